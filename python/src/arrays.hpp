// The array import of the bindings (defined in rope_pool.cpp), shared by every op's binding:
// arrays taken as they are (no conversion, no copy) and turned into TensorViews, and shapes
// printed the way the caller's framework prints them.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string>

#include "ropepool/tensor.hpp"

namespace ropepool::python {

/// An input (read-only arrays accepted) / an output (must be writable); `exporter` as in
/// rope_pool_fused_into. Messages name `name` and rope_pool_fused.
nanobind::ndarray<nanobind::ro> import_input(nanobind::handle obj, const char* name,
                                             nanobind::handle exporter);
nanobind::ndarray<> import_output(nanobind::handle obj, const char* name,
                                  nanobind::handle exporter);
TensorView view_of(const nanobind::ndarray<nanobind::ro>& a);
TensorView view_of(const nanobind::ndarray<>& a);
/// str(obj.shape), or "[2, 8, 128]" for an object without a printable shape.
std::string shape_of(nanobind::handle obj, const TensorView& view);

}  // namespace ropepool::python
