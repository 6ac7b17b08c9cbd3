// The checks that what was stored or reported fits a job: ReportStep checks a rank's report
// with ValidateReport, and Restore checks every step read back from the state directory with
// the same rules (a job whose files fail a check is quarantined); a fold keeps the model only
// while StateFinite holds. The storage protos themselves are the store's (state_codec.h).
//
//   if (absl::Status s = ValidateStoredPlan(batch, config, planned_with, &plan); !s.ok()) {
//     quarantine(s);
//   }
#ifndef SPARSEBALANCE_SERVER_JOB_STATE_H_
#define SPARSEBALANCE_SERVER_JOB_STATE_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/latency_model.h"
#include "planner/types.h"
#include "server/plan_store.h"

namespace sparsebalance {

// Reported times above this (seconds) are refused: no micro-batch or wait takes 11 days, and
// the model's least squares must never see values whose squares overflow.
inline constexpr double kMaxReportedSeconds = 1e6;

// Every value of a learned state finite (speed factors positive): what a fold must keep.
bool StateFinite(const LatencyModelState& state);

// Finds a micro-batch's planned samples by id, for the documents of a report (ValidateReport
// and the fold). Workers measure a micro-batch's documents in planned order, so each is looked
// for first at the planned sample of the one before it, then at the next; only a report in
// another order sorts the micro-batch's ids, once, and searches them. Reset rebinds it to
// another micro-batch and keeps the sorted vector's room.
//
//   PlannedSampleFinder finder(&micro_batch.samples);
//   for (const DocumentRecallMeasurement& d : timing.documents) Use(finder.Find(d.sample_id));
class PlannedSampleFinder {
 public:
  explicit PlannedSampleFinder(const std::vector<PlannedSample>* samples = nullptr)
      : samples_(samples) {}
  void Reset(const std::vector<PlannedSample>* samples) {
    samples_ = samples;
    next_ = 0;
    by_id_.clear();
  }
  // The planned sample with `id`, or null when the micro-batch has none.
  const PlannedSample* Find(uint64_t id);

 private:
  const std::vector<PlannedSample>* samples_;
  size_t next_ = 0;  // the planned sample after the last one found in order
  std::vector<std::pair<uint64_t, const PlannedSample*>> by_id_;  // sorted, once needed
};

// Checks one rank's report of a step against the step's plan: micro-batch indices, each
// reported once, tokens as planned, times finite and bounded, exchange_seconds in
// [0, compute_seconds) and 0 unless the micro-batch's plan holds a shard (a report for a shard
// that was not planned is refused), density and recall in [0, 1],
// measured document recalls for samples of that micro-batch's plan (each document once, its
// index in range, recalls in [0, 1], layer_recall empty or one per model layer of `layers`,
// rows >= 1); with `complete`, every non-empty planned micro-batch must be there.
// INVALID_ARGUMENT whose message names "micro_batches[k].<field>".
absl::Status ValidateReport(const StepPlan& plan, int rank, int layers,
                            const std::vector<MicroBatchTiming>& micro_batches, double wait_seconds,
                            bool complete);
// Joins a plan read back from the state directory to its batch and checks it against the
// batch and config. A plan stored by an older planner has no lengths: they and the segments
// are filled from the batch (CompletePlannedSamples); a newer plan's must equal the batch's.
// Then: rank and micro-batch counts, every sample placed at most once (a split document: as
// one shard per rank of its group, all in one micro-batch index, tiling [0, length) at
// block-aligned cuts, the group's ranks in the job), densities in (0, 1], tokens as summed
// (a shard's query tokens), figures finite, and one default density in every micro-batch, in
// (0, 1] (every planner gives each micro-batch its config's density_default). With
// `planned_with` (the density settings the step was planned with, from its record; null for a
// record of an older planner): those settings a valid config's, the default density theirs, and
// every density and layer density within their [density_min, density_max]. Not the job's
// config: UpdateJobConfig may have changed its densities since the step was planned.
// DATA_LOSS naming what is wrong.
absl::Status ValidateStoredPlan(const std::vector<Sample>& batch, const PlannerConfig& config,
                                const PlannedDensities* planned_with, StepPlan* plan);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SERVER_JOB_STATE_H_
