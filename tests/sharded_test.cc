// Sharded checkpoints: the JSON index, tensor-parallel slice fields (writer, reader, footer
// validation), and their failure modes.
#include "ferry/sharded.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "ferry_generated.h"
#include "format/footer.hpp"
#include "format/format.hpp"
#include "save_group.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

using testing::RandomBytes;
using testing::TempDir;

WriterOptions Scratch() {
  WriterOptions o;
  o.durable = false;
  return o;
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A shard with the given U8[n] tensors (contents derived from the name).
void WriteShard(const std::string& path, const std::vector<std::pair<std::string, int64_t>>& t) {
  auto w = Writer::Create(path, Scratch());
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  for (const auto& [name, n] : t) {
    auto bytes = RandomBytes(static_cast<size_t>(n), std::hash<std::string>{}(name));
    ASSERT_TRUE(w->AddTensor(name, DType::kU8, {n}, bytes.data(), bytes.size()).ok());
  }
  ASSERT_TRUE(w->Commit().ok());
}

// ---- tensor-parallel slice fields ---------------------------------------------------------

TEST(GlobalSliceTest, WriterRoundTrip) {
  TempDir dir;
  std::string path = dir.File("tp1.ferry");
  auto w = Writer::Create(path, Scratch());
  ASSERT_TRUE(w.ok());
  std::vector<uint8_t> bytes(2 * 8 * 2);
  ASSERT_TRUE(w->AddTensor("w", DType::kBF16, {2, 8}, bytes.data(), bytes.size()).ok());
  ASSERT_TRUE(w->AddTensor("plain", DType::kU8, {4}, bytes.data(), 4).ok());
  ASSERT_TRUE(w->SetGlobalSlice("w", {4, 8}, {2, 0}).ok());
  ASSERT_TRUE(w->Commit().ok());
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  TensorInfo wi = *(*r)->Find("w");
  EXPECT_EQ(wi.global_shape, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(wi.shard_offset, (std::vector<int64_t>{2, 0}));
  TensorInfo pi = *(*r)->Find("plain");
  EXPECT_TRUE(pi.global_shape.empty());
  EXPECT_TRUE(pi.shard_offset.empty());
}

TEST(GlobalSliceTest, WriterRejectsBadSlices) {
  TempDir dir;
  std::string path = dir.File("bad.ferry");
  auto w = Writer::Create(path, Scratch());
  ASSERT_TRUE(w.ok());
  std::vector<uint8_t> bytes(6);
  ASSERT_TRUE(w->AddTensor("a", DType::kU8, {2, 3}, bytes.data(), 6).ok());
  ASSERT_TRUE(w->AddTensor("b", DType::kU8, {6}, bytes.data(), 6).ok());
  Status st = w->SetGlobalSlice("nope", {2}, {0});
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_EQ(st.message(), path + ": SetGlobalSlice of 'nope', which was not added");
  st = w->SetGlobalSlice("a", {4}, {0, 0});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(),
            path + ": tensor 'a' has 2 dims, but the global shape has 1 and the offset 2");
  st = w->SetGlobalSlice("a", {4, 3}, {3, 0});
  EXPECT_EQ(st.message(), path + ": tensor 'a': dim 0 covers [3, 5) of a global extent of 4");
  st = w->SetGlobalSlice("a", {4, 3}, {-1, 0});
  EXPECT_EQ(st.message(), path + ": tensor 'a': dim 0 covers [-1, 1) of a global extent of 4");
  st = w->SetGlobalSlice("a", {4, -3}, {0, 0});
  EXPECT_EQ(st.message(),
            path + ": tensor 'a': global shape has a negative dim or its size overflows");
  // Found by search when it is not the newest tensor.
  EXPECT_TRUE(w->SetGlobalSlice("a", {2, 9}, {0, 6}).ok());
  ASSERT_TRUE(w->Commit().ok());
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->Find("a")->shard_offset, (std::vector<int64_t>{0, 6}));
}

// A footer with one U8[2, 3] tensor and the given slice fields (null: absent).
std::vector<uint8_t> SliceFooter(const std::vector<int64_t>* global,
                                 const std::vector<int64_t>* offset) {
  flatbuffers::FlatBufferBuilder b;
  auto name = b.CreateString("t");
  auto shape = b.CreateVector(std::vector<int64_t>{2, 3});
  auto sums = b.CreateVector(std::vector<uint64_t>{0});
  flatbuffers::Offset<flatbuffers::Vector<int64_t>> g = 0, o = 0;
  if (global) g = b.CreateVector(*global);
  if (offset) o = b.CreateVector(*offset);
  auto t = fb::CreateTensor(b, name, fb::DType::U8, shape, format::kFirstDataOffset, 6, 6,
                            fb::Encoding::RAW, 4096, sums, 0, g, o);
  auto tensors = b.CreateVector(std::vector<flatbuffers::Offset<fb::Tensor>>{t});
  auto root = fb::CreateCheckpoint(b, 1, 0, fb::ChecksumAlgo::XXH3_64, tensors);
  fb::FinishCheckpointBuffer(b, root);
  return std::vector<uint8_t>(b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize());
}

std::string ParseError(const std::vector<int64_t>* global, const std::vector<int64_t>* offset) {
  std::vector<uint8_t> footer = SliceFooter(global, offset);
  std::vector<uint64_t> aligned((footer.size() + 7) / 8);
  std::memcpy(aligned.data(), footer.data(), footer.size());
  auto r = ParseFooter(reinterpret_cast<const uint8_t*>(aligned.data()), footer.size(),
                       format::kFirstDataOffset + 4096, "mem");
  if (r.ok()) return "ok";
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  const std::string prefix = "mem: corrupt footer (starts at offset 8192): tensor #0 't': ";
  const std::string& m = r.status().message();
  return m.rfind(prefix, 0) == 0 ? m.substr(prefix.size()) : m;
}

TEST(GlobalSliceTest, ReaderValidatesSliceFields) {
  std::vector<int64_t> g{4, 3}, o{2, 0};
  EXPECT_EQ(ParseError(nullptr, nullptr), "ok");
  EXPECT_EQ(ParseError(&g, &o), "ok");
  EXPECT_EQ(ParseError(&g, nullptr), "has global_shape without shard_offset");
  EXPECT_EQ(ParseError(nullptr, &o), "has shard_offset without global_shape");
  std::vector<int64_t> g1{6};
  EXPECT_EQ(ParseError(&g1, &o), "2 dims, but global_shape has 1 and shard_offset 2");
  std::vector<int64_t> o1{0};
  EXPECT_EQ(ParseError(&g, &o1), "2 dims, but global_shape has 2 and shard_offset 1");
  std::vector<int64_t> neg{-1, 0};
  EXPECT_EQ(ParseError(&g, &neg),
            "slice dim 0 at offset -1 of extent 2 does not fit the global extent 4");
  std::vector<int64_t> past{3, 0};
  EXPECT_EQ(ParseError(&g, &past),
            "slice dim 0 at offset 3 of extent 2 does not fit the global extent 4");
  std::vector<int64_t> small{1, 3};
  EXPECT_EQ(ParseError(&small, &o),
            "slice dim 0 at offset 2 of extent 2 does not fit the global extent 1");
  std::vector<int64_t> gneg{4, -3};
  EXPECT_EQ(ParseError(&gneg, &o), "negative dim 1 (-3)");
}

// ---- the index ----------------------------------------------------------------------------

TEST(ShardedTest, WriteIndexAndOpen) {
  TempDir dir;
  WriteShard(dir.File("model-00001-of-00002.ferry"), {{"a", 10}, {"c", 3000}});
  std::filesystem::create_directory(dir.File("sub"));
  WriteShard(dir.File("sub/model-00002-of-00002.ferry"), {{"b", 7}, {"d", 0}});
  std::string index = dir.File("model.ferry.index.json");
  ASSERT_TRUE(WriteShardIndex(index,
                              {"sub/model-00002-of-00002.ferry", "model-00001-of-00002.ferry"},
                              {{"step", "100"}})
                  .ok());
  EXPECT_EQ(ReadText(index),
            "{\n"
            "  \"metadata\": {\n"
            "    \"step\": \"100\",\n"
            "    \"total_size\": 3017\n"
            "  },\n"
            "  \"weight_map\": {\n"
            "    \"a\": \"model-00001-of-00002.ferry\",\n"
            "    \"b\": \"sub/model-00002-of-00002.ferry\",\n"
            "    \"c\": \"model-00001-of-00002.ferry\",\n"
            "    \"d\": \"sub/model-00002-of-00002.ferry\"\n"
            "  }\n"
            "}\n");
  auto ck = ShardedCheckpoint::Open(index);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ((*ck)->num_shards(), 2u);
  EXPECT_EQ((*ck)->shard_name(0), "model-00001-of-00002.ferry");  // byte order of names
  EXPECT_EQ((*ck)->shard_name(1), "sub/model-00002-of-00002.ferry");
  EXPECT_EQ((*ck)->num_tensors(), 4u);
  EXPECT_EQ((*ck)->names(), (std::vector<std::string>{"a", "b", "c", "d"}));
  auto b = (*ck)->Find("b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->shard, 1u);
  EXPECT_EQ(b->info.nbytes, 7u);
  std::vector<uint8_t> got(7);
  ASSERT_TRUE((*ck)->shard(b->shard)->ReadInto("b", got.data(), 7).ok());
  EXPECT_EQ(got, RandomBytes(7, std::hash<std::string>{}("b")));
  auto missing = (*ck)->Find("zz");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(), index + ": no tensor named 'zz'");
  EXPECT_EQ((*ck)->metadata(), (std::vector<std::pair<std::string, std::string>>{
                                   {"step", "100"}, {"total_size", "3017"}}));
}

TEST(ShardedTest, WriteIndexRejects) {
  TempDir dir;
  WriteShard(dir.File("x.ferry"), {{"a", 1}});
  WriteShard(dir.File("y.ferry"), {{"a", 2}});
  std::string index = dir.File("i.json");
  Status st = WriteShardIndex(index, {"x.ferry", "y.ferry"});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), index + ": tensor 'a' is in both 'x.ferry' and 'y.ferry'");
  st = WriteShardIndex(index, {"../x.ferry"});
  EXPECT_EQ(st.message(),
            index + ": shard '../x.ferry' is not a relative path inside the index's directory");
  EXPECT_EQ(WriteShardIndex(index, {"nope.ferry"}).code(), StatusCode::kNotFound);
  EXPECT_FALSE(std::filesystem::exists(index));
}

// A failed index write names the index, never its temporary file: here the index's name fits
// the file system's limit and its temporary file's longer name does not (ENAMETOOLONG).
TEST(ShardedTest, FailedIndexWriteNamesTheIndex) {
  TempDir dir;
  WriteShard(dir.File("x.ferry"), {{"a", 1}});
  const std::string index = dir.File(std::string(240, 'i') + ".json");
  Status st = WriteShardIndex(index, {"x.ferry"});
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_EQ(st.message().rfind(index + ": ", 0), 0u) << st.message();
  EXPECT_EQ(st.message().find(".tmp."), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("errno " + std::to_string(ENAMETOOLONG) + ")"), std::string::npos)
      << st.message();
  EXPECT_FALSE(std::filesystem::exists(index));
}

TEST(ShardedTest, OpenRejectsBadIndexes) {
  TempDir dir;
  WriteShard(dir.File("x.ferry"), {{"a", 1}, {"b", 2}});
  WriteShard(dir.File("y.ferry"), {{"c", 3}});
  std::string index = dir.File("i.json");
  auto error = [&](const std::string& text) {
    WriteText(index, text);
    auto r = ShardedCheckpoint::Open(index);
    if (r.ok()) return std::string("ok");
    std::string m = r.status().message();
    if (r.status().code() == StatusCode::kDataLoss) {
      const std::string prefix = index + ": bad checkpoint index: ";
      EXPECT_EQ(m.rfind(prefix, 0), 0u) << m;
      return m.substr(prefix.size());
    }
    return std::string(StatusCodeName(r.status().code()));
  };
  EXPECT_EQ(error(R"({"weight_map": {"a": "x.ferry", "b": "x.ferry", "c": "y.ferry"}})"), "ok");
  EXPECT_EQ(error("[1]"), "not a JSON object");
  EXPECT_EQ(error("{"),
            "invalid JSON at byte 1: syntax error while parsing object key - "
            "unexpected end of input; expected string literal");
  EXPECT_EQ(error(R"({"weight_map": []})"), "no \"weight_map\" object (tensor name -> file name)");
  EXPECT_EQ(error(R"({"weight_map": {"a": 1}})"), "tensor 'a': file is not a string");
  EXPECT_EQ(error(R"({"weight_map": {"a": "/etc/x.ferry"}})"),
            "tensor 'a': file '/etc/x.ferry' is not a relative path inside the index's directory");
  EXPECT_EQ(error(R"({"weight_map": {"a": "d/../x.ferry"}})"),
            "tensor 'a': file 'd/../x.ferry' is not a relative path inside the index's directory");
  EXPECT_EQ(error(R"({"weight_map": {"a": "x.ferry", "a": "y.ferry"}})"), "duplicate key 'a'");
  EXPECT_EQ(error(R"({"metadata": 3, "weight_map": {}})"), "\"metadata\" is not an object");
  EXPECT_EQ(error(R"({"weight_map": {"a": "x.ferry", "b": "y.ferry", "c": "y.ferry"}})"),
            "maps tensor 'b' to 'y.ferry', which has no such tensor");
  EXPECT_EQ(error(R"({"weight_map": {"a": "x.ferry", "c": "y.ferry"}})"),
            "tensor 'b' of 'x.ferry' is not in the weight_map");
  EXPECT_EQ(error(R"({"weight_map": {"a": [[[[[[[[[1]]]]]]]]]}})"),
            "nests deeper than a checkpoint index can");
  EXPECT_EQ(error(R"({"weight_map": {"a": "x.ferry", "b": "x.ferry", "c": "z.ferry"}})"),
            "NotFound");
  auto none = ShardedCheckpoint::Open(dir.File("absent.json"));
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
}

TEST(ShardedTest, TensorInTwoShards) {
  TempDir dir;
  WriteShard(dir.File("x.ferry"), {{"a", 1}});
  WriteShard(dir.File("y.ferry"), {{"a", 1}, {"b", 1}});
  std::string index = dir.File("i.json");
  WriteText(index, R"({"weight_map": {"a": "x.ferry", "b": "y.ferry"}})");
  auto r = ShardedCheckpoint::Open(index);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(),
            index + ": bad checkpoint index: tensor 'a' is in both 'y.ferry' and 'x.ferry'");
}

TEST(ShardedTest, MetadataValuesThatAreNotStrings) {
  TempDir dir;
  WriteShard(dir.File("x.ferry"), {{"a", 1}});
  std::string index = dir.File("i.json");
  WriteText(index, R"({"metadata": {"total_size": 1, "cfg": {"k": [1, 2]}},
                       "weight_map": {"a": "x.ferry"}})");
  auto r = ShardedCheckpoint::Open(index);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->metadata(), (std::vector<std::pair<std::string, std::string>>{
                                  {"cfg", "{\"k\":[1,2]}"}, {"total_size", "1"}}));
}

// The safetensors layout opens as it is: an index over .safetensors shards.
TEST(ShardedTest, SafetensorsShards) {
  TempDir dir;
  const std::string src = std::string(FERRY_TEST_DATA_DIR) + "/safetensors/sharded/";
  std::vector<std::string> files = {"model-00001-of-00002.safetensors",
                                    "model-00002-of-00002.safetensors"};
  for (const auto& f : files) std::filesystem::copy_file(src + f, dir.File(f));
  std::string index = dir.File("model.safetensors.index.json");
  ASSERT_TRUE(WriteShardIndex(index, files).ok());
  auto ck = ShardedCheckpoint::Open(index);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ((*ck)->num_shards(), 2u);
  size_t total = 0;
  for (size_t s = 0; s < 2; ++s) total += (*ck)->shard(s)->num_tensors();
  EXPECT_EQ((*ck)->num_tensors(), total);
  for (const std::string& name : (*ck)->names()) {
    auto loc = (*ck)->Find(name);
    ASSERT_TRUE(loc.ok());
    EXPECT_TRUE((*ck)->shard(loc->shard)->Find(name).ok());
  }
}

TEST(ShardedTest, FromReader) {
  TempDir dir;
  WriteShard(dir.File("one.ferry"), {{"b", 2}, {"a", 1}});
  auto r = Reader::Open(dir.File("one.ferry"));
  ASSERT_TRUE(r.ok());
  auto ck = ShardedCheckpoint::FromReader(*r);
  EXPECT_EQ(ck->path(), dir.File("one.ferry"));
  EXPECT_EQ(ck->num_shards(), 1u);
  EXPECT_EQ(ck->shard_name(0), "one.ferry");
  EXPECT_EQ(ck->names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(ck->Find("b")->info.index, 1u);
}

// ---- ShardedSave: ranks as threads ---------------------------------------------------------

std::set<std::string> Files(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out.insert(e.path().filename().string());
  }
  return out;
}

// Every rank saves tensors "r<rank>.<k>" with content from (generation, rank, k).
std::vector<Status> SaveGeneration(const std::string& index, int nranks, uint64_t generation,
                                   bool async, int fail_rank = -1) {
  testing::ThreadGroup group(nranks);
  std::vector<Status> results(nranks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < nranks; ++rank) {
    threads.emplace_back([&, rank] {
      ShardedSaveOptions o;
      o.writer.durable = false;
      o.writer.block_size = 4096;
      o.metadata = {{"generation", std::to_string(generation)}};
      auto save = ShardedSave::Begin(index, group.Rank(rank), o);
      if (!save.ok()) {
        results[rank] = save.status();
        return;
      }
      for (int k = 0; k < 3; ++k) {
        auto bytes = RandomBytes(5000 + 3000 * k, generation * 100 + rank * 10 + k);
        Status st = (*save)->writer().AddTensor(
            "r" + std::to_string(rank) + "." + std::to_string(k), DType::kU8,
            {static_cast<int64_t>(bytes.size())}, bytes.data(), bytes.size(),
            k == 1 ? Encoding::kZstd : Encoding::kRaw);
        EXPECT_TRUE(st.ok()) << st.ToString();
      }
      if (rank == fail_rank) {
        // A shard that cannot be committed: its temporary file's directory entry is taken.
        std::filesystem::create_directory((*save)->shard_path());
        std::ofstream((*save)->shard_path() + "/x") << "x";
      }
      if (async) {
        Status st = (*save)->CommitAsync();
        results[rank] = (*save)->Finish();
        if (!st.ok()) results[rank] = st;
      } else {
        results[rank] = (*save)->Commit();
      }
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

void ExpectGeneration(const std::string& index, int nranks, uint64_t generation) {
  auto ck = ShardedCheckpoint::Open(index, {true});
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ((*ck)->num_shards(), static_cast<size_t>(nranks));
  ASSERT_EQ((*ck)->num_tensors(), static_cast<size_t>(3 * nranks));
  bool has = false;
  for (const auto& [k, v] : (*ck)->metadata()) {
    if (k == "generation") {
      EXPECT_EQ(v, std::to_string(generation));
      has = true;
    }
  }
  EXPECT_TRUE(has);
  for (int rank = 0; rank < nranks; ++rank) {
    for (int k = 0; k < 3; ++k) {
      std::string name = "r" + std::to_string(rank) + "." + std::to_string(k);
      auto loc = (*ck)->Find(name);
      ASSERT_TRUE(loc.ok()) << name;
      auto want = RandomBytes(5000 + 3000 * k, generation * 100 + rank * 10 + k);
      std::vector<uint8_t> got(want.size());
      ASSERT_TRUE((*ck)->shard(loc->shard)->ReadInto(name, got.data(), got.size(), {true}).ok());
      EXPECT_EQ(got, want) << name;
    }
  }
}

TEST(ShardedSaveTest, RanksWriteShardsAndRankZeroTheIndex) {
  TempDir dir;
  const std::string index = dir.File("model.ferry.index.json");
  for (int nranks : {1, 3}) {
    for (bool async : {false, true}) {
      SCOPED_TRACE(std::to_string(nranks) + " ranks, async " + std::to_string(async));
      uint64_t generation = nranks * 10 + async;
      for (const Status& st : SaveGeneration(index, nranks, generation, async)) {
        ASSERT_TRUE(st.ok()) << st.ToString();
      }
      ExpectGeneration(index, nranks, generation);
      // The replaced checkpoint's shards are gone: the index and this save's shards remain.
      std::set<std::string> files = Files(dir.path());
      EXPECT_EQ(files.size(), static_cast<size_t>(nranks) + 1);
      for (const std::string& f : files) {
        EXPECT_TRUE(f == "model.ferry.index.json" ||
                    (f.rfind("model-", 0) == 0 &&
                     f.find("-of-0000" + std::to_string(nranks) + ".ferry") != std::string::npos))
            << f;
      }
    }
  }
}

TEST(ShardedSaveTest, AFailedShardKeepsThePreviousCheckpointOnEveryRank) {
  TempDir dir;
  const std::string index = dir.File("m.index.json");
  for (const Status& st : SaveGeneration(index, 2, 1, false)) ASSERT_TRUE(st.ok());
  // Files of others that merely look alike are never deleted.
  std::ofstream(dir.File("mine.bin")) << "keep";
  for (bool async : {false, true}) {
    auto results = SaveGeneration(index, 2, 2, async, /*fail_rank=*/1);
    EXPECT_FALSE(results[1].ok());
    ASSERT_FALSE(results[0].ok());
    EXPECT_NE(results[0].message().find("another rank failed"), std::string::npos)
        << results[0].ToString();
    ExpectGeneration(index, 2, 1);
    // Rank 0 removed its own new shard; rank 1's is the directory the test made.
    for (const std::string& f : Files(dir.path())) {
      if (std::filesystem::is_directory(dir.File(f))) std::filesystem::remove_all(dir.File(f));
    }
    EXPECT_EQ(Files(dir.path()).size(), 4u);  // index, two shards, mine.bin
  }
  EXPECT_TRUE(std::filesystem::exists(dir.File("mine.bin")));
}

// Whatever the timing, no rank returns from a save while the replaced checkpoint's shards are
// still there: rank 0 is held inside its last all-reduce until rank 1 has returned from the
// save and looked at the folder (had rank 0 deleted only after that all-reduce, rank 1 would
// find them every time).
TEST(ShardedSaveTest, NoRankReturnsBeforeTheReplacedShardsAreGone) {
  TempDir dir;
  const std::string index = dir.File("model.ferry.index.json");
  for (const Status& st : SaveGeneration(index, 2, 1, false)) ASSERT_TRUE(st.ok());
  ASSERT_EQ(Files(dir.path()).size(), 3u);
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "sync");
    testing::ThreadGroup group(2);
    std::mutex mu;
    std::condition_variable cv;
    bool looked = false;
    std::set<std::string> seen;
    int calls = 0;
    SaveGroup rank0 = group.Rank(0);
    auto reduce = rank0.all_reduce_max;
    // Begin agrees twice and the commit twice: the fourth call is the last.
    rank0.all_reduce_max = [&](uint64_t* words, size_t count) {
      Status st = reduce(words, count);
      if (++calls == 4) {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return looked; });
      }
      return st;
    };
    std::vector<Status> results(2);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back([&, rank] {
        ShardedSaveOptions o;
        o.writer.durable = false;
        auto save = ShardedSave::Begin(index, rank == 0 ? rank0 : group.Rank(1), o);
        if (!save.ok()) {
          results[rank] = save.status();
        } else {
          uint8_t byte = static_cast<uint8_t>(rank);
          EXPECT_TRUE((*save)
                          ->writer()
                          .AddTensor("t" + std::to_string(rank), DType::kU8, {1}, &byte, 1)
                          .ok());
          if (async) {
            results[rank] = (*save)->CommitAsync();
            Status st = (*save)->Finish();
            if (results[rank].ok()) results[rank] = st;
          } else {
            results[rank] = (*save)->Commit();
          }
        }
        if (rank == 1) {
          std::lock_guard<std::mutex> lock(mu);
          seen = Files(dir.path());
          looked = true;
          cv.notify_all();
        }
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_TRUE(results[0].ok()) << results[0].ToString();
    ASSERT_TRUE(results[1].ok()) << results[1].ToString();
    EXPECT_EQ(seen, Files(dir.path()));
    EXPECT_EQ(seen.size(), 3u);  // the index and this save's two shards
  }
}

TEST(ShardedSaveTest, BeginChecksTheGroup) {
  TempDir dir;
  SaveGroup g;
  g.rank = 2;
  g.nranks = 2;
  g.all_reduce_max = [](uint64_t*, size_t) { return Status::Ok(); };
  EXPECT_EQ(ShardedSave::Begin(dir.File("x.index.json"), g).status().code(),
            StatusCode::kInvalidArgument);
  g.rank = 0;
  g.all_reduce_max = nullptr;
  EXPECT_EQ(ShardedSave::Begin(dir.File("x.index.json"), g).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry
