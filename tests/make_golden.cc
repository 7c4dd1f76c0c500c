// Writes the golden format-v1 checkpoint (tests/data/golden_v1.ferry).
//
// The committed file is the contract: golden_test.cc checks it against constants of its own,
// and this program exists only to document how the file was made. It refuses to overwrite an
// existing file, because a golden file that is regenerated proves nothing about old files. A
// later format version gets a new generator mode and a new file beside this one.
//
// usage: ferry_make_golden <output path>
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"

namespace {

using ferry::DType;
using ferry::Encoding;
using ferry::Status;

template <typename T>
std::vector<uint8_t> Bytes(const std::vector<T>& v) {
  std::vector<uint8_t> out(v.size() * sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

struct Tensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  Encoding encoding;
  std::vector<uint8_t> bytes;
};

std::vector<Tensor> GoldenTensors() {
  std::vector<Tensor> t;
  {
    std::vector<uint16_t> v(16 * 8);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint16_t>(0x3C00 + (i * 37) % 512);
    t.push_back({"embed.weight", DType::kBF16, {16, 8}, Encoding::kRaw, Bytes(v)});
  }
  {
    std::vector<float> v(64 * 40);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((i * 7) % 251) * 0.125f;
    t.push_back({"fc1.weight", DType::kF32, {64, 40}, Encoding::kZstd, Bytes(v)});
  }
  {
    std::vector<uint16_t> v(48 * 64);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint16_t>(0x3F00 | ((i * 13) % 256));
    t.push_back({"fc2.weight", DType::kBF16, {48, 64}, Encoding::kShuffleZstd, Bytes(v)});
  }
  std::vector<uint8_t> fp8(40 * 64);
  for (size_t i = 0; i < fp8.size(); ++i) fp8[i] = static_cast<uint8_t>((i * 29 + 3) % 256);
  t.push_back({"fc1.weight.fp8", DType::kF8_E4M3FN, {40, 64}, Encoding::kRaw, fp8});
  {
    std::vector<uint8_t> tr(64 * 40);
    for (size_t r = 0; r < 64; ++r) {
      for (size_t c = 0; c < 40; ++c) tr[r * 40 + c] = fp8[c * 64 + r];
    }
    t.push_back({"fc1.weight.fp8_t", DType::kF8_E4M3FN, {64, 40}, Encoding::kRaw, tr});
  }
  t.push_back({"fc1.weight.scale_inv",
               DType::kF32,
               {1},
               Encoding::kRaw,
               Bytes(std::vector<float>{0.0078125f})});
  t.push_back(
      {"fc1.weight.amax", DType::kF32, {}, Encoding::kRaw, Bytes(std::vector<float>{3.5f})});
  {
    std::vector<uint8_t> v(15);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>((i * 53 + 1) % 256);
    t.push_back({"fc1.weight.e5m2", DType::kF8_E5M2, {3, 5}, Encoding::kRaw, v});
  }
  {
    std::vector<uint8_t> v(8);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(127 + i);
    t.push_back({"mx.scales", DType::kF8_E8M0FNU, {4, 2}, Encoding::kRaw, v});
  }
  {
    // 15 FP4 elements: element 2j in the low nibble of byte j, the last high nibble zero.
    std::vector<uint8_t> v(8, 0);
    for (size_t i = 0; i < 15; ++i) {
      auto nibble = static_cast<uint8_t>((i * 3 + 1) % 16);
      v[i / 2] |= static_cast<uint8_t>(i % 2 == 0 ? nibble : nibble << 4);
    }
    t.push_back({"nvfp4.weight", DType::kF4_E2M1FN, {3, 5}, Encoding::kRaw, v});
  }
  t.push_back({"counts",
               DType::kI64,
               {5},
               Encoding::kRaw,
               Bytes(std::vector<int64_t>{INT64_MIN, -1, 0, 42, INT64_MAX})});
  {
    std::vector<uint8_t> v(7);
    for (size_t i = 0; i < v.size(); ++i) v[i] = i % 3 == 0 ? 1 : 0;
    t.push_back({"mask", DType::kBool, {7}, Encoding::kRaw, v});
  }
  t.push_back(
      {"pi", DType::kF64, {}, Encoding::kRaw, Bytes(std::vector<double>{3.141592653589793})});
  t.push_back({"empty", DType::kF16, {0, 4}, Encoding::kRaw, {}});
  t.push_back({"z.complex",
               DType::kC64,
               {2},
               Encoding::kRaw,
               Bytes(std::vector<float>{1.0f, 2.0f, -0.5f, 0.25f})});
  t.push_back(
      {"\xC3\xBCn\xC3\xAF"
       "code.\xE6\x9D\x83\xE9\x87\x8D",
       DType::kU8,
       {4},
       Encoding::kRaw,
       {1, 2, 3, 4}});
  return t;
}

Status Write(const std::string& path) {
  ferry::WriterOptions options;
  options.block_size = 4096;
  options.zstd_level = 3;
  options.producer = "tensorferry golden v1";
  auto writer = ferry::Writer::Create(path, options);
  if (!writer.ok()) return writer.status();
  for (const Tensor& t : GoldenTensors()) {
    Status st =
        writer->AddTensor(t.name, t.dtype, t.shape, t.bytes.data(), t.bytes.size(), t.encoding);
    if (!st.ok()) return st;
  }

  ferry::QuantizedTensor q;
  q.name = "fc1.weight.q";
  q.quantized_dtype = DType::kF8_E4M3FN;
  q.logical_dtype = DType::kBF16;
  q.shape = {40, 64};
  q.scaling_mode = ferry::ScalingMode::kPerTensor;
  q.rowwise = ferry::QuantizedComponent{"fc1.weight.fp8", "fc1.weight.scale_inv",
                                        ferry::ScaleLayout::kRowMajor, "fc1.weight.amax"};
  q.columnwise = ferry::QuantizedComponent{"fc1.weight.fp8_t", "fc1.weight.scale_inv",
                                           ferry::ScaleLayout::kRowMajor, ""};
  if (Status st = writer->AddQuantized(q); !st.ok()) return st;

  ferry::ScalingState delayed;
  delayed.module = "layers.0.mlp.fc1";
  delayed.recipe = ferry::DelayedScaling{
      2, ferry::Fp8Format::kE4M3, 4, ferry::AmaxComputeAlgo::kMostRecent, false, true, false};
  ferry::DirectionState fwd;
  fwd.direction = ferry::Direction::kForward;
  fwd.num_gemms = 1;
  fwd.slot_roles = {ferry::SlotRole::kInput, ferry::SlotRole::kWeight, ferry::SlotRole::kOutput};
  fwd.scale = {1.0f, 2.0f, 4.0f};
  fwd.history_len = 4;
  for (int l = 0; l < 4; ++l) {
    for (int s = 0; s < 3; ++s) fwd.amax_history.push_back((l + 1) * 10.0f + s + 0.5f);
  }
  ferry::DirectionState bwd;
  bwd.direction = ferry::Direction::kBackward;
  bwd.num_gemms = 1;
  bwd.slot_roles = {ferry::SlotRole::kGradOutput, ferry::SlotRole::kGradInput};
  bwd.scale = {0.5f, 0.25f};
  bwd.history_len = 4;
  for (int l = 0; l < 4; ++l) {
    for (int s = 0; s < 2; ++s) bwd.amax_history.push_back((l + 1) * 100.0f + s + 0.25f);
  }
  delayed.states = {fwd, bwd};
  if (Status st = writer->AddScalingState(delayed); !st.ok()) return st;

  ferry::ScalingState mx;
  mx.module = "layers.1.mlp.fc1";
  mx.recipe = ferry::MXFP8BlockScaling{};
  if (Status st = writer->AddScalingState(mx); !st.ok()) return st;
  ferry::ScalingState custom;
  custom.module = "zz.custom";
  custom.recipe = ferry::CustomRecipe{"my.Recipe", "my.factory"};
  if (Status st = writer->AddScalingState(custom); !st.ok()) return st;

  for (auto [k, v] : std::vector<std::pair<const char*, const char*>>{
           {"step", "1234"},
           {"config", "{\"layers\": 2, \"hidden\": 64}"},
           {"note", "golden v1 \xE2\x9C\x93"}}) {
    if (Status st = writer->SetMetadata(k, v); !st.ok()) return st;
  }
  return writer->Commit();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <output path>\n", argv[0]);
    return 2;
  }
  struct stat st;
  if (::stat(argv[1], &st) == 0) {
    std::fprintf(stderr,
                 "%s exists: golden files are never regenerated (a new format version gets a "
                 "new file)\n",
                 argv[1]);
    return 1;
  }
  Status status = Write(argv[1]);
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    return 1;
  }
  std::printf("wrote %s\n", argv[1]);
  return 0;
}
