// Dynamic sparsity tuning (DST, DESIGN.md section 5): with the assignment fixed, choose the
// step's target makespan T by mode, then per rank choose per-sample densities that bring the
// rank to T: stragglers are lowered (never below their floors), the other ranks are raised
// (up to density_max) so that their idle time buys attention recall.
//
//   std::vector<double> rho = TuneDensities(batch, assignment, config, model, base, recall);
#ifndef SPARSEBALANCE_PLANNER_SPARSITY_TUNER_H_
#define SPARSEBALANCE_PLANNER_SPARSITY_TUNER_H_

#include <cstdint>
#include <vector>

#include "planner/latency_model.h"
#include "planner/plan_threads.h"
#include "planner/recall_model.h"
#include "planner/sample_assigner.h"
#include "planner/sample_table.h"
#include "planner/types.h"

namespace sparsebalance {

// The step-level half of DST, run before placement by the sparsebalance policy so that SAB
// places samples by the cost they will have: the per-sample densities, each in
// [floor, density_max], with the least predicted attention time whose token-weighted
// predicted recall is at least that of `base` plus a small margin (0.001, or a tenth of the
// recall still missing if less) that the per-rank tuning may spend (one multiplier over the
// whole batch: long,
// insensitive documents go down, short or sensitive ones go up). `base_recall` is that
// recall (TokenWeightedRecall of `base`, which the caller has already). Returns `base` when
// no such densities exist. With `per_bucket` the same is done within each length bucket
// (recall_model.h) on its own, each keeping its own recall at base: density moves between
// documents of one bucket only (long ones pay most per unit of recall), so no bucket pays for
// another (the per-bucket guard's step-level half).
std::vector<double> AllocateDensities(const std::vector<Sample>& batch, const PlannerConfig& config,
                                      const LatencyModel& model, const RecallModel& recall,
                                      const std::vector<double>& base, double base_recall,
                                      bool per_bucket = false);
// The same with the step's SampleTable (PlanStep builds one for all phases), the per-sample
// work split over `threads` when given (the result does not depend on them).
std::vector<double> AllocateDensities(const std::vector<Sample>& batch, const PlannerConfig& config,
                                      const LatencyModel& model, const SampleTable& table,
                                      const std::vector<double>& base, double base_recall,
                                      bool per_bucket, PlanThreads* threads = nullptr);

// The per-rank half of DST: a density per batch sample (deferred samples keep `base`).
//
// Within a rank the densities maximise the predicted token-weighted recall for the rank's
// time budget: the marginal recall per second is equalised across samples (a water-filling
// over one multiplier), so cuts fall first on long, insensitive documents and raises first on
// short or sensitive ones. Stragglers only lower and the others only raise, each sample
// staying in [floor, base] or [base, density_max]. In every mode but kMin the predicted
// token-weighted recall of the result is at least `min_recall`, which must not exceed the
// recall at `base` (pure raising, the fallback, never loses recall): if the target would
// lose more, the target is raised until it does not.
//
// Both take the per-bucket guard: `bucket_min_recall` holds, per length bucket of
// recall_model.h (kRecallBuckets entries; negative: unguarded; empty: no guard), the least
// token-weighted recall the bucket's placed documents must keep, which `base` must meet. A
// bucket below it gets more weight in the trade-off (the constraint's multiplier) until it
// meets it; failing that, its samples keep at least their base densities. Not in kMin.
std::vector<double> TuneDensities(const std::vector<Sample>& batch, const Assignment& assignment,
                                  const PlannerConfig& config, const LatencyModel& model,
                                  const RecallModel& recall, const std::vector<double>& base,
                                  double min_recall,
                                  const std::vector<double>& bucket_min_recall = {});
// The same with the step's SampleTable (PlanStep builds one for all phases), the per-sample and
// per-rank work split over `threads` when given (the result does not depend on them).
std::vector<double> TuneDensities(const std::vector<Sample>& batch, const Assignment& assignment,
                                  const PlannerConfig& config, const LatencyModel& model,
                                  const SampleTable& table, const std::vector<double>& base,
                                  double min_recall, const std::vector<double>& bucket_min_recall,
                                  PlanThreads* threads = nullptr);

// Per-layer densities of one sample that DST gave `density`, from the job's per-layer recall
// curves: the densities in [floor, density_max] whose mean is `density` (so the attention cost
// stays about the same) and whose mean recall over the layers is the highest (water-filling:
// each layer gets density until an extra block buys the same recall in every layer). Empty when the
// model has no layer curves, the curves of the sample's layers are about equal (within 5%), or the
// shape has one layer.
std::vector<double> LayerDensities(const Sample& sample, double density, double floor,
                                   const PlannerConfig& config, const RecallModel& recall);

// The tuner's continuous estimate of ActiveBlocks for a document of `rows` query blocks at
// density rho in (0, 1], `anchors` (local_blocks + 2) blocks kept per row: row n keeps
// max(anchors, rho*n + 1/2) blocks (the exact count keeps max(anchors, ceil(rho*n))), summed
// over the rows. Continuous and monotone in rho, within half a block per row of the exact
// count and unbiased over densities; its derivative in rho goes to `slope` when given.
double EstimatedActiveBlocks(int64_t rows, double rho, double anchors, double* slope = nullptr);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_SPARSITY_TUNER_H_
