// Shared pieces of the pybind11 module sparsebalance._C (client/python/): the Bind* functions
// that module.cc calls, one per area, and StatusError, the one way an absl::Status becomes a
// Python exception (sparsebalance.PlannerError or KernelError, carrying the gRPC code).
//
//   ThrowIfError(client->DeleteJob(id), ErrorKind::kPlanner);  // raises PlannerError if not OK
//
// StatusError is a plain C++ exception so that it can be thrown while the GIL is released; the
// translator registered in module.cc raises the Python exception with the GIL held.
#ifndef SPARSEBALANCE_CLIENT_PYTHON_BINDINGS_H_
#define SPARSEBALANCE_CLIENT_PYTHON_BINDINGS_H_

#include <pybind11/pybind11.h>

#include <exception>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace sparsebalance {
namespace python {

namespace py = pybind11;

// Which Python exception class a status becomes.
enum class ErrorKind {
  kPlanner,  // sparsebalance.PlannerError: client calls, plan types, local planning
  kKernel,   // sparsebalance.KernelError: block selection and attention
};

class StatusError : public std::exception {
 public:
  StatusError(absl::Status status, ErrorKind kind)
      : status_(std::move(status)), kind_(kind), what_(status_.ToString()) {}
  const char* what() const noexcept override { return what_.c_str(); }
  const absl::Status& status() const { return status_; }
  ErrorKind kind() const { return kind_; }

 private:
  absl::Status status_;
  ErrorKind kind_;
  std::string what_;
};

inline void ThrowIfError(const absl::Status& status, ErrorKind kind) {
  if (!status.ok()) throw StatusError(status, kind);
}

template <typename T>
T ValueOrThrow(absl::StatusOr<T> value, ErrorKind kind) {
  if (!value.ok()) throw StatusError(value.status(), kind);
  return *std::move(value);
}

// Runs `work` (C++ only: no Python objects) with the GIL released, so that other Python threads
// run meanwhile, and returns what it returns once the GIL is held again.
template <typename Work>
auto WithoutGil(Work work) {
  py::gil_scoped_release release;
  return work();
}

// Sample, PlannerConfig, plans, timings and the local planner functions.
void BindPlanTypes(py::module_& m);
// ClientOptions, JobHandle, RankStepPlan, PlannerClient, TrainerSession.
void BindClient(py::module_& m);
// Selection, select_blocks, attention_forward/backward, exact_recall, the CUDA entry points, the
// kept-block rule (kept_blocks_per_row) and the profile-table format.
void BindKernels(py::module_& m);

}  // namespace python
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_CLIENT_PYTHON_BINDINGS_H_
