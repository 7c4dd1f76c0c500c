// Device memory for loads (src/cuda/device_alloc.hpp).
#include "cuda/device_alloc.hpp"

#ifdef FERRY_HAVE_CUDA

#include "cuda/cuda_util.hpp"

namespace ferry {

Result<std::shared_ptr<void>> AllocateDeviceMemory(uint64_t bytes, cudaStream_t stream,
                                                   const DeviceAllocator* alloc, CUcontext ctx,
                                                   const std::string& where) {
  if (alloc != nullptr) {
    void* p = alloc->allocate(bytes, reinterpret_cast<Stream>(stream));
    if (p == nullptr) {
      return Error(StatusCode::kResourceExhausted, where, ": the allocator returned no memory for ",
                   bytes, " bytes");
    }
    auto dealloc = alloc->deallocate;
    return std::shared_ptr<void>(p, [dealloc, bytes, stream, ctx](void* q) {
      ScopedContext scope(ctx);
      if (dealloc) dealloc(q, bytes, reinterpret_cast<Stream>(stream));
    });
  }
  void* p = nullptr;
  cudaError_t err = cudaMallocAsync(&p, bytes, stream);
  if (err != cudaSuccess) return CudaStatus(err, where, "cudaMallocAsync");
  return std::shared_ptr<void>(p, [stream, ctx](void* q) {
    ScopedContext scope(ctx);
    cudaFreeAsync(q, stream);
  });
}

}  // namespace ferry

#endif  // FERRY_HAVE_CUDA
