// What every rank derives alike without talking: the batch of a step is a pure function of the
// spec and the step (so a restarted rank regenerates it), fits the token budget, respects the
// length range and has ids unique across steps.
#include "worker/step_inputs.h"

#include <set>

#include "gtest/gtest.h"

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

}  // namespace
}  // namespace sparsebalance
