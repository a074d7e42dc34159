// Concurrency of the CPU backend (issue #9): many application threads calling the op at
// once, on separate pools and on one shared pool, while another thread changes the thread
// count; the pool's wake-ups and its bound on workers. Every result is checked against the
// serial result (bit for bit) and the float64 reference (SPEC §1 bound). This suite also
// runs under ThreadSanitizer (./dev.sh test, build-tsan), so sizes stay small.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "../../src/cpu/cpu_kernels.hpp"
#include "ropepool/half.hpp"
#include "ropepool/reference.hpp"
#include "ropepool/rope_pool.hpp"
#include "ropepool/schedule.hpp"

namespace ropepool {
namespace {

using detail::cpu::max_cpu_threads;
using detail::cpu::thread_pool_stats;

// Restores the process-wide knobs a test changes.
struct KnobGuard {
  int threads = cpu_num_threads();
  int64_t min_bytes = detail::cpu::parallel_min_bytes();
  ~KnobGuard() {
    set_cpu_num_threads(threads);
    detail::cpu::set_parallel_min_bytes(min_bytes);
  }
};

uint32_t next_random(uint64_t& state) {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return uint32_t(state >> 33);
}

// One call's buffers: [T, Hq, D] / [T, Hk, D] inputs, outputs and a private or shared pool.
struct Problem {
  int64_t T, Hq, Hk, D, P;
  DType dtype;
  std::vector<uint8_t> q, k, v, q_out, k_out;
  std::vector<int32_t> positions, slots;
  RopePoolParams params;

  Problem(int64_t T_, int64_t Hq_, int64_t Hk_, int64_t D_, int64_t P_, DType dtype_, uint64_t seed)
      : T(T_), Hq(Hq_), Hk(Hk_), D(D_), P(P_), dtype(dtype_) {
    const size_t es = dtype_size(dtype);
    q.resize(size_t(T * Hq * D) * es);
    k.resize(size_t(T * Hk * D) * es);
    v.resize(size_t(T * Hk * D) * es);
    q_out.assign(q.size(), 0xAB);
    k_out.assign(k.size(), 0xAB);
    for (auto* buf : {&q, &k, &v})
      for (size_t i = 0; i < buf->size() / es; ++i) store(*buf, i, float(int(next_random(seed) % 2001) - 1000) / 250);
    positions.resize(size_t(T));
    slots.resize(size_t(T));
    for (int64_t t = 0; t < T; ++t) positions[size_t(t)] = int32_t(next_random(seed) % 5000);
    params.head_dim = D;
    params.num_qo_heads = Hq;
    params.num_kv_heads = Hk;
  }

  void store(std::vector<uint8_t>& buf, size_t i, float x) const {
    if (dtype == DType::Float32) std::memcpy(&buf[i * 4], &x, 4);
    const uint16_t h = dtype == DType::Float16 ? float_to_half(x) : float_to_bf16(x);
    if (dtype != DType::Float32) std::memcpy(&buf[i * 2], &h, 2);
  }

  RopePoolTensors tensors(std::vector<uint8_t>& k_pool, std::vector<uint8_t>& v_pool) {
    return {TensorView::contiguous(q.data(), dtype, {T, Hq, D}),
            TensorView::contiguous(k.data(), dtype, {T, Hk, D}),
            TensorView::contiguous(v.data(), dtype, {T, Hk, D}),
            TensorView::contiguous(positions.data(), DType::Int32, {T}),
            TensorView::contiguous(slots.data(), DType::Int32, {T}),
            TensorView::contiguous(k_pool.data(), dtype, {P, Hk, D}),
            TensorView::contiguous(v_pool.data(), dtype, {P, Hk, D}),
            TensorView::contiguous(q_out.data(), dtype, {T, Hq, D}),
            TensorView::contiguous(k_out.data(), dtype, {T, Hk, D})};
  }

  std::vector<uint8_t> empty_pool() const {
    return std::vector<uint8_t>(size_t(P * Hk * D) * dtype_size(dtype), 0xCD);
  }
};

// Number of elements of `out` outside the SPEC §1 bound of the float64 rotation of `in`.
int64_t count_inaccurate(const TensorView& in, const TensorView& out, const TensorView& positions,
                         const RopePoolParams& params) {
  const RopeSchedule schedule = make_rope_schedule(params);
  const std::vector<double> exact = reference::rotate(in, positions, schedule);
  const int64_t T = in.shape[0], H = in.shape[1], D = in.shape[2], half = schedule.rotary_dim / 2;
  int64_t bad = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t lo = d < half ? d : d - half;
        const double pair = std::abs(reference::load(in, t, h, lo)) + std::abs(reference::load(in, t, h, lo + half));
        const double want = exact[size_t((t * H + h) * D + d)];
        if (std::abs(reference::load(out, t, h, d) - want) > reference::tolerance(out.dtype, want, pair)) ++bad;
      }
  return bad;
}

// A thread that keeps changing the thread count (1 .. 2 x max, and 0 = the default) until
// stopped: calls must stay correct whatever count they read.
struct Resizer {
  std::atomic<bool> stop{false};
  std::thread thread{[this] {
    for (int i = 0; !stop.load(std::memory_order_relaxed); ++i) {
      set_cpu_num_threads(i % (2 * max_cpu_threads() + 1));
      std::this_thread::yield();
    }
  }};
  ~Resizer() {
    stop = true;
    thread.join();
  }
};

// --- the pool's wake-ups and its bound on workers ----------------------------------------

// A call wakes only the workers it uses, however many an earlier call started: waking every
// worker on every call made calls ~20-100x slower once a large thread count had been used.
TEST(ThreadPool, CallWakesOnlyTheWorkersItUses) {
  KnobGuard guard;
  detail::cpu::set_parallel_min_bytes(1);
  Problem big(64, 4, 2, 32, 64, DType::Float32, 1);
  for (int64_t t = 0; t < big.T; ++t) big.slots[size_t(t)] = int32_t(t);
  std::vector<uint8_t> k_pool = big.empty_pool(), v_pool = big.empty_pool();
  set_cpu_num_threads(max_cpu_threads());  // >= 8
  rope_pool_fused(big.tensors(k_pool, v_pool), big.params);  // starts max - 1 workers
  ASSERT_GE(thread_pool_stats().workers_started, max_cpu_threads() - 1);

  set_cpu_num_threads(2);
  constexpr int kCalls = 50;
  const int64_t wakeups_before = thread_pool_stats().worker_wakeups;
  for (int i = 0; i < kCalls; ++i) rope_pool_fused(big.tensors(k_pool, v_pool), big.params);
  const int64_t wakeups = thread_pool_stats().worker_wakeups - wakeups_before;
  EXPECT_LE(wakeups, kCalls) << "2-thread calls woke " << wakeups << " workers in " << kCalls
                             << " calls (one each expected)";
  EXPECT_GE(wakeups, 1);
}

// A huge thread count is clamped: it cannot start thousands of workers.
TEST(ThreadPool, HugeThreadCountIsClamped) {
  KnobGuard guard;
  set_cpu_num_threads(1 << 30);
  EXPECT_EQ(cpu_num_threads(), max_cpu_threads());
  EXPECT_GE(max_cpu_threads(), 8);
  EXPECT_LE(max_cpu_threads(), 4 * int(std::max(1u, std::thread::hardware_concurrency())) + 8);
  detail::cpu::set_parallel_min_bytes(1);
  Problem p(256, 2, 1, 16, 256, DType::Float32, 2);
  for (int64_t t = 0; t < p.T; ++t) p.slots[size_t(t)] = int32_t(t);
  std::vector<uint8_t> k_pool = p.empty_pool(), v_pool = p.empty_pool();
  rope_pool_fused(p.tensors(k_pool, v_pool), p.params);
  EXPECT_LE(thread_pool_stats().workers_started, max_cpu_threads() - 1);
  EXPECT_EQ(count_inaccurate(p.tensors(k_pool, v_pool).q, p.tensors(k_pool, v_pool).q_out,
                             p.tensors(k_pool, v_pool).positions, p.params),
            0);
  set_cpu_num_threads(0);
  EXPECT_GE(cpu_num_threads(), 1);
  EXPECT_LE(cpu_num_threads(), max_cpu_threads());
}

// --- many callers ------------------------------------------------------------------------

constexpr int kCallers = 6;
constexpr int kRounds = 4;

// Each caller owns its buffers and pool; all run at once (some on the pool, some falling back
// to their own thread) while another thread changes the thread count.
TEST(Concurrency, ManyCallersSeparatePools) {
  KnobGuard guard;
  detail::cpu::set_parallel_min_bytes(1);
  const DType dtypes[] = {DType::Float32, DType::Float16, DType::BFloat16};
  std::vector<Problem> problems;
  std::vector<std::vector<uint8_t>> serial_q, serial_k, serial_kp, serial_vp;
  for (int c = 0; c < kCallers; ++c) {
    problems.emplace_back(8 + 5 * c, 2 + c % 3, 1 + c % 2, 16 * (1 + c % 2), 40 + 5 * c, dtypes[c % 3], 100 + c);
    Problem& p = problems.back();
    for (int64_t t = 0; t < p.T; ++t) p.slots[size_t(t)] = t % 7 == 3 ? -1 : int32_t(p.P - 1 - t);
  }
  // The serial results, one thread.
  set_cpu_num_threads(1);
  for (Problem& p : problems) {
    std::vector<uint8_t> k_pool = p.empty_pool(), v_pool = p.empty_pool();
    const RopePoolTensors x = p.tensors(k_pool, v_pool);
    rope_pool_fused(x, p.params);
    EXPECT_EQ(count_inaccurate(x.q, x.q_out, x.positions, p.params), 0);
    EXPECT_EQ(count_inaccurate(x.k, x.k_out, x.positions, p.params), 0);
    serial_q.push_back(p.q_out);
    serial_k.push_back(p.k_out);
    serial_kp.push_back(k_pool);
    serial_vp.push_back(v_pool);
  }

  std::atomic<int> mismatches{0};
  {
    Resizer resizer;
    std::vector<std::thread> callers;
    for (int c = 0; c < kCallers; ++c)
      callers.emplace_back([&, c] {
        Problem p = problems[size_t(c)];
        for (int round = 0; round < kRounds; ++round) {
          std::vector<uint8_t> k_pool = p.empty_pool(), v_pool = p.empty_pool();
          std::fill(p.q_out.begin(), p.q_out.end(), uint8_t(round));
          std::fill(p.k_out.begin(), p.k_out.end(), uint8_t(round));
          rope_pool_fused(p.tensors(k_pool, v_pool), p.params);
          if (p.q_out != serial_q[size_t(c)] || p.k_out != serial_k[size_t(c)] ||
              k_pool != serial_kp[size_t(c)] || v_pool != serial_vp[size_t(c)])
            mismatches.fetch_add(1);
        }
      });
    for (auto& t : callers) t.join();
  }
  EXPECT_EQ(mismatches.load(), 0) << "concurrent results differ from the serial ones";
}

// All callers write one shared pool, each its own slots (disjoint), at once: every written
// row holds that caller's row, every other row stays as it was.
TEST(Concurrency, ManyCallersOneSharedPool) {
  KnobGuard guard;
  detail::cpu::set_parallel_min_bytes(1);
  constexpr int64_t kTokens = 12, Hq = 3, Hk = 2, D = 32;
  constexpr int64_t kPool = kCallers * kTokens * 2;
  std::vector<Problem> problems;
  for (int c = 0; c < kCallers; ++c) {
    problems.emplace_back(kTokens, Hq, Hk, D, kPool, DType::BFloat16, 500 + c);
    Problem& p = problems.back();
    // Caller c owns slots c, c + kCallers, c + 2 kCallers, ... (interleaved rows).
    for (int64_t t = 0; t < kTokens; ++t) p.slots[size_t(t)] = t == 5 ? -1 : int32_t(c + kCallers * (2 * t));
  }
  Problem& first = problems.front();
  std::vector<uint8_t> k_pool = first.empty_pool(), v_pool = first.empty_pool();
  const std::vector<uint8_t> pool_before = k_pool;

  {
    Resizer resizer;
    std::vector<std::thread> callers;
    for (int c = 0; c < kCallers; ++c)
      callers.emplace_back([&, c] {
        for (int round = 0; round < kRounds; ++round)
          rope_pool_fused(problems[size_t(c)].tensors(k_pool, v_pool), problems[size_t(c)].params);
      });
    for (auto& t : callers) t.join();
  }

  const size_t row_bytes = size_t(Hk * D) * 2;
  std::vector<bool> written(size_t(kPool), false);
  for (int c = 0; c < kCallers; ++c) {
    Problem& p = problems[size_t(c)];
    const RopePoolTensors x = p.tensors(k_pool, v_pool);
    EXPECT_EQ(count_inaccurate(x.q, x.q_out, x.positions, p.params), 0) << "caller " << c;
    EXPECT_EQ(count_inaccurate(x.k, x.k_out, x.positions, p.params), 0) << "caller " << c;
    for (int64_t t = 0; t < kTokens; ++t) {
      const int32_t s = p.slots[size_t(t)];
      if (s < 0) continue;
      written[size_t(s)] = true;
      EXPECT_EQ(std::memcmp(&k_pool[size_t(s) * row_bytes], &p.k_out[size_t(t) * row_bytes], row_bytes), 0)
          << "k_pool row " << s << " (caller " << c << ", token " << t << ")";
      EXPECT_EQ(std::memcmp(&v_pool[size_t(s) * row_bytes], &p.v[size_t(t) * row_bytes], row_bytes), 0)
          << "v_pool row " << s << " (caller " << c << ", token " << t << ")";
    }
  }
  for (int64_t s = 0; s < kPool; ++s)
    if (!written[size_t(s)]) {
      EXPECT_EQ(std::memcmp(&k_pool[size_t(s) * row_bytes], &pool_before[size_t(s) * row_bytes], row_bytes), 0)
          << "unwritten k_pool row " << s << " changed";
      EXPECT_EQ(std::memcmp(&v_pool[size_t(s) * row_bytes], &pool_before[size_t(s) * row_bytes], row_bytes), 0)
          << "unwritten v_pool row " << s << " changed";
    }
}

// Reading and setting the thread count from many threads at once (a plain int before
// issue #9: a data race ThreadSanitizer reports).
TEST(Concurrency, ThreadCountReadAndSetFromManyThreads) {
  KnobGuard guard;
  std::vector<std::thread> threads;
  std::atomic<int> out_of_range{0};
  for (int i = 0; i < 4; ++i)
    threads.emplace_back([&, i] {
      for (int j = 0; j < 2000; ++j) {
        set_cpu_num_threads((i + j) % 7);
        const int n = cpu_num_threads();
        if (n < 1 || n > max_cpu_threads()) out_of_range.fetch_add(1);
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(out_of_range.load(), 0);
}

}  // namespace
}  // namespace ropepool
