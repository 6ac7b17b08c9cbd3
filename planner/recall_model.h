// The planner's view of attention quality: recall curves learned from measured recall, the
// trainer's sensitivity as their prior, and per-sample density floors.
//
// Recall of a document at density rho is modelled as 1 - (1 - rho)^g. Workers measure the true
// recall (softmax mass kept) of documents on sampled query rows; RecallModel fits g per length
// bucket (four buckets relative to the micro-batch capacity C: [1, C/64), [C/64, C/16),
// [C/16, C/4), [C/4, C]; at C = 128K: <2K, 2K-8K, 8K-32K, 32K+) and, where workers measure
// layers, per bucket and layer. Each curve keeps, per density bin of width 0.05, the measured
// documents' mean recall and density (older steps forgotten geometrically), and g is the least
// squares fit of those means in recall space: fitting bin means, not each document's
// log(1 - recall), keeps a bucket's predicted mean recall unbiased when its documents differ
// (the log of a mean is not the mean of the logs). Before a bucket has measurements, g comes from
// the document's sensitivity s (the prior): g(s) = 1.25 + 4.75 (1 - s)^2, so a tolerant document (s
// = 0, g = 6) keeps 0.88 of its mass at rho = 0.3 and the most sensitive (s = 1, g = 1.25) only
// 0.36. The prior counts as `prior_documents` measured documents; the fit takes over as
// measurements come.
//
//   RecallModel recall(config.micro_batch_capacity, config.shape.layers);
//   double g = recall.Exponent(sample.length, sample.sensitivity);
//   absl::Status s = recall.ObserveStep(observations);  // after every reported step
//
// A sample's floor (the lowest density DST may give it) is
// density_min + s * (density_max - density_min): a sensitivity of 1 means dense attention.
// Its base density (what every policy gives it without tuning) is the job's default density,
// raised to the floor where the floor is higher.
#ifndef SPARSEBALANCE_PLANNER_RECALL_MODEL_H_
#define SPARSEBALANCE_PLANNER_RECALL_MODEL_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "planner/types.h"

namespace sparsebalance {

inline constexpr double kRecallExponentMin = 1.25;  // prior g at sensitivity 1
inline constexpr double kRecallExponentMax = 6.0;   // prior g at sensitivity 0
// Bounds of a learned g: 1 is recall = rho (no better than keeping blocks at random); 64 keeps
// 0.9999999 of the mass at rho = 0.22 (documents whose blocks are all anchors).
inline constexpr double kLearnedExponentMin = 1.0;
inline constexpr double kLearnedExponentMax = 64.0;

// The prior g(s) above; s is clamped to [0, 1]. Inline, as the functions below that the
// sample table asks for every sample of a step: the library is built -fPIC, so a call to an
// out-of-line definition is never inlined.
inline double RecallExponent(double sensitivity) {
  const double tolerance = 1.0 - std::clamp(sensitivity, 0.0, 1.0);
  return kRecallExponentMin + (kRecallExponentMax - kRecallExponentMin) * tolerance * tolerance;
}
// 1 - (1 - rho)^g, in [0, 1].
double RecallAt(double exponent, double density);
// RecallAt that keeps its last answer: the planner's loops over a batch call it with few
// distinct (exponent, density) pairs (one per length bucket and base density), and each call
// costs a DetLog and a DetExp. Exact: a repeat returns the value computed for the same bits.
class RecallAtMemo {
 public:
  double operator()(double exponent, double density) {
    if (!(exponent == exponent_ && density == density_)) {  // NaN at first: a miss
      exponent_ = exponent;
      density_ = density;
      value_ = RecallAt(exponent, density);
    }
    return value_;
  }

 private:
  double exponent_ = std::numeric_limits<double>::quiet_NaN();
  double density_ = std::numeric_limits<double>::quiet_NaN();
  double value_ = 0.0;
};
// 1 - (1 - rho)^g(s): the prior's recall.
double PredictedRecall(double sensitivity, double density);
// The density in [0, 1] at which 1 - (1 - rho)^g reaches `recall` (1 for recall >= 1).
double DensityForRecall(double exponent, double recall);

inline double DensityFloor(double sensitivity, const PlannerConfig& config) {
  const double s = std::clamp(sensitivity, 0.0, 1.0);
  // Written as a convex combination so that s = 0 and s = 1 give the bounds exactly.
  return (1.0 - s) * config.density_min + s * config.density_max;
}
inline double BaseDensity(double sensitivity, const PlannerConfig& config) {
  return std::clamp(std::max(config.density_default, DensityFloor(sensitivity, config)),
                    config.density_min, config.density_max);
}

// Length buckets, relative to the micro-batch capacity (see above).
inline constexpr int kRecallBuckets = 4;
// The lowest length of bucket k >= 1: the capacity split at C/64, C/16 and C/4 (at least 2).
inline int64_t RecallBucketEdge(int k, int64_t capacity) {
  constexpr int kShift[kRecallBuckets] = {0, 6, 4, 2};
  return std::max<int64_t>(2, capacity >> kShift[k]);
}
// The bucket of a document of `length` tokens. The edges never decrease, so the last edge at
// or below the length is the count of them; inline and without branches, as the planner asks
// several times for every document of a step.
inline int RecallBucket(int64_t length, int64_t capacity) {
  static_assert(kRecallBuckets == 4, "one comparison per edge below");
  return static_cast<int>(length >= RecallBucketEdge(1, capacity)) +
         static_cast<int>(length >= RecallBucketEdge(2, capacity)) +
         static_cast<int>(length >= RecallBucketEdge(3, capacity));
}
struct LengthRange {
  int64_t min = 1;  // tokens, inclusive
  int64_t max = 1;  // tokens, inclusive
};
LengthRange RecallBucketRange(int bucket, int64_t capacity);
// "<2K", "2K-8K", "8K-32K", "32K+" at capacity 128K (K = 1024 tokens, M = 1024 K).
std::string RecallBucketLabel(int bucket, int64_t capacity);

// One document's measured recall, as the planner folds it in.
struct RecallObservation {
  int64_t length = 0;    // the document's tokens, [1, kMaxShards x capacity]
  int layer = -1;        // 0-based model layer, or -1: all layers together
  double density = 0.0;  // (0, 1]: the density the plan gave it (in that layer)
  double recall = 0.0;   // [0, 1]: measured softmax mass kept
};

struct RecallModelOptions {
  double forgetting = 0.9;        // per step: older steps weigh forgetting^age in the fit
  double prior_documents = 16.0;  // weight of the sensitivity prior, in measured documents
};

// Density bins of a curve: [0, 0.05), [0.05, 0.1), ..., [0.95, 1].
inline constexpr int kRecallDensityBins = 20;

// What one curve keeps of its measurements, per density bin (plain so that the service can
// snapshot it); w is a document's weight (1, times forgetting^age).
struct RecallCurveSums {
  std::array<double, kRecallDensityBins> documents{};  // sum of w
  std::array<double, kRecallDensityBins> recall{};     // sum of w recall
  std::array<double, kRecallDensityBins> density{};    // sum of w rho
  double Documents() const;
  bool operator==(const RecallCurveSums& o) const {
    return documents == o.documents && recall == o.recall && density == o.density;
  }
};

struct RecallModelState {
  // (layers + 1) x kRecallBuckets, row-major: row 0 is all layers together, row 1 + l layer l.
  std::vector<RecallCurveSums> curves;
  int64_t steps_observed = 0;
};

// How Exponent mixes a curve's fitted g with the prior's: the fit weighs the curve's documents
// against `prior_documents`. Without a fit (or documents) g is the prior's.
struct ExponentBlend {
  double prior_documents = 0.0;
  double documents = 0.0;
  double fitted = 0.0;  // 0: no fit
  double operator()(double prior_exponent) const {
    if (!(fitted > 0.0) || !(documents > 0.0)) return prior_exponent;
    return (prior_documents * prior_exponent + documents * fitted) / (prior_documents + documents);
  }
};

// RecallModel's all-layers Exponent and SampleExponent, copied out of it (RecallModel::AllLayers)
// for a loop over a batch: one that stores doubles as it goes (the sample table) would otherwise
// load the model's fields again after every store, which might alias them.
class AllLayerExponents {
 public:
  // RecallBucket(length, capacity), from the edges kept here.
  int Bucket(int64_t length) const {
    return static_cast<int>(length >= edges_[0]) + static_cast<int>(length >= edges_[1]) +
           static_cast<int>(length >= edges_[2]);
  }
  // g of a document of length bucket `bucket`.
  double InBucket(int bucket, double sensitivity) const {
    return blends_[bucket](RecallExponent(sensitivity));
  }
  double Exponent(int64_t length, double sensitivity) const {
    return InBucket(Bucket(length), sensitivity);
  }
  double SampleExponent(const Sample& sample) const {
    if (sample.segments.empty()) return Exponent(sample.length, sample.sensitivity);
    double weighted = 0.0;
    for (int64_t segment : sample.segments) {
      weighted += static_cast<double>(segment) * Exponent(segment, sample.sensitivity);
    }
    return weighted / static_cast<double>(sample.length);
  }

 private:
  friend class RecallModel;
  std::array<int64_t, kRecallBuckets - 1> edges_{};  // RecallBucketEdge(1..3, capacity)
  std::array<ExponentBlend, kRecallBuckets> blends_{};
};

// What GetJob shows of one curve.
struct RecallCurveSummary {
  int bucket = 0;
  std::optional<int> layer;  // empty: all layers
  double exponent = 0.0;     // for a document of sensitivity 0
  double documents = 0.0;
  double measured_recall = 0.0;  // mean, 0 without documents
  double measured_density = 0.0;
};

class RecallModel;

// The index of the curve of length bucket `bucket` and `layer` (-1: all layers together) in
// RecallModelState::curves.
inline size_t RecallCurveIndex(int bucket, int layer) {
  return static_cast<size_t>(layer + 1) * kRecallBuckets + bucket;
}

// One step's recall measurements as ObserveStep folds them in: per curve and density bin, how
// many were measured and their recalls' and densities' sums. The sums are exact (fixed point,
// each value rounded down to a multiple of 2^-60), so they do not depend on the order the
// measurements came in: the service adds each report's measurements as the report is taken, in
// whatever order the ranks report, and folds the same state as from the reports in rank order
// (and after a restart, from its report logs). Adding checks each measurement as ObserveStep
// does, so that a caller with many folds them without a vector of them: a step whose workers
// measure every document in every layer (sb-worker's probe) has one all-layers and one
// per-layer measurement per document, 2.2 million at 65,536 documents of 32 layers.
//
//   RecallStepSums step(model);
//   for (...) if (absl::Status s = step.Add(o); !s.ok()) ...;  // nothing folded
//   model.ObserveStep(step);
class RecallStepSums {
 public:
  // Sums for a model of `model`'s capacity and layers (ObserveStep(step) folds them into it).
  explicit RecallStepSums(const RecallModel& model);

  // Adds one measurement, numbered by how many came before it. INVALID_ARGUMENT naming
  // `observations[i].<field>` as ObserveStep's, and nothing added, if it is outside the bounds
  // ObserveStep checks.
  absl::Status Add(const RecallObservation& o) { return AddAt(BucketOf(o), o); }
  // A document's measurements at once, numbered in this order: its all-layers recall at
  // `density`, then layer l's recall layer_recall[l] at layer_densities[l] (at `density` where
  // layer_densities is not one per layer). Checked as Add checks each; on an error, the
  // measurements before it stay added.
  absl::Status AddDocument(int64_t length, double density, double recall,
                           const std::vector<double>& layer_densities,
                           const std::vector<double>& layer_recall);
  // The measurements added.
  size_t size() const { return count_; }
  int64_t capacity() const { return capacity_; }  // the model's

 private:
  friend class RecallModel;
  // What the measurements of one density bin of one curve add up to: their count, and their
  // recalls and densities in units of 2^-60 (each at most 2^60: no sum of fewer than 2^67 of
  // them overflows).
  struct Bin {
    uint64_t documents = 0;
    unsigned __int128 recall = 0;
    unsigned __int128 density = 0;
  };
  // RecallBucket of the length, or -1 when the length is out of bounds (AddAt names it).
  int BucketOf(const RecallObservation& o) const;
  absl::Status AddAt(int bucket, const RecallObservation& o);
  // Adds a measurement known to be valid to the bin of `density` of the curve whose bins start
  // at `curve`.
  static void AddTo(Bin* curve, double density, double recall);

  int64_t capacity_;
  int layers_;
  // Curve c's bins at [c * kRecallDensityBins, (c + 1) * kRecallDensityBins), curves numbered as
  // RecallModelState::curves (RecallCurveIndex).
  std::vector<Bin> bins_;
  size_t count_ = 0;
};

class RecallModel {
 public:
  // `capacity` is the micro-batch capacity (tokens), `layers` the model's layer count.
  RecallModel(int64_t capacity, int layers, const RecallModelOptions& options = {});

  int64_t capacity() const { return capacity_; }
  int layers() const { return layers_; }
  const RecallModelState& state() const { return state_; }
  // INVALID_ARGUMENT when the state's shape does not match the model's or a sum is not finite.
  absl::Status set_state(const RecallModelState& state);

  // g of a document of `length` tokens and trainer-given `sensitivity`, all layers together.
  double Exponent(int64_t length, double sensitivity) const {
    return Mixed(CurveIndex(RecallBucket(length, capacity_), -1), RecallExponent(sensitivity));
  }
  // g of one layer: the bucket's layer curve, with the all-layers curve as its prior.
  double LayerExponent(int64_t length, double sensitivity, int layer) const;
  // LayerExponent(length, sensitivity, l) of every layer l into g[0, layers()).
  void LayerExponents(int64_t length, double sensitivity, double* g) const;
  // Whether any layer curve has measurements (so per-layer densities can be planned).
  bool HasLayerCurves() const;
  // One g for a sample: its documents' exponents, token-weighted (a pre-packed sample's
  // documents share one density, and the tuner works with one curve per sample).
  double SampleExponent(const Sample& sample) const { return AllLayers().SampleExponent(sample); }
  // Exponent and SampleExponent's curves, for a loop over a batch's samples.
  AllLayerExponents AllLayers() const {
    AllLayerExponents out;
    for (int b = 1; b < kRecallBuckets; ++b) out.edges_[b - 1] = RecallBucketEdge(b, capacity_);
    for (int b = 0; b < kRecallBuckets; ++b) out.blends_[b] = Blend(CurveIndex(b, -1));
    return out;
  }
  // RecallAt(SampleExponent(sample), density): the recall every planner figure uses.
  double SampleRecall(const Sample& sample, double density) const;

  // Folds one step's measurements in (after forgetting the older ones by one step). The whole
  // step is refused, naming observations[i] and the field, if a length is outside
  // [1, kMaxShards x capacity] (a split document may exceed the capacity), a layer outside [-1,
  // layers), a density outside (0, 1] or a recall outside [0, 1] (or not finite); nothing is folded
  // in then.
  absl::Status ObserveStep(const std::vector<RecallObservation>& observations);
  // The same with the measurements summed already (RecallStepSums, made for a model of this
  // one's shape: INVALID_ARGUMENT, and nothing folded, for sums of another shape). The order
  // the measurements were added in does not change the result.
  absl::Status ObserveStep(const RecallStepSums& step);

  std::vector<RecallCurveSummary> Curves() const;

 private:
  size_t CurveIndex(int bucket, int layer) const { return RecallCurveIndex(bucket, layer); }
  ExponentBlend Blend(size_t curve) const {
    return {options_.prior_documents, documents_[curve], fitted_[curve]};
  }
  double Mixed(size_t curve, double prior_exponent) const { return Blend(curve)(prior_exponent); }
  friend class RecallStepSums;
  // Refits fitted_[curve] from its sums.
  void Fit(size_t curve);
  // documents_ from the sums, every curve (after any change of them).
  void CountDocuments();

  int64_t capacity_;
  int layers_;
  RecallModelOptions options_;
  RecallModelState state_;
  std::vector<double> fitted_;  // per curve: the least-squares g of its bins (0: no data)
  // Per curve: its sums' Documents(), kept with them: Mixed runs for every exponent the planner
  // asks for (several per sample and step), and summing the bins each time cost more than the
  // rest of it.
  std::vector<double> documents_;
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_RECALL_MODEL_H_
