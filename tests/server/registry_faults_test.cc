// JobRegistry over a real PlanStore against what broke it before (issue 11): state files that an
// older planner or an attacker wrote, calls that changed state before they were refused, repeats
// that differ, deletions racing writers, and a state directory that cannot be written. Each
// test restarts the registry on its directory where durability is the property.
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/planner.h"
#include "proto/wire.h"
#include "server/job_registry.h"
#include "server/plan_store.h"
#include "sparsebalance/state/v1/state.pb.h"
#include "tests/server/state_files.h"
#include "tests/server/test_support.h"
#include "tests/server/tmpfs_mount.h"
#include "tests/support/file_size_limit.h"

namespace sparsebalance {
namespace {

using test_support::ReadBytes;
using test_support::WriteBytes;

using test_support::CountingHex;
using ::testing::HasSubstr;

constexpr int kRanks = 2;

// "OK and equal to `want`" for a StatusOr<bool> (the repeat flag of ReportStep).
::testing::AssertionResult Answered(const absl::StatusOr<bool>& got, bool want) {
  if (!got.ok()) return ::testing::AssertionFailure() << got.status();
  if (*got != want) return ::testing::AssertionFailure() << "answered " << *got;
  return ::testing::AssertionSuccess();
}

std::string MakeTempDir(const std::string& base) {
  std::string pattern = base + "/registry_faults_XXXXXX";
  char* dir = mkdtemp(pattern.data());
  EXPECT_NE(dir, nullptr);
  return dir == nullptr ? "" : std::string(dir);
}

// The first planned sample of a stored step (its plan has at least one).
v1::PlannedSample* FirstPlannedSample(state::v1::StepRecord* step) {
  for (v1::RankPlan& r : *step->mutable_ranks()) {
    for (v1::MicroBatch& m : *r.mutable_micro_batches()) {
      if (m.samples_size() > 0) return m.mutable_samples(0);
    }
  }
  ADD_FAILURE() << "the stored plan has no planned sample";
  static v1::PlannedSample none;
  return &none;
}

// What a planner older than PlannedSample stored: ids and densities (and layer densities) only.
void ToOldForm(state::v1::StepRecord* step) {
  for (v1::RankPlan& r : *step->mutable_ranks()) {
    for (v1::MicroBatch& m : *r.mutable_micro_batches()) {
      m.clear_sample_ids();
      m.clear_densities();
      m.clear_layer_densities();
      bool layered = false;
      for (const v1::PlannedSample& p : m.samples()) {
        m.add_sample_ids(p.id());
        m.add_densities(p.density());
        layered = layered || p.layer_densities_size() > 0;
      }
      if (layered) {
        for (const v1::PlannedSample& p : m.samples()) {
          *m.add_layer_densities()->mutable_densities() = p.layer_densities();
        }
      }
      m.clear_samples();
    }
  }
}

class RegistryFaultsTest : public ::testing::Test {
 public:
  // /dev/shm when there is one: the deletion race writes thousands of synced snapshots.
  RegistryFaultsTest()
      : base_(MakeTempDir(std::filesystem::is_directory("/dev/shm") ? "/dev/shm"
                                                                    : ::testing::TempDir())),
        dir_(base_ + "/state") {
    Restart();
  }
  ~RegistryFaultsTest() override {
    registry_.reset();
    store_.reset();
    std::error_code ignored;
    std::filesystem::remove_all(base_, ignored);
  }

  // A new store and registry on the same directory, as after a planner restart.
  void Restart() {
    registry_.reset();
    store_.reset();
    absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir_, false);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    JobRegistry::Options options;
    options.store = store_.get();
    options.on_store_failure = [this](const absl::Status&) { ++store_failures_; };
    options.on_fold_failure = [this](const std::string&, int64_t, const absl::Status&) {
      ++fold_failures_;
    };
    registry_ = std::make_unique<JobRegistry>(options, hex_);
    ASSERT_TRUE(registry_->Restore().ok());
  }

  std::string Create(int ranks = kRanks) {
    absl::StatusOr<CreatedJob> job =
        registry_->CreateJob("test", test_support::SmallJob(ranks, /*history_steps=*/16), "");
    EXPECT_TRUE(job.ok()) << job.status();
    for (int r = 0; r < ranks; ++r) EXPECT_TRUE(registry_->JoinJob(job->job_id, r).ok());
    return job->job_id;
  }

  // Plans `step` and reports every rank; returns the plan.
  StepPlan RunStep(const std::string& id, int64_t step, int ranks = kRanks) {
    absl::StatusOr<SubmitResult> submitted =
        registry_->SubmitBatch(id, step, test_support::PretrainBatch(100 + step, ranks));
    EXPECT_TRUE(submitted.ok()) << submitted.status();
    for (int r = 0; r < ranks; ++r) {
      absl::StatusOr<bool> reported = registry_->ReportStep(
          id, step, r, test_support::TimingsOf(submitted->plan->ranks[r].micro_batches, 1.1), 0.01);
      EXPECT_TRUE(reported.ok()) << reported.status();
    }
    return *submitted->plan;
  }

  std::string JobDir(const std::string& id) const { return dir_ + "/" + id; }

  // Rewrites a job file's message in place (as an attacker or an older planner would: its frame
  // checks), in the file's format.
  template <typename Message>
  void Edit(const std::string& path, const std::function<void(Message*)>& change) {
    Message message;
    bool legacy = false;
    ASSERT_TRUE(test_support::ReadStateFile(path, &message, &legacy)) << path;
    change(&message);
    test_support::WriteStateFile(path, message, legacy);
  }

  const JobView* Listed(const std::vector<JobView>& jobs, const std::string& id) {
    for (const JobView& v : jobs) {
      if (v.job_id == id) return &v;
    }
    return nullptr;
  }

  std::function<std::string(int)> hex_ = CountingHex();
  std::string base_;
  std::string dir_;
  std::unique_ptr<PlanStore> store_;
  std::unique_ptr<JobRegistry> registry_;
  std::atomic<int> store_failures_{0};
  std::atomic<int> fold_failures_{0};
  std::string victim_;
};

// Issue 11 case 1: an older planner accepted micro_batch_capacity = INT64_MAX and a sample of
// INT64_MAX tokens, persisted the step and could not fold it; every restart then refused the
// whole state directory. Now that job is quarantined and every other job is served.
TEST_F(RegistryFaultsTest, APoisonedJobFromAnOlderPlannerIsQuarantinedAndOthersAreServed) {
  const std::string good = Create();
  const StepPlan good_plan = RunStep(good, 0);

  // The poisoned job, written as the older planner wrote it.
  const std::string poisoned = "bbbbbbbbbbbbbbb1";
  StoredJob snapshot;
  snapshot.job_id = poisoned;
  snapshot.name = "poison";
  snapshot.token = std::string(64, 'c');
  snapshot.settings.planner.ranks = 1;
  snapshot.settings.planner.micro_batches = 1;
  snapshot.settings.planner.micro_batch_capacity = std::numeric_limits<int64_t>::max();
  for (int i = 0; i < 16; ++i) snapshot.model.covariance[i] = i % 5 == 0 ? 1.0 : 0.0;
  snapshot.model.weights = {1.0, 1.0, 1.0, 1.0};
  snapshot.model.speed_factors = {1.0};
  snapshot.prior = {1e-6, 1e-8, 1e-4, 1e-3};
  snapshot.next_step = 1;
  snapshot.joined = {true};
  ASSERT_TRUE(store_->CreateJob(snapshot).ok());
  state::v1::StepRecord step;  // the bytes as the older planner wrote them
  step.set_step(0);
  v1::Sample* sample = step.add_batch();
  sample->set_id(7);
  sample->set_length(std::numeric_limits<int64_t>::max());
  v1::RankPlan* rank = step.add_ranks();
  v1::MicroBatch* mb = rank->add_micro_batches();
  mb->add_sample_ids(7);
  mb->add_densities(0.3);
  mb->set_tokens(std::numeric_limits<int64_t>::max());
  WriteBytes(JobDir(poisoned) + "/step-0.pb", step.SerializeAsString());
  StoredReport report;
  report.rank = 0;
  report.micro_batches.push_back(
      {0, 1.0, 0.0, std::numeric_limits<int64_t>::max(), 0.0, 0.0, {}, 0.0, 0.0});
  ASSERT_TRUE(store_->AppendReport(poisoned, 0, report).ok());

  for (int restart = 0; restart < 2; ++restart) {
    Restart();
    // The good job: served, same plan, its report still counted.
    bool ready = false;
    absl::StatusOr<std::shared_ptr<const StepPlan>> plan = registry_->GetPlan(good, 0, 0, &ready);
    ASSERT_TRUE(plan.ok() && ready) << plan.status();
    EXPECT_EQ((*plan)->ranks[0].micro_batches[0].samples,
              good_plan.ranks[0].micro_batches[0].samples);
    EXPECT_TRUE(Answered(
        registry_->ReportStep(good, 0, 0,
                              test_support::TimingsOf(good_plan.ranks[0].micro_batches, 1.1), 0.01),
        true));
    // The poisoned one: listed as failed, named, not served, its files moved aside.
    const std::vector<JobView> jobs = registry_->ListJobs("", 100);
    const JobView* failed = Listed(jobs, poisoned);
    ASSERT_NE(failed, nullptr);
    EXPECT_TRUE(failed->failed);
    EXPECT_THAT(failed->failure, HasSubstr("micro_batch_capacity"));
    EXPECT_EQ(registry_->GetJob(poisoned).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(registry_->failed_jobs().size(), 1u);
    EXPECT_FALSE(std::filesystem::exists(JobDir(poisoned)));
    EXPECT_TRUE(std::filesystem::exists(dir_ + "/quarantine/" + poisoned));
  }
  // Deleting it removes its quarantined files for good.
  ASSERT_TRUE(registry_->DeleteJob(poisoned).ok());
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/quarantine/" + poisoned));
  Restart();
  EXPECT_EQ(Listed(registry_->ListJobs("", 100), poisoned), nullptr);
  EXPECT_NE(Listed(registry_->ListJobs("", 100), good), nullptr);
}

// Issue 11 case 5: files that parse but are wrong. Each corruption quarantines its job only,
// with a reason that names what is wrong, and the planner serves the other job.
TEST_F(RegistryFaultsTest, EveryInvalidStateFileQuarantinesOnlyItsJob) {
  struct Corruption {
    std::string name;
    std::string reason;  // expected in the failure
    std::function<void(RegistryFaultsTest*, const std::string& job_dir)> apply;
  };
  using Snapshot = state::v1::JobSnapshot;
  using Step = state::v1::StepRecord;
  const std::vector<Corruption> corruptions = {
      {"plan rank count", "ranks",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Step>(d + "/step-0.pb", [](Step* s) { s->mutable_ranks()->RemoveLast(); });
       }},
      {"micro-batch count", "micro-batches",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Step>(d + "/step-0.pb", [](Step* s) { s->mutable_ranks(0)->add_micro_batches(); });
       }},
      {"sample id not in the batch", "not in the batch",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Step>(d + "/step-0.pb", [](Step* s) { FirstPlannedSample(s)->set_id(987654321); });
       }},
      {"old-form sample id not in the batch", "not in the batch",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Step>(d + "/step-0.pb", [](Step* s) {
           ToOldForm(s);
           for (v1::RankPlan& r : *s->mutable_ranks()) {
             for (v1::MicroBatch& m : *r.mutable_micro_batches()) {
               if (m.sample_ids_size() > 0) {
                 m.set_sample_ids(0, 987654321);
                 return;
               }
             }
           }
         });
       }},
      {"planned length not the batch's", "samples[0].length",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Step>(d + "/step-0.pb", [](Step* s) {
           v1::PlannedSample* p = FirstPlannedSample(s);
           p->set_length(p->length() + 1);
         });
       }},
      {"planned segments not summing to the length", "segments",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Step>(d + "/step-0.pb", [](Step* s) {
           v1::PlannedSample* p = FirstPlannedSample(s);
           p->add_segments(1);
           p->add_segments(p->length());
         });
       }},
      // Values a damaged record of the previous format (no checksum) could hold, each still
      // within (0, 1]: the review's flipped bits served a default density of 2.6e-211 and a
      // density of 0.032 in a job whose density_min was 0.2.
      {"one micro-batch's default density", "default density",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Step>(d + "/step-0.pb", [](Step* s) {
           s->mutable_ranks(1)->mutable_micro_batches(1)->set_default_density(2.6e-211);
         });
       }},
      {"a default density not the one planned with", "density_default its step was planned",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Step>(d + "/step-0.pb", [](Step* s) {
           for (v1::RankPlan& r : *s->mutable_ranks()) {
             for (v1::MicroBatch& m : *r.mutable_micro_batches()) m.set_default_density(0.5);
           }
         });
       }},
      {"a density below the density_min planned with", "planned with",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Step>(d + "/step-0.pb", [](Step* s) {
           FirstPlannedSample(s)->set_density(s->planned_with().density_min() * 0.16);
         });
       }},
      {"planned density settings no config has", "which no config has",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Step>(d + "/step-0.pb", [](Step* s) {
           s->mutable_planned_with()->set_density_min(s->planned_with().density_default() * 2);
         });
       }},
      {"report rank", "rank",
       [](RegistryFaultsTest* t, const std::string&) {
         ASSERT_TRUE(t->store_->AppendReport(t->victim_, 0, {9, {}, 0.0}).ok());
       }},
      {"report micro-batch index", "micro_batch",
       [](RegistryFaultsTest* t, const std::string& d) {
         std::filesystem::remove(d + "/step-0.reports");
         StoredReport r;
         r.micro_batches.push_back({5, 0.0, 0.0, 0, 0.0, 0.0, {}, 0.0, 0.0});
         ASSERT_TRUE(t->store_->AppendReport(t->victim_, 0, r).ok());
       }},
      {"non-finite model weight", "not finite",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Snapshot>(d + "/job.pb", [](Snapshot* s) {
           s->mutable_model()->set_weights(1, std::numeric_limits<double>::quiet_NaN());
         });
       }},
      {"zero speed factor", "speed_factors",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Snapshot>(d + "/job.pb",
                           [](Snapshot* s) { s->mutable_model()->set_speed_factors(0, 0.0); });
       }},
      {"negative next step", "next_step",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Snapshot>(d + "/job.pb", [](Snapshot* s) { s->set_next_step(-5); });
       }},
      {"first kept step past the next step", "first_kept_step",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Snapshot>(d + "/job.pb",
                           [](Snapshot* s) { s->set_first_kept_step(s->next_step() + 1); });
       }},
      {"empty token", "token",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Snapshot>(d + "/job.pb", [](Snapshot* s) { s->set_token(""); });
       }},
      {"2^31-1 layers", "layers",
       [](RegistryFaultsTest* t, const std::string& d) {
         t->Edit<Snapshot>(d + "/job.pb", [](Snapshot* s) {
           s->mutable_config()->mutable_shape()->set_layers(std::numeric_limits<int32_t>::max());
         });
       }},
  };
  for (const Corruption& c : corruptions) {
    SCOPED_TRACE(c.name);
    victim_ = Create();
    RunStep(victim_, 0);
    const std::string bystander = Create();
    const StepPlan bystander_plan = RunStep(bystander, 0);
    // The planner is down while its files are changed (a fresh store: no open logs).
    registry_.reset();
    store_.reset();
    absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir_, false);
    ASSERT_TRUE(store.ok());
    store_ = *std::move(store);
    c.apply(this, JobDir(victim_));
    Restart();
    const std::vector<JobView> jobs = registry_->ListJobs("", 1000);
    const JobView* failed = Listed(jobs, victim_);
    ASSERT_NE(failed, nullptr);
    EXPECT_TRUE(failed->failed);
    EXPECT_THAT(failed->failure, HasSubstr(c.reason));
    EXPECT_TRUE(registry_->GetJob(bystander).ok());
    bool ready = false;
    absl::StatusOr<std::shared_ptr<const StepPlan>> plan =
        registry_->GetPlan(bystander, 0, 1, &ready);
    ASSERT_TRUE(plan.ok() && ready);
    EXPECT_EQ((*plan)->ranks[1].micro_batches[1].samples,
              bystander_plan.ranks[1].micro_batches[1].samples);
    EXPECT_TRUE(registry_->DeleteJob(victim_).ok());
  }
}

// A step keeps its plan when UpdateJobConfig later moves the job's density bounds past its
// densities; its record keeps the bounds it was planned with, which a restart checks it
// against, so it restores. A record without them (an older planner's) restores too.
TEST_F(RegistryFaultsTest, AStepPlannedBeforeTheDensityBoundsChangedRestores) {
  const std::string id = Create();
  const StepPlan before = RunStep(id, 0);
  JobSettings update;
  update.planner.density_min = 0.6;
  update.planner.density_default = 0.7;
  update.planner.density_max = 0.9;
  ASSERT_TRUE(
      registry_->UpdateJobConfig(id, update, {"density_min", "density_default", "density_max"})
          .ok());
  const StepPlan after = RunStep(id, 1);
  double lowest = 1.0;
  for (const RankPlan& rank : before.ranks) {
    for (const MicroBatchPlan& mb : rank.micro_batches) {
      for (const PlannedSample& p : mb.samples) lowest = std::min(lowest, p.density);
    }
  }
  ASSERT_LT(lowest, 0.6);  // step 0 is outside the job's bounds now
  EXPECT_EQ(after.ranks[0].micro_batches[0].default_density, 0.7);
  for (int restart = 0; restart < 2; ++restart) {
    Restart();
    ASSERT_FALSE(Listed(registry_->ListJobs("", 100), id)->failed)
        << Listed(registry_->ListJobs("", 100), id)->failure;
    for (const auto& [step, planned] : {std::make_pair(0, before), std::make_pair(1, after)}) {
      bool ready = false;
      absl::StatusOr<std::shared_ptr<const StepPlan>> plan =
          registry_->GetPlan(id, step, 0, &ready);
      ASSERT_TRUE(plan.ok() && ready) << plan.status();
      EXPECT_EQ(CanonicalPlanText(**plan), CanonicalPlanText(planned));
    }
    // The second time, as an older planner stored them: no planned bounds in the records.
    if (restart > 0) break;
    registry_.reset();
    for (const char* file : {"step-0.pb", "step-1.pb"}) {
      Edit<state::v1::StepRecord>(JobDir(id) + "/" + file, [](state::v1::StepRecord* s) {
        ASSERT_TRUE(s->has_planned_with());
        s->clear_planned_with();
      });
    }
  }
}

// A plan stored by a planner older than PlannedSample (ids and densities only) restores with
// every planned sample's length and segments, taken from the step's stored batch, and the
// step's reports fold into the model as they would have.
TEST_F(RegistryFaultsTest, AnOlderPlannersStoredPlanRestoresWithLengthsFromItsBatch) {
  const std::string id = Create();
  std::vector<Sample> batch = test_support::PretrainBatch(100, kRanks);
  int packed = 0;
  for (size_t i = 0; i < batch.size(); i += 3) {
    if (batch[i].length < 2) continue;
    batch[i].segments = {1, batch[i].length - 1};
    ++packed;
  }
  ASSERT_GT(packed, 0);
  absl::StatusOr<SubmitResult> submitted = registry_->SubmitBatch(id, 0, batch);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const StepPlan planned = *submitted->plan;
  // Rank 0 reports now; rank 1 after the restart, which folds the step from the old-form plan.
  ASSERT_TRUE(Answered(
      registry_->ReportStep(id, 0, 0, test_support::TimingsOf(planned.ranks[0].micro_batches), 0),
      false));
  registry_.reset();
  store_.reset();
  {
    absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir_, false);
    ASSERT_TRUE(store.ok());
    store_ = *std::move(store);
  }
  Edit<state::v1::StepRecord>(JobDir(id) + "/step-0.pb", ToOldForm);
  state::v1::StepRecord stored;
  ASSERT_TRUE(test_support::ReadStateFile(JobDir(id) + "/step-0.pb", &stored));
  ASSERT_GT(stored.ranks(0).micro_batches(0).sample_ids_size(), 0);
  ASSERT_EQ(stored.ranks(0).micro_batches(0).samples_size(), 0);
  Restart();
  EXPECT_EQ(Listed(registry_->ListJobs("", 100), id)->failed, false);
  bool ready = false;
  absl::StatusOr<std::shared_ptr<const StepPlan>> restored = registry_->GetPlan(id, 0, 1, &ready);
  ASSERT_TRUE(restored.ok() && ready) << restored.status();
  // Every sample's length and segments are back: the same plan, field for field.
  EXPECT_EQ(CanonicalPlanText(**restored), CanonicalPlanText(planned));
  EXPECT_TRUE(CheckPlan(**restored, batch, test_support::SmallJob(kRanks).planner).ok());
  ASSERT_TRUE(Answered(
      registry_->ReportStep(id, 0, 1, test_support::TimingsOf(planned.ranks[1].micro_batches), 0),
      false));
  absl::StatusOr<JobView> job = registry_->GetJob(id);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->steps_folded, 1);
  EXPECT_EQ(job->unfolded_steps, 0);
  EXPECT_EQ(fold_failures_.load(), 0);
}

// Files a trim left behind never fold a step a second time. (A) job.pb cannot be written (a
// folder where its temporary file goes; ENOSPC or EIO on a real disk) while step records can
// (written over the spare record's allocated space): the submit is acknowledged, its trim keeps
// the trimmed step 0's files since no snapshot holds its fold, and the next snapshot, written,
// does not list step 0 among the history's folded steps. (B) The files of a trimmed step come
// back as a DropStep that failed would leave them. A restart used to fold those steps again
// from their files: steps_folded and the model changed with no new report. The snapshot's
// first_kept_step now says they left the history: their files are removed, never folded, and
// a snapshot without it (an older planner's) still loads.
TEST_F(RegistryFaultsTest, AStepIsFoldedOnceWhateverFilesAFailedTrimLeft) {
  absl::StatusOr<CreatedJob> job =
      registry_->CreateJob("fold-once", test_support::SmallJob(kRanks, /*history_steps=*/2), "");
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id;
  const std::string job_dir = JobDir(id);
  for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(registry_->JoinJob(id, r).ok());
  auto folder_bytes = [&] {
    int64_t bytes = 0;
    for (const auto& entry : std::filesystem::directory_iterator(job_dir)) {
      if (entry.is_regular_file()) bytes += static_cast<int64_t>(entry.file_size());
    }
    return bytes;
  };
  RunStep(id, 0);
  RunStep(id, 1);
  // (A) Step 2's snapshot fails; step 0 leaves the history with its files kept.
  const std::string blocked = job_dir + "/job.pb.tmp";
  ASSERT_TRUE(std::filesystem::create_directory(blocked));
  const int failures = store_failures_.load();
  RunStep(id, 2);
  EXPECT_GT(store_failures_.load(), failures);
  ASSERT_TRUE(std::filesystem::exists(job_dir + "/step-0.reports"));
  std::filesystem::remove(blocked);
  // (B) Step 1's files, dropped when step 3 is planned, come back as if the DropStep had failed.
  const std::string record1 = ReadBytes(job_dir + "/step-1.pb");
  const std::string reports1 = ReadBytes(job_dir + "/step-1.reports");
  RunStep(id, 3);
  ASSERT_FALSE(std::filesystem::exists(job_dir + "/step-1.reports"));
  WriteBytes(job_dir + "/step-1.pb", record1);
  WriteBytes(job_dir + "/step-1.reports", reports1);
  // The snapshot with step 3's fold, and step 1 below its first kept step.
  ASSERT_TRUE(registry_->SubmitBatch(id, 4, test_support::PretrainBatch(104, kRanks)).ok());
  const JobView before = *registry_->GetJob(id);
  ASSERT_EQ(before.steps_folded, 4);
  for (int restart = 0; restart < 3; ++restart) {
    SCOPED_TRACE(restart);
    if (restart == 2) {  // as an older planner wrote it
      Edit<state::v1::JobSnapshot>(job_dir + "/job.pb", [](state::v1::JobSnapshot* s) {
        ASSERT_EQ(s->first_kept_step(), 2);
        s->clear_first_kept_step();
      });
    }
    Restart();
    absl::StatusOr<JobView> after = registry_->GetJob(id);
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_EQ(after->steps_folded, before.steps_folded);
    EXPECT_EQ(after->coefficients.per_block, before.coefficients.per_block);
    EXPECT_EQ(after->coefficients.per_token, before.coefficients.per_token);
    EXPECT_EQ(after->speed_factors, before.speed_factors);
    EXPECT_EQ(after->next_step, 5);
    for (int64_t step : {0, 1, 2}) {
      EXPECT_FALSE(std::filesystem::exists(absl::StrCat(job_dir, "/step-", step, ".pb"))) << step;
      EXPECT_FALSE(std::filesystem::exists(absl::StrCat(job_dir, "/step-", step, ".reports")))
          << step;
    }
    EXPECT_EQ(store_->JobBytes(id), folder_bytes());
    bool ready = false;
    EXPECT_TRUE(registry_->GetPlan(id, 4, 0, &ready).ok() && ready);
  }
}

// Defect: a flipped bit in a step record was served after a restart when the record still
// parsed (a planned density one ulp away passes every check of its value). The record's
// checksum finds it: the job is quarantined, naming the file, and the other job is served.
TEST_F(RegistryFaultsTest, AFlippedBitInAStepRecordQuarantinesItsJob) {
  const std::string good = Create();
  const std::string victim = Create();
  const StepPlan good_plan = RunStep(good, 0);
  const StepPlan victim_plan = RunStep(victim, 0);
  registry_.reset();
  // The lowest bit of the first planned sample's density, found by its 8 bytes in the file.
  const std::string path = JobDir(victim) + "/step-0.pb";
  std::string bytes = ReadBytes(path);
  state::v1::StepRecord record;
  ASSERT_TRUE(test_support::ReadStateFile(path, &record));
  const double density = FirstPlannedSample(&record)->density();
  std::string le(8, '\0');
  std::memcpy(le.data(), &density, 8);
  const size_t at = bytes.find(le);
  ASSERT_NE(at, std::string::npos);
  bytes[at] ^= 1;
  WriteBytes(path, bytes);

  Restart();
  const JobView* failed = Listed(registry_->ListJobs("", 100), victim);
  ASSERT_NE(failed, nullptr);
  EXPECT_TRUE(failed->failed);
  EXPECT_THAT(failed->failure, HasSubstr("step-0.pb"));
  EXPECT_THAT(failed->failure, HasSubstr("CRC32C"));
  EXPECT_EQ(registry_->GetJob(victim).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/quarantine/" + victim + "/step-0.pb"));
  bool ready = false;
  absl::StatusOr<std::shared_ptr<const StepPlan>> plan = registry_->GetPlan(good, 0, 0, &ready);
  ASSERT_TRUE(plan.ok() && ready) << plan.status();
  EXPECT_EQ(CanonicalPlanText(**plan), CanonicalPlanText(good_plan));
}

// A job whose job.pb and step records were written before the frame (the bare messages) is
// restored as it was: the same plans, its reports counted. The files are left as they are; the
// next snapshot and the next step are written framed.
TEST_F(RegistryFaultsTest, StateFilesOfThePreviousFormatStillLoad) {
  const std::string id = Create();
  const StepPlan plan0 = RunStep(id, 0);
  const StepPlan plan1 = RunStep(id, 1);
  registry_.reset();
  for (const char* file : {"job.pb", "step-0.pb", "step-1.pb"}) {
    const std::string path = JobDir(id) + "/" + file;
    const std::string bytes = ReadBytes(path);
    bool legacy = true;
    absl::StatusOr<absl::string_view> body = StateFileBody(bytes, path, &legacy);
    ASSERT_TRUE(body.ok()) << body.status();
    ASSERT_FALSE(legacy) << file;
    WriteBytes(path, std::string(*body));
  }
  Restart();
  absl::StatusOr<JobView> job = registry_->GetJob(id);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->next_step, 2);
  EXPECT_EQ(job->steps_folded, 2);
  for (const auto& [step, planned] : {std::make_pair(0, plan0), std::make_pair(1, plan1)}) {
    bool ready = false;
    absl::StatusOr<std::shared_ptr<const StepPlan>> plan = registry_->GetPlan(id, step, 1, &ready);
    ASSERT_TRUE(plan.ok() && ready) << plan.status();
    EXPECT_EQ(CanonicalPlanText(**plan), CanonicalPlanText(planned));
    EXPECT_TRUE(Answered(
        registry_->ReportStep(id, step, 1,
                              test_support::TimingsOf(planned.ranks[1].micro_batches, 1.1), 0.01),
        true));
  }
  RunStep(id, 2);
  const auto legacy_file = [&](const std::string& file) {
    const std::string path = JobDir(id) + "/" + file;
    bool legacy = false;
    EXPECT_TRUE(StateFileBody(ReadBytes(path), path, &legacy).ok()) << file;
    return legacy;
  };
  EXPECT_TRUE(legacy_file("step-0.pb"));
  EXPECT_TRUE(legacy_file("step-1.pb"));
  EXPECT_FALSE(legacy_file("step-2.pb"));
  EXPECT_FALSE(legacy_file("job.pb"));
}

// A snapshot's own job_id is never used as a path or an id: the folder's name is.
TEST_F(RegistryFaultsTest, TheLearnedRecallCurvesSurviveARestart) {
  const std::string id = Create();
  for (int64_t step = 0; step < 3; ++step) {
    absl::StatusOr<SubmitResult> submitted =
        registry_->SubmitBatch(id, step, test_support::PretrainBatch(200 + step, kRanks));
    ASSERT_TRUE(submitted.ok()) << submitted.status();
    for (int r = 0; r < kRanks; ++r) {
      std::vector<MicroBatchTiming> timings =
          test_support::TimingsOf(submitted->plan->ranks[r].micro_batches, 1.0);
      for (MicroBatchTiming& m : timings) {
        for (const PlannedSample& p :
             submitted->plan->ranks[r].micro_batches[m.micro_batch].samples) {
          m.documents.push_back({p.id, 0, RecallAt(2.0, p.density), {}, 2});
        }
      }
      ASSERT_TRUE(registry_->ReportStep(id, step, r, timings, 0.0).ok());
    }
  }
  // The next plan's snapshot holds the curves of the folded steps.
  ASSERT_TRUE(registry_->SubmitBatch(id, 3, test_support::PretrainBatch(203, kRanks)).ok());
  const JobView before = *registry_->GetJob(id);
  Restart();
  const JobView after = *registry_->GetJob(id);
  ASSERT_EQ(after.recall_curves.size(), before.recall_curves.size());
  double documents = 0.0;
  for (size_t k = 0; k < before.recall_curves.size(); ++k) {
    EXPECT_EQ(after.recall_curves[k].exponent, before.recall_curves[k].exponent);
    EXPECT_EQ(after.recall_curves[k].documents, before.recall_curves[k].documents);
    documents += before.recall_curves[k].documents;
  }
  EXPECT_GT(documents, 0.0);
}

TEST_F(RegistryFaultsTest, AJobIdInsideTheFilesIsNeverUsed) {
  const std::string id = Create();
  RunStep(id, 0);
  registry_.reset();
  Edit<state::v1::JobSnapshot>(JobDir(id) + "/job.pb",
                               [](state::v1::JobSnapshot* s) { s->set_job_id("../../evil"); });
  const std::filesystem::path parent = std::filesystem::path(base_);
  Restart();
  EXPECT_TRUE(registry_->GetJob(id).ok());
  RunStep(id, 1);
  EXPECT_FALSE(std::filesystem::exists(parent / "evil"));
  EXPECT_FALSE(std::filesystem::exists(parent.parent_path() / "evil"));
}

// Issue 11 case 6: a refused call changes nothing. A NaN wait_seconds from a rank that ran the
// local plan used to switch the step to the local plan (and rewrite it) before the refusal.
TEST_F(RegistryFaultsTest, ARefusedReportChangesNothing) {
  const std::string id = Create();
  absl::StatusOr<SubmitResult> submitted =
      registry_->SubmitBatch(id, 0, test_support::PretrainBatch(5, kRanks));
  ASSERT_TRUE(submitted.ok());
  const std::string before = ReadBytes(JobDir(id) + "/step-0.pb");
  absl::StatusOr<StepPlan> local = PlanStepLocally(test_support::PretrainBatch(5, kRanks),
                                                   test_support::SmallJob(kRanks).planner);
  ASSERT_TRUE(local.ok());
  absl::StatusOr<bool> refused =
      registry_->ReportStep(id, 0, 0, test_support::TimingsOf(local->ranks[0].micro_batches),
                            std::numeric_limits<double>::quiet_NaN(), /*planned_locally=*/true);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("wait_seconds"));
  EXPECT_EQ(ReadBytes(JobDir(id) + "/step-0.pb"), before);
  bool ready = false;
  absl::StatusOr<std::shared_ptr<const StepPlan>> plan = registry_->GetPlan(id, 0, 0, &ready);
  ASSERT_TRUE(plan.ok() && ready);
  EXPECT_FALSE((*plan)->planned_locally);
  // Bad timings against the local plan are refused before the switch too.
  std::vector<MicroBatchTiming> wrong = test_support::TimingsOf(local->ranks[0].micro_batches);
  wrong[0].tokens += 1;
  EXPECT_EQ(registry_->ReportStep(id, 0, 0, wrong, 0.0, true).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadBytes(JobDir(id) + "/step-0.pb"), before);
}

// Issue 11 case 6: a repeat with other timings was acknowledged as a duplicate; an empty report
// for a rank with planned micro-batches was accepted.
TEST_F(RegistryFaultsTest, ARepeatThatDiffersAndAnIncompleteReportAreRefused) {
  const std::string id = Create();
  absl::StatusOr<SubmitResult> submitted =
      registry_->SubmitBatch(id, 0, test_support::PretrainBatch(6, kRanks));
  ASSERT_TRUE(submitted.ok());
  const std::vector<MicroBatchTiming> timings =
      test_support::TimingsOf(submitted->plan->ranks[0].micro_batches, 1.1);
  ASSERT_GE(timings.size(), 1u);
  absl::StatusOr<bool> empty = registry_->ReportStep(id, 0, 1, {}, 0.0);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr("micro_batches"));
  ASSERT_TRUE(Answered(registry_->ReportStep(id, 0, 0, timings, 0.25), false));
  EXPECT_TRUE(Answered(registry_->ReportStep(id, 0, 0, timings, 0.25), true));
  std::vector<MicroBatchTiming> changed = timings;
  changed[0].compute_seconds *= 2;
  absl::StatusOr<bool> differs = registry_->ReportStep(id, 0, 0, changed, 0.25);
  EXPECT_EQ(differs.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(differs.status().message(), HasSubstr("micro_batches[0].compute_seconds"));
  absl::StatusOr<bool> other_wait = registry_->ReportStep(id, 0, 0, timings, 0.5);
  EXPECT_EQ(other_wait.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(other_wait.status().message(), HasSubstr("wait_seconds"));
  // After a restart the acknowledged report is what repeats are compared with.
  Restart();
  EXPECT_TRUE(Answered(registry_->ReportStep(id, 0, 0, timings, 0.25), true));
  EXPECT_EQ(registry_->ReportStep(id, 0, 0, changed, 0.25).status().code(),
            absl::StatusCode::kAlreadyExists);
}

// Issue 11 case 6: planned_locally with step INT64_MAX overflowed next_step and bricked the job;
// a skip of 10^15 steps was accepted.
TEST_F(RegistryFaultsTest, StepsAndSkipsAreBounded) {
  const std::string id = Create();
  RunStep(id, 0);
  const std::vector<Sample> batch = test_support::PretrainBatch(9, kRanks);
  for (int64_t step : {std::numeric_limits<int64_t>::max(), int64_t{1000000000000000}}) {
    absl::StatusOr<SubmitResult> refused =
        registry_->SubmitBatch(id, step, batch, /*planned_locally=*/true);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << step;
    EXPECT_THAT(refused.status().message(), HasSubstr("step"));
  }
  EXPECT_EQ(registry_->SubmitBatch(id, -1, batch).status().code(),
            absl::StatusCode::kInvalidArgument);
  bool ready = false;
  EXPECT_EQ(registry_->GetPlan(id, -1, 0, &ready).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The job goes on: a skip within the bound, then the next step.
  ASSERT_TRUE(registry_->SubmitBatch(id, 5, batch, /*planned_locally=*/true).ok());
  Restart();
  absl::StatusOr<JobView> view = registry_->GetJob(id);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->next_step, 6);
  RunStep(id, 6);
}

// Issue 11 case 4: 40 concurrent UpdateJobConfig calls racing one DeleteJob re-created deleted
// jobs on disk, which came back after a restart with their old tokens.
TEST_F(RegistryFaultsTest, ADeletedJobStaysDeletedUnderConcurrentWriters) {
  constexpr int kRounds = 150;
  constexpr int kWriters = 40;
  std::vector<std::string> deleted;
  for (int round = 0; round < kRounds; ++round) {
    const std::string id = Create(1);
    std::atomic<bool> go{false};
    std::vector<std::thread> writers;
    // A join racing the delete is answered OK (before it) or NOT_FOUND (after it), also when
    // the delete lands between its append and its sync (JoinJob syncs outside the lock).
    std::vector<absl::StatusCode> joins(kWriters, absl::StatusCode::kOk);
    for (int w = 0; w < kWriters; ++w) {
      writers.emplace_back([&, w] {
        while (!go) std::this_thread::yield();
        JobSettings update;
        update.planner.density_default = w % 2 == 0 ? 0.3 : 0.25;
        registry_->UpdateJobConfig(id, update, {"density_default"}).IgnoreError();
        joins[w] = registry_->JoinJob(id, 0).status().code();
      });
    }
    go = true;
    ASSERT_TRUE(registry_->DeleteJob(id).ok());
    for (std::thread& t : writers) t.join();
    for (absl::StatusCode code : joins) {
      EXPECT_TRUE(code == absl::StatusCode::kOk || code == absl::StatusCode::kNotFound) << code;
    }
    EXPECT_EQ(registry_->GetJob(id).status().code(), absl::StatusCode::kNotFound);
    deleted.push_back(id);
  }
  Restart();
  EXPECT_TRUE(registry_->ListJobs("", 1000).empty());
  for (const std::string& id : deleted) {
    EXPECT_FALSE(std::filesystem::exists(JobDir(id))) << id;
    EXPECT_EQ(registry_->Authorize(id, std::string(64, 'a')).code(), absl::StatusCode::kNotFound);
  }
}

// A batch's new reports of one step are stored in one append: when it cannot be written (here
// the file size limit lets a step's log hold two reports, not three), none of them is taken and
// the first of them is the one refused, while a report of another step before them stays
// accepted. Sent again once the disk has room, the whole batch is taken, and survives a restart.
TEST_F(RegistryFaultsTest, ABatchsReportsOfAStepAreStoredTogetherOrNotAtAll) {
  constexpr int kNode = 4;
  const std::string id = Create(kNode);
  std::vector<StepPlan> plans;
  for (int64_t step = 0; step < 2; ++step) {
    absl::StatusOr<SubmitResult> submitted =
        registry_->SubmitBatch(id, step, test_support::PretrainBatch(300 + step, kNode));
    ASSERT_TRUE(submitted.ok()) << submitted.status();
    plans.push_back(*submitted->plan);
  }
  auto report = [&](int64_t step, int rank) {
    RankStepReport r;
    r.step = step;
    r.rank = rank;
    r.micro_batches = test_support::TimingsOf(plans[step].ranks[rank].micro_batches, 1.1);
    r.wait_seconds = 0.01;
    return r;
  };
  ASSERT_TRUE(Answered(registry_->ReportStep(id, 0, 0, report(0, 0).micro_batches, 0.01), false));
  const std::string log0 = JobDir(id) + "/step-0.reports";
  const auto one = static_cast<double>(std::filesystem::file_size(log0));
  auto batch = [&] {
    return std::vector<RankStepReport>{report(0, 1), report(1, 0), report(1, 1), report(1, 2)};
  };

  std::vector<RankStepReport> first = batch();
  std::vector<JobRegistry::ReportAnswer> answers;
  absl::Status failed;
  {
    test_support::FileSizeLimit limit(static_cast<int64_t>(2.5 * one));
    failed = registry_->ReportSteps(id, first, &answers);
  }

  EXPECT_EQ(failed.code(), absl::StatusCode::kResourceExhausted) << failed;
  EXPECT_EQ(ErrorReason(failed), kReasonStateDirFailure) << failed;
  ASSERT_EQ(answers.size(), 2u);  // reports[1], step 1's first, is the one refused
  EXPECT_FALSE(answers[0].duplicate);
  // Step 0's report was taken; none of step 1's was (a new one now, not a repeat).
  EXPECT_TRUE(Answered(registry_->ReportStep(id, 0, 1, report(0, 1).micro_batches, 0.01), true));
  EXPECT_TRUE(Answered(registry_->ReportStep(id, 1, 0, report(1, 0).micro_batches, 0.01), false));

  // Again with room: the rest of the batch is taken (rank 0's step 1 report, sent above, is a
  // repeat now), then survives a restart.
  std::vector<RankStepReport> again = batch();
  ASSERT_TRUE(registry_->ReportSteps(id, again, &answers).ok());
  ASSERT_EQ(answers.size(), 4u);
  EXPECT_TRUE(answers[0].duplicate);
  EXPECT_TRUE(answers[1].duplicate);
  EXPECT_FALSE(answers[2].duplicate);
  EXPECT_FALSE(answers[3].duplicate);
  Restart();
  for (int rank : {0, 1, 2}) {
    EXPECT_TRUE(
        Answered(registry_->ReportStep(id, 1, rank, report(1, rank).micro_batches, 0.01), true))
        << "rank " << rank;
  }
  EXPECT_TRUE(Answered(registry_->ReportStep(id, 0, 1, report(0, 1).micro_batches, 0.01), true));
}

// A state directory that cannot be written: the call fails with the state-dir reason (not
// UNAVAILABLE), nothing changes, and once the directory can be written the call succeeds. Runs
// on a small tmpfs remounted read-only (needs root; skipped otherwise).
TEST_F(RegistryFaultsTest, AReadOnlyStateDirFailsCallsWithItsReasonAndChangesNothing) {
  test_support::TmpfsMount disk("4m");
  if (!disk.mounted()) GTEST_SKIP() << disk.error();
  dir_ = disk.path() + "/state";
  Restart();
  const std::string id = Create();
  ASSERT_TRUE(registry_->SubmitBatch(id, 0, test_support::PretrainBatch(10, kRanks)).ok());
  // A job whose rank 1 has not joined yet.
  absl::StatusOr<CreatedJob> half =
      registry_->CreateJob("half", test_support::SmallJob(kRanks, /*history_steps=*/16), "");
  ASSERT_TRUE(half.ok()) << half.status();
  ASSERT_TRUE(registry_->JoinJob(half->job_id, 0, nullptr, "host-a").ok());
  // (A report log held open for writing would keep the remount from going read-only.)
  ASSERT_TRUE(disk.Remount(/*read_only=*/true)) << std::strerror(errno);
  // A join the store refuses changes nothing: the rank is not joined, its host not shown.
  const absl::Status join = registry_->JoinJob(half->job_id, 1, nullptr, "host-b").status();
  EXPECT_EQ(ErrorReason(join), kReasonStateDirFailure) << join;
  {
    const JobView view = *registry_->GetJob(half->job_id);
    EXPECT_EQ(view.joined_ranks, 1);
    ASSERT_NE(view.hosts, nullptr);
    ASSERT_EQ(view.hosts->size(), static_cast<size_t>(kRanks));
    EXPECT_EQ((*view.hosts)[0], "host-a");
    EXPECT_EQ((*view.hosts)[1], "");
  }
  const std::vector<Sample> batch = test_support::PretrainBatch(11, kRanks);
  absl::StatusOr<SubmitResult> failed = registry_->SubmitBatch(id, 1, batch);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ErrorReason(failed.status()), kReasonStateDirFailure) << failed.status();
  EXPECT_GE(store_failures_.load(), 1);
  EXPECT_EQ(registry_->GetJob(id)->next_step, 1);
  EXPECT_EQ(ErrorReason(registry_->CreateJob("x", test_support::SmallJob(1), "").status()),
            kReasonStateDirFailure);
  ASSERT_TRUE(disk.Remount(/*read_only=*/false)) << std::strerror(errno);
  ASSERT_TRUE(registry_->SubmitBatch(id, 1, batch).ok());
  Restart();
  EXPECT_EQ(registry_->GetJob(id)->next_step, 2);
  registry_.reset();
  store_.reset();
}

}  // namespace
}  // namespace sparsebalance
