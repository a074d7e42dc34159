// The SIMD part of mla_rope_pool_fused's CPU backend (SPEC §8), per Highway target. Included
// by kernel_hwy-inl.h in each of its passes, after its own code, so it runs on rope_pool_fused's row
// helpers (element formats, row rotations, the sin/cos table, e4m3 quantisation) rather than
// copies of them; mla_kernel.cpp plans the call and runs mla_run_tokens_hwy on the thread pool.
//
// Per token: one sin/cos table (R/2 entries, the angle reduced in double as for
// rope_pool_fused), every q_pe head and the k_pe head rotated in registers (bfloat16 GPT-J
// pairs, DeepSeek's case, through the permute-free even/odd path), then the cache row: kv_c
// copied, or quantised to e4m3 straight from q's dtype, and k_pe_rot.
//
// The op moves T * ((2 * H + 2) * R + L) elements plus the cache rows once, with little
// arithmetic, so it is bound by memory. What that takes:
// - Software prefetch a few KiB ahead, into L2. q_pe is a strided view (R of every nope + R
//   elements) read next to the k_pe/kv_c stream, and the hardware prefetchers lose track of
//   such mixed streams: without it one thread read about 2 GB/s. Prefetching into L1 instead
//   holds an L1 miss buffer per line for the whole trip to memory, and there are too few of
//   them for 128-byte pieces spread over memory: a plain copy of 128 of every 384 bytes moved
//   about 19 GB/s on two AMD EPYC threads with L1 prefetches, 37 with L2 prefetches (dense:
//   45); the op itself gained 1.3-1.5x at T = 4096 (PERFORMANCE.md, SPEC §8 on the CPU).
// - Non-temporal stores for large calls (CallPlan::stream_stores' threshold), which save the
//   read-for-ownership of every written line, the random cache rows included. Rows that are
//   not vector-aligned (any view is accepted) are staged in L1 and copied out with aligned
//   streaming stores (StreamBytes).
// - Cache rows are random, so nearly every one costs a page walk: their first and last lines
//   are touched a batch of tokens ahead, so the walks overlap.

#if defined(ROPEPOOL_SRC_CPU_MLA_HWY_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ROPEPOOL_SRC_CPU_MLA_HWY_INL_H_
#undef ROPEPOOL_SRC_CPU_MLA_HWY_INL_H_
#else
#define ROPEPOOL_SRC_CPU_MLA_HWY_INL_H_
#endif

#include <algorithm>
#include <cassert>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../mla_backend.hpp"
#include "cpu_kernels.hpp"
#include "hwy/cache_control.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace ropepool::detail::cpu {
namespace HWY_NAMESPACE {

// What kernel_hwy.cpp dispatches to (HWY_EXPORT); defined where kernel_hwy-inl.h defines
// the target's functions (ROPEPOOL_HWY_HERE).
void MlaRunTokens(const MlaPlan& plan, int64_t token_begin, int64_t token_end);

#if ROPEPOOL_HWY_HERE
namespace hn = hwy::HWY_NAMESPACE;

// n bytes with non-temporal stores wherever the destination is vector-aligned: plain stores
// up to the first aligned address and for the tail, so any destination streams (CopyBytes
// streams only from an aligned start).
HWY_INLINE void StreamBytes(void* dst, const void* src, size_t n) {
  auto* out = static_cast<uint8_t*>(dst);
  const auto* in = static_cast<const uint8_t*>(src);
  if constexpr (!kCanStream) {
    std::memcpy(out, in, n);
  } else {
    const hn::ScalableTag<uint8_t> d8;
    const size_t N = hn::Lanes(d8);
    size_t i = std::min(n, (N - reinterpret_cast<uintptr_t>(out) % N) % N);
    std::memcpy(out, in, i);
    for (; i + N <= n; i += N) hn::Stream(hn::LoadU(d8, in + i), d8, out + i);
    std::memcpy(out + i, in + i, n - i);
  }
}

// Tokens whose cache rows are touched together, the most q_pe_rot bytes staged at once, and
// how far ahead of the rotation inputs are prefetched (see the loop; measured: 2 KiB is too
// close with L1 prefetches, 16 KiB no better; with L2 prefetches 2 to 16 KiB time alike).
constexpr int64_t kRowBatch = 16;
constexpr int64_t kStageBytes = 2048;
constexpr int64_t kPrefetchBytes = 4096;

template <class E, bool kFp8Cache>
void MlaTokensT(const MlaPlan& plan, int64_t token_begin, int64_t token_end) {
  using T = typename E::T;
  // DeepSeek's case: bfloat16 GPT-J pairs rotate through the even/odd path (plain tables).
  constexpr bool kBF16 = std::is_same_v<E, BFloat16> && kEvenOddBF16;
  const MlaProblem& p = *plan.problem;
  const int64_t H = p.num_heads, R = p.rope_dim, L = p.latent_dim, half = R / 2;
  const bool gptj = p.interleaved;
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  // Table entries computed: whole vectors over R/2 (inv_freq is zero-padded to kTablePad,
  // a multiple of every vector length).
  const int64_t n = round_up(half, N);
  // bfloat16 GPT-J k_pe rows of whole (even, odd) chunks into an fp8 cache rotate from the
  // plain tables too (RotateRowInterleavedBF16WithE4M3)
  const bool fused_k = kBF16 && kFp8Cache && gptj && R % (2 * N) == 0;
  // (RotateRowInterleaved / RotateRowWithE4M3 read the interleaved ones)
  const bool il_tables = gptj && (!kBF16 || (kFp8Cache && !fused_k));
  const bool stream = kCanStream && plan.stream_stores;
  // k_pe_rot (null: not asked for, SPEC §8 return_k_rot=False)
  const bool k_rot_written = p.k_out.data != nullptr;
  constexpr size_t es = sizeof(T);
  const size_t q_row_bytes = size_t(R) * es;

  // q_out rows are streamed in place when every one is vector-aligned (as framework tensors
  // are), else staged in L1, a group of heads at a time, and copied out by StreamBytes.
  const size_t vec_bytes = size_t(N) * sizeof(float);  // >= what every row helper streams
  const bool q_staged = stream && !(Aligned(p.q_out.data, vec_bytes) &&
                                    (size_t(p.q_out.row_stride) * es) % vec_bytes == 0 &&
                                    (size_t(p.q_out.head_stride) * es) % vec_bytes == 0);
  const bool q_dense = p.q_out.head_stride == R;  // a token's q_out rows are one block
  // Staged heads go out kStageBytes at a time: a whole token's rows at H = 128 (16 KiB) next
  // to the rows being read and prefetched overflow L1 (~12% slower).
  const int64_t group = q_staged ? std::max<int64_t>(1, kStageBytes / int64_t(q_row_bytes)) : H;

  thread_local std::vector<float> tables;
  thread_local std::vector<uint8_t> staging;
  tables.resize(size_t(6 * n));
  float* cos_t = tables.data();
  float* sin_t = cos_t + n;
  float* cos_il = sin_t + n;
  float* sin_il = cos_il + 2 * n;
  const size_t q_stage_bytes = q_staged ? size_t(group) * q_row_bytes : 0;
  const size_t row_stage_bytes = size_t(L + R) * (kFp8Cache ? 1 : es);
  staging.resize(q_stage_bytes + row_stage_bytes);
  uint8_t* q_stage = staging.data();
  uint8_t* row_stage = q_stage + q_stage_bytes;  // the cache row (fp8) or k_pe_rot

  const float scale = static_cast<float>(p.attention_scaling);
  const Divisor div(plan.kv_scale);
  const size_t cache_es = kFp8Cache ? 1 : es;

  auto q_in = [&](int64_t t, int64_t h) {
    return static_cast<const T*>(p.q_pe.data) + t * p.q_pe.row_stride + h * p.q_pe.head_stride;
  };
  auto q_out = [&](int64_t t, int64_t h) {
    return static_cast<T*>(p.q_out.data) + t * p.q_out.row_stride + h * p.q_out.head_stride;
  };
  auto cache_row = [&](int64_t slot) {
    const int64_t page = p.page_size == 1 ? slot : slot / p.page_size;
    const int64_t row = p.page_size == 1 ? 0 : slot - page * p.page_size;
    return static_cast<uint8_t*>(p.cache.data) +
           (page * p.cache.page_stride + row * p.cache.row_stride) * int64_t(cache_es);
  };
  // One row; inlined into the head loop (a call per 64-element row costs ~10% in cache).
  auto rotate = [&](const T* x, T* out, bool stream_out) HWY_ATTR __attribute__((always_inline)) {
#if HWY_TARGET != HWY_SCALAR
    if constexpr (kBF16) {
      if (gptj) return RotateRowInterleavedBF16(x, out, nullptr, cos_t, sin_t, R, R, stream_out);
    }
#endif
    if (gptj)
      RotateRowInterleaved<E>(x, out, nullptr, cos_il, sin_il, R, R, stream_out);
    else
      RotateRow<E>(x, out, nullptr, cos_t, sin_t, R, R, stream_out);
  };

  const int64_t num_tokens = p.num_tokens;
  const int64_t cache_row_bytes = (L + R) * int64_t(cache_es);
  // Prefetching follows a cursor over the flat list of q_pe rows (token-major) kPrefetchBytes
  // of rows ahead of the one being rotated; as it enters a token, that token's other inputs
  // (into L2, as the q_pe rows) and the lines it writes with plain stores (into L1) are
  // prefetched too. The same distance serves a
  // decode step (T = 1: the heads of the one token) and long prefill runs.
  // Cache rows are random, one or two 4 KiB pages each, so nearly every one costs a page walk
  // (a nested one in a VM). Touching the first and last line of kRowBatch tokens' rows together
  // lets the walks overlap instead of stalling one token at a time (~15% at H = 16; streamed
  // rows are then overwritten whole). The batches start at the prefetch cursor.
  int64_t touched_end = token_begin;  // rows of tokens below this have been touched
  auto touch_rows = [&](int64_t u0) {
    touched_end = std::min(num_tokens, u0 + kRowBatch);
    for (int64_t u = u0; u < touched_end; ++u) {
      const int64_t slot = p.slots[u];
      if (slot < 0) continue;
      const uint8_t* row = cache_row(slot);
      hwy::Prefetch(row);
      hwy::Prefetch(row + cache_row_bytes - 1);
    }
  };
  int64_t pf_t = token_begin, pf_h = 0;
  auto prefetch_next_row = [&]() HWY_ATTR __attribute__((always_inline)) {
    if (pf_t >= num_tokens) return;
    if (pf_h == 0) {
      if (pf_t >= touched_end) touch_rows(pf_t);
      PrefetchBytesL2(static_cast<const T*>(p.kv_c.data) + pf_t * p.kv_c.row_stride, L * int64_t(es));
      PrefetchBytesL2(static_cast<const T*>(p.k_pe.data) + pf_t * p.k_pe.row_stride, R * int64_t(es));
      // A line this core has read ahead is held exclusively, so a plain store to it needs no
      // read-for-ownership: k_out, the first line of a staged q_out block (shared with the
      // previous token's last), the cache row when not streaming.
      if (k_rot_written)
        PrefetchBytes(static_cast<const T*>(p.k_out.data) + pf_t * p.k_out.row_stride, R * int64_t(es));
      if (q_staged) hwy::Prefetch(q_out(pf_t, 0));
      const int64_t slot = p.slots[pf_t];
      if (!stream && slot >= 0) PrefetchBytes(cache_row(slot), cache_row_bytes);
    }
    PrefetchBytesL2(q_in(pf_t, pf_h), int64_t(q_row_bytes));
    if (++pf_h == H) pf_h = 0, ++pf_t;
  };
  for (int64_t r = 0; r < std::max<int64_t>(1, kPrefetchBytes / int64_t(q_row_bytes)); ++r)
    prefetch_next_row();

  for (int64_t t = token_begin; t < token_end; ++t) {
    SinCosTable(plan.inv_freq_padded, n, p.positions[t], scale, cos_t, sin_t, nullptr);
    if (il_tables) {
      for (int64_t i = 0; i < half; ++i) {
        cos_il[2 * i] = cos_il[2 * i + 1] = cos_t[i];
        sin_il[2 * i] = -sin_t[i];
        sin_il[2 * i + 1] = sin_t[i];
      }
    }

    for (int64_t h0 = 0; h0 < H; h0 += group) {
      const int64_t h1 = std::min(H, h0 + group);
      for (int64_t h = h0; h < h1; ++h) {
        prefetch_next_row();
        if (q_staged)
          rotate(q_in(t, h), reinterpret_cast<T*>(q_stage + size_t(h - h0) * q_row_bytes), false);
        else
          rotate(q_in(t, h), q_out(t, h), stream);
      }
      if (q_staged) {
        if (q_dense) {
          StreamBytes(q_out(t, h0), q_stage, size_t(h1 - h0) * q_row_bytes);
        } else {
          for (int64_t h = h0; h < h1; ++h)
            StreamBytes(q_out(t, h), q_stage + size_t(h - h0) * q_row_bytes, q_row_bytes);
        }
      }
    }

    const T* k_x = static_cast<const T*>(p.k_pe.data) + t * p.k_pe.row_stride;
    T* k_dst = k_rot_written ? static_cast<T*>(p.k_out.data) + t * p.k_out.row_stride : nullptr;
    int64_t slot = p.slots[t];
    if (plan.superseded && plan.superseded[t]) slot = -1;
    assert(slot < p.pool_size);  // validated (SPEC §3)
    // with neither k_pe_rot nor a cache row the token's k_pe has nothing to write
    if (!k_dst && slot < 0) continue;
    const T* kv = static_cast<const T*>(p.kv_c.data) + t * p.kv_c.row_stride;
    if constexpr (kFp8Cache) {
      // SPEC §8: the cache gets the rotated k before it is rounded to k's dtype.
      uint8_t* dst = slot < 0 ? nullptr : stream ? row_stage : cache_row(slot);
#if HWY_TARGET != HWY_SCALAR
      if constexpr (kBF16) {
        if (fused_k)
          RotateRowInterleavedBF16WithE4M3(k_x, k_dst, dst ? dst + L : nullptr, cos_t, sin_t, R, R,
                                           false, div);
      }
#endif
      if (!fused_k)
        RotateRowWithE4M3<E>(k_x, k_dst, dst ? dst + L : nullptr, cos_t, sin_t, cos_il, sin_il, R,
                             R, gptj, false, div);
      if (slot < 0) continue;
      QuantizeInputRow<E>(kv, dst, L, div);
      if (stream) StreamBytes(cache_row(slot), row_stage, size_t(L + R));
    } else {
      T* k_rot = reinterpret_cast<T*>(row_stage);
      rotate(k_x, k_rot, false);
      if (k_dst) std::memcpy(k_dst, k_rot, q_row_bytes);
      if (slot < 0) continue;
      uint8_t* dst = cache_row(slot);
      if (stream) {
        StreamBytes(dst, kv, size_t(L) * es);
        StreamBytes(dst + size_t(L) * es, k_rot, q_row_bytes);
      } else {
        std::memcpy(dst, kv, size_t(L) * es);
        std::memcpy(dst + size_t(L) * es, k_rot, q_row_bytes);
      }
    }
  }
  // Non-temporal stores are weakly ordered: fence before this thread reports completion.
  if (stream) hwy::FlushStream();
}

void MlaRunTokens(const MlaPlan& plan, int64_t token_begin, int64_t token_end) {
  const bool fp8 = plan.problem->cache_dtype == DType::Float8E4M3FN;
  switch (plan.problem->dtype) {
    case DType::Float32:
      return fp8 ? MlaTokensT<Float32, true>(plan, token_begin, token_end)
                 : MlaTokensT<Float32, false>(plan, token_begin, token_end);
    case DType::Float16:
      return fp8 ? MlaTokensT<Float16, true>(plan, token_begin, token_end)
                 : MlaTokensT<Float16, false>(plan, token_begin, token_end);
    case DType::BFloat16:
      return fp8 ? MlaTokensT<BFloat16, true>(plan, token_begin, token_end)
                 : MlaTokensT<BFloat16, false>(plan, token_begin, token_end);
    default:
      return;
  }
}

#endif  // ROPEPOOL_HWY_HERE

}  // namespace HWY_NAMESPACE
}  // namespace ropepool::detail::cpu
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
