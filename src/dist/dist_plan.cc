// The distributed load's plan (dist_plan.hpp): moved here from distributed.cc so that plans
// made for NCCL and for the C API's own collectives are one and the same.
#include "dist/dist_plan.hpp"

#include <algorithm>
#include <tuple>

#include "base/util.hpp"
#include "codec/codec.hpp"
#include "format/block_source.hpp"

namespace ferry {

PlanSource SourceOf(const Reader& reader) {
  PlanSource s;
  s.shards.push_back(&reader);
  s.find = [&reader](std::string_view name) -> Result<std::pair<uint32_t, size_t>> {
    FERRY_ASSIGN_OR_RETURN(size_t i, BlocksOf(reader).Lookup(name));
    return std::make_pair(uint32_t{0}, i);
  };
  s.names = [&reader] { return reader.names(); };
  s.path = reader.path();
  return s;
}

PlanSource SourceOf(const ShardedCheckpoint& ck) {
  PlanSource s;
  for (size_t i = 0; i < ck.num_shards(); ++i) s.shards.push_back(ck.shard(i).get());
  s.find = [&ck](std::string_view name) -> Result<std::pair<uint32_t, size_t>> {
    FERRY_ASSIGN_OR_RETURN(auto loc, ck.Find(name));
    return std::make_pair(static_cast<uint32_t>(loc.shard), loc.info.index);
  };
  s.names = [&ck] { return ck.names(); };
  s.path = ck.path();
  return s;
}

Status ResolvePlan(const PlanSource& src, const std::vector<DistributedRequest>& requests,
                   std::vector<PlanEntry>* items, std::vector<size_t>* locals) {
  auto add = [&](size_t k, std::string_view name, int64_t row_begin, int64_t row_end, void* dst,
                 uint64_t dst_bytes) -> Status {
    FERRY_ASSIGN_OR_RETURN(auto where, src.find(name));
    const BlockSource& r = BlocksOf(*src.shards[where.first]);
    FERRY_ASSIGN_OR_RETURN(Extent e, r.Locate(where.second, row_begin, row_end));
    PlanEntry m;
    m.request = k;
    m.shard = where.first;
    m.tensor = e.tensor;
    m.whole = row_begin == 0 && row_end < 0;
    m.row0 = m.whole ? 0 : row_begin;
    m.len = e.len;
    m.file_begin = e.file_offset();
    // Cut only where the Loader can start a row range: a row must start on a byte. A tensor
    // of one row is not cut.
    if (!m.whole || (!e.info.shape.empty() && e.info.shape[0] > 1)) {
      auto one = r.RowRange(m.tensor, 0, 1);
      if (one.ok() && one->second < r.RawSize(m.tensor)) m.row_bytes = one->second;
    }
    m.info = std::move(e.info);
    if (dst != nullptr) {
      if (dst_bytes < m.len) {
        return Error(StatusCode::kInvalidArgument, r.Where(m.tensor), ": needs ", m.len,
                     " bytes, destination holds ", dst_bytes);
      }
      m.caller_dst = static_cast<uint8_t*>(dst);
    }
    items->push_back(std::move(m));
    return Status::Ok();
  };
  if (requests.empty()) {
    std::vector<std::string> names = src.names();
    for (size_t k = 0; k < names.size(); ++k) {
      FERRY_RETURN_IF_ERROR(add(k, names[k], 0, -1, nullptr, 0));
    }
  } else {
    for (size_t k = 0; k < requests.size(); ++k) {
      const DistributedRequest& q = requests[k];
      if (q.local) {
        FERRY_RETURN_IF_ERROR(src.find(q.name).status());  // fail at planning, not later
        locals->push_back(k);
        continue;
      }
      FERRY_RETURN_IF_ERROR(add(k, q.name, q.row_begin, q.row_end, q.dst, q.dst_bytes));
    }
  }
  // File order (per shard) makes every rank's reads stream through the files. The key holds
  // only what every rank shares (not buffer addresses), so all ranks sort alike; items with
  // equal keys are interchangeable for the plan.
  auto key = [](const PlanEntry& m) {
    return std::make_tuple(m.shard, m.file_begin, m.len, std::string_view(m.info.name),
                           m.caller_dst != nullptr);
  };
  std::stable_sort(items->begin(), items->end(),
                   [&](const PlanEntry& a, const PlanEntry& b) { return key(a) < key(b); });
  return Status::Ok();
}

uint64_t PlanHash(const std::vector<PlanEntry>& items, int nranks, int rounds) {
  std::string key = StrCat(nranks, "/", rounds, "/", items.size(), "\n");
  for (const PlanEntry& m : items) {
    key += StrCat(m.shard, " ", m.info.name, " ", m.file_begin, " ", m.len, " ", m.row_bytes, " ",
                  m.caller_dst != nullptr, "\n");
  }
  uint64_t h = Checksum64(key.data(), key.size());
  return h == UINT64_MAX ? h - 1 : h;  // UINT64_MAX marks a rank that failed to plan
}

uint64_t LayOutArena(std::vector<PlanEntry>* items, uint64_t own_min_bytes) {
  DeviceArena arena;
  for (PlanEntry& m : *items) {
    m.in_arena = m.caller_dst == nullptr && m.len > 0 && m.len < own_min_bytes;
    if (m.in_arena) m.arena_off = arena.Place(m.len);
  }
  return arena.bytes;
}

Status AgreeOnPlan(const Status& planned, uint64_t hash, const AllReduceMaxFn& all_reduce_max,
                   const std::string& where, int rank) {
  uint64_t words[2] = {hash, ~hash};
  if (!planned.ok()) words[0] = words[1] = UINT64_MAX;
  FERRY_RETURN_IF_ERROR(all_reduce_max(words, 2));
  if (!planned.ok()) return planned;
  if (words[0] != hash || words[1] != ~hash) {
    return Error(StatusCode::kInvalidArgument, where, ": rank ", rank,
                 ": the ranks disagree on the replicated requests (or another rank failed to "
                 "plan); every rank must request the same tensors and rows, with or without a "
                 "destination alike");
  }
  return Status::Ok();
}

Status AgreeOnOutcome(const Status& mine, const AllReduceMaxFn& all_reduce_max,
                      const std::string& where, int rank) {
  uint64_t words[2] = {mine.ok() ? 0u : 1u, 0};
  FERRY_RETURN_IF_ERROR(all_reduce_max(words, 2));
  if (!mine.ok()) return mine;
  if (words[0] != 0) {
    return Error(StatusCode::kInternal, where, ": rank ", rank,
                 ": another rank failed this distributed load (its error says why)");
  }
  return Status::Ok();
}

std::vector<PlanPiece> SplitEntries(const std::vector<PlanEntry>& items, int nranks, int rounds) {
  std::vector<PlanItem> plan_items(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    plan_items[i] = PlanItem{items[i].len, items[i].row_bytes};
  }
  return SplitPlan(plan_items, nranks, rounds);
}

std::vector<std::vector<PlanBroadcast>> PlanBroadcasts(const std::vector<PlanEntry>& items,
                                                       const std::vector<PlanPiece>& pieces,
                                                       int nranks, int rounds) {
  std::vector<std::vector<PlanBroadcast>> ops(static_cast<size_t>(nranks) * rounds);
  for (const PlanPiece& p : pieces) {
    const PlanEntry& m = items[p.item];
    std::vector<PlanBroadcast>& seg_ops = ops[p.segment];
    if (m.in_arena && !seg_ops.empty() && seg_ops.back().arena) {
      PlanBroadcast& last = seg_ops.back();
      const uint64_t end = items[last.item].arena_off + last.begin + last.bytes;
      const uint64_t at = m.arena_off + p.begin;
      if (at >= end && at - end < kArenaAlign) {
        last.bytes = at + p.len - (items[last.item].arena_off + last.begin);
        continue;
      }
    }
    seg_ops.push_back(
        PlanBroadcast{p.item, p.begin, p.len, static_cast<int>(p.segment / rounds), m.in_arena});
  }
  return ops;
}

std::vector<std::vector<const PlanPiece*>> PiecesOf(const std::vector<PlanPiece>& pieces, int rank,
                                                    int rounds) {
  std::vector<std::vector<const PlanPiece*>> mine(rounds);
  for (const PlanPiece& p : pieces) {
    if (static_cast<int>(p.segment / rounds) == rank) mine[p.segment % rounds].push_back(&p);
  }
  return mine;
}

std::pair<int64_t, int64_t> PieceRows(const PlanEntry& m, const PlanPiece& p) {
  if (p.begin == 0 && p.len == m.len) {
    if (m.whole) return {0, -1};
    return {m.row0, m.row0 + m.info.shape[0]};
  }
  // SplitPlan cuts inside an item only on row boundaries.
  const int64_t begin = m.row0 + static_cast<int64_t>(p.begin / m.row_bytes);
  return {begin, begin + static_cast<int64_t>(p.len / m.row_bytes)};
}

Result<DistPlan> MakeDistPlan(const PlanSource& src,
                              const std::vector<DistributedRequest>& requests, int rank, int nranks,
                              int rounds, uint64_t own_min_bytes, const AllReduceMaxFn* check) {
  DistPlan plan;
  Status planned = ResolvePlan(src, requests, &plan.items, &plan.locals);
  if (check != nullptr) {
    const uint64_t hash = planned.ok() ? PlanHash(plan.items, nranks, rounds) : 0;
    FERRY_RETURN_IF_ERROR(AgreeOnPlan(planned, hash, *check, src.path, rank));
  }
  FERRY_RETURN_IF_ERROR(planned);
  plan.arena_bytes = LayOutArena(&plan.items, own_min_bytes);
  plan.pieces = SplitEntries(plan.items, nranks, rounds);
  plan.broadcasts = PlanBroadcasts(plan.items, plan.pieces, nranks, rounds);
  return plan;
}

Result<std::vector<StoredRange>> StoredRangesOf(const PlanSource& src,
                                                const std::vector<PlanEntry>& items,
                                                const std::vector<PlanPiece>& pieces, int rank,
                                                int rounds) {
  std::vector<StoredRange> out;
  for (const auto& round : PiecesOf(pieces, rank, rounds)) {
    for (const PlanPiece* p : round) {
      const PlanEntry& m = items[p->item];
      const BlockSource& r = BlocksOf(*src.shards[m.shard]);
      auto [row_begin, row_end] = PieceRows(m, *p);
      FERRY_ASSIGN_OR_RETURN(Extent e, r.Locate(m.tensor, row_begin, row_end));
      const uint64_t begin = e.begin, end = e.begin + e.len;
      const uint64_t blocks = r.NumBlocks(m.tensor);
      // The first block that ends after `begin` (blocks lie in raw order).
      uint64_t lo = 0, hi = blocks;
      while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        StoredBlock b = r.Block(m.tensor, mid);
        if (b.raw_offset + b.raw_size <= begin) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      for (uint64_t k = lo; k < blocks; ++k) {
        StoredBlock b = r.Block(m.tensor, k);
        if (b.raw_offset >= end) break;
        if (b.compressed || b.planes) {
          out.push_back({m.shard, b.file_offset, b.file_offset + b.stored_size});
        } else {
          uint64_t from = std::max(begin, b.raw_offset) - b.raw_offset;
          uint64_t to = std::min(end, b.raw_offset + b.raw_size) - b.raw_offset;
          out.push_back({m.shard, b.file_offset + from, b.file_offset + to});
        }
      }
    }
  }
  std::sort(out.begin(), out.end(), [](const StoredRange& a, const StoredRange& b) {
    return std::tie(a.shard, a.begin, a.end) < std::tie(b.shard, b.begin, b.end);
  });
  std::vector<StoredRange> joined;
  for (const StoredRange& x : out) {
    if (x.begin == x.end) continue;
    if (!joined.empty() && joined.back().shard == x.shard && x.begin <= joined.back().end) {
      joined.back().end = std::max(joined.back().end, x.end);
    } else {
      joined.push_back(x);
    }
  }
  return joined;
}

}  // namespace ferry
