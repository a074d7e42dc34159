// The RoPE frequency schedule: inverse frequencies and attention factor for every variant.
// The one definition every backend and the reference use. Formulas follow transformers'
// ROPE_INIT_FUNCTIONS (modeling_rope_utils.py), evaluated in double instead of float32:
// at position 2^20 a float32 inv_freq is off by up to ~0.06 rad, far outside SPEC §1.
#include "ropepool/schedule.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "format.hpp"
#include "ropepool/error.hpp"

namespace ropepool {
namespace {

[[noreturn]] void fail(const std::string& message, std::string hint = {}) {
  throw Error("rope_pool_fused: " + message, std::move(hint));
}

std::string num(double x) {
  std::string s = std::to_string(x);
  s.erase(s.find_last_not_of('0') + 1);
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

// base ** (-2i / R) for i in [0, R/2)
std::vector<double> default_inv_freq(double base, int64_t R) {
  std::vector<double> f(static_cast<size_t>(R / 2));
  for (int64_t i = 0; i < R / 2; ++i) f[i] = std::pow(base, -2.0 * double(i) / double(R));
  return f;
}

void require_positive(const char* type, const char* field, double value) {
  if (!(value > 0) || !std::isfinite(value))
    fail(std::string("rope_scaling '") + type + "' needs " + field + " > 0, got " + num(value));
}

int64_t require_length(const char* type, const char* field, const std::optional<int64_t>& v) {
  if (!v)
    fail(std::string("rope_scaling '") + type + "' needs " + field,
         "pass it from the model config (config." + std::string(field) + ")");
  if (*v <= 0)
    fail(std::string("rope_scaling '") + type + "' needs " + field + " > 0, got " +
         std::to_string(*v));
  return *v;
}

// YaRN (arXiv 2309.00071): frequencies below the correction range are interpolated
// (divided by factor), above it extrapolated (kept), linearly blended in between.
void yarn(const RopeScaling& s, double base, int64_t R, RopeSchedule& out) {
  const double factor = s.factor;
  require_positive("yarn", "factor", factor);
  const std::optional<int64_t> orig =
      s.original_max_position_embeddings ? s.original_max_position_embeddings
                                         : s.max_position_embeddings;
  const double original_max =
      double(require_length("yarn", "original_max_position_embeddings", orig));
  auto get_mscale = [](double scale, double mscale) {
    return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
  };
  if (s.attention_factor)
    out.attention_scaling = *s.attention_factor;
  else if (s.mscale && *s.mscale != 0 && s.mscale_all_dim && *s.mscale_all_dim != 0)
    out.attention_scaling = get_mscale(factor, *s.mscale) / get_mscale(factor, *s.mscale_all_dim);
  else
    out.attention_scaling = get_mscale(factor, 1.0);
  // transformers treats 0 / None alike here ("or 32")
  const double beta_fast = s.beta_fast && *s.beta_fast != 0 ? *s.beta_fast : 32.0;
  const double beta_slow = s.beta_slow && *s.beta_slow != 0 ? *s.beta_slow : 1.0;
  const double dim = double(R);
  auto correction_dim = [&](double rotations) {
    return dim * std::log(original_max / (rotations * 2 * std::numbers::pi)) / (2 * std::log(base));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1);
  if (low == high) high += 0.001;  // as transformers: avoid a zero-width ramp
  out.inv_freq = default_inv_freq(base, R);
  for (size_t i = 0; i < out.inv_freq.size(); ++i) {
    const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation = 1.0 - ramp;
    const double f = out.inv_freq[i];
    out.inv_freq[i] = (f / factor) * (1.0 - extrapolation) + f * extrapolation;
  }
}

// Llama 3.1: long wavelengths divided by factor, short ones kept, smooth blend between.
void llama3(const RopeScaling& s, double base, int64_t R, RopeSchedule& out) {
  require_positive("llama3", "factor", s.factor);
  require_positive("llama3", "low_freq_factor", s.low_freq_factor);
  require_positive("llama3", "high_freq_factor", s.high_freq_factor);
  if (s.high_freq_factor == s.low_freq_factor)
    fail("rope_scaling 'llama3' needs high_freq_factor != low_freq_factor");
  const double old_context =
      double(require_length("llama3", "original_max_position_embeddings",
                            s.original_max_position_embeddings));
  const double low_freq_wavelen = old_context / s.low_freq_factor;
  const double high_freq_wavelen = old_context / s.high_freq_factor;
  out.inv_freq = default_inv_freq(base, R);
  for (double& f : out.inv_freq) {
    const double wavelen = 2 * std::numbers::pi / f;
    if (wavelen > low_freq_wavelen) {
      f /= s.factor;
    } else if (wavelen >= high_freq_wavelen) {
      const double smooth =
          (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      f = (1 - smooth) * f / s.factor + smooth * f;
    }
  }
}

// LongRoPE (Phi-3): per-frequency rescale factors, long or short by sequence length.
void longrope(const RopeScaling& s, double base, int64_t R, RopeSchedule& out) {
  // transformers (4.57) reads original_max_position_embeddings from the top level of the
  // model config and falls back to max_position_embeddings silently; Phi-3 passing only its
  // rope_scaling dict then gets attention factor 1 and short factors at every length, so
  // here it is required (a keyword of its own in Python, SPEC §4).
  const int64_t original_max = require_length("longrope", "original_max_position_embeddings",
                                              s.original_max_position_embeddings);
  const int64_t max_pos =
      require_length("longrope", "max_position_embeddings", s.max_position_embeddings);
  const int64_t seq_len = require_length("longrope", "seq_len", s.seq_len);
  const double factor = double(max_pos) / double(original_max);
  if (s.longrope_factor && std::fabs(*s.longrope_factor - factor) > 1e-12 * factor)
    fail("rope_scaling['factor'] = " + detail::py_float(*s.longrope_factor) +
             " disagrees with max_position_embeddings / original_max_position_embeddings = " +
             detail::py_float(factor),
         "longrope's factor is max_position_embeddings / original_max_position_embeddings "
         "(as transformers computes it); drop 'factor' or fix the lengths");
  if (s.attention_factor)
    out.attention_scaling = *s.attention_factor;
  else
    out.attention_scaling =
        factor <= 1.0 ? 1.0 : std::sqrt(1 + std::log(factor) / std::log(double(original_max)));
  const bool use_long = seq_len > original_max;
  const std::vector<double>& ext = use_long ? s.long_factor : s.short_factor;
  if (int64_t(ext.size()) != R / 2)
    fail(std::string("rope_scaling 'longrope' needs ") + (use_long ? "long_factor" : "short_factor") +
         " with rotary_dim/2 = " + std::to_string(R / 2) + " entries, got " +
         std::to_string(ext.size()));
  out.inv_freq = default_inv_freq(base, R);
  for (size_t i = 0; i < out.inv_freq.size(); ++i) {
    require_positive("longrope", use_long ? "long_factor entries" : "short_factor entries", ext[i]);
    out.inv_freq[i] /= ext[i];
  }
}

// head_dim, rope_base, rotary_dim and the inv_freq view: the order SPEC §2 lists
// (head_dim, then rope_base) followed by the §4 arguments.
int64_t check_rope_params(const RopePoolParams& p) {
  if (p.head_dim <= 0 || p.head_dim % 2 != 0)
    fail("head_dim must be even and > 0, got " + std::to_string(p.head_dim));
  if (!(p.rope_base > 0) || !std::isfinite(p.rope_base))
    fail("rope_base must be finite and > 0, got " + std::to_string(p.rope_base));
  if (p.rotary_dim != 0 && (p.rotary_dim < 0 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim))
    fail("rotary_dim must be even and in (0, head_dim = " + std::to_string(p.head_dim) +
         "], got " + std::to_string(p.rotary_dim));
  const int64_t R = p.rotary_dim ? p.rotary_dim : p.head_dim;
  const TensorView& f = p.inv_freq;
  if (f.data) {
    if (f.ndim != 1 || f.shape[0] != R / 2 || f.dtype != DType::Float32)
      fail("inv_freq must be a 1-D float32 tensor of rotary_dim/2 = " + std::to_string(R / 2) +
           " entries, got " + dtype_name(f.dtype) + " " + format_shape(f));
    if (f.device.type != DeviceType::CPU)
      fail("inv_freq must be in host (CPU) memory, got " + device_name(f.device),
           "the schedule is read on the host once per call; keep a CPU copy (inv_freq.cpu()) "
           "made at model load, so no call synchronises the device");
  }
  return R;
}

void check_finite(const RopeSchedule& s) {
  for (size_t i = 0; i < s.inv_freq.size(); ++i)
    if (!std::isfinite(s.inv_freq[i]))
      fail("the RoPE schedule gives a non-finite inv_freq[" + std::to_string(i) + "]",
           "check rope_base and the rope_scaling values");
  if (!std::isfinite(s.attention_scaling))
    fail("attention_scaling must be finite, got " + num(s.attention_scaling));
}

// SPEC §7: three non-negative sections covering the R/2 frequencies.
void check_mrope(const std::vector<int64_t>& section, bool interleaved, int64_t R) {
  if (section.empty()) {
    if (interleaved)
      fail("mrope_interleaved needs mrope_section",
           "pass mrope_section (config.rope_scaling['mrope_section']) too");
    return;
  }
  int64_t sum = 0;
  bool ok = section.size() == 3;
  for (int64_t x : section) ok = ok && x >= 0, sum += x;
  if (!ok || sum != R / 2) {
    std::string got = "[";
    for (size_t i = 0; i < section.size(); ++i) got += (i ? ", " : "") + std::to_string(section[i]);
    fail("mrope_section must be three non-negative integers summing to rotary_dim/2 = " +
             std::to_string(R / 2) + ", got " + got + "]",
         "mrope_section counts frequencies (pairs), not elements: Qwen2-VL's head_dim 128 has "
         "[16, 24, 24]");
  }
}

}  // namespace

void check_precomputed_schedule(const RopePoolParams& params, const RopeSchedule& schedule) {
  const int64_t R = check_rope_params(params);
  if (schedule.rotary_dim != R || int64_t(schedule.inv_freq.size()) != R / 2)
    fail("the precomputed schedule is for rotary_dim " + std::to_string(schedule.rotary_dim) +
         " with " + std::to_string(schedule.inv_freq.size()) +
         " frequencies, but this call rotates " + std::to_string(R) + " elements",
         "make the schedule with this call's head_dim and rotary_dim");
  if (schedule.rope_base != 0 && schedule.rope_base != params.rope_base)
    fail("rope_base = " + detail::py_float(params.rope_base) +
             " disagrees with the schedule, made for rope_base = " +
             detail::py_float(schedule.rope_base),
         "pass the rope_base the schedule was made with (or make a new schedule)");
  check_mrope(schedule.mrope_section, schedule.mrope_interleaved, R);
  check_finite(schedule);
}

RopeSchedule make_rope_schedule(const RopePoolParams& params) {
  RopeSchedule out;
  const int64_t R = check_rope_params(params);
  out.rotary_dim = R;
  out.rope_base = params.rope_base;
  const double base = params.rope_base;
  const RopeScaling& s = params.rope_scaling;

  // mRoPE (SPEC §7) says which position each frequency reads: it combines with any
  // schedule, inv_freq included.
  RopeScaling without_mrope = s;
  without_mrope.mrope_section.clear();
  without_mrope.mrope_interleaved = false;
  check_mrope(s.mrope_section, s.mrope_interleaved, R);
  out.mrope_section = s.mrope_section;
  out.mrope_interleaved = s.mrope_interleaved;
  if (params.inv_freq.data && !(without_mrope == RopeScaling{}))
    fail("inv_freq replaces rope_scaling (and max_position_embeddings, "
         "original_max_position_embeddings, seq_len); pass one or the other");
  if (params.inv_freq.data) {
    // The escape hatch: the caller's float32 table, widened exactly to double.
    const TensorView& t = params.inv_freq;
    out.inv_freq.resize(static_cast<size_t>(R / 2));
    for (int64_t i = 0; i < R / 2; ++i)
      out.inv_freq[i] = static_cast<const float*>(t.data)[i * t.strides[0]];
  } else {
    switch (s.type) {
      case RopeType::Default:
        out.inv_freq = default_inv_freq(base, R);
        break;
      case RopeType::Linear:
        require_positive("linear", "factor", s.factor);
        out.inv_freq = default_inv_freq(base, R);
        for (double& f : out.inv_freq) f /= s.factor;
        break;
      case RopeType::Dynamic: {
        // NTK-aware: grow the base once the sequence outgrows the trained context.
        require_positive("dynamic", "factor", s.factor);
        const int64_t max_pos =
            require_length("dynamic", "max_position_embeddings", s.max_position_embeddings);
        const int64_t seq_len = std::max(require_length("dynamic", "seq_len", s.seq_len), max_pos);
        if (R <= 2) fail("rope_scaling 'dynamic' needs rotary_dim > 2");
        const double scaled = std::pow(s.factor * double(seq_len) / double(max_pos) - (s.factor - 1),
                                       double(R) / double(R - 2));
        out.inv_freq = default_inv_freq(base * scaled, R);
        break;
      }
      case RopeType::Yarn: yarn(s, base, R, out); break;
      case RopeType::Llama3: llama3(s, base, R, out); break;
      case RopeType::LongRope: longrope(s, base, R, out); break;
    }
  }
  if (params.attention_scaling) out.attention_scaling = *params.attention_scaling;
  check_finite(out);
  return out;
}

}  // namespace ropepool
