// float <-> float16 / bfloat16 / float8 e4m3 conversion, round-to-nearest-even, NaN
// preserved.
// Used by the reference, the tests and the CLI; the kernels have vector versions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace ropepool {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // subnormal: value = man * 2^-24
    float v = float(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // nan
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {
    // result is subnormal (or zero): round abs / 2^-24 to an integer, ties to even
    const float scaled = bits_float(abs) * 16777216.0f;  // exact: power-of-two scale
    const uint32_t whole = uint32_t(scaled);
    const float frac = scaled - float(whole);
    uint32_t r = whole + ((frac > 0.5f || (frac == 0.5f && (whole & 1u))) ? 1u : 0u);
    return uint16_t(sign | r);
  }
  // normal: rebias exponent, round mantissa from 23 to 10 bits, ties to even
  uint32_t v = abs - 0x38000000u;  // exponent 127 -> 15 bias
  v += 0xfffu + ((v >> 13) & 1u);
  return uint16_t(sign | (v >> 13));
}

/// float8 e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities;
/// NaN = S.1111.111; largest finite 448) to float: exact.
inline float e4m3_to_float(uint8_t b) {
  const int exp = (b >> 3) & 15, man = b & 7;
  float v;
  if (exp == 15 && man == 7) v = NAN;
  else if (exp == 0) v = std::ldexp(float(man), -9);  // subnormal: man * 2^-9
  else v = std::ldexp(float(8 + man), exp - 10);      // (1 + man/8) * 2^(exp-7)
  return (b & 0x80) ? -v : v;
}

/// SPEC §6's rule for float -> e4m3fn: round to nearest even; magnitudes beyond 448,
/// infinities included, saturate to +-448; NaN stays NaN (sign kept). (torch's conversion
/// differs: it turns magnitudes that round beyond 448 into NaN.)
inline uint8_t float_to_e4m3(float f) {
  const uint8_t sign = uint8_t((float_bits(f) >> 24) & 0x80u);
  const float a = std::fabs(f);
  if (std::isnan(f)) return uint8_t(sign | 0x7f);
  if (a > 448.0f) return uint8_t(sign | 0x7e);
  if (a < 0.015625f)  // below 2^-6: subnormal steps of 2^-9 (a * 512 is exact)
    return uint8_t(sign | uint8_t(std::nearbyint(a * 512.0f)));  // 8 is the smallest normal
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): exponent e - 1
  const int exp = e - 1;
  int man = int(std::nearbyint(std::ldexp(a, 3 - exp)));  // 8..16, exact before rounding
  int biased = exp + 7;
  if (man == 16) man = 8, ++biased;  // rounded up to the next power of two
  return uint8_t(sign | (biased << 3) | (man - 8));
}

}  // namespace ropepool
