// Status and Result<T>: how every TensorFerry C++ call reports failure. No exception is thrown
// for bad input; a call returns a Status whose message names the file and, where it applies,
// the tensor and the byte offset.
#ifndef FERRY_STATUS_HPP_
#define FERRY_STATUS_HPP_

#include <optional>
#include <string>
#include <utility>

#include "ferry/api.h"

namespace ferry {

// Values are pinned forever: the C API returns them as plain ints.
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,    // the caller passed something unusable (bad name, size, option)
  kNotFound = 2,           // no such file or tensor
  kDataLoss = 3,           // the file is corrupt, truncated or hostile; a checksum mismatched
  kResourceExhausted = 4,  // out of memory or threads, or over a documented limit
  kUnimplemented = 5,      // a valid request this build cannot serve (e.g. no CUDA support)
  kInternal = 6,           // a broken invariant inside TensorFerry: a bug, please report
  kCudaError = 7,          // a CUDA runtime call failed
  kIoError = 8,            // the system refused a read, write (disk full), sync or rename
};

FERRY_API const char* StatusCodeName(StatusCode code);

// A value type: cheap to copy when ok (no allocation), thread-compatible.
class FERRY_API Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "DataLoss: <message>", or "OK".
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Either a value or a non-ok Status. Accessing value() of a failed Result throws
// std::bad_optional_access: that is a programming error, not an input error.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT(google-explicit-constructor)
  Result(Status status) : status_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (status_.ok()) status_ = Status(StatusCode::kInternal, "Result built from an OK status");
  }

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }

  T& value() & { return value_.value(); }
  const T& value() const& { return value_.value(); }
  T&& value() && { return std::move(value_.value()); }
  T* operator->() { return &value_.value(); }
  const T* operator->() const { return &value_.value(); }
  T& operator*() & { return value_.value(); }
  const T& operator*() const& { return value_.value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace ferry

#endif  // FERRY_STATUS_HPP_
