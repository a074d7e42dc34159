// RoPE scaling variants in the Hugging Face `config.rope_scaling` vocabulary (SPEC §4), and
// the one parser of such dicts (used by C++ callers and by the Python package alike).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ropepool {

enum class RopeType : uint8_t { Default, Linear, Dynamic, Yarn, Llama3, LongRope };

/// "default", "linear", "dynamic", "yarn", "llama3", "longrope".
const char* rope_type_name(RopeType type);

/// The type named `name` ("su" is transformers' old name of longrope); throws
/// ropepool::Error naming the known types otherwise.
RopeType parse_rope_type(const std::string& name);

/// The fields of `config.rope_scaling` (and the model-level values some types read).
/// Field names follow transformers; unset optionals take transformers' defaults. Made by
/// parse_rope_scaling from a config dict, or filled in by hand (then `factor` defaults to 1).
struct RopeScaling {
  RopeType type = RopeType::Default;
  double factor = 1.0;                            ///< linear, dynamic, yarn, llama3 (longrope: see below)
  std::optional<double> attention_factor;         ///< yarn, longrope: overrides the derived mscale
  std::optional<double> beta_fast, beta_slow;     ///< yarn: 32 and 1 when unset
  std::optional<double> mscale, mscale_all_dim;   ///< yarn (DeepSeek style)
  bool truncate = true;                           ///< yarn: floor/ceil the correction range
  double low_freq_factor = 1.0;                   ///< llama3
  double high_freq_factor = 4.0;                  ///< llama3
  /// yarn, llama3: from rope_scaling. longrope: required; Phi-3 keeps it at the top level
  /// of its config (transformers reads config.original_max_position_embeddings there).
  std::optional<int64_t> original_max_position_embeddings;
  std::optional<int64_t> max_position_embeddings;           ///< model config: dynamic, longrope, yarn
  std::vector<double> short_factor, long_factor;            ///< longrope: R/2 entries each
  /// longrope: a `factor` given in rope_scaling; it must equal max_position_embeddings /
  /// original_max_position_embeddings (the factor transformers uses).
  std::optional<double> longrope_factor;
  /// dynamic and longrope depend on the sequence length: the caller passes it explicitly
  /// (transformers uses max(position_ids) + 1 of the batch). dynamic rescales the base once
  /// seq_len > max_position_embeddings; longrope uses long_factor once
  /// seq_len > original_max_position_embeddings, short_factor otherwise.
  std::optional<int64_t> seq_len;
  /// Multimodal RoPE (SPEC §7; Qwen2-VL, Qwen2.5-VL, Qwen3-VL), with any type: empty, or
  /// [s_t, s_h, s_w] with s_t + s_h + s_w = rotary_dim/2. Frequency i takes its position from
  /// row a(i) of positions [3, T]; mrope_interleaved (Qwen3-VL) picks a(i) by i % 3.
  std::vector<int64_t> mrope_section;
  bool mrope_interleaved = false;

  friend bool operator==(const RopeScaling&, const RopeScaling&) = default;
};

/// One value of a rope_scaling entry as JSON or Python hold it.
struct ScalingValue {
  enum class Kind : uint8_t { Null, Bool, Int, Float, String, List, Other };
  Kind kind = Kind::Null;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0;
  std::string text;           ///< String; for Other, the name of the value's type
  std::vector<double> list;   ///< List: a list of numbers

  static ScalingValue null() { return {}; }
  static ScalingValue of(bool b) { ScalingValue v; v.kind = Kind::Bool; v.boolean = b; return v; }
  static ScalingValue of(int64_t i) { ScalingValue v; v.kind = Kind::Int; v.integer = i; return v; }
  static ScalingValue of(int i) { return of(int64_t(i)); }
  static ScalingValue of(double d) { ScalingValue v; v.kind = Kind::Float; v.number = d; return v; }
  static ScalingValue of(std::string s) { ScalingValue v; v.kind = Kind::String; v.text = std::move(s); return v; }
  static ScalingValue of(const char* s) { return of(std::string(s)); }
  static ScalingValue of(std::vector<double> l) { ScalingValue v; v.kind = Kind::List; v.list = std::move(l); return v; }
};

using ScalingEntries = std::vector<std::pair<std::string, ScalingValue>>;

/// What a model config keeps outside rope_scaling, passed as keywords of their own.
/// A keyword that the chosen type does not read is an error (SPEC §4), never ignored.
struct RopeScalingContext {
  double rope_base = 10000;  ///< rope_scaling["rope_theta"], if present, must equal it
  std::optional<int64_t> max_position_embeddings;           ///< dynamic, yarn, longrope
  std::optional<int64_t> original_max_position_embeddings;  ///< longrope (Phi-3: top level)
  std::optional<int64_t> seq_len;                           ///< dynamic, longrope
  /// SPEC §7 keywords: the same as rope_scaling["mrope_section"] / ["mrope_interleaved"];
  /// given in both places they must agree.
  std::optional<std::vector<int64_t>> mrope_section;
  std::optional<bool> mrope_interleaved;
};

/// Parses a Hugging Face `config.rope_scaling` dict (its items, in order) with the rules of
/// SPEC §4: the type from "rope_type" or "type" (they must agree; "su" = longrope, "mrope" =
/// default), the keys each type requires and reads (any other key is an error; every type
/// reads "mrope_section" and "mrope_interleaved", SPEC §7), the value types (a number, a
/// bool, a string, a list of numbers; null = absent), rope_theta agreeing with rope_base,
/// and the context keywords. Values themselves (factor > 0, list lengths, ...) are checked by
/// make_rope_schedule. No entries (no dict, or an empty one) means type default. Throws
/// ropepool::Error.
RopeScaling parse_rope_scaling(const ScalingEntries& entries, const RopeScalingContext& context = {});

}  // namespace ropepool
