// The loader's pipeline: a plan (load_plan.hpp) of pieces moved by the worker pool into the
// destinations (load_memory.hpp): for the host, read and decoded in place; for the device,
// DMA'd straight from the registered page cache, or filled into the pinned staging ring
// (staging_ring.hpp) and copied from there on the caller's stream.
#include "ferry/loader.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>

#include "base/util.hpp"
#include "base/worker_pool.hpp"
#include "codec/planes.hpp"
#include "cuda/cuda_util.hpp"
#include "cuda/staging_ring.hpp"
#include "format/block_source.hpp"
#include "load/handover.hpp"
#include "load/load_memory.hpp"
#include "load/load_plan.hpp"
#include "load/loader_tuning.hpp"
#include "load/planes_stage.hpp"

#ifdef FERRY_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime.h>
#endif

namespace ferry {

namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

#ifdef FERRY_HAVE_CUDA
// Timestamps of a device load's phases (LoadPhases); host-only builds record none.
double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
#endif

// Pieces per request, for the hand-over of streaming loads.
void CountPieces(const std::vector<Piece>& pieces, std::vector<uint32_t>* count) {
  for (const Piece& p : pieces) ++(*count)[p.r];
}

// Workers of loads from sources read without a mapping, at most: each waits on one read.
constexpr int kMaxReadWorkers = 64;

// Bytes per piece of a host load: a staging slot, or the source's preferred read where it is
// read without a mapping (remote storage: one range GET per piece).
uint64_t HostPieceBytes(const BlockSource& source, uint64_t slot_bytes) {
  if (source.mapping() != nullptr) return slot_bytes;
  return std::max(slot_bytes, source.bytes().preferred_read_bytes());
}

// Reads the raw pieces among pieces[first, last) from the source as one ReadStoredRanges,
// each to dst_of(piece): a remote source keeps them in flight together and joins neighbours
// into one request, where piece by piece each would cost a round trip.
template <typename DstOf>
Status ReadRawPieces(const BlockSource& source, const LoadPlan& plan,
                     const std::vector<Piece>& pieces, uint32_t first, uint32_t last,
                     const DstOf& dst_of) {
  std::vector<BlockSource::StoredRange> ranges;
  for (uint32_t i = first; i < last; ++i) {
    const Piece& p = pieces[i];
    const Resolved& rr = plan.res[p.r];
    if (rr.info.encoding != Encoding::kRaw || p.len == 0) continue;
    ranges.push_back({rr.tensor, ReadRange{rr.info.data_offset + p.begin, p.len, dst_of(p)}});
  }
  return source.ReadStoredRanges(ranges);
}

// The pieces a host-load worker takes at once, as [first, last): without a mapping, runs of
// raw pieces of up to the source's preferred read size (read by ReadRawPieces); else one each.
std::vector<std::pair<uint32_t, uint32_t>> HostRuns(const BlockSource& source, const LoadPlan& plan,
                                                    const std::vector<Piece>& pieces) {
  std::vector<std::pair<uint32_t, uint32_t>> runs;
  const bool gather = source.mapping() == nullptr;
  const uint64_t limit = source.bytes().preferred_read_bytes();
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < pieces.size(); ++i) {
    const bool raw = plan.res[pieces[i].r].info.encoding == Encoding::kRaw;
    const bool join = gather && raw && !runs.empty() && runs.back().second == i &&
                      plan.res[pieces[i - 1].r].info.encoding == Encoding::kRaw &&
                      bytes + pieces[i].len <= limit;
    if (join) {
      runs.back().second = i + 1;
      bytes += pieces[i].len;
    } else {
      runs.emplace_back(i, i + 1);
      bytes = pieces[i].len;
    }
  }
  return runs;
}

#ifdef FERRY_HAVE_CUDA

// Everything one device load shares between its workers.
struct DeviceJob {
  const BlockSource& source;
  const LoadPlan& plan;
  const DevicePlan& pieces;
  const DeviceRoute& route;
  const DirectFile& direct;
  cudaStream_t stream;
  bool verify;
  bool streaming;
  bool pread;          // raw pieces are read from the source (one-shot, or no mapping)
  Handover* handover;  // streaming loads: told of every piece enqueued (else null)
  FirstError error;
  std::atomic<uint64_t> next_group{0}, next_batch{0}, copies{0};
  std::atomic<double> first_fill{0};  // steady seconds when the first slot was filled
#ifdef FERRY_HAVE_CUDA_KERNELS
  PlanesStage* planes = nullptr;  // expands PLANES batches on the device
  uint64_t planes_batch0 = 0;     // index of the first PLANES batch
  bool planes_pread = false;      // their stored bytes are read from the source
  bool planes_verify = false;     // their raw bytes are checked on the device
#endif
};

// A failed load wakes every worker waiting for a slot, pinned or on the device.
void AbortLoad(DeviceJob& job, StagingRing& ring, Status st) {
  job.error.Set(std::move(st));
  ring.Abort();
#ifdef FERRY_HAVE_CUDA_KERNELS
  if (job.planes != nullptr) job.planes->Abort();
#endif
}

// One worker's registered window of the mapping (HostPath::kRegisterWindows): registered
// before its group's copies, unregistered once they complete (the worker waits for them).
class MappedWindow {
 public:
  MappedWindow(const std::string& path, cudaEvent_t done) : path_(path), done_(done) {}
  // Releases the previous window, then registers [begin, begin + bytes).
  Status Register(uint8_t* begin, uint64_t bytes) {
    FERRY_RETURN_IF_ERROR(Release());
    cudaError_t err =
        cudaHostRegister(begin, bytes, cudaHostRegisterReadOnly | cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return CudaStatus(err, path_, "cudaHostRegister of a window");
    }
    pending_ = begin;
    return Status::Ok();
  }
  // Marks the end of the window's copies on `stream`.
  Status Recorded(cudaStream_t stream) {
    cudaError_t err = cudaEventRecord(done_, stream);
    return err == cudaSuccess ? Status::Ok() : CudaStatus(err, path_, "cudaEventRecord");
  }
  Status Release() {
    if (pending_ == nullptr) return Status::Ok();
    cudaError_t err = cudaEventSynchronize(done_);
    if (err == cudaSuccess) err = cudaHostUnregister(pending_);
    pending_ = nullptr;
    return err == cudaSuccess ? Status::Ok()
                              : CudaStatus(err, path_, "releasing a registered window");
  }

 private:
  const std::string& path_;
  cudaEvent_t done_;
  uint8_t* pending_ = nullptr;
};

// The DMA of one group of raw pieces straight from the mapping. The DMA reads the page cache
// itself, so the blocks are checked there.
Status CopyGroup(DeviceJob& job, const Group& g) {
  const uint8_t* base = job.source.mapping()->data();  // groups exist only when mapped
  for (uint32_t i = g.first; i < g.last; ++i) {
    const Piece& p = job.pieces.mapped[i];
    const Resolved& rr = job.plan.res[p.r];
    if (job.verify)
      FERRY_RETURN_IF_ERROR(job.source.VerifyRange(rr.tensor, p.begin, p.len, nullptr));
    cudaError_t err = cudaMemcpyAsync(rr.dst + p.dst_off, base + rr.info.data_offset + p.begin,
                                      p.len, cudaMemcpyHostToDevice, job.stream);
    if (err != cudaSuccess) return CudaStatus(err, job.source.Where(rr.tensor), "cudaMemcpyAsync");
    job.copies.fetch_add(1, std::memory_order_relaxed);
    if (job.handover != nullptr) FERRY_RETURN_IF_ERROR(job.handover->PieceDone(p.r));
  }
  return Status::Ok();
}

// A worker's first phase: groups of mapped pieces, taken in turn, until none is left.
Status CopyMapped(DeviceJob& job, cudaEvent_t window_event) {
  if (job.pieces.groups.empty()) return Status::Ok();
  MappedWindow window(job.source.path(), window_event);
  auto* base = const_cast<uint8_t*>(job.source.mapping()->data());
  Status st;
  while (st.ok()) {
    uint64_t k = job.next_group.fetch_add(1);
    if (k >= job.pieces.groups.size() || job.error.failed()) break;
    const Group& g = job.pieces.groups[k];
    if (job.route.windows) st = window.Register(base + g.reg_begin, g.reg_end - g.reg_begin);
    if (st.ok()) st = CopyGroup(job, g);
    if (st.ok() && job.route.windows) st = window.Recorded(job.stream);
  }
  Status released = window.Release();
  return st.ok() ? released : st;
}

// Fills a slot with batch b's pieces: one direct read of the batch's file span, or each
// piece read (and decoded) by the CPU.
Status FillSlot(DeviceJob& job, const Batch& b, uint8_t* slot) {
  const std::vector<Piece>& pieces = job.pieces.staged;
  if (b.direct) {
    const Piece& last = pieces[b.last - 1];
    uint64_t need = job.plan.res[last.r].info.data_offset + last.begin + last.len - b.span_begin;
    FERRY_RETURN_IF_ERROR(job.direct.ReadAligned(slot, b.span_begin, b.span_len, need));
    for (uint32_t i = b.first; job.verify && i < b.last; ++i) {
      const Piece& p = pieces[i];
      FERRY_RETURN_IF_ERROR(
          job.source.VerifyRange(job.plan.res[p.r].tensor, p.begin, p.len, slot + p.soff));
    }
    return Status::Ok();
  }
  // Each block is checked by the worker that copies it, as it copies it (ReadPath::verify):
  // pieces never straddle blocks (MakePieces), and a piece no larger than a block holds it
  // whole unless a row range cuts it.
  ReadPath how;
  how.verify = job.verify;
  how.streaming = job.streaming;
  how.direct = job.direct.is_open() ? &job.direct : nullptr;
  how.pread = job.pread;
  // Without a mapping the slot's raw pieces are read together, not one round trip each, and
  // checked after; with one, pread reads each block and hashes it as it lands (how.pread).
  const bool gathered = job.pread && job.source.mapping() == nullptr;
  if (gathered) {
    FERRY_RETURN_IF_ERROR(ReadRawPieces(job.source, job.plan, pieces, b.first, b.last,
                                        [&](const Piece& p) { return slot + p.soff; }));
  }
  for (uint32_t i = b.first; i < b.last; ++i) {
    const Piece& p = pieces[i];
    const Resolved& rr = job.plan.res[p.r];
    if (gathered && rr.info.encoding == Encoding::kRaw) {
      if (job.verify) {
        FERRY_RETURN_IF_ERROR(job.source.VerifyRange(rr.tensor, p.begin, p.len, slot + p.soff));
      }
      continue;
    }
    FERRY_RETURN_IF_ERROR(job.source.Read(rr.tensor, p.begin, p.len, slot + p.soff, how));
  }
  return Status::Ok();
}

// One DMA per run of pieces whose staging and destination offsets advance together.
Status CopySlot(DeviceJob& job, const Batch& b, const uint8_t* slot) {
  const std::vector<Piece>& pieces = job.pieces.staged;
  const std::vector<Resolved>& res = job.plan.res;
  uint32_t i = b.first;
  while (i < b.last) {
    const Piece& p = pieces[i];
    uint8_t* dst = res[p.r].dst + p.dst_off;
    uint64_t run_len = p.len;
    uint32_t j = i + 1;
    while (j < b.last) {
      const Piece& q = pieces[j];
      uint8_t* qdst = res[q.r].dst + q.dst_off;
      if (res[q.r].alloc_id != res[p.r].alloc_id || qdst < dst || q.soff < p.soff ||
          static_cast<uint64_t>(qdst - dst) != q.soff - p.soff) {
        break;
      }
      run_len = q.soff - p.soff + q.len;
      ++j;
    }
    if (run_len > 0) {
      cudaError_t err =
          cudaMemcpyAsync(dst, slot + p.soff, run_len, cudaMemcpyHostToDevice, job.stream);
      if (err != cudaSuccess) {
        return CudaStatus(err, job.source.Where(res[p.r].tensor), "cudaMemcpyAsync");
      }
      job.copies.fetch_add(1, std::memory_order_relaxed);
    }
    i = j;
  }
  return Status::Ok();
}

#ifdef FERRY_HAVE_CUDA_KERNELS
// A batch of whole PLANES blocks: their stored bytes are read into the slot (with pread in
// one-shot and cold loads: no page faults on a mapping used once; from the mapping a repeated
// load has faulted in already), their headers and tables checked here, then handed to the
// stage, which copies them to the device and expands them there.
Status StagePlanes(DeviceJob& job, const Batch& b, uint64_t k, uint8_t* slot) {
  const std::vector<Piece>& pieces = job.pieces.staged;
  const BlockSource& source = job.source;
  std::vector<PlanesStaged> blocks;
  blocks.reserve(b.last - b.first);
  uint64_t used = 0;
  for (uint32_t i = b.first; i < b.last; ++i) {
    const Piece& p = pieces[i];
    const Resolved& rr = job.plan.res[p.r];
    const uint64_t blk = p.begin / source.Record(rr.tensor).block_size;
    const StoredBlock s = source.Block(rr.tensor, blk);
    uint8_t* dst = slot + p.soff;
    if (job.planes_pread) {
      FERRY_RETURN_IF_ERROR(source.ReadStoredRange(rr.tensor, s.file_offset, s.stored_size, dst));
    } else {
      FERRY_RETURN_IF_ERROR(source.ReadStored(rr.tensor, blk, dst));
    }
    PlanesStaged staged;
    Status st = planes::Parse(dst, s.stored_size, s.raw_size, &staged.layout);
    if (!st.ok()) {
      return Error(StatusCode::kDataLoss, source.Where(rr.tensor), ": block ", blk,
                   " at file offset ", s.file_offset, ": ", st.message());
    }
    staged.soff = p.soff;
    staged.dst = rr.dst + p.dst_off;
    staged.error_index = i - job.pieces.planes_first;
    if (job.planes_verify) staged.checksum = source.BlockChecksum(rr.tensor, blk);
    blocks.push_back(staged);
    used = p.soff + s.stored_size;
  }
  if (job.first_fill.load(std::memory_order_relaxed) == 0) {
    job.first_fill.store(SteadySeconds(), std::memory_order_relaxed);
  }
  job.copies.fetch_add(1, std::memory_order_relaxed);
  return job.planes->Enqueue(k - job.planes_batch0, slot, used, blocks, job.stream, source.path());
}

// A corrupt unit, or raw bytes that differ from what was saved, show up only once the device
// has run: waits for it, so the load reports DataLoss naming the tensor and block instead of
// handing out garbage.
Status PlanesErrors(PlanesStage& stage, const BlockSource& source, const LoadPlan& plan,
                    const DevicePlan& pieces, cudaStream_t stream) {
  std::vector<uint32_t> errors;
  FERRY_RETURN_IF_ERROR(stage.Finish(stream, &errors, source.path()));
  for (uint32_t i = 0; i < errors.size(); ++i) {
    if (errors[i] == 0) continue;
    const Piece& p = pieces.staged[pieces.planes_first + i];
    const size_t t = plan.res[p.r].tensor;
    const uint64_t blk = p.begin / source.Record(t).block_size;
    // The same message as a check on the host.
    if (errors[i] == kChecksumMismatch) return source.ChecksumMismatch(t, blk);
    return Error(StatusCode::kDataLoss, source.Where(t), ": block ", blk, " at file offset ",
                 source.Block(t, blk).file_offset, ": ", planes::DeviceErrorText(errors[i]),
                 " (decoded on the GPU)");
  }
  return Status::Ok();
}
#endif

// A worker's second phase: batches through the ring, taken in turn, until none is left.
void CopyStaged(DeviceJob& job, StagingRing& ring) {
  for (;;) {
    uint64_t k = job.next_batch.fetch_add(1);
    if (k >= job.pieces.batches.size()) return;
    uint8_t* slot = nullptr;
    Status st = ring.Acquire(k, &slot);
    if (st.ok() && slot == nullptr) return;  // the load failed elsewhere
    const Batch& b = job.pieces.batches[k];
    // The stream after which the slot may be refilled: a PLANES batch's copy runs on the
    // stage's copy stream, ahead of its decode.
    cudaStream_t copied_on = job.stream;
#ifdef FERRY_HAVE_CUDA_KERNELS
    if (b.planes) {
      if (st.ok()) st = StagePlanes(job, b, k, slot);
      copied_on = job.planes->copy_stream();
    } else
#endif
    {
      if (st.ok()) st = FillSlot(job, b, slot);
      if (st.ok() && job.first_fill.load(std::memory_order_relaxed) == 0) {
        job.first_fill.store(SteadySeconds(), std::memory_order_relaxed);
      }
      if (st.ok()) st = CopySlot(job, b, slot);
    }
    if (st.ok()) st = ring.Record(k, copied_on);
    for (uint32_t i = b.first; st.ok() && job.handover != nullptr && i < b.last; ++i) {
      st = job.handover->PieceDone(job.pieces.staged[i].r);
    }
    if (!st.ok()) AbortLoad(job, ring, std::move(st));
    ring.Release(k);
    if (job.error.failed()) return;
  }
}

#endif  // FERRY_HAVE_CUDA

}  // namespace

class Loader::Impl {
 public:
  LoaderOptions options;
  bool explicit_threads = false;  // the caller chose the thread count: use all of them
  std::mutex call_mu;
  std::unique_ptr<WorkerPool> pool;
  std::unique_ptr<WorkerPool> read_pool;  // made for the first source that wants more reads
  LoadStats stats;
  LoaderTuning tuning;
  LoadPhases phases;

  // The workers of a load and how many of them run: ActiveWorkers of the pool (all of it when
  // the caller chose the thread count); a source read without a mapping keeps
  // preferred_parallel_reads() reads in flight, one per worker, even past the pool's size
  // (its workers mostly wait on the network or a network file system).
  Result<std::pair<WorkerPool*, int>> Workers(const BlockSource& source, const LoadPlan& plan,
                                              bool one_shot, bool verify) {
    const int active =
        explicit_threads ? pool->size() : ActiveWorkers(plan, pool->size(), one_shot, verify);
    const int reads =
        source.mapping() != nullptr
            ? 0
            : std::clamp(source.bytes().preferred_parallel_reads(), 1, kMaxReadWorkers);
    if (reads <= active) return std::make_pair(pool.get(), active);
    if (reads <= pool->size()) return std::make_pair(pool.get(), reads);
    if (read_pool == nullptr || read_pool->size() < reads) {
      read_pool.reset();
      FERRY_ASSIGN_OR_RETURN(read_pool, WorkerPool::Create(reads));
    }
    return std::make_pair(read_pool.get(), reads);
  }

#ifdef FERRY_HAVE_CUDA
  std::unique_ptr<StagingRing> ring;          // made on the first device load
  CUcontext ctx = nullptr;                    // of the events below and of `registered`
  cudaEvent_t tail = nullptr;                 // recorded after each load's last copy
  std::vector<cudaEvent_t> worker_events;     // windowed registration, one per worker
  std::shared_ptr<const Mapping> registered;  // mapping registered for direct DMA
  // The mapping of the last device load: a load from any other is a one-shot load.
  std::weak_ptr<const Mapping> loaded_mapping;
#ifdef FERRY_HAVE_CUDA_KERNELS
  PlanesStage planes_stage;  // device twins of the ring slots, for PLANES blocks
#endif

  ~Impl() {
#ifdef FERRY_HAVE_CUDA_KERNELS
    planes_stage.Release();
#endif
    if (ctx != nullptr) {
      ScopedContext scope(ctx);
      Unregister();
      ReleaseEvents();
    }
    ring.reset();
  }

  void ReleaseEvents() {
    ScopedContext scope(ctx);
    if (tail) cudaEventSynchronize(tail);
    if (tail) cudaEventDestroy(tail);
    tail = nullptr;
    for (cudaEvent_t& e : worker_events) {
      if (e) cudaEventDestroy(e);
      e = nullptr;
    }
  }

  void Unregister() {
    if (!registered) return;
    ScopedContext scope(ctx);
    if (tail) cudaEventSynchronize(tail);
    cudaHostUnregister(const_cast<uint8_t*>(registered->data()));
    registered.reset();
  }

  // Ring and events for the caller's current context.
  Status PrepareDevice(CUcontext current) {
    if (ring == nullptr) {
      uint64_t slots = std::max<uint64_t>(2, options.staging_bytes / options.slot_bytes);
      ring = std::make_unique<StagingRing>(slots, options.slot_bytes + kSlotSlack,
                                           options.pinned_alloc);
    }
    FERRY_RETURN_IF_ERROR(ring->Prepare(current));
    if (ctx == current) return Status::Ok();
    if (ctx != nullptr) {
      Unregister();
      ReleaseEvents();
    }
    FERRY_CUDA_RETURN(cudaEventCreateWithFlags(&tail, cudaEventDisableTiming), "tail event");
    worker_events.assign(pool->size(), nullptr);
    for (cudaEvent_t& e : worker_events) {
      FERRY_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "worker events");
    }
    ctx = current;
    return Status::Ok();
  }

  Status RegisterMapping(const std::shared_ptr<const Mapping>& mapping) {
    if (registered == mapping) return Status::Ok();
    Unregister();
    if (mapping->size() == 0) return Status::Ok();
    cudaError_t err = cudaHostRegister(const_cast<uint8_t*>(mapping->data()), mapping->size(),
                                       cudaHostRegisterReadOnly | cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      cudaGetLastError();  // not sticky; clear it so later calls are unaffected
      return CudaStatus(err, mapping->path(), "cudaHostRegister(ReadOnly) of the mapping");
    }
    registered = mapping;
    return Status::Ok();
  }

  // How raw pieces reach the device, and the registration that takes.
  Result<DeviceRoute> Route(const BlockSource& source, bool cold) {
    DeviceRoute route;
    route.slot_bytes = options.slot_bytes;
    route.window_bytes = options.register_window_bytes;
    // Without a mapping every piece goes through the ring, read from the source.
    if (source.mapping() == nullptr) return route;
    route.cold = cold;
    route.windows = !cold && options.host_path == HostPath::kRegisterWindows;
    // kAuto takes a registration an earlier load made only for unverified loads: the DMA
    // reads bytes the CPU never sees, so checking them would take a second pass over the
    // mapping, where the ring hashes each block while it copies it.
    route.from_mapping = !cold && (options.host_path == HostPath::kRegister || route.windows ||
                                   (options.host_path == HostPath::kAuto && !options.verify &&
                                    registered == source.mapping()));
    if (route.from_mapping && !route.windows) {
      FERRY_RETURN_IF_ERROR(RegisterMapping(source.mapping()));
    }
    if (route.windows) Unregister();
    return route;
  }

  // Runs the workers: mapped groups first, then the ring's batches.
  Status RunDevice(DeviceJob& job, CUcontext current, int dev, WorkerPool& workers, int active) {
    ring->Begin();
    workers.Run([&](int worker) {
      if (worker >= active) return;
      // The worker's first CUDA call must find the caller's context, or the runtime would
      // create one on device 0.
      if (Driver().ok && current != nullptr) {
        Driver().ctx_set_current(current);
      } else if (cudaSetDevice(dev) != cudaSuccess) {
        AbortLoad(job, *ring,
                  Error(StatusCode::kCudaError, job.source.path(), ": cudaSetDevice on a worker"));
        return;
      }
      Status st = CopyMapped(job, job.route.windows ? worker_events[worker] : nullptr);
      if (!st.ok()) AbortLoad(job, *ring, std::move(st));
      CopyStaged(job, *ring);
    });
    cudaError_t terr = cudaEventRecord(tail, job.stream);
    if (job.error.failed()) return job.error.Get();
    if (terr != cudaSuccess) return CudaStatus(terr, job.source.path(), "cudaEventRecord");
    return Status::Ok();
  }

  Result<std::vector<LoadedTensor>> DeviceLoad(const Reader& reader,
                                               const std::vector<LoadRequest>& requests,
                                               Stream stream, const DeviceAllocator* alloc,
                                               const ReadyCallback* on_ready = nullptr,
                                               HandOver when = HandOver::kComplete) {
    const BlockSource& source = BlocksOf(reader);
    auto t0 = std::chrono::steady_clock::now();
    cudaStream_t cstream = reinterpret_cast<cudaStream_t>(stream);
    int dev = -1;
    FERRY_CUDA_RETURN(cudaGetDevice(&dev), source.path());
    // Makes the caller's current device's context current on this thread if the thread has
    // none yet; that is the caller's device, never another.
    FERRY_CUDA_RETURN(cudaFree(nullptr), source.path());
    CUcontext current = nullptr;
    if (Driver().ok) Driver().ctx_get_current(&current);
    phases = LoadPhases{};
    const double start = SteadySeconds();
    FERRY_RETURN_IF_ERROR(PrepareDevice(current));
    const double setup = SecondsSince(t0);
    phases.prepared = setup;

    auto t_plan = std::chrono::steady_clock::now();
    FERRY_ASSIGN_OR_RETURN(LoadPlan plan, Resolve(source, requests));
    double planning = SecondsSince(t_plan);
    phases.resolved = SecondsSince(t0);
    auto t_alloc = std::chrono::steady_clock::now();
    std::vector<LoadedTensor> out;
    FERRY_RETURN_IF_ERROR(
        AllocateDevice(source, plan, cstream, alloc, current, dev, &out, tuning.arena_cuda_malloc));
    const double allocation = SecondsSince(t_alloc);
    phases.allocated = SecondsSince(t0);
    t_plan = std::chrono::steady_clock::now();
    // Data mostly absent from the page cache is read with O_DIRECT straight into the ring
    // (no page-cache copy, no readahead guesswork); file systems without O_DIRECT (tmpfs)
    // keep the page-cache path.
    const DirectFile direct = OpenDirect(source, plan, options.io);
    FERRY_ASSIGN_OR_RETURN(DeviceRoute route, Route(source, direct.is_open()));
#ifdef FERRY_HAVE_CUDA_KERNELS
    // PLANES blocks expand on the device, and verified loads check them there. Streaming loads
    // decode them on the host: they hand tensors out before a GPU decode's errors are known.
    if (on_ready == nullptr && !tuning.planes_on_host) route.planes_source = &source;
#endif
    const DevicePlan pieces = PlanDevice(plan, route);
    planning += SecondsSince(t_plan);
    phases.planned = SecondsSince(t0);
#ifdef FERRY_HAVE_CUDA_KERNELS
    const uint32_t nplanes = pieces.planes_count();
    uint64_t planes_batches = 0;
    for (const Batch& b : pieces.batches) planes_batches += b.planes ? 1 : 0;
    const bool planes_verify = options.verify && source.has_checksums();
    if (nplanes > 0) {
      PlanesStageShape shape;
      shape.group = tuning.planes_group;
      shape.twin_factor = tuning.planes_twin_factor;
      shape.prewarm = tuning.planes_prewarm;
      shape.verify_each_group = tuning.planes_verify_each_group;
      FERRY_RETURN_IF_ERROR(planes_stage.Prepare(
          current, ring->num_slots(), options.slot_bytes + kSlotSlack, shape, source.path()));
      FERRY_RETURN_IF_ERROR(
          planes_stage.StartLoad(nplanes, planes_batches, planes_verify, cstream, source.path()));
      phases.planes_ready = SecondsSince(t0);
    }
#endif
    // One-shot load: the first from this mapping. Its resident raw bytes are read with pread
    // (no page faults on a mapping used once) by more workers; repeated loads of one file
    // copy from the mapping they have already faulted in. A source without a mapping is
    // always read.
    const bool mapped = source.mapping() != nullptr;
    const bool one_shot = !mapped || loaded_mapping.lock() != source.mapping();
    loaded_mapping = source.mapping();
    const bool pread = !mapped || (one_shot && !route.cold && !route.from_mapping);
    // Streaming: declared after `out`, so it is finished (its thread joined) before `out` goes.
    std::unique_ptr<Handover> handover;
    if (on_ready != nullptr) {
      std::vector<uint32_t> count(plan.res.size(), 0);
      CountPieces(pieces.mapped, &count);
      CountPieces(pieces.staged, &count);
      handover = std::make_unique<Handover>(*on_ready, when, out, true, stream, current);
      FERRY_RETURN_IF_ERROR(handover->Start(std::move(count)));
    }
    DeviceJob job{source, plan,          pieces,         route,
                  direct, cstream,       options.verify, options.streaming_stores,
                  pread,  handover.get()};
    FERRY_ASSIGN_OR_RETURN(auto workers, Workers(source, plan, one_shot, options.verify));
    const int active = workers.second;
#ifdef FERRY_HAVE_CUDA_KERNELS
    if (nplanes > 0) {
      job.planes = &planes_stage;
      job.planes_batch0 = pieces.batches.size() - planes_batches;
      job.planes_verify = planes_verify;
      using PlanesRead = LoaderTuning::PlanesRead;
      job.planes_pread = !mapped || tuning.planes_read == PlanesRead::kRead ||
                         (tuning.planes_read == PlanesRead::kAuto && (pread || route.cold));
    }
#endif
    Status ran = RunDevice(job, current, dev, *workers.first, workers.second);
    phases.enqueued = SecondsSince(t0);
    const double fill = job.first_fill.load();
    phases.first_fill = fill > 0 ? fill - start : 0;
#ifdef FERRY_HAVE_CUDA_KERNELS
    if (nplanes > 0) {
      if (ran.ok()) ran = PlanesErrors(planes_stage, source, plan, pieces, cstream);
      planes_stage.EndLoad(cstream);
      const double launch = planes_stage.first_launch();
      phases.first_decode = launch > 0 ? launch - start : 0;
      phases.checked = SecondsSince(t0);
    }
#endif
    if (handover) {
      Status handed = handover->Finish();
      if (ran.ok()) ran = std::move(handed);
    }
    FERRY_RETURN_IF_ERROR(ran);

    stats = LoadStats{};
    stats.bytes = plan.bytes();
    stats.copies = job.copies.load();
    stats.pinned_bytes = ring->pinned_bytes();
    stats.used_register = route.from_mapping;
    stats.used_direct_io = route.cold;
    stats.used_pread = pread;
    stats.workers = active;
    stats.setup_seconds = setup;
    stats.plan_seconds = planning;
    stats.alloc_seconds = allocation;
    stats.seconds = SecondsSince(t0);
    phases.total = stats.seconds;
    return out;
  }
#endif  // FERRY_HAVE_CUDA

  Result<std::vector<LoadedTensor>> HostLoad(const Reader& reader,
                                             const std::vector<LoadRequest>& requests,
                                             const ReadyCallback* on_ready = nullptr) {
    const BlockSource& source = BlocksOf(reader);
    auto t0 = std::chrono::steady_clock::now();
    FERRY_ASSIGN_OR_RETURN(LoadPlan plan, Resolve(source, requests));
    const auto t_alloc = std::chrono::steady_clock::now();
    std::vector<LoadedTensor> out;
    FERRY_RETURN_IF_ERROR(AllocateHost(source, plan, &out));
    const double allocation = SecondsSince(t_alloc);
    const auto t_pieces = std::chrono::steady_clock::now();
    const std::vector<Piece> pieces =
        MakePieces(plan, HostPieceBytes(source, options.slot_bytes), true);
    const double planning =
        std::chrono::duration<double>(t_alloc - t0).count() + SecondsSince(t_pieces);
    std::unique_ptr<Handover> handover;
    if (on_ready != nullptr) {
      std::vector<uint32_t> count(plan.res.size(), 0);
      CountPieces(pieces, &count);
      handover =
          std::make_unique<Handover>(*on_ready, HandOver::kComplete, out, false, nullptr, nullptr);
      FERRY_RETURN_IF_ERROR(handover->Start(std::move(count)));
    }
    const DirectFile direct = OpenDirect(source, plan, options.io);
    ReadPath how;
    how.verify = options.verify;
    how.direct = direct.is_open() ? &direct : nullptr;
    FirstError error;
    std::atomic<uint64_t> next{0};
    const std::vector<std::pair<uint32_t, uint32_t>> runs = HostRuns(source, plan, pieces);
    FERRY_ASSIGN_OR_RETURN(auto workers, Workers(source, plan, false, options.verify));
    const int active = workers.second;
    auto dst_of = [&](const Piece& p) { return plan.res[p.r].dst + p.dst_off; };
    workers.first->Run([&](int worker) {
      if (worker >= active) return;
      for (;;) {
        uint64_t k = next.fetch_add(1);
        if (k >= runs.size() || error.failed()) return;
        const auto [first, last] = runs[k];
        Status st;
        if (last - first > 1) {
          // Raw pieces read together, then checked where they landed.
          st = ReadRawPieces(source, plan, pieces, first, last, dst_of);
          for (uint32_t i = first; st.ok() && how.verify && i < last; ++i) {
            const Piece& p = pieces[i];
            st = source.VerifyRange(plan.res[p.r].tensor, p.begin, p.len, dst_of(p));
          }
        } else {
          const Piece& p = pieces[first];
          st = source.Read(plan.res[p.r].tensor, p.begin, p.len, dst_of(p), how);
        }
        for (uint32_t i = first; st.ok() && handover && i < last; ++i) {
          st = handover->PieceDone(pieces[i].r);
        }
        if (!st.ok()) error.Set(std::move(st));
      }
    });
    if (handover) {
      Status st = handover->Finish();
      if (!st.ok()) error.Set(std::move(st));
    }
    if (error.failed()) return error.Get();
    stats = LoadStats{};
    stats.used_direct_io = direct.is_open();
    stats.bytes = plan.bytes();
    stats.copies = pieces.size();
    stats.workers = active;
    stats.plan_seconds = planning;
    stats.alloc_seconds = allocation;
    stats.seconds = SecondsSince(t0);
    return out;
  }
};

bool CudaAvailable() {
#ifdef FERRY_HAVE_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}

Loader::Loader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Loader::~Loader() = default;

Result<std::unique_ptr<Loader>> Loader::Create(LoaderOptions options) {
  if (options.slot_bytes < 4096 || options.slot_bytes % 4096 != 0) {
    return Error(StatusCode::kInvalidArgument, "LoaderOptions.slot_bytes ", options.slot_bytes,
                 " must be a positive multiple of 4096");
  }
  if (options.staging_bytes < 2 * options.slot_bytes) {
    return Error(StatusCode::kInvalidArgument, "LoaderOptions.staging_bytes ",
                 options.staging_bytes, " must hold at least two slots of ", options.slot_bytes);
  }
  if (options.threads < 0 || options.threads > 256) {
    return Error(StatusCode::kInvalidArgument, "LoaderOptions.threads ", options.threads,
                 " outside [0, 256]");
  }
  const bool explicit_threads = options.threads != 0;
  if (options.threads == 0) options.threads = DefaultThreads();
  auto impl = std::make_unique<Impl>();
  impl->explicit_threads = explicit_threads;
  impl->options = options;
  FERRY_ASSIGN_OR_RETURN(impl->pool, WorkerPool::Create(options.threads));
  return std::unique_ptr<Loader>(new Loader(std::move(impl)));
}

Result<std::vector<LoadedTensor>> Loader::LoadAsync(const Reader& reader,
                                                    const std::vector<LoadRequest>& requests,
                                                    Stream stream,
                                                    const DeviceAllocator* allocator) {
  std::lock_guard<std::mutex> lock(impl_->call_mu);
#ifdef FERRY_HAVE_CUDA
  if (allocator != nullptr && !allocator->allocate) {
    return Error(StatusCode::kInvalidArgument, reader.path(), ": allocator without allocate");
  }
  return impl_->DeviceLoad(reader, requests, stream, allocator);
#else
  (void)requests;
  (void)stream;
  (void)allocator;
  return Error(StatusCode::kUnimplemented, reader.path(),
               ": this build of TensorFerry has no CUDA support (use LoadToHost)");
#endif
}

Result<std::vector<LoadedTensor>> Loader::Load(const Reader& reader,
                                               const std::vector<LoadRequest>& requests,
                                               Stream stream, const DeviceAllocator* allocator) {
  FERRY_ASSIGN_OR_RETURN(auto out, LoadAsync(reader, requests, stream, allocator));
#ifdef FERRY_HAVE_CUDA
  auto t0 = std::chrono::steady_clock::now();
  cudaError_t err = cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) return CudaStatus(err, reader.path(), "cudaStreamSynchronize");
  std::lock_guard<std::mutex> lock(impl_->call_mu);
  impl_->stats.seconds += SecondsSince(t0);
#endif
  return out;
}

Result<std::vector<LoadedTensor>> Loader::LoadToHost(const Reader& reader,
                                                     const std::vector<LoadRequest>& requests) {
  std::lock_guard<std::mutex> lock(impl_->call_mu);
  return impl_->HostLoad(reader, requests);
}

Result<std::vector<LoadedTensor>> Loader::LoadStreaming(const Reader& reader,
                                                        const std::vector<LoadRequest>& requests,
                                                        const ReadyCallback& on_ready,
                                                        HandOver when, Stream stream,
                                                        const DeviceAllocator* allocator) {
  if (!on_ready) {
    return Error(StatusCode::kInvalidArgument, reader.path(), ": LoadStreaming without a callback");
  }
  std::lock_guard<std::mutex> lock(impl_->call_mu);
#ifdef FERRY_HAVE_CUDA
  if (allocator != nullptr && !allocator->allocate) {
    return Error(StatusCode::kInvalidArgument, reader.path(), ": allocator without allocate");
  }
  return impl_->DeviceLoad(reader, requests, stream, allocator, &on_ready, when);
#else
  (void)requests;
  (void)when;
  (void)stream;
  (void)allocator;
  return Error(StatusCode::kUnimplemented, reader.path(),
               ": this build of TensorFerry has no CUDA support (use LoadToHostStreaming)");
#endif
}

Result<std::vector<LoadedTensor>> Loader::LoadToHostStreaming(
    const Reader& reader, const std::vector<LoadRequest>& requests, const ReadyCallback& on_ready) {
  if (!on_ready) {
    return Error(StatusCode::kInvalidArgument, reader.path(),
                 ": LoadToHostStreaming without a callback");
  }
  std::lock_guard<std::mutex> lock(impl_->call_mu);
  return impl_->HostLoad(reader, requests, &on_ready);
}

void LoaderInternals::SetTuning(Loader& loader, const LoaderTuning& tuning) {
  std::lock_guard<std::mutex> lock(loader.impl_->call_mu);
  loader.impl_->tuning = tuning;
}

LoaderTuning LoaderInternals::Tuning(const Loader& loader) {
  std::lock_guard<std::mutex> lock(loader.impl_->call_mu);
  return loader.impl_->tuning;
}

LoadPhases LoaderInternals::LastPhases(const Loader& loader) {
  std::lock_guard<std::mutex> lock(loader.impl_->call_mu);
  return loader.impl_->phases;
}

LoadStats Loader::last_stats() const {
  std::lock_guard<std::mutex> lock(impl_->call_mu);
  return impl_->stats;
}

const LoaderOptions& Loader::options() const { return impl_->options; }

}  // namespace ferry
