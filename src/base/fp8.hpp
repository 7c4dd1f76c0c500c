// 8-bit floating point (OCP FP8: E4M3FN and E5M2) from float, as the per-tensor scaled
// conversions of weights make them: round to nearest, ties to even, values beyond the largest
// finite one saturate to it, NaN stays NaN. Used to make fp8 test and benchmark data.
#ifndef FERRY_SRC_BASE_FP8_HPP_
#define FERRY_SRC_BASE_FP8_HPP_

#include <cmath>
#include <cstdint>

namespace ferry {

struct Fp8Layout {
  int exponent_bits, mantissa_bits, bias;
  uint8_t max_finite;  // the code of the largest finite value
};
inline constexpr Fp8Layout kE4M3FN{4, 3, 7, 0x7E};  // largest 448
inline constexpr Fp8Layout kE5M2{5, 2, 15, 0x7B};   // largest 57344

inline float Fp8ToFloat(uint8_t code, const Fp8Layout& f) {
  const int m = code & ((1 << f.mantissa_bits) - 1);
  const int e = (code >> f.mantissa_bits) & ((1 << f.exponent_bits) - 1);
  const float sign = code & 0x80 ? -1.0f : 1.0f;
  if ((code & 0x7F) > f.max_finite) {
    // E5M2 keeps IEEE infinities; every other code past the largest finite one is NaN.
    return f.exponent_bits == 5 && m == 0 ? sign * INFINITY : NAN;
  }
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), 1 - f.bias - f.mantissa_bits);
  return sign *
         std::ldexp(static_cast<float>(m + (1 << f.mantissa_bits)), e - f.bias - f.mantissa_bits);
}

inline uint8_t FloatToFp8(float x, const Fp8Layout& f) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7F;
  const float a = std::fabs(x);
  if (a >= Fp8ToFloat(f.max_finite, f)) return sign | f.max_finite;
  int ex = 0;
  std::frexp(a, &ex);  // a = m * 2^ex, m in [0.5, 1)
  // Codes count quanta: subnormals step by the smallest quantum, each binade by its own; a
  // rounding that carries into the next binade lands on that binade's first code.
  const int biased = ex - 1 + f.bias;
  const int scale = biased <= 0 ? 1 - f.bias - f.mantissa_bits : ex - 1 - f.mantissa_bits;
  const int q = static_cast<int>(std::nearbyint(std::ldexp(a, -scale)));
  const int code = biased <= 0 ? q : ((biased - 1) << f.mantissa_bits) + q;
  return sign | static_cast<uint8_t>(code > f.max_finite ? f.max_finite : code);
}

}  // namespace ferry

#endif  // FERRY_SRC_BASE_FP8_HPP_
