// JSON from untrusted files (safetensors headers, checkpoint indexes), parsed strictly.
#ifndef FERRY_SRC_BASE_STRICT_JSON_HPP_
#define FERRY_SRC_BASE_STRICT_JSON_HPP_

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace ferry {

// Parses [begin, end) and refuses nesting deeper than `max_depth` (so a file of brackets cannot
// make the parser build a deep tree, nor anything that later walks it recursively -- dump(),
// a describer, a destructor -- overflow the stack) and duplicate keys, which JSON leaves
// undefined and nlohmann would resolve silently (last one wins). Time and memory are linear in
// the input. Returns the reason on failure: `too_deep`, "<duplicate>" formatted by
// `duplicate(key, depth)`, or "invalid JSON at <where> <byte_base + offset>: ..." for syntax
// errors.
//
// Every JSON document read from a file goes through here, with a max_depth no larger than
// kMaxJsonDepth.
inline constexpr int kMaxJsonDepth = 64;

struct StrictJsonOptions {
  int max_depth = 3;
  // Keys per object. nlohmann::ordered_json looks keys up linearly, so documents parsed into
  // it (small, fixed-shape objects) cap their width to stay linear.
  size_t max_keys = SIZE_MAX;
  const char* too_deep = "nests too deeply";
  std::string (*duplicate)(const std::string& key, int depth) = nullptr;
  const char* where = "byte";  // "byte" or "file offset"
  uint64_t byte_base = 0;      // added to syntax error positions
};

std::optional<std::string> ParseStrictJson(const char* begin, const char* end,
                                           const StrictJsonOptions& options, nlohmann::json* out);
std::optional<std::string> ParseStrictJson(const char* begin, const char* end,
                                           const StrictJsonOptions& options,
                                           nlohmann::ordered_json* out);

}  // namespace ferry

#endif  // FERRY_SRC_BASE_STRICT_JSON_HPP_
