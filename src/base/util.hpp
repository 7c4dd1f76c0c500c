// Internal helpers: message building, status macros, checked arithmetic.
#ifndef FERRY_SRC_BASE_UTIL_HPP_
#define FERRY_SRC_BASE_UTIL_HPP_

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>

#include "ferry/status.hpp"

namespace ferry {

template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

template <typename... Args>
Status Error(StatusCode code, const Args&... args) {
  return Status(code, StrCat(args...));
}

// Control bytes (< 0x20, 0x7f) and the bytes in `also` as \xNN, so a hostile name or URL
// cannot forge log lines.
std::string EscapeBytes(std::string_view text, std::string_view also = {});

// Quotes a tensor name for messages, escaping control bytes so a hostile name cannot forge
// log lines.
std::string Quote(std::string_view name);

// Appends strerror(err) as "(<text>, errno <n>)".
std::string ErrnoText(int err);
// The errno of the last ErrnoText in `message`, or 0 when it holds none.
int ErrnoIn(std::string_view message);

inline bool AddOverflows(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_add_overflow(a, b, out);
}
inline bool MulOverflows(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}
inline uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace ferry

#define FERRY_CONCAT_INNER(a, b) a##b
#define FERRY_CONCAT(a, b) FERRY_CONCAT_INNER(a, b)

#define FERRY_RETURN_IF_ERROR(expr)        \
  do {                                     \
    ::ferry::Status _ferry_st = (expr);    \
    if (!_ferry_st.ok()) return _ferry_st; \
  } while (0)

#define FERRY_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()

#define FERRY_ASSIGN_OR_RETURN(lhs, expr) \
  FERRY_ASSIGN_OR_RETURN_IMPL(FERRY_CONCAT(_ferry_result_, __LINE__), lhs, expr)

#endif  // FERRY_SRC_BASE_UTIL_HPP_
