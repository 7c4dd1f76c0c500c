#include "base/strict_json.hpp"

#include <limits>
#include <set>
#include <vector>

#include "base/util.hpp"

namespace ferry {

namespace {

// Thrown out of the parser to stop a hostile document early.
struct Reject {
  std::string what;
};

// nlohmann's DOM builder behind checks for depth, duplicate keys and object width. A SAX
// handler rather than parse()'s callback: with a callback, nlohmann scans the parent container
// for discarded values at the end of every object, which is quadratic in a header of many
// entries (80,000 tensors took minutes).
template <typename J>
class StrictSax {
 public:
  using number_integer_t = typename J::number_integer_t;
  using number_unsigned_t = typename J::number_unsigned_t;
  using number_float_t = typename J::number_float_t;
  using string_t = typename J::string_t;
  using binary_t = typename J::binary_t;

  StrictSax(J* out, const StrictJsonOptions& options) : dom_(*out, true), options_(options) {}

  bool null() { return dom_.null(); }
  bool boolean(bool v) { return dom_.boolean(v); }
  bool number_integer(number_integer_t v) { return dom_.number_integer(v); }
  bool number_unsigned(number_unsigned_t v) { return dom_.number_unsigned(v); }
  bool number_float(number_float_t v, const string_t& s) { return dom_.number_float(v, s); }
  bool string(string_t& v) { return dom_.string(v); }
  bool binary(binary_t& v) { return dom_.binary(v); }

  bool start_object(std::size_t n) {
    Enter();
    keys_.emplace_back();
    return dom_.start_object(n);
  }
  bool key(string_t& k) {
    std::set<std::string>& keys = keys_.back();
    if (keys.size() >= options_.max_keys) {
      throw Reject{StrCat("an object has more than ", options_.max_keys, " keys")};
    }
    if (!keys.insert(k).second) {
      throw Reject{options_.duplicate ? options_.duplicate(k, depth_)
                                      : StrCat("duplicate key ", Quote(k))};
    }
    return dom_.key(k);
  }
  bool end_object() {
    --depth_;
    keys_.pop_back();
    return dom_.end_object();
  }
  bool start_array(std::size_t n) {
    Enter();
    return dom_.start_array(n);
  }
  bool end_array() {
    --depth_;
    return dom_.end_array();
  }
  template <class Exception>
  bool parse_error(std::size_t position, const std::string& token, const Exception& ex) {
    return dom_.parse_error(position, token, ex);  // throws ex
  }

 private:
  void Enter() {
    if (depth_ >= options_.max_depth) throw Reject{options_.too_deep};
    ++depth_;
  }

  nlohmann::detail::json_sax_dom_parser<J> dom_;
  const StrictJsonOptions& options_;
  int depth_ = 0;  // containers open
  std::vector<std::set<std::string>> keys_;
};

template <typename J>
std::optional<std::string> Parse(const char* begin, const char* end,
                                 const StrictJsonOptions& options, J* out) {
  try {
    J result;
    StrictSax<J> sax(&result, options);
    J::sax_parse(begin, end, &sax);
    *out = std::move(result);
  } catch (const nlohmann::json::parse_error& e) {
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

}  // namespace

std::optional<std::string> ParseStrictJson(const char* begin, const char* end,
                                           const StrictJsonOptions& options, nlohmann::json* out) {
  return Parse(begin, end, options, out);
}

std::optional<std::string> ParseStrictJson(const char* begin, const char* end,
                                           const StrictJsonOptions& options,
                                           nlohmann::ordered_json* out) {
  return Parse(begin, end, options, out);
}

}  // namespace ferry
