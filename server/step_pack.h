// A kept step in few bytes: JobRegistry holds the newest steps of a job as C++ values and packs
// the older ones (their batch, plan and reports) into one byte string, which it unpacks again
// in the rare calls that need an old step (GetRankPlan of it, a late report, a repeated
// SubmitBatch). A StepPlan of 16,384 samples is some 2 MB of vectors and a step's reports with
// their measured recalls 1.4 MB more; packed, the three take about a tenth of that.
//
//   std::string bytes = PackStep(batch, plan, reports);
//   absl::StatusOr<PackedStepContents> back = UnpackStep(bytes);  // the same, field for field
//
// Lossless: every field of every value comes back equal, doubles bit for bit (-0.0, NaN
// payloads), including MicroBatchPlan::features. Integers are varints (signed ones zigzag, ids
// as differences from the previous id); a double that is a small integer or a multiple of 2^-16
// (token counts, zeros, quantized densities) takes 1 to 4 bytes, any other 9. Never written to
// disk: the format may change with any release.
#ifndef SPARSEBALANCE_SERVER_STEP_PACK_H_
#define SPARSEBALANCE_SERVER_STEP_PACK_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "planner/recall_model.h"
#include "planner/types.h"
#include "server/step_reports.h"

namespace sparsebalance {

// What a kept step holds besides its bookkeeping (JobRegistry's StepRecord), unpacked.
struct PackedStepContents {
  std::vector<Sample> batch;
  StepPlan plan;
  StepReports reports;  // by rank, with their waits
};

// What a step's per-layer densities were made from: the job's config and recall model when the
// step was planned (BuildPlan gives each planned sample LayerDensities of its batch sample at its
// density). A job that plans per layer keeps about 32 doubles per sample in each plan, most of
// a packed step's bytes (5.6 MB a step at 16,384 samples of 32 layers, where the rest took 0.8):
// given this, PackStep leaves them out and UnpackStep computes them again, checked bit for bit
// against a hash PackStep keeps.
struct LayerDensityRecipe {
  PlannerConfig config;
  RecallModel recall;
};

// Whether `recipe` gives back, bit for bit, the per-layer densities of every planned sample of
// `plan` that has them (and at least one has): a step read back from the state directory
// (StepRecord.layer_recall) is packed with its recipe only then, so that a release whose
// LayerDensities differ keeps the stored densities instead of losing them.
bool RecipeGivesLayerDensities(const std::vector<Sample>& batch, const StepPlan& plan,
                               const LayerDensityRecipe& recipe);

std::string PackStep(const std::vector<Sample>& batch, const StepPlan& plan,
                     const StepReports& reports, const LayerDensityRecipe* layers = nullptr);
// INTERNAL when `bytes` is not what PackStep wrote (truncated or altered in memory), or when its
// layer densities were left out and `layers` does not give them back (none given, or not the
// recipe PackStep had).
absl::StatusOr<PackedStepContents> UnpackStep(absl::string_view bytes,
                                              const LayerDensityRecipe* layers = nullptr);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SERVER_STEP_PACK_H_
