// The README's C++ example, built against an installed ropepool.
#include <ropepool/half.hpp>
#include <ropepool/ropepool.hpp>

#include <cstdio>
#include <random>
#include <vector>

int main() {
  using ropepool::DType, ropepool::TensorView;
  const int64_t T = 4, Hq = 32, Hk = 8, D = 128, P = 1024;
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal;
  auto random_bf16 = [&](int64_t n) {
    std::vector<uint16_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = ropepool::float_to_bf16(normal(rng));
    return v;
  };
  std::vector<uint16_t> q = random_bf16(T * Hq * D), k = random_bf16(T * Hk * D),
                        v = random_bf16(T * Hk * D), k_pool = random_bf16(P * Hk * D),
                        v_pool = random_bf16(P * Hk * D), q_rot(q.size()), k_rot(k.size());
  std::vector<int32_t> positions = {0, 1, 2, 3}, slots = {10, 11, -1, 12};

  ropepool::RopePoolTensors t;
  t.q = TensorView::contiguous(q.data(), DType::BFloat16, {T, Hq, D});
  t.k = TensorView::contiguous(k.data(), DType::BFloat16, {T, Hk, D});
  t.v = TensorView::contiguous(v.data(), DType::BFloat16, {T, Hk, D});
  t.positions = TensorView::contiguous(positions.data(), DType::Int32, {T});
  t.slots = TensorView::contiguous(slots.data(), DType::Int32, {T});
  t.k_pool = TensorView::contiguous(k_pool.data(), DType::BFloat16, {P, Hk, D});
  t.v_pool = TensorView::contiguous(v_pool.data(), DType::BFloat16, {P, Hk, D});
  t.q_out = TensorView::contiguous(q_rot.data(), DType::BFloat16, {T, Hq, D});
  t.k_out = TensorView::contiguous(k_rot.data(), DType::BFloat16, {T, Hk, D});
  ropepool::RopePoolParams p{.head_dim = D, .num_qo_heads = Hq, .num_kv_heads = Hk,
                             .rope_base = 500000.0};
  ropepool::rope_pool_fused(t, p);

  // k_pool row 11 now holds k_rot of token 1, bit for bit
  for (int64_t i = 0; i < Hk * D; ++i)
    if (k_pool[size_t(11 * Hk * D + i)] != k_rot[size_t(1 * Hk * D + i)]) return 1;

  // a bad slot is an error, and nothing is written
  slots[3] = int32_t(P);
  try {
    ropepool::rope_pool_fused(t, p);
    return 1;
  } catch (const ropepool::Error& e) {
    std::printf("rejected as expected: %s\n  hint: %s\n", e.what(), e.hint().c_str());
  }
  std::printf("example ok\n");
  return 0;
}
