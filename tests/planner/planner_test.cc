#include "planner/planner.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/latency_model.h"
#include "planner/plan_threads.h"
#include "planner/recall_model.h"
#include "planner/sample_table.h"
#include "planner/types.h"
#include "tests/planner/random_cases.h"

namespace sparsebalance {
namespace {

using test_util::Describe;
using test_util::MakeModel;
using test_util::MakeRandomCase;
using test_util::RandomCase;
using ::testing::AllOf;
using ::testing::HasSubstr;

bool Tuned(Policy policy) { return policy == Policy::kDst || policy == Policy::kSparseBalance; }

int64_t TotalTokens(const std::vector<Sample>& batch) {
  int64_t total = 0;
  for (const Sample& s : batch) total += s.length;
  return total;
}

// Every invariant a plan must keep, beyond (and independently of) CheckPlan.
void ExpectValidPlan(const StepPlan& plan, const std::vector<Sample>& batch,
                     const PlannerConfig& config, const std::string& where) {
  SCOPED_TRACE(where);
  const absl::Status check = CheckPlan(plan, batch, config);
  ASSERT_TRUE(check.ok()) << check;
  EXPECT_EQ(plan.policy, config.policy);
  std::map<uint64_t, const Sample*> by_id;
  for (const Sample& s : batch) by_id[s.id] = &s;
  std::map<uint64_t, int> seen;
  std::map<uint64_t, int> rank_of_group;
  ASSERT_EQ(static_cast<int>(plan.ranks.size()), config.ranks);
  double makespan = 0.0;
  for (int r = 0; r < config.ranks; ++r) {
    const RankPlan& rank = plan.ranks[r];
    ASSERT_EQ(static_cast<int>(rank.micro_batches.size()), config.micro_batches);
    double rank_seconds = 0.0;
    for (const MicroBatchPlan& mb : rank.micro_batches) {
      int64_t tokens = 0;
      for (const PlannedSample& p : mb.samples) {
        ASSERT_TRUE(by_id.count(p.id)) << "unknown id " << p.id;
        const Sample& s = *by_id[p.id];
        ++seen[s.id];
        // The plan is self-sufficient: each planned sample carries its batch sample's shape.
        ASSERT_EQ(p.length, s.length) << "id " << s.id;
        ASSERT_EQ(p.segments, s.segments) << "id " << s.id;
        ASSERT_TRUE(p.layer_densities.empty()) << "id " << s.id;
        tokens += p.length;
        const double rho = p.density;
        // 1e-12: DensityFloor(1) can round an ulp above density_max (sparsity_tuner_test).
        ASSERT_GE(rho, DensityFloor(s.sensitivity, config) - 1e-12) << "id " << s.id;
        ASSERT_LE(rho, config.density_max) << "id " << s.id;
        if (!Tuned(config.policy)) {
          ASSERT_EQ(rho, BaseDensity(s.sensitivity, config)) << "id " << s.id;
        }
        if (s.group != 0) {
          auto [it, inserted] = rank_of_group.emplace(s.group, r);
          ASSERT_EQ(it->second, r) << "group " << s.group << " split";
        }
      }
      EXPECT_EQ(mb.tokens, tokens);
      ASSERT_LE(mb.tokens, config.micro_batch_capacity);
      EXPECT_EQ(mb.default_density, config.density_default);
      rank_seconds += mb.predicted_seconds;
    }
    EXPECT_NEAR(rank.predicted_seconds, rank_seconds, 1e-9 * rank_seconds);
    makespan = std::max(makespan, rank.predicted_seconds);
  }
  for (uint64_t id : plan.deferred_ids) ++seen[id];
  for (const Sample& s : batch) ASSERT_EQ(seen[s.id], 1) << "id " << s.id;
  EXPECT_EQ(seen.size(), batch.size());
  if (config.overflow == OverflowPolicy::kError) {
    EXPECT_TRUE(plan.deferred_ids.empty());
  }
  const int64_t capacity =
      static_cast<int64_t>(config.ranks) * config.micro_batches * config.micro_batch_capacity;
  if (TotalTokens(batch) > capacity) {
    EXPECT_FALSE(plan.deferred_ids.empty());
  }
  // Figures.
  EXPECT_EQ(plan.makespan_seconds, makespan);
  EXPECT_LE(plan.lower_bound_seconds, plan.makespan_seconds * (1.0 + 1e-12));
  EXPECT_GE(plan.gap, -1e-12);
  if (plan.lower_bound_seconds > 0) {
    EXPECT_NEAR(plan.gap, plan.makespan_seconds / plan.lower_bound_seconds - 1.0, 1e-12);
  }
  EXPECT_GE(plan.imbalance_ratio, 1.0 - 1e-12);
  EXPECT_GE(plan.bubble_ratio, -1e-12);
  EXPECT_LT(plan.bubble_ratio, 1.0);
  if (plan.deferred_ids.size() < batch.size()) {
    EXPECT_GE(plan.mean_density, config.density_min - 1e-12);
    EXPECT_LE(plan.mean_density, config.density_max + 1e-12);
    EXPECT_GT(plan.predicted_recall, 0.0);
    EXPECT_LE(plan.predicted_recall, 1.0);
  }
}

TEST(PlanStepTest, RandomCasesGiveValidPlansForEveryPolicy) {
  int planned = 0;
  int unplaceable = 0;
  test_util::FailureBudget budget;
  for (uint64_t seed = 0; seed < test_util::kRandomCases; ++seed) {
    RandomCase c = MakeRandomCase(seed);
    const LatencyModel model = MakeModel(c.config, c.speed);
    for (Policy policy : AllPolicies()) {
      c.config.policy = policy;
      const std::string where = Describe(c);
      absl::StatusOr<StepPlan> plan = PlanStep(c.batch, c.config, model);
      if (!plan.ok()) {
        // Only bin packing can fail once the batch is valid: a sample (or group) for which no
        // rank has room left, under kError; under kDefer only a group that fits no rank even
        // empty (it fits no step).
        ASSERT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << where;
        ASSERT_THAT(std::string(plan.status().message()),
                    AllOf(HasSubstr("does not fit"), HasSubstr("micro_batch_capacity")))
            << where;
        if (c.config.overflow != OverflowPolicy::kError) {
          ASSERT_THAT(std::string(plan.status().message()),
                      HasSubstr("does not fit any rank even with its"))
              << where;
        }
        ++unplaceable;
        continue;
      }
      ++planned;
      budget.Run([&] { ExpectValidPlan(*plan, c.batch, c.config, where); });
    }
  }
  budget.Summarize();
  EXPECT_GT(planned, 20 * unplaceable) << planned << " planned, " << unplaceable << " did not fit";
}

// Folding a step's reports uses the features BuildPlan summed instead of computing them again
// (JobRegistry::Fold): they must be the model's own PlanFeatures of every micro-batch, bit for
// bit, with and without split documents.
TEST(PlanStepTest, PlansCarryTheFeaturesTheModelComputesForEachMicroBatch) {
  int checked = 0;
  for (uint64_t seed = 0; seed < test_util::kRandomCases; ++seed) {
    RandomCase c = MakeRandomCase(seed);
    const LatencyModel model = MakeModel(c.config, c.speed);
    for (Policy policy : AllPolicies()) {
      for (int max_shards : {1, std::min(4, c.config.ranks)}) {
        c.config.policy = policy;
        c.config.max_shards = max_shards;
        absl::StatusOr<StepPlan> plan = PlanStep(c.batch, c.config, model);
        if (!plan.ok()) continue;  // unplaceable under kError: the test above covers it
        for (size_t r = 0; r < plan->ranks.size(); ++r) {
          for (size_t m = 0; m < plan->ranks[r].micro_batches.size(); ++m) {
            const MicroBatchPlan& mb = plan->ranks[r].micro_batches[m];
            ASSERT_TRUE(mb.features_known) << Describe(c) << " rank " << r << " mb " << m;
            ASSERT_EQ(mb.features, model.PlanFeatures(mb))
                << Describe(c) << " max_shards " << max_shards << " rank " << r << " mb " << m;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(PlanStepTest, PlansAreDeterministicAcrossRunsCopiesAndModels) {
  for (uint64_t seed = 1000; seed < 1040; ++seed) {
    RandomCase c = MakeRandomCase(seed, /*max_samples=*/400);
    c.config.overflow = OverflowPolicy::kDefer;
    const LatencyModel model = MakeModel(c.config, c.speed);
    for (Policy policy : AllPolicies()) {
      c.config.policy = policy;
      absl::StatusOr<StepPlan> first = PlanStep(c.batch, c.config, model);
      ASSERT_TRUE(first.ok()) << Describe(c) << "\n" << first.status();
      const std::vector<Sample> copy = c.batch;
      const LatencyModel other_model = MakeModel(c.config, c.speed);
      absl::StatusOr<StepPlan> second = PlanStep(copy, c.config, other_model);
      ASSERT_TRUE(second.ok());
      ASSERT_EQ(CanonicalPlanText(*first), CanonicalPlanText(*second)) << Describe(c);
      absl::StatusOr<StepPlan> third = PlanStep(c.batch, c.config, model);
      ASSERT_TRUE(third.ok());
      ASSERT_EQ(CanonicalPlanText(*first), CanonicalPlanText(*third)) << Describe(c);
    }
  }
}

// PlanStep's phase timings: the same plan with and without them, each phase's time within the
// call's, and the phases a policy skips at 0 (times are only bounded, never compared to a
// speed).
TEST(PlanStepTest, PhaseTimesAddUpWithinTheCallAndLeaveThePlanAsItIs) {
  PlannerConfig config = test_util::StepConfig(16, 4, 131072);
  const LatencyModel model = MakeModel(config);
  const RecallModel recall(config.micro_batch_capacity, config.shape.layers);
  const std::vector<Sample> batch = test_util::TraceBatch(config, 3, 0.85);
  for (Policy policy : AllPolicies()) {
    config.policy = policy;
    const absl::StatusOr<ValidConfig> valid = ValidConfig::Check(config);
    ASSERT_TRUE(valid.ok());
    PlanPhaseSeconds phases;
    phases.fill(-1.0);  // every phase is written, skipped ones with 0
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<StepPlan> timed = PlanStep(batch, *valid, model, recall, nullptr, &phases);
    const double call =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_TRUE(timed.ok()) << timed.status();
    absl::StatusOr<StepPlan> untimed = PlanStep(batch, *valid, model, recall);
    ASSERT_TRUE(untimed.ok());
    EXPECT_EQ(CanonicalPlanText(*timed), CanonicalPlanText(*untimed)) << PolicyName(policy);
    double sum = 0.0;
    for (int k = 0; k < kPlanPhases; ++k) {
      EXPECT_GE(phases[k], 0.0) << kPlanPhaseNames[k];
      sum += phases[k];
    }
    EXPECT_LE(sum, call) << PolicyName(policy);
    EXPECT_GT(phases[3], 0.0) << "every policy places";
    EXPECT_GT(phases[6], 0.0) << "every policy builds a plan";
    const bool tuned = policy == Policy::kDst || policy == Policy::kSparseBalance;
    EXPECT_EQ(phases[4] > 0.0, tuned) << PolicyName(policy) << " guards";
    EXPECT_EQ(phases[5] > 0.0, tuned) << PolicyName(policy) << " tune";
  }
  // A batch that fails validation leaves the phases it did not reach at 0.
  PlanPhaseSeconds phases;
  phases.fill(-1.0);
  const absl::StatusOr<ValidConfig> valid = ValidConfig::Check(config);
  ASSERT_FALSE(PlanStep({}, *valid, model, recall, nullptr, &phases).ok());
  for (int k = 0; k < kPlanPhases; ++k) EXPECT_EQ(phases[k], 0.0) << kPlanPhaseNames[k];
}

TEST(PlanStepTest, CanonicalTextSeesEveryDensity) {
  RandomCase c = MakeRandomCase(7, 200);
  c.config.overflow = OverflowPolicy::kDefer;
  const LatencyModel model = MakeModel(c.config, c.speed);
  absl::StatusOr<StepPlan> plan = PlanStep(c.batch, c.config, model);
  ASSERT_TRUE(plan.ok());
  StepPlan changed = *plan;
  for (RankPlan& rank : changed.ranks) {
    for (MicroBatchPlan& mb : rank.micro_batches) {
      if (mb.samples.empty()) continue;
      mb.samples.back().density = std::nextafter(mb.samples.back().density, 2.0);
      EXPECT_NE(CanonicalPlanText(changed), CanonicalPlanText(*plan));
      return;
    }
  }
}

// `count` samples of `length` tokens with ids 100, 101, ...
std::vector<Sample> UniformBatch(int count, int64_t length) {
  std::vector<Sample> batch(count);
  for (int i = 0; i < count; ++i) {
    batch[i].id = 100 + i;
    batch[i].length = length;
  }
  return batch;
}

// The plans of `batch` under `config` by every policy, on the test prior's model: each one
// must be made and pass ExpectValidPlan (a failure is reported and that plan left out).
std::vector<StepPlan> ValidPlansOfEveryPolicy(PlannerConfig config,
                                              const std::vector<Sample>& batch) {
  const LatencyModel model = MakeModel(config);
  std::vector<StepPlan> plans;
  for (Policy policy : AllPolicies()) {
    config.policy = policy;
    absl::StatusOr<StepPlan> plan = PlanStep(batch, config, model);
    EXPECT_TRUE(plan.ok()) << PolicyName(policy) << ": " << plan.status();
    if (!plan.ok()) continue;
    ExpectValidPlan(*plan, batch, config, std::string(PolicyName(policy)));
    plans.push_back(*std::move(plan));
  }
  return plans;
}

TEST(PlanStepTest, DeferReturnsTheLeftoverSamples) {
  // 24 samples of 4096 tokens: 16 fit (4 x 2 x 8192 = 65536 tokens), 8 wait.
  for (const StepPlan& plan : ValidPlansOfEveryPolicy(
           test_util::StepConfig(4, 2, 8192, OverflowPolicy::kDefer), UniformBatch(24, 4096))) {
    EXPECT_EQ(plan.deferred_ids.size(), 8u) << PolicyName(plan.policy);
    for (const RankPlan& rank : plan.ranks) {
      for (const MicroBatchPlan& mb : rank.micro_batches) {
        EXPECT_EQ(mb.tokens, 8192) << PolicyName(plan.policy);
      }
    }
  }
}

TEST(PlanStepTest, DeferOverRandomOverfullBatches) {
  test_util::FailureBudget budget;
  int planned = 0;
  int refused = 0;
  for (uint64_t seed = 2000; seed < 2060; ++seed) {
    RandomCase c = MakeRandomCase(seed, 600);
    c.config.overflow = OverflowPolicy::kDefer;
    const int64_t capacity = static_cast<int64_t>(c.config.ranks) * c.config.micro_batches *
                             c.config.micro_batch_capacity;
    // Top the batch up to 150% of the step's tokens.
    int64_t total = TotalTokens(c.batch);
    for (uint64_t i = 0; total <= capacity * 3 / 2; ++i) {
      Sample s;
      s.id = (uint64_t{1} << 63) + i;
      s.length = std::max<int64_t>(1, c.config.micro_batch_capacity / (1 + i % 5));
      total += s.length;
      c.batch.push_back(s);
    }
    const LatencyModel model = MakeModel(c.config, c.speed);
    for (Policy policy : AllPolicies()) {
      c.config.policy = policy;
      absl::StatusOr<StepPlan> plan = PlanStep(c.batch, c.config, model);
      if (!plan.ok() &&
          absl::StrContains(plan.status().message(), "does not fit any rank even with its")) {
        ++refused;  // a group no rank holds even empty: refused under defer too
        continue;
      }
      ASSERT_TRUE(plan.ok()) << Describe(c) << "\n" << plan.status();
      ++planned;
      budget.Run([&] { ExpectValidPlan(*plan, c.batch, c.config, Describe(c)); });
      int64_t deferred = 0;
      std::set<uint64_t> deferred_ids(plan->deferred_ids.begin(), plan->deferred_ids.end());
      for (const Sample& s : c.batch) {
        if (deferred_ids.count(s.id)) deferred += s.length;
      }
      EXPECT_GE(deferred, total - capacity) << Describe(c);
    }
  }
  EXPECT_GT(planned, 4 * refused) << "most overfull batches plan (with deferrals)";
  budget.Summarize();
}

TEST(PlanStepTest, DeferLeavesTheLatestSamplesNotThoseTheWalkReachesLast) {
  // One micro-batch of 8192 tokens; in arrival order 3000, 3000 and 2000 tokens fit (8000),
  // the newest 4000 does not. Placed largest first without regard to arrival, 4000 and 3000
  // went in and the older 3000 and 2000 waited: under a steady overflow a sample that rarely
  // fits at the walk's end waited for hundreds of steps.
  const PlannerConfig config = test_util::StepConfig(1, 1, 8192, OverflowPolicy::kDefer);
  const std::vector<Sample> batch = {
      {1, 3000, 0.5, 0, {}}, {2, 3000, 0.5, 0, {}}, {3, 2000, 0.5, 0, {}}, {4, 4000, 0.5, 0, {}}};
  for (const StepPlan& plan : ValidPlansOfEveryPolicy(config, batch)) {
    EXPECT_EQ(plan.deferred_ids, (std::vector<uint64_t>{4})) << PolicyName(plan.policy);
  }
  // A group is one unit in arrival order, where its first member arrives: 5 and 6 (group 9,
  // 5000 tokens) come before 7; the newest, 7, waits.
  const std::vector<Sample> grouped = {
      {5, 1000, 0.5, 9, {}}, {7, 4000, 0.5, 0, {}}, {6, 4000, 0.5, 9, {}}, {8, 3000, 0.5, 0, {}}};
  for (const StepPlan& plan : ValidPlansOfEveryPolicy(config, grouped)) {
    EXPECT_EQ(plan.deferred_ids, (std::vector<uint64_t>{7})) << PolicyName(plan.policy);
  }
}

TEST(PlanStepTest, DeferredSamplesWaitFewStepsInASteadyOverflow) {
  // A trainer's loop under overflow=defer, as TrainerSession runs it: each step's batch is what
  // the last step deferred, in its order, then new samples of about 99% of the step's tokens
  // (lengths drawn log-normal, so some steps overflow). Every sample must be planned within a
  // few steps of its arrival. Before the planner deferred the latest arrivals, a sample of 8
  // ranks' balancing policies waited 128-189 steps here (it is at most 5 now).
  PlannerConfig config = test_util::StepConfig(8, 2, 16384, OverflowPolicy::kDefer);
  const int64_t room = int64_t{8} * 2 * 16384;
  const LatencyModel model = MakeModel(config);
  for (Policy policy : AllPolicies()) {
    config.policy = policy;
    Rng rng(11);
    std::map<uint64_t, int> arrived;  // samples not yet planned: id -> step of arrival
    std::vector<Sample> carried;
    uint64_t next_id = 1;
    int longest_wait = 0;
    int overflowing_steps = 0;
    for (int step = 0; step < 400; ++step) {
      std::vector<Sample> batch = carried;
      for (int64_t fresh = 0; fresh < room * 99 / 100;) {
        Sample s;
        s.id = next_id++;
        s.length =
            std::min<int64_t>(16384, 64 + static_cast<int64_t>(std::exp(7.0 + rng.Normal())));
        s.sensitivity = rng.Uniform();
        fresh += s.length;
        arrived[s.id] = step;
        batch.push_back(s);
      }
      absl::StatusOr<StepPlan> plan = PlanStep(batch, config, model);
      ASSERT_TRUE(plan.ok()) << PolicyName(policy) << " step " << step << ": " << plan.status();
      const std::set<uint64_t> deferred(plan->deferred_ids.begin(), plan->deferred_ids.end());
      if (!deferred.empty()) ++overflowing_steps;
      carried.clear();
      for (const Sample& s : batch) {
        if (deferred.count(s.id) != 0) {
          carried.push_back(s);
          continue;
        }
        longest_wait = std::max(longest_wait, step - arrived[s.id]);
        arrived.erase(s.id);
      }
    }
    for (const auto& [id, step] : arrived) longest_wait = std::max(longest_wait, 400 - step);
    EXPECT_GT(overflowing_steps, 200) << PolicyName(policy) << ": the loop must overflow often";
    EXPECT_LE(longest_wait, 16) << PolicyName(policy) << " (still waiting included)";
  }
}

TEST(PlanStepTest, DstKeepsTheRecallOfThePlacedSamplesWhenSomeAreDeferred) {
  // Rank 0 straggles with a 64K tolerant document, rank 1 holds 8K; four 64K documents of
  // sensitivity 0.25 (lower recall at the default density) do not fit and are deferred. The
  // plan's recall (over the placed samples) must not fall below the untuned plan's.
  PlannerConfig config = test_util::StepConfig(2, 1, 65536, OverflowPolicy::kDefer);
  std::vector<Sample> batch = {{1, 65536, 0.0, 0, {}}, {2, 8192, 0.0, 0, {}}};
  for (uint64_t id = 3; id <= 6; ++id) batch.push_back({id, 65536, 0.25, 0, {}});
  const LatencyModel model = MakeModel(config);
  config.policy = Policy::kSequential;
  absl::StatusOr<StepPlan> untuned = PlanStep(batch, config, model);
  ASSERT_TRUE(untuned.ok()) << untuned.status();
  ASSERT_EQ(untuned->deferred_ids, (std::vector<uint64_t>{3, 4, 5, 6}));
  for (DstMode mode : {DstMode::kMean, DstMode::kMax, DstMode::kQuantile}) {
    config.policy = Policy::kDst;
    config.dst_mode = mode;
    absl::StatusOr<StepPlan> tuned = PlanStep(batch, config, model);
    ASSERT_TRUE(tuned.ok()) << tuned.status();
    ExpectValidPlan(*tuned, batch, config, std::string(DstModeName(mode)));
    EXPECT_GE(tuned->predicted_recall, untuned->predicted_recall - 1e-12) << DstModeName(mode);
  }
}

TEST(PlanStepTest, ErrorPolicyRejectsAnOverfullBatchNamingTheCapacity) {
  PlannerConfig config = test_util::StepConfig(4, 2, 8192, OverflowPolicy::kError);
  const std::vector<Sample> batch = UniformBatch(17, 4096);  // 69632 > 65536 tokens
  const LatencyModel model = MakeModel(config);
  for (Policy policy : AllPolicies()) {
    config.policy = policy;
    absl::StatusOr<StepPlan> plan = PlanStep(batch, config, model);
    ASSERT_FALSE(plan.ok()) << PolicyName(policy);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(plan.status().message()),
                AllOf(HasSubstr("micro_batch_capacity"), HasSubstr("8192"), HasSubstr("65536"),
                      HasSubstr("69632"), HasSubstr("defer")));
  }
}

// The INVALID_ARGUMENT message PlanStep gives for `batch` under `config`.
std::string PlanError(const std::vector<Sample>& batch, const PlannerConfig& config) {
  const LatencyModel model(config.shape, std::max(config.ranks, 1), test_util::kTestPrior);
  absl::StatusOr<StepPlan> plan = PlanStep(batch, config, model);
  EXPECT_FALSE(plan.ok());
  if (plan.ok()) return "";
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(plan.status().message());
}

TEST(ValidateBatchTest, ErrorsNameTheSampleIndexAndField) {
  PlannerConfig config = test_util::StepConfig(2, 2, 8192);
  const std::vector<Sample> good = UniformBatch(6, 1000);
  EXPECT_TRUE(ValidateBatch(good, config).ok());

  EXPECT_THAT(PlanError({}, config), AllOf(HasSubstr("samples"), HasSubstr("empty")));

  std::vector<Sample> batch = good;
  batch[3].id = batch[1].id;
  EXPECT_THAT(PlanError(batch, config),
              AllOf(HasSubstr("samples[3].id"), HasSubstr("101"), HasSubstr("more than once")));

  batch = good;
  batch[2].length = 8193;
  EXPECT_THAT(PlanError(batch, config),
              AllOf(HasSubstr("samples[2].length"), HasSubstr("8193"),
                    HasSubstr("micro_batch_capacity"), HasSubstr("8192")));

  batch = good;
  batch[1].length = 0;
  EXPECT_THAT(PlanError(batch, config), HasSubstr("samples[1].length"));
  batch[1].length = -5;
  EXPECT_THAT(PlanError(batch, config), HasSubstr("samples[1].length"));

  for (double bad : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN(),
                     std::numeric_limits<double>::infinity()}) {
    batch = good;
    batch[4].sensitivity = bad;
    EXPECT_THAT(PlanError(batch, config), HasSubstr("samples[4].sensitivity")) << bad;
  }

  batch = good;
  batch[5].segments = {400, 500};  // 900 != 1000
  EXPECT_THAT(PlanError(batch, config),
              AllOf(HasSubstr("samples[5].segments"), HasSubstr("900"), HasSubstr("1000")));
  batch[5].segments = {1000, 0};
  EXPECT_THAT(PlanError(batch, config), HasSubstr("samples[5].segments[1]"));
  batch[5].segments = {1000, -200};
  EXPECT_THAT(PlanError(batch, config), HasSubstr("samples[5].segments[1]"));
  // A segment longer than the sample is named itself, before any later one.
  batch[5].segments = {1200, -200};
  EXPECT_THAT(PlanError(batch, config),
              AllOf(HasSubstr("samples[5].segments[0]"), HasSubstr("1200"), HasSubstr("1000")));
  batch[5].segments = {600, 300, 200};  // the running sum passes 1000 at segments[2]
  EXPECT_THAT(PlanError(batch, config),
              AllOf(HasSubstr("samples[5].segments[2]"), HasSubstr("more than")));
  batch[5].segments = {400, 600};
  EXPECT_TRUE(ValidateBatch(batch, config).ok());
}

// The error names the first failing sample in index order; at one index a repeated id comes
// before its fields. Increasing ids are checked in one pass, others sorted with their indices:
// both paths, ids at the extremes and ids that differ only in their highest byte.
TEST(ValidateBatchTest, ARepeatedIdIsNamedAtItsFirstRepeatInIndexOrder) {
  const PlannerConfig config = test_util::StepConfig(2, 2, 8192);
  auto batch_of = [](std::vector<uint64_t> ids) {
    std::vector<Sample> batch = UniformBatch(static_cast<int>(ids.size()), 100);
    for (size_t i = 0; i < ids.size(); ++i) batch[i].id = ids[i];
    return batch;
  };
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  constexpr uint64_t kTop = uint64_t{1} << 56;
  EXPECT_TRUE(ValidateBatch(batch_of({0, 1, kMax - 1, kMax}), config).ok());
  EXPECT_TRUE(ValidateBatch(batch_of({kMax, 0, 5, kMax - 1, 3 * kTop, kTop}), config).ok());
  EXPECT_TRUE(ValidateBatch(batch_of({7}), config).ok());
  // The later of two equal ids, increasing up to it or not.
  EXPECT_THAT(ValidateBatch(batch_of({1, 2, 3, 2}), config).message(),
              AllOf(HasSubstr("samples[3].id"), HasSubstr("2 appears more than once")));
  EXPECT_THAT(ValidateBatch(batch_of({50, 40, 30, 40, 10}), config).message(),
              HasSubstr("samples[3].id"));
  // The earliest repeat, not the repeat of the earliest id.
  EXPECT_THAT(ValidateBatch(batch_of({1, 2, 3, 2, 1}), config).message(),
              HasSubstr("samples[3].id"));
  EXPECT_THAT(ValidateBatch(batch_of({5, 9, 9, 5}), config).message(), HasSubstr("samples[2].id"));
  EXPECT_THAT(ValidateBatch(batch_of({4, 4, 4}), config).message(), HasSubstr("samples[1].id"));
  // Ids are checked in the fields' pass: a field error before the ids stop increasing comes
  // first, a repeat before a later field error does.
  std::vector<Sample> batch = batch_of({1, 2, 3, 2, 7});
  batch[1].length = 0;
  EXPECT_THAT(ValidateBatch(batch, config).message(), HasSubstr("samples[1].length"));
  batch = batch_of({1, 2, 3, 2, 7});
  batch[4].length = 0;
  EXPECT_THAT(ValidateBatch(batch, config).message(), HasSubstr("samples[3].id"));
  batch = batch_of({9, 3, 5, 3});  // stops increasing at 1, repeats at 3
  batch[2].sensitivity = 2.0;
  EXPECT_THAT(ValidateBatch(batch, config).message(), HasSubstr("samples[2].sensitivity"));
  // Ids at the extremes, and ids equal in all but their highest byte.
  EXPECT_THAT(ValidateBatch(batch_of({0, kMax, 7, kMax}), config).message(),
              AllOf(HasSubstr("samples[3].id"), HasSubstr("18446744073709551615")));
  EXPECT_THAT(ValidateBatch(batch_of({kMax, 0, 0}), config).message(),
              AllOf(HasSubstr("samples[2].id"), HasSubstr(": 0 appears")));
  EXPECT_THAT(
      ValidateBatch(batch_of({2 * kTop + 1, kTop + 1, 3 * kTop + 1, kTop + 1}), config).message(),
      HasSubstr("samples[3].id"));

  // An earlier field error wins over a later repeat, whichever path finds the repeat.
  for (std::vector<uint64_t> ids :
       {std::vector<uint64_t>{1, 2, 3, 4, 1}, std::vector<uint64_t>{9, 8, 7, 6, 9}}) {
    std::vector<Sample> batch = batch_of(ids);
    batch[1].length = 0;
    EXPECT_THAT(ValidateBatch(batch, config).message(), HasSubstr("samples[1].length"));
    batch = batch_of(ids);
    batch[2].sensitivity = 2.0;
    EXPECT_THAT(ValidateBatch(batch, config).message(), HasSubstr("samples[2].sensitivity"));
    // At the repeat's own index the id error comes first.
    batch = batch_of(ids);
    batch[4].length = 0;
    batch[4].segments = {1, 2};
    EXPECT_THAT(ValidateBatch(batch, config).message(), HasSubstr("samples[4].id"));
  }

  // Random batches against the definition: the first index whose id an earlier one has.
  Rng rng(42);
  for (int c = 0; c < 300; ++c) {
    const int count = 1 + static_cast<int>(rng.NextU64() % 300);
    const uint64_t pool = 1 + rng.NextU64() % (2 * count);  // repeats in most batches
    const uint64_t high = rng.NextU64() % 2 == 0 ? 0 : rng.NextU64();
    std::vector<uint64_t> ids(count);
    for (uint64_t& id : ids) id = (rng.NextU64() % pool) * kTop ^ high ^ (rng.NextU64() % 3);
    if (c % 3 == 0) std::sort(ids.begin(), ids.end());  // the increasing path up to a repeat
    std::set<uint64_t> seen;
    size_t want = ids.size();
    for (size_t i = 0; i < ids.size() && want == ids.size(); ++i) {
      if (!seen.insert(ids[i]).second) want = i;
    }
    const absl::Status status = ValidateBatch(batch_of(ids), config);
    if (want == ids.size()) {
      EXPECT_TRUE(status.ok()) << status;
    } else {
      EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("samples[", want, "].id"))) << c;
    }
  }
}

// On threads the batch is checked in ranges, and the answer must be the one pass's: the first
// failing sample in index order (a repeated id there named before its fields), whichever range
// holds it and whichever range the ids stop increasing in. Random batches of a few thousand
// samples (several ranges a thread) with errors placed at random, at range edges among them,
// against the definition: per index, a repeated id, else the sample checked on its own.
TEST(ValidateBatchTest, OnThreadsTheFirstFailingSampleIsNamedAsInOnePass) {
  PlannerConfig config = test_util::StepConfig(64, 4, 8192);
  const absl::StatusOr<ValidConfig> valid = ValidConfig::Check(config);
  ASSERT_TRUE(valid.ok()) << valid.status();
  Rng rng(7);
  int failing = 0;
  int repeats = 0;
  for (int c = 0; c < 200; ++c) {
    const int count = 600 + static_cast<int>(rng.NextU64() % 4000);
    std::vector<Sample> batch = UniformBatch(count, 100);
    for (int i = 0; i < count; ++i) batch[i].id = 10 * static_cast<uint64_t>(i) + 10;
    if (c % 4 == 1) std::reverse(batch.begin(), batch.end());  // ids never increase
    // 0 to 3 errors: a repeated id or a bad field, at random places or at a range's edge
    // (ChunkCount: 8 ranges on 2 threads).
    const int errors = static_cast<int>(rng.NextU64() % 4);
    for (int e = 0; e < errors; ++e) {
      size_t at = rng.NextU64() % count;
      if (rng.NextU64() % 2 == 0) at = std::min<size_t>(count - 1, (rng.NextU64() % 8) * count / 8);
      switch (rng.NextU64() % 5) {
        case 0:
          batch[at].id = batch[rng.NextU64() % count].id;
          break;
        case 1:
          batch[at].id = 3;  // below every other id: the ids stop increasing, no repeat
          break;
        case 2:
          batch[at].length = 0;
          break;
        case 3:
          batch[at].sensitivity = 1.5;
          break;
        default:
          batch[at].segments = {40, 50};  // 90 != 100
          break;
      }
    }
    // The expected message: a repeat's field, or the sample's own error with its index.
    std::string want;
    bool repeat = false;
    std::set<uint64_t> seen;
    for (size_t i = 0; i < batch.size() && want.empty(); ++i) {
      if (!seen.insert(batch[i].id).second) {
        want = absl::StrCat("samples[", i, "].id: ");
        repeat = true;
      } else if (absl::Status alone = ValidateBatch({batch[i]}, *valid); !alone.ok()) {
        const std::string message(alone.message());
        const std::string first = "samples[0]";
        EXPECT_EQ(message.substr(0, first.size()), first) << message;
        want = absl::StrCat("samples[", i, "]", message.substr(first.size()));
      }
    }
    failing += want.empty() ? 0 : 1;
    repeats += repeat ? 1 : 0;
    const absl::Status one = ValidateBatch(batch, *valid);
    for (int threads : {2, 3, 4}) {
      PlanThreads pool(threads);
      const absl::Status status = ValidateBatch(batch, *valid, &pool);
      EXPECT_EQ(status, one) << c << " on " << threads << " threads";
      if (want.empty()) {
        EXPECT_TRUE(status.ok()) << c << ": " << status;
      } else if (repeat) {
        EXPECT_THAT(status.message(), HasSubstr(want)) << c;
      } else {
        EXPECT_EQ(status.message(), want) << c;
      }
    }
  }
  // Both kinds of failure, and clean batches, were drawn.
  EXPECT_GT(repeats, 10);
  EXPECT_GT(failing - repeats, 10);
  EXPECT_LT(failing, 200);
}

TEST(ValidateConfigTest, ErrorsNameTheField) {
  const std::vector<Sample> batch = UniformBatch(2, 100);
  struct Case {
    const char* field;
    void (*spoil)(PlannerConfig*);
  };
  const Case cases[] = {
      {"config.ranks", [](PlannerConfig* c) { c->ranks = 0; }},
      {"config.ranks", [](PlannerConfig* c) { c->ranks = -3; }},
      {"config.micro_batches", [](PlannerConfig* c) { c->micro_batches = 0; }},
      {"config.micro_batch_capacity", [](PlannerConfig* c) { c->micro_batch_capacity = 0; }},
      {"config.shape.layers", [](PlannerConfig* c) { c->shape.layers = 0; }},
      {"config.shape.heads", [](PlannerConfig* c) { c->shape.heads = 0; }},
      {"config.shape.head_dim", [](PlannerConfig* c) { c->shape.head_dim = 0; }},
      {"config.shape.block_size", [](PlannerConfig* c) { c->shape.block_size = 96; }},
      {"config.shape.local_blocks", [](PlannerConfig* c) { c->shape.local_blocks = -1; }},
      {"config.density_min", [](PlannerConfig* c) { c->density_min = 0.0; }},
      {"config.density_min", [](PlannerConfig* c) { c->density_min = std::nan(""); }},
      {"config.density_max", [](PlannerConfig* c) { c->density_max = 1.5; }},
      {"config.density_max", [](PlannerConfig* c) { c->density_max = -0.2; }},
      {"config.density_default", [](PlannerConfig* c) { c->density_default = 0.0; }},
      {"config.density_default", [](PlannerConfig* c) { c->density_default = 1.01; }},
      {"config.density_min",
       [](PlannerConfig* c) {
         c->density_min = 0.6;
         c->density_max = 0.5;
       }},
      {"config.density_default", [](PlannerConfig* c) { c->density_default = 0.01; }},
      {"config.dst_quantile", [](PlannerConfig* c) { c->dst_quantile = 1.5; }},
      {"config.dst_quantile", [](PlannerConfig* c) { c->dst_quantile = std::nan(""); }},
  };
  for (const Case& c : cases) {
    PlannerConfig config;
    config.ranks = 2;
    c.spoil(&config);
    const absl::Status status = ValidateConfig(config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.field));
    EXPECT_THAT(PlanError(batch, config), HasSubstr(c.field));
  }
  PlannerConfig config;
  EXPECT_TRUE(ValidateConfig(config).ok());
}

TEST(PlanStepTest, ModelWithOtherRankCountIsRejected) {
  PlannerConfig config;
  config.ranks = 4;
  const LatencyModel model(config.shape, 3, test_util::kTestPrior);
  absl::StatusOr<StepPlan> plan = PlanStep(UniformBatch(4, 100), config, model);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("config.ranks"));
}

TEST(CheckPlanTest, CatchesBrokenPlans) {
  PlannerConfig config = test_util::StepConfig(2, 2, 4096);
  const std::vector<Sample> batch = UniformBatch(6, 1000);
  const LatencyModel model = MakeModel(config);
  absl::StatusOr<StepPlan> plan = PlanStep(batch, config, model);
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(CheckPlan(*plan, batch, config).ok());
  auto first_nonempty = [](StepPlan* p) -> MicroBatchPlan* {
    for (RankPlan& rank : p->ranks) {
      for (MicroBatchPlan& mb : rank.micro_batches) {
        if (!mb.samples.empty()) return &mb;
      }
    }
    return nullptr;
  };
  {
    StepPlan broken = *plan;
    MicroBatchPlan* mb = first_nonempty(&broken);
    broken.deferred_ids.push_back(mb->samples.front().id);  // placed and deferred
    EXPECT_EQ(CheckPlan(broken, batch, config).code(), absl::StatusCode::kFailedPrecondition);
  }
  {
    StepPlan broken = *plan;
    first_nonempty(&broken)->samples.front().density = config.density_max + 0.01;
    EXPECT_THAT(std::string(CheckPlan(broken, batch, config).message()), HasSubstr("density"));
  }
  {
    StepPlan broken = *plan;
    broken.ranks[0].micro_batches.pop_back();
    EXPECT_FALSE(CheckPlan(broken, batch, config).ok());
  }
  {
    StepPlan broken = *plan;
    MicroBatchPlan* mb = first_nonempty(&broken);
    mb->samples.pop_back();
    EXPECT_THAT(std::string(CheckPlan(broken, batch, config).message()), HasSubstr("tokens"));
  }
  {
    StepPlan broken = *plan;
    MicroBatchPlan* mb = first_nonempty(&broken);
    mb->samples.front().length += 1;
    mb->tokens += 1;
    EXPECT_THAT(std::string(CheckPlan(broken, batch, config).message()),
                AllOf(HasSubstr("planned with 1001 tokens"), HasSubstr("the batch has 1000")));
  }
  {
    StepPlan broken = *plan;
    first_nonempty(&broken)->samples.front().segments = {500, 500};
    EXPECT_THAT(std::string(CheckPlan(broken, batch, config).message()),
                HasSubstr("in 2 segments; the batch has 1000 in 0"));
  }
}

TEST(PlanStepTest, PackedSamplesArePlannedWithTheirSegments) {
  // Every sample pre-packed, for every policy: each planned sample carries its batch sample's
  // length and segments, and its documents are the segments.
  std::vector<Sample> batch = UniformBatch(12, 3000);
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].segments = {1000 + static_cast<int64_t>(i), 1500, 500 - static_cast<int64_t>(i)};
  }
  for (const StepPlan& plan : ValidPlansOfEveryPolicy(test_util::StepConfig(3, 2, 8192), batch)) {
    for (const RankPlan& rank : plan.ranks) {
      for (const MicroBatchPlan& mb : rank.micro_batches) {
        for (const PlannedSample& p : mb.samples) {
          EXPECT_EQ(p.Documents(), batch[p.id - 100].segments) << PolicyName(plan.policy);
        }
      }
    }
  }
}

TEST(CompletePlannedSamplesTest, FillsAnOlderPlannersSamplesFromTheBatch) {
  std::vector<Sample> batch = UniformBatch(3, 1000);
  batch[1].segments = {600, 400};
  // As MicroBatchFromProto reads an older planner's message: ids and densities only.
  std::vector<MicroBatchPlan> plan(2);
  plan[0].samples = {{101, 0, 0.3, {}, {}, 0, 0, 0, {}}, {100, 0, 0.5, {}, {}, 0, 0, 0, {}}};
  plan[1].samples = {{102, 0, 0.2, {}, {}, 0, 0, 0, {}}};
  ASSERT_TRUE(CompletePlannedSamples(batch, &plan).ok());
  EXPECT_EQ(plan[0].samples[0].length, 1000);
  EXPECT_EQ(plan[0].samples[0].segments, (std::vector<int64_t>{600, 400}));
  EXPECT_EQ(plan[0].samples[0].density, 0.3);
  EXPECT_EQ(plan[0].samples[1].length, 1000);
  EXPECT_TRUE(plan[0].samples[1].segments.empty());
  EXPECT_EQ(plan[1].samples[0].length, 1000);
  // A complete plan is left as it is.
  const std::vector<MicroBatchPlan> before = plan;
  ASSERT_TRUE(CompletePlannedSamples(batch, &plan).ok());
  EXPECT_EQ(plan[0].samples[0].segments, before[0].samples[0].segments);
}

TEST(CompletePlannedSamplesTest, ErrorsNameTheMicroBatchSampleAndField) {
  const std::vector<Sample> batch = UniformBatch(2, 1000);
  std::vector<MicroBatchPlan> plan(2);
  plan[1].samples = {{100, 1000, 0.3, {}, {}, 0, 0, 0, {}}, {999, 0, 0.3, {}, {}, 0, 0, 0, {}}};
  EXPECT_THAT(std::string(CompletePlannedSamples(batch, &plan).message()),
              AllOf(HasSubstr("micro_batches[1].samples[1].id"), HasSubstr("999")));
  plan[1].samples[1] = {101, 1200, 0.3, {}, {}, 0, 0, 0, {}};
  EXPECT_THAT(
      std::string(CompletePlannedSamples(batch, &plan).message()),
      AllOf(HasSubstr("micro_batches[1].samples[1].length"), HasSubstr("1200"), HasSubstr("1000")));
  plan[1].samples[1] = {101, 1000, 0.3, {400, 600}, {}, 0, 0, 0, {}};
  EXPECT_THAT(std::string(CompletePlannedSamples(batch, &plan).message()),
              AllOf(HasSubstr("micro_batches[1].samples[1].segments"), HasSubstr("[400,600]")));
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

PlannerConfig PretrainConfig() { return test_util::StepConfig(16, 4, 131072); }

TEST(SabQualityTest, MedianGapWithinTwoPercentOnPretrainBatches) {
  PlannerConfig config = PretrainConfig();
  const LatencyModel model = MakeModel(config);
  std::vector<double> sab_gaps;
  std::vector<double> sequential_gaps;
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    const std::vector<Sample> batch = test_util::TraceBatch(config, seed, 0.85);
    ASSERT_GE(batch.size(), 4u * config.ranks);
    for (Policy policy : {Policy::kSab, Policy::kSequential}) {
      config.policy = policy;
      absl::StatusOr<StepPlan> plan = PlanStep(batch, config, model);
      ASSERT_TRUE(plan.ok()) << plan.status();
      ASSERT_TRUE(CheckPlan(*plan, batch, config).ok());
      (policy == Policy::kSab ? sab_gaps : sequential_gaps).push_back(plan->gap);
    }
  }
  EXPECT_LE(Median(sab_gaps), 0.02);
  EXPECT_LT(Median(sab_gaps), Median(sequential_gaps));
}

TEST(SabQualityTest, SlowRankGetsHalfTheWork) {
  PlannerConfig config = PretrainConfig();
  config.policy = Policy::kSab;
  LatencyModel model = MakeModel(config);
  LatencyModelState state = model.state();
  state.speed_factors[0] = 2.0;
  model.set_state(state);
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    const std::vector<Sample> batch = test_util::TraceBatch(config, seed, 0.7);
    absl::StatusOr<StepPlan> plan = PlanStep(batch, config, model);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(CheckPlan(*plan, batch, config).ok());
    // Raw work: predicted seconds without the speed factor.
    const double slow = plan->ranks[0].predicted_seconds / 2.0;
    double others = 0.0;
    for (int r = 1; r < config.ranks; ++r) others += plan->ranks[r].predicted_seconds;
    others /= config.ranks - 1;
    EXPECT_NEAR(slow / others, 0.5, 0.05) << "seed " << seed;
  }
}

// --- Upper bounds and checked arithmetic (types.h): the attacks that once got through. ---

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int kInt32Max = std::numeric_limits<int>::max();

PlannerConfig OneRankConfig() {
  PlannerConfig config;
  config.ranks = 1;
  config.micro_batches = 1;
  return config;
}

// Attack: world_size 1, one micro-batch of INT64_MAX tokens, then one sample of INT64_MAX
// tokens. It used to be accepted, and the latency model's fold then met non-finite features.
TEST(BoundsTest, CapacityOfInt64MaxIsRefusedNamingTheFieldAndTheLimit) {
  PlannerConfig config = OneRankConfig();
  config.micro_batch_capacity = kInt64Max;
  const absl::Status status = ValidateConfig(config);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("config.micro_batch_capacity"), HasSubstr("9223372036854775807"),
                    HasSubstr("1073741824")));
  const std::vector<Sample> batch = {{1, kInt64Max, 0.0, 0, {}}};
  EXPECT_THAT(PlanError(batch, config), HasSubstr("config.micro_batch_capacity"));
  // At the largest capacity the same sample is refused by its own length.
  config.micro_batch_capacity = kMaxMicroBatchCapacity;
  EXPECT_THAT(PlanError(batch, config),
              AllOf(HasSubstr("samples[0].length"), HasSubstr("9223372036854775807"),
                    HasSubstr("1073741824")));
  config.micro_batch_capacity = kMaxMicroBatchCapacity + 1;
  EXPECT_THAT(std::string(ValidateConfig(config).message()),
              AllOf(HasSubstr("config.micro_batch_capacity"), HasSubstr("1073741825")));
}

// Attack: length 1, segments {INT64_MAX, INT64_MAX, 3}: their sum wrapped to 1 and passed,
// and placement then wrote ranks_[-1]. Now the first segment is refused, naming it.
TEST(BoundsTest, SegmentsWhoseSumWrapsAreRefusedNamingTheSegment) {
  const PlannerConfig config = OneRankConfig();
  std::vector<Sample> batch = {{1, 1, 0.0, 0, {kInt64Max, kInt64Max, 3}}};
  EXPECT_EQ(ValidateBatch(batch, config).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(PlanError(batch, config),
              AllOf(HasSubstr("samples[0].segments[0]"), HasSubstr("9223372036854775807"),
                    HasSubstr("length 1")));
  // Segments that each fit but whose running sum would pass the length (and, unchecked,
  // wrap): the first one past it is named.
  batch = {{1, 100, 0.0, 0, {}}, {2, 100, 0.0, 0, {60, 50, 100 - 110 + kInt64Max}}};
  EXPECT_THAT(PlanError(batch, config), HasSubstr("samples[1].segments[1]"));
  batch = {{2, 100, 0.0, 0, {1, 99, 1}}};
  EXPECT_THAT(PlanError(batch, config),
              AllOf(HasSubstr("samples[0].segments[2]"), HasSubstr("more than")));
  for (int64_t bad : {int64_t{0}, int64_t{-1}, std::numeric_limits<int64_t>::min()}) {
    batch = {{2, 100, 0.0, 0, {50, bad, 50}}};
    EXPECT_THAT(PlanError(batch, config), HasSubstr("samples[0].segments[1]")) << bad;
  }
  // Each policy, for every attack above, refuses rather than plans.
  for (Policy policy : AllPolicies()) {
    PlannerConfig c = config;
    c.policy = policy;
    EXPECT_FALSE(PlanStepLocally({{1, 1, 0.0, 0, {kInt64Max, kInt64Max, 3}}}, c).ok());
  }
}

TEST(BoundsTest, MicroBatchAndSlotCountsAreBounded) {
  PlannerConfig config = OneRankConfig();
  // Attack: micro_batches 2^31 - 1 with 65,536 ranks (2^47 plan slots).
  config.ranks = 65536;
  config.micro_batches = kInt32Max;
  absl::Status status = ValidateConfig(config);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr("config.micro_batches"),
                                                   HasSubstr("2147483647"), HasSubstr("65536")));
  // Within the per-rank bound but not the slot bound: 65,536 x 64 = 2^22 slots.
  config.micro_batches = 64;
  status = ValidateConfig(config);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("config.micro_batches"), HasSubstr("65536 x 64"),
                    HasSubstr("4194304"), HasSubstr("1048576")));
  config.micro_batches = 16;  // exactly 2^20 slots
  EXPECT_TRUE(ValidateConfig(config).ok());
  config.ranks = kInt32Max;
  config.micro_batches = kInt32Max;
  EXPECT_THAT(std::string(ValidateConfig(config).message()), HasSubstr("config.micro_batches"));
  config.ranks = 1;
  config.micro_batches = kMaxMicroBatches;
  EXPECT_TRUE(ValidateConfig(config).ok());
  config.micro_batches = kMaxMicroBatches + 1;
  EXPECT_THAT(std::string(ValidateConfig(config).message()),
              AllOf(HasSubstr("config.micro_batches"), HasSubstr("65537"), HasSubstr("65536")));
}

TEST(BoundsTest, ShapeDimensionsAreBoundedNamingTheFieldAndTheLimit) {
  struct Case {
    const char* field;
    int* (*field_of)(PlannerConfig*);
    int limit;
  };
  const Case cases[] = {
      {"config.shape.layers", [](PlannerConfig* c) { return &c->shape.layers; }, kMaxLayers},
      {"config.shape.heads", [](PlannerConfig* c) { return &c->shape.heads; }, kMaxHeads},
      {"config.shape.head_dim", [](PlannerConfig* c) { return &c->shape.head_dim; }, kMaxHeadDim},
      {"config.shape.local_blocks", [](PlannerConfig* c) { return &c->shape.local_blocks; },
       kMaxLocalBlocks},
  };
  for (const Case& c : cases) {
    for (int bad : {c.limit + 1, kInt32Max}) {
      PlannerConfig config = OneRankConfig();
      *c.field_of(&config) = bad;
      const absl::Status status = ValidateConfig(config);
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
      EXPECT_THAT(std::string(status.message()),
                  AllOf(HasSubstr(c.field), HasSubstr(absl::StrCat(bad)),
                        HasSubstr(absl::StrCat(c.limit))));
    }
    PlannerConfig config = OneRankConfig();
    *c.field_of(&config) = c.limit;
    EXPECT_TRUE(ValidateConfig(config).ok()) << c.field;
  }
}

TEST(BoundsTest, BatchOfTooManySamplesIsRefusedBeforeItsSamplesAreRead) {
  PlannerConfig config = OneRankConfig();
  config.overflow = OverflowPolicy::kDefer;
  const std::vector<Sample> batch(static_cast<size_t>(kMaxBatchSamples) + 1);
  const absl::Status status = ValidateBatch(batch, config);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("samples"), HasSubstr("16777217"), HasSubstr("16777216")));
}

TEST(BoundsTest, ValidateBatchRefusesAnInvalidConfig) {
  PlannerConfig config = OneRankConfig();
  config.micro_batch_capacity = kInt64Max;
  const absl::Status status = ValidateBatch({{1, 10, 0.0, 0, {}}}, config);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("config.micro_batch_capacity"));
}

// Everything at its largest allowed value plans into a valid plan with finite figures, and
// the latency model folds the plan's features in (the first attack's failure).
TEST(BoundsTest, LargestAllowedValuesPlanAndFoldIn) {
  PlannerConfig config = OneRankConfig();
  config.ranks = 2;
  config.micro_batches = 2;
  config.micro_batch_capacity = kMaxMicroBatchCapacity;
  config.shape.layers = kMaxLayers;
  config.shape.heads = kMaxHeads;
  config.shape.head_dim = kMaxHeadDim;
  config.overflow = OverflowPolicy::kDefer;
  const int64_t half = kMaxMicroBatchCapacity / 2;
  const std::vector<Sample> batch = {
      {1, kMaxMicroBatchCapacity, 0.0, 0, {}},
      {2, kMaxMicroBatchCapacity, 0.5, 0, {half, half}},
      {3, kMaxMicroBatchCapacity, 1.0, 7, {1, kMaxMicroBatchCapacity - 1}},
      {4, kMaxMicroBatchCapacity, 0.2, 7, {}},
      {5, 1, 0.0, 0, {1}},
  };
  for (int local_blocks : {0, 1, kMaxLocalBlocks}) {
    for (int block_size : {64, 128}) {
      for (Policy policy : AllPolicies()) {
        config.shape.local_blocks = local_blocks;
        config.shape.block_size = block_size;
        config.policy = policy;
        const std::string where = absl::StrCat(PolicyName(policy), " local_blocks ", local_blocks,
                                               " block_size ", block_size);
        LatencyModel model = MakeModel(config);
        absl::StatusOr<StepPlan> plan = PlanStep(batch, config, model);
        ASSERT_TRUE(plan.ok()) << where << ": " << plan.status();
        ExpectValidPlan(*plan, batch, config, where);
        EXPECT_TRUE(std::isfinite(plan->makespan_seconds)) << where;
        std::vector<Observation> observations;
        for (int r = 0; r < config.ranks; ++r) {
          for (int m = 0; m < config.micro_batches; ++m) {
            const MicroBatchPlan& mb = plan->ranks[r].micro_batches[m];
            if (mb.samples.empty()) continue;
            const MicroBatchFeatures features = model.PlanFeatures(mb);
            ASSERT_TRUE(std::isfinite(features.active_blocks) && features.active_blocks > 0)
                << where;
            observations.push_back({r, m, features, 1.5 * mb.predicted_seconds});
          }
        }
        EXPECT_TRUE(model.ObserveStep(observations).ok()) << where;
      }
    }
  }
}

// Property: any mix of extreme values in every config and sample field never crashes, and
// whatever ValidateConfig and ValidateBatch accept plans into a plan that passes CheckPlan.
TEST(BoundsTest, ExtremeValuesNeverCrashAndWhatIsAcceptedPlansValidly) {
  const double kNaN = std::numeric_limits<double>::quiet_NaN();
  const double kInf = std::numeric_limits<double>::infinity();
  const std::vector<int64_t> kInt64s = {kInt64Max,
                                        std::numeric_limits<int64_t>::min(),
                                        kInt32Max,
                                        int64_t{1} << 31,
                                        -1,
                                        0,
                                        1,
                                        2,
                                        3,
                                        64,
                                        4096,
                                        kMaxMicroBatchCapacity,
                                        kMaxMicroBatchCapacity + 1};
  const std::vector<int> kInt32s = {kInt32Max,
                                    std::numeric_limits<int>::min(),
                                    -1,
                                    0,
                                    1,
                                    2,
                                    4,
                                    64,
                                    128,
                                    kMaxLayers,
                                    kMaxLayers + 1,
                                    kMaxMicroBatches,
                                    kMaxLocalBlocks,
                                    kMaxLocalBlocks + 1};
  const std::vector<double> kDoubles = {kNaN, kInf, -kInf, -1.0, 0.0, 1e-300,
                                        0.05, 0.3,  0.5,   1.0,  1.5, 2.0};
  Rng rng(20240611);
  auto pick = [&rng](const auto& pool) { return pool[rng.NextU64() % pool.size()]; };
  // In half the cases the config (and independently the batch) is wild: a third of its
  // fields extreme. The other half keeps sane values, so a fair share is accepted and planned.
  bool wild = false;
  auto extreme = [&] { return wild && rng.NextU64() % 3 == 0; };
  auto int32_or = [&](int sane) { return extreme() ? pick(kInt32s) : sane; };
  auto int64_or = [&](int64_t sane) { return extreme() ? pick(kInt64s) : sane; };
  auto double_or = [&](double sane) { return extreme() ? pick(kDoubles) : sane; };
  int accepted = 0;
  int planned = 0;
  for (int c = 0; c < 2000; ++c) {
    wild = rng.NextU64() % 2 == 0;
    PlannerConfig config;
    config.ranks = int32_or(1 + static_cast<int>(rng.NextU64() % 8));
    config.micro_batches = int32_or(1 + static_cast<int>(rng.NextU64() % 4));
    config.micro_batch_capacity = int64_or(int64_t{1} << (8 + rng.NextU64() % 23));
    config.shape.layers = int32_or(32);
    config.shape.heads = int32_or(32);
    config.shape.head_dim = int32_or(128);
    config.shape.block_size = int32_or(rng.NextU64() % 2 == 0 ? 64 : 128);
    config.shape.local_blocks = int32_or(1);
    config.density_min = double_or(0.05);
    config.density_max = double_or(1.0);
    config.density_default = double_or(0.3);
    config.policy = AllPolicies()[rng.NextU64() % AllPolicies().size()];
    config.dst_mode = test_util::AllDstModes()[rng.NextU64() % 4];
    config.dst_quantile = double_or(0.5);
    config.overflow = rng.NextU64() % 2 == 0 ? OverflowPolicy::kError : OverflowPolicy::kDefer;
    // Keep the test quick: a huge accepted rank count plans a large (valid) plan.
    if (int64_t{config.ranks} * std::max(config.micro_batches, 1) > 4096 &&
        rng.NextU64() % 8 != 0) {
      config.ranks = 3;
    }
    wild = rng.NextU64() % 2 == 0;
    std::vector<Sample> batch(1 + rng.NextU64() % 6);
    for (size_t i = 0; i < batch.size(); ++i) {
      Sample& s = batch[i];
      s.id = rng.NextU64() % 4 == 0 ? rng.NextU64() : i;
      const int64_t sane_length = 1 + static_cast<int64_t>(rng.NextU64() % 20000);
      s.length = int64_or(sane_length);
      s.sensitivity = double_or(rng.Uniform());
      s.group = rng.NextU64() % 3 == 0 ? 1 + rng.NextU64() % 2 : 0;
      switch (wild ? rng.NextU64() % 4 : 1 + rng.NextU64() % 3) {
        case 0:  // one extreme segment among sane ones
          s.segments = {s.length / 2, pick(kInt64s), s.length - s.length / 2};
          break;
        case 1:  // a valid split (when the length allows)
          if (s.length >= 2) s.segments = {1, s.length - 1};
          break;
        case 2:  // the wrapping attack
          if (wild) s.segments = {kInt64Max, kInt64Max, 3};
          break;
        default:
          break;
      }
    }
    const std::string where = absl::StrCat("case ", c);
    const absl::Status config_status = ValidateConfig(config);
    const absl::Status batch_status = ValidateBatch(batch, config);
    if (!config_status.ok()) {
      EXPECT_EQ(config_status.code(), absl::StatusCode::kInvalidArgument) << where;
      EXPECT_THAT(std::string(config_status.message()), HasSubstr("config.")) << where;
      EXPECT_EQ(batch_status, config_status) << where;
      continue;
    }
    if (!batch_status.ok()) {
      EXPECT_EQ(batch_status.code(), absl::StatusCode::kInvalidArgument) << where;
      EXPECT_THAT(std::string(batch_status.message()), HasSubstr("samples")) << where;
      EXPECT_FALSE(PlanStepLocally(batch, config).ok()) << where;
      continue;
    }
    ++accepted;
    absl::StatusOr<StepPlan> plan = PlanStepLocally(batch, config);
    if (!plan.ok()) {
      // Only a batch that does not fit may still be refused (a group too large for a rank).
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << where;
      EXPECT_EQ(config.overflow, OverflowPolicy::kError) << where << ": " << plan.status();
      continue;
    }
    ++planned;
    const absl::Status check = CheckPlan(*plan, batch, config);
    ASSERT_TRUE(check.ok()) << where << ": " << check;
    EXPECT_TRUE(std::isfinite(plan->makespan_seconds)) << where;
  }
  // The pools are chosen so that both sides are exercised.
  EXPECT_GT(accepted, 100);
  EXPECT_GT(planned, 100);
}

// Bytes the heap hands out now (glibc): its arenas' and its mapped chunks'.
size_t HeapInUse() {
  const struct mallinfo2 info = mallinfo2();
  return info.uordblks + info.hblkhd;
}

// Whether HeapInUse sees allocations: not under a sanitizer, whose own allocator glibc's
// mallinfo2 knows nothing of (scripts/tsan.sh's build reports 0 for everything).
bool HeapIsMeasured() {
  const size_t before = HeapInUse();
  const std::vector<char> block(size_t{4} << 20, 1);
  asm volatile("" : : "r"(block.data()) : "memory");  // the block is not optimized away
  return HeapInUse() >= before + block.size();
}

// Planning keeps its per-sample arrays per thread between steps, but a step of more than
// kKeptScratchSamples samples frees them when it ends: one very large batch must not leave the
// thread holding them (some 200 bytes a sample across the table, the placement and the tuner).
// A small step's arrays are kept (the heap stays larger by them), a large one's are not.
TEST(PlanStepTest, AVeryLargeStepLeavesNoPerSampleArraysHeld) {
  if (!HeapIsMeasured()) GTEST_SKIP() << "mallinfo2 does not see this build's allocator";
  const PlannerConfig config = test_util::StepConfig(4096, 4, 131072);
  const absl::StatusOr<ValidConfig> valid = ValidConfig::Check(config);
  ASSERT_TRUE(valid.ok()) << valid.status();
  const LatencyModel model = test_util::MakeModel(config);
  const RecallModel recall(config.micro_batch_capacity, config.shape.layers);
  // The heap after a step of `batch`, its plan gone, less the heap before it.
  auto held_after = [&](const std::vector<Sample>& batch) {
    const size_t before = HeapInUse();
    {
      const absl::StatusOr<StepPlan> plan = PlanStep(batch, *valid, model, recall);
      EXPECT_TRUE(plan.ok()) << plan.status();
    }
    const size_t after = HeapInUse();
    return after > before ? after - before : 0;
  };
  std::vector<Sample> large = test_util::TraceBatch(config, 3, 0.6);
  ASSERT_GT(large.size(), kKeptScratchSamples);
  const std::vector<Sample> small(large.begin(), large.begin() + kKeptScratchSamples / 2);
  // On a thread of its own, whose arrays start empty whatever ran before on this one.
  std::thread([&] {
    // A small step first: its arrays stay.
    EXPECT_GT(held_after(small), 50 * kKeptScratchSamples / 2) << "the small step's arrays";
    // The large one grows them past the limit and frees them: at most a few MiB stay.
    EXPECT_LT(held_after(large), size_t{8} << 20);
  }).join();
}

// ValidateBatch checks ids that do not increase with a set it drops before it returns: even a
// batch of more than kKeptScratchSamples unordered ids leaves nothing held on the thread.
TEST(ValidateBatchTest, AVeryLargeBatchOfUnorderedIdsLeavesNoScratchHeld) {
  if (!HeapIsMeasured()) GTEST_SKIP() << "mallinfo2 does not see this build's allocator";
  const PlannerConfig config = test_util::StepConfig(4096, 4, 131072);
  auto descending = [](size_t count) {
    std::vector<Sample> batch(count);
    for (size_t i = 0; i < count; ++i) batch[i] = {count - i, 100, 0.0, 0, {}};
    return batch;
  };
  const std::vector<Sample> large = descending(kKeptScratchSamples + 1000);
  std::thread([&] {
    const size_t before = HeapInUse();
    EXPECT_TRUE(ValidateBatch(large, config).ok());
    const size_t after = HeapInUse();
    EXPECT_LT(after > before ? after - before : 0, size_t{1} << 20);
  }).join();
}

}  // namespace
}  // namespace sparsebalance
