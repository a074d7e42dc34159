// `ropepool bench`: the default workload (Llama-3-8B attention shape), each result verified
// against the float64 reference, timed, and set next to this machine's copy bandwidth.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "cli_common.hpp"
#include "test_hooks.hpp"

namespace ropepool::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct BenchConfig {
  RopePoolParams params{
      .head_dim = 128, .num_qo_heads = 32, .num_kv_heads = 8, .rope_base = 500000};
  DType dtype = DType::BFloat16;
  DType index_dtype = DType::Int32;
  std::vector<int64_t> tokens = {1, 16, 256, 4096, 32768};
  int threads = 0;
  int64_t iters = 0;       // 0: as many as fit in `seconds`
  double seconds = 1.0;    // timing budget per token count
  int64_t copy_mib = 0;    // 0: max(256 MiB, 2 x L3)
  int64_t rotate_mib = 0;  // 0: max(256 MiB, 2 x L3)
  int64_t stream_min_mib = 16;  // the CPU backend's non-temporal store threshold; -1: never
  int64_t min_pool_slots = 65536;
  int64_t max_position = int64_t(1) << 17;
  double skip_fraction = 0.05;  // share of tokens with slot -1 (no pool write)
  uint64_t seed = 20240601;
  std::string json_path;
  // SPEC §6
  DType pool_dtype = DType::Other;   // Other: dtype
  DType q_out_dtype = DType::Other;  // Other: dtype
  KvLayout kv_layout = KvLayout::None;
  int64_t page_size = 1;
  bool k_rot = true;  // false: k_out left empty, no k_rot written (SPEC §4 return_k_rot=False)
  double fp8_scale = 0.015625;  // k/v/q scale of fp8 runs (default 1/64, a power of two)
  // SPEC §7: --qk-norm (q and k weights in the input dtype, Qwen3's "rms" style) and
  // --mrope (positions [3, T], Qwen2-VL's sections scaled to head_dim).
  bool qk_norm = false;
  bool mrope = false;
};

// Qwen2-VL's [16, 24, 24] for head_dim 128, scaled to another head_dim (summing to D/2).
std::vector<int64_t> mrope_section_for(int64_t head_dim) {
  const int64_t half = head_dim / 2, t = half / 4, h = (half - t) / 2;
  return {t, h, half - t - h};
}

struct Percentiles {
  double median = 0, p10 = 0, p90 = 0, min = 0;
};

Percentiles percentiles(std::vector<double> v) {
  Percentiles p;
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  auto rank = [&](double q) { return v[size_t(std::floor(q * double(n - 1)))]; };
  p.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  p.p10 = rank(0.10);
  p.p90 = rank(0.90);
  p.min = v.front();
  return p;
}

// --- memcpy anchor ------------------------------------------------------------------------

struct CopyResult {
  size_t bytes = 0;  // buffer size; traffic per copy is 2x (read + written)
  int reps = 0;
  Percentiles seconds;
  double gbps = 0;
};

CopyResult measure_memcpy(size_t bytes, int threads, int reps) {
  HostBuffer src("copy source", DType::Int32, int64_t(bytes / 4), 0),
      dst("copy destination", DType::Int32, int64_t(bytes / 4), 0);
  // Touch both buffers first so page faults are not timed.
  parallel_for(int64_t(bytes), threads, [&](int64_t b, int64_t e) {
    std::memset(static_cast<char*>(src.data()) + b, 0x5a, size_t(e - b));
    std::memset(static_cast<char*>(dst.data()) + b, 0, size_t(e - b));
  });
  // One chunk per thread, split on 4 KiB boundaries, like the op splits its tokens.
  const int64_t pages = int64_t(bytes / 4096);
  std::vector<double> samples;
  for (int r = 0; r < reps + 1; ++r) {
    const auto t0 = Clock::now();
    parallel_for(pages, threads, [&](int64_t b, int64_t e) {
      const size_t off = size_t(b) * 4096;
      const size_t len = e == pages ? bytes - off : size_t(e - b) * 4096;
      std::memcpy(static_cast<char*>(dst.data()) + off, static_cast<char*>(src.data()) + off, len);
    });
    const double s = seconds_since(t0);
    if (r > 0) samples.push_back(s);  // the first copy warms TLBs and the thread start-up
  }
  if (std::memcmp(src.data(), dst.data(), bytes) != 0)
    throw BackendError("memcpy anchor: destination differs from source");
  CopyResult c;
  c.bytes = bytes;
  c.reps = reps;
  c.seconds = percentiles(samples);
  c.gbps = 2.0 * double(bytes) / c.seconds.median * 1e-9;
  return c;
}

// --- one token count ----------------------------------------------------------------------

struct InputSet {
  std::unique_ptr<HostBuffer> q, k, v, q_out, k_out, positions, slots;
  RopePoolTensors tensors;
  uint64_t seed = 0;
};

// One format of a run: every combination of the --fusion (SPEC §7) and the --pool-dtype,
// --q-out-dtype, --kv-layout, --page-size and --k-rot (SPEC §6) lists.
struct Format {
  bool qk_norm = false, mrope = false;  // SPEC §7 (--fusion)
  DType pool_dtype = DType::Other;   // as resolved: --dtype for `same`, or float8_e4m3fn
  DType q_out_dtype = DType::Other;  // likewise
  KvLayout kv_layout = KvLayout::None;
  int64_t page_size = 1;             // 1 for a [P, Hk, D] pool
  bool k_rot = true;                 // false: no k_rot (SPEC §4 return_k_rot=False)
};

// A --fusion value's name: none, qk-norm, mrope or qk-norm+mrope.
const char* fusion_name(const Format& f) {
  return f.qk_norm ? (f.mrope ? "qk-norm+mrope" : "qk-norm") : f.mrope ? "mrope" : "none";
}

struct TokenResult {
  Format format;
  int64_t tokens = 0, pool_slots = 0, sets = 0, calls = 0;
  double bytes_per_call = 0;
  std::vector<double> samples;  // seconds per call, every round's
  Percentiles seconds;
  double gbps = 0, copy_ratio = 0;
  CheckStats q_check, k_check, pool_check;
  int64_t pool_rows_written = 0;
  bool ok() const { return q_check.ok() && k_check.ok() && pool_check.ok(); }
};

const char* stage_prefix = "[ropepool bench]";
constexpr int64_t kMaxAutoCalls = 1000000;

TokenResult run_tokens(const BenchConfig& cfg, int64_t T, size_t rotate_bytes) {
  RopePoolParams p = cfg.params;
  const int64_t Hq = p.num_qo_heads, Hk = p.num_kv_heads, D = p.head_dim;
  const size_t es = dtype_size(cfg.dtype), is = dtype_size(cfg.index_dtype);
  const size_t pool_es = dtype_size(cfg.pool_dtype), q_out_es = dtype_size(cfg.q_out_dtype);
  const int64_t position_rows = cfg.mrope ? 3 : 1;
  // SPEC §7: the norm weights (in q's dtype, around 1 as trained ones are) and mRoPE.
  HostBuffer q_norm_w("q_norm_weight", cfg.dtype, D, 0), k_norm_w("k_norm_weight", cfg.dtype, D, 0);
  const TensorView q_norm_view = TensorView::contiguous(q_norm_w.data(), cfg.dtype, {D});
  const TensorView k_norm_view = TensorView::contiguous(k_norm_w.data(), cfg.dtype, {D});
  if (cfg.qk_norm) {
    fill_uniform(q_norm_w.data(), cfg.dtype, D, counter_bits(cfg.seed, 7), 0.5, 1.5, 1);
    fill_uniform(k_norm_w.data(), cfg.dtype, D, counter_bits(cfg.seed, 8), 0.5, 1.5, 1);
    p.q_norm_weight = q_norm_view;
    p.k_norm_weight = k_norm_view;
    p.norm_eps = 1e-6;
  }
  if (cfg.mrope) p.rope_scaling.mrope_section = mrope_section_for(D);
  const int threads = cfg.threads;
  const int64_t ps = cfg.page_size;
  TokenResult r;
  r.tokens = T;
  r.pool_slots = (std::max(cfg.min_pool_slots, 4 * T) + ps - 1) / ps * ps;
  // every tensor at its own element size: q, k, v read; q_rot, k_rot (not with --k-rot no),
  // k/v pool rows written; positions ([3, T] with --mrope), slots and the two norm weights
  // (--qk-norm)
  const int64_t k_rot_heads = cfg.k_rot ? Hk : 0;
  r.bytes_per_call = double(T) * double(D) *
                         double(int64_t(es) * (Hq + 2 * Hk + k_rot_heads) +
                                int64_t(q_out_es) * Hq + 2 * int64_t(pool_es) * Hk) +
                     double(T * (position_rows + 1) * int64_t(is)) +
                     (cfg.qk_norm ? double(2 * D * int64_t(es)) : 0);
  const size_t set_bytes =
      size_t(T) * size_t(D) * es * size_t(2 * Hq + 3 * Hk) + size_t(T) * 2 * is;
  // Rotate among input sets so a small call does not find its inputs already in cache.
  r.sets = std::clamp<int64_t>(
      int64_t((rotate_bytes + set_bytes - 1) / std::max<size_t>(1, set_bytes)), 1, 4096);
  if (T == 0) r.sets = 1;

  const int64_t P = r.pool_slots;
  std::fprintf(stderr, "%s T=%lld: %lld input set(s) of %.1f MiB, pool of %lld slots: filling\n",
               stage_prefix, (long long)T, (long long)r.sets, double(set_bytes) / 1048576.0,
               (long long)P);
  const uint64_t k_pool_seed = counter_bits(cfg.seed, uint64_t(T) * 4 + 1);
  const uint64_t v_pool_seed = counter_bits(cfg.seed, uint64_t(T) * 4 + 2);
  const DType pd = cfg.pool_dtype;
  HostBuffer k_pool("k_pool", pd, P * Hk * D, 0), v_pool("v_pool", pd, P * Hk * D, 0);
  fill_uniform(k_pool.data(), pd, P * Hk * D, k_pool_seed, -4, 4, threads);
  fill_uniform(v_pool.data(), pd, P * Hk * D, v_pool_seed, -4, 4, threads);
  auto pool_view = [&](const HostBuffer& b) {
    switch (cfg.kv_layout) {
      case KvLayout::NHD: return TensorView::contiguous(b.data(), pd, {P / ps, ps, Hk, D});
      case KvLayout::HND: return TensorView::contiguous(b.data(), pd, {P / ps, Hk, ps, D});
      case KvLayout::None: break;
    }
    return TensorView::contiguous(b.data(), pd, {P, Hk, D});
  };
  const TensorView k_pool_view = pool_view(k_pool), v_pool_view = pool_view(v_pool);
  // --k-rot no: the timed calls leave k_out empty (SPEC §4 return_k_rot=False). k_out still
  // has a buffer per set, written only by the check's companion call: the same inputs with
  // k_rot and every slot -1 (no pool write), whose k_rot is checked against the reference
  // and which the pool rows of the call without k_rot must match as they match k_rot.
  HostBuffer no_slots("slots all -1", cfg.index_dtype, T, 0);
  std::memset(no_slots.base(), 0xff, no_slots.bytes());  // -1 in int32 and int64
  const bool fp8_pool = pd == DType::Float8E4M3FN, fp8_q = cfg.q_out_dtype == DType::Float8E4M3FN;
  const float scale = float(cfg.fp8_scale);
  // A written pool row (slot) against token t of an input set: q's dtype: bit-identical to
  // k_out / v; fp8: v exactly e4m3(v / v_scale), k within one e4m3 step of e4m3(k_out /
  // k_scale) (the kernel quantises the float32 rotated value that k_out rounds).
  auto pool_row_ok = [&](const RopePoolTensors& tv, int64_t slot, int64_t t) {
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const void* kp = reference::pool_element(k_pool_view, cfg.kv_layout, slot, h, d);
        const void* vp = reference::pool_element(v_pool_view, cfg.kv_layout, slot, h, d);
        if (!fp8_pool) {
          if (std::memcmp(kp, element(tv.k_out, t, h, d), es) ||
              std::memcmp(vp, element(tv.v, t, h, d), es))
            return false;
          continue;
        }
        const uint8_t kb = *static_cast<const uint8_t*>(kp), vb = *static_cast<const uint8_t*>(vp);
        if (vb != float_to_e4m3(float(load(tv.v, t, h, d)) / scale)) return false;
        const uint8_t want = float_to_e4m3(float(load(tv.k_out, t, h, d)) / scale);
        if (std::abs(e4m3_ordinal(kb) - e4m3_ordinal(want)) > 1) return false;
      }
    return true;
  };

  std::vector<InputSet> sets(size_t(r.sets));
  Rng rng(counter_bits(cfg.seed, uint64_t(T) * 4 + 3));
  std::vector<uint8_t> taken(size_t(P), 0);
  for (size_t s = 0; s < sets.size(); ++s) {
    InputSet& in = sets[s];
    in.seed = counter_bits(cfg.seed, (uint64_t(T) << 20) + s);
    in.q = std::make_unique<HostBuffer>("q", cfg.dtype, T * Hq * D, 0);
    in.k = std::make_unique<HostBuffer>("k", cfg.dtype, T * Hk * D, 0);
    in.v = std::make_unique<HostBuffer>("v", cfg.dtype, T * Hk * D, 0);
    in.q_out = std::make_unique<HostBuffer>("q_out", cfg.q_out_dtype, T * Hq * D, 0);
    in.k_out = std::make_unique<HostBuffer>("k_out", cfg.dtype, T * Hk * D, 0);
    in.positions = std::make_unique<HostBuffer>("positions", cfg.index_dtype, position_rows * T, 0);
    in.slots = std::make_unique<HostBuffer>("slots", cfg.index_dtype, T, 0);
    fill_uniform(in.q->data(), cfg.dtype, T * Hq * D, in.seed + 1, -4, 4, threads);
    fill_uniform(in.k->data(), cfg.dtype, T * Hk * D, in.seed + 2, -4, 4, threads);
    fill_uniform(in.v->data(), cfg.dtype, T * Hk * D, in.seed + 3, -4, 4, threads);
    // Outputs all-ones (a NaN in every float dtype) so an element the op skips fails the
    // check; written in parallel, like the inputs, so the pages are placed alike.
    for (HostBuffer* out : {in.q_out.get(), in.k_out.get()})
      parallel_for(int64_t(out->bytes()), threads, [&](int64_t b, int64_t e) {
        std::memset(out->base() + b, 0xff, size_t(e - b));
      });
    // Distinct random slots within a call (P >= 4T keeps rejection cheap), some skipped.
    std::vector<int64_t> slot(static_cast<size_t>(T)), pos(static_cast<size_t>(position_rows * T));
    for (int64_t t = 0; t < T; ++t) {
      pos[size_t(t)] = int64_t(rng.below(uint64_t(cfg.max_position)));
      // mRoPE: height and width rows a little apart from the temporal one (image patches)
      for (int64_t row = 1; row < position_rows; ++row)
        pos[size_t(row * T + t)] = pos[size_t(t)] + int64_t(rng.below(64));
      if (rng.chance(cfg.skip_fraction)) {
        slot[size_t(t)] = -1;
        continue;
      }
      int64_t candidate;
      do candidate = int64_t(rng.below(uint64_t(P)));
      while (taken[size_t(candidate)]);
      taken[size_t(candidate)] = 1;
      slot[size_t(t)] = candidate;
    }
    for (int64_t sl : slot)
      if (sl >= 0) taken[size_t(sl)] = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (is == 8) {
        static_cast<int64_t*>(in.slots->data())[t] = slot[size_t(t)];
      } else {
        static_cast<int32_t*>(in.slots->data())[t] = int32_t(slot[size_t(t)]);
      }
    }
    for (int64_t i = 0; i < position_rows * T; ++i) {
      if (is == 8)
        static_cast<int64_t*>(in.positions->data())[i] = pos[size_t(i)];
      else
        static_cast<int32_t*>(in.positions->data())[i] = int32_t(pos[size_t(i)]);
    }
    RopePoolTensors& tv = in.tensors;
    tv.q = in.q->contiguous({T, Hq, D});
    tv.k = in.k->contiguous({T, Hk, D});
    tv.v = in.v->contiguous({T, Hk, D});
    tv.q_out = in.q_out->contiguous({T, Hq, D});
    tv.k_out = in.k_out->contiguous({T, Hk, D});  // emptied after the check with --k-rot no
    tv.positions = cfg.mrope ? in.positions->contiguous({3, T}) : in.positions->contiguous({T});
    tv.slots = in.slots->contiguous({T});
    tv.k_pool = k_pool_view;
    tv.v_pool = v_pool_view;
  }

  // First call of every set: check every q_out/k_out element against the float64
  // reference and every written pool row bit for bit; remember who wrote each row last.
  // --k-rot no: the first call writes no k_rot; the companion call (above) writes k_out.
  std::fprintf(stderr,
               "%s T=%lld: first call of each set, checking against the float64 reference\n",
               stage_prefix, (long long)T);
  const RopeSchedule schedule = make_rope_schedule(p);
  std::vector<std::pair<int32_t, int64_t>> last_writer(size_t(P), {-1, -1});  // (set, token)
  for (size_t s = 0; s < sets.size(); ++s) {
    const RopePoolTensors& tv = sets[s].tensors;
    if (cfg.k_rot) {
      rope_pool_fused(tv, p);
    } else {
      RopePoolTensors no_k_rot = tv;
      no_k_rot.k_out = TensorView{};
      rope_pool_fused(no_k_rot, p);
    }
    RotationCheck how;
    how.threads = threads;
    how.norm_eps = p.norm_eps.value_or(1e-6);
    if (cfg.qk_norm) how.norm_weight = &q_norm_view;
    r.q_check.merge(fp8_q ? check_quantized("q_out", tv.q, tv.q_out, tv.positions, schedule,
                                            p.interleaved, scale)
                          : check_rotation("q_out", tv.q, tv.q_out, tv.positions, schedule,
                                           p.interleaved, how));
    if (!cfg.k_rot) {
      // The companion call: k_rot and no pool row (q_out written again, already checked).
      RopePoolTensors companion = tv;
      companion.slots = no_slots.contiguous({T});
      rope_pool_fused(companion, p);
    }
    if (cfg.qk_norm) how.norm_weight = &k_norm_view;
    r.k_check.merge(check_rotation("k_out", tv.k, tv.k_out, tv.positions, schedule, p.interleaved, how));
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = reference::load_index(tv.slots, t);
      if (slot < 0) continue;
      ++r.pool_rows_written;
      r.pool_check.elements += 2 * Hk * D;
      if (!pool_row_ok(tv, slot, t))
        r.pool_check.fail(slot, [&] {
          return "set " + std::to_string(s) + ": pool row " + std::to_string(slot) +
                 " differs from " + (cfg.k_rot ? "k_out" : "k_rot (of a call with k_rot)") +
                 "/v of token " + std::to_string(t);
        });
      last_writer[size_t(slot)] = {int32_t(s), t};
    }
  }
  // Inputs must come back unmodified, and every pool row must hold either its initial
  // bits or the rows of its last writer.
  CheckStats inputs_check;
  std::mutex mu;
  for (const InputSet& in : sets) {
    for (auto [buf, count, seed] : {std::tuple{in.q.get(), T * Hq * D, in.seed + 1},
                                    {in.k.get(), T * Hk * D, in.seed + 2},
                                    {in.v.get(), T * Hk * D, in.seed + 3}})
      parallel_for(count, threads, [&](int64_t b, int64_t e) {
        CheckStats local;
        for (int64_t i = b; i < e; ++i)
          if (!holds_uniform(buf->data(), cfg.dtype, i, seed, -4, 4))
            local.fail(i, [&] { return "an input (q/k/v) element was modified by the call"; });
        std::lock_guard lock(mu);
        inputs_check.merge(local);
      });
  }
  r.q_check.merge(inputs_check);
  parallel_for(P, threads, [&](int64_t b, int64_t e) {
    CheckStats local;
    for (int64_t row = b; row < e; ++row) {
      const auto [s, t] = last_writer[size_t(row)];
      if (s >= 0) {
        const RopePoolTensors& tv = sets[size_t(s)].tensors;
        if (!pool_row_ok(tv, row, t))
          local.fail(row, [&] {
            return "pool row " + std::to_string(row) + " no longer holds its last writer's rows";
          });
        continue;
      }
      local.elements += 2 * Hk * D;
      bool same = true;
      for (int64_t h = 0; h < Hk && same; ++h)
        for (int64_t d = 0; d < D && same; ++d) {
          // the same element index in both pools (same layout)
          const int64_t i = (static_cast<const uint8_t*>(reference::pool_element(
                                 k_pool_view, cfg.kv_layout, row, h, d)) -
                             k_pool.base()) /
                            int64_t(pool_es);
          same = holds_uniform(k_pool.data(), pd, i, k_pool_seed, -4, 4) &&
                 holds_uniform(v_pool.data(), pd, i, v_pool_seed, -4, 4);
        }
      if (!same)
        local.fail(row, [&] {
          return "pool row " + std::to_string(row) + " was never a slot but changed";
        });
    }
    std::lock_guard lock(mu);
    r.pool_check.merge(local);
  });
  if (!r.ok()) {
    std::fprintf(stderr, "%s T=%lld: VERIFICATION FAILED, not timing it\n", stage_prefix,
                 (long long)T);
    return r;
  }

  // Timing: sets in turn, one sample per call; --iters calls, or as many as fit in
  // --seconds (at least 10).
  std::fprintf(stderr, "%s T=%lld: verified; timing\n", stage_prefix, (long long)T);
  if (!cfg.k_rot)
    for (InputSet& in : sets) in.tensors.k_out = TensorView{};  // no k_rot from here on
  for (size_t s = 0; s < sets.size() && s < 3; ++s) rope_pool_fused(sets[s].tensors, p);  // warm-up
  std::vector<double> samples;
  const auto timing_start = Clock::now();
  for (int64_t i = 0;; ++i) {
    if (cfg.iters > 0
            ? i >= cfg.iters
            : i >= 10 && (i >= kMaxAutoCalls || seconds_since(timing_start) >= cfg.seconds))
      break;
    const RopePoolTensors& tv = sets[size_t(i % r.sets)].tensors;
    const auto t0 = Clock::now();
    rope_pool_fused(tv, p);
    samples.push_back(seconds_since(t0));
  }
  r.samples = std::move(samples);  // calls, percentiles, GB/s: run_bench's, over every round
  return r;
}

// The run's formats' settings in the config (and the scales they need in its params).
BenchConfig with_format(const BenchConfig& base, const Format& f) {
  BenchConfig cfg = base;
  cfg.qk_norm = f.qk_norm;
  cfg.mrope = f.mrope;
  cfg.pool_dtype = f.pool_dtype;
  cfg.q_out_dtype = f.q_out_dtype;
  cfg.kv_layout = f.kv_layout;
  cfg.page_size = f.page_size;
  cfg.k_rot = f.k_rot;
  cfg.params.kv_layout = f.kv_layout;
  std::optional<double> pool_scale, q_scale;  // SPEC §6: a scale only with an fp8 tensor
  if (f.pool_dtype == DType::Float8E4M3FN) pool_scale = cfg.fp8_scale;
  if (f.q_out_dtype == DType::Float8E4M3FN) q_scale = cfg.fp8_scale;
  cfg.params.k_scale.value = cfg.params.v_scale.value = pool_scale;
  cfg.params.q_scale.value = q_scale;
  return cfg;
}

// --- report --------------------------------------------------------------------------------

std::string now_string() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S %Z", std::localtime(&t));
  return buf;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    o += c;
  }
  return o;
}

void write_json(const BenchConfig& cfg, const CopyResult& copy_before, const CopyResult& copy_after,
                const std::vector<TokenResult>& rs, const std::string& date, double load_at_start,
                double load_at_end) {
  std::ofstream f(cfg.json_path);
  if (!f) throw UsageError{"--json: cannot open '" + cfg.json_path + "' for writing"};
  const RopePoolParams& p = cfg.params;
  f << "{\n  \"version\": \"" << kVersion << "\",\n  \"date\": \"" << date << "\",\n"
    << "  \"cpu\": \"" << json_escape(cpu_model())
    << "\",\n  \"hardware_threads\": " << std::thread::hardware_concurrency()
    << ",\n  \"threads\": " << cfg.threads << ",\n"
    << "  \"load_average_start\": " << load_at_start << ",\n  \"load_average_end\": " << load_at_end
    << ",\n"
    << "  \"dtype\": \"" << dtype_name(cfg.dtype) << "\",\n  \"index_dtype\": \""
    << dtype_name(cfg.index_dtype) << "\",\n  \"num_qo_heads\": " << p.num_qo_heads
    << ",\n  \"num_kv_heads\": " << p.num_kv_heads << ",\n  \"head_dim\": " << p.head_dim
    << ",\n  \"rope_base\": " << p.rope_base
    << ",\n  \"interleaved\": " << (p.interleaved ? "true" : "false") << ",\n"
    << "  \"memcpy_buffer_bytes\": " << copy_before.bytes << ",\n";
  for (const CopyResult* c : {&copy_before, &copy_after})
    f << "  \"memcpy_" << (c == &copy_before ? "before" : "after") << "\": {\"reps\": " << c->reps
      << ", \"median_s\": " << c->seconds.median << ", \"gbps\": " << c->gbps << "},\n";
  f << "  \"memcpy_ratio_uses_gbps\": " << std::max(copy_before.gbps, copy_after.gbps) << ",\n"
    << "  \"results\": [";
  for (size_t i = 0; i < rs.size(); ++i) {
    const TokenResult& r = rs[i];
    f << (i ? ",\n" : "\n") << "    {\"fusion\": \"" << fusion_name(r.format)
      << "\", \"pool_dtype\": \"" << dtype_name(r.format.pool_dtype)
      << "\", \"q_out_dtype\": \"" << dtype_name(r.format.q_out_dtype)
      << "\", \"k_rot\": " << (r.format.k_rot ? "true" : "false") << ", \"kv_layout\": \""
      << kv_layout_name(r.format.kv_layout) << "\", \"page_size\": " << r.format.page_size
      << ", \"tokens\": " << r.tokens
      << ", \"pool_slots\": " << r.pool_slots << ", \"input_sets\": " << r.sets
      << ", \"calls\": " << r.calls << ", \"verified\": " << (r.ok() ? "true" : "false")
      << ", \"max_error_over_bound\": " << std::max(r.q_check.worst, r.k_check.worst)
      << ", \"bytes_per_call\": " << r.bytes_per_call
      << ", \"median_us\": " << r.seconds.median * 1e6 << ", \"p10_us\": " << r.seconds.p10 * 1e6
      << ", \"p90_us\": " << r.seconds.p90 * 1e6 << ", \"gbps\": " << r.gbps
      << ", \"memcpy_ratio\": " << r.copy_ratio << "}";
  }
  f << "\n  ]\n}\n";
}

}  // namespace

double memcpy_gbps(size_t bytes, int threads, int reps) {
  return measure_memcpy(bytes, threads, reps).gbps;
}

const char* bench_help() {
  return R"(usage: ropepool bench [options]

Times rope_pool_fused on the CPU for several token counts. Every input set's first call is
checked against the float64 reference (every q_out/k_out element within the SPEC §1 bound,
every written pool row bit-identical to k_out/v, every other pool row unchanged) before it
is timed; a token count that fails is reported and not timed (exit status 1). With
--k-rot no the call writes no k_rot (k_out left empty); its pool rows are checked against
the k_out of a second call with k_rot and every slot -1 (no pool write), itself checked
against the reference.

Default workload: Llama-3-8B attention (num_qo_heads 32, num_kv_heads 8, head_dim 128,
rope_base 500000), bfloat16, int32 positions/slots, T in 1,16,256,4096,32768, a pool of
max(65536, 4T) slots (--pool-slots), distinct random slots with ~5% set to -1 (no pool write), random
positions below 2^17. Small T rotate among many input sets so caches do not flatter.

Reported per T: median call time with p10/p90, GB/s with
  bytes = T*head_dim*(es*(num_qo_heads + 3*num_kv_heads) + q_rot_es*num_qo_heads
          + 2*pool_es*num_kv_heads) + T*(positions + slots)
(q, k, v read; q_rot, k_rot, k_pool, v_pool rows written; each tensor at its element size:
es = --dtype, pool_es = 1 with --pool-dtype fp8, q_rot_es = 1 with --q-out-dtype fp8; without
them 2*num_qo_heads + 5*num_kv_heads rows of es; --k-rot no: num_kv_heads rows of es fewer,
no k_rot written), and the ratio to the memcpy
bandwidth measured in the same run (a multithreaded memcpy of a buffer much larger than L3,
over the same number of threads; bytes = read + written; median of several copies; measured
before and after the op, the faster of the two counts). Progress goes to stderr, the table
to stdout at the end.

options:
  --mla              the mla_rope_pool_fused workload instead (DeepSeek-V3 shape; see
                     `ropepool bench --mla --help`)
  --threads N        worker threads (default: ROPEPOOL_NUM_THREADS or all hardware threads)
  --dtype D          bfloat16 (default), float16 or float32
  --index-dtype D    int32 (default) or int64 positions/slots
  --tokens LIST      comma-separated token counts (default 1,16,256,4096,32768)
  --iters N          timed calls per token count (default: as many as fit in --seconds,
                     at least 10)
  --seconds S        timing budget per token count when --iters is not given (default 1)
  --copy-mib N       memcpy anchor buffer size in MiB (default 2 x L3, within 256..1024)
  --rotate-mib N     input bytes to rotate among for small T (default 2 x L3, within 256..1024)
  --pool-slots N     pool slots: max(N, 4T) (default 65536), rounded up to whole pages
  --stream-min-mib N calls moving at least N MiB use non-temporal stores (default 16, the
                     library's threshold; -1: never), to measure that choice on a machine
  --pool-dtype D     same (default: the pools in --dtype) or fp8 (float8_e4m3fn pools,
                     k_scale = v_scale = --fp8-scale; k rows checked within one e4m3 step)
  --q-out-dtype D    same (default) or fp8 (float8_e4m3fn q_rot, q_scale = --fp8-scale)
  --fp8-scale X      the fp8 scales instead of 1/64, with --pool-dtype or --q-out-dtype fp8
                     (rounded to float32; a scale that is not a power of two divides instead
                     of multiplying by its reciprocal)
  --kv-layout L      none (default: [P, Hk, D] pools), NHD or HND (paged, SPEC §6)
  --page-size N      slots per page with --kv-layout NHD/HND (default 16)
  --k-rot K          yes (default: k_rot written to k_out) or no (k_out left empty, SPEC §4
                     return_k_rot=False: only q_rot and the pools are written)
                     --pool-dtype, --q-out-dtype, --kv-layout, --page-size and --k-rot take
                     comma lists: every combination is a cache format of the run (a 3-D pool
                     takes no page size), each token count times them one after the other
                     against the same memcpy anchor, and each row also gives its share of
                     memcpy over the first format's at that T, e.g.
                     --pool-dtype same,fp8 --kv-layout none,NHD,HND --page-size 1,16,64
                     --k-rot yes,no
  --rounds N         time each token count's formats N times in turn, each time for
                     1/N of --seconds (or --iters), pooling the samples (default 1), so that
                     a machine whose load drifts affects every format alike
  --num-qo-heads N, --num-kv-heads N, --head-dim N, --rope-base X
                     a different attention shape
  --interleaved      GPT-J pairs (x[2i], x[2i+1]) instead of half-split ones
  --qk-norm          SPEC §7: normalise every q and k head first (weights [head_dim] in the
                     input dtype, Qwen3's "rms" style); bytes include the two weights
  --mrope            SPEC §7: multimodal RoPE, positions [3, T] (Qwen2-VL's sections
                     [16, 24, 24] for head_dim 128, scaled for others); bytes count 3T positions
                     (--qk-norm --mrope: both in one call)
  --fusion LIST      SPEC §7 variants as formats of one run, timed in turn like the cache
                     formats (and combined with them): none, qk-norm, mrope, qk-norm+mrope,
                     e.g. --fusion none,qk-norm,mrope gives the norm's and mRoPE's share of
                     memcpy over the plain call's, against the same memcpy anchor; instead
                     of --qk-norm / --mrope
  --seed N           random seed (default 20240601)
  --json FILE        also write the results as JSON
  -h, --help         this text
)";
}

// A comma-separated list of names, each parsed by `parse`.
template <class F>
auto parse_list(const std::string& option, const std::string& value, F parse) {
  std::vector<decltype(parse(value))> out;
  std::stringstream ss(value);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(parse(item));
  if (out.empty() || value.back() == ',')
    throw UsageError{option + " expects a comma-separated list, got '" + value + "'"};
  return out;
}

int run_bench(Args& args) {
  BenchConfig cfg;
  cfg.threads = cpu_num_threads();
  std::vector<int64_t> page_sizes;  // empty: not given
  std::vector<DType> pool_dtypes = {DType::Other}, q_out_dtypes = {DType::Other};
  std::vector<KvLayout> kv_layouts = {KvLayout::None};
  std::vector<bool> k_rots = {true};
  std::vector<Format> fusions;  // --fusion: only qk_norm / mrope set
  int64_t rounds = 1;
  bool fp8_scale_given = false;
  while (!args.done()) {
    const std::string o = args.next_option();
    if (o == "-h" || o == "--help") {
      std::fputs(bench_help(), stdout);
      return 0;
    } else if (o == "--mla") {
      return run_bench_mla(args);  // cli_bench_mla.cpp: its own workload and options
    } else if (o == "--threads") {
      cfg.threads = int(parse_int(o, args.value(o), 1));
    } else if (o == "--dtype") {
      cfg.dtype = parse_float_dtype(args.value(o));
    } else if (o == "--index-dtype") {
      cfg.index_dtype = parse_index_dtype(args.value(o));
    } else if (o == "--tokens") {
      cfg.tokens = parse_int_list(o, args.value(o));
    } else if (o == "--iters") {
      cfg.iters = parse_int(o, args.value(o), 1);
    } else if (o == "--seconds") {
      cfg.seconds = parse_double(o, args.value(o));
    } else if (o == "--copy-mib") {
      cfg.copy_mib = parse_int(o, args.value(o), 1);
    } else if (o == "--rotate-mib") {
      cfg.rotate_mib = parse_int(o, args.value(o), 1);
    } else if (o == "--stream-min-mib") {
      cfg.stream_min_mib = parse_int(o, args.value(o), -1);
    } else if (o == "--num-qo-heads") {
      cfg.params.num_qo_heads = parse_int(o, args.value(o), 1);
    } else if (o == "--num-kv-heads") {
      cfg.params.num_kv_heads = parse_int(o, args.value(o), 1);
    } else if (o == "--head-dim") {
      cfg.params.head_dim = parse_int(o, args.value(o), 2);
      if (cfg.params.head_dim % 2) throw UsageError{"--head-dim must be even"};
    } else if (o == "--rope-base") {
      cfg.params.rope_base = parse_double(o, args.value(o));
    } else if (o == "--interleaved") {
      cfg.params.interleaved = true;
    } else if (o == "--qk-norm") {
      cfg.qk_norm = true;
    } else if (o == "--mrope") {
      cfg.mrope = true;
    } else if (o == "--fusion") {
      fusions = parse_list(o, args.value(o), [&](const std::string& v) {
        Format f;
        if (v == "qk-norm" || v == "qk-norm+mrope") f.qk_norm = true;
        if (v == "mrope" || v == "qk-norm+mrope") f.mrope = true;
        if (v != "none" && !f.qk_norm && !f.mrope)
          throw UsageError{"--fusion must be none, qk-norm, mrope or qk-norm+mrope (or a list of "
                           "them), got '" + v + "'"};
        return f;
      });
    } else if (o == "--seed") {
      cfg.seed = uint64_t(parse_int(o, args.value(o), 0));
    } else if (o == "--json") {
      cfg.json_path = args.value(o);
    } else if (o == "--pool-dtype" || o == "--q-out-dtype") {
      (o == "--pool-dtype" ? pool_dtypes : q_out_dtypes) =
          parse_list(o, args.value(o), [&](const std::string& v) {
            if (v == "same") return DType::Other;
            if (v == "fp8" || v == "float8_e4m3fn") return DType::Float8E4M3FN;
            throw UsageError{o + " must be same or fp8 (or a list of them), got '" + v + "'"};
          });
    } else if (o == "--k-rot") {
      k_rots = parse_list(o, args.value(o), [&](const std::string& v) {
        if (v == "yes") return true;
        if (v == "no") return false;
        throw UsageError{"--k-rot must be yes or no (or a list of them), got '" + v + "'"};
      });
    } else if (o == "--pool-slots") {
      cfg.min_pool_slots = parse_int(o, args.value(o), 1);
    } else if (o == "--rounds") {
      rounds = parse_int(o, args.value(o), 1);
    } else if (o == "--fp8-scale") {
      fp8_scale_given = true;
      cfg.fp8_scale = parse_double(o, args.value(o));
      if (!(float(cfg.fp8_scale) > 0.0f && std::isfinite(float(cfg.fp8_scale))))
        throw UsageError{"--fp8-scale must be finite and > 0 as a float32"};
    } else if (o == "--kv-layout") {
      kv_layouts = parse_list(o, args.value(o), [&](const std::string& v) {
        if (v == "none") return KvLayout::None;
        if (v == "NHD") return KvLayout::NHD;
        if (v == "HND") return KvLayout::HND;
        throw UsageError{"--kv-layout must be none, NHD or HND (or a list of them), got '" + v + "'"};
      });
    } else if (o == "--page-size") {
      page_sizes = parse_list(o, args.value(o),
                              [&](const std::string& v) { return parse_int(o, v, 1); });
    } else {
      args.unknown(o);
    }
  }
  auto has = [](const auto& list, auto value) {
    return std::find(list.begin(), list.end(), value) != list.end();
  };
  const bool any_fp8 = has(pool_dtypes, DType::Float8E4M3FN) || has(q_out_dtypes, DType::Float8E4M3FN);
  if (!page_sizes.empty() && !has(kv_layouts, KvLayout::NHD) && !has(kv_layouts, KvLayout::HND))
    throw UsageError{"--page-size needs --kv-layout NHD or HND"};
  if (fp8_scale_given && !any_fp8)
    throw UsageError{"--fp8-scale needs --pool-dtype fp8 or --q-out-dtype fp8"};
  if (!fusions.empty() && (cfg.qk_norm || cfg.mrope))
    throw UsageError{"--fusion replaces --qk-norm and --mrope: give one or the other"};
  if (fusions.empty()) fusions.push_back({cfg.qk_norm, cfg.mrope});  // --qk-norm / --mrope
  const bool any_norm = std::any_of(fusions.begin(), fusions.end(), [](const Format& f) { return f.qk_norm; });
  const bool any_mrope = std::any_of(fusions.begin(), fusions.end(), [](const Format& f) { return f.mrope; });
  if (any_norm && any_fp8)
    throw UsageError{"the QK norm (--qk-norm, --fusion qk-norm) with fp8 pools or q_rot: the bench "
                     "cannot verify that yet"};
  if (page_sizes.empty()) page_sizes = {16};
  // Every combination, in the order of the lists (a 3-D pool takes no page size); --fusion
  // outermost, --k-rot innermost, so a format's rows with and without k_rot are neighbours.
  std::vector<Format> formats;
  for (const Format& fusion : fusions)
    for (DType pool : pool_dtypes)
      for (DType q_out : q_out_dtypes)
        for (KvLayout layout : kv_layouts)
          for (int64_t page : layout == KvLayout::None ? std::vector<int64_t>{1} : page_sizes)
            for (bool k_rot : k_rots)
              formats.push_back({fusion.qk_norm, fusion.mrope, pool == DType::Other ? cfg.dtype : pool,
                                 q_out == DType::Other ? cfg.dtype : q_out, layout, page, k_rot});
  cfg = with_format(cfg, formats.front());  // the header's settings with one format
  set_cpu_num_threads(cfg.threads);
  detail::cpu::set_stream_min_bytes(cfg.stream_min_mib < 0 ? -1 : cfg.stream_min_mib << 20);

  const size_t l3 = l3_cache_bytes();
  // "Much larger than L3": twice the reported L3, at least 256 MiB, at most 1 GiB (two such
  // buffers are live during the copy).
  const size_t big = std::clamp<size_t>(2 * l3, size_t(256) << 20, size_t(1) << 30);
  const size_t copy_bytes = cfg.copy_mib ? size_t(cfg.copy_mib) << 20 : big;
  const size_t rotate_bytes = cfg.rotate_mib ? size_t(cfg.rotate_mib) << 20 : big;
  const std::string date = now_string();
  const RopePoolParams& p = cfg.params;

  std::printf("ropepool %s bench, %s\n", kVersion, date.c_str());
  const double load_at_start = load_average();
  std::printf("CPU: %s, %u hardware threads, L3 %zu MiB; ropepool threads: %d; SIMD target %s\n",
              cpu_model().c_str(), std::thread::hardware_concurrency(), l3 >> 20, cfg.threads,
              detail::cpu::hwy_target_name());
  if (load_at_start > 0.5)
    std::fprintf(stderr,
                 "%s note: load average %.2f before starting; other processes compete for the "
                 "CPU and memory bandwidth, figures will be low and noisy\n",
                 stage_prefix, load_at_start);
  std::printf(
      "workload: %s, num_qo_heads %lld, num_kv_heads %lld, head_dim %lld, rope_base %g, "
      "%s pairs, %s positions/slots below 2^%d, ~%.0f%% slots -1\n",
      dtype_name(cfg.dtype), (long long)p.num_qo_heads, (long long)p.num_kv_heads,
      (long long)p.head_dim, p.rope_base, p.interleaved ? "GPT-J" : "half-split",
      dtype_name(cfg.index_dtype),
      int(std::log2(double(cfg.max_position))), cfg.skip_fraction * 100);
  if (formats.size() == 1)
    std::printf("pools: %s, kv_layout %s, page_size %lld; q_rot %s%s", dtype_name(cfg.pool_dtype),
                kv_layout_name(cfg.kv_layout), (long long)cfg.page_size, dtype_name(cfg.q_out_dtype),
                cfg.k_rot ? "" : "; no k_rot (return_k_rot=False)");
  else
    std::printf("%zu %s (%spools, q_rot, k_rot, kv_layout, page_size), each token count "
                "timing them in turn%s",
                formats.size(), fusions.size() > 1 ? "formats" : "cache formats",
                fusions.size() > 1 ? "fusion, " : "", rounds > 1 ? ", round after round" : "");
  if (any_fp8) std::printf("; fp8 scales %.9g", double(float(cfg.fp8_scale)));
  std::printf("\n");
  if (rounds > 1)
    std::printf("rounds: %lld per token count; each format's samples are pooled over them\n",
                (long long)rounds);
  if (cfg.stream_min_mib < 0)
    std::printf("stores: cached only (--stream-min-mib -1)\n");
  else
    std::printf("stores: non-temporal from %lld MiB of traffic per call\n",
                (long long)cfg.stream_min_mib);
  if (any_norm) std::printf("fusion: QK norm (rms, weights in %s)\n", dtype_name(cfg.dtype));
  if (any_mrope) {
    const std::vector<int64_t> sec = mrope_section_for(p.head_dim);
    std::printf("fusion: mRoPE, positions [3, T], mrope_section [%lld, %lld, %lld]\n",
                (long long)sec[0], (long long)sec[1], (long long)sec[2]);
  }
  std::fflush(stdout);

  // The copy anchor is measured before and after the op; ratios use the faster of the two,
  // so a machine that got busier (or quieter) during the run cannot flatter the op.
  std::fprintf(stderr, "%s memcpy anchor: %zu MiB, %d thread(s)\n", stage_prefix, copy_bytes >> 20,
               cfg.threads);
  const CopyResult copy_before = measure_memcpy(copy_bytes, cfg.threads, 7);

  // Per token count, the formats one after the other (round after round with --rounds, each
  // round a share of --iters / --seconds), so that formats compared at one T ran close in time.
  std::vector<TokenResult> results;
  bool all_ok = true;
  for (int64_t T : cfg.tokens) {
    std::vector<TokenResult> at_t(formats.size());
    for (int64_t round = 0; round < rounds; ++round)
      for (size_t f = 0; f < formats.size(); ++f) {
        TokenResult& acc = at_t[f];
        if (round > 0 && !acc.ok()) continue;  // a failed check is not timed again
        if (formats.size() > 1 || rounds > 1)
          std::fprintf(stderr, "%s T=%lld: round %lld of %lld, fusion %s, pools %s, q_rot %s, k_rot %s, kv_layout %s, page_size %lld\n",
                       stage_prefix, (long long)T, (long long)round + 1, (long long)rounds,
                       fusion_name(formats[f]), dtype_name(formats[f].pool_dtype), dtype_name(formats[f].q_out_dtype),
                       formats[f].k_rot ? "yes" : "no", kv_layout_name(formats[f].kv_layout),
                       (long long)formats[f].page_size);
        BenchConfig c = with_format(cfg, formats[f]);
        c.iters = cfg.iters > 0 ? (cfg.iters + rounds - 1) / rounds : 0;
        c.seconds = cfg.seconds / double(rounds);
        TokenResult r = run_tokens(c, T, rotate_bytes);
        r.format = formats[f];
        if (round > 0) r.samples.insert(r.samples.begin(), acc.samples.begin(), acc.samples.end());
        acc = std::move(r);
      }
    for (TokenResult& r : at_t) {
      r.calls = int64_t(r.samples.size());
      r.seconds = percentiles(r.samples);
      r.gbps = r.samples.empty() ? 0 : r.bytes_per_call / r.seconds.median * 1e-9;
      all_ok = all_ok && r.ok();
      if (r.ok())
        std::fprintf(stderr, "%s T=%lld: median %.2f us, %.2f GB/s\n", stage_prefix, (long long)T,
                     r.seconds.median * 1e6, r.gbps);
      results.push_back(std::move(r));
    }
  }

  std::fprintf(stderr, "%s memcpy anchor again\n", stage_prefix);
  const CopyResult copy_after = measure_memcpy(copy_bytes, cfg.threads, 7);
  const CopyResult& copy = copy_after.gbps > copy_before.gbps ? copy_after : copy_before;
  for (const CopyResult* c : {&copy_before, &copy_after})
    std::printf(
        "memcpy %s: %zu MiB buffer, %d thread(s): %.2f GB/s (median of %d; p10 %.2f, p90 %.2f "
        "GB/s; bytes = read + written)\n",
        c == &copy_before ? "before" : "after ", copy_bytes >> 20, cfg.threads, c->gbps, c->reps,
        2.0 * double(copy_bytes) / c->seconds.p90 * 1e-9,
        2.0 * double(copy_bytes) / c->seconds.p10 * 1e-9);
  std::printf("the memcpy column is GB/s over the faster of the two (%.2f GB/s)\n\n", copy.gbps);
  // With several formats, each row starts with its format.
  const bool format_columns = formats.size() > 1, fusion_column = fusions.size() > 1;
  auto print_format = [&](const TokenResult& r) {
    if (fusion_column) std::printf("%-13s ", fusion_name(r.format));
    if (format_columns)
      std::printf("%-14s %-14s %-5s %-4s %4lld ", dtype_name(r.format.pool_dtype),
                  dtype_name(r.format.q_out_dtype), r.format.k_rot ? "yes" : "no",
                  kv_layout_name(r.format.kv_layout), (long long)r.format.page_size);
  };
  if (fusion_column) std::printf("%-13s ", "fusion");
  if (format_columns)
    std::printf("%-14s %-14s %-5s %-4s %4s ", "pools", "q_rot", "k_rot", "kv", "page");
  std::printf("%7s %10s %5s %7s %11s %11s %11s %10s %8s %7s  %s\n", "tokens", "pool_slots", "sets",
              "calls", "median_us", "p10_us", "p90_us", "MB/call", "GB/s", "memcpy", "check");
  for (TokenResult& r : results) r.copy_ratio = r.gbps / copy.gbps;
  for (size_t i = 0; i < results.size(); ++i) {
    TokenResult& r = results[i];
    // the first format's row of the same T (results come in blocks of the formats, per T)
    const TokenResult& first = results[i / formats.size() * formats.size()];
    print_format(r);
    const double worst = std::max(r.q_check.worst, r.k_check.worst);
    char check[64];
    if (r.tokens == 0)
      std::snprintf(check, sizeof check, "ok, pools untouched");
    else
      std::snprintf(check, sizeof check, "ok, max err %.2f of bound", worst);
    if (r.ok()) {
      std::printf("%7lld %10lld %5lld %7lld %11.2f %11.2f %11.2f %10.3f %8.2f %6.0f%%  %s",
                  (long long)r.tokens, (long long)r.pool_slots, (long long)r.sets,
                  (long long)r.calls, r.seconds.median * 1e6, r.seconds.p10 * 1e6,
                  r.seconds.p90 * 1e6, r.bytes_per_call * 1e-6, r.gbps, r.copy_ratio * 100, check);
      if (format_columns && &first != &r && first.ok() && first.gbps > 0)
        std::printf("; %.2fx the first format's share", r.gbps / first.gbps);
      std::printf("\n");
    } else {
      std::printf("%7lld %10lld %5lld %7s %11s %11s %11s %10.3f %8s %7s  FAILED\n",
                  (long long)r.tokens, (long long)r.pool_slots, (long long)r.sets, "-", "-", "-",
                  "-", r.bytes_per_call * 1e-6, "-", "-");
      for (const CheckStats* c : {&r.q_check, &r.k_check, &r.pool_check})
        if (!c->ok())
          std::printf("        %lld of %lld checked elements/rows wrong; first: %s\n",
                      (long long)c->failures, (long long)c->elements, c->first_failure().c_str());
    }
  }
  const double load_at_end = load_average();
  std::printf("\nload average (1 min, includes this run): %.2f at start, %.2f at end\n",
              load_at_start, load_at_end);
  if (!cfg.json_path.empty())
    write_json(cfg, copy_before, copy_after, results, date, load_at_start, load_at_end);
  if (!all_ok) {
    std::printf("\nVERIFICATION FAILED: see the rows marked FAILED above\n");
    return 1;
  }
  return 0;
}

}  // namespace ropepool::cli
