// Binding of the CPU backend's thread count.
#include <nanobind/nanobind.h>

#include "bindings.hpp"
#include "ropepool/rope_pool.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace ropepool::python {

void init_threads(nb::module_& m) {
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 0)
          throw nb::value_error(
              ("set_num_threads: n must be >= 0 (0 restores the default), got " +
               std::to_string(n))
                  .c_str());
        // The count is an atomic: no GIL needed. Releasing it here lets a thread that is
        // waiting for the GIL (e.g. coming back from a rope_pool_fused call, which runs
        // without the GIL) take it now instead of after the interpreter's switch interval.
        nb::gil_scoped_release release;
        set_cpu_num_threads(n);
      },
      "n"_a,
      "Sets the number of CPU worker threads of the CPU backend. 0 restores the default "
      "(ROPEPOOL_NUM_THREADS, else all hardware threads).");
  m.def("get_num_threads", &cpu_num_threads,
        "The number of CPU worker threads the CPU backend uses.");
}

}  // namespace ropepool::python
