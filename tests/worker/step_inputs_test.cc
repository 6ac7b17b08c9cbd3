// What every rank derives alike without talking: the batch of a step (a pure function of the
// spec and the step, so a restarted rank regenerates it), the documents a planned micro-batch
// runs as (each segment of a pre-packed sample a document of its own) and the plan's digest.
// A batch is the trace's in-range draws from the first that fits the budget up to the next that
// does not; a budget below every length is refused saying so.
#include "worker/step_inputs.h"

#include <cstdint>
#include <limits>
#include <set>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "planner/traces.h"
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

// The in-range draws of the trace BatchForStep uses for `step` (the same seeding), with their
// draw index.
std::vector<std::pair<int, int64_t>> InRangeDraws(const BatchSpec& spec, int64_t step, int n) {
  absl::StatusOr<TraceGenerator> gen =
      TraceGenerator::Builtin(spec.trace, spec.seed * 1000003 + static_cast<uint64_t>(step));
  EXPECT_TRUE(gen.ok()) << gen.status();
  std::vector<std::pair<int, int64_t>> out;
  for (int draw = 0; gen.ok() && static_cast<int>(out.size()) < n; ++draw) {
    const Sample s = gen->Next();
    if (s.length >= spec.min_length && s.length <= spec.max_length) out.push_back({draw, s.length});
  }
  return out;
}

TEST(StepInputsTest, DocumentsOverTheBudgetBeforeTheFirstThatFitsAreSkipped) {
  // A budget a few documents of the trace pass: batches used to fail when the first did.
  BatchSpec spec = Spec();
  spec.token_budget = 4000;
  int skipping_steps = 0;
  for (int64_t step = 0; step < 16; ++step) {
    SCOPED_TRACE(step);
    absl::StatusOr<std::vector<Sample>> batch = BatchForStep(spec, step);
    ASSERT_TRUE(batch.ok()) << batch.status();
    // The batch: the in-range draws from the first that fits up to the next that does not.
    std::vector<uint64_t> want;
    int64_t total = 0;
    for (const auto& [draw, length] : InRangeDraws(spec, step, 4000)) {
      if (total + length > spec.token_budget) {
        if (want.empty()) continue;
        break;
      }
      total += length;
      want.push_back(static_cast<uint64_t>(step) * 1000000 + draw);
    }
    std::vector<uint64_t> got;
    for (const Sample& s : *batch) got.push_back(s.id);
    EXPECT_EQ(got, want);
    if (InRangeDraws(spec, step, 1)[0].second > spec.token_budget) ++skipping_steps;
  }
  EXPECT_GT(skipping_steps, 0) << "no step starts with a document over the budget: pick another";
}

TEST(StepInputsTest, ABatchWhoseFirstDocumentFitsIsTheDrawsUpToTheFirstThatDoesNot) {
  const BatchSpec spec = Spec();
  for (int64_t step = 0; step < 8; ++step) {
    SCOPED_TRACE(step);
    const std::vector<std::pair<int, int64_t>> draws = InRangeDraws(spec, step, 4000);
    ASSERT_LE(draws[0].second, spec.token_budget);
    absl::StatusOr<std::vector<Sample>> batch = BatchForStep(spec, step);
    ASSERT_TRUE(batch.ok()) << batch.status();
    int64_t total = 0;
    size_t k = 0;
    for (; k < draws.size() && total + draws[k].second <= spec.token_budget; ++k) {
      total += draws[k].second;
      ASSERT_LT(k, batch->size());
      EXPECT_EQ((*batch)[k].id, static_cast<uint64_t>(step) * 1000000 + draws[k].first);
    }
    EXPECT_EQ(batch->size(), k);
  }
}

TEST(StepInputsTest, ABudgetNoDocumentFitsIsRefusedSayingSo) {
  BatchSpec spec = Spec();
  spec.token_budget = spec.min_length - 1;
  absl::Status status = BatchForStep(spec, 0).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("token_budget 63 is below min_length 64"), std::string::npos)
      << status;
  // A long document counts in the budget but is never refused for it.
  spec.long_document = 100000;
  absl::StatusOr<std::vector<Sample>> batch = BatchForStep(spec, 0);
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_EQ(batch->size(), 1u);
  EXPECT_EQ((*batch)[0].id, LongDocumentId(0));
}

TEST(StepInputsTest, TheStepBudgetIsFillTimesTheCapacityAndRefusesWhatIsNoTokenCount) {
  absl::StatusOr<int64_t> budget = StepTokenBudget(0.6, 2, 2, 4096);
  ASSERT_TRUE(budget.ok()) << budget.status();
  EXPECT_EQ(*budget, 9830);  // 0.6 x 16384, rounded down
  // 1e300 x 16384 tokens used to be cast to int64 (undefined); NaN, inf, <= 0 and a product
  // below one token are no budget either.
  for (double fill : {1e300, 1e15, std::numeric_limits<double>::infinity(),
                      std::numeric_limits<double>::quiet_NaN(), 0.0, -0.5, 1e-9}) {
    SCOPED_TRACE(fill);
    absl::Status status = StepTokenBudget(fill, 2, 2, 4096).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(status.message().rfind("fill: ", 0), 0u) << status;
  }
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
