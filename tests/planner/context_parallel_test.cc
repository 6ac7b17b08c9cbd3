#include "planner/context_parallel.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/latency_model.h"
#include "planner/planner.h"
#include "planner/random.h"
#include "planner/types.h"
#include "tests/planner/random_cases.h"

namespace sparsebalance {
namespace {

using test_util::MakeModel;
using ::testing::HasSubstr;

PlannerConfig CpConfig(int ranks, int micro_batches, int max_shards, Policy policy) {
  PlannerConfig c;
  c.ranks = ranks;
  c.micro_batches = micro_batches;
  c.micro_batch_capacity = 32768;
  c.max_shards = max_shards;
  c.policy = policy;
  return c;
}

// `long_length` tokens of one document (id 1000), then short documents of 500..3000 tokens
// until `fill` of the step's tokens.
std::vector<Sample> BatchWithOneLongDocument(const PlannerConfig& c, int64_t long_length,
                                             double fill, uint64_t seed) {
  std::vector<Sample> batch = {{1000, long_length, 0.0, 0, {}}};
  Rng rng(seed);
  int64_t total = long_length;
  const int64_t budget = static_cast<int64_t>(
      fill * static_cast<double>(c.ranks * c.micro_batches * c.micro_batch_capacity));
  for (uint64_t id = 0;; ++id) {
    const int64_t length = 500 + static_cast<int64_t>(rng.Uniform() * 2500);
    if (total + length > budget) break;
    batch.push_back({id, length, 0.0, 0, {}});
    total += length;
  }
  return batch;
}

// The shards of `id` in the plan, by shard index: (rank, micro-batch, planned sample).
struct FoundShard {
  int rank;
  int micro_batch;
  PlannedSample planned;
};
std::map<int, FoundShard> ShardsOf(const StepPlan& plan, uint64_t id) {
  std::map<int, FoundShard> out;
  for (int r = 0; r < static_cast<int>(plan.ranks.size()); ++r) {
    for (int m = 0; m < static_cast<int>(plan.ranks[r].micro_batches.size()); ++m) {
      for (const PlannedSample& p : plan.ranks[r].micro_batches[m].samples) {
        if (p.id == id && p.sharded()) out[p.shard_index] = {r, m, p};
      }
    }
  }
  return out;
}

TEST(ContextParallelTest, ADocumentFourTimesTheCapacityTrainsOverFourRanks) {
  for (Policy policy :
       {Policy::kSequential, Policy::kFlops, Policy::kSab, Policy::kSparseBalance}) {
    SCOPED_TRACE(PolicyName(policy));
    PlannerConfig c = CpConfig(4, 2, 4, policy);
    std::vector<Sample> batch = BatchWithOneLongDocument(c, 4 * c.micro_batch_capacity, 0.9, 3);
    const LatencyModel model = MakeModel(c);
    absl::StatusOr<StepPlan> plan = PlanStep(batch, c, model);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(CheckPlan(*plan, batch, c).ok()) << CheckPlan(*plan, batch, c);
    const std::map<int, FoundShard> shards = ShardsOf(*plan, 1000);
    ASSERT_EQ(shards.size(), 4u);
    std::set<int> ranks;
    int64_t next = 0;
    for (const auto& [j, s] : shards) {
      EXPECT_EQ(s.planned.shard_begin, next);
      EXPECT_EQ(s.planned.shard_begin % c.shape.block_size, 0);
      EXPECT_LE(s.planned.QueryTokens(), c.micro_batch_capacity);
      EXPECT_EQ(s.micro_batch, shards.at(0).micro_batch);
      EXPECT_EQ(s.planned.shard_group[j], s.rank);
      EXPECT_EQ(s.planned.shard_group, shards.at(0).planned.shard_group);
      // Split documents run first in their micro-batch.
      EXPECT_EQ(plan->ranks[s.rank].micro_batches[s.micro_batch].samples.front().id, 1000u);
      ranks.insert(s.rank);
      next = s.planned.shard_end;
    }
    EXPECT_EQ(next, 4 * c.micro_batch_capacity);
    EXPECT_EQ(ranks.size(), 4u);
    EXPECT_TRUE(plan->deferred_ids.empty());
  }
}

TEST(ContextParallelTest, WithoutSplittingALongDocumentIsAnErrorThatSaysHowToSplitIt) {
  PlannerConfig c = CpConfig(4, 2, 1, Policy::kSparseBalance);
  std::vector<Sample> batch = BatchWithOneLongDocument(c, 2 * c.micro_batch_capacity, 0.5, 1);
  const absl::StatusOr<StepPlan> plan = PlanStep(batch, c, MakeModel(c));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("samples[0].length"));
  EXPECT_THAT(plan.status().message(), HasSubstr("max_shards"));
  // Splitting allowed, but over too few ranks: 3 x capacity needs 3 shards.
  c.max_shards = 2;
  batch = BatchWithOneLongDocument(c, 3 * c.micro_batch_capacity, 0.5, 1);
  const absl::StatusOr<StepPlan> too_few = PlanStep(batch, c, MakeModel(c));
  EXPECT_EQ(too_few.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_few.status().message(), HasSubstr("max_shards x micro_batch_capacity"));
  // A pre-packed sample is never split.
  c.max_shards = 4;
  batch = {
      {5, 2 * c.micro_batch_capacity, 0.0, 0, {c.micro_batch_capacity, c.micro_batch_capacity}}};
  const absl::StatusOr<StepPlan> packed = PlanStep(batch, c, MakeModel(c));
  EXPECT_EQ(packed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(packed.status().message(), HasSubstr("never split"));
}

TEST(ContextParallelTest, AGroupsDocumentsAreNeverSplitAndOneAboveTheCapacityIsRefused) {
  // Document 1 fits a micro-batch but costs more than the mean rank's share: ungrouped, the
  // sparse policy splits it. In group 5 it must train whole, on the rank of its group.
  for (ShardPolicy policy : {ShardPolicy::kSparse, ShardPolicy::kDense, ShardPolicy::kStatic}) {
    SCOPED_TRACE(static_cast<int>(policy));
    PlannerConfig c = CpConfig(4, 1, 4, Policy::kSparseBalance);
    c.shard_policy = policy;
    c.shard_min_length = 8192;
    std::vector<Sample> batch = {{1, 30000, 0.0, 5, {}}, {2, 500, 0.0, 5, {}}};
    for (uint64_t id = 10; id < 16; ++id) batch.push_back({id, 2000, 0.0, 0, {}});
    const absl::StatusOr<StepPlan> plan = PlanStep(batch, c, MakeModel(c));
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(CheckPlan(*plan, batch, c).ok()) << CheckPlan(*plan, batch, c);
    EXPECT_TRUE(ShardsOf(*plan, 1).empty());
    // The same document out of any group is split: the check above is not vacuous.
    batch[0].group = 0;
    batch[1].group = 0;
    const absl::StatusOr<StepPlan> ungrouped = PlanStep(batch, c, MakeModel(c));
    ASSERT_TRUE(ungrouped.ok()) << ungrouped.status();
    EXPECT_FALSE(ShardsOf(*ungrouped, 1).empty());
  }
  // A grouped document above the capacity could never be placed: refused up front, under
  // either overflow policy, naming the sample and its group.
  for (OverflowPolicy overflow : {OverflowPolicy::kError, OverflowPolicy::kDefer}) {
    PlannerConfig c = CpConfig(4, 1, 4, Policy::kSparseBalance);
    c.overflow = overflow;
    const std::vector<Sample> batch = {{1, 500, 0.0, 0, {}},
                                       {2, c.micro_batch_capacity + 1, 0.0, 7, {}}};
    const absl::Status status = ValidateBatch(batch, c);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr("samples[1].length"));
    EXPECT_THAT(status.message(), HasSubstr("group 7"));
    EXPECT_EQ(PlanStep(batch, c, MakeModel(c)).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(ContextParallelTest, TheLongestDocumentAllowedIsWhatBlockAlignedShardsHold) {
  // Capacity 100 with blocks of 64: a shard but the last ends on a block boundary, so it holds
  // at most 64 tokens, and two shards hold 64 + 100 = 164 tokens, not 2 x 100.
  EXPECT_EQ(LongestSplittable(2, 100, 64), 164);
  EXPECT_EQ(LongestSplittable(4, 32768, 64), 4 * 32768);
  EXPECT_EQ(LongestSplittable(3, 50, 64), 50);  // below a block: no cut fits
  for (ShardPolicy policy : {ShardPolicy::kSparse, ShardPolicy::kStatic}) {
    for (OverflowPolicy overflow : {OverflowPolicy::kError, OverflowPolicy::kDefer}) {
      SCOPED_TRACE(absl::StrCat(static_cast<int>(policy), " ", static_cast<int>(overflow)));
      PlannerConfig c = CpConfig(4, 2, 2, Policy::kSparseBalance);
      c.micro_batch_capacity = 100;
      c.shard_policy = policy;
      c.overflow = overflow;
      // The longest allowed is planned, in two shards.
      std::vector<Sample> batch = {{1, 164, 0.0, 0, {}}, {2, 50, 0.0, 0, {}}};
      const absl::StatusOr<StepPlan> plan = PlanStep(batch, c, MakeModel(c));
      ASSERT_TRUE(plan.ok()) << plan.status();
      ASSERT_TRUE(CheckPlan(*plan, batch, c).ok()) << CheckPlan(*plan, batch, c);
      EXPECT_EQ(ShardsOf(*plan, 1).size(), 2u);
      EXPECT_TRUE(plan->deferred_ids.empty());
      // One token more, up to 2 x capacity, fits no block-aligned split: refused, not deferred
      // for ever.
      for (int64_t length : {165, 200}) {
        batch[0].length = length;
        const absl::Status status = ValidateBatch(batch, c);
        EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(status.message(), HasSubstr("samples[0].length"));
        EXPECT_THAT(status.message(), HasSubstr("164 tokens"));
        EXPECT_THAT(status.message(), HasSubstr("block boundaries"));
      }
    }
  }
}

// A document that must be split but has fewer query blocks than max_shards (each shard holds
// at least one) is split over as many ranks as it has blocks, under every shard policy: the
// sparse and dense policies tried only shard counts above its blocks when their cost guess was
// high, and the static one only max_shards equal shards, so it was refused (deferred every
// step under defer) though two shards hold it.
TEST(ContextParallelTest, ADocumentOfFewerBlocksThanMaxShardsIsSplitOverAsManyRanks) {
  for (ShardPolicy policy : {ShardPolicy::kSparse, ShardPolicy::kDense, ShardPolicy::kStatic}) {
    for (OverflowPolicy overflow : {OverflowPolicy::kError, OverflowPolicy::kDefer}) {
      SCOPED_TRACE(absl::StrCat(static_cast<int>(policy), " ", static_cast<int>(overflow)));
      // Capacity 100, blocks of 64, max_shards 4: 101 tokens are 2 blocks, two shards hold them.
      PlannerConfig c = CpConfig(8, 1, 4, Policy::kSparseBalance);
      c.micro_batch_capacity = 100;
      c.shard_policy = policy;
      c.overflow = overflow;
      const std::vector<Sample> batch = {{1, 101, 0.0, 0, {}}, {2, 60, 0.0, 0, {}}};
      ASSERT_TRUE(ValidateBatch(batch, c).ok()) << ValidateBatch(batch, c);
      const absl::StatusOr<StepPlan> plan = PlanStep(batch, c, MakeModel(c));
      ASSERT_TRUE(plan.ok()) << plan.status();
      ASSERT_TRUE(CheckPlan(*plan, batch, c).ok()) << CheckPlan(*plan, batch, c);
      EXPECT_EQ(ShardsOf(*plan, 1).size(), 2u);
      EXPECT_TRUE(plan->deferred_ids.empty());
    }
  }
}

TEST(ContextParallelTest, AMaximumGroupAboveTheWorldSizeIsAConfigError) {
  PlannerConfig c = CpConfig(4, 2, 5, Policy::kSparseBalance);
  const absl::Status status = ValidateConfig(c);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("config.max_shards = 5"));
  c.max_shards = 0;
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("config.max_shards = 0"));
  c.max_shards = 2;
  c.shard_min_length = -1;
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("config.shard_min_length"));
}

TEST(ContextParallelTest, CutsBalanceSparseCostSoEarlierShardsHoldMoreTokens) {
  PlannerConfig c = CpConfig(8, 1, 8, Policy::kSparseBalance);
  c.micro_batch_capacity = 131072;
  const LatencyModel model = MakeModel(c);
  for (double density : {1.0, 0.3}) {
    SCOPED_TRACE(density);
    const int64_t length = 131072;
    double largest = 0.0;
    const std::vector<int64_t> cuts =
        CostBalancedCuts(model, length, density, 4, c.micro_batch_capacity, &largest);
    ASSERT_EQ(cuts.size(), 5u);
    EXPECT_EQ(cuts.front(), 0);
    EXPECT_EQ(cuts.back(), length);
    double smallest = 1e300;
    double biggest = 0.0;
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(cuts[j] % c.shape.block_size, 0);
      const double t = ShardSeconds(model, length, cuts[j], cuts[j + 1], density);
      smallest = std::min(smallest, t);
      biggest = std::max(biggest, t);
      if (j > 0) {  // causal: a later shard's rows keep more blocks, so it gets fewer tokens
        EXPECT_LT(cuts[j + 1] - cuts[j], cuts[j] - cuts[j - 1]);
      }
    }
    EXPECT_DOUBLE_EQ(biggest, largest);
    // Balanced to within about one block row of the last shard.
    EXPECT_LT(biggest / smallest, 1.02);
    // Equal-token cuts are further from balance.
    const std::vector<int64_t> equal = EqualTokenCuts(length, 64, 4, c.micro_batch_capacity);
    double equal_biggest = 0.0;
    for (int j = 0; j < 4; ++j) {
      equal_biggest =
          std::max(equal_biggest, ShardSeconds(model, length, equal[j], equal[j + 1], density));
    }
    EXPECT_GT(equal_biggest, 1.1 * biggest);
  }
  // Fewer blocks than shards, or shards that cannot hold the document: no cuts.
  EXPECT_TRUE(CostBalancedCuts(model, 128, 0.3, 4, 1 << 20).empty());
  EXPECT_TRUE(CostBalancedCuts(model, 100000, 0.3, 2, 40000).empty());
  EXPECT_TRUE(EqualTokenCuts(100000, 64, 2, 40000).empty());
}

TEST(ContextParallelTest, SplittingBringsTheStepTowardsTheBoundThatAllowsIt) {
  PlannerConfig c = CpConfig(16, 1, 8, Policy::kSparseBalance);
  c.micro_batch_capacity = 65536;
  PlannerConfig off = c;
  off.max_shards = 1;
  // One document that alone outlasts the mean rank.
  const std::vector<Sample> batch = BatchWithOneLongDocument(c, 65536, 0.7, 5);
  const LatencyModel model = MakeModel(c);
  absl::StatusOr<StepPlan> split = PlanStep(batch, c, model);
  absl::StatusOr<StepPlan> whole = PlanStep(batch, off, model);
  ASSERT_TRUE(split.ok()) << split.status();
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_TRUE(CheckPlan(*split, batch, c).ok());
  EXPECT_GE(ShardsOf(*split, 1000).size(), 2u);
  EXPECT_LT(split->makespan_seconds, 0.8 * whole->makespan_seconds);
  EXPECT_LT(split->lower_bound_seconds, whole->lower_bound_seconds);
  EXPECT_GE(split->makespan_seconds, split->lower_bound_seconds);
  // Balanced ranks; above the bound by about the key/value exchange, which the bound leaves
  // out (a plan that splits less exchanges less).
  EXPECT_LT(split->imbalance_ratio, 1.05);
  EXPECT_LT(split->gap, 0.25);
}

TEST(ContextParallelTest, StaticSplitsLongDocumentsEquallyOverFixedGroups) {
  PlannerConfig c = CpConfig(8, 2, 4, Policy::kFlops);
  c.shard_policy = ShardPolicy::kStatic;
  c.shard_min_length = 8192;
  std::vector<Sample> batch = BatchWithOneLongDocument(c, 20000, 0.6, 9);
  batch.push_back({2000, 9000, 0.0, 0, {}});
  batch.push_back({2001, 8000, 0.0, 0, {}});  // below shard_min_length: whole
  absl::StatusOr<StepPlan> plan = PlanStep(batch, c, MakeModel(c));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(CheckPlan(*plan, batch, c).ok());
  for (uint64_t id : {1000u, 2000u}) {
    const std::map<int, FoundShard> shards = ShardsOf(*plan, id);
    ASSERT_EQ(shards.size(), 4u) << id;
    const int first = shards.at(0).rank;
    EXPECT_EQ(first % 4, 0);
    for (const auto& [j, s] : shards) EXPECT_EQ(s.rank, first + j);
    // Equal tokens, at block boundaries: at most one block apart.
    for (const auto& [j, s] : shards) {
      EXPECT_NEAR(static_cast<double>(s.planned.QueryTokens()),
                  static_cast<double>(shards.at(0).planned.QueryTokens()), 64.0);
    }
  }
  EXPECT_TRUE(ShardsOf(*plan, 2001).empty());
}

TEST(ContextParallelTest, PlansAreDeterministicAndADocumentThatFitsNowhereIsDeferredOrAnError) {
  PlannerConfig c = CpConfig(8, 2, 4, Policy::kSparseBalance);
  const std::vector<Sample> batch = BatchWithOneLongDocument(c, 100000, 0.8, 2);
  absl::StatusOr<StepPlan> a = PlanStep(batch, c, MakeModel(c));
  absl::StatusOr<StepPlan> b = PlanStep(batch, c, MakeModel(c));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(CanonicalPlanText(*a), CanonicalPlanText(*b));
  EXPECT_THAT(CanonicalPlanText(*a), HasSubstr("#0@"));

  // Every rank's micro-batches nearly full: no four ranks have room for the shards.
  PlannerConfig full = CpConfig(4, 1, 4, Policy::kSparseBalance);
  std::vector<Sample> crowded = {{1, 30000, 0.0, 0, {}},
                                 {2, 30000, 0.0, 0, {}},
                                 {3, 30000, 0.0, 0, {}},
                                 {4, 30000, 0.0, 0, {}},
                                 {5, 3 * full.micro_batch_capacity, 0.0, 0, {}}};
  full.overflow = OverflowPolicy::kDefer;
  absl::StatusOr<StepPlan> deferred = PlanStep(crowded, full, MakeModel(full));
  ASSERT_TRUE(deferred.ok()) << deferred.status();
  ASSERT_TRUE(CheckPlan(*deferred, crowded, full).ok());
  EXPECT_FALSE(deferred->deferred_ids.empty());
}

TEST(ContextParallelTest, ThePlanCheckRefusesShardsThatMissOrRepeatTokens) {
  PlannerConfig c = CpConfig(4, 2, 4, Policy::kSparseBalance);
  std::vector<Sample> batch = BatchWithOneLongDocument(c, 3 * c.micro_batch_capacity, 0.8, 4);
  absl::StatusOr<StepPlan> plan = PlanStep(batch, c, MakeModel(c));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(CheckPlan(*plan, batch, c).ok());
  const std::map<int, FoundShard> shards = ShardsOf(*plan, 1000);
  ASSERT_GE(shards.size(), 3u);
  auto mutate = [&](int index, auto change) {
    StepPlan bad = *plan;
    const FoundShard& at = shards.at(index);
    MicroBatchPlan& mb = bad.ranks[at.rank].micro_batches[at.micro_batch];
    for (PlannedSample& p : mb.samples) {
      if (p.id == 1000) {
        mb.tokens -= p.QueryTokens();
        change(p);
        mb.tokens += p.QueryTokens();  // the micro-batch's count stays consistent
      }
    }
    return CheckPlan(bad, batch, c);
  };
  // Shard 1 starts a block late: tokens missed.
  absl::Status missed = mutate(1, [](PlannedSample& p) { p.shard_begin += 64; });
  EXPECT_EQ(missed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(missed.message(), HasSubstr("tokens missed"));
  // ... or a block early: tokens repeated.
  absl::Status repeated = mutate(1, [](PlannedSample& p) { p.shard_begin -= 64; });
  EXPECT_THAT(repeated.message(), HasSubstr("tokens repeated"));
  // The last shard stops short of the document's end.
  const int last = static_cast<int>(shards.size()) - 1;
  absl::Status short_end = mutate(last, [](PlannedSample& p) { p.shard_end -= 1; });
  EXPECT_THAT(short_end.message(), HasSubstr("tokens missed"));
  // A shard claims another rank's place in the ring.
  absl::Status wrong_rank = mutate(0, [](PlannedSample& p) { p.shard_index = 1; });
  EXPECT_THAT(wrong_rank.message(), HasSubstr("shard_index"));
  // Misaligned cut.
  absl::Status misaligned = mutate(1, [](PlannedSample& p) { p.shard_begin += 1; });
  EXPECT_EQ(misaligned.code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ContextParallelTest, TheLatencyModelLearnsTheExchangeRateApartFromCompute) {
  PlannerConfig c = CpConfig(4, 1, 4, Policy::kSparseBalance);
  LatencyModel model = MakeModel(c);
  const double prior = model.exchange_seconds_per_byte();
  EXPECT_DOUBLE_EQ(prior, kDefaultExchangeSecondsPerByte);
  PlannedSample shard;
  shard.id = 1;
  shard.length = 65536;
  shard.density = 0.3;
  shard.shard_begin = 32768;
  shard.shard_end = 65536;
  shard.shard_index = 1;
  shard.shard_group = {0, 1};
  const MicroBatchFeatures f = model.PlannedSampleFeatures(shard);
  EXPECT_DOUBLE_EQ(f.exchange_bytes, ShardExchangeBytes(c.shape, 32768));
  EXPECT_EQ(f.tokens, 32768);
  // The truth exchanges at 10 GB/s; compute is as the model predicts.
  const double truth = 1.0 / 10e9;
  for (int step = 0; step < 30; ++step) {
    const double exchange = f.exchange_bytes * truth;
    const double compute = model.ComputeSeconds(f);
    ASSERT_TRUE(model.ObserveStep({{1, 0, f, compute + exchange, exchange}}).ok());
  }
  EXPECT_NEAR(model.exchange_seconds_per_byte(), truth, 0.05 * truth);
  EXPECT_NEAR(model.speed_factor(1), 1.0, 0.05);  // the network is not the rank's speed
  // An exchange time outside [0, measured) refuses the whole step.
  const absl::Status bad = model.ObserveStep({{1, 0, f, 1.0, 1.5}});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("exchange_seconds"));
}

}  // namespace
}  // namespace sparsebalance
