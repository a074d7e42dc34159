// Pieces of validation that more than one op's validation layer uses (src/rope_pool.cpp,
// src/mla_rope_pool.cpp): view comparisons, an unset optional output, stride printing and
// SPEC §1's angle limit.
#pragma once

#include <cstdint>
#include <string>

#include "backend.hpp"
#include "ropepool/schedule.hpp"
#include "ropepool/tensor.hpp"

namespace ropepool::detail {

bool same_shape(const TensorView& a, const TensorView& b);
/// A default TensorView (no data, no dimensions): how a call leaves out an optional output,
/// k_out for SPEC §4's and §8's return_k_rot=False.
inline bool unset_view(const TensorView& v) { return v.data == nullptr && v.ndim == 0; }
/// The same memory, dtype, shape and strides (of every dimension of extent > 1): an output
/// that is its input (in-place rotation).
bool same_view(const TensorView& a, const TensorView& b);
/// "(8192, 128, 1)".
std::string strides_str(const TensorView& v);
/// SPEC §1: every |positions[t] * inv_freq[i]| within the limit of `b` (host positions
/// scanned, or the bound `b` assumes for device positions); throws ropepool::Error whose
/// message starts with `op` (e.g. "rope_pool_fused"). With `data_readable` false
/// (shapes-only validation, CallOptions::data_readable) the host positions are not scanned.
void check_angles(const char* op, const RopeSchedule& schedule, const BackendLimits& b,
                  const TensorView& positions, int64_t num_tokens, bool data_readable = true);

}  // namespace ropepool::detail
