// RoPE scaling variants in the Hugging Face `config.rope_scaling` vocabulary (SPEC §4).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace ropepool {

enum class RopeType : uint8_t { Default, Linear, Dynamic, Yarn, Llama3, LongRope };

/// "default", "linear", "dynamic", "yarn", "llama3", "longrope".
const char* rope_type_name(RopeType type);

/// The fields of `config.rope_scaling` (and the two model-level lengths some types read).
/// Field names follow transformers; unset optionals take transformers' defaults.
struct RopeScaling {
  RopeType type = RopeType::Default;
  double factor = 1.0;                            ///< linear, dynamic, yarn, llama3 (longrope: see below)
  std::optional<double> attention_factor;         ///< yarn, longrope: overrides the derived mscale
  std::optional<double> beta_fast, beta_slow;     ///< yarn: 32 and 1 when unset
  std::optional<double> mscale, mscale_all_dim;   ///< yarn (DeepSeek style)
  bool truncate = true;                           ///< yarn: floor/ceil the correction range
  double low_freq_factor = 1.0;                   ///< llama3
  double high_freq_factor = 4.0;                  ///< llama3
  std::optional<int64_t> original_max_position_embeddings;  ///< yarn, llama3, longrope
  std::optional<int64_t> max_position_embeddings;           ///< model config: dynamic, longrope, yarn
  std::vector<double> short_factor, long_factor;            ///< longrope: R/2 entries each
  /// dynamic and longrope depend on the sequence length: the caller passes it explicitly
  /// (transformers uses max(position_ids) + 1 of the batch). dynamic rescales the base once
  /// seq_len > max_position_embeddings; longrope uses long_factor once
  /// seq_len > original_max_position_embeddings, short_factor otherwise.
  std::optional<int64_t> seq_len;
};

}  // namespace ropepool
