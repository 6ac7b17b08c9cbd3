// One step of planning: validation, placement (sample_assigner.h), density tuning
// (sparsity_tuner.h) and the plan's predicted figures. Pure and deterministic: the same batch,
// config and model give a byte-identical plan on every machine, which is what lets every
// rank recompute the planner's answer locally when the planner is unreachable.
//
//   LatencyModel model(config.shape, config.ranks, prior);
//   absl::StatusOr<StepPlan> plan = PlanStep(batch, config, model);
//   if (!plan.ok()) ...;  // INVALID_ARGUMENT naming the field and index
#ifndef SPARSEBALANCE_PLANNER_PLANNER_H_
#define SPARSEBALANCE_PLANNER_PLANNER_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "planner/latency_model.h"
#include "planner/plan_threads.h"
#include "planner/recall_model.h"
#include "planner/sample_assigner.h"
#include "planner/sample_table.h"
#include "planner/types.h"

namespace sparsebalance {

// A PlannerConfig that ValidateConfig accepted. Only Check makes one, so the overloads below
// that take it do not check the config again: sb-planner checks a job's config once, when the
// job is created or its config changes, and plans every step with it.
//
//   absl::StatusOr<ValidConfig> config = ValidConfig::Check(settings.planner);
//   absl::StatusOr<StepPlan> plan = PlanStep(batch, *config, model);
class ValidConfig {
 public:
  static absl::StatusOr<ValidConfig> Check(const PlannerConfig& config);
  const PlannerConfig& get() const { return config_; }

 private:
  explicit ValidConfig(const PlannerConfig& config) : config_(config) {}
  PlannerConfig config_;
};

// Checks the batch against the config (which must itself be valid: ValidateConfig's error is
// returned otherwise): non-empty, at most kMaxBatchSamples, unique ids, lengths in
// [1, micro_batch_capacity], sensitivity in [0, 1], segments in [1, length] summing to the
// length (checked as it runs, so no sum wraps); with kError also that the total fits
// ranks x micro_batches x capacity. Errors are INVALID_ARGUMENT and name `samples[i]` and the
// field (`samples[i].segments[k]` for a segment).
absl::Status ValidateBatch(const std::vector<Sample>& batch, const PlannerConfig& config);
// With `threads`, the samples are checked on them (plan_threads.h); the answer is the same.
absl::Status ValidateBatch(const std::vector<Sample>& batch, const ValidConfig& config,
                           PlanThreads* threads = nullptr);

// The segment rule ValidateBatch applies to each sample, also applied to planned samples read
// from the wire: empty, or each segment in [1, length] and all summing to `length` (checked
// as it runs, so no sum wraps). INVALID_ARGUMENT naming `<where>.segments[k]`, or
// `<where>.segments` for the sum.
absl::Status ValidateSegments(int64_t length, const std::vector<int64_t>& segments,
                              absl::string_view where);

// Joins planned micro-batches to the batch they were planned from. A planned sample read from
// an older planner's message has no length (0): it gets the batch sample's length and
// segments. Every other one must match its batch sample. INVALID_ARGUMENT naming
// `micro_batches[m].samples[k].<field>` for an id not in the batch or a length or segments
// that differ from the batch's.
absl::Status CompletePlannedSamples(const std::vector<Sample>& batch,
                                    std::vector<MicroBatchPlan>* micro_batches);
// A batch's samples by id, made once for the CompletePlannedSamples of many ranks' plans of one
// batch (a stored step's, one call per rank: an index per call took about 0.13 s a step to
// restore at 16,384 samples over 1,024 ranks, and about 2 s at 65,536 over 4,096).
using SamplesById = absl::flat_hash_map<uint64_t, const Sample*>;
SamplesById IndexSamplesById(const std::vector<Sample>& batch);
absl::Status CompletePlannedSamples(const SamplesById& batch,
                                    std::vector<MicroBatchPlan>* micro_batches);

// One rank's part of a step plan against the config, after CompletePlannedSamples (every
// planned id is in `batch`): config.micro_batches micro-batches, each sample id at most once on
// the rank (a split document's shard too: a rank holds at most one shard of a document), each
// micro-batch's query tokens within micro_batch_capacity and equal to its `tokens` (unless 0),
// layer_densities empty or one per layer, and the step's `deferred_ids` in `batch` and not
// planned on this rank. What a trainer
// checks before it runs a plan that came over the wire (TrainerSession), and CheckPlan of every
// rank. FAILED_PRECONDITION naming `micro_batches[m]` and the sample id.
absl::Status CheckRankPlan(const SamplesById& batch,
                           const std::vector<MicroBatchPlan>& micro_batches,
                           const std::vector<uint64_t>& deferred_ids, const PlannerConfig& config);

// The plan a trainer computes without the planner (the client's offline fallback): PlanStep
// with a latency model at the default cost prior, marked planned_locally. Deterministic, so
// every rank that falls back, and the planner when told afterwards, computes the same plan.
absl::StatusOr<StepPlan> PlanStepLocally(const std::vector<Sample>& batch,
                                         const PlannerConfig& config);
absl::StatusOr<StepPlan> PlanStepLocally(const std::vector<Sample>& batch,
                                         const ValidConfig& config);

// Where one PlanStep call's wall time went, in seconds, phase by phase in the order they run
// (PlanStep fills it when asked): checking the batch; the step's SampleTable and the recall
// at base densities; the step-level allocation (sparsebalance); placement (AssignSamples); the
// recall guards' minimums for the placed samples; the per-rank tuning (dst, sparsebalance);
// and BuildPlan. Phases a policy skips stay 0.
inline constexpr int kPlanPhases = 7;
inline constexpr std::array<const char*, kPlanPhases> kPlanPhaseNames = {
    "validate", "table", "allocate", "place", "guards", "tune", "build"};
using PlanPhaseSeconds = std::array<double, kPlanPhases>;

// Plans one step with `config.policy`. The model must have `config.ranks` ranks; `recall` is
// the job's learned recall model (its capacity and layers must match the config's). Without
// one the recall prior alone is used (a RecallModel with no measurements). The batch is
// checked (ValidateBatch) either way; the config only when it is not a ValidConfig. With
// `threads`, its per-sample and per-rank work is split over them (plan_threads.h): the plan is
// the same bytes with any number of threads. With `phases`, the wall time of each phase goes
// there (the plan does not depend on it).
absl::StatusOr<StepPlan> PlanStep(const std::vector<Sample>& batch, const PlannerConfig& config,
                                  const LatencyModel& model);
absl::StatusOr<StepPlan> PlanStep(const std::vector<Sample>& batch, const ValidConfig& config,
                                  const LatencyModel& model);
absl::StatusOr<StepPlan> PlanStep(const std::vector<Sample>& batch, const ValidConfig& config,
                                  const LatencyModel& model, const RecallModel& recall,
                                  PlanThreads* threads = nullptr,
                                  PlanPhaseSeconds* phases = nullptr);

// Turns an assignment and densities into a plan with its predicted figures.
StepPlan BuildPlan(const std::vector<Sample>& batch, const PlannerConfig& config,
                   const LatencyModel& model, const Assignment& assignment,
                   const std::vector<double>& densities);
StepPlan BuildPlan(const std::vector<Sample>& batch, const PlannerConfig& config,
                   const LatencyModel& model, const RecallModel& recall,
                   const Assignment& assignment, const std::vector<double>& densities,
                   const std::vector<double>& defaults);
// The same with the step's SampleTable (built from the same batch, config, model and recall),
// the ranks built on `threads` when given.
StepPlan BuildPlan(const std::vector<Sample>& batch, const PlannerConfig& config,
                   const LatencyModel& model, const RecallModel& recall, const SampleTable& table,
                   const Assignment& assignment, const std::vector<double>& densities,
                   const std::vector<double>& defaults, PlanThreads* threads = nullptr);

// Verifies a plan's invariants against its batch: every sample exactly once (placed or
// deferred) with the batch's length and segments, config.micro_batches per rank, micro-batch
// capacity, groups on one rank, densities in [floor, density_max], token counts;
// FAILED_PRECONDITION naming what is wrong.
absl::Status CheckPlan(const StepPlan& plan, const std::vector<Sample>& batch,
                       const PlannerConfig& config);

// Token-weighted predicted recall (RecallModel::SampleRecall) of the batch at one density per
// sample; `weights` (one per sample, e.g. 1 placed / 0 deferred) scale each sample's tokens when
// given. Without a model, the prior alone (each sample's sensitivity).
double TokenWeightedRecall(const std::vector<Sample>& batch, const std::vector<double>& densities,
                           const std::vector<double>& weights = {});
double TokenWeightedRecall(const std::vector<Sample>& batch, const std::vector<double>& densities,
                           const RecallModel& recall, const std::vector<double>& weights = {});

// A canonical text of the plan (every id, length, segment, density and figure, doubles in hex) for
// comparing plans byte for byte.
std::string CanonicalPlanText(const StepPlan& plan);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_PLANNER_H_
