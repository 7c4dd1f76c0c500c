// Device side of loading PLANES tensors: each pinned staging slot has a device twin that its
// compressed blocks are copied into (on a loader-owned copy stream, so copies overlap the
// decode of earlier slots), then the decode kernel expands them into the destination on the
// caller's stream, after the copy and after the caller's earlier work.
#ifndef FERRY_SRC_LOAD_PLANES_STAGE_HPP_
#define FERRY_SRC_LOAD_PLANES_STAGE_HPP_

#ifdef FERRY_HAVE_CUDA_KERNELS

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

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
};

// Not thread-safe as a whole: Prepare and Release run with no load in flight; Enqueue may be
// called concurrently for distinct slots.
class PlanesStage {
 public:
  PlanesStage() = default;
  ~PlanesStage();
  PlanesStage(const PlanesStage&) = delete;
  PlanesStage& operator=(const PlanesStage&) = delete;

  // Device slots of `slot_bytes` each, in the current context `ctx` (the caller's device).
  // Idempotent for the same context and sizes; a new context releases the old resources.
  Status Prepare(CUcontext ctx, size_t nslots, size_t slot_bytes, const std::string& where);
  void Release();

  // Enqueues the copy of host slot bytes [0, bytes) to device slot `k` and the decode of
  // `blocks` on `stream`, which also orders every later use of both slots: record the slot's
  // event on `stream` after this call.
  Status Enqueue(size_t k, const uint8_t* host, size_t bytes,
                 const std::vector<PlanesStaged>& blocks, uint32_t* errors, cudaStream_t stream,
                 const std::string& where);

  // Per-load device error array of n entries (zeroed on `stream`), and its host copy, filled
  // by FetchErrors, which waits (on an event of its own) until `stream` has passed the
  // decodes.
  Status StartLoad(size_t n, cudaStream_t stream, const std::string& where);
  uint32_t* device_errors() const { return errors_; }
  Status FetchErrors(cudaStream_t stream, std::vector<uint32_t>* out, const std::string& where);

 private:
  CUcontext ctx_ = nullptr;
  uint8_t* slots_ = nullptr;
  size_t nslots_ = 0, slot_bytes_ = 0;
  cudaStream_t copy_ = nullptr;
  std::vector<cudaEvent_t> copied_;
  cudaEvent_t fetched_ = nullptr;  // recorded after the copy of a load's errors
  uint32_t* errors_ = nullptr;
  uint32_t* host_errors_ = nullptr;
  size_t errors_cap_ = 0;
};

}  // namespace ferry

#endif  // FERRY_HAVE_CUDA_KERNELS
#endif  // FERRY_SRC_LOAD_PLANES_STAGE_HPP_
