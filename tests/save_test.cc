// Saves through the writer's pipeline: the staging pool, snapshots of host sources, asynchronous
// commits, the layout a parallel writer produces, and (on a GPU) device sources on the caller's
// stream. GPU tests GTEST_SKIP() without a device.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <thread>

#include "cuda/staging_pool.hpp"
#include "ferry/ferry.hpp"
#include "ferry/loader.hpp"
#include "test_util.hpp"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace ferry {
namespace {

namespace fs = std::filesystem;
using testing::RandomBytes;
using testing::TempDir;

struct Def {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  Encoding encoding;
};

// Sizes around block boundaries (block 4096 below), small tensors that pack into one staging
// piece, an empty tensor and a scalar.
const std::vector<Def> kDefs = {
    {"a.raw", DType::kU8, {3 * 4096 + 17}, Encoding::kRaw},
    {"b.shuffle", DType::kBF16, {64, 130}, Encoding::kShuffleZstd},
    {"c.zstd", DType::kF32, {5000}, Encoding::kZstd},
    {"d.empty", DType::kF16, {0, 4}, Encoding::kShuffleZstd},
    {"e.scalar", DType::kI64, {}, Encoding::kRaw},
    {"f.small", DType::kF32, {7}, Encoding::kShuffleZstd},
    {"g.exact", DType::kU8, {4096}, Encoding::kRaw},
    {"h.fp4", DType::kF4_E2M1FN, {33}, Encoding::kZstd},
};

std::vector<uint8_t> Content(const Def& d, uint64_t seed) {
  auto bytes = RandomBytes(*StorageBytes(d.dtype, *NumElements(d.shape)), seed);
  // High bytes of small range, like weights, so compressed tensors really compress.
  if (d.encoding != Encoding::kRaw) {
    for (size_t i = 1; i < bytes.size(); i += 2) bytes[i] &= 0x07;
  }
  return bytes;
}

WriterOptions Options(int threads, std::shared_ptr<StagingPool> pool = nullptr) {
  WriterOptions o;
  o.block_size = 4096;
  o.durable = false;
  o.threads = threads;
  o.staging = std::move(pool);
  return o;
}

void ExpectContent(const std::string& path, const std::vector<Def>& defs, uint64_t seed) {
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE((*r)->VerifyAll().ok());
  ASSERT_EQ((*r)->num_tensors(), defs.size());
  for (size_t k = 0; k < defs.size(); ++k) {
    auto want = Content(defs[k], seed + k);
    auto info = (*r)->Find(defs[k].name);
    ASSERT_TRUE(info.ok()) << defs[k].name;
    EXPECT_EQ(info->encoding, want.empty() ? Encoding::kRaw : defs[k].encoding);
    std::vector<uint8_t> got(want.size());
    ASSERT_TRUE((*r)->ReadInto(defs[k].name, got.data(), got.size(), {true}).ok());
    EXPECT_EQ(got, want) << defs[k].name;
  }
}

std::vector<uint8_t> FileBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

std::set<std::string> DirEntries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

// ---- the staging pool ---------------------------------------------------------------------

TEST(StagingPoolTest, PiecesAreContiguousAlignedAndReusedInOrder) {
  auto pool = StagingPool::Create(16384);
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ((*pool)->bytes(), 16384u);
  EXPECT_FALSE((*pool)->pinned());
  StagingPool::Impl& p = (*pool)->impl();
  auto a = p.Acquire(4000);  // 4096 with alignment
  auto b = p.Acquire(100);   // 256
  auto c = p.Acquire(8192);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(b->data - a->data, 4096);
  EXPECT_EQ(c->data - b->data, 256);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data) % 4096, 0u);
  // 16384 - 12544 = 3840 left at the end: a 4096 piece must wait for the head to come back,
  // which takes the release of `a` (releasing `b` alone frees nothing: `a` is older).
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    auto d = p.Acquire(4096);
    ASSERT_TRUE(d.ok());
    EXPECT_EQ(d->data, a->data);  // wrapped to the start
    got = true;
    p.Release(d->id);
  });
  p.Release(b->id);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(got.load());
  p.Release(a->id);
  waiter.join();
  EXPECT_TRUE(got.load());
  p.Release(c->id);
  // Everything back: the whole pool is one piece again.
  auto all = p.Acquire(16384);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->data, a->data);
  p.Release(all->id);
  auto big = p.Acquire(16385);
  EXPECT_EQ(big.status().code(), StatusCode::kInvalidArgument);
}

// The loader's staging ring cuts one pool into equal slots: pieces of one slot's size always
// start on a slot boundary, and a slot comes back only after its holder (and every older one)
// gave it back.
TEST(StagingPoolTest, EqualPiecesAreSlots) {
  constexpr uint64_t kSlot = 3 * 4096, kSlots = 4;
  auto pool = StagingPool::Impl::Create(kSlots * kSlot, PinnedAlloc::kHostRegister, "ring");
  ASSERT_TRUE(pool.ok());
  StagingPool::Impl& p = **pool;
  struct Held {
    StagingPool::Impl::Piece piece;
    bool released = false;
  };
  std::deque<Held> live;  // in acquisition order, as the pool keeps them
  std::mt19937 rng(5);
  for (int round = 0; round < 200; ++round) {
    while (live.size() < kSlots) {
      auto piece = p.Acquire(kSlot);
      ASSERT_TRUE(piece.ok());
      const uint64_t off = static_cast<uint64_t>(piece->data - p.base());
      EXPECT_EQ(off % kSlot, 0u);
      EXPECT_LT(off, kSlots * kSlot);
      for (const Held& h : live) EXPECT_NE(h.piece.data, piece->data);
      live.push_back(Held{*piece});
    }
    // Batches finish out of order; a slot is free again once every older one is back.
    for (int k = 0; k < 2; ++k) {
      Held& h = live[rng() % live.size()];
      if (!h.released) p.Release(h.piece.id);
      h.released = true;
    }
    if (!live.front().released) p.Release(live.front().piece.id);
    live.front().released = true;
    while (!live.empty() && live.front().released) live.pop_front();
  }
  for (const Held& h : live) {
    if (!h.released) p.Release(h.piece.id);
  }
}

TEST(StagingPoolTest, RejectsTinyPools) {
  EXPECT_EQ(StagingPool::Create(4096).status().code(), StatusCode::kInvalidArgument);
  auto p = StagingPool::Create(10000);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)->bytes(), 12288u);  // rounded up to pages
}

// ---- host sources through the pipeline ----------------------------------------------------

Status WriteDefs(const std::string& path, const std::vector<Def>& defs, uint64_t seed,
                 WriterOptions o, bool async) {
  auto w = Writer::Create(path, std::move(o));
  if (!w.ok()) return w.status();
  for (size_t k = 0; k < defs.size(); ++k) {
    auto bytes = Content(defs[k], seed + k);
    Status st = w->AddTensor(defs[k].name, defs[k].dtype, defs[k].shape, bytes.data(), bytes.size(),
                             defs[k].encoding);
    // The writer copied (snapshot) or wrote (no pool) the bytes: the buffer is the caller's.
    std::fill(bytes.begin(), bytes.end(), 0xEE);
    if (!st.ok()) return st;
  }
  Status st = w->SetMetadata("seed", std::to_string(seed));
  if (!st.ok()) return st;
  if (!async) return w->Commit();
  auto h = w->CommitAsync();
  if (!h.ok()) return h.status();
  EXPECT_EQ(h->path(), path);
  return h->Wait();
}

TEST(SaveTest, LayoutDoesNotDependOnThreadsOrStaging) {
  TempDir dir;
  const std::string one = dir.File("one.ferry");
  ASSERT_TRUE(WriteDefs(one, kDefs, 10, Options(1), false).ok());
  ExpectContent(one, kDefs, 10);
  const auto reference = FileBytes(one);
  auto pool = StagingPool::Create(3 * 4096);
  ASSERT_TRUE(pool.ok());
  for (int threads : {2, 4, 9}) {
    for (bool staged : {false, true}) {
      for (bool async : {false, true}) {
        SCOPED_TRACE(std::to_string(threads) + " threads, staged " + std::to_string(staged) +
                     ", async " + std::to_string(async));
        const std::string path = dir.File("many.ferry");
        Status st = WriteDefs(path, kDefs, 10, Options(threads, staged ? *pool : nullptr), async);
        ASSERT_TRUE(st.ok()) << st.ToString();
        EXPECT_EQ(FileBytes(path), reference);
      }
    }
  }
  EXPECT_EQ(DirEntries(dir.path()), (std::set<std::string>{"one.ferry", "many.ferry"}));
}

// Direct writes assemble the file in 4 MiB segments of a 64 MiB ring: a checkpoint larger
// than the ring, written by several threads, must come out byte for byte as buffered writes
// make it.
TEST(SaveTest, DirectWritesMatchBufferedWrites) {
  TempDir dir;
  std::vector<Def> defs;
  for (int i = 0; i < 9; ++i) {
    defs.push_back(
        {"raw." + std::to_string(i), DType::kU8, {(7 << 20) + 4096 * i + i}, Encoding::kRaw});
    defs.push_back(
        {"z." + std::to_string(i), DType::kBF16, {(1 << 20) + 3 * i}, Encoding::kShuffleZstd});
    defs.push_back({"s." + std::to_string(i), DType::kF32, {i}, Encoding::kRaw});
  }
  std::vector<std::vector<uint8_t>> files;
  for (bool direct : {false, true}) {
    const std::string path = dir.File(direct ? "direct.ferry" : "buffered.ferry");
    WriterOptions o = Options(4);
    o.block_size = 1 << 20;
    o.direct_io = direct;
    ASSERT_TRUE(WriteDefs(path, defs, 70, o, false).ok());
    ExpectContent(path, defs, 70);
    files.push_back(FileBytes(path));
  }
  EXPECT_GT(files[0].size(), uint64_t{64} << 20);
  EXPECT_TRUE(files[0] == files[1]);
}

TEST(SaveTest, AsyncCommitFinishesAfterTheCallReturns) {
  TempDir dir;
  const std::string path = dir.File("async.ferry");
  ASSERT_TRUE(WriteDefs(path, kDefs, 1, Options(2), false).ok());
  // A pool of two blocks for a checkpoint of many: each add waits for earlier blocks.
  auto pool = StagingPool::Create(2 * 4096);
  ASSERT_TRUE(pool.ok());
  std::vector<Def> big = kDefs;
  big.push_back({"z.large", DType::kBF16, {1 << 20}, Encoding::kShuffleZstd});
  SaveHandle handle;
  {
    auto w = Writer::Create(path, Options(2, *pool));
    ASSERT_TRUE(w.ok());
    for (size_t k = 0; k < big.size(); ++k) {
      auto bytes = Content(big[k], 50 + k);
      ASSERT_TRUE(w->AddTensor(big[k].name, big[k].dtype, big[k].shape, bytes.data(), bytes.size(),
                               big[k].encoding)
                      .ok());
    }
    ASSERT_TRUE(w->WaitSnapshot().ok());
    auto h = w->CommitAsync();
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    handle = std::move(*h);
    // The writer is spent; the save goes on without it.
    EXPECT_EQ(w->Commit().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(w->CommitAsync().status().code(), StatusCode::kInvalidArgument);
  }
  Status st = handle.Wait();
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE(handle.done());
  EXPECT_TRUE(handle.Wait().ok());  // the same answer again
  ExpectContent(path, big, 50);
  EXPECT_EQ(DirEntries(dir.path()), std::set<std::string>{"async.ferry"});
}

TEST(SaveTest, DroppedHandleStillCommits) {
  TempDir dir;
  const std::string path = dir.File("dropped.ferry");
  auto pool = StagingPool::Create(1 << 20);
  ASSERT_TRUE(pool.ok());
  {
    auto w = Writer::Create(path, Options(2, *pool));
    ASSERT_TRUE(w.ok());
    for (size_t k = 0; k < kDefs.size(); ++k) {
      auto bytes = Content(kDefs[k], 7 + k);
      ASSERT_TRUE(w->AddTensor(kDefs[k].name, kDefs[k].dtype, kDefs[k].shape, bytes.data(),
                               bytes.size(), kDefs[k].encoding)
                      .ok());
    }
    ASSERT_TRUE(w->SetMetadata("seed", "7").ok());
    auto h = w->CommitAsync();
    ASSERT_TRUE(h.ok());
  }  // the handle's destructor waits for the save
  ExpectContent(path, kDefs, 7);
  SaveHandle empty;
  EXPECT_EQ(empty.Wait().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(empty.done());
}

TEST(SaveTest, FailedAsyncCommitKeepsThePreviousFile) {
  TempDir dir;
  // The final name becomes a non-empty directory while the save runs: the commit fails after
  // all the data was written (a directory there at the start is refused by Create).
  const std::string path = dir.File("taken");
  auto pool = StagingPool::Create(1 << 20);
  ASSERT_TRUE(pool.ok());
  auto w = Writer::Create(path, Options(2, *pool));
  ASSERT_TRUE(w.ok());
  auto bytes = RandomBytes(10000, 3);
  ASSERT_TRUE(w->AddTensor("t", DType::kU8, {10000}, bytes.data(), bytes.size()).ok());
  fs::create_directory(path);
  std::ofstream(path + "/keep") << "x";
  auto h = w->CommitAsync();
  ASSERT_TRUE(h.ok());
  Status st = h->Wait();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("is a directory, not a regular file"), std::string::npos);
  EXPECT_NE(st.message().find(path), std::string::npos) << st.message();
  EXPECT_EQ(DirEntries(dir.path()), std::set<std::string>{"taken"});
  EXPECT_TRUE(fs::exists(path + "/keep"));
}

TEST(SaveTest, FailingSourceSpoilsTheSaveButNotThePreviousFile) {
  TempDir dir;
  const std::string path = dir.File("m.ferry");
  ASSERT_TRUE(WriteDefs(path, kDefs, 1, Options(2), false).ok());
  auto pool = StagingPool::Create(1 << 20);
  ASSERT_TRUE(pool.ok());
  auto w = Writer::Create(path, Options(2, *pool));
  ASSERT_TRUE(w.ok());
  auto bytes = RandomBytes(20000, 1);
  ASSERT_TRUE(w->AddTensor("first", DType::kU8, {20000}, bytes.data(), 20000).ok());
  FillFn fill = [](uint64_t offset, void* dst, size_t size) {
    if (offset >= 8192) return Status(StatusCode::kIoError, "socket closed");
    std::memset(dst, 1, size);
    return Status::Ok();
  };
  Status st = w->AddTensorFrom("pulled", DType::kU8, {20000}, fill, Encoding::kZstd);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_EQ(st.message(), path + ": tensor 'pulled': source failed at byte 8192: socket closed");
  // Later calls report the same failure; nothing replaces the file.
  EXPECT_EQ(w->AddTensor("later", DType::kU8, {4}, bytes.data(), 4).code(), StatusCode::kIoError);
  EXPECT_EQ(w->CommitAsync().status().code(), StatusCode::kIoError);
  ExpectContent(path, kDefs, 1);
  EXPECT_EQ(DirEntries(dir.path()), std::set<std::string>{"m.ferry"});
}

// The progress callback sees every block once, in a growing total that ends at the tensor
// bytes; called with and without a pool, whatever the thread count.
TEST(SaveTest, ProgressCountsEveryBlockOnce) {
  TempDir dir;
  uint64_t total = 0;
  for (const Def& d : kDefs) total += *StorageBytes(d.dtype, *NumElements(d.shape));
  for (bool pooled : {false, true}) {
    for (int threads : {1, 3}) {
      std::shared_ptr<StagingPool> pool;
      if (pooled) pool = *StagingPool::Create(1 << 20);
      WriterOptions o = Options(threads, pool);
      std::vector<uint64_t> seen;
      std::atomic<int> inside{0};
      bool overlapped = false;
      o.progress = [&](uint64_t written) {
        overlapped |= inside.fetch_add(1) != 0;
        seen.push_back(written);
        inside.fetch_sub(1);
        return Status::Ok();
      };
      const std::string path = dir.File("p" + std::to_string(pooled) + std::to_string(threads));
      ASSERT_TRUE(WriteDefs(path, kDefs, 5, o, pooled).ok());
      ExpectContent(path, kDefs, 5);
      EXPECT_FALSE(overlapped) << "two progress calls ran at once";
      ASSERT_FALSE(seen.empty());
      EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
      EXPECT_EQ(seen.back(), total) << "pooled " << pooled << ", threads " << threads;
    }
  }
}

// Small tensors travel in batches: thousands of them reach the file in a few writes (one
// progress call each), not one hand-off and write per tensor, and the file is the same as
// one written tensor by tensor (a small tensor between large ones, every encoding, with and
// without a pool, any thread count; a pulled small tensor too).
TEST(SaveTest, SmallTensorsTravelInBatches) {
  TempDir dir;
  std::vector<Def> defs;
  for (int i = 0; i < 5000; ++i) {
    const Encoding e = static_cast<Encoding>(i % 4);
    defs.push_back({"s." + std::to_string(i), DType::kBF16, {i % 7 == 0 ? 0 : 1 + i % 40}, e});
    if (i % 1000 == 999) {
      defs.push_back({"big." + std::to_string(i), DType::kF32, {70000}, e});  // 280 KB: no batch
    }
  }
  uint64_t total = 0;
  for (const Def& d : defs) total += *StorageBytes(d.dtype, *NumElements(d.shape));
  std::vector<uint8_t> reference;
  for (bool pooled : {false, true}) {
    for (int threads : {1, 3}) {
      std::shared_ptr<StagingPool> pool;
      if (pooled) pool = *StagingPool::Create(1 << 20);
      WriterOptions o = Options(threads, pool);
      std::atomic<int> calls{0};
      o.progress = [&](uint64_t written) {
        ++calls;
        return Status::Ok();
      };
      const std::string path = dir.File("b" + std::to_string(pooled) + std::to_string(threads));
      ASSERT_TRUE(WriteDefs(path, defs, 9, o, false).ok());
      ExpectContent(path, defs, 9);
      // One call per batch of small tensors (each big tensor ends one), one per block of the
      // big ones: not one per tensor.
      const uint64_t big_blocks = (280000 + o.block_size - 1) / o.block_size;
      EXPECT_EQ(calls.load(), 5 + 5 * big_blocks) << "pooled " << pooled << ", threads " << threads;
      if (reference.empty()) {
        reference = FileBytes(path);
      } else {
        EXPECT_TRUE(FileBytes(path) == reference) << "pooled " << pooled << ", threads " << threads;
      }
    }
  }
  // A pulled small tensor, and one whose source fails: the failure names the tensor and the
  // byte, and spoils the save.
  auto w = Writer::Create(dir.File("pulled.ferry"), Options(2));
  ASSERT_TRUE(w.ok());
  FillFn ok = [](uint64_t, void* dst, size_t size) {
    std::memset(dst, 3, size);
    return Status::Ok();
  };
  FillFn bad = [](uint64_t, void*, size_t) { return Status(StatusCode::kIoError, "gone"); };
  ASSERT_TRUE(w->AddTensorFrom("p", DType::kU8, {100}, ok, Encoding::kZstd).ok());
  Status st = w->AddTensorFrom("q", DType::kU8, {100}, bad, Encoding::kRaw);
  EXPECT_EQ(st.message(), dir.File("pulled.ferry") + ": tensor 'q': source failed at byte 0: gone");
  EXPECT_EQ(w->Commit().code(), StatusCode::kIoError);
}

// A progress callback that says stop fails the save with its status; the previous file stays
// and no temporary file is left.
TEST(SaveTest, ProgressCanStopTheSave) {
  TempDir dir;
  const std::string path = dir.File("m.ferry");
  ASSERT_TRUE(WriteDefs(path, kDefs, 1, Options(2), false).ok());
  for (bool pooled : {false, true}) {
    std::shared_ptr<StagingPool> pool;
    if (pooled) pool = *StagingPool::Create(1 << 20);
    WriterOptions o = Options(2, pool);
    int calls = 0;
    o.progress = [&](uint64_t written) {
      ++calls;
      return written >= 8192 ? Status(StatusCode::kIoError, "stopped by the test") : Status::Ok();
    };
    Status st = WriteDefs(path, kDefs, 2, o, pooled);
    EXPECT_EQ(st.code(), StatusCode::kIoError) << st.ToString();
    EXPECT_NE(st.message().find("stopped by the test"), std::string::npos) << st.message();
    EXPECT_GE(calls, 1);
    ExpectContent(path, kDefs, 1);
    EXPECT_EQ(DirEntries(dir.path()), std::set<std::string>{"m.ferry"});
  }
}

TEST(SaveTest, AbortAndDestructionDropTheTemporaryFile) {
  TempDir dir;
  const std::string path = dir.File("x.ferry");
  auto pool = StagingPool::Create(2 * 4096);
  ASSERT_TRUE(pool.ok());
  auto bytes = RandomBytes(1 << 20, 4);
  for (bool abort : {true, false}) {
    auto w = Writer::Create(path, Options(3, *pool));
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(
        w->AddTensor("t", DType::kU8, {1 << 20}, bytes.data(), bytes.size(), Encoding::kZstd).ok());
    if (abort) {
      w->Abort();
      EXPECT_EQ(w->Commit().code(), StatusCode::kInvalidArgument);
    }
  }
  EXPECT_TRUE(DirEntries(dir.path()).empty());
  // The pool came back whole.
  auto all = (*pool)->impl().Acquire(2 * 4096);
  ASSERT_TRUE(all.ok());
  (*pool)->impl().Release(all->id);
}

TEST(SaveTest, BlockLargerThanThePoolIsRefused) {
  TempDir dir;
  auto pool = StagingPool::Create(8192);
  ASSERT_TRUE(pool.ok());
  WriterOptions o = Options(1, *pool);
  o.block_size = 16384;
  auto w = Writer::Create(dir.File("m.ferry"), o);
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(w.status().message().find("exceeds the staging pool"), std::string::npos);
}

TEST(SaveTest, DeviceSourceWithoutAGpuIsAClearError) {
  if (CudaAvailable()) GTEST_SKIP() << "a GPU is present";
  TempDir dir;
  auto w = Writer::Create(dir.File("m.ferry"), Options(1));
  ASSERT_TRUE(w.ok());
  uint8_t fake[16] = {};
  Status st = w->AddDeviceTensor("t", DType::kU8, {16}, fake, 16, nullptr);
  EXPECT_TRUE(st.code() == StatusCode::kUnimplemented || st.code() == StatusCode::kCudaError)
      << st.ToString();
  EXPECT_NE(st.message().find("'t'"), std::string::npos) << st.message();
  // Nothing was staged: the writer still works.
  ASSERT_TRUE(w->AddTensor("h", DType::kU8, {16}, fake, 16).ok());
  ASSERT_TRUE(w->Commit().ok());
}

// ---- device sources -----------------------------------------------------------------------

#ifdef FERRY_HAVE_CUDA

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

class DeviceSaveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device";
  }
  void TearDown() override {
    for (void* p : buffers_) cudaFree(p);
  }
  uint8_t* Upload(const std::vector<uint8_t>& bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes.size(), 1)), cudaSuccess);
    buffers_.push_back(p);
    EXPECT_EQ(cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
    return static_cast<uint8_t*>(p);
  }
  std::vector<void*> buffers_;
};

TEST_F(DeviceSaveTest, RoundTripIsBitExactSyncAndAsync) {
  TempDir dir;
  std::vector<uint8_t*> dev;
  for (size_t k = 0; k < kDefs.size(); ++k) dev.push_back(Upload(Content(kDefs[k], 30 + k)));
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto pool = StagingPool::Create(4 * 4096, true);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_TRUE((*pool)->pinned());
  for (int mode = 0; mode < 3; ++mode) {  // internal pool, shared pool sync, shared pool async
    SCOPED_TRACE(mode);
    const std::string path = dir.File("dev.ferry");
    auto w = Writer::Create(path, Options(3, mode == 0 ? nullptr : *pool));
    ASSERT_TRUE(w.ok());
    for (size_t k = 0; k < kDefs.size(); ++k) {
      uint64_t n = *StorageBytes(kDefs[k].dtype, *NumElements(kDefs[k].shape));
      Status st = w->AddDeviceTensor(kDefs[k].name, kDefs[k].dtype, kDefs[k].shape, dev[k], n,
                                     reinterpret_cast<Stream>(stream), kDefs[k].encoding);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
    ASSERT_TRUE(w->SetMetadata("seed", "30").ok());
    if (mode == 2) {
      auto h = w->CommitAsync();
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      ASSERT_TRUE(h->Wait().ok());
    } else {
      ASSERT_TRUE(w->Commit().ok());
    }
    ExpectContent(path, kDefs, 30);
  }
  cudaStreamDestroy(stream);
}

// The copies run in stream order: after work the caller enqueued before the add, and before
// work enqueued after it, with no synchronization by the caller.
TEST_F(DeviceSaveTest, CopiesFollowTheCallersStream) {
  TempDir dir;
  const size_t n = size_t{64} << 20;
  uint8_t* buf = Upload(std::vector<uint8_t>(n, 0x11));
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // A host function that sleeps holds the stream, so a writer that read early would see 0x11.
  ASSERT_CUDA(cudaLaunchHostFunc(
      stream, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }, nullptr));
  ASSERT_CUDA(cudaMemsetAsync(buf, 0xAB, n, stream));
  const std::string path = dir.File("order.ferry");
  WriterOptions o = Options(4);
  o.block_size = 1 << 20;
  auto w = Writer::Create(path, o);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(w->AddDeviceTensor("t", DType::kU8, {static_cast<int64_t>(n)}, buf, n,
                                 reinterpret_cast<Stream>(stream))
                  .ok());
  // Overwrites enqueued after the add must not reach the file.
  ASSERT_CUDA(cudaMemsetAsync(buf, 0xCD, n, stream));
  ASSERT_TRUE(w->Commit().ok());
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok());
  std::vector<uint8_t> got(n);
  ASSERT_TRUE((*r)->ReadInto("t", got.data(), n, {true}).ok());
  EXPECT_EQ(got, std::vector<uint8_t>(n, 0xAB));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
}

TEST_F(DeviceSaveTest, AsyncSaveSnapshotsBeforeReturning) {
  TempDir dir;
  const size_t n = size_t{32} << 20;
  auto want = RandomBytes(n, 99);
  uint8_t* buf = Upload(want);
  for (uint64_t pool_bytes : {uint64_t{64} << 20, uint64_t{4} << 20}) {  // larger, smaller
    SCOPED_TRACE(pool_bytes);
    auto pool = StagingPool::Create(pool_bytes, true);
    ASSERT_TRUE(pool.ok());
    const std::string path = dir.File("snap.ferry");
    WriterOptions o = Options(4, *pool);
    o.block_size = 1 << 20;
    auto w = Writer::Create(path, o);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->AddDeviceTensor("t", DType::kBF16, {static_cast<int64_t>(n / 2)}, buf, n,
                                   nullptr, Encoding::kShuffleZstd)
                    .ok());
    auto h = w->CommitAsync();
    ASSERT_TRUE(h.ok());
    // Overwrite the source at once, outside any stream order with the save.
    ASSERT_CUDA(cudaMemset(buf, 0, n));
    ASSERT_CUDA(cudaDeviceSynchronize());
    ASSERT_TRUE(h->Wait().ok());
    auto r = Reader::Open(path);
    ASSERT_TRUE(r.ok());
    std::vector<uint8_t> got(n);
    ASSERT_TRUE((*r)->ReadInto("t", got.data(), n, {true}).ok());
    EXPECT_EQ(got, want);
    ASSERT_CUDA(cudaMemcpy(buf, want.data(), n, cudaMemcpyHostToDevice));
  }
}

TEST_F(DeviceSaveTest, RefusesMemoryThatIsNotOnTheCurrentDevice) {
  TempDir dir;
  auto w = Writer::Create(dir.File("m.ferry"), Options(1));
  ASSERT_TRUE(w.ok());
  std::vector<uint8_t> host(64);
  Status st = w->AddDeviceTensor("h", DType::kU8, {64}, host.data(), 64, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("not device memory"), std::string::npos) << st.message();
  int count = 0;
  cudaGetDeviceCount(&count);
  if (count >= 2) {
    int cur = 0;
    cudaGetDevice(&cur);
    int other = cur == 0 ? 1 : 0;
    void* p = nullptr;
    ASSERT_CUDA(cudaSetDevice(other));
    ASSERT_CUDA(cudaMalloc(&p, 64));
    ASSERT_CUDA(cudaSetDevice(cur));
    st = w->AddDeviceTensor("o", DType::kU8, {64}, p, 64, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find("make device " + std::to_string(other) + " current"),
              std::string::npos)
        << st.message();
    cudaFree(p);
  }
  ASSERT_TRUE(w->Commit().ok());
}

#endif  // FERRY_HAVE_CUDA

}  // namespace
}  // namespace ferry
