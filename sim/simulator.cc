#include "sim/simulator.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <map>
#include <numeric>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "contract/block_geometry.h"
#include "contract/step_figures.h"
#include "planner/context_parallel.h"
#include "planner/det_math.h"
#include "planner/latency_model.h"
#include "planner/planner.h"
#include "planner/random.h"
#include "planner/recall_model.h"

namespace sparsebalance {
namespace {

// Multiplicative noise is clamped so that a measured time stays positive.
constexpr double kMinNoiseFactor = 0.5;

struct BucketTotals {
  double tokens = 0.0;
  double true_recall = 0.0;       // sum of tokens x recall
  double predicted_recall = 0.0;  // sum of tokens x recall
};

// The planner's fit (RecallModel's least squares over density bins) of the true recalls of the
// documents a policy placed, never forgotten and without a prior: the best g of the planner's
// form for that policy's densities, which the learned g should approach.
constexpr RecallModelOptions kTruthFit{/*forgetting=*/1.0, /*prior_documents=*/0.0};

struct PolicyRun {
  PolicyRun(const SimPolicy& row, const ValidConfig& config, const CostCoefficients& prior)
      : policy(row.policy),
        row(row),
        config(config),
        model(config.get().shape, config.get().ranks, prior),
        recall(config.get().micro_batch_capacity, config.get().shape.layers),
        truth_fit(config.get().micro_batch_capacity, config.get().shape.layers, kTruthFit) {}
  Policy policy;
  SimPolicy row;
  ValidConfig config;
  LatencyModel model;
  RecallModel recall;
  RecallModel truth_fit;
  std::array<BucketTotals, kRecallBuckets> buckets{};
  std::vector<Sample> carried;  // deferred samples for the next step
  PolicyResult result;
  std::vector<double> imbalance;
  std::vector<double> bubble;
  std::vector<double> gaps;
  std::vector<double> errors;
  double plan_seconds = 0.0;
  double tokens = 0.0;
  double weighted_density = 0.0;
  double weighted_recall = 0.0;
  double weighted_predicted_recall = 0.0;
  double split_documents = 0.0;  // over all steps
  double exchange_seconds = 0.0;
  double compute_seconds = 0.0;
};

// Seconds of the attention of one document of the efficiency truth, over a A(L, rho).
double EfficiencyFactor(int64_t length, double density) {
  const double sparse = 1.0 - std::clamp(density, 0.0, 1.0);
  const double forward = 1.0 + 0.15 * sparse;
  const double backward = 1.0 + 0.8 * sparse;
  const double short_document = 1.0 + 0.5 * DetExp(-static_cast<double>(length) / 4096.0);
  return (forward / 3.0 + 2.0 * backward / 3.0) * short_document;
}

// The density the hidden truth runs of a planned sample in one layer (-1: its `density`).
double LayerDensity(const PlannedSample& p, int layer) {
  return layer < 0 ? p.density : p.layer_densities[static_cast<size_t>(layer)];
}

}  // namespace

std::string SimPolicyName(const SimPolicy& p) {
  if (!p.context_parallel) return std::string(PolicyName(p.policy));
  if (p.policy == Policy::kFlops && p.shard_policy == ShardPolicy::kStatic) return "static-cp";
  if (p.policy == Policy::kFlops && p.shard_policy == ShardPolicy::kDense) return "dense-cp";
  return absl::StrCat(PolicyName(p.policy), "-cp",
                      p.shard_policy == ShardPolicy::kSparse
                          ? ""
                          : absl::StrCat(":", ShardPolicyName(p.shard_policy)));
}

absl::StatusOr<SimPolicy> ParseSimPolicy(absl::string_view name) {
  if (name == "static-cp") return SimPolicy(Policy::kFlops, ShardPolicy::kStatic);
  if (name == "dense-cp") return SimPolicy(Policy::kFlops, ShardPolicy::kDense);
  if (absl::EndsWith(name, "-cp")) {
    absl::StatusOr<Policy> p = ParsePolicy(name.substr(0, name.size() - 3));
    if (p.ok()) return SimPolicy(*p, ShardPolicy::kSparse);
  } else if (absl::StatusOr<Policy> p = ParsePolicy(name); p.ok()) {
    return SimPolicy(*p);
  }
  std::vector<std::string> names;
  for (Policy p : AllPolicies()) names.emplace_back(PolicyName(p));
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown policy \"", name, "\"; choose one of: ", absl::StrJoin(names, ", "),
      ", static-cp, dense-cp, or a policy with -cp (sparse-cost context parallelism, e.g. "
      "sparsebalance-cp)"));
}

std::vector<SimPolicy> DefaultSimPolicies(int max_shards) {
  std::vector<SimPolicy> out(AllPolicies().begin(), AllPolicies().end());
  if (max_shards > 1) {
    out.emplace_back(Policy::kFlops, ShardPolicy::kStatic);
    out.emplace_back(Policy::kFlops, ShardPolicy::kDense);
    out.emplace_back(Policy::kSparseBalance, ShardPolicy::kSparse);
  }
  return out;
}

absl::string_view CostTruthName(CostTruth truth) {
  return truth == CostTruth::kLinear ? "linear" : "efficiency";
}

absl::StatusOr<CostTruth> ParseCostTruth(absl::string_view text) {
  if (text == "linear") return CostTruth::kLinear;
  if (text == "efficiency") return CostTruth::kEfficiency;
  return absl::InvalidArgumentError(
      absl::StrCat("--cost_truth=", text, ": want linear or efficiency"));
}

absl::StatusOr<SensitivityPrior> ParseSensitivityPrior(absl::string_view text, double* sd) {
  if (text == "none") return SensitivityPrior::kNone;
  if (text == "true") return SensitivityPrior::kTrue;
  if (absl::StartsWith(text, "noisy:")) {
    double value = 0.0;
    if (absl::SimpleAtod(text.substr(6), &value) && value >= 0.0 && std::isfinite(value)) {
      *sd = value;
      return SensitivityPrior::kNoisy;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--sensitivity_prior=", text, ": want none, true or noisy:SD with SD a number >= 0"));
}

namespace {

// The truth's attention seconds of one document at one density (all layers, fwd + bwd).
double TrueAttentionSeconds(const SimOptions& o, const CostCoefficients& c, int64_t length,
                            double density) {
  const double blocks =
      static_cast<double>(ActiveBlocks(length, density, o.shape.block_size, o.shape.local_blocks));
  if (o.cost_truth == CostTruth::kLinear) return c.per_block * blocks;
  return c.per_block * blocks * EfficiencyFactor(length, density);
}

// The truth's seconds of one document outside attention.
double TrueOtherSeconds(const SimOptions& o, const CostCoefficients& c, int64_t length) {
  const double tokens = static_cast<double>(length);
  if (o.cost_truth == CostTruth::kLinear) return c.per_token * tokens + c.per_sample;
  return c.per_token * tokens + 1e-3 + 2e-3 * std::sqrt(tokens / 131072.0);
}

}  // namespace

double TrueDocumentSeconds(const SimOptions& o, int64_t length, double density) {
  const CostCoefficients c = GroundTruthCoefficients(o);
  return TrueAttentionSeconds(o, c, length, density) + TrueOtherSeconds(o, c, length);
}

double TrueShardSeconds(const SimOptions& o, int64_t length, int64_t begin, int64_t end,
                        double density) {
  const CostCoefficients c = GroundTruthCoefficients(o);
  const int block = o.shape.block_size;
  const double blocks = static_cast<double>(ActiveBlocksInRows(
      begin / block, QueryBlocks(std::min(end, length), block), density, o.shape.local_blocks));
  const double attention = o.cost_truth == CostTruth::kLinear
                               ? c.per_block * blocks
                               : c.per_block * blocks * EfficiencyFactor(length, density);
  return attention + TrueOtherSeconds(o, c, end - begin);
}

double TrueExchangeSeconds(const SimOptions& o, int index, int64_t begin) {
  return 2.0 * index * o.shape.layers * o.exchange_latency +
         ShardExchangeBytes(o.shape, begin) / o.exchange_bandwidth;
}

HiddenRecallCurve DrawHiddenRecallCurve(uint64_t seed, uint64_t sample_id, int document,
                                        int64_t length, double sensitivity) {
  Rng rng(Rng::Mix(Rng::Mix(Rng::Mix(seed, 0x7265636c /* "recl" */), sample_id),
                   static_cast<uint64_t>(document)));
  const double s = std::clamp(sensitivity, 0.0, 1.0);
  const double u =
      std::clamp(DetLog(static_cast<double>(length) / 1024.0) / DetLog(2.0), 0.0, 7.0) / 7.0;
  HiddenRecallCurve c;
  const double z1 = rng.Normal();
  const double z2 = rng.Normal();
  c.anchor = std::clamp((0.55 - 0.35 * u) * (1.0 - 0.5 * s) * DetExp(0.3 * z1), 0.02, 0.9);
  c.concentration = std::clamp((0.12 + 0.18 * u) * (1.0 + 1.5 * s) * DetExp(0.3 * z2), 0.04, 0.95);
  const double p_needle = (length < 8192 ? 0.03 : length < 32768 ? 0.12 : 0.35) + 0.3 * s;
  const double draw = rng.Uniform();
  const double mass = 0.04 + 0.12 * rng.Uniform();
  const double threshold = 0.25 + 0.35 * rng.Uniform();
  if (draw < p_needle) {
    c.needle = std::min(mass, 1.0 - c.anchor);
    c.needle_threshold = threshold;
  }
  return c;
}

double KeptShare(int64_t length, double density, const ModelShape& shape) {
  const double all =
      static_cast<double>(ActiveBlocks(length, 1.0, shape.block_size, shape.local_blocks));
  const double anchors =
      static_cast<double>(ActiveBlocks(length, 1e-9, shape.block_size, shape.local_blocks));
  if (all <= anchors) return 1.0;
  const double kept =
      static_cast<double>(ActiveBlocks(length, density, shape.block_size, shape.local_blocks));
  return std::clamp((kept - anchors) / (all - anchors), 0.0, 1.0);
}

double TrueRecall(const HiddenRecallCurve& c, double x) {
  x = std::clamp(x, 0.0, 1.0);
  const double spread = x > 0.0 ? DetPow(x, c.concentration) : 0.0;
  const double recall =
      c.anchor + (1.0 - c.anchor - c.needle) * spread + (x >= c.needle_threshold ? c.needle : 0.0);
  return std::clamp(recall, 0.0, 1.0);
}

CostCoefficients GroundTruthCoefficients(const SimOptions& o) {
  CostCoefficients truth;
  truth.per_token = o.seconds_per_token;
  const double dense_blocks =
      static_cast<double>(ActiveBlocks(131072, 1.0, o.shape.block_size, o.shape.local_blocks));
  truth.per_block = o.attention_ratio * o.seconds_per_token * 131072.0 / dense_blocks;
  truth.per_sample = 2e-3;
  truth.per_micro_batch = 0.05;
  return truth;
}

ProfileTable SyntheticProfile(const SimOptions& o) {
  const CostCoefficients truth = GroundTruthCoefficients(o);
  ProfileTable table;
  table.device = "sb-sim synthetic (attention x0.6, linear x1.4 of the ground truth)";
  table.shape = o.shape;
  const double layers = o.shape.layers;
  for (int64_t length : {4096, 16384, 65536, 131072}) {
    for (double density : {1.0, 0.5, 0.3, 0.1}) {
      const double seconds = (0.6 * TrueAttentionSeconds(o, truth, length, density) +
                              1.4 * truth.per_token * static_cast<double>(length)) /
                             layers;
      table.rows.push_back({length, density, seconds});
    }
  }
  return table;
}

std::vector<int> SlowRanks(const SimOptions& o) {
  std::vector<int> slow;
  const int n = std::clamp(o.slow_ranks, 0, o.ranks);
  for (int k = 0; k < n; ++k) {
    slow.push_back(static_cast<int>((2 * static_cast<int64_t>(k) + 1) * o.ranks / (2 * n)));
  }
  return slow;
}

absl::StatusOr<SimReport> RunSimulation(const SimOptions& o) {
  PlannerConfig planner_config;
  planner_config.ranks = o.ranks;
  planner_config.micro_batches = o.micro_batches;
  planner_config.micro_batch_capacity = o.capacity;
  planner_config.shape = o.shape;
  planner_config.density_default = o.density_default;
  planner_config.density_min = o.density_min;
  planner_config.density_max = o.density_max;
  planner_config.dst_mode = o.mode;
  planner_config.dst_quantile = o.quantile;
  planner_config.overflow = OverflowPolicy::kDefer;
  planner_config.bucket_recall_margin = o.bucket_recall_margin;
  planner_config.document_recall_floor = o.document_recall_floor;
  if (absl::Status s = ValidateConfig(planner_config); !s.ok()) return s;
  if (o.steps < 1) return absl::InvalidArgumentError("--steps must be at least 1");
  if (!(o.fill > 0.0 && o.fill <= 1.0)) return absl::InvalidArgumentError("--fill needs (0, 1]");
  if (!(o.noise >= 0.0 && o.noise < 1.0)) return absl::InvalidArgumentError("--noise needs [0, 1)");
  if (!(o.slow_factor > 0.0)) return absl::InvalidArgumentError("--slow_factor needs > 0");
  if (o.policies.empty()) return absl::InvalidArgumentError("--policies names no policy");
  if (o.max_shards < 1 || o.max_shards > std::min(o.ranks, kMaxShards)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_shards=", o.max_shards, " needs [1, min(--ranks ", o.ranks, ", ", kMaxShards, ")]"));
  }
  if (!(o.exchange_bandwidth > 0) || !(o.exchange_latency >= 0)) {
    return absl::InvalidArgumentError(
        "the exchange truth needs a bandwidth > 0 and a latency >= 0");
  }
  for (const SimPolicy& p : o.policies) {
    if (p.context_parallel && o.max_shards < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--policies names ", SimPolicyName(p), ", which splits documents: set --max_shards > 1"));
    }
  }
  if (o.recall_rows < 1) return absl::InvalidArgumentError("--recall_rows must be at least 1");
  if (!(o.sensitivity_noise >= 0.0 && std::isfinite(o.sensitivity_noise))) {
    return absl::InvalidArgumentError("--sensitivity_prior=noisy:SD needs SD >= 0");
  }

  absl::StatusOr<CostCoefficients> prior =
      FitProfile(o.has_profile ? o.profile : SyntheticProfile(o), o.shape);
  if (!prior.ok()) return prior.status();
  const CostCoefficients truth_coef = GroundTruthCoefficients(o);
  std::vector<double> speed(o.ranks, 1.0);  // hidden speed factors
  for (int r : SlowRanks(o)) speed[r] = o.slow_factor;

  absl::StatusOr<TraceGenerator> generator =
      o.trace_records.empty() ? TraceGenerator::Builtin(o.trace, o.seed)
                              : TraceGenerator::FromRecords(o.trace_records, o.seed);
  if (!generator.ok()) return generator.status();
  if (o.pack_length > 0) {
    if (o.pack_length > o.capacity) {
      return absl::InvalidArgumentError(
          absl::StrCat("--pack ", o.pack_length, " exceeds --capacity ", o.capacity));
    }
    generator->SetPackLength(o.pack_length);
  }
  const int64_t budget = static_cast<int64_t>(o.fill * static_cast<double>(o.ranks) *
                                              o.micro_batches * static_cast<double>(o.capacity));

  std::vector<PolicyRun> runs;
  runs.reserve(o.policies.size());
  for (const SimPolicy& p : o.policies) {
    PlannerConfig c = planner_config;
    c.policy = p.policy;
    if (p.context_parallel) {
      c.max_shards = o.max_shards;
      c.shard_policy = p.shard_policy;
    }
    absl::StatusOr<ValidConfig> valid = ValidConfig::Check(c);
    if (!valid.ok()) return valid.status();
    runs.emplace_back(p, *valid, *prior);
  }
  // Hidden sensitivity of every sample drawn so far (deferred samples come back later).
  std::unordered_map<uint64_t, double> hidden_sensitivity;

  for (int step = 0; step < o.steps; ++step) {
    std::vector<Sample> fresh = generator->NextBatch(budget);
    for (Sample& s : fresh) {
      // Documents longer than the longest a row can train (max_shards block-aligned shards of
      // a micro-batch) are cut to it, as a real pipeline truncates them; rows without context
      // parallelism cut them further to one micro-batch below.
      const int64_t longest = LongestSplittable(o.max_shards, o.capacity, o.shape.block_size);
      if (s.length > longest) {
        s.length = longest;
        s.segments.clear();
      }
      // The planner is told the sensitivity only as --sensitivity_prior says.
      hidden_sensitivity[s.id] = s.sensitivity;
      switch (o.sensitivity_prior) {
        case SensitivityPrior::kNone:
          s.sensitivity = 0.0;
          break;
        case SensitivityPrior::kTrue:
          break;
        case SensitivityPrior::kNoisy: {
          Rng rng(Rng::Mix(Rng::Mix(o.seed, 0x70726972 /* "prir" */), s.id));
          s.sensitivity = std::clamp(s.sensitivity + o.sensitivity_noise * rng.Normal(), 0.0, 1.0);
          break;
        }
      }
    }
    for (size_t p = 0; p < runs.size(); ++p) {
      PolicyRun& run = runs[p];
      std::vector<Sample> batch = std::move(run.carried);
      run.carried.clear();
      batch.insert(batch.end(), fresh.begin(), fresh.end());
      if (!run.row.context_parallel) {
        for (Sample& s : batch) {
          if (s.length > o.capacity) {
            s.length = o.capacity;
            s.segments.clear();
          }
        }
      }
      std::map<uint64_t, const Sample*> by_id;  // to carry deferred samples to the next step
      for (const Sample& s : batch) by_id[s.id] = &s;

      const auto start = std::chrono::steady_clock::now();
      absl::StatusOr<StepPlan> plan = PlanStep(batch, run.config, run.model, run.recall);
      run.plan_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (!plan.ok()) {
        return absl::Status(plan.status().code(),
                            absl::StrCat("step ", step, " policy ", PolicyName(run.policy), ": ",
                                         plan.status().message()));
      }
      for (uint64_t id : plan->deferred_ids) run.carried.push_back(*by_id[id]);

      // Execute with the hidden truth. Noise per micro-batch and per recall measurement comes
      // from streams that depend on the seed, the step and the policy only (not on which other
      // policies run), so a policy's figures are the same whatever --policies lists.
      // A context-parallel row has a stream of its own (its policy number plus 16 per shard
      // policy), so the rows without it keep their figures.
      const uint64_t stream =
          static_cast<uint64_t>(run.policy) +
          (run.row.context_parallel ? 16 * (static_cast<uint64_t>(run.row.shard_policy) + 1) : 0);
      Rng noise(Rng::Mix(Rng::Mix(o.seed, static_cast<uint64_t>(step) + 1000), stream));
      Rng measurement(Rng::Mix(Rng::Mix(o.seed, static_cast<uint64_t>(step) + 500000), stream));
      std::vector<Observation> observations;
      std::vector<RecallObservation> recall_observations;
      std::vector<RecallObservation> true_observations;
      std::vector<double> compute(o.ranks, 0.0);
      double placed_tokens = 0.0;
      std::vector<std::vector<double>> timeline(o.ranks);
      std::vector<std::vector<double>> seconds_of(o.ranks);  // [rank][micro-batch]
      for (int r = 0; r < o.ranks; ++r) {
        const RankPlan& rank = plan->ranks[r];
        seconds_of[r].assign(rank.micro_batches.size(), 0.0);
        for (size_t m = 0; m < rank.micro_batches.size(); ++m) {
          const MicroBatchPlan& mb = rank.micro_batches[m];
          double truth_seconds = 0.0;
          double exchange_seconds = 0.0;
          for (const PlannedSample& ps : mb.samples) {
            const Sample& sample = *by_id[ps.id];
            const double planner_sensitivity = sample.sensitivity;
            const double sensitivity = hidden_sensitivity[ps.id];
            const int layers = ps.layer_densities.empty() ? 0 : o.shape.layers;
            const std::vector<int64_t> documents = ps.Documents();
            if (ps.sharded() && ps.shard_index == 0) run.split_documents += 1.0;
            for (size_t d = 0; d < documents.size(); ++d) {
              const int64_t length = documents[d];
              // A shard weighs its query tokens: a split document's shards add up to it.
              const double w = static_cast<double>(ps.sharded() ? ps.QueryTokens() : length);
              const HiddenRecallCurve curve =
                  DrawHiddenRecallCurve(o.seed, ps.id, static_cast<int>(d), length, sensitivity);
              // Cost and recall in every layer: one pass at `density`, or the layers' mean.
              double recall = 0.0;
              double attention = 0.0;
              const int passes = std::max(layers, 1);
              for (int l = 0; l < passes; ++l) {
                const double rho = LayerDensity(ps, layers > 0 ? l : -1);
                recall += TrueRecall(curve, KeptShare(length, rho, o.shape));
                attention += ps.sharded()
                                 ? TrueShardSeconds(o, length, ps.shard_begin, ps.shard_end, rho)
                                 : TrueAttentionSeconds(o, truth_coef, length, rho);
              }
              recall /= passes;
              attention /= passes;
              if (ps.sharded()) {  // TrueShardSeconds counts the shard's other work already
                truth_seconds += attention;
                exchange_seconds += TrueExchangeSeconds(o, ps.shard_index, ps.shard_begin);
              } else {
                truth_seconds += attention + TrueOtherSeconds(o, truth_coef, length);
              }
              const double predicted =
                  RecallAt(run.recall.Exponent(length, planner_sensitivity), ps.density);
              run.weighted_density += w * ps.density;
              run.weighted_recall += w * recall;
              run.weighted_predicted_recall += w * predicted;
              placed_tokens += w;
              BucketTotals& bucket = run.buckets[RecallBucket(length, o.capacity)];
              bucket.tokens += w;
              bucket.true_recall += w * recall;
              bucket.predicted_recall += w * predicted;
              true_observations.push_back({length, -1, ps.density, recall});
              // The worker's measurement: the mean over a few sampled query rows.
              const double rows = static_cast<double>(std::min<int64_t>(o.recall_rows, length));
              const double sd = std::sqrt(recall * (1.0 - recall) / rows);
              const double measured = std::clamp(recall + sd * measurement.Normal(), 0.0, 1.0);
              recall_observations.push_back({length, -1, ps.density, measured});
            }
          }
          double seconds = 0.0;
          if (!mb.samples.empty()) {
            const double factor = std::max(kMinNoiseFactor, 1.0 + o.noise * noise.Normal());
            // The network is not the GPU: the exchange is not scaled by the rank's speed.
            seconds = speed[r] * (truth_seconds + truth_coef.per_micro_batch) * factor +
                      exchange_seconds * factor;
            observations.push_back({r, static_cast<int>(m), run.model.PlanFeatures(mb), seconds,
                                    exchange_seconds * factor});
            run.exchange_seconds += exchange_seconds * factor;
          }
          compute[r] += seconds;
          seconds_of[r][m] = seconds;
          timeline[r].push_back(seconds);
        }
      }
      run.compute_seconds += std::accumulate(compute.begin(), compute.end(), 0.0);
      run.tokens += placed_tokens;
      // The step ends when the last rank does. A micro-batch that holds shards starts when every
      // rank of its groups (and of groups linked to them through a shared rank) has finished
      // its previous micro-batch: the shards exchange with each other from their start.
      std::vector<double> finish(o.ranks, 0.0);
      const size_t micro_batches = static_cast<size_t>(o.micro_batches);
      for (size_t m = 0; m < micro_batches; ++m) {
        std::vector<int> parent(o.ranks);
        for (int r = 0; r < o.ranks; ++r) parent[r] = r;
        auto find = [&](int r) {
          while (parent[r] != r) r = parent[r] = parent[parent[r]];
          return r;
        };
        for (int r = 0; r < o.ranks; ++r) {
          for (const PlannedSample& ps : plan->ranks[r].micro_batches[m].samples) {
            for (int peer : ps.shard_group) parent[find(peer)] = find(r);
          }
        }
        std::vector<double> start(o.ranks, 0.0);
        for (int r = 0; r < o.ranks; ++r) start[find(r)] = std::max(start[find(r)], finish[r]);
        for (int r = 0; r < o.ranks; ++r) finish[r] = start[find(r)] + seconds_of[r][m];
      }
      const double step_seconds = *std::max_element(finish.begin(), finish.end());
      run.result.step_seconds.push_back(step_seconds);
      run.imbalance.push_back(ImbalanceRatio(compute));
      run.bubble.push_back(BubbleRatio(compute));
      run.gaps.push_back(plan->gap);
      if (step >= std::min(o.warmup_steps, o.steps - 1)) {
        for (int r = 0; r < o.ranks; ++r) {
          if (compute[r] > 0) {
            run.errors.push_back(std::fabs(plan->ranks[r].predicted_seconds - compute[r]) /
                                 compute[r]);
          }
        }
      }
      if (step == o.steps - 1) {
        run.result.timeline = std::move(timeline);
        run.result.timeline_step_seconds = step_seconds;
      }
      if (absl::Status s = run.model.ObserveStep(std::move(observations)); !s.ok()) return s;
      if (absl::Status s = run.recall.ObserveStep(recall_observations); !s.ok()) return s;
      if (absl::Status s = run.truth_fit.ObserveStep(true_observations); !s.ok()) return s;
    }
  }

  SimReport report;
  SimScenario& sc = report.scenario;
  sc.trace = o.trace;
  sc.pack_length = o.pack_length;
  sc.ranks = o.ranks;
  sc.micro_batches = o.micro_batches;
  sc.capacity = o.capacity;
  sc.fill = o.fill;
  sc.steps = o.steps;
  sc.mode = o.mode == DstMode::kQuantile ? absl::StrFormat("quantile:%g", o.quantile)
                                         : std::string(DstModeName(o.mode));
  sc.slow_ranks = static_cast<int>(SlowRanks(o).size());
  sc.slow_factor = o.slow_factor;
  sc.noise = o.noise;
  sc.seed = o.seed;
  sc.density_default = o.density_default;
  sc.density_min = o.density_min;
  sc.cost_truth = std::string(CostTruthName(o.cost_truth));
  sc.sensitivity_prior = o.sensitivity_prior == SensitivityPrior::kNone ? "none"
                         : o.sensitivity_prior == SensitivityPrior::kTrue
                             ? "true"
                             : absl::StrFormat("noisy:%g", o.sensitivity_noise);
  sc.recall_rows = o.recall_rows;
  sc.bucket_recall_margin = o.bucket_recall_margin;
  sc.document_recall_floor = o.document_recall_floor;
  sc.max_shards = o.max_shards;
  double sequential_mean = 0.0;
  double flops_mean = 0.0;
  for (PolicyRun& run : runs) {
    PolicyResult& r = run.result;
    r.policy = run.policy;
    double sum = 0.0;
    for (double t : r.step_seconds) sum += t;
    r.mean_step_seconds = sum / static_cast<double>(r.step_seconds.size());
    auto mean_of = [](const std::vector<double>& v) {
      double s = 0.0;
      for (double x : v) s += x;
      return v.empty() ? 0.0 : s / static_cast<double>(v.size());
    };
    r.imbalance_ratio = mean_of(run.imbalance);
    r.bubble_ratio = mean_of(run.bubble);
    r.mean_density = run.tokens > 0 ? run.weighted_density / run.tokens : 0.0;
    r.mean_recall = run.tokens > 0 ? run.weighted_recall / run.tokens : 0.0;
    r.mean_predicted_recall = run.tokens > 0 ? run.weighted_predicted_recall / run.tokens : 0.0;
    for (int b = 0; b < kRecallBuckets; ++b) {
      const BucketTotals& t = run.buckets[b];
      BucketRecallResult out;
      out.bucket = b;
      out.label = RecallBucketLabel(b, o.capacity);
      out.tokens = t.tokens;
      out.true_recall = t.tokens > 0 ? t.true_recall / t.tokens : 0.0;
      out.predicted_recall = t.tokens > 0 ? t.predicted_recall / t.tokens : 0.0;
      out.learned_exponent = run.recall.Exponent(RecallBucketRange(b, o.capacity).min, 0.0);
      out.truth_exponent = run.truth_fit.Exponent(RecallBucketRange(b, o.capacity).min, 0.0);
      out.prior_exponent = RecallExponent(0.0);
      r.buckets.push_back(out);
    }
    r.median_gap = Quantile(run.gaps, 0.5);
    r.median_prediction_error = Quantile(run.errors, 0.5);
    r.mean_plan_seconds = run.plan_seconds / o.steps;
    r.name = SimPolicyName(run.row);
    r.split_documents = run.split_documents / o.steps;
    r.exchange_share = run.compute_seconds > 0 ? run.exchange_seconds / run.compute_seconds : 0.0;
    r.learned_speed_factors = run.model.speed_factors();
    if (!run.row.context_parallel && run.policy == Policy::kSequential) {
      sequential_mean = r.mean_step_seconds;
    }
    if (!run.row.context_parallel && run.policy == Policy::kFlops) flops_mean = r.mean_step_seconds;
  }
  for (PolicyRun& run : runs) {
    PolicyResult& r = run.result;
    r.speedup_vs_sequential = sequential_mean > 0 ? sequential_mean / r.mean_step_seconds : 0.0;
    r.speedup_vs_flops = flops_mean > 0 ? flops_mean / r.mean_step_seconds : 0.0;
    report.results.push_back(std::move(r));
  }
  return report;
}

}  // namespace sparsebalance
