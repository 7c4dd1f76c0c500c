// safetensors through the Reader: files of the reference library load bit-exactly, malformed
// headers fail with messages that name the file, the tensor and the offset; the writer and
// the sharded index.
#include "format/safetensors.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "ferry/ferry.hpp"
#include "ferry/loader.hpp"
#include "format/block_source.hpp"
#include "format/footer.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

using testing::TempDir;

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

const std::string kFixtures = std::string(FERRY_TEST_DATA_DIR) + "/safetensors";

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// A safetensors file image: the u64 length, `header` verbatim, then `data`.
std::string Image(const std::string& header, const std::string& data = "",
                  uint64_t claimed_length = UINT64_MAX) {
  uint64_t n = claimed_length == UINT64_MAX ? header.size() : claimed_length;
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

// Opens `image` written to a file and returns the error (or "OK").
Status OpenImage(const TempDir& dir, const std::string& image,
                 const std::string& name = "bad.safetensors") {
  std::string path = dir.File(name);
  WriteFile(path, image);
  auto r = Reader::Open(path);
  return r.ok() ? Status::Ok() : r.status();
}

// The fixture's byte rule (tests/data/safetensors/make_fixtures.py).
std::string FixtureBytes(size_t position, uint64_t nbytes, bool is_bool) {
  std::string out(nbytes, '\0');
  for (uint64_t k = 0; k < nbytes; ++k) {
    out[k] = static_cast<char>(is_bool ? k % 2 : (7 * k + 13 * position + 1) % 251);
  }
  return out;
}

TEST(SafetensorsTest, ReferenceLibraryFileLoadsBitExactly) {
  auto r = Reader::Open(kFixtures + "/all_dtypes.safetensors");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const Reader& reader = **r;
  EXPECT_TRUE(BlocksOf(reader).safetensors());
  EXPECT_FALSE(BlocksOf(reader).has_checksums());
  EXPECT_EQ(reader.producer(), "safetensors");
  ASSERT_EQ(reader.num_tensors(), 22u);
  EXPECT_EQ(reader.metadata("format"), "pt");
  EXPECT_EQ(reader.metadata("producer"), "make_fixtures.py");

  const std::map<std::string, std::pair<DType, std::vector<int64_t>>> expect = {
      {"bool.mask", {DType::kBool, {5}}},
      {"c64.z", {DType::kC64, {3}}},
      {"empty.f16", {DType::kF16, {0, 3}}},
      {"f16.w", {DType::kF16, {2, 3}}},
      {"f32.scalar", {DType::kF32, {}}},
      {"f32.w", {DType::kF32, {4, 5}}},
      {"f4.packed", {DType::kF4_E2M1FN, {2, 6}}},
      {"f64.w", {DType::kF64, {3}}},
      {"f8e4m3.w", {DType::kF8_E4M3FN, {8}}},
      {"f8e4m3fnuz.w", {DType::kF8_E4M3FNUZ, {4}}},
      {"f8e5m2.w", {DType::kF8_E5M2, {8}}},
      {"f8e5m2fnuz.w", {DType::kF8_E5M2FNUZ, {4}}},
      {"f8e8m0.scale", {DType::kF8_E8M0FNU, {4}}},
      {"i16.w", {DType::kI16, {3}}},
      {"i32.w", {DType::kI32, {3}}},
      {"i64.w", {DType::kI64, {2, 2}}},
      {"i8.w", {DType::kI8, {7}}},
      {"model.bf16", {DType::kBF16, {16, 8}}},
      {"u16.w", {DType::kU16, {3}}},
      {"u32.w", {DType::kU32, {3}}},
      {"u64.w", {DType::kU64, {2}}},
      {"u8.w", {DType::kU8, {9}}},
  };
  auto loader = Loader::Create();
  ASSERT_TRUE(loader.ok());
  auto host = (*loader)->LoadToHost(reader, {});
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  ASSERT_EQ(host->size(), reader.num_tensors());

  for (size_t i = 0; i < reader.num_tensors(); ++i) {
    TensorInfo t = reader.tensor(i);
    SCOPED_TRACE(t.name);
    auto e = expect.find(t.name);
    ASSERT_NE(e, expect.end());
    EXPECT_EQ(t.dtype, e->second.first);
    EXPECT_EQ(t.shape, e->second.second);
    EXPECT_EQ(t.encoding, Encoding::kRaw);
    std::string want = FixtureBytes(i, t.nbytes, t.dtype == DType::kBool);
    auto view = reader.View(t.name, ReadOptions{true});
    ASSERT_TRUE(view.ok()) << view.status().ToString();
    ASSERT_EQ(view->nbytes, t.nbytes);
    if (t.nbytes > 0) {
      EXPECT_EQ(std::string(static_cast<const char*>(view->data), t.nbytes), want);
    }
    std::string copy(t.nbytes, '\0');
    ASSERT_TRUE(reader.ReadInto(t.name, copy.data(), copy.size(), ReadOptions{true}).ok());
    EXPECT_EQ(copy, want);
    const LoadedTensor& lt = (*host)[i];
    ASSERT_EQ(lt.info.name, t.name);
    if (t.nbytes > 0) EXPECT_EQ(std::string(static_cast<const char*>(lt.data), t.nbytes), want);
  }
  // Nothing to check, so nothing fails; the CLI reports checksums as unavailable.
  EXPECT_TRUE(reader.VerifyAll().ok());
}

TEST(SafetensorsTest, RowSlicesAndUnalignedOffsets) {
  TempDir dir;
  // 3 bytes of I8 first push the F32 tensor to an odd data offset: legal in safetensors.
  std::string header = R"({"a":{"dtype":"I8","shape":[3],"data_offsets":[0,3]},)"
                       R"("b":{"dtype":"F32","shape":[2,2],"data_offsets":[3,19]}})";
  std::string data = "xyz";
  for (int k = 0; k < 16; ++k) data += static_cast<char>(k);
  std::string path = dir.File("odd.safetensors");
  WriteFile(path, Image(header, data));
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto b = (*r)->Find("b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->data_offset, 8 + header.size() + 3);
  std::string row(8, '\0');
  ASSERT_TRUE((*r)->ReadRowsInto("b", 1, 2, row.data(), row.size()).ok());
  EXPECT_EQ(row, data.substr(3 + 8, 8));
}

TEST(SafetensorsTest, EmptyHeaderAndPaddingAndNullMetadata) {
  TempDir dir;
  EXPECT_TRUE(OpenImage(dir, Image("{}")).ok());
  EXPECT_TRUE(OpenImage(dir, Image("{}      ")).ok());
  EXPECT_TRUE(OpenImage(dir, Image(R"({"__metadata__":null})")).ok());
}

struct BadCase {
  const char* what;
  std::string image;
  StatusCode code;
  std::vector<std::string> substrings;
};

TEST(SafetensorsTest, MalformedHeadersGetClearErrors) {
  TempDir dir;
  const std::string t = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string eight(8, 'd');
  std::vector<BadCase> cases = {
      {"huge length",
       Image("{", "", uint64_t{1} << 40),
       StatusCode::kDataLoss,
       {"safetensors header length 1099511627776", "offset 0", "exceeds the limit of 104857600"}},
      {"length past the end",
       Image("{}", "", 1000),
       StatusCode::kDataLoss,
       {"header length 1000", "runs past the end of the 10-byte file"}},
      {"invalid JSON",
       Image(R"({"t": {"dtype": "F32",,}})"),
       StatusCode::kDataLoss,
       {"bad.safetensors: safetensors header (file offset 8, ", "invalid JSON at file offset 30"}},
      {"trailing garbage", Image("{}  x"), StatusCode::kDataLoss, {"invalid JSON"}},
      {"unknown dtype",
       Image(R"({"t":{"dtype":"F7","shape":[2],"data_offsets":[0,2]}})", "dd"),
       StatusCode::kDataLoss,
       {"tensor 't': unknown dtype 'F7'"}},
      {"packed F6",
       Image(R"({"t":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[0,3]}})", "ddd"),
       StatusCode::kUnimplemented,
       {"tensor 't': dtype F6_E2M3 (packed 6-bit elements) has no TensorFerry equivalent"}},
      {"offsets out of range",
       Image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "dddd"),
       StatusCode::kDataLoss,
       {"tensor 't': data_offsets [0, 8]", "run past the end of the 4-byte data section"}},
      {"begin after end",
       Image(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", eight),
       StatusCode::kDataLoss,
       {"tensor 't': data_offsets [8, 0] has begin after end"}},
      {"overlap",
       Image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
             R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
             eight),
       StatusCode::kDataLoss,
       {"tensor 'b': data_offsets [4, 8] overlap tensor 'a' at [0, 8] (file offset "}},
      {"size mismatch",
       Image(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight),
       StatusCode::kDataLoss,
       {"tensor 't': data_offsets [0, 8] (file offset ",
        "hold 8 bytes but shape [3] of F32 needs 12"}},
      {"negative dim",
       Image(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight),
       StatusCode::kDataLoss,
       {"tensor 't': shape dim 0 is -2, not a non-negative integer"}},
      {"fractional dim",
       Image(R"({"t":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", eight),
       StatusCode::kDataLoss,
       {"shape dim 0 is 2.0"}},
      {"numel overflow",
       Image(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
             eight),
       StatusCode::kDataLoss,
       {"tensor 't': element count overflows 64 bits"}},
      {"missing dtype",
       Image(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", eight),
       StatusCode::kDataLoss,
       {"tensor 't': no \"dtype\""}},
      {"missing offsets",
       Image(R"({"t":{"dtype":"F32","shape":[2]}})", eight),
       StatusCode::kDataLoss,
       {"tensor 't': no \"data_offsets\""}},
      {"bad offsets",
       Image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", eight),
       StatusCode::kDataLoss,
       {"\"data_offsets\" is [0], not [begin, end]"}},
      {"negative offset",
       Image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[-1,7]}})", eight),
       StatusCode::kDataLoss,
       {"not [begin, end] as non-negative integers"}},
      {"unknown field",
       Image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"device":"cuda:0"}})", eight),
       StatusCode::kDataLoss,
       {"tensor 't': unknown field 'device'"}},
      {"entry not an object",
       Image(R"({"t":[1,2]})"),
       StatusCode::kDataLoss,
       {"tensor 't': entry is not a JSON object"}},
      {"duplicate tensor",
       Image("{" + t + "," + t + "}", eight),
       StatusCode::kDataLoss,
       {"has the key 't' twice"}},
      {"deep nesting",
       Image(R"({"t":{"dtype":"F32","shape":[[[2]]],"data_offsets":[0,8]}})", eight),
       StatusCode::kDataLoss,
       {"nests deeper than a safetensors header can"}},
      {"metadata not strings",
       Image(R"({"__metadata__":{"step":12}})"),
       StatusCode::kDataLoss,
       {"\"__metadata__\" value of 'step' is not a string"}},
      {"empty name",
       Image(R"({"":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", eight),
       StatusCode::kDataLoss,
       {"a tensor has an empty name"}},
      {"NUL in name",
       Image(R"({"a\u0000b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", eight),
       StatusCode::kDataLoss,
       {"name contains a NUL byte"}},
      {"invalid UTF-8", Image("{\"\xff\":{}}"), StatusCode::kDataLoss, {"invalid JSON"}},
  };
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.what);
    Status st = OpenImage(dir, c.image);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), c.code) << st.ToString();
    EXPECT_PRED2(Contains, st.message(), dir.File("bad.safetensors")) << st.ToString();
    for (const std::string& s : c.substrings) {
      EXPECT_PRED2(Contains, st.message(), s) << st.ToString();
    }
  }
}

TEST(SafetensorsTest, NotSafetensorsFallsBackToTheFerryMessage) {
  TempDir dir;
  Status st = OpenImage(dir, std::string(64, '\x01'), "junk.bin");
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_PRED2(Contains, st.message(), "not a TensorFerry checkpoint (bad magic at offset 0)");
  // Text is not corruption: the message says what the file looks like.
  st = OpenImage(dir, std::string(64, 'x'), "junk.txt");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_PRED2(
      Contains, st.message(),
      "junk.txt: not a TensorFerry checkpoint: it looks like a text file, not a checkpoint");
}

// A file of another kind opened as a checkpoint: the message says what it looks like and how
// to convert or open it, not "bad magic", which reads like corruption.
TEST(SafetensorsTest, ForeignFilesSayWhatTheyAreAndHowToConvertThem) {
  TempDir dir;
  const std::string data = std::string(FERRY_TEST_DATA_DIR);
  auto open = [&](const std::string& image, const std::string& name) {
    Status st = OpenImage(dir, image, name);
    const std::string prefix = dir.File(name) + ": not a TensorFerry checkpoint: it ";
    EXPECT_EQ(st.message().rfind(prefix, 0), 0u) << st.message();
    return std::make_pair(st.code(), st.message().rfind(prefix, 0) == 0
                                         ? st.message().substr(prefix.size())
                                         : st.message());
  };
  auto convert = [&](const std::string& name) {
    return "convert it with `ferry convert " + dir.File(name) +
           " out.ferry` (Python: tensorferry.convert)";
  };
  using P = std::pair<StatusCode, std::string>;
  EXPECT_EQ(open(ReadFile(data + "/torch/dtypes.pt"), "model.pt"),
            P(StatusCode::kInvalidArgument,
              "looks like a PyTorch checkpoint (a zip archive, as torch.save writes): " +
                  convert("model.pt")));
  EXPECT_EQ(open(ReadFile(data + "/torch/pytorch_model-00001-of-00002.bin"), "shard.bin"),
            P(StatusCode::kInvalidArgument,
              "looks like a PyTorch checkpoint (a zip archive, as torch.save writes): " +
                  convert("shard.bin")));
  const std::string legacy_hint =
      "looks like a PyTorch checkpoint in torch.save's legacy format, which TensorFerry does "
      "not read: load it with torch.load and save it with tensorferry.torch.save_state_dict (or "
      "again with a current torch.save)";
  EXPECT_EQ(open(ReadFile(data + "/torch/legacy.pt"), "legacy.pt"),
            P(StatusCode::kInvalidArgument, legacy_hint));
  const std::string index_hint =
      "looks like the index of a sharded checkpoint (JSON with a weight_map): open it as one "
      "(ShardedCheckpoint::Open, ferry_sharded_open, tensorferry.distributed.open_checkpoint) "
      "or merge its shards into one file with `ferry convert ";
  for (const char* index : {"/torch/pytorch_model.bin.index.json",
                            "/safetensors/sharded/model.safetensors.index.json"}) {
    EXPECT_EQ(open(ReadFile(data + index), "index.json"),
              P(StatusCode::kInvalidArgument, index_hint + dir.File("index.json") + " out.ferry`"));
  }
  // A safetensors header that opens after whitespace, its length past the end of the file.
  std::string truncated = std::string("\xff\x00\x00\x00\x00\x00\x00\x00", 8) + "  {\"a\":";
  truncated.resize(40, ' ');
  EXPECT_EQ(open(truncated, "cut.safetensors"),
            P(StatusCode::kDataLoss,
              "looks like a safetensors file whose header length does not fit the file "
              "(truncated or damaged)"));
  EXPECT_EQ(open(std::string("\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94", 13) +
                     std::string(30, 'N') + ".",
                 "state.pkl"),
            P(StatusCode::kInvalidArgument,
              "looks like a Python pickle, which TensorFerry never runs: load it with the "
              "program that wrote it and save its tensors with tensorferry"));
  EXPECT_EQ(open(std::string("PK\x03\x04", 4) + std::string(60, '\0') + "arr_0.npy", "a.npz"),
            P(StatusCode::kInvalidArgument,
              "looks like a zip archive (an .npz or another archive), not a checkpoint"));
  EXPECT_EQ(open("\xef\xbb\xbf [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]\n", "list.json"),
            P(StatusCode::kInvalidArgument, "looks like a JSON file, not a checkpoint"));
  EXPECT_EQ(open("model weights: see the README for where they are kept\n", "notes.txt"),
            P(StatusCode::kInvalidArgument, "looks like a text file, not a checkpoint"));
  // Shorter than any checkpoint: too little to tell by.
  Status st = OpenImage(dir, "garbage", "short.txt");
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_PRED2(Contains, st.message(), "7 bytes, too short for a TensorFerry checkpoint");
  // The command shown is one shell word whatever the name holds.
  EXPECT_EQ(open(ReadFile(data + "/torch/dtypes.pt"), "it's a model.pt").second,
            "looks like a PyTorch checkpoint (a zip archive, as torch.save writes): convert it "
            "with `ferry convert '" +
                dir.File("it'\\''s a model.pt") + "' out.ferry` (Python: tensorferry.convert)");
}

// Every single-byte change of a valid header either still parses or fails cleanly.
TEST(SafetensorsTest, ByteFlipsNeverCrash) {
  TempDir dir;
  std::string image = ReadFile(kFixtures + "/all_dtypes.safetensors");
  uint64_t n;
  std::memcpy(&n, image.data(), 8);
  std::string path = dir.File("flip.safetensors");
  int failures = 0;
  for (uint64_t at = 0; at < 8 + n; at += 3) {
    std::string bad = image;
    bad[at] = static_cast<char>(bad[at] ^ (at < 8 ? 0x40 : 0x0b));
    WriteFile(path, bad);
    auto r = Reader::Open(path);
    if (!r.ok()) {
      ++failures;
      EXPECT_PRED2(Contains, r.status().message(), path);
    }
  }
  EXPECT_GT(failures, 0);
}

TEST(SafetensorsTest, DTypeNamesRoundTrip) {
  for (int v = 0; v < kNumDTypes; ++v) {
    auto d = static_cast<DType>(v);
    const char* name = SafetensorsDTypeName(d);
    bool representable = d != DType::kC128 && d != DType::kF6_E2M3FN && d != DType::kF6_E3M2FN;
    ASSERT_EQ(name != nullptr, representable) << DTypeName(d);
    if (name) EXPECT_EQ(ParseSafetensorsDType(name), d);
  }
  EXPECT_STREQ(SafetensorsDTypeName(DType::kF8_E4M3FN), "F8_E4M3");
  EXPECT_STREQ(SafetensorsDTypeName(DType::kF4_E2M1FN), "F4");
}

TEST(SafetensorsWriterTest, WritesWhatTheReaderReadsBack) {
  TempDir dir;
  std::string path = dir.File("out.safetensors");
  std::vector<SafetensorsEntry> entries = {{"small", DType::kI8, {3}},
                                           {"wide", DType::kF64, {2}},
                                           {"mid", DType::kBF16, {2, 2}},
                                           {"fp4", DType::kF4_E2M1FN, {4}}};
  SortSafetensorsEntries(&entries);
  std::vector<std::string> order;
  for (const auto& e : entries) order.push_back(e.name);
  EXPECT_EQ(order, (std::vector<std::string>{"wide", "mid", "small", "fp4"}));
  auto w = SafetensorsWriter::Create(path, entries, {{"k", "v"}}, false);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->data_bytes(), 16u + 8u + 3u + 2u);
  EXPECT_EQ(w->header_bytes() % 8, 0u);
  std::string data;
  for (int k = 0; k < 29; ++k) data += static_cast<char>(k * 5);
  ASSERT_TRUE(w->Write(data.data(), 10).ok());
  ASSERT_TRUE(w->Write(data.data() + 10, 19).ok());
  ASSERT_TRUE(w->Commit().ok());

  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->metadata("k"), "v");
  std::string wide(16, '\0'), fp4(2, '\0');
  ASSERT_TRUE((*r)->ReadInto("wide", wide.data(), wide.size()).ok());
  ASSERT_TRUE((*r)->ReadInto("fp4", fp4.data(), fp4.size()).ok());
  EXPECT_EQ(wide, data.substr(0, 16));
  EXPECT_EQ(fp4, data.substr(27, 2));
  EXPECT_EQ((*r)->Find("wide")->data_offset % 8, 0u);
}

TEST(SafetensorsWriterTest, RefusesWhatSafetensorsCannotHold) {
  TempDir dir;
  std::string path = dir.File("out.safetensors");
  auto c128 = SafetensorsWriter::Create(path, {{"z", DType::kC128, {1}}}, {}, false);
  EXPECT_EQ(c128.status().code(), StatusCode::kUnimplemented);
  EXPECT_PRED2(Contains, c128.status().message(), "tensor 'z' of dtype C128 has no safetensors");
  auto odd = SafetensorsWriter::Create(path, {{"q", DType::kF4_E2M1FN, {3}}}, {}, false);
  EXPECT_EQ(odd.status().code(), StatusCode::kUnimplemented);
  EXPECT_PRED2(Contains, odd.status().message(), "3 F4 elements");
  auto dup =
      SafetensorsWriter::Create(path, {{"a", DType::kU8, {1}}, {"a", DType::kU8, {1}}}, {}, false);
  EXPECT_EQ(dup.status().code(), StatusCode::kInvalidArgument);

  // Too few bytes: Commit fails and leaves no file behind.
  auto w = SafetensorsWriter::Create(path, {{"a", DType::kU8, {4}}}, {}, false);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(w->Write("ab", 2).ok());
  EXPECT_FALSE(w->Write("abc", 3).ok());
  Status st = w->Commit();
  EXPECT_PRED2(Contains, st.message(), "2 of 4 data bytes written");
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(SafetensorsIndexTest, ReadsTheShardedFixture) {
  auto index = ReadSafetensorsIndex(kFixtures + "/sharded/model.safetensors.index.json");
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  ASSERT_EQ(index->shards.size(), 2u);
  EXPECT_PRED2(Contains, index->shards[0], "sharded/model-00001-of-00002.safetensors");
  ASSERT_EQ(index->weight_map.size(), 4u);
  EXPECT_EQ(index->weight_map[0], std::make_pair(std::string("embed.weight"), size_t{0}));
  EXPECT_EQ(index->weight_map[3], std::make_pair(std::string("norm.weight"), size_t{1}));
  for (const std::string& shard : index->shards) EXPECT_TRUE(Reader::Open(shard).ok());
}

TEST(SafetensorsIndexTest, RejectsEscapesAndBadShapes) {
  TempDir dir;
  std::string path = dir.File("model.safetensors.index.json");
  WriteFile(path, R"({"weight_map": {"a": "../outside.safetensors"}})");
  auto esc = ReadSafetensorsIndex(path);
  EXPECT_EQ(esc.status().code(), StatusCode::kDataLoss);
  EXPECT_PRED2(
      Contains, esc.status().message(),
      "bad checkpoint index: tensor 'a': file '../outside.safetensors' is not a relative path");
  WriteFile(path, R"({"weight_map": {"a": "/etc/passwd"}})");
  EXPECT_FALSE(ReadSafetensorsIndex(path).ok());
  WriteFile(path, R"({"metadata": {}})");
  EXPECT_PRED2(Contains, ReadSafetensorsIndex(path).status().message(), "no \"weight_map\"");
  WriteFile(path, R"({"weight_map": {"a": 3}})");
  EXPECT_PRED2(Contains, ReadSafetensorsIndex(path).status().message(), "is not a string");
  WriteFile(path, "{");
  EXPECT_PRED2(Contains, ReadSafetensorsIndex(path).status().message(), "invalid JSON");
}

}  // namespace
}  // namespace ferry
