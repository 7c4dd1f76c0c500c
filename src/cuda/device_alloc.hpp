// Device memory the library allocates for loads: in stream order on the caller's stream, from
// the caller's allocator or cudaMallocAsync, owned by shared pointers that free it on that
// stream from whichever thread drops the last owner.
#ifndef FERRY_SRC_CUDA_DEVICE_ALLOC_HPP_
#define FERRY_SRC_CUDA_DEVICE_ALLOC_HPP_

#include <cstdint>
#include <memory>
#include <string>

#include "base/util.hpp"
#include "ferry/loader.hpp"

#ifdef FERRY_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime.h>
#endif

namespace ferry {

// 256 bytes: what cudaMalloc guarantees, and what device copies and kernels read best from.
// Device arenas, pinned staging pieces and the PLANES decoder's sources are cut at it.
inline constexpr uint64_t kDeviceAlign = 256;

// Several tensors in one allocation, each at a kDeviceAlign boundary in the order placed: one
// allocation for all measured 0.6 ms in a fresh process on an H200 host, one per tensor
// 20-25 ms for 180 tensors.
struct DeviceArena {
  uint64_t bytes = 0;
  // The offset of `len` more bytes.
  uint64_t Place(uint64_t len) {
    const uint64_t at = bytes;
    bytes += AlignUp(len, kDeviceAlign);
    return at;
  }
};

#ifdef FERRY_HAVE_CUDA
// `bytes` of memory of the current device (context `ctx`) in stream order on `stream`: from
// `alloc` when given, else cudaMallocAsync. The returned pointer owns it and frees it on
// `stream` (alloc->deallocate, or cudaFreeAsync) with `ctx` current. `where` names the memory
// in messages: ResourceExhausted when the allocator returns none, CudaError when CUDA fails.
Result<std::shared_ptr<void>> AllocateDeviceMemory(uint64_t bytes, cudaStream_t stream,
                                                   const DeviceAllocator* alloc, CUcontext ctx,
                                                   const std::string& where);
#endif

}  // namespace ferry

#endif  // FERRY_SRC_CUDA_DEVICE_ALLOC_HPP_
