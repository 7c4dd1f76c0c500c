// Distributed loading over the caller's NCCL communicator (include/ferry/distributed.hpp).
//
// Plan: the replicated requests, sorted into file order, form one byte sequence; SplitPlan cuts
// it into nranks * rounds segments on row boundaries. Every rank computes the same plan from
// the same index, so the broadcast calls (their count, sizes and roots) match across ranks
// without any exchange except the optional 16-byte plan check.
#include "ferry/distributed.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "base/util.hpp"
#include "cuda/cuda_util.hpp"
#include "cuda/device_alloc.hpp"
#include "dist/dist_plan.hpp"

#ifdef FERRY_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime.h>
#endif

namespace ferry {

std::vector<PlanPiece> SplitPlan(const std::vector<PlanItem>& items, int nranks, int rounds) {
  std::vector<PlanPiece> pieces;
  if (nranks < 1 || rounds < 1 || items.empty()) return pieces;
  const uint64_t segments = static_cast<uint64_t>(nranks) * static_cast<uint64_t>(rounds);
  uint64_t total = 0;
  for (const PlanItem& m : items) total += m.bytes;
  // cuts[j]: where segment j starts in the concatenation; cuts[segments] is the end.
  std::vector<uint64_t> cuts(segments + 1, 0);
  cuts[segments] = total;
  size_t it = 0;
  uint64_t start = 0;  // items[it] covers [start, start + items[it].bytes)
  for (uint64_t j = 1; j < segments; ++j) {
    auto target = static_cast<uint64_t>(static_cast<unsigned __int128>(total) * j / segments);
    while (it < items.size() && start + items[it].bytes <= target) start += items[it++].bytes;
    uint64_t cut = target;
    if (it < items.size()) {
      const PlanItem& m = items[it];
      uint64_t off = target - start;
      uint64_t snapped;
      if (m.row_bytes == 0 || m.row_bytes >= m.bytes) {
        snapped = off * 2 < m.bytes ? 0 : m.bytes;  // whole item to the nearer side
      } else {
        uint64_t rows = (off + m.row_bytes / 2) / m.row_bytes;
        snapped = std::min(rows * m.row_bytes, m.bytes);
      }
      cut = start + snapped;
    }
    cuts[j] = std::max(cut, cuts[j - 1]);
  }
  uint64_t pos = 0;
  uint32_t seg = 0;
  for (uint32_t i = 0; i < items.size(); ++i) {
    uint64_t b = pos, e = pos + items[i].bytes;
    while (b < e) {
      while (cuts[seg + 1] <= b) ++seg;
      uint64_t pe = std::min(e, cuts[seg + 1]);
      pieces.push_back(PlanPiece{i, seg, b - pos, pe - b});
      b = pe;
    }
    pos = e;
  }
  return pieces;
}

#ifdef FERRY_HAVE_CUDA
namespace {

// ---- NCCL, found at run time ------------------------------------------------------------
// Declarations of our own (values from nccl.h, stable across NCCL 2.x), so that neither the
// build nor the library's load needs NCCL: only DistributedLoader::Create does.
constexpr int kNcclSuccess = 0;
constexpr int kNcclInProgress = 7;
constexpr int kNcclUint8 = 1;
constexpr int kNcclUint64 = 5;
constexpr int kNcclMax = 2;

struct NcclApi {
  int (*get_version)(int*) = nullptr;
  int (*comm_count)(NcclComm, int*) = nullptr;
  int (*comm_user_rank)(NcclComm, int*) = nullptr;
  int (*comm_cu_device)(NcclComm, int*) = nullptr;
  int (*group_start)() = nullptr;
  int (*group_end)() = nullptr;
  int (*broadcast)(const void*, void*, size_t, int, int, NcclComm, cudaStream_t) = nullptr;
  int (*all_reduce)(const void*, void*, size_t, int, int, NcclComm, cudaStream_t) = nullptr;
  const char* (*error_string)(int) = nullptr;
  int (*async_error)(NcclComm, int*) = nullptr;
  const char* (*last_error)(NcclComm) = nullptr;  // NCCL 2.13+, optional
  int version = 0;
};

template <typename Fn>
bool Bind(void* handle, const char* name, Fn* fn) {
  *fn = reinterpret_cast<Fn>(dlsym(handle, name));
  return *fn != nullptr;
}

// The communicator was made by some NCCL in this process, and only that NCCL may be handed it.
// So: a library the caller names; else NCCL symbols already global in the process (linked in);
// else a libnccl.so.2 that is already loaded (RTLD_NOLOAD finds one loaded with RTLD_LOCAL, as
// Python extensions do); else load libnccl.so.2. Handles are never closed (NCCL keeps threads).
Result<const NcclApi*> LoadNccl(const std::string& library) {
  static std::mutex mu;
  static std::map<std::string, NcclApi>* cache = new std::map<std::string, NcclApi>();
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache->find(library); it != cache->end()) return &it->second;
  void* handle = nullptr;
  // RTLD_DEFAULT is a null pointer in glibc, so "found" is tracked on its own.
  bool found = false;
  std::string tried;
  if (!library.empty()) {
    handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    found = handle != nullptr;
    tried = library;
  } else if (dlsym(RTLD_DEFAULT, "ncclCommCount") != nullptr) {
    handle = RTLD_DEFAULT;
    found = true;
  } else {
    handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    if (handle == nullptr) handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    found = handle != nullptr;
    tried = "libnccl.so.2";
  }
  if (!found) {
    const char* why = dlerror();
    return Error(StatusCode::kUnimplemented, "distributed loading needs NCCL: dlopen(", tried,
                 ") failed: ", why ? why : "unknown error");
  }
  NcclApi api;
  bool ok = Bind(handle, "ncclGetVersion", &api.get_version) &&
            Bind(handle, "ncclCommCount", &api.comm_count) &&
            Bind(handle, "ncclCommUserRank", &api.comm_user_rank) &&
            Bind(handle, "ncclCommCuDevice", &api.comm_cu_device) &&
            Bind(handle, "ncclGroupStart", &api.group_start) &&
            Bind(handle, "ncclGroupEnd", &api.group_end) &&
            Bind(handle, "ncclBroadcast", &api.broadcast) &&
            Bind(handle, "ncclAllReduce", &api.all_reduce) &&
            Bind(handle, "ncclGetErrorString", &api.error_string) &&
            Bind(handle, "ncclCommGetAsyncError", &api.async_error);
  if (!ok) {
    return Error(StatusCode::kUnimplemented, "distributed loading: the NCCL library (",
                 tried.empty() ? "linked into the process" : tried,
                 ") lacks a required function (NCCL 2.4 or newer is needed)");
  }
  Bind(handle, "ncclGetLastError", &api.last_error);
  api.get_version(&api.version);
  return &cache->emplace(library, api).first->second;
}

// A non-blocking communicator answers ncclInProgress; its result arrives through the async
// error query.
int SettleNccl(const NcclApi& api, NcclComm comm, int rc) {
  while (rc == kNcclInProgress) {
    int state = kNcclSuccess;
    if (api.async_error(comm, &state) != kNcclSuccess) break;
    rc = state;
    if (rc == kNcclInProgress) std::this_thread::yield();
  }
  return rc;
}

Status NcclStatus(const NcclApi& api, NcclComm comm, int rc, const char* what) {
  rc = SettleNccl(api, comm, rc);
  if (rc == kNcclSuccess) return Status::Ok();
  const char* last = api.last_error ? api.last_error(comm) : nullptr;
  return Error(StatusCode::kCudaError, "NCCL ", what, " failed: ", api.error_string(rc),
               last && *last ? StrCat(" (", last, ")") : std::string());
}

// NCCL for `comm`, whose device must be the caller's current one (the collectives would
// otherwise run on another GPU than the caller's buffers); `who` names the caller in messages.
Result<const NcclApi*> NcclOnCurrentDevice(NcclComm comm, const std::string& library,
                                           const char* who) {
  if (comm == nullptr) return Error(StatusCode::kInvalidArgument, who, ": null communicator");
  FERRY_ASSIGN_OR_RETURN(const NcclApi* nccl, LoadNccl(library));
  int comm_dev = -1, dev = -1;
  FERRY_CUDA_RETURN(cudaGetDevice(&dev), who);
  FERRY_RETURN_IF_ERROR(
      NcclStatus(*nccl, comm, nccl->comm_cu_device(comm, &comm_dev), "comm device"));
  if (comm_dev != dev) {
    return Error(StatusCode::kInvalidArgument, who, ": the communicator's device is ", comm_dev,
                 " but device ", dev, " is current; make device ", comm_dev, " current first");
  }
  return nccl;
}

// NCCL takes size_t counts, but large single operations have had limits in some versions;
// pieces of 1 GiB cost nothing measurable.
constexpr uint64_t kMaxBroadcastBytes = uint64_t{1} << 30;
// Bounds the work NCCL fuses into one group launch.
constexpr size_t kMaxGroupOps = 256;

// The plan check's and Load's all-reduces, through the loader's device scratch (2 words each).
// A template here rather than a member, so that the lambda stays out of the exported symbols.
template <typename Impl>
AllReduceMaxFn ReducerOf(Impl* impl, const std::string& where) {
  return [impl, where](uint64_t* words, size_t) { return impl->AllReduceMax(words, where); };
}

// One broadcast: `bytes` at `ptr` from `root`.
struct Op {
  uint8_t* ptr;
  uint64_t bytes;
  int root;
};

}  // namespace

class DistributedLoader::Impl {
 public:
  NcclComm comm = nullptr;
  const NcclApi* nccl = nullptr;
  DistributedOptions options;
  int rank = 0, nranks = 1, device = -1;
  CUcontext ctx = nullptr;
  std::unique_ptr<Loader> loader;
  cudaStream_t side = nullptr;  // broadcasts and the small all-reduces
  cudaEvent_t loaded = nullptr, done = nullptr;
  uint64_t* scratch = nullptr;  // 4 words of device memory for the all-reduces
  std::mutex mu;
  DistributedStats stats;

  ~Impl() {
    ScopedContext scope(ctx);
    if (side != nullptr) {
      if (scratch != nullptr) cudaFreeAsync(scratch, side);
      cudaStreamSynchronize(side);
      cudaStreamDestroy(side);
    }
    if (loaded != nullptr) cudaEventDestroy(loaded);
    if (done != nullptr) cudaEventDestroy(done);
  }

  Status CheckDevice(const std::string& where) const {
    int dev = -1;
    FERRY_CUDA_RETURN(cudaGetDevice(&dev), where);
    if (dev != device) {
      return Error(StatusCode::kInvalidArgument, where, ": the communicator's device is ", device,
                   " but device ", dev, " is current; make device ", device, " current first");
    }
    return Status::Ok();
  }

  // Max over ranks of `words` (2 of them), through the device scratch; waits for the result
  // (on the internal stream only).
  Status AllReduceMax(uint64_t* words, const std::string& where) {
    // Pageable host memory: the copies stage through the driver, and the copy back returns
    // only when the all-reduce is done.
    FERRY_CUDA_RETURN(cudaMemcpyAsync(scratch, words, 16, cudaMemcpyHostToDevice, side), where);
    FERRY_RETURN_IF_ERROR(NcclStatus(
        *nccl, comm, nccl->all_reduce(scratch, scratch + 2, 2, kNcclUint64, kNcclMax, comm, side),
        "all-reduce"));
    FERRY_CUDA_RETURN(cudaMemcpyAsync(words, scratch + 2, 16, cudaMemcpyDeviceToHost, side), where);
    FERRY_CUDA_RETURN(cudaStreamSynchronize(side), where);
    return Status::Ok();
  }

  struct Outcome {
    Result<std::vector<LoadedTensor>> result;
    bool collective = false;  // every rank reached the enqueue phase (Load may agree on status)
  };

  Outcome Run(const PlanSource& src, const std::vector<DistributedRequest>& requests, Stream stream,
              const DeviceAllocator* alloc) {
    auto t0 = std::chrono::steady_clock::now();
    cudaStream_t cstream = reinterpret_cast<cudaStream_t>(stream);
    if (Status st = CheckDevice(src.path); !st.ok()) return {st, false};
    if (alloc != nullptr && !alloc->allocate) {
      return {Error(StatusCode::kInvalidArgument, src.path, ": allocator without allocate"), false};
    }
    stats = DistributedStats{};
    stats.rank = rank;
    stats.nranks = nranks;

    // ---- plan (local failures are reported to the other ranks by the plan check) ----------
    std::vector<PlanEntry> items;
    std::vector<size_t> locals;
    Status plan_status = ResolvePlan(src, requests, &items, &locals);
    uint64_t arena_bytes = 0;
    std::shared_ptr<void> arena;
    if (plan_status.ok()) {
      arena_bytes = LayOutArena(&items, UINT64_MAX);  // one allocation for the call
      if (arena_bytes > 0) {
        auto allocated = AllocateDeviceMemory(arena_bytes, cstream, alloc, ctx, src.path);
        if (allocated.ok()) {
          arena = *allocated;
        } else {
          plan_status = allocated.status();
        }
      }
    }
    if (options.check_plan) {
      const uint64_t h = plan_status.ok() ? PlanHash(items, nranks, options.rounds) : 0;
      Status st = AgreeOnPlan(plan_status, h, ReducerOf(this, src.path), src.path, rank);
      if (!st.ok()) return {st, false};
    } else if (!plan_status.ok()) {
      return {plan_status, false};
    }

    // ---- destinations and broadcasts -------------------------------------------------------
    const int rounds = options.rounds;
    std::vector<PlanPiece> pieces = SplitEntries(items, nranks, rounds);
    auto dst_of = [&](const PlanEntry& m) {
      return m.caller_dst != nullptr ? m.caller_dst
                                     : static_cast<uint8_t*>(arena.get()) + m.arena_off;
    };
    std::vector<std::vector<Op>> ops;
    for (const std::vector<PlanBroadcast>& seg : PlanBroadcasts(items, pieces, nranks, rounds)) {
      ops.emplace_back();
      for (const PlanBroadcast& b : seg) {
        ops.back().push_back(Op{dst_of(items[b.item]) + b.begin, b.bytes, b.root});
      }
    }
    for (const PlanPiece& p : pieces) {
      (static_cast<int>(p.segment / rounds) == rank ? stats.bytes_read : stats.bytes_received) +=
          p.len;
    }
    const std::vector<std::vector<const PlanPiece*>> mine = PiecesOf(pieces, rank, rounds);

    // ---- enqueue: read round k on `stream`, broadcast it on `side` -------------------------
    Status failure;  // first local failure; collectives still go out so no rank hangs
    for (int k = 0; k < rounds; ++k) {
      if (failure.ok()) failure = ReadPieces(src, items, mine[k], dst_of, cstream);
      cudaError_t err = cudaEventRecord(loaded, cstream);
      if (err == cudaSuccess) err = cudaStreamWaitEvent(side, loaded, 0);
      if (err != cudaSuccess) {
        // Without the dependency the broadcasts could send unread bytes: stop here.
        return {CudaStatus(err, src.path, "ordering broadcasts after reads"), false};
      }
      std::vector<Op> round_ops;
      for (int r = 0; r < nranks; ++r) {
        const std::vector<Op>& seg_ops = ops[static_cast<size_t>(r) * rounds + k];
        round_ops.insert(round_ops.end(), seg_ops.begin(), seg_ops.end());
      }
      if (Status st = Broadcast(round_ops); !st.ok()) return {st, false};
    }
    std::vector<LoadedTensor> out(requests.empty() ? items.size() : requests.size());
    if (failure.ok() && !locals.empty())
      failure = ReadLocals(src, requests, locals, cstream, alloc, &out);
    cudaError_t err = cudaEventRecord(done, side);
    if (err == cudaSuccess) err = cudaStreamWaitEvent(cstream, done, 0);
    if (err != cudaSuccess)
      return {CudaStatus(err, src.path, "joining the broadcast stream"), true};
    if (!failure.ok()) return {failure, true};

    for (const PlanEntry& m : items) {
      LoadedTensor& t = out[m.request];
      t.info = m.info;
      t.nbytes = m.len;
      t.device = device;
      if (m.len == 0) continue;
      t.data = dst_of(m);
      if (m.caller_dst == nullptr) t.owner = std::shared_ptr<void>(arena, t.data);
    }
    stats.bytes = stats.bytes_read + stats.bytes_received;
    stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return {std::move(out), true};
  }

  template <typename DstOf>
  Status ReadPieces(const PlanSource& src, const std::vector<PlanEntry>& items,
                    const std::vector<const PlanPiece*>& pieces, const DstOf& dst_of,
                    cudaStream_t stream) {
    std::vector<std::vector<LoadRequest>> per_shard(src.shards.size());
    for (const PlanPiece* p : pieces) {
      const PlanEntry& m = items[p->item];
      LoadRequest q;
      q.name = m.info.name;
      std::tie(q.row_begin, q.row_end) = PieceRows(m, *p);
      q.dst = dst_of(m) + p->begin;
      q.dst_bytes = p->len;
      per_shard[m.shard].push_back(std::move(q));
    }
    for (size_t s = 0; s < per_shard.size(); ++s) {
      if (per_shard[s].empty()) continue;
      FERRY_RETURN_IF_ERROR(
          loader->LoadAsync(*src.shards[s], per_shard[s], Stream(stream)).status());
      stats.used_direct_io = stats.used_direct_io || loader->last_stats().used_direct_io;
    }
    return Status::Ok();
  }

  Status ReadLocals(const PlanSource& src, const std::vector<DistributedRequest>& requests,
                    const std::vector<size_t>& locals, cudaStream_t stream,
                    const DeviceAllocator* alloc, std::vector<LoadedTensor>* out) {
    // Grouped by shard, one Loader call each; results go back to their request slots.
    std::map<uint32_t, std::pair<std::vector<LoadRequest>, std::vector<size_t>>> by_shard;
    for (size_t k : locals) {
      const DistributedRequest& q = requests[k];
      FERRY_ASSIGN_OR_RETURN(auto where, src.find(q.name));
      auto& [reqs, slots] = by_shard[where.first];
      reqs.push_back(LoadRequest{q.name, q.row_begin, q.row_end, q.dst, q.dst_bytes});
      slots.push_back(k);
    }
    for (auto& [shard, entry] : by_shard) {
      FERRY_ASSIGN_OR_RETURN(auto loaded_tensors, loader->LoadAsync(*src.shards[shard], entry.first,
                                                                    Stream(stream), alloc));
      stats.used_direct_io = stats.used_direct_io || loader->last_stats().used_direct_io;
      for (size_t j = 0; j < loaded_tensors.size(); ++j) {
        stats.bytes_read += loaded_tensors[j].nbytes;
        (*out)[entry.second[j]] = std::move(loaded_tensors[j]);
      }
    }
    return Status::Ok();
  }

  Status Broadcast(const std::vector<Op>& round_ops) {
    size_t in_group = 0;
    bool open = false;
    auto close = [&]() -> Status {
      if (!open) return Status::Ok();
      open = false;
      in_group = 0;
      return NcclStatus(*nccl, comm, nccl->group_end(), "group end (broadcasts)");
    };
    for (const Op& op : round_ops) {
      for (uint64_t off = 0; off < op.bytes; off += kMaxBroadcastBytes) {
        if (!open) {
          FERRY_RETURN_IF_ERROR(NcclStatus(*nccl, comm, nccl->group_start(), "group start"));
          open = true;
        }
        uint64_t n = std::min(kMaxBroadcastBytes, op.bytes - off);
        int rc = nccl->broadcast(op.ptr + off, op.ptr + off, n, kNcclUint8, op.root, comm, side);
        if (rc != kNcclSuccess && rc != kNcclInProgress) {
          Status st = NcclStatus(*nccl, comm, rc, "broadcast");
          (void)close();
          return st;
        }
        ++stats.broadcasts;
        if (++in_group == kMaxGroupOps) FERRY_RETURN_IF_ERROR(close());
      }
    }
    return close();
  }

  // Load's epilogue: every rank learns whether any rank failed.
  Status Agree(Status mine, const std::string& where) {
    return AgreeOnOutcome(mine, ReducerOf(this, where), where, rank);
  }
};

DistributedLoader::DistributedLoader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DistributedLoader::~DistributedLoader() = default;

Result<std::unique_ptr<DistributedLoader>> DistributedLoader::Create(NcclComm comm,
                                                                     DistributedOptions options) {
  if (comm == nullptr)
    return Error(StatusCode::kInvalidArgument, "DistributedLoader: null communicator");
  if (options.rounds < 1 || options.rounds > 64) {
    return Error(StatusCode::kInvalidArgument, "DistributedOptions.rounds ", options.rounds,
                 " outside [1, 64]");
  }
  FERRY_ASSIGN_OR_RETURN(const NcclApi* nccl,
                         NcclOnCurrentDevice(comm, options.nccl_library, "DistributedLoader"));
  auto impl = std::make_unique<Impl>();
  impl->comm = comm;
  impl->nccl = nccl;
  FERRY_RETURN_IF_ERROR(
      NcclStatus(*nccl, comm, nccl->comm_count(comm, &impl->nranks), "comm count"));
  FERRY_RETURN_IF_ERROR(
      NcclStatus(*nccl, comm, nccl->comm_user_rank(comm, &impl->rank), "comm rank"));
  FERRY_CUDA_RETURN(cudaGetDevice(&impl->device), "DistributedLoader");
  // The current device's context, made current on this thread if it is not yet (never another).
  FERRY_CUDA_RETURN(cudaFree(nullptr), "DistributedLoader");
  if (Driver().ok) Driver().ctx_get_current(&impl->ctx);
  FERRY_ASSIGN_OR_RETURN(impl->loader, Loader::Create(options.loader));
  impl->options = std::move(options);
  FERRY_CUDA_RETURN(cudaStreamCreateWithFlags(&impl->side, cudaStreamNonBlocking),
                    "DistributedLoader");
  FERRY_CUDA_RETURN(cudaEventCreateWithFlags(&impl->loaded, cudaEventDisableTiming),
                    "DistributedLoader");
  FERRY_CUDA_RETURN(cudaEventCreateWithFlags(&impl->done, cudaEventDisableTiming),
                    "DistributedLoader");
  void* scratch = nullptr;
  FERRY_CUDA_RETURN(cudaMallocAsync(&scratch, 4 * sizeof(uint64_t), impl->side),
                    "DistributedLoader");
  impl->scratch = static_cast<uint64_t*>(scratch);
  return std::unique_ptr<DistributedLoader>(new DistributedLoader(std::move(impl)));
}

namespace {

Result<std::vector<LoadedTensor>> RunAsync(DistributedLoader::Impl& impl, const PlanSource& src,
                                           const std::vector<DistributedRequest>& requests,
                                           Stream stream, const DeviceAllocator* alloc) {
  std::lock_guard<std::mutex> lock(impl.mu);
  return impl.Run(src, requests, stream, alloc).result;
}

Result<std::vector<LoadedTensor>> RunSync(DistributedLoader::Impl& impl, const PlanSource& src,
                                          const std::vector<DistributedRequest>& requests,
                                          Stream stream, const DeviceAllocator* alloc) {
  std::lock_guard<std::mutex> lock(impl.mu);
  auto t0 = std::chrono::steady_clock::now();
  auto outcome = impl.Run(src, requests, stream, alloc);
  if (!outcome.collective) return std::move(outcome.result);
  FERRY_RETURN_IF_ERROR(impl.Agree(outcome.result.status(), src.path));
  cudaError_t err = cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) return CudaStatus(err, src.path, "cudaStreamSynchronize");
  impl.stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return std::move(outcome.result);
}

}  // namespace

Result<std::vector<LoadedTensor>> DistributedLoader::LoadAsync(
    const Reader& reader, const std::vector<DistributedRequest>& requests, Stream stream,
    const DeviceAllocator* allocator) {
  return RunAsync(*impl_, SourceOf(reader), requests, stream, allocator);
}

Result<std::vector<LoadedTensor>> DistributedLoader::LoadAsync(
    const ShardedCheckpoint& checkpoint, const std::vector<DistributedRequest>& requests,
    Stream stream, const DeviceAllocator* allocator) {
  return RunAsync(*impl_, SourceOf(checkpoint), requests, stream, allocator);
}

Result<std::vector<LoadedTensor>> DistributedLoader::Load(
    const Reader& reader, const std::vector<DistributedRequest>& requests, Stream stream,
    const DeviceAllocator* allocator) {
  return RunSync(*impl_, SourceOf(reader), requests, stream, allocator);
}

Result<std::vector<LoadedTensor>> DistributedLoader::Load(
    const ShardedCheckpoint& checkpoint, const std::vector<DistributedRequest>& requests,
    Stream stream, const DeviceAllocator* allocator) {
  return RunSync(*impl_, SourceOf(checkpoint), requests, stream, allocator);
}

int DistributedLoader::rank() const { return impl_->rank; }
int DistributedLoader::nranks() const { return impl_->nranks; }
int DistributedLoader::device() const { return impl_->device; }
DistributedStats DistributedLoader::last_stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

namespace {

// What NcclSaveGroup's all-reduce needs, alive as long as any copy of the group.
struct NcclReducer {
  NcclComm comm = nullptr;
  const NcclApi* nccl = nullptr;
  CUcontext ctx = nullptr;
  cudaStream_t stream = nullptr;
  uint64_t* scratch = nullptr;  // kWords in, kWords out
  static constexpr size_t kWords = 16;
  std::mutex mu;

  ~NcclReducer() {
    ScopedContext scope(ctx);
    if (scratch != nullptr) cudaFree(scratch);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  Status AllReduceMax(uint64_t* words, size_t count) {
    std::lock_guard<std::mutex> lock(mu);
    ScopedContext scope(ctx);
    for (size_t at = 0; at < count; at += kWords) {
      const size_t n = std::min(kWords, count - at);
      FERRY_CUDA_RETURN(cudaMemcpyAsync(scratch, words + at, n * 8, cudaMemcpyHostToDevice, stream),
                        "save group");
      FERRY_RETURN_IF_ERROR(NcclStatus(
          *nccl, comm,
          nccl->all_reduce(scratch, scratch + kWords, n, kNcclUint64, kNcclMax, comm, stream),
          "all-reduce"));
      FERRY_CUDA_RETURN(
          cudaMemcpyAsync(words + at, scratch + kWords, n * 8, cudaMemcpyDeviceToHost, stream),
          "save group");
      FERRY_CUDA_RETURN(cudaStreamSynchronize(stream), "save group");
    }
    return Status::Ok();
  }
};

}  // namespace

Result<SaveGroup> NcclSaveGroup(NcclComm comm, const std::string& nccl_library) {
  FERRY_ASSIGN_OR_RETURN(const NcclApi* nccl,
                         NcclOnCurrentDevice(comm, nccl_library, "NcclSaveGroup"));
  auto r = std::make_shared<NcclReducer>();
  r->comm = comm;
  r->nccl = nccl;
  SaveGroup g;
  FERRY_RETURN_IF_ERROR(NcclStatus(*nccl, comm, nccl->comm_count(comm, &g.nranks), "comm count"));
  FERRY_RETURN_IF_ERROR(NcclStatus(*nccl, comm, nccl->comm_user_rank(comm, &g.rank), "comm rank"));
  FERRY_CUDA_RETURN(cudaFree(nullptr), "NcclSaveGroup");
  if (Driver().ok) Driver().ctx_get_current(&r->ctx);
  FERRY_CUDA_RETURN(cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking), "NcclSaveGroup");
  void* scratch = nullptr;
  FERRY_CUDA_RETURN(cudaMalloc(&scratch, 2 * NcclReducer::kWords * sizeof(uint64_t)),
                    "NcclSaveGroup");
  r->scratch = static_cast<uint64_t*>(scratch);
  g.all_reduce_max = [r](uint64_t* words, size_t count) { return r->AllReduceMax(words, count); };
  return g;
}

#else  // !FERRY_HAVE_CUDA

Result<SaveGroup> NcclSaveGroup(NcclComm, const std::string&) {
  return Error(StatusCode::kUnimplemented,
               "this build of TensorFerry has no CUDA support, so no NCCL save group");
}

class DistributedLoader::Impl {};

DistributedLoader::DistributedLoader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DistributedLoader::~DistributedLoader() = default;

Result<std::unique_ptr<DistributedLoader>> DistributedLoader::Create(NcclComm, DistributedOptions) {
  return Error(StatusCode::kUnimplemented,
               "this build of TensorFerry has no CUDA support, so no distributed loading");
}

// No DistributedLoader exists in this build; these only satisfy the linker.
Result<std::vector<LoadedTensor>> DistributedLoader::LoadAsync(
    const Reader&, const std::vector<DistributedRequest>&, Stream, const DeviceAllocator*) {
  return Error(StatusCode::kUnimplemented, "no CUDA support");
}
Result<std::vector<LoadedTensor>> DistributedLoader::LoadAsync(
    const ShardedCheckpoint&, const std::vector<DistributedRequest>&, Stream,
    const DeviceAllocator*) {
  return Error(StatusCode::kUnimplemented, "no CUDA support");
}
Result<std::vector<LoadedTensor>> DistributedLoader::Load(const Reader&,
                                                          const std::vector<DistributedRequest>&,
                                                          Stream, const DeviceAllocator*) {
  return Error(StatusCode::kUnimplemented, "no CUDA support");
}
Result<std::vector<LoadedTensor>> DistributedLoader::Load(const ShardedCheckpoint&,
                                                          const std::vector<DistributedRequest>&,
                                                          Stream, const DeviceAllocator*) {
  return Error(StatusCode::kUnimplemented, "no CUDA support");
}
int DistributedLoader::rank() const { return 0; }
int DistributedLoader::nranks() const { return 1; }
int DistributedLoader::device() const { return -1; }
DistributedStats DistributedLoader::last_stats() const { return {}; }

#endif  // FERRY_HAVE_CUDA

}  // namespace ferry
