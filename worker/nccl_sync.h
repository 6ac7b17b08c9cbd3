// The GPU ranks' step synchronisation: an NCCL all-reduce of a gradient-sized buffer at the end
// of each step (so a fast rank waits for the slowest, as in data-parallel training) and of one
// value for the plan agreement. Bootstrapped the standard NCCL way: every rank sets
// NCCL_COMM_ID=host:port (the same on all ranks) and ncclGetUniqueId derives the same id from
// it. Built only with CUDA (SB_WITH_CUDA); otherwise Create returns FAILED_PRECONDITION.
#ifndef SPARSEBALANCE_WORKER_NCCL_SYNC_H_
#define SPARSEBALANCE_WORKER_NCCL_SYNC_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace sparsebalance {

class NcclSync {
 public:
  // `gradient_bytes`: the size of the buffer all-reduced each step.
  static absl::StatusOr<std::unique_ptr<NcclSync>> Create(int rank, int ranks,
                                                          int64_t gradient_bytes);
  // Makes device rank % (devices visible) this process's CUDA device: ranks on one multi-GPU
  // host each get their own (NCCL refuses two ranks on one device). Call before any CUDA work.
  static absl::Status SelectDevice(int rank);
  virtual ~NcclSync() = default;
  // All-reduce (max) of one value across ranks.
  virtual absl::StatusOr<double> AllReduceMax(double value) = 0;
  // All-reduce (sum) of the gradient buffer; returns when it is complete on this rank.
  virtual absl::Status AllReduceGradients() = 0;
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_WORKER_NCCL_SYNC_H_
