// The PLANES codec on the CPU: bit-exact round trips, the code builder, and corrupt blocks.
#include "codec/planes.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "base/fp8.hpp"
#include "base/util.hpp"
#include "codec/codec.hpp"
#include "ferry/ferry.hpp"
#include "ferry/loader.hpp"
#include "ferry_generated.h"
#include "format/block_source.hpp"
#include "planes_data.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

using testing::Fp8Weights;
using testing::NormalWeights;
using testing::RandomBytes;
using testing::SprinkleSpecials;

constexpr size_t kUnit = planes::kStreamsPerUnit * planes::kSymbolsPerStream;  // elements

std::vector<uint8_t> EncodeOrDie(const std::vector<uint8_t>& raw, size_t width, double savings) {
  std::vector<uint8_t> out(planes::Bound(raw.size())), scratch(raw.size());
  size_t n = planes::Encode(raw.data(), raw.size(), width, out.data(), scratch.data(), savings);
  out.resize(n);
  return out;
}

Status DecodeInto(const std::vector<uint8_t>& enc, size_t raw_size, std::vector<uint8_t>* out) {
  out->assign(raw_size, 0xA5);
  std::vector<uint8_t> scratch(raw_size);
  return planes::Decode(enc.data(), enc.size(), out->data(), raw_size, scratch.data());
}

TEST(PlanesTest, LengthsAreBoundedPrefixCodes) {
  for (uint64_t seed : {1, 2, 3}) {
    uint64_t freq[256] = {};
    std::mt19937_64 rng(seed);
    // Geometric frequencies: unbounded Huffman codes would reach 40+ bits.
    for (int s = 0; s < 256; ++s) freq[s] = (rng() % 3 == 0) ? 0 : (uint64_t{1} << (s % 48)) + 1;
    uint8_t len[256];
    planes::BuildLengths(freq, planes::kMaxCodeLength, len);
    uint64_t kraft = 0;
    for (int s = 0; s < 256; ++s) {
      EXPECT_EQ(len[s] == 0, freq[s] == 0) << s;
      EXPECT_LE(len[s], planes::kMaxCodeLength);
      if (len[s]) kraft += uint64_t{1} << (planes::kMaxCodeLength - len[s]);
    }
    EXPECT_LE(kraft, uint64_t{1} << planes::kMaxCodeLength);
  }
  uint64_t one[256] = {};
  one[42] = 1000;
  uint8_t len[256];
  planes::BuildLengths(one, planes::kMaxCodeLength, len);
  EXPECT_EQ(len[42], 1);
  EXPECT_EQ(std::count(len, len + 256, 0), 255);
}

TEST(PlanesTest, RoundTripEveryWidthAndEdgeSize) {
  for (size_t width : {1, 2, 4, 8}) {
    const size_t u = kUnit * width;
    for (size_t n : {size_t{0}, size_t{1}, width - 1 + 1, u - width, u - 1, u, u + 1, u + width,
                     3 * u + 5, 4 * u + 3 * width, size_t{4} << 20}) {
      for (int kind = 0; kind < 3; ++kind) {
        std::vector<uint8_t> raw =
            kind == 0 ? NormalWeights(n, width, 0.02f, n + width) : RandomBytes(n, n * 7 + width);
        if (kind == 2) SprinkleSpecials(raw = NormalWeights(n, width, 1.0f, n), width);
        std::vector<uint8_t> enc = EncodeOrDie(raw, width, -1);
        if (n == 0) {
          EXPECT_TRUE(enc.empty());
          continue;
        }
        ASSERT_FALSE(enc.empty()) << width << " " << n;
        ASSERT_LE(enc.size(), planes::Bound(n));
        std::vector<uint8_t> back;
        Status st = DecodeInto(enc, n, &back);
        ASSERT_TRUE(st.ok()) << st.ToString() << " width " << width << " n " << n;
        ASSERT_TRUE(back == raw) << "width " << width << " n " << n << " kind " << kind;
      }
    }
  }
}

TEST(PlanesTest, Bf16WeightsCodeTheExponentPlaneOnly) {
  const size_t n = size_t{4} << 20;
  std::vector<uint8_t> raw = NormalWeights(n, 2, 0.02f, 7);
  std::vector<uint8_t> enc = EncodeOrDie(raw, 2, 0.0);
  ASSERT_FALSE(enc.empty());
  planes::Layout l;
  ASSERT_TRUE(planes::Parse(enc.data(), enc.size(), n, &l).ok());
  EXPECT_EQ(l.plane[0].mode, planes::kPlaneRaw);
  EXPECT_EQ(l.plane[1].mode, planes::kPlaneHuffman);
  EXPECT_EQ(l.coded_planes, 1u);
  // Sign + exponent of N(0, 0.02) carry about 3.3 bits: the block shrinks below 0.72.
  EXPECT_LT(static_cast<double>(enc.size()) / n, 0.72);
  std::vector<uint8_t> back;
  ASSERT_TRUE(DecodeInto(enc, n, &back).ok());
  EXPECT_TRUE(back == raw);
}

TEST(PlanesTest, IncompressibleBlocksAreNotEncoded) {
  std::vector<uint8_t> raw = RandomBytes(1 << 20, 3);
  EXPECT_TRUE(EncodeOrDie(raw, 2, 0.02).empty());
  EXPECT_TRUE(EncodeOrDie(raw, 1, 0.02).empty());
  // Tiny blocks never pay for the header.
  std::vector<uint8_t> tiny = NormalWeights(64, 2, 0.02f, 1);
  EXPECT_TRUE(EncodeOrDie(tiny, 2, 0.0).empty());
}

// Writers reuse their output buffers: what a buffer held before must not reach the block.
TEST(PlanesTest, EncodingDoesNotDependOnTheOutputBuffersOldBytes) {
  for (size_t width : {2, 4, 8}) {
    std::vector<uint8_t> raw = NormalWeights(kUnit * width * 2 + 3 * width + 1, width, 0.02f, 9);
    std::vector<uint8_t> scratch(raw.size());
    std::vector<uint8_t> zeros(planes::Bound(raw.size()), 0), junk(zeros.size(), 0xEE);
    size_t a = planes::Encode(raw.data(), raw.size(), width, zeros.data(), scratch.data(), -1);
    size_t b = planes::Encode(raw.data(), raw.size(), width, junk.data(), scratch.data(), -1);
    ASSERT_GT(a, 0u);
    ASSERT_EQ(a, b);
    EXPECT_EQ(std::memcmp(zeros.data(), junk.data(), a), 0) << "width " << width;
  }
}

TEST(PlanesTest, ConstantPlaneUsesOneBitCodes) {
  std::vector<uint8_t> raw(kUnit * 2 * 3, 0);
  for (size_t i = 0; i < raw.size(); i += 2) raw[i] = static_cast<uint8_t>(i * 13);
  std::vector<uint8_t> enc = EncodeOrDie(raw, 2, 0.0);
  ASSERT_FALSE(enc.empty());
  std::vector<uint8_t> back;
  ASSERT_TRUE(DecodeInto(enc, raw.size(), &back).ok());
  EXPECT_TRUE(back == raw);
}

TEST(PlanesTest, HeaderAndTableCorruptionIsDataLoss) {
  const size_t n = kUnit * 2 * 3 + 6;
  std::vector<uint8_t> raw = NormalWeights(n, 2, 0.02f, 11);
  std::vector<uint8_t> enc = EncodeOrDie(raw, 2, 0.0);
  ASSERT_FALSE(enc.empty());
  std::vector<uint8_t> back;
  // Truncations.
  for (size_t cut : {size_t{0}, size_t{10}, size_t{95}, enc.size() / 2, enc.size() - 1}) {
    std::vector<uint8_t> t(enc.begin(), enc.begin() + cut);
    Status st = DecodeInto(t, n, &back);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << cut;
  }
  // A wrong raw size.
  {
    std::vector<uint8_t> scratch(n + 2), out(n + 2);
    EXPECT_EQ(planes::Decode(enc.data(), enc.size(), out.data(), n + 2, scratch.data()).code(),
              StatusCode::kDataLoss);
  }
  // Every byte of the header, the plane directory and the coded plane's tables, flipped: an
  // error or a different decode, never a crash (sanitizer builds check the bounds).
  planes::Layout l;
  ASSERT_TRUE(planes::Parse(enc.data(), enc.size(), n, &l).ok());
  size_t tables_end = l.plane[1].offset + planes::kCodedUnitTableOffset + 4 * (l.nunits + 1);
  int errors = 0;
  for (size_t i = 0; i < tables_end; ++i) {
    if (i >= l.plane[0].offset && i < l.plane[0].offset + l.plane[0].size) continue;
    for (uint8_t mask : {0x01, 0x10, 0x80}) {
      std::vector<uint8_t> c = enc;
      c[i] ^= mask;
      Status st = DecodeInto(c, n, &back);
      if (!st.ok()) {
        EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
        EXPECT_FALSE(st.message().empty());
        ++errors;
      }
    }
  }
  EXPECT_GT(errors, 0);
}

TEST(PlanesTest, CorruptUnitsAreDataLossNamingUnitAndPlane) {
  const size_t n = kUnit * 2 * 4;
  std::vector<uint8_t> raw = NormalWeights(n, 2, 0.02f, 5);
  std::vector<uint8_t> enc = EncodeOrDie(raw, 2, 0.0);
  planes::Layout l;
  ASSERT_TRUE(planes::Parse(enc.data(), enc.size(), n, &l).ok());
  const uint8_t* table = enc.data() + l.plane[1].offset + planes::kCodedUnitTableOffset;
  uint32_t unit2;
  std::memcpy(&unit2, table + 8, 4);
  const size_t u2 = l.plane[1].offset + unit2;
  std::vector<uint8_t> back;
  {
    std::vector<uint8_t> c = enc;
    c[u2 + 3] += 1;  // stream 3's length no longer adds up to the unit
    Status st = DecodeInto(c, n, &back);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss);
    EXPECT_NE(st.message().find("unit 2 of plane 1"), std::string::npos) << st.message();
  }
  {
    std::vector<uint8_t> c = enc;
    // Move one word from stream 0 to stream 1: lengths still add up, codes no longer do.
    c[u2 + 0] -= 1;
    c[u2 + 1] += 1;
    Status st = DecodeInto(c, n, &back);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss);
    EXPECT_NE(st.message().find("unit 2 of plane 1, stream"), std::string::npos) << st.message();
  }
  // Every single-byte change in the stream data: an error or a different decode (which the
  // block checksum rejects), never a crash. Huffman codes resynchronize, so only some changes
  // break the stream's length or padding.
  int caught = 0, total = 0;
  uint32_t unit3;
  std::memcpy(&unit3, table + 12, 4);
  for (size_t i = u2 + planes::kStreamsPerUnit; i < l.plane[1].offset + unit3; i += 3) {
    std::vector<uint8_t> c = enc;
    c[i] ^= 0x5a;
    Status st = DecodeInto(c, n, &back);
    ++total;
    if (!st.ok()) {
      EXPECT_EQ(st.code(), StatusCode::kDataLoss);
      ++caught;
    } else {
      EXPECT_FALSE(back == raw);
    }
  }
  EXPECT_GT(caught, 0) << total;
}

// ---- in files: the writer, Reader reads and host loads ----------------------------------

TEST(PlanesFileTest, EveryDTypeRoundTripsThroughWriterReaderAndHostLoads) {
  testing::TempDir dir;
  std::string path = dir.File("planes.ferry");
  WriterOptions wo;
  wo.block_size = 64 << 10;
  std::map<std::string, std::vector<uint8_t>> expected;
  {
    auto w = Writer::Create(path, wo);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    uint64_t seed = 1;
    for (int d = 0; d < kNumDTypes; ++d) {
      auto dtype = static_cast<DType>(d);
      size_t width = std::max<size_t>(1, DTypeStorageBits(dtype) / 8);
      // Sizes around one unit and one block, and tiny ones that stay raw.
      for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{kUnit - 1}, int64_t{kUnit},
                            int64_t{kUnit + 1}, int64_t{70000}}) {
        uint64_t n = *StorageBytes(dtype, numel);
        std::vector<uint8_t> bytes = width == 2 || width == 4 || width == 8
                                         ? NormalWeights(n, width, 0.02f, seed++)
                                         : NormalWeights(n, 1, 0.02f, seed++);
        if (d % 2) SprinkleSpecials(bytes, width == 2 || width == 4 || width == 8 ? width : 1);
        std::string name = StrCat(DTypeName(dtype), "/", numel);
        ASSERT_TRUE(w->AddTensor(name, dtype, {numel}, bytes.data(), n, Encoding::kPlanes).ok());
        expected[name] = std::move(bytes);
      }
    }
    ASSERT_TRUE(w->Commit().ok());
  }
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  int planes_chunks = 0;
  for (const auto& [name, bytes] : expected) {
    auto info = (*r)->Find(name);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->encoding, bytes.empty() ? Encoding::kRaw : Encoding::kPlanes) << name;
    const fb::Tensor* t = BlocksOf(**r).at(info->index);
    if (t->chunks()) {
      for (const fb::Chunk* c : *t->chunks()) planes_chunks += c->codec() == fb::ChunkCodec::PLANES;
    }
    std::vector<uint8_t> out(bytes.size() + 1, 0xEE);
    ReadOptions ro;
    ro.verify = true;
    ASSERT_TRUE((*r)->ReadInto(name, out.data(), out.size(), ro).ok()) << name;
    out.pop_back();
    EXPECT_TRUE(out == bytes) << name;
  }
  EXPECT_GT(planes_chunks, 20);
  EXPECT_TRUE((*r)->VerifyAll().ok());
  auto loader = Loader::Create();
  ASSERT_TRUE(loader.ok());
  auto host = (*loader)->LoadToHost(**r, {});
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  for (const LoadedTensor& lt : *host) {
    const std::vector<uint8_t>& want = expected.at(lt.info.name);
    ASSERT_EQ(lt.nbytes, want.size());
    if (want.empty()) continue;  // an empty tensor may have no memory at all
    EXPECT_EQ(std::memcmp(lt.data, want.data(), want.size()), 0) << lt.info.name;
  }
}

TEST(PlanesFileTest, CorruptUnitIsDataLossNamingTensorAndBlock) {
  testing::TempDir dir;
  std::string path = dir.File("corrupt.ferry");
  WriterOptions wo;
  wo.block_size = 1 << 20;
  std::vector<uint8_t> w3 = NormalWeights(size_t{3} << 20, 2, 0.02f, 77);
  {
    auto w = Writer::Create(path, wo);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->AddTensor("layers.0.w", DType::kBF16, {1536, 1024}, w3.data(), w3.size(),
                             Encoding::kPlanes)
                    .ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  uint64_t at = 0;
  {
    auto r = Reader::Open(path);
    ASSERT_TRUE(r.ok());
    auto info = (*r)->Find("layers.0.w");
    const fb::Tensor* t = BlocksOf(**r).at(info->index);
    const fb::Chunk* c = t->chunks()->Get(1);
    ASSERT_EQ(c->codec(), fb::ChunkCodec::PLANES);
    planes::Layout l;
    const uint8_t* block = BlocksOf(**r).mapping()->data() + info->data_offset + c->offset();
    ASSERT_TRUE(planes::Parse(block, c->stored_size(), 1 << 20, &l).ok());
    uint32_t unit1;
    std::memcpy(&unit1, block + l.plane[1].offset + planes::kCodedUnitTableOffset + 4, 4);
    at = info->data_offset + c->offset() + l.plane[1].offset + unit1 + 5;  // a stream length
  }
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint8_t v;
  ASSERT_EQ(::pread(fd, &v, 1, static_cast<off_t>(at)), 1);
  v ^= 0x21;
  ASSERT_EQ(::pwrite(fd, &v, 1, static_cast<off_t>(at)), 1);
  ::close(fd);
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok());
  std::vector<uint8_t> out(w3.size());
  Status st = (*r)->ReadInto("layers.0.w", out.data(), out.size());
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("'layers.0.w'"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("block 1 "), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("unit 1 of plane 1"), std::string::npos) << st.message();
  auto loader = Loader::Create();
  ASSERT_TRUE(loader.ok());
  auto host = (*loader)->LoadToHost(**r, {});
  ASSERT_FALSE(host.ok());
  EXPECT_EQ(host.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(host.status().message().find("block 1 "), std::string::npos) << host.status().message();
}

// fp8 weights (E4M3FN, E5M2) are one-byte elements: the whole byte is one coded plane.
TEST(PlanesFileTest, Fp8WeightsCompressAndRoundTripBitExact) {
  testing::TempDir dir;
  std::string path = dir.File("fp8.ferry");
  WriterOptions wo;
  wo.block_size = 1 << 20;
  const std::vector<uint8_t> e4m3 = Fp8Weights(size_t{3} << 20, kE4M3FN, 5);
  std::vector<uint8_t> e5m2 = Fp8Weights((size_t{5} << 19) + 77, kE5M2, 6);
  SprinkleSpecials(e5m2, 1);  // NaN, largest finite values, negative zero
  {
    auto w = Writer::Create(path, wo);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->AddTensor("w.e4m3", DType::kF8_E4M3FN, {3072, 1024}, e4m3.data(), e4m3.size(),
                             Encoding::kPlanes)
                    .ok());
    ASSERT_TRUE(w->AddTensor("w.e5m2", DType::kF8_E5M2, {static_cast<int64_t>(e5m2.size())},
                             e5m2.data(), e5m2.size(), Encoding::kPlanes)
                    .ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const BlockSource& blocks = BlocksOf(**r);
  for (const auto& [name, bytes] :
       {std::pair{"w.e4m3", &e4m3},
        std::pair{"w.e5m2", static_cast<const std::vector<uint8_t>*>(&e5m2)}}) {
    auto info = (*r)->Find(name);
    ASSERT_TRUE(info.ok());
    const TensorRecord t = blocks.Record(info->index);
    ASSERT_EQ(t.encoding, Encoding::kPlanes) << name;
    for (uint64_t b = 0; b < blocks.NumBlocks(info->index); ++b) {
      EXPECT_TRUE(blocks.Block(info->index, b).planes) << name << " block " << b;
    }
    // Below the 1.18x (E4M3) and 1.39x (E5M2) of real weights: these are Gaussian rows.
    EXPECT_GT(static_cast<double>(t.nbytes) / t.data_size, 1.08) << name;
    std::vector<uint8_t> out(bytes->size());
    ReadOptions ro;
    ro.verify = true;
    ASSERT_TRUE((*r)->ReadInto(name, out.data(), out.size(), ro).ok()) << name;
    EXPECT_TRUE(out == *bytes) << name;
  }
  auto loader = Loader::Create();
  ASSERT_TRUE(loader.ok());
  auto host = (*loader)->LoadToHost(**r, {});
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  for (const LoadedTensor& lt : *host) {
    const std::vector<uint8_t>& want = lt.info.name == "w.e4m3" ? e4m3 : e5m2;
    ASSERT_EQ(lt.nbytes, want.size());
    EXPECT_EQ(std::memcmp(lt.data, want.data(), want.size()), 0) << lt.info.name;
  }
}

// Random bytes over an fp8 block's coded plane: the decoder reports DataLoss or decodes to
// something, and a verified read of the file never hands out bytes other than those saved.
TEST(PlanesFileTest, CorruptFp8BlocksAreErrors) {
  const std::vector<uint8_t> raw = Fp8Weights(size_t{1} << 20, kE4M3FN, 8);
  const std::vector<uint8_t> enc = EncodeOrDie(raw, 1, 0.0);
  ASSERT_FALSE(enc.empty());
  planes::Layout l;
  ASSERT_TRUE(planes::Parse(enc.data(), enc.size(), raw.size(), &l).ok());
  ASSERT_EQ(l.plane[0].mode, planes::kPlaneHuffman);
  std::mt19937_64 rng(3);
  int caught = 0;
  for (int round = 0; round < 300; ++round) {
    std::vector<uint8_t> bad = enc;
    const size_t span = l.plane[0].size - planes::kCodedUnitTableOffset;
    for (int k = 0; k < 1 + round % 4; ++k) {
      bad[l.plane[0].offset + planes::kCodedUnitTableOffset + rng() % span] ^=
          static_cast<uint8_t>(1 + rng() % 255);
    }
    std::vector<uint8_t> out;
    Status st = DecodeInto(bad, raw.size(), &out);
    if (!st.ok()) {
      EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
      ++caught;
    } else {
      // Huffman streams resynchronize: other symbols, the same bit count. The block checksum
      // is what rejects these (below).
      EXPECT_NE(Checksum64(out.data(), out.size()), Checksum64(raw.data(), raw.size()));
    }
  }
  EXPECT_GT(caught, 30);
  // A changed code that still decodes: the checksum catches it.
  testing::TempDir dir;
  std::string path = dir.File("fp8c.ferry");
  {
    WriterOptions wo;
    wo.block_size = 1 << 20;
    auto w = Writer::Create(path, wo);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->AddTensor("w", DType::kF8_E4M3FN, {1024, 1024}, raw.data(), raw.size(),
                             Encoding::kPlanes)
                    .ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  uint64_t stored_at = 0;
  {
    auto r = Reader::Open(path);
    ASSERT_TRUE(r.ok());
    const StoredBlock s = BlocksOf(**r).Block(0, 0);
    ASSERT_TRUE(s.planes);
    stored_at = s.file_offset;
  }
  // Swap two adjacent 4-byte stream words of unit 0's stream 0: same lengths, other symbols.
  const uint32_t unit0 = [&] {
    uint32_t v;
    std::memcpy(&v, enc.data() + l.plane[0].offset + planes::kCodedUnitTableOffset, 4);
    return v;
  }();
  const uint64_t words = stored_at + l.plane[0].offset + unit0 + planes::kStreamsPerUnit;
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint8_t w8[8];
  ASSERT_EQ(::pread(fd, w8, 8, static_cast<off_t>(words)), 8);
  std::rotate(w8, w8 + 4, w8 + 8);
  ASSERT_EQ(::pwrite(fd, w8, 8, static_cast<off_t>(words)), 8);
  ::close(fd);
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok());
  std::vector<uint8_t> out(raw.size());
  ReadOptions ro;
  ro.verify = true;
  Status st = (*r)->ReadInto("w", out.data(), out.size(), ro);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
}

}  // namespace
}  // namespace ferry
