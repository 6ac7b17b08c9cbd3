#include "client/planner_client.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/wire.h"
#include "sparsebalance/planner/v1/planner.grpc.pb.h"

namespace sparsebalance {
namespace {

// Retry UNAVAILABLE only, with exponential backoff (gRPC adds jitter), per DESIGN.md 7.
constexpr char kServiceConfig[] = R"({
  "methodConfig": [{
    "name": [{"service": "sparsebalance.planner.v1.PlannerService"}],
    "retryPolicy": {
      "maxAttempts": 4,
      "initialBackoff": "0.1s",
      "maxBackoff": "1s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }]
})";

// Whether a report stream's final status says the stream failed, rather than answering the
// report with an error of its own: the planner cannot serve now or is draining (UNAVAILABLE),
// lacks the method (UNIMPLEMENTED), refused the stream at its cap (REPORT_STREAMS_FULL), or
// the call was cancelled. The report is then sent again by a unary call.
bool StreamFailed(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsUnimplemented(status) ||
         absl::IsCancelled(status) || ErrorReason(status) == kReasonReportStreamsFull;
}

// One report at a time on a ReportSteps stream, on gRPC's callback API. A hold keeps the call
// open until Close, whatever the planner does, so the stream operations below never meet a
// finished call; Close then waits for OnDone, which brings the stream's final status.
class ReportStream final
    : public grpc::ClientBidiReactor<v1::ReportStepsRequest, v1::ReportStepsResponse> {
 public:
  ReportStream(v1::PlannerService::Stub* stub, const std::string& token) {
    if (!token.empty()) context_.AddMetadata("authorization", "Bearer " + token);
    stub->async()->ReportSteps(&context_, this);
    AddHold();
    StartCall();
  }
  ~ReportStream() override {
    absl::MutexLock lock(&mu_);
    CloseLocked(/*cancel=*/false);
  }
  ReportStream(const ReportStream&) = delete;
  ReportStream& operator=(const ReportStream&) = delete;

  // Sends `report` and waits up to `timeout` for its answer. An error closes the stream: the
  // stream's final status (the report's own error, or why the stream failed; UNAVAILABLE when
  // it ended without one), or DEADLINE_EXCEEDED.
  absl::StatusOr<v1::ReportStepResponse> Exchange(const v1::ReportStepRequest& report,
                                                  absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::UnavailableError("ReportSteps: the stream is closed");
    *request_.mutable_report() = report;
    read_done_ = write_done_ = read_ok_ = false;
    StartWrite(&request_);
    StartRead(&response_);
    const auto answered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return read_done_ && write_done_;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&answered), timeout)) {
      CloseLocked(/*cancel=*/true);
      return absl::DeadlineExceededError(absl::StrCat(
          "ReportStep: no answer on the report stream within ", absl::FormatDuration(timeout)));
    }
    if (read_ok_) return response_.response();
    CloseLocked(/*cancel=*/false);
    if (final_.ok()) return absl::UnavailableError("ReportSteps: the planner ended the stream");
    return final_;
  }

  void OnWriteDone(bool /*ok*/) override {
    absl::MutexLock lock(&mu_);
    write_done_ = true;
  }
  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    read_done_ = true;
    read_ok_ = ok;
  }
  void OnDone(const grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    final_ = FromGrpcStatus(status);
    done_ = true;
  }

 private:
  // Ends the call (cancelled, or with the client's side closed, which the planner answers by
  // finishing it) and waits for OnDone; the reads and writes started complete before it.
  void CloseLocked(bool cancel) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (closed_) {
      mu_.Await(absl::Condition(&done_));
      return;
    }
    closed_ = true;
    if (cancel) {
      context_.TryCancel();
    } else {
      StartWritesDone();
    }
    RemoveHold();
    // A planner that does not finish the call after the client's side closed is cancelled.
    if (!mu_.AwaitWithTimeout(absl::Condition(&done_), absl::Seconds(5))) {
      context_.TryCancel();
      mu_.Await(absl::Condition(&done_));
    }
  }

  grpc::ClientContext context_;
  absl::Mutex mu_;
  v1::ReportStepsRequest request_ ABSL_GUARDED_BY(mu_);
  v1::ReportStepsResponse response_ ABSL_GUARDED_BY(mu_);
  bool write_done_ ABSL_GUARDED_BY(mu_) = false;
  bool read_done_ ABSL_GUARDED_BY(mu_) = false;
  bool read_ok_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;  // CloseLocked ran (RemoveHold called)
  bool done_ ABSL_GUARDED_BY(mu_) = false;    // OnDone ran: final_ is set
  absl::Status final_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::string LocalHostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  return SanitizeHostName(name);
}

bool IsUnreachable(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable ||
         status.code() == absl::StatusCode::kDeadlineExceeded ||
         ErrorReason(status) == kReasonStateDirFailure;
}

bool IsTransient(const absl::Status& status) {
  // Refused until the job's files shrink: the same call made again is refused again.
  if (IsJobStateQuota(status)) return false;
  switch (status.code()) {
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kCancelled:
      return true;
    default:
      return IsUnreachable(status);
  }
}

// The longest deadline a call gets, in seconds (about 3 years: none in practice). A longer
// timeout is cut to it before it becomes a time point, whose nanoseconds since the epoch would
// overflow from about 292 years on (and its milliseconds' int64 from about 3e14 years).
constexpr double kMaxTimeoutSeconds = 1e8;

struct PlannerClient::Impl {
  using Stub = v1::PlannerService::Stub;
  // The job this client speaks for and its token: options' until CreateJob answers. Read as one
  // (CurrentJob), so that a call made while another thread's CreateJob runs names one job with
  // that job's token.
  struct Job {
    std::string id;
    std::string token;
  };

  explicit Impl(const ClientOptions& connected)
      : options(connected), job{connected.job_id, connected.token} {}

  Job CurrentJob() const ABSL_LOCKS_EXCLUDED(job_mu) {
    absl::ReaderMutexLock lock(&job_mu);
    return job;
  }

  const ClientOptions options;  // as Connect got them (its job_id and token: see `job`)
  mutable absl::Mutex job_mu;
  Job job ABSL_GUARDED_BY(job_mu);
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<Stub> stub;

  // One unary call of `method`: a deadline `timeout_seconds` from now (the call timeout when
  // 0), `bearer` (a job's or the admin token) as "authorization: Bearer <token>" when there is
  // one, and gRPC's status as an absl::Status.
  template <typename Request, typename Response>
  absl::StatusOr<Response> Call(grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                                             Response*),
                                const Request& request, const std::string& bearer,
                                double timeout_seconds = 0.0) const {
    if (timeout_seconds == 0.0) timeout_seconds = options.call_timeout_seconds;
    timeout_seconds = std::min(timeout_seconds, kMaxTimeoutSeconds);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000)));
    if (!bearer.empty()) context.AddMetadata("authorization", "Bearer " + bearer);
    Response response;
    absl::Status status = FromGrpcStatus(((*stub).*method)(&context, request, &response));
    if (!status.ok()) return status;
    return response;
  }

  // The report's answer on the report stream (opened here when there is none), or nullopt
  // when the stream is not to be used now: options.report_stream off, another report on it,
  // or a failed stream's backoff. A report's own error closes the stream and is returned; the
  // next report opens a new one. A stream that failed as a stream (StreamFailed) is closed
  // too, and the next one opens after 1 s, doubling to 60 s while they keep failing (never
  // again for UNIMPLEMENTED: a planner without ReportSteps).
  std::optional<absl::StatusOr<v1::ReportStepResponse>> Stream(const v1::ReportStepRequest& report,
                                                               const std::string& token)
      ABSL_LOCKS_EXCLUDED(stream_mu) {
    if (!options.report_stream || !stream_mu.TryLock()) return std::nullopt;
    std::optional<absl::StatusOr<v1::ReportStepResponse>> out;
    const absl::Time now = absl::Now();
    if (!stream_unsupported && now >= stream_retry_at) {
      if (stream == nullptr) stream = std::make_unique<ReportStream>(stub.get(), token);
      out = stream->Exchange(report, absl::Seconds(options.call_timeout_seconds));
      if (!out->ok()) stream.reset();
      if (out->ok() || !StreamFailed(out->status())) {
        stream_backoff = absl::Seconds(1);
      } else {
        stream_unsupported = absl::IsUnimplemented(out->status());
        stream_retry_at = now + stream_backoff;
        stream_backoff = std::min(2 * stream_backoff, absl::Seconds(60));
      }
    }
    stream_mu.Unlock();
    return out;
  }

  absl::Mutex stream_mu;  // held by the report using the stream
  std::unique_ptr<ReportStream> stream ABSL_GUARDED_BY(stream_mu);
  bool stream_unsupported ABSL_GUARDED_BY(stream_mu) = false;
  absl::Time stream_retry_at ABSL_GUARDED_BY(stream_mu) = absl::InfinitePast();
  absl::Duration stream_backoff ABSL_GUARDED_BY(stream_mu) = absl::Seconds(1);
};

PlannerClient::PlannerClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PlannerClient::~PlannerClient() = default;

ClientOptions PlannerClient::options() const {
  ClientOptions options = impl_->options;
  Impl::Job job = impl_->CurrentJob();
  options.job_id = std::move(job.id);
  options.token = std::move(job.token);
  return options;
}

absl::StatusOr<std::unique_ptr<PlannerClient>> PlannerClient::Connect(
    const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("target: empty; e.g. host:50151");
  if (absl::Status s = ValidateHostName(options.host_name, "host_name"); !s.ok()) return s;
  for (const auto& [name, seconds] :
       {std::pair<const char*, double>{"call_timeout_seconds", options.call_timeout_seconds},
        {"plan_timeout_seconds", options.plan_timeout_seconds}}) {
    // An infinite one cannot be a deadline (and every deadline is required, DESIGN.md 6).
    if (!(seconds > 0) || !std::isfinite(seconds)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", seconds, " seconds; must be finite and > 0 (e.g. 60)"));
    }
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.root_certs_pem.empty()) {
    if (!options.cert_chain_pem.empty()) {
      return absl::InvalidArgumentError("cert_chain_pem needs root_certs_pem (TLS)");
    }
    credentials = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.root_certs_pem;
    ssl.pem_cert_chain = options.cert_chain_pem;
    ssl.pem_private_key = options.private_key_pem;
    credentials = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  args.SetServiceConfigJSON(kServiceConfig);
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 1);
  // Keepalive from the client side too, matching the planner's permitted ping rate.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  // Reconnect soon after the planner comes back: gRPC's default backoff grows to 120 s, during
  // which every call fails fast and the trainer would stay on local plans for minutes.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetMaxReceiveMessageSize(256 << 20);
  auto impl = std::make_unique<Impl>(options);
  impl->channel = grpc::CreateCustomChannel(options.target, credentials, args);
  impl->stub = v1::PlannerService::NewStub(impl->channel);
  return std::unique_ptr<PlannerClient>(new PlannerClient(std::move(impl)));
}

absl::StatusOr<JobHandle> PlannerClient::CreateJob(const std::string& name,
                                                   const PlannerConfig& config, int history_steps) {
  v1::CreateJobRequest request;
  request.set_name(name);
  JobSettings settings;
  settings.planner = config;
  settings.history_steps = history_steps;
  *request.mutable_config() = ConfigToProto(settings);
  request.mutable_config()->set_history_steps(history_steps);
  absl::StatusOr<v1::CreateJobResponse> response =
      impl_->Call(&Impl::Stub::CreateJob, request, impl_->options.admin_token);
  if (!response.ok()) return response.status();
  absl::StatusOr<JobSettings> created = ConfigFromProto(response->config(), WireLimits());
  if (!created.ok()) return created.status();
  {
    absl::MutexLock lock(&impl_->job_mu);
    impl_->job = {response->job_id(), response->job_token()};
  }
  return JobHandle{response->job_id(), response->job_token(), created->planner,
                   created->history_steps};
}

absl::Status PlannerClient::DeleteJob(const std::string& job_id) {
  v1::DeleteJobRequest request;
  request.set_job_id(job_id);
  const std::string& admin = impl_->options.admin_token;
  return impl_
      ->Call(&Impl::Stub::DeleteJob, request, admin.empty() ? impl_->CurrentJob().token : admin)
      .status();
}

absl::StatusOr<std::string> PlannerClient::UploadProfile(const std::string& profile_text) {
  v1::UploadProfileRequest request;
  const Impl::Job job = impl_->CurrentJob();
  request.set_job_id(job.id);
  request.set_profile(profile_text);
  absl::StatusOr<v1::UploadProfileResponse> response =
      impl_->Call(&Impl::Stub::UploadProfile, request, job.token);
  if (!response.ok()) return response.status();
  return response->device();
}

absl::StatusOr<std::pair<PlannerConfig, int64_t>> PlannerClient::JoinJob(int rank,
                                                                         int64_t* rank_next_step) {
  v1::JoinJobRequest request;
  const Impl::Job job = impl_->CurrentJob();
  request.set_job_id(job.id);
  request.set_rank(rank);
  request.set_host(impl_->options.host_name.empty() ? LocalHostName() : impl_->options.host_name);
  absl::StatusOr<v1::JoinJobResponse> response =
      impl_->Call(&Impl::Stub::JoinJob, request, job.token);
  if (!response.ok()) return response.status();
  absl::StatusOr<JobSettings> settings = ConfigFromProto(response->config(), WireLimits());
  if (!settings.ok()) return settings.status();
  if (rank_next_step != nullptr) *rank_next_step = response->rank_next_step();
  return std::make_pair(settings->planner, response->next_step());
}

absl::StatusOr<std::vector<uint64_t>> PlannerClient::SubmitBatch(int64_t step,
                                                                 const std::vector<Sample>& batch,
                                                                 bool planned_locally) {
  v1::SubmitBatchRequest request;
  const Impl::Job job = impl_->CurrentJob();
  request.set_job_id(job.id);
  request.set_step(step);
  request.set_planned_locally(planned_locally);
  for (const Sample& s : batch) SampleToProto(s, request.add_samples());
  absl::StatusOr<v1::SubmitBatchResponse> response =
      impl_->Call(&Impl::Stub::SubmitBatch, request, job.token);
  if (!response.ok()) return response.status();
  return std::vector<uint64_t>(response->deferred_ids().begin(), response->deferred_ids().end());
}

namespace {

// A rank's plan as GetRankPlan and GetRankPlans answer it, or as DecodeRankStepPlan reads it.
// INTERNAL naming `where` for a plan of another step or rank than the one asked for (`rank` -1:
// not known here, DecodeRankStepPlan's caller compares) or one that fails
// MicroBatchesFromProto's checks: a plan of another rank would have this rank train samples
// that another rank trains too.
absl::StatusOr<RankStepPlan> RankStepPlanFromProto(
    const v1::RankPlan& plan, const google::protobuf::RepeatedField<uint64_t>& deferred_ids,
    int64_t step, int rank, int world_size, int block_size, const std::string& where) {
  if (rank >= 0 && (plan.step() != step || plan.rank() != rank)) {
    return absl::InternalError(absl::StrCat(where, ": the planner answered with the plan of step ",
                                            plan.step(), " of rank ", plan.rank(),
                                            "; asked for step ", step, " of rank ", rank));
  }
  RankStepPlan out;
  out.step = plan.step();
  out.rank = plan.rank();
  out.predicted_seconds = plan.predicted_seconds();
  out.predicted_makespan_seconds = plan.figures().makespan_seconds();
  out.local_fallback = plan.planned_locally();
  out.deferred_ids.assign(deferred_ids.begin(), deferred_ids.end());
  absl::StatusOr<std::vector<MicroBatchPlan>> micro_batches =
      MicroBatchesFromProto(plan, PlanContext{world_size, block_size});
  if (!micro_batches.ok()) {
    return absl::InternalError(absl::StrCat(where, ": the planner's plan of step ", step,
                                            " is malformed: ", micro_batches.status().message()));
  }
  out.micro_batches = *std::move(micro_batches);
  return out;
}

}  // namespace

absl::StatusOr<RankStepPlan> PlannerClient::GetRankPlan(int64_t step, int rank, int world_size,
                                                        int block_size) {
  v1::GetRankPlanRequest request;
  const Impl::Job job = impl_->CurrentJob();
  request.set_job_id(job.id);
  request.set_step(step);
  request.set_rank(rank);
  absl::StatusOr<v1::GetRankPlanResponse> response = impl_->Call(
      &Impl::Stub::GetRankPlan, request, job.token, impl_->options.plan_timeout_seconds);
  if (!response.ok()) return response.status();
  if (!response->has_plan()) {
    return absl::InternalError(absl::StrCat("GetRankPlan: the planner's answer for step ", step,
                                            " of rank ", rank, " holds no plan"));
  }
  return RankStepPlanFromProto(response->plan(), response->deferred_ids(), step, rank, world_size,
                               block_size, "GetRankPlan");
}

absl::StatusOr<std::vector<RankStepPlan>> PlannerClient::GetRankPlans(
    int64_t step, const std::vector<int>& ranks, int world_size, int block_size,
    std::vector<std::string>* encoded) {
  v1::GetRankPlansRequest request;
  const Impl::Job job = impl_->CurrentJob();
  request.set_job_id(job.id);
  request.set_step(step);
  request.mutable_ranks()->Assign(ranks.begin(), ranks.end());
  absl::StatusOr<v1::GetRankPlansResponse> response = impl_->Call(
      &Impl::Stub::GetRankPlans, request, job.token, impl_->options.plan_timeout_seconds);
  if (!response.ok()) return response.status();
  if (response->plans_size() != request.ranks_size()) {
    return absl::InternalError(absl::StrCat("GetRankPlans: ", response->plans_size(), " plans for ",
                                            request.ranks_size(), " ranks"));
  }
  std::vector<RankStepPlan> plans;
  plans.reserve(ranks.size());
  for (int k = 0; k < response->plans_size(); ++k) {
    absl::StatusOr<RankStepPlan> plan =
        RankStepPlanFromProto(response->plans(k), response->deferred_ids(), step, ranks[k],
                              world_size, block_size, absl::StrCat("GetRankPlans: plans[", k, "]"));
    if (!plan.ok()) return plan.status();
    plans.push_back(*std::move(plan));
  }
  if (encoded != nullptr) {
    // Each rank's part as GetRankPlan answers it, for DecodeRankStepPlan on that rank.
    encoded->clear();
    encoded->reserve(plans.size());
    v1::GetRankPlanResponse part;
    part.mutable_deferred_ids()->CopyFrom(response->deferred_ids());
    for (const v1::RankPlan& plan : response->plans()) {
      *part.mutable_plan() = plan;
      encoded->push_back(part.SerializeAsString());
    }
  }
  return plans;
}

absl::StatusOr<RankStepPlan> DecodeRankStepPlan(const std::string& bytes, int world_size,
                                                int block_size) {
  v1::GetRankPlanResponse response;
  if (!response.ParseFromString(bytes) || !response.has_plan()) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan: ", bytes.size(), " bytes that are not a GetRankPlanResponse"));
  }
  return RankStepPlanFromProto(response.plan(), response.deferred_ids(), response.plan().step(),
                               /*rank=*/-1, world_size, block_size, "DecodeRankStepPlan");
}

absl::StatusOr<bool> PlannerClient::ReportStep(int64_t step, int rank,
                                               const std::vector<MicroBatchTiming>& micro_batches,
                                               double wait_seconds, bool planned_locally) {
  v1::ReportStepRequest request;
  request.set_planned_locally(planned_locally);
  const Impl::Job job = impl_->CurrentJob();
  request.set_job_id(job.id);
  request.set_step(step);
  request.set_rank(rank);
  request.set_wait_seconds(wait_seconds);
  for (const MicroBatchTiming& m : micro_batches) TimingToProto(m, request.add_micro_batches());
  if (std::optional<absl::StatusOr<v1::ReportStepResponse>> streamed =
          impl_->Stream(request, job.token)) {
    if (streamed->ok()) return (*streamed)->duplicate();
    // The stream failed before the answer: the report goes again by a unary call (retried
    // while UNAVAILABLE); a copy that did arrive makes it a duplicate. Any other error is the
    // report's own answer, DEADLINE_EXCEEDED included (a planner that does not answer in time
    // would not answer a unary call sooner).
    if (!StreamFailed(streamed->status())) return streamed->status();
  }
  absl::StatusOr<v1::ReportStepResponse> response =
      impl_->Call(&Impl::Stub::ReportStep, request, job.token);
  if (!response.ok()) return response.status();
  return response->duplicate();
}

std::string EncodeRankStepReport(const RankStepReport& report) {
  v1::ReportStepRequest request;
  ReportToProto(report, &request);
  return request.SerializeAsString();
}

absl::StatusOr<RankStepReport> DecodeRankStepReport(const std::string& bytes) {
  v1::ReportStepRequest request;
  if (!request.ParseFromString(bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("report: ", bytes.size(), " bytes that are not a ReportStepRequest"));
  }
  return ReportFromProto(request);
}

absl::StatusOr<std::vector<bool>> PlannerClient::ReportStepBatch(
    const std::vector<RankStepReport>& reports) {
  v1::ReportStepBatchRequest request;
  const Impl::Job job = impl_->CurrentJob();
  request.set_job_id(job.id);
  for (const RankStepReport& report : reports) ReportToProto(report, request.add_reports());
  absl::StatusOr<v1::ReportStepBatchResponse> response =
      impl_->Call(&Impl::Stub::ReportStepBatch, request, job.token);
  if (!response.ok()) return response.status();
  if (response->responses_size() != request.reports_size()) {
    return absl::InternalError(absl::StrCat("ReportStepBatch: ", response->responses_size(),
                                            " answers to ", request.reports_size(), " reports"));
  }
  std::vector<bool> duplicates;
  duplicates.reserve(reports.size());
  for (const v1::ReportStepResponse& r : response->responses()) duplicates.push_back(r.duplicate());
  return duplicates;
}

}  // namespace sparsebalance
