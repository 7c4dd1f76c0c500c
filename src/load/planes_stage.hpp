// Device side of loading PLANES tensors. Each batch of compressed blocks, filled by a worker into
// a pinned staging slot, is copied into a device slot (a "twin") on a loader-owned copy stream;
// the pinned slot is free again once that copy has run. The blocks of a group of consecutive
// batches are then expanded by one decode launch on the caller's stream (after the group's
// copies and after the caller's earlier work), and with verification on, their raw bytes are
// hashed on the device and compared with the index's checksums.
//
// Why groups: one launch per 4 MiB block is bound by the launch's latency (one block spreads
// over the SMs thinly, each CTA decoding one unit serially), well below what the link delivers
// once the GPU's clocks are low, as in a fresh process; a launch over many blocks runs at the
// kernel's throughput. A twin is reused only after the decode that read it, which the copy
// stream waits for (an event), and a batch waits on the host until that decode was enqueued.
#ifndef FERRY_SRC_LOAD_PLANES_STAGE_HPP_
#define FERRY_SRC_LOAD_PLANES_STAGE_HPP_

#ifdef FERRY_HAVE_CUDA_KERNELS

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "codec/checksum_cuda.hpp"
#include "codec/planes_cuda.hpp"
#include "ferry/status.hpp"

namespace ferry {

// One compressed block staged for the device: where its stored bytes sit in the host slot,
// where its raw bytes go, and what to name when it turns out corrupt.
struct PlanesStaged {
  uint64_t soff = 0;  // offset in the slot, 256-byte aligned
  uint8_t* dst = nullptr;
  planes::Layout layout;
  uint32_t error_index = 0;  // entry in the load's device error array
  uint64_t checksum = 0;     // of the raw bytes, checked when the load verifies
};

// How the stage groups its work (LoaderTuning sets these; the defaults are the loader's).
struct PlanesStageShape {
  int group = 8;        // batches whose blocks one decode launch expands
  int twin_factor = 2;  // device slots per pinned slot
  bool prewarm = true;  // load the decode kernel at Prepare instead of at the first launch
  bool verify_each_group = false;  // hash each group after its decode instead of all at the end
};

// Not thread-safe as a whole: Prepare, StartLoad, Finish, EndLoad and Release run with no
// batch in flight; Enqueue and Abort may be called concurrently (distinct batches).
class PlanesStage {
 public:
  PlanesStage() = default;
  ~PlanesStage();
  PlanesStage(const PlanesStage&) = delete;
  PlanesStage& operator=(const PlanesStage&) = delete;

  // Device slots of `slot_bytes` each for a ring of `nslots` pinned slots, in the current
  // context `ctx` (the caller's device). Idempotent for the same context, sizes and shape; a
  // change releases the old resources first.
  Status Prepare(CUcontext ctx, size_t nslots, size_t slot_bytes, const PlanesStageShape& shape,
                 const std::string& where);
  void Release();

  // Starts a load of `nblocks` blocks in `nbatches` batches: zeroes the device error array on
  // `stream` and makes the copy stream wait for the previous load's decodes.
  Status StartLoad(size_t nblocks, size_t nbatches, bool verify, cudaStream_t stream,
                   const std::string& where);

  // Batch j (0-based among the load's PLANES batches): waits until its device slot is free,
  // enqueues the copy of host bytes [0, bytes) into it on copy_stream(), and, when it is the
  // last batch of its group to arrive, the group's decodes on `stream`. The pinned slot may be
  // refilled once copy_stream() passes this point (record its event there). Returns with
  // nothing enqueued once the load was aborted.
  Status Enqueue(size_t j, const uint8_t* host, size_t bytes,
                 const std::vector<PlanesStaged>& blocks, cudaStream_t stream,
                 const std::string& where);
  cudaStream_t copy_stream() const { return copy_; }
  // Wakes every Enqueue waiting for a device slot (the load failed elsewhere).
  void Abort();

  // After every batch was enqueued: the checksums (all blocks in one launch unless checked per
  // group), then the error values of every block, copied to the host once `stream` has passed
  // them (an event; not a stream synchronization). out[i] != 0: block i failed to decode
  // (planes::DeviceErrorText) or, kChecksumMismatch, decoded to other bytes than were saved.
  Status Finish(cudaStream_t stream, std::vector<uint32_t>* out, const std::string& where);
  // Marks the end of a load's device work on `stream` (also of a failed load), which the next
  // load's copies into the device slots wait for.
  void EndLoad(cudaStream_t stream);

  // Seconds (steady clock) of the first decode launch of the current load, 0 before it.
  double first_launch() const { return first_launch_.load(std::memory_order_relaxed); }

 private:
  // A group's launch: decodes (and checks) blocks [first, first + n) of the load.
  Status Launch(size_t g, cudaStream_t stream, const std::string& where);

  CUcontext ctx_ = nullptr;
  PlanesStageShape shape_;
  uint8_t* twins_ = nullptr;
  size_t nslots_ = 0, ntwins_ = 0, ngroup_slots_ = 0, slot_bytes_ = 0;
  cudaStream_t copy_ = nullptr;
  std::vector<cudaEvent_t> copied_, decoded_;  // per group slot
  cudaEvent_t done_ = nullptr;                 // end of the previous load's device work
  bool done_recorded_ = false;
  cudaEvent_t fetched_ = nullptr;  // recorded after the copy of a load's errors
  uint32_t* errors_ = nullptr;
  uint32_t* host_errors_ = nullptr;
  DeviceBlock* table_ = nullptr;       // device copy of host_table_
  DeviceBlock* host_table_ = nullptr;  // pinned: what each block's raw bytes must hash to
  size_t errors_cap_ = 0;

  // The current load.
  size_t nblocks_ = 0, nbatches_ = 0;
  bool verify_ = false;
  // Per group slot: batches still to arrive, and each arrived batch's decodes.
  struct Arrived {
    uint32_t first = 0;  // error index of its first block
    std::vector<planes::DeviceJob> jobs;
  };
  std::unique_ptr<std::atomic<int>[]> remaining_;
  std::vector<std::vector<Arrived>> arrived_;
  std::vector<uint64_t> launched_;  // per group slot: 1 + the last group launched from it
  std::mutex mu_;
  std::condition_variable cv_;
  bool aborted_ = false;
  std::atomic<double> first_launch_{0};
};

}  // namespace ferry

#endif  // FERRY_HAVE_CUDA_KERNELS
#endif  // FERRY_SRC_LOAD_PLANES_STAGE_HPP_
