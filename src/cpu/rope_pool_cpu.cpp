// CPU backend (first version: plain scalar loops, single thread).
#include <cmath>
#include <cstring>
#include <numbers>
#include <vector>

#include "../backend.hpp"
#include "ropepool/half.hpp"

namespace ropepool::detail {
namespace {

struct F32 {
  using T = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};
struct F16 {
  using T = uint16_t;
  static float load(uint16_t x) { return half_to_float(x); }
  static uint16_t store(float x) { return float_to_half(x); }
};
struct BF16 {
  using T = uint16_t;
  static float load(uint16_t x) { return bf16_to_float(x); }
  static uint16_t store(float x) { return float_to_bf16(x); }
};

// The angle reduced in double (|pos * inv_freq| up to ~2^21 keeps ~30 correct bits after
// reduction), then float32 sin/cos on [-pi, pi].
void sincos_table(int64_t pos, const double* inv_freq, int64_t half, double scale, float* cos_out,
                  float* sin_out) {
  constexpr double kTwoPi = 2 * std::numbers::pi;
  for (int64_t i = 0; i < half; ++i) {
    const double theta = double(pos) * inv_freq[i];
    const float r = float(theta - std::nearbyint(theta / kTwoPi) * kTwoPi);
    cos_out[i] = float(scale) * std::cos(r);
    sin_out[i] = float(scale) * std::sin(r);
  }
}

template <class E>
void rotate_row(const typename E::T* x, typename E::T* out, typename E::T* out2, const float* c,
                const float* s, int64_t R, int64_t D) {
  const int64_t half = R / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = E::load(x[i]), b = E::load(x[i + half]);
    const auto lo = E::store(a * c[i] - b * s[i]);
    const auto hi = E::store(a * s[i] + b * c[i]);
    out[i] = lo;
    out[i + half] = hi;
    if (out2) {
      out2[i] = lo;
      out2[i + half] = hi;
    }
  }
  for (int64_t d = R; d < D; ++d) {
    out[d] = x[d];
    if (out2) out2[d] = x[d];
  }
}

template <class E>
void run(const RopePoolProblem& p) {
  using T = typename E::T;
  const int64_t half = p.rotary_dim / 2, D = p.head_dim;
  std::vector<float> cs(static_cast<size_t>(2 * half));
  auto at = [](const Rows& r, int64_t row, int64_t h) {
    return static_cast<T*>(r.data) + row * r.row_stride + h * r.head_stride;
  };
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    sincos_table(p.positions[t], p.inv_freq, half, p.attention_scaling, cs.data(),
                 cs.data() + half);
    const int64_t slot = p.slots[t];
    for (int64_t h = 0; h < p.num_qo_heads; ++h)
      rotate_row<E>(at(p.q, t, h), at(p.q_out, t, h), nullptr, cs.data(), cs.data() + half,
                    p.rotary_dim, D);
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      rotate_row<E>(at(p.k, t, h), at(p.k_out, t, h), slot >= 0 ? at(p.k_pool, slot, h) : nullptr,
                    cs.data(), cs.data() + half, p.rotary_dim, D);
      if (slot >= 0) std::memcpy(at(p.v_pool, slot, h), at(p.v, t, h), size_t(D) * sizeof(T));
    }
  }
}

}  // namespace

void rope_pool_cpu(const RopePoolProblem& p) {
  switch (p.dtype) {
    case DType::Float32: return run<F32>(p);
    case DType::Float16: return run<F16>(p);
    case DType::BFloat16: return run<BF16>(p);
    default: return;
  }
}

}  // namespace ropepool::detail
