// The loader's plan (src/load/load_plan.hpp) and the block source it reads through
// (src/format/block_source.hpp): pure computation, checked on a small checkpoint.
#include "load/load_plan.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "test_util.hpp"

namespace ferry {
namespace {

using testing::RandomBytes;
using testing::TempDir;

constexpr uint64_t kBlock = 16 << 10;

class LoadPlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string path = dir_.File("plan.ferry");
    WriterOptions wo;
    wo.block_size = kBlock;
    auto w = Writer::Create(path, wo);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    Add(*w, "a_raw", {100, 1000}, Encoding::kRaw, 1);  // 400,000 bytes: 25 blocks
    Add(*w, "b_zstd", {50, 1000}, Encoding::kZstd, 2);
    for (int i = 0; i < 20; ++i)
      Add(*w, "c_small/" + std::to_string(i), {3 + i}, Encoding::kRaw, 3);
    ASSERT_TRUE(w->Commit().ok());
    auto r = Reader::Open(path);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    reader_ = *r;
  }

  void Add(Writer& w, const std::string& name, std::vector<int64_t> shape, Encoding enc,
           uint64_t seed) {
    uint64_t n = *StorageBytes(DType::kF32, *NumElements(shape));
    std::vector<uint8_t> bytes = RandomBytes(n, seed);
    for (size_t i = 0; enc != Encoding::kRaw && i < n; i += 2) bytes[i] = 0;  // compressible
    ASSERT_TRUE(w.AddTensor(name, DType::kF32, shape, bytes.data(), n, enc).ok());
  }

  const BlockSource& source() const { return BlocksOf(*reader_); }

  TempDir dir_;
  std::shared_ptr<Reader> reader_;
};

TEST_F(LoadPlanTest, ResolvesInFileOrderWithRowsNarrowed) {
  auto all = Resolve(source(), {});
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_EQ(all->res.size(), reader_->num_tensors());
  for (size_t k = 0; k < all->res.size(); ++k) EXPECT_EQ(all->res[k].tensor, k);  // name order
  for (size_t k = 1; k < all->order.size(); ++k) {
    EXPECT_LT(all->res[all->order[k - 1]].file_offset(), all->res[all->order[k]].file_offset());
  }
  EXPECT_EQ(all->bytes(), [&] {
    uint64_t n = 0;
    for (size_t i = 0; i < reader_->num_tensors(); ++i) n += reader_->tensor(i).nbytes;
    return n;
  }());

  LoadRequest rows;
  rows.name = "a_raw";
  rows.row_begin = 10;
  rows.row_end = 13;
  auto plan = Resolve(source(), {rows});
  ASSERT_TRUE(plan.ok());
  const Resolved& r = plan->res[0];
  EXPECT_EQ(r.begin, 10u * 4000);
  EXPECT_EQ(r.len, 3u * 4000);
  EXPECT_EQ(r.info.shape, (std::vector<int64_t>{3, 1000}));
  EXPECT_EQ(r.file_offset(), reader_->Find("a_raw")->data_offset + 40000);

  rows.dst = &rows;  // any non-null pointer: only its size is checked here
  rows.dst_bytes = 11999;
  auto small = Resolve(source(), {rows});
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(small.status().message(), reader_->path() +
                                          ": tensor 'a_raw': needs 12000 bytes, destination "
                                          "holds 11999");
  LoadRequest missing;
  missing.name = "nope";
  EXPECT_EQ(Resolve(source(), {missing}).status().code(), StatusCode::kNotFound);
}

TEST_F(LoadPlanTest, PiecesCoverEachRangeWithoutCrossingBlocks) {
  auto plan = Resolve(source(), {});
  ASSERT_TRUE(plan.ok());
  for (uint64_t max_piece : {uint64_t{4096}, kBlock, uint64_t{1} << 20}) {
    std::map<uint32_t, uint64_t> next;  // per request: where the next piece must start
    for (const Piece& p : MakePieces(*plan, max_piece)) {
      const Resolved& r = plan->res[p.r];
      EXPECT_EQ(p.begin, r.begin + next[p.r]);
      EXPECT_EQ(p.dst_off, next[p.r]);
      EXPECT_LE(p.len, std::min(max_piece, kBlock));
      EXPECT_EQ(p.begin / kBlock, (p.begin + p.len - 1) / kBlock) << "crosses a block";
      next[p.r] += p.len;
    }
    for (size_t k = 0; k < plan->res.size(); ++k) {
      EXPECT_EQ(next[static_cast<uint32_t>(k)], plan->res[k].len) << max_piece;
    }
  }
}

// Host loads: an encoded tensor in whole blocks whatever the piece size (a piece that cuts a
// block decodes all of it); raw tensors still in pieces of at most max_piece.
TEST_F(LoadPlanTest, WholeEncodedBlocks) {
  auto plan = Resolve(source(), {});
  ASSERT_TRUE(plan.ok());
  uint64_t encoded = 0;
  for (const Piece& p : MakePieces(*plan, 4096, true)) {
    const Resolved& r = plan->res[p.r];
    if (r.info.encoding == Encoding::kRaw) {
      EXPECT_LE(p.len, 4096u);
      continue;
    }
    ++encoded;
    EXPECT_EQ(p.begin % kBlock, 0u);
    EXPECT_EQ(p.len, std::min(kBlock, r.info.nbytes - p.begin));
  }
  EXPECT_EQ(encoded, (reader_->Find("b_zstd")->nbytes + kBlock - 1) / kBlock);
}

TEST_F(LoadPlanTest, DeviceRoutes) {
  auto plan = Resolve(source(), {});
  ASSERT_TRUE(plan.ok());
  DeviceRoute route;
  route.slot_bytes = 8192;
  // Staging: every piece through the ring, packed at 64 bytes, no batch over one slot.
  DevicePlan staged = PlanDevice(*plan, route);
  EXPECT_TRUE(staged.mapped.empty());
  for (const Batch& b : staged.batches) {
    EXPECT_FALSE(b.direct);
    for (uint32_t i = b.first; i < b.last; ++i) {
      EXPECT_EQ(staged.staged[i].soff % 64, 0u);
      EXPECT_LE(staged.staged[i].soff + staged.staged[i].len, route.slot_bytes);
    }
  }
  // Registered mapping: raw pieces go straight from it, encoded ones still through the ring.
  route.from_mapping = true;
  DevicePlan mapped = PlanDevice(*plan, route);
  for (const Piece& p : mapped.mapped) EXPECT_EQ(plan->res[p.r].info.encoding, Encoding::kRaw);
  for (const Piece& p : mapped.staged) EXPECT_NE(plan->res[p.r].info.encoding, Encoding::kRaw);
  EXPECT_EQ(mapped.groups.size(), mapped.mapped.size());
  // Windows: page-aligned registered ranges that never share a page.
  route.windows = true;
  route.window_bytes = 64 << 10;
  DevicePlan windows = PlanDevice(*plan, route);
  ASSERT_FALSE(windows.groups.empty());
  for (size_t g = 0; g < windows.groups.size(); ++g) {
    EXPECT_EQ(windows.groups[g].reg_begin % kDirectAlign, 0u);
    EXPECT_EQ(windows.groups[g].reg_end % kDirectAlign, 0u);
    if (g > 0) EXPECT_LE(windows.groups[g - 1].reg_end, windows.groups[g].reg_begin);
  }
  // Cold: raw pieces in direct batches whose aligned span fits a slot and its slack.
  route = DeviceRoute();
  route.slot_bytes = 8192;
  route.cold = true;
  DevicePlan cold = PlanDevice(*plan, route);
  bool any_direct = false;
  for (const Batch& b : cold.batches) {
    if (!b.direct) continue;
    any_direct = true;
    EXPECT_EQ(b.span_begin % kDirectAlign, 0u);
    EXPECT_EQ(b.span_len % kDirectAlign, 0u);
    EXPECT_LE(b.span_len, route.slot_bytes + kSlotSlack);
    for (uint32_t i = b.first; i < b.last; ++i) {
      const Piece& p = cold.staged[i];
      EXPECT_EQ(plan->res[p.r].info.data_offset + p.begin, b.span_begin + p.soff);
    }
  }
  EXPECT_TRUE(any_direct);
}

TEST_F(LoadPlanTest, BlockSourceReadsThroughEitherPath) {
  const BlockSource& s = source();
  auto i = s.Lookup("b_zstd");
  ASSERT_TRUE(i.ok());
  std::vector<uint8_t> whole(s.RawSize(*i)), part(5000);
  ASSERT_TRUE(reader_->ReadInto("b_zstd", whole.data(), whole.size()).ok());
  ReadPath how;
  how.verify = true;
  // A range cut inside two blocks, through the mapping and through O_DIRECT where the file
  // system has it.
  ASSERT_TRUE(s.Read(*i, kBlock - 1000, part.size(), part.data(), how).ok());
  EXPECT_TRUE(std::equal(part.begin(), part.end(), whole.begin() + (kBlock - 1000)));
  DirectFile direct = DirectFile::Open(reader_->path());
  if (direct.is_open()) {
    how.direct = &direct;
    std::fill(part.begin(), part.end(), 0);
    ASSERT_TRUE(s.Read(*i, kBlock - 1000, part.size(), part.data(), how).ok());
    EXPECT_TRUE(std::equal(part.begin(), part.end(), whole.begin() + (kBlock - 1000)));
  }
  EXPECT_EQ(s.Read(*i, whole.size() - 10, 11, part.data(), how).code(),
            StatusCode::kInvalidArgument);
  for (uint64_t b = 0; b < s.NumBlocks(*i); ++b) EXPECT_TRUE(s.VerifyBlock(*i, b).ok());
}

}  // namespace
}  // namespace ferry
