#include "planner/latency_model.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "contract/block_geometry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/random.h"

namespace sparsebalance {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// Roughly an 8B model on one H100: seconds per active block, token, document, micro-batch.
constexpr CostCoefficients kPrior{1.7e-5, 1e-4, 2e-3, 0.05};
// What the hardware really does: the prior is off by up to 50% per term.
constexpr CostCoefficients kTruth{1.7e-5 * 1.3, 1e-4 * 0.8, 2e-3 * 1.5, 0.05 * 0.6};

constexpr int kRanks = 8;
constexpr int kMicroBatches = 4;
constexpr int kSlowRank = 5;
constexpr double kSlowFactor = 1.5;

double TrueSeconds(const CostCoefficients& c, const MicroBatchFeatures& f) {
  return c.per_block * f.active_blocks + c.per_token * f.tokens + c.per_sample * f.documents +
         (f.tokens > 0 ? c.per_micro_batch : 0.0);
}

// A micro-batch as the planner packs them: 16K-128K tokens of documents of 128-64K tokens,
// each at its own density in [0.05, 1].
MicroBatchFeatures RandomMicroBatch(const LatencyModel& model, Rng& rng) {
  MicroBatchFeatures f;
  int64_t left = 16384 + static_cast<int64_t>(rng.NextU64() % (131072 - 16384));
  while (left > 0) {
    Sample s;
    s.length = std::min<int64_t>(
        left, static_cast<int64_t>(std::exp(std::log(128.0) + rng.Uniform() * std::log(512.0))));
    left -= s.length;
    const MicroBatchFeatures one = model.SampleFeatures(s, 0.05 + 0.95 * rng.Uniform());
    f.active_blocks += one.active_blocks;
    f.tokens += one.tokens;
    f.documents += one.documents;
  }
  return f;
}

// One step of measurements from the truth, every rank and micro-batch, ordered by rank.
std::vector<Observation> MeasuredStep(const LatencyModel& model, const std::vector<double>& speed,
                                      Rng& rng) {
  std::vector<Observation> step;
  for (int r = 0; r < static_cast<int>(speed.size()); ++r) {
    for (int m = 0; m < kMicroBatches; ++m) {
      Observation o;
      o.rank = r;
      o.micro_batch = m;
      o.features = RandomMicroBatch(model, rng);
      o.measured_seconds = speed[r] * TrueSeconds(kTruth, o.features);
      step.push_back(o);
    }
  }
  return step;
}

std::vector<double> TrueSpeeds() {
  std::vector<double> speed(kRanks, 1.0);
  speed[kSlowRank] = kSlowFactor;
  return speed;
}

template <typename T>
std::vector<uint64_t> Bits(const T& values) {
  std::vector<uint64_t> bits;
  for (double v : values) {
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(b));
    bits.push_back(b);
  }
  return bits;
}

// Bitwise equality of two states, with a readable failure.
void ExpectSameState(const LatencyModelState& a, const LatencyModelState& b) {
  EXPECT_EQ(Bits(a.weights), Bits(b.weights));
  EXPECT_EQ(Bits(a.covariance), Bits(b.covariance));
  EXPECT_EQ(Bits(a.speed_factors), Bits(b.speed_factors));
  EXPECT_EQ(a.steps_observed, b.steps_observed);
}

template <typename T>
void Shuffle(std::vector<T>* v, Rng& rng) {
  for (size_t i = v->size(); i > 1; --i) std::swap((*v)[i - 1], (*v)[rng.NextU64() % i]);
}

TEST(LatencyModelTest, StartsFromThePrior) {
  const LatencyModel model(ModelShape(), kRanks, kPrior);
  const CostCoefficients c = model.coefficients();
  EXPECT_DOUBLE_EQ(c.per_block, kPrior.per_block);
  EXPECT_DOUBLE_EQ(c.per_token, kPrior.per_token);
  EXPECT_DOUBLE_EQ(c.per_sample, kPrior.per_sample);
  EXPECT_DOUBLE_EQ(c.per_micro_batch, kPrior.per_micro_batch);
  EXPECT_EQ(model.ranks(), kRanks);
  EXPECT_EQ(model.speed_factors(), std::vector<double>(kRanks, 1.0));
  Rng rng(1);
  for (int i = 0; i < 100; ++i) {
    const MicroBatchFeatures f = RandomMicroBatch(model, rng);
    EXPECT_NEAR(model.Seconds(f), TrueSeconds(kPrior, f), 1e-12 * TrueSeconds(kPrior, f));
    EXPECT_EQ(model.PredictSeconds(3, f), model.Seconds(f));
  }
  EXPECT_EQ(model.Seconds(MicroBatchFeatures()), 0.0);  // an empty micro-batch costs nothing
}

// The worst relative error of the model's predictions over fresh micro-batches on every rank.
double WorstPredictionError(const LatencyModel& model, const std::vector<double>& speed, Rng& rng) {
  double worst = 0.0;
  for (int i = 0; i < 50 * kRanks; ++i) {
    const int r = i % kRanks;
    const MicroBatchFeatures f = RandomMicroBatch(model, rng);
    const double truth = speed[r] * TrueSeconds(kTruth, f);
    worst = std::max(worst, std::fabs(model.PredictSeconds(r, f) / truth - 1.0));
  }
  return worst;
}

TEST(LatencyModelTest, LearnsCoefficientsAndASlowRankFromItsOwnFunctionalForm) {
  LatencyModel model(ModelShape(), kRanks, kPrior);
  const std::vector<double> speed = TrueSpeeds();
  Rng rng(2);
  EXPECT_GT(WorstPredictionError(model, speed, rng), 0.3);  // the prior alone is far off
  for (int step = 0; step < 20; ++step) {
    ASSERT_TRUE(model.ObserveStep(MeasuredStep(model, speed, rng)).ok());
  }
  EXPECT_EQ(model.state().steps_observed, 20);
  // The median rank is 1 and the slow one is found.
  EXPECT_NEAR(model.speed_factor(kSlowRank), kSlowFactor, 0.05 * kSlowFactor);
  for (int r = 0; r < kRanks; ++r) {
    if (r != kSlowRank) {
      EXPECT_NEAR(model.speed_factor(r), 1.0, 0.05) << "rank " << r;
    }
  }
  // The attention and linear terms, which carry almost all of the time, are learned.
  EXPECT_NEAR(model.coefficients().per_block, kTruth.per_block, 0.02 * kTruth.per_block);
  EXPECT_NEAR(model.coefficients().per_token, kTruth.per_token, 0.02 * kTruth.per_token);
  EXPECT_LE(WorstPredictionError(model, speed, rng), 0.01);
}

TEST(LatencyModelTest, LearnsTheMicroBatchOverheadFromAZeroPrior) {
  // FitProfile always returns per_micro_batch = 0 (a profile cannot see it), so this is the
  // prior every deployment starts from. The term is under 2% of a micro-batch here, and the
  // model bounds each weight's variance (so that noisy, poorly excited steps, such as the
  // balanced micro-batches of SAB, cannot make it swing): it learns such a term slowly but
  // steadily, and predictions are good long before it has converged.
  CostCoefficients prior = kPrior;
  prior.per_micro_batch = 0.0;
  LatencyModel model(ModelShape(), kRanks, prior);
  EXPECT_EQ(model.coefficients().per_micro_batch, 0.0);
  const std::vector<double> speed = TrueSpeeds();
  Rng rng(3);
  double after_20 = 0.0;
  for (int step = 0; step < 60; ++step) {
    ASSERT_TRUE(model.ObserveStep(MeasuredStep(model, speed, rng)).ok());
    if (step == 19) {
      after_20 = model.coefficients().per_micro_batch;
      EXPECT_NEAR(model.speed_factor(kSlowRank), kSlowFactor, 0.05 * kSlowFactor);
      EXPECT_LE(WorstPredictionError(model, speed, rng), 0.02);
    }
  }
  EXPECT_GT(after_20, 0.0);
  EXPECT_GT(model.coefficients().per_micro_batch, after_20);  // still approaching the truth
  EXPECT_LT(model.coefficients().per_micro_batch, 1.5 * kTruth.per_micro_batch);
  EXPECT_LE(WorstPredictionError(model, speed, rng), 0.01);
}

class RefusedObservationTest : public ::testing::TestWithParam<double> {};

TEST_P(RefusedObservationTest, BadMeasuredSecondsRefuseTheWholeStepAndNameTheEntry) {
  LatencyModel model(ModelShape(), kRanks, kPrior);
  const std::vector<double> speed = TrueSpeeds();
  Rng rng(4);
  for (int step = 0; step < 3; ++step)
    ASSERT_TRUE(model.ObserveStep(MeasuredStep(model, speed, rng)).ok());
  const LatencyModelState before = model.state();
  std::vector<Observation> step = MeasuredStep(model, speed, rng);
  // Entry 9 is rank 2, micro-batch 1; entries before it are valid and must not be folded in.
  step[9].measured_seconds = GetParam();
  const absl::Status status = model.ObserveStep(step);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("measured_seconds"), HasSubstr("observation 9"), HasSubstr("rank 2"),
                    HasSubstr("micro_batch 1")));
  ExpectSameState(model.state(), before);
}

INSTANTIATE_TEST_SUITE_P(NonPositiveOrNonFinite, RefusedObservationTest,
                         ::testing::Values(std::numeric_limits<double>::quiet_NaN(),
                                           std::numeric_limits<double>::infinity(),
                                           -std::numeric_limits<double>::infinity(), 0.0, -0.0,
                                           -1.0, -1e-300));

// A non-finite feature folded in would turn every weight, the covariance and all speed factors
// into NaN for good.
TEST(LatencyModelTest, RefusesRanksOutOfRangeAndBadFeaturesWithoutChangingState) {
  LatencyModel model(ModelShape(), kRanks, kPrior);
  const std::vector<double> speed = TrueSpeeds();
  Rng rng(5);
  ASSERT_TRUE(model.ObserveStep(MeasuredStep(model, speed, rng)).ok());
  const LatencyModelState before = model.state();
  const std::vector<Observation> good = MeasuredStep(model, speed, rng);
  struct Case {
    const char* what;
    void (*spoil)(Observation*);
    const char* message;
  };
  const Case cases[] = {
      {"rank -1", [](Observation* o) { o->rank = -1; }, "rank is outside [0, 8)"},
      {"rank 8", [](Observation* o) { o->rank = kRanks; }, "rank is outside [0, 8)"},
      {"negative blocks", [](Observation* o) { o->features.active_blocks = -1; }, "features"},
      {"NaN blocks", [](Observation* o) { o->features.active_blocks = std::nan(""); }, "features"},
      {"infinite blocks",
       [](Observation* o) { o->features.active_blocks = std::numeric_limits<double>::infinity(); },
       "features"},
      {"zero tokens", [](Observation* o) { o->features.tokens = 0; }, "features"},
      {"infinite tokens",
       [](Observation* o) { o->features.tokens = std::numeric_limits<double>::infinity(); },
       "features"},
      {"no documents", [](Observation* o) { o->features.documents = 0; }, "features"},
      {"NaN documents", [](Observation* o) { o->features.documents = std::nan(""); }, "features"},
      {"infinite documents",
       [](Observation* o) { o->features.documents = std::numeric_limits<double>::infinity(); },
       "features"},
  };
  for (const Case& c : cases) {
    std::vector<Observation> step = good;
    c.spoil(&step[17]);
    const absl::Status status = model.ObserveStep(step);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(std::string(status.message()),
                AllOf(HasSubstr("observation 17"), HasSubstr(c.message)))
        << c.what;
    ExpectSameState(model.state(), before);
    model.set_state(before);  // keep later cases independent even if one was folded in
  }
  // The model still learns from the step once it is valid.
  ASSERT_TRUE(model.ObserveStep(good).ok());
  EXPECT_EQ(model.state().steps_observed, before.steps_observed + 1);
}

TEST(LatencyModelTest, EmptyStepIsAcceptedAndChangesNothing) {
  LatencyModel model(ModelShape(), kRanks, kPrior);
  const LatencyModelState before = model.state();
  EXPECT_TRUE(model.ObserveStep({}).ok());
  ExpectSameState(model.state(), before);
}

TEST(LatencyModelTest, ObservationOrderWithinAStepDoesNotMatter) {
  const std::vector<double> speed = TrueSpeeds();
  for (uint64_t seed = 0; seed < 10; ++seed) {
    LatencyModel ordered(ModelShape(), kRanks, kPrior);
    LatencyModel shuffled(ModelShape(), kRanks, kPrior);
    Rng data(100 + seed);
    Rng order(200 + seed);
    for (int step = 0; step < 6; ++step) {
      std::vector<Observation> observations = MeasuredStep(ordered, speed, data);
      // Not every rank reports every step.
      if (step % 2 == 1) observations.resize(observations.size() - 3 * kMicroBatches);
      std::vector<Observation> permuted = observations;
      Shuffle(&permuted, order);
      ASSERT_TRUE(ordered.ObserveStep(observations).ok());
      ASSERT_TRUE(shuffled.ObserveStep(permuted).ok());
      ExpectSameState(shuffled.state(), ordered.state());
    }
  }
}

TEST(LatencyModelTest, OrderDoesNotMatterEvenWithRepeatedMicroBatchKeys) {
  // Two entries with the same (rank, micro_batch), e.g. a worker that reports per document or
  // leaves micro_batch at 0: replicas that receive them in another order must still agree
  // (or the step must be refused on all of them).
  const std::vector<double> speed = TrueSpeeds();
  Rng data(8);
  LatencyModel probe(ModelShape(), kRanks, kPrior);
  std::vector<Observation> step = MeasuredStep(probe, speed, data);
  for (Observation& o : step) o.micro_batch = 0;
  std::vector<Observation> reversed(step.rbegin(), step.rend());
  LatencyModel a(ModelShape(), kRanks, kPrior);
  LatencyModel b(ModelShape(), kRanks, kPrior);
  const absl::Status sa = a.ObserveStep(step);
  const absl::Status sb = b.ObserveStep(reversed);
  EXPECT_EQ(sa.code(), sb.code());
  ExpectSameState(a.state(), b.state());
}

TEST(LatencyModelTest, SpeedFactorsStayWithinTheirBounds) {
  for (const LatencyModelOptions& options :
       {LatencyModelOptions{}, LatencyModelOptions{0.9, 0.5, 0.5, 2.0}}) {
    LatencyModel model(ModelShape(), kRanks, kPrior, options);
    // One rank 10x slower, one 20x faster, one 3x slower than the rest.
    std::vector<double> speed(kRanks, 1.0);
    speed[0] = 10.0;
    speed[1] = 0.05;
    speed[2] = 3.0;
    Rng rng(6);
    for (int step = 0; step < 40; ++step) {
      ASSERT_TRUE(model.ObserveStep(MeasuredStep(model, speed, rng)).ok());
      for (int r = 0; r < kRanks; ++r) {
        ASSERT_GE(model.speed_factor(r), options.speed_min) << "step " << step << " rank " << r;
        ASSERT_LE(model.speed_factor(r), options.speed_max) << "step " << step << " rank " << r;
      }
    }
    // 10x slow: pinned at the bound (up to the median normalisation of the other ranks).
    EXPECT_NEAR(model.speed_factor(0), options.speed_max, 0.01 * options.speed_max);
    EXPECT_LT(model.speed_factor(1), 1.0);
  }
}

TEST(LatencyModelTest, PrePackedSampleCostsTheSumOfItsDocuments) {
  Rng rng(7);
  for (int block : {64, 128}) {
    for (int local = 0; local <= 3; ++local) {
      ModelShape shape;
      shape.block_size = block;
      shape.local_blocks = local;
      const LatencyModel model(shape, 1, kPrior);
      for (int c = 0; c < 50; ++c) {
        Sample packed;
        packed.length = 0;
        const int docs = 1 + static_cast<int>(rng.NextU64() % 8);
        for (int d = 0; d < docs; ++d) {
          const int64_t length = 1 + static_cast<int64_t>(rng.NextU64() % 20000);
          packed.segments.push_back(length);
          packed.length += length;
        }
        const double density = 0.01 + 0.99 * rng.Uniform();
        const MicroBatchFeatures f = model.SampleFeatures(packed, density);
        double blocks = 0.0;
        double seconds = 0.0;
        for (int64_t length : packed.segments) {
          Sample doc;
          doc.length = length;
          blocks += model.SampleFeatures(doc, density).active_blocks;
          seconds += model.SampleSeconds(doc, density);
        }
        ASSERT_EQ(f.active_blocks, blocks);
        ASSERT_EQ(f.tokens, static_cast<double>(packed.length));
        ASSERT_EQ(f.documents, static_cast<double>(docs));
        ASSERT_NEAR(model.SampleSeconds(packed, density), seconds, 1e-12 * seconds);
        // Attention never crosses documents: never more blocks than one long document.
        Sample whole;
        whole.length = packed.length;
        ASSERT_LE(f.active_blocks, model.SampleFeatures(whole, density).active_blocks);
      }
    }
  }
}

TEST(LatencyModelTest, SampleFeaturesUseTheBlockCount) {
  const LatencyModel model(ModelShape(), 1, kPrior);
  Sample s;
  s.length = 32768;
  const MicroBatchFeatures f = model.SampleFeatures(s, 0.3);
  EXPECT_EQ(f.active_blocks, static_cast<double>(ActiveBlocks(32768, 0.3, 64, 1)));
  EXPECT_EQ(f.tokens, 32768.0);
  EXPECT_EQ(f.documents, 1.0);
  // SampleSeconds excludes the micro-batch term; Seconds of the sample alone includes it.
  EXPECT_NEAR(model.Seconds(f) - model.SampleSeconds(s, 0.3), kPrior.per_micro_batch, 1e-12);
}

// PlannedSampleFeatures' definition with a density per layer: the mean over the layers of the
// sample's features at each (the shard's rows only for a shard), added as doubles layer by
// layer. Its faster count must give the same bits.
MicroBatchFeatures MeanOverLayers(const LatencyModel& model, const ModelShape& shape,
                                  const PlannedSample& p) {
  MicroBatchFeatures f;
  if (p.sharded()) {
    f.tokens = static_cast<double>(p.QueryTokens());
    f.documents = 1.0;
    f.exchange_bytes = ShardExchangeBytes(shape, p.shard_begin);
    for (double d : p.layer_densities) {
      f.active_blocks += static_cast<double>(
          ActiveBlocksInRows(QueryBlocks(p.shard_begin, shape.block_size),
                             QueryBlocks(p.shard_end, shape.block_size), d, shape.local_blocks));
    }
  } else {
    Sample s;
    s.length = p.length;
    s.segments = p.segments;
    f = model.SampleFeatures(s, p.layer_densities[0]);
    for (size_t l = 1; l < p.layer_densities.size(); ++l) {
      f.active_blocks += model.SampleFeatures(s, p.layer_densities[l]).active_blocks;
    }
  }
  f.active_blocks /= static_cast<double>(p.layer_densities.size());
  return f;
}

uint64_t Bits(double x) {
  uint64_t bits = 0;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

TEST(LatencyModelTest, PerLayerDensitiesCostTheMeanOfTheLayersFeaturesBitForBit) {
  Rng rng(31);
  for (int block : {1, 64, 128}) {
    for (int local : {0, 1, 3}) {
      ModelShape shape;
      shape.block_size = block;
      shape.local_blocks = local;
      const LatencyModel model(shape, 2, kPrior);
      for (int c = 0; c < 300; ++c) {
        PlannedSample p;
        p.id = static_cast<uint64_t>(c);
        p.density = 0.05 + 0.9 * rng.Uniform();
        // Documents of one block to ~2^27 tokens (at block size 1 the largest pass 2^53 blocks
        // over 32 layers: the doubles are added as the definition adds them).
        auto length = [&] {
          const double most = block == 1 ? 1.5e8 : 4e5;
          return 1 + static_cast<int64_t>(std::exp(rng.Uniform() * std::log(most)));
        };
        switch (c % 3) {
          case 0:
            p.length = length();
            break;
          case 1:  // packed
            for (int d = 1 + static_cast<int>(rng.NextU64() % 6); d > 0; --d) {
              p.segments.push_back(length());
              p.length += p.segments.back();
            }
            break;
          default:  // a shard of a document
            p.length = length() + 2 * block;
            p.shard_begin = block * static_cast<int64_t>(rng.NextU64() % (p.length / block));
            p.shard_end = p.shard_begin + 1 +
                          static_cast<int64_t>(rng.NextU64() % (p.length - p.shard_begin));
            p.shard_index = 1;
            p.shard_group = {0, 1};
            break;
        }
        const int layers = c % 10 == 0 ? 1 + static_cast<int>(rng.NextU64() % 64) : 32;
        for (int l = 0; l < layers; ++l) {
          p.layer_densities.push_back(
              std::clamp(p.density * (0.4 + 1.2 * rng.Uniform()), 1e-4, 1.0));
        }
        const MicroBatchFeatures want = MeanOverLayers(model, shape, p);
        const MicroBatchFeatures got = model.PlannedSampleFeatures(p);
        ASSERT_EQ(Bits(got.active_blocks), Bits(want.active_blocks))
            << "block=" << block << " local=" << local << " case " << c << ": " << got.active_blocks
            << " != " << want.active_blocks;
        ASSERT_EQ(got, want) << "block=" << block << " local=" << local << " case " << c;
      }
    }
  }
}

}  // namespace
}  // namespace sparsebalance
