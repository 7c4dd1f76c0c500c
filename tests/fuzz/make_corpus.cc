// Writes the seed corpus of the fuzz targets: small valid checkpoints and safetensors files of
// many shapes, dtypes and encodings, and well-formed zstd chunks. Deterministic, so the
// committed corpus only changes when the format or the writer does.
//   ferry_fuzz_corpus OUT_DIR     (writes OUT_DIR/{footer,load,chunk,safetensors,planes}/)
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "codec/codec.hpp"
#include "codec/planes.hpp"
#include "ferry/ferry.hpp"
#include "format/safetensors.hpp"

namespace fs = std::filesystem;
using namespace ferry;

namespace {

fs::path g_out;

[[noreturn]] void Die(const Status& st, const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", what.c_str(), st.ToString().c_str());
  std::exit(1);
}

std::vector<uint8_t> Bytes(size_t n, uint64_t seed, bool compressible) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = static_cast<uint8_t>(rng());
    // Weights-like: low-entropy high bytes, so zstd chunks really are compressed.
    if (compressible && i % 2 == 1) out[i] &= 0x0f;
  }
  return out;
}

struct Spec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  Encoding encoding = Encoding::kRaw;
  bool compressible = true;
};

std::vector<uint8_t> ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

void Put(const std::string& target, const std::string& name, const std::vector<uint8_t>& bytes) {
  fs::create_directories(g_out / target);
  std::ofstream out(g_out / target / name, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

// A checkpoint with `specs` (and, when `extras`, quantized tensors, scaling states and
// metadata) seeds both the footer and the full-load targets.
void Checkpoint(const std::string& name, const std::vector<Spec>& specs, bool extras = false) {
  fs::path tmp = fs::temp_directory_path() / ("ferry_seed_" + name);
  WriterOptions o;
  o.block_size = 4096;  // the minimum: small tensors still span several blocks and chunks
  o.producer = "seed";
  o.durable = false;
  o.threads = 1;
  auto w = Writer::Create(tmp.string(), o);
  if (!w.ok()) Die(w.status(), name);
  uint64_t seed = 1;
  for (const Spec& s : specs) {
    uint64_t n = *StorageBytes(s.dtype, *NumElements(s.shape));
    auto data = Bytes(n, seed++, s.compressible);
    Status st = w->AddTensor(s.name, s.dtype, s.shape, data.data(), n, s.encoding);
    if (!st.ok()) Die(st, name + "/" + s.name);
  }
  if (extras) {
    QuantizedTensor q;
    q.name = "layer.weight";
    q.quantized_dtype = DType::kF8_E4M3FN;
    q.logical_dtype = DType::kBF16;
    q.shape = {4, 32};
    q.scaling_mode = ScalingMode::kMxfp8_1x32;
    q.rowwise = QuantizedComponent{"q.data", "q.scale_inv", ScaleLayout::kRowMajor, ""};
    q.columnwise = QuantizedComponent{"q.data", "", ScaleLayout::kSwizzled, "q.amax"};
    if (Status st = w->AddQuantized(q); !st.ok()) Die(st, name);
    ScalingState delayed{"attn", DelayedScaling{}, {}};
    DirectionState fwd;
    fwd.slot_roles = {SlotRole::kInput, SlotRole::kWeight, SlotRole::kOutput};
    fwd.scale = {1.0f, 2.0f, 0.5f};
    fwd.history_len = 2;
    fwd.amax_history = {1, 2, 3, 4, 5, 6};
    DirectionState bwd;
    bwd.direction = Direction::kBackward;
    bwd.slot_roles = {SlotRole::kGradOutput, SlotRole::kGradInput};
    bwd.scale = {1.0f, 1.0f};
    bwd.history_len = 1;
    bwd.amax_history = {7, 8};
    delayed.states = {fwd, bwd};
    const std::vector<ScalingState> states = {
        delayed,
        {"current", Float8CurrentScaling{Fp8Format::kE5M2, true, false}, {}},
        {"custom", CustomRecipe{"mine", "pkg.factory"}, {}},
        {"fp4", NVFP4BlockScaling{true, false, true}, {}},
        {"mx", MXFP8BlockScaling{}, {}},
        {"none", std::monostate{}, {}},
        {"tiles", Float8BlockScaling{}, {}},
    };
    for (const ScalingState& s : states) {
      if (Status st = w->AddScalingState(s); !st.ok()) Die(st, name + "/" + s.module);
    }
    for (const char* k : {"config", "step", "producer.framework"}) {
      if (Status st = w->SetMetadata(k, std::string(k) + "-value"); !st.ok()) Die(st, name);
    }
  }
  if (Status st = w->Commit(); !st.ok()) Die(st, name);
  auto bytes = ReadAll(tmp);
  fs::remove(tmp);
  Put("footer", name, bytes);
  Put("load", name, bytes);
}

void Safetensors(const std::string& name, const std::vector<SafetensorsEntry>& entries,
                 const std::vector<std::pair<std::string, std::string>>& metadata) {
  fs::path tmp = fs::temp_directory_path() / ("ferry_seed_" + name);
  auto w = SafetensorsWriter::Create(tmp.string(), entries, metadata, false);
  if (!w.ok()) Die(w.status(), name);
  auto data = Bytes(w->data_bytes(), 7, true);
  if (Status st = w->Write(data.data(), data.size()); !st.ok()) Die(st, name);
  if (Status st = w->Commit(); !st.ok()) Die(st, name);
  auto bytes = ReadAll(tmp);
  fs::remove(tmp);
  Put("safetensors", name, bytes);
  Put("load", name, bytes);  // the Reader opens safetensors files too
}

// Chunk target input: u8 mode (0x80: stored, else zstd; low bits: element width), u32 raw
// size, then the chunk.
void Chunk(const std::string& name, uint8_t width, const std::vector<uint8_t>& raw, bool zstd) {
  std::vector<uint8_t> shuffled(raw.size());
  Shuffle(raw.data(), shuffled.data(), raw.size(), width);
  std::vector<uint8_t> out(5);
  out[0] = static_cast<uint8_t>(width | (zstd ? 0 : 0x80));
  uint32_t n = static_cast<uint32_t>(raw.size());
  std::memcpy(out.data() + 1, &n, 4);
  if (zstd) {
    std::vector<uint8_t> frame(CompressBound(raw.size()));
    auto size = ZstdCompress(shuffled.data(), shuffled.size(), frame.data(), frame.size(), 1);
    if (!size.ok()) Die(size.status(), name);
    out.insert(out.end(), frame.begin(), frame.begin() + static_cast<std::ptrdiff_t>(*size));
  } else {
    out.insert(out.end(), shuffled.begin(), shuffled.end());
  }
  Put("chunk", name, out);
}

// Planes target input: u32 raw size, then one PLANES block (always coded, however small).
void PlanesBlock(const std::string& name, size_t width, const std::vector<uint8_t>& raw) {
  std::vector<uint8_t> out(4 + planes::Bound(raw.size())), scratch(raw.size() + 1);
  uint32_t n = static_cast<uint32_t>(raw.size());
  std::memcpy(out.data(), &n, 4);
  size_t m = planes::Encode(raw.data(), raw.size(), width, out.data() + 4, scratch.data(), -1);
  if (m == 0) Die(Status(StatusCode::kInternal, "planes encode"), name);
  out.resize(4 + m);
  Put("planes", name, out);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  g_out = argv[1];
  using E = Encoding;
  Checkpoint("empty.ferry", {});
  Checkpoint("one_u8.ferry", {{"x", DType::kU8, {100}}});
  {
    std::vector<Spec> every;
    for (int d = 0; d < kNumDTypes; ++d) {
      auto dtype = static_cast<DType>(d);
      every.push_back({DTypeName(dtype), dtype, {3, 5}});
    }
    Checkpoint("every_dtype_raw.ferry", every);
  }
  Checkpoint("zstd_blocks.ferry", {{"w", DType::kBF16, {64, 40}, E::kZstd}});
  Checkpoint("shuffle_zstd.ferry", {{"a", DType::kF32, {30, 50}, E::kShuffleZstd},
                                    {"b", DType::kF16, {3000}, E::kShuffleZstd},
                                    {"c", DType::kC128, {300}, E::kShuffleZstd}});
  Checkpoint("planes.ferry", {{"w", DType::kBF16, {40, 128}, E::kPlanes},
                              {"f", DType::kF32, {3000}, E::kPlanes},
                              {"h", DType::kF16, {5, 7}, E::kPlanes},
                              {"noise", DType::kBF16, {3000}, E::kPlanes, false}});
  Checkpoint("stored_chunks.ferry", {{"noise", DType::kU16, {5000}, E::kShuffleZstd, false},
                                     {"noise8", DType::kU8, {5000}, E::kZstd, false}});
  Checkpoint("shapes.ferry", {{"scalar", DType::kF64, {}},
                              {"empty", DType::kF16, {0, 3}},
                              {"empty_zstd", DType::kBF16, {4, 0}, E::kZstd},
                              {"cube", DType::kI32, {2, 3, 4}},
                              {"fp4_odd", DType::kF4_E2M1FN, {7}},
                              {"fp4_rows", DType::kF4_E2M1FN, {6, 4}, E::kShuffleZstd},
                              {"fp6", DType::kF6_E3M2FN, {5}},
                              {"complex", DType::kC64, {2, 2}}});
  Checkpoint("multi_block_raw.ferry",
             {{"long", DType::kU8, {10000}}, {"long2", DType::kI64, {600}}});
  Checkpoint("quantized_scaling_metadata.ferry",
             {{"q.amax", DType::kF32, {1}},
              {"q.data", DType::kF8_E4M3FN, {4, 32}},
              {"q.scale_inv", DType::kF8_E8M0FNU, {4, 1}, E::kZstd}},
             true);

  Safetensors("mixed.safetensors",
              {{"b.bf16", DType::kBF16, {3, 4}},
               {"a.f32", DType::kF32, {2}},
               {"c.u8", DType::kU8, {5}},
               {"d.fp4", DType::kF4_E2M1FN, {2, 4}},
               {"e.scalar", DType::kI64, {}},
               {"f.empty", DType::kF16, {0}}},
              {{"format", "pt"}, {"step", "7"}});
  Safetensors("empty.safetensors", {}, {});
  Safetensors("fp8.safetensors",
              {{"w", DType::kF8_E4M3FN, {4, 8}},
               {"s", DType::kF8_E8M0FNU, {4}},
               {"flag", DType::kBool, {3}}},
              {{"note", "fp8 weights"}});

  for (uint8_t width : {1, 2, 4, 8}) {
    for (size_t n : {0, 17, 4096, 40000}) {
      std::string base = "w" + std::to_string(width) + "_" + std::to_string(n);
      Chunk(base + ".zst", width, Bytes(n, n + width, true), true);
    }
  }
  Chunk("stored_w2.bin", 2, Bytes(300, 3, false), false);
  Chunk("w3_odd.zst", 3, Bytes(1001, 9, true), true);
  PlanesBlock("bf16_two_units.bin", 2, Bytes(2 * 8192 * 2 + 6, 21, true));
  PlanesBlock("f32_partial_unit.bin", 4, Bytes(4 * 1000 + 3, 22, true));
  PlanesBlock("u8_one_unit.bin", 1, Bytes(8192, 23, true));
  PlanesBlock("f64_tail.bin", 8, Bytes(8 * 300 + 5, 24, true));
  PlanesBlock("bf16_tiny.bin", 2, Bytes(10, 25, true));
  return 0;
}
