// Runs one planned micro-batch the way a training step would, on the CPU reference kernels or
// the CUDA kernels, and measures it: every layer is kernels::LayerRunner's layer (the one that
// sb-profile measures, so that the profile table predicts what workers measure), run on the
// micro-batch's documents as one varlen batch, with inputs made from the documents' ids
// (worker/synthetic_inputs.h). Timing is the layer runner's: thread CPU time on CPU (the
// kernels run single-threaded on the calling thread), CUDA events on GPU.
//
// A planned sample runs as its documents (DocumentsOf, worker/step_inputs.h): a pre-packed
// sample's segments are separate varlen entries, so no document attends across a boundary,
// and its figures are added up over its documents. Per-layer densities, where planned, are
// run layer by layer.
//
//   absl::StatusOr<std::unique_ptr<MicroBatchRunner>> runner =
//       MicroBatchRunner::Create("cpu", shape, /*exact_recall=*/false);
//   absl::StatusOr<MicroBatchResult> r = (*runner)->Run(plan.micro_batches[m],
//   /*recall_seed=*/step);
//
// Context parallelism: a planned sample that is a shard of a split document
// (PlannedSample::sharded()) runs on the CPU through the shard exchange of the context
// (worker/shard_layer.h), every layer, before the micro-batch's unsplit samples, shards in
// ascending id (the plan's order; every rank of a group does the same, so none deadlocks). Its
// inputs are the rows [shard_begin, shard_end) of the unsplit document's (MakeDocument of the
// sample id), so a split document computes what the unsplit one would. Its time is the thread's
// CPU time of its own compute plus the wall time of the exchange (exchange_seconds); its
// recall is the block scores' estimate on its own rows.
//
// Recall: by default the block scores' estimate; with MicroBatchRunnerOptions::recall_rows
// the true kept softmax mass on sampled rows of every document (per layer), timed apart.
#ifndef SPARSEBALANCE_WORKER_MICRO_BATCH_RUNNER_H_
#define SPARSEBALANCE_WORKER_MICRO_BATCH_RUNNER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "contract/selection_mode.h"
#include "kernels/layer_runner.h"
#include "planner/types.h"

namespace sparsebalance {

class ShardExchange;

// What one planned sample measured, over its documents and the model's layers.
struct SampleResult {
  int64_t tokens = 0;
  int64_t active_blocks = 0;      // kept (query block, key block) pairs, all heads and layers
  int64_t causal_blocks = 0;      // all causal pairs, all heads and layers
  double achieved_density = 0.0;  // active / causal blocks
  double recall = 0.0;            // token- and layer-averaged attention recall, [0, 1]
  // A shard of a split document: its exchange time (part of the micro-batch's compute) and the
  // key/value bytes it received from its group, all layers.
  double exchange_seconds = 0.0;
  int64_t exchange_bytes = 0;
};

struct MicroBatchResult {
  double compute_seconds = 0.0;    // all layers, forward + backward (attention + linear)
  double attention_seconds = 0.0;  // the selection and attention part of compute_seconds
  int64_t tokens = 0;
  int64_t active_blocks = 0;          // kept (query block, key block) pairs, all heads and layers
  int64_t causal_blocks = 0;          // all causal pairs, all heads and layers
  double achieved_density = 0.0;      // token-weighted share of causal key blocks kept
  double recall = 0.0;                // token-weighted attention recall (measured or estimated)
  double estimated_recall = 0.0;      // token-weighted: the block scores' estimate, always
  std::vector<SampleResult> samples;  // one per planned sample, in the plan's order
  // With the recall probe: one per document of each planned sample (samples in the plan's
  // order, then their documents), its recall in every layer.
  std::vector<DocumentRecallMeasurement> documents;
  double recall_seconds = 0.0;  // the probe's time, on the compute clock, not in compute_seconds
  // The shards' exchange with their groups (wall time), part of compute_seconds and of
  // attention_seconds; 0 without shards.
  double exchange_seconds = 0.0;
};

// Where a micro-batch runs: what keys its exchange messages and seeds its recall probe.
struct MicroBatchContext {
  uint64_t recall_seed = 0;  // e.g. the step
  int64_t step = 0;
  int micro_batch = 0;  // index in the rank's plan
  // Needed when a sample is a shard of a split document (CPU ranks); not owned.
  ShardExchange* exchange = nullptr;
};

struct MicroBatchRunnerOptions {
  // CPU only: the exact recall over every row (O(tokens^2), for small runs).
  bool exact_recall = false;
  // Otherwise, above 0: the recall probe (kernels/recall_probe.h) on this many query rows per
  // document (the last one always among them) within `recall_pair_share` of the kept (query,
  // key) pairs; 0: the block scores' estimate.
  int recall_rows = 0;
  double recall_pair_share = 0.05;
  // Block selection within each document's budget (the job config's `selection` and
  // `anchor_threshold`): top-k, or anchor-guided thresholding at tau in (0, 1].
  SelectionMode selection = SelectionMode::kTopK;
  double anchor_threshold = kDefaultAnchorThreshold;
};

class MicroBatchRunner {
 public:
  // `device` is "cpu" or "cuda". With `exact_recall` (CPU only) the recall is the exact
  // softmax mass inside the kept blocks (O(tokens^2), for small runs); otherwise the block
  // scores' estimate.
  static absl::StatusOr<std::unique_ptr<MicroBatchRunner>> Create(const std::string& device,
                                                                  const ModelShape& shape,
                                                                  bool exact_recall);
  // The same with the recall measured as `options` says (INVALID_ARGUMENT for a bad option).
  static absl::StatusOr<std::unique_ptr<MicroBatchRunner>> Create(
      const std::string& device, const ModelShape& shape, const MicroBatchRunnerOptions& options);
  // The runner of Create over a layer runner made by the caller (e.g. a test's, which records
  // what each layer is asked to run); `options` as Create checks them, `cpu` whether the layer
  // runs on the CPU (shards of split documents run only there).
  static std::unique_ptr<MicroBatchRunner> Over(std::unique_ptr<kernels::LayerRunner> layer,
                                                const ModelShape& shape,
                                                const MicroBatchRunnerOptions& options, bool cpu);
  virtual ~MicroBatchRunner() = default;
  // Runs the micro-batch's planned samples, each at its density (per layer where its
  // layer_densities are given: then exactly one per layer). INVALID_ARGUMENT naming
  // `samples[k]` for a sample that cannot run (no tokens, a density outside (0, 1], layer
  // densities of the wrong count).
  absl::StatusOr<MicroBatchResult> Run(const MicroBatchPlan& micro_batch) {
    return Run(micro_batch, /*recall_seed=*/0);
  }
  // The same; the probe's rows of each document are drawn from `recall_seed` (e.g. the step),
  // the sample's id and the document's index, so that any rank running the sample in that step
  // probes the same rows.
  absl::StatusOr<MicroBatchResult> Run(const MicroBatchPlan& micro_batch, uint64_t recall_seed) {
    MicroBatchContext context;
    context.recall_seed = recall_seed;
    return Run(micro_batch, context);
  }
  // The same within a step: shards of split documents exchange through context.exchange
  // (FAILED_PRECONDITION naming the sample without one; UNIMPLEMENTED on cuda).
  virtual absl::StatusOr<MicroBatchResult> Run(const MicroBatchPlan& micro_batch,
                                               const MicroBatchContext& context) = 0;
  virtual std::string device_name() const = 0;
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_WORKER_MICRO_BATCH_RUNNER_H_
