#include "worker/micro_batch_runner.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/layer_runner.h"
#include "worker/synthetic_inputs.h"

namespace sparsebalance {
namespace {

absl::Status CheckInputs(const std::vector<uint64_t>& ids, const std::vector<int64_t>& lengths,
                         const std::vector<double>& densities) {
  if (ids.size() != lengths.size() || ids.size() != densities.size()) {
    return absl::InvalidArgumentError(absl::StrCat("micro-batch: ", ids.size(), " ids, ",
                                                   lengths.size(), " lengths, ", densities.size(),
                                                   " densities; they must match"));
  }
  if (ids.empty()) return absl::InvalidArgumentError("micro-batch: no documents");
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] <= 0 || lengths[i] > (int64_t{1} << 30)) {
      return absl::InvalidArgumentError(
          absl::StrCat("lengths[", i, "]: ", lengths[i], " is not a positive token count"));
    }
  }
  return absl::OkStatus();
}

// Every layer of the model is the one layer kernels::LayerRunner runs, on the same inputs.
class LayerwiseRunner : public MicroBatchRunner {
 public:
  LayerwiseRunner(std::unique_ptr<kernels::LayerRunner> layer, const ModelShape& shape,
                  bool exact_recall)
      : layer_(std::move(layer)), shape_(shape), exact_recall_(exact_recall) {}

  std::string device_name() const override { return layer_->device_name(); }

  absl::StatusOr<MicroBatchResult> Run(const std::vector<uint64_t>& ids,
                                       const std::vector<int64_t>& lengths,
                                       const std::vector<double>& densities) override {
    if (absl::Status s = CheckInputs(ids, lengths, densities); !s.ok()) return s;
    // Inputs are the data loader's work, not the step's: made before any clock starts.
    VarlenBatch varlen;
    kernels::LayerBatch batch;
    for (size_t i = 0; i < ids.size(); ++i) {
      varlen.Append(MakeDocument(ids[i], lengths[i], shape_.heads, shape_.head_dim), lengths[i]);
      batch.documents.push_back({lengths[i], densities[i]});
    }
    batch.q = std::move(varlen.q);
    batch.k = std::move(varlen.k);
    batch.v = std::move(varlen.v);
    if (absl::Status s = layer_->Load(std::move(batch)); !s.ok()) return s;
    MicroBatchResult result;
    for (int layer = 0; layer < shape_.layers; ++layer) {
      // Every layer sees the same inputs here, so one layer's recall is the micro-batch's.
      absl::StatusOr<kernels::LayerMeasurement> m = layer_->Run(layer == 0 && exact_recall_);
      if (!m.ok()) return m.status();
      result.attention_seconds += m->attention_seconds;
      result.compute_seconds += m->seconds();
      if (layer == 0) Summarize(*m, &result);
    }
    return result;
  }

 private:
  // Token-weighted recall and density over the documents.
  static void Summarize(const kernels::LayerMeasurement& m, MicroBatchResult* out) {
    double recall_sum = 0.0;
    double density_sum = 0.0;
    for (const kernels::DocumentMeasurement& d : m.documents) {
      out->tokens += d.tokens;
      recall_sum += d.recall * static_cast<double>(d.tokens);
      density_sum += d.achieved_density * static_cast<double>(d.tokens);
    }
    const double tokens = static_cast<double>(out->tokens);
    out->active_blocks = m.active_blocks;
    out->causal_blocks = m.causal_blocks;
    out->recall = tokens > 0 ? std::clamp(recall_sum / tokens, 0.0, 1.0) : 1.0;
    out->achieved_density = tokens > 0 ? density_sum / tokens : 1.0;
    out->documents = m.documents;
  }

  std::unique_ptr<kernels::LayerRunner> layer_;
  ModelShape shape_;
  bool exact_recall_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MicroBatchRunner>> MicroBatchRunner::Create(
    const std::string& device, const ModelShape& shape, bool exact_recall) {
  if (device != "cpu" && device != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat("--device=", device, ": expected cpu or cuda"));
  }
  if (device == "cuda" && exact_recall) {
    return absl::InvalidArgumentError("--exact_recall: only with --device=cpu");
  }
  kernels::LayerRunnerOptions options;
  options.device = device;
  options.threads = 1;  // one rank, one core: its own work on its own thread
  absl::StatusOr<std::unique_ptr<kernels::LayerRunner>> layer =
      kernels::LayerRunner::Create(shape, options);
  if (!layer.ok()) {
    return absl::Status(layer.status().code(),
                        absl::StrCat("--device=", device, ": ", layer.status().message()));
  }
  return std::unique_ptr<MicroBatchRunner>(
      new LayerwiseRunner(*std::move(layer), shape, exact_recall));
}

}  // namespace sparsebalance
