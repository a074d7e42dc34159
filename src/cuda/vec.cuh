// Device helpers of the CUDA backend: raw vector loads/stores (16 bytes on the fast path,
// one element on the fallback) and their conversion to and from float32.
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

 private:
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

}  // namespace ropepool::cuda
