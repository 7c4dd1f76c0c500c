// The C API (include/ferry/ferry.h) over the C++ core. Every entry point runs inside Guard(),
// so no exception crosses into C: a C caller (or ctypes) has no way to unwind C++ frames.
#include <dlfcn.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "format/block_source.hpp"
#include "ferry/distributed.hpp"
#include "ferry/ferry.h"
#include "ferry/ferry.hpp"
#include "ferry/loader.hpp"
#include "ferry/sharded.hpp"
#include "format/footer.hpp"
#include "io/io.hpp"
#include "import/torch/import_writer.hpp"
#include "base/util.hpp"

// The C header mirrors ferry::StatusCode; a drifted value would silently mislabel errors.
static_assert(FERRY_IO_ERROR == static_cast<int>(ferry::StatusCode::kIoError));
static_assert(FERRY_CUDA_ERROR == static_cast<int>(ferry::StatusCode::kCudaError));
static_assert(FERRY_DATA_LOSS == static_cast<int>(ferry::StatusCode::kDataLoss));
static_assert(FERRY_NUM_DTYPES == ferry::kNumDTypes);
static_assert(FERRY_DTYPE_F4_E2M1FN == static_cast<int>(ferry::DType::kF4_E2M1FN));
static_assert(FERRY_ENCODING_SHUFFLE_ZSTD == static_cast<int>(ferry::Encoding::kShuffleZstd));
static_assert(FERRY_ENCODING_PLANES == static_cast<int>(ferry::Encoding::kPlanes));

struct ferry_writer_t {
  explicit ferry_writer_t(ferry::Writer w) : writer(std::move(w)) {}
  ferry::Writer writer;
  bool spent = false;  // committed, or commit failed: the Writer must not be used again
};

struct ferry_staging_pool_t {
  std::shared_ptr<ferry::StagingPool> pool;
};

struct ferry_save_t {
  ferry::SaveHandle handle;
};

namespace {

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

}  // namespace

namespace {

// Every tensor's description, packed for ferry_reader_tensor_table and pointed into by
// ferry_reader_tensor_info.
struct TensorTable {
  std::vector<ferry_tensor_record_t> records;
  std::vector<char> names;
  std::vector<int64_t> shapes;
  uint64_t packed_bytes = 0;
};

}  // namespace

// Everything a reader hands out by pointer is built once (at open, or the tensor table on
// first use under a once flag), so the pointers are stable and the const accessors need no
// locking.
struct ferry_reader_t {
  std::shared_ptr<ferry::Reader> reader;
  size_t num_tensors = 0;
  std::string producer;
  std::vector<std::pair<std::string, std::string>> metadata;
  std::vector<std::unique_ptr<CScaling>> scaling;
  // Built on first use: a Python open of 100,000 tensors that only lists names must not pay
  // per-tensor C++ objects.
  mutable std::once_flag table_once;
  mutable std::unique_ptr<TensorTable> table;
};

struct ferry_sharded_t {
  std::shared_ptr<ferry::ShardedCheckpoint> sharded;
};

struct ferry_loader_t {
  std::unique_ptr<ferry::Loader> loader;
};

namespace {

using ferry::Status;
using ferry::StatusCode;

int Fail(ferry_error_t* error, int code, std::string_view message) noexcept {
  if (error != nullptr) {
    error->code = code;
    size_t n = std::min(message.size(), sizeof(error->message) - 1);
    std::memcpy(error->message, message.data(), n);
    error->message[n] = '\0';
  }
  return code;
}

int Report(const Status& status, ferry_error_t* error) noexcept {
  if (status.ok()) return FERRY_OK;
  return Fail(error, static_cast<int>(status.code()), status.message());
}

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

int NullArg(ferry_error_t* error, const char* function, const char* arg) {
  return Fail(error, FERRY_INVALID_ARGUMENT,
              ferry::StrCat(function, ": ", arg, " must not be NULL"));
}

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

// ---- dtypes ---------------------------------------------------------------------------------

struct DlType {
  uint8_t code;
  uint8_t bits;
};

constexpr DlType kDlTypes[FERRY_NUM_DTYPES] = {
    {kDLBool, 8},
    {kDLUInt, 8},
    {kDLUInt, 16},
    {kDLUInt, 32},
    {kDLUInt, 64},
    {kDLInt, 8},
    {kDLInt, 16},
    {kDLInt, 32},
    {kDLInt, 64},
    {kDLFloat, 16},
    {kDLBfloat, 16},
    {kDLFloat, 32},
    {kDLFloat, 64},
    {kDLComplex, 64},
    {kDLComplex, 128},
    {kDLFloat8_e4m3fn, 8},
    {kDLFloat8_e5m2, 8},
    {kDLFloat8_e8m0fnu, 8},
    {kDLFloat8_e4m3fnuz, 8},
    {kDLFloat8_e5m2fnuz, 8},
    {kDLFloat6_e2m3fn, 6},
    {kDLFloat6_e3m2fn, 6},
    {kDLFloat4_e2m1fn, 4},
};

bool ValidDType(int32_t dtype) { return dtype >= 0 && dtype < FERRY_NUM_DTYPES; }

DLDataType ToDl(ferry::DType dtype) {
  DlType t = kDlTypes[static_cast<int>(dtype)];
  DLDataType out;
  out.code = t.code;
  out.bits = t.bits;
  out.lanes = 1;
  return out;
}

bool FromDl(DLDataType type, ferry::DType* out) {
  if (type.lanes != 1) return false;
  for (int i = 0; i < FERRY_NUM_DTYPES; ++i) {
    if (kDlTypes[i].code == type.code && kDlTypes[i].bits == type.bits) {
      *out = static_cast<ferry::DType>(i);
      return true;
    }
  }
  return false;
}

int CheckEncoding(int32_t encoding, const char* function, ferry_error_t* error) {
  if (encoding < FERRY_ENCODING_DEFAULT || encoding > FERRY_ENCODING_PLANES) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(function, ": unknown encoding ", encoding));
  }
  return FERRY_OK;
}

// ---- DLPack tensors -------------------------------------------------------------------------

// Owns one DLManagedTensorVersioned and whatever keeps its memory alive (the file mapping of a
// view, or the loader's allocation).
struct ManagedCtx {
  DLManagedTensorVersioned managed{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  std::shared_ptr<const void> keepalive;
};

void DeleteManaged(DLManagedTensorVersioned* self) noexcept {
  if (self == nullptr) return;
  // Freeing device memory through a caller's allocator may throw from user code; a deleter is
  // called from C and must not unwind.
  try {
    delete static_cast<ManagedCtx*>(self->manager_ctx);
  } catch (...) {
  }
}

DLManagedTensorVersioned* MakeManaged(const ferry::TensorInfo& info, void* data, DLDevice device,
                                      uint64_t flags, std::shared_ptr<const void> keepalive) {
  auto ctx = std::make_unique<ManagedCtx>();
  ctx->shape = info.shape;
  ctx->strides.assign(info.shape.size(), 1);
  for (size_t d = info.shape.size(); d > 1; --d) {
    ctx->strides[d - 2] = ctx->strides[d - 1] * std::max<int64_t>(info.shape[d - 1], 1);
  }
  ctx->keepalive = std::move(keepalive);
  DLManagedTensorVersioned& m = ctx->managed;
  m.version.major = DLPACK_MAJOR_VERSION;
  m.version.minor = DLPACK_MINOR_VERSION;
  m.manager_ctx = ctx.get();
  m.deleter = DeleteManaged;
  m.flags = flags;
  if (info.dtype == ferry::DType::kF6_E2M3FN || info.dtype == ferry::DType::kF6_E3M2FN) {
    m.flags |= DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED;
  }
  m.dl_tensor.data = data;
  m.dl_tensor.device = device;
  m.dl_tensor.ndim = static_cast<int32_t>(ctx->shape.size());
  m.dl_tensor.dtype = ToDl(info.dtype);
  // A non-NULL pointer even for scalars: some consumers read shape[0] of ndim 0 tensors.
  m.dl_tensor.shape = ctx->shape.empty() ? nullptr : ctx->shape.data();
  m.dl_tensor.strides = ctx->strides.empty() ? nullptr : ctx->strides.data();
  m.dl_tensor.byte_offset = 0;
  return &ctx.release()->managed;
}

struct LegacyCtx {
  DLManagedTensor legacy{};
  DLManagedTensorVersioned* versioned = nullptr;
};

void DeleteLegacy(DLManagedTensor* self) noexcept {
  if (self == nullptr) return;
  auto* ctx = static_cast<LegacyCtx*>(self->manager_ctx);
  ferry_dlpack_free(ctx->versioned);
  delete ctx;
}

// ---- recipes --------------------------------------------------------------------------------

int ToRecipe(const ferry_recipe_t& c, ferry::Recipe* out, const char* function,
             ferry_error_t* error) {
  auto bad = [&](const char* field, int32_t v) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(function, ": recipe field ", field, " has invalid value ", v));
  };
  if (c.fp8_format < 0 || c.fp8_format > FERRY_FP8_FORMAT_HYBRID) {
    if (c.kind != FERRY_RECIPE_NONE && c.kind != FERRY_RECIPE_NVFP4_BLOCK_SCALING &&
        c.kind != FERRY_RECIPE_CUSTOM) {
      return bad("fp8_format", c.fp8_format);
    }
  }
  auto fmt = static_cast<ferry::Fp8Format>(c.fp8_format);
  switch (c.kind) {
    case FERRY_RECIPE_NONE:
      *out = std::monostate{};
      return FERRY_OK;
    case FERRY_RECIPE_DELAYED_SCALING: {
      if (c.amax_compute_algo != FERRY_AMAX_COMPUTE_MAX &&
          c.amax_compute_algo != FERRY_AMAX_COMPUTE_MOST_RECENT) {
        return bad("amax_compute_algo", c.amax_compute_algo);
      }
      ferry::DelayedScaling r;
      r.margin = c.margin;
      r.fp8_format = fmt;
      r.amax_history_len = c.amax_history_len;
      r.amax_compute_algo = static_cast<ferry::AmaxComputeAlgo>(c.amax_compute_algo);
      r.reduce_amax = c.reduce_amax != 0;
      r.fp8_dpa = c.fp8_dpa != 0;
      r.fp8_mha = c.fp8_mha != 0;
      *out = r;
      return FERRY_OK;
    }
    case FERRY_RECIPE_FLOAT8_CURRENT_SCALING: {
      ferry::Float8CurrentScaling r;
      r.fp8_format = fmt;
      r.fp8_dpa = c.fp8_dpa != 0;
      r.fp8_mha = c.fp8_mha != 0;
      *out = r;
      return FERRY_OK;
    }
    case FERRY_RECIPE_MXFP8_BLOCK_SCALING: {
      ferry::MXFP8BlockScaling r;
      r.fp8_format = fmt;
      *out = r;
      return FERRY_OK;
    }
    case FERRY_RECIPE_FLOAT8_BLOCK_SCALING: {
      ferry::Float8BlockScaling r;
      r.fp8_format = fmt;
      r.x_block_scaling_dim = c.x_block_scaling_dim;
      r.w_block_scaling_dim = c.w_block_scaling_dim;
      r.grad_block_scaling_dim = c.grad_block_scaling_dim;
      *out = r;
      return FERRY_OK;
    }
    case FERRY_RECIPE_NVFP4_BLOCK_SCALING: {
      ferry::NVFP4BlockScaling r;
      r.disable_rht = c.disable_rht != 0;
      r.disable_stochastic_rounding = c.disable_stochastic_rounding != 0;
      r.disable_2d_quantization = c.disable_2d_quantization != 0;
      *out = r;
      return FERRY_OK;
    }
    case FERRY_RECIPE_CUSTOM: {
      if (c.custom_name == nullptr || c.custom_name[0] == '\0') {
        return Fail(error, FERRY_INVALID_ARGUMENT,
                    ferry::StrCat(function, ": a custom recipe needs custom_name"));
      }
      ferry::CustomRecipe r;
      r.name = c.custom_name;
      if (c.custom_qfactory != nullptr) r.qfactory = c.custom_qfactory;
      *out = r;
      return FERRY_OK;
    }
    default:
      return bad("kind", c.kind);
  }
}

// Fills `c` (already ferry_recipe_init-ed for the right kind) from a C++ recipe; custom names
// point into `owner`.
void FromRecipe(const ferry::Recipe& recipe, CScaling* owner) {
  ferry_recipe_t& c = owner->recipe;
  if (std::holds_alternative<ferry::DelayedScaling>(recipe)) {
    const auto& r = std::get<ferry::DelayedScaling>(recipe);
    ferry_recipe_init(&c, FERRY_RECIPE_DELAYED_SCALING);
    c.margin = r.margin;
    c.fp8_format = static_cast<int32_t>(r.fp8_format);
    c.amax_history_len = r.amax_history_len;
    c.amax_compute_algo = static_cast<int32_t>(r.amax_compute_algo);
    c.reduce_amax = r.reduce_amax;
    c.fp8_dpa = r.fp8_dpa;
    c.fp8_mha = r.fp8_mha;
  } else if (std::holds_alternative<ferry::Float8CurrentScaling>(recipe)) {
    const auto& r = std::get<ferry::Float8CurrentScaling>(recipe);
    ferry_recipe_init(&c, FERRY_RECIPE_FLOAT8_CURRENT_SCALING);
    c.fp8_format = static_cast<int32_t>(r.fp8_format);
    c.fp8_dpa = r.fp8_dpa;
    c.fp8_mha = r.fp8_mha;
  } else if (std::holds_alternative<ferry::MXFP8BlockScaling>(recipe)) {
    ferry_recipe_init(&c, FERRY_RECIPE_MXFP8_BLOCK_SCALING);
    c.fp8_format = static_cast<int32_t>(std::get<ferry::MXFP8BlockScaling>(recipe).fp8_format);
  } else if (std::holds_alternative<ferry::Float8BlockScaling>(recipe)) {
    const auto& r = std::get<ferry::Float8BlockScaling>(recipe);
    ferry_recipe_init(&c, FERRY_RECIPE_FLOAT8_BLOCK_SCALING);
    c.fp8_format = static_cast<int32_t>(r.fp8_format);
    c.x_block_scaling_dim = r.x_block_scaling_dim;
    c.w_block_scaling_dim = r.w_block_scaling_dim;
    c.grad_block_scaling_dim = r.grad_block_scaling_dim;
  } else if (std::holds_alternative<ferry::NVFP4BlockScaling>(recipe)) {
    const auto& r = std::get<ferry::NVFP4BlockScaling>(recipe);
    ferry_recipe_init(&c, FERRY_RECIPE_NVFP4_BLOCK_SCALING);
    c.disable_rht = r.disable_rht;
    c.disable_stochastic_rounding = r.disable_stochastic_rounding;
    c.disable_2d_quantization = r.disable_2d_quantization;
  } else if (std::holds_alternative<ferry::CustomRecipe>(recipe)) {
    const auto& r = std::get<ferry::CustomRecipe>(recipe);
    ferry_recipe_init(&c, FERRY_RECIPE_CUSTOM);
    owner->custom_name = r.name;
    owner->custom_qfactory = r.qfactory;
    c.custom_name = owner->custom_name.c_str();
    c.custom_qfactory = owner->custom_qfactory.empty() ? nullptr : owner->custom_qfactory.c_str();
  } else {
    ferry_recipe_init(&c, FERRY_RECIPE_NONE);
  }
}

std::unique_ptr<CScaling> ToCScaling(const ferry::ScalingState& s) {
  auto c = std::make_unique<CScaling>();
  c->module = s.module;
  FromRecipe(s.recipe, c.get());
  c->dirs = s.states;
  c->roles.resize(c->dirs.size());
  c->cdirs.resize(c->dirs.size());
  for (size_t i = 0; i < c->dirs.size(); ++i) {
    const ferry::DirectionState& d = c->dirs[i];
    for (ferry::SlotRole r : d.slot_roles) c->roles[i].push_back(static_cast<int32_t>(r));
    ferry_direction_state_t& cd = c->cdirs[i];
    cd.direction = static_cast<int32_t>(d.direction);
    cd.num_gemms = d.num_gemms;
    cd.num_slots = static_cast<int32_t>(d.slot_roles.size());
    cd.history_len = d.history_len;
    cd.slot_roles = c->roles[i].empty() ? nullptr : c->roles[i].data();
    cd.scale = d.scale.empty() ? nullptr : d.scale.data();
    cd.amax_history = d.amax_history.empty() ? nullptr : d.amax_history.data();
  }
  return c;
}

void FillScaling(const CScaling& c, ferry_scaling_state_t* out) {
  ferry_scaling_state_t full;
  full.struct_size = sizeof(full);
  full.module = c.module.c_str();
  full.recipe = c.recipe;
  full.num_states = c.cdirs.size();
  full.states = c.cdirs.empty() ? nullptr : c.cdirs.data();
  FillSized(full, out);
}

std::unique_ptr<ferry_reader_t> WrapReader(std::shared_ptr<ferry::Reader> reader) {
  auto h = std::make_unique<ferry_reader_t>();
  h->reader = std::move(reader);
  const ferry::Reader& rd = *h->reader;
  h->producer = rd.producer();
  h->num_tensors = rd.num_tensors();
  h->metadata = rd.metadata();
  for (const ferry::ScalingState& s : rd.scaling_states()) h->scaling.push_back(ToCScaling(s));
  return h;
}

// open(path, ReaderOptions from the C struct, NULL: defaults), its result handed to `take`.
template <typename Open, typename Take>
int OpenWithOptions(const char* path, const ferry_reader_options_t* options, const char* fn,
                    ferry_error_t* error, Open open, Take take) {
  ferry::ReaderOptions o;
  if (options != nullptr) {
    if (!FERRY_C_HAS(options, verify_on_open)) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(fn, ": options->struct_size is not set"));
    }
    o.verify_on_open = options->verify_on_open != 0;
  }
  auto opened = open(path, o);
  if (!opened.ok()) return Report(opened.status(), error);
  take(std::move(opened).value());
  return FERRY_OK;
}

// One pass over the footer's tensor tables (no per-tensor heap objects): sizes first, so
// the three arrays are allocated once.
std::unique_ptr<TensorTable> BuildTable(const ferry::Reader& reader) {
  const ferry::BlockSource& r = ferry::BlocksOf(reader);
  const size_t n = r.size();
  auto t = std::make_unique<TensorTable>();
  uint64_t name_bytes = 0, dims = 0;
  for (size_t i = 0; i < n; ++i) {
    const ferry::fb::Tensor* x = r.at(i);
    name_bytes += x->name()->size() + 1;
    dims += x->shape() ? x->shape()->size() : 0;
  }
  t->records.resize(n);
  t->names.resize(name_bytes);
  t->shapes.resize(dims);
  uint64_t name_at = 0, dim_at = 0, packed = 0;
  for (size_t i = 0; i < n; ++i) {
    const ferry::fb::Tensor* x = r.at(i);
    ferry_tensor_record_t& rec = t->records[i];
    const flatbuffers::String* name = x->name();
    std::memcpy(t->names.data() + name_at, name->data(), name->size());
    t->names[name_at + name->size()] = '\0';
    rec.name_offset = name_at;
    rec.name_size = name->size();
    name_at += name->size() + 1;
    rec.shape_offset = dim_at;
    rec.ndim = 0;
    if (const auto* shape = x->shape()) {
      for (flatbuffers::uoffset_t d = 0; d < shape->size(); ++d) {
        t->shapes[dim_at + d] = shape->Get(d);
      }
      rec.ndim = static_cast<int32_t>(shape->size());
      dim_at += shape->size();
    }
    rec.nbytes = x->nbytes();
    rec.data_offset = x->data_offset();
    rec.data_size = x->data_size();
    rec.block_size = x->block_size();
    rec.dtype = static_cast<int32_t>(x->dtype());
    rec.encoding = static_cast<int32_t>(x->encoding());
    rec.reserved = 0;
    // Sizes are validated at open (each tensor lies inside the file), so the sum of aligned
    // sizes cannot overflow.
    rec.packed_offset = packed;
    packed += ferry::AlignUp(rec.nbytes, FERRY_PACKED_ALIGNMENT);
  }
  t->packed_bytes = packed;
  return t;
}

const TensorTable& Table(const ferry_reader_t* reader) {
  std::call_once(reader->table_once, [reader] { reader->table = BuildTable(*reader->reader); });
  return *reader->table;
}

void FillInfo(const TensorTable& table, size_t index, ferry_tensor_info_t* out) {
  const ferry_tensor_record_t& rec = table.records[index];
  ferry_tensor_info_t full;
  full.struct_size = sizeof(full);
  full.name = table.names.data() + rec.name_offset;
  full.dtype = rec.dtype;
  full.ndim = rec.ndim;
  full.shape = rec.ndim == 0 ? nullptr : table.shapes.data() + rec.shape_offset;
  full.nbytes = rec.nbytes;
  full.data_offset = rec.data_offset;
  full.data_size = rec.data_size;
  full.encoding = rec.encoding;
  full.block_size = rec.block_size;
  full.index = index;
  FillSized(full, out);
}

ferry::ReadOptions ReadFlags(uint32_t flags) {
  ferry::ReadOptions o;
  o.verify = (flags & FERRY_READ_VERIFY) != 0;
  return o;
}

// ---- loader ---------------------------------------------------------------------------------

int ToRequests(const ferry_load_request_t* requests, size_t n, bool out_given,
               std::vector<ferry::LoadRequest>* out, const char* function, ferry_error_t* error) {
  if (n > 0 && requests == nullptr) return NullArg(error, function, "requests");
  if (!out_given) {
    bool all_dst = n > 0;
    for (size_t i = 0; i < n; ++i) all_dst = all_dst && requests[i].dst != nullptr;
    if (!all_dst) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(function,
                                ": out may be NULL only when every request has a dst (the "
                                "loader's allocations would leak)"));
    }
  }
  out->reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (requests[i].name == nullptr) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(function, ": requests[", i, "].name is NULL"));
    }
    ferry::LoadRequest r;
    r.name = requests[i].name;
    r.row_begin = requests[i].row_begin;
    r.row_end = requests[i].row_end;
    r.dst = requests[i].dst;
    r.dst_bytes = requests[i].dst_bytes;
    out->push_back(std::move(r));
  }
  return FERRY_OK;
}

void ExportLoaded(std::vector<ferry::LoadedTensor>& loaded, DLManagedTensorVersioned** out) {
  // Build every descriptor before handing any out, so a failure (bad_alloc) leaks nothing.
  std::vector<std::unique_ptr<DLManagedTensorVersioned, void (*)(DLManagedTensorVersioned*)>> made;
  made.reserve(loaded.size());
  for (ferry::LoadedTensor& t : loaded) {
    DLDevice dev;
    if (t.device >= 0) {
      dev.device_type = kDLCUDA;
      dev.device_id = t.device;
    } else {
      dev.device_type = kDLCPU;
      dev.device_id = 0;
    }
    uint64_t flags = t.owner ? DLPACK_FLAG_BITMASK_IS_COPIED : 0;
    made.emplace_back(MakeManaged(t.info, t.data, dev, flags, std::move(t.owner)),
                      &ferry_dlpack_free);
  }
  for (size_t i = 0; i < made.size(); ++i) out[i] = made[i].release();
}

// A streaming load's C callback, given a borrowed descriptor of each tensor.
struct CReady {
  ferry_ready_fn fn = nullptr;
  void* user = nullptr;
  int32_t hand_over = FERRY_HAND_OVER_COMPLETE;
};

ferry::ReadyCallback ToCallback(const CReady& c) {
  return [c](const ferry::ReadyTensor& t) {
    DLDevice dev;
    dev.device_type = t.tensor->device >= 0 ? kDLCUDA : kDLCPU;
    dev.device_id = t.tensor->device >= 0 ? t.tensor->device : 0;
    std::unique_ptr<DLManagedTensorVersioned, void (*)(DLManagedTensorVersioned*)> m(
        MakeManaged(t.tensor->info, t.tensor->data, dev, 0, nullptr), &ferry_dlpack_free);
    c.fn(c.user, t.index, &m->dl_tensor, static_cast<void*>(t.ready));
  };
}

int CheckReady(const CReady* ready, const char* function, ferry_error_t* error) {
  if (ready == nullptr) return FERRY_OK;
  if (ready->fn == nullptr) return NullArg(error, function, "on_ready");
  if (ready->hand_over != FERRY_HAND_OVER_COMPLETE &&
      ready->hand_over != FERRY_HAND_OVER_ENQUEUED) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(function, ": hand_over ", ready->hand_over,
                              " is neither FERRY_HAND_OVER_COMPLETE nor FERRY_HAND_OVER_ENQUEUED"));
  }
  return FERRY_OK;
}

ferry::HandOver ToHandOver(const CReady& c) {
  return c.hand_over == FERRY_HAND_OVER_ENQUEUED ? ferry::HandOver::kEnqueued
                                                 : ferry::HandOver::kComplete;
}

int RunLoad(ferry_loader_t* loader, const ferry_reader_t* reader,
            const ferry_load_request_t* requests, size_t num_requests,
            const ferry_allocator_t* allocator, DLManagedTensorVersioned** out, void* stream,
            int mode, const char* function, ferry_error_t* error, const CReady* ready = nullptr) {
  if (loader == nullptr) return NullArg(error, function, "loader");
  if (reader == nullptr) return NullArg(error, function, "reader");
  if (out == nullptr && num_requests == 0) return NullArg(error, function, "out");
  if (int rc = CheckReady(ready, function, error); rc != FERRY_OK) return rc;
  std::vector<ferry::LoadRequest> reqs;
  int rc = ToRequests(requests, num_requests, out != nullptr, &reqs, function, error);
  if (rc != FERRY_OK) return rc;
  ferry::DeviceAllocator dalloc;
  const ferry::DeviceAllocator* dalloc_ptr = nullptr;
  if (allocator != nullptr) {
    if (allocator->struct_size < sizeof(ferry_allocator_t) || allocator->allocate == nullptr) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(function, ": allocator needs struct_size and allocate"));
    }
    ferry_allocator_t a = *allocator;
    dalloc.allocate = [a](uint64_t bytes, ferry::Stream s) {
      return a.allocate(a.ctx, bytes, static_cast<void*>(s));
    };
    dalloc.deallocate = [a](void* p, uint64_t bytes, ferry::Stream s) {
      if (a.deallocate != nullptr) a.deallocate(a.ctx, p, bytes, static_cast<void*>(s));
    };
    dalloc_ptr = &dalloc;
  }
  auto s = static_cast<ferry::Stream>(stream);
  ferry::Result<std::vector<ferry::LoadedTensor>> result =
      ready != nullptr && mode == 2
          ? loader->loader->LoadToHostStreaming(*reader->reader, reqs, ToCallback(*ready))
      : ready != nullptr ? loader->loader->LoadStreaming(*reader->reader, reqs, ToCallback(*ready),
                                                         ToHandOver(*ready), s, dalloc_ptr)
      : mode == 0        ? loader->loader->LoadAsync(*reader->reader, reqs, s, dalloc_ptr)
      : mode == 1        ? loader->loader->Load(*reader->reader, reqs, s, dalloc_ptr)
                         : loader->loader->LoadToHost(*reader->reader, reqs);
  if (!result.ok()) return Report(result.status(), error);
  if (out != nullptr) ExportLoaded(*result, out);
  return FERRY_OK;
}

// Packed loads: one request per non-empty tensor, into dst at its packed offset.
int RunPacked(ferry_loader_t* loader, const ferry_reader_t* reader, void* dst, uint64_t dst_size,
              void* stream, int mode, const char* function, ferry_error_t* error,
              const CReady* ready = nullptr) {
  if (loader == nullptr) return NullArg(error, function, "loader");
  if (reader == nullptr) return NullArg(error, function, "reader");
  if (int rc = CheckReady(ready, function, error); rc != FERRY_OK) return rc;
  const TensorTable& table = Table(reader);
  if (table.packed_bytes == 0 && ready == nullptr) return FERRY_OK;
  if (dst == nullptr && table.packed_bytes > 0) return NullArg(error, function, "dst");
  if (dst_size < table.packed_bytes) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(function, ": ", reader->reader->path(), ": dst holds ", dst_size,
                              " bytes, a packed load needs ", table.packed_bytes));
  }
  std::vector<ferry::LoadRequest> reqs;
  reqs.reserve(table.records.size());
  // Streaming: every tensor is requested (empty ones too, so each is handed over), and the
  // request's position is the tensor's index.
  for (const ferry_tensor_record_t& rec : table.records) {
    if (rec.nbytes == 0 && ready == nullptr) continue;
    ferry::LoadRequest q;
    q.name.assign(table.names.data() + rec.name_offset, rec.name_size);
    q.dst = static_cast<uint8_t*>(dst) + rec.packed_offset;
    q.dst_bytes = rec.nbytes;
    reqs.push_back(std::move(q));
  }
  auto s = static_cast<ferry::Stream>(stream);
  ferry::Result<std::vector<ferry::LoadedTensor>> result =
      ready != nullptr ? loader->loader->LoadStreaming(*reader->reader, reqs, ToCallback(*ready),
                                                       ToHandOver(*ready), s)
      : mode == 0      ? loader->loader->LoadAsync(*reader->reader, reqs, s)
      : mode == 1      ? loader->loader->Load(*reader->reader, reqs, s)
                       : loader->loader->LoadToHost(*reader->reader, reqs);
  return result.ok() ? FERRY_OK : Report(result.status(), error);
}

}  // namespace

extern "C" {

// ---- status, version, dtypes ----------------------------------------------------------------

const char* ferry_status_name(int code) {
  if (code < FERRY_OK || code > FERRY_IO_ERROR) return "Unknown";
  return ferry::StatusCodeName(static_cast<StatusCode>(code));
}

const char* ferry_version(void) { return ferry::VersionString(); }

uint32_t ferry_format_version(void) { return ferry::kFormatVersion; }

const char* ferry_dtype_name(int32_t dtype) {
  if (!ValidDType(dtype)) return "?";
  return ferry::DTypeName(static_cast<ferry::DType>(dtype));
}

int ferry_dtype_parse(const char* name, int32_t* dtype, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(name);
    FERRY_C_REQUIRE(dtype);
    auto d = ferry::ParseDType(name);
    if (!d) {
      return Fail(error, FERRY_NOT_FOUND,
                  ferry::StrCat("ferry_dtype_parse: unknown dtype ", ferry::Quote(name)));
    }
    *dtype = static_cast<int32_t>(*d);
    return FERRY_OK;
  });
}

int ferry_dtype_storage_bytes(int32_t dtype, uint64_t numel, uint64_t* nbytes,
                              ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(nbytes);
    if (!ValidDType(dtype)) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat("ferry_dtype_storage_bytes: unknown dtype ", dtype));
    }
    auto n = ferry::StorageBytes(static_cast<ferry::DType>(dtype), numel);
    if (!n) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat("ferry_dtype_storage_bytes: ", numel, " elements overflow"));
    }
    *nbytes = *n;
    return FERRY_OK;
  });
}

int ferry_dtype_to_dlpack(int32_t dtype, DLDataType* out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(out);
    if (!ValidDType(dtype)) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat("ferry_dtype_to_dlpack: unknown dtype ", dtype));
    }
    *out = ToDl(static_cast<ferry::DType>(dtype));
    return FERRY_OK;
  });
}

int ferry_dtype_from_dlpack(DLDataType type, int32_t* dtype, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(dtype);
    ferry::DType d;
    if (!FromDl(type, &d)) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat("ferry_dtype_from_dlpack: no ferry dtype for DLPack code ",
                                int{type.code}, " bits ", int{type.bits}, " lanes ", type.lanes));
    }
    *dtype = static_cast<int32_t>(d);
    return FERRY_OK;
  });
}

// ---- DLPack helpers -------------------------------------------------------------------------

void ferry_dlpack_free(DLManagedTensorVersioned* tensor) {
  if (tensor != nullptr && tensor->deleter != nullptr) tensor->deleter(tensor);
}

int ferry_dlpack_to_legacy(DLManagedTensorVersioned* tensor, DLManagedTensor** out,
                           ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(tensor);
    FERRY_C_REQUIRE(out);
    auto ctx = std::make_unique<LegacyCtx>();
    ctx->versioned = tensor;
    ctx->legacy.dl_tensor = tensor->dl_tensor;
    ctx->legacy.manager_ctx = ctx.get();
    ctx->legacy.deleter = DeleteLegacy;
    *out = &ctx.release()->legacy;
    return FERRY_OK;
  });
}

void ferry_dlpack_legacy_free(DLManagedTensor* tensor) {
  if (tensor != nullptr && tensor->deleter != nullptr) tensor->deleter(tensor);
}

void ferry_dlpack_capsule_destructor(void* capsule) {
  // A destructor written in Python (ctypes) cannot work here: it runs while the consumer's
  // exception is pending, its first Python API call raises that exception inside the callback,
  // which swallows it, and the consumer then fails with SystemError and the tensor leaks.
  // These two functions touch no error state for a capsule of the name asked.
  using IsValidFn = int (*)(void*, const char*);
  using GetPointerFn = void* (*)(void*, const char*);
  static const auto is_valid =
      reinterpret_cast<IsValidFn>(::dlsym(RTLD_DEFAULT, "PyCapsule_IsValid"));
  static const auto get_pointer =
      reinterpret_cast<GetPointerFn>(::dlsym(RTLD_DEFAULT, "PyCapsule_GetPointer"));
  if (capsule == nullptr || is_valid == nullptr || get_pointer == nullptr) return;
  if (is_valid(capsule, "dltensor_versioned")) {
    ferry_dlpack_free(
        static_cast<DLManagedTensorVersioned*>(get_pointer(capsule, "dltensor_versioned")));
  } else if (is_valid(capsule, "dltensor")) {
    ferry_dlpack_legacy_free(static_cast<DLManagedTensor*>(get_pointer(capsule, "dltensor")));
  }
}

// ---- writer ---------------------------------------------------------------------------------

void ferry_writer_options_init(ferry_writer_options_t* options) {
  if (options == nullptr) return;
  ferry::WriterOptions d;
  std::memset(static_cast<void*>(options), 0, sizeof(*options));
  options->struct_size = sizeof(*options);
  options->block_size = d.block_size;
  options->encoding = static_cast<int32_t>(d.encoding);
  options->zstd_level = d.zstd_level;
  options->min_savings = d.min_savings;
  options->threads = d.threads;
  options->durable = d.durable ? 1 : 0;
  options->producer = nullptr;
  options->staging = nullptr;
  options->direct_io = d.direct_io ? 1 : 0;
}

namespace {
// ferry_writer_options_t -> WriterOptions (ferry_writer_create, ferry_convert).
int ToWriterOptions(const char* path, const ferry_writer_options_t* options, const char* fn,
                    ferry::WriterOptions* o, ferry_error_t* error) {
  if (options == nullptr) return FERRY_OK;
  int rc = CheckSized(options, fn, "options", error);
  if (rc != FERRY_OK) return rc;
  if (FERRY_C_HAS(options, block_size)) o->block_size = options->block_size;
  if (FERRY_C_HAS(options, encoding)) {
    if (options->encoding < FERRY_ENCODING_RAW || options->encoding > FERRY_ENCODING_PLANES) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(path, ": unknown default encoding ", options->encoding));
    }
    o->encoding = static_cast<ferry::Encoding>(options->encoding);
  }
  if (FERRY_C_HAS(options, zstd_level)) o->zstd_level = options->zstd_level;
  if (FERRY_C_HAS(options, min_savings)) o->min_savings = options->min_savings;
  if (FERRY_C_HAS(options, threads)) o->threads = options->threads;
  if (FERRY_C_HAS(options, durable)) o->durable = options->durable != 0;
  if (FERRY_C_HAS(options, producer) && options->producer != nullptr) {
    o->producer = options->producer;
  }
  if (FERRY_C_HAS(options, staging) && options->staging != nullptr) {
    o->staging = options->staging->pool;
  }
  if (FERRY_C_HAS(options, direct_io)) o->direct_io = options->direct_io != 0;
  if (FERRY_C_HAS(options, progress) && options->progress != nullptr) {
    auto* fn = options->progress;
    void* user = FERRY_C_HAS(options, progress_user) ? options->progress_user : nullptr;
    o->progress = [fn, user](uint64_t done) -> Status {
      const int32_t rc = fn(user, done);
      if (rc == 0) return Status::Ok();
      return Error(StatusCode::kIoError, "the progress callback stopped the save (it returned ", rc,
                   ")");
    };
  }
  return FERRY_OK;
}
}  // namespace

int ferry_writer_create(const char* path, const ferry_writer_options_t* options,
                        ferry_writer_t** out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(path);
    FERRY_C_REQUIRE(out);
    ferry::WriterOptions o;
    int rc = ToWriterOptions(path, options, fn, &o, error);
    if (rc != FERRY_OK) return rc;
    auto w = ferry::Writer::Create(path, std::move(o));
    if (!w.ok()) return Report(w.status(), error);
    *out = new ferry_writer_t(std::move(w).value());
    return FERRY_OK;
  });
}

int ferry_convert(const char* src, const char* dst, const ferry_writer_options_t* options,
                  ferry_error_t* error) {
  return ferry_convert_to(src, dst, nullptr, options, error);
}

int ferry_convert_to(const char* src, const char* dst, const char* format,
                     const ferry_writer_options_t* options, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(src);
    FERRY_C_REQUIRE(dst);
    ferry::WriterOptions o;
    int rc = ToWriterOptions(dst, options, fn, &o, error);
    if (rc != FERRY_OK) return rc;
    return Report(ferry::torch_import::ConvertCheckpoint(src, dst, o, format ? format : ""), error);
  });
}

// Argument checks shared by the functions that add one tensor to a writer.
static int CheckAddArgs(const ferry_writer_t* writer, const char* name, int32_t dtype,
                        const int64_t* shape, int32_t ndim, int32_t encoding, const char* function,
                        ferry_error_t* error) {
  if (writer->spent) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(writer->writer.path(), ": writer already committed"));
  }
  if (ndim < 0 || (ndim > 0 && shape == nullptr)) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(writer->writer.path(), ": tensor ", ferry::Quote(name),
                              ": bad shape (ndim ", ndim, ")"));
  }
  if (!ValidDType(dtype)) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(writer->writer.path(), ": tensor ", ferry::Quote(name),
                              ": unknown dtype ", dtype));
  }
  return CheckEncoding(encoding, function, error);
}

int ferry_writer_add_tensor(ferry_writer_t* writer, const char* name, int32_t dtype,
                            const int64_t* shape, int32_t ndim, const void* data, uint64_t nbytes,
                            int32_t encoding, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(writer);
    FERRY_C_REQUIRE(name);
    int rc = CheckAddArgs(writer, name, dtype, shape, ndim, encoding, fn, error);
    if (rc != FERRY_OK) return rc;
    std::vector<int64_t> dims(shape, shape + ndim);
    auto dt = static_cast<ferry::DType>(dtype);
    Status st = encoding == FERRY_ENCODING_DEFAULT
                    ? writer->writer.AddTensor(name, dt, dims, data, nbytes)
                    : writer->writer.AddTensor(name, dt, dims, data, nbytes,
                                               static_cast<ferry::Encoding>(encoding));
    return Report(st, error);
  });
}

int ferry_writer_add_device_tensor_async(ferry_writer_t* writer, const char* name, int32_t dtype,
                                         const int64_t* shape, int32_t ndim, const void* data,
                                         uint64_t nbytes, int32_t encoding, void* stream,
                                         ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(writer);
    FERRY_C_REQUIRE(name);
    int rc = CheckAddArgs(writer, name, dtype, shape, ndim, encoding, fn, error);
    if (rc != FERRY_OK) return rc;
    std::vector<int64_t> dims(shape, shape + ndim);
    auto dt = static_cast<ferry::DType>(dtype);
    auto s = static_cast<ferry::Stream>(stream);
    Status st = encoding == FERRY_ENCODING_DEFAULT
                    ? writer->writer.AddDeviceTensor(name, dt, dims, data, nbytes, s)
                    : writer->writer.AddDeviceTensor(name, dt, dims, data, nbytes, s,
                                                     static_cast<ferry::Encoding>(encoding));
    return Report(st, error);
  });
}

int ferry_writer_wait_snapshot(ferry_writer_t* writer, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(writer);
    return Report(writer->writer.WaitSnapshot(), error);
  });
}

int ferry_writer_add_dltensor(ferry_writer_t* writer, const char* name, const DLTensor* tensor,
                              int32_t encoding, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(writer);
    FERRY_C_REQUIRE(name);
    FERRY_C_REQUIRE(tensor);
    auto where = [&] {
      return ferry::StrCat(writer->writer.path(), ": tensor ", ferry::Quote(name));
    };
    DLDeviceType dev = tensor->device.device_type;
    if (dev != kDLCPU && dev != kDLCUDAHost && dev != kDLCUDAManaged) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(where(), ": DLTensor is not in host memory (device type ",
                                static_cast<int>(dev), "); copy it to the host first"));
    }
    ferry::DType dt;
    if (!FromDl(tensor->dtype, &dt)) {
      return Fail(
          error, FERRY_INVALID_ARGUMENT,
          ferry::StrCat(where(), ": unsupported DLPack dtype code ", int{tensor->dtype.code},
                        " bits ", int{tensor->dtype.bits}, " lanes ", tensor->dtype.lanes));
    }
    if (tensor->ndim < 0 || (tensor->ndim > 0 && tensor->shape == nullptr)) {
      return Fail(error, FERRY_INVALID_ARGUMENT, ferry::StrCat(where(), ": bad DLTensor shape"));
    }
    std::vector<int64_t> dims(tensor->shape, tensor->shape + tensor->ndim);
    if (tensor->strides != nullptr) {
      int64_t expect = 1;
      for (int32_t d = tensor->ndim - 1; d >= 0; --d) {
        if (dims[d] != 1 && tensor->strides[d] != expect) {
          return Fail(error, FERRY_INVALID_ARGUMENT,
                      ferry::StrCat(where(), ": DLTensor is not dense row-major (dim ", d,
                                    " stride ", tensor->strides[d], ", expected ", expect, ")"));
        }
        expect *= dims[d];
      }
    }
    auto numel = ferry::NumElements(dims);
    if (!numel) {
      return Fail(error, FERRY_INVALID_ARGUMENT, ferry::StrCat(where(), ": bad DLTensor shape"));
    }
    auto nbytes = ferry::StorageBytes(dt, *numel);
    if (!nbytes) {
      return Fail(error, FERRY_INVALID_ARGUMENT, ferry::StrCat(where(), ": size overflows"));
    }
    const void* data = static_cast<const char*>(tensor->data) + tensor->byte_offset;
    return ferry_writer_add_tensor(writer, name, static_cast<int32_t>(dt), dims.data(),
                                   tensor->ndim, data, *nbytes, encoding, error);
  });
}

int ferry_writer_set_metadata(ferry_writer_t* writer, const char* key, const char* value,
                              ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(writer);
    FERRY_C_REQUIRE(key);
    FERRY_C_REQUIRE(value);
    return Report(writer->writer.SetMetadata(key, value), error);
  });
}

void ferry_recipe_init(ferry_recipe_t* recipe, int32_t kind) {
  if (recipe == nullptr) return;
  std::memset(static_cast<void*>(recipe), 0, sizeof(*recipe));
  recipe->struct_size = sizeof(*recipe);
  recipe->kind = kind;
  ferry::DelayedScaling delayed;
  ferry::Float8BlockScaling block;
  recipe->margin = delayed.margin;
  recipe->amax_history_len = delayed.amax_history_len;
  recipe->amax_compute_algo = static_cast<int32_t>(delayed.amax_compute_algo);
  recipe->reduce_amax = delayed.reduce_amax;
  recipe->x_block_scaling_dim = block.x_block_scaling_dim;
  recipe->w_block_scaling_dim = block.w_block_scaling_dim;
  recipe->grad_block_scaling_dim = block.grad_block_scaling_dim;
  switch (kind) {
    case FERRY_RECIPE_DELAYED_SCALING:
    case FERRY_RECIPE_FLOAT8_CURRENT_SCALING:
      recipe->fp8_format = FERRY_FP8_FORMAT_HYBRID;
      break;
    default:
      recipe->fp8_format = FERRY_FP8_FORMAT_E4M3;
      break;
  }
}

int ferry_writer_add_scaling_state(ferry_writer_t* writer, const char* module,
                                   const ferry_recipe_t* recipe,
                                   const ferry_direction_state_t* states, size_t num_states,
                                   ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(writer);
    FERRY_C_REQUIRE(module);
    FERRY_C_REQUIRE(recipe);
    if (num_states > 0 && states == nullptr) return NullArg(error, fn, "states");
    int rc = CheckSized(recipe, fn, "recipe", error);
    if (rc != FERRY_OK) return rc;
    ferry::ScalingState s;
    s.module = module;
    rc = ToRecipe(*recipe, &s.recipe, fn, error);
    if (rc != FERRY_OK) return rc;
    auto where = [&](size_t i) {
      return ferry::StrCat(writer->writer.path(), ": scaling state ", ferry::Quote(module),
                           " direction ", i);
    };
    for (size_t i = 0; i < num_states; ++i) {
      const ferry_direction_state_t& c = states[i];
      if (c.direction != FERRY_DIRECTION_FORWARD && c.direction != FERRY_DIRECTION_BACKWARD) {
        return Fail(error, FERRY_INVALID_ARGUMENT,
                    ferry::StrCat(where(i), ": invalid direction ", c.direction));
      }
      if (c.num_slots < 0 || c.history_len < 0) {
        return Fail(error, FERRY_INVALID_ARGUMENT,
                    ferry::StrCat(where(i), ": negative num_slots or history_len"));
      }
      size_t slots = static_cast<size_t>(c.num_slots);
      size_t hist = slots * static_cast<size_t>(c.history_len);
      if ((slots > 0 && (c.slot_roles == nullptr || c.scale == nullptr)) ||
          (hist > 0 && c.amax_history == nullptr)) {
        return Fail(error, FERRY_INVALID_ARGUMENT,
                    ferry::StrCat(where(i), ": slot_roles, scale or amax_history is NULL"));
      }
      ferry::DirectionState d;
      d.direction = static_cast<ferry::Direction>(c.direction);
      d.num_gemms = c.num_gemms;
      for (size_t k = 0; k < slots; ++k) {
        if (c.slot_roles[k] < FERRY_SLOT_INPUT || c.slot_roles[k] > FERRY_SLOT_GRAD_INPUT) {
          return Fail(
              error, FERRY_INVALID_ARGUMENT,
              ferry::StrCat(where(i), ": invalid slot role ", c.slot_roles[k], " in slot ", k));
        }
        d.slot_roles.push_back(static_cast<ferry::SlotRole>(c.slot_roles[k]));
      }
      if (slots > 0) d.scale.assign(c.scale, c.scale + slots);
      if (hist > 0) d.amax_history.assign(c.amax_history, c.amax_history + hist);
      d.history_len = c.history_len;
      s.states.push_back(std::move(d));
    }
    return Report(writer->writer.AddScalingState(s), error);
  });
}

int ferry_writer_commit(ferry_writer_t* writer, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(writer);
    if (writer->spent) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(writer->writer.path(), ": writer already committed"));
    }
    writer->spent = true;
    return Report(writer->writer.Commit(), error);
  });
}

int ferry_writer_commit_async(ferry_writer_t* writer, ferry_save_t** out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(writer);
    FERRY_C_REQUIRE(out);
    if (writer->spent) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(writer->writer.path(), ": writer already committed"));
    }
    writer->spent = true;
    auto h = writer->writer.CommitAsync();
    if (!h.ok()) return Report(h.status(), error);
    *out = new ferry_save_t{std::move(h).value()};
    return FERRY_OK;
  });
}

int ferry_save_wait(ferry_save_t* save, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(save);
    return Report(save->handle.Wait(), error);
  });
}

int ferry_save_done(const ferry_save_t* save) {
  try {
    return save == nullptr || save->handle.done() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

void ferry_save_free(ferry_save_t* save) {
  if (save == nullptr) return;
  try {
    delete save;  // ~SaveHandle waits for the save
  } catch (...) {
  }
}

int ferry_staging_pool_create(uint64_t bytes, int32_t pin, ferry_staging_pool_t** out,
                              ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(out);
    auto pool = ferry::StagingPool::Create(bytes, pin != 0);
    if (!pool.ok()) return Report(pool.status(), error);
    *out = new ferry_staging_pool_t{std::move(pool).value()};
    return FERRY_OK;
  });
}

uint64_t ferry_staging_pool_bytes(const ferry_staging_pool_t* pool) {
  return pool != nullptr ? pool->pool->bytes() : 0;
}

void ferry_staging_pool_free(ferry_staging_pool_t* pool) {
  if (pool == nullptr) return;
  try {
    delete pool;
  } catch (...) {
  }
}

int ferry_write_shard_index(const char* index_path, const char* const* shard_files,
                            size_t num_files, const char* const* metadata_keys,
                            const char* const* metadata_values, size_t num_metadata,
                            ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(index_path);
    if (num_files > 0 && shard_files == nullptr) return NullArg(error, fn, "shard_files");
    if (num_metadata > 0 && (metadata_keys == nullptr || metadata_values == nullptr)) {
      return NullArg(error, fn, "metadata_keys");
    }
    std::vector<std::string> files;
    for (size_t i = 0; i < num_files; ++i) {
      if (shard_files[i] == nullptr) return NullArg(error, fn, "shard_files[i]");
      files.emplace_back(shard_files[i]);
    }
    std::vector<std::pair<std::string, std::string>> md;
    for (size_t i = 0; i < num_metadata; ++i) {
      if (metadata_keys[i] == nullptr || metadata_values[i] == nullptr) {
        return NullArg(error, fn, "metadata_keys[i]");
      }
      md.emplace_back(metadata_keys[i], metadata_values[i]);
    }
    return Report(ferry::WriteShardIndex(index_path, files, md), error);
  });
}

void ferry_writer_abort(ferry_writer_t* writer) {
  if (writer == nullptr) return;
  try {
    writer->writer.Abort();
  } catch (...) {
  }
}

void ferry_writer_free(ferry_writer_t* writer) {
  if (writer == nullptr) return;
  try {
    delete writer;  // ~Writer aborts an uncommitted file
  } catch (...) {
  }
}

// ---- reader ---------------------------------------------------------------------------------

void ferry_reader_options_init(ferry_reader_options_t* options) {
  if (options == nullptr) return;
  std::memset(static_cast<void*>(options), 0, sizeof(*options));
  options->struct_size = sizeof(*options);
  options->verify_on_open = 0;
}

int ferry_reader_open(const char* path, const ferry_reader_options_t* options, ferry_reader_t** out,
                      ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(path);
    FERRY_C_REQUIRE(out);
    return OpenWithOptions(
        path, options, fn, error,
        [](const char* p, const ferry::ReaderOptions& o) { return ferry::Reader::Open(p, o); },
        [&](std::shared_ptr<ferry::Reader> r) { *out = WrapReader(std::move(r)).release(); });
  });
}

void ferry_reader_free(ferry_reader_t* reader) { delete reader; }

const char* ferry_reader_path(const ferry_reader_t* reader) {
  return reader == nullptr ? "" : reader->reader->path().c_str();
}

uint64_t ferry_reader_file_size(const ferry_reader_t* reader) {
  return reader == nullptr ? 0 : reader->reader->file_size();
}

uint32_t ferry_reader_format_version(const ferry_reader_t* reader) {
  return reader == nullptr ? 0 : reader->reader->format_version();
}

const char* ferry_reader_producer(const ferry_reader_t* reader) {
  return reader == nullptr ? "" : reader->producer.c_str();
}

size_t ferry_reader_num_tensors(const ferry_reader_t* reader) {
  return reader == nullptr ? 0 : reader->num_tensors;
}

int ferry_reader_tensor_info(const ferry_reader_t* reader, size_t index, ferry_tensor_info_t* info,
                             ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(info);
    if (index >= reader->num_tensors) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(reader->reader->path(), ": tensor index ", index, " out of range (",
                                reader->num_tensors, " tensors)"));
    }
    FillInfo(Table(reader), index, info);
    return FERRY_OK;
  });
}

int ferry_reader_tensor_table(const ferry_reader_t* reader, ferry_tensor_table_t* table,
                              ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(table);
    if (int rc = CheckSized(table, fn, "table", error); rc != FERRY_OK) return rc;
    const TensorTable& t = Table(reader);
    ferry_tensor_table_t full;
    full.struct_size = sizeof(full);
    full.num_tensors = t.records.size();
    full.record_size = sizeof(ferry_tensor_record_t);
    full.records = t.records.data();
    full.names = t.names.data();
    full.names_size = t.names.size();
    full.shapes = t.shapes.data();
    full.num_shape_entries = t.shapes.size();
    full.packed_bytes = t.packed_bytes;
    FillSized(full, table);
    return FERRY_OK;
  });
}

int ferry_reader_find_tensor(const ferry_reader_t* reader, const char* name,
                             ferry_tensor_info_t* info, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(name);
    FERRY_C_REQUIRE(info);
    auto found = reader->reader->Find(name);
    if (!found.ok()) return Report(found.status(), error);
    FillInfo(Table(reader), found->index, info);
    return FERRY_OK;
  });
}

size_t ferry_reader_num_metadata(const ferry_reader_t* reader) {
  return reader == nullptr ? 0 : reader->metadata.size();
}

int ferry_reader_metadata_at(const ferry_reader_t* reader, size_t index, const char** key,
                             const char** value, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    if (index >= reader->metadata.size()) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(reader->reader->path(), ": metadata index ", index,
                                " out of range (", reader->metadata.size(), " entries)"));
    }
    if (key != nullptr) *key = reader->metadata[index].first.c_str();
    if (value != nullptr) *value = reader->metadata[index].second.c_str();
    return FERRY_OK;
  });
}

int ferry_reader_metadata_entry(const ferry_reader_t* reader, size_t index, const char** key,
                                size_t* key_size, const char** value, size_t* value_size,
                                ferry_error_t* error) {
  int rc = ferry_reader_metadata_at(reader, index, key, value, error);
  if (rc != FERRY_OK) return rc;
  if (key_size != nullptr) *key_size = reader->metadata[index].first.size();
  if (value_size != nullptr) *value_size = reader->metadata[index].second.size();
  return FERRY_OK;
}

int ferry_reader_metadata_get(const ferry_reader_t* reader, const char* key, const char** value,
                              ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(key);
    FERRY_C_REQUIRE(value);
    const auto& md = reader->metadata;
    auto it = std::lower_bound(md.begin(), md.end(), std::string_view(key),
                               [](const auto& kv, std::string_view k) { return kv.first < k; });
    if (it == md.end() || it->first != key) {
      return Fail(error, FERRY_NOT_FOUND,
                  ferry::StrCat(reader->reader->path(), ": no metadata key ", ferry::Quote(key)));
    }
    *value = it->second.c_str();
    return FERRY_OK;
  });
}

size_t ferry_reader_num_scaling_states(const ferry_reader_t* reader) {
  return reader == nullptr ? 0 : reader->scaling.size();
}

int ferry_reader_scaling_state_at(const ferry_reader_t* reader, size_t index,
                                  ferry_scaling_state_t* state, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(state);
    if (index >= reader->scaling.size()) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(reader->reader->path(), ": scaling state index ", index,
                                " out of range (", reader->scaling.size(), " states)"));
    }
    FillScaling(*reader->scaling[index], state);
    return FERRY_OK;
  });
}

int ferry_reader_find_scaling_state(const ferry_reader_t* reader, const char* module,
                                    ferry_scaling_state_t* state, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(module);
    FERRY_C_REQUIRE(state);
    for (const auto& s : reader->scaling) {
      if (s->module == module) {
        FillScaling(*s, state);
        return FERRY_OK;
      }
    }
    return Fail(error, FERRY_NOT_FOUND,
                ferry::StrCat(reader->reader->path(), ": no scaling state for module ",
                              ferry::Quote(module)));
  });
}

int ferry_reader_view(const ferry_reader_t* reader, const char* name, uint32_t flags,
                      DLManagedTensorVersioned** out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(name);
    FERRY_C_REQUIRE(out);
    auto view = reader->reader->View(name, ReadFlags(flags));
    if (!view.ok()) return Report(view.status(), error);
    DLDevice dev;
    dev.device_type = kDLCPU;
    dev.device_id = 0;
    // Consumers may ignore DLPack's read-only flag (torch does) and write: the reader's own
    // mapping is read-only (a write would fault) and shared (it would reach the file). The view
    // maps its bytes again, privately: a write copies the page into this process.
    std::shared_ptr<ferry::PrivateRegion> region;
    if (view->nbytes > 0) {
      const ferry::Mapping& file = *ferry::BlocksOf(*reader->reader).mapping();
      auto mapped = ferry::PrivateRegion::Map(file, view->info.data_offset, view->nbytes);
      if (!mapped.ok()) return Report(mapped.status(), error);
      region = std::move(*mapped);
    }
    void* data = region ? region->data() : nullptr;
    *out = MakeManaged(view->info, data, dev, 0, std::move(region));
    return FERRY_OK;
  });
}

int ferry_reader_view_file(const ferry_reader_t* reader, DLManagedTensorVersioned** out,
                           ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(out);
    // Private, as in ferry_reader_view: consumers may write whatever the read-only flag says.
    const auto& mapping = ferry::BlocksOf(*reader->reader).mapping();
    if (!mapping) {
      return Fail(error, FERRY_UNIMPLEMENTED,
                  ferry::StrCat(reader->reader->path(), ": not a mapped local file"));
    }
    const ferry::Mapping& file = *mapping;
    auto mapped = ferry::PrivateRegion::Map(file, 0, file.size());
    if (!mapped.ok()) return Report(mapped.status(), error);
    ferry::TensorInfo info;
    info.name = reader->reader->path();
    info.dtype = ferry::DType::kU8;
    info.shape = {static_cast<int64_t>(file.size())};
    info.nbytes = file.size();
    DLDevice dev;
    dev.device_type = kDLCPU;
    dev.device_id = 0;
    void* data = (*mapped)->data();
    *out = MakeManaged(info, data, dev, 0, std::move(*mapped));
    return FERRY_OK;
  });
}

int ferry_reader_read_into(const ferry_reader_t* reader, const char* name, void* dst,
                           uint64_t dst_size, uint32_t flags, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(name);
    // A NULL destination must not reach the copy (dst_size alone cannot tell).
    if (dst == nullptr && dst_size > 0) return NullArg(error, fn, "dst");
    return Report(reader->reader->ReadInto(name, dst, dst_size, ReadFlags(flags)), error);
  });
}

int ferry_reader_read_rows_into(const ferry_reader_t* reader, const char* name, int64_t row_begin,
                                int64_t row_end, void* dst, uint64_t dst_size, uint32_t flags,
                                ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(name);
    // A NULL destination must not reach the copy (dst_size alone cannot tell).
    if (dst == nullptr && dst_size > 0) return NullArg(error, fn, "dst");
    return Report(
        reader->reader->ReadRowsInto(name, row_begin, row_end, dst, dst_size, ReadFlags(flags)),
        error);
  });
}

int ferry_reader_verify(const ferry_reader_t* reader, const char* name, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    return Report(name == nullptr ? reader->reader->VerifyAll() : reader->reader->Verify(name),
                  error);
  });
}

// ---- loader ---------------------------------------------------------------------------------

void ferry_loader_options_init(ferry_loader_options_t* options) {
  if (options == nullptr) return;
  ferry::LoaderOptions d;
  std::memset(static_cast<void*>(options), 0, sizeof(*options));
  options->struct_size = sizeof(*options);
  options->staging_bytes = d.staging_bytes;
  options->slot_bytes = d.slot_bytes;
  options->threads = d.threads;
  options->host_path = static_cast<int32_t>(d.host_path);
  options->pinned_alloc = static_cast<int32_t>(d.pinned_alloc);
  options->verify = d.verify ? 1 : 0;
  options->io = static_cast<int32_t>(d.io);
  options->register_window_bytes = d.register_window_bytes;
  options->streaming_stores = d.streaming_stores ? 1 : 0;
}

int ferry_cuda_available(void) {
  try {
    return ferry::CudaAvailable() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

int ferry_loader_create(const ferry_loader_options_t* options, ferry_loader_t** out,
                        ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(out);
    ferry::LoaderOptions o;
    if (options != nullptr) {
      int rc = CheckSized(options, fn, "options", error);
      if (rc != FERRY_OK) return rc;
      if (FERRY_C_HAS(options, staging_bytes)) o.staging_bytes = options->staging_bytes;
      if (FERRY_C_HAS(options, slot_bytes)) o.slot_bytes = options->slot_bytes;
      if (FERRY_C_HAS(options, threads)) o.threads = options->threads;
      if (FERRY_C_HAS(options, host_path)) {
        if (options->host_path < FERRY_HOST_PATH_AUTO ||
            options->host_path > FERRY_HOST_PATH_REGISTER_WINDOWS) {
          return Fail(error, FERRY_INVALID_ARGUMENT,
                      ferry::StrCat("ferry_loader_create: unknown host_path ", options->host_path));
        }
        o.host_path = static_cast<ferry::HostPath>(options->host_path);
      }
      if (FERRY_C_HAS(options, pinned_alloc)) {
        if (options->pinned_alloc < FERRY_PINNED_HOST_REGISTER ||
            options->pinned_alloc > FERRY_PINNED_HOST_ALLOC) {
          return Fail(
              error, FERRY_INVALID_ARGUMENT,
              ferry::StrCat("ferry_loader_create: unknown pinned_alloc ", options->pinned_alloc));
        }
        o.pinned_alloc = static_cast<ferry::PinnedAlloc>(options->pinned_alloc);
      }
      if (FERRY_C_HAS(options, verify)) o.verify = options->verify != 0;
      if (FERRY_C_HAS(options, io)) {
        if (options->io < FERRY_IO_AUTO || options->io > FERRY_IO_DIRECT) {
          return Fail(error, FERRY_INVALID_ARGUMENT,
                      ferry::StrCat("ferry_loader_create: unknown io ", options->io));
        }
        o.io = static_cast<ferry::IoMode>(options->io);
      }
      if (FERRY_C_HAS(options, register_window_bytes)) {
        o.register_window_bytes = options->register_window_bytes;
      }
      if (FERRY_C_HAS(options, streaming_stores)) {
        o.streaming_stores = options->streaming_stores != 0;
      }
    }
    auto l = ferry::Loader::Create(o);
    if (!l.ok()) return Report(l.status(), error);
    auto h = std::make_unique<ferry_loader_t>();
    h->loader = std::move(l).value();
    *out = h.release();
    return FERRY_OK;
  });
}

void ferry_loader_free(ferry_loader_t* loader) {
  try {
    delete loader;
  } catch (...) {
  }
}

void ferry_load_request_init(ferry_load_request_t* request, const char* name) {
  if (request == nullptr) return;
  request->name = name;
  request->row_begin = 0;
  request->row_end = -1;
  request->dst = nullptr;
  request->dst_bytes = 0;
}

int ferry_loader_load_async(ferry_loader_t* loader, const ferry_reader_t* reader,
                            const ferry_load_request_t* requests, size_t num_requests,
                            const ferry_allocator_t* allocator, DLManagedTensorVersioned** out,
                            void* stream, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return RunLoad(loader, reader, requests, num_requests, allocator, out, stream, 0,
                   "ferry_loader_load_async", error);
  });
}

int ferry_loader_load(ferry_loader_t* loader, const ferry_reader_t* reader,
                      const ferry_load_request_t* requests, size_t num_requests,
                      const ferry_allocator_t* allocator, DLManagedTensorVersioned** out,
                      void* stream, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return RunLoad(loader, reader, requests, num_requests, allocator, out, stream, 1,
                   "ferry_loader_load", error);
  });
}

int ferry_loader_load_to_host(ferry_loader_t* loader, const ferry_reader_t* reader,
                              const ferry_load_request_t* requests, size_t num_requests,
                              DLManagedTensorVersioned** out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return RunLoad(loader, reader, requests, num_requests, nullptr, out, nullptr, 2,
                   "ferry_loader_load_to_host", error);
  });
}

int ferry_loader_load_packed_async(ferry_loader_t* loader, const ferry_reader_t* reader, void* dst,
                                   uint64_t dst_size, void* stream, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return RunPacked(loader, reader, dst, dst_size, stream, 0, fn, error);
  });
}

int ferry_loader_load_packed(ferry_loader_t* loader, const ferry_reader_t* reader, void* dst,
                             uint64_t dst_size, void* stream, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return RunPacked(loader, reader, dst, dst_size, stream, 1, fn, error);
  });
}

int ferry_loader_load_to_host_packed(ferry_loader_t* loader, const ferry_reader_t* reader,
                                     void* dst, uint64_t dst_size, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return RunPacked(loader, reader, dst, dst_size, nullptr, 2, fn, error);
  });
}

int ferry_loader_load_streaming(ferry_loader_t* loader, const ferry_reader_t* reader,
                                const ferry_load_request_t* requests, size_t num_requests,
                                const ferry_allocator_t* allocator, int32_t hand_over,
                                ferry_ready_fn on_ready, void* user, DLManagedTensorVersioned** out,
                                void* stream, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    CReady ready{on_ready, user, hand_over};
    return RunLoad(loader, reader, requests, num_requests, allocator, out, stream, 0, fn, error,
                   &ready);
  });
}

int ferry_loader_load_to_host_streaming(ferry_loader_t* loader, const ferry_reader_t* reader,
                                        const ferry_load_request_t* requests, size_t num_requests,
                                        ferry_ready_fn on_ready, void* user,
                                        DLManagedTensorVersioned** out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    CReady ready{on_ready, user, FERRY_HAND_OVER_COMPLETE};
    return RunLoad(loader, reader, requests, num_requests, nullptr, out, nullptr, 2, fn, error,
                   &ready);
  });
}

int ferry_loader_load_packed_streaming(ferry_loader_t* loader, const ferry_reader_t* reader,
                                       void* dst, uint64_t dst_size, int32_t hand_over,
                                       ferry_ready_fn on_ready, void* user, void* stream,
                                       ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    CReady ready{on_ready, user, hand_over};
    return RunPacked(loader, reader, dst, dst_size, stream, 0, fn, error, &ready);
  });
}

// ---- sharded checkpoints and distributed plans ------------------------------------------

int ferry_sharded_open(const char* path, const ferry_reader_options_t* options,
                       ferry_sharded_t** out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(path);
    FERRY_C_REQUIRE(out);
    return OpenWithOptions(path, options, fn, error, ferry::ShardedCheckpoint::Open,
                           [&](std::shared_ptr<ferry::ShardedCheckpoint> s) {
                             *out = new ferry_sharded_t{std::move(s)};
                           });
  });
}

void ferry_sharded_free(ferry_sharded_t* sharded) { delete sharded; }

size_t ferry_sharded_num_shards(const ferry_sharded_t* sharded) {
  return sharded == nullptr ? 0 : sharded->sharded->num_shards();
}

int ferry_sharded_shard(const ferry_sharded_t* sharded, size_t shard, ferry_reader_t** out,
                        ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(sharded);
    FERRY_C_REQUIRE(out);
    if (shard >= sharded->sharded->num_shards()) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(sharded->sharded->path(), ": no shard ", shard, " (of ",
                                sharded->sharded->num_shards(), ")"));
    }
    *out = WrapReader(sharded->sharded->shard(shard)).release();
    return FERRY_OK;
  });
}

int ferry_sharded_find(const ferry_sharded_t* sharded, const char* name, size_t* shard,
                       ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(sharded);
    FERRY_C_REQUIRE(name);
    FERRY_C_REQUIRE(shard);
    auto loc = sharded->sharded->Find(name);
    if (!loc.ok()) return Report(loc.status(), error);
    *shard = loc->shard;
    return FERRY_OK;
  });
}

int ferry_split_plan(const ferry_plan_item_t* items, size_t num_items, int32_t nranks,
                     int32_t rounds, ferry_plan_piece_t* pieces, size_t capacity, size_t* count,
                     ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(count);
    if (num_items > 0) FERRY_C_REQUIRE(items);
    if (nranks < 1 || rounds < 1) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat("ferry_split_plan: nranks ", nranks, " and rounds ", rounds,
                                " must be at least 1"));
    }
    std::vector<ferry::PlanItem> in(num_items);
    for (size_t i = 0; i < num_items; ++i) in[i] = {items[i].bytes, items[i].row_bytes};
    std::vector<ferry::PlanPiece> plan = ferry::SplitPlan(in, nranks, rounds);
    *count = plan.size();
    if (capacity < plan.size()) return FERRY_OK;
    if (!plan.empty()) FERRY_C_REQUIRE(pieces);
    for (size_t i = 0; i < plan.size(); ++i) {
      pieces[i] = {plan[i].item, plan[i].segment, plan[i].begin, plan[i].len};
    }
    return FERRY_OK;
  });
}

}  // extern "C"
