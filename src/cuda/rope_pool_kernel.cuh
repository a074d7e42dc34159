// The rope_pool_fused CUDA kernel: one launch rotates q and k, writes q_out/k_out and
// writes rotated k and raw v into the pool rows named by `slots`.
//
// Units and items (docs/CUDA.md has the full story):
//  - A unit is one pair of kVec-element vectors (x[i..], x[i + R/2..]) of one head (NeoX),
//    one vector of kVec/2 adjacent pairs (GPT-J "interleaved"; two scalars on the scalar
//    path), or one vector past rotary_dim that is copied.
//  - Work is cut into warp-sized items: "kv rounds" (one warp rotates all num_kv_heads k
//    heads of a token and copies all its v heads, 32 * (kKUnits, kVVecs) at a time, and alone
//    writes the token's whole pool row) and "q chunks" of 32 * kQUnits q units (kQUnitsFp8
//    with an fp8 q_out); with an fp8 pool at T <= kMaxScanTokens the k heads and the v heads
//    are two kv items (HeadOps::kv_items).
//  - sin/cos of (token, frequency) are computed once into shared memory and shared by every
//    q and k head of the token.
//  - Pools (SPEC §6): the seed's case ([P, Hk, D] or any pool with page size 1, in q's dtype)
//    is variant 0, compiled as it always was; paged pools, fp8 pools and an fp8 q_out are the
//    other PoolVariant bits, compiled into their own kernels.
//
// Launch shape (docs/CUDA.md): one CTA per token, its warps split the token's items (one
// warp per item by default). A warp computes its first item's addresses before waiting for
// the previous grid (PDL) and issues the loads right after the wait, before the sin/cos
// table is built, so memory latency overlaps the angle math.
#pragma once

#include <cstddef>
#include <cstdint>

#include "angle.cuh"  // load_index, angle_sincos
#include "slot_errors.hpp"  // SlotErrorRecord
#include "vec.cuh"

namespace ropepool::cuda {

constexpr int kMaxHalfRotary = 256;  ///< inv_freq entries passed by value (rotary_dim <= 512)
constexpr int kMaxWarpsPerCta = 8;
constexpr int kQUnits = 4;  ///< q units per lane per item (8 vectors in flight)
constexpr int kQUnitsFp8 = 2;  ///< the same for an fp8 q_out at small T (PoolParams::q_units)
constexpr int kKUnits = 2;  ///< k units per lane per kv round
constexpr int kVVecs = 4;   ///< v vectors per lane per kv round
constexpr int kStage = 8;   ///< raw vectors a lane holds: 2*kQUnits == 2*kKUnits + kVVecs
constexpr int kSlotLocks = 1 << 16;
constexpr int kUncappedMaxTokens = 256;  ///< LaunchConfig::uncapped up to this many tokens
constexpr int kSplitMaxTokens = 128;     ///< the uncapped kernel's CTAs of two warps up to this T
constexpr int kSplitFp8PoolMaxTokens = 256;  ///< the same for calls with fp8 pools
constexpr int kMaxScanTokens = 256;  ///< duplicate scan in shared memory up to this many tokens

/// How a kernel keeps two tokens with one slot from mixing their rows (SPEC §3).
enum PoolWriteMode : int {
  kPoolWriteDirect = 0,  ///< one token per call (or the tuning driver's lock-free variant)
  kPoolWriteScan = 1,    ///< T <= kMaxScanTokens: a token skips its write if a later token
                         ///< has its slot (last token wins, as on the CPU)
  kPoolWriteLock = 2,    ///< per-slot spin lock around the whole row write
};

/// Kernel variants for the pools and q_out (SPEC §6): template parameter kPool of the kernel, a
/// set of these bits. 0 is the seed's case: pools in q's dtype whose slot s is row
/// s * kp_row (a [P, Hk, D] pool, or any pool with page size 1).
enum PoolVariant : int {
  kPoolPaged = 1,  ///< slot s at page s / page_size, row s % page_size (runtime page size)
  kPoolFp8 = 2,    ///< k_pool / v_pool in float8 e4m3fn: e4m3(x / k_scale or v_scale)
  kQOutFp8 = 4,    ///< q_out in float8 e4m3fn: e4m3(q_rot / q_scale)
};
/// Shared memory before the table in the kernels with kPool != 0: three Fp8Divisor (k, v and q
/// scales) and the kv warp's two pool row offsets.
constexpr int kPoolSharedBytes = 3 * int(sizeof(Fp8Divisor)) + 2 * 8;
static_assert(sizeof(Fp8Divisor) == 16 && kPoolSharedBytes % 16 == 0, "the table stays 16-byte aligned");

/// Parameters of the kernels with kPool != 0 only, after the seed's block (KernelParams<.., true>).
struct PoolParams {
  int64_t kp_in_page, vp_in_page;  ///< stride of a row inside a page (pool elements)
  int64_t page_size;
  const float* scale_ptr[3];  ///< k_scale, v_scale, q_scale: one float32 of device memory read
                              ///< when the kernel runs, or nullptr: scale_value
  float scale_value[3];
  int page_shift;        ///< log2(page_size) when it is a power of two, else -1
  int slots_fit_32_bits;  ///< pool_size <= 2^32 - 1: the page division in 32 bits
  int kv_items;  ///< fp8 pools: 1 (one kv item), or 2 (the k heads and the v heads are items of
                 ///< their own, on two warps; never in kPoolWriteLock mode)
  int q_units;   ///< fp8 q_out: q units per lane per q item, kQUnits or (no row locks) kQUnitsFp8
};

/// SPEC §7's QK norm (a second kernel parameter of the kernels that normalise: the main
/// kernel's norm variant and the fusion kernels of fusion_kernel.cuh).
struct FusionParams {
  const void* q_norm_weight;  ///< [head_dim] contiguous, or nullptr
  const void* k_norm_weight;
  bool q_norm_float32, k_norm_float32;  ///< the weight's dtype: float32, else q's dtype
  float norm_eps;
  bool norm_gemma;
  bool interleaved;  ///< GPT-J pairs (the main kernel has it as a template argument)
};

template <int kFreqCap, bool kPoolParams = false>
struct KernelParams {
  const void* q;
  const void* k;
  const void* v;
  void* q_out;
  void* k_out;
  void* k_pool;
  void* v_pool;
  // Strides in elements (the last dimension is contiguous).
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;
  int64_t qo_row, qo_head, ko_row, ko_head, kp_row, kp_head, vp_row, vp_head;
  const void* positions;
  const void* slots;
  int64_t positions_stride, slots_stride;
  int64_t num_tokens;
  int64_t pool_size;
  int num_qo_heads, num_kv_heads, head_dim, rotary_dim;  // rotary_dim: even, <= head_dim
  int pool_write_mode;                // PoolWriteMode
  float attention_scaling;
  bool positions_int64, slots_int64;
  SlotErrorRecord* error_record;  ///< device view of this device's record
  double inv_freq[kFreqCap];      ///< R/2 entries; by value: no allocation, graph-safe
  // SPEC §7 mRoPE (after inv_freq: ParamTouch reads only the words before it). Positions
  // [3, T]: frequency e reads row mrope_axis(e), rows positions_row_stride elements apart.
  bool mrope, mrope_interleaved;
  int mrope_section[3];
  int64_t positions_row_stride;
};

/// The positions row frequency e reads: row 0, unless mRoPE picks row 1 or 2 for e (SPEC §7;
/// include/ropepool/schedule.hpp, mrope_axis). The table loads each thread's first position
/// from its own frequency's row: one load per thread, not row 0 and then, once its value is
/// in, the mRoPE row (two DRAM latencies in a row on the table's critical path).
template <int kFreqCap>
__device__ __forceinline__ const void* position_row(const KernelParams<kFreqCap>& p, int e) {
  if (!p.mrope) return p.positions;
  int axis = 0;
  if (p.mrope_interleaved) {
    axis = e % 3 == 1 && e < 3 * p.mrope_section[1]   ? 1
           : e % 3 == 2 && e < 3 * p.mrope_section[2] ? 2
                                                       : 0;
  } else {
    axis = e < p.mrope_section[0] ? 0 : e < p.mrope_section[0] + p.mrope_section[1] ? 1 : 2;
  }
  return static_cast<const char*>(p.positions) + axis * p.positions_row_stride * (p.positions_int64 ? 8 : 4);
}

/// The angle table of token t: cos and sin of frequencies e0, e0 + step, ... below half, each
/// at its own position; `first_row` is position_row(p, e0) (the main kernel works it out
/// before waiting for the previous grid). Without mRoPE every frequency reuses the first load.
template <int kFreqCap>
__device__ __forceinline__ void token_table(const KernelParams<kFreqCap>& p, int64_t t, int e0, int step,
                                            int half, const void* first_row, double f0, bool f0_given,
                                            float* cos_row, float* sin_row) {
  const int64_t pos = load_index(first_row, p.positions_stride, p.positions_int64, t);
  for (int e = e0; e < half; e += step) {
    const int64_t pos_e =
        e == e0 || !p.mrope ? pos : load_index(position_row(p, e), p.positions_stride, p.positions_int64, t);
    angle_sincos(pos_e, f0_given && e == e0 ? f0 : p.inv_freq[e], p.attention_scaling, &cos_row[e],
                 &sin_row[e]);
  }
}

/// The paged / fp8 kernels: the seed's block unchanged (kp_row, vp_row: the page stride), then
/// PoolParams.
template <int kFreqCap>
struct KernelParams<kFreqCap, true> : KernelParams<kFreqCap, false> {
  PoolParams pool;
};

/// A slot of a paged pool as (page, row inside the page): a shift for power-of-two page sizes
/// (1 included), else a 32-bit division when every slot fits, else a 64-bit one. Only meaningful
/// for a slot in range (callers use it only for rows they write).
struct PageRow {
  int64_t page, row;
};
__device__ __forceinline__ PageRow page_row(int64_t slot, const PoolParams& pool) {
  if (pool.page_shift >= 0) return {slot >> pool.page_shift, slot & (pool.page_size - 1)};
  if (pool.slots_fit_32_bits) {
    const uint32_t s = uint32_t(slot), n = uint32_t(pool.page_size), q = s / n;
    return {int64_t(q), int64_t(s - q * n)};
  }
  const int64_t page = slot / pool.page_size;
  return {page, slot - page * pool.page_size};
}

__device__ unsigned int g_slot_locks[kSlotLocks];
__device__ unsigned long long g_slot_error_claim;

/// Records the first bad slot since the host last acknowledged one. `seq_acked` is read
/// from host memory (slow, error path only); the device-side claim makes exactly one
/// thread write the record per acknowledgement.
__device__ __noinline__ void record_slot_error(SlotErrorRecord* rec, int64_t token, int64_t slot,
                                               int64_t pool_size) {
  if (rec == nullptr) return;
  const unsigned long long acked = *reinterpret_cast<volatile unsigned long long*>(&rec->seq_acked);
  if (atomicCAS(&g_slot_error_claim, acked, acked + 1) != acked) return;
  volatile SlotErrorRecord* r = rec;
  r->token = token;
  r->slot = slot;
  r->pool_size = pool_size;
  __threadfence_system();  // the fields before the sequence number that publishes them
  r->seq_written = acked + 1;
}

// A warp takes the lock of a pool row before its first pool store and drops it after its
// last, so two tokens with one slot write whole rows one after the other. A warp holds at
// most one lock and never waits on another lock or a barrier while holding it: no deadlock.
__device__ __forceinline__ unsigned int* slot_lock(int64_t slot) {
  return &g_slot_locks[uint64_t(slot) & (kSlotLocks - 1)];
}
__device__ __forceinline__ void lock_row(unsigned int* lock, int lane) {
  if (lane == 0) {
    while (atomicCAS(lock, 0u, 1u) != 0u) __nanosleep(32);
    __threadfence();
  }
  __syncwarp();
}
/// Programmatic dependent launch (sm_90): with the launch attribute set, this grid may
/// start while the previous kernel on the stream finishes; it must wait for that kernel
/// (and its memory) before touching global memory. Without the attribute both are no-ops.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
/// Global -> shared copy of 4 or 8 bytes that holds no register while in flight
/// (cp.async, sm_80+); complete after cp_async_wait_all().
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, bool eight_bytes) {
  const unsigned dst = unsigned(__cvta_generic_to_shared(smem));
  if (eight_bytes)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(gmem) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}
__device__ __forceinline__ void unlock_row(unsigned int* lock, int lane) {
  __threadfence();  // every lane's pool stores are visible before the lock is free
  __syncwarp();
  if (lane == 0) atomicExch(lock, 0u);
}

/// Geometry of a head and the unit operations. Compile-time geometry on the tuned paths
/// (kHeadDim != 0).
template <class E, int kVec, int kHeadDim, int kFreqCap, bool kInterleaved, int kPool = 0>
struct HeadOps {
  using IO = VecIO<E, kVec>;
  using Raw = typename IO::Raw;
  using Bits = typename E::Bits;
  using Params = KernelParams<kFreqCap, kPool != 0>;
  using Fp8 = Fp8IO<kVec>;
  static constexpr bool kPaged = (kPool & kPoolPaged) != 0;
  static constexpr bool kFp8Pool = (kPool & kPoolFp8) != 0;
  static constexpr bool kFp8QOut = (kPool & kQOutFp8) != 0;
  static_assert(kPool == 0 || kPaged, "the fp8 variants address pools by pages (page size 1 too)");
  // A rotating unit reads a second access (the pair's other half) except for interleaved
  // pairs inside one vector.
  static constexpr bool kTwoAccesses = !kInterleaved || kVec == 1;

  // ---- where a lane's units are -------------------------------------------------------------
  // Unit (or vector) number `flat` of a token sits in head flat / per_head at index
  // flat % per_head. A lane's units are 32 apart, so the next one is found by adding
  // (32 / per_head, 32 % per_head) with one carry: no division per unit (both are
  // compile-time on the tuned paths).
  struct Cursor {
    int head, j;
  };
  struct Stride {  // units (or vectors) per head, and 32 of them as whole heads plus j
    int per_head, heads, j;
  };
  __device__ __forceinline__ static Stride stride_of(int per_head) {
    return {per_head, 32 / per_head, 32 % per_head};
  }
  __device__ __forceinline__ static Cursor cursor_at(int flat, const Stride& s) {
    return {flat / s.per_head, flat % s.per_head};
  }
  __device__ __forceinline__ static void advance(Cursor& c, const Stride& s) {
    c.j += s.j;
    c.head += s.heads;
    if (c.j >= s.per_head) c.j -= s.per_head, ++c.head;
  }

  const Params& p;
  int lane;
  int head_dim, rotary_dim, half, pairs_per_head, units_per_head, vecs_per_head;
  int q_units_per_token, k_units, v_vecs;
  Stride units, vecs;  // q/k units per head; v vectors (kVec elements) per head
  static constexpr int kSources = kKUnits + kVVecs;  ///< unit addresses a lane holds per item
  static_assert(kSources >= kQUnits, "a q chunk's addresses fit the kv round's");

  __device__ explicit HeadOps(const Params& params) : p(params) {
    lane = threadIdx.x & 31;
    head_dim = kHeadDim ? kHeadDim : p.head_dim;
    rotary_dim = kHeadDim ? kHeadDim : p.rotary_dim;
    half = rotary_dim / 2;
    // Rotating units per head: NeoX pairs of vectors, interleaved vectors, or (interleaved,
    // scalar path) pairs of adjacent elements.
    pairs_per_head = !kInterleaved ? half / kVec : kVec == 1 ? half : rotary_dim / kVec;
    units_per_head = pairs_per_head + (head_dim - rotary_dim) / kVec;
    vecs_per_head = head_dim / kVec;
    q_units_per_token = p.num_qo_heads * units_per_head;
    k_units = p.num_kv_heads * units_per_head;
    v_vecs = p.num_kv_heads * vecs_per_head;
    units = stride_of(units_per_head);
    vecs = stride_of(vecs_per_head);
  }

  /// A token's kv work: one item (k and v heads), or with an fp8 pool in the scan and direct
  /// write modes two (PoolParams::kv_items): the k heads (item 0) and the v heads (item 1), so
  /// that at small T the e4m3 quantisation of a token's k and v runs on two warps. Both items
  /// decide to write the row or not from the slots alone, so a row stays one token's.
  __device__ __forceinline__ int kv_items() const {
    if constexpr (kFp8Pool) return p.pool.kv_items;
    else return 1;
  }
  /// Which heads kv item `item` handles: kKv (one item), kKHeads or kVHeads.
  __device__ __forceinline__ int kv_parts(int item) const {
    if constexpr (kFp8Pool) return p.pool.kv_items == 1 ? kKv : item == 0 ? kKHeads : kVHeads;
    else return kKv;
  }
  static constexpr int kKHeads = 1, kVHeads = 2, kKv = kKHeads | kVHeads;

  __device__ __forceinline__ int kv_rounds(int parts = kKv) const {
    const int rk = parts & kKHeads ? (k_units + 32 * kKUnits - 1) / (32 * kKUnits) : 0;
    const int rv = parts & kVHeads ? (v_vecs + 32 * kVVecs - 1) / (32 * kVVecs) : 0;
    return rk > rv ? rk : rv;
  }

  // Element offsets inside a head of unit j: the pair (first, first + partner()), or one
  // vector at `first` (interleaved, or a pass-through vector past rotary_dim).
  __device__ __forceinline__ int unit_first(int j) const {
    if (j >= pairs_per_head) return rotary_dim + (j - pairs_per_head) * kVec;
    return kInterleaved && kVec == 1 ? 2 * j : j * kVec;
  }
  __device__ __forceinline__ int partner() const { return kInterleaved ? 1 : half; }

  __device__ __forceinline__ void store_unit(Bits* head, int j, Raw a, Raw b) const {
    const int first = unit_first(j);
    IO::store(head + first, a);
    if (kTwoAccesses && j < pairs_per_head) IO::store(head + first + partner(), b);
  }

  /// Rotates (a, b) in place with one token's table row, or leaves a pass-through vector.
  __device__ __forceinline__ void rotate_unit(const float* cos_row, const float* sin_row, int j,
                                              Raw& a, Raw& b) const {
    if (j >= pairs_per_head) return;
    if constexpr (kInterleaved && kVec > 1) {
      // GPT-J pairs (x[2m], x[2m + 1]) inside one vector: frequencies j * kVec/2 + m.
      constexpr int kPairs = kVec / 2;
      float f[kVec], o[kVec];
      IO::to_float(a, f);
#pragma unroll
      for (int m = 0; m < kPairs; ++m) {
        const float c = cos_row[j * kPairs + m], s = sin_row[j * kPairs + m];
        o[2 * m] = f[2 * m] * c - f[2 * m + 1] * s;
        o[2 * m + 1] = f[2 * m] * s + f[2 * m + 1] * c;
      }
      a = IO::from_float(o);
    } else {
      // Pair element i of (a, b) turns by frequency j * kVec + i (NeoX) or j (scalar GPT-J).
      float fa[kVec], fb[kVec], c[kVec], s[kVec];
      IO::to_float(a, fa);
      IO::to_float(b, fb);
      const float* ct = cos_row + j * kVec;
      const float* st = sin_row + j * kVec;
      if constexpr (kVec % 4 == 0) {
#pragma unroll
        for (int i = 0; i < kVec; i += 4) {
          const float4 c4 = *reinterpret_cast<const float4*>(ct + i);
          const float4 s4 = *reinterpret_cast<const float4*>(st + i);
          c[i] = c4.x, c[i + 1] = c4.y, c[i + 2] = c4.z, c[i + 3] = c4.w;
          s[i] = s4.x, s[i + 1] = s4.y, s[i + 2] = s4.z, s[i + 3] = s4.w;
        }
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) c[i] = ct[i], s[i] = st[i];
      }
      float oa[kVec], ob[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        oa[i] = fa[i] * c[i] - fb[i] * s[i];
        ob[i] = fa[i] * s[i] + fb[i] * c[i];
      }
      a = IO::from_float(oa);
      b = IO::from_float(ob);
    }
  }

  /// GPT-J pairs (x[2m], x[2m + 1]) inside one vector: frequencies j * kVec/2 + m (the fp8
  /// variants; rotate_unit has the same code inline).
  __device__ __forceinline__ void rotate_in_vector(const float* cos_row, const float* sin_row, int j,
                                                   Raw a, float (&o)[kVec]) const {
    constexpr int kPairs = kVec / 2;
    float f[kVec];
    IO::to_float(a, f);
#pragma unroll
    for (int m = 0; m < kPairs; ++m) {
      const float c = cos_row[j * kPairs + m], s = sin_row[j * kPairs + m];
      o[2 * m] = f[2 * m] * c - f[2 * m + 1] * s;
      o[2 * m + 1] = f[2 * m] * s + f[2 * m + 1] * c;
    }
  }

  /// The fp8 variants: unit j's float32 results before rounding (fa, and fb for the second
  /// access of a pair): rotated, or the input of a pass-through vector (exact). (a, b) become
  /// the unit's output in q's dtype, rounded once, as rotate_unit leaves them.
  __device__ __forceinline__ void rotate_unit_float(const float* cos_row, const float* sin_row,
                                                    int j, Raw& a, Raw& b, float (&fa)[kVec],
                                                    float (&fb)[kVec]) const {
    if (j >= pairs_per_head) {
      IO::to_float(a, fa);
      if constexpr (std::is_same_v<E, F16>) IO::keep_nan_signs(a, fa);
      return;
    }
    if constexpr (kInterleaved && kVec > 1) {
      rotate_in_vector(cos_row, sin_row, j, a, fa);
      a = IO::from_float(fa);
    } else {
      float xa[kVec], xb[kVec], c[kVec], s[kVec];
      IO::to_float(a, xa);
      IO::to_float(b, xb);
      const float* ct = cos_row + j * kVec;
      const float* st = sin_row + j * kVec;
      if constexpr (kVec % 4 == 0) {
#pragma unroll
        for (int i = 0; i < kVec; i += 4) {
          const float4 c4 = *reinterpret_cast<const float4*>(ct + i);
          const float4 s4 = *reinterpret_cast<const float4*>(st + i);
          c[i] = c4.x, c[i + 1] = c4.y, c[i + 2] = c4.z, c[i + 3] = c4.w;
          s[i] = s4.x, s[i + 1] = s4.y, s[i + 2] = s4.z, s[i + 3] = s4.w;
        }
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) c[i] = ct[i], s[i] = st[i];
      }
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        fa[i] = xa[i] * c[i] - xb[i] * s[i];
        fb[i] = xa[i] * s[i] + xb[i] * c[i];
      }
      a = IO::from_float(fa);
      b = IO::from_float(fb);
    }
  }

  /// Stores unit j of floats (fa, fb) as e4m3(x / scale) at `head` (an e4m3 head row); kPow2:
  /// the scale is a power of two (fp8_power_of_two, decided once per item by the caller).
  template <bool kPow2 = false>
  __device__ __forceinline__ void store_unit_fp8(uint8_t* head, int j, const float (&fa)[kVec],
                                                 const float (&fb)[kVec], const Fp8Divisor& scale) const {
    const int first = unit_first(j);
    Fp8::store(head + first, Fp8::template quantize<kPow2>(fa, scale));
    if (kTwoAccesses && j < pairs_per_head)
      Fp8::store(head + first + partner(), Fp8::template quantize<kPow2>(fb, scale));
  }

  // ---- SPEC §7's QK norm (rope_pool_norm_kernel) ---------------------------------------------
  // The planner runs it here only when units_per_head is a power of two <= 32: then a lane's
  // units are 32 apart at one j, and a head's units sit in an aligned group of units_per_head
  // lanes (the same stage index in each), so its sum of squares is a butterfly of shuffles
  // inside the group (norm_scales). finish_q / finish_kv then normalise each unit right before
  // rotating it (norm_unit), rounded to q's dtype as SPEC §7 says, so the rotation and every
  // store path (fp8 included) run unchanged.

  /// What a norm leaves for finish_q / finish_kv: r = rsqrt(mean(x^2) + eps) of each unit's
  /// head, and the weights; `on` false: this item's heads have no weight (no norm). The
  /// kernel passes its address unconditionally, so the struct stays in registers (choosing
  /// between its address and nullptr at run time put it on the stack: a local-memory load
  /// per unit).
  struct NormScales {
    float r[kQUnits];
    const void* w;
    float w_offset;  ///< added to each weight: -0 ("rms"), 1 ("gemma")
    bool w_float32, gemma, on;
    Raw wa, wb;  ///< kEarlyWeights, 16-bit weights: the lane's weight vectors (its units' j)
  };

  /// A lane's units all sit at one j (see above), so where the weights are 16-bit and the IO is
  /// a 16-byte vector, norm_scales loads them once, before the sums of squares, instead of each
  /// unit loading them after the previous unit's stores. Not with fp8 outputs, where holding
  /// them spills.
  static constexpr bool kEarlyWeights =
      !std::is_same_v<E, F32> && IO::kBytes == 16 && !kFp8Pool && !kFp8QOut;

  /// Vector x (elements first.. of a head) normalised with r and the weights: "rms"
  /// round(w * round(x * r)), "gemma" round(x * r * (1 + w)), each in float32. "rms" with
  /// weights in q's 16-bit dtype (Qwen3's) takes the second product as one packed multiply of
  /// the rounded vector and the weights as loaded (VecIO::mul_rn, the same bits: 4 instructions
  /// for 8 elements where the float32 path takes 36 to widen both, add -0, multiply and round
  /// again). Otherwise one code path for both styles
  /// (w_offset: -0 or 1, and w + -0 is w for every w, -0 included), so that neither style's
  /// instructions are issued, predicated off, for the other.
  __device__ __forceinline__ void norm_vector(Raw& x, int first, const NormScales& n, float r,
                                              const Raw& w_held) const {
    const void* w = n.w;
    const bool w_float32 = n.w_float32, gemma = n.gemma;
    float f[kVec], wv[kVec];
    IO::to_float(x, f);
    // 16-bit weights: the vector norm_scales loaded (kEarlyWeights) or a load here.
    const auto w16 = [&] {
      if constexpr (kEarlyWeights) return w_held;
      else return IO::load(static_cast<const Bits*>(w) + first);
    };
    if constexpr (!std::is_same_v<E, F32> && IO::kBytes == 16) {  // the vector paths norm here
      if (!gemma && !w_float32) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) f[e] *= r;
        x = IO::mul_rn(IO::from_float(f), w16());
        return;
      }
    }
    if (w_float32) {
      const float* w32 = static_cast<const float*>(w) + first;
      if constexpr (kVec % 4 == 0) {
#pragma unroll
        for (int e = 0; e < kVec; e += 4) {
          const float4 w4 = __ldg(reinterpret_cast<const float4*>(w32 + e));
          wv[e] = w4.x, wv[e + 1] = w4.y, wv[e + 2] = w4.z, wv[e + 3] = w4.w;
        }
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) wv[e] = __ldg(w32 + e);
      }
    } else {
      IO::to_float(w16(), wv);
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) f[e] *= r;
    if (!gemma) IO::to_float(IO::from_float(f), f);  // rms: the normalised value in q's dtype
#pragma unroll
    for (int e = 0; e < kVec; ++e) f[e] *= wv[e] + n.w_offset;
    x = IO::from_float(f);
  }

  /// The r of the kUnits units of one item in stage[2i] (and stage[2i + 1], a pair's second
  /// half), the first at cursor c; heads past `heads` take no part in the sums. Every lane
  /// takes part in the shuffles.
  template <int kUnits>
  __device__ __forceinline__ NormScales norm_scales(const Raw (&stage)[kStage], Cursor c, int heads,
                                                    const void* w, bool w_float32,
                                                    const FusionParams& f, int active = kUnits) const {
    static_assert(kUnits <= kQUnits, "NormScales holds a q chunk's units");
    NormScales n{{}, w, f.norm_gemma ? 1.0f : -0.0f, w_float32, f.norm_gemma, true, {}, {}};
    if constexpr (kEarlyWeights) {
      if (!w_float32) {
        const Bits* w16 = static_cast<const Bits*>(w) + unit_first(c.j);
        n.wa = IO::load(w16);
        if (kTwoAccesses && c.j < pairs_per_head) n.wb = IO::load(w16 + partner());
      }
    }
    float sum[kUnits];
    Cursor u = c;
#pragma unroll
    for (int i = 0; i < kUnits; ++i, advance(u, units)) {
      float x[kVec], s = 0.f;
      IO::to_float(stage[2 * i], x);
#pragma unroll
      for (int e = 0; e < kVec; ++e) s += x[e] * x[e];
      if (kTwoAccesses && u.j < pairs_per_head) {
        IO::to_float(stage[2 * i + 1], x);
#pragma unroll
        for (int e = 0; e < kVec; ++e) s += x[e] * x[e];
      }
      sum[i] = i < active && u.head < heads ? s : 0.f;  // active: a q item of kQUnitsFp8
    }
    for (int m = units_per_head >> 1; m > 0; m >>= 1) {
#pragma unroll
      for (int i = 0; i < kUnits; ++i) sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], m);
    }
#pragma unroll
    for (int i = 0; i < kUnits; ++i)
      n.r[i] = 1.0f / sqrtf(sum[i] / float(head_dim) + f.norm_eps);  // IEEE sqrt and division
    return n;
  }

  /// Unit i of an item (stage pair a, b at index j of its head) normalised in place, right
  /// before finish_q / finish_kv rotates it.
  __device__ __forceinline__ void norm_unit(Raw& a, Raw& b, int j, const NormScales& n, int i) const {
    const int first = unit_first(j);
    norm_vector(a, first, n, n.r[i], n.wa);
    if (kTwoAccesses && j < pairs_per_head) norm_vector(b, first + partner(), n, n.r[i], n.wb);
  }

  /// Where an item's loads go: one pointer per unit (nullptr past the last head), and which
  /// units are pairs that read a second vector partner() elements further on.
  struct Sources {
    const Bits* at[kSources];
    unsigned pairs;
  };
  __device__ __forceinline__ void add_unit(Sources& s, int i, const void* base, int64_t row,
                                           int64_t head_stride, int64_t t, Cursor c, int heads) const {
    s.at[i] = c.head < heads ? static_cast<const Bits*>(base) + t * row + c.head * head_stride +
                                   unit_first(c.j)
                             : nullptr;
    if (kTwoAccesses && c.j < pairs_per_head) s.pairs |= 1u << i;
  }
  __device__ __forceinline__ void load_unit(const Sources& s, int i, Raw& a, Raw& b) const {
    if (s.at[i] == nullptr) return;
    a = IO::load(s.at[i]);
    if (s.pairs & (1u << i)) b = IO::load(s.at[i] + partner());
  }

  // ---- q chunks: 32 * q_item_units() consecutive units of the token's q heads --------------
  /// kQUnits, or with an fp8 q_out where no row lock is taken kQUnitsFp8 (PoolParams::q_units),
  /// so that the e4m3 quantisation of q runs on twice the warps: at small T it is the CTA's
  /// longest chain. Large calls keep kQUnits: more loads in flight per warp.
  __device__ __forceinline__ int q_item_units() const {
    if constexpr (kFp8QOut) return p.pool.q_units;
    else return kQUnits;
  }
  __device__ __forceinline__ int q_chunks() const {
    return (q_units_per_token + 32 * q_item_units() - 1) / (32 * q_item_units());
  }
  __device__ __forceinline__ Cursor q_first(int chunk) const {
    return cursor_at(chunk * q_item_units() * 32 + lane, units);
  }

  /// Addresses only (no memory access): may run before the previous grid has finished.
  __device__ __forceinline__ Sources q_sources(int64_t t, int chunk) const {
    Sources s{{}, 0u};
    Cursor c = q_first(chunk);
#pragma unroll
    for (int i = 0; i < kQUnits; ++i, advance(c, units))
      if (i < q_item_units()) add_unit(s, i, p.q, p.q_row, p.q_head, t, c, p.num_qo_heads);
    return s;
  }

  __device__ __forceinline__ void load_q(const Sources& s, Raw (&stage)[kStage]) const {
#pragma unroll
    for (int i = 0; i < kQUnits; ++i) load_unit(s, i, stage[2 * i], stage[2 * i + 1]);
  }

  /// kPow2: q_scale is a power of two (fp8_power_of_two).
  template <bool kPow2 = false>
  __device__ __forceinline__ void finish_q(int64_t t, int chunk, const float* cos_row,
                                           const float* sin_row, Raw (&stage)[kStage],
                                           const Fp8Divisor* q_scale = nullptr,
                                           const NormScales* norm = nullptr) const {
    Cursor c = q_first(chunk);
#pragma unroll
    for (int i = 0; i < kQUnits; ++i, advance(c, units)) {
      if (i >= q_item_units() || c.head >= p.num_qo_heads) continue;
      if (norm != nullptr && norm->on) norm_unit(stage[2 * i], stage[2 * i + 1], c.j, *norm, i);
      if constexpr (kFp8QOut) {
        // Both halves at once here: one half at a time spills more in the q chunks.
        float fa[kVec], fb[kVec];
        rotate_unit_float(cos_row, sin_row, c.j, stage[2 * i], stage[2 * i + 1], fa, fb);
        store_unit_fp8<kPow2>(static_cast<uint8_t*>(p.q_out) + t * p.qo_row + c.head * p.qo_head, c.j,
                              fa, fb, *q_scale);
      } else {
        rotate_unit(cos_row, sin_row, c.j, stage[2 * i], stage[2 * i + 1]);
        store_unit(static_cast<Bits*>(p.q_out) + t * p.qo_row + c.head * p.qo_head, c.j,
                   stage[2 * i], stage[2 * i + 1]);
      }
    }
  }

  // ---- kv rounds: the token's k and v heads, 32 * (kKUnits, kVVecs) per round -------------
  __device__ __forceinline__ Cursor k_first(int round) const {
    return cursor_at(round * kKUnits * 32 + lane, units);
  }
  __device__ __forceinline__ Cursor v_first(int round) const {
    return cursor_at(round * kVVecs * 32 + lane, vecs);
  }

  /// parts: the heads the item loads (kv_parts); the others' addresses are nullptr.
  __device__ __forceinline__ Sources kv_sources(int64_t t, int round, int parts = kKv) const {
    Sources s{{}, 0u};
    Cursor c = k_first(round);
#pragma unroll
    for (int i = 0; i < kKUnits; ++i, advance(c, units))
      add_unit(s, i, p.k, p.k_row, p.k_head, t, c, parts & kKHeads ? p.num_kv_heads : 0);
    c = v_first(round);
#pragma unroll
    for (int i = 0; i < kVVecs; ++i, advance(c, vecs))
      s.at[kKUnits + i] = parts & kVHeads && c.head < p.num_kv_heads
                              ? static_cast<const Bits*>(p.v) + t * p.v_row + c.head * p.v_head + c.j * kVec
                              : nullptr;
    return s;
  }

  __device__ __forceinline__ void load_kv(const Sources& s, Raw (&stage)[kStage]) const {
#pragma unroll
    for (int i = 0; i < kKUnits; ++i) load_unit(s, i, stage[2 * i], stage[2 * i + 1]);
#pragma unroll
    for (int i = 0; i < kVVecs; ++i)
      if (s.at[kKUnits + i] != nullptr) stage[2 * kKUnits + i] = IO::load(s.at[kKUnits + i]);
  }

  /// Where token t's pool row starts: `slot` (variant 0: row slot * kp_row), or (paged) the
  /// offsets of its page and row in k_pool and v_pool (pool elements), kept in shared memory
  /// (`offsets`, written by the kv warp for itself) and read where each store needs them: two
  /// 64-bit values held in registers across the rounds cost spills at the 64-register cap.
  struct PoolRow {
    int64_t slot;
    volatile int64_t* offsets;
  };
  __device__ __forceinline__ PoolRow pool_row(int64_t slot, int64_t* offsets, int parts = kKv) const {
    PoolRow r{slot, offsets};
    if constexpr (kPaged) {
      const PageRow at = page_row(slot, p.pool);  // once per token
      if (lane == 0) {  // used only when the row is written (slot in range); each its own
        if (parts & kKHeads) offsets[0] = at.page * p.kp_row + at.row * p.pool.kp_in_page;
        if (parts & kVHeads) offsets[1] = at.page * p.vp_row + at.row * p.pool.vp_in_page;
      }
      __syncwarp();
    }
    return r;
  }

  /// kPow2: every scale of `parts` is a power of two (fp8_power_of_two).
  template <bool kPow2 = false>
  __device__ __forceinline__ void finish_kv(int64_t t, const float* cos_row, const float* sin_row,
                                            int round, const PoolRow& row, bool to_pool,
                                            Raw (&stage)[kStage], int parts = kKv,
                                            const Fp8Divisor* kv_scales = nullptr,
                                            const NormScales* norm = nullptr) const {
    Cursor c = k_first(round);
#pragma unroll
    for (int i = 0; i < kKUnits; ++i, advance(c, units)) {
      if (!(parts & kKHeads) || c.head >= p.num_kv_heads) continue;
      if (norm != nullptr && norm->on) norm_unit(stage[2 * i], stage[2 * i + 1], c.j, *norm, i);
      if constexpr (kFp8Pool) {
        // k_pool from the rotated float32 values, before they are rounded to q's dtype.
        float fa[kVec], fb[kVec];
        rotate_unit_float(cos_row, sin_row, c.j, stage[2 * i], stage[2 * i + 1], fa, fb);
        if (p.k_out != nullptr)  // null: no k_rot (SPEC §4 return_k_rot=False; pool variants only)
          store_unit(static_cast<Bits*>(p.k_out) + t * p.ko_row + c.head * p.ko_head, c.j,
                     stage[2 * i], stage[2 * i + 1]);
        if (to_pool)
          store_unit_fp8<kPow2>(static_cast<uint8_t*>(p.k_pool) + k_row_offset(row) + c.head * p.kp_head,
                                c.j, fa, fb, kv_scales[0]);
      } else {
        rotate_unit(cos_row, sin_row, c.j, stage[2 * i], stage[2 * i + 1]);
        // null k_out: no k_rot (SPEC §4 return_k_rot=False), which the planner gives a pool
        // variant; the seed's kernels (variant 0) store unconditionally, as before
        if (!kPaged || p.k_out != nullptr)
          store_unit(static_cast<Bits*>(p.k_out) + t * p.ko_row + c.head * p.ko_head, c.j,
                     stage[2 * i], stage[2 * i + 1]);
        if (to_pool)
          store_unit(static_cast<Bits*>(p.k_pool) + k_row_offset(row) + c.head * p.kp_head, c.j,
                     stage[2 * i], stage[2 * i + 1]);
      }
    }
    if (!to_pool || !(parts & kVHeads)) return;
    c = v_first(round);
#pragma unroll
    for (int i = 0; i < kVVecs; ++i, advance(c, vecs)) {
      if (c.head >= p.num_kv_heads) continue;
      if constexpr (kFp8Pool) {
        float f[kVec];
        IO::to_float(stage[2 * kKUnits + i], f);
        if constexpr (std::is_same_v<E, F16>) IO::keep_nan_signs(stage[2 * kKUnits + i], f);
        Fp8::store(static_cast<uint8_t*>(p.v_pool) + v_row_offset(row) + c.head * p.vp_head + c.j * kVec,
                   Fp8::template quantize<kPow2>(f, kv_scales[1]));
      } else {
        IO::store(static_cast<Bits*>(p.v_pool) + v_row_offset(row) + c.head * p.vp_head + c.j * kVec,
                  stage[2 * kKUnits + i]);
      }
    }
  }
  __device__ __forceinline__ int64_t k_row_offset(const PoolRow& r) const {
    if constexpr (kPaged) return r.offsets[0];
    else return r.slot * p.kp_row;
  }
  __device__ __forceinline__ int64_t v_row_offset(const PoolRow& r) const {
    if constexpr (kPaged) return r.offsets[1];
    else return r.slot * p.vp_row;
  }

  /// Whether token t writes its pool row at all (SPEC §1, §3): negative slots never do;
  /// slots >= pool_size are skipped and recorded for the host.
  __device__ __forceinline__ bool pool_row_valid(int64_t t, int64_t slot) const {
    if (slot >= p.pool_size && lane == 0) record_slot_error(p.error_record, t, slot, p.pool_size);
    return slot >= 0 && slot < p.pool_size;
  }
};

/// Keeps `x` computed here: the compiler may neither sink its computation below this point
/// nor redo it later (used to finish address math before griddepcontrol.wait).
template <class T>
__device__ __forceinline__ void pin(T*& x) {
  asm volatile("" : "+l"(x));
}
__device__ __forceinline__ void pin(unsigned& x) { asm volatile("" : "+r"(x)); }

/// Grids up to this many CTAs read their parameters before waiting for the previous grid.
constexpr unsigned kTouchParamsMaxGrid = 128;

/// A CTA that lands on an SM which has not run this launch yet misses the constant cache on
/// every parameter line it reads, ~250 cycles each, and after the wait those misses are the
/// critical path of a small call. So, first thing, warp 0 reads every 8-byte word before
/// inv_freq (and each thread its first inv_freq entry); just before the wait the values
/// feed a branch to a no-op, which keeps the compiler from moving the loads past it. Large
/// grids skip it: most of their CTAs find the parameters cached already (docs/CUDA.md).
template <int kFreqCap, bool kPoolParams = false>
struct ParamTouch {
  static constexpr int kWords = int(offsetof(KernelParams<kFreqCap>, inv_freq) / 8);
  static_assert(kWords <= 32, "one warp reads the parameters before inv_freq");
  static constexpr int kPoolWords = int(sizeof(PoolParams) / 8);  // after inv_freq
  static_assert(sizeof(PoolParams) % 8 == 0 && kPoolWords <= 32, "one more word per lane");
  unsigned long long word = 0;

  __device__ __forceinline__ void start(const KernelParams<kFreqCap, kPoolParams>& p, bool on) {
    if (on && threadIdx.x < kWords) word = reinterpret_cast<const unsigned long long*>(&p)[threadIdx.x];
    if constexpr (kPoolParams) {
      if (on && threadIdx.x < kPoolWords)
        word ^= reinterpret_cast<const unsigned long long*>(&p.pool)[threadIdx.x];
    }
  }
  __device__ __forceinline__ void finish(bool on, double f0) const {
    if (on && (word ^ static_cast<unsigned long long>(__double_as_longlong(f0))) == 1ull)
      __nanosleep(1);
  }
};

// ---- the kernel -------------------------------------------------------------------------------

// At most 64 registers (launch bounds 256 x 4): 32 resident warps per SM instead of 25 at
// the unconstrained 74-80, i.e. more loads in flight for the bandwidth-bound large calls
// (docs/CUDA.md), at the price of 8 bytes of spills on a few generic paths. The fp8 pools
// with q_out in q's dtype take 80 (256 x 3): at 64 their float32 k values and e4m3 divisions
// spilled 50-70 bytes, and the spill-free kernel measured faster at every T on the H200 (an
// fp8 q_out as well measured faster at 64, spills and all).
//
// CTA b handles token b. Items: the kv item (all kv rounds), then the q chunks; warp w takes
// items w, w + warps, ... Everything that reads no global memory (the first item's addresses;
// on small grids the parameters, see ParamTouch) is done before waiting for the previous
// grid, so after the wait a warp issues its loads at once: at T = 1 the kernel is one short
// chain of latencies (the measured timeline is in docs/NOTES.md).
//
// kPool (PoolVariant bits, 0 for the seed's pools) adds, per token: the page/row of its slot
// (kv warp, once), and the fp8 scales, loaded right after the wait by threads 0-2 and shared,
// prepared for division (Fp8Divisor), through the first 48 bytes of shared memory.
//
// kNorm (rope_pool_norm_kernel): SPEC §7's QK norm with `norm`, each head normalised in
// registers right before it is rotated (HeadOps::norm_scales, norm_unit), where the planner finds a head's
// units in one lane group; the fusion kernels take the other geometries.
//
// kSplit (the uncapped kernel only): a token's items over gridDim.y CTAs, blockIdx.y taking
// items blockIdx.y * warps + w, ...: at small T a token's e4m3 work then issues on several SMs.
template <class E, int kVec, int kHeadDim, int kFreqCap, bool kInterleaved, int kPool, bool kNorm,
          bool kSplit = false>
__device__ __forceinline__ void token_kernel_body(const KernelParams<kFreqCap, kPool != 0>& p,
                                                  const FusionParams* norm) {
  using Ops = HeadOps<E, kVec, kHeadDim, kFreqCap, kInterleaved, kPool>;
  using Raw = typename Ops::Raw;
  constexpr bool kScales = Ops::kFp8Pool || Ops::kFp8QOut;
  extern __shared__ float4 shared[];  // float4: 16-byte aligned table rows
  const bool touch = gridDim.x <= kTouchParamsMaxGrid;
  ParamTouch<kFreqCap, kPool != 0> params_touched;
  params_touched.start(p, touch);
  const Ops ops(p);
  const int e0 = threadIdx.x;
  const double f0 = touch && e0 < ops.half ? p.inv_freq[e0] : 0.0;  // read early when touching

  const int64_t t = blockIdx.x;
  const int half = ops.half;
  // kPool != 0: k_scale, v_scale, q_scale prepared for division (Fp8Divisor) in bytes 0-47,
  // the kv warp's pool row offsets in bytes 48-63 (PoolRow), then the table.
  Fp8Divisor* const divisors = reinterpret_cast<Fp8Divisor*>(shared);
  float* cos_row = reinterpret_cast<float*>(shared) + (kPool != 0 ? kPoolSharedBytes / 4 : 0);
  float* sin_row = cos_row + half;
  // kPoolWriteScan: every slot of the call (T <= kMaxScanTokens) as stored (int32 or int64),
  // after the table (2 * half floats: the slots start 8-byte aligned).
  void* scan_slots = sin_row + half;
  const bool scan = p.pool_write_mode == kPoolWriteScan;

  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5;
  const int kv_items = ops.kv_items();  // 1, or 2 for an fp8 pool at small T (HeadOps::kv_items)
  const int items = kv_items + ops.q_chunks();
  int item = kSplit ? int(blockIdx.y) * warps + warp : warp;
  const int item_step = kSplit ? warps * int(gridDim.y) : warps;

  // Before the wait: the first item's addresses.
  typename Ops::Sources src{{}, 0u};
  if (item < kv_items) src = ops.kv_sources(t, 0, ops.kv_parts(item));
  else if (item < items) src = ops.q_sources(t, item - kv_items);
#pragma unroll
  for (int i = 0; i < Ops::kSources; ++i) pin(src.at[i]);
  pin(src.pairs);
  const void* pos_row = position_row(p, e0);  // SPEC §7: this thread's first frequency's row
  pin(pos_row);
  params_touched.finish(touch, f0);

  wait_for_previous_grid();
  // The scales may have been written by the previous grid: read after the wait, now, so the
  // load overlaps the table; stored to shared memory before the barrier.
  float scale = 1.0f;
  if constexpr (kScales) {
    if (e0 < 3) scale = p.pool.scale_ptr[e0] != nullptr ? __ldg(p.pool.scale_ptr[e0]) : p.pool.scale_value[e0];
  }
  Raw stage[kStage];
  int64_t slot = -1;
  if (item < kv_items) {
    slot = load_index(p.slots, p.slots_stride, p.slots_int64, t);
    ops.load_kv(src, stage);
  } else if (item < items) {
    ops.load_q(src, stage);
  }

  // The call's slots go to shared memory with cp.async, in flight with the loads above and
  // the position load below: no registers held, and their latency hides behind the table.
  if (scan) {
    const int64_t es = p.slots_int64 ? 8 : 4;
    for (int u = threadIdx.x; u < p.num_tokens; u += blockDim.x)
      cp_async(static_cast<char*>(scan_slots) + u * es,
               static_cast<const char*>(p.slots) + u * p.slots_stride * es, p.slots_int64);
  }
  if (e0 < half) token_table(p, t, e0, blockDim.x, half, pos_row, f0, touch, cos_row, sin_row);
  if constexpr (kScales) {
    if (e0 < 3) divisors[e0] = fp8_divisor(scale);
  }
  if (scan) cp_async_wait_all();
  __syncthreads();
  allow_next_grid();

  for (bool prefetched = true; item < items; item += item_step, prefetched = false) {
    if (item < kv_items) {
      // A warp's first item, prefetched; with two kv items and one warp, item 1 is not.
      const int parts = ops.kv_parts(item);
      if (Ops::kFp8Pool && !prefetched) {
        slot = load_index(p.slots, p.slots_stride, p.slots_int64, t);
        ops.load_kv(ops.kv_sources(t, 0, parts), stage);
      }
      // The k item records a bad slot (SPEC §3); a v item of its own only skips it.
      bool to_pool = parts & Ops::kKHeads ? ops.pool_row_valid(t, slot) : slot >= 0 && slot < p.pool_size;
      if (scan && to_pool) {
        // Last token wins: skip the write when a later token of the call has this slot.
        bool later = false;
        for (int64_t u = t + 1 + ops.lane; u < p.num_tokens; u += 32)
          later |= (p.slots_int64 ? static_cast<const long long*>(scan_slots)[u]
                                  : static_cast<const int*>(scan_slots)[u]) == slot;
        to_pool = !__any_sync(0xffffffffu, later);
      }
      typename Ops::PoolRow row{slot, nullptr};
      if constexpr (kPool != 0) row = ops.pool_row(slot, reinterpret_cast<int64_t*>(shared) + 6, parts);
      // Lock mode (one kv item): taken after the loads are in flight, after the barrier (no
      // warp holds a lock across it), released after the row's last store.
      unsigned int* lock = nullptr;
      const int rounds = ops.kv_rounds(parts);
      for (int r = 0; r < rounds; ++r) {
        if (r > 0) ops.load_kv(ops.kv_sources(t, r, parts), stage);
        if (to_pool && p.pool_write_mode == kPoolWriteLock && lock == nullptr) {
          lock = slot_lock(slot);
          lock_row(lock, ops.lane);  // after the loads are in flight
        }
        if constexpr (kNorm) {
          typename Ops::NormScales scales{};  // on = false: k has no weight, or no k heads here
          if (norm->k_norm_weight != nullptr && (parts & Ops::kKHeads))
            scales = ops.template norm_scales<kKUnits>(stage, ops.k_first(r), p.num_kv_heads,
                                                       norm->k_norm_weight, norm->k_norm_float32, *norm);
          ops.finish_kv(t, cos_row, sin_row, r, row, to_pool, stage, parts,
                        Ops::kFp8Pool ? divisors : nullptr, &scales);
        } else if constexpr (Ops::kFp8Pool) {
          // Power-of-two scales take the product path (vec.cuh), chosen once per item.
          const bool pow2 = (!(parts & Ops::kKHeads) || fp8_power_of_two(divisors[0])) &&
                            (!(parts & Ops::kVHeads) || fp8_power_of_two(divisors[1]));
          if (pow2)
            ops.template finish_kv<true>(t, cos_row, sin_row, r, row, to_pool, stage, parts, divisors);
          else
            ops.finish_kv(t, cos_row, sin_row, r, row, to_pool, stage, parts, divisors);
        } else {
          ops.finish_kv(t, cos_row, sin_row, r, row, to_pool, stage);
        }
      }
      if (lock != nullptr) unlock_row(lock, ops.lane);
    } else {
      if (!prefetched) ops.load_q(ops.q_sources(t, item - kv_items), stage);
      if constexpr (kNorm) {
        typename Ops::NormScales scales{};  // on = false: q has no weight
        if (norm->q_norm_weight != nullptr)
          scales = ops.template norm_scales<kQUnits>(stage, ops.q_first(item - kv_items), p.num_qo_heads,
                                                     norm->q_norm_weight, norm->q_norm_float32, *norm,
                                                     ops.q_item_units());
        ops.finish_q(t, item - kv_items, cos_row, sin_row, stage, Ops::kFp8QOut ? divisors + 2 : nullptr,
                     &scales);
      } else if constexpr (Ops::kFp8QOut) {
        if (fp8_power_of_two(divisors[2]))
          ops.template finish_q<true>(t, item - kv_items, cos_row, sin_row, stage, divisors + 2);
        else
          ops.finish_q(t, item - kv_items, cos_row, sin_row, stage, divisors + 2);
      } else {
        ops.finish_q(t, item - kv_items, cos_row, sin_row, stage);
      }
    }
  }
}

template <class E, int kVec, int kHeadDim, int kFreqCap, bool kInterleaved, int kPool = 0>
__global__ void __launch_bounds__(kMaxWarpsPerCta * 32, kPool == (kPoolPaged | kPoolFp8) ? 3 : 4)
    rope_pool_token_kernel(const __grid_constant__ KernelParams<kFreqCap, kPool != 0> p) {
  token_kernel_body<E, kVec, kHeadDim, kFreqCap, kInterleaved, kPool, false>(p, nullptr);
}

/// The pool variants' main kernels at small T (fp8 pools, fp8 q_out, paged pools in q's
/// dtype; LaunchConfig::uncapped): the same body with a bound of one CTA per SM, so the
/// compiler may use up to 255 registers instead of 64 or 80, and a token's items over
/// gridDim.y CTAs (LaunchConfig::ctas_per_token; LaunchConfig::split_plain also runs a 3-D
/// pool in q's dtype here).
template <class E, int kVec, int kHeadDim, int kFreqCap, bool kInterleaved, int kPool>
__global__ void __launch_bounds__(kMaxWarpsPerCta * 32, 1)
    rope_pool_token_kernel_uncapped(const __grid_constant__ KernelParams<kFreqCap, true> p) {
  token_kernel_body<E, kVec, kHeadDim, kFreqCap, kInterleaved, kPool, false, true>(p, nullptr);
}

/// The main kernel with SPEC §7's QK norm (the planner's geometry: see HeadOps::norm_scales), at
/// most 80 registers (256 x 3), where it is free of spills; at 64 it spills 28-68 bytes and
/// measured within 4% either way on the H200 (docs/NOTES.md).
template <class E, int kVec, int kHeadDim, int kFreqCap, bool kInterleaved, int kPool = 0>
__global__ void __launch_bounds__(kMaxWarpsPerCta * 32, 3)
    rope_pool_norm_kernel(const __grid_constant__ KernelParams<kFreqCap, kPool != 0> p,
                          const __grid_constant__ FusionParams norm) {
  token_kernel_body<E, kVec, kHeadDim, kFreqCap, kInterleaved, kPool, true>(p, &norm);
}

}  // namespace ropepool::cuda
