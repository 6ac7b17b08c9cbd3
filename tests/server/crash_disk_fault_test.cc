// Crash-and-disk-fault test of sb-planner (issue 11): a real sb-planner process with its
// --state_dir on a small tmpfs, driven over loopback gRPC through the C++ client, while a killer
// thread SIGKILLs it at random moments and restarts it on the same state. From 35% to 60% of the
// run the tmpfs is full (a filler file): the first half of that without kills (one planner turns
// NOT_SERVING and refuses writes with STATE_DIR_FAILURE), the second half with kills (restarts
// are refused until the filler goes). Only OK answers count as acknowledged. After each restart
// the last acknowledged reports are resent (each must be a duplicate); at the end a last restart
// must bring every job back with every acknowledged plan served unchanged and every acknowledged
// report still stored (resent: duplicate; resent changed: ALREADY_EXISTS).
//
// Needs root to mount the tmpfs (GTEST_SKIP otherwise). The seed is fixed (SB_CRASH_TEST_SEED
// overrides it): batches, timings and kill intervals follow from it; where a kill lands relative
// to a call does not. The scenario drives for 30 s by default (about 33 s in all);
// SB_CRASH_TEST_SECONDS=600 (say) makes it a soak run (run the binary itself: ctest stops it
// after 300 s). The summary line ("crash_disk_fault: ...") gives kills, acknowledged submits and
// reports, and the failures seen while the disk was full.
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/planner_client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "planner/random.h"
#include "planner/types.h"
#include "proto/wire.h"
#include "sparsebalance/planner/v1/planner.grpc.pb.h"
#include "tests/server/health_check.h"
#include "tests/server/tmpfs_mount.h"
#include "tools/child_process.h"
#include "tools/tool_support.h"

namespace sparsebalance {
namespace {

using Clock = std::chrono::steady_clock;
using tools::PlannerProcess;

constexpr char kServiceName[] = "sparsebalance.planner.v1.PlannerService";
constexpr uint64_t kDefaultSeed = 20240611;
constexpr double kDefaultSeconds = 30.0;
constexpr int kJobs = 3;
constexpr int kRanks = 4;
constexpr int kMicroBatches = 2;
constexpr int64_t kCapacity = 4096;  // tokens per micro-batch
// Each job steps at most once per round of this long (seconds): at most 1500 steps a job in the
// default run (about 800 with the kills and the full disk), all in the kept history below,
// so every plan and report is checked at the end; a soak run checks the steps still kept (the
// summary says how many). A step takes about 8 KiB of the tmpfs (its step record and its report
// log), so a soak run levels off near 50 MiB.
constexpr double kRoundSeconds = 0.02;
constexpr int kHistorySteps = 2048;
constexpr int64_t kTmpfsBytes = 80 << 20;
// A call that keeps failing this long after the disk recovered means the planner is stuck.
constexpr double kStuckSeconds = 60.0;
constexpr int kMaxUnexpectedFailures = 10;

double EnvDouble(const char* name, double fallback) {
  const char* text = getenv(name);
  double value = 0;
  return text != nullptr && absl::SimpleAtod(text, &value) && value > 0 ? value : fallback;
}

uint64_t EnvSeed() {
  const char* text = getenv("SB_CRASH_TEST_SEED");
  uint64_t value = 0;
  return text != nullptr && absl::SimpleAtoi(text, &value) ? value : kDefaultSeed;
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void SleepSeconds(double seconds) {
  std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6)));
}

// Where the disk is in the scenario. Only the driver thread moves it.
enum DiskPhase : int { kDiskFine = 0, kDiskFull = 1, kDiskRecovered = 2 };

// The planner process of the moment and the killer thread that SIGKILLs and restarts it.
class PlannerSupervisor {
 public:
  PlannerSupervisor(std::string state_dir, std::string log_dir, const std::atomic<int>* disk)
      : state_dir_(std::move(state_dir)), log_dir_(std::move(log_dir)), disk_(disk) {}
  ~PlannerSupervisor() { StopKiller(); }

  // Starts a planner (none may run). Counts a start refused while the disk was fine.
  absl::Status Start() {
    const int disk_before = disk_->load();
    std::string log_path;
    {
      std::lock_guard<std::mutex> lock(mu_);
      log_path = absl::StrCat(log_dir_, "/planner-", log_paths_.size(), ".log");
      log_paths_.push_back(log_path);
    }
    absl::StatusOr<std::unique_ptr<PlannerProcess>> started = PlannerProcess::Start(
        SB_PLANNER_PATH,
        {"--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0", "--state_dir=" + state_dir_,
         "--state_check_seconds=0.2", "--drain_seconds=0"},
        log_path);
    std::lock_guard<std::mutex> lock(mu_);
    if (!started.ok()) {
      ++failed_starts_;
      if (disk_before != kDiskFull && disk_->load() != kDiskFull) {
        unexpected_.push_back(absl::StrCat("a restart failed while the disk was not full: ",
                                           started.status().ToString()));
      }
      return started.status();
    }
    current_ = *std::move(started);
    ++generation_;
    ++starts_;
    return absl::OkStatus();
  }

  // Starts a planner, retrying every 0.2 s until one listens or `give_up_seconds` pass.
  absl::Status StartRetrying(double give_up_seconds) {
    const Clock::time_point begin = Clock::now();
    while (true) {
      absl::Status status = Start();
      if (status.ok() || SecondsSince(begin) > give_up_seconds || Stopping()) return status;
      SleepSeconds(0.2);
    }
  }

  // The current planner: {generation, port}; port 0 while none runs.
  std::pair<int, int> Current() {
    std::lock_guard<std::mutex> lock(mu_);
    return {generation_, current_ == nullptr ? 0 : current_->port()};
  }

  void Kill() {
    std::lock_guard<std::mutex> lock(mu_);
    if (current_ == nullptr) return;
    std::string how;
    if (!current_->Running(&how)) {
      unexpected_.push_back(
          absl::StrCat("sb-planner ended on its own (", how, "); log: ", current_->log_path()));
    }
    current_.reset();  // SIGKILL and reap
    ++kills_;
  }

  // SIGKILLs the planner every 0.2-1.5 s (seeded) and restarts it on the same state. A restart
  // refused (disk full) is retried every 0.2 s.
  void StartKiller(uint64_t seed) {
    killer_ = std::thread([this, seed] {
      Rng rng(seed);
      std::unique_lock<std::mutex> lock(mu_);
      while (!stop_) {
        const Clock::time_point at =
            Clock::now() + std::chrono::milliseconds(200 + static_cast<int>(1300 * rng.Uniform()));
        while (!stop_ && Clock::now() < at) {
          cv_.wait_until(lock, std::min(at, Clock::now() + std::chrono::milliseconds(50)));
          CheckAlive();
        }
        if (stop_) break;
        if (paused_) continue;
        busy_ = true;
        lock.unlock();
        Kill();
        StartRetrying(1e9).IgnoreError();
        lock.lock();
        busy_ = false;
        cv_.notify_all();
      }
    });
  }
  void StopKiller() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    if (killer_.joinable()) killer_.join();
  }
  // No kill after this returns (until Resume), and a planner runs.
  void Pause() {
    std::unique_lock<std::mutex> lock(mu_);
    paused_ = true;
    cv_.wait(lock, [this] { return !busy_; });
  }
  void Resume() {
    std::lock_guard<std::mutex> lock(mu_);
    paused_ = false;
  }

  int kills() const { return kills_; }
  int starts() const { return starts_; }
  int failed_starts() const { return failed_starts_; }
  std::vector<std::string> unexpected() {
    std::lock_guard<std::mutex> lock(mu_);
    return unexpected_;
  }
  std::vector<std::string> log_paths() {
    std::lock_guard<std::mutex> lock(mu_);
    return log_paths_;
  }

 private:
  bool Stopping() {
    std::lock_guard<std::mutex> lock(mu_);
    return stop_;
  }
  // With mu_ held: a planner that ended without our SIGKILL crashed; restarting it is the
  // killer's next round.
  void CheckAlive() {
    std::string how;
    if (current_ != nullptr && !current_->Running(&how)) {
      unexpected_.push_back(
          absl::StrCat("sb-planner ended on its own (", how, "); log: ", current_->log_path()));
      current_.reset();
    }
  }

  const std::string state_dir_;
  const std::string log_dir_;
  const std::atomic<int>* const disk_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::unique_ptr<PlannerProcess> current_;
  int generation_ = 0;
  std::atomic<int> kills_{0};
  std::atomic<int> starts_{0};
  std::atomic<int> failed_starts_{0};
  std::vector<std::string> unexpected_;
  std::vector<std::string> log_paths_;
  bool stop_ = false;
  bool paused_ = false;
  bool busy_ = false;
  std::thread killer_;
};

// A step's global batch: documents of 64-1024 tokens filling half of ranks x micro-batches x
// capacity, so every batch fits.
std::vector<Sample> MakeBatch(uint64_t seed, int job, int64_t step) {
  Rng rng(Rng::Mix(Rng::Mix(seed, static_cast<uint64_t>(job)), static_cast<uint64_t>(step)));
  const int64_t budget = kRanks * kMicroBatches * kCapacity / 2;
  std::vector<Sample> batch;
  int64_t total = 0;
  for (uint64_t i = 0;; ++i) {
    Sample s;
    s.id = static_cast<uint64_t>(step) * 1000 + i;
    s.length = 64 + static_cast<int64_t>(961 * rng.Uniform());
    s.sensitivity = 0.3 * rng.Uniform();
    if (total + s.length > budget) break;
    total += s.length;
    batch.push_back(s);
  }
  return batch;
}

// Plausible measurements of a rank's plan: every non-empty micro-batch once, its planned tokens,
// attention <= compute, density and recall in [0, 1].
std::vector<MicroBatchTiming> MakeTimings(uint64_t seed, int job, const RankStepPlan& plan,
                                          double* wait_seconds) {
  Rng rng(Rng::Mix(Rng::Mix(seed ^ 0x5eed, static_cast<uint64_t>(job) * 1000003 + plan.step),
                   static_cast<uint64_t>(plan.rank)));
  std::vector<MicroBatchTiming> timings;
  for (size_t k = 0; k < plan.micro_batches.size(); ++k) {
    const MicroBatchPlan& m = plan.micro_batches[k];
    if (m.samples.empty()) continue;
    MicroBatchTiming t;
    t.micro_batch = static_cast<int>(k);
    t.tokens = m.tokens;
    t.compute_seconds = 1e-4 + 1e-6 * static_cast<double>(m.tokens) * (1 + 0.1 * plan.rank) *
                                   (0.9 + 0.2 * rng.Uniform());
    t.attention_seconds = t.compute_seconds * (0.3 + 0.4 * rng.Uniform());
    double density = 0;
    for (const PlannedSample& p : m.samples) density += p.density;
    t.achieved_density = std::min(1.0, density / static_cast<double>(m.samples.size()));
    t.recall = 0.9 + 0.1 * rng.Uniform();
    timings.push_back(t);
  }
  *wait_seconds = 0.01 * rng.Uniform();
  return timings;
}

// Every field of a rank's plan, exactly (doubles to 17 digits), to compare two answers.
std::string DescribePlan(const RankStepPlan& plan) {
  std::string out = absl::StrFormat("step %d rank %d predicted %.17g makespan %.17g local %d",
                                    plan.step, plan.rank, plan.predicted_seconds,
                                    plan.predicted_makespan_seconds, plan.local_fallback ? 1 : 0);
  for (const MicroBatchPlan& m : plan.micro_batches) {
    absl::StrAppendFormat(&out, " | tokens %d default %.17g predicted %.17g:", m.tokens,
                          m.default_density, m.predicted_seconds);
    for (const PlannedSample& p : m.samples) {
      absl::StrAppendFormat(&out, " %d:%d[%s]@%.17g", p.id, p.length,
                            absl::StrJoin(p.segments, ","), p.density);
    }
  }
  return out;
}

struct AckedReport {
  std::vector<MicroBatchTiming> timings;
  double wait_seconds = 0;
  int new_answers = 0;        // OK answers with duplicate=false: more than one means it was lost
  int duplicate_answers = 0;  // OK answers with duplicate=true
};

struct JobRun {
  int index = 0;
  std::string job_id;
  std::string token;
  std::unique_ptr<PlannerClient> client;
  int generation = -1;  // of the planner `client` talks to
  int64_t next_step = 0;
  int64_t last_acked_step = -1;  // the last step whose SubmitBatch answered OK
  std::map<std::pair<int64_t, int>, std::string> plans;  // (step, rank) -> DescribePlan
  std::map<std::pair<int64_t, int>, AckedReport> reports;
};

// The scenario: drives the jobs step by step through kills and the full disk, then checks.
class CrashScenario {
 public:
  CrashScenario(uint64_t seed, double seconds, std::string mount_dir, std::string log_dir)
      : seed_(seed),
        seconds_(seconds),
        mount_dir_(std::move(mount_dir)),
        state_dir_(mount_dir_ + "/state"),
        filler_path_(mount_dir_ + "/filler"),
        supervisor_(state_dir_, std::move(log_dir), &disk_) {}
  ~CrashScenario() {
    supervisor_.StopKiller();
    if (filler_fd_ >= 0) close(filler_fd_);
  }

  void Run() {
    ASSERT_TRUE(supervisor_.Start().ok());
    CreateJobs();
    if (aborted_) return;
    supervisor_.StartKiller(Rng::Mix(seed_, 0xc0ffee));
    driving_ = true;
    begin_ = Clock::now();
    while (!aborted_ && SecondsSince(begin_) < seconds_) {
      const Clock::time_point round = Clock::now();
      for (JobRun& job : jobs_) {
        if (aborted_ || !StepJob(job)) break;
      }
      SleepSeconds(std::max(0.0, kRoundSeconds - SecondsSince(round)));
    }
    if (disk_.load() == kDiskFull) LeaveFullDisk();
    driving_ = false;
    driven_seconds_ = SecondsSince(begin_);
    supervisor_.StopKiller();
    ASSERT_FALSE(aborted_) << "the scenario stopped early; see the failures above";
    CheckEverythingCameBack();
    PrintSummary();
  }

 private:
  void CreateJobs() {
    for (int j = 0; j < kJobs && !aborted_; ++j) {
      JobRun job;
      job.index = j;
      PlannerConfig config;
      config.ranks = kRanks;
      config.micro_batches = kMicroBatches;
      config.micro_batch_capacity = kCapacity;
      std::optional<JobHandle> handle =
          Call<JobHandle>(job, "CreateJob", -1, -1, [&](PlannerClient& client) {
            return client.CreateJob(absl::StrCat("crash-", j), config, kHistorySteps);
          });
      if (!handle.has_value()) return;
      job.job_id = handle->job_id;
      job.token = handle->token;
      job.generation = -1;  // reconnect with the job's id and token
      for (int rank = 0; rank < kRanks; ++rank) {
        if (!Call<std::pair<PlannerConfig, int64_t>>(
                 job, "JoinJob", -1, rank, [&](PlannerClient& c) { return c.JoinJob(rank); })
                 .has_value()) {
          return;
        }
      }
      jobs_.push_back(std::move(job));
    }
  }

  // One step of `job`: the batch, every rank's plan, every rank's report. False when aborted.
  bool StepJob(JobRun& job) {
    const int64_t step = job.next_step;
    const std::vector<Sample> batch = MakeBatch(seed_, job.index, step);
    if (!Call<std::vector<uint64_t>>(job, "SubmitBatch", step, -1, [&](PlannerClient& c) {
           return c.SubmitBatch(step, batch);
         }).has_value()) {
      return false;
    }
    ++acked_submits_;
    if (disk_.load() == kDiskRecovered) ++acked_submits_after_recovery_;
    job.last_acked_step = step;
    std::vector<RankStepPlan> plans;
    for (int rank = 0; rank < kRanks; ++rank) {
      std::optional<RankStepPlan> plan =
          Call<RankStepPlan>(job, "GetRankPlan", step, rank,
                             [&](PlannerClient& c) { return c.GetRankPlan(step, rank); });
      if (!plan.has_value()) return false;
      RecordPlan(job, step, rank, *plan);
      plans.push_back(*std::move(plan));
    }
    for (int rank = 0; rank < kRanks; ++rank) {
      double wait = 0;
      const std::vector<MicroBatchTiming> timings =
          MakeTimings(seed_, job.index, plans[rank], &wait);
      std::optional<bool> duplicate =
          Call<bool>(job, "ReportStep", step, rank,
                     [&](PlannerClient& c) { return c.ReportStep(step, rank, timings, wait); });
      if (!duplicate.has_value()) return false;
      AckedReport& acked = job.reports[{step, rank}];
      acked.timings = timings;
      acked.wait_seconds = wait;
      if (*duplicate) {
        // Stored by an earlier attempt whose answer was lost to a kill.
        ++acked.duplicate_answers;
        ++reports_first_answered_duplicate_;
      } else {
        ++acked.new_answers;
      }
      ++acked_reports_;
    }
    ++job.next_step;
    return true;
  }

  void RecordPlan(JobRun& job, int64_t step, int rank, const RankStepPlan& plan) {
    const std::string described = DescribePlan(plan);
    auto [it, inserted] = job.plans.emplace(std::make_pair(step, rank), described);
    ++plan_answers_;
    if (!inserted && it->second != described) {
      ADD_FAILURE() << "seed " << seed_ << ": job " << job.index << " (" << job.job_id << ") step "
                    << step << " rank " << rank
                    << ": an acknowledged plan changed.\nbefore: " << it->second
                    << "\nnow:    " << described;
      ++lost_;
    }
  }

  // Calls `fn` on the job's client until it answers OK (reconnecting to each restarted planner)
  // and checks every failure: UNAVAILABLE/DEADLINE_EXCEEDED at any time (the planner is down),
  // STATE_DIR_FAILURE (RESOURCE_EXHAUSTED/INTERNAL) only while the disk is full, nothing else.
  template <typename T>
  std::optional<T> Call(JobRun& job, const char* method, int64_t step, int rank,
                        const std::function<absl::StatusOr<T>(PlannerClient&)>& fn) {
    const Clock::time_point started = Clock::now();
    absl::Status last;
    while (!aborted_) {
      Tick();
      if (EnsureConnected(job)) {
        const int disk = disk_.load();
        absl::StatusOr<T> result = fn(*job.client);
        if (result.ok()) return *std::move(result);
        last = result.status();
        CheckFailure(last, disk, job, method, step, rank);
      }
      const Clock::time_point since = std::max(started, recovered_at_);
      if (disk_.load() != kDiskFull &&
          std::chrono::duration<double>(Clock::now() - since).count() > kStuckSeconds) {
        ADD_FAILURE() << "seed " << seed_ << ": " << method << " of job " << job.index << " step "
                      << step << " rank " << rank << " kept failing for " << kStuckSeconds
                      << " s; last: " << last;
        aborted_ = true;
        break;
      }
      SleepSeconds(0.02);
    }
    return std::nullopt;
  }

  void CheckFailure(const absl::Status& status, int disk, const JobRun& job, const char* method,
                    int64_t step, int rank) {
    const bool state_dir = ErrorReason(status) == kReasonStateDirFailure &&
                           (status.code() == absl::StatusCode::kResourceExhausted ||
                            status.code() == absl::StatusCode::kInternal);
    const bool down = status.code() == absl::StatusCode::kUnavailable ||
                      status.code() == absl::StatusCode::kDeadlineExceeded;
    if (disk == kDiskFull) ++full_disk_failures_;
    if (down) {
      ++down_failures_;
      return;
    }
    if (state_dir && disk == kDiskFull) {
      ++state_dir_failures_;
      return;
    }
    ADD_FAILURE() << "seed " << seed_ << ": " << method << " of job " << job.index << " ("
                  << job.job_id << ") step " << step << " rank " << rank << " while the disk was "
                  << (disk == kDiskFull   ? "full"
                      : disk == kDiskFine ? "fine"
                                          : "recovered")
                  << ": unexpected " << status << " (reason \"" << ErrorReason(status) << "\")";
    if (++unexpected_failures_ >= kMaxUnexpectedFailures) aborted_ = true;
  }

  // A client on the current planner (a new one after each restart); false while none runs.
  // After a restart, the job's last acknowledged reports are resent: each must be a duplicate.
  bool EnsureConnected(JobRun& job) {
    const auto [generation, port] = supervisor_.Current();
    if (port == 0) return false;
    if (job.generation == generation && job.client != nullptr) return true;
    ClientOptions options;
    options.target = absl::StrCat("127.0.0.1:", port);
    options.job_id = job.job_id;
    options.token = job.token;
    options.call_timeout_seconds = 1.0;
    options.plan_timeout_seconds = 1.0;
    absl::StatusOr<std::unique_ptr<PlannerClient>> client = PlannerClient::Connect(options);
    if (!client.ok()) {
      ADD_FAILURE() << client.status();
      aborted_ = true;
      return false;
    }
    job.client = *std::move(client);
    job.generation = generation;
    ResendLastReports(job);
    return true;
  }

  // An acknowledged report sent again must be answered as a duplicate; a new answer means the
  // planner lost it (`how` says when it was resent).
  void CountResentAnswer(const JobRun& job, int64_t step, int rank, bool duplicate,
                         AckedReport& acked, const char* how) {
    if (duplicate) {
      ++acked.duplicate_answers;
      return;
    }
    ++acked.new_answers;
    ++lost_;
    ADD_FAILURE() << "seed " << seed_ << ": job " << job.index << " (" << job.job_id << ") step "
                  << step << " rank " << rank << ": an acknowledged report was lost " << how;
  }

  void ResendLastReports(JobRun& job) {
    if (job.reports.empty()) return;
    const int64_t step = job.reports.rbegin()->first.first;
    for (auto it = job.reports.lower_bound({step, 0}); it != job.reports.end(); ++it) {
      const int rank = it->first.second;
      AckedReport& acked = it->second;
      absl::StatusOr<bool> duplicate =
          job.client->ReportStep(step, rank, acked.timings, acked.wait_seconds);
      if (!duplicate.ok()) continue;  // checked again later
      ++resent_after_restart_;
      CountResentAnswer(job, step, rank, *duplicate, acked, "by a restart (resent, it was new)");
    }
    const auto plan = job.plans.find({step, 0});
    if (plan != job.plans.end()) {
      absl::StatusOr<RankStepPlan> again = job.client->GetRankPlan(step, 0);
      if (again.ok()) RecordPlan(job, step, 0, *again);
    }
  }

  // Moves the disk phase on the driver's clock and keeps a full disk full.
  void Tick() {
    if (!driving_) return;
    const double elapsed = SecondsSince(begin_);
    const int disk = disk_.load();
    if (disk == kDiskFine && elapsed >= 0.35 * seconds_) {
      EnterFullDisk();
    } else if (disk == kDiskFull && elapsed >= 0.6 * seconds_) {
      LeaveFullDisk();
    } else if (disk == kDiskFull) {
      // Kills again for the second half: the restarts are refused until the disk recovers.
      if (killer_paused_ && elapsed >= 0.475 * seconds_) ResumeKiller();
      FillDisk();  // the planner frees a little now and then (a cut-off append, a *.tmp)
    }
  }

  void ResumeKiller() {
    supervisor_.Resume();
    killer_paused_ = false;
  }

  // Appends to the filler until the tmpfs answers ENOSPC.
  void FillDisk() {
    static const std::string chunk(1 << 16, 'x');
    while (true) {
      const ssize_t n = write(filler_fd_, chunk.data(), chunk.size());
      if (n > 0) continue;
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno != ENOSPC) ADD_FAILURE() << "filling the tmpfs: " << strerror(errno);
      return;
    }
  }

  // The first half of the full-disk phase runs without kills: one planner lives through the
  // full disk (health NOT_SERVING, its writes refused) and sees it recover in the second half.
  void EnterFullDisk() {
    supervisor_.Pause();
    killer_paused_ = true;
    filler_fd_ = open(filler_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (filler_fd_ < 0) {
      ADD_FAILURE() << "cannot create " << filler_path_ << ": " << strerror(errno);
      aborted_ = true;
      ResumeKiller();
      return;
    }
    FillDisk();
    disk_ = kDiskFull;
    full_at_ = Clock::now();
    full_from_seconds_ = SecondsSince(begin_);
    saw_not_serving_ = WaitForHealth(2, 10.0);
  }

  void LeaveFullDisk() {
    if (killer_paused_) ResumeKiller();
    close(filler_fd_);
    filler_fd_ = -1;
    EXPECT_EQ(unlink(filler_path_.c_str()), 0) << strerror(errno);
    disk_ = kDiskRecovered;
    recovered_at_ = Clock::now();
    full_seconds_ = std::chrono::duration<double>(recovered_at_ - full_at_).count();
    saw_serving_again_ = WaitForHealth(1, 15.0);
  }

  // Polls the current planner's health (through restarts) for `want`: 1 SERVING, 2 NOT_SERVING.
  bool WaitForHealth(int want, double seconds) {
    const Clock::time_point begin = Clock::now();
    while (SecondsSince(begin) < seconds) {
      const int port = supervisor_.Current().second;
      if (port != 0) {
        auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                           grpc::InsecureChannelCredentials());
        if (test_support::HealthStatus(channel, kServiceName, 0.5) == want) return true;
      }
      SleepSeconds(0.05);
    }
    return false;
  }

  // The last restart: every job, plan and report acknowledged must be there.
  void CheckEverythingCameBack() {
    supervisor_.Kill();
    ASSERT_TRUE(supervisor_.StartRetrying(10.0).ok()) << "the final restart failed";
    const std::vector<std::string> logs = supervisor_.log_paths();
    const std::string final_log = tools::ReadFile(logs.back()).value_or("");
    EXPECT_NE(final_log.find(absl::StrCat("(", kJobs, " jobs reloaded)")), std::string::npos)
        << final_log;
    const int port = supervisor_.Current().second;
    auto stub = v1::PlannerService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
    for (JobRun& job : jobs_) {
      ASSERT_TRUE(EnsureConnected(job));
      v1::GetJobRequest request;
      request.set_job_id(job.job_id);
      v1::GetJobResponse response;
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      context.AddMetadata("authorization", "Bearer " + job.token);
      const absl::Status got = FromGrpcStatus(stub->GetJob(&context, request, &response));
      ASSERT_TRUE(got.ok()) << "job " << job.index << " (" << job.job_id
                            << ") is not back: " << got;
      EXPECT_EQ(response.job().state(), v1::JOB_STATE_ACTIVE) << response.job().failure();
      EXPECT_GE(response.job().next_step(), job.last_acked_step + 1)
          << "seed " << seed_ << ": job " << job.index << " lost acknowledged steps";
      const int64_t first_kept = response.job().next_step() - kHistorySteps;

      for (const auto& [key, described] : job.plans) {
        const auto [step, rank] = key;
        if (step < first_kept) {
          ++not_kept_;
          continue;
        }
        absl::StatusOr<RankStepPlan> plan = job.client->GetRankPlan(step, rank);
        ASSERT_TRUE(plan.ok()) << "seed " << seed_ << ": job " << job.index << " step " << step
                               << " rank " << rank
                               << ": acknowledged plan not served: " << plan.status();
        ++plans_checked_;
        EXPECT_EQ(DescribePlan(*plan), described)
            << "seed " << seed_ << ": job " << job.index << " step " << step << " rank " << rank
            << ": the acknowledged plan changed";
      }
      for (auto& [key, acked] : job.reports) {
        const auto [step, rank] = key;
        if (step < first_kept) {
          ++not_kept_;
          continue;
        }
        absl::StatusOr<bool> duplicate =
            job.client->ReportStep(step, rank, acked.timings, acked.wait_seconds);
        ASSERT_TRUE(duplicate.ok()) << "seed " << seed_ << ": job " << job.index << " step " << step
                                    << " rank " << rank << ": " << duplicate.status();
        ++reports_checked_;
        CountResentAnswer(job, step, rank, *duplicate, acked, "(resent at the end, it was new)");
        std::vector<MicroBatchTiming> changed = acked.timings;
        double wait = acked.wait_seconds;
        if (changed.empty()) {
          wait += 0.5;
        } else {
          changed[0].compute_seconds *= 1.5;
        }
        EXPECT_EQ(job.client->ReportStep(step, rank, changed, wait).status().code(),
                  absl::StatusCode::kAlreadyExists)
            << "seed " << seed_ << ": job " << job.index << " step " << step << " rank " << rank
            << ": a changed resend was not compared with the stored report";
        EXPECT_LE(acked.new_answers, 1)
            << "seed " << seed_ << ": job " << job.index << " step " << step << " rank " << rank
            << " was acknowledged as new " << acked.new_answers << " times";
      }
    }

    for (const std::string& path : logs) {
      const std::string log = tools::ReadFile(path).value_or("");
      EXPECT_EQ(log.find("could not be loaded"), std::string::npos) << path << ":\n" << log;
      if (log.find("could not be folded") != std::string::npos) ++logs_with_unfolded_steps_;
    }
    std::error_code error;
    const std::filesystem::path quarantine = state_dir_ + "/quarantine";
    if (std::filesystem::exists(quarantine, error)) {
      EXPECT_TRUE(std::filesystem::is_empty(quarantine, error))
          << "jobs were quarantined in " << quarantine;
    }
    for (const std::string& what : supervisor_.unexpected()) {
      ADD_FAILURE() << "seed " << seed_ << ": " << what;
    }
    EXPECT_GT(supervisor_.kills(), 0);
    EXPECT_GT(full_disk_failures_, 0) << "no call failed while the disk was full";
    EXPECT_TRUE(saw_not_serving_) << "health never went NOT_SERVING with the disk full";
    EXPECT_GT(acked_submits_after_recovery_, 0) << "no step was planned after the disk recovered";
    EXPECT_TRUE(saw_serving_again_) << "health never came back to SERVING after the disk recovered";
    EXPECT_EQ(lost_, 0);
  }

  void PrintSummary() {
    std::printf(
        "crash_disk_fault: seed %llu, %.1f s driven (the disk full from %.1f s for %.1f s), "
        "%d kills, %d starts, %d refused starts; %lld submits, %lld reports (%lld first "
        "answered duplicate), %lld plan answers acknowledged; %lld reports resent after "
        "restarts; %lld failures while the disk was full (%lld STATE_DIR_FAILURE), %lld "
        "UNAVAILABLE/DEADLINE_EXCEEDED in all; checked %lld plans and %lld reports after the "
        "last restart (%lld older than the kept history); %d planner logs with unfolded "
        "steps; lost %lld\n",
        static_cast<unsigned long long>(seed_), driven_seconds_, full_from_seconds_, full_seconds_,
        supervisor_.kills(), supervisor_.starts(), supervisor_.failed_starts(),
        static_cast<long long>(acked_submits_), static_cast<long long>(acked_reports_),
        static_cast<long long>(reports_first_answered_duplicate_),
        static_cast<long long>(plan_answers_), static_cast<long long>(resent_after_restart_),
        static_cast<long long>(full_disk_failures_), static_cast<long long>(state_dir_failures_),
        static_cast<long long>(down_failures_), static_cast<long long>(plans_checked_),
        static_cast<long long>(reports_checked_), static_cast<long long>(not_kept_),
        logs_with_unfolded_steps_, static_cast<long long>(lost_));
    std::fflush(stdout);
  }

  const uint64_t seed_;
  const double seconds_;
  const std::string mount_dir_;
  const std::string state_dir_;
  const std::string filler_path_;
  std::atomic<int> disk_{kDiskFine};
  PlannerSupervisor supervisor_;
  std::vector<JobRun> jobs_;
  bool driving_ = false;
  bool killer_paused_ = false;
  bool aborted_ = false;
  Clock::time_point begin_;
  Clock::time_point full_at_;
  Clock::time_point recovered_at_;
  int filler_fd_ = -1;
  bool saw_not_serving_ = false;
  bool saw_serving_again_ = false;
  double driven_seconds_ = 0;
  double full_seconds_ = 0;
  double full_from_seconds_ = 0;  // when the disk filled up, seconds into the run
  int64_t acked_submits_ = 0;
  int64_t acked_submits_after_recovery_ = 0;
  int64_t acked_reports_ = 0;
  int64_t reports_first_answered_duplicate_ = 0;
  int64_t plan_answers_ = 0;
  int64_t resent_after_restart_ = 0;
  int64_t full_disk_failures_ = 0;
  int64_t state_dir_failures_ = 0;
  int64_t down_failures_ = 0;
  int64_t unexpected_failures_ = 0;
  int64_t plans_checked_ = 0;
  int64_t reports_checked_ = 0;
  int64_t not_kept_ = 0;
  int64_t lost_ = 0;
  int logs_with_unfolded_steps_ = 0;
};

TEST(CrashDiskFaultTest, KillsAndAFullDiskLoseNoAcknowledgedPlanOrReport) {
  std::string pattern = ::testing::TempDir() + "sb_crash_XXXXXX";
  ASSERT_NE(mkdtemp(pattern.data()), nullptr) << strerror(errno);
  const std::string root = pattern;
  const std::string log_dir = root + "/logs";
  ASSERT_EQ(mkdir(log_dir.c_str(), 0700), 0) << strerror(errno);
  test_support::TmpfsMount disk(std::to_string(kTmpfsBytes));
  if (!disk.mounted()) {
    GTEST_SKIP() << "this test needs to mount a tmpfs (run it as root, or in a container with "
                    "CAP_SYS_ADMIN): "
                 << disk.error();
  }
  const std::string mount_dir = disk.path();
  const uint64_t seed = EnvSeed();
  const double seconds = EnvDouble("SB_CRASH_TEST_SECONDS", kDefaultSeconds);
  std::printf("crash_disk_fault: seed %llu, %.0f s, planner logs in %s\n",
              static_cast<unsigned long long>(seed), seconds, log_dir.c_str());
  {
    // Destroyed before the mount: every planner is killed and reaped before the unmount.
    CrashScenario scenario(seed, seconds, mount_dir, log_dir);
    scenario.Run();
  }

  if (!HasFailure()) std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace sparsebalance
