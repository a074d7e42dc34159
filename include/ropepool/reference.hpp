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

/// The exact rotation of every element of x [T, H, D] (as read) in float64, row-major.
/// Pairs are (i, i + R/2), or (2i, 2i + 1) when interleaved.
std::vector<double> rotate(const TensorView& x, const TensorView& positions,
                           const RopeSchedule& schedule, bool interleaved = false);

/// The op computed from `rotate`, each element rounded once to the tensors' dtype.
/// Same contract as ropepool::rope_pool_fused, CPU tensors only, no threading.
void rope_pool_fused(const RopePoolTensors& tensors, const RopePoolParams& params);

/// The accuracy bound of SPEC §1 for one element: one unit in the last place of `exact`
/// in `dtype`, plus 2^-18 * (|a| + |b|) where a, b are the pair's inputs.
double tolerance(DType dtype, double exact, double abs_a_plus_b);

}  // namespace ropepool::reference
