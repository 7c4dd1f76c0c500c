// Distributed loading: every rank of an NCCL communicator receives a checkpoint's tensors while
// each byte is read from storage, and crosses a host-to-device link, on one rank only. The
// other ranks get it over NVLink (or whatever the communicator uses) with NCCL broadcasts.
//
//   ncclComm_t comm = ...;                    // the caller's, one rank per GPU, created as usual
//   auto loader = ferry::DistributedLoader::Create(comm).value();
//   auto reader = ferry::Reader::Open("model.ferry").value();
//   auto tensors = loader->Load(*reader, {}, stream).value();   // every tensor, on every rank
//
// How the work is split: the replicated tensors are laid out in file order as one sequence of
// bytes and cut into nranks equal parts (at row boundaries of dimension 0, so a large tensor
// may be read by two ranks); rank r reads part r with the normal Loader pipeline (pinned ring,
// O_DIRECT for cold files) straight into its final place, then grouped ncclBroadcast calls
// deliver every part to every rank. The parts are further cut into `rounds` pieces so that the
// broadcasts of one piece overlap the reads of the next. A request marked `local` (a rank's
// tensor-parallel slice) is read by that rank alone and causes no NCCL traffic.
// See docs/DISTRIBUTED.md for when this wins.
//
// Device rules: as for Loader (ferry/loader.hpp). All memory, copies and collectives are on the
// communicator's device, which must be the calling thread's current device; no other GPU is
// touched. Results are ordered on the caller's `stream`: the work starts after what `stream`
// already holds, and `stream` waits for all of it. Broadcasts run on an internal stream of the
// same device (created by Create), so that they overlap the host-to-device copies, which run on
// `stream` itself.
//
// Collective calls: LoadAsync and Load are collective over the communicator: every rank must
// call them in the same order relative to its other NCCL calls on that communicator, with the
// same checkpoint and the same replicated requests (in any order). Local requests may differ
// from rank to rank. With DistributedOptions::check_plan (the default) the ranks compare a hash
// of their plans first, so a mismatch (or a rank that failed to plan) is an error on every rank
// instead of a hang.
//
// NCCL is not a link-time dependency: the library finds the process's NCCL at Create (the one
// already loaded, else dlopen of "libnccl.so.2" or DistributedOptions::nccl_library), so
// libferry loads on machines without NCCL and uses the same NCCL as the caller's communicator.
//
// Handles and threads: a DistributedLoader is owned by its creator (std::unique_ptr); it
// borrows `comm`, which must outlive it. Calls on one DistributedLoader are serialized
// internally. Destroy it before the CUDA context goes away (not from static destructors).
#ifndef FERRY_DISTRIBUTED_HPP_
#define FERRY_DISTRIBUTED_HPP_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ferry/loader.hpp"
#include "ferry/sharded.hpp"

// NCCL's handle: `typedef struct ncclComm* ncclComm_t;` in nccl.h. Declared here so that callers
// pass their ncclComm_t unchanged without this header including nccl.h.
struct ncclComm;

namespace ferry {

using NcclComm = ::ncclComm*;

struct DistributedOptions {
  // The per-rank pipeline (staging ring, threads, I/O mode, verify).
  LoaderOptions loader;
  // Pieces per rank. Round k's broadcasts run while round k + 1 is read; 1 disables the overlap.
  int rounds = 4;
  // Before enqueuing anything, all-reduce a 16-byte hash of the collective plan and fail on
  // every rank if the ranks disagree. Waits for that one small all-reduce (not for `stream`).
  bool check_plan = true;
  // NCCL library to dlopen when none is loaded in the process yet; empty: "libnccl.so.2".
  std::string nccl_library;
};

// One tensor, or rows [row_begin, row_end) of dimension 0 of one, as for LoadRequest.
struct DistributedRequest {
  std::string name;
  int64_t row_begin = 0;
  int64_t row_end = -1;  // -1: through the last row
  // Optional destination on the current device, holding dst_bytes >= the bytes requested.
  void* dst = nullptr;
  uint64_t dst_bytes = 0;
  // false: every rank receives these rows (and every rank must request them).
  // true: only this rank needs them (its tensor-parallel slice); read locally, no collective.
  bool local = false;
};

// Figures of the last call on this rank.
struct DistributedStats {
  int rank = 0;
  int nranks = 1;
  uint64_t bytes = 0;           // raw bytes delivered to this rank (replicated + local)
  uint64_t bytes_read = 0;      // of those, bytes this rank read from storage
  uint64_t bytes_received = 0;  // of those, bytes received from other ranks
  uint64_t broadcasts = 0;      // ncclBroadcast calls
  bool used_direct_io = false;  // some of this rank's reads used O_DIRECT
  double seconds = 0;           // wall time of the call
};

class FERRY_API DistributedLoader {
 public:
  // `comm` is the caller's communicator; its device must be the current device.
  static Result<std::unique_ptr<DistributedLoader>> Create(NcclComm comm,
                                                           DistributedOptions options = {});
  ~DistributedLoader();
  DistributedLoader(const DistributedLoader&) = delete;
  DistributedLoader& operator=(const DistributedLoader&) = delete;

  // Enqueues reads, copies and broadcasts and returns once they are enqueued; the tensors are
  // ready once `stream` reaches this point. Empty `requests`: every tensor, replicated.
  // Results follow the order of `requests` (of the checkpoint's names when empty). Memory the
  // loader allocates (through `allocator`, else cudaMallocAsync on `stream`) holds all the
  // replicated tensors of one call in one allocation: each LoadedTensor::owner keeps it alive.
  // Local requests without `dst` are allocated per tensor, as Loader does.
  // If this rank fails after its collectives were planned, it still enqueues them (so the
  // others do not hang) and returns the error; the other ranks cannot tell from LoadAsync:
  // use Load, or agree on success yourself, before trusting the data.
  Result<std::vector<LoadedTensor>> LoadAsync(const Reader& reader,
                                              const std::vector<DistributedRequest>& requests,
                                              Stream stream = nullptr,
                                              const DeviceAllocator* allocator = nullptr);
  Result<std::vector<LoadedTensor>> LoadAsync(const ShardedCheckpoint& checkpoint,
                                              const std::vector<DistributedRequest>& requests,
                                              Stream stream = nullptr,
                                              const DeviceAllocator* allocator = nullptr);
  // As LoadAsync, then all ranks agree on success (a failure on any rank fails the call on every
  // rank) and `stream` is synchronized.
  Result<std::vector<LoadedTensor>> Load(const Reader& reader,
                                         const std::vector<DistributedRequest>& requests,
                                         Stream stream = nullptr,
                                         const DeviceAllocator* allocator = nullptr);
  Result<std::vector<LoadedTensor>> Load(const ShardedCheckpoint& checkpoint,
                                         const std::vector<DistributedRequest>& requests,
                                         Stream stream = nullptr,
                                         const DeviceAllocator* allocator = nullptr);

  int rank() const;
  int nranks() const;
  // The CUDA device of the communicator.
  int device() const;
  DistributedStats last_stats() const;

  class Impl;

 private:
  explicit DistributedLoader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The split itself, exposed for tests and tools; needs no GPU. Given the replicated items in
// canonical order (each a byte length and, when it may be cut between rows, its row size), cuts
// their concatenation into nranks * rounds contiguous segments of near-equal size, each cut on a
// row boundary (or an item boundary for items that cannot be cut). Piece p covers item
// `item`'s bytes [begin, begin + len) and belongs to segment `segment` (rank = segment / rounds,
// round = segment % rounds). Items of zero bytes yield no piece.
struct PlanItem {
  uint64_t bytes = 0;
  uint64_t row_bytes = 0;  // 0: cannot be cut
};
struct PlanPiece {
  uint32_t item = 0;
  uint32_t segment = 0;
  uint64_t begin = 0;
  uint64_t len = 0;
};
FERRY_API std::vector<PlanPiece> SplitPlan(const std::vector<PlanItem>& items, int nranks,
                                           int rounds);

// A SaveGroup (sharded.hpp) over the caller's NCCL communicator, for ShardedSave: rank and size
// are the communicator's, and all_reduce_max is an ncclAllReduce on a stream of the library's
// own, on the communicator's device (which must be current at this call), with a few bytes of
// device memory made here; it waits for that stream only. The group borrows `comm`, which
// must outlive every copy of it; its calls, like every NCCL call, must come in the same order
// on every rank. Unimplemented without CUDA or NCCL (found at run time as for
// DistributedLoader).
FERRY_API Result<SaveGroup> NcclSaveGroup(NcclComm comm, const std::string& nccl_library = "");

}  // namespace ferry

#endif  // FERRY_DISTRIBUTED_HPP_
