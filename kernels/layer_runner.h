// One transformer layer, forward and backward, as both sb-profile (kernels/layer_profiler.h)
// and sb-worker (worker/micro_batch_runner.h) run it, so that the profile table measures
// exactly what a worker runs: block selection at each document's density, block-sparse
// attention forward and backward over a varlen batch of documents, and the linear part (QKV
// and output projections, a 4x MLP: forward, input and weight gradients) as GEMMs.
//
// Documents are cu_seqlens entries: they never attend to each other. Results come per
// document as well as for the batch, so that a caller that packs several documents into one
// sample can add them up per sample.
//
// Timing: on CPU with one thread (the worker's case) the calling thread's CPU time
// (CLOCK_THREAD_CPUTIME_ID), so that ranks sharing a few cores are measured by their own work,
// not by the scheduler; with several kernel threads (sb-profile --threads) the wall clock of
// the layer, since the work then runs on the pool's threads. On GPU, CUDA events around the
// kernels.
//
//   absl::StatusOr<std::unique_ptr<LayerRunner>> runner = LayerRunner::Create(shape, {});
//   LayerBatch batch;  // documents and their q, k, v
//   absl::Status loaded = (*runner)->Load(std::move(batch));
//   absl::StatusOr<LayerMeasurement> m = (*runner)->Run(/*exact_recall=*/false);
#ifndef SPARSEBALANCE_KERNELS_LAYER_RUNNER_H_
#define SPARSEBALANCE_KERNELS_LAYER_RUNNER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "contract/layer_shape.h"
#include "contract/selection_mode.h"
#include "kernels/recall_probe.h"

namespace sparsebalance {
namespace kernels {

struct LayerDocument {
  int64_t length = 0;        // tokens, in [1, 2^30]
  double density = 1.0;      // share of causal key blocks kept, (0, 1]
  uint64_t recall_seed = 0;  // seeds the rows the recall probe samples (recall_probe.h)
};

// A varlen batch: the documents back to back in the tensors, in order.
struct LayerBatch {
  std::vector<LayerDocument> documents;
  std::vector<float> q, k, v;  // fp32 [total tokens, heads, head_dim]
};

struct DocumentMeasurement {
  int64_t tokens = 0;
  int64_t active_blocks = 0;      // kept (query block, key block) pairs, all heads
  int64_t causal_blocks = 0;      // all causal pairs, all heads
  double achieved_density = 0.0;  // token-weighted share of causal key blocks kept
  // Attention recall, [0, 1], as RunOptions asked: the probe's mean over its sampled rows and
  // the heads; the exact token-weighted mean over every row; or the block scores' estimate.
  double recall = 0.0;
  double estimated_recall = 0.0;  // the block scores' token-weighted estimate, always
  int recall_rows = 0;            // query rows measured: sampled, every row (exact), 0 (estimate)
};

struct LayerMeasurement {
  double attention_seconds = 0.0;  // block selection + attention forward + backward
  double linear_seconds = 0.0;     // the GEMMs
  double seconds() const { return attention_seconds + linear_seconds; }
  double recall_seconds = 0.0;  // the recall probe, on the same clock, not part of seconds()
  int64_t active_blocks = 0;    // over the batch, all heads
  int64_t causal_blocks = 0;    // over the batch, all heads
  std::vector<DocumentMeasurement> documents;  // one per LayerBatch document, same order
};

struct LayerRunnerOptions {
  std::string device = "cpu";  // "cpu" (fp32 reference) or "cuda" (bf16 kernels, device 0)
  int threads = 1;             // CPU kernel threads; 0 means the hardware concurrency
};

// How Run measures recall (besides the block scores' estimate, which it always reports).
struct RunOptions {
  // CPU only: every row's exact kept mass (O(tokens^2)), off the clock.
  bool exact_recall = false;
  // Otherwise, with `probe_recall`: the recall probe on rows sampled by `sampling` (seeded by
  // each document's recall_seed), timed into recall_seconds.
  bool probe_recall = false;
  RecallSampling sampling;
  // How block selection chooses each row's blocks within its density's budget
  // (kernels/block_selection.h): top-k, or anchor-guided thresholding at tau = anchor_threshold
  // (in (0, 1]), which may keep fewer blocks than the density allows.
  SelectionMode selection = SelectionMode::kTopK;
  double anchor_threshold = kDefaultAnchorThreshold;
};

class LayerRunner {
 public:
  // Checks the shape (heads, head_dim 64 or 128, block size 64 or 128, local_blocks >= 0) and
  // the device; "cuda" needs a build with the CUDA kernels and a usable device.
  static absl::StatusOr<std::unique_ptr<LayerRunner>> Create(const ModelShape& shape,
                                                             const LayerRunnerOptions& options);
  virtual ~LayerRunner() = default;

  // Takes the batch that the next Run calls use and prepares its buffers (host or device);
  // the data loader's work, not the step's, so it is never timed.
  virtual absl::Status Load(LayerBatch batch) = 0;

  // Gives the loaded documents new densities (one each, in (0, 1]) without loading again:
  // sb-profile measures one document at several densities.
  virtual absl::Status SetDensities(const std::vector<double>& densities) = 0;

  // Runs one layer forward and backward on the loaded batch and measures it. With
  // `exact_recall` (CPU only) each document's recall is the exact softmax mass inside the kept
  // blocks (O(tokens^2), off the clock); otherwise the block scores' estimate.
  absl::StatusOr<LayerMeasurement> Run(bool exact_recall) {
    RunOptions options;
    options.exact_recall = exact_recall;
    return Run(options);
  }
  // The same with the recall measured as `options` says (a probe needs a valid sampling).
  virtual absl::StatusOr<LayerMeasurement> Run(const RunOptions& options) = 0;

  // E.g. "cpu Intel(R) Xeon(R) ... (1 thread, fp32 reference)" or the GPU's name.
  virtual std::string device_name() const = 0;
};

}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_LAYER_RUNNER_H_
