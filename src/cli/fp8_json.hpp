// FP8/FP4 descriptions (quantized tensors, recipes, scaling state) as JSON: what
// `ferry inspect --json` prints, and how `ferry convert` carries them through a safetensors
// file's "__metadata__" so that ferry -> safetensors -> ferry loses nothing.
#ifndef FERRY_SRC_CLI_FP8_JSON_HPP_
#define FERRY_SRC_CLI_FP8_JSON_HPP_

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "ferry/ferry.hpp"

namespace ferry::cli {

using Json = nlohmann::ordered_json;

// __metadata__ keys of a safetensors file written by `ferry convert`: each holds a JSON array
// of QuantizedJson / ScalingJson objects.
inline constexpr char kQuantizedKey[] = "tensorferry.quantized";
inline constexpr char kScalingKey[] = "tensorferry.scaling";

const char* ScalingModeName(ScalingMode m);
const char* SlotRoleName(SlotRole r);
const char* DirectionName(Direction d);

// {"type": "DelayedScaling", field: value, ...}; {"type": "none"} for no recipe.
Json RecipeJson(const Recipe& recipe);
// "DelayedScaling(margin=0, fp8_format=HYBRID, ...)", from RecipeJson.
std::string RecipeText(const Recipe& recipe);
Json QuantizedJson(const QuantizedTensor& q);
// Floats are exact (a float survives the trip through double); NaN and infinities, which JSON
// lacks, are the strings "nan", "inf" and "-inf".
Json ScalingJson(const ScalingState& s);

// Parses the text of a kQuantizedKey / kScalingKey metadata value strictly: nesting at most
// as deep as ScalingJson writes (so nothing that walks it recursively can overflow the
// stack), objects at most as wide, no duplicate keys. InvalidArgument saying why otherwise.
Status ParseFp8Json(const std::string& text, Json* out);

// A safetensors file's metadata with the FP8 descriptions `ferry convert` put there taken out
// (DescribeFp8Metadata): what convert and the fuzzers' describe target see.
struct Fp8Metadata {
  std::vector<QuantizedTensor> quantized;
  std::vector<ScalingState> scaling;
  // Everything else, and the descriptions that did not parse, in their original order.
  std::vector<std::pair<std::string, std::string>> metadata;
  // (key, why) of each description kept as plain metadata.
  std::vector<std::pair<std::string, std::string>> kept;
};
Fp8Metadata DescribeFp8Metadata(std::vector<std::pair<std::string, std::string>> metadata);

// Inverses of QuantizedJson and ScalingJson. InvalidArgument, naming the field, for anything
// they would not have produced.
Result<QuantizedTensor> QuantizedFromJson(const Json& j);
Result<ScalingState> ScalingFromJson(const Json& j);

}  // namespace ferry::cli

#endif  // FERRY_SRC_CLI_FP8_JSON_HPP_
