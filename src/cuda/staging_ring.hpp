// A ring of pinned host slots through which bytes move between host and device in stream
// order: the loader fills a slot on the CPU and copies it to the device; a device writer copies
// device memory into a slot and drains it on the CPU. Either way, a slot is reused only after
// the device work that touched it has completed (its event), never by synchronizing a stream.
//
// Batch k of a pass uses slot k % num_slots(); batches take a slot in order, so a slot goes to
// batch k + num_slots() only after batch k released it.
//
// Thread safety: Prepare, Begin and WaitIdle are called by one thread while no pass runs.
// During a pass, Acquire, Record, Release and Abort may be called from any number of threads
// at once; a batch's Acquire, Record and Release come from the thread that runs that batch.
#ifndef FERRY_SRC_CUDA_STAGING_RING_HPP_
#define FERRY_SRC_CUDA_STAGING_RING_HPP_

#ifdef FERRY_HAVE_CUDA

#include <cuda.h>
#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "ferry/loader.hpp"

namespace ferry {

class StagingRing {
 public:
  // `slots` slots of `slot_capacity` bytes each, 4096-byte aligned, allocated by Prepare.
  StagingRing(uint64_t slots, uint64_t slot_capacity, PinnedAlloc alloc);
  // Waits for the ring's own events, then frees its pinned memory. Run it while the CUDA
  // context still exists (not from a static destructor).
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // Allocates the pinned memory (once) and the slots' events in context `ctx`, the caller's
  // current one; events are remade, after waiting for the old ones, when `ctx` changes.
  Status Prepare(CUcontext ctx);
  uint64_t num_slots() const { return slots_.size(); }
  uint64_t pinned_bytes() const { return bytes_; }

  // Starts a pass: batch k of it will use slot k % num_slots().
  void Begin();
  // Blocks until slot k % num_slots() is batch k's and the device has finished with its
  // previous contents; `*data` is then the slot's memory, or null once the pass is aborted.
  Status Acquire(uint64_t k, uint8_t** data);
  // Marks, on `stream`, the point after the device work that reads or writes batch k's slot.
  Status Record(uint64_t k, cudaStream_t stream);
  // Hands batch k's slot to batch k + num_slots() (also after a failed batch).
  void Release(uint64_t k);
  // Wakes every Acquire of this pass; they return a null slot.
  void Abort();
  // Waits for every slot's last recorded device work.
  void WaitIdle();

 private:
  struct Slot {
    uint8_t* data = nullptr;
    cudaEvent_t event = nullptr;
    bool used = false;  // `event` was recorded since the events were made
    uint64_t turn = 0;  // the batch that may take the slot next
  };
  void DestroyEvents();
  void Free();

  const uint64_t capacity_;
  const PinnedAlloc alloc_;
  uint8_t* memory_ = nullptr;
  uint64_t bytes_ = 0;
  std::vector<Slot> slots_;
  CUcontext ctx_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  bool aborted_ = false;
};

}  // namespace ferry

#endif  // FERRY_HAVE_CUDA
#endif  // FERRY_SRC_CUDA_STAGING_RING_HPP_
