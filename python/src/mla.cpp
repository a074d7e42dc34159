// Binding of ropepool::mla_rope_pool_fused (SPEC §8). The Python layer (ropepool/_mla.py)
// allocates q_pe_rot/k_pe_rot and makes the schedule; this file turns arrays into
// TensorViews and hands them to the C++ op, which owns all validation.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"
#include "ropepool/error.hpp"
#include "ropepool/mla.hpp"
#include "ropepool/schedule.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace ropepool::python {
namespace {

constexpr std::array<const char*, 8> kNames = {"q_pe", "k_pe", "kv_c", "positions",
                                               "slots", "kv_cache", "q_out", "k_out"};

// The shared import names rope_pool_fused in its messages; this op's name goes there.
template <class F>
auto renamed(F&& import) {
  try {
    return import();
  } catch (const nb::builtin_exception& e) {
    std::string m = e.what();
    const std::string prefix = "rope_pool_fused: ";
    if (m.rfind(prefix, 0) == 0) m = "mla_" + m;
    throw nb::builtin_exception(e.type(), m.c_str());
  }
}

void mla_rope_pool_fused_into(nb::handle q_pe, nb::handle k_pe, nb::handle kv_c,
                              nb::handle positions, nb::handle slots, nb::handle kv_cache,
                              nb::handle q_out, nb::handle k_out, double rope_base,
                              bool interleaved, std::optional<std::vector<double>> inv_freq,
                              double attention_scaling, bool nhd,
                              std::optional<double> kv_scale, nb::handle kv_scale_tensor,
                              bool check_slots, uintptr_t stream, nb::handle exporter,
                              bool validate_only) {
  const std::array<nb::handle, 8> objects = {q_pe, k_pe, kv_c, positions, slots, kv_cache,
                                             q_out, k_out};
  std::array<nb::ndarray<nb::ro>, 5> inputs;
  for (size_t i = 0; i < 5; ++i)
    inputs[i] = renamed([&] { return import_input(objects[i], kNames[i], exporter); });
  // k_out None: no k_pe_rot (SPEC §8 return_k_rot=False), an empty view for the core.
  const bool k_rot = !k_out.is_none();
  std::array<nb::ndarray<>, 3> outputs;
  for (size_t i = 0; i < (k_rot ? 3 : 2); ++i)
    outputs[i] = renamed([&] { return import_output(objects[5 + i], kNames[5 + i], exporter); });
  nb::ndarray<nb::ro> scale;
  MlaTensors t;
  t.q_pe = view_of(inputs[0]);
  t.k_pe = view_of(inputs[1]);
  t.kv_c = view_of(inputs[2]);
  t.positions = view_of(inputs[3]);
  t.slots = view_of(inputs[4]);
  t.kv_cache = view_of(outputs[0]);
  t.q_out = view_of(outputs[1]);
  if (k_rot) t.k_out = view_of(outputs[2]);
  if (!kv_scale_tensor.is_none()) {
    scale = renamed([&] { return import_input(kv_scale_tensor, "kv_scale", exporter); });
    t.kv_scale = view_of(scale);
  }

  MlaParams params;
  params.rope_base = rope_base;
  params.interleaved = interleaved;
  params.kv_layout = nhd ? MlaCacheLayout::NHD : MlaCacheLayout::Token;
  params.kv_scale = kv_scale;
  RopeSchedule schedule;
  if (inv_freq) {
    schedule.rotary_dim = 2 * int64_t(inv_freq->size());
    schedule.inv_freq = std::move(*inv_freq);
    schedule.attention_scaling = attention_scaling;
    params.schedule = &schedule;
  }
  MlaCallOptions options;
  options.check_slots = check_slots;
  options.stream = reinterpret_cast<void*>(stream);
  options.format_shape = [&objects, &kv_scale_tensor](const char* name, const TensorView& v) {
    for (size_t i = 0; i < kNames.size(); ++i)
      if (std::string(name) == kNames[i]) return shape_of(objects[i], v);
    return shape_of(kv_scale_tensor, v);
  };

  nb::gil_scoped_release release;
  if (validate_only)
    validate_mla_rope_pool(t, params, options);
  else
    mla_rope_pool_fused(t, params, options);
}

}  // namespace

void init_mla(nb::module_& m) {
  m.def("mla_rope_pool_fused_into", &mla_rope_pool_fused_into, "q_pe"_a, "k_pe"_a, "kv_c"_a,
        "positions"_a, "slots"_a, "kv_cache"_a, "q_out"_a, "k_out"_a.none(), nb::kw_only(),
        "rope_base"_a, "interleaved"_a = true, "inv_freq"_a = nb::none(),
        "attention_scaling"_a = 1.0, "nhd"_a = false, "kv_scale"_a = nb::none(),
        "kv_scale_tensor"_a = nb::none(), "check_slots"_a = false, "stream"_a = 0,
        "exporter"_a = nb::none(), "validate_only"_a = false,
        nb::sig("def mla_rope_pool_fused_into(q_pe: object, k_pe: object, kv_c: object, "
                "positions: object, slots: object, kv_cache: object, q_out: object, "
                "k_out: object | None, *, rope_base: float, interleaved: bool = True, "
                "inv_freq: list[float] | None = None, attention_scaling: float = 1.0, "
                "nhd: bool = False, kv_scale: float | None = None, "
                "kv_scale_tensor: object = None, check_slots: bool = False, stream: int = 0, "
                "exporter: object = None, validate_only: bool = False) -> None"),
        R"doc(Low-level entry point of mla_rope_pool_fused (SPEC §8): rotates q_pe and k_pe
into the caller-allocated q_out/k_out (which may be q_pe/k_pe) and writes
concat(kv_c, k_pe_rot) into the kv_cache rows named by slots; k_out None writes no
k_pe_rot (SPEC §8 return_k_rot=False). `inv_freq` and
`attention_scaling` are a precomputed schedule (None: the default schedule of rope_base);
`nhd` selects the paged cache [pages, page_size, L + R]. Most callers want
`ropepool.mla_rope_pool_fused`.)doc");
}

}  // namespace ropepool::python
