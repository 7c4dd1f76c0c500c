// A fixed set of threads that run one job at a time, all threads on the same job.
#ifndef FERRY_SRC_WORKER_POOL_HPP_
#define FERRY_SRC_WORKER_POOL_HPP_

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

}  // namespace ferry

#endif  // FERRY_SRC_WORKER_POOL_HPP_
