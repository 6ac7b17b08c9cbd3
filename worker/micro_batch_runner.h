// Runs one planned micro-batch the way a training step would, on the CPU reference kernels or
// the CUDA kernels, and measures it: every layer is kernels::LayerRunner's layer (the one that
// sb-profile measures, so that the profile table predicts what workers measure), run on the
// micro-batch's documents as one varlen batch, with inputs made from the documents' ids
// (worker/synthetic_inputs.h). Timing is the layer runner's: thread CPU time on CPU (the
// kernels run single-threaded on the calling thread), CUDA events on GPU.
//
//   absl::StatusOr<std::unique_ptr<MicroBatchRunner>> runner =
//       MicroBatchRunner::Create("cpu", shape, /*exact_recall=*/false);
//   absl::StatusOr<MicroBatchResult> r = (*runner)->Run(ids, lengths, densities);
#ifndef SPARSEBALANCE_WORKER_MICRO_BATCH_RUNNER_H_
#define SPARSEBALANCE_WORKER_MICRO_BATCH_RUNNER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/layer_runner.h"
#include "planner/types.h"

namespace sparsebalance {

struct MicroBatchResult {
  double compute_seconds = 0.0;    // all layers, forward + backward (attention + linear)
  double attention_seconds = 0.0;  // the selection and attention part of compute_seconds
  int64_t tokens = 0;
  int64_t active_blocks = 0;      // kept (query block, key block) pairs, all heads, one layer
  int64_t causal_blocks = 0;      // all causal pairs, all heads, one layer
  double achieved_density = 0.0;  // token-weighted share of causal key blocks kept
  double recall = 0.0;            // token-weighted attention recall (exact or estimated)
  // The same figures per document (one layer), in the order Run was given them: what a
  // sample made of several documents adds up.
  std::vector<kernels::DocumentMeasurement> documents;
};

class MicroBatchRunner {
 public:
  // `device` is "cpu" or "cuda". With `exact_recall` (CPU only) the recall is the exact
  // softmax mass inside the kept blocks (O(tokens^2), for small runs); otherwise the block
  // scores' estimate.
  static absl::StatusOr<std::unique_ptr<MicroBatchRunner>> Create(const std::string& device,
                                                                  const ModelShape& shape,
                                                                  bool exact_recall);
  virtual ~MicroBatchRunner() = default;
  // Documents `ids` of `lengths` tokens at `densities` (each in (0, 1]).
  virtual absl::StatusOr<MicroBatchResult> Run(const std::vector<uint64_t>& ids,
                                               const std::vector<int64_t>& lengths,
                                               const std::vector<double>& densities) = 0;
  virtual std::string device_name() const = 0;
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_WORKER_MICRO_BATCH_RUNNER_H_
