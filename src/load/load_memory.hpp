// Destination memory of a load: the caller's buffers, the caller's allocator, or the loader's
// own allocations (host: aligned_alloc; device: cudaMallocAsync on the load stream, with small
// tensors packed into one arena so their copies coalesce).
#ifndef FERRY_SRC_LOAD_LOAD_MEMORY_HPP_
#define FERRY_SRC_LOAD_LOAD_MEMORY_HPP_

#include <vector>

#include "ferry/loader.hpp"
#include "load/load_plan.hpp"

#ifdef FERRY_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime.h>
#endif

namespace ferry {

// Gives every request of `plan` a host destination (its own, or 64-byte aligned memory that
// the returned LoadedTensor owns) and describes it in `out` (one entry per request).
Status AllocateHost(const BlockSource& source, LoadPlan& plan, std::vector<LoadedTensor>* out);

#ifdef FERRY_HAVE_CUDA
// As AllocateHost, on device `device` in stream order on `stream`: through `alloc` when given,
// else cudaMallocAsync. Sets each request's alloc_id (requests sharing one allocation share
// it). Memory is freed on `stream` with context `ctx` current, from whichever thread drops the
// last owner. `arena_cuda_malloc`: the one allocation of a load without `alloc` from
// cudaMalloc instead (LoaderTuning::arena_cuda_malloc).
Status AllocateDevice(const BlockSource& source, LoadPlan& plan, cudaStream_t stream,
                      const DeviceAllocator* alloc, CUcontext ctx, int device,
                      std::vector<LoadedTensor>* out, bool arena_cuda_malloc = false);
#endif

}  // namespace ferry

#endif  // FERRY_SRC_LOAD_LOAD_MEMORY_HPP_
