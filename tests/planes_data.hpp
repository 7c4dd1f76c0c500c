// Weight-like test data for the PLANES codec, shared by its tests and its benchmark.
#ifndef FERRY_TESTS_PLANES_DATA_HPP_
#define FERRY_TESTS_PLANES_DATA_HPP_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "base/fp8.hpp"

namespace ferry::testing {

inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline uint16_t FloatToHalf(float f) {
  // Through the compiler's _Float16 where available: exact IEEE rounding.
  _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

// `n` bytes of elements drawn from N(0, stddev), as bf16 (width 2), f16 (width 2, half = true),
// f32 (width 4) or f64 (width 8); a trailing partial element is filled with random bytes.
inline std::vector<uint8_t> NormalWeights(size_t n, size_t width, float stddev, uint64_t seed,
                                          bool half = false) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<uint8_t> out(n);
  size_t count = width ? n / width : 0;
  for (size_t i = 0; i < count; ++i) {
    float v = dist(rng);
    if (width == 2) {
      uint16_t b = half ? FloatToHalf(v) : FloatToBf16(v);
      std::memcpy(&out[i * 2], &b, 2);
    } else if (width == 4) {
      std::memcpy(&out[i * 4], &v, 4);
    } else if (width == 8) {
      double d = v;
      std::memcpy(&out[i * 8], &d, 8);
    } else {
      // One byte: an E4M3-like value, sign, 4 exponent bits around the weight scale, 3 mantissa.
      int e = static_cast<int>(std::floor(std::log2(std::fabs(v) + 1e-30f))) + 14;
      e = e < 0 ? 0 : (e > 15 ? 15 : e);
      out[i] = static_cast<uint8_t>((v < 0) << 7 | e << 3 | (rng() & 7));
    }
  }
  for (size_t i = count * width; i < n; ++i) out[i] = static_cast<uint8_t>(rng());
  return out;
}

// `n` fp8 weights as per-tensor scaled conversions make them: N(0, 1) values whose scale
// varies by row of 1024 (weights after training are not one Gaussian), divided by the largest
// magnitude over the format's largest finite value, rounded to `format`.
inline std::vector<uint8_t> Fp8Weights(size_t n, const Fp8Layout& format, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  float amax = 0, scale = 1;
  for (size_t i = 0; i < n; ++i) {
    if (i % 1024 == 0) scale = std::exp(0.5f * dist(rng));
    v[i] = dist(rng) * scale;
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float to_max = amax > 0 ? Fp8ToFloat(format.max_finite, format) / amax : 1.0f;
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = FloatToFp8(v[i] * to_max, format);
  return out;
}

// Overwrites every 7th element with a special value of its width: NaNs with payloads,
// infinities, subnormals, negative zero, the largest finite values.
inline void SprinkleSpecials(std::vector<uint8_t>& data, size_t width) {
  static const uint16_t k16[] = {0x7fc0, 0xffc1, 0x7f81, 0x7f80, 0xff80, 0x0001, 0x8001,
                                 0x8000, 0x0000, 0x7f7f, 0x007f, 0x7e00, 0xfc00, 0x7c01};
  static const uint32_t k32[] = {0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7f800000u, 0xff800000u,
                                 0x00000001u, 0x807fffffu, 0x80000000u, 0x00000000u, 0x7f7fffffu};
  static const uint64_t k64[] = {0x7ff8000000000001ull, 0xfff0000000000000ull,
                                 0x0000000000000001ull, 0x8000000000000000ull};
  size_t count = data.size() / width;
  for (size_t i = 0, j = 0; i < count; i += 7, ++j) {
    uint8_t* p = &data[i * width];
    if (width == 2) std::memcpy(p, &k16[j % 14], 2);
    if (width == 4) std::memcpy(p, &k32[j % 10], 4);
    if (width == 8) std::memcpy(p, &k64[j % 4], 8);
    if (width == 1) *p = static_cast<uint8_t>(j % 3 == 0 ? 0x7f : (j % 3 == 1 ? 0xff : 0x80));
  }
}

}  // namespace ferry::testing

#endif  // FERRY_TESTS_PLANES_DATA_HPP_
