// Hooks the library exports for its own tests and benchmarks (tests/cpu, tests/cuda,
// bench/cuda), and nothing else: not part of the public API (include/ropepool/). They
// reach one level below rope_pool_fused: the kernel-facing problem, the CPU store and
// threading thresholds and norm path, the vector float conversions, the CUDA launch shape.
#pragma once

#include <cstdint>

#include "backend.hpp"
#include "cuda/launch.hpp"
#include "ropepool/rope_pool.hpp"
#include "ropepool/schedule.hpp"

namespace ropepool::detail {

/// Validates like rope_pool_fused and returns the problem it would hand a backend;
/// `schedule` receives the schedule made for it (problem.inv_freq may point into it).
RopePoolProblem backend_problem(const RopePoolTensors& tensors, const RopePoolParams& params,
                                const CallOptions& options, RopeSchedule& schedule);

namespace cpu {

/// Calls moving at least this many bytes use non-temporal stores (negative = never).
void set_stream_min_bytes(int64_t bytes);
int64_t stream_min_bytes();
/// Bytes of traffic per thread: smaller calls run on the caller alone.
void set_parallel_min_bytes(int64_t bytes);
int64_t parallel_min_bytes();
/// float32 -> dtype with the kernels' vector rounding (RNE, NaN kept NaN), and back.
void demote_row_hwy(DType dtype, const float* in, void* out, int64_t n);
void promote_row_hwy(DType dtype, const void* in, float* out, int64_t n);
/// out[i] = e4m3(in[i] / scale) with the kernels' vector quantisation (SPEC §6's rule).
void quantize_e4m3_row_hwy(const float* in, uint8_t* out, int64_t n, float scale);
/// The same for a bfloat16 row (the kernels' path for v rows of bfloat16 inputs).
void quantize_e4m3_bf16_row_hwy(const uint16_t* in, uint8_t* out, int64_t n, float scale);
/// How the bfloat16 kernel normalises a half-split head of whole (even, odd) chunks with
/// rotary_dim = head_dim (SPEC §7): kFused (the default) in registers inside the rotation,
/// kScratch in a pass of its own through a scratch row that the rotation reads. The same bits
/// either way (tests/cpu compare them).
enum class NormRows : int { kFused = 0, kScratch = 1 };
void set_norm_rows(NormRows rows);
NormRows norm_rows();
/// The Highway target the CPU kernel dispatches to now, e.g. "AVX3".
const char* hwy_target_name();

}  // namespace cpu
}  // namespace ropepool::detail
