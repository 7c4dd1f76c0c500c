// The committed format-v1 file (tests/data/golden_v1.ferry) must read back exactly, in every
// later build. Every expected value below is written out here, independent of the program that
// made the file (tests/make_golden.cc): if this test fails, the reader changed, not the file.
// Never regenerate the file to make this test pass.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>

#include "codec/codec.hpp"
#include "ferry/ferry.hpp"
#include "format/block_source.hpp"
#include "format/footer.hpp"

namespace ferry {
namespace {

const std::string kGoldenPath = std::string(FERRY_TEST_DATA_DIR) + "/golden_v1.ferry";

template <typename T>
std::vector<uint8_t> Bytes(const std::vector<T>& v) {
  std::vector<uint8_t> out(v.size() * sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::vector<uint8_t> Fp8Bytes() {
  std::vector<uint8_t> v(40 * 64);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>((i * 29 + 3) % 256);
  return v;
}

struct Expected {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  Encoding encoding;
  uint64_t data_size;
  std::vector<uint8_t> bytes;
};

// The tensors in name (byte) order, with the layout the v1 writer gave them.
std::vector<Expected> ExpectedTensors() {
  std::vector<Expected> t;
  t.push_back({"counts",
               DType::kI64,
               {5},
               Encoding::kRaw,
               40,
               Bytes(std::vector<int64_t>{INT64_MIN, -1, 0, 42, INT64_MAX})});
  {
    std::vector<uint16_t> v(16 * 8);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint16_t>(0x3C00 + (i * 37) % 512);
    t.push_back({"embed.weight", DType::kBF16, {16, 8}, Encoding::kRaw, 256, Bytes(v)});
  }
  t.push_back({"empty", DType::kF16, {0, 4}, Encoding::kRaw, 0, {}});
  {
    std::vector<float> v(64 * 40);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((i * 7) % 251) * 0.125f;
    t.push_back({"fc1.weight", DType::kF32, {64, 40}, Encoding::kZstd, 1648, Bytes(v)});
  }
  t.push_back(
      {"fc1.weight.amax", DType::kF32, {}, Encoding::kRaw, 4, Bytes(std::vector<float>{3.5f})});
  {
    std::vector<uint8_t> v(15);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>((i * 53 + 1) % 256);
    t.push_back({"fc1.weight.e5m2", DType::kF8_E5M2, {3, 5}, Encoding::kRaw, 15, v});
  }
  t.push_back({"fc1.weight.fp8", DType::kF8_E4M3FN, {40, 64}, Encoding::kRaw, 2560, Fp8Bytes()});
  {
    auto fp8 = Fp8Bytes();
    std::vector<uint8_t> v(64 * 40);
    for (size_t r = 0; r < 64; ++r) {
      for (size_t c = 0; c < 40; ++c) v[r * 40 + c] = fp8[c * 64 + r];
    }
    t.push_back({"fc1.weight.fp8_t", DType::kF8_E4M3FN, {64, 40}, Encoding::kRaw, 2560, v});
  }
  t.push_back({"fc1.weight.scale_inv",
               DType::kF32,
               {1},
               Encoding::kRaw,
               4,
               Bytes(std::vector<float>{0.0078125f})});
  {
    std::vector<uint16_t> v(48 * 64);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint16_t>(0x3F00 | ((i * 13) % 256));
    t.push_back({"fc2.weight", DType::kBF16, {48, 64}, Encoding::kShuffleZstd, 560, Bytes(v)});
  }
  {
    std::vector<uint8_t> v(7);
    for (size_t i = 0; i < v.size(); ++i) v[i] = i % 3 == 0 ? 1 : 0;
    t.push_back({"mask", DType::kBool, {7}, Encoding::kRaw, 7, v});
  }
  t.push_back({"mx.scales",
               DType::kF8_E8M0FNU,
               {4, 2},
               Encoding::kRaw,
               8,
               {127, 128, 129, 130, 131, 132, 133, 134}});
  // FP4 E2M1, 15 elements: nibble i = (3i + 1) mod 16; element 2j is the low nibble of byte
  // j and the high nibble of the last byte is zero.
  t.push_back({"nvfp4.weight",
               DType::kF4_E2M1FN,
               {3, 5},
               Encoding::kRaw,
               8,
               {0x41, 0xA7, 0x0D, 0x63, 0xC9, 0x2F, 0x85, 0x0B}});
  t.push_back(
      {"pi", DType::kF64, {}, Encoding::kRaw, 8, Bytes(std::vector<double>{3.141592653589793})});
  t.push_back({"z.complex",
               DType::kC64,
               {2},
               Encoding::kRaw,
               16,
               Bytes(std::vector<float>{1.0f, 2.0f, -0.5f, 0.25f})});
  t.push_back(
      {"\xC3\xBCn\xC3\xAF"
       "code.\xE6\x9D\x83\xE9\x87\x8D",
       DType::kU8,
       {4},
       Encoding::kRaw,
       4,
       {1, 2, 3, 4}});
  return t;
}

// File offsets of each tensor as the v1 writer laid them out (added in make_golden.cc's
// order: 4096-byte alignment for tensors of 4096 raw bytes or more, 64 otherwise).
const std::vector<std::pair<std::string, uint64_t>> kOffsets = {
    {"embed.weight", 4096},
    {"fc1.weight", 8192},
    {"fc2.weight", 12288},
    {"fc1.weight.fp8", 12864},
    {"fc1.weight.fp8_t", 15424},
    {"fc1.weight.scale_inv", 17984},
    {"fc1.weight.amax", 18048},
    {"fc1.weight.e5m2", 18112},
    {"mx.scales", 18176},
    {"nvfp4.weight", 18240},
    {"counts", 18304},
    {"mask", 18368},
    {"pi", 18432},
    {"z.complex", 18496},
    {"\xC3\xBCn\xC3\xAF"
     "code.\xE6\x9D\x83\xE9\x87\x8D",
     18560},
};

class GoldenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto r = Reader::Open(kGoldenPath);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    reader_ = *r;
  }
  std::shared_ptr<Reader> reader_;
};

TEST_F(GoldenTest, FileIsTheCommittedOne) {
  // Pins the exact bytes: a regenerated file would hide a reader that no longer reads the old
  // one. If this fails, restore tests/data/golden_v1.ferry from version control.
  std::ifstream in(kGoldenPath, std::ios::binary);
  std::vector<uint8_t> bytes(std::istreambuf_iterator<char>(in), {});
  EXPECT_EQ(bytes.size(), 21544u);
  EXPECT_EQ(Checksum64(bytes.data(), bytes.size()), 0xfc11a704b8a4cda1u);
  EXPECT_EQ(reader_->file_size(), bytes.size());
}

TEST_F(GoldenTest, Header) {
  EXPECT_EQ(reader_->format_version(), 1u);
  EXPECT_EQ(reader_->producer(), "tensorferry golden v1");
  EXPECT_TRUE(reader_->VerifyAll().ok());
  auto verified = Reader::Open(kGoldenPath, {.verify_on_open = true});
  EXPECT_TRUE(verified.ok()) << verified.status().ToString();
}

TEST_F(GoldenTest, Tensors) {
  auto expected = ExpectedTensors();
  ASSERT_EQ(reader_->num_tensors(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const Expected& e = expected[i];
    SCOPED_TRACE(e.name);
    TensorInfo t = reader_->tensor(i);
    EXPECT_EQ(t.name, e.name);
    EXPECT_EQ(t.index, i);
    EXPECT_EQ(t.dtype, e.dtype);
    EXPECT_EQ(t.shape, e.shape);
    EXPECT_EQ(t.encoding, e.encoding);
    EXPECT_EQ(t.nbytes, e.bytes.size());
    EXPECT_EQ(t.block_size, e.bytes.empty() ? 0u : 4096u);
    EXPECT_EQ(t.data_size, e.data_size);
    std::vector<uint8_t> out(e.bytes.size() + 1, 0xEE);
    Status st = reader_->ReadInto(e.name, out.data(), e.bytes.size(), {true});
    ASSERT_TRUE(st.ok()) << st.ToString();
    out.pop_back();
    EXPECT_EQ(out, e.bytes);
    if (e.encoding == Encoding::kRaw) {
      auto view = reader_->View(e.name, {true});
      ASSERT_TRUE(view.ok()) << view.status().ToString();
      ASSERT_EQ(view->nbytes, e.bytes.size());
      if (!e.bytes.empty()) EXPECT_EQ(std::memcmp(view->data, e.bytes.data(), view->nbytes), 0);
    }
  }
}

TEST_F(GoldenTest, Layout) {
  for (const auto& [name, offset] : kOffsets) {
    auto t = reader_->Find(name);
    ASSERT_TRUE(t.ok()) << name;
    EXPECT_EQ(t->data_offset, offset) << name;
    EXPECT_EQ(t->data_offset % (t->nbytes >= 4096 ? 4096 : 64), 0u) << name;
  }
  EXPECT_EQ(reader_->Find("empty")->data_offset, 0u);
  // The chunk tables of the encoded tensors: one zstd frame per 4096-byte block.
  const BlockSource& source = BlocksOf(*reader_);
  for (const char* name : {"fc1.weight", "fc2.weight"}) {
    SCOPED_TRACE(name);
    const size_t i = reader_->Find(name)->index;
    const fb::Tensor* t = source.at(i);
    ASSERT_NE(t->chunks(), nullptr);
    uint64_t blocks = (t->nbytes() + 4095) / 4096;
    ASSERT_EQ(t->chunks()->size(), blocks);
    ASSERT_EQ(t->checksums()->size(), blocks);
    uint64_t end = 0;
    for (const fb::Chunk* c : *t->chunks()) {
      EXPECT_EQ(c->codec(), fb::ChunkCodec::ZSTD);
      EXPECT_EQ(c->offset(), end);  // chunks are packed back to back
      end = c->offset() + c->stored_size();
    }
    EXPECT_EQ(end, t->data_size());
    // The block source reports the same table.
    ASSERT_EQ(source.NumBlocks(i), blocks);
    for (uint64_t b = 0; b < source.NumBlocks(i); ++b) {
      const fb::Chunk* c = t->chunks()->Get(static_cast<flatbuffers::uoffset_t>(b));
      StoredBlock s = source.Block(i, b);
      EXPECT_EQ(s.file_offset, t->data_offset() + c->offset());
      EXPECT_EQ(s.stored_size, c->stored_size());
      EXPECT_EQ(s.raw_offset, b * 4096);
      EXPECT_EQ(s.raw_size, std::min<uint64_t>(4096, t->nbytes() - b * 4096));
      EXPECT_TRUE(s.compressed);
      EXPECT_TRUE(source.VerifyBlock(i, b).ok());
    }
  }
}

TEST_F(GoldenTest, RowsOfEncodedTensors) {
  auto expected = ExpectedTensors();
  const Expected& fc1 = expected[3];
  ASSERT_EQ(fc1.name, "fc1.weight");
  // Rows 20..45 of F32[64, 40] cross both block boundaries (160 bytes per row).
  std::vector<uint8_t> out(25 * 160);
  ASSERT_TRUE(reader_->ReadRowsInto("fc1.weight", 20, 45, out.data(), out.size(), {true}).ok());
  EXPECT_EQ(std::memcmp(out.data(), fc1.bytes.data() + 20 * 160, out.size()), 0);
  const Expected& fc2 = expected[9];
  ASSERT_EQ(fc2.name, "fc2.weight");
  out.assign(16 * 128, 0);
  ASSERT_TRUE(reader_->ReadRowsInto("fc2.weight", 31, 47, out.data(), out.size(), {true}).ok());
  EXPECT_EQ(std::memcmp(out.data(), fc2.bytes.data() + 31 * 128, out.size()), 0);
  Status odd = reader_->ReadRowsInto("nvfp4.weight", 1, 2, out.data(), out.size());
  EXPECT_EQ(odd.code(), StatusCode::kInvalidArgument);
}

TEST_F(GoldenTest, Metadata) {
  std::vector<std::pair<std::string, std::string>> expect = {
      {"config", "{\"layers\": 2, \"hidden\": 64}"},
      {"note", "golden v1 \xE2\x9C\x93"},
      {"step", "1234"},
  };
  EXPECT_EQ(reader_->metadata(), expect);
  EXPECT_EQ(reader_->metadata("step"), std::optional<std::string>("1234"));
}

TEST_F(GoldenTest, QuantizedTensor) {
  auto qs = reader_->quantized();
  ASSERT_EQ(qs.size(), 1u);
  const QuantizedTensor& q = qs[0];
  EXPECT_EQ(q.name, "fc1.weight.q");
  EXPECT_EQ(q.quantized_dtype, DType::kF8_E4M3FN);
  EXPECT_EQ(q.logical_dtype, DType::kBF16);
  EXPECT_EQ(q.shape, (std::vector<int64_t>{40, 64}));
  EXPECT_EQ(q.scaling_mode, ScalingMode::kPerTensor);
  ASSERT_TRUE(q.rowwise.has_value());
  EXPECT_EQ(q.rowwise->data, "fc1.weight.fp8");
  EXPECT_EQ(q.rowwise->scale_inv, "fc1.weight.scale_inv");
  EXPECT_EQ(q.rowwise->scale_layout, ScaleLayout::kRowMajor);
  EXPECT_EQ(q.rowwise->amax, "fc1.weight.amax");
  ASSERT_TRUE(q.columnwise.has_value());
  EXPECT_EQ(q.columnwise->data, "fc1.weight.fp8_t");
  EXPECT_EQ(q.columnwise->scale_inv, "fc1.weight.scale_inv");
  EXPECT_EQ(q.columnwise->scale_layout, ScaleLayout::kRowMajor);
  EXPECT_EQ(q.columnwise->amax, "");
}

TEST_F(GoldenTest, ScalingStates) {
  auto states = reader_->scaling_states();
  ASSERT_EQ(states.size(), 3u);

  const ScalingState& s0 = states[0];
  EXPECT_EQ(s0.module, "layers.0.mlp.fc1");
  ASSERT_TRUE(std::holds_alternative<DelayedScaling>(s0.recipe));
  const auto& d = std::get<DelayedScaling>(s0.recipe);
  EXPECT_EQ(d.margin, 2);
  EXPECT_EQ(d.fp8_format, Fp8Format::kE4M3);
  EXPECT_EQ(d.amax_history_len, 4);
  EXPECT_EQ(d.amax_compute_algo, AmaxComputeAlgo::kMostRecent);
  EXPECT_FALSE(d.reduce_amax);
  EXPECT_TRUE(d.fp8_dpa);
  EXPECT_FALSE(d.fp8_mha);
  ASSERT_EQ(s0.states.size(), 2u);
  const DirectionState& fwd = s0.states[0];
  EXPECT_EQ(fwd.direction, Direction::kForward);
  EXPECT_EQ(fwd.num_gemms, 1);
  EXPECT_EQ(fwd.slot_roles,
            (std::vector<SlotRole>{SlotRole::kInput, SlotRole::kWeight, SlotRole::kOutput}));
  EXPECT_EQ(fwd.scale, (std::vector<float>{1.0f, 2.0f, 4.0f}));
  EXPECT_EQ(fwd.history_len, 4);
  EXPECT_EQ(fwd.amax_history, (std::vector<float>{10.5f, 11.5f, 12.5f, 20.5f, 21.5f, 22.5f, 30.5f,
                                                  31.5f, 32.5f, 40.5f, 41.5f, 42.5f}));
  const DirectionState& bwd = s0.states[1];
  EXPECT_EQ(bwd.direction, Direction::kBackward);
  EXPECT_EQ(bwd.num_gemms, 1);
  EXPECT_EQ(bwd.slot_roles, (std::vector<SlotRole>{SlotRole::kGradOutput, SlotRole::kGradInput}));
  EXPECT_EQ(bwd.scale, (std::vector<float>{0.5f, 0.25f}));
  EXPECT_EQ(bwd.history_len, 4);
  EXPECT_EQ(bwd.amax_history, (std::vector<float>{100.25f, 101.25f, 200.25f, 201.25f, 300.25f,
                                                  301.25f, 400.25f, 401.25f}));

  EXPECT_EQ(states[1].module, "layers.1.mlp.fc1");
  ASSERT_TRUE(std::holds_alternative<MXFP8BlockScaling>(states[1].recipe));
  // Written with the default format, so the file holds no value: the schema default applies
  // and must never change.
  EXPECT_EQ(std::get<MXFP8BlockScaling>(states[1].recipe).fp8_format, Fp8Format::kE4M3);
  EXPECT_TRUE(states[1].states.empty());

  EXPECT_EQ(states[2].module, "zz.custom");
  ASSERT_TRUE(std::holds_alternative<CustomRecipe>(states[2].recipe));
  EXPECT_EQ(std::get<CustomRecipe>(states[2].recipe).name, "my.Recipe");
  EXPECT_EQ(std::get<CustomRecipe>(states[2].recipe).qfactory, "my.factory");
  EXPECT_TRUE(states[2].states.empty());
}

}  // namespace
}  // namespace ferry
