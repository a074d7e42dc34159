// SPEC §7 on CUDA: QK RMSNorm before RoPE, in one launch (mRoPE alone runs in
// rope_pool_token_kernel, whose table build reads each frequency's position row).
//
// A separate, simpler kernel than rope_pool_token_kernel (whose lanes hold units of several
// heads, so a per-head norm would need a reduction across heads): one CTA per token; the
// token's sin/cos table in shared memory (mRoPE too, as in the main kernel); then a warp
// per head. A warp reads its head once (each lane D/32
// elements) into a per-warp shared row, sums the squares with a warp reduction (float32),
// normalises in place with SPEC §7's rounding points, and rotates from the shared row into
// q_out / k_out (and the pool). One warp writes all kv heads of a token, so a pool row is
// always one token's (SPEC §3); with several tokens it holds the row's spin lock while it
// writes, as the main kernel's lock mode does.
#pragma once

#include <cstdint>

#include "rope_pool_kernel.cuh"
#include "vec.cuh"

namespace ropepool::cuda {

constexpr int kFusionWarps = 4;            ///< warps per CTA
constexpr int kFusionMaxHeadDim = 2048;    ///< a head in shared memory per warp (8 KiB)

/// What SPEC §7 adds to KernelParams (a second kernel parameter).
struct FusionParams {
  const void* q_norm_weight;  ///< [head_dim] contiguous, or nullptr
  const void* k_norm_weight;
  bool q_norm_float32, k_norm_float32;  ///< the weight's dtype: float32, else q's dtype
  float norm_eps;
  bool norm_gemma;
  bool interleaved;  ///< GPT-J pairs (the main kernel has it as a template argument)
};

template <class E>
__device__ __forceinline__ float load_element(const void* base, int64_t i) {
  float f[1];
  VecIO<E, 1>::to_float(static_cast<const typename E::Bits*>(base)[i], f);
  return f[0];
}
template <class E>
__device__ __forceinline__ typename E::Bits to_bits(float x) {
  const float f[1] = {x};
  return VecIO<E, 1>::from_float(f);
}
/// x rounded to E (round to nearest even) and widened back.
template <class E>
__device__ __forceinline__ float round_to(float x) {
  float f[1];
  VecIO<E, 1>::to_float(to_bits<E>(x), f);
  return f[0];
}
template <class E>
__device__ __forceinline__ float weight_at(const void* w, bool is_float32, int d) {
  return is_float32 ? __ldg(static_cast<const float*>(w) + d) : load_element<E>(w, d);
}

/// One head: x [D] -> (normalised when w) -> rotated into out (and out2 when not null).
/// `row` is this warp's shared row of D floats.
template <class E>
__device__ __forceinline__ void fused_head(const KernelParams<kMaxHalfRotary>& p,
                                           const FusionParams& f, const typename E::Bits* x,
                                           typename E::Bits* out, typename E::Bits* out2,
                                           const void* w, bool w_float32, const float* cos_row,
                                           const float* sin_row, float* row, int lane) {
  const int D = p.head_dim, R = p.rotary_dim, half = R / 2;
  float sum = 0.f;
  for (int d = lane; d < D; d += 32) {
    float v[1];
    VecIO<E, 1>::to_float(__ldg(x + d), v);
    row[d] = v[0];
    sum += v[0] * v[0];
  }
  if (w != nullptr) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
    const float r = 1.0f / sqrtf(sum / float(D) + f.norm_eps);  // IEEE sqrt and division
    for (int d = lane; d < D; d += 32) {
      const float n = row[d] * r;
      const float wd = weight_at<E>(w, w_float32, d);
      row[d] = f.norm_gemma ? round_to<E>(n * (1.0f + wd)) : round_to<E>(round_to<E>(n) * wd);
    }
  }
  __syncwarp();
  for (int d = lane; d < D; d += 32) {
    float o = row[d];
    if (d < R) {
      const int i = f.interleaved ? d / 2 : d % half;
      const int ia = f.interleaved ? 2 * i : i, ib = f.interleaved ? 2 * i + 1 : i + half;
      const float a = row[ia], b = row[ib], c = cos_row[i], s = sin_row[i];
      o = d == ia ? a * c - b * s : a * s + b * c;
    }
    const typename E::Bits bits = to_bits<E>(o);
    out[d] = bits;
    if (out2 != nullptr) out2[d] = bits;
  }
  __syncwarp();  // the row is reused by this warp's next head
}

template <class E>
__global__ void __launch_bounds__(kFusionWarps * 32)
    rope_pool_fusion_kernel(const __grid_constant__ KernelParams<kMaxHalfRotary> p,
                            const __grid_constant__ FusionParams f) {
  using Bits = typename E::Bits;
  extern __shared__ float4 shared[];
  const int half = p.rotary_dim / 2, D = p.head_dim;
  float* cos_row = reinterpret_cast<float*>(shared);
  float* sin_row = cos_row + half;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  float* row = sin_row + half + warp * D;
  const int64_t t = blockIdx.x;

  wait_for_previous_grid();
  if (int(threadIdx.x) < half) {  // the main kernel's table, mRoPE included
    const int64_t pos = load_index(p.positions, p.positions_stride, p.positions_int64, t);
    for (int e = threadIdx.x; e < half; e += blockDim.x)
      angle_sincos(p.mrope ? mrope_position(p, e, t, pos) : pos, p.inv_freq[e],
                   p.attention_scaling, &cos_row[e], &sin_row[e]);
  }
  __syncthreads();
  allow_next_grid();

  // Warp 0: every kv head of the token (the whole pool row); all warps: the q heads.
  if (warp == 0) {
    const int64_t slot = load_index(p.slots, p.slots_stride, p.slots_int64, t);
    if (slot >= p.pool_size && lane == 0) record_slot_error(p.error_record, t, slot, p.pool_size);
    const bool to_pool = slot >= 0 && slot < p.pool_size;
    unsigned int* lock = nullptr;
    if (to_pool && p.pool_write_mode == kPoolWriteLock) {
      lock = slot_lock(slot);
      lock_row(lock, lane);
    }
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const Bits* k = static_cast<const Bits*>(p.k) + t * p.k_row + h * p.k_head;
      Bits* k_out = static_cast<Bits*>(p.k_out) + t * p.ko_row + h * p.ko_head;
      Bits* k_pool = to_pool ? static_cast<Bits*>(p.k_pool) + slot * p.kp_row + h * p.kp_head
                             : nullptr;
      fused_head<E>(p, f, k, k_out, k_pool, f.k_norm_weight, f.k_norm_float32, cos_row, sin_row,
                    row, lane);
      if (to_pool) {
        const Bits* v = static_cast<const Bits*>(p.v) + t * p.v_row + h * p.v_head;
        Bits* v_pool = static_cast<Bits*>(p.v_pool) + slot * p.vp_row + h * p.vp_head;
        for (int d = lane; d < D; d += 32) v_pool[d] = __ldg(v + d);  // raw bits
      }
    }
    if (lock != nullptr) unlock_row(lock, lane);
  }
  // q heads: warps 1.. first (warp 0 is busy with the kv heads), then warp 0 joins.
  for (int h = (warp + warps - 1) % warps; h < p.num_qo_heads; h += warps) {
    const Bits* q = static_cast<const Bits*>(p.q) + t * p.q_row + h * p.q_head;
    Bits* q_out = static_cast<Bits*>(p.q_out) + t * p.qo_row + h * p.qo_head;
    fused_head<E>(p, f, q, q_out, nullptr, f.q_norm_weight, f.q_norm_float32, cos_row, sin_row,
                  row, lane);
  }
}

}  // namespace ropepool::cuda
