// Reused CUDA events (src/cuda/event_pool.hpp).
#include "cuda/event_pool.hpp"

#include "base/util.hpp"
#include "cuda/cuda_util.hpp"

namespace ferry {

#ifdef FERRY_HAVE_CUDA

EventPool::~EventPool() {
  if (all_.empty()) return;
  ScopedContext scope(static_cast<CUcontext>(ctx_));
  for (void* e : all_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

Result<void*> EventPool::Take(const std::string& where) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      void* e = free_.back();
      free_.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  FERRY_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), where);
  std::lock_guard<std::mutex> lock(mu_);
  all_.push_back(e);
  return static_cast<void*>(e);
}

#else  // !FERRY_HAVE_CUDA

EventPool::~EventPool() = default;

Result<void*> EventPool::Take(const std::string& where) {
  return Error(StatusCode::kUnimplemented, where, ": this build has no CUDA support");
}

#endif  // FERRY_HAVE_CUDA

void EventPool::Give(void* event) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(event);
}

}  // namespace ferry
