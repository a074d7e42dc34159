// The test kit for mla_rope_pool_fused (SPEC §8): one complete call laid out in poisoned,
// guarded host buffers the way DeepSeek's attention produces its inputs (q_pe a strided
// view of q [T, H, nope + R], kv_c and k_pe column slices of one projection output
// [T, L + R]), and one checker of the whole contract against the float64 reference.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ropepool_kit.hpp"
#include "ropepool/mla.hpp"

namespace ropepool::test {

struct MlaShape {
  DType dtype = DType::BFloat16;
  DType cache_dtype = DType::BFloat16;  ///< dtype, or Float8E4M3FN
  int64_t num_tokens = 4;
  int64_t num_heads = 16;
  int64_t rope_dim = 64;     ///< R (DeepSeek: qk_rope_head_dim)
  int64_t latent_dim = 512;  ///< L (DeepSeek: kv_lora_rank)
  int64_t nope_dim = 128;    ///< q rows are [nope | rope]; 0: q_pe is a contiguous tensor
  int64_t pool_size = 64;    ///< slots (pages * page_size when paged)
  int64_t page_size = 0;     ///< 0: token cache [P, L + R]; > 0: NHD [pages, page_size, L + R]
  int64_t row_pad = 8;       ///< unused elements after each cache row (must stay unchanged)
  DType position_dtype = DType::Int32;
  DType slot_dtype = DType::Int32;
  bool k_pe_3d = false;      ///< k_pe (and k_out) as [T, 1, R]
  bool inplace = false;      ///< q_out = q_pe, k_out = k_pe
  double rope_base = 10000;
  bool interleaved = true;
  RopeScaling rope_scaling;
  std::optional<double> kv_scale;  ///< fp8: a float scale
  bool kv_scale_tensor = false;    ///< fp8: the scale as a one-element tensor (value 0.75)
};

/// DeepSeek-V3's rope_scaling (config.json: yarn, factor 40, original 4096, beta_fast 32,
/// beta_slow 1, mscale 1.0, mscale_all_dim 1.0).
RopeScaling deepseek_v3_yarn();

/// Owns every tensor of one call.
class MlaCase {
 public:
  explicit MlaCase(const MlaShape& s);
  MlaCase(const MlaCase&) = delete;
  MlaCase& operator=(const MlaCase&) = delete;

  MlaShape shape;
  MlaTensors tensors;
  MlaParams params;

  /// Fresh random call: every buffer poisoned, random finite inputs, positions in [0, 2^20)
  /// with both extremes, distinct slots with about `negative_fraction` negative ones.
  void randomize(Rng& rng, double negative_fraction = 0.125);
  void set_slot(int64_t t, int64_t s) { set_index(tensors.slots, t, s); }
  void set_position(int64_t t, int64_t p) { set_index(tensors.positions, t, p); }
  /// Poisons q_out/k_out (not when in place).
  void poison_outputs(Rng& rng);

  struct Snapshot {
    std::vector<std::vector<uint8_t>> bytes;
  };
  Snapshot snapshot() const;
  /// Buffers that differ from `before`; one line each (empty: nothing changed).
  std::vector<std::string> changes_since(const Snapshot& before) const;
  /// The whole contract of a successful call (one line per problem): q_out/k_out within the
  /// SPEC §1 bound, each named cache row = concat(kv_c, k_pe_rot) of a token that names it
  /// (bit for bit; fp8: kv_c by §6's rule exactly, k within one e4m3 step of the exact
  /// value), every other byte (inputs, other rows, row padding, guards) unchanged.
  /// An empty k_out (SPEC §8 return_k_rot=False): no k_pe_rot check, the k_out buffer (in
  /// place: k_pe) unchanged, and the k_pe_rot part of each row in q_pe's dtype within the
  /// SPEC §1 bound of the float64 rotation of its token's k_pe.
  std::vector<std::string> check(const Snapshot& before, int threads = 1) const;
  /// SPEC §8 return_k_rot=False against the call just made (`before`: the buffers before
  /// it): the same call again from `before` with an empty k_out passes check() and leaves
  /// every buffer but the one k_out lives in bit-identical to the first call's (q_out and
  /// the whole cache, row padding and guards included, exactly as with k_pe_rot). Leaves the
  /// case as the call without k_pe_rot left it, the k_out view restored. `run`, when given,
  /// makes the call instead of mla_rope_pool_fused on the host buffers (a device test runs
  /// it on copies and brings the results back); `same_bits` false skips the byte comparison,
  /// for calls whose repeated slots may go to either writer.
  std::vector<std::string> check_without_k_rot(const Snapshot& before,
                                               const MlaCallOptions& options = {},
                                               int threads = 1,
                                               const std::function<void()>& run = nullptr,
                                               bool same_bits = true);

  float scale_value() const;
  const std::vector<std::unique_ptr<HostBuffer>>& buffers() const { return buffers_; }

 private:
  std::vector<std::unique_ptr<HostBuffer>> buffers_;
  HostBuffer *q_ = nullptr, *kv_ = nullptr, *pos_ = nullptr, *slots_ = nullptr,
             *cache_ = nullptr, *q_out_ = nullptr, *k_out_ = nullptr, *scale_ = nullptr;
};

/// The schedule an MLA call uses (its precomputed one, or make_rope_schedule of its keywords).
RopeSchedule mla_schedule(const MlaParams& params, int64_t rope_dim);

}  // namespace ropepool::test
