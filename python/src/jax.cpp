// The JAX front end's native half (SPEC §9): XLA FFI handlers of rope_pool_fused for the
// CPU and CUDA platforms, and the shapes-only validation that ropepool/jax.py runs while
// JAX traces a call. Built only when jaxlib's FFI headers (jax.ffi.include_dir()) are
// found at build time (python/CMakeLists.txt); they are header-only, so nothing of jaxlib
// is linked. The handlers live in this module, beside the other bindings, so a JAX call
// shares the CPU thread pool (ropepool.set_num_threads) and the CUDA slot-error record
// (ropepool.cuda_check_slot_errors) with the torch and DLPack paths.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "ropepool/error.hpp"
#include "ropepool/rope_pool.hpp"
#include "ropepool/schedule.hpp"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;
using namespace nb::literals;

namespace ropepool::python {
namespace {

DType from_xla(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::Float32;
    case ffi::DataType::F16: return DType::Float16;
    case ffi::DataType::BF16: return DType::BFloat16;
    case ffi::DataType::S32: return DType::Int32;
    case ffi::DataType::S64: return DType::Int64;
    case ffi::DataType::F64: return DType::Float64;
    case ffi::DataType::S8: return DType::Int8;
    case ffi::DataType::S16: return DType::Int16;
    case ffi::DataType::U8: return DType::UInt8;
    case ffi::DataType::U16: return DType::UInt16;
    case ffi::DataType::U32: return DType::UInt32;
    case ffi::DataType::U64: return DType::UInt64;
    case ffi::DataType::PRED: return DType::Bool;
    case ffi::DataType::C64: return DType::Complex64;
    case ffi::DataType::C128: return DType::Complex128;
    case ffi::DataType::F8E4M3FN: return DType::Float8E4M3FN;
    case ffi::DataType::F8E5M2: return DType::Float8E5M2;
    default: return DType::Other;
  }
}

// XLA's buffers are dense and row-major (ropepool/jax.py asks for the default layouts).
TensorView row_major(void* data, DType dtype, Device device, ffi::Span<const int64_t> dims) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  // A rank above kMaxDims fails the rank checks anyway (8 is neither 1 nor 3).
  t.ndim = dims.size() < size_t(TensorView::kMaxDims) ? int(dims.size()) : TensorView::kMaxDims;
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[i] = dims[size_t(i)];
    t.strides[i] = stride;
    stride *= t.shape[i] > 0 ? t.shape[i] : 1;
  }
  return t;
}

TensorView view(const ffi::AnyBuffer& b, Device device) {
  return row_major(b.untyped_data(), from_xla(b.element_type()), device, b.dimensions());
}

// The keyword scalars of one call, as the FFI attributes carry them (ropepool/jax.py).
// An empty inv_freq means "no precomputed schedule": the op makes rope_base's default one.
struct Keywords {
  int64_t head_dim, num_qo_heads, num_kv_heads;
  double rope_base;
  int64_t rotary_dim;
  bool interleaved;
  ffi::Span<const double> inv_freq;
  double attention_scaling;
  bool check_slots;
};

ffi::Error run(Device device, void* stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
               ffi::AnyBuffer positions, ffi::AnyBuffer slots, ffi::AnyBuffer k_pool,
               ffi::AnyBuffer v_pool, ffi::Result<ffi::AnyBuffer> q_rot,
               ffi::Result<ffi::AnyBuffer> k_rot, ffi::Result<ffi::AnyBuffer> k_pool_out,
               ffi::Result<ffi::AnyBuffer> v_pool_out, const Keywords& kw) {
  // The pools are aliased to the outputs (input_output_aliases): XLA hands the op one
  // buffer, the donated pool or its copy. Anything else would leave every row the call
  // does not write undefined.
  if (k_pool.element_count() > 0 &&  // (an empty buffer's address means nothing)
      (k_pool_out->untyped_data() != k_pool.untyped_data() ||
       v_pool_out->untyped_data() != v_pool.untyped_data()))
    return ffi::Error::Internal(
        "rope_pool_fused: the pool outputs are not aliased to the pool operands; call "
        "through ropepool.jax.rope_pool_fused");
  RopePoolTensors t;
  t.q = view(q, device);
  t.k = view(k, device);
  t.v = view(v, device);
  t.positions = view(positions, device);
  t.slots = view(slots, device);
  t.k_pool = view(*k_pool_out, device);
  t.v_pool = view(*v_pool_out, device);
  t.q_out = view(*q_rot, device);  // q itself with inplace=True (aliased)
  t.k_out = view(*k_rot, device);

  RopePoolParams params;
  params.head_dim = kw.head_dim;
  params.num_qo_heads = kw.num_qo_heads;
  params.num_kv_heads = kw.num_kv_heads;
  params.rope_base = kw.rope_base;
  params.rotary_dim = kw.rotary_dim;
  params.interleaved = kw.interleaved;
  RopeSchedule schedule;
  if (kw.inv_freq.size() > 0) {
    schedule.rotary_dim = 2 * int64_t(kw.inv_freq.size());
    schedule.inv_freq.assign(kw.inv_freq.begin(), kw.inv_freq.end());
    schedule.attention_scaling = kw.attention_scaling;
    params.schedule = &schedule;
  }
  CallOptions options;
  options.check_slots = kw.check_slots;
  options.stream = stream;
  // Only data errors reach this point (the slot range of SPEC §3, the CPU angle limit of
  // §1, a CUDA slot error of an earlier call): validation of shapes, dtypes and keywords ran
  // when JAX traced the call. They become the error XLA raises (JaxRuntimeError).
  try {
    rope_pool_fused(t, params, options);
  } catch (const Error& e) {
    std::string message = e.what();
    if (!e.hint().empty()) message += " (" + e.hint() + ")";
    return ffi::Error::InvalidArgument(message);
  } catch (const std::exception& e) {
    return ffi::Error::Internal(e.what());
  }
  return ffi::Error::Success();
}

ffi::Error run_cpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer positions,
                   ffi::AnyBuffer slots, ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                   ffi::Result<ffi::AnyBuffer> q_rot, ffi::Result<ffi::AnyBuffer> k_rot,
                   ffi::Result<ffi::AnyBuffer> k_pool_out, ffi::Result<ffi::AnyBuffer> v_pool_out,
                   int64_t head_dim, int64_t num_qo_heads, int64_t num_kv_heads, double rope_base,
                   int64_t rotary_dim, bool interleaved, ffi::Span<const double> inv_freq,
                   double attention_scaling, bool check_slots) {
  return run({DeviceType::CPU, 0}, nullptr, q, k, v, positions, slots, k_pool, v_pool, q_rot,
             k_rot, k_pool_out, v_pool_out,
             {head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, interleaved, inv_freq,
              attention_scaling, check_slots});
}

#ifdef ROPEPOOL_WITH_CUDA
// The CUDA handler runs the kernel on XLA's stream for the computation (a cudaStream_t,
// taken as void* so this file needs no CUDA header) of the device XLA names.
ffi::Error run_cuda(void* stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                    ffi::AnyBuffer v, ffi::AnyBuffer positions, ffi::AnyBuffer slots,
                    ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool, ffi::Result<ffi::AnyBuffer> q_rot,
                    ffi::Result<ffi::AnyBuffer> k_rot, ffi::Result<ffi::AnyBuffer> k_pool_out,
                    ffi::Result<ffi::AnyBuffer> v_pool_out, int64_t head_dim,
                    int64_t num_qo_heads, int64_t num_kv_heads, double rope_base,
                    int64_t rotary_dim, bool interleaved, ffi::Span<const double> inv_freq,
                    double attention_scaling, bool check_slots) {
  return run({DeviceType::CUDA, device}, stream, q, k, v, positions, slots, k_pool, v_pool,
             q_rot, k_rot, k_pool_out, v_pool_out,
             {head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, interleaved, inv_freq,
              attention_scaling, check_slots});
}
#endif

template <typename Binding>
auto bind_operands(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()      // k
      .template Arg<ffi::AnyBuffer>()      // v
      .template Arg<ffi::AnyBuffer>()      // positions
      .template Arg<ffi::AnyBuffer>()      // slots
      .template Arg<ffi::AnyBuffer>()      // k_pool
      .template Arg<ffi::AnyBuffer>()      // v_pool
      .template Ret<ffi::AnyBuffer>()      // q_rot
      .template Ret<ffi::AnyBuffer>()      // k_rot
      .template Ret<ffi::AnyBuffer>()      // k_pool (aliased)
      .template Ret<ffi::AnyBuffer>()      // v_pool (aliased)
      .template Attr<int64_t>("head_dim")
      .template Attr<int64_t>("num_qo_heads")
      .template Attr<int64_t>("num_kv_heads")
      .template Attr<double>("rope_base")
      .template Attr<int64_t>("rotary_dim")
      .template Attr<bool>("interleaved")
      .template Attr<ffi::Span<const double>>("inv_freq")
      .template Attr<double>("attention_scaling")
      .template Attr<bool>("check_slots");
}

XLA_FFI_DEFINE_HANDLER(kRopePoolFusedCpu, run_cpu, bind_operands(ffi::Ffi::Bind()));
#ifdef ROPEPOOL_WITH_CUDA
XLA_FFI_DEFINE_HANDLER(kRopePoolFusedCuda, run_cuda,
                       bind_operands(ffi::Ffi::Bind()
                                         .Ctx<ffi::PlatformStream<void*>>()
                                         .Ctx<ffi::DeviceOrdinal>()));
#endif

// "(2, 8, 128)", "(5,)": a shape as JAX prints it (str of a tuple).
std::string tuple_shape(const TensorView& t) {
  std::string s = "(";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + (t.ndim == 1 ? ",)" : ")");
}

DType dtype_named(const std::string& name) {
  for (int d = 0; d < int(DType::Other); ++d)
    if (name == dtype_name(DType(d))) return DType(d);
  return DType::Other;
}

// The validation of rope_pool_fused from shapes and dtype names alone (JAX's abstract
// values while a call is traced): validate_rope_pool with null data pointers and
// data_readable = false, so every check but the data ones (slot range, CPU angle scan)
// runs here, with the SPEC §2 messages and shapes printed as JAX prints them.
void validate_shapes(const std::vector<std::vector<int64_t>>& shapes,
                     const std::vector<std::string>& dtypes, const std::string& platform,
                     bool inplace, int64_t head_dim, int64_t num_qo_heads, int64_t num_kv_heads,
                     double rope_base, int64_t rotary_dim, bool interleaved,
                     std::optional<std::vector<double>> schedule_inv_freq,
                     double schedule_attention_scaling, bool check_slots) {
  if (shapes.size() != 7 || dtypes.size() != 7)
    throw nb::value_error("validate_shapes: expected the 7 operands' shapes and dtypes");
  const Device device = platform == "cpu"    ? Device{DeviceType::CPU, 0}
                        : platform == "cuda" ? Device{DeviceType::CUDA, 0}
                                             : Device{DeviceType::Other, 0};
  std::array<TensorView, 7> v;
  for (size_t i = 0; i < 7; ++i)
    v[i] = row_major(nullptr, dtype_named(dtypes[i]), device,
                     ffi::Span<const int64_t>(shapes[i].data(), shapes[i].size()));
  RopePoolTensors t;
  t.q = v[0], t.k = v[1], t.v = v[2], t.positions = v[3], t.slots = v[4];
  t.k_pool = v[5], t.v_pool = v[6];
  t.q_out = t.q;  // fresh arrays of q's and k's shape and dtype, or q and k with inplace
  t.k_out = t.k;
  (void)inplace;  // null data: no overlap either way
  RopePoolParams params;
  params.head_dim = head_dim;
  params.num_qo_heads = num_qo_heads;
  params.num_kv_heads = num_kv_heads;
  params.rope_base = rope_base;
  params.rotary_dim = rotary_dim;
  params.interleaved = interleaved;
  RopeSchedule schedule;
  if (schedule_inv_freq) {
    schedule.rotary_dim = 2 * int64_t(schedule_inv_freq->size());
    schedule.inv_freq = std::move(*schedule_inv_freq);
    schedule.attention_scaling = schedule_attention_scaling;
    params.schedule = &schedule;
  }
  CallOptions options;
  options.check_slots = check_slots;
  options.data_readable = false;
  options.format_shape = [](Arg, const TensorView& view) { return tuple_shape(view); };
  validate_rope_pool(t, params, options);
}

}  // namespace

void init_jax(nb::module_& m) {
  m.attr("jax_front_end") = true;
  m.def(
      "jax_ffi_handlers",
      [] {
        nb::dict handlers;
        handlers["cpu"] = nb::capsule(reinterpret_cast<void*>(kRopePoolFusedCpu));
#ifdef ROPEPOOL_WITH_CUDA
        handlers["CUDA"] = nb::capsule(reinterpret_cast<void*>(kRopePoolFusedCuda));
#endif
        return handlers;
      },
      "Low-level: {XLA platform name: PyCapsule of the XLA FFI handler of rope_pool_fused}, "
      "for jax.ffi.register_ffi_target (ropepool.jax does it).");
  m.def("jax_validate", &validate_shapes, "shapes"_a, "dtypes"_a, "platform"_a, nb::kw_only(),
        "inplace"_a, "head_dim"_a, "num_qo_heads"_a, "num_kv_heads"_a, "rope_base"_a,
        "rotary_dim"_a, "interleaved"_a, "schedule_inv_freq"_a.none(),
        "schedule_attention_scaling"_a, "check_slots"_a,
        "Low-level: validate_rope_pool from the operands' shapes and dtype names (JAX's "
        "abstract values), for platform 'cpu' or 'cuda'; raises ValueError with the SPEC §2 "
        "messages. Slot values and the CPU angle scan are checked when the call runs.");
}

}  // namespace ropepool::python
