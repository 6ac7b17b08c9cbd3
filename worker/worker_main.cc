// sb-worker: one rank of a training-like job. Joins the job, then each step gets its plan from
// sb-planner (or computes it locally when the planner is away), agrees with the other ranks
// on which plan they run, runs each micro-batch (sparse attention forward and backward at the
// planned densities plus the linear part, over every layer, on inputs made from the sample
// ids), waits for the other ranks (the gradient all-reduce), and reports what it measured.
// One JSON line per step goes to --out for sb-run's summary and the tests.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "client/planner_client.h"
#include "client/trainer_session.h"
#include "tools/tool_support.h"
#include "worker/micro_batch_runner.h"
#include "worker/nccl_sync.h"
#include "worker/run_summary.h"
#include "worker/shard_exchange.h"
#include "worker/shard_layer.h"
#include "worker/step_inputs.h"
#include "worker/step_sync.h"

ABSL_FLAG(std::string, planner, "127.0.0.1:50151", "sb-planner address host:port");
ABSL_FLAG(std::string, job, "", "job id (CreateJob's answer)");
ABSL_FLAG(int, rank, -1, "this rank, in [0, world_size)");
ABSL_FLAG(std::string, token_file, "", "file holding the job token (CreateJob's answer)");
ABSL_FLAG(std::string, host_name, "",
          "this worker's host name for the planner (GetJob's slowest ranks, the slow-rank "
          "metrics); empty: the machine's");
ABSL_FLAG(std::string, device, "cpu",
          "cpu: the fp32 reference kernels, one thread, timed by the thread's CPU time (fair "
          "when ranks share cores); cuda: the sm_90 kernels, timed by CUDA events, ranks "
          "synchronised by NCCL (set NCCL_COMM_ID)");
ABSL_FLAG(std::string, sync, "",
          "CPU ranks: the step-sync hub host:port (sb-run starts one); empty with one rank");
ABSL_FLAG(std::string, sync_secret_file, "",
          "required with --sync: file holding the run's secret (sb-run writes one per run, "
          "mode 0600, and passes it here); every connection to the hub and to a rank's "
          "shard-exchange port must prove it, and one that does not is refused");
ABSL_FLAG(int, steps, 10, "run steps [resume point, steps)");
ABSL_FLAG(std::string, trace, "pretrain", "built-in trace the global batches come from");
ABSL_FLAG(uint64_t, seed, 1, "trace seed: every rank must use the same");
ABSL_FLAG(double, fill, 0.6, "tokens per step as a share of ranks x micro-batches x capacity");
ABSL_FLAG(int64_t, min_length, 128, "skip documents shorter than this (tokens)");
ABSL_FLAG(std::string, profile, "",
          "rank 0 uploads this profile table (sb-profile output) to the job at start");
ABSL_FLAG(
    bool, exact_recall, false,
    "CPU: report the exact recall (softmax mass kept) over every query row (slow: O(tokens^2) "
    "per layer; small runs)");
ABSL_FLAG(int, recall_rows, -1,
          "query rows per document whose true kept softmax mass (recall) is measured each step "
          "and reported per document and layer (the document's last row always among them); 0: "
          "report the block scores' estimate instead; -1: 8 on cpu, 0 on cuda");
ABSL_FLAG(double, recall_budget, 0.05,
          "cost bound of --recall_rows: per document, the probed (query, key) pairs beyond its "
          "last row stay within this share of those its kept blocks hold (fewer rows otherwise)");
ABSL_FLAG(std::string, out, "", "append one JSON line per step here");
ABSL_FLAG(double, call_timeout, 2.0, "seconds: deadline of planner calls before falling back");
ABSL_FLAG(double, plan_timeout, 60.0, "seconds a rank waits for the coordinator's plan");
ABSL_FLAG(int64_t, gradient_bytes, 64 << 20, "cuda: bytes all-reduced each step");
ABSL_FLAG(int64_t, long_document, 0,
          "context parallelism: add one document of this many tokens to every step's batch "
          "(every rank must pass the same; the job needs max_shards > 1 when it exceeds the "
          "micro-batch capacity)");
ABSL_FLAG(double, exchange_timeout, 120.0,
          "CPU ranks of a job with max_shards > 1: seconds a shard waits for one message of its "
          "group before failing with an error naming the peer");

namespace sparsebalance {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double UnixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The file a flag names; a missing or unreadable one is fatal.
std::string ReadFlagFile(const std::string& flag, const std::string& path) {
  absl::StatusOr<std::string> text = tools::ReadFile(path);
  if (!text.ok()) tools::Fatal(absl::StrCat("--", flag, ": ", text.status().message()));
  return *std::move(text);
}

// Rank synchronisation: the hub on CPU, NCCL on GPU, nothing for a single rank.
class Barrier {
 public:
  virtual ~Barrier() = default;
  virtual absl::StatusOr<double> AgreeMax(int64_t step, double value) = 0;
  virtual absl::Status EndStep(int64_t step) = 0;
};

class NoBarrier : public Barrier {
 public:
  absl::StatusOr<double> AgreeMax(int64_t, double value) override { return value; }
  absl::Status EndStep(int64_t) override { return absl::OkStatus(); }
};

class HubBarrier : public Barrier {
 public:
  explicit HubBarrier(std::unique_ptr<StepSyncClient> client) : client_(std::move(client)) {}
  absl::StatusOr<double> AgreeMax(int64_t step, double value) override {
    return client_->AllReduceMax(step, kPlanPhase, value);
  }
  absl::Status EndStep(int64_t step) override {
    return client_->AllReduceMax(step, kGradientPhase, 0.0).status();
  }

 private:
  std::unique_ptr<StepSyncClient> client_;
};

class NcclBarrier : public Barrier {
 public:
  explicit NcclBarrier(std::unique_ptr<NcclSync> sync) : sync_(std::move(sync)) {}
  absl::StatusOr<double> AgreeMax(int64_t, double value) override {
    return sync_->AllReduceMax(value);
  }
  absl::Status EndStep(int64_t) override { return sync_->AllReduceGradients(); }

 private:
  std::unique_ptr<NcclSync> sync_;
};

int Main(int argc, char** argv) {
  tools::InitTool(
      argc, argv,
      "one rank of a SparseBalance job: plans from sb-planner, sparse attention at the\n"
      "planned densities, measured and reported (one JSON line per step to --out).\n\n"
      "  sb-worker --planner=HOST:PORT --job=ID --rank=R --token_file=FILE \\\n"
      "            [--device=cpu|cuda] [--sync=HOST:PORT --sync_secret_file=FILE] \\\n"
      "            [--out=steps.jsonl]\n\n"
      "Timing: on CPU the thread CPU time of the compute (ranks may share cores); on GPU\n"
      "CUDA events. Waiting time is the wall time spent in the end-of-step synchronisation.\n"
      "sb-run starts a planner, a step-sync hub and the workers of a local job.");
  const int rank = absl::GetFlag(FLAGS_rank);
  if (absl::GetFlag(FLAGS_job).empty()) tools::UsageError("--job is required");
  if (rank < 0) tools::UsageError("--rank is required (>= 0)");
  if (absl::GetFlag(FLAGS_token_file).empty()) tools::UsageError("--token_file is required");
  const std::string token(
      absl::StripAsciiWhitespace(ReadFlagFile("token_file", absl::GetFlag(FLAGS_token_file))));
  // The hub and the other ranks' exchange ports take connections from any local process: each
  // connection proves the run's secret, read from a file because a command line is public.
  std::string sync_secret;
  if (!absl::GetFlag(FLAGS_sync).empty()) {
    if (absl::GetFlag(FLAGS_sync_secret_file).empty()) {
      tools::UsageError("--sync_secret_file is required with --sync (sb-run writes one per run)");
    }
    sync_secret = std::string(absl::StripAsciiWhitespace(
        ReadFlagFile("sync_secret_file", absl::GetFlag(FLAGS_sync_secret_file))));
    if (absl::Status s = CheckSyncSecret(sync_secret); !s.ok()) {
      tools::UsageError(absl::StrCat("--sync_secret_file: ", s.message()));
    }
  }
  auto connect_hub = [&] {
    absl::StatusOr<std::unique_ptr<StepSyncClient>> sync =
        StepSyncClient::Connect(absl::GetFlag(FLAGS_sync), sync_secret, rank);
    if (!sync.ok()) {
      const bool denied = absl::IsPermissionDenied(sync.status());
      tools::Fatal(
          absl::StrCat(denied ? "--sync_secret_file: " : "--sync: ", sync.status().message()));
    }
    return *std::move(sync);
  };
  // A CPU rank and the hub prove the run's secret to each other before the rank joins, so that
  // a wrong secret file (or a hub's port taken over) stops it before the planner counts it in.
  // (GPU ranks synchronise through NCCL; they reach the hub, if at all, after the join.)
  const std::string device = absl::GetFlag(FLAGS_device);
  std::unique_ptr<StepSyncClient> hub_client;
  if (!absl::GetFlag(FLAGS_sync).empty() && device != "cuda") hub_client = connect_hub();

  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_planner);
  options.job_id = absl::GetFlag(FLAGS_job);
  options.token = token;
  options.call_timeout_seconds = absl::GetFlag(FLAGS_call_timeout);
  options.plan_timeout_seconds = absl::GetFlag(FLAGS_plan_timeout);
  options.host_name = absl::GetFlag(FLAGS_host_name);
  absl::StatusOr<std::unique_ptr<PlannerClient>> client = PlannerClient::Connect(options);
  if (!client.ok()) {
    const std::string flag =
        absl::StrContains(client.status().message(), "host_name") ? "--host_name" : "--planner";
    tools::Fatal(absl::StrCat(flag, ": ", client.status().message()));
  }

  // Join, waiting for a planner that is still starting (up to a minute).
  int64_t resume = 0;
  absl::StatusOr<std::pair<PlannerConfig, int64_t>> joined;
  const Clock::time_point join_start = Clock::now();
  while (true) {
    joined = (*client)->JoinJob(rank, &resume);
    if (joined.ok() || !IsUnreachable(joined.status()) || Since(join_start) > 60) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (!joined.ok()) tools::Fatal(absl::StrCat("JoinJob: ", joined.status().ToString()));
  const PlannerConfig config = joined->first;
  if (rank >= config.ranks)
    tools::Fatal(absl::StrCat("--rank=", rank, ": the job has ", config.ranks));
  if (rank == 0 && !absl::GetFlag(FLAGS_profile).empty()) {
    absl::StatusOr<std::string> device =
        (*client)->UploadProfile(ReadFlagFile("profile", absl::GetFlag(FLAGS_profile)));
    if (!device.ok()) tools::Fatal(absl::StrCat("UploadProfile: ", device.status().ToString()));
    std::cerr << "sb-worker: rank 0 uploaded the profile of " << *device << std::endl;
  }

  if (device == "cuda") {
    if (absl::Status s = NcclSync::SelectDevice(rank); !s.ok()) {
      tools::Fatal(std::string(s.message()));
    }
  }
  MicroBatchRunnerOptions runner_options;
  runner_options.exact_recall = absl::GetFlag(FLAGS_exact_recall);
  // The device probe has not been checked on a GPU yet: opt in there.
  const int recall_rows = absl::GetFlag(FLAGS_recall_rows);
  runner_options.recall_rows = recall_rows >= 0 ? recall_rows : (device == "cpu" ? 8 : 0);
  runner_options.recall_pair_share = absl::GetFlag(FLAGS_recall_budget);
  // Block selection is the job's (JobConfig.selection / anchor_threshold), read at join.
  runner_options.selection = config.selection;
  runner_options.anchor_threshold = config.anchor_threshold;
  if (recall_rows < -1) tools::UsageError("--recall_rows must be >= 0 (or -1: the default)");
  absl::StatusOr<std::unique_ptr<MicroBatchRunner>> runner =
      MicroBatchRunner::Create(device, config.shape, runner_options);
  if (!runner.ok()) tools::Fatal(std::string(runner.status().message()));

  std::unique_ptr<Barrier> barrier;
  if (device == "cuda" && config.ranks > 1) {
    absl::StatusOr<std::unique_ptr<NcclSync>> nccl =
        NcclSync::Create(rank, config.ranks, absl::GetFlag(FLAGS_gradient_bytes));
    if (!nccl.ok()) tools::Fatal(std::string(nccl.status().message()));
    barrier = std::make_unique<NcclBarrier>(*std::move(nccl));
  } else if (!absl::GetFlag(FLAGS_sync).empty()) {
    barrier = std::make_unique<HubBarrier>(hub_client ? std::move(hub_client) : connect_hub());
  } else if (config.ranks > 1) {
    tools::Fatal("--sync is required for CPU ranks of a job with more than one rank");
  } else {
    barrier = std::make_unique<NoBarrier>();
  }

  // Context parallelism on CPU ranks: the shard exchange, its address at the hub.
  std::unique_ptr<ShardExchange> exchange;
  if (config.max_shards > 1 && config.ranks > 1 && device == "cpu") {
    ShardExchangeOptions exchange_options;
    exchange_options.secret = sync_secret;
    exchange_options.timeout_seconds = absl::GetFlag(FLAGS_exchange_timeout);
    exchange_options.world_size = config.ranks;
    // Every document of a step is at most a micro-batch's capacity or --long_document.
    exchange_options.max_payload_bytes = MaxShardPayloadBytes(
        std::max<int64_t>(config.micro_batch_capacity, absl::GetFlag(FLAGS_long_document)),
        config.shape.heads, config.shape.head_dim);
    absl::StatusOr<std::unique_ptr<ShardExchange>> started =
        ShardExchange::Start(rank, absl::GetFlag(FLAGS_sync), exchange_options);
    if (!started.ok()) tools::Fatal(absl::StrCat("--sync: ", started.status().message()));
    exchange = *std::move(started);
  }

  BatchSpec spec;
  spec.trace = absl::GetFlag(FLAGS_trace);
  spec.seed = absl::GetFlag(FLAGS_seed);
  spec.max_length = config.micro_batch_capacity;
  spec.min_length = std::min<int64_t>(absl::GetFlag(FLAGS_min_length), spec.max_length);
  spec.long_document = absl::GetFlag(FLAGS_long_document);
  if (spec.long_document < 0) tools::UsageError("--long_document must be >= 0 tokens");
  absl::StatusOr<int64_t> budget = StepTokenBudget(
      absl::GetFlag(FLAGS_fill), config.ranks, config.micro_batches, config.micro_batch_capacity);
  if (!budget.ok()) tools::UsageError(absl::StrCat("--", budget.status().message()));
  spec.token_budget = *budget;
  std::ofstream out;
  if (!absl::GetFlag(FLAGS_out).empty()) {
    out.open(absl::GetFlag(FLAGS_out), std::ios::app);
    if (!out) tools::Fatal(absl::StrCat("--out=", absl::GetFlag(FLAGS_out), ": cannot open"));
  }
  TrainerSession session(client->get(), rank, /*coordinator=*/rank == 0, config);
  std::cerr << "sb-worker: rank " << rank << " of job " << options.job_id << " on "
            << (*runner)->device_name() << " ("
            << (config.selection == SelectionMode::kAnchor
                    ? absl::StrCat("anchor selection, tau ", config.anchor_threshold)
                    : std::string("top-k selection"))
            << "), from step " << resume << std::endl;

  for (int64_t step = resume; step < absl::GetFlag(FLAGS_steps); ++step) {
    absl::StatusOr<std::vector<Sample>> batch = BatchForStep(spec, step);
    if (!batch.ok()) tools::Fatal(batch.status().ToString());
    const double wall_start = UnixSeconds();
    absl::StatusOr<RankStepPlan> plan = session.Plan(step, *batch);
    if (!plan.ok()) tools::Fatal(absl::StrCat("step ", step, ": ", plan.status().ToString()));
    // Every rank runs one plan: if any fell back, all use the local one.
    absl::StatusOr<double> any_local = barrier->AgreeMax(step, plan->local_fallback ? 1.0 : 0.0);
    if (!any_local.ok()) tools::Fatal(any_local.status().ToString());
    if (*any_local > 0 && !plan->local_fallback) {
      plan = session.LocalPlan(step, *batch);
      if (!plan.ok()) tools::Fatal(plan.status().ToString());
    }
    std::vector<MicroBatchTiming> timings;
    double compute = 0.0, attention = 0.0, density_tokens = 0.0, recall_tokens = 0.0;
    double estimate_tokens = 0.0, recall_seconds = 0.0, exchange_seconds = 0.0;
    int64_t tokens = 0;
    std::vector<ShardLine> shards;
    for (size_t m = 0; m < plan->micro_batches.size(); ++m) {
      const MicroBatchPlan& mb = plan->micro_batches[m];
      if (mb.samples.empty()) continue;
      MicroBatchContext context;
      context.recall_seed = static_cast<uint64_t>(step);
      context.step = step;
      context.micro_batch = static_cast<int>(m);
      context.exchange = exchange.get();
      absl::StatusOr<MicroBatchResult> r = (*runner)->Run(mb, context);
      if (!r.ok())
        tools::Fatal(absl::StrCat("step ", step, " micro-batch ", m, ": ", r.status().ToString()));
      MicroBatchTiming t;
      t.micro_batch = static_cast<int>(m);
      t.compute_seconds = r->compute_seconds;
      t.attention_seconds = std::min(r->attention_seconds, r->compute_seconds);
      t.tokens = r->tokens;
      t.achieved_density = r->achieved_density;
      t.recall = r->recall;
      t.documents = std::move(r->documents);
      t.recall_seconds = r->recall_seconds;
      t.exchange_seconds = r->exchange_seconds;
      for (size_t k = 0; k < mb.samples.size(); ++k) {
        const PlannedSample& p = mb.samples[k];
        if (!p.sharded()) continue;
        shards.push_back({p.id, p.shard_index, static_cast<int>(p.shard_group.size()),
                          p.shard_begin, p.shard_end, p.length, r->samples[k].exchange_seconds,
                          r->samples[k].exchange_bytes});
      }
      exchange_seconds += r->exchange_seconds;
      timings.push_back(std::move(t));
      compute += r->compute_seconds;
      attention += r->attention_seconds;
      tokens += r->tokens;
      density_tokens += r->achieved_density * static_cast<double>(r->tokens);
      recall_tokens += r->recall * static_cast<double>(r->tokens);
      estimate_tokens += r->estimated_recall * static_cast<double>(r->tokens);
      recall_seconds += r->recall_seconds;
    }
    const Clock::time_point wait_start = Clock::now();
    if (absl::Status s = barrier->EndStep(step); !s.ok()) tools::Fatal(s.ToString());
    const double wait = Since(wait_start);
    const absl::Status reported = session.Report(step, timings, wait);
    if (!reported.ok()) std::cerr << "sb-worker: step " << step << ": " << reported << std::endl;
    const bool acked = reported.ok() && session.buffered_reports() == 0;
    if (out.is_open()) {
      StepLine line;
      line.step = step;
      line.rank = rank;
      line.compute_seconds = compute;
      line.attention_seconds = attention;
      line.wait_seconds = wait;
      line.predicted_seconds = plan->predicted_seconds;
      line.tokens = tokens;
      line.density = tokens > 0 ? density_tokens / tokens : 0.0;
      line.recall = tokens > 0 ? recall_tokens / tokens : 0.0;
      line.estimated_recall = tokens > 0 ? estimate_tokens / tokens : 0.0;
      line.recall_seconds = recall_seconds;
      line.exchange_seconds = exchange_seconds;
      line.shards = shards;
      line.local_fallback = plan->local_fallback;
      line.acked = acked;
      line.plan_digest = PlanDigest(plan->micro_batches);
      line.wall_start = wall_start;
      line.wall_end = UnixSeconds();
      out << FormatStepLine(line) << std::endl;
    }
  }
  // Reports still buffered (the planner was away at the end): give it a little while.
  const Clock::time_point flush_start = Clock::now();
  while (session.buffered_reports() > 0 && Since(flush_start) < 20) {
    session.Flush().IgnoreError();
    if (session.buffered_reports() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  if (session.buffered_reports() > 0) {
    std::cerr << "sb-worker: " << session.buffered_reports()
              << " reports could not be delivered (planner unreachable)" << std::endl;
  }
  return 0;
}

}  // namespace
}  // namespace sparsebalance

int main(int argc, char** argv) { return sparsebalance::Main(argc, argv); }
