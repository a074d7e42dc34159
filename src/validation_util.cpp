// Validation pieces shared by the ops' validation layers (validation_util.hpp).
#include "validation_util.hpp"

#include <cmath>

#include "format.hpp"
#include "ropepool/error.hpp"

namespace ropepool::detail {

bool same_shape(const TensorView& a, const TensorView& b) {
  if (a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] != b.shape[i]) return false;
  return true;
}

bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.dtype != b.dtype || !same_shape(a, b)) return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] > 1 && a.strides[i] != b.strides[i]) return false;
  return true;
}

std::string strides_str(const TensorView& v) {
  std::string s = "(";
  for (int i = 0; i < v.ndim; ++i) s += (i ? ", " : "") + std::to_string(v.strides[i]);
  return s + ")";
}

// SPEC §1: every accepted angle |positions[t] * inv_freq[i]| is one the reduction handles.
void check_angles(const char* op, const RopeSchedule& schedule, const BackendLimits& b,
                  const TensorView& positions, int64_t T, bool data_readable) {
  double max_f = 0;
  size_t arg_f = 0;
  for (size_t i = 0; i < schedule.inv_freq.size(); ++i)
    if (std::fabs(schedule.inv_freq[i]) > max_f) max_f = std::fabs(schedule.inv_freq[i]), arg_f = i;
  if (max_f == 0 || T == 0) return;
  // The message parts are built only when a call fails: this runs on every call.
  const char* limit = "the limit of 2^32 = 4294967296 rad that the angle reduction handles";
  auto freq = [&] { return "inv_freq[" + std::to_string(arg_f) + "] = " + py_float(max_f); };
  const char* hint = "check rope_base, rope_scaling or inv_freq (inverse frequencies are "
                     "radians per position, at most 1 for the standard schedules)";
  if (b.assumed_max_position > 0) {
    // Positions in device memory: the bound their range allows (no synchronisation).
    if (b.assumed_max_position * max_f > b.max_angle)
      throw Error(std::string(op) + ": positions up to 2^31 in magnitude times " + freq() +
                      " give angles up to " + py_float(b.assumed_max_position * max_f) +
                      " rad, beyond " + limit + " on the " + b.name + " backend",
                  hint);
    return;
  }
  // int32 positions cannot exceed 2^31: the default schedules (max inv_freq 1) never scan.
  if (positions.dtype == DType::Int32 && 2147483648.0 * max_f <= b.max_angle) return;
  if (!data_readable) return;  // shapes-only validation: the run scans
  // [T], or mRoPE's [3, T] (SPEC §7): every row
  const int rows = positions.ndim == 2 ? int(positions.shape[0]) : 1;
  const int64_t es = positions.dtype == DType::Int64 ? 8 : 4;
  for (int r = 0; r < rows; ++r) {
    const Index pos{static_cast<const char*>(positions.data) + r * positions.strides[0] * es,
                    positions.strides[positions.ndim - 1], positions.dtype == DType::Int64};
    for (int64_t i = 0; i < T; ++i) {
      const double theta = std::fabs(double(pos[i])) * max_f;
      if (theta > b.max_angle)
        throw Error(std::string(op) + ": positions[" + (rows > 1 ? std::to_string(r) + ", " : "") +
                        std::to_string(i) + "] = " + std::to_string(pos[i]) + " times " + freq() +
                        " is an angle of " + py_float(theta) + " rad, beyond " + limit,
                    hint);
    }
  }
}

}  // namespace ropepool::detail
