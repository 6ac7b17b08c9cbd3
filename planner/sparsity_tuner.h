// Dynamic sparsity tuning (DST, DESIGN.md section 5): with the assignment fixed, choose the
// step's target makespan T by mode, then per rank choose per-sample densities that bring the
// rank to T: stragglers are lowered (never below their floors), the other ranks are raised
// (up to density_max) so that their idle time buys attention recall.
//
//   std::vector<double> rho = TuneDensities(batch, assignment, config, model, base, recall);
#ifndef SPARSEBALANCE_PLANNER_SPARSITY_TUNER_H_
#define SPARSEBALANCE_PLANNER_SPARSITY_TUNER_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "planner/latency_model.h"
#include "planner/plan_threads.h"
#include "planner/recall_model.h"
#include "planner/sample_assigner.h"
#include "planner/sample_table.h"
#include "planner/thread_scratch.h"
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
// With `samples`, the tuner's set-up reads each sample's record there (TunerSamples, below,
// filled for every sample of the batch from `table`, `config` and this `base`) instead of the
// table.
class TunerSamples;
std::vector<double> TuneDensities(const std::vector<Sample>& batch, const Assignment& assignment,
                                  const PlannerConfig& config, const LatencyModel& model,
                                  const SampleTable& table, const std::vector<double>& base,
                                  double min_recall, const std::vector<double>& bucket_min_recall,
                                  PlanThreads* threads = nullptr,
                                  const TunerSamples* samples = nullptr);

// What the tuner's set-up reads of one sample at its base density, which depends on neither the
// assignment nor the bucket weights: 64 bytes, one cache line (sparsity_tuner.cc).
struct alignas(64) TunerSample {
  double floor = 0.0;  // lowest density: the table's floor, or the base where that is higher
  double base = 0.0;
  double g_minus_1 = 0.0;  // recall exponent - 1
  double log_floor = 0.0;  // LogOneMinus(floor)
  double log_base = 0.0;   // LogOneMinus(base)
  double offset = 0.0;     // SampleTerms::price_offset
  double weight = 0.0;     // tokens
  int doc_begin = 0;       // its documents in the table's document arrays
  // The end of its documents where it has several (> doc_begin + 1); where it has one, ~bucket
  // (< 0), the length bucket of that document (recall_model.h): 4 more bytes would make a
  // record span two cache lines.
  int doc_end_or_bucket = 0;
  int doc_end() const { return doc_end_or_bucket < 0 ? doc_begin + 1 : doc_end_or_bucket; }
  int bucket() const { return doc_end_or_bucket < 0 ? ~doc_end_or_bucket : -1; }
};

// Per-sample records for TuneDensities' set-up, filled ahead in batch order, block by block, where
// the work beside them leaves a thread idle (PlanStep fills them beside the placement's serial
// sort and deal). The set-up walks the samples in placement order, scattered over the batch:
// reading a record there is one cache miss per sample where reading the table is about four (its
// terms' two lines, its base density, its document's tokens and bucket).
class TunerSamples {
 public:
  // Room for `n` samples, in storage kept per thread between steps (as the tuner's own) when it
  // is free.
  explicit TunerSamples(size_t n);
  TunerSamples(const TunerSamples&) = delete;
  TunerSamples& operator=(const TunerSamples&) = delete;
  // Fills the records of samples [begin, end) at densities `base`; ranges may be filled from
  // several threads at once.
  void Fill(const SampleTable& table, const PlannerConfig& config, const std::vector<double>& base,
            size_t begin, size_t end);
  const TunerSample& operator[](size_t i) const { return records_[i]; }

 private:
  struct Storage {
    std::vector<TunerSample> records;
  };
  ThreadScratch<Storage> storage_;
  TunerSample* records_ = nullptr;
};

// Per-layer densities of one sample that DST gave `density`, from the job's per-layer recall
// curves: the densities in [floor, density_max] whose mean is `density` (so the attention cost
// stays about the same) and whose mean recall over the layers is the highest (water-filling:
// each layer gets density until an extra block buys the same recall in every layer). Empty when the
// model has no layer curves, the curves of the sample's layers are about equal (within 5%), or the
// shape has one layer.
std::vector<double> LayerDensities(const Sample& sample, double density, double floor,
                                   const PlannerConfig& config, const RecallModel& recall);
// The same written over `densities` (emptied when there are none): BuildPlan fills each planned
// sample's in place, without a vector made and moved in per sample.
void LayerDensities(const Sample& sample, double density, double floor, const PlannerConfig& config,
                    const RecallModel& recall, std::vector<double>* densities);

// The most layer densities one plan gives its samples in all (samples x layers): 2^25, a step
// of 2^20 samples (the service's --max_samples) of a 32-layer model. Each is a double in the
// plan, in every rank's plan message and in the step record: a job created with 4,096 layers
// asked 72 KB of memory per sample of its steps (1.2 GB for 16,384 samples, most of it written
// and fsync'ed), where a sample of the request takes a few bytes. A larger step is planned with
// one density per sample, kept in every layer.
inline constexpr int64_t kMaxPlannedLayerDensities = int64_t{1} << 25;

// Whether a plan of `samples` samples of `config` with `recall` gives its samples per-layer
// densities: a tuned policy (DST spreads a sample's density over the layers) once the job has
// learned per-layer curves, unless samples x layers is above kMaxPlannedLayerDensities.
bool PlansLayerDensities(const PlannerConfig& config, const RecallModel& recall, size_t samples);
// A planned sample's layer densities as BuildPlan gives them (where PlansLayerDensities):
// LayerDensities of its batch sample at its planned density, its floor the lower of the
// sample's and that density. Packed steps compute them again with it (server/step_pack.h).
void PlannedLayerDensities(const Sample& sample, double density, const PlannerConfig& config,
                           const RecallModel& recall, std::vector<double>* densities);

// The tuner's continuous estimate of ActiveBlocks for a document of `rows` query blocks at
// density rho in (0, 1], `anchors` (local_blocks + 2) blocks kept per row: row n keeps
// max(anchors, rho*n + 1/2) blocks (the exact count keeps max(anchors, ceil(rho*n))), summed
// over the rows. Continuous and monotone in rho, within half a block per row of the exact
// count and unbiased over densities; its derivative in rho goes to `slope` when given.
double EstimatedActiveBlocks(int64_t rows, double rho, double anchors, double* slope = nullptr);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_SPARSITY_TUNER_H_
