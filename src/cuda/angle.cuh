// Device helpers every CUDA kernel of ropepool shares: index loads and the angle of SPEC §1
// (formed and reduced in double, so the accuracy bound holds up to the angle limit).
#pragma once

#include <cstdint>

namespace ropepool::cuda {

__device__ __forceinline__ int64_t load_index(const void* data, int64_t stride, bool is_int64,
                                              int64_t i) {
  return is_int64 ? __ldg(static_cast<const long long*>(data) + i * stride)
                  : int64_t(__ldg(static_cast<const int*>(data) + i * stride));
}

/// cos and sin of pos * inv_freq, times scale, to float32 accuracy for |pos| < 2^21.
/// The angle is formed and reduced to [-pi, pi] in double (one DMUL, a DFMA pair: Hopper
/// runs FP64 at half the FP32 rate and this is done once per (token, frequency)); __sincosf
/// is only used on the reduced angle, where its absolute error is below 2^-21.
__device__ __forceinline__ void angle_sincos(int64_t pos, double inv_freq, float scale,
                                             float* c, float* s) {
  constexpr double kTwoPiHi = 6.283185307179586232;     // 2*pi rounded to double
  constexpr double kTwoPiLo = 2.449293598294706414e-16;  // 2*pi - kTwoPiHi
  constexpr double kInvTwoPi = 0.15915494309189534561;
  const double theta = double(pos) * inv_freq;
  const double turns = rint(theta * kInvTwoPi);
  const double r = fma(-turns, kTwoPiLo, fma(-turns, kTwoPiHi, theta));
  float sr, cr;
  __sincosf(float(r), &sr, &cr);
  *c = cr * scale;
  *s = sr * scale;
}

}  // namespace ropepool::cuda
