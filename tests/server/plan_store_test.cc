// Durability: a registry restored from its state directory serves the same plans, counts the
// reports it acknowledged, and continues the job. The store itself: framed report logs that
// survive torn and failed appends (a real full and read-only tmpfs when mounting is permitted),
// typed store failures, quarantine of unparsable jobs, and nothing outside --state_dir touched.
#include "server/plan_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/plan_threads.h"
#include "planner/planner.h"
#include "planner/recall_model.h"
#include "planner/traces.h"
#include "proto/wire.h"
#include "server/job_registry.h"
#include "server/state_codec.h"
#include "tests/server/state_files.h"
#include "tests/server/test_support.h"
#include "tests/server/tmpfs_mount.h"
#include "tests/support/file_size_limit.h"
#include "tests/support/scratch_dir.h"

namespace sparsebalance {
namespace {

using test_support::ReadBytes;
using test_support::WriteBytes;

using test_support::CountingHex;
using test_support::FolderBytes;

std::vector<Sample> Batch(uint64_t seed, int ranks) {
  return test_support::PretrainBatch(seed, ranks);
}
std::vector<MicroBatchTiming> Measure(const StepPlan& plan, int rank) {
  return test_support::TimingsOf(plan.ranks[rank].micro_batches, 1.2);
}

std::string TempDir() { return test_support::ScratchDir("plan_store") + "/state"; }

int CountFiles(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

// A store opened in `dir` (null when it cannot be) and registry options that write to it.
struct StoredOptions {
  std::unique_ptr<PlanStore> store;
  JobRegistry::Options options;
};

StoredOptions OptionsWithStore(const std::string& dir, bool fsync_reports) {
  StoredOptions stored;
  absl::StatusOr<std::unique_ptr<PlanStore>> opened = PlanStore::Open(dir, fsync_reports);
  EXPECT_TRUE(opened.ok()) << opened.status();
  if (opened.ok()) stored.store = *std::move(opened);
  stored.options.store = stored.store.get();
  return stored;
}

// Creates job `name` (SmallJob of `ranks` ranks) on `registry` and joins every rank. Fatal
// failures: call it in ASSERT_NO_FATAL_FAILURE.
void CreateJoinedJob(JobRegistry& registry, const std::string& name, int ranks, int history_steps,
                     CreatedJob* created) {
  absl::StatusOr<CreatedJob> job =
      registry.CreateJob(name, test_support::SmallJob(ranks, history_steps), "");
  ASSERT_TRUE(job.ok()) << job.status();
  *created = *std::move(job);
  for (int r = 0; r < ranks; ++r) ASSERT_TRUE(registry.JoinJob(created->job_id, r).ok());
}

// A state directory that was there already, the planner's own, that others could write into is
// made private as the planner makes a new one (others could rename, remove or plant job folders
// in it): it stayed 0777.
TEST(PlanStoreTest, AnOwnStateDirectoryOthersMayWriteIsMadePrivate) {
  for (mode_t mode : {0777, 0775, 0750}) {
    const std::string dir = TempDir();
    ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
    ASSERT_EQ(chmod(dir.c_str(), mode), 0);
    absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir, false);
    ASSERT_TRUE(store.ok()) << store.status();
    struct stat st {};
    ASSERT_EQ(stat(dir.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0700u) << std::oct << mode;
  }
}

TEST(PlanStoreTest, ARestoredRegistryServesTheSamePlansAndContinues) {
  const StoredOptions stored = OptionsWithStore(TempDir(), false);
  ASSERT_NE(stored.store, nullptr);
  constexpr int kRanks = 3;
  CreatedJob job;
  std::vector<std::string> plans;
  std::vector<std::vector<Sample>> batches;
  JobView before;
  const std::string& id = job.job_id;
  {
    JobRegistry registry(stored.options, CountingHex());
    ASSERT_NO_FATAL_FAILURE(CreateJoinedJob(registry, "durable", kRanks, 8, &job));
    for (int step = 0; step < 3; ++step) {
      batches.push_back(Batch(10 + step, kRanks));
      absl::StatusOr<SubmitResult> result = registry.SubmitBatch(id, step, batches.back());
      ASSERT_TRUE(result.ok()) << result.status();
      plans.push_back(CanonicalPlanText(*result->plan));
      // Steps 0 and 1 fully reported (folded into the model), step 2 by rank 0 only.
      const int reporters = step < 2 ? kRanks : 1;
      for (int r = 0; r < reporters; ++r) {
        ASSERT_TRUE(registry.ReportStep(id, step, r, Measure(*result->plan, r), 0.0).ok());
      }
    }
    before = *registry.GetJob(id);
  }  // the planner "dies"

  JobRegistry restored(stored.options, CountingHex());
  ASSERT_TRUE(restored.Restore().ok());
  EXPECT_TRUE(restored.Authorize(id, job.job_token).ok());
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

// Measured times and, for every document, a measured recall that differs from document to
// document.
std::vector<MicroBatchTiming> MeasureRecall(const StepPlan& plan, int rank) {
  std::vector<MicroBatchTiming> out = Measure(plan, rank);
  test_support::AddDocumentRecalls(
      plan, rank,
      [](const PlannedSample& p, size_t d) {
        const double wobble = 1.0 + 0.1 * std::sin(0.7 * static_cast<double>(p.id) + d);
        return std::min(1.0, RecallAt(2.0, p.density) * wobble);
      },
      &out);
  return out;
}

// A step's measured recalls are summed as its reports are taken; a restart in the middle of the
// step loses those sums, and the fold sums the step's reports (from the report log and after)
// again: the job learns the same curves, bit for bit, as one that was never restarted, and plans
// the same next step.
TEST(PlanStoreTest, ARestartInTheMiddleOfAStepLearnsTheSameRecallCurves) {
  constexpr int kRanks = 3;
  const StoredOptions kept = OptionsWithStore(TempDir(), false);
  const StoredOptions restarted = OptionsWithStore(TempDir(), false);
  ASSERT_NE(kept.store, nullptr);
  ASSERT_NE(restarted.store, nullptr);
  JobRegistry live(kept.options, CountingHex());
  auto other = std::make_unique<JobRegistry>(restarted.options, CountingHex());
  CreatedJob a;
  CreatedJob b;
  ASSERT_NO_FATAL_FAILURE(CreateJoinedJob(live, "kept", kRanks, 8, &a));
  ASSERT_NO_FATAL_FAILURE(CreateJoinedJob(*other, "restarted", kRanks, 8, &b));
  for (int step = 0; step < 3; ++step) {
    const std::vector<Sample> batch = Batch(40 + step, kRanks);
    absl::StatusOr<SubmitResult> planned = live.SubmitBatch(a.job_id, step, batch);
    ASSERT_TRUE(planned.ok()) << planned.status();
    ASSERT_TRUE(other->SubmitBatch(b.job_id, step, batch).ok());
    for (int r = 0; r < kRanks; ++r) {
      const std::vector<MicroBatchTiming> report = MeasureRecall(*planned->plan, r);
      ASSERT_TRUE(live.ReportStep(a.job_id, step, r, report, 0.0).ok());
      ASSERT_TRUE(other->ReportStep(b.job_id, step, r, report, 0.0).ok());
      if (step == 2 && r == 0) {  // the planner of the second job "dies" after rank 0's report
        other = std::make_unique<JobRegistry>(restarted.options, CountingHex());
        ASSERT_TRUE(other->Restore().ok());
      }
    }
  }
  const JobView want = *live.GetJob(a.job_id);
  const JobView got = *other->GetJob(b.job_id);
  EXPECT_EQ(got.steps_folded, 3);
  ASSERT_EQ(got.recall_curves.size(), want.recall_curves.size());
  double measured = 0.0;
  for (size_t k = 0; k < want.recall_curves.size(); ++k) {
    EXPECT_EQ(got.recall_curves[k].documents, want.recall_curves[k].documents) << k;
    EXPECT_EQ(got.recall_curves[k].exponent, want.recall_curves[k].exponent) << k;
    EXPECT_EQ(got.recall_curves[k].measured_recall, want.recall_curves[k].measured_recall) << k;
    measured += want.recall_curves[k].documents;
  }
  EXPECT_GT(measured, 0.0);
  const std::vector<Sample> next = Batch(50, kRanks);
  absl::StatusOr<SubmitResult> x = live.SubmitBatch(a.job_id, 3, next);
  absl::StatusOr<SubmitResult> y = other->SubmitBatch(b.job_id, 3, next);
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_EQ(CanonicalPlanText(*x->plan), CanonicalPlanText(*y->plan));
}

// A job whose workers measure every layer plans a density per layer, and keeps its older steps
// packed without them: computed again from the recall model of the step's time (step_pack.h).
// Its step records keep that model, so a restarted planner packs the restored steps exactly as
// before (the same bytes), not with 32 densities a sample, once it has computed them again bit for
// bit. A record without it (an older planner's), or whose model does not give its densities back,
// keeps them: more bytes, the same plans.
TEST(PlanStoreTest, ARestartedPerLayerJobPacksItsStepsAsBefore) {
  constexpr int kRanks = 2;
  const std::string dir = TempDir();
  const StoredOptions stored = OptionsWithStore(dir, false);
  ASSERT_NE(stored.store, nullptr);
  CreatedJob job;
  const std::string& id = job.job_id;
  std::vector<std::string> plans;
  std::vector<int> layer_densities(8, 0);  // per step, in its plan
  int64_t bytes = 0;
  int packed = 0;
  {
    JobRegistry registry(stored.options, CountingHex());
    ASSERT_NO_FATAL_FAILURE(CreateJoinedJob(registry, "layers", kRanks, 16, &job));
    const int layers = test_support::SmallJob(kRanks).planner.shape.layers;
    for (int step = 0; step < 8; ++step) {
      absl::StatusOr<SubmitResult> planned =
          registry.SubmitBatch(id, step, Batch(60 + step, kRanks));
      ASSERT_TRUE(planned.ok()) << planned.status();
      plans.push_back(CanonicalPlanText(*planned->plan));
      for (const RankPlan& rank : planned->plan->ranks) {
        for (const MicroBatchPlan& mb : rank.micro_batches) {
          for (const PlannedSample& p : mb.samples) {
            layer_densities[step] += static_cast<int>(p.layer_densities.size());
          }
        }
      }
      for (int r = 0; r < kRanks; ++r) {
        std::vector<MicroBatchTiming> report = MeasureRecall(*planned->plan, r);
        test_support::AddLayerRecalls(
            *planned->plan, r, layers,
            [](const PlannedSample&, const DocumentRecallMeasurement&, int l, double rho) {
              return RecallAt(l % 2 == 0 ? 1.5 : 6.0, rho);
            },
            &report);
        ASSERT_TRUE(registry.ReportStep(id, step, r, report, 0.0).ok());
      }
    }
    ASSERT_GT(layer_densities[2] + layer_densities[3], 0);
    registry.PackHistory(id);
    packed = registry.PackedSteps(id);
    bytes = registry.PackedBytes(id);
    ASSERT_GE(packed, 4);
  }  // the planner "dies"
  auto restart_and_check = [&](int64_t* restored_bytes) {
    JobRegistry restored(stored.options, CountingHex());
    ASSERT_TRUE(restored.Restore().ok());
    EXPECT_EQ(restored.PackedSteps(id), packed);
    *restored_bytes = restored.PackedBytes(id);
    for (int step = 0; step < 8; ++step) {
      bool ready = false;
      absl::StatusOr<std::shared_ptr<const StepPlan>> plan = restored.GetPlan(id, step, 1, &ready);
      ASSERT_TRUE(plan.ok() && ready) << plan.status();
      EXPECT_EQ(CanonicalPlanText(**plan), plans[step]) << "step " << step;
    }
  };
  // A restored plan has no micro-batch features (the record does not keep them), so its steps
  // pack a little smaller than before; without the recipes they took more (below).
  int64_t restored_bytes = 0;
  ASSERT_NO_FATAL_FAILURE(restart_and_check(&restored_bytes));
  EXPECT_LE(restored_bytes, bytes);
  // Step 2's record as an older planner wrote it, and step 3's with the recall model of a job
  // that learned nothing (whose layer densities differ from the plan's).
  for (int step : {2, 3}) {
    const std::string path = absl::StrCat(dir, "/", id, "/step-", step, ".pb");
    state::v1::StepRecord record;
    ASSERT_TRUE(test_support::ReadStateFile(path, &record));
    ASSERT_TRUE(record.has_layer_recall()) << "step " << step;
    if (step == 2) {
      record.clear_layer_recall();
    } else {
      for (state::v1::RecallCurveSums& c : *record.mutable_layer_recall()->mutable_curves()) {
        for (double& v : *c.mutable_documents()) v = 0.0;
        for (double& v : *c.mutable_recall()) v = 0.0;
        for (double& v : *c.mutable_density()) v = 0.0;
      }
    }
    test_support::WriteStateFile(path, record);
  }
  int64_t with_densities = 0;
  ASSERT_NO_FATAL_FAILURE(restart_and_check(&with_densities));
  EXPECT_GE(with_densities - restored_bytes, 8 * (layer_densities[2] + layer_densities[3]));
}

// A join appends one record to the job's joins.log and leaves job.pb alone (rewriting and
// syncing the snapshot per join made a 4,096-rank job's joins cost the planner seconds): ranks
// that joined and were acknowledged are joined after a restart, with no snapshot written since
// the job was created, and their reports are taken.
// A restore on the planning threads (each job's steps loaded, checked and packed on them) is
// the restore on one thread: the same plans, job views and packed bytes; and of two broken
// steps, the job's quarantine reason names the earlier, whether both fail to parse or both
// hold plans their batches refute, as one pass would.
TEST(PlanStoreTest, ARestoreOnThreadsIsTheRestoreOnOneThread) {
  constexpr int kRanks = 4;
  constexpr int kSteps = 12;
  const std::string dir = TempDir();
  CreatedJob job;
  std::vector<std::string> plans;
  {
    const StoredOptions stored = OptionsWithStore(dir, false);
    ASSERT_NE(stored.store, nullptr);
    JobRegistry registry(stored.options, CountingHex());
    ASSERT_NO_FATAL_FAILURE(CreateJoinedJob(registry, "threads", kRanks, kSteps, &job));
    for (int step = 0; step < kSteps; ++step) {
      absl::StatusOr<SubmitResult> result =
          registry.SubmitBatch(job.job_id, step, Batch(30 + step, kRanks));
      ASSERT_TRUE(result.ok()) << result.status();
      plans.push_back(CanonicalPlanText(*result->plan));
      const int reporters = step % 3 == 2 ? 1 : kRanks;  // some steps reported in part
      for (int r = 0; r < reporters; ++r) {
        ASSERT_TRUE(registry.ReportStep(job.job_id, step, r, Measure(*result->plan, r), 0.0).ok());
      }
    }
  }
  // What a registry restored from a copy of the state (broken by `broken`) on `threads`
  // threads (1: none given) serves, or its one failed job's reason.
  struct Restored {
    std::vector<std::string> plans;
    int64_t next_step = 0;
    std::vector<double> speed_factors;
    double per_token = 0.0;
    int64_t packed_bytes = 0;
    std::string failure;
  };
  int copies = 0;
  auto restore = [&](int threads, const std::function<void(const std::string&)>& broken) {
    Restored out;
    const std::string copy = absl::StrCat(dir, "-copy", copies++);
    std::filesystem::copy(dir, copy, std::filesystem::copy_options::recursive);
    if (broken) broken(copy + "/" + job.job_id);
    StoredOptions stored = OptionsWithStore(copy, false);
    EXPECT_NE(stored.store, nullptr);
    if (stored.store == nullptr) return out;
    std::unique_ptr<PlanThreads> pool;
    if (threads > 1) pool = std::make_unique<PlanThreads>(threads);
    stored.options.plan_threads = pool.get();
    JobRegistry registry(stored.options, CountingHex());
    EXPECT_TRUE(registry.Restore().ok());
    const std::vector<JobView> failed = registry.failed_jobs();
    if (!failed.empty()) {
      out.failure = absl::StrReplaceAll(failed[0].failure, {{copy, "<state>"}});
      return out;
    }
    out.packed_bytes = registry.PackedBytes(job.job_id);  // before GetPlan unpacks them
    for (int step = 0; step < kSteps; ++step) {
      bool ready = false;
      absl::StatusOr<std::shared_ptr<const StepPlan>> plan =
          registry.GetPlan(job.job_id, step, 0, &ready);
      EXPECT_TRUE(plan.ok() && ready) << step;
      out.plans.push_back(plan.ok() ? CanonicalPlanText(**plan) : "");
    }
    absl::StatusOr<JobView> view = registry.GetJob(job.job_id);
    EXPECT_TRUE(view.ok());
    if (view.ok()) {
      out.next_step = view->next_step;
      out.speed_factors = view->speed_factors;
      out.per_token = view->coefficients.per_token;
    }
    return out;
  };
  const Restored one = restore(1, nullptr);
  EXPECT_EQ(one.failure, "");
  EXPECT_EQ(one.plans, plans);
  EXPECT_EQ(one.next_step, kSteps);
  EXPECT_GT(one.packed_bytes, 0);  // the old steps were packed
  for (int threads : {2, 3}) {
    const Restored many = restore(threads, nullptr);
    EXPECT_EQ(many.failure, "") << threads;
    EXPECT_EQ(many.plans, plans) << threads;
    EXPECT_EQ(many.next_step, one.next_step) << threads;
    EXPECT_EQ(many.speed_factors, one.speed_factors) << threads;
    EXPECT_EQ(many.per_token, one.per_token) << threads;
    EXPECT_EQ(many.packed_bytes, one.packed_bytes) << threads;
  }

  // Steps 4 and 9 broken: garbage records (the load fails), or plans of a split document
  // that their batch refutes in two different ways (the restore's checks fail).
  const JobSettings settings = test_support::SmallJob(kRanks);
  const LatencyModel prior(settings.planner.shape, kRanks, kDefaultCostPrior);
  auto save_broken = [&](const std::string& job_dir, int64_t step, void (*mutate)(StepPlan*)) {
    absl::StatusOr<std::unique_ptr<PlanStore>> store =
        PlanStore::Open(job_dir.substr(0, job_dir.rfind('/')), false);
    ASSERT_TRUE(store.ok()) << store.status();
    test_support::ShardedStep sharded = test_support::MakeShardedStep(prior, kRanks);
    mutate(&sharded.plan);
    ASSERT_TRUE((*store)->SaveStep(job.job_id, step, sharded.batch, sharded.plan, false).ok());
  };
  const std::vector<std::pair<std::function<void(const std::string&)>, std::string>> breaks = {
      {[](const std::string& job_dir) {
         WriteBytes(job_dir + "/step-4.pb", "\xff\xff\xff\xff garbage");
         WriteBytes(job_dir + "/step-9.pb", "\xff\xff\xff\xff garbage");
       },
       "step-4.pb"},
      {[&](const std::string& job_dir) {
         save_broken(job_dir, 4, [](StepPlan* p) {
           p->ranks[0].micro_batches[0].samples[0].shard_end -= 64;
           p->ranks[0].micro_batches[0].tokens -= 64;
         });
         save_broken(job_dir, 9, [](StepPlan* p) {
           p->ranks[0].micro_batches[0].samples[0].shard_begin = 13300;
           p->ranks[0].micro_batches[0].tokens += 12;
         });
       },
       "leaves a gap"},
  };
  for (const auto& [broken, reason] : breaks) {
    const Restored serial = restore(1, broken);
    EXPECT_THAT(serial.failure,
                ::testing::AllOf(::testing::HasSubstr("step-4"), ::testing::HasSubstr(reason)));
    for (int threads : {2, 3}) {
      EXPECT_EQ(restore(threads, broken).failure, serial.failure) << threads;
    }
  }
}

TEST(PlanStoreTest, JoinsSurviveARestartWithoutASnapshotAfterThem) {
  const std::string dir = TempDir();
  const StoredOptions stored = OptionsWithStore(dir, false);
  ASSERT_NE(stored.store, nullptr);
  constexpr int kRanks = 4;
  CreatedJob job;
  std::string snapshot_before_joins;
  {
    JobRegistry registry(stored.options, CountingHex());
    absl::StatusOr<CreatedJob> created =
        registry.CreateJob("joins", test_support::SmallJob(kRanks, 8), "");
    ASSERT_TRUE(created.ok()) << created.status();
    job = *created;
    snapshot_before_joins = ReadBytes(dir + "/" + job.job_id + "/job.pb");
    // Ranks 3 and 1 join (1 twice: a repeat appends nothing), 0 and 2 do not.
    for (int r : {3, 1, 1}) ASSERT_TRUE(registry.JoinJob(job.job_id, r).ok());
    EXPECT_EQ(ReadBytes(dir + "/" + job.job_id + "/job.pb"), snapshot_before_joins);
  }  // the planner "dies"
  absl::StatusOr<PlanStore::Loaded> loaded = stored.store->LoadAll();
  ASSERT_TRUE(loaded.ok());
  ASSERT_EQ(loaded->jobs.size(), 1u);
  EXPECT_EQ(loaded->jobs[0].job.joined, (std::vector<bool>{false, true, false, true}));
  EXPECT_EQ(loaded->jobs[0].joins_skipped_bytes, 0);
  EXPECT_EQ(loaded->jobs[0].joins_log_bytes,
            static_cast<int64_t>(ReadBytes(dir + "/" + job.job_id + "/joins.log").size()));
  EXPECT_GT(loaded->jobs[0].joins_log_bytes, 0);

  JobRegistry restored(stored.options, CountingHex());
  ASSERT_TRUE(restored.Restore().ok());
  EXPECT_EQ(restored.GetJob(job.job_id)->joined_ranks, 2);
  for (int r : {0, 2}) ASSERT_TRUE(restored.JoinJob(job.job_id, r).ok());
  const std::vector<Sample> batch = Batch(3, kRanks);
  absl::StatusOr<SubmitResult> result = restored.SubmitBatch(job.job_id, 0, batch);
  ASSERT_TRUE(result.ok()) << result.status();
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(restored.ReportStep(job.job_id, 0, r, Measure(*result->plan, r), 0.0).ok())
        << "rank " << r;
  }
}

// A fold writes no snapshot (the next SubmitBatch's carries it): a planner that dies after a
// step's last report but before the next submit refolds the step from its report log.
TEST(PlanStoreTest, AStepFoldedAfterTheLastSnapshotIsRefoldedOnRestore) {
  const StoredOptions stored = OptionsWithStore(TempDir(), false);
  ASSERT_NE(stored.store, nullptr);
  constexpr int kRanks = 3;
  CreatedJob job;
  JobView before;
  const std::string& id = job.job_id;
  {
    JobRegistry registry(stored.options, CountingHex());
    ASSERT_NO_FATAL_FAILURE(CreateJoinedJob(registry, "refold", kRanks, 8, &job));
    for (int step = 0; step < 2; ++step) {
      absl::StatusOr<SubmitResult> result =
          registry.SubmitBatch(id, step, Batch(30 + step, kRanks));
      ASSERT_TRUE(result.ok());
      for (int r = 0; r < kRanks; ++r) {
        ASSERT_TRUE(registry.ReportStep(id, step, r, Measure(*result->plan, r), 0.0).ok());
      }
    }
    before = *registry.GetJob(id);
    ASSERT_EQ(before.steps_folded, 2);  // step 1 folded after the last snapshot
  }
  JobRegistry restored(stored.options, CountingHex());
  ASSERT_TRUE(restored.Restore().ok());
  const JobView after = *restored.GetJob(id);
  EXPECT_EQ(after.steps_folded, 2);
  EXPECT_EQ(after.coefficients.per_block, before.coefficients.per_block);
  EXPECT_EQ(after.coefficients.per_token, before.coefficients.per_token);
  EXPECT_EQ(after.speed_factors, before.speed_factors);
}

// Context parallelism through the store: a stored plan with a split document is restored and
// served with its shards; exchange times are accepted only where shards were planned; the
// exchange rate learned from them survives restarts (refolded from the report log, and from the
// snapshot once one carries the fold).
TEST(PlanStoreTest, SplitDocumentsAndTheLearnedExchangeRateSurviveRestarts) {
  const StoredOptions stored = OptionsWithStore(TempDir(), false);
  ASSERT_NE(stored.store, nullptr);
  constexpr int kRanks = 4;
  CreatedJob job;
  const std::string& id = job.job_id;
  const JobSettings settings = test_support::SmallJob(kRanks);
  const LatencyModel prior(settings.planner.shape, kRanks, kDefaultCostPrior);
  const test_support::ShardedStep sharded = test_support::MakeShardedStep(prior, kRanks);
  {
    JobRegistry registry(stored.options, CountingHex());
    ASSERT_NO_FATAL_FAILURE(CreateJoinedJob(registry, "split", kRanks, 8, &job));
    // As if the planner had planned it (the planner's own choices are not what is tested).
    ASSERT_TRUE(stored.store->SaveStep(id, 0, sharded.batch, sharded.plan, /*folded=*/false).ok());
  }
  constexpr double kMeasuredRate = 5e9;  // bytes per second, the prior is 25e9
  double learned = 0;
  {
    JobRegistry restored(stored.options, CountingHex());
    ASSERT_TRUE(restored.Restore().ok());
    ASSERT_TRUE(restored.failed_jobs().empty());
    bool ready = false;
    absl::StatusOr<std::shared_ptr<const StepPlan>> plan = restored.GetPlan(id, 0, 0, &ready);
    ASSERT_TRUE(plan.ok() && ready) << plan.status();
    for (int r = 0; r < kRanks; ++r) {
      for (int m = 0; m < 2; ++m) {
        EXPECT_EQ((*plan)->ranks[r].micro_batches[m].samples,
                  sharded.plan.ranks[r].micro_batches[m].samples);
      }
    }
    EXPECT_TRUE((*plan)->ranks[0].micro_batches[0].samples[0].sharded());
    EXPECT_DOUBLE_EQ(restored.GetJob(id)->exchange_bytes_per_second, 25e9);
    // Rank 1 holds no shard: an exchange time on its micro-batch is refused.
    std::vector<MicroBatchTiming> rank1 =
        test_support::TimingsOf(sharded.plan.ranks[1].micro_batches);
    std::vector<MicroBatchTiming> bad = rank1;
    bad[0].exchange_seconds = 0.01;
    const absl::Status refused = restored.ReportStep(id, 0, 1, bad, 0.0).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(refused.message()),
                ::testing::HasSubstr("a report for a shard that was not planned"));
    ASSERT_TRUE(restored.ReportStep(id, 0, 1, rank1, 0.0).ok());
    for (int r : sharded.group) {
      const std::vector<MicroBatchTiming> timings =
          test_support::ShardedTimings(sharded, prior, r, kMeasuredRate);
      ASSERT_TRUE(restored.ReportStep(id, 0, r, timings, 0.0).ok()) << "rank " << r;
    }
    const JobView view = *restored.GetJob(id);
    EXPECT_EQ(view.steps_folded, 1);
    EXPECT_EQ(view.unfolded_steps, 0) << view.failure;
    learned = view.exchange_bytes_per_second;
    EXPECT_LT(learned, 25e9);  // moved towards what was measured
    EXPECT_GT(learned, kMeasuredRate);
  }
  {
    // No snapshot carries the fold yet: the restart refolds step 0 from its report log.
    JobRegistry restored(stored.options, CountingHex());
    ASSERT_TRUE(restored.Restore().ok());
    EXPECT_EQ(restored.GetJob(id)->exchange_bytes_per_second, learned);
    EXPECT_EQ(restored.GetJob(id)->steps_folded, 1);
    // The next step's snapshot carries the model with its exchange sums.
    ASSERT_TRUE(restored.SubmitBatch(id, 1, Batch(40, kRanks)).ok());
  }
  JobRegistry restored(stored.options, CountingHex());
  ASSERT_TRUE(restored.Restore().ok());
  EXPECT_EQ(restored.GetJob(id)->exchange_bytes_per_second, learned);
  EXPECT_EQ(restored.GetJob(id)->steps_folded, 1);
}

// A stored plan whose shards do not tile their document, or sit where their group says they do
// not, quarantines the job (DATA_LOSS) rather than being served.
TEST(PlanStoreTest, MalformedStoredShardsQuarantineTheJob) {
  constexpr int kRanks = 4;
  const JobSettings settings = test_support::SmallJob(kRanks);
  const LatencyModel prior(settings.planner.shape, kRanks, kDefaultCostPrior);
  struct Case {
    void (*mutate)(StepPlan*);
    const char* reason;
  };
  const Case cases[] = {
      {[](StepPlan* p) {
         p->ranks[0].micro_batches[0].samples[0].shard_end -= 64;
         p->ranks[0].micro_batches[0].tokens -= 64;
       },
       "leaves a gap"},
      {[](StepPlan* p) {
         p->ranks[3].micro_batches[0].samples[0].shard_end = 39000;
         p->ranks[3].micro_batches[0].tokens -= 1000;
       },
       "its shards end at token 39000 of 40000"},
      {[](StepPlan* p) {
         // Rank 3's shard moved to its second micro-batch.
         auto& mbs = p->ranks[3].micro_batches;
         mbs[1].samples.insert(mbs[1].samples.begin(), mbs[0].samples[0]);
         mbs[1].tokens += mbs[0].tokens;
         mbs[0] = MicroBatchPlan{};
         mbs[0].default_density = mbs[1].default_density;  // as the planner sets it
       },
       "different micro-batches"},
      {[](StepPlan* p) {
         // Rank 3's shard dropped: the group has a rank without its shard.
         auto& mb = p->ranks[3].micro_batches[0];
         mb.samples.clear();
         mb.tokens = 0;
       },
       "2 shards for a group of 3 ranks"},
      {[](StepPlan* p) {
         p->ranks[0].micro_batches[0].samples[0].shard_begin = 13300;
         p->ranks[0].micro_batches[0].tokens += 12;
       },
       "not block-aligned"},
  };
  for (const Case& c : cases) {
    const StoredOptions stored = OptionsWithStore(TempDir(), false);
    ASSERT_NE(stored.store, nullptr);
    CreatedJob job;
    test_support::ShardedStep sharded = test_support::MakeShardedStep(prior, kRanks);
    c.mutate(&sharded.plan);
    {
      JobRegistry registry(stored.options, CountingHex());
      ASSERT_NO_FATAL_FAILURE(CreateJoinedJob(registry, "split", kRanks, 8, &job));
      ASSERT_TRUE(
          stored.store->SaveStep(job.job_id, 0, sharded.batch, sharded.plan, /*folded=*/false)
              .ok());
    }
    JobRegistry restored(stored.options, CountingHex());
    ASSERT_TRUE(restored.Restore().ok());
    const std::vector<JobView> failed = restored.failed_jobs();
    ASSERT_EQ(failed.size(), 1u) << c.reason;
    EXPECT_THAT(failed[0].failure, ::testing::HasSubstr(c.reason));
  }
}

TEST(PlanStoreTest, ATornReportIsDroppedAndHistoryAndDeleteRemoveFiles) {
  const std::string dir = TempDir();
  const StoredOptions stored = OptionsWithStore(dir, true);
  ASSERT_NE(stored.store, nullptr);
  JobRegistry registry(stored.options, CountingHex());
  CreatedJob job;
  ASSERT_NO_FATAL_FAILURE(CreateJoinedJob(registry, "torn", 2, 2, &job));
  const std::string& id = job.job_id;
  absl::StatusOr<SubmitResult> s0 = registry.SubmitBatch(id, 0, Batch(1, 2));
  ASSERT_TRUE(s0.ok());
  ASSERT_TRUE(registry.ReportStep(id, 0, 0, Measure(*s0->plan, 0), 0.0).ok());
  // A crash in the middle of the next append leaves half a record.
  const std::string log = dir + "/" + id + "/step-0.reports";
  const int fd = open(log.c_str(), O_WRONLY | O_APPEND);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, "\x40\x00\x00\x00\x01\x02", 6), 6);
  close(fd);
  JobRegistry restored(stored.options, CountingHex());
  ASSERT_TRUE(restored.Restore().ok());
  EXPECT_TRUE(*restored.ReportStep(id, 0, 0, Measure(*s0->plan, 0), 0.0));   // kept
  EXPECT_FALSE(*restored.ReportStep(id, 0, 1, Measure(*s0->plan, 1), 0.0));  // not torn in
  // History of 2: step 0's files go when step 2 is planned.
  ASSERT_TRUE(restored.SubmitBatch(id, 1, Batch(2, 2)).ok());
  ASSERT_TRUE(restored.SubmitBatch(id, 2, Batch(3, 2)).ok());
  EXPECT_NE(access((dir + "/" + id + "/step-0.pb").c_str(), F_OK), 0);
  EXPECT_EQ(access((dir + "/" + id + "/step-2.pb").c_str(), F_OK), 0);
  ASSERT_TRUE(restored.DeleteJob(id).ok());
  EXPECT_EQ(CountFiles(dir), 0);
}

// ---- The store on its own ----

constexpr char kJobA[] = "aaaaaaaa00000001";
constexpr char kJobB[] = "bbbbbbbb00000002";
constexpr char kJobC[] = "cccccccc00000003";
constexpr char kJobD[] = "dddddddd00000004";
constexpr char kJobE[] = "eeeeeeee00000005";

// A job of 2 ranks as job.pb holds it.
StoredJob Snapshot(const std::string& id) {
  StoredJob job;
  job.job_id = id;
  job.name = std::string(40, 'n');
  job.token = std::string(64, 't');
  job.settings.planner.ranks = 2;
  job.model.speed_factors = {1.0, 1.0};
  job.next_step = 1;
  return job;
}

// Writes step `step`: an empty batch and a plan that defers sample 7.
absl::Status SaveStep(PlanStore& store, const std::string& id, int64_t step) {
  StepPlan plan;
  plan.deferred_ids = {7};
  return store.SaveStep(id, step, {}, plan, /*folded=*/false);
}

// Report `i`: rank and wait_seconds are `i`; `micro_batches` entries of some 45 bytes each.
StoredReport Report(int i, int micro_batches = 4) {
  StoredReport report;
  report.rank = i;
  report.wait_seconds = i;
  for (int m = 0; m < micro_batches; ++m) {
    report.micro_batches.push_back({m, 0.5 + m, 0.25, 65536, 0.5, 0.99, {}, 0.0, 0.0});
  }
  return report;
}

std::vector<int> Ranks(const PlanStore::LoadedStep& step) {
  std::vector<int> ranks;
  for (const StoredReport& r : step.reports) ranks.push_back(r.rank);
  return ranks;
}

int64_t FileSize(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

bool Exists(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0;
}

// An open store at a fresh `<tmp>/state` with job `id` and its step 0.
std::unique_ptr<PlanStore> StoreWithJob(const std::string& dir, const std::string& id,
                                        bool fsync_reports = false) {
  absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir, fsync_reports);
  EXPECT_TRUE(store.ok()) << store.status();
  if (!store.ok()) return nullptr;
  EXPECT_TRUE((*store)->CreateJob(Snapshot(id)).ok());
  EXPECT_TRUE(SaveStep(**store, id, 0).ok());
  return *std::move(store);
}

using test_support::TmpfsMount;

TEST(PlanStoreTest, IsValidJobIdAcceptsOnlyShortLowercaseAlphanumerics) {
  for (const std::string& id :
       {std::string("aaaaaaaa"), std::string("0123456789abcdef"), std::string(64, 'z')}) {
    EXPECT_TRUE(IsValidJobId(id)) << id;
  }
  for (const std::string& id :
       {std::string(""), std::string("aaaaaaa"), std::string(65, 'a'), std::string("AAAAAAAA"),
        std::string("../../etc"), std::string("aaaa/aaaa"), std::string("aaaaaaa."),
        std::string(".."), std::string("aaaa aaaa"), std::string("aaaa\\0aaa", 9),
        std::string("quarantine")}) {
    EXPECT_FALSE(IsValidJobId(id)) << id;
  }
}

// The codec keeps every field: a job, a step's batch and plan (compared as CanonicalPlanText)
// and a report come back as they went in.
TEST(StateCodecTest, JobsStepsAndReportsRoundTrip) {
  StoredJob job = Snapshot(kJobA);
  job.settings = test_support::SmallJob(2, 16);
  job.settings.planner.policy = Policy::kDst;
  job.model.weights = {1.5, 0.5, 2.0, 1.0};
  job.model.covariance[5] = 0.25;
  job.model.speed_factors = {1.1, 0.9};
  job.model.rank_error_variance = 0.01;
  job.model.steps_observed = 7;
  job.prior = {1e-6, 2e-8, 3e-4, 4e-3};
  job.joined = {true, false};
  job.folded_steps = {3, 4};
  job.first_kept_step = 3;
  job.unfolded_steps = 1;
  job.fold_failure = "step 2: why";
  job.settings.planner.bucket_recall_margin = 0.02;
  job.settings.planner.document_recall_floor = 0.5;
  job.recall.curves.assign(
      static_cast<size_t>(job.settings.planner.shape.layers + 1) * kRecallBuckets,
      RecallCurveSums{});
  job.recall.curves[3].documents[5] = 12.0;
  job.recall.curves[3].recall[5] = 9.0;
  job.recall.curves[3].density[5] = 3.3;
  job.recall.steps_observed = 5;
  job.model.exchange_u = 3.5e10;
  job.model.exchange_uu = 4.25e20;
  job.settings.planner.max_shards = 2;
  job.settings.planner.shard_policy = ShardPolicy::kDense;
  absl::StatusOr<StoredJob> back = DecodeJob(EncodeJob(job));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->job_id, job.job_id);
  EXPECT_EQ(back->token, job.token);
  EXPECT_EQ(back->settings.history_steps, 16);
  EXPECT_EQ(back->settings.planner.policy, Policy::kDst);
  EXPECT_EQ(back->model.weights, job.model.weights);
  EXPECT_EQ(back->model.covariance, job.model.covariance);
  EXPECT_EQ(back->model.speed_factors, job.model.speed_factors);
  EXPECT_EQ(back->model.steps_observed, 7);
  EXPECT_EQ(back->prior.per_micro_batch, 4e-3);
  EXPECT_EQ(back->joined, job.joined);
  EXPECT_EQ(back->folded_steps, job.folded_steps);
  EXPECT_EQ(back->first_kept_step, 3);
  EXPECT_EQ(back->fold_failure, job.fold_failure);
  EXPECT_EQ(back->recall.curves, job.recall.curves);
  EXPECT_EQ(back->recall.steps_observed, 5);
  EXPECT_EQ(back->settings.planner.bucket_recall_margin, 0.02);
  EXPECT_EQ(back->settings.planner.document_recall_floor, 0.5);
  EXPECT_EQ(back->model.exchange_u, 3.5e10);
  EXPECT_EQ(back->model.exchange_uu, 4.25e20);
  EXPECT_EQ(back->settings.planner.max_shards, 2);
  EXPECT_EQ(back->settings.planner.shard_policy, ShardPolicy::kDense);
  {
    // A snapshot of a planner older than the exchange sums: the model keeps its prior rate.
    state::v1::JobSnapshot old = EncodeJob(job);
    old.mutable_model()->clear_exchange_u();
    old.mutable_model()->clear_exchange_uu();
    absl::StatusOr<StoredJob> older = DecodeJob(old);
    ASSERT_TRUE(older.ok()) << older.status();
    LatencyModel model(job.settings.planner.shape, 2, older->prior);
    model.set_state(older->model);
    EXPECT_DOUBLE_EQ(model.exchange_seconds_per_byte(), kDefaultExchangeSecondsPerByte);
    old.mutable_model()->set_exchange_uu(-1.0);
    EXPECT_EQ(DecodeJob(old).status().code(), absl::StatusCode::kDataLoss);
  }
  // A model whose size is not the job's does not decode.
  job.model.speed_factors = {1.0};
  EXPECT_EQ(DecodeJob(EncodeJob(job)).status().code(), absl::StatusCode::kDataLoss);

  const std::vector<Sample> batch = Batch(3, 2);
  absl::StatusOr<StepPlan> plan = PlanStepLocally(batch, test_support::SmallJob(2).planner);
  ASSERT_TRUE(plan.ok()) << plan.status();
  state::v1::StepRecord record;
  EncodeStep(5, batch, *plan, /*folded=*/true, /*layer_recall=*/nullptr, /*planned_with=*/nullptr,
             &record);
  absl::StatusOr<PlanStore::LoadedStep> decoded = DecodeStep(record);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  const PlanStore::LoadedStep& step = *decoded;
  EXPECT_EQ(step.step, 5);
  EXPECT_TRUE(step.folded);
  EXPECT_EQ(BatchFingerprint(step.batch), BatchFingerprint(batch));
  EXPECT_EQ(CanonicalPlanText(step.plan), CanonicalPlanText(*plan));
  EXPECT_FALSE(step.planned_with.has_value());
  {
    // The density settings it was planned with, where given, come back as they were.
    const PlannedDensities densities{0.125, 0.875, 0.25};
    state::v1::StepRecord with;
    EncodeStep(5, batch, *plan, /*folded=*/true, /*layer_recall=*/nullptr, &densities, &with);
    absl::StatusOr<PlanStore::LoadedStep> back = DecodeStep(with);
    ASSERT_TRUE(back.ok()) << back.status();
    ASSERT_TRUE(back->planned_with.has_value());
    EXPECT_EQ(back->planned_with->density_min, 0.125);
    EXPECT_EQ(back->planned_with->density_max, 0.875);
    EXPECT_EQ(back->planned_with->density_default, 0.25);
  }
  // The step's figures are stored once, in ranks[0]; a record of an older planner, which
  // repeats them in every rank, reads the same.
  ASSERT_EQ(record.ranks_size(), 2);
  EXPECT_TRUE(record.ranks(0).has_figures());
  EXPECT_FALSE(record.ranks(1).has_figures());
  state::v1::StepRecord older = record;
  *older.mutable_ranks(1)->mutable_figures() = record.ranks(0).figures();
  absl::StatusOr<PlanStore::LoadedStep> older_decoded = DecodeStep(older);
  ASSERT_TRUE(older_decoded.ok()) << older_decoded.status();
  EXPECT_EQ(CanonicalPlanText(older_decoded->plan), CanonicalPlanText(*plan));
  // A malformed planned sample does not decode, and the error names it.
  record.mutable_ranks(0)->mutable_micro_batches(0)->mutable_samples(0)->set_density(2.0);
  absl::Status bad = DecodeStep(record).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(bad.message().find("ranks[0].micro_batches[0].samples[0].density"), std::string::npos)
      << bad;

  StoredReport report = Report(1, 3);
  report.micro_batches[1].exchange_seconds = 0.125;
  state::v1::ReportRecord encoded;
  EncodeReport(report, &encoded);
  const StoredReport report_back = DecodeReport(encoded);
  EXPECT_EQ(report_back.micro_batches[1].exchange_seconds, 0.125);
  EXPECT_EQ(report_back.rank, 1);
  EXPECT_EQ(report_back.wait_seconds, 1.0);
  ASSERT_EQ(report_back.micro_batches.size(), 3u);
  EXPECT_EQ(report_back.micro_batches[2].compute_seconds, 2.5);
  EXPECT_EQ(report_back.micro_batches[2].tokens, 65536);
}

// A step record holds each planned sample once, in MicroBatch.samples: not the wire's deprecated
// copy for clients older than it (ids, densities and each layer density again), which doubled a
// per-layer job's records. Records of planners that wrote only that old form still decode.
TEST(StateCodecTest, StepRecordsHoldEachLayerDensityOnceAndOldFormRecordsStillDecode) {
  const std::vector<Sample> batch = Batch(7, 2);
  absl::StatusOr<StepPlan> local = PlanStepLocally(batch, test_support::SmallJob(2).planner);
  ASSERT_TRUE(local.ok()) << local.status();
  StepPlan plan = *std::move(local);
  int layered = 0;
  for (RankPlan& rank : plan.ranks) {
    for (MicroBatchPlan& mb : rank.micro_batches) {
      for (PlannedSample& p : mb.samples) {
        p.layer_densities.clear();
        for (int l = 0; l < 4; ++l) p.layer_densities.push_back(0.125 * (l + 1) + 1e-3 * layered);
        ++layered;
      }
    }
  }
  ASSERT_GT(layered, 0);
  state::v1::StepRecord record;
  EncodeStep(2, batch, plan, /*folded=*/false, /*layer_recall=*/nullptr, /*planned_with=*/nullptr,
             &record);
  int stored_layers = 0;
  size_t wire_bytes = 0;
  for (int r = 0; r < record.ranks_size(); ++r) {
    wire_bytes += RankPlanToProto(plan, 2, r).ByteSizeLong();
    for (const v1::MicroBatch& m : record.ranks(r).micro_batches()) {
      EXPECT_EQ(m.sample_ids_size(), 0);
      EXPECT_EQ(m.densities_size(), 0);
      EXPECT_EQ(m.layer_densities_size(), 0);
      for (const v1::PlannedSample& p : m.samples()) stored_layers += p.layer_densities_size();
    }
  }
  EXPECT_EQ(stored_layers, 4 * layered);
  EXPECT_LT(record.ByteSizeLong(), wire_bytes);
  absl::StatusOr<PlanStore::LoadedStep> decoded = DecodeStep(record);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(CanonicalPlanText(decoded->plan), CanonicalPlanText(plan));

  // An older planner's record: the wire's old form alone (no samples, so no lengths: the
  // registry takes those from the step's batch). Ids, densities and layer densities come back.
  state::v1::StepRecord old = record;
  for (int r = 0; r < old.ranks_size(); ++r) {
    const v1::RankPlan wire = RankPlanToProto(plan, 2, r);
    for (int m = 0; m < wire.micro_batches_size(); ++m) {
      v1::MicroBatch* mb = old.mutable_ranks(r)->mutable_micro_batches(m);
      ASSERT_EQ(wire.micro_batches(m).layer_densities_size(), mb->samples_size());
      *mb->mutable_sample_ids() = wire.micro_batches(m).sample_ids();
      *mb->mutable_densities() = wire.micro_batches(m).densities();
      *mb->mutable_layer_densities() = wire.micro_batches(m).layer_densities();
      mb->clear_samples();
    }
  }
  absl::StatusOr<PlanStore::LoadedStep> older = DecodeStep(old);
  ASSERT_TRUE(older.ok()) << older.status();
  ASSERT_EQ(older->plan.ranks.size(), plan.ranks.size());
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    const auto& want = plan.ranks[r].micro_batches;
    const auto& got = older->plan.ranks[r].micro_batches;
    ASSERT_EQ(got.size(), want.size());
    for (size_t m = 0; m < want.size(); ++m) {
      ASSERT_EQ(got[m].samples.size(), want[m].samples.size());
      for (size_t k = 0; k < want[m].samples.size(); ++k) {
        EXPECT_EQ(got[m].samples[k].id, want[m].samples[k].id);
        EXPECT_EQ(got[m].samples[k].density, want[m].samples[k].density);
        EXPECT_EQ(got[m].samples[k].layer_densities, want[m].samples[k].layer_densities);
      }
    }
  }
}

TEST(PlanStoreTest, StoreFailuresAreRecognisedByTheirPayloadNotTheirMessage) {
  const absl::Status full = StoreFailure(absl::StatusCode::kResourceExhausted, "disk full");
  EXPECT_TRUE(IsStoreFailure(full));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(full.message(), "state_dir: disk full");
  EXPECT_EQ(ErrorReason(full), kReasonStateDirFailure);  // the one signal, up to the client
  EXPECT_FALSE(IsStoreFailure(absl::InternalError("state_dir: looks like one")));
  EXPECT_FALSE(IsStoreFailure(absl::UnavailableError("state: the old kind")));

  // A real one: the state directory under a regular file.
  const std::string parent = TempDir();
  ASSERT_EQ(mkdir(parent.c_str(), 0700), 0);
  WriteBytes(parent + "/file", "x");
  absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(parent + "/file/state", false);
  ASSERT_FALSE(store.ok());
  EXPECT_TRUE(IsStoreFailure(store.status())) << store.status();
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(absl::StartsWith(store.status().message(), "state_dir: ")) << store.status();
  EXPECT_TRUE(absl::StrContains(store.status().message(), parent + "/file/state"));
  EXPECT_TRUE(absl::StrContains(store.status().message(), std::strerror(ENOTDIR)));
}

TEST(PlanStoreTest, EveryMethodRefusesAJobIdThatIsNotAFolderName) {
  const std::string dir = TempDir();
  absl::StatusOr<std::unique_ptr<PlanStore>> opened = PlanStore::Open(dir, false);
  ASSERT_TRUE(opened.ok());
  PlanStore& store = **opened;
  const std::string parent = dir.substr(0, dir.rfind('/'));
  const int parent_entries = CountFiles(parent);
  for (const std::string& id :
       {std::string("../escape"), std::string("../../tmp"), std::string("aaaaaaaa/../.."),
        std::string(".."), std::string(""), std::string("AAAAAAAA1"), std::string("quarantine")}) {
    SCOPED_TRACE(id);
    const std::vector<absl::Status> results = {
        store.CreateJob(Snapshot(id)),
        store.SaveJob(Snapshot(id)),
        SaveStep(store, id, 0),
        store.AppendReport(id, 0, Report(0)),
        store.DropStep(id, 0),
        store.RetireJob(id),
        store.Quarantine(id, "test"),
        store.DeleteQuarantined(id),
        store.AppendJoin(id, 0).status(),
        store.SyncJoins(id, 1),
    };
    for (const absl::Status& s : results) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_FALSE(IsStoreFailure(s));
    }
    store.RemoveRetired(id);
  }
  EXPECT_EQ(CountFiles(dir), 0);
  EXPECT_EQ(CountFiles(parent), parent_entries);
  EXPECT_EQ(SaveStep(store, kJobA, -1).code(), absl::StatusCode::kInvalidArgument);
}

// The bug this format fixes: a torn record mid-file (a partial write on a full disk, appends
// after it) made the loader stop there, losing every report acknowledged after it.
TEST(PlanStoreTest, ATornRecordInTheMiddleLosesOnlyItself) {
  const std::string dir = TempDir();
  std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA);
  ASSERT_NE(store, nullptr);
  const std::string log = dir + "/" + kJobA + "/step-0.reports";
  std::vector<std::string> records;
  int64_t size = 0;
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(store->AppendReport(kJobA, 0, Report(i)).ok());
    records.push_back(ReadBytes(log).substr(size));
    size = FileSize(log);
  }
  ASSERT_EQ(records[0].substr(0, 4), "\xE2\x9C\x53\xB7");
  // Record 2 torn after half its bytes (its length still claims the whole, reaching into
  // record 3), record 4 with one body byte flipped.
  const std::string torn = records[2].substr(0, records[2].size() / 2);
  std::string flipped = records[4];
  flipped[flipped.size() - 3] ^= 0x40;
  WriteBytes(log, records[0] + records[1] + torn + records[3] + flipped + records[5]);

  absl::StatusOr<PlanStore::Loaded> loaded = store->LoadAll();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->jobs.size(), 1u);
  EXPECT_TRUE(loaded->failed.empty());
  const PlanStore::LoadedStep& step = loaded->jobs[0].steps.at(0);
  EXPECT_EQ(Ranks(step), (std::vector<int>{0, 1, 3, 5}));
  EXPECT_EQ(step.skipped_bytes, static_cast<int64_t>(torn.size() + flipped.size()));
  EXPECT_EQ(step.reports[2].micro_batches.size(), 4u);
}

// A report whose record would be over 64 MiB (the loader's limit on a record) is refused with
// its size, before anything is written; the log keeps what it had and takes the next one.
TEST(PlanStoreTest, AReportOverTheRecordLimitIsRefusedAndTheLogKeepsWhatItHad) {
  const std::string dir = TempDir();
  std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA);
  ASSERT_NE(store, nullptr);
  const std::string log = dir + "/" + kJobA + "/step-0.reports";
  ASSERT_TRUE(store->AppendReport(kJobA, 0, Report(0)).ok());
  const int64_t size = FileSize(log);
  StoredReport huge = Report(1, 1);
  DocumentRecallMeasurement& d = huge.micro_batches[0].documents.emplace_back();
  d.rows = 1;
  d.layer_recall.assign((64 << 20) / 8 + 1, 0.5);  // 8 bytes each, packed
  const absl::Status refused = store->AppendReport(kJobA, 0, huge);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("report: "), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("at most 67108864"), std::string::npos) << refused;
  EXPECT_EQ(FileSize(log), size);
  ASSERT_TRUE(store->AppendReport(kJobA, 0, Report(2)).ok());
  absl::StatusOr<PlanStore::Loaded> loaded = store->LoadAll();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(Ranks(loaded->jobs[0].steps.at(0)), (std::vector<int>{0, 2}));
  EXPECT_EQ(loaded->jobs[0].steps.at(0).skipped_bytes, 0);
}

TEST(PlanStoreTest, ALogOfThePreviousFormatLoadsAndIsRewrittenOnAppend) {
  const std::string dir = TempDir();
  std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA);
  ASSERT_NE(store, nullptr);
  // What the previous version wrote: a 4-byte little-endian length and the body; then a
  // record torn by a crash.
  std::string old_log;
  for (int i = 0; i < 3; ++i) {
    state::v1::ReportRecord encoded;
    EncodeReport(Report(i), &encoded);
    const std::string body = encoded.SerializeAsString();
    const uint32_t n = static_cast<uint32_t>(body.size());
    old_log += std::string{static_cast<char>(n & 0xff), static_cast<char>((n >> 8) & 0xff),
                           static_cast<char>((n >> 16) & 0xff), static_cast<char>(n >> 24)};
    old_log += body;
  }
  old_log += std::string("\x40\x00\x00\x00\x01", 5);
  const std::string log = dir + "/" + kJobA + "/step-0.reports";
  WriteBytes(log, old_log);

  absl::StatusOr<PlanStore::Loaded> loaded = store->LoadAll();
  ASSERT_TRUE(loaded.ok());
  ASSERT_EQ(loaded->jobs.size(), 1u);
  EXPECT_EQ(Ranks(loaded->jobs[0].steps.at(0)), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(loaded->jobs[0].steps.at(0).skipped_bytes, 5);

  // The next append rewrites the log in the framed format (never a mix of the two).
  ASSERT_TRUE(store->AppendReport(kJobA, 0, Report(3)).ok());
  EXPECT_EQ(ReadBytes(log).substr(0, 4), "\xE2\x9C\x53\xB7");
  loaded = store->LoadAll();
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(Ranks(loaded->jobs[0].steps.at(0)), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(loaded->jobs[0].steps.at(0).skipped_bytes, 0);
}

// A log that a machine crash left zero-filled (its length grown, its data never written: no
// --fsync_reports) holds no report. It was read as the previous format, each 4 zero bytes an
// empty report of rank 0, which restore took as rank 0's acknowledged report and which then
// refused rank 0's real one as a differing repeat.
TEST(PlanStoreTest, AZeroFilledLogHoldsNoReport) {
  const std::string dir = TempDir();
  std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA);
  ASSERT_NE(store, nullptr);
  const std::string log = dir + "/" + kJobA + "/step-0.reports";
  WriteBytes(log, std::string(4096, '\0'));
  absl::StatusOr<PlanStore::Loaded> loaded = store->LoadAll();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->jobs.size(), 1u);
  EXPECT_TRUE(loaded->failed.empty());
  EXPECT_TRUE(Ranks(loaded->jobs[0].steps.at(0)).empty());
  EXPECT_EQ(loaded->jobs[0].steps.at(0).skipped_bytes, 4096);
  // Rank 0's real report is taken, and the log holds it alone.
  ASSERT_TRUE(store->AppendReport(kJobA, 0, Report(0)).ok());
  loaded = store->LoadAll();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(Ranks(loaded->jobs[0].steps.at(0)), (std::vector<int>{0}));
  EXPECT_EQ(loaded->jobs[0].steps.at(0).reports[0].micro_batches.size(),
            Report(0).micro_batches.size());
  EXPECT_EQ(loaded->jobs[0].steps.at(0).skipped_bytes, 0);
}

// joins.log: ranks the snapshot lists and ranks the log adds are joined; a sync vouches only
// for bytes the log holds; a torn record loses only itself, a record naming a rank the job does
// not have is skipped, a join appended part way is cut back, and a retired job's folder is
// never re-created by a join.
TEST(PlanStoreTest, TheJoinsLogAddsRanksAndSurvivesTornAndFailedAppends) {
  const std::string dir = TempDir();
  std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA);
  ASSERT_NE(store, nullptr);
  StoredJob snapshot = Snapshot(kJobA);
  snapshot.settings.planner.ranks = 6;
  snapshot.model.speed_factors.assign(6, 1.0);
  snapshot.joined = {true, false, false, false, false, false};
  ASSERT_TRUE(store->SaveJob(snapshot).ok());
  const std::string log = dir + "/" + kJobA + "/joins.log";
  std::vector<std::string> records;
  int64_t end = 0;
  for (int rank : {2, 3, 9, 4}) {  // 9: not a rank of the job
    const int64_t size = std::max<int64_t>(FileSize(log), 0);
    absl::StatusOr<int64_t> appended = store->AppendJoin(kJobA, rank);
    ASSERT_TRUE(appended.ok()) << appended.status();
    EXPECT_EQ(*appended, FileSize(log));
    end = *appended;
    records.push_back(ReadBytes(log).substr(size));
  }
  EXPECT_TRUE(store->SyncJoins(kJobA, end).ok());
  // A log shorter than an append said it ended (cut back under it) is not called durable.
  const absl::Status short_log = store->SyncJoins(kJobA, end + 1);
  EXPECT_TRUE(IsStoreFailure(short_log)) << short_log;
  ASSERT_EQ(records[0].substr(0, 4), "\xE2\x9C\x53\xB7");
  // Rank 3's record torn after half its bytes.
  const std::string torn = records[1].substr(0, records[1].size() / 2);
  WriteBytes(log, records[0] + torn + records[2] + records[3]);

  // A join whose write lands in part (the file size limit, as for reports) is cut back.
  const int64_t before = FileSize(log);
  absl::Status failed;
  {
    test_support::FileSizeLimit limit(before + 3);
    failed = store->AppendJoin(kJobA, 5).status();
  }
  const int64_t after = FileSize(log);
  EXPECT_TRUE(IsStoreFailure(failed)) << failed;
  EXPECT_TRUE(absl::StrContains(failed.message(), log)) << failed;
  EXPECT_EQ(after, before);

  absl::StatusOr<PlanStore::Loaded> loaded = store->LoadAll();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->jobs.size(), 1u);
  EXPECT_TRUE(loaded->failed.empty());
  EXPECT_EQ(loaded->jobs[0].job.joined, (std::vector<bool>{true, false, true, false, true, false}));
  EXPECT_EQ(loaded->jobs[0].joins_skipped_bytes,
            static_cast<int64_t>(torn.size() + records[2].size()));

  ASSERT_TRUE(store->RetireJob(kJobA).ok());
  const absl::Status gone = store->AppendJoin(kJobA, 1).status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kFailedPrecondition) << gone;
  EXPECT_FALSE(IsStoreFailure(gone));
  const absl::Status gone_sync = store->SyncJoins(kJobA, end);
  EXPECT_EQ(gone_sync.code(), absl::StatusCode::kFailedPrecondition) << gone_sync;
  EXPECT_FALSE(Exists(dir + "/" + kJobA));
}

// A write that lands only in part (here the file size limit, EFBIG: deterministic and needs no
// privileges) is cut back, so the reports appended after it are not behind a torn record.
TEST(PlanStoreTest, APartialAppendIsCutBackSoLaterReportsFollowIt) {
  const std::string dir = TempDir();
  std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA);
  ASSERT_NE(store, nullptr);
  const std::string log = dir + "/" + kJobA + "/step-0.reports";
  ASSERT_TRUE(store->AppendReport(kJobA, 0, Report(0, 40)).ok());
  ASSERT_TRUE(store->AppendReport(kJobA, 0, Report(1, 40)).ok());
  const int64_t before = FileSize(log);
  const int64_t record = before / 2;

  absl::Status failed;
  absl::Status again;
  {
    test_support::FileSizeLimit limit(before + record / 2);
    failed = store->AppendReport(kJobA, 0, Report(2, 40));
    again = store->AppendReport(kJobA, 0, Report(3, 40));
  }
  const int64_t after = FileSize(log);

  EXPECT_EQ(failed.code(), absl::StatusCode::kResourceExhausted) << failed;
  EXPECT_TRUE(IsStoreFailure(failed));
  EXPECT_TRUE(absl::StartsWith(failed.message(), "state_dir: ")) << failed;
  EXPECT_TRUE(absl::StrContains(failed.message(), log)) << failed;
  EXPECT_TRUE(IsStoreFailure(again));
  EXPECT_EQ(after, before);  // half a record landed and was cut off again
  ASSERT_TRUE(store->AppendReport(kJobA, 0, Report(4, 40)).ok());
  ASSERT_TRUE(store->AppendReport(kJobA, 0, Report(5, 40)).ok());

  absl::StatusOr<PlanStore::Loaded> loaded = store->LoadAll();
  ASSERT_TRUE(loaded.ok());
  ASSERT_EQ(loaded->jobs.size(), 1u);
  EXPECT_EQ(Ranks(loaded->jobs[0].steps.at(0)), (std::vector<int>{0, 1, 4, 5}));
  EXPECT_EQ(loaded->jobs[0].steps.at(0).skipped_bytes, 0);
}

// Several reports in one append (a node's, from one ReportStepBatch call): all land, in order,
// or none does: an append that lands only in part (the file size limit midway through its
// second record) is cut back to the size before it, and the next one follows it cleanly.
TEST(PlanStoreTest, ReportsAppendedTogetherLandAllOrNone) {
  const std::string dir = TempDir();
  std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA);
  ASSERT_NE(store, nullptr);
  const std::string log = dir + "/" + kJobA + "/step-0.reports";
  const std::vector<StoredReport> first = {Report(0, 40), Report(1, 40)};
  ASSERT_TRUE(store->AppendReports(kJobA, 0, first).ok());
  const int64_t before = FileSize(log);
  const int64_t record = before / 2;

  const std::vector<StoredReport> second = {Report(2, 40), Report(3, 40), Report(4, 40)};
  absl::Status failed;
  {
    test_support::FileSizeLimit limit(before + record + record / 2);
    failed = store->AppendReports(kJobA, 0, second);
  }
  const int64_t after = FileSize(log);

  EXPECT_EQ(failed.code(), absl::StatusCode::kResourceExhausted) << failed;
  EXPECT_TRUE(IsStoreFailure(failed));
  EXPECT_EQ(after, before);  // a record and a half landed and were cut off again
  const std::vector<StoredReport> third = {Report(5, 40), Report(6, 40)};
  ASSERT_TRUE(store->AppendReports(kJobA, 0, third).ok());

  absl::StatusOr<PlanStore::Loaded> loaded = store->LoadAll();
  ASSERT_TRUE(loaded.ok());
  ASSERT_EQ(loaded->jobs.size(), 1u);
  EXPECT_EQ(Ranks(loaded->jobs[0].steps.at(0)), (std::vector<int>{0, 1, 5, 6}));
  EXPECT_EQ(loaded->jobs[0].steps.at(0).skipped_bytes, 0);
}

// A write larger than any probe (StoreHealth::kMaxProbeBytes) is shown to fit again by the file
// system's free space: a probe that writes less passes where the write would fail, and health
// turned SERVING between every step's failures.
TEST(PlanStoreTest, AProbeAsksTheFileSystemForTheRoomOfALargerWrite) {
  TmpfsMount disk("8m");
  if (!disk.mounted()) GTEST_SKIP() << "no tmpfs: " << disk.error();
  const std::string dir = disk.path() + "/state";
  absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir, true);
  ASSERT_TRUE(store.ok()) << store.status();
  const int64_t mib = int64_t{1} << 20;
  EXPECT_TRUE((*store)->CheckWritable(mib).ok());
  EXPECT_TRUE((*store)->CheckWritable(mib, 4 * mib).ok());
  const absl::Status short_of_room = (*store)->CheckWritable(mib, 64 * mib);
  EXPECT_EQ(short_of_room.code(), absl::StatusCode::kResourceExhausted) << short_of_room;
  EXPECT_TRUE(IsStoreFailure(short_of_room));
  EXPECT_TRUE(absl::StrContains(short_of_room.message(),
                                absl::StrCat("bytes free, less than the ", 64 * mib)))
      << short_of_room;
  // The probe's own file (.write-probe-*.tmp) is gone either way.
  DIR* d = opendir(dir.c_str());
  ASSERT_NE(d, nullptr) << std::strerror(errno);
  while (dirent* e = readdir(d)) EXPECT_FALSE(absl::EndsWith(e->d_name, ".tmp")) << e->d_name;
  closedir(d);
}

// The incident, for real: a small tmpfs fills up while reports are appended, space comes back,
// more are appended. Every report acknowledged OK is loaded, none after a torn record.
TEST(PlanStoreTest, AFullDiskLosesNoAcknowledgedReport) {
  TmpfsMount disk("256k");
  if (!disk.mounted()) GTEST_SKIP() << "no tmpfs to fill: " << disk.error();
  const std::string dir = disk.path() + "/state";
  std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA, /*fsync_reports=*/true);
  ASSERT_NE(store, nullptr);
  std::vector<int> acknowledged;
  int next = 0;
  // Records of some 4.6 KB: each spans a page boundary, so the failing one lands in part.
  ASSERT_TRUE(store->AppendReport(kJobA, 0, Report(next, 100)).ok());
  acknowledged.push_back(next++);

  // Fill the disk, then give back 3 pages.
  const std::string filler = disk.path() + "/filler";
  const int fd = open(filler.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  const std::string page(4096, 'f');
  int64_t filled = 0;
  while (true) {
    const ssize_t n = write(fd, page.data(), page.size());
    if (n <= 0) break;
    filled += n;
  }
  ASSERT_EQ(errno, ENOSPC);
  ASSERT_EQ(ftruncate(fd, filled - 3 * 4096), 0);
  close(fd);

  absl::Status failure;
  for (int i = 0; i < 100 && failure.ok(); ++i) {
    failure = store->AppendReport(kJobA, 0, Report(next, 100));
    if (failure.ok()) acknowledged.push_back(next);
    ++next;
  }
  ASSERT_FALSE(failure.ok()) << "the disk never filled";
  EXPECT_GE(acknowledged.size(), 2u);
  EXPECT_EQ(failure.code(), absl::StatusCode::kResourceExhausted) << failure;
  EXPECT_TRUE(IsStoreFailure(failure));
  EXPECT_TRUE(absl::StrContains(failure.message(), std::strerror(ENOSPC))) << failure;
  // More failures while full, of every kind of write; none leaves a torn record or a *.tmp.
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(store->AppendReport(kJobA, 0, Report(next++, 100)).code(),
              absl::StatusCode::kResourceExhausted);
  }
  const absl::Status step = SaveStep(*store, kJobA, 1);
  EXPECT_EQ(step.code(), absl::StatusCode::kResourceExhausted) << step;
  EXPECT_TRUE(IsStoreFailure(store->CheckWritable()));
  EXPECT_FALSE(Exists(dir + "/" + kJobA + "/step-1.pb.tmp"));

  // Space comes back.
  ASSERT_EQ(unlink(filler.c_str()), 0);
  EXPECT_TRUE(store->CheckWritable().ok());
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(store->AppendReport(kJobA, 0, Report(next, 100)).ok());
    acknowledged.push_back(next++);
  }
  store.reset();  // the planner restarts

  absl::StatusOr<std::unique_ptr<PlanStore>> reopened = PlanStore::Open(dir, true);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  absl::StatusOr<PlanStore::Loaded> loaded = (*reopened)->LoadAll();
  ASSERT_TRUE(loaded.ok());
  ASSERT_EQ(loaded->jobs.size(), 1u);
  ASSERT_EQ(loaded->jobs[0].steps.size(), 1u);
  EXPECT_EQ(Ranks(loaded->jobs[0].steps[0]), acknowledged);
  EXPECT_EQ(loaded->jobs[0].steps[0].skipped_bytes, 0);
}

TEST(PlanStoreTest, AReadOnlyDiskIsAStoreFailureAndOpenRefusesIt) {
  TmpfsMount disk("256k");
  if (!disk.mounted()) GTEST_SKIP() << "no tmpfs to remount read-only: " << disk.error();
  const std::string dir = disk.path() + "/state";
  std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(disk.Remount(/*read_only=*/true)) << std::strerror(errno);

  const std::string read_only = std::strerror(EROFS);
  for (const absl::Status& s : {store->SaveJob(Snapshot(kJobA)), SaveStep(*store, kJobA, 1),
                                store->AppendReport(kJobA, 0, Report(0)),
                                store->CreateJob(Snapshot(kJobB)), store->CheckWritable()}) {
    EXPECT_TRUE(IsStoreFailure(s)) << s;
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_TRUE(absl::StartsWith(s.message(), "state_dir: ")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), read_only)) << s;
  }
  absl::StatusOr<std::unique_ptr<PlanStore>> reopened = PlanStore::Open(dir, false);
  ASSERT_FALSE(reopened.ok());
  EXPECT_TRUE(IsStoreFailure(reopened.status()));
  EXPECT_TRUE(absl::StrContains(reopened.status().message(), dir)) << reopened.status();
  EXPECT_TRUE(absl::StrContains(reopened.status().message(), read_only)) << reopened.status();
  // What is there still loads.
  absl::StatusOr<PlanStore::Loaded> loaded = store->LoadAll();
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(loaded->jobs.size(), 1u);
  store.reset();
  EXPECT_TRUE(disk.Remount(/*read_only=*/false));
}

TEST(PlanStoreTest, OpenSweepsTmpFilesAndFinishesInterruptedRemovals) {
  const std::string dir = TempDir();
  {
    std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA);
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->CreateJob(Snapshot(kJobB)).ok());
    ASSERT_TRUE(SaveStep(*store, kJobB, 0).ok());
    ASSERT_TRUE(store->RetireJob(kJobB).ok());  // a crash before RemoveRetired
  }
  // What a crash mid-write leaves, and an empty folder (a crash inside CreateJob).
  WriteBytes(dir + "/stray.tmp", "x");
  WriteBytes(dir + "/" + kJobA + "/job.pb.tmp", "half a snapshot");
  WriteBytes(dir + "/" + kJobA + "/step-1.pb.tmp", "half a step");
  ASSERT_EQ(mkdir((dir + "/" + kJobC).c_str(), 0700), 0);
  ASSERT_TRUE(Exists(dir + "/.deleted-" + kJobB));

  absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir, false);
  ASSERT_TRUE(store.ok());
  EXPECT_FALSE(Exists(dir + "/stray.tmp"));
  EXPECT_FALSE(Exists(dir + "/" + kJobA + "/job.pb.tmp"));
  EXPECT_FALSE(Exists(dir + "/" + kJobA + "/step-1.pb.tmp"));
  EXPECT_FALSE(Exists(dir + "/.deleted-" + kJobB));
  absl::StatusOr<PlanStore::Loaded> loaded = (*store)->LoadAll();
  ASSERT_TRUE(loaded.ok());
  ASSERT_EQ(loaded->jobs.size(), 1u);
  EXPECT_EQ(loaded->jobs[0].job_id, kJobA);
  EXPECT_EQ(loaded->jobs[0].job.token, std::string(64, 't'));
  EXPECT_TRUE(loaded->failed.empty());
  EXPECT_FALSE(Exists(dir + "/" + kJobC));
}

TEST(PlanStoreTest, ADroppedStepsRecordIsWrittenOverByTheNextStepAndCutToItsLength) {
  const std::string dir = TempDir();
  std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA);
  ASSERT_NE(store, nullptr);
  const std::string job_dir = dir + "/" + kJobA;
  const std::string spare = job_dir + "/spare-step.pb.tmp";
  // Step 1: a large record (a batch of 64 ranks' samples), then dropped.
  StepPlan plan;
  plan.deferred_ids = {3};
  ASSERT_TRUE(store->SaveStep(kJobA, 1, Batch(5, 64), plan, /*folded=*/true).ok());
  const int64_t large = FileSize(job_dir + "/step-1.pb");
  ASSERT_TRUE(store->DropStep(kJobA, 1).ok());
  EXPECT_FALSE(Exists(job_dir + "/step-1.pb"));
  struct stat dropped;
  ASSERT_EQ(lstat(spare.c_str(), &dropped), 0);
  EXPECT_EQ(dropped.st_size, large);
  // Step 2, a small record, is written into the dropped file and cut to its own length: the
  // same bytes as the same record in a new file (job B has no spare).
  ASSERT_TRUE(SaveStep(*store, kJobA, 2).ok());
  ASSERT_TRUE(store->CreateJob(Snapshot(kJobB)).ok());
  ASSERT_TRUE(SaveStep(*store, kJobB, 2).ok());
  EXPECT_FALSE(Exists(spare));
  struct stat written;
  ASSERT_EQ(lstat((job_dir + "/step-2.pb").c_str(), &written), 0);
  EXPECT_EQ(written.st_ino, dropped.st_ino);
  EXPECT_LT(written.st_size, large);
  const std::string over = ReadBytes(job_dir + "/step-2.pb");
  const std::string fresh = ReadBytes(dir + "/" + kJobB + "/step-2.pb");
  EXPECT_EQ(over.size(), fresh.size());
  EXPECT_TRUE(over == fresh) << "the record written over the spare differs from a new one";
  // No spare now: the next step goes to a new file.
  ASSERT_TRUE(SaveStep(*store, kJobA, 3).ok());
  absl::StatusOr<PlanStore::Loaded> loaded = store->LoadAll();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->jobs.size(), 2u);
  EXPECT_TRUE(loaded->failed.empty());
  std::vector<int64_t> steps;
  for (const PlanStore::LoadedStep& step : loaded->jobs[0].steps) {
    steps.push_back(step.step);
    EXPECT_TRUE(step.batch.empty()) << "step " << step.step;
    EXPECT_EQ(step.plan.deferred_ids, (std::vector<uint64_t>{7})) << "step " << step.step;
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{0, 2, 3}));

  // A spare that is not a regular file is left alone and the step goes to a new file: a
  // folder, and a symlink (not followed to what it names).
  ASSERT_EQ(mkdir(spare.c_str(), 0700), 0);
  ASSERT_TRUE(SaveStep(*store, kJobA, 4).ok());
  struct stat st;
  ASSERT_EQ(lstat(spare.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  ASSERT_EQ(rmdir(spare.c_str()), 0);
  const std::string outside = dir + "-outside";
  WriteBytes(outside, "not the store's");
  ASSERT_EQ(symlink(outside.c_str(), spare.c_str()), 0);
  ASSERT_TRUE(SaveStep(*store, kJobA, 5).ok());
  EXPECT_EQ(ReadBytes(outside), "not the store's");
  ASSERT_EQ(lstat(spare.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  ASSERT_EQ(lstat((job_dir + "/step-5.pb").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  loaded = store->LoadAll();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->jobs[0].steps.back().step, 5);
  // A restart sweeps the spare with the other temporary files.
  ASSERT_TRUE(store->DropStep(kJobA, 2).ok());
  ASSERT_TRUE(Exists(spare));
  store.reset();
  ASSERT_TRUE(PlanStore::Open(dir, false).ok());
  EXPECT_FALSE(Exists(spare));
}

TEST(PlanStoreTest, CreateJobNeverReusesAFolderAndNothingRecreatesARetiredJob) {
  const std::string dir = TempDir();
  std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA);
  ASSERT_NE(store, nullptr);
  const absl::Status again = store->CreateJob(Snapshot(kJobA));
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists) << again;
  EXPECT_FALSE(IsStoreFailure(again));
  ASSERT_TRUE(store->AppendReport(kJobA, 0, Report(0)).ok());  // a log held open

  ASSERT_TRUE(store->RetireJob(kJobA).ok());
  EXPECT_FALSE(Exists(dir + "/" + kJobA));
  EXPECT_TRUE(Exists(dir + "/.deleted-" + kJobA));
  EXPECT_TRUE(store->LoadAll()->jobs.empty());
  // A save racing the delete is refused, and is no store failure.
  for (const absl::Status& s :
       {store->SaveJob(Snapshot(kJobA)), store->SaveJob(Snapshot(kJobA), false),
        SaveStep(*store, kJobA, 1), store->AppendReport(kJobA, 0, Report(1))}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_FALSE(IsStoreFailure(s));
  }
  EXPECT_FALSE(Exists(dir + "/" + kJobA));

  store->RemoveRetired(kJobA);
  EXPECT_FALSE(Exists(dir + "/.deleted-" + kJobA));
  EXPECT_TRUE(store->RetireJob(kJobA).ok());  // nothing left to retire
  EXPECT_EQ(CountFiles(dir), 0);
  EXPECT_TRUE(store->CreateJob(Snapshot(kJobA)).ok());  // the id is free again
}

TEST(PlanStoreTest, UnparsableFilesQuarantineOnlyTheirJob) {
  const std::string dir = TempDir();
  std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->AppendReport(kJobA, 0, Report(0)).ok());
  for (const char* id : {kJobB, kJobC, kJobD, kJobE}) {
    ASSERT_TRUE(store->CreateJob(Snapshot(id)).ok());
    ASSERT_TRUE(SaveStep(*store, id, 0).ok());
  }
  // B: job.pb truncated inside its name field; C: garbage step-1.pb; D: a FIFO for job.pb
  // (reading it must not block); E: a snapshot naming another job (the folder's name wins).
  const std::string b_job = dir + "/" + kJobB + "/job.pb";
  WriteBytes(b_job, ReadBytes(b_job).substr(0, 30));
  WriteBytes(dir + "/" + kJobC + "/step-1.pb", "\xff\xff\xff\xff garbage");
  const std::string d_job = dir + "/" + kJobD + "/job.pb";
  ASSERT_EQ(unlink(d_job.c_str()), 0);
  ASSERT_EQ(mkfifo(d_job.c_str(), 0600), 0);
  ASSERT_TRUE(store->SaveJob(Snapshot("zzzzzzzz99999999")).code() ==
              absl::StatusCode::kFailedPrecondition);
  WriteBytes(dir + "/" + kJobE + "/job.pb",
             EncodeJob(Snapshot("zzzzzzzz99999999")).SerializeAsString());

  absl::StatusOr<PlanStore::Loaded> loaded = store->LoadAll();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->jobs.size(), 2u);
  EXPECT_EQ(loaded->jobs[0].job_id, kJobA);
  EXPECT_EQ(Ranks(loaded->jobs[0].steps.at(0)), std::vector<int>{0});
  EXPECT_EQ(loaded->jobs[1].job_id, kJobE);
  EXPECT_EQ(loaded->jobs[1].job.job_id, "zzzzzzzz99999999");
  ASSERT_EQ(loaded->failed.size(), 3u);
  const std::vector<std::pair<std::string, std::string>> expected = {
      {kJobB, "job.pb"}, {kJobC, "step-1.pb"}, {kJobD, "not a regular file"}};
  for (size_t i = 0; i < expected.size(); ++i) {
    const PlanStore::FailedJob& failed = loaded->failed[i];
    EXPECT_EQ(failed.job_id, expected[i].first);
    EXPECT_TRUE(absl::StrContains(failed.reason, expected[i].second)) << failed.reason;
    EXPECT_EQ(failed.path, dir + "/quarantine/" + expected[i].first);
    EXPECT_FALSE(Exists(dir + "/" + expected[i].first));
    EXPECT_TRUE(Exists(failed.path + "/step-0.pb"));
    EXPECT_EQ(ReadBytes(failed.path + "/REASON"), failed.reason + "\n");
  }

  // Listed again after a restart, with the same reasons, until deleted.
  const std::vector<PlanStore::FailedJob> first = loaded->failed;
  store.reset();
  absl::StatusOr<std::unique_ptr<PlanStore>> reopened = PlanStore::Open(dir, false);
  ASSERT_TRUE(reopened.ok());
  loaded = (*reopened)->LoadAll();
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(loaded->jobs.size(), 2u);
  ASSERT_EQ(loaded->failed.size(), 3u);
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(loaded->failed[i].job_id, first[i].job_id);
    EXPECT_EQ(loaded->failed[i].reason, first[i].reason);
  }
  ASSERT_TRUE((*reopened)->DeleteQuarantined(kJobB).ok());
  EXPECT_EQ((*reopened)->DeleteQuarantined(kJobB).code(), absl::StatusCode::kNotFound);
  loaded = (*reopened)->LoadAll();
  ASSERT_EQ(loaded->failed.size(), 2u);
  EXPECT_EQ(loaded->failed[0].job_id, kJobC);
  EXPECT_FALSE(Exists(dir + "/quarantine/" + kJobB));
}

// Defect: step records and job.pb carried no checksum, so a byte changed on disk was loaded and
// served whenever the result still parsed (a density of 2.6e-211). They are framed now: each
// change below still parses as a valid record, and each quarantines its job alone, naming the
// file and what does not check. Files of the previous format (the bare message) still load.
TEST(PlanStoreTest, AChangedByteInAStepRecordOrSnapshotQuarantinesItsJob) {
  const std::string dir = TempDir();
  std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA);
  ASSERT_NE(store, nullptr);
  for (const char* id : {kJobB, kJobC, kJobD, kJobE}) {
    ASSERT_TRUE(store->CreateJob(Snapshot(id)).ok());
    ASSERT_TRUE(SaveStep(*store, id, 0).ok());
  }
  const auto change = [&](const char* id, const std::string& file,
                          const std::function<void(std::string*)>& edit) {
    const std::string path = absl::StrCat(dir, "/", id, "/", file);
    std::string bytes = ReadBytes(path);
    edit(&bytes);
    WriteBytes(path, bytes);
  };
  // B: the deferred id 7 (the record's last byte) becomes 6. C: one bit of the magic word.
  // D: one letter of the job's name in job.pb. E: a byte more at the end of the record.
  change(kJobB, "step-0.pb", [](std::string* b) { b->back() ^= 1; });
  change(kJobC, "step-0.pb", [](std::string* b) { (*b)[0] ^= 1; });
  change(kJobD, "job.pb", [](std::string* b) { (*b)[b->find("nnnn")] = 'm'; });
  change(kJobE, "step-0.pb", [](std::string* b) { b->push_back('\0'); });
  {
    state::v1::StepRecord record;  // what B's record says now, its frame aside
    const std::string bytes = ReadBytes(absl::StrCat(dir, "/", kJobB, "/step-0.pb"));
    ASSERT_TRUE(record.ParseFromString(bytes.substr(12)));
    EXPECT_EQ(record.deferred_ids(0), 6u);
  }

  store.reset();
  absl::StatusOr<std::unique_ptr<PlanStore>> reopened = PlanStore::Open(dir, false);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  absl::StatusOr<PlanStore::Loaded> loaded = (*reopened)->LoadAll();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->jobs.size(), 1u);
  EXPECT_EQ(loaded->jobs[0].job_id, kJobA);
  EXPECT_EQ(loaded->jobs[0].steps.at(0).plan.deferred_ids, std::vector<uint64_t>{7});
  const std::vector<std::pair<std::string, std::vector<std::string>>> expected = {
      {kJobB, {"step-0.pb", "CRC32C"}},
      {kJobC, {"step-0.pb", "magic word"}},
      {kJobD, {"job.pb", "CRC32C"}},
      {kJobE, {"step-0.pb", "header says"}}};
  ASSERT_EQ(loaded->failed.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const PlanStore::FailedJob& failed = loaded->failed[i];
    EXPECT_EQ(failed.job_id, expected[i].first);
    for (const std::string& part : expected[i].second) {
      EXPECT_TRUE(absl::StrContains(failed.reason, part)) << failed.reason;
    }
    EXPECT_TRUE(Exists(dir + "/quarantine/" + expected[i].first));
  }

  // A's files as the previous format wrote them (no frame): they load as before, and are left
  // as they are until the store writes them again (then framed).
  for (const char* file : {"job.pb", "step-0.pb"}) {
    const std::string path = absl::StrCat(dir, "/", kJobA, "/", file);
    const std::string bytes = ReadBytes(path);
    bool legacy = true;
    ASSERT_TRUE(StateFileBody(bytes, path, &legacy).ok());
    EXPECT_FALSE(legacy);
    WriteBytes(path, bytes.substr(12));
  }
  absl::StatusOr<PlanStore::Loaded> old_format = (*reopened)->LoadAll();
  ASSERT_TRUE(old_format.ok()) << old_format.status();
  ASSERT_EQ(old_format->jobs.size(), 1u);
  EXPECT_EQ(old_format->jobs[0].job.name, Snapshot(kJobA).name);
  EXPECT_EQ(old_format->jobs[0].steps.at(0).plan.deferred_ids, std::vector<uint64_t>{7});
  const std::string job_path = absl::StrCat(dir, "/", kJobA, "/job.pb");
  bool legacy = false;
  const std::string old_job = ReadBytes(job_path);
  ASSERT_TRUE(StateFileBody(old_job, job_path, &legacy).ok());
  EXPECT_TRUE(legacy);
  ASSERT_TRUE((*reopened)->SaveJob(Snapshot(kJobA)).ok());
  const std::string new_job = ReadBytes(job_path);
  ASSERT_TRUE(StateFileBody(new_job, job_path, &legacy).ok());
  EXPECT_FALSE(legacy);
  EXPECT_EQ(new_job, FrameStateFile(old_job));
}

// Only folders named like job ids are the store's: symlinks, files and other names at the top
// level are neither loaded nor moved nor deleted, and no removal follows a symlink out.
TEST(PlanStoreTest, NothingOutsideTheStateDirIsTouched) {
  const std::string dir = TempDir();
  std::unique_ptr<PlanStore> store = StoreWithJob(dir, kJobA);
  ASSERT_NE(store, nullptr);
  const std::string outside = dir + "-outside";
  ASSERT_EQ(mkdir(outside.c_str(), 0700), 0);
  WriteBytes(outside + "/job.pb", EncodeJob(Snapshot(kJobB)).SerializeAsString());
  WriteBytes(outside + "/precious", "keep me");
  ASSERT_EQ(symlink(outside.c_str(), (dir + "/" + kJobB).c_str()), 0);
  WriteBytes(dir + "/" + kJobC, "a file named like a job");
  ASSERT_EQ(mkdir((dir + "/Not-A-Job").c_str(), 0700), 0);
  WriteBytes(dir + "/Not-A-Job/job.pb", "garbage");
  // Inside a job folder: a symlink out (removed with the job, its target kept).
  ASSERT_EQ(symlink(outside.c_str(), (dir + "/" + kJobA + "/link").c_str()), 0);
  // A retired "job" that is a symlink out: Open() removes the link, not what it points to.
  ASSERT_EQ(symlink(outside.c_str(), (dir + "/.deleted-" + kJobD).c_str()), 0);

  store.reset();
  absl::StatusOr<std::unique_ptr<PlanStore>> reopened = PlanStore::Open(dir, false);
  ASSERT_TRUE(reopened.ok());
  EXPECT_FALSE(Exists(dir + "/.deleted-" + kJobD));
  absl::StatusOr<PlanStore::Loaded> loaded = (*reopened)->LoadAll();
  ASSERT_TRUE(loaded.ok());
  ASSERT_EQ(loaded->jobs.size(), 1u);
  EXPECT_EQ(loaded->jobs[0].job_id, kJobA);
  EXPECT_TRUE(loaded->failed.empty());
  EXPECT_TRUE(Exists(dir + "/Not-A-Job/job.pb"));
  EXPECT_TRUE(Exists(dir + "/" + kJobC));
  EXPECT_EQ((*reopened)->Quarantine(kJobB, "test").code(), absl::StatusCode::kFailedPrecondition);

  ASSERT_TRUE((*reopened)->RetireJob(kJobA).ok());
  (*reopened)->RemoveRetired(kJobA);
  EXPECT_FALSE(Exists(dir + "/.deleted-" + kJobA));
  ASSERT_TRUE((*reopened)->RetireJob(kJobB).ok());  // the symlink itself moves
  (*reopened)->RemoveRetired(kJobB);
  EXPECT_FALSE(Exists(dir + "/.deleted-" + kJobB));
  EXPECT_EQ(ReadBytes(outside + "/precious"), "keep me");
  EXPECT_TRUE(Exists(outside + "/job.pb"));
}

// ---- The bytes each job keeps, and the bound on them ----

// A job's bytes are the sizes of the files in its folder after every kind of write (create,
// joins, step records, reports, a step switched to its local plan, snapshots, steps dropped from
// the history), kept without a walk of the folder; a restart counts the same from the files it
// finds, and deleting the job ends its count.
TEST(PlanStoreTest, AJobsBytesAreItsFilesSizesThroughEveryWriteAndARestart) {
  const std::string dir = TempDir();
  StoredOptions stored = OptionsWithStore(dir, false);
  ASSERT_NE(stored.store, nullptr);
  std::map<std::string, int64_t> observed;  // the observer's last word per job
  stored.store->set_job_bytes_observer(
      [&observed](const std::string& job_id, int64_t bytes) { observed[job_id] = bytes; });
  constexpr int kRanks = 3;
  std::string id;
  std::string job_dir;
  auto counted = [&](const std::string& after) {
    EXPECT_EQ(stored.store->JobBytes(id), FolderBytes(job_dir)) << "after " << after;
    EXPECT_EQ(observed[id], stored.store->JobBytes(id)) << "after " << after;
  };
  int64_t before_restart = 0;
  int64_t spare = 0;
  {
    JobRegistry registry(stored.options, CountingHex());
    absl::StatusOr<CreatedJob> job =
        registry.CreateJob("counted", test_support::SmallJob(kRanks, /*history_steps=*/3), "");
    ASSERT_TRUE(job.ok()) << job.status();
    id = job->job_id;
    job_dir = dir + "/" + id;
    counted("CreateJob");
    EXPECT_GT(stored.store->JobBytes(id), 0);
    for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(registry.JoinJob(id, r).ok());
    counted("JoinJob");
    for (int64_t step = 0; step < 6; ++step) {
      absl::StatusOr<SubmitResult> result =
          registry.SubmitBatch(id, step, Batch(40 + step, kRanks));
      ASSERT_TRUE(result.ok()) << result.status();
      counted(absl::StrCat("SubmitBatch of step ", step));
      for (int r = 0; r < kRanks; ++r) {
        ASSERT_TRUE(registry.ReportStep(id, step, r, MeasureRecall(*result->plan, r), 0.0).ok());
      }
      counted(absl::StrCat("the reports of step ", step));
      EXPECT_EQ(registry.GetJob(id)->state_bytes, stored.store->JobBytes(id));
    }
    // Step 6 switched to the trainer's local plan before any report: its record is replaced.
    ASSERT_TRUE(registry.SubmitBatch(id, 6, Batch(50, kRanks)).ok());
    absl::StatusOr<SubmitResult> local =
        registry.SubmitBatch(id, 6, Batch(50, kRanks), /*planned_locally=*/true);
    ASSERT_TRUE(local.ok()) << local.status();
    ASSERT_TRUE(local->switched_to_local);
    counted("the switch to the local plan");
    // A shorter history drops the oldest steps' files at once.
    const int64_t before_trim = stored.store->JobBytes(id);
    JobSettings shorter;
    shorter.history_steps = 1;
    ASSERT_TRUE(registry.UpdateJobConfig(id, shorter, {"history_steps"}).ok());
    counted("UpdateJobConfig history_steps 1");
    EXPECT_LT(stored.store->JobBytes(id), before_trim);
    before_restart = stored.store->JobBytes(id);
    spare = FileSize(job_dir + "/spare-step.pb.tmp");
    ASSERT_GT(spare, 0);  // the last step dropped, kept for the next step to write over
  }
  // The restart counts the files it finds: the same bytes, but for the spare record, a
  // temporary file that Open sweeps.
  stored.store.reset();
  StoredOptions reopened = OptionsWithStore(dir, false);
  ASSERT_NE(reopened.store, nullptr);
  JobRegistry restored(reopened.options, CountingHex());
  ASSERT_TRUE(restored.Restore().ok());
  EXPECT_EQ(reopened.store->JobBytes(id), before_restart - spare);
  EXPECT_EQ(reopened.store->JobBytes(id), FolderBytes(job_dir));
  EXPECT_EQ(restored.GetJob(id)->state_bytes, before_restart - spare);
  ASSERT_TRUE(restored.DeleteJob(id).ok());
  EXPECT_EQ(reopened.store->JobBytes(id), 0);
}

// The store's bound, exactly: a report append or step record that would pass it is refused
// whole (the log keeps its records, nothing of the refused one lands) with RESOURCE_EXHAUSTED
// and the reason JOB_STATE_QUOTA, never a store failure, naming the job, its bytes and the
// flag; another job is not held to the first one's bytes. job.pb and joins.log are counted but
// not refused; a dropped step makes room again.
TEST(PlanStoreTest, AWritePastTheBoundIsRefusedWholeAndTheJobKeepsWhatItHad) {
  // One report record's bytes, and a job's with its step 0, measured on an unbounded store.
  int64_t base = 0;
  int64_t report = 0;
  {
    std::unique_ptr<PlanStore> probe = StoreWithJob(TempDir(), kJobA);
    ASSERT_NE(probe, nullptr);
    base = probe->JobBytes(kJobA);
    ASSERT_TRUE(probe->AppendReport(kJobA, 0, Report(1)).ok());
    report = probe->JobBytes(kJobA) - base;
    ASSERT_GT(report, 0);
  }
  // Room for step 0 and two reports, and half a report more (reports 1 to 9 are of one size).
  const int64_t bound = base + 2 * report + report / 2;
  const std::string dir = TempDir();
  absl::StatusOr<std::unique_ptr<PlanStore>> opened = PlanStore::Open(dir, false, bound);
  ASSERT_TRUE(opened.ok()) << opened.status();
  PlanStore& store = **opened;
  ASSERT_TRUE(store.CreateJob(Snapshot(kJobA)).ok());
  ASSERT_TRUE(SaveStep(store, kJobA, 0).ok());
  ASSERT_TRUE(store.CreateJob(Snapshot(kJobB)).ok());
  ASSERT_TRUE(store.AppendReport(kJobA, 0, Report(1)).ok());
  ASSERT_TRUE(store.AppendReport(kJobA, 0, Report(2)).ok());
  const std::string log = dir + "/" + kJobA + "/step-0.reports";
  const int64_t log_bytes = FileSize(log);
  const int64_t held = store.JobBytes(kJobA);
  EXPECT_EQ(held, base + 2 * report);

  // A step record of some hundred samples: larger than the room left.
  StepPlan plan;
  plan.deferred_ids = {7};
  for (const absl::Status& refused :
       {store.AppendReport(kJobA, 0, Report(3)),
        store.AppendReports(kJobA, 0, {Report(3), Report(4)}),
        store.SaveStep(kJobA, 1, Batch(5, 8), plan, /*folded=*/false)}) {
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
    EXPECT_TRUE(IsJobStateQuota(refused)) << refused;
    EXPECT_FALSE(IsStoreFailure(refused)) << refused;
    EXPECT_THAT(std::string(refused.message()),
                ::testing::AllOf(::testing::HasSubstr(
                                     absl::StrCat("job \"", kJobA, "\" keeps ", held, " bytes")),
                                 ::testing::HasSubstr(absl::StrCat("bound of ", bound, " bytes")),
                                 ::testing::HasSubstr("--max_job_state_mb")));
  }
  EXPECT_EQ(FileSize(log), log_bytes);
  EXPECT_FALSE(Exists(dir + "/" + kJobA + "/step-1.pb"));
  EXPECT_EQ(store.JobBytes(kJobA), held);
  EXPECT_EQ(store.JobBytes(kJobA), FolderBytes(dir + "/" + kJobA));
  // Job B has its own bytes: its reports are taken.
  ASSERT_TRUE(SaveStep(store, kJobB, 0).ok());
  ASSERT_TRUE(store.AppendReports(kJobB, 0, {Report(1), Report(2)}).ok());

  // The job's snapshot and joins are never refused, even past the bound; a job past it has no
  // room for a new step at all.
  StoredJob larger = Snapshot(kJobA);
  larger.fold_failure = std::string(1000, 'f');
  ASSERT_TRUE(store.SaveJob(larger).ok());
  ASSERT_TRUE(store.AppendJoin(kJobA, 1).ok());
  EXPECT_GT(store.JobBytes(kJobA), bound);
  EXPECT_EQ(store.JobBytes(kJobA), FolderBytes(dir + "/" + kJobA));
  EXPECT_TRUE(IsJobStateQuota(store.CheckJobRoom(kJobA)));
  EXPECT_TRUE(store.CheckJobRoom(kJobB).ok());

  // What it stored loads whole; dropping step 0 makes room for the next step.
  absl::StatusOr<PlanStore::Loaded> loaded = store.LoadAll();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->jobs.size(), 2u);
  ASSERT_EQ(loaded->jobs[0].steps.size(), 1u);
  EXPECT_EQ(Ranks(loaded->jobs[0].steps[0]), (std::vector<int>{1, 2}));
  EXPECT_EQ(loaded->jobs[0].steps[0].skipped_bytes, 0);
  ASSERT_TRUE(store.SaveJob(Snapshot(kJobA)).ok());
  ASSERT_TRUE(store.DropStep(kJobA, 0).ok());
  EXPECT_TRUE(store.CheckJobRoom(kJobA).ok());
  EXPECT_TRUE(SaveStep(store, kJobA, 1).ok());
  EXPECT_EQ(store.JobBytes(kJobA), FolderBytes(dir + "/" + kJobA));
}

// The defect: one job's caller could fill the state directory shared by every job, after
// which every write failed as a store failure (health NOT_SERVING) and every job's calls with
// it. Now a job at its bound is refused alone: its new steps and the reports that do not fit
// are RESOURCE_EXHAUSTED (JOB_STATE_QUOTA) naming it, another job goes on submitting and
// reporting, no store failure is reported, and what the job stored reloads whole after a
// restart with the same bytes counted. A shorter history makes room again.
TEST(PlanStoreTest, AJobPastItsBoundIsRefusedAloneAndKeepsWhatItStored) {
  constexpr int kRanks = 4;
  // The bound: the big job once created, and some eight steps of it, measured on an unbounded
  // store (the same ids and batches: the same bytes).
  int64_t bound = 0;
  {
    StoredOptions probe = OptionsWithStore(TempDir(), false);
    ASSERT_NE(probe.store, nullptr);
    JobRegistry registry(probe.options, CountingHex());
    CreatedJob job;
    ASSERT_NO_FATAL_FAILURE(CreateJoinedJob(registry, "big", kRanks, 64, &job));
    const int64_t created = probe.store->JobBytes(job.job_id);
    ASSERT_TRUE(registry.SubmitBatch(job.job_id, 0, Batch(60, kRanks)).ok());
    const int64_t step = probe.store->JobBytes(job.job_id) - created;
    bound = created + 8 * step + step / 2;
  }
  const std::string dir = TempDir();
  JobRegistry::Options options;
  int store_failures = 0;
  options.on_store_failure = [&store_failures](const absl::Status&) { ++store_failures; };
  CreatedJob big;
  CreatedJob small;
  std::vector<std::string> plans;  // the big job's, by step
  int64_t refused_step = -1;
  int64_t held = 0;
  {
    absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir, false, bound);
    ASSERT_TRUE(store.ok()) << store.status();
    options.store = store->get();
    JobRegistry registry(options, CountingHex());
    ASSERT_NO_FATAL_FAILURE(CreateJoinedJob(registry, "big", kRanks, /*history_steps=*/64, &big));
    ASSERT_NO_FATAL_FAILURE(CreateJoinedJob(registry, "small", 2, /*history_steps=*/2, &small));
    for (int64_t step = 0; step < 64; ++step) {
      absl::StatusOr<SubmitResult> result =
          registry.SubmitBatch(big.job_id, step, Batch(60 + step, kRanks));
      if (!result.ok()) {
        const absl::Status& refused = result.status();
        EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
        EXPECT_TRUE(IsJobStateQuota(refused)) << refused;
        EXPECT_THAT(std::string(refused.message()),
                    ::testing::AllOf(::testing::HasSubstr(absl::StrCat("job \"", big.job_id, "\"")),
                                     ::testing::HasSubstr("--max_job_state_mb")));
        refused_step = step;
        break;
      }
      plans.push_back(CanonicalPlanText(*result->plan));
      EXPECT_LE((*store)->JobBytes(big.job_id), bound);
    }
    ASSERT_GE(refused_step, 2) << "the bound should hold a few steps";
    EXPECT_EQ(registry.GetJob(big.job_id)->next_step, refused_step);
    // Refused again, before any planning, while it has no room: the same answer.
    EXPECT_TRUE(IsJobStateQuota(
        registry.SubmitBatch(big.job_id, refused_step, Batch(60 + refused_step, kRanks)).status()));
    // What the big job has is still served: a repeated batch, the plans, a rank joining anew,
    // and reports as long as they fit (each either taken or refused at the bound).
    EXPECT_TRUE(registry.SubmitBatch(big.job_id, 0, Batch(60, kRanks))->repeated);
    int reports_refused = 0;
    for (int64_t step = 0; step < refused_step; ++step) {
      bool ready = false;
      absl::StatusOr<std::shared_ptr<const StepPlan>> plan =
          registry.GetPlan(big.job_id, step, 0, &ready);
      ASSERT_TRUE(plan.ok() && ready) << plan.status();
      for (int r = 0; r < kRanks; ++r) {
        absl::StatusOr<bool> reported =
            registry.ReportStep(big.job_id, step, r, MeasureRecall(**plan, r), 0.0);
        if (!reported.ok()) {
          EXPECT_TRUE(IsJobStateQuota(reported.status())) << reported.status();
          ++reports_refused;
        }
      }
      EXPECT_LE((*store)->JobBytes(big.job_id), bound);
    }
    EXPECT_GT(reports_refused, 0);
    // The small job goes on beside it, all of it taken.
    for (int64_t step = 0; step < 5; ++step) {
      absl::StatusOr<SubmitResult> result =
          registry.SubmitBatch(small.job_id, step, Batch(step, 2));
      ASSERT_TRUE(result.ok()) << result.status();
      for (int r = 0; r < 2; ++r) {
        ASSERT_TRUE(
            registry.ReportStep(small.job_id, step, r, Measure(*result->plan, r), 0.0).ok());
      }
    }
    EXPECT_EQ(store_failures, 0);
    held = (*store)->JobBytes(big.job_id);
    EXPECT_EQ(held, FolderBytes(dir + "/" + big.job_id));
  }

  // A restart reloads every step the big job stored, the same plans, with the same bytes
  // counted (no step was dropped: no spare record for Open to sweep).
  absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir, false, bound);
  ASSERT_TRUE(store.ok()) << store.status();
  options.store = store->get();
  JobRegistry restored(options, CountingHex());
  ASSERT_TRUE(restored.Restore().ok());
  EXPECT_TRUE(restored.failed_jobs().empty());
  EXPECT_EQ((*store)->JobBytes(big.job_id), held);
  EXPECT_EQ(restored.GetJob(big.job_id)->next_step, refused_step);
  for (int64_t step = 0; step < refused_step; ++step) {
    bool ready = false;
    absl::StatusOr<std::shared_ptr<const StepPlan>> plan =
        restored.GetPlan(big.job_id, step, 0, &ready);
    ASSERT_TRUE(plan.ok() && ready) << plan.status();
    EXPECT_EQ(CanonicalPlanText(**plan), plans[step]) << "step " << step;
  }
  EXPECT_TRUE(IsJobStateQuota(
      restored.SubmitBatch(big.job_id, refused_step, Batch(60 + refused_step, kRanks)).status()));
  // A shorter history drops the oldest steps' files, and the job plans again.
  JobSettings shorter;
  shorter.history_steps = 2;
  ASSERT_TRUE(restored.UpdateJobConfig(big.job_id, shorter, {"history_steps"}).ok());
  EXPECT_LT((*store)->JobBytes(big.job_id), held);
  EXPECT_TRUE(
      restored.SubmitBatch(big.job_id, refused_step, Batch(60 + refused_step, kRanks)).ok());
  EXPECT_EQ((*store)->JobBytes(big.job_id), FolderBytes(dir + "/" + big.job_id));
  EXPECT_EQ(store_failures, 0);
}

}  // namespace
}  // namespace sparsebalance
