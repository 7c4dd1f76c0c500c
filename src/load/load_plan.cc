// The loader's plan (src/load/load_plan.hpp).
#include "load/load_plan.hpp"

#include <algorithm>
#include <utility>

#include "base/util.hpp"
#include "cuda/device_alloc.hpp"

namespace ferry {

namespace {

// Copy-bound loads (raw tensors) run on at most this many workers; see LoaderOptions::threads.
constexpr int kCopyWorkers = 8;
// A one-shot load (the first a loader makes from a file mapping) runs copy-bound work on this
// many: in fresh processes on an H200 host, 12 workers reached 38-39 GB/s where 8 reached
// 31-33 (/dev/shm) and 36-39 (page cache); the page lookups of a first pass over the file are
// CPU work the warm steady state does not have (benchmarks/README.md).
constexpr int kOneShotCopyWorkers = 12;
// Below this resident fraction a load counts as cold and takes direct I/O (IoMode::kAuto).
constexpr double kColdFraction = 0.5;

// IoMode::kAuto. Direct reads pay off when the page cache cannot help: the data is cold AND
// larger than half the memory the cache could use, so caching it would only evict other
// data. Below that, buffered reads with kernel readahead measured as fast or faster than
// O_DIRECT on the H200 host's virtual disk (benchmarks/README.md), and they leave the file
// cached for the next process.
bool WantDirect(const BlockSource& source, const LoadPlan& plan) {
  uint64_t avail = AvailableMemory();
  if (avail == 0 || plan.bytes() <= avail / 2) return false;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  ranges.reserve(plan.res.size());
  for (const Resolved& x : plan.res) ranges.emplace_back(x.file_offset(), x.len);
  return source.mapping()->ResidentFraction(ranges) < kColdFraction;
}

// Groups consecutive pieces into batches that fit one staging slot, packed at 64 bytes.
void AppendBatches(std::vector<Piece>& pieces, uint32_t first, uint32_t last, uint64_t slot_bytes,
                   std::vector<Batch>* batches) {
  uint64_t used = 0;
  bool open = false;
  for (uint32_t i = first; i < last; ++i) {
    uint64_t need = AlignUp(pieces[i].len, 64);
    if (!open || used + need > slot_bytes) {
      batches->push_back(Batch{i, i + 1});
      used = 0;
      open = true;
    } else {
      batches->back().last = i + 1;
    }
    pieces[i].soff = used;
    used += need;
  }
}

// Groups consecutive raw pieces (file order) into direct batches whose aligned file span fits
// one slot; gaps between the pieces are read too, which is cheaper than another request.
void AppendDirectBatches(std::vector<Piece>& pieces, uint32_t first, uint32_t last,
                         const std::vector<Resolved>& res, uint64_t slot_bytes,
                         std::vector<Batch>* batches) {
  auto file_off = [&](const Piece& p) { return res[p.r].info.data_offset + p.begin; };
  uint32_t i = first;
  while (i < last) {
    uint64_t span_begin = file_off(pieces[i]) / kDirectAlign * kDirectAlign;
    uint32_t j = i;
    uint64_t span_end = span_begin;
    while (j < last) {
      uint64_t b = file_off(pieces[j]);
      uint64_t e = AlignUp(b + pieces[j].len, kDirectAlign);
      if (b < span_begin || (j > i && std::max(span_end, e) - span_begin > slot_bytes)) break;
      span_end = std::max(span_end, e);
      pieces[j].soff = b - span_begin;
      ++j;
    }
    Batch batch{i, j};
    batch.direct = true;
    batch.span_begin = span_begin;
    batch.span_len = span_end - span_begin;
    batches->push_back(batch);
    i = j;
  }
}

// One group per piece, or, for windows, runs of pieces whose registered page range reaches
// `window_bytes`. Windows never share a page: a page registered twice is an error.
std::vector<Group> MakeGroups(const std::vector<Piece>& pieces, const std::vector<Resolved>& res,
                              bool windows, uint64_t window_bytes) {
  std::vector<Group> groups;
  for (uint32_t i = 0; i < pieces.size(); ++i) {
    if (!windows) {
      groups.push_back(Group{i, i + 1, 0, 0});
      continue;
    }
    const Piece& p = pieces[i];
    uint64_t off = res[p.r].info.data_offset + p.begin;
    uint64_t pb = off / kDirectAlign * kDirectAlign, pe = AlignUp(off + p.len, kDirectAlign);
    Group* g = groups.empty() ? nullptr : &groups.back();
    if (g != nullptr && (pb < g->reg_end || g->reg_end - g->reg_begin < window_bytes)) {
      g->last = i + 1;
      g->reg_end = std::max(g->reg_end, pe);
    } else {
      groups.push_back(Group{i, i + 1, pb, pe});
    }
  }
  return groups;
}

}  // namespace

uint64_t LoadPlan::bytes() const {
  uint64_t total = 0;
  for (const Resolved& r : res) total += r.len;
  return total;
}

Result<LoadPlan> Resolve(const BlockSource& source, const std::vector<LoadRequest>& requests) {
  LoadPlan plan;
  std::vector<Resolved>& out = plan.res;
  out.resize(requests.empty() ? source.size() : requests.size());
  for (size_t k = 0; k < out.size(); ++k) {
    if (requests.empty()) {
      FERRY_ASSIGN_OR_RETURN(static_cast<Extent&>(out[k]), source.Locate(k));
      continue;
    }
    const LoadRequest& q = requests[k];
    FERRY_ASSIGN_OR_RETURN(static_cast<Extent&>(out[k]),
                           source.Locate(q.name, q.row_begin, q.row_end));
    if (q.dst != nullptr && q.dst_bytes < out[k].len) {
      return Error(StatusCode::kInvalidArgument, source.Where(out[k].tensor), ": needs ",
                   out[k].len, " bytes, destination holds ", q.dst_bytes);
    }
    out[k].dst = static_cast<uint8_t*>(q.dst);
  }
  plan.order.resize(out.size());
  for (size_t k = 0; k < out.size(); ++k) plan.order[k] = k;
  std::stable_sort(plan.order.begin(), plan.order.end(),
                   [&](size_t a, size_t b) { return out[a].file_offset() < out[b].file_offset(); });
  return plan;
}

int ActiveWorkers(const LoadPlan& plan, int pool_size, bool one_shot) {
  uint64_t total = 0, encoded = 0;
  for (const Resolved& r : plan.res) {
    total += r.len;
    if (r.info.encoding != Encoding::kRaw) encoded += r.len;
  }
  return encoded * 2 > total ? pool_size
                             : std::min(pool_size, one_shot ? kOneShotCopyWorkers : kCopyWorkers);
}

DirectFile OpenDirect(const BlockSource& source, const LoadPlan& plan, IoMode io) {
  // Without a mapping there is no residency to sample, and the source may not be a local
  // file at all: its own reads are the only path.
  if (source.mapping() == nullptr) return DirectFile();
  if (io == IoMode::kDirect || (io == IoMode::kAuto && WantDirect(source, plan))) {
    return DirectFile::Open(source.path());
  }
  return DirectFile();
}

std::vector<Piece> MakePieces(const LoadPlan& plan, uint64_t max_piece, bool whole_encoded_blocks) {
  std::vector<Piece> pieces;
  for (size_t k : plan.order) {
    const Resolved& r = plan.res[k];
    uint64_t step = max_piece;
    if (r.info.block_size > 0) {
      const bool whole = whole_encoded_blocks && r.info.encoding != Encoding::kRaw;
      step = whole ? r.info.block_size : std::min(step, r.info.block_size);
    }
    uint64_t pos = r.begin, end = r.begin + r.len;
    while (pos < end) {
      uint64_t next = std::min(end, (pos / step + 1) * step);
      pieces.push_back(Piece{static_cast<uint32_t>(k), pos, next - pos, pos - r.begin, 0});
      pos = next;
    }
  }
  return pieces;
}

bool DevicePlanesPiece(const BlockSource& source, size_t i, uint64_t begin, uint64_t len) {
  const TensorRecord t = source.Record(i);
  if (len == 0 || t.encoding != Encoding::kPlanes) return false;
  const uint64_t bs = t.block_size;
  if (begin % bs != 0) return false;
  const StoredBlock s = source.Block(i, begin / bs);
  return s.planes && s.raw_size == len;
}

DevicePlan PlanDevice(const LoadPlan& plan, const DeviceRoute& route) {
  DevicePlan out;
  std::vector<Piece> cold_raw, planes;
  for (const Piece& p : MakePieces(plan, route.slot_bytes)) {
    bool raw = plan.res[p.r].info.encoding == Encoding::kRaw;
    if (route.planes_source != nullptr &&
        DevicePlanesPiece(*route.planes_source, plan.res[p.r].tensor, p.begin, p.len)) {
      planes.push_back(p);
    } else if (route.from_mapping && raw) {
      out.mapped.push_back(p);
    } else if (route.cold && raw) {
      cold_raw.push_back(p);
    } else {
      out.staged.push_back(p);
    }
  }
  // Filled batches first, then the direct reads of raw pieces.
  const auto nfill = static_cast<uint32_t>(out.staged.size());
  out.staged.insert(out.staged.end(), cold_raw.begin(), cold_raw.end());
  AppendBatches(out.staged, 0, nfill, route.slot_bytes, &out.batches);
  AppendDirectBatches(out.staged, nfill, static_cast<uint32_t>(out.staged.size()), plan.res,
                      route.slot_bytes + kSlotSlack, &out.batches);
  out.groups = MakeGroups(out.mapped, plan.res, route.windows, route.window_bytes);
  // PLANES batches, packed by stored size at the decoder's source alignment (kDeviceAlign).
  out.planes_first = static_cast<uint32_t>(out.staged.size());
  out.staged.insert(out.staged.end(), planes.begin(), planes.end());
  uint64_t used = 0;
  const uint64_t cap = route.slot_bytes + kSlotSlack;
  for (uint32_t i = out.planes_first; i < out.staged.size(); ++i) {
    Piece& p = out.staged[i];
    const uint64_t bs = route.planes_source->Record(plan.res[p.r].tensor).block_size;
    const uint64_t need = AlignUp(
        route.planes_source->Block(plan.res[p.r].tensor, p.begin / bs).stored_size, kDeviceAlign);
    if (i == out.planes_first || used + need > cap) {
      Batch b{i, i + 1};
      b.planes = true;
      out.batches.push_back(b);
      used = 0;
    } else {
      out.batches.back().last = i + 1;
    }
    p.soff = used;
    used += need;
  }
  return out;
}

}  // namespace ferry
