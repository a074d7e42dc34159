// CPU backend of mla_rope_pool_fused (SPEC §8). Per token: one sin/cos table (the angle
// in double, reduced mod 2*pi, as rope_pool_fused's kernel), then every q_pe head and the
// k_pe head rotated in float32 rows (the dtype conversions are the Highway row helpers, the
// rotation loops vectorise), then the cache row: kv_c copied (or quantised) and k_pe_rot.
// Threads take contiguous token runs on the library's thread pool.
#include <algorithm>
#include <cassert>
#include <cstring>
#include <vector>

#include "../mla_backend.hpp"
#include "cpu_kernels.hpp"
#include "ropepool/half.hpp"
#include "ropepool/rope_pool.hpp"

namespace ropepool::detail {
namespace cpu {
namespace {

struct MlaPlan {
  const MlaProblem* p = nullptr;
  const double* inv_freq_padded = nullptr;
  int64_t table_size = 0;
  int64_t tokens_per_item = 1;
  float scale = 1.0f;  // fp8 caches
  /// nullptr, or 1 for a token whose cache row a later token of the call also writes: its
  /// write is skipped so that, with several threads, the row is exactly the last token's.
  const uint8_t* superseded = nullptr;
};

template <class T>
T* at(void* base, int64_t offset) {
  return static_cast<T*>(base) + offset;
}

// out[0, R) = the rotation of x[0, R) (float32, cos/sin already scaled).
void rotate(const float* x, float* out, const float* c, const float* s, int64_t R, bool gptj) {
  const int64_t half = R / 2;
  if (gptj) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      out[2 * i] = a * c[i] - b * s[i];
      out[2 * i + 1] = a * s[i] + b * c[i];
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      out[i] = a * c[i] - b * s[i];
      out[i + half] = a * s[i] + b * c[i];
    }
  }
}

void quantise(const float* x, uint8_t* out, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) out[i] = e4m3_bits(x[i] / scale);
}

void run_tokens(const MlaPlan& plan, int64_t t0, int64_t t1) {
  const MlaProblem& p = *plan.p;
  const int64_t R = p.rope_dim, L = p.latent_dim, es = int64_t(dtype_size(p.dtype));
  const bool fp8 = p.cache_dtype == DType::Float8E4M3FN;
  thread_local std::vector<float> scratch;
  scratch.resize(size_t(2 * plan.table_size + 2 * R + (fp8 ? L : 0)));
  float* cos_row = scratch.data();
  float* sin_row = cos_row + plan.table_size;
  float* in = sin_row + plan.table_size;
  float* out = in + R;
  float* latent = out + R;
  const float att = float(p.attention_scaling);
  for (int64_t t = t0; t < t1; ++t) {
    sincos_table(plan.inv_freq_padded, plan.table_size, p.positions[t], att, cos_row, sin_row);
    for (int64_t h = 0; h < p.num_heads; ++h) {
      const int64_t src = t * p.q_pe.row_stride + h * p.q_pe.head_stride;
      const int64_t dst = t * p.q_out.row_stride + h * p.q_out.head_stride;
      promote_row_hwy(p.dtype, static_cast<const char*>(p.q_pe.data) + src * es, in, R);
      rotate(in, out, cos_row, sin_row, R, p.interleaved);
      demote_row_hwy(p.dtype, out, static_cast<char*>(p.q_out.data) + dst * es, R);
    }
    promote_row_hwy(p.dtype, static_cast<const char*>(p.k_pe.data) + t * p.k_pe.row_stride * es, in, R);
    rotate(in, out, cos_row, sin_row, R, p.interleaved);
    char* k_dst = static_cast<char*>(p.k_out.data) + t * p.k_out.row_stride * es;
    demote_row_hwy(p.dtype, out, k_dst, R);

    const int64_t slot = p.slots[t];
    if (slot < 0 || (plan.superseded && plan.superseded[t])) continue;
    assert(slot < p.pool_size);
    const int64_t row = (slot / p.page_size) * p.cache.page_stride +
                        (slot % p.page_size) * p.cache.row_stride;
    const char* kv = static_cast<const char*>(p.kv_c.data) + t * p.kv_c.row_stride * es;
    if (fp8) {
      uint8_t* dst = at<uint8_t>(p.cache.data, row);
      promote_row_hwy(p.dtype, kv, latent, L);
      quantise(latent, dst, L, plan.scale);
      quantise(out, dst + L, R, plan.scale);  // the rotated value before rounding to k's dtype
    } else {
      char* dst = static_cast<char*>(p.cache.data) + row * es;
      std::memcpy(dst, kv, size_t(L * es));
      std::memcpy(dst + L * es, k_dst, size_t(R * es));
    }
  }
}

void run_item(const void* ctx, int64_t item) {
  const auto& plan = *static_cast<const MlaPlan*>(ctx);
  const int64_t t0 = item * plan.tokens_per_item;
  run_tokens(plan, t0, std::min(plan.p->num_tokens, t0 + plan.tokens_per_item));
}

// Every token whose slot a later token also names (one pass, slot -> latest token).
const uint8_t* mark_superseded(const Index& slots, int64_t T) {
  thread_local std::vector<uint8_t> superseded;
  thread_local std::vector<std::pair<int64_t, int64_t>> order;
  superseded.assign(size_t(T), 0);
  order.clear();
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) order.emplace_back(slots[t], t);
  std::sort(order.begin(), order.end());
  for (size_t i = 0; i + 1 < order.size(); ++i)
    if (order[i].first == order[i + 1].first) superseded[size_t(order[i].second)] = 1;
  return superseded.data();
}

}  // namespace
}  // namespace cpu

void mla_rope_pool_cpu(const MlaProblem& p) {
  using namespace cpu;
  const int64_t T = p.num_tokens, half = p.rope_dim / 2;
  if (T == 0) return;
  thread_local std::vector<double> inv_freq_padded;
  const int64_t table_size = round_up(half, kTablePad);
  inv_freq_padded.assign(size_t(table_size), 0.0);
  std::copy(p.inv_freq, p.inv_freq + half, inv_freq_padded.begin());

  MlaPlan plan;
  plan.p = &p;
  plan.inv_freq_padded = inv_freq_padded.data();
  plan.table_size = table_size;
  plan.scale = p.kv_scale.ptr ? *p.kv_scale.ptr : p.kv_scale.value;  // read when the call runs

  const int64_t es = int64_t(dtype_size(p.dtype));
  const int64_t bytes = T * es * (2 * p.num_heads * p.rope_dim + 3 * p.rope_dim + 2 * p.latent_dim);
  const int threads =
      int(std::clamp<int64_t>(bytes / parallel_min_bytes(), 1, std::max(1, cpu_num_threads())));
  if (threads == 1 || T == 1) {
    run_tokens(plan, 0, T);
    return;
  }
  if (!p.check_slots) plan.superseded = mark_superseded(p.slots, T);
  const int64_t target_items = int64_t(threads) * 8;
  plan.tokens_per_item = std::max<int64_t>(1, (T + target_items - 1) / target_items);
  parallel_for(threads, (T + plan.tokens_per_item - 1) / plan.tokens_per_item, run_item, &plan);
}

}  // namespace ropepool::detail
