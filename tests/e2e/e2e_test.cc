// End to end, with real processes: sb-planner, sb-worker ranks (CPU kernels) synchronised by
// the step-sync hub, and sb-run (the main job). The planner is killed with SIGKILL mid-run and
// restarted on its state directory; a worker is killed and restarted; the main job's measured
// figures favour sparsebalance over sequential; a document of 4x the capacity trains split over
// the 4 ranks (context parallelism), every connection proving the run's secret.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/planner_client.h"
#include "gtest/gtest.h"
#include "tests/support/loopback_client.h"
#include "tools/child_process.h"
#include "tools/tool_support.h"
#include "worker/run_summary.h"
#include "worker/step_inputs.h"
#include "worker/step_sync.h"

namespace sparsebalance {
namespace {

using Clock = std::chrono::steady_clock;

double UnixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

class TempDir {
 public:
  TempDir() {
    char name[] = "/tmp/sb-e2e-XXXXXX";
    path_ = mkdtemp(name);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A child process with its stdout and stderr appended to `log`.
std::unique_ptr<tools::ChildProcess> Start(const std::vector<std::string>& args,
                                           const std::string& log) {
  absl::StatusOr<std::unique_ptr<tools::ChildProcess>> child =
      tools::ChildProcess::Start(args, {log, log});
  EXPECT_TRUE(child.ok()) << child.status();
  return child.ok() ? *std::move(child) : nullptr;
}

// A free loopback port (bound, read, released) for a planner that must come back on it.
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// sb-planner on `port`, once it listens (null, with a test failure, when it does not).
std::unique_ptr<tools::PlannerProcess> StartPlanner(const std::string& state, int port,
                                                    const std::string& log) {
  absl::StatusOr<std::unique_ptr<tools::PlannerProcess>> planner =
      tools::PlannerProcess::Start(SB_PLANNER_PATH,
                                   {absl::StrCat("--listen=127.0.0.1:", port),
                                    "--metrics_listen=127.0.0.1:0", "--state_dir=" + state},
                                   log, /*start_timeout_seconds=*/60);
  EXPECT_TRUE(planner.ok()) << planner.status();
  return planner.ok() ? *std::move(planner) : nullptr;
}

std::unique_ptr<PlannerClient> Connect(int port, const std::string& job = "",
                                       const std::string& token = "") {
  return test_support::ConnectLoopback(port, job, token, /*call_timeout_seconds=*/5);
}

// A tiny model so that a step takes tens of milliseconds.
PlannerConfig TinyJob(int ranks) {
  PlannerConfig c;
  c.ranks = ranks;
  c.micro_batches = 1;
  c.micro_batch_capacity = 2048;
  c.shape.layers = 1;
  c.shape.heads = 1;
  c.shape.head_dim = 64;
  c.policy = Policy::kSparseBalance;
  return c;
}

// A job on a running planner (retrying while it starts), its token in a file.
JobHandle CreateJob(int port, const PlannerConfig& config, const std::string& token_file) {
  std::unique_ptr<PlannerClient> admin = Connect(port);
  absl::StatusOr<JobHandle> job;
  for (int attempt = 0; attempt < 100; ++attempt) {
    job = admin->CreateJob("e2e", config);
    if (job.ok() || !IsUnreachable(job.status())) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(job.ok()) << job.status();
  std::ofstream(token_file) << job->token << "\n";
  return *job;
}

// The step-sync secret of these jobs (sb-run draws one for each run).
constexpr char kSyncSecret[] = "e2e-test-step-sync-secret-0123456789";

std::unique_ptr<tools::ChildProcess> StartWorker(int port, const JobHandle& job, int rank,
                                                 const std::string& token_file,
                                                 const std::string& sync,
                                                 const std::string& secret_file, int steps,
                                                 const std::string& out, const std::string& log) {
  return Start(
      {SB_WORKER_PATH, absl::StrCat("--planner=127.0.0.1:", port), "--job=" + job.job_id,
       absl::StrCat("--rank=", rank), "--token_file=" + token_file, "--device=cpu",
       "--sync=" + sync, "--sync_secret_file=" + secret_file, absl::StrCat("--steps=", steps),
       "--call_timeout=1", "--plan_timeout=20", "--out=" + out, "--min_length=64"},
      log);
}

// Lines of `path` so far (a worker may be writing it).
std::vector<StepLine> Lines(const std::string& path) {
  std::vector<StepLine> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    absl::StatusOr<StepLine> s = ParseStepLine(line);
    if (s.ok()) out.push_back(*s);
  }
  return out;
}

int64_t StepsDone(const std::string& path, int rank) {
  int64_t n = 0;
  for (const StepLine& s : Lines(path)) n += s.rank == rank ? 1 : 0;
  return n;
}

// Waits up to a minute for `rank` to have written `steps` step lines; whether it has.
bool WaitForSteps(const std::string& lines, int rank, int64_t steps) {
  const Clock::time_point start = Clock::now();
  while (StepsDone(lines, rank) < steps && Clock::now() - start < std::chrono::seconds(60)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return StepsDone(lines, rank) >= steps;
}

std::string ReadAll(const std::string& path) { return tools::ReadFile(path).value_or(""); }

// A tiny job under way in a temporary folder: sb-planner on a fixed port (state in dir/state),
// the job (its token in dir/token), the step-sync hub (its secret in dir/sync_secret) and the
// workers, their step lines in
// dir/steps.jsonl and their logs in dir/workerR.log. Everything stops, and the folder goes,
// when it is destroyed.
struct JobUnderWay {
  std::unique_ptr<TempDir> temp = std::make_unique<TempDir>();
  int port = 0;
  std::unique_ptr<tools::PlannerProcess> planner;
  JobHandle job;
  std::string token_file;
  std::string secret_file;
  std::unique_ptr<StepSyncHub> hub;
  std::vector<std::unique_ptr<tools::ChildProcess>> workers;

  const std::string& dir() const { return temp->path(); }
  std::string lines() const { return dir() + "/steps.jsonl"; }
  std::string worker_log(int rank) const { return absl::StrCat(dir(), "/worker", rank, ".log"); }
  // Whether everything started (each failure is also a test failure).
  bool ok() const { return planner != nullptr && hub != nullptr; }
  // Whether everything started and `rank` wrote `steps` step lines within a minute (when not,
  // the failure shows its log).
  ::testing::AssertionResult RankReached(int rank, int64_t steps) const {
    if (!ok()) return ::testing::AssertionFailure() << "the job did not start";
    if (WaitForSteps(lines(), rank, steps)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "rank " << rank << " did not write " << steps
                                         << " steps: " << ReadAll(worker_log(rank));
  }
};

JobUnderWay StartJob(int ranks, int steps) {
  JobUnderWay run;
  run.port = FreePort();
  run.planner = StartPlanner(run.dir() + "/state", run.port, run.dir() + "/planner.log");
  if (run.planner == nullptr) return run;
  run.token_file = run.dir() + "/token";
  run.job = CreateJob(run.port, TinyJob(ranks), run.token_file);
  run.secret_file = run.dir() + "/sync_secret";
  EXPECT_TRUE(tools::WritePrivateFile(run.secret_file, absl::StrCat(kSyncSecret, "\n")).ok());
  StepSyncHubOptions hub_options;
  hub_options.secret = kSyncSecret;
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StepSyncHub::Start(ranks, hub_options);
  EXPECT_TRUE(hub.ok()) << hub.status();
  if (!hub.ok()) return run;
  run.hub = *std::move(hub);
  for (int r = 0; r < ranks; ++r) {
    run.workers.push_back(StartWorker(run.port, run.job, r, run.token_file, run.hub->address(),
                                      run.secret_file, steps, run.lines(), run.worker_log(r)));
  }
  return run;
}

TEST(EndToEndTest, PlannerKilledMidRunComesBackWithEveryPlanAndAcknowledgedReport) {
  constexpr int kRanks = 3;
  constexpr int kSteps = 14;
  JobUnderWay run = StartJob(kRanks, kSteps);
  // Let a few steps go through the planner, then kill it.
  ASSERT_TRUE(run.RankReached(0, 4));
  const std::string lines = run.lines();
  run.planner->Kill();
  const double killed_at = UnixSeconds();
  // The ranks go on alone for a while.
  WaitForSteps(lines, 0, StepsDone(lines, 0) + 2);
  run.planner = StartPlanner(run.dir() + "/state", run.port, run.dir() + "/planner-restarted.log");
  ASSERT_NE(run.planner, nullptr);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(run.workers[r]->WaitFor(180), 0) << ReadAll(run.worker_log(r));
  }
  absl::StatusOr<std::vector<StepLine>> all = ReadStepLines(lines);
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), static_cast<size_t>(kRanks * kSteps));  // the job went on to the end
  int local_steps = 0;
  for (const StepLine& s : *all) local_steps += s.local_fallback ? 1 : 0;
  EXPECT_GT(local_steps, 0) << "no rank ran on a local plan while the planner was down";

  std::map<int, std::unique_ptr<PlannerClient>> clients;
  for (int r = 0; r < kRanks; ++r) clients[r] = Connect(run.port, run.job.job_id, run.job.token);
  int plans_checked = 0, reports_checked = 0;
  for (const StepLine& s : *all) {
    // Every report acknowledged before the kill is still there: an empty repeat is compared
    // with it and refused as different (a lost one would be refused as incomplete instead).
    if (s.acked && s.wall_end < killed_at) {
      absl::StatusOr<bool> repeat = clients[s.rank]->ReportStep(s.step, s.rank, {}, 0.0);
      EXPECT_EQ(repeat.status().code(), absl::StatusCode::kAlreadyExists)
          << "the report of step " << s.step << " rank " << s.rank
          << " was acknowledged before the kill and is lost: " << repeat.status();
      ++reports_checked;
    }
    // Every plan the planner issued before the kill is served identically after it.
    if (!s.local_fallback && s.wall_start < killed_at) {
      absl::StatusOr<RankStepPlan> plan = clients[s.rank]->GetRankPlan(s.step, s.rank);
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_EQ(PlanDigest(plan->micro_batches), s.plan_digest)
          << "step " << s.step << " rank " << s.rank;
      ++plans_checked;
    }
  }
  EXPECT_GE(plans_checked, 4 * kRanks);
  EXPECT_GE(reports_checked, 3 * kRanks);
}

TEST(EndToEndTest, AKilledWorkerRestartsOnItsRankAndTheJobContinues) {
  constexpr int kRanks = 3;
  constexpr int kSteps = 8;
  JobUnderWay run = StartJob(kRanks, kSteps);
  ASSERT_TRUE(run.RankReached(2, 3));
  run.workers[2]->Kill();
  const int64_t done_before = StepsDone(run.lines(), 2);
  run.workers[2] =
      StartWorker(run.port, run.job, 2, run.token_file, run.hub->address(), run.secret_file, kSteps,
                  run.lines(), run.dir() + "/worker2-restarted.log");
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(run.workers[r]->WaitFor(120), 0);
  absl::StatusOr<std::vector<StepLine>> all = ReadStepLines(run.lines());
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), static_cast<size_t>(kRanks * kSteps));
  // It resumed where its reports stopped, not from step 0: at the first step without a line,
  // or one later if it was killed between sending a report and writing that step's line.
  const std::string log = ReadAll(run.dir() + "/worker2-restarted.log");
  EXPECT_TRUE(log.find(absl::StrCat("from step ", done_before, "\n")) != std::string::npos ||
              log.find(absl::StrCat("from step ", done_before + 1, "\n")) != std::string::npos)
      << "killed after " << done_before << " steps: " << log;
}

// What the workers measure is thread CPU time, which other load on the cores hardly moves: over
// many runs, under a parallel CTest and a concurrent PyTorch example, the sequential run's
// imbalance stayed within 1.47-1.49 and sparsebalance's within 1.18-1.30, with recall
// 0.556 against 0.568-0.790 (tests/e2e/main_job_noise.py measures it; the spread comes from
// sb-profile's wall-clock table, which the planner's model starts from and then corrects). So
// the test asserts margins well inside that spread: sparsebalance at least 0.05 more balanced
// (a sequential policy in its place measures the same 1.48 and fails), and its recall not
// lower, but for 0.02 of slack because the workers estimate recall from block scores while
// the planner keeps its recall model's figure. Six steps, so that a noisy first profile is
// corrected by what the workers report.
TEST(EndToEndTest, TheMainJobIsMoreBalancedWithSparseBalanceAndRecallIsNotLower) {
  constexpr int kSteps = 6;
  TempDir dir;
  const std::string out = dir.path() + "/out";
  std::unique_ptr<tools::ChildProcess> run =
      Start({SB_RUN_PATH, "--planner_listen=127.0.0.1:0", "--state_dir=" + dir.path() + "/state",
             "--out=" + out, "--workers=4", absl::StrCat("--steps=", kSteps), "--capacity=2048",
             "--micro_batches=2", "--fill=0.6"},
            dir.path() + "/run.log");
  ASSERT_NE(run, nullptr);
  ASSERT_EQ(run->WaitFor(300), 0) << ReadAll(dir.path() + "/run.log");
  absl::StatusOr<RunResult> sequential =
      SummarizeRun("sequential", out + "/sequential.steps.jsonl", 4);
  absl::StatusOr<RunResult> balanced =
      SummarizeRun("sparsebalance", out + "/sparsebalance.steps.jsonl", 4);
  ASSERT_TRUE(sequential.ok() && balanced.ok());
  EXPECT_EQ(sequential->steps.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(balanced->steps.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(balanced->local_plan_steps, 0) << "the planner's plans, not the local fallback";
  const std::string summary = ReadAll(out + "/summary.txt");
  EXPECT_LT(balanced->imbalance, sequential->imbalance - 0.05) << summary;
  EXPECT_GE(balanced->mean_recall, sequential->mean_recall - 0.02) << summary;
  EXPECT_TRUE(std::filesystem::exists(out + "/timeline.svg"));
}

// Context parallelism end to end (issue 15): sb-run with --long_document_factor=4 gives every
// step a document of 4x the micro-batch capacity, which only trains split over the 4 CPU
// ranks. Through the real planner and real workers exchanging keys, values and gradients over
// TCP: every step completes on the planner's plans, the long document runs as 4 shards on 4
// distinct ranks covering its tokens once, and the reports (acknowledged by the planner,
// which refuses exchange_seconds outside [0, compute) or without a shard) carry an exchange
// time > 0 for them. No prior profile, few steps, small shapes: it checks the path, not speed.
TEST(EndToEndTest, TheMainJobTrainsADocumentOfFourTimesTheCapacityOverFourRanks) {
  constexpr int kSteps = 3;
  constexpr int64_t kCapacity = 1024;
  TempDir dir;
  const std::string out = dir.path() + "/out";
  std::unique_ptr<tools::ChildProcess> run =
      Start({SB_RUN_PATH, "--planner_listen=127.0.0.1:0", "--state_dir=" + dir.path() + "/state",
             "--out=" + out, "--workers=4", absl::StrCat("--steps=", kSteps),
             absl::StrCat("--capacity=", kCapacity), "--micro_batches=2", "--fill=0.6",
             "--policies=sparsebalance", "--profile=none", "--long_document_factor=4"},
            dir.path() + "/run.log");
  ASSERT_NE(run, nullptr);
  ASSERT_EQ(run->WaitFor(300), 0) << ReadAll(dir.path() + "/run.log");
  const std::string log = ReadAll(dir.path() + "/run.log");
  absl::StatusOr<RunResult> result =
      SummarizeRun("sparsebalance", out + "/sparsebalance.steps.jsonl", 4);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->steps.size(), static_cast<size_t>(kSteps)) << log;
  EXPECT_EQ(result->local_plan_steps, 0) << "the planner's plans, not the local fallback";
  for (const auto& [step, lines] : result->steps) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    std::set<int> ranks;
    std::map<int, std::pair<int64_t, int64_t>> ranges;  // shard index -> tokens
    for (const StepLine& line : lines) {
      EXPECT_TRUE(line.acked) << "rank " << line.rank << "'s report was refused or lost";
      EXPECT_LT(line.exchange_seconds, line.compute_seconds);
      for (const ShardLine& shard : line.shards) {
        if (shard.sample != LongDocumentId(step)) continue;
        EXPECT_EQ(shard.length, 4 * kCapacity);
        EXPECT_EQ(shard.shards, 4);
        EXPECT_GT(shard.exchange_seconds, 0.0);
        EXPECT_GT(line.exchange_seconds, 0.0);
        ranks.insert(line.rank);
        ranges[shard.index] = {shard.begin, shard.end};
      }
    }
    EXPECT_EQ(ranks.size(), 4u) << "the long document's 4 shards on 4 distinct ranks";
    ASSERT_EQ(ranges.size(), 4u);
    int64_t next = 0;
    for (const auto& [index, range] : ranges) {
      EXPECT_EQ(range.first, next) << "shard " << index;
      next = range.second;
    }
    EXPECT_EQ(next, 4 * kCapacity);
    EXPECT_NE(log.find(absl::StrCat("step ", step, ": document ", LongDocumentId(step), " (",
                                    4 * kCapacity, " tokens) split into 4 shards")),
              std::string::npos)
        << log;
  }
  // Every connection to the hub and between the ranks proved the run's secret, whose file is
  // gone with the run.
  EXPECT_EQ(log.find("dropped"), std::string::npos) << log;
  for (int r = 0; r < 4; ++r) {
    const std::string rank_log = ReadAll(absl::StrCat(out, "/sparsebalance.rank", r, ".log"));
    EXPECT_EQ(rank_log.find("dropped"), std::string::npos) << rank_log;
  }
  EXPECT_FALSE(std::filesystem::exists(out + "/sparsebalance.sync_secret"));
}

// A CPU rank proves the run's secret to the hub and its peers, read from a file (a command line
// is public to `ps`): without one, or with one it cannot read or that cannot be a secret, it
// stops at once with an error naming the flag, before it contacts anything.
TEST(EndToEndTest, AWorkerWithTheHubButNoUsableSecretFileStopsNamingTheFlag) {
  TempDir dir;
  const std::string token = dir.path() + "/token";
  const std::string secret = dir.path() + "/secret";
  ASSERT_TRUE(tools::WritePrivateFile(token, "t\n").ok());
  ASSERT_TRUE(tools::WritePrivateFile(secret, "too-short\n").ok());
  // Nothing listens at port 1: the worker must stop before it tries.
  std::vector<std::string> worker = {SB_WORKER_PATH, "--planner=127.0.0.1:1", "--sync=127.0.0.1:1"};
  worker.insert(worker.end(), {"--job=j", "--rank=0", "--token_file=" + token});
  struct Case {
    std::string flag;
    std::string message;
    int exit_code;
  };
  const std::vector<Case> cases = {
      {"", "--sync_secret_file is required with --sync", tools::kExitUsage},
      {"--sync_secret_file=" + dir.path() + "/missing",
       "--sync_secret_file: ", tools::kExitFailure},
      {"--sync_secret_file=" + secret, "--sync_secret_file: secret: 9 bytes", tools::kExitUsage},
  };
  for (const auto& [flag, message, exit_code] : cases) {
    SCOPED_TRACE(flag);
    std::vector<std::string> args = worker;
    if (!flag.empty()) args.push_back(flag);
    const std::string log = dir.path() + "/worker.log";
    std::filesystem::remove(log);
    std::unique_ptr<tools::ChildProcess> child = Start(args, log);
    ASSERT_NE(child, nullptr);
    EXPECT_EQ(child->WaitFor(30), exit_code) << ReadAll(log);
    EXPECT_NE(ReadAll(log).find(message), std::string::npos) << ReadAll(log);
  }
}

// A CPU rank and the hub prove the run's secret to each other before the rank joins the
// planner: a worker whose secret file holds another run's secret stops naming that file, and
// the planner never sees its join. (It joined first, then failed at the hub: a planner counted
// a rank that never ran a step. Nothing listens at the planner's address here, so a join would
// be retried for a minute and fail naming JoinJob.)
TEST(EndToEndTest, AWorkerWithAnotherRunsSecretStopsBeforeItJoins) {
  TempDir dir;
  const std::string token = dir.path() + "/token";
  const std::string secret = dir.path() + "/secret";
  ASSERT_TRUE(tools::WritePrivateFile(token, "t\n").ok());
  ASSERT_TRUE(tools::WritePrivateFile(secret, "another-runs-step-sync-secret-0123456789\n").ok());
  StepSyncHubOptions hub_options;
  hub_options.secret = kSyncSecret;
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StepSyncHub::Start(1, hub_options);
  ASSERT_TRUE(hub.ok()) << hub.status();
  const std::string log = dir.path() + "/worker.log";
  std::unique_ptr<tools::ChildProcess> child =
      Start({SB_WORKER_PATH, "--planner=127.0.0.1:1", "--sync=" + (*hub)->address(),
             "--sync_secret_file=" + secret, "--job=j", "--rank=0", "--token_file=" + token},
            log);
  ASSERT_NE(child, nullptr);
  EXPECT_EQ(child->WaitFor(30), tools::kExitFailure) << ReadAll(log);
  EXPECT_NE(ReadAll(log).find(absl::StrCat("--sync_secret_file: step sync: the hub at ",
                                           (*hub)->address(), " refused this worker's secret")),
            std::string::npos)
      << ReadAll(log);
  EXPECT_EQ(ReadAll(log).find("JoinJob"), std::string::npos) << ReadAll(log);
  EXPECT_EQ((*hub)->refused_connections(), 1);
}

}  // namespace
}  // namespace sparsebalance
