// The plan of a distributed load, apart from the collectives that carry it out: which tensors
// every rank receives (in file order), where each lands (one shared arena or a buffer of its
// own), which pieces each rank reads and which broadcasts deliver them, and the agreement of
// the ranks on all of it. DistributedLoader (NCCL) and the C API's ferry_dist_plan_t (bindings
// that run their own collectives, such as torch.distributed) share it, so every rank of either
// kind computes the same plan from the same checkpoint.
#ifndef FERRY_SRC_DIST_DIST_PLAN_HPP_
#define FERRY_SRC_DIST_DIST_PLAN_HPP_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cuda/device_alloc.hpp"
#include "ferry/distributed.hpp"
#include "ferry/sharded.hpp"

namespace ferry {

// Broadcasts of arena pieces join across padding shorter than this, and arena entries start
// on it.
inline constexpr uint64_t kArenaAlign = kDeviceAlign;

// What the plan needs to know of the checkpoint: its shards and a name lookup.
struct PlanSource {
  std::vector<const Reader*> shards;
  std::function<Result<std::pair<uint32_t, size_t>>(std::string_view)> find;
  std::function<std::vector<std::string>()> names;
  std::string path;
};

// Both borrow their argument, which must outlive the source.
PlanSource SourceOf(const Reader& reader);
PlanSource SourceOf(const ShardedCheckpoint& checkpoint);

// One replicated request, resolved.
struct PlanEntry {
  size_t request = 0;  // index into the caller's requests (or the names list)
  uint32_t shard = 0;
  size_t tensor = 0;
  TensorInfo info;          // shape already narrowed to the requested rows
  int64_t row0 = 0;         // first requested row (0 for whole tensors)
  bool whole = true;        // no row range was requested
  uint64_t file_begin = 0;  // file offset of the first requested byte, for ordering
  uint64_t len = 0;
  uint64_t row_bytes = 0;  // 0: not cut between rows
  uint8_t* caller_dst = nullptr;
  bool in_arena = false;  // set by LayOutArena
  uint64_t arena_off = 0;
};

// Resolves `requests` (empty: every tensor, replicated) into the replicated entries, sorted
// into file order, and the indexes of the local ones (checked to exist).
Status ResolvePlan(const PlanSource& src, const std::vector<DistributedRequest>& requests,
                   std::vector<PlanEntry>* items, std::vector<size_t>* locals);

// Places every entry without a destination of its own and with fewer than `own_min_bytes`
// bytes (but some) in one arena, kArenaAlign apart; returns the arena's size.
uint64_t LayOutArena(std::vector<PlanEntry>* items, uint64_t own_min_bytes);

// Hash of everything the ranks must agree on; never UINT64_MAX (which marks a failed plan).
uint64_t PlanHash(const std::vector<PlanEntry>& items, int nranks, int rounds);

// Element-wise maximum of words[0, count) over all ranks.
using AllReduceMaxFn = std::function<Status(uint64_t* words, size_t count)>;

// The plan check: every rank offers its plan's hash (or, when `planned` failed, a mark that it
// failed) and learns whether all agree. Returns the all-reduce's error, then `planned`'s, then
// InvalidArgument when the ranks disagree.
Status AgreeOnPlan(const Status& planned, uint64_t hash, const AllReduceMaxFn& all_reduce_max,
                   const std::string& where, int rank);

// After a load: every rank learns whether any rank failed. Returns the all-reduce's error,
// then `mine`, then Internal when another rank failed.
Status AgreeOnOutcome(const Status& mine, const AllReduceMaxFn& all_reduce_max,
                      const std::string& where, int rank);

// SplitPlan over the entries' lengths and row sizes.
std::vector<PlanPiece> SplitEntries(const std::vector<PlanEntry>& items, int nranks, int rounds);

// One broadcast from rank `root`: `bytes` from byte `begin` of item `item`'s destination; an
// arena broadcast may run on through the arena entries that follow `item`.
struct PlanBroadcast {
  uint32_t item = 0;
  uint64_t begin = 0;
  uint64_t bytes = 0;
  int root = 0;
  bool arena = false;
};

// The broadcasts of each segment (nranks * rounds of them). Arena pieces of one segment that
// lie in order with less than kArenaAlign bytes between them share one broadcast, however many
// tensors they hold; whether pieces join depends only on the plan, so every rank issues the
// same calls.
std::vector<std::vector<PlanBroadcast>> PlanBroadcasts(const std::vector<PlanEntry>& items,
                                                       const std::vector<PlanPiece>& pieces,
                                                       int nranks, int rounds);

// The pieces `rank` reads, by round.
std::vector<std::vector<const PlanPiece*>> PiecesOf(const std::vector<PlanPiece>& pieces, int rank,
                                                    int rounds);

// The LoadRequest row range that reads piece `p` of entry `m` (0, -1: the whole tensor).
std::pair<int64_t, int64_t> PieceRows(const PlanEntry& m, const PlanPiece& p);

// A whole plan, for callers that run the collectives themselves.
struct DistPlan {
  std::vector<PlanEntry> items;
  std::vector<size_t> locals;
  uint64_t arena_bytes = 0;
  std::vector<PlanPiece> pieces;
  std::vector<std::vector<PlanBroadcast>> broadcasts;  // per segment
};

// Stored bytes [begin, end) of one shard's file.
struct StoredRange {
  uint32_t shard = 0;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// The stored bytes a rank's pieces are read from, sorted by shard and offset, neighbours
// joined: of a raw block, exactly the bytes of its rows; an encoded block whole (so a block cut
// between two ranks is fetched by both). A rank whose checkpoint is remote requests these from
// the server, besides the opening request and the footer every rank reads; with block
// verification on, the raw blocks cut by a piece are read whole too, which is not counted here.
Result<std::vector<StoredRange>> StoredRangesOf(const PlanSource& src,
                                                const std::vector<PlanEntry>& items,
                                                const std::vector<PlanPiece>& pieces, int rank,
                                                int rounds);

// Resolve, lay out, check (when `check` is set: AgreeOnPlan through it) and split.
Result<DistPlan> MakeDistPlan(const PlanSource& src,
                              const std::vector<DistributedRequest>& requests, int rank, int nranks,
                              int rounds, uint64_t own_min_bytes, const AllReduceMaxFn* check);

}  // namespace ferry

#endif  // FERRY_SRC_DIST_DIST_PLAN_HPP_
