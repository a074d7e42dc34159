// The one parser of Hugging Face `config.rope_scaling` dicts (SPEC §4). The Python package
// hands it the dict's items, so C++ and Python callers get the same rules and the same
// messages (tests/data/rope_scaling_cases.json is checked from both).
#include "ropepool/rope_scaling.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "format.hpp"
#include "ropepool/error.hpp"

namespace ropepool {
namespace {

using detail::py_float;

[[noreturn]] void fail(const std::string& message, std::string hint = {}) {
  throw Error("rope_pool_fused: " + message, std::move(hint));
}

std::string describe(const ScalingValue& v) {
  using K = ScalingValue::Kind;
  switch (v.kind) {
    case K::Null: return "null";
    case K::Bool: return std::string("a bool (") + (v.boolean ? "true" : "false") + ")";
    case K::Int: return "an integer (" + std::to_string(v.integer) + ")";
    case K::Float: return "a float (" + py_float(v.number) + ")";
    case K::String: return "a string ('" + v.text + "')";
    case K::List: return "a list";
    case K::Other: return "a " + v.text;
  }
  return "?";
}

std::string quoted(const std::string& key) { return "rope_scaling['" + key + "']"; }

double number(const std::string& key, const ScalingValue& v) {
  if (v.kind == ScalingValue::Kind::Int) return double(v.integer);
  if (v.kind == ScalingValue::Kind::Float) return v.number;
  fail(quoted(key) + " must be a number, got " + describe(v));
}

int64_t integer(const std::string& key, const ScalingValue& v) {
  if (v.kind == ScalingValue::Kind::Int) return v.integer;
  fail(quoted(key) + " must be an integer, got " + describe(v));
}

// [s_t, s_h, s_w]: three integers (JSON and Python lists arrive as numbers).
std::vector<int64_t> mrope_section(const std::string& name, const ScalingValue& v) {
  bool ok = v.kind == ScalingValue::Kind::List && v.list.size() == 3;
  std::vector<int64_t> out;
  for (size_t i = 0; ok && i < v.list.size(); ++i) {
    ok = std::isfinite(v.list[i]) && v.list[i] == std::floor(v.list[i]) &&
         std::fabs(v.list[i]) < 9007199254740992.0;
    out.push_back(ok ? int64_t(v.list[i]) : 0);
  }
  if (!ok)
    fail(name + " must be a list of three integers [temporal, height, width], got " +
         (v.kind == ScalingValue::Kind::List ? "a list of " + std::to_string(v.list.size()) +
                                                   (v.list.size() == 3 ? " numbers" : " entries")
                                             : describe(v)));
  return out;
}

struct TypeKeys {
  std::vector<std::string> required, optional;
};

const TypeKeys& keys_of(RopeType t) {
  static const TypeKeys none{}, factor{{"factor"}, {}};
  static const TypeKeys yarn{{"factor"},
                             {"attention_factor", "beta_fast", "beta_slow", "mscale",
                              "mscale_all_dim", "truncate", "original_max_position_embeddings"}};
  static const TypeKeys llama3{
      {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}, {}};
  static const TypeKeys longrope{{"short_factor", "long_factor"},
                                 {"factor", "attention_factor", "original_max_position_embeddings"}};
  switch (t) {
    case RopeType::Default: return none;
    case RopeType::Linear: case RopeType::Dynamic: return factor;
    case RopeType::Yarn: return yarn;
    case RopeType::Llama3: return llama3;
    case RopeType::LongRope: return longrope;
  }
  return none;
}

// A type's other spellings as the name of the type they mean; any other name as it is.
std::string canonical_rope_type_name(const std::string& name) {
  if (name == "su") return "longrope";  // transformers' old name
  if (name == "mrope") return "default";  // Qwen2-VL's configs (transformers maps it so)
  return name;
}

}  // namespace

const char* rope_type_name(RopeType type) {
  switch (type) {
    case RopeType::Default: return "default";
    case RopeType::Linear: return "linear";
    case RopeType::Dynamic: return "dynamic";
    case RopeType::Yarn: return "yarn";
    case RopeType::Llama3: return "llama3";
    case RopeType::LongRope: return "longrope";
  }
  return "?";
}

RopeType parse_rope_type(const std::string& name) {
  const std::string canonical = canonical_rope_type_name(name);
  for (RopeType t : {RopeType::Default, RopeType::Linear, RopeType::Dynamic, RopeType::Yarn,
                     RopeType::Llama3, RopeType::LongRope})
    if (canonical == rope_type_name(t)) return t;
  fail("unknown rope_scaling type '" + name +
           "'; expected one of default, linear, dynamic, yarn, llama3, longrope",
       "for any other schedule pass inv_freq (and attention_scaling) directly");
}

RopeScaling parse_rope_scaling(const ScalingEntries& entries, const RopeScalingContext& context) {
  auto find = [&](const std::string& key) -> const ScalingValue* {
    for (const auto& [k, v] : entries)
      if (k == key && v.kind != ScalingValue::Kind::Null) return &v;
    return nullptr;
  };
  RopeScaling s;
  // The type: "rope_type" (current) or "type" (older configs); both must agree.
  const ScalingValue* rope_type = find("rope_type");
  const ScalingValue* type = find("type");
  for (auto [key, v] : {std::pair{"rope_type", rope_type}, {"type", type}})
    if (v && v->kind != ScalingValue::Kind::String)
      fail(quoted(key) + " must be a string, got " + describe(*v));
  // Agreeing means naming the same type: transformers 5.x keeps Qwen2-VL's "type": "mrope"
  // beside the "rope_type": "default" it maps it to (config.rope_parameters), and an old
  // "su" may sit beside "longrope".
  if (rope_type && type &&
      canonical_rope_type_name(rope_type->text) != canonical_rope_type_name(type->text))
    fail("rope_scaling has rope_type '" + rope_type->text + "' and type '" + type->text +
         "'; they must agree");
  const std::string name = rope_type ? rope_type->text : type ? type->text : "default";
  s.type = parse_rope_type(name);
  const char* tname = rope_type_name(s.type);
  const TypeKeys& keys = keys_of(s.type);

  // A key the type does not read would be silently ignored: a model that needs it (e.g.
  // multimodal "mrope_section") would get the wrong rotation.
  std::vector<std::string> known = {"rope_type", "type", "rope_theta", "mrope_section",
                                    "mrope_interleaved"};
  known.insert(known.end(), keys.required.begin(), keys.required.end());
  known.insert(known.end(), keys.optional.begin(), keys.optional.end());
  std::sort(known.begin(), known.end());
  std::vector<std::string> unknown;
  for (const auto& [k, v] : entries)
    if (!std::binary_search(known.begin(), known.end(), k)) unknown.push_back(k);
  if (!unknown.empty()) {
    std::sort(unknown.begin(), unknown.end());
    std::string m = std::string("rope_scaling type '") + tname + "' does not use ";
    for (size_t i = 0; i < unknown.size(); ++i) m += (i ? ", '" : "'") + unknown[i] + "'";
    m += "; accepted keys: ";
    for (size_t i = 0; i < known.size(); ++i) m += (i ? ", " : "") + known[i];
    fail(m);
  }

  // Value types, in the dict's order.
  for (const auto& [k, v] : entries) {
    if (v.kind == ScalingValue::Kind::Null || k == "rope_type" || k == "type") continue;
    if (k == "truncate" || k == "mrope_interleaved") {
      if (v.kind != ScalingValue::Kind::Bool)
        fail(quoted(k) + " must be a bool, got " + describe(v));
      (k == "truncate" ? s.truncate : s.mrope_interleaved) = v.boolean;
    } else if (k == "mrope_section") {
      s.mrope_section = mrope_section(quoted(k), v);
    } else if (k == "short_factor" || k == "long_factor") {
      if (v.kind != ScalingValue::Kind::List)
        fail(quoted(k) + " must be a list of numbers, got " + describe(v));
      (k == "short_factor" ? s.short_factor : s.long_factor) = v.list;
    } else if (k == "original_max_position_embeddings") {
      s.original_max_position_embeddings = integer(k, v);
    } else {
      const double x = number(k, v);
      if (k == "factor") {
        if (s.type == RopeType::LongRope)
          s.longrope_factor = x;
        else
          s.factor = x;
      }
      if (k == "attention_factor") s.attention_factor = x;
      if (k == "beta_fast") s.beta_fast = x;
      if (k == "beta_slow") s.beta_slow = x;
      if (k == "mscale") s.mscale = x;
      if (k == "mscale_all_dim") s.mscale_all_dim = x;
      if (k == "low_freq_factor") s.low_freq_factor = x;
      if (k == "high_freq_factor") s.high_freq_factor = x;
    }
  }

  std::vector<std::string> missing;
  for (const std::string& k : keys.required)
    if (!find(k)) missing.push_back(k);
  if (!missing.empty()) {
    std::string m = std::string("rope_scaling type '") + tname + "' needs ";
    for (size_t i = 0; i < missing.size(); ++i) m += (i ? ", '" : "'") + missing[i] + "'";
    fail(m);
  }

  if (const ScalingValue* theta = find("rope_theta")) {
    const double t = number("rope_theta", *theta);
    if (t != context.rope_base)
      fail("rope_scaling['rope_theta'] = " +
           (theta->kind == ScalingValue::Kind::Int ? std::to_string(theta->integer) : py_float(t)) +
           " differs from rope_base = " + py_float(context.rope_base));
  }

  // The keywords a model config keeps outside rope_scaling: each only where it is read.
  const bool reads_seq_len = s.type == RopeType::Dynamic || s.type == RopeType::LongRope;
  const bool reads_max_pos =
      s.type == RopeType::Dynamic || s.type == RopeType::LongRope || s.type == RopeType::Yarn;
  if (context.seq_len && !reads_seq_len)
    fail(std::string("seq_len is not read by rope_scaling type '") + tname +
         "'; only dynamic and longrope depend on the sequence length");
  if (context.max_position_embeddings && !reads_max_pos)
    fail(std::string("max_position_embeddings is not read by rope_scaling type '") + tname +
         "'; only dynamic, yarn and longrope read it");
  if (context.original_max_position_embeddings) {
    if (s.type != RopeType::LongRope)
      fail(std::string("original_max_position_embeddings= is not read by rope_scaling type '") +
               tname + "'; only longrope reads it from the model config",
           s.type == RopeType::Yarn || s.type == RopeType::Llama3
               ? "yarn and llama3 read rope_scaling['original_max_position_embeddings']"
               : "");
    if (s.original_max_position_embeddings &&
        *s.original_max_position_embeddings != *context.original_max_position_embeddings)
      fail("rope_scaling['original_max_position_embeddings'] = " +
           std::to_string(*s.original_max_position_embeddings) +
           " differs from original_max_position_embeddings = " +
           std::to_string(*context.original_max_position_embeddings));
    s.original_max_position_embeddings = context.original_max_position_embeddings;
  }
  s.max_position_embeddings = context.max_position_embeddings;
  s.seq_len = context.seq_len;

  // SPEC §7: the multimodal keys as keywords of their own; both places must agree.
  auto section_str = [](const std::vector<int64_t>& v) {
    std::string t = "[";
    for (size_t i = 0; i < v.size(); ++i) t += (i ? ", " : "") + std::to_string(v[i]);
    return t + "]";
  };
  if (context.mrope_section) {
    if (find("mrope_section") && s.mrope_section != *context.mrope_section)
      fail("rope_scaling['mrope_section'] = " + section_str(s.mrope_section) +
           " differs from mrope_section = " + section_str(*context.mrope_section));
    s.mrope_section = *context.mrope_section;
  }
  if (context.mrope_interleaved) {
    if (find("mrope_interleaved") && s.mrope_interleaved != *context.mrope_interleaved)
      fail(std::string("rope_scaling['mrope_interleaved'] = ") +
           (s.mrope_interleaved ? "true" : "false") + " differs from mrope_interleaved = " +
           (*context.mrope_interleaved ? "true" : "false"));
    s.mrope_interleaved = *context.mrope_interleaved;
  }
  return s;
}

}  // namespace ropepool
