// Internal host-side interface of the CUDA backend: the launch shape and a way to force one.
// Used by the launcher (rope_pool_cuda.cu), and through src/test_hooks.hpp by the CUDA test
// (tests/cuda) and benchmark (bench/cuda); not part of the public API.
#pragma once

#include <cstdint>

#include "../backend.hpp"

namespace ropepool::detail::cuda_launch {

/// How one call is launched (one CTA per token). The defaults (numeric fields 0,
/// `dedupe_rows` true) are what a library call uses: the heuristic chooses the shape.
struct LaunchConfig {
  int warps_per_cta = 0;  ///< 1..8
  /// Programmatic dependent launch: 1 on, -1 off, 0 default (on).
  int pdl = 0;
  /// Keep duplicate slots from mixing rows (SPEC §3): shared-memory scan or per-slot lock.
  /// Only the benchmark turns it off, to measure what it costs.
  bool dedupe_rows = true;
  /// An fp8 pool's k heads and v heads as two warp items: 0 default, on where the call takes
  /// no row lock (T <= kMaxScanTokens; a row's lock is held by one warp); -1 off (one kv item).
  int split_fp8_kv = 0;
  /// The pool variants' kernels (fp8 pool, fp8 q_out, or a paged pool in q's dtype; head_dim
  /// 128 tuned) without the 3-4 CTAs per SM register cap: 0 (default) where T <=
  /// cuda::kUncappedMaxTokens (small grids, where the cap buys no occupancy that matters); 1
  /// at every T; -1 off (the capped kernel at every T).
  int uncapped = 0;
  /// The uncapped kernel only: a token's warp items over this many CTAs (0 default: for fp8
  /// calls CTAs of two warps up to T = cuda::kSplitMaxTokens, so that a small call's e4m3
  /// work issues on more SMs; one CTA otherwise).
  int ctas_per_token = 0;
  /// An fp8 q_out where no row lock is taken: q units per lane per q item, 1, 2 or 4 (0
  /// default: cuda::kQUnitsFp8).
  int fp8_q_units = 0;
  /// A call whose pools and q_out are in q's dtype (head_dim 128 tuned, no QK norm): 1 runs
  /// it on the uncapped kernel of the paged variant (a 3-D pool as page size 1), so that
  /// ctas_per_token applies to it; 0 (default) the seed's or the paged kernels.
  int split_plain = 0;
  /// The head kernel (head_kernel.cuh: one unit per lane, a token over many short warps;
  /// head_dim 128 tuned, no QK norm, no row locks): 0 default (calls up to
  /// cuda::kHeadKernelMaxTokens tokens, cuda::kHeadKernelMaxTokensVariant on a pool variant,
  /// from 2 tokens in q's dtype, not with split_plain), 1 wherever it applies, -1 off.
  int head_kernel = 0;
};

/// Which kernel a problem runs on: a tuned head size, the generic 16-byte path, or the
/// scalar fallback (misaligned base pointer or stride, or a head size the 16-byte vectors do
/// not divide). The vector paths read q/k/v 16 bytes at a time and write each output with
/// accesses of as many elements (8 or 4 bytes for an fp8 pool or q_out).
enum class Path : uint8_t { Tuned, Vector, Scalar };

struct LaunchPlan {
  Path path = Path::Scalar;
  int vec_elems = 1;  ///< elements per access
  LaunchConfig config;      ///< the chosen shape
  int pool_write_mode = 0;  ///< cuda::PoolWriteMode
  int kv_items = 1;         ///< kv warp items per token (LaunchConfig::split_fp8_kv)
  int q_item_units = 4;     ///< q units per lane per q item (cuda::kQUnits, or kQUnitsFp8)
  bool uncapped = false;    ///< the kernel without the register cap (LaunchConfig::uncapped,
                            ///< split_plain; never for calls with a QK norm: they run the norm kernel)
  /// cuda::PoolVariant bits: 0 for pools in q's dtype with page size 1 (the seed's kernels);
  /// paged pools, fp8 pools and an fp8 q_out run kernels of their own.
  int pool_variant = 0;
  int64_t grid = 0;         ///< CTAs per token (LaunchConfig::ctas_per_token) times the tokens
  int ctas_per_token = 1;
  bool head_kernel = false;  ///< LaunchConfig::head_kernel: warps_per_cta warps per CTA
  int threads = 0;
  size_t shared_bytes = 0;
};

/// The plan `rope_pool_cuda` would use (no launch), with optional overrides.
LaunchPlan plan_launch(const RopePoolProblem& problem, const LaunchConfig& overrides = {});

/// `rope_pool_cuda` with forced launch parameters (the benchmark's and the test's entry point).
void rope_pool_cuda_with(const RopePoolProblem& problem, const LaunchConfig& overrides);

/// mla_rope_pool_fused (mla_kernel.cu): every launch from now on with CTAs of `warps` warps
/// (1 to 4), or with the launcher's choice again (0). Process-wide, for the MLA test and the
/// benchmark only: it is not synchronised with calls running on other threads.
void set_mla_warps_per_cta(int warps);

/// mla_rope_pool_fused: every launch from now on with q items of `units` 16-byte units per lane
/// (1, 2, 4 or 8; at least a head's units per lane and at most the kernel's, so 8 runs as 4 on
/// the NeoX vector path), or with the launcher's choice again (0). Same scope as above.
void set_mla_q_units_per_lane(int units);

}  // namespace ropepool::detail::cuda_launch
