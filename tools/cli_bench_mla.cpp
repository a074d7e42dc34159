// `ropepool bench --mla`: mla_rope_pool_fused on the CPU at DeepSeek-V3's shape (R = 64,
// L = 512; H = 128 query heads as in a TP-1 run and 16 as in TP-8; bfloat16 and fp8 caches),
// checked with the MLA test kit, timed on cold inputs, GB/s next to a memcpy of the same run.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "cli_common.hpp"
#include "ropepool_mla_kit.hpp"

namespace ropepool::cli {
namespace {

using Clock = std::chrono::steady_clock;

const char* kHelp = R"(usage: ropepool bench --mla [options]

Times mla_rope_pool_fused on the CPU at DeepSeek-V3's shape (config.json: qk_rope_head_dim
64, kv_lora_rank 512, rope_theta 10000, yarn factor 40 from 4096, beta_fast 32, beta_slow 1,
mscale = mscale_all_dim = 1.0): q_pe a view of q [T, H, 192], k_pe and kv_c columns of one
[T, 576] projection output, a token cache of max(65536, 4 x tokens of all sets) rows, GPT-J
pairs, bfloat16 inputs, int32 positions below 2^20 and distinct random slots (~12% skipped).

Cold inputs: each call takes the next of `sets` input sets (consecutive T-token slices of one
case), as many as make --rotate-mib, so a call does not find its inputs in cache from the
previous one (as the next layer of a model would not). Checked first: one call over all the
sets' tokens against the float64 reference (every q_pe_rot/k_pe_rot element within the SPEC
§1 bound, every cache row by SPEC §8, every other byte unchanged); after the timed calls,
every buffer must still hold exactly what that checked call wrote. Reported: median, p10 and
p90 of the calls that fit in --seconds (at least 10, after 3 warm-up calls).

--k-rot no: the calls write no k_pe_rot (k_out left empty, SPEC §8 return_k_rot=False); the
check is the same call with k_pe_rot first, then the call without it, which must leave every
buffer but k_out's as that call did (q_pe_rot and the whole cache bit for bit) and k_out's
untouched.

bytes per call = T*(2*H*R + 2*R + L)*2 + T*(L + R)*cache_elem + 8*T
(q_pe, k_pe, kv_c read; q_pe_rot, k_pe_rot, cache rows written; positions, slots; --k-rot no:
T*R*2 fewer, no k_pe_rot written), set next to the memcpy bandwidth of the same run (read +
written, measured before and after the op, the faster counts; the buffer as in `ropepool
bench`).

options:
  --threads N       worker threads (default: ROPEPOOL_NUM_THREADS or all hardware threads)
  --tokens LIST     token counts (default 1,16,256,4096,16384)
  --heads LIST      query heads (default 128,16)
  --cache LIST      cache dtypes, bfloat16 and/or fp8 (default bfloat16,fp8)
  --k-rot LIST      yes (default: k_pe_rot written to k_out) and/or no (k_out left empty,
                    return_k_rot=False: only q_pe_rot and the cache rows are written);
                    yes,no puts both rows of a shape next to each other
  --seconds S       timing budget per row (default 0.5)
  --copy-mib N      memcpy anchor buffer in MiB (default 2 x L3, within 256..1024)
  --rotate-mib N    input bytes to rotate among (default 2 x L3, within 256..1024)
  -h, --help        this text
)";

struct Percentiles {
  double median = 0, p10 = 0, p90 = 0;
};

Percentiles percentiles(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  auto rank = [&](double q) { return v[size_t(std::floor(q * double(n - 1)))]; };
  return {n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]), rank(0.10), rank(0.90)};
}

// The tensors of one T-token slice (set `s`) of a case laid out for sets * T tokens.
MlaTensors slice(const MlaTensors& all, int64_t s, int64_t T) {
  MlaTensors t = all;
  for (TensorView* v : {&t.q_pe, &t.k_pe, &t.kv_c, &t.positions, &t.slots, &t.q_out, &t.k_out}) {
    v->data = static_cast<char*>(v->data) + s * T * v->strides[0] * int64_t(dtype_size(v->dtype));
    v->shape[0] = T;
  }
  return t;
}

}  // namespace

int run_bench_mla(Args& args) {
  int threads = cpu_num_threads();
  std::vector<int64_t> tokens = {1, 16, 256, 4096, 16384}, heads = {128, 16};
  std::vector<DType> caches = {DType::BFloat16, DType::Float8E4M3FN};
  std::vector<bool> k_rots = {true};
  double seconds = 0.5;
  int64_t copy_mib = 0, rotate_mib = 0;
  while (!args.done()) {
    const std::string o = args.next_option();
    if (o == "-h" || o == "--help") {
      std::fputs(kHelp, stdout);
      return 0;
    } else if (o == "--threads") {
      threads = int(parse_int(o, args.value(o), 1));
    } else if (o == "--tokens") {
      tokens = parse_int_list(o, args.value(o));
    } else if (o == "--heads") {
      heads = parse_int_list(o, args.value(o));
    } else if (o == "--cache") {
      caches.clear();
      std::string list = args.value(o);
      for (size_t b = 0; b <= list.size();) {
        const size_t e = std::min(list.find(',', b), list.size());
        const std::string name = list.substr(b, e - b);
        if (name == "bfloat16" || name == "bf16")
          caches.push_back(DType::BFloat16);
        else if (name == "fp8" || name == "float8_e4m3fn")
          caches.push_back(DType::Float8E4M3FN);
        else
          throw UsageError{"--cache: expected bfloat16 or fp8, got '" + name + "'"};
        b = e + 1;
      }
    } else if (o == "--k-rot") {
      k_rots.clear();
      std::string list = args.value(o);
      for (size_t b = 0; b <= list.size();) {
        const size_t e = std::min(list.find(',', b), list.size());
        const std::string name = list.substr(b, e - b);
        if (name != "yes" && name != "no")
          throw UsageError{"--k-rot must be yes or no (or a list of them), got '" + name + "'"};
        k_rots.push_back(name == "yes");
        b = e + 1;
      }
    } else if (o == "--seconds") {
      seconds = parse_double(o, args.value(o));
    } else if (o == "--copy-mib") {
      copy_mib = parse_int(o, args.value(o), 1);
    } else if (o == "--rotate-mib") {
      rotate_mib = parse_int(o, args.value(o), 1);
    } else {
      args.unknown(o);
    }
  }
  for (int64_t T : tokens)
    if (T < 1) throw UsageError{"--tokens: token counts must be >= 1"};
  set_cpu_num_threads(threads);
  const size_t l3 = l3_cache_bytes();
  const size_t big = std::clamp<size_t>(2 * l3, size_t(256) << 20, size_t(1) << 30);
  const size_t copy_bytes = copy_mib ? size_t(copy_mib) << 20 : big;
  const size_t rotate_bytes = rotate_mib ? size_t(rotate_mib) << 20 : big;
  const double load_at_start = load_average();
  std::printf("ropepool %s bench --mla\nCPU: %s, %u hardware threads, L3 %zu MiB; ropepool threads: %d\n",
              kVersion, cpu_model().c_str(), std::thread::hardware_concurrency(), l3 >> 20, threads);
  if (load_at_start > 0.5)
    std::fprintf(stderr,
                 "[ropepool bench --mla] note: load average %.2f before starting; other processes "
                 "compete for the CPU and memory bandwidth, figures will be low and noisy\n",
                 load_at_start);
  std::fflush(stdout);
  const double copy_before = memcpy_gbps(copy_bytes, threads, 7);
  struct Row {
    int64_t H, T, sets = 1, calls = 0;
    DType cache;
    bool k_rot = true;
    Percentiles us;
    double gbps = 0;
    bool ok = false;
    std::string failure;
  };
  std::vector<Row> rows;
  Rng rng(20240601);
  for (int64_t H : heads)
    for (DType cache : caches)
      for (int64_t T : tokens)
        for (bool k_rot : k_rots) {
          MlaShape s;
          s.dtype = DType::BFloat16;
          s.cache_dtype = cache;
          s.num_heads = H;
          const int64_t R = s.rope_dim, L = s.latent_dim;
          // What one token's slice of the case occupies: q rows [H, nope + R], the projection
          // row [L + R], q_out/k_out, positions (stride 2) and slots.
          const int64_t es = int64_t(dtype_size(s.dtype));
          const int64_t token_bytes = es * (H * (s.nope_dim + R) + L + R + H * R + R) + 3 * 4;
          Row r{H, T};
          r.cache = cache;
          r.k_rot = k_rot;
          r.sets = std::clamp<int64_t>(int64_t(rotate_bytes) / (T * token_bytes) + 1, 1, 4096);
          s.num_tokens = r.sets * T;
          s.pool_size = std::max<int64_t>(65536, 4 * s.num_tokens);
          s.rope_scaling = deepseek_v3_yarn();
          if (cache == DType::Float8E4M3FN) s.kv_scale = 0.5;
          MlaCase c(s);
          c.randomize(rng);
          {
            const MlaCase::Snapshot before = c.snapshot();
            mla_rope_pool_fused(c.tensors, c.params);
            std::vector<std::string> problems = c.check(before, std::max(1, threads));
            // --k-rot no: the same call again without k_pe_rot, the same bytes (k_out aside)
            if (!k_rot && problems.empty())
              problems = c.check_without_k_rot(before, {}, std::max(1, threads));
            r.ok = problems.empty();
            if (!r.ok) r.failure = problems.front();
          }
          if (!r.ok) {
            rows.push_back(r);
            continue;
          }
          const MlaCase::Snapshot checked = c.snapshot();
          std::vector<MlaTensors> sets;
          for (int64_t i = 0; i < r.sets; ++i) sets.push_back(slice(c.tensors, i, T));
          if (!k_rot)
            for (MlaTensors& t : sets) t.k_out = TensorView{};  // no k_pe_rot from here on
          std::vector<double> samples;
          int64_t call = 0;
          for (; call < 3; ++call) mla_rope_pool_fused(sets[size_t(call % r.sets)], c.params);
          const auto budget = Clock::now();
          while (samples.size() < 10 ||
                 (std::chrono::duration<double>(Clock::now() - budget).count() < seconds &&
                  samples.size() < 1000000)) {
            const MlaTensors& t = sets[size_t(call++ % r.sets)];
            const auto t0 = Clock::now();
            mla_rope_pool_fused(t, c.params);
            samples.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
          }
          // Every set's call rewrites exactly the bytes the checked call wrote.
          for (; call < 3 + r.sets; ++call)
            mla_rope_pool_fused(sets[size_t(call % r.sets)], c.params);
          const std::vector<std::string> changed = c.changes_since(checked);
          if (!changed.empty()) {
            r.ok = false;
            r.failure = "the timed calls changed what the checked call wrote: " + changed.front();
            rows.push_back(r);
            continue;
          }
          r.calls = int64_t(samples.size());
          r.us = percentiles(samples);
          for (double* v : {&r.us.median, &r.us.p10, &r.us.p90}) *v *= 1e6;
          const double bytes = double(T) * double((2 * H * R + (k_rot ? 2 : 1) * R + L) * es) +
                               double(T) * double((L + R) * int64_t(dtype_size(cache))) + 8.0 * T;
          r.gbps = bytes / r.us.median * 1e-3;
          rows.push_back(r);
          std::fprintf(stderr, "[ropepool bench --mla] H=%lld %s T=%lld k_rot=%s: %.2f us\n",
                       (long long)H, dtype_name(cache), (long long)T, k_rot ? "yes" : "no",
                       r.us.median);
        }
  const double copy_after = memcpy_gbps(copy_bytes, threads, 7);
  const double copy = std::max(copy_before, copy_after);
  const double load_at_end = load_average();
  std::printf("memcpy (%zu MiB, %d threads, read + written): %.2f GB/s before, %.2f after; "
              "ratios use the faster\n\n",
              copy_bytes >> 20, threads, copy_before, copy_after);
  std::printf("%5s %14s %5s %7s %5s %7s %11s %11s %11s %8s %7s  %s\n", "heads", "cache",
              "k_rot", "tokens", "sets", "calls", "median_us", "p10_us", "p90_us", "GB/s", "memcpy",
              "check");
  bool all_ok = true;
  for (const Row& r : rows) {
    all_ok = all_ok && r.ok;
    if (r.ok)
      std::printf("%5lld %14s %5s %7lld %5lld %7lld %11.2f %11.2f %11.2f %8.2f %6.0f%%  ok\n",
                  (long long)r.H, dtype_name(r.cache), r.k_rot ? "yes" : "no", (long long)r.T,
                  (long long)r.sets,
                  (long long)r.calls, r.us.median, r.us.p10, r.us.p90, r.gbps, 100 * r.gbps / copy);
    else
      std::printf("%5lld %14s %5s %7lld %5lld %7s %11s %11s %11s %8s %7s  FAILED: %s\n",
                  (long long)r.H, dtype_name(r.cache), r.k_rot ? "yes" : "no", (long long)r.T,
                  (long long)r.sets, "-", "-",
                  "-", "-", "-", "-", r.failure.c_str());
  }
  std::printf("\nload average (1 min, includes this run): %.2f at start, %.2f at end\n",
              load_at_start, load_at_end);
  return all_ok ? 0 : 1;
}

}  // namespace ropepool::cli
