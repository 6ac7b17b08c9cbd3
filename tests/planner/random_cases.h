// Random planning problems for the planner's property tests: configs of 1-64 ranks and 1-8
// micro-batches, batches with long-tail lengths, sensitivities, groups and pre-packed samples,
// and latency models with per-rank speed factors. Everything is drawn from one seed, so a
// failing case is reproduced by its seed alone.
//
//   RandomCase c = MakeRandomCase(seed);
//   LatencyModel model = MakeModel(c.config, c.speed);
//   absl::StatusOr<StepPlan> plan = PlanStep(c.batch, c.config, model);
#ifndef SPARSEBALANCE_TESTS_PLANNER_RANDOM_CASES_H_
#define SPARSEBALANCE_TESTS_PLANNER_RANDOM_CASES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"
#include "planner/latency_model.h"
#include "planner/profile_table.h"
#include "planner/random.h"
#include "planner/recall_model.h"
#include "planner/traces.h"
#include "planner/types.h"

namespace sparsebalance {
namespace test_util {

// Roughly an 8B model on one H100 (seconds per active block, token, document, micro-batch),
// as sb-sim's ground truth: attention is about 2.7x the linear part at 128K dense.
inline constexpr CostCoefficients kTestPrior{1.7e-5, 1e-4, 2e-3, 0.05};

// Property tests draw this many random cases; a broken invariant shows in many of them, so a
// FailureBudget reports the first few in full, not all of them.
inline constexpr int kRandomCases = 200;

// Whether a plan was refused for a group that fits no rank even with its micro-batches empty
// (under either overflow policy: sample_assigner.cc's Overflow), which random cases with groups
// can draw; tests of other properties skip such cases.
inline bool RefusedAsAGroupThatFitsNoRank(const absl::Status& status) {
  return status.code() == absl::StatusCode::kInvalidArgument &&
         absl::StrContains(status.message(), "does not fit any rank even with its");
}
inline constexpr int kMaxReportedFailures = 3;

struct RandomCase {
  uint64_t seed = 0;
  PlannerConfig config;
  std::vector<Sample> batch;
  std::vector<double> speed;  // per rank, for the latency model
};

inline double LogUniform(Rng& rng, double lo, double hi) {
  return std::exp(std::log(lo) + rng.Uniform() * (std::log(hi) - std::log(lo)));
}

inline const std::vector<DstMode>& AllDstModes() {
  static const auto* const kAll =
      new std::vector<DstMode>{DstMode::kMin, DstMode::kMean, DstMode::kMax, DstMode::kQuantile};
  return *kAll;
}

// A valid config and batch. `max_samples` bounds the batch size (and so the test's time).
inline RandomCase MakeRandomCase(uint64_t seed, int max_samples = 1200) {
  Rng rng(Rng::Mix(seed, 0x5eedULL));
  RandomCase c;
  c.seed = seed;
  PlannerConfig& config = c.config;
  config.ranks = 1 + static_cast<int>(rng.NextU64() % 64);
  config.micro_batches = 1 + static_cast<int>(rng.NextU64() % 8);
  config.micro_batch_capacity = static_cast<int64_t>(LogUniform(rng, 256.0, 131072.0));
  config.shape.block_size = rng.NextU64() % 2 == 0 ? 64 : 128;
  config.shape.local_blocks = static_cast<int>(rng.NextU64() % 4);
  config.density_min = 0.02 + 0.18 * rng.Uniform();
  config.density_max =
      rng.NextU64() % 2 == 0
          ? 1.0
          : config.density_min + (1.0 - config.density_min) * (0.3 + 0.7 * rng.Uniform());
  config.density_default =
      config.density_min + (config.density_max - config.density_min) * 0.7 * rng.Uniform();
  config.policy = AllPolicies()[rng.NextU64() % AllPolicies().size()];
  config.dst_mode = AllDstModes()[rng.NextU64() % AllDstModes().size()];
  config.dst_quantile = rng.Uniform();
  config.overflow = rng.NextU64() % 3 == 0 ? OverflowPolicy::kError : OverflowPolicy::kDefer;

  // Fill: up to 60% of the step's tokens under kError (so that it usually fits), up to 130%
  // under kDefer (so that some steps overflow).
  const double capacity = static_cast<double>(config.ranks) * config.micro_batches *
                          static_cast<double>(config.micro_batch_capacity);
  const double fill = (config.overflow == OverflowPolicy::kError ? 0.6 : 1.3) * rng.Uniform();
  const int64_t budget = std::max<int64_t>(1, static_cast<int64_t>(fill * capacity));
  const bool grouped = rng.NextU64() % 3 == 0;
  const int64_t cap = config.micro_batch_capacity;
  int64_t total = 0;
  while (total < budget && static_cast<int>(c.batch.size()) < max_samples) {
    Sample s;
    s.id = Rng::Mix(seed, c.batch.size());
    const uint64_t kind = rng.NextU64() % 20;
    if (kind == 0) {
      s.length = cap;  // exactly the capacity
    } else if (kind == 1) {
      s.length = 1;
    } else if (kind < 6) {
      s.length = static_cast<int64_t>(LogUniform(rng, std::max(1.0, cap / 4.0), cap));
    } else {
      s.length = static_cast<int64_t>(LogUniform(rng, 1.0, std::max(1.0, cap / 4.0)));
    }
    s.length = std::clamp<int64_t>(s.length, 1, cap);
    const uint64_t sensitivity_kind = rng.NextU64() % 20;
    if (sensitivity_kind < 10) {
      s.sensitivity = 0.0;
    } else if (sensitivity_kind < 15) {
      s.sensitivity = rng.Uniform();
    } else if (sensitivity_kind < 19) {
      s.sensitivity = DrawSensitivity(rng);
    } else {
      s.sensitivity = 1.0;
    }
    if (grouped && rng.NextU64() % 4 == 0) {
      s.group = 1 + rng.NextU64() % std::max<uint64_t>(1, c.batch.size() / 4 + 1);
    }
    if (s.length >= 2 && rng.NextU64() % 10 == 0) {
      const int pieces = 2 + static_cast<int>(rng.NextU64() % 4);
      int64_t left = s.length;
      for (int k = 0; k < pieces - 1 && left > 1; ++k) {
        const int64_t piece = 1 + static_cast<int64_t>(rng.NextU64() % (left - 1));
        s.segments.push_back(piece);
        left -= piece;
      }
      s.segments.push_back(left);
    }
    total += s.length;
    c.batch.push_back(s);
  }
  c.speed.assign(config.ranks, 1.0);
  if (rng.NextU64() % 2 == 0) {
    for (double& h : c.speed) {
      if (rng.NextU64() % 5 == 0) h = 0.5 + 1.5 * rng.Uniform();
    }
  }
  return c;
}

// A step of `ranks` x `micro_batches` micro-batches of `capacity` tokens; the rest default.
inline PlannerConfig StepConfig(int ranks, int micro_batches, int64_t capacity,
                                OverflowPolicy overflow = PlannerConfig().overflow) {
  PlannerConfig config;
  config.ranks = ranks;
  config.micro_batches = micro_batches;
  config.micro_batch_capacity = capacity;
  config.overflow = overflow;
  return config;
}

// A model with the test prior and the given speed factors (one per rank; none: all 1).
inline LatencyModel MakeModel(const PlannerConfig& config, const std::vector<double>& speed = {},
                              const CostCoefficients& prior = kTestPrior) {
  LatencyModel model(config.shape, config.ranks, prior);
  if (speed.empty()) return model;
  LatencyModelState state = model.state();
  state.speed_factors = speed;
  model.set_state(state);
  return model;
}

inline std::vector<double> BaseDensities(const std::vector<Sample>& batch,
                                         const PlannerConfig& config) {
  std::vector<double> base;
  base.reserve(batch.size());
  for (const Sample& s : batch) base.push_back(BaseDensity(s.sensitivity, config));
  return base;
}

// A recall model that has learned per-layer curves (so that plans carry layer densities) and
// other exponents per length bucket than the prior's.
inline RecallModel LearnedRecall(const PlannerConfig& config) {
  RecallModel model(config.micro_batch_capacity, config.shape.layers);
  std::vector<RecallObservation> observations;
  for (int b = 0; b < kRecallBuckets; ++b) {
    const int64_t length = RecallBucketRange(b, config.micro_batch_capacity).min;
    for (int layer = -1; layer < config.shape.layers; ++layer) {
      const double g = layer < 0 ? 3.0 : 1.5 + 6.0 * layer / config.shape.layers + 0.3 * b;
      for (int k = 1; k <= 20; ++k) {
        const double rho = 0.05 * k;
        observations.push_back({length, layer, rho, 1.0 - std::pow(1.0 - rho, g)});
      }
    }
  }
  EXPECT_TRUE(model.ObserveStep(observations).ok());
  return model;
}

// One step of the built-in pretraining trace filling `fill` of the step's tokens.
inline std::vector<Sample> TraceBatch(const PlannerConfig& config, uint64_t seed, double fill,
                                      const std::string& trace = "pretrain") {
  absl::StatusOr<TraceGenerator> generator = TraceGenerator::Builtin(trace, seed);
  if (!generator.ok()) return {};
  const double capacity = static_cast<double>(config.ranks) * config.micro_batches *
                          static_cast<double>(config.micro_batch_capacity);
  return generator->NextBatch(static_cast<int64_t>(fill * capacity));
}

// A short description of a case for failure messages.
inline std::string Describe(const RandomCase& c) {
  const PlannerConfig& k = c.config;
  return absl::StrCat("seed ", c.seed, ": ", c.batch.size(), " samples, ", k.ranks, " ranks x ",
                      k.micro_batches, " x ", k.micro_batch_capacity, " tokens, policy ",
                      PolicyName(k.policy), ", dst ", DstModeName(k.dst_mode), " q ",
                      k.dst_quantile, ", overflow ", OverflowPolicyName(k.overflow), ", density [",
                      k.density_min, ", ", k.density_default, ", ", k.density_max, "], block ",
                      k.shape.block_size, " local ", k.shape.local_blocks);
}

// Property tests over many cases: the failures of the first few failing cases are reported in
// full, later failing cases are only counted (one broken invariant would otherwise print
// thousands of lines), and Summarize() reports that count.
//
//   FailureBudget budget;  // kMaxReportedFailures
//   for (...) budget.Run([&] { ExpectValidPlan(...); });
//   budget.Summarize();
class FailureBudget {
 public:
  explicit FailureBudget(int reported_cases = kMaxReportedFailures) : left_(reported_cases) {}

  template <typename Check>
  void Run(Check&& check) {
    ++cases_;
    if (left_ > 0) {
      const int before = FailureCount();
      check();
      if (FailureCount() > before) {
        --left_;
        ++failed_;
      }
      return;
    }
    ::testing::TestPartResultArray results;
    {
      ::testing::ScopedFakeTestPartResultReporter reporter(
          ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
      check();
    }
    for (int i = 0; i < results.size(); ++i) {
      if (results.GetTestPartResult(i).failed()) {
        ++failed_;
        ++silenced_;
        break;
      }
    }
  }

  void Summarize() const {
    if (silenced_ > 0) {
      ADD_FAILURE() << failed_ << " of " << cases_ << " cases failed; " << silenced_
                    << " of them are not shown";
    }
  }

 private:
  static int FailureCount() {
    const ::testing::TestResult* result =
        ::testing::UnitTest::GetInstance()->current_test_info()->result();
    int failed = 0;
    for (int i = 0; i < result->total_part_count(); ++i) {
      if (result->GetTestPartResult(i).failed()) ++failed;
    }
    return failed;
  }

  int left_;
  int cases_ = 0;
  int failed_ = 0;
  int silenced_ = 0;
};

}  // namespace test_util
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_TESTS_PLANNER_RANDOM_CASES_H_
