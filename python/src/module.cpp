// The extension module ropepool._ropepool: error translation and the init_* of each binding.
#include <nanobind/nanobind.h>

#include <exception>
#include <string>

#include "bindings.hpp"
#include "ropepool/error.hpp"
#include "ropepool/version.hpp"

namespace nb = nanobind;

namespace {

// Raises `type(message)` with `hint` attached as an exception note (PEP 678). The hint stays
// out of the message so that code matching the exact SPEC §2 text keeps working.
void raise_with_note(PyObject* type, const char* message, const std::string& hint) {
  PyObject* exc = PyObject_CallFunction(type, "s", message);
  if (!exc) return;  // the constructor failed: its error is already set
  if (!hint.empty()) {
    PyObject* r = PyObject_CallMethod(exc, "add_note", "s", hint.c_str());
    if (r) {
      Py_DECREF(r);
    } else {
      PyErr_Clear();  // Python < 3.11 has no add_note; `__notes__` is read the same way
      PyObject* notes = Py_BuildValue("[s]", hint.c_str());
      if (notes) {
        PyObject_SetAttrString(exc, "__notes__", notes);
        Py_DECREF(notes);
      }
      PyErr_Clear();
    }
  }
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
}

}  // namespace

NB_MODULE(_ropepool, m) {
  m.doc() = "C++ core of ropepool (nanobind). Use the `ropepool` package instead.";
  m.attr("__version__") = ropepool::kVersion;
#ifdef ROPEPOOL_WITH_CUDA
  m.attr("cuda_backend") = true;
#else
  m.attr("cuda_backend") = false;
#endif

  // Registered after nanobind's defaults, so tried first: ropepool::Error derives from
  // std::invalid_argument, which nanobind would otherwise map to a ValueError without hint.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const ropepool::Error& e) {
      raise_with_note(PyExc_ValueError, e.what(), e.hint());
    } catch (const ropepool::BackendError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  ropepool::python::init_rope_pool(m);
  ropepool::python::init_threads(m);
  ropepool::python::init_cuda(m);
  ropepool::python::init_mla(m);
#ifdef ROPEPOOL_WITH_JAX
  ropepool::python::init_jax(m);
#else
  m.attr("jax_front_end") = false;
#endif
}
