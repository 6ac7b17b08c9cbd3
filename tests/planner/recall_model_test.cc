// RecallModel: the prior without measurements, the fit per length bucket and layer, validation,
// and the per-bucket recall guards PlanStep enforces with a learned model.
#include "planner/recall_model.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "planner/planner.h"
#include "planner/random.h"
#include "planner/sparsity_tuner.h"
#include "tests/planner/random_cases.h"

namespace sparsebalance {
namespace {

constexpr int64_t kCapacity = 131072;

// Observations of documents of `length` whose true curve is 1 - (1 - rho)^g, measured at
// densities spread over [0.05, 0.5] (where the planner plans; above, a large g keeps all but
// 1e-4 of the mass and the fit only learns that g is large).
std::vector<RecallObservation> Measured(int64_t length, double g, int count, int layer = -1) {
  std::vector<RecallObservation> out;
  for (int k = 0; k < count; ++k) {
    const double rho = 0.05 + 0.45 * (k % 17) / 16.0;
    out.push_back({length, layer, rho, RecallAt(g, rho)});
  }
  return out;
}

TEST(RecallBucketTest, FourContiguousBucketsCoverTheCapacity) {
  EXPECT_EQ(RecallBucketLabel(0, kCapacity), "<2K");
  EXPECT_EQ(RecallBucketLabel(1, kCapacity), "2K-8K");
  EXPECT_EQ(RecallBucketLabel(2, kCapacity), "8K-32K");
  EXPECT_EQ(RecallBucketLabel(3, kCapacity), "32K+");
  for (int64_t capacity : {int64_t{1024}, int64_t{4096}, kCapacity, int64_t{1} << 20}) {
    int64_t next = 1;
    for (int b = 0; b < kRecallBuckets; ++b) {
      const LengthRange range = RecallBucketRange(b, capacity);
      EXPECT_EQ(range.min, next) << capacity << " bucket " << b;
      EXPECT_GE(range.max, range.min);
      EXPECT_EQ(RecallBucket(range.min, capacity), b);
      EXPECT_EQ(RecallBucket(range.max, capacity), b);
      next = range.max + 1;
    }
    EXPECT_EQ(next, capacity + 1);
  }
}

// A document's bucket is the last one whose lowest length it reaches, also at capacities so
// small that several edges coincide (each edge is at least 2 tokens).
TEST(RecallBucketTest, ABucketIsTheLastWhoseEdgeTheLengthReaches) {
  for (int64_t capacity = 1; capacity <= 300; ++capacity) {
    for (int64_t length = 1; length <= capacity + 2; ++length) {
      int last = 0;
      for (int k = 1; k < kRecallBuckets; ++k) {
        if (length >= RecallBucketEdge(k, capacity)) last = k;
      }
      ASSERT_EQ(RecallBucket(length, capacity), last)
          << "capacity " << capacity << " length " << length;
    }
  }
  EXPECT_EQ(RecallBucket(1, 4), 0);
  EXPECT_EQ(RecallBucket(2, 4), 3);  // all three edges are 2 tokens
}

TEST(RecallModelTest, WithoutMeasurementsTheSensitivityPriorDecides) {
  const RecallModel model(kCapacity, 4);
  for (double s : {0.0, 0.3, 1.0}) {
    EXPECT_DOUBLE_EQ(model.Exponent(100000, s), RecallExponent(s));
    EXPECT_DOUBLE_EQ(model.LayerExponent(1000, s, 2), RecallExponent(s));
  }
  EXPECT_FALSE(model.HasLayerCurves());
}

TEST(RecallModelTest, LearnsEachBucketsCurveFromMeasurementsAlone) {
  RecallModel model(kCapacity, 4);
  for (int step = 0; step < 30; ++step) {
    std::vector<RecallObservation> obs = Measured(65536, 2.0, 200);     // long: sensitive
    std::vector<RecallObservation> shorter = Measured(1024, 9.0, 200);  // short: tolerant
    obs.insert(obs.end(), shorter.begin(), shorter.end());
    ASSERT_TRUE(model.ObserveStep(obs).ok());
  }
  // The prior (g = 6 at sensitivity 0) weighs 16 documents against ~2,000 measured ones.
  EXPECT_NEAR(model.Exponent(65536, 0.0), 2.0, 0.05);
  // Bin means of a concave curve sit a little below the curve (within a bin of width 0.05).
  EXPECT_NEAR(model.Exponent(1024, 0.0), 9.0, 0.15);
  // Buckets nobody measured keep the prior.
  EXPECT_DOUBLE_EQ(model.Exponent(4096, 0.0), RecallExponent(0.0));
  // A trainer-given sensitivity no longer matters much once the bucket has measurements.
  EXPECT_NEAR(model.Exponent(65536, 1.0), 2.0, 0.05);
  const std::vector<RecallCurveSummary> curves = model.Curves();
  ASSERT_EQ(curves.size(), static_cast<size_t>(kRecallBuckets));
  EXPECT_GT(curves[3].documents, 1000.0);
  EXPECT_EQ(curves[1].documents, 0.0);
}

// AllLayers, which the sample table reads for every sample, gives the model's own buckets and
// exponents bit for bit: a curve learned per bucket (each its own g), one left to the prior, at
// and around every edge, with a capacity small enough that the edges clamp to 2.
TEST(RecallModelTest, AllLayersGivesTheModelsExponentsBitForBit) {
  for (int64_t capacity : {kCapacity, int64_t{64}}) {
    RecallModel model(capacity, 2);
    std::vector<RecallObservation> obs;
    for (int b : {0, 1, 3}) {  // bucket 2 keeps the prior
      const std::vector<RecallObservation> bucket =
          Measured(RecallBucketRange(b, capacity).min, 1.5 + b, 50);
      obs.insert(obs.end(), bucket.begin(), bucket.end());
    }
    ASSERT_TRUE(model.ObserveStep(obs).ok());
    const AllLayerExponents all = model.AllLayers();
    std::vector<int64_t> lengths = {1, 2, 3, capacity, capacity * kMaxShards};
    for (int b = 1; b < kRecallBuckets; ++b) {
      const int64_t edge = RecallBucketEdge(b, capacity);
      lengths.insert(lengths.end(), {edge - 1, edge, edge + 1});
    }
    for (int64_t length : lengths) {
      EXPECT_EQ(all.Bucket(length), RecallBucket(length, capacity)) << length;
      for (double s : {0.0, 0.3, 1.0}) {
        EXPECT_EQ(all.Exponent(length, s), model.Exponent(length, s)) << length << " " << s;
        EXPECT_EQ(all.InBucket(RecallBucket(length, capacity), s), model.Exponent(length, s));
      }
    }
    const Sample packed{7, capacity, 0.3, 0, {capacity / 8, capacity / 2, capacity * 3 / 8}};
    double weighted = 0.0;
    for (int64_t segment : packed.segments) {
      weighted += static_cast<double>(segment) * model.Exponent(segment, packed.sensitivity);
    }
    EXPECT_EQ(model.SampleExponent(packed), weighted / static_cast<double>(packed.length));
    EXPECT_EQ(all.SampleExponent(packed), model.SampleExponent(packed));
  }
}

// LayerExponents gives every layer's LayerExponent bit for bit: layers with curves of their own
// and one left to its bucket's, at and around every bucket edge.
TEST(RecallModelTest, LayerExponentsGivesEachLayersExponentBitForBit) {
  const int layers = 5;
  RecallModel model(kCapacity, layers);
  std::vector<RecallObservation> obs;
  for (int b = 0; b < kRecallBuckets; ++b) {
    const int64_t length = RecallBucketRange(b, kCapacity).min;
    for (int l = -1; l < layers - 1; ++l) {  // the last layer keeps its bucket's curve
      const std::vector<RecallObservation> m = Measured(length, 1.5 + b + 0.7 * l, 30, l);
      obs.insert(obs.end(), m.begin(), m.end());
    }
  }
  ASSERT_TRUE(model.ObserveStep(obs).ok());
  std::vector<int64_t> lengths = {1, 2, kCapacity, kCapacity * kMaxShards};
  for (int b = 1; b < kRecallBuckets; ++b) {
    const int64_t edge = RecallBucketEdge(b, kCapacity);
    lengths.insert(lengths.end(), {edge - 1, edge, edge + 1});
  }
  std::vector<double> g(layers);
  for (int64_t length : lengths) {
    for (double s : {0.0, 0.3, 1.0}) {
      model.LayerExponents(length, s, g.data());
      for (int l = 0; l < layers; ++l) {
        EXPECT_EQ(g[l], model.LayerExponent(length, s, l)) << length << " " << s << " " << l;
      }
    }
  }
}

TEST(RecallModelTest, LayerCurvesFallBackToTheBucketsCurve) {
  RecallModel model(kCapacity, 2);
  for (int step = 0; step < 20; ++step) {
    std::vector<RecallObservation> obs = Measured(65536, 3.0, 100);
    std::vector<RecallObservation> l0 = Measured(65536, 1.5, 100, /*layer=*/0);
    obs.insert(obs.end(), l0.begin(), l0.end());
    ASSERT_TRUE(model.ObserveStep(obs).ok());
  }
  EXPECT_TRUE(model.HasLayerCurves());
  EXPECT_NEAR(model.LayerExponent(65536, 0.0, 0), 1.5, 0.05);
  // Layer 1 was never measured on its own: the bucket's all-layer curve.
  EXPECT_DOUBLE_EQ(model.LayerExponent(65536, 0.0, 1), model.Exponent(65536, 0.0));
}

TEST(RecallModelTest, OlderStepsAreForgotten) {
  RecallModel model(kCapacity, 1);
  for (int step = 0; step < 20; ++step)
    ASSERT_TRUE(model.ObserveStep(Measured(65536, 2.0, 200)).ok());
  for (int step = 0; step < 40; ++step)
    ASSERT_TRUE(model.ObserveStep(Measured(65536, 5.0, 200)).ok());
  EXPECT_NEAR(model.Exponent(65536, 0.0), 5.0, 0.1);
}

TEST(RecallModelTest, RefusesABadObservationNamingItAndKeepsTheState) {
  RecallModel model(kCapacity, 4);
  ASSERT_TRUE(model.ObserveStep(Measured(65536, 2.0, 10)).ok());
  const RecallModelState before = model.state();
  struct Bad {
    RecallObservation o;
    const char* field;
  };
  for (const Bad& bad :
       std::vector<Bad>{{{0, -1, 0.3, 0.5}, "observations[1].length"},
                        {{kMaxShards * kCapacity + 1, -1, 0.3, 0.5}, "observations[1].length"},
                        {{100, 4, 0.3, 0.5}, "observations[1].layer"},
                        {{100, -2, 0.3, 0.5}, "observations[1].layer"},
                        {{100, -1, 0.0, 0.5}, "observations[1].density"},
                        {{100, -1, NAN, 0.5}, "observations[1].density"},
                        {{100, -1, 0.3, 1.5}, "observations[1].recall"},
                        {{100, -1, 0.3, NAN}, "observations[1].recall"}}) {
    const absl::Status s = model.ObserveStep({{100, -1, 0.3, 0.5}, bad.o});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(bad.field), absl::string_view::npos) << s.message();
    EXPECT_EQ(model.state().curves, before.curves);
    EXPECT_EQ(model.state().steps_observed, before.steps_observed);
  }
  RecallModelState wrong = before;
  wrong.curves.pop_back();
  EXPECT_EQ(model.set_state(wrong).code(), absl::StatusCode::kInvalidArgument);
  wrong = before;
  wrong.curves[0].documents[3] = INFINITY;
  EXPECT_EQ(model.set_state(wrong).code(), absl::StatusCode::kInvalidArgument);
  wrong = before;
  wrong.curves[0].documents[3] = 1.0;
  wrong.curves[0].recall[3] = 2.0;  // a mean recall of 2
  EXPECT_EQ(model.set_state(wrong).code(), absl::StatusCode::kInvalidArgument);
}

// Documents added at once (RecallStepSums::AddDocument: the all-layers recall, then each layer's
// at its own density, or at the document's where the densities are not one per layer) fold into
// the same state, bit for bit, as the same measurements one by one; a bad one is named by its
// place among them, and a step of sums refused or not folded leaves the model as it was.
TEST(RecallStepSumsTest, DocumentsFoldAsTheirMeasurementsOneByOne) {
  const int layers = 4;
  RecallModel by_document(kCapacity, layers);
  RecallModel one_by_one(kCapacity, layers);
  for (int step = 0; step < 3; ++step) {
    RecallStepSums sums(by_document);
    std::vector<RecallObservation> flat;
    for (int k = 0; k < 200; ++k) {
      const int64_t length = 1 + (k * 7919 + step) % (2 * kCapacity);
      const double density = 0.01 + 0.99 * ((k * 37) % 100) / 99.0;
      const double recall = 1.0 - std::pow(1.0 - density, 2.0 + k % 5);
      std::vector<double> layer_densities;
      std::vector<double> layer_recall;
      const int measured = k % 7 == 0 ? 0 : k % 7 == 1 ? layers - 1 : layers;
      for (int l = 0; l < measured; ++l) {
        layer_densities.push_back(std::min(1.0, density * (0.5 + 0.3 * l)));
        layer_recall.push_back(std::min(1.0, recall * (0.8 + 0.1 * l)));
      }
      if (k % 5 == 0) layer_densities.clear();  // the document's density in every layer
      ASSERT_TRUE(sums.AddDocument(length, density, recall, layer_densities, layer_recall).ok());
      flat.push_back({length, -1, density, recall});
      for (int l = 0; l < measured; ++l) {
        flat.push_back(
            {length, l, layer_densities.empty() ? density : layer_densities[l], layer_recall[l]});
      }
    }
    EXPECT_EQ(sums.size(), flat.size());
    ASSERT_TRUE(by_document.ObserveStep(sums).ok());
    ASSERT_TRUE(one_by_one.ObserveStep(flat).ok());
    EXPECT_EQ(by_document.state().curves, one_by_one.state().curves) << "step " << step;
    EXPECT_EQ(by_document.state().steps_observed, one_by_one.state().steps_observed);
    EXPECT_EQ(by_document.LayerExponent(4096, 0.2, 2), one_by_one.LayerExponent(4096, 0.2, 2));
  }
  const RecallModelState before = by_document.state();
  struct Bad {
    std::vector<double> layer_densities;
    std::vector<double> layer_recall;
    const char* field;
  };
  for (const Bad& bad : std::vector<Bad>{
           {{0.3, 0.3, 0.3}, {0.5, 1.5, 0.5}, "observations[3].recall"},   // 1 + 1 + layer 1
           {{0.3, 0.0, 0.3}, {0.5, 0.5, 0.5}, "observations[3].density"},  // layer 1
           {{}, {0.5, 0.5, 0.5, 0.5, 0.5}, "observations[6].layer"}}) {    // layer 4 of 4
    RecallStepSums sums(by_document);
    ASSERT_TRUE(sums.AddDocument(100, 0.3, 0.5, {}, {}).ok());
    const absl::Status s = sums.AddDocument(100, 0.3, 0.5, bad.layer_densities, bad.layer_recall);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(bad.field), absl::string_view::npos) << s.message();
    EXPECT_EQ(by_document.state().curves, before.curves);  // sums apart from the model
  }
  RecallModel other(kCapacity, layers + 1);
  EXPECT_EQ(other.ObserveStep(RecallStepSums(by_document)).code(),
            absl::StatusCode::kInvalidArgument);
}

// A learned model in which long documents lose recall fast and short ones hardly at all: the
// case where the token-weighted guard alone lets the long buckets pay for the speed-up.
RecallModel LongDocumentsSensitive(const PlannerConfig& config) {
  RecallModel model(config.micro_batch_capacity, config.shape.layers);
  const double g[kRecallBuckets] = {12.0, 6.0, 2.5, 1.5};
  for (int step = 0; step < 10; ++step) {
    std::vector<RecallObservation> obs;
    for (int b = 0; b < kRecallBuckets; ++b) {
      const LengthRange range = RecallBucketRange(b, config.micro_batch_capacity);
      std::vector<RecallObservation> m = Measured(range.min, g[b], 50);
      obs.insert(obs.end(), m.begin(), m.end());
    }
    EXPECT_TRUE(model.ObserveStep(obs).ok());
  }
  return model;
}

// The largest drop of a bucket's predicted recall below its recall at the default density.
double WorstBucketDrop(const StepPlan& plan) {
  double worst = 0.0;
  for (const BucketRecallFigures& b : plan.buckets) {
    worst = std::max(worst, b.default_recall - b.predicted_recall);
  }
  return worst;
}

TEST(RecallGuardTest, NoLengthBucketLosesMoreThanTheMargin) {
  test_util::FailureBudget budget;
  double unguarded_worst = 0.0;
  int planned = 0;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    test_util::RandomCase c = test_util::MakeRandomCase(seed, 400);
    c.config.policy = Policy::kSparseBalance;
    c.config.dst_mode = seed % 3 == 0 ? DstMode::kMax : DstMode::kMean;
    const LatencyModel model = test_util::MakeModel(c.config, c.speed);
    const RecallModel recall = LongDocumentsSensitive(c.config);
    absl::StatusOr<ValidConfig> valid = ValidConfig::Check(c.config);
    ASSERT_TRUE(valid.ok()) << valid.status();
    absl::StatusOr<StepPlan> plan = PlanStep(c.batch, *valid, model, recall);
    if (test_util::RefusedAsAGroupThatFitsNoRank(plan.status())) continue;
    ASSERT_TRUE(plan.ok()) << plan.status();
    ++planned;
    budget.Run([&] {
      EXPECT_LE(WorstBucketDrop(*plan), c.config.bucket_recall_margin + 1e-9) << "seed " << seed;
      EXPECT_TRUE(CheckPlan(*plan, c.batch, c.config).ok());
    });
    // The same case without the bucket guard (margin 1: only the token-weighted guard).
    PlannerConfig loose = c.config;
    loose.bucket_recall_margin = 1.0;
    absl::StatusOr<StepPlan> unguarded =
        PlanStep(c.batch, *ValidConfig::Check(loose), model, recall);
    ASSERT_TRUE(unguarded.ok());
    unguarded_worst = std::max(unguarded_worst, WorstBucketDrop(*unguarded));
  }
  budget.Summarize();
  EXPECT_GE(planned, 45);  // of 60 cases
  // Without it some bucket does pay (so the check above can fail).
  EXPECT_GT(unguarded_worst, 0.02);
}

TEST(RecallGuardTest, EveryDocumentKeepsTheRecallFloor) {
  int planned = 0;
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    test_util::RandomCase c = test_util::MakeRandomCase(seed, 300);
    c.config.document_recall_floor = 0.6;
    const RecallModel recall = LongDocumentsSensitive(c.config);
    const LatencyModel model = test_util::MakeModel(c.config, c.speed);
    for (Policy policy : {Policy::kSequential, Policy::kSparseBalance}) {
      c.config.policy = policy;
      absl::StatusOr<StepPlan> plan =
          PlanStep(c.batch, *ValidConfig::Check(c.config), model, recall);
      if (test_util::RefusedAsAGroupThatFitsNoRank(plan.status())) continue;
      ASSERT_TRUE(plan.ok()) << plan.status();
      ++planned;
      for (const RankPlan& rank : plan->ranks) {
        for (const MicroBatchPlan& mb : rank.micro_batches) {
          for (const PlannedSample& p : mb.samples) {
            const Sample* s = nullptr;
            for (const Sample& b : c.batch) {
              if (b.id == p.id) s = &b;
            }
            ASSERT_NE(s, nullptr);
            if (p.density >= c.config.density_max) continue;  // the floor is out of reach
            EXPECT_GE(recall.SampleRecall(*s, p.density), 0.6 - 1e-9)
                << "seed " << seed << " policy " << PolicyName(policy) << " id " << p.id;
          }
        }
      }
    }
  }
  EXPECT_GE(planned, 45);  // of 60 plans (30 cases, 2 policies)
}

// A model whose layer 0 loses recall fast and layer 1 hardly at all, for every bucket.
RecallModel LayersDiffer(const PlannerConfig& config) {
  RecallModel model(config.micro_batch_capacity, config.shape.layers);
  for (int step = 0; step < 10; ++step) {
    std::vector<RecallObservation> obs;
    for (int b = 0; b < kRecallBuckets; ++b) {
      const int64_t length = RecallBucketRange(b, config.micro_batch_capacity).min;
      for (int l = 0; l < config.shape.layers; ++l) {
        std::vector<RecallObservation> m = Measured(length, l == 0 ? 1.5 : 8.0, 40, l);
        obs.insert(obs.end(), m.begin(), m.end());
      }
      std::vector<RecallObservation> all = Measured(length, 3.0, 40);
      obs.insert(obs.end(), all.begin(), all.end());
    }
    EXPECT_TRUE(model.ObserveStep(obs).ok());
  }
  return model;
}

TEST(LayerDensitiesTest, SpendTheSameDensityWhereRecallFallsFastest) {
  PlannerConfig config;
  config.shape.layers = 2;
  const RecallModel recall = LayersDiffer(config);
  Sample s;
  s.id = 1;
  s.length = 65536;
  for (double density : {0.1, 0.3, 0.6}) {
    const std::vector<double> rho = LayerDensities(s, density, config.density_min, config, recall);
    ASSERT_EQ(rho.size(), 2u);
    EXPECT_NEAR(0.5 * (rho[0] + rho[1]), density, 1e-9);
    // Where an extra block buys most recall: at low densities the tolerant layer (its recall
    // rises fast at first), at high ones the sensitive layer (the tolerant one has little left).
    if (density < 0.2) {
      EXPECT_LT(rho[0], rho[1]);
    }
    if (density > 0.5) {
      EXPECT_GT(rho[0], rho[1]);
    }
    // More recall over the layers than the same density in both.
    auto mean_recall = [&](double r0, double r1) {
      return 0.5 * (RecallAt(recall.LayerExponent(s.length, 0, 0), r0) +
                    RecallAt(recall.LayerExponent(s.length, 0, 1), r1));
    };
    EXPECT_GT(mean_recall(rho[0], rho[1]), mean_recall(density, density));
  }
  // Layers that agree get none.
  RecallModel same(config.micro_batch_capacity, 2);
  for (int l = 0; l < 2; ++l) ASSERT_TRUE(same.ObserveStep(Measured(65536, 3.0, 100, l)).ok());
  EXPECT_TRUE(LayerDensities(s, 0.3, 0.05, config, same).empty());
}

// The split is water-filling's: every layer strictly between its bounds has the same marginal
// recall g (1 - rho)^(g - 1) (an extra unit of density buys the same recall there), the mean is
// the density, and the overload that writes over a vector gives the same densities, emptying
// one that held others where there are none.
TEST(LayerDensitiesTest, EqualMarginalRecallInEveryLayerBetweenItsBounds) {
  // Layer counts with and without layers past the last four (the solve's pairs of lanes), and
  // a density_max that layers meet.
  for (const auto& [layers, density_max] :
       std::vector<std::pair<int, double>>{{6, 1.0}, {32, 1.0}, {33, 1.0}, {32, 0.6}, {33, 0.6}}) {
    PlannerConfig config;
    config.shape.layers = layers;
    config.density_max = density_max;
    const RecallModel recall = test_util::LearnedRecall(config);
    int compared = 0;
    std::vector<double> reused = {0.5, 0.5};
    for (int k = 0; k < 400; ++k) {
      Sample s;
      s.id = k;
      s.length = 1 + (k * 7919) % config.micro_batch_capacity;
      s.sensitivity = (k % 11) / 10.0;
      const double density = 0.03 + 0.95 * (k % 97) / 96.0;
      const double floor = config.density_min;
      const std::vector<double> rho = LayerDensities(s, density, floor, config, recall);
      LayerDensities(s, density, floor, config, recall, &reused);
      EXPECT_EQ(reused, rho) << k;
      if (rho.empty()) continue;
      ASSERT_EQ(rho.size(), static_cast<size_t>(layers));
      double mean = 0.0;
      for (double r : rho) {
        mean += r / layers;
        EXPECT_GE(r, std::min(floor, density)) << layers << " layers, " << k;
        EXPECT_LE(r, std::max(density_max, density)) << layers << " layers, " << k;
      }
      EXPECT_NEAR(mean, density, 1e-12) << layers << " layers, " << k;
      std::vector<double> marginal;
      for (int l = 0; l < layers; ++l) {
        const double lo = std::min(floor, density);
        if (rho[l] <= lo + 1e-9 || rho[l] >= config.density_max - 1e-9) continue;
        const double g = std::max(recall.LayerExponent(s.length, s.sensitivity, l), 1.0 + 1e-6);
        marginal.push_back(g * std::pow(1.0 - rho[l], g - 1.0));
      }
      for (double m : marginal) {
        EXPECT_NEAR(m / marginal[0], 1.0, 1e-6) << layers << " layers, " << k;
      }
      compared += marginal.size() > 1 ? 1 : 0;
    }
    EXPECT_GT(compared, 100) << layers << " layers";
  }
}

// Densities next to 1 (DST raises up to 1 - 1e-9 when density_max is 1): the per-layer split
// still averages to the sample's density. Its search once started at a fixed multiplier where a
// layer with a steep curve (exponent 8 here) sat near 0.96, and returned that.
TEST(LayerDensitiesTest, KeepTheMeanNextToDensityOne) {
  PlannerConfig config;
  config.shape.layers = 2;
  config.density_max = 1.0;
  const RecallModel recall = LayersDiffer(config);
  Sample s;
  s.id = 1;
  s.length = 65536;
  for (double density : {0.99, 0.9999, 1.0 - 1e-6, 1.0 - 1e-9}) {
    const std::vector<double> rho = LayerDensities(s, density, config.density_min, config, recall);
    if (rho.empty()) continue;  // both layers at the bound: one density
    ASSERT_EQ(rho.size(), 2u);
    EXPECT_NEAR(0.5 * (rho[0] + rho[1]), density, 1e-9) << "density " << density;
    EXPECT_LE(std::max(rho[0], rho[1]), 1.0);
  }
}

TEST(LayerDensitiesTest, TunedPlansCarryThemAndStayValid) {
  int with_layers = 0;  // over all seeds (a small batch may sit at density_max everywhere)
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    test_util::RandomCase c = test_util::MakeRandomCase(seed, 200);
    c.config.shape.layers = 2;
    c.config.policy = Policy::kSparseBalance;
    const RecallModel recall = LayersDiffer(c.config);
    const LatencyModel model = test_util::MakeModel(c.config, c.speed);
    absl::StatusOr<StepPlan> plan = PlanStep(c.batch, *ValidConfig::Check(c.config), model, recall);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(CheckPlan(*plan, c.batch, c.config).ok()) << CheckPlan(*plan, c.batch, c.config);
    for (const RankPlan& rank : plan->ranks) {
      for (const MicroBatchPlan& mb : rank.micro_batches) {
        for (const PlannedSample& p : mb.samples) {
          if (p.layer_densities.empty()) continue;
          ++with_layers;
          EXPECT_NEAR(0.5 * (p.layer_densities[0] + p.layer_densities[1]), p.density, 1e-6);
        }
      }
    }
    // Untuned policies run one density in every layer.
    c.config.policy = Policy::kSab;
    plan = PlanStep(c.batch, *ValidConfig::Check(c.config), model, recall);
    ASSERT_TRUE(plan.ok());
    for (const RankPlan& rank : plan->ranks) {
      for (const MicroBatchPlan& mb : rank.micro_batches) {
        for (const PlannedSample& p : mb.samples) EXPECT_TRUE(p.layer_densities.empty());
      }
    }
  }
  EXPECT_GT(with_layers, 0);
}

TEST(RecallGuardTest, ConfigRefusesAMarginOrFloorOutOfRange) {
  PlannerConfig config;
  config.bucket_recall_margin = -0.1;
  EXPECT_NE(ValidateConfig(config).message().find("bucket_recall_margin"), absl::string_view::npos);
  config.bucket_recall_margin = 0.01;
  config.document_recall_floor = 1.0;
  EXPECT_NE(ValidateConfig(config).message().find("document_recall_floor"),
            absl::string_view::npos);
}

}  // namespace
}  // namespace sparsebalance
