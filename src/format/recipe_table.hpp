// FP8/FP4 recipes in the footer: the one conversion between ferry::Recipe and the FlatBuffers
// Recipe union of a ScalingState (schema/ferry.fbs), both ways.
#ifndef FERRY_SRC_FORMAT_RECIPE_TABLE_HPP_
#define FERRY_SRC_FORMAT_RECIPE_TABLE_HPP_

#include <string>
#include <utility>

#include "ferry/ferry.hpp"
#include "ferry_generated.h"

namespace ferry::format {

// Why the recipe of a verified ScalingState table cannot be read ("missing recipe table",
// "DelayedScaling has an unknown enum value", "bad MXFP8BlockScaling", ...), or empty.
std::string CheckRecipeTable(const fb::ScalingState* s);
// The recipe of a ScalingState table that CheckRecipeTable passed.
Recipe RecipeFromTable(const fb::ScalingState* s);
// The union type and table of `recipe`, built into `b`.
std::pair<fb::Recipe, flatbuffers::Offset<void>> RecipeToTable(flatbuffers::FlatBufferBuilder& b,
                                                               const Recipe& recipe);

}  // namespace ferry::format

#endif  // FERRY_SRC_FORMAT_RECIPE_TABLE_HPP_
