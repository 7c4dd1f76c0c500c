// What the C API's files share (not installed): the handle structs behind the opaque C types,
// error filling, the guard that keeps C++ exceptions from crossing into C, and option-struct
// helpers. Every entry point runs inside Guard(), so no exception crosses into C: a C caller
// (or ctypes) has no way to unwind C++ frames.
#ifndef FERRY_SRC_CAPI_INTERNAL_HPP_
#define FERRY_SRC_CAPI_INTERNAL_HPP_

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "base/util.hpp"
#include "ferry/ferry.h"
#include "ferry/ferry.hpp"
#include "ferry/loader.hpp"
#include "ferry/sharded.hpp"

// A writer the caller owns, or the one a sharded save lends (committed and freed with the save).
struct ferry_writer_t {
  explicit ferry_writer_t(ferry::Writer w) : owned(std::move(w)), writer(&*owned) {}
  explicit ferry_writer_t(ferry::Writer* lent) : writer(lent), lent(true) {}
  std::optional<ferry::Writer> owned;
  ferry::Writer* writer;
  bool lent = false;
  bool spent = false;  // committed, or commit failed: the Writer must not be used again
};

struct ferry_staging_pool_t {
  std::shared_ptr<ferry::StagingPool> pool;
};

struct ferry_save_t {
  ferry::SaveHandle handle;
};

namespace ferry::capi {

// One scaling state in C form. Heap-allocated and never moved, because the C structs it hands
// out point into its own members.
struct CScaling {
  std::string module;
  std::string custom_name;
  std::string custom_qfactory;
  ferry_recipe_t recipe{};
  std::vector<ferry::DirectionState> dirs;
  std::vector<std::vector<int32_t>> roles;
  std::vector<ferry_direction_state_t> cdirs;
};

// Every tensor's description, packed for ferry_reader_tensor_table and pointed into by
// ferry_reader_tensor_info.
struct TensorTable {
  std::vector<ferry_tensor_record_t> records;
  std::vector<char> names;
  std::vector<int64_t> shapes;
  uint64_t packed_bytes = 0;
};

}  // namespace ferry::capi

// Everything a reader hands out by pointer is built once (at open, or the tensor table on
// first use under a once flag), so the pointers are stable and the const accessors need no
// locking.
struct ferry_reader_t {
  std::shared_ptr<ferry::Reader> reader;
  size_t num_tensors = 0;
  std::string producer;
  std::vector<std::pair<std::string, std::string>> metadata;
  std::vector<std::unique_ptr<ferry::capi::CScaling>> scaling;
  // Built on first use: a Python open of 100,000 tensors that only lists names must not pay
  // per-tensor C++ objects.
  mutable std::once_flag table_once;
  mutable std::unique_ptr<ferry::capi::TensorTable> table;
};

struct ferry_sharded_t {
  std::shared_ptr<ferry::ShardedCheckpoint> sharded;
};

struct ferry_sharded_save_t {
  std::unique_ptr<ferry::ShardedSave> save;
  std::unique_ptr<ferry_writer_t> writer;  // lends save->writer()
};

// A plan made by MakeDistPlan, in its C form (the arrays ferry_dist_plan_view points into).
struct ferry_dist_plan_t {
  std::shared_ptr<ferry::ShardedCheckpoint> checkpoint;  // the item names point into it too
  std::function<ferry::Status(uint64_t*, size_t)> all_reduce_max;
  int32_t rank = 0;
  int32_t rounds = 1;
  std::vector<std::string> names;
  std::vector<ferry_dist_item_t> items;
  uint64_t arena_bytes = 0;
  std::vector<ferry_dist_broadcast_t> broadcasts;
  std::vector<ferry_dist_read_t> reads;
};

struct ferry_loader_t {
  std::unique_ptr<ferry::Loader> loader;
};

namespace ferry::capi {

using ferry::Status;
using ferry::StatusCode;

int Fail(ferry_error_t* error, int code, std::string_view message) noexcept;
int Report(const Status& status, ferry_error_t* error) noexcept;

template <typename F>
int Guard(ferry_error_t* error, F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Fail(error, FERRY_RESOURCE_EXHAUSTED, "out of memory");
  } catch (const std::exception& e) {
    try {
      return Fail(error, FERRY_INTERNAL, std::string("internal error: ") + e.what());
    } catch (...) {
      return Fail(error, FERRY_INTERNAL, "internal error");
    }
  } catch (...) {
    return Fail(error, FERRY_INTERNAL, "internal error: unknown exception");
  }
}

int NullArg(ferry_error_t* error, const char* function, const char* arg);

#define FERRY_C_REQUIRE(arg)                               \
  do {                                                     \
    if ((arg) == nullptr) return NullArg(error, fn, #arg); \
  } while (0)

// Copies `full` into a caller struct of `caller_size` bytes, keeping the caller's struct_size,
// so a caller compiled against an older, shorter struct is not overrun.
template <typename T>
void FillSized(const T& full, T* out) {
  size_t n = std::min(out->struct_size, sizeof(T));
  size_t keep = out->struct_size;
  std::memcpy(static_cast<void*>(out), &full, n);
  out->struct_size = keep;
}

template <typename T>
int CheckSized(const T* s, const char* function, const char* what, ferry_error_t* error) {
  if (s->struct_size < sizeof(size_t) * 2) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(function, ": ", what,
                              "->struct_size is not set (use sizeof or the _init function)"));
  }
  return FERRY_OK;
}

// Reads a field of an option struct only when the caller's struct is long enough to hold it.
#define FERRY_C_HAS(ptr, field) \
  ((ptr)->struct_size >=        \
   offsetof(std::remove_pointer_t<decltype(ptr)>, field) + sizeof((ptr)->field))

// The caller's all-reduce as the library's (a non-zero return is an error naming `fn`).
std::function<Status(uint64_t*, size_t)> ToAllReduce(ferry_all_reduce_max_fn fn, void* user);

// `n` key/value string pairs (either array may be NULL when n is 0), for metadata.
int ToPairs(const char* const* keys, const char* const* values, size_t n, const char* fn,
            std::vector<std::pair<std::string, std::string>>* out, ferry_error_t* error);

// dtypes.cc
bool ValidDType(int32_t dtype);
DLDataType ToDl(ferry::DType dtype);
bool FromDl(DLDataType type, ferry::DType* out);

// dlpack.cc
DLManagedTensorVersioned* MakeManaged(const ferry::TensorInfo& info, void* data, DLDevice device,
                                      uint64_t flags, std::shared_ptr<const void> keepalive);

// scaling.cc
// A checked ScalingState from the C form; errors name `path`, the module and the direction.
int ToScalingState(const char* module, const ferry_recipe_t& recipe,
                   const ferry_direction_state_t* states, size_t num_states,
                   const std::string& path, ferry::ScalingState* out, ferry_error_t* error);
std::unique_ptr<CScaling> ToCScaling(const ferry::ScalingState& s);
void FillScaling(const CScaling& c, ferry_scaling_state_t* out);

// reader.cc
std::unique_ptr<ferry_reader_t> WrapReader(std::shared_ptr<ferry::Reader> reader);
const TensorTable& Table(const ferry_reader_t* reader);

// ferry_reader_options_t -> ReaderOptions (NULL: the defaults).
int ToReaderOptions(const ferry_reader_options_t* options, const char* fn, ferry::ReaderOptions* o,
                    ferry_error_t* error);

// open(path, ReaderOptions from the C struct, NULL: defaults), its result handed to `take`.
template <typename Open, typename Take>
int OpenWithOptions(const char* path, const ferry_reader_options_t* options, const char* fn,
                    ferry_error_t* error, Open open, Take take) {
  ferry::ReaderOptions o;
  if (int rc = ToReaderOptions(options, fn, &o, error); rc != FERRY_OK) return rc;
  auto opened = open(path, o);
  if (!opened.ok()) return Report(opened.status(), error);
  take(std::move(opened).value());
  return FERRY_OK;
}

// writer.cc
int ToWriterOptions(const char* path, const ferry_writer_options_t* options, const char* fn,
                    ferry::WriterOptions* o, ferry_error_t* error);

}  // namespace ferry::capi

#endif  // FERRY_SRC_CAPI_INTERNAL_HPP_
