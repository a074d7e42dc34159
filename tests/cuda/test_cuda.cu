// The CUDA backend on a GPU, against the float64 reference through the test kit: every
// kernel path (tuned head sizes, generic 16-byte, scalar; NeoX and GPT-J; partial rotary;
// strided fused-QKV views; misaligned views) and launch shape, every pool row checked bit
// for bit, untouched rows unchanged, SPEC §3 (out-of-range slots with and without
// check_slots, duplicates), a pool over 4 GiB, CUDA-graph capture and replay; SPEC §6: paged
// NHD/HND pools of page sizes 1 to 256, layers of stacked caches and the K/V halves of vLLM's
// and FlashInfer's combined caches (every byte of the allocation outside the rows written
// unchanged, guards included), fp8 e4m3 pools and q_out with scale values and pointers
// (a CUDA graph sees a changed scale), and the e4m3 conversion on every float32; SPEC §7's
// QK norm (the fusion kernel) with every one of these caches, mRoPE included, and the norm
// kernel's packed "rms" multiply against its float32 path on every pair of 16-bit patterns.
// Registered with ctest under the label `gpu` (scripts/gpu_check.sh runs `ctest -L gpu`).
//
//   ropepool_test_cuda [--quick] [--sanitize]
//
// --sanitize: a smaller grid, no stress repeats, for compute-sanitizer.
// Prints "tests: N checks, M failures"; exit status 0 only when every check passed.
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ropepool/cuda.hpp"
#include "ropepool/error.hpp"
#include "ropepool/half.hpp"
#include "ropepool/reference.hpp"
#include "ropepool/rope_pool.hpp"
#include "ropepool/schedule.hpp"
#include "ropepool_kit.hpp"
#include "ropepool_kit_cuda.hpp"
#include "cuda/vec.cuh"
#include "test_hooks.hpp"

using namespace ropepool;
using namespace ropepool::test;

namespace {

int g_failures = 0;
int g_checks = 0;

void expect(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    std::printf("FAIL: %s\n", what.c_str());
  }
}

/// What an every-pattern check kernel found, once it has run: how many elements differed (its
/// 8-byte counter) and the first mismatches it recorded (`words` 32-bit words, at most 8).
struct Mismatches {
  unsigned long long n = 0;
  unsigned first[8] = {};
};
Mismatches read_mismatches(const DeviceBuffer& count, const DeviceBuffer& first, size_t words) {
  ROPEPOOL_CUDA_OK(cudaGetLastError());
  ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
  Mismatches m;
  ROPEPOOL_CUDA_OK(cudaMemcpy(&m.n, count.ptr, 8, cudaMemcpyDeviceToHost));
  ROPEPOOL_CUDA_OK(cudaMemcpy(m.first, first.ptr, std::min(words, std::size(m.first)) * 4, cudaMemcpyDeviceToHost));
  return m;
}

uint32_t to_bits(float f, DType dt) {
  switch (dt) {
    case DType::Float32: return float_bits(f);
    case DType::Float16: return float_to_half(f);
    default: return float_to_bf16(f);
  }
}

// ---- one test case ----------------------------------------------------------------------

/// PaddedHeads: the fused layout with 16 bytes after each head (a head stride of D + 16 bytes):
/// a token's heads are not contiguous in its row.
enum class Layout { Contiguous, FusedQkv, Misaligned, PaddedHeads };

struct Case {
  DType dtype = DType::BFloat16;
  int64_t T = 37, Hq = 4, Hk = 2, D = 128, R = 0;
  bool interleaved = false;
  Layout layout = Layout::Contiguous;
  bool index64 = false;
  int64_t pool = 0;  // 0: 2T + 5
  double rope_base = 10000;
  int64_t max_position = int64_t(1) << 20;
  std::string name() const {
    char b[200];
    std::snprintf(b, sizeof b, "%s T=%lld Hq=%lld Hk=%lld D=%lld R=%lld%s%s%s",
                  dtype_name(dtype), (long long)T, (long long)Hq, (long long)Hk, (long long)D,
                  (long long)(R ? R : D), interleaved ? " interleaved" : "",
                  layout == Layout::FusedQkv     ? " fused-qkv"
                  : layout == Layout::Misaligned  ? " misaligned"
                  : layout == Layout::PaddedHeads ? " padded-heads"
                                                  : "",
                  index64 ? " int64" : "");
    return b;
  }
};

/// Host + device copies of one call's tensors, with views of both.
struct Problem {
  Case c;
  size_t es;
  int64_t P;
  std::vector<uint8_t> h_qkv, h_pool_k, h_pool_v, h_pos, h_slots;
  std::unique_ptr<DeviceBuffer> d_qkv, d_q_out, d_k_out, d_pool_k, d_pool_v, d_pos, d_slots;
  RopePoolTensors host, dev;  // host views: q/k/v/positions/slots only
  RopePoolParams params;

  explicit Problem(const Case& cs, Rng& rng, const std::vector<int64_t>* slots_in = nullptr)
      : c(cs), es(dtype_size(cs.dtype)) {
    const int64_t T = c.T, Hq = c.Hq, Hk = c.Hk, D = c.D;
    P = c.pool ? c.pool : 2 * T + 5;
    params.head_dim = D;
    params.num_qo_heads = Hq;
    params.num_kv_heads = Hk;
    params.rope_base = c.rope_base;
    params.rotary_dim = c.R;
    params.interleaved = c.interleaved;

    // q, k, v: one buffer. Fused: rows of [Hq + 2 Hk, D] (padded heads: a head every hs
    // elements); else three blocks. Misaligned: everything one element off a 16-byte boundary.
    const int64_t off = c.layout == Layout::Misaligned ? 1 : 0;
    const int64_t hs = c.layout == Layout::PaddedHeads ? D + int64_t(16 / es) : D;  // head stride
    const int64_t row = (Hq + 2 * Hk) * hs;
    const int64_t n = T * row + 3 * off + 8;
    h_qkv.resize(size_t(n) * es);
    std::uniform_real_distribution<float> u(-2.f, 2.f);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t b = to_bits(u(rng), c.dtype);
      std::memcpy(&h_qkv[size_t(i) * es], &b, es);
    }
    auto view = [&](void* base, int64_t elem_off, int64_t H, int64_t rs, Device d) {
      TensorView t = TensorView::contiguous(static_cast<char*>(base) + elem_off * int64_t(es), c.dtype, {T, H, D}, d);
      t.strides[0] = rs;
      t.strides[1] = hs;
      return t;
    };
    d_qkv = std::make_unique<DeviceBuffer>(h_qkv.size());
    ROPEPOOL_CUDA_OK(cudaMemcpy(d_qkv->ptr, h_qkv.data(), h_qkv.size(), cudaMemcpyHostToDevice));
    const Device cpu{}, gpu{DeviceType::CUDA, 0};
    for (auto [side, base, dev] : {std::tuple{&host, (void*)h_qkv.data(), cpu}, {&dev, d_qkv->ptr, gpu}}) {
      if (c.layout == Layout::FusedQkv || c.layout == Layout::PaddedHeads) {
        side->q = view(base, 0, Hq, row, dev);
        side->k = view(base, Hq * hs, Hk, row, dev);
        side->v = view(base, (Hq + Hk) * hs, Hk, row, dev);
      } else {
        side->q = view(base, off, Hq, Hq * D, dev);
        side->k = view(base, off + T * Hq * D, Hk, Hk * D, dev);
        side->v = view(base, off + T * (Hq + Hk) * D, Hk, Hk * D, dev);
      }
    }

    // Positions: random below max_position, a few right at the top of the range.
    const DType idt = c.index64 ? DType::Int64 : DType::Int32;
    const size_t is = dtype_size(idt);
    std::vector<int64_t> pos(T), slots(T);
    std::uniform_int_distribution<int64_t> upos(0, c.max_position - 1);
    for (int64_t t = 0; t < T; ++t) pos[t] = t % 7 == 0 ? c.max_position - 1 - t : upos(rng);
    if (slots_in) {
      slots = *slots_in;
    } else {
      // Distinct random rows, about one token in eight with no pool write.
      std::vector<int64_t> rows(P);
      for (int64_t i = 0; i < P; ++i) rows[i] = i;
      std::shuffle(rows.begin(), rows.end(), rng);
      for (int64_t t = 0; t < T; ++t) slots[t] = rng() % 8 == 0 ? -1 - int64_t(rng() % 3) : rows[t];
    }
    h_pos.resize(T * is);
    h_slots.resize(T * is);
    for (int64_t t = 0; t < T; ++t) {
      if (c.index64) {
        std::memcpy(&h_pos[t * is], &pos[t], 8);
        std::memcpy(&h_slots[t * is], &slots[t], 8);
      } else {
        const int32_t p32 = int32_t(pos[t]), s32 = int32_t(slots[t]);
        std::memcpy(&h_pos[t * is], &p32, 4);
        std::memcpy(&h_slots[t * is], &s32, 4);
      }
    }
    d_pos = std::make_unique<DeviceBuffer>(h_pos.size());
    d_slots = std::make_unique<DeviceBuffer>(h_slots.size());
    ROPEPOOL_CUDA_OK(cudaMemcpy(d_pos->ptr, h_pos.data(), h_pos.size(), cudaMemcpyHostToDevice));
    ROPEPOOL_CUDA_OK(cudaMemcpy(d_slots->ptr, h_slots.data(), h_slots.size(), cudaMemcpyHostToDevice));
    host.positions = TensorView::contiguous(h_pos.data(), idt, {T});
    host.slots = TensorView::contiguous(h_slots.data(), idt, {T});
    dev.positions = TensorView::contiguous(d_pos->ptr, idt, {T}, gpu);
    dev.slots = TensorView::contiguous(d_slots->ptr, idt, {T}, gpu);

    // Pools: random bits (poison) that must survive wherever no token writes.
    const size_t pool_bytes = size_t(P * Hk * D) * es + size_t(off) * es;
    h_pool_k.resize(pool_bytes);
    h_pool_v.resize(pool_bytes);
    for (auto* h : {&h_pool_k, &h_pool_v})
      for (size_t i = 0; i < h->size(); ++i) (*h)[i] = uint8_t(rng());
    d_pool_k = std::make_unique<DeviceBuffer>(pool_bytes);
    d_pool_v = std::make_unique<DeviceBuffer>(pool_bytes);
    ROPEPOOL_CUDA_OK(cudaMemcpy(d_pool_k->ptr, h_pool_k.data(), pool_bytes, cudaMemcpyHostToDevice));
    ROPEPOOL_CUDA_OK(cudaMemcpy(d_pool_v->ptr, h_pool_v.data(), pool_bytes, cudaMemcpyHostToDevice));
    dev.k_pool = TensorView::contiguous(d_pool_k->bytes_at(off * es), c.dtype, {P, Hk, D}, gpu);
    dev.v_pool = TensorView::contiguous(d_pool_v->bytes_at(off * es), c.dtype, {P, Hk, D}, gpu);

    // Outputs: all-ones bits (NaN in every dtype) so an unwritten element shows.
    const size_t qo = size_t(T * Hq * D + off) * es, ko = size_t(T * Hk * D + off) * es;
    d_q_out = std::make_unique<DeviceBuffer>(qo);
    d_k_out = std::make_unique<DeviceBuffer>(ko);
    ROPEPOOL_CUDA_OK(cudaMemset(d_q_out->ptr, 0xff, qo));
    ROPEPOOL_CUDA_OK(cudaMemset(d_k_out->ptr, 0xff, ko));
    dev.q_out = TensorView::contiguous(d_q_out->bytes_at(off * es), c.dtype, {T, Hq, D}, gpu);
    dev.k_out = TensorView::contiguous(d_k_out->bytes_at(off * es), c.dtype, {T, Hk, D}, gpu);
  }

  int64_t slot(int64_t t) const { return reference::load_index(host.slots, t); }

  std::vector<uint8_t> fetch(const DeviceBuffer& b) const {
    std::vector<uint8_t> h(b.bytes);
    ROPEPOOL_CUDA_OK(cudaMemcpy(h.data(), b.ptr, b.bytes, cudaMemcpyDeviceToHost));
    return h;
  }
};

/// Checks q_out/k_out against the float64 reference (SPEC §1 bound), and every pool row:
/// written rows bit-equal to k_out / v of their token, the others unchanged.
bool check_outputs(Problem& pr, const std::string& what, bool expect_written = true,
                   const TensorView* q_norm_host = nullptr, const TensorView* k_norm_host = nullptr) {
  const Case& c = pr.c;
  const int64_t T = c.T, Hq = c.Hq, Hk = c.Hk, D = c.D;
  const size_t es = pr.es;
  const int64_t off = c.layout == Layout::Misaligned ? 1 : 0;
  const RopeSchedule schedule = make_rope_schedule(pr.params);
  const auto q_out = pr.fetch(*pr.d_q_out), k_out = pr.fetch(*pr.d_k_out);
  const auto pool_k = pr.fetch(*pr.d_pool_k), pool_v = pr.fetch(*pr.d_pool_v);
  int bad = 0;
  std::string first;
  auto note = [&](const std::string& m) {
    if (bad++ == 0) first = m;
  };
  if (expect_written) {
    for (auto [x, out, H, name] : {std::tuple{&pr.host.q, &q_out, Hq, "q"}, {&pr.host.k, &k_out, Hk, "k"}}) {
      const TensorView got = TensorView::contiguous(const_cast<uint8_t*>(out->data()) + size_t(off) * es, c.dtype, {T, H, D});
      RotationCheck how;  // SPEC §7: normalised where the call normalises
      how.norm_weight = x == &pr.host.q ? q_norm_host : k_norm_host;
      how.norm_eps = pr.params.norm_eps.value_or(1e-6);
      how.norm_gemma = pr.params.norm_style.value_or("rms") == "gemma";
      const CheckStats s = check_rotation(name, *x, got, pr.host.positions, schedule, c.interleaved, how);
      for (const auto& f : s.first) note(f.second);
      bad += int(std::max<int64_t>(0, s.failures - int64_t(s.first.size())));
    }
  } else {
    // Nothing written: outputs still all-ones.
    for (auto* o : {&q_out, &k_out})
      for (uint8_t b : *o)
        if (b != 0xff) {
          note("an output element was written");
          break;
        }
  }
  // Pool rows: which token (if any) owns each row; duplicates: any of them, whole row.
  std::vector<std::vector<int64_t>> writers(pr.P);
  if (expect_written)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = pr.slot(t);
      if (s >= 0 && s < pr.P) writers[s].push_back(t);
    }
  auto view = [&](const std::vector<uint8_t>& bytes, int64_t rows) {
    return TensorView::contiguous(const_cast<uint8_t*>(bytes.data()) + size_t(off) * es, c.dtype, {rows, Hk, D});
  };
  const TensorView k_pool_now = view(pool_k, pr.P), v_pool_now = view(pool_v, pr.P);
  const TensorView k_pool_was = view(pr.h_pool_k, pr.P), v_pool_was = view(pr.h_pool_v, pr.P);
  const TensorView k_rot = view(k_out, T);
  for (int64_t s = 0; s < pr.P; ++s) {
    if (writers[s].empty()) {
      if (!rows_identical(k_pool_now, s, k_pool_was, s) || !rows_identical(v_pool_now, s, v_pool_was, s))
        note("pool row " + std::to_string(s) + " changed but no token writes it");
      continue;
    }
    bool matched = false;
    for (int64_t t : writers[s])
      if (rows_identical(k_pool_now, s, k_rot, t) && rows_identical(v_pool_now, s, pr.host.v, t)) matched = true;
    if (!matched)
      note("pool row " + std::to_string(s) + " is not one token's complete k_rot/v row (" +
           std::to_string(writers[s].size()) + " writers)");
  }
  expect(bad == 0, what + ": " + std::to_string(bad) + " bad; first: " + first);
  return bad == 0;
}

using detail::cuda_launch::LaunchConfig;

/// Launch shapes the tests force besides the default (one warp per item): fewer warps than
/// items, so a warp loops over items and loads all but its first after the barrier.
enum class Kernel { Auto, OneWarp, TwoWarps };

const char* kernel_name(Kernel k) {
  return k == Kernel::OneWarp ? "1 warp" : k == Kernel::TwoWarps ? "2 warps" : "default";
}

/// Runs the op through the public API (Kernel::Auto) or with a forced kernel.
void call(Problem& pr, Kernel kernel, const CallOptions& o = {}) {
  if (kernel == Kernel::Auto) {
    rope_pool_fused(pr.dev, pr.params, o);
    return;
  }
  RopeSchedule schedule;
  const detail::RopePoolProblem p = detail::backend_problem(pr.dev, pr.params, o, schedule);
  LaunchConfig cfg;
  cfg.warps_per_cta = kernel == Kernel::OneWarp ? 1 : 2;
  cfg.head_kernel = -1;  // the token kernel's shapes (from T = 2 the default is the head kernel)
  detail::cuda_launch::rope_pool_cuda_with(p, cfg);
}

void run_case(const Case& c, Kernel kernel, Rng& rng) {
  Problem pr(c, rng);
  const std::string what = c.name() + " [" + kernel_name(kernel) + "]";
  try {
    call(pr, kernel);
    ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    expect(false, what + ": threw " + e.what());
    return;
  }
  check_outputs(pr, what);
}

template <class Ex>
std::string catch_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    if constexpr (std::is_same_v<Ex, std::exception>) {
      return e.what();
    } else {
      if (dynamic_cast<const Ex*>(&e) != nullptr) return e.what();
      return std::string("WRONG EXCEPTION TYPE: ") + e.what();
    }
  }
  return "";
}

// ---- the test suite -------------------------------------------------------------------------

bool g_sanitize = false;  // compute-sanitizer run: a small grid, no stress repeats

void test_grid(bool quick, Rng& rng) {
  std::vector<Case> cases;
  for (DType dt : {DType::Float32, DType::Float16, DType::BFloat16}) {
    // Tuned head sizes, generic 16-byte, scalar, partial rotary, GPT-J pairs.
    struct G {
      int64_t D, R;
      bool il;
    };
    for (G g : {G{64, 0, false}, G{96, 0, false}, G{128, 0, false}, G{256, 0, false}, G{80, 0, false},
                G{72, 0, false}, G{34, 0, false}, G{128, 64, false}, G{512, 0, false}, G{128, 0, true},
                G{64, 32, true}, G{34, 0, true}}) {
      for (auto [Hq, Hk] : {std::pair<int64_t, int64_t>{4, 2}, {5, 3}, {32, 8}}) {
        for (int64_t T : {int64_t(1), int64_t(37), int64_t(300)}) {
          if (quick && (T == 300 || Hq == 32) && !(g.D == 128 && g.R == 0 && !g.il)) continue;
          if (g_sanitize && (T == 300 || Hq != 4 || (dt != DType::BFloat16 && g.D != 128))) continue;
          if (g.D >= 256 && T == 300 && Hq == 32) continue;
          Case c;
          c.dtype = dt, c.D = g.D, c.R = g.R, c.interleaved = g.il, c.Hq = Hq, c.Hk = Hk, c.T = T;
          c.index64 = (T + Hq) % 2 == 0;
          cases.push_back(c);
        }
      }
    }
    for (Layout l : {Layout::FusedQkv, Layout::Misaligned, Layout::PaddedHeads})
      for (int64_t D : {int64_t(128), int64_t(64)}) {
        Case c;
        c.dtype = dt, c.D = D, c.layout = l, c.T = 45, c.Hq = 6, c.Hk = 2;
        cases.push_back(c);
      }
  }
  for (const Case& c : cases)
    for (Kernel k : {Kernel::Auto, Kernel::OneWarp, Kernel::TwoWarps}) run_case(c, k, rng);
  std::printf("grid: %zu cases x 3 launch shapes\n", cases.size());
}

void test_slot_errors(Rng& rng) {
  Case c;
  c.T = 40, c.Hq = 4, c.Hk = 2, c.D = 128;
  c.pool = 100;
  // 1. check_slots=false: the bad row is skipped, the call returns, the next call reports.
  {
    std::vector<int64_t> slots(c.T);
    for (int64_t t = 0; t < c.T; ++t) slots[t] = t;
    slots[17] = 100;  // == pool size: out of range
    slots[23] = 5000;
    Problem pr(c, rng, &slots);
    std::string m = catch_message<std::exception>([&] { rope_pool_fused(pr.dev, pr.params); });
    expect(m.empty(), "out-of-range slot without check_slots: the call itself does not throw (" + m + ")");
    ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
    check_outputs(pr, "out-of-range slot skipped, other rows written");
    Problem next(c, rng);
    m = catch_message<BackendError>([&] { rope_pool_fused(next.dev, next.params); });
    // The record holds the first bad slot the device saw: either bad token of that call.
    const bool named = m.find("slots[17] = 100 ") != std::string::npos ||
                       m.find("slots[23] = 5000 ") != std::string::npos;
    expect(named && m.find("pool of 100 slots") != std::string::npos,
           "the next call reports the earlier bad slot: " + m);
    m = catch_message<std::exception>([&] { rope_pool_fused(next.dev, next.params); });
    expect(m.empty(), "reported once, then cleared: " + m);
    ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
    check_outputs(next, "call after the report runs normally");
  }
  // 2. cuda_check_slot_errors: synchronises and reports.
  {
    std::vector<int64_t> slots(c.T, -1);
    slots[3] = 1 << 30;
    Problem pr(c, rng, &slots);
    rope_pool_fused(pr.dev, pr.params);
    std::string m = catch_message<BackendError>([] { cuda_check_slot_errors(); });
    expect(m.find("slots[3] = 1073741824") != std::string::npos, "cuda_check_slot_errors reports: " + m);
    m = catch_message<std::exception>([] { cuda_check_slot_errors(0); });
    expect(m.empty(), "cuda_check_slot_errors clean after the report: " + m);
  }
  // 3. check_slots=true: ValueError text, nothing written at all.
  for (bool i64 : {false, true}) {
    Case ci = c;
    ci.index64 = i64;
    std::vector<int64_t> slots(c.T);
    for (int64_t t = 0; t < c.T; ++t) slots[t] = t;
    slots[9] = 100;
    slots[30] = 101;
    Problem pr(ci, rng, &slots);
    CallOptions o;
    o.check_slots = true;
    const std::string m = catch_message<Error>([&] { rope_pool_fused(pr.dev, pr.params, o); });
    expect(m == "rope_pool_fused: slots[9] = 100 is out of range for a pool of 100 slots",
           "check_slots message: " + m);
    ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
    check_outputs(pr, "check_slots: nothing written", /*expect_written=*/false);
  }
  {
    std::vector<int64_t> slots(c.T);
    for (int64_t t = 0; t < c.T; ++t) slots[t] = t;
    slots[31] = 12;
    Problem pr(c, rng, &slots);
    CallOptions o;
    o.check_slots = true;
    const std::string m = catch_message<Error>([&] { rope_pool_fused(pr.dev, pr.params, o); });
    expect(m == "rope_pool_fused: slots[31] = 12 repeats slots[12]; with check_slots each slot may be "
                "written once per call",
           "check_slots duplicate message: " + m);
    check_outputs(pr, "check_slots duplicate: nothing written", false);
    slots[31] = 31;
    Problem ok(c, rng, &slots);
    rope_pool_fused(ok.dev, ok.params, o);
    ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
    check_outputs(ok, "check_slots with valid slots");
  }
  // 4. Out-of-range slot in lock mode (large T).
  {
    Case big = c;
    big.T = 3000, big.pool = 6001;
    std::vector<int64_t> slots(big.T);
    for (int64_t t = 0; t < big.T; ++t) slots[t] = 2 * t;
    slots[2500] = 6001;
    Problem pr(big, rng, &slots);
    rope_pool_fused(pr.dev, pr.params);
    std::string m = catch_message<BackendError>([] { cuda_check_slot_errors(); });
    expect(m.find("slots[2500] = 6001 out of range for a pool of 6001 slots") != std::string::npos,
           "lock mode: bad slot reported: " + m);
    check_outputs(pr, "lock mode: bad slot skipped");
  }
  // 5. Duplicates without checking: whole rows only. Many tokens on few slots, through every
  //    duplicate scheme and launch shape: shared-memory scan (T <= 256: the LAST token
  //    wins), per-slot locks (more tokens).
  for (DType dt : {DType::BFloat16, DType::Float32}) {
    for (auto [T, kernel] : {std::pair{int64_t(200), Kernel::Auto}, {int64_t(600), Kernel::OneWarp},
                             {int64_t(4096), Kernel::Auto}, {int64_t(200), Kernel::TwoWarps}}) {
      Case d;
      d.dtype = dt, d.T = T, d.Hq = 4, d.Hk = 8, d.D = 128, d.pool = 8;
      d.index64 = dt == DType::Float32;  // the scan reads int32 and int64 slots
      std::vector<int64_t> slots(d.T);
      for (int64_t t = 0; t < d.T; ++t) slots[t] = t % 5;
      for (int rep = 0; rep < (g_sanitize ? 1 : 3); ++rep) {
        Problem pr(d, rng, &slots);
        call(pr, kernel);
        ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
        const std::string what = std::string("duplicate slots keep whole rows (") + dtype_name(dt) +
                                 " T=" + std::to_string(T) + " " + kernel_name(kernel) + ")";
        check_outputs(pr, what);
        if (T <= 256) {
          // Scan mode: row s holds the last token with slot s.
          const auto k_out = pr.fetch(*pr.d_k_out), pool = pr.fetch(*pr.d_pool_k);
          const size_t row = size_t(d.Hk * d.D) * pr.es;
          bool last = true;
          for (int64_t s = 0; s < 5; ++s) {
            const int64_t t_last = (T - 1) - ((T - 1 - s) % 5);
            last &= !std::memcmp(&pool[size_t(s) * row], &k_out[size_t(t_last) * row], row);
          }
          expect(last, what + ": the last token wins");
        }
      }
    }
  }
}

void test_large_pool(Rng& rng) {
  // bf16 [P, 8, 128] with P = 2^21 + 64: 4.3 GB per pool; the last rows start past 2^32 bytes.
  const int64_t Hk = 8, D = 128, P = (int64_t(1) << 21) + 64, T = 4;
  const size_t row = size_t(Hk * D) * 2, bytes = size_t(P) * row;
  size_t free_b = 0, total_b = 0;
  ROPEPOOL_CUDA_OK(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < 2 * bytes + (size_t(1) << 30)) {
    std::printf("large pool: skipped (%.1f GB free)\n", double(free_b) / 1e9);
    return;
  }
  DeviceBuffer kp(bytes), vp(bytes);
  ROPEPOOL_CUDA_OK(cudaMemset(kp.ptr, 0x11, bytes));
  ROPEPOOL_CUDA_OK(cudaMemset(vp.ptr, 0x22, bytes));
  Case c;
  c.T = T, c.Hq = 2, c.Hk = Hk, c.D = D, c.pool = 16;
  std::vector<int64_t> slots = {P - 1, P - 3, int64_t(1) << 21, 5};
  Problem pr(c, rng, &slots);  // its own small pools are ignored
  const Device gpu{DeviceType::CUDA, 0};
  pr.dev.k_pool = TensorView::contiguous(kp.ptr, c.dtype, {P, Hk, D}, gpu);
  pr.dev.v_pool = TensorView::contiguous(vp.ptr, c.dtype, {P, Hk, D}, gpu);
  CallOptions o;
  o.check_slots = true;  // the range check reads the slots back: also exercises that path
  rope_pool_fused(pr.dev, pr.params, o);
  ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
  const auto k_out = pr.fetch(*pr.d_k_out);
  std::vector<uint8_t> got(row), vref;
  bool ok = true;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    ROPEPOOL_CUDA_OK(cudaMemcpy(got.data(), kp.bytes_at(size_t(s) * row), row, cudaMemcpyDeviceToHost));
    ok &= !std::memcmp(got.data(), &k_out[size_t(t) * row], row);
    ROPEPOOL_CUDA_OK(cudaMemcpy(got.data(), vp.bytes_at(size_t(s) * row), row, cudaMemcpyDeviceToHost));
    const uint8_t* v0 = static_cast<const uint8_t*>(pr.host.v.data) + size_t(t * pr.host.v.strides[0]) * 2;
    ok &= !std::memcmp(got.data(), v0, row);
  }
  // Neighbours untouched.
  for (int64_t s : {P - 2, P - 4, (int64_t(1) << 21) - 1, (int64_t(1) << 21) + 1}) {
    ROPEPOOL_CUDA_OK(cudaMemcpy(got.data(), kp.bytes_at(size_t(s) * row), row, cudaMemcpyDeviceToHost));
    ok &= std::all_of(got.begin(), got.end(), [](uint8_t b) { return b == 0x11; });
  }
  expect(ok, "pool over 4 GiB: rows past 2^32 bytes written exactly, neighbours untouched");
  std::printf("large pool: %.2f GB per pool checked\n", double(bytes) / 1e9);
}

void test_graph(Rng& rng) {
  Case c;
  c.T = 64, c.Hq = 32, c.Hk = 8, c.D = 128;
  Problem pr(c, rng);
  cudaStream_t s;
  ROPEPOOL_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CallOptions o;
  o.stream = s;
  rope_pool_fused(pr.dev, pr.params, o);  // warm-up outside capture (first-call setup)
  ROPEPOOL_CUDA_OK(cudaStreamSynchronize(s));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  ROPEPOOL_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  std::string m = catch_message<std::exception>([&] { rope_pool_fused(pr.dev, pr.params, o); });
  ROPEPOOL_CUDA_OK(cudaStreamEndCapture(s, &g));
  expect(m.empty(), "capture: " + m);
  size_t nodes = 0;
  ROPEPOOL_CUDA_OK(cudaGraphGetNodes(g, nullptr, &nodes));
  expect(nodes == 1, "captured graph has one node, got " + std::to_string(nodes));
  ROPEPOOL_CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
  // New inputs in the same buffers, fresh poison, then replay.
  Problem fresh(c, rng);
  ROPEPOOL_CUDA_OK(cudaMemcpy(pr.d_qkv->ptr, fresh.h_qkv.data(), fresh.h_qkv.size(), cudaMemcpyHostToDevice));
  pr.h_qkv = fresh.h_qkv;
  ROPEPOOL_CUDA_OK(cudaMemset(pr.d_q_out->ptr, 0xff, pr.d_q_out->bytes));
  ROPEPOOL_CUDA_OK(cudaMemcpy(pr.d_pool_k->ptr, pr.h_pool_k.data(), pr.h_pool_k.size(), cudaMemcpyHostToDevice));
  ROPEPOOL_CUDA_OK(cudaGraphLaunch(ge, s));
  ROPEPOOL_CUDA_OK(cudaStreamSynchronize(s));
  check_outputs(pr, "CUDA graph replay with new inputs");
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
}

/// Every pair of 16-bit patterns (a, b) = (index >> 16, index & 0xffff), 8 consecutive indices
/// as one VecIO<E, 8> vector each: SPEC §7's second "rms" rounding as the norm kernel takes it
/// with weights in q's dtype (VecIO::mul_rn, one packed multiply) against the float32 path it
/// replaced, from_float(to_float(a) * (to_float(b) + -0)). Counts elements whose bits differ.
/// Element e of the vector takes index base + (e + shift) % 8: over shifts 0, 2, 4, 6 each
/// word of the vector (the compiler issues some as HMUL2, some as HFMA2 with a -0 addend)
/// sees every pair.
template <class E>
__global__ void packed_mul_every_pair(uint64_t begin, uint64_t end, int shift, unsigned long long* bad,
                                      unsigned* first_bad) {
  using IO = cuda::VecIO<E, 8>;
  for (uint64_t base = begin + (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8; base < end;
       base += uint64_t(gridDim.x) * blockDim.x * 8) {
    const uint32_t a = uint32_t(base >> 16), b0 = uint32_t(base) & 0xffffu;
    uint32_t bw[4];
    for (int i = 0; i < 4; ++i) bw[i] = (b0 + (2 * i + shift) % 8) | (b0 + (2 * i + 1 + shift) % 8) << 16;
    const uint4 av = make_uint4(a | a << 16, a | a << 16, a | a << 16, a | a << 16);
    const uint4 bv = make_uint4(bw[0], bw[1], bw[2], bw[3]);
    float fa[8], fb[8];
    IO::to_float(av, fa);
    IO::to_float(bv, fb);
    const float w_offset = -0.0f;
    for (int i = 0; i < 8; ++i) fa[i] *= fb[i] + w_offset;
    const uint4 want = IO::from_float(fa), got = IO::mul_rn(av, bv);
    const uint32_t ww[4] = {want.x, want.y, want.z, want.w}, gw[4] = {got.x, got.y, got.z, got.w};
    for (int i = 0; i < 8; ++i) {
      const uint32_t g = (gw[i / 2] >> (16 * (i % 2))) & 0xffffu, w = (ww[i / 2] >> (16 * (i % 2))) & 0xffffu;
      if (g != w) {
        const unsigned long long n = atomicAdd(bad, 1ull);
        if (n < 4) first_bad[2 * n] = uint32_t(base + (i + shift) % 8), first_bad[2 * n + 1] = g | w << 16;
      }
    }
  }
}

/// The norm kernel's packed multiply (VecIO::mul_rn) gives the float32 path's bits on every pair
/// of bfloat16 and of float16 patterns: subnormal and zero products of either sign, overflow to
/// infinity, infinities times zero, NaNs.
void test_norm_packed_mul() {
  DeviceBuffer d_bad(8), d_first(32);
  for (int e = 0; e < 2; ++e) {
    // Under the sanitizer: all b for 16 values of a each near 0, 1, -1, the largest and NaN.
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    if (!g_sanitize) ranges = {{0, uint64_t(1) << 32}};
    else
      for (uint64_t a : {0x0000u, 0x3f80u, 0xbf80u, 0x7f70u, 0xfff0u}) ranges.push_back({a << 16, (a + 16) << 16});
    ROPEPOOL_CUDA_OK(cudaMemset(d_bad.ptr, 0, 8));
    ROPEPOOL_CUDA_OK(cudaMemset(d_first.ptr, 0xff, 32));  // written only on a mismatch
    auto* d_n = static_cast<unsigned long long*>(d_bad.ptr);
    auto* d_pairs = static_cast<unsigned*>(d_first.ptr);
    for (auto [b, en] : ranges)
      for (int shift = 0; shift < 8; shift += 2) {
        if (e == 0) packed_mul_every_pair<cuda::BF16><<<2048, 256>>>(b, en, shift, d_n, d_pairs);
        else packed_mul_every_pair<cuda::F16><<<2048, 256>>>(b, en, shift, d_n, d_pairs);
      }
    const auto [n, first] = read_mismatches(d_bad, d_first, 8);
    char b[200];
    std::snprintf(b, sizeof b, "norm's packed %s multiply (VecIO::mul_rn) on %s pairs of patterns: %llu differ from the float32 path%s",
                  e == 0 ? "bfloat16" : "float16", g_sanitize ? "5 x 2^20" : "all 2^32", n, n ? "; first: " : "");
    std::string what = b;
    for (unsigned long long i = 0; i < std::min(n, 4ull); ++i) {
      std::snprintf(b, sizeof b, "0x%04x * 0x%04x -> 0x%04x (want 0x%04x) ", first[2 * i] >> 16, first[2 * i] & 0xffffu,
                    first[2 * i + 1] & 0xffffu, first[2 * i + 1] >> 16);
      what += b;
    }
    expect(n == 0, what);
    std::printf("  %-4s %s\n", n == 0 ? "ok" : "FAIL", what.c_str());
  }
}

// SPEC §7 (the main kernel's norm variant, or the fusion kernels of fusion_kernel.cuh for the
// other geometries): QK norm ("rms" with q-dtype weights,
// "gemma" with float32 ones) and mRoPE (Qwen2-VL sections, Qwen3-VL interleaved), alone and
// combined, against the float64 reference (with the one midpoint ulp §7 allows), every pool
// row bit for bit; text-only mRoPE positions give the plain call's bits.
void test_fusions(Rng& rng) {
  test_norm_packed_mul();
  struct F {
    DType dt;
    int64_t T, Hq, Hk, D, R;
    bool il;
    int norm;  // 0 none, 1 rms, 2 gemma
    int mrope; // 0 none, 1 sections, 2 interleaved
  };
  std::vector<F> fs;
  for (DType dt : {DType::Float32, DType::Float16, DType::BFloat16})
    for (F f : {F{dt, 37, 32, 8, 128, 0, false, 1, 0}, F{dt, 1, 8, 4, 256, 0, false, 2, 0},
                F{dt, 70, 28, 4, 128, 0, false, 0, 1}, F{dt, 64, 32, 8, 128, 0, false, 1, 2},
                F{dt, 300, 4, 2, 64, 32, true, 2, 1}, F{dt, 9, 3, 1, 34, 0, false, 1, 2}})
      fs.push_back(f);
  for (const F& f : fs) {
    Case c;
    c.dtype = f.dt, c.T = f.T, c.Hq = f.Hq, c.Hk = f.Hk, c.D = f.D, c.R = f.R, c.interleaved = f.il;
    c.index64 = f.T % 2 == 0;
    c.max_position = int64_t(1) << 17;
    Problem pr(c, rng);
    const int64_t D = f.D, T = f.T, half = (f.R ? f.R : f.D) / 2;
    // norm weights: host and device copies
    const DType wt = f.norm == 2 ? DType::Float32 : f.dt;
    const size_t wes = dtype_size(wt);
    std::vector<uint8_t> h_w(size_t(2 * D) * wes);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (int64_t d = 0; d < 2 * D; ++d) {
      const float w = (f.norm == 2 ? 0.f : 1.f) + 0.4f * normal(rng);
      const uint32_t b = to_bits(w, wt);
      std::memcpy(&h_w[size_t(d) * wes], &b, wes);
    }
    DeviceBuffer d_w(h_w.size());
    ROPEPOOL_CUDA_OK(cudaMemcpy(d_w.ptr, h_w.data(), h_w.size(), cudaMemcpyHostToDevice));
    const Device gpu{DeviceType::CUDA, 0};
    TensorView hq = TensorView::contiguous(h_w.data(), wt, {D}),
               hk = TensorView::contiguous(h_w.data() + size_t(D) * wes, wt, {D});
    if (f.norm) {
      pr.params.q_norm_weight = TensorView::contiguous(d_w.ptr, wt, {D}, gpu);
      pr.params.k_norm_weight = TensorView::contiguous(d_w.bytes_at(size_t(D) * wes), wt, {D}, gpu);
      pr.params.norm_eps = 1e-6;
      if (f.norm == 2) pr.params.norm_style = "gemma";
    }
    // mRoPE positions [3, T]: row 0 the case's positions, rows 1-2 near it (a third equal)
    const size_t is = c.index64 ? 8 : 4;
    std::vector<uint8_t> h_pos3(size_t(3 * T) * is);
    std::unique_ptr<DeviceBuffer> d_pos3;
    if (f.mrope) {
      const int64_t st = half / 4, sh = (half - st) / 2;
      pr.params.rope_scaling.mrope_section = {st, sh, half - st - sh};
      pr.params.rope_scaling.mrope_interleaved = f.mrope == 2;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t p0 = reference::load_index(pr.host.positions, t);
        const bool text = rng() % 3 == 0;
        for (int64_t r = 0; r < 3; ++r) {
          const int64_t v = p0 + (r == 0 || text ? 0 : int64_t(rng() % 64));
          if (c.index64) std::memcpy(&h_pos3[size_t(r * T + t) * is], &v, 8);
          else { const int32_t v32 = int32_t(v); std::memcpy(&h_pos3[size_t(r * T + t) * is], &v32, 4); }
        }
      }
      d_pos3 = std::make_unique<DeviceBuffer>(h_pos3.size());
      ROPEPOOL_CUDA_OK(cudaMemcpy(d_pos3->ptr, h_pos3.data(), h_pos3.size(), cudaMemcpyHostToDevice));
      const DType idt = c.index64 ? DType::Int64 : DType::Int32;
      pr.host.positions = TensorView::contiguous(h_pos3.data(), idt, {3, T});
      pr.dev.positions = TensorView::contiguous(d_pos3->ptr, idt, {3, T}, gpu);
    }
    char name[160];
    std::snprintf(name, sizeof name, "fusion %s norm=%d mrope=%d", c.name().c_str(), f.norm, f.mrope);
    try {
      rope_pool_fused(pr.dev, pr.params);
      ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
    } catch (const std::exception& e) {
      expect(false, std::string(name) + ": threw " + e.what());
      continue;
    }
    check_outputs(pr, name, true, f.norm ? &hq : nullptr, f.norm ? &hk : nullptr);
  }

  // The norm kernel's head_dim limit, rejected by validation before anything runs.
  {
    Case c;
    c.T = 2, c.Hq = 1, c.Hk = 1, c.D = 4096, c.dtype = DType::Float32;
    Problem pr(c, rng);
    DeviceBuffer d_w(size_t(c.D) * 4);
    pr.params.q_norm_weight = TensorView::contiguous(d_w.ptr, DType::Float32, {c.D}, {DeviceType::CUDA, 0});
    const std::string m = catch_message<Error>([&] { rope_pool_fused(pr.dev, pr.params); });
    expect(m == "rope_pool_fused: head_dim = 4096 exceeds the limit of 2048 on the cuda backend "
                "with q_norm_weight/k_norm_weight",
           "norm head_dim limit: " + m);
  }

  // Text-only mRoPE (three equal rows) == the plain call, bit for bit (the same kernel).
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    Case c;
    c.dtype = dt, c.T = 50, c.Hq = 8, c.Hk = 2, c.D = 128;
    Problem plain(c, rng), mrope(c, rng);
    // the same inputs and pools in both
    ROPEPOOL_CUDA_OK(cudaMemcpy(mrope.d_qkv->ptr, plain.h_qkv.data(), plain.h_qkv.size(), cudaMemcpyHostToDevice));
    ROPEPOOL_CUDA_OK(cudaMemcpy(mrope.d_slots->ptr, plain.h_slots.data(), plain.h_slots.size(), cudaMemcpyHostToDevice));
    std::vector<uint8_t> h_pos3(size_t(3) * plain.h_pos.size());
    for (int r = 0; r < 3; ++r) std::memcpy(&h_pos3[size_t(r) * plain.h_pos.size()], plain.h_pos.data(), plain.h_pos.size());
    DeviceBuffer d_pos3(h_pos3.size());
    ROPEPOOL_CUDA_OK(cudaMemcpy(d_pos3.ptr, h_pos3.data(), h_pos3.size(), cudaMemcpyHostToDevice));
    mrope.dev.positions = TensorView::contiguous(d_pos3.ptr, plain.dev.positions.dtype, {3, c.T}, {DeviceType::CUDA, 0});
    mrope.params.rope_scaling.mrope_section = {16, 24, 24};
    rope_pool_fused(plain.dev, plain.params);
    rope_pool_fused(mrope.dev, mrope.params);
    ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
    const auto a = plain.fetch(*plain.d_q_out), b = mrope.fetch(*mrope.d_q_out);
    const auto ka = plain.fetch(*plain.d_k_out), kb = mrope.fetch(*mrope.d_k_out);
    expect(a == b && ka == kb, std::string("text-only mRoPE equals the plain call, ") + dtype_name(dt));
  }
}

// ---- SPEC §6: paged and strided pools, fp8 pools, fp8 q_out ------------------------------

using detail::cuda_launch::Path;

const char* path_name(Path p) {
  return p == Path::Tuned ? "tuned" : p == Path::Vector ? "vector" : "scalar";
}

/// SPEC §6's e4m3 rule applied to a double (no intermediate float): the "exact" side of the
/// one-ulp checks.
uint8_t e4m3_of(double x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return uint8_t(sign | 0x7f);
  const double a = std::fabs(x);
  if (a > 448.0) return uint8_t(sign | 0x7e);
  if (a < 0.015625) return uint8_t(sign | uint8_t(std::nearbyint(a * 512.0)));
  int e;
  std::frexp(a, &e);
  const int exp = e - 1;
  int man = int(std::nearbyint(std::ldexp(a, 3 - exp)));
  int biased = exp + 7;
  if (man == 16) man = 8, ++biased;
  return uint8_t(sign | (biased << 3) | (man - 8));
}
bool e4m3_is_nan(uint8_t b) { return (b & 0x7f) == 0x7f; }
int e4m3_ordinal(uint8_t b) { return (b & 0x80) ? -int(b & 0x7f) : int(b & 0x7f); }
/// Within one e4m3 step of e4m3(x) for some x in [exact - slack, exact + slack] (NaN only for
/// NaN). slack: what SPEC §7 allows the normalised inputs of a rotated element (0 without a norm:
/// one step of e4m3(exact)). e4m3_of is monotonic, so the ends of the interval bound the codes.
bool e4m3_within_one(uint8_t got, double exact, double slack = 0) {
  const uint8_t lo = e4m3_of(exact - slack), hi = e4m3_of(exact + slack);
  if (e4m3_is_nan(lo) || e4m3_is_nan(hi) || e4m3_is_nan(got))
    return e4m3_is_nan(lo) && e4m3_is_nan(hi) && e4m3_is_nan(got);
  return e4m3_ordinal(got) >= e4m3_ordinal(lo) - 1 && e4m3_ordinal(got) <= e4m3_ordinal(hi) + 1;
}
std::string hex8(uint8_t b) {
  char s[8];
  std::snprintf(s, sizeof s, "0x%02x", b);
  return s;
}

/// Element bits of a float dtype as float (exact; NaN keeps sign and payload).
float bits_to_float(uint32_t b, DType dt) {
  switch (dt) {
    case DType::Float32: return bits_float(b);
    case DType::Float16: return half_to_float(uint16_t(b));
    default: return bf16_to_float(uint16_t(b));
  }
}
uint32_t bits_at(const void* p, size_t es) {
  uint32_t b = 0;
  std::memcpy(&b, p, es);
  return b;
}

/// Where the K and V pools of a cache live (SPEC §6), in pool elements: every kind of cache the
/// engines use. E = D + pad is the stride between consecutive runs of D elements.
enum class Cache { Pool3D, NHD, HND, Stack3D, StackNHD, Vllm, FlashNHD, FlashHND };
const char* cache_name(Cache c) {
  switch (c) {
    case Cache::Pool3D: return "[P,Hk,D]";
    case Cache::NHD: return "NHD [pages,ps,Hk,D]";
    case Cache::HND: return "HND [pages,Hk,ps,D]";
    case Cache::Stack3D: return "layer 1 of [3,P,Hk,D]";
    case Cache::StackNHD: return "layer 1 of [3,pages,ps,Hk,D]";
    case Cache::Vllm: return "vLLM [2,blocks,bs,Hk,D]";
    case Cache::FlashNHD: return "FlashInfer [pages,2,ps,Hk,D]";
    default: return "FlashInfer [pages,2,Hk,ps,D]";
  }
}
struct CacheGeom {
  int64_t page_stride = 0, row_stride = 0, head_stride = 0;
  int64_t k_origin = 0, v_origin = 0;  ///< offsets in their allocation
  int64_t alloc_elems = 0;              ///< elements of one allocation
  bool one_allocation = false;          ///< K and V are halves of one cache
};
CacheGeom cache_geom(Cache kind, int64_t pages, int64_t ps, int64_t Hk, int64_t D, int64_t pad) {
  const int64_t E = D + pad, one = pages * ps * Hk * E;
  CacheGeom g;
  auto nhd = [&] { g.head_stride = E, g.row_stride = Hk * E, g.page_stride = ps * Hk * E; };
  auto hnd = [&] { g.row_stride = E, g.head_stride = ps * E, g.page_stride = Hk * ps * E; };
  switch (kind) {
    case Cache::Pool3D: nhd(), g.row_stride = 0, g.alloc_elems = one; break;
    case Cache::NHD: nhd(), g.alloc_elems = one; break;
    case Cache::HND: hnd(), g.alloc_elems = one; break;
    case Cache::Stack3D: nhd(), g.row_stride = 0, g.k_origin = g.v_origin = one, g.alloc_elems = 3 * one; break;
    case Cache::StackNHD: nhd(), g.k_origin = g.v_origin = one, g.alloc_elems = 3 * one; break;
    case Cache::Vllm: nhd(), g.v_origin = one, g.alloc_elems = 2 * one, g.one_allocation = true; break;
    case Cache::FlashNHD:
      nhd(), g.page_stride = 2 * ps * Hk * E, g.v_origin = ps * Hk * E, g.alloc_elems = 2 * one;
      g.one_allocation = true;
      break;
    case Cache::FlashHND:
      hnd(), g.page_stride = 2 * Hk * ps * E, g.v_origin = Hk * ps * E, g.alloc_elems = 2 * one;
      g.one_allocation = true;
      break;
  }
  return g;
}

/// One device allocation: a guard, the elements, a guard; every byte random to start with.
struct PoolBuffer {
  static constexpr size_t kGuard = 256;
  std::vector<uint8_t> before;  // guards included
  std::unique_ptr<DeviceBuffer> dev;
  PoolBuffer(size_t body_bytes, Rng& rng) : before(2 * kGuard + body_bytes) {
    for (auto& b : before) b = uint8_t(rng());
    dev = std::make_unique<DeviceBuffer>(before.size());
    ROPEPOOL_CUDA_OK(cudaMemcpy(dev->ptr, before.data(), before.size(), cudaMemcpyHostToDevice));
  }
  std::vector<uint8_t> now() const {
    std::vector<uint8_t> h(before.size());
    ROPEPOOL_CUDA_OK(cudaMemcpy(h.data(), dev->ptr, h.size(), cudaMemcpyDeviceToHost));
    return h;
  }
};

struct PoolCase {
  DType dtype = DType::BFloat16;
  int64_t T = 37, Hq = 4, Hk = 2, D = 128, R = 0;
  bool interleaved = false;
  Cache cache = Cache::NHD;
  int64_t page_size = 16;
  int64_t pages = 0;      ///< 0: room for 2T + 5 slots, plus a page
  int64_t pad = 0;        ///< elements between runs of D, beyond D
  int64_t base_off = 0;   ///< bytes the pools' origin is shifted by (alignment tests)
  /// > 0: the pool size the kernel is told (pages beyond the allocation are never addressed:
  /// the slots stay below pages * page_size). Beyond 2^32 it takes the 64-bit page division.
  int64_t claimed_pool_size = 0;
  bool fp8_pool = false, fp8_q = false;
  float k_scale = 1, v_scale = 1, q_scale = 1;
  bool scale_ptrs = false;  ///< scales as one float32 each in device memory
  bool specials = false;    ///< NaN, Inf, huge, tiny and tie values in v (NaN in q and k)
  /// SPEC §7 (the fusion kernel): 0 none, 1 "rms" (weights in q's dtype), 2 "gemma" (float32
  /// weights); norm_sides: bit 0 q_norm_weight, bit 1 k_norm_weight.
  int norm = 0, norm_sides = 3;
  int mrope = 0;            ///< SPEC §7 positions [3, T]: 1 Qwen2-VL sections, 2 interleaved
  bool index64 = false;
  Kernel kernel = Kernel::Auto;
  int warps = 0;            ///< LaunchConfig::warps_per_cta when not 0 (over `kernel`'s)
  bool no_split = false;    ///< LaunchConfig::split_fp8_kv = -1 (an fp8 pool's k and v on one item)
  bool capped = false;      ///< LaunchConfig::uncapped = -1 (the capped kernel at every T)
  bool forced_uncapped = false;  ///< LaunchConfig::uncapped = 1 (the uncapped one at every T)
  int ctas_per_token = 0;   ///< LaunchConfig::ctas_per_token (the uncapped kernel's split)
  int fp8_q_units = 0;      ///< LaunchConfig::fp8_q_units
  bool split_plain = false; ///< LaunchConfig::split_plain (a call in q's dtype on the uncapped kernel)
  bool no_k_rot = false;    ///< SPEC §4 return_k_rot=False: a null k_out
  /// LaunchConfig::head_kernel: 0 the planner's choice (1: the head kernel, -1: the token
  /// kernel); a case that sets one of the token kernel's shapes above runs the token kernel.
  int head_kernel = 0;
  bool padded_heads = false;  ///< q, k and v with 16 bytes after each head (Layout::PaddedHeads)
  int expect_uncapped = -1; ///< 1 or 0: whether the plan must take the uncapped kernel; -1 any
  int expect_path = -1;     ///< a Path the plan must choose, or -1
  std::vector<int64_t> slots;  ///< empty: distinct random rows, some negative
  /// Rows per page as the kernel sees them: the 3-D pools are pages of one row.
  int64_t rows_per_page() const { return cache == Cache::Pool3D || cache == Cache::Stack3D ? 1 : page_size; }
  std::string name() const {
    char b[400];
    const int64_t ps = rows_per_page();
    std::snprintf(b, sizeof b, "%s T=%lld Hq=%lld Hk=%lld D=%lld%s%s %s ps=%lld%s%s pool=%s%s%s%s%s%s%s [%s]",
                  dtype_name(dtype), (long long)T, (long long)Hq, (long long)Hk, (long long)D,
                  R ? (" R=" + std::to_string(R)).c_str() : "", interleaved ? " gptj" : "",
                  cache_name(cache), (long long)ps, pad ? (" pad=" + std::to_string(pad)).c_str() : "",
                  base_off ? (" base+" + std::to_string(base_off) + "B").c_str() : "",
                  fp8_pool ? "fp8" : dtype_name(dtype),
                  fp8_pool ? (" ks=" + std::to_string(k_scale) + " vs=" + std::to_string(v_scale)).c_str() : "",
                  fp8_q ? (" q_out=fp8 qs=" + std::to_string(q_scale)).c_str() : "",
                  (fp8_pool || fp8_q) ? (scale_ptrs ? " (scale ptrs)" : " (scale values)") : "",
                  specials ? " +nan/inf/ties" : "",
                  norm ? (std::string(" norm=") + (norm == 2 ? "gemma" : "rms") +
                          (norm_sides == 1 ? "(q)" : norm_sides == 2 ? "(k)" : ""))
                             .c_str()
                       : "",
                  mrope ? (mrope == 2 ? " mrope(interleaved)" : " mrope") : "", kernel_name(kernel));
    std::string n = b;
    if (no_split) n += " no-split";
    if (capped) n += " capped";
    if (forced_uncapped) n += " uncapped(forced)";
    if (ctas_per_token) n += " ctas/token=" + std::to_string(ctas_per_token);
    if (fp8_q_units) n += " q_units=" + std::to_string(fp8_q_units);
    if (split_plain) n += " split-plain";
    if (no_k_rot) n += " no-k_rot";
    if (warps) n += " warps=" + std::to_string(warps);
    if (head_kernel) n += head_kernel > 0 ? " head-kernel" : " token-kernel";
    if (padded_heads) n += " padded-heads";
    if (claimed_pool_size) n += " pool_size=" + std::to_string(claimed_pool_size);
    return n;
  }
};

/// One call on a SPEC §6 cache, with the problem filled in directly (the validation of these
/// keywords is not the backend's), and its check.
struct PoolRun {
  PoolCase c;
  int64_t ps, pages, P;
  size_t es, pes;
  CacheGeom g;
  std::unique_ptr<Problem> pr;
  std::vector<std::unique_ptr<PoolBuffer>> bufs;
  PoolBuffer *kbuf = nullptr, *vbuf = nullptr;
  std::unique_ptr<DeviceBuffer> q8, scale_dev;
  // SPEC §7: the norm weights (q's then k's: host bytes, views, values) and mRoPE positions
  std::vector<uint8_t> h_w, h_pos3;
  std::unique_ptr<DeviceBuffer> d_w, d_pos3;
  TensorView hq_w, hk_w;
  std::vector<double> wq, wk;
  RopeSchedule schedule;
  detail::RopePoolProblem prob;
  LaunchConfig cfg;

  PoolRun(const PoolCase& cs, Rng& rng) : c(cs) {
    ps = c.rows_per_page();
    pages = c.pages ? c.pages : (2 * c.T + 5 + ps - 1) / ps + 1;
    P = pages * ps;
    es = dtype_size(c.dtype);
    pes = c.fp8_pool ? 1 : es;
    Case base;
    base.dtype = c.dtype, base.T = c.T, base.Hq = c.Hq, base.Hk = c.Hk, base.D = c.D, base.R = c.R;
    base.interleaved = c.interleaved, base.index64 = c.index64, base.pool = P;
    if (c.padded_heads) base.layout = Layout::PaddedHeads;
    pr = std::make_unique<Problem>(base, rng, c.slots.empty() ? nullptr : &c.slots);
    if (c.specials) add_specials();
    if (c.norm) add_norm(rng);
    if (c.mrope) add_mrope(rng);
    g = cache_geom(c.cache, pages, ps, c.Hk, c.D, c.pad);
    const size_t body = size_t(g.alloc_elems) * pes + size_t(c.base_off);
    for (int i = 0; i < (g.one_allocation ? 1 : 2); ++i) bufs.push_back(std::make_unique<PoolBuffer>(body, rng));
    kbuf = bufs[0].get();
    vbuf = bufs.back().get();

    CallOptions o;
    prob = detail::backend_problem(pr->dev, pr->params, o, schedule);
    if (c.no_k_rot) prob.k_out = detail::Rows{nullptr, 0, 0};
    auto pool_rows = [&](PoolBuffer* b, int64_t origin) {
      return detail::PoolRows{b->dev->bytes_at(PoolBuffer::kGuard + size_t(c.base_off) + size_t(origin) * pes),
                              g.page_stride, g.row_stride, g.head_stride};
    };
    prob.k_pool = pool_rows(kbuf, g.k_origin);
    prob.v_pool = pool_rows(vbuf, g.v_origin);
    prob.page_size = ps;
    prob.pool_size = c.claimed_pool_size ? c.claimed_pool_size : P;
    prob.pool_dtype = c.fp8_pool ? DType::Float8E4M3FN : c.dtype;
    if (c.fp8_q) {
      q8 = std::make_unique<DeviceBuffer>(size_t(c.T * c.Hq * c.D));
      ROPEPOOL_CUDA_OK(cudaMemset(q8->ptr, 0xff, q8->bytes));  // 0xff: an e4m3 NaN
      prob.q_out = detail::Rows{q8->ptr, c.Hq * c.D, c.D};
      prob.q_out_dtype = DType::Float8E4M3FN;
    }
    scale_dev = std::make_unique<DeviceBuffer>(3 * sizeof(float));
    set_scales(c.k_scale, c.v_scale, c.q_scale);
    if (c.kernel != Kernel::Auto) cfg.warps_per_cta = c.kernel == Kernel::OneWarp ? 1 : 2;
    if (c.warps) cfg.warps_per_cta = c.warps;
    cfg.split_fp8_kv = c.no_split ? -1 : 0;
    cfg.uncapped = c.capped ? -1 : c.forced_uncapped ? 1 : 0;
    cfg.ctas_per_token = c.ctas_per_token, cfg.fp8_q_units = c.fp8_q_units;
    cfg.split_plain = c.split_plain ? 1 : 0;
    cfg.head_kernel = c.head_kernel;
    if (c.head_kernel == 0 && (c.no_split || c.capped || c.forced_uncapped || c.ctas_per_token || c.fp8_q_units ||
                               c.split_plain || c.expect_uncapped == 1))
      cfg.head_kernel = -1;
    // Forced warps in q's dtype: the token kernel's shapes, as before the head kernel took these
    // calls by default (fp8 calls keep the head kernel at that CTA size).
    if (c.head_kernel == 0 && !c.fp8_pool && !c.fp8_q && (c.kernel != Kernel::Auto || c.warps)) cfg.head_kernel = -1;
  }

  /// The scales the next launch uses: values, or (scale_ptrs) the device floats, with a wrong
  /// value beside the pointer, so a kernel that reads the value fails.
  void set_scales(float ks, float vs, float qs) {
    c.k_scale = ks, c.v_scale = vs, c.q_scale = qs;
    const float host[3] = {ks, vs, qs};
    ROPEPOOL_CUDA_OK(cudaMemcpy(scale_dev->ptr, host, sizeof host, cudaMemcpyHostToDevice));
    const float* d = static_cast<const float*>(scale_dev->ptr);
    detail::Scale* s[3] = {&prob.k_scale, &prob.v_scale, &prob.q_scale};
    for (int i = 0; i < 3; ++i) *s[i] = c.scale_ptrs ? detail::Scale{777.0f, d + i} : detail::Scale{host[i], nullptr};
  }

  /// NaN (both signs, quiet and signalling), infinities, values beyond 448, tiny values and
  /// e4m3 ties in v; a NaN in some q and k heads.
  void add_specials() {
    const DType dt = c.dtype;
    const uint32_t nan_a = dt == DType::Float32 ? 0xffc01234u : dt == DType::Float16 ? 0xfe01u : 0xffc1u;
    const uint32_t nan_b = dt == DType::Float32 ? 0x7f800001u : dt == DType::Float16 ? 0x7c01u : 0x7f81u;
    const uint32_t inf_p = dt == DType::Float32 ? 0x7f800000u : dt == DType::Float16 ? 0x7c00u : 0x7f80u;
    const std::vector<uint32_t> values = {
        nan_a, nan_b, inf_p, inf_p | (dt == DType::Float32 ? 0x80000000u : 0x8000u),
        to_bits(3000.f, dt), to_bits(-3000.f, dt), to_bits(1e-4f, dt), to_bits(-2.5e-3f, dt),
        to_bits(1.0625f, dt), to_bits(-1.1875f, dt), to_bits(0.0f, dt), to_bits(-0.0f, dt),
        to_bits(0.0029296875f, dt), to_bits(248.0f, dt), to_bits(-464.0f, dt), to_bits(440.0f, dt)};
    const Problem& p = *pr;
    for (int64_t t = 0; t < c.T; ++t) {
      for (int j = 0; j < 3; ++j) {
        const uint32_t b = values[size_t(t * 3 + j) % values.size()];
        std::memcpy(element(p.host.v, t, (t + j) % c.Hk, (5 * t + 11 * j) % c.D), &b, es);
      }
      if (t % 7 == 1) std::memcpy(element(p.host.k, t, 0, 3 % c.D), &nan_a, es);
      if (t % 5 == 2) std::memcpy(element(p.host.q, t, 1 % c.Hq, 7 % c.D), &nan_b, es);
    }
    ROPEPOOL_CUDA_OK(cudaMemcpy(pr->d_qkv->ptr, pr->h_qkv.data(), pr->h_qkv.size(), cudaMemcpyHostToDevice));
  }

  /// SPEC §7 norm weights around 1 ("rms") or 0 ("gemma"), device copies in the call.
  void add_norm(Rng& rng) {
    const int64_t D = c.D;
    const DType wt = c.norm == 2 ? DType::Float32 : c.dtype;
    const size_t wes = dtype_size(wt);
    h_w.resize(size_t(2 * D) * wes);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (int64_t d = 0; d < 2 * D; ++d) {
      const uint32_t b = to_bits((c.norm == 2 ? 0.f : 1.f) + 0.4f * normal(rng), wt);
      std::memcpy(&h_w[size_t(d) * wes], &b, wes);
      (d < D ? wq : wk).push_back(double(bits_to_float(b, wt)));
    }
    d_w = std::make_unique<DeviceBuffer>(h_w.size());
    ROPEPOOL_CUDA_OK(cudaMemcpy(d_w->ptr, h_w.data(), h_w.size(), cudaMemcpyHostToDevice));
    hq_w = TensorView::contiguous(h_w.data(), wt, {D});
    hk_w = TensorView::contiguous(h_w.data() + size_t(D) * wes, wt, {D});
    const Device gpu{DeviceType::CUDA, 0};
    RopePoolParams& params = pr->params;
    if (c.norm_sides & 1) params.q_norm_weight = TensorView::contiguous(d_w->ptr, wt, {D}, gpu);
    if (c.norm_sides & 2) params.k_norm_weight = TensorView::contiguous(d_w->bytes_at(size_t(D) * wes), wt, {D}, gpu);
    params.norm_eps = 1e-6;
    if (c.norm == 2) params.norm_style = "gemma";
  }
  const TensorView* norm_of(bool q) const {
    return c.norm && (c.norm_sides & (q ? 1 : 2)) ? (q ? &hq_w : &hk_w) : nullptr;
  }

  /// SPEC §7 mRoPE positions [3, T]: row 0 the case's positions, rows 1-2 near them (a third
  /// of the tokens text-only: three equal rows).
  void add_mrope(Rng& rng) {
    Problem& p = *pr;
    const int64_t T = c.T, half = (c.R ? c.R : c.D) / 2, st = half / 4, sh = (half - st) / 2;
    p.params.rope_scaling.mrope_section = {st, sh, half - st - sh};
    p.params.rope_scaling.mrope_interleaved = c.mrope == 2;
    const size_t is = c.index64 ? 8 : 4;
    h_pos3.resize(size_t(3 * T) * is);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p0 = reference::load_index(p.host.positions, t);
      const bool text = rng() % 3 == 0;
      for (int64_t r = 0; r < 3; ++r) {
        const int64_t v = p0 + (r == 0 || text ? 0 : int64_t(rng() % 64));
        const int32_t v32 = int32_t(v);
        std::memcpy(&h_pos3[size_t(r * T + t) * is], c.index64 ? static_cast<const void*>(&v) : &v32, is);
      }
    }
    d_pos3 = std::make_unique<DeviceBuffer>(h_pos3.size());
    ROPEPOOL_CUDA_OK(cudaMemcpy(d_pos3->ptr, h_pos3.data(), h_pos3.size(), cudaMemcpyHostToDevice));
    const DType idt = c.index64 ? DType::Int64 : DType::Int32;
    p.host.positions = TensorView::contiguous(h_pos3.data(), idt, {3, T});
    p.dev.positions = TensorView::contiguous(d_pos3->ptr, idt, {3, T}, {DeviceType::CUDA, 0});
  }

  /// The exact rotation of x [T, H, D] (of its SPEC §7 normalised values when the case
  /// normalises it) and, per element, the slack the norm's one-ulp midpoint differences
  /// (float32: 2^-20 relative) and the float32 rotation (2^-18 (|a| + |b|)) allow, as
  /// check_rotation allows them: 0 without a norm.
  void exact_rotation(const TensorView& x, bool q, std::vector<double>& exact, std::vector<double>& slack) const {
    const TensorView* w = norm_of(q);
    const TensorView& positions = pr->host.positions;
    if (w == nullptr) {
      exact = reference::rotate(x, positions, schedule, c.interleaved);
      slack.assign(exact.size(), 0.0);
      return;
    }
    const bool gemma = c.norm == 2;
    const int64_t T = x.shape[0], H = x.shape[1], D = x.shape[2], R = schedule.rotary_dim, half = R / 2;
    const std::vector<double> y = reference::normalize(x, *w, 1e-6, gemma);
    exact = reference::rotate(y, T, H, D, positions, schedule, c.interleaved);
    slack.resize(exact.size());
    const std::vector<double>& wd = q ? wq : wk;
    for (int64_t i = 0; i < T * H; ++i)
      for (int64_t d = 0; d < D; ++d) {
        auto mid = [&](int64_t e) {  // the one-ulp midpoint difference of normalised element e
          const double v = std::abs(y[size_t(i * D + e)]), a = std::abs(wd[size_t(e)]);
          if (x.dtype == DType::Float32) return std::ldexp(v, -20);
          if (gemma || a == 0) return reference::tolerance(x.dtype, v, 0);
          return reference::tolerance(x.dtype, v / a, 0) * a + reference::tolerance(x.dtype, v, 0);
        };
        double sl = mid(d);
        if (d < R) {
          const int64_t other = c.interleaved ? (d ^ 1) : d < half ? d + half : d - half;
          sl += mid(other) + std::ldexp(std::abs(y[size_t(i * D + d)]) + std::abs(y[size_t(i * D + other)]), -18);
        }
        slack[size_t(i * D + d)] = sl;
      }
  }

  Path plan_path(int* variant = nullptr, int* warps = nullptr, int* kv_items = nullptr,
                 int* q_units = nullptr, bool* uncapped = nullptr, int* ctas = nullptr,
                 bool* head = nullptr) const {
    const auto plan = detail::cuda_launch::plan_launch(prob, cfg);
    if (head) *head = plan.head_kernel;
    if (ctas) *ctas = plan.ctas_per_token;
    if (uncapped) *uncapped = plan.uncapped;
    if (variant) *variant = plan.pool_variant;
    if (warps) *warps = plan.config.warps_per_cta;
    if (kv_items) *kv_items = plan.kv_items;
    if (q_units) *q_units = plan.q_item_units;
    return plan.path;
  }

  void launch() { detail::cuda_launch::rope_pool_cuda_with(prob, cfg); }

  /// Every output element and every byte of the cache allocations (guards included). Returns
  /// the number of problems, `first` the first one.
  int64_t check(std::string& first) const {
    int64_t bad = 0;
    auto note = [&](const std::string& m) {
      if (bad++ == 0) first = m;
    };
    const int64_t T = c.T, Hq = c.Hq, Hk = c.Hk, D = c.D;
    const Problem& p = *pr;
    const auto k_out = p.fetch(*p.d_k_out);
    const TensorView k_out_view = TensorView::contiguous(const_cast<uint8_t*>(k_out.data()), c.dtype, {T, Hk, D});
    auto how = [&](bool q) {  // SPEC §7: normalised where the call normalises
      RotationCheck r;
      r.norm_weight = norm_of(q);
      r.norm_gemma = c.norm == 2;
      return r;
    };
    {
      const CheckStats s =
          check_rotation("k", p.host.k, k_out_view, p.host.positions, schedule, c.interleaved, how(false));
      for (const auto& f : s.first) note(f.second);
      bad += std::max<int64_t>(0, s.failures - int64_t(s.first.size()));
    }
    if (!c.fp8_q) {
      const auto q_out = p.fetch(*p.d_q_out);
      const TensorView q_view = TensorView::contiguous(const_cast<uint8_t*>(q_out.data()), c.dtype, {T, Hq, D});
      const CheckStats s = check_rotation("q", p.host.q, q_view, p.host.positions, schedule, c.interleaved, how(true));
      for (const auto& f : s.first) note(f.second);
      bad += std::max<int64_t>(0, s.failures - int64_t(s.first.size()));
    } else {
      std::vector<uint8_t> q(q8->bytes);
      ROPEPOOL_CUDA_OK(cudaMemcpy(q.data(), q8->ptr, q.size(), cudaMemcpyDeviceToHost));
      std::vector<double> exact, slack;
      exact_rotation(p.host.q, true, exact, slack);
      for (size_t i = 0; i < q.size(); ++i)
        if (!e4m3_within_one(q[i], exact[i] / double(c.q_scale), slack[i] / double(c.q_scale)))
          note("q_out (fp8) element " + std::to_string(i) + " = " + hex8(q[i]) + ", exact " +
               std::to_string(exact[i]) + " / q_scale " + std::to_string(c.q_scale) + " -> " +
               hex8(e4m3_of(exact[i] / double(c.q_scale))) +
               (slack[i] > 0 ? " (norm slack " + std::to_string(slack[i]) + ")" : ""));
    }

    // Pools: which tokens write each slot; a row must be one writer's complete k and v row.
    std::vector<double> k_exact, k_slack;
    exact_rotation(p.host.k, false, k_exact, k_slack);
    std::vector<std::vector<int64_t>> writers(static_cast<size_t>(P));
    for (int64_t t = 0; t < T; ++t)
      if (const int64_t s = p.slot(t); s >= 0 && s < P) writers[size_t(s)].push_back(t);
    std::vector<std::vector<uint8_t>> now;
    for (const auto& b : bufs) now.push_back(b->now());
    std::vector<std::vector<uint8_t>> written;
    for (const auto& b : bufs) written.emplace_back(b->before.size(), 0);
    const size_t kb = 0, vb = bufs.size() - 1;
    auto addr = [&](int64_t origin, int64_t s, int64_t h, int64_t d) {
      return PoolBuffer::kGuard + size_t(c.base_off) +
             size_t(origin + (s / ps) * g.page_stride + (s % ps) * g.row_stride + h * g.head_stride + d) * pes;
    };
    // Whether element (h, d) of the pool row at slot s holds token t's value; a reason if not.
    auto k_ok = [&](int64_t t, int64_t s, int64_t h, int64_t d, std::string* why) {
      const uint8_t* got = &now[kb][addr(g.k_origin, s, h, d)];
      const uint8_t* ko = &k_out[size_t((t * Hk + h) * D + d) * es];
      if (!c.fp8_pool) {
        if (std::memcmp(got, ko, es) == 0) return true;
        if (why) *why = "k_pool differs from k_out";
        return false;
      }
      const double exact = k_exact[size_t((t * Hk + h) * D + d)] / double(c.k_scale);
      bool ok = e4m3_within_one(*got, exact, k_slack[size_t((t * Hk + h) * D + d)] / double(c.k_scale));
      // float32: k_out is the very value the pool element was quantised from.
      const uint8_t from_k_out = float_to_e4m3(bits_to_float(bits_at(ko, es), c.dtype) / c.k_scale);
      if (c.dtype == DType::Float32 && *got != from_k_out) ok = false;
      if (!ok && why)
        *why = "k_pool (fp8) " + hex8(*got) + ", exact " + std::to_string(exact * c.k_scale) + " / k_scale " +
               std::to_string(c.k_scale) + " -> " + hex8(e4m3_of(exact)) +
               (c.dtype == DType::Float32 ? ", e4m3(k_out / k_scale) = " + hex8(from_k_out) : "");
      return ok;
    };
    auto v_ok = [&](int64_t t, int64_t s, int64_t h, int64_t d, std::string* why) {
      const uint8_t* got = &now[vb][addr(g.v_origin, s, h, d)];
      const void* vin = element(p.host.v, t, h, d);
      if (!c.fp8_pool) {
        if (std::memcmp(got, vin, es) == 0) return true;
        if (why) *why = "v_pool differs from v";
        return false;
      }
      const float x = bits_to_float(bits_at(vin, es), c.dtype);
      const uint8_t want = float_to_e4m3(x / c.v_scale);
      if (*got == want) return true;
      if (why) {
        char b[200];
        std::snprintf(b, sizeof b, "v_pool (fp8) %s, want e4m3(%.9g / %.9g) = %s (v bits 0x%x)", hex8(*got).c_str(),
                      double(x), double(c.v_scale), hex8(want).c_str(), bits_at(vin, es));
        *why = b;
      }
      return false;
    };
    int64_t bad_rows = 0;
    for (int64_t s = 0; s < P; ++s) {
      const auto& w = writers[size_t(s)];
      if (w.empty()) continue;
      for (int64_t h = 0; h < Hk; ++h)
        for (int64_t d = 0; d < D; ++d)
          for (auto [buf, origin] : {std::pair{kb, g.k_origin}, {vb, g.v_origin}})
            for (size_t e = 0; e < pes; ++e) {
              uint8_t& m = written[buf][addr(origin, s, h, d) + e];
              if (m++) note("test layout error: two pool elements share a byte");
            }
      std::string why;
      bool matched = false;
      for (int64_t t : w) {
        bool all = true;
        for (int64_t h = 0; h < Hk && all; ++h)
          for (int64_t d = 0; d < D && all; ++d)
            all = k_ok(t, s, h, d, &why) && v_ok(t, s, h, d, &why);
        if (all) {
          matched = true;
          break;
        }
      }
      if (!matched && bad_rows++ < 3)
        note("slot " + std::to_string(s) + " (page " + std::to_string(s / ps) + ", row " + std::to_string(s % ps) +
             ", " + std::to_string(w.size()) + " writer(s), first token " + std::to_string(w.front()) +
             ") is not one token's complete row: " + why);
    }
    if (bad_rows > 3) bad += bad_rows - 3;
    for (size_t b = 0; b < bufs.size(); ++b) {
      int64_t changed = 0;
      size_t first_at = 0;
      for (size_t i = 0; i < now[b].size(); ++i)
        if (!written[b][i] && now[b][i] != bufs[b]->before[i] && changed++ == 0) first_at = i;
      if (changed) {
        const bool guard = first_at < PoolBuffer::kGuard || first_at >= now[b].size() - PoolBuffer::kGuard;
        note(std::to_string(changed) + " byte(s) of cache allocation " + std::to_string(b) +
             " changed outside the rows written, first at byte " + std::to_string(first_at) +
             (guard ? " (a guard byte)" : ""));
      }
    }
    return bad;
  }
};

int g_pool_cases = 0;

/// Runs one case, prints one line: ok/FAIL, the plan (path, variant, warps), the case.
/// SPEC §4 return_k_rot=False: `run` (launched, null k_out) against the same case with k_out on
/// the same inputs (`twin_rng`: the generator as `run` found it): the twin passes the whole
/// check, and `run` wrote the same cache bytes and q_out bit for bit and not one byte of its
/// k_out buffer (all-ones poison).
int64_t check_without_k_rot(const PoolRun& run, const PoolCase& pc, Rng& twin_rng, std::string& first) {
  PoolCase with = pc;
  with.no_k_rot = false;
  PoolRun twin(with, twin_rng);
  twin.launch();
  ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
  int64_t bad = twin.check(first);
  auto note = [&](const std::string& m) {
    if (bad++ == 0) first = m;
  };
  for (size_t b = 0; b < run.bufs.size(); ++b)
    if (run.bufs[b]->now() != twin.bufs[b]->now())
      note("cache allocation " + std::to_string(b) + " differs from the call with k_rot");
  const DeviceBuffer& q = pc.fp8_q ? *run.q8 : *run.pr->d_q_out;
  const DeviceBuffer& q_twin = pc.fp8_q ? *twin.q8 : *twin.pr->d_q_out;
  if (run.pr->fetch(q) != twin.pr->fetch(q_twin)) note("q_out differs from the call with k_rot");
  const std::vector<uint8_t> k_out = run.pr->fetch(*run.pr->d_k_out);
  if (std::any_of(k_out.begin(), k_out.end(), [](uint8_t x) { return x != 0xff; }))
    note("k_out was written although the call asked for no k_rot");
  return bad;
}

void run_pool_case(const PoolCase& pc, Rng& rng, const char* group) {
  Rng twin_rng = rng;
  PoolRun run(pc, rng);
  int variant = 0, warps = 0, kv_items = 0, q_units = 0, ctas = 0;
  bool uncapped = false, head = false;
  const Path path = run.plan_path(&variant, &warps, &kv_items, &q_units, &uncapped, &ctas, &head);
  const std::string what = std::string(group) + ": " + pc.name();
  std::string first;
  int64_t bad = 0;
  try {
    run.launch();
    ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
    bad = pc.no_k_rot ? check_without_k_rot(run, pc, twin_rng, first) : run.check(first);
  } catch (const std::exception& e) {
    bad = 1, first = std::string("threw ") + e.what();
  }
  // The planner: where the call takes no row locks (T <= kMaxScanTokens, 256:
  // src/cuda/rope_pool_kernel.cuh), an fp8 pool's k and v heads on items of their own (unless
  // the case turns it off) and an fp8 q_out's q items of 2 units (kQUnitsFp8), else of 4.
  // The head kernel: forced, or by default on the tuned path of head_dim 128 without a QK norm,
  // for calls with an fp8 pool or q_out from T = 1, in q's dtype from T = 2; up to T = 128, or
  // 256 for a pool variant (an fp8 pool or q_out, pages of more than one row, no k_rot)
  // (src/cuda/head_kernel.cuh).
  const bool head_ok = path == Path::Tuned && pc.D == 128 && !pc.norm && pc.T <= 256;
  const bool on_variant = pc.fp8_pool || pc.fp8_q || pc.no_k_rot || pc.rows_per_page() > 1;
  const bool want_head = run.cfg.head_kernel == 1    ? head_ok
                         : run.cfg.head_kernel == -1 ? false
                                                     : head_ok && pc.T <= (on_variant ? 256 : 128) &&
                                                           (pc.fp8_pool || pc.fp8_q || pc.T >= 2);
  if (head != want_head) {
    ++bad;
    first = std::string("plan ") + (head ? "took" : "did not take") + " the head kernel" +
            (first.empty() ? "" : "; " + first);
  }
  const int want_kv = pc.fp8_pool && pc.T <= 256 && !pc.no_split ? 2 : 1;
  const int want_q = pc.fp8_q && pc.T <= 256 ? (pc.fp8_q_units ? pc.fp8_q_units : 2) : 4;
  if (!pc.norm && !head && (kv_items != want_kv || q_units != want_q)) {
    ++bad;
    first = "plan chose " + std::to_string(kv_items) + " kv item(s) and q items of " + std::to_string(q_units) +
            " units, expected " + std::to_string(want_kv) + " and " + std::to_string(want_q) +
            (first.empty() ? "" : "; " + first);
  }
  // A norm call runs the norm kernel: its plan never claims the uncapped one.
  if (pc.norm || head ? uncapped : pc.expect_uncapped >= 0 && bool(pc.expect_uncapped) != uncapped) {
    ++bad;
    first = std::string("plan ") + (uncapped ? "took" : "did not take") + " the uncapped kernel" +
            (first.empty() ? "" : "; " + first);
  }
  if (uncapped && !pc.norm) {
    // The uncapped kernel (tuned, NeoX, D = 128) of an fp8 call (or split_plain) spreads a
    // token's warp items over CTAs of two warps up to T = 128 and keeps one CTA beyond; a paged
    // pool in q's dtype keeps one CTA; ctas_per_token sets the count (at most one CTA per item).
    // A head is D / 16 NeoX units of 16-byte vectors for 2-byte elements, D / 8 for float32.
    const int64_t units = pc.D / (pc.dtype == DType::Float32 ? 8 : 16);
    const int64_t items = want_kv + (pc.Hq * units + 32 * want_q - 1) / (32 * want_q);
    const bool split = (pc.fp8_pool && pc.T <= 256) || ((pc.fp8_q || pc.split_plain) && pc.T <= 128);
    const int64_t want_ctas = pc.ctas_per_token ? std::min<int64_t>(pc.ctas_per_token, items)
                              : split              ? (items + 1) / 2
                                                   : 1;
    if (ctas != want_ctas) {
      ++bad;
      first = "plan spread a token over " + std::to_string(ctas) + " CTA(s), expected " +
              std::to_string(want_ctas) + (first.empty() ? "" : "; " + first);
    }
  }
  if (pc.expect_path >= 0 && !pc.norm && int(path) != pc.expect_path) {
    ++bad;
    first = std::string("plan chose the ") + path_name(path) + " path, expected " + path_name(Path(pc.expect_path)) +
            (first.empty() ? "" : "; " + first);
  }
  ++g_pool_cases;
  expect(bad == 0, what + ": " + std::to_string(bad) + " bad; first: " + first);
  if (pc.norm)  // a norm kernel (the main kernel's variant or a fusion kernel), same pool variants
    std::printf("  %-4s norm   v%d     %s\n", bad == 0 ? "ok" : "FAIL", variant, what.c_str());
  else
    std::printf("  %-4s %-6s v%d %dw%s%s%s  %s\n", bad == 0 ? "ok" : "FAIL", path_name(path), variant, warps,
                kv_items == 2 ? " kv2" : "", q_units != 4 && !head ? " q2" : "", head ? " head" : "", what.c_str());
}

void test_paged_layouts(Rng& rng) {
  std::printf("paged pools (NHD, HND) in q's dtype:\n");
  for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32})
    for (Cache cache : {Cache::NHD, Cache::HND})
      for (int64_t ps : {1, 5, 16, 64, 256}) {
        if (g_sanitize && (dt != DType::BFloat16 || (ps != 5 && ps != 16))) continue;
        PoolCase c;
        c.dtype = dt, c.cache = cache, c.page_size = ps, c.T = 37, c.index64 = ps == 5;
        run_pool_case(c, rng, "paged");
        if (dt == DType::BFloat16 && !g_sanitize) {
          for (int64_t T : {int64_t(1), int64_t(300)}) {  // one token; lock mode (T > 256)
            PoolCase d = c;
            d.T = T, d.Hq = 8, d.Hk = 4;
            run_pool_case(d, rng, "paged");
          }
          if (ps == 16 || ps == 5) {
            PoolCase d = c;
            d.claimed_pool_size = ps * (int64_t(1) << 31);  // 64-bit page division (ps 5)
            run_pool_case(d, rng, "paged");
            d = c;
            d.kernel = Kernel::OneWarp;
            run_pool_case(d, rng, "paged");
            for (auto [D, R, il] : {std::tuple{80, 0, false}, {34, 0, false}, {64, 32, true}, {128, 64, false}}) {
              d = c;
              d.D = D, d.R = R, d.interleaved = il, d.Hq = 5, d.Hk = 3;
              run_pool_case(d, rng, "paged");
            }
          }
        }
      }
  // The planner: a paged pool in q's dtype (page size > 1, head_dim 128 tuned) runs the
  // uncapped kernel up to T = 256 with one CTA per token, the capped one beyond (and where
  // LaunchConfig::uncapped = -1); a 3-D pool the seed's kernel.
  for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32})
    for (Cache cache : {Cache::Pool3D, Cache::NHD, Cache::HND})
      for (int64_t T : {int64_t(1), int64_t(37), int64_t(256), int64_t(300)})
        for (bool capped : {false, true}) {
          if (g_sanitize && (dt != DType::BFloat16 || T > 37 || capped)) continue;
          if (capped && (cache == Cache::Pool3D || T > 256)) continue;
          PoolCase c;
          c.dtype = dt, c.cache = cache, c.page_size = cache == Cache::HND ? 64 : 16, c.T = T;
          c.Hq = 32, c.Hk = 8, c.D = 128, c.capped = capped;
          c.expect_uncapped = cache != Cache::Pool3D && T <= 256 && !capped;
          run_pool_case(c, rng, "paged");
        }
  // Pools in q's dtype on the uncapped kernel (LaunchConfig::split_plain, forced only): a 3-D
  // pool as page size 1 and paged ones, a token's items over the default, one and three CTAs,
  // in the scan, direct and (T = 300) row-lock write modes.
  for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32})
    for (Cache cache : {Cache::Pool3D, Cache::NHD, Cache::HND})
      for (int64_t T : {int64_t(1), int64_t(37), int64_t(128), int64_t(300)})
        for (int ctas : {0, 1, 3}) {
          if (g_sanitize && (dt != DType::BFloat16 || T > 37 || ctas == 1)) continue;
          PoolCase c;
          c.dtype = dt, c.cache = cache, c.page_size = cache == Cache::HND ? 64 : 16, c.T = T;
          c.Hq = 32, c.Hk = 8, c.D = 128, c.split_plain = true, c.ctas_per_token = ctas;
          c.expect_uncapped = 1;
          run_pool_case(c, rng, "paged");
        }
}

void test_combined_caches(Rng& rng) {
  std::printf("layers of stacked caches and the K/V halves of combined caches:\n");
  for (bool fp8 : {false, true})
    for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32})
      for (Cache cache : {Cache::Stack3D, Cache::StackNHD, Cache::Vllm, Cache::FlashNHD, Cache::FlashHND})
        for (int64_t ps : {1, 16, 5}) {
          if ((cache == Cache::Stack3D) != (ps == 1) && !(ps == 1 && cache == Cache::FlashNHD)) continue;
          if (g_sanitize && (dt != DType::BFloat16 || ps == 5)) continue;
          if (dt != DType::BFloat16 && ps == 5) continue;
          PoolCase c;
          c.dtype = dt, c.cache = cache, c.page_size = ps, c.T = 45, c.Hq = 6, c.Hk = 2;
          c.fp8_pool = fp8, c.k_scale = 0.25f, c.v_scale = 0.0375f;
          run_pool_case(c, rng, "cache");
        }
}

void test_fp8_pools(Rng& rng) {
  std::printf("fp8 e4m3 pools (k_scale / v_scale as values and as device pointers):\n");
  struct S {
    float ks, vs;
    bool ptrs, specials;
  };
  for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32}) {
    for (Cache cache : {Cache::Pool3D, Cache::NHD, Cache::HND})
      for (S s : {S{1.0f, 1.0f, false, true}, S{0.0375f, 0.3f, false, false}, S{0.004f, 0.0625f, true, true},
                  S{3.0f, 1.0f / 3.0f, true, false}}) {
        if (g_sanitize && (dt != DType::BFloat16 || !s.ptrs)) continue;
        PoolCase c;
        c.dtype = dt, c.cache = cache, c.page_size = cache == Cache::HND ? 64 : 16;
        c.fp8_pool = true, c.k_scale = s.ks, c.v_scale = s.vs, c.scale_ptrs = s.ptrs, c.specials = s.specials;
        run_pool_case(c, rng, "fp8");
      }
    if (dt == DType::BFloat16) {  // the uncapped kernel with a token over 3 CTAs, under compute-sanitizer too
      PoolCase c;
      c.dtype = dt, c.cache = Cache::NHD, c.page_size = 16, c.T = 3, c.Hq = 32, c.Hk = 8, c.D = 128;
      c.fp8_pool = true, c.fp8_q = true, c.k_scale = 0.0375f, c.v_scale = 0.3f, c.q_scale = 0.07f;
      c.ctas_per_token = 3, c.expect_uncapped = 1;
      run_pool_case(c, rng, "fp8");
    }
    // The default split of fp8-pool calls at T = 129-256 (one CTA per token with an fp8 q_rot
    // alone), Llama-3-8B's heads.
    for (int64_t T : {129, 256})
      for (int fp8 : {1, 2, 3}) {  // bit 0: fp8 pools, bit 1: fp8 q_rot
        if (g_sanitize && T != 256) continue;
        PoolCase c;
        c.dtype = dt, c.cache = fp8 == 2 ? Cache::Pool3D : Cache::NHD, c.page_size = 16, c.T = T;
        c.Hq = 32, c.Hk = 8, c.D = 128, c.expect_uncapped = dt == DType::Float32 ? -1 : 1;
        c.fp8_pool = fp8 & 1, c.k_scale = 0.0375f, c.v_scale = 0.3f, c.scale_ptrs = T == 256;
        c.fp8_q = fp8 & 2, c.q_scale = 0.07f;
        run_pool_case(c, rng, "fp8");
      }
    if (g_sanitize) continue;
    // Every path and launch shape, scale values that are not powers of two.
    PoolCase base;
    base.dtype = dt, base.cache = Cache::NHD, base.page_size = 16, base.fp8_pool = true;
    base.k_scale = 0.0375f, base.v_scale = 0.07f, base.specials = true, base.Hq = 5, base.Hk = 3;
    for (auto [D, R, il] : {std::tuple{80, 0, false}, {34, 0, false}, {64, 32, true}, {128, 64, false},
                            {34, 0, true}, {256, 0, false}, {96, 0, false}}) {
      PoolCase c = base;
      c.D = D, c.R = R, c.interleaved = il;
      run_pool_case(c, rng, "fp8");
    }
    for (Kernel k : {Kernel::OneWarp, Kernel::TwoWarps}) {
      PoolCase c = base;
      c.kernel = k, c.Hq = 32, c.Hk = 8;
      run_pool_case(c, rng, "fp8");
    }
    // Llama's shape at T = 1 and in scan mode, every launch shape, with an fp8 q_out and
    // without: the k and v heads on items of their own, and on one (what T > 256 uses).
    for (Kernel k : {Kernel::Auto, Kernel::OneWarp, Kernel::TwoWarps})
      for (int64_t T : {int64_t(1), int64_t(37)})
        for (bool no_split : {true, false})
          for (bool fp8_q : {false, true}) {
            PoolCase c = base;
            c.kernel = k, c.T = T, c.Hq = 32, c.Hk = 8, c.D = 128, c.no_split = no_split, c.scale_ptrs = !no_split;
            c.fp8_q = fp8_q, c.q_scale = 0.07f;
            run_pool_case(c, rng, "fp8");
          }
    for (int64_t T : {int64_t(1), int64_t(300)}) {
      PoolCase c = base;
      c.T = T, c.cache = Cache::HND, c.page_size = 5;
      run_pool_case(c, rng, "fp8");
    }
    // The fp8 kernels at T <= 128, without the register cap (the default) and with it
    // (LaunchConfig::uncapped = -1): Llama's shape, an fp8 pool and/or an fp8 q_out,
    // power-of-two scales and not.
    for (int64_t T : {int64_t(1), int64_t(37), int64_t(128)})
      for (int fp8 : {1, 2, 3})
        for (bool pow2 : {false, true})
          for (bool capped : {false, true}) {
            PoolCase c = base;
            c.T = T, c.Hq = 32, c.Hk = 8, c.D = 128, c.capped = capped, c.expect_uncapped = !capped;
            c.fp8_pool = fp8 & 1, c.fp8_q = fp8 & 2, c.q_scale = pow2 ? 0.5f : 0.07f;
            if (pow2) c.k_scale = 0.25f, c.v_scale = 1.0f;
            if (!c.fp8_pool) c.cache = Cache::Pool3D;
            run_pool_case(c, rng, "fp8");
          }
    // Beyond T = 256 the default is the capped kernel; LaunchConfig::uncapped = 1 runs the
    // uncapped one at any T: the scan (T <= 256) and the row-lock (T > 256) write modes.
    for (int64_t T : {int64_t(129), int64_t(256), int64_t(300)})
      for (int fp8 : {1, 3})
        for (bool pow2 : {false, true})
          for (bool forced : {false, true}) {
            PoolCase c = base;
            c.T = T, c.Hq = 32, c.Hk = 8, c.D = 128, c.forced_uncapped = forced, c.expect_uncapped = forced || T <= 256;
            c.fp8_pool = fp8 & 1, c.fp8_q = fp8 & 2, c.q_scale = pow2 ? 0.5f : 0.07f;
            if (pow2) c.k_scale = 0.25f, c.v_scale = 1.0f;
            c.cache = Cache::NHD, c.page_size = 16;
            run_pool_case(c, rng, "fp8");
          }
    // The uncapped kernel with a token's items over a given number of CTAs
    // (LaunchConfig::ctas_per_token) and q items of 1 or 2 units (fp8_q_units).
    for (int64_t T : {int64_t(1), int64_t(37), int64_t(128)})
      for (int fp8 : {1, 2, 3})
        for (int ctas : {1, 2, 5})
          for (int q_units : {0, 1}) {
            if (q_units && !(fp8 & 2)) continue;
            PoolCase c = base;
            c.T = T, c.Hq = 32, c.Hk = 8, c.D = 128, c.expect_uncapped = 1;
            c.ctas_per_token = ctas, c.fp8_q_units = q_units;
            c.fp8_pool = fp8 & 1, c.fp8_q = fp8 & 2, c.q_scale = ctas == 2 ? 0.5f : 0.07f;
            if (ctas == 2) c.k_scale = 0.25f, c.v_scale = 1.0f;
            c.cache = fp8 & 1 ? Cache::NHD : Cache::Pool3D, c.page_size = 16;
            run_pool_case(c, rng, "fp8");
          }
  }
}

void test_fp8_q_out(Rng& rng) {
  std::printf("fp8 q_out (q_scale), with pools in q's dtype and in fp8:\n");
  for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32})
    for (bool fp8_pool : {false, true})
      for (auto [D, R, il] : {std::tuple{128, 0, false}, {34, 0, false}, {64, 32, true}, {80, 0, false}}) {
        if (g_sanitize && (dt != DType::BFloat16 || D != 128)) continue;
        PoolCase c;
        c.dtype = dt, c.D = D, c.R = R, c.interleaved = il, c.Hq = 8, c.Hk = 2;
        c.cache = fp8_pool ? Cache::NHD : Cache::Pool3D, c.page_size = 16;
        c.fp8_pool = fp8_pool, c.k_scale = 0.5f, c.v_scale = 0.11f;
        c.fp8_q = true, c.q_scale = D == 34 ? 0.004f : 0.05f, c.scale_ptrs = D != 128, c.specials = il;
        run_pool_case(c, rng, "q8");
        if (D == 128 && !g_sanitize) {  // the lock mode's launch (T > 256), Llama's heads
          c.T = 300, c.Hq = 32, c.Hk = 8;
          run_pool_case(c, rng, "q8");
        }
      }
}

void test_pool_alignment(Rng& rng) {
  std::printf("vector-path eligibility from the pools' strides and base:\n");
  struct A {
    DType dt;
    bool fp8;
    Cache cache;
    int64_t pad, base_off;
    Path want;
  };
  // bf16: 16-byte accesses of its pools, 8-byte ones of fp8 pools; float32 fp8: 4-byte ones.
  for (A a : {A{DType::BFloat16, false, Cache::NHD, 8, 0, Path::Tuned},   // 272-byte head stride
              A{DType::BFloat16, false, Cache::NHD, 1, 0, Path::Scalar},  // 258
              A{DType::BFloat16, false, Cache::HND, 4, 0, Path::Scalar},  // row stride 264
              A{DType::BFloat16, false, Cache::NHD, 0, 2, Path::Scalar},  // base off by 2 bytes
              A{DType::BFloat16, true, Cache::NHD, 8, 0, Path::Tuned},    // 136 = 17 x 8
              A{DType::BFloat16, true, Cache::HND, 4, 0, Path::Scalar},   // 132
              A{DType::BFloat16, true, Cache::NHD, 0, 8, Path::Tuned},
              A{DType::BFloat16, true, Cache::FlashHND, 0, 4, Path::Scalar},
              A{DType::Float32, true, Cache::NHD, 4, 4, Path::Tuned},     // 4-byte accesses
              A{DType::Float32, true, Cache::HND, 1, 0, Path::Scalar},
              A{DType::Float16, false, Cache::Pool3D, 0, 16, Path::Tuned},
              A{DType::Float16, true, Cache::Vllm, 3, 0, Path::Scalar}}) {
    if (g_sanitize && a.dt != DType::BFloat16) continue;
    PoolCase c;
    c.dtype = a.dt, c.fp8_pool = a.fp8, c.cache = a.cache, c.pad = a.pad, c.base_off = a.base_off;
    c.k_scale = 0.125f, c.v_scale = 0.09f, c.expect_path = int(a.want);
    run_pool_case(c, rng, "align");
  }
}

/// SPEC §3 with paged pools: out-of-range slots (pool size pages * page_size) skipped and
/// reported; duplicate slots keep whole rows (scan: the last token; locks: one of them).
void test_paged_slots(Rng& rng) {
  std::printf("slot errors and duplicate slots with paged pools:\n");
  for (int run_head : {0, 1})  // the head kernel too (LaunchConfig::head_kernel; head_dim 128)
  for (bool fp8 : {false, true}) {
    PoolCase c;
    c.T = 40, c.cache = fp8 ? Cache::HND : Cache::NHD, c.page_size = fp8 ? 5 : 16, c.pages = 3;
    c.fp8_pool = fp8, c.k_scale = 0.5f, c.v_scale = 0.25f;
    if (run_head) c.Hq = 32, c.Hk = 8, c.D = 128, c.head_kernel = 1;
    const int64_t P = 3 * c.page_size;
    c.slots.resize(size_t(c.T));
    for (int64_t t = 0; t < c.T; ++t) c.slots[size_t(t)] = t < P ? P - 1 - t : -1;
    c.slots[7] = P;  // == pool size
    c.slots[11] = 1000;
    PoolRun run(c, rng);
    run.launch();
    ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
    std::string first;
    const int64_t bad = run.check(first);
    expect(bad == 0, std::string("out-of-range slots skipped, paged ") + (fp8 ? "fp8" : "bf16") + ": " + first);
    const std::string m = catch_message<BackendError>([] { cuda_check_slot_errors(); });
    const std::string pool = "pool of " + std::to_string(P) + " slots";
    const bool named = m.find("slots[7] = " + std::to_string(P) + " ") != std::string::npos ||
                       m.find("slots[11] = 1000 ") != std::string::npos;
    expect(named && m.find(pool) != std::string::npos, "paged pool: bad slot reported with " + pool + ": " + m);
    std::printf("  %-4s out-of-range slots, %s pages=3 ps=%lld (%s%s): %s\n", bad == 0 && named ? "ok" : "FAIL",
                cache_name(c.cache), (long long)c.page_size, fp8 ? "fp8" : "bf16", run_head ? ", head kernel" : "",
                m.substr(0, 90).c_str());
  }
  {  // lock mode (T > 256) with a bad slot
    PoolCase c;
    c.T = 600, c.cache = Cache::FlashNHD, c.page_size = 16, c.fp8_pool = true, c.k_scale = 0.3f, c.v_scale = 0.2f;
    c.pages = 80;
    c.slots.resize(size_t(c.T));
    for (int64_t t = 0; t < c.T; ++t) c.slots[size_t(t)] = 2 * t;
    c.slots[555] = 80 * 16;
    PoolRun run(c, rng);
    run.launch();
    ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
    std::string first;
    const int64_t bad = run.check(first);
    const std::string m = catch_message<BackendError>([] { cuda_check_slot_errors(); });
    const bool named = m.find("slots[555] = 1280 out of range for a pool of 1280 slots") != std::string::npos;
    expect(bad == 0 && named, "lock mode, paged fp8: bad slot skipped and reported: " + first + " | " + m);
    std::printf("  %-4s lock mode out-of-range slot, %s: %s\n", bad == 0 && named ? "ok" : "FAIL",
                cache_name(c.cache), m.substr(0, 90).c_str());
  }
  for (bool fp8 : {false, true})
    for (auto [T, kernel, run_head] : {std::tuple{int64_t(200), Kernel::Auto, 0}, {int64_t(600), Kernel::OneWarp, 0},
                                       {int64_t(4096), Kernel::Auto, 0}, {int64_t(200), Kernel::Auto, 1},
                                       {int64_t(40), Kernel::TwoWarps, 1}, {int64_t(256), Kernel::Auto, 1}}) {
      if (g_sanitize && T > 600) continue;
      PoolCase c;
      c.dtype = fp8 ? DType::Float32 : DType::BFloat16;  // float32: fp8 k rows are exact too
      c.T = T, c.Hq = 4, c.Hk = 8, c.cache = Cache::HND, c.page_size = 3, c.pages = 4, c.kernel = kernel;
      if (run_head) c.D = 128, c.head_kernel = 1;  // the head kernel: head_dim 128
      c.fp8_pool = fp8, c.k_scale = 0.1f, c.v_scale = 0.15f, c.index64 = fp8;
      c.slots.resize(size_t(T));
      for (int64_t t = 0; t < T; ++t) c.slots[size_t(t)] = (3 * t) % 11;  // 11 of 12 slots
      for (int rep = 0; rep < (g_sanitize ? 1 : 2); ++rep) {
        PoolRun run(c, rng);
        run.launch();
        ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
        std::string first;
        int64_t bad = run.check(first);
        if (T <= 256) {  // scan mode: the last writer's row, checked by its v row
          const auto now = run.vbuf->now();
          for (int64_t s = 0; s < 11; ++s) {
            int64_t last = -1;
            for (int64_t t = 0; t < T; ++t)
              if (c.slots[size_t(t)] == s) last = t;
            bool same = true;
            for (int64_t h = 0; h < c.Hk && same; ++h)
              for (int64_t d = 0; d < c.D && same; ++d) {
                const size_t at = PoolBuffer::kGuard + size_t(run.g.v_origin + (s / 3) * run.g.page_stride +
                                                              (s % 3) * run.g.row_stride + h * run.g.head_stride + d) *
                                                           run.pes;
                const void* vin = element(run.pr->host.v, last, h, d);
                const uint8_t want_fp8 = float_to_e4m3(bits_to_float(bits_at(vin, run.es), c.dtype) / c.v_scale);
                same = fp8 ? now[at] == want_fp8 : std::memcmp(&now[at], vin, run.es) == 0;
              }
            if (!same) {
              ++bad;
              if (first.empty()) first = "slot " + std::to_string(s) + " does not hold the last token's row";
            }
          }
        }
        const std::string what = std::string("duplicate slots, paged ") + (fp8 ? "fp8" : "bf16") +
                                 " T=" + std::to_string(T) + " " + kernel_name(kernel) +
                                 (run_head ? " head kernel" : "");
        expect(bad == 0, what + ": " + first);
        std::printf("  %-4s %s\n", bad == 0 ? "ok" : "FAIL", what.c_str());
      }
    }
}

/// A captured graph reads the scales when it runs: replay, change the device floats, replay. The
/// main kernel, and the fusion kernel (SPEC §7 norm).
void test_graph_scales(Rng& rng, int norm, int head_kernel = 0) {
  std::printf("CUDA graph: scale pointers changed between two replays%s:\n",
              norm ? " (QK norm)" : head_kernel < 0 ? " (the token kernel)" : "");
  PoolCase c;
  c.T = 64, c.Hq = 32, c.Hk = 8, c.cache = Cache::FlashNHD, c.page_size = 16;
  c.fp8_pool = true, c.fp8_q = true, c.scale_ptrs = true, c.norm = norm, c.head_kernel = head_kernel;
  PoolRun run(c, rng);
  run.set_scales(0.5f, 0.25f, 0.125f);
  cudaStream_t s;
  ROPEPOOL_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  run.prob.stream = s;
  run.launch();  // warm-up outside capture
  ROPEPOOL_CUDA_OK(cudaStreamSynchronize(s));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  ROPEPOOL_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const std::string m = catch_message<std::exception>([&] { run.launch(); });
  ROPEPOOL_CUDA_OK(cudaStreamEndCapture(s, &g));
  expect(m.empty(), "capture (fp8 pools, scale pointers): " + m);
  ROPEPOOL_CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
  for (auto [ks, vs, qs] : {std::tuple{0.5f, 0.25f, 0.125f}, {0.0125f, 0.03f, 0.02f}}) {
    run.set_scales(ks, vs, qs);  // the device floats the graph reads
    ROPEPOOL_CUDA_OK(cudaMemset(run.q8->ptr, 0xff, run.q8->bytes));
    ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());  // both done before the replay on `s`
    ROPEPOOL_CUDA_OK(cudaGraphLaunch(ge, s));
    ROPEPOOL_CUDA_OK(cudaStreamSynchronize(s));
    std::string first;
    const int64_t bad = run.check(first);
    const std::string what = "graph replay with k_scale " + std::to_string(ks) + ", v_scale " + std::to_string(vs) +
                             ", q_scale " + std::to_string(qs);
    expect(bad == 0, what + ": " + first);
    std::printf("  %-4s %s\n", bad == 0 ? "ok" : "FAIL", what.c_str());
  }
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
}
void test_graph_scales(Rng& rng) {
  for (int norm : {0, 1}) test_graph_scales(rng, norm);
  test_graph_scales(rng, 0, -1);  // T = 64 with fp8 pools: the head kernel by default, so the token kernel too
}

/// SPEC §7 x §6: the QK norm (the fusion kernel) with paged NHD/HND pools, fp8 pools and an
/// fp8 q_out, each case checked as the others here (every byte of the cache allocations, guards
/// included; fp8 k within one e4m3 step of the exact rotated normalised value, up to SPEC §7's
/// midpoint ulp; v bit-exact), with mRoPE, the K/V halves of combined caches, SPEC §3's slot
/// rules (out-of-range slots skipped and reported, duplicates keep whole rows).
void test_norm_caches(Rng& rng) {
  std::printf("QK norm (SPEC §7) with paged and fp8 caches and an fp8 q_out:\n");
  for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32})
    for (Cache cache : {Cache::NHD, Cache::HND})
      for (int64_t ps : {1, 16, 64})
        for (bool fp8_pool : {false, true})
          for (bool fp8_q : {false, true}) {
            if (g_sanitize && (dt != DType::BFloat16 || ps == 64)) continue;
            PoolCase c;
            c.dtype = dt, c.cache = cache, c.page_size = ps, c.T = 37, c.Hq = 8, c.Hk = 2;
            c.norm = ps == 16 ? 2 : 1;  // "gemma" (float32 weights) at page size 16
            c.index64 = ps == 64;
            c.fp8_pool = fp8_pool, c.k_scale = 0.5f, c.v_scale = 0.11f;
            c.fp8_q = fp8_q, c.q_scale = 0.05f, c.scale_ptrs = cache == Cache::HND;
            c.padded_heads = fp8_pool && !fp8_q;
            run_pool_case(c, rng, "norm");
          }
  if (!g_sanitize) {
    for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32}) {
      PoolCase base;
      base.dtype = dt, base.cache = Cache::NHD, base.page_size = 16, base.Hq = 5, base.Hk = 3, base.norm = 1;
      base.fp8_pool = true, base.k_scale = 0.0375f, base.v_scale = 0.07f;
      base.fp8_q = true, base.q_scale = 0.02f;
      // The norm runs over the whole head, the rotation over rotary_dim: partial rotary, GPT-J
      // pairs, head sizes that are not multiples of 32.
      for (auto [D, R, il] : {std::tuple{80, 0, false}, {34, 0, false}, {64, 32, true}, {128, 64, false},
                              {34, 0, true}, {256, 0, false}, {96, 0, false}}) {
        PoolCase c = base;
        c.D = D, c.R = R, c.interleaved = il, c.norm = D == 256 ? 2 : 1;
        run_pool_case(c, rng, "norm");
      }
      // NaN in q and k heads (the whole head's norm is NaN), Inf, huge, tiny and ties in v.
      for (bool fp8 : {false, true}) {
        PoolCase c = base;
        c.specials = true, c.fp8_pool = c.fp8_q = fp8, c.cache = Cache::HND, c.page_size = 64;
        run_pool_case(c, rng, "norm");
      }
      // One of q and k normalised; the other rotated as without a norm.
      for (int sides : {1, 2}) {
        PoolCase c = base;
        c.norm_sides = sides, c.norm = sides;
        run_pool_case(c, rng, "norm");
      }
      // mRoPE (Qwen2-VL sections; Qwen3-VL interleaved, which normalises q and k too).
      for (int mrope : {1, 2})
        for (bool fp8 : {false, true}) {
          PoolCase c = base;
          c.mrope = mrope, c.fp8_pool = c.fp8_q = fp8, c.cache = mrope == 2 ? Cache::HND : Cache::NHD;
          c.D = 128, c.Hq = 8, c.Hk = 2, c.index64 = mrope == 2;
          run_pool_case(c, rng, "norm");
        }
    }
    // Page sizes beyond a power of two (the division), 256, and the 64-bit page division.
    for (int64_t ps : {5, 256}) {
      PoolCase c;
      c.cache = ps == 5 ? Cache::HND : Cache::NHD, c.page_size = ps, c.norm = 1, c.Hq = 6, c.Hk = 2;
      c.fp8_pool = ps == 5, c.k_scale = 0.25f, c.v_scale = 0.5f;
      run_pool_case(c, rng, "norm");
      c.claimed_pool_size = ps * (int64_t(1) << 31);
      run_pool_case(c, rng, "norm");
    }
    // The K/V halves of combined caches, layers of stacked caches, padded rows.
    for (bool fp8 : {false, true})
      for (Cache cache : {Cache::Stack3D, Cache::StackNHD, Cache::Vllm, Cache::FlashNHD, Cache::FlashHND}) {
        PoolCase c;
        c.cache = cache, c.page_size = cache == Cache::Stack3D ? 1 : 16, c.T = 45, c.Hq = 6, c.Hk = 2;
        c.norm = fp8 ? 2 : 1, c.pad = cache == Cache::Vllm ? 3 : 0;
        c.fp8_pool = fp8, c.k_scale = 0.25f, c.v_scale = 0.0375f;
        run_pool_case(c, rng, "norm");
      }
    // One token (no lock), many (locks), both kinds of pools.
    for (int64_t T : {int64_t(1), int64_t(300)})
      for (bool fp8 : {false, true}) {
        PoolCase c;
        c.T = T, c.Hq = 8, c.Hk = 4, c.cache = Cache::HND, c.page_size = 16, c.norm = 1;
        c.fp8_pool = c.fp8_q = fp8, c.k_scale = 0.125f, c.v_scale = 0.3f, c.q_scale = 0.07f;
        run_pool_case(c, rng, "norm");
      }
  }

  // SPEC §3: out-of-range slots skipped (their q_rot/k_rot still written) and reported.
  for (bool fp8 : {false, true}) {
    PoolCase c;
    c.T = 40, c.cache = fp8 ? Cache::HND : Cache::NHD, c.page_size = fp8 ? 5 : 16, c.pages = 3, c.norm = 1;
    c.fp8_pool = fp8, c.fp8_q = fp8, c.k_scale = 0.5f, c.v_scale = 0.25f, c.q_scale = 0.1f;
    const int64_t P = 3 * c.page_size;
    c.slots.resize(size_t(c.T));
    for (int64_t t = 0; t < c.T; ++t) c.slots[size_t(t)] = t < P ? P - 1 - t : -1 - t % 3;
    c.slots[7] = P;  // == pool size
    c.slots[11] = 1000;
    PoolRun run(c, rng);
    run.launch();
    ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
    std::string first;
    const int64_t bad = run.check(first);
    const std::string m = catch_message<BackendError>([] { cuda_check_slot_errors(); });
    const std::string pool = "pool of " + std::to_string(P) + " slots";
    const bool named = m.find("slots[7] = " + std::to_string(P) + " ") != std::string::npos ||
                       m.find("slots[11] = 1000 ") != std::string::npos;
    expect(bad == 0, std::string("norm: out-of-range slots skipped, ") + (fp8 ? "fp8" : "bf16") + ": " + first);
    expect(named && m.find(pool) != std::string::npos, "norm: bad slot reported with " + pool + ": " + m);
    std::printf("  %-4s norm, out-of-range slots, %s pages=3 ps=%lld (%s): %s\n",
                bad == 0 && named ? "ok" : "FAIL", cache_name(c.cache), (long long)c.page_size,
                fp8 ? "fp8" : "bf16", m.substr(0, 90).c_str());
  }
  // Duplicate slots: each row one token's complete k and v row (the row lock).
  for (bool fp8 : {false, true})
    for (int64_t T : {int64_t(200), int64_t(2048)}) {
      if (g_sanitize && T > 200) continue;
      PoolCase c;
      c.dtype = fp8 ? DType::Float32 : DType::BFloat16;  // float32: fp8 k rows are exact too
      c.T = T, c.Hq = 4, c.Hk = 8, c.cache = Cache::HND, c.page_size = 3, c.pages = 4, c.norm = fp8 ? 2 : 1;
      c.fp8_pool = fp8, c.k_scale = 0.1f, c.v_scale = 0.15f, c.index64 = fp8;
      c.slots.resize(size_t(T));
      for (int64_t t = 0; t < T; ++t) c.slots[size_t(t)] = (3 * t) % 11;  // 11 of 12 slots
      run_pool_case(c, rng, "norm dup");
    }
}

// ---- the e4m3 conversion itself, on every float32 ------------------------------------------

/// Thresholds of ropepool::float_to_e4m3 on magnitudes: thr[c] (c = 1..126) is the smallest
/// float32 bit pattern (sign clear) that converts to code c; thr[127] = +Inf + 1 (NaN).
std::vector<uint32_t> e4m3_thresholds(std::string& problem) {
  std::vector<uint32_t> thr(128, 0);
  for (int code = 1; code <= 126; ++code) {
    uint32_t lo = 0, hi = 0x7f800000u;  // f(hi) = 126 >= code; find the first a with f(a) >= code
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2;
      if (float_to_e4m3(bits_float(mid)) >= code) hi = mid;
      else lo = mid + 1;
    }
    thr[size_t(code)] = lo;
    if (float_to_e4m3(bits_float(lo)) != code || float_to_e4m3(bits_float(lo - 1)) != code - 1)
      problem = "float_to_e4m3 is not a step function at code " + std::to_string(code);
  }
  thr[127] = 0x7f800001u;
  return thr;
}

__device__ __forceinline__ uint32_t e4m3_expected(uint32_t u, const uint32_t* thr) {
  const uint32_t a = u & 0x7fffffffu, sign = (u >> 24) & 0x80u;
  if (a > 0x7f800000u) return sign | 0x7fu;
  uint32_t lo = 0, hi = 127;  // number of thresholds thr[1..126] <= a
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) / 2;
    if (thr[mid] <= a) lo = mid;
    else hi = mid - 1;
  }
  return sign | lo;
}

/// Converts every float32 (as x / 1.0f) with the kernel's helpers and counts disagreements
/// with the thresholds of float_to_e4m3. kind: 0 e4m3_quotient<1>, 1 <2>, 2 <4>, 3 Fp8IO<8>,
/// 4 the software e4m3_soft, 5 Fp8IO<8> with the power-of-two product (scale 1).
__global__ void e4m3_every_float(const uint32_t* thr_g, int kind, uint64_t begin, uint64_t end,
                                 unsigned long long* mismatches, unsigned* first_bad) {
  __shared__ uint32_t thr[128];
  for (int i = threadIdx.x; i < 128; i += blockDim.x) thr[i] = thr_g[i];
  __syncthreads();
  const cuda::Fp8Divisor one = cuda::fp8_divisor(1.0f);
  for (uint64_t base = begin + (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8; base < end;
       base += uint64_t(gridDim.x) * blockDim.x * 8) {
    float f[8];
    for (int i = 0; i < 8; ++i) f[i] = __uint_as_float(uint32_t(base + i));
    uint32_t got[8];
    if (kind == 0) {
      for (int i = 0; i < 8; ++i) got[i] = cuda::e4m3_quotient<1>(f + i, one);
    } else if (kind == 1) {
      for (int i = 0; i < 8; i += 2) {
        const uint32_t w = cuda::e4m3_quotient<2>(f + i, one);
        got[i] = w & 0xff, got[i + 1] = w >> 8;
      }
    } else if (kind == 2) {
      for (int i = 0; i < 8; i += 4) {
        const uint32_t w = cuda::e4m3_quotient<4>(f + i, one);
        for (int j = 0; j < 4; ++j) got[i + j] = (w >> (8 * j)) & 0xff;
      }
    } else if (kind == 3 || kind == 5) {
      float v[8];
      for (int i = 0; i < 8; ++i) v[i] = f[i];
      const uint2 w = kind == 5 ? cuda::Fp8IO<8>::quantize<true>(v, one) : cuda::Fp8IO<8>::quantize(v, one);
      for (int j = 0; j < 4; ++j) got[j] = (w.x >> (8 * j)) & 0xff, got[4 + j] = (w.y >> (8 * j)) & 0xff;
    } else {
      for (int i = 0; i < 8; ++i) got[i] = cuda::e4m3_soft(f[i]);
    }
    for (int i = 0; i < 8; ++i) {
      const uint32_t u = uint32_t(base + i);
      if (got[i] != e4m3_expected(u, thr)) {
        const unsigned long long n = atomicAdd(mismatches, 1ull);
        if (n < 4) first_bad[2 * n] = u, first_bad[2 * n + 1] = got[i];
      }
    }
  }
}

/// x[i] / scales[i / per_scale] with the kernel's helpers (8 at a time: Fp8IO<8>; one at a time:
/// e4m3_quotient<1>), for the host's float_to_e4m3(x / scale).
__global__ void e4m3_quotients(const float* x, const float* scales, int per_scale, size_t n, uint8_t* out8,
                               uint8_t* out1) {
  for (size_t g = blockIdx.x * size_t(blockDim.x) + threadIdx.x; g < n / 8; g += size_t(gridDim.x) * blockDim.x) {
    const cuda::Fp8Divisor d = cuda::fp8_divisor(scales[g * 8 / size_t(per_scale)]);
    float v[8];
    for (int i = 0; i < 8; ++i) v[i] = x[g * 8 + i];
    const uint2 w = cuda::Fp8IO<8>::quantize(v, d);
    for (int j = 0; j < 4; ++j) out8[g * 8 + j] = (w.x >> (8 * j)) & 0xff, out8[g * 8 + 4 + j] = (w.y >> (8 * j)) & 0xff;
    for (int i = 0; i < 8; ++i) out1[g * 8 + i] = uint8_t(cuda::e4m3_quotient<1>(v + i, d));
  }
}

/// Every float32 x over one scale: the kernels' quotient (fp8_quotient with fp8_divisor) against
/// IEEE division (__fdiv_rn). Counts e4m3 bytes that differ (e4m3_quotient<1> against the
/// conversion of the IEEE quotient with the same sign rule; for a scale that fp8_power_of_two
/// accepts, its product path as well) and, where the quotient decides the e4m3 result
/// (2^-11 <= |x / scale| <= 2^11), float32 quotients that differ in any bit. *power_of_two:
/// what fp8_power_of_two says of the scale.
__global__ void e4m3_division_every_float(float scale, uint64_t begin, uint64_t end, unsigned long long* bad,
                                          unsigned* first_bad, unsigned* power_of_two) {
  const cuda::Fp8Divisor d = cuda::fp8_divisor(scale);
  const bool pow2 = cuda::fp8_power_of_two(d);
  if (blockIdx.x == 0 && threadIdx.x == 0) *power_of_two = pow2;
  for (uint64_t u = begin + uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < end;
       u += uint64_t(gridDim.x) * blockDim.x) {
    const float x = __uint_as_float(uint32_t(u));
    const float want_q = __fdiv_rn(x, scale);
    const uint32_t sign = ((uint32_t(u) ^ __float_as_uint(scale)) >> 31) << 7;
    const uint32_t want = (cuda::e4m3x2(want_q, 0.0f) & 0xffu) | sign;
    const uint32_t got = cuda::e4m3_quotient<1>(&x, d);
    const uint32_t got_product = pow2 ? cuda::e4m3_quotient<1, true>(&x, d) : want;
    const float aq = fabsf(want_q);
    const bool q_differs = aq >= 0x1p-11f && aq <= 2048.0f &&
                           __float_as_uint(cuda::fp8_quotient(x, d)) != __float_as_uint(want_q);
    if (got != want || got_product != want || q_differs) {
      const unsigned long long n = atomicAdd(bad, 1ull);
      if (n == 0) *first_bad = uint32_t(u);
    }
  }
}

void test_e4m3_division(Rng& rng) {
  // Scales of every kind: fp8 calibration values, powers of two, mantissas of all ones, the ends
  // of the normal range, subnormals, and the ones a device tensor could hold by mistake (0,
  // infinities, NaN, negative).
  std::vector<float> scales = {1.0f, 0.5f, 0.25f, 1.0f / 3.0f, 0.0375f, 448.0f / 1e6f, 7.0f, 1.1f,
                               std::nextafter(2.0f, 0.0f), std::nextafter(1.0f, 2.0f), 0x1p-64f, 0x1p64f,
                               0x1.fffffep-65f, 0x1.000002p64f, 1e-30f, 1e30f, FLT_MIN, FLT_MAX,
                               std::nextafter(0.0f, 1.0f), 0x1p-149f, 0x1p-127f, 0x1p127f, 0x1.234p-140f,
                               0x1.fffffcp-127f, 0.0f, -0.0f, INFINITY, -INFINITY, NAN, -0.7f, -2.0f};
  const int extra = g_sanitize ? 0 : 13;
  for (int i = 0; i < extra; ++i) scales.push_back(std::ldexp(1.0f + float(rng.unit()), int(rng.integer(-20, 20))));
  // Under the sanitizer: 2^20 patterns from the e4m3 range up, both signs.
  std::vector<std::pair<uint64_t, uint64_t>> ranges = {{0, uint64_t(1) << 32}};
  if (g_sanitize) ranges = {{0x3a800000u, 0x3a900000u}, {0xbf800000u, 0xbf900000u}};
  DeviceBuffer d_bad(8), d_first(4), d_pow2(4);
  int failing = 0, pow2_wrong = 0, pow2_scales = 0;
  std::string first;
  for (float s : scales) {
    ROPEPOOL_CUDA_OK(cudaMemset(d_bad.ptr, 0, 8));
    ROPEPOOL_CUDA_OK(cudaMemset(d_first.ptr, 0, 4));  // written only on a mismatch
    ROPEPOOL_CUDA_OK(cudaMemset(d_pow2.ptr, 0xff, 4));
    for (auto [b, e] : ranges)
      e4m3_division_every_float<<<4096, 256>>>(s, b, e, static_cast<unsigned long long*>(d_bad.ptr),
                                               static_cast<unsigned*>(d_first.ptr),
                                               static_cast<unsigned*>(d_pow2.ptr));
    const Mismatches m = read_mismatches(d_bad, d_first, 1);
    unsigned pow2 = 0;
    ROPEPOOL_CUDA_OK(cudaMemcpy(&pow2, d_pow2.ptr, 4, cudaMemcpyDeviceToHost));
    int exponent = 0;
    const bool want_pow2 = std::isfinite(s) && s != 0.0f && std::fabs(std::frexp(s, &exponent)) == 0.5f;
    pow2_scales += want_pow2;
    pow2_wrong += pow2 != unsigned(want_pow2);
    if (m.n != 0 && failing++ == 0) {
      char b[160];
      std::snprintf(b, sizeof b, "; first: scale %a, %llu x differ, e.g. x = 0x%08x", double(s), m.n, m.first[0]);
      first = b;
    }
  }
  const std::string what = std::string("x / scale as the kernels divide, against IEEE division on ") +
                           (g_sanitize ? "2 x 2^20" : "every") + " float32 x, " +
                           std::to_string(scales.size()) + " scales (0, inf, NaN, subnormal included): " +
                           std::to_string(failing) + " scales differ" + first;
  expect(failing == 0, what);
  std::printf("  %-4s %s\n", failing == 0 ? "ok" : "FAIL", what.c_str());
  const std::string which = "fp8_power_of_two on the same scales (" + std::to_string(pow2_scales) +
                            " finite nonzero powers of two): " + std::to_string(pow2_wrong) + " wrong";
  expect(pow2_wrong == 0 && pow2_scales >= 8, which);
  std::printf("  %-4s %s\n", pow2_wrong == 0 ? "ok" : "FAIL", which.c_str());
}

void test_e4m3_conversion(Rng& rng) {
  std::printf("e4m3 conversion (SPEC §6 rule) against ropepool::float_to_e4m3:\n");
  std::string problem;
  const std::vector<uint32_t> thr = e4m3_thresholds(problem);
  expect(problem.empty(), "host thresholds: " + problem);
  // The thresholds stand for float_to_e4m3 on the host too: random patterns agree.
  int64_t host_bad = 0;
  for (int i = 0; i < 2000000; ++i) {
    const uint32_t u = uint32_t(rng());
    const uint32_t a = u & 0x7fffffffu;
    uint32_t want = a > 0x7f800000u ? 0x7fu : uint32_t(std::upper_bound(thr.begin() + 1, thr.begin() + 127, a) - (thr.begin() + 1));
    want |= (u >> 24) & 0x80u;
    host_bad += float_to_e4m3(bits_float(u)) != want;
  }
  expect(host_bad == 0, "thresholds reproduce float_to_e4m3 on 2e6 random floats: " + std::to_string(host_bad) + " differ");
  DeviceBuffer d_thr(thr.size() * 4), d_count(8), d_first(64);
  ROPEPOOL_CUDA_OK(cudaMemcpy(d_thr.ptr, thr.data(), thr.size() * 4, cudaMemcpyHostToDevice));
  const uint64_t end = g_sanitize ? (uint64_t(1) << 20) : (uint64_t(1) << 32);
  const char* kinds[] = {"e4m3_quotient<1>", "e4m3_quotient<2>", "e4m3_quotient<4>", "Fp8IO<8>::quantize",
                         "e4m3_soft", "Fp8IO<8>::quantize<true>"};
  for (int kind = 0; kind < 6; ++kind) {
    // Under the sanitizer: the bottom of the range and the e4m3 range (2^-10 .. 2^9), both signs.
    std::vector<std::pair<uint64_t, uint64_t>> ranges = {{0, end}};
    if (g_sanitize) ranges = {{0, end}, {0x3a800000u, 0x3a800000u + end}, {0xc3c00000u, 0xc3c00000u + end}};
    ROPEPOOL_CUDA_OK(cudaMemset(d_count.ptr, 0, 8));
    ROPEPOOL_CUDA_OK(cudaMemset(d_first.ptr, 0, 64));  // written only on a mismatch
    for (auto [b, e] : ranges)
      e4m3_every_float<<<1024, 256>>>(static_cast<uint32_t*>(d_thr.ptr), kind, b, e,
                                      static_cast<unsigned long long*>(d_count.ptr), static_cast<unsigned*>(d_first.ptr));
    const auto [n, first] = read_mismatches(d_count, d_first, 8);
    char b[200];
    std::snprintf(b, sizeof b, "%s on %s float32 patterns: %llu differ from float_to_e4m3%s", kinds[kind],
                  g_sanitize ? "3 x 2^20" : "all 2^32", n, n ? "; first: " : "");
    std::string what = b;
    for (unsigned long long i = 0; i < std::min(n, 4ull); ++i) {
      std::snprintf(b, sizeof b, "0x%08x -> %s (want %s) ", first[2 * i], hex8(uint8_t(first[2 * i + 1])).c_str(),
                    hex8(float_to_e4m3(bits_float(first[2 * i]))).c_str());
      what += b;
    }
    expect(n == 0, what);
    std::printf("  %-4s %s\n", n == 0 ? "ok" : "FAIL", what.c_str());
  }
  // Division: random float32 bit patterns (every class) over scales that are not powers of two.
  const int kScales = 24, per = g_sanitize ? 4096 : 1 << 18;
  std::vector<float> scales = {1.0f / 3.0f, 0.0375f, 3.0f, 0.004f, 7.0f, 448.0f / 1e6f, 1e-3f, 0.1f, 1.1f, 2.0f};
  while (int(scales.size()) < kScales) scales.push_back(std::ldexp(1.0f + float(rng.unit()), int(rng.integer(-12, 12))));
  const size_t n = size_t(kScales) * size_t(per);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    // Mostly values near the e4m3 range, some of any exponent, NaN and Inf.
    uint32_t u = uint32_t(rng());
    if (i % 4 != 0) u = (u & 0x807fffffu) | (uint32_t(rng.integer(110, 136)) << 23);
    x[i] = bits_float(u);
  }
  DeviceBuffer d_x(n * 4), d_s(scales.size() * 4), d_o8(n), d_o1(n);
  ROPEPOOL_CUDA_OK(cudaMemcpy(d_x.ptr, x.data(), n * 4, cudaMemcpyHostToDevice));
  ROPEPOOL_CUDA_OK(cudaMemcpy(d_s.ptr, scales.data(), scales.size() * 4, cudaMemcpyHostToDevice));
  e4m3_quotients<<<1024, 256>>>(static_cast<float*>(d_x.ptr), static_cast<float*>(d_s.ptr), per, n,
                                static_cast<uint8_t*>(d_o8.ptr), static_cast<uint8_t*>(d_o1.ptr));
  ROPEPOOL_CUDA_OK(cudaGetLastError());
  std::vector<uint8_t> o8(n), o1(n);
  ROPEPOOL_CUDA_OK(cudaMemcpy(o8.data(), d_o8.ptr, n, cudaMemcpyDeviceToHost));
  ROPEPOOL_CUDA_OK(cudaMemcpy(o1.data(), d_o1.ptr, n, cudaMemcpyDeviceToHost));
  int64_t bad = 0;
  std::string first;
  for (size_t i = 0; i < n; ++i) {
    const float s = scales[i / size_t(per)];
    const uint8_t want = float_to_e4m3(x[i] / s);
    if (o8[i] != want || o1[i] != want) {
      if (bad++ == 0) {
        char b[200];
        std::snprintf(b, sizeof b, "e4m3(0x%08x / %.9g) = %s / %s, want %s", float_bits(x[i]), double(s),
                      hex8(o8[i]).c_str(), hex8(o1[i]).c_str(), hex8(want).c_str());
        first = b;
      }
    }
  }
  const std::string what = "e4m3(x / scale) on " + std::to_string(n) + " random float32 over " +
                           std::to_string(kScales) + " scales, bit-exact to float_to_e4m3(x / scale): " +
                           std::to_string(bad) + " differ " + first;
  expect(bad == 0, what);
  std::printf("  %-4s %s\n", bad == 0 ? "ok" : "FAIL", what.c_str());
}

/// SPEC §4 return_k_rot=False on every kernel: the seed's tuned kernel (3-D pool in q's dtype),
/// the paged and uncapped ones (a token over CTAs), the lock mode (T > 256), fp8 pools and q_out,
/// the norm variant of the main kernel and both fusion kernels (partial rotary, odd head_dim).
void test_no_k_rot(Rng& rng) {
  std::printf("no k_rot (SPEC §4 return_k_rot=False), against the same call with k_rot:\n");
  struct S {
    Cache cache;
    int64_t page_size, T, Hq, Hk, D, R;
    bool fp8_pool, fp8_q;
    int norm;
  };
  const S shapes[] = {{Cache::Pool3D, 1, 1, 32, 8, 128, 0, false, false, 0},
                      {Cache::Pool3D, 1, 37, 4, 2, 128, 0, false, false, 0},
                      {Cache::NHD, 16, 3, 32, 8, 128, 0, false, false, 0},
                      {Cache::HND, 64, 300, 32, 8, 128, 0, false, false, 0},
                      {Cache::NHD, 16, 3, 32, 8, 128, 0, true, true, 0},
                      {Cache::FlashNHD, 16, 300, 8, 2, 128, 0, true, false, 0},
                      {Cache::Pool3D, 1, 37, 4, 2, 80, 0, false, true, 0},
                      {Cache::NHD, 16, 37, 4, 2, 128, 0, false, false, 1},
                      {Cache::Vllm, 16, 37, 4, 2, 128, 0, true, false, 2},
                      {Cache::Pool3D, 1, 37, 4, 2, 128, 64, false, false, 1},
                      {Cache::HND, 16, 37, 3, 2, 34, 0, false, false, 1}};
  for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32})
    for (const S& s : shapes) {
      if (g_sanitize && dt != DType::BFloat16) continue;
      PoolCase c;
      c.dtype = dt, c.cache = s.cache, c.page_size = s.page_size, c.T = s.T, c.Hq = s.Hq, c.Hk = s.Hk;
      c.D = s.D, c.R = s.R, c.norm = s.norm, c.no_k_rot = true;
      c.fp8_pool = s.fp8_pool, c.k_scale = 0.0375f, c.v_scale = 0.3f;
      c.fp8_q = s.fp8_q, c.q_scale = 0.07f;
      run_pool_case(c, rng, "no-k_rot");
    }
}

/// The head kernel (LaunchConfig::head_kernel, head_dim 128 tuned): every pool variant, dtype and
/// write mode it takes (direct at T = 1, scan above), scales that are powers of two and not, as
/// values and as pointers, NaN/Inf/ties, heads that fill a warp partly, 2, 4 and 8 warps per
/// CTA, mRoPE, no k_rot; then the same calls on the token kernel (head_kernel = -1).
void test_head_kernel(Rng& rng) {
  std::printf("the head kernel:\n");
  struct S {
    int64_t Hq, Hk;
  };
  for (int head : {1, -1})
    for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32})
      for (Cache cache : {Cache::Pool3D, Cache::NHD, Cache::HND, Cache::FlashNHD})
        for (int fp8 : {0, 1, 2, 3})  // bit 0: fp8 pools, bit 1: fp8 q_rot
          for (int64_t T : {int64_t(1), int64_t(5), int64_t(37)}) {
            if (g_sanitize && (dt != DType::BFloat16 || T == 5 || head < 0)) continue;
            if (head < 0 && (T != 5 || cache == Cache::FlashNHD)) continue;
            const int pick = int(T) + fp8 + int(cache);
            const S shape = pick % 3 == 0 ? S{32, 8} : pick % 3 == 1 ? S{5, 3} : S{64, 1};
            PoolCase c;
            c.dtype = dt, c.cache = cache, c.page_size = cache == Cache::HND ? 5 : 16, c.T = T;
            c.Hq = shape.Hq, c.Hk = shape.Hk, c.D = 128, c.head_kernel = head;
            c.fp8_pool = fp8 & 1, c.fp8_q = fp8 & 2;
            const bool pow2 = pick % 2 == 0;
            c.k_scale = pow2 ? 0.25f : 0.0375f, c.v_scale = pow2 ? 1.0f : 0.3f, c.q_scale = pow2 ? 0.5f : 0.07f;
            c.scale_ptrs = T != 5, c.specials = fp8 != 0 && T == 37, c.index64 = T == 5;
            c.padded_heads = pick % 5 == 2;
            c.kernel = pick % 4 == 1 ? Kernel::TwoWarps : Kernel::Auto;
            if (pick % 4 == 2) c.warps = 4;
            if (pick % 4 == 3) c.warps = 8;  // a token over two CTAs of 8 and 6 warps (32 q heads)
            run_pool_case(c, rng, "head");
          }
  for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32})
    for (int mrope : {1, 2})
      for (bool no_k_rot : {false, true}) {
        if (g_sanitize && dt != DType::BFloat16) continue;
        PoolCase c;
        c.dtype = dt, c.cache = Cache::NHD, c.page_size = 16, c.T = 7, c.Hq = 32, c.Hk = 8, c.D = 128;
        c.head_kernel = 1, c.mrope = mrope, c.no_k_rot = no_k_rot;
        c.fp8_pool = no_k_rot, c.fp8_q = no_k_rot, c.k_scale = 0.0375f, c.v_scale = 0.3f, c.q_scale = 0.07f;
        run_pool_case(c, rng, "head");
      }
  // The planner's bounds: the seed's pool takes the head kernel by default to T = 128
  // (kHeadKernelMaxTokens), not at 129; a pool variant to T = 256 (kHeadKernelMaxTokensVariant,
  // the most tokens without row locks), not at 257. At T = 256 the scan's later-slot registers
  // are all in use: every layout, fp8 and not (duplicate slots at T = 256: test_paged_slots).
  for (int64_t T : {int64_t(128), int64_t(129)}) {
    if (g_sanitize) continue;
    PoolCase c;
    c.dtype = DType::BFloat16, c.cache = Cache::Pool3D, c.T = T, c.Hq = 32, c.Hk = 8, c.D = 128;
    run_pool_case(c, rng, "head");
  }
  int pick = 0;
  for (Cache cache : {Cache::Pool3D, Cache::NHD, Cache::HND, Cache::FlashNHD})
    for (int fp8 : {0, 1, 2, 3})
      for (int64_t T : {int64_t(256), int64_t(257)}) {
        if (g_sanitize || (T == 257 && fp8 != 3)) continue;
        PoolCase c;
        c.dtype = pick % 3 == 0 ? DType::BFloat16 : pick % 3 == 1 ? DType::Float16 : DType::Float32;
        c.cache = cache, c.page_size = cache == Cache::HND ? 5 : 16, c.T = T, c.Hq = 32, c.Hk = 8, c.D = 128;
        c.fp8_pool = fp8 & 1, c.fp8_q = fp8 & 2, c.no_k_rot = cache == Cache::Pool3D && fp8 == 0;
        c.k_scale = 0.0375f, c.v_scale = 0.3f, c.q_scale = 0.07f, c.scale_ptrs = pick % 2 == 0;
        c.specials = fp8 != 0 && pick % 2 == 1;
        ++pick;
        run_pool_case(c, rng, "head");
      }
}

void test_pools(Rng& rng) {
  test_e4m3_conversion(rng);
  test_e4m3_division(rng);
  test_paged_layouts(rng);
  test_combined_caches(rng);
  test_fp8_pools(rng);
  test_fp8_q_out(rng);
  test_pool_alignment(rng);
  test_paged_slots(rng);
  test_graph_scales(rng);
  test_norm_caches(rng);
  test_no_k_rot(rng);
  test_head_kernel(rng);
  std::printf("pools (SPEC §6, with SPEC §7's norm too): %d cases\n", g_pool_cases);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    else if (a == "--sanitize") quick = g_sanitize = true;
    else if (a == "--test") continue;  // the default (what the old driver needed)
    else {
      std::fprintf(stderr, "usage: %s [--quick] [--sanitize]\n", argv[0]);
      return 2;
    }
  }
  print_device();
  Rng rng(fresh_seed());
  std::printf("seed: %llu (replay: ROPEPOOL_TEST_SEED)\n", (unsigned long long)rng.seed());
  test_grid(quick, rng);
  test_slot_errors(rng);
  test_graph(rng);
  test_fusions(rng);
  test_pools(rng);
  if (!quick) test_large_pool(rng);
  std::printf("tests: %d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
