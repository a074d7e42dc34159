// The CPU kernel on every Highway target this machine supports, with Highway's own test
// pattern (hwy/tests/hwy_gtest.h): each test runs once per target, the library's dynamic
// dispatch restricted to that target.
//   KernelMatchesReference  random shapes, strides, partial rotary, GPT-J pairs, attention
//                           scaling, duplicate / negative slots and NaN/Inf inputs, with 1-3
//                           threads and both store paths: the whole call contract of the
//                           test kit, "last token wins" for repeated slots, and agreement
//                           with a plain scalar evaluation up to float rounding.
//   DemoteIsExhaustive      float32 -> float16/bfloat16 and float32 -> e4m3fn of every
//                           float32 bit pattern (in shards, so ctest spreads them over the
//                           cores), and every 16-bit pattern widened back.
//   E4M3OnEveryBoundary     the vector float32 -> e4m3fn quantisation (x / scale, SPEC §6)
//                           against ropepool::float_to_e4m3: every rounding boundary of every
//                           code (midpoints and their float32 neighbours), saturation, NaN,
//                           subnormals, with several scales, and every 256th float32 pattern;
//                           every bfloat16 pattern through the bf16 row path (v rows) with
//                           every power-of-two scale and some others.
//   Fp8RowsAreTheRotation   bfloat16 k heads into fp8 pools and q heads into an fp8 q_rot:
//                           the pool row and the q_rot row are e4m3 of the float32 rotation
//                           bit for bit (the same call in float32 gives that rotation as k_rot
//                           and q_rot), k_rot that rotation rounded; half-split and GPT-J
//                           pairs, whole (even, odd) chunks or not.
//   MlaFp8KIsTheRotation    the same for mla_rope_pool_fused's fp8 cache rows (k_pe_rot part)
//                           and its k_pe_rot; without k_pe_rot (return_k_rot=False) the
//                           same bytes.
//   CachesMatchReference    paged (NHD/HND, page sizes 1, 5, 16) and combined-cache pools,
//                           fp8 pools and fp8 q_rot, 1-3 threads, each also with SPEC §7's
//                           QK norm with 1 ("rms") and 2 threads ("gemma"): the test kit's
//                           whole-call contract.
//   NormRowsAgree           SPEC §7 on bfloat16 half-split heads: the norm inside the
//                           rotation (the default) and through a scratch row write the same
//                           bytes, "rms" (bfloat16 and float32 weights) and "gemma", with and
//                           without k_rot, pools and q_rot in bf16 or fp8, on values of every
//                           magnitude class (subnormal, huge, zero and non-finite heads, zero
//                           and extreme weights); on ordinary values also the test kit's
//                           whole-call contract.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "test_targets.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#ifndef ROPEPOOL_TEST_TARGETS_SHARED
#define ROPEPOOL_TEST_TARGETS_SHARED

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ropepool_kit.hpp"
#include "ropepool_mla_kit.hpp"
#include "test_hooks.hpp"

namespace ropepool::test {
namespace {

/// Shards of the 2^32 float32 patterns: one ctest entry each.
constexpr int kDemoteShards = 4;
/// Blocks of 2^20 patterns checked: all of them, except under AddressSanitizer (dev.sh's
/// sanitizer pass), where every 16th block keeps the run short; the Release run is complete.
/// g++ defines __SANITIZE_ADDRESS__ under ASan, clang (14) only answers __has_feature.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ROPEPOOL_TEST_UNDER_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(ROPEPOOL_TEST_UNDER_ASAN)
constexpr uint64_t kDemoteBlockStride = 16;
#else
constexpr uint64_t kDemoteBlockStride = 1;
#endif

// ---- the first scalar backend, in behaviour, for "equal up to rounding" ----------------------
template <class T, float (*Load)(T), T (*Store)(float)>
void scalar_run(const detail::RopePoolProblem& p) {
  const int64_t half = p.rotary_dim / 2, D = p.head_dim;
  std::vector<float> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
  auto at = [](const detail::Rows& r, int64_t row, int64_t h) {
    return static_cast<T*>(r.data) + row * r.row_stride + h * r.head_stride;
  };
  auto at_pool = [](const detail::PoolRows& r, int64_t slot, int64_t h) {  // page_size 1
    return static_cast<T*>(r.data) + slot * r.page_stride + h * r.head_stride;
  };
  auto rot = [&](const T* x, T* out, T* out2) {
    for (int64_t i = 0; i < half; ++i) {
      const int64_t ia = p.interleaved ? 2 * i : i, ib = p.interleaved ? 2 * i + 1 : i + half;
      const float a = Load(x[ia]), b = Load(x[ib]);
      const T lo = Store(a * c[size_t(i)] - b * s[size_t(i)]);
      const T hi = Store(a * s[size_t(i)] + b * c[size_t(i)]);
      out[ia] = lo, out[ib] = hi;
      if (out2) out2[ia] = lo, out2[ib] = hi;
    }
    for (int64_t d = p.rotary_dim; d < D; ++d) {
      out[d] = x[d];
      if (out2) out2[d] = x[d];
    }
  };
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double theta = double(p.positions[t]) * p.inv_freq[i];
      const float r = float(theta - std::nearbyint(theta / (2 * M_PI)) * (2 * M_PI));
      c[size_t(i)] = float(p.attention_scaling) * std::cos(r);
      s[size_t(i)] = float(p.attention_scaling) * std::sin(r);
    }
    const int64_t slot = p.slots[t];
    for (int64_t h = 0; h < p.num_qo_heads; ++h) rot(at(p.q, t, h), at(p.q_out, t, h), nullptr);
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      rot(at(p.k, t, h), at(p.k_out, t, h), slot >= 0 ? at_pool(p.k_pool, slot, h) : nullptr);
      if (slot >= 0) std::memcpy(at_pool(p.v_pool, slot, h), at(p.v, t, h), size_t(D) * sizeof(T));
    }
  }
}
float f32_load(float x) { return x; }
float f32_store(float x) { return x; }

void scalar_run_any(const detail::RopePoolProblem& p) {
  if (p.dtype == DType::Float32) scalar_run<float, f32_load, f32_store>(p);
  if (p.dtype == DType::Float16) scalar_run<uint16_t, half_to_float, float_to_half>(p);
  if (p.dtype == DType::BFloat16) scalar_run<uint16_t, bf16_to_float, float_to_bf16>(p);
}

// Distance between two results of the same pair, in units of "one last place of the dtype
// plus one float32 rounding of the inputs' size" (products round at the inputs' scale, so
// a cancelling a*c - b*s may differ by many of its own last places and still be equal up to
// float rounding).
double rounding_units_apart(DType dt, double x, double y, double abs_a_plus_b) {
  if (std::isnan(x) && std::isnan(y)) return 0;
  if (x == y) return 0;
  const double unit = reference::tolerance(dt, std::max(std::fabs(x), std::fabs(y)), 0) +
                      std::ldexp(abs_a_plus_b, -24);
  return std::fabs(x - y) / unit;
}

struct Flavour {
  bool strided, duplicates, specials, check_slots, interleaved;
  double scaling;
  int64_t max_pos;
  int norm = 0;        // SPEC §7: 0 none, 1 "rms" (bf16/f16/f32 weights as q), 2 "gemma" (float32)
  bool mrope = false;  // SPEC §7: positions [3, T], sections over R/2
  bool no_k_rot = false;  // also the call without k_rot (SPEC §4): the same bytes otherwise
};

struct KernelCase {
  DType dtype;
  int64_t T, Hq, Hk, D, R;
  Flavour f;
};

/// SPEC §7 norm weights of a case, q's then k's (head_dim each): around 1 in q's dtype for
/// "rms", around 0 in float32 for "gemma", set on the case's params. Owns their memory.
struct NormWeights {
  std::vector<float> w32;
  std::vector<uint16_t> w16;
  void set(Case& c, DType dtype, int64_t D, bool gemma, Rng& rng) {
    std::normal_distribution<float> normal(0.f, 1.f);
    const DType wt = gemma ? DType::Float32 : dtype;
    w32.resize(size_t(2 * D));
    w16.resize(size_t(2 * D));
    for (size_t d = 0; d < w32.size(); ++d) {
      w32[d] = (gemma ? 0.f : 1.f) + 0.4f * normal(rng);
      w16[d] = dtype == DType::Float16 ? float_to_half(w32[d]) : float_to_bf16(w32[d]);
    }
    char* base = wt == DType::Float32 ? reinterpret_cast<char*>(w32.data()) : reinterpret_cast<char*>(w16.data());
    const int64_t es = int64_t(dtype_size(wt));
    c.params.q_norm_weight = TensorView::contiguous(base, wt, {D});
    c.params.k_norm_weight = TensorView::contiguous(base + D * es, wt, {D});
    if (gemma) c.params.norm_style = "gemma";
  }
};

/// One call on the current target: the kit's contract, "last token wins", and the scalar
/// evaluation within 8 rounding units.
void check_kernel_case(const KernelCase& kc, Rng& rng, const std::string& label) {
  SCOPED_TRACE(label);
  Shape s;
  s.dtype = kc.dtype;
  s.num_tokens = kc.T;
  s.num_qo_heads = kc.Hq;
  s.num_kv_heads = kc.Hk;
  s.head_dim = kc.D;
  s.rotary_dim = kc.R;
  s.interleaved = kc.f.interleaved;
  s.position_dtype = s.slot_dtype = DType::Int64;
  s.pool_size = kc.f.duplicates ? std::max<int64_t>(4, kc.T / 2) : kc.T * 2 + 3;
  Layout l;
  if (kc.f.strided) l = Layout{QkvLayout::Padded, PoolLayout::LayerOfStack, OutLayout::Padded, IndexLayout::Strided};
  Case c(s, l);
  c.params.attention_scaling = kc.f.scaling;
  c.randomize(rng, 0.05);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const TensorView* x : {&c.tensors.q, &c.tensors.k, &c.tensors.v})
    for (int64_t t = 0; t < kc.T; ++t)
      for (int64_t h = 0; h < x->shape[1]; ++h)
        for (int64_t d = 0; d < kc.D; ++d) {
          float v = normal(rng) * 3;
          if (kc.f.specials && rng.integer(0, 999) < 3)
            v = rng.integer(0, 2) == 0 ? NAN : (rng.chance(0.5) ? INFINITY : -INFINITY);
          store(*x, t, h, d, v);
        }
  for (int64_t t = 0; t < kc.T; ++t) {
    c.set_position(t, rng.integer(-kc.f.max_pos / 8, kc.f.max_pos));
    if (kc.f.duplicates) {
      c.set_slot(t, rng.integer(0, 999) < 50 ? -1 - rng.integer(0, 2) : rng.integer(0, s.pool_size - 1));
    }
  }
  // SPEC §7: norm weights (q's dtype for "rms", float32 for "gemma") and mRoPE positions.
  NormWeights weights;
  std::vector<int64_t> pos3;
  if (kc.f.norm) {
    weights.set(c, kc.dtype, kc.D, kc.f.norm == 2, rng);
    c.params.norm_eps = kc.f.norm == 2 ? 1e-6 : 1e-5;
  }
  if (kc.f.mrope) {
    const int64_t half = kc.R / 2, st = half / 4, sh = (half - st) / 2;
    c.params.rope_scaling.mrope_section = {st, sh, half - st - sh};
    c.params.rope_scaling.mrope_interleaved = kc.T % 2 == 1;
    pos3.resize(size_t(3 * kc.T));
    for (int64_t t = 0; t < kc.T; ++t) {
      pos3[size_t(t)] = c.position(t);
      const bool text = rng.chance(0.3);  // three equal rows
      pos3[size_t(kc.T + t)] = c.position(t) + (text ? 0 : rng.integer(0, 64));
      pos3[size_t(2 * kc.T + t)] = c.position(t) + (text ? 0 : rng.integer(0, 64));
    }
    c.tensors.positions = TensorView::contiguous(pos3.data(), DType::Int64, {3, kc.T});
  }
  const Snapshot before = c.snapshot();
  CallOptions options;
  options.check_slots = kc.f.check_slots && !kc.f.duplicates;
  ASSERT_NO_THROW(rope_pool_fused(c.tensors, c.params, options));
  for (const std::string& problem : check_call(c, before)) ADD_FAILURE() << problem;
  if (kc.f.no_k_rot) {
    const Snapshot after = c.snapshot();
    for (const std::string& problem : check_without_k_rot(c, before, options)) ADD_FAILURE() << problem;
    c.restore(after);  // the checks below read k_out
  }

  // Repeated slots: the last token wins, whatever the thread count.
  const TensorView &k_pool = c.tensors.k_pool, &v_pool = c.tensors.v_pool;
  std::vector<int64_t> last(size_t(s.pool_size), -1);
  for (int64_t t = 0; t < kc.T; ++t)
    if (c.slot(t) >= 0) last[size_t(c.slot(t))] = t;
  for (int64_t slot = 0; slot < s.pool_size; ++slot)
    if (const int64_t t = last[size_t(slot)]; t >= 0)
      EXPECT_TRUE(rows_identical(k_pool, slot, c.tensors.k_out, t) && rows_identical(v_pool, slot, c.tensors.v, t))
          << "pool row " << slot << " is not the last writer's (token " << t << ")";

  // The scalar evaluation on a twin of the call (same inputs, the pools as before). Not with
  // a norm: its float32 sum of squares runs in another order there, so a normalised value on
  // a rounding midpoint may differ by the one ulp SPEC §7 allows (check_call allows it).
  if (kc.f.norm) return;
  Case twin(s, l);
  twin.restore(before);
  twin.params = c.params;
  if (kc.f.mrope) twin.tensors.positions = c.tensors.positions;  // read only
  RopeSchedule schedule;
  const detail::RopePoolProblem p = detail::backend_problem(twin.tensors, twin.params, options, schedule);
  scalar_run_any(p);
  double worst_units = 0;
  const int64_t half = kc.R / 2;
  for (auto [in, out, ref] : {std::tuple{&c.tensors.q, &c.tensors.q_out, &twin.tensors.q_out},
                              {&c.tensors.k, &c.tensors.k_out, &twin.tensors.k_out}})
    for (int64_t t = 0; t < kc.T; ++t)
      for (int64_t h = 0; h < in->shape[1]; ++h)
        for (int64_t d = 0; d < kc.R; ++d) {
          const int64_t i = kc.f.interleaved ? d / 2 : d % half;
          const int64_t ia = kc.f.interleaved ? 2 * i : i, ib = kc.f.interleaved ? 2 * i + 1 : i + half;
          const double ab = std::fabs(load(*in, t, h, ia)) + std::fabs(load(*in, t, h, ib));
          const double got = load(*out, t, h, d), old = load(*ref, t, h, d);
          if (std::isfinite(got) || std::isfinite(old))
            worst_units = std::max(worst_units, rounding_units_apart(kc.dtype, got, old, ab));
        }
  EXPECT_LE(worst_units, 8) << "differs from the scalar evaluation by " << worst_units
                            << " units (1 ulp + 2^-24 (|a|+|b|))";
}

/// The kernel against the scalar backend on a grid of shapes, dtypes and SPEC §4/§7 flavours,
/// with `threads` threads (1, 2 and 3 are separate ctest entries, so they run side by side).
void kernel_matches_reference(const char* target, int threads) {
  // The library dispatches to the target under test.
  ASSERT_STREQ(detail::cpu::hwy_target_name(), target);
  const DType dtypes[] = {DType::Float32, DType::Float16, DType::BFloat16};
  struct Dims {
    int64_t T, Hq, Hk, D, R;
  };
  const Dims dims[] = {{1, 1, 1, 2, 2},      {3, 4, 2, 8, 8},       {17, 2, 1, 80, 80},
                       {5, 3, 1, 128, 64},   {33, 8, 2, 64, 64},    {300, 8, 2, 128, 128},
                       {700, 4, 4, 96, 32},  {40, 32, 8, 128, 128}, {2, 16, 4, 256, 256},
                       {1200, 2, 2, 18, 12}, {9, 5, 3, 34, 34}};
  const Flavour flavours[] = {{false, false, false, true, false, 1.0, 1 << 16},
                              {true, false, false, false, false, 1.0, (1 << 20) - 1},
                              {false, true, false, false, false, 1.25, 1 << 16},
                              {true, true, true, false, false, 1.0, 1 << 16},
                              {false, false, false, false, true, 1.0, 1 << 16},
                              {true, true, false, false, true, 0.75, (1 << 20) - 1},
                              // SPEC §7: QK norm ("rms", "gemma") and mRoPE, alone and combined
                              {false, false, false, false, false, 1.0, 1 << 16, 1, false, true},
                              {true, true, false, false, true, 1.0, 1 << 16, 2, true},
                              {false, false, false, false, false, 1.25, (1 << 20) - 1, 1, true},
                              // SPEC §4 return_k_rot=False
                              {true, true, false, false, false, 1.0, 1 << 16, 0, false, true},
                              {false, false, false, false, true, 1.0, (1 << 20) - 1, 0, false, true}};
  Rng rng(fresh_seed());
  SCOPED_TRACE("seed " + std::to_string(rng.seed()) + " (replay: ROPEPOOL_TEST_SEED)");
  const int saved_threads = cpu_num_threads();
  set_cpu_num_threads(threads);
  // Non-temporal stores on every call with 2 threads (aligned rows take them), never
  // with 1 or 3: both store paths are checked on every target.
  detail::cpu::set_stream_min_bytes(threads == 2 ? 0 : -1);
  // With 2 or 3 threads every call is split (tokens, or heads when tokens are few).
  detail::cpu::set_parallel_min_bytes(threads == 1 ? 1 << 20 : 1);
  for (DType dt : dtypes)
    for (const Dims& d : dims)
      for (size_t f = 0; f < std::size(flavours); ++f) {
        const std::string label = std::string(target) + " threads=" + std::to_string(threads) + " " +
                                  dtype_name(dt) + " T=" + std::to_string(d.T) + " Hq=" + std::to_string(d.Hq) +
                                  " Hk=" + std::to_string(d.Hk) + " D=" + std::to_string(d.D) +
                                  " R=" + std::to_string(d.R) + " flavour " + std::to_string(f);
        check_kernel_case({dt, d.T, d.Hq, d.Hk, d.D, d.R, flavours[f]}, rng, label);
        if (::testing::Test::HasFatalFailure()) return;
      }
  set_cpu_num_threads(saved_threads);
  detail::cpu::set_stream_min_bytes(16 << 20);
  detail::cpu::set_parallel_min_bytes(1 << 20);
}

void demote_is_exhaustive(const char* target, int shard) {
  ASSERT_STREQ(detail::cpu::hwy_target_name(), target);
  std::vector<float> in(1 << 20);
  std::vector<uint16_t> out(1 << 20);
  std::vector<uint8_t> out8(1 << 20);
  int64_t bad = 0;
  const uint64_t per_shard = (uint64_t(1) << 32) / kDemoteShards;
  for (uint64_t base = per_shard * uint64_t(shard); base < per_shard * uint64_t(shard + 1);
       base += in.size() * kDemoteBlockStride) {
    for (size_t i = 0; i < in.size(); ++i) in[i] = bits_float(uint32_t(base + i));
    // e4m3 (scale 1: the division is exact), every pattern
    detail::cpu::quantize_e4m3_row_hwy(in.data(), out8.data(), int64_t(in.size()), 1.0f);
    for (size_t i = 0; i < in.size(); ++i)
      if (out8[i] != float_to_e4m3(in[i]) && ++bad <= 5)
        ADD_FAILURE() << "e4m3: " << std::hex << uint32_t(base + i) << " -> " << int(out8[i])
                      << ", want " << int(float_to_e4m3(in[i]));
    for (DType dt : {DType::Float16, DType::BFloat16}) {
      detail::cpu::demote_row_hwy(dt, in.data(), out.data(), int64_t(in.size()));
      for (size_t i = 0; i < in.size(); ++i) {
        const uint16_t want = dt == DType::Float16 ? float_to_half(in[i]) : float_to_bf16(in[i]);
        if (out[i] == want) continue;
        // The kernel's bf16 rounding assumes what every NaN it can produce has: a zero low
        // half (see RoundToBF16High); other NaN patterns never reach it.
        if (dt == DType::BFloat16 && std::isnan(in[i]) && (float_bits(in[i]) & 0xffffu)) continue;
        // NaN payloads may differ; NaN must stay NaN.
        const float widened = dt == DType::Float16 ? half_to_float(out[i]) : bf16_to_float(out[i]);
        if (std::isnan(in[i]) && std::isnan(widened)) continue;
        if (++bad <= 5)
          ADD_FAILURE() << "demote " << dtype_name(dt) << ": " << std::hex << uint32_t(base + i)
                        << " -> " << out[i] << ", want " << want;
      }
    }
  }
  EXPECT_EQ(bad, 0);
  if (shard != 0) return;
  // Every 16-bit pattern widened.
  std::vector<uint16_t> all16(1 << 16);
  std::iota(all16.begin(), all16.end(), 0);
  std::vector<float> wide(1 << 16);
  for (DType dt : {DType::Float16, DType::BFloat16}) {
    detail::cpu::promote_row_hwy(dt, all16.data(), wide.data(), 1 << 16);
    for (int i = 0; i < (1 << 16); ++i) {
      const float want = dt == DType::Float16 ? half_to_float(uint16_t(i)) : bf16_to_float(uint16_t(i));
      // F16C quiets signalling NaNs on the way (sets the quiet bit): still the same NaN.
      const bool same_nan = std::isnan(wide[size_t(i)]) && std::isnan(want) &&
                            (float_bits(wide[size_t(i)]) >> 31) == (float_bits(want) >> 31);
      if (float_bits(wide[size_t(i)]) != float_bits(want) && !same_nan)
        ADD_FAILURE() << "promote " << dtype_name(dt) << ": " << std::hex << i << " -> "
                      << float_bits(wide[size_t(i)]) << ", want " << float_bits(want);
    }
  }
}

void e4m3_on_every_boundary(const char* target) {
  ASSERT_STREQ(detail::cpu::hwy_target_name(), target);
  std::vector<float> in;
  for (int code = 0; code < 0x7e; ++code) {
    const float lo = e4m3_to_float(uint8_t(code)), hi = e4m3_to_float(uint8_t(code + 1));
    const float mid = lo + (hi - lo) / 2;  // exact in float32
    float below = mid, above = mid;
    for (int i = 0; i < 3; ++i) {
      below = std::nextafter(below, 0.0f), above = std::nextafter(above, 1e9f);
      for (float x : {below, above}) in.push_back(x), in.push_back(-x);
    }
    for (float x : {lo, mid, hi}) in.push_back(x), in.push_back(-x);
  }
  for (float x : {448.0f, 449.0f, 463.99f, 464.0f, 465.0f, 480.0f, 1e6f, 3.4e38f, INFINITY,
                  -INFINITY, NAN, -NAN, 0.0f, -0.0f, 1e-45f, 1e-30f, 0x1p-10f, 0x1p-9f, 0x1p-6f,
                  std::nextafter(0x1p-6f, 0.0f), 0x1.ep-7f, 0x1.fp-7f})
    in.push_back(x), in.push_back(-x);
  in.push_back(bits_float(0x7f800001u));  // signalling NaN
  in.push_back(bits_float(0xffc00123u));
  std::vector<uint8_t> out(in.size());
  int64_t bad = 0;
  // 2^-106 and above fold E4M3Code's 2^20 into the division; 2^-107, 1e-33 (below) and
  // float32 subnormal scales divide first
  for (float scale : {1.0f, 0.3f, 3.0f, 1.0f / 448.0f, 0x1p-20f, 1e20f, 0x1p-106f, 0x1p-107f,
                      1e-33f, 3e-39f, 0x1p100f}) {
    std::vector<float> pre(in.size());
    for (size_t i = 0; i < in.size(); ++i) pre[i] = in[i] * scale;  // x / scale near the boundary
    detail::cpu::quantize_e4m3_row_hwy(pre.data(), out.data(), int64_t(pre.size()), scale);
    for (size_t i = 0; i < pre.size(); ++i)
      if (out[i] != float_to_e4m3(pre[i] / scale) && ++bad <= 5)
        ADD_FAILURE() << "e4m3(" << pre[i] << " / " << scale << ") = 0x" << std::hex << int(out[i])
                      << ", want 0x" << int(float_to_e4m3(pre[i] / scale));
  }
  // every 256th float32 pattern (every exponent, sign and NaN class), offset so all low bits vary
  std::vector<float> sweep(1 << 16);
  out.resize(sweep.size());
  for (uint64_t base = 0; base < (uint64_t(1) << 32); base += uint64_t(sweep.size()) * 256) {
    for (size_t i = 0; i < sweep.size(); ++i)
      sweep[i] = bits_float(uint32_t(base + i * 256 + (i * 37) % 256));
    detail::cpu::quantize_e4m3_row_hwy(sweep.data(), out.data(), int64_t(sweep.size()), 1.0f);
    for (size_t i = 0; i < sweep.size(); ++i)
      if (out[i] != float_to_e4m3(sweep[i]) && ++bad <= 5)
        ADD_FAILURE() << "e4m3 of bits 0x" << std::hex << float_bits(sweep[i]) << " = 0x"
                      << int(out[i]) << ", want 0x" << int(float_to_e4m3(sweep[i]));
  }
  // every bfloat16 pattern through the bf16 row (on vector targets the even/odd split, or
  // 16-bit lanes with a power-of-two scale 2^-k, k in [-119, 115]): with every power-of-two
  // scale, normal and subnormal, and some others
  std::vector<uint16_t> all16(1 << 16);
  std::iota(all16.begin(), all16.end(), 0);
  out.resize(all16.size());
  std::vector<float> scales = {0.3f, 3.0f, 1.0f / 448.0f, 1e20f, 1e-33f, 0x1.fffffep127f};
  for (int e = -149; e <= 127; ++e) scales.push_back(std::ldexp(1.0f, e));
  for (float scale : scales) {
    // rows of many lengths, so whole vectors, half vectors and the scalar tail all run
    for (size_t at = 0, len = 1; at < all16.size(); at += len, len = len % 97 + 13)
      detail::cpu::quantize_e4m3_bf16_row_hwy(all16.data() + at, out.data() + at,
                                              int64_t(std::min(len, all16.size() - at)), scale);
    for (size_t i = 0; i < all16.size(); ++i) {
      const uint8_t want = float_to_e4m3(bf16_to_float(all16[i]) / scale);
      if (out[i] != want && ++bad <= 5)
        ADD_FAILURE() << "e4m3 of bf16 0x" << std::hex << all16[i] << " / " << scale << " = 0x"
                      << int(out[i]) << ", want 0x" << int(want);
    }
  }
  EXPECT_EQ(bad, 0);
}

// The bench and the kit check a k pool row and an fp8 q_rot only within one e4m3 step of the
// exact value (k_rot is rounded). Here they must be e4m3(f / scale) exactly, f the float32
// rotation: the same call in float32 (16-bit inputs widened, q_rot in float32) rotates with
// the same float32 operations and returns f as k_rot and q_rot, so its pool row is e4m3(k_rot /
// k_scale) and the bfloat16 or float16 call's pool row and fp8 q_rot are e4m3(f / scale) bit for
// bit, and its k_rot is f rounded to its dtype. Half-split and GPT-J pairs.
void fp8_rows_are_the_rotation(const char* target) {
  ASSERT_STREQ(detail::cpu::hwy_target_name(), target);
  Rng rng(fresh_seed());
  SCOPED_TRACE("seed " + std::to_string(rng.seed()) + " (replay: ROPEPOOL_TEST_SEED)");
  // head sizes whose R/2 is a whole number of (even, odd) chunks on every target, and not
  const int64_t dims[][2] = {{128, 128}, {256, 256}, {128, 64}, {40, 40}, {96, 72}};
  for (const DType dtype : {DType::BFloat16, DType::Float16}) {
    for (const bool interleaved : {false, true}) {
      for (const auto& dim : dims)
        for (double k_scale : {0.015625, 0.02, 1.7}) {
          SCOPED_TRACE(dtype_name(dtype) +
                       std::string(interleaved ? ", GPT-J pairs" : ", half-split pairs"));
          Shape s;
          s.dtype = dtype;
          s.interleaved = interleaved;
          s.num_tokens = 23;
          s.num_qo_heads = 2;
          s.num_kv_heads = 3;
          s.head_dim = dim[0];
          s.rotary_dim = dim[1];
          s.pool_size = 40;
          s.pool_dtype = DType::Float8E4M3FN;
          s.k_scale = k_scale;
          s.v_scale = 0.7;
          s.q_out_dtype = DType::Float8E4M3FN;
          s.q_scale = k_scale;
          Case b(s);
          b.randomize(rng);
          // values of every magnitude class: x * 2^e for e in [-30, 30] (float16: [-12, 12], its
          // range) saturates, goes subnormal
          const int e_max = dtype == DType::Float16 ? 12 : 30;
          for (TensorView* x : {&b.tensors.q, &b.tensors.k})
            for (int64_t t = 0; t < s.num_tokens; ++t)
              for (int64_t h = 0; h < x->shape[1]; ++h)
                for (int64_t d = 0; d < s.head_dim; ++d)
                  store(*x, t, h, d,
                        float(load(*x, t, h, d) *
                              std::ldexp(1.0, int(rng() % uint64_t(2 * e_max + 1)) - e_max)));
          Shape s32 = s;
          s32.dtype = DType::Float32;
          s32.q_out_dtype = DType::Other;
          s32.q_scale = 0;
          Case f(s32);
          f.randomize(rng);
          for (int64_t t = 0; t < s.num_tokens; ++t) {
            f.set_position(t, b.position(t));
            f.set_slot(t, b.slot(t));
            for (int64_t h = 0; h < s.num_qo_heads; ++h)
              for (int64_t d = 0; d < s.head_dim; ++d)
                store(f.tensors.q, t, h, d, float(load(b.tensors.q, t, h, d)));
            for (int64_t h = 0; h < s.num_kv_heads; ++h)
              for (int64_t d = 0; d < s.head_dim; ++d) {
                store(f.tensors.k, t, h, d, float(load(b.tensors.k, t, h, d)));
                store(f.tensors.v, t, h, d, float(load(b.tensors.v, t, h, d)));
              }
          }
          ASSERT_NO_THROW(rope_pool_fused(b.tensors, b.params));
          ASSERT_NO_THROW(rope_pool_fused(f.tensors, f.params));
          const float scale = float(k_scale);
          int64_t bad = 0, checked = 0;
          for (int64_t t = 0; t < s.num_tokens; ++t) {
            const int64_t slot = b.slot(t);
            if (slot < 0) continue;
            for (int64_t h = 0; h < s.num_kv_heads; ++h)
              for (int64_t d = 0; d < s.head_dim; ++d) {
                const TensorView& bp = b.tensors.k_pool;
                const TensorView& fp = f.tensors.k_pool;
                const uint8_t got = static_cast<const uint8_t*>(
                    bp.data)[slot * bp.strides[0] + h * bp.strides[1] + d * bp.strides[2]];
                const uint8_t got32 = static_cast<const uint8_t*>(
                    fp.data)[slot * fp.strides[0] + h * fp.strides[1] + d * fp.strides[2]];
                const uint8_t want = float_to_e4m3(float(load(f.tensors.k_out, t, h, d)) / scale);
                ++checked;
                if ((got != want || got32 != want) && ++bad <= 5)
                  ADD_FAILURE() << "D " << dim[0] << " R " << dim[1] << " k_scale " << k_scale
                                << " token " << t << " head " << h << " d " << d << ": "
                                << dtype_name(dtype) << " call 0x" << std::hex << int(got)
                                << ", float32 call 0x" << int(got32)
                                << ", want 0x" << int(want);
              }
          }
          EXPECT_GT(checked, 0);
          ASSERT_EQ(bad, 0);
          for (int64_t t = 0; t < s.num_tokens; ++t)
            for (int64_t h = 0; h < s.num_kv_heads; ++h)
              for (int64_t d = 0; d < s.head_dim; ++d) {
                auto bits = [&](double x) {
                  return dtype == DType::Float16 ? float_to_half(float(x)) : float_to_bf16(float(x));
                };
                const uint16_t got = bits(load(b.tensors.k_out, t, h, d));
                const uint16_t want = bits(load(f.tensors.k_out, t, h, d));
                if (got != want && ++bad <= 5)
                  ADD_FAILURE() << "D " << dim[0] << " R " << dim[1] << " token " << t << " head "
                                << h << " d " << d << ": k_rot 0x" << std::hex << got << ", want 0x"
                                << want;
              }
          ASSERT_EQ(bad, 0);
          const float q_scale = float(s.q_scale);
          for (int64_t t = 0; t < s.num_tokens; ++t)
            for (int64_t h = 0; h < s.num_qo_heads; ++h)
              for (int64_t d = 0; d < s.head_dim; ++d) {
                const TensorView& qo = b.tensors.q_out;
                const uint8_t got = static_cast<const uint8_t*>(
                    qo.data)[t * qo.strides[0] + h * qo.strides[1] + d * qo.strides[2]];
                const uint8_t want = float_to_e4m3(float(load(f.tensors.q_out, t, h, d)) / q_scale);
                if (got != want && ++bad <= 5)
                  ADD_FAILURE() << "D " << dim[0] << " R " << dim[1] << " q_scale " << q_scale
                                << " token " << t << " head " << h << " d " << d << ": q_rot 0x"
                                << std::hex << int(got) << ", want 0x" << int(want);
              }
          ASSERT_EQ(bad, 0);
        }
    }
  }
}

// The same for mla_rope_pool_fused with an fp8 cache (SPEC §8): a bfloat16 call's k_pe_rot part
// of each cache row is e4m3(f / kv_scale) bit for bit and its k_pe_rot is f rounded to
// bfloat16, f the float32 rotation, which the same call in float32 returns as k_pe_rot; its
// kv_c part is the float32 call's. R = 64 (DeepSeek's) rotates in whole (even, odd) chunks on
// every target, R = 40 on none of the wider ones. (A last-bit difference in f itself shows only
// where it crosses an e4m3 or bfloat16 rounding boundary: this holds the path and the
// quantisation, not every float32 operation.)
void mla_fp8_k_is_the_rotation(const char* target) {
  ASSERT_STREQ(detail::cpu::hwy_target_name(), target);
  Rng rng(fresh_seed());
  SCOPED_TRACE("seed " + std::to_string(rng.seed()) + " (replay: ROPEPOOL_TEST_SEED)");
  for (int64_t R : {64, 40})
    for (double kv_scale : {0.015625, 0.02, 1.7}) {
      MlaShape s;
      s.cache_dtype = DType::Float8E4M3FN;
      s.num_tokens = 19;
      s.num_heads = 3;
      s.rope_dim = R;
      s.latent_dim = 96;
      s.kv_scale = kv_scale;
      MlaCase b(s);
      b.randomize(rng);
      // every magnitude class: k_pe * 2^e for e in [-30, 30] saturates, goes subnormal
      for (int64_t t = 0; t < s.num_tokens; ++t)
        for (int64_t d = 0; d < R; ++d)
          store(b.tensors.k_pe, t, d, 0,
                float(load(b.tensors.k_pe, t, d, 0) * std::ldexp(1.0, int(rng() % 61) - 30)));
      MlaShape s32 = s;
      s32.dtype = DType::Float32;
      MlaCase f(s32);
      f.randomize(rng);
      for (int64_t t = 0; t < s.num_tokens; ++t) {
        f.set_position(t, index_at(b.tensors.positions, t));
        f.set_slot(t, index_at(b.tensors.slots, t));
        for (int64_t h = 0; h < s.num_heads; ++h)
          for (int64_t d = 0; d < R; ++d)
            store(f.tensors.q_pe, t, h, d, float(load(b.tensors.q_pe, t, h, d)));
        for (int64_t d = 0; d < R; ++d)
          store(f.tensors.k_pe, t, d, 0, float(load(b.tensors.k_pe, t, d, 0)));
        for (int64_t d = 0; d < s.latent_dim; ++d)
          store(f.tensors.kv_c, t, d, 0, float(load(b.tensors.kv_c, t, d, 0)));
      }
      const MlaCase::Snapshot b_before = b.snapshot(), f_before = f.snapshot();
      ASSERT_NO_THROW(mla_rope_pool_fused(b.tensors, b.params));
      ASSERT_NO_THROW(mla_rope_pool_fused(f.tensors, f.params));
      // SPEC §8 return_k_rot=False: the same calls without k_pe_rot write the same bytes (the
      // calls are made again; the k_out views are restored for the checks below)
      for (MlaCase* c : {&b, &f}) {
        const MlaCase::Snapshot after = c->snapshot();
        for (const std::string& problem : c->check_without_k_rot(c == &b ? b_before : f_before))
          ADD_FAILURE() << "R " << R << " kv_scale " << kv_scale << ": " << problem;
        for (size_t i = 0; i < c->buffers().size(); ++i) c->buffers()[i]->restore(after.bytes[i]);
      }
      const float scale = float(kv_scale);
      const int64_t L = s.latent_dim;
      auto cache_byte = [&](const MlaCase& c, int64_t slot, int64_t col) {
        const TensorView& kc = c.tensors.kv_cache;
        return static_cast<const uint8_t*>(kc.data)[slot * kc.strides[0] + col * kc.strides[1]];
      };
      int64_t bad = 0, checked = 0;
      for (int64_t t = 0; t < s.num_tokens; ++t) {
        const int64_t slot = index_at(b.tensors.slots, t);
        for (int64_t d = 0; d < R; ++d) {
          const float k = float(load(f.tensors.k_out, t, d, 0));
          const float k_bf16 = float(load(b.tensors.k_out, t, d, 0));
          if (float_to_bf16(k) != float_to_bf16(k_bf16) && ++bad <= 5)
            ADD_FAILURE() << "R " << R << " token " << t << " k_pe_rot[" << d << "] = " << k_bf16
                          << ", want bfloat16 of " << k;
          if (slot < 0) continue;
          const uint8_t want = float_to_e4m3(k / scale);
          ++checked;
          const uint8_t got = cache_byte(b, slot, L + d), got32 = cache_byte(f, slot, L + d);
          if ((got != want || got32 != want) && ++bad <= 5)
            ADD_FAILURE() << "R " << R << " kv_scale " << kv_scale << " token " << t << " k " << d
                          << ": bf16 call 0x" << std::hex << int(got) << ", float32 call 0x"
                          << int(got32) << ", want 0x" << int(want) << std::dec;
        }
        for (int64_t d = 0; slot >= 0 && d < L; ++d)
          if (cache_byte(b, slot, d) != cache_byte(f, slot, d) && ++bad <= 5)
            ADD_FAILURE() << "R " << R << " token " << t << " kv_c " << d << " differs";
      }
      EXPECT_GT(checked, 0);
      ASSERT_EQ(bad, 0);
    }
}

void caches_match_reference(const char* target) {
  ASSERT_STREQ(detail::cpu::hwy_target_name(), target);
  Rng rng(fresh_seed());
  SCOPED_TRACE("seed " + std::to_string(rng.seed()) + " (replay: ROPEPOOL_TEST_SEED)");
  // The library's defaults again on every way out, a failure's early return included.
  struct Restore {
    int threads = cpu_num_threads();
    ~Restore() {
      set_cpu_num_threads(threads);
      detail::cpu::set_stream_min_bytes(16 << 20);
      detail::cpu::set_parallel_min_bytes(1 << 20);
    }
  } restore;
  for (int threads : {1, 2, 3}) {
    set_cpu_num_threads(threads);
    detail::cpu::set_parallel_min_bytes(threads == 1 ? 1 << 20 : 1);
    // Non-temporal stores on every call with 2 threads (rows that are vector-aligned take
    // them, the e4m3 rows too), never with 1 or 3.
    detail::cpu::set_stream_min_bytes(threads == 2 ? 0 : -1);
    for (DType dt : {DType::Float32, DType::Float16, DType::BFloat16})
      for (KvLayout layout : {KvLayout::None, KvLayout::NHD, KvLayout::HND})
        for (int64_t page_size : {1, 5, 16})
          for (int fp8 = 0; fp8 < 4; ++fp8)  // bit 0: fp8 pools, bit 1: fp8 q_rot
          for (int norm = 0; norm <= (threads < 3 ? 1 : 0); ++norm) {
            // SPEC §7's QK norm with every cache: "rms" (weights in q's dtype) with one
            // thread, "gemma" (float32 weights) with two
            if (layout == KvLayout::None && page_size != 1) continue;
            Shape s;
            s.dtype = dt;
            s.num_tokens = 45;
            s.num_qo_heads = 3;
            s.num_kv_heads = 2;
            // With 2 threads (streaming) rows of whole 64-byte lines, unpadded, so the
            // vector-aligned store paths run; otherwise an odd head size.
            const bool lines = threads == 2;
            s.head_dim = lines ? 128 : 40;
            s.rotary_dim = fp8 == 3 ? 24 : 0;
            s.interleaved = fp8 == 2;
            s.pool_size = 70;
            s.kv_layout = layout;
            s.page_size = page_size;
            if (fp8 & 1) s.pool_dtype = DType::Float8E4M3FN, s.k_scale = 0.02, s.v_scale = 0.7;
            if (fp8 & 2) s.q_out_dtype = DType::Float8E4M3FN, s.q_scale = 0.013;
            s.tensor_scales = page_size == 5;
            Case c(s, Layout{lines ? QkvLayout::Contiguous : QkvLayout::Padded,
                             page_size == 16 ? PoolLayout::CombinedFlashInfer : PoolLayout::CombinedVllm,
                             lines ? OutLayout::Contiguous : OutLayout::Padded, IndexLayout::Strided});
            c.randomize(rng);
            const bool gemma = threads == 2;
            NormWeights weights;
            if (norm) weights.set(c, dt, s.head_dim, gemma, rng);
            const std::string label = std::string(target) + " threads " + std::to_string(threads) + " " +
                                      dtype_name(dt) + " " + kv_layout_name(layout) + " page_size " +
                                      std::to_string(page_size) + " fp8 " + std::to_string(fp8) +
                                      (norm ? (gemma ? " gemma" : " rms") : "");
            const Snapshot before = c.snapshot();
            ASSERT_NO_THROW(rope_pool_fused(c.tensors, c.params)) << label;
            for (const std::string& problem : check_call(c, before)) ADD_FAILURE() << label << ": " << problem;
            // SPEC §4 return_k_rot=False: the same call without k_rot writes the same bytes
            for (const std::string& problem : check_without_k_rot(c, before))
              ADD_FAILURE() << label << ": " << problem;
            if (::testing::Test::HasFailure()) return;
          }
  }
}

// SPEC §7: the two ways the bfloat16 kernel normalises a half-split head (detail::cpu::NormRows)
// give the same bytes in every buffer. R = D with R/2 a whole number of (even, odd) chunks on
// every target (the fused way), and D = 80, whose R/2 = 40 is whole chunks only on the
// 128-bit targets (elsewhere both ways take the scratch row).
void norm_rows_agree(const char* target) {
  using detail::cpu::NormRows;
  ASSERT_STREQ(detail::cpu::hwy_target_name(), target);
  Rng rng(fresh_seed());
  SCOPED_TRACE("seed " + std::to_string(rng.seed()) + " (replay: ROPEPOOL_TEST_SEED)");
  std::normal_distribution<float> normal(0.f, 1.f);
  auto pow2 = [&](int lo, int hi) { return std::ldexp(1.0f, int(rng.integer(lo, hi))); };
  for (const int64_t D : {64, 128, 256, 80})
    for (int style = 0; style < 3; ++style)  // "rms" bf16 weights, "rms" float32 weights, "gemma"
      for (const bool extreme : {false, true})
        for (const bool k_rot : {true, false})
        for (const bool fp8 : {false, true}) {  // fp8 pools and q_rot (SPEC §6)
          SCOPED_TRACE("D " + std::to_string(D) + ", style " + std::to_string(style) +
                       (extreme ? ", extreme values" : "") + (k_rot ? "" : ", no k_rot") +
                       (fp8 ? ", fp8 pools and q_rot" : ""));
          Shape s;
          s.dtype = DType::BFloat16;
          s.num_tokens = 29;
          s.num_qo_heads = 3;
          s.num_kv_heads = 2;
          s.head_dim = D;
          s.pool_size = 40;
          if (fp8) {
            s.pool_dtype = s.q_out_dtype = DType::Float8E4M3FN;
            s.k_scale = 0.02, s.v_scale = 0.7, s.q_scale = 0.015625;
          }
          Case c(s);
          c.randomize(rng, 0.1);
          for (const TensorView* x : {&c.tensors.q, &c.tensors.k})
            for (int64_t t = 0; t < s.num_tokens; ++t)
              for (int64_t h = 0; h < x->shape[1]; ++h) {
                // extreme: a head scaled into bfloat16's subnormals, near its overflow, all
                // zeros, with NaN/Inf, or spread over every binade
                const int kind = extreme ? int(rng.integer(0, 4)) : -1;
                const float head_scale = kind == 0 ? pow2(-140, -126) : kind == 1 ? pow2(100, 125) : 1.0f;
                for (int64_t d = 0; d < D; ++d) {
                  float v = normal(rng) * 3 * head_scale;
                  if (kind == 2) v = rng.chance(0.5) ? 0.0f : -0.0f;
                  if (kind == 3 && rng.integer(0, 15) == 0) v = rng.chance(0.3) ? NAN : (rng.chance(0.5) ? INFINITY : -INFINITY);
                  if (kind == 4) v *= pow2(-135, 120);
                  store(*x, t, h, d, v);
                }
              }
          const bool gemma = style == 2;
          const DType wt = style == 0 ? DType::BFloat16 : DType::Float32;
          std::vector<float> w32(size_t(2 * D));
          std::vector<uint16_t> w16(size_t(2 * D));
          for (int64_t d = 0; d < 2 * D; ++d) {
            float w = (gemma ? 0.f : 1.f) + 0.4f * normal(rng);
            if (extreme && rng.integer(0, 15) == 0) w = rng.chance(0.3) ? 0.0f : w * pow2(-130, 100);
            w32[size_t(d)] = w;
            w16[size_t(d)] = float_to_bf16(w);
          }
          void* base = wt == DType::Float32 ? static_cast<void*>(w32.data()) : w16.data();
          const size_t es = dtype_size(wt);
          c.params.q_norm_weight = TensorView::contiguous(base, wt, {D});
          c.params.k_norm_weight = TensorView::contiguous(static_cast<char*>(base) + D * es, wt, {D});
          c.params.norm_eps = gemma ? 1e-6 : 1e-5;
          if (gemma) c.params.norm_style = "gemma";
          if (!k_rot) c.tensors.k_out = TensorView{};

          const Snapshot before = c.snapshot();
          ASSERT_NO_THROW(rope_pool_fused(c.tensors, c.params));  // the default: fused
          if (!extreme)
            for (const std::string& problem : check_call(c, before)) ADD_FAILURE() << problem;
          const Snapshot fused = c.snapshot();
          c.restore(before);
          {
            struct Restore {
              ~Restore() { detail::cpu::set_norm_rows(NormRows::kFused); }
            } restore;
            detail::cpu::set_norm_rows(NormRows::kScratch);
            ASSERT_NO_THROW(rope_pool_fused(c.tensors, c.params));
          }
          for (const std::string& change : changes_since(c, fused))
            ADD_FAILURE() << "through the scratch row, unlike fused: " << change;
        }
}

}  // namespace
}  // namespace ropepool::test

#endif  // ROPEPOOL_TEST_TARGETS_SHARED

// ---- per target: the entry points Highway dispatches to ------------------------------------
HWY_BEFORE_NAMESPACE();
namespace ropepool::test::HWY_NAMESPACE {

void KernelMatchesReference(int threads) { kernel_matches_reference(hwy::TargetName(HWY_TARGET), threads); }
void DemoteIsExhaustive(int shard) { demote_is_exhaustive(hwy::TargetName(HWY_TARGET), shard); }
void E4M3OnEveryBoundary() { e4m3_on_every_boundary(hwy::TargetName(HWY_TARGET)); }
void CachesMatchReference() { caches_match_reference(hwy::TargetName(HWY_TARGET)); }
void Fp8RowsAreTheRotation() { fp8_rows_are_the_rotation(hwy::TargetName(HWY_TARGET)); }
void MlaFp8KIsTheRotation() { mla_fp8_k_is_the_rotation(hwy::TargetName(HWY_TARGET)); }
void NormRowsAgree() { norm_rows_agree(hwy::TargetName(HWY_TARGET)); }

}  // namespace ropepool::test::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "hwy/tests/hwy_gtest.h"

namespace ropepool::test {

HWY_BEFORE_TEST(CpuTarget);
HWY_EXPORT_AND_TEST_P(CpuTarget, E4M3OnEveryBoundary);
HWY_EXPORT_AND_TEST_P(CpuTarget, CachesMatchReference);
HWY_EXPORT_AND_TEST_P(CpuTarget, Fp8RowsAreTheRotation);
HWY_EXPORT_AND_TEST_P(CpuTarget, MlaFp8KIsTheRotation);
HWY_EXPORT_AND_TEST_P(CpuTarget, NormRowsAgree);

class CpuTargetShard : public hwy::TestWithParamTargetAndT<int> {};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P_T(CpuTargetShard, ::testing::Range(0, kDemoteShards));
HWY_EXPORT_AND_TEST_P_T(CpuTargetShard, DemoteIsExhaustive);

// kernel_matches_reference with 1, 2 and 3 threads: one ctest entry each.
class CpuTargetThreads : public hwy::TestWithParamTargetAndT<int> {};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P_T(CpuTargetThreads, ::testing::Values(1, 2, 3));
HWY_EXPORT_AND_TEST_P_T(CpuTargetThreads, KernelMatchesReference);

// Several application threads calling at once (one gets the pool, the others run alone), and
// a forked child (the parent's workers do not exist there) must all get correct results.
TEST(CpuThreads, ConcurrentCallersAndFork) {
  const int saved_threads = cpu_num_threads();
  set_cpu_num_threads(2);
  detail::cpu::set_stream_min_bytes(-1);
  detail::cpu::set_parallel_min_bytes(1);
  const KernelCase kc{DType::BFloat16, 600, 8, 2, 128, 128, {false, false, false, true, false, 1.0, 1 << 16}};
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<std::thread> callers;
  std::atomic<int> failed{0};
  for (int i = 0; i < 3; ++i)
    callers.emplace_back([&, i] {
      Rng rng(seed + uint64_t(i));
      for (int rep = 0; rep < 3; ++rep) {
        check_kernel_case(kc, rng, "concurrent caller " + std::to_string(i));
        if (::testing::Test::HasFailure()) failed = 1;
      }
    });
  for (auto& t : callers) t.join();
  const pid_t pid = fork();
  if (pid == 0) {
    Rng rng(seed + 7);
    check_kernel_case(kc, rng, "forked child");
    std::_Exit(::testing::Test::HasFailure() ? 1 : 0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the forked child failed or hung";
  Rng rng(seed + 8);
  check_kernel_case(kc, rng, "parent after fork");
  set_cpu_num_threads(saved_threads);
  detail::cpu::set_stream_min_bytes(16 << 20);
  detail::cpu::set_parallel_min_bytes(1 << 20);
}

}  // namespace ropepool::test
#endif  // HWY_ONCE
