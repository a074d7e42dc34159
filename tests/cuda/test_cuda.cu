// The CUDA backend on a GPU, against the float64 reference through the test kit: every
// kernel path (tuned head sizes, generic 16-byte, scalar; NeoX and GPT-J; partial rotary;
// strided fused-QKV views; misaligned views) and launch shape, every pool row checked bit
// for bit, untouched rows unchanged, SPEC §3 (out-of-range slots with and without
// check_slots, duplicates), a pool over 4 GiB, CUDA-graph capture and replay.
// Registered with ctest under the label `gpu` (scripts/gpu_check.sh runs `ctest -L gpu`).
//
//   ropepool_test_cuda [--quick] [--sanitize]
//
// --sanitize: a smaller grid, no stress repeats, for compute-sanitizer.
// Prints "tests: N checks, M failures"; exit status 0 only when every check passed.
#include <cuda_runtime.h>

#include <algorithm>
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

uint32_t to_bits(float f, DType dt) {
  switch (dt) {
    case DType::Float32: return float_bits(f);
    case DType::Float16: return float_to_half(f);
    default: return float_to_bf16(f);
  }
}

// ---- one test case ----------------------------------------------------------------------

enum class Layout { Contiguous, FusedQkv, Misaligned };

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
                  layout == Layout::FusedQkv ? " fused-qkv" : layout == Layout::Misaligned ? " misaligned" : "",
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

    // q, k, v: one buffer. Fused: rows of [Hq + 2 Hk, D]; else three blocks. Misaligned:
    // everything one element off a 16-byte boundary.
    const int64_t off = c.layout == Layout::Misaligned ? 1 : 0;
    const int64_t row = (Hq + 2 * Hk) * D;
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
      return t;
    };
    d_qkv = std::make_unique<DeviceBuffer>(h_qkv.size());
    ROPEPOOL_CUDA_OK(cudaMemcpy(d_qkv->ptr, h_qkv.data(), h_qkv.size(), cudaMemcpyHostToDevice));
    const Device cpu{}, gpu{DeviceType::CUDA, 0};
    for (auto [side, base, dev] : {std::tuple{&host, (void*)h_qkv.data(), cpu}, {&dev, d_qkv->ptr, gpu}}) {
      if (c.layout == Layout::FusedQkv) {
        side->q = view(base, 0, Hq, row, dev);
        side->k = view(base, Hq * D, Hk, row, dev);
        side->v = view(base, (Hq + Hk) * D, Hk, row, dev);
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
    for (Layout l : {Layout::FusedQkv, Layout::Misaligned})
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

// SPEC §7 (the fusion kernel, fusion_kernel.cuh): QK norm ("rms" with q-dtype weights,
// "gemma" with float32 ones) and mRoPE (Qwen2-VL sections, Qwen3-VL interleaved), alone and
// combined, against the float64 reference (with the one midpoint ulp §7 allows), every pool
// row bit for bit; text-only mRoPE positions give the plain call's bits.
void test_fusions(Rng& rng) {
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
  if (!quick) test_large_pool(rng);
  std::printf("tests: %d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
