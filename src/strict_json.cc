#include "strict_json.hpp"

#include <set>
#include <vector>

#include "util.hpp"

namespace ferry {

namespace {

using Json = nlohmann::json;

// Thrown out of the parser's callback to stop a hostile document early.
struct Reject {
  std::string what;
};

class Shape {
 public:
  explicit Shape(const StrictJsonOptions& options) : options_(options) {}

  bool operator()(int depth, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        if (depth >= options_.max_depth) throw Reject{options_.too_deep};
        if (event == Json::parse_event_t::object_start) keys_.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        if (!keys_.empty()) keys_.pop_back();
        break;
      case Json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (!keys_.empty() && !keys_.back().insert(key).second) {
          throw Reject{options_.duplicate ? options_.duplicate(key, depth)
                                          : StrCat("duplicate key ", Quote(key))};
        }
        break;
      }
      default:
        break;
    }
    return true;
  }

 private:
  const StrictJsonOptions& options_;
  std::vector<std::set<std::string>> keys_;
};

}  // namespace

std::optional<std::string> ParseStrictJson(const char* begin, const char* end,
                                           const StrictJsonOptions& options, Json* out) {
  try {
    *out = Json::parse(begin, end, Shape(options));
  } catch (const Json::parse_error& e) {
    std::string what = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] parse error at line 1, column 7: ".
    if (auto p = what.find(": "); p != std::string::npos) what = what.substr(p + 2);
    // e.byte counts from 1 at the first byte.
    return StrCat("invalid JSON at ", options.where, " ",
                  options.byte_base + (e.byte > 0 ? e.byte - 1 : 0), ": ", what);
  } catch (const Reject& r) {
    return r.what;
  } catch (const std::exception& e) {
    return StrCat("invalid JSON: ", e.what());
  }
  return std::nullopt;
}

}  // namespace ferry
