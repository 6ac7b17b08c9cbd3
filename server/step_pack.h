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
#include "planner/types.h"
#include "server/step_reports.h"

namespace sparsebalance {

// What a kept step holds besides its bookkeeping (JobRegistry's StepRecord), unpacked.
struct PackedStepContents {
  std::vector<Sample> batch;
  StepPlan plan;
  StepReports reports;  // by rank, with their waits
};

std::string PackStep(const std::vector<Sample>& batch, const StepPlan& plan,
                     const StepReports& reports);
// INTERNAL when `bytes` is not what PackStep wrote (truncated or altered in memory).
absl::StatusOr<PackedStepContents> UnpackStep(absl::string_view bytes);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SERVER_STEP_PACK_H_
