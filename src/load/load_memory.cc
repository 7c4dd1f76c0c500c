// Destination memory of a load (src/load/load_memory.hpp).
#include "load/load_memory.hpp"

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "base/host_memory.hpp"
#include "base/util.hpp"
#include "cuda/cuda_util.hpp"
#include "cuda/device_alloc.hpp"

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
    uint64_t allocated = 0;
    void* p = AllocateBulk(arena_bytes, 64, &allocated);
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

constexpr uint64_t kNotInArena = UINT64_MAX;

// Arena layout (default allocator only): every tensor the loader allocates, packed in file
// order at kDeviceAlign (also 64-byte staging alignment, so copies of small tensors coalesce),
// in one cudaMallocAsync. Returns the arena's size; `offsets[k]` is request k's place in it,
// or kNotInArena.
uint64_t ArenaLayout(const LoadPlan& plan, std::vector<uint64_t>* offsets) {
  DeviceArena arena;
  offsets->assign(plan.res.size(), kNotInArena);
  for (size_t k : plan.order) {
    const Resolved& rr = plan.res[k];
    if (rr.dst == nullptr && rr.len > 0) (*offsets)[k] = arena.Place(rr.len);
  }
  return arena.bytes;
}

}  // namespace

Status AllocateDevice(const BlockSource& source, LoadPlan& plan, cudaStream_t stream,
                      const DeviceAllocator* alloc, CUcontext ctx, int device,
                      std::vector<LoadedTensor>* out) {
  std::vector<uint64_t> arena_off;
  const uint64_t arena_bytes = alloc == nullptr ? ArenaLayout(plan, &arena_off) : 0;
  std::shared_ptr<void> arena;
  if (arena_bytes > 0) {
    FERRY_ASSIGN_OR_RETURN(arena,
                           AllocateDeviceMemory(arena_bytes, stream, nullptr, ctx, source.path()));
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
      } else {
        FERRY_ASSIGN_OR_RETURN(
            t.owner, AllocateDeviceMemory(rr.len, stream, alloc, ctx, source.Where(rr.tensor)));
      }
      if (rr.alloc_id != 1) rr.dst = static_cast<uint8_t*>(t.owner.get());
    }
    t.data = rr.dst;
  }
  return Status::Ok();
}

#endif  // FERRY_HAVE_CUDA

}  // namespace ferry
