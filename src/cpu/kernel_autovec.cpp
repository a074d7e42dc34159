// The plain C++ CPU kernel: scalar-looking loops over fixed-size blocks of local buffers,
// left to the compiler's auto-vectoriser. It is compiled three times through GCC/Clang
// target attributes (baseline x86-64, AVX2+FMA+F16C, AVX-512) and picked at run time, so no
// global -march flag is needed. Kept next to the Highway kernel as a measured alternative
// (see rope_pool_cpu.cpp for the figures); the sin/cos table is shared with it.
#include <bit>
#include <cstring>
#include <vector>

#include "cpu_kernels.hpp"
#include "ropepool/half.hpp"

namespace ropepool::detail::cpu {
namespace {

#define ROPEPOOL_INLINE [[gnu::always_inline]] inline

struct F32 {
  using T = float;
  ROPEPOOL_INLINE static float load(float x) { return x; }
  ROPEPOOL_INLINE static float store(float x) { return x; }
};

struct BF16 {
  using T = uint16_t;
  ROPEPOOL_INLINE static float load(uint16_t h) { return std::bit_cast<float>(uint32_t(h) << 16); }
  // Round to nearest even in integer ops, NaN kept NaN (quiet bit set), branch-free so the
  // loop vectorises.
  ROPEPOOL_INLINE static uint16_t store(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
    const uint32_t bits = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x400000u) : rounded;
    return uint16_t(bits >> 16);
  }
};

#if defined(__FLT16_MAX__)
// _Float16 conversions: F16C vcvtph2ps/vcvtps2ph (round to nearest even) when the target has
// them, libgcc's correctly rounded soft conversions otherwise.
struct F16 {
  using T = uint16_t;
  ROPEPOOL_INLINE static float load(uint16_t h) { return float(std::bit_cast<_Float16>(h)); }
  ROPEPOOL_INLINE static uint16_t store(float f) {
    return std::bit_cast<uint16_t>(static_cast<_Float16>(f));
  }
};
#else
struct F16 {
  using T = uint16_t;
  ROPEPOOL_INLINE static float load(uint16_t h) { return half_to_float(h); }
  ROPEPOOL_INLINE static uint16_t store(float f) { return float_to_half(f); }
};
#endif

// Pairs per block: local buffers of a fixed size keep the loops free of aliasing questions
// (q_out may be q itself for in-place rotation).
constexpr int64_t kBlock = 64;

template <class E>
ROPEPOOL_INLINE void rotate_row(const typename E::T* x, typename E::T* out, typename E::T* out2,
                                const float* cos_t, const float* sin_t, int64_t rotary_dim,
                                int64_t head_dim) {
  using T = typename E::T;
  const int64_t half = rotary_dim / 2;
  for (int64_t i0 = 0; i0 < half; i0 += kBlock) {
    const int64_t n = half - i0 < kBlock ? half - i0 : kBlock;
    float a[kBlock], b[kBlock];
    T lo[kBlock], hi[kBlock];
    for (int64_t i = 0; i < n; ++i) {
      a[i] = E::load(x[i0 + i]);
      b[i] = E::load(x[half + i0 + i]);
    }
    for (int64_t i = 0; i < n; ++i) {
      lo[i] = E::store(a[i] * cos_t[i0 + i] - b[i] * sin_t[i0 + i]);
      hi[i] = E::store(a[i] * sin_t[i0 + i] + b[i] * cos_t[i0 + i]);
    }
    for (int64_t i = 0; i < n; ++i) {
      out[i0 + i] = lo[i];
      out[half + i0 + i] = hi[i];
    }
    if (out2)
      for (int64_t i = 0; i < n; ++i) {
        out2[i0 + i] = lo[i];
        out2[half + i0 + i] = hi[i];
      }
  }
  copy_pass_through(x, out, out2, rotary_dim, head_dim);
}

// GPT-J pairs (x[2i], x[2i+1]).
template <class E>
ROPEPOOL_INLINE void rotate_row_interleaved(const typename E::T* x, typename E::T* out,
                                            typename E::T* out2, const float* cos_t,
                                            const float* sin_t, int64_t rotary_dim,
                                            int64_t head_dim) {
  using T = typename E::T;
  for (int64_t j0 = 0; j0 < rotary_dim; j0 += 2 * kBlock) {
    const int64_t n = rotary_dim - j0 < 2 * kBlock ? rotary_dim - j0 : 2 * kBlock;  // even
    float v[2 * kBlock];
    T o[2 * kBlock];
    for (int64_t j = 0; j < n; ++j) v[j] = E::load(x[j0 + j]);
    for (int64_t i = 0; i < n / 2; ++i) {
      const float a = v[2 * i], b = v[2 * i + 1];
      const float c = cos_t[j0 / 2 + i], s = sin_t[j0 / 2 + i];
      o[2 * i] = E::store(a * c - b * s);
      o[2 * i + 1] = E::store(a * s + b * c);
    }
    for (int64_t j = 0; j < n; ++j) out[j0 + j] = o[j];
    if (out2)
      for (int64_t j = 0; j < n; ++j) out2[j0 + j] = o[j];
  }
  copy_pass_through(x, out, out2, rotary_dim, head_dim);
}

template <class E>
ROPEPOOL_INLINE void run_block_t(const CallPlan& plan, const Block& block, float* cos_t,
                                 float* sin_t) {
  using T = typename E::T;
  const RopePoolProblem& p = *plan.problem;
  const float scale = static_cast<float>(p.attention_scaling);
  const int64_t Hq = p.num_qo_heads, D = p.head_dim, R = p.rotary_dim;
  for (int64_t t = block.token_begin; t < block.token_end; ++t) {
    sincos_table(plan.inv_freq_padded, plan.table_size, p.positions[t], scale, cos_t, sin_t);
    int64_t slot = p.slots[t];
    if (plan.pool_write_superseded && plan.pool_write_superseded[t]) slot = -1;
    for (int64_t h = block.head_begin; h < block.head_end; ++h) {
      if (h < Hq) {
        T* out = static_cast<T*>(p.q_out.data) + t * p.q_out.row_stride + h * p.q_out.head_stride;
        const T* x = static_cast<const T*>(p.q.data) + t * p.q.row_stride + h * p.q.head_stride;
        if (p.interleaved)
          rotate_row_interleaved<E>(x, out, nullptr, cos_t, sin_t, R, D);
        else
          rotate_row<E>(x, out, nullptr, cos_t, sin_t, R, D);
        continue;
      }
      const int64_t kv = h - Hq;
      const T* x = static_cast<const T*>(p.k.data) + t * p.k.row_stride + kv * p.k.head_stride;
      T* out = static_cast<T*>(p.k_out.data) + t * p.k_out.row_stride + kv * p.k_out.head_stride;
      T* pool = slot >= 0 ? static_cast<T*>(p.k_pool.data) + slot * p.k_pool.row_stride +
                                kv * p.k_pool.head_stride
                          : nullptr;
      if (p.interleaved)
        rotate_row_interleaved<E>(x, out, pool, cos_t, sin_t, R, D);
      else
        rotate_row<E>(x, out, pool, cos_t, sin_t, R, D);
      if (slot >= 0)
        std::memcpy(static_cast<T*>(p.v_pool.data) + slot * p.v_pool.row_stride +
                        kv * p.v_pool.head_stride,
                    static_cast<const T*>(p.v.data) + t * p.v.row_stride + kv * p.v.head_stride,
                    size_t(D) * sizeof(T));
    }
  }
}

ROPEPOOL_INLINE void run_block_any(const CallPlan& plan, const Block& block, float* cos_t,
                                   float* sin_t) {
  switch (plan.problem->dtype) {
    case DType::Float32: return run_block_t<F32>(plan, block, cos_t, sin_t);
    case DType::Float16: return run_block_t<F16>(plan, block, cos_t, sin_t);
    case DType::BFloat16: return run_block_t<BF16>(plan, block, cos_t, sin_t);
    default: return;
  }
}

// GCC only: clang 14 rejects "bmi2" in __builtin_cpu_supports and ignores the whole target
// attribute over "prefer-vector-width"; a clang build (the fuzzer) uses the baseline clone.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ROPEPOOL_AUTOVEC_CLONES 1
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,"
                      "prefer-vector-width=512"))) void
run_block_avx512(const CallPlan& plan, const Block& block, float* cos_t, float* sin_t) {
  run_block_any(plan, block, cos_t, sin_t);
}
__attribute__((target("avx2,fma,f16c,bmi,bmi2"))) void run_block_avx2(const CallPlan& plan,
                                                                     const Block& block,
                                                                     float* cos_t, float* sin_t) {
  run_block_any(plan, block, cos_t, sin_t);
}
#endif
void run_block_baseline(const CallPlan& plan, const Block& block, float* cos_t, float* sin_t) {
  run_block_any(plan, block, cos_t, sin_t);
}

using BlockFn = void (*)(const CallPlan&, const Block&, float*, float*);

BlockFn pick() {
#ifdef ROPEPOOL_AUTOVEC_CLONES
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return run_block_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2"))
    return run_block_avx2;
#endif
  return run_block_baseline;
}

}  // namespace

void run_block_autovec(const CallPlan& plan, const Block& block) {
  static const BlockFn fn = pick();
  thread_local std::vector<float> table;
  if (table.size() < size_t(2 * plan.table_size)) table.resize(size_t(2 * plan.table_size));
  fn(plan, block, table.data(), table.data() + plan.table_size);
}

}  // namespace ropepool::detail::cpu
