#include "server/job_registry.h"

#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/planner.h"
#include "planner/traces.h"
#include "server/plan_store.h"
#include "tests/server/test_support.h"
#include "tests/support/scratch_dir.h"

namespace sparsebalance {
namespace {

using test_support::CountingHex;

std::vector<Sample> Batch(uint64_t seed, int ranks) {
  return test_support::PretrainBatch(seed, ranks, /*fill=*/0.7);
}
// Measured times: the plan's predictions times 1.1.
std::vector<MicroBatchTiming> Measure(const StepPlan& plan, int rank) {
  return test_support::TimingsOf(plan.ranks[rank].micro_batches, 1.1);
}

using ::testing::HasSubstr;

bool Exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

class JobRegistryTest : public ::testing::Test {
 protected:
  JobRegistryTest() : registry_(JobRegistry::Options{}, CountingHex()) {}
  std::string Create(int ranks, int history = 8) {
    absl::StatusOr<CreatedJob> job =
        registry_.CreateJob("test", test_support::SmallJob(ranks, history), "");
    EXPECT_TRUE(job.ok()) << job.status();
    tokens_[job->job_id] = job->job_token;
    return job->job_id;
  }
  void JoinAll(const std::string& id, int ranks) {
    for (int r = 0; r < ranks; ++r) ASSERT_TRUE(registry_.JoinJob(id, r).ok());
  }
  JobRegistry registry_;
  std::map<std::string, std::string> tokens_;
};

TEST_F(JobRegistryTest, TokensAuthorizeTheirOwnJobOnly) {
  const std::string a = Create(2);
  const std::string b = Create(2);
  EXPECT_TRUE(registry_.Authorize(a, tokens_[a]).ok());
  EXPECT_EQ(registry_.Authorize(a, tokens_[b]).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(registry_.Authorize(a, "").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(registry_.Authorize("nope", tokens_[a]).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tokens_[a].size(), 64u);
  EXPECT_NE(tokens_[a], tokens_[b]);
}

TEST_F(JobRegistryTest, StepsArePlannedInOrderAndRepeatsAreIdempotent) {
  const std::string id = Create(4);
  const std::vector<Sample> b0 = Batch(1, 4);
  absl::StatusOr<SubmitResult> first = registry_.SubmitBatch(id, 0, b0);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->repeated);
  ASSERT_TRUE(CheckPlan(*first->plan, b0, test_support::SmallJob(4).planner).ok());
  // The same batch again: the same answer, nothing planned anew.
  absl::StatusOr<SubmitResult> again = registry_.SubmitBatch(id, 0, b0);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->repeated);
  EXPECT_EQ(CanonicalPlanText(*again->plan), CanonicalPlanText(*first->plan));
  // A different batch for a planned step.
  std::vector<Sample> other = b0;
  other.pop_back();
  EXPECT_EQ(registry_.SubmitBatch(id, 0, other).status().code(), absl::StatusCode::kAlreadyExists);
  // Out of order, negative.
  absl::Status skip = registry_.SubmitBatch(id, 2, b0).status();
  EXPECT_EQ(skip.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(skip.message()), HasSubstr("plans step 1 next"));
  EXPECT_EQ(registry_.SubmitBatch(id, -1, b0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_.GetJob(id)->next_step, 1);
}

TEST_F(JobRegistryTest, ARejectedBatchChangesNothing) {
  const std::string id = Create(2);
  std::vector<Sample> bad = Batch(2, 2);
  bad[3].sensitivity = 7.0;
  absl::Status status = registry_.SubmitBatch(id, 0, bad).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("samples[3].sensitivity"));
  EXPECT_EQ(registry_.GetJob(id)->next_step, 0);
  EXPECT_TRUE(registry_.SubmitBatch(id, 0, Batch(2, 2)).ok());
}

// The registry is where a batch meets the job's config (the service only converts it): the
// check comes before anything else, so a repeat of a planned step with an invalid batch is
// INVALID_ARGUMENT (not ALREADY_EXISTS), and a batch over the capacity of the config the job
// has now is refused after UpdateJobConfig changed it.
TEST_F(JobRegistryTest, BatchesAreCheckedAgainstTheJobsCurrentConfigFirst) {
  const std::string id = Create(2);
  ASSERT_TRUE(registry_.SubmitBatch(id, 0, Batch(2, 2)).ok());
  std::vector<Sample> repeat = Batch(2, 2);
  repeat[1].id = repeat[0].id;
  absl::Status status = registry_.SubmitBatch(id, 0, repeat).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("samples[1].id"));
  std::vector<Sample> far = Batch(3, 2);
  far[0].length = 0;
  status = registry_.SubmitBatch(id, 9, far).status();  // out of order, and invalid
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("samples[0].length"));

  // Overflowing the steps' capacity: deferred under `defer`, refused once `error` is set.
  JobSettings update = test_support::SmallJob(2);
  update.planner.overflow = OverflowPolicy::kDefer;
  ASSERT_TRUE(registry_.UpdateJobConfig(id, update, {"overflow"}).ok());
  std::vector<Sample> big = Batch(4, 2);
  for (const Sample& s : Batch(5, 2)) big.push_back({s.id + 1000000, s.length, 0.0, 0, {}});
  absl::StatusOr<SubmitResult> deferred = registry_.SubmitBatch(id, 1, big);
  ASSERT_TRUE(deferred.ok()) << deferred.status();
  EXPECT_FALSE(deferred->deferred_ids.empty());
  update.planner.overflow = OverflowPolicy::kError;
  ASSERT_TRUE(registry_.UpdateJobConfig(id, update, {"overflow"}).ok());
  status = registry_.SubmitBatch(id, 2, big).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("micro_batch_capacity"));
}

TEST_F(JobRegistryTest, GetPlanWaitsForTheStepAndServesEachRank) {
  const std::string id = Create(3);
  bool ready = true;
  ASSERT_TRUE(registry_.GetPlan(id, 0, 1, &ready).ok());
  EXPECT_FALSE(ready);
  const std::vector<Sample> batch = Batch(3, 3);
  ASSERT_TRUE(registry_.SubmitBatch(id, 0, batch).ok());
  absl::StatusOr<std::shared_ptr<const StepPlan>> plan = registry_.GetPlan(id, 0, 1, &ready);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(ready);
  EXPECT_TRUE(CheckPlan(**plan, batch, test_support::SmallJob(3).planner).ok());
  EXPECT_EQ(registry_.GetPlan(id, 0, 3, &ready).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(JobRegistryTest, ReportsAreAcceptedOnceAndFoldedWhenEveryRankReported) {
  const std::string id = Create(3);
  const std::vector<Sample> batch = Batch(4, 3);
  absl::StatusOr<SubmitResult> step = registry_.SubmitBatch(id, 0, batch);
  ASSERT_TRUE(step.ok());
  // Not joined yet.
  EXPECT_EQ(registry_.ReportStep(id, 0, 0, Measure(*step->plan, 0), 0.5).status().code(),
            absl::StatusCode::kFailedPrecondition);
  JoinAll(id, 3);
  // Not planned.
  EXPECT_EQ(registry_.ReportStep(id, 1, 0, Measure(*step->plan, 0), 0.5).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const double per_token_before = registry_.GetJob(id)->coefficients.per_token;
  for (int r = 0; r < 3; ++r) {
    absl::StatusOr<bool> duplicate = registry_.ReportStep(id, 0, r, Measure(*step->plan, r), 0.1);
    ASSERT_TRUE(duplicate.ok()) << duplicate.status();
    EXPECT_FALSE(*duplicate);
    if (r < 2) {  // nothing is folded before the last rank has reported
      EXPECT_EQ(registry_.GetJob(id)->coefficients.per_token, per_token_before);
    }
  }
  // Folded once, after the last rank: the model saw everything 10% slower than predicted.
  const JobView view = *registry_.GetJob(id);
  EXPECT_NE(view.coefficients.per_token, per_token_before);
  absl::StatusOr<bool> repeat = registry_.ReportStep(id, 0, 1, Measure(*step->plan, 1), 0.1);
  ASSERT_TRUE(repeat.ok());
  EXPECT_TRUE(*repeat);
  EXPECT_EQ(registry_.GetJob(id)->coefficients.per_token, view.coefficients.per_token);
}

// A trainer that ran steps on its local fallback plans while the planner was away: the planner
// records those plans (identical to what the ranks computed), skips the steps whose batches
// were lost, and keeps the two kinds of plan apart within a step.
TEST_F(JobRegistryTest, LocallyPlannedStepsAreRecordedAsTheTrainerRanThem) {
  const std::string id = Create(2);
  JoinAll(id, 2);
  const JobSettings settings = test_support::SmallJob(2);
  ASSERT_TRUE(registry_.SubmitBatch(id, 0, Batch(1, 2)).ok());
  // Out of order without the flag; with it, steps 1 and 2 are skipped.
  EXPECT_EQ(registry_.SubmitBatch(id, 3, Batch(4, 2)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<SubmitResult> local = registry_.SubmitBatch(id, 3, Batch(4, 2), true);
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(local->skipped_steps, 2);
  EXPECT_TRUE(local->plan->planned_locally);
  absl::StatusOr<StepPlan> expected = PlanStepLocally(Batch(4, 2), settings.planner);
  ASSERT_TRUE(expected.ok());
  EXPECT_EQ(CanonicalPlanText(*local->plan), CanonicalPlanText(*expected));
  EXPECT_EQ(registry_.GetJob(id)->next_step, 4);
  // Reports against the local plan fit it and are folded; a planner's-plan report does not.
  EXPECT_EQ(registry_.ReportStep(id, 3, 0, Measure(*local->plan, 0), 0.0, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(registry_.ReportStep(id, 3, r, Measure(*local->plan, r), 0.0, true).ok());
  }
  // Step 4 was planned by the planner, but the ranks ran their local plan: the first local
  // report switches the record (no report yet), and a later planner's-plan report is refused.
  absl::StatusOr<SubmitResult> planned = registry_.SubmitBatch(id, 4, Batch(5, 2));
  ASSERT_TRUE(planned.ok());
  EXPECT_FALSE(planned->plan->planned_locally);
  absl::StatusOr<StepPlan> local4 = PlanStepLocally(Batch(5, 2), settings.planner);
  ASSERT_TRUE(local4.ok());
  ASSERT_TRUE(registry_.ReportStep(id, 4, 1, Measure(*local4, 1), 0.0, true).ok());
  bool ready = false;
  absl::StatusOr<std::shared_ptr<const StepPlan>> served = registry_.GetPlan(id, 4, 0, &ready);
  ASSERT_TRUE(served.ok() && ready);
  EXPECT_EQ(CanonicalPlanText(**served), CanonicalPlanText(*local4));
  EXPECT_EQ(registry_.ReportStep(id, 4, 0, Measure(*planned->plan, 0), 0.0, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(registry_.ReportStep(id, 4, 0, Measure(*local4, 0), 0.0, true).ok());
  EXPECT_EQ(registry_.GetJob(id)->steps_folded, 2);
  // A step with reports against one plan cannot be switched by a resubmission.
  absl::StatusOr<SubmitResult> step5 = registry_.SubmitBatch(id, 5, Batch(6, 2));
  ASSERT_TRUE(step5.ok());
  ASSERT_TRUE(registry_.ReportStep(id, 5, 0, Measure(*step5->plan, 0), 0.0).ok());
  EXPECT_EQ(registry_.SubmitBatch(id, 5, Batch(6, 2), true).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(JobRegistryTest, BadReportsNameTheFieldAndLeaveTheRankUnreported) {
  const std::string id = Create(2);
  JoinAll(id, 2);
  absl::StatusOr<SubmitResult> step = registry_.SubmitBatch(id, 0, Batch(5, 2));
  ASSERT_TRUE(step.ok());
  const std::vector<MicroBatchTiming> good = Measure(*step->plan, 0);
  ASSERT_FALSE(good.empty());
  struct Case {
    void (*mutate)(std::vector<MicroBatchTiming>*);
    const char* field;
  };
  const std::vector<Case> cases = {
      {[](auto* m) { (*m)[0].compute_seconds = 0.0; }, "micro_batches[0].compute_seconds"},
      {[](auto* m) { (*m)[0].compute_seconds = -1.0; }, "micro_batches[0].compute_seconds"},
      {[](auto* m) { (*m)[0].compute_seconds = std::nan(""); }, "micro_batches[0].compute_seconds"},
      {[](auto* m) { (*m)[0].attention_seconds = 1e9; }, "micro_batches[0].attention_seconds"},
      {[](auto* m) { (*m)[0].recall = 1.5; }, "micro_batches[0].recall"},
      {[](auto* m) { (*m)[0].achieved_density = -0.1; }, "micro_batches[0].achieved_density"},
      {[](auto* m) { (*m)[0].micro_batch = 9; }, "micro_batches[0].micro_batch"},
      {[](auto* m) { (*m)[0].tokens += 1; }, "micro_batches[0].tokens"},
      {[](auto* m) { m->push_back((*m)[0]); }, ".micro_batch"},
  };
  for (const Case& c : cases) {
    std::vector<MicroBatchTiming> bad = good;
    c.mutate(&bad);
    absl::Status status = registry_.ReportStep(id, 0, 0, bad, 0.0).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.field));
  }
  EXPECT_EQ(registry_.ReportStep(id, 0, 0, good, -1.0).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The rank was not marked reported by any of those.
  absl::StatusOr<bool> ok = registry_.ReportStep(id, 0, 0, good, 0.0);
  ASSERT_TRUE(ok.ok());
  EXPECT_FALSE(*ok);
}

// Context parallelism: an exchange time is part of compute_seconds, and only a micro-batch
// that holds a shard exchanged anything. A report for a shard that was not planned is refused
// whole; what was accepted before stays.
TEST_F(JobRegistryTest, ExchangeTimesOutsideShardsAreRefusedAndAcceptedReportsStay) {
  const std::string id = Create(2);
  JoinAll(id, 2);
  absl::StatusOr<SubmitResult> step = registry_.SubmitBatch(id, 0, Batch(5, 2));
  ASSERT_TRUE(step.ok());
  ASSERT_TRUE(registry_.ReportStep(id, 0, 1, Measure(*step->plan, 1), 0.0).ok());
  const std::vector<MicroBatchTiming> good = Measure(*step->plan, 0);
  ASSERT_FALSE(good.empty());
  struct Case {
    void (*mutate)(std::vector<MicroBatchTiming>*);
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](auto* m) { m->back().exchange_seconds = 0.001; },
       ".exchange_seconds: 0.001 is a report for a shard that was not planned"},
      {[](auto* m) { (*m)[0].exchange_seconds = -0.5; },
       "micro_batches[0].exchange_seconds: -0.5 is not in [0, compute_seconds"},
      {[](auto* m) { (*m)[0].exchange_seconds = std::nan(""); },
       "micro_batches[0].exchange_seconds: nan"},
      {[](auto* m) { (*m)[0].exchange_seconds = (*m)[0].compute_seconds; },
       "micro_batches[0].exchange_seconds"},
  };
  for (const Case& c : cases) {
    std::vector<MicroBatchTiming> bad = good;
    c.mutate(&bad);
    const absl::Status status = registry_.ReportStep(id, 0, 0, bad, 0.0).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
  }
  // Nothing folded; rank 1's report is still the acknowledged one (a repeat), rank 0 is still
  // unreported, and its good report completes the step.
  EXPECT_EQ(registry_.GetJob(id)->steps_folded, 0);
  absl::StatusOr<bool> repeat = registry_.ReportStep(id, 0, 1, Measure(*step->plan, 1), 0.0);
  ASSERT_TRUE(repeat.ok());
  EXPECT_TRUE(*repeat);
  absl::StatusOr<bool> fresh = registry_.ReportStep(id, 0, 0, good, 0.0);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_FALSE(*fresh);
  EXPECT_EQ(registry_.GetJob(id)->steps_folded, 1);
  // A repeat that differs only in its exchange time is not the acknowledged report.
  std::vector<MicroBatchTiming> differs = good;
  differs[0].exchange_seconds = 0.001;
  const absl::Status again = registry_.ReportStep(id, 0, 0, differs, 0.0).status();
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(again.message()), HasSubstr("micro_batches[0].exchange_seconds"));
}

TEST_F(JobRegistryTest, ShardSettingsChangeAtRunTimeWithinTheWorldSize) {
  const std::string id = Create(4);
  // The prior exchange rate until workers report exchanges.
  EXPECT_DOUBLE_EQ(registry_.GetJob(id)->exchange_bytes_per_second,
                   1.0 / kDefaultExchangeSecondsPerByte);
  JobSettings update = test_support::SmallJob(4);
  update.planner.max_shards = 4;
  update.planner.shard_policy = ShardPolicy::kStatic;
  update.planner.shard_min_length = 16384;
  absl::StatusOr<JobSettings> now =
      registry_.UpdateJobConfig(id, update, {"max_shards", "shard_policy", "shard_min_length"});
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(registry_.GetJob(id)->settings.planner.max_shards, 4);
  EXPECT_EQ(registry_.GetJob(id)->settings.planner.shard_policy, ShardPolicy::kStatic);
  EXPECT_EQ(registry_.GetJob(id)->settings.planner.shard_min_length, 16384);
  update.planner.max_shards = 5;  // above the world size: refused, nothing changes
  const absl::Status bad = registry_.UpdateJobConfig(id, update, {"max_shards"}).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("config.max_shards = 5"));
  EXPECT_EQ(registry_.GetJob(id)->settings.planner.max_shards, 4);
  // And at creation.
  JobSettings wide = test_support::SmallJob(2);
  wide.planner.max_shards = 3;
  const absl::Status create = registry_.CreateJob("wide", wide, "").status();
  EXPECT_EQ(create.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(create.message()), HasSubstr("config.max_shards"));
}

// A registry's options over a fresh state directory (dir_), for tests that restart on it.
class JobRegistryRestoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test_support::ScratchDir("restore");
    absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir_, false);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    options.store = store_.get();
  }
  std::string dir_;
  std::unique_ptr<PlanStore> store_;
  JobRegistry::Options options;
};

// UpdateJobConfig may tighten the two settings that bound a batch (max_shards, overflow) after a
// step that needed the looser ones was planned. The step stays what it was: its repeat gets the
// same answer, and a restart restores the job (it was quarantined: its batch was checked against
// the config as it is now).
TEST_F(JobRegistryRestoreTest, StepsPlannedBeforeMaxShardsOrOverflowWereTightenedStay) {
  JobRegistry registry(options, CountingHex());
  JobSettings settings = test_support::SmallJob(4);
  settings.planner.max_shards = 4;
  settings.planner.overflow = OverflowPolicy::kDefer;
  absl::StatusOr<CreatedJob> job = registry.CreateJob("tightened", settings, "");
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string& id = job->job_id;
  // Step 0 splits a document longer than the capacity (65,536); step 1 overflows and defers.
  std::vector<Sample> split = Batch(1, 4);
  split.push_back({split.back().id + 1, 100000, 0.0, 0, {}});
  std::vector<Sample> overfull = test_support::PretrainBatch(2, 4, /*fill=*/0.95);
  for (const Sample& s : test_support::PretrainBatch(3, 4, 0.5)) {
    overfull.push_back({s.id + 1000000, s.length, 0.0, 0, {}});
  }
  absl::StatusOr<SubmitResult> step0 = registry.SubmitBatch(id, 0, split);
  ASSERT_TRUE(step0.ok()) << step0.status();
  bool any_shard = false;
  for (const RankPlan& rank : step0->plan->ranks) {
    for (const MicroBatchPlan& mb : rank.micro_batches) {
      for (const PlannedSample& p : mb.samples) any_shard = any_shard || p.sharded();
    }
  }
  ASSERT_TRUE(any_shard);
  absl::StatusOr<SubmitResult> step1 = registry.SubmitBatch(id, 1, overfull);
  ASSERT_TRUE(step1.ok()) << step1.status();
  ASSERT_FALSE(step1->deferred_ids.empty());
  const std::string plan0 = CanonicalPlanText(*step0->plan);
  const std::string plan1 = CanonicalPlanText(*step1->plan);

  settings.planner.max_shards = 1;
  settings.planner.overflow = OverflowPolicy::kError;
  ASSERT_TRUE(registry.UpdateJobConfig(id, settings, {"max_shards", "overflow"}).ok());
  // New steps are checked against the config as it is now.
  absl::Status now = registry.SubmitBatch(id, 2, split).status();
  EXPECT_EQ(now.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(now.message()), HasSubstr("exceeds micro_batch_capacity"));
  // Repeats of the steps planned before: the same answers.
  for (const auto& [step, batch, text] :
       {std::make_tuple(0, &split, &plan0), std::make_tuple(1, &overfull, &plan1)}) {
    absl::StatusOr<SubmitResult> again = registry.SubmitBatch(id, step, *batch);
    ASSERT_TRUE(again.ok()) << "step " << step << ": " << again.status();
    EXPECT_TRUE(again->repeated);
    EXPECT_EQ(CanonicalPlanText(*again->plan), *text);
  }
  // A restart serves the job and both steps as they were planned.
  JobRegistry restarted(options, CountingHex());
  ASSERT_TRUE(restarted.Restore().ok());
  absl::StatusOr<JobView> view = restarted.GetJob(id);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->next_step, 2);
  EXPECT_EQ(view->settings.planner.max_shards, 1);
  for (const auto& [step, text] : {std::make_pair(0, &plan0), std::make_pair(1, &plan1)}) {
    bool ready = false;
    absl::StatusOr<std::shared_ptr<const StepPlan>> plan = restarted.GetPlan(id, step, 0, &ready);
    ASSERT_TRUE(plan.ok()) << "step " << step << ": " << plan.status();
    ASSERT_TRUE(ready);
    EXPECT_EQ(CanonicalPlanText(**plan), *text);
  }
}

// A step whose last report landed but whose fold no snapshot holds yet (a crash came before the
// next submit's snapshot) is folded at restart from its report log, also when it is beyond the
// job's history there: it was trimmed first, its files dropped, its fold lost for good. Its files
// go once a snapshot holds the fold, and a second restart folds nothing twice.
TEST_F(JobRegistryRestoreTest, AStepBeyondTheHistoryIsFoldedBeforeItsFilesGo) {
  std::string id;
  {
    JobRegistry registry(options, CountingHex());
    absl::StatusOr<CreatedJob> job = registry.CreateJob("refold", test_support::SmallJob(2), "");
    ASSERT_TRUE(job.ok()) << job.status();
    id = job->job_id;
    absl::StatusOr<SubmitResult> step0 = registry.SubmitBatch(id, 0, Batch(1, 2));
    ASSERT_TRUE(step0.ok()) << step0.status();
    ASSERT_TRUE(registry.SubmitBatch(id, 1, Batch(2, 2)).ok());
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(registry.JoinJob(id, r).ok());
    for (int r = 0; r < 2; ++r) {
      absl::StatusOr<bool> reported = registry.ReportStep(id, 0, r, Measure(*step0->plan, r), 0.0);
      ASSERT_TRUE(reported.ok()) << reported.status();
    }
    EXPECT_EQ(registry.GetJob(id)->steps_folded, 1);
  }  // the process ends before a snapshot holds step 0's fold
  // The snapshot as that process left it, with a history of one step (as UpdateJobConfig may
  // have made it, or a record written just before a crash may leave one step too many).
  absl::StatusOr<PlanStore::Loaded> loaded = store_->LoadAll();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->jobs.size(), 1u);
  StoredJob snapshot = loaded->jobs[0].job;
  EXPECT_TRUE(snapshot.folded_steps.empty());
  snapshot.settings.history_steps = 1;
  ASSERT_TRUE(store_->SaveJob(snapshot).ok());

  for (int restart = 0; restart < 2; ++restart) {
    JobRegistry restarted(options, CountingHex());
    ASSERT_TRUE(restarted.Restore().ok());
    absl::StatusOr<JobView> view = restarted.GetJob(id);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->steps_folded, 1) << "restart " << restart;
    EXPECT_FALSE(Exists(dir_ + "/" + id + "/step-0.reports")) << "restart " << restart;
    EXPECT_TRUE(Exists(dir_ + "/" + id + "/step-1.pb")) << "restart " << restart;
  }
}

// Measured times plus a recall for every document of the rank's plan, as if each document's
// true curve were 1 - (1 - rho)^g.
std::vector<MicroBatchTiming> MeasureWithRecall(const StepPlan& plan, int rank, double g) {
  std::vector<MicroBatchTiming> out = Measure(plan, rank);
  test_support::AddDocumentRecalls(
      plan, rank, [g](const PlannedSample& p, size_t) { return RecallAt(g, p.density); }, &out);
  for (MicroBatchTiming& m : out) m.recall_seconds = 0.01 * m.attention_seconds;
  return out;
}

TEST_F(JobRegistryTest, MeasuredRecallTeachesTheJobsRecallCurves) {
  const std::string id = Create(2);
  JoinAll(id, 2);
  EXPECT_TRUE(registry_.GetJob(id)->recall_curves.size() >= static_cast<size_t>(kRecallBuckets));
  for (int64_t s = 0; s < 6; ++s) {
    absl::StatusOr<SubmitResult> step = registry_.SubmitBatch(id, s, Batch(10 + s, 2));
    ASSERT_TRUE(step.ok()) << step.status();
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(registry_.ReportStep(id, s, r, MeasureWithRecall(*step->plan, r, 2.0), 0).ok());
    }
  }
  const JobView view = *registry_.GetJob(id);
  double measured = 0.0;
  for (const RecallCurveSummary& c : view.recall_curves) {
    if (c.layer.has_value() || c.documents == 0) continue;
    measured += c.documents;
    // The prior for sensitivity 0 is g = 6 (worth 16 documents); measurements say 2.
    EXPECT_LT(c.exponent, 6.0 - 4.0 * c.documents / (c.documents + 16.0) + 0.01)
        << "bucket " << c.bucket;
    EXPECT_GT(c.measured_recall, 0.0);
  }
  EXPECT_GT(measured, 0.0);
  // The plans now carry the learned curve's recall per bucket.
  absl::StatusOr<SubmitResult> next = registry_.SubmitBatch(id, 6, Batch(20, 2));
  ASSERT_TRUE(next.ok());
  ASSERT_FALSE(next->plan->buckets.empty());
  for (const BucketRecallFigures& b : next->plan->buckets) {
    EXPECT_LT(b.default_recall, PredictedRecall(0.0, 0.3) - 0.01) << b.label;
  }
}

// Workers that measure every layer (sb-worker's probe) teach the job one curve per layer and
// bucket: the fold adds each document's layers' recalls at the densities the plan gave those
// layers, and the job's next plans spread each sample's density over the layers (their mean the
// sample's), unevenly where the layers' curves differ.
TEST_F(JobRegistryTest, PerLayerRecallsTeachLayerCurvesAndPlansSplitDensityOverLayers) {
  const std::string id = Create(2);
  JoinAll(id, 2);
  const int layers = test_support::SmallJob(2).planner.shape.layers;
  ASSERT_GE(layers, 2);
  std::vector<std::string> planned;  // each step's plan as SubmitBatch gave it
  for (int64_t s = 0; s < 6; ++s) {
    absl::StatusOr<SubmitResult> step = registry_.SubmitBatch(id, s, Batch(30 + s, 2));
    ASSERT_TRUE(step.ok()) << step.status();
    planned.push_back(CanonicalPlanText(*step->plan));
    for (int r = 0; r < 2; ++r) {
      std::vector<MicroBatchTiming> report = MeasureWithRecall(*step->plan, r, 3.0);
      test_support::AddLayerRecalls(
          *step->plan, r, layers,
          [](const PlannedSample&, const DocumentRecallMeasurement&, int l, double rho) {
            return RecallAt(l % 2 == 0 ? 1.5 : 8.0, rho);  // odd layers: tolerant
          },
          &report);
      for (MicroBatchTiming& m : report) {
        for (DocumentRecallMeasurement& d : m.documents) {  // all layers: their mean
          d.recall = 0.0;
          for (double layer : d.layer_recall) d.recall += layer / layers;
        }
      }
      ASSERT_TRUE(registry_.ReportStep(id, s, r, report, 0).ok());
    }
  }
  const JobView view = *registry_.GetJob(id);
  EXPECT_EQ(view.steps_folded, 6);
  std::set<int> learned;
  for (const RecallCurveSummary& c : view.recall_curves) {
    if (c.layer.has_value() && c.documents > 0) learned.insert(*c.layer);
  }
  EXPECT_EQ(learned.size(), static_cast<size_t>(layers));
  absl::StatusOr<SubmitResult> next = registry_.SubmitBatch(id, 6, Batch(40, 2));
  ASSERT_TRUE(next.ok()) << next.status();
  int split = 0;
  for (const RankPlan& rank : next->plan->ranks) {
    for (const MicroBatchPlan& mb : rank.micro_batches) {
      for (const PlannedSample& p : mb.samples) {
        if (p.layer_densities.empty()) continue;
        ASSERT_EQ(p.layer_densities.size(), static_cast<size_t>(layers));
        double mean = 0.0;
        for (double rho : p.layer_densities) mean += rho / layers;
        EXPECT_NEAR(mean, p.density, 1e-9) << p.id;
        // Layers of different curves get different densities (which gets more depends on the
        // density: LayerDensitiesTest).
        EXPECT_GT(std::fabs(p.layer_densities[0] - p.layer_densities[1]), 1e-3) << p.id;
        ++split;
      }
    }
  }
  EXPECT_GT(split, 0);
  // The older steps were packed without their layer densities (step_pack.h), the model has
  // learned since: each comes back as it was planned, from the recall model of its own time.
  EXPECT_GE(registry_.PackedSteps(id), 4);
  for (int64_t s = 0; s < 6; ++s) {
    bool ready = false;
    absl::StatusOr<std::shared_ptr<const StepPlan>> old = registry_.GetPlan(id, s, 1, &ready);
    ASSERT_TRUE(old.ok() && ready) << old.status();
    EXPECT_EQ(CanonicalPlanText(**old), planned[s]) << "step " << s;
  }
}

// The fold finds a measured document's planned sample whatever order the report lists them
// in, and what it learns does not depend on the order the ranks report in (their measurements
// are summed as each report is taken, exactly: RecallStepSums): ranks reporting 2, 0, 1 with
// their documents reversed teach the same curves, bit for bit, as ranks 0, 1, 2 in plan order,
// all layers and each layer, and the next plans are the same.
TEST_F(JobRegistryTest, ReportsInAnyOrderTeachTheSameCurvesBitForBit) {
  constexpr int kRanks = 3;
  const std::string in_order = Create(kRanks);
  const std::string shuffled = Create(kRanks);
  JoinAll(in_order, kRanks);
  JoinAll(shuffled, kRanks);
  const int layers = test_support::SmallJob(kRanks).planner.shape.layers;
  // Each document's measured recall, all layers and per layer: values that differ from
  // document to document, so that their sums' rounding would depend on their order.
  auto measure = [&](const StepPlan& plan, int rank) {
    std::vector<MicroBatchTiming> report = MeasureWithRecall(plan, rank, 2.0);
    auto wobble = [](const PlannedSample& p, const DocumentRecallMeasurement& d) {
      return 1.0 + 0.1 * std::sin(static_cast<double>(p.id) * 0.7 + d.document);
    };
    test_support::AddLayerRecalls(
        plan, rank, layers,
        [&](const PlannedSample& p, const DocumentRecallMeasurement& d, int l, double rho) {
          return std::min(1.0, RecallAt(1.5 + l, rho) * wobble(p, d));
        },
        &report);
    for (MicroBatchTiming& m : report) {
      const auto& samples = plan.ranks[rank].micro_batches[m.micro_batch].samples;
      for (DocumentRecallMeasurement& d : m.documents) {
        const PlannedSample& p = *std::find_if(samples.begin(), samples.end(),
                                               [&](const auto& q) { return q.id == d.sample_id; });
        d.recall = std::min(1.0, d.recall * wobble(p, d));
      }
    }
    return report;
  };
  for (int64_t s = 0; s < 5; ++s) {
    absl::StatusOr<SubmitResult> a = registry_.SubmitBatch(in_order, s, Batch(30 + s, kRanks));
    absl::StatusOr<SubmitResult> b = registry_.SubmitBatch(shuffled, s, Batch(30 + s, kRanks));
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(CanonicalPlanText(*a->plan), CanonicalPlanText(*b->plan)) << "step " << s;
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_TRUE(registry_.ReportStep(in_order, s, r, measure(*a->plan, r), 0).ok());
    }
    for (int r : {2, 0, 1}) {
      std::vector<MicroBatchTiming> report = measure(*b->plan, r);
      for (MicroBatchTiming& m : report) std::reverse(m.documents.begin(), m.documents.end());
      ASSERT_TRUE(registry_.ReportStep(shuffled, s, r, report, 0).ok());
    }
  }
  const JobView want = *registry_.GetJob(in_order);
  const JobView got = *registry_.GetJob(shuffled);
  EXPECT_EQ(want.steps_folded, 5);
  EXPECT_EQ(got.steps_folded, 5);
  ASSERT_EQ(got.recall_curves.size(), want.recall_curves.size());
  double measured = 0.0;
  std::set<int> learned_layers;
  for (size_t k = 0; k < want.recall_curves.size(); ++k) {
    const RecallCurveSummary& w = want.recall_curves[k];
    const RecallCurveSummary& g = got.recall_curves[k];
    EXPECT_EQ(g.layer, w.layer) << k;
    EXPECT_EQ(g.documents, w.documents) << k;
    EXPECT_EQ(g.exponent, w.exponent) << k;
    EXPECT_EQ(g.measured_recall, w.measured_recall) << k;
    EXPECT_EQ(g.measured_density, w.measured_density) << k;
    measured += w.documents;
    if (w.layer.has_value()) learned_layers.insert(*w.layer);
  }
  EXPECT_GT(measured, 0.0);
  EXPECT_EQ(learned_layers.size(), static_cast<size_t>(layers));
  absl::StatusOr<SubmitResult> a = registry_.SubmitBatch(in_order, 5, Batch(40, kRanks));
  absl::StatusOr<SubmitResult> b = registry_.SubmitBatch(shuffled, 5, Batch(40, kRanks));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(CanonicalPlanText(*a->plan), CanonicalPlanText(*b->plan));
}

TEST_F(JobRegistryTest, BadDocumentRecallsNameTheFieldAndLeaveTheRankUnreported) {
  const std::string id = Create(2);
  JoinAll(id, 2);
  absl::StatusOr<SubmitResult> step = registry_.SubmitBatch(id, 0, Batch(5, 2));
  ASSERT_TRUE(step.ok());
  const std::vector<MicroBatchTiming> good = MeasureWithRecall(*step->plan, 0, 3.0);
  ASSERT_FALSE(good.empty());
  ASSERT_FALSE(good[0].documents.empty());
  struct Case {
    void (*mutate)(std::vector<MicroBatchTiming>*);
    const char* field;
  };
  const std::vector<Case> cases = {
      {[](auto* m) { (*m)[0].documents[0].sample_id = 999999999; },
       "micro_batches[0].documents[0].sample_id"},
      {[](auto* m) { (*m)[0].documents[0].document = 7; },
       "micro_batches[0].documents[0].document"},
      {[](auto* m) { (*m)[0].documents[0].recall = 1.5; }, "micro_batches[0].documents[0].recall"},
      {[](auto* m) { (*m)[0].documents[0].rows = 0; }, "micro_batches[0].documents[0].rows"},
      {[](auto* m) { (*m)[0].documents[0].layer_recall = {0.5}; },
       "micro_batches[0].documents[0].layer_recall"},
      {[](auto* m) { (*m)[0].documents.push_back((*m)[0].documents[0]); }, "is reported twice"},
      {[](auto* m) { (*m)[0].recall_seconds = -1; }, "micro_batches[0].recall_seconds"},
  };
  for (const Case& c : cases) {
    std::vector<MicroBatchTiming> bad = good;
    c.mutate(&bad);
    absl::Status status = registry_.ReportStep(id, 0, 0, bad, 0.0).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.field));
  }
  absl::StatusOr<bool> ok = registry_.ReportStep(id, 0, 0, good, 0.0);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_FALSE(*ok);
}

// Workers report a micro-batch's documents in planned order, which the registry checks in one
// walk; any other order is checked by looking each document up, and is as valid.
TEST_F(JobRegistryTest, DocumentRecallsInAnyOrderAreCheckedAgainstThePlan) {
  const std::string id = Create(2);
  JoinAll(id, 2);
  absl::StatusOr<SubmitResult> step = registry_.SubmitBatch(id, 0, Batch(5, 2));
  ASSERT_TRUE(step.ok());
  std::vector<MicroBatchTiming> good = MeasureWithRecall(*step->plan, 0, 3.0);
  size_t with_two = good.size();  // a micro-batch with at least two documents
  for (size_t m = 0; m < good.size(); ++m) {
    if (good[m].documents.size() >= 2) with_two = m;
  }
  ASSERT_LT(with_two, good.size());
  const std::string where = absl::StrCat("micro_batches[", with_two, "].documents[1]");
  // A bad last document after good ones in order; the same reversed.
  std::vector<MicroBatchTiming> bad = good;
  bad[with_two].documents[1].document = 9;
  absl::Status status = registry_.ReportStep(id, 0, 0, bad, 0.0).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr(where + ".document: 9 is outside"));
  bad = good;
  bad[with_two].documents[1].sample_id = 999999999;
  std::swap(bad[with_two].documents[0], bad[with_two].documents[1]);
  status = registry_.ReportStep(id, 0, 0, bad, 0.0).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr(absl::StrCat("micro_batches[", with_two,
                                     "].documents[0].sample_id: 999999999 is not planned")));
  // Every micro-batch's documents reversed: accepted.
  for (MicroBatchTiming& m : good) std::reverse(m.documents.begin(), m.documents.end());
  absl::StatusOr<bool> ok = registry_.ReportStep(id, 0, 0, good, 0.0);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_FALSE(*ok);
}

TEST_F(JobRegistryTest, HistoryIsBounded) {
  const std::string id = Create(2, /*history=*/3);
  std::vector<std::vector<Sample>> batches;
  for (int step = 0; step < 6; ++step) {
    batches.push_back(Batch(100 + step, 2));
    ASSERT_TRUE(registry_.SubmitBatch(id, step, batches.back()).ok());
  }
  bool ready = false;
  EXPECT_EQ(registry_.GetPlan(id, 1, 0, &ready).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry_.SubmitBatch(id, 1, batches[1]).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(registry_.GetPlan(id, 3, 0, &ready).ok());
  EXPECT_TRUE(ready);
  EXPECT_TRUE(registry_.SubmitBatch(id, 5, batches[5])->repeated);
}

// Packing leaves SubmitBatch with pack_in_submit false (sb-planner packs after waking the
// ranks): nothing is packed until PackHistory, which packs all but the newest two, and the packed
// steps' plans are served as they were planned. With the default the submits pack.
TEST(JobRegistryPackingTest, PackHistoryPacksWhatSubmitLeft) {
  for (bool in_submit : {true, false}) {
    JobRegistry::Options options;
    options.pack_in_submit = in_submit;
    JobRegistry registry(options, CountingHex());
    absl::StatusOr<CreatedJob> job =
        registry.CreateJob("test", test_support::SmallJob(2, /*history=*/8), "");
    ASSERT_TRUE(job.ok()) << job.status();
    std::vector<std::string> plans;
    for (int step = 0; step < 5; ++step) {
      absl::StatusOr<SubmitResult> result =
          registry.SubmitBatch(job->job_id, step, Batch(300 + step, 2));
      ASSERT_TRUE(result.ok()) << result.status();
      plans.push_back(CanonicalPlanText(*result->plan));
    }
    EXPECT_EQ(registry.PackedSteps(job->job_id), in_submit ? 3 : 0) << in_submit;
    registry.PackHistory(job->job_id);
    EXPECT_EQ(registry.PackedSteps(job->job_id), 3);
    for (int step = 0; step < 5; ++step) {
      bool ready = false;
      absl::StatusOr<std::shared_ptr<const StepPlan>> plan =
          registry.GetPlan(job->job_id, step, 0, &ready);
      ASSERT_TRUE(plan.ok()) << plan.status();
      ASSERT_TRUE(ready);
      EXPECT_EQ(CanonicalPlanText(**plan), plans[step]) << "step " << step;
    }
  }
  JobRegistry registry(JobRegistry::Options{}, CountingHex());
  registry.PackHistory("no-such-job");  // nothing to do, no crash
  EXPECT_EQ(registry.PackedSteps("no-such-job"), 0);
}

// Steps older than the newest two are kept packed (step_pack.h) and unpacked by the calls that
// need them; nothing a caller sees differs from a step kept as values: old plans are served as
// they were planned, late reports are checked, acknowledged once, compared when repeated and
// folded, repeated batches get the stored answer, and a restarted rank learns its first
// unreported step.
TEST_F(JobRegistryTest, OldStepsAreServedAsTheyWerePlanned) {
  const int ranks = 3;
  const std::string id = Create(ranks, /*history=*/8);
  JoinAll(id, ranks);
  std::vector<std::vector<Sample>> batches;
  std::vector<SubmitResult> planned;
  for (int step = 0; step < 6; ++step) {
    batches.push_back(Batch(200 + step, ranks));
    absl::StatusOr<SubmitResult> result = registry_.SubmitBatch(id, step, batches.back());
    ASSERT_TRUE(result.ok()) << result.status();
    planned.push_back(*std::move(result));
    // Every step but 1 fully reported as it goes, step 2 by ranks 0 and 1 only; documents
    // measured, so that folding a late step uses them.
    for (int r = 0; r < ranks; ++r) {
      if (step == 1 || (step == 2 && r == 2)) continue;
      std::vector<MicroBatchTiming> report = Measure(*planned[step].plan, r);
      for (MicroBatchTiming& m : report) {
        const PlannedSample& s =
            planned[step].plan->ranks[r].micro_batches[m.micro_batch].samples[0];
        m.documents.push_back({s.id, 0, 0.95, {}, 4});
      }
      ASSERT_TRUE(registry_.ReportStep(id, step, r, report, 0.2).ok());
    }
  }
  EXPECT_EQ(registry_.GetJob(id)->steps_folded, 4);
  // Every kept step's plan, as SubmitBatch answered it, twice (the second from the unpacked
  // step).
  for (int step = 0; step < 6; ++step) {
    for (int pass = 0; pass < 2; ++pass) {
      bool ready = false;
      absl::StatusOr<std::shared_ptr<const StepPlan>> plan = registry_.GetPlan(id, step, 1, &ready);
      ASSERT_TRUE(plan.ok() && ready) << plan.status();
      EXPECT_EQ(CanonicalPlanText(**plan), CanonicalPlanText(*planned[step].plan)) << step;
    }
  }
  // A restarted rank resumes at its first unreported step: 1 (and 2 for rank 2).
  int64_t next = -1;
  ASSERT_TRUE(registry_.JoinJob(id, 0, &next).ok());
  EXPECT_EQ(next, 1);
  ASSERT_TRUE(registry_.SubmitBatch(id, 6, Batch(206, ranks)).ok());  // packs the old steps
  ASSERT_TRUE(registry_.JoinJob(id, 2, &next).ok());
  EXPECT_EQ(next, 1);
  // Repeated batches of old steps: the stored answer; another batch is ALREADY_EXISTS.
  absl::StatusOr<SubmitResult> again = registry_.SubmitBatch(id, 0, batches[0]);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->repeated);
  EXPECT_EQ(CanonicalPlanText(*again->plan), CanonicalPlanText(*planned[0].plan));
  EXPECT_EQ(again->deferred_ids, planned[0].deferred_ids);
  EXPECT_EQ(registry_.SubmitBatch(id, 3, batches[4]).status().code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(registry_.SubmitBatch(id, 7, Batch(207, ranks)).ok());
  // Repeats of reports of packed, folded steps: the same is a duplicate, another differs.
  absl::StatusOr<bool> repeat = registry_.ReportStep(id, 3, 1, Measure(*planned[3].plan, 1), 0.2);
  ASSERT_TRUE(repeat.ok()) << repeat.status();
  EXPECT_TRUE(*repeat);
  absl::Status differs = registry_.ReportStep(id, 4, 1, Measure(*planned[4].plan, 1), 0.3).status();
  EXPECT_EQ(differs.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(differs.message()), HasSubstr("wait_seconds: 0.3"));
  // Late reports: checked against the old plan, then accepted and folded (step 2 first, as its
  // last rank reports, then step 1).
  std::vector<MicroBatchTiming> wrong = Measure(*planned[2].plan, 2);
  wrong[0].micro_batch = 7;
  EXPECT_EQ(registry_.ReportStep(id, 2, 2, wrong, 0.2).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(registry_.ReportStep(id, 2, 2, Measure(*planned[2].plan, 2), 0.2).ok());
  EXPECT_EQ(registry_.GetJob(id)->steps_folded, 5);
  ASSERT_TRUE(registry_.SubmitBatch(id, 8, Batch(208, ranks)).ok());
  for (int r = 0; r < ranks; ++r) {
    absl::StatusOr<bool> late = registry_.ReportStep(id, 1, r, Measure(*planned[1].plan, r), 0.2);
    ASSERT_TRUE(late.ok()) << late.status();
    EXPECT_FALSE(*late);
  }
  EXPECT_EQ(registry_.GetJob(id)->steps_folded, 6);
  ASSERT_TRUE(registry_.JoinJob(id, 2, &next).ok());
  EXPECT_EQ(next, 6);
}

TEST_F(JobRegistryTest, UpdateJobConfigChangesTunablesOnly) {
  const std::string id = Create(2);
  JobSettings update = test_support::SmallJob(2);
  update.planner.policy = Policy::kTokens;
  update.planner.ranks = 64;
  absl::StatusOr<JobSettings> now = registry_.UpdateJobConfig(id, update, {"policy"});
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->planner.policy, Policy::kTokens);
  EXPECT_EQ(now->planner.ranks, 2);
  EXPECT_EQ(registry_.SubmitBatch(id, 0, Batch(7, 2))->plan->policy, Policy::kTokens);
  absl::Status frozen = registry_.UpdateJobConfig(id, update, {"world_size"}).status();
  EXPECT_EQ(frozen.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(frozen.message()), HasSubstr("world_size"));
  update.planner.density_min = 0.9;  // above the default: invalid, nothing changes
  EXPECT_EQ(registry_.UpdateJobConfig(id, update, {"policy", "density_min"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_.GetJob(id)->settings.planner.density_min,
            test_support::SmallJob(2).planner.density_min);
}

TEST_F(JobRegistryTest, UpdateJobConfigChangesTheSelection) {
  const std::string id = Create(2);
  JobSettings update = test_support::SmallJob(2);
  update.planner.selection = SelectionMode::kAnchor;
  update.planner.anchor_threshold = 0.1;
  absl::StatusOr<JobSettings> now =
      registry_.UpdateJobConfig(id, update, {"selection", "anchor_threshold"});
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->planner.selection, SelectionMode::kAnchor);
  EXPECT_EQ(registry_.GetJob(id)->settings.planner.anchor_threshold, 0.1);
  update.planner.anchor_threshold = 0.0;  // outside (0, 1]: refused, nothing changes
  absl::Status bad = registry_.UpdateJobConfig(id, update, {"anchor_threshold"}).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("anchor_threshold"));
  EXPECT_EQ(registry_.GetJob(id)->settings.planner.anchor_threshold, 0.1);
}

TEST_F(JobRegistryTest, JobLimitListAndDelete) {
  JobRegistry::Options options;
  options.max_jobs = 3;
  JobRegistry registry(options, CountingHex());
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i)
    ids.push_back(registry.CreateJob("j", test_support::SmallJob(1), "")->job_id);
  EXPECT_EQ(registry.CreateJob("j", test_support::SmallJob(1), "").status().code(),
            absl::StatusCode::kResourceExhausted);
  std::vector<JobView> page = registry.ListJobs("", 2);
  ASSERT_EQ(page.size(), 2u);
  std::vector<JobView> rest = registry.ListJobs(page.back().job_id, 2);
  ASSERT_EQ(rest.size(), 1u);
  EXPECT_LT(page.back().job_id, rest[0].job_id);
  ASSERT_TRUE(registry.DeleteJob(ids[0]).ok());
  EXPECT_EQ(registry.GetJob(ids[0]).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.DeleteJob(ids[0]).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.CreateJob("j", test_support::SmallJob(1), "").ok());
}

TEST_F(JobRegistryTest, ConcurrentReportsAreAllAcceptedAndFoldedOnce) {
  constexpr int kRanks = 32;
  const std::string id = Create(kRanks);
  JoinAll(id, kRanks);
  absl::StatusOr<SubmitResult> step = registry_.SubmitBatch(id, 0, Batch(9, kRanks));
  ASSERT_TRUE(step.ok());
  std::vector<std::thread> threads;
  std::vector<int> fresh(kRanks, 0);
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      for (int repeat = 0; repeat < 3; ++repeat) {
        absl::StatusOr<bool> d = registry_.ReportStep(id, 0, r, Measure(*step->plan, r), 0.0);
        if (d.ok() && !*d) ++fresh[r];
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(fresh[r], 1) << r;
}

TEST_F(JobRegistryTest, ProfilesAreValidated) {
  EXPECT_EQ(registry_.CreateJob("p", test_support::SmallJob(2), "not a profile").status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string id = Create(2);
  absl::Status bad = registry_.UploadProfile(id, "sparsebalance-profile 1\n").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("profile"));
}

// A steady clock the test moves by hand.
struct ManualClock {
  std::shared_ptr<std::atomic<int64_t>> seconds = std::make_shared<std::atomic<int64_t>>(1000);
  std::function<std::chrono::steady_clock::time_point()> Now() const {
    return
        [s = seconds] { return std::chrono::steady_clock::time_point(std::chrono::seconds(*s)); };
  }
  void Advance(std::chrono::seconds by) { *seconds += by.count(); }
};

TEST(JobRegistryIdleTest, JobsWithoutAuthorizedCallsForTheTtlAreDeletedWithTheirFiles) {
  const std::string dir = test_support::ScratchDir("idle_ttl");
  absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir, false);
  ASSERT_TRUE(store.ok()) << store.status();
  ManualClock clock;
  JobRegistry::Options options;
  options.store = store->get();
  options.now = clock.Now();
  JobRegistry registry(options, CountingHex());
  absl::StatusOr<CreatedJob> busy = registry.CreateJob("busy", test_support::SmallJob(2), "");
  absl::StatusOr<CreatedJob> idle = registry.CreateJob("idle", test_support::SmallJob(2), "");
  ASSERT_TRUE(busy.ok() && idle.ok());
  ASSERT_TRUE(registry.SubmitBatch(idle->job_id, 0, Batch(1, 2)).ok());
  ASSERT_TRUE(Exists(dir + "/" + idle->job_id));
  constexpr std::chrono::seconds kTtl(3600);
  clock.Advance(std::chrono::seconds(3000));
  EXPECT_TRUE(registry.ExpireIdleJobs(kTtl).empty());  // neither idle for an hour yet
  ASSERT_TRUE(registry.Authorize(busy->job_id, busy->job_token).ok());  // busy's activity
  // A wrong token is no activity.
  EXPECT_FALSE(registry.Authorize(idle->job_id, busy->job_token).ok());
  clock.Advance(std::chrono::seconds(601));
  EXPECT_EQ(registry.ExpireIdleJobs(kTtl), std::vector<std::string>{idle->job_id});
  EXPECT_EQ(registry.job_count(), 1);
  EXPECT_FALSE(Exists(dir + "/" + idle->job_id));
  EXPECT_TRUE(Exists(dir + "/" + busy->job_id));
  absl::Status late = registry.Authorize(idle->job_id, idle->job_token);
  EXPECT_EQ(late.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(late.message()), HasSubstr("--job_idle_ttl"));
  EXPECT_EQ(registry.GetJob(idle->job_id).status().code(), absl::StatusCode::kNotFound);
  // Busy's hour runs from its last call.
  EXPECT_TRUE(registry.ExpireIdleJobs(kTtl).empty());
  clock.Advance(std::chrono::seconds(3001));
  EXPECT_EQ(registry.ExpireIdleJobs(kTtl), std::vector<std::string>{busy->job_id});
  EXPECT_EQ(registry.job_count(), 0);
  // A restarted planner counts idle time from its start: nothing expired is reloaded, and a
  // job reloaded after a long downtime is not expired at once.
  absl::StatusOr<CreatedJob> kept = registry.CreateJob("kept", test_support::SmallJob(2), "");
  ASSERT_TRUE(kept.ok());
  clock.Advance(std::chrono::seconds(86400));
  JobRegistry restarted(options, CountingHex());
  ASSERT_TRUE(restarted.Restore().ok());
  EXPECT_EQ(restarted.job_count(), 1);
  EXPECT_TRUE(restarted.ExpireIdleJobs(kTtl).empty());
}

TEST_F(JobRegistryTest, HostNamesAreCheckedAndNameTheSlowestRanks) {
  const std::string id = Create(4);
  absl::Status bad = registry_.JoinJob(id, 0, nullptr, "node 1").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("host: character 4"));
  bad = registry_.JoinJob(id, 0, nullptr, std::string(kMaxHostName + 1, 'a')).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("host: 254 characters"));
  EXPECT_EQ(registry_.GetJob(id)->joined_ranks, 0);  // refused before anything changed
  ASSERT_TRUE(registry_.JoinJob(id, 0, nullptr, "gpu-node-01.cluster").ok());
  ASSERT_TRUE(registry_.JoinJob(id, 2, nullptr, "[::1]").status().code() ==
              absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(registry_.JoinJob(id, 2, nullptr, "10.0.0.7").ok());
  ASSERT_TRUE(registry_.JoinJob(id, 2).ok());  // a rejoin without a host keeps the known one
  absl::StatusOr<JobView> view = registry_.GetJob(id);
  ASSERT_TRUE(view.ok());
  ASSERT_NE(view->hosts, nullptr);
  EXPECT_EQ(*view->hosts, (std::vector<std::string>{"gpu-node-01.cluster", "", "10.0.0.7", ""}));
  // A rank that comes back on another host: a view taken before keeps what it saw (the names
  // are changed in place only while no view holds them), later views see the new name.
  ASSERT_TRUE(registry_.JoinJob(id, 2, nullptr, "10.0.0.8").ok());
  EXPECT_EQ((*view->hosts)[2], "10.0.0.7");
  EXPECT_EQ((*registry_.GetJob(id)->hosts)[2], "10.0.0.8");
  ASSERT_TRUE(registry_.JoinJob(id, 2, nullptr, "10.0.0.7").ok());

  const std::vector<SlowRank> slowest =
      SlowestRanks({1.0, 3.0, 2.0, 3.0}, view->hosts.get(), /*k=*/3);
  ASSERT_EQ(slowest.size(), 3u);
  EXPECT_EQ(slowest[0].rank, 1);  // ties: the lower rank first
  EXPECT_EQ(slowest[1].rank, 3);
  EXPECT_EQ(slowest[2].rank, 2);
  EXPECT_EQ(slowest[2].host, "10.0.0.7");
  EXPECT_DOUBLE_EQ(slowest[2].speed_factor, 2.0);
  EXPECT_EQ(SlowestRanks({1.0, 2.0}, nullptr, 8).size(), 2u);  // k beyond the ranks
  EXPECT_TRUE(SlowestRanks({1.0, 2.0}, nullptr, -1).empty());
}

}  // namespace
}  // namespace sparsebalance
