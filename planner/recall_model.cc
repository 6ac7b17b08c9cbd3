#include "planner/recall_model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "planner/det_math.h"

namespace sparsebalance {
namespace {

// Recall is clamped below 1 - kRecallClamp before its log is taken: a measured recall of 1
// (every block of a short document is an anchor) says "g is large", not "g is infinite".
constexpr double kRecallClamp = 1e-4;
// Observations at densities above this carry no information about g (recall is 1 at 1).
constexpr double kMaxFittedDensity = 0.95;

// Buckets split the capacity C at C/64, C/16 and C/4.
int64_t BucketEdge(int k, int64_t capacity) {  // lowest length of bucket k >= 1
  static constexpr int kShift[kRecallBuckets] = {0, 6, 4, 2};
  return std::max<int64_t>(2, capacity >> kShift[k]);
}

std::string Tokens(int64_t n) {
  if (n >= (int64_t{1} << 20) && n % (int64_t{1} << 20) == 0) return absl::StrCat(n >> 20, "M");
  if (n >= 1024 && n % 1024 == 0) return absl::StrCat(n >> 10, "K");
  return absl::StrCat(n);
}

}  // namespace

double RecallExponent(double sensitivity) {
  const double tolerance = 1.0 - std::clamp(sensitivity, 0.0, 1.0);
  return kRecallExponentMin + (kRecallExponentMax - kRecallExponentMin) * tolerance * tolerance;
}

double RecallAt(double exponent, double density) {
  const double rho = std::clamp(density, 0.0, 1.0);
  return 1.0 - DetPow(1.0 - rho, exponent);
}

double PredictedRecall(double sensitivity, double density) {
  return RecallAt(RecallExponent(sensitivity), density);
}

double DensityForRecall(double exponent, double recall) {
  if (recall >= 1.0) return 1.0;
  if (recall <= 0.0) return 0.0;
  return 1.0 - DetPow(1.0 - recall, 1.0 / exponent);
}

double DensityFloor(double sensitivity, const PlannerConfig& config) {
  const double s = std::clamp(sensitivity, 0.0, 1.0);
  // Written as a convex combination so that s = 0 and s = 1 give the bounds exactly.
  return (1.0 - s) * config.density_min + s * config.density_max;
}

double BaseDensity(double sensitivity, const PlannerConfig& config) {
  return std::clamp(std::max(config.density_default, DensityFloor(sensitivity, config)),
                    config.density_min, config.density_max);
}

int RecallBucket(int64_t length, int64_t capacity) {
  int bucket = 0;
  for (int k = 1; k < kRecallBuckets; ++k) {
    if (length >= BucketEdge(k, capacity)) bucket = k;
  }
  return bucket;
}

LengthRange RecallBucketRange(int bucket, int64_t capacity) {
  LengthRange range;
  range.min = bucket == 0 ? 1 : BucketEdge(bucket, capacity);
  range.max = bucket + 1 < kRecallBuckets ? BucketEdge(bucket + 1, capacity) - 1 : capacity;
  return range;
}

std::string RecallBucketLabel(int bucket, int64_t capacity) {
  if (bucket == 0) return absl::StrCat("<", Tokens(BucketEdge(1, capacity)));
  if (bucket + 1 == kRecallBuckets) return absl::StrCat(Tokens(BucketEdge(bucket, capacity)), "+");
  return absl::StrCat(Tokens(BucketEdge(bucket, capacity)), "-",
                      Tokens(BucketEdge(bucket + 1, capacity)));
}

RecallModel::RecallModel(int64_t capacity, int layers, const RecallModelOptions& options)
    : capacity_(capacity), layers_(std::max(layers, 0)), options_(options) {
  state_.curves.assign(static_cast<size_t>(layers_ + 1) * kRecallBuckets, RecallCurveSums{});
}

absl::Status RecallModel::set_state(const RecallModelState& state) {
  const size_t want = static_cast<size_t>(layers_ + 1) * kRecallBuckets;
  if (state.curves.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat("recall model state has ", state.curves.size(),
                                                   " curves; a model of ", layers_, " layers has ",
                                                   want));
  }
  for (size_t i = 0; i < state.curves.size(); ++i) {
    const RecallCurveSums& c = state.curves[i];
    for (double v : {c.xx, c.xy, c.documents, c.recall, c.density}) {
      if (!std::isfinite(v) || v < 0) {
        return absl::InvalidArgumentError(absl::StrCat("recall model state: curves[", i, "] holds ",
                                                       v,
                                                       "; sums must be finite and non-negative"));
      }
    }
  }
  state_ = state;
  return absl::OkStatus();
}

const RecallCurveSums& RecallModel::Sums(int bucket, int layer) const {
  return state_.curves[static_cast<size_t>(layer + 1) * kRecallBuckets + bucket];
}

double RecallModel::Mixed(const RecallCurveSums& sums, double prior_exponent) const {
  if (!(sums.xx > 0.0) || !(sums.documents > 0.0)) return prior_exponent;
  const double fitted = std::clamp(sums.xy / sums.xx, kLearnedExponentMin, kLearnedExponentMax);
  const double w0 = options_.prior_documents;
  return (w0 * prior_exponent + sums.documents * fitted) / (w0 + sums.documents);
}

double RecallModel::Exponent(int64_t length, double sensitivity) const {
  return Mixed(Sums(RecallBucket(length, capacity_), -1), RecallExponent(sensitivity));
}

double RecallModel::LayerExponent(int64_t length, double sensitivity, int layer) const {
  const int bucket = RecallBucket(length, capacity_);
  const double all = Exponent(length, sensitivity);
  if (layer < 0 || layer >= layers_) return all;
  return Mixed(Sums(bucket, layer), all);
}

bool RecallModel::HasLayerCurves() const {
  for (size_t i = kRecallBuckets; i < state_.curves.size(); ++i) {
    if (state_.curves[i].documents > 0.0) return true;
  }
  return false;
}

double RecallModel::SampleRecall(const Sample& sample, double density) const {
  return RecallAt(SampleExponent(sample), density);
}

double RecallModel::SampleExponent(const Sample& sample) const {
  if (sample.segments.empty()) return Exponent(sample.length, sample.sensitivity);
  double weighted = 0.0;
  for (int64_t segment : sample.segments) {
    weighted += static_cast<double>(segment) * Exponent(segment, sample.sensitivity);
  }
  return weighted / static_cast<double>(sample.length);
}

absl::Status RecallModel::ObserveStep(const std::vector<RecallObservation>& observations) {
  for (size_t i = 0; i < observations.size(); ++i) {
    const RecallObservation& o = observations[i];
    auto error = [&](absl::string_view field, const auto&... what) {
      return absl::InvalidArgumentError(
          absl::StrCat("observations[", i, "].", field, ": ", what...));
    };
    if (o.length < 1 || o.length > capacity_) {
      return error("length", o.length, " tokens is outside [1, ", capacity_, "]");
    }
    if (o.layer < -1 || o.layer >= layers_) {
      return error("layer", o.layer, " is outside [-1, ", layers_, ")");
    }
    if (!(o.density > 0.0 && o.density <= 1.0)) {
      return error("density", o.density, " is outside (0, 1]");
    }
    if (!(o.recall >= 0.0 && o.recall <= 1.0)) {
      return error("recall", o.recall, " is outside [0, 1]");
    }
  }
  for (RecallCurveSums& c : state_.curves) {
    const double f = options_.forgetting;
    c = {c.xx * f, c.xy * f, c.documents * f, c.recall * f, c.density * f};
  }
  for (const RecallObservation& o : observations) {
    if (o.density > kMaxFittedDensity) continue;
    const double x = DetLog(1.0 - o.density);
    const double y = DetLog(std::max(1.0 - o.recall, kRecallClamp));
    RecallCurveSums& c = state_.curves[static_cast<size_t>(o.layer + 1) * kRecallBuckets +
                                       RecallBucket(o.length, capacity_)];
    c.xx += x * x;
    c.xy += x * y;
    c.documents += 1.0;
    c.recall += o.recall;
    c.density += o.density;
  }
  ++state_.steps_observed;
  return absl::OkStatus();
}

std::vector<RecallCurveSummary> RecallModel::Curves() const {
  std::vector<RecallCurveSummary> out;
  for (int layer = -1; layer < layers_; ++layer) {
    for (int b = 0; b < kRecallBuckets; ++b) {
      const RecallCurveSums& c = Sums(b, layer);
      if (layer >= 0 && !(c.documents > 0.0)) continue;
      RecallCurveSummary s;
      s.bucket = b;
      if (layer >= 0) s.layer = layer;
      s.exponent = layer < 0 ? Exponent(RecallBucketRange(b, capacity_).min, 0.0)
                             : LayerExponent(RecallBucketRange(b, capacity_).min, 0.0, layer);
      s.documents = c.documents;
      s.measured_recall = c.documents > 0 ? c.recall / c.documents : 0.0;
      s.measured_density = c.documents > 0 ? c.density / c.documents : 0.0;
      out.push_back(s);
    }
  }
  return out;
}

}  // namespace sparsebalance
