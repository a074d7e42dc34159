// The op: rotate q and k heads with RoPE and write rotated k and v into a slot-indexed
// KV-cache pool, in one pass (SPEC §1-§3).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "ropepool/rope_scaling.hpp"
#include "ropepool/tensor.hpp"

namespace ropepool {

struct RopeSchedule;  // schedule.hpp

/// The caller's arguments. Every tensor lives on one device; `q_out`/`k_out` are
/// caller-allocated outputs with the shapes of `q`/`k` (the library never allocates).
struct RopePoolTensors {
  TensorView q;          ///< [T, Hq, D], float32 / float16 / bfloat16
  TensorView k;          ///< [T, Hk, D], same dtype
  TensorView v;          ///< [T, Hk, D], same dtype
  TensorView positions;  ///< [T], int32 or int64
  TensorView slots;      ///< [T], int32 or int64; negative = no pool write
  TensorView k_pool;     ///< [P, Hk, D], updated in place
  TensorView v_pool;     ///< [P, Hk, D], updated in place
  TensorView q_out;      ///< [T, Hq, D], receives q_rot
  TensorView k_out;      ///< [T, Hk, D], receives k_rot
};

/// Keyword parameters of SPEC §1.
struct RopePoolParams {
  int64_t head_dim = 0;      ///< D, even and > 0
  int64_t num_qo_heads = 0;  ///< Hq
  int64_t num_kv_heads = 0;  ///< Hk
  double rope_base = 10000;  ///< > 0 and finite

  // SPEC §4 (all optional; the defaults give the seed behaviour).
  int64_t rotary_dim = 0;     ///< R: rotate the first R elements (even, <= head_dim); 0 = head_dim
  bool interleaved = false;   ///< GPT-J pairs (x[2i], x[2i+1]) instead of half-split (x[i], x[i+R/2])
  RopeScaling rope_scaling;   ///< Hugging Face rope_scaling variants
  /// Any other schedule: R/2 float32 inverse frequencies on the CPU (1-D). Replaces
  /// rope_base/rope_scaling.
  TensorView inv_freq;
  /// Multiplies cos and sin; replaces the schedule's own attention factor when set.
  std::optional<double> attention_scaling;
  /// A schedule made once by make_rope_schedule (e.g. at model load): used as is, instead
  /// of rope_base/rope_scaling/inv_freq/attention_scaling. Its rotary_dim must match.
  const RopeSchedule* schedule = nullptr;

  // SPEC §7: per-head RMSNorm of q and/or k before RoPE (Qwen3, Gemma 3). Multimodal RoPE
  // is rope_scaling.mrope_section / mrope_interleaved (positions [3, T]).
  TensorView q_norm_weight;  ///< [head_dim], q's dtype or float32, on q's device; none = no q norm
  TensorView k_norm_weight;  ///< [head_dim], likewise for k (the pool gets the normalised k)
  std::optional<double> norm_eps;          ///< finite and > 0; unset = 1e-6
  std::optional<std::string> norm_style;   ///< "rms" (unset: Qwen3RMSNorm) or "gemma" (1 + w)
};

/// Which argument a shape in a message belongs to (for ShapeFormatter).
enum class Arg : uint8_t { q, k, v, positions, slots, k_pool, v_pool, q_out, k_out };

/// Prints a tensor's shape the way the caller's framework does ("torch.Size([2, 8, 128])",
/// "(2, 8, 128)"). The default prints "[2, 8, 128]".
using ShapeFormatter = std::function<std::string(Arg, const TensorView&)>;

struct CallOptions {
  /// Strict slot checking: also reject two tokens with the same slot. On CUDA it also
  /// makes the call wait for the kernel and raise an out-of-range slot at once.
  bool check_slots = false;
  /// cudaStream_t to run on (CUDA only); nullptr = the legacy default stream.
  void* stream = nullptr;
  ShapeFormatter format_shape;
  /// false: the tensors' data may not be read (shapes-only validation while a framework
  /// traces a graph, e.g. JAX or MLX: data pointers may be null). The checks that read
  /// positions or slots on the host (the CPU angle scan of SPEC §1, the slot range of §3)
  /// are skipped; the call that runs with the data makes them. Only validate_rope_pool
  /// takes it; rope_pool_fused rejects it.
  bool data_readable = true;
};

/// Runs the op. Validates everything first (SPEC §2 order and messages) and throws
/// ropepool::Error before writing anything. On CPU the call is synchronous.
void rope_pool_fused(const RopePoolTensors& tensors, const RopePoolParams& params,
                     const CallOptions& options = {});

/// Only the validation of rope_pool_fused (no slot scan on CUDA tensors): throws the same
/// ropepool::Error the op would, writes nothing. With options.data_readable = false it
/// reads no tensor data (shapes, dtypes, strides and keywords only).
void validate_rope_pool(const RopePoolTensors& tensors, const RopePoolParams& params,
                        const CallOptions& options = {});

/// Number of CPU threads a call may use, the calling thread included (default:
/// ROPEPOOL_NUM_THREADS or all hardware threads). Process-wide; safe to read and set from
/// any thread, also while calls run (a call uses the value it reads at its start).
int cpu_num_threads();
/// n > 0 sets the count, clamped to 4 x the hardware threads (at least 8) so a huge n cannot
/// start thousands of workers; n <= 0 restores the default. Cheap: workers start lazily, when
/// a call first uses them, and a call wakes only the workers it uses.
void set_cpu_num_threads(int n);

}  // namespace ropepool
