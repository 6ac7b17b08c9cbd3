// The layer that sb-profile and sb-worker both run: its per-document block counts are the
// contract's (contract/block_geometry.h), documents in one batch never see each other, and
// the time splits into attention and linear parts.
#include "kernels/layer_runner.h"

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "contract/block_geometry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda_attention.h"
#include "planner/random.h"
#include "tests/support/small_shape.h"

namespace sparsebalance {
namespace kernels {
namespace {

using test_support::SmallShape;
using ::testing::HasSubstr;

// Random q, k, v in [-1, 1) for the documents.
LayerBatch MakeBatch(const ModelShape& shape, const std::vector<LayerDocument>& documents,
                     uint64_t seed) {
  LayerBatch batch;
  batch.documents = documents;
  int64_t tokens = 0;
  for (const LayerDocument& d : documents) tokens += d.length;
  const size_t n = static_cast<size_t>(tokens) * shape.heads * shape.head_dim;
  Rng rng(seed);
  for (std::vector<float>* t : {&batch.q, &batch.k, &batch.v}) {
    t->resize(n);
    for (float& x : *t) x = static_cast<float>(2.0 * rng.Uniform() - 1.0);
  }
  return batch;
}

// Document `document` of a batch, with its rows of the tensors, as a batch of its own.
LayerBatch Slice(const ModelShape& shape, const LayerBatch& batch, size_t document) {
  int64_t start = 0;
  for (size_t i = 0; i < document; ++i) start += batch.documents[i].length;
  const size_t width = static_cast<size_t>(shape.heads) * shape.head_dim;
  const size_t begin = static_cast<size_t>(start) * width;
  const size_t end = begin + static_cast<size_t>(batch.documents[document].length) * width;
  LayerBatch one;
  one.documents = {batch.documents[document]};
  one.q.assign(batch.q.begin() + begin, batch.q.begin() + end);
  one.k.assign(batch.k.begin() + begin, batch.k.begin() + end);
  one.v.assign(batch.v.begin() + begin, batch.v.begin() + end);
  return one;
}

std::unique_ptr<LayerRunner> CpuRunner(const ModelShape& shape) {
  absl::StatusOr<std::unique_ptr<LayerRunner>> runner = LayerRunner::Create(shape, {});
  EXPECT_TRUE(runner.ok()) << runner.status();
  return runner.ok() ? *std::move(runner) : nullptr;
}

// heads x the contract's count for each document, and all causal pairs.
void ExpectContractBlocks(const ModelShape& shape, const LayerBatch& batch,
                          const LayerMeasurement& m) {
  ASSERT_EQ(m.documents.size(), batch.documents.size());
  int64_t active = 0;
  int64_t causal = 0;
  for (size_t i = 0; i < batch.documents.size(); ++i) {
    const LayerDocument& d = batch.documents[i];
    const int64_t rows = QueryBlocks(d.length, shape.block_size);
    EXPECT_EQ(m.documents[i].tokens, d.length) << i;
    EXPECT_EQ(m.documents[i].active_blocks,
              shape.heads * ActiveBlocks(d.length, d.density, shape.block_size, shape.local_blocks))
        << "document " << i << ": " << d.length << " tokens at density " << d.density;
    EXPECT_EQ(m.documents[i].causal_blocks, shape.heads * rows * (rows + 1) / 2) << i;
    EXPECT_GE(m.documents[i].recall, 0.0);
    EXPECT_LE(m.documents[i].recall, 1.0);
    EXPECT_GT(m.documents[i].achieved_density, 0.0);
    EXPECT_LE(m.documents[i].achieved_density, 1.0);
    active += m.documents[i].active_blocks;
    causal += m.documents[i].causal_blocks;
  }
  EXPECT_EQ(m.active_blocks, active);
  EXPECT_EQ(m.causal_blocks, causal);
}

TEST(LayerRunnerTest, OneDocumentKeepsTheContractsBlocks) {
  const ModelShape shape = SmallShape();
  std::unique_ptr<LayerRunner> runner = CpuRunner(shape);
  ASSERT_NE(runner, nullptr);
  for (int64_t length : {1, 64, 65, 500, 1024}) {
    for (double density : {1.0, 0.5, 0.1}) {
      const LayerBatch batch = MakeBatch(shape, {{length, density}}, 7);
      ASSERT_TRUE(runner->Load(batch).ok());
      absl::StatusOr<LayerMeasurement> m = runner->Run(/*exact_recall=*/false);
      ASSERT_TRUE(m.ok()) << m.status();
      ExpectContractBlocks(shape, batch, *m);
      EXPECT_GT(m->attention_seconds, 0.0);
      EXPECT_GT(m->linear_seconds, 0.0);
      EXPECT_DOUBLE_EQ(m->seconds(), m->attention_seconds + m->linear_seconds);
      if (density == 1.0) {
        EXPECT_EQ(m->documents[0].recall, 1.0);
      }
    }
  }
}

TEST(LayerRunnerTest, SetDensitiesChangesTheBlocksWithoutLoading) {
  const ModelShape shape = SmallShape();
  std::unique_ptr<LayerRunner> runner = CpuRunner(shape);
  ASSERT_NE(runner, nullptr);
  LayerBatch batch = MakeBatch(shape, {{700, 1.0}}, 3);
  ASSERT_TRUE(runner->Load(batch).ok());
  ASSERT_TRUE(runner->SetDensities({0.2}).ok());
  absl::StatusOr<LayerMeasurement> m = runner->Run(false);
  ASSERT_TRUE(m.ok()) << m.status();
  batch.documents[0].density = 0.2;
  ExpectContractBlocks(shape, batch, *m);
  EXPECT_THAT(runner->SetDensities({0.2, 0.3}).message(), HasSubstr("2 densities for 1"));
  EXPECT_THAT(runner->SetDensities({1.5}).message(), HasSubstr("densities[0]=1.5"));
}

TEST(LayerRunnerTest, DocumentsOfABatchAreMeasuredAsIfAlone) {
  ModelShape shape = SmallShape();
  for (int block_size : {64, 128}) {
    shape.block_size = block_size;
    std::unique_ptr<LayerRunner> runner = CpuRunner(shape);
    ASSERT_NE(runner, nullptr);
    const LayerBatch batch =
        MakeBatch(shape, {{300, 0.3}, {1, 1.0}, {777, 0.1}, {128, 0.5}, {1000, 1.0}}, 11);
    ASSERT_TRUE(runner->Load(batch).ok());
    for (bool exact : {false, true}) {
      absl::StatusOr<LayerMeasurement> together = runner->Run(exact);
      ASSERT_TRUE(together.ok()) << together.status();
      ExpectContractBlocks(shape, batch, *together);
      EXPECT_EQ(together->documents[4].recall, 1.0);  // density 1 keeps every block
      // Selection and recall of a document depend on its own tokens only.
      std::unique_ptr<LayerRunner> alone = CpuRunner(shape);
      for (size_t i = 0; i < batch.documents.size(); ++i) {
        ASSERT_TRUE(alone->Load(Slice(shape, batch, i)).ok());
        absl::StatusOr<LayerMeasurement> m = alone->Run(exact);
        ASSERT_TRUE(m.ok()) << m.status();
        const DocumentMeasurement& a = m->documents[0];
        const DocumentMeasurement& b = together->documents[i];
        EXPECT_EQ(a.tokens, b.tokens) << i;
        EXPECT_EQ(a.active_blocks, b.active_blocks) << i;
        EXPECT_EQ(a.causal_blocks, b.causal_blocks) << i;
        EXPECT_DOUBLE_EQ(a.achieved_density, b.achieved_density) << i;
        EXPECT_NEAR(a.recall, b.recall, 1e-6) << "document " << i << (exact ? " exact" : "");
      }
    }
  }
}

TEST(LayerRunnerTest, TheRecallProbeMeasuresSampledRowsOffTheClock) {
  const ModelShape shape = SmallShape();
  std::unique_ptr<LayerRunner> runner = CpuRunner(shape);
  ASSERT_NE(runner, nullptr);
  LayerBatch batch = MakeBatch(shape, {{900, 0.1}, {1, 1.0}, {300, 0.3}}, 5);
  for (size_t i = 0; i < batch.documents.size(); ++i) batch.documents[i].recall_seed = 40 + i;
  ASSERT_TRUE(runner->Load(batch).ok());
  absl::StatusOr<LayerMeasurement> exact = runner->Run(/*exact_recall=*/true);
  ASSERT_TRUE(exact.ok()) << exact.status();
  RunOptions options;
  options.probe_recall = true;
  // Rows beyond the longest document and a budget that never binds: every row is probed, so
  // the probe's mean is the exact all-rows recall.
  options.sampling.rows = 1000;
  options.sampling.max_pair_share = 100.0;
  absl::StatusOr<LayerMeasurement> all = runner->Run(options);
  ASSERT_TRUE(all.ok()) << all.status();
  for (size_t d = 0; d < batch.documents.size(); ++d) {
    EXPECT_EQ(all->documents[d].recall_rows, batch.documents[d].length) << d;
    EXPECT_EQ(exact->documents[d].recall_rows, batch.documents[d].length) << d;
    EXPECT_NEAR(all->documents[d].recall, exact->documents[d].recall, 1e-4) << d;
    EXPECT_EQ(all->documents[d].estimated_recall, exact->documents[d].estimated_recall) << d;
  }
  EXPECT_LT(all->documents[0].recall, 1.0);
  EXPECT_EQ(all->documents[1].recall, 1.0);
  // Defaults: a few rows, the same on a second run (seeded), timed apart from the layer.
  options.sampling = RecallSampling{};
  absl::StatusOr<LayerMeasurement> first = runner->Run(options);
  absl::StatusOr<LayerMeasurement> second = runner->Run(options);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(first->documents[0].recall_rows, 8);
  EXPECT_EQ(first->documents[1].recall_rows, 1);
  EXPECT_EQ(first->documents[0].recall, second->documents[0].recall);
  EXPECT_GT(first->recall_seconds, 0.0);
  EXPECT_EQ(exact->recall_seconds, 0.0);
  absl::StatusOr<LayerMeasurement> estimate = runner->Run(/*exact_recall=*/false);
  ASSERT_TRUE(estimate.ok());
  EXPECT_EQ(estimate->documents[0].recall_rows, 0);
  EXPECT_EQ(estimate->documents[0].recall, estimate->documents[0].estimated_recall);
  options.sampling.rows = 0;
  EXPECT_THAT(runner->Run(options).status().message(), HasSubstr("rows=0"));
}

TEST(LayerRunnerTest, BadInputIsAnErrorThatNamesIt) {
  const ModelShape shape = SmallShape();
  ModelShape bad = shape;
  bad.head_dim = 96;
  EXPECT_THAT(LayerRunner::Create(bad, {}).status().message(), HasSubstr("head_dim=96"));
  bad = shape;
  bad.local_blocks = -1;
  EXPECT_THAT(LayerRunner::Create(bad, {}).status().message(), HasSubstr("local_blocks=-1"));
  LayerRunnerOptions tpu;
  tpu.device = "tpu";
  EXPECT_THAT(LayerRunner::Create(shape, tpu).status().message(), HasSubstr("device=tpu"));

  std::unique_ptr<LayerRunner> runner = CpuRunner(shape);
  ASSERT_NE(runner, nullptr);
  EXPECT_EQ(runner->Run(false).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(runner->Load(LayerBatch{}).message(), HasSubstr("no documents"));
  LayerBatch batch = MakeBatch(shape, {{100, 0.5}}, 1);
  ASSERT_TRUE(runner->Load(batch).ok());
  ASSERT_TRUE(runner->Run(false).ok());
  batch.documents[0].density = 0.0;
  EXPECT_THAT(runner->Load(batch).message(), HasSubstr("densities[0]=0"));
  batch.documents[0] = {0, 0.5};
  EXPECT_THAT(runner->Load(batch).message(), HasSubstr("documents[0].length 0"));
  batch.documents[0] = {101, 0.5};
  EXPECT_THAT(runner->Load(batch).message(), HasSubstr("q holds 12800 values"));
  // A batch that failed to load leaves none: the earlier one is not run by mistake.
  EXPECT_EQ(runner->Run(false).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(LayerRunnerTest, CudaWithoutADeviceSaysSo) {
  if (cuda::DeviceCount() > 0) GTEST_SKIP() << "a CUDA device is usable here";
  LayerRunnerOptions options;
  options.device = "cuda";
  absl::StatusOr<std::unique_ptr<LayerRunner>> runner = LayerRunner::Create(SmallShape(), options);
  EXPECT_EQ(runner.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(runner.status().message(), HasSubstr("--device=cpu"));
}

}  // namespace
}  // namespace kernels
}  // namespace sparsebalance
