// What the CUDA backend can run, as plain numbers for validation (src/rope_pool.cpp) in
// every build, with or without CUDA. rope_pool_cuda.cu checks them against the kernel's own
// constants at compile time.
#pragma once

#include <cstdint>

#include "../backend.hpp"

namespace ropepool::detail::cuda_limits_values {

inline constexpr int64_t kMaxRotaryDim = 512;  ///< 2 * cuda::kMaxHalfRotary (inv_freq by value)
/// Item indices inside a CTA are int: num_heads * head_dim (the scalar path's unit count, the
/// largest of any path) plus one item of slack (32 lanes * 4 units) stays below 2^24.
inline constexpr int64_t kMaxHeadsXHeadDim = (int64_t(1) << 24) - 32 * 4 - 1;
inline constexpr int64_t kMaxTokens = 0x7fffffff;  ///< one CTA per token: gridDim.x
inline constexpr int64_t kMaxDevices = 64;  ///< slot error records, one per device
/// Positions live on the device: the angle check assumes |position| <= 2^31 (the int32
/// range; int64 positions beyond it are the caller's responsibility, SPEC §1).
inline constexpr double kAssumedMaxPosition = 2147483648.0;

inline BackendLimits value() {
  BackendLimits l;
  l.name = "cuda";
  l.max_rotary_dim = kMaxRotaryDim;
  l.max_heads_x_head_dim = kMaxHeadsXHeadDim;
  l.max_tokens = kMaxTokens;
  l.max_device_index = kMaxDevices - 1;
  l.max_angle = kMaxAngle;
  l.assumed_max_position = kAssumedMaxPosition;
  return l;
}

}  // namespace ropepool::detail::cuda_limits_values
