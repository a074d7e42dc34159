// Device helpers of the CUDA backend: raw vector loads/stores (16 bytes on the fast path,
// one element on the fallback), their conversion to and from float32, and the float32 ->
// float8 e4m3fn quantisation of the fp8 pools and q_out (SPEC §6).
//
// Data stays in its raw form (4 registers per 16-byte vector) from the load until the
// rotation needs it, so the loads can be issued before the sin/cos table is ready without
// doubling the registers they occupy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace ropepool::cuda {

/// Element types. `Bits` is the element's storage as an unsigned integer.
struct F32 {
  using Bits = uint32_t;
  static constexpr int kBytes = 4;
};
struct F16 {
  using Bits = uint16_t;
  static constexpr int kBytes = 2;
};
struct BF16 {
  using Bits = uint16_t;
  static constexpr int kBytes = 2;
};

template <int kBytes>
struct RawOf;
template <>
struct RawOf<16> {
  using type = uint4;
};
template <>
struct RawOf<4> {
  using type = uint32_t;
};
template <>
struct RawOf<2> {
  using type = uint16_t;
};

/// kVec consecutive elements of type E moved as one access of kVec * E::kBytes bytes
/// (16 on the vector paths, one element on the scalar fallback).
template <class E, int kVec>
struct VecIO {
  static constexpr int kBytes = kVec * E::kBytes;
  using Raw = typename RawOf<kBytes>::type;
  using Bits = typename E::Bits;

  /// Read-only path (ld.global.nc): q/k/v are never written by this kernel, except in
  /// place by the very thread that read them, after the read.
  static __device__ __forceinline__ Raw load(const Bits* p) {
    return __ldg(reinterpret_cast<const Raw*>(p));
  }
  static __device__ __forceinline__ void store(Bits* p, Raw r) {
    if constexpr (kBytes == 16) {
      // Explicit st.global.v4: a uint4 that reaches the store through a phi (prefetched or
      // reloaded) is otherwise split into four 4-byte stores.
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(r.x), "r"(r.y),
                   "r"(r.z), "r"(r.w)
                   : "memory");
    } else {
      *reinterpret_cast<Raw*>(p) = r;
    }
  }

  static __device__ __forceinline__ void to_float(Raw r, float (&f)[kVec]) {
    if constexpr (kBytes == 16) {
      const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) word_to_float(w[i], f, i);
    } else if constexpr (kBytes == 4) {
      word_to_float(r, f, 0);
    } else {  // one 16-bit element
      f[0] = half_bits_to_float(r);
    }
  }

  /// float16 only: gives NaNs of to_float the sign of their float16 bits (the conversion may
  /// return one canonical NaN). OR-ing the sign bits back in is a no-op for numbers. Used where
  /// an input element is quantised to e4m3 bit-exactly (SPEC §6: NaN stays NaN, sign kept).
  static __device__ __forceinline__ void keep_nan_signs(Raw r, float (&f)[kVec]) {
    static_assert(std::is_same_v<E, F16>, "float32 and bfloat16 widen exactly");
    if constexpr (kBytes == 16) {
      const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(__float_as_uint(f[2 * i]) | ((w[i] & 0x8000u) << 16));
        f[2 * i + 1] = __uint_as_float(__float_as_uint(f[2 * i + 1]) | (w[i] & 0x80000000u));
      }
    } else if constexpr (kBytes == 4) {
      f[0] = __uint_as_float(__float_as_uint(f[0]) | ((r & 0x8000u) << 16));
      f[1] = __uint_as_float(__float_as_uint(f[1]) | (r & 0x80000000u));
    } else {
      f[0] = __uint_as_float(__float_as_uint(f[0]) | ((uint32_t(r) & 0x8000u) << 16));
    }
  }

  static __device__ __forceinline__ Raw from_float(const float (&f)[kVec]) {
    if constexpr (kBytes == 16) {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = float_to_word(f, i);
      return make_uint4(w[0], w[1], w[2], w[3]);
    } else if constexpr (kBytes == 4) {
      return float_to_word(f, 0);
    } else {
      return float_to_half_bits(f[0]);
    }
  }

  /// 16-bit types: element-wise a * b rounded once to nearest even, two elements per
  /// instruction (mul.rn.bf16x2 / mul.rn.f16x2 on sm_90; ptxas issues some as HFMA2 with a -0
  /// addend, the same single rounding). These are the bits of
  /// from_float(to_float(a) * to_float(b)): the exact product of two bfloat16 (8-bit
  /// significands) or float16 (11-bit) elements has at most 22 significant bits, so float32
  /// holds it exactly, except for bfloat16 products of magnitude 2^128 and up (inf in either
  /// way) or with bits below 2^-149, which are then under 2^-134, half the least bfloat16
  /// subnormal, and both ways give a zero of the product's sign. The CUDA test compares the two
  /// on every pair of 16-bit patterns (subnormals, infinities and NaNs included).
  static __device__ __forceinline__ Raw mul_rn(Raw a, Raw b) {
    static_assert(kPerWord == 2 && kBytes == 16, "16-bit elements, 16-byte vectors (the norm's vector paths)");
    return make_uint4(mul_word(a.x, b.x), mul_word(a.y, b.y), mul_word(a.z, b.z), mul_word(a.w, b.w));
  }

 private:
  static __device__ __forceinline__ uint32_t mul_word(uint32_t a, uint32_t b) {
    uint32_t w;
    if constexpr (std::is_same_v<E, BF16>) {
      __nv_bfloat162 x, y;
      memcpy(&x, &a, 4);
      memcpy(&y, &b, 4);
      const __nv_bfloat162 z = __hmul2_rn(x, y);
      memcpy(&w, &z, 4);
    } else {
      __half2 x, y;
      memcpy(&x, &a, 4);
      memcpy(&y, &b, 4);
      const __half2 z = __hmul2_rn(x, y);
      memcpy(&w, &z, 4);
    }
    return w;
  }

  static constexpr int kPerWord = 4 / E::kBytes;  // elements in one 32-bit word (1 or 2)

  static __device__ __forceinline__ void word_to_float(uint32_t w, float (&f)[kVec], int i) {
    if constexpr (kPerWord == 1) {
      f[i] = __uint_as_float(w);
    } else if constexpr (std::is_same_v<E, BF16>) {
      // bfloat16 is the top half of a float32: widening is a shift, exact.
      f[2 * i] = __uint_as_float(w << 16);
      f[2 * i + 1] = __uint_as_float(w & 0xffff0000u);
    } else {
      __half2 h;
      memcpy(&h, &w, 4);
      const float2 v = __half22float2(h);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }

  // One rounding, to nearest even: cvt.rn.{bf16x2,f16x2}.f32 packs two elements at once.
  static __device__ __forceinline__ uint32_t float_to_word(const float (&f)[kVec], int i) {
    if constexpr (kPerWord == 1) {
      return __float_as_uint(f[i]);
    } else if constexpr (std::is_same_v<E, BF16>) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
      uint32_t w;
      memcpy(&w, &h, 4);
      return w;
    } else {
      const __half2 h = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
      uint32_t w;
      memcpy(&w, &h, 4);
      return w;
    }
  }

  static __device__ __forceinline__ float half_bits_to_float(uint16_t b) {
    if constexpr (std::is_same_v<E, BF16>) return __uint_as_float(uint32_t(b) << 16);
    else return __half2float(__ushort_as_half(b));
  }
  static __device__ __forceinline__ uint16_t float_to_half_bits(float x) {
    if constexpr (std::is_same_v<E, BF16>) return __bfloat16_as_ushort(__float2bfloat16_rn(x));
    else return __half_as_ushort(__float2half_rn(x));
  }
};

// ---- float8 e4m3fn (SPEC §6) ---------------------------------------------------------------

/// float -> e4m3fn by SPEC §6's rule in software (round to nearest even, magnitudes beyond 448,
/// infinities included, to +-448, NaN to S.1111.111 with its sign): what ropepool::float_to_e4m3
/// computes on the host. Used where the hardware conversion is missing (before sm_89); the
/// CUDA test checks it on every float32 as well.
__device__ __forceinline__ uint32_t e4m3_soft(float x) {
  const uint32_t u = __float_as_uint(x), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7fu;  // NaN
  if (a > 0x43e00000u) return sign | 0x7eu;  // beyond 448, infinity included
  if (a < 0x3c800000u)                       // below 2^-6: steps of 2^-9 (a * 512 is exact)
    return sign | __float2uint_rn(__uint_as_float(a) * 512.0f);  // 8 is the smallest normal
  // Normal: keep 3 mantissa bits, round the other 20 to nearest even (a carry moves into the
  // exponent), rebias the exponent from 127 to 7.
  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  return sign | ((r >> 20) - (120u << 3));
}

/// Two floats -> two e4m3fn bytes (lo in bits 0-7, hi in bits 8-15), round to nearest even,
/// saturating (cvt...satfinite: beyond 448 and infinities to +-448). The hardware gives every
/// NaN as 0x7f; callers OR in the sign they want (e4m3_quotient).
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return e4m3_soft(lo) | (e4m3_soft(hi) << 8);
#endif
}

/// A float32 scale prepared once for many divisions x / scale (SPEC §6), so that each one is
/// exactly IEEE's round-to-nearest quotient without a division instruction sequence (whose
/// rarely taken slow path is a subroutine call: under the kernels' 64-register cap the call's
/// register saves are what spilled). scale = s * 2^-j with |s| in [1, 2) (sign kept): x / scale
/// = (x * p1 * p2) / s with p1 * p2 = 2^j, and r = RN(1 / s). Zero, infinite and NaN scales
/// are kept so that every quotient is the IEEE one as well (x / 0 = inf, x / inf = 0, NaN).
struct Fp8Divisor {
  float s, r, p1, p2;
};

__device__ __forceinline__ Fp8Divisor fp8_divisor(float scale) {
  const uint32_t u = __float_as_uint(scale), sign = u & 0x80000000u;
  uint32_t a = u & 0x7fffffffu;
  if (a == 0 || a >= 0x7f800000u) {
    // 0: r = inf, every quotient comes from x * r (inf, or NaN for x = 0). inf: s = 1, r = 0, so
    // x / inf = 0 and inf / inf = NaN. NaN: NaN throughout.
    if (a == 0x7f800000u) return {__uint_as_float(sign | 0x3f800000u), __uint_as_float(sign), 1.0f, 1.0f};
    return {scale, a == 0 ? __uint_as_float(sign | 0x7f800000u) : scale, 1.0f, 1.0f};
  }
  int j = 0;
  if (a < 0x00800000u) {  // subnormal: times 2^64 (exact) first
    a = __float_as_uint(__uint_as_float(a) * 0x1p64f);
    j = 64;
  }
  j += 127 - int(a >> 23);  // |scale| * 2^j in [1, 2); j in [-127, 149]
  const float s = __uint_as_float(sign | 0x3f800000u | (a & 0x007fffffu));
  // RN(1 / s): an approximate reciprocal refined once is within an ulp or so; of it and its two
  // neighbours the nearest to 1 / s has the smallest |1 - s * r| (exact through the fma: s and r
  // have 24 bits and the residual is tiny), and 1 / s is never a midpoint, so no ties.
  float r0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(s));
  r0 = fmaf(r0, fmaf(-s, r0, 1.0f), r0);
  float best = r0, err = fabsf(fmaf(-s, r0, 1.0f));
  for (int k = -1; k <= 1; k += 2) {
    const float c = __uint_as_float(__float_as_uint(r0) + uint32_t(k));
    const float e = fabsf(fmaf(-s, c, 1.0f));
    if (e < err) best = c, err = e;
  }
  const int j1 = j / 2;  // 2^j1 and 2^(j - j1) are both normal floats
  return {s, best, __uint_as_float(uint32_t(127 + j1) << 23), __uint_as_float(uint32_t(127 + j - j1) << 23)};
}

/// RN(x / scale) for a prepared scale, where it decides the e4m3 result. y = x * 2^j is exact
/// unless it leaves the normal range, and then the quotient is beyond 2^127 or below 2^-126,
/// which e4m3 saturates or rounds to zero whatever the rounding (the two factors scale in one
/// direction, so an intermediate overflow or underflow means the final one too). For
/// |y / s| <= 2^12, y is normal: q0 = RN(y * r) is within two ulps, one Newton step makes it
/// faithful, and with r = RN(1 / s) the second step gives RN(y / s) (Markstein's theorem; the
/// residuals fma(-q, s, y) are exact). Beyond 2^12 (or infinite, NaN) q0 itself saturates or
/// stays NaN in the conversion. The CUDA test checks this against __fdiv_rn on every float32
/// for many scales.
__device__ __forceinline__ float fp8_quotient(float x, const Fp8Divisor& d) {
  const float y = x * d.p1 * d.p2;
  const float q0 = y * d.r;
  const float q1 = fmaf(fmaf(-q0, d.s, y), d.r, q0);
  const float q2 = fmaf(fmaf(-q1, d.s, y), d.r, q1);
  return fabsf(q0) <= 4096.0f ? q2 : q0;
}

/// A finite, nonzero power-of-two scale: s = r = +-1. Every other prepared scale has s != r
/// (r = RN(1 / s) lies in (1/2, 1) for s in (1, 2); zero gives r = inf, infinity r = 0, NaN is
/// unequal to itself). For such a scale fp8_quotient's residuals are zero, so its Newton steps
/// return q0 = x * p1 * p2 * r unchanged: the quotient is that product alone (vLLM's
/// uncalibrated fp8 cache scale, 1.0, among them).
__device__ __forceinline__ bool fp8_power_of_two(const Fp8Divisor& d) { return d.s == d.r; }

/// e4m3fn bytes of x[i] / scale, i < kN, packed little-endian: the quotient in float32 as IEEE
/// round-to-nearest division gives it (fp8_quotient; kPow2: the product of fp8_power_of_two,
/// the same float), then e4m3x2. Every result keeps the sign
/// of the exact quotient (sign(x) ^ sign(scale)): a no-op for numbers (the conversion keeps
/// it), and NaN keeps its sign for a positive scale, as ropepool::float_to_e4m3(x / scale) does
/// on the host (the GPU returns one canonical NaN).
///
/// Per element, the product path multiplies twice (r, +-1, is folded into p1 before the
/// elements' products: exact, p1 is a power of two); the signs come from the top bytes of x
/// gathered by byte permutes and one xor and mask for all kN.
template <int kN, bool kPow2 = false>
__device__ __forceinline__ uint32_t e4m3_quotient(const float* x, const Fp8Divisor& d) {
  static_assert(kN == 1 || kN == 2 || kN == 4, "up to 4 bytes per word");
  const float p1r = d.p1 * d.r;
  const auto quotient = [&](float v) { return kPow2 ? v * p1r * d.p2 : fp8_quotient(v, d); };
  uint32_t bytes = 0;
#pragma unroll
  for (int i = 0; i < kN; i += 2) {
    const float lo = quotient(x[i]), hi = kN > 1 ? quotient(x[i + 1]) : 0.0f;
    bytes |= e4m3x2(lo, hi) << (8 * i);
  }
  // Byte i of `tops`: the top byte of x[i] (its sign at bit 7).
  uint32_t tops = __float_as_uint(x[0]) >> 24;
  if constexpr (kN >= 2) tops = __byte_perm(__float_as_uint(x[0]), __float_as_uint(x[1]), 0x0073);
  if constexpr (kN == 4)
    tops = __byte_perm(tops, __byte_perm(__float_as_uint(x[2]), __float_as_uint(x[3]), 0x0073), 0x5410);
  constexpr uint32_t kSignBits = kN == 1 ? 0x80u : kN == 2 ? 0x8080u : 0x80808080u;
  const uint32_t scale_signs = (__float_as_uint(d.s) >> 31) * kSignBits;
  return (kN == 1 ? bytes & 0xffu : bytes) | ((tops ^ scale_signs) & kSignBits);
}

/// kVec e4m3fn elements moved as one access of kVec bytes (8 on the 16-bit vector paths, 4 on
/// the float32 one, 1 on the scalar fallback).
template <int kVec>
struct Fp8IO {
  using Raw = std::conditional_t<kVec == 8, uint2, std::conditional_t<kVec == 4, uint32_t, uint8_t>>;
  static_assert(kVec == 8 || kVec == 4 || kVec == 1, "e4m3 accesses of 8, 4 or 1 bytes");

  /// kPow2: the scale is one that fp8_power_of_two accepts (the product alone). The caller
  /// decides once per warp item, not per access: a branch per access splits the unrolled units
  /// into basic blocks the compiler cannot interleave (measured: the division path up to 15%
  /// slower, the product path barely faster; docs/NOTES.md, 2026-12-05).
  template <bool kPow2 = false>
  static __device__ __forceinline__ Raw quantize(const float (&f)[kVec], const Fp8Divisor& d) {
    if constexpr (kVec == 8)
      return make_uint2(e4m3_quotient<4, kPow2>(f, d), e4m3_quotient<4, kPow2>(f + 4, d));
    else if constexpr (kVec == 4) return e4m3_quotient<4, kPow2>(f, d);
    else return uint8_t(e4m3_quotient<1, kPow2>(f, d));
  }
  static __device__ __forceinline__ void store(uint8_t* p, Raw r) {
    if constexpr (kVec == 8) {
      asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(r.x), "r"(r.y) : "memory");
    } else {
      *reinterpret_cast<Raw*>(p) = r;
    }
  }
};

}  // namespace ropepool::cuda
