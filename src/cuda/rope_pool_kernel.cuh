// The rope_pool_fused CUDA kernel: one launch rotates q and k, writes k_out/q_out and
// writes rotated k and raw v into the pool rows named by `slots`.
//
// Work decomposition (docs/CUDA.md has the full story):
//  - A CTA owns a tile of `tokens_per_cta` consecutive tokens and first builds their
//    cos/sin table in shared memory: one (token, frequency) entry per thread, so each sin/cos
//    is computed once per CTA and shared by every q and k head of the token.
//  - The tile's work is a list of warp-sized items: one "kv item" per token (a single warp
//    rotates all num_kv_heads k heads and copies all v heads, and alone writes the token's
//    whole pool row, under a per-slot lock), then "q items" of 32 * kQUnits units of q.
//  - A unit is one pair of kVec-element vectors (x[i..], x[i + R/2..]) of one head (NeoX),
//    one vector of kVec/2 adjacent pairs (GPT-J "interleaved"; two scalars on the scalar
//    path), or one vector past rotary_dim that is copied. Each warp issues the loads of its first item
//    before the sin/cos work and the barrier, so memory latency overlaps the math.
#pragma once

#include <cstdint>

#include "vec.cuh"

namespace ropepool::cuda {

constexpr int kMaxHalfRotary = 256;  ///< inv_freq entries passed by value (rotary_dim <= 512)
constexpr int kMaxWarpsPerCta = 8;
constexpr int kQUnits = 4;        ///< q units per lane per item (8 vectors in flight)
constexpr int kKUnits = 2;        ///< k units per lane per kv round
constexpr int kVVecs = 4;         ///< v vectors per lane per kv round
constexpr int kStage = 8;         ///< raw vectors a lane holds: 2*kQUnits == 2*kKUnits + kVVecs
constexpr int kSlotLocks = 1 << 16;

/// The first out-of-range slot seen by any call on a device since the host last looked.
/// Lives in mapped pinned host memory so the host reads it without a device sync.
struct SlotErrorRecord {
  unsigned long long seq_written;  ///< device: bumped after token/slot/pool_size are written
  long long token;
  long long slot;
  long long pool_size;
  unsigned long long seq_acked;  ///< host: the last seq_written it reported
};

template <int kFreqCap>
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
  int tokens_per_cta, ctas_per_tile;
  float attention_scaling;
  bool positions_int64, slots_int64, lock_rows;
  SlotErrorRecord* error_record;  ///< device view of this device's record
  double inv_freq[kFreqCap];      ///< R/2 entries; by value: no allocation, graph-safe
};

__device__ unsigned int g_slot_locks[kSlotLocks];
__device__ unsigned long long g_slot_error_claim;

__device__ __forceinline__ int64_t load_index(const void* data, int64_t stride, bool is_int64,
                                              int64_t i) {
  return is_int64 ? __ldg(static_cast<const long long*>(data) + i * stride)
                  : int64_t(__ldg(static_cast<const int*>(data) + i * stride));
}

/// cos and sin of pos * inv_freq, times scale, to float32 accuracy for |pos| < 2^21.
/// The angle is formed and reduced to [-pi, pi] in double (one DMUL, a DFMA pair: Hopper
/// runs FP64 at half the FP32 rate and this is done once per (token, frequency)); __sincosf
/// is only used on the reduced angle, where its absolute error is below 2^-21.
__device__ __forceinline__ void angle_sincos(int64_t pos, double inv_freq, float scale,
                                             float* c, float* s) {
  constexpr double kTwoPiHi = 6.283185307179586232;     // 2*pi rounded to double
  constexpr double kTwoPiLo = 2.449293598294706414e-16;  // 2*pi - kTwoPiHi
  constexpr double kInvTwoPi = 0.15915494309189534561;
  const double theta = double(pos) * inv_freq;
  const double turns = rint(theta * kInvTwoPi);
  const double r = fma(-turns, kTwoPiLo, fma(-turns, kTwoPiHi, theta));
  float sr, cr;
  __sincosf(float(r), &sr, &cr);
  *c = cr * scale;
  *s = sr * scale;
}

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
// most one lock and never waits on anything while holding it: no deadlock.
__device__ __forceinline__ void lock_row(unsigned int* lock, int lane) {
  if (lane == 0) {
    while (atomicCAS(lock, 0u, 1u) != 0u) __nanosleep(32);
    __threadfence();
  }
  __syncwarp();
}
__device__ __forceinline__ void unlock_row(unsigned int* lock, int lane) {
  __threadfence();  // every lane's pool stores are visible before the lock is free
  __syncwarp();
  if (lane == 0) atomicExch(lock, 0u);
}

template <class E, int kVec, int kHeadDim, int kFreqCap, bool kInterleaved>
struct RopePoolCta {
  using IO = VecIO<E, kVec>;
  using Raw = typename IO::Raw;
  using Bits = typename E::Bits;
  // A rotating unit reads a second access (the pair's other half) except for interleaved
  // pairs inside one vector.
  static constexpr bool kTwoAccesses = !kInterleaved || kVec == 1;

  const KernelParams<kFreqCap>& p;
  const float* cos_tab;
  const float* sin_tab;
  int64_t t0;  // first token of the tile
  int tile_tokens;
  int lane;
  // Geometry, compile-time on the tuned paths.
  int head_dim, rotary_dim, half, pairs_per_head, units_per_head, vecs_per_head;

  __device__ RopePoolCta(const KernelParams<kFreqCap>& params, const float* c, const float* s,
                         int64_t first_token, int tokens)
      : p(params), cos_tab(c), sin_tab(s), t0(first_token), tile_tokens(tokens) {
    lane = threadIdx.x & 31;
    head_dim = kHeadDim ? kHeadDim : p.head_dim;
    rotary_dim = kHeadDim ? kHeadDim : p.rotary_dim;
    half = rotary_dim / 2;
    // Rotating units per head: NeoX pairs of vectors, interleaved vectors, or (interleaved,
    // scalar path) pairs of adjacent elements.
    pairs_per_head = !kInterleaved ? half / kVec : kVec == 1 ? half : rotary_dim / kVec;
    units_per_head = pairs_per_head + (head_dim - rotary_dim) / kVec;
    vecs_per_head = head_dim / kVec;
  }

  // Element offsets inside a head of unit j: the pair (first, first + partner()), or one
  // vector at `first` (interleaved, or a pass-through vector past rotary_dim).
  __device__ __forceinline__ int unit_first(int j) const {
    if (j >= pairs_per_head) return rotary_dim + (j - pairs_per_head) * kVec;
    return kInterleaved && kVec == 1 ? 2 * j : j * kVec;
  }
  __device__ __forceinline__ int partner() const { return kInterleaved ? 1 : half; }

  __device__ __forceinline__ void load_unit(const Bits* head, int j, Raw& a, Raw& b) const {
    const int first = unit_first(j);
    a = IO::load(head + first);
    if (kTwoAccesses && j < pairs_per_head) b = IO::load(head + first + partner());
  }

  /// Rotates (a, b) in place with the tile table of token `tok`, or leaves a pass-through
  /// vector alone.
  __device__ __forceinline__ void rotate_unit(int tok, int j, Raw& a, Raw& b) const {
    if (j >= pairs_per_head) return;
    if constexpr (kInterleaved && kVec > 1) {
      rotate_interleaved(tok, j, a);
      return;
    }
    // Pair element i of (a, b) turns by frequency j * kVec + i (NeoX) or j (scalar GPT-J).
    float fa[kVec], fb[kVec], c[kVec], s[kVec];
    IO::to_float(a, fa);
    IO::to_float(b, fb);
    const float* ct = cos_tab + tok * half + j * kVec;
    const float* st = sin_tab + tok * half + j * kVec;
    if constexpr (kVec % 4 == 0 && !kInterleaved) {
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

  /// GPT-J pairs (x[2m], x[2m + 1]) inside one vector: frequencies j * kVec/2 + m.
  __device__ __forceinline__ void rotate_interleaved(int tok, int j, Raw& a) const {
    constexpr int kPairs = kVec / 2;
    float f[kVec], o[kVec];
    IO::to_float(a, f);
    const float* ct = cos_tab + tok * half + j * kPairs;
    const float* st = sin_tab + tok * half + j * kPairs;
#pragma unroll
    for (int m = 0; m < kPairs; ++m) {
      const float c = ct[m], s = st[m];
      o[2 * m] = f[2 * m] * c - f[2 * m + 1] * s;
      o[2 * m + 1] = f[2 * m] * s + f[2 * m + 1] * c;
    }
    a = IO::from_float(o);
  }

  __device__ __forceinline__ void store_unit(Bits* head, int j, Raw a, Raw b) const {
    const int first = unit_first(j);
    IO::store(head + first, a);
    if (kTwoAccesses && j < pairs_per_head) IO::store(head + first + partner(), b);
  }

  // ---- q items: 32 * kQUnits consecutive units of the tile's q heads -------------------
  struct QUnit {
    int tok, head, j;
  };
  __device__ __forceinline__ bool q_unit(int item, int i, QUnit& u) const {
    const int per_token = p.num_qo_heads * units_per_head;
    const int flat = (item * kQUnits + i) * 32 + lane;
    if (flat >= tile_tokens * per_token) return false;
    u.tok = flat / per_token;
    const int rem = flat - u.tok * per_token;
    u.head = rem / units_per_head;
    u.j = rem - u.head * units_per_head;
    return true;
  }

  __device__ __forceinline__ void load_q(int item, Raw (&stage)[kStage]) const {
#pragma unroll
    for (int i = 0; i < kQUnits; ++i) {
      QUnit u;
      if (!q_unit(item, i, u)) continue;
      const Bits* src = static_cast<const Bits*>(p.q) + (t0 + u.tok) * p.q_row + u.head * p.q_head;
      load_unit(src, u.j, stage[2 * i], stage[2 * i + 1]);
    }
  }

  __device__ __forceinline__ void finish_q(int item, Raw (&stage)[kStage]) const {
#pragma unroll
    for (int i = 0; i < kQUnits; ++i) {
      QUnit u;
      if (!q_unit(item, i, u)) continue;
      rotate_unit(u.tok, u.j, stage[2 * i], stage[2 * i + 1]);
      Bits* dst = static_cast<Bits*>(p.q_out) + (t0 + u.tok) * p.qo_row + u.head * p.qo_head;
      store_unit(dst, u.j, stage[2 * i], stage[2 * i + 1]);
    }
  }

  // ---- kv items: one token's k and v heads, in rounds of 32 * (kKUnits, kVVecs) ---------
  __device__ __forceinline__ int kv_rounds() const {
    const int k_units = p.num_kv_heads * units_per_head;
    const int v_vecs = p.num_kv_heads * vecs_per_head;
    const int rk = (k_units + 32 * kKUnits - 1) / (32 * kKUnits);
    const int rv = (v_vecs + 32 * kVVecs - 1) / (32 * kVVecs);
    return rk > rv ? rk : rv;
  }

  __device__ __forceinline__ void load_kv(int tok, int round, Raw (&stage)[kStage]) const {
    const int64_t t = t0 + tok;
    const int k_units = p.num_kv_heads * units_per_head;
    const int v_vecs = p.num_kv_heads * vecs_per_head;
#pragma unroll
    for (int i = 0; i < kKUnits; ++i) {
      const int u = (round * kKUnits + i) * 32 + lane;
      if (u >= k_units) continue;
      const int head = u / units_per_head, j = u - head * units_per_head;
      load_unit(static_cast<const Bits*>(p.k) + t * p.k_row + head * p.k_head, j, stage[2 * i],
                stage[2 * i + 1]);
    }
#pragma unroll
    for (int i = 0; i < kVVecs; ++i) {
      const int u = (round * kVVecs + i) * 32 + lane;
      if (u >= v_vecs) continue;
      const int head = u / vecs_per_head, j = u - head * vecs_per_head;
      stage[2 * kKUnits + i] =
          IO::load(static_cast<const Bits*>(p.v) + t * p.v_row + head * p.v_head + j * kVec);
    }
  }

  __device__ __forceinline__ void finish_kv_round(int tok, int round, int64_t slot, bool to_pool,
                                                  Raw (&stage)[kStage]) const {
    const int64_t t = t0 + tok;
    const int k_units = p.num_kv_heads * units_per_head;
    const int v_vecs = p.num_kv_heads * vecs_per_head;
#pragma unroll
    for (int i = 0; i < kKUnits; ++i) {
      const int u = (round * kKUnits + i) * 32 + lane;
      if (u >= k_units) continue;
      const int head = u / units_per_head, j = u - head * units_per_head;
      rotate_unit(tok, j, stage[2 * i], stage[2 * i + 1]);
      store_unit(static_cast<Bits*>(p.k_out) + t * p.ko_row + head * p.ko_head, j, stage[2 * i],
                 stage[2 * i + 1]);
      if (to_pool)
        store_unit(static_cast<Bits*>(p.k_pool) + slot * p.kp_row + head * p.kp_head, j,
                   stage[2 * i], stage[2 * i + 1]);
    }
    if (!to_pool) return;
#pragma unroll
    for (int i = 0; i < kVVecs; ++i) {
      const int u = (round * kVVecs + i) * 32 + lane;
      if (u >= v_vecs) continue;
      const int head = u / vecs_per_head, j = u - head * vecs_per_head;
      IO::store(static_cast<Bits*>(p.v_pool) + slot * p.vp_row + head * p.vp_head + j * kVec,
                stage[2 * kKUnits + i]);
    }
  }

  __device__ __forceinline__ int64_t load_slot(int tok) const {
    return load_index(p.slots, p.slots_stride, p.slots_int64, t0 + tok);
  }

  /// `stage` holds round 0 already when `prefetched`.
  __device__ __forceinline__ void run_kv(int tok, int64_t slot, bool prefetched,
                                         Raw (&stage)[kStage]) const {
    // Negative: no pool write (SPEC §1). >= pool_size: skipped and reported (SPEC §3).
    const bool to_pool = slot >= 0 && slot < p.pool_size;
    if (slot >= p.pool_size && lane == 0)
      record_slot_error(p.error_record, t0 + tok, slot, p.pool_size);
    unsigned int* lock = nullptr;
    const int rounds = kv_rounds();
    for (int r = 0; r < rounds; ++r) {
      if (!(prefetched && r == 0)) load_kv(tok, r, stage);
      // Taken after the loads are in flight, so the atomic overlaps their latency.
      if (to_pool && p.lock_rows && lock == nullptr) {
        lock = &g_slot_locks[uint64_t(slot) & (kSlotLocks - 1)];
        lock_row(lock, lane);
      }
      finish_kv_round(tok, r, slot, to_pool, stage);
    }
    if (lock != nullptr) unlock_row(lock, lane);
  }
};

template <class E, int kVec, int kHeadDim, int kFreqCap, bool kInterleaved>
__global__ void __launch_bounds__(kMaxWarpsPerCta * 32)
    rope_pool_kernel(const __grid_constant__ KernelParams<kFreqCap> p) {
  extern __shared__ float4 shared_table[];  // float4: 16-byte aligned rows
  using Cta = RopePoolCta<E, kVec, kHeadDim, kFreqCap, kInterleaved>;
  using Raw = typename Cta::Raw;

  const int64_t tile = blockIdx.x / p.ctas_per_tile;
  const int part = blockIdx.x - int(tile * p.ctas_per_tile);
  const int64_t t0 = tile * p.tokens_per_cta;
  const int64_t left = p.num_tokens - t0;
  const int tile_tokens = left < p.tokens_per_cta ? int(left) : p.tokens_per_cta;
  const int half = kHeadDim ? kHeadDim / 2 : p.rotary_dim / 2;
  float* cos_tab = reinterpret_cast<float*>(shared_table);
  float* sin_tab = cos_tab + p.tokens_per_cta * half;
  const Cta cta(p, cos_tab, sin_tab, t0, tile_tokens);

  // Items of this tile: tile_tokens kv items, then the q items.
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5;
  const int q_units = tile_tokens * p.num_qo_heads * cta.units_per_head;
  const int items = tile_tokens + (q_units + 32 * kQUnits - 1) / (32 * kQUnits);
  const int item_step = warps * p.ctas_per_tile;
  int item = part * warps + warp;

  // Issue the first item's loads (and its slot) before the table is built.
  Raw stage[kStage];
  int64_t slot = -1;
  if (item < tile_tokens) {
    slot = cta.load_slot(item);
    cta.load_kv(item, 0, stage);
  } else if (item < items) {
    cta.load_q(item - tile_tokens, stage);
  }

  const float scale = p.attention_scaling;
  for (int e = threadIdx.x; e < tile_tokens * half; e += blockDim.x) {
    const int tok = e / half, i = e - tok * half;
    const int64_t pos = load_index(p.positions, p.positions_stride, p.positions_int64, t0 + tok);
    angle_sincos(pos, p.inv_freq[i], scale, &cos_tab[e], &sin_tab[e]);
  }
  __syncthreads();

  bool prefetched = true;
  for (; item < items; item += item_step, prefetched = false) {
    if (item < tile_tokens) {
      if (!prefetched) slot = cta.load_slot(item);
      cta.run_kv(item, slot, prefetched, stage);
    } else {
      if (!prefetched) cta.load_q(item - tile_tokens, stage);
      cta.finish_q(item - tile_tokens, stage);
    }
  }
}

}  // namespace ropepool::cuda
