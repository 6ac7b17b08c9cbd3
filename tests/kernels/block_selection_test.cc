// Block selection: anchors always kept, k_i blocks per row (the planner's count), rows sorted,
// the transpose exact, recall 1 at density 1 and never above 1; bad input named.
#include "kernels/block_selection.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "contract/block_geometry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference.h"

namespace sparsebalance {
namespace kernels {
namespace {

using ::testing::HasSubstr;

TEST(BlockSelectionTest, RowsKeepAnchorsAndExactlyThePlannersCount) {
  const testing::Problem b = testing::MakeProblem({1000, 1, 333, 2048, 129}, 2, 64, 11);
  const std::vector<double> densities = {0.1, 0.5, 0.3, 0.05, 1.0};
  for (int block_size : {64, 128}) {
    for (int local_blocks : {0, 1, 3}) {
      SelectionOptions options;
      options.block_size = block_size;
      options.local_blocks = local_blocks;
      absl::StatusOr<Selection> sel =
          SelectBlocks(b.cu, b.heads, b.head_dim, b.q, b.k, densities, options);
      ASSERT_TRUE(sel.ok()) << sel.status();
      const BlockIndex& index = sel->index;
      ASSERT_TRUE(ValidateBlockIndex(index).ok());  // sorted, causal, flags, exact transpose
      ASSERT_EQ(sel->estimated_recall.size(), static_cast<size_t>(index.rows()));
      int64_t active = 0;
      for (int s = 0; s < index.sequences(); ++s) {
        const int64_t q = QuantizeDensity(densities[s]);
        for (int h = 0; h < b.heads; ++h) {
          for (int32_t i = 0; i < index.blocks(s); ++i) {
            const int64_t r = index.RowId(s, h, i);
            std::vector<int32_t> row(index.col_idx.begin() + index.row_ptr[r],
                                     index.col_idx.begin() + index.row_ptr[r + 1]);
            EXPECT_EQ(static_cast<int64_t>(row.size()), KeptBlocks(i, q, local_blocks));
            EXPECT_EQ(row.front(), 0);  // sink
            for (int32_t j = std::max(0, i - local_blocks); j <= i; ++j) {
              EXPECT_TRUE(std::binary_search(row.begin(), row.end(), j)) << "anchor " << j;
            }
            EXPECT_GT(sel->estimated_recall[r], 0.0f);
            EXPECT_LE(sel->estimated_recall[r], 1.0f);
            if (densities[s] == 1.0) {
              EXPECT_EQ(sel->estimated_recall[r], 1.0f);
            }
          }
        }
        active +=
            sparsebalance::ActiveBlocks(index.length(s), densities[s], block_size, local_blocks) *
            b.heads;
      }
      EXPECT_EQ(index.active_blocks(), active);  // what the planner's latency model counts
    }
  }
}

TEST(BlockSelectionTest, TheBestScoringBlocksAreKept) {
  // One head; key block 5 is made to match every query strongly: every row past the anchors
  // that may keep one more block keeps it.
  const int head_dim = 64;
  const int32_t length = 64 * 12;
  std::vector<float> q(static_cast<size_t>(length) * head_dim, 0.0f);
  std::vector<float> k = testing::RandomTensor(q.size(), 4, 0.01f);
  for (int32_t t = 0; t < length; ++t) q[static_cast<size_t>(t) * head_dim] = 1.0f;
  for (int32_t t = 5 * 64; t < 6 * 64; ++t) k[static_cast<size_t>(t) * head_dim] = 10.0f;
  SelectionOptions options;
  options.local_blocks = 0;
  absl::StatusOr<Selection> sel = SelectBlocks({0, length}, 1, head_dim, q, k, {0.25}, options);
  ASSERT_TRUE(sel.ok()) << sel.status();
  for (int32_t i = 8; i < 12; ++i) {  // k_i = 3: the anchors and one more
    const int64_t r = sel->index.RowId(0, 0, i);
    std::vector<int32_t> row(sel->index.col_idx.begin() + sel->index.row_ptr[r],
                             sel->index.col_idx.begin() + sel->index.row_ptr[r + 1]);
    EXPECT_TRUE(std::binary_search(row.begin(), row.end(), 5)) << "row " << i;
  }
}

TEST(BlockSelectionTest, ExactRecallIsOneAtFullDensityAndAtMostOneOtherwise) {
  const testing::Problem b = testing::MakeProblem({300, 129, 64}, 2, 64, 21);
  for (double density : {1.0, 0.4, 0.1}) {
    absl::StatusOr<Selection> sel = SelectBlocks(b.cu, b.heads, b.head_dim, b.q, b.k,
                                                 {density, density, density}, SelectionOptions{});
    ASSERT_TRUE(sel.ok());
    absl::StatusOr<std::vector<float>> recall = ExactRecall(sel->index, b.head_dim, b.q, b.k);
    ASSERT_TRUE(recall.ok()) << recall.status();
    ASSERT_EQ(recall->size(), sel->estimated_recall.size());
    double mean = 0.0;
    for (float r : *recall) {
      EXPECT_LE(r, 1.0f);
      EXPECT_GT(r, 0.0f);
      if (density == 1.0) {
        EXPECT_NEAR(r, 1.0f, 1e-6);
      }
      mean += r;
    }
    mean /= recall->size();
    if (density < 1.0) {
      EXPECT_LT(mean, 1.0);
    }
  }
}

TEST(BlockSelectionTest, AMassThresholdKeepsFewerBlocksAndReachesItsEstimate) {
  const testing::Problem b = testing::MakeProblem({2048}, 1, 128, 31);
  SelectionOptions capped;
  absl::StatusOr<Selection> full = SelectBlocks(b.cu, 1, 128, b.q, b.k, {0.5}, capped);
  SelectionOptions thresholded = capped;
  thresholded.mass_threshold = 0.3;
  absl::StatusOr<Selection> early = SelectBlocks(b.cu, 1, 128, b.q, b.k, {0.5}, thresholded);
  ASSERT_TRUE(full.ok() && early.ok());
  EXPECT_LT(early->index.active_blocks(), full->index.active_blocks());
  for (int64_t r = 0; r < early->index.rows(); ++r) {
    const int64_t kept = early->index.row_ptr[r + 1] - early->index.row_ptr[r];
    const int64_t cap = full->index.row_ptr[r + 1] - full->index.row_ptr[r];
    EXPECT_LE(kept, cap);
    // Stopped early only once the estimate reached the threshold.
    if (kept < cap) {
      EXPECT_GE(early->estimated_recall[r], 0.3f - 1e-6f);
    }
  }
}

// The kept blocks of CSR row r.
std::vector<int32_t> RowOf(const BlockIndex& index, int64_t r) {
  return std::vector<int32_t>(index.col_idx.begin() + index.row_ptr[r],
                              index.col_idx.begin() + index.row_ptr[r + 1]);
}

SelectionOptions AnchorOptions(double tau, int local_blocks = 1) {
  SelectionOptions options;
  options.mode = SelectionMode::kAnchor;
  options.anchor_threshold = tau;
  options.local_blocks = local_blocks;
  return options;
}

TEST(AnchorSelectionTest, KeepsTheAnchorsAndAPrefixOfTopKWithinTheBudget) {
  // Structured scores: shared directions in q and k give rows real high- and low-scoring blocks.
  testing::Problem b = testing::MakeProblem({3000, 700, 4096}, 2, 64, 51);
  for (size_t e = 0; e < b.q.size(); e += 64) {
    b.q[e] += 2.0f;
    b.k[e] += static_cast<float>((e / 64 / 2 / 97) % 5) - 2.0f;  // varies by block of keys
  }
  const std::vector<double> densities = {0.1, 0.3, 0.5};
  for (int local_blocks : {0, 1, 2}) {
    SelectionOptions topk_options;
    topk_options.local_blocks = local_blocks;
    absl::StatusOr<Selection> topk =
        SelectBlocks(b.cu, b.heads, b.head_dim, b.q, b.k, densities, topk_options);
    ASSERT_TRUE(topk.ok()) << topk.status();
    int64_t previous_active = 0;
    for (double tau : {1.0, 0.5, 0.05, 0.001}) {  // lower tau: never fewer blocks
      absl::StatusOr<Selection> anchor = SelectBlocks(b.cu, b.heads, b.head_dim, b.q, b.k,
                                                      densities, AnchorOptions(tau, local_blocks));
      ASSERT_TRUE(anchor.ok()) << anchor.status();
      const BlockIndex& index = anchor->index;
      ASSERT_TRUE(ValidateBlockIndex(index).ok());  // sorted, causal, flags, exact transpose
      ASSERT_EQ(index.rows(), topk->index.rows());
      for (int s = 0; s < index.sequences(); ++s) {
        const int64_t q = QuantizeDensity(densities[s]);
        for (int h = 0; h < b.heads; ++h) {
          for (int32_t i = 0; i < index.blocks(s); ++i) {
            const int64_t r = index.RowId(s, h, i);
            const std::vector<int32_t> row = RowOf(index, r);
            const std::vector<int32_t> capped = RowOf(topk->index, r);
            EXPECT_LE(static_cast<int64_t>(row.size()), KeptBlocks(i, q, local_blocks));
            EXPECT_EQ(row.front(), 0);  // sink
            for (int32_t j = std::max(0, i - local_blocks); j <= i; ++j) {
              EXPECT_TRUE(std::binary_search(row.begin(), row.end(), j)) << "anchor " << j;
            }
            // The same order as top-k, stopped earlier: a subset of top-k's row.
            EXPECT_TRUE(std::includes(capped.begin(), capped.end(), row.begin(), row.end()))
                << "row " << r << " tau " << tau;
            EXPECT_LE(anchor->estimated_recall[r], topk->estimated_recall[r] + 1e-6f);
          }
        }
      }
      EXPECT_GE(index.active_blocks(), previous_active) << "tau " << tau;
      previous_active = index.active_blocks();
    }
    // The thresholds bind on these inputs: tau = 1 keeps fewer blocks than top-k.
    absl::StatusOr<Selection> strict = SelectBlocks(b.cu, b.heads, b.head_dim, b.q, b.k, densities,
                                                    AnchorOptions(1.0, local_blocks));
    ASSERT_TRUE(strict.ok());
    EXPECT_LT(strict->index.active_blocks(), topk->index.active_blocks());
  }
}

TEST(AnchorSelectionTest, AVanishingThresholdIsTopKExactly) {
  const testing::Problem b = testing::MakeProblem({1000, 1, 333, 2048, 129}, 2, 64, 61);
  const std::vector<double> densities = {0.1, 0.5, 0.3, 0.05, 1.0};
  for (int local_blocks : {0, 1, 3}) {
    SelectionOptions topk_options;
    topk_options.local_blocks = local_blocks;
    absl::StatusOr<Selection> topk =
        SelectBlocks(b.cu, b.heads, b.head_dim, b.q, b.k, densities, topk_options);
    absl::StatusOr<Selection> anchor = SelectBlocks(b.cu, b.heads, b.head_dim, b.q, b.k, densities,
                                                    AnchorOptions(1e-30, local_blocks));
    ASSERT_TRUE(topk.ok() && anchor.ok());
    EXPECT_EQ(anchor->index.row_ptr, topk->index.row_ptr);
    EXPECT_EQ(anchor->index.col_idx, topk->index.col_idx);
    EXPECT_EQ(anchor->index.col_ptr, topk->index.col_ptr);
    EXPECT_EQ(anchor->index.row_idx, topk->index.row_idx);
    EXPECT_EQ(anchor->estimated_recall, topk->estimated_recall);
  }
}

TEST(AnchorSelectionTest, ThresholdOneKeepsOnlyBlocksScoringAtLeastTheBestAnchor) {
  // Query block 9, local_blocks 1: anchors 0, 8, 9 (best anchor score 2.0 at block 8).
  const std::vector<float> scores = {1.0f, 3.0f, 2.0f, -1.0f, 2.5f, 1.9f, 0.0f, 4.0f, 2.0f, 0.5f};
  std::vector<double> pairs(10, 64.0 * 64.0);
  pairs[9] = 64.0 * 65.0 / 2;
  float estimate = 0.0f;
  // tau = 1: blocks 7 (4.0), 1 (3.0), 4 (2.5) and 2 (2.0, a tie with the anchor) clear it.
  EXPECT_EQ(SelectRow(9, 1, /*kept_cap=*/10 - 1, 1.0, scores, pairs, &estimate,
                      SelectionMode::kAnchor, 1.0),
            (std::vector<int32_t>{0, 1, 2, 4, 7, 8, 9}));
  // The cap still binds: two blocks beyond the three anchors, the best two.
  EXPECT_EQ(SelectRow(9, 1, 5, 1.0, scores, pairs, &estimate, SelectionMode::kAnchor, 1.0),
            (std::vector<int32_t>{0, 1, 7, 8, 9}));
  // tau = e^-1.5: the floor is 0.5, so block 5 (1.9) joins, blocks 6 (0.0) and 3 (-1.0) do not.
  EXPECT_EQ(
      SelectRow(9, 1, 9, 1.0, scores, pairs, &estimate, SelectionMode::kAnchor, std::exp(-1.5)),
      (std::vector<int32_t>{0, 1, 2, 4, 5, 7, 8, 9}));
  // A best anchor above every other block keeps the anchors only; top-k keeps the cap.
  std::vector<float> sink_heavy = scores;
  sink_heavy[0] = 9.0f;
  EXPECT_EQ(SelectRow(9, 1, 6, 1.0, sink_heavy, pairs, &estimate, SelectionMode::kAnchor, 0.5),
            (std::vector<int32_t>{0, 8, 9}));
  EXPECT_EQ(SelectRow(9, 1, 6, 1.0, sink_heavy, pairs, &estimate).size(), 6u);
  // A budget of every causal block keeps every block in either mode (a dense row).
  EXPECT_EQ(
      SelectRow(9, 1, 10, 1.0, sink_heavy, pairs, &estimate, SelectionMode::kAnchor, 1.0).size(),
      10u);
  EXPECT_EQ(estimate, 1.0f);
}

TEST(AnchorSelectionTest, DeterministicAcrossRunsAndThreadCounts) {
  const testing::Problem b = testing::MakeProblem({2000, 513, 64}, 3, 64, 71);
  SelectionOptions one = AnchorOptions(0.2);
  one.threads = 1;
  SelectionOptions four = one;
  four.threads = 4;
  absl::StatusOr<Selection> a =
      SelectBlocks(b.cu, b.heads, b.head_dim, b.q, b.k, {0.2, 0.4, 0.1}, one);
  absl::StatusOr<Selection> c =
      SelectBlocks(b.cu, b.heads, b.head_dim, b.q, b.k, {0.2, 0.4, 0.1}, four);
  absl::StatusOr<Selection> d =
      SelectBlocks(b.cu, b.heads, b.head_dim, b.q, b.k, {0.2, 0.4, 0.1}, four);
  ASSERT_TRUE(a.ok() && c.ok() && d.ok());
  EXPECT_EQ(a->index.col_idx, c->index.col_idx);
  EXPECT_EQ(a->index.row_ptr, c->index.row_ptr);
  EXPECT_EQ(c->index.col_idx, d->index.col_idx);
  EXPECT_EQ(a->estimated_recall, c->estimated_recall);
}

TEST(BlockSelectionTest, BadInputIsAnErrorNamingTheField) {
  const testing::Problem b = testing::MakeProblem({100, 50}, 2, 64, 41);
  SelectionOptions ok;
  struct Case {
    std::vector<int32_t> cu;
    int head_dim;
    std::vector<double> densities;
    SelectionOptions options;
    size_t q_size;
    const char* message;
  };
  SelectionOptions block32 = ok;
  block32.block_size = 32;
  SelectionOptions threshold = ok;
  threshold.mass_threshold = 0.0;
  SelectionOptions local = ok;
  local.local_blocks = -1;
  SelectionOptions tau0 = ok;
  tau0.anchor_threshold = 0.0;
  SelectionOptions tau_big = ok;
  tau_big.anchor_threshold = 1.5;
  SelectionOptions negative_threads = ok;
  negative_threads.threads = -2;
  for (const Case& c : std::vector<Case>{
           {b.cu, 64, {0.5, 1.5}, ok, b.q.size(), "densities[1]=1.5 is outside (0, 1]"},
           {b.cu, 64, {0.0, 0.5}, ok, b.q.size(), "densities[0]=0 is outside (0, 1]"},
           {b.cu, 64, {0.5}, ok, b.q.size(), "densities has 1 entries"},
           {{0, 100, 90}, 64, {0.5, 0.5}, ok, b.q.size(), "cu_seqlens[2]=90"},
           {b.cu, 96, {0.5, 0.5}, ok, b.q.size(), "head_dim=96 is not supported"},
           {b.cu, 64, {0.5, 0.5}, block32, b.q.size(), "block_size=32 is not supported"},
           {b.cu, 64, {0.5, 0.5}, threshold, b.q.size(), "mass_threshold=0"},
           {b.cu, 64, {0.5, 0.5}, local, b.q.size(), "local_blocks=-1"},
           {b.cu, 64, {0.5, 0.5}, tau0, b.q.size(), "anchor_threshold=0 is outside (0, 1]"},
           {b.cu, 64, {0.5, 0.5}, tau_big, b.q.size(), "anchor_threshold=1.5 is outside"},
           {b.cu, 64, {0.5, 0.5}, negative_threads, b.q.size(), "threads=-2 must be non-negative"},
           {b.cu, 64, {0.5, 0.5}, ok, b.q.size() - 1, "q has 19199 elements; expected 19200"},
       }) {
    std::vector<float> q(c.q_size, 0.0f);
    absl::StatusOr<Selection> sel =
        SelectBlocks(c.cu, 2, c.head_dim, q, b.k, c.densities, c.options);
    EXPECT_EQ(sel.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(sel.status().message(), HasSubstr(c.message));
  }
}

// A NaN or an infinity in q or k made the row's block masses NaN: the scores were sorted with a
// comparison that is no order (undefined behaviour in std::sort) and the estimate read 1.0, a
// perfect recall, which the worker reported to the planner. Now the first such row is named.
TEST(BlockSelectionTest, ANanOrInfinityInQOrKIsAnErrorNamingItsRow) {
  for (const float bad : {std::nanf(""), INFINITY}) {
    for (const bool in_q : {true, false}) {
      SCOPED_TRACE(::testing::Message() << bad << (in_q ? " in q" : " in k"));
      testing::Problem b = testing::MakeProblem({100, 1000}, 2, 64, 43);
      // Sequence 1, token 600 (its query block 9), head 1.
      const size_t at = (static_cast<size_t>(100 + 600) * b.heads + 1) * b.head_dim + 5;
      (in_q ? b.q : b.k)[at] = bad;
      const std::vector<double> densities = {0.5, 0.1};
      absl::StatusOr<Selection> sel =
          SelectBlocks(b.cu, b.heads, b.head_dim, b.q, b.k, densities, SelectionOptions{});
      EXPECT_EQ(sel.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(sel.status().message(),
                  HasSubstr("block scores of sequence 1, head 1, query block 9 are NaN"));
    }
  }
  // -infinity is an order like any other score: a block nothing attends to, kept last.
  testing::Problem b = testing::MakeProblem({1000}, 1, 64, 44);
  const std::vector<double> densities = {0.1};
  ASSERT_TRUE(SelectBlocks(b.cu, 1, 64, b.q, b.k, densities, SelectionOptions{}).ok());
  std::vector<float> scores = {1.0f, -INFINITY, 3.0f, 0.5f, 2.0f};
  std::vector<double> pairs(scores.size(), 1.0);
  float recall = 0.0f;
  const std::vector<int32_t> kept = SelectRow(4, 0, 3, 1.0, scores, pairs, &recall);
  EXPECT_EQ(kept, (std::vector<int32_t>{0, 2, 4}));
  EXPECT_GT(recall, 0.0f);
  EXPECT_LT(recall, 1.0f);
}

}  // namespace
}  // namespace kernels
}  // namespace sparsebalance
