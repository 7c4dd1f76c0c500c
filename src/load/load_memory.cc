// Destination memory of a load (src/load/load_memory.hpp).
#include "load/load_memory.hpp"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "base/util.hpp"
#include "cuda/cuda_util.hpp"

namespace ferry {

namespace {
// The description of request `rr` on `device` (-1: host), without memory yet.
LoadedTensor Describe(const Resolved& rr, int device) {
  LoadedTensor t;
  t.info = rr.info;
  t.nbytes = rr.len;
  t.device = device;
  t.data = rr.dst;
  return t;
}
}  // namespace

namespace {
constexpr uint64_t kHugePage = uint64_t{2} << 20;

// Host memory: 2 MiB aligned and advised for transparent huge pages when large, so a fresh
// process faults it in 2 MiB at a time (one-shot LoadToHost of 8 GiB on an H200 host: 9.1 GB/s
// into 4 KiB pages, 15-16 into huge pages).
void* AllocateHostBytes(uint64_t bytes) {
  if (bytes < kHugePage) return std::aligned_alloc(64, AlignUp(bytes, 64));
  const uint64_t n = AlignUp(bytes, kHugePage);
  void* p = std::aligned_alloc(kHugePage, n);
  if (p != nullptr) ::madvise(p, n, MADV_HUGEPAGE);
  return p;
}
}  // namespace

Status AllocateHost(const BlockSource& source, LoadPlan& plan, std::vector<LoadedTensor>* out) {
  out->resize(plan.res.size());
  // Every tensor the loader allocates shares one allocation, each at a 64-byte-aligned offset
  // in file order.
  uint64_t arena_bytes = 0;
  std::vector<uint64_t> arena_off(plan.res.size(), UINT64_MAX);
  for (size_t k : plan.order) {
    if (plan.res[k].dst == nullptr && plan.res[k].len > 0) {
      arena_off[k] = arena_bytes;
      arena_bytes += AlignUp(plan.res[k].len, 64);
    }
  }
  std::shared_ptr<void> arena;
  if (arena_bytes > 0) {
    void* p = AllocateHostBytes(arena_bytes);
    if (p == nullptr) {
      return Error(StatusCode::kResourceExhausted, source.path(), ": allocating ", arena_bytes,
                   " bytes for ", plan.res.size(), " tensors");
    }
    arena = std::shared_ptr<void>(p, std::free);
  }
  for (size_t k = 0; k < plan.res.size(); ++k) {
    Resolved& rr = plan.res[k];
    LoadedTensor& t = (*out)[k] = Describe(rr, -1);
    if (arena_off[k] != UINT64_MAX) {
      rr.dst = static_cast<uint8_t*>(arena.get()) + arena_off[k];
      t.owner = std::shared_ptr<void>(arena, rr.dst);
    }
    t.data = rr.dst;
  }
  return Status::Ok();
}

#ifdef FERRY_HAVE_CUDA

namespace {

constexpr uint64_t kDeviceAlign = 256;
constexpr uint64_t kNotInArena = UINT64_MAX;

// Arena layout (default allocator only): every tensor the loader allocates, packed in file
// order with 256-byte alignment (also 64-byte staging alignment, so copies of small tensors
// coalesce), in one cudaMallocAsync: one allocation per tensor measured 20-25 ms for 180
// tensors in a fresh process on an H200 host, one for all 0.6 ms. Returns the arena's size;
// `offsets[k]` is request k's place in it, or kNotInArena.
uint64_t ArenaLayout(const LoadPlan& plan, std::vector<uint64_t>* offsets) {
  uint64_t bytes = 0;
  offsets->assign(plan.res.size(), kNotInArena);
  for (size_t k : plan.order) {
    const Resolved& rr = plan.res[k];
    if (rr.dst == nullptr && rr.len > 0) {
      (*offsets)[k] = bytes;
      bytes += AlignUp(rr.len, kDeviceAlign);
    }
  }
  return bytes;
}

// Memory of `bytes` from the caller's allocator, owned by the returned pointer.
Result<std::shared_ptr<void>> FromAllocator(const BlockSource& source, const Resolved& rr,
                                            const DeviceAllocator& alloc, cudaStream_t stream,
                                            CUcontext ctx) {
  void* p = alloc.allocate(rr.len, reinterpret_cast<Stream>(stream));
  if (p == nullptr) {
    return Error(StatusCode::kResourceExhausted, source.Where(rr.tensor),
                 ": the allocator returned no memory for ", rr.len, " bytes");
  }
  auto dealloc = alloc.deallocate;
  uint64_t n = rr.len;
  return std::shared_ptr<void>(p, [dealloc, n, stream, ctx](void* q) {
    ScopedContext scope(ctx);
    if (dealloc) dealloc(q, n, reinterpret_cast<Stream>(stream));
  });
}

}  // namespace

Status AllocateDevice(const BlockSource& source, LoadPlan& plan, cudaStream_t stream,
                      const DeviceAllocator* alloc, CUcontext ctx, int device,
                      std::vector<LoadedTensor>* out) {
  std::vector<uint64_t> arena_off;
  const uint64_t arena_bytes = alloc == nullptr ? ArenaLayout(plan, &arena_off) : 0;
  auto free_async = [ctx, stream](void* p) {
    ScopedContext scope(ctx);
    cudaFreeAsync(p, stream);
  };
  auto malloc_async = [&](uint64_t bytes,
                          const std::string& where) -> Result<std::shared_ptr<void>> {
    void* p = nullptr;
    cudaError_t err = cudaMallocAsync(&p, bytes, stream);
    if (err != cudaSuccess) return CudaStatus(err, where, "cudaMallocAsync");
    return std::shared_ptr<void>(p, free_async);
  };
  std::shared_ptr<void> arena;
  if (arena_bytes > 0) {
    FERRY_ASSIGN_OR_RETURN(arena, malloc_async(arena_bytes, source.path()));
  }
  out->resize(plan.res.size());
  for (size_t k = 0; k < plan.res.size(); ++k) {
    Resolved& rr = plan.res[k];
    LoadedTensor& t = (*out)[k] = Describe(rr, device);
    rr.alloc_id = k + 2;
    if (rr.dst == nullptr && rr.len > 0) {
      if (alloc == nullptr && arena_off[k] != kNotInArena) {
        rr.dst = static_cast<uint8_t*>(arena.get()) + arena_off[k];
        rr.alloc_id = 1;
        t.owner = std::shared_ptr<void>(arena, rr.dst);
      } else if (alloc != nullptr) {
        FERRY_ASSIGN_OR_RETURN(t.owner, FromAllocator(source, rr, *alloc, stream, ctx));
      } else {
        FERRY_ASSIGN_OR_RETURN(t.owner, malloc_async(rr.len, source.Where(rr.tensor)));
      }
      if (rr.alloc_id != 1) rr.dst = static_cast<uint8_t*>(t.owner.get());
    }
    t.data = rr.dst;
  }
  return Status::Ok();
}

#endif  // FERRY_HAVE_CUDA

}  // namespace ferry
