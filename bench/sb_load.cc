// sb-load: a load generator for sb-planner over gRPC. It measures what the issue's service bars
// are about, against a real planner process (started here unless --planner names one):
//
//   reports  ReportStep throughput: --clients connections, one rank each, one call in flight
//            per client, --reports calls in all (distinct (step, rank) pairs, so every call is
//            validated, appended to the state directory and folded into the model). With
//            --batch, each client is a node leader that sends its node's reports of a step in
//            one ReportStepBatch call.
//   step     One step of a --ranks job: --ranks GetRankPlan calls wait first, then one
//            SubmitBatch of --samples samples, then every rank reports as soon as its plan
//            arrives. Time from the SubmitBatch call to the last report's answer, --steps times;
//            and the CPU each step took the planner (knowing its pid) and this process: when
//            both share a machine, a round cannot take less than their sum over its cores.
//            With --batch, nodes of that many ranks report together: one ReportStepBatch
//            call once the node's last plan arrived (a node leader's gather, here in process);
//            with --node_plans too, each node takes its ranks' plans in one GetRankPlans call.
//   prefetch The client's default flow (client/balancer.h, prefetch on) over --steps steps of
//            a --ranks job: once a step's plans are out, the next step's batch is submitted and
//            every rank asks for its plan of it while the step trains (--step_seconds, a sleep:
//            the GPUs' time); at the step's end each rank reports it and takes its prefetched
//            plan. What the planner costs the ranks is how long each then waits for a plan not
//            in yet, and how soon after a step starts all of the next step's plans are in.
//            With --batch, nodes of that many ranks report together, as in the step scenario.
//   soak     --soak_steps whole steps of a --soak_ranks job; the planner's resident memory is
//            sampled as it goes (needs the planner's pid: started here, or --planner_pid).
//   floor    The reports scenario's calls without their work: --reports grpc.health.v1 Check
//            calls from --clients connections, one in flight each. What a bare unary call costs
//            the planner here, the part of a report that is gRPC's and the kernel's (run on its
//            own; not part of `all`).
//
// Calls use gRPC's callback API directly (not the client library's blocking calls) so that
// one load process can keep a thousand calls in flight on a 2-core machine.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "contract/step_figures.h"
#include "google/protobuf/arena.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "planner/random.h"
#include "sparsebalance/planner/v1/planner.grpc.pb.h"
#include "tools/child_process.h"
#include "tools/tool_support.h"

ABSL_FLAG(std::string, planner, "",
          "host:port of a running sb-planner; empty: start one (see --sb_planner) on a free "
          "loopback port with a temporary state directory, and stop it at the end");
ABSL_FLAG(std::string, sb_planner, "",
          "the sb-planner binary to start (default: ../server/sb-planner next to sb-load)");
ABSL_FLAG(int, planner_pid, 0, "pid of the --planner process, for the soak's memory figures");
ABSL_FLAG(std::string, admin_token_file, "", "file holding the planner's admin token, if any");
ABSL_FLAG(std::string, scenario, "all",
          "reports | step | prefetch | soak | all | floor (not in all)");
ABSL_FLAG(int, clients, 64, "reports: concurrent clients (a connection and a rank each)");
ABSL_FLAG(int, reports, 40000, "reports: ReportStep calls in all");
ABSL_FLAG(int, ranks, 1024, "step, prefetch: ranks of the job");
ABSL_FLAG(int, samples, 16384, "step, prefetch: samples per SubmitBatch");
ABSL_FLAG(int, steps, 5,
          "step, prefetch: steps measured (step: the median and the slowest are reported)");
ABSL_FLAG(int, connections, 64, "step, prefetch: connections the ranks share");
ABSL_FLAG(double, step_seconds, 1.0,
          "prefetch: seconds each step trains (a sleep) while the next one is planned");
ABSL_FLAG(int, batch, 1,
          "reports, step, prefetch: reports a call, 1-1024; above 1 each node of that many ranks "
          "sends its reports of a step in one ReportStepBatch call (reports: each client is a "
          "node's leader, and the job has --clients x --batch ranks)");
ABSL_FLAG(bool, node_plans, false,
          "step: with --batch, a node's plans come in one GetRankPlans call too (the node's "
          "leader then hands them out), and its reports go in one ReportStepBatch call");
ABSL_FLAG(bool, report_stream, false,
          "reports, step: each rank reports on its own ReportSteps stream, opened before the "
          "clock starts (the client library's ClientOptions::report_stream); false, the "
          "default as in the client library: unary ReportStep calls");
ABSL_FLAG(bool, document_curves, false,
          "the recall the ranks report for each document: false, one hidden curve for all, "
          "1 - (1 - density)^4 (the figures in README); true, each document its own exponent "
          "in [2, 8] drawn from its sample id, as documents of different sensitivity differ");
ABSL_FLAG(int, soak_steps, 10000, "soak: steps");
ABSL_FLAG(int, soak_ranks, 8, "soak: ranks of the job");
ABSL_FLAG(std::string, json, "", "also write the figures to this file as JSON");
ABSL_FLAG(bool, keep_jobs, false,
          "leave each scenario's job on the planner (no DeleteJob), so that its per-job metric "
          "series stay for a scrape (deploy/'s live check and the compose demo)");

namespace sparsebalance {
namespace {

namespace v1 = ::sparsebalance::planner::v1;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

void Check(const grpc::Status& status, const std::string& what) {
  if (!status.ok()) {
    tools::Fatal(absl::StrCat(what, ": ", status.error_code(), " ", status.error_message()));
  }
}

// Resident set size of a process in bytes (VmRSS), or -1.
int64_t ResidentBytes(int pid) {
  if (pid <= 0) return -1;
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// CPU seconds (user + system) a process has used so far, or -1.
double CpuSeconds(int pid) {
  if (pid <= 0) return -1;
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return -1;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);  // utime, stime
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// An sb-planner child process on a free loopback port with a temporary state directory (and
// its log beside it), stopped and removed at the end.
class SpawnedPlanner {
 public:
  explicit SpawnedPlanner(const std::string& binary) {
    char dir_template[] = "/tmp/sb-load-XXXXXX";
    if (mkdtemp(dir_template) == nullptr) tools::Fatal("cannot create a temporary directory");
    dir_ = dir_template;
    absl::StatusOr<std::unique_ptr<tools::PlannerProcess>> planner =
        tools::PlannerProcess::Start(binary,
                                     {"--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                                      "--state_dir=" + dir_ + "/state", "--drain_seconds=1"},
                                     dir_ + "/planner.log");
    if (!planner.ok()) {
      tools::Fatal(absl::StrCat("cannot start ", binary,
                                " (set --sb_planner): ", planner.status().message()));
    }
    planner_ = *std::move(planner);
  }
  ~SpawnedPlanner() {
    planner_->Stop();
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  const std::string& address() const { return planner_->address(); }
  int pid() const { return planner_->pid(); }

 private:
  std::string dir_;
  std::unique_ptr<tools::PlannerProcess> planner_;
};

// Connections to the planner, each its own TCP connection (a local subchannel pool).
class Connections {
 public:
  Connections(const std::string& target, int count) {
    for (int i = 0; i < count; ++i) {
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      args.SetMaxReceiveMessageSize(64 << 20);
      std::shared_ptr<grpc::Channel> channel =
          grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
      stubs_.push_back(v1::PlannerService::NewStub(channel));
      generic_.push_back(std::make_unique<grpc::GenericStub>(channel));
    }
  }
  v1::PlannerService::Stub* operator[](size_t i) { return stubs_[i % stubs_.size()].get(); }
  // The same connection for calls by method name (the floor scenario's health checks).
  grpc::GenericStub* generic(size_t i) { return generic_[i % generic_.size()].get(); }
  size_t size() const { return stubs_.size(); }

 private:
  std::vector<std::unique_ptr<v1::PlannerService::Stub>> stubs_;
  std::vector<std::unique_ptr<grpc::GenericStub>> generic_;
};

// Counts down callbacks; Wait() returns when every one has come back.
class Latch {
 public:
  explicit Latch(int64_t count) : count_(count) {}
  void Done() {
    absl::MutexLock lock(&mu_);
    --count_;
  }
  void Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int64_t* count) { return *count <= 0; }, &count_));
  }

 private:
  absl::Mutex mu_;
  int64_t count_ ABSL_GUARDED_BY(mu_);
};

// Collects latencies and the first error from many callbacks.
class Tally {
 public:
  void Add(const grpc::Status& status, double seconds) {
    absl::MutexLock lock(&mu_);
    if (!status.ok() && error_.empty()) {
      error_ = absl::StrCat(status.error_code(), " ", status.error_message());
    }
    latencies_.push_back(seconds);
  }
  void CheckOk(const std::string& what) {
    absl::MutexLock lock(&mu_);
    if (!error_.empty()) tools::Fatal(absl::StrCat(what, ": ", error_));
  }
  // The q-quantile of the latencies (seconds).
  double Quantile(double q) {
    absl::MutexLock lock(&mu_);
    return sparsebalance::Quantile(latencies_, q);
  }

 private:
  absl::Mutex mu_;
  std::string error_ ABSL_GUARDED_BY(mu_);
  std::vector<double> latencies_ ABSL_GUARDED_BY(mu_);
};

struct Job {
  std::string id;
  std::string token;
};

void Authorize(grpc::ClientContext* context, const std::string& token, double seconds) {
  if (!token.empty()) context->AddMetadata("authorization", "Bearer " + token);
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
}

// One asynchronous call of a job's rank: its state lives as long as the callback holding it.
template <typename Request, typename Response>
struct RankCall {
  grpc::ClientContext context;
  Request request;
  Response response;
};

// A RankCall authorised for `job` with a 60 s deadline, its request naming the job.
template <typename Request, typename Response>
std::shared_ptr<RankCall<Request, Response>> NewRankCall(const Job& job) {
  auto call = std::make_shared<RankCall<Request, Response>>();
  Authorize(&call->context, job.token, 60);
  call->request.set_job_id(job.id);
  return call;
}

Job CreateJob(v1::PlannerService::Stub* stub, const std::string& admin_token, int ranks,
              int micro_batches, int history_steps) {
  v1::CreateJobRequest request;
  request.set_name("sb-load");
  v1::JobConfig* config = request.mutable_config();
  config->set_world_size(ranks);
  config->set_micro_batches(micro_batches);
  config->set_micro_batch_capacity(65536);
  config->set_history_steps(history_steps);
  v1::CreateJobResponse response;
  grpc::ClientContext context;
  Authorize(&context, admin_token, 30);
  Check(stub->CreateJob(&context, request, &response), "CreateJob");
  return {response.job_id(), response.job_token()};
}

void DeleteJob(v1::PlannerService::Stub* stub, const std::string& admin_token, const Job& job) {
  if (absl::GetFlag(FLAGS_keep_jobs)) return;
  v1::DeleteJobRequest request;
  request.set_job_id(job.id);
  v1::DeleteJobResponse response;
  grpc::ClientContext context;
  // A planner without an admin token lets a job's own token alone delete it.
  Authorize(&context, admin_token.empty() ? job.token : admin_token, 30);
  Check(stub->DeleteJob(&context, request, &response), "DeleteJob");
}

// What an async call's callback hands its call's status to.
using Done = std::function<void(const grpc::Status&)>;

// Runs `calls` async unary calls with at most `in_flight` outstanding; `start(i, done)` issues
// call i and must invoke done(status) exactly once.
void RunAsync(int64_t calls, int in_flight, Tally* tally,
              const std::function<void(int64_t, const Done&)>& start) {
  Latch latch(calls);
  std::atomic<int64_t> next{0};
  std::function<void()> issue = [&] {
    const int64_t i = next.fetch_add(1);
    if (i >= calls) return;
    const Clock::time_point t0 = Clock::now();
    start(i, [&, t0](const grpc::Status& status) {
      tally->Add(status, Seconds(t0, Clock::now()));
      issue();  // the next call before this one counts as done, so Wait sees every call
      latch.Done();
    });
  };
  for (int k = 0; k < in_flight; ++k) issue();
  latch.Wait();
}

void Join(Connections& connections, const Job& job, int ranks) {
  Tally tally;
  RunAsync(ranks, 64, &tally, [&](int64_t rank, const Done& done) {
    auto call = NewRankCall<v1::JoinJobRequest, v1::JoinJobResponse>(job);
    call->request.set_rank(static_cast<int>(rank));
    connections[rank]->async()->JoinJob(&call->context, &call->request, &call->response,
                                        [call, done](const grpc::Status& s) { done(s); });
  });
  tally.CheckOk("JoinJob");
}

// A batch of `count` documents (ids from `first_id`) of 256..4096 tokens.
v1::SubmitBatchRequest Batch(const Job& job, int64_t step, int count, uint64_t seed) {
  v1::SubmitBatchRequest request;
  request.set_job_id(job.id);
  request.set_step(step);
  Rng rng(seed);
  for (int i = 0; i < count; ++i) {
    v1::Sample* s = request.add_samples();
    s->set_id(static_cast<uint64_t>(step) * 1000000 + static_cast<uint64_t>(i));
    s->set_length(256 + static_cast<int64_t>(rng.Uniform() * 3840));
  }
  return request;
}

v1::SubmitBatchResponse Submit(v1::PlannerService::Stub* stub, const Job& job,
                               const v1::SubmitBatchRequest& request) {
  v1::SubmitBatchResponse response;
  grpc::ClientContext context;
  Authorize(&context, job.token, 60);
  Check(stub->SubmitBatch(&context, request, &response), "SubmitBatch");
  return response;
}

// The report a rank would send for its plan: 5% slower than predicted.
v1::ReportStepRequest ReportFor(const Job& job, const v1::RankPlan& plan) {
  static const bool document_curves = absl::GetFlag(FLAGS_document_curves);
  v1::ReportStepRequest request;
  request.set_job_id(job.id);
  request.set_step(plan.step());
  request.set_rank(plan.rank());
  request.set_wait_seconds(0.01);
  for (int m = 0; m < plan.micro_batches_size(); ++m) {
    const v1::MicroBatch& mb = plan.micro_batches(m);
    if (mb.samples_size() == 0) continue;
    v1::MicroBatchReport* r = request.add_micro_batches();
    r->set_micro_batch(m);
    r->set_compute_seconds(std::max(1e-3, mb.predicted_seconds() * 1.05));
    r->set_attention_seconds(r->compute_seconds() * 0.5);
    r->set_tokens(mb.tokens());
    r->set_achieved_density(mb.default_density());
    r->set_recall(0.9);
    // Measured recall per document, as sb-worker's probe sends it: a hidden curve
    // 1-(1-density)^g of the planned density, so the planner's recall model has data to fit.
    // g is 4 for every document, or (--document_curves) the document's own, from a hash of its
    // sample id and index that the planner does not know.
    for (const v1::PlannedSample& sample : mb.samples()) {
      const int documents = std::max(1, sample.segments_size());
      for (int d = 0; d < documents; ++d) {
        v1::DocumentRecall* recall = r->add_documents();
        recall->set_sample_id(sample.id());
        recall->set_document(d);
        const double g =
            document_curves
                ? 2.0 + 6.0 * Rng(Rng::Mix(sample.id(), static_cast<uint64_t>(d))).Uniform()
                : 4.0;
        recall->set_recall(1.0 - std::pow(1.0 - sample.density(), g));
        recall->set_rows(8);
      }
    }
    r->set_recall_seconds(r->attention_seconds() * 0.005);
  }
  return request;
}

// The figures of a run, in the order measured, for --json; six significant digits each.
struct Figures {
  nlohmann::ordered_json values = nlohmann::ordered_json::object();
  void Add(const std::string& name, double value) {
    double rounded = 0.0;
    if (!absl::SimpleAtod(absl::StrFormat("%.6g", value), &rounded)) rounded = value;
    values[name] = rounded;
  }
};

// One rank's ReportSteps stream, open from construction to Close, one report in flight:
// Send writes a report and hands its answer's status (UNAVAILABLE for a stream that ended,
// as a report's error ends it) and latency to `done`, on a gRPC thread.
class ReportStream final
    : public grpc::ClientBidiReactor<v1::ReportStepsRequest, v1::ReportStepsResponse> {
 public:
  ReportStream(v1::PlannerService::Stub* stub, const Job& job) {
    Authorize(&context_, job.token, 24 * 3600);
    stub->async()->ReportSteps(&context_, this);
    AddHold();  // the call stays until Close, whatever the planner does
    StartCall();
  }
  ~ReportStream() override { Close(); }

  // `request` must live until `done` is called; `done` may Send the next report.
  void Send(const v1::ReportStepsRequest* request,
            std::function<void(const grpc::Status&, double)> done) {
    absl::MutexLock lock(&mu_);
    done_ = std::move(done);
    start_ = Clock::now();
    if (writing_) {  // the last report's write has not called back yet (its answer has)
      queued_ = request;
    } else {
      writing_ = true;
      StartWrite(request);
    }
    StartRead(&response_);
  }
  void Close() {
    absl::MutexLock lock(&mu_);
    if (closed_) return;
    closed_ = true;
    StartWritesDone();
    RemoveHold();
    mu_.Await(absl::Condition(&finished_));
  }

  void OnWriteDone(bool /*ok*/) override {
    absl::MutexLock lock(&mu_);
    writing_ = queued_ != nullptr;
    if (queued_ != nullptr) StartWrite(std::exchange(queued_, nullptr));
  }
  void OnReadDone(bool ok) override {
    std::function<void(const grpc::Status&, double)> done;
    grpc::Status status;
    double seconds = 0.0;
    {
      absl::MutexLock lock(&mu_);
      done = std::move(done_);
      seconds = Seconds(start_, Clock::now());
      if (!ok) {  // a report's error ends the stream; the planner's log says which
        status = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                              "the report stream ended before the report's answer");
      } else if (response_.response().duplicate()) {
        status =
            grpc::Status(grpc::StatusCode::INTERNAL, "a fresh report came back as a duplicate");
      }
    }
    if (done) done(status, seconds);
  }
  void OnDone(const grpc::Status& /*status*/) override {
    absl::MutexLock lock(&mu_);
    finished_ = true;
  }

 private:
  grpc::ClientContext context_;
  absl::Mutex mu_;
  v1::ReportStepsResponse response_;
  std::function<void(const grpc::Status&, double)> done_ ABSL_GUARDED_BY(mu_);
  Clock::time_point start_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  const v1::ReportStepsRequest* queued_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

// A ReportSteps stream per rank on the rank's connection, or none without --report_stream.
std::vector<std::unique_ptr<ReportStream>> OpenReportStreams(Connections& connections,
                                                             const Job& job, int ranks) {
  std::vector<std::unique_ptr<ReportStream>> streams;
  if (!absl::GetFlag(FLAGS_report_stream)) return streams;
  for (int rank = 0; rank < ranks; ++rank) {
    streams.push_back(std::make_unique<ReportStream>(connections[rank], job));
  }
  return streams;
}

// The messages on one arena that starts inside the call: a rank's plan is some hundred small
// messages, and allocating each on the heap is CPU that sb-load takes from the planner it
// measures (the planner's own calls do the same). PlanThenReport's state.
struct PlanThenReportCall {
  PlanThenReportCall() : arena(ArenaOptions(block)) {}
  static google::protobuf::ArenaOptions ArenaOptions(char* block) {
    google::protobuf::ArenaOptions options;
    options.initial_block = block;
    options.initial_block_size = sizeof(PlanThenReportCall::block);
    return options;
  }
  template <typename Message>
  Message* New() {
    return google::protobuf::Arena::CreateMessage<Message>(&arena);
  }
  alignas(std::max_align_t) char block[16384];
  google::protobuf::Arena arena;  // after the block it starts in
  grpc::ClientContext context;
  v1::GetRankPlanRequest* request = New<v1::GetRankPlanRequest>();
  v1::GetRankPlanResponse* response = New<v1::GetRankPlanResponse>();
  grpc::ClientContext report_context;
  v1::ReportStepRequest* report = New<v1::ReportStepRequest>();
  v1::ReportStepResponse* report_response = New<v1::ReportStepResponse>();
  v1::ReportStepsRequest* streamed = New<v1::ReportStepsRequest>();  // as a stream sends it
};

// --batch, checked: in [1, 1024], a divisor of `ranks` (when not 0), and not with
// --report_stream (batches are unary calls).
int NodeSize(int ranks) {
  const int n = absl::GetFlag(FLAGS_batch);
  if (n < 1 || n > 1024 || (ranks > 0 && ranks % n != 0)) {
    tools::Fatal("--batch must be in [1, 1024] and divide --ranks");
  }
  if (n > 1 && absl::GetFlag(FLAGS_report_stream)) {
    tools::Fatal("--batch and --report_stream do not go together (batches are unary calls)");
  }
  return n;
}

// A node's reports of one step (the step scenario's --batch): collected as its ranks' plans
// arrive, sent in one ReportStepBatch call by the last, whose answer goes to every rank's
// on_done.
struct NodeReports {
  NodeReports(const Job& job, int ranks) : ranks(ranks) {
    Authorize(&context, job.token, 60);
    request.set_job_id(job.id);
  }
  // Adds a rank's report; the node's last sends them all.
  void Add(v1::PlannerService::Stub* stub, const v1::ReportStepRequest& report,
           std::function<void(const grpc::Status&, double)> on_done) {
    // The last rank's call takes every rank's on_done with it, out of the lock's reach.
    std::vector<std::function<void(const grpc::Status&, double)>> all;
    {
      absl::MutexLock lock(&mu);
      *request.add_reports() = report;
      done.push_back(std::move(on_done));
      if (request.reports_size() < ranks) return;
      all = std::move(done);
    }
    const Clock::time_point t0 = Clock::now();
    stub->async()->ReportStepBatch(
        &context, &request, &response, [this, t0, all = std::move(all)](grpc::Status s) {
          if (s.ok() && response.responses_size() != ranks) {
            s = grpc::Status(grpc::StatusCode::INTERNAL, "answers do not match the reports");
          }
          const double seconds = Seconds(t0, Clock::now());
          for (const auto& d : all) d(s, seconds);
        });
  }
  const int ranks;
  absl::Mutex mu;
  v1::ReportStepBatchRequest request ABSL_GUARDED_BY(mu);
  std::vector<std::function<void(const grpc::Status&, double)>> done ABSL_GUARDED_BY(mu);
  grpc::ClientContext context;
  v1::ReportStepBatchResponse response;
};

// A node's part of a step with --node_plans: one GetRankPlans call for ranks [first, first + n)
// (which waits for the plan), then their reports in one ReportStepBatch call through `node`
// (which must outlive the reports' answers). `on_plan` and `on_done` are called once per rank,
// as PlanThenReport calls them.
void NodePlanThenReport(v1::PlannerService::Stub* stub, const Job& job, int64_t step, int first,
                        int n, NodeReports* node,
                        std::function<void(const grpc::Status&, double)> on_plan,
                        std::function<void(const grpc::Status&, double)> on_done) {
  struct Call {
    grpc::ClientContext context;
    v1::GetRankPlansRequest request;
    v1::GetRankPlansResponse response;
  };
  auto call = std::make_shared<Call>();
  Authorize(&call->context, job.token, 60);
  call->request.set_job_id(job.id);
  call->request.set_step(step);
  for (int r = first; r < first + n; ++r) call->request.add_ranks(r);
  const Clock::time_point t0 = Clock::now();
  stub->async()->GetRankPlans(&call->context, &call->request, &call->response,
                              [&job, call, stub, node, n, t0, on_plan = std::move(on_plan),
                               on_done = std::move(on_done)](grpc::Status s) {
                                if (s.ok() && call->response.plans_size() != n) {
                                  s = grpc::Status(grpc::StatusCode::INTERNAL,
                                                   "plans do not match the ranks");
                                }
                                const double seconds = Seconds(t0, Clock::now());
                                for (int k = 0; k < n; ++k) {
                                  if (on_plan) on_plan(s, seconds);
                                }
                                if (!s.ok()) {
                                  for (int k = 0; k < n; ++k) on_done(s, -1.0);
                                  return;
                                }
                                for (int k = 0; k < n; ++k)
                                  node->Add(stub, ReportFor(job, call->response.plans(k)), on_done);
                              });
}

// One rank's part of a step: GetRankPlan (which waits for the plan), then the ReportStep of that
// plan. `on_plan`, if set, sees the plan call's status and latency (seconds); `on_done` sees the
// report's status and latency, or the failed plan call's status and -1.
// With `stream`, the report goes on it; with `node`, to the node's batch.
void PlanThenReport(v1::PlannerService::Stub* stub, const Job& job, int64_t step, int rank,
                    std::function<void(const grpc::Status&, double)> on_plan,
                    std::function<void(const grpc::Status&, double)> on_done,
                    ReportStream* stream = nullptr, NodeReports* node = nullptr) {
  auto call = std::make_shared<PlanThenReportCall>();
  Authorize(&call->context, job.token, 60);
  Authorize(&call->report_context, job.token, 60);
  call->request->set_job_id(job.id);
  call->request->set_step(step);
  call->request->set_rank(rank);
  const Clock::time_point t0 = Clock::now();
  stub->async()->GetRankPlan(
      &call->context, call->request, call->response,
      [&job, call, stub, t0, stream, node, on_plan = std::move(on_plan),
       on_done = std::move(on_done)](const grpc::Status& s) {
        if (on_plan) on_plan(s, Seconds(t0, Clock::now()));
        if (!s.ok()) return on_done(s, -1.0);
        if (node != nullptr) {
          return node->Add(stub, ReportFor(job, call->response->plan()),
                           [call, on_done](const grpc::Status& r, double t) { on_done(r, t); });
        }
        if (stream != nullptr) {
          *call->streamed->mutable_report() = ReportFor(job, call->response->plan());
          return stream->Send(call->streamed,
                              [call, on_done](const grpc::Status& r, double t) { on_done(r, t); });
        }
        *call->report = ReportFor(job, call->response->plan());
        const Clock::time_point t1 = Clock::now();
        stub->async()->ReportStep(
            &call->report_context, call->report, call->report_response,
            [call, t1, on_done](const grpc::Status& r) { on_done(r, Seconds(t1, Clock::now())); });
      });
}

void RunReports(const std::string& target, const std::string& admin, int pid, Figures* figures) {
  const int clients = absl::GetFlag(FLAGS_clients);
  const int batch = NodeSize(0);
  const int ranks = clients * batch;  // client c sends ranks [c * batch, (c + 1) * batch)
  const int steps = std::max<int>(1, (absl::GetFlag(FLAGS_reports) + ranks - 1) / ranks);
  if (steps > 4096) {
    tools::Fatal("--reports / (--clients x --batch) must be at most 4096 (the planner's history)");
  }
  Connections connections(target, clients);
  const Job job = CreateJob(connections[0], admin, ranks, 1, steps);
  Join(connections, job, ranks);
  // Set-up, not timed: every step planned, every rank's plan fetched and its report built.
  std::vector<v1::ReportStepRequest> reports(static_cast<size_t>(steps) * ranks);
  for (int step = 0; step < steps; ++step) {
    Submit(connections[0], job, Batch(job, step, 2 * ranks, 1000 + step));
  }
  Tally fetch;
  RunAsync(static_cast<int64_t>(reports.size()), 64, &fetch, [&](int64_t i, const Done& done) {
    auto call = NewRankCall<v1::GetRankPlanRequest, v1::GetRankPlanResponse>(job);
    call->request.set_step(i / ranks);
    call->request.set_rank(static_cast<int>(i % ranks));
    connections[i % ranks]->async()->GetRankPlan(
        &call->context, &call->request, &call->response, [&, call, done, i](const grpc::Status& s) {
          if (s.ok()) reports[i] = ReportFor(job, call->response.plan());
          done(s);
        });
  });
  fetch.CheckOk("GetRankPlan");
  // A node's reports of a step in one request: batches[step * clients + c].
  std::vector<v1::ReportStepBatchRequest> batches(batch > 1 ? static_cast<size_t>(steps) * clients
                                                            : 0);
  for (size_t b = 0; b < batches.size(); ++b) {
    batches[b].set_job_id(job.id);
    for (int k = 0; k < batch; ++k) *batches[b].add_reports() = reports[b * batch + k];
  }
  // Timed: client c sends (step, c) for step 0, 1, ... with one call (or one report on its
  // stream) in flight; with --batch, its node's reports of the step in one call.
  std::vector<std::unique_ptr<ReportStream>> streams = OpenReportStreams(connections, job, clients);
  std::vector<v1::ReportStepsRequest> streamed(streams.empty() ? 0 : reports.size());
  for (size_t i = 0; i < streamed.size(); ++i) *streamed[i].mutable_report() = reports[i];
  Tally tally;
  Latch latch(static_cast<int64_t>(steps) * clients);
  std::vector<std::function<void(int)>> chains(clients);
  const Clock::time_point start = Clock::now();
  for (int c = 0; c < clients; ++c) {
    chains[c] = [&, c](int step) {
      if (step >= steps) return;
      if (!batches.empty()) {
        struct Call {
          grpc::ClientContext context;
          v1::ReportStepBatchResponse response;
        };
        auto call = std::make_shared<Call>();
        Authorize(&call->context, job.token, 60);
        const Clock::time_point t0 = Clock::now();
        connections[c]->async()->ReportStepBatch(
            &call->context, &batches[static_cast<size_t>(step) * clients + c], &call->response,
            [&, call, t0, c, step](grpc::Status s) {
              if (s.ok() && call->response.responses_size() != batch) {
                s = grpc::Status(grpc::StatusCode::INTERNAL, "answers do not match the reports");
              }
              for (int k = 0; s.ok() && k < batch; ++k) {
                if (call->response.responses(k).duplicate()) {
                  s = grpc::Status(grpc::StatusCode::INTERNAL,
                                   "a fresh report came back as a duplicate");
                }
              }
              tally.Add(s, Seconds(t0, Clock::now()));
              chains[c](step + 1);
              latch.Done();
            });
        return;
      }
      if (!streams.empty()) {
        return streams[c]->Send(&streamed[static_cast<size_t>(step) * clients + c],
                                [&, c, step](const grpc::Status& s, double seconds) {
                                  tally.Add(s, seconds);
                                  chains[c](step + 1);
                                  latch.Done();
                                });
      }
      struct Call {
        grpc::ClientContext context;
        v1::ReportStepResponse response;
      };
      auto call = std::make_shared<Call>();
      Authorize(&call->context, job.token, 60);
      const v1::ReportStepRequest* request = &reports[static_cast<size_t>(step) * clients + c];
      const Clock::time_point t0 = Clock::now();
      connections[c]->async()->ReportStep(&call->context, request, &call->response,
                                          [&, call, t0, c, step](grpc::Status s) {
                                            if (s.ok() && call->response.duplicate()) {
                                              s = grpc::Status(grpc::StatusCode::INTERNAL,
                                                               "a fresh report came back as a "
                                                               "duplicate");
                                            }
                                            tally.Add(s, Seconds(t0, Clock::now()));
                                            chains[c](step + 1);
                                            latch.Done();
                                          });
    };
  }
  const double cpu_start = CpuSeconds(pid);
  for (int c = 0; c < clients; ++c) chains[c](0);
  latch.Wait();
  const double seconds = Seconds(start, Clock::now());
  const double planner_cpu = CpuSeconds(pid) - cpu_start;
  tally.CheckOk(batch > 1 ? "ReportStepBatch" : "ReportStep");
  streams.clear();
  const double rate = static_cast<double>(reports.size()) / seconds;
  const std::string how = batch > 1 ? absl::StrCat("by ReportStepBatch calls of ", batch)
                          : absl::GetFlag(FLAGS_report_stream) ? "on ReportSteps streams"
                                                               : "by ReportStep calls";
  std::cout << absl::StrFormat(
      "reports: %d reports from %d clients %s in %.2f s: %.0f per second "
      "(latency of a call p50 %.2f ms, p99 %.2f ms)\n",
      reports.size(), clients, how, seconds, rate, tally.Quantile(0.5) * 1e3,
      tally.Quantile(0.99) * 1e3);
  if (cpu_start >= 0) {
    // What the planner itself spends, apart from the load generator on the same cores.
    const double per_report = planner_cpu / static_cast<double>(reports.size());
    std::cout << absl::StrFormat(
        "reports: the planner used %.2f CPU-seconds: %.1f us per report, %.0f reports per "
        "CPU-second\n",
        planner_cpu, per_report * 1e6, per_report > 0 ? 1.0 / per_report : 0.0);
    figures->Add("planner_cpu_us_per_report", per_report * 1e6);
  }
  figures->Add("reports_per_second", rate);
  figures->Add("report_p50_ms", tally.Quantile(0.5) * 1e3);
  figures->Add("report_p99_ms", tally.Quantile(0.99) * 1e3);
  DeleteJob(connections[0], admin, job);
}

void RunFloor(const std::string& target, int pid, Figures* figures) {
  const int clients = absl::GetFlag(FLAGS_clients);
  const int64_t calls = absl::GetFlag(FLAGS_reports);
  Connections connections(target, clients);
  // HealthCheckRequest{service: ""} is the empty message.
  const grpc::ByteBuffer request(nullptr, 0);
  auto check = [&](int64_t i, const Done& done) {
    struct Call {
      grpc::ClientContext context;
      grpc::ByteBuffer response;
    };
    auto call = std::make_shared<Call>();
    Authorize(&call->context, "", 60);
    connections.generic(i % clients)
        ->UnaryCall(&call->context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                    &call->response, [call, done](const grpc::Status& s) { done(s); });
  };
  Tally warm;  // connections up before the clock starts
  RunAsync(clients, clients, &warm, check);
  warm.CheckOk("Health/Check");
  Tally tally;
  const double cpu_start = CpuSeconds(pid);
  const Clock::time_point start = Clock::now();
  RunAsync(calls, clients, &tally, check);
  const double seconds = Seconds(start, Clock::now());
  const double planner_cpu = CpuSeconds(pid) - cpu_start;
  tally.CheckOk("Health/Check");
  std::cout << absl::StrFormat(
      "floor: %d grpc.health.v1 Check calls from %d clients in %.2f s: %.0f per second (latency "
      "p50 %.2f ms)\n",
      calls, clients, seconds, static_cast<double>(calls) / seconds, tally.Quantile(0.5) * 1e3);
  if (cpu_start >= 0) {
    const double per_call = planner_cpu / static_cast<double>(calls);
    std::cout << absl::StrFormat("floor: the planner used %.1f us of CPU per call\n",
                                 per_call * 1e6);
    figures->Add("planner_cpu_us_per_bare_call", per_call * 1e6);
  }
}

void RunStep(const std::string& target, const std::string& admin, int pid, Figures* figures) {
  const int ranks = absl::GetFlag(FLAGS_ranks);
  const int samples = absl::GetFlag(FLAGS_samples);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int per_node = NodeSize(ranks);
  Connections connections(target, absl::GetFlag(FLAGS_connections));
  const Job job = CreateJob(connections[0], admin, ranks, 4, 0);
  // Every rank's first JoinJob, 64 in flight: what a job's start costs the planner.
  const double join_cpu_before = CpuSeconds(pid);
  const Clock::time_point join_start = Clock::now();
  Join(connections, job, ranks);
  const double join_seconds = Seconds(join_start, Clock::now());
  const double join_cpu =
      pid > 0 && join_cpu_before >= 0 ? CpuSeconds(pid) - join_cpu_before : -1.0;
  std::cout << absl::StrFormat(
      "step: %d ranks joined in %.1f ms%s\n", ranks, join_seconds * 1e3,
      join_cpu >= 0 ? absl::StrFormat(" (the planner's CPU %.1f ms)", join_cpu * 1e3) : "");
  figures->Add("step_join_ms", join_seconds * 1e3);
  if (join_cpu >= 0) figures->Add("step_join_planner_cpu_ms", join_cpu * 1e3);
  std::vector<std::unique_ptr<ReportStream>> streams = OpenReportStreams(connections, job, ranks);
  std::vector<double> totals;
  double submit_sum = 0.0;
  double plans_sum = 0.0;
  // CPU seconds over the steps (the job's creation and joins left out).
  const double planner_before = CpuSeconds(pid);
  const double load_before = CpuSeconds(getpid());
  for (int step = 0; step < steps; ++step) {
    const v1::SubmitBatchRequest batch = Batch(job, step, samples, 7 + step);
    Tally plans;
    Tally reports;
    Latch waiting(ranks);  // GetRankPlan calls issued
    Latch done(ranks);     // reports answered
    absl::Mutex mu;
    Clock::time_point last_plan;
    std::vector<std::unique_ptr<NodeReports>> nodes;
    for (int n = 0; per_node > 1 && n < ranks / per_node; ++n) {
      nodes.push_back(std::make_unique<NodeReports>(job, per_node));
    }
    const bool node_plans = per_node > 1 && absl::GetFlag(FLAGS_node_plans);
    // Each rank's plan arriving, and its report's answer (or its failed plan call's, -1).
    const auto on_plan = [&](const grpc::Status& s, double seconds) {
      plans.Add(s, seconds);
      absl::MutexLock lock(&mu);
      last_plan = std::max(last_plan, Clock::now());
    };
    const auto on_done = [&](const grpc::Status& s, double report_seconds) {
      if (report_seconds >= 0) reports.Add(s, report_seconds);
      done.Done();
    };
    for (int rank = 0; node_plans && rank < ranks; rank += per_node) {
      NodePlanThenReport(connections[rank / per_node], job, step, rank, per_node,
                         nodes[rank / per_node].get(), on_plan, on_done);
      for (int k = 0; k < per_node; ++k) waiting.Done();
    }
    for (int rank = 0; !node_plans && rank < ranks; ++rank) {
      PlanThenReport(connections[rank], job, step, rank, on_plan, on_done,
                     streams.empty() ? nullptr : streams[rank].get(),
                     nodes.empty() ? nullptr : nodes[rank / per_node].get());
      waiting.Done();
    }
    waiting.Wait();
    // Let the waiting calls reach the planner and park there before the batch arrives.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const Clock::time_point start = Clock::now();
    Submit(connections[0], job, batch);
    const Clock::time_point submitted = Clock::now();
    done.Wait();
    const Clock::time_point end = Clock::now();
    plans.CheckOk(node_plans ? "GetRankPlans" : "GetRankPlan");
    reports.CheckOk(per_node > 1 ? "ReportStepBatch" : "ReportStep");
    totals.push_back(Seconds(start, end));
    submit_sum += Seconds(start, submitted);
    plans_sum += Seconds(start, last_plan);
  }
  const double load_cpu = (CpuSeconds(getpid()) - load_before) / steps;
  const double planner_cpu =
      pid > 0 && planner_before >= 0 ? (CpuSeconds(pid) - planner_before) / steps : -1.0;
  const bool streams_used = !streams.empty();
  streams.clear();
  const double median = sparsebalance::Quantile(totals, 0.5);
  const double slowest = sparsebalance::Quantile(totals, 1.0);
  // The first step apart too: issue 16's bar names it (the job's first plan, its per-thread
  // buffers and files new).
  const double first = totals.empty() ? 0.0 : totals.front();
  std::cout << absl::StrFormat(
      "step: %d ranks, %d samples, %d connections, reports %s: SubmitBatch to last report "
      "%.1f ms median, %.1f ms slowest of %d, %.1f ms the first (SubmitBatch %.1f ms, last plan "
      "served at %.1f ms, mean)\n",
      ranks, samples, connections.size(),
      per_node > 1   ? absl::StrCat("by node, ", per_node, " ranks a ReportStepBatch call",
                                  absl::GetFlag(FLAGS_node_plans) ? " (plans too)" : "")
      : streams_used ? "on streams"
                     : "by unary calls",
      median * 1e3, slowest * 1e3, steps, first * 1e3, submit_sum / steps * 1e3,
      plans_sum / steps * 1e3);
  if (planner_cpu >= 0) {
    // Parking the next step's GetRankPlan calls is in the step's CPU but before its clock.
    const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    std::cout << absl::StrFormat(
        "step: CPU per step: the planner %.1f ms, sb-load %.1f ms; on one machine that is %.1f "
        "ms of all its %d cores\n",
        planner_cpu * 1e3, load_cpu * 1e3, (planner_cpu + load_cpu) / cores * 1e3, cores);
    figures->Add("step_planner_cpu_ms", planner_cpu * 1e3);
    figures->Add("step_load_cpu_ms", load_cpu * 1e3);
  }
  figures->Add("step_ms_median", median * 1e3);
  figures->Add("step_ms_max", slowest * 1e3);
  figures->Add("step_ms_first", first * 1e3);
  figures->Add("step_submit_ms_mean", submit_sum / steps * 1e3);
  figures->Add("step_last_plan_ms_mean", plans_sum / steps * 1e3);
  DeleteJob(connections[0], admin, job);
}

// The prefetch scenario (see the top of the file). Step 0 is planned and fetched before the
// clock starts (a first step is never prefetched); steps 1..--steps are measured.
void RunPrefetch(const std::string& target, const std::string& admin, int pid, Figures* figures) {
  const int ranks = absl::GetFlag(FLAGS_ranks);
  const int samples = absl::GetFlag(FLAGS_samples);
  const int steps = absl::GetFlag(FLAGS_steps);
  const double step_seconds = absl::GetFlag(FLAGS_step_seconds);
  const int per_node = NodeSize(ranks);
  if (!(step_seconds >= 0 && step_seconds <= 600)) {
    tools::Fatal(absl::StrCat("--step_seconds=", step_seconds, ": expected 0 to 600 seconds"));
  }
  Connections connections(target, absl::GetFlag(FLAGS_connections));
  const Job job = CreateJob(connections[0], admin, ranks, 4, 0);
  Join(connections, job, ranks);
  // Each rank's plan of a step and when it arrived; GetRankPlan waits for a step not planned.
  struct Fetched {
    std::vector<v1::RankPlan> plans;
    std::vector<Clock::time_point> arrived;
    Tally tally;
    std::unique_ptr<Latch> latch;
  };
  const auto fetch = [&](int64_t step, Fetched* out) {
    out->plans.assign(ranks, v1::RankPlan());
    out->arrived.assign(ranks, Clock::time_point());
    out->latch = std::make_unique<Latch>(ranks);
    for (int rank = 0; rank < ranks; ++rank) {
      auto call = NewRankCall<v1::GetRankPlanRequest, v1::GetRankPlanResponse>(job);
      call->request.set_step(step);
      call->request.set_rank(rank);
      connections[rank]->async()->GetRankPlan(
          &call->context, &call->request, &call->response,
          [out, call, rank](const grpc::Status& s) {
            out->arrived[rank] = Clock::now();
            if (s.ok()) {
              out->plans[rank].Swap(call->response.mutable_plan());
            }
            out->tally.Add(s, 0.0);
            out->latch->Done();
          });
    }
  };
  auto current = std::make_unique<Fetched>();
  Submit(connections[0], job, Batch(job, 0, samples, 7));
  fetch(0, current.get());
  current->latch->Wait();
  current->tally.CheckOk("GetRankPlan");
  std::vector<double> waits;      // seconds, per (step, rank): plan arrival past the step's end
  std::vector<double> all_in;     // seconds from a step's start to its successor's last plan
  std::vector<double> submitted;  // seconds from a step's start to the next SubmitBatch's answer
  const double cpu_before = CpuSeconds(pid);
  for (int64_t step = 0; step < steps; ++step) {
    // The step starts: rank 0 submits the next batch, every rank prefetches its next plan.
    const Clock::time_point start = Clock::now();
    auto next = std::make_unique<Fetched>();
    fetch(step + 1, next.get());
    Clock::time_point answered;
    std::thread submit([&] {
      Submit(connections[0], job, Batch(job, step + 1, samples, 8 + step));
      answered = Clock::now();
    });
    std::this_thread::sleep_for(std::chrono::duration<double>(step_seconds));
    const Clock::time_point trained = Clock::now();
    // The step ends: every rank reports it (in the background, as the client does) and takes
    // its prefetched plan of the next step.
    Tally reports;
    Latch reported(ranks);
    // With --batch, a node's ranks report through their leader: one call per node.
    std::vector<std::unique_ptr<NodeReports>> nodes;
    for (int n = 0; per_node > 1 && n < ranks / per_node; ++n) {
      nodes.push_back(std::make_unique<NodeReports>(job, per_node));
    }
    for (int rank = 0; rank < ranks; ++rank) {
      if (!nodes.empty()) {
        nodes[rank / per_node]->Add(connections[rank], ReportFor(job, current->plans[rank]),
                                    [&](const grpc::Status& s, double) {
                                      reports.Add(s, 0.0);
                                      reported.Done();
                                    });
        continue;
      }
      auto call = NewRankCall<v1::ReportStepRequest, v1::ReportStepResponse>(job);
      call->request = ReportFor(job, current->plans[rank]);
      connections[rank]->async()->ReportStep(&call->context, &call->request, &call->response,
                                             [&, call](const grpc::Status& s) {
                                               reports.Add(s, 0.0);
                                               reported.Done();
                                             });
    }
    next->latch->Wait();
    submit.join();
    next->tally.CheckOk("GetRankPlan");
    Clock::time_point last = start;
    for (const Clock::time_point& t : next->arrived) {
      waits.push_back(std::max(0.0, Seconds(trained, t)));
      last = std::max(last, t);
    }
    all_in.push_back(Seconds(start, last));
    submitted.push_back(Seconds(start, answered));
    reported.Wait();
    reports.CheckOk(per_node > 1 ? "ReportStepBatch" : "ReportStep");
    current = std::move(next);
  }
  const double cpu = CpuSeconds(pid) - cpu_before;  // planning, answers and reports of each step
  const int64_t waited = std::count_if(waits.begin(), waits.end(), [](double w) { return w > 0; });
  std::cout << absl::StrFormat(
      "prefetch: %d ranks, %d samples, steps of %.2f s: ranks waited for their plans %.1f ms "
      "median, %.1f ms p99, %.1f ms at most (%d of %d plans were not in when the step before "
      "ended); the next step's plans were all in %.1f ms median, %.1f ms at most after a step "
      "started "
      "(SubmitBatch answered at %.1f ms median), over %d steps\n",
      ranks, samples, step_seconds, sparsebalance::Quantile(waits, 0.5) * 1e3,
      sparsebalance::Quantile(waits, 0.99) * 1e3, sparsebalance::Quantile(waits, 1.0) * 1e3, waited,
      waits.size(), sparsebalance::Quantile(all_in, 0.5) * 1e3,
      sparsebalance::Quantile(all_in, 1.0) * 1e3, sparsebalance::Quantile(submitted, 0.5) * 1e3,
      steps);
  if (pid > 0 && cpu_before >= 0) {
    std::cout << absl::StrFormat(
        "prefetch: the planner used %.2f CPU-seconds a step (planning, storing, %d plans "
        "answered and %d reports)\n",
        cpu / steps, ranks, ranks);
    figures->Add("prefetch_planner_cpu_s_per_step", cpu / steps);
  }
  figures->Add("prefetch_wait_ms_median", sparsebalance::Quantile(waits, 0.5) * 1e3);
  figures->Add("prefetch_wait_ms_p99", sparsebalance::Quantile(waits, 0.99) * 1e3);
  figures->Add("prefetch_wait_ms_max", sparsebalance::Quantile(waits, 1.0) * 1e3);
  figures->Add("prefetch_all_in_ms_median", sparsebalance::Quantile(all_in, 0.5) * 1e3);
  figures->Add("prefetch_all_in_ms_max", sparsebalance::Quantile(all_in, 1.0) * 1e3);
  DeleteJob(connections[0], admin, job);
}

void RunSoak(const std::string& target, const std::string& admin, int pid, Figures* figures) {
  const int ranks = absl::GetFlag(FLAGS_soak_ranks);
  const int steps = absl::GetFlag(FLAGS_soak_steps);
  Connections connections(target, ranks);
  const Job job = CreateJob(connections[0], admin, ranks, 2, 0);
  Join(connections, job, ranks);
  const int samples_every = std::max(1, steps / 10);
  std::vector<std::pair<int, int64_t>> rss;  // (step, bytes)
  const Clock::time_point start = Clock::now();
  for (int step = 0; step < steps; ++step) {
    Submit(connections[0], job, Batch(job, step, 4 * ranks, 99 + step));
    Tally tally;
    RunAsync(ranks, ranks, &tally, [&](int64_t rank, const Done& done) {
      PlanThenReport(connections[rank], job, step, static_cast<int>(rank), nullptr,
                     [done](const grpc::Status& s, double) { done(s); });
    });
    tally.CheckOk(absl::StrCat("step ", step));
    if ((step + 1) % samples_every == 0) rss.emplace_back(step + 1, ResidentBytes(pid));
  }
  const double seconds = Seconds(start, Clock::now());
  std::cout << absl::StrFormat("soak: %d steps of %d ranks in %.1f s (%.2f ms a step)\n", steps,
                               ranks, seconds, seconds / steps * 1e3);
  figures->Add("soak_ms_per_step", seconds / steps * 1e3);
  if (pid > 0 && rss.size() >= 2) {
    std::cout << "soak: planner resident memory (MiB) after step";
    for (const auto& [step, bytes] : rss) {
      std::cout << absl::StrFormat(" %d: %.1f;", step, bytes / 1048576.0);
    }
    // Growth over the second half of the run: after the history has filled, memory is flat.
    const int64_t middle = rss[rss.size() / 2 - 1].second;
    const int64_t last = rss.back().second;
    std::cout << absl::StrFormat("\nsoak: growth from step %d to %d: %+.1f MiB\n",
                                 rss[rss.size() / 2 - 1].first, rss.back().first,
                                 (last - middle) / 1048576.0);
    figures->Add("soak_rss_mib_mid", middle / 1048576.0);
    figures->Add("soak_rss_mib_end", last / 1048576.0);
  } else {
    std::cout << "soak: planner memory not sampled (give --planner_pid)\n";
  }
  DeleteJob(connections[0], admin, job);
}

int Main(int argc, char** argv) {
  // As sb-planner: absl::Mutex's deadlock detection (on in Debian's build) costs a graph update
  // per lock of gRPC's own mutexes, CPU that sb-load takes from the planner it measures on the
  // same cores.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Each line as it is written, also into a pipe: a script (or a person watching a long step
  // scenario) sees the join line before the steps end, not everything at exit.
  std::cout << std::unitbuf;
  tools::InitTool(
      argc, argv,
      "load generator for sb-planner: ReportStep throughput, one large step, steps\n"
      "planned ahead as the client does, and a memory soak (README \"Service load\");\n"
      "starts the planner it measures unless --planner names one.\n\n"
      "  sb-load [--planner=HOST:PORT] [--scenario=reports|step|prefetch|soak|all|floor] ...");
  tools::StopChildrenOnSignals();
  const std::string scenario = absl::GetFlag(FLAGS_scenario);
  if (scenario != "reports" && scenario != "step" && scenario != "prefetch" && scenario != "soak" &&
      scenario != "all" && scenario != "floor") {
    tools::Fatal(absl::StrCat("--scenario=", scenario,
                              ": expected reports, step, prefetch, soak, all or floor"));
  }
  std::string admin;
  if (!absl::GetFlag(FLAGS_admin_token_file).empty()) {
    absl::StatusOr<std::string> text = tools::ReadFile(absl::GetFlag(FLAGS_admin_token_file));
    if (!text.ok()) tools::Fatal(absl::StrCat("--admin_token_file: ", text.status().message()));
    admin = std::string(absl::StripAsciiWhitespace(*text));
  }
  std::unique_ptr<SpawnedPlanner> spawned;
  std::string target = absl::GetFlag(FLAGS_planner);
  int pid = absl::GetFlag(FLAGS_planner_pid);
  if (target.empty()) {
    std::string binary = absl::GetFlag(FLAGS_sb_planner);
    if (binary.empty()) {
      absl::StatusOr<std::string> found = tools::FindToolBinary("sb-planner");
      if (!found.ok()) tools::Fatal(absl::StrCat(found.status().message(), "; set --sb_planner"));
      binary = *found;
    }
    spawned = std::make_unique<SpawnedPlanner>(binary);
    target = spawned->address();
    pid = spawned->pid();
    std::cout << "sb-load: started " << binary << " on " << target << "\n";
  }
  Figures figures;
  if (scenario == "reports" || scenario == "all") RunReports(target, admin, pid, &figures);
  if (scenario == "step" || scenario == "all") RunStep(target, admin, pid, &figures);
  if (scenario == "prefetch" || scenario == "all") RunPrefetch(target, admin, pid, &figures);
  if (scenario == "soak" || scenario == "all") RunSoak(target, admin, pid, &figures);
  if (scenario == "floor") RunFloor(target, pid, &figures);
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    if (absl::Status s = tools::WriteFile(path, figures.values.dump() + "\n"); !s.ok()) {
      tools::Fatal(absl::StrCat("--json: ", s.message()));
    }
  }
  return 0;
}

}  // namespace
}  // namespace sparsebalance

int main(int argc, char** argv) {
  try {
    return sparsebalance::Main(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "sb-load: " << e.what() << std::endl;
  } catch (...) {
    std::cerr << "sb-load: an unknown exception" << std::endl;
  }
  return 1;
}
