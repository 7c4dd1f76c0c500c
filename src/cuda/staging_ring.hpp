// The loader's staging slots: equal pieces of one pinned staging pool (staging_pool.hpp), each
// with an event, through which bytes move from host to device in stream order: the loader
// fills a slot on the CPU and copies it to the device, and a slot is reused only after the
// device work that read it has completed (its event), never by synchronizing a stream.
//
// Batches of a pass take their slots in batch order (batch k waits for batch k - 1 to have
// one), so at most num_slots() consecutive batches hold slots at once; a batch holds its slot
// from Acquire to Release.
//
// Thread safety: Prepare, Begin and WaitIdle are called by one thread while no pass runs.
// During a pass, Acquire, SlotOf, Record, Release and Abort may be called from any number of
// threads at once; a batch's Acquire, SlotOf, Record and Release come from the thread that
// runs that batch.
#ifndef FERRY_SRC_CUDA_STAGING_RING_HPP_
#define FERRY_SRC_CUDA_STAGING_RING_HPP_

#ifdef FERRY_HAVE_CUDA

#include <cuda.h>
#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda/staging_pool.hpp"
#include "ferry/loader.hpp"

namespace ferry {

class StagingRing {
 public:
  // `slots` slots of `slot_capacity` bytes each (a multiple of 4096), allocated by Prepare.
  StagingRing(uint64_t slots, uint64_t slot_capacity, PinnedAlloc alloc);
  // Waits for the slots' events, then frees the pinned memory. Run it while the CUDA context
  // still exists (not from a static destructor).
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // Allocates and pins the memory (once) and makes the slots' events in context `ctx`, the
  // caller's current one; events are remade, after waiting for the old ones, when `ctx`
  // changes.
  Status Prepare(CUcontext ctx);
  uint64_t num_slots() const { return slots_.size(); }
  uint64_t pinned_bytes() const { return pool_ ? slots_.size() * capacity_ : 0; }

  // Starts a pass: its batches are numbered from 0.
  void Begin();
  // Blocks until batch k has a slot whose previous contents the device has finished with;
  // `*data` is then the slot's memory, or null once the pass is aborted (no Release then).
  Status Acquire(uint64_t k, uint8_t** data);
  // The slot (in [0, num_slots())) that batch k holds.
  uint64_t SlotOf(uint64_t k) const { return held_[k % held_.size()].slot; }
  // Marks, on `stream`, the point after the device work that reads batch k's slot.
  Status Record(uint64_t k, cudaStream_t stream);
  // Gives batch k's slot back (also after a failed batch).
  void Release(uint64_t k);
  // Wakes every Acquire of this pass; they return a null slot.
  void Abort();
  // Waits for every slot's last recorded device work.
  void WaitIdle();

 private:
  struct Slot {
    cudaEvent_t event = nullptr;
    bool used = false;  // `event` was recorded since the events were made
  };
  // What batch k holds, at k % num_slots(): at most num_slots() consecutive batches hold
  // slots, so they never share an entry.
  struct Held {
    uint64_t piece = 0;
    uint64_t slot = 0;
  };
  void DestroyEvents();

  const uint64_t capacity_;
  const PinnedAlloc alloc_;
  std::unique_ptr<StagingPool::Impl> pool_;
  std::vector<Slot> slots_;
  std::vector<Held> held_;
  CUcontext ctx_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t turn_ = 0;  // the batch that may take a slot next
  bool aborted_ = false;
};

}  // namespace ferry

#endif  // FERRY_HAVE_CUDA
#endif  // FERRY_SRC_CUDA_STAGING_RING_HPP_
