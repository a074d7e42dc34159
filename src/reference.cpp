// The float64 reference: plain loops, no threading, no SIMD. Tests and the CLI compare
// every backend against it.
#include "ropepool/reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ropepool/half.hpp"

namespace ropepool::reference {
namespace {

void* element(const TensorView& x, int64_t t, int64_t h, int64_t d) {
  const int64_t off = t * x.strides[0] + h * x.strides[1] + d * x.strides[2];
  return static_cast<char*>(x.data) + off * int64_t(dtype_size(x.dtype));
}

void store_at(void* p, DType dtype, double value) {
  const float f = static_cast<float>(value);
  switch (dtype) {
    case DType::Float32: *static_cast<float*>(p) = f; break;
    // double -> float -> half can round twice; the float step keeps 13 extra bits, so
    // the result differs from a single rounding only on exact float ties (never for
    // rotated values in practice) and stays within the SPEC bound regardless.
    case DType::Float16: *static_cast<uint16_t*>(p) = float_to_half(f); break;
    case DType::BFloat16: *static_cast<uint16_t*>(p) = float_to_bf16(f); break;
    default: break;
  }
}

void store(const TensorView& x, int64_t t, int64_t h, int64_t d, double value) {
  store_at(element(x, t, h, d), x.dtype, value);
}

// SPEC §6: e4m3(x / scale), the division in float32.
uint8_t quantize(double value, float scale) { return float_to_e4m3(static_cast<float>(value) / scale); }

}  // namespace

void* pool_element(const TensorView& pool, KvLayout layout, int64_t slot, int64_t h, int64_t d) {
  int64_t off = 0;
  switch (layout) {
    case KvLayout::None: off = slot * pool.strides[0] + h * pool.strides[1] + d * pool.strides[2]; break;
    case KvLayout::NHD: {
      const int64_t ps = pool.shape[1];
      off = (slot / ps) * pool.strides[0] + (slot % ps) * pool.strides[1] + h * pool.strides[2] +
            d * pool.strides[3];
      break;
    }
    case KvLayout::HND: {
      const int64_t ps = pool.shape[2];
      off = (slot / ps) * pool.strides[0] + h * pool.strides[1] + (slot % ps) * pool.strides[2] +
            d * pool.strides[3];
      break;
    }
  }
  return static_cast<char*>(pool.data) + off * int64_t(dtype_size(pool.dtype));
}

float scale_value(const QuantScale& scale) {
  if (scale.has_tensor()) return *static_cast<const float*>(scale.tensor.data);
  return scale.value ? static_cast<float>(*scale.value) : 1.0f;
}

double load(const TensorView& x, int64_t t, int64_t h, int64_t d) {
  const void* p = element(x, t, h, d);
  switch (x.dtype) {
    case DType::Float32: return *static_cast<const float*>(p);
    case DType::Float16: return half_to_float(*static_cast<const uint16_t*>(p));
    case DType::BFloat16: return bf16_to_float(*static_cast<const uint16_t*>(p));
    default: return 0;
  }
}

double round_to(DType dtype, double x) {
  const float f = static_cast<float>(x);
  switch (dtype) {
    case DType::Float16: return half_to_float(float_to_half(f));
    case DType::BFloat16: return bf16_to_float(float_to_bf16(f));
    default: return f;
  }
}

int64_t load_position(const TensorView& positions, int row, int64_t t) {
  if (positions.ndim != 2) return load_index(positions, t);
  const char* base = static_cast<const char*>(positions.data);
  const int64_t off = row * positions.strides[0] + t * positions.strides[1];
  if (positions.dtype == DType::Int64) return *reinterpret_cast<const int64_t*>(base + 8 * off);
  return *reinterpret_cast<const int32_t*>(base + 4 * off);
}

std::vector<double> normalize(const TensorView& x, const TensorView& weight, double eps,
                              bool gemma) {
  const int64_t T = x.shape[0], H = x.shape[1], D = x.shape[2];
  std::vector<double> w(static_cast<size_t>(D));
  for (int64_t d = 0; d < D; ++d) {
    const char* p = static_cast<const char*>(weight.data) +
                    d * weight.strides[0] * int64_t(dtype_size(weight.dtype));
    w[size_t(d)] = weight.dtype == DType::Float32    ? *reinterpret_cast<const float*>(p)
                   : weight.dtype == DType::Float16 ? half_to_float(*reinterpret_cast<const uint16_t*>(p))
                                                    : bf16_to_float(*reinterpret_cast<const uint16_t*>(p));
  }
  std::vector<double> out(static_cast<size_t>(T * H * D));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      double sum = 0;
      for (int64_t d = 0; d < D; ++d) sum += load(x, t, h, d) * load(x, t, h, d);
      const double r = 1.0 / std::sqrt(sum / double(D) + double(float(eps)));  // eps as float32, as in the models
      double* o = &out[size_t((t * H + h) * D)];
      for (int64_t d = 0; d < D; ++d) {
        const double a = load(x, t, h, d);
        o[d] = gemma ? round_to(x.dtype, a * r * (1.0 + w[size_t(d)]))
                     : round_to(x.dtype, w[size_t(d)] * round_to(x.dtype, a * r));
      }
    }
  return out;
}

int64_t load_index(const TensorView& x, int64_t t) {
  const char* base = static_cast<const char*>(x.data);
  if (x.dtype == DType::Int64) return *reinterpret_cast<const int64_t*>(base + 8 * t * x.strides[0]);
  return *reinterpret_cast<const int32_t*>(base + 4 * t * x.strides[0]);
}

std::vector<double> rotate(const TensorView& x, const TensorView& positions,
                           const RopeSchedule& schedule, bool interleaved) {
  const int64_t T = x.shape[0], H = x.shape[1], D = x.shape[2];
  std::vector<double> values(static_cast<size_t>(T * H * D));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) values[size_t((t * H + h) * D + d)] = load(x, t, h, d);
  return rotate(values, T, H, D, positions, schedule, interleaved);
}

std::vector<double> rotate(const std::vector<double>& x, int64_t T, int64_t H, int64_t D,
                           const TensorView& positions, const RopeSchedule& schedule,
                           bool interleaved) {
  const int64_t half = schedule.rotary_dim / 2;
  std::vector<double> out(static_cast<size_t>(T * H * D));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      double* o = &out[static_cast<size_t>((t * H + h) * D)];
      const double* in = &x[static_cast<size_t>((t * H + h) * D)];
      for (int64_t i = 0; i < half; ++i) {
        const double pos = double(load_position(positions, mrope_axis(schedule, i), t));
        // pos * inv_freq is exact enough in double (relative error 2^-53, |theta| < 2^21)
        const double theta = pos * schedule.inv_freq[i];
        const double c = std::cos(theta) * schedule.attention_scaling;
        const double s = std::sin(theta) * schedule.attention_scaling;
        // the pair (a, b): half-split (i, i + R/2) or GPT-J interleaved (2i, 2i + 1)
        const int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
        const double a = in[ia], b = in[ib];
        o[ia] = a * c - b * s;
        o[ib] = a * s + b * c;
      }
      for (int64_t d = schedule.rotary_dim; d < D; ++d) o[d] = in[d];
    }
  }
  return out;
}

void rope_pool_fused(const RopePoolTensors& t, const RopePoolParams& params) {
  const RopeSchedule schedule = make_rope_schedule(params);
  const int64_t T = t.q.shape[0], Hq = t.q.shape[1], Hk = t.k.shape[1], D = t.q.shape[2];
  const bool fp8_q = t.q_out.dtype == DType::Float8E4M3FN;
  const bool fp8_pool = t.k_pool.dtype == DType::Float8E4M3FN;
  const float q_scale = scale_value(params.q_scale), k_scale = scale_value(params.k_scale),
              v_scale = scale_value(params.v_scale);
  // both rotations are complete before any store, so q_out/k_out may alias q/k (in place)
  const double eps = params.norm_eps.value_or(1e-6);
  const bool gemma = params.norm_style.value_or("rms") == "gemma";
  auto rotated = [&](const TensorView& x, const TensorView& weight) {
    if (!weight.data) return rotate(x, t.positions, schedule, params.interleaved);
    return rotate(normalize(x, weight, eps, gemma), x.shape[0], x.shape[1], x.shape[2],
                  t.positions, schedule, params.interleaved);
  };
  const std::vector<double> q_rot = rotated(t.q, params.q_norm_weight);
  const std::vector<double> k_rot = rotated(t.k, params.k_norm_weight);
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const double x = q_rot[size_t((i * Hq + h) * D + d)];
        if (fp8_q)
          *static_cast<uint8_t*>(element(t.q_out, i, h, d)) = quantize(x, q_scale);
        else
          store(t.q_out, i, h, d, x);
      }
    if (t.k_out.data)  // an empty k_out: no k_rot (SPEC §4 return_k_rot=False)
      for (int64_t h = 0; h < Hk; ++h)
        for (int64_t d = 0; d < D; ++d) store(t.k_out, i, h, d, k_rot[size_t((i * Hk + h) * D + d)]);
  }
  const size_t es = dtype_size(t.k_pool.dtype);
  for (int64_t i = 0; i < T; ++i) {
    const int64_t slot = load_index(t.slots, i);
    if (slot < 0) continue;
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t d = 0; d < D; ++d) {
        void* k_dst = pool_element(t.k_pool, params.kv_layout, slot, h, d);
        void* v_dst = pool_element(t.v_pool, params.kv_layout, slot, h, d);
        if (fp8_pool) {
          *static_cast<uint8_t*>(k_dst) = quantize(k_rot[size_t((i * Hk + h) * D + d)], k_scale);
          *static_cast<uint8_t*>(v_dst) = quantize(load(t.v, i, h, d), v_scale);
        } else if (!t.k_out.data) {
          store_at(k_dst, t.k_pool.dtype, k_rot[size_t((i * Hk + h) * D + d)]);
          std::memcpy(v_dst, element(t.v, i, h, d), es);
        } else {
          std::memcpy(k_dst, element(t.k_out, i, h, d), es);
          std::memcpy(v_dst, element(t.v, i, h, d), es);
        }
      }
  }
}

double tolerance(DType dtype, double exact, double abs_a_plus_b) {
  // One unit in the last place of `exact` in the output format.
  const int mant_bits = dtype == DType::Float32 ? 23 : dtype == DType::Float16 ? 10 : 7;
  const int min_exp = dtype == DType::Float16 ? -14 : -126;
  int e = 0;
  std::frexp(exact, &e);  // exact = m * 2^e, m in [0.5, 1)
  const int exp = std::max(e - 1, min_exp);
  const double ulp = std::ldexp(1.0, exp - mant_bits);
  return ulp + std::ldexp(abs_a_plus_b, -18);
}

}  // namespace ropepool::reference
