// Distributed loading: the split plan (no GPU needed), argument checks, and a one-rank
// communicator on the current GPU (skipped without a GPU or NCCL). The two-rank, two-process
// checks and the benchmark live in distributed_bench.cc.
#include <gtest/gtest.h>

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include <cstring>
#include <map>
#include <numeric>
#include <thread>

#include "dist/dist_plan.hpp"
#include "ferry/distributed.hpp"
#include "nccl_probe.hpp"
#include "save_group.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

using testing::RandomBytes;
using testing::TempDir;

// Every byte of every item is covered exactly once, in order, and pieces inside an item start
// on row boundaries.
void ExpectCovers(const std::vector<PlanItem>& items, const std::vector<PlanPiece>& pieces,
                  int segments) {
  std::vector<uint64_t> next(items.size(), 0);
  uint32_t last_segment = 0;
  for (const PlanPiece& p : pieces) {
    ASSERT_LT(p.item, items.size());
    EXPECT_EQ(p.begin, next[p.item]);
    EXPECT_GT(p.len, 0u);
    EXPECT_GE(p.segment, last_segment);
    EXPECT_LT(p.segment, static_cast<uint32_t>(segments));
    last_segment = p.segment;
    const PlanItem& m = items[p.item];
    if (p.begin != 0 || p.len != m.bytes) {
      ASSERT_GT(m.row_bytes, 0u);
      EXPECT_EQ(p.begin % m.row_bytes, 0u);
      EXPECT_EQ(p.len % m.row_bytes, 0u);
    }
    next[p.item] += p.len;
  }
  for (size_t i = 0; i < items.size(); ++i) EXPECT_EQ(next[i], items[i].bytes) << i;
}

std::vector<uint64_t> SegmentBytes(const std::vector<PlanPiece>& pieces, int segments) {
  std::vector<uint64_t> out(segments, 0);
  for (const PlanPiece& p : pieces) out[p.segment] += p.len;
  return out;
}

TEST(SplitPlanTest, OneBigTensorSplitsByRows) {
  std::vector<PlanItem> items{{1000 * 64, 64}};
  auto pieces = SplitPlan(items, 2, 1);
  ExpectCovers(items, pieces, 2);
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[0].len, 500u * 64);
  EXPECT_EQ(pieces[1].begin, 500u * 64);
}

TEST(SplitPlanTest, RoundsAndRanksBalance) {
  std::vector<PlanItem> items;
  for (int i = 0; i < 50; ++i) items.push_back({uint64_t(4096) * (1 + i % 7), 4096});
  for (int ranks : {1, 2, 3, 8}) {
    for (int rounds : {1, 4}) {
      auto pieces = SplitPlan(items, ranks, rounds);
      ExpectCovers(items, pieces, ranks * rounds);
      uint64_t total = 0;
      for (const auto& m : items) total += m.bytes;
      for (uint64_t b : SegmentBytes(pieces, ranks * rounds)) {
        // Off by at most one row (half a row each side) from an equal share.
        EXPECT_LE(b, total / (ranks * rounds) + 4096) << ranks << "x" << rounds;
        EXPECT_GE(b + 4096, total / (ranks * rounds)) << ranks << "x" << rounds;
      }
    }
  }
}

TEST(SplitPlanTest, UncuttableItemsGoWhole) {
  // A scalar-like item (row_bytes 0) and a one-row item never split; empty items vanish.
  std::vector<PlanItem> items{{200, 0}, {0, 0}, {300, 300}, {100, 10}};
  auto pieces = SplitPlan(items, 2, 1);
  ExpectCovers(items, pieces, 2);
  for (const PlanPiece& p : pieces) EXPECT_NE(p.item, 1u);
  // The cut at 300 falls inside the one-row item [200, 500), nearer to its start.
  EXPECT_EQ(SegmentBytes(pieces, 2), (std::vector<uint64_t>{200, 400}));
  // Nearer to its end (a tie goes to the end): the whole item stays in the first segment.
  std::vector<PlanItem> late{{100, 0}, {300, 300}, {100, 10}};
  EXPECT_EQ(SegmentBytes(SplitPlan(late, 2, 1), 2), (std::vector<uint64_t>{400, 100}));
}

TEST(SplitPlanTest, MoreSegmentsThanBytes) {
  std::vector<PlanItem> items{{3, 1}};
  auto pieces = SplitPlan(items, 4, 2);
  ExpectCovers(items, pieces, 8);
  EXPECT_EQ(std::accumulate(pieces.begin(), pieces.end(), uint64_t{0},
                            [](uint64_t a, const PlanPiece& p) { return a + p.len; }),
            3u);
  EXPECT_TRUE(SplitPlan({}, 2, 4).empty());
  EXPECT_TRUE(SplitPlan(items, 0, 4).empty());
}

TEST(SplitPlanTest, Deterministic) {
  std::vector<PlanItem> items;
  for (int i = 0; i < 1000; ++i)
    items.push_back({uint64_t(i * 37 % 5000), uint64_t(i % 3 ? 8 : 0)});
  auto a = SplitPlan(items, 2, 4), b = SplitPlan(items, 2, 4);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].item, b[i].item);
    EXPECT_EQ(a[i].segment, b[i].segment);
    EXPECT_EQ(a[i].begin, b[i].begin);
  }
  ExpectCovers(items, a, 8);
}

// The plan shared by DistributedLoader and ferry_dist_plan_t, carried out in host memory: every
// rank reads its pieces, then the broadcasts copy each root's bytes to the others; every rank
// must then hold every tensor, byte for byte.
class DistPlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto w = Writer::Create(dir_.File("plan.ferry")).value();
    for (int i = 0; i < 40; ++i) {  // small ones (the arena) among larger ones (their own)
      const int64_t rows = i % 5 == 0 ? 3000 : 1 + i % 7;
      std::vector<uint8_t> bytes = RandomBytes(rows * 12, 100 + i);
      ASSERT_TRUE(w.AddTensor("t" + std::to_string(100 + i), DType::kF32, {rows, 3}, bytes.data(),
                              bytes.size())
                      .ok());
    }
    ASSERT_TRUE(w.Commit().ok());
    reader_ = Reader::Open(dir_.File("plan.ferry")).value();
  }

  // Plans on `nranks` threads through one ThreadGroup; the statuses, one per rank.
  std::vector<Result<DistPlan>> PlanAll(int nranks, int rounds, uint64_t own_min_bytes,
                                        std::vector<std::vector<DistributedRequest>> requests) {
    testing::ThreadGroup group(nranks);
    std::vector<Result<DistPlan>> out(nranks, Status(StatusCode::kInternal, "not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < nranks; ++r) {
      threads.emplace_back([&, r] {
        AllReduceMaxFn reduce = group.Rank(r).all_reduce_max;
        out[r] = MakeDistPlan(SourceOf(*reader_), requests[r], r, nranks, rounds, own_min_bytes,
                              &reduce);
      });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  testing::TempDir dir_;
  std::shared_ptr<Reader> reader_;
};

TEST_F(DistPlanTest, EveryRankEndsWithEveryByte) {
  const int nranks = 3, rounds = 2;
  auto plans = PlanAll(nranks, rounds, 4096, std::vector<std::vector<DistributedRequest>>(3));
  for (auto& p : plans) ASSERT_TRUE(p.ok()) << p.status().message();
  const DistPlan& plan = *plans[0];
  ASSERT_EQ(plan.items.size(), 40u);
  // Broadcast calls must match across ranks exactly.
  for (int r = 1; r < nranks; ++r) {
    ASSERT_EQ(plans[r]->broadcasts.size(), plan.broadcasts.size());
    for (size_t s = 0; s < plan.broadcasts.size(); ++s) {
      ASSERT_EQ(plans[r]->broadcasts[s].size(), plan.broadcasts[s].size());
      for (size_t k = 0; k < plan.broadcasts[s].size(); ++k) {
        EXPECT_EQ(plans[r]->broadcasts[s][k].bytes, plan.broadcasts[s][k].bytes);
        EXPECT_EQ(plans[r]->broadcasts[s][k].root, plan.broadcasts[s][k].root);
      }
    }
  }
  size_t ops = 0;
  for (const auto& seg : plan.broadcasts) ops += seg.size();
  EXPECT_LT(ops, plan.pieces.size());  // arena pieces travel together

  struct Memory {
    std::vector<uint8_t> arena;
    std::vector<std::vector<uint8_t>> own;
    uint8_t* At(const DistPlan& p, uint32_t item, uint64_t begin) {
      const PlanEntry& m = p.items[item];
      return (m.in_arena ? arena.data() + m.arena_off : own[item].data()) + begin;
    }
  };
  std::vector<Memory> mem(nranks);
  for (int r = 0; r < nranks; ++r) {
    mem[r].arena.assign(plan.arena_bytes, 0);
    for (const PlanEntry& m : plan.items) mem[r].own.emplace_back(m.in_arena ? 0 : m.len, 0);
    for (const auto& round : PiecesOf(plans[r]->pieces, r, rounds)) {
      for (const PlanPiece* p : round) {
        const PlanEntry& m = plan.items[p->item];
        auto [row_begin, row_end] = PieceRows(m, *p);
        uint8_t* dst = mem[r].At(plan, p->item, p->begin);
        Status st = row_end < 0
                        ? reader_->ReadInto(m.info.name, dst, p->len)
                        : reader_->ReadRowsInto(m.info.name, row_begin, row_end, dst, p->len);
        ASSERT_TRUE(st.ok()) << st.message();
      }
    }
  }
  for (const auto& seg : plan.broadcasts) {
    for (const PlanBroadcast& b : seg) {
      const uint8_t* src = mem[b.root].At(plan, b.item, b.begin);
      for (int r = 0; r < nranks; ++r) {
        if (r != b.root) std::memcpy(mem[r].At(plan, b.item, b.begin), src, b.bytes);
      }
    }
  }
  for (uint32_t i = 0; i < plan.items.size(); ++i) {
    const PlanEntry& m = plan.items[i];
    EXPECT_EQ(m.in_arena, m.len < 4096) << m.info.name;
    std::vector<uint8_t> want(m.len);
    ASSERT_TRUE(reader_->ReadInto(m.info.name, want.data(), want.size()).ok());
    for (int r = 0; r < nranks; ++r) {
      EXPECT_EQ(std::memcmp(mem[r].At(plan, i, 0), want.data(), m.len), 0)
          << m.info.name << " on rank " << r;
    }
  }
}

TEST_F(DistPlanTest, RanksThatDisagreeFailTogether) {
  std::vector<std::vector<DistributedRequest>> requests(2);
  requests[1].push_back(DistributedRequest{"t100"});
  auto plans = PlanAll(2, 4, UINT64_MAX, requests);
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(plans[r].ok());
    EXPECT_EQ(plans[r].status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(plans[r].status().message().find(": rank " + std::to_string(r) +
                                               ": the ranks disagree on the replicated requests"),
              std::string::npos);
  }
  requests[1][0].name = "missing";
  requests[0] = requests[1];
  requests[0][0].name = "t100";
  plans = PlanAll(2, 4, UINT64_MAX, requests);
  EXPECT_EQ(plans[0].status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(plans[1].status().code(), StatusCode::kNotFound);
}

TEST(AgreeOnOutcomeTest, AnyFailureFailsEveryRank) {
  testing::ThreadGroup group(2);
  Status got[2];
  std::thread other([&] {
    got[1] = AgreeOnOutcome(Status(StatusCode::kDataLoss, "mine"), group.Rank(1).all_reduce_max,
                            "ck", 1);
  });
  got[0] = AgreeOnOutcome(Status::Ok(), group.Rank(0).all_reduce_max, "ck", 0);
  other.join();
  EXPECT_EQ(got[0].message(),
            "ck: rank 0: another rank failed this distributed load (its error "
            "says why)");
  EXPECT_EQ(got[1].code(), StatusCode::kDataLoss);
}

TEST(DistributedLoaderTest, RejectsNullCommunicator) {
  auto r = DistributedLoader::Create(nullptr);
  ASSERT_FALSE(r.ok());
#ifdef FERRY_HAVE_CUDA
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "DistributedLoader: null communicator");
#else
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented);
#endif
}

#ifdef FERRY_HAVE_CUDA
// One rank: everything is read locally and every broadcast is to itself; exercises planning,
// row cuts, caller buffers, local requests and sharded checkpoints on a single GPU.
class OneRankTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device";
    if (!nccl_.ok()) GTEST_SKIP() << "no libnccl.so.2";
    ASSERT_EQ(cudaGetDevice(&device_), cudaSuccess);
    testing::NcclProbe::UniqueId id;
    ASSERT_EQ(nccl_.get_unique_id(&id), 0);
    ASSERT_EQ(nccl_.comm_init_rank(&comm_, 1, id, 0), 0);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
    if (comm_) nccl_.comm_destroy(comm_);
  }
  std::vector<uint8_t> Host(const LoadedTensor& t) {
    std::vector<uint8_t> out(t.nbytes);
    if (t.nbytes) {
      EXPECT_EQ(cudaMemcpy(out.data(), t.data, t.nbytes, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return out;
  }
  testing::NcclProbe nccl_;
  ncclComm* comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
};

TEST_F(OneRankTest, LoadsEverythingBitExact) {
  TempDir dir;
  std::string path = dir.File("m.ferry");
  std::map<std::string, std::vector<uint8_t>> want;
  {
    WriterOptions o;
    o.durable = false;
    auto w = Writer::Create(path, o);
    ASSERT_TRUE(w.ok());
    auto add = [&](const std::string& name, DType dt, std::vector<int64_t> shape,
                   Encoding enc = Encoding::kRaw) {
      uint64_t n = *StorageBytes(dt, *NumElements(shape));
      want[name] = RandomBytes(n, want.size() + 1);
      ASSERT_TRUE(w->AddTensor(name, dt, shape, want[name].data(), n, enc).ok()) << name;
    };
    add("big", DType::kBF16, {1000, 1536});
    add("zstd", DType::kBF16, {300, 1024}, Encoding::kShuffleZstd);
    add("scalar", DType::kI64, {});
    add("empty", DType::kF32, {0, 8});
    add("fp4_odd", DType::kF4_E2M1FN, {3, 5});
    for (int i = 0; i < 100; ++i) add("tiny." + std::to_string(i), DType::kU8, {17 + i});
    ASSERT_TRUE(w->Commit().ok());
  }
  auto reader = Reader::Open(path);
  ASSERT_TRUE(reader.ok());
  for (int rounds : {1, 3}) {
    DistributedOptions o;
    o.rounds = rounds;
    auto dl = DistributedLoader::Create(comm_, o);
    ASSERT_TRUE(dl.ok()) << dl.status().ToString();
    EXPECT_EQ((*dl)->rank(), 0);
    EXPECT_EQ((*dl)->nranks(), 1);
    auto all = (*dl)->Load(**reader, {}, stream_);
    ASSERT_TRUE(all.ok()) << all.status().ToString();
    ASSERT_EQ(all->size(), want.size());
    for (const LoadedTensor& t : *all) {
      EXPECT_EQ(t.device, device_);
      EXPECT_EQ(Host(t), want[t.info.name]) << t.info.name;
    }
    // Rows, a caller buffer, and a local slice, in one call.
    void* buf = nullptr;
    ASSERT_EQ(cudaMalloc(&buf, 300 * 1024 * 2), cudaSuccess);
    std::vector<DistributedRequest> reqs(3);
    reqs[0].name = "big";
    reqs[0].row_begin = 10;
    reqs[0].row_end = 999;
    reqs[1].name = "zstd";
    reqs[1].dst = buf;
    reqs[1].dst_bytes = 300 * 1024 * 2;
    reqs[2].name = "big";
    reqs[2].row_begin = 500;
    reqs[2].local = true;
    auto part = (*dl)->Load(**reader, reqs, stream_);
    ASSERT_TRUE(part.ok()) << part.status().ToString();
    const auto& big = want["big"];
    EXPECT_EQ((*part)[0].info.shape, (std::vector<int64_t>{989, 1536}));
    EXPECT_EQ(Host((*part)[0]),
              std::vector<uint8_t>(big.begin() + 10 * 3072, big.begin() + 999 * 3072));
    EXPECT_EQ((*part)[1].data, buf);
    EXPECT_EQ(Host((*part)[1]), want["zstd"]);
    EXPECT_EQ(Host((*part)[2]), std::vector<uint8_t>(big.begin() + 500 * 3072, big.end()));
    DistributedStats st = (*dl)->last_stats();
    EXPECT_EQ(st.bytes_received, 0u);
    EXPECT_EQ(st.bytes, st.bytes_read);
    cudaFree(buf);
  }
}

TEST_F(OneRankTest, Errors) {
  TempDir dir;
  std::string path = dir.File("m.ferry");
  {
    WriterOptions o;
    o.durable = false;
    auto w = Writer::Create(path, o);
    std::vector<uint8_t> b(64);
    ASSERT_TRUE(w->AddTensor("a", DType::kU8, {8, 8}, b.data(), 64).ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  auto reader = Reader::Open(path);
  auto dl = DistributedLoader::Create(comm_);
  ASSERT_TRUE(dl.ok());
  DistributedRequest q;
  q.name = "nope";
  auto r = (*dl)->Load(**reader, {q}, stream_);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  q.name = "a";
  q.row_begin = 3;
  q.row_end = 9;
  r = (*dl)->Load(**reader, {q}, stream_);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), path + ": tensor 'a': rows [3, 9) outside [0, 8)");
  q.row_end = 4;
  q.dst = reinterpret_cast<void*>(16);
  q.dst_bytes = 4;
  r = (*dl)->Load(**reader, {q}, stream_);
  EXPECT_EQ(r.status().message(), path + ": tensor 'a': needs 8 bytes, destination holds 4");
  // Still usable after failures.
  auto ok = (*dl)->Load(**reader, {}, stream_);
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
  DistributedOptions bad;
  bad.rounds = 0;
  EXPECT_EQ(DistributedLoader::Create(comm_, bad).status().code(), StatusCode::kInvalidArgument);
}
#endif  // FERRY_HAVE_CUDA

}  // namespace
}  // namespace ferry
