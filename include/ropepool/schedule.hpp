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
  /// Multimodal RoPE (SPEC §7): empty, or [s_t, s_h, s_w] summing to rotary_dim/2; the
  /// positions are then [3, T] and frequency i reads row mrope_axis(*this, i).
  std::vector<int64_t> mrope_section;
  bool mrope_interleaved = false;
};

/// The row of positions [3, T] that frequency i of an mRoPE schedule reads (SPEC §7):
/// Qwen2-VL's contiguous sections (0 for i < s_t, 1 for i < s_t + s_h, else 2) or, with
/// mrope_interleaved (Qwen3-VL), 1 where i % 3 == 1 and i < 3 s_h, 2 where i % 3 == 2 and
/// i < 3 s_w, else 0.
inline int mrope_axis(const int64_t section[3], bool interleaved, int64_t i) {
  if (interleaved) {
    if (i % 3 == 1 && i < 3 * section[1]) return 1;
    if (i % 3 == 2 && i < 3 * section[2]) return 2;
    return 0;
  }
  return i < section[0] ? 0 : i < section[0] + section[1] ? 1 : 2;
}
inline int mrope_axis(const RopeSchedule& s, int64_t i) {
  return s.mrope_section.empty() ? 0 : mrope_axis(s.mrope_section.data(), s.mrope_interleaved, i);
}

/// The schedule of `params`: head_dim, rope_base, rotary_dim, rope_scaling, inv_freq and
/// attention_scaling (default: inv_freq[i] = rope_base ** (-2i / R), in double). Checks
/// them first and throws ropepool::Error, so it can be made once, e.g. at model load, and
/// passed as RopePoolParams::schedule.
RopeSchedule make_rope_schedule(const RopePoolParams& params);

/// Checks a schedule passed as RopePoolParams::schedule against the call (head_dim, its
/// rotary_dim, finite values); the call then reads it in place.
void check_precomputed_schedule(const RopePoolParams& params, const RopeSchedule& schedule);

}  // namespace ropepool
