// The pinned staging ring (src/cuda/staging_ring.hpp).
#include "cuda/staging_ring.hpp"

#include <sys/mman.h>

#ifdef FERRY_HAVE_CUDA

#include <cstdlib>
#include <cstring>

#include "cuda/cuda_util.hpp"
#include "base/util.hpp"

namespace ferry {

StagingRing::StagingRing(uint64_t slots, uint64_t slot_capacity, PinnedAlloc alloc)
    : capacity_(slot_capacity), alloc_(alloc), slots_(slots) {}

StagingRing::~StagingRing() {
  if (ctx_ == nullptr && memory_ == nullptr) return;
  ScopedContext scope(ctx_);
  DestroyEvents();
  Free();
}

void StagingRing::WaitIdle() {
  for (Slot& s : slots_) {
    if (s.used) cudaEventSynchronize(s.event);
    s.used = false;
  }
}

void StagingRing::DestroyEvents() {
  WaitIdle();
  for (Slot& s : slots_) {
    if (s.event) cudaEventDestroy(s.event);
    s.event = nullptr;
  }
}

void StagingRing::Free() {
  if (memory_ == nullptr) return;
  if (alloc_ == PinnedAlloc::kHostRegister) {
    cudaHostUnregister(memory_);
    std::free(memory_);
  } else {
    cudaFreeHost(memory_);
  }
  memory_ = nullptr;
}

Status StagingRing::Prepare(CUcontext ctx) {
  if (memory_ == nullptr) {
    const uint64_t bytes = slots_.size() * capacity_;
    if (alloc_ == PinnedAlloc::kHostAlloc) {
      void* p = nullptr;
      FERRY_CUDA_RETURN(cudaHostAlloc(&p, bytes, cudaHostAllocPortable), "staging ring");
      memory_ = static_cast<uint8_t*>(p);
    } else {
      // 2 MiB aligned and advised for transparent huge pages: pinning a 64 MiB ring of huge
      // pages measured 17-20 ms in fresh processes on an H200 host, 41-46 ms with 4 KiB pages
      // (benchmarks/README.md). The ring is rounded up to 2 MiB.
      constexpr uint64_t kHugePage = uint64_t{2} << 20;
      const uint64_t alloc_bytes = AlignUp(bytes, kHugePage);
      void* p = std::aligned_alloc(kHugePage, alloc_bytes);
      if (p == nullptr) {
        return Error(StatusCode::kResourceExhausted, "staging ring of ", bytes, " bytes");
      }
      ::madvise(p, alloc_bytes, MADV_HUGEPAGE);
      // Touch every page first: registering prefaulted memory is measurably faster.
      std::memset(p, 0, alloc_bytes);
      cudaError_t err = cudaHostRegister(p, alloc_bytes, cudaHostRegisterPortable);
      if (err != cudaSuccess) {
        std::free(p);
        return CudaStatus(err, "staging ring", "cudaHostRegister");
      }
      memory_ = static_cast<uint8_t*>(p);
    }
    bytes_ = bytes;
    for (uint64_t i = 0; i < slots_.size(); ++i) slots_[i].data = memory_ + i * capacity_;
  }
  if (ctx_ != ctx) {
    if (ctx_ != nullptr) {
      ScopedContext scope(ctx_);
      DestroyEvents();
    }
    for (Slot& s : slots_) {
      FERRY_CUDA_RETURN(cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming),
                        "staging events");
      s.used = false;
    }
    ctx_ = ctx;
  }
  return Status::Ok();
}

void StagingRing::Begin() {
  std::lock_guard<std::mutex> lock(mu_);
  aborted_ = false;
  for (uint64_t i = 0; i < slots_.size(); ++i) slots_[i].turn = i;
}

Status StagingRing::Acquire(uint64_t k, uint8_t** data) {
  Slot& slot = slots_[k % slots_.size()];
  *data = nullptr;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return slot.turn == k || aborted_; });
    if (aborted_) return Status::Ok();
  }
  if (slot.used) {
    cudaError_t err = cudaEventSynchronize(slot.event);
    if (err != cudaSuccess) return CudaStatus(err, "staging ring", "waiting for a slot");
  }
  *data = slot.data;
  return Status::Ok();
}

Status StagingRing::Record(uint64_t k, cudaStream_t stream) {
  Slot& slot = slots_[k % slots_.size()];
  cudaError_t err = cudaEventRecord(slot.event, stream);
  if (err != cudaSuccess) return CudaStatus(err, "staging ring", "cudaEventRecord");
  slot.used = true;
  return Status::Ok();
}

void StagingRing::Release(uint64_t k) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    slots_[k % slots_.size()].turn = k + slots_.size();
  }
  cv_.notify_all();
}

void StagingRing::Abort() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
  }
  cv_.notify_all();
}

}  // namespace ferry

#endif  // FERRY_HAVE_CUDA
