// What every rank derives alike without talking: the batch of a step (a pure function of the
// spec and the step, so a restarted rank regenerates it), the documents a planned micro-batch
// runs as (each segment of a pre-packed sample a document of its own) and the plan's digest.
#include "worker/step_inputs.h"

#include <cstdint>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "planner/types.h"

namespace sparsebalance {
namespace {

BatchSpec Spec() {
  BatchSpec spec;
  spec.trace = "pretrain";
  spec.seed = 3;
  spec.token_budget = 4 * 32768;
  spec.max_length = 32768;
  spec.min_length = 64;
  return spec;
}

TEST(StepInputsTest, TheBatchOfAStepIsTheSameOnEveryCall) {
  const auto a = BatchForStep(Spec(), 5);
  const auto b = BatchForStep(Spec(), 5);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->size(), b->size());
  for (size_t i = 0; i < a->size(); ++i) {
    EXPECT_EQ((*a)[i].id, (*b)[i].id);
    EXPECT_EQ((*a)[i].length, (*b)[i].length);
    EXPECT_EQ((*a)[i].segments, (*b)[i].segments);
  }
}

TEST(StepInputsTest, BatchesFitTheBudgetAndTheRangeWithIdsUniqueAcrossSteps) {
  const BatchSpec spec = Spec();
  std::set<uint64_t> ids;
  for (int64_t step = 0; step < 8; ++step) {
    const auto batch = BatchForStep(spec, step);
    ASSERT_TRUE(batch.ok()) << batch.status();
    int64_t tokens = 0;
    for (const Sample& s : *batch) {
      EXPECT_GE(s.length, spec.min_length);
      EXPECT_LE(s.length, spec.max_length);
      EXPECT_TRUE(ids.insert(s.id).second) << "id " << s.id << " repeats";
      tokens += s.length;
    }
    EXPECT_LE(tokens, spec.token_budget);
    // Greedy filling stops only when the next document would not fit: the batch is not tiny.
    EXPECT_GT(tokens, spec.token_budget / 4) << "step " << step;
  }
}

TEST(StepInputsTest, AnEmptyBudgetOrRangeIsRefusedNamingIt) {
  BatchSpec spec = Spec();
  spec.token_budget = 0;
  absl::Status status = BatchForStep(spec, 0).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("token_budget"), std::string::npos) << status;
  spec = Spec();
  spec.min_length = spec.max_length + 1;
  EXPECT_EQ(BatchForStep(spec, 0).status().code(), absl::StatusCode::kInvalidArgument);
  spec = Spec();
  spec.trace = "no-such-trace";
  EXPECT_FALSE(BatchForStep(spec, 0).ok());
}

MicroBatchPlan PackedMicroBatch() {
  MicroBatchPlan mb;
  mb.samples = {{10, 500, 0.3, {}, {}, 0, 0, 0, {}},
                {11, 1000, 0.7, {600, 300, 100}, {}, 0, 0, 0, {}},
                {12, 64, 1.0, {}, {}, 0, 0, 0, {}}};
  mb.tokens = 1564;
  return mb;
}

TEST(DocumentsOfTest, SegmentsBecomeDocumentsAtTheirSamplesDensity) {
  const MicroBatchPlan mb = PackedMicroBatch();
  const MicroBatchDocuments docs = DocumentsOf(mb);
  EXPECT_EQ(docs.lengths, (std::vector<int64_t>{500, 600, 300, 100, 64}));
  EXPECT_EQ(docs.densities, (std::vector<double>{0.3, 0.7, 0.7, 0.7, 1.0}));
  EXPECT_EQ(docs.sample_of, (std::vector<size_t>{0, 1, 1, 1, 2}));
  // An unpacked sample's document is made from its id, as before segments reached the runner;
  // the documents of a packed sample all differ.
  EXPECT_EQ(docs.ids[0], 10u);
  EXPECT_EQ(docs.ids[1], 11u);
  EXPECT_EQ(docs.ids[4], 12u);
  EXPECT_EQ(std::set<uint64_t>(docs.ids.begin(), docs.ids.end()).size(), docs.ids.size());
  // Tokens are conserved: the runner's total is the plan's.
  int64_t tokens = 0;
  for (int64_t n : docs.lengths) tokens += n;
  EXPECT_EQ(tokens, mb.tokens);
  EXPECT_TRUE(DocumentsOf(MicroBatchPlan()).lengths.empty());
}

TEST(PlanDigestTest, SeesEveryPlannedField) {
  const std::vector<MicroBatchPlan> plan = {PackedMicroBatch(), MicroBatchPlan()};
  const std::string digest = PlanDigest(plan);
  EXPECT_EQ(digest.size(), 16u);
  EXPECT_EQ(PlanDigest(plan), digest);
  auto changed = [&](auto change) {
    std::vector<MicroBatchPlan> other = plan;
    change(other[0].samples[1]);
    return PlanDigest(other);
  };
  EXPECT_NE(changed([](PlannedSample& p) { p.id = 99; }), digest);
  EXPECT_NE(changed([](PlannedSample& p) { p.density = 0.71; }), digest);
  EXPECT_NE(changed([](PlannedSample& p) { p.segments = {600, 400}; }), digest);
  EXPECT_NE(changed([](PlannedSample& p) { p.length = 1001; }), digest);
  EXPECT_NE(changed([](PlannedSample& p) { p.layer_densities = {0.5}; }), digest);
}

}  // namespace
}  // namespace sparsebalance
