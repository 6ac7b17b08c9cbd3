// Durability: a registry restored from its state directory serves the same plans, counts the
// reports it acknowledged, and continues the job.
#include "server/plan_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "planner/planner.h"
#include "planner/traces.h"
#include "server/job_registry.h"
#include "tests/server/test_support.h"

namespace sparsebalance {
namespace {

using test_support::CountingHex;

std::vector<Sample> Batch(uint64_t seed, int ranks) {
  return test_support::PretrainBatch(seed, ranks);
}
std::vector<MicroBatchTiming> Measure(const StepPlan& plan, int rank) {
  return test_support::TimingsOf(plan.ranks[rank].micro_batches, 1.2);
}

std::string TempDir() {
  std::string pattern = ::testing::TempDir() + "plan_store_XXXXXX";
  char* dir = mkdtemp(pattern.data());
  EXPECT_NE(dir, nullptr);
  return std::string(dir) + "/state";
}

int CountFiles(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

TEST(PlanStoreTest, ARestoredRegistryServesTheSamePlansAndContinues) {
  const std::string dir = TempDir();
  absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir, false);
  ASSERT_TRUE(store.ok()) << store.status();
  JobRegistry::Options options;
  options.store = store->get();
  constexpr int kRanks = 3;
  std::string id;
  std::string token;
  std::vector<std::string> plans;
  std::vector<std::vector<Sample>> batches;
  JobView before;
  {
    JobRegistry registry(options, CountingHex());
    absl::StatusOr<CreatedJob> job =
        registry.CreateJob("durable", test_support::SmallJob(kRanks, 8), "");
    ASSERT_TRUE(job.ok()) << job.status();
    id = job->job_id;
    token = job->job_token;
    for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(registry.JoinJob(id, r).ok());
    for (int step = 0; step < 3; ++step) {
      batches.push_back(Batch(10 + step, kRanks));
      absl::StatusOr<SubmitResult> result = registry.SubmitBatch(id, step, batches.back());
      ASSERT_TRUE(result.ok()) << result.status();
      plans.push_back(CanonicalPlanText(result->plan));
      // Steps 0 and 1 fully reported (folded into the model), step 2 by rank 0 only.
      const int reporters = step < 2 ? kRanks : 1;
      for (int r = 0; r < reporters; ++r) {
        ASSERT_TRUE(registry.ReportStep(id, step, r, Measure(result->plan, r), 0.0).ok());
      }
    }
    before = *registry.GetJob(id);
  }  // the planner "dies"

  JobRegistry restored(options, CountingHex());
  ASSERT_TRUE(restored.Restore().ok());
  EXPECT_TRUE(restored.Authorize(id, token).ok());
  absl::StatusOr<JobView> after = restored.GetJob(id);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->next_step, 3);
  EXPECT_EQ(after->joined_ranks, kRanks);
  EXPECT_EQ(after->speed_factors, before.speed_factors);
  EXPECT_EQ(after->coefficients.per_token, before.coefficients.per_token);
  for (int step = 0; step < 3; ++step) {
    bool ready = false;
    absl::StatusOr<std::shared_ptr<const StepPlan>> plan = restored.GetPlan(id, step, 0, &ready);
    ASSERT_TRUE(plan.ok() && ready);
    EXPECT_EQ(CanonicalPlanText(**plan), plans[step]) << "step " << step;
    // Resubmitting the same batch is recognised as the planned one.
    EXPECT_TRUE(restored.SubmitBatch(id, step, batches[step])->repeated);
  }
  // Rank 0's acknowledged report of step 2 is still there; the others complete the step.
  bool ready = false;
  const StepPlan step2 = **restored.GetPlan(id, 2, 0, &ready);
  EXPECT_TRUE(*restored.ReportStep(id, 2, 0, Measure(step2, 0), 0.0));  // a repeat
  for (int r = 1; r < kRanks; ++r) {
    EXPECT_FALSE(*restored.ReportStep(id, 2, r, Measure(step2, r), 0.0));
  }
  EXPECT_NE(restored.GetJob(id)->coefficients.per_token, before.coefficients.per_token);
  // And the job goes on.
  EXPECT_TRUE(restored.SubmitBatch(id, 3, Batch(20, kRanks)).ok());
}

// A fold writes no snapshot (the next SubmitBatch's carries it): a planner that dies after a
// step's last report but before the next submit refolds the step from its report log.
TEST(PlanStoreTest, AStepFoldedAfterTheLastSnapshotIsRefoldedOnRestore) {
  const std::string dir = TempDir();
  absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir, false);
  ASSERT_TRUE(store.ok()) << store.status();
  JobRegistry::Options options;
  options.store = store->get();
  constexpr int kRanks = 3;
  std::string id;
  JobView before;
  {
    JobRegistry registry(options, CountingHex());
    absl::StatusOr<CreatedJob> job =
        registry.CreateJob("refold", test_support::SmallJob(kRanks, 8), "");
    ASSERT_TRUE(job.ok());
    id = job->job_id;
    for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(registry.JoinJob(id, r).ok());
    for (int step = 0; step < 2; ++step) {
      absl::StatusOr<SubmitResult> result =
          registry.SubmitBatch(id, step, Batch(30 + step, kRanks));
      ASSERT_TRUE(result.ok());
      for (int r = 0; r < kRanks; ++r) {
        ASSERT_TRUE(registry.ReportStep(id, step, r, Measure(result->plan, r), 0.0).ok());
      }
    }
    before = *registry.GetJob(id);
    ASSERT_EQ(before.steps_folded, 2);  // step 1 folded after the last snapshot
  }
  JobRegistry restored(options, CountingHex());
  ASSERT_TRUE(restored.Restore().ok());
  const JobView after = *restored.GetJob(id);
  EXPECT_EQ(after.steps_folded, 2);
  EXPECT_EQ(after.coefficients.per_block, before.coefficients.per_block);
  EXPECT_EQ(after.coefficients.per_token, before.coefficients.per_token);
  EXPECT_EQ(after.speed_factors, before.speed_factors);
}

TEST(PlanStoreTest, ATornReportIsDroppedAndHistoryAndDeleteRemoveFiles) {
  const std::string dir = TempDir();
  absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir, true);
  ASSERT_TRUE(store.ok());
  JobRegistry::Options options;
  options.store = store->get();
  JobRegistry registry(options, CountingHex());
  const std::string id = registry.CreateJob("torn", test_support::SmallJob(2, 2), "")->job_id;
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(registry.JoinJob(id, r).ok());
  absl::StatusOr<SubmitResult> s0 = registry.SubmitBatch(id, 0, Batch(1, 2));
  ASSERT_TRUE(s0.ok());
  ASSERT_TRUE(registry.ReportStep(id, 0, 0, Measure(s0->plan, 0), 0.0).ok());
  // A crash in the middle of the next append leaves half a record.
  const std::string log = dir + "/" + id + "/step-0.reports";
  const int fd = open(log.c_str(), O_WRONLY | O_APPEND);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, "\x40\x00\x00\x00\x01\x02", 6), 6);
  close(fd);
  JobRegistry restored(options, CountingHex());
  ASSERT_TRUE(restored.Restore().ok());
  EXPECT_TRUE(*restored.ReportStep(id, 0, 0, Measure(s0->plan, 0), 0.0));   // kept
  EXPECT_FALSE(*restored.ReportStep(id, 0, 1, Measure(s0->plan, 1), 0.0));  // not torn in
  // History of 2: step 0's files go when step 2 is planned.
  ASSERT_TRUE(restored.SubmitBatch(id, 1, Batch(2, 2)).ok());
  ASSERT_TRUE(restored.SubmitBatch(id, 2, Batch(3, 2)).ok());
  EXPECT_NE(access((dir + "/" + id + "/step-0.pb").c_str(), F_OK), 0);
  EXPECT_EQ(access((dir + "/" + id + "/step-2.pb").c_str(), F_OK), 0);
  ASSERT_TRUE(restored.DeleteJob(id).ok());
  EXPECT_EQ(CountFiles(dir), 0);
}

}  // namespace
}  // namespace sparsebalance
