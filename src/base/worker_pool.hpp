// A fixed set of threads that run one job at a time, all threads on the same job.
#ifndef FERRY_SRC_BASE_WORKER_POOL_HPP_
#define FERRY_SRC_BASE_WORKER_POOL_HPP_

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ferry/status.hpp"

namespace ferry {

class WorkerPool {
 public:
  // Starts max(1, threads) workers. ResourceExhausted, with none left running, when the system
  // refuses a thread (EAGAIN from a thread limit, ENOMEM for a stack under an address-space
  // limit): a request for more threads than the machine gives must not abort the process.
  static Result<std::unique_ptr<WorkerPool>> Create(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const { return static_cast<int>(threads_.size()); }
  // Runs fn(worker_index) on every worker at once and returns when all have returned.
  // Threads persist between jobs, so per-thread state (a CUDA context made current, a zstd
  // context) is paid for once.
  void Run(const std::function<void(int)>& fn);

 private:
  WorkerPool() = default;
  void Loop(int index);

  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int running_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// The first error of a pool job; later ones are dropped (they are usually consequences).
// Any worker may Set; failed() is a cheap check between pieces of work.
class FirstError {
 public:
  void Set(Status st) {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) status_ = std::move(st);
    failed_.store(true);
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  Status Get() {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

 private:
  std::mutex mu_;
  Status status_;
  std::atomic<bool> failed_{false};
};

}  // namespace ferry

#endif  // FERRY_SRC_BASE_WORKER_POOL_HPP_
