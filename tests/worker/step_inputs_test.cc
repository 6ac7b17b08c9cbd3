// What a rank derives from its plan alone: the documents a planned micro-batch runs as (each
// segment of a pre-packed sample a document of its own) and the plan's digest.
#include "worker/step_inputs.h"

#include <cstdint>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "planner/types.h"

namespace sparsebalance {
namespace {

MicroBatchPlan PackedMicroBatch() {
  MicroBatchPlan mb;
  mb.samples = {
      {10, 500, 0.3, {}, {}}, {11, 1000, 0.7, {600, 300, 100}, {}}, {12, 64, 1.0, {}, {}}};
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
