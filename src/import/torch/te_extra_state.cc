// TransformerEngine extra state to ScalingState; see te_extra_state.hpp.
#include "import/torch/te_extra_state.hpp"

#include <cmath>
#include <nlohmann/json.hpp>

#include "base/util.hpp"
#include "format/recipe.hpp"
#include "import/torch/torch_checkpoint.hpp"

namespace ferry::torch_import {

namespace {

using Kind = Value::Kind;

const Value* Field(const Value* obj, std::string_view name) {
  if (obj == nullptr || !obj->is(Kind::kObject) || obj->state == nullptr) return nullptr;
  const Value* st = obj->state;
  if (st->is(Kind::kTuple) && st->items.size() == 2) st = st->items[1];
  return st->is(Kind::kDict) ? st->Get(name) : nullptr;
}

std::optional<double> Number(const Value* v) {
  if (v == nullptr) return std::nullopt;
  if (v->is(Kind::kInt)) return static_cast<double>(v->i);
  if (v->is(Kind::kFloat)) return v->f;
  return std::nullopt;
}

// A Format member: Format(_FormatHelper(max_fwd, max_bwd)) as REDUCE/NEWOBJ arguments, or
// the member pickled by its qualified name.
Result<Fp8Format> ReadFormat(const Value* v, const std::string& where) {
  if (v != nullptr && v->is(Kind::kGlobal)) {
    const size_t dot = v->s.rfind("Format.");
    auto f = dot == std::string::npos ? std::nullopt : format::Fp8FormatNamed(v->s.substr(dot + 7));
    if (f) return *f;
  }
  if (v != nullptr && v->is(Kind::kStr)) {
    if (auto f = format::Fp8FormatNamed(v->s)) return *f;
  }
  if (v != nullptr && v->is(Kind::kObject) && v->ShortClass() == "Format" &&
      v->Elements().size() == 1) {
    const Value* h = v->Elements()[0];
    if ((h->is(Kind::kObject) || h->is(Kind::kTuple)) && h->Elements().size() >= 2) {
      auto fwd = Number(h->Elements()[0]), bwd = Number(h->Elements()[1]);
      if (fwd && bwd) {
        if (*fwd == 448 && *bwd == 448) return Fp8Format::kE4M3;
        if (*fwd == 57344 && *bwd == 57344) return Fp8Format::kE5M2;
        if (*fwd == 448 && *bwd == 57344) return Fp8Format::kHybrid;
      }
    }
  }
  return Error(StatusCode::kUnimplemented, where,
               ": recipe fp8_format is not E4M3, E5M2 or HYBRID");
}

// One field of a pickled recipe into `f`; a field TransformerEngine did not pickle keeps its
// default.
Status ReadRecipeField(const Value* v, const format::RecipeField& f, const std::string& where) {
  using FieldKind = format::RecipeField::Kind;
  switch (f.kind) {
    case FieldKind::kInt32:
      if (!v->is(Kind::kInt) || v->i < INT32_MIN || v->i > INT32_MAX) {
        return Error(StatusCode::kDataLoss, where, ": recipe field ", f.name, " is not an int32");
      }
      *static_cast<int32_t*>(f.value) = static_cast<int32_t>(v->i);
      return Status::Ok();
    case FieldKind::kBool:
      if (!v->is(Kind::kBool)) {
        return Error(StatusCode::kDataLoss, where, ": recipe field ", f.name, " is not a bool");
      }
      *static_cast<bool*>(f.value) = v->b;
      return Status::Ok();
    case FieldKind::kFp8Format: {
      FERRY_ASSIGN_OR_RETURN(*static_cast<Fp8Format*>(f.value), ReadFormat(v, where));
      return Status::Ok();
    }
    case FieldKind::kAmaxComputeAlgo: {
      auto algo = v->is_str() ? format::AmaxComputeAlgoNamed(v->s) : std::nullopt;
      if (!algo) {
        return Error(StatusCode::kUnimplemented, where,
                     ": amax_compute_algo is neither 'max' nor 'most_recent'");
      }
      *static_cast<AmaxComputeAlgo*>(f.value) = *algo;
      return Status::Ok();
    }
    case FieldKind::kString:
      break;
  }
  return Error(StatusCode::kDataLoss, where, ": recipe field ", f.name, " is not a string");
}

Result<Recipe> ReadRecipe(const Value* r, const std::string& where) {
  if (r == nullptr || r->is(Kind::kNone)) return Recipe{};
  if (!r->is(Kind::kObject) || !r->s.starts_with("transformer_engine.common.recipe.")) {
    return Error(StatusCode::kDataLoss, where, ": recipe is a ", r->s.empty() ? "value" : r->s,
                 ", not a TransformerEngine recipe");
  }
  const std::string kind = r->ShortClass();
  // TransformerEngine's qfactory is a callable, never kept: a custom recipe is known by name.
  if (kind == "CustomRecipe") return Recipe{CustomRecipe{"CustomRecipe", ""}};
  std::optional<Recipe> recipe = kind == "none" ? std::nullopt : format::RecipeNamed(kind);
  if (!recipe) return Error(StatusCode::kUnimplemented, where, ": unknown recipe ", r->s);
  for (const format::RecipeField& f : format::RecipeFields(*recipe)) {
    if (const Value* v = Field(r, f.name)) FERRY_RETURN_IF_ERROR(ReadRecipeField(v, f, where));
  }
  return *recipe;
}

// The float32 values of a tensor of the extra state.
Result<std::vector<float>> Floats(const Value* v, const Mapping* mapping, const std::string& what,
                                  WalkBudget* budget) {
  if (v == nullptr || !v->is(Kind::kTensor)) {
    return Error(StatusCode::kDataLoss, what, " is not a tensor");
  }
  const TensorRef& t = *v->tensor;
  if (t.dtype.name != "float32") {
    return Error(StatusCode::kUnimplemented, what, " is torch.", t.dtype.name, ", not float32");
  }
  if (!budget->Take(TensorBytes(t))) return budget->Exhausted(what);
  std::vector<float> out(TensorBytes(t) / 4);
  FERRY_RETURN_IF_ERROR(
      CopyTensorBytes(t, 0, reinterpret_cast<uint8_t*>(out.data()), out.size() * 4, mapping, what));
  return out;
}

Result<DirectionState> ReadDirection(const Value* dict, bool forward, int32_t num_gemms,
                                     const Mapping* mapping, const std::string& where,
                                     WalkBudget* budget) {
  const char* sfx = forward ? "fwd" : "bwd";
  const Value* scale_v = dict->Get(StrCat("scale_", sfx));
  const Value* hist_v = dict->Get(StrCat("amax_history_", sfx));
  FERRY_ASSIGN_OR_RETURN(auto scale,
                         Floats(scale_v, mapping, StrCat(where, ": scale_", sfx), budget));
  FERRY_ASSIGN_OR_RETURN(auto hist,
                         Floats(hist_v, mapping, StrCat(where, ": amax_history_", sfx), budget));
  const TensorRef& h = *hist_v->tensor;
  const size_t s = scale.size();
  const int per = forward ? 3 : 2;
  if (num_gemms <= 0) num_gemms = static_cast<int32_t>(s / per);
  if (s != static_cast<size_t>(per) * static_cast<size_t>(num_gemms)) {
    return Error(StatusCode::kDataLoss, where, ": scale_", sfx, " has ", s, " entries, not ", per,
                 " x num_gemms (", num_gemms, ")");
  }
  if (h.shape.size() != 2 || static_cast<size_t>(h.shape[1]) != s) {
    return Error(StatusCode::kDataLoss, where, ": amax_history_", sfx, " is not [L, ", s, "]");
  }
  DirectionState d;
  d.direction = forward ? Direction::kForward : Direction::kBackward;
  d.num_gemms = num_gemms;
  for (int32_t g = 0; g < num_gemms; ++g) {
    if (forward) {
      d.slot_roles.insert(d.slot_roles.end(),
                          {SlotRole::kInput, SlotRole::kWeight, SlotRole::kOutput});
    } else {
      d.slot_roles.insert(d.slot_roles.end(), {SlotRole::kGradOutput, SlotRole::kGradInput});
    }
  }
  d.scale = std::move(scale);
  d.amax_history = std::move(hist);
  d.history_len = static_cast<int32_t>(h.shape[0]);
  return d;
}

// Plain values of extra_fp8_variables as JSON; nullopt for anything else, and when `budget`
// runs out (then *exhausted is set): a list holding the same list twice, nested, is
// exponentially many nodes.
std::optional<nlohmann::json> PlainJson(const Value* v, int depth, WalkBudget* budget,
                                        bool* exhausted) {
  if (depth > 8) return std::nullopt;
  // A node costs about what it occupies: the json value, its slot in the parent and, for a
  // list, the vector behind it (64 bytes).
  if (!budget->Take(64 + (v->is_str() ? v->s.size() : 0))) {
    *exhausted = true;
    return std::nullopt;
  }
  switch (v->kind) {
    case Kind::kNone:
      return nlohmann::json(nullptr);
    case Kind::kBool:
      return nlohmann::json(v->b);
    case Kind::kInt:
      return nlohmann::json(v->i);
    case Kind::kFloat:
      if (!std::isfinite(v->f)) return std::nullopt;
      return nlohmann::json(v->f);
    case Kind::kStr:
      return nlohmann::json(v->s);
    case Kind::kTuple:
    case Kind::kList: {
      nlohmann::json a = nlohmann::json::array();
      for (const Value* x : v->items) {
        auto j = PlainJson(x, depth + 1, budget, exhausted);
        if (!j) return std::nullopt;
        a.push_back(*j);
      }
      return a;
    }
    default:
      return std::nullopt;
  }
}

}  // namespace

Result<ScalingState> DecodeExtraState(Heap* heap, const Value* v, const std::string& module,
                                      const Mapping* mapping, const std::string& where,
                                      std::vector<std::pair<std::string, std::string>>* metadata,
                                      WalkBudget* budget) {
  ScalingState out;
  out.module = module;
  // Unwrap the container forms down to the dict (or None).
  if (v->is(Kind::kTensor)) {
    const TensorRef& t = *v->tensor;
    if (t.dtype.name != "uint8" && t.dtype.name != "int8") {
      return Error(StatusCode::kDataLoss, where, ": extra state is a torch.", t.dtype.name,
                   " tensor, not bytes");
    }
    uint64_t n = TensorBytes(t);
    if (n == 0) return out;  // a module with no FP8 state
    if (!budget->Take(n)) return budget->Exhausted(where);
    Value* bytes = heap->New(Kind::kBytes);
    bytes->s.resize(n);
    FERRY_RETURN_IF_ERROR(
        CopyTensorBytes(t, 0, reinterpret_cast<uint8_t*>(bytes->s.data()), n, mapping, where));
    UnpickleOptions o;
    o.where = StrCat(where, " (pickled extra state)");
    FERRY_ASSIGN_OR_RETURN(v,
                           Unpickle(heap, reinterpret_cast<const uint8_t*>(bytes->s.data()), n, o));
    mapping = nullptr;
  } else if (v->is(Kind::kObject) && v->global == Global::kBytesIO) {
    // io.BytesIO state: (bytes, position, __dict__)
    const Value* st = v->state;
    if (st == nullptr || !st->is(Kind::kTuple) || st->items.empty() ||
        !st->items[0]->is(Kind::kBytes)) {
      return Error(StatusCode::kDataLoss, where, ": io.BytesIO extra state without its bytes");
    }
    const std::string& b = st->items[0]->s;
    if (!budget->Take(b.size())) return budget->Exhausted(where);
    FERRY_ASSIGN_OR_RETURN(v, LoadTorchZip(heap, reinterpret_cast<const uint8_t*>(b.data()),
                                           b.size(), StrCat(where, " (io.BytesIO extra state)")));
    mapping = nullptr;
  }
  if (v->is(Kind::kNone)) return out;
  if (v->is(Kind::kList) && v->items.size() == 4) {
    // TransformerEngine 0.2 and older: [scale_fwd, amax_history_fwd, scale_bwd, amax_history_bwd]
    Value* d = heap->New(Kind::kDict);
    const char* keys[] = {"scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"};
    for (int k = 0; k < 4; ++k) {
      Value* key = heap->New(Kind::kStr);
      key->s = keys[k];
      d->dict.emplace_back(key, v->items[k]);
    }
    v = d;
  }
  if (!v->is(Kind::kDict)) {
    return Error(StatusCode::kDataLoss, where,
                 ": extra state is neither a tensor, io.BytesIO, "
                 "dict nor None");
  }
  FERRY_ASSIGN_OR_RETURN(out.recipe, ReadRecipe(v->Get("recipe"), where));
  int32_t num_gemms = 0;
  const Value* extra = v->Get("extra_fp8_variables");
  if (extra != nullptr && extra->is(Kind::kDict)) {
    if (const Value* n = extra->Get("num_gemms");
        n && n->is(Kind::kInt) && n->i > 0 && n->i < (1 << 20)) {
      num_gemms = static_cast<int32_t>(n->i);
    }
    nlohmann::json j = nlohmann::json::object();
    bool exhausted = false;
    for (const auto& [k, x] : extra->dict) {
      if (!k->is_str()) continue;
      if (!budget->Take(k->s.size())) return budget->Exhausted(where);
      if (auto pj = PlainJson(x, 0, budget, &exhausted)) j[k->s] = *pj;
      if (exhausted) return budget->Exhausted(where);
    }
    if (!j.empty()) {
      std::string text = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      if (!budget->Take(text.size())) return budget->Exhausted(where);
      metadata->emplace_back(kExtraVariablesKeyPrefix + module, std::move(text));
    }
  }
  if (v->Get("scale_fwd") != nullptr) {
    FERRY_ASSIGN_OR_RETURN(auto d, ReadDirection(v, true, num_gemms, mapping, where, budget));
    out.states.push_back(std::move(d));
  }
  if (v->Get("scale_bwd") != nullptr) {
    FERRY_ASSIGN_OR_RETURN(auto d, ReadDirection(v, false, num_gemms, mapping, where, budget));
    out.states.push_back(std::move(d));
  }
  return out;
}

}  // namespace ferry::torch_import
