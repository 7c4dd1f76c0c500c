// SaveGroups for tests: the ranks of a sharded save as threads of one process.
#ifndef FERRY_TESTS_SAVE_GROUP_HPP_
#define FERRY_TESTS_SAVE_GROUP_HPP_

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "ferry/sharded.hpp"

namespace ferry::testing {

// An all-reduce through shared memory: every rank's call blocks until all have arrived.
class ThreadGroup {
 public:
  explicit ThreadGroup(int nranks) : nranks_(nranks) {}

  SaveGroup Rank(int rank) {
    SaveGroup g;
    g.rank = rank;
    g.nranks = nranks_;
    g.all_reduce_max = [this](uint64_t* words, size_t count) {
      std::unique_lock<std::mutex> lock(mu_);
      if (arrived_ == 0) acc_.assign(count, 0);
      for (size_t i = 0; i < count && i < acc_.size(); ++i) acc_[i] = std::max(acc_[i], words[i]);
      const uint64_t gen = generation_;
      if (++arrived_ == nranks_) {
        result_ = acc_;
        arrived_ = 0;
        ++generation_;
        cv_.notify_all();
      } else {
        cv_.wait(lock, [&] { return generation_ != gen; });
      }
      std::copy(result_.begin(), result_.begin() + std::min(count, result_.size()), words);
      return Status::Ok();
    };
    return g;
  }

 private:
  const int nranks_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::vector<uint64_t> acc_, result_;
};

}  // namespace ferry::testing

#endif  // FERRY_TESTS_SAVE_GROUP_HPP_
