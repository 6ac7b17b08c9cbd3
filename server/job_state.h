// A job's stored state (sparsebalance.state.v1) <-> the planner's types, and the checks that
// what was stored or reported fits the job: JobRegistry writes with these, Restore reads and
// validates with them (a job whose files fail a check is quarantined), and ReportStep checks a
// rank's report with the same rules it is checked with after a restart.
//
//   absl::StatusOr<LatencyModel> model = ModelFromProto(snapshot.model(), settings.planner);
//   if (!model.ok()) quarantine(model.status().message());
#ifndef SPARSEBALANCE_SERVER_JOB_STATE_H_
#define SPARSEBALANCE_SERVER_JOB_STATE_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/latency_model.h"
#include "planner/types.h"
#include "proto/wire.h"
#include "sparsebalance/state/v1/state.pb.h"

namespace sparsebalance {

// Reported times above this (seconds) are refused: no micro-batch or wait takes 11 days, and
// the model's least squares must never see values whose squares overflow.
inline constexpr double kMaxReportedSeconds = 1e6;

state::v1::ModelState ModelToProto(const LatencyModel& model);
// The model of a snapshot, for a job of `config`; DATA_LOSS when its shape is not the job's or
// a value is not finite (speed factors: not positive).
absl::StatusOr<LatencyModel> ModelFromProto(const state::v1::ModelState& in,
                                            const PlannerConfig& config);
// Every value of a learned state finite (speed factors positive): what a fold must keep.
bool StateFinite(const LatencyModelState& state);
// The plan a step record holds, its micro-batches read as MicroBatchFromProto reads them
// (INVALID_ARGUMENT naming `ranks[r].micro_batches[m]...`); not checked against the batch:
// ValidateStoredPlan.
absl::StatusOr<StepPlan> StepPlanFromProto(const state::v1::StepRecord& in);

// Checks one rank's report of a step against the step's plan: micro-batch indices, each
// reported once, tokens as planned, times finite and bounded, density and recall in [0, 1];
// with `complete`, every non-empty planned micro-batch must be there. INVALID_ARGUMENT whose
// message names "micro_batches[k].<field>".
absl::Status ValidateReport(const StepPlan& plan, int rank,
                            const std::vector<MicroBatchTiming>& micro_batches, double wait_seconds,
                            bool complete);
// Joins a plan read back from the state directory to its batch and checks it against the
// batch and config. A plan stored by an older planner has no lengths: they and the segments
// are filled from the batch (CompletePlannedSamples); a newer plan's must equal the batch's.
// Then: rank and micro-batch counts, every sample placed at most once, densities in (0, 1],
// tokens as summed, figures finite. DATA_LOSS naming what is wrong.
absl::Status ValidateStoredPlan(const std::vector<Sample>& batch, const PlannerConfig& config,
                                StepPlan* plan);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SERVER_JOB_STATE_H_
