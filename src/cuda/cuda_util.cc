#include "cuda/cuda_util.hpp"

#ifdef FERRY_HAVE_CUDA

#include "base/util.hpp"

namespace ferry {

Status CudaStatus(cudaError_t err, const std::string& where, const char* what) {
  return Error(StatusCode::kCudaError, where, ": ", what, " failed: ", cudaGetErrorName(err), " (",
               cudaGetErrorString(err), ")");
}

const DriverApi& Driver() {
  static const DriverApi api = [] {
    DriverApi a;
    cudaDriverEntryPointQueryResult q;
    auto get = [&](const char* name, void** fn) {
      return cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q) ==
                 cudaSuccess &&
             q == cudaDriverEntryPointSuccess;
    };
    a.ok = get("cuCtxGetCurrent", reinterpret_cast<void**>(&a.ctx_get_current)) &&
           get("cuCtxSetCurrent", reinterpret_cast<void**>(&a.ctx_set_current)) &&
           get("cuCtxPushCurrent", reinterpret_cast<void**>(&a.ctx_push)) &&
           get("cuCtxPopCurrent", reinterpret_cast<void**>(&a.ctx_pop));
    return a;
  }();
  return api;
}

ScopedContext::ScopedContext(CUcontext ctx) {
  const DriverApi& d = Driver();
  if (d.ok && ctx != nullptr && d.ctx_push(ctx) == CUDA_SUCCESS) pushed_ = true;
}

ScopedContext::~ScopedContext() {
  if (pushed_) {
    CUcontext ignored;
    Driver().ctx_pop(&ignored);
  }
}

}  // namespace ferry

#endif  // FERRY_HAVE_CUDA
