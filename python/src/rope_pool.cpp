// Binding of ropepool::rope_pool_fused. The Python layer (ropepool/_op.py) allocates
// q_rot/k_rot with the caller's framework (or passes the caller's q_out=/k_out= as they
// are) and calls `rope_pool_fused_into` here; this file only turns arrays into TensorViews
// and hands them to the C++ op, which owns all validation (SPEC §2), so every message comes
// from one place.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/tuple.h>

#include <array>
#include <exception>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"
#include "ropepool/error.hpp"
#include "ropepool/rope_pool.hpp"
#include "ropepool/rope_scaling.hpp"
#include "ropepool/schedule.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace ropepool::python {
namespace {

// Arrays are imported with nanobind's default (writable) ndarray, or read-only for the
// inputs so that read-only NumPy arrays work as q/k/v/positions/slots. No dtype, shape or
// device constraint: a constraint would make nanobind reject (or, with conversion, copy)
// the argument before the C++ validation can say what is wrong in the SPEC's words.
using ReadArray = nb::ndarray<nb::ro>;
using WriteArray = nb::ndarray<>;

constexpr std::array<const char*, 12> kArgNames = {
    "q",     "k",     "v",       "positions", "slots",   "k_pool",
    "v_pool", "q_out", "k_out", "k_scale",   "v_scale", "q_scale"};

// Every DLPack dtype gets its name, so that a message says "got float64", not "other".
DType to_dtype(nb::dlpack::dtype dt) {
  if (dt.lanes != 1) return DType::Other;
  switch (static_cast<nb::dlpack::dtype_code>(dt.code)) {
    case nb::dlpack::dtype_code::Float:
      return dt.bits == 32 ? DType::Float32 : dt.bits == 16 ? DType::Float16
                           : dt.bits == 64 ? DType::Float64 : DType::Other;
    case nb::dlpack::dtype_code::Bfloat:
      return dt.bits == 16 ? DType::BFloat16 : DType::Other;
    case nb::dlpack::dtype_code::Int:
      return dt.bits == 32 ? DType::Int32 : dt.bits == 64 ? DType::Int64
             : dt.bits == 16 ? DType::Int16 : dt.bits == 8 ? DType::Int8 : DType::Other;
    case nb::dlpack::dtype_code::UInt:
      return dt.bits == 8 ? DType::UInt8 : dt.bits == 16 ? DType::UInt16
             : dt.bits == 32 ? DType::UInt32 : dt.bits == 64 ? DType::UInt64 : DType::Other;
    case nb::dlpack::dtype_code::Bool:
      return DType::Bool;
    case nb::dlpack::dtype_code::Complex:
      return dt.bits == 64 ? DType::Complex64 : dt.bits == 128 ? DType::Complex128 : DType::Other;
    default:
      // DLPack 1.1 codes (not in nanobind's enum): kDLFloat8_e4m3fn = 10, kDLFloat8_e5m2 = 12
      return dt.code == 10 ? DType::Float8E4M3FN : dt.code == 12 ? DType::Float8E5M2 : DType::Other;
  }
}

Device to_device(int device_type, int device_id) {
  if (device_type == nb::device::cpu::value) return {DeviceType::CPU, 0};
  if (device_type == nb::device::cuda::value) return {DeviceType::CUDA, device_id};
  // Pinned host memory (kDLCUDAHost) is CPU-addressable; managed memory and every other
  // device type is left to validation to reject.
  if (device_type == nb::device::cuda_host::value) return {DeviceType::CPU, 0};
  return {DeviceType::Other, device_id};
}

template <typename Array>
TensorView to_view(const Array& a) {
  TensorView t;
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.dtype = to_dtype(a.dtype());
  t.device = to_device(a.device_type(), a.device_id());
  // A rank above kMaxDims is wrong for every argument anyway; clamping keeps the rank
  // check failing (8 is neither 1 nor 3) without reading past the view's arrays.
  t.ndim = static_cast<int>(a.ndim()) < TensorView::kMaxDims ? static_cast<int>(a.ndim())
                                                              : TensorView::kMaxDims;
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = static_cast<int64_t>(a.shape(i));
    t.strides[i] = a.stride(i);  // nanobind strides are in elements, like TensorView's
  }
  // An empty array addresses no memory, so its strides mean nothing, and producers say so:
  // torch exports [0, H, D] with strides (0, 0, 0). Row-major strides keep T = 0 calls
  // (SPEC §1) from failing the layout checks.
  if (t.numel() == 0) {
    int64_t stride = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      t.strides[i] = stride;
      stride *= t.shape[i] > 0 ? t.shape[i] : 1;
    }
  }
  return t;
}

std::string py_type_name(nb::handle obj) {
  nb::object name = obj.type().attr("__name__");
  return PyUnicode_Check(name.ptr()) ? nb::borrow<nb::str>(name).c_str() : "object";
}

// Imports `obj` without any conversion or copy (convert=false): a converted pool would be
// a temporary copy and the writes would be lost. `exporter`, when given, turns obj into a
// DLPack capsule (torch passes torch._C._to_dlpack: 10x cheaper than Tensor.__dlpack__,
// which nanobind would call, and that adds up over nine tensors per call).
template <typename Array>
Array import_array(nb::handle obj, const char* name, bool writable, nb::handle exporter) {
  Array a;
  if (!exporter.is_none()) {
    nb::object capsule;
    try {
      capsule = exporter(obj);
    } catch (const nb::python_error&) {
      capsule.reset();  // not exportable: fall through to the plain import and its message
    }
    if (capsule.is_valid() && nb::try_cast(capsule, a, /*convert=*/false)) return a;
  }
  if (nb::try_cast(obj, a, /*convert=*/false)) return a;
  ReadArray probe;
  if (writable && nb::try_cast(obj, probe, false))
    throw nb::type_error(("rope_pool_fused: " + std::string(name) +
                          " is read-only; the op writes into it, pass a writable array")
                             .c_str());
  // Say why an array-like object could not be imported, rather than "must be an array".
  if (nb::hasattr(obj, "shape") && nb::hasattr(obj, "dtype")) {
    // str(x) (nb::str(h) would only re-label h, not convert it)
    auto text = [](nb::handle h) -> std::string {
      nb::object s = nb::steal(PyObject_Str(h.ptr()));
      if (!s.is_valid()) {
        PyErr_Clear();
        return {};
      }
      return nb::borrow<nb::str>(s).c_str();
    };
    std::string device, dtype;
    try {
      nb::object d = obj.attr("device");
      device = text(nb::hasattr(d, "type") ? d.attr("type") : d);
    } catch (const std::exception&) {
    }
    try {
      dtype = text(obj.attr("dtype"));
    } catch (const std::exception&) {
    }
    if (device == "meta")
      throw nb::value_error(("rope_pool_fused: " + std::string(name) +
                             " is on the meta device (no memory); meta tensors are unsupported "
                             "outside torch.compile tracing, which uses the op's fake "
                             "implementation").c_str());
    throw nb::value_error(("rope_pool_fused: " + std::string(name) + " (" + py_type_name(obj) +
                           " of dtype " + dtype +
                           ") cannot be exported through DLPack or the buffer protocol; "
                           "expected float32, float16 or bfloat16 (q/k/v/pools) or int32/int64 "
                           "(positions/slots)" +
                           (dtype.find("bfloat16") != std::string::npos
                                ? "; NumPy cannot export bfloat16 (ml_dtypes): pass a torch "
                                  "tensor, e.g. torch.from_numpy(x.view(numpy.uint16))"
                                  ".view(torch.bfloat16)"
                            : dtype.find("float8") != std::string::npos
                                ? "; NumPy cannot export float8 (ml_dtypes) through DLPack: pass "
                                  "torch tensors, e.g. torch.from_numpy(x.view(numpy.uint8))"
                                  ".view(torch.float8_e4m3fn)"
                                : ""))
                              .c_str());
  }
  throw nb::type_error(("rope_pool_fused: " + std::string(name) +
                        " must be an array (torch.Tensor, numpy.ndarray or another DLPack "
                        "producer), got " + py_type_name(obj))
                           .c_str());
}

// Prints a shape from the caller's own object (`str(x.shape)`: "torch.Size([2, 8, 128])"
// for torch, "(2, 8, 128)" for NumPy), so messages read like the caller's framework.
std::string framework_shape(nb::handle obj, const TensorView& view) {
  nb::gil_scoped_acquire gil;
  try {
    nb::object shape = obj.attr("shape");
    // str(x.shape) (nb::str(obj) would only re-label a non-str object, not convert it)
    nb::str text = nb::steal<nb::str>(PyObject_Str(shape.ptr()));
    if (!text.is_valid()) throw nb::python_error();
    return text.c_str();
  } catch (const std::exception&) {
    // An object without a printable `.shape` (a raw DLPack capsule): "[2, 8, 128]".
    return format_shape(view);
  }
}

void rope_pool_fused_into(nb::handle q, nb::handle k, nb::handle v, nb::handle positions,
                          nb::handle slots, nb::handle k_pool, nb::handle v_pool,
                          nb::handle q_out, nb::handle k_out, int64_t head_dim,
                          int64_t num_qo_heads, int64_t num_kv_heads, double rope_base,
                          bool check_slots, uintptr_t stream, nb::handle exporter,
                          int64_t rotary_dim, bool interleaved,
                          std::optional<std::vector<double>> schedule_inv_freq,
                          double schedule_attention_scaling, bool validate_only,
                          std::optional<std::string> kv_layout, std::optional<double> k_scale,
                          nb::handle k_scale_tensor, std::optional<double> v_scale,
                          nb::handle v_scale_tensor, std::optional<double> q_scale,
                          nb::handle q_scale_tensor, nb::handle q_norm_weight,
                          nb::handle k_norm_weight, std::optional<double> norm_eps,
                          std::optional<std::string> norm_style,
                          std::optional<std::vector<int64_t>> mrope_section,
                          bool mrope_interleaved) {
  const std::array<nb::handle, 12> objects = {q,     k,     v,              positions,
                                              slots, k_pool, v_pool,        q_out,
                                              k_out, k_scale_tensor, v_scale_tensor, q_scale_tensor};
  // The imported arrays hold references to the producers' buffers for the whole call.
  const std::array<ReadArray, 5> inputs = {
      import_array<ReadArray>(q, kArgNames[0], false, exporter),
      import_array<ReadArray>(k, kArgNames[1], false, exporter),
      import_array<ReadArray>(v, kArgNames[2], false, exporter),
      import_array<ReadArray>(positions, kArgNames[3], false, exporter),
      import_array<ReadArray>(slots, kArgNames[4], false, exporter)};
  // k_out None: no k_rot (SPEC §4 return_k_rot=False), an empty view for the core.
  const std::array<WriteArray, 4> outputs = {
      import_array<WriteArray>(k_pool, kArgNames[5], true, exporter),
      import_array<WriteArray>(v_pool, kArgNames[6], true, exporter),
      import_array<WriteArray>(q_out, kArgNames[7], true, exporter),
      k_out.is_none() ? WriteArray() : import_array<WriteArray>(k_out, kArgNames[8], true, exporter)};

  // SPEC §6 scales: a number, or a one-element tensor read when the kernel runs.
  std::array<ReadArray, 3> scale_arrays;
  const std::array<nb::handle, 3> scale_objects = {k_scale_tensor, v_scale_tensor, q_scale_tensor};
  for (size_t i = 0; i < 3; ++i)
    if (!scale_objects[i].is_none())
      scale_arrays[i] = import_array<ReadArray>(scale_objects[i], kArgNames[9 + i], false, exporter);

  RopePoolTensors tensors;
  tensors.q = to_view(inputs[0]);
  tensors.k = to_view(inputs[1]);
  tensors.v = to_view(inputs[2]);
  tensors.positions = to_view(inputs[3]);
  tensors.slots = to_view(inputs[4]);
  tensors.k_pool = to_view(outputs[0]);
  tensors.v_pool = to_view(outputs[1]);
  tensors.q_out = to_view(outputs[2]);
  if (!k_out.is_none()) tensors.k_out = to_view(outputs[3]);

  RopePoolParams params;
  params.head_dim = head_dim;
  params.num_qo_heads = num_qo_heads;
  params.num_kv_heads = num_kv_heads;
  params.rope_base = rope_base;
  params.rotary_dim = rotary_dim;
  params.interleaved = interleaved;
  if (kv_layout) params.kv_layout = parse_kv_layout(*kv_layout);
  {
    QuantScale* scales[3] = {&params.k_scale, &params.v_scale, &params.q_scale};
    const std::optional<double> values[3] = {k_scale, v_scale, q_scale};
    for (size_t i = 0; i < 3; ++i) {
      scales[i]->value = values[i];
      if (!scale_objects[i].is_none()) scales[i]->tensor = to_view(scale_arrays[i]);
    }
  }
  RopeSchedule schedule;
  if (schedule_inv_freq) {
    // The schedule's own rotary_dim (2 entries per frequency), not the call's: a mismatch
    // must be reported with the schedule's numbers.
    schedule.rotary_dim = 2 * int64_t(schedule_inv_freq->size());
    schedule.inv_freq = std::move(*schedule_inv_freq);
    schedule.attention_scaling = schedule_attention_scaling;
    if (mrope_section) schedule.mrope_section = *mrope_section;
    schedule.mrope_interleaved = mrope_interleaved;
    params.schedule = &schedule;
  } else {
    if (mrope_section) params.rope_scaling.mrope_section = *mrope_section;
    params.rope_scaling.mrope_interleaved = mrope_interleaved;
  }
  // SPEC §7: the norm weights are inputs like q (read-only, never copied).
  std::array<ReadArray, 2> norm_weights;
  if (!q_norm_weight.is_none()) {
    norm_weights[0] = import_array<ReadArray>(q_norm_weight, "q_norm_weight", false, exporter);
    params.q_norm_weight = to_view(norm_weights[0]);
  }
  if (!k_norm_weight.is_none()) {
    norm_weights[1] = import_array<ReadArray>(k_norm_weight, "k_norm_weight", false, exporter);
    params.k_norm_weight = to_view(norm_weights[1]);
  }
  params.norm_eps = norm_eps;
  params.norm_style = std::move(norm_style);

  CallOptions options;
  options.check_slots = check_slots;
  options.stream = reinterpret_cast<void*>(stream);
  options.format_shape = [&objects](Arg arg, const TensorView& view) {
    return framework_shape(objects[static_cast<size_t>(arg)], view);
  };

  // The CPU backend runs its own worker threads; other Python threads may run meanwhile.
  nb::gil_scoped_release release;
  if (validate_only)
    validate_rope_pool(tensors, params, options);
  else
    rope_pool_fused(tensors, params, options);
}

// A rope_scaling entry as the Python layer normalises it: (key, kind, bool, int, float, str,
// list); kind is ScalingValue::Kind (the Python layer has told bools from ints and numbers
// from strings, which only it can).
using Entry = std::tuple<std::string, int, bool, int64_t, double, std::string, std::vector<double>>;

// The schedule of SPEC §4 (parse_rope_scaling + make_rope_schedule), for the Python layer:
// it is computed once per call from the keyword arguments (or once at model load by
// ropepool.rope_schedule) and handed to the op as plain numbers, which the torch op schema
// can carry.
nb::tuple rope_schedule(int64_t head_dim, double rope_base, int64_t rotary_dim,
                        std::optional<std::vector<Entry>> rope_scaling,
                        std::optional<int64_t> max_position_embeddings,
                        std::optional<int64_t> original_max_position_embeddings,
                        std::optional<int64_t> seq_len, nb::handle inv_freq,
                        std::optional<double> attention_scaling,
                        std::optional<std::vector<int64_t>> mrope_section,
                        std::optional<bool> mrope_interleaved) {
  RopePoolParams params;
  params.head_dim = head_dim;
  params.rope_base = rope_base;
  params.rotary_dim = rotary_dim;
  ScalingEntries entries;
  if (rope_scaling)
    for (auto& [key, kind, b, i, f, text, list] : *rope_scaling) {
      ScalingValue v;
      v.kind = static_cast<ScalingValue::Kind>(kind);
      v.boolean = b, v.integer = i, v.number = f, v.text = text, v.list = list;
      entries.emplace_back(key, std::move(v));
    }
  RopeScalingContext context;
  context.rope_base = rope_base;
  context.max_position_embeddings = max_position_embeddings;
  context.original_max_position_embeddings = original_max_position_embeddings;
  context.seq_len = seq_len;
  context.mrope_section = std::move(mrope_section);
  context.mrope_interleaved = mrope_interleaved;
  const bool has_table = !inv_freq.is_none();
  if (has_table && !rope_scaling) {
    // Next to an inv_freq table these lengths are unused: make_rope_schedule says so.
    params.rope_scaling.max_position_embeddings = max_position_embeddings;
    params.rope_scaling.original_max_position_embeddings = original_max_position_embeddings;
    params.rope_scaling.seq_len = seq_len;
    if (context.mrope_section) params.rope_scaling.mrope_section = *context.mrope_section;
    params.rope_scaling.mrope_interleaved = context.mrope_interleaved.value_or(false);
  } else {
    params.rope_scaling = parse_rope_scaling(entries, context);
  }
  params.attention_scaling = attention_scaling;
  ReadArray table;
  if (has_table) {
    table = import_array<ReadArray>(inv_freq, "inv_freq", false, nb::none());
    params.inv_freq = to_view(table);
  }
  const RopeSchedule schedule = make_rope_schedule(params);
  nb::list freqs;
  for (double f : schedule.inv_freq) freqs.append(f);
  nb::object section = nb::none();
  if (!schedule.mrope_section.empty()) {
    nb::list l;
    for (int64_t x : schedule.mrope_section) l.append(x);
    section = l;
  }
  return nb::make_tuple(schedule.rotary_dim, freqs, schedule.attention_scaling, schedule.rope_base,
                        section, schedule.mrope_interleaved);
}

}  // namespace

// The shared array import (arrays.hpp), for the other ops' bindings.
nb::ndarray<nb::ro> import_input(nb::handle obj, const char* name, nb::handle exporter) {
  return import_array<ReadArray>(obj, name, false, exporter);
}
nb::ndarray<> import_output(nb::handle obj, const char* name, nb::handle exporter) {
  return import_array<WriteArray>(obj, name, true, exporter);
}
TensorView view_of(const nb::ndarray<nb::ro>& a) { return to_view(a); }
TensorView view_of(const nb::ndarray<>& a) { return to_view(a); }
std::string shape_of(nb::handle obj, const TensorView& view) { return framework_shape(obj, view); }

void init_rope_pool(nb::module_& m) {
  m.def("rope_schedule", &rope_schedule, nb::kw_only(), "head_dim"_a, "rope_base"_a,
        "rotary_dim"_a = 0, "rope_scaling"_a = nb::none(),
        "max_position_embeddings"_a = nb::none(),
        "original_max_position_embeddings"_a = nb::none(), "seq_len"_a = nb::none(),
        "inv_freq"_a = nb::none(), "attention_scaling"_a = nb::none(),
        "mrope_section"_a = nb::none(), "mrope_interleaved"_a = nb::none(),
        "Low-level: (rotary_dim, inv_freq as a list of floats, attention_scaling, rope_base, "
        "mrope_section or None, mrope_interleaved) "
        "of a schedule (C++ parse_rope_scaling + make_rope_schedule); rope_scaling is a list "
        "of normalised entries. Use ropepool.rope_schedule instead.");

  m.def("rope_pool_fused_into", &rope_pool_fused_into, "q"_a, "k"_a, "v"_a, "positions"_a,
        "slots"_a, "k_pool"_a, "v_pool"_a, "q_out"_a, "k_out"_a.none(), nb::kw_only(),
        "head_dim"_a, "num_qo_heads"_a, "num_kv_heads"_a, "rope_base"_a,
        "check_slots"_a = false, "stream"_a = 0, "exporter"_a = nb::none(),
        "rotary_dim"_a = 0, "interleaved"_a = false, "schedule_inv_freq"_a = nb::none(),
        "schedule_attention_scaling"_a = 1.0, "validate_only"_a = false,
        "kv_layout"_a = nb::none(), "k_scale"_a = nb::none(), "k_scale_tensor"_a = nb::none(),
        "v_scale"_a = nb::none(), "v_scale_tensor"_a = nb::none(), "q_scale"_a = nb::none(),
        "q_scale_tensor"_a = nb::none(),
        "q_norm_weight"_a = nb::none(), "k_norm_weight"_a = nb::none(),
        "norm_eps"_a = nb::none(), "norm_style"_a = nb::none(), "mrope_section"_a = nb::none(),
        "mrope_interleaved"_a = false,
        nb::sig("def rope_pool_fused_into(q: object, k: object, v: object, "
                "positions: object, slots: object, k_pool: object, v_pool: object, "
                "q_out: object, k_out: object | None, *, head_dim: int, num_qo_heads: int, "
                "num_kv_heads: int, rope_base: float, check_slots: bool = False, "
                "stream: int = 0, exporter: object = None, rotary_dim: int = 0, "
                "interleaved: bool = False, schedule_inv_freq: list[float] | None = None, "
                "schedule_attention_scaling: float = 1.0, validate_only: bool = False, "
                "kv_layout: str | None = None, k_scale: float | None = None, "
                "k_scale_tensor: object = None, v_scale: float | None = None, "
                "v_scale_tensor: object = None, q_scale: float | None = None, "
                "q_scale_tensor: object = None, "
                "q_norm_weight: object = None, k_norm_weight: object = None, "
                "norm_eps: float | None = None, norm_style: str | None = None, "
                "mrope_section: list[int] | None = None, mrope_interleaved: bool = False) -> None"),
        R"doc(Low-level entry point: rotates q and k into the caller-allocated q_out/k_out
and writes rotated k and v into k_pool/v_pool (SPEC §1), all in place.

Every array is taken as is through DLPack or the buffer protocol (no conversion, no copy).
`stream` is a cudaStream_t as an integer, used for CUDA arrays (0 = legacy default
stream); the caller must have made the arrays' device current. `exporter(x)`, if given,
returns a DLPack capsule for x (a faster route than x.__dlpack__()); messages still print
shapes from the objects themselves. `schedule_inv_freq`/`schedule_attention_scaling`, when
given, are a precomputed schedule (from rope_schedule) for rotary_dim; q_out/k_out may be
q/k themselves (in-place rotation); q_out may be float8_e4m3fn (fp8 q_rot, SPEC §6);
k_out None writes no k_rot (SPEC §4 return_k_rot=False).
`kv_layout` ("NHD" / "HND") takes 4-D paged pools; `k_scale`/`v_scale`/`q_scale` are numbers
and `*_scale_tensor` one-element float32 arrays read when the kernel runs (one of the two
per scale). `mrope_section`/`mrope_interleaved` belong to the schedule (SPEC §7), and
`q_norm_weight`, `k_norm_weight`, `norm_eps`, `norm_style` are SPEC §7's norm keywords.
With `validate_only`, only the validation runs
(validate_rope_pool): the same errors, nothing written. Raises ValueError with the
SPEC §2 messages (extra help in the exception's notes) and RuntimeError for backend
failures. Most callers want `ropepool.rope_pool_fused`.)doc");
}

}  // namespace ropepool::python
