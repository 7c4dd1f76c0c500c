// CUDA events of one context, made on demand and reused: a load's hand-over events, a save's
// device-to-host copy events. Events are cudaEvent_t values passed as void*, so that users
// compile without CUDA headers.
//
// Thread safety: Take and Give may be called from any number of threads at once.
#ifndef FERRY_SRC_CUDA_EVENT_POOL_HPP_
#define FERRY_SRC_CUDA_EVENT_POOL_HPP_

#include <mutex>
#include <string>
#include <vector>

#include "ferry/status.hpp"

namespace ferry {

class EventPool {
 public:
  EventPool() = default;
  // Destroys every event it made, with `context` (the CUcontext they were made in) current.
  ~EventPool();
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // The context of the events made from now on (the caller's current one); set it before the
  // first Take.
  void set_context(void* context) { ctx_ = context; }
  // A free event, or a new one (timing disabled) in the calling thread's current context.
  // CudaError naming `where` when one cannot be made (Unimplemented without CUDA).
  Result<void*> Take(const std::string& where);
  // Gives back an event that no pending work will record or wait on any more.
  void Give(void* event);

 private:
  void* ctx_ = nullptr;
  std::mutex mu_;
  std::vector<void*> free_;
  std::vector<void*> all_;
};

}  // namespace ferry

#endif  // FERRY_SRC_CUDA_EVENT_POOL_HPP_
