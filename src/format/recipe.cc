// FP8/FP4 recipes by name, as JSON and as FlatBuffers tables (src/format/recipe.hpp,
// src/format/recipe_table.hpp).
#include "format/recipe.hpp"

#include <limits>
#include <string>
#include <utility>

#include "base/util.hpp"
#include "format/footer.hpp"
#include "format/recipe_table.hpp"

namespace ferry::format {

namespace {

template <typename E>
struct Named {
  const char* name;
  E value;
};
constexpr Named<Fp8Format> kFp8Formats[] = {
    {"E4M3", Fp8Format::kE4M3}, {"E5M2", Fp8Format::kE5M2}, {"HYBRID", Fp8Format::kHybrid}};
constexpr Named<AmaxComputeAlgo> kAlgos[] = {{"max", AmaxComputeAlgo::kMax},
                                             {"most_recent", AmaxComputeAlgo::kMostRecent}};
// In the order of Recipe's alternatives.
constexpr const char* kRecipeNames[] = {"none",
                                        "DelayedScaling",
                                        "Float8CurrentScaling",
                                        "MXFP8BlockScaling",
                                        "Float8BlockScaling",
                                        "NVFP4BlockScaling",
                                        "CustomRecipe"};
static_assert(std::size(kRecipeNames) == std::variant_size_v<Recipe>);

template <typename E, size_t N>
const char* NameOf(const Named<E> (&table)[N], E value) {
  for (const auto& n : table) {
    if (n.value == value) return n.name;
  }
  return "?";
}

template <typename E, size_t N>
std::optional<E> ValueOf(const Named<E> (&table)[N], std::string_view name) {
  for (const auto& n : table) {
    if (name == n.name) return n.value;
  }
  return std::nullopt;
}

template <size_t... I>
Recipe DefaultOf(size_t index, std::index_sequence<I...>) {
  Recipe r;
  ((index == I ? (r.emplace<I>(), 0) : 0), ...);
  return r;
}

using Kind = RecipeField::Kind;
using Json = nlohmann::ordered_json;

// One field of `j` into `f`; the reason when it is missing or of the wrong type.
std::optional<std::string> ReadField(const Json& j, const RecipeField& f) {
  auto it = j.find(f.name);
  if (it == j.end()) return StrCat("missing \"", f.name, "\"");
  const Json& v = *it;
  switch (f.kind) {
    case Kind::kInt32:
      if (!v.is_number_integer() || v.get<int64_t>() < std::numeric_limits<int32_t>::min() ||
          v.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
        return StrCat("\"", f.name, "\" is not a 32-bit integer");
      }
      *static_cast<int32_t*>(f.value) = static_cast<int32_t>(v.get<int64_t>());
      return std::nullopt;
    case Kind::kBool:
      if (!v.is_boolean()) return StrCat("\"", f.name, "\" is not a boolean");
      *static_cast<bool*>(f.value) = v.get<bool>();
      return std::nullopt;
    case Kind::kString:
      if (!v.is_string()) return StrCat("\"", f.name, "\" is not a string");
      *static_cast<std::string*>(f.value) = v.get<std::string>();
      return std::nullopt;
    case Kind::kFp8Format:
    case Kind::kAmaxComputeAlgo: {
      if (!v.is_string()) return StrCat("\"", f.name, "\" is not a string");
      const std::string s = v.get<std::string>();
      bool known;
      if (f.kind == Kind::kFp8Format) {
        auto e = Fp8FormatNamed(s);
        if ((known = e.has_value())) *static_cast<Fp8Format*>(f.value) = *e;
      } else {
        auto e = AmaxComputeAlgoNamed(s);
        if ((known = e.has_value())) *static_cast<AmaxComputeAlgo*>(f.value) = *e;
      }
      if (!known) return StrCat("\"", f.name, "\" has the unknown value ", Quote(s));
      return std::nullopt;
    }
  }
  return std::nullopt;
}

}  // namespace

const char* RecipeName(const Recipe& recipe) { return kRecipeNames[recipe.index()]; }

std::optional<Recipe> RecipeNamed(std::string_view name) {
  for (size_t i = 0; i < std::size(kRecipeNames); ++i) {
    if (name == kRecipeNames[i]) {
      return DefaultOf(i, std::make_index_sequence<std::variant_size_v<Recipe>>());
    }
  }
  return std::nullopt;
}

const char* Fp8FormatName(Fp8Format f) { return NameOf(kFp8Formats, f); }
std::optional<Fp8Format> Fp8FormatNamed(std::string_view name) {
  return ValueOf(kFp8Formats, name);
}
const char* AmaxComputeAlgoName(AmaxComputeAlgo a) { return NameOf(kAlgos, a); }
std::optional<AmaxComputeAlgo> AmaxComputeAlgoNamed(std::string_view name) {
  return ValueOf(kAlgos, name);
}

std::vector<RecipeField> RecipeFields(Recipe& recipe) {
  struct Visitor {
    std::vector<RecipeField> operator()(std::monostate&) { return {}; }
    std::vector<RecipeField> operator()(DelayedScaling& r) {
      return {{"margin", Kind::kInt32, &r.margin},
              {"fp8_format", Kind::kFp8Format, &r.fp8_format},
              {"amax_history_len", Kind::kInt32, &r.amax_history_len},
              {"amax_compute_algo", Kind::kAmaxComputeAlgo, &r.amax_compute_algo},
              {"reduce_amax", Kind::kBool, &r.reduce_amax},
              {"fp8_dpa", Kind::kBool, &r.fp8_dpa},
              {"fp8_mha", Kind::kBool, &r.fp8_mha}};
    }
    std::vector<RecipeField> operator()(Float8CurrentScaling& r) {
      return {{"fp8_format", Kind::kFp8Format, &r.fp8_format},
              {"fp8_dpa", Kind::kBool, &r.fp8_dpa},
              {"fp8_mha", Kind::kBool, &r.fp8_mha}};
    }
    std::vector<RecipeField> operator()(MXFP8BlockScaling& r) {
      return {{"fp8_format", Kind::kFp8Format, &r.fp8_format}};
    }
    std::vector<RecipeField> operator()(Float8BlockScaling& r) {
      return {{"fp8_format", Kind::kFp8Format, &r.fp8_format},
              {"x_block_scaling_dim", Kind::kInt32, &r.x_block_scaling_dim},
              {"w_block_scaling_dim", Kind::kInt32, &r.w_block_scaling_dim},
              {"grad_block_scaling_dim", Kind::kInt32, &r.grad_block_scaling_dim}};
    }
    std::vector<RecipeField> operator()(NVFP4BlockScaling& r) {
      return {{"disable_rht", Kind::kBool, &r.disable_rht},
              {"disable_stochastic_rounding", Kind::kBool, &r.disable_stochastic_rounding},
              {"disable_2d_quantization", Kind::kBool, &r.disable_2d_quantization}};
    }
    std::vector<RecipeField> operator()(CustomRecipe& r) {
      return {{"name", Kind::kString, &r.name}, {"qfactory", Kind::kString, &r.qfactory}};
    }
  };
  return std::visit(Visitor{}, recipe);
}

Json RecipeToJson(const Recipe& recipe) {
  Json j = Json::object();
  j["type"] = RecipeName(recipe);
  Recipe copy = recipe;
  for (const RecipeField& f : RecipeFields(copy)) {
    switch (f.kind) {
      case Kind::kInt32:
        j[f.name] = *static_cast<const int32_t*>(f.value);
        break;
      case Kind::kBool:
        j[f.name] = *static_cast<const bool*>(f.value);
        break;
      case Kind::kString:
        j[f.name] = *static_cast<const std::string*>(f.value);
        break;
      case Kind::kFp8Format:
        j[f.name] = Fp8FormatName(*static_cast<const Fp8Format*>(f.value));
        break;
      case Kind::kAmaxComputeAlgo:
        j[f.name] = AmaxComputeAlgoName(*static_cast<const AmaxComputeAlgo*>(f.value));
        break;
    }
  }
  return j;
}

Result<Recipe> RecipeFromJson(const Json& j) {
  if (!j.is_object()) return Error(StatusCode::kInvalidArgument, "expected an object");
  auto type = j.find("type");
  if (type == j.end()) return Error(StatusCode::kInvalidArgument, "missing \"type\"");
  if (!type->is_string()) return Error(StatusCode::kInvalidArgument, "\"type\" is not a string");
  const std::string name = type->get<std::string>();
  std::optional<Recipe> recipe = RecipeNamed(name);
  if (!recipe) return Error(StatusCode::kInvalidArgument, "unknown recipe type ", Quote(name));
  for (const RecipeField& f : RecipeFields(*recipe)) {
    if (auto bad = ReadField(j, f)) return Status(StatusCode::kInvalidArgument, *bad);
  }
  return *recipe;
}

// ---- FlatBuffers ----------------------------------------------------------------------------

namespace {
bool ValidFp8Format(fb::Fp8Format f) { return static_cast<uint8_t>(f) <= 2; }
}  // namespace

std::string CheckRecipeTable(const fb::ScalingState* s) {
  switch (s->recipe_type()) {
    case fb::Recipe::NONE:
      return {};
    case fb::Recipe::DelayedScaling: {
      auto* r = s->recipe_as_DelayedScaling();
      if (r == nullptr) return "missing recipe table";
      if (!ValidFp8Format(r->fp8_format()) || static_cast<uint8_t>(r->amax_compute_algo()) > 1) {
        return "DelayedScaling has an unknown enum value";
      }
      return {};
    }
    case fb::Recipe::Float8CurrentScaling: {
      auto* r = s->recipe_as_Float8CurrentScaling();
      if (r == nullptr || !ValidFp8Format(r->fp8_format())) return "bad Float8CurrentScaling";
      return {};
    }
    case fb::Recipe::MXFP8BlockScaling: {
      auto* r = s->recipe_as_MXFP8BlockScaling();
      if (r == nullptr || !ValidFp8Format(r->fp8_format())) return "bad MXFP8BlockScaling";
      return {};
    }
    case fb::Recipe::Float8BlockScaling: {
      auto* r = s->recipe_as_Float8BlockScaling();
      if (r == nullptr || !ValidFp8Format(r->fp8_format())) return "bad Float8BlockScaling";
      return {};
    }
    case fb::Recipe::NVFP4BlockScaling:
      if (s->recipe_as_NVFP4BlockScaling() == nullptr) return "bad NVFP4";
      return {};
    case fb::Recipe::CustomRecipe:
      if (s->recipe_as_CustomRecipe() == nullptr) return "bad CustomRecipe";
      return {};
    default:
      return StrCat("unknown recipe type ", static_cast<int>(s->recipe_type()));
  }
}

Recipe RecipeFromTable(const fb::ScalingState* s) {
  switch (s->recipe_type()) {
    case fb::Recipe::DelayedScaling: {
      auto* r = s->recipe_as_DelayedScaling();
      DelayedScaling d;
      d.margin = r->margin();
      d.fp8_format = static_cast<Fp8Format>(r->fp8_format());
      d.amax_history_len = r->amax_history_len();
      d.amax_compute_algo = static_cast<AmaxComputeAlgo>(r->amax_compute_algo());
      d.reduce_amax = r->reduce_amax();
      d.fp8_dpa = r->fp8_dpa();
      d.fp8_mha = r->fp8_mha();
      return d;
    }
    case fb::Recipe::Float8CurrentScaling: {
      auto* r = s->recipe_as_Float8CurrentScaling();
      return Float8CurrentScaling{static_cast<Fp8Format>(r->fp8_format()), r->fp8_dpa(),
                                  r->fp8_mha()};
    }
    case fb::Recipe::MXFP8BlockScaling:
      return MXFP8BlockScaling{
          static_cast<Fp8Format>(s->recipe_as_MXFP8BlockScaling()->fp8_format())};
    case fb::Recipe::Float8BlockScaling: {
      auto* r = s->recipe_as_Float8BlockScaling();
      return Float8BlockScaling{static_cast<Fp8Format>(r->fp8_format()), r->x_block_scaling_dim(),
                                r->w_block_scaling_dim(), r->grad_block_scaling_dim()};
    }
    case fb::Recipe::NVFP4BlockScaling: {
      auto* r = s->recipe_as_NVFP4BlockScaling();
      return NVFP4BlockScaling{r->disable_rht(), r->disable_stochastic_rounding(),
                               r->disable_2d_quantization()};
    }
    case fb::Recipe::CustomRecipe: {
      auto* r = s->recipe_as_CustomRecipe();
      return CustomRecipe{std::string(Sv(r->name())), std::string(Sv(r->qfactory()))};
    }
    default:
      return std::monostate{};
  }
}

std::pair<fb::Recipe, flatbuffers::Offset<void>> RecipeToTable(flatbuffers::FlatBufferBuilder& b,
                                                               const Recipe& recipe) {
  using Out = std::pair<fb::Recipe, flatbuffers::Offset<void>>;
  struct Visitor {
    flatbuffers::FlatBufferBuilder& b;
    Out operator()(std::monostate) { return {fb::Recipe::NONE, 0}; }
    Out operator()(const DelayedScaling& r) {
      return {fb::Recipe::DelayedScaling,
              fb::CreateDelayedScaling(b, r.margin, static_cast<fb::Fp8Format>(r.fp8_format),
                                       r.amax_history_len,
                                       static_cast<fb::AmaxComputeAlgo>(r.amax_compute_algo),
                                       r.reduce_amax, r.fp8_dpa, r.fp8_mha)
                  .Union()};
    }
    Out operator()(const Float8CurrentScaling& r) {
      return {fb::Recipe::Float8CurrentScaling,
              fb::CreateFloat8CurrentScaling(b, static_cast<fb::Fp8Format>(r.fp8_format), r.fp8_dpa,
                                             r.fp8_mha)
                  .Union()};
    }
    Out operator()(const MXFP8BlockScaling& r) {
      return {fb::Recipe::MXFP8BlockScaling,
              fb::CreateMXFP8BlockScaling(b, static_cast<fb::Fp8Format>(r.fp8_format)).Union()};
    }
    Out operator()(const Float8BlockScaling& r) {
      return {fb::Recipe::Float8BlockScaling,
              fb::CreateFloat8BlockScaling(b, static_cast<fb::Fp8Format>(r.fp8_format),
                                           r.x_block_scaling_dim, r.w_block_scaling_dim,
                                           r.grad_block_scaling_dim)
                  .Union()};
    }
    Out operator()(const NVFP4BlockScaling& r) {
      return {fb::Recipe::NVFP4BlockScaling,
              fb::CreateNVFP4BlockScaling(b, r.disable_rht, r.disable_stochastic_rounding,
                                          r.disable_2d_quantization)
                  .Union()};
    }
    Out operator()(const CustomRecipe& r) {
      auto name = b.CreateString(r.name);
      auto qf = r.qfactory.empty() ? 0 : b.CreateString(r.qfactory);
      return {fb::Recipe::CustomRecipe, fb::CreateCustomRecipe(b, name, qf).Union()};
    }
  };
  return std::visit(Visitor{b}, recipe);
}

}  // namespace ferry::format
