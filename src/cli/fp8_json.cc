// FP8/FP4 descriptions to and from JSON.
#include "fp8_json.hpp"

#include <cmath>
#include <limits>
#include <utility>

#include "base/strict_json.hpp"
#include "base/util.hpp"
#include "format/recipe.hpp"

namespace ferry::cli {

namespace {

template <typename E>
struct Named {
  const char* name;
  E value;
};

constexpr Named<ScalingMode> kScalingModes[] = {{"per-tensor", ScalingMode::kPerTensor},
                                                {"mxfp8-1x32", ScalingMode::kMxfp8_1x32},
                                                {"block-1x128", ScalingMode::kBlock_1x128},
                                                {"block-128x128", ScalingMode::kBlock_128x128},
                                                {"nvfp4-1x16", ScalingMode::kNvfp4_1x16}};
constexpr Named<SlotRole> kSlotRoles[] = {{"input", SlotRole::kInput},
                                          {"weight", SlotRole::kWeight},
                                          {"output", SlotRole::kOutput},
                                          {"grad_output", SlotRole::kGradOutput},
                                          {"grad_input", SlotRole::kGradInput}};
constexpr Named<Direction> kDirections[] = {{"forward", Direction::kForward},
                                            {"backward", Direction::kBackward}};
constexpr Named<ScaleLayout> kLayouts[] = {{"row-major", ScaleLayout::kRowMajor},
                                           {"swizzled", ScaleLayout::kSwizzled}};

template <typename E, size_t N>
const char* NameOf(const Named<E> (&table)[N], E value) {
  for (const auto& n : table) {
    if (n.value == value) return n.name;
  }
  return "?";
}

// Parse failures unwind to the public entry points, which turn them into a Status: the
// descriptions nest several levels deep, and threading a Status through each would hide
// the little logic there is.
struct Bad {
  std::string what;
};

const Json& Field(const Json& j, const char* key) {
  if (!j.is_object()) throw Bad{"expected an object"};
  auto it = j.find(key);
  if (it == j.end()) throw Bad{StrCat("missing \"", key, "\"")};
  return *it;
}

std::string String(const Json& j, const char* key) {
  const Json& v = Field(j, key);
  if (!v.is_string()) throw Bad{StrCat("\"", key, "\" is not a string")};
  return v.get<std::string>();
}

// A string that may be null (an absent component tensor).
std::string OptionalString(const Json& j, const char* key) {
  const Json& v = Field(j, key);
  if (v.is_null()) return {};
  if (!v.is_string()) throw Bad{StrCat("\"", key, "\" is not a string or null")};
  return v.get<std::string>();
}

bool Bool(const Json& j, const char* key) {
  const Json& v = Field(j, key);
  if (!v.is_boolean()) throw Bad{StrCat("\"", key, "\" is not a boolean")};
  return v.get<bool>();
}

int32_t Int(const Json& j, const char* key) {
  const Json& v = Field(j, key);
  if (!v.is_number_integer() || v.get<int64_t>() < std::numeric_limits<int32_t>::min() ||
      v.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
    throw Bad{StrCat("\"", key, "\" is not a 32-bit integer")};
  }
  return static_cast<int32_t>(v.get<int64_t>());
}

template <typename E, size_t N>
E Enum(const Json& j, const char* key, const Named<E> (&table)[N]) {
  std::string s = String(j, key);
  for (const auto& n : table) {
    if (s == n.name) return n.value;
  }
  throw Bad{StrCat("\"", key, "\" has the unknown value ", Quote(s))};
}

DType DTypeField(const Json& j, const char* key) {
  std::string s = String(j, key);
  auto d = ParseDType(s);
  if (!d) throw Bad{StrCat("\"", key, "\" names the unknown dtype ", Quote(s))};
  return *d;
}

Json FloatsJson(const std::vector<float>& v) {
  Json out = Json::array();
  for (float f : v) {
    if (std::isnan(f)) {
      out.push_back("nan");
    } else if (std::isinf(f)) {
      out.push_back(f > 0 ? "inf" : "-inf");
    } else {
      out.push_back(static_cast<double>(f));
    }
  }
  return out;
}

std::vector<float> Floats(const Json& j, const char* key) {
  const Json& v = Field(j, key);
  if (!v.is_array()) throw Bad{StrCat("\"", key, "\" is not an array")};
  std::vector<float> out;
  out.reserve(v.size());
  for (const Json& e : v) {
    if (e.is_number()) {
      out.push_back(static_cast<float>(e.get<double>()));
    } else if (e == "nan") {
      out.push_back(std::numeric_limits<float>::quiet_NaN());
    } else if (e == "inf" || e == "-inf") {
      float inf = std::numeric_limits<float>::infinity();
      out.push_back(e == "inf" ? inf : -inf);
    } else {
      throw Bad{StrCat("\"", key, "\" holds ", e.dump(), ", not a number")};
    }
  }
  return out;
}

std::vector<int64_t> Shape(const Json& j, const char* key) {
  const Json& v = Field(j, key);
  if (!v.is_array()) throw Bad{StrCat("\"", key, "\" is not an array")};
  std::vector<int64_t> out;
  for (const Json& e : v) {
    if (!e.is_number_integer() || e.get<int64_t>() < 0) {
      throw Bad{StrCat("\"", key, "\" holds ", e.dump(), ", not a non-negative integer")};
    }
    out.push_back(e.get<int64_t>());
  }
  return out;
}

Json ComponentJson(const std::optional<QuantizedComponent>& c) {
  if (!c) return nullptr;
  Json j = Json::object();
  j["data"] = c->data;
  j["scale_inv"] = c->scale_inv.empty() ? Json(nullptr) : Json(c->scale_inv);
  j["scale_layout"] = NameOf(kLayouts, c->scale_layout);
  j["amax"] = c->amax.empty() ? Json(nullptr) : Json(c->amax);
  return j;
}

std::optional<QuantizedComponent> ComponentFrom(const Json& j, const char* key) {
  const Json& v = Field(j, key);
  if (v.is_null()) return std::nullopt;
  QuantizedComponent c;
  c.data = String(v, "data");
  c.scale_inv = OptionalString(v, "scale_inv");
  c.scale_layout = Enum(v, "scale_layout", kLayouts);
  c.amax = OptionalString(v, "amax");
  return c;
}

Recipe RecipeFrom(const Json& j) {
  auto recipe = format::RecipeFromJson(j);
  if (!recipe.ok()) throw Bad{recipe.status().message()};
  return *std::move(recipe);
}

}  // namespace

const char* ScalingModeName(ScalingMode m) { return NameOf(kScalingModes, m); }
const char* SlotRoleName(SlotRole r) { return NameOf(kSlotRoles, r); }
const char* DirectionName(Direction d) { return NameOf(kDirections, d); }

Json RecipeJson(const Recipe& recipe) { return format::RecipeToJson(recipe); }

std::string RecipeText(const Recipe& recipe) {
  Json j = RecipeJson(recipe);
  std::string out = j["type"].get<std::string>();
  if (j.size() == 1) return out;
  out += "(";
  bool first = true;
  for (const auto& [k, v] : j.items()) {
    if (k == "type") continue;
    if (!first) out += ", ";
    first = false;
    out += k + "=" + (v.is_string() ? v.get<std::string>() : v.dump());
  }
  return out + ")";
}

Json QuantizedJson(const QuantizedTensor& q) {
  Json e = Json::object();
  e["name"] = q.name;
  e["quantized_dtype"] = DTypeName(q.quantized_dtype);
  e["logical_dtype"] = DTypeName(q.logical_dtype);
  e["shape"] = q.shape;
  e["scaling_mode"] = ScalingModeName(q.scaling_mode);
  e["rowwise"] = ComponentJson(q.rowwise);
  e["columnwise"] = ComponentJson(q.columnwise);
  return e;
}

Json ScalingJson(const ScalingState& s) {
  Json e = Json::object();
  e["module"] = s.module;
  e["recipe"] = RecipeJson(s.recipe);
  Json states = Json::array();
  for (const DirectionState& d : s.states) {
    Json ds = Json::object();
    ds["direction"] = DirectionName(d.direction);
    ds["num_gemms"] = d.num_gemms;
    Json roles = Json::array();
    for (SlotRole r : d.slot_roles) roles.push_back(SlotRoleName(r));
    ds["slot_roles"] = std::move(roles);
    ds["scale"] = FloatsJson(d.scale);
    ds["history_len"] = d.history_len;
    ds["amax_history"] = FloatsJson(d.amax_history);
    states.push_back(std::move(ds));
  }
  e["states"] = std::move(states);
  return e;
}

Status ParseFp8Json(const std::string& text, Json* out) {
  StrictJsonOptions options;
  // list > scaling state > states > direction state > slot roles: 5; a little room.
  options.max_depth = 8;
  options.max_keys = 64;
  options.too_deep = "nests deeper than an FP8 description can";
  if (auto error = ParseStrictJson(text.data(), text.data() + text.size(), options, out)) {
    return Status(StatusCode::kInvalidArgument, *error);
  }
  return Status::Ok();
}

Fp8Metadata DescribeFp8Metadata(std::vector<std::pair<std::string, std::string>> metadata) {
  Fp8Metadata out;
  for (auto& [key, value] : metadata) {
    bool quantized = key == kQuantizedKey;
    if (!quantized && key != kScalingKey) {
      out.metadata.emplace_back(std::move(key), std::move(value));
      continue;
    }
    Json list;
    Status st = ParseFp8Json(value, &list);
    std::vector<QuantizedTensor> qs;
    std::vector<ScalingState> ss;
    if (st.ok() && !list.is_array()) st = Status(StatusCode::kInvalidArgument, "not a JSON array");
    for (size_t i = 0; st.ok() && i < list.size(); ++i) {
      if (quantized) {
        auto q = QuantizedFromJson(list[i]);
        if (q.ok()) qs.push_back(std::move(*q));
        st = q.status();
      } else {
        auto sc = ScalingFromJson(list[i]);
        if (sc.ok()) ss.push_back(std::move(*sc));
        st = sc.status();
      }
    }
    if (!st.ok()) {
      out.kept.emplace_back(key, st.message());
      out.metadata.emplace_back(std::move(key), std::move(value));
      continue;
    }
    for (auto& q : qs) out.quantized.push_back(std::move(q));
    for (auto& sc : ss) out.scaling.push_back(std::move(sc));
  }
  return out;
}

Result<QuantizedTensor> QuantizedFromJson(const Json& j) {
  try {
    QuantizedTensor q;
    q.name = String(j, "name");
    q.quantized_dtype = DTypeField(j, "quantized_dtype");
    q.logical_dtype = DTypeField(j, "logical_dtype");
    q.shape = Shape(j, "shape");
    q.scaling_mode = Enum(j, "scaling_mode", kScalingModes);
    q.rowwise = ComponentFrom(j, "rowwise");
    q.columnwise = ComponentFrom(j, "columnwise");
    return q;
  } catch (const Bad& b) {
    return Error(StatusCode::kInvalidArgument, "quantized tensor: ", b.what);
  } catch (const std::exception& e) {
    return Error(StatusCode::kInvalidArgument, "quantized tensor: ", e.what());
  }
}

Result<ScalingState> ScalingFromJson(const Json& j) {
  try {
    ScalingState s;
    s.module = String(j, "module");
    s.recipe = RecipeFrom(Field(j, "recipe"));
    const Json& states = Field(j, "states");
    if (!states.is_array()) throw Bad{"\"states\" is not an array"};
    for (const Json& ds : states) {
      DirectionState d;
      d.direction = Enum(ds, "direction", kDirections);
      d.num_gemms = Int(ds, "num_gemms");
      const Json& roles = Field(ds, "slot_roles");
      if (!roles.is_array()) throw Bad{"\"slot_roles\" is not an array"};
      for (const Json& r : roles) {
        bool found = false;
        for (const auto& n : kSlotRoles) {
          if (r == n.name) {
            d.slot_roles.push_back(n.value);
            found = true;
          }
        }
        if (!found) throw Bad{StrCat("unknown slot role ", r.dump())};
      }
      d.scale = Floats(ds, "scale");
      d.history_len = Int(ds, "history_len");
      d.amax_history = Floats(ds, "amax_history");
      s.states.push_back(std::move(d));
    }
    return s;
  } catch (const Bad& b) {
    return Error(StatusCode::kInvalidArgument, "scaling state: ", b.what);
  } catch (const std::exception& e) {
    return Error(StatusCode::kInvalidArgument, "scaling state: ", e.what());
  }
}

}  // namespace ferry::cli
