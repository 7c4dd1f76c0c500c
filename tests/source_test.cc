// Byte sources: the file-system classifier, the local sources, and every read path giving the
// same bytes through a source that is never mapped (as network file systems are read) as
// through the mapping.
#include "io/source.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "base/util.hpp"
#include "ferry/ferry.hpp"
#include "ferry/loader.hpp"
#include "format/block_source.hpp"
#include "format/checkpoint_index.hpp"
#include "format/safetensors.hpp"
#include "test_util.hpp"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace ferry {
namespace {

using testing::RandomBytes;
using testing::TempDir;

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

SourceOptions NoMmap() {
  SourceOptions o;
  o.allow_mmap = false;
  return o;
}

Result<std::shared_ptr<Reader>> OpenUnmapped(const std::string& path, ReaderOptions ro = {}) {
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<ByteSource> bytes, OpenSource(path, NoMmap()));
  return OpenReader(std::move(bytes), ro);
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
}

// ---- the file-system classifier ------------------------------------------------------------

TEST(FileSystemTest, NetworkFileSystemsAreNamedAndNeverMapped) {
  const std::map<uint64_t, std::string> network = {
      {0x6969, "nfs"},      {0x517B, "smb"},          {0xFF534D42, "cifs"},
      {0xFE534D42, "smb2"}, {0x0BD00BD0, "lustre"},   {0x65735546, "fuse"},
      {0x00C36400, "ceph"}, {0x47504653, "gpfs"},     {0x01021997, "9p"},
      {0x5346414F, "afs"},  {0x6B414653, "afs"},      {0x73757245, "coda"},
      {0x564C, "ncp"},      {0x20030528, "orangefs"}, {0x19830326, "beegfs"},
      {0xAAD7AAEA, "panfs"}};
  for (const auto& [magic, name] : network) {
    FileSystemKind kind = ClassifyFileSystem(magic);
    EXPECT_TRUE(kind.network) << name;
    ASSERT_NE(kind.name, nullptr) << name;
    EXPECT_EQ(kind.name, name);
  }
  // 32-bit systems hand out f_type sign-extended.
  const auto cifs = static_cast<uint64_t>(int64_t{static_cast<int32_t>(0xFF534D42)});
  EXPECT_TRUE(ClassifyFileSystem(cifs).network);
  EXPECT_STREQ(ClassifyFileSystem(cifs).name, "cifs");
}

TEST(FileSystemTest, LocalFileSystemsAreMapped) {
  const std::map<uint64_t, std::string> local = {{0xEF53, "ext4"},        {0x58465342, "xfs"},
                                                 {0x9123683E, "btrfs"},   {0x01021994, "tmpfs"},
                                                 {0x794C7630, "overlay"}, {0x2FC12FC1, "zfs"}};
  for (const auto& [magic, name] : local) {
    FileSystemKind kind = ClassifyFileSystem(magic);
    EXPECT_FALSE(kind.network) << name;
    ASSERT_NE(kind.name, nullptr) << name;
    EXPECT_EQ(kind.name, name);
  }
  FileSystemKind unknown = ClassifyFileSystem(0x12345678);
  EXPECT_EQ(unknown.name, nullptr);
  EXPECT_FALSE(unknown.network);
}

// ---- local sources --------------------------------------------------------------------------

TEST(LocalSourceTest, MappedOrNotAndSaysWhy) {
  TempDir dir;
  const std::string path = dir.File("bytes.bin");
  const std::vector<uint8_t> data = RandomBytes(100000, 1);
  WriteFile(path, data);
  auto mapped = OpenSource(path);
  ASSERT_TRUE(mapped.ok()) << mapped.status().ToString();
  ASSERT_NE((*mapped)->mapping(), nullptr);
  EXPECT_EQ((*mapped)->mapping()->size(), data.size());
  EXPECT_TRUE((*mapped)->Describe().starts_with("mmap (local file system: "))
      << (*mapped)->Describe();
  auto unmapped = OpenSource(path, NoMmap());
  ASSERT_TRUE(unmapped.ok()) << unmapped.status().ToString();
  EXPECT_EQ((*unmapped)->mapping(), nullptr);
  EXPECT_TRUE((*unmapped)->Describe().starts_with(
      "pread, no mmap (mapping turned off; local file system: "))
      << (*unmapped)->Describe();
  for (const auto& source : {*mapped, *unmapped}) {
    EXPECT_EQ(source->name(), path);
    EXPECT_EQ(source->size(), data.size());
    std::vector<uint8_t> got(5000);
    ASSERT_TRUE(source->ReadAt(12345, got.size(), got.data()).ok());
    EXPECT_EQ(0, std::memcmp(got.data(), data.data() + 12345, got.size()));
    std::vector<uint8_t> a(10), b(100);
    std::vector<ReadRange> ranges = {{99990, 10, a.data()}, {7, 100, b.data()}};
    ASSERT_TRUE(source->ReadRanges(ranges).ok());
    EXPECT_EQ(0, std::memcmp(a.data(), data.data() + 99990, 10));
    EXPECT_EQ(0, std::memcmp(b.data(), data.data() + 7, 100));
    Status past = source->ReadAt(99995, 10, a.data());
    EXPECT_EQ(past.code(), StatusCode::kDataLoss);
    EXPECT_EQ(past.message(),
              path + ": bytes [99995, 100005) lie past the end of the 100000-byte file");
  }
}

TEST(LocalSourceTest, TruncatedAfterOpenIsDataLossNamingFileAndOffset) {
  TempDir dir;
  const std::string path = dir.File("bytes.bin");
  WriteFile(path, RandomBytes(100000, 2));
  auto source = OpenSource(path, NoMmap());
  ASSERT_TRUE(source.ok());
  ASSERT_EQ(::truncate(path.c_str(), 60000), 0);
  std::vector<uint8_t> got(20000);
  Status st = (*source)->ReadAt(50000, got.size(), got.data());
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_EQ(st.message(), path +
                              ": the file ends at offset 60000, inside the 20000 bytes read at "
                              "offset 50000 (100000 bytes when opened: truncated after it was "
                              "opened?)");
}

TEST(LocalSourceTest, RefusesWhatIsNotARegularFileWithoutBlocking) {
  TempDir dir;
  const std::string fifo = dir.File("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& path : {fifo, dir.path()}) {
    for (bool mmap : {true, false}) {
      SourceOptions o;
      o.allow_mmap = mmap;
      auto source = OpenSource(path, o);  // a FIFO without a writer would block a plain open
      EXPECT_EQ(source.status().code(), StatusCode::kInvalidArgument) << path;
      EXPECT_EQ(source.status().message(), path + ": not a regular file");
    }
  }
  auto missing = OpenSource(dir.File("nope"), NoMmap());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(missing.status().message(), dir.File("nope")));
}

// ---- names ---------------------------------------------------------------------------------

TEST(SourceNameTest, RemoteNamesAndPrintableUrls) {
  EXPECT_TRUE(IsRemoteName("http://host/a.ferry"));
  EXPECT_TRUE(IsRemoteName("HTTPS://host/a.ferry"));
  EXPECT_TRUE(IsRemoteName("s3://bucket/key.ferry"));
  EXPECT_FALSE(IsRemoteName("/data/http://x"));
  EXPECT_FALSE(IsRemoteName("model.ferry"));
  EXPECT_FALSE(IsRemoteName("s3:/bucket"));
  EXPECT_EQ(PrintableUrl("https://user:secret@host:8443/d/a.ferry?X-Amz-Signature=abc#f"),
            "https://host:8443/d/a.ferry");
  EXPECT_EQ(PrintableUrl("s3://bucket/dir/a.ferry"), "s3://bucket/dir/a.ferry");
  EXPECT_EQ(PrintableUrl("http://host/a@b.ferry"), "http://host/a@b.ferry");
  EXPECT_EQ(PrintableUrl("/local/path?.ferry"), "/local/path");
}

TEST(SourceNameTest, UrlsNeverPrintTheirSecrets) {
  // Refused (a build without an HTTP client) or unreachable (port 1): either way, no secret.
  auto remote = OpenSource("https://user:secret@127.0.0.1:1/a.ferry?sig=abc");
  ASSERT_FALSE(remote.ok());
  EXPECT_FALSE(Contains(remote.status().message(), "secret")) << remote.status().ToString();
  EXPECT_FALSE(Contains(remote.status().message(), "sig=")) << remote.status().ToString();
  EXPECT_TRUE(Contains(remote.status().message(), "https://127.0.0.1:1/a.ferry"))
      << remote.status().ToString();
}

TEST(SourceNameTest, UnsupportedSchemeIsInvalidArgumentUnlessSuchAFileExists) {
  auto gs = OpenSource("gs://bucket/a.ferry?token=x");
  EXPECT_EQ(gs.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(gs.status().message(),
            "gs://bucket/a.ferry: URL scheme 'gs' is not supported (http://, https://, s3://), "
            "and no local file has this name");
  // A relative path that merely looks like a URL is still a file.
  TempDir dir;
  std::filesystem::create_directories(dir.File("gs:/bucket"));
  WriteFile(dir.File("gs:/bucket/a.ferry"), {1, 2, 3});
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  auto local = OpenSource("gs://bucket/a.ferry");
  std::filesystem::current_path(cwd);
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  EXPECT_EQ((*local)->size(), 3u);
}

// ---- every read path, mapped and not --------------------------------------------------------

// A checkpoint with every encoding over several blocks, rows that cross blocks, a scalar, an
// empty tensor, and enough small tensors that the footer outgrows the tail read at open.
class UnmappedReadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.File("ckpt.ferry");
    WriterOptions wo;
    wo.block_size = 64 << 10;
    auto w = Writer::Create(path_, wo);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    uint64_t seed = 1;
    for (Encoding enc :
         {Encoding::kRaw, Encoding::kZstd, Encoding::kShuffleZstd, Encoding::kPlanes}) {
      for (DType dtype : {DType::kBF16, DType::kF32, DType::kU8}) {
        Add(*w, StrCat(EncodingName(enc), "/", DTypeName(dtype)), dtype, {300, 257}, enc, seed++);
      }
    }
    for (int i = 0; i < 1500; ++i) {
      Add(*w, StrCat("small/", i, "/with/a/long/enough/name"), DType::kF32, {i % 5 + 1},
          Encoding::kRaw, 100 + i);
    }
    Add(*w, "scalar", DType::kF64, {}, Encoding::kRaw, 7);
    Add(*w, "empty", DType::kF16, {0, 4}, Encoding::kRaw, 8);
    ASSERT_TRUE(w->Commit().ok());
    auto m = Reader::Open(path_);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    mapped_ = *m;
    auto u = OpenUnmapped(path_);
    ASSERT_TRUE(u.ok()) << u.status().ToString();
    unmapped_ = *u;
  }

  void Add(Writer& w, const std::string& name, DType dtype, std::vector<int64_t> shape,
           Encoding enc, uint64_t seed) {
    ASSERT_TRUE(testing::AddTestTensor(w, name, dtype, shape, enc, seed, &expected_).ok());
  }

  void ExpectAllLoaded(const std::vector<LoadedTensor>& out) {
    ASSERT_EQ(out.size(), expected_.size());
    for (const LoadedTensor& t : out) {
      const auto& want = expected_.at(t.info.name);
      ASSERT_EQ(t.nbytes, want.size()) << t.info.name;
      if (!want.empty()) EXPECT_EQ(0, std::memcmp(t.data, want.data(), want.size())) << t.info.name;
    }
  }

  TempDir dir_;
  std::string path_;
  std::shared_ptr<Reader> mapped_, unmapped_;
  std::map<std::string, std::vector<uint8_t>> expected_;
};

TEST_F(UnmappedReadTest, OpensWithTheSameIndexWithoutAMapping) {
  EXPECT_EQ(BlocksOf(*unmapped_).mapping(), nullptr);
  EXPECT_NE(BlocksOf(*mapped_).mapping(), nullptr);
  // The footer is larger than the tail read at open, so it took a read of its own.
  uint64_t footer = 0;
  std::ifstream f(path_, std::ios::binary);
  f.seekg(-24, std::ios::end);
  f.read(reinterpret_cast<char*>(&footer), 8);
  EXPECT_GT(footer, uint64_t{64} << 10);
  EXPECT_EQ(unmapped_->path(), path_);
  EXPECT_EQ(unmapped_->file_size(), mapped_->file_size());
  EXPECT_EQ(unmapped_->names(), mapped_->names());
  for (size_t i = 0; i < mapped_->num_tensors(); i += 97) {
    EXPECT_EQ(unmapped_->tensor(i).data_offset, mapped_->tensor(i).data_offset);
  }
  EXPECT_TRUE(OpenUnmapped(path_, {true}).ok());  // verify_on_open reads every block
}

TEST_F(UnmappedReadTest, ReadIntoAndRowsGiveTheSameBytes) {
  for (bool verify : {false, true}) {
    for (const auto& [name, want] : expected_) {
      for (const auto& reader : {mapped_, unmapped_}) {
        std::vector<uint8_t> got(want.size() + 1, 0xEE);
        ASSERT_TRUE(reader->ReadInto(name, got.data(), got.size(), {verify}).ok()) << name;
        EXPECT_TRUE(std::equal(want.begin(), want.end(), got.begin())) << name;
        EXPECT_EQ(got[want.size()], 0xEE) << name;
      }
    }
    // Rows 100..211 of a 300-row tensor: cut blocks at both ends.
    for (const char* name : {"raw/BF16", "zstd/F32", "shuffle+zstd/BF16", "planes/BF16"}) {
      const auto& want = expected_.at(name);
      const uint64_t row = want.size() / 300;
      std::vector<uint8_t> got(111 * row);
      Status st = unmapped_->ReadRowsInto(name, 100, 211, got.data(), got.size(), {verify});
      ASSERT_TRUE(st.ok()) << st.ToString();
      EXPECT_EQ(0, std::memcmp(got.data(), want.data() + 100 * row, got.size())) << name;
    }
  }
}

TEST_F(UnmappedReadTest, VerifyReadsEveryBlock) {
  EXPECT_TRUE(unmapped_->VerifyAll().ok());
  for (const char* name : {"raw/U8", "zstd/U8", "shuffle+zstd/F32", "planes/BF16"}) {
    EXPECT_TRUE(unmapped_->Verify(name).ok()) << name;
  }
}

TEST_F(UnmappedReadTest, HostLoadsGiveTheSameBytes) {
  for (bool verify : {false, true}) {
    for (IoMode io : {IoMode::kAuto, IoMode::kDirect}) {
      LoaderOptions o;
      o.verify = verify;
      o.io = io;
      o.slot_bytes = 16 << 10;  // pieces cut inside blocks
      o.staging_bytes = 64 << 10;
      auto loader = Loader::Create(o);
      ASSERT_TRUE(loader.ok());
      auto out = (*loader)->LoadToHost(*unmapped_, {});
      ASSERT_TRUE(out.ok()) << out.status().ToString();
      ExpectAllLoaded(*out);
      EXPECT_FALSE((*loader)->last_stats().used_direct_io);  // no O_DIRECT without a mapping
      size_t handed = 0;
      auto streamed =
          (*loader)->LoadToHostStreaming(*unmapped_, {}, [&](const ReadyTensor&) { ++handed; });
      ASSERT_TRUE(streamed.ok()) << streamed.status().ToString();
      ExpectAllLoaded(*streamed);
      EXPECT_EQ(handed, expected_.size());
    }
  }
  auto loader = Loader::Create();
  ASSERT_TRUE(loader.ok());
  const auto& want = expected_.at("shuffle+zstd/BF16");
  const uint64_t row = want.size() / 300;
  std::vector<uint8_t> rows(50 * row);
  LoadRequest q{"shuffle+zstd/BF16", 250, 300, rows.data(), rows.size()};
  auto out = (*loader)->LoadToHost(*unmapped_, {q, LoadRequest{"planes/U8"}});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(0, std::memcmp(rows.data(), want.data() + 250 * row, rows.size()));
  EXPECT_EQ(0, std::memcmp((*out)[1].data, expected_.at("planes/U8").data(), (*out)[1].nbytes));
}

TEST_F(UnmappedReadTest, ViewsNeedAMapping) {
  auto view = unmapped_->View("raw/F32");
  EXPECT_EQ(view.status().code(), StatusCode::kUnimplemented);
  EXPECT_EQ(view.status().message(),
            path_ +
                ": tensor 'raw/F32': a zero-copy view needs a mapped file, and this one is "
                "read without a mapping (" +
                BlocksOf(*unmapped_).bytes().Describe() + "; use ReadInto)");
  EXPECT_TRUE(mapped_->View("raw/F32").ok());
}

TEST_F(UnmappedReadTest, CorruptBlocksAreFound) {
  const TensorInfo raw = *mapped_->Find("raw/F32");
  const TensorInfo zstd = *mapped_->Find("zstd/F32");
  int fd = ::open(path_.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  for (uint64_t at : {raw.data_offset + 70000, zstd.data_offset + 10}) {
    const uint8_t x = 0x5A;
    ASSERT_EQ(::pwrite(fd, &x, 1, static_cast<off_t>(at)), 1);
  }
  ::close(fd);
  auto r = OpenUnmapped(path_);
  ASSERT_TRUE(r.ok());
  std::vector<uint8_t> got(raw.nbytes);
  Status st = (*r)->ReadInto("raw/F32", got.data(), got.size(), {true});
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(st.message(), path_ + ": tensor 'raw/F32': checksum mismatch in block 1"))
      << st.ToString();
  // Rows inside block 1 only: the block is cut, so it is checked where it is stored.
  st = (*r)->ReadRowsInto("raw/F32", 70, 71, got.data(), got.size(), {true});
  EXPECT_TRUE(Contains(st.message(), "checksum mismatch in block 1")) << st.ToString();
  st = (*r)->Verify("zstd/F32");
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(st.message(), path_ + ": tensor 'zstd/F32': ")) << st.ToString();
}

TEST_F(UnmappedReadTest, TruncatedAfterOpenIsDataLossNamingFileTensorAndOffset) {
  const TensorInfo raw = *mapped_->Find("raw/F32");
  const TensorInfo zstd = *mapped_->Find("zstd/F32");
  const uint64_t cut = std::min(raw.data_offset, zstd.data_offset) + 4096;
  ASSERT_EQ(::truncate(path_.c_str(), static_cast<off_t>(cut)), 0);
  for (const TensorInfo& t : {raw, zstd}) {
    std::vector<uint8_t> got(t.nbytes);
    Status st = unmapped_->ReadInto(t.name, got.data(), got.size());
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << t.name;
    EXPECT_TRUE(Contains(st.message(),
                         StrCat(path_, ": tensor ", Quote(t.name), ": the file ends at offset ")))
        << st.ToString();
    EXPECT_TRUE(Contains(st.message(), "truncated after it was opened?")) << st.ToString();
  }
  auto loader = Loader::Create();
  ASSERT_TRUE(loader.ok());
  auto out = (*loader)->LoadToHost(*unmapped_, {});
  EXPECT_EQ(out.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(out.status().message(), path_)) << out.status().ToString();
}

TEST(UnmappedSafetensorsTest, HeadersOfAnySizeGiveTheSameBytes) {
  TempDir dir;
  // 3 tensors: the header fits the head read at open; 2000: it takes a read of its own.
  for (int n : {3, 2000}) {
    const std::string path = dir.File(StrCat("m", n, ".safetensors"));
    std::vector<SafetensorsEntry> entries;
    for (int i = 0; i < n; ++i) {
      entries.push_back(
          {StrCat("layer.", i, ".a.rather.long.tensor.name"), DType::kBF16, {3, i % 7}});
    }
    SortSafetensorsEntries(&entries);
    auto w = SafetensorsWriter::Create(path, entries, {{"k", "v"}}, false);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    const std::vector<uint8_t> data = RandomBytes(w->data_bytes(), n);
    ASSERT_TRUE(w->Write(data.data(), data.size()).ok());
    EXPECT_EQ(w->header_bytes() > (64 << 10), n > 3);
    ASSERT_TRUE(w->Commit().ok());
    auto mapped = Reader::Open(path);
    auto unmapped = OpenUnmapped(path);
    ASSERT_TRUE(mapped.ok() && unmapped.ok()) << unmapped.status().ToString();
    EXPECT_EQ((*unmapped)->metadata("k"), "v");
    ASSERT_EQ((*unmapped)->names(), (*mapped)->names());
    auto loader = Loader::Create();
    ASSERT_TRUE(loader.ok());
    auto a = (*loader)->LoadToHost(**mapped, {});
    auto b = (*loader)->LoadToHost(**unmapped, {});
    ASSERT_TRUE(a.ok() && b.ok()) << b.status().ToString();
    for (size_t i = 0; i < a->size(); ++i) {
      ASSERT_EQ((*a)[i].nbytes, (*b)[i].nbytes);
      if ((*a)[i].nbytes == 0) continue;
      EXPECT_EQ(0, std::memcmp((*a)[i].data, (*b)[i].data, (*a)[i].nbytes)) << i;
    }
  }
}

TEST(UnmappedShardedTest, IndexAndShardsReadWithoutAMapping) {
  TempDir dir;
  std::map<std::string, std::vector<uint8_t>> want;
  for (int s = 0; s < 2; ++s) {
    auto w = Writer::Create(dir.File(StrCat("shard", s, ".ferry")));
    ASSERT_TRUE(w.ok());
    for (int k = 0; k < 3; ++k) {
      const std::string name = StrCat("t", s, k);
      want[name] = RandomBytes(10000 * (k + 1), s * 10 + k);
      ASSERT_TRUE(w->AddTensor(name, DType::kU8, {static_cast<int64_t>(want[name].size())},
                               want[name].data(), want[name].size(),
                               k == 1 ? Encoding::kZstd : Encoding::kRaw)
                      .ok());
    }
    ASSERT_TRUE(w->Commit().ok());
  }
  const std::string index = dir.File("model.ferry.index.json");
  std::ofstream(index) << R"({"weight_map": {"t00": "shard0.ferry", "t01": "shard0.ferry",
      "t02": "shard0.ferry", "t10": "shard1.ferry", "t11": "shard1.ferry", "t12": "shard1.ferry"}})";
  auto parsed = ReadCheckpointIndex(index);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ASSERT_EQ(parsed->shard_files.size(), 2u);
  auto loader = Loader::Create();
  ASSERT_TRUE(loader.ok());
  size_t seen = 0;
  for (size_t s = 0; s < parsed->shard_files.size(); ++s) {
    auto shard = OpenUnmapped(parsed->ShardPath(s));
    ASSERT_TRUE(shard.ok()) << shard.status().ToString();
    auto out = (*loader)->LoadToHost(**shard, {});
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    for (const LoadedTensor& t : *out) {
      EXPECT_EQ(std::vector<uint8_t>(static_cast<const uint8_t*>(t.data),
                                     static_cast<const uint8_t*>(t.data) + t.nbytes),
                want.at(t.info.name));
      ++seen;
    }
  }
  EXPECT_EQ(seen, want.size());
}

#ifdef FERRY_HAVE_CUDA
// Device loads without a mapping: no registration, no O_DIRECT, every piece through the ring
// (PLANES blocks decoded on the device where the build has the kernels), bit-exact.
TEST_F(UnmappedReadTest, DeviceLoadsGiveTheSameBytes) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device";
  for (HostPath host_path : {HostPath::kAuto, HostPath::kRegister, HostPath::kRegisterWindows}) {
    for (bool verify : {false, true}) {
      LoaderOptions o;
      o.io = IoMode::kDirect;  // asked for, but there is no mapping to sample or bypass
      o.host_path = host_path;
      o.verify = verify;
      o.slot_bytes = 32 << 10;
      o.staging_bytes = 128 << 10;
      auto loader = Loader::Create(o);
      ASSERT_TRUE(loader.ok());
      auto out = (*loader)->Load(*unmapped_, {});
      ASSERT_TRUE(out.ok()) << out.status().ToString();
      const LoadStats stats = (*loader)->last_stats();
      EXPECT_FALSE(stats.used_register);
      EXPECT_FALSE(stats.used_direct_io);
      EXPECT_TRUE(stats.used_pread);
      ASSERT_EQ(out->size(), expected_.size());
      for (const LoadedTensor& t : *out) {
        const auto& want = expected_.at(t.info.name);
        ASSERT_EQ(t.nbytes, want.size());
        std::vector<uint8_t> got(t.nbytes);
        if (t.nbytes) {
          ASSERT_EQ(cudaMemcpy(got.data(), t.data, t.nbytes, cudaMemcpyDeviceToHost), cudaSuccess);
        }
        EXPECT_EQ(got, want) << t.info.name;
      }
    }
  }
}
#endif

}  // namespace
}  // namespace ferry
