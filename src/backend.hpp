// Kernel-facing parameters: what validation hands a backend. Everything here has been
// checked already (shapes, dtypes, layout, slot range on CPU); backends only assert.
#pragma once

#include <cstdint>

#include "ropepool/tensor.hpp"

namespace ropepool::detail {

/// Pointer + strides (in elements) of one [rows, heads, D] tensor whose last dimension is
/// contiguous.
struct Rows {
  void* data = nullptr;
  int64_t row_stride = 0;   // between tokens (or pool slots)
  int64_t head_stride = 0;  // between heads
};

/// A KV-cache pool (SPEC §6): slot s lives in page s / page_size, row s % page_size, at
/// data + page * page_stride + row * row_stride + head * head_stride (strides in elements of
/// the pool's dtype). A 3-D [P, Hk, D] pool is page_size 1 (page_stride = its slot stride,
/// row_stride 0); kv_layout "NHD" [pages, page_size, Hk, D] and "HND"
/// [pages, Hk, page_size, D] only differ in which strides are which.
struct PoolRows {
  void* data = nullptr;
  int64_t page_stride = 0;
  int64_t row_stride = 0;
  int64_t head_stride = 0;
};

/// A quantisation scale (SPEC §6): stored = e4m3(x / scale). `ptr`, when set, points to one
/// float32 in the tensors' memory (device memory on CUDA), read when the kernel runs, so a
/// CUDA graph sees the current value; otherwise `value` is used.
struct Scale {
  float value = 1.0f;
  const float* ptr = nullptr;
};

struct Index {
  const void* data = nullptr;
  int64_t stride = 1;
  bool is_int64 = false;
  int64_t operator[](int64_t t) const {
    return is_int64 ? static_cast<const int64_t*>(data)[t * stride]
                    : static_cast<const int32_t*>(data)[t * stride];
  }
};

struct RopePoolProblem {
  DType dtype = DType::Float32;        // q, k, v and k_out
  DType pool_dtype = DType::Float32;   // k_pool, v_pool: dtype, or Float8E4M3FN (k_scale, v_scale)
  DType q_out_dtype = DType::Float32;  // q_out: dtype, or Float8E4M3FN (q_scale)
  int64_t num_tokens = 0;
  int64_t num_qo_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;   // R <= head_dim; elements >= R are copied
  bool interleaved = false; // GPT-J pairs (2i, 2i+1) instead of NeoX (i, i + R/2)
  int64_t pool_size = 0;  // pages * page_size: the slot range of SPEC §3
  int64_t page_size = 1;  // 1 for 3-D pools
  Rows q, k, v, q_out, k_out;  // k_out.data null: no k_rot (SPEC §4 return_k_rot=False)
  PoolRows k_pool, v_pool;
  Scale k_scale, v_scale, q_scale;  // used only where the dtype above is Float8E4M3FN
  Index positions, slots;
  const double* inv_freq = nullptr;  // R/2 entries, host memory
  double attention_scaling = 1.0;
  bool check_slots = false;
  void* stream = nullptr;

  // SPEC §7 (defaults: off). mRoPE: positions [3, T] (row r at positions.data + r *
  // positions_row_stride elements); frequency i reads row mrope_axis(mrope_section,
  // mrope_interleaved, i) (include/ropepool/schedule.hpp).
  bool mrope = false;
  int64_t mrope_section[3] = {0, 0, 0};
  bool mrope_interleaved = false;
  int64_t positions_row_stride = 0;
  // QK norm: a [head_dim] weight (dtype: `dtype` or Float32, contiguous, on the tensors'
  // device) per normalised tensor, nullptr = that tensor is not normalised.
  const void* q_norm_weight = nullptr;
  const void* k_norm_weight = nullptr;
  DType q_norm_dtype = DType::Float32, k_norm_dtype = DType::Float32;
  float norm_eps = 1e-6f;
  bool norm_gemma = false;  // y = x * rsqrt(mean(x^2) + eps) * (1 + w) in float32, one rounding
};

/// What a backend can run, asked by validation before any backend runs (CUTLASS's
/// can_implement): a call beyond a limit is rejected there with a message naming the
/// argument, its value and the limit; the backend only asserts. 0 = no limit.
struct BackendLimits {
  const char* name = "cpu";
  int64_t max_rotary_dim = 0;        ///< rotary_dim
  int64_t max_heads_x_head_dim = 0;  ///< num_qo_heads * head_dim and num_kv_heads * head_dim
  int64_t max_tokens = 0;            ///< T of one call
  int64_t max_device_index = -1;     ///< the device index of the tensors; -1 = no limit
  /// Largest |positions[t] * inv_freq[i]| (radians) whose reduction keeps SPEC §1's bound.
  double max_angle = 0;
  /// When positions are not readable on the host (device memory, no synchronisation): the
  /// |position| the angle check assumes. 0 = positions are scanned on the host.
  double assumed_max_position = 0;
};
BackendLimits cpu_limits();
BackendLimits cuda_limits();  // available without the CUDA backend too (cuda_stub.cpp)

/// SPEC §1: the documented angle limit, 2^32 rad. Both backends form the angle in double
/// (53 bits: at 2^32 rad the product is within 2^-21 rad) and reduce it by 2*pi with an
/// error below 2^-22 rad there, far inside the 2^-18 * (|a| + |b|) term of the bound.
inline constexpr double kMaxAngle = 4294967296.0;

/// SPEC §7 on CUDA: the fusion kernel (src/cuda/fusion_kernel.cuh, kFusionMaxHeadDim) keeps
/// a head per warp in shared memory, so head_dim is limited there.
inline constexpr int64_t kCudaFusionMaxHeadDim = 2048;

/// SPEC §3 on host-readable slots: throws ropepool::Error for the first slot >= P and, when
/// reject_duplicates, for the first repeated non-negative slot.
void check_slot_values(const Index& slots, int64_t T, int64_t P, bool reject_duplicates);

/// CPU backend: synchronous. Expects slots already range-checked (and, with
/// check_slots, free of duplicates).
void rope_pool_cpu(const RopePoolProblem& problem);

/// CUDA backend (built when ROPEPOOL_WITH_CUDA): asynchronous on problem.stream.
void rope_pool_cuda(const RopePoolProblem& problem);
bool cuda_backend_available();

}  // namespace ropepool::detail
