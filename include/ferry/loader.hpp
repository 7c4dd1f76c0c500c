// TensorFerry loader: checkpoint tensors onto the caller's current CUDA device, on the caller's
// stream, through a small reusable pinned staging ring; or into host memory.
//
// Device rules (the reason this library exists):
// - The target device is cudaGetDevice() of the calling thread at the time of the call. The
//   loader never calls cudaSetDevice on the caller's thread, and never allocates, copies or
//   creates a context on any other device. Its worker threads set the captured device before
//   their first CUDA call, so no thread falls back to device 0.
// - Copies are enqueued on the caller's stream (default: the legacy default stream of the
//   current device, i.e. nullptr). The loader never calls cudaDeviceSynchronize and never
//   synchronizes the stream per chunk: staging buffers are recycled through CUDA events.
//
// Handles and threads: a Loader is owned by its creator (std::unique_ptr). Calls on one Loader
// are serialized internally (a second concurrent call waits); use one Loader per thread for
// parallel loads. Its pinned staging memory is allocated on first device use and freed by the
// destructor after the loader's in-flight copies complete (it waits on its own events only).
// Destroy Loaders before the CUDA context goes away (not from static destructors).
#ifndef FERRY_LOADER_HPP_
#define FERRY_LOADER_HPP_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"

struct CUstream_st;
struct CUevent_st;

namespace ferry {

// Same types as cudaStream_t / CUstream and cudaEvent_t / CUevent, without CUDA headers.
using Stream = CUstream_st*;
using Event = CUevent_st*;

// True when this build has the CUDA loader and a device is usable (any CUDA error: false).
FERRY_API bool CudaAvailable();

// Device memory from the caller's allocator (e.g. a framework's caching allocator). Called on
// the loading thread with the target device current; memory must be usable in stream order on
// `stream`. `allocate` returns nullptr on failure.
struct DeviceAllocator {
  std::function<void*(uint64_t bytes, Stream stream)> allocate;
  std::function<void(void* ptr, uint64_t bytes, Stream stream)> deallocate;
};

// How page-cache-resident data reaches the GPU.
enum class HostPath : uint8_t {
  kAuto = 0,      // kRegister once this mapping is registered, else kStaging
  kStaging = 1,   // CPU copies from the mapping into the pinned ring, then DMA
  kRegister = 2,  // cudaHostRegister(ReadOnly) the mapped file, DMA straight from page cache
  // As kRegister, but each worker registers one window of register_window_bytes at a time and
  // unregisters it once its copies complete (the load then waits for its own copies).
  kRegisterWindows = 3
};

// How bytes leave the file. kAuto takes kDirect only for a load that is mostly cold (sampled
// with mincore) and larger than half of MemAvailable, where caching it would only evict other
// data; otherwise the page-cache path, which measured as fast or faster than O_DIRECT on cold
// files of a virtual disk (benchmarks/README.md). kDirect falls back to the page cache where
// the file system refuses O_DIRECT (tmpfs).
enum class IoMode : uint8_t {
  kAuto = 0,
  kPageCache = 1,  // read through the mmap
  kDirect = 2      // O_DIRECT reads into the pinned ring (aligned to 4096)
};

enum class PinnedAlloc : uint8_t {
  kHostRegister = 0,  // malloc + prefault + cudaHostRegister (measured faster to set up)
  kHostAlloc = 1      // cudaHostAlloc
};

struct LoaderOptions {
  // Pinned staging memory: as many slots of slot_bytes (each with 8 KiB of room for aligning
  // direct reads) as fit, at least two; allocated on 2 MiB transparent huge pages where the
  // kernel gives them (faster to pin), rounded up to 2 MiB.
  uint64_t staging_bytes = uint64_t{64} << 20;
  // Bytes per staging slot and per DMA; small tensors are packed into one slot when their
  // destinations are contiguous.
  uint64_t slot_bytes = uint64_t{4} << 20;
  // CPU worker threads (copy, decode, verify). 0: min(16, hardware threads). Loads of raw
  // tensors use at most 8 of them (more measured slower on an H200 host: the copy is memory
  // bound), except a one-shot load (the first this loader makes from a Reader's file
  // mapping), which reads resident data with pread on up to 12 (faster in fresh processes);
  // loads that are mostly compressed use all of them (decode bound).
  int threads = 0;
  HostPath host_path = HostPath::kAuto;
  IoMode io = IoMode::kAuto;
  uint64_t register_window_bytes = uint64_t{64} << 20;
  PinnedAlloc pinned_alloc = PinnedAlloc::kHostRegister;
  // Check block checksums while loading: on the host for the bytes the CPU reads or decodes,
  // on the device for PLANES blocks expanded there (XXH3-64 of the decoded bytes).
  bool verify = false;
  // Fill staging slots with non-temporal stores. Off by default: measured slower on an H200
  // host (40 vs 52 GB/s at 8 threads, benchmarks/README.md).
  bool streaming_stores = false;
};

// One tensor (or a row range of one) to load. With `dst` null the loader allocates;
// otherwise `dst` must hold `dst_bytes` >= the bytes loaded, on the target (device memory of
// the current device for device loads, host memory for host loads).
struct LoadRequest {
  std::string name;
  int64_t row_begin = 0;
  int64_t row_end = -1;  // -1: through the last row
  void* dst = nullptr;
  uint64_t dst_bytes = 0;
};

// A loaded tensor. `info.shape` reflects a row range. When the loader allocated the memory,
// `owner` frees it (through the caller's allocator, on the load stream, or std::free for host)
// once the last copy of `owner` is dropped; with a caller-provided `dst`, `owner` is null.
// Without a caller's allocator, the tensors of one load share one allocation (one
// cudaMallocAsync, or one host allocation), freed when the last of them is dropped.
struct LoadedTensor {
  TensorInfo info;
  void* data = nullptr;
  uint64_t nbytes = 0;
  int device = -1;  // CUDA device ordinal, or -1 for host memory
  std::shared_ptr<void> owner;
};

// Streaming loads (Loader::LoadStreaming): when a tensor is handed over.
enum class HandOver : uint8_t {
  // Once every copy into the tensor is complete: anything may read it, on any stream or the
  // host. What a framework building modules while the rest loads wants.
  kComplete = 0,
  // Once every copy into it is enqueued on the load stream, followed by `ready`: work the
  // callback enqueues on that stream runs after the copies; another stream waits with
  // cudaStreamWaitEvent(ready) inside the callback. The earliest hand-over.
  kEnqueued = 1,
};

// One tensor handed over by a streaming load.
struct ReadyTensor {
  // Position in the requests (with no requests: the tensor's index in name order), which is
  // also its position in the vector the load returns.
  size_t index = 0;
  // The tensor as the load will return it. Valid during the callback; copy it (a
  // LoadedTensor is cheap to copy and keeps loader-allocated memory alive) to keep it.
  const LoadedTensor* tensor = nullptr;
  // Device loads: an event recorded on the load stream after the tensor's last copy
  // (already complete with HandOver::kComplete). Valid until the callback returns: wait on it
  // (cudaStreamWaitEvent, cudaEventSynchronize) inside the callback. Host loads: null.
  Event ready = nullptr;
};

// Called once per tensor, in the order the tensors' last copies were enqueued (file order,
// give or take the interleaving of the worker threads), from one thread the loader starts for
// the load: never two calls at once, never on a copy worker, so a slow callback delays later
// hand-overs but not the copies. It must not call back into the same Loader. An exception it
// throws fails the load (Internal) and no further tensor is handed over.
using ReadyCallback = std::function<void(const ReadyTensor&)>;

// Figures of the last load, for benchmarks and logs.
struct LoadStats {
  uint64_t bytes = 0;           // raw bytes delivered
  uint64_t copies = 0;          // cudaMemcpyAsync calls (device) or memcpy pieces (host)
  uint64_t pinned_bytes = 0;    // pinned staging memory held by the loader
  bool used_register = false;   // the page-cache registration path was taken
  bool used_direct_io = false;  // O_DIRECT reads were used
  bool used_pread = false;      // a one-shot load: resident raw bytes read with pread
  double seconds = 0;           // wall time of the call
};

class FERRY_API Loader {
 public:
  static Result<std::unique_ptr<Loader>> Create(LoaderOptions options = {});
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // Enqueues every copy on `stream` and returns; data is ready once `stream` reaches this
  // point. Staging slots are reused as their events complete, so the call itself blocks on
  // CPU work and on slot reuse, never on the stream as a whole. Empty `requests`: every tensor.
  // The one exception: a load that expands PLANES blocks on the device (PLANES tensors, in a
  // build with the CUDA kernels) waits before it returns until `stream` has run those decodes
  // (and, with LoaderOptions::verify, the checksums of their output), and with them everything
  // enqueued on `stream` before this call (an event recorded after them; not
  // cudaStreamSynchronize, so work other threads enqueue on `stream` meanwhile is not waited
  // for). Only then is it known whether a block was corrupt, or decoded to other bytes than
  // were saved, which is reported as DataLoss naming the tensor and the block instead of
  // handing out garbage.
  Result<std::vector<LoadedTensor>> LoadAsync(const Reader& reader,
                                              const std::vector<LoadRequest>& requests,
                                              Stream stream = nullptr,
                                              const DeviceAllocator* allocator = nullptr);
  // As LoadAsync, then waits for `stream` (cudaStreamSynchronize of that stream only).
  Result<std::vector<LoadedTensor>> Load(const Reader& reader,
                                         const std::vector<LoadRequest>& requests,
                                         Stream stream = nullptr,
                                         const DeviceAllocator* allocator = nullptr);
  // Host memory target; needs no GPU. Parallel over the worker threads.
  Result<std::vector<LoadedTensor>> LoadToHost(const Reader& reader,
                                               const std::vector<LoadRequest>& requests);

  // Streaming forms: as LoadAsync and LoadToHost, and every tensor goes to `on_ready` as soon
  // as it is loaded (see HandOver and ReadyCallback) while the rest still loads. They return
  // once every tensor was handed over: with HandOver::kComplete the data is then complete;
  // with kEnqueued, as LoadAsync, once `stream` reaches this point. On failure the tensors
  // handed over before it stay valid only while the caller holds copies of them.
  // LoadStreaming decodes PLANES tensors on the host (and checks them there when verifying):
  // a tensor is handed over before a device decode's errors could be known, so the device
  // decoder would hand out tensors not yet known to be intact.
  Result<std::vector<LoadedTensor>> LoadStreaming(const Reader& reader,
                                                  const std::vector<LoadRequest>& requests,
                                                  const ReadyCallback& on_ready,
                                                  HandOver when = HandOver::kComplete,
                                                  Stream stream = nullptr,
                                                  const DeviceAllocator* allocator = nullptr);
  Result<std::vector<LoadedTensor>> LoadToHostStreaming(const Reader& reader,
                                                        const std::vector<LoadRequest>& requests,
                                                        const ReadyCallback& on_ready);

  LoadStats last_stats() const;
  const LoaderOptions& options() const;

  class Impl;

 private:
  friend struct LoaderInternals;  // the library's own benchmarks and tests (not public API)
  explicit Loader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry

#endif  // FERRY_LOADER_HPP_
