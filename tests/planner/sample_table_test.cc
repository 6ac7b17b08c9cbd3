#include "planner/sample_table.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "contract/block_geometry.h"
#include "gtest/gtest.h"
#include "planner/latency_model.h"
#include "planner/plan_threads.h"
#include "planner/recall_model.h"
#include "planner/types.h"
#include "tests/planner/random_cases.h"

namespace sparsebalance {
namespace {

// The table's documents of sample i (`sample`) are its own (or its segments), with their query
// blocks and length buckets, and follow those of sample i - 1.
void ExpectDocuments(const SampleTable& table, size_t i, const Sample& sample,
                     const PlannerConfig& config) {
  const std::vector<int64_t> documents =
      sample.segments.empty() ? std::vector<int64_t>{sample.length} : sample.segments;
  const SampleTerms& t = table[i];
  EXPECT_EQ(t.doc_begin, i == 0 ? 0 : table[i - 1].doc_end);
  ASSERT_EQ(t.doc_end - t.doc_begin, static_cast<int>(documents.size()));
  for (size_t j = 0; j < documents.size(); ++j) {
    const int d = t.doc_begin + static_cast<int>(j);
    EXPECT_EQ(table.doc_rows()[d], QueryBlocks(documents[j], config.shape.block_size));
    EXPECT_EQ(table.doc_tokens()[d], documents[j]);
    EXPECT_EQ(table.doc_buckets()[d], RecallBucket(documents[j], config.micro_batch_capacity));
  }
}

// Every sample's terms (and documents) are what their definitions give, bit for bit: the table
// computes some of
// them by shortcuts (logarithms kept while floors and bases repeat, the recall at base from the
// base's logarithm), which must not change a plan. Densities up to 1 (where the shortcut does
// not apply), a document recall floor, pre-packed samples, prior and learned exponents, and the
// table built on one thread and on two.
TEST(SampleTableTest, TermsAreTheirDefinitionsBitForBit) {
  PlanThreads two(2);
  int cases = 0;
  for (double density_default : {0.3, 0.999999999, 1.0}) {
    for (double recall_floor : {0.0, 0.6}) {
      for (bool learned : {false, true}) {
        PlannerConfig config = test_util::StepConfig(64, 2, 16384);
        config.density_default = density_default;
        config.document_recall_floor = recall_floor;
        std::vector<Sample> batch = test_util::TraceBatch(config, 11 + cases, 0.9);
        ASSERT_GT(batch.size(), 100u);
        for (size_t i = 0; i < batch.size(); ++i) {
          Sample& s = batch[i];
          s.sensitivity = static_cast<double>((i * 37) % 101) / 100.0;
          if (i % 7 == 3 && s.length >= 2) s.segments = {s.length / 2, s.length - s.length / 2};
        }
        const LatencyModel model = test_util::MakeModel(config);
        const RecallModel recall =
            learned ? test_util::LearnedRecall(config)
                    : RecallModel(config.micro_batch_capacity, config.shape.layers);
        const SampleTable alone(batch, config, model, recall);
        const SampleTable split(batch, config, model, recall, &two);
        ASSERT_EQ(alone.size(), batch.size());
        for (size_t i = 0; i < batch.size(); ++i) {
          SCOPED_TRACE(absl::StrCat("case ", cases, ", samples[", i, "]"));
          const Sample& s = batch[i];
          const SampleTerms& t = alone[i];
          const double g = recall.SampleExponent(s);
          double floor = DensityFloor(s.sensitivity, config);
          double base = BaseDensity(s.sensitivity, config);
          if (recall_floor > 0) {
            const double keep = std::min(config.density_max, DensityForRecall(g, recall_floor));
            floor = std::max(floor, keep);
            base = std::max(base, keep);
          }
          EXPECT_EQ(t.exponent, g);
          EXPECT_EQ(t.floor, floor);
          EXPECT_EQ(t.base, base);
          EXPECT_EQ(t.log_floor, LogOneMinus(floor));
          EXPECT_EQ(t.log_base, LogOneMinus(base));
          EXPECT_EQ(t.base_recall, RecallAt(g, base));
          EXPECT_TRUE(std::isfinite(t.price_offset));
          EXPECT_EQ(alone.Recall(i, base), RecallAt(g, base));
          EXPECT_EQ(alone.Recall(i, 0.5 * base), RecallAt(g, 0.5 * base));
          const SampleTerms& u = split[i];
          EXPECT_EQ(u.exponent, t.exponent);
          EXPECT_EQ(u.base_recall, t.base_recall);
          EXPECT_EQ(u.log_floor, t.log_floor);
          EXPECT_EQ(u.log_base, t.log_base);
          EXPECT_EQ(u.price_offset, t.price_offset);
          ExpectDocuments(alone, i, s, config);
          ExpectDocuments(split, i, s, config);
        }
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 12);
}

// A table reuses the arrays of the thread's table before it (kept between steps): it must keep
// none of that table's terms or answers. The first table, on a larger batch, is asked every
// sample's recall and blocks at one density; the next, on other lengths and sensitivities, is
// asked at the same density, alone and while another table holds the thread's arrays.
TEST(SampleTableTest, ATableKeepsNothingOfTheTablesBeforeIt) {
  PlannerConfig config = test_util::StepConfig(64, 2, 16384);
  const LatencyModel model = test_util::MakeModel(config);
  const RecallModel recall(config.micro_batch_capacity, config.shape.layers);
  std::vector<Sample> first = test_util::TraceBatch(config, 5, 0.9);
  std::vector<Sample> second = test_util::TraceBatch(config, 6, 0.6);
  ASSERT_GT(first.size(), second.size());
  for (size_t i = 0; i < second.size(); ++i) {
    second[i].sensitivity = static_cast<double>((i * 13) % 97) / 100.0;
    second[i].length = std::max<int64_t>(1, second[i].length / 3 + 5);
  }
  constexpr double kAsked = 0.25;
  auto ask_all = [&](const SampleTable& table, const std::vector<Sample>& batch) {
    for (size_t i = 0; i < batch.size(); ++i) {
      table.Recall(i, kAsked);
      table.FeaturesAt(batch[i], i, kAsked);
    }
  };
  auto expect_fresh = [&](const SampleTable& table, const std::vector<Sample>& batch) {
    ASSERT_EQ(table.size(), batch.size());
    for (size_t i = 0; i < batch.size(); ++i) {
      SCOPED_TRACE(absl::StrCat("samples[", i, "]"));
      const double g = recall.SampleExponent(batch[i]);
      EXPECT_EQ(table[i].exponent, g);
      EXPECT_EQ(table.Recall(i, kAsked), RecallAt(g, kAsked));
      const MicroBatchFeatures got = table.FeaturesAt(batch[i], i, kAsked);
      const MicroBatchFeatures want = model.SampleFeatures(batch[i], kAsked);
      EXPECT_EQ(got.active_blocks, want.active_blocks);
      EXPECT_EQ(got.tokens, want.tokens);
      ExpectDocuments(table, i, batch[i], config);
    }
  };
  {
    const SampleTable before(first, config, model, recall);
    ask_all(before, first);
  }
  {
    const SampleTable after(second, config, model, recall);
    expect_fresh(after, second);
    ask_all(after, second);
    const SampleTable beside(first, config, model, recall);  // while `after` holds the arrays
    expect_fresh(beside, first);
  }
  const SampleTable again(first, config, model, recall);
  expect_fresh(again, first);
}

}  // namespace
}  // namespace sparsebalance
