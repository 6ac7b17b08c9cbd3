// sb-run: the main job. Starts sb-planner (its embedded defaults unless told otherwise), a
// step-sync hub and N CPU sb-worker processes (or N GPU workers synchronised by NCCL with
// --device=cuda, one device per rank), and runs the same short training-like run once
// per policy (by default `sequential`, then `sparsebalance`). Each run is a job of its own.
// Prints a side-by-side summary of what the workers measured and writes a picture (per-rank
// timeline of the steps, before and after) and the raw per-step lines. Stops everything it
// started, also on errors and Ctrl-C.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/planner_client.h"
#include "planner/profile_table.h"
#include "tools/child_process.h"
#include "tools/secret.h"
#include "tools/tool_support.h"
#include "worker/run_summary.h"
#include "worker/step_sync.h"

ABSL_FLAG(std::string, planner, "",
          "address of a running sb-planner; empty: start one (embedded defaults: 127.0.0.1:50151, "
          "state in ./sb-planner-state) and stop it at the end");
ABSL_FLAG(std::string, planner_listen, "", "--listen for the started planner (e.g. 127.0.0.1:0)");
ABSL_FLAG(std::string, state_dir, "", "--state_dir for the started planner");
ABSL_FLAG(std::string, bin_dir, "",
          "folder holding sb-planner, sb-worker and sb-profile (default: found next to sb-run "
          "in the build tree or the install prefix)");
ABSL_FLAG(int, workers, 4, "ranks (one sb-worker process each)");
ABSL_FLAG(std::string, device, "cpu",
          "cpu: the workers run the fp32 reference kernels, synchronised by a local hub; cuda: "
          "the CUDA kernels, one device per rank (rank % devices), synchronised by NCCL on "
          "NCCL_COMM_ID (default: 127.0.0.1 and a free port); the auto profile is measured on "
          "the same device");
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
ABSL_FLAG(std::string, selection, "topk",
          "block selection of the jobs: topk (k_i blocks per row) or anchor (anchor-guided "
          "thresholding: at most k_i, only blocks weighing >= --anchor_threshold x the best "
          "anchor's)");
ABSL_FLAG(double, anchor_threshold, sparsebalance::kDefaultAnchorThreshold,
          "tau of --selection=anchor, in (0, 1]");
ABSL_FLAG(int, long_document_factor, 0,
          "context parallelism: above 1, every step's batch also holds one document of this "
          "many times --capacity tokens, and the jobs split documents over up to this many ranks "
          "(max_shards; at most --workers); each step prints how it was split and its exchange "
          "time");
ABSL_FLAG(bool, keep_jobs, false, "keep the jobs in the planner afterwards (default: delete them)");

namespace sparsebalance {
namespace {

using Clock = std::chrono::steady_clock;

// The path of another binary of the project; fatal when it is not found.
std::string FindBinary(const std::string& name) {
  absl::StatusOr<std::string> path = tools::FindToolBinary(name, absl::GetFlag(FLAGS_bin_dir));
  if (!path.ok()) tools::Fatal(absl::StrCat(path.status().message(), "; set --bin_dir"));
  return *path;
}

// A child process that must start; fatal otherwise.
std::unique_ptr<tools::ChildProcess> Start(const std::vector<std::string>& args,
                                           const tools::ChildOutput& output) {
  absl::StatusOr<std::unique_ptr<tools::ChildProcess>> child =
      tools::ChildProcess::Start(args, output);
  if (!child.ok()) tools::Fatal(child.status().message());
  return *std::move(child);
}

// Starts sb-planner (its output in `log`) and returns it once it listens.
std::unique_ptr<tools::PlannerProcess> StartPlanner(const std::string& log) {
  std::vector<std::string> args;
  if (!absl::GetFlag(FLAGS_planner_listen).empty()) {
    args.push_back("--listen=" + absl::GetFlag(FLAGS_planner_listen));
    args.push_back("--metrics_listen=127.0.0.1:0");
  }
  if (!absl::GetFlag(FLAGS_state_dir).empty()) {
    args.push_back("--state_dir=" + absl::GetFlag(FLAGS_state_dir));
  }
  absl::StatusOr<std::unique_ptr<tools::PlannerProcess>> planner = tools::PlannerProcess::Start(
      FindBinary("sb-planner"), args, log, /*start_timeout_seconds=*/60);
  if (!planner.ok()) {
    tools::Fatal(absl::StrCat("sb-planner did not start (is another one on its port?): ",
                              planner.status().message()));
  }
  std::cout << (*planner)->listening_line() << "\n";
  return *std::move(planner);
}

// OK if the profile table at `path` parses and fits the latency model for `shape` (what the
// planner checks when rank 0 uploads it).
absl::Status CheckProfile(const std::string& path, const ModelShape& shape) {
  absl::StatusOr<std::string> text = tools::ReadFile(path);
  if (!text.ok()) return text.status();
  absl::StatusOr<ProfileTable> table = ParseProfileTable(*text);
  if (!table.ok()) return table.status();
  return FitProfile(*table, shape).status();
}

// Per step, how each split document ran: its shards' ranks and token ranges, and the
// exchange time (the slowest shard's, over all layers).
std::string SplitReport(const RunResult& run) {
  std::string out;
  for (const auto& [step, lines] : run.steps) {
    struct Split {
      int64_t length = 0;
      std::map<int, std::pair<int, std::string>> shards;  // index -> rank, token range
      double exchange = 0.0;
    };
    std::map<uint64_t, Split> splits;
    for (const StepLine& line : lines) {
      for (const ShardLine& shard : line.shards) {
        Split& split = splits[shard.sample];
        split.length = shard.length;
        split.shards[shard.index] = {line.rank,
                                     absl::StrCat("[", shard.begin, ", ", shard.end, ")")};
        split.exchange = std::max(split.exchange, shard.exchange_seconds);
      }
    }
    if (splits.empty()) {
      out += absl::StrFormat("  step %d: no document split\n", step);
      continue;
    }
    for (const auto& [sample, split] : splits) {
      std::string where;
      for (const auto& [index, shard] : split.shards) {
        absl::StrAppend(&where, where.empty() ? "" : ", ", "rank ", shard.first, " ", shard.second);
      }
      out += absl::StrFormat(
          "  step %d: document %d (%d tokens) split into %d shards: %s; exchange %.4f s\n", step,
          sample, split.length, split.shards.size(), where, split.exchange);
    }
  }
  return out;
}

// A TCP port free on the loopback interface now (the kernel's pick for port 0).
int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) tools::Fatal("socket() failed while picking a port for NCCL_COMM_ID");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    close(fd);
    tools::Fatal("could not pick a free port for NCCL_COMM_ID: set it yourself");
  }
  close(fd);
  return ntohs(address.sin_port);
}

int Main(int argc, char** argv) {
  tools::InitTool(
      argc, argv,
      "the SparseBalance main job: sb-planner, N workers (CPU, or GPU with --device=cuda), one\n"
      "short run per policy on\n"
      "the same batches, and a side-by-side summary of what the workers measured\n"
      "(summary.txt, summary.json, timeline.svg and the workers' step lines in --out).\n\n"
      "  sb-run [--workers=4] [--steps=8] [--policies=sequential,sparsebalance] [--out=DIR]");
  tools::StopChildrenOnSignals();
  const int workers = absl::GetFlag(FLAGS_workers);
  if (workers < 1 || workers > 64) tools::Fatal("--workers: must be in [1, 64]");
  const std::string device = absl::GetFlag(FLAGS_device);
  if (device != "cpu" && device != "cuda") {
    tools::UsageError(absl::StrCat("--device=", device, ": must be cpu or cuda"));
  }
  if (device == "cuda" && std::getenv("NCCL_COMM_ID") == nullptr) {
    // The workers inherit it: NCCL's bootstrap root (rank 0) listens there.
    const std::string comm_id = absl::StrCat("127.0.0.1:", FreeLoopbackPort());
    setenv("NCCL_COMM_ID", comm_id.c_str(), 1);
  }
  std::vector<Policy> policies;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_policies), ',')) {
    absl::StatusOr<Policy> p = ParsePolicy(name);
    if (!p.ok()) tools::Fatal(absl::StrCat("--policies: ", p.status().message()));
    policies.push_back(*p);
  }
  const int long_factor = absl::GetFlag(FLAGS_long_document_factor);
  if (long_factor != 0 && (long_factor < 2 || long_factor > workers)) {
    tools::UsageError(absl::StrCat("--long_document_factor=", long_factor,
                                   ": must be 0 (off) or in [2, --workers=", workers, "]"));
  }
  const int64_t long_document =
      long_factor > 0 ? long_factor * absl::GetFlag(FLAGS_capacity) : int64_t{0};
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
    profile = out_dir + "/" + device + ".profile";
    // A noisy table (other processes on the cores still perturb one thread's CPU time through
    // caches) can give a degenerate fit, which the planner rejects: measure again.
    constexpr int kProfileAttempts = 3;
    absl::Status fit;
    for (int attempt = 1; attempt <= kProfileAttempts; ++attempt) {
      const Clock::time_point t0 = Clock::now();
      std::unique_ptr<tools::ChildProcess> sb_profile =
          Start({FindBinary("sb-profile"), "--device=" + device,
                 device == "cpu" ? "--threads=1" : "--repeats=3",
                 absl::StrCat("--heads=", shape.heads), absl::StrCat("--head_dim=", shape.head_dim),
                 absl::StrCat("--block_size=", shape.block_size),
                 absl::StrCat("--lengths=512,1024,2048,",
                              std::min<int64_t>(4096, absl::GetFlag(FLAGS_capacity))),
                 "--densities=1.0,0.3,0.1", "--out=" + profile},
                {/*stdout_path=*/"/dev/null"});
      if (sb_profile->Wait() != 0) tools::Fatal("sb-profile failed");
      fit = CheckProfile(profile, shape);
      std::cout << absl::StrFormat("sb-run: measured this CPU with sb-profile in %.1f s -> %s%s\n",
                                   std::chrono::duration<double>(Clock::now() - t0).count(),
                                   profile, fit.ok() ? "" : " (unusable, measuring again)");
      if (fit.ok()) break;
    }
    if (!fit.ok()) {
      tools::Fatal(absl::StrCat("sb-profile gave no usable table in ", kProfileAttempts,
                                " attempts (", fit.message(),
                                "); is the machine busy? Run again, or pass --profile=none"));
    }
  } else if (profile == "none") {
    profile.clear();
  }

  std::unique_ptr<tools::PlannerProcess> started_planner;
  std::string planner = absl::GetFlag(FLAGS_planner);
  if (planner.empty()) {
    started_planner = StartPlanner(out_dir + "/planner.log");
    planner = started_planner->address();
  }

  ClientOptions options;
  options.target = planner;
  absl::StatusOr<std::unique_ptr<PlannerClient>> admin = PlannerClient::Connect(options);
  if (!admin.ok()) tools::Fatal(admin.status().ToString());

  SelectionMode selection = SelectionMode::kTopK;
  if (absl::GetFlag(FLAGS_selection) == "anchor") {
    selection = SelectionMode::kAnchor;
  } else if (absl::GetFlag(FLAGS_selection) != "topk") {
    tools::UsageError(
        absl::StrCat("--selection=", absl::GetFlag(FLAGS_selection), ": expected topk or anchor"));
  }
  std::vector<RunResult> results;
  for (Policy policy : policies) {
    PlannerConfig config;
    config.ranks = workers;
    config.micro_batches = absl::GetFlag(FLAGS_micro_batches);
    config.micro_batch_capacity = absl::GetFlag(FLAGS_capacity);
    config.shape = shape;
    config.policy = policy;
    config.selection = selection;
    config.anchor_threshold = absl::GetFlag(FLAGS_anchor_threshold);
    if (long_factor > 0) config.max_shards = long_factor;
    absl::StatusOr<JobHandle> job =
        (*admin)->CreateJob(absl::StrCat("main-job-", PolicyName(policy)), config);
    if (!job.ok()) tools::Fatal(absl::StrCat("CreateJob: ", job.status().ToString()));
    const std::string token_file = absl::StrCat(out_dir, "/", PolicyName(policy), ".token");
    if (absl::Status s = tools::WritePrivateFile(token_file, job->token + "\n"); !s.ok()) {
      tools::Fatal(s.ToString());
    }
    const std::string lines = absl::StrCat(out_dir, "/", PolicyName(policy), ".steps.jsonl");
    std::filesystem::remove(lines);
    // CPU ranks meet at a local hub; GPU ranks all-reduce through NCCL instead. The hub and the
    // ranks' exchange ports take any local connection, so each must prove a secret drawn for
    // this run, handed over in a 0600 file like the token (a command line is public to `ps`).
    std::unique_ptr<StepSyncHub> hub;
    const std::string secret_file = absl::StrCat(out_dir, "/", PolicyName(policy), ".sync_secret");
    if (device == "cpu") {
      StepSyncHubOptions hub_options;
      absl::StatusOr<std::string> secret = tools::RandomHex(64);
      if (!secret.ok()) tools::Fatal(secret.status().message());
      hub_options.secret = *std::move(secret);
      if (absl::Status s = tools::WritePrivateFile(secret_file, hub_options.secret + "\n");
          !s.ok()) {
        tools::Fatal(s.ToString());
      }
      absl::StatusOr<std::unique_ptr<StepSyncHub>> started =
          StepSyncHub::Start(workers, hub_options);
      if (!started.ok()) tools::Fatal(started.status().ToString());
      hub = *std::move(started);
    }
    std::cout << "sb-run: " << PolicyName(policy) << ": job " << job->job_id << ", " << workers
              << " workers, " << absl::GetFlag(FLAGS_steps) << " steps ..." << std::flush;
    const Clock::time_point t0 = Clock::now();
    std::vector<std::unique_ptr<tools::ChildProcess>> ranks;
    for (int r = 0; r < workers; ++r) {
      std::vector<std::string> args = {FindBinary("sb-worker"),
                                       "--planner=" + planner,
                                       "--job=" + job->job_id,
                                       absl::StrCat("--rank=", r),
                                       "--token_file=" + token_file,
                                       "--device=" + device,
                                       absl::StrCat("--steps=", absl::GetFlag(FLAGS_steps)),
                                       "--trace=" + absl::GetFlag(FLAGS_trace),
                                       absl::StrCat("--seed=", absl::GetFlag(FLAGS_seed)),
                                       absl::StrCat("--fill=", absl::GetFlag(FLAGS_fill)),
                                       "--out=" + lines};
      if (hub != nullptr) {
        args.push_back("--sync=" + hub->address());
        args.push_back("--sync_secret_file=" + secret_file);
      }
      if (!profile.empty()) args.push_back("--profile=" + profile);
      if (absl::GetFlag(FLAGS_exact_recall)) args.push_back("--exact_recall");
      if (long_document > 0) args.push_back(absl::StrCat("--long_document=", long_document));
      ranks.push_back(Start(
          args, {"/dev/null", absl::StrCat(out_dir, "/", PolicyName(policy), ".rank", r, ".log")}));
    }
    for (const std::unique_ptr<tools::ChildProcess>& rank : ranks) {
      if (int code = rank->Wait(); code != 0) {
        tools::Fatal(absl::StrCat("a worker of the ", PolicyName(policy), " run failed (exit ",
                                  code, "); see ", out_dir, "/", PolicyName(policy), ".rank*.log"));
      }
    }
    std::cout << absl::StrFormat(" %.1f s\n",
                                 std::chrono::duration<double>(Clock::now() - t0).count());
    // The secret opens nothing once its hub and workers are gone: out/ keeps none.
    if (hub != nullptr) std::filesystem::remove(secret_file);
    absl::StatusOr<RunResult> result =
        SummarizeRun(std::string(PolicyName(policy)), lines, workers);
    if (!result.ok()) tools::Fatal(result.status().ToString());
    if (long_document > 0) std::cout << SplitReport(*result);
    results.push_back(*std::move(result));
    if (!absl::GetFlag(FLAGS_keep_jobs)) {
      if (absl::Status s = (*admin)->DeleteJob(job->job_id); !s.ok()) {
        std::cerr << "sb-run: DeleteJob " << job->job_id << ": " << s << std::endl;
      }
    }
  }

  if (started_planner != nullptr) started_planner->Stop();
  const std::string table = FormatSummary(results);
  std::cout << "\n" << table;
  for (const auto& [name, text] : {std::pair<std::string, std::string>{"summary.txt", table},
                                   {"summary.json", SummaryJson(results)},
                                   {"timeline.svg", TimelineSvg(results)}}) {
    if (absl::Status s = tools::WriteFile(absl::StrCat(out_dir, "/", name), text); !s.ok()) {
      tools::Fatal(s.message());
    }
  }
  std::cout << "\nsb-run: per-step lines, summary.txt/.json and timeline.svg in " << out_dir
            << "/\n";
  return 0;
}

}  // namespace
}  // namespace sparsebalance

int main(int argc, char** argv) { return sparsebalance::Main(argc, argv); }
