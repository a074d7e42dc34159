// The small-call kernel of rope_pool_fused (head_dim 128, NeoX, no QK norm): every warp does
// one unit per lane of one kind of work, so a token's work spreads over many short warps.
//
// A token's work is cut into warps of 32 units of one kind: the k warps (its k heads' units:
// rotate, k_rot, the k pool row), the v warps (its v heads' 16-byte vectors: the v pool row)
// and the q warps (its q heads' units). Llama-3-8B's shape in bfloat16 makes 2 k, 4 v and 8 q
// warps per token, each lane holding one unit where a token kernel item holds 2-4 (docs/CUDA.md,
// "The head kernel"). Each rotating warp builds the token's sin/cos table in its own slice of
// shared memory (two frequencies per lane at head_dim 128), so no warp waits on another.
//
// Every rule of the token kernel holds: the same unit operations (HeadOps), the fp8 rule and
// its power-of-two fast path, pools of every variant, slot errors recorded by one warp per
// token, and in scan mode a token skips its row when a later token of the call has its slot.
// No row locks: the planner sends only calls up to kMaxScanTokens here.
#pragma once

#include "rope_pool_kernel.cuh"

namespace ropepool::cuda {

/// Calls up to this many tokens run the head kernel by default (LaunchConfig::head_kernel),
/// kHeadKernelWarps warps per CTA: those with an fp8 pool or an fp8 q_out from one token, those
/// in q's dtype from kHeadKernelMinTokensPlain (at T = 1 the token kernel is as fast under CUDA
/// graphs: docs/CUDA.md). Calls on a pool variant (an fp8 pool or q_out, a paged pool, no k_rot)
/// up to kHeadKernelMaxTokensVariant: at T = 256 the head kernel is faster for them, even with
/// the token kernel for the seed's pool.
constexpr int kHeadKernelMaxTokens = 128;
constexpr int kHeadKernelMaxTokensVariant = kMaxScanTokens;
constexpr int kHeadKernelMinTokensPlain = 2;
constexpr int kHeadKernelWarps = kMaxWarpsPerCta;

/// A token's warps: k warps, then v warps, then q warps, 32 units each (k and q: NeoX pairs of
/// vectors, `units` per head; v: vectors, `vecs` per head). The planner sizes the grid with it
/// and the kernel gives each warp its kind with it.
struct HeadWarpCounts {
  int k, v, q;
  __host__ __device__ int total() const { return k + v + q; }
};
__host__ __device__ __forceinline__ HeadWarpCounts head_warp_counts(int num_qo_heads, int num_kv_heads, int units,
                                                                    int vecs) {
  return {(num_kv_heads * units + 31) / 32, (num_kv_heads * vecs + 31) / 32, (num_qo_heads * units + 31) / 32};
}

template <class E, int kVec, int kHeadDim, int kFreqCap, int kPool>
struct HeadWarp {
  using Ops = HeadOps<E, kVec, kHeadDim, kFreqCap, false, kPool>;
  using IO = typename Ops::IO;
  using Raw = typename Ops::Raw;
  using Bits = typename Ops::Bits;
  using Fp8 = typename Ops::Fp8;
  static constexpr int kUnitsPerHead = kHeadDim / 2 / kVec;  // NeoX pairs of vectors
  static constexpr int kVecsPerHead = kHeadDim / kVec;
  static constexpr int kHalf = kHeadDim / 2;
  static constexpr int kFreqPerLane = (kHalf + 31) / 32;
  static_assert(32 % kUnitsPerHead == 0 && 32 % kVecsPerHead == 0, "whole heads per warp");

  /// The k warp: unit (head, j) rotated; k_rot, and the pool row when to_pool.
  template <bool kPow2>
  static __device__ __forceinline__ void finish_k(const Ops& ops, const KernelParams<kFreqCap, kPool != 0>& p,
                                                  int64_t t, int head, int j, const float* cos_row,
                                                  const float* sin_row, Raw a, Raw b, bool to_pool,
                                                  int64_t row, const Fp8Divisor& d) {
    if constexpr (Ops::kFp8Pool) {
      float fa[kVec], fb[kVec];
      ops.rotate_unit_float(cos_row, sin_row, j, a, b, fa, fb);
      if (p.k_out != nullptr)
        ops.store_unit(static_cast<Bits*>(p.k_out) + t * p.ko_row + head * p.ko_head, j, a, b);
      if (to_pool)
        ops.template store_unit_fp8<kPow2>(static_cast<uint8_t*>(p.k_pool) + row + head * p.kp_head, j, fa, fb, d);
    } else {
      ops.rotate_unit(cos_row, sin_row, j, a, b);
      if (kPool == 0 || p.k_out != nullptr)
        ops.store_unit(static_cast<Bits*>(p.k_out) + t * p.ko_row + head * p.ko_head, j, a, b);
      if (to_pool) ops.store_unit(static_cast<Bits*>(p.k_pool) + row + head * p.kp_head, j, a, b);
    }
  }

  /// The v warp: vector j of v head `head` into the pool row.
  template <bool kPow2>
  static __device__ __forceinline__ void finish_v(const KernelParams<kFreqCap, kPool != 0>& p, int head, int j,
                                                  Raw a, int64_t row, const Fp8Divisor& d) {
    if constexpr (Ops::kFp8Pool) {
      float f[kVec];
      IO::to_float(a, f);
      if constexpr (std::is_same_v<E, F16>) IO::keep_nan_signs(a, f);
      Fp8::store(static_cast<uint8_t*>(p.v_pool) + row + head * p.vp_head + j * kVec,
                 Fp8::template quantize<kPow2>(f, d));
    } else {
      IO::store(static_cast<Bits*>(p.v_pool) + row + head * p.vp_head + j * kVec, a);
    }
  }

  /// The q warp: unit (head, j) rotated into q_out.
  template <bool kPow2>
  static __device__ __forceinline__ void finish_q(const Ops& ops, const KernelParams<kFreqCap, kPool != 0>& p,
                                                  int64_t t, int head, int j, const float* cos_row,
                                                  const float* sin_row, Raw a, Raw b, const Fp8Divisor& d) {
    if constexpr (Ops::kFp8QOut) {
      float fa[kVec], fb[kVec];
      ops.rotate_unit_float(cos_row, sin_row, j, a, b, fa, fb);
      ops.template store_unit_fp8<kPow2>(static_cast<uint8_t*>(p.q_out) + t * p.qo_row + head * p.qo_head, j, fa,
                                         fb, d);
    } else {
      ops.rotate_unit(cos_row, sin_row, j, a, b);
      ops.store_unit(static_cast<Bits*>(p.q_out) + t * p.qo_row + head * p.qo_head, j, a, b);
    }
  }
};

/// Token blockIdx.x; warp g = blockIdx.y * warps + warp of it: k warps first, then v, then q.
template <class E, int kVec, int kHeadDim, int kFreqCap, int kPool>
__global__ void __launch_bounds__(kMaxWarpsPerCta * 32)
    rope_pool_head_kernel(const __grid_constant__ KernelParams<kFreqCap, kPool != 0> p) {
  using W = HeadWarp<E, kVec, kHeadDim, kFreqCap, kPool>;
  using Ops = typename W::Ops;
  using IO = typename W::IO;
  using Raw = typename W::Raw;
  using Bits = typename W::Bits;
  constexpr bool kScales = Ops::kFp8Pool || Ops::kFp8QOut;
  extern __shared__ float4 shared[];  // per warp: cos, sin of the token's kHalf frequencies

  ParamTouch<kFreqCap, kPool != 0> params_touched;
  params_touched.start(p, true);
  const Ops ops(p);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t t = blockIdx.x;
  const int g = int(blockIdx.y) * int(blockDim.x >> 5) + warp;
  const HeadWarpCounts n = head_warp_counts(p.num_qo_heads, p.num_kv_heads, W::kUnitsPerHead, W::kVecsPerHead);
  if (g >= n.total()) return;
  enum { kK, kV, kQ };
  const int role = g < n.k ? kK : g < n.k + n.v ? kV : kQ;
  const int sub = role == kK ? g : role == kV ? g - n.k : g - n.k - n.v;

  // Before the wait: this lane's unit (or v vector), its address, its frequencies.
  const int u = sub * 32 + lane;
  const int per_head = role == kV ? W::kVecsPerHead : W::kUnitsPerHead;
  const int head = u / per_head, j = u % per_head;
  const int heads = role == kQ ? p.num_qo_heads : p.num_kv_heads;
  const Bits* src = nullptr;
  if (head < heads) {
    if (role == kQ) src = static_cast<const Bits*>(p.q) + t * p.q_row + head * p.q_head + j * kVec;
    else if (role == kK) src = static_cast<const Bits*>(p.k) + t * p.k_row + head * p.k_head + j * kVec;
    else src = static_cast<const Bits*>(p.v) + t * p.v_row + head * p.v_head + j * kVec;
  }
  pin(src);
  double f[W::kFreqPerLane];
  const void* pos_row[W::kFreqPerLane];
#pragma unroll
  for (int i = 0; i < W::kFreqPerLane; ++i) {
    const int e = lane + 32 * i;
    f[i] = role != kV && e < W::kHalf ? p.inv_freq[e] : 0.0;
    pos_row[i] = position_row(p, e);
    pin(pos_row[i]);
  }
  params_touched.finish(true, f[0]);

  wait_for_previous_grid();
  Raw a{}, b{};
  if (src != nullptr) {
    a = IO::load(src);
    if (role != kV) b = IO::load(src + W::kHalf);
  }
  int64_t slot = -1;
  if (role != kQ) slot = load_index(p.slots, p.slots_stride, p.slots_int64, t);
  // Scan mode: the later tokens' slots, loaded now with the data (-1 matches no written row).
  constexpr int kLater = kMaxScanTokens / 32;
  int64_t later_slot[kLater];
  const bool scan = role != kQ && p.pool_write_mode == kPoolWriteScan;
#pragma unroll
  for (int i = 0; i < kLater; ++i) {
    const int64_t w = t + 1 + lane + 32 * i;
    later_slot[i] = scan && w < p.num_tokens ? load_index(p.slots, p.slots_stride, p.slots_int64, w) : -1;
  }
  float scale = 1.0f;
  if constexpr (kScales) {
    const int which = role == kK ? 0 : role == kV ? 1 : 2;
    if ((role != kQ && Ops::kFp8Pool) || (role == kQ && Ops::kFp8QOut))
      scale = p.pool.scale_ptr[which] != nullptr ? __ldg(p.pool.scale_ptr[which]) : p.pool.scale_value[which];
  }
  float* cos_row = reinterpret_cast<float*>(shared) + warp * 2 * W::kHalf;
  float* sin_row = cos_row + W::kHalf;
  if (role != kV) {
    const int64_t pos0 = load_index(pos_row[0], p.positions_stride, p.positions_int64, t);
#pragma unroll
    for (int i = 0; i < W::kFreqPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e >= W::kHalf) break;
      const int64_t pos = i == 0 || !p.mrope ? pos0 : load_index(pos_row[i], p.positions_stride, p.positions_int64, t);
      angle_sincos(pos, f[i], p.attention_scaling, &cos_row[e], &sin_row[e]);
    }
    __syncwarp();
  }
  allow_next_grid();

  Fp8Divisor d{};
  if constexpr (kScales) d = fp8_divisor(scale);
  if (role == kQ) {
    if (head >= heads) return;
    if (Ops::kFp8QOut && fp8_power_of_two(d)) W::template finish_q<true>(ops, p, t, head, j, cos_row, sin_row, a, b, d);
    else W::template finish_q<false>(ops, p, t, head, j, cos_row, sin_row, a, b, d);
    return;
  }
  // The k and v warps: whether the token writes its pool row (SPEC §1, §3), from the slots
  // alone, so that every warp of the token decides alike. The first k warp records a bad slot.
  bool to_pool = role == kK && sub == 0 ? ops.pool_row_valid(t, slot) : slot >= 0 && slot < p.pool_size;
  if (scan) {
    bool later = false;  // last token wins: a later token of the call has this slot
#pragma unroll
    for (int i = 0; i < kLater; ++i) later |= later_slot[i] == slot;
    to_pool = to_pool && !__any_sync(0xffffffffu, later);
  }
  int64_t row = 0;  // the row's offset in the pool (elements)
  if (to_pool) {
    if constexpr (Ops::kPaged) {
      const PageRow at = page_row(slot, p.pool);
      row = role == kK ? at.page * p.kp_row + at.row * p.pool.kp_in_page : at.page * p.vp_row + at.row * p.pool.vp_in_page;
    } else {
      row = slot * (role == kK ? p.kp_row : p.vp_row);
    }
  }
  if (head >= heads) return;
  const bool pow2 = Ops::kFp8Pool && fp8_power_of_two(d);
  if (role == kK) {
    if (pow2) W::template finish_k<true>(ops, p, t, head, j, cos_row, sin_row, a, b, to_pool, row, d);
    else W::template finish_k<false>(ops, p, t, head, j, cos_row, sin_row, a, b, to_pool, row, d);
  } else if (to_pool) {
    if (pow2) W::template finish_v<true>(p, head, j, a, row, d);
    else W::template finish_v<false>(p, head, j, a, row, d);
  }
}

}  // namespace ropepool::cuda
