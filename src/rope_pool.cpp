// Validation and dispatch of rope_pool_fused: the one place that decides whether a call is
// valid (SPEC §2, §3). Backends receive a checked RopePoolProblem and only assert.
#include <algorithm>
#include <array>
#include <cmath>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "format.hpp"
#include "test_hooks.hpp"
#include "validation_util.hpp"
#include "ropepool/error.hpp"
#include "ropepool/rope_pool.hpp"
#include "ropepool/schedule.hpp"

namespace ropepool {
namespace {

using detail::same_shape;
using detail::same_view;
using detail::strides_str;

const char* arg_name(Arg a) {
  switch (a) {
    case Arg::q: return "q";
    case Arg::k: return "k";
    case Arg::v: return "v";
    case Arg::positions: return "positions";
    case Arg::slots: return "slots";
    case Arg::k_pool: return "k_pool";
    case Arg::v_pool: return "v_pool";
    case Arg::q_out: return "q_out";
    case Arg::k_out: return "k_out";
    case Arg::k_scale: return "k_scale";
    case Arg::v_scale: return "v_scale";
    case Arg::q_scale: return "q_scale";
  }
  return "?";
}

detail::Index index(const TensorView& v);
detail::Index position_row(const TensorView& positions, int row);

struct Checker {
  const RopePoolTensors& t;
  const RopePoolParams& p;
  const CallOptions& o;

  std::string shape(Arg a, const TensorView& v) const {
    return o.format_shape ? o.format_shape(a, v) : format_shape(v);
  }

  [[noreturn]] static void fail(const std::string& message, std::string hint = {}) {
    throw Error(message, std::move(hint));
  }

  static std::string pool_hint(const TensorView& pool) {
    if (pool.ndim == 4)
      return "a layer-stacked pool [L, P, H, D] must be indexed as `k_pool[layer]`; a paged "
             "pool needs kv_layout \"NHD\" ([pages, page_size, H, D]) or \"HND\" "
             "([pages, H, page_size, D])";
    if (pool.ndim == 5)
      return "pass the K and V halves of a combined cache as k_pool and v_pool, e.g. "
             "`kv_cache[0]`, `kv_cache[1]` of vLLM's [2, blocks, block_size, H, D] or "
             "`kv_cache[:, 0]`, `kv_cache[:, 1]` of FlashInfer's [pages, 2, ...], with kv_layout";
    if (pool.ndim == 2) return "a flat pool [P, H*D] must be viewed as `[P, H, D]`";
    return {};
  }

  bool paged() const { return p.kv_layout != KvLayout::None; }

  // The expected pool shape, in words, for messages.
  std::string pool_shape_words() const {
    const std::string hk = "num_kv_heads = " + std::to_string(p.num_kv_heads),
                      d = "head_dim = " + std::to_string(p.head_dim);
    switch (p.kv_layout) {
      case KvLayout::NHD: return "[pages, page_size, " + hk + ", " + d + "]";
      case KvLayout::HND: return "[pages, " + hk + ", page_size, " + d + "]";
      case KvLayout::None: break;
    }
    return "[P, " + hk + ", " + d + "]";
  }

  // Heads and head size of a pool of the call's rank (SPEC §2 message 8, §6).
  bool pool_heads_ok(const TensorView& pool) const {
    switch (p.kv_layout) {
      case KvLayout::NHD: return pool.shape[2] == p.num_kv_heads && pool.shape[3] == p.head_dim;
      case KvLayout::HND: return pool.shape[1] == p.num_kv_heads && pool.shape[3] == p.head_dim;
      case KvLayout::None: break;
    }
    return pool.shape[1] == p.num_kv_heads && pool.shape[2] == p.head_dim;
  }

  std::string pool_geometry_hint(const TensorView& pool) const {
    if (!paged())
      return pool.shape[1] * pool.shape[2] == p.num_kv_heads * p.head_dim
                 ? "the pool's heads and head size are swapped or merged; view it as "
                   "[P, num_kv_heads, head_dim]"
                 : "";
    std::string h = std::string("kv_layout \"") + kv_layout_name(p.kv_layout) + "\" expects " +
                    pool_shape_words();
    const bool other = p.kv_layout == KvLayout::NHD
                           ? pool.shape[1] == p.num_kv_heads && pool.shape[3] == p.head_dim
                           : pool.shape[2] == p.num_kv_heads && pool.shape[3] == p.head_dim;
    if (other)
      h += std::string("; this pool fits kv_layout \"") +
           (p.kv_layout == KvLayout::NHD ? "HND" : "NHD") + "\"";
    return h;
  }

  // An argument the call does not have, which no check applies to: k_out left empty (a
  // default TensorView), SPEC §4 return_k_rot=False, where k_rot is not written at all and
  // the backends get a null k_out.
  bool absent(Arg a) const { return a == Arg::k_out && detail::unset_view(t.k_out); }

  static bool fp8_pools(const TensorView& k_pool, const TensorView& v_pool) {
    return k_pool.dtype == DType::Float8E4M3FN && v_pool.dtype == DType::Float8E4M3FN;
  }

  // SPEC §2 checks 1-11, in order, with the exact contract messages.
  void contract() const {
    if (t.q.ndim != 3 || t.k.ndim != 3 || t.v.ndim != 3)
      fail("rope_pool_fused expects q/k/v to be 3-D");
    const bool mrope = mrope_requested();
    if ((!mrope && t.positions.ndim != 1) || t.slots.ndim != 1)
      fail("rope_pool_fused expects positions/slots to be 1-D",
           t.positions.ndim == 2 && t.positions.shape[0] == 3
               ? "positions [3, T] are multimodal (mRoPE) positions: pass mrope_section"
               : "");
    if (mrope && (t.positions.ndim != 2 || t.positions.shape[0] != 3))
      fail("rope_pool_fused: with mrope_section, positions must be [3, num_tokens] (temporal, "
           "height and width rows), got " + shape(Arg::positions, t.positions),
           "text-only tokens take the same position in all three rows");
    if (!paged() && (t.k_pool.ndim != 3 || t.v_pool.ndim != 3))
      fail("rope_pool_fused expects pool tensors to be 3-D",
           pool_hint(t.k_pool.ndim != 3 ? t.k_pool : t.v_pool));
    if (paged() && (t.k_pool.ndim != 4 || t.v_pool.ndim != 4)) {
      const bool k_bad = t.k_pool.ndim != 4;
      fail(std::string("rope_pool_fused: kv_layout \"") + kv_layout_name(p.kv_layout) +
               "\" expects 4-D pools " + pool_shape_words() + ", got " +
               (k_bad ? "k_pool " + shape(Arg::k_pool, t.k_pool)
                      : "v_pool " + shape(Arg::v_pool, t.v_pool)),
           (k_bad ? t.k_pool : t.v_pool).ndim == 3
               ? "a [P, num_kv_heads, head_dim] pool takes no kv_layout"
               : pool_hint(k_bad ? t.k_pool : t.v_pool));
    }
    const int64_t T = t.q.shape[0];
    if (t.q.shape[1] != p.num_qo_heads || t.q.shape[2] != p.head_dim)
      fail("q shape must be [num_tokens, num_qo_heads, head_dim], got " + shape(Arg::q, t.q),
           geometry_hint("q", t.q, "num_qo_heads", p.num_qo_heads, -1, p.head_dim));
    if (t.k.shape[0] != T || t.k.shape[1] != p.num_kv_heads || t.k.shape[2] != p.head_dim)
      fail("k shape must be [num_tokens, num_kv_heads, head_dim], got " + shape(Arg::k, t.k),
           geometry_hint("k", t.k, "num_kv_heads", p.num_kv_heads, T, p.head_dim));
    if (!same_shape(t.v, t.k))
      fail("v shape must match k shape, got " + shape(Arg::v, t.v) + " vs " +
           shape(Arg::k, t.k));
    if (t.positions.shape[t.positions.ndim - 1] != T || t.slots.shape[0] != T)
      fail("positions/slots must have one entry per token");
    if (!pool_heads_ok(t.k_pool))
      fail("k_pool has incompatible shape " + shape(Arg::k_pool, t.k_pool),
           pool_geometry_hint(t.k_pool));
    if (!same_shape(t.v_pool, t.k_pool))
      fail("v_pool shape must match k_pool shape, got " + shape(Arg::v_pool, t.v_pool) +
           " vs " + shape(Arg::k_pool, t.k_pool));
    if (t.k.dtype != t.q.dtype || t.v.dtype != t.q.dtype)
      fail("q/k/v dtypes must match", std::string("got q ") + dtype_name(t.q.dtype) + ", k " +
                                          dtype_name(t.k.dtype) + ", v " + dtype_name(t.v.dtype));
    // SPEC §6: float8_e4m3fn pools (both) take q/k/v of any float dtype.
    if ((t.k_pool.dtype != t.q.dtype || t.v_pool.dtype != t.q.dtype) &&
        !fp8_pools(t.k_pool, t.v_pool))
      fail("pool dtypes must match q/k/v dtype",
           std::string("got k_pool ") + dtype_name(t.k_pool.dtype) + ", v_pool " +
               dtype_name(t.v_pool.dtype) + " for q/k/v of " + dtype_name(t.q.dtype) +
               "; the pools hold rotated k and v in q's dtype, or both in float8_e4m3fn");
  }

  // Which keyword or dimension disagrees, for the shape messages of §2 (whose text is fixed).
  static std::string geometry_hint(const char* name, const TensorView& x, const char* heads_kw,
                                   int64_t heads, int64_t tokens, int64_t head_dim) {
    std::string h;
    auto add = [&](const std::string& s) { h += (h.empty() ? "" : "; ") + s; };
    if (tokens >= 0 && x.shape[0] != tokens)
      add(std::string(name) + ".shape[0] = " + std::to_string(x.shape[0]) + " but q has " +
          std::to_string(tokens) + " tokens");
    if (x.shape[1] != heads)
      add(std::string(heads_kw) + " = " + std::to_string(heads) + " but " + name +
          ".shape[1] = " + std::to_string(x.shape[1]));
    if (x.shape[2] != head_dim)
      add("head_dim = " + std::to_string(head_dim) + " but " + name + ".shape[2] = " +
          std::to_string(x.shape[2]));
    return h;
  }

  // SPEC §7: multimodal positions [3, T] (from the keyword, the rope_scaling dict or a
  // precomputed schedule).
  bool mrope_requested() const {
    return p.schedule ? !p.schedule->mrope_section.empty() : !p.rope_scaling.mrope_section.empty();
  }

  // SPEC §7's norm keywords, after the schedule: weights [head_dim] of q's dtype or float32
  // on q's device, eps finite and > 0, a known style; a norm keyword needs a weight.
  void norm() const {
    const bool any = p.q_norm_weight.data || p.k_norm_weight.data;
    if (!any && (p.norm_eps || p.norm_style))
      fail(std::string("rope_pool_fused: ") + (p.norm_eps ? "norm_eps" : "norm_style") +
               " is given but neither q_norm_weight nor k_norm_weight",
           "pass the norm weights (e.g. the model's q_norm.weight and k_norm.weight), or drop "
           "the norm keywords");
    for (auto [name, w] : {std::pair{"q_norm_weight", &p.q_norm_weight}, {"k_norm_weight", &p.k_norm_weight}}) {
      if (!w->data) continue;
      if (w->ndim != 1 || w->shape[0] != p.head_dim)
        fail(std::string("rope_pool_fused: ") + name + " must be [head_dim] = [" +
             std::to_string(p.head_dim) + "], got " + format_shape(*w));
      if (w->dtype != t.q.dtype && w->dtype != DType::Float32)
        fail(std::string("rope_pool_fused: ") + name + " must be " + dtype_name(t.q.dtype) +
             " (q's dtype) or float32, got " + dtype_name(w->dtype));
      if (!(w->device == t.q.device))
        fail(std::string("rope_pool_fused: ") + name + " must be on q's device " +
                 device_name(t.q.device) + ", got " + device_name(w->device),
             "move the weight once, at model load");
      if (w->shape[0] > 1 && w->strides[0] != 1)
        fail(std::string("rope_pool_fused: ") + name + " must be contiguous, got stride " +
             std::to_string(w->strides[0]));
    }
    if (p.norm_eps && !(*p.norm_eps > 0 && std::isfinite(*p.norm_eps) &&
                        std::isfinite(float(*p.norm_eps)) && float(*p.norm_eps) > 0))
      fail("rope_pool_fused: norm_eps must be finite and > 0 (as a float32), got " +
           num(*p.norm_eps));
    if (p.norm_style && *p.norm_style != "rms" && *p.norm_style != "gemma")
      fail("rope_pool_fused: norm_style must be 'rms' or 'gemma', got '" + *p.norm_style + "'",
           "'rms': Qwen3RMSNorm / LlamaRMSNorm (w * x); 'gemma': Gemma3RMSNorm ((1 + w) * x)");
  }

  // The checks SPEC §2 lists after the contract ones, in its order.
  // `made` receives a schedule made from the parameters; a precomputed one is only checked.
  const RopeSchedule* extended(RopeSchedule& made) const {
    for (auto [a, v] : {std::pair{Arg::positions, &t.positions}, {Arg::slots, &t.slots}})
      if (v->dtype != DType::Int32 && v->dtype != DType::Int64)
        fail(std::string("rope_pool_fused: ") + arg_name(a) + " must be int32 or int64, got " +
             dtype_name(v->dtype));
    // head_dim, rope_base and the SPEC §4 schedule arguments, in that order
    const RopeSchedule* schedule = &made;
    if (p.schedule) {
      check_precomputed_schedule(p, *p.schedule);
      schedule = p.schedule;
    } else {
      made = make_rope_schedule(p);
    }
    norm();
    if (p.num_qo_heads <= 0 || p.num_kv_heads <= 0)
      fail("rope_pool_fused: num_qo_heads and num_kv_heads must be > 0, got " +
           std::to_string(p.num_qo_heads) + " and " + std::to_string(p.num_kv_heads));
    if (!is_float(t.q.dtype))
      fail(std::string("rope_pool_fused: unsupported dtype ") + dtype_name(t.q.dtype) +
           " for q/k/v/pools; expected float32, float16 or bfloat16");
    devices();
    // SPEC §7 on CUDA: the norm kernel keeps a head per warp in shared memory.
    if (t.q.device.type == DeviceType::CUDA && (p.q_norm_weight.data || p.k_norm_weight.data) &&
        p.head_dim > detail::kCudaFusionMaxHeadDim)
      fail("rope_pool_fused: head_dim = " + std::to_string(p.head_dim) +
           " exceeds the limit of " + std::to_string(detail::kCudaFusionMaxHeadDim) +
           " on the cuda backend with q_norm_weight/k_norm_weight");
    outputs();
    scales();
    layouts();
    limits(*schedule);
    overlaps();
    return schedule;
  }

  const detail::BackendLimits& backend() const {
    static const detail::BackendLimits cpu = detail::cpu_limits(), cuda = detail::cuda_limits();
    return t.q.device.type == DeviceType::CUDA ? cuda : cpu;
  }

  // What the backend can run (it only asserts these), then SPEC §1's angle limit.
  void limits(const RopeSchedule& schedule) const {
    const detail::BackendLimits& b = backend();
    auto on = [&b] { return std::string(" on the ") + b.name + " backend"; };
    if (b.max_rotary_dim && schedule.rotary_dim > b.max_rotary_dim)
      fail("rope_pool_fused: rotary_dim = " + std::to_string(schedule.rotary_dim) +
               " exceeds the limit of " + std::to_string(b.max_rotary_dim) + on(),
           "rotate the first " + std::to_string(b.max_rotary_dim) +
               " elements with rotary_dim, or use the CPU backend");
    if (b.max_heads_x_head_dim)
      for (auto [kw, heads] : {std::pair{"num_qo_heads", p.num_qo_heads}, {"num_kv_heads", p.num_kv_heads}})
        if (heads * p.head_dim > b.max_heads_x_head_dim)
          fail(std::string("rope_pool_fused: ") + kw + " * head_dim = " +
               std::to_string(heads * p.head_dim) + " exceeds the limit of " +
               std::to_string(b.max_heads_x_head_dim) + on());
    if (b.max_device_index >= 0 && t.q.device.index > b.max_device_index)
      fail("rope_pool_fused: the device index = " + std::to_string(t.q.device.index) +
           " exceeds the limit of " + std::to_string(b.max_device_index) + on());
    if (b.max_tokens && t.q.shape[0] > b.max_tokens)
      fail("rope_pool_fused: num_tokens = " + std::to_string(t.q.shape[0]) +
               " exceeds the limit of " + std::to_string(b.max_tokens) + on(),
           "split the call");
    detail::check_angles("rope_pool_fused", schedule, b, t.positions, t.q.shape[0],
                         o.data_readable);
  }

  static std::string num(double x) { return detail::py_float(x); }

  // SPEC §3: arguments whose memory overlaps where the result would depend on the order of
  // reads and writes. An output that is exactly its input (q_out == q: in-place rotation)
  // replaces it; every other pair of (output, anything else) must not share a byte. Inputs
  // may share memory with each other (k is v without inplace: read twice).
  void overlaps() const {
    const bool q_inplace = same_view(t.q_out, t.q), k_inplace = same_view(t.k_out, t.k);
    struct Named {
      const TensorView* view;
      const char* name;
    };
    // In this order: q_out replaces ins[0] (q), k_out replaces ins[1] (k).
    const Named outs[] = {{&t.q_out, q_inplace ? "q (rotated in place)" : "q_out"},
                          {&t.k_out, k_inplace ? "k (rotated in place)" : "k_out"},
                          {&t.k_pool, "k_pool"},
                          {&t.v_pool, "v_pool"}};
    // The inputs, the scale tensors (read while the outputs are written) and the SPEC §7
    // norm weights.
    Named ins[10] = {{&t.q, "q"}, {&t.k, "k"}, {&t.v, "v"}, {&t.positions, "positions"},
                     {&t.slots, "slots"}};
    size_t num_ins = 5;
    for (auto [s, n] : {std::pair{&p.k_scale, "k_scale"}, {&p.v_scale, "v_scale"}, {&p.q_scale, "q_scale"}})
      if (s->has_tensor()) ins[num_ins++] = {&s->tensor, n};
    for (auto [w, n] : {std::pair{&p.q_norm_weight, "q_norm_weight"}, {&p.k_norm_weight, "k_norm_weight"}})
      if (w->data) ins[num_ins++] = {w, n};
    auto reject = [](const char* a, const char* b) {
      fail(std::string("rope_pool_fused: ") + a + " and " + b +
               " overlap in memory (they share at least one byte); the result would depend "
               "on the order of reads and writes",
           "pass separate buffers; views that interleave without sharing a byte (e.g. q/k/v "
           "columns of one fused QKV output) are fine");
    };
    // Byte spans first (one pass over the nine views): disjoint spans, the common case, cost
    // two comparisons per pair; only intersecting spans get the exact test.
    ByteSpan out_span[4], in_span[10];
    for (size_t i = 0; i < 4; ++i) out_span[i] = byte_span(*outs[i].view);
    for (size_t i = 0; i < num_ins; ++i) in_span[i] = byte_span(*ins[i].view);
    auto meet = [](const ByteSpan& a, const ByteSpan& b) {
      return !a.empty() && !b.empty() && a.lo < b.hi && b.lo < a.hi;
    };
    // (An empty k_out, no k_rot, has an empty span: it meets nothing.)
    for (size_t o = 0; o < 4; ++o) {
      for (size_t i = 0; i < num_ins; ++i) {
        if ((o == 0 && i == 0 && q_inplace) || (o == 1 && i == 1 && k_inplace)) continue;
        if (meet(out_span[o], in_span[i]) && views_overlap(*outs[o].view, *ins[i].view))
          reject(outs[o].name, ins[i].name);
      }
      for (size_t o2 = o + 1; o2 < 4; ++o2)
        if (meet(out_span[o], out_span[o2]) && views_overlap(*outs[o].view, *outs[o2].view))
          reject(outs[o].name, outs[o2].name);
    }
  }

  void devices() const {
    const Device d = t.q.device;
    for (auto [a, v] : all())
      if (!(v->device == d) && !absent(a))
        fail(std::string("rope_pool_fused: all tensors must be on one device, got q on ") +
                 device_name(d) + " and " + arg_name(a) + " on " + device_name(v->device),
             "move every tensor (the pools too) to the device the model runs on");
    if (d.type == DeviceType::CUDA && !detail::cuda_backend_available())
      fail("rope_pool_fused: tensors are on " + device_name(d) +
               " but this build of ropepool has no CUDA backend",
           "rebuild with CUDA (nvcc on PATH, -DROPEPOOL_WITH_CUDA=ON)");
    if (d.type == DeviceType::Other)
      fail("rope_pool_fused: unsupported device; expected cpu or cuda tensors");
  }

  // Outputs: caller-allocated (the C++ API, Python's q_out=/k_out=) or allocated by the
  // Python layer. q_out may also be float8_e4m3fn (SPEC §6, quantised with q_scale).
  void outputs() const {
    for (auto [a, out, in] : {std::tuple{Arg::q_out, &t.q_out, &t.q}, {Arg::k_out, &t.k_out, &t.k}})
      if (!absent(a) &&
          (!same_shape(*out, *in) ||
           (out->dtype != in->dtype && !(a == Arg::q_out && out->dtype == DType::Float8E4M3FN))))
        fail(std::string("rope_pool_fused: ") + arg_name(a) + " must have the shape and dtype of " +
             arg_name(a == Arg::q_out ? Arg::q : Arg::k) + " (" + shape(a == Arg::q_out ? Arg::q : Arg::k, *in) +
             " " + dtype_name(in->dtype) + "), got " + shape(a, *out) + " " + dtype_name(out->dtype));
  }

  // SPEC §6: k_scale/v_scale only with float8_e4m3fn pools, q_scale only with a
  // float8_e4m3fn q_out; a number finite and > 0 as float32; a tensor of one float32 on the
  // pools' device, whose value is checked where reading it is free (host memory).
  void scales() const {
    const bool fp8_pool = fp8_pools(t.k_pool, t.v_pool), fp8_q = t.q_out.dtype == DType::Float8E4M3FN;
    for (auto [a, s, used] : {std::tuple{Arg::k_scale, &p.k_scale, fp8_pool},
                              {Arg::v_scale, &p.v_scale, fp8_pool}, {Arg::q_scale, &p.q_scale, fp8_q}}) {
      if (!s->given()) continue;
      const std::string name = arg_name(a);
      if (!used) {
        if (a == Arg::q_scale)
          fail("rope_pool_fused: q_scale is given but q_rot is " + std::string(dtype_name(t.q_out.dtype)) +
                   "; q_scale quantises a float8_e4m3fn q_rot only",
               "ask for an fp8 q_rot (Python: q_out_dtype=torch.float8_e4m3fn; C++: a "
               "float8_e4m3fn q_out), or drop q_scale");
        fail("rope_pool_fused: " + name + " is given but the pools are " +
                 dtype_name(t.k_pool.dtype) + "; k_scale and v_scale quantise float8_e4m3fn pools only",
             "pass float8_e4m3fn pools, or drop the scale");
      }
      if (s->value && s->has_tensor())
        fail("rope_pool_fused: " + name + " is both a number and a tensor; pass one of them");
      if (s->value) {
        const float f = static_cast<float>(*s->value);
        if (!(std::isfinite(f) && f > 0))
          fail("rope_pool_fused: " + name + " must be finite and > 0, got " + num(*s->value) +
               (std::isfinite(*s->value) && *s->value > 0 ? " (" + num(f) + " as float32)" : ""));
        continue;
      }
      const TensorView& x = s->tensor;
      if (x.numel() != 1)
        fail("rope_pool_fused: " + name + " must be a number or a one-element float32 tensor, got shape " +
             shape(a, x));
      if (x.dtype != DType::Float32)
        fail("rope_pool_fused: " + name + " must be a float32 tensor, got " + dtype_name(x.dtype));
      if (!(x.device == t.k_pool.device))
        fail("rope_pool_fused: " + name + " must be on the pools' device (" +
             device_name(t.k_pool.device) + "), got " + device_name(x.device));
      if (x.device.type == DeviceType::CPU) {
        const float f = *static_cast<const float*>(x.data);
        if (!(std::isfinite(f) && f > 0))
          fail("rope_pool_fused: " + name + " must be finite and > 0, got " + num(f) +
               " (the tensor's value)");
      }
    }
  }

  void layouts() const {
    // A view with elements and no memory (a C++ caller's bug) would crash a kernel; a k_out
    // that has a shape but no data would read as "no k_rot" to a backend, silently. (Shapes-
    // only validation, data_readable false, has no memory to point to.)
    for (auto [a, v] : all())
      if (o.data_readable && v->data == nullptr && v->numel() > 0 && !absent(a))
        fail(std::string("rope_pool_fused: ") + arg_name(a) + " " + shape(a, *v) +
                 " has a null data pointer",
             a == Arg::k_out ? "for a call without k_rot leave k_out empty (a default TensorView)"
                             : "");
    for (auto [a, v] : all()) {
      // an empty tensor addresses nothing (frameworks export it with arbitrary strides)
      // (positions/slots are 1-D and read through their stride)
      if (v->ndim < 3 || v->numel() == 0) continue;
      const int last = v->ndim - 1;
      if (v->shape[last] > 1 && v->strides[last] != 1)
        fail(std::string("rope_pool_fused: ") + arg_name(a) +
                 " must have a contiguous last dimension (stride 1), got strides " +
                 strides_str(*v),
             "pass a view whose head_dim axis is contiguous, e.g. x.contiguous()");
    }
    // Everything the op writes must have one memory location per element, or rows written
    // by different tokens/heads would clobber each other.
    for (auto [a, v] : {std::pair{Arg::q_out, &t.q_out}, {Arg::k_out, &t.k_out},
                        {Arg::k_pool, &t.k_pool}, {Arg::v_pool, &t.v_pool}})
      if (!absent(a) && !non_overlapping(*v))
        fail(std::string("rope_pool_fused: ") + arg_name(a) +
             " has overlapping or negative strides " + strides_str(*v) +
             "; every element it receives needs its own memory");
  }

  // Every tensor argument, for the per-argument checks (no allocation on the call path).
  std::array<std::pair<Arg, const TensorView*>, 9> all() const {
    return {{{Arg::q, &t.q},           {Arg::k, &t.k},         {Arg::v, &t.v},
            {Arg::positions, &t.positions}, {Arg::slots, &t.slots}, {Arg::k_pool, &t.k_pool},
            {Arg::v_pool, &t.v_pool}, {Arg::q_out, &t.q_out}, {Arg::k_out, &t.k_out}}};
  }

  // [rows, heads, D] (or a 4-D pool) with unit last stride: dims of extent > 1, taken by
  // increasing stride, must each step over everything the smaller dims span.
  static bool non_overlapping(const TensorView& v) {
    if (v.numel() == 0) return true;
    std::pair<int64_t, int64_t> dims[TensorView::kMaxDims];  // (stride, extent)
    int n = 0;
    const int last = v.ndim - 1;
    for (int i = 0; i < last; ++i)
      if (v.shape[i] > 1) {
        if (v.strides[i] <= 0) return false;
        dims[n++] = {v.strides[i], v.shape[i]};
      }
    // insertion sort of at most 7 dims (std::sort trips GCC's -Warray-bounds here)
    for (int i = 1; i < n; ++i)
      for (int j = i; j > 0 && dims[j] < dims[j - 1]; --j) std::swap(dims[j], dims[j - 1]);
    int64_t span = v.shape[last];
    for (int i = 0; i < n; ++i) {
      if (dims[i].first < span) return false;
      span = dims[i].first * (dims[i].second - 1) + span;
    }
    return true;
  }

};

detail::Rows rows(const TensorView& v) { return {v.data, v.strides[0], v.strides[1]}; }
// SPEC §6: [P, Hk, D] is page_size 1; NHD [pages, page_size, Hk, D]; HND [pages, Hk, page_size, D].
detail::PoolRows pool_rows(const TensorView& v, KvLayout layout) {
  switch (layout) {
    case KvLayout::NHD: return {v.data, v.strides[0], v.strides[1], v.strides[2]};
    case KvLayout::HND: return {v.data, v.strides[0], v.strides[2], v.strides[1]};
    case KvLayout::None: break;
  }
  return {v.data, v.strides[0], 0, v.strides[1]};
}
detail::Scale scale(const QuantScale& s) {
  detail::Scale out;
  if (s.has_tensor()) out.ptr = static_cast<const float*>(s.tensor.data);
  else if (s.value) out.value = static_cast<float>(*s.value);
  return out;
}
detail::Index index(const TensorView& v) {
  return {v.data, v.strides[0], v.dtype == DType::Int64};
}
// Row r of positions [3, T] (mRoPE), or positions [T] itself.
detail::Index position_row(const TensorView& v, int row) {
  if (v.ndim != 2) return index(v);
  const size_t es = v.dtype == DType::Int64 ? 8 : 4;
  return {static_cast<const char*>(v.data) + row * v.strides[0] * int64_t(es), v.strides[1],
          v.dtype == DType::Int64};
}

// Everything a call needs, checked: the kernel-facing problem, and the schedule made for
// it when the caller passed none (problem.inv_freq points into it or into the caller's).
struct Checked {
  detail::RopePoolProblem problem;
  RopeSchedule made_schedule;
};

Checked check(const RopePoolTensors& t, const RopePoolParams& p, const CallOptions& o) {
  Checker c{t, p, o};
  Checked out;
  c.contract();
  const RopeSchedule* schedule = c.extended(out.made_schedule);
  detail::RopePoolProblem& problem = out.problem;
  problem.dtype = t.q.dtype;
  problem.num_tokens = t.q.shape[0];
  problem.num_qo_heads = p.num_qo_heads;
  problem.num_kv_heads = p.num_kv_heads;
  problem.head_dim = p.head_dim;
  const int64_t page_size = p.kv_layout == KvLayout::NHD   ? t.k_pool.shape[1]
                            : p.kv_layout == KvLayout::HND ? t.k_pool.shape[2]
                                                           : 1;
  problem.pool_size = t.k_pool.shape[0] * page_size;
  // An empty page (page_size 0) holds no slot: every slot >= 0 is out of range; kernels
  // still get a divisor they can use.
  problem.page_size = std::max<int64_t>(1, page_size);
  problem.q = rows(t.q);
  problem.k = rows(t.k);
  problem.v = rows(t.v);
  problem.q_out = rows(t.q_out);
  problem.k_out = rows(t.k_out);
  problem.pool_dtype = t.k_pool.dtype;
  problem.q_out_dtype = t.q_out.dtype;
  problem.k_pool = pool_rows(t.k_pool, p.kv_layout);
  problem.v_pool = pool_rows(t.v_pool, p.kv_layout);
  problem.k_scale = scale(p.k_scale);
  problem.v_scale = scale(p.v_scale);
  problem.q_scale = scale(p.q_scale);
  problem.positions = position_row(t.positions, 0);
  problem.slots = index(t.slots);
  problem.check_slots = o.check_slots;
  problem.stream = o.stream;
  problem.interleaved = p.interleaved;
  problem.rotary_dim = schedule->rotary_dim;
  problem.inv_freq = schedule->inv_freq.data();
  problem.attention_scaling = schedule->attention_scaling;
  // SPEC §7
  if (!schedule->mrope_section.empty()) {
    problem.mrope = true;
    for (int i = 0; i < 3; ++i) problem.mrope_section[i] = schedule->mrope_section[size_t(i)];
    problem.mrope_interleaved = schedule->mrope_interleaved;
    problem.positions_row_stride = t.positions.strides[0];
  }
  problem.q_norm_weight = p.q_norm_weight.data;
  problem.k_norm_weight = p.k_norm_weight.data;
  problem.q_norm_dtype = p.q_norm_weight.dtype;
  problem.k_norm_dtype = p.k_norm_weight.dtype;
  problem.norm_eps = float(p.norm_eps.value_or(1e-6));
  problem.norm_gemma = p.norm_style.value_or("rms") == "gemma";
  if (t.q.device.type == DeviceType::CPU && o.data_readable)
    detail::check_slot_values(problem.slots, problem.num_tokens, problem.pool_size,
                              o.check_slots);
  return out;
}

}  // namespace

namespace detail {

RopePoolProblem backend_problem(const RopePoolTensors& tensors, const RopePoolParams& params,
                                const CallOptions& options, RopeSchedule& schedule) {
  Checked checked = check(tensors, params, options);
  // A moved vector keeps its storage, so problem.inv_freq stays valid.
  schedule = std::move(checked.made_schedule);
  return checked.problem;
}

// SPEC §3 on the host: the first out-of-range slot, and with strict checking the first
// repeated one, are rejected before anything is written. The CUDA backend calls this on
// a host copy of the slots when check_slots is on.
void check_slot_values(const Index& slots, int64_t T, int64_t P, bool reject_duplicates) {
  for (int64_t i = 0; i < T; ++i) {
    const int64_t s = slots[i];
    if (s >= P)
      throw Error("rope_pool_fused: slots[" + std::to_string(i) + "] = " + std::to_string(s) +
                      " is out of range for a pool of " + std::to_string(P) + " slots",
                  "slots index rows of k_pool/v_pool; use a negative slot to skip a token");
  }
  if (!reject_duplicates) return;
  std::vector<std::pair<int64_t, int64_t>> seen;  // (slot, token): grows with T, not P
  seen.reserve(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i)
    if (slots[i] >= 0) seen.emplace_back(slots[i], i);
  std::sort(seen.begin(), seen.end());
  for (size_t i = 1; i < seen.size(); ++i)
    if (seen[i].first == seen[i - 1].first)
      throw Error("rope_pool_fused: slots[" + std::to_string(seen[i].second) + "] = " +
                  std::to_string(seen[i].first) + " repeats slots[" +
                  std::to_string(seen[i - 1].second) +
                  "]; with check_slots each slot may be written once per call");
}

}  // namespace detail

const char* kv_layout_name(KvLayout layout) {
  switch (layout) {
    case KvLayout::NHD: return "NHD";
    case KvLayout::HND: return "HND";
    case KvLayout::None: break;
  }
  return "none";
}

KvLayout parse_kv_layout(const std::string& name) {
  if (name == "NHD") return KvLayout::NHD;
  if (name == "HND") return KvLayout::HND;
  throw Error("rope_pool_fused: kv_layout must be None, \"NHD\" or \"HND\", got \"" + name + "\"",
              "NHD: pools [pages, page_size, num_kv_heads, head_dim]; HND: [pages, num_kv_heads, "
              "page_size, head_dim]");
}

void validate_rope_pool(const RopePoolTensors& tensors, const RopePoolParams& params,
                        const CallOptions& options) {
  check(tensors, params, options);
}

void rope_pool_fused(const RopePoolTensors& tensors, const RopePoolParams& params,
                     const CallOptions& options) {
  if (!options.data_readable)
    throw std::invalid_argument("rope_pool_fused: CallOptions::data_readable = false is for "
                                "validate_rope_pool only");
  const Checked checked = check(tensors, params, options);
  const detail::RopePoolProblem& problem = checked.problem;
  if (problem.num_tokens == 0) return;
  if (tensors.q.device.type == DeviceType::CUDA)
    detail::rope_pool_cuda(problem);
  else
    detail::rope_pool_cpu(problem);
}

}  // namespace ropepool
