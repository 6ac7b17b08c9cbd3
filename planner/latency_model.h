// Predicts micro-batch times and learns from measured ones (DESIGN.md section 4):
//
//   t(rank r, micro-batch S) = h_r * ( sum_{s in S} [ per_block * A(L_s, rho_s)
//                                      + per_token * L_s + per_sample * docs_s ] + per_mb )
//
// The coefficients start from a prior (a fitted profile table) and are refined online by
// recursive least squares with forgetting, projected onto non-negative values; h_r is a
// bounded EWMA of measured / predicted time per rank, normalised so the median rank is 1.
//
//   LatencyModel model(shape, /*ranks=*/32, prior);
//   double t = model.PredictSeconds(rank, model.SampleFeatures(sample, /*density=*/0.3));
//   absl::Status s = model.ObserveStep(observations);  // after every step
#ifndef SPARSEBALANCE_PLANNER_LATENCY_MODEL_H_
#define SPARSEBALANCE_PLANNER_LATENCY_MODEL_H_

#include <array>
#include <vector>

#include "absl/status/status.h"
#include "planner/profile_table.h"
#include "planner/types.h"

namespace sparsebalance {

// The prior of a job without a profile table: a 7B-class model on one H100-class GPU
// (seconds per active block, token, document and micro-batch, whole model, fwd+bwd). The
// planner service and the client's local fallback both start from it.
inline constexpr CostCoefficients kDefaultCostPrior{1.7e-5, 1e-4, 2e-3, 0.05};

// The prior of the key/value exchange of context parallelism: seconds per byte a shard sends
// or receives, 1 / (25 GB/s), about what one GPU gets of an InfiniBand NDR link in a ring.
inline constexpr double kDefaultExchangeSecondsPerByte = 1.0 / 25e9;

// MicroBatchFeatures (what the model sees of a micro-batch) is in planner/types.h: plans carry
// them.

// Bytes one shard of a split document exchanges with its group in a step: it receives the keys
// and values of the document's `shard_begin` tokens before it (forward) and sends back their
// gradients (backward), bf16, in every layer: 2 x shard_begin x (2 x heads x head_dim x 2 B) x
// layers. Selection needs only the pooled keys (one vector per block), which is left out.
double ShardExchangeBytes(const ModelShape& shape, int64_t shard_begin);

// One measured micro-batch of one rank.
struct Observation {
  int rank = 0;
  int micro_batch = 0;
  MicroBatchFeatures features;
  double measured_seconds = 0.0;  // compute time of the micro-batch (exchange included)
  double exchange_seconds = 0.0;  // the part of it its shards spent exchanging
};

struct LatencyModelOptions {
  double forgetting = 0.85;  // per step: older steps weigh forgetting^age in the fit
  double speed_ewma = 0.3;   // weight of the newest step in the speed factor EWMA
  double speed_min = 0.25;   // bounds of a speed factor
  double speed_max = 4.0;
  double error_ewma = 0.2;  // weight of the newest step in rank_error_variance
};

// The model's learned state, plain so that the service can snapshot it.
struct LatencyModelState {
  std::array<double, 4> weights{};      // multipliers of the feature scales (RLS estimate)
  std::array<double, 16> covariance{};  // RLS P matrix, row-major 4x4
  std::vector<double> speed_factors;    // h_r
  // EWMA of the squared relative error of predicted rank times, measured before each step is
  // folded in (out of sample); its root is the noise DST leaves room for.
  double rank_error_variance = 0.0;
  int64_t steps_observed = 0;
  // Key/value exchange of context parallelism, learned apart from the compute coefficients
  // (workers report it apart): a least-squares fit through the origin, relative-error
  // weighted, of measured exchange seconds on exchanged bytes. With u = bytes / seconds of
  // each measured micro-batch, seconds per byte = exchange_u / exchange_uu; both sums start as
  // four observations at the prior and are forgotten like the coefficients.
  double exchange_u = 0.0;
  double exchange_uu = 0.0;
};

class LatencyModel {
 public:
  LatencyModel(const ModelShape& shape, int ranks, const CostCoefficients& prior,
               const LatencyModelOptions& options = {},
               double exchange_seconds_per_byte = kDefaultExchangeSecondsPerByte);

  const ModelShape& shape() const { return shape_; }
  // The coefficients the model started from (with state(), enough to rebuild it).
  const CostCoefficients& prior() const { return prior_; }
  int ranks() const { return static_cast<int>(state_.speed_factors.size()); }
  CostCoefficients coefficients() const;
  // Learned seconds per exchanged byte (context parallelism), speed factors not applied: the
  // network is not the GPU.
  double exchange_seconds_per_byte() const {
    return state_.exchange_uu > 0 ? state_.exchange_u / state_.exchange_uu : 0.0;
  }
  double speed_factor(int rank) const { return state_.speed_factors[rank]; }
  const std::vector<double>& speed_factors() const { return state_.speed_factors; }
  // Typical relative error of a predicted rank time (0 before the first observed step).
  double rank_error_sd() const;
  const LatencyModelState& state() const { return state_; }
  // A state without exchange sums (a snapshot older than them) keeps the prior's.
  void set_state(const LatencyModelState& state);

  // Features of one sample at `density` (its documents at the same density).
  MicroBatchFeatures SampleFeatures(const Sample& sample, double density) const;
  // Features of a planned sample: its documents at its density, or, with layer densities,
  // the mean over layers of each layer's active blocks (cost is linear in the layers).
  MicroBatchFeatures PlannedSampleFeatures(const PlannedSample& sample) const;
  // Features of a planned micro-batch: the sum of its samples'.
  MicroBatchFeatures PlanFeatures(const MicroBatchPlan& micro_batch) const;
  // Seconds of one sample at `density` without the speed factor and micro-batch overhead.
  double SampleSeconds(const Sample& sample, double density) const;
  // The same from the sample's features (SampleFeatures, or a SampleTable's).
  // This and the three below are inline: planning asks them for every sample of a step, a few
  // times each.
  double SampleSeconds(const MicroBatchFeatures& f) const {
    return f.active_blocks * scale_[0] * state_.weights[0] +
           f.tokens * scale_[1] * state_.weights[1] + f.documents * scale_[2] * state_.weights[2];
  }
  // Seconds of a micro-batch without the speed factor (0 for an empty one), exchange included.
  double Seconds(const MicroBatchFeatures& features) const {
    return ComputeSeconds(features) + ExchangeSeconds(features);
  }
  // The compute part of Seconds (the part the speed factor scales) and the exchange part.
  double ComputeSeconds(const MicroBatchFeatures& features) const {
    // Scaled(features) term by term, added in its order: through the array, GCC stored the
    // scaled features one by one and loaded them back two at a time, which the CPU cannot
    // forward from the stores (a stall on every sample of BuildPlan).
    const double non_empty = features.tokens > 0 ? 1.0 : 0.0;
    double t = 0;
    t += features.active_blocks * scale_[0] * state_.weights[0];
    t += features.tokens * scale_[1] * state_.weights[1];
    t += features.documents * scale_[2] * state_.weights[2];
    t += non_empty * scale_[3] * state_.weights[3];
    return t;
  }
  double ExchangeSeconds(const MicroBatchFeatures& features) const {
    return features.exchange_bytes * exchange_seconds_per_byte();
  }
  double PredictSeconds(int rank, const MicroBatchFeatures& features) const {
    return speed_factor(rank) * ComputeSeconds(features) + ExchangeSeconds(features);
  }

  // Folds one step's measurements in. The whole step is refused, naming the offending entry,
  // if a time is NaN, infinite, zero or negative, an exchange time is outside
  // [0, measured_seconds), a rank is out of range, or features are negative; nothing is folded
  // in then. The compute coefficients and speed factors learn from measured less exchange
  // seconds; the exchange rate from the micro-batches with exchanged bytes. Observations are
  // applied in (rank, micro_batch) order whatever order they arrive in, so every replica learns the
  // same model.
  absl::Status ObserveStep(std::vector<Observation> observations);

 private:
  std::array<double, 4> Scaled(const MicroBatchFeatures& f) const {
    const double non_empty = f.tokens > 0 ? 1.0 : 0.0;
    return {f.active_blocks * scale_[0], f.tokens * scale_[1], f.documents * scale_[2],
            non_empty * scale_[3]};
  }

  ModelShape shape_;
  CostCoefficients prior_;
  LatencyModelOptions options_;
  std::array<double, 4> scale_{};  // seconds per unit of each feature at weight 1
  LatencyModelState state_;
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_LATENCY_MODEL_H_
