// Round trips through the writer and reader on host memory, and the writer's and reader's
// documented failure modes.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <set>

#include "ferry/ferry.hpp"
#include "format/recipe.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

using testing::RandomBytes;
using testing::TempDir;

// Scratch checkpoints skip fsync: the tests check layout and behaviour, not durability.
WriterOptions Scratch(uint64_t block_size = uint64_t{4} << 20) {
  WriterOptions o;
  o.durable = false;
  o.block_size = block_size;
  return o;
}

std::set<std::string> DirEntries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out.insert(e.path().filename().string());
  }
  return out;
}

std::vector<uint8_t> ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

void WriteFileBytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

std::shared_ptr<Reader> OpenOrDie(const std::string& path, ReaderOptions options = {}) {
  auto r = Reader::Open(path, options);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : nullptr;
}

TEST(FormatTest, RoundTripEveryDTypeAndEncoding) {
  TempDir dir;
  for (Encoding enc :
       {Encoding::kRaw, Encoding::kZstd, Encoding::kShuffleZstd, Encoding::kPlanes}) {
    std::string path = dir.File(std::string("all_") + EncodingName(enc) + ".ferry");
    std::vector<std::vector<uint8_t>> data;
    {
      auto w = Writer::Create(path);
      ASSERT_TRUE(w.ok()) << w.status().ToString();
      for (int d = 0; d < kNumDTypes; ++d) {
        auto dtype = static_cast<DType>(d);
        std::vector<int64_t> shape = {3, 5, 7};
        uint64_t n = *StorageBytes(dtype, 105);
        data.push_back(RandomBytes(n, d));
        ASSERT_TRUE(w->AddTensor(DTypeName(dtype), dtype, shape, data.back().data(), n, enc).ok());
      }
      ASSERT_TRUE(w->Commit().ok());
    }
    auto r = Reader::Open(path);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ((*r)->num_tensors(), static_cast<size_t>(kNumDTypes));
    for (int d = 0; d < kNumDTypes; ++d) {
      auto dtype = static_cast<DType>(d);
      auto info = (*r)->Find(DTypeName(dtype));
      ASSERT_TRUE(info.ok());
      EXPECT_EQ(info->dtype, dtype);
      EXPECT_EQ(info->shape, (std::vector<int64_t>{3, 5, 7}));
      std::vector<uint8_t> out(info->nbytes);
      ASSERT_TRUE((*r)->ReadInto(DTypeName(dtype), out.data(), out.size(), {true}).ok());
      EXPECT_EQ(out, data[d]) << DTypeName(dtype);
    }
  }
}

TEST(FormatTest, Fp4PacksTwoPerByte) {
  EXPECT_EQ(*StorageBytes(DType::kF4_E2M1FN, 7), 4u);
  EXPECT_EQ(*StorageBytes(DType::kF4_E2M1FN, 8), 4u);
  EXPECT_EQ(*StorageBytes(DType::kBF16, 7), 14u);
}

TEST(FormatTest, DTypeNamesParseBack) {
  for (int d = 0; d < kNumDTypes; ++d) {
    auto dtype = static_cast<DType>(d);
    auto parsed = ParseDType(DTypeName(dtype));
    ASSERT_TRUE(parsed.has_value()) << DTypeName(dtype);
    EXPECT_EQ(*parsed, dtype);
  }
  EXPECT_FALSE(ParseDType("F17").has_value());
  EXPECT_STREQ(DTypeName(static_cast<DType>(kNumDTypes)), "?");
  EXPECT_FALSE(IsValidDType(kNumDTypes));
  EXPECT_FALSE(NumElements({2, -1}).has_value());
  EXPECT_FALSE(NumElements({int64_t{1} << 40, int64_t{1} << 40}).has_value());
  EXPECT_EQ(*NumElements({}), 1u);
  EXPECT_EQ(*NumElements({0, 5}), 0u);
}

TEST(FormatTest, LayoutAlignsDataAndTrailer) {
  TempDir dir;
  std::string path = dir.File("layout.ferry");
  auto big = RandomBytes(5000, 1);
  auto small = RandomBytes(10, 2);
  {
    auto w = Writer::Create(path, Scratch());
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->AddTensor("a_small", DType::kU8, {10}, small.data(), small.size()).ok());
    ASSERT_TRUE(w->AddTensor("b_big", DType::kU8, {5000}, big.data(), big.size()).ok());
    ASSERT_TRUE(w->AddTensor("c_small", DType::kU8, {10}, small.data(), small.size()).ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  auto r = OpenOrDie(path);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->Find("a_small")->data_offset, 4096u);
  EXPECT_EQ(r->Find("b_big")->data_offset, 8192u);
  EXPECT_EQ(r->Find("c_small")->data_offset, 8192u + 5000u + 56u);  // next 64-byte boundary
  auto bytes = ReadFileBytes(path);
  ASSERT_GE(bytes.size(), 4096u + 24u);
  EXPECT_EQ(std::memcmp(bytes.data(), "TFERRY01", 8), 0);
  EXPECT_EQ(std::memcmp(bytes.data() + bytes.size() - 8, "TFERRY01", 8), 0);
  uint64_t footer_size;
  std::memcpy(&footer_size, bytes.data() + bytes.size() - 24, 8);
  uint64_t footer_offset = bytes.size() - 24 - footer_size;
  EXPECT_EQ(footer_offset % 8, 0u);
  EXPECT_EQ(std::memcmp(bytes.data() + footer_offset + 4, "TFRY", 4), 0);
  // The padding between the magic and the first tensor is zero.
  for (size_t i = 8; i < 4096; ++i) ASSERT_EQ(bytes[i], 0) << i;
  EXPECT_EQ(r->format_version(), 1u);
  EXPECT_EQ(r->producer(), std::string("tensorferry ") + VersionString());
  EXPECT_EQ(r->file_size(), bytes.size());
}

TEST(FormatTest, ScalarsAndZeroSizeTensors) {
  TempDir dir;
  std::string path = dir.File("scalars.ferry");
  double pi = 3.141592653589793;
  int8_t minus_one = -1;
  uint8_t fp4_scalar = 0x07;  // one element: low nibble only
  {
    auto w = Writer::Create(path, Scratch());
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->AddTensor("pi", DType::kF64, {}, &pi, sizeof(pi)).ok());
    ASSERT_TRUE(w->AddTensor("minus_one", DType::kI8, {}, &minus_one, 1, Encoding::kZstd).ok());
    ASSERT_TRUE(w->AddTensor("fp4_scalar", DType::kF4_E2M1FN, {}, &fp4_scalar, 1).ok());
    ASSERT_TRUE(w->AddTensor("empty_rows", DType::kF32, {0, 5}, nullptr, 0).ok());
    ASSERT_TRUE(w->AddTensor("empty_cols", DType::kBF16, {5, 0}, nullptr, 0, Encoding::kZstd).ok());
    ASSERT_TRUE(w->AddTensor("empty_1d", DType::kF4_E2M1FN, {0}, nullptr, 0).ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  auto r = OpenOrDie(path, {.verify_on_open = true});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->num_tensors(), 6u);

  auto info = r->Find("pi");
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->shape.empty());
  EXPECT_EQ(info->nbytes, 8u);
  double pi_out = 0;
  ASSERT_TRUE(r->ReadInto("pi", &pi_out, sizeof(pi_out), {true}).ok());
  EXPECT_EQ(pi_out, pi);
  auto view = r->View("pi", {true});
  ASSERT_TRUE(view.ok());
  ASSERT_EQ(view->nbytes, 8u);
  EXPECT_EQ(std::memcmp(view->data, &pi, 8), 0);

  int8_t m = 0;
  ASSERT_TRUE(r->ReadInto("minus_one", &m, 1, {true}).ok());
  EXPECT_EQ(m, -1);
  uint8_t f = 0;
  ASSERT_TRUE(r->ReadInto("fp4_scalar", &f, 1, {true}).ok());
  EXPECT_EQ(f, 0x07);

  // A scalar has no dimension 0 to slice.
  Status rows = r->ReadRowsInto("pi", 0, 1, &pi_out, sizeof(pi_out));
  EXPECT_EQ(rows.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rows.message().find("a scalar has no rows"), std::string::npos) << rows.message();

  for (const char* name : {"empty_rows", "empty_cols", "empty_1d"}) {
    auto e = r->Find(name);
    ASSERT_TRUE(e.ok()) << name;
    EXPECT_EQ(e->nbytes, 0u);
    EXPECT_EQ(e->data_size, 0u);
    // Empty tensors own no bytes, whatever encoding was asked for.
    EXPECT_EQ(e->encoding, Encoding::kRaw);
    EXPECT_TRUE(r->ReadInto(name, nullptr, 0, {true}).ok()) << name;
    auto v = r->View(name, {true});
    ASSERT_TRUE(v.ok()) << name;
    EXPECT_EQ(v->nbytes, 0u);
    EXPECT_EQ(v->data, nullptr);
  }
  EXPECT_EQ(r->Find("empty_rows")->shape, (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(r->Find("empty_cols")->shape, (std::vector<int64_t>{5, 0}));
  EXPECT_TRUE(r->ReadRowsInto("empty_rows", 0, 0, nullptr, 0).ok());
  // Rows of a [5, 0] tensor exist but hold no bytes.
  EXPECT_TRUE(r->ReadRowsInto("empty_cols", 1, 4, nullptr, 0).ok());
  EXPECT_TRUE(r->VerifyAll().ok());
}

TEST(FormatTest, HundredThousandTinyTensors) {
  TempDir dir;
  std::string path = dir.File("many.ferry");
  constexpr int kCount = 100000;
  auto name_of = [](int i) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "layer.%06d.w", i);
    return std::string(buf);
  };
  auto value_of = [](int i) { return static_cast<uint32_t>(i) * 2654435761u; };
  {
    auto w = Writer::Create(path, Scratch());
    ASSERT_TRUE(w.ok());
    // Added in reverse order so the footer's sort is exercised, not just preserved.
    for (int i = kCount - 1; i >= 0; --i) {
      uint32_t v = value_of(i);
      Status st = w->AddTensor(name_of(i), DType::kU32, {1}, &v, sizeof(v));
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
    ASSERT_TRUE(w->Commit().ok());
  }
  auto start = std::chrono::steady_clock::now();
  auto r = OpenOrDie(path);
  auto open_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(r);
  ASSERT_EQ(r->num_tensors(), static_cast<size_t>(kCount));
  std::cout << "open + validate of " << kCount << " tensors: " << open_ms << " ms\n";
  for (int i = 0; i < kCount; ++i) {
    std::string name = name_of(i);
    TensorInfo t = r->tensor(static_cast<size_t>(i));
    ASSERT_EQ(t.name, name);  // zero-padded names sort like their indices
    auto found = r->Find(name);
    ASSERT_TRUE(found.ok()) << name;
    ASSERT_EQ(found->index, static_cast<size_t>(i));
    uint32_t out = 0;
    ASSERT_TRUE(r->ReadInto(name, &out, sizeof(out), {true}).ok()) << name;
    ASSERT_EQ(out, value_of(i)) << name;
  }
  auto missing = r->Find("layer.100000.w");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(path), std::string::npos);
  EXPECT_NE(missing.status().message().find("'layer.100000.w'"), std::string::npos);
}

TEST(FormatTest, NonAsciiNames) {
  TempDir dir;
  std::string path = dir.File("utf8.ferry");
  const std::vector<std::string> names = {
      "模型.层.0.权重",            // CJK
      "Gewichtsmatrix.ü",          // Latin-1 range
      "emb\xF0\x9F\x9A\x80",       // 4-byte sequence (rocket)
      "e\xCC\x81t\xC3\xA9",        // combining acute vs precomposed: distinct names
      "\xD0\xB2\xD0\xB5\xD1\x81",  // Cyrillic
      "plain",
  };
  {
    auto w = Writer::Create(path, Scratch());
    ASSERT_TRUE(w.ok());
    for (size_t i = 0; i < names.size(); ++i) {
      auto bytes = RandomBytes(12, i);
      ASSERT_TRUE(w->AddTensor(names[i], DType::kF32, {3}, bytes.data(), 12).ok()) << names[i];
    }
    ASSERT_TRUE(w->SetMetadata("説明", "ナンセンス ✓").ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  auto r = OpenOrDie(path);
  ASSERT_TRUE(r);
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());  // byte order, as the format requires
  EXPECT_EQ(r->names(), sorted);
  for (size_t i = 0; i < names.size(); ++i) {
    std::vector<uint8_t> out(12);
    ASSERT_TRUE(r->ReadInto(names[i], out.data(), out.size(), {true}).ok()) << names[i];
    EXPECT_EQ(out, RandomBytes(12, i)) << names[i];
  }
  EXPECT_EQ(r->metadata("説明"), std::optional<std::string>("ナンセンス ✓"));
  // A lookup miss quotes the UTF-8 name as is.
  auto miss = r->Find("模型.层.1.权重");
  EXPECT_EQ(miss.status().code(), StatusCode::kNotFound);
  EXPECT_NE(miss.status().message().find("'模型.层.1.权重'"), std::string::npos)
      << miss.status().message();
}

TEST(FormatTest, Metadata) {
  TempDir dir;
  std::string path = dir.File("meta.ferry");
  std::string big(1 << 20, 'x');
  for (size_t i = 0; i < big.size(); i += 7) big[i] = static_cast<char>('a' + i % 26);
  {
    auto w = Writer::Create(path, Scratch());
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->SetMetadata("step", "41").ok());
    ASSERT_TRUE(w->SetMetadata("step", "42").ok());  // last value wins
    ASSERT_TRUE(w->SetMetadata("config", big).ok());
    ASSERT_TRUE(w->SetMetadata("empty", "").ok());
    ASSERT_TRUE(w->SetMetadata("binary", std::string("a\0b\xff", 4)).ok());
    Status st = w->SetMetadata("", "v");
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("empty metadata key"), std::string::npos) << st.message();
    st = w->SetMetadata(std::string("k\0ey", 4), "v");
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("NUL"), std::string::npos) << st.message();
    ASSERT_TRUE(w->Commit().ok());
  }
  auto r = OpenOrDie(path);
  ASSERT_TRUE(r);
  std::vector<std::pair<std::string, std::string>> expect = {
      {"binary", std::string("a\0b\xff", 4)}, {"config", big}, {"empty", ""}, {"step", "42"}};
  EXPECT_EQ(r->metadata(), expect);
  EXPECT_EQ(r->metadata("step"), std::optional<std::string>("42"));
  EXPECT_EQ(r->metadata("empty"), std::optional<std::string>(""));
  EXPECT_EQ(r->metadata("config"), std::optional<std::string>(big));
  EXPECT_FALSE(r->metadata("missing").has_value());
  EXPECT_EQ(r->num_tensors(), 0u);
  EXPECT_TRUE(r->quantized().empty());
  EXPECT_TRUE(r->scaling_states().empty());
}

DirectionState MakeDirection(Direction dir, std::vector<SlotRole> roles, int32_t history_len,
                             float base) {
  DirectionState d;
  d.direction = dir;
  d.num_gemms = static_cast<int32_t>(roles.size());
  d.slot_roles = std::move(roles);
  d.history_len = history_len;
  for (size_t s = 0; s < d.slot_roles.size(); ++s) d.scale.push_back(base + 0.5f * s);
  for (int32_t l = 0; l < history_len; ++l) {
    for (size_t s = 0; s < d.slot_roles.size(); ++s) {
      d.amax_history.push_back(base * 100 + static_cast<float>(l) + 0.125f * s);
    }
  }
  return d;
}

TEST(FormatTest, EveryRecipeAndScalingState) {
  TempDir dir;
  std::string path = dir.File("recipes.ferry");
  std::vector<ScalingState> states;
  {
    ScalingState s;
    s.module = "a.delayed";
    s.recipe = DelayedScaling{.margin = 3,
                              .fp8_format = Fp8Format::kE5M2,
                              .amax_history_len = 16,
                              .amax_compute_algo = AmaxComputeAlgo::kMostRecent,
                              .reduce_amax = false,
                              .fp8_dpa = true,
                              .fp8_mha = true};
    s.states.push_back(MakeDirection(
        Direction::kForward, {SlotRole::kInput, SlotRole::kWeight, SlotRole::kOutput}, 16, 1.f));
    s.states.push_back(MakeDirection(Direction::kBackward,
                                     {SlotRole::kGradOutput, SlotRole::kGradInput}, 16, 2.f));
    states.push_back(s);
  }
  {
    ScalingState s;
    s.module = "b.delayed_defaults";
    s.recipe = DelayedScaling{};
    s.states.push_back(MakeDirection(Direction::kForward, {SlotRole::kInput}, 1, 3.f));
    states.push_back(s);
  }
  {
    ScalingState s;
    s.module = "c.current";
    s.recipe = Float8CurrentScaling{Fp8Format::kE4M3, true, false};
    states.push_back(s);
  }
  {
    ScalingState s;
    s.module = "d.mxfp8";
    s.recipe = MXFP8BlockScaling{Fp8Format::kHybrid};
    states.push_back(s);
  }
  {
    ScalingState s;
    s.module = "e.block";
    s.recipe = Float8BlockScaling{Fp8Format::kE5M2, 2, 1, 2};
    states.push_back(s);
  }
  {
    ScalingState s;
    s.module = "f.nvfp4";
    s.recipe = NVFP4BlockScaling{true, false, true};
    states.push_back(s);
  }
  {
    ScalingState s;
    s.module = "g.custom";
    s.recipe = CustomRecipe{"my_pkg.MyRecipe", "my_pkg.make_quantizer"};
    states.push_back(s);
  }
  {
    ScalingState s;
    s.module = "h.custom_no_factory";
    s.recipe = CustomRecipe{"other.Recipe", ""};
    states.push_back(s);
  }
  {
    // No recipe, but state: a framework that records amax only.
    ScalingState s;
    s.module = "i.none";
    s.states.push_back(MakeDirection(Direction::kForward, {}, 0, 0.f));
    s.states.push_back(MakeDirection(Direction::kBackward, {SlotRole::kGradOutput}, 0, 4.f));
    s.states.push_back(MakeDirection(
        Direction::kForward,
        {SlotRole::kInput, SlotRole::kWeight, SlotRole::kInput, SlotRole::kWeight}, 5, 5.f));
    states.push_back(s);
  }
  {
    auto w = Writer::Create(path, Scratch());
    ASSERT_TRUE(w.ok());
    // Added out of order; the reader returns them sorted by module.
    for (auto it = states.rbegin(); it != states.rend(); ++it) {
      ASSERT_TRUE(w->AddScalingState(*it).ok()) << it->module;
    }
    ASSERT_TRUE(w->Commit().ok());
  }
  auto r = OpenOrDie(path);
  ASSERT_TRUE(r);
  auto got = r->scaling_states();
  ASSERT_EQ(got.size(), states.size());
  for (size_t i = 0; i < states.size(); ++i) {
    EXPECT_EQ(got[i], states[i]) << states[i].module;
  }
  // Spot checks that do not lean on operator==.
  const auto& d = std::get<DelayedScaling>(got[0].recipe);
  EXPECT_EQ(d.margin, 3);
  EXPECT_EQ(d.fp8_format, Fp8Format::kE5M2);
  EXPECT_EQ(d.amax_history_len, 16);
  EXPECT_EQ(d.amax_compute_algo, AmaxComputeAlgo::kMostRecent);
  EXPECT_FALSE(d.reduce_amax);
  EXPECT_TRUE(d.fp8_dpa);
  EXPECT_TRUE(d.fp8_mha);
  ASSERT_EQ(got[0].states.size(), 2u);
  EXPECT_EQ(got[0].states[1].direction, Direction::kBackward);
  EXPECT_EQ(got[0].states[0].amax_history.size(), 48u);
  EXPECT_EQ(got[0].states[0].amax_history[3 * 1 + 2], 101.25f);  // row 1, slot 2
  EXPECT_TRUE(std::holds_alternative<std::monostate>(got[8].recipe));
  EXPECT_EQ(std::get<CustomRecipe>(got[7].recipe).qfactory, "");
  EXPECT_EQ(std::get<DelayedScaling>(got[1].recipe), DelayedScaling{});
}

// Every recipe kind by name, field by field, and back from JSON; the same names a pickled
// TransformerEngine recipe and `ferry inspect --json` use.
TEST(FormatTest, RecipesByNameAndJson) {
  const Recipe recipes[] = {
      std::monostate{},
      DelayedScaling{3, Fp8Format::kE5M2, 16, AmaxComputeAlgo::kMostRecent, false, true, false},
      Float8CurrentScaling{Fp8Format::kE4M3, true, true},
      MXFP8BlockScaling{Fp8Format::kE5M2},
      Float8BlockScaling{Fp8Format::kHybrid, 2, 1, 2},
      NVFP4BlockScaling{true, false, true},
      CustomRecipe{"mine", "pkg.factory"}};
  for (const Recipe& r : recipes) {
    const nlohmann::ordered_json j = format::RecipeToJson(r);
    EXPECT_EQ(j["type"], format::RecipeName(r));
    auto back = format::RecipeFromJson(j);
    ASSERT_TRUE(back.ok()) << back.status().ToString() << " " << j.dump();
    EXPECT_TRUE(*back == r) << j.dump();
    auto named = format::RecipeNamed(format::RecipeName(r));
    ASSERT_TRUE(named.has_value());
    EXPECT_EQ(named->index(), r.index());
    Recipe copy = r;
    EXPECT_EQ(format::RecipeFields(copy).size() + 1, j.size());
  }
  EXPECT_EQ(format::RecipeToJson(recipes[1]).dump(),
            R"({"type":"DelayedScaling","margin":3,"fp8_format":"E5M2","amax_history_len":16,)"
            R"("amax_compute_algo":"most_recent","reduce_amax":false,"fp8_dpa":true,)"
            R"("fp8_mha":false})");
  EXPECT_FALSE(format::RecipeNamed("Unknown").has_value());
  EXPECT_EQ(format::Fp8FormatNamed("HYBRID"), Fp8Format::kHybrid);
  EXPECT_FALSE(format::Fp8FormatNamed("E2M1").has_value());
  EXPECT_EQ(format::AmaxComputeAlgoName(AmaxComputeAlgo::kMostRecent), std::string("most_recent"));

  auto message = [](const char* text) {
    return format::RecipeFromJson(nlohmann::ordered_json::parse(text)).status().message();
  };
  EXPECT_EQ(message(R"({"type":"Bogus"})"), "unknown recipe type 'Bogus'");
  EXPECT_EQ(message(R"({"type":"MXFP8BlockScaling"})"), "missing \"fp8_format\"");
  EXPECT_EQ(message(R"({"type":"MXFP8BlockScaling","fp8_format":"E9"})"),
            "\"fp8_format\" has the unknown value 'E9'");
  EXPECT_EQ(message(R"({"type":"Float8BlockScaling","fp8_format":"E4M3","x_block_scaling_dim":)"
                    R"(4294967296,"w_block_scaling_dim":1,"grad_block_scaling_dim":1})"),
            "\"x_block_scaling_dim\" is not a 32-bit integer");
  EXPECT_EQ(message("[]"), "expected an object");
}

TEST(FormatTest, ScalingStateErrors) {
  TempDir dir;
  auto w = Writer::Create(dir.File("bad_scaling.ferry"), Scratch());
  ASSERT_TRUE(w.ok());
  ScalingState s;
  s.module = "m";
  s.states.push_back(
      MakeDirection(Direction::kForward, {SlotRole::kInput, SlotRole::kWeight}, 3, 1.f));
  s.states[0].amax_history.pop_back();
  Status st = w->AddScalingState(s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("scaling state 'm'"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("5 history entries"), std::string::npos) << st.message();
  s.states[0] = MakeDirection(Direction::kForward, {SlotRole::kInput}, 2, 1.f);
  s.states[0].scale.push_back(1.f);
  EXPECT_EQ(w->AddScalingState(s).code(), StatusCode::kInvalidArgument);
  s.states[0] = MakeDirection(Direction::kForward, {SlotRole::kInput}, 2, 1.f);
  ASSERT_TRUE(w->AddScalingState(s).ok());
  st = w->AddScalingState(s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("duplicate scaling state 'm'"), std::string::npos) << st.message();
  ScalingState c;
  c.module = "c";
  c.recipe = CustomRecipe{};
  st = w->AddScalingState(c);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("a custom recipe needs a name"), std::string::npos);
  c.module = "";
  EXPECT_EQ(w->AddScalingState(c).code(), StatusCode::kInvalidArgument);
}

TEST(FormatTest, QuantizedTensorsWithComponents) {
  TempDir dir;
  std::string path = dir.File("quant.ferry");
  // MXFP8 weight [64, 96]: rowwise scales [64, 96/32], columnwise [64/32, 96] (padded shapes
  // are the caller's business; the format stores whatever it is given).
  auto row_data = RandomBytes(64 * 96, 1);
  auto col_data = RandomBytes(96 * 64, 2);
  auto row_scale = RandomBytes(128 * 4, 3);
  auto col_scale = RandomBytes(4 * 96, 4);
  float amax = 7.5f, scale_inv = 0.0625f;
  auto fp8 = RandomBytes(32 * 32, 5);
  auto fp4 = RandomBytes(16 * 32 / 2, 6);
  auto fp4_scales = RandomBytes(16 * 2, 7);

  std::vector<QuantizedTensor> qs;
  {
    QuantizedTensor q;
    q.name = "mlp.fc1.weight";
    q.quantized_dtype = DType::kF8_E4M3FN;
    q.logical_dtype = DType::kBF16;
    q.shape = {64, 96};
    q.scaling_mode = ScalingMode::kMxfp8_1x32;
    q.rowwise = QuantizedComponent{"mlp.fc1.weight.row", "mlp.fc1.weight.row_scale_inv",
                                   ScaleLayout::kSwizzled, ""};
    q.columnwise = QuantizedComponent{"mlp.fc1.weight.col", "mlp.fc1.weight.col_scale_inv",
                                      ScaleLayout::kRowMajor, ""};
    qs.push_back(q);
  }
  {
    QuantizedTensor q;
    q.name = "mlp.fc2.weight";
    q.quantized_dtype = DType::kF8_E5M2;
    q.logical_dtype = DType::kF32;
    q.shape = {32, 32};
    q.scaling_mode = ScalingMode::kPerTensor;
    q.rowwise = QuantizedComponent{"mlp.fc2.weight.data", "mlp.fc2.weight.scale_inv",
                                   ScaleLayout::kRowMajor, "mlp.fc2.weight.amax"};
    qs.push_back(q);
  }
  {
    // Columnwise only, and the same tensor referenced by several fields.
    QuantizedTensor q;
    q.name = "mlp.fc3.weight";
    q.quantized_dtype = DType::kF4_E2M1FN;
    q.logical_dtype = DType::kBF16;
    q.shape = {16, 32};
    q.scaling_mode = ScalingMode::kNvfp4_1x16;
    q.columnwise = QuantizedComponent{"mlp.fc3.weight.fp4", "mlp.fc3.weight.fp4_scales",
                                      ScaleLayout::kSwizzled, "mlp.fc2.weight.amax"};
    qs.push_back(q);
  }
  {
    auto w = Writer::Create(path, Scratch());
    ASSERT_TRUE(w.ok());
    // Quantized entries may come before their component tensors: references resolve at Commit.
    for (const auto& q : qs) ASSERT_TRUE(w->AddQuantized(q).ok()) << q.name;
    ASSERT_TRUE(w->AddTensor("mlp.fc1.weight.row", DType::kF8_E4M3FN, {64, 96}, row_data.data(),
                             row_data.size())
                    .ok());
    ASSERT_TRUE(w->AddTensor("mlp.fc1.weight.col", DType::kF8_E4M3FN, {96, 64}, col_data.data(),
                             col_data.size(), Encoding::kZstd)
                    .ok());
    ASSERT_TRUE(w->AddTensor("mlp.fc1.weight.row_scale_inv", DType::kF8_E8M0FNU, {128, 4},
                             row_scale.data(), row_scale.size())
                    .ok());
    ASSERT_TRUE(w->AddTensor("mlp.fc1.weight.col_scale_inv", DType::kF8_E8M0FNU, {4, 96},
                             col_scale.data(), col_scale.size())
                    .ok());
    ASSERT_TRUE(
        w->AddTensor("mlp.fc2.weight.data", DType::kF8_E5M2, {32, 32}, fp8.data(), fp8.size())
            .ok());
    ASSERT_TRUE(w->AddTensor("mlp.fc2.weight.scale_inv", DType::kF32, {1}, &scale_inv, 4).ok());
    ASSERT_TRUE(w->AddTensor("mlp.fc2.weight.amax", DType::kF32, {}, &amax, 4).ok());
    ASSERT_TRUE(
        w->AddTensor("mlp.fc3.weight.fp4", DType::kF4_E2M1FN, {16, 32}, fp4.data(), fp4.size())
            .ok());
    ASSERT_TRUE(w->AddTensor("mlp.fc3.weight.fp4_scales", DType::kF8_E4M3FN, {16, 2},
                             fp4_scales.data(), fp4_scales.size())
                    .ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  auto r = OpenOrDie(path, {.verify_on_open = true});
  ASSERT_TRUE(r);
  auto got = r->quantized();
  ASSERT_EQ(got.size(), qs.size());
  for (size_t i = 0; i < qs.size(); ++i) EXPECT_EQ(got[i], qs[i]) << qs[i].name;
  EXPECT_FALSE(got[0].rowwise->amax.size());
  EXPECT_FALSE(got[2].rowwise.has_value());
  EXPECT_EQ(got[2].columnwise->scale_layout, ScaleLayout::kSwizzled);
  // Component bytes come back through the ordinary tensor path.
  std::vector<uint8_t> out(col_data.size());
  ASSERT_TRUE(r->ReadInto(got[0].columnwise->data, out.data(), out.size(), {true}).ok());
  EXPECT_EQ(out, col_data);
  float amax_out = 0;
  ASSERT_TRUE(r->ReadInto(got[1].rowwise->amax, &amax_out, 4, {true}).ok());
  EXPECT_EQ(amax_out, 7.5f);
}

TEST(FormatTest, QuantizedErrors) {
  TempDir dir;
  auto w = Writer::Create(dir.File("q.ferry"), Scratch());
  ASSERT_TRUE(w.ok());
  QuantizedTensor q;
  q.name = "q";
  q.shape = {4, -1};
  Status st = w->AddQuantized(q);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("quantized tensor 'q': bad shape"), std::string::npos);
  q.shape = {4, 4};
  q.rowwise = QuantizedComponent{};
  st = w->AddQuantized(q);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("needs a data tensor"), std::string::npos) << st.message();
  q.rowwise->data = "d";
  ASSERT_TRUE(w->AddQuantized(q).ok());
  st = w->AddQuantized(q);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("duplicate quantized tensor 'q'"), std::string::npos);
}

class RowsTest : public ::testing::TestWithParam<Encoding> {};

TEST_P(RowsTest, ReadRowsInto) {
  TempDir dir;
  std::string path = dir.File("rows.ferry");
  // 100 rows of 37 F32 = 148 bytes per row: rows straddle the 4096-byte blocks.
  constexpr int64_t kRows = 100, kCols = 37;
  auto data = RandomBytes(kRows * kCols * 4, 11);
  // Low-entropy rows so zstd actually compresses (STORED chunks would hide the decoder).
  std::vector<uint8_t> smooth(kRows * kCols * 2);
  for (size_t i = 0; i < smooth.size(); ++i) smooth[i] = static_cast<uint8_t>((i / 64) % 7);
  auto fp4_even = RandomBytes(10 * 6 / 2, 12);      // [10, 6]: 3 bytes per row
  auto fp4_odd = RandomBytes((9 * 5 + 1) / 2, 13);  // [9, 5]: rows split bytes
  {
    auto w = Writer::Create(path, Scratch(4096));
    ASSERT_TRUE(w.ok());
    Encoding enc = GetParam();
    ASSERT_TRUE(w->AddTensor("w", DType::kF32, {kRows, kCols}, data.data(), data.size(), enc).ok());
    ASSERT_TRUE(
        w->AddTensor("s", DType::kBF16, {kRows, kCols}, smooth.data(), smooth.size(), enc).ok());
    ASSERT_TRUE(
        w->AddTensor("fp4_even", DType::kF4_E2M1FN, {10, 6}, fp4_even.data(), fp4_even.size(), enc)
            .ok());
    ASSERT_TRUE(
        w->AddTensor("fp4_odd", DType::kF4_E2M1FN, {9, 5}, fp4_odd.data(), fp4_odd.size(), enc)
            .ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  auto r = OpenOrDie(path);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->Find("w")->encoding, GetParam());
  const uint64_t row = kCols * 4;
  const std::vector<std::pair<int64_t, int64_t>> ranges = {
      {0, kRows}, {0, 1}, {27, 28}, {27, 56}, {50, 100}, {99, 100}, {13, 13}, {0, 0}, {100, 100}};
  for (auto [b, e] : ranges) {
    for (bool verify : {false, true}) {
      std::vector<uint8_t> out((e - b) * row + 1, 0xEE);
      Status st = r->ReadRowsInto("w", b, e, out.data(), out.size() - 1, {verify});
      ASSERT_TRUE(st.ok()) << st.ToString();
      EXPECT_EQ(std::memcmp(out.data(), data.data() + b * row, (e - b) * row), 0)
          << "rows " << b << ".." << e;
      EXPECT_EQ(out.back(), 0xEE) << "wrote past the rows";
      // One spare byte keeps data() non-null for empty ranges (memcmp must not see null).
      std::vector<uint8_t> sout((e - b) * kCols * 2 + 1);
      ASSERT_TRUE(r->ReadRowsInto("s", b, e, sout.data(), sout.size() - 1, {verify}).ok());
      EXPECT_EQ(std::memcmp(sout.data(), smooth.data() + b * kCols * 2, sout.size() - 1), 0);
    }
  }
  std::vector<uint8_t> out(4);
  ASSERT_TRUE(r->ReadRowsInto("fp4_even", 4, 5, out.data(), 3, {true}).ok());
  EXPECT_EQ(std::memcmp(out.data(), fp4_even.data() + 12, 3), 0);
  Status st = r->ReadRowsInto("fp4_odd", 2, 4, out.data(), out.size());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find(path), std::string::npos);
  EXPECT_NE(st.message().find("tensor 'fp4_odd'"), std::string::npos);
  EXPECT_NE(st.message().find("odd number of packed FP4"), std::string::npos) << st.message();
  // The whole odd tensor is still readable.
  std::vector<uint8_t> whole(fp4_odd.size());
  ASSERT_TRUE(r->ReadInto("fp4_odd", whole.data(), whole.size(), {true}).ok());
  EXPECT_EQ(whole, fp4_odd);

  for (auto [b, e] : std::vector<std::pair<int64_t, int64_t>>{{-1, 2}, {5, 4}, {0, 101}}) {
    std::vector<uint8_t> big(kRows * row);
    st = r->ReadRowsInto("w", b, e, big.data(), big.size());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << b << ".." << e;
    EXPECT_NE(st.message().find("outside [0, 100)"), std::string::npos) << st.message();
  }
  std::vector<uint8_t> small(row * 2 - 1);
  st = r->ReadRowsInto("w", 3, 5, small.data(), small.size());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("rows need 296 bytes, destination holds 295"), std::string::npos)
      << st.message();
  st = r->ReadRowsInto("nope", 0, 1, small.data(), small.size());
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
}

INSTANTIATE_TEST_SUITE_P(Encodings, RowsTest,
                         ::testing::Values(Encoding::kRaw, Encoding::kZstd, Encoding::kShuffleZstd,
                                           Encoding::kPlanes),
                         [](const auto& info) {
                           return std::string(info.param == Encoding::kRaw      ? "Raw"
                                              : info.param == Encoding::kZstd   ? "Zstd"
                                              : info.param == Encoding::kPlanes ? "Planes"
                                                                                : "ShuffleZstd");
                         });

TEST(FormatTest, ReadIntoChecksDestination) {
  TempDir dir;
  std::string path = dir.File("dst.ferry");
  auto data = RandomBytes(64, 1);
  {
    auto w = Writer::Create(path, Scratch());
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->AddTensor("x", DType::kI16, {32}, data.data(), data.size()).ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  auto r = OpenOrDie(path);
  ASSERT_TRUE(r);
  std::vector<uint8_t> out(63);
  Status st = r->ReadInto("x", out.data(), out.size());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find(path + ": tensor 'x': needs 64 bytes, destination holds 63"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(r->ReadInto("x", nullptr, 64).code(), StatusCode::kInvalidArgument);
  // A larger destination is fine; only nbytes are written.
  std::vector<uint8_t> larger(100, 0xAB);
  ASSERT_TRUE(r->ReadInto("x", larger.data(), larger.size()).ok());
  EXPECT_EQ(std::memcmp(larger.data(), data.data(), 64), 0);
  EXPECT_EQ(larger[64], 0xAB);
  st = r->ReadInto("y", out.data(), out.size());
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_NE(st.message().find(path + ": no tensor named 'y'"), std::string::npos) << st.message();
}

TEST(FormatTest, ViewOutlivesReader) {
  TempDir dir;
  std::string path = dir.File("view.ferry");
  auto data = RandomBytes(3 * 4096 + 100, 5);
  {
    auto w = Writer::Create(path, Scratch(4096));
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->AddTensor("raw", DType::kU8, {static_cast<int64_t>(data.size())}, data.data(),
                             data.size())
                    .ok());
    ASSERT_TRUE(w->AddTensor("packed", DType::kU8, {static_cast<int64_t>(data.size())}, data.data(),
                             data.size(), Encoding::kZstd)
                    .ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  HostView view;
  {
    auto r = OpenOrDie(path);
    ASSERT_TRUE(r);
    auto v = r->View("raw", {true});
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    view = *v;
    EXPECT_EQ(view.info.name, "raw");
    EXPECT_EQ(view.info.data_offset, 4096u);
    // Zero copy: the view points into the file mapping at the tensor's offset.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(view.data) % 4096, 0u);
    auto enc = r->View("packed");
    EXPECT_EQ(enc.status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(enc.status().message().find("tensor 'packed': is stored zstd"), std::string::npos)
        << enc.status().message();
    EXPECT_EQ(r->View("none").status().code(), StatusCode::kNotFound);
  }
  // The Reader is gone (and the file unlinked): the mapping must still be readable.
  std::filesystem::remove(path);
  ASSERT_EQ(view.nbytes, data.size());
  EXPECT_EQ(std::memcmp(view.data, data.data(), data.size()), 0);
  HostView copy = view;
  view = HostView{};
  EXPECT_EQ(std::memcmp(copy.data, data.data(), data.size()), 0);
}

TEST(FormatTest, WriterRejectsBadTensors) {
  TempDir dir;
  std::string path = dir.File("errors.ferry");
  auto w = Writer::Create(path, Scratch());
  ASSERT_TRUE(w.ok());
  std::vector<uint8_t> buf(64);
  ASSERT_TRUE(w->AddTensor("x", DType::kF32, {2, 3}, buf.data(), 24).ok());

  Status st = w->AddTensor("x", DType::kF32, {2, 3}, buf.data(), 24);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), path + ": duplicate tensor 'x'");

  st = w->AddTensor("neg", DType::kF32, {2, -3}, buf.data(), 24);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("tensor 'neg': shape has a negative dim"), std::string::npos)
      << st.message();

  st = w->AddTensor("huge", DType::kF32, {int64_t{1} << 40, int64_t{1} << 40}, buf.data(), 24);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("overflows"), std::string::npos) << st.message();

  st = w->AddTensor("dims", DType::kU8, std::vector<int64_t>(65, 1), buf.data(), 1);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("65 dims (limit 64)"), std::string::npos) << st.message();

  st = w->AddTensor("short", DType::kF32, {2, 3}, buf.data(), 20);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), path + ": tensor 'short': F32 shape needs 24 bytes, got 20");

  st = w->AddTensor("fp4", DType::kF4_E2M1FN, {3, 3}, buf.data(), 9);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("needs 5 bytes, got 9"), std::string::npos) << st.message();

  st = w->AddTensor("null", DType::kU8, {4}, nullptr, 4);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);

  st = w->AddTensor("", DType::kU8, {1}, buf.data(), 1);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("empty tensor name"), std::string::npos);

  st = w->AddTensor(std::string("a\0b", 3), DType::kU8, {1}, buf.data(), 1);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("contains a NUL byte"), std::string::npos);

  st = w->AddTensor("dtype", static_cast<DType>(99), {1}, buf.data(), 1);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("unknown dtype 99"), std::string::npos);

  st = w->AddTensor("enc", DType::kU8, {1}, buf.data(), 1, static_cast<Encoding>(9));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("unknown encoding 9"), std::string::npos);

  // Rejected tensors leave no trace: the checkpoint holds only "x".
  ASSERT_TRUE(w->Commit().ok());
  auto r = OpenOrDie(path);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->names(), std::vector<std::string>{"x"});
  // A spent writer refuses more work.
  st = w->AddTensor("y", DType::kU8, {1}, buf.data(), 1);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("already committed"), std::string::npos);
  EXPECT_EQ(w->Commit().code(), StatusCode::kInvalidArgument);
}

TEST(FormatTest, WriterRejectsBadOptions) {
  TempDir dir;
  WriterOptions o;
  o.block_size = 5000;
  auto w = Writer::Create(dir.File("a.ferry"), o);
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(w.status().message().find("block_size 5000 must be a power of two"), std::string::npos);
  o.block_size = 2048;
  EXPECT_EQ(Writer::Create(dir.File("a.ferry"), o).status().code(), StatusCode::kInvalidArgument);
  o = WriterOptions{};
  o.min_savings = 1.0;
  EXPECT_EQ(Writer::Create(dir.File("a.ferry"), o).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Writer::Create("").status().code(), StatusCode::kInvalidArgument);
  auto missing_dir = Writer::Create(dir.File("no/such/dir.ferry"));
  // An I/O error (Python's OSError), not a missing checkpoint.
  EXPECT_EQ(missing_dir.status().code(), StatusCode::kIoError);
  EXPECT_NE(missing_dir.status().message().find(dir.File("no/such/dir.ferry")), std::string::npos);
  EXPECT_TRUE(DirEntries(dir.path()).empty());
}

TEST(FormatTest, QuantizedMissingTensorFailsCommit) {
  TempDir dir;
  std::string path = dir.File("q.ferry");
  auto w = Writer::Create(path, Scratch());
  ASSERT_TRUE(w.ok());
  std::vector<uint8_t> buf(16);
  ASSERT_TRUE(w->AddTensor("q.data", DType::kF8_E4M3FN, {4, 4}, buf.data(), 16).ok());
  QuantizedTensor q;
  q.name = "q";
  q.shape = {4, 4};
  q.rowwise = QuantizedComponent{"q.data", "q.scale_inv", ScaleLayout::kRowMajor, ""};
  ASSERT_TRUE(w->AddQuantized(q).ok());
  Status st = w->Commit();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(),
            path + ": quantized tensor 'q' refers to tensor 'q.scale_inv', which was not added");
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_TRUE(DirEntries(dir.path()).empty()) << "temporary file left behind";
}

std::string WriteSingle(const std::string& path, const std::string& name, uint64_t seed) {
  auto w = Writer::Create(path, Scratch());
  if (!w.ok()) return w.status().ToString();
  auto bytes = RandomBytes(256, seed);
  Status st = w->AddTensor(name, DType::kU8, {256}, bytes.data(), bytes.size());
  if (st.ok()) st = w->Commit();
  return st.ok() ? "" : st.ToString();
}

void ExpectSingle(const std::string& path, const std::string& name, uint64_t seed) {
  auto r = OpenOrDie(path, {.verify_on_open = true});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->names(), std::vector<std::string>{name});
  std::vector<uint8_t> out(256);
  ASSERT_TRUE(r->ReadInto(name, out.data(), out.size()).ok());
  EXPECT_EQ(out, RandomBytes(256, seed));
}

TEST(FormatTest, AtomicCommit) {
  TempDir dir;
  std::string path = dir.File("ckpt.ferry");
  ASSERT_EQ(WriteSingle(path, "old", 1), "");
  ExpectSingle(path, "old", 1);
  std::vector<uint8_t> big = RandomBytes(1 << 16, 9);

  {
    // Explicit abort after data was streamed: the temporary file exists, then vanishes.
    auto w = Writer::Create(path, Scratch());
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->AddTensor("new", DType::kU8, {1 << 16}, big.data(), big.size()).ok());
    EXPECT_EQ(DirEntries(dir.path()).size(), 2u);
    w->Abort();
    w->Abort();  // idempotent
    EXPECT_EQ(w->Commit().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(DirEntries(dir.path()), std::set<std::string>{"ckpt.ferry"});
  ExpectSingle(path, "old", 1);

  {
    // Destroyed without Commit.
    auto w = Writer::Create(path, Scratch());
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->AddTensor("new", DType::kU8, {1 << 16}, big.data(), big.size()).ok());
  }
  EXPECT_EQ(DirEntries(dir.path()), std::set<std::string>{"ckpt.ferry"});
  ExpectSingle(path, "old", 1);

  {
    // A Commit that fails validation.
    auto w = Writer::Create(path, Scratch());
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->AddTensor("new", DType::kU8, {1 << 16}, big.data(), big.size()).ok());
    QuantizedTensor q;
    q.name = "q";
    q.rowwise = QuantizedComponent{"missing", "", ScaleLayout::kRowMajor, ""};
    ASSERT_TRUE(w->AddQuantized(q).ok());
    EXPECT_FALSE(w->Commit().ok());
  }
  EXPECT_EQ(DirEntries(dir.path()), std::set<std::string>{"ckpt.ferry"});
  ExpectSingle(path, "old", 1);

  {
    // A source that fails midway.
    auto w = Writer::Create(path, Scratch(4096));
    ASSERT_TRUE(w.ok());
    FillFn fill = [](uint64_t offset, void* dst, size_t size) {
      if (offset >= 8192) return Status(StatusCode::kIoError, "device went away");
      std::memset(dst, 1, size);
      return Status::Ok();
    };
    Status st = w->AddTensorFrom("pulled", DType::kU8, {20000}, fill, Encoding::kRaw);
    EXPECT_EQ(st.code(), StatusCode::kIoError);
    EXPECT_EQ(st.message(),
              path + ": tensor 'pulled': source failed at byte 8192: device went away");
  }
  EXPECT_EQ(DirEntries(dir.path()), std::set<std::string>{"ckpt.ferry"});
  ExpectSingle(path, "old", 1);

  // A reader of the old file keeps its data while a new commit replaces the path.
  auto old_reader = OpenOrDie(path);
  ASSERT_TRUE(old_reader);
  ASSERT_EQ(WriteSingle(path, "new", 2), "");
  EXPECT_EQ(DirEntries(dir.path()), std::set<std::string>{"ckpt.ferry"});
  ExpectSingle(path, "new", 2);
  std::vector<uint8_t> out(256);
  ASSERT_TRUE(old_reader->ReadInto("old", out.data(), out.size(), {true}).ok());
  EXPECT_EQ(out, RandomBytes(256, 1));
}

TEST(FormatTest, DurableCommit) {
  TempDir dir;
  std::string path = dir.File("durable.ferry");
  auto w = Writer::Create(path);  // durable by default: fsync of file and directory
  ASSERT_TRUE(w.ok());
  uint16_t v = 0xBEEF;
  ASSERT_TRUE(w->AddTensor("v", DType::kU16, {}, &v, 2).ok());
  EXPECT_EQ(w->path(), path);
  ASSERT_TRUE(w->Commit().ok());
  EXPECT_EQ(DirEntries(dir.path()), std::set<std::string>{"durable.ferry"});
  auto r = OpenOrDie(path);
  ASSERT_TRUE(r);
  uint16_t out = 0;
  ASSERT_TRUE(r->ReadInto("v", &out, 2).ok());
  EXPECT_EQ(out, 0xBEEF);
}

TEST(FormatTest, AddTensorFromStreamsBlocks) {
  TempDir dir;
  std::string path = dir.File("pulled.ferry");
  auto data = RandomBytes(3 * 4096 + 17, 3);
  for (Encoding enc : {Encoding::kRaw, Encoding::kZstd, Encoding::kShuffleZstd}) {
    std::vector<std::pair<uint64_t, size_t>> calls;
    {
      auto w = Writer::Create(path, Scratch(4096));
      ASSERT_TRUE(w.ok());
      FillFn fill = [&](uint64_t offset, void* dst, size_t size) {
        calls.emplace_back(offset, size);
        std::memcpy(dst, data.data() + offset, size);
        return Status::Ok();
      };
      ASSERT_TRUE(
          w->AddTensorFrom("t", DType::kU8, {static_cast<int64_t>(data.size())}, fill, enc).ok());
      ASSERT_TRUE(w->Commit().ok());
    }
    std::vector<std::pair<uint64_t, size_t>> expect = {
        {0, 4096}, {4096, 4096}, {8192, 4096}, {12288, 17}};
    EXPECT_EQ(calls, expect);
    auto r = OpenOrDie(path);
    ASSERT_TRUE(r);
    std::vector<uint8_t> out(data.size());
    ASSERT_TRUE(r->ReadInto("t", out.data(), out.size(), {true}).ok());
    EXPECT_EQ(out, data);
  }
}

TEST(FormatTest, VerifyCatchesFlippedDataByte) {
  TempDir dir;
  std::string path = dir.File("flip.ferry");
  auto data = RandomBytes(3 * 4096, 21);
  std::vector<uint8_t> smooth(3 * 4096);
  for (size_t i = 0; i < smooth.size(); ++i) smooth[i] = static_cast<uint8_t>(i / 100);
  {
    auto w = Writer::Create(path, Scratch(4096));
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(
        w->AddTensor("layers.0.weight", DType::kF32, {3, 1024}, data.data(), data.size()).ok());
    ASSERT_TRUE(w->AddTensor("packed", DType::kU8, {3 * 4096}, smooth.data(), smooth.size(),
                             Encoding::kZstd)
                    .ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  auto bytes = ReadFileBytes(path);
  uint64_t offset;
  {
    auto r = OpenOrDie(path);
    ASSERT_TRUE(r);
    offset = r->Find("layers.0.weight")->data_offset;
  }
  bytes[offset + 4096 + 1000] ^= 0x01;  // block 1 of the raw tensor
  WriteFileBytes(path, bytes);

  auto r = OpenOrDie(path);  // the index is intact, so open succeeds
  ASSERT_TRUE(r);
  std::vector<uint8_t> out(data.size());
  Status st = r->ReadInto("layers.0.weight", out.data(), out.size(), {true});
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find(path + ": tensor 'layers.0.weight'"), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("checksum mismatch in block 1"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("raw bytes [4096, 8192)"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("stored at file offset " + std::to_string(offset + 4096)),
            std::string::npos)
      << st.message();

  // Without verification the bytes are returned as stored.
  ASSERT_TRUE(r->ReadInto("layers.0.weight", out.data(), out.size()).ok());
  EXPECT_EQ(out[4096 + 1000], data[4096 + 1000] ^ 0x01);
  // Rows that avoid the damaged block verify cleanly; rows touching it do not.
  ASSERT_TRUE(r->ReadRowsInto("layers.0.weight", 0, 1, out.data(), out.size(), {true}).ok());
  ASSERT_TRUE(r->ReadRowsInto("layers.0.weight", 2, 3, out.data(), out.size(), {true}).ok());
  EXPECT_EQ(r->ReadRowsInto("layers.0.weight", 1, 2, out.data(), out.size(), {true}).code(),
            StatusCode::kDataLoss);
  EXPECT_EQ(r->View("layers.0.weight", {true}).status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(r->View("layers.0.weight").ok());
  st = r->Verify("layers.0.weight");
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("block 1"), std::string::npos);
  EXPECT_TRUE(r->Verify("packed").ok());
  EXPECT_EQ(r->VerifyAll().code(), StatusCode::kDataLoss);
  auto on_open = Reader::Open(path, {.verify_on_open = true});
  EXPECT_EQ(on_open.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(on_open.status().message().find("'layers.0.weight'"), std::string::npos);
}

TEST(FormatTest, VerifyCatchesFlippedCompressedByte) {
  TempDir dir;
  std::string path = dir.File("flipz.ferry");
  std::vector<uint8_t> smooth(3 * 4096);
  for (size_t i = 0; i < smooth.size(); ++i) smooth[i] = static_cast<uint8_t>((i / 100) * 3);
  {
    auto w = Writer::Create(path, Scratch(4096));
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(
        w->AddTensor("z", DType::kU8, {3 * 4096}, smooth.data(), smooth.size(), Encoding::kZstd)
            .ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  auto clean = ReadFileBytes(path);
  TensorInfo info;
  {
    auto r = OpenOrDie(path);
    ASSERT_TRUE(r);
    info = *r->Find("z");
    ASSERT_LT(info.data_size, smooth.size()) << "expected zstd to compress";
  }
  // Whatever stored byte is damaged, a verified read reports DataLoss naming the tensor (a
  // broken frame fails in zstd, a frame that still decodes fails the checksum).
  for (uint64_t k = 0; k < info.data_size; ++k) {
    auto bytes = clean;
    bytes[info.data_offset + k] ^= 0x20;
    WriteFileBytes(path, bytes);
    auto r = OpenOrDie(path);
    ASSERT_TRUE(r);
    std::vector<uint8_t> out(smooth.size());
    Status st = r->ReadInto("z", out.data(), out.size(), {true});
    if (st.ok()) {
      // zstd may ignore some bits (e.g. unused header flags); then the data must be intact.
      EXPECT_EQ(out, smooth) << "byte " << k;
      continue;
    }
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
    EXPECT_NE(st.message().find(path + ": tensor 'z'"), std::string::npos) << st.message();
  }
}

}  // namespace
}  // namespace ferry
