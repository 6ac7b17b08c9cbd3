// MicroBatchRunner on the CPU reference kernels: a planned sample runs as its documents (a
// pre-packed sample's segments never attend across a boundary, so it keeps exactly the blocks
// of its documents run alone and measures the same recall), per-layer densities run layer by
// layer, and a sample that cannot run is refused naming it. A shard of a split document runs
// through the shard exchange (ranks as threads): the shards together keep the unsplit
// document's blocks, and each reports an exchange time inside its compute time.
#include "worker/micro_batch_runner.h"

#include <future>
#include <memory>
#include <vector>

#include "contract/block_geometry.h"
#include "gtest/gtest.h"
#include "kernels/layer_runner.h"
#include "planner/types.h"
#include "tests/support/small_shape.h"
#include "worker/shard_exchange.h"
#include "worker/shard_layer.h"
#include "worker/step_sync.h"

namespace sparsebalance {
namespace {

// Two layers, so that per-layer densities run layer by layer.
ModelShape SmallShape() { return test_support::SmallShape(/*layers=*/2); }

std::unique_ptr<MicroBatchRunner> Runner(bool exact_recall = false) {
  absl::StatusOr<std::unique_ptr<MicroBatchRunner>> runner =
      MicroBatchRunner::Create("cpu", SmallShape(), exact_recall);
  EXPECT_TRUE(runner.ok()) << runner.status();
  return runner.ok() ? std::move(*runner) : nullptr;
}

MicroBatchPlan OneSample(PlannedSample sample) {
  MicroBatchPlan mb;
  mb.tokens = sample.length;
  mb.samples = {std::move(sample)};
  return mb;
}

// Blocks the kernels keep for documents of `lengths` at `density`, all heads and layers.
int64_t ExpectedBlocks(const std::vector<int64_t>& lengths, double density) {
  const ModelShape shape = SmallShape();
  int64_t blocks = 0;
  for (int64_t length : lengths) {
    blocks += ActiveBlocks(length, density, shape.block_size, shape.local_blocks);
  }
  return blocks * shape.heads * shape.layers;
}

TEST(MicroBatchRunnerTest, APackedSampleKeepsTheBlocksOfItsDocumentsNotOfOneSequence) {
  const std::vector<int64_t> segments = {640, 320, 64};
  absl::StatusOr<MicroBatchResult> r =
      Runner()->Run(OneSample({7, 1024, 0.3, segments, {}, 0, 0, 0, {}}));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->samples.size(), 1u);
  EXPECT_EQ(r->tokens, 1024);
  EXPECT_EQ(r->samples[0].active_blocks, ExpectedBlocks(segments, 0.3));
  EXPECT_NE(r->samples[0].active_blocks, ExpectedBlocks({1024}, 0.3));
  EXPECT_EQ(r->active_blocks, r->samples[0].active_blocks);
}

TEST(MicroBatchRunnerTest, APackedSampleMeasuresWhatItsDocumentsMeasureAsSamples) {
  // The runner makes a packed sample's d-th document from id ^ (d * golden); planning those
  // ids as plain samples runs the very same tensors.
  const uint64_t id = 11;
  const uint64_t second = id ^ 0x9E3779B97F4A7C15ULL;
  std::unique_ptr<MicroBatchRunner> runner = Runner(/*exact_recall=*/true);
  absl::StatusOr<MicroBatchResult> packed =
      runner->Run(OneSample({id, 768, 0.25, {512, 256}, {}, 0, 0, 0, {}}));
  MicroBatchPlan apart;
  apart.samples = {{id, 512, 0.25, {}, {}, 0, 0, 0, {}}, {second, 256, 0.25, {}, {}, 0, 0, 0, {}}};
  apart.tokens = 768;
  absl::StatusOr<MicroBatchResult> separate = runner->Run(apart);
  ASSERT_TRUE(packed.ok() && separate.ok()) << packed.status() << separate.status();
  const SampleResult& p = packed->samples[0];
  const SampleResult& a = separate->samples[0];
  const SampleResult& b = separate->samples[1];
  EXPECT_EQ(p.tokens, a.tokens + b.tokens);
  EXPECT_EQ(p.active_blocks, a.active_blocks + b.active_blocks);
  EXPECT_EQ(p.causal_blocks, a.causal_blocks + b.causal_blocks);
  EXPECT_NEAR(p.recall, (a.recall * 512 + b.recall * 256) / 768, 1e-12);
  EXPECT_NEAR(packed->recall, separate->recall, 1e-12);
  EXPECT_LT(p.recall, 1.0);  // exact recall at density 0.25 loses mass
}

TEST(MicroBatchRunnerTest, PerLayerDensitiesRunLayerByLayer) {
  absl::StatusOr<MicroBatchResult> r =
      Runner()->Run(OneSample({3, 1024, 0.5, {}, {1.0, 0.1}, 0, 0, 0, {}}));
  ASSERT_TRUE(r.ok()) << r.status();
  const ModelShape shape = SmallShape();
  const int64_t dense = ActiveBlocks(1024, 1.0, shape.block_size, shape.local_blocks);
  const int64_t sparse = ActiveBlocks(1024, 0.1, shape.block_size, shape.local_blocks);
  EXPECT_EQ(r->samples[0].active_blocks, (dense + sparse) * shape.heads);
  EXPECT_EQ(r->samples[0].causal_blocks, 2 * dense * shape.heads);
  EXPECT_GT(r->achieved_density, 0.1);
  EXPECT_LT(r->achieved_density, 1.0);
}

TEST(MicroBatchRunnerTest, ExactRecallIsOneAtFullDensity) {
  absl::StatusOr<MicroBatchResult> r =
      Runner(/*exact_recall=*/true)->Run(OneSample({5, 512, 1.0, {}, {}, 0, 0, 0, {}}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->recall, 1.0, 1e-6);
  EXPECT_DOUBLE_EQ(r->achieved_density, 1.0);
  EXPECT_GT(r->compute_seconds, 0.0);
  EXPECT_LE(r->attention_seconds, r->compute_seconds);
}

std::unique_ptr<MicroBatchRunner> ProbingRunner(int rows = 8) {
  MicroBatchRunnerOptions options;
  options.recall_rows = rows;
  absl::StatusOr<std::unique_ptr<MicroBatchRunner>> runner =
      MicroBatchRunner::Create("cpu", SmallShape(), options);
  EXPECT_TRUE(runner.ok()) << runner.status();
  return runner.ok() ? std::move(*runner) : nullptr;
}

TEST(MicroBatchRunnerTest, TheRecallProbeReportsEveryDocumentAndLayer) {
  MicroBatchPlan mb;
  mb.samples = {{21, 1024, 0.2, {640, 384}, {0.2, 1.0}, 0, 0, 0, {}},
                {22, 900, 0.1, {}, {}, 0, 0, 0, {}},
                {23, 1, 1.0, {}, {}, 0, 0, 0, {}}};
  mb.tokens = 1925;
  absl::StatusOr<MicroBatchResult> r = ProbingRunner()->Run(mb, /*recall_seed=*/5);
  ASSERT_TRUE(r.ok()) << r.status();
  // One per document of each planned sample, in order.
  ASSERT_EQ(r->documents.size(), 4u);
  const std::vector<std::pair<uint64_t, int>> ids = {{21, 0}, {21, 1}, {22, 0}, {23, 0}};
  const std::vector<int64_t> lengths = {640, 384, 900, 1};
  double weighted = 0.0;
  for (size_t d = 0; d < ids.size(); ++d) {
    const DocumentRecallMeasurement& m = r->documents[d];
    EXPECT_EQ(m.sample_id, ids[d].first) << d;
    EXPECT_EQ(m.document, ids[d].second) << d;
    ASSERT_EQ(m.layer_recall.size(), 2u) << d;
    EXPECT_NEAR(m.recall, (m.layer_recall[0] + m.layer_recall[1]) / 2, 1e-12) << d;
    EXPECT_GE(m.rows, 1) << d;
    weighted += m.recall * static_cast<double>(lengths[d]);
  }
  EXPECT_EQ(r->documents[3].rows, 1);  // a 1-token document has one row
  EXPECT_EQ(r->documents[3].recall, 1.0);
  EXPECT_EQ(r->documents[0].layer_recall[1], 1.0);  // layer 1 of sample 21 is dense
  EXPECT_LT(r->documents[0].layer_recall[0], 1.0);
  EXPECT_EQ(r->documents[2].layer_recall[0], r->documents[2].layer_recall[1]);  // same blocks
  // The micro-batch's recall is the measured one, token-weighted.
  EXPECT_NEAR(r->recall, weighted / 1925, 1e-9);
  EXPECT_NE(r->recall, r->estimated_recall);
  EXPECT_GT(r->recall_seconds, 0.0);
  // The same sample and seed probe the same rows wherever the sample runs.
  MicroBatchPlan alone;
  alone.samples = {mb.samples[1]};
  alone.tokens = 900;
  absl::StatusOr<MicroBatchResult> a = ProbingRunner()->Run(alone, 5);
  ASSERT_TRUE(a.ok());
  ASSERT_EQ(a->documents.size(), 1u);
  EXPECT_EQ(a->documents[0], r->documents[2]);
  // Without the probe: the estimate, and no documents.
  absl::StatusOr<MicroBatchResult> estimate = Runner()->Run(mb, 5);
  ASSERT_TRUE(estimate.ok());
  EXPECT_TRUE(estimate->documents.empty());
  EXPECT_EQ(estimate->recall_seconds, 0.0);
  EXPECT_EQ(estimate->recall, estimate->estimated_recall);
  EXPECT_NEAR(estimate->estimated_recall, r->estimated_recall, 1e-12);
  // Bad options are named.
  MicroBatchRunnerOptions bad;
  bad.recall_rows = -2;
  EXPECT_NE(MicroBatchRunner::Create("cpu", SmallShape(), bad)
                .status()
                .message()
                .find("--recall_rows=-2"),
            std::string::npos);
}

TEST(MicroBatchRunnerTest, AnchorSelectionKeepsAtMostTheBudgetAndTopKAtAVanishingThreshold) {
  const ModelShape shape = SmallShape();
  auto run = [&](SelectionMode mode, double tau) {
    MicroBatchRunnerOptions options;
    options.exact_recall = true;
    options.selection = mode;
    options.anchor_threshold = tau;
    absl::StatusOr<std::unique_ptr<MicroBatchRunner>> runner =
        MicroBatchRunner::Create("cpu", shape, options);
    EXPECT_TRUE(runner.ok()) << runner.status();
    MicroBatchPlan mb;
    mb.samples = {{21, 2048, 0.3, {}, {}, 0, 0, 0, {}}, {22, 1024, 0.5, {}, {}, 0, 0, 0, {}}};
    mb.tokens = 3072;
    absl::StatusOr<MicroBatchResult> r = (*runner)->Run(mb);
    EXPECT_TRUE(r.ok()) << r.status();
    return *r;
  };
  const MicroBatchResult topk = run(SelectionMode::kTopK, kDefaultAnchorThreshold);
  const MicroBatchResult strict = run(SelectionMode::kAnchor, 1.0);
  const MicroBatchResult loose = run(SelectionMode::kAnchor, 1e-30);
  EXPECT_EQ(topk.active_blocks, ExpectedBlocks({2048}, 0.3) + ExpectedBlocks({1024}, 0.5));
  // The worker's inputs have weak blocks: tau = 1 drops some, never adds; recall follows.
  EXPECT_LT(strict.active_blocks, topk.active_blocks);
  EXPECT_LT(strict.achieved_density, topk.achieved_density);
  EXPECT_LE(strict.recall, topk.recall + 1e-12);
  EXPECT_EQ(loose.active_blocks, topk.active_blocks);
  EXPECT_EQ(loose.recall, topk.recall);
  MicroBatchRunnerOptions bad;
  bad.anchor_threshold = 0.0;
  absl::StatusOr<std::unique_ptr<MicroBatchRunner>> refused =
      MicroBatchRunner::Create("cpu", shape, bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("anchor_threshold"), absl::string_view::npos);
}

// A layer runner that runs the real CPU one and records what each Run was asked.
class RecordingLayer final : public kernels::LayerRunner {
 public:
  RecordingLayer(std::unique_ptr<kernels::LayerRunner> real, std::vector<kernels::RunOptions>* runs)
      : real_(std::move(real)), runs_(runs) {}
  absl::Status Load(kernels::LayerBatch batch) override { return real_->Load(std::move(batch)); }
  absl::Status SetDensities(const std::vector<double>& densities) override {
    return real_->SetDensities(densities);
  }
  absl::StatusOr<kernels::LayerMeasurement> Run(const kernels::RunOptions& options) override {
    runs_->push_back(options);
    return real_->Run(options);
  }
  std::string device_name() const override { return real_->device_name(); }

 private:
  std::unique_ptr<kernels::LayerRunner> real_;
  std::vector<kernels::RunOptions>* runs_;
};

// Every layer selects blocks as the job says, not only the first: the layers after it, at the
// same densities, ran top-k at the default threshold in an anchor job (while the figures
// reported were the first layer's), so the time measured was top-k's. Only the recall is
// measured once per distinct densities.
TEST(MicroBatchRunnerTest, EveryLayerRunsTheJobsSelectionAndOnlyTheFirstMeasuresRecall) {
  const ModelShape shape = test_support::SmallShape(/*layers=*/3);
  kernels::LayerRunnerOptions layer_options;
  layer_options.device = "cpu";
  layer_options.threads = 1;
  absl::StatusOr<std::unique_ptr<kernels::LayerRunner>> real =
      kernels::LayerRunner::Create(shape, layer_options);
  ASSERT_TRUE(real.ok()) << real.status();
  std::vector<kernels::RunOptions> runs;
  MicroBatchRunnerOptions options;
  options.recall_rows = 4;
  options.selection = SelectionMode::kAnchor;
  options.anchor_threshold = 0.9;
  std::unique_ptr<MicroBatchRunner> runner = MicroBatchRunner::Over(
      std::make_unique<RecordingLayer>(*std::move(real), &runs), shape, options, /*cpu=*/true);
  absl::StatusOr<MicroBatchResult> r = runner->Run(OneSample({31, 1024, 0.4, {}, {}, 0, 0, 0, {}}));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(runs.size(), 3u);
  for (size_t layer = 0; layer < runs.size(); ++layer) {
    EXPECT_EQ(runs[layer].selection, SelectionMode::kAnchor) << "layer " << layer;
    EXPECT_EQ(runs[layer].anchor_threshold, 0.9) << "layer " << layer;
    EXPECT_EQ(runs[layer].probe_recall, layer == 0) << "layer " << layer;
    EXPECT_FALSE(runs[layer].exact_recall) << "layer " << layer;
  }
}

TEST(MicroBatchRunnerTest, ASampleThatCannotRunIsRefusedNamingIt) {
  std::unique_ptr<MicroBatchRunner> runner = Runner();
  auto refusal = [&](const MicroBatchPlan& mb) { return runner->Run(mb).status(); };
  EXPECT_EQ(refusal(MicroBatchPlan()).code(), absl::StatusCode::kInvalidArgument);
  MicroBatchPlan mb = OneSample({1, 256, 0.3, {}, {}, 0, 0, 0, {}});
  mb.samples.push_back({2, 128, 0.0, {}, {}, 0, 0, 0, {}});
  absl::Status density = refusal(mb);
  EXPECT_EQ(density.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(density.message().find("samples[1].density"), std::string::npos) << density;
  absl::Status layers = refusal(OneSample({1, 256, 0.3, {}, {0.5, 0.5, 0.5}, 0, 0, 0, {}}));
  EXPECT_NE(layers.message().find("samples[0].layer_densities: 3 values"), std::string::npos)
      << layers;
  absl::Status segments = refusal(OneSample({1, 256, 0.3, {200, 100}, {}, 0, 0, 0, {}}));
  EXPECT_NE(segments.message().find("samples[0].segments"), std::string::npos) << segments;
  absl::Status length = refusal(OneSample({1, 0, 0.3, {}, {}, 0, 0, 0, {}}));
  EXPECT_NE(length.message().find("samples[0].length"), std::string::npos) << length;
}

PlannedSample Shard(uint64_t id, int64_t length, int64_t begin, int64_t end, int index,
                    std::vector<int> group) {
  PlannedSample p;
  p.id = id;
  p.length = length;
  p.density = 0.3;
  p.shard_begin = begin;
  p.shard_end = end;
  p.shard_index = index;
  p.shard_group = std::move(group);
  return p;
}

TEST(MicroBatchRunnerTest, ShardsOfASplitDocumentKeepItsBlocksAndReportTheirExchange) {
  constexpr int64_t kLength = 1024;
  absl::StatusOr<MicroBatchResult> whole =
      Runner()->Run(OneSample(Shard(21, kLength, 0, 0, 0, {})));
  ASSERT_TRUE(whole.ok()) << whole.status();
  StepSyncHubOptions hub_options;
  hub_options.secret = "micro-batch-runner-test-secret";
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StepSyncHub::Start(2, hub_options);
  ASSERT_TRUE(hub.ok()) << hub.status();
  // Rank 1 runs shard 0 with an unsplit sample after it; rank 0 runs shard 1.
  std::vector<std::future<absl::StatusOr<MicroBatchResult>>> runs;
  for (int rank = 0; rank < 2; ++rank) {
    runs.push_back(std::async(std::launch::async, [&, rank]() -> absl::StatusOr<MicroBatchResult> {
      ShardExchangeOptions options;
      options.secret = hub_options.secret;
      options.world_size = 2;
      options.max_payload_bytes =
          MaxShardPayloadBytes(kLength, SmallShape().heads, SmallShape().head_dim);
      absl::StatusOr<std::unique_ptr<ShardExchange>> ex =
          ShardExchange::Start(rank, (*hub)->address(), options);
      if (!ex.ok()) return ex.status();
      MicroBatchPlan mb;
      if (rank == 1) {
        PlannedSample other = Shard(5, 256, 0, 0, 0, {});
        mb.samples = {Shard(21, kLength, 0, 512, 0, {1, 0}), other};
      } else {
        mb.samples = {Shard(21, kLength, 512, kLength, 1, {1, 0})};
      }
      MicroBatchContext context;
      context.step = 4;
      context.exchange = ex->get();
      return Runner()->Run(mb, context);
    }));
  }
  absl::StatusOr<MicroBatchResult> r0 = runs[0].get(), r1 = runs[1].get();
  ASSERT_TRUE(r0.ok()) << r0.status();
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(r0->samples[0].tokens, 512);
  EXPECT_EQ(r1->samples[0].tokens, 512);
  EXPECT_EQ(r1->samples[1].tokens, 256);
  EXPECT_EQ(r1->tokens, 768);
  EXPECT_EQ(r0->samples[0].active_blocks + r1->samples[0].active_blocks,
            whole->samples[0].active_blocks);
  EXPECT_EQ(r0->samples[0].causal_blocks + r1->samples[0].causal_blocks,
            whole->samples[0].causal_blocks);
  EXPECT_EQ(r1->samples[1].active_blocks, ExpectedBlocks({256}, 0.3));
  for (const MicroBatchResult* r : {&*r0, &*r1}) {
    EXPECT_GT(r->exchange_seconds, 0.0);
    EXPECT_LT(r->exchange_seconds, r->compute_seconds);
    EXPECT_LE(r->attention_seconds, r->compute_seconds);
  }
  EXPECT_GT(r0->samples[0].exchange_bytes, 0) << "shard 1 receives shard 0's blocks";
  EXPECT_EQ(r1->samples[0].exchange_bytes, 0) << "shard 0 receives none";
}

TEST(MicroBatchRunnerTest, AShardWithoutAnExchangeIsRefusedNamingIt) {
  absl::StatusOr<MicroBatchResult> r = Runner()->Run(OneSample(Shard(3, 1024, 0, 512, 0, {0, 1})));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("samples[0]"), std::string::npos) << r.status();
  r = Runner()->Run(OneSample(Shard(3, 1024, 0, 2048, 0, {0, 1})));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("samples[0]"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace sparsebalance
