// The loader: plan pieces, move them through a pinned staging ring (or straight from a
// registered page cache) onto the caller's device and stream, or into host memory.
#include "ferry/loader.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "cuda_util.hpp"
#include "planes.hpp"
#include "planes_stage.hpp"
#include "reader_impl.hpp"
#include "util.hpp"
#include "worker_pool.hpp"

#ifdef FERRY_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime.h>
#endif

namespace ferry {

namespace {

constexpr uint64_t kDeviceAlign = 256;
// Tensors below this size share one default allocation so their copies coalesce.
constexpr uint64_t kArenaTensorLimit = uint64_t{1} << 20;
// Copy-bound loads (raw tensors) run on at most this many workers; see LoaderOptions::threads.
constexpr int kCopyWorkers = 8;

struct Resolved {
  size_t tensor = 0;
  uint64_t begin = 0;  // raw byte range within the tensor
  uint64_t len = 0;
  uint64_t file_offset = 0;  // for ordering reads
  TensorInfo info;
  uint8_t* dst = nullptr;
  // Destinations with the same id belong to one allocation; a single DMA may only span
  // pieces of one allocation (adjacent cudaMalloc blocks are not one copyable range).
  uint64_t alloc_id = 0;
};

// Workers for a load: all of them when most bytes need decoding, else kCopyWorkers.
int ActiveWorkers(const std::vector<Resolved>& res, int pool_size) {
  uint64_t total = 0, encoded = 0;
  for (const Resolved& r : res) {
    total += r.len;
    if (r.info.encoding != Encoding::kRaw) encoded += r.len;
  }
  return encoded * 2 > total ? pool_size : std::min(pool_size, kCopyWorkers);
}

struct Piece {
  uint32_t r;      // index into the resolved list
  uint64_t begin;  // raw byte offset within the tensor
  uint64_t len;
  uint64_t dst_off;  // offset within the resolved destination
  uint64_t soff;     // offset within its staging slot
};

struct Batch {
  uint32_t first, last;  // pieces [first, last)
  // Direct batches: one O_DIRECT read of file bytes [span_begin, span_begin + span_len) into
  // the slot; each piece then sits at its file offset minus span_begin.
  bool direct = false;
  uint64_t span_begin = 0, span_len = 0;
  // PLANES blocks whose stored bytes go to the device, which expands them (GPU decode).
  bool planes = false;
};

// Page and O_DIRECT alignment (also the unit of page-cache registration).
constexpr uint64_t kDirectAlign = 4096;
// Below this resident fraction a load counts as cold and takes direct I/O (IoMode::kAuto).
constexpr double kColdFraction = 0.5;
// Room past a chunk for aligning a direct read's start and end.
constexpr uint64_t kSlotSlack = 2 * kDirectAlign;

// Pieces copied straight from the mapping, with the page range to register around them
// (empty when the whole mapping is registered).
struct Group {
  uint32_t first, last;
  uint64_t reg_begin, reg_end;
};

int DefaultThreads() {
  unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp<unsigned>(hw == 0 ? 4 : hw, 1, 16));
}

// Resolves requests (all tensors when empty) against the reader, sorted by file offset so
// reads stream through the file.
Result<std::vector<Resolved>> Resolve(const Reader::Impl& r,
                                      const std::vector<LoadRequest>& requests,
                                      std::vector<size_t>* request_order) {
  std::vector<Resolved> out;
  if (requests.empty()) {
    out.resize(r.size());
    for (size_t i = 0; i < r.size(); ++i) {
      out[i].tensor = i;
      out[i].len = r.at(i)->nbytes();
    }
  } else {
    out.resize(requests.size());
    for (size_t k = 0; k < requests.size(); ++k) {
      const LoadRequest& q = requests[k];
      FERRY_ASSIGN_OR_RETURN(out[k].tensor, r.Lookup(q.name));
      const fb::Tensor* t = r.at(out[k].tensor);
      if (q.row_begin == 0 && q.row_end < 0) {
        out[k].len = t->nbytes();
      } else {
        int64_t rows = t->shape() && t->shape()->size() ? t->shape()->Get(0) : 0;
        int64_t row_end = q.row_end < 0 ? rows : q.row_end;
        FERRY_ASSIGN_OR_RETURN(auto range, r.RowRange(out[k].tensor, q.row_begin, row_end));
        out[k].begin = range.first;
        out[k].len = range.second;
      }
      if (q.dst != nullptr && q.dst_bytes < out[k].len) {
        return Error(StatusCode::kInvalidArgument, r.Where(out[k].tensor), ": needs ", out[k].len,
                     " bytes, destination holds ", q.dst_bytes);
      }
      out[k].dst = static_cast<uint8_t*>(q.dst);
    }
  }
  for (size_t k = 0; k < out.size(); ++k) {
    out[k].info = r.Info(out[k].tensor);
    out[k].file_offset = out[k].info.data_offset + out[k].begin;
    if (!requests.empty()) {
      const LoadRequest& q = requests[k];
      if (!(q.row_begin == 0 && q.row_end < 0)) {
        int64_t rows = out[k].info.shape[0];
        out[k].info.shape[0] = (q.row_end < 0 ? rows : q.row_end) - q.row_begin;
      }
    }
  }
  request_order->resize(out.size());
  for (size_t k = 0; k < out.size(); ++k) (*request_order)[k] = k;
  std::stable_sort(request_order->begin(), request_order->end(),
                   [&](size_t a, size_t b) { return out[a].file_offset < out[b].file_offset; });
  return out;
}

// Splits every resolved range into pieces of at most `max_piece` bytes whose boundaries fall
// on multiples of the piece size within the tensor, so block checksums and zstd blocks are
// handled whole whenever the piece size divides the block size.
std::vector<Piece> MakePieces(const std::vector<Resolved>& res, const std::vector<size_t>& order,
                              uint64_t max_piece) {
  std::vector<Piece> pieces;
  for (size_t k : order) {
    const Resolved& r = res[k];
    uint64_t step = max_piece;
    if (r.info.block_size > 0) step = std::min(step, r.info.block_size);
    uint64_t pos = r.begin, end = r.begin + r.len;
    while (pos < end) {
      uint64_t next = std::min(end, (pos / step + 1) * step);
      pieces.push_back(Piece{static_cast<uint32_t>(k), pos, next - pos, pos - r.begin, 0});
      pos = next;
    }
  }
  return pieces;
}

// Groups consecutive pieces into batches that fit one staging slot, packed at 64 bytes.
void AppendBatches(std::vector<Piece>& pieces, uint32_t first, uint32_t last, uint64_t slot_bytes,
                   std::vector<Batch>* batches) {
  uint64_t used = 0;
  bool open = false;
  for (uint32_t i = first; i < last; ++i) {
    uint64_t need = AlignUp(pieces[i].len, 64);
    if (!open || used + need > slot_bytes) {
      batches->push_back(Batch{i, i + 1});
      used = 0;
      open = true;
    } else {
      batches->back().last = i + 1;
    }
    pieces[i].soff = used;
    used += need;
  }
}

// A whole PLANES-coded block: the device can expand it straight into the destination.
[[maybe_unused]] bool DevicePlanesPiece(const Reader::Impl& r, const Resolved& rr, const Piece& p) {
  if (rr.info.encoding != Encoding::kPlanes || p.len == 0) return false;
  const fb::Tensor* t = r.at(rr.tensor);
  const uint64_t bs = t->block_size();
  if (p.begin % bs != 0 || p.len != r.BlockRawSize(rr.tensor, p.begin / bs)) return false;
  const fb::Chunk* ch = t->chunks()->Get(static_cast<flatbuffers::uoffset_t>(p.begin / bs));
  return ch->codec() == fb::ChunkCodec::PLANES;
}

// Stored size of a PLANES piece (see DevicePlanesPiece).
[[maybe_unused]] uint64_t PlanesStoredSize(const Reader::Impl& r, const Resolved& rr,
                                           const Piece& p) {
  const fb::Tensor* t = r.at(rr.tensor);
  return t->chunks()
      ->Get(static_cast<flatbuffers::uoffset_t>(p.begin / t->block_size()))
      ->stored_size();
}

// Packs PLANES pieces by stored size, 256-byte aligned (the decoder's source alignment).
[[maybe_unused]] void AppendPlanesBatches(const Reader::Impl& r, const std::vector<Resolved>& res,
                                          std::vector<Piece>& pieces, uint32_t first, uint32_t last,
                                          uint64_t slot_bytes, std::vector<Batch>* batches) {
  uint64_t used = 0;
  bool open = false;
  for (uint32_t i = first; i < last; ++i) {
    uint64_t need = AlignUp(PlanesStoredSize(r, res[pieces[i].r], pieces[i]), 256);
    if (!open || used + need > slot_bytes) {
      Batch b{i, i + 1};
      b.planes = true;
      batches->push_back(b);
      used = 0;
      open = true;
    } else {
      batches->back().last = i + 1;
    }
    pieces[i].soff = used;
    used += need;
  }
}

// Groups consecutive raw pieces (file order) into direct batches whose aligned file span fits
// one slot; gaps between the pieces are read too, which is cheaper than another request.
void AppendDirectBatches(std::vector<Piece>& pieces, uint32_t first, uint32_t last,
                         const std::vector<Resolved>& res, uint64_t slot_bytes,
                         std::vector<Batch>* batches) {
  auto file_off = [&](const Piece& p) { return res[p.r].info.data_offset + p.begin; };
  uint32_t i = first;
  while (i < last) {
    uint64_t span_begin = file_off(pieces[i]) / kDirectAlign * kDirectAlign;
    uint32_t j = i;
    uint64_t span_end = span_begin;
    while (j < last) {
      uint64_t b = file_off(pieces[j]);
      uint64_t e = AlignUp(b + pieces[j].len, kDirectAlign);
      if (b < span_begin || (j > i && std::max(span_end, e) - span_begin > slot_bytes)) break;
      span_end = std::max(span_end, e);
      pieces[j].soff = b - span_begin;
      ++j;
    }
    Batch batch{i, j};
    batch.direct = true;
    batch.span_begin = span_begin;
    batch.span_len = span_end - span_begin;
    batches->push_back(batch);
    i = j;
  }
}

// Bytes resident in the page cache, as a fraction of sampled pages of the requested ranges.
double ResidentFraction(const Mapping& m, const std::vector<Resolved>& res) {
  uint64_t total = 0;
  for (const Resolved& r : res) total += r.len;
  if (total == 0 || m.size() == 0) return 1.0;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t samples = std::min<uint64_t>(2048, total / page + 1);
  const uint64_t stride = std::max<uint64_t>(total / samples, 1);
  uint64_t seen = 0, resident = 0, acc = 0;
  for (const Resolved& r : res) {
    for (uint64_t off = acc % stride == 0 ? 0 : stride - acc % stride; off < r.len; off += stride) {
      uint64_t at = (r.info.data_offset + r.begin + off) / page * page;
      unsigned char vec = 0;
      if (::mincore(const_cast<uint8_t*>(m.data()) + at, page, &vec) == 0) {
        ++seen;
        resident += vec & 1;
      }
    }
    acc += r.len;
  }
  return seen == 0 ? 1.0 : static_cast<double>(resident) / seen;
}

// Reads file bytes [offset, offset + len) with O_DIRECT (offset, len and dst aligned); a read
// that ends at end of file may return less than len but must cover `need` bytes.
Status DirectRead(int fd, const std::string& path, uint8_t* dst, uint64_t offset, uint64_t len,
                  uint64_t need) {
  uint64_t done = 0;
  while (done < len) {
    ssize_t n = ::pread(fd, dst + done, len - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Error(StatusCode::kIoError, path, ": direct read at offset ", offset + done,
                   " failed ", ErrnoText(errno));
    }
    if (n == 0) break;
    done += static_cast<uint64_t>(n);
  }
  if (done < need) {
    return Error(StatusCode::kDataLoss, path, ": direct read at offset ", offset, " got ", done,
                 " of ", need, " bytes (file truncated?)");
  }
  return Status::Ok();
}

// An aligned per-thread buffer for direct reads of compressed chunks.
uint8_t* DirectBuffer(uint64_t bytes) {
  struct Buf {
    uint8_t* p = nullptr;
    uint64_t n = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf buf;
  if (buf.n < bytes) {
    std::free(buf.p);
    buf.n = AlignUp(bytes, kDirectAlign);
    buf.p = static_cast<uint8_t*>(std::aligned_alloc(kDirectAlign, buf.n));
    if (buf.p == nullptr) buf.n = 0;
  }
  return buf.p;
}

// Raw bytes [p.begin, p.begin + p.len) of an encoded tensor, its chunks read with O_DIRECT.
Status FillEncodedDirect(const Reader::Impl& r, int fd, size_t tensor, uint64_t begin, uint64_t len,
                         uint8_t* dst, bool verify) {
  const fb::Tensor* t = r.at(tensor);
  const uint64_t bs = t->block_size();
  thread_local std::vector<uint8_t> block, scratch;
  for (uint64_t b = begin / bs; b * bs < begin + len; ++b) {
    const fb::Chunk* ch = t->chunks()->Get(static_cast<flatbuffers::uoffset_t>(b));
    uint64_t off = t->data_offset() + ch->offset();
    uint64_t abegin = off / kDirectAlign * kDirectAlign;
    uint64_t aend = AlignUp(off + ch->stored_size(), kDirectAlign);
    uint8_t* buf = DirectBuffer(aend - abegin);
    if (buf == nullptr) {
      return Error(StatusCode::kResourceExhausted, r.Where(tensor), ": direct read buffer");
    }
    FERRY_RETURN_IF_ERROR(
        DirectRead(fd, r.path, buf, abegin, aend - abegin, off + ch->stored_size() - abegin));
    uint64_t braw = r.BlockRawSize(tensor, b);
    uint64_t bbegin = b * bs;
    uint64_t lo = std::max(begin, bbegin), hi = std::min(begin + len, bbegin + braw);
    if (scratch.size() < braw) scratch.resize(braw);
    if (lo == bbegin && hi == bbegin + braw) {
      FERRY_RETURN_IF_ERROR(r.DecodeStored(tensor, b, buf + (off - abegin), dst + (bbegin - begin),
                                           scratch.data(), verify));
    } else {
      if (block.size() < braw) block.resize(braw);
      FERRY_RETURN_IF_ERROR(
          r.DecodeStored(tensor, b, buf + (off - abegin), block.data(), scratch.data(), verify));
      std::memcpy(dst + (lo - begin), block.data() + (lo - bbegin), hi - lo);
    }
  }
  return Status::Ok();
}

// First error wins; later ones are dropped (they are usually consequences).
class ErrorSlot {
 public:
  void Set(Status st) {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) status_ = std::move(st);
    failed_.store(true);
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  Status Get() {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

 private:
  std::mutex mu_;
  Status status_;
  std::atomic<bool> failed_{false};
};

// Memory the kernel could give the page cache now (MemAvailable), or 0 when unknown.
uint64_t AvailableMemory() {
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t kib = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %lu kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib * 1024;
}

// IoMode::kAuto. Direct reads pay off when the page cache cannot help: the data is cold AND
// larger than half the memory the cache could use, so caching it would only evict other
// data. Below that, buffered reads with kernel readahead measured as fast or faster than
// O_DIRECT on the H200 host's virtual disk (benchmarks/README.md), and they leave the file
// cached for the next process.
bool WantDirect(const Reader::Impl& r, const std::vector<Resolved>& res) {
  uint64_t bytes = 0;
  for (const Resolved& x : res) bytes += x.len;
  uint64_t avail = AvailableMemory();
  if (avail == 0 || bytes <= avail / 2) return false;
  return ResidentFraction(*r.mapping, res) < kColdFraction;
}

// An O_DIRECT descriptor for cold loads (IoMode), or none (-1) for the page-cache path.
class DirectFile {
 public:
  DirectFile(const Reader::Impl& r, const std::vector<Resolved>& res, IoMode io) {
    if (io == IoMode::kDirect || (io == IoMode::kAuto && WantDirect(r, res))) {
      fd_ = ::open(r.path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    }
  }
  ~DirectFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  DirectFile(const DirectFile&) = delete;
  DirectFile& operator=(const DirectFile&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
};

// Host target of a raw piece through direct I/O: an aligned bounce buffer, then a copy.
Status FillRawDirect(const Reader::Impl& r, int fd, const Resolved& rr, const Piece& p,
                     uint8_t* dst, bool verify) {
  uint64_t off = rr.info.data_offset + p.begin;
  uint64_t abegin = off / kDirectAlign * kDirectAlign;
  uint64_t aend = AlignUp(off + p.len, kDirectAlign);
  uint8_t* buf = DirectBuffer(aend - abegin);
  if (buf == nullptr) {
    return Error(StatusCode::kResourceExhausted, r.Where(rr.tensor), ": direct read buffer");
  }
  FERRY_RETURN_IF_ERROR(DirectRead(fd, r.path, buf, abegin, aend - abegin, off + p.len - abegin));
  std::memcpy(dst, buf + (off - abegin), p.len);
  if (verify) return r.VerifyRawRange(rr.tensor, p.begin, p.len, dst);
  return Status::Ok();
}

}  // namespace

#ifdef FERRY_HAVE_CUDA
namespace {

struct Slot {
  uint8_t* data = nullptr;
  cudaEvent_t event = nullptr;
  bool used = false;
  uint64_t turn = 0;
};

}  // namespace
#endif  // FERRY_HAVE_CUDA

class Loader::Impl {
 public:
  LoaderOptions options;
  bool explicit_threads = false;  // the caller chose the thread count: use all of them
  std::mutex call_mu;
  std::unique_ptr<WorkerPool> pool;
  LoadStats stats;

#ifdef FERRY_HAVE_CUDA
  // Pinned ring, allocated on first device load in the caller's context.
  uint8_t* ring = nullptr;
  uint64_t ring_bytes = 0;
  bool ring_registered = false;  // malloc + cudaHostRegister (else cudaHostAlloc)
  std::vector<Slot> slots;
  CUcontext events_ctx = nullptr;          // events belong to one context; remade on change
  cudaEvent_t tail = nullptr;              // recorded after each load's last copy
  std::vector<cudaEvent_t> worker_events;  // windowed registration, one per worker
  std::shared_ptr<Mapping> registered;     // mapping registered for direct DMA

  std::mutex slot_mu;
  std::condition_variable slot_cv;

#ifdef FERRY_HAVE_CUDA_KERNELS
  // Device twins of the ring slots for PLANES blocks, and the load's first PLANES piece.
  PlanesStage planes_stage;
  uint32_t planes_first = 0;
#endif

  ~Impl() { ReleaseCuda(); }

  void WaitInFlight() {
    for (Slot& s : slots) {
      if (s.used) cudaEventSynchronize(s.event);
      s.used = false;
    }
    if (tail) cudaEventSynchronize(tail);
  }

  void ReleaseEvents() {
    ScopedContext scope(events_ctx);
    WaitInFlight();
    for (Slot& s : slots) {
      if (s.event) cudaEventDestroy(s.event);
      s.event = nullptr;
    }
    if (tail) cudaEventDestroy(tail);
    tail = nullptr;
    for (cudaEvent_t& e : worker_events) {
      if (e) cudaEventDestroy(e);
      e = nullptr;
    }
  }

  void Unregister() {
    if (!registered) return;
    ScopedContext scope(events_ctx);
    if (tail) cudaEventSynchronize(tail);
    cudaHostUnregister(const_cast<uint8_t*>(registered->data()));
    registered.reset();
  }

  void ReleaseCuda() {
#ifdef FERRY_HAVE_CUDA_KERNELS
    planes_stage.Release();
#endif
    if (events_ctx == nullptr && ring == nullptr) return;
    ScopedContext scope(events_ctx);
    Unregister();
    ReleaseEvents();
    if (ring != nullptr) {
      if (ring_registered) {
        cudaHostUnregister(ring);
        std::free(ring);
      } else {
        cudaFreeHost(ring);
      }
      ring = nullptr;
    }
    slots.clear();
  }

  // Ring and events for the caller's current context.
  Status PrepareDevice(CUcontext ctx) {
    if (ring == nullptr) {
      uint64_t nslots = std::max<uint64_t>(2, options.staging_bytes / options.chunk_bytes);
      const uint64_t stride = options.chunk_bytes + kSlotSlack;
      ring_bytes = nslots * stride;
      if (options.pinned_alloc == PinnedAlloc::kHostAlloc) {
        void* p = nullptr;
        FERRY_CUDA_RETURN(cudaHostAlloc(&p, ring_bytes, cudaHostAllocPortable), "staging ring");
        ring = static_cast<uint8_t*>(p);
        ring_registered = false;
      } else {
        void* p = std::aligned_alloc(4096, ring_bytes);
        if (p == nullptr) {
          return Error(StatusCode::kResourceExhausted, "staging ring of ", ring_bytes, " bytes");
        }
        // Touch every page first: registering prefaulted memory is measurably faster.
        std::memset(p, 0, ring_bytes);
        cudaError_t err = cudaHostRegister(p, ring_bytes, cudaHostRegisterPortable);
        if (err != cudaSuccess) {
          std::free(p);
          return CudaStatus(err, "staging ring", "cudaHostRegister");
        }
        ring = static_cast<uint8_t*>(p);
        ring_registered = true;
      }
      slots.resize(nslots);
      for (uint64_t i = 0; i < nslots; ++i) slots[i].data = ring + i * stride;
    }
    if (events_ctx != ctx) {
      if (events_ctx != nullptr) {
        Unregister();
        ReleaseEvents();
      }
      for (Slot& s : slots) {
        FERRY_CUDA_RETURN(cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming),
                          "staging events");
        s.used = false;
      }
      FERRY_CUDA_RETURN(cudaEventCreateWithFlags(&tail, cudaEventDisableTiming), "tail event");
      worker_events.assign(pool->size(), nullptr);
      for (cudaEvent_t& e : worker_events) {
        FERRY_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "worker events");
      }
      events_ctx = ctx;
    }
    return Status::Ok();
  }

  Status RegisterMapping(const std::shared_ptr<Mapping>& mapping) {
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

  Result<std::vector<LoadedTensor>> DeviceLoad(const Reader& reader,
                                               const std::vector<LoadRequest>& requests,
                                               Stream stream, const DeviceAllocator* alloc) {
    const Reader::Impl& r = reader.impl();
    auto t0 = std::chrono::steady_clock::now();
    cudaStream_t cstream = reinterpret_cast<cudaStream_t>(stream);
    int dev = -1;
    FERRY_CUDA_RETURN(cudaGetDevice(&dev), r.path);
    // Makes the caller's current device's context current on this thread if the thread has
    // none yet; that is the caller's device, never another.
    FERRY_CUDA_RETURN(cudaFree(nullptr), r.path);
    CUcontext ctx = nullptr;
    if (Driver().ok) Driver().ctx_get_current(&ctx);
    FERRY_RETURN_IF_ERROR(PrepareDevice(ctx));

    std::vector<size_t> order;
    FERRY_ASSIGN_OR_RETURN(std::vector<Resolved> res, Resolve(r, requests, &order));
    std::vector<LoadedTensor> out(res.size());
    FERRY_RETURN_IF_ERROR(AllocateDevice(r, res, order, out, cstream, alloc, ctx, dev));

    // Data mostly absent from the page cache is read with O_DIRECT straight into the ring
    // (no page-cache copy, no readahead guesswork); file systems without O_DIRECT (tmpfs)
    // keep the page-cache path.
    DirectFile direct_file(r, res, options.io);
    const int direct_fd = direct_file.fd();
    const bool windows = direct_fd < 0 && options.host_path == HostPath::kRegisterWindows;
    bool use_register =
        direct_fd < 0 && (options.host_path == HostPath::kRegister || windows ||
                          (options.host_path == HostPath::kAuto && registered == r.mapping));
    if (use_register && !windows) FERRY_RETURN_IF_ERROR(RegisterMapping(r.mapping));
    if (windows) Unregister();

    // Raw pieces go straight from the registered mapping, or through one direct read per
    // batch; everything else is filled by the CPU (copy or decode) into the ring.
    std::vector<Piece> all = MakePieces(res, order, options.chunk_bytes);
    std::vector<Piece> direct, staged, direct_raw, device_planes;
#ifdef FERRY_HAVE_CUDA_KERNELS
    // Checksums are computed on the host, so verified loads decode PLANES blocks there.
    const bool planes_on_device = !options.verify;
#else
    const bool planes_on_device = false;
#endif
    for (const Piece& p : all) {
      bool raw = res[p.r].info.encoding == Encoding::kRaw;
      if (planes_on_device && DevicePlanesPiece(r, res[p.r], p)) {
        device_planes.push_back(p);
      } else if (use_register && raw) {
        direct.push_back(p);
      } else if (direct_fd >= 0 && raw) {
        direct_raw.push_back(p);
      } else {
        staged.push_back(p);
      }
    }
    std::vector<Batch> batches;
    const uint32_t nfill = static_cast<uint32_t>(staged.size());
    staged.insert(staged.end(), direct_raw.begin(), direct_raw.end());
    AppendBatches(staged, 0, nfill, options.chunk_bytes, &batches);
    AppendDirectBatches(staged, nfill, static_cast<uint32_t>(staged.size()), res,
                        options.chunk_bytes + kSlotSlack, &batches);
#ifdef FERRY_HAVE_CUDA_KERNELS
    const uint32_t nplanes = static_cast<uint32_t>(device_planes.size());
    planes_first = static_cast<uint32_t>(staged.size());
    staged.insert(staged.end(), device_planes.begin(), device_planes.end());
    AppendPlanesBatches(r, res, staged, planes_first, static_cast<uint32_t>(staged.size()),
                        options.chunk_bytes + kSlotSlack, &batches);
    if (nplanes > 0) {
      FERRY_RETURN_IF_ERROR(
          planes_stage.Prepare(ctx, slots.size(), options.chunk_bytes + kSlotSlack, r.path));
      FERRY_RETURN_IF_ERROR(planes_stage.StartLoad(nplanes, cstream, r.path));
    }
#endif
    std::vector<Group> groups;
    for (uint32_t i = 0; i < direct.size(); ++i) {
      const Piece& p = direct[i];
      uint64_t off = res[p.r].info.data_offset + p.begin;
      uint64_t pb = off / kDirectAlign * kDirectAlign, pe = AlignUp(off + p.len, kDirectAlign);
      if (!windows) {
        groups.push_back(Group{i, i + 1, 0, 0});
        continue;
      }
      Group* g = groups.empty() ? nullptr : &groups.back();
      // Windows never share a page: a page registered twice is an error.
      if (g != nullptr &&
          (pb < g->reg_end || g->reg_end - g->reg_begin < options.register_window_bytes)) {
        g->last = i + 1;
        g->reg_end = std::max(g->reg_end, pe);
      } else {
        groups.push_back(Group{i, i + 1, pb, pe});
      }
    }

    ErrorSlot error;
    std::atomic<uint64_t> next_direct{0}, next_batch{0}, copies{0};
    const uint64_t nslots = slots.size();
    // Batch k uses slot k % nslots; slot.turn says which batch may take it next.
    for (uint64_t i = 0; i < nslots; ++i) slots[i].turn = i;
    const bool verify = options.verify;

    const int active = explicit_threads ? pool->size() : ActiveWorkers(res, pool->size());
    pool->Run([&](int worker) {
      if (worker >= active) return;
      // The worker's first CUDA call must find the caller's context, or the runtime would
      // create one on device 0.
      if (Driver().ok && ctx != nullptr) {
        Driver().ctx_set_current(ctx);
      } else if (cudaSetDevice(dev) != cudaSuccess) {
        error.Set(Error(StatusCode::kCudaError, r.path, ": cudaSetDevice on a worker"));
        return;
      }
      uint8_t* pending = nullptr;  // this worker's registered window, copies in flight
      cudaEvent_t my_event = windows ? worker_events[worker] : nullptr;
      auto release_pending = [&]() -> Status {
        if (pending == nullptr) return Status::Ok();
        cudaError_t err = cudaEventSynchronize(my_event);
        if (err == cudaSuccess) err = cudaHostUnregister(pending);
        pending = nullptr;
        return err == cudaSuccess ? Status::Ok()
                                  : CudaStatus(err, r.path, "releasing a registered window");
      };
      for (;;) {
        uint64_t k = next_direct.fetch_add(1);
        if (k >= groups.size() || error.failed()) break;
        const Group& g = groups[k];
        if (windows) {
          Status st = release_pending();
          cudaError_t err = cudaSuccess;
          if (st.ok()) {
            err = cudaHostRegister(const_cast<uint8_t*>(r.base()) + g.reg_begin,
                                   g.reg_end - g.reg_begin,
                                   cudaHostRegisterReadOnly | cudaHostRegisterPortable);
            if (err != cudaSuccess) {
              cudaGetLastError();
              st = CudaStatus(err, r.path, "cudaHostRegister of a window");
            }
          }
          if (!st.ok()) {
            error.Set(st);
            break;
          }
          pending = const_cast<uint8_t*>(r.base()) + g.reg_begin;
        }
        Status st;
        for (uint32_t i = g.first; st.ok() && i < g.last; ++i) {
          const Piece& p = direct[i];
          const Resolved& rr = res[p.r];
          // The DMA reads the page cache itself, so the blocks are checked there.
          if (verify) st = r.VerifyRawRange(rr.tensor, p.begin, p.len, nullptr);
          if (!st.ok()) break;
          cudaError_t err =
              cudaMemcpyAsync(rr.dst + p.dst_off, r.base() + rr.info.data_offset + p.begin, p.len,
                              cudaMemcpyHostToDevice, cstream);
          if (err != cudaSuccess) {
            st = CudaStatus(err, r.Where(rr.tensor), "cudaMemcpyAsync");
            break;
          }
          copies.fetch_add(1, std::memory_order_relaxed);
        }
        if (st.ok() && windows) {
          cudaError_t err = cudaEventRecord(my_event, cstream);
          if (err != cudaSuccess) st = CudaStatus(err, r.path, "cudaEventRecord");
        }
        if (!st.ok()) {
          error.Set(st);
          break;
        }
      }
      if (Status st = release_pending(); !st.ok()) error.Set(st);
      for (;;) {
        uint64_t k = next_batch.fetch_add(1);
        if (k >= batches.size()) break;
        Slot& slot = slots[k % nslots];
        {
          std::unique_lock<std::mutex> lock(slot_mu);
          slot_cv.wait(lock, [&] { return slot.turn == k || error.failed(); });
        }
        if (error.failed()) break;
        Status st = RunBatch(r, res, staged, batches[k], slot, cstream, verify, direct_fd, &copies);
        if (!st.ok()) error.Set(std::move(st));
        {
          std::lock_guard<std::mutex> lock(slot_mu);
          slot.turn = k + nslots;
        }
        slot_cv.notify_all();
        if (!st.ok()) break;
      }
    });
    {
      // Wake anyone still waiting on a slot of a failed load.
      std::lock_guard<std::mutex> lock(slot_mu);
    }
    slot_cv.notify_all();
    cudaError_t terr = cudaEventRecord(tail, cstream);
    if (error.failed()) return error.Get();
    if (terr != cudaSuccess) return CudaStatus(terr, r.path, "cudaEventRecord");
#ifdef FERRY_HAVE_CUDA_KERNELS
    if (nplanes > 0) {
      // A corrupt unit shows up only once the decode has run: wait for it, so the load
      // reports DataLoss naming the tensor and block instead of handing out garbage.
      std::vector<uint32_t> errors(nplanes);
      FERRY_RETURN_IF_ERROR(planes_stage.FetchErrors(cstream, &errors, r.path));
      for (uint32_t i = 0; i < nplanes; ++i) {
        if (errors[i] == 0) continue;
        const Piece& p = staged[planes_first + i];
        const Resolved& rr = res[p.r];
        const fb::Tensor* t = r.at(rr.tensor);
        const uint64_t b = p.begin / t->block_size();
        return Error(
            StatusCode::kDataLoss, r.Where(rr.tensor), ": block ", b, " at file offset ",
            t->data_offset() + t->chunks()->Get(static_cast<flatbuffers::uoffset_t>(b))->offset(),
            ": ", planes::DeviceErrorText(errors[i]), " (decoded on the GPU)");
      }
    }
#endif

    stats = LoadStats{};
    for (const Resolved& rr : res) stats.bytes += rr.len;
    stats.copies = copies.load();
    stats.pinned_bytes = ring_bytes;
    stats.used_register = use_register;
    stats.used_direct_io = direct_fd >= 0;
    stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
  }

  Status RunBatch(const Reader::Impl& r, const std::vector<Resolved>& res,
                  const std::vector<Piece>& pieces, const Batch& batch, Slot& slot,
                  cudaStream_t stream, bool verify, int direct_fd, std::atomic<uint64_t>* copies) {
    if (slot.used) {
      cudaError_t err = cudaEventSynchronize(slot.event);
      if (err != cudaSuccess) return CudaStatus(err, r.path, "waiting for a staging slot");
    }
#ifdef FERRY_HAVE_CUDA_KERNELS
    if (batch.planes) {
      FERRY_RETURN_IF_ERROR(StagePlanes(r, res, pieces, batch, slot, stream));
      copies->fetch_add(1, std::memory_order_relaxed);
      cudaError_t err = cudaEventRecord(slot.event, stream);
      if (err != cudaSuccess) return CudaStatus(err, r.path, "cudaEventRecord");
      slot.used = true;
      return Status::Ok();
    }
#endif
    if (batch.direct) {
      const Piece& last = pieces[batch.last - 1];
      uint64_t need = res[last.r].info.data_offset + last.begin + last.len - batch.span_begin;
      FERRY_RETURN_IF_ERROR(
          DirectRead(direct_fd, r.path, slot.data, batch.span_begin, batch.span_len, need));
      for (uint32_t i = batch.first; verify && i < batch.last; ++i) {
        const Piece& p = pieces[i];
        FERRY_RETURN_IF_ERROR(
            r.VerifyRawRange(res[p.r].tensor, p.begin, p.len, slot.data + p.soff));
      }
    } else {
      for (uint32_t i = batch.first; i < batch.last; ++i) {
        const Piece& p = pieces[i];
        size_t tensor = res[p.r].tensor;
        if (direct_fd >= 0 && res[p.r].info.encoding != Encoding::kRaw) {
          FERRY_RETURN_IF_ERROR(
              FillEncodedDirect(r, direct_fd, tensor, p.begin, p.len, slot.data + p.soff, verify));
        } else {
          FERRY_RETURN_IF_ERROR(r.ReadRange(tensor, p.begin, p.len, slot.data + p.soff, verify,
                                            options.streaming_stores));
        }
      }
    }
    // One DMA per run of pieces whose staging and destination offsets advance together.
    uint32_t i = batch.first;
    while (i < batch.last) {
      const Piece& p = pieces[i];
      uint8_t* dst = res[p.r].dst + p.dst_off;
      uint64_t run_len = p.len;
      uint32_t j = i + 1;
      while (j < batch.last) {
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
            cudaMemcpyAsync(dst, slot.data + p.soff, run_len, cudaMemcpyHostToDevice, stream);
        if (err != cudaSuccess) return CudaStatus(err, r.Where(res[p.r].tensor), "cudaMemcpyAsync");
        copies->fetch_add(1, std::memory_order_relaxed);
      }
      i = j;
    }
    cudaError_t err = cudaEventRecord(slot.event, stream);
    if (err != cudaSuccess) return CudaStatus(err, r.path, "cudaEventRecord");
    slot.used = true;
    return Status::Ok();
  }

#ifdef FERRY_HAVE_CUDA_KERNELS
  // Copies the stored bytes of a batch of PLANES blocks into the slot (from the mapping: hot
  // or cold, the page cache serves them), checks their headers and tables here, then sends
  // them to the slot's device twin and expands them into their destinations on `stream`.
  Status StagePlanes(const Reader::Impl& r, const std::vector<Resolved>& res,
                     const std::vector<Piece>& pieces, const Batch& batch, Slot& slot,
                     cudaStream_t stream) {
    std::vector<PlanesStaged> blocks;
    blocks.reserve(batch.last - batch.first);
    uint64_t used = 0;
    for (uint32_t i = batch.first; i < batch.last; ++i) {
      const Piece& p = pieces[i];
      const Resolved& rr = res[p.r];
      const fb::Tensor* t = r.at(rr.tensor);
      const uint64_t b = p.begin / t->block_size();
      const fb::Chunk* ch = t->chunks()->Get(static_cast<flatbuffers::uoffset_t>(b));
      const uint64_t at = t->data_offset() + ch->offset();
      uint8_t* dst = slot.data + p.soff;
      if (!r.mapping->Guard([&] { std::memcpy(dst, r.base() + at, ch->stored_size()); })) {
        return r.Shrank(rr.tensor, at);
      }
      PlanesStaged s;
      Status st = planes::Parse(dst, ch->stored_size(), p.len, &s.layout);
      if (!st.ok()) {
        return Error(StatusCode::kDataLoss, r.Where(rr.tensor), ": block ", b, " at file offset ",
                     at, ": ", st.message());
      }
      s.soff = p.soff;
      s.dst = rr.dst + p.dst_off;
      s.error_index = i - planes_first;
      blocks.push_back(s);
      used = p.soff + ch->stored_size();
    }
    return planes_stage.Enqueue(static_cast<size_t>(&slot - slots.data()), slot.data, used, blocks,
                                planes_stage.device_errors(), stream, r.path);
  }
#endif

  Status AllocateDevice(const Reader::Impl& r, std::vector<Resolved>& res,
                        const std::vector<size_t>& order, std::vector<LoadedTensor>& out,
                        cudaStream_t stream, const DeviceAllocator* alloc, CUcontext ctx, int dev) {
    // Arena layout (default allocator only): small tensors packed in file order with 256-byte
    // alignment, which is also 64-byte staging alignment, so their copies coalesce.
    uint64_t arena_bytes = 0;
    std::vector<uint64_t> arena_off(res.size(), UINT64_MAX);
    if (alloc == nullptr) {
      for (size_t k : order) {
        if (res[k].dst == nullptr && res[k].len > 0 && res[k].len < kArenaTensorLimit) {
          arena_off[k] = arena_bytes;
          arena_bytes += AlignUp(res[k].len, kDeviceAlign);
        }
      }
    }
    auto free_async = [ctx, stream](void* p) {
      ScopedContext scope(ctx);
      cudaFreeAsync(p, stream);
    };
    std::shared_ptr<void> arena;
    if (arena_bytes > 0) {
      void* p = nullptr;
      cudaError_t err = cudaMallocAsync(&p, arena_bytes, stream);
      if (err != cudaSuccess) return CudaStatus(err, r.path, "cudaMallocAsync");
      arena = std::shared_ptr<void>(p, free_async);
    }
    for (size_t k = 0; k < res.size(); ++k) {
      Resolved& rr = res[k];
      LoadedTensor& t = out[k];
      t.info = rr.info;
      t.nbytes = rr.len;
      t.device = dev;
      rr.alloc_id = k + 2;
      if (rr.dst != nullptr || rr.len == 0) {
        t.data = rr.dst;
        continue;
      }
      if (arena_off[k] != UINT64_MAX) {
        rr.dst = static_cast<uint8_t*>(arena.get()) + arena_off[k];
        rr.alloc_id = 1;
        t.owner = std::shared_ptr<void>(arena, rr.dst);
      } else if (alloc != nullptr) {
        void* p = alloc->allocate(rr.len, reinterpret_cast<Stream>(stream));
        if (p == nullptr) {
          return Error(StatusCode::kResourceExhausted, r.Where(rr.tensor),
                       ": the allocator returned no memory for ", rr.len, " bytes");
        }
        auto dealloc = alloc->deallocate;
        uint64_t n = rr.len;
        t.owner = std::shared_ptr<void>(p, [dealloc, n, stream, ctx](void* q) {
          ScopedContext scope(ctx);
          if (dealloc) dealloc(q, n, reinterpret_cast<Stream>(stream));
        });
        rr.dst = static_cast<uint8_t*>(p);
      } else {
        void* p = nullptr;
        cudaError_t err = cudaMallocAsync(&p, rr.len, stream);
        if (err != cudaSuccess) return CudaStatus(err, r.Where(rr.tensor), "cudaMallocAsync");
        t.owner = std::shared_ptr<void>(p, free_async);
        rr.dst = static_cast<uint8_t*>(p);
      }
      t.data = rr.dst;
    }
    return Status::Ok();
  }
#endif  // FERRY_HAVE_CUDA

  Result<std::vector<LoadedTensor>> HostLoad(const Reader& reader,
                                             const std::vector<LoadRequest>& requests) {
    const Reader::Impl& r = reader.impl();
    auto t0 = std::chrono::steady_clock::now();
    std::vector<size_t> order;
    FERRY_ASSIGN_OR_RETURN(std::vector<Resolved> res, Resolve(r, requests, &order));
    std::vector<LoadedTensor> out(res.size());
    for (size_t k = 0; k < res.size(); ++k) {
      Resolved& rr = res[k];
      out[k].info = rr.info;
      out[k].nbytes = rr.len;
      out[k].device = -1;
      if (rr.dst == nullptr && rr.len > 0) {
        void* p = std::aligned_alloc(64, AlignUp(rr.len, 64));
        if (p == nullptr) {
          return Error(StatusCode::kResourceExhausted, r.Where(rr.tensor), ": allocating ", rr.len,
                       " bytes");
        }
        out[k].owner = std::shared_ptr<void>(p, std::free);
        rr.dst = static_cast<uint8_t*>(p);
      }
      out[k].data = rr.dst;
    }
    std::vector<Piece> pieces = MakePieces(res, order, options.chunk_bytes);
    DirectFile direct_file(r, res, options.io);
    const int fd = direct_file.fd();
    ErrorSlot error;
    std::atomic<uint64_t> next{0};
    const int active = explicit_threads ? pool->size() : ActiveWorkers(res, pool->size());
    pool->Run([&](int worker) {
      if (worker >= active) return;
      for (;;) {
        uint64_t k = next.fetch_add(1);
        if (k >= pieces.size() || error.failed()) return;
        const Piece& p = pieces[k];
        const Resolved& rr = res[p.r];
        uint8_t* dst = rr.dst + p.dst_off;
        Status st;
        if (fd < 0) {
          st = r.ReadRange(rr.tensor, p.begin, p.len, dst, options.verify);
        } else if (rr.info.encoding == Encoding::kRaw) {
          st = FillRawDirect(r, fd, rr, p, dst, options.verify);
        } else {
          st = FillEncodedDirect(r, fd, rr.tensor, p.begin, p.len, dst, options.verify);
        }
        if (!st.ok()) error.Set(std::move(st));
      }
    });
    if (error.failed()) return error.Get();
    stats = LoadStats{};
    stats.used_direct_io = fd >= 0;
    for (const Resolved& rr : res) stats.bytes += rr.len;
    stats.copies = pieces.size();
    stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
  if (options.chunk_bytes < 4096 || options.chunk_bytes % 4096 != 0) {
    return Error(StatusCode::kInvalidArgument, "LoaderOptions.chunk_bytes ", options.chunk_bytes,
                 " must be a positive multiple of 4096");
  }
  if (options.staging_bytes < 2 * options.chunk_bytes) {
    return Error(StatusCode::kInvalidArgument, "LoaderOptions.staging_bytes ",
                 options.staging_bytes, " must hold at least two chunks of ", options.chunk_bytes);
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
  impl->pool = std::make_unique<WorkerPool>(options.threads);
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
  impl_->stats.seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
#endif
  return out;
}

Result<std::vector<LoadedTensor>> Loader::LoadToHost(const Reader& reader,
                                                     const std::vector<LoadRequest>& requests) {
  std::lock_guard<std::mutex> lock(impl_->call_mu);
  return impl_->HostLoad(reader, requests);
}

LoadStats Loader::last_stats() const {
  std::lock_guard<std::mutex> lock(impl_->call_mu);
  return impl_->stats;
}

const LoaderOptions& Loader::options() const { return impl_->options; }

}  // namespace ferry
