// Multi-head latent attention (DeepSeek V2/V3, Kimi K2), SPEC §8: rotate the rotary part of
// every query head and the one shared rotary key, and write concat(kv_c, k_pe_rot) into a
// slot-indexed latent cache, in one pass.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "ropepool/rope_scaling.hpp"
#include "ropepool/tensor.hpp"

namespace ropepool {

struct RopeSchedule;  // schedule.hpp

/// The caller's arguments (T tokens, H query heads, R = rope_dim, L = the latent size). Every
/// tensor lives on one device; q_out/k_out are caller-allocated (the library never
/// allocates) and may be q_pe/k_pe themselves (in-place rotation).
/// `k_out` left empty (a default TensorView: no data, no dimensions) asks for no k_pe_rot
/// (SPEC §8, Python's return_k_rot=False): k_pe is only read, and nothing but q_out and the
/// cache rows is written.
struct MlaTensors {
  TensorView q_pe;       ///< [T, H, R], float32 / float16 / bfloat16; often a view of q [T, H, 192]
  TensorView k_pe;       ///< [T, R] or [T, 1, R], q_pe's dtype
  TensorView kv_c;       ///< [T, L], q_pe's dtype
  TensorView positions;  ///< [T], int32 or int64
  TensorView slots;      ///< [T], int32 or int64; negative = no cache write
  /// [P, L + R] (MlaCacheLayout::Token) or [pages, page_size, L + R] (NHD); q_pe's dtype or
  /// float8_e4m3fn. Updated in place.
  TensorView kv_cache;
  TensorView q_out;  ///< q_pe's shape and dtype: receives q_pe_rot
  TensorView k_out;  ///< k_pe's shape and dtype: receives k_pe_rot; empty: no k_pe_rot
  /// Optional: a one-element float32 tensor on the cache's device holding the fp8 scale, read
  /// when the kernel runs (replaces MlaParams::kv_scale). Only with a float8_e4m3fn cache.
  TensorView kv_scale;
};

enum class MlaCacheLayout : uint8_t {
  Token,  ///< kv_cache [P, L + R]
  NHD,    ///< kv_cache [pages, page_size, L + R]: slot s is page s / page_size, row s % page_size
};

/// Keyword parameters of SPEC §8 (the schedule ones as in RopePoolParams, SPEC §4).
struct MlaParams {
  double rope_base = 10000;  ///< > 0 and finite
  bool interleaved = true;   ///< GPT-J pairs (x[2i], x[2i+1]), what DeepSeek's weights expect
  RopeScaling rope_scaling;  ///< e.g. DeepSeek's yarn with mscale / mscale_all_dim
  TensorView inv_freq;       ///< R/2 float32 inverse frequencies on the CPU (replaces the above)
  std::optional<double> attention_scaling;  ///< multiplies cos and sin
  const RopeSchedule* schedule = nullptr;   ///< precomputed (make_rope_schedule), rotary_dim R
  MlaCacheLayout kv_layout = MlaCacheLayout::Token;
  /// fp8 cache only: stored = e4m3(x / kv_scale) (SPEC §6's rule); unset = 1.0. A float that
  /// is not finite and > 0 is an error. Exclusive with MlaTensors::kv_scale.
  std::optional<double> kv_scale;
};

/// How a shape prints in messages: `name` is the argument ("q_pe", "kv_cache", ...).
using MlaShapeFormatter = std::function<std::string(const char* name, const TensorView&)>;

struct MlaCallOptions {
  /// Strict slot checking: also reject two tokens with the same slot. On CUDA it also makes
  /// the call wait for the device and raise an out-of-range slot at once.
  bool check_slots = false;
  /// cudaStream_t to run on (CUDA only); nullptr = the legacy default stream.
  void* stream = nullptr;
  MlaShapeFormatter format_shape;  ///< default: "[2, 128, 64]"
  /// false: the tensors' data pointers may be null (shapes-only validation while a framework
  /// traces a call, e.g. JAX or MLX, with positions and slots given as stand-in values).
  /// Only validate_mla_rope_pool takes it; mla_rope_pool_fused rejects it.
  bool data_readable = true;
};

/// Runs the op (SPEC §8). Validates everything first and throws ropepool::Error before
/// writing anything; on the CPU the call is synchronous. Rows of kv_cache named by a slot
/// >= 0 become concat(kv_c[t], k_pe_rot[t]) (kv_c bit for bit unless the cache is fp8);
/// every other byte of the cache is unchanged.
void mla_rope_pool_fused(const MlaTensors& tensors, const MlaParams& params,
                         const MlaCallOptions& options = {});

/// Only the validation of mla_rope_pool_fused (no slot scan on CUDA tensors): throws the
/// same ropepool::Error the op would, writes nothing.
void validate_mla_rope_pool(const MlaTensors& tensors, const MlaParams& params,
                            const MlaCallOptions& options = {});

}  // namespace ropepool
