// Kernel-facing parameters of mla_rope_pool_fused (SPEC §8): what its validation
// (src/mla_rope_pool.cpp) hands a backend. Everything here has been checked already;
// backends only assert.
#pragma once

#include <cstdint>

#include "backend.hpp"
#include "ropepool/half.hpp"

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
  Rows k_pe, k_out;        // [T, R] (head_stride unused); k_out.data null: no k_pe_rot
                           // (SPEC §8 return_k_rot=False)
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

/// ropepool::float_to_e4m3 (SPEC §6: round to nearest even, +-448 beyond, NaN kept) by
/// integer operations on the float's bits; equal to it for every float
/// (tests/cpp/test_mla.cpp). The CPU kernel now quantises with the main kernel's Highway code
/// (kernel_hwy-inl.h), so only that test calls this.
inline uint8_t e4m3_bits(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint8_t(sign | 0x7f);  // NaN
  if (a > 0x43e00000u) return uint8_t(sign | 0x7e);  // beyond 448, infinity included
  if (a < 0x3c800000u) {
    // below 2^-6: steps of 2^-9; a * 512 (exact) + 2^23 rounds to an integer, ties to even
    const float t = bits_float(a) * 512.0f + 8388608.0f;
    return uint8_t(sign | (float_bits(t) - 0x4b000000u));  // 8: the smallest normal
  }
  // normal: three mantissa bits, ties to even; a carry moves into the exponent
  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  return uint8_t(sign | ((r >> 20) - (120u << 3)));
}

/// SPEC §3 for MLA on host-readable slots, with the op's name in the messages.
void mla_check_slot_values(const Index& slots, int64_t T, int64_t P, bool reject_duplicates);

/// CPU backend: synchronous; slots already range-checked.
void mla_rope_pool_cpu(const MlaProblem& problem);
/// CUDA backend (built when ROPEPOOL_WITH_CUDA): asynchronous on problem.stream; an
/// out-of-range slot is never written and is reported like rope_pool_fused's (SPEC §3).
void mla_rope_pool_cuda(const MlaProblem& problem);

}  // namespace ropepool::detail
