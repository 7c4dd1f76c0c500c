#include "base/worker_pool.hpp"

#include <system_error>

#include "base/util.hpp"

namespace ferry {

Result<std::unique_ptr<WorkerPool>> WorkerPool::Create(int threads) {
  if (threads < 1) threads = 1;
  std::unique_ptr<WorkerPool> pool(new WorkerPool());
  std::string failure;
  try {
    pool->threads_.reserve(threads);
    for (int i = 0; i < threads; ++i) {
      WorkerPool* p = pool.get();
      pool->threads_.emplace_back([p, i] { p->Loop(i); });
    }
  } catch (const std::system_error& e) {
    failure = e.what();
  } catch (const std::bad_alloc&) {
    failure = "out of memory";
  }
  if (failure.empty()) return pool;
  size_t started = pool->threads_.size();
  pool.reset();  // stops and joins the workers already started
  return Error(StatusCode::kResourceExhausted, "cannot start worker thread ", started + 1, " of ",
               threads, ": ", failure);
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void WorkerPool::Run(const std::function<void(int)>& fn) {
  std::unique_lock<std::mutex> lock(mu_);
  job_ = &fn;
  running_ = static_cast<int>(threads_.size());
  ++generation_;
  start_cv_.notify_all();
  done_cv_.wait(lock, [this] { return running_ == 0; });
  job_ = nullptr;
}

void WorkerPool::Loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    (*job)(index);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--running_ == 0) done_cv_.notify_all();
    }
  }
}

}  // namespace ferry
