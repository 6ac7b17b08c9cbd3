// The persistence codec of sb-planner's state directory: the store's C++ records (plan_store.h:
// StoredJob, a step's batch and plan, StoredReport) <-> the storage protos of
// sparsebalance.state.v1 (proto/sparsebalance/state/v1/state.proto). Only PlanStore uses it:
// the registry hands the store C++ values and gets C++ values back.
//
//   state::v1::JobSnapshot bytes_side = EncodeJob(job);
//   absl::StatusOr<StoredJob> back = DecodeJob(bytes_side);  // DATA_LOSS naming the field
#ifndef SPARSEBALANCE_SERVER_STATE_CODEC_H_
#define SPARSEBALANCE_SERVER_STATE_CODEC_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/types.h"
#include "server/plan_store.h"
#include "sparsebalance/state/v1/state.pb.h"

namespace sparsebalance {

state::v1::JobSnapshot EncodeJob(const StoredJob& job);
// The job of a snapshot: its config (defaults filled, checked by ConfigFromProto under limits
// that never refuse a job accepted before) and its model, whose sizes must fit the config and
// whose values must be finite (speed factors positive). DATA_LOSS naming what is wrong.
absl::StatusOr<StoredJob> DecodeJob(const state::v1::JobSnapshot& in);

// A step record into `out` (e.g. a message on an arena: a step of 16,384 samples is some
// 50,000 small messages). The plan in the current form only (MicroBatch.samples, without the
// deprecated copy the wire keeps for older clients): DecodeStep reads both forms. With
// `layer_recall`, the recall model the plan's per-layer densities were computed from
// (StepRecord.layer_recall); with `planned_with`, the density settings it was planned with.
void EncodeStep(int64_t step, const std::vector<Sample>& batch, const StepPlan& plan, bool folded,
                const RecallModelState* layer_recall, const PlannedDensities* planned_with,
                state::v1::StepRecord* out);
// The step, batch and plan of a record, as stored (not checked against the job: the registry
// does that with ValidateBatch and ValidateStoredPlan, which also fills the lengths of a plan
// an older planner stored), its layer_recall where it has one (its shape unchecked), and its
// planned_with where it has one (its values unchecked: ValidateStoredPlan checks them).
// DATA_LOSS naming `ranks[r].micro_batches[m]...` for a malformed planned sample, or
// `layer_recall.curves[i]` for a curve without kRecallDensityBins bins.
absl::StatusOr<PlanStore::LoadedStep> DecodeStep(const state::v1::StepRecord& in);

// Into `out`, which may live on an arena (PlanStore::AppendReport builds it on the stack).
void EncodeReport(const StoredReport& report, state::v1::ReportRecord* out);
StoredReport DecodeReport(const state::v1::ReportRecord& in);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SERVER_STATE_CODEC_H_
