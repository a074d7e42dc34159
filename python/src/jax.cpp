// The JAX front end's native half (SPEC §9): XLA FFI handlers of rope_pool_fused and
// mla_rope_pool_fused for the CPU and CUDA platforms, and the shapes-only validation that
// ropepool/jax.py runs while JAX traces a call. Built only when jaxlib's FFI headers (jax.ffi.include_dir()) are
// found at build time (python/CMakeLists.txt); they are header-only, so nothing of jaxlib
// is linked. The handlers live in this module, beside the other bindings, so a JAX call
// shares the CPU thread pool (ropepool.set_num_threads) and the CUDA slot-error record
// (ropepool.cuda_check_slot_errors) with the torch and DLPack paths.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "ropepool/error.hpp"
#include "ropepool/mla.hpp"
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

// Optional numbers travel as arrays of no or one value (unset / set), optional strings as
// "" when unset; an empty inv_freq means "no precomputed schedule": the op makes rope_base's
// default one. The members are the FFI attributes of the same names (ropepool/jax.py).
struct Keywords {
  int64_t head_dim, num_qo_heads, num_kv_heads;
  double rope_base;
  int64_t rotary_dim;
  bool interleaved;
  ffi::Span<const double> inv_freq;
  double attention_scaling;
  ffi::Span<const int64_t> mrope_section;  // SPEC §7, part of a precomputed schedule
  bool mrope_interleaved;
  bool q_norm, k_norm;  // which norm weights follow the seven operands, in this order
  ffi::Span<const double> norm_eps;
  std::string_view norm_style;
  std::string_view kv_layout;  // SPEC §6
  ffi::Span<const double> k_scale, v_scale, q_scale;
  bool check_slots;
};

// mla_rope_pool_fused's keywords (SPEC §8), likewise.
struct MlaKeywords {
  double rope_base;
  bool interleaved;
  ffi::Span<const double> inv_freq;
  double attention_scaling;
  bool nhd;
  ffi::Span<const double> kv_scale;
  bool check_slots;
};

}  // namespace
}  // namespace ropepool::python

// (expanded in namespace xla::ffi)
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ropepool::python::Keywords, StructMember<int64_t>("head_dim"),
    StructMember<int64_t>("num_qo_heads"), StructMember<int64_t>("num_kv_heads"),
    StructMember<double>("rope_base"), StructMember<int64_t>("rotary_dim"),
    StructMember<bool>("interleaved"), StructMember<Span<const double>>("inv_freq"),
    StructMember<double>("attention_scaling"),
    StructMember<Span<const int64_t>>("mrope_section"), StructMember<bool>("mrope_interleaved"),
    StructMember<bool>("q_norm"), StructMember<bool>("k_norm"),
    StructMember<Span<const double>>("norm_eps"), StructMember<std::string_view>("norm_style"),
    StructMember<std::string_view>("kv_layout"), StructMember<Span<const double>>("k_scale"),
    StructMember<Span<const double>>("v_scale"), StructMember<Span<const double>>("q_scale"),
    StructMember<bool>("check_slots"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ropepool::python::MlaKeywords, StructMember<double>("rope_base"),
    StructMember<bool>("interleaved"), StructMember<Span<const double>>("inv_freq"),
    StructMember<double>("attention_scaling"), StructMember<bool>("nhd"),
    StructMember<Span<const double>>("kv_scale"), StructMember<bool>("check_slots"));

namespace ropepool::python {
namespace {

std::optional<double> unset_or(ffi::Span<const double> value) {
  return value.size() ? std::optional<double>(value[0]) : std::nullopt;
}

// A precomputed schedule from its numbers, with the schedule's own rotary_dim (2 entries
// per frequency), not the call's: a mismatch is reported with the schedule's numbers.
// nullptr for none (an empty inv_freq).
const RopeSchedule* precomputed(RopeSchedule& s, ffi::Span<const double> inv_freq,
                                double attention_scaling) {
  if (inv_freq.size() == 0) return nullptr;
  s.rotary_dim = 2 * int64_t(inv_freq.size());
  s.inv_freq.assign(inv_freq.begin(), inv_freq.end());
  s.attention_scaling = attention_scaling;
  return &s;
}

// The op's parameters from the keywords; `schedule` holds the precomputed schedule, if any.
RopePoolParams params_of(const Keywords& kw, RopeSchedule& schedule) {
  RopePoolParams p;
  p.head_dim = kw.head_dim;
  p.num_qo_heads = kw.num_qo_heads;
  p.num_kv_heads = kw.num_kv_heads;
  p.rope_base = kw.rope_base;
  p.rotary_dim = kw.rotary_dim;
  p.interleaved = kw.interleaved;
  p.schedule = precomputed(schedule, kw.inv_freq, kw.attention_scaling);
  schedule.mrope_section.assign(kw.mrope_section.begin(), kw.mrope_section.end());
  schedule.mrope_interleaved = kw.mrope_interleaved;
  p.norm_eps = unset_or(kw.norm_eps);
  if (kw.norm_style.size()) p.norm_style = std::string(kw.norm_style);
  if (kw.kv_layout.size()) p.kv_layout = parse_kv_layout(std::string(kw.kv_layout));
  p.k_scale.value = unset_or(kw.k_scale);
  p.v_scale.value = unset_or(kw.v_scale);
  p.q_scale.value = unset_or(kw.q_scale);
  return p;
}

MlaParams mla_params_of(const MlaKeywords& kw, RopeSchedule& schedule) {
  MlaParams p;
  p.rope_base = kw.rope_base;
  p.interleaved = kw.interleaved;
  p.schedule = precomputed(schedule, kw.inv_freq, kw.attention_scaling);
  p.kv_layout = kw.nhd ? MlaCacheLayout::NHD : MlaCacheLayout::Token;
  p.kv_scale = unset_or(kw.kv_scale);
  return p;
}

// An aliased operand (input_output_aliases): XLA hands the op one buffer, the donated array
// or its copy. Anything else would leave every row the call does not write undefined.
bool aliased(const ffi::AnyBuffer& operand, ffi::Result<ffi::AnyBuffer> result) {
  return operand.element_count() == 0 ||  // (an empty buffer's address means nothing)
         result->untyped_data() == operand.untyped_data();
}

// Runs one call of the op. Only data errors reach this point (the slot range of SPEC §3,
// the CPU angle limit of §1, a CUDA slot error of an earlier call): validation of shapes,
// dtypes and keywords ran when JAX traced the call. They become the error XLA raises
// (JaxRuntimeError), with the hint.
template <class Call>
ffi::Error status(Call&& call) {
  try {
    call();
  } catch (const Error& e) {
    std::string message = e.what();
    if (!e.hint().empty()) message += " (" + e.hint() + ")";
    return ffi::Error::InvalidArgument(message);
  } catch (const std::exception& e) {
    return ffi::Error::Internal(e.what());
  }
  return ffi::Error::Success();
}

// `k_rot` null: the call without a k_rot result (SPEC §4 return_k_rot=False), k_out empty.
ffi::Error run(Device device, void* stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
               ffi::AnyBuffer positions, ffi::AnyBuffer slots, ffi::AnyBuffer k_pool,
               ffi::AnyBuffer v_pool, std::optional<ffi::AnyBuffer> weight0,
               std::optional<ffi::AnyBuffer> weight1, ffi::Result<ffi::AnyBuffer> q_rot,
               ffi::Result<ffi::AnyBuffer>* k_rot, ffi::Result<ffi::AnyBuffer> k_pool_out,
               ffi::Result<ffi::AnyBuffer> v_pool_out, const Keywords& kw) {
  if (!aliased(k_pool, k_pool_out) || !aliased(v_pool, v_pool_out))
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
  if (k_rot) t.k_out = view(**k_rot, device);
  return status([&] {
    RopeSchedule schedule;
    RopePoolParams params = params_of(kw, schedule);
    // SPEC §7's weights, after the seven operands: q's if given, then k's.
    const std::optional<ffi::AnyBuffer> weights[2] = {weight0, weight1};
    size_t next = 0;
    for (auto [given, weight] : {std::pair{kw.q_norm, &params.q_norm_weight},
                                 {kw.k_norm, &params.k_norm_weight}})
      if (given) {
        if (!weights[next]) throw std::logic_error("rope_pool_fused: a norm weight is missing");
        *weight = view(*weights[next++], device);
      }
    CallOptions options;
    options.check_slots = kw.check_slots;
    options.stream = stream;
    rope_pool_fused(t, params, options);
  });
}

// `k_pe_rot` null: the call without a k_pe_rot result (SPEC §8 return_k_rot=False), k_out
// empty.
ffi::Error run_mla(Device device, void* stream, ffi::AnyBuffer q_pe, ffi::AnyBuffer k_pe,
                   ffi::AnyBuffer kv_c, ffi::AnyBuffer positions, ffi::AnyBuffer slots,
                   ffi::AnyBuffer kv_cache, ffi::Result<ffi::AnyBuffer> q_pe_rot,
                   ffi::Result<ffi::AnyBuffer>* k_pe_rot, ffi::Result<ffi::AnyBuffer> kv_cache_out,
                   const MlaKeywords& kw) {
  if (!aliased(kv_cache, kv_cache_out))
    return ffi::Error::Internal(
        "mla_rope_pool_fused: the kv_cache output is not aliased to the kv_cache operand; "
        "call through ropepool.jax.mla_rope_pool_fused");
  MlaTensors t;
  t.q_pe = view(q_pe, device);
  t.k_pe = view(k_pe, device);
  t.kv_c = view(kv_c, device);
  t.positions = view(positions, device);
  t.slots = view(slots, device);
  t.kv_cache = view(*kv_cache_out, device);
  t.q_out = view(*q_pe_rot, device);  // q_pe itself with inplace=True (aliased)
  if (k_pe_rot) t.k_out = view(**k_pe_rot, device);
  return status([&] {
    RopeSchedule schedule;
    MlaCallOptions options;
    options.check_slots = kw.check_slots;
    options.stream = stream;
    mla_rope_pool_fused(t, mla_params_of(kw, schedule), options);
  });
}

constexpr Device kCpu{DeviceType::CPU, 0};

ffi::Error run_cpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer positions,
                   ffi::AnyBuffer slots, ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                   std::optional<ffi::AnyBuffer> weight0, std::optional<ffi::AnyBuffer> weight1,
                   ffi::Result<ffi::AnyBuffer> q_rot, ffi::Result<ffi::AnyBuffer> k_rot,
                   ffi::Result<ffi::AnyBuffer> k_pool_out, ffi::Result<ffi::AnyBuffer> v_pool_out,
                   Keywords kw) {
  return run(kCpu, nullptr, q, k, v, positions, slots, k_pool, v_pool, weight0, weight1, q_rot,
             &k_rot, k_pool_out, v_pool_out, kw);
}

// rope_pool_fused without the k_rot result (return_k_rot=False): its own FFI target.
ffi::Error run_cpu_no_k_rot(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer positions, ffi::AnyBuffer slots, ffi::AnyBuffer k_pool,
                            ffi::AnyBuffer v_pool, std::optional<ffi::AnyBuffer> weight0,
                            std::optional<ffi::AnyBuffer> weight1,
                            ffi::Result<ffi::AnyBuffer> q_rot,
                            ffi::Result<ffi::AnyBuffer> k_pool_out,
                            ffi::Result<ffi::AnyBuffer> v_pool_out, Keywords kw) {
  return run(kCpu, nullptr, q, k, v, positions, slots, k_pool, v_pool, weight0, weight1, q_rot,
             nullptr, k_pool_out, v_pool_out, kw);
}

ffi::Error run_mla_cpu(ffi::AnyBuffer q_pe, ffi::AnyBuffer k_pe, ffi::AnyBuffer kv_c,
                       ffi::AnyBuffer positions, ffi::AnyBuffer slots, ffi::AnyBuffer kv_cache,
                       ffi::Result<ffi::AnyBuffer> q_pe_rot, ffi::Result<ffi::AnyBuffer> k_pe_rot,
                       ffi::Result<ffi::AnyBuffer> kv_cache_out, MlaKeywords kw) {
  return run_mla(kCpu, nullptr, q_pe, k_pe, kv_c, positions, slots, kv_cache, q_pe_rot, &k_pe_rot,
                 kv_cache_out, kw);
}

// mla_rope_pool_fused without the k_pe_rot result (return_k_rot=False): its own FFI target.
ffi::Error run_mla_cpu_no_k_rot(ffi::AnyBuffer q_pe, ffi::AnyBuffer k_pe, ffi::AnyBuffer kv_c,
                                ffi::AnyBuffer positions, ffi::AnyBuffer slots,
                                ffi::AnyBuffer kv_cache, ffi::Result<ffi::AnyBuffer> q_pe_rot,
                                ffi::Result<ffi::AnyBuffer> kv_cache_out, MlaKeywords kw) {
  return run_mla(kCpu, nullptr, q_pe, k_pe, kv_c, positions, slots, kv_cache, q_pe_rot, nullptr,
                 kv_cache_out, kw);
}

#ifdef ROPEPOOL_WITH_CUDA
// The CUDA handlers run the kernel on XLA's stream for the computation (a cudaStream_t,
// taken as void* so this file needs no CUDA header) of the device XLA names.
ffi::Error run_cuda(void* stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                    ffi::AnyBuffer v, ffi::AnyBuffer positions, ffi::AnyBuffer slots,
                    ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                    std::optional<ffi::AnyBuffer> weight0, std::optional<ffi::AnyBuffer> weight1,
                    ffi::Result<ffi::AnyBuffer> q_rot, ffi::Result<ffi::AnyBuffer> k_rot,
                    ffi::Result<ffi::AnyBuffer> k_pool_out,
                    ffi::Result<ffi::AnyBuffer> v_pool_out, Keywords kw) {
  return run({DeviceType::CUDA, device}, stream, q, k, v, positions, slots, k_pool, v_pool,
             weight0, weight1, q_rot, &k_rot, k_pool_out, v_pool_out, kw);
}

ffi::Error run_cuda_no_k_rot(void* stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                             ffi::AnyBuffer v, ffi::AnyBuffer positions, ffi::AnyBuffer slots,
                             ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                             std::optional<ffi::AnyBuffer> weight0,
                             std::optional<ffi::AnyBuffer> weight1,
                             ffi::Result<ffi::AnyBuffer> q_rot,
                             ffi::Result<ffi::AnyBuffer> k_pool_out,
                             ffi::Result<ffi::AnyBuffer> v_pool_out, Keywords kw) {
  return run({DeviceType::CUDA, device}, stream, q, k, v, positions, slots, k_pool, v_pool,
             weight0, weight1, q_rot, nullptr, k_pool_out, v_pool_out, kw);
}

ffi::Error run_mla_cuda(void* stream, int32_t device, ffi::AnyBuffer q_pe, ffi::AnyBuffer k_pe,
                        ffi::AnyBuffer kv_c, ffi::AnyBuffer positions, ffi::AnyBuffer slots,
                        ffi::AnyBuffer kv_cache, ffi::Result<ffi::AnyBuffer> q_pe_rot,
                        ffi::Result<ffi::AnyBuffer> k_pe_rot,
                        ffi::Result<ffi::AnyBuffer> kv_cache_out, MlaKeywords kw) {
  return run_mla({DeviceType::CUDA, device}, stream, q_pe, k_pe, kv_c, positions, slots,
                 kv_cache, q_pe_rot, &k_pe_rot, kv_cache_out, kw);
}

ffi::Error run_mla_cuda_no_k_rot(void* stream, int32_t device, ffi::AnyBuffer q_pe,
                                 ffi::AnyBuffer k_pe, ffi::AnyBuffer kv_c,
                                 ffi::AnyBuffer positions, ffi::AnyBuffer slots,
                                 ffi::AnyBuffer kv_cache, ffi::Result<ffi::AnyBuffer> q_pe_rot,
                                 ffi::Result<ffi::AnyBuffer> kv_cache_out, MlaKeywords kw) {
  return run_mla({DeviceType::CUDA, device}, stream, q_pe, k_pe, kv_c, positions, slots,
                 kv_cache, q_pe_rot, nullptr, kv_cache_out, kw);
}
#endif

// (by reference: a Binding cannot be moved into a parameter)
template <typename Binding>
auto bind_inputs(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()      // k
      .template Arg<ffi::AnyBuffer>()      // v
      .template Arg<ffi::AnyBuffer>()      // positions
      .template Arg<ffi::AnyBuffer>()      // slots
      .template Arg<ffi::AnyBuffer>()      // k_pool
      .template Arg<ffi::AnyBuffer>()      // v_pool
      .template OptionalArg<ffi::AnyBuffer>()  // q_norm_weight or k_norm_weight (SPEC §7)
      .template OptionalArg<ffi::AnyBuffer>();  // k_norm_weight after q_norm_weight
}

template <typename Binding>
auto bind_operands(Binding b) {
  return bind_inputs(std::move(b))
      .template Ret<ffi::AnyBuffer>()      // q_rot
      .template Ret<ffi::AnyBuffer>()      // k_rot
      .template Ret<ffi::AnyBuffer>()      // k_pool (aliased)
      .template Ret<ffi::AnyBuffer>()      // v_pool (aliased)
      .template Attrs<Keywords>();
}

// return_k_rot=False: no k_rot result (nothing allocated or written for it).
template <typename Binding>
auto bind_operands_no_k_rot(Binding b) {
  return bind_inputs(std::move(b))
      .template Ret<ffi::AnyBuffer>()      // q_rot
      .template Ret<ffi::AnyBuffer>()      // k_pool (aliased)
      .template Ret<ffi::AnyBuffer>()      // v_pool (aliased)
      .template Attrs<Keywords>();
}

template <typename Binding>
auto bind_mla_inputs(Binding&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // q_pe
      .template Arg<ffi::AnyBuffer>()      // k_pe
      .template Arg<ffi::AnyBuffer>()      // kv_c
      .template Arg<ffi::AnyBuffer>()      // positions
      .template Arg<ffi::AnyBuffer>()      // slots
      .template Arg<ffi::AnyBuffer>();     // kv_cache
}

template <typename Binding>
auto bind_mla_operands(Binding b) {
  return bind_mla_inputs(std::move(b))
      .template Ret<ffi::AnyBuffer>()      // q_pe_rot
      .template Ret<ffi::AnyBuffer>()      // k_pe_rot
      .template Ret<ffi::AnyBuffer>()      // kv_cache (aliased)
      .template Attrs<MlaKeywords>();
}

// return_k_rot=False: no k_pe_rot result (nothing allocated or written for it).
template <typename Binding>
auto bind_mla_operands_no_k_rot(Binding b) {
  return bind_mla_inputs(std::move(b))
      .template Ret<ffi::AnyBuffer>()      // q_pe_rot
      .template Ret<ffi::AnyBuffer>()      // kv_cache (aliased)
      .template Attrs<MlaKeywords>();
}

XLA_FFI_DEFINE_HANDLER(kRopePoolFusedCpu, run_cpu, bind_operands(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kRopePoolFusedNoKRotCpu, run_cpu_no_k_rot,
                       bind_operands_no_k_rot(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kMlaRopePoolFusedCpu, run_mla_cpu, bind_mla_operands(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kMlaRopePoolFusedNoKRotCpu, run_mla_cpu_no_k_rot,
                       bind_mla_operands_no_k_rot(ffi::Ffi::Bind()));
#ifdef ROPEPOOL_WITH_CUDA
XLA_FFI_DEFINE_HANDLER(kRopePoolFusedCuda, run_cuda,
                       bind_operands(ffi::Ffi::Bind()
                                         .Ctx<ffi::PlatformStream<void*>>()
                                         .Ctx<ffi::DeviceOrdinal>()));
XLA_FFI_DEFINE_HANDLER(kRopePoolFusedNoKRotCuda, run_cuda_no_k_rot,
                       bind_operands_no_k_rot(ffi::Ffi::Bind()
                                                  .Ctx<ffi::PlatformStream<void*>>()
                                                  .Ctx<ffi::DeviceOrdinal>()));
XLA_FFI_DEFINE_HANDLER(kMlaRopePoolFusedCuda, run_mla_cuda,
                       bind_mla_operands(ffi::Ffi::Bind()
                                             .Ctx<ffi::PlatformStream<void*>>()
                                             .Ctx<ffi::DeviceOrdinal>()));
XLA_FFI_DEFINE_HANDLER(kMlaRopePoolFusedNoKRotCuda, run_mla_cuda_no_k_rot,
                       bind_mla_operands_no_k_rot(ffi::Ffi::Bind()
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

// The operands of a call being traced: JAX's abstract values (shapes and dtype names), as
// views without data on the platform's device.
std::vector<TensorView> abstract_views(const std::vector<std::vector<int64_t>>& shapes,
                                       const std::vector<std::string>& dtypes,
                                       const std::string& platform, size_t count) {
  if (shapes.size() != count || dtypes.size() != count)
    throw nb::value_error(("jax_validate: expected the " + std::to_string(count) +
                           " operands' shapes and dtypes").c_str());
  const Device device = platform == "cpu"    ? kCpu
                        : platform == "cuda" ? Device{DeviceType::CUDA, 0}
                                             : Device{DeviceType::Other, 0};
  std::vector<TensorView> views;
  for (size_t i = 0; i < count; ++i)
    views.push_back(row_major(nullptr, dtype_named(dtypes[i]), device,
                              ffi::Span<const int64_t>(shapes[i].data(), shapes[i].size())));
  return views;
}

// The keywords as ropepool/jax.py passes them to validation (Python values: None for an
// unset string, a tuple for an array), read into the handlers' structs. Owns what their
// spans point to.
class PyKeywords {
 public:
  explicit PyKeywords(nb::dict kw) : kw_(std::move(kw)) {}
  template <class T>
  T get(const char* name) const {
    return nb::cast<T>(kw_[name]);
  }
  template <class T>
  ffi::Span<const T> span(const char* name) {
    auto& store = std::get<std::deque<std::vector<T>>>(arrays_);
    return store.emplace_back(nb::cast<std::vector<T>>(kw_[name]));
  }
  std::optional<std::string> text(const char* name) const {
    return nb::cast<std::optional<std::string>>(kw_[name]);
  }
  std::string_view str(const char* name) {
    return strings_.emplace_back(text(name).value_or(""));
  }

 private:
  nb::dict kw_;
  std::tuple<std::deque<std::vector<double>>, std::deque<std::vector<int64_t>>> arrays_;
  std::deque<std::string> strings_;
};

// The validation of rope_pool_fused from the operands' shapes and dtypes alone while JAX
// traces a call: validate_rope_pool with null data pointers and data_readable = false, so
// every check but the data ones (slot range, CPU angle scan) runs here, with the SPEC §2
// messages and shapes printed as JAX prints them.
void validate(const std::vector<std::vector<int64_t>>& shapes,
              const std::vector<std::string>& dtypes, const std::string& platform,
              nb::dict py) {
  PyKeywords r(std::move(py));
  const Keywords kw{r.get<int64_t>("head_dim"),     r.get<int64_t>("num_qo_heads"),
                    r.get<int64_t>("num_kv_heads"), r.get<double>("rope_base"),
                    r.get<int64_t>("rotary_dim"),   r.get<bool>("interleaved"),
                    r.span<double>("inv_freq"),     r.get<double>("attention_scaling"),
                    r.span<int64_t>("mrope_section"), r.get<bool>("mrope_interleaved"),
                    r.get<bool>("q_norm"),          r.get<bool>("k_norm"),
                    r.span<double>("norm_eps"),     r.str("norm_style"),
                    r.str("kv_layout"),             r.span<double>("k_scale"),
                    r.span<double>("v_scale"),      r.span<double>("q_scale"),
                    r.get<bool>("check_slots")};
  const std::vector<TensorView> v =
      abstract_views(shapes, dtypes, platform, 7 + size_t(kw.q_norm) + size_t(kw.k_norm));
  RopePoolTensors t;
  t.q = v[0], t.k = v[1], t.v = v[2], t.positions = v[3], t.slots = v[4];
  t.k_pool = v[5], t.v_pool = v[6];
  // Fresh arrays of q's and k's shape (q_rot float8_e4m3fn with q_out_dtype), or q and k
  // with inplace: with null data there is no overlap either way. No k_rot
  // (return_k_rot=False): k_out empty.
  t.q_out = t.q;
  if (r.get<bool>("q_fp8")) t.q_out.dtype = DType::Float8E4M3FN;
  if (r.get<bool>("k_rot")) t.k_out = t.k;
  RopeSchedule schedule;
  RopePoolParams params = params_of(kw, schedule);
  // The op tells a given norm weight by its data pointer: a placeholder address, never read.
  static const char weight_placeholder = 0;
  size_t next = 7;
  for (auto [given, weight] : {std::pair{kw.q_norm, &params.q_norm_weight},
                               {kw.k_norm, &params.k_norm_weight}})
    if (given) {
      *weight = v[next++];
      weight->data = const_cast<char*>(&weight_placeholder);
    }
  // "" is unset in the attributes; a caller's "" is reported as the value it is.
  if (r.text("norm_style") == "") params.norm_style = "";
  if (r.text("kv_layout") == "") parse_kv_layout("");
  CallOptions options;
  options.check_slots = kw.check_slots;
  options.data_readable = false;
  options.format_shape = [](Arg, const TensorView& view) { return tuple_shape(view); };
  validate_rope_pool(t, params, options);
}

// The same for mla_rope_pool_fused. Its validation reads positions and slots on the CPU
// (the angle scan, the slot range): it is given placeholder values that pass (position 0,
// slot -1: no write) in place of the data, which the handler checks when the call runs.
void validate_mla(const std::vector<std::vector<int64_t>>& shapes,
                  const std::vector<std::string>& dtypes, const std::string& platform,
                  nb::dict py) {
  PyKeywords r(std::move(py));
  const MlaKeywords kw{r.get<double>("rope_base"),   r.get<bool>("interleaved"),
                       r.span<double>("inv_freq"),   r.get<double>("attention_scaling"),
                       r.get<bool>("nhd"),           r.span<double>("kv_scale"),
                       r.get<bool>("check_slots")};
  const std::vector<TensorView> v = abstract_views(shapes, dtypes, platform, 6);
  MlaTensors t;
  t.q_pe = v[0], t.k_pe = v[1], t.kv_c = v[2], t.positions = v[3], t.slots = v[4];
  t.kv_cache = v[5];
  // Fresh arrays of q_pe's and k_pe's shape, or q_pe and k_pe (inplace). No k_pe_rot
  // (return_k_rot=False): k_out empty.
  t.q_out = t.q_pe;
  if (r.get<bool>("k_rot")) t.k_out = t.k_pe;
  // (int64 placeholders: every byte of 0 and -1 reads the same as int32; 1-D views only,
  // any other rank is rejected before the values are read)
  std::vector<int64_t> zeros, minus_ones;
  if (t.positions.ndim == 1) zeros.assign(size_t(std::max<int64_t>(t.positions.shape[0], 0)), 0);
  if (t.slots.ndim == 1) minus_ones.assign(size_t(std::max<int64_t>(t.slots.shape[0], 0)), -1);
  t.positions.data = zeros.data();
  t.slots.data = minus_ones.data();
  RopeSchedule schedule;
  MlaCallOptions options;
  options.data_readable = false;  // the tensors have no memory yet
  options.check_slots = kw.check_slots;
  options.format_shape = [](const char*, const TensorView& view) { return tuple_shape(view); };
  validate_mla_rope_pool(t, mla_params_of(kw, schedule), options);
}

}  // namespace

void init_jax(nb::module_& m) {
  m.attr("jax_front_end") = true;
  m.def(
      "jax_ffi_handlers",
      [] {
        nb::dict cpu, handlers;
        cpu["ropepool_rope_pool_fused"] = nb::capsule(reinterpret_cast<void*>(kRopePoolFusedCpu));
        cpu["ropepool_rope_pool_fused_no_k_rot"] =
            nb::capsule(reinterpret_cast<void*>(kRopePoolFusedNoKRotCpu));
        cpu["ropepool_mla_rope_pool_fused"] =
            nb::capsule(reinterpret_cast<void*>(kMlaRopePoolFusedCpu));
        cpu["ropepool_mla_rope_pool_fused_no_k_rot"] =
            nb::capsule(reinterpret_cast<void*>(kMlaRopePoolFusedNoKRotCpu));
        handlers["cpu"] = cpu;
#ifdef ROPEPOOL_WITH_CUDA
        nb::dict cuda;
        cuda["ropepool_rope_pool_fused"] = nb::capsule(reinterpret_cast<void*>(kRopePoolFusedCuda));
        cuda["ropepool_rope_pool_fused_no_k_rot"] =
            nb::capsule(reinterpret_cast<void*>(kRopePoolFusedNoKRotCuda));
        cuda["ropepool_mla_rope_pool_fused"] =
            nb::capsule(reinterpret_cast<void*>(kMlaRopePoolFusedCuda));
        cuda["ropepool_mla_rope_pool_fused_no_k_rot"] =
            nb::capsule(reinterpret_cast<void*>(kMlaRopePoolFusedNoKRotCuda));
        handlers["CUDA"] = cuda;
#endif
        return handlers;
      },
      "Low-level: {XLA platform name: {FFI target name: PyCapsule of its XLA FFI handler}}, "
      "for jax.ffi.register_ffi_target (ropepool.jax does it).");
  m.def("jax_validate", &validate, "shapes"_a, "dtypes"_a, "platform"_a, "keywords"_a,
        "Low-level: validate_rope_pool from the operands' shapes and dtype names (JAX's "
        "abstract values; q, k, v, positions, slots, k_pool, v_pool, then the norm weights "
        "given), for platform 'cpu' or 'cuda', and the keywords as ropepool.jax passes them "
        "(k_rot False: no k_rot, return_k_rot=False); "
        "raises ValueError with the SPEC §2 messages. Slot values and the CPU angle scan are "
        "checked when the call runs.");
  m.def("jax_validate_mla", &validate_mla, "shapes"_a, "dtypes"_a, "platform"_a, "keywords"_a,
        "Low-level: validate_mla_rope_pool from the six operands' shapes and dtype names, as "
        "jax_validate (k_rot False: no k_pe_rot, return_k_rot=False; SPEC §8).");
}

}  // namespace ropepool::python
