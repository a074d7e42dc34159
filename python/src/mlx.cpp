// The MLX front end (ropepool.mlx, SPEC §9): rope_pool_fused as an MLX primitive, so a call
// is a node of MLX's lazy graph (evaluated by mx.eval, traceable by mx.compile) with MLX's
// functional semantics: the pools come back as new arrays, which take over the buffers of
// the pools passed in when nothing else references them at evaluation time (donation),
// and are copies otherwise.
//
// Built as its own extension module, ropepool._ropepool_mlx, against the MLX package's
// CMake config and in nanobind's "mlx" domain, so that mx.array arguments and results are
// the very objects of mlx.core (python/CMakeLists.txt). All validation is ropepool's own
// (src/rope_pool.cpp): shapes, dtypes and keywords when the call is traced (views without
// data, CallOptions::data_readable = false), slot and position values when the graph runs.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <exception>
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

// Copies pool `a` into a row-major buffer: whole rows at a time where rows are contiguous.
void copy_pool(const mx::array& a, const char* src, char* dst) {
  if (a.flags().row_contiguous) {
    std::memcpy(dst, src, a.nbytes());
    return;
  }
  gather(a, src, dst);
}

// What one evaluation hands to the stream's thread. The arrays are weak copies (no
// reference count): MLX keeps the inputs' and outputs' buffers alive until the task ran.
struct Task {
  RopePoolParams params;
  std::shared_ptr<const RopeSchedule> schedule;
  bool check_slots;
  bool donated[4];
  mx::array in[7];
  mx::array out[4];
};

// The primitive: inputs (q, k, v, positions, slots, k_pool, v_pool), outputs
// (q_rot, k_rot, k_pool, v_pool).
class RopePoolFused : public mx::Primitive {
 public:
  RopePoolFused(mx::Stream stream, RopePoolParams params,
                std::shared_ptr<const RopeSchedule> schedule, bool check_slots, bool inplace)
      : mx::Primitive(stream), params_(params), schedule_(std::move(schedule)),
        check_slots_(check_slots), inplace_(inplace) {
    params_.schedule = schedule_.get();
  }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    // Donation: an input nothing else references gives its buffer to the output that
    // replaces it (the pools always; q and k with inplace=True). The kernel then writes in
    // place; otherwise the output gets a new buffer (pools: a copy of the old values).
    auto donate = [](const mx::array& in, mx::array& out) {
      if (!in.is_donatable() || !in.flags().row_contiguous || in.dtype() != out.dtype() ||
          in.data_size() != out.size())
        return false;
      out.copy_shared_buffer(in);
      return true;
    };
    bool donated[4];
    // Each output of a multi-output primitive keeps its own copy of the input list, so an
    // input is referenced once per output and is_donatable() would never hold. The copies
    // of the outputs other than the one being evaluated (whose list `inputs` is) are
    // dropped now; MLX drops them right after this evaluation anyway (array::detach). Not
    // while a transformation traces the graph: it still walks them.
    if (!outputs[0].is_tracer())
      for (auto& out : outputs)
        if (&out.inputs() != &inputs) out.inputs().clear();
    for (int o = 0; o < 4; ++o) {
      const int in = o < 2 ? o : o + 3;  // q_rot <- q, k_rot <- k, pools <- pools
      donated[o] = (o >= 2 || inplace_) && donate(inputs[size_t(in)], outputs[size_t(o)]);
      if (!donated[o]) outputs[size_t(o)].set_data(mx::allocator::malloc(outputs[size_t(o)].nbytes()));
    }

    // The data pointers are final now (buffers are allocated when an array's producer is
    // encoded); the values are there when the stream runs the task, in order.
    auto task = std::make_shared<Task>(Task{
        params_, schedule_, check_slots_, {donated[0], donated[1], donated[2], donated[3]},
        {mx::array::unsafe_weak_copy(inputs[0]), mx::array::unsafe_weak_copy(inputs[1]),
         mx::array::unsafe_weak_copy(inputs[2]), mx::array::unsafe_weak_copy(inputs[3]),
         mx::array::unsafe_weak_copy(inputs[4]), mx::array::unsafe_weak_copy(inputs[5]),
         mx::array::unsafe_weak_copy(inputs[6])},
        {mx::array::unsafe_weak_copy(outputs[0]), mx::array::unsafe_weak_copy(outputs[1]),
         mx::array::unsafe_weak_copy(outputs[2]), mx::array::unsafe_weak_copy(outputs[3])}});
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([task] { run(*task); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::invalid_argument(gpu_message());
  }

  static std::string gpu_message() {
    return "ropepool.mlx.rope_pool_fused runs on MLX's CPU stream only: this build has no "
           "ropepool backend for MLX's gpu device (Metal or MLX's CUDA backend); pass "
           "stream=mx.cpu or run it under `with mx.stream(mx.cpu):`";
  }

  std::vector<mx::array> jvp(const std::vector<mx::array>&, const std::vector<mx::array>&,
                             const std::vector<int>&) override {
    throw NotImplemented("ropepool.mlx.rope_pool_fused: jvp (forward-mode gradient) is not "
                         "implemented; the op is for inference (it writes a KV cache)");
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>&, const std::vector<mx::array>&,
                             const std::vector<int>&, const std::vector<mx::array>&) override {
    throw NotImplemented("ropepool.mlx.rope_pool_fused: vjp (gradient) is not implemented; "
                         "the op is for inference (it writes a KV cache)");
  }

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>&,
                                                           const std::vector<int>&) override {
    throw NotImplemented("ropepool.mlx.rope_pool_fused: vmap is not implemented; pass the "
                         "tokens of every sequence as one [T, ...] batch");
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
           inplace_ == o.inplace_ && schedule_->rotary_dim == o.schedule_->rotary_dim &&
           schedule_->inv_freq == o.schedule_->inv_freq &&
           schedule_->attention_scaling == o.schedule_->attention_scaling;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[1].shape(), inputs[5].shape(), inputs[6].shape()};
  }

 private:
  // On the stream's thread: copies where needed, then the op (which validates again, now
  // with the values: an out-of-range slot throws before anything is written, and MLX
  // raises it from the evaluation).
  static void run(Task& t) {
    std::vector<char> scratch[5];
    auto input_view = [&](int i) {
      const mx::array& a = t.in[i];
      const char* data = a.size() ? static_cast<const char*>(a.data<void>()) : nullptr;
      if (a.ndim() == 3 && !last_dim_contiguous(a)) {
        // The kernel reads rows with a contiguous last dimension: gather the others.
        scratch[i].resize(a.nbytes());
        gather(a, data, scratch[i].data());
        TensorView v = shape_view(a);
        v.data = scratch[i].data();
        return v;
      }
      return data_view(a, data);
    };
    RopePoolTensors tensors;
    tensors.q = input_view(0);
    tensors.k = input_view(1);
    tensors.v = input_view(2);
    tensors.positions = input_view(3);
    tensors.slots = input_view(4);
    TensorView outs[4];
    for (int o = 0; o < 4; ++o) {
      mx::array& out = t.out[o];
      void* dst = out.size() ? out.data<void>() : nullptr;
      if (o >= 2 && !t.donated[o] && out.size())
        copy_pool(t.in[o + 3], static_cast<const char*>(t.in[o + 3].data<void>()),
                  static_cast<char*>(dst));
      outs[o] = data_view(out, dst);
    }
    tensors.q_out = outs[0];
    tensors.k_out = outs[1];
    tensors.k_pool = outs[2];
    tensors.v_pool = outs[3];
    CallOptions options;
    options.check_slots = t.check_slots;
    options.format_shape = [](Arg, const TensorView& v) { return tuple_shape(v); };
    rope_pool_fused(tensors, t.params, options);
  }

  RopePoolParams params_;
  std::shared_ptr<const RopeSchedule> schedule_;
  bool check_slots_;
  bool inplace_;
};

mx::array as_array(nb::handle obj, const char* name) {
  mx::array* a = nullptr;
  if (!nb::try_cast(obj, a, /*convert=*/false) || a == nullptr) {
    nb::object type_name = obj.type().attr("__name__");
    throw nb::type_error(("rope_pool_fused: " + std::string(name) +
                          " must be an mlx.core.array, got " +
                          nb::cast<std::string>(nb::str(type_name)))
                             .c_str());
  }
  return *a;
}

using StreamArg = std::optional<std::variant<mx::Stream, mx::Device, mx::Device::DeviceType>>;

nb::tuple rope_pool_fused_mlx(nb::handle q, nb::handle k, nb::handle v, nb::handle positions,
                              nb::handle slots, nb::handle k_pool, nb::handle v_pool,
                              int64_t head_dim, int64_t num_qo_heads, int64_t num_kv_heads,
                              double rope_base, int64_t rotary_dim, bool interleaved,
                              std::optional<std::vector<double>> schedule_inv_freq,
                              double schedule_attention_scaling, bool inplace,
                              bool check_slots, StreamArg stream) {
  const nb::handle objects[7] = {q, k, v, positions, slots, k_pool, v_pool};
  std::vector<mx::array> inputs;
  inputs.reserve(7);
  for (int i = 0; i < 7; ++i) inputs.push_back(as_array(objects[i], kArgNames[i]));

  RopePoolParams params;
  params.head_dim = head_dim;
  params.num_qo_heads = num_qo_heads;
  params.num_kv_heads = num_kv_heads;
  params.rope_base = rope_base;
  params.rotary_dim = rotary_dim;
  params.interleaved = interleaved;
  std::shared_ptr<RopeSchedule> schedule;
  if (schedule_inv_freq) {
    schedule = std::make_shared<RopeSchedule>();
    // The schedule's own rotary_dim (2 per frequency): a mismatch is reported with it.
    schedule->rotary_dim = 2 * int64_t(schedule_inv_freq->size());
    schedule->inv_freq = std::move(*schedule_inv_freq);
    schedule->attention_scaling = schedule_attention_scaling;
    params.schedule = schedule.get();
  }

  // Shapes, dtypes and keywords now, with the messages of SPEC §2 (values: at evaluation).
  RopePoolTensors views;
  views.q = shape_view(inputs[0]);
  views.k = shape_view(inputs[1]);
  views.v = shape_view(inputs[2]);
  views.positions = shape_view(inputs[3]);
  views.slots = shape_view(inputs[4]);
  views.k_pool = shape_view(inputs[5]);
  views.v_pool = shape_view(inputs[6]);
  views.q_out = views.q;
  views.k_out = views.k;
  CallOptions options;
  options.data_readable = false;
  options.check_slots = check_slots;
  options.format_shape = [](Arg, const TensorView& view) { return tuple_shape(view); };
  validate_rope_pool(views, params, options);

  // A GPU stream or device is refused before MLX is asked for it (an MLX without a GPU
  // backend would only say that it has none).
  const bool gpu_asked = stream && std::visit([](const auto& x) {
    using X = std::decay_t<decltype(x)>;
    if constexpr (std::is_same_v<X, mx::Stream>) return x.device.type != mx::Device::DeviceType::cpu;
    else if constexpr (std::is_same_v<X, mx::Device>) return x.type != mx::Device::DeviceType::cpu;
    else return x != mx::Device::DeviceType::cpu;
  }, *stream);
  if (gpu_asked) throw Error(RopePoolFused::gpu_message());
  const mx::Stream s = stream ? std::visit([](auto x) { return mx::to_stream(x); }, *stream)
                              : mx::to_stream(std::monostate{});
  if (s.device.type != mx::Device::DeviceType::cpu)
    throw Error(RopePoolFused::gpu_message());
  if (!schedule) schedule = std::make_shared<RopeSchedule>(make_rope_schedule(params));

  auto outputs = mx::array::make_arrays(
      {inputs[0].shape(), inputs[1].shape(), inputs[5].shape(), inputs[6].shape()},
      {inputs[0].dtype(), inputs[1].dtype(), inputs[5].dtype(), inputs[6].dtype()},
      std::make_shared<RopePoolFused>(s, params, std::move(schedule), check_slots, inplace),
      inputs);
  return nb::make_tuple(outputs[0], outputs[1], outputs[2], outputs[3]);
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
  m.doc() = "ropepool's MLX primitive (nanobind, MLX's domain). Use ropepool.mlx instead.";
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
        "inplace"_a = false, "check_slots"_a = false, "stream"_a = nb::none(),
        "Low-level: the MLX primitive with the keywords normalised by ropepool.mlx "
        "(use ropepool.mlx.rope_pool_fused). Returns (q_rot, k_rot, k_pool, v_pool), lazy.");
}
