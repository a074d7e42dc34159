// Developer harness for the CPU backend (not part of the library or the test suite):
//   check  - every kernel variant x Highway target x thread count against a float64
//            evaluation (SPEC §1 bound) and against the first scalar backend, on random
//            shapes, strides, partial rotary, duplicate / negative slots and NaN/Inf inputs;
//            exhaustive float32 -> f16/bf16 rounding of every Highway target.
//   bench  - the reference workload (Hq=32, Hk=8, D=128, bf16, pool 4T slots, random distinct
//            slots, ~5% -1) per variant and thread count, next to memcpy bandwidth.
// Build (after building the library in build-cpu):
//   g++ -O2 -std=c++20 -Iinclude -Isrc src/cpu/cpu_kernel_check.cpp build-cpu/libropepool.a
//       -lhwy -lpthread -o build-cpu/cpu_kernel_check
//   build-cpu/cpu_kernel_check check | quick (no exhaustive rounding) | threads (multithreaded
//       cases only, for -fsanitize=thread) | bench [f32|f16|bf16] [T ...]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include "cpu/cpu_kernels.hpp"
#include "hwy/highway.h"
#include "hwy/targets.h"
#include "ropepool/half.hpp"
#include "ropepool/reference.hpp"
#include "ropepool/ropepool.hpp"

using namespace ropepool;
using detail::RopePoolProblem;
using detail::Rows;

namespace {

thread_local std::mt19937_64 rng(12345);

// Page-aligned storage, as tensors from PyTorch & co. are (>= 64 bytes): the kernel's
// non-temporal stores need vector-aligned rows.
template <class T>
struct PageAligned {
  using value_type = T;
  PageAligned() = default;
  template <class U>
  PageAligned(const PageAligned<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(std::aligned_alloc(4096, (n * sizeof(T) + 4095) / 4096 * 4096));
  }
  void deallocate(T* p, size_t) { std::free(p); }
  bool operator==(const PageAligned&) const { return true; }
};
using Vec16 = std::vector<uint16_t, PageAligned<uint16_t>>;
using Bytes = std::vector<uint8_t, PageAligned<uint8_t>>;

// ---- the first scalar backend, verbatim in behaviour, for "equal up to rounding" ----------
namespace scalar {
struct F32 {
  using T = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};
struct F16 {
  using T = uint16_t;
  static float load(uint16_t x) { return half_to_float(x); }
  static uint16_t store(float x) { return float_to_half(x); }
};
struct BF16 {
  using T = uint16_t;
  static float load(uint16_t x) { return bf16_to_float(x); }
  static uint16_t store(float x) { return float_to_bf16(x); }
};
template <class E>
void run(const RopePoolProblem& p) {
  using T = typename E::T;
  const int64_t half = p.rotary_dim / 2, D = p.head_dim;
  std::vector<float> c(half), s(half);
  auto at = [](const Rows& r, int64_t row, int64_t h) {
    return static_cast<T*>(r.data) + row * r.row_stride + h * r.head_stride;
  };
  auto rot = [&](const T* x, T* out, T* out2) {
    for (int64_t i = 0; i < half; ++i) {
      const int64_t ia = p.interleaved ? 2 * i : i, ib = p.interleaved ? 2 * i + 1 : i + half;
      const float a = E::load(x[ia]), b = E::load(x[ib]);
      const auto lo = E::store(a * c[i] - b * s[i]);
      const auto hi = E::store(a * s[i] + b * c[i]);
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
      c[i] = float(p.attention_scaling) * std::cos(r);
      s[i] = float(p.attention_scaling) * std::sin(r);
    }
    const int64_t slot = p.slots[t];
    for (int64_t h = 0; h < p.num_qo_heads; ++h) rot(at(p.q, t, h), at(p.q_out, t, h), nullptr);
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      rot(at(p.k, t, h), at(p.k_out, t, h), slot >= 0 ? at(p.k_pool, slot, h) : nullptr);
      if (slot >= 0) std::memcpy(at(p.v_pool, slot, h), at(p.v, t, h), D * sizeof(T));
    }
  }
}
void run_any(const RopePoolProblem& p) {
  if (p.dtype == DType::Float32) run<F32>(p);
  if (p.dtype == DType::Float16) run<F16>(p);
  if (p.dtype == DType::BFloat16) run<BF16>(p);
}
}  // namespace scalar

// ---- element access in raw buffers ----------------------------------------------------------
double get(DType dt, const void* base, int64_t off) {
  if (dt == DType::Float32) return static_cast<const float*>(base)[off];
  const uint16_t h = static_cast<const uint16_t*>(base)[off];
  return dt == DType::Float16 ? half_to_float(h) : bf16_to_float(h);
}
void put(DType dt, void* base, int64_t off, float v) {
  if (dt == DType::Float32) static_cast<float*>(base)[off] = v;
  else if (dt == DType::Float16) static_cast<uint16_t*>(base)[off] = float_to_half(v);
  else static_cast<uint16_t*>(base)[off] = float_to_bf16(v);
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
std::atomic<double> worst_vs_scalar{0};

struct Case {
  DType dtype;
  int64_t T, Hq, Hk, D, R, P;
  bool strided, duplicates, specials, check_slots, interleaved;
  double scaling;
  int64_t max_pos;
};

struct Buffers {
  Bytes qkv, out, kpool, vpool;
  std::vector<int64_t> positions, slots;
};

std::atomic<int> failures{0};
void fail(const std::string& what) {
  if (++failures <= (std::getenv("ALLFAIL") ? 100000000 : 20)) std::printf("FAIL %s\n", what.c_str());
}

// One case: builds inputs, runs the backend, checks every element.
void check_case(const Case& c, const std::string& label) {
  const int64_t es = int64_t(dtype_size(c.dtype));
  const int64_t pad = c.strided ? 8 : 0;  // elements between heads / rows
  const int64_t qkv_row = (c.Hq + 2 * c.Hk) * (c.D + pad) + pad;
  Buffers b;
  b.qkv.resize(size_t(c.T * qkv_row * es));
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> pick(0, 999);
  for (int64_t i = 0; i < c.T * qkv_row; ++i) {
    float v = normal(rng) * 3;
    if (c.specials && pick(rng) < 3) v = pick(rng) % 3 == 0 ? NAN : (pick(rng) % 2 ? INFINITY : -INFINITY);
    put(c.dtype, b.qkv.data(), i, v);
  }
  const int64_t out_row = (c.Hq + c.Hk) * (c.D + pad);
  b.out.resize(size_t(c.T * out_row * es));
  for (auto& x : b.out) x = uint8_t(rng());  // poison
  const int64_t pool_head = c.D + pad, pool_row = c.Hk * pool_head + pad;
  b.kpool.resize(size_t(c.P * pool_row * es));
  b.vpool.resize(size_t(c.P * pool_row * es));
  for (auto& x : b.kpool) x = uint8_t(rng());
  for (auto& x : b.vpool) x = uint8_t(rng());
  const Bytes kpool0 = b.kpool, vpool0 = b.vpool;
  b.positions.resize(c.T);
  b.slots.resize(c.T);
  std::uniform_int_distribution<int64_t> pos_d(-c.max_pos / 8, c.max_pos);
  for (auto& p : b.positions) p = pos_d(rng);
  {
    std::vector<int64_t> perm(c.P);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t t = 0; t < c.T; ++t) {
      b.slots[t] = perm[t % c.P];
      if (c.duplicates && t > 0 && pick(rng) < 300) b.slots[t] = b.slots[pick(rng) % t];
      if (pick(rng) < 50) b.slots[t] = -1 - pick(rng) % 3;
    }
  }
  RopePoolParams params;
  params.head_dim = c.D;
  params.num_qo_heads = c.Hq;
  params.num_kv_heads = c.Hk;
  params.rotary_dim = c.R;
  RopeSchedule sched = make_rope_schedule(params);  // inv_freq for rotary_dim R
  if (sched.rotary_dim != c.R) fail(label + " schedule rotary_dim");

  RopePoolProblem p;
  p.dtype = c.dtype;
  p.num_tokens = c.T;
  p.num_qo_heads = c.Hq;
  p.num_kv_heads = c.Hk;
  p.head_dim = c.D;
  p.rotary_dim = c.R;
  p.interleaved = c.interleaved;
  p.pool_size = c.P;
  auto* qkv = b.qkv.data();
  p.q = {qkv + pad * es, qkv_row, c.D + pad};
  p.k = {qkv + (pad + c.Hq * (c.D + pad)) * es, qkv_row, c.D + pad};
  p.v = {qkv + (pad + (c.Hq + c.Hk) * (c.D + pad)) * es, qkv_row, c.D + pad};
  p.q_out = {b.out.data(), out_row, c.D + pad};
  p.k_out = {b.out.data() + c.Hq * (c.D + pad) * es, out_row, c.D + pad};
  p.k_pool = {b.kpool.data(), pool_row, pool_head};
  p.v_pool = {b.vpool.data(), pool_row, pool_head};
  p.positions = {b.positions.data(), 1, true};
  p.slots = {b.slots.data(), 1, true};
  p.inv_freq = sched.inv_freq.data();
  p.attention_scaling = c.scaling;
  p.check_slots = c.check_slots;

  detail::rope_pool_cpu(p);

  // Scalar backend on copies of the outputs.
  Buffers s = b;
  s.kpool = kpool0;
  s.vpool = vpool0;
  RopePoolProblem ps = p;
  ps.q_out.data = s.out.data();
  ps.k_out.data = s.out.data() + c.Hq * (c.D + pad) * es;
  ps.k_pool.data = s.kpool.data();
  ps.v_pool.data = s.vpool.data();
  scalar::run_any(ps);

  const int64_t half = c.R / 2;
  double worst_units = 0;
  auto check_rows = [&](const Rows& in, const Rows& out, const Rows& out_scalar, int64_t H,
                        const char* name) {
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t ib = t * in.row_stride + h * in.head_stride;
        const int64_t ob = t * out.row_stride + h * out.head_stride;
        for (int64_t d = 0; d < c.D; ++d) {
          const double got = get(c.dtype, out.data, ob + d);
          const double old = get(c.dtype, out_scalar.data, ob + d);
          double exact, ab = 0;
          if (d < c.R) {
            const int64_t i = c.interleaved ? d / 2 : d % half;
            const int64_t ia = c.interleaved ? 2 * i : i, ibb = c.interleaved ? 2 * i + 1 : i + half;
            const double theta = double(b.positions[t]) * sched.inv_freq[i];
            const double co = std::cos(theta) * c.scaling, si = std::sin(theta) * c.scaling;
            const double a = get(c.dtype, in.data, ib + ia), bb = get(c.dtype, in.data, ib + ibb);
            exact = d == ia ? a * co - bb * si : a * si + bb * co;
            ab = std::fabs(a) + std::fabs(bb);
          } else {
            exact = get(c.dtype, in.data, ib + d);
          }
          bool ok;
          if (std::isnan(exact)) ok = std::isnan(got);
          else if (std::isinf(exact)) ok = got == exact;
          else if (d >= c.R) ok = got == exact;
          else ok = std::fabs(got - exact) <= reference::tolerance(c.dtype, exact, ab);
          if (!ok) {
            char msg[256];
            std::snprintf(msg, sizeof msg, "%s %s t=%ld h=%ld d=%ld got %.9g exact %.9g", label.c_str(),
                          name, long(t), long(h), long(d), got, exact);
            fail(msg);
          }
          if (!std::isnan(exact) && !std::isinf(exact))
            worst_units = std::max(worst_units, rounding_units_apart(c.dtype, got, old, ab));
        }
      }
    }
  };
  check_rows(p.q, p.q_out, ps.q_out, c.Hq, "q");
  check_rows(p.k, p.k_out, ps.k_out, c.Hk, "k");
  for (double w = worst_vs_scalar.load(); w < worst_units && !worst_vs_scalar.compare_exchange_weak(w, worst_units);) {
  }
  if (worst_units > 8)
    fail(label + " differs from the scalar backend by " + std::to_string(worst_units) +
         " units (1 ulp + 2^-24 (|a|+|b|))");

  // Pools: the last token with each slot wins; the rest bit-identical to before.
  std::vector<int64_t> last(c.P, -1);
  for (int64_t t = 0; t < c.T; ++t)
    if (b.slots[t] >= 0) last[b.slots[t]] = t;
  for (int64_t slot = 0; slot < c.P; ++slot) {
    const size_t row_bytes = size_t(pool_row * es);
    const uint8_t* kr = b.kpool.data() + slot * row_bytes;
    const uint8_t* vr = b.vpool.data() + slot * row_bytes;
    if (last[slot] < 0) {
      if (std::memcmp(kr, kpool0.data() + slot * row_bytes, row_bytes) ||
          std::memcmp(vr, vpool0.data() + slot * row_bytes, row_bytes))
        fail(label + " untouched pool row " + std::to_string(slot) + " changed");
      continue;
    }
    const int64_t t = last[slot];
    for (int64_t h = 0; h < c.Hk; ++h) {
      const uint8_t* kh = kr + h * pool_head * es;
      const uint8_t* vh = vr + h * pool_head * es;
      const uint8_t* ko = static_cast<const uint8_t*>(p.k_out.data) + (t * out_row + h * (c.D + pad)) * es;
      const uint8_t* vi = static_cast<const uint8_t*>(p.v.data) + (t * qkv_row + h * (c.D + pad)) * es;
      if (std::memcmp(kh, ko, size_t(c.D * es)) || std::memcmp(vh, vi, size_t(c.D * es)))
        fail(label + " pool row " + std::to_string(slot) + " head " + std::to_string(h) +
             " is not token " + std::to_string(t) + "'s row");
      // padding between heads untouched
      if (pad && std::memcmp(kh + c.D * es, kpool0.data() + slot * row_bytes + (h * pool_head + c.D) * es, size_t(pad * es)))
        fail(label + " pool padding written");
    }
  }
  // Output padding (between heads) untouched? It was poisoned; only check q_out is not NaN
  // garbage where it should not be written: skipped (outputs are ours to fill).
}

// Several application threads calling at once (one gets the pool, the others run alone), and
// a forked child (the parent's workers do not exist there) must all get correct results.
void check_concurrency_and_fork() {
  set_cpu_num_threads(2);
  detail::cpu::set_kernel_variant(detail::cpu::KernelVariant::highway);
  detail::cpu::set_stream_min_bytes(-1);
  detail::cpu::set_parallel_min_bytes(1);
  const Case c{DType::BFloat16, 600, 8, 2, 128, 128, 1500, false, false, false, true, false, 1.0, 1 << 16};
  std::vector<std::thread> callers;
  for (int i = 0; i < 3; ++i)
    callers.emplace_back([&c, i] {
      for (int rep = 0; rep < 3; ++rep) check_case(c, "[concurrent caller " + std::to_string(i) + "]");
    });
  for (auto& t : callers) t.join();
  const int before = failures;
  const pid_t pid = fork();
  if (pid == 0) {
    check_case(c, "[forked child]");
    std::_Exit(failures == before ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) fail("[forked child] failed or hung");
  check_case(c, "[parent after fork]");
  std::printf("concurrent callers and fork: %s\n", failures == before ? "ok" : "FAIL");
}

int check(bool exhaustive, bool threads_only = false) {
  const DType dtypes[] = {DType::Float32, DType::Float16, DType::BFloat16};
  struct Shape {
    int64_t T, Hq, Hk, D, R;
  };
  const Shape shapes[] = {{1, 1, 1, 2, 2},      {3, 4, 2, 8, 8},     {17, 2, 1, 80, 80},
                          {5, 3, 1, 128, 64},   {33, 8, 2, 64, 64},  {300, 8, 2, 128, 128},
                          {700, 4, 4, 96, 32},  {40, 32, 8, 128, 128}, {2, 16, 4, 256, 256},
                          {1200, 2, 2, 18, 12}, {9, 5, 3, 34, 34}};
  std::vector<int64_t> targets;
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) targets.push_back(t);
  int cases = 0;
  for (int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    for (auto variant : {detail::cpu::KernelVariant::highway, detail::cpu::KernelVariant::autovec}) {
      if (variant == detail::cpu::KernelVariant::autovec && target != targets.front()) continue;
      detail::cpu::set_kernel_variant(variant);
      for (int threads : {1, 2, 3}) {
        if (threads_only && (threads == 1 || target != targets.front())) continue;
        set_cpu_num_threads(threads);
        // Non-temporal stores on every call with 2 threads (aligned rows take them), never
        // with 1 or 3: both store paths are checked on every target.
        detail::cpu::set_stream_min_bytes(threads == 2 ? 0 : -1);
        // With 2 or 3 threads every call is split (tokens, or heads when tokens are few).
        detail::cpu::set_parallel_min_bytes(threads == 1 ? 1 << 20 : 1);
        for (DType dt : dtypes)
          for (const Shape& s : shapes)
            for (int flavour = 0; flavour < 6; ++flavour) {
              // strided, duplicates, specials, check_slots, interleaved, scaling, max_pos
              struct Flavour {
                bool st, dup, sp, chk, il;
                double scaling;
                int64_t max_pos;
              };
              const Flavour f[6] = {{false, false, false, true, false, 1.0, 1 << 16},
                                    {true, false, false, false, false, 1.0, (1 << 20) - 1},
                                    {false, true, false, false, false, 1.25, 1 << 16},
                                    {true, true, true, false, false, 1.0, 1 << 16},
                                    {false, false, false, false, true, 1.0, 1 << 16},
                                    {true, true, false, false, true, 0.75, (1 << 20) - 1}};
              const Flavour& fl = f[flavour];
              Case c{dt, s.T, s.Hq, s.Hk, s.D, s.R, 0, fl.st, fl.dup, fl.sp, fl.chk, fl.il,
                     fl.scaling, fl.max_pos};
              c.P = c.duplicates ? std::max<int64_t>(4, s.T / 2) : s.T * 2 + 3;
              char label[200];
              std::snprintf(label, sizeof label, "[%s %s thr=%d %s T=%ld Hq=%ld Hk=%ld D=%ld R=%ld fl=%d]",
                            hwy::TargetName(target),
                            variant == detail::cpu::KernelVariant::highway ? "hwy" : "autovec",
                            threads, dtype_name(dt), long(s.T), long(s.Hq), long(s.Hk), long(s.D),
                            long(s.R), flavour);
              check_case(c, label);
              ++cases;
            }
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
  check_concurrency_and_fork();
  std::printf("largest difference from the scalar backend: %.2f units of (1 ulp + 2^-24 (|a|+|b|))\n",
              worst_vs_scalar.load());
  if (!exhaustive) {
    std::printf("%d cases, %d failures\n", cases, failures.load());
    return failures ? 1 : 0;
  }

  // Exhaustive rounding of every float32 bit pattern, every target.
  std::vector<float> in(1 << 20);
  std::vector<uint16_t> out(1 << 20);
  for (int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    int64_t bad = 0;
    for (uint64_t base = 0; base < (1ull << 32); base += in.size()) {
      for (size_t i = 0; i < in.size(); ++i) in[i] = bits_float(uint32_t(base + i));
      for (DType dt : {DType::Float16, DType::BFloat16}) {
        detail::cpu::demote_row_hwy(dt, in.data(), out.data(), int64_t(in.size()));
        for (size_t i = 0; i < in.size(); ++i) {
          const uint16_t want = dt == DType::Float16 ? float_to_half(in[i]) : float_to_bf16(in[i]);
          // The kernel's bf16 rounding assumes what every NaN it can produce has: a zero low
          // half (see RoundToBF16High); other NaN patterns never reach it.
          if (dt == DType::BFloat16 && std::isnan(in[i]) && (float_bits(in[i]) & 0xffffu)) continue;
          if (out[i] != want) {
            // NaN payloads may differ; NaN must stay NaN.
            const bool nan_ok = std::isnan(in[i]) && std::isnan(get(dt, &out[i], 0));
            if (!nan_ok && ++bad <= 5)
              std::printf("FAIL demote %s %s: %08x -> %04x want %04x\n", hwy::TargetName(target),
                          dtype_name(dt), uint32_t(base + i), out[i], want);
          }
        }
      }
    }
    // Every 16-bit pattern widened.
    std::vector<uint16_t> all16(1 << 16);
    std::iota(all16.begin(), all16.end(), 0);
    std::vector<float> wide(1 << 16);
    for (DType dt : {DType::Float16, DType::BFloat16}) {
      detail::cpu::promote_row_hwy(dt, all16.data(), wide.data(), 1 << 16);
      for (int i = 0; i < (1 << 16); ++i) {
        const float want = dt == DType::Float16 ? half_to_float(uint16_t(i)) : bf16_to_float(uint16_t(i));
        // F16C quiets signalling NaNs on the way (sets the quiet bit): still the same NaN.
        const bool same_nan = std::isnan(wide[i]) && std::isnan(want) &&
                              (float_bits(wide[i]) >> 31) == (float_bits(want) >> 31);
        if (float_bits(wide[i]) != float_bits(want) && !same_nan && ++bad <= 5)
          std::printf("FAIL promote %s %s: %04x -> %08x want %08x\n", hwy::TargetName(target),
                      dtype_name(dt), i, float_bits(wide[i]), float_bits(want));
      }
    }
    if (bad) ++failures;
    std::printf("exhaustive f16/bf16 rounding on %s: %s\n", hwy::TargetName(target), bad ? "FAIL" : "ok");
  }
  hwy::SetSupportedTargetsForTest(0);
  std::printf("%d cases, %d failures\n", cases, failures.load());
  return failures ? 1 : 0;
}

// ---- bench ----------------------------------------------------------------------------------

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class F>
double median_seconds(F&& f, int reps) {
  std::vector<double> t;
  f();  // warm-up (page faults, pool start)
  for (int i = 0; i < reps; ++i) {
    const double t0 = now();
    f();
    t.push_back(now() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int bench(const std::vector<int64_t>& token_counts, DType dt) {
  const int64_t Hq = 32, Hk = 8, D = 128;
  const int64_t es = int64_t(dtype_size(dt));
  std::printf("Highway target: %s, %s, Hq=%ld Hk=%ld D=%ld, pool 4T slots (random, ~5%% -1)\n",
              detail::cpu::hwy_target_name(), dtype_name(dt), long(Hq), long(Hk), long(D));
  for (int64_t T : token_counts) {
    const int64_t P = 4 * T;
    // Raw element storage: es bytes per element.
    Bytes q(T * Hq * D * es), k(T * Hk * D * es), v(T * Hk * D * es), qo(q.size()), ko(k.size());
    Bytes kp(P * Hk * D * es), vp(P * Hk * D * es);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (auto* buf : {&q, &k, &v})
      for (size_t i = 0; i < buf->size() / es; ++i) put(dt, buf->data(), int64_t(i), normal(rng));
    for (auto* buf : {&qo, &ko, &kp, &vp}) std::fill(buf->begin(), buf->end(), uint8_t(0x3f));
    std::vector<int32_t> positions(T), slots(T);
    std::vector<int32_t> perm(P);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::uniform_int_distribution<int> pick(0, 99);
    for (int64_t t = 0; t < T; ++t) {
      positions[t] = int32_t(t);
      slots[t] = pick(rng) < 5 ? -1 : perm[t];
    }
    auto view = [&](void* data, int64_t rows, int64_t heads) {
      return TensorView::contiguous(data, dt, {rows, heads, D});
    };
    RopePoolTensors tensors{view(q.data(), T, Hq), view(k.data(), T, Hk), view(v.data(), T, Hk),
                            TensorView::contiguous(positions.data(), DType::Int32, {T}),
                            TensorView::contiguous(slots.data(), DType::Int32, {T}),
                            view(kp.data(), P, Hk), view(vp.data(), P, Hk),
                            view(qo.data(), T, Hq), view(ko.data(), T, Hk)};
    RopePoolParams params;
    params.head_dim = D;
    params.num_qo_heads = Hq;
    params.num_kv_heads = Hk;
    const double bytes = double(T * D * es * (2 * Hq + 5 * Hk) + 2 * T * 4);
    // memcpy of the same traffic (read + write = bytes): half of it copied
    std::vector<uint8_t> src(size_t(bytes / 2)), dst(size_t(bytes / 2));
    std::memset(src.data(), 1, src.size());
    std::memset(dst.data(), 2, dst.size());
    std::printf("T=%ld  traffic %.1f MB (read + write)\n", long(T), bytes / 1e6);
    struct Config {
      detail::cpu::KernelVariant variant;
      bool stream;
      int threads;
    };
    std::vector<Config> configs;
    for (auto variant : {detail::cpu::KernelVariant::highway, detail::cpu::KernelVariant::autovec})
      for (bool stream : {false, true})
        for (int threads : {1, 2}) {
          if (stream && variant == detail::cpu::KernelVariant::autovec) continue;
          configs.push_back({variant, stream, threads});
        }
    // Rounds over all configurations, so load from other processes hits them alike; the
    // best round of each is reported next to its median.
    const int rounds = T >= 32768 ? 5 : 15;
    std::vector<std::vector<double>> times(configs.size());
    std::vector<double> copy_times;
    for (int r = 0; r < rounds; ++r) {
      for (size_t i = 0; i < configs.size(); ++i) {
        detail::cpu::set_kernel_variant(configs[i].variant);
        detail::cpu::set_stream_min_bytes(configs[i].stream ? 0 : -1);
        set_cpu_num_threads(configs[i].threads);
        rope_pool_fused(tensors, params);  // warm-up of this configuration
        const double t0 = now();
        rope_pool_fused(tensors, params);
        times[i].push_back(now() - t0);
      }
      const double t0 = now();
      std::memcpy(dst.data(), src.data(), src.size());
      copy_times.push_back(now() - t0);
    }
    auto stats = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return std::pair{v.front(), v[v.size() / 2]};
    };
    const auto [copy_best, copy_median] = stats(copy_times);
    std::printf("  memcpy: best %.2f GB/s, median %.2f GB/s\n", bytes / copy_best / 1e9,
                bytes / copy_median / 1e9);
    for (size_t i = 0; i < configs.size(); ++i) {
      const auto [best, median] = stats(times[i]);
      std::printf("  %-8s %-9s threads=%d  best %7.2f ms %6.2f GB/s %5.1f%%  median %7.2f ms %6.2f GB/s %5.1f%% (of memcpy's)\n",
                  configs[i].variant == detail::cpu::KernelVariant::highway ? "highway" : "autovec",
                  configs[i].stream ? "nt-stores" : "stores", configs[i].threads, best * 1e3,
                  bytes / best / 1e9, 100 * copy_best / best, median * 1e3, bytes / median / 1e9,
                  100 * copy_median / median);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  if (mode == "check") return check(true);
  if (mode == "quick") return check(false);
  if (mode == "threads") return check(false, true);  // for ThreadSanitizer builds
  std::vector<int64_t> ts;
  DType dt = DType::BFloat16;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "f32") dt = DType::Float32;
    else if (a == "f16") dt = DType::Float16;
    else if (a == "bf16") dt = DType::BFloat16;
    else ts.push_back(std::atoll(argv[i]));
  }
  if (ts.empty()) ts = {4096, 32768};
  return bench(ts, dt);
}
