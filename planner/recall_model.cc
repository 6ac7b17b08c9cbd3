#include "planner/recall_model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "planner/det_math.h"

namespace sparsebalance {
namespace {

std::string Tokens(int64_t n) {
  if (n >= (int64_t{1} << 20) && n % (int64_t{1} << 20) == 0) return absl::StrCat(n >> 20, "M");
  if (n >= 1024 && n % 1024 == 0) return absl::StrCat(n >> 10, "K");
  return absl::StrCat(n);
}

}  // namespace

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

LengthRange RecallBucketRange(int bucket, int64_t capacity) {
  LengthRange range;
  range.min = bucket == 0 ? 1 : RecallBucketEdge(bucket, capacity);
  range.max = bucket + 1 < kRecallBuckets ? RecallBucketEdge(bucket + 1, capacity) - 1 : capacity;
  return range;
}

std::string RecallBucketLabel(int bucket, int64_t capacity) {
  if (bucket == 0) return absl::StrCat("<", Tokens(RecallBucketEdge(1, capacity)));
  if (bucket + 1 == kRecallBuckets)
    return absl::StrCat(Tokens(RecallBucketEdge(bucket, capacity)), "+");
  return absl::StrCat(Tokens(RecallBucketEdge(bucket, capacity)), "-",
                      Tokens(RecallBucketEdge(bucket + 1, capacity)));
}

double RecallCurveSums::Documents() const {
  double sum = 0.0;
  for (double w : documents) sum += w;
  return sum;
}

RecallModel::RecallModel(int64_t capacity, int layers, const RecallModelOptions& options)
    : capacity_(capacity), layers_(std::max(layers, 0)), options_(options) {
  state_.curves.assign(static_cast<size_t>(layers_ + 1) * kRecallBuckets, RecallCurveSums{});
  fitted_.assign(state_.curves.size(), 0.0);
  documents_.assign(state_.curves.size(), 0.0);
}

void RecallModel::CountDocuments() {
  documents_.resize(state_.curves.size());
  for (size_t i = 0; i < state_.curves.size(); ++i) documents_[i] = state_.curves[i].Documents();
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
    for (int b = 0; b < kRecallDensityBins; ++b) {
      // A bin's sums are means times its weight: recall and density at most the weight.
      const double w = c.documents[b];
      if (!std::isfinite(w) || w < 0 || !(c.recall[b] >= 0 && c.recall[b] <= w * (1 + 1e-9)) ||
          !(c.density[b] >= 0 && c.density[b] <= w * (1 + 1e-9))) {
        return absl::InvalidArgumentError(
            absl::StrCat("recall model state: curves[", i, "] bin ", b,
                         " is not a finite weight with recall and density sums in [0, weight]"));
      }
    }
  }
  state_ = state;
  for (size_t i = 0; i < state_.curves.size(); ++i) Fit(i);
  CountDocuments();
  return absl::OkStatus();
}

void RecallModel::Fit(size_t curve) {
  const RecallCurveSums& c = state_.curves[curve];
  // Bin means: the least squares below fits these, each weighted by its documents.
  double weights[kRecallDensityBins];
  double recalls[kRecallDensityBins];
  double logs[kRecallDensityBins];  // log(1 - mean density)
  int bins = 0;
  for (int b = 0; b < kRecallDensityBins; ++b) {
    const double w = c.documents[b];
    if (!(w > 0)) continue;
    const double rho = c.density[b] / w;
    if (rho >= 1.0 - 1e-9) continue;  // recall is 1 at density 1 whatever g is
    weights[bins] = w;
    recalls[bins] = c.recall[b] / w;
    logs[bins] = DetLog(1.0 - rho);
    ++bins;
  }
  if (bins == 0) {
    fitted_[curve] = 0.0;
    return;
  }
  // Squared error of the bin means at exponent e^t; golden-section search over t.
  auto error = [&](double t) {
    const double g = DetExp(t);
    double sum = 0.0;
    for (int k = 0; k < bins; ++k) {
      const double miss = recalls[k] - (1.0 - DetExp(g * logs[k]));
      sum += weights[k] * miss * miss;
    }
    return sum;
  };
  const double kGolden = 0.6180339887498949;
  double a = DetLog(kLearnedExponentMin);
  double b = DetLog(kLearnedExponentMax);
  double x1 = b - kGolden * (b - a);
  double x2 = a + kGolden * (b - a);
  double f1 = error(x1);
  double f2 = error(x2);
  for (int iter = 0; iter < 80 && b - a > 1e-10; ++iter) {
    if (f1 <= f2) {
      b = x2;
      x2 = x1;
      f2 = f1;
      x1 = b - kGolden * (b - a);
      f1 = error(x1);
    } else {
      a = x1;
      x1 = x2;
      f1 = f2;
      x2 = a + kGolden * (b - a);
      f2 = error(x2);
    }
  }
  fitted_[curve] = std::clamp(DetExp(0.5 * (a + b)), kLearnedExponentMin, kLearnedExponentMax);
}

double RecallModel::LayerExponent(int64_t length, double sensitivity, int layer) const {
  const double all = Exponent(length, sensitivity);
  if (layer < 0 || layer >= layers_) return all;
  return Mixed(CurveIndex(RecallBucket(length, capacity_), layer), all);
}

void RecallModel::LayerExponents(int64_t length, double sensitivity, double* g) const {
  const int bucket = RecallBucket(length, capacity_);
  const double all = Mixed(CurveIndex(bucket, -1), RecallExponent(sensitivity));  // Exponent
  for (int layer = 0; layer < layers_; ++layer) g[layer] = Mixed(CurveIndex(bucket, layer), all);
}

bool RecallModel::HasLayerCurves() const {
  for (size_t i = kRecallBuckets; i < state_.curves.size(); ++i) {
    if (documents_[i] > 0.0) return true;
  }
  return false;
}

double RecallModel::SampleRecall(const Sample& sample, double density) const {
  return RecallAt(SampleExponent(sample), density);
}

RecallStepSums::RecallStepSums(const RecallModel& model)
    : capacity_(model.capacity_),
      layers_(model.layers_),
      bins_(model.state_.curves.size() * kRecallDensityBins) {}

int RecallStepSums::BucketOf(const RecallObservation& o) const {
  // A document split over ranks (context parallelism) may be up to kMaxShards capacities.
  if (o.length < 1 || o.length > capacity_ * kMaxShards) return -1;
  return RecallBucket(o.length, capacity_);
}

inline void RecallStepSums::AddTo(Bin* curve, double density, double recall) {
  constexpr double kUnit = 0x1p60;  // fixed point: values in [0, 1] to [0, 2^60], truncated
  Bin& bin =
      curve[std::min(kRecallDensityBins - 1, static_cast<int>(density * kRecallDensityBins))];
  ++bin.documents;
  bin.recall += static_cast<uint64_t>(static_cast<int64_t>(recall * kUnit));
  bin.density += static_cast<uint64_t>(static_cast<int64_t>(density * kUnit));
}

absl::Status RecallStepSums::AddAt(int bucket, const RecallObservation& o) {
  auto error = [&](absl::string_view field, const auto&... what) {
    return absl::InvalidArgumentError(
        absl::StrCat("observations[", count_, "].", field, ": ", what...));
  };
  if (bucket < 0) {
    return error("length", o.length, " tokens is outside [1, ", kMaxShards, " x ", capacity_, "]");
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
  AddTo(&bins_[RecallCurveIndex(bucket, o.layer) * kRecallDensityBins], o.density, o.recall);
  ++count_;
  return absl::OkStatus();
}

absl::Status RecallStepSums::AddDocument(int64_t length, double density, double recall,
                                         const std::vector<double>& layer_densities,
                                         const std::vector<double>& layer_recall) {
  RecallObservation o{length, -1, density, recall};
  const int bucket = BucketOf(o);  // once for the document's layers
  if (absl::Status s = AddAt(bucket, o); !s.ok()) return s;
  const size_t layers = layer_recall.size();
  // Layer l's density: layer_densities[l], or `density` in every layer (a stride of 0).
  const bool per_layer = layer_densities.size() == layers;
  const double* const densities = per_layer ? layer_densities.data() : &density;
  const size_t stride = per_layer ? 1 : 0;
  // The layers' measurements added as AddAt adds them, their layer known to be in range, each
  // other check made as one test per layer; AddAt itself takes the first one that fails, which
  // names it. (AddAt per layer, with its error path, was most of the fold of a step whose
  // 65,536 documents each measured 32 layers.)
  size_t valid = std::min(layers, static_cast<size_t>(layers_));  // past it: out of range
  Bin* const first = &bins_[RecallCurveIndex(bucket, 0) * kRecallDensityBins];
  for (size_t l = 0; l < valid; ++l) {
    const double d = densities[l * stride];
    const double r = layer_recall[l];
    if (!(d > 0.0 && d <= 1.0 && r >= 0.0 && r <= 1.0)) {
      valid = l;
      break;
    }
    AddTo(first + l * kRecallBuckets * kRecallDensityBins, d, r);  // RecallCurveIndex(bucket, l)
  }
  count_ += valid;
  if (valid == layers) return absl::OkStatus();
  o.layer = static_cast<int>(valid);
  o.density = densities[valid * stride];
  o.recall = layer_recall[valid];
  return AddAt(bucket, o);  // refuses it (a bad value, or the layer past the model's), naming it
}

absl::Status RecallModel::ObserveStep(const std::vector<RecallObservation>& observations) {
  RecallStepSums step(*this);
  for (const RecallObservation& o : observations) {
    if (absl::Status s = step.Add(o); !s.ok()) return s;
  }
  return ObserveStep(step);
}

absl::Status RecallModel::ObserveStep(const RecallStepSums& step) {
  if (step.bins_.size() != state_.curves.size() * kRecallDensityBins ||
      step.capacity_ != capacity_ || step.layers_ != layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("recall step sums are for capacity ", step.capacity_, " and ", step.layers_,
                     " layers, the model for ", capacity_, " and ", layers_));
  }
  // Every curve forgets by one step; those measured this step get the step's sums and a new fit
  // (forgetting scales every bin of a curve alike, which leaves its fit as it was).
  constexpr double kUnit = 0x1p-60;  // RecallStepSums' fixed point
  const double forgetting = options_.forgetting;
  for (size_t i = 0; i < state_.curves.size(); ++i) {
    RecallCurveSums& c = state_.curves[i];
    const RecallStepSums::Bin* const bins = &step.bins_[i * kRecallDensityBins];
    bool measured = false;
    for (int b = 0; b < kRecallDensityBins; ++b) {
      c.documents[b] *= forgetting;
      c.recall[b] *= forgetting;
      c.density[b] *= forgetting;
      if (bins[b].documents == 0) continue;
      measured = true;
      c.documents[b] += static_cast<double>(bins[b].documents);
      c.recall[b] += static_cast<double>(bins[b].recall) * kUnit;
      c.density[b] += static_cast<double>(bins[b].density) * kUnit;
    }
    if (measured) Fit(i);
  }
  CountDocuments();  // every curve's weights decayed
  ++state_.steps_observed;
  return absl::OkStatus();
}

std::vector<RecallCurveSummary> RecallModel::Curves() const {
  std::vector<RecallCurveSummary> out;
  for (int layer = -1; layer < layers_; ++layer) {
    for (int b = 0; b < kRecallBuckets; ++b) {
      const RecallCurveSums& c = state_.curves[CurveIndex(b, layer)];
      const double documents = c.Documents();
      if (layer >= 0 && !(documents > 0.0)) continue;
      RecallCurveSummary s;
      s.bucket = b;
      if (layer >= 0) s.layer = layer;
      const int64_t length = RecallBucketRange(b, capacity_).min;
      s.exponent = layer < 0 ? Exponent(length, 0.0) : LayerExponent(length, 0.0, layer);
      s.documents = documents;
      double recall = 0.0;
      double density = 0.0;
      for (int k = 0; k < kRecallDensityBins; ++k) {
        recall += c.recall[k];
        density += c.density[k];
      }
      s.measured_recall = documents > 0 ? recall / documents : 0.0;
      s.measured_density = documents > 0 ? density / documents : 0.0;
      out.push_back(s);
    }
  }
  return out;
}

}  // namespace sparsebalance
