// One init_* function per binding file; module.cpp calls them all.
#pragma once

#include <nanobind/nanobind.h>

namespace ropepool::python {
void init_rope_pool(nanobind::module_& m);
void init_threads(nanobind::module_& m);
void init_cuda(nanobind::module_& m);
void init_jax(nanobind::module_& m);  // python/src/jax.cpp, in builds with the JAX front end
void init_mla(nanobind::module_& m);
}  // namespace ropepool::python
