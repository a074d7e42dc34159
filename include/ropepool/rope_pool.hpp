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
/// `k_out` left empty (a default TensorView: no data, no dimensions) asks for no k_rot
/// (SPEC §4, Python's return_k_rot=False): k is only read, and nothing but q_out and the
/// pools is written.
struct RopePoolTensors {
  TensorView q;          ///< [T, Hq, D], float32 / float16 / bfloat16
  TensorView k;          ///< [T, Hk, D], same dtype
  TensorView v;          ///< [T, Hk, D], same dtype
  TensorView positions;  ///< [T], int32 or int64
  TensorView slots;      ///< [T], int32 or int64; negative = no pool write
  /// [P, Hk, D] (or 4-D with RopePoolParams::kv_layout), q's dtype or float8_e4m3fn (both
  /// pools); any strides with a contiguous last dimension; updated in place.
  TensorView k_pool;
  TensorView v_pool;     ///< as k_pool
  /// [T, Hq, D], receives q_rot: q's dtype, or float8_e4m3fn (quantised with q_scale).
  TensorView q_out;
  TensorView k_out;      ///< [T, Hk, D], q's dtype, receives k_rot; empty: no k_rot
};

/// How 4-D pools are laid out (SPEC §6); slot s is page s / page_size, row s % page_size.
enum class KvLayout : uint8_t {
  None,  ///< pools are [P, Hk, D]
  NHD,   ///< pools are [pages, page_size, Hk, D]
  HND,   ///< pools are [pages, Hk, page_size, D]
};
/// "none", "NHD", "HND".
const char* kv_layout_name(KvLayout layout);
/// "NHD" / "HND" (as FlashInfer spells them); anything else throws ropepool::Error.
KvLayout parse_kv_layout(const std::string& name);

/// A quantisation scale of SPEC §6 (fp8 pools, fp8 q_out): stored = e4m3(x / scale).
/// Unset (the default: 1.0 where it is used), a number (rounded to float32; finite and > 0),
/// or a one-element float32 tensor on the tensors' device, read when the kernel runs (so a
/// CUDA graph sees its current value). Not both.
struct QuantScale {
  std::optional<double> value;
  TensorView tensor;  ///< set when tensor.data != nullptr or tensor.ndim != 0
  bool has_tensor() const { return tensor.data != nullptr || tensor.ndim != 0; }
  bool given() const { return value.has_value() || has_tensor(); }
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

  // SPEC §6 (all optional; the defaults give 3-D pools in q's dtype).
  KvLayout kv_layout = KvLayout::None;  ///< 4-D paged pools (NHD / HND)
  QuantScale k_scale;  ///< float8_e4m3fn pools only: k_pool stores e4m3(rotated k / k_scale)
  QuantScale v_scale;  ///< float8_e4m3fn pools only: v_pool stores e4m3(v / v_scale)
  QuantScale q_scale;  ///< float8_e4m3fn q_out only: q_out stores e4m3(rotated q / q_scale)
  // SPEC §7: per-head RMSNorm of q and/or k before RoPE (Qwen3, Gemma 3). Multimodal RoPE
  // is rope_scaling.mrope_section / mrope_interleaved (positions [3, T]).
  TensorView q_norm_weight;  ///< [head_dim], q's dtype or float32, on q's device; none = no q norm
  TensorView k_norm_weight;  ///< [head_dim], likewise for k (the pool gets the normalised k)
  std::optional<double> norm_eps;          ///< finite and > 0; unset = 1e-6
  std::optional<std::string> norm_style;   ///< "rms" (unset: Qwen3RMSNorm) or "gemma" (1 + w)
};

/// Which argument a shape in a message belongs to (for ShapeFormatter).
enum class Arg : uint8_t { q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, k_scale, v_scale, q_scale };

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
