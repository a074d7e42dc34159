// `ropepool bench --mla`: mla_rope_pool_fused on the CPU at DeepSeek-V3's shape (R = 64,
// L = 512; H = 128 query heads as in a TP-1 run and 16 as in TP-8; bfloat16 and fp8 caches),
// every first call checked with the MLA test kit, GB/s next to a memcpy of the same run.
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
[T, 576] projection output, a token cache of max(65536, 4T) rows, GPT-J pairs, bfloat16
inputs, int32 positions below 2^20 and distinct random slots (~12% skipped). Each
(H, cache dtype, T) is checked once against the float64 reference (every q_pe_rot/k_pe_rot
element within the SPEC §1 bound, every cache row by SPEC §8, every other byte unchanged),
then timed: median of the calls that fit in --seconds.

bytes per call = T*(2*H*R + 2*R + L)*2 + T*(L + R)*cache_elem + 8*T
(q_pe, k_pe, kv_c read; q_pe_rot, k_pe_rot, cache rows written; positions, slots), set next
to the memcpy bandwidth of the same run (read + written, like `ropepool bench`). Inputs of
small T stay in cache between calls, which flatters them.

options:
  --threads N       worker threads (default: ROPEPOOL_NUM_THREADS or all hardware threads)
  --tokens LIST     token counts (default 1,16,256,4096)
  --heads LIST      query heads (default 128,16)
  --seconds S       timing budget per row (default 0.5)
  --copy-mib N      memcpy anchor buffer in MiB (default 256)
  -h, --help        this text
)";

}  // namespace

int run_bench_mla(Args& args) {
  int threads = cpu_num_threads();
  std::vector<int64_t> tokens = {1, 16, 256, 4096}, heads = {128, 16};
  double seconds = 0.5;
  int64_t copy_mib = 256;
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
    } else if (o == "--seconds") {
      seconds = parse_double(o, args.value(o));
    } else if (o == "--copy-mib") {
      copy_mib = parse_int(o, args.value(o), 1);
    } else {
      args.unknown(o);
    }
  }
  set_cpu_num_threads(threads);
  std::printf("ropepool %s bench --mla\nCPU: %s, %u hardware threads; ropepool threads: %d\n",
              kVersion, cpu_model().c_str(), std::thread::hardware_concurrency(), threads);
  const double copy_before = memcpy_gbps(size_t(copy_mib) << 20, threads, 7);
  struct Row {
    int64_t H, T;
    DType cache;
    double median_us = 0, gbps = 0;
    bool ok = false;
    std::string failure;
  };
  std::vector<Row> rows;
  Rng rng(20240601);
  for (int64_t H : heads)
    for (DType cache : {DType::BFloat16, DType::Float8E4M3FN})
      for (int64_t T : tokens) {
        MlaShape s;
        s.dtype = DType::BFloat16;
        s.cache_dtype = cache;
        s.num_heads = H;
        s.num_tokens = T;
        s.pool_size = std::max<int64_t>(65536, 4 * T);
        s.rope_scaling = deepseek_v3_yarn();
        if (cache == DType::Float8E4M3FN) s.kv_scale = 0.5;
        MlaCase c(s);
        c.randomize(rng);
        const MlaCase::Snapshot before = c.snapshot();
        Row r{H, T, cache};
        mla_rope_pool_fused(c.tensors, c.params);
        const std::vector<std::string> problems = c.check(before, std::max(1, threads));
        r.ok = problems.empty();
        if (!r.ok) {
          r.failure = problems.front();
          rows.push_back(r);
          continue;
        }
        std::vector<double> samples;
        const auto budget = Clock::now();
        while (samples.size() < 10 ||
               (std::chrono::duration<double>(Clock::now() - budget).count() < seconds &&
                samples.size() < 100000)) {
          const auto t0 = Clock::now();
          mla_rope_pool_fused(c.tensors, c.params);
          samples.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        }
        std::sort(samples.begin(), samples.end());
        const double median = samples[samples.size() / 2];
        const int64_t R = s.rope_dim, L = s.latent_dim;
        const double bytes = double(T) * double((2 * H * R + 2 * R + L) * 2) +
                             double(T) * double((L + R) * int64_t(dtype_size(cache))) + 8.0 * T;
        r.median_us = median * 1e6;
        r.gbps = bytes / median * 1e-9;
        rows.push_back(r);
        std::fprintf(stderr, "[ropepool bench --mla] H=%lld %s T=%lld: %.2f us\n", (long long)H,
                     dtype_name(cache), (long long)T, r.median_us);
      }
  const double copy_after = memcpy_gbps(size_t(copy_mib) << 20, threads, 7);
  const double copy = std::max(copy_before, copy_after);
  std::printf("memcpy (%lld MiB, %d threads, read + written): %.2f GB/s before, %.2f after; "
              "ratios use the faster\n\n",
              (long long)copy_mib, threads, copy_before, copy_after);
  std::printf("%5s %14s %7s %11s %8s %7s  %s\n", "heads", "cache", "tokens", "median_us", "GB/s",
              "memcpy", "check");
  bool all_ok = true;
  for (const Row& r : rows) {
    all_ok = all_ok && r.ok;
    if (r.ok)
      std::printf("%5lld %14s %7lld %11.2f %8.2f %6.0f%%  ok\n", (long long)r.H,
                  dtype_name(r.cache), (long long)r.T, r.median_us, r.gbps, 100 * r.gbps / copy);
    else
      std::printf("%5lld %14s %7lld %11s %8s %7s  FAILED: %s\n", (long long)r.H,
                  dtype_name(r.cache), (long long)r.T, "-", "-", "-", r.failure.c_str());
  }
  return all_ok ? 0 : 1;
}

}  // namespace ropepool::cli
