// The loader's plan: requests resolved against the block source in file order, cut into
// pieces, and, for a device load, routed (DMA straight from the registered mapping, or through
// the staging ring) and grouped into batches of one staging slot each. Pure computation: no
// I/O except the page-cache residency sample that chooses direct I/O, no CUDA.
#ifndef FERRY_SRC_LOAD_LOAD_PLAN_HPP_
#define FERRY_SRC_LOAD_LOAD_PLAN_HPP_

#include <cstdint>
#include <vector>

#include "ferry/loader.hpp"
#include "format/block_source.hpp"
#include "io/io.hpp"

namespace ferry {

// Room past a slot's slot_bytes for aligning a direct read's start and end.
inline constexpr uint64_t kSlotSlack = 2 * kDirectAlign;

// One request, resolved, and where its bytes go.
struct Resolved : Extent {
  uint8_t* dst = nullptr;
  // Destinations with the same id belong to one allocation; a single DMA may only span
  // pieces of one allocation (adjacent cudaMalloc blocks are not one copyable range).
  uint64_t alloc_id = 0;
};

// What a load reads.
struct LoadPlan {
  std::vector<Resolved> res;  // in request order (all tensors, in name order, when none)
  std::vector<size_t> order;  // indices into `res` in file order, so reads stream
  uint64_t bytes() const;
};

// Resolves `requests` (every tensor when empty), checking the caller's destination sizes.
Result<LoadPlan> Resolve(const BlockSource& source, const std::vector<LoadRequest>& requests);

// Workers for a load: the whole pool when most bytes need decoding, else at most 8 (more
// measured slower on an H200 host: the copy is memory bound), or 12 for a one-shot load (the
// first from a file mapping, whose first pass over the file costs more CPU).
int ActiveWorkers(const LoadPlan& plan, int pool_size, bool one_shot = false);

// An O_DIRECT file when `io` asks for direct reads (kAuto: a cold load larger than half of
// MemAvailable), else a closed one (the page-cache path).
DirectFile OpenDirect(const BlockSource& source, const LoadPlan& plan, IoMode io);

// A run of raw bytes of one resolved request.
struct Piece {
  uint32_t r;        // index into LoadPlan::res
  uint64_t begin;    // raw byte offset within the tensor
  uint64_t len;      //
  uint64_t dst_off;  // offset within the request's destination
  uint64_t soff;     // offset within its staging slot
};

// Every request cut into pieces of at most `max_piece` bytes, in file order. Boundaries fall
// on multiples of the piece size within the tensor, so blocks are handled whole whenever the
// piece size divides the block size. With `whole_encoded_blocks` (loads with no slot to fit),
// encoded tensors are cut at their blocks whatever `max_piece`: a piece that cuts a block
// decodes all of it, so 1 MiB pieces of 4 MiB blocks measured 3x slower.
std::vector<Piece> MakePieces(const LoadPlan& plan, uint64_t max_piece,
                              bool whole_encoded_blocks = false);

// Pieces that fill one staging slot.
struct Batch {
  uint32_t first, last;  // pieces [first, last)
  // Direct batches: one O_DIRECT read of file bytes [span_begin, span_begin + span_len) into
  // the slot; each piece then sits at its file offset minus span_begin.
  bool direct = false;
  uint64_t span_begin = 0, span_len = 0;
  // Whole PLANES blocks whose stored bytes go to the device, which expands them; each piece's
  // stored bytes sit at its soff (256-byte aligned).
  bool planes = false;
};

// Pieces copied straight from the mapping, with the page range to register around them
// (empty when the whole mapping is registered).
struct Group {
  uint32_t first, last;
  uint64_t reg_begin, reg_end;
};

// Which way a device load's raw pieces go.
struct DeviceRoute {
  bool from_mapping = false;  // DMA from the registered page cache
  bool windows = false;       // ... registered one window at a time
  bool cold = false;          // read with O_DIRECT into the ring
  uint64_t slot_bytes = 0;
  uint64_t window_bytes = 0;
  // Set when the device decodes PLANES blocks: whole PLANES-coded blocks of this source then
  // travel compressed, in their own batches, after every other batch.
  const BlockSource* planes_source = nullptr;
};

// A device load's pieces by route: `mapped` in `groups` (DMA from the mapping); `staged` in
// `batches` (filled into ring slots by the CPU, or by one direct read per batch); PLANES
// pieces for the device are staged[planes_first, end), in the last batches.
struct DevicePlan {
  std::vector<Piece> mapped;
  std::vector<Group> groups;
  std::vector<Piece> staged;
  std::vector<Batch> batches;
  uint32_t planes_first = 0;
  uint32_t planes_count() const { return static_cast<uint32_t>(staged.size()) - planes_first; }
};

// Whole PLANES-coded block b of tensor i: the piece [begin, begin + len) of a PLANES tensor
// covers exactly one block stored with ChunkCodec PLANES.
bool DevicePlanesPiece(const BlockSource& source, size_t i, uint64_t begin, uint64_t len);
DevicePlan PlanDevice(const LoadPlan& plan, const DeviceRoute& route);

}  // namespace ferry

#endif  // FERRY_SRC_LOAD_LOAD_PLAN_HPP_
