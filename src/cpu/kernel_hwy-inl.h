// The Highway CPU kernel, per SIMD target: kernel_hwy_targets.h includes this file once per
// target (foreach_target.h) and kernel_hwy.cpp picks one at run time (HWY_DYNAMIC_DISPATCH);
// no global -march flags. Each target's definitions are compiled in one of the
// kernel_hwy_part*.cpp files (ROPEPOOL_HWY_HERE, kernel_hwy_targets.h), so the targets
// compile in parallel; every other pass, kernel_hwy.cpp's included, sees the declarations
// alone.
//
// Per token: one sin/cos table (R/2 entries) shared by every q and k head of the token;
// per head: load pairs (x[i], x[i + R/2]) widened to float32, rotate, round once and store.
// A kv head's rotated row goes to k_out and to its pool row from the same registers, and its
// v row is copied to the v pool row. The rows a few tokens ahead are prefetched into L2 as
// the heads are rotated, and large calls store with non-temporal stores.
//
// bfloat16 rows take a permute-free path: a bf16 is the top half of a float32, so one vector
// of 2N bf16 read as N uint32 lanes yields the even-indexed elements (shift left 16) and the
// odd-indexed ones (mask) as two float vectors, and two rounded float vectors recombine into
// 2N bf16 with a shift and a bit-select. The sin/cos table is kept in the same (even, odd)
// order per chunk of 2N pairs (inv_freq is permuted once per block), so the rotation itself
// is unchanged. Compared with widening N elements at a time this halves the shuffles and
// stores (in-cache speed +~35% on AVX-512).

// Per-target include guard (Highway's toggle idiom).
#if defined(ROPEPOOL_SRC_CPU_KERNEL_HWY_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ROPEPOOL_SRC_CPU_KERNEL_HWY_INL_H_
#undef ROPEPOOL_SRC_CPU_KERNEL_HWY_INL_H_
#else
#define ROPEPOOL_SRC_CPU_KERNEL_HWY_INL_H_
#endif

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

#include "cpu_kernels.hpp"
#include "ropepool/half.hpp"
#include "ropepool/schedule.hpp"


HWY_BEFORE_NAMESPACE();
namespace ropepool::detail::cpu {
namespace HWY_NAMESPACE {

// What kernel_hwy.cpp dispatches to (HWY_EXPORT).
void RunBlock(const CallPlan& plan, const Block& block);
void SinCosTable(const double* HWY_RESTRICT inv_freq, int64_t n, int64_t pos, float scale,
                 float* HWY_RESTRICT cos_out, float* HWY_RESTRICT sin_out,
                 const double* HWY_RESTRICT pos_per_freq);
void DemoteRow(DType dtype, const float* in, void* out, int64_t n);
void PromoteRow(DType dtype, const void* in, float* out, int64_t n);
void QuantizeE4M3Row(const float* in, uint8_t* out, int64_t n, float scale);
void QuantizeE4M3BF16Row(const uint16_t* in, uint8_t* out, int64_t n, float scale);

#if ROPEPOOL_HWY_HERE
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using DU16 = hn::Rebind<uint16_t, DF>;  // half-width: one uint16 per float lane
using VU16 = hn::Vec<DU16>;

// Element formats: storage type, widening load and rounding store (RNE, NaN kept NaN).
struct Float32 {
  using T = float;
  static VF load(DF df, const T* p) { return hn::LoadU(df, p); }
  static float scalar_load(T x) { return x; }
  static T scalar_store(float x) { return x; }
};

// Round float32 to bfloat16, to nearest even, with integer ops (Highway 1.0.3's DemoteTo
// truncates): adding 0x7fff plus the lowest kept bit carries into the kept bits exactly when
// the dropped half is above a tie, or a tie with an odd kept part. The result is in the upper
// 16 bits of each lane. NaN needs no special case here: every NaN the kernel can produce is
// either an input bf16 NaN (quiet after arithmetic, low 16 bits zero) or the default NaN of
// an invalid operation (low 16 bits zero), and a zero low half never carries, so NaN stays
// NaN. (ropepool::float_to_bf16, for arbitrary floats, does check.)
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> RoundToBF16High(VF v) {
  const hn::RebindToUnsigned<DF> du32;
  const auto u = hn::BitCast(du32, v);
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // The same sum in three instructions instead of four: the kept bit tested into a mask
  // register selects an add of 1 (a masked add).
  const auto t = hn::Add(u, hn::Set(du32, 0x7fffu));
  return hn::IfThenElse(hn::TestBit(u, hn::Set(du32, 0x10000u)), hn::Add(t, hn::Set(du32, 1u)), t);
#else
  return hn::Add(u, hn::Add(hn::Set(du32, 0x7fffu), hn::And(hn::ShiftRight<16>(u), hn::Set(du32, 1u))));
#endif
}

struct BFloat16 {
  using T = uint16_t;
  static VF load(DF df, const T* p) {
    const hn::RebindToUnsigned<DF> du32;
    return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(DU16(), p))));
  }
  static VU16 store_bits(DF /*df*/, VF v) {
    const hn::RebindToSigned<DF> di32;
    return hn::DemoteTo(DU16(), hn::BitCast(di32, hn::ShiftRight<16>(RoundToBF16High(v))));
  }
  static float scalar_load(T x) { return bf16_to_float(x); }
  static T scalar_store(float x) { return float_to_bf16(x); }
};

// The even/odd bf16 path: 2N elements <-> (even, odd) float vectors of N lanes (not on the
// one-lane HWY_SCALAR target, which takes the generic path).
#if HWY_TARGET != HWY_SCALAR
constexpr bool kEvenOddBF16 = true;
using DU16Full = hn::Repartition<uint16_t, DF>;
HWY_INLINE void LoadBF16EvenOdd(const uint16_t* p, VF& even, VF& odd) {
  const DF df;
  const hn::RebindToUnsigned<DF> du32;
  const auto v = hn::BitCast(du32, hn::LoadU(DU16Full(), p));
  even = hn::BitCast(df, hn::ShiftLeft<16>(v));
  odd = hn::BitCast(df, hn::And(v, hn::Set(du32, 0xffff0000u)));
}
HWY_INLINE hn::Vec<DU16Full> PackBF16EvenOdd(VF even, VF odd) {
  const hn::RebindToUnsigned<DF> du32;
  return hn::BitCast(DU16Full(), hn::OrAnd(hn::ShiftRight<16>(RoundToBF16High(even)),
                                           RoundToBF16High(odd), hn::Set(du32, 0xffff0000u)));
}
#else
constexpr bool kEvenOddBF16 = false;
#endif

#undef ROPEPOOL_HWY_F16C  // defined once per target
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
#define ROPEPOOL_HWY_F16C 1
#else
#define ROPEPOOL_HWY_F16C 0
#endif

struct Float16 {
  using T = uint16_t;
  static VF load(DF df, const T* p) {
#if ROPEPOOL_HWY_F16C
    return hn::PromoteTo(df, hn::BitCast(hn::Rebind<hwy::float16_t, DF>(), hn::LoadU(DU16(), p)));
#else
    // Highway 1.0.3's emulated PromoteTo turns inf/NaN into large finite numbers; this is
    // ropepool::half_to_float in vector form.
    const hn::RebindToUnsigned<DF> du32;
    const hn::RebindToSigned<DF> di32;
    const auto h = hn::PromoteTo(du32, hn::LoadU(DU16(), p));
    const auto sign = hn::ShiftLeft<16>(hn::And(h, hn::Set(du32, 0x8000u)));
    const auto exp = hn::And(hn::ShiftRight<10>(h), hn::Set(du32, 0x1fu));
    const auto man = hn::And(h, hn::Set(du32, 0x3ffu));
    const auto normal = hn::Or(hn::ShiftLeft<23>(hn::Add(exp, hn::Set(du32, 112u))),
                               hn::ShiftLeft<13>(man));
    const auto special = hn::Or(hn::Set(du32, 0x7f800000u), hn::ShiftLeft<13>(man));
    const auto subnormal = hn::BitCast(  // man * 2^-24, exact
        du32, hn::Mul(hn::ConvertTo(df, hn::BitCast(di32, man)), hn::Set(df, 1.0f / 16777216.0f)));
    const auto exp_i = hn::BitCast(di32, exp);
    auto bits = hn::IfThenElse(hn::RebindMask(du32, hn::Eq(exp_i, hn::Zero(di32))), subnormal, normal);
    bits = hn::IfThenElse(hn::RebindMask(du32, hn::Eq(exp_i, hn::Set(di32, 0x1f))), special, bits);
    return hn::BitCast(df, hn::Or(bits, sign));
#endif
  }
  static VU16 store_bits(DF df, VF v) {
#if ROPEPOOL_HWY_F16C
    (void)df;
    // F16C vcvtps2ph with rounding control 0: round to nearest even, NaN stays NaN.
    return hn::BitCast(DU16(), hn::DemoteTo(hn::Rebind<hwy::float16_t, DF>(), v));
#else
    // Targets without F16C: Highway's emulated DemoteTo truncates the mantissa, so this is
    // ropepool::float_to_half in vector form.
    const hn::RebindToUnsigned<DF> du32;
    const hn::RebindToSigned<DF> di32;
    const auto u = hn::BitCast(du32, v);
    const auto sign = hn::And(hn::ShiftRight<16>(u), hn::Set(du32, 0x8000u));
    const auto abs = hn::And(u, hn::Set(du32, 0x7fffffffu));
    const auto abs_i = hn::BitCast(di32, abs);
    // normal: rebias the exponent, round 23 -> 10 mantissa bits, ties to even
    auto w = hn::Sub(abs, hn::Set(du32, 0x38000000u));
    w = hn::Add(w, hn::Add(hn::Set(du32, 0xfffu), hn::And(hn::ShiftRight<13>(w), hn::Set(du32, 1u))));
    auto h = hn::ShiftRight<13>(w);
    // subnormal result: abs / 2^-24 rounded to an integer (exact scaling, RNE conversion).
    // Only those lanes are converted, the others are zero first: Highway 1.0.3's emulated
    // NearestInt (EMU128) casts 2^31 itself to int32, undefined behaviour (clang's UBSan
    // reports it), and abs * 2^24 is 2^31 for |v| = 128.
    const auto is_sub = hn::Lt(abs_i, hn::Set(di32, 0x38800000));
    const auto sub_abs = hn::IfThenElseZero(hn::RebindMask(df, is_sub), hn::BitCast(df, abs));
    const auto sub = hn::BitCast(du32, hn::NearestInt(hn::Mul(sub_abs, hn::Set(df, 16777216.0f))));
    h = hn::IfThenElse(hn::RebindMask(du32, is_sub), sub, h);
    h = hn::IfThenElse(hn::RebindMask(du32, hn::Gt(abs_i, hn::Set(di32, 0x477fefff))),
                       hn::Set(du32, 0x7c00u), h);  // rounds to >= 65520: inf
    const auto nan = hn::Or(hn::Set(du32, 0x7e00u),
                            hn::And(hn::ShiftRight<13>(abs), hn::Set(du32, 0x3ffu)));
    h = hn::IfThenElse(hn::RebindMask(du32, hn::Gt(abs_i, hn::Set(di32, 0x7f800000))), nan, h);
    return hn::DemoteTo(DU16(), hn::BitCast(di32, hn::Or(h, sign)));
#endif
  }
  static float scalar_load(T x) { return half_to_float(x); }
  static T scalar_store(float x) { return float_to_half(x); }
};

// Non-temporal stores only where the stored vectors are full 128/256/512-bit registers.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
constexpr bool kCanStream = true;
#else
constexpr bool kCanStream = false;
#endif

template <class E>
HWY_INLINE void StoreVec(DF df, VF v, typename E::T* p, bool stream) {
  if constexpr (!kCanStream) {
    (void)stream;
    if constexpr (std::is_same_v<E, Float32>)
      hn::StoreU(v, df, p);
    else
      hn::StoreU(E::store_bits(df, v), DU16(), p);
  } else if constexpr (std::is_same_v<E, Float32>) {
    if (stream)
      hn::Stream(v, df, p);
    else
      hn::StoreU(v, df, p);
  } else {
    const VU16 bits = E::store_bits(df, v);
    if (stream)
      hn::Stream(bits, DU16(), p);
    else
      hn::StoreU(bits, DU16(), p);
  }
}

// Non-temporal stores need vector-aligned addresses.
HWY_INLINE bool Aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

HWY_INLINE void CopyBytes(void* dst, const void* src, size_t n, bool stream) {
  const hn::ScalableTag<uint8_t> d8;
  const size_t N = hn::Lanes(d8);
  if (!kCanStream || !stream || !Aligned(dst, N)) {
    std::memcpy(dst, src, n);
    return;
  }
  auto* out = static_cast<uint8_t*>(dst);
  const auto* in = static_cast<const uint8_t*>(src);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::Stream(hn::LoadU(d8, in + i), d8, out + i);
  std::memcpy(out + i, in + i, n - i);
}

// Every 64-byte line of [p, p + bytes), bytes > 0, into L1.
HWY_INLINE void PrefetchBytes(const void* p, int64_t bytes) {
  const uintptr_t last = reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes) - 1;
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63); a <= last; a += 64)
    hwy::Prefetch(reinterpret_cast<const char*>(a));
}

// The same into L2 (x86 prefetcht1, Arm PLDL2KEEP; where the compiler has no such hint, L1).
HWY_INLINE void PrefetchBytesL2(const void* p, int64_t bytes) {
  const uintptr_t last = reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes) - 1;
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63); a <= last; a += 64) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(reinterpret_cast<const char*>(a), 0, 2);
#else
    hwy::Prefetch(reinterpret_cast<const char*>(a));
#endif
  }
}

// GPT-J pairs (x[j], x[j+1]) from an even j up to rotary_dim, one at a time, then the
// pass-through rest of the head. cos_sin(j, c, s) reads pair j's factors: the two
// interleaved paths lay out their tables differently.
template <class E, class CosSin>
HWY_INLINE void InterleavedTail(const typename E::T* x, typename E::T* out, typename E::T* out2,
                                int64_t j, int64_t rotary_dim, int64_t head_dim, CosSin cos_sin) {
  using T = typename E::T;
  for (; j < rotary_dim; j += 2) {
    const float a = E::scalar_load(x[j]), b = E::scalar_load(x[j + 1]);
    float c, s;
    cos_sin(j, c, s);
    const T lo = E::scalar_store(a * c - b * s), hi = E::scalar_store(a * s + b * c);
    out[j] = lo;
    out[j + 1] = hi;
    if (out2) {
      out2[j] = lo;
      out2[j + 1] = hi;
    }
  }
  copy_pass_through(x, out, out2, rotary_dim, head_dim);
}

// One head: rotate the pairs (x[i], x[i + R/2]) for i in [first_pair, R/2) into `out` (and
// `out2` when not null), copy x[R, D).
template <class E>
HWY_INLINE void RotateRow(const typename E::T* x, typename E::T* out,
                          typename E::T* out2, const float* HWY_RESTRICT cos_t,
                          const float* HWY_RESTRICT sin_t, int64_t rotary_dim, int64_t head_dim,
                          bool stream, int64_t first_pair = 0) {
  using T = typename E::T;
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const int64_t half = rotary_dim / 2;
  const size_t vec_bytes = size_t(N) * sizeof(T);
  const size_t half_bytes = size_t(half) * sizeof(T);
  // Streaming only when every vector store lands aligned (the second half starts at
  // out + half, so half * sizeof(T) must keep the alignment too).
  if (stream) {
    stream = half_bytes % vec_bytes == 0 && Aligned(out, vec_bytes) &&
             (out2 == nullptr || Aligned(out2, vec_bytes));
  }
  int64_t i = first_pair;
  for (; i + N <= half; i += N) {
    const VF a = E::load(df, x + i);
    const VF b = E::load(df, x + half + i);
    const VF c = hn::LoadU(df, cos_t + i);
    const VF s = hn::LoadU(df, sin_t + i);
    const VF lo = hn::MulSub(a, c, hn::Mul(b, s));  // a*cos - b*sin
    const VF hi = hn::MulAdd(a, s, hn::Mul(b, c));  // a*sin + b*cos
    StoreVec<E>(df, lo, out + i, stream);
    StoreVec<E>(df, hi, out + half + i, stream);
    if (out2) {
      StoreVec<E>(df, lo, out2 + i, stream);
      StoreVec<E>(df, hi, out2 + half + i, stream);
    }
  }
  for (; i < half; ++i) {  // tail when R/2 is not a multiple of the vector length
    const float a = E::scalar_load(x[i]), b = E::scalar_load(x[i + half]);
    const T lo = E::scalar_store(a * cos_t[i] - b * sin_t[i]);
    const T hi = E::scalar_store(a * sin_t[i] + b * cos_t[i]);
    out[i] = lo;
    out[i + half] = hi;
    if (out2) {
      out2[i] = lo;
      out2[i + half] = hi;
    }
  }
  copy_pass_through(x, out, out2, rotary_dim, head_dim);
}

#if HWY_TARGET != HWY_SCALAR
HWY_INLINE void StoreU16(hn::Vec<DU16Full> bits, uint16_t* p, bool stream) {
  if constexpr (kCanStream) {
    if (stream) return hn::Stream(bits, DU16Full(), p);
  }
  (void)stream;
  hn::StoreU(bits, DU16Full(), p);
}

// The 2N half-split pairs of a bfloat16 head at i, rotated with the table in (even, odd) order:
// the first halves' results (lo) and the second halves' (hi), as (even, odd) float vectors.
// `prepare(v, at)` transforms each loaded vector first (`at`: the element index of its chunk
// half: i, i + N, half + i, half + i + N): the identity, or SPEC §7's norm (NormChunk).
struct AsLoaded {
  VF operator()(VF v, int64_t /*at*/) const { return v; }
};
template <class Prepare>
HWY_INLINE void RotateChunkBF16(const uint16_t* x, int64_t half, int64_t i, const float* HWY_RESTRICT cos_t,
                                const float* HWY_RESTRICT sin_t, const Prepare& prepare, VF& lo_even,
                                VF& lo_odd, VF& hi_even, VF& hi_odd) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  VF a_even, a_odd, b_even, b_odd;
  LoadBF16EvenOdd(x + i, a_even, a_odd);
  LoadBF16EvenOdd(x + half + i, b_even, b_odd);
  a_even = prepare(a_even, i);
  a_odd = prepare(a_odd, i + N);
  b_even = prepare(b_even, half + i);
  b_odd = prepare(b_odd, half + i + N);
  const VF c_even = hn::LoadU(df, cos_t + i), c_odd = hn::LoadU(df, cos_t + i + N);
  const VF s_even = hn::LoadU(df, sin_t + i), s_odd = hn::LoadU(df, sin_t + i + N);
  lo_even = hn::MulSub(a_even, c_even, hn::Mul(b_even, s_even));
  lo_odd = hn::MulSub(a_odd, c_odd, hn::Mul(b_odd, s_odd));
  hi_even = hn::MulAdd(a_even, s_even, hn::Mul(b_even, c_even));
  hi_odd = hn::MulAdd(a_odd, s_odd, hn::Mul(b_odd, c_odd));
}

// bfloat16, half-split pairs, with the table in (even, odd) order per chunk of 2N pairs (see
// the file comment); the pairs past the last whole chunk take the generic path, which has no
// `prepare` (callers that prepare have whole chunks and rotary_dim = head_dim).
template <class Prepare = AsLoaded>
HWY_INLINE void RotateRowBF16(const uint16_t* x, uint16_t* out, uint16_t* out2,
                              const float* HWY_RESTRICT cos_t, const float* HWY_RESTRICT sin_t,
                              int64_t rotary_dim, int64_t head_dim, bool stream,
                              const Prepare& prepare = {}) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const int64_t half = rotary_dim / 2;
  const size_t vec_bytes = size_t(2 * N) * sizeof(uint16_t);
  const bool stream_here = stream && size_t(half) * sizeof(uint16_t) % vec_bytes == 0 &&
                     Aligned(out, vec_bytes) && (out2 == nullptr || Aligned(out2, vec_bytes));
  int64_t i = 0;
  for (; i + 2 * N <= half; i += 2 * N) {
    VF lo_even, lo_odd, hi_even, hi_odd;
    RotateChunkBF16(x, half, i, cos_t, sin_t, prepare, lo_even, lo_odd, hi_even, hi_odd);
    const auto lo = PackBF16EvenOdd(lo_even, lo_odd), hi = PackBF16EvenOdd(hi_even, hi_odd);
    StoreU16(lo, out + i, stream_here);
    StoreU16(hi, out + half + i, stream_here);
    if (out2) {
      StoreU16(lo, out2 + i, stream_here);
      StoreU16(hi, out2 + half + i, stream_here);
    }
  }
  RotateRow<BFloat16>(x, out, out2, cos_t, sin_t, rotary_dim, head_dim, stream, i);
}

// bfloat16, GPT-J pairs: the even/odd split is exactly (a, b), the table stays in order.
HWY_INLINE void RotateRowInterleavedBF16(const uint16_t* x, uint16_t* out, uint16_t* out2,
                                         const float* HWY_RESTRICT cos_t,
                                         const float* HWY_RESTRICT sin_t, int64_t rotary_dim,
                                         int64_t head_dim, bool stream) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const size_t vec_bytes = size_t(2 * N) * sizeof(uint16_t);
  const bool stream_here =
      stream && Aligned(out, vec_bytes) && (out2 == nullptr || Aligned(out2, vec_bytes));
  int64_t j = 0;
  for (; j + 2 * N <= rotary_dim; j += 2 * N) {
    VF a, b;
    LoadBF16EvenOdd(x + j, a, b);
    const VF c = hn::LoadU(df, cos_t + j / 2), s = hn::LoadU(df, sin_t + j / 2);
    const auto r = PackBF16EvenOdd(hn::MulSub(a, c, hn::Mul(b, s)), hn::MulAdd(a, s, hn::Mul(b, c)));
    StoreU16(r, out + j, stream_here);
    if (out2) StoreU16(r, out2 + j, stream_here);
  }
  InterleavedTail<BFloat16>(x, out, out2, j, rotary_dim, head_dim,
                            [&](int64_t p, float& c, float& s) { c = cos_t[p / 2], s = sin_t[p / 2]; });
}

// The bf16 half-split table order: within each whole chunk of 2N pairs, the even-indexed
// frequencies first, then the odd ones; the rest in order.
template <class V>
void PermuteForBF16(const V* inv_freq, int64_t n, int64_t half, V* out) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(DF()));
  int64_t i = 0;
  for (; i + 2 * N <= half; i += 2 * N)
    for (int64_t j = 0; j < N; ++j) {
      out[i + j] = inv_freq[i + 2 * j];
      out[i + N + j] = inv_freq[i + 2 * j + 1];
    }
  for (; i < n; ++i) out[i] = inv_freq[i];
}
#endif  // HWY_TARGET != HWY_SCALAR

// pos_per_freq (mRoPE, SPEC §7): nullptr, or n positions, one per frequency (same order as
// inv_freq), used instead of pos. Text-only mRoPE positions (three equal rows) give the same
// products, so the same bits as the plain table.
void SinCosTable(const double* HWY_RESTRICT inv_freq, int64_t n, int64_t pos, float scale,
                 float* HWY_RESTRICT cos_out, float* HWY_RESTRICT sin_out,
                 const double* HWY_RESTRICT pos_per_freq) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df_half;  // as many floats as doubles
  const DF df;
  const int64_t Nd = static_cast<int64_t>(hn::Lanes(dd));
  const int64_t Nf = static_cast<int64_t>(hn::Lanes(df));
  // theta = pos * inv_freq in double (|theta| < 2^21 for |pos| < 2^20 keeps ~32 fraction
  // bits), reduced to [-pi, pi]: r = theta - n * 2pi with one rounding (fused multiply-add on
  // FMA targets); the error of the double 2pi times n (< 2^18) stays below 2^-32.
  const auto pos_d = hn::Set(dd, static_cast<double>(pos));
  const auto two_pi = hn::Set(dd, 6.283185307179586);
  const auto inv_two_pi = hn::Set(dd, 0.15915494309189535);
  auto reduce = [&](int64_t i, decltype(pos_d) pos_v) {
    const auto theta = hn::Mul(pos_v, hn::LoadU(dd, inv_freq + i));
    const auto turns = hn::Round(hn::Mul(theta, inv_two_pi));
    const auto r = hn::NegMulAdd(turns, two_pi, theta);
    // Store the float angles into sin_out, overwritten in place below.
    hn::StoreU(hn::DemoteTo(df_half, r), df_half, sin_out + i);
  };
  if (pos_per_freq == nullptr) {
    for (int64_t i = 0; i < n; i += Nd) reduce(i, pos_d);
  } else {
    for (int64_t i = 0; i < n; i += Nd) reduce(i, hn::LoadU(dd, pos_per_freq + i));
  }
  const auto vscale = hn::Set(df, scale);
  for (int64_t i = 0; i < n; i += Nf) {
    const VF r = hn::LoadU(df, sin_out + i);
    hn::StoreU(hn::Mul(vscale, hn::Cos(df, r)), df, cos_out + i);
    hn::StoreU(hn::Mul(vscale, hn::Sin(df, r)), df, sin_out + i);
  }
}

// GPT-J pairs (x[2i], x[2i+1]): out = x * cos_il + swap_pairs(x) * sin_il, with tables that
// repeat each frequency's cos twice and carry sin as (-sin, +sin), so the pair elements stay
// in place in one register.
template <class E>
HWY_INLINE void RotateRowInterleaved(const typename E::T* x, typename E::T* out,
                                     typename E::T* out2, const float* HWY_RESTRICT cos_il,
                                     const float* HWY_RESTRICT sin_il, int64_t rotary_dim,
                                     int64_t head_dim, bool stream) {
  using T = typename E::T;
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const size_t vec_bytes = size_t(N) * sizeof(T);
  if (stream)
    stream = Aligned(out, vec_bytes) && (out2 == nullptr || Aligned(out2, vec_bytes));
  int64_t j = 0;
#if HWY_TARGET != HWY_SCALAR  // one-lane vectors hold no pair
  for (; j + N <= rotary_dim; j += N) {
    const VF v = E::load(df, x + j);
    const VF r = hn::MulAdd(v, hn::LoadU(df, cos_il + j),
                            hn::Mul(hn::Reverse2(df, v), hn::LoadU(df, sin_il + j)));
    StoreVec<E>(df, r, out + j, stream);
    if (out2) StoreVec<E>(df, r, out2 + j, stream);
  }
#endif
  // j is even here: vectors hold whole pairs.
  InterleavedTail<E>(x, out, out2, j, rotary_dim, head_dim,
                     [&](int64_t p, float& c, float& s) { c = cos_il[p], s = sin_il[p + 1]; });
}

// v rounded to E's dtype and widened back, in registers (round to nearest even).
template <class E>
HWY_INLINE VF RoundTo(DF df, VF v) {
  if constexpr (std::is_same_v<E, Float32>) {
    return v;
  } else if constexpr (std::is_same_v<E, BFloat16>) {
    const hn::RebindToUnsigned<DF> du32;
    return hn::BitCast(df, hn::And(RoundToBF16High(v), hn::Set(du32, 0xffff0000u)));
  } else {
    HWY_ALIGN uint16_t bits[hn::MaxLanes(DF())];  // the store path's rounding, then the load's widening
    hn::Store(E::store_bits(df, v), DU16(), bits);
    return E::load(df, bits);
  }
}

// SPEC §7's per-head norm, in two passes over a head that stays in L1 (it is read from
// memory once): SumSquares gives sum(x^2) in float32; with r = rsqrt(mean(x^2) + eps) in
// float32, NormApply writes y into a scratch row the rotation then reads: "rms":
// y = round(w * round(x * r)), "gemma": y = round(x * r * w) with w already 1 + weight.
template <class E>
HWY_INLINE float SumSquares(const typename E::T* x, int64_t D) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  (void)df, (void)N;
  int64_t i = 0;
#if HWY_TARGET == HWY_SCALAR
  // One lane would be one long float32 chain over the head: sum in double, round once.
  double sum_d = 0;
  for (; i < D; ++i) sum_d += double(E::scalar_load(x[i])) * double(E::scalar_load(x[i]));
  const float sum = static_cast<float>(sum_d);
#else
  VF acc = hn::Zero(df);  // N float32 partial sums
  for (; i + N <= D; i += N) {
    const VF v = E::load(df, x + i);
    acc = hn::MulAdd(v, v, acc);
  }
  float sum = hn::GetLane(hn::SumOfLanes(df, acc));
  for (; i < D; ++i) sum += E::scalar_load(x[i]) * E::scalar_load(x[i]);
#endif
  return sum;
}

// r = 1 / sqrt(sum / D + eps) for the sums of squares of n heads, in place, in whole vectors
// (`r` holds at least n rounded up to a vector): the float32 divisions and square root are
// IEEE operations in every lane, so each r is bit-identical to the scalar expression. One
// head at a time, the two divisions and the root were a tenth of the norm's cost.
HWY_INLINE void NormScales(float* HWY_RESTRICT r, int64_t n, float D, float eps) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const VF vd = hn::Set(df, D), ve = hn::Set(df, eps), one = hn::Set(df, 1.0f);
  for (int64_t i = 0; i < n; i += N)
    hn::StoreU(hn::Div(one, hn::Sqrt(hn::Add(hn::Div(hn::LoadU(df, r + i), vd), ve))), df, r + i);
}

// The norm's second pass, with r = rsqrt(mean(x^2) + eps) of the head.
template <class E>
HWY_INLINE void NormApply(const typename E::T* x, typename E::T* y, const float* HWY_RESTRICT w,
                          float r, int64_t D, bool gemma) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const VF vr = hn::Set(df, r);
  int64_t i = 0;
  for (; i + N <= D; i += N) {
    const VF n = hn::Mul(E::load(df, x + i), vr);
    // "rms": n rounded to the input dtype (in registers), then times w
    StoreVec<E>(df, hn::Mul(gemma ? n : RoundTo<E>(df, n), hn::LoadU(df, w + i)), y + i, false);
  }
  for (; i < D; ++i) {
    const float n = E::scalar_load(x[i]) * r;
    y[i] = gemma ? E::scalar_store(n * w[i])
                 : E::scalar_store(E::scalar_load(E::scalar_store(n)) * w[i]);
  }
}

// ---- float8 e4m3fn pools and q_rot (SPEC §6) ------------------------------------------------
//
// Stored element = e4m3(x / scale): the division in float32, then round to nearest even,
// magnitudes beyond 448 (infinities included) saturate to +-448, NaN stays NaN. This is
// ropepool::float_to_e4m3 in vector form, on the float32 bits, with the float adder doing the
// rounding: |v| (clamped to 448) plus c = 2^(e + 20), where 2^e is |v|'s binade but at least
// 2^-6 (the smallest normal e4m3), is a float32 whose ulp is 2^(e - 3), the e4m3 step of that
// binade (subnormals: 2^-9), so the addition rounds |v| to the e4m3 grid, to nearest even,
// exactly once. The sum is c plus k steps: k = 8 + m for a normal result with mantissa m (16
// when it carries into the next binade), the subnormal code itself below 2^-6; the e4m3 code
// is k + 8 * (e + 6).
//
// Fewer operations than computing c and subtracting it again:
// - The kernel hands over v * 2^20 (the scale's division or reciprocal carries the factor, see
//   Divisor): its exponent field is already c's, so c needs no addition, and the sum is a
//   fused multiply-add of v * 2^20 by 2^-20 (exact) plus c.
// - c's mantissa field need not be zero: any even constant M (with M + 16 below 2^23) keeps
//   the rounding (the sum stays in c's binade, ties still go to an even k). With M =
//   8 * (biased exponent of c) + 24, which is 8 * (e + 6) modulo 128, the sum's low 7 bits are
//   the code itself, so c is built as b + (b >> 20) from b = c's exponent field | 24.
// - The sign bit and NaN's code come from v's top byte: v >> 24 is the sign at bit 7 and, for
//   NaN (exponent all ones), 0x7f below it: the e4m3 NaN of that sign.
// About 11 vector operations instead of about 14 for computing c and subtracting it.
using DU8 = hn::Rebind<uint8_t, DF>;  // one byte per float lane
using DU32 = hn::RebindToUnsigned<DF>;

constexpr float kE4M3Pre = 1048576.0f;  // 2^20, the factor E4M3Code's input carries

// The e4m3 code of |v| in the low 7 bits of each 32-bit lane and v's sign at bit 7, the other
// bits zero, from `a`, the bits of |v20| = |v| * 2^20 at most 448 * 2^20, and `top`, v20's bits
// shifted right by 24 (the sign at bit 7).
HWY_INLINE hn::Vec<DU32> E4M3CodeInRange(DF df, hn::Vec<DU32> a, hn::Vec<DU32> top) {
  const DU32 du32;
  // c's exponent field, at least 2^14 (2^-6 * 2^20), with 24 in the low bits
  const auto b = hn::Max(hn::OrAnd(hn::Set(du32, 24u), a, hn::Set(du32, 0x7f800000u)),
                         hn::Set(du32, 0x46800018u));
  const auto c = hn::Add(b, hn::ShiftRight<20>(b));  // mantissa field 8 * exponent + 24
  const VF sum = hn::MulAdd(hn::BitCast(df, a), hn::Set(df, 1.0f / kE4M3Pre), hn::BitCast(df, c));
  // the sum's low 7 bits, top's others (a bit select: one instruction on AVX-512)
  return hn::Xor(top, hn::And(hn::Xor(top, hn::BitCast(du32, sum)), hn::Set(du32, 0x7fu)));
}

constexpr uint32_t kE4M3MaxBits = 0x4de00000u;  // 448 * 2^20

// e4m3(v) in the low byte of each 32-bit lane, the other bits zero, from v20 = v * 2^20.
HWY_INLINE hn::Vec<DU32> E4M3Code(DF df, VF v20) {
  const DU32 du32;
  const hn::RebindToSigned<DF> di32;
  const auto u = hn::BitCast(du32, v20);
  const auto abs_i = hn::BitCast(di32, hn::And(u, hn::Set(du32, 0x7fffffffu)));
  // 448 * 2^20 and beyond, infinities included: 448 * 2^20 (NaN too, replaced below)
  const auto a = hn::BitCast(du32, hn::Min(abs_i, hn::Set(di32, int32_t(kE4M3MaxBits))));
  // v's top byte: for NaN (exponent all ones) the sign at bit 7 and 0x7f below it, the e4m3 NaN
  const auto top = hn::ShiftRight<24>(u);
  return hn::IfThenElse(hn::RebindMask(du32, hn::Gt(abs_i, hn::Set(di32, 0x7f800000))), top,
                        E4M3CodeInRange(df, a, top));
}

HWY_INLINE hn::Vec<DU8> ToE4M3(DF df, VF v20) { return hn::TruncateTo(DU8(), E4M3Code(df, v20)); }

// The division by a scale, as SPEC §6 says (float32, IEEE), times E4M3Code's 2^20. When 1/scale
// is exact in float32 (a power-of-two scale, vLLM's default 1.0 among them), x * (1/scale) is
// the same real number as x / scale, so it rounds to the same float: a multiply instead of a
// divide, which costs about as much as the whole rest of the quantisation. The factor 2^20 goes
// into the reciprocal or the divisor (x * (2^20 / scale), x / (scale * 2^-20)): a quotient of
// normal magnitude rounds to exactly 2^20 times x / scale's float32; one below 2^-126 or beyond
// 2^107 may not, but both are e4m3 0 or 448 either way (of the same sign; NaN stays NaN). A
// scale below 2^-106 (where scale * 2^-20 would not be a normal float32) divides first and
// multiplies by 2^20 after.
//
// A scale 2^-k with k in [-119, 115] also gives the bfloat16 rows (v, MLA's kv_c) their codes
// on 16-bit lanes, twice as many per vector, from the bits alone (BF16E4M3Codes): x / scale is
// then x * 2^k exactly, a bfloat16 with k added to its exponent, so its code is its magnitude
// bits rounded to 3 mantissa bits (to nearest even) with the exponent rebiased. The range of k
// keeps 448 * scale and 2^-6 * scale normal bfloat16 numbers and every bfloat16 subnormal x
// below half of e4m3's least subnormal after the scale.
// The row functions take it by value: a local copy, which the byte stores of the codes cannot
// alias, so its fields stay in registers (through a reference they were reloaded and tested
// again after every store).
struct Divisor {
  float scale = 1.0f;
  float divisor20 = 1.0f / kE4M3Pre, reciprocal20 = kE4M3Pre;  // scale * 2^-20, 2^20 / scale
  bool exact_reciprocal = true;
  bool folded = true;  // divisor20 and reciprocal20 are exact
  bool bf16_bits = false;   // BF16E4M3Codes applies (the constants below are set)
  uint16_t bf16_max = 0;     // bits of 448 * scale: larger magnitudes saturate to 448
  uint16_t bf16_normal = 0;  // bits of 2^-6 * scale: smaller ones are e4m3 subnormals
  uint16_t bf16_bias = 0;    // 7 + (k - 120) * 2^7 modulo 2^16: rounding and exponent rebias
  uint16_t bf16_shift0 = 0;  // 125 - k: a subnormal's shift is this minus its exponent field
  explicit Divisor(float s) : scale(s) {
    const float reciprocal = 1.0f / s;
    exact_reciprocal = std::isfinite(reciprocal) && reciprocal != 0.0f &&
                       (float_bits(s) & 0x7fffffu) == 0 && (float_bits(s) & 0x7f800000u) != 0;
    folded = s >= 0x1p-106f;
    divisor20 = s / kE4M3Pre;
    reciprocal20 = reciprocal * kE4M3Pre;
    const int k = 127 - int((float_bits(s) >> 23) & 0xffu);  // s = 2^-k when exact_reciprocal
    bf16_bits = exact_reciprocal && k >= -119 && k <= 115;
    if (bf16_bits) {
      bf16_max = uint16_t(((135 - k) << 7) | 0x60);  // 448 = 1.75 * 2^8
      bf16_normal = uint16_t((121 - k) << 7);
      bf16_bias = uint16_t(7 + (k - 120) * 128);
      bf16_shift0 = uint16_t(125 - k);
    }
  }
};

// x / scale * 2^20 (E4M3Code's input) with the Divisor's choice of operations.
HWY_INLINE VF Scaled(DF df, VF x, const Divisor& d) {
  if (HWY_UNLIKELY(!d.folded))
    return hn::Mul(hn::Div(x, hn::Set(df, d.scale)), hn::Set(df, kE4M3Pre));
  return d.exact_reciprocal ? hn::Mul(x, hn::Set(df, d.reciprocal20))
                            : hn::Div(x, hn::Set(df, d.divisor20));
}

HWY_INLINE float ScaleValue(const Scale& s) { return s.ptr ? *s.ptr : s.value; }

// A kv slot's address in a pool of element size `elem` (SPEC §6 paging; 3-D pools are
// page_size 1).
HWY_INLINE char* PoolRow(const PoolRows& r, int64_t page, int64_t row, int64_t head, size_t elem) {
  return static_cast<char*>(r.data) +
         (page * r.page_stride + row * r.row_stride + head * r.head_stride) * int64_t(elem);
}

// The e4m3 codes (E4M3Code) of two vectors at once. Magnitudes beyond 448 (after the scale)
// and NaN are rare: one test for both vectors (their larger |bits|), and only then the clamp
// and NaN's code (E4M3Code); otherwise E4M3CodeInRange alone: no clamp, NaN compare or
// select, for a maximum and a compare per pair.
HWY_INLINE void E4M3Codes2(DF df, VF v0, VF v1, hn::Vec<DU32>& c0, hn::Vec<DU32>& c1) {
  const DU32 du32;
  const auto u0 = hn::BitCast(du32, v0), u1 = hn::BitCast(du32, v1);
  const auto abs0 = hn::And(u0, hn::Set(du32, 0x7fffffffu));
  const auto abs1 = hn::And(u1, hn::Set(du32, 0x7fffffffu));
  // |bits| < 2^31: a signed compare (one instruction on AVX2, which has no unsigned one)
  const hn::RebindToSigned<DF> di32;
  const auto larger = hn::BitCast(di32, hn::Max(abs0, abs1));
  if (HWY_UNLIKELY(!hn::AllFalse(di32, hn::Gt(larger, hn::Set(di32, int32_t(kE4M3MaxBits)))))) {
    c0 = E4M3Code(df, v0);
    c1 = E4M3Code(df, v1);
  } else {
    c0 = E4M3CodeInRange(df, abs0, hn::ShiftRight<24>(u0));
    c1 = E4M3CodeInRange(df, abs1, hn::ShiftRight<24>(u1));
  }
}

#if HWY_TARGET != HWY_SCALAR
// The e4m3 codes of 2N elements held as (even, odd) float vectors (the bf16 split of the file
// comment), in memory order: lane j's code pair (even | odd << 8) is bytes 2j and 2j + 1. On
// x86 from SSE4 on they stay in 32-bit lanes until two such vectors are stored together
// (StoreE4M3Full below: one unsigned saturating pack and one permutation of 64-bit words, for
// a truncation per vector and a concatenation); elsewhere they are truncated to 16 bits here.
#undef ROPEPOOL_E4M3_PAIR_WORDS  // defined per target
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_SSE4
#define ROPEPOOL_E4M3_PAIR_WORDS 1
#else
#define ROPEPOOL_E4M3_PAIR_WORDS 0
#endif
#if ROPEPOOL_E4M3_PAIR_WORDS
using EvenOddCodes = hn::Vec<DU32>;
#else
using EvenOddCodes = VU16;
#endif
HWY_INLINE EvenOddCodes E4M3EvenOdd(DF df, VF even, VF odd) {
  hn::Vec<DU32> code_e, code_o;
  E4M3Codes2(df, even, odd, code_e, code_o);
  const auto pairs = hn::Or(code_e, hn::ShiftLeft<8>(code_o));
#if ROPEPOOL_E4M3_PAIR_WORDS
  return pairs;
#else
  return hn::TruncateTo(DU16(), pairs);
#endif
}

using DU8Full = hn::Repartition<uint8_t, DF>;

// Stores the codes of 2N elements (half a vector).
HWY_INLINE void StoreE4M3Half(VU16 codes, uint8_t* p) {
  hn::StoreU(hn::BitCast(hn::Repartition<uint8_t, DU16>(), codes), hn::Repartition<uint8_t, DU16>(), p);
}
#if ROPEPOOL_E4M3_PAIR_WORDS
HWY_INLINE void StoreE4M3Half(hn::Vec<DU32> pairs, uint8_t* p) { StoreE4M3Half(hn::TruncateTo(DU16(), pairs), p); }
#endif

// Stores the codes of 4N elements, [0, 2N) in `lower`, as one full vector: a non-temporal
// store where `stream` (p vector-aligned). The e4m3 rows are written this way, straight from
// registers, rather than through a staging row in L1: two half-vector stores read back as one
// full vector miss store-to-load forwarding, which stalled the staging copy.
HWY_INLINE void StoreE4M3Full(VU16 lower, VU16 upper, uint8_t* p, bool stream) {
  const auto bytes = hn::BitCast(DU8Full(), hn::Combine(DU16Full(), upper, lower));
  if constexpr (kCanStream) {
    if (stream) return hn::Stream(bytes, DU8Full(), p);
  }
  (void)stream;
  hn::StoreU(bytes, DU8Full(), p);
}

#if ROPEPOOL_E4M3_PAIR_WORDS
// The same for E4M3EvenOdd's 32-bit lanes (code pairs below 2^16): the pack per 128-bit block
// puts block b's four pairs of `lower`, then of `upper`, into 64-bit words 2b and 2b + 1, and
// the permutation takes `lower`'s words first.
HWY_INLINE void StoreE4M3Full(hn::Vec<DU32> lower, hn::Vec<DU32> upper, uint8_t* p, bool stream) {
#if HWY_TARGET <= HWY_AVX3
  const __m512i packed = _mm512_packus_epi32(lower.raw, upper.raw);
  const hn::Vec<DU8Full> bytes{
      _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), packed)};
#elif HWY_TARGET == HWY_AVX2
  const hn::Vec<DU8Full> bytes{
      _mm256_permute4x64_epi64(_mm256_packus_epi32(lower.raw, upper.raw), _MM_SHUFFLE(3, 1, 2, 0))};
#else
  const hn::Vec<DU8Full> bytes{_mm_packus_epi32(lower.raw, upper.raw)};
#endif
  if constexpr (kCanStream) {
    if (stream) return hn::Stream(bytes, DU8Full(), p);
  }
  (void)stream;
  hn::StoreU(bytes, DU8Full(), p);
}
#endif

// The codes of 4N elements in memory order, four vectors of E4M3Code results c0..c3 (a code
// per 32-bit lane, 0 to 255), in one full vector, built in two steps so that fewer vectors
// are live: PackE4M3Codes2(c0, c1) and (c2, c3), then StoreE4M3Codes4 (non-temporal where
// `stream`, p vector-aligned). On x86 with saturating packs per 128-bit block, 32 -> 16 bits
// (c0 | c1, c2 | c3) and 16 -> 8 bits: block b then holds the codes of lanes 4b to 4b + 3 of
// c0, c1, c2 and c3, one 32-bit word each, and one permutation of the words puts c0's first
// (word 4b + k goes to k * N/4 + b). Elsewhere each vector is truncated to bytes, two by two.
#if HWY_ARCH_X86 && HWY_TARGET != HWY_EMU128
using PackedCodes = hn::Vec<hn::Repartition<int16_t, DF>>;
HWY_INLINE PackedCodes PackE4M3Codes2(hn::Vec<DU32> c0, hn::Vec<DU32> c1) {
  const hn::Repartition<int32_t, DF> di32;
  return hn::ReorderDemote2To(hn::Repartition<int16_t, DF>(), hn::BitCast(di32, c0),
                              hn::BitCast(di32, c1));
}
HWY_INLINE void StoreE4M3Codes4(PackedCodes p01, PackedCodes p23, uint8_t* p, bool stream) {
#if HWY_TARGET <= HWY_AVX3
  hn::Vec<DU8Full> bytes{_mm512_packus_epi16(p01.raw, p23.raw)};
#elif HWY_TARGET == HWY_AVX2
  hn::Vec<DU8Full> bytes{_mm256_packus_epi16(p01.raw, p23.raw)};
#else
  hn::Vec<DU8Full> bytes{_mm_packus_epi16(p01.raw, p23.raw)};
#endif
  constexpr size_t kBlocks = hn::MaxLanes(DF()) / 4;
  if constexpr (kBlocks > 1) {
    alignas(64) static constexpr int32_t kWords4[16] = {0, 4, 8, 12, 1, 5, 9, 13,
                                                        2, 6, 10, 14, 3, 7, 11, 15};
    alignas(32) static constexpr int32_t kWords2[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    const DU32 du32;
    const auto order = hn::SetTableIndices(du32, kBlocks == 4 ? kWords4 : kWords2);
    bytes = hn::BitCast(DU8Full(), hn::TableLookupLanes(hn::BitCast(du32, bytes), order));
  }
  if constexpr (kCanStream) {
    if (stream) return hn::Stream(bytes, DU8Full(), p);
  }
  (void)stream;
  hn::StoreU(bytes, DU8Full(), p);
}
#else
using PackedCodes = VU16;
HWY_INLINE PackedCodes PackE4M3Codes2(hn::Vec<DU32> c0, hn::Vec<DU32> c1) {
  const hn::Repartition<uint8_t, DU16> d8;  // 2N bytes, the size of a VU16
  return hn::BitCast(DU16(), hn::Combine(d8, hn::TruncateTo(DU8(), c1), hn::TruncateTo(DU8(), c0)));
}
HWY_INLINE void StoreE4M3Codes4(PackedCodes p01, PackedCodes p23, uint8_t* p, bool stream) {
  StoreE4M3Full(p01, p23, p, stream);
}
#endif
#endif

// out[i] = e4m3(in[i] / scale) for a row of E's dtype (v, MLA's kv_c, the pass-through part of
// a head) or a float32 row: 4N elements per step stored as one vector (non-temporal where
// `stream` and `out` is vector-aligned), then N, then the rest (scalar).
template <class E>
HWY_INLINE void QuantizeRow(const typename E::T* in, uint8_t* out, int64_t n, Divisor d,
                            bool stream = false) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  stream = stream && Aligned(out, size_t(4 * N));
  for (; i + 4 * N <= n; i += 4 * N) {
    auto packed = [&](int64_t at) {
      hn::Vec<DU32> c0, c1;
      E4M3Codes2(df, Scaled(df, E::load(df, in + at), d), Scaled(df, E::load(df, in + at + N), d),
                 c0, c1);
      return PackE4M3Codes2(c0, c1);
    };
    StoreE4M3Codes4(packed(i), packed(i + 2 * N), out + i, stream);
  }
#endif
  (void)stream;
  for (; i + N <= n; i += N)
    hn::StoreU(ToE4M3(df, Scaled(df, E::load(df, in + i), d)), DU8(), out + i);
  for (; i < n; ++i) out[i] = float_to_e4m3(E::scalar_load(in[i]) / d.scale);
}

// hn::MulAdd's arithmetic on one float: fused where the target's MulAdd is, else two
// roundings. The scalar tails below spell out which product is rounded, so that they are the
// vector steps' bits in every instantiation (left to contraction, the compiler fused a different
// product in the float16 and float32 ones).
HWY_INLINE float MulAddLikeVector(float a, float b, float c) {
#if HWY_NATIVE_FMA
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// One head of E's dtype rotated once in float32, with the operations of RotateRow (half-split
// pairs, cos_t/sin_t in plain order) or RotateRowInterleaved (GPT-J pairs, the interleaved
// tables cos_il/sin_il), and from the same registers: k_rot rounded to E's dtype (`out`, may be
// null) and the rotated values divided by the scale and quantised (`codes`: the k pool row, an
// fp8 q_rot row, MLA's k_pe part of a cache row; may be null), four vectors of codes per store.
// No float32 row in between; the pass-through elements are copied and quantised as read.
// `stream`: non-temporal stores where every store of a row lands vector-aligned.
template <class E>
HWY_INLINE void RotateRowWithE4M3(const typename E::T* x, typename E::T* out, uint8_t* codes,
                                  const float* HWY_RESTRICT cos_t, const float* HWY_RESTRICT sin_t,
                                  const float* HWY_RESTRICT cos_il,
                                  const float* HWY_RESTRICT sin_il, int64_t rotary_dim,
                                  int64_t head_dim, bool interleaved, bool stream,
                                  Divisor d) {
  using T = typename E::T;
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  // the length of a run of consecutive results: each half, or the whole rotated part
  const int64_t run = interleaved ? rotary_dim : rotary_dim / 2;
  const size_t vec_bytes = size_t(N) * sizeof(T);
  const bool stream_out = stream && out && size_t(run) * sizeof(T) % vec_bytes == 0 &&
                          Aligned(out, vec_bytes);
  const bool stream_codes = stream && codes && run % (4 * N) == 0 && Aligned(codes, size_t(4 * N));
  (void)stream_codes;
  auto store = [&](VF r, int64_t at) __attribute__((always_inline)) {
    if (out) StoreVec<E>(df, r, out + at, stream_out);
  };
  int64_t i = 0;
  if (interleaved) {
#if HWY_TARGET != HWY_SCALAR  // one-lane vectors hold no pair
    auto step = [&](int64_t j) __attribute__((always_inline)) {
      const VF v = E::load(df, x + j);
      const VF r = hn::MulAdd(v, hn::LoadU(df, cos_il + j),
                              hn::Mul(hn::Reverse2(df, v), hn::LoadU(df, sin_il + j)));
      store(r, j);
      return Scaled(df, r, d);
    };
    if (codes) {
      auto packed = [&](int64_t j) __attribute__((always_inline)) {
        hn::Vec<DU32> c0, c1;
        E4M3Codes2(df, step(j), step(j + N), c0, c1);
        return PackE4M3Codes2(c0, c1);
      };
      for (; i + 4 * N <= run; i += 4 * N)
        StoreE4M3Codes4(packed(i), packed(i + 2 * N), codes + i, stream_codes);
    }
    for (; i + N <= run; i += N) {
      const VF r = step(i);
      if (codes) hn::StoreU(ToE4M3(df, r), DU8(), codes + i);
    }
#endif
    for (; i < run; i += 2) {  // i is even here: vectors hold whole pairs
      const float a = E::scalar_load(x[i]), b = E::scalar_load(x[i + 1]);
      // step's lanes: a*cos + round(b*(-sin)), b*cos + round(a*sin)
      const float bs = b * sin_il[i], as = a * sin_il[i + 1];
      const float lo = MulAddLikeVector(a, cos_il[i], bs), hi = MulAddLikeVector(b, cos_il[i + 1], as);
      if (out) out[i] = E::scalar_store(lo), out[i + 1] = E::scalar_store(hi);
      if (codes) codes[i] = float_to_e4m3(lo / d.scale), codes[i + 1] = float_to_e4m3(hi / d.scale);
    }
  } else {
    // pair i: the scaled results for the codes of [i, i + N) and [run + i, run + i + N)
    auto step = [&](int64_t at, VF& lo, VF& hi) __attribute__((always_inline)) {
      const VF a = E::load(df, x + at), b = E::load(df, x + run + at);
      const VF c = hn::LoadU(df, cos_t + at), s = hn::LoadU(df, sin_t + at);
      lo = hn::MulSub(a, c, hn::Mul(b, s));  // a*cos - b*sin
      hi = hn::MulAdd(a, s, hn::Mul(b, c));  // a*sin + b*cos
      store(lo, at);
      store(hi, run + at);
      lo = Scaled(df, lo, d);
      hi = Scaled(df, hi, d);
    };
#if HWY_TARGET != HWY_SCALAR
    if (codes) {
      // pairs at and at + N: the packed codes of both halves
      auto packed = [&](int64_t at, PackedCodes& lo, PackedCodes& hi)
                        __attribute__((always_inline)) {
        VF l0, h0, l1, h1;
        step(at, l0, h0);
        step(at + N, l1, h1);
        hn::Vec<DU32> cl0, ch0, cl1, ch1;
        E4M3Codes2(df, l0, h0, cl0, ch0);
        E4M3Codes2(df, l1, h1, cl1, ch1);
        lo = PackE4M3Codes2(cl0, cl1);
        hi = PackE4M3Codes2(ch0, ch1);
      };
      for (; i + 4 * N <= run; i += 4 * N) {
        PackedCodes lo01, hi01, lo23, hi23;
        packed(i, lo01, hi01);
        packed(i + 2 * N, lo23, hi23);
        StoreE4M3Codes4(lo01, lo23, codes + i, stream_codes);
        StoreE4M3Codes4(hi01, hi23, codes + run + i, stream_codes);
      }
    }
#endif
    for (; i + N <= run; i += N) {
      VF lo, hi;
      step(i, lo, hi);
      if (codes) {
        hn::StoreU(ToE4M3(df, lo), DU8(), codes + i);
        hn::StoreU(ToE4M3(df, hi), DU8(), codes + run + i);
      }
    }
    for (; i < run; ++i) {  // when R/2 is not a multiple of the vector length
      const float a = E::scalar_load(x[i]), b = E::scalar_load(x[i + run]);
      // step's arithmetic: a*cos - round(b*sin), a*sin + round(b*cos)
      const float bs = b * sin_t[i], bc = b * cos_t[i];
      const float lo = MulAddLikeVector(a, cos_t[i], -bs), hi = MulAddLikeVector(a, sin_t[i], bc);
      if (out) out[i] = E::scalar_store(lo), out[i + run] = E::scalar_store(hi);
      if (codes) codes[i] = float_to_e4m3(lo / d.scale), codes[i + run] = float_to_e4m3(hi / d.scale);
    }
  }
  if (out) copy_pass_through(x, out, static_cast<T*>(nullptr), rotary_dim, head_dim);
  if (codes && rotary_dim < head_dim)
    QuantizeRow<E>(x + rotary_dim, codes + rotary_dim, head_dim - rotary_dim, d);
}

#if HWY_TARGET != HWY_SCALAR

// The e4m3 codes of 2N bfloat16 values h divided by the Divisor's scale 2^-k (d.bf16_bits), on
// 16-bit lanes, in memory order (bytes 2j and 2j + 1 of the result are the codes of h's lanes 2j
// and 2j + 1). With a = |h|'s bits (exponent field E, 7 mantissa bits):
// - a normal e4m3 result (a at least the bits of 2^-6 * scale): a, clamped to the bits of
//   448 * scale (infinities too), plus 7, plus its lowest kept bit (bit 4), plus the exponent
//   rebias, shifted right by 4: the code, rounded to nearest even, carries and all;
// - below that, an e4m3 subnormal (rare, so only computed when a lane needs it): the
//   significand 2^7 + mantissa times 2^(E + k - 125), i.e. shifted right by 125 - k - E (5 or
//   more; capped at 15, which gives 0 all the same), rounded to nearest even: add half the
//   shifted-out weight less one and the result's lowest bit before shifting. A bfloat16
//   subnormal (E = 0) or zero takes the same formula; k <= 115 makes its code 0, as it is;
// - NaN: 0x7f; then h's sign at bit 7.
// (Highway 1.0.3's 16-bit variable shift does not compile for SSSE3: that target keeps the
// even/odd path.)
#undef ROPEPOOL_BF16_E4M3_LANES  // defined once per target
#if HWY_TARGET != HWY_SSSE3
#define ROPEPOOL_BF16_E4M3_LANES 1
// The Divisor's constants come as vectors (max, bias, normal, shift0: d.bf16_max ...), set
// once per row: the byte stores of the codes may alias the Divisor, so its fields would be
// loaded and broadcast again for every vector.
using VU16Full = hn::Vec<DU16Full>;
HWY_INLINE VU16 BF16E4M3Codes(VU16Full h, VU16Full max, VU16Full bias, VU16Full normal,
                              VU16Full shift0) {
  const DU16Full du16;
  const auto a = hn::And(h, hn::Set(du16, 0x7fff));
  const auto c = hn::Min(a, max);
  auto code =
      hn::ShiftRight<4>(hn::Add(hn::Add(c, bias), hn::And(hn::ShiftRight<4>(c), hn::Set(du16, 1))));
  const auto small = hn::Lt(a, normal);
  if (HWY_UNLIKELY(!hn::AllFalse(du16, small))) {
    const auto sig = hn::OrAnd(hn::Set(du16, 0x80), a, hn::Set(du16, 0x7f));
    const auto shift = hn::Min(hn::Sub(shift0, hn::ShiftRight<7>(a)), hn::Set(du16, 15));
    const auto half_less_one = hn::Shr(hn::Set(du16, 0x7fff), hn::Sub(hn::Set(du16, 16), shift));
    const auto odd = hn::And(hn::Shr(sig, shift), hn::Set(du16, 1));
    code = hn::IfThenElse(small, hn::Shr(hn::Add(hn::Add(sig, half_less_one), odd), shift), code);
  }
  code = hn::IfThenElse(hn::Gt(a, hn::Set(du16, 0x7f80)), hn::Set(du16, 0x7f), code);
  code = hn::OrAnd(code, hn::ShiftRight<8>(h), hn::Set(du16, 0x80));
  return hn::BitCast(DU16(), hn::TruncateTo(hn::Rebind<uint8_t, DU16Full>(), code));
}
#endif

// QuantizeRow for a bfloat16 row (v, MLA's kv_c): 4N elements per step, on 16-bit lanes
// (BF16E4M3Codes) where the scale allows, else through the even/odd split (the stores
// non-temporal where `stream` and `out` is vector-aligned), then 2N, then the rest (scalar).
HWY_INLINE void QuantizeRowBF16(const uint16_t* in, uint8_t* out, int64_t n, Divisor d,
                                bool stream) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  stream = stream && Aligned(out, size_t(4 * N));
  int64_t i = 0;
#ifdef ROPEPOOL_BF16_E4M3_LANES
  if (d.bf16_bits) {
    const DU16Full du16;
    const auto max = hn::Set(du16, d.bf16_max), bias = hn::Set(du16, d.bf16_bias);
    const auto normal = hn::Set(du16, d.bf16_normal), shift0 = hn::Set(du16, d.bf16_shift0);
    for (; i + 4 * N <= n; i += 4 * N)
      StoreE4M3Full(BF16E4M3Codes(hn::LoadU(du16, in + i), max, bias, normal, shift0),
                    BF16E4M3Codes(hn::LoadU(du16, in + i + 2 * N), max, bias, normal, shift0),
                    out + i, stream);
    for (; i + 2 * N <= n; i += 2 * N)
      StoreE4M3Half(BF16E4M3Codes(hn::LoadU(du16, in + i), max, bias, normal, shift0), out + i);
    QuantizeRow<BFloat16>(in + i, out + i, n - i, d);
    return;
  }
#endif
  auto codes = [&](int64_t at) {
    VF even, odd;
    LoadBF16EvenOdd(in + at, even, odd);
    return E4M3EvenOdd(df, Scaled(df, even, d), Scaled(df, odd, d));
  };
  for (; i + 4 * N <= n; i += 4 * N) StoreE4M3Full(codes(i), codes(i + 2 * N), out + i, stream);
  for (; i + 2 * N <= n; i += 2 * N) StoreE4M3Half(codes(i), out + i);
  QuantizeRow<BFloat16>(in + i, out + i, n - i, d);
}

// A bfloat16 head with half-split pairs, for R/2 a multiple of 2N, rotated into an e4m3 row:
// the rotation of RotateRowBF16 (table in its (even, odd) order), k_rot rounded and stored as
// it stores it (`out` may be null: an fp8 q_rot head has no bfloat16 row), and the same float32
// registers, before that rounding, divided by the scale and quantised into the e4m3 row (`pool`:
// the k pool row or the fp8 q_rot row; null: no slot). No float32 row in between; the
// pass-through elements are copied and quantised as read. `stream`: non-temporal stores for
// both rows where they are vector-aligned.
// `prepare`: as RotateRowBF16's.
template <class Prepare = AsLoaded>
HWY_INLINE void RotateRowBF16WithE4M3(const uint16_t* x, uint16_t* out, uint8_t* pool,
                                      const float* HWY_RESTRICT cos_t,
                                      const float* HWY_RESTRICT sin_t, int64_t rotary_dim,
                                      int64_t head_dim, bool stream, Divisor d,
                                      const Prepare& prepare = {}) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const int64_t half = rotary_dim / 2;
  const size_t vec_bytes = size_t(2 * N) * sizeof(uint16_t);
  const bool stream_here = stream && size_t(half) * sizeof(uint16_t) % vec_bytes == 0 &&
                           Aligned(out, vec_bytes);
  // the pool row in whole vectors of 4N codes: both halves start vector-aligned
  const bool stream_pool = stream && pool && half % (4 * N) == 0 && Aligned(pool, size_t(4 * N));
  // One chunk of 2N pairs at i: k_rot stored, the e4m3 codes of [i, i + 2N) and
  // [half + i, half + i + 2N) returned.
  auto chunk = [&](int64_t i, EvenOddCodes& lo_codes, EvenOddCodes& hi_codes) __attribute__((always_inline)) {
    VF lo_even, lo_odd, hi_even, hi_odd;
    RotateChunkBF16(x, half, i, cos_t, sin_t, prepare, lo_even, lo_odd, hi_even, hi_odd);
    if (out) {
      StoreU16(PackBF16EvenOdd(lo_even, lo_odd), out + i, stream_here);
      StoreU16(PackBF16EvenOdd(hi_even, hi_odd), out + half + i, stream_here);
    }
    if (pool) {
      lo_codes = E4M3EvenOdd(df, Scaled(df, lo_even, d), Scaled(df, lo_odd, d));
      hi_codes = E4M3EvenOdd(df, Scaled(df, hi_even, d), Scaled(df, hi_odd, d));
    }
  };
  EvenOddCodes lo0, hi0, lo1, hi1;
  int64_t i = 0;
  if (pool) {
    for (; i + 4 * N <= half; i += 4 * N) {
      chunk(i, lo0, hi0);
      chunk(i + 2 * N, lo1, hi1);
      StoreE4M3Full(lo0, lo1, pool + i, stream_pool);
      StoreE4M3Full(hi0, hi1, pool + half + i, stream_pool);
    }
  }
  for (; i < half; i += 2 * N) {
    chunk(i, lo0, hi0);
    if (pool) {
      StoreE4M3Half(lo0, pool + i);
      StoreE4M3Half(hi0, pool + half + i);
    }
  }
  if (out) copy_pass_through(x, out, static_cast<uint16_t*>(nullptr), rotary_dim, head_dim);
  if (pool && rotary_dim < head_dim)
    QuantizeRowBF16(x + rotary_dim, pool + rotary_dim, head_dim - rotary_dim, d, stream_pool);
}

// The same for GPT-J pairs, for a rotary_dim that is a multiple of 2N: each chunk's (even, odd)
// registers are the pairs (a, b), rotated with the float32 operations of the generic
// interleaved path (RotateRowWithE4M3: even = a*c - b*s, odd = b*c + a*s, the second product
// rounded first) from the table in plain order; k_rot (`out`, may be null) rounded and stored
// as RotateRowWithE4M3 stores it, the codes (`codes`: the k pool row, the fp8 q_rot row, MLA's k_pe
// part of a cache row; may be null) quantised from the same registers. No interleaved tables
// and no float32 row in between.
HWY_INLINE void RotateRowInterleavedBF16WithE4M3(const uint16_t* x, uint16_t* out, uint8_t* codes,
                                                 const float* HWY_RESTRICT cos_t,
                                                 const float* HWY_RESTRICT sin_t,
                                                 int64_t rotary_dim, int64_t head_dim, bool stream,
                                                 Divisor d) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const bool stream_here = stream && Aligned(out, size_t(2 * N) * sizeof(uint16_t));
  // the codes in whole vectors of 4N: the rotated part and the rest start vector-aligned
  const bool stream_codes =
      stream && codes && rotary_dim % (4 * N) == 0 && Aligned(codes, size_t(4 * N));
  auto chunk = [&](int64_t j, EvenOddCodes& c) __attribute__((always_inline)) {
    VF a, b;
    LoadBF16EvenOdd(x + j, a, b);
    const VF cs = hn::LoadU(df, cos_t + j / 2), sn = hn::LoadU(df, sin_t + j / 2);
    const VF even = hn::MulSub(a, cs, hn::Mul(b, sn)), odd = hn::MulAdd(b, cs, hn::Mul(a, sn));
    if (out) StoreU16(PackBF16EvenOdd(even, odd), out + j, stream_here);
    if (codes) c = E4M3EvenOdd(df, Scaled(df, even, d), Scaled(df, odd, d));
  };
  EvenOddCodes c0, c1;
  int64_t j = 0;
  if (codes) {
    for (; j + 4 * N <= rotary_dim; j += 4 * N) {
      chunk(j, c0);
      chunk(j + 2 * N, c1);
      StoreE4M3Full(c0, c1, codes + j, stream_codes);
    }
  }
  for (; j < rotary_dim; j += 2 * N) {
    chunk(j, c0);
    if (codes) StoreE4M3Half(c0, codes + j);
  }
  if (out) copy_pass_through(x, out, static_cast<uint16_t*>(nullptr), rotary_dim, head_dim);
  if (codes && rotary_dim < head_dim)
    QuantizeRowBF16(x + rotary_dim, codes + rotary_dim, head_dim - rotary_dim, d, stream_codes);
}
#endif

// e4m3(x / scale) of a row as read (v, MLA's kv_c): bfloat16 rows through QuantizeRowBF16
// where vectors hold pairs, every other row through QuantizeRow; non-temporal stores where
// `stream` and `out` is vector-aligned.
template <class E>
HWY_INLINE void QuantizeInputRow(const typename E::T* in, uint8_t* out, int64_t n, Divisor d,
                                 bool stream = false) {
#if HWY_TARGET != HWY_SCALAR
  if constexpr (std::is_same_v<E, BFloat16>) {
    QuantizeRowBF16(in, out, n, d, stream);
    return;
  }
#endif
  QuantizeRow<E>(in, out, n, d, stream);
}

// kQuant: an fp8 pool and/or an fp8 q_rot (SPEC §6). Heads whose outputs are all in q's
// dtype take the plain path; a k head with fp8 pools is rotated once, and k_rot (rounded to
// q's dtype) and the pool row (quantised) come from the same registers: RotateRowWithE4M3, or
// for a bfloat16 head of whole chunks RotateRowBF16WithE4M3 (GPT-J pairs
// RotateRowInterleavedBF16WithE4M3); an fp8 q_rot head goes through the same functions
// without a row in q's dtype. k_rot has the
// plain path's bits except for bfloat16 GPT-J pairs, whose plain path rounds the other product
// of the odd lane (RotateRowInterleavedBF16: a*s + round(b*c); here, as for float32 and float16,
// b*c + round(a*s)), so the two can differ by one ulp near a tie. Scale tensors are read here,
// when the kernel runs.
#if HWY_TARGET != HWY_SCALAR
// NormRow for bfloat16 through the permute-free (even, odd) split of the file comment: 2N
// elements per step; `w` is in (even, odd) order per whole chunk of 2N (PermuteForBF16 over
// the head), in order for the rest.
HWY_INLINE float SumSquaresBF16(const uint16_t* x, int64_t D) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  VF acc_e = hn::Zero(df), acc_o = hn::Zero(df);
  int64_t i = 0;
  for (; i + 2 * N <= D; i += 2 * N) {
    VF e, o;
    LoadBF16EvenOdd(x + i, e, o);
    acc_e = hn::MulAdd(e, e, acc_e);
    acc_o = hn::MulAdd(o, o, acc_o);
  }
  float sum = hn::GetLane(hn::SumOfLanes(df, hn::Add(acc_e, acc_o)));
  for (; i < D; ++i) sum += bf16_to_float(x[i]) * bf16_to_float(x[i]);
  return sum;
}

HWY_INLINE void NormApplyBF16(const uint16_t* x, uint16_t* y, const float* HWY_RESTRICT w,
                              float r, int64_t D, bool gemma) {
  const DF df;
  const hn::RebindToUnsigned<DF> du32;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const int64_t whole = D / (2 * N) * (2 * N);
  int64_t i = 0;
  const VF vr = hn::Set(df, r);
  const auto keep = hn::Set(du32, 0xffff0000u);
  for (i = 0; i < whole; i += 2 * N) {
    VF e, o;
    LoadBF16EvenOdd(x + i, e, o);
    e = hn::Mul(e, vr);
    o = hn::Mul(o, vr);
    if (!gemma) {  // "rms": rounded to bfloat16 (in registers), then times w
      e = hn::BitCast(df, hn::And(RoundToBF16High(e), keep));
      o = hn::BitCast(df, hn::And(RoundToBF16High(o), keep));
    }
    StoreU16(PackBF16EvenOdd(hn::Mul(e, hn::LoadU(df, w + i)), hn::Mul(o, hn::LoadU(df, w + i + N))),
             y + i, false);
  }
  for (; i < D; ++i) {
    const float n = bf16_to_float(x[i]) * r;
    y[i] = float_to_bf16(gemma ? n * w[i] : bf16_to_float(float_to_bf16(n)) * w[i]);
  }
}
#endif

#if HWY_TARGET != HWY_SCALAR
// SPEC §7 inside RotateRowBF16 (its `prepare`), for a half-split head of whole (even, odd)
// chunks with R = D: each loaded vector normalised in registers, the values NormApplyBF16
// writes to its scratch row for RotateRowBF16 to read back, without the pack, store and
// reload between them. kGemma: y = round(x * r * w) with w already 1 + weight; else ("rms")
// y = round(w * round(x * r)). `w` is in (even, odd) order per chunk, as NormApplyBF16's.
template <bool kGemma>
struct NormChunk {
  VF r;
  const float* w;
  VF operator()(VF x, int64_t at) const {
    const DF df;
    VF n = hn::Mul(x, r);
    if constexpr (!kGemma) n = RoundTo<BFloat16>(df, n);
    return RoundTo<BFloat16>(df, hn::Mul(n, hn::LoadU(df, w + at)));
  }
};
#endif  // HWY_TARGET != HWY_SCALAR

template <class E, bool kQuant>
void RunBlockT(const CallPlan& plan, const Block& block) {
  using T = typename E::T;
  constexpr bool kBF16 = std::is_same_v<E, BFloat16> && kEvenOddBF16;
  const RopePoolProblem& p = *plan.problem;
  const int64_t Hq = p.num_qo_heads, D = p.head_dim, R = p.rotary_dim;
  // Per-thread scratch sized by head_dim (grows once, reused across calls): cos and sin
  // (n each), the interleaved forms (2n each), the permuted inv_freq (n doubles).
  const int64_t n = plan.table_size;
  thread_local std::vector<float> table;
  thread_local std::vector<double> inv_freq_permuted;
  if (table.size() < size_t(6 * n)) table.resize(size_t(6 * n));
  float* cos_t = table.data();
  float* sin_t = cos_t + n;
  float* cos_il = sin_t + n;
  float* sin_il = cos_il + 2 * n;
  const double* inv_freq = plan.inv_freq_padded;
#if HWY_TARGET != HWY_SCALAR
  if (kBF16 && !p.interleaved) {
    if (inv_freq_permuted.size() < size_t(n)) inv_freq_permuted.resize(size_t(n));
    PermuteForBF16(inv_freq, n, R / 2, inv_freq_permuted.data());
    inv_freq = inv_freq_permuted.data();
  }
#endif
  // mRoPE (SPEC §7): each frequency's position row, in the table's order, as doubles so that
  // each token's positions per frequency are vector selects.
  thread_local std::vector<double> axis, axis_permuted, pos_per_freq;
  const double* axis_of = nullptr;
  if (p.mrope) {
    axis.assign(size_t(n), 0.0);
    for (int64_t i = 0; i < R / 2; ++i)
      axis[size_t(i)] = double(mrope_axis(p.mrope_section, p.mrope_interleaved, i));
    axis_of = axis.data();
#if HWY_TARGET != HWY_SCALAR
    if (kBF16 && !p.interleaved) {
      axis_permuted.resize(size_t(n));
      PermuteForBF16(axis.data(), n, R / 2, axis_permuted.data());
      axis_of = axis_permuted.data();
    }
#endif
    if (pos_per_freq.size() < size_t(n)) pos_per_freq.resize(size_t(n));
  }
  Index pos_rows[3] = {p.positions, p.positions, p.positions};  // rows of [3, T]
  for (int r = 1; r < 3 && p.mrope; ++r)
    pos_rows[r].data = static_cast<const char*>(p.positions.data) +
                       r * p.positions_row_stride * (p.positions.is_int64 ? 8 : 4);
  // QK norm (SPEC §7): the weights as float32 ("gemma": 1 + w), and a head of scratch.
  thread_local std::vector<float> norm_w;
  thread_local std::vector<T> normed;
  thread_local std::vector<float> norm_r;  // per head of the block: sum of squares, then r
  const bool q_norm = p.q_norm_weight != nullptr, k_norm = p.k_norm_weight != nullptr;
  // bfloat16 half-split heads of whole chunks with R = D are normalised inside the rotation
  // (RotateRowBF16 with NormChunk); the other heads through the scratch row.
  const bool norm_fused = (q_norm || k_norm) && kBF16 && !p.interleaved && R == D &&
                          (D / 2) % (2 * static_cast<int64_t>(hn::Lanes(DF()))) == 0 &&
                          plan.norm_rows == NormRows::kFused;
  if (q_norm || k_norm) {
    norm_w.resize(size_t(2 * D));
    normed.resize(size_t(D));
    // whole vectors for NormScales (the lanes past the block's heads are not read)
    norm_r.resize(size_t(block.head_end - block.head_begin + int64_t(hn::Lanes(DF()))));
    for (int which = 0; which < 2; ++which) {
      const void* w = which ? p.k_norm_weight : p.q_norm_weight;
      if (!w) continue;
      float* out = norm_w.data() + which * D;
      PromoteRow(which ? p.k_norm_dtype : p.q_norm_dtype, w, out, D);
      if (p.norm_gemma)
        for (int64_t d = 0; d < D; ++d) out[d] = 1.0f + out[d];
#if HWY_TARGET != HWY_SCALAR
      if constexpr (kBF16) {  // NormRowBF16 reads whole chunks of 2N in (even, odd) order
        thread_local std::vector<float> plain;
        plain.assign(out, out + D);
        PermuteForBF16(plain.data(), D, D, out);
      }
#endif
    }
  }
  const bool dup_tables = p.interleaved && !kBF16;
  const bool k_rot_written = p.k_out.data != nullptr;
  const float scale = static_cast<float>(p.attention_scaling);
  const bool stream = plan.stream_stores;
  // kQuant: tables in plain order, interleaved ones duplicated (the bf16 paths keep their
  // own).
  float *cos_p = cos_t, *sin_p = sin_t, *cos_pil = cos_il, *sin_pil = sin_il;
  thread_local std::vector<float> plain_table;
  bool fp8_pool = false, fp8_q = false, fused_k = false, fused_q = false;
  Divisor k_div(1.0f), v_div(1.0f), q_div(1.0f);
  if constexpr (kQuant) {
    fp8_pool = p.pool_dtype == DType::Float8E4M3FN;
    fp8_q = p.q_out_dtype == DType::Float8E4M3FN;
    k_div = Divisor(ScaleValue(p.k_scale));
    v_div = Divisor(ScaleValue(p.v_scale));
    q_div = Divisor(ScaleValue(p.q_scale));
    if (kBF16) {
      // fp8-pool k heads and fp8 q_rot heads of whole (even, odd) chunks rotate straight
      // from the bf16 tables (half-split: R/2 in chunks; GPT-J pairs: R)
      const int64_t chunk = 2 * static_cast<int64_t>(hn::Lanes(DF()));
      const bool whole = (p.interleaved ? R : R / 2) % chunk == 0;
      fused_k = fp8_pool && whole;
      fused_q = fp8_q && whole;
      if (plain_table.size() < size_t(6 * n)) plain_table.resize(size_t(6 * n));
      cos_p = plain_table.data();
      sin_p = cos_p + n;
      cos_pil = sin_p + n;
      sin_pil = cos_pil + 2 * n;
    }
  }
  auto row = [](const Rows& r, int64_t index, int64_t head) {
    return static_cast<T*>(r.data) + index * r.row_stride + head * r.head_stride;
  };
  auto pool_row = [](const PoolRows& r, int64_t page, int64_t page_row, int64_t head) {
    return static_cast<T*>(r.data) + page * r.page_stride + page_row * r.row_stride +
           head * r.head_stride;
  };
  const int64_t page_size = p.page_size;
  // The slot token t writes (-1: none, or a later token of the call writes the same slot), and
  // a slot's page and row in it (SPEC §6 paging; 3-D pools: page_size 1, no division).
  auto written_slot = [&](int64_t t) -> int64_t {
    return plan.pool_write_superseded && plan.pool_write_superseded[t] ? -1 : p.slots[t];
  };
  auto page_of = [page_size](int64_t slot, int64_t& page, int64_t& page_row) {
    page = slot, page_row = 0;
    if (page_size != 1 && slot >= 0) {
      page = slot / page_size;
      page_row = slot - page * page_size;
    }
  };
  // Pool rows land at random slots, so nearly every 4 KiB page a row lies in costs a page walk
  // (a nested one in a VM): per token one or two per pool for [P, Hk, D] and NHD pools, one
  // per head with HND (its heads are page_size rows apart). Touching one line of every page
  // the next kPoolTouchBatch tokens will write, in one go, lets those walks overlap instead of
  // stalling the stores one token at a time. (Streamed rows are then overwritten whole.) With
  // plain stores (smaller calls) every line of those rows is prefetched into L2: a plain store
  // first reads its line for ownership, and the random rows' reads then overlap too.
  constexpr int64_t kPoolTouchBatch = 16;
  const int64_t kv_begin = std::max(block.head_begin, Hq) - Hq, kv_end = block.head_end - Hq;
  const size_t pool_es = kQuant && fp8_pool ? 1 : sizeof(T);
  int64_t touched_end = block.token_begin;  // pool rows of tokens below this were touched
  auto touch_pool_rows = [&](int64_t t0) {
    touched_end = std::min(block.token_end, t0 + kPoolTouchBatch);
    for (int64_t u = t0; u < touched_end; ++u) {
      const int64_t slot = written_slot(u);
      if (slot < 0) continue;
      int64_t pg, pg_row;
      page_of(slot, pg, pg_row);
      for (const PoolRows* pool : {&p.k_pool, &p.v_pool}) {
        uintptr_t last_page = 0;
        for (int64_t kv = kv_begin; kv < kv_end; ++kv) {
          const char* at = PoolRow(*pool, pg, pg_row, kv, pool_es);
          if (!stream) {  // plain stores: the whole row, so that they find their lines owned
            PrefetchBytesL2(at, D * int64_t(pool_es));
            continue;
          }
          if ((reinterpret_cast<uintptr_t>(at) >> 12) == last_page) continue;
          last_page = reinterpret_cast<uintptr_t>(at) >> 12;
          hwy::Prefetch(at);
        }
      }
    }
  };
  // The inputs of token t + ahead (q, k and v rows) are prefetched into L2 head by head as
  // token t's heads are rotated, about kPrefetchAheadBytes ahead of the reads. The hardware
  // prefetchers alone kept too few of these streams' misses in flight: the loads waited
  // between bursts of arithmetic, and a large call took about its in-cache time plus the copy
  // time of its bytes (NOTES.md, 2026-12-06).
  // With plain stores (smaller calls) that token's q_rot and k_rot rows are prefetched too,
  // so that the stores find their lines owned instead of each waiting for its read.
  constexpr int64_t kPrefetchAheadBytes = 16384;
  const size_t q_out_es = kQuant && fp8_q ? 1 : sizeof(T);
  auto q_out_row = [&](int64_t t, int64_t h) {
    return static_cast<char*>(p.q_out.data) +
           (t * p.q_out.row_stride + h * p.q_out.head_stride) * int64_t(q_out_es);
  };
  const int64_t row_bytes = D * int64_t(sizeof(T));
  const int64_t q_heads = std::max<int64_t>(0, std::min(block.head_end, Hq) - block.head_begin);
  const int64_t kv_heads = std::max<int64_t>(0, kv_end - kv_begin);  // kv_end < 0: q heads only
  const int64_t read_per_token = (q_heads + 2 * kv_heads) * row_bytes;
  const int64_t ahead = std::max<int64_t>(1, (kPrefetchAheadBytes + read_per_token - 1) / read_per_token);
  for (int64_t t = block.token_begin; t < block.token_end; ++t) {
    if (kv_begin < kv_end && t >= touched_end) touch_pool_rows(t);
    const int64_t pf_t = t + ahead < block.token_end ? t + ahead : -1;
    const bool pf_v = pf_t >= 0 && written_slot(pf_t) >= 0;
    if (axis_of) {  // each frequency's position: row axis_of[i] of the token's three
      const hn::ScalableTag<double> dd;
      const auto p0 = hn::Set(dd, double(pos_rows[0][t])), p1 = hn::Set(dd, double(pos_rows[1][t])),
                 p2 = hn::Set(dd, double(pos_rows[2][t]));
      for (int64_t i = 0; i < n; i += static_cast<int64_t>(hn::Lanes(dd))) {
        const auto a = hn::LoadU(dd, axis_of + i);
        hn::StoreU(hn::IfThenElse(hn::Eq(a, hn::Set(dd, 2.0)), p2,
                                  hn::IfThenElse(hn::Eq(a, hn::Set(dd, 1.0)), p1, p0)),
                   dd, pos_per_freq.data() + i);
      }
    }
    SinCosTable(inv_freq, n, p.positions[t], scale, cos_t, sin_t,
                axis_of ? pos_per_freq.data() : nullptr);
    if (dup_tables) {
      for (int64_t i = 0; i < n; ++i) {
        cos_il[2 * i] = cos_il[2 * i + 1] = cos_t[i];
        sin_il[2 * i] = -sin_t[i];
        sin_il[2 * i + 1] = sin_t[i];
      }
    }
    if constexpr (kQuant && kBF16) {
      // Heads not of whole chunks take RotateRowWithE4M3, which reads its own tables: for
      // GPT-J pairs the interleaved form of cos_t/sin_t (in plain order there), for
      // half-split pairs cos_t/sin_t un-permuted.
      const bool generic_rows = (fp8_q && !fused_q) || (fp8_pool && !fused_k);
      if (generic_rows && p.interleaved) {
        for (int64_t i = 0; i < n; ++i) {
          cos_pil[2 * i] = cos_pil[2 * i + 1] = cos_t[i];
          sin_pil[2 * i] = -sin_t[i];
          sin_pil[2 * i + 1] = sin_t[i];
        }
      } else if (generic_rows) {
        // undo PermuteForBF16 (cheaper than a second table)
        const int64_t N = static_cast<int64_t>(hn::Lanes(DF())), half = R / 2;
        int64_t i = 0;
        for (; i + 2 * N <= half; i += 2 * N)
          for (int64_t j = 0; j < N; ++j) {
            cos_p[i + 2 * j] = cos_t[i + j], cos_p[i + 2 * j + 1] = cos_t[i + N + j];
            sin_p[i + 2 * j] = sin_t[i + j], sin_p[i + 2 * j + 1] = sin_t[i + N + j];
          }
        for (; i < half; ++i) cos_p[i] = cos_t[i], sin_p[i] = sin_t[i];
      }
    }
    auto rotate = [&](const T* x, T* out, T* out2) __attribute__((always_inline)) {
#if HWY_TARGET != HWY_SCALAR
      if constexpr (kBF16) {
        if (p.interleaved)
          RotateRowInterleavedBF16(x, out, out2, cos_t, sin_t, R, D, stream);
        else
          RotateRowBF16(x, out, out2, cos_t, sin_t, R, D, stream);
        return;
      }
#endif
      {
        if (p.interleaved)
          RotateRowInterleaved<E>(x, out, out2, cos_il, sin_il, R, D, stream);
        else
          RotateRow<E>(x, out, out2, cos_t, sin_t, R, D, stream);
      }
    };
    // A head rotated once into k_rot (`out`, may be null) and an e4m3 row (`codes`, may be
    // null) from the same registers; `fused`: a bfloat16 head of whole (even, odd) chunks.
    [[maybe_unused]] auto rotate_e4m3 = [&](const T* x, T* out, uint8_t* codes, const Divisor& d,
                                            bool fused) __attribute__((always_inline)) {
#if HWY_TARGET != HWY_SCALAR
      if constexpr (kBF16) {
        if (fused) {
          if (p.interleaved)
            RotateRowInterleavedBF16WithE4M3(x, out, codes, cos_t, sin_t, R, D, stream, d);
          else
            RotateRowBF16WithE4M3(x, out, codes, cos_t, sin_t, R, D, stream, d);
          return;
        }
      }
#endif
      (void)fused;
      RotateRowWithE4M3<E>(x, out, codes, cos_p, sin_p, cos_pil, sin_pil, R, D, p.interleaved,
                           stream, d);
    };
    const int64_t slot = written_slot(t);
    // SPEC §7: a normalised head is rotated from the scratch row. First the sums of
    // squares of all the block's normalised heads of the token (independent, so they
    // overlap, and so do their square roots and divisions), then head by head the second
    // pass and the rotation (the token's heads are still in L1).
    if (q_norm || k_norm) {
      for (int64_t h = block.head_begin; h < block.head_end; ++h) {
        const bool is_q = h < Hq;
        if (!(is_q ? q_norm : k_norm)) continue;
        const T* x = is_q ? row(p.q, t, h) : row(p.k, t, h - Hq);
        float sum;
#if HWY_TARGET != HWY_SCALAR
        if constexpr (kBF16)
          sum = SumSquaresBF16(x, D);
        else
#endif
          sum = SumSquares<E>(x, D);
        norm_r[size_t(h - block.head_begin)] = sum;
      }
      NormScales(norm_r.data(), block.head_end - block.head_begin, static_cast<float>(D), p.norm_eps);
    }
    auto norm = [&](const T* x, int which, int64_t h) -> const T* {
      const float r = norm_r[size_t(h - block.head_begin)];
#if HWY_TARGET != HWY_SCALAR
      if constexpr (kBF16) {
        NormApplyBF16(x, normed.data(), norm_w.data() + which * D, r, D, p.norm_gemma);
        return normed.data();
      }
#endif
      NormApply<E>(x, normed.data(), norm_w.data() + which * D, r, D, p.norm_gemma);
      return normed.data();
    };
    // A head normalised in registers as it is rotated (norm_fused), into out and out2 (may be
    // null), or with `codes` into out (may be null) and the e4m3 row `codes` (may be null:
    // no pool row) as rotate_e4m3 would.
    [[maybe_unused]] auto norm_rotate = [&](const T* x, int which, int64_t h, T* out, T* out2,
                                            uint8_t* codes = nullptr, const Divisor* d = nullptr)
                                            __attribute__((always_inline)) {
#if HWY_TARGET != HWY_SCALAR
      if constexpr (kBF16) {
        const float* w = norm_w.data() + which * D;
        const VF r = hn::Set(DF(), norm_r[size_t(h - block.head_begin)]);
        auto with = [&](const auto& prepare) __attribute__((always_inline)) {
          if (d != nullptr)
            RotateRowBF16WithE4M3(x, out, codes, cos_t, sin_t, R, D, stream, *d, prepare);
          else
            RotateRowBF16(x, out, out2, cos_t, sin_t, R, D, stream, prepare);
        };
        if (p.norm_gemma) with(NormChunk<true>{r, w});
        else with(NormChunk<false>{r, w});
      }
#endif
      (void)x, (void)which, (void)h, (void)out, (void)out2, (void)codes, (void)d;
    };
    int64_t page, page_row;
    page_of(slot, page, page_row);
    for (int64_t h = block.head_begin; h < block.head_end; ++h) {
      if (pf_t >= 0) {
        if (h < Hq) {
          PrefetchBytesL2(row(p.q, pf_t, h), row_bytes);
          if (!stream) PrefetchBytesL2(q_out_row(pf_t, h), D * int64_t(q_out_es));
        } else {
          PrefetchBytesL2(row(p.k, pf_t, h - Hq), row_bytes);
          if (pf_v) PrefetchBytesL2(row(p.v, pf_t, h - Hq), row_bytes);
          if (!stream && k_rot_written) PrefetchBytesL2(row(p.k_out, pf_t, h - Hq), row_bytes);
        }
      }
      if (h < Hq) {
        const bool in_rotation = q_norm && norm_fused;  // normalised by norm_rotate
        const T* x = q_norm && !in_rotation ? norm(row(p.q, t, h), 0, h) : row(p.q, t, h);
        if (kQuant && fp8_q) {
          uint8_t* const codes = reinterpret_cast<uint8_t*>(q_out_row(t, h));
          if (in_rotation) norm_rotate(x, 0, h, nullptr, nullptr, codes, &q_div);
          else rotate_e4m3(x, nullptr, codes, q_div, fused_q);
        } else if (in_rotation)
          norm_rotate(x, 0, h, row(p.q_out, t, h), nullptr);
        else
          rotate(x, row(p.q_out, t, h), nullptr);
        continue;
      }
      const int64_t kv = h - Hq;
      // k_rot (null: not asked for, SPEC §4 return_k_rot=False); with neither k_rot nor a
      // pool row the head has nothing to write.
      T* const k_rot = k_rot_written ? row(p.k_out, t, kv) : nullptr;
      if (!k_rot && slot < 0) continue;
      const bool in_rotation = k_norm && norm_fused;  // normalised by norm_rotate
      const T* x = k_norm && !in_rotation ? norm(row(p.k, t, kv), 1, h) : row(p.k, t, kv);
      if (kQuant && fp8_pool) {
        uint8_t* k_dst = nullptr;
        uint8_t* v_dst = nullptr;
        if (slot >= 0) {
          k_dst = reinterpret_cast<uint8_t*>(PoolRow(p.k_pool, page, page_row, kv, 1));
          v_dst = reinterpret_cast<uint8_t*>(PoolRow(p.v_pool, page, page_row, kv, 1));
        }
        if (in_rotation) norm_rotate(x, 1, h, k_rot, nullptr, k_dst, &k_div);
        else rotate_e4m3(x, k_rot, k_dst, k_div, fused_k);
        if (v_dst) QuantizeInputRow<E>(row(p.v, t, kv), v_dst, D, v_div, stream);
        continue;
      }
      T* const k_dst = slot >= 0 ? pool_row(p.k_pool, page, page_row, kv) : nullptr;
      // without k_rot the pool row is the rotation's first output
      if (in_rotation)
        norm_rotate(x, 1, h, k_rot ? k_rot : k_dst, k_rot ? k_dst : nullptr);
      else
        rotate(x, k_rot ? k_rot : k_dst, k_rot ? k_dst : nullptr);
      if (slot >= 0)
        CopyBytes(pool_row(p.v_pool, page, page_row, kv), row(p.v, t, kv), size_t(D) * sizeof(T),
                  stream);
    }
  }
  // Non-temporal stores are weakly ordered: fence before this thread reports completion.
  if (stream) hwy::FlushStream();
}

void RunBlock(const CallPlan& plan, const Block& block) {
  if (plan.problem->pool_dtype == DType::Float8E4M3FN ||
      plan.problem->q_out_dtype == DType::Float8E4M3FN) {
    switch (plan.problem->dtype) {
      case DType::Float32: return RunBlockT<Float32, true>(plan, block);
      case DType::Float16: return RunBlockT<Float16, true>(plan, block);
      case DType::BFloat16: return RunBlockT<BFloat16, true>(plan, block);
      default: return;
    }
  }
  switch (plan.problem->dtype) {
    case DType::Float32: return RunBlockT<Float32, false>(plan, block);
    case DType::Float16: return RunBlockT<Float16, false>(plan, block);
    case DType::BFloat16: return RunBlockT<BFloat16, false>(plan, block);
    default: return;
  }
}

// The kernels' float -> 16-bit rounding, exposed for exhaustive tests: bf16 through the
// even/odd packing (whole chunks) and the generic path (the rest), f16 through store_bits.
void DemoteRow(DType dtype, const float* in, void* out, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  auto* out16 = static_cast<uint16_t*>(out);
  if (kEvenOddBF16 && dtype == DType::BFloat16) {
#if HWY_TARGET != HWY_SCALAR
    // Inputs in memory order; the packing wants even and odd elements apart.
    HWY_ALIGN float even[hn::MaxLanes(DF())], odd[hn::MaxLanes(DF())];
    for (; i + 2 * N <= n; i += 2 * N) {
      for (int64_t j = 0; j < N; ++j) {
        even[j] = in[i + 2 * j];
        odd[j] = in[i + 2 * j + 1];
      }
      hn::StoreU(PackBF16EvenOdd(hn::Load(df, even), hn::Load(df, odd)), DU16Full(), out16 + i);
    }
#endif
  }
  for (; i + N <= n; i += N) {
    const VF v = hn::LoadU(df, in + i);
    if (dtype == DType::Float16)
      hn::StoreU(Float16::store_bits(df, v), DU16(), out16 + i);
    else if (dtype == DType::BFloat16)
      hn::StoreU(BFloat16::store_bits(df, v), DU16(), out16 + i);
    else
      hn::StoreU(v, df, static_cast<float*>(out) + i);
  }
  for (; i < n; ++i) {
    if (dtype == DType::Float16)
      out16[i] = float_to_half(in[i]);
    else if (dtype == DType::BFloat16)
      out16[i] = float_to_bf16(in[i]);
    else
      static_cast<float*>(out)[i] = in[i];
  }
}

// The kernels' float32 -> e4m3 quantisation (x / scale), exposed for tests.
void QuantizeE4M3Row(const float* in, uint8_t* out, int64_t n, float scale) {
  QuantizeRow<Float32>(in, out, n, Divisor(scale));
}

void QuantizeE4M3BF16Row(const uint16_t* in, uint8_t* out, int64_t n, float scale) {
  QuantizeInputRow<BFloat16>(in, out, n, Divisor(scale));
}

void PromoteRow(DType dtype, const void* in, float* out, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto* in16 = static_cast<const uint16_t*>(in);
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    if (dtype == DType::Float16)
      hn::StoreU(Float16::load(df, in16 + i), df, out + i);
    else if (dtype == DType::BFloat16)
      hn::StoreU(BFloat16::load(df, in16 + i), df, out + i);
    else
      hn::StoreU(hn::LoadU(df, static_cast<const float*>(in) + i), df, out + i);
  }
  for (; i < n; ++i)
    out[i] = dtype == DType::Float16    ? half_to_float(in16[i])
             : dtype == DType::BFloat16 ? bf16_to_float(in16[i])
                                        : static_cast<const float*>(in)[i];
}

#endif  // ROPEPOOL_HWY_HERE

}  // namespace HWY_NAMESPACE
}  // namespace ropepool::detail::cpu
HWY_AFTER_NAMESPACE();

// mla_rope_pool_fused's rows, on the helpers above (per target).
#include "mla_hwy-inl.h"

#endif  // per-target include guard
