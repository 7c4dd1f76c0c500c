// FP8/FP4 recipes by name: the one place TransformerEngine's names for recipe classes, their
// fields and enum values are spelled, and the one conversion between ferry::Recipe and JSON
// ({"type": "DelayedScaling", "margin": 0, "fp8_format": "HYBRID", ...}). Readers of other
// spellings (a pickled TransformerEngine recipe, a Python dict) walk RecipeFields by name.
// The FlatBuffers form is in recipe_table.hpp.
#ifndef FERRY_SRC_FORMAT_RECIPE_HPP_
#define FERRY_SRC_FORMAT_RECIPE_HPP_

#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <vector>

#include "ferry/ferry.hpp"

namespace ferry::format {

// "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling",
// "NVFP4BlockScaling", "CustomRecipe"; "none" for no recipe.
const char* RecipeName(const Recipe& recipe);
// A recipe of the kind `name` (as RecipeName spells it) with every field at its default;
// nullopt for an unknown name.
std::optional<Recipe> RecipeNamed(std::string_view name);

// "E4M3", "E5M2", "HYBRID".
const char* Fp8FormatName(Fp8Format f);
std::optional<Fp8Format> Fp8FormatNamed(std::string_view name);
// "max", "most_recent".
const char* AmaxComputeAlgoName(AmaxComputeAlgo a);
std::optional<AmaxComputeAlgo> AmaxComputeAlgoNamed(std::string_view name);

// One field of a recipe, pointing into it: `value` is an int32_t*, bool*, Fp8Format*,
// AmaxComputeAlgo* or std::string* as `kind` says.
struct RecipeField {
  enum class Kind { kInt32, kBool, kFp8Format, kAmaxComputeAlgo, kString };
  const char* name;
  Kind kind;
  void* value;
};
// The fields of `recipe` in TransformerEngine's order (none for no recipe). The pointers are
// valid while `recipe` is.
std::vector<RecipeField> RecipeFields(Recipe& recipe);

// {"type": RecipeName, then every field by name}: enums by name, numbers and booleans as JSON.
nlohmann::ordered_json RecipeToJson(const Recipe& recipe);
// The inverse: "type" and every field of that type, each of its JSON type. InvalidArgument
// saying what is wrong (missing "margin", "margin" is not a 32-bit integer, ...) otherwise.
Result<Recipe> RecipeFromJson(const nlohmann::ordered_json& j);

}  // namespace ferry::format

#endif  // FERRY_SRC_FORMAT_RECIPE_HPP_
