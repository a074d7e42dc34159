// CUDA backend of mla_rope_pool_fused (SPEC §8): one launch of warp items (docs/CUDA.md,
// "SPEC §8" has the measurements behind each choice).
//
// A token's work is one kv item (the k_pe head rotated into k_out, unless the call returns no
// k_pe_rot, and the whole cache row: kv_c copied bit for bit, or quantised to e4m3, beside the
// rotated k_pe, which goes into the row from the same registers: fp8 from its float32 value
// before rounding) and q items of its q_pe heads, up to kQUnits 16-byte units per lane (a
// unit: a vector of GPT-J pairs, or a vector and its NeoX partner R/2 further on; kN elements
// on the scalar path) with a head's units in a group of lanes, so a lane's units share their
// offset and sin/cos. Each warp does one item on its own: no CTA-wide barrier, so warps never
// wait for one another. Small calls run one warp per CTA (on as many SMs) with fewer units per
// lane; larger ones 4-warp CTAs.
//
// Order of work in a warp, as in rope_pool_fused's kernel: before the PDL wait what reads no
// memory another grid writes (on small grids every parameter word and the lane's inv_freq
// entry, to warm the constant cache; the item's token); after it, at once, the position,
// every data load of the item, and for the kv item the slot, the fp8 scale and (small calls)
// the later tokens' slots; then the warp's own sin/cos table (the angle in double, reduced
// by a two-part 2*pi: angle.cuh) in its slice of shared memory while those loads are in
// flight; then rotate and store. inv_freq travels by value: 32 doubles for rope_dim <= 64.
//
// A slot >= the cache size is never written; the first one is recorded in the slot-error
// record rope_pool_fused uses (slot_errors.hpp) and reported by the next call. Only the kv
// item writes a cache row, so SPEC §3's rule for two tokens naming one row (the row is one
// token's complete row) concerns one warp per token: up to kMaxScanTokens tokens, a kv warp
// skips its row when a later token of the call names the same slot (the last token wins, as
// on the CPU; no atomics); beyond, the warp writes its row under a per-row spin lock, taken
// once its loads are in flight (an acquiring CAS by lane 0) and released by lane 0 after a
// __syncwarp (one releasing store: a single fence for the warp).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "../mla_backend.hpp"
#include "angle.cuh"
#include "launch.hpp"
#include "limits.hpp"
#include "ropepool/error.hpp"
#include "slot_errors.hpp"
#include "vec.cuh"

namespace ropepool::detail {
namespace {

constexpr int kMaxHalf = 256;   // inv_freq by value: rope_dim <= 512 (cuda_limits)
constexpr int kSmallHalf = 32;  // rope_dim <= 64 (every MLA model): a 256-byte inv_freq
constexpr int kRowLocks = 1 << 16;
constexpr int kMaxWarpsPerCta = 4;
// The launch shape by the call's warp items: up to kFewItems, as many as an H100's or H200's
// SMs (DeepSeek-V3: T <= 7 at H = 128, T <= 44 at H = 16, with the units per lane below), CTAs
// of kMaxWarpsPerCta warps; up to kSmallCallItems one warp per CTA (one to four on an SM;
// DeepSeek-V3: to T = 105 at H = 128, 264 at H = 16); beyond, kMaxWarpsPerCta again. Measured
// on both (docs/CUDA.md, "Launch shape").
constexpr int kFewItems = 132;
constexpr int kSmallCallItems = 4 * kFewItems;
// Calls of fewer q items than this at the most units per lane take a quarter of those units
// (DeepSeek-V3: T < 32 at H = 128, T < 128 at H = 16).
constexpr int kSmallQItems = 128;
// cuda_launch::set_mla_warps_per_cta: 0, or the warps per CTA of every launch.
std::atomic<int> g_forced_warps{0};
// cuda_launch::set_mla_q_units_per_lane: 0, or the q units per lane of every launch.
std::atomic<int> g_forced_units{0};
constexpr int kMaxScanTokens = 256;  // the duplicate scan up to this many tokens, locks beyond
constexpr int kScanPerLane = kMaxScanTokens / 32;
static_assert(2 * kMaxHalf == cuda_limits_values::kMaxRotaryDim);

/// How a kv item keeps two tokens with one slot from mixing the row (SPEC §3).
enum RowGuard : int {
  kRowDirect = 0,  ///< one token per call
  kRowScan = 1,    ///< T <= kMaxScanTokens: skip the row when a later token names the slot
  kRowLock = 2,    ///< a per-row spin lock around the row's stores
};

/// Everything before inv_freq is read by the warps of a small grid before the PDL wait (the
/// kernel's constant-cache warm-up), so keep it within 64 words.
struct MlaShapeParams {
  const void* q_pe;
  const void* k_pe;
  const void* kv_c;
  void* q_out;
  void* k_out;
  void* cache;
  const void* positions;
  const void* slots;
  const float* scale_ptr;  // fp8 with a kv_scale tensor: read when the kernel runs
  cuda::SlotErrorRecord* error_record;
  unsigned long long* error_claim;
  int64_t q_row, q_head, qo_row, qo_head, k_row, ko_row, kv_row;  // elements
  int64_t page_stride, row_stride, page_size, pool_size;          // cache elements
  int64_t positions_stride, slots_stride, num_tokens;
  int64_t q_group, qo_group;  // q_head and qo_head times group_heads
  int num_heads, half, units_per_head, latent_units;
  int items;           // per token: the kv item, then the q items
  int64_t row_tokens;  // tokens per grid row (blockIdx.y)
  uint32_t row_items;  // row_tokens * items, < 2^32
  int kv_rounds;       // of the kv item
  // q items (MlaWarp): groups of group_lanes = 2^group_shift lanes per head, group_heads =
  // 32 / group_lanes heads side by side, 2^slot_shift units of a head per lane; q_per_lane
  // units per lane make item_heads heads per item.
  int group_lanes, group_shift, group_heads, slot_shift, q_per_lane, item_heads;
  int page_shift;  // log2(page_size) when a power of two, else -1
  int row_guard;   // RowGuard
  float attention_scaling, scale_value;
  bool positions_int64, slots_int64, slots_fit_32_bits;
};

template <int kFreqCap>
struct MlaParams : MlaShapeParams {
  double inv_freq[kFreqCap];  // R/2 entries; by value: no allocation, graph-safe
};

constexpr int kParamWords = int(sizeof(MlaShapeParams) / 8);
static_assert(sizeof(MlaShapeParams) % 8 == 0 && kParamWords <= 64, "two words per lane");

__device__ unsigned int g_mla_row_locks[kRowLocks];

using cuda::angle_sincos;
using cuda::Fp8Divisor;
using cuda::load_index;

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

__device__ __noinline__ void record_slot_error(cuda::SlotErrorRecord* rec,
                                               unsigned long long* claim, int64_t token,
                                               int64_t slot, int64_t pool_size) {
  if (rec == nullptr) return;
  const unsigned long long acked = *reinterpret_cast<volatile unsigned long long*>(&rec->seq_acked);
  if (atomicCAS(claim, acked, acked + 1) != acked) return;
  volatile cuda::SlotErrorRecord* r = rec;
  r->token = token;
  r->slot = slot;
  r->pool_size = pool_size;
  __threadfence_system();  // the fields before the sequence number that publishes them
  r->seq_written = acked + 1;
}

/// kN consecutive elements of type E, kept raw (as loaded) until the table is ready: one
/// 16-byte access on the vector path, kN element accesses on the scalar path.
template <class E, int kN, bool kVector>
struct Chunk {
  using Bits = typename E::Bits;
  using One = cuda::VecIO<E, 1>;
  struct Elements {
    typename One::Raw e[kN];
  };
  using Raw =
      std::conditional_t<kVector, typename cuda::VecIO<E, (kVector ? kN : 1)>::Raw, Elements>;
  using Fp8 = cuda::Fp8IO<kVector ? kN : 1>;

  static __device__ __forceinline__ Raw load(const Bits* p) {
    if constexpr (kVector) {
      return cuda::VecIO<E, kN>::load(p);
    } else {
      Raw r;
#pragma unroll
      for (int i = 0; i < kN; ++i) r.e[i] = One::load(p + i);
      return r;
    }
  }
  static __device__ __forceinline__ void store(Bits* p, const Raw& r) {
    if constexpr (kVector) {
      cuda::VecIO<E, kN>::store(p, r);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) One::store(p + i, r.e[i]);
    }
  }
  static __device__ __forceinline__ void to_float(const Raw& r, float (&f)[kN]) {
    if constexpr (kVector) {
      cuda::VecIO<E, kN>::to_float(r, f);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        float one[1];
        One::to_float(r.e[i], one);
        f[i] = one[0];
      }
    }
  }
  /// to_float for an element that is quantised as it is: float16 NaNs keep their sign.
  static __device__ __forceinline__ void to_float_exact(const Raw& r, float (&f)[kN]) {
    to_float(r, f);
    if constexpr (std::is_same_v<E, cuda::F16>) {
      if constexpr (kVector) {
        cuda::VecIO<E, kN>::keep_nan_signs(r, f);
      } else {
#pragma unroll
        for (int i = 0; i < kN; ++i) {
          float one[1] = {f[i]};
          One::keep_nan_signs(r.e[i], one);
          f[i] = one[0];
        }
      }
    }
  }
  static __device__ __forceinline__ Raw from_float(const float (&f)[kN]) {
    if constexpr (kVector) {
      return cuda::VecIO<E, kN>::from_float(f);
    } else {
      Raw r;
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const float one[1] = {f[i]};
        r.e[i] = One::from_float(one);
      }
      return r;
    }
  }
  /// e4m3(f[i] / scale) (SPEC §6) at p: one access of kN bytes, or kN byte stores.
  static __device__ __forceinline__ void store_e4m3(uint8_t* p, const float (&f)[kN],
                                                    const Fp8Divisor& d) {
    if constexpr (kVector) {
      Fp8::store(p, Fp8::quantize(f, d));
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const float one[1] = {f[i]};
        Fp8::store(p + i, Fp8::quantize(one, d));
      }
    }
  }
};

/// The warps' sin/cos tables (dynamic shared memory; float4: 16-byte aligned rows).
extern __shared__ float4 mla_tables[];

/// kCount consecutive floats of a table row (16-byte or 8-byte shared loads where the
/// geometry makes them aligned: see the table layout in the kernel).
template <int kCount>
__device__ __forceinline__ void load_table(const float* row, float (&v)[kCount]) {
  if constexpr (kCount % 4 == 0) {
#pragma unroll
    for (int i = 0; i < kCount; i += 4) {
      const float4 x = *reinterpret_cast<const float4*>(row + i);
      v[i] = x.x, v[i + 1] = x.y, v[i + 2] = x.z, v[i + 3] = x.w;
    }
  } else if constexpr (kCount % 2 == 0) {
#pragma unroll
    for (int i = 0; i < kCount; i += 2) {
      const float2 x = *reinterpret_cast<const float2*>(row + i);
      v[i] = x.x, v[i + 1] = x.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kCount; ++i) v[i] = row[i];
  }
}

/// One warp's work. kN elements per chunk: 16 bytes on the vector path; on the scalar path
/// 2 (one GPT-J pair) or 1 (NeoX: one element of each half). A unit j of a head is the chunk
/// at j * kN (GPT-J: kN / 2 pairs, frequencies j * kN / 2 + m), or (NeoX) the chunks at
/// j * kN and R/2 + j * kN (frequencies j * kN + e).
///
/// q items: a head's units go to a group of G lanes (G a power of two, at most 32), lane
/// j = lane % G of the group taking unit j (and with J > 1 "slots", units j + G, ..., j +
/// (J - 1) G as well), so a lane's units all lie at one offset inside their heads. With
/// kFixedJ (J = 1: the kernels for rope_dim <= 64, where every unit count is at most 16) a
/// lane reads its sin/cos once for all its units.
template <class E, int kN, bool kVector, bool kGptj, bool kFp8, int kFreqCap>
struct MlaWarp {
  using C = Chunk<E, kN, kVector>;
  using Raw = typename C::Raw;
  using Bits = typename E::Bits;
  using CacheBits = std::conditional_t<kFp8, uint8_t, Bits>;
  static constexpr bool kPair = !kGptj;  // a unit reads a second chunk R/2 further on
  static constexpr bool kFixedJ = kFreqCap == kSmallHalf;
  /// Frequencies of one unit: GPT-J kN / 2 pairs, NeoX kN elements.
  static constexpr int kFreqs = kGptj ? kN / 2 : kN;
  /// Per lane: q units of a q item (8 chunks in flight: GPT-J 8 units, NeoX 4 pairs; the
  /// scalar path's units are small, and a head may need up to 8 slots); k units and latent
  /// chunks per round of the kv item (one round for DeepSeek's R = 64, L = 512).
  static constexpr int kQUnits = kPair && kVector ? 4 : 8;
  static constexpr int kLatent = kVector ? (E::kBytes == 4 ? 4 : 2) : 8;

  const MlaParams<kFreqCap>& p;
  int table_at;  // the warp's table: cos at mla_tables[table_at], sin R/2 floats further
  int lane;

  // ---- the table -------------------------------------------------------------------------

  __device__ __forceinline__ float* cos_row() const {
    return reinterpret_cast<float*>(mla_tables) + table_at;
  }
  __device__ __forceinline__ float* sin_row() const { return cos_row() + p.half; }

  /// The warp's table for token t: entry e = lane (+ 32 k) by this lane (its inv_freq entry is
  /// in the constant cache: read before the wait).
  __device__ __forceinline__ void build_table(int64_t pos) const {
    if (lane < p.half)
      angle_sincos(pos, p.inv_freq[lane], p.attention_scaling, cos_row() + lane, sin_row() + lane);
    if constexpr (!kFixedJ) {  // R > 64: more entries per lane
#pragma unroll 1
      for (int e = lane + 32; e < p.half; e += 32)
        angle_sincos(pos, p.inv_freq[e], p.attention_scaling, cos_row() + e, sin_row() + e);
    }
    __syncwarp();
  }
  __device__ __forceinline__ int64_t position(int64_t t) const {
    return load_index(p.positions, p.positions_stride, p.positions_int64, t);
  }
  /// sin/cos of unit j's frequencies.
  __device__ __forceinline__ void table(int j, float (&c)[kFreqs], float (&s)[kFreqs]) const {
    load_table<kFreqs>(cos_row() + j * kFreqs, c);
    load_table<kFreqs>(sin_row() + j * kFreqs, s);
  }

  // ---- rotation of one unit, float32 -----------------------------------------------------

  /// GPT-J: y = the kN / 2 pairs of chunk a rotated; NeoX: (y, w) = the chunks (a, b) at
  /// j * kN and R/2 + j * kN rotated (w unused for GPT-J).
  __device__ __forceinline__ void rotate(const float (&c)[kFreqs], const float (&s)[kFreqs],
                                         const Raw& a, const Raw& b, float (&y)[kN],
                                         float (&w)[kN]) const {
    float x[kN];
    C::to_float(a, x);
    if constexpr (kGptj) {
#pragma unroll
      for (int m = 0; m < kFreqs; ++m) {
        y[2 * m] = x[2 * m] * c[m] - x[2 * m + 1] * s[m];
        y[2 * m + 1] = x[2 * m] * s[m] + x[2 * m + 1] * c[m];
      }
    } else {
      float z[kN];
      C::to_float(b, z);
#pragma unroll
      for (int e = 0; e < kN; ++e) {
        y[e] = x[e] * c[e] - z[e] * s[e];
        w[e] = x[e] * s[e] + z[e] * c[e];
      }
    }
  }

  // ---- q items -----------------------------------------------------------------------------

  /// q item `q_item` of token t: its heads are [q_item * item_heads, + item_heads); this lane
  /// takes, in group lane j0 = lane % G, units (h0 + k group_heads, j0 + l G) for unit i =
  /// k J + l (J = 2^slot_shift slots), i < q_per_lane. Addresses walk head groups: no
  /// multiplication per unit. q_load issues the loads (kUnits per lane at most), q_store
  /// rotates and stores once the table is built.
  struct QLanes {
    int h0, j0;
    uint32_t valid;  // bit i: unit i (one register, not a predicate per unit)
  };
  __device__ __forceinline__ QLanes q_lanes(int q_item) const {
    QLanes q;
    q.h0 = q_item * p.item_heads + (lane >> p.group_shift);  // the lane's first head
    q.j0 = lane & (p.group_lanes - 1);
    const int slots = kFixedJ ? 1 : 1 << p.slot_shift;
    const int groups =
        q.h0 < p.num_heads ? (p.num_heads - q.h0 + p.group_heads - 1) >> (5 - p.group_shift) : 0;
    const int n = q.j0 < p.units_per_head ? min(p.q_per_lane, groups * slots) : 0;
    q.valid = (1u << n) - 1u;
    return q;
  }
  template <int kUnits>
  __device__ __forceinline__ void q_load(int64_t t, const QLanes& q, Raw (&a)[kUnits],
                                         Raw (&b)[kUnits]) const {
    const int slots = kFixedJ ? 1 : 1 << p.slot_shift;
    const int64_t q_group = p.q_group;
    const int slot_step = p.group_lanes * kN;  // elements between a lane's slots
    const Bits* x =
        static_cast<const Bits*>(p.q_pe) + t * p.q_row + int64_t(q.h0) * p.q_head + q.j0 * kN;
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      const int l = kFixedJ ? 0 : i & (slots - 1);
      if (((q.valid >> i) & 1u) && (kFixedJ || q.j0 + l * p.group_lanes < p.units_per_head)) {
        const Bits* u = x + l * slot_step;
        a[i] = C::load(u);
        if constexpr (kPair) b[i] = C::load(u + p.half);
      }
      if (kFixedJ || l == slots - 1) x += q_group;
    }
  }
  template <int kUnits>
  __device__ __forceinline__ void q_store(int64_t t, const QLanes& q, const Raw (&a)[kUnits],
                                          const Raw (&b)[kUnits]) const {
    const int slots = kFixedJ ? 1 : 1 << p.slot_shift;
    const int slot_step = p.group_lanes * kN;
    // One lane's units share their sin/cos (kFixedJ): read once where they are few, else per
    // unit (16 registers held across the rotations spill).
    constexpr bool kHold = kFixedJ && kFreqs <= 4;
    float c[kFreqs], s[kFreqs];
    if constexpr (kHold) {
      if (q.valid) table(q.j0, c, s);
    }
    const int64_t qo_group = p.qo_group;
    Bits* y = static_cast<Bits*>(p.q_out) + t * p.qo_row + int64_t(q.h0) * p.qo_head + q.j0 * kN;
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      const int l = kFixedJ ? 0 : i & (slots - 1);
      if (((q.valid >> i) & 1u) && (kFixedJ || q.j0 + l * p.group_lanes < p.units_per_head)) {
        if constexpr (!kHold) table(q.j0 + l * p.group_lanes, c, s);
        float r[kN], w[kN];
        rotate(c, s, a[i], b[i], r, w);
        Bits* o = y + l * slot_step;
        C::store(o, C::from_float(r));
        if constexpr (kPair) C::store(o + p.half, C::from_float(w));
      }
      if (kFixedJ || l == slots - 1) y += qo_group;
    }
  }
  __device__ __forceinline__ void q_item(int64_t t, int q_item) const {
    const int64_t pos = position(t);
    const QLanes q = q_lanes(q_item);
    Raw a[kQUnits], b[kQUnits];
    q_load(t, q, a, b);
    build_table(pos);
    allow_next_grid();
    q_store(t, q, a, b);
  }

  // ---- the kv item: k_pe -> k_out and the cache row ----------------------------------------

  /// Where slot s's row starts (cache elements): a shift for power-of-two page sizes (1
  /// included), else a 32-bit division when every slot fits, else a 64-bit one.
  __device__ __forceinline__ int64_t row_offset(int64_t slot) const {
    int64_t page, in_page;
    if (p.page_shift >= 0) {
      page = slot >> p.page_shift;
      in_page = slot & (p.page_size - 1);
    } else if (p.slots_fit_32_bits) {
      const uint32_t s = uint32_t(slot), n = uint32_t(p.page_size), q = s / n;
      page = q, in_page = s - q * n;
    } else {
      page = slot / p.page_size;
      in_page = slot - page * p.page_size;
    }
    return page * p.page_stride + in_page * p.row_stride;
  }

  /// Round r: k unit 32 r + lane and latent chunks (r kLatent + i) 32 + lane.
  __device__ __forceinline__ void load_kv(int64_t t, int r, Raw& ka, Raw& kb,
                                          Raw (&la)[kLatent]) const {
    const int j = r * 32 + lane;
    if (j < p.units_per_head) {
      const Bits* k = static_cast<const Bits*>(p.k_pe) + t * p.k_row + j * kN;
      ka = C::load(k);
      if constexpr (kPair) kb = C::load(k + p.half);
    }
    const Bits* l = static_cast<const Bits*>(p.kv_c) + t * p.kv_row;
#pragma unroll
    for (int i = 0; i < kLatent; ++i) {
      const int c = (r * kLatent + i) * 32 + lane;
      if (c < p.latent_units) la[i] = C::load(l + c * kN);
    }
  }

  /// Stores round r's latent chunks into the row (when `row` >= 0), then rotates and stores
  /// its k unit (k_out, and the row's last R elements). Latent first: its registers are free
  /// before the rotation's.
  __device__ __forceinline__ void finish_kv(int64_t t, int r, int64_t row, const Fp8Divisor& d,
                                            const Raw& ka, const Raw& kb,
                                            const Raw (&la)[kLatent]) const {
    CacheBits* row_ptr = static_cast<CacheBits*>(p.cache) + (row >= 0 ? row : 0);
    if (row >= 0) {
#pragma unroll
      for (int i = 0; i < kLatent; ++i) {
        const int c = (r * kLatent + i) * 32 + lane;
        if (c >= p.latent_units) continue;
        if constexpr (kFp8) {
          float f[kN];
          C::to_float_exact(la[i], f);
          C::store_e4m3(row_ptr + c * kN, f, d);
        } else {
          C::store(row_ptr + c * kN, la[i]);  // bit for bit (NaN payloads too): no conversion
        }
      }
    }
    const int j = r * 32 + lane;
    if (j >= p.units_per_head) return;
    float c[kFreqs], s[kFreqs], y[kN], w[kN];
    table(j, c, s);
    rotate(c, s, ka, kb, y, w);
    // k_out is null when the call returns no k_pe_rot (SPEC §8, return_k_rot=False).
    const bool k_rot = p.k_out != nullptr;
    Bits* k_out = static_cast<Bits*>(p.k_out) + t * p.ko_row + j * kN;
    CacheBits* k_row = row_ptr + p.latent_units * kN + j * kN;  // the rotated k_pe after kv_c
    const Raw ry = C::from_float(y);
    if (k_rot) C::store(k_out, ry);
    if (row >= 0) {
      if constexpr (kFp8)
        C::store_e4m3(k_row, y, d);  // before rounding (SPEC §8)
      else
        C::store(k_row, ry);
    }
    if constexpr (kPair) {
      const Raw rw = C::from_float(w);
      if (k_rot) C::store(k_out + p.half, rw);
      if (row >= 0) {
        if constexpr (kFp8)
          C::store_e4m3(k_row + p.half, w, d);
        else
          C::store(k_row + p.half, rw);
      }
    }
  }

  /// The row lock (CUTLASS's semaphore pattern at warp scope): lane 0 takes it with an
  /// acquiring CAS; __syncwarp orders every lane's row stores after it, and before lane 0's
  /// releasing store (one MEMBAR.ALL.GPU for the warp instead of a sequentially consistent
  /// fence per lane).
  __device__ __forceinline__ void lock_row(uint32_t index) const {
    if (lane == 0) {
      unsigned int* lock = &g_mla_row_locks[index];
      for (;;) {
        unsigned int old;
        asm volatile("atom.acquire.gpu.global.cas.b32 %0, [%1], 0, 1;"
                     : "=r"(old)
                     : "l"(lock)
                     : "memory");
        if (old == 0) break;
        __nanosleep(32);
      }
    }
    __syncwarp();
  }
  __device__ __forceinline__ void unlock_row(uint32_t index) const {
    __syncwarp();
    if (lane == 0)
      asm volatile("st.release.gpu.global.b32 [%0], 0;" ::"l"(&g_mla_row_locks[index]) : "memory");
  }

  __device__ __forceinline__ void kv_item(int64_t t) const {
    const int64_t pos = position(t);
    const int64_t slot = load_index(p.slots, p.slots_stride, p.slots_int64, t);
    Raw ka, kb, la[kLatent];
    load_kv(t, 0, ka, kb, la);

    float scale = 1.0f;
    if constexpr (kFp8) scale = p.scale_ptr != nullptr ? __ldg(p.scale_ptr) : p.scale_value;
    bool write_row = slot >= 0 && slot < p.pool_size;
    if (p.row_guard == kRowScan) {
      // Whether a later token of the call names this slot: loads in flight with the data,
      // compared as soon as the slot is there (before the table, which waits for the
      // position anyway), so that they hold no registers across it.
      bool named_later = false;
#pragma unroll
      for (int i = 0; i < kScanPerLane; ++i) {
        const int64_t u = t + 1 + lane + 32 * i;
        if (u < p.num_tokens)
          named_later |= load_index(p.slots, p.slots_stride, p.slots_int64, u) == slot;
      }
      write_row = write_row && !__any_sync(0xffffffffu, named_later);
    }
    build_table(pos);
    allow_next_grid();

    if (slot >= p.pool_size && lane == 0)
      record_slot_error(p.error_record, p.error_claim, t, slot, p.pool_size);
    const int64_t row = write_row ? row_offset(slot) : -1;
    // Lock: taken with the loads in flight, released after the row's last store. A warp holds
    // at most one lock and waits on nothing else while holding it: no deadlock.
    const bool locked = write_row && p.row_guard == kRowLock;
    const uint32_t lock = uint32_t(slot) & (kRowLocks - 1);  // consecutive slots: distinct locks
    if (locked) lock_row(lock);
    Fp8Divisor d{};
    if constexpr (kFp8) d = cuda::fp8_divisor(scale);
    finish_kv(t, 0, row, d, ka, kb, la);
    for (int r = 1; r < p.kv_rounds; ++r) {
      load_kv(t, r, ka, kb, la);
      finish_kv(t, r, row, d, ka, kb, la);
    }
    if (locked) unlock_row(lock);
  }
};

/// One item per warp: flat item t * items + i of a grid row is token t's item i (0: the kv
/// item, i >= 1: q item i - 1). At most 64 registers (32 warps per SM; 72 for the NeoX fp8
/// kernels, which spilled at 64).
template <class E, int kN, bool kVector, bool kGptj, bool kFp8, int kFreqCap>
__global__ void __launch_bounds__(kMaxWarpsPerCta * 32,
                                  kFp8 && !kGptj ? 28 / kMaxWarpsPerCta : 32 / kMaxWarpsPerCta)
    mla_kernel(const __grid_constant__ MlaParams<kFreqCap> p) {
  using Warp = MlaWarp<E, kN, kVector, kGptj, kFp8, kFreqCap>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  // Warp w of grid row y takes item w % items of token y * row_tokens + w / items (32-bit
  // arithmetic: the launcher keeps a row's items below 2^32).
  const uint32_t w = blockIdx.x * warps + warp;
  if (w >= p.row_items) return;
  const int64_t t = int64_t(blockIdx.y) * p.row_tokens + w / uint32_t(p.items);
  if (t >= p.num_tokens) return;
  const int item = int(w % uint32_t(p.items));

  // Before the wait (nothing here reads memory another grid writes). A CTA landing on an SM
  // that has not run this launch misses the constant cache on every parameter line it reads,
  // and after the wait those misses would be the critical path of a small call: the lanes of
  // a small grid read every parameter word now and each lane its inv_freq entry (the values
  // feed a branch to a no-op, so that the loads stay before the wait).
  if (gridDim.x <= 128) {
    unsigned long long touched = lane < p.half ? __double_as_longlong(p.inv_freq[lane]) : 0;
    for (int i = lane; i < kParamWords; i += 32)
      touched ^=
          reinterpret_cast<const unsigned long long*>(static_cast<const MlaShapeParams*>(&p))[i];
    if (touched == 1ull) __nanosleep(1);
  }

  wait_for_previous_grid();
  const int stride = (2 * p.half + 3) & ~3;  // floats per warp, 16-byte aligned
  const Warp ops{p, warp * stride, lane};
  if (item == 0)
    ops.kv_item(t);
  else
    ops.q_item(t, item - 1);
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw BackendError(std::string("mla_rope_pool_fused: CUDA error in ") + what + ": " +
                       cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    switched_ = device != previous_;
    if (switched_) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int log2_of(int x) {  // x a power of two
  int s = 0;
  while ((1 << s) < x) ++s;
  return s;
}

template <class E, int kN, bool kVector, bool kGptj, bool kFp8, int kFreqCap>
void launch_with(const MlaProblem& m, MlaShapeParams shape, cudaStream_t stream) {
  using Warp = MlaWarp<E, kN, kVector, kGptj, kFp8, kFreqCap>;
  const int64_t T = m.num_tokens, H = m.num_heads;
  const int upH = int(kGptj ? m.rope_dim / kN : m.rope_dim / 2 / kN);
  shape.units_per_head = upH;
  shape.latent_units = int(m.latent_dim / kN);
  shape.kv_rounds = std::max(
      (upH + 31) / 32, int((shape.latent_units + 32 * Warp::kLatent - 1) / (32 * Warp::kLatent)));
  // q geometry (MlaWarp): G lanes per head, the smallest power of two >= upH (at most 32),
  // and J slots per lane when a head has more than 32 units.
  int group = 1;
  while (group < upH && group < 32) group *= 2;
  int slots = 1;
  while (slots * group < upH) slots *= 2;
  assert(slots <= Warp::kQUnits && (!Warp::kFixedJ || slots == 1));
  shape.group_lanes = group, shape.group_shift = log2_of(group), shape.group_heads = 32 / group;
  shape.slot_shift = log2_of(slots);
  // Units per lane: the most loads in flight for large calls; a small call is one chain of
  // latencies, and fewer units per lane spread its heads over more SMs.
  int per_lane = Warp::kQUnits;
  const auto items_for = [&](int n) {
    return (H + (32 / group) * (n / slots) - 1) / ((32 / group) * (n / slots));
  };
  if (T * items_for(per_lane) < kSmallQItems) per_lane = std::max(slots, per_lane / 4);
  if (const int forced = g_forced_units.load(std::memory_order_relaxed); forced > 0)
    per_lane = std::min(Warp::kQUnits, std::max(slots, forced));
  shape.q_per_lane = per_lane;
  shape.item_heads = (32 / group) * (per_lane / slots);
  shape.items = int(1 + items_for(per_lane));
  shape.q_group = shape.group_heads * m.q_pe.head_stride;
  shape.qo_group = shape.group_heads * m.q_out.head_stride;
  // CTAs of kMaxWarpsPerCta warps while the items fit the SMs one each (fewer CTAs to start:
  // 7% less time at T = 1, H = 128 under graphs on an H100, 0.2-0.35 µs less at T = 2-4,
  // H = 128 and T = 16-32, H = 16), one warp per CTA up to four per SM, kMaxWarpsPerCta beyond,
  // unless a test or benchmark forces the shape.
  // A grid row (blockIdx.x) holds at most 2^31 warps (32-bit item arithmetic); a call beyond
  // that (2^31 tokens of tiny heads) takes several rows.
  const int64_t total = T * shape.items;
  const int forced = g_forced_warps.load(std::memory_order_relaxed);
  const bool one_warp = total > kFewItems && total <= kSmallCallItems;
  const int warps = forced > 0 ? forced : one_warp ? 1 : kMaxWarpsPerCta;
  const int64_t row_warps = std::min<int64_t>(total, (int64_t(1) << 31) - warps);
  shape.row_tokens = std::min<int64_t>(T, row_warps / shape.items);
  shape.row_items = uint32_t(shape.row_tokens * shape.items);
  const int64_t rows = (T + shape.row_tokens - 1) / shape.row_tokens;
  if (rows > 65535) throw BackendError("mla_rope_pool_fused: too many tokens for one CUDA launch");
  const int64_t ctas = (shape.row_items + warps - 1) / warps;

  MlaParams<kFreqCap> params{};
  static_cast<MlaShapeParams&>(params) = shape;
  for (int64_t i = 0; i < m.rope_dim / 2; ++i) params.inv_freq[i] = m.inv_freq[i];

  cudaLaunchConfig_t launch{};
  launch.gridDim = dim3(unsigned(ctas), unsigned(rows));
  launch.blockDim = dim3(unsigned(32 * warps));
  launch.dynamicSmemBytes = size_t(warps) * size_t((2 * shape.half + 3) & ~3) * sizeof(float);
  launch.stream = stream;
  // PDL (docs/CUDA.md): this launch may start while the previous kernel on the stream drains
  // (every warp waits for it before touching memory) and lets the next one start once its
  // table is built.
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  launch.attrs = &attr;
  launch.numAttrs = 1;
  check(cudaLaunchKernelEx(&launch, mla_kernel<E, kN, kVector, kGptj, kFp8, kFreqCap>, params),
        "cudaLaunchKernelEx (mla_kernel)");
}

template <class E, int kN, bool kVector, bool kGptj, bool kFp8>
void launch(const MlaProblem& m, const MlaShapeParams& shape, cudaStream_t stream) {
  // The scalar path (misaligned views) only with the full inv_freq block: fewer kernels.
  if constexpr (kVector) {
    if (m.rope_dim / 2 <= kSmallHalf)
      return launch_with<E, kN, kVector, kGptj, kFp8, kSmallHalf>(m, shape, stream);
  }
  launch_with<E, kN, kVector, kGptj, kFp8, kMaxHalf>(m, shape, stream);
}

template <class E>
void launch_dtype(const MlaProblem& m, const MlaShapeParams& shape, cudaStream_t stream) {
  constexpr int kVec = 16 / E::kBytes;
  const int64_t es = E::kBytes;
  const bool fp8 = m.cache_dtype == DType::Float8E4M3FN;
  const int64_t T = m.num_tokens, H = m.num_heads;
  auto ok = [&](const void* base, int64_t stride, int64_t extent, int64_t elem) {
    return aligned(base, 16) && (extent <= 1 || (stride * elem) % 16 == 0);
  };
  // 16-byte accesses everywhere (8-byte for an fp8 cache), and a chunk never straddles a
  // pair half or the row's parts.
  const int64_t cache_es = fp8 ? 1 : es;
  const bool vector =
      (m.interleaved ? m.rope_dim % kVec : (m.rope_dim / 2) % kVec) == 0 &&
      m.latent_dim % kVec == 0 && ok(m.q_pe.data, m.q_pe.row_stride, T, es) &&
      ok(m.q_pe.data, m.q_pe.head_stride, H, es) && ok(m.q_out.data, m.q_out.row_stride, T, es) &&
      ok(m.q_out.data, m.q_out.head_stride, H, es) && ok(m.k_pe.data, m.k_pe.row_stride, T, es) &&
      ok(m.k_out.data, m.k_out.row_stride, T, es) && ok(m.kv_c.data, m.kv_c.row_stride, T, es) &&
      aligned(m.cache.data, kVec * cache_es) && m.cache.page_stride % kVec == 0 &&
      m.cache.row_stride % kVec == 0;
  if (vector) {
    if (m.interleaved)
      return fp8 ? launch<E, kVec, true, true, true>(m, shape, stream)
                 : launch<E, kVec, true, true, false>(m, shape, stream);
    return fp8 ? launch<E, kVec, true, false, true>(m, shape, stream)
               : launch<E, kVec, true, false, false>(m, shape, stream);
  }
  // Scalar path: GPT-J chunks are one pair; NeoX chunks one element of each half. The cache
  // row's kv_c part is written in chunks of the same size, so L must be a multiple of it
  // (always for NeoX; for GPT-J L is even in every MLA model, and odd L is refused below).
  if (m.interleaved) {
    if (m.latent_dim % 2 != 0)
      throw BackendError("mla_rope_pool_fused: the CUDA scalar path needs an even kv_lora_rank");
    return fp8 ? launch<E, 2, false, true, true>(m, shape, stream)
               : launch<E, 2, false, true, false>(m, shape, stream);
  }
  return fp8 ? launch<E, 1, false, false, true>(m, shape, stream)
             : launch<E, 1, false, false, false>(m, shape, stream);
}

}  // namespace

void cuda_launch::set_mla_warps_per_cta(int warps) {
  if (warps < 0 || warps > kMaxWarpsPerCta)
    throw BackendError("set_mla_warps_per_cta: " + std::to_string(warps) + " warps per CTA, expected 0 to " +
                       std::to_string(kMaxWarpsPerCta));
  g_forced_warps.store(warps, std::memory_order_relaxed);
}

void cuda_launch::set_mla_q_units_per_lane(int units) {
  if (units != 0 && units != 1 && units != 2 && units != 4 && units != 8)
    throw BackendError("set_mla_q_units_per_lane: " + std::to_string(units) +
                       " units per lane, expected 0, 1, 2, 4 or 8");
  g_forced_units.store(units, std::memory_order_relaxed);
}

void mla_rope_pool_cuda(const MlaProblem& m) {
  assert(m.rope_dim / 2 <= kMaxHalf);
  const int device = cuda_slot_errors::device_of(m.q_pe.data);
  DeviceGuard guard(device);
  cuda_slot_errors::report_pending(device);
  const auto stream = static_cast<cudaStream_t>(m.stream);
  const int64_t T = m.num_tokens;
  if (m.check_slots) {
    // SPEC §3 exactly as on the CPU, for one synchronisation: a host copy of the slots.
    const size_t es = m.slots.is_int64 ? 8 : 4;
    std::vector<unsigned char> bytes(size_t(T) * es);
    const char* src = static_cast<const char*>(m.slots.data);
    if (m.slots.stride >= 1)
      check(cudaMemcpy2DAsync(bytes.data(), es, src, size_t(m.slots.stride) * es, es, size_t(T),
                              cudaMemcpyDeviceToHost, stream),
            "cudaMemcpy2DAsync (slots)");
    else  // a reversed or broadcast view: one entry at a time
      for (int64_t t = 0; t < T; ++t)
        check(cudaMemcpyAsync(bytes.data() + t * es, src + t * m.slots.stride * int64_t(es), es,
                              cudaMemcpyDeviceToHost, stream),
              "cudaMemcpyAsync (slots)");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (check_slots)");
    mla_check_slot_values(Index{bytes.data(), 1, m.slots.is_int64}, T, m.pool_size, true);
  }
  MlaShapeParams p{};
  p.q_pe = m.q_pe.data, p.k_pe = m.k_pe.data, p.kv_c = m.kv_c.data;
  p.q_out = m.q_out.data, p.k_out = m.k_out.data, p.cache = m.cache.data;
  p.positions = m.positions.data, p.slots = m.slots.data;
  p.scale_ptr = m.kv_scale.ptr;
  p.error_record = cuda_slot_errors::record(device);
  p.error_claim = cuda_slot_errors::claim(device);
  p.q_row = m.q_pe.row_stride, p.q_head = m.q_pe.head_stride;
  p.qo_row = m.q_out.row_stride, p.qo_head = m.q_out.head_stride;
  p.k_row = m.k_pe.row_stride, p.ko_row = m.k_out.row_stride, p.kv_row = m.kv_c.row_stride;
  p.page_stride = m.cache.page_stride, p.row_stride = m.cache.row_stride;
  p.page_size = m.page_size, p.pool_size = m.pool_size;
  p.positions_stride = m.positions.stride, p.slots_stride = m.slots.stride;
  p.num_tokens = T;
  p.num_heads = int(m.num_heads), p.half = int(m.rope_dim / 2);
  p.page_shift = -1;
  for (int s = 0; s < 63; ++s)
    if (m.page_size == (int64_t(1) << s)) p.page_shift = s;
  p.slots_fit_32_bits = m.pool_size <= int64_t(0xffffffff);
  p.row_guard = T == 1 ? kRowDirect : T <= kMaxScanTokens ? kRowScan : kRowLock;
  p.attention_scaling = float(m.attention_scaling);
  p.scale_value = m.kv_scale.value;
  p.positions_int64 = m.positions.is_int64, p.slots_int64 = m.slots.is_int64;
  switch (m.dtype) {
    case DType::Float32:
      return launch_dtype<cuda::F32>(m, p, stream);
    case DType::Float16:
      return launch_dtype<cuda::F16>(m, p, stream);
    case DType::BFloat16:
      return launch_dtype<cuda::BF16>(m, p, stream);
    default:
      throw BackendError("mla_rope_pool_fused: unsupported dtype reached the CUDA backend");
  }
}

}  // namespace ropepool::detail
