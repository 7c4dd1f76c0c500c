// The loader's staging slots (src/cuda/staging_ring.hpp).
#include "cuda/staging_ring.hpp"

#ifdef FERRY_HAVE_CUDA

#include "base/util.hpp"
#include "cuda/cuda_util.hpp"

namespace ferry {

StagingRing::StagingRing(uint64_t slots, uint64_t slot_capacity, PinnedAlloc alloc)
    : capacity_(slot_capacity), alloc_(alloc), slots_(slots), held_(slots) {}

StagingRing::~StagingRing() {
  if (ctx_ != nullptr) {
    ScopedContext scope(ctx_);
    DestroyEvents();
  }
  pool_.reset();  // unpins in the context it was pinned in
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

Status StagingRing::Prepare(CUcontext ctx) {
  if (pool_ == nullptr) {
    FERRY_ASSIGN_OR_RETURN(
        pool_, StagingPool::Impl::Create(slots_.size() * capacity_, alloc_, "staging ring"));
  }
  FERRY_RETURN_IF_ERROR(pool_->EnsurePinned());
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
  turn_ = 0;
}

Status StagingRing::Acquire(uint64_t k, uint8_t** data) {
  *data = nullptr;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return turn_ == k || aborted_; });
    if (aborted_) return Status::Ok();
  }
  // Every piece is one slot, and the pool holds exactly num_slots() of them: a piece starts
  // on a slot boundary, and the pool waits until the oldest holder gives its slot back.
  auto piece = pool_->Acquire(capacity_);
  bool aborted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    turn_ = k + 1;
    aborted = aborted_;
  }
  cv_.notify_all();
  if (!piece.ok()) {
    held_[k % held_.size()] = Held{UINT64_MAX, 0};  // nothing to give back
    return piece.status();
  }
  if (aborted) {
    pool_->Release(piece->id);
    return Status::Ok();
  }
  const uint64_t slot = static_cast<uint64_t>(piece->data - pool_->base()) / capacity_;
  held_[k % held_.size()] = Held{piece->id, slot};
  Slot& s = slots_[slot];
  if (s.used) {
    cudaError_t err = cudaEventSynchronize(s.event);
    if (err != cudaSuccess) return CudaStatus(err, "staging ring", "waiting for a slot");
  }
  *data = piece->data;
  return Status::Ok();
}

Status StagingRing::Record(uint64_t k, cudaStream_t stream) {
  Slot& slot = slots_[SlotOf(k)];
  cudaError_t err = cudaEventRecord(slot.event, stream);
  if (err != cudaSuccess) return CudaStatus(err, "staging ring", "cudaEventRecord");
  slot.used = true;
  return Status::Ok();
}

void StagingRing::Release(uint64_t k) { pool_->Release(held_[k % held_.size()].piece); }

void StagingRing::Abort() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
  }
  cv_.notify_all();
}

}  // namespace ferry

#endif  // FERRY_HAVE_CUDA
