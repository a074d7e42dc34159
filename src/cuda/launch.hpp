// Internal host-side interface of the CUDA backend: the launch shape and a way to force one.
// Used by the launcher (rope_pool_cuda.cu) and by the GPU self-test/tuning driver
// (src/cuda/selftest.cu); not part of the public API.
#pragma once

#include <cstdint>

#include "../backend.hpp"

namespace ropepool::detail::cuda_launch {

/// How one call is cut into CTAs. Every field 0 means "let the heuristic choose".
struct LaunchConfig {
  int warps_per_cta = 0;   ///< 1..8
  int tokens_per_cta = 0;  ///< tokens whose sin/cos table one CTA builds
  int ctas_per_tile = 0;   ///< CTAs sharing one tile's work items (decode: spread a token)
  /// Take the per-slot lock around pool-row writes (duplicate-slot safety, SPEC §3).
  /// Only the tuning driver turns it off, to measure what it costs.
  bool lock_rows = true;
};

/// Which kernel a problem runs on: a tuned head size, the generic 16-byte path, or the
/// scalar fallback (misaligned base pointer or stride, or a head size the 16-byte vectors do
/// not divide).
enum class Path : uint8_t { Tuned, Vector, Scalar };

struct LaunchPlan {
  Path path = Path::Scalar;
  int vec_elems = 1;  ///< elements per access
  LaunchConfig config;
  int64_t grid = 0;
  int threads = 0;
  size_t shared_bytes = 0;
};

/// The plan `rope_pool_cuda` would use (no launch), with optional overrides.
LaunchPlan plan_launch(const RopePoolProblem& problem, const LaunchConfig& overrides = {});

/// `rope_pool_cuda` with forced launch parameters (the tuning driver's entry point).
void rope_pool_cuda_with(const RopePoolProblem& problem, const LaunchConfig& overrides);

}  // namespace ropepool::detail::cuda_launch
