// Pinned host staging memory: the one implementation behind the loader's staging ring
// (cuda/staging_ring.hpp) and the writer's StagingPool (include/ferry/ferry.hpp). A ring of
// host memory handed out in contiguous pieces, given back in any order and reused in
// allocation order; pinned once, either by cudaHostAlloc or by registering host memory that
// is huge-page aligned (base/host_memory.hpp) and prefaulted on several threads first
// (registering prefaulted memory is measurably faster).
//
// Pinned memory is unregistered and freed by the destructor, in the context it was pinned
// in; destroy pools while that context exists, never from a static destructor.
//
// Thread safety: every method may be called from any number of threads at once.
#ifndef FERRY_SRC_CUDA_STAGING_POOL_HPP_
#define FERRY_SRC_CUDA_STAGING_POOL_HPP_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

#include "ferry/ferry.hpp"
#include "ferry/loader.hpp"

namespace ferry {

class StagingPool::Impl {
 public:
  // A pool of `bytes` (> 0). kHostRegister: host memory now, registered by EnsurePinned;
  // kHostAlloc: pinned now by cudaHostAlloc (Unimplemented without CUDA). `name` names the
  // pool in messages ("staging pool", "staging ring"). Hidden: the class has StagingPool's
  // exported visibility, and this is no API.
  __attribute__((visibility("hidden"))) static Result<std::unique_ptr<Impl>> Create(
      uint64_t bytes, PinnedAlloc alloc, std::string name);
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
  uint8_t* base() const { return base_; }

 private:
  Impl(uint8_t* base, uint64_t bytes, uint64_t allocated, PinnedAlloc alloc, std::string name)
      : base_(base), bytes_(bytes), allocated_(allocated), alloc_(alloc), name_(std::move(name)) {}

  struct Live {
    uint64_t off;
    uint64_t size;
    bool released;
  };
  uint8_t* const base_;
  const uint64_t bytes_;
  const uint64_t allocated_;  // bytes_ rounded up as allocated (and registered)
  const PinnedAlloc alloc_;
  const std::string name_;
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
