// The recall probe: the kept softmax mass of sampled rows equals a brute-force reference
// (dense softmax, then the share inside the kept blocks), over all rows it equals ExactRecall;
// needles outside the kept blocks give ~0 while the block-score estimate does not see them;
// 1-token documents are 1; sampling is deterministic, keeps the last rows and the budget.
#include "kernels/recall_probe.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_selection.h"
#include "reference.h"

namespace sparsebalance {
namespace kernels {
namespace {

using ::testing::HasSubstr;

// Brute force: row t (document s, head h) softmax over its document's causal keys in double,
// the share of keys whose block the CSR row keeps.
double ReferenceRowRecall(const BlockIndex& index, int head_dim, const std::vector<float>& q,
                          const std::vector<float>& k, int s, int h, int32_t t) {
  const int heads = index.heads;
  const int64_t token0 = index.cu_seqlens[s];
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  std::vector<double> logits(t + 1);
  for (int32_t u = 0; u <= t; ++u) {
    double dot = 0.0;
    for (int d = 0; d < head_dim; ++d) {
      dot += static_cast<double>(q[((token0 + t) * heads + h) * head_dim + d]) *
             k[((token0 + u) * heads + h) * head_dim + d];
    }
    logits[u] = dot * scale;
  }
  const double m = *std::max_element(logits.begin(), logits.end());
  const int64_t r = index.RowId(s, h, t / index.block_size);
  std::vector<int32_t> kept(index.col_idx.begin() + index.row_ptr[r],
                            index.col_idx.begin() + index.row_ptr[r + 1]);
  double total = 0.0;
  double inside = 0.0;
  for (int32_t u = 0; u <= t; ++u) {
    const double p = std::exp(logits[u] - m);
    total += p;
    if (std::binary_search(kept.begin(), kept.end(), u / index.block_size)) inside += p;
  }
  return inside / total;
}

// Every row of every document.
RecallRows AllRows(const BlockIndex& index) {
  RecallRows rows;
  for (int s = 0; s < index.sequences(); ++s) {
    for (int32_t t = 0; t < index.length(s); ++t) rows.rows.push_back(t);
    rows.offsets.push_back(static_cast<int64_t>(rows.rows.size()));
  }
  return rows;
}

Selection Select(const testing::Problem& p, const std::vector<double>& densities,
                 int block_size = 64) {
  SelectionOptions options;
  options.block_size = block_size;
  absl::StatusOr<Selection> sel =
      SelectBlocks(p.cu, p.heads, p.head_dim, p.q, p.k, densities, options);
  EXPECT_TRUE(sel.ok()) << sel.status();
  return *std::move(sel);
}

TEST(RecallProbeTest, SampledRowsMatchTheBruteForceDefinition) {
  // Varlen packing, several heads, a 1-token document, a short last block.
  const testing::Problem p = testing::MakeProblem({700, 1, 260, 129}, 3, 64, 5);
  for (int block_size : {64, 128}) {
    const Selection sel = Select(p, {0.2, 0.5, 0.1, 0.4}, block_size);
    RecallRows rows;
    for (int s = 0; s < sel.index.sequences(); ++s) {
      const int32_t length = sel.index.length(s);
      for (int32_t t : {0, length / 3, length / 2 + 7, length - 2, length - 1}) {
        if (t >= 0 && t < length &&
            (rows.rows.size() == static_cast<size_t>(rows.offsets.back()) ||
             t > rows.rows.back())) {
          rows.rows.push_back(t);
        }
      }
      rows.offsets.push_back(static_cast<int64_t>(rows.rows.size()));
    }
    absl::StatusOr<RecallProbe> probe =
        ProbeRecall(sel.index, p.head_dim, p.q, p.k, rows, 0.0f, /*threads=*/2);
    ASSERT_TRUE(probe.ok()) << probe.status();
    ASSERT_EQ(probe->row_recall.size(), rows.rows.size());
    bool some_below_one = false;
    for (int s = 0; s < sel.index.sequences(); ++s) {
      double sum = 0.0;
      for (int64_t e = rows.offsets[s]; e < rows.offsets[s + 1]; ++e) {
        double want = 0.0;
        for (int h = 0; h < p.heads; ++h) {
          want += ReferenceRowRecall(sel.index, p.head_dim, p.q, p.k, s, h, rows.rows[e]);
        }
        want /= p.heads;
        EXPECT_NEAR(probe->row_recall[e], want, 1e-5) << "document " << s << " row " << e;
        sum += want;
        some_below_one |= want < 0.999;
      }
      EXPECT_NEAR(probe->document_recall[s], sum / rows.count(s), 1e-5) << "document " << s;
    }
    EXPECT_TRUE(some_below_one);                // the case is sparse enough to test something
    EXPECT_EQ(probe->document_recall[1], 1.0);  // a 1-token document keeps its only key
  }
}

TEST(RecallProbeTest, AllRowsAgreeWithExactRecall) {
  const testing::Problem p = testing::MakeProblem({400, 300}, 2, 64, 9);
  const Selection sel = Select(p, {0.3, 0.2});
  absl::StatusOr<RecallProbe> probe =
      ProbeRecall(sel.index, p.head_dim, p.q, p.k, AllRows(sel.index));
  ASSERT_TRUE(probe.ok()) << probe.status();
  absl::StatusOr<std::vector<float>> exact = ExactRecall(sel.index, p.head_dim, p.q, p.k);
  ASSERT_TRUE(exact.ok());
  for (int s = 0; s < sel.index.sequences(); ++s) {
    // ExactRecall is per CSR row (mean over its tokens); token-weight it over the document.
    double sum = 0.0;
    for (int h = 0; h < p.heads; ++h) {
      for (int32_t i = 0; i < sel.index.blocks(s); ++i) {
        const int32_t tokens = std::min(64, sel.index.length(s) - i * 64);
        sum += tokens * (*exact)[sel.index.RowId(s, h, i)];
      }
    }
    EXPECT_NEAR(probe->document_recall[s], sum / (p.heads * sel.index.length(s)), 1e-4);
  }
}

TEST(RecallProbeTest, ANeedleOutsideTheKeptBlocksGivesZeroWhileTheEstimateLooksFine) {
  // One document of 1024 tokens (16 blocks), one head: all queries and keys small noise; the
  // last query matches one key at token 300 (block 4) with a huge logit. At density 0.1 the
  // last row keeps the sink, the diagonal, its local block and one more: the pooled scores
  // (diluted by 64 tokens) do not single out block 4.
  const int head_dim = 64;
  const int32_t length = 1024;
  testing::Problem p = testing::MakeProblem({length}, 1, head_dim, 3);
  for (float& x : p.q) x *= 0.05f;
  for (float& x : p.k) x *= 0.05f;
  const int32_t needle = 300;
  const int32_t last = length - 1;
  for (int d = 0; d < head_dim; ++d) {
    p.q[int64_t{last} * head_dim + d] = (d % 2 == 0 ? 4.0f : -4.0f);
    p.k[int64_t{needle} * head_dim + d] = (d % 2 == 0 ? 4.0f : -4.0f);
  }
  const Selection sel = Select(p, {0.1});
  const int64_t r = sel.index.RowId(0, 0, last / 64);
  std::vector<int32_t> kept(sel.index.col_idx.begin() + sel.index.row_ptr[r],
                            sel.index.col_idx.begin() + sel.index.row_ptr[r + 1]);
  ASSERT_FALSE(std::binary_search(kept.begin(), kept.end(), needle / 64));
  RecallRows rows;
  rows.rows = {last};
  rows.offsets = {0, 1};
  absl::StatusOr<RecallProbe> probe = ProbeRecall(sel.index, head_dim, p.q, p.k, rows);
  ASSERT_TRUE(probe.ok()) << probe.status();
  EXPECT_LT(probe->document_recall[0], 1e-6);
  EXPECT_GT(sel.estimated_recall[r], 0.1f);  // what the worker reported before
}

TEST(RecallProbeTest, DenseDocumentsAndOneTokenDocumentsHaveRecallOne) {
  const testing::Problem p = testing::MakeProblem({1, 500, 1}, 2, 64, 4);
  const Selection sel = Select(p, {1.0, 1.0, 1.0});
  const std::vector<uint64_t> seeds = {1, 2, 3};
  const RecallRows rows = SampleRecallRows(sel.index, seeds, RecallSampling{});
  absl::StatusOr<RecallProbe> probe = ProbeRecall(sel.index, p.head_dim, p.q, p.k, rows);
  ASSERT_TRUE(probe.ok()) << probe.status();
  EXPECT_EQ(rows.count(0), 1);
  EXPECT_EQ(rows.count(1), 8);  // a dense row costs nothing: the budget never binds
  EXPECT_EQ(rows.count(2), 1);
  for (double recall : probe->document_recall) EXPECT_EQ(recall, 1.0);
}

TEST(RecallProbeTest, SamplingIsDeterministicKeepsTheLastRowsAndTheBudget) {
  const testing::Problem p = testing::MakeProblem({4096, 3000, 5, 200}, 2, 64, 8);
  const Selection sel = Select(p, {0.1, 0.2, 1.0, 0.5});
  RecallSampling sampling;
  sampling.rows = 8;
  sampling.last_rows = 2;
  const std::vector<uint64_t> seeds = {11, 12, 13, 14};
  const RecallRows a = SampleRecallRows(sel.index, seeds, sampling);
  const RecallRows b = SampleRecallRows(sel.index, seeds, sampling);
  EXPECT_EQ(a.rows, b.rows);
  EXPECT_EQ(a.offsets, b.offsets);
  ASSERT_TRUE(ValidateRecallRows(sel.index, a).ok());  // ascending, inside each document
  const std::vector<uint64_t> other_seeds = {21, 22, 23, 24};
  EXPECT_NE(SampleRecallRows(sel.index, other_seeds, sampling).rows, a.rows);
  for (int s = 0; s < sel.index.sequences(); ++s) {
    const int32_t length = sel.index.length(s);
    ASSERT_GE(a.count(s), std::min(2, length));
    EXPECT_LE(a.count(s), std::min(8, length));
    EXPECT_EQ(a.rows[a.offsets[s + 1] - 1], length - 1);
    if (length >= 2) {
      EXPECT_EQ(a.rows[a.offsets[s + 1] - 2], length - 2);
    }
  }
  EXPECT_EQ(a.count(0), 8);  // a long sparse document affords 8 rows at 5%
  // A tight budget: only the last rows stay, and whatever is kept beyond them fits.
  sampling.max_pair_share = 1e-4;
  const RecallRows tight = SampleRecallRows(sel.index, seeds, sampling);
  for (int s = 0; s < sel.index.sequences(); ++s) {
    double cost = 0.0;
    for (int64_t e = tight.offsets[s]; e < tight.offsets[s + 1] - std::min(2, sel.index.length(s));
         ++e) {
      cost += tight.rows[e] + 1;  // an upper bound of the row's cost
    }
    if (sel.index.length(s) > 200) {
      EXPECT_LE(cost, 1e-4 * KeptPairsPerHead(sel.index, s)) << "document " << s;
    }
  }
  EXPECT_EQ(tight.count(0), 2);
}

TEST(RecallProbeTest, BadInputIsNamed) {
  const testing::Problem p = testing::MakeProblem({100}, 1, 64, 2);
  const Selection sel = Select(p, {1.0});
  RecallRows rows;
  rows.rows = {5, 5};
  rows.offsets = {0, 2};
  absl::StatusOr<RecallProbe> probe = ProbeRecall(sel.index, p.head_dim, p.q, p.k, rows);
  EXPECT_EQ(probe.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(probe.status().message(), HasSubstr("rows[1]=5"));
  rows.rows = {100};
  rows.offsets = {0, 1};
  EXPECT_THAT(ProbeRecall(sel.index, p.head_dim, p.q, p.k, rows).status().message(),
              HasSubstr("rows[0]=100"));
  rows.offsets = {0};
  EXPECT_THAT(ProbeRecall(sel.index, p.head_dim, p.q, p.k, rows).status().message(),
              HasSubstr("offsets"));
  rows.rows = {5};
  rows.offsets = {0, 1};
  EXPECT_THAT(
      ProbeRecall(sel.index, p.head_dim, p.q, p.k, rows, 0.0f, /*threads=*/-1).status().message(),
      HasSubstr("threads=-1 must be non-negative"));
  RecallSampling sampling;
  sampling.last_rows = 9;
  EXPECT_THAT(ValidateRecallSampling(sampling).message(), HasSubstr("last_rows=9"));
  sampling = RecallSampling{};
  sampling.max_pair_share = 0.0;
  EXPECT_THAT(ValidateRecallSampling(sampling).message(), HasSubstr("max_pair_share"));
  sampling = RecallSampling{};
  sampling.rows = 0;
  EXPECT_THAT(ValidateRecallSampling(sampling).message(), HasSubstr("rows=0"));
}

}  // namespace
}  // namespace kernels
}  // namespace sparsebalance
