// The bars, measured by the simulator (deterministic for a seed: these are properties
// of the algorithms under the simulated cluster, not wall-clock figures).
#include "sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "absl/strings/match.h"
#include "contract/block_geometry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/recall_model.h"
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
  // SparseBalance (issue 14's bar): >= 1.05x flops and >= 1.08x tokens, with every length
  // bucket's TRUE recall (hidden from the planner, which plans with the curves it learned
  // from simulated reports) within 1 point of sequential's, and overall no lower.
  EXPECT_GE(flops.mean_step_seconds / sb.mean_step_seconds, 1.05);
  EXPECT_GE(tokens.mean_step_seconds / sb.mean_step_seconds, 1.08);
  EXPECT_GE(sb.mean_recall, seq.mean_recall);
  for (size_t b = 0; b < seq.buckets.size(); ++b) {
    EXPECT_GE(sb.buckets[b].true_recall, seq.buckets[b].true_recall - 0.01) << seq.buckets[b].label;
  }
  // DST alone: faster than sequential, true recall at least 5 points higher, and with the
  // bucket guard no bucket more than a point below sequential's either.
  EXPECT_LT(dst.mean_step_seconds, seq.mean_step_seconds);
  EXPECT_GE(dst.mean_recall, seq.mean_recall + 0.05);
  for (size_t b = 0; b < seq.buckets.size(); ++b) {
    EXPECT_GE(dst.buckets[b].true_recall, seq.buckets[b].true_recall - 0.01)
        << seq.buckets[b].label;
  }
  // The baselines keep the default density, so they keep the same true recall in every bucket
  // (they see the same batches, and S1 defers nothing, so every bucket holds the same tokens).
  for (const PolicyResult* baseline : {&tokens, &flops, &sab}) {
    ASSERT_EQ(baseline->buckets.size(), seq.buckets.size());
    for (size_t b = 0; b < seq.buckets.size(); ++b) {
      EXPECT_EQ(baseline->buckets[b].tokens, seq.buckets[b].tokens) << b;
      EXPECT_NEAR(baseline->buckets[b].true_recall, seq.buckets[b].true_recall, 1e-9) << b;
    }
  }
  for (size_t b = 0; b < seq.buckets.size(); ++b) {
    EXPECT_EQ(sb.buckets[b].tokens, seq.buckets[b].tokens) << b;
    EXPECT_GT(seq.buckets[b].tokens, 0.0) << b;  // pretrain fills every bucket
  }
  // Every policy's latency model predicts rank times well (balanced plans give it poorly
  // excited, noisy steps to learn from).
  for (const auto& [policy, result] : r) {
    EXPECT_LE(result.median_prediction_error, 0.05) << PolicyName(policy);
  }
  // The speedups in the report agree with the step times.
  EXPECT_NEAR(sb.speedup_vs_sequential, seq.mean_step_seconds / sb.mean_step_seconds, 1e-12);
}

INSTANTIATE_TEST_SUITE_P(Seeds, S1BarsTest, ::testing::Values(1, 2, 3, 4, 5));

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
    EXPECT_EQ(a->results[i].mean_recall, b->results[i].mean_recall);
    EXPECT_EQ(a->results[i].mean_predicted_recall, b->results[i].mean_predicted_recall);
    for (size_t k = 0; k < a->results[i].buckets.size(); ++k) {
      EXPECT_EQ(a->results[i].buckets[k].true_recall, b->results[i].buckets[k].true_recall);
      EXPECT_EQ(a->results[i].buckets[k].learned_exponent,
                b->results[i].buckets[k].learned_exponent);
    }
  }
  o.seed = 6;
  absl::StatusOr<SimReport> c = RunSimulation(o);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->results[0].step_seconds, c->results[0].step_seconds);
  EXPECT_NE(a->results[0].mean_recall, c->results[0].mean_recall);
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
  EXPECT_EQ(ByPolicy(*a)[Policy::kSparseBalance].mean_recall, b->results[0].mean_recall);
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

// ----------------------------------------------------------------------------------------------
// The hidden recall truth.

// g that the planner's form 1 - (1 - rho)^g needs to match a recall at one density.
double ImpliedExponent(double recall, double density) {
  return std::log(std::max(1.0 - recall, 1e-12)) / std::log(1.0 - density);
}

TEST(HiddenRecallTest, IsNotThePlannersForm) {
  // For the planner's form the implied g is the same at every density; for the truth it is
  // not: anchors keep mass at low densities (high implied g) that a power law then spreads.
  const ModelShape shape;
  int differ = 0;
  const int documents = 200;
  for (int id = 0; id < documents; ++id) {
    const int64_t length = 65536;
    const HiddenRecallCurve c = DrawHiddenRecallCurve(1, id, 0, length, 0.1);
    const double low = ImpliedExponent(TrueRecall(c, KeptShare(length, 0.1, shape)), 0.1);
    const double high = ImpliedExponent(TrueRecall(c, KeptShare(length, 0.5, shape)), 0.5);
    if (std::fabs(low / high - 1.0) > 0.2) ++differ;
  }
  EXPECT_GE(differ, documents * 9 / 10);
}

TEST(HiddenRecallTest, CurvesAreMonotoneAndReachOne) {
  const ModelShape shape;
  for (int64_t length : {64, 1000, 4096, 20000, 131072}) {
    for (int id = 0; id < 50; ++id) {
      const HiddenRecallCurve c = DrawHiddenRecallCurve(3, id, 0, length, 0.2);
      double previous = 0.0;
      for (double rho = 0.01; rho <= 1.0; rho += 0.01) {
        const double r = TrueRecall(c, KeptShare(length, rho, shape));
        EXPECT_GE(r, previous - 1e-12) << length << " " << rho;
        EXPECT_LE(r, 1.0);
        previous = r;
      }
      EXPECT_NEAR(TrueRecall(c, KeptShare(length, 1.0, shape)), 1.0, 1e-12);
    }
  }
}

// Long documents are more sensitive than short ones at the same density, and a share of them
// holds a needle that appears as a step of at least its mass.
TEST(HiddenRecallTest, LongDocumentsAreMoreSensitiveAndSomeHaveNeedles) {
  const ModelShape shape;
  auto mean_recall = [&](int64_t length, int* needles) {
    double sum = 0.0;
    *needles = 0;
    for (int id = 0; id < 1000; ++id) {
      const HiddenRecallCurve c = DrawHiddenRecallCurve(2, id, 0, length, 0.1);
      sum += TrueRecall(c, KeptShare(length, 0.3, shape));
      if (c.needle > 0.0) {
        ++*needles;
        EXPECT_GE(TrueRecall(c, c.needle_threshold) - TrueRecall(c, c.needle_threshold - 1e-9),
                  c.needle - 1e-6);
      }
    }
    return sum / 1000;
  };
  int short_needles = 0;
  int long_needles = 0;
  const double short_recall = mean_recall(1024, &short_needles);
  const double long_recall = mean_recall(65536, &long_needles);
  EXPECT_GE(short_recall - long_recall, 0.05) << short_recall << " " << long_recall;
  // p = 0.03 + 0.3 s and 0.35 + 0.3 s at s = 0.1: about 60 and 380 of 1000.
  EXPECT_NEAR(short_needles, 60, 30);
  EXPECT_NEAR(long_needles, 380, 60);
}

TEST(HiddenRecallTest, KeptShareCountsOnlyNonAnchorBlocks) {
  const ModelShape shape;                       // blocks of 64, one local block
  EXPECT_EQ(KeptShare(128, 0.05, shape), 1.0);  // two query blocks: every block is an anchor
  EXPECT_EQ(KeptShare(131072, 1.0, shape), 1.0);
  const double x = KeptShare(131072, 0.3, shape);
  EXPECT_GT(x, 0.29);
  EXPECT_LT(x, 0.31);
  EXPECT_LT(KeptShare(2048, 0.3, shape), 0.3);  // anchors are a large share of a short one
}

// ----------------------------------------------------------------------------------------------
// The hidden cost truth.

TEST(CostTruthTest, EfficiencyTruthIsOutsideTheLinearClass) {
  SimOptions o;
  const CostCoefficients c = GroundTruthCoefficients(o);
  // Attention seconds per active block: the document's seconds less its linear time and
  // overhead (sim/simulator.h: b L + 1 ms + 2 ms sqrt(L / 128K)).
  auto per_block = [&](int64_t length, double density) {
    const double tokens = static_cast<double>(length);
    const double other = c.per_token * tokens + 1e-3 + 2e-3 * std::sqrt(tokens / 131072.0);
    const double blocks = static_cast<double>(
        ActiveBlocks(length, density, o.shape.block_size, o.shape.local_blocks));
    return (TrueDocumentSeconds(o, length, density) - other) / blocks;
  };
  // A sparse block costs more than a dense one (backward gains less than forward).
  EXPECT_GT(per_block(131072, 0.1), 1.3 * per_block(131072, 1.0));
  // A short document's block costs more than a long one's.
  EXPECT_GT(per_block(1024, 1.0), 1.3 * per_block(131072, 1.0));
  // Dense 128K: attention_ratio x its linear time, as in the linear truth.
  o.cost_truth = CostTruth::kLinear;
  const double linear = TrueDocumentSeconds(o, 131072, 1.0);
  EXPECT_DOUBLE_EQ(linear,
                   c.per_block * static_cast<double>(ActiveBlocks(131072, 1.0, o.shape.block_size,
                                                                  o.shape.local_blocks)) +
                       c.per_token * 131072 + c.per_sample);
  o.cost_truth = CostTruth::kEfficiency;
  EXPECT_NEAR(TrueDocumentSeconds(o, 131072, 1.0), linear + 1e-3, 1e-6 * linear);
}

TEST(CostTruthTest, WithoutNoiseOnlyTheLinearTruthIsPredictedExactly) {
  SimOptions o = S1(1);
  o.noise = 0.0;
  o.policies = {Policy::kSparseBalance};
  o.cost_truth = CostTruth::kLinear;
  absl::StatusOr<SimReport> linear = RunSimulation(o);
  o.cost_truth = CostTruth::kEfficiency;
  absl::StatusOr<SimReport> efficiency = RunSimulation(o);
  ASSERT_TRUE(linear.ok() && efficiency.ok());
  EXPECT_LT(linear->results[0].median_prediction_error, 0.005);
  EXPECT_GT(efficiency->results[0].median_prediction_error,
            2.0 * linear->results[0].median_prediction_error);
}

// ----------------------------------------------------------------------------------------------
// What the planner learns.

// Every policy's recall model moves from its prior (g = 6 at sensitivity 0) toward the best
// fit of its form to the true recall at the densities it planned.
TEST(SimulatorTest, RecallModelLearnsTowardTheTruth) {
  SimOptions o = S1(2);
  o.policies = {Policy::kSequential, Policy::kSparseBalance};
  absl::StatusOr<SimReport> report = RunSimulation(o);
  ASSERT_TRUE(report.ok()) << report.status();
  int checked = 0;
  for (const PolicyResult& r : report->results) {
    for (const BucketRecallResult& b : r.buckets) {
      ASSERT_GT(b.tokens, 0.0);
      EXPECT_EQ(b.prior_exponent, RecallExponent(0.0));
      EXPECT_NE(b.learned_exponent, b.prior_exponent) << PolicyName(r.policy) << " " << b.label;
      if (std::fabs(b.prior_exponent - b.truth_exponent) < 1.5) continue;
      ++checked;
      EXPECT_LT(std::fabs(b.learned_exponent - b.truth_exponent),
                0.5 * std::fabs(b.prior_exponent - b.truth_exponent))
          << PolicyName(r.policy) << " " << b.label << " learned " << b.learned_exponent
          << " truth " << b.truth_exponent;
    }
  }
  EXPECT_GE(checked, 3);
}

// The JSON's buckets add up: token-weighted, the buckets' true and predicted recall are the
// policy's mean recall and mean predicted recall; labels are the planner's.
TEST(SimulatorTest, BucketsAddUpToTheMeans) {
  SimOptions o = S1(3);
  o.steps = 4;
  absl::StatusOr<SimReport> report = RunSimulation(o);
  ASSERT_TRUE(report.ok());
  for (const PolicyResult& r : report->results) {
    ASSERT_EQ(r.buckets.size(), static_cast<size_t>(kRecallBuckets));
    double tokens = 0.0;
    double truth = 0.0;
    double predicted = 0.0;
    for (int b = 0; b < kRecallBuckets; ++b) {
      EXPECT_EQ(r.buckets[b].bucket, b);
      EXPECT_EQ(r.buckets[b].label, RecallBucketLabel(b, o.capacity));
      tokens += r.buckets[b].tokens;
      truth += r.buckets[b].tokens * r.buckets[b].true_recall;
      predicted += r.buckets[b].tokens * r.buckets[b].predicted_recall;
    }
    EXPECT_NEAR(truth / tokens, r.mean_recall, 1e-9);
    EXPECT_NEAR(predicted / tokens, r.mean_predicted_recall, 1e-9);
  }
  EXPECT_TRUE(absl::StrContains(FormatTable(*report), "recall 32K+"));
}

// The planner is told sensitivities only with --sensitivity_prior: the plans change with it,
// noisy:0 is the truth, and the hidden truth (the same documents) does not change.
TEST(SimulatorTest, SensitivityPriorIsWhatThePlannerIsTold) {
  SimOptions o = S1(1);
  o.steps = 3;
  o.policies = {Policy::kSequential, Policy::kSparseBalance};
  auto run = [&](SensitivityPrior prior, double sd) {
    o.sensitivity_prior = prior;
    o.sensitivity_noise = sd;
    absl::StatusOr<SimReport> report = RunSimulation(o);
    EXPECT_TRUE(report.ok());
    return ByPolicy(*report);
  };
  std::map<Policy, PolicyResult> none = run(SensitivityPrior::kNone, 0.0);
  std::map<Policy, PolicyResult> truth = run(SensitivityPrior::kTrue, 0.0);
  std::map<Policy, PolicyResult> noisy0 = run(SensitivityPrior::kNoisy, 0.0);
  std::map<Policy, PolicyResult> noisy = run(SensitivityPrior::kNoisy, 0.2);
  // Sequential ignores sensitivity (its density is the default, raised to floors only when
  // told): with no prior every document runs at the default density.
  EXPECT_NEAR(none[Policy::kSequential].mean_density, o.density_default, 1e-12);
  EXPECT_GT(truth[Policy::kSequential].mean_density, o.density_default);
  EXPECT_NE(none[Policy::kSparseBalance].mean_density, truth[Policy::kSparseBalance].mean_density);
  EXPECT_EQ(truth[Policy::kSparseBalance].step_seconds,
            noisy0[Policy::kSparseBalance].step_seconds);
  EXPECT_NE(truth[Policy::kSparseBalance].mean_density, noisy[Policy::kSparseBalance].mean_density);
}

// The hidden truth shows what the bucket guard is for: without it (margin 1) DST's per-rank
// cuts fall on long documents, whose TRUE recall then drops well below sequential's although
// the overall recall rises; with the default margin (0.01) it stays within a point.
TEST(SimulatorTest, BucketGuardKeepsLongDocumentsTrueRecall) {
  SimOptions o = S1(1);
  o.policies = {Policy::kSequential, Policy::kDst};
  absl::StatusOr<SimReport> guarded = RunSimulation(o);
  o.bucket_recall_margin = 1.0;
  absl::StatusOr<SimReport> unguarded = RunSimulation(o);
  ASSERT_TRUE(guarded.ok() && unguarded.ok());
  const int last = kRecallBuckets - 1;  // 32K+
  std::map<Policy, PolicyResult> g = ByPolicy(*guarded);
  std::map<Policy, PolicyResult> u = ByPolicy(*unguarded);
  const double sequential = g[Policy::kSequential].buckets[last].true_recall;
  EXPECT_EQ(sequential, u[Policy::kSequential].buckets[last].true_recall);
  EXPECT_LT(u[Policy::kDst].buckets[last].true_recall, sequential - 0.05);
  EXPECT_GT(u[Policy::kDst].mean_recall, u[Policy::kSequential].mean_recall);
  EXPECT_GE(g[Policy::kDst].buckets[last].true_recall, sequential - 0.01);
}

TEST(SimulatorTest, ParsesTruthAndPriorFlags) {
  double sd = -1.0;
  EXPECT_EQ(*ParseSensitivityPrior("none", &sd), SensitivityPrior::kNone);
  EXPECT_EQ(*ParseSensitivityPrior("true", &sd), SensitivityPrior::kTrue);
  EXPECT_EQ(*ParseSensitivityPrior("noisy:0.25", &sd), SensitivityPrior::kNoisy);
  EXPECT_EQ(sd, 0.25);
  for (const char* bad : {"noisy:", "noisy:-1", "noisy:x", "maybe"}) {
    EXPECT_THAT(std::string(ParseSensitivityPrior(bad, &sd).status().message()),
                HasSubstr("--sensitivity_prior"))
        << bad;
  }
  EXPECT_EQ(*ParseCostTruth("linear"), CostTruth::kLinear);
  EXPECT_EQ(*ParseCostTruth("efficiency"), CostTruth::kEfficiency);
  EXPECT_THAT(std::string(ParseCostTruth("cubic").status().message()), HasSubstr("--cost_truth"));
  SimOptions o = S1(1);
  o.recall_rows = 0;
  EXPECT_THAT(std::string(RunSimulation(o).status().message()), HasSubstr("--recall_rows"));
}

// Context parallelism where one rank's share is too small for the longest documents (one
// micro-batch per rank, nearly full): splitting them beats the best placement without it on
// the same batches, the rows report their splits and exchange, and the table compares them.
TEST(SimulatorTest, ContextParallelismSplitsTheDocumentsThatOutlastARank) {
  for (uint64_t seed : {1, 2}) {
    SCOPED_TRACE(seed);
    SimOptions o = S1(seed);
    o.micro_batches = 1;
    o.fill = 0.95;
    o.steps = 8;
    o.max_shards = 4;
    o.policies = {Policy::kSparseBalance, SimPolicy(Policy::kFlops, ShardPolicy::kDense),
                  SimPolicy(Policy::kSparseBalance, ShardPolicy::kSparse)};
    absl::StatusOr<SimReport> report = RunSimulation(o);
    ASSERT_TRUE(report.ok()) << report.status();
    ASSERT_EQ(report->results.size(), 3u);
    const PolicyResult& whole = report->results[0];
    const PolicyResult& dense = report->results[1];
    const PolicyResult& split = report->results[2];
    EXPECT_EQ(whole.name, "sparsebalance");
    EXPECT_EQ(dense.name, "dense-cp");
    EXPECT_EQ(split.name, "sparsebalance-cp");
    EXPECT_EQ(whole.split_documents, 0.0);
    EXPECT_GT(split.split_documents, 0.0);
    EXPECT_GT(split.exchange_share, 0.0);
    EXPECT_LT(split.exchange_share, 0.2);
    // Measured 1.19-1.23x on seeds 1-2 (README "Context parallelism").
    EXPECT_GT(whole.mean_step_seconds / split.mean_step_seconds, 1.1);
    const std::string table = FormatTable(*report);
    EXPECT_THAT(table, HasSubstr("faster than sparsebalance"));
    EXPECT_THAT(table, HasSubstr("faster than dense-cp"));
  }
}

TEST(SimulatorTest, AContextParallelRowNeedsMaxShards) {
  SimOptions o = S1(1);
  o.steps = 1;
  o.policies = {SimPolicy(Policy::kSparseBalance, ShardPolicy::kSparse)};
  EXPECT_THAT(std::string(RunSimulation(o).status().message()), HasSubstr("--max_shards"));
  o.max_shards = 64;
  EXPECT_THAT(std::string(RunSimulation(o).status().message()), HasSubstr("--max_shards=64"));
  EXPECT_EQ(SimPolicyName(*ParseSimPolicy("sab-cp")), "sab-cp");
  EXPECT_EQ(SimPolicyName(*ParseSimPolicy("static-cp")), "static-cp");
  EXPECT_THAT(std::string(ParseSimPolicy("fast-cp").status().message()), HasSubstr("-cp"));
}

}  // namespace
}  // namespace sparsebalance
