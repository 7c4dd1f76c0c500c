// Streaming loads (Loader::LoadStreaming): each tensor goes to the caller's callback as soon as
// the last copy into it is enqueued on the load stream (or complete), while the rest of the
// load goes on.
//
// Workers report every piece they finish; the worker that finishes a tensor's last piece
// records an event on the load stream (every earlier piece of that tensor is already on the
// stream, since each worker reports only after its own copy call returned) and queues the
// tensor. One notifier thread takes the queue in order, waits for the event when the caller
// asked for completed tensors, and runs the callback; callbacks therefore never run
// concurrently and never block a copy worker.
#ifndef FERRY_SRC_LOAD_HANDOVER_HPP_
#define FERRY_SRC_LOAD_HANDOVER_HPP_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "base/worker_pool.hpp"
#include "cuda/event_pool.hpp"
#include "ferry/loader.hpp"

namespace ferry {

class Handover {
 public:
  // `device`: a device load on `stream` in context `ctx` (a CUcontext; null when the driver
  // API is unavailable); else a host load (no events).
  Handover(const ReadyCallback& callback, HandOver when, const std::vector<LoadedTensor>& out,
           bool device, Stream stream, void* ctx);
  ~Handover();
  Handover(const Handover&) = delete;
  Handover& operator=(const Handover&) = delete;

  // pieces[k]: how many pieces the load copies into out[k]. Tensors with none (empty ones)
  // are handed over at once. Starts the notifier thread.
  Status Start(std::vector<uint32_t> pieces);
  // A worker finished one piece of out[k]: enqueued its copy (device) or copied it (host).
  Status PieceDone(size_t k);
  // Waits until every queued tensor was handed over (the load's pieces are all reported, or
  // the load failed and no more will come). The first error of the notifier, if any.
  Status Finish();

 private:
  struct Item {
    size_t index;
    void* event;  // cudaEvent_t, null for host loads
  };
  Status Queue(size_t k);
  void Loop();

  const ReadyCallback& callback_;
  const HandOver when_;
  const bool device_;
  const std::vector<LoadedTensor>& out_;
  const Stream stream_;
  void* const ctx_;
  std::unique_ptr<std::atomic<uint32_t>[]> remaining_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool closing_ = false;
  Status error_;
  EventPool events_;    // destroyed after the thread is joined (Finish)
  ThreadGroup thread_;  // one thread
};

}  // namespace ferry

#endif  // FERRY_SRC_LOAD_HANDOVER_HPP_
