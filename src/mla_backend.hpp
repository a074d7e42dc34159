// Kernel-facing parameters of mla_rope_pool_fused (SPEC §8): what its validation
// (src/mla_rope_pool.cpp) hands a backend. Everything here has been checked already;
// backends only assert.
#pragma once

#include <cstdint>

#include "backend.hpp"

namespace ropepool::detail {

struct MlaProblem {
  DType dtype = DType::Float32;        // q_pe, k_pe, kv_c, q_out, k_out
  DType cache_dtype = DType::Float32;  // dtype, or Float8E4M3FN (kv_scale)
  int64_t num_tokens = 0;
  int64_t num_heads = 0;   // H
  int64_t rope_dim = 0;    // R (even); the whole q_pe/k_pe head is rotated
  int64_t latent_dim = 0;  // L; a cache row holds L + R elements
  bool interleaved = true;
  Rows q_pe, q_out;        // [T, H, R]
  Rows k_pe, k_out;        // [T, R] (head_stride unused)
  Rows kv_c;               // [T, L] (head_stride unused)
  /// Cache row of slot s: data + (s / page_size) * page_stride + (s % page_size) * row_stride
  /// (head_stride unused). Token caches are page_size 1.
  PoolRows cache;
  int64_t page_size = 1;
  int64_t pool_size = 0;   // pages * page_size: the slot range of SPEC §3
  Scale kv_scale;          // fp8 caches only
  Index positions, slots;
  const double* inv_freq = nullptr;  // R/2 entries, host memory
  double attention_scaling = 1.0;
  bool check_slots = false;
  void* stream = nullptr;
};

/// SPEC §3 for MLA on host-readable slots, with the op's name in the messages.
void mla_check_slot_values(const Index& slots, int64_t T, int64_t P, bool reject_duplicates);

/// CPU backend: synchronous; slots already range-checked.
void mla_rope_pool_cpu(const MlaProblem& problem);
/// CUDA backend (built when ROPEPOOL_WITH_CUDA): asynchronous on problem.stream; an
/// out-of-range slot is never written and is reported like rope_pool_fused's (SPEC §3).
void mla_rope_pool_cuda(const MlaProblem& problem);

}  // namespace ropepool::detail
