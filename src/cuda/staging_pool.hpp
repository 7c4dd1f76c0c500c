// StagingPool internals (include/ferry/ferry.hpp): a ring of host memory handed out in
// contiguous pieces, given back in any order and reused in allocation order.
#ifndef FERRY_SRC_CUDA_STAGING_POOL_HPP_
#define FERRY_SRC_CUDA_STAGING_POOL_HPP_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>

#include "ferry/ferry.hpp"

namespace ferry {

class StagingPool::Impl {
 public:
  Impl(uint8_t* base, uint64_t bytes) : base_(base), bytes_(bytes) {}
  ~Impl();
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  struct Piece {
    uint64_t id = 0;
    uint8_t* data = nullptr;
  };
  // `n` contiguous bytes (256-byte aligned), waiting while the ring is full. Pieces come back
  // through Release in any order; their memory is reused once every older piece is back too,
  // so one slow piece holds the ring's tail.
  Result<Piece> Acquire(uint64_t n);
  void Release(uint64_t id);

  // Registers the memory with CUDA (portable) in the calling thread's current context, once.
  Status EnsurePinned();
  bool pinned() const;
  uint64_t bytes() const { return bytes_; }

 private:
  struct Live {
    uint64_t off;
    uint64_t size;
    bool released;
  };
  uint8_t* const base_;
  const uint64_t bytes_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Live> live_;  // allocation order; live_.front() has id front_id_
  uint64_t front_id_ = 0;

  mutable std::mutex pin_mu_;
  bool pinned_ = false;
  void* pin_ctx_ = nullptr;  // CUcontext of the registration
};

}  // namespace ferry

#endif  // FERRY_SRC_CUDA_STAGING_POOL_HPP_
