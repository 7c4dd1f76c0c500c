// Hostile inputs outside the fuzzers' reach: deep JSON in indexes, headers of very many
// entries, non-regular files, NUL bytes in paths, tiny and whitespace-led safetensors files,
// decode scratch bounds, and what replacing a checkpoint does to its mode and to a symbolic
// link at the destination.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "base/strict_json.hpp"
#include "base/util.hpp"
#include "codec/codec.hpp"
#include "ferry/ferry.hpp"
#include "ferry/sharded.hpp"
#include "format/safetensors.hpp"
#include "io/io.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

using testing::TempDir;

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string Safetensors(const std::string& header, const std::string& data = "") {
  uint64_t n = header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

std::string Nested(size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// ---- item 1: depth of the sharded index ------------------------------------------------

TEST(HostileIndex, DeeplyNestedMetadataIsRefusedBeforeAnythingRecurses) {
  TempDir dir;
  std::string path = dir.File("model.safetensors.index.json");
  WriteFile(path, "{\"metadata\": {\"x\": " + Nested(100000) +
                      "}, \"weight_map\": {\"a\": \"s.safetensors\"}}");
  auto index = ReadSafetensorsIndex(path);
  ASSERT_FALSE(index.ok());
  EXPECT_EQ(index.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(index.status().message(), "model.safetensors.index.json"));
  EXPECT_TRUE(Contains(index.status().message(), "nests deeper"));
}

TEST(HostileIndex, ReasonableMetadataStillReadsAndDuplicateKeysAreRefused) {
  TempDir dir;
  std::string path = dir.File("i.json");
  WriteFile(path,
            "{\"metadata\": {\"total_size\": 8, \"n\": {\"a\": [1, [2]]}}, "
            "\"weight_map\": {\"a\": \"s.safetensors\"}}");
  auto index = ReadSafetensorsIndex(path);
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  ASSERT_EQ(index->metadata.size(), 2u);
  EXPECT_EQ(index->metadata[0].second, "{\"a\":[1,[2]]}");
  WriteFile(path, "{\"weight_map\": {\"a\": \"s.safetensors\", \"a\": \"t.safetensors\"}}");
  index = ReadSafetensorsIndex(path);
  ASSERT_FALSE(index.ok());
  EXPECT_TRUE(Contains(index.status().message(), "duplicate key"));
}

TEST(StrictJson, OrderedJsonIsDepthAndWidthBounded) {
  StrictJsonOptions options;
  options.max_depth = 4;
  options.max_keys = 3;
  nlohmann::ordered_json out;
  std::string deep = Nested(5);
  EXPECT_TRUE(ParseStrictJson(deep.data(), deep.data() + deep.size(), options, &out));
  std::string wide = "{\"a\":1,\"b\":2,\"c\":3,\"d\":4}";
  auto error = ParseStrictJson(wide.data(), wide.data() + wide.size(), options, &out);
  ASSERT_TRUE(error);
  EXPECT_TRUE(Contains(*error, "more than 3 keys"));
  std::string ok = "[{\"a\":[1,{\"b\":null}]}]";
  EXPECT_FALSE(ParseStrictJson(ok.data(), ok.data() + ok.size(), options, &out));
  EXPECT_EQ(out.dump(), ok);
}

// ---- item 6: a header of many entries parses in linear time ------------------------------

TEST(HostileSafetensors, HeaderOfManyEntriesOpens) {
  // 150,000 entries: over ten minutes with a parse quadratic in the entry count (80,000 took
  // 209 s); seconds when linear. The test's time limit (CMakeLists) is the guard.
  constexpr size_t kEntries = 150000;
  std::string header = "{";
  for (size_t i = 0; i < kEntries; ++i) {
    char buf[96];
    std::snprintf(buf, sizeof(buf),
                  "%s\"t%07zu\":{\"dtype\":\"U8\",\"shape\":[1],"
                  "\"data_offsets\":[%zu,%zu]}",
                  i ? "," : "", i, i, i + 1);
    header += buf;
  }
  header += "}";
  TempDir dir;
  std::string path = dir.File("many.safetensors");
  WriteFile(path, Safetensors(header, std::string(kEntries, 'x')));
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->num_tensors(), kEntries);
  EXPECT_EQ((*r)->tensor(kEntries - 1).name, "t0149999");
}

// ---- item 10: whitespace before the header, tiny files -------------------------------------

TEST(HostileSafetensors, LeadingWhitespaceIsAcceptedLikeTheReferenceLibrary) {
  TempDir dir;
  std::string path = dir.File("ws.safetensors");
  WriteFile(
      path,
      Safetensors(" \n\t{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}", "hi"));
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::string got(2, '\0');
  ASSERT_TRUE((*r)->ReadInto("a", got.data(), 2).ok());
  EXPECT_EQ(got, "hi");
}

TEST(HostileSafetensors, TinyFilesGetASafetensorsError) {
  TempDir dir;
  std::string path = dir.File("tiny.safetensors");
  for (const std::string& image :
       {Safetensors("[]"), Safetensors(""), Safetensors("  "), Safetensors("null")}) {
    WriteFile(path, image);
    auto r = Reader::Open(path);
    ASSERT_FALSE(r.ok()) << image.size();
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
    EXPECT_TRUE(Contains(r.status().message(), "safetensors header")) << r.status().ToString();
    EXPECT_FALSE(Contains(r.status().message(), "TensorFerry")) << r.status().ToString();
  }
  WriteFile(path, Safetensors("{}"));  // no tensors: valid
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->num_tensors(), 0u);
}

// ---- item 7: non-regular files ---------------------------------------------------------

TEST(HostileFiles, NamedPipeIsRefusedWithoutBlocking) {
  TempDir dir;
  std::string fifo = dir.File("pipe.ferry");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // Without a writer, a blocking open would never return; the test's time limit catches that.
  auto r = Reader::Open(fifo);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(r.status().message(), "not a regular file"));
  EXPECT_FALSE(ReadSafetensorsIndex(fifo).ok());
  auto d = Reader::Open(dir.path());
  ASSERT_FALSE(d.ok());
}

// ---- item 5: NUL bytes in paths --------------------------------------------------------------

TEST(HostileStrings, PathsWithANulByteAreRefused) {
  TempDir dir;
  std::string path = dir.File("model.ferry");
  {
    auto w = Writer::Create(path);
    ASSERT_TRUE(w.ok());
    uint8_t v = 7;
    ASSERT_TRUE(w->AddTensor("a", DType::kU8, {1}, &v, 1).ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  std::string hidden = path + std::string(1, '\0') + ".bak";
  auto w = Writer::Create(hidden);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(w.status().message(), "NUL"));
  EXPECT_FALSE(Reader::Open(hidden).ok());
  EXPECT_FALSE(SafetensorsWriter::Create(hidden, {}, {}).ok());
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 1);
  // The C++ API has lengths: names and keys with a NUL byte are refused there too.
  auto w2 = Writer::Create(dir.File("b.ferry"));
  ASSERT_TRUE(w2.ok());
  uint8_t v = 1;
  EXPECT_FALSE(w2->AddTensor(std::string("a\0b", 3), DType::kU8, {1}, &v, 1).ok());
  EXPECT_FALSE(w2->SetMetadata(std::string("k\0a", 3), "v").ok());
}

// ---- items 8, 9: decode scratch ----------------------------------------------------------

// Resident set size of this process, in bytes.
uint64_t Rss() {
  std::ifstream f("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

TEST(DecodeMemory, ReadingOneRowOfHugeBlocksLeavesNoScratchBehind) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizer's allocator keeps freed memory resident (quarantine)";
#endif
  TempDir dir;
  std::string path = dir.File("big.ferry");
  constexpr uint64_t kBlock = uint64_t{64} << 20;
  std::vector<float> data(kBlock / 4 * 2);
  for (size_t k = 0; k < data.size(); ++k) data[k] = static_cast<float>(k % 1000);
  {
    WriterOptions o;
    o.block_size = kBlock;
    o.encoding = Encoding::kShuffleZstd;
    o.threads = 1;
    o.durable = false;
    auto w = Writer::Create(path, o);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->AddTensor("t", DType::kF32, {static_cast<int64_t>(data.size() / 4), 4},
                             data.data(), data.size() * 4)
                    .ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok());
  float row[4];
  int64_t rows = static_cast<int64_t>(data.size() / 4);
  const uint64_t before = Rss();
  for (int64_t k : {int64_t{3}, rows / 2 + 1, rows - 1}) {
    ReadOptions ro;
    ro.verify = true;
    ASSERT_TRUE((*r)->ReadRowsInto("t", k, k + 1, row, sizeof(row), ro).ok());
    for (int c = 0; c < 4; ++c) EXPECT_EQ(row[c], data[static_cast<size_t>(k) * 4 + c]);
  }
  // Two 64 MiB buffers per thread stayed resident before; none may now.
  EXPECT_LT(Rss(), before + (uint64_t{16} << 20));
}

TEST(DecodeMemory, HugeScratchIsLeasedFromOneBudget) {
  // Two threads each wanting 3/4 of the budget: the second waits for the first to release.
  const uint64_t n = kDecodeScratchBudget / 4 * 3;
  DecodeScratch a;
  ASSERT_TRUE(a.Get(n).ok());
  std::atomic<bool> got{false};
  std::thread t([&] {
    DecodeScratch b;
    auto p = b.Get(n);
    got = p.ok();
    b.Release();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(got.load());  // still waiting: both leases would exceed the budget
  a.Release();
  t.join();
  EXPECT_TRUE(got.load());
  // Small scratch takes no lease and stays for the next call.
  DecodeScratch small;
  auto p1 = small.Get(1024);
  auto p2 = small.Get(512);
  ASSERT_TRUE(p1.ok() && p2.ok());
  EXPECT_EQ(*p1, *p2);
}

TEST(DecodeMemory, UnshuffleRangeMatchesUnshuffle) {
  for (size_t width : {2, 4, 8}) {
    for (size_t n : {0, 1, 7, 64, 1001}) {
      std::vector<uint8_t> raw = testing::RandomBytes(n, n * width);
      std::vector<uint8_t> shuffled(n), back(n);
      Shuffle(raw.data(), shuffled.data(), n, width);
      EXPECT_EQ(UnshuffledChecksum64(shuffled.data(), n, width), Checksum64(raw.data(), n));
      for (size_t lo = 0; lo <= n; lo += 1 + n / 7) {
        for (size_t hi = lo; hi <= n; hi += 1 + n / 5) {
          std::vector<uint8_t> part(hi - lo + 1);
          UnshuffleRange(shuffled.data(), n, width, lo, hi, part.data());
          if (hi == lo) continue;  // nothing to compare (and raw.data() may be null)
          ASSERT_EQ(std::memcmp(part.data(), raw.data() + lo, hi - lo), 0) << n << " " << lo;
        }
      }
    }
  }
}

// ---- item 12: replacing a checkpoint ------------------------------------------------------

Status WriteOne(const std::string& path, uint8_t value) {
  FERRY_ASSIGN_OR_RETURN(Writer w, Writer::Create(path));
  FERRY_RETURN_IF_ERROR(w.AddTensor("a", DType::kU8, {1}, &value, 1));
  return w.Commit();
}

uint8_t ReadOne(const std::string& path) {
  auto r = Reader::Open(path);
  uint8_t v = 0;
  if (!r.ok() || !(*r)->ReadInto("a", &v, 1).ok()) return 0;
  return v;
}

mode_t Mode(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? st.st_mode & 07777 : 0;
}

TEST(Replace, KeepsThePreviousFilesMode) {
  TempDir dir;
  std::string path = dir.File("private.ferry");
  ASSERT_TRUE(WriteOne(path, 1).ok());
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  ASSERT_TRUE(WriteOne(path, 2).ok());
  EXPECT_EQ(Mode(path), 0600u);
  EXPECT_EQ(ReadOne(path), 2);
  ASSERT_EQ(::chmod(path.c_str(), 0640), 0);
  std::string st = dir.File("private.safetensors");
  {
    auto w = SafetensorsWriter::Create(st, {{"a", DType::kU8, {1}}}, {});
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->Write("x", 1).ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  ASSERT_EQ(::chmod(st.c_str(), 0600), 0);
  auto w = SafetensorsWriter::Create(st, {{"a", DType::kU8, {1}}}, {});
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(w->Write("y", 1).ok());
  ASSERT_TRUE(w->Commit().ok());
  EXPECT_EQ(Mode(st), 0600u);
}

TEST(Replace, WritesThroughASymbolicLinkAndKeepsTheLink) {
  TempDir dir;
  std::filesystem::create_directory(dir.File("store"));
  std::string target = dir.File("store/blob.ferry"), link = dir.File("model.ferry");
  ASSERT_TRUE(WriteOne(target, 1).ok());
  ASSERT_EQ(::chmod(target.c_str(), 0600), 0);
  ASSERT_EQ(::symlink("store/blob.ferry", link.c_str()), 0);
  ASSERT_TRUE(WriteOne(link, 2).ok());
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_EQ(std::filesystem::read_symlink(link), "store/blob.ferry");
  EXPECT_EQ(ReadOne(target), 2);
  EXPECT_EQ(Mode(target), 0600u);
  // The temporary file lived next to the target, and is gone.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.File("store")), {}), 1);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 2);

  std::string dangling = dir.File("dangling.ferry");
  ASSERT_EQ(::symlink("nowhere/x.ferry", dangling.c_str()), 0);
  Status st = WriteOne(dangling, 3);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_TRUE(Contains(st.message(), "symbolic link"));
  EXPECT_TRUE(std::filesystem::is_symlink(dangling));
}

// Every writer (TensorFerry, safetensors, the sharded index) refuses a destination that is
// there and is not a regular file, before writing anything, and leaves it as it was: renaming
// a new file over a FIFO or a device node would delete it (as root, /dev/null itself).
TEST(Replace, RefusesWhatIsNotARegularFile) {
  TempDir dir;
  std::string fifo = dir.File("fifo.ferry"), folder = dir.File("folder.ferry");
  std::string sock = dir.File("sock.ferry"), null_link = dir.File("null.ferry");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::filesystem::create_directory(folder);
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(sock.size(), sizeof(addr.sun_path));
  std::memcpy(addr.sun_path, sock.c_str(), sock.size());
  ASSERT_EQ(::bind(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(fd);
  ASSERT_EQ(::symlink("/dev/null", null_link.c_str()), 0);
  ASSERT_TRUE(WriteOne(dir.File("shard.ferry"), 1).ok());

  struct Case {
    std::string path, what;
  };
  for (const Case& c :
       {Case{fifo, "is a FIFO"}, Case{folder, "is a directory"}, Case{sock, "is a socket"},
        Case{null_link, "leads to /dev/null, which is a character device"}}) {
    SCOPED_TRACE(c.path);
    Status st = WriteOne(c.path, 2);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_EQ(st.message(), c.path + ": " + c.what +
                                ", not a regular file; a checkpoint replaces only a regular "
                                "file: write to a file path");
    auto w = SafetensorsWriter::Create(c.path, {{"a", DType::kU8, {1}}}, {});
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(w.status().message(), st.message());
    Status index = WriteShardIndex(c.path, {"shard.ferry"}, {});
    EXPECT_EQ(index.message(), st.message());
  }
  struct stat st;
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  ASSERT_EQ(::lstat(sock.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_TRUE(std::filesystem::is_directory(folder));
  EXPECT_TRUE(std::filesystem::is_empty(folder));
  EXPECT_TRUE(std::filesystem::is_symlink(null_link));
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  // Nothing else was created: the five entries made above.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 5);
}

// A destination that turns into something else while the writer runs is refused at commit.
TEST(Replace, RefusesADestinationThatChangedBeforeTheCommit) {
  TempDir dir;
  std::string path = dir.File("late.ferry");
  auto w = Writer::Create(path);
  ASSERT_TRUE(w.ok());
  uint8_t v = 1;
  ASSERT_TRUE(w->AddTensor("a", DType::kU8, {1}, &v, 1).ok());
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  Status st = w->Commit();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_TRUE(Contains(st.message(), "is a FIFO, not a regular file")) << st.ToString();
  struct stat s;
  ASSERT_EQ(::lstat(path.c_str(), &s), 0);
  EXPECT_TRUE(S_ISFIFO(s.st_mode));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 1);
}

}  // namespace
}  // namespace ferry
