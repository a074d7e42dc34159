// A plain float64 evaluation of the op, for tests, `ropepool verify` and `ropepool bench`.
#pragma once

#include <vector>

#include "ropepool/rope_pool.hpp"
#include "ropepool/schedule.hpp"

namespace ropepool::reference {

/// Reads element (t, h, d) of a float tensor view on the CPU as double.
double load(const TensorView& x, int64_t t, int64_t h, int64_t d);
/// Reads entry t of a 1-D int32/int64 CPU tensor view.
int64_t load_index(const TensorView& x, int64_t t);

/// Entry (row, t) of positions: [T] (row 0 only) or [3, T] (mRoPE, SPEC §7).
int64_t load_position(const TensorView& positions, int row, int64_t t);

/// The exact rotation of every element of x [T, H, D] (as read) in float64, row-major.
/// Pairs are (i, i + R/2), or (2i, 2i + 1) when interleaved. With an mRoPE schedule
/// (SPEC §7) frequency i takes its position from row mrope_axis(schedule, i) of
/// positions [3, T].
std::vector<double> rotate(const TensorView& x, const TensorView& positions,
                           const RopeSchedule& schedule, bool interleaved = false);
/// The same for values already read (row-major [T, H, D]), e.g. the output of normalize.
std::vector<double> rotate(const std::vector<double>& x, int64_t T, int64_t H, int64_t D,
                           const TensorView& positions, const RopeSchedule& schedule,
                           bool interleaved = false);

/// SPEC §7's per-head norm of x [T, H, D] with weight [D] (x's dtype or float32), row-major,
/// each value rounded to x's dtype where SPEC §7 rounds ("rms": x * rsqrt(mean(x^2) + eps)
/// rounded, times w, rounded; "gemma": x * rsqrt(mean(x^2) + eps) * (1 + w), rounded
/// once), the rest in float64.
std::vector<double> normalize(const TensorView& x, const TensorView& weight, double eps,
                              bool gemma);
/// x's value rounded to `dtype` (double -> float -> 16-bit, as `store` does).
double round_to(DType dtype, double x);

/// Address of element (slot, head, d) of a pool: [P, Hk, D], or 4-D paged as `layout` says
/// (SPEC §6: page slot / page_size, row slot % page_size).
void* pool_element(const TensorView& pool, KvLayout layout, int64_t slot, int64_t h, int64_t d);
/// A scale's value: the number, the tensor's float32 (CPU memory), or 1.0 when unset.
float scale_value(const QuantScale& scale);

/// The op computed from `normalize` (when params has norm weights, SPEC §7) and `rotate`,
/// each element rounded once to the tensors' dtype (fp8 pools and q_rot: the exact value
/// rounded to float32, divided by the scale in float32, then e4m3 by SPEC §6's rule). Same
/// contract as ropepool::rope_pool_fused (kv_layout and scales included), CPU tensors only,
/// no threading.
void rope_pool_fused(const RopePoolTensors& tensors, const RopePoolParams& params);

/// The accuracy bound of SPEC §1 for one element: one unit in the last place of `exact`
/// in `dtype`, plus 2^-18 * (|a| + |b|) where a, b are the pair's inputs.
double tolerance(DType dtype, double exact, double abs_a_plus_b);

}  // namespace ropepool::reference
