// Every entry point that takes a path takes an http(s):// or s3:// URL: Reader::Open with its
// storage options, the loader (host, streaming, device), sharded indexes naming shards beside
// them, the C API, and the split of a distributed load (which bytes each rank reads from the
// object store). Against the test servers (servers/test_servers.hpp) on 127.0.0.1.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "dist/dist_plan.hpp"
#include "ferry/ferry.h"
#include "ferry/loader.hpp"
#include "ferry/sharded.hpp"
#include "format/block_source.hpp"
#include "format/safetensors.hpp"
#include "io/remote_sink.hpp"
#include "io/remote_source.hpp"
#include "io/url.hpp"
#include "observed_source.hpp"
#include "save_group.hpp"
#include "servers/test_servers.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using Expected = std::map<std::string, std::vector<uint8_t>>;

std::vector<uint8_t> FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

// Puts `bytes` at s3://bucket/key of the test S3 server.
Status PutObject(const std::string& key, const std::vector<uint8_t>& bytes) {
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<RemoteSink> sink,
                         OpenS3Sink(S3Url(key), MotoSettings(), S3SinkOptions()));
  FERRY_RETURN_IF_ERROR(sink->Append(bytes.data(), bytes.size()));
  return sink->Commit();
}

// Writes a checkpoint where nginx serves it (servers' root + `name`) and puts it into the
// bucket under the same key. `add` adds the tensors.
template <typename Add>
Status Publish(const std::string& name, Add add, WriterOptions wo = {}) {
  const std::string path = Info("root") + "/" + name;
  fs::create_directories(fs::path(path).parent_path());
  wo.durable = false;
  FERRY_ASSIGN_OR_RETURN(Writer w, Writer::Create(path, wo));
  FERRY_RETURN_IF_ERROR(add(w));
  FERRY_RETURN_IF_ERROR(w.Commit());
  return PutObject(name, FileBytes(path));
}

// Every encoding, bf16 and f32, 64 KiB blocks: many blocks and range GETs per tensor.
Status AddEveryEncoding(Writer& w, Expected* expected) {
  uint64_t seed = 1;
  for (Encoding enc :
       {Encoding::kRaw, Encoding::kZstd, Encoding::kShuffleZstd, Encoding::kPlanes}) {
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      if (enc == Encoding::kPlanes && dtype == DType::kF32) continue;  // planes: 16-bit floats
      FERRY_RETURN_IF_ERROR(testing::AddTestTensor(w,
                                                   StrCat(EncodingName(enc), "/", DTypeName(dtype)),
                                                   dtype, {700, 257}, enc, seed++, expected));
    }
  }
  return testing::AddTestTensor(w, "small", DType::kI32, {3}, Encoding::kRaw, seed, expected);
}

// The suite's checkpoint: published once, at a key of this process.
struct Checkpoint {
  std::string name;
  Expected expected;
};
const Checkpoint& EveryEncoding() {
  static Checkpoint* c = [] {
    auto* out = new Checkpoint;
    out->name = StrCat("storage/", getpid(), "/every encoding.ferry");
    WriterOptions wo;
    wo.block_size = 64 << 10;
    Status st = Publish(
        out->name, [&](Writer& w) { return AddEveryEncoding(w, &out->expected); }, wo);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return out;
  }();
  return *c;
}

std::string HttpUrl(const std::string& name) { return Info("http") + "/" + UriEncode(name, true); }
std::string HttpsUrl(const std::string& name) {
  return Info("https") + "/" + UriEncode(name, true);
}

class StorageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    REQUIRE_SERVER("nginx");
    REQUIRE_SERVER("moto");
    UseMotoEnvironment(&env_);
    (void)EveryEncoding();
  }
  // The checkpoint's URLs: plain HTTP and S3 (through the AWS environment).
  std::vector<std::string> Urls() const {
    return {HttpUrl(EveryEncoding().name), S3Url(EveryEncoding().name)};
  }
  ScopedEnv env_;
};

void ExpectTensors(const std::vector<LoadedTensor>& got, const Expected& expected,
                   const std::string& url) {
  ASSERT_EQ(got.size(), expected.size()) << url;
  for (const LoadedTensor& t : got) {
    const std::vector<uint8_t>& want = expected.at(t.info.name);
    ASSERT_EQ(t.nbytes, want.size()) << url << " " << t.info.name;
    EXPECT_EQ(std::memcmp(t.data, want.data(), want.size()), 0) << url << " " << t.info.name;
  }
}

// ---- Reader::Open ---------------------------------------------------------------------------

TEST_F(StorageTest, ReaderOpenReadsEveryEncodingWithTheOptionsGivenInCode) {
  ReaderOptions ro;
  ro.storage.max_in_flight = 3;
  ro.storage.piece_bytes = 64 << 10;
  ro.storage.max_attempts = 2;
  ro.verify_on_open = true;
  for (const std::string& url : Urls()) {
    auto reader = Reader::Open(url, ro);
    ASSERT_TRUE(reader.ok()) << url << ": " << reader.status().ToString();
    EXPECT_EQ((*reader)->path(), url);
    const ByteSource& bytes = BlocksOf(**reader).bytes();
    EXPECT_NE(bytes.Describe().find(", 3 in flight, 64 KiB each, ETag "), std::string::npos)
        << bytes.Describe();
    for (const auto& [tensor, want] : EveryEncoding().expected) {
      std::vector<uint8_t> got(want.size());
      Status st = (*reader)->ReadInto(tensor, got.data(), got.size(), {true});
      ASSERT_TRUE(st.ok()) << url << " " << tensor << ": " << st.ToString();
      EXPECT_TRUE(got == want) << url << " " << tensor;
    }
    auto view = (*reader)->View("raw/BF16");
    EXPECT_EQ(view.status().code(), StatusCode::kUnimplemented);
  }
}

TEST_F(StorageTest, TheCaBundleMayBeGivenInCode) {
  const std::string url = HttpsUrl(EveryEncoding().name);
  ScopedEnv env;
  env.Set("CURL_CA_BUNDLE", "");
  env.Set("SSL_CERT_FILE", "");
  auto untrusted = Reader::Open(url);
  EXPECT_EQ(untrusted.status().code(), StatusCode::kIoError);
  ReaderOptions ro;
  ro.storage.ca_bundle = Info("ca");
  auto reader = Reader::Open(url, ro);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ((*reader)->num_tensors(), EveryEncoding().expected.size());
}

TEST_F(StorageTest, StorageOptionsOutOfRangeAreRefused) {
  ReaderOptions ro;
  ro.storage.max_in_flight = -1;
  EXPECT_EQ(Reader::Open(Urls()[0], ro).status().ToString(),
            "InvalidArgument: storage options: max_attempts 0 and max_in_flight -1 must lie in "
            "[0, 100] and [0, 256] (0: the default)");
  ro.storage.max_in_flight = 0;
  ro.storage.max_attempts = 101;
  EXPECT_EQ(Reader::Open(Urls()[1], ro).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Reader::Open(HttpUrl("storage/none.ferry")).status().ToString(),
            "NotFound: " + HttpUrl("storage/none.ferry") + ": no such object (HTTP 404)");
}

// ---- the loader -----------------------------------------------------------------------------

TEST_F(StorageTest, HostLoadsWholeStreamingAndByRows) {
  LoaderOptions lo;
  lo.verify = true;
  lo.threads = 1;  // the reads still go out several at a time
  auto loader = Loader::Create(lo).value();
  for (const std::string& url : Urls()) {
    auto reader = Reader::Open(url).value();
    auto all = loader->LoadToHost(*reader, {});
    ASSERT_TRUE(all.ok()) << url << ": " << all.status().ToString();
    ExpectTensors(*all, EveryEncoding().expected, url);

    std::vector<std::string> seen;
    auto streamed = loader->LoadToHostStreaming(
        *reader, {}, [&](const ReadyTensor& t) { seen.push_back(t.tensor->info.name); });
    ASSERT_TRUE(streamed.ok()) << url << ": " << streamed.status().ToString();
    ExpectTensors(*streamed, EveryEncoding().expected, url);
    EXPECT_EQ(seen.size(), EveryEncoding().expected.size());

    for (const char* name : {"raw/F32", "shuffle+zstd/BF16", "planes/BF16"}) {
      LoadRequest q;
      q.name = name;
      q.row_begin = 123;
      q.row_end = 456;
      auto rows = loader->LoadToHost(*reader, {q});
      ASSERT_TRUE(rows.ok()) << url << " " << name << ": " << rows.status().ToString();
      const std::vector<uint8_t>& whole = EveryEncoding().expected.at(name);
      const uint64_t row = whole.size() / 700;
      ASSERT_EQ((*rows)[0].nbytes, 333 * row);
      EXPECT_EQ(std::memcmp((*rows)[0].data, whole.data() + 123 * row, 333 * row), 0) << name;
    }
  }
}

TEST_F(StorageTest, DeviceLoadsGiveTheSameBytes) {
#ifdef FERRY_HAVE_CUDA
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device";
  for (bool verify : {false, true}) {
    LoaderOptions lo;
    lo.verify = verify;
    auto loader = Loader::Create(lo).value();
    for (const std::string& url : Urls()) {
      auto reader = Reader::Open(url).value();
      auto out = loader->Load(*reader, {});
      ASSERT_TRUE(out.ok()) << url << ": " << out.status().ToString();
      for (const LoadedTensor& t : *out) {
        std::vector<uint8_t> got(t.nbytes);
        ASSERT_EQ(cudaMemcpy(got.data(), t.data, t.nbytes, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_TRUE(got == EveryEncoding().expected.at(t.info.name)) << url << " " << t.info.name;
      }
    }
  }
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

// The fault server's URL of a file under the servers' root, serving it faithfully and logging
// the Range header of every request.
std::string LoggedUrl(const std::string& name) {
  return StrCat(Info("fault"), "/", getpid(), "-", TestName(), "/ok/0/", UriEncode(name, true));
}
std::vector<std::string> RangesAsked(const std::string& logged_url) {
  const std::string prefix = Info("fault");
  auto src = OpenHttpSource(prefix + "/_ranges" + logged_url.substr(prefix.size()), {});
  EXPECT_TRUE(src.ok()) << src.status().ToString();
  if (!src.ok()) return {};
  std::string text((*src)->size(), '\0');
  EXPECT_TRUE((*src)->ReadAt(0, text.size(), reinterpret_cast<uint8_t*>(text.data())).ok());
  return nlohmann::json::parse(text).get<std::vector<std::string>>();
}

TEST_F(StorageTest, SmallTensorsShareTheirRequests) {
  // 400 small raw tensors lie back to back: a load asks for them in a few requests, not in
  // one round trip each.
  const std::string name = StrCat("storage/", getpid(), "/small tensors.ferry");
  Expected expected;
  ASSERT_TRUE(Publish(name, [&](Writer& w) -> Status {
                for (int i = 0; i < 400; ++i) {
                  FERRY_RETURN_IF_ERROR(testing::AddTestTensor(w, StrCat("t", 1000 + i),
                                                               DType::kF32, {16 + i % 50},
                                                               Encoding::kRaw, i, &expected));
                }
                return Status::Ok();
              }).ok());
  const std::string url = LoggedUrl(name);
  auto reader = Reader::Open(url).value();
  const size_t opening = RangesAsked(url).size();
  auto loader = Loader::Create().value();
  auto out = loader->LoadToHost(*reader, {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ExpectTensors(*out, expected, url);
  const std::vector<std::string> ranges = RangesAsked(url);
  EXPECT_LE(ranges.size() - opening, 2u) << nlohmann::json(ranges).dump();
}

// ---- sharded checkpoints --------------------------------------------------------------------

TEST(SiblingNameTest, BesideLocalPathsObjectsAndUrls) {
  EXPECT_EQ(SiblingName("ckpt/m.index.json", "a.ferry"), "ckpt/a.ferry");
  EXPECT_EQ(SiblingName("m.index.json", "a.ferry"), "./a.ferry");
  EXPECT_EQ(SiblingName("/m.index.json", "d/a.ferry"), "/d/a.ferry");
  EXPECT_EQ(SiblingName("s3://bkt/x/y/m.json", "a b%.ferry"), "s3://bkt/x/y/a b%.ferry");
  EXPECT_EQ(SiblingName("S3://bkt/m.json", "d/a.ferry"), "S3://bkt/d/a.ferry");
  EXPECT_EQ(SiblingName("s3://bkt", "a.ferry"), "s3://bkt/a.ferry");
  EXPECT_EQ(SiblingName("https://h:8443/p/m.json?X-Amz-Signature=s#f", "d/a b+.ferry"),
            "https://h:8443/p/d/a%20b%2B.ferry");
  EXPECT_EQ(SiblingName("http://h/m.json", "a.ferry"), "http://h/a.ferry");
  EXPECT_EQ(SiblingName("http://h?q=/x", "a.ferry"), "http://h/a.ferry");
}

TEST_F(StorageTest, ShardedIndexOnS3AndHttpNamesShardsBesideIt) {
  const std::string dir = StrCat("storage/", getpid(), "/sharded/");
  Expected expected;
  uint64_t seed = 77;
  // A shard name with a space (percent-encoded over HTTP, literal in the S3 key) and one in a
  // subfolder.
  const std::vector<std::string> files = {"part one.ferry", "sub/part-2.ferry"};
  for (size_t s = 0; s < files.size(); ++s) {
    ASSERT_TRUE(Publish(dir + files[s], [&](Writer& w) {
                  return testing::AddTestTensor(w, StrCat("w", s), DType::kBF16, {300, 64},
                                                s == 0 ? Encoding::kRaw : Encoding::kShuffleZstd,
                                                seed++, &expected);
                }).ok());
  }
  const std::string index_path = Info("root") + "/" + dir + "model.ferry.index.json";
  ASSERT_TRUE(WriteShardIndex(index_path, files, {{"step", "7"}}).ok());
  ASSERT_TRUE(PutObject(dir + "model.ferry.index.json", FileBytes(index_path)).ok());
  for (const std::string& url :
       {S3Url(dir + "model.ferry.index.json"), HttpUrl(dir + "model.ferry.index.json"),
        HttpUrl(dir + "model.ferry.index.json") + "?token=abc"}) {
    auto ck = ShardedCheckpoint::Open(url);
    ASSERT_TRUE(ck.ok()) << url << ": " << ck.status().ToString();
    EXPECT_EQ((*ck)->path(), PrintableUrl(url));
    ASSERT_EQ((*ck)->num_shards(), 2u);
    EXPECT_EQ((*ck)->shard(0)->path(), SiblingName(url, files[0]));
    auto loader = Loader::Create().value();
    for (size_t s = 0; s < 2; ++s) {
      auto out = loader->LoadToHost(*(*ck)->shard(s), {});
      ASSERT_TRUE(out.ok()) << out.status().ToString();
      EXPECT_EQ(std::memcmp((*out)[0].data, expected.at(StrCat("w", s)).data(), (*out)[0].nbytes),
                0);
    }
    ASSERT_EQ((*ck)->metadata().size(), 2u);  // "step" and "total_size"
  }
  // A shard missing from the bucket is named.
  ASSERT_TRUE(PutObject(dir + "broken.json",
                        std::vector<uint8_t>(
                            std::string_view(R"({"weight_map": {"x": "gone.ferry"}})").begin(),
                            std::string_view(R"({"weight_map": {"x": "gone.ferry"}})").end()))
                  .ok());
  EXPECT_EQ(ShardedCheckpoint::Open(S3Url(dir + "broken.json")).status().ToString(),
            "NotFound: " + S3Url(dir + "gone.ferry") + ": no such object (HTTP 404 NoSuchKey)");
}

// ---- the C API ------------------------------------------------------------------------------

TEST_F(StorageTest, TheCApiTakesUrlsAndItsStorageOptions) {
  ferry_reader_options_t ro;
  ferry_reader_options_init(&ro);
  ro.max_in_flight = 2;
  ro.piece_bytes = 128 << 10;
  ferry_loader_t* loader = nullptr;
  ASSERT_EQ(ferry_loader_create(nullptr, &loader, nullptr), FERRY_OK);
  const std::string ca = Info("ca");  // outlives every use of ro.ca_bundle below
  for (const std::string& url : {Urls()[0], Urls()[1], HttpsUrl(EveryEncoding().name)}) {
    ro.ca_bundle = url.rfind("https", 0) == 0 ? ca.c_str() : nullptr;
    ferry_reader_t* reader = nullptr;
    ferry_error_t error{};
    ASSERT_EQ(ferry_reader_open(url.c_str(), &ro, &reader, &error), FERRY_OK)
        << url << ": " << error.message;
    EXPECT_EQ(std::string(ferry_reader_path(reader)), url);
    for (const auto& [tensor, want] : EveryEncoding().expected) {
      std::vector<uint8_t> got(want.size());
      ferry_load_request_t q;
      ferry_load_request_init(&q, tensor.c_str());
      q.dst = got.data();
      q.dst_bytes = got.size();
      ASSERT_EQ(ferry_loader_load_to_host(loader, reader, &q, 1, nullptr, &error), FERRY_OK)
          << url << " " << tensor << ": " << error.message;
      EXPECT_TRUE(got == want) << url << " " << tensor;
    }
    ferry_reader_free(reader);
  }
  ferry_loader_free(loader);

  // An older caller's struct (without the storage fields) still opens URLs.
  struct {
    size_t struct_size;
    int32_t verify_on_open;
  } old{sizeof(old), 1};
  ferry_reader_t* reader = nullptr;
  ASSERT_EQ(
      ferry_reader_open(Urls()[1].c_str(), reinterpret_cast<const ferry_reader_options_t*>(&old),
                        &reader, nullptr),
      FERRY_OK);
  ferry_reader_free(reader);

  ferry_error_t error{};
  const std::string missing = S3Url("storage/missing.ferry");
  EXPECT_EQ(ferry_reader_open(missing.c_str(), nullptr, &reader, &error), FERRY_NOT_FOUND);
  EXPECT_EQ(std::string(error.message), missing + ": no such object (HTTP 404 NoSuchKey)");
  ro.max_in_flight = 1000;
  EXPECT_EQ(ferry_reader_open(Urls()[0].c_str(), &ro, &reader, &error), FERRY_INVALID_ARGUMENT);
  EXPECT_EQ(ferry_reader_open("gs://b/k", nullptr, &reader, &error), FERRY_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(error.message),
            "gs://b/k: URL scheme 'gs' is not supported (http://, https://, s3://), and no "
            "local file has this name");
}

// ---- saves to s3:// --------------------------------------------------------------------------

// The object at `key` of the test bucket, whole.
Result<std::vector<uint8_t>> ObjectBytes(const std::string& key) {
  FERRY_ASSIGN_OR_RETURN(auto src, OpenS3Source(S3Url(key), MotoSettings(), RemoteOptions()));
  std::vector<uint8_t> out(src->size());
  FERRY_RETURN_IF_ERROR(src->ReadAt(0, out.size(), out.data()));
  return out;
}

void ExpectObjectHolds(const std::string& url, const Expected& expected) {
  auto reader = Reader::Open(url, ReaderOptions{.verify_on_open = true});
  ASSERT_TRUE(reader.ok()) << url << ": " << reader.status().ToString();
  ASSERT_EQ((*reader)->num_tensors(), expected.size()) << url;
  for (const auto& [name, want] : expected) {
    std::vector<uint8_t> got(want.size());
    Status st = (*reader)->ReadInto(name, got.data(), got.size(), {true});
    ASSERT_TRUE(st.ok()) << url << " " << name << ": " << st.ToString();
    EXPECT_TRUE(got == want) << url << " " << name;
  }
}

// Tensors of every encoding in 1 MiB blocks, 22 MiB of incompressible raw bytes among them:
// several 8 MiB parts, whose 4 MiB segments the workers fill out of order.
Status AddManyParts(Writer& w, Expected* expected) {
  FERRY_RETURN_IF_ERROR(AddEveryEncoding(w, expected));
  FERRY_RETURN_IF_ERROR(
      testing::AddTestTensor(w, "big", DType::kF32, {22 << 18}, Encoding::kRaw, 99, expected));
  return testing::AddTestTensor(w, "tail", DType::kBF16, {3, 1000}, Encoding::kShuffleZstd, 100,
                                expected);
}

TEST_F(StorageTest, SavesToS3RoundTripSyncAndAsync) {
  for (bool async : {false, true}) {
    for (int threads : {1, 4}) {
      for (bool staged : {false, true}) {
        const std::string url =
            S3Url(StrCat("storage/", getpid(), "/saved ", async, threads, staged, ".ferry"));
        WriterOptions wo;
        wo.block_size = 1 << 20;
        wo.threads = threads;
        if (staged) wo.staging = StagingPool::Create(8 << 20).value();
        auto w = Writer::Create(url, wo);
        ASSERT_TRUE(w.ok()) << w.status().ToString();
        EXPECT_EQ(w->path(), url);
        Expected expected;
        ASSERT_TRUE(AddManyParts(*w, &expected).ok());
        ASSERT_TRUE(w->SetMetadata("step", "12").ok());
        // Nothing is visible before the commit.
        EXPECT_EQ(Reader::Open(url).status().code(), StatusCode::kNotFound) << url;
        if (async) {
          auto handle = w->CommitAsync();
          ASSERT_TRUE(handle.ok()) << handle.status().ToString();
          ASSERT_TRUE(handle->Wait().ok()) << url;
        } else {
          Status st = w->Commit();
          ASSERT_TRUE(st.ok()) << url << ": " << st.ToString();
        }
        ExpectObjectHolds(url, expected);
        const auto metadata = Reader::Open(url).value()->metadata();
        EXPECT_EQ(metadata, (std::vector<std::pair<std::string, std::string>>{{"step", "12"}}));
      }
    }
  }
}

TEST_F(StorageTest, SmallSavesAndSafetensorsGoUpWhole) {
  // Under one part: one PutObject at the commit.
  const std::string url = S3Url(StrCat("storage/", getpid(), "/small save.ferry"));
  Expected expected;
  auto w = Writer::Create(url).value();
  ASSERT_TRUE(testing::AddTestTensor(w, "x", DType::kI32, {5}, Encoding::kRaw, 3, &expected).ok());
  ASSERT_TRUE(w.Commit().ok());
  ExpectObjectHolds(url, expected);

  // safetensors output (ferry convert --to safetensors) streams to the object as well.
  const std::string st_url = S3Url(StrCat("storage/", getpid(), "/out.safetensors"));
  std::vector<uint8_t> data = testing::RandomBytes(6 << 20, 5);
  auto sw = SafetensorsWriter::Create(st_url, {{"w", DType::kU8, {6 << 20}}}, {{"k", "v"}});
  ASSERT_TRUE(sw.ok()) << sw.status().ToString();
  ASSERT_TRUE(sw->Write(data.data(), data.size()).ok());
  EXPECT_EQ(Reader::Open(st_url).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(sw->Commit().ok());
  ExpectObjectHolds(st_url, {{"w", data}});

  // A plain HTTP server takes no uploads.
  EXPECT_EQ(
      Writer::Create(HttpUrl("storage/up.ferry")).status().ToString(),
      "InvalidArgument: " + HttpUrl("storage/up.ferry") + ": only s3:// destinations take uploads");
}

TEST_F(StorageTest, DeviceSavesToS3) {
#ifdef FERRY_HAVE_CUDA
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device";
  std::vector<uint8_t> host = testing::TensorBytes(20 << 20, 7, true);
  void* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, host.size()), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  for (bool async : {false, true}) {
    for (Encoding enc : {Encoding::kRaw, Encoding::kShuffleZstd, Encoding::kPlanes}) {
      const std::string url =
          S3Url(StrCat("storage/", getpid(), "/device ", async, EncodingName(enc), ".ferry"));
      WriterOptions wo;
      wo.block_size = 1 << 20;
      auto w = Writer::Create(url, wo).value();
      ASSERT_TRUE(
          w.AddDeviceTensor("w", DType::kBF16, {10 << 20}, dev, host.size(), nullptr, enc).ok());
      if (async) {
        auto handle = w.CommitAsync();
        ASSERT_TRUE(handle.ok() && handle->Wait().ok()) << url;
      } else {
        ASSERT_TRUE(w.Commit().ok()) << url;
      }
      ExpectObjectHolds(url, {{"w", host}});
    }
  }
  cudaFree(dev);
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

// The object a failed save must leave in place.
Status SaveOld(const std::string& url, Expected* old) {
  FERRY_ASSIGN_OR_RETURN(Writer w, Writer::Create(url));
  FERRY_RETURN_IF_ERROR(
      testing::AddTestTensor(w, "old", DType::kF32, {1000}, Encoding::kRaw, 1, old));
  return w.Commit();
}

TEST_F(StorageTest, AFailedOrAbandonedSaveLeavesThePreviousObject) {
  const std::string key = StrCat("storage/", getpid(), "/kept.ferry");
  const std::string url = S3Url(key);
  Expected old;
  ASSERT_TRUE(SaveOld(url, &old).ok());
  const std::vector<uint8_t> before = ObjectBytes(key).value();
  // 30 MiB pulled from a source that fails past 20 MiB: parts are already uploaded then.
  const FillFn failing = [](uint64_t offset, void* dst, uint64_t n) -> Status {
    if (offset >= (20 << 20)) return Error(StatusCode::kIoError, "the source went away");
    std::memset(dst, 0x5a, n);
    return Status::Ok();
  };
  {
    WriterOptions wo;
    wo.block_size = 1 << 20;
    auto w = Writer::Create(url, wo).value();
    Status st = w.AddTensorFrom("new", DType::kU8, {30 << 20}, failing, Encoding::kRaw);
    EXPECT_EQ(st.ToString(), "IoError: " + url +
                                 ": tensor 'new': source failed at byte 20971520: the source "
                                 "went away");
    EXPECT_FALSE(w.Commit().ok());
  }
  EXPECT_TRUE(ObjectBytes(key).value() == before);
  // Aborted, and dropped without a commit, after parts went up.
  for (bool abort : {true, false}) {
    auto w = Writer::Create(url).value();
    std::vector<uint8_t> big = testing::RandomBytes(24 << 20, 9);
    ASSERT_TRUE(w.AddTensor("new", DType::kU8, {24 << 20}, big.data(), big.size()).ok());
    if (abort) w.Abort();
  }
  EXPECT_TRUE(ObjectBytes(key).value() == before);
  ExpectObjectHolds(url, old);
}

TEST_F(StorageTest, ASaveKilledMidUploadLeavesThePreviousObject) {
  const std::string key = StrCat("storage/", getpid(), "/killed.ferry");
  const std::string url = S3Url(key);
  Expected old;
  ASSERT_TRUE(SaveOld(url, &old).ok());
  const std::vector<uint8_t> before = ObjectBytes(key).value();
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // 48 MiB of raw bytes, unstaged: AddTensor returns once they are in the upload, which
    // holds at most 4 parts of 8 MiB at once, so at least two parts have reached the server.
    close(ready[0]);
    std::vector<uint8_t> big = testing::RandomBytes(48 << 20, 11);
    auto w = Writer::Create(url);
    if (!w.ok() || !w->AddTensor("new", DType::kU8, {48 << 20}, big.data(), big.size()).ok()) {
      _exit(1);
    }
    char c = 'x';
    if (write(ready[1], &c, 1) != 1) _exit(1);
    for (;;) pause();  // killed here, before the commit
  }
  close(ready[1]);
  char c = 0;
  const bool signalled = read(ready[0], &c, 1) == 1;
  close(ready[0]);
  kill(child, SIGKILL);
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(signalled) << "the child's save failed (exit status " << wstatus << ")";
  EXPECT_TRUE(WIFSIGNALED(wstatus));
  EXPECT_TRUE(ObjectBytes(key).value() == before);
  ExpectObjectHolds(url, old);
}

// ---- the split of a distributed load --------------------------------------------------------

// The ranges read through a source once Record() was called; thread-safe.
class RangeLog {
 public:
  void Record() {
    std::lock_guard<std::mutex> lock(mu_);
    on_ = true;
  }
  void Add(uint64_t offset, uint64_t len) {
    std::lock_guard<std::mutex> lock(mu_);
    if (on_ && len > 0) ranges_.emplace_back(offset, offset + len);
  }
  std::vector<std::pair<uint64_t, uint64_t>> Ranges() const {
    std::lock_guard<std::mutex> lock(mu_);
    return ranges_;
  }

 private:
  mutable std::mutex mu_;
  bool on_ = false;
  std::vector<std::pair<uint64_t, uint64_t>> ranges_;
};

// Sorted, joined intervals.
std::vector<std::pair<uint64_t, uint64_t>> Union(std::vector<std::pair<uint64_t, uint64_t>> v) {
  std::sort(v.begin(), v.end());
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const auto& r : v) {
    if (!out.empty() && r.first <= out.back().second) {
      out.back().second = std::max(out.back().second, r.second);
    } else {
      out.push_back(r);
    }
  }
  return out;
}
uint64_t Total(const std::vector<std::pair<uint64_t, uint64_t>>& v) {
  uint64_t n = 0;
  for (const auto& r : Union(v)) n += r.second - r.first;
  return n;
}

// Each of `nranks` ranks (threads) opens the object through a recording source, plans the
// load with the others (MakeDistPlan over a thread group) and reads its own pieces as the
// distributed loader does (row ranges through a Loader, here into host memory); the bytes it
// assembled are checked against what the plan says it holds. Returns the ranges each rank
// read from the object store.
std::vector<std::vector<std::pair<uint64_t, uint64_t>>> ReadShares(const std::string& url,
                                                                   int nranks, int rounds,
                                                                   const Expected& expected) {
  testing::ThreadGroup group(nranks);
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> out(nranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < nranks; ++r) {
    threads.emplace_back([&, r] {
      auto src = OpenS3Source(url, MotoSettings(), RemoteOptions());
      ASSERT_TRUE(src.ok()) << src.status().ToString();
      auto log = std::make_shared<RangeLog>();
      auto recording = std::make_shared<testing::ObservedSource>(
          *src, [log](uint64_t offset, uint64_t len) { log->Add(offset, len); });
      auto reader = OpenReader(recording).value();
      log->Record();  // after the trailer and footer, which every rank reads
      AllReduceMaxFn reduce = group.Rank(r).all_reduce_max;
      auto plan = MakeDistPlan(SourceOf(*reader), {}, r, nranks, rounds, 0, &reduce);
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();
      LoaderOptions lo;
      lo.verify = false;  // checksums of cut blocks would be read from the store
      auto loader = Loader::Create(lo).value();
      for (const auto& round : PiecesOf(plan->pieces, r, rounds)) {
        std::vector<LoadRequest> requests;
        std::vector<std::vector<uint8_t>> buffers;
        for (const PlanPiece* p : round) {
          const PlanEntry& m = plan->items[p->item];
          LoadRequest q;
          q.name = m.info.name;
          std::tie(q.row_begin, q.row_end) = PieceRows(m, *p);
          buffers.emplace_back(p->len);
          q.dst = buffers.back().data();
          q.dst_bytes = p->len;
          requests.push_back(q);
        }
        auto loaded = loader->LoadToHost(*reader, requests);
        ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
        for (size_t k = 0; k < round.size(); ++k) {
          const PlanPiece* p = round[k];
          const std::vector<uint8_t>& want = expected.at(plan->items[p->item].info.name);
          EXPECT_EQ(std::memcmp(buffers[k].data(), want.data() + p->begin, p->len), 0);
        }
      }
      out[r] = log->Ranges();
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST_F(StorageTest, EachRankReadsOnlyItsShareOfTheObject) {
  const std::string name = StrCat("storage/", getpid(), "/split.ferry");
  Expected expected;
  ASSERT_TRUE(Publish(name, [&](Writer& w) -> Status {
                for (int i = 0; i < 12; ++i) {
                  FERRY_RETURN_IF_ERROR(testing::AddTestTensor(w, StrCat("layer", 10 + i),
                                                               DType::kBF16, {100 + 37 * i, 512},
                                                               Encoding::kRaw, i, &expected));
                }
                return Status::Ok();
              }).ok());
  auto reader = Reader::Open(S3Url(name)).value();
  uint64_t data = 0;
  std::vector<std::pair<uint64_t, uint64_t>> tensors;
  for (size_t i = 0; i < reader->num_tensors(); ++i) {
    const TensorInfo t = reader->tensor(i);
    tensors.emplace_back(t.data_offset, t.data_offset + t.data_size);
    data += t.data_size;
  }
  for (int nranks : {2, 3}) {
    auto ranges = ReadShares(S3Url(name), nranks, 2, expected);
    if (HasFailure()) return;
    std::vector<std::pair<uint64_t, uint64_t>> all;
    for (int r = 0; r < nranks; ++r) {
      // Its share, within a row of 1/N, and nothing outside the tensors' bytes.
      const uint64_t mine = Total(ranges[r]);
      EXPECT_NEAR(static_cast<double>(mine), static_cast<double>(data) / nranks, 1024.0)
          << "rank " << r << " of " << nranks;
      for (const auto& rg : ranges[r]) {
        EXPECT_TRUE(std::any_of(tensors.begin(), tensors.end(), [&](const auto& t) {
          return rg.first >= t.first && rg.second <= t.second;
        })) << rg.first;
      }
      all.insert(all.end(), ranges[r].begin(), ranges[r].end());
    }
    // No byte read twice; together, every byte of every tensor.
    uint64_t sum = 0;
    for (int r = 0; r < nranks; ++r) sum += Total(ranges[r]);
    EXPECT_EQ(sum, data);
    EXPECT_EQ(Total(all), data);
  }
}

TEST_F(StorageTest, CompressedSharesOverlapByAtMostTheBlocksAtTheirEdges) {
  auto reader = Reader::Open(S3Url(EveryEncoding().name)).value();
  uint64_t stored = 0, largest = 0;
  for (size_t i = 0; i < reader->num_tensors(); ++i) {
    const BlockSource& blocks = BlocksOf(*reader);
    stored += reader->tensor(i).data_size;
    for (uint64_t b = 0; b < blocks.NumBlocks(i); ++b) {
      largest = std::max(largest, blocks.Block(i, b).stored_size);
    }
  }
  const int nranks = 3;
  auto ranges = ReadShares(S3Url(EveryEncoding().name), nranks, 2, EveryEncoding().expected);
  for (int r = 0; r < nranks; ++r) {
    // A piece that cuts an encoded block reads the whole block (and there are two pieces per
    // rank and tensor kind at most).
    EXPECT_LE(Total(ranges[r]), stored / nranks + 16 * largest) << "rank " << r;
  }
}

}  // namespace
}  // namespace ferry
