// Every thread the library starts is started here: a group of threads on one function
// (ThreadGroup), parts of a job spread over threads (RunParts), one background thread
// (StartDetached), or a fixed set of threads that run one job at a time (WorkerPool). A thread
// the system refuses (EAGAIN from a thread limit, ENOMEM for a stack under an address-space
// limit) is ResourceExhausted or fewer threads, never an exception or an abort.
#ifndef FERRY_SRC_BASE_WORKER_POOL_HPP_
#define FERRY_SRC_BASE_WORKER_POOL_HPP_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ferry/status.hpp"

namespace ferry {

// Worker threads when the caller chose none: the machine's hardware threads (4 when the
// system cannot tell), between 1 and `cap` (more measured no faster, or the work is capped).
int DefaultThreads(int cap = 16);

// Threads started together on one function and joined together. Not thread-safe: one owner
// starts and joins.
class ThreadGroup {
 public:
  ThreadGroup() = default;
  // Joins whatever still runs.
  ~ThreadGroup();
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;

  // Starts fn(size()), ..., fn(size() + n - 1), each on a thread of its own. ResourceExhausted,
  // "<what> <k> of <n>: <reason>", when the system refuses thread k; the threads already
  // started keep running (the caller tells them to stop, then joins).
  Status Start(int n, const std::function<void(int)>& fn, const std::string& what);
  void Join();
  int size() const { return static_cast<int>(threads_.size()); }

 private:
  std::vector<std::thread> threads_;
};

// Runs fn(0), ..., fn(parts - 1), each once, on up to `parts` threads at once: the caller runs
// fn(0), and any part whose thread the system refuses, after its own (slower, same result).
// Returns the number of threads that ran parts (the caller's included).
int RunParts(int parts, const std::function<void(int)>& fn);

// Runs fn on a thread of its own that nobody joins. ResourceExhausted, "<what>: <reason>",
// when the system refuses the thread (fn was not run).
Status StartDetached(std::function<void()> fn, const std::string& what);

class WorkerPool {
 public:
  // Starts max(1, threads) workers. ResourceExhausted, with none left running, when the system
  // refuses a thread (EAGAIN from a thread limit, ENOMEM for a stack under an address-space
  // limit): a request for more threads than the machine gives must not abort the process.
  static Result<std::unique_ptr<WorkerPool>> Create(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const { return threads_.size(); }
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
  ThreadGroup threads_;
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
