#include "load/planes_stage.hpp"

#ifdef FERRY_HAVE_CUDA_KERNELS

#include <algorithm>

#include "base/util.hpp"
#include "cuda/cuda_util.hpp"

namespace ferry {

PlanesStage::~PlanesStage() { Release(); }

void PlanesStage::Release() {
  if (ctx_ == nullptr && slots_ == nullptr) return;
  // Frees run in the context the resources belong to, whatever thread drops the loader.
  ScopedContext scope(ctx_);
  if (copy_ != nullptr) cudaStreamSynchronize(copy_);
  for (cudaEvent_t e : copied_) cudaEventDestroy(e);
  copied_.clear();
  if (fetched_ != nullptr) cudaEventDestroy(fetched_);
  fetched_ = nullptr;
  if (copy_ != nullptr) cudaStreamDestroy(copy_);
  copy_ = nullptr;
  if (slots_ != nullptr) cudaFree(slots_);
  slots_ = nullptr;
  if (errors_ != nullptr) cudaFree(errors_);
  errors_ = nullptr;
  if (host_errors_ != nullptr) cudaFreeHost(host_errors_);
  host_errors_ = nullptr;
  errors_cap_ = 0;
  nslots_ = slot_bytes_ = 0;
  ctx_ = nullptr;
}

Status PlanesStage::Prepare(CUcontext ctx, size_t nslots, size_t slot_bytes,
                            const std::string& where) {
  if (ctx == ctx_ && slots_ != nullptr && nslots == nslots_ && slot_bytes == slot_bytes_) {
    return Status::Ok();
  }
  Release();
  ctx_ = ctx;
  void* p = nullptr;
  FERRY_CUDA_RETURN(cudaMalloc(&p, nslots * slot_bytes), where);
  slots_ = static_cast<uint8_t*>(p);
  nslots_ = nslots;
  slot_bytes_ = slot_bytes;
  FERRY_CUDA_RETURN(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking), where);
  copied_.assign(nslots, nullptr);
  for (cudaEvent_t& e : copied_) {
    FERRY_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), where);
  }
  FERRY_CUDA_RETURN(cudaEventCreateWithFlags(&fetched_, cudaEventDisableTiming), where);
  return Status::Ok();
}

Status PlanesStage::StartLoad(size_t n, cudaStream_t stream, const std::string& where) {
  if (n > errors_cap_) {
    if (errors_ != nullptr) {
      // The previous load's copies and decodes are done: its errors were fetched after a sync.
      cudaFree(errors_);
      cudaFreeHost(host_errors_);
      errors_ = nullptr;
      host_errors_ = nullptr;
    }
    size_t cap = std::max<size_t>(n, 1024);
    void* p = nullptr;
    FERRY_CUDA_RETURN(cudaMalloc(&p, cap * sizeof(uint32_t)), where);
    errors_ = static_cast<uint32_t*>(p);
    FERRY_CUDA_RETURN(cudaHostAlloc(&p, cap * sizeof(uint32_t), cudaHostAllocDefault), where);
    host_errors_ = static_cast<uint32_t*>(p);
    errors_cap_ = cap;
  }
  FERRY_CUDA_RETURN(cudaMemsetAsync(errors_, 0, n * sizeof(uint32_t), stream), where);
  return Status::Ok();
}

Status PlanesStage::Enqueue(size_t k, const uint8_t* host, size_t bytes,
                            const std::vector<PlanesStaged>& blocks, uint32_t* errors,
                            cudaStream_t stream, const std::string& where) {
  uint8_t* dslot = slots_ + k * slot_bytes_;
  FERRY_CUDA_RETURN(cudaMemcpyAsync(dslot, host, bytes, cudaMemcpyHostToDevice, copy_), where);
  FERRY_CUDA_RETURN(cudaEventRecord(copied_[k], copy_), where);
  FERRY_CUDA_RETURN(cudaStreamWaitEvent(stream, copied_[k], 0), where);
  // Blocks of one slot are contiguous in the load's error array.
  std::vector<planes::DeviceJob> jobs(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    jobs[i] = planes::DeviceJob{dslot + blocks[i].soff, blocks[i].dst, blocks[i].layout};
  }
  for (size_t i = 0; i < blocks.size();) {
    size_t j = i + 1;
    while (j < blocks.size() && blocks[j].error_index == blocks[j - 1].error_index + 1) ++j;
    Status st = planes::DecodeOnDevice(jobs.data() + i, static_cast<int>(j - i),
                                       errors + blocks[i].error_index, stream);
    if (!st.ok()) return Error(st.code(), where, ": ", st.message());
    i = j;
  }
  return Status::Ok();
}

Status PlanesStage::FetchErrors(cudaStream_t stream, std::vector<uint32_t>* out,
                                const std::string& where) {
  size_t n = out->size();
  if (n == 0) return Status::Ok();
  FERRY_CUDA_RETURN(
      cudaMemcpyAsync(host_errors_, errors_, n * sizeof(uint32_t), cudaMemcpyDeviceToHost, stream),
      where);
  // Waits for this copy (and so for the decodes before it on `stream`), not for the stream:
  // work other threads enqueue on it meanwhile is not ours to wait for.
  FERRY_CUDA_RETURN(cudaEventRecord(fetched_, stream), where);
  FERRY_CUDA_RETURN(cudaEventSynchronize(fetched_), where);
  std::copy(host_errors_, host_errors_ + n, out->begin());
  return Status::Ok();
}

}  // namespace ferry

#endif  // FERRY_HAVE_CUDA_KERNELS
