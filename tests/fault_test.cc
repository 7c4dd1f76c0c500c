// Fault injection: a writer killed at random points, a full disk, signals interrupting every
// system call, a file truncated or rewritten under an open reader, and many threads sharing
// one reader. Each must end in the old checkpoint, the new one, or a clean error; never a torn
// file, a wrong byte or a crash. No GPU needed.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "codec/codec.hpp"
#include "ferry/ferry.hpp"
#include "ferry/loader.hpp"
#include "ferry/sharded.hpp"
#include "format/safetensors.hpp"
#include "io/io.hpp"
#include "save_group.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using testing::RandomBytes;
using testing::TempDir;
using testing::TensorBytes;

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// ---- checkpoints whose every byte follows from (generation, tensor) -----------------------

struct TensorDef {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  Encoding encoding;
};

std::vector<uint8_t> Content(const TensorDef& t, uint64_t generation, size_t index) {
  uint64_t n = *StorageBytes(t.dtype, *NumElements(t.shape));
  // Compressed tensors really compress (and take longer to write).
  return TensorBytes(n, generation * 1000 + index, t.encoding != Encoding::kRaw);
}

Status WriteGeneration(const std::string& path, const std::vector<TensorDef>& defs,
                       uint64_t generation, bool durable, int threads = 2) {
  WriterOptions o;
  o.durable = durable;
  o.threads = threads;
  o.block_size = 1 << 20;
  auto w = Writer::Create(path, o);
  if (!w.ok()) return w.status();
  for (size_t k = 0; k < defs.size(); ++k) {
    auto bytes = Content(defs[k], generation, k);
    Status st = w->AddTensor(defs[k].name, defs[k].dtype, defs[k].shape, bytes.data(), bytes.size(),
                             defs[k].encoding);
    if (!st.ok()) return st;
  }
  Status st = w->SetMetadata("generation", std::to_string(generation));
  if (!st.ok()) return st;
  return w->Commit();
}

// Opens `path`, verifies every checksum, and checks that its bytes are exactly generation g's;
// returns g.
uint64_t CheckComplete(const std::string& path, const std::vector<TensorDef>& defs) {
  auto r = Reader::Open(path);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (!r.ok()) return UINT64_MAX;
  Status st = (*r)->VerifyAll();
  EXPECT_TRUE(st.ok()) << st.ToString();
  auto g = (*r)->metadata("generation");
  EXPECT_TRUE(g.has_value());
  if (!g) return UINT64_MAX;
  uint64_t generation = std::stoull(*g);
  EXPECT_EQ((*r)->num_tensors(), defs.size());
  for (size_t k = 0; k < defs.size(); ++k) {
    auto want = Content(defs[k], generation, k);
    std::vector<uint8_t> got(want.size() + 1);
    EXPECT_TRUE((*r)->ReadInto(defs[k].name, got.data(), want.size()).ok());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0) << defs[k].name;
  }
  return generation;
}

// Names in `dir` other than `keep`.
std::vector<std::string> Leftovers(const std::string& dir, const std::string& keep) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename() != keep) out.push_back(e.path().filename().string());
  }
  return out;
}

const std::vector<TensorDef> kLarge = {
    {"a.raw", DType::kU8, {24 << 20}, Encoding::kRaw},
    {"b.shuffled", DType::kBF16, {4096, 1024}, Encoding::kShuffleZstd},
    {"c.zstd", DType::kF32, {1 << 20}, Encoding::kZstd},
    {"d.small", DType::kF64, {3, 5}, Encoding::kRaw},
};

// ---- (a) the writer killed with SIGKILL at random points ----------------------------------

TEST(FaultTest, KilledWriterLeavesOldOrNewCheckpoint) {
  TempDir dir;
  const std::string path = dir.File("model.ferry");
  ASSERT_TRUE(WriteGeneration(path, kLarge, 1, true).ok());
  ASSERT_EQ(CheckComplete(path, kLarge), 1u);

  auto run_child = [&](uint64_t generation, bool durable) {
    pid_t pid = ::fork();
    if (pid == 0) {
      Status st = WriteGeneration(path, kLarge, generation, durable);
      ::_exit(st.ok() ? 0 : 1);
    }
    return pid;
  };
  // How long an uninterrupted write takes (the faster of two runs), so that kill times spread
  // over the whole write.
  auto full = std::chrono::steady_clock::duration::max();
  uint64_t current = 0;
  for (uint64_t generation : {2, 3}) {
    auto t0 = std::chrono::steady_clock::now();
    pid_t pid = run_child(generation, false);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    full = std::min(full, std::chrono::steady_clock::now() - t0);
    current = CheckComplete(path, kLarge);
    ASSERT_EQ(current, generation);
  }

  std::mt19937_64 rng(20261107);
  const auto full_us = std::chrono::duration_cast<std::chrono::microseconds>(full).count();
  int completed = 0, killed = 0;
  for (uint64_t round = 4; round < 4 + 24; ++round) {
    const bool durable = round % 4 == 0;
    const auto delay = std::chrono::microseconds(rng() % static_cast<uint64_t>(full_us + 1));
    int status = 0;
    pid_t pid = run_child(round, durable);
    ASSERT_GT(pid, 0);
    std::this_thread::sleep_for(delay);
    ::kill(pid, SIGKILL);
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    if (WIFEXITED(status)) {
      ASSERT_EQ(WEXITSTATUS(status), 0) << "round " << round;
      ++completed;
    } else {
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
      ++killed;
    }
    // The path holds a complete checkpoint: the previous one, or this round's.
    uint64_t now = CheckComplete(path, kLarge);
    ASSERT_TRUE(now == current || now == round)
        << "round " << round << " left generation " << now << " (before: " << current << ")";
    if (WIFEXITED(status)) {
      EXPECT_EQ(now, round);
    }
    current = now;
    // A killed writer cannot remove its temporary file; nothing else may be left.
    for (const std::string& name : Leftovers(dir.path(), "model.ferry")) {
      EXPECT_EQ(name.rfind("model.ferry.tmp.", 0), 0u) << name;
      fs::remove(dir.File(name));
    }
  }
  RecordProperty("completed", completed);
  RecordProperty("killed", killed);
  EXPECT_GT(killed, 0);
}

// Kills a child running write(generation, durable) at random points of a save, `rounds` times;
// after each, check() must find the previous generation or the new one complete, and
// leftover(name) must accept every file in `dir` besides those check() needs.
void KillRounds(const std::string& dir, const std::function<Status(uint64_t, bool)>& write,
                const std::function<uint64_t()>& check,
                const std::function<bool(const std::string&)>& allowed, int rounds) {
  auto run_child = [&](uint64_t generation, bool durable) {
    pid_t pid = ::fork();
    if (pid == 0) {
      Status st = write(generation, durable);
      if (!st.ok()) std::fprintf(stderr, "%s\n", st.ToString().c_str());
      ::_exit(st.ok() ? 0 : 1);
    }
    return pid;
  };
  auto full = std::chrono::steady_clock::duration::max();
  uint64_t current = 0;
  for (uint64_t generation : {2, 3}) {
    auto t0 = std::chrono::steady_clock::now();
    pid_t pid = run_child(generation, false);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    full = std::min(full, std::chrono::steady_clock::now() - t0);
    current = check();
    ASSERT_EQ(current, generation);
  }
  std::mt19937_64 rng(20261130);
  const auto full_us = std::chrono::duration_cast<std::chrono::microseconds>(full).count();
  int killed = 0;
  for (uint64_t round = 4; round < 4 + static_cast<uint64_t>(rounds); ++round) {
    const bool durable = round % 4 == 0;
    const auto delay = std::chrono::microseconds(rng() % static_cast<uint64_t>(full_us + 1));
    int status = 0;
    pid_t pid = run_child(round, durable);
    ASSERT_GT(pid, 0);
    std::this_thread::sleep_for(delay);
    ::kill(pid, SIGKILL);
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    if (WIFEXITED(status)) {
      ASSERT_EQ(WEXITSTATUS(status), 0) << "round " << round;
    } else {
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
      ++killed;
    }
    uint64_t now = check();
    ASSERT_TRUE(now == current || now == round)
        << "round " << round << " left generation " << now << " (before: " << current << ")";
    if (WIFEXITED(status)) EXPECT_EQ(now, round);
    current = now;
    for (const auto& e : fs::directory_iterator(dir)) {
      EXPECT_TRUE(allowed(e.path().filename().string())) << e.path();
    }
  }
  EXPECT_GT(killed, 0);
}

TEST(FaultTest, KilledAsyncWriterLeavesOldOrNewCheckpoint) {
  TempDir dir;
  const std::string path = dir.File("model.ferry");
  ASSERT_TRUE(WriteGeneration(path, kLarge, 1, true).ok());
  // A staging pool much smaller than the checkpoint: adds wait for writes, and the background
  // commit still has blocks to write when CommitAsync returns.
  auto write = [&](uint64_t generation, bool durable) -> Status {
    auto pool = StagingPool::Create(4 << 20);
    if (!pool.ok()) return pool.status();
    WriterOptions o;
    o.durable = durable;
    o.threads = 2;
    o.block_size = 1 << 20;
    o.staging = *pool;
    auto w = Writer::Create(path, o);
    if (!w.ok()) return w.status();
    for (size_t k = 0; k < kLarge.size(); ++k) {
      auto bytes = Content(kLarge[k], generation, k);
      Status st = w->AddTensor(kLarge[k].name, kLarge[k].dtype, kLarge[k].shape, bytes.data(),
                               bytes.size(), kLarge[k].encoding);
      if (!st.ok()) return st;
    }
    Status st = w->SetMetadata("generation", std::to_string(generation));
    if (!st.ok()) return st;
    auto h = w->CommitAsync();
    if (!h.ok()) return h.status();
    return h->Wait();
  };
  KillRounds(
      dir.path(), write, [&] { return CheckComplete(path, kLarge); },
      [&](const std::string& name) {
        if (name == "model.ferry") return true;
        if (name.rfind("model.ferry.tmp.", 0) == 0) {
          fs::remove(dir.File(name));  // a killed writer cannot remove its temporary file
          return true;
        }
        return false;
      },
      16);
}

TEST(FaultTest, KilledShardedSaveLeavesOldOrNewCheckpoint) {
  TempDir dir;
  const std::string index = dir.File("model.ferry.index.json");
  constexpr int kRanks = 2;
  // Rank r holds kLarge's tensors under "r<r>/"; the ranks are threads of the child.
  auto write = [&](uint64_t generation, bool durable) -> Status {
    testing::ThreadGroup group(kRanks);
    std::vector<Status> results(kRanks);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < kRanks; ++rank) {
      threads.emplace_back([&, rank] {
        ShardedSaveOptions o;
        o.writer.durable = durable;
        o.writer.threads = 1;
        o.writer.block_size = 1 << 20;
        o.metadata = {{"generation", std::to_string(generation)}};
        auto save = ShardedSave::Begin(index, group.Rank(rank), o);
        if (!save.ok()) {
          results[rank] = save.status();
          return;
        }
        for (size_t k = 0; k < kLarge.size(); ++k) {
          auto bytes = Content(kLarge[k], generation * 10 + rank, k);
          Status st = (*save)->writer().AddTensor("r" + std::to_string(rank) + "/" + kLarge[k].name,
                                                  kLarge[k].dtype, kLarge[k].shape, bytes.data(),
                                                  bytes.size(), kLarge[k].encoding);
          if (!st.ok()) results[rank] = st;
        }
        // Odd generations commit in the background.
        if (generation % 2) {
          Status st = (*save)->CommitAsync();
          Status fin = (*save)->Finish();
          results[rank] = st.ok() ? fin : st;
        } else {
          Status st = (*save)->Commit();
          if (results[rank].ok()) results[rank] = st;
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const Status& st : results) {
      if (!st.ok()) return st;
    }
    return Status::Ok();
  };
  ASSERT_TRUE(write(1, true).ok());
  auto check = [&]() -> uint64_t {
    auto ck = ShardedCheckpoint::Open(index, {true});
    EXPECT_TRUE(ck.ok()) << ck.status().ToString();
    if (!ck.ok()) return UINT64_MAX;
    uint64_t generation = UINT64_MAX;
    for (const auto& [k, v] : (*ck)->metadata()) {
      if (k == "generation") generation = std::stoull(v);
    }
    EXPECT_EQ((*ck)->num_tensors(), kRanks * kLarge.size());
    for (int rank = 0; rank < kRanks; ++rank) {
      for (size_t k = 0; k < kLarge.size(); ++k) {
        std::string name = "r" + std::to_string(rank) + "/" + kLarge[k].name;
        auto loc = (*ck)->Find(name);
        EXPECT_TRUE(loc.ok()) << name;
        if (!loc.ok()) return UINT64_MAX;
        auto want = Content(kLarge[k], generation * 10 + rank, k);
        std::vector<uint8_t> got(want.size());
        EXPECT_TRUE((*ck)->shard(loc->shard)->ReadInto(name, got.data(), got.size()).ok());
        EXPECT_EQ(got, want) << name;
      }
    }
    return generation;
  };
  KillRounds(
      dir.path(), write, check,
      [&](const std::string& name) {
        if (name == "model.ferry.index.json") return true;
        if (name.rfind("model.ferry.index.json.tmp.", 0) == 0) {
          fs::remove(dir.File(name));  // the index's temporary file, of a kill while it was made
          return true;
        }
        // Shards of the checkpoint in use, or orphans of a killed save (and temporary files),
        // which a later save's cleanup or an operator removes; drop them so rounds stay small.
        if (name.rfind("model-", 0) != 0) return false;
        auto ck = ShardedCheckpoint::Open(index);
        bool used = false;
        for (size_t i = 0; ck.ok() && i < (*ck)->num_shards(); ++i) {
          used = used || (*ck)->shard_name(i) == name;
        }
        if (!used) fs::remove(dir.File(name));
        return true;
      },
      12);
}

// ---- (b) out of space: RLIMIT_FSIZE makes write() fail with EFBIG -------------------------

// In a child: writes generation 2 over `path` with file size limited to `limit`. Exit codes:
// 0 IoError naming the file (not its temporary file) and EFBIG, and the temporary file gone,
// 10 success, 11 another code, 12 a message without the path or naming the temporary file,
// 13 the temporary file left behind, 14 a message without the errno.
int WriteWithFileSizeLimit(const std::string& dir, const std::string& path,
                           const std::vector<TensorDef>& defs, rlim_t limit, bool safetensors) {
  pid_t pid = ::fork();
  if (pid == 0) {
    // Ignored, SIGXFSZ does not kill the writer: write() returns EFBIG instead.
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {limit, limit};
    ::setrlimit(RLIMIT_FSIZE, &rl);
    Status st;
    if (safetensors) {
      std::vector<SafetensorsEntry> entries;
      for (const TensorDef& d : defs) entries.push_back({d.name, d.dtype, d.shape});
      auto w = SafetensorsWriter::Create(path, entries, {{"generation", "2"}}, true);
      st = w.ok() ? Status::Ok() : w.status();
      for (size_t k = 0; st.ok() && k < defs.size(); ++k) {
        auto bytes = Content(defs[k], 2, k);
        st = w->Write(bytes.data(), bytes.size());
      }
      if (st.ok()) st = w->Commit();
    } else {
      st = WriteGeneration(path, defs, 2, true, 1);
    }
    if (st.ok()) ::_exit(10);
    if (st.code() != StatusCode::kIoError) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      ::_exit(11);
    }
    if (!Contains(st.message(), path) || Contains(st.message(), ".tmp.")) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      ::_exit(12);
    }
    if (!Contains(st.message(), "errno " + std::to_string(EFBIG))) ::_exit(14);
    for (const auto& e : fs::directory_iterator(dir)) {
      if (Contains(e.path().filename().string(), ".tmp.")) ::_exit(13);
    }
    ::_exit(0);
  }
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

TEST(FaultTest, FileSizeLimitFailsCleanlyAndKeepsThePreviousFile) {
  const std::vector<TensorDef> defs = {
      {"a.raw", DType::kU8, {3 << 20}, Encoding::kRaw},
      {"b.zstd", DType::kBF16, {512 << 10}, Encoding::kShuffleZstd},
      {"c.small", DType::kI32, {7}, Encoding::kRaw},
  };
  TempDir dir;
  const std::string path = dir.File("model.ferry");
  // The new file's exact layout, to aim limits at its data, footer and trailer.
  const std::string probe = dir.File("probe.ferry");
  ASSERT_TRUE(WriteGeneration(probe, defs, 2, false).ok());
  const uint64_t total = fs::file_size(probe);
  std::vector<uint8_t> trailer(24);
  {
    File f = std::move(File::OpenRead(probe).value());
    ASSERT_TRUE(f.PReadAll(trailer.data(), 24, total - 24).ok());
  }
  uint64_t footer;
  std::memcpy(&footer, trailer.data(), 8);
  fs::remove(probe);
  ASSERT_TRUE(WriteGeneration(path, defs, 1, false).ok());

  const uint64_t footer_at = total - 24 - footer;
  for (uint64_t limit : {uint64_t{0}, uint64_t{100}, uint64_t{4096}, uint64_t{4097},
                         uint64_t{1} << 20, (uint64_t{3} << 20) + 4096, footer_at - 1, footer_at,
                         footer_at + footer / 2, total - 24, total - 1}) {
    SCOPED_TRACE("limit " + std::to_string(limit) + " of " + std::to_string(total));
    EXPECT_EQ(WriteWithFileSizeLimit(dir.path(), path, defs, limit, false), 0);
    EXPECT_TRUE(Leftovers(dir.path(), "model.ferry").empty());
    EXPECT_EQ(CheckComplete(path, defs), 1u);
  }
  EXPECT_EQ(WriteWithFileSizeLimit(dir.path(), path, defs, total, false), 10);
  EXPECT_EQ(CheckComplete(path, defs), 2u);
}

TEST(FaultTest, FileSizeLimitFailsCleanlyForSafetensors) {
  const std::vector<TensorDef> defs = {
      {"a", DType::kU8, {1 << 20}, Encoding::kRaw},
      {"b", DType::kBF16, {1000}, Encoding::kRaw},
  };
  TempDir dir;
  const std::string path = dir.File("model.safetensors");
  {
    std::vector<SafetensorsEntry> entries;
    for (const TensorDef& d : defs) entries.push_back({d.name, d.dtype, d.shape});
    auto w = SafetensorsWriter::Create(path, entries, {{"generation", "1"}}, false);
    ASSERT_TRUE(w.ok());
    for (size_t k = 0; k < defs.size(); ++k) {
      auto bytes = Content(defs[k], 1, k);
      ASSERT_TRUE(w->Write(bytes.data(), bytes.size()).ok());
    }
    ASSERT_TRUE(w->Commit().ok());
  }
  const uint64_t total = fs::file_size(path);
  for (uint64_t limit : {uint64_t{0}, uint64_t{10}, uint64_t{200}, uint64_t{1} << 19, total - 1}) {
    SCOPED_TRACE("limit " + std::to_string(limit));
    EXPECT_EQ(WriteWithFileSizeLimit(dir.path(), path, defs, limit, true), 0);
    EXPECT_TRUE(Leftovers(dir.path(), "model.safetensors").empty());
    auto r = Reader::Open(path);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ((*r)->metadata("generation"), "1");
  }
}

// A folder that does not exist: IoError naming the destination and the errno, for both
// writers (Python raises it as an OSError).
TEST(FaultTest, SaveErrorsNameTheDestination) {
  TempDir dir;
  const std::string path = dir.File("missing/model.ferry");
  auto w = Writer::Create(path, WriterOptions{});
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kIoError);
  EXPECT_EQ(w.status().message(),
            path + ": creating its temporary file failed (No such file or directory, errno " +
                std::to_string(ENOENT) + ")");
  auto st = SafetensorsWriter::Create(dir.File("missing/model.safetensors"), {}, {}, false);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.status().code(), StatusCode::kIoError);
  EXPECT_FALSE(Contains(st.status().message(), ".tmp.")) << st.status().message();
}

// ---- (b2) temporary files of killed writers ------------------------------------------------

// Forks a child that starts a save to `path`, writes a tensor into its temporary file, says so
// and waits to be killed.
pid_t StartWriterChild(const std::string& path) {
  int p[2];
  if (::pipe(p) != 0) return -1;
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(p[0]);
    WriterOptions o;
    o.durable = false;
    o.threads = 1;
    auto w = Writer::Create(path, o);
    std::vector<uint8_t> bytes(1 << 16, 7);
    if (!w.ok() || !w->AddTensor("a", DType::kU8, {1 << 16}, bytes.data(), bytes.size()).ok()) {
      ::_exit(1);
    }
    char c = 1;
    if (::write(p[1], &c, 1) != 1) ::_exit(2);
    for (;;) ::pause();
  }
  ::close(p[1]);
  char c = 0;
  const bool ready = ::read(p[0], &c, 1) == 1;
  ::close(p[0]);
  return ready ? pid : -1;
}

std::vector<std::string> Names(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void WriteBytes(const std::string& path, size_t n) {
  std::ofstream(path, std::ios::binary) << std::string(n, 'x');
}

TEST(FaultTest, SaveSweepsTemporaryFilesOfKilledWritersOnly) {
  TempDir dir;
  const std::string path = dir.File("model.ferry");
  // The live writer first: a writer's own start sweeps.
  const pid_t live = StartWriterChild(path);
  ASSERT_GT(live, 0);
  struct Reap {
    pid_t pid;
    ~Reap() {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } reap{live};
  const pid_t dead = StartWriterChild(path);
  ASSERT_GT(dead, 0);
  ASSERT_EQ(::kill(dead, SIGKILL), 0);
  ASSERT_EQ(::waitpid(dead, nullptr, 0), dead);
  const std::vector<std::string> before = Names(dir.path(), "model.ferry.tmp.");
  ASSERT_EQ(before.size(), 2u);
  const std::string dead_tag = ".tmp." + std::to_string(dead) + ".";
  const std::string stale = Contains(before[0], dead_tag) ? before[0] : before[1];
  const std::string lively = stale == before[0] ? before[1] : before[0];
  ASSERT_TRUE(Contains(stale, dead_tag));

  // Names of the dead writer's pid that must stay: one a live process holds locked (the lock
  // alone protects it), an empty one (a writer may not have locked it yet), and one of another
  // checkpoint.
  const std::string locked = "model.ferry" + dead_tag + "00000000000000aa";
  const std::string empty = "model.ferry" + dead_tag + "00000000000000bb";
  const std::string other = "other.ferry" + dead_tag + "00000000000000cc";
  WriteBytes(dir.File(locked), 100);
  WriteBytes(dir.File(empty), 0);
  WriteBytes(dir.File(other), 100);
  const int lock = ::open(dir.File(locked).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(lock, 0);
  ASSERT_EQ(::flock(lock, LOCK_EX), 0);
  // A save of this process still in flight.
  WriterOptions o;
  o.durable = false;
  auto mine = Writer::Create(path, o);
  ASSERT_TRUE(mine.ok());
  const std::vector<std::string> with_mine = Names(dir.path(), "model.ferry.tmp.");

  // The next save into the folder removes the killed writer's file, and only that.
  ASSERT_TRUE(WriteGeneration(path, kLarge, 1, false).ok());
  std::vector<std::string> want;
  for (const std::string& n : with_mine) {
    if (n != stale) want.push_back(n);
  }
  EXPECT_EQ(Names(dir.path(), "model.ferry.tmp."), want);
  EXPECT_TRUE(fs::exists(dir.File(lively)));
  EXPECT_TRUE(fs::exists(dir.File(other)));
  EXPECT_EQ(CheckComplete(path, kLarge), 1u);

  // Unlocked, the lookalike is the dead writer's garbage too; the safetensors writer sweeps
  // its own files the same way.
  ::close(lock);
  const std::string st_stale = "model.safetensors" + dead_tag + "00000000000000dd";
  WriteBytes(dir.File(st_stale), 100);
  ASSERT_TRUE(WriteGeneration(path, kLarge, 2, false).ok());
  EXPECT_FALSE(fs::exists(dir.File(locked)));
  EXPECT_TRUE(fs::exists(dir.File(empty)));
  auto sw = SafetensorsWriter::Create(dir.File("model.safetensors"), {}, {}, false);
  ASSERT_TRUE(sw.ok());
  EXPECT_FALSE(fs::exists(dir.File(st_stale)));
  sw->Abort();

  mine->Abort();
}

// ---- (c) EINTR and short transfers --------------------------------------------------------

// SIGALRM every 50 µs with a handler installed without SA_RESTART: slow system calls return
// EINTR or transfer less than asked, and every caller must carry on.
class SignalStorm {
 public:
  SignalStorm() {
    struct sigaction sa = {};
    sa.sa_handler = [](int) { count_.fetch_add(1, std::memory_order_relaxed); };
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;  // no SA_RESTART
    ::sigaction(SIGALRM, &sa, &old_);
    struct itimerval it = {{0, 50}, {0, 50}};
    ::setitimer(ITIMER_REAL, &it, nullptr);
  }
  ~SignalStorm() {
    struct itimerval off = {};
    ::setitimer(ITIMER_REAL, &off, nullptr);
    ::sigaction(SIGALRM, &old_, nullptr);
  }
  static uint64_t count() { return count_.load(); }

 private:
  struct sigaction old_;
  static inline std::atomic<uint64_t> count_{0};
};

TEST(FaultTest, InterruptedWritesToAPipeArriveWhole) {
  // A pipe makes short writes real: an interrupted write() returns what it moved so far.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const auto data = RandomBytes(48 << 20, 5);
  std::vector<uint8_t> got;
  std::thread reader([&] {
    std::vector<uint8_t> buf(100000);
    for (;;) {
      ssize_t n = ::read(fds[0], buf.data(), buf.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got.insert(got.end(), buf.begin(), buf.begin() + n);
    }
  });
  uint64_t before = SignalStorm::count();
  {
    SignalStorm storm;
    File out(fds[1], "pipe");
    Status st = out.WriteAll(data.data(), data.size());
    EXPECT_TRUE(st.ok()) << st.ToString();
  }  // closes the write end
  reader.join();
  ::close(fds[0]);
  EXPECT_GT(SignalStorm::count(), before);
  ASSERT_EQ(got.size(), data.size());
  EXPECT_EQ(got, data);
}

TEST(FaultTest, CheckpointRoundTripUnderSignalStorm) {
  TempDir dir;
  const std::string path = dir.File("model.ferry");
  uint64_t before = SignalStorm::count();
  SignalStorm storm;
  ASSERT_TRUE(WriteGeneration(path, kLarge, 7, true).ok());
  EXPECT_EQ(CheckComplete(path, kLarge), 7u);
  auto r = Reader::Open(path, {true});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  for (IoMode io : {IoMode::kPageCache, IoMode::kDirect}) {
    LoaderOptions o;
    o.io = io;
    o.verify = true;
    o.threads = 4;
    auto loader = Loader::Create(o);
    ASSERT_TRUE(loader.ok());
    auto out = (*loader)->LoadToHost(**r, {});
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    for (size_t k = 0; k < kLarge.size(); ++k) {
      const LoadedTensor& t = (*out)[k];
      auto want = Content(kLarge[k], 7, k);
      ASSERT_EQ(t.nbytes, want.size());
      EXPECT_EQ(std::memcmp(t.data, want.data(), want.size()), 0) << t.info.name;
    }
  }
  EXPECT_GT(SignalStorm::count(), before);
  RecordProperty("signals", static_cast<int>(SignalStorm::count() - before));
}

// ---- (d) the file truncated or rewritten after open ---------------------------------------

class TruncationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.File("model.ferry");
    ASSERT_TRUE(WriteGeneration(path_, defs_, 3, false).ok());
    auto r = Reader::Open(path_);
    ASSERT_TRUE(r.ok());
    reader_ = *r;
    size_ = fs::file_size(path_);
  }

  void ExpectShrank(const Status& st) {
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
    EXPECT_TRUE(Contains(st.message(), path_)) << st.ToString();
    EXPECT_TRUE(Contains(st.message(), "shrank")) << st.ToString();
  }

  const std::vector<TensorDef> defs_ = {
      {"raw", DType::kF32, {300, 1000}, Encoding::kRaw},
      {"shuffled", DType::kBF16, {600, 1000}, Encoding::kShuffleZstd},
      {"zstd", DType::kU8, {1 << 20}, Encoding::kZstd},
      {"noise", DType::kU16, {300000}, Encoding::kShuffleZstd},  // stored chunks
  };
  TempDir dir_;
  std::string path_;
  std::shared_ptr<Reader> reader_;
  uint64_t size_ = 0;
};

TEST_F(TruncationTest, EveryPageCacheReadReportsTheShrunkFile) {
  ASSERT_EQ(::truncate(path_.c_str(), 4096 + 100), 0);
  std::vector<uint8_t> buf(4 << 20);
  for (const TensorDef& d : defs_) {
    SCOPED_TRACE(d.name);
    for (bool verify : {false, true}) {
      ExpectShrank(reader_->ReadInto(d.name, buf.data(), buf.size(), {verify}));
      ExpectShrank(reader_->ReadRowsInto(d.name, 1, 2, buf.data(), buf.size(), {verify}));
    }
    ExpectShrank(reader_->Verify(d.name));
  }
  ExpectShrank(reader_->View("raw", {true}).status());
  ExpectShrank(reader_->VerifyAll());
  LoaderOptions o;
  o.io = IoMode::kPageCache;
  for (bool verify : {false, true}) {
    o.verify = verify;
    auto loader = Loader::Create(o);
    auto out = (*loader)->LoadToHost(*reader_, {});
    ASSERT_FALSE(out.ok());
    ExpectShrank(out.status());
  }
  // Metadata comes from the copy of the footer taken at open.
  EXPECT_EQ(reader_->metadata("generation"), "3");
  EXPECT_EQ(reader_->num_tensors(), defs_.size());
}

TEST_F(TruncationTest, ReadsSucceedAgainOnceTheFileIsWhole) {
  std::vector<uint8_t> original(size_);
  {
    File f = std::move(File::OpenRead(path_).value());
    ASSERT_TRUE(f.PReadAll(original.data(), size_, 0).ok());
  }
  ASSERT_EQ(::truncate(path_.c_str(), size_ / 2), 0);
  std::vector<uint8_t> buf(4 << 20);
  ExpectShrank(reader_->VerifyAll());
  // Rewritten in place with the same bytes (as `cp` would): the mapping sees them again.
  int fd = ::open(path_.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, original.data(), original.size(), 0), static_cast<ssize_t>(size_));
  ::close(fd);
  EXPECT_TRUE(reader_->VerifyAll().ok());
  ASSERT_TRUE(reader_->ReadInto("raw", buf.data(), buf.size(), {true}).ok());
  EXPECT_EQ(std::memcmp(buf.data(), Content(defs_[0], 3, 0).data(), 1200000), 0);
}

TEST_F(TruncationTest, RewrittenBytesFailVerification) {
  // Same size, other bytes: nothing faults, and checksums tell.
  int fd = ::open(path_.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  auto junk = RandomBytes(size_ - 8192 - 4096, 99);
  ASSERT_EQ(::pwrite(fd, junk.data(), junk.size(), 4096), static_cast<ssize_t>(junk.size()));
  ::close(fd);
  std::vector<uint8_t> buf(4 << 20);
  for (const TensorDef& d : defs_) {
    Status st = reader_->ReadInto(d.name, buf.data(), buf.size(), {true});
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << d.name << ": " << st.ToString();
  }
}

TEST_F(TruncationTest, DirectReadsReportTruncation) {
  ASSERT_EQ(::truncate(path_.c_str(), 4096 + 100), 0);
  LoaderOptions o;
  o.io = IoMode::kDirect;
  auto loader = Loader::Create(o);
  auto out = (*loader)->LoadToHost(*reader_, {});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kDataLoss) << out.status().ToString();
  EXPECT_TRUE(Contains(out.status().message(), path_)) << out.status().ToString();
}

// The file shrinks and grows back while 8 threads read: every read is either right or a
// clean DataLoss, whichever moment the fault lands on.
TEST_F(TruncationTest, ConcurrentTruncationRace) {
  std::vector<uint8_t> original(size_);
  {
    File f = std::move(File::OpenRead(path_).value());
    ASSERT_TRUE(f.PReadAll(original.data(), size_, 0).ok());
  }
  std::vector<std::vector<uint8_t>> want;
  for (size_t k = 0; k < defs_.size(); ++k) want.push_back(Content(defs_[k], 3, k));
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> ok{0}, shrank{0};
  std::thread mutator([&] {
    int fd = ::open(path_.c_str(), O_WRONLY);
    for (int i = 0; i < 200 && fd >= 0; ++i) {
      (void)::ftruncate(fd, static_cast<off_t>(4096 + (i * 7919) % (size_ / 2)));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      (void)::pwrite(fd, original.data(), original.size(), 0);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (fd >= 0) ::close(fd);
    stop = true;
  });
  std::vector<std::thread> readers;
  for (int t = 0; t < 8; ++t) {
    readers.emplace_back([&, t] {
      std::vector<uint8_t> buf(4 << 20);
      for (size_t n = 0; !stop; ++n) {
        size_t k = (n + t) % defs_.size();
        Status st = reader_->ReadInto(defs_[k].name, buf.data(), buf.size(), {true});
        if (st.ok()) {
          ok++;
          EXPECT_EQ(std::memcmp(buf.data(), want[k].data(), want[k].size()), 0);
        } else {
          shrank++;
          // A fault, or a checksum over pages caught half rewritten: both DataLoss.
          EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
        }
      }
    });
  }
  mutator.join();
  for (auto& r : readers) r.join();
  RecordProperty("reads_ok", static_cast<int>(ok.load()));
  RecordProperty("reads_data_loss", static_cast<int>(shrank.load()));
  EXPECT_GT(ok + shrank, 0u);
  EXPECT_TRUE(reader_->VerifyAll().ok());
}

// Only faults inside a guarded read are turned into errors: a SIGBUS anywhere else (here: a
// zero-copy view touched after the truncation) still kills the process as it did before.
TEST_F(TruncationTest, OtherFaultsStillReachThePreviousHandler) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto view = reader_->View("raw");
  ASSERT_TRUE(view.ok());
  // Installs the guard's handler (a guarded read has happened in this process).
  std::vector<uint8_t> buf(4000);
  ASSERT_TRUE(reader_->ReadRowsInto("raw", 0, 1, buf.data(), buf.size()).ok());
  ASSERT_EQ(::truncate(path_.c_str(), 4096), 0);
  EXPECT_DEATH(
      {
        // The dying child skips destructors: it removes its own scratch directory first (the
        // mapping keeps the truncated file alive).
        std::error_code ec;
        fs::remove_all(dir_.path(), ec);
        const volatile uint8_t* p = static_cast<const uint8_t*>(view->data);
        uint64_t sum = 0;
        for (uint64_t i = 0; i < view->nbytes; i += 4096) sum += p[i];
        std::printf("%llu\n", static_cast<unsigned long long>(sum));
      },
      "");
}

// ---- (e) many threads, one reader -----------------------------------------------------------

TEST(FaultTest, ManyThreadsShareOneReader) {
  TempDir dir;
  const std::string path = dir.File("model.ferry");
  std::vector<TensorDef> defs;
  for (int i = 0; i < 24; ++i) {
    Encoding enc = static_cast<Encoding>(i % 3);
    defs.push_back({"t" + std::to_string(100 + i),
                    i % 2 ? DType::kBF16 : DType::kF32,
                    {37 + i * 11, 1000 + i},
                    enc});
  }
  ASSERT_TRUE(WriteGeneration(path, defs, 9, false).ok());
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok());
  const Reader& reader = **r;
  std::vector<std::vector<uint8_t>> want;
  for (size_t k = 0; k < defs.size(); ++k) want.push_back(Content(defs[k], 9, k));
  LoaderOptions shared_options;
  shared_options.threads = 2;
  auto shared_loader = Loader::Create(shared_options);  // calls serialize inside
  ASSERT_TRUE(shared_loader.ok());

  std::atomic<int> failures{0};
  auto fail = [&](const std::string& what) {
    if (failures++ < 10) ADD_FAILURE() << what;
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      LoaderOptions o;
      o.threads = 2;
      o.verify = t % 2 == 0;
      o.slot_bytes = 64 << 10;
      auto own = Loader::Create(o);
      if (!own.ok()) return fail("Loader::Create");
      for (int iter = 0; iter < 6; ++iter) {
        size_t k = rng() % defs.size();
        const std::string& name = defs[k].name;
        switch ((t + iter) % 5) {
          case 0: {
            std::vector<uint8_t> buf(want[k].size());
            Status st = reader.ReadInto(name, buf.data(), buf.size(), {iter % 2 == 0});
            if (!st.ok() || buf != want[k]) fail("ReadInto " + name + " " + st.ToString());
            break;
          }
          case 1: {
            auto v = reader.View(name, {true});
            if (defs[k].encoding != Encoding::kRaw) {
              if (v.ok()) fail("View of an encoded tensor");
            } else if (!v.ok() || std::memcmp(v->data, want[k].data(), want[k].size()) != 0) {
              fail("View " + name);
            }
            break;
          }
          case 2: {
            const int64_t rows = defs[k].shape[0];
            const uint64_t row_bytes = want[k].size() / rows;
            std::vector<uint8_t> buf((rows - rows / 3) * row_bytes);
            Status st = reader.ReadRowsInto(name, rows / 3, rows, buf.data(), buf.size());
            if (!st.ok() ||
                std::memcmp(buf.data(), want[k].data() + rows / 3 * row_bytes, buf.size()) != 0) {
              fail("ReadRowsInto " + name + " " + st.ToString());
            }
            break;
          }
          case 3:
          case 4: {
            Loader& loader = (t + iter) % 5 == 3 ? **own : **shared_loader;
            std::vector<LoadRequest> req = {{name}, {defs[(k + 1) % defs.size()].name}};
            // A few whole-file loads; the rest ask for two tensors.
            bool all = iter == 0 && t < 4;
            auto out = loader.LoadToHost(reader, all ? std::vector<LoadRequest>{} : req);
            if (!out.ok()) {
              fail("LoadToHost " + out.status().ToString());
              break;
            }
            for (const LoadedTensor& lt : *out) {
              size_t idx = static_cast<size_t>(std::stoi(lt.info.name.substr(1)) - 100);
              if (lt.nbytes != want[idx].size() ||
                  std::memcmp(lt.data, want[idx].data(), lt.nbytes) != 0) {
                fail("LoadToHost data " + lt.info.name);
              }
            }
            break;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_TRUE(reader.VerifyAll().ok());
}

// An index large enough that Reader::Open validates it on several threads, opened by several
// threads at once (under TSan this covers the parallel footer validation).
TEST(FaultTest, ManyThreadsOpenALargeIndex) {
  TempDir dir;
  const std::string path = dir.File("many.ferry");
  constexpr int kTensors = 40000;
  {
    WriterOptions o;
    o.durable = false;
    auto w = Writer::Create(path, o);
    ASSERT_TRUE(w.ok());
    for (int i = 0; i < kTensors; ++i) {
      uint32_t v = static_cast<uint32_t>(i);
      char name[32];
      std::snprintf(name, sizeof(name), "layer.%06d", i);
      ASSERT_TRUE(w->AddTensor(name, DType::kU32, {1}, &v, 4).ok());
    }
    ASSERT_TRUE(w->Commit().ok());
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto r = Reader::Open(path);
      if (!r.ok() || (*r)->num_tensors() != kTensors) {
        failures++;
        return;
      }
      for (int i = t; i < kTensors; i += 997) {
        char name[32];
        std::snprintf(name, sizeof(name), "layer.%06d", i);
        uint32_t v = 0;
        if (!(*r)->ReadInto(name, &v, 4, {true}).ok() || v != static_cast<uint32_t>(i)) {
          failures++;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

}  // namespace
}  // namespace ferry
