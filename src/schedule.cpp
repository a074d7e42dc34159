#include "ropepool/schedule.hpp"

#include <cmath>

namespace ropepool {

RopeSchedule make_rope_schedule(const RopePoolParams& params) {
  RopeSchedule s;
  s.rotary_dim = params.head_dim;
  const int64_t half = s.rotary_dim / 2;
  s.inv_freq.resize(static_cast<size_t>(half));
  // Double precision: at position 2^20 an inv_freq off by one float32 ulp moves the
  // angle by ~0.06 rad, far outside the SPEC §1 bound.
  for (int64_t i = 0; i < half; ++i)
    s.inv_freq[i] = std::pow(params.rope_base, -2.0 * double(i) / double(s.rotary_dim));
  return s;
}

}  // namespace ropepool
