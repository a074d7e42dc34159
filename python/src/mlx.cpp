// The MLX front end (ropepool.mlx, SPEC §9): rope_pool_fused and mla_rope_pool_fused as MLX
// primitives, so a call is a node of MLX's lazy graph (evaluated by mx.eval, traceable by
// mx.compile) with MLX's functional semantics: the caches come back as new arrays, which take
// over the buffers of the caches passed in when nothing else references them at evaluation
// time (donation), and are copies otherwise.
//
// Built as its own extension module, ropepool._ropepool_mlx, against the MLX package's
// CMake config and in nanobind's "mlx" domain, so that mx.array arguments and results are
// the very objects of mlx.core (python/CMakeLists.txt). All validation is ropepool's own
// (src/rope_pool.cpp, src/mla_rope_pool.cpp): shapes, dtypes and keywords when the call is
// traced (views without data, CallOptions::data_readable = false, or stand-ins where a check
// reads values), slot and position values when the graph runs.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <initializer_list>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "mlx/version.h"
#include "ropepool/error.hpp"
#include "ropepool/mla.hpp"
#include "ropepool/rope_pool.hpp"
#include "ropepool/schedule.hpp"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace ropepool::mlx_frontend {
namespace {

// Raised by vjp/jvp/vmap; the module's translator turns it into NotImplementedError.
class NotImplemented : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

constexpr const char* kArgNames[7] = {"q", "k", "v", "positions", "slots", "k_pool", "v_pool"};
constexpr const char* kMlaArgNames[6] = {"q_pe", "k_pe", "kv_c", "positions", "slots", "kv_cache"};

DType to_dtype(mx::Dtype d) {
  switch (d.val()) {
    case mx::Dtype::Val::float32: return DType::Float32;
    case mx::Dtype::Val::float16: return DType::Float16;
    case mx::Dtype::Val::bfloat16: return DType::BFloat16;
    case mx::Dtype::Val::int32: return DType::Int32;
    case mx::Dtype::Val::int64: return DType::Int64;
    case mx::Dtype::Val::float64: return DType::Float64;
    case mx::Dtype::Val::int8: return DType::Int8;
    case mx::Dtype::Val::int16: return DType::Int16;
    case mx::Dtype::Val::uint8: return DType::UInt8;
    case mx::Dtype::Val::uint16: return DType::UInt16;
    case mx::Dtype::Val::uint32: return DType::UInt32;
    case mx::Dtype::Val::uint64: return DType::UInt64;
    case mx::Dtype::Val::bool_: return DType::Bool;
    case mx::Dtype::Val::complex64: return DType::Complex64;
  }
  return DType::Other;
}

// A view of an array's shape and dtype, row-major strides, no data: what validation sees
// when a call is traced (a lazy array has neither data nor strides yet).
TensorView shape_view(const mx::array& a) {
  TensorView t;
  t.dtype = to_dtype(a.dtype());
  t.ndim = a.ndim() < size_t(TensorView::kMaxDims) ? int(a.ndim()) : TensorView::kMaxDims;
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[i] = a.shape(i);
    t.strides[i] = stride;
    stride *= t.shape[i] > 0 ? t.shape[i] : 1;
  }
  return t;
}

// The view of an evaluated array's memory (MLX strides are in elements, like TensorView's).
TensorView data_view(const mx::array& a, const void* data) {
  TensorView t = shape_view(a);
  t.data = const_cast<void*>(data);
  if (a.size() > 0)
    for (int i = 0; i < t.ndim; ++i) t.strides[i] = a.strides()[i];
  return t;
}

// A lazy array's shape over host memory that stands in for its data while a call is traced:
// for the checks that read values or ask whether an argument is given by its data pointer.
TensorView stand_in(const mx::array& a, const void* data) {
  TensorView t = shape_view(a);
  t.data = const_cast<void*>(data);
  return t;
}

// MLX keeps float8 e4m3 in uint8 arrays (mx.to_fp8, mx.from_fp8): a uint8 cache holds
// float8_e4m3fn bits.
TensorView e4m3_bits(TensorView v) {
  if (v.dtype == DType::UInt8) v.dtype = DType::Float8E4M3FN;
  return v;
}

// Shapes in messages as MLX prints them (a Python tuple: "(2, 8, 128)").
std::string tuple_shape(const TensorView& v) {
  std::string s = "(";
  for (int i = 0; i < v.ndim; ++i) s += (i ? ", " : "") + std::to_string(v.shape[i]);
  return s + (v.ndim == 1 ? ",)" : ")");
}

bool last_dim_contiguous(const mx::array& a) {
  return a.size() == 0 || a.ndim() == 0 || a.shape(-1) <= 1 || a.strides().back() == 1;
}

// Copies the elements of a (any strides) into `dst`, row-major.
void gather(const mx::array& a, const char* src, char* dst) {
  const size_t es = a.itemsize();
  const int n = int(a.ndim());
  std::vector<int64_t> idx(size_t(n), 0);
  for (size_t e = 0; e < a.size(); ++e) {
    int64_t off = 0;
    for (int d = 0; d < n; ++d) off += idx[size_t(d)] * a.strides()[size_t(d)];
    std::memcpy(dst + e * es, src + off * int64_t(es), es);
    for (int d = n - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < a.shape(d)) break;
      idx[size_t(d)] = 0;
    }
  }
}

// Copies cache `a` into a row-major buffer: whole rows at a time where rows are contiguous.
void copy_cache(const mx::array& a, const char* src, char* dst) {
  if (a.flags().row_contiguous) {
    std::memcpy(dst, src, a.nbytes());
    return;
  }
  gather(a, src, dst);
}

bool same_schedule(const RopeSchedule* a, const RopeSchedule* b) {
  if (!a || !b) return a == b;
  return a->rotary_dim == b->rotary_dim && a->inv_freq == b->inv_freq &&
         a->attention_scaling == b->attention_scaling &&
         a->mrope_section == b->mrope_section && a->mrope_interleaved == b->mrope_interleaved;
}

// What one evaluation hands to the stream's thread. The arrays are weak copies (no
// reference count): MLX keeps the inputs' and outputs' buffers alive until the task ran.
struct Task {
  std::vector<mx::array> in, out;
  std::vector<bool> donated;
};

// A task's arrays as the op reads and writes them, on the stream's thread.
struct TaskViews {
  const Task& t;
  std::deque<std::vector<char>> scratch;

  // Input i: rows with a contiguous last dimension, which the kernel reads (other layouts
  // are gathered).
  TensorView input(size_t i) {
    const mx::array& a = t.in[i];
    const char* data = a.size() ? a.data<char>() : nullptr;
    if (last_dim_contiguous(a)) return data_view(a, data);
    std::vector<char>& copy = scratch.emplace_back(a.nbytes());
    gather(a, data, copy.data());
    return stand_in(a, copy.data());
  }
  // Positions and slots, read through their strides.
  TensorView index(size_t i) const {
    const mx::array& a = t.in[i];
    return data_view(a, a.size() ? a.data<void>() : nullptr);
  }
  // Output o; a cache (`old`: the input it replaces) holds the old values first when its
  // buffer is a new one.
  TensorView output(size_t o, int old = -1) const {
    const mx::array& out = t.out[o];
    void* dst = out.size() ? const_cast<void*>(out.data<void>()) : nullptr;
    if (old >= 0 && !t.donated[o] && out.size())
      copy_cache(t.in[size_t(old)], t.in[size_t(old)].data<char>(), static_cast<char*>(dst));
    return data_view(out, dst);
  }
};

std::string gpu_message(const char* op) {
  return std::string("ropepool.mlx.") + op +
         " runs on MLX's CPU stream only: this build has no ropepool backend for MLX's gpu "
         "device (Metal or MLX's CUDA backend); pass stream=mx.cpu or run it under `with "
         "mx.stream(mx.cpu):`";
}

// What both primitives share: donation, the hand-over to the stream's thread, and the
// transformations they refuse.
class CachePrimitive : public mx::Primitive {
 public:
  CachePrimitive(mx::Stream stream, const char* op) : mx::Primitive(stream), op_(op) {}

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::invalid_argument(gpu_message(op_));
  }

  std::vector<mx::array> jvp(const std::vector<mx::array>&, const std::vector<mx::array>&,
                             const std::vector<int>&) override {
    throw NotImplemented(std::string("ropepool.mlx.") + op_ +
                         ": jvp (forward-mode gradient) is not implemented; the op is for "
                         "inference (it writes a KV cache)");
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>&, const std::vector<mx::array>&,
                             const std::vector<int>&, const std::vector<mx::array>&) override {
    throw NotImplemented(std::string("ropepool.mlx.") + op_ +
                         ": vjp (gradient) is not implemented; the op is for inference (it "
                         "writes a KV cache)");
  }

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>&,
                                                           const std::vector<int>&) override {
    throw NotImplemented(std::string("ropepool.mlx.") + op_ +
                         ": vmap is not implemented; pass the tokens of every sequence as one "
                         "[T, ...] batch");
  }

 protected:
  // Donation: output o takes over the buffer of input replaces[o] (-1: none) when nothing
  // else references it, and the kernel then writes in place; otherwise the output gets a new
  // buffer (a cache: a copy of the old values, made on the stream's thread). Then `run`
  // is queued on the stream with the task: the data pointers are final now (buffers are
  // allocated when an array's producer is encoded), the values are there when it runs.
  template <class Run>
  void dispatch(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
                std::initializer_list<int> replaces, Run run) {
    // Each output of a multi-output primitive keeps its own copy of the input list, so an
    // input is referenced once per output and is_donatable() would never hold. The copies
    // of the outputs other than the one being evaluated (whose list `inputs` is) are
    // dropped now; MLX drops them right after this evaluation anyway (array::detach). Not
    // while a transformation traces the graph: it still walks them.
    if (!outputs[0].is_tracer())
      for (auto& out : outputs)
        if (&out.inputs() != &inputs) out.inputs().clear();
    auto task = std::make_shared<Task>();
    size_t o = 0;
    for (int in : replaces) {
      mx::array& out = outputs[o++];
      const bool donated = in >= 0 && donate(inputs[size_t(in)], out);
      if (!donated) out.set_data(mx::allocator::malloc(out.nbytes()));
      task->donated.push_back(donated);
    }
    for (const auto& a : inputs) task->in.push_back(mx::array::unsafe_weak_copy(a));
    for (const auto& a : outputs) task->out.push_back(mx::array::unsafe_weak_copy(a));
    mx::cpu::get_command_encoder(stream()).dispatch([task, run] { run(*task); });
  }

 private:
  static bool donate(const mx::array& in, mx::array& out) {
    if (!in.is_donatable() || !in.flags().row_contiguous || in.dtype() != out.dtype() ||
        in.data_size() != out.size())
      return false;
    out.copy_shared_buffer(in);
    return true;
  }

  const char* op_;
};

// Where rope_pool_fused's optional array arguments sit among the primitive's inputs (-1:
// not given): SPEC §7's norm weights, SPEC §6's scales (k_scale, v_scale, q_scale).
struct ExtraInputs {
  int q_norm = -1, k_norm = -1;
  int scales[3] = {-1, -1, -1};
  bool operator==(const ExtraInputs&) const = default;
};

// rope_pool_fused. Inputs (q, k, v, positions, slots, k_pool, v_pool, then the extra inputs
// that are given), outputs (q_rot, k_rot, k_pool, v_pool), or (q_rot, k_pool, v_pool) without
// k_rot (SPEC §4 return_k_rot=False: no k_rot output, nothing allocated or written for it).
// uint8 pools and a uint8 q_rot hold float8 e4m3 bits (SPEC §6).
class RopePoolFused : public CachePrimitive {
 public:
  RopePoolFused(mx::Stream stream, RopePoolParams params,
                std::shared_ptr<const RopeSchedule> schedule, bool check_slots, bool inplace,
                bool q_fp8, ExtraInputs extra, bool k_rot)
      : CachePrimitive(stream, "rope_pool_fused"), params_(params),
        schedule_(std::move(schedule)), check_slots_(check_slots), inplace_(inplace),
        q_fp8_(q_fp8), k_rot_(k_rot), extra_(extra) {
    params_.schedule = schedule_.get();
  }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int q = inplace_ ? 0 : -1, k = inplace_ ? 1 : -1;  // q_rot <- q, k_rot <- k
    // On the stream's thread, the op (which validates again, now with the values: an
    // out-of-range slot throws before anything is written, and MLX raises it from the
    // evaluation).
    auto run = [params = params_, schedule = schedule_, check_slots = check_slots_,
                extra = extra_, k_rot = k_rot_](const Task& task) {
      TaskViews v{task, {}};
      RopePoolTensors t;
      t.q = v.input(0);
      t.k = v.input(1);
      t.v = v.input(2);
      t.positions = v.index(3);
      t.slots = v.index(4);
      t.q_out = e4m3_bits(v.output(0));
      // without k_rot: k_out stays empty and the pools are outputs 1 and 2
      const size_t pools = k_rot ? 2 : 1;
      if (k_rot) t.k_out = v.output(1);
      t.k_pool = e4m3_bits(v.output(pools, 5));
      t.v_pool = e4m3_bits(v.output(pools + 1, 6));
      RopePoolParams p = params;
      if (extra.q_norm >= 0) p.q_norm_weight = v.input(size_t(extra.q_norm));
      if (extra.k_norm >= 0) p.k_norm_weight = v.input(size_t(extra.k_norm));
      QuantScale* scales[3] = {&p.k_scale, &p.v_scale, &p.q_scale};
      for (int i = 0; i < 3; ++i)
        if (extra.scales[i] >= 0) scales[i]->tensor = v.input(size_t(extra.scales[i]));
      CallOptions options;
      options.check_slots = check_slots;
      options.format_shape = [](Arg, const TensorView& x) { return tuple_shape(x); };
      rope_pool_fused(t, p, options);
    };
    if (k_rot_)
      dispatch(inputs, outputs, {q, k, 5, 6}, std::move(run));
    else
      dispatch(inputs, outputs, {q, 5, 6}, std::move(run));
  }

  const char* name() const override { return "RopePoolFused"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RopePoolFused&>(other);
    return params_.head_dim == o.params_.head_dim &&
           params_.num_qo_heads == o.params_.num_qo_heads &&
           params_.num_kv_heads == o.params_.num_kv_heads &&
           params_.rope_base == o.params_.rope_base &&
           params_.rotary_dim == o.params_.rotary_dim &&
           params_.interleaved == o.params_.interleaved && check_slots_ == o.check_slots_ &&
           inplace_ == o.inplace_ && same_schedule(schedule_.get(), o.schedule_.get()) &&
           extra_ == o.extra_ && params_.norm_eps == o.params_.norm_eps &&
           params_.norm_style == o.params_.norm_style && q_fp8_ == o.q_fp8_ &&
           k_rot_ == o.k_rot_ &&
           params_.kv_layout == o.params_.kv_layout &&
           params_.k_scale.value == o.params_.k_scale.value &&
           params_.v_scale.value == o.params_.v_scale.value &&
           params_.q_scale.value == o.params_.q_scale.value;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    if (!k_rot_) return {inputs[0].shape(), inputs[5].shape(), inputs[6].shape()};
    return {inputs[0].shape(), inputs[1].shape(), inputs[5].shape(), inputs[6].shape()};
  }

 private:
  RopePoolParams params_;
  std::shared_ptr<const RopeSchedule> schedule_;
  bool check_slots_;
  bool inplace_;
  bool q_fp8_;
  bool k_rot_;  // false: no k_rot output (return_k_rot=False)
  ExtraInputs extra_;
};

// mla_rope_pool_fused. Inputs (q_pe, k_pe, kv_c, positions, slots, kv_cache, then kv_scale
// when it is an array), outputs (q_pe_rot, k_pe_rot, kv_cache), or (q_pe_rot, kv_cache)
// without k_pe_rot (SPEC §8 return_k_rot=False: no k_pe_rot output, nothing allocated or
// written for it).
class MlaRopePoolFused : public CachePrimitive {
 public:
  MlaRopePoolFused(mx::Stream stream, MlaParams params,
                   std::shared_ptr<const RopeSchedule> schedule, bool check_slots, bool inplace,
                   bool scale_input, bool k_rot)
      : CachePrimitive(stream, "mla_rope_pool_fused"), params_(params),
        schedule_(std::move(schedule)), check_slots_(check_slots), inplace_(inplace),
        scale_input_(scale_input), k_rot_(k_rot) {
    params_.schedule = schedule_.get();  // null: the op makes the default schedule
  }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int q = inplace_ ? 0 : -1, k = inplace_ ? 1 : -1;
    auto run = [params = params_, schedule = schedule_, check_slots = check_slots_,
                scale_input = scale_input_, k_rot = k_rot_](const Task& task) {
      TaskViews v{task, {}};
      MlaTensors t;
      t.q_pe = v.input(0);
      t.k_pe = v.input(1);
      t.kv_c = v.input(2);
      t.positions = v.index(3);
      t.slots = v.index(4);
      t.q_out = v.output(0);
      // without k_pe_rot: k_out stays empty and the cache is output 1
      if (k_rot) t.k_out = v.output(1);
      t.kv_cache = e4m3_bits(v.output(k_rot ? 2 : 1, 5));
      if (scale_input) t.kv_scale = v.input(6);
      MlaCallOptions options;
      options.check_slots = check_slots;
      options.format_shape = [](const char*, const TensorView& x) { return tuple_shape(x); };
      mla_rope_pool_fused(t, params, options);
    };
    if (k_rot_)
      dispatch(inputs, outputs, {q, k, 5}, std::move(run));
    else
      dispatch(inputs, outputs, {q, 5}, std::move(run));
  }

  const char* name() const override { return "MlaRopePoolFused"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const MlaRopePoolFused&>(other);
    return params_.rope_base == o.params_.rope_base &&
           params_.interleaved == o.params_.interleaved &&
           params_.kv_layout == o.params_.kv_layout && params_.kv_scale == o.params_.kv_scale &&
           check_slots_ == o.check_slots_ && inplace_ == o.inplace_ &&
           scale_input_ == o.scale_input_ && k_rot_ == o.k_rot_ &&
           same_schedule(schedule_.get(), o.schedule_.get());
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    if (!k_rot_) return {inputs[0].shape(), inputs[5].shape()};
    return {inputs[0].shape(), inputs[1].shape(), inputs[5].shape()};
  }

 private:
  MlaParams params_;
  std::shared_ptr<const RopeSchedule> schedule_;
  bool check_slots_;
  bool inplace_;
  bool scale_input_;
  bool k_rot_;  // false: no k_pe_rot output (return_k_rot=False)
};

mx::array as_array(nb::handle obj, const char* op, const char* name) {
  mx::array* a = nullptr;
  if (!nb::try_cast(obj, a, /*convert=*/false) || a == nullptr) {
    nb::object type_name = obj.type().attr("__name__");
    throw nb::type_error((std::string(op) + ": " + name + " must be an mlx.core.array, got " +
                          nb::cast<std::string>(nb::str(type_name)))
                             .c_str());
  }
  return *a;
}

using StreamArg = std::optional<std::variant<mx::Stream, mx::Device, mx::Device::DeviceType>>;

// The stream a call runs on: MLX's CPU stream. A GPU stream or device is refused before MLX
// is asked for it (an MLX without a GPU backend would only say that it has none).
mx::Stream cpu_stream(const StreamArg& stream, const char* op) {
  const bool gpu_asked = stream && std::visit([](const auto& x) {
    using X = std::decay_t<decltype(x)>;
    if constexpr (std::is_same_v<X, mx::Stream>) return x.device.type != mx::Device::DeviceType::cpu;
    else if constexpr (std::is_same_v<X, mx::Device>) return x.type != mx::Device::DeviceType::cpu;
    else return x != mx::Device::DeviceType::cpu;
  }, *stream);
  if (gpu_asked) throw Error(gpu_message(op));
  const mx::Stream s = stream ? std::visit([](auto x) { return mx::to_stream(x); }, *stream)
                              : mx::to_stream(std::monostate{});
  if (s.device.type != mx::Device::DeviceType::cpu) throw Error(gpu_message(op));
  return s;
}

// A schedule from the Python layer (made by ropepool.rope_schedule), or null.
std::shared_ptr<RopeSchedule> given_schedule(std::optional<std::vector<double>> inv_freq,
                                             double attention_scaling) {
  if (!inv_freq) return nullptr;
  auto schedule = std::make_shared<RopeSchedule>();
  // The schedule's own rotary_dim (2 per frequency): a mismatch is reported with it.
  schedule->rotary_dim = 2 * int64_t(inv_freq->size());
  schedule->inv_freq = std::move(*inv_freq);
  schedule->attention_scaling = attention_scaling;
  return schedule;
}

nb::tuple rope_pool_fused_mlx(nb::handle q, nb::handle k, nb::handle v, nb::handle positions,
                              nb::handle slots, nb::handle k_pool, nb::handle v_pool,
                              int64_t head_dim, int64_t num_qo_heads, int64_t num_kv_heads,
                              double rope_base, int64_t rotary_dim, bool interleaved,
                              std::optional<std::vector<double>> schedule_inv_freq,
                              double schedule_attention_scaling, bool inplace,
                              bool check_slots, nb::handle q_norm_weight,
                              nb::handle k_norm_weight, std::optional<double> norm_eps,
                              std::optional<std::string> norm_style,
                              std::optional<std::vector<int64_t>> mrope_section,
                              bool mrope_interleaved, std::optional<std::string> kv_layout,
                              std::optional<double> k_scale, nb::handle k_scale_tensor,
                              std::optional<double> v_scale, nb::handle v_scale_tensor,
                              std::optional<double> q_scale, nb::handle q_scale_tensor,
                              bool q_fp8, bool return_k_rot, StreamArg stream) {
  constexpr const char* kOp = "rope_pool_fused";
  const nb::handle objects[7] = {q, k, v, positions, slots, k_pool, v_pool};
  std::vector<mx::array> inputs;
  inputs.reserve(12);
  for (int i = 0; i < 7; ++i) inputs.push_back(as_array(objects[i], kOp, kArgNames[i]));
  // SPEC §7's norm weights and SPEC §6's scale arrays are inputs like q (read when the
  // graph runs).
  auto optional_input = [&](nb::handle obj, const char* name) {
    if (obj.is_none()) return -1;
    inputs.push_back(as_array(obj, kOp, name));
    return int(inputs.size()) - 1;
  };
  ExtraInputs extra;
  extra.q_norm = optional_input(q_norm_weight, "q_norm_weight");
  extra.k_norm = optional_input(k_norm_weight, "k_norm_weight");
  extra.scales[0] = optional_input(k_scale_tensor, "k_scale");
  extra.scales[1] = optional_input(v_scale_tensor, "v_scale");
  extra.scales[2] = optional_input(q_scale_tensor, "q_scale");

  RopePoolParams params;
  params.head_dim = head_dim;
  params.num_qo_heads = num_qo_heads;
  params.num_kv_heads = num_kv_heads;
  params.rope_base = rope_base;
  params.rotary_dim = rotary_dim;
  params.interleaved = interleaved;
  params.norm_eps = norm_eps;
  params.norm_style = std::move(norm_style);
  if (kv_layout) params.kv_layout = parse_kv_layout(*kv_layout);
  QuantScale* scales[3] = {&params.k_scale, &params.v_scale, &params.q_scale};
  scales[0]->value = k_scale;
  scales[1]->value = v_scale;
  scales[2]->value = q_scale;
  std::shared_ptr<RopeSchedule> schedule =
      given_schedule(std::move(schedule_inv_freq), schedule_attention_scaling);
  if (schedule) {
    if (mrope_section) schedule->mrope_section = *mrope_section;
    schedule->mrope_interleaved = mrope_interleaved;
    params.schedule = schedule.get();
  } else {
    if (mrope_section) params.rope_scaling.mrope_section = *mrope_section;
    params.rope_scaling.mrope_interleaved = mrope_interleaved;
  }

  // Shapes, dtypes and keywords now, with the messages of SPEC §2 (values: at evaluation).
  RopePoolTensors views;
  views.q = shape_view(inputs[0]);
  views.k = shape_view(inputs[1]);
  views.v = shape_view(inputs[2]);
  views.positions = shape_view(inputs[3]);
  views.slots = shape_view(inputs[4]);
  views.k_pool = e4m3_bits(shape_view(inputs[5]));
  views.v_pool = e4m3_bits(shape_view(inputs[6]));
  views.q_out = views.q;
  if (q_fp8) views.q_out.dtype = DType::Float8E4M3FN;
  if (return_k_rot) views.k_out = views.k;  // else empty: no k_rot (SPEC §4)
  // Validation tells a given norm weight by its data pointer (memory that is never read
  // stands in) and reads a scale array's value on the CPU (1 stands in).
  const int64_t unread[1] = {};
  const float one = 1.0f;
  if (extra.q_norm >= 0) params.q_norm_weight = stand_in(inputs[size_t(extra.q_norm)], unread);
  if (extra.k_norm >= 0) params.k_norm_weight = stand_in(inputs[size_t(extra.k_norm)], unread);
  for (int i = 0; i < 3; ++i)
    if (extra.scales[i] >= 0) scales[i]->tensor = stand_in(inputs[size_t(extra.scales[i])], &one);
  CallOptions options;
  options.data_readable = false;
  options.check_slots = check_slots;
  options.format_shape = [](Arg, const TensorView& view) { return tuple_shape(view); };
  validate_rope_pool(views, params, options);
  // the evaluation's views replace the stand-ins
  params.q_norm_weight = params.k_norm_weight = TensorView{};
  for (QuantScale* scale : scales) scale->tensor = TensorView{};

  const mx::Stream s = cpu_stream(stream, kOp);
  if (!schedule) schedule = std::make_shared<RopeSchedule>(make_rope_schedule(params));

  auto primitive = std::make_shared<RopePoolFused>(s, params, std::move(schedule), check_slots,
                                                   inplace, q_fp8, extra, return_k_rot);
  const mx::Dtype q_rot_dtype = q_fp8 ? mx::uint8 : inputs[0].dtype();
  if (!return_k_rot) {  // three outputs: no k_rot array at all
    auto outputs = mx::array::make_arrays(
        {inputs[0].shape(), inputs[5].shape(), inputs[6].shape()},
        {q_rot_dtype, inputs[5].dtype(), inputs[6].dtype()}, std::move(primitive), inputs);
    return nb::make_tuple(outputs[0], nb::none(), outputs[1], outputs[2]);
  }
  auto outputs = mx::array::make_arrays(
      {inputs[0].shape(), inputs[1].shape(), inputs[5].shape(), inputs[6].shape()},
      {q_rot_dtype, inputs[1].dtype(), inputs[5].dtype(), inputs[6].dtype()},
      std::move(primitive), inputs);
  return nb::make_tuple(outputs[0], outputs[1], outputs[2], outputs[3]);
}

nb::tuple mla_rope_pool_fused_mlx(nb::handle q_pe, nb::handle k_pe, nb::handle kv_c,
                                  nb::handle positions, nb::handle slots, nb::handle kv_cache,
                                  double rope_base, bool interleaved,
                                  std::optional<std::vector<double>> inv_freq,
                                  double attention_scaling, bool nhd,
                                  std::optional<double> kv_scale, nb::handle kv_scale_tensor,
                                  bool inplace, bool check_slots, bool return_k_rot,
                                  StreamArg stream) {
  constexpr const char* kOp = "mla_rope_pool_fused";
  const nb::handle objects[6] = {q_pe, k_pe, kv_c, positions, slots, kv_cache};
  std::vector<mx::array> inputs;
  inputs.reserve(7);
  for (int i = 0; i < 6; ++i) inputs.push_back(as_array(objects[i], kOp, kMlaArgNames[i]));
  const bool scale_input = !kv_scale_tensor.is_none();  // read when the graph runs
  if (scale_input) inputs.push_back(as_array(kv_scale_tensor, kOp, "kv_scale"));

  MlaParams params;
  params.rope_base = rope_base;
  params.interleaved = interleaved;
  params.kv_layout = nhd ? MlaCacheLayout::NHD : MlaCacheLayout::Token;
  params.kv_scale = kv_scale;
  std::shared_ptr<const RopeSchedule> schedule =
      given_schedule(std::move(inv_freq), attention_scaling);
  params.schedule = schedule.get();

  // Shapes, dtypes and keywords now, with the op's messages (SPEC §8). Validation reads the
  // positions (the angle limit), the slots (their range) and a scale array (its value): they
  // stand in as 0, -1 (no write) and 1; the evaluation checks the real values.
  const std::vector<int64_t> zeros(inputs[3].size(), 0), no_writes(inputs[4].size(), -1);
  const float one = 1.0f;
  MlaTensors views;
  views.q_pe = shape_view(inputs[0]);
  views.k_pe = shape_view(inputs[1]);
  views.kv_c = shape_view(inputs[2]);
  views.positions = stand_in(inputs[3], zeros.data());
  views.slots = stand_in(inputs[4], no_writes.data());
  views.kv_cache = e4m3_bits(shape_view(inputs[5]));
  views.q_out = views.q_pe;
  if (return_k_rot) views.k_out = views.k_pe;  // else empty: no k_pe_rot (SPEC §8)
  if (scale_input) views.kv_scale = stand_in(inputs[6], &one);
  MlaCallOptions options;
  options.data_readable = false;  // lazy arrays: no memory yet
  options.check_slots = check_slots;
  options.format_shape = [](const char*, const TensorView& view) { return tuple_shape(view); };
  validate_mla_rope_pool(views, params, options);

  const mx::Stream s = cpu_stream(stream, kOp);
  auto primitive = std::make_shared<MlaRopePoolFused>(s, params, std::move(schedule),
                                                      check_slots, inplace, scale_input,
                                                      return_k_rot);
  if (!return_k_rot) {  // two outputs: no k_pe_rot array at all
    auto outputs = mx::array::make_arrays({inputs[0].shape(), inputs[5].shape()},
                                          {inputs[0].dtype(), inputs[5].dtype()},
                                          std::move(primitive), inputs);
    return nb::make_tuple(outputs[0], nb::none(), outputs[1]);
  }
  auto outputs = mx::array::make_arrays(
      {inputs[0].shape(), inputs[1].shape(), inputs[5].shape()},
      {inputs[0].dtype(), inputs[1].dtype(), inputs[5].dtype()}, std::move(primitive), inputs);
  return nb::make_tuple(outputs[0], outputs[1], outputs[2]);
}

// Raises `type(message)` with `hint` attached as an exception note (PEP 678), like the
// core module's translator (python/src/module.cpp).
void raise_with_note(PyObject* type, const char* message, const std::string& hint) {
  PyObject* exc = PyObject_CallFunction(type, "s", message);
  if (!exc) return;
  if (!hint.empty()) {
    PyObject* r = PyObject_CallMethod(exc, "add_note", "s", hint.c_str());
    if (r)
      Py_DECREF(r);
    else
      PyErr_Clear();
  }
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
}

}  // namespace
}  // namespace ropepool::mlx_frontend

NB_MODULE(_ropepool_mlx, m) {
  using namespace ropepool::mlx_frontend;
  m.doc() = "ropepool's MLX primitives (nanobind, MLX's domain). Use ropepool.mlx instead.";
  // The MLX the module was compiled against (its C++ API has no stable ABI across releases).
  m.attr("mlx_version") = std::to_string(MLX_VERSION_MAJOR) + "." +
                          std::to_string(MLX_VERSION_MINOR) + "." +
                          std::to_string(MLX_VERSION_PATCH);

  // In MLX's nanobind domain this translator also sees errors that mlx.core's own
  // functions pass on from the primitive (mx.eval, mx.grad): ropepool's errors keep their
  // Python types and notes there too.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const ropepool::Error& e) {
      raise_with_note(PyExc_ValueError, e.what(), e.hint());
    } catch (const ropepool::BackendError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (const NotImplemented& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what());
    }
  });

  m.def("is_mlx_array", [](nb::handle obj) {
    mx::array* a = nullptr;
    return nb::try_cast(obj, a, false) && a != nullptr;
  }, "True when obj is an mlx.core.array this module can take (the import-time ABI check).");

  m.def("rope_pool_fused", &rope_pool_fused_mlx, "q"_a, "k"_a, "v"_a, "positions"_a,
        "slots"_a, "k_pool"_a, "v_pool"_a, nb::kw_only(), "head_dim"_a, "num_qo_heads"_a,
        "num_kv_heads"_a, "rope_base"_a, "rotary_dim"_a = 0, "interleaved"_a = false,
        "schedule_inv_freq"_a = nb::none(), "schedule_attention_scaling"_a = 1.0,
        "inplace"_a = false, "check_slots"_a = false, "q_norm_weight"_a = nb::none(),
        "k_norm_weight"_a = nb::none(), "norm_eps"_a = nb::none(), "norm_style"_a = nb::none(),
        "mrope_section"_a = nb::none(), "mrope_interleaved"_a = false,
        "kv_layout"_a = nb::none(), "k_scale"_a = nb::none(), "k_scale_tensor"_a = nb::none(),
        "v_scale"_a = nb::none(), "v_scale_tensor"_a = nb::none(), "q_scale"_a = nb::none(),
        "q_scale_tensor"_a = nb::none(), "q_fp8"_a = false, "return_k_rot"_a = true,
        "stream"_a = nb::none(),
        "Low-level: the MLX primitive with the keywords normalised by ropepool.mlx "
        "(use ropepool.mlx.rope_pool_fused). Returns (q_rot, k_rot, k_pool, v_pool), lazy; "
        "k_rot is None with return_k_rot=False (the primitive then has no k_rot output).");

  m.def("mla_rope_pool_fused", &mla_rope_pool_fused_mlx, "q_pe"_a, "k_pe"_a, "kv_c"_a,
        "positions"_a, "slots"_a, "kv_cache"_a, nb::kw_only(), "rope_base"_a,
        "interleaved"_a = true, "inv_freq"_a = nb::none(), "attention_scaling"_a = 1.0,
        "nhd"_a = false, "kv_scale"_a = nb::none(), "kv_scale_tensor"_a = nb::none(),
        "inplace"_a = false, "check_slots"_a = false, "return_k_rot"_a = true,
        "stream"_a = nb::none(),
        "Low-level: the MLX primitive of mla_rope_pool_fused with the keywords normalised by "
        "ropepool.mlx (use ropepool.mlx.mla_rope_pool_fused). Returns (q_pe_rot, k_pe_rot, "
        "kv_cache), lazy; k_pe_rot is None with return_k_rot=False (the primitive then has no "
        "k_pe_rot output).");
}
