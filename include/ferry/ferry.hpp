// TensorFerry C++ API: write and read device-agnostic tensor checkpoints.
//
// A checkpoint file stores tensors, FP8/FP4 scaling state and string metadata, and nothing
// about the device it was saved from. Loading onto a GPU (ferry/loader.hpp) always targets the
// caller's current device and stream.
//
// Handles and threads:
// - Writer: owned by its creator (move-only); one thread at a time. Its worker threads run in
//   the background between calls; CommitAsync hands the rest of the save to a SaveHandle.
// - StagingPool: shared (std::shared_ptr); thread-safe, any number of writers may use one at
//   once (they then wait for each other's slots).
// - SaveHandle: owned by its holder (move-only); Wait and done may be called from any thread.
// - Reader: shared (std::shared_ptr); immutable after Open, so every const method may be
//   called from any number of threads at once. HostView objects keep the file mapping alive
//   on their own, so a view may outlive the Reader it came from.
#ifndef FERRY_FERRY_HPP_
#define FERRY_FERRY_HPP_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "ferry/status.hpp"
#include "ferry/version.h"

struct CUstream_st;

namespace ferry {

// Same type as cudaStream_t / CUstream, without including CUDA headers (also in loader.hpp).
using Stream = CUstream_st*;

// Runtime version, "MAJOR.MINOR.PATCH"; compare with FERRY_VERSION_STRING for header skew.
FERRY_API const char* VersionString();

// The format version this build writes (and the newest it reads).
inline constexpr uint32_t kFormatVersion = 1;

// Element types. Values equal the schema's (schema/ferry.fbs) and are pinned forever.
enum class DType : uint8_t {
  kBool = 0,
  kU8 = 1,
  kU16 = 2,
  kU32 = 3,
  kU64 = 4,
  kI8 = 5,
  kI16 = 6,
  kI32 = 7,
  kI64 = 8,
  kF16 = 9,
  kBF16 = 10,
  kF32 = 11,
  kF64 = 12,
  kC64 = 13,
  kC128 = 14,
  kF8_E4M3FN = 15,
  kF8_E5M2 = 16,
  kF8_E8M0FNU = 17,
  kF8_E4M3FNUZ = 18,
  kF8_E5M2FNUZ = 19,
  kF6_E2M3FN = 20,
  kF6_E3M2FN = 21,
  kF4_E2M1FN = 22,  // two per byte, element 2i in the low nibble
};
inline constexpr int kNumDTypes = 23;

// "BF16", "F8_E4M3FN", ... (the schema's names); "?" for values out of range.
FERRY_API const char* DTypeName(DType dtype);
// Parses a DTypeName; nullopt when unknown.
FERRY_API std::optional<DType> ParseDType(std::string_view name);
// Bits per element in storage: 4 for F4_E2M1FN, 8 for F6 (one per byte), 8*itemsize otherwise.
FERRY_API int DTypeStorageBits(DType dtype);
FERRY_API bool IsValidDType(uint8_t value);
// Stored bytes of `numel` elements (ceil(numel/2) for F4). nullopt on overflow.
FERRY_API std::optional<uint64_t> StorageBytes(DType dtype, uint64_t numel);
// Product of dims; nullopt on a negative dim or overflow.
FERRY_API std::optional<uint64_t> NumElements(const std::vector<int64_t>& shape);

// kPlanes: byte planes with Huffman-coded exponent planes, decoded on the GPU by the loader
// (on the CPU elsewhere); for bf16/f16 weights (docs/PLANES.md).
enum class Encoding : uint8_t { kRaw = 0, kZstd = 1, kShuffleZstd = 2, kPlanes = 3 };
FERRY_API const char* EncodingName(Encoding encoding);

// Description of one stored tensor. Cheap to copy; independent of the Reader's lifetime.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;       // raw bytes
  uint64_t data_offset = 0;  // absolute file offset of the stored bytes
  uint64_t data_size = 0;    // stored bytes (== nbytes for kRaw)
  Encoding encoding = Encoding::kRaw;
  uint64_t block_size = 0;  // raw bytes per checksum block / chunk
  size_t index = 0;         // position in the Reader's name-sorted tensor list
  // Tensor-parallel slices (Writer::SetGlobalSlice): the whole tensor's shape and where this
  // stored tensor starts inside it, one entry per dimension. Both empty for an ordinary
  // tensor. They describe the stored tensor; a row-range load changes `shape` only.
  std::vector<int64_t> global_shape;
  std::vector<int64_t> shard_offset;
};

// ---- FP8 / FP4 scaling metadata (TransformerEngine recipes), never pickled ----------------

enum class Fp8Format : uint8_t { kE4M3 = 0, kE5M2 = 1, kHybrid = 2 };
enum class AmaxComputeAlgo : uint8_t { kMax = 0, kMostRecent = 1 };
enum class ScalingMode : uint8_t {
  kPerTensor = 0,
  kMxfp8_1x32 = 1,
  kBlock_1x128 = 2,
  kBlock_128x128 = 3,
  kNvfp4_1x16 = 4
};
enum class ScaleLayout : uint8_t { kRowMajor = 0, kSwizzled = 1 };
enum class Direction : uint8_t { kForward = 0, kBackward = 1 };
enum class SlotRole : uint8_t {
  kInput = 0,
  kWeight = 1,
  kOutput = 2,
  kGradOutput = 3,
  kGradInput = 4
};

struct DelayedScaling {
  int32_t margin = 0;
  Fp8Format fp8_format = Fp8Format::kHybrid;
  int32_t amax_history_len = 1024;
  AmaxComputeAlgo amax_compute_algo = AmaxComputeAlgo::kMax;
  bool reduce_amax = true;
  bool fp8_dpa = false;
  bool fp8_mha = false;
  bool operator==(const DelayedScaling&) const = default;
};
struct Float8CurrentScaling {
  Fp8Format fp8_format = Fp8Format::kHybrid;
  bool fp8_dpa = false;
  bool fp8_mha = false;
  bool operator==(const Float8CurrentScaling&) const = default;
};
struct MXFP8BlockScaling {
  Fp8Format fp8_format = Fp8Format::kE4M3;
  bool operator==(const MXFP8BlockScaling&) const = default;
};
struct Float8BlockScaling {
  Fp8Format fp8_format = Fp8Format::kE4M3;
  int32_t x_block_scaling_dim = 1;
  int32_t w_block_scaling_dim = 2;
  int32_t grad_block_scaling_dim = 1;
  bool operator==(const Float8BlockScaling&) const = default;
};
struct NVFP4BlockScaling {
  bool disable_rht = false;
  bool disable_stochastic_rounding = false;
  bool disable_2d_quantization = false;
  bool operator==(const NVFP4BlockScaling&) const = default;
};
// Known by name only: callables are never serialized.
struct CustomRecipe {
  std::string name;
  std::string qfactory;
  bool operator==(const CustomRecipe&) const = default;
};
// monostate: no recipe recorded.
using Recipe = std::variant<std::monostate, DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling,
                            Float8BlockScaling, NVFP4BlockScaling, CustomRecipe>;

// Scaling state of one direction of one module: S = slot_roles.size() slots and
// L = history_len rows of amax history (row 0 current), stored F32[L, S] row-major.
struct DirectionState {
  Direction direction = Direction::kForward;
  int32_t num_gemms = 1;
  std::vector<SlotRole> slot_roles;
  std::vector<float> scale;         // S entries
  std::vector<float> amax_history;  // L * S entries
  int32_t history_len = 0;
  bool operator==(const DirectionState&) const = default;
};

struct ScalingState {
  std::string module;
  Recipe recipe;
  std::vector<DirectionState> states;  // empty for stateless recipes
  bool operator==(const ScalingState&) const = default;
};

// Each string names a tensor of the same checkpoint.
struct QuantizedComponent {
  std::string data;
  std::string scale_inv;  // may be empty
  ScaleLayout scale_layout = ScaleLayout::kRowMajor;
  std::string amax;  // may be empty
  bool operator==(const QuantizedComponent&) const = default;
};

struct QuantizedTensor {
  std::string name;
  DType quantized_dtype = DType::kF8_E4M3FN;
  DType logical_dtype = DType::kBF16;
  std::vector<int64_t> shape;
  ScalingMode scaling_mode = ScalingMode::kPerTensor;
  std::optional<QuantizedComponent> rowwise;
  std::optional<QuantizedComponent> columnwise;
  bool operator==(const QuantizedTensor&) const = default;
};

// ---- Writer ----------------------------------------------------------------------------

class StagingPool;

struct WriterOptions {
  // Raw bytes per checksum block (and per compressed chunk). A power of two, >= 4096.
  uint64_t block_size = uint64_t{4} << 20;
  // Default encoding of tensors added without an explicit one.
  Encoding encoding = Encoding::kRaw;
  // Level 1 measured both faster and smaller than 3 on shuffled bf16 (benchmarks/README.md).
  int zstd_level = 1;
  // A chunk is stored uncompressed unless compression saves at least this fraction.
  double min_savings = 0.03;
  // Compression threads (0: one per hardware thread, at most 16).
  int threads = 0;
  // Stored as Checkpoint.producer; empty means "tensorferry <version>".
  std::string producer;
  // fsync the file and its directory on Commit (turn off only for scratch files).
  bool durable = true;
  // Write through O_DIRECT (aligned 4 MiB segments assembled in file order) where the file
  // system supports it, else through the page cache. Direct writes measured faster on the
  // H200 hosts' disks and leave the page cache alone (a load right after the save then reads
  // from the disk).
  bool direct_io = true;
  // Host memory that holds tensor bytes between the add call and the file write. Set: every
  // source (host, pulled or device) is first copied into it, so each add returns once its bytes
  // are snapshotted there, and CommitAsync returns without waiting for the disk (see
  // Writer::CommitAsync). Null: host sources are written straight from the caller's memory
  // (each AddTensor returns once its bytes are in the file), and pulled or device sources go
  // through a pool of max(64 MiB, 2 * block_size) that the writer allocates on first use
  // (pinned on first device use) and frees with itself. Either way, host and pulled tensors of
  // at most 64 KiB (and one block) are copied into the writer's own batches and written many
  // at a time, so a small tensor costs no hand-off to the writer's threads.
  std::shared_ptr<StagingPool> staging;
  // Called after each block (or batch of small tensors) is written, with the raw bytes of the
  // tensors written so far (tensor bytes only, as added): for progress bars, and to stop a
  // save, since a non-OK return fails it with that status (Commit returns it; the previous
  // file at the path stays).
  // Runs on the writer's threads, one call at a time, never under the writer's locks; it must
  // not call the writer. Empty: none.
  std::function<Status(uint64_t raw_bytes_written)> progress;
};

// Host staging memory for writers: a ring of `bytes`, allocated once and reused by every save
// that names it (allocating and pinning costs ~0.25 s per GiB, far more than a save's copy).
// Each block of a tensor (at most WriterOptions::block_size bytes) takes a contiguous piece,
// small tensors packed at 256 bytes, and gives it back once it is in the file; a writer that
// needs a piece while the ring is full waits for earlier blocks to be written (by itself or by
// any other writer sharing the pool).
// Pinned memory (page-locked, registered with CUDA for the device-to-host DMA) is registered in
// the context of the device current at Create (pin = true) or at the first device-source save
// (pin = false), and unregistered by the destructor; destroy pools before the CUDA context
// goes away (not from static destructors). Shared and thread-safe.
class FERRY_API StagingPool {
 public:
  // `bytes` >= 8192, rounded up to 4096. pin: register now (needs CUDA and a device); false
  // leaves that to the first device source, so host-only saves never touch CUDA.
  static Result<std::shared_ptr<StagingPool>> Create(uint64_t bytes, bool pin = false);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  uint64_t bytes() const;
  bool pinned() const;

  class Impl;
  Impl& impl() const { return *impl_; }

 private:
  explicit StagingPool(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The rest of a save running in the background (Writer::CommitAsync): compression, writes,
// fsync and the atomic rename. Move-only. The destructor waits for the save to finish (the
// file is then committed or, on failure, its temporary file removed), so that no save is cut
// off by the end of its owner; call Wait first to see the result.
class FERRY_API SaveHandle {
 public:
  SaveHandle();
  SaveHandle(SaveHandle&&) noexcept;
  SaveHandle& operator=(SaveHandle&&) noexcept;
  ~SaveHandle();

  // Blocks until the save has finished and returns its final status (the same on every call).
  // A handle without a save (default-constructed or moved-from) returns InvalidArgument.
  Status Wait();
  // True once the save has finished (Wait would not block).
  bool done() const;
  // The checkpoint's final path.
  const std::string& path() const;

  class State;
  explicit SaveHandle(std::shared_ptr<State> state);

 private:
  std::shared_ptr<State> state_;
};

// Pulls a tensor's bytes in order: fill `size` bytes at `dst` with raw bytes
// [offset, offset + size). Lets sources that are not in host memory (a GPU, a socket)
// stream through the writer without a full host copy.
using FillFn = std::function<Status(uint64_t offset, void* dst, size_t size)>;

// Writes one checkpoint. Data streams to "<path>.tmp.<random>" as tensors are added, so memory
// does not grow with tensor sizes; Commit() writes the footer, fsyncs and renames over `path`
// atomically. If Commit() is never reached (error, destruction, crash) the temporary file is
// removed where possible and any previous file at `path` is untouched.
// Move-only; not thread-safe (one thread at a time).
class FERRY_API Writer {
 public:
  static Result<Writer> Create(const std::string& path, WriterOptions options = {});
  Writer(Writer&&) noexcept;
  Writer& operator=(Writer&&) noexcept;
  ~Writer();

  // Host-memory source: `data` must hold the tensor's StorageBytes; it is read before the
  // call returns and may be freed after.
  Status AddTensor(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                   const void* data, uint64_t nbytes);
  Status AddTensor(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                   const void* data, uint64_t nbytes, Encoding encoding);
  // Pulled source (see FillFn), called with pieces of at most options.block_size bytes.
  Status AddTensorFrom(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                       const FillFn& fill, Encoding encoding);

  // Device source: `device_data` is memory of the calling thread's current CUDA device (device
  // or managed memory) holding the tensor's StorageBytes. The writer enqueues device-to-host
  // copies into pinned staging memory on `stream` (nullptr: the legacy default stream) and
  // returns once they are enqueued, waiting only while the staging pool is full; worker threads
  // (bound to the caller's context) wait for each copy's event, then checksum, compress and
  // write it. The copies run after whatever `stream` already holds, so work enqueued on
  // `stream` after this call may overwrite or free the buffer at once; anything else must wait
  // for WaitSnapshot, CommitAsync or Commit to return. Every device tensor of one writer must
  // be on the same device (the one current at the first such call); no other device is
  // touched. Unimplemented in builds without CUDA.
  Status AddDeviceTensor(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                         const void* device_data, uint64_t nbytes, Stream stream);
  Status AddDeviceTensor(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                         const void* device_data, uint64_t nbytes, Stream stream,
                         Encoding encoding);
  // Waits until every byte added so far is in host memory (the device-to-host copies have
  // completed: it waits on the writer's own events, not on the streams), so the caller may
  // reuse every source buffer. Returns the first error of the save so far, if any.
  Status WaitSnapshot();

  // Marks the already added tensor `name` as a slice of a larger tensor (tensor parallelism):
  // `global_shape` is the whole tensor's shape and `offset` where this one starts in it, each
  // with one entry per dimension of the tensor, 0 <= offset[d] and offset[d] + shape[d] <=
  // global_shape[d]. Stored as Tensor.global_shape / shard_offset; nothing about ranks or
  // devices is recorded. Call before Commit.
  Status SetGlobalSlice(std::string_view name, const std::vector<int64_t>& global_shape,
                        const std::vector<int64_t>& offset);

  // Component tensors must be added (before Commit) under the names the QuantizedTensor uses.
  Status AddQuantized(const QuantizedTensor& tensor);
  Status AddScalingState(const ScalingState& state);
  Status SetMetadata(std::string_view key, std::string_view value);

  // Finishes the file and atomically replaces `path`. The Writer is spent afterwards.
  Status Commit();
  // WaitSnapshot, then returns while the rest of the save (compression and writes of the
  // staged bytes, the footer, fsync, the atomic rename and the directory fsync) runs in the
  // background; the handle gives its final status. The Writer is spent afterwards. All source
  // buffers may be reused once this returns. What the call waited for depends on the staging
  // pool (WriterOptions::staging): with a pool at least as large as the checkpoint, only for
  // the copies into host memory; with a smaller pool, each add also waited for earlier blocks
  // to be written to the file (not fsynced) to free pool space, so by the return everything
  // but the last pool-full of bytes has been written. Without a pool, host sources were
  // written during their AddTensor calls. A crash before the handle reports success leaves
  // the previous file at `path` untouched.
  Result<SaveHandle> CommitAsync();
  // Drops the temporary file; `path` is untouched. Idempotent.
  void Abort();

  const std::string& path() const;

  class Impl;

 private:
  explicit Writer(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

// ---- Reader ----------------------------------------------------------------------------

// How checkpoints named by http://, https:// and s3:// URLs are read (docs/STORAGE.md). Zero
// or empty keeps the default, which the environment may set: the AWS_* variables and shared
// files for s3:// (credentials, region, endpoint, addressing, AWS_CA_BUNDLE), CURL_CA_BUNDLE
// or SSL_CERT_FILE for the certificate authorities. Local paths ignore these.
struct StorageOptions {
  // PEM file of the certificate authorities to trust (TLS peers are always verified).
  std::string ca_bundle;
  int max_attempts = 0;      // attempts of one request before its error is returned (5)
  int max_in_flight = 0;     // range GETs at once, and connections kept open (8)
  uint64_t piece_bytes = 0;  // bytes per range GET (8 MiB)
};

struct ReaderOptions {
  // Check every tensor's checksums at open (reads the whole file). Off: checksums are
  // checked when asked (ReadOptions::verify, Reader::Verify).
  bool verify_on_open = false;
  StorageOptions storage;
};

struct ReadOptions {
  bool verify = false;  // check block checksums of the bytes read
};

// A read-only zero-copy view of a raw tensor inside the file mapping. `keepalive` holds a
// reference to the mapping (an opaque owner): the view is valid (and the memory readable) as long
// as the view, or a copy, exists, and the file is not truncated: the caller's own reads of a
// truncated file raise SIGBUS, which the library's copies (ReadInto, loads) turn into DataLoss
// instead (docs/SECURITY.md).
struct HostView {
  const void* data = nullptr;
  uint64_t nbytes = 0;
  TensorInfo info;
  std::shared_ptr<const void> keepalive;
};

class BlockSource;  // internal: the stored data behind a Reader
class ByteSource;   // internal: where a Reader's bytes come from

class FERRY_API Reader {
 public:
  // Opens `path`: a local file (mapped, or read with pread on network file systems), an
  // http:// or https:// URL, or an s3://bucket/key object (read with parallel range GETs, its
  // ETag pinned: an object replaced while open is DataLoss). Reads trailer and footer, verifies
  // and validates the index. Fails with NotFound / IoError for file or network trouble,
  // InvalidArgument for an unsupported URL, and DataLoss for any malformed byte.
  static Result<std::shared_ptr<Reader>> Open(const std::string& path, ReaderOptions = {});
  ~Reader();

  const std::string& path() const;
  uint64_t file_size() const;
  uint32_t format_version() const;
  std::string producer() const;

  size_t num_tensors() const;
  // i in [0, num_tensors()), in name order.
  TensorInfo tensor(size_t i) const;
  // O(log n) lookup by exact name; NotFound names the file and tensor.
  Result<TensorInfo> Find(std::string_view name) const;
  std::vector<std::string> names() const;

  std::vector<std::pair<std::string, std::string>> metadata() const;
  std::optional<std::string> metadata(std::string_view key) const;
  std::vector<QuantizedTensor> quantized() const;
  std::vector<ScalingState> scaling_states() const;

  // Zero-copy view; Unimplemented for encoded tensors (use ReadInto).
  Result<HostView> View(std::string_view name, ReadOptions = {}) const;
  // Copies (decoding if needed) the whole tensor into `dst`, which holds `dst_size` >= nbytes.
  Status ReadInto(std::string_view name, void* dst, uint64_t dst_size, ReadOptions = {}) const;
  // Copies rows [row_begin, row_end) of dimension 0 (a tensor-parallel shard).
  Status ReadRowsInto(std::string_view name, int64_t row_begin, int64_t row_end, void* dst,
                      uint64_t dst_size, ReadOptions = {}) const;
  // Checks the checksums of one tensor, or of every tensor.
  Status Verify(std::string_view name) const;
  Status VerifyAll() const;

 private:
  friend const BlockSource& BlocksOf(const Reader& reader);
  friend Result<std::shared_ptr<Reader>> OpenReader(std::shared_ptr<const ByteSource> bytes,
                                                    ReaderOptions options);
  explicit Reader(std::unique_ptr<BlockSource> blocks);
  std::unique_ptr<BlockSource> blocks_;
};

}  // namespace ferry

#endif  // FERRY_FERRY_HPP_
