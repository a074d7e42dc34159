// Validation and dispatch of mla_rope_pool_fused (SPEC §8): the one place that decides
// whether an MLA call is valid, in SPEC §2's order (ranks, shapes, dtypes, then the
// keywords, devices, layouts, backend limits, the angle limit, overlaps and the slot range).
// Backends receive a checked MlaProblem and only assert.
#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "format.hpp"
#include "mla_backend.hpp"
#include "validation_util.hpp"
#include "ropepool/error.hpp"
#include "ropepool/mla.hpp"
#include "ropepool/rope_pool.hpp"
#include "ropepool/schedule.hpp"

namespace ropepool {
namespace {

constexpr const char* kOp = "mla_rope_pool_fused";
using detail::same_shape;
using detail::same_view;
using detail::strides_str;

[[noreturn]] void fail(const std::string& message, std::string hint = {}) {
  throw Error(std::string(kOp) + ": " + message, std::move(hint));
}

std::string dims(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (int64_t x : d) s += (s.size() > 1 ? ", " : "") + std::to_string(x);
  return s + "]";
}
std::string dims(std::initializer_list<int64_t> d) { return dims(std::vector<int64_t>(d)); }

// One memory location per element of a view with a contiguous last dimension (rank <= 3):
// the outer dims of extent > 1, by increasing stride, each step over all the smaller ones span.
bool non_overlapping(const TensorView& v) {
  if (v.numel() == 0) return true;
  std::pair<int64_t, int64_t> outer[2];  // (stride, extent); the op's views have rank <= 3
  int n = 0;
  for (int i = 0; i + 1 < v.ndim && i < 2; ++i)
    if (v.shape[i] > 1) {
      if (v.strides[i] <= 0) return false;
      outer[n++] = {v.strides[i], v.shape[i]};
    }
  if (n == 2 && outer[1] < outer[0]) std::swap(outer[0], outer[1]);
  int64_t span = v.shape[v.ndim - 1];
  for (int i = 0; i < n; ++i) {
    if (outer[i].first < span) return false;
    span = outer[i].first * (outer[i].second - 1) + span;
  }
  return true;
}

detail::Rows rows(const TensorView& v) {
  return {v.data, v.strides[0], v.ndim == 3 ? v.strides[1] : 0};
}
detail::Index index(const TensorView& v) { return {v.data, v.strides[0], v.dtype == DType::Int64}; }

struct Checker {
  const MlaTensors& t;
  const MlaParams& p;
  const MlaCallOptions& o;

  std::string shape(const char* name, const TensorView& v) const {
    return o.format_shape ? o.format_shape(name, v) : format_shape(v);
  }
  bool paged() const { return p.kv_layout == MlaCacheLayout::NHD; }
  // An argument the call does not have, which no check applies to: k_out left empty (a
  // default TensorView), SPEC §8 return_k_rot=False, where k_pe_rot is not written at all and
  // the backends get a null k_out.
  bool absent(const TensorView& v) const {
    return &v == &t.k_out && detail::unset_view(t.k_out);
  }
  const char* cache_form() const {
    return paged() ? "[pages, page_size, kv_lora_rank + rope_dim]"
                   : "[num_slots, kv_lora_rank + rope_dim]";
  }

  // Ranks, then shapes against q_pe [T, H, R] and kv_c [T, L], then dtypes.
  void contract() const {
    if (t.q_pe.ndim != 3)
      fail("q_pe must be 3-D [num_tokens, num_heads, rope_dim], got " + shape("q_pe", t.q_pe),
           t.q_pe.ndim == 2 ? "one head per token is [T, 1, R]; a flat [T, H*R] must be viewed "
                              "as [T, H, R]"
                            : "");
    if (t.k_pe.ndim != 2 && t.k_pe.ndim != 3)
      fail("k_pe must be [num_tokens, rope_dim] or [num_tokens, 1, rope_dim], got " +
           shape("k_pe", t.k_pe));
    if (t.kv_c.ndim != 2)
      fail("kv_c must be 2-D [num_tokens, kv_lora_rank], got " + shape("kv_c", t.kv_c));
    if (t.positions.ndim != 1 || t.slots.ndim != 1)
      fail("positions/slots must be 1-D [num_tokens], got positions " +
           shape("positions", t.positions) + " and slots " + shape("slots", t.slots));
    const int cache_rank = paged() ? 3 : 2;
    if (t.kv_cache.ndim != cache_rank)
      fail(std::string("kv_cache must be ") + (paged() ? "3-D " : "2-D ") + cache_form() +
               (paged() ? " with kv_layout=\"NHD\"" : " without kv_layout") + ", got " +
               shape("kv_cache", t.kv_cache),
           t.kv_cache.ndim == 3 && !paged()
               ? "a paged cache [pages, page_size, L + R] needs kv_layout=\"NHD\""
           : t.kv_cache.ndim == 2 && paged()
               ? "a token cache [P, L + R] is passed without kv_layout"
               : "");
    const int64_t T = t.q_pe.shape[0], R = t.q_pe.shape[2], L = t.kv_c.shape[1];
    const bool k_ok = t.k_pe.shape[0] == T && t.k_pe.shape[t.k_pe.ndim - 1] == R &&
                      (t.k_pe.ndim == 2 || t.k_pe.shape[1] == 1);
    if (!k_ok)
      fail("k_pe shape must be [num_tokens, rope_dim] = " + dims({T, R}) + " (or " +
           dims({T, 1, R}) + ") for q_pe " + shape("q_pe", t.q_pe) + ", got " +
           shape("k_pe", t.k_pe));
    if (t.kv_c.shape[0] != T)
      fail("kv_c shape must be [num_tokens, kv_lora_rank] with num_tokens = " +
           std::to_string(T) + " (from q_pe), got " + shape("kv_c", t.kv_c));
    if (t.positions.shape[0] != T || t.slots.shape[0] != T)
      fail("positions/slots must have one entry per token (" + std::to_string(T) +
           "), got positions " + shape("positions", t.positions) + " and slots " +
           shape("slots", t.slots));
    if (t.kv_cache.shape[cache_rank - 1] != L + R)
      fail("kv_cache shape must be " + std::string(cache_form()) + " with kv_lora_rank + rope_dim = " +
           std::to_string(L) + " + " + std::to_string(R) + " = " + std::to_string(L + R) +
           ", got " + shape("kv_cache", t.kv_cache));
    if (t.k_pe.dtype != t.q_pe.dtype || t.kv_c.dtype != t.q_pe.dtype)
      fail(std::string("q_pe/k_pe/kv_c dtypes must match, got q_pe ") + dtype_name(t.q_pe.dtype) +
           ", k_pe " + dtype_name(t.k_pe.dtype) + ", kv_c " + dtype_name(t.kv_c.dtype));
    if (t.kv_cache.dtype != t.q_pe.dtype && t.kv_cache.dtype != DType::Float8E4M3FN)
      fail(std::string("kv_cache dtype must be q_pe's (") + dtype_name(t.q_pe.dtype) +
           ") or float8_e4m3fn, got " + dtype_name(t.kv_cache.dtype));
  }

  // Indices, the schedule, and the rest of the keywords, in SPEC §2's order.
  const RopeSchedule* extended(RopeSchedule& made) const {
    for (auto [name, v] : {std::pair{"positions", &t.positions}, {"slots", &t.slots}})
      if (v->dtype != DType::Int32 && v->dtype != DType::Int64)
        fail(std::string(name) + " must be int32 or int64, got " + dtype_name(v->dtype));
    const int64_t R = t.q_pe.shape[2];
    if (R <= 0 || R % 2 != 0)
      fail("rope_dim (q_pe.shape[2]) must be even and > 0, got " + std::to_string(R));
    if (t.q_pe.shape[1] <= 0 || t.kv_c.shape[1] <= 0)
      fail("num_heads (q_pe.shape[1]) and kv_lora_rank (kv_c.shape[1]) must be > 0, got " +
           std::to_string(t.q_pe.shape[1]) + " and " + std::to_string(t.kv_c.shape[1]));
    // The one schedule (SPEC §4) with rotary_dim = R; its messages name rope_pool_fused's
    // keywords, which are this op's too, so only the op's name changes.
    RopePoolParams rp;
    rp.head_dim = R;
    rp.rope_base = p.rope_base;
    rp.interleaved = p.interleaved;
    rp.rope_scaling = p.rope_scaling;
    rp.inv_freq = p.inv_freq;
    rp.attention_scaling = p.attention_scaling;
    const RopeSchedule* schedule = &made;
    try {
      if (p.schedule) {
        check_precomputed_schedule(rp, *p.schedule);
        schedule = p.schedule;
      } else {
        made = make_rope_schedule(rp);
      }
    } catch (const Error& e) {
      std::string m = e.what();
      const std::string prefix = "rope_pool_fused: ";
      if (m.rfind(prefix, 0) == 0) m = m.substr(prefix.size());
      fail(m, e.hint());
    }
    // SPEC §7's multimodal sections pick a position row per frequency; this op takes one
    // position per token, so a schedule with them would have its sections ignored.
    if (!schedule->mrope_section.empty())
      fail("the schedule is multimodal (mrope_section = " + dims(schedule->mrope_section) +
               "); positions here are one per token and the sections would be ignored",
           "make the schedule (or rope_scaling) without mrope_section");
    if (!is_float(t.q_pe.dtype))
      fail(std::string("unsupported dtype ") + dtype_name(t.q_pe.dtype) +
           " for q_pe/k_pe/kv_c; expected float32, float16 or bfloat16");
    scale();
    devices();
    outputs();
    layouts();
    limits(*schedule);
    overlaps();
    return schedule;
  }

  bool fp8() const { return t.kv_cache.dtype == DType::Float8E4M3FN; }

  // SPEC §6's scale, for the one fp8 cache.
  void scale() const {
    const bool given = p.kv_scale || t.kv_scale.data;
    if (given && !fp8())
      fail(std::string("kv_scale is only used with a float8_e4m3fn kv_cache, got a ") +
           dtype_name(t.kv_cache.dtype) + " cache");
    if (p.kv_scale && t.kv_scale.data)
      fail("kv_scale is given twice (a number and a tensor); pass one");
    if (p.kv_scale && !(std::isfinite(*p.kv_scale) && float(*p.kv_scale) > 0 &&
                        std::isfinite(float(*p.kv_scale))))
      fail("kv_scale must be finite and > 0, got " + detail::py_float(*p.kv_scale));
    if (t.kv_scale.data) {
      if (t.kv_scale.numel() != 1 || t.kv_scale.dtype != DType::Float32)
        fail("kv_scale must be a one-element float32 tensor, got " +
             std::string(dtype_name(t.kv_scale.dtype)) + " " + shape("kv_scale", t.kv_scale));
      if (!(t.kv_scale.device == t.kv_cache.device))
        fail("kv_scale must be on the cache's device (" + device_name(t.kv_cache.device) +
             "), got " + device_name(t.kv_scale.device));
      if (t.kv_scale.device.type == DeviceType::CPU) {  // free to read here (SPEC §6)
        const float s = *static_cast<const float*>(t.kv_scale.data);
        if (!(std::isfinite(s) && s > 0))
          fail("kv_scale must be finite and > 0, got " + detail::py_float(s));
      }
    }
  }

  std::array<std::pair<const char*, const TensorView*>, 8> all() const {
    return {{{"q_pe", &t.q_pe}, {"k_pe", &t.k_pe}, {"kv_c", &t.kv_c},
             {"positions", &t.positions}, {"slots", &t.slots}, {"kv_cache", &t.kv_cache},
             {"q_out", &t.q_out}, {"k_out", &t.k_out}}};
  }

  void devices() const {
    const Device d = t.q_pe.device;
    for (auto [name, v] : all())
      if (!(v->device == d) && !absent(*v))
        fail("all tensors must be on one device, got q_pe on " + device_name(d) + " and " +
                 name + " on " + device_name(v->device),
             "move every tensor (the cache too) to the device the model runs on");
    if (d.type == DeviceType::CUDA && !detail::cuda_backend_available())
      fail("tensors are on " + device_name(d) + " but this build of ropepool has no CUDA backend",
           "rebuild with CUDA (nvcc on PATH, -DROPEPOOL_WITH_CUDA=ON)");
    if (d.type == DeviceType::Other) fail("unsupported device; expected cpu or cuda tensors");
  }

  void outputs() const {
    for (auto [name, out, in, in_name] :
         {std::tuple{"q_out", &t.q_out, &t.q_pe, "q_pe"}, {"k_out", &t.k_out, &t.k_pe, "k_pe"}})
      if (!absent(*out) && (!same_shape(*out, *in) || out->dtype != in->dtype))
        fail(std::string(name) + " must have the shape and dtype of " + in_name + " (" +
             shape(in_name, *in) + " " + dtype_name(in->dtype) + "), got " + shape(name, *out) +
             " " + dtype_name(out->dtype));
  }

  void layouts() const {
    // A view with elements and no memory (a C++ caller's bug) would crash a kernel; a k_out
    // that has a shape but no data would read as "no k_pe_rot" to a backend, silently.
    // (Shapes-only validation, data_readable false, has no memory to point to.)
    for (auto [name, v] : all())
      if (o.data_readable && v->data == nullptr && v->numel() > 0 && !absent(*v))
        fail(std::string(name) + " " + shape(name, *v) + " has a null data pointer",
             v == &t.k_out ? "for a call without k_pe_rot leave k_out empty (a default TensorView)"
                           : "");
    for (auto [name, v] : all()) {
      if (v->ndim < 2 || v->numel() == 0) continue;
      if (v->shape[v->ndim - 1] > 1 && v->strides[v->ndim - 1] != 1)
        fail(std::string(name) + " must have a contiguous last dimension (stride 1), got strides " +
                 strides_str(*v),
             "pass a view whose last axis is contiguous, e.g. x.contiguous()");
    }
    for (auto [name, v] : {std::pair{"q_out", &t.q_out}, {"k_out", &t.k_out}, {"kv_cache", &t.kv_cache}})
      if (!absent(*v) && !non_overlapping(*v))
        fail(std::string(name) + " has overlapping or negative strides " + strides_str(*v) +
             "; every element it receives needs its own memory");
  }

  const detail::BackendLimits& backend() const {
    static const detail::BackendLimits cpu = detail::cpu_limits(), cuda = detail::cuda_limits();
    return t.q_pe.device.type == DeviceType::CUDA ? cuda : cpu;
  }

  void limits(const RopeSchedule& schedule) const {
    const detail::BackendLimits& b = backend();
    auto on = [&b] { return std::string(" on the ") + b.name + " backend"; };
    const int64_t H = t.q_pe.shape[1], R = t.q_pe.shape[2], L = t.kv_c.shape[1];
    if (b.max_rotary_dim && R > b.max_rotary_dim)
      fail("rope_dim = " + std::to_string(R) + " exceeds the limit of " +
           std::to_string(b.max_rotary_dim) + on());
    if (b.max_heads_x_head_dim) {
      if (H * R > b.max_heads_x_head_dim)
        fail("num_heads * rope_dim = " + std::to_string(H * R) + " exceeds the limit of " +
             std::to_string(b.max_heads_x_head_dim) + on());
      if (L + R > b.max_heads_x_head_dim)
        fail("kv_lora_rank + rope_dim = " + std::to_string(L + R) + " exceeds the limit of " +
             std::to_string(b.max_heads_x_head_dim) + on());
    }
    if (b.max_device_index >= 0 && t.q_pe.device.index > b.max_device_index)
      fail("the device index = " + std::to_string(t.q_pe.device.index) + " exceeds the limit of " +
           std::to_string(b.max_device_index) + on());
    if (b.max_tokens && t.q_pe.shape[0] > b.max_tokens)
      fail("num_tokens = " + std::to_string(t.q_pe.shape[0]) + " exceeds the limit of " +
               std::to_string(b.max_tokens) + on(),
           "split the call");
    detail::check_angles(kOp, schedule, b, t.positions, t.q_pe.shape[0]);
  }

  // SPEC §3: every output against every input it does not replace and the other outputs.
  // (An empty k_out, no k_pe_rot, has an empty span: it meets nothing.)
  void overlaps() const {
    const bool q_inplace = same_view(t.q_out, t.q_pe), k_inplace = same_view(t.k_out, t.k_pe);
    struct Named {
      const TensorView* view;
      const char* name;
    };
    const Named outs[] = {{&t.q_out, q_inplace ? "q_pe (rotated in place)" : "q_out"},
                          {&t.k_out, k_inplace ? "k_pe (rotated in place)" : "k_out"},
                          {&t.kv_cache, "kv_cache"}};
    const Named ins[] = {{&t.q_pe, "q_pe"},   {&t.k_pe, "k_pe"},   {&t.kv_c, "kv_c"},
                         {&t.positions, "positions"}, {&t.slots, "slots"}, {&t.kv_scale, "kv_scale"}};
    auto reject = [](const char* a, const char* b) {
      fail(std::string(a) + " and " + b +
               " overlap in memory (they share at least one byte); the result would depend on "
               "the order of reads and writes",
           "pass separate buffers; views that interleave without sharing a byte (e.g. k_pe and "
           "kv_c as columns of one projection output) are fine");
    };
    auto overlap = [](const TensorView& a, const TensorView& b) {
      const ByteSpan x = byte_span(a), y = byte_span(b);
      return !x.empty() && !y.empty() && x.lo < y.hi && y.lo < x.hi && views_overlap(a, b);
    };
    for (size_t i = 0; i < 3; ++i) {
      for (size_t j = 0; j < 6; ++j) {
        if ((i == 0 && j == 0 && q_inplace) || (i == 1 && j == 1 && k_inplace)) continue;
        if (overlap(*outs[i].view, *ins[j].view)) reject(outs[i].name, ins[j].name);
      }
      for (size_t k = i + 1; k < 3; ++k)
        if (overlap(*outs[i].view, *outs[k].view)) reject(outs[i].name, outs[k].name);
    }
  }
};

struct Checked {
  detail::MlaProblem problem;
  RopeSchedule made_schedule;
};

Checked check(const MlaTensors& t, const MlaParams& p, const MlaCallOptions& o) {
  Checker c{t, p, o};
  Checked out;
  c.contract();
  const RopeSchedule* schedule = c.extended(out.made_schedule);
  detail::MlaProblem& m = out.problem;
  m.dtype = t.q_pe.dtype;
  m.cache_dtype = t.kv_cache.dtype;
  m.num_tokens = t.q_pe.shape[0];
  m.num_heads = t.q_pe.shape[1];
  m.rope_dim = t.q_pe.shape[2];
  m.latent_dim = t.kv_c.shape[1];
  m.interleaved = p.interleaved;
  m.q_pe = rows(t.q_pe);
  m.q_out = rows(t.q_out);
  m.k_pe = rows(t.k_pe);
  if (!c.absent(t.k_out)) m.k_out = rows(t.k_out);  // else null: no k_pe_rot
  m.kv_c = rows(t.kv_c);
  if (c.paged()) {
    m.cache = {t.kv_cache.data, t.kv_cache.strides[0], t.kv_cache.strides[1], 0};
    m.page_size = t.kv_cache.shape[1];
    m.pool_size = t.kv_cache.shape[0] * t.kv_cache.shape[1];
  } else {
    m.cache = {t.kv_cache.data, t.kv_cache.strides[0], 0, 0};
    m.page_size = 1;
    m.pool_size = t.kv_cache.shape[0];
  }
  if (t.kv_scale.data) m.kv_scale.ptr = static_cast<const float*>(t.kv_scale.data);
  else if (p.kv_scale) m.kv_scale.value = float(*p.kv_scale);
  m.positions = index(t.positions);
  m.slots = index(t.slots);
  m.inv_freq = schedule->inv_freq.data();
  m.attention_scaling = schedule->attention_scaling;
  m.check_slots = o.check_slots;
  m.stream = o.stream;
  if (t.q_pe.device.type == DeviceType::CPU)
    detail::mla_check_slot_values(m.slots, m.num_tokens, m.pool_size, o.check_slots);
  return out;
}

}  // namespace

namespace detail {

void mla_check_slot_values(const Index& slots, int64_t T, int64_t P, bool reject_duplicates) {
  for (int64_t i = 0; i < T; ++i)
    if (slots[i] >= P)
      fail("slots[" + std::to_string(i) + "] = " + std::to_string(slots[i]) +
               " is out of range for a kv_cache of " + std::to_string(P) + " slots",
           "slots index rows of kv_cache (pages * page_size rows when paged); use a negative "
           "slot to skip a token");
  if (!reject_duplicates) return;
  std::vector<std::pair<int64_t, int64_t>> seen;
  seen.reserve(size_t(T));
  for (int64_t i = 0; i < T; ++i)
    if (slots[i] >= 0) seen.emplace_back(slots[i], i);
  std::sort(seen.begin(), seen.end());
  for (size_t i = 1; i < seen.size(); ++i)
    if (seen[i].first == seen[i - 1].first)
      fail("slots[" + std::to_string(seen[i].second) + "] = " + std::to_string(seen[i].first) +
           " repeats slots[" + std::to_string(seen[i - 1].second) +
           "]; with check_slots each slot may be written once per call");
}

}  // namespace detail

void validate_mla_rope_pool(const MlaTensors& tensors, const MlaParams& params,
                            const MlaCallOptions& options) {
  check(tensors, params, options);
}

void mla_rope_pool_fused(const MlaTensors& tensors, const MlaParams& params,
                         const MlaCallOptions& options) {
  if (!options.data_readable)
    throw std::invalid_argument("mla_rope_pool_fused: MlaCallOptions::data_readable = false is "
                                "for validate_mla_rope_pool only");
  const Checked checked = check(tensors, params, options);
  if (checked.problem.num_tokens == 0) return;
  if (tensors.q_pe.device.type == DeviceType::CUDA)
    detail::mla_rope_pool_cuda(checked.problem);
  else
    detail::mla_rope_pool_cpu(checked.problem);
}

}  // namespace ropepool
