// The bars, measured by the simulator (deterministic for a seed: these are properties
// of the algorithms under the simulated cluster, not wall-clock figures).
#include "sim/simulator.h"

#include <algorithm>
#include <map>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "sim/sim_report.h"

namespace sparsebalance {
namespace {

using ::testing::HasSubstr;

// Scenario S1 of the README: pretrain documents, 32 ranks x 4 micro-batches of 131072
// tokens, 85% full, density 0.3 (min 0.05), attention of a dense 128K document 2.7x its linear
// cost, 5% noise.
SimOptions S1(uint64_t seed) {
  SimOptions o;
  o.trace = "pretrain";
  o.ranks = 32;
  o.micro_batches = 4;
  o.capacity = 131072;
  o.fill = 0.85;
  o.steps = 30;
  o.seed = seed;
  o.noise = 0.05;
  o.density_default = 0.3;
  o.density_min = 0.05;
  o.attention_ratio = 2.7;
  return o;
}

std::map<Policy, PolicyResult> ByPolicy(const SimReport& report) {
  std::map<Policy, PolicyResult> out;
  for (const PolicyResult& r : report.results) out[r.policy] = r;
  return out;
}

class S1BarsTest : public ::testing::TestWithParam<uint64_t> {};

TEST_P(S1BarsTest, PoliciesMeetTheirBars) {
  absl::StatusOr<SimReport> report = RunSimulation(S1(GetParam()));
  ASSERT_TRUE(report.ok()) << report.status();
  std::map<Policy, PolicyResult> r = ByPolicy(*report);
  const PolicyResult& seq = r[Policy::kSequential];
  const PolicyResult& tokens = r[Policy::kTokens];
  const PolicyResult& flops = r[Policy::kFlops];
  const PolicyResult& sab = r[Policy::kSab];
  const PolicyResult& dst = r[Policy::kDst];
  const PolicyResult& sb = r[Policy::kSparseBalance];

  // SAB: within 2% of the lower bound (median over steps).
  EXPECT_LE(sab.median_gap, 0.02);
  // SparseBalance: >= 1.05x flops, >= 1.08x tokens, recall no lower than sequential's.
  EXPECT_GE(flops.mean_step_seconds / sb.mean_step_seconds, 1.05);
  EXPECT_GE(tokens.mean_step_seconds / sb.mean_step_seconds, 1.08);
  EXPECT_GE(sb.mean_recall, seq.mean_recall);
  // DST alone: faster than sequential, recall at least 5 points higher.
  EXPECT_LT(dst.mean_step_seconds, seq.mean_step_seconds);
  EXPECT_GE(dst.mean_recall, seq.mean_recall + 0.05);
  // The baselines keep the default density, so their recall is the same.
  EXPECT_NEAR(tokens.mean_recall, seq.mean_recall, 1e-12);
  // Every policy's latency model predicts rank times well (balanced plans give it poorly
  // excited, noisy steps to learn from).
  for (const auto& [policy, result] : r) {
    EXPECT_LE(result.median_prediction_error, 0.05) << PolicyName(policy);
  }
  // The speedups in the report agree with the step times.
  EXPECT_NEAR(sb.speedup_vs_sequential, seq.mean_step_seconds / sb.mean_step_seconds, 1e-12);
}

INSTANTIATE_TEST_SUITE_P(Seeds, S1BarsTest, ::testing::Values(1, 2, 3));

TEST(SimulatorTest, SlowRankIsFoundAndSparseBalanceOutrunsSequential) {
  SimOptions o = S1(1);
  o.slow_ranks = 1;
  o.slow_factor = 1.5;
  o.policies = {Policy::kSequential, Policy::kSparseBalance};
  absl::StatusOr<SimReport> report = RunSimulation(o);
  ASSERT_TRUE(report.ok()) << report.status();
  std::map<Policy, PolicyResult> r = ByPolicy(*report);
  EXPECT_GE(r[Policy::kSequential].mean_step_seconds / r[Policy::kSparseBalance].mean_step_seconds,
            1.3);
  const int slow = SlowRanks(o).front();
  for (const PolicyResult& result : report->results) {
    // The latency model: median prediction error <= 5% after 20 steps, slow rank's factor
    // within 10% of 1.5 (the factors are normalised so the median rank is 1).
    EXPECT_LE(result.median_prediction_error, 0.05) << PolicyName(result.policy);
    EXPECT_NEAR(result.learned_speed_factors[slow], 1.5, 0.15) << PolicyName(result.policy);
    for (int rank = 0; rank < o.ranks; ++rank) {
      if (rank != slow) {
        EXPECT_NEAR(result.learned_speed_factors[rank], 1.0, 0.1) << rank;
      }
    }
  }
}

TEST(SimulatorTest, SameSeedSameReportOtherSeedOtherReport) {
  SimOptions o = S1(5);
  o.steps = 4;
  o.ranks = 8;
  absl::StatusOr<SimReport> a = RunSimulation(o);
  absl::StatusOr<SimReport> b = RunSimulation(o);
  ASSERT_TRUE(a.ok() && b.ok());
  for (size_t i = 0; i < a->results.size(); ++i) {
    EXPECT_EQ(a->results[i].step_seconds, b->results[i].step_seconds);
    EXPECT_EQ(a->results[i].timeline, b->results[i].timeline);
  }
  o.seed = 6;
  absl::StatusOr<SimReport> c = RunSimulation(o);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->results[0].step_seconds, c->results[0].step_seconds);
}

TEST(SimulatorTest, APolicysFiguresDoNotDependOnTheOtherPoliciesListed) {
  SimOptions all = S1(4);
  all.steps = 3;
  SimOptions one = all;
  one.policies = {Policy::kSparseBalance};
  absl::StatusOr<SimReport> a = RunSimulation(all);
  absl::StatusOr<SimReport> b = RunSimulation(one);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(ByPolicy(*a)[Policy::kSparseBalance].step_seconds, b->results[0].step_seconds);
}

TEST(SimulatorTest, PackedProlongAndManyRanksRun) {
  SimOptions packed = S1(1);
  packed.pack_length = 131072;
  packed.steps = 3;
  absl::StatusOr<SimReport> report = RunSimulation(packed);
  ASSERT_TRUE(report.ok()) << report.status();
  for (const PolicyResult& r : report->results) {
    EXPECT_GT(r.mean_step_seconds, 0.0);
    EXPECT_EQ(r.timeline.size(), 32u);
  }
  SimOptions prolong = S1(1);
  prolong.trace = "prolong";
  prolong.steps = 3;
  report = RunSimulation(prolong);
  ASSERT_TRUE(report.ok()) << report.status();
  std::map<Policy, PolicyResult> r = ByPolicy(*report);
  EXPECT_LT(r[Policy::kSparseBalance].mean_step_seconds, r[Policy::kSequential].mean_step_seconds);
}

TEST(SimulatorTest, TimelineMatchesStepTime) {
  SimOptions o = S1(3);
  o.steps = 2;
  absl::StatusOr<SimReport> report = RunSimulation(o);
  ASSERT_TRUE(report.ok());
  for (const PolicyResult& r : report->results) {
    double slowest = 0.0;
    for (const std::vector<double>& rank : r.timeline) {
      ASSERT_EQ(rank.size(), 4u);
      double sum = 0.0;
      for (double t : rank) sum += t;
      slowest = std::max(slowest, sum);
    }
    EXPECT_DOUBLE_EQ(slowest, r.timeline_step_seconds);
    EXPECT_DOUBLE_EQ(r.step_seconds.back(), r.timeline_step_seconds);
  }
}

TEST(SimulatorTest, BadOptionsAreErrorsNamingTheFlag) {
  SimOptions o = S1(1);
  o.steps = 0;
  EXPECT_THAT(std::string(RunSimulation(o).status().message()), HasSubstr("--steps"));
  o = S1(1);
  o.fill = 1.5;
  EXPECT_THAT(std::string(RunSimulation(o).status().message()), HasSubstr("--fill"));
  o = S1(1);
  o.trace = "nope";
  EXPECT_THAT(std::string(RunSimulation(o).status().message()), HasSubstr("nope"));
  o = S1(1);
  o.ranks = 0;
  EXPECT_THAT(std::string(RunSimulation(o).status().message()), HasSubstr("config.ranks"));
  o = S1(1);
  o.pack_length = 262144;
  EXPECT_THAT(std::string(RunSimulation(o).status().message()), HasSubstr("--pack"));
}

}  // namespace
}  // namespace sparsebalance
