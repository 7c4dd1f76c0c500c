// Status names, versions and the error filling every entry point shares.

#include "capi/internal.hpp"

// The C header mirrors ferry::StatusCode; a drifted value would silently mislabel errors.
static_assert(FERRY_IO_ERROR == static_cast<int>(ferry::StatusCode::kIoError));
static_assert(FERRY_CUDA_ERROR == static_cast<int>(ferry::StatusCode::kCudaError));
static_assert(FERRY_DATA_LOSS == static_cast<int>(ferry::StatusCode::kDataLoss));
static_assert(FERRY_NUM_DTYPES == ferry::kNumDTypes);
static_assert(FERRY_DTYPE_F4_E2M1FN == static_cast<int>(ferry::DType::kF4_E2M1FN));
static_assert(FERRY_ENCODING_SHUFFLE_ZSTD == static_cast<int>(ferry::Encoding::kShuffleZstd));
static_assert(FERRY_ENCODING_PLANES == static_cast<int>(ferry::Encoding::kPlanes));

namespace ferry::capi {

int Fail(ferry_error_t* error, int code, std::string_view message) noexcept {
  if (error != nullptr) {
    error->code = code;
    constexpr size_t kKeep = sizeof(error->message) - 1;
    if (message.size() <= kKeep) {
      std::memcpy(error->message, message.data(), message.size());
      error->message[message.size()] = '\0';
    } else {
      // Cut in the middle: the end holds the errno (ferry_error_errno) and the cause.
      constexpr std::string_view kCut = " ... ";
      constexpr size_t kTail = 200;
      const size_t head = kKeep - kCut.size() - kTail;
      std::memcpy(error->message, message.data(), head);
      std::memcpy(error->message + head, kCut.data(), kCut.size());
      std::memcpy(error->message + head + kCut.size(), message.data() + message.size() - kTail,
                  kTail);
      error->message[kKeep] = '\0';
    }
  }
  return code;
}

int Report(const Status& status, ferry_error_t* error) noexcept {
  if (status.ok()) return FERRY_OK;
  return Fail(error, static_cast<int>(status.code()), status.message());
}

int NullArg(ferry_error_t* error, const char* function, const char* arg) {
  return Fail(error, FERRY_INVALID_ARGUMENT,
              ferry::StrCat(function, ": ", arg, " must not be NULL"));
}

std::function<Status(uint64_t*, size_t)> ToAllReduce(ferry_all_reduce_max_fn fn, void* user) {
  return [fn, user](uint64_t* words, size_t count) -> Status {
    const int32_t rc = fn(user, words, count);
    if (rc == 0) return Status::Ok();
    return ferry::Error(StatusCode::kInternal, "the all_reduce_max callback failed (it returned ",
                        rc, ")");
  };
}

int ToPairs(const char* const* keys, const char* const* values, size_t n, const char* fn,
            std::vector<std::pair<std::string, std::string>>* out, ferry_error_t* error) {
  if (n > 0 && (keys == nullptr || values == nullptr)) return NullArg(error, fn, "metadata_keys");
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] == nullptr || values[i] == nullptr) {
      return Fail(
          error, FERRY_INVALID_ARGUMENT,
          ferry::StrCat(fn, ": metadata_keys[", i, "] or metadata_values[", i, "] is NULL"));
    }
    out->emplace_back(keys[i], values[i]);
  }
  return FERRY_OK;
}

}  // namespace ferry::capi

using namespace ferry::capi;  // NOLINT(build/namespaces): the entry points are shells over these

extern "C" {

const char* ferry_status_name(int code) {
  if (code < FERRY_OK || code > FERRY_IO_ERROR) return "Unknown";
  return ferry::StatusCodeName(static_cast<StatusCode>(code));
}

int ferry_error_errno(const ferry_error_t* error) {
  if (error == nullptr || error->code == FERRY_OK) return 0;
  return ferry::ErrnoIn(
      std::string_view(error->message, strnlen(error->message, sizeof(error->message))));
}

const char* ferry_version(void) { return ferry::VersionString(); }

uint32_t ferry_format_version(void) { return ferry::kFormatVersion; }

}  // extern "C"
