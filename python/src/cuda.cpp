// Binding of the CUDA-specific API (a no-op in builds without the CUDA backend).
#include <nanobind/nanobind.h>

#include "bindings.hpp"
#include "ropepool/cuda.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace ropepool::python {

void init_cuda(nb::module_& m) {
  m.def(
      "cuda_check_slot_errors",
      [](int device) {
        nb::gil_scoped_release release;  // it waits for the device
        cuda_check_slot_errors(device);
      },
      "device"_a = -1,
      "Waits for all work on a CUDA device (-1: the current one) and raises RuntimeError if "
      "an earlier rope_pool_fused call without check_slots met an out-of-range slot there "
      "(SPEC §3: that token's pool rows were not written). Reporting clears the record; the "
      "next rope_pool_fused call on that device reports it too, without waiting. Does "
      "nothing in builds without the CUDA backend.");
}

}  // namespace ropepool::python
