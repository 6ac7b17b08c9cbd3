#include "planner/latency_model.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "contract/block_geometry.h"

namespace sparsebalance {
namespace {

// Feature order: active blocks, tokens, documents, micro-batch (constant 1).
constexpr int kFeatures = 4;
// Prior uncertainty of each weight (relative): the profile may be off by about 100%.
constexpr double kPriorVariance = 1.0;
// Upper bound on a weight's variance under forgetting. Large enough that terms the prior lacks
// (the per-micro-batch overhead) are learned, small enough that noisy steps of near-identical
// micro-batches (balanced plans excite the model poorly) cannot make the weights swing: at
// 1e4 the prediction error of balanced policies in sb-sim rose from 2% to 16%.
constexpr double kMaxVariance = 100;
// Weight of the exchange rate's prior, in measured micro-batches.
constexpr double kExchangePriorObservations = 4.0;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Features of one sample of `length` tokens (documents: `segments`, or one) at `density`.
MicroBatchFeatures Features(const ModelShape& shape, int64_t length,
                            const std::vector<int64_t>& segments, double density) {
  MicroBatchFeatures f;
  f.tokens = static_cast<double>(length);
  if (segments.empty()) {
    f.active_blocks =
        static_cast<double>(ActiveBlocks(length, density, shape.block_size, shape.local_blocks));
    f.documents = 1.0;
  } else {
    for (int64_t segment : segments) {
      f.active_blocks +=
          static_cast<double>(ActiveBlocks(segment, density, shape.block_size, shape.local_blocks));
    }
    f.documents = static_cast<double>(segments.size());
  }
  return f;
}

}  // namespace

LatencyModel::LatencyModel(const ModelShape& shape, int ranks, const CostCoefficients& prior,
                           const LatencyModelOptions& options, double exchange_seconds_per_byte)
    : shape_(shape), prior_(prior), options_(options) {
  // Scales make the fit well conditioned: each feature's weight is about 1. A term whose prior
  // is zero (the micro-batch overhead; the profile cannot see it) gets a scale of 2% of a
  // reference micro-batch (one 8K document at density 0.3), so it can be learned.
  const Sample reference{0, 8192, 0.0, 0, {}};
  const double blocks = static_cast<double>(
      ActiveBlocks(reference.length, 0.3, shape.block_size, shape.local_blocks));
  const double reference_seconds = prior.per_block * blocks + prior.per_token * 8192.0 +
                                   prior.per_sample + prior.per_micro_batch;
  const std::array<double, kFeatures> prior_coef = {prior.per_block, prior.per_token,
                                                    prior.per_sample, prior.per_micro_batch};
  const std::array<double, kFeatures> reference_x = {blocks, 8192.0, 1.0, 1.0};
  for (int i = 0; i < kFeatures; ++i) {
    const double fallback = 0.02 * reference_seconds / reference_x[i];
    scale_[i] = prior_coef[i] > 0 ? prior_coef[i] : (fallback > 0 ? fallback : 1e-6);
    state_.weights[i] = prior_coef[i] > 0 ? 1.0 : 0.0;
    // A term the prior knows nothing of starts uninformative, so the data decide it.
    state_.covariance[i * kFeatures + i] = prior_coef[i] > 0 ? kPriorVariance : kMaxVariance;
  }
  state_.speed_factors.assign(std::max(ranks, 1), 1.0);
  // Four observations at the prior rate (u = bytes per second).
  if (exchange_seconds_per_byte > 0 && std::isfinite(exchange_seconds_per_byte)) {
    const double u = 1.0 / exchange_seconds_per_byte;
    state_.exchange_u = kExchangePriorObservations * u;
    state_.exchange_uu = kExchangePriorObservations * u * u;
  }
}

void LatencyModel::set_state(const LatencyModelState& state) {
  const double u = state_.exchange_u;
  const double uu = state_.exchange_uu;
  state_ = state;
  if (!(state_.exchange_uu > 0)) {  // a snapshot from before the exchange was learned
    state_.exchange_u = u;
    state_.exchange_uu = uu;
  }
}

double LatencyModel::rank_error_sd() const { return std::sqrt(state_.rank_error_variance); }

CostCoefficients LatencyModel::coefficients() const {
  return {scale_[0] * state_.weights[0], scale_[1] * state_.weights[1],
          scale_[2] * state_.weights[2], scale_[3] * state_.weights[3]};
}

MicroBatchFeatures LatencyModel::SampleFeatures(const Sample& sample, double density) const {
  return Features(shape_, sample.length, sample.segments, density);
}

double ShardExchangeBytes(const ModelShape& shape, int64_t shard_begin) {
  const double kv_bytes_per_token = 2.0 * shape.heads * shape.head_dim * 2.0;  // K and V, bf16
  return 2.0 * static_cast<double>(std::max<int64_t>(shard_begin, 0)) * kv_bytes_per_token *
         shape.layers;
}

MicroBatchFeatures LatencyModel::PlannedSampleFeatures(const PlannedSample& p) const {
  // With a density per layer, the active blocks are their mean over the layers. The per-layer
  // counts are summed exactly in int64, all layers of a document at once
  // (ActiveBlocksOfQueryBlocksSum), and converted once. The definition adds the same integers
  // as doubles, layer by layer (and document by document); every partial sum is at most the
  // total, so where the total is at most 2^53 each of those additions is exact and the two
  // give the same bits. A larger total (32 layers of a 2^25-row document at full density: 2^25
  // tokens at block size 1) adds the doubles as the definition does.
  constexpr int64_t kExactInDouble = int64_t{1} << 53;
  const std::vector<double>& layers = p.layer_densities;
  const auto layer_count = static_cast<double>(layers.size());
  if (p.sharded()) {
    // The shard's rows of its one document (shard_begin is block-aligned), with the exchange.
    const int64_t first_row = QueryBlocks(p.shard_begin, shape_.block_size);
    const int64_t end_row = QueryBlocks(p.shard_end, shape_.block_size);
    auto blocks = [&](double density) {
      return static_cast<double>(
          ActiveBlocksInRows(first_row, end_row, density, shape_.local_blocks));
    };
    MicroBatchFeatures f;
    f.tokens = static_cast<double>(p.QueryTokens());
    f.documents = 1.0;
    f.exchange_bytes = ShardExchangeBytes(shape_, p.shard_begin);
    if (layers.empty()) {
      f.active_blocks = blocks(p.density);
      return f;
    }
    const int64_t sum = ActiveBlocksInRowsSum(first_row, end_row, layers.data(), layers.size(),
                                              shape_.local_blocks);
    if (sum <= kExactInDouble) {
      f.active_blocks = static_cast<double>(sum) / layer_count;
    } else {
      for (double d : layers) f.active_blocks += blocks(d);
      f.active_blocks /= layer_count;
    }
    return f;
  }
  if (layers.empty()) return Features(shape_, p.length, p.segments, p.density);
  auto document_sum = [&](int64_t length) {
    return ActiveBlocksOfQueryBlocksSum(QueryBlocks(length, shape_.block_size), layers.data(),
                                        layers.size(), shape_.local_blocks);
  };
  int64_t sum = 0;
  if (p.segments.empty()) {
    sum = document_sum(p.length);
  } else {
    for (int64_t segment : p.segments) {
      if (__builtin_add_overflow(sum, document_sum(segment), &sum)) {
        sum = std::numeric_limits<int64_t>::max();
        break;
      }
    }
  }
  if (sum <= kExactInDouble) {
    MicroBatchFeatures f;
    f.tokens = static_cast<double>(p.length);
    f.documents = p.segments.empty() ? 1.0 : static_cast<double>(p.segments.size());
    f.active_blocks = static_cast<double>(sum) / layer_count;
    return f;
  }
  MicroBatchFeatures f = Features(shape_, p.length, p.segments, layers[0]);
  for (size_t l = 1; l < layers.size(); ++l) {
    f.active_blocks += Features(shape_, p.length, p.segments, layers[l]).active_blocks;
  }
  f.active_blocks /= layer_count;
  return f;
}

MicroBatchFeatures LatencyModel::PlanFeatures(const MicroBatchPlan& micro_batch) const {
  MicroBatchFeatures sum;
  for (const PlannedSample& p : micro_batch.samples) {
    const MicroBatchFeatures f = PlannedSampleFeatures(p);
    sum.active_blocks += f.active_blocks;
    sum.tokens += f.tokens;
    sum.documents += f.documents;
    sum.exchange_bytes += f.exchange_bytes;
  }
  return sum;
}

double LatencyModel::SampleSeconds(const Sample& sample, double density) const {
  return SampleSeconds(SampleFeatures(sample, density));
}

absl::Status LatencyModel::ObserveStep(std::vector<Observation> observations) {
  for (size_t i = 0; i < observations.size(); ++i) {
    const Observation& o = observations[i];
    // Named only when one is refused (a step has tens of thousands).
    auto where = [&] {
      return absl::StrCat("observation ", i, " (rank ", o.rank, ", micro_batch ", o.micro_batch,
                          ")");
    };
    if (!std::isfinite(o.measured_seconds) || o.measured_seconds <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": measured_seconds ", o.measured_seconds,
                       " is not a positive finite number; the step was not folded in"));
    }
    if (!(o.exchange_seconds >= 0 && o.exchange_seconds < o.measured_seconds)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), ": exchange_seconds ", o.exchange_seconds, " is outside [0, measured_seconds ",
          o.measured_seconds, "); the step was not folded in"));
    }
    if (o.rank < 0 || o.rank >= ranks()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": rank is outside [0, ", ranks(), ")"));
    }
    const MicroBatchFeatures& f = o.features;
    if (!(f.active_blocks >= 0) || !(f.tokens > 0) || !(f.documents >= 1) ||
        !(f.exchange_bytes >= 0) || !std::isfinite(f.active_blocks) || !std::isfinite(f.tokens) ||
        !std::isfinite(f.documents) || !std::isfinite(f.exchange_bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(where(),
                                                     ": features need active_blocks >= 0, tokens > "
                                                     "0, documents >= 1 and exchange_bytes >= 0"));
    }
  }
  if (observations.empty()) return absl::OkStatus();
  // A total order on the values, so that any permutation of the same step (even with
  // repeated keys) is folded in identically.
  std::sort(observations.begin(), observations.end(),
            [](const Observation& a, const Observation& b) {
              return std::tie(a.rank, a.micro_batch, a.measured_seconds, a.exchange_seconds,
                              a.features.active_blocks, a.features.tokens, a.features.documents,
                              a.features.exchange_bytes) <
                     std::tie(b.rank, b.micro_batch, b.measured_seconds, b.exchange_seconds,
                              b.features.active_blocks, b.features.tokens, b.features.documents,
                              b.features.exchange_bytes);
            });

  // 0. How wrong the model was on this step, before learning from it; and which ranks run at
  // a speed outside the factor bounds (their times would drag the shared coefficients, so
  // only their speed factors learn from them).
  std::vector<char> out_of_bounds(ranks(), 0);
  {
    std::vector<double> measured(ranks(), 0.0);
    std::vector<double> predicted(ranks(), 0.0);
    std::vector<double> measured_compute(ranks(), 0.0);
    std::vector<double> predicted_compute(ranks(), 0.0);
    for (const Observation& o : observations) {
      measured[o.rank] += o.measured_seconds;
      predicted[o.rank] += PredictSeconds(o.rank, o.features);
      measured_compute[o.rank] += o.measured_seconds - o.exchange_seconds;
      predicted_compute[o.rank] += speed_factor(o.rank) * ComputeSeconds(o.features);
    }
    double sum = 0.0;
    int count = 0;
    for (int r = 0; r < ranks(); ++r) {
      if (measured[r] <= 0 || predicted[r] <= 0) continue;
      const double speed = predicted_compute[r] > 0 ? state_.speed_factors[r] *
                                                          measured_compute[r] / predicted_compute[r]
                                                    : state_.speed_factors[r];
      out_of_bounds[r] = speed < options_.speed_min || speed > options_.speed_max;
      const double e = measured[r] / predicted[r] - 1.0;
      sum += e * e;
      ++count;
    }
    if (count > 0) {
      const double variance = sum / count;
      state_.rank_error_variance = state_.steps_observed == 0
                                       ? variance
                                       : (1.0 - options_.error_ewma) * state_.rank_error_variance +
                                             options_.error_ewma * variance;
    }
  }

  // 1. Coefficients: RLS on y = t / h_r, with the step's forgetting applied once.
  std::array<double, 16>& p = state_.covariance;
  for (double& v : p) v /= options_.forgetting;
  std::array<double, 4>& w = state_.weights;
  for (const Observation& o : observations) {
    if (out_of_bounds[o.rank]) continue;
    const double h = state_.speed_factors[o.rank];
    const std::array<double, 4> z = Scaled(o.features);
    const double y = (o.measured_seconds - o.exchange_seconds) / h;
    // Relative-error weighting: divide the row by its target so long and short micro-batches
    // count alike.
    std::array<double, 4> x;
    for (int i = 0; i < kFeatures; ++i) x[i] = z[i] / y;
    std::array<double, 4> px{};
    for (int i = 0; i < kFeatures; ++i) {
      for (int j = 0; j < kFeatures; ++j) px[i] += p[i * kFeatures + j] * x[j];
    }
    double denom = 1.0;
    double pred = 0.0;
    for (int i = 0; i < kFeatures; ++i) {
      denom += x[i] * px[i];
      pred += x[i] * w[i];
    }
    const double err = 1.0 - pred;
    for (int i = 0; i < kFeatures; ++i) w[i] += px[i] / denom * err;
    for (int i = 0; i < kFeatures; ++i) {
      for (int j = 0; j < kFeatures; ++j) p[i * kFeatures + j] -= px[i] * px[j] / denom;
    }
    for (int i = 0; i < kFeatures; ++i) w[i] = std::max(w[i], 0.0);
  }
  // Keep P bounded so that forgetting cannot blow it up when the inputs do not excite a
  // direction (e.g. every micro-batch has one document). The bound is well above the prior
  // so that small terms (a per-micro-batch overhead worth 1% of the time) stay learnable.
  for (int i = 0; i < kFeatures; ++i) {
    double& d = p[i * kFeatures + i];
    if (d > kMaxVariance) {
      const double f = std::sqrt(kMaxVariance / d);
      for (int j = 0; j < kFeatures; ++j) {
        p[i * kFeatures + j] *= f;
        p[j * kFeatures + i] *= f;
      }
    }
  }

  // 1b. The exchange rate: each micro-batch that exchanged bytes is one point u = bytes / s.
  // Forgotten only in steps that measured an exchange, so that the sums of a job without
  // context parallelism never decay to zero (the ratio is unchanged by the scaling).
  bool forgotten = false;
  for (const Observation& o : observations) {
    if (o.features.exchange_bytes <= 0 || o.exchange_seconds <= 0) continue;
    if (!forgotten) {
      state_.exchange_u *= options_.forgetting;
      state_.exchange_uu *= options_.forgetting;
      forgotten = true;
    }
    const double u = o.features.exchange_bytes / o.exchange_seconds;
    state_.exchange_u += u;
    state_.exchange_uu += u * u;
  }

  // 2. Speed factors: EWMA of measured / predicted compute time per rank, bounded.
  std::vector<double> measured(ranks(), 0.0);
  std::vector<double> predicted(ranks(), 0.0);
  for (const Observation& o : observations) {
    measured[o.rank] += o.measured_seconds - o.exchange_seconds;
    predicted[o.rank] += ComputeSeconds(o.features);
  }
  for (int r = 0; r < ranks(); ++r) {
    if (measured[r] <= 0 || predicted[r] <= 0) continue;
    double& h = state_.speed_factors[r];
    h = (1.0 - options_.speed_ewma) * h + options_.speed_ewma * (measured[r] / predicted[r]);
    h = std::clamp(h, options_.speed_min, options_.speed_max);
  }
  // 3. Normalise: the median rank has factor 1; the weights absorb the common scale, so
  // predictions do not change.
  const double median = Median(state_.speed_factors);
  if (median > 0) {
    for (double& h : state_.speed_factors) {
      h = std::clamp(h / median, options_.speed_min, options_.speed_max);
    }
    for (double& v : w) v *= median;
    for (double& v : p) v *= median * median;
  }
  ++state_.steps_observed;
  return absl::OkStatus();
}

}  // namespace sparsebalance
