// CUDA helpers shared by the loader and the distributed loader: status conversion, and driver
// context calls that keep every CUDA call on the caller's device.
#ifndef FERRY_SRC_CUDA_CUDA_UTIL_HPP_
#define FERRY_SRC_CUDA_CUDA_UTIL_HPP_

#ifdef FERRY_HAVE_CUDA

#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "ferry/status.hpp"

namespace ferry {

// CudaError naming `where` and the failed call.
Status CudaStatus(cudaError_t err, const std::string& where, const char* what);

#define FERRY_CUDA_RETURN(call, where)                                                   \
  do {                                                                                   \
    cudaError_t _ferry_err = (call);                                                     \
    if (_ferry_err != cudaSuccess) return ::ferry::CudaStatus(_ferry_err, where, #call); \
  } while (0)

// Driver context calls, fetched through the runtime so the library has no link-time
// dependency on libcuda (CI machines have no driver).
struct DriverApi {
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
  bool ok = false;
};
const DriverApi& Driver();

// Makes `ctx` current on this thread for a scope and restores whatever was current before
// (possibly nothing), so a deleter running on an arbitrary thread never lands on device 0.
class ScopedContext {
 public:
  explicit ScopedContext(CUcontext ctx);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  bool pushed_ = false;
};

}  // namespace ferry

#endif  // FERRY_HAVE_CUDA
#endif  // FERRY_SRC_CUDA_CUDA_UTIL_HPP_
