// sb-run: the main job. Starts sb-planner (its embedded defaults unless told otherwise), a
// step-sync hub and N CPU sb-worker processes, and runs the same short training-like run once
// per policy (by default `sequential`, then `sparsebalance`). Each run is a job of its own.
// Prints a side-by-side summary of what the workers measured and writes a picture (per-rank
// timeline of the steps, before and after) and the raw per-step lines. Stops everything it
// started, also on errors and Ctrl-C.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/planner_client.h"
#include "planner/profile_table.h"
#include "worker/run_summary.h"
#include "worker/step_sync.h"

extern char** environ;

ABSL_FLAG(std::string, planner, "",
          "address of a running sb-planner; empty: start one (embedded defaults: 127.0.0.1:50151, "
          "state in ./sb-planner-state) and stop it at the end");
ABSL_FLAG(std::string, planner_listen, "", "--listen for the started planner (e.g. 127.0.0.1:0)");
ABSL_FLAG(std::string, state_dir, "", "--state_dir for the started planner");
ABSL_FLAG(std::string, bin_dir, "",
          "folder holding sb-planner, sb-worker and sb-profile (default: found next to sb-run "
          "in the build tree or the install prefix)");
ABSL_FLAG(int, workers, 4, "ranks (one sb-worker process each)");
ABSL_FLAG(int, steps, 8, "steps per run");
ABSL_FLAG(std::string, policies, "sequential,sparsebalance", "one run per policy, in order");
ABSL_FLAG(int, layers, 2, "model layers");
ABSL_FLAG(int, heads, 2, "attention heads");
ABSL_FLAG(int, head_dim, 64, "64 or 128");
ABSL_FLAG(int, block_size, 64, "attention block, tokens");
ABSL_FLAG(int64_t, capacity, 8192, "micro-batch capacity, tokens (also the longest document)");
ABSL_FLAG(int, micro_batches, 1, "micro-batches per rank and step");
ABSL_FLAG(double, fill, 0.5, "tokens per step as a share of ranks x micro-batches x capacity");
ABSL_FLAG(std::string, trace, "pretrain", "built-in trace");
ABSL_FLAG(uint64_t, seed, 1, "trace seed (the same batches for every policy)");
ABSL_FLAG(std::string, profile, "auto",
          "auto: measure this machine with sb-profile first and upload it to each job; none: "
          "keep the planner's default prior; or a profile table file");
ABSL_FLAG(std::string, out, "out/main-job", "folder for the summary, picture and step lines");
ABSL_FLAG(bool, exact_recall, false, "workers report the exact recall (slower)");
ABSL_FLAG(bool, keep_jobs, false, "keep the jobs in the planner afterwards (default: delete them)");

namespace sparsebalance {
namespace {

using Clock = std::chrono::steady_clock;

// Children to stop on any exit path (also from the Ctrl-C handler: plain array, kill() only).
constexpr int kMaxChildren = 256;
volatile pid_t g_children[kMaxChildren];
volatile int g_child_count = 0;

void StopChildren(int signal) {
  for (int i = 0; i < g_child_count; ++i) {
    if (g_children[i] > 0) kill(g_children[i], signal);
  }
}

void OnSignal(int signal) {
  StopChildren(SIGKILL);
  _exit(128 + signal);
}

[[noreturn]] void Die(const std::string& what) {
  std::cerr << "sb-run: " << what << std::endl;
  StopChildren(SIGKILL);
  std::exit(1);
}

pid_t Spawn(const std::vector<std::string>& args, const std::string& stdout_path,
            int* stdout_pipe = nullptr, const std::string& stderr_path = "") {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  int fds[2] = {-1, -1};
  if (stdout_pipe != nullptr) {
    if (pipe(fds) != 0) Die("pipe failed");
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
  } else if (!stdout_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, stdout_path.c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND, 0644);
  }
  if (!stderr_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, stderr_path.c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND, 0644);
  }
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (std::string& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawn(&pid, copy[0].c_str(), &actions, nullptr, argv.data(), environ) != 0) {
    Die(absl::StrCat("cannot start ", copy[0]));
  }
  posix_spawn_file_actions_destroy(&actions);
  if (stdout_pipe != nullptr) {
    close(fds[1]);
    *stdout_pipe = fds[0];
  }
  if (g_child_count < kMaxChildren) g_children[g_child_count++] = pid;
  return pid;
}

void Forget(pid_t pid) {
  for (int i = 0; i < g_child_count; ++i) {
    if (g_children[i] == pid) g_children[i] = 0;
  }
}

std::string FindBinary(const std::string& name) {
  std::vector<std::filesystem::path> candidates;
  const std::string bin_dir = absl::GetFlag(FLAGS_bin_dir);
  if (!bin_dir.empty()) candidates.push_back(std::filesystem::path(bin_dir) / name);
  std::error_code error;
  const std::filesystem::path self = std::filesystem::canonical("/proc/self/exe", error);
  if (!error) {
    const std::filesystem::path dir = self.parent_path();
    candidates.push_back(dir / name);  // installed: everything in bin/
    for (const char* sub : {"server", "worker", "kernels"}) {
      candidates.push_back(dir.parent_path() / sub / name);  // the build tree
    }
  }
  for (const std::filesystem::path& p : candidates) {
    if (std::filesystem::exists(p)) return p.string();
  }
  Die(absl::StrCat("cannot find ", name, " (set --bin_dir)"));
}

// Starts sb-planner and returns its address (from its "listening on" line).
std::string StartPlanner(pid_t* pid) {
  std::vector<std::string> args = {FindBinary("sb-planner")};
  if (!absl::GetFlag(FLAGS_planner_listen).empty()) {
    args.push_back("--listen=" + absl::GetFlag(FLAGS_planner_listen));
    args.push_back("--metrics_listen=127.0.0.1:0");
  }
  if (!absl::GetFlag(FLAGS_state_dir).empty()) {
    args.push_back("--state_dir=" + absl::GetFlag(FLAGS_state_dir));
  }
  int out = -1;
  *pid = Spawn(args, "", &out);
  FILE* stream = fdopen(out, "r");
  char line[2048];
  std::string address;
  while (fgets(line, sizeof line, stream) != nullptr) {
    std::cout << line;
    const std::string text = line;
    const size_t at = text.find("listening on ");
    if (at != std::string::npos) {
      const size_t start = at + 13;
      address = text.substr(start, text.find_first_of(" ;", start) - start);
      break;
    }
  }
  if (address.empty()) Die("sb-planner did not start (is another one on its port? see above)");
  // Keep reading its output so that it never blocks on a full pipe.
  std::thread([stream] {
    char sink[2048];
    while (fgets(sink, sizeof sink, stream) != nullptr) {
    }
    fclose(stream);
  }).detach();
  return address;
}

// OK if the profile table at `path` parses and fits the latency model for `shape` (what the
// planner checks when rank 0 uploads it).
absl::Status CheckProfile(const std::string& path, const ModelShape& shape) {
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  absl::StatusOr<ProfileTable> table = ParseProfileTable(text);
  if (!table.ok()) return table.status();
  return FitProfile(*table, shape).status();
}

int WaitFor(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  Forget(pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "The SparseBalance main job: sb-planner, N CPU workers, one short run per policy on the "
      "same batches, and a side-by-side summary of what the workers measured.\n"
      "  sb-run [--workers=4] [--steps=8] [--policies=sequential,sparsebalance] [--out=DIR]");
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view path) {
    return path == "sb-run" || absl::EndsWith(path, "worker/run_main.cc");
  };
  usage.normalize_filename = [](absl::string_view path) {
    return absl::EndsWith(path, "worker/run_main.cc") ? std::string("sb-run") : std::string(path);
  };
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);

  const int workers = absl::GetFlag(FLAGS_workers);
  if (workers < 1 || workers > 64) Die("--workers: must be in [1, 64]");
  std::vector<Policy> policies;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_policies), ',')) {
    absl::StatusOr<Policy> p = ParsePolicy(name);
    if (!p.ok()) Die(absl::StrCat("--policies: ", p.status().message()));
    policies.push_back(*p);
  }
  const std::string out_dir = absl::GetFlag(FLAGS_out);
  std::filesystem::create_directories(out_dir);

  // The profile first: the planner's latency model starts from this machine's figures.
  ModelShape shape;
  shape.layers = absl::GetFlag(FLAGS_layers);
  shape.heads = absl::GetFlag(FLAGS_heads);
  shape.head_dim = absl::GetFlag(FLAGS_head_dim);
  shape.block_size = absl::GetFlag(FLAGS_block_size);
  std::string profile = absl::GetFlag(FLAGS_profile);
  if (profile == "auto") {
    profile = out_dir + "/cpu.profile";
    // A noisy table (other processes on the cores still perturb one thread's CPU time through
    // caches) can give a degenerate fit, which the planner rejects: measure again.
    constexpr int kProfileAttempts = 3;
    absl::Status fit;
    for (int attempt = 1; attempt <= kProfileAttempts; ++attempt) {
      const Clock::time_point t0 = Clock::now();
      const pid_t pid =
          Spawn({FindBinary("sb-profile"), "--device=cpu", "--threads=1",
                 absl::StrCat("--heads=", shape.heads), absl::StrCat("--head_dim=", shape.head_dim),
                 absl::StrCat("--block_size=", shape.block_size),
                 absl::StrCat("--lengths=512,1024,2048,",
                              std::min<int64_t>(4096, absl::GetFlag(FLAGS_capacity))),
                 "--densities=1.0,0.3,0.1", "--out=" + profile},
                "/dev/null");
      if (WaitFor(pid) != 0) Die("sb-profile failed");
      fit = CheckProfile(profile, shape);
      std::cout << absl::StrFormat("sb-run: measured this CPU with sb-profile in %.1f s -> %s%s\n",
                                   std::chrono::duration<double>(Clock::now() - t0).count(),
                                   profile, fit.ok() ? "" : " (unusable, measuring again)");
      if (fit.ok()) break;
    }
    if (!fit.ok()) {
      Die(absl::StrCat("sb-profile gave no usable table in ", kProfileAttempts, " attempts (",
                       fit.message(), "); is the machine busy? Run again, or pass --profile=none"));
    }
  } else if (profile == "none") {
    profile.clear();
  }

  pid_t planner_pid = 0;
  std::string planner = absl::GetFlag(FLAGS_planner);
  if (planner.empty()) planner = StartPlanner(&planner_pid);

  ClientOptions options;
  options.target = planner;
  absl::StatusOr<std::unique_ptr<PlannerClient>> admin = PlannerClient::Connect(options);
  if (!admin.ok()) Die(admin.status().ToString());

  std::vector<RunResult> results;
  for (Policy policy : policies) {
    PlannerConfig config;
    config.ranks = workers;
    config.micro_batches = absl::GetFlag(FLAGS_micro_batches);
    config.micro_batch_capacity = absl::GetFlag(FLAGS_capacity);
    config.shape = shape;
    config.policy = policy;
    absl::StatusOr<JobHandle> job =
        (*admin)->CreateJob(absl::StrCat("main-job-", PolicyName(policy)), config);
    if (!job.ok()) Die(absl::StrCat("CreateJob: ", job.status().ToString()));
    const std::string token_file = absl::StrCat(out_dir, "/", PolicyName(policy), ".token");
    {
      std::ofstream t(token_file);
      t << job->token << "\n";
    }
    chmod(token_file.c_str(), 0600);
    const std::string lines = absl::StrCat(out_dir, "/", PolicyName(policy), ".steps.jsonl");
    std::filesystem::remove(lines);
    absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StepSyncHub::Start(workers);
    if (!hub.ok()) Die(hub.status().ToString());
    std::cout << "sb-run: " << PolicyName(policy) << ": job " << job->job_id << ", " << workers
              << " workers, " << absl::GetFlag(FLAGS_steps) << " steps ..." << std::flush;
    const Clock::time_point t0 = Clock::now();
    std::vector<pid_t> pids;
    for (int r = 0; r < workers; ++r) {
      std::vector<std::string> args = {FindBinary("sb-worker"),
                                       "--planner=" + planner,
                                       "--job=" + job->job_id,
                                       absl::StrCat("--rank=", r),
                                       "--token_file=" + token_file,
                                       "--device=cpu",
                                       "--sync=" + (*hub)->address(),
                                       absl::StrCat("--steps=", absl::GetFlag(FLAGS_steps)),
                                       "--trace=" + absl::GetFlag(FLAGS_trace),
                                       absl::StrCat("--seed=", absl::GetFlag(FLAGS_seed)),
                                       absl::StrCat("--fill=", absl::GetFlag(FLAGS_fill)),
                                       "--out=" + lines};
      if (!profile.empty()) args.push_back("--profile=" + profile);
      if (absl::GetFlag(FLAGS_exact_recall)) args.push_back("--exact_recall");
      pids.push_back(Spawn(args, "/dev/null", nullptr,
                           absl::StrCat(out_dir, "/", PolicyName(policy), ".rank", r, ".log")));
    }
    for (pid_t pid : pids) {
      if (int code = WaitFor(pid); code != 0) {
        Die(absl::StrCat("a worker of the ", PolicyName(policy), " run failed (exit ", code,
                         "); see ", out_dir, "/", PolicyName(policy), ".rank*.log"));
      }
    }
    std::cout << absl::StrFormat(" %.1f s\n",
                                 std::chrono::duration<double>(Clock::now() - t0).count());
    absl::StatusOr<RunResult> result =
        SummarizeRun(std::string(PolicyName(policy)), lines, workers);
    if (!result.ok()) Die(result.status().ToString());
    results.push_back(*std::move(result));
    if (!absl::GetFlag(FLAGS_keep_jobs)) {
      if (absl::Status s = (*admin)->DeleteJob(job->job_id); !s.ok()) {
        std::cerr << "sb-run: DeleteJob " << job->job_id << ": " << s << std::endl;
      }
    }
  }

  if (planner_pid > 0) {
    kill(planner_pid, SIGTERM);
    WaitFor(planner_pid);
  }
  const std::string table = FormatSummary(results);
  std::cout << "\n" << table;
  std::ofstream(out_dir + "/summary.txt") << table;
  std::ofstream(out_dir + "/summary.json") << SummaryJson(results);
  const std::string svg = out_dir + "/timeline.svg";
  std::ofstream(svg) << TimelineSvg(results);
  std::cout << "\nsb-run: per-step lines, summary.txt/.json and timeline.svg in " << out_dir
            << "/\n";
  return 0;
}

}  // namespace
}  // namespace sparsebalance

int main(int argc, char** argv) { return sparsebalance::Main(argc, argv); }
