#include "base/worker_pool.hpp"

#include <algorithm>
#include <system_error>

#include "base/util.hpp"

namespace ferry {

int DefaultThreads(int cap) {
  const unsigned hw = std::thread::hardware_concurrency();
  return std::clamp(hw == 0 ? 4 : static_cast<int>(std::min<unsigned>(hw, 1u << 20)), 1,
                    std::max(cap, 1));
}

ThreadGroup::~ThreadGroup() { Join(); }

Status ThreadGroup::Start(int n, const std::function<void(int)>& fn, const std::string& what) {
  const int first = size();
  std::string failure;
  try {
    threads_.reserve(threads_.size() + std::max(n, 0));
    for (int i = 0; i < n; ++i) threads_.emplace_back(fn, first + i);
  } catch (const std::system_error& e) {
    failure = e.what();
  } catch (const std::bad_alloc&) {
    failure = "out of memory";
  }
  if (failure.empty()) return Status::Ok();
  return Error(StatusCode::kResourceExhausted, what, " ", size() - first + 1, " of ", n, ": ",
               failure);
}

void ThreadGroup::Join() {
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

int RunParts(int parts, const std::function<void(int)>& fn) {
  if (parts <= 0) return 0;
  ThreadGroup group;
  // Parts 1.. on their own threads; whatever the system refuses runs here after part 0.
  (void)group.Start(
      parts - 1, [&](int i) { fn(i + 1); }, "");
  const int started = group.size();
  fn(0);
  for (int k = started + 1; k < parts; ++k) fn(k);
  group.Join();
  return started + 1;
}

Status StartDetached(std::function<void()> fn, const std::string& what) {
  try {
    std::thread(std::move(fn)).detach();
  } catch (const std::system_error& e) {
    return Error(StatusCode::kResourceExhausted, what, ": ", e.what());
  } catch (const std::bad_alloc&) {
    return Error(StatusCode::kResourceExhausted, what, ": out of memory");
  }
  return Status::Ok();
}

Result<std::unique_ptr<WorkerPool>> WorkerPool::Create(int threads) {
  if (threads < 1) threads = 1;
  std::unique_ptr<WorkerPool> pool(new WorkerPool());
  WorkerPool* p = pool.get();
  Status st = pool->threads_.Start(
      threads, [p](int i) { p->Loop(i); }, "cannot start worker thread");
  if (st.ok()) return pool;
  pool.reset();  // stops and joins the workers already started
  return st;
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  threads_.Join();
}

void WorkerPool::Run(const std::function<void(int)>& fn) {
  std::unique_lock<std::mutex> lock(mu_);
  job_ = &fn;
  running_ = threads_.size();
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
