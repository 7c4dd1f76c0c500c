// Compression ratio and per-core encode/decode throughput of the chunk codecs on normally
// distributed data (weights look like this), with and without the byte shuffle.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "codec/codec.hpp"

namespace {

using namespace ferry;

constexpr size_t kBytes = size_t{64} << 20;
constexpr size_t kBlock = size_t{4} << 20;

uint16_t ToBF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

uint16_t ToF16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

// OCP E4M3FN with round-to-nearest and saturation at 448.
uint8_t ToE4M3(float f) {
  uint8_t sign = std::signbit(f) ? 0x80 : 0;
  float a = std::fabs(f);
  if (a >= 448.f) return sign | 0x7e;
  if (a < std::ldexp(1.f, -9)) return sign;
  int e;
  float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exp = e - 1 + 7;
  if (exp <= 0) {  // subnormal: multiples of 2^-9
    int q = static_cast<int>(std::nearbyint(a / std::ldexp(1.f, -9)));
    return sign | static_cast<uint8_t>(q);
  }
  int q = static_cast<int>(std::nearbyint((m * 2 - 1) * 8));
  if (q == 8) {
    q = 0;
    ++exp;
  }
  if (exp > 15 || (exp == 15 && q == 7)) return sign | 0x7e;
  return sign | static_cast<uint8_t>(exp << 3 | q);
}

// dtype: 0 bf16, 1 fp16, 2 fp32, 3 fp8 e4m3.
const std::vector<uint8_t>& Data(int dtype) {
  static std::vector<uint8_t> cache[4];
  auto& out = cache[dtype];
  if (!out.empty()) return out;
  out.resize(kBytes);
  std::mt19937_64 rng(42);
  std::normal_distribution<float> nd(0.f, 0.02f);  // typical init scale of weights
  size_t width = dtype == 2 ? 4 : dtype == 3 ? 1 : 2;
  for (size_t i = 0; i < kBytes / width; ++i) {
    float v = nd(rng);
    if (dtype == 0) {
      uint16_t b = ToBF16(v);
      std::memcpy(&out[2 * i], &b, 2);
    } else if (dtype == 1) {
      uint16_t h = ToF16(v);
      std::memcpy(&out[2 * i], &h, 2);
    } else if (dtype == 2) {
      std::memcpy(&out[4 * i], &v, 4);
    } else {
      out[i] = ToE4M3(v * 1000.f);  // scaled into E4M3's range, as an FP8 recipe would
    }
  }
  return out;
}

const char* kNames[] = {"bf16", "fp16", "fp32", "fp8_e4m3"};
const size_t kWidths[] = {2, 2, 4, 1};

struct Encoded {
  std::vector<std::vector<uint8_t>> frames;
  size_t stored = 0;
};

Encoded Encode(const std::vector<uint8_t>& data, size_t width, bool shuffle, int level) {
  Encoded e;
  std::vector<uint8_t> tmp(kBlock);
  for (size_t off = 0; off < data.size(); off += kBlock) {
    const uint8_t* in = data.data() + off;
    if (shuffle) {
      Shuffle(in, tmp.data(), kBlock, width);
      in = tmp.data();
    }
    std::vector<uint8_t> frame(CompressBound(kBlock));
    frame.resize(*ZstdCompress(in, kBlock, frame.data(), frame.size(), level));
    e.stored += frame.size();
    e.frames.push_back(std::move(frame));
  }
  return e;
}

// Args: dtype, shuffle, zstd level.
void BM_Encode(benchmark::State& state) {
  int dtype = static_cast<int>(state.range(0));
  bool shuffle = state.range(1) != 0;
  const auto& data = Data(dtype);
  Encoded e;
  for (auto _ : state) e = Encode(data, kWidths[dtype], shuffle, static_cast<int>(state.range(2)));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
  state.counters["ratio"] = static_cast<double>(kBytes) / e.stored;
  state.SetLabel(std::string(kNames[dtype]) + (shuffle ? " shuffle+zstd" : " zstd"));
}

void BM_Decode(benchmark::State& state) {
  int dtype = static_cast<int>(state.range(0));
  bool shuffle = state.range(1) != 0;
  const auto& data = Data(dtype);
  Encoded e = Encode(data, kWidths[dtype], shuffle, static_cast<int>(state.range(2)));
  std::vector<uint8_t> out(kBytes), tmp(kBlock);
  for (auto _ : state) {
    for (size_t b = 0; b < e.frames.size(); ++b) {
      uint8_t* dst = out.data() + b * kBlock;
      uint8_t* target = shuffle ? tmp.data() : dst;
      (void)ZstdDecompressExact(e.frames[b].data(), e.frames[b].size(), target, kBlock);
      if (shuffle) Unshuffle(tmp.data(), dst, kBlock, kWidths[dtype]);
    }
    benchmark::DoNotOptimize(out.data());
  }
  if (out != data) state.SkipWithError("decoded bytes differ");
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
  state.counters["ratio"] = static_cast<double>(kBytes) / e.stored;
  state.SetLabel(std::string(kNames[dtype]) + (shuffle ? " shuffle+zstd" : " zstd"));
}

void BM_Unshuffle(benchmark::State& state) {
  size_t width = static_cast<size_t>(state.range(0));
  std::vector<uint8_t> in(kBlock, 1), out(kBlock);
  for (auto _ : state) {
    Unshuffle(in.data(), out.data(), kBlock, width);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBlock));
}

void Args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"dtype", "shuffle", "level"});
  for (int d = 0; d < 4; ++d) {
    for (int s = 0; s < 2; ++s) {
      if (d == 3 && s == 1) continue;  // one-byte elements: shuffling is the identity
      b->Args({d, s, 3});
    }
  }
  b->Args({0, 1, 1})->Args({0, 1, 9});
  b->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_Encode)->Apply(Args);
BENCHMARK(BM_Decode)->Apply(Args);
BENCHMARK(BM_Unshuffle)->Arg(2)->Arg(4)->Arg(8);

}  // namespace

BENCHMARK_MAIN();
