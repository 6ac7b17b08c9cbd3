#include "server/step_pack.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "planner/latency_model.h"
#include "planner/planner.h"
#include "planner/recall_model.h"
#include "tests/server/test_support.h"

namespace sparsebalance {
namespace {

// A double's bits: equal bits, equal value (-0.0 and NaN payloads included).
uint64_t Bits(double v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(v));
  return bits;
}

// Every field CanonicalPlanText leaves out, and every double bit for bit.
void ExpectSamePlan(const StepPlan& a, const StepPlan& b) {
  EXPECT_EQ(CanonicalPlanText(a), CanonicalPlanText(b));
  EXPECT_EQ(a.planned_locally, b.planned_locally);
  EXPECT_EQ(a.buckets, b.buckets);
  for (auto [x, y] : {std::pair(a.makespan_seconds, b.makespan_seconds),
                      {a.gap, b.gap},
                      {a.lower_bound_seconds, b.lower_bound_seconds},
                      {a.imbalance_ratio, b.imbalance_ratio},
                      {a.bubble_ratio, b.bubble_ratio},
                      {a.mean_density, b.mean_density},
                      {a.predicted_recall, b.predicted_recall}}) {
    EXPECT_EQ(Bits(x), Bits(y));
  }
  ASSERT_EQ(a.ranks.size(), b.ranks.size());
  for (size_t r = 0; r < a.ranks.size(); ++r) {
    EXPECT_EQ(Bits(a.ranks[r].predicted_seconds), Bits(b.ranks[r].predicted_seconds));
    ASSERT_EQ(a.ranks[r].micro_batches.size(), b.ranks[r].micro_batches.size());
    for (size_t m = 0; m < a.ranks[r].micro_batches.size(); ++m) {
      const MicroBatchPlan& x = a.ranks[r].micro_batches[m];
      const MicroBatchPlan& y = b.ranks[r].micro_batches[m];
      EXPECT_EQ(x.samples, y.samples) << "rank " << r << " micro-batch " << m;
      EXPECT_EQ(x.features_known, y.features_known);
      EXPECT_EQ(x.features, y.features);
      EXPECT_EQ(Bits(x.predicted_seconds), Bits(y.predicted_seconds));
      EXPECT_EQ(Bits(x.default_density), Bits(y.default_density));
    }
  }
}

void ExpectSameBatch(const std::vector<Sample>& a, const std::vector<Sample>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].id, b[i].id);
    EXPECT_EQ(a[i].length, b[i].length);
    EXPECT_EQ(Bits(a[i].sensitivity), Bits(b[i].sensitivity));
    EXPECT_EQ(a[i].group, b[i].group);
    EXPECT_EQ(a[i].segments, b[i].segments);
  }
}

void ExpectSameReports(const StepReports& a, const StepReports& b) {
  ASSERT_EQ(a.count(), b.count());
  for (int rank = 0; rank < std::max(a.slots(), b.slots()); ++rank) {
    ASSERT_EQ(a.has(rank), b.has(rank)) << "rank " << rank;
    if (!a.has(rank)) continue;
    EXPECT_EQ(Bits(a.wait_seconds(rank)), Bits(b.wait_seconds(rank))) << "rank " << rank;
    const std::vector<MicroBatchTiming>& timings = a.timings(rank);
    const std::vector<MicroBatchTiming>& other = b.timings(rank);
    ASSERT_EQ(timings.size(), other.size());
    for (size_t k = 0; k < timings.size(); ++k) {
      const MicroBatchTiming& x = timings[k];
      const MicroBatchTiming& y = other[k];
      EXPECT_EQ(x.micro_batch, y.micro_batch);
      EXPECT_EQ(x.tokens, y.tokens);
      for (auto [u, v] : {std::pair(x.compute_seconds, y.compute_seconds),
                          {x.attention_seconds, y.attention_seconds},
                          {x.achieved_density, y.achieved_density},
                          {x.recall, y.recall},
                          {x.recall_seconds, y.recall_seconds},
                          {x.exchange_seconds, y.exchange_seconds}}) {
        EXPECT_EQ(Bits(u), Bits(v));
      }
      EXPECT_EQ(x.documents, y.documents);
    }
  }
}

// A step with every optional part a plan and a report can have: shards over a group of ranks
// (test_support's hand-made context-parallel step), segments, per-layer densities, deferred
// ids, recall buckets, the features of the prediction, documents' measured recalls with
// per-layer values; and doubles the compact codes do not cover (-0.0, NaN, infinities,
// subnormals, fractions) next to those they do (integers, multiples of 2^-16), ids at both ends
// of uint64 and negative values in signed fields.
PackedStepContents RichStep() {
  ModelShape shape;
  LatencyModel model(shape, 4, kDefaultCostPrior);
  test_support::ShardedStep sharded = test_support::MakeShardedStep(model, 4);
  PackedStepContents step;
  step.batch = sharded.batch;
  step.batch.push_back({std::numeric_limits<uint64_t>::max(), 3000, 0.25, 7, {1000, 2000}});
  step.batch.push_back({0, 5, 1.0 / 3.0, 0, {}});
  step.batch[0].sensitivity = -0.0;
  step.plan = sharded.plan;
  step.plan.policy = Policy::kDst;
  step.plan.planned_locally = true;
  step.plan.deferred_ids = {std::numeric_limits<uint64_t>::max(), 0, 12345678901234ull};
  step.plan.gap = -0.0;
  step.plan.bubble_ratio = std::numeric_limits<double>::quiet_NaN();
  step.plan.imbalance_ratio = std::numeric_limits<double>::infinity();
  step.plan.predicted_recall = std::numeric_limits<double>::denorm_min();
  step.plan.buckets.push_back({2, "8K-32K", 8193, 32768, 123456, 0.97, 0.99});
  step.plan.buckets.push_back({-1, "", -5, 0, 0, -0.5, std::numeric_limits<double>::max()});
  MicroBatchPlan& mb = step.plan.ranks[1].micro_batches[1];
  PlannedSample packed;
  packed.id = std::numeric_limits<uint64_t>::max();
  packed.length = 3000;
  packed.density = 0.125;  // a multiple of 2^-16
  packed.segments = {1000, 2000};
  packed.layer_densities = {0.5, 1.0 / 7.0, -0.0, 3.0};
  mb.samples.push_back(packed);
  mb.features_known = true;
  mb.features = {1234.5, 11000, 2, 1e9 / 3};
  step.plan.ranks[3].micro_batches[0].samples[0].shard_index = -2;
  step.plan.ranks[2].micro_batches[0].features_known = true;
  step.plan.ranks[2].micro_batches[0].features.exchange_bytes = -1e300;

  std::vector<std::vector<MicroBatchTiming>> timings(4);
  for (int r = 0; r < 4; ++r) {
    timings[r] = test_support::TimingsOf(step.plan.ranks[r].micro_batches, 1.1);
  }
  DocumentRecallMeasurement d;
  d.sample_id = std::numeric_limits<uint64_t>::max();
  d.document = 1;
  d.recall = 0.875;
  d.layer_recall = {0.5, 0.9375, 1.0 / 3.0};
  d.rows = 8;
  timings[1].back().documents.push_back(d);
  timings[1].back().documents.push_back({101, 0, 0.1, {}, 1});
  timings[2][0].exchange_seconds = 1e-7;
  timings[2][0].recall_seconds = -0.0;
  const std::vector<double> waits = {0.0, 0.01, std::nan("7"),
                                     std::numeric_limits<double>::infinity()};
  // Ranks out of order, with a gap (rank 4 did not report) and an empty report (rank 5's).
  step.reports.Put(5, {}, -0.0);
  for (int r : {2, 0, 3, 1}) step.reports.Put(r, timings[r], waits[r]);
  return step;
}

TEST(StepPackTest, EveryFieldComesBackBitForBit) {
  const PackedStepContents step = RichStep();
  ASSERT_TRUE(step.plan.ranks[0].micro_batches[0].samples[0].sharded());
  const std::string bytes = PackStep(step.batch, step.plan, step.reports);
  absl::StatusOr<PackedStepContents> back = UnpackStep(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSameBatch(step.batch, back->batch);
  ExpectSamePlan(step.plan, back->plan);
  ASSERT_EQ(back->reports.count(), 5);
  EXPECT_FALSE(back->reports.has(4));
  ExpectSameReports(step.reports, back->reports);
  // Packing what was unpacked gives the same bytes.
  EXPECT_EQ(PackStep(back->batch, back->plan, back->reports), bytes);
}

TEST(StepPackTest, AnEmptyStepRoundTrips) {
  const std::string bytes = PackStep({}, StepPlan{}, {});
  absl::StatusOr<PackedStepContents> back = UnpackStep(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->batch.empty());
  ExpectSamePlan(StepPlan{}, back->plan);
  EXPECT_TRUE(back->reports.empty());
}

TEST(StepPackTest, CutOrExtendedBytesDoNotUnpack) {
  const PackedStepContents step = RichStep();
  const std::string bytes = PackStep(step.batch, step.plan, step.reports);
  for (size_t n = 0; n < bytes.size(); ++n) {
    absl::StatusOr<PackedStepContents> back = UnpackStep(absl::string_view(bytes).substr(0, n));
    EXPECT_EQ(back.status().code(), absl::StatusCode::kInternal) << "first " << n << " bytes";
  }
  EXPECT_EQ(UnpackStep(bytes + '\0').status().code(), absl::StatusCode::kInternal);
}

// What the registry gains: a planned step of the pretrain trace (DST densities, its buckets
// and predictions) packs into less than a quarter of the bytes its values take in memory
// (vectors' elements and the structs themselves; the allocator's own overhead not counted).
TEST(StepPackTest, APlannedStepPacksIntoUnderAQuarterOfItsValues) {
  const int ranks = 16;
  JobSettings settings = test_support::SmallJob(ranks);
  absl::StatusOr<ValidConfig> config = ValidConfig::Check(settings.planner);
  ASSERT_TRUE(config.ok()) << config.status();
  const std::vector<Sample> batch = test_support::PretrainBatch(5, ranks, 0.8);
  LatencyModel model(settings.planner.shape, ranks, kDefaultCostPrior);
  absl::StatusOr<StepPlan> plan = PlanStep(batch, *config, model);
  ASSERT_TRUE(plan.ok()) << plan.status();
  StepReports reports;
  size_t bytes = sizeof(PackedStepContents) + batch.size() * sizeof(Sample) +
                 plan->ranks.size() * sizeof(RankPlan);
  for (const Sample& s : batch) bytes += s.segments.size() * sizeof(int64_t);
  for (int r = 0; r < ranks; ++r) {
    for (const MicroBatchPlan& mb : plan->ranks[r].micro_batches) {
      bytes += sizeof(MicroBatchPlan) + mb.samples.size() * sizeof(PlannedSample);
      for (const PlannedSample& p : mb.samples) {
        bytes += p.segments.size() * sizeof(int64_t) + p.layer_densities.size() * sizeof(double) +
                 p.shard_group.size() * sizeof(int);
      }
    }
    reports.Put(r, test_support::TimingsOf(plan->ranks[r].micro_batches, 1.05), 0.002 * r);
    bytes += reports.timings(r).size() * sizeof(MicroBatchTiming) + sizeof(double);
  }
  const std::string packed = PackStep(batch, *plan, reports);
  EXPECT_LT(4 * packed.size(), bytes) << packed.size() << " bytes packed, " << bytes << " unpacked";
  absl::StatusOr<PackedStepContents> back = UnpackStep(packed);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSamePlan(*plan, back->plan);
}

// A job that plans per layer: PackStep with the step's LayerDensityRecipe leaves the layer
// densities out (a small part of the bytes remains), and UnpackStep with the same recipe gives
// the plan back bit for bit; without it, or with a recipe the step was not planned with (the
// recall model a step later), unpacking fails rather than serve other densities.
TEST(StepPackTest, LeftOutLayerDensitiesComeBackFromTheirRecipe) {
  const int ranks = 16;
  JobSettings settings = test_support::SmallJob(ranks);
  settings.planner.shape.layers = 6;
  absl::StatusOr<ValidConfig> config = ValidConfig::Check(settings.planner);
  ASSERT_TRUE(config.ok()) << config.status();
  const std::vector<Sample> batch = test_support::PretrainBatch(9, ranks, 0.8);
  LatencyModel model(settings.planner.shape, ranks, kDefaultCostPrior);
  LayerDensityRecipe recipe{settings.planner,
                            RecallModel(settings.planner.micro_batch_capacity, 6)};
  std::vector<RecallObservation> observations;
  for (int b = 0; b < kRecallBuckets; ++b) {
    const int64_t length = RecallBucketRange(b, settings.planner.micro_batch_capacity).min;
    for (int k = 1; k <= 19; ++k) {
      const double rho = 0.05 * k;
      for (int l = -1; l < 6; ++l) {
        const double g = l < 0 ? 4.0 : 2.0 + 0.8 * l;
        for (int n = 0; n < 4; ++n) observations.push_back({length, l, rho, RecallAt(g, rho)});
      }
    }
  }
  ASSERT_TRUE(recipe.recall.ObserveStep(observations).ok());
  absl::StatusOr<StepPlan> plan = PlanStep(batch, *config, model, recipe.recall);
  ASSERT_TRUE(plan.ok()) << plan.status();
  int split = 0;
  for (const RankPlan& rank : plan->ranks) {
    for (const MicroBatchPlan& mb : rank.micro_batches) {
      for (const PlannedSample& p : mb.samples) split += p.layer_densities.empty() ? 0 : 1;
    }
  }
  ASSERT_GT(split, 20);
  const std::string raw = PackStep(batch, *plan, {});
  const std::string bytes = PackStep(batch, *plan, {}, &recipe);
  EXPECT_LT(2 * bytes.size(), raw.size()) << bytes.size() << " against " << raw.size();
  absl::StatusOr<PackedStepContents> back = UnpackStep(bytes, &recipe);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSamePlan(*plan, back->plan);
  EXPECT_EQ(UnpackStep(bytes).status().code(), absl::StatusCode::kInternal);
  LayerDensityRecipe later = recipe;
  ASSERT_TRUE(
      later.recall
          .ObserveStep(std::vector<RecallObservation>(40, {4096, 2, 0.3, RecallAt(9.0, 0.3)}))
          .ok());
  EXPECT_EQ(UnpackStep(bytes, &later).status().code(), absl::StatusCode::kInternal);
  // The check a restarted planner makes before it trusts a stored recipe: the step's own gives
  // every density back, the later one does not, and neither do recipes for a plan without
  // per-layer densities or whose one changed density no recipe gives.
  EXPECT_TRUE(RecipeGivesLayerDensities(batch, *plan, recipe));
  EXPECT_FALSE(RecipeGivesLayerDensities(batch, *plan, later));
  StepPlan changed = *plan;
  StepPlan flat = *plan;
  bool once = false;
  for (RankPlan& rank : changed.ranks) {
    for (MicroBatchPlan& mb : rank.micro_batches) {
      for (PlannedSample& p : mb.samples) {
        if (!once && !p.layer_densities.empty()) {
          p.layer_densities.back() = std::nextafter(p.layer_densities.back(), 2.0);
          once = true;
        }
      }
    }
  }
  for (RankPlan& rank : flat.ranks) {
    for (MicroBatchPlan& mb : rank.micro_batches) {
      for (PlannedSample& p : mb.samples) p.layer_densities.clear();
    }
  }
  ASSERT_TRUE(once);
  EXPECT_FALSE(RecipeGivesLayerDensities(batch, changed, recipe));
  EXPECT_FALSE(RecipeGivesLayerDensities(batch, flat, recipe));
  // Packed raw, a step needs no recipe.
  absl::StatusOr<PackedStepContents> plain = UnpackStep(raw);
  ASSERT_TRUE(plain.ok()) << plain.status();
  ExpectSamePlan(*plan, plain->plan);
}

TEST(StepReportsTest, SlotsCountRanksOnceAndKeepTheLatestReport) {
  StepReports reports;
  EXPECT_TRUE(reports.empty());
  EXPECT_FALSE(reports.has(0));
  EXPECT_FALSE(reports.has(-1));
  reports.Reserve(8);
  EXPECT_EQ(reports.slots(), 8);
  EXPECT_EQ(reports.count(), 0);
  EXPECT_FALSE(reports.has(7));
  reports.Put(7, {MicroBatchTiming{}}, 0.5);
  reports.Put(7, {MicroBatchTiming{}, MicroBatchTiming{}}, 0.25);  // replaces, counted once
  reports.Put(10, {}, 1.0);                                        // grows the slots
  EXPECT_EQ(reports.count(), 2);
  EXPECT_EQ(reports.slots(), 11);
  EXPECT_TRUE(reports.has(7));
  EXPECT_TRUE(reports.has(10));
  EXPECT_FALSE(reports.has(9));
  EXPECT_FALSE(reports.has(11));
  EXPECT_EQ(reports.timings(7).size(), 2u);
  EXPECT_EQ(reports.wait_seconds(7), 0.25);
  EXPECT_TRUE(reports.timings(10).empty());
  reports.Clear();
  EXPECT_TRUE(reports.empty());
  EXPECT_EQ(reports.slots(), 0);
  EXPECT_FALSE(reports.has(7));
}

}  // namespace
}  // namespace sparsebalance
