// The RoPE frequency schedule: the one definition every backend and the reference use.
#pragma once

#include <cstdint>
#include <vector>

#include "ropepool/rope_pool.hpp"

namespace ropepool {

struct RopeSchedule {
  int64_t rotary_dim = 0;         ///< R: the first R elements of a head are rotated
  std::vector<double> inv_freq;   ///< R/2 inverse frequencies (radians per position)
  double attention_scaling = 1.0; ///< multiplies cos and sin (mscale)
  /// The rope_base it was made from (make_rope_schedule records it); a call passing this
  /// schedule must pass the same rope_base (SPEC §4: a disagreeing keyword is an error).
  /// 0 = made by hand, nothing to compare.
  double rope_base = 0;
};

/// The schedule of `params`: head_dim, rope_base, rotary_dim, rope_scaling, inv_freq and
/// attention_scaling (default: inv_freq[i] = rope_base ** (-2i / R), in double). Checks
/// them first and throws ropepool::Error, so it can be made once, e.g. at model load, and
/// passed as RopePoolParams::schedule.
RopeSchedule make_rope_schedule(const RopePoolParams& params);

/// Checks a schedule passed as RopePoolParams::schedule against the call (head_dim, its
/// rotary_dim, finite values); the call then reads it in place.
void check_precomputed_schedule(const RopePoolParams& params, const RopeSchedule& schedule);

}  // namespace ropepool
