// sparsebalance._C: the C++ half of the Python package sparsebalance (client/python/). The
// Python half (sparsebalance/*.py) re-exports these names and adds the PyTorch operator, the
// sampler and the exception classes that StatusError becomes here.
#include <pybind11/pybind11.h>

#include <string>

#include "client/python/bindings.h"

namespace sparsebalance {
namespace python {
namespace {

// Raises sparsebalance.PlannerError / KernelError(code, message) for a StatusError.
void TranslateStatusError(std::exception_ptr error) {
  try {
    if (error) std::rethrow_exception(std::move(error));
  } catch (const StatusError& e) {
    const char* class_name = e.kind() == ErrorKind::kKernel ? "KernelError" : "PlannerError";
    try {
      py::object cls = py::module_::import("sparsebalance._errors").attr(class_name);
      py::object instance =
          cls(static_cast<int>(e.status().code()), std::string(e.status().message()));
      PyErr_SetObject(cls.ptr(), instance.ptr());
    } catch (py::error_already_set& import_error) {
      // The package is incomplete (e.g. _C copied alone): still say what failed.
      import_error.discard_as_unraisable("sparsebalance._C: cannot import sparsebalance._errors");
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  }
}

}  // namespace
}  // namespace python
}  // namespace sparsebalance

PYBIND11_MODULE(_C, m) {
  namespace sbp = sparsebalance::python;
  m.doc() =
      "SparseBalance C++ bindings: planner client, plan types and sparse attention kernels. "
      "Import the package `sparsebalance`, not this module.";
  pybind11::register_exception_translator(&sbp::TranslateStatusError);
  sbp::BindPlanTypes(m);
  sbp::BindClient(m);
  sbp::BindKernels(m);
}
