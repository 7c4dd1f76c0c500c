// Hostile and damaged files: every one must be rejected (or read) with a clear Status, never
// a crash, a hang or an out-of-bounds access. Footers are built directly with the generated
// FlatBuffers code so that each test breaks exactly one rule behind a correct trailer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>

#include "codec/codec.hpp"
#include "ferry/ferry.hpp"
#include "ferry_generated.h"
#include "format/footer.hpp"
#include "format/format.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

using testing::RandomBytes;
using testing::ReadFileBytes;
using testing::TempDir;
using testing::WriteFileBytes;

void PutU64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint64_t GetU64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Footer position of a well-formed file image, from its trailer.
struct FooterSpan {
  uint64_t offset, size;
};
FooterSpan FooterOf(const std::vector<uint8_t>& file) {
  uint64_t size = GetU64(file.data() + file.size() - 24);
  return {file.size() - 24 - size, size};
}

// Rewrites the trailer checksum so a modified footer passes the checksum and reaches the
// FlatBuffers verifier and the semantic checks.
void RecomputeFooterChecksum(std::vector<uint8_t>& file) {
  FooterSpan f = FooterOf(file);
  PutU64(file.data() + file.size() - 16, Checksum64(file.data() + f.offset, f.size));
}

// ---- A file described field by field ----------------------------------------------------

struct TensorSpec {
  std::string name;
  uint8_t dtype = static_cast<uint8_t>(DType::kU8);
  std::optional<std::vector<int64_t>> shape;
  uint64_t data_offset = 0;
  uint64_t data_size = 0;
  uint64_t nbytes = 0;
  uint8_t encoding = 0;
  uint64_t block_size = 4096;
  std::optional<std::vector<uint64_t>> checksums;
  std::optional<std::vector<fb::Chunk>> chunks;
  // Place the vector's elements 4 bytes off 8-byte alignment (the builder never does).
  bool misalign_shape = false;
  bool misalign_checksums = false;
  std::optional<std::vector<int64_t>> global_shape;
  std::optional<std::vector<int64_t>> shard_offset;
};

struct QuantSpec {
  std::string name;
  uint8_t quantized_dtype = static_cast<uint8_t>(DType::kF8_E4M3FN);
  uint8_t logical_dtype = static_cast<uint8_t>(DType::kBF16);
  uint8_t scaling_mode = 0;
  std::vector<int64_t> shape;
  std::string data, scale_inv, amax;
  uint8_t scale_layout = 0;
};

struct DirSpec {
  uint8_t direction = 0;
  std::vector<uint8_t> roles;
  std::vector<float> scale;
  std::vector<float> history;
  int32_t history_len = 0;
};

struct ScalingSpec {
  std::string module;
  uint8_t recipe_type = static_cast<uint8_t>(fb::Recipe::DelayedScaling);
  bool recipe_table = true;
  uint8_t fp8_format = 2;
  std::vector<DirSpec> dirs;
};

struct FileSpec {
  std::vector<uint8_t> data;  // the data section, from offset 4096
  std::vector<TensorSpec> tensors;
  std::vector<QuantSpec> quantized;
  std::vector<ScalingSpec> scaling;
  std::vector<std::pair<std::string, std::string>> metadata;
  uint32_t format_version = 1;
  uint8_t checksum_algo = 0;
  std::optional<std::vector<uint32_t>> data_order;

  TensorSpec& tensor(const std::string& name) {
    for (auto& t : tensors) {
      if (t.name == name) return t;
    }
    ADD_FAILURE() << "no tensor spec " << name;
    return tensors.front();
  }
};

// A vector of 8-byte values whose elements start 4 bytes off 8-byte alignment: legal to the
// FlatBuffers verifier, which checks only the 4-byte length field.
template <typename T>
flatbuffers::Offset<flatbuffers::Vector<T>> MisalignedVector(flatbuffers::FlatBufferBuilder& b,
                                                             const std::vector<T>& v) {
  static_assert(sizeof(T) == 8);
  // The buffer is built back to front and its total size is a multiple of 8, so an element
  // block is 8-byte aligned exactly when the bytes written after it are.
  b.PreAlign(v.size() * 8, 8);
  b.PushElement<uint32_t>(0);
  b.StartVector(v.size() * 2, 4);
  b.PushBytes(reinterpret_cast<const uint8_t*>(v.data()), v.size() * 8);
  return flatbuffers::Offset<flatbuffers::Vector<T>>(b.EndVector(v.size()));
}

flatbuffers::Offset<void> BuildRecipe(flatbuffers::FlatBufferBuilder& b, const ScalingSpec& s) {
  if (!s.recipe_table) return 0;
  auto fmt = static_cast<fb::Fp8Format>(s.fp8_format);
  switch (static_cast<fb::Recipe>(s.recipe_type)) {
    case fb::Recipe::NONE:
      return 0;
    case fb::Recipe::DelayedScaling:
      return fb::CreateDelayedScaling(b, 0, fmt).Union();
    case fb::Recipe::Float8CurrentScaling:
      return fb::CreateFloat8CurrentScaling(b, fmt).Union();
    case fb::Recipe::MXFP8BlockScaling:
      return fb::CreateMXFP8BlockScaling(b, fmt).Union();
    case fb::Recipe::Float8BlockScaling:
      return fb::CreateFloat8BlockScaling(b, fmt).Union();
    case fb::Recipe::NVFP4BlockScaling:
      return fb::CreateNVFP4BlockScaling(b).Union();
    default:
      // An unknown union member: any table will do as its payload.
      return fb::CreateCustomRecipe(b, b.CreateString("x")).Union();
  }
}

std::vector<uint8_t> BuildFooter(const FileSpec& spec) {
  flatbuffers::FlatBufferBuilder b;
  std::vector<flatbuffers::Offset<fb::Tensor>> tensors;
  for (const TensorSpec& t : spec.tensors) {
    auto name = b.CreateString(t.name);
    flatbuffers::Offset<flatbuffers::Vector<int64_t>> shape = 0;
    if (t.shape)
      shape = t.misalign_shape ? MisalignedVector(b, *t.shape) : b.CreateVector(*t.shape);
    flatbuffers::Offset<flatbuffers::Vector<uint64_t>> sums = 0;
    if (t.checksums) {
      sums =
          t.misalign_checksums ? MisalignedVector(b, *t.checksums) : b.CreateVector(*t.checksums);
    }
    auto chunks = t.chunks ? b.CreateVectorOfStructs(*t.chunks) : 0;
    auto global = t.global_shape ? b.CreateVector(*t.global_shape) : 0;
    auto offset = t.shard_offset ? b.CreateVector(*t.shard_offset) : 0;
    tensors.push_back(fb::CreateTensor(
        b, name, static_cast<fb::DType>(t.dtype), shape, t.data_offset, t.data_size, t.nbytes,
        static_cast<fb::Encoding>(t.encoding), t.block_size, sums, chunks, global, offset));
  }
  auto tvec = b.CreateVector(tensors);
  std::vector<flatbuffers::Offset<fb::QuantizedTensor>> quantized;
  for (const QuantSpec& q : spec.quantized) {
    auto name = b.CreateString(q.name);
    auto shape = b.CreateVector(q.shape);
    auto data = b.CreateString(q.data);
    auto scale = q.scale_inv.empty() ? 0 : b.CreateString(q.scale_inv);
    auto amax = q.amax.empty() ? 0 : b.CreateString(q.amax);
    auto row = fb::CreateQuantizedComponent(b, data, scale,
                                            static_cast<fb::ScaleLayout>(q.scale_layout), amax);
    quantized.push_back(fb::CreateQuantizedTensor(
        b, name, static_cast<fb::DType>(q.quantized_dtype), static_cast<fb::DType>(q.logical_dtype),
        shape, static_cast<fb::ScalingMode>(q.scaling_mode), row, 0));
  }
  auto qvec = b.CreateVector(quantized);
  std::vector<flatbuffers::Offset<fb::ScalingState>> scaling;
  for (const ScalingSpec& s : spec.scaling) {
    std::vector<flatbuffers::Offset<fb::DirectionState>> dirs;
    for (const DirSpec& d : s.dirs) {
      auto roles =
          b.CreateVector(reinterpret_cast<const fb::SlotRole*>(d.roles.data()), d.roles.size());
      auto scale = b.CreateVector(d.scale);
      auto hist = b.CreateVector(d.history);
      dirs.push_back(fb::CreateDirectionState(b, static_cast<fb::Direction>(d.direction), 1, roles,
                                              scale, hist, d.history_len));
    }
    auto dvec = b.CreateVector(dirs);
    auto module = b.CreateString(s.module);
    auto recipe = BuildRecipe(b, s);
    scaling.push_back(
        fb::CreateScalingState(b, module, static_cast<fb::Recipe>(s.recipe_type), recipe, dvec));
  }
  auto svec = b.CreateVector(scaling);
  std::vector<flatbuffers::Offset<fb::KeyValue>> metadata;
  for (const auto& [k, v] : spec.metadata) {
    auto ko = b.CreateString(k);
    auto vo = b.CreateString(v);
    metadata.push_back(fb::CreateKeyValue(b, ko, vo));
  }
  auto mvec = b.CreateVector(metadata);
  auto producer = b.CreateString("corruption_test");
  auto order = spec.data_order ? b.CreateVector(*spec.data_order) : 0;
  auto root = fb::CreateCheckpoint(b, spec.format_version, producer,
                                   static_cast<fb::ChecksumAlgo>(spec.checksum_algo), tvec, qvec,
                                   svec, mvec, order);
  fb::FinishCheckpointBuffer(b, root);
  return std::vector<uint8_t>(b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize());
}

// Magic, zeros up to 4096, the data section, zeros up to 8-byte alignment, footer, trailer.
std::vector<uint8_t> AssembleFile(const std::vector<uint8_t>& data,
                                  const std::vector<uint8_t>& footer) {
  uint64_t footer_offset = (format::kFirstDataOffset + data.size() + 7) / 8 * 8;
  std::vector<uint8_t> file(footer_offset + footer.size() + format::kTrailerSize, 0);
  std::memcpy(file.data(), format::kMagic, format::kMagicSize);
  if (!data.empty()) std::memcpy(file.data() + format::kFirstDataOffset, data.data(), data.size());
  if (!footer.empty()) std::memcpy(file.data() + footer_offset, footer.data(), footer.size());
  uint8_t* trailer = file.data() + footer_offset + footer.size();
  PutU64(trailer, footer.size());
  PutU64(trailer + 8, Checksum64(footer.data(), footer.size()));
  std::memcpy(trailer + 16, format::kMagic, format::kMagicSize);
  return file;
}

std::vector<uint8_t> Assemble(const FileSpec& spec) {
  return AssembleFile(spec.data, BuildFooter(spec));
}

std::vector<uint8_t> Smooth(size_t n) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(i / 256);
  return out;
}

void PadData(std::vector<uint8_t>& data, uint64_t alignment) {
  data.resize((data.size() + alignment - 1) / alignment * alignment, 0);
}

// A valid file that every hostile case starts from:
//   a  U8[4096]       raw at 4096
//   b  F32[16]        raw at 8192
//   c  U8[6000]       zstd at 8256: a compressed 4096-byte block and a stored 1904-byte one
//   d  F16[0, 4]      empty
//   quantized q -> a (data), b (scale_inv); scaling state s (DelayedScaling, 2 slots, L = 2)
FileSpec BaselineSpec() {
  FileSpec spec;
  auto a = RandomBytes(4096, 1);
  auto bb = RandomBytes(64, 2);
  auto c = Smooth(6000);
  for (size_t i = 4096; i < 6000; ++i) c[i] = static_cast<uint8_t>(i * 131 + (i >> 3));

  spec.data = a;
  spec.data.insert(spec.data.end(), bb.begin(), bb.end());
  std::vector<uint8_t> frame(CompressBound(4096));
  size_t csize = *ZstdCompress(c.data(), 4096, frame.data(), frame.size(), 3);
  frame.resize(csize);
  uint64_t c_offset = 4096 + spec.data.size();
  spec.data.insert(spec.data.end(), frame.begin(), frame.end());
  spec.data.insert(spec.data.end(), c.begin() + 4096, c.end());
  PadData(spec.data, 64);

  TensorSpec ta{"a", static_cast<uint8_t>(DType::kU8), std::vector<int64_t>{4096}, 4096, 4096,
                4096};
  ta.checksums = std::vector<uint64_t>{Checksum64(a.data(), 4096)};
  TensorSpec tb{"b", static_cast<uint8_t>(DType::kF32), std::vector<int64_t>{16}, 8192, 64, 64};
  tb.checksums = std::vector<uint64_t>{Checksum64(bb.data(), 64)};
  TensorSpec tc{
      "c", static_cast<uint8_t>(DType::kU8), std::vector<int64_t>{6000}, c_offset, csize + 1904,
      6000};
  tc.encoding = static_cast<uint8_t>(fb::Encoding::ZSTD);
  tc.checksums =
      std::vector<uint64_t>{Checksum64(c.data(), 4096), Checksum64(c.data() + 4096, 1904)};
  tc.chunks = std::vector<fb::Chunk>{fb::Chunk(0, csize, fb::ChunkCodec::ZSTD),
                                     fb::Chunk(csize, 1904, fb::ChunkCodec::STORED)};
  TensorSpec td{"d", static_cast<uint8_t>(DType::kF16), std::vector<int64_t>{0, 4}, 0, 0, 0};
  td.block_size = 0;
  spec.tensors = {ta, tb, tc, td};

  spec.quantized.push_back(QuantSpec{"q",
                                     static_cast<uint8_t>(DType::kU8),
                                     static_cast<uint8_t>(DType::kBF16),
                                     0,
                                     {64, 64},
                                     "a",
                                     "b"});
  ScalingSpec s;
  s.module = "s";
  s.dirs.push_back(DirSpec{0, {0, 1}, {1.f, 2.f}, {3.f, 4.f, 5.f, 6.f}, 2});
  spec.scaling.push_back(s);
  spec.metadata = {{"k", "v"}};
  return spec;
}

std::vector<uint8_t> ExpectedC() {
  auto c = Smooth(6000);
  for (size_t i = 4096; i < 6000; ++i) c[i] = static_cast<uint8_t>(i * 131 + (i >> 3));
  return c;
}

class CorruptionTest : public ::testing::Test {
 protected:
  TempDir dir_;  // declared first: path_ is initialized from it
  std::string path_ = dir_.File("hostile.ferry");

  Result<std::shared_ptr<Reader>> OpenBytes(const std::vector<uint8_t>& bytes) {
    WriteFileBytes(path_, bytes);
    return Reader::Open(path_);
  }

  // The file must be rejected at open with `code` and a message holding `path` and `what`.
  void ExpectRejected(const std::vector<uint8_t>& bytes, const std::string& what,
                      StatusCode code = StatusCode::kDataLoss) {
    auto r = OpenBytes(bytes);
    ASSERT_FALSE(r.ok()) << "accepted a file that should fail with: " << what;
    EXPECT_EQ(r.status().code(), code) << r.status().ToString();
    EXPECT_NE(r.status().message().find(path_), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(what), std::string::npos)
        << "want '" << what << "' in: " << r.status().message();
  }

  void ExpectRejected(const FileSpec& spec, const std::string& what,
                      StatusCode code = StatusCode::kDataLoss) {
    ExpectRejected(Assemble(spec), what, code);
  }
};

TEST_F(CorruptionTest, BaselineIsValid) {
  FileSpec spec = BaselineSpec();
  auto r = OpenBytes(Assemble(spec));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->names(), (std::vector<std::string>{"a", "b", "c", "d"}));
  EXPECT_TRUE((*r)->VerifyAll().ok());
  std::vector<uint8_t> out(6000);
  ASSERT_TRUE((*r)->ReadInto("c", out.data(), out.size(), {true}).ok());
  EXPECT_EQ(out, ExpectedC());
  EXPECT_EQ((*r)->quantized().size(), 1u);
  EXPECT_EQ((*r)->scaling_states().size(), 1u);
  EXPECT_EQ((*r)->metadata("k"), std::optional<std::string>("v"));
}

TEST_F(CorruptionTest, LayoutOutOfNameOrderIsValid) {
  // Extents need not follow name order; only overlaps are errors.
  FileSpec spec = BaselineSpec();
  spec.tensor("a").data_offset = 4096 + 64;  // a after b: [4096, 4160) b, [4160, 8256) a
  spec.tensor("b").data_offset = 4096;
  std::vector<uint8_t> a(spec.data.begin(), spec.data.begin() + 4096);
  std::vector<uint8_t> b(spec.data.begin() + 4096, spec.data.begin() + 4160);
  std::copy(b.begin(), b.end(), spec.data.begin());
  std::copy(a.begin(), a.end(), spec.data.begin() + 64);
  auto r = OpenBytes(Assemble(spec));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE((*r)->VerifyAll().ok());
}

// ---- hostile extents -----------------------------------------------------------------

TEST_F(CorruptionTest, DataPastEndOfFile) {
  FileSpec spec = BaselineSpec();
  uint64_t data_end = 4096 + spec.data.size();
  spec.tensor("a").data_offset = data_end - 2048;
  ExpectRejected(spec, "tensor #0 'a': data extent at offset " + std::to_string(data_end - 2048) +
                           " size 4096 runs past the data section end " + std::to_string(data_end));
  // Starting exactly at the footer.
  spec = BaselineSpec();
  spec.tensor("b").data_offset = data_end;
  ExpectRejected(spec, "runs past the data section end");
  // Far beyond the file.
  spec = BaselineSpec();
  spec.tensor("a").data_offset = uint64_t{1} << 40;
  ExpectRejected(spec, "runs past the data section end");
}

TEST_F(CorruptionTest, ExtentSumOverflows) {
  FileSpec spec = BaselineSpec();
  spec.tensor("a").data_offset = ~uint64_t{0} - 63;  // 64-aligned, + 4096 wraps
  ExpectRejected(spec, "tensor #0 'a': data extent at offset 18446744073709551552 size 4096");
  spec = BaselineSpec();
  auto& c = spec.tensor("c");
  (*c.chunks)[1] = fb::Chunk(~uint64_t{0} - 10, 1904, fb::ChunkCodec::STORED);
  ExpectRejected(spec, "chunk 1 at relative offset 18446744073709551605");
  spec = BaselineSpec();
  spec.tensor("c").data_size = ~uint64_t{0};
  ExpectRejected(spec, "runs past the data section end");
}

TEST_F(CorruptionTest, OverlappingTensors) {
  FileSpec spec = BaselineSpec();
  spec.tensor("b").data_offset = 4096 + 4032;  // the last 64 bytes of a
  ExpectRejected(spec, "tensor data extents overlap at offset 8128");
  spec = BaselineSpec();
  spec.tensor("c").data_offset = 4096;  // on top of a, listed after it
  ExpectRejected(spec, "tensor data extents overlap at offset 4096");
  spec = BaselineSpec();
  spec.tensor("a").data_offset = 0;
  ExpectRejected(spec, "tensor #0 'a': data offset 0 overlaps the magic");
  spec = BaselineSpec();
  spec.tensor("b").data_offset = 8192 + 8;
  ExpectRejected(spec, "tensor #1 'b': data offset 8200 is not 64-byte aligned");
}

// data_order lets a reader check overlaps in one pass; a hostile one must not let overlapping
// or missing extents through. Baseline tensors with data: a (#0), b (#1), c (#2), in file order.
TEST_F(CorruptionTest, HostileDataOrder) {
  FileSpec spec = BaselineSpec();
  spec.data_order = std::vector<uint32_t>{0, 1, 2};
  {
    auto r = OpenBytes(Assemble(spec));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_TRUE((*r)->VerifyAll().ok());
  }
  spec.data_order = std::vector<uint32_t>{0, 2, 1};
  ExpectRejected(spec, "tensor data extents overlap (or data_order is unsorted) at offset 8192");
  spec.data_order = std::vector<uint32_t>{0, 0, 1};
  ExpectRejected(spec, "overlap (or data_order is unsorted) at offset 4096");
  spec.data_order = std::vector<uint32_t>{0, 1};
  ExpectRejected(spec, "data_order has 2 entries for 3 tensors with data");
  spec.data_order = std::vector<uint32_t>{0, 1, 2, 3};
  ExpectRejected(spec, "data_order has 4 entries for 3 tensors with data");
  spec.data_order = std::vector<uint32_t>{0, 1, 7};
  ExpectRejected(spec, "data_order names tensor #7 of 4");
  spec.data_order = std::vector<uint32_t>{0, 1, 0xFFFFFFFFu};
  ExpectRejected(spec, "data_order names tensor #4294967295 of 4");
  spec.data_order = std::vector<uint32_t>{0, 1, 3};
  ExpectRejected(spec, "data_order names tensor #3, which has no data");
  // A correct order does not excuse an overlap.
  spec = BaselineSpec();
  spec.tensor("b").data_offset = 4096 + 4032;
  spec.data_order = std::vector<uint32_t>{0, 1, 2};
  ExpectRejected(spec, "overlap (or data_order is unsorted) at offset 8128");
}

TEST_F(CorruptionTest, HostileGlobalSlice) {
  FileSpec spec = BaselineSpec();
  spec.tensor("b").global_shape = std::vector<int64_t>{64};
  spec.tensor("b").shard_offset = std::vector<int64_t>{48};
  {
    auto r = OpenBytes(Assemble(spec));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ((*r)->Find("b")->global_shape, std::vector<int64_t>{64});
    EXPECT_EQ((*r)->Find("b")->shard_offset, std::vector<int64_t>{48});
  }
  spec.tensor("b").shard_offset = std::vector<int64_t>{49};
  ExpectRejected(spec,
                 "tensor #1 'b': slice dim 0 at offset 49 of extent 16 does not fit the global "
                 "extent 64");
  spec.tensor("b").shard_offset = std::vector<int64_t>{-1};
  ExpectRejected(spec, "slice dim 0 at offset -1");
  spec.tensor("b").shard_offset = std::vector<int64_t>{INT64_MAX};
  ExpectRejected(spec, "does not fit the global extent");
  spec.tensor("b").global_shape = std::vector<int64_t>{8};  // smaller than the slice itself
  spec.tensor("b").shard_offset = std::vector<int64_t>{0};
  ExpectRejected(spec, "of extent 16 does not fit the global extent 8");
  spec.tensor("b").global_shape = std::vector<int64_t>{-64};
  ExpectRejected(spec, "tensor #1 'b': negative dim 0 (-64)");
  spec.tensor("b").global_shape = std::vector<int64_t>{64, 1};
  ExpectRejected(spec, "1 dims, but global_shape has 2 and shard_offset 1");
  spec.tensor("b").global_shape.reset();
  ExpectRejected(spec, "tensor #1 'b': has shard_offset without global_shape");
  spec.tensor("b").global_shape = std::vector<int64_t>{64};
  spec.tensor("b").shard_offset.reset();
  ExpectRejected(spec, "has global_shape without shard_offset");
}

// Enough tensors that the index is validated in parallel slices: a name out of order exactly
// where one slice ends and the next begins is caught as well as one inside a slice.
TEST_F(CorruptionTest, UnsortedNamesAcrossValidationSlices) {
  FileSpec base = BaselineSpec();
  base.data_order.reset();
  TensorSpec empty{"", static_cast<uint8_t>(DType::kF16), std::vector<int64_t>{0}, 0, 0, 0};
  empty.block_size = 0;
  const size_t n = 40000;
  char name[32];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(name, sizeof(name), "e%06zu", i);  // after "a".."d"
    empty.name = name;
    base.tensors.push_back(empty);
  }
  ASSERT_TRUE(OpenBytes(Assemble(base)).ok());
  // 40,004 tensors make two slices (one per 16,384 tensors, as many as there are cores):
  // the boundary, and an index inside a slice.
  const size_t total = base.tensors.size();
  for (size_t i : {total / 2, size_t{12345}}) {
    FileSpec spec = base;
    spec.tensors[i].name = spec.tensors[i - 1].name;
    ExpectRejected(
        spec, "tensor #" + std::to_string(i) + " '" + spec.tensors[i].name + "' is a duplicate");
    spec = base;
    std::swap(spec.tensors[i].name, spec.tensors[i - 1].name);
    ExpectRejected(spec, "tensor #" + std::to_string(i) + " '" + spec.tensors[i].name +
                             "' is out of sorted order");
  }
}

TEST_F(CorruptionTest, UnsortedOrDuplicateNames) {
  FileSpec spec = BaselineSpec();
  std::swap(spec.tensors[0], spec.tensors[1]);
  ExpectRejected(spec, "tensor #1 'a' is out of sorted order");
  spec = BaselineSpec();
  spec.tensor("b").name = "a";
  ExpectRejected(spec, "tensor #1 'a' is a duplicate");
  spec = BaselineSpec();
  spec.tensor("a").name = "";
  ExpectRejected(spec, "tensor #0 has an empty name");
  spec = BaselineSpec();
  spec.tensor("a").name = std::string("\0a", 2);
  ExpectRejected(spec, "tensor #0 name contains a NUL byte");
  spec = BaselineSpec();
  spec.tensor("a").name = std::string(format::kMaxNameBytes + 1, 'a');
  ExpectRejected(spec, "tensor #0 name is 65537 bytes (limit 65536)");
  // Control bytes in a hostile name are escaped in the message.
  spec = BaselineSpec();
  spec.tensor("b").nbytes = 1;
  spec.tensor("b").name = "b\n";
  ExpectRejected(spec, "tensor #1 'b\\x0a': nbytes 1");

  spec = BaselineSpec();
  spec.metadata = {{"z", "1"}, {"a", "2"}};
  ExpectRejected(spec, "metadata key #1 'a' is out of sorted order");
  spec = BaselineSpec();
  spec.metadata = {{"k", "1"}, {"k", "2"}};
  ExpectRejected(spec, "metadata key #1 'k' is a duplicate");
  spec = BaselineSpec();
  spec.quantized.push_back(spec.quantized[0]);
  ExpectRejected(spec, "quantized tensor #1 'q' is a duplicate");
  spec = BaselineSpec();
  spec.scaling.push_back(spec.scaling[0]);
  spec.scaling[0].module = "t";
  ExpectRejected(spec, "scaling state #1 's' is out of sorted order");
}

TEST_F(CorruptionTest, SizeDoesNotMatchShape) {
  FileSpec spec = BaselineSpec();
  spec.tensor("b").nbytes = 60;
  ExpectRejected(spec, "tensor #1 'b': nbytes 60 but shape and dtype give 64");
  spec = BaselineSpec();
  spec.tensor("b").dtype = static_cast<uint8_t>(DType::kF64);  // 16 x 8 = 128 bytes
  ExpectRejected(spec, "nbytes 64 but shape and dtype give 128");
  spec = BaselineSpec();
  // 127 packed FP4 elements take 64 bytes; 128 take 64 too, 129 take 65.
  spec.tensor("b").dtype = static_cast<uint8_t>(DType::kF4_E2M1FN);
  spec.tensor("b").shape = std::vector<int64_t>{127};
  EXPECT_TRUE(OpenBytes(Assemble(spec)).ok());
  spec.tensor("b").shape = std::vector<int64_t>{129};
  ExpectRejected(spec, "nbytes 64 but shape and dtype give 65");
  spec = BaselineSpec();
  spec.tensor("b").shape.reset();  // absent shape: a scalar, 4 bytes of F32
  ExpectRejected(spec, "nbytes 64 but shape and dtype give 4");
  spec = BaselineSpec();
  spec.tensor("a").data_size = 4032;
  ExpectRejected(spec, "tensor #0 'a': raw data size 4032 != nbytes 4096");
}

TEST_F(CorruptionTest, BadDims) {
  FileSpec spec = BaselineSpec();
  spec.tensor("b").shape = std::vector<int64_t>{-16};
  ExpectRejected(spec, "tensor #1 'b': negative dim 0 (-16)");
  spec.tensor("b").shape = std::vector<int64_t>{-4, -4};
  ExpectRejected(spec, "negative dim 0 (-4)");
  spec.tensor("b").shape = std::vector<int64_t>{4, INT64_MIN};
  ExpectRejected(spec, "negative dim 1");
  spec.tensor("b").shape = std::vector<int64_t>(65, 1);
  ExpectRejected(spec, "tensor #1 'b': 65 dims (limit 64)");
  spec.tensor("b").shape = std::vector<int64_t>(200000, 1);
  ExpectRejected(spec, "200000 dims (limit 64)");
  spec.tensor("b").shape = std::vector<int64_t>{int64_t{1} << 40, int64_t{1} << 40};
  ExpectRejected(spec, "element count overflows 64 bits");
  spec.tensor("b").shape = std::vector<int64_t>{int64_t{1} << 62};
  ExpectRejected(spec, "byte size overflows 64 bits");  // x4 bytes of F32
  spec.tensor("b").shape = std::vector<int64_t>{INT64_MAX, 0, INT64_MAX};
  ExpectRejected(spec, "nbytes 64 but shape and dtype give 0");
}

TEST_F(CorruptionTest, BadChunkTables) {
  FileSpec spec = BaselineSpec();
  (*spec.tensor("c").chunks)[1] =
      fb::Chunk((*spec.tensor("c").chunks)[1].offset(), 1904 + 64, fb::ChunkCodec::STORED);
  ExpectRejected(spec, "tensor #2 'c': chunk 1 at relative offset");
  ExpectRejected(spec, "runs past the tensor's");
  spec = BaselineSpec();
  (*spec.tensor("c").chunks)[1] = fb::Chunk(0, 1904, fb::ChunkCodec::STORED);
  ExpectRejected(spec, "overlaps its predecessor");
  spec = BaselineSpec();
  spec.tensor("c").chunks->pop_back();
  ExpectRejected(spec, "tensor #2 'c': 1 chunks for 2 blocks");
  spec = BaselineSpec();
  spec.tensor("c").chunks.reset();
  ExpectRejected(spec, "tensor #2 'c': 0 chunks for 2 blocks");
  spec = BaselineSpec();
  spec.tensor("a").chunks = std::vector<fb::Chunk>{fb::Chunk(0, 4096, fb::ChunkCodec::STORED)};
  ExpectRejected(spec, "tensor #0 'a': raw tensor with a chunk table");
  spec = BaselineSpec();
  auto& chunks = *spec.tensor("c").chunks;
  chunks[1] = fb::Chunk(chunks[1].offset(), 1900, fb::ChunkCodec::STORED);
  ExpectRejected(spec, "stored chunk 1 holds 1900 bytes for a 1904-byte block");
  spec = BaselineSpec();
  (*spec.tensor("c").chunks)[0] = fb::Chunk(0, 0, fb::ChunkCodec::ZSTD);
  ExpectRejected(spec, "zstd chunk 0 size 0 impossible for a 4096-byte block");
  spec = BaselineSpec();
  (*spec.tensor("c").chunks)[1] =
      fb::Chunk((*spec.tensor("c").chunks)[1].offset(), 1904, static_cast<fb::ChunkCodec>(7));
  ExpectRejected(spec, "chunk 1 has unknown codec 7");
  spec = BaselineSpec();
  spec.tensor("c").block_size = 0;
  ExpectRejected(spec, "tensor #2 'c': block size 0 outside [4096, 1073741824]");
  spec = BaselineSpec();
  spec.tensor("a").block_size = uint64_t{1} << 31;
  ExpectRejected(spec, "block size 2147483648 outside");
}

TEST_F(CorruptionTest, MisalignedVectors) {
  FileSpec spec = BaselineSpec();
  spec.tensor("b").misalign_shape = true;
  auto bytes = Assemble(spec);
  // The crafted footer really is misaligned where it matters and passes the verifier.
  {
    FooterSpan f = FooterOf(bytes);
    std::vector<uint64_t> aligned((f.size + 7) / 8);
    std::memcpy(aligned.data(), bytes.data() + f.offset, f.size);
    const auto* p = reinterpret_cast<const uint8_t*>(aligned.data());
    flatbuffers::Verifier verifier(p, f.size);
    ASSERT_TRUE(fb::VerifyCheckpointBuffer(verifier));
    const fb::Tensor* b = fb::GetCheckpoint(p)->tensors()->Get(1);
    ASSERT_EQ(reinterpret_cast<uintptr_t>(b->shape()->Data()) % 8, 4u);
  }
  ExpectRejected(bytes, "tensor #1 'b': misaligned shape");
  spec = BaselineSpec();
  spec.tensor("c").misalign_checksums = true;
  ExpectRejected(spec, "tensor #2 'c': misaligned checksum or chunk table");
}

TEST_F(CorruptionTest, UnknownEnums) {
  FileSpec spec = BaselineSpec();
  spec.tensor("b").dtype = kNumDTypes;
  ExpectRejected(spec, "tensor #1 'b': unknown dtype 23");
  spec.tensor("b").dtype = 255;
  ExpectRejected(spec, "unknown dtype 255");
  spec = BaselineSpec();
  spec.tensor("c").encoding = 4;
  ExpectRejected(spec, "tensor #2 'c': unknown encoding 4");
  spec = BaselineSpec();
  spec.tensor("c").encoding = 3;  // PLANES holds only PLANES and STORED chunks
  ExpectRejected(spec, "tensor #2 'c': chunk 0 (codec 1, 55 bytes) impossible in a planes tensor");
  spec = BaselineSpec();
  spec.checksum_algo = 1;
  ExpectRejected(spec, "unknown checksum algorithm 1");
  spec = BaselineSpec();
  spec.format_version = 2;
  ExpectRejected(spec, "format version 2 (this build reads version 1)", StatusCode::kUnimplemented);
  spec = BaselineSpec();
  spec.quantized[0].quantized_dtype = 99;
  ExpectRejected(spec, "quantized tensor 'q': unknown dtype");
  spec = BaselineSpec();
  spec.quantized[0].scaling_mode = 5;
  ExpectRejected(spec, "quantized tensor 'q': bad scaling mode");
  spec = BaselineSpec();
  spec.quantized[0].scale_layout = 2;
  ExpectRejected(spec, "quantized tensor 'q': bad layout");
  spec = BaselineSpec();
  spec.scaling[0].recipe_type = 9;
  ExpectRejected(spec, "scaling state 's': unknown recipe type 9");
  spec = BaselineSpec();
  spec.scaling[0].recipe_table = false;
  ExpectRejected(spec, "scaling state 's': missing recipe table");
  spec = BaselineSpec();
  spec.scaling[0].fp8_format = 3;
  ExpectRejected(spec, "DelayedScaling has an unknown enum value");
  for (auto type : {fb::Recipe::Float8CurrentScaling, fb::Recipe::MXFP8BlockScaling,
                    fb::Recipe::Float8BlockScaling}) {
    spec.scaling[0].recipe_type = static_cast<uint8_t>(type);
    ExpectRejected(spec, std::string("bad ") + fb::EnumNameRecipe(type));
  }
  spec = BaselineSpec();
  spec.scaling[0].dirs[0].direction = 2;
  ExpectRejected(spec, "scaling state 's' direction #0: bad direction");
  spec = BaselineSpec();
  spec.scaling[0].dirs[0].roles[1] = 5;
  ExpectRejected(spec, "unknown slot role");
}

TEST_F(CorruptionTest, MissingChecksums) {
  FileSpec spec = BaselineSpec();
  spec.tensor("a").checksums.reset();
  ExpectRejected(spec, "tensor #0 'a': 0 checksums for 1 blocks");
  spec = BaselineSpec();
  spec.tensor("c").checksums->pop_back();
  ExpectRejected(spec, "tensor #2 'c': 1 checksums for 2 blocks");
  spec = BaselineSpec();
  spec.tensor("b").checksums->push_back(0);
  ExpectRejected(spec, "tensor #1 'b': 2 checksums for 1 blocks");
  spec = BaselineSpec();
  spec.tensor("d").checksums = std::vector<uint64_t>{0};
  ExpectRejected(spec, "tensor #3 'd': 1 checksums for 0 blocks");
}

TEST_F(CorruptionTest, QuantizedReferencesMissingTensor) {
  FileSpec spec = BaselineSpec();
  spec.quantized[0].scale_inv = "nope";
  ExpectRejected(spec, "quantized tensor 'q': component tensor 'nope' is missing");
  spec = BaselineSpec();
  spec.quantized[0].data = "";
  ExpectRejected(spec, "component tensor '' is missing");
  spec = BaselineSpec();
  spec.quantized[0].amax = "a ";
  ExpectRejected(spec, "component tensor 'a ' is missing");
  spec = BaselineSpec();
  spec.quantized[0].shape = {64, -1};
  ExpectRejected(spec, "quantized tensor 'q': negative dim 1 (-1)");
}

TEST_F(CorruptionTest, ScalingStateWithWrongSizes) {
  FileSpec spec = BaselineSpec();
  spec.scaling[0].dirs[0].history.pop_back();
  ExpectRejected(spec,
                 "scaling state 's' direction #0: amax_history has 3 entries, expected 2 x 2");
  spec = BaselineSpec();
  spec.scaling[0].dirs[0].history_len = 3;
  ExpectRejected(spec, "amax_history has 4 entries, expected 3 x 2");
  spec = BaselineSpec();
  spec.scaling[0].dirs[0].scale.push_back(1.f);
  ExpectRejected(spec, "scaling state 's' direction #0: 3 scales for 2 slots");
  spec = BaselineSpec();
  spec.scaling[0].dirs[0].history_len = -1;
  ExpectRejected(spec, "negative history length");
  spec = BaselineSpec();
  spec.scaling[0].dirs[0].history_len = INT32_MAX;
  ExpectRejected(spec, "expected 2147483647 x 2");
}

// A zstd chunk whose frame holds more (or less) than its block: the block's raw size caps
// the output, so a verified or unverified read fails with DataLoss and writes nothing past
// the tensor's bytes.
TEST_F(CorruptionTest, ZstdChunkDecodesToWrongSize) {
  struct Case {
    const char* label;
    std::vector<uint8_t> frame;
    std::string what;
  };
  auto compress = [](const std::vector<uint8_t>& raw) {
    std::vector<uint8_t> out(CompressBound(raw.size()));
    out.resize(*ZstdCompress(raw.data(), raw.size(), out.data(), out.size(), 3));
    return out;
  };
  std::vector<uint8_t> big(8192, 'A');  // decodes past the 4096-byte block
  std::vector<uint8_t> small(2048, 'B');
  std::vector<uint8_t> exact = Smooth(4096);
  auto twice = compress(exact);
  auto once = twice;
  twice.insert(twice.end(), once.begin(), once.end());  // two frames back to back
  std::vector<Case> cases = {
      {"larger", compress(big), "tensor 'z': chunk 0 at file offset 4096: corrupt zstd frame"},
      {"smaller", compress(small), "zstd frame decoded to 2048 bytes, expected 4096"},
      {"two frames", twice, "tensor 'z': chunk 0 at file offset 4096"},
      {"garbage", RandomBytes(100, 5), "corrupt zstd frame"},
  };
  for (uint8_t encoding : {uint8_t{1}, uint8_t{2}}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(c.label) + (encoding == 2 ? " shuffled" : ""));
      ASSERT_LE(c.frame.size(), CompressBound(4096));
      FileSpec spec;
      spec.data = c.frame;
      PadData(spec.data, 64);
      TensorSpec t{
          "z", static_cast<uint8_t>(DType::kF32), std::vector<int64_t>{1024}, 4096, c.frame.size(),
          4096};
      t.encoding = encoding;
      t.checksums = std::vector<uint64_t>{Checksum64(exact.data(), 4096)};
      t.chunks = std::vector<fb::Chunk>{fb::Chunk(0, c.frame.size(), fb::ChunkCodec::ZSTD)};
      spec.tensors = {t};
      auto r = OpenBytes(Assemble(spec));
      ASSERT_TRUE(r.ok()) << r.status().ToString();  // the index itself is consistent
      for (bool verify : {false, true}) {
        std::vector<uint8_t> dst(4096 + 4096, 0xCD);
        Status st = (*r)->ReadInto("z", dst.data(), dst.size(), {verify});
        EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
        EXPECT_NE(st.message().find(path_), std::string::npos) << st.message();
        EXPECT_NE(st.message().find(c.what), std::string::npos) << st.message();
        for (size_t i = 4096; i < dst.size(); ++i) {
          ASSERT_EQ(dst[i], 0xCD) << "wrote past the tensor at " << i;
        }
      }
      EXPECT_EQ((*r)->Verify("z").code(), StatusCode::kDataLoss);
      std::vector<uint8_t> rows(4 * 100);
      EXPECT_EQ((*r)->ReadRowsInto("z", 0, 100, rows.data(), rows.size()).code(),
                StatusCode::kDataLoss);
    }
  }
}

// A footer of several MiB is read in slices on parallel threads and hashed while its tables
// are checked: the table it yields is the whole footer's, and a damaged footer is reported as
// a checksum mismatch even where its structure is broken too.
TEST_F(CorruptionTest, LargeFootersReadInSlicesAndCheckedWhole) {
  FileSpec spec;
  spec.data.assign(64, 0);
  const int count = 30000;
  for (int i = 0; i < count; ++i) {
    char name[40];
    std::snprintf(name, sizeof(name), "%06d.", i);
    TensorSpec t{name + std::string(120, 'w'),
                 static_cast<uint8_t>(DType::kF16),
                 std::vector<int64_t>{0, 4},
                 0,
                 0,
                 0};
    t.block_size = 0;
    spec.tensors.push_back(t);
  }
  auto good = Assemble(spec);
  FooterSpan f = FooterOf(good);
  ASSERT_GT(f.size, uint64_t{4} << 20);  // read in slices, hashed beside the parse
  auto r = OpenBytes(good);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ((*r)->num_tensors(), static_cast<size_t>(count));
  EXPECT_EQ((*r)->tensor(count - 1).name, spec.tensors.back().name);
  EXPECT_TRUE((*r)->Find(spec.tensors[count / 2].name).ok());
  const std::string mismatch =
      "footer checksum mismatch (footer at offset " + std::to_string(f.offset);
  // A name's byte in the last slice: well formed, but not the footer that was written.
  auto bytes = good;
  bytes[f.offset + f.size - 64] ^= 1;
  ExpectRejected(bytes, mismatch);
  // The root offset: the structure is broken as well.
  bytes = good;
  bytes[f.offset] ^= 0x40;
  ExpectRejected(bytes, mismatch);
}

// ---- the trailer --------------------------------------------------------------------

TEST_F(CorruptionTest, BadTrailers) {
  auto good = Assemble(BaselineSpec());
  FooterSpan f = FooterOf(good);

  ExpectRejected(std::vector<uint8_t>{}, "file is 0 bytes, too short");
  ExpectRejected(std::vector<uint8_t>(good.begin(), good.begin() + 31), "file is 31 bytes");
  auto bytes = good;
  bytes[0] = 'X';
  ExpectRejected(bytes, "not a TensorFerry checkpoint (bad magic at offset 0)");
  bytes = good;
  bytes[bytes.size() - 1] ^= 1;
  ExpectRejected(bytes, "bad trailer magic at offset " + std::to_string(good.size() - 8));
  for (uint64_t len : {uint64_t{0}, good.size() - 24 - 8 + 1, good.size(), uint64_t{1} << 63,
                       ~uint64_t{0}, format::kMaxFooterBytes + 1}) {
    bytes = good;
    PutU64(bytes.data() + bytes.size() - 24, len);
    ExpectRejected(bytes, "footer length " + std::to_string(len) + " (trailer at offset " +
                              std::to_string(good.size() - 24) + ") does not fit the file");
  }
  bytes = good;
  bytes[bytes.size() - 16] ^= 1;
  ExpectRejected(bytes, "footer checksum mismatch (footer at offset " + std::to_string(f.offset) +
                            ", " + std::to_string(f.size) + " bytes)");
  // A footer length that reaches into the data section (right checksum for that window):
  // the window is no FlatBuffer, or one whose extents now end before the data they claim.
  bytes = good;
  PutU64(bytes.data() + bytes.size() - 24, f.size + 8);
  RecomputeFooterChecksum(bytes);
  ExpectRejected(bytes, "corrupt footer");
  // A footer that does not start on an 8-byte boundary.
  auto footer = BuildFooter(BaselineSpec());
  auto data = BaselineSpec().data;
  bytes = AssembleFile(data, footer);
  bytes.insert(bytes.begin() + static_cast<ptrdiff_t>(bytes.size() - 24 - footer.size()), 4, 0);
  ExpectRejected(bytes, "footer offset " + std::to_string(f.offset + 4) + " is not 8-byte aligned");
  // A valid FlatBuffer without the file identifier.
  bytes = good;
  std::memcpy(bytes.data() + f.offset + 4, "XXXX", 4);
  RecomputeFooterChecksum(bytes);
  ExpectRejected(bytes, "missing identifier TFRY");
  // A footer of random bytes with the identifier in place.
  bytes = good;
  auto noise = RandomBytes(f.size, 77);
  std::memcpy(noise.data() + 4, "TFRY", 4);
  std::memcpy(bytes.data() + f.offset, noise.data(), noise.size());
  RecomputeFooterChecksum(bytes);
  ExpectRejected(bytes, "FlatBuffers verification failed");
}

TEST_F(CorruptionTest, NotAFile) {
  auto missing = Reader::Open(dir_.File("missing.ferry"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(dir_.File("missing.ferry")), std::string::npos);
  auto directory = Reader::Open(dir_.path());
  EXPECT_FALSE(directory.ok());
  EXPECT_NE(directory.status().message().find(dir_.path()), std::string::npos);
}

// ParseFooter is the fuzzers' entry point: it must stand on its own, without the trailer.
TEST(ParseFooterTest, RejectsGarbageInMemory) {
  auto footer = BuildFooter(BaselineSpec());
  uint64_t data_end = 4096 + BaselineSpec().data.size();
  std::vector<uint64_t> aligned((footer.size() + 7) / 8 + 1);
  auto* p = reinterpret_cast<uint8_t*>(aligned.data());
  std::memcpy(p, footer.data(), footer.size());
  auto ok = ParseFooter(p, footer.size(), data_end, "mem");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  // Every extent must end before data_end, so a smaller data_end is a corrupt footer.
  auto early = ParseFooter(p, footer.size(), 4096 + 4095, "mem");
  EXPECT_EQ(early.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(early.status().message().find("mem: corrupt footer (starts at offset 8191)"),
            std::string::npos)
      << early.status().message();
  EXPECT_EQ(ParseFooter(p, 4, data_end, "mem").status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(ParseFooter(p, 0, data_end, "mem").status().code(), StatusCode::kDataLoss);
  auto misaligned = ParseFooter(p + 1, footer.size() - 1, data_end, "mem");
  EXPECT_EQ(misaligned.status().code(), StatusCode::kInternal);
  // Every prefix of the footer is rejected (a table or vector runs past the end), except
  // those that drop only the builder's zero padding after the last string.
  for (size_t n = 0; n + 8 < footer.size(); ++n) {
    auto r = ParseFooter(p, n, data_end, "mem");
    ASSERT_FALSE(r.ok()) << "prefix " << n;
    ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().ToString();
  }
  for (uint64_t seed = 0; seed < 200; ++seed) {
    auto noise = RandomBytes(footer.size(), seed);
    if (seed % 2 == 0) std::memcpy(noise.data() + 4, "TFRY", 4);
    std::memcpy(p, noise.data(), noise.size());
    EXPECT_FALSE(ParseFooter(p, noise.size(), data_end, "mem").ok()) << seed;
  }
}

// ---- systematic damage to a file from the real writer ------------------------------

class DamageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.File("damaged.ferry");
    std::string src = dir_.File("source.ferry");
    WriterOptions o;
    o.durable = false;
    o.block_size = 4096;
    auto w = Writer::Create(src, o);
    ASSERT_TRUE(w.ok());
    auto raw = RandomBytes(3 * 4096 + 100, 1);
    auto smooth = Smooth(2 * 4096 + 50);
    auto fp8 = RandomBytes(64 * 16, 2);
    float scale_inv = 0.5f;
    auto fp4 = RandomBytes(8 * 16 / 2, 3);
    ASSERT_TRUE(w->AddTensor("raw", DType::kF32, {static_cast<int64_t>(raw.size() / 4)}, raw.data(),
                             raw.size())
                    .ok());
    ASSERT_TRUE(
        w->AddTensor("zstd", DType::kU8, {2, 4121}, smooth.data(), smooth.size(), Encoding::kZstd)
            .ok());
    ASSERT_TRUE(w->AddTensor("shuffled", DType::kBF16, {4121, 1}, smooth.data(), smooth.size(),
                             Encoding::kShuffleZstd)
                    .ok());
    ASSERT_TRUE(w->AddTensor("q.data", DType::kF8_E4M3FN, {64, 16}, fp8.data(), fp8.size()).ok());
    ASSERT_TRUE(w->AddTensor("q.scale_inv", DType::kF32, {}, &scale_inv, 4).ok());
    ASSERT_TRUE(w->AddTensor("fp4", DType::kF4_E2M1FN, {8, 16}, fp4.data(), fp4.size()).ok());
    ASSERT_TRUE(w->AddTensor("empty", DType::kF16, {0, 3}, nullptr, 0).ok());
    QuantizedTensor q;
    q.name = "q";
    q.shape = {64, 16};
    q.rowwise = QuantizedComponent{"q.data", "q.scale_inv", ScaleLayout::kRowMajor, ""};
    ASSERT_TRUE(w->AddQuantized(q).ok());
    ScalingState s;
    s.module = "layer";
    s.recipe = DelayedScaling{1, Fp8Format::kE4M3, 2, AmaxComputeAlgo::kMostRecent, false};
    s.states.push_back(DirectionState{Direction::kForward,
                                      1,
                                      {SlotRole::kInput, SlotRole::kWeight},
                                      {1.f, 2.f},
                                      {3.f, 4.f, 5.f, 6.f},
                                      2});
    ASSERT_TRUE(w->AddScalingState(s).ok());
    ScalingState c;
    c.module = "custom";
    c.recipe = CustomRecipe{"pkg.Recipe", "pkg.factory"};
    ASSERT_TRUE(w->AddScalingState(c).ok());
    ASSERT_TRUE(w->SetMetadata("step", "7").ok());
    ASSERT_TRUE(w->Commit().ok());
    good_ = ReadFileBytes(src);
    footer_ = FooterOf(good_);
    ASSERT_GT(footer_.size, 200u);
  }

  // Opens the damaged image; if the reader accepts it, every accessor and every read must
  // return (successfully or with a clean Status).
  void OpenAndExercise(const std::vector<uint8_t>& bytes, size_t* accepted) {
    WriteFileBytes(path_, bytes);
    auto r = Reader::Open(path_);
    if (!r.ok()) {
      EXPECT_NE(r.status().message().find(path_), std::string::npos) << r.status().ToString();
      return;
    }
    ++*accepted;
    const Reader& reader = **r;
    (void)reader.producer();
    (void)reader.metadata();
    (void)reader.metadata("step");
    (void)reader.quantized();
    (void)reader.scaling_states();
    for (size_t i = 0; i < reader.num_tensors(); ++i) {
      TensorInfo t = reader.tensor(i);
      auto found = reader.Find(t.name);
      EXPECT_TRUE(found.ok()) << t.name;  // names are sorted and unique once validated
      // Validated extents bound stored bytes by the file, but an encoded tensor's raw size
      // is bounded only by its chunk count; skip implausible allocations.
      if (t.nbytes > (uint64_t{64} << 20)) continue;
      std::vector<uint8_t> out(t.nbytes + 16, 0xCD);
      Status st = reader.ReadInto(t.name, out.data(), t.nbytes, {true});
      if (!st.ok()) EXPECT_NE(st.message().find(path_), std::string::npos) << st.ToString();
      for (size_t k = t.nbytes; k < out.size(); ++k) ASSERT_EQ(out[k], 0xCD);
      (void)reader.ReadInto(t.name, out.data(), t.nbytes, {false});
      (void)reader.Verify(t.name);
      auto view = reader.View(t.name, {true});
      if (view.ok() && view->nbytes > 0) {
        volatile uint8_t sink = static_cast<const uint8_t*>(view->data)[view->nbytes - 1];
        (void)sink;
      }
      if (!t.shape.empty() && t.shape[0] > 0) {
        (void)reader.ReadRowsInto(t.name, t.shape[0] / 2, t.shape[0], out.data(), t.nbytes, {true});
      }
    }
  }

  TempDir dir_;
  std::string path_;
  std::vector<uint8_t> good_;
  FooterSpan footer_{};
};

TEST_F(DamageTest, TruncatedAtEveryFooterAndTrailerOffset) {
  for (uint64_t n = footer_.offset; n < good_.size(); ++n) {
    WriteFileBytes(path_, good_.data(), n);
    auto r = Reader::Open(path_);
    ASSERT_FALSE(r.ok()) << "truncated to " << n << " bytes was accepted";
    ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().ToString();
    ASSERT_NE(r.status().message().find(path_), std::string::npos) << r.status().message();
  }
  // And a sample of cuts inside the data section and the header.
  for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{8}, uint64_t{31}, uint64_t{32},
                     uint64_t{4096}, uint64_t{4097}, uint64_t{12000}, footer_.offset - 1}) {
    WriteFileBytes(path_, good_.data(), n);
    auto r = Reader::Open(path_);
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().ToString();
  }
}

TEST_F(DamageTest, EveryFlippedFooterOrTrailerByteIsCaught) {
  for (uint64_t k = footer_.offset; k < good_.size(); ++k) {
    auto bytes = good_;
    bytes[k] ^= 0xFF;
    WriteFileBytes(path_, bytes);
    auto r = Reader::Open(path_);
    ASSERT_FALSE(r.ok()) << "flipped byte " << k << " was accepted";
    ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().ToString();
    ASSERT_NE(r.status().message().find(path_), std::string::npos) << r.status().message();
  }
}

TEST_F(DamageTest, FlippedFooterBytesWithValidChecksumNeverCrash) {
  size_t accepted = 0, total = 0;
  for (uint8_t mask : {uint8_t{0x01}, uint8_t{0x80}, uint8_t{0xFF}}) {
    for (uint64_t k = footer_.offset; k < footer_.offset + footer_.size; ++k) {
      auto bytes = good_;
      bytes[k] ^= mask;
      RecomputeFooterChecksum(bytes);
      OpenAndExercise(bytes, &accepted);
      ++total;
      if (HasFatalFailure()) return;
    }
  }
  // Most damage is caught by the verifier or the semantic checks; the rest (a dtype of the
  // same width, a flipped flag, a float in the scaling state) reads back consistently.
  std::cout << accepted << " of " << total << " damaged footers opened\n";
  EXPECT_LT(accepted, total);
}

TEST_F(DamageTest, SetFooterBytesWithValidChecksumNeverCrash) {
  // Values a fuzzer would try: zero, all ones, and small integers that look like offsets.
  size_t accepted = 0;
  for (uint8_t value : {uint8_t{0x00}, uint8_t{0xFF}, uint8_t{0x7F}, uint8_t{0x04}}) {
    for (uint64_t k = footer_.offset; k < footer_.offset + footer_.size; ++k) {
      auto bytes = good_;
      if (bytes[k] == value) continue;
      bytes[k] = value;
      RecomputeFooterChecksum(bytes);
      OpenAndExercise(bytes, &accepted);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(DamageTest, FlippedDataBytesAreCaughtByVerify) {
  // Every 97th byte of the data section: raw blocks fail the checksum, compressed chunks
  // fail either zstd or the checksum. Never a crash, and never silently wrong when verified.
  auto r0 = Reader::Open(dir_.File("source.ferry"));
  ASSERT_TRUE(r0.ok());
  std::vector<std::vector<uint8_t>> expect;
  std::vector<TensorInfo> infos;
  for (size_t i = 0; i < (*r0)->num_tensors(); ++i) {
    infos.push_back((*r0)->tensor(i));
    expect.emplace_back(infos.back().nbytes);
    ASSERT_TRUE((*r0)->ReadInto(infos.back().name, expect.back().data(), infos.back().nbytes).ok());
  }
  for (uint64_t k = 4096; k < footer_.offset; k += 97) {
    auto bytes = good_;
    bytes[k] ^= 0x10;
    WriteFileBytes(path_, bytes);
    auto r = Reader::Open(path_);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    for (size_t i = 0; i < infos.size(); ++i) {
      const TensorInfo& t = infos[i];
      std::vector<uint8_t> out(t.nbytes);
      Status st = (*r)->ReadInto(t.name, out.data(), out.size(), {true});
      bool inside = k >= t.data_offset && k < t.data_offset + t.data_size;
      if (st.ok()) {
        EXPECT_EQ(out, expect[i]) << t.name << " byte " << k;
      } else {
        EXPECT_TRUE(inside) << t.name << " failed for a byte outside it: " << st.ToString();
        EXPECT_EQ(st.code(), StatusCode::kDataLoss);
        EXPECT_NE(st.message().find("tensor '" + t.name + "'"), std::string::npos) << st.message();
      }
    }
  }
}

}  // namespace
}  // namespace ferry
