// Pinned host staging memory (src/cuda/staging_pool.hpp).
#include "cuda/staging_pool.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "base/host_memory.hpp"
#include "base/util.hpp"
#include "base/worker_pool.hpp"
#include "cuda/cuda_util.hpp"
#include "cuda/device_alloc.hpp"

namespace ferry {

namespace {
constexpr uint64_t kPageBytes = 4096;

#ifdef FERRY_HAVE_CUDA
// First touch of fresh pages, spread over threads from 64 MiB up: page faults (zeroing) are
// what a one-thread touch of many GiB waits on.
void Prefault(uint8_t* p, uint64_t n) {
  const int parts = n < (uint64_t{64} << 20) ? 1 : DefaultThreads(16);
  const uint64_t step = AlignUp((n + parts - 1) / parts, kPageBytes);
  RunParts(parts, [=](int k) {
    const uint64_t at = static_cast<uint64_t>(k) * step;
    if (at < n) std::memset(p + at, 0, std::min(step, n - at));
  });
}
#endif
}  // namespace

Result<std::unique_ptr<StagingPool::Impl>> StagingPool::Impl::Create(uint64_t bytes,
                                                                     PinnedAlloc alloc,
                                                                     std::string name) {
  if (alloc == PinnedAlloc::kHostAlloc) {
#ifdef FERRY_HAVE_CUDA
    void* p = nullptr;
    FERRY_CUDA_RETURN(cudaHostAlloc(&p, bytes, cudaHostAllocPortable), name);
    CUcontext ctx = nullptr;
    if (Driver().ok) Driver().ctx_get_current(&ctx);
    std::unique_ptr<Impl> impl(new Impl(static_cast<uint8_t*>(p), bytes, bytes, alloc, name));
    impl->pinned_ = true;
    impl->pin_ctx_ = ctx;
    return impl;
#else
    return Error(StatusCode::kUnimplemented, name, ": this build has no CUDA support");
#endif
  }
  uint64_t allocated = 0;
  void* p = AllocateBulk(bytes, kPageBytes, &allocated);
  if (p == nullptr) {
    return Error(StatusCode::kResourceExhausted, name, ": cannot allocate ", bytes, " bytes");
  }
  return std::unique_ptr<Impl>(
      new Impl(static_cast<uint8_t*>(p), bytes, allocated, alloc, std::move(name)));
}

StagingPool::Impl::~Impl() {
#ifdef FERRY_HAVE_CUDA
  if (pinned_) {
    ScopedContext scope(static_cast<CUcontext>(pin_ctx_));
    if (alloc_ == PinnedAlloc::kHostAlloc) {
      cudaFreeHost(base_);
      return;
    }
    cudaHostUnregister(base_);
  }
#endif
  std::free(base_);
}

Result<StagingPool::Impl::Piece> StagingPool::Impl::Acquire(uint64_t n) {
  n = AlignUp(std::max<uint64_t>(n, 1), kDeviceAlign);
  if (n > bytes_) {
    return Error(StatusCode::kInvalidArgument, "a block of ", n, " bytes does not fit the ", name_,
                 " of ", bytes_, " bytes");
  }
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    uint64_t off = UINT64_MAX;
    if (live_.empty()) {
      off = 0;
    } else {
      const Live& front = live_.front();
      const Live& back = live_.back();
      const uint64_t head = back.off + back.size;
      if (back.off >= front.off) {  // live bytes are [front.off, head)
        if (head + n <= bytes_) {
          off = head;
        } else if (n <= front.off) {
          off = 0;  // wrap; the unused end waits for the tail to pass
        }
      } else if (head + n <= front.off) {  // wrapped: free bytes are [head, front.off)
        off = head;
      }
    }
    if (off != UINT64_MAX) {
      live_.push_back(Live{off, n, false});
      return Piece{front_id_ + live_.size() - 1, base_ + off};
    }
    cv_.wait(lock);
  }
}

void StagingPool::Impl::Release(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (id < front_id_ || id - front_id_ >= live_.size()) return;
    live_[id - front_id_].released = true;
    if (id != front_id_) return;
    while (!live_.empty() && live_.front().released) {
      live_.pop_front();
      ++front_id_;
    }
  }
  cv_.notify_all();
}

Status StagingPool::Impl::EnsurePinned() {
  std::lock_guard<std::mutex> lock(pin_mu_);
  if (pinned_) return Status::Ok();
#ifdef FERRY_HAVE_CUDA
  // The current device's context (made current here if the thread has none): never another.
  FERRY_CUDA_RETURN(cudaFree(nullptr), name_);
  CUcontext ctx = nullptr;
  if (Driver().ok) Driver().ctx_get_current(&ctx);
  Prefault(base_, allocated_);
  cudaError_t err = cudaHostRegister(base_, allocated_, cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return CudaStatus(err, StrCat(name_, " of ", bytes_, " bytes"), "cudaHostRegister");
  }
  pinned_ = true;
  pin_ctx_ = ctx;
  return Status::Ok();
#else
  return Error(StatusCode::kUnimplemented,
               "this build of TensorFerry has no CUDA support, so no pinned staging memory");
#endif
}

bool StagingPool::Impl::pinned() const {
  std::lock_guard<std::mutex> lock(pin_mu_);
  return pinned_;
}

StagingPool::StagingPool(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StagingPool::~StagingPool() = default;

Result<std::shared_ptr<StagingPool>> StagingPool::Create(uint64_t bytes, bool pin) {
  if (bytes < 2 * kPageBytes || bytes > (uint64_t{1} << 46)) {
    return Error(StatusCode::kInvalidArgument, "staging pool of ", bytes,
                 " bytes: needs at least 8192 bytes");
  }
  FERRY_ASSIGN_OR_RETURN(auto impl, Impl::Create(AlignUp(bytes, kPageBytes),
                                                 PinnedAlloc::kHostRegister, "staging pool"));
  if (pin) FERRY_RETURN_IF_ERROR(impl->EnsurePinned());
  return std::shared_ptr<StagingPool>(new StagingPool(std::move(impl)));
}

uint64_t StagingPool::bytes() const { return impl_->bytes(); }
bool StagingPool::pinned() const { return impl_->pinned(); }

}  // namespace ferry
