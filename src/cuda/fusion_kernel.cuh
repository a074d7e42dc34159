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
//
// SPEC §6's caches are the main kernel's PoolVariant bits (template parameter kPool), with
// its parameters (KernelParams<.., true>: PoolParams) and its helpers: the slot -> (page, row)
// of HeadOps::pool_row, the slot error record, and Fp8IO's e4m3(x / scale) (the division in
// float32). An fp8 k_pool element is quantised from the rotated float32 value before it is
// rounded to q's dtype (as the main kernel does), an fp8 q_out element likewise, and an fp8
// v_pool element from its input element (bit-exact). Element-wise accesses: any page size,
// stride or alignment takes the same code.
#pragma once

#include <cstdint>
#include <type_traits>

#include "rope_pool_kernel.cuh"
#include "vec.cuh"

namespace ropepool::cuda {

constexpr int kFusionWarps = 4;          ///< warps per CTA
constexpr int kFusionMaxHeadDim = 2048;  ///< a head in shared memory per warp (8 KiB)

/// Element `bits` of type E as float32. float16 NaNs keep their sign (the conversion may
/// return one canonical NaN), so a NaN quantised to e4m3 keeps it, as on the host.
template <class E>
__device__ __forceinline__ float widen(typename E::Bits bits) {
  float f[1];
  VecIO<E, 1>::to_float(bits, f);
  if constexpr (std::is_same_v<E, F16>) VecIO<E, 1>::keep_nan_signs(bits, f);
  return f[0];
}
template <class E>
__device__ __forceinline__ float load_element(const void* base, int64_t i) {
  return widen<E>(static_cast<const typename E::Bits*>(base)[i]);
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
/// Element d of an e4m3fn row: e4m3(x / scale) by SPEC §6's rule (the main kernel's helper).
__device__ __forceinline__ void store_e4m3(void* row, int d, float x, const Fp8Divisor& scale) {
  const float f[1] = {x};
  Fp8IO<1>::store(static_cast<uint8_t*>(row) + d, Fp8IO<1>::quantize(f, scale));
}

/// One head: x [D] -> (normalised when w) -> rotated into `out` (q's dtype, or e4m3 with
/// out_scale when kOutFp8) and, when `pool` is not null, into that pool row too (q's dtype:
/// the same bits as out; e4m3 with pool_scale when kPoolFp8). `row` is this warp's shared row
/// of D floats.
template <class E, bool kOutFp8, bool kPoolFp8>
__device__ __forceinline__ void fused_head(const KernelParams<kMaxHalfRotary>& p,
                                           const FusionParams& f, const typename E::Bits* x,
                                           void* out, const Fp8Divisor& out_scale, void* pool,
                                           const Fp8Divisor& pool_scale, const void* w, bool w_float32,
                                           const float* cos_row, const float* sin_row, float* row,
                                           int lane) {
  using Bits = typename E::Bits;
  static_assert(!(kOutFp8 && kPoolFp8), "q_out (fp8) has no pool row, k_out is in q's dtype");
  const int D = p.head_dim, R = p.rotary_dim, half = R / 2;
  float sum = 0.f;
  for (int d = lane; d < D; d += 32) {
    const float v = widen<E>(__ldg(x + d));
    row[d] = v;
    sum += v * v;
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
    // o: the element in float32 before its one rounding (to q's dtype or to e4m3)
    float o = row[d];
    if (d < R) {
      const int i = f.interleaved ? d / 2 : d % half;
      const int ia = f.interleaved ? 2 * i : i, ib = f.interleaved ? 2 * i + 1 : i + half;
      const float a = row[ia], b = row[ib], c = cos_row[i], s = sin_row[i];
      o = d == ia ? a * c - b * s : a * s + b * c;
    }
    if constexpr (kOutFp8) {
      store_e4m3(out, d, o, out_scale);
    } else {
      const Bits bits = to_bits<E>(o);
      if (out != nullptr) static_cast<Bits*>(out)[d] = bits;  // null: no k_rot (SPEC §4)
      if (pool != nullptr) {
        if constexpr (kPoolFp8) store_e4m3(pool, d, o, pool_scale);
        else static_cast<Bits*>(pool)[d] = bits;
      }
    }
  }
  __syncwarp();  // the row is reused by this warp's next head
}

/// kPool: PoolVariant bits (0: pools in q's dtype addressed as slot * kp_row, page size 1).
template <class E, int kPool = 0>
__global__ void __launch_bounds__(kFusionWarps * 32)
    rope_pool_fusion_kernel(const __grid_constant__ KernelParams<kMaxHalfRotary, kPool != 0> p,
                            const __grid_constant__ FusionParams f) {
  using Bits = typename E::Bits;
  // The main kernel's head geometry is not used here: only its pool addressing.
  using Ops = HeadOps<E, 1, 0, kMaxHalfRotary, false, kPool>;
  constexpr bool kFp8Pool = Ops::kFp8Pool, kFp8QOut = Ops::kFp8QOut;
  extern __shared__ float4 shared[];
  const int half = p.rotary_dim / 2, D = p.head_dim;
  // kPool != 0: as in the main kernel, k_scale, v_scale, q_scale prepared for division in
  // bytes 0-47, the kv warp's pool row offsets in bytes 48-63 (HeadOps::pool_row), then the
  // table.
  Fp8Divisor* const scales = reinterpret_cast<Fp8Divisor*>(shared);
  int64_t* const row_offsets = reinterpret_cast<int64_t*>(shared) + 6;
  float* cos_row = reinterpret_cast<float*>(shared) + (kPool != 0 ? kPoolSharedBytes / 4 : 0);
  float* sin_row = cos_row + half;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  float* row = sin_row + half + warp * D;
  const int64_t t = blockIdx.x;

  wait_for_previous_grid();
  // Scale tensors may have been written by the previous grid: read after the wait.
  if constexpr (kFp8Pool || kFp8QOut) {
    const int i = threadIdx.x;
    if (i < 3)
      scales[i] = fp8_divisor(p.pool.scale_ptr[i] != nullptr ? __ldg(p.pool.scale_ptr[i])
                                                             : p.pool.scale_value[i]);
  }
  if (int(threadIdx.x) < half)  // the main kernel's table, mRoPE included
    token_table(p, t, threadIdx.x, blockDim.x, half, position_row(p, threadIdx.x), 0.0, false, cos_row,
                sin_row);
  __syncthreads();
  allow_next_grid();
  const Fp8Divisor one{1.0f, 1.0f, 1.0f, 1.0f};
  const Fp8Divisor& k_scale = kFp8Pool ? scales[0] : one;
  const Fp8Divisor& v_scale = kFp8Pool ? scales[1] : one;
  const Fp8Divisor& q_scale = kFp8QOut ? scales[2] : one;
  using PoolBits = std::conditional_t<kFp8Pool, uint8_t, Bits>;  // a pool element
  using QOutBits = std::conditional_t<kFp8QOut, uint8_t, Bits>;  // a q_out element

  // Warp 0: every kv head of the token (the whole pool row); all warps: the q heads.
  int64_t slot = -1;
  if (warp == 0) {
    const Ops ops(p);
    slot = load_index(p.slots, p.slots_stride, p.slots_int64, t);
    const bool to_pool = slot >= 0 && slot < p.pool_size;  // SPEC §1, §3
    typename Ops::PoolRow pool_row{slot, nullptr};
    if constexpr (kPool != 0) pool_row = ops.pool_row(slot, row_offsets);
    // The lock's address is recomputed to release it: a pointer held across the head loop
    // (whose IEEE division and square root call their slow paths) costs a spill.
    const bool locked = to_pool && p.pool_write_mode == kPoolWriteLock;
    if (locked) lock_row(slot_lock(slot), lane);
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const Bits* k = static_cast<const Bits*>(p.k) + t * p.k_row + h * p.k_head;
      // null k_out: no k_rot (SPEC §4), planned as a pool variant
      Bits* k_out = kPool == 0 || p.k_out ? static_cast<Bits*>(p.k_out) + t * p.ko_row + h * p.ko_head : nullptr;
      PoolBits* k_pool =
          to_pool ? static_cast<PoolBits*>(p.k_pool) + ops.k_row_offset(pool_row) + h * p.kp_head
                  : nullptr;
      fused_head<E, false, kFp8Pool>(p, f, k, k_out, one, k_pool, k_scale, f.k_norm_weight,
                                     f.k_norm_float32, cos_row, sin_row, row, lane);
      if (to_pool) {
        const Bits* v = static_cast<const Bits*>(p.v) + t * p.v_row + h * p.v_head;
        PoolBits* v_pool =
            static_cast<PoolBits*>(p.v_pool) + ops.v_row_offset(pool_row) + h * p.vp_head;
        for (int d = lane; d < D; d += 32) {
          if constexpr (kFp8Pool) store_e4m3(v_pool, d, widen<E>(__ldg(v + d)), v_scale);
          else v_pool[d] = __ldg(v + d);  // raw bits
        }
      }
    }
    if (locked) unlock_row(slot_lock(slot), lane);
  }
  // q heads: warps 1.. first (warp 0 is busy with the kv heads), then warp 0 joins.
  for (int h = (warp + warps - 1) % warps; h < p.num_qo_heads; h += warps) {
    const Bits* q = static_cast<const Bits*>(p.q) + t * p.q_row + h * p.q_head;
    QOutBits* q_out = static_cast<QOutBits*>(p.q_out) + t * p.qo_row + h * p.qo_head;
    fused_head<E, kFp8QOut, false>(p, f, q, q_out, q_scale, nullptr, one, f.q_norm_weight,
                                   f.q_norm_float32, cos_row, sin_row, row, lane);
  }
  // A slot >= pool_size (not written above) goes to the host's record, as in the main kernel.
  // Last, so that no value is live across the call (ptxas saves those on the stack).
  if (warp == 0 && lane == 0 && slot >= p.pool_size)
    record_slot_error(p.error_record, t, slot, p.pool_size);
}

// ---- the vector path ---------------------------------------------------------------------------
//
// rope_pool_fusion_kernel above is element-wise and a warp works through its heads one after
// the other, so each head is a chain of memory latencies: right for any geometry, slow (a few
// percent of the copy ceiling). When the geometry allows, this kernel runs instead. A unit is
// one 16-byte vector of a head (kVec elements) and a head's D / kVec units sit in consecutive
// lanes of one warp (D / kVec is a power of two up to 32), so its sum of squares is a
// butterfly of shuffles inside that lane group and the NeoX partner of a vector (half / kVec
// vectors on, also a power of two) is one shuffle away; GPT-J pairs never leave their vector.
// All the token's units (q heads, k heads, then v vectors) are spread over the CTA, kFusionUnits
// per thread whose loads are issued before any of them is used (the first ones right after
// the wait, in flight while the table is built). The pool row is written by
// many warps, so with several tokens (possible duplicate slots, SPEC §3) thread 0 holds the
// row's lock for the CTA, between two barriers.

constexpr int kFusionUnits = 2;  ///< units per thread per round, loads issued together

/// The vector path's geometry (kernel parameter).
struct FusionVecGeometry {
  int group_shift;   ///< log2(D / kVec): lanes per head
  int pair_xor;      ///< NeoX: half / kVec (the partner lane's distance); GPT-J: unused
  int rot_units;     ///< vectors of a head inside rotary_dim
  int qk_units;      ///< (Hq + Hk) * D / kVec
  int units;         ///< qk_units + Hk * D / kVec
  int rounds;        ///< ceil(units / (kFusionUnits * blockDim.x))
};

template <class E, int kVec, int kPool>
__global__ void __launch_bounds__(1024, 1)
    rope_pool_fusion_vec_kernel(const __grid_constant__ KernelParams<kMaxHalfRotary, kPool != 0> p,
                                const __grid_constant__ FusionParams f,
                                const __grid_constant__ FusionVecGeometry g) {
  using IO = VecIO<E, kVec>;
  using Raw = typename IO::Raw;
  using Bits = typename E::Bits;
  using Fp8 = Fp8IO<kVec>;
  constexpr bool kPaged = (kPool & kPoolPaged) != 0, kFp8Pool = (kPool & kPoolFp8) != 0;
  constexpr bool kFp8QOut = (kPool & kQOutFp8) != 0;
  extern __shared__ float4 shared[];
  const int half = p.rotary_dim / 2, D = p.head_dim, tid = threadIdx.x;
  Fp8Divisor* const divisors = reinterpret_cast<Fp8Divisor*>(shared);  // kPool != 0
  float* const cos_row = reinterpret_cast<float*>(shared) + (kPool != 0 ? kPoolSharedBytes / 4 : 0);
  float* const sin_row = cos_row + half;
  const int64_t t = blockIdx.x;
  const int per_head = 1 << g.group_shift, lane_group_mask = per_head - 1;
  const int Hq = p.num_qo_heads;
  int unit[kFusionUnits];
  Raw x[kFusionUnits] = {};
  const auto load_round = [&](int round) {
#pragma unroll
    for (int k = 0; k < kFusionUnits; ++k) {  // every load of the round first
      const int i = (round * kFusionUnits + k) * int(blockDim.x) + tid;
      unit[k] = i;
      const int c = i & lane_group_mask;
      if (i < g.qk_units) {
        const int h = i >> g.group_shift;
        x[k] = h < Hq ? IO::load(static_cast<const Bits*>(p.q) + t * p.q_row + h * p.q_head + c * kVec)
                      : IO::load(static_cast<const Bits*>(p.k) + t * p.k_row + (h - Hq) * p.k_head + c * kVec);
      } else if (i < g.units) {  // read even when the token writes no pool row (rare)
        const int h = (i - g.qk_units) >> g.group_shift;
        x[k] = IO::load(static_cast<const Bits*>(p.v) + t * p.v_row + h * p.v_head + c * kVec);
      }
    }
  };

  wait_for_previous_grid();
  load_round(0);  // in flight while the table is built
  if constexpr (kFp8Pool || kFp8QOut) {
    if (tid < 3)
      divisors[tid] = fp8_divisor(p.pool.scale_ptr[tid] != nullptr ? __ldg(p.pool.scale_ptr[tid])
                                                                  : p.pool.scale_value[tid]);
  }
  if (tid < half)  // mRoPE included
    token_table(p, t, tid, blockDim.x, half, position_row(p, tid), 0.0, false, cos_row, sin_row);
  const int64_t slot = load_index(p.slots, p.slots_stride, p.slots_int64, t);
  __syncthreads();
  allow_next_grid();

  // The pool row (SPEC §1, §3: negative slots skip it, slots >= pool_size are reported).
  const bool to_pool = slot >= 0 && slot < p.pool_size;
  int64_t kp_row = slot * p.kp_row, vp_row = slot * p.vp_row;
  if constexpr (kPaged) {
    const PageRow at = page_row(slot, p.pool);
    kp_row = at.page * p.kp_row + at.row * p.pool.kp_in_page;
    vp_row = at.page * p.vp_row + at.row * p.pool.vp_in_page;
  }
  const bool locked = to_pool && p.pool_write_mode == kPoolWriteLock;  // the same for the CTA
  if (locked) {
    if (tid == 0) {
      while (atomicCAS(slot_lock(slot), 0u, 1u) != 0u) __nanosleep(32);
      __threadfence();
    }
    __syncthreads();
  }

  for (int round = 0; round < g.rounds; ++round) {
    if (round > 0) load_round(round);
#pragma unroll
    for (int k = 0; k < kFusionUnits; ++k) {
      const int i = unit[k], c = i & lane_group_mask, h = i >> g.group_shift;
      const bool qk = i < g.qk_units, is_q = h < Hq;
      float v[kVec];
      IO::to_float(x[k], v);
      if constexpr (std::is_same_v<E, F16>) IO::keep_nan_signs(x[k], v);
      if (!qk) {  // a v vector (or nothing): raw bits, or e4m3 from its input element
        if (i < g.units && to_pool) {
          const int hv = (i - g.qk_units) >> g.group_shift;
          if constexpr (kFp8Pool) {
            Fp8::store(static_cast<uint8_t*>(p.v_pool) + vp_row + hv * p.vp_head + c * kVec,
                       Fp8::quantize(v, divisors[1]));
          } else {
            IO::store(static_cast<Bits*>(p.v_pool) + vp_row + hv * p.vp_head + c * kVec, x[k]);
          }
        }
      }
      // The head's sum of squares, then the norm (every lane takes part in the shuffles, so
      // lanes of v vectors and past the end compute values nobody uses).
      float sum = 0.f;
#pragma unroll
      for (int e = 0; e < kVec; ++e) sum += v[e] * v[e];
      for (int m = per_head >> 1; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
      const void* w = is_q ? f.q_norm_weight : f.k_norm_weight;
      if (qk && w != nullptr) {
        const float r = 1.0f / sqrtf(sum / float(D) + f.norm_eps);  // IEEE sqrt and division
        float wv[kVec];
        if (is_q ? f.q_norm_float32 : f.k_norm_float32) {
#pragma unroll
          for (int e = 0; e < kVec; e += 4) {
            const float4 w4 = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(w) + c * kVec + e));
            wv[e] = w4.x, wv[e + 1] = w4.y, wv[e + 2] = w4.z, wv[e + 3] = w4.w;
          }
        } else {
          IO::to_float(IO::load(static_cast<const Bits*>(w) + c * kVec), wv);
        }
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const float n = v[e] * r;
          v[e] = f.norm_gemma ? round_to<E>(n * (1.0f + wv[e])) : round_to<E>(round_to<E>(n) * wv[e]);
        }
      }
      // The rotation: o, each element in float32 before its one rounding.
      float o[kVec];
      if (f.interleaved) {
#pragma unroll
        for (int e = 0; e < kVec; e += 2) {
          const int d = c * kVec + e;
          if (d < p.rotary_dim) {
            const float co = cos_row[d / 2], si = sin_row[d / 2];
            o[e] = v[e] * co - v[e + 1] * si;
            o[e + 1] = v[e] * si + v[e + 1] * co;
          } else {
            o[e] = v[e], o[e + 1] = v[e + 1];
          }
        }
      } else {
        float other[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) other[e] = __shfl_xor_sync(0xffffffffu, v[e], g.pair_xor);
        const bool first = c < g.pair_xor;
        const int j = (first ? c : c - g.pair_xor) * kVec;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          if (c < g.rot_units) {
            const float co = cos_row[j + e], si = sin_row[j + e];
            o[e] = first ? v[e] * co - other[e] * si : other[e] * si + v[e] * co;
          } else {
            o[e] = v[e];
          }
        }
      }
      if (!qk) continue;
      if (is_q) {
        if constexpr (kFp8QOut) {
          Fp8::store(static_cast<uint8_t*>(p.q_out) + t * p.qo_row + h * p.qo_head + c * kVec,
                     Fp8::quantize(o, divisors[2]));
        } else {
          IO::store(static_cast<Bits*>(p.q_out) + t * p.qo_row + h * p.qo_head + c * kVec, IO::from_float(o));
        }
      } else {
        const int hk = h - Hq;
        const Raw bits = IO::from_float(o);
        if (kPool == 0 || p.k_out != nullptr)  // null: no k_rot (SPEC §4; pool variants only)
          IO::store(static_cast<Bits*>(p.k_out) + t * p.ko_row + hk * p.ko_head + c * kVec, bits);
        if (to_pool) {
          if constexpr (kFp8Pool) {
            Fp8::store(static_cast<uint8_t*>(p.k_pool) + kp_row + hk * p.kp_head + c * kVec,
                       Fp8::quantize(o, divisors[0]));
          } else {
            IO::store(static_cast<Bits*>(p.k_pool) + kp_row + hk * p.kp_head + c * kVec, bits);
          }
        }
      }
    }
  }
  if (locked) {
    __threadfence();  // every thread's pool stores are visible before the lock is free
    __syncthreads();
    if (tid == 0) atomicExch(slot_lock(slot), 0u);
  }
  if (tid == 0 && slot >= p.pool_size) record_slot_error(p.error_record, t, slot, p.pool_size);
}

}  // namespace ropepool::cuda
