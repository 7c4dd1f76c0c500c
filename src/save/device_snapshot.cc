// Device-to-host copies of a save (src/save/device_snapshot.hpp).
#include "save/device_snapshot.hpp"

#include "base/util.hpp"
#include "cuda/cuda_util.hpp"

#ifdef FERRY_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime.h>
#endif

namespace ferry {

#ifdef FERRY_HAVE_CUDA

namespace {
cudaEvent_t Ev(void* e) { return static_cast<cudaEvent_t>(e); }
cudaStream_t St(Stream s) { return reinterpret_cast<cudaStream_t>(s); }
}  // namespace

Status DeviceSnapshot::Bind(const std::string& where, const void* data, uint64_t nbytes) {
  int dev = -1;
  FERRY_CUDA_RETURN(cudaGetDevice(&dev), where);
  // The current device's context, made current on this thread if it has none (never
  // another device's).
  FERRY_CUDA_RETURN(cudaFree(nullptr), where);
  CUcontext cur = nullptr;
  if (Driver().ok) Driver().ctx_get_current(&cur);
  if (nbytes > 0) {
    cudaPointerAttributes attr{};
    cudaError_t err = cudaPointerGetAttributes(&attr, data);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return CudaStatus(err, where, "cudaPointerGetAttributes");
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
      return Error(StatusCode::kInvalidArgument, where,
                   ": the source is not device memory (use AddTensor for host memory)");
    }
    if (attr.type == cudaMemoryTypeDevice && attr.device != dev) {
      return Error(StatusCode::kInvalidArgument, where, ": the source is memory of device ",
                   attr.device, " but device ", dev, " is current; make device ", attr.device,
                   " current first");
    }
  }
  if (device_ < 0) {
    device_ = dev;
    ctx_ = cur;
    events_.set_context(cur);
  } else if (dev != device_ || cur != ctx_) {
    return Error(StatusCode::kInvalidArgument, where, ": device ", dev,
                 " is current, but this writer's device tensors are on device ", device_);
  }
  return Status::Ok();
}

Result<void*> DeviceSnapshot::Copy(void* dst, const void* src, uint64_t n, Stream stream,
                                   const std::string& where, uint64_t offset) {
  FERRY_ASSIGN_OR_RETURN(void* ev, events_.Take(path_));
  cudaError_t err = cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, St(stream));
  if (err == cudaSuccess) err = cudaEventRecord(Ev(ev), St(stream));
  if (err == cudaSuccess) return ev;
  // The event may be unrecorded; the copy, if enqueued, still needs waiting for.
  cudaStreamSynchronize(St(stream));
  Recycle(ev);
  return CudaStatus(err, StrCat(where, " at byte ", offset), "device-to-host copy");
}

Status DeviceSnapshot::RecordTail(Stream stream) {
  void* e = nullptr;
  for (auto& [s, ev] : tails_) {
    if (s == stream) e = ev;
  }
  if (e == nullptr) {
    FERRY_ASSIGN_OR_RETURN(e, events_.Take(path_));
    tails_.emplace_back(stream, e);
  }
  FERRY_CUDA_RETURN(cudaEventRecord(Ev(e), St(stream)), path_);
  return Status::Ok();
}

Status DeviceSnapshot::WaitAll() {
  for (auto& [s, e] : tails_) {
    cudaError_t err = cudaEventSynchronize(Ev(e));
    if (err != cudaSuccess) return CudaStatus(err, path_, "waiting for device-to-host copies");
  }
  return Status::Ok();
}

void DeviceSnapshot::BindWorker(void** bound) const {
  if (*bound == ctx_) return;
  if (Driver().ok && ctx_ != nullptr) Driver().ctx_set_current(static_cast<CUcontext>(ctx_));
  *bound = ctx_;
}

Status DeviceSnapshot::WaitCopy(void* event, std::string_view tensor) {
  cudaError_t err = cudaEventSynchronize(Ev(event));
  if (err != cudaSuccess) {
    return CudaStatus(err, StrCat(path_, ": tensor ", Quote(tensor)), "device-to-host copy");
  }
  return Status::Ok();
}

void DeviceSnapshot::Recycle(void* event) { events_.Give(event); }

#else  // !FERRY_HAVE_CUDA

Status DeviceSnapshot::Bind(const std::string& where, const void*, uint64_t) {
  return Error(StatusCode::kUnimplemented, where,
               ": this build of TensorFerry has no CUDA support (copy the tensor to the host "
               "and use AddTensor)");
}

Result<void*> DeviceSnapshot::Copy(void*, const void*, uint64_t, Stream, const std::string& where,
                                   uint64_t) {
  return Error(StatusCode::kUnimplemented, where, ": no CUDA support");
}

Status DeviceSnapshot::RecordTail(Stream) { return Status::Ok(); }
Status DeviceSnapshot::WaitAll() { return Status::Ok(); }
void DeviceSnapshot::BindWorker(void**) const {}
Status DeviceSnapshot::WaitCopy(void*, std::string_view) { return Status::Ok(); }
void DeviceSnapshot::Recycle(void*) {}

#endif  // FERRY_HAVE_CUDA

}  // namespace ferry
