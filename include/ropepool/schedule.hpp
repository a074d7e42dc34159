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
};

/// inv_freq[i] = rope_base ** (-2i / R), computed in double. Expects validated params.
RopeSchedule make_rope_schedule(const RopePoolParams& params);

}  // namespace ropepool
