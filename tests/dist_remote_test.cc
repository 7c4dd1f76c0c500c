// The distributed load's split of the stored bytes (StoredRangesOf): every rank fetches only
// its share of a checkpoint, the shares cover the tensors' bytes once (raw) or overlap by the
// encoded blocks cut between ranks, and a rank reading a checkpoint over HTTP asks the server
// for exactly those bytes besides the opening request and the footer, as the server's own log
// of Range headers shows (the range server of tests/servers/servers.py, started by the ctest
// fixture remote_servers). Ranks are threads; the reads go to host memory (no GPU needed), as
// DistributedLoader's do onto the device.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "base/util.hpp"
#include "dist/dist_plan.hpp"
#include "format/block_source.hpp"
#include "io/remote_source.hpp"
#include "io/source.hpp"
#include "save_group.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;

Ranges Joined(Ranges v) {
  std::sort(v.begin(), v.end());
  Ranges out;
  for (const auto& r : v) {
    if (r.first == r.second) continue;
    if (!out.empty() && r.first <= out.back().second) {
      out.back().second = std::max(out.back().second, r.second);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

uint64_t Total(const Ranges& v) {
  uint64_t n = 0;
  for (const auto& r : Joined(v)) n += r.second - r.first;
  return n;
}

Ranges Intersect(const Ranges& a, const Ranges& b) {
  Ranges out;
  for (const auto& x : Joined(a)) {
    for (const auto& y : Joined(b)) {
      uint64_t lo = std::max(x.first, y.first), hi = std::min(x.second, y.second);
      if (lo < hi) out.emplace_back(lo, hi);
    }
  }
  return Joined(out);
}

Ranges OfShard0(const std::vector<StoredRange>& v) {
  Ranges out;
  for (const StoredRange& r : v) {
    EXPECT_EQ(r.shard, 0u);
    out.emplace_back(r.begin, r.end);
  }
  return out;
}

// Bf16-like rows of varied heights, so that the split cuts tensors between rows.
Status WriteCheckpoint(const std::string& path, Encoding encoding, uint64_t block_size) {
  WriterOptions o;
  o.encoding = encoding;
  o.block_size = block_size;
  FERRY_ASSIGN_OR_RETURN(Writer w, Writer::Create(path, o));
  for (int i = 0; i < 12; ++i) {
    const int64_t rows = 100 + 37 * i;
    std::vector<uint8_t> bytes = testing::RandomBytes(rows * 512 * 2, 700 + i);
    for (size_t k = 1; k < bytes.size(); k += 2) bytes[k] = 0x3c + bytes[k] % 3;  // compressible
    FERRY_RETURN_IF_ERROR(w.AddTensor(StrCat("layer", 10 + i), DType::kBF16, {rows, 512},
                                      bytes.data(), bytes.size()));
  }
  return w.Commit();
}

// Plans on `nranks` threads and returns each rank's plan.
std::vector<DistPlan> PlanAll(const Reader& reader, int nranks, int rounds) {
  testing::ThreadGroup group(nranks);
  std::vector<DistPlan> out(nranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < nranks; ++r) {
    threads.emplace_back([&, r] {
      AllReduceMaxFn reduce = group.Rank(r).all_reduce_max;
      auto plan = MakeDistPlan(SourceOf(reader), {}, r, nranks, rounds, 0, &reduce);
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();
      out[r] = std::move(plan).value();
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

Ranges TensorBytes(const Reader& reader) {
  Ranges out;
  for (size_t i = 0; i < reader.num_tensors(); ++i) {
    const TensorInfo t = reader.tensor(i);
    out.emplace_back(t.data_offset, t.data_offset + t.data_size);
  }
  return Joined(out);
}

// Each rank's share of the stored bytes under a plan made by all of them.
std::vector<Ranges> Shares(const Reader& reader, int nranks, int rounds) {
  std::vector<DistPlan> plans = PlanAll(reader, nranks, rounds);
  std::vector<Ranges> out(nranks);
  for (int r = 0; r < nranks && !::testing::Test::HasFailure(); ++r) {
    auto mine = StoredRangesOf(SourceOf(reader), plans[r].items, plans[r].pieces, r, rounds);
    EXPECT_TRUE(mine.ok()) << mine.status().ToString();
    if (mine.ok()) out[r] = OfShard0(*mine);
  }
  return out;
}

class StoredRangesTest : public ::testing::Test {
 protected:
  testing::TempDir dir_;
};

TEST_F(StoredRangesTest, RawSharesCoverEveryTensorByteOnce) {
  // Small blocks: the shares cut raw blocks, which must not widen them.
  ASSERT_TRUE(WriteCheckpoint(dir_.File("raw.ferry"), Encoding::kRaw, 64 << 10).ok());
  auto reader = Reader::Open(dir_.File("raw.ferry")).value();
  const Ranges tensors = TensorBytes(*reader);
  const uint64_t data = Total(tensors);
  for (int nranks : {1, 2, 3, 5}) {
    for (int rounds : {1, 4}) {
      std::vector<Ranges> shares = Shares(*reader, nranks, rounds);
      if (HasFailure()) return;
      Ranges all;
      uint64_t sum = 0;
      for (int r = 0; r < nranks; ++r) {
        const Ranges& share = shares[r];
        // About 1/N: the split is balanced to within a row (1 KiB) per segment.
        EXPECT_NEAR(static_cast<double>(Total(share)), static_cast<double>(data) / nranks,
                    1024.0 * rounds)
            << "rank " << r << " of " << nranks << ", " << rounds << " rounds";
        EXPECT_EQ(Total(Intersect(share, tensors)), Total(share)) << "outside the tensors";
        sum += Total(share);
        all.insert(all.end(), share.begin(), share.end());
      }
      EXPECT_EQ(sum, data) << nranks << " ranks: some byte is fetched twice";
      EXPECT_EQ(Joined(all), tensors) << nranks << " ranks: some byte is fetched by none";
    }
  }
}

TEST_F(StoredRangesTest, EncodedBlocksCutBetweenRanksAreFetchedByBoth) {
  ASSERT_TRUE(WriteCheckpoint(dir_.File("zstd.ferry"), Encoding::kShuffleZstd, 64 << 10).ok());
  auto reader = Reader::Open(dir_.File("zstd.ferry")).value();
  const BlockSource& blocks = BlocksOf(*reader);
  uint64_t largest = 0, count = 0;
  for (size_t i = 0; i < reader->num_tensors(); ++i) {
    for (uint64_t b = 0; b < blocks.NumBlocks(i); ++b) {
      largest = std::max(largest, blocks.Block(i, b).stored_size);
      count += blocks.Block(i, b).compressed ? 1 : 0;
    }
  }
  ASSERT_GT(count, 12u) << "the test wants compressed tensors of several blocks";
  const Ranges tensors = TensorBytes(*reader);
  const int nranks = 3, rounds = 2;
  Ranges all;
  uint64_t sum = 0;
  for (const Ranges& share : Shares(*reader, nranks, rounds)) {
    sum += Total(share);
    all.insert(all.end(), share.begin(), share.end());
  }
  if (HasFailure()) return;
  EXPECT_EQ(Joined(all), tensors);
  // Only blocks at the edges of segments are fetched twice: nranks * rounds - 1 cuts.
  EXPECT_LE(sum - Total(tensors), (nranks * rounds - 1) * largest);
}

// ---- against a server ----------------------------------------------------------------------

// servers.json of the ctest fixture remote_servers; null when the test runs without it.
const nlohmann::json* Servers() {
  static const nlohmann::json info = [] {
    const char* path = std::getenv("FERRY_TEST_SERVERS");
    if (path == nullptr) return nlohmann::json();
    std::ifstream in(path);
    return in ? nlohmann::json::parse(in, nullptr, false) : nlohmann::json();
  }();
  return info.is_object() ? &info : nullptr;
}

// The Range headers the server logged for `url` (a range-server URL), as byte ranges; suffix
// ranges (the opening request) are left out.
Ranges ServerLog(const std::string& fault, const std::string& url) {
  auto log = OpenSource(fault + "/_ranges" + url.substr(fault.size()));
  EXPECT_TRUE(log.ok()) << log.status().ToString();
  if (!log.ok()) return {};
  std::string text((*log)->size(), '\0');
  EXPECT_TRUE((*log)->ReadAt(0, text.size(), reinterpret_cast<uint8_t*>(text.data())).ok());
  Ranges out;
  for (const auto& h : nlohmann::json::parse(text)) {
    std::string v = h.get<std::string>();
    EXPECT_EQ(v.rfind("bytes=", 0), 0u) << v;
    v = v.substr(6);
    if (v.empty() || v[0] == '-') continue;
    size_t dash = v.find('-');
    out.emplace_back(std::stoull(v.substr(0, dash)), std::stoull(v.substr(dash + 1)) + 1);
  }
  return out;
}

TEST(DistRemoteTest, EachRankAsksTheServerForItsShareOnly) {
  const nlohmann::json* info = Servers();
  if (info == nullptr) GTEST_SKIP() << "FERRY_TEST_SERVERS is not set (ctest sets it)";
  const std::string fault = (*info)["fault"].get<std::string>();
  const std::string name = StrCat("dist/", getpid(), "/split.ferry");
  const std::string local = (*info)["root"].get<std::string>() + "/" + name;
  std::filesystem::create_directories(std::filesystem::path(local).parent_path());
  ASSERT_TRUE(WriteCheckpoint(local, Encoding::kRaw, 64 << 10).ok());
  auto truth = Reader::Open(local).value();
  const Ranges tensors = TensorBytes(*truth);

  const int nranks = 3, rounds = 2;
  testing::ThreadGroup group(nranks);
  std::vector<Ranges> asked(nranks), planned(nranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < nranks; ++r) {
    threads.emplace_back([&, r] {
      // One URL per rank, so that the server's log tells the ranks apart.
      const std::string url = StrCat(fault, "/", getpid(), "-rank", r, "/ok/0/", name);
      auto reader = Reader::Open(url);
      ASSERT_TRUE(reader.ok()) << reader.status().ToString();
      AllReduceMaxFn reduce = group.Rank(r).all_reduce_max;
      auto plan = MakeDistPlan(SourceOf(**reader), {}, r, nranks, rounds, 0, &reduce);
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();
      auto mine = StoredRangesOf(SourceOf(**reader), plan->items, plan->pieces, r, rounds);
      ASSERT_TRUE(mine.ok()) << mine.status().ToString();
      planned[r] = OfShard0(*mine);
      auto loader = Loader::Create().value();
      for (const auto& round : PiecesOf(plan->pieces, r, rounds)) {
        std::vector<LoadRequest> requests;
        std::vector<std::vector<uint8_t>> got(round.size());
        for (size_t k = 0; k < round.size(); ++k) {
          const PlanEntry& m = plan->items[round[k]->item];
          LoadRequest q;
          q.name = m.info.name;
          std::tie(q.row_begin, q.row_end) = PieceRows(m, *round[k]);
          got[k].resize(round[k]->len);
          q.dst = got[k].data();
          q.dst_bytes = got[k].size();
          requests.push_back(q);
        }
        auto loaded = loader->LoadToHost(**reader, requests);
        ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
        for (size_t k = 0; k < round.size(); ++k) {
          const TensorInfo t = truth->Find(plan->items[round[k]->item].info.name).value();
          std::vector<uint8_t> whole(t.nbytes);
          ASSERT_TRUE(truth->ReadInto(t.name, whole.data(), whole.size()).ok());
          const uint64_t row_bytes = t.nbytes / t.shape[0];
          const uint64_t at = requests[k].row_end < 0 ? 0 : requests[k].row_begin * row_bytes;
          ASSERT_LE(at + got[k].size(), whole.size());
          EXPECT_EQ(std::memcmp(got[k].data(), whole.data() + at, got[k].size()), 0)
              << t.name << " on rank " << r;
        }
      }
      asked[r] = ServerLog(fault, url);
    });
  }
  for (auto& t : threads) t.join();
  if (HasFailure()) return;
  // The opening request keeps the object's last tail_bytes, so reads there reach no server;
  // below that, every byte of a tensor the server sent a rank is of its share or of the head
  // every rank reads when it opens the file (a range from byte 0), and the whole share was
  // asked for.
  const uint64_t size = truth->file_size();
  const Ranges below_tail =
      Intersect(tensors, {{0, size - std::min(size, RemoteOptions().tail_bytes)}});
  Ranges all;
  for (int r = 0; r < nranks; ++r) {
    Ranges head;
    for (const auto& x : asked[r]) {
      if (x.first == 0) head.push_back(x);
    }
    ASSERT_EQ(head.size(), 1u) << "rank " << r;
    EXPECT_LE(head[0].second, uint64_t{64} << 10);
    Ranges expected = planned[r];
    expected.push_back(head[0]);
    EXPECT_EQ(Intersect(asked[r], below_tail), Intersect(expected, below_tail)) << "rank " << r;
    EXPECT_EQ(Total(Intersect(Intersect(asked[r], tensors), expected)),
              Total(Intersect(asked[r], tensors)))
        << "rank " << r << " asked for tensor bytes outside its share";
    EXPECT_NEAR(static_cast<double>(Total(planned[r])),
                static_cast<double>(Total(tensors)) / nranks, 1024.0 * rounds);
    all.insert(all.end(), planned[r].begin(), planned[r].end());
  }
  EXPECT_EQ(Joined(all), tensors);
  std::filesystem::remove_all(std::filesystem::path(local).parent_path());
}

}  // namespace
}  // namespace ferry
