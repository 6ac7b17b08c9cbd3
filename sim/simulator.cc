#include "sim/simulator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "contract/block_geometry.h"
#include "contract/step_figures.h"
#include "planner/latency_model.h"
#include "planner/planner.h"
#include "planner/random.h"

namespace sparsebalance {
namespace {

// Multiplicative noise is clamped so that a measured time stays positive.
constexpr double kMinNoiseFactor = 0.5;

// What one policy accumulates over the run.
struct PolicyRun {
  PolicyRun(Policy policy, const PlannerConfig& config, const CostCoefficients& prior)
      : policy(policy), config(config), model(config.shape, config.ranks, prior) {
    this->config.policy = policy;
  }
  Policy policy;
  PlannerConfig config;
  LatencyModel model;
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
};

}  // namespace

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
      const double blocks = static_cast<double>(
          ActiveBlocks(length, density, o.shape.block_size, o.shape.local_blocks));
      const double seconds =
          (0.6 * truth.per_block * blocks + 1.4 * truth.per_token * static_cast<double>(length)) /
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
  PlannerConfig config;
  config.ranks = o.ranks;
  config.micro_batches = o.micro_batches;
  config.micro_batch_capacity = o.capacity;
  config.shape = o.shape;
  config.density_default = o.density_default;
  config.density_min = o.density_min;
  config.density_max = o.density_max;
  config.dst_mode = o.mode;
  config.dst_quantile = o.quantile;
  config.overflow = OverflowPolicy::kDefer;
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  if (o.steps < 1) return absl::InvalidArgumentError("--steps must be at least 1");
  if (!(o.fill > 0.0 && o.fill <= 1.0)) return absl::InvalidArgumentError("--fill needs (0, 1]");
  if (!(o.noise >= 0.0 && o.noise < 1.0)) return absl::InvalidArgumentError("--noise needs [0, 1)");
  if (!(o.slow_factor > 0.0)) return absl::InvalidArgumentError("--slow_factor needs > 0");
  if (o.policies.empty()) return absl::InvalidArgumentError("--policies names no policy");

  absl::StatusOr<CostCoefficients> prior =
      FitProfile(o.has_profile ? o.profile : SyntheticProfile(o), o.shape);
  if (!prior.ok()) return prior.status();
  const CostCoefficients truth_coef = GroundTruthCoefficients(o);
  // The truth is a latency model that never learns, with the hidden speed factors.
  LatencyModel truth(o.shape, o.ranks, truth_coef);
  LatencyModelState truth_state = truth.state();
  for (int r : SlowRanks(o)) truth_state.speed_factors[r] = o.slow_factor;
  truth.set_state(truth_state);

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
  for (Policy p : o.policies) runs.emplace_back(p, config, *prior);

  for (int step = 0; step < o.steps; ++step) {
    std::vector<Sample> fresh = generator->NextBatch(budget);
    // Documents longer than a micro-batch cannot be trained on as they are; a real pipeline
    // truncates them, and so does the simulator.
    for (Sample& s : fresh) {
      if (s.length > o.capacity) {
        s.length = o.capacity;
        s.segments.clear();
      }
    }
    for (size_t p = 0; p < runs.size(); ++p) {
      PolicyRun& run = runs[p];
      std::vector<Sample> batch = std::move(run.carried);
      run.carried.clear();
      batch.insert(batch.end(), fresh.begin(), fresh.end());
      std::map<uint64_t, const Sample*> by_id;  // to carry deferred samples to the next step
      for (const Sample& s : batch) by_id[s.id] = &s;

      const auto start = std::chrono::steady_clock::now();
      absl::StatusOr<StepPlan> plan = PlanStep(batch, run.config, run.model);
      run.plan_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (!plan.ok()) {
        return absl::Status(plan.status().code(),
                            absl::StrCat("step ", step, " policy ", PolicyName(run.policy), ": ",
                                         plan.status().message()));
      }
      for (uint64_t id : plan->deferred_ids) run.carried.push_back(*by_id[id]);

      // Execute with the hidden truth, noise per micro-batch from a stream that depends on
      // the seed, the step and the policy only (not on which other policies run), so a
      // policy's figures are the same whatever --policies lists.
      Rng noise(Rng::Mix(Rng::Mix(o.seed, static_cast<uint64_t>(step) + 1000),
                         static_cast<uint64_t>(run.policy)));
      std::vector<Observation> observations;
      std::vector<double> compute(o.ranks, 0.0);
      double placed_tokens = 0.0;
      std::vector<std::vector<double>> timeline(o.ranks);
      for (int r = 0; r < o.ranks; ++r) {
        const RankPlan& rank = plan->ranks[r];
        for (size_t m = 0; m < rank.micro_batches.size(); ++m) {
          const MicroBatchPlan& mb = rank.micro_batches[m];
          const MicroBatchFeatures features = truth.PlanFeatures(mb);
          for (const PlannedSample& p : mb.samples) {
            const double w = static_cast<double>(p.length);
            placed_tokens += w;
            run.weighted_density += w * p.density;
          }
          double seconds = 0.0;
          if (!mb.samples.empty()) {
            const double factor = std::max(kMinNoiseFactor, 1.0 + o.noise * noise.Normal());
            seconds = truth.PredictSeconds(r, features) * factor;
            observations.push_back({r, static_cast<int>(m), features, seconds});
          }
          compute[r] += seconds;
          timeline[r].push_back(seconds);
        }
      }
      // Recall is the planner's recall model (there is no hidden truth for it): the plan's
      // token-weighted prediction over the samples it placed.
      run.tokens += placed_tokens;
      run.weighted_recall += plan->predicted_recall * placed_tokens;
      const double step_seconds = *std::max_element(compute.begin(), compute.end());
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
    r.median_gap = Quantile(run.gaps, 0.5);
    r.median_prediction_error = Quantile(run.errors, 0.5);
    r.mean_plan_seconds = run.plan_seconds / o.steps;
    r.learned_speed_factors = run.model.speed_factors();
    if (run.policy == Policy::kSequential) sequential_mean = r.mean_step_seconds;
    if (run.policy == Policy::kFlops) flops_mean = r.mean_step_seconds;
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
