#include "load/handover.hpp"

#include <exception>
#include <string>
#include <utility>

#include "base/util.hpp"

#ifdef FERRY_HAVE_CUDA
#include "cuda/cuda_util.hpp"
#endif

namespace ferry {

Handover::Handover(const ReadyCallback& callback, HandOver when,
                   const std::vector<LoadedTensor>& out, bool device, Stream stream, void* ctx)
    : callback_(callback), when_(when), device_(device), out_(out), stream_(stream), ctx_(ctx) {
  events_.set_context(ctx);
}

Handover::~Handover() { Finish(); }

Status Handover::Start(std::vector<uint32_t> pieces) {
  remaining_.reset(new std::atomic<uint32_t>[pieces.size()]);
  for (size_t k = 0; k < pieces.size(); ++k) remaining_[k].store(pieces[k]);
  FERRY_RETURN_IF_ERROR(thread_.Start(
      1, [this](int) { Loop(); }, "starting hand-over thread"));
  for (size_t k = 0; k < pieces.size(); ++k) {
    if (pieces[k] == 0) FERRY_RETURN_IF_ERROR(Queue(k));
  }
  return Status::Ok();
}

Status Handover::PieceDone(size_t k) {
  if (remaining_[k].fetch_sub(1, std::memory_order_acq_rel) != 1) return Status::Ok();
  return Queue(k);
}

Status Handover::Queue(size_t k) {
  void* event = nullptr;
#ifdef FERRY_HAVE_CUDA
  if (device_) {
    auto taken = events_.Take("hand-over");
    if (!taken.ok()) {
      return Error(taken.status().code(), "creating a hand-over event for tensor #", k, ": ",
                   taken.status().message());
    }
    event = *taken;
    cudaError_t err =
        cudaEventRecord(static_cast<cudaEvent_t>(event), reinterpret_cast<cudaStream_t>(stream_));
    if (err != cudaSuccess) return CudaStatus(err, "hand-over", "cudaEventRecord");
  }
#endif
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Item{k, event});
  }
  cv_.notify_one();
  return Status::Ok();
}

void Handover::Loop() {
#ifdef FERRY_HAVE_CUDA
  // Waiting on an event needs the load's context current on this thread.
  std::unique_ptr<ScopedContext> scope;
  if (device_ && ctx_ != nullptr) {
    scope = std::make_unique<ScopedContext>(static_cast<CUcontext>(ctx_));
  }
#endif
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !queue_.empty() || closing_; });
      if (queue_.empty()) return;
      item = queue_.front();
      queue_.pop_front();
    }
    Status st;
    bool failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      failed = !error_.ok();
    }
#ifdef FERRY_HAVE_CUDA
    if (item.event != nullptr && when_ == HandOver::kComplete) {
      cudaError_t err = cudaEventSynchronize(static_cast<cudaEvent_t>(item.event));
      if (err != cudaSuccess) st = CudaStatus(err, "hand-over", "cudaEventSynchronize");
    }
#endif
    // After a failed callback the rest are drained without calling it again.
    if (st.ok() && !failed) {
      ReadyTensor ready;
      ready.index = item.index;
      ready.tensor = &out_[item.index];
      ready.ready = static_cast<Event>(item.event);
      try {
        callback_(ready);
      } catch (const std::exception& e) {
        st = Error(StatusCode::kInternal, "the ready callback threw: ", e.what());
      } catch (...) {
        st = Error(StatusCode::kInternal, "the ready callback threw");
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (item.event != nullptr) events_.Give(item.event);
    if (!st.ok() && error_.ok()) error_ = std::move(st);
  }
}

Status Handover::Finish() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
  }
  cv_.notify_one();
  thread_.Join();
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

}  // namespace ferry
