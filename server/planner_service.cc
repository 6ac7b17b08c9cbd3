#include "server/planner_service.h"

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <new>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/arena.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/impl/codegen/server_callback_handlers.h"
#include "planner/planner.h"
#include "server/request_guard.h"
#include "tools/secret.h"

namespace sparsebalance {
namespace {

// The index of PlannerService's method `method` (the generated Service numbers the methods so,
// in the order of planner.proto). A name the service lacks, or other message types than the
// method's, is a bug of this file: it aborts at start-up.
template <typename Request, typename Response>
int MethodIndex(const char* method) {
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          v1::PlannerService::service_full_name());
  const google::protobuf::MethodDescriptor* found =
      service == nullptr ? nullptr : service->FindMethodByName(method);
  if (found == nullptr || found->input_type() != Request::descriptor() ||
      found->output_type() != Response::descriptor()) {
    std::cerr << "sb-planner: PlannerService has no method " << method << "("
              << Request::descriptor()->full_name() << ") returns ("
              << Response::descriptor()->full_name() << ")" << std::endl;
    std::abort();
  }
  return found->index();
}

// Where a request of type Request holds its job id, as field numbers from the top
// (PendingRequest reads it off the bytes, so that the token is checked before the parse):
// job_id (1) in every job call's request, report.job_id in a ReportSteps stream's; none in
// CreateJob's and ListJobs', whose callers need the admin token.
template <typename Request>
absl::Span<const int> JobIdPath() {
  static constexpr int kTop[] = {1};
  static constexpr int kInReport[] = {1, 1};
  if constexpr (std::is_same_v<Request, v1::CreateJobRequest> ||
                std::is_same_v<Request, v1::ListJobsRequest>) {
    return {};
  } else if constexpr (std::is_same_v<Request, v1::ReportStepsRequest>) {
    return kInReport;
  } else {
    return kTop;
  }
}

// Stops the planner at start-up when JobIdPath<Request> does not end at a string field named
// job_id (a bug of this file, as MethodIndex's).
template <typename Request>
void CheckJobIdPath(const char* method) {
  const absl::Span<const int> path = JobIdPath<Request>();
  const google::protobuf::Descriptor* type = Request::descriptor();
  const google::protobuf::FieldDescriptor* field = nullptr;
  for (size_t k = 0; k < path.size() && type != nullptr; ++k) {
    field = type->FindFieldByNumber(path[k]);
    type = field == nullptr ? nullptr : field->message_type();
  }
  if (!path.empty() && (field == nullptr || field->name() != "job_id" ||
                        field->type() != google::protobuf::FieldDescriptor::TYPE_STRING)) {
    std::cerr << "sb-planner: " << method << ": no job_id at the job id path of "
              << Request::descriptor()->full_name() << std::endl;
    std::abort();
  }
}

// GetJobRequest.slowest_ranks: 0 means the default; above the bound is INVALID_ARGUMENT.
constexpr int kDefaultSlowestRanks = 8;
constexpr int kMaxSlowestRanks = 64;

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void SummaryToProto(const JobView& view, v1::JobSummary* out) {
  out->set_job_id(view.job_id);
  if (view.failed) {
    out->set_state(v1::JOB_STATE_FAILED);
    out->set_failure(view.failure);
    return;
  }
  out->set_name(view.name);
  *out->mutable_config() = ConfigToProto(view.settings);
  out->set_next_step(view.next_step);
  out->set_joined_ranks(view.joined_ranks);
  if (view.has_plan) FiguresToProto(*view.last_plan, out->mutable_last_figures());
  out->mutable_speed_factors()->Assign(view.speed_factors.begin(), view.speed_factors.end());
  out->set_state(v1::JOB_STATE_ACTIVE);
  out->set_failure(view.failure);
  out->set_unfolded_steps(view.unfolded_steps);
  out->set_steps_folded(view.steps_folded);
  out->set_exchange_bytes_per_second(view.exchange_bytes_per_second);
  out->set_state_bytes(view.state_bytes);
  for (const RecallCurveSummary& c : view.recall_curves) {
    v1::RecallCurve* curve = out->add_recall_curves();
    curve->set_bucket(RecallBucketLabel(c.bucket, view.micro_batch_capacity));
    const LengthRange range = RecallBucketRange(c.bucket, view.micro_batch_capacity);
    curve->set_length_min(range.min);
    curve->set_length_max(range.max);
    if (c.layer.has_value()) curve->set_layer(*c.layer);
    curve->set_exponent(c.exponent);
    curve->set_documents(c.documents);
    curve->set_measured_recall(c.measured_recall);
    curve->set_measured_density(c.measured_density);
  }
}

}  // namespace

// A GetRankPlan (or GetRankPlans) call waiting for its step. Whoever finishes it first (the
// SubmitBatch that plans the step, or the call's cancellation or deadline) sets `finished`
// under `mu`, fills the response and calls Reply; everyone after sees `finished` and leaves
// the call alone. The call (Register's reactor) deletes itself in OnDone, which gRPC runs only
// after Reply, so it is alive whenever `finished` is false.
struct PlannerServiceImpl::Wait {
  const PlannerServiceImpl* service = nullptr;
  const char* method = "GetRankPlan";
  std::chrono::steady_clock::time_point start;
  std::string job_id;
  int64_t step = 0;
  // The ranks asked for: one (GetRankPlan, answered into `response`) or several (GetRankPlans,
  // into `many`).
  std::vector<int> ranks;
  v1::GetRankPlanResponse* response = nullptr;
  v1::GetRankPlansResponse* many = nullptr;
  Call* call = nullptr;
  absl::Mutex mu;
  bool finished ABSL_GUARDED_BY(mu) = false;

  void Complete(absl::Status status, const StepPlan* plan) {
    absl::MutexLock lock(&mu);
    if (finished) return;
    finished = true;
    if (plan != nullptr) {
      try {  // a large plan's message is the one allocation here that can fail
        if (many != nullptr) {
          for (int r : ranks) RankPlanToProto(*plan, step, r, many->add_plans());
          many->mutable_deferred_ids()->Assign(plan->deferred_ids.begin(),
                                               plan->deferred_ids.end());
        } else {
          RankPlanToProto(*plan, step, ranks.front(), response->mutable_plan());
          response->mutable_deferred_ids()->Assign(plan->deferred_ids.begin(),
                                                   plan->deferred_ids.end());
        }
      } catch (const std::bad_alloc&) {
        if (many != nullptr) many->Clear();
        if (response != nullptr) response->Clear();
        status = absl::ResourceExhaustedError(
            absl::StrCat(method, ": the planner ran out of memory building the plan message"));
        std::cerr << "sb-planner: " << status.message() << std::endl;
      }
    }
    service->Record(method, start, status);
    call->Reply(ToGrpcStatus(status));
  }
};

std::string BearerToken(const grpc::CallbackServerContext& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return "";
  const absl::string_view value(it->second.data(), it->second.size());
  constexpr absl::string_view kBearer = "Bearer ";
  if (!absl::StartsWith(value, kBearer)) return "";
  return std::string(value.substr(kBearer.size()));
}

PlannerServiceImpl::PlannerServiceImpl(JobRegistry* registry, Options options)
    : registry_(registry), options_(std::move(options)) {
  if (options_.metrics != nullptr) {
    options_.metrics->SetJobs(registry_->job_count());
    options_.metrics->SetCallLimits(options_.max_waiting_calls, options_.max_report_streams);
  }
  Serve<Caller::kAdmin>("CreateJob", &PlannerServiceImpl::OnCreateJob);
  Serve<Caller::kJob>("JoinJob", &PlannerServiceImpl::OnJoinJob);
  Serve<Caller::kJob>("SubmitBatch", &PlannerServiceImpl::OnSubmitBatch);
  Register<Caller::kJob, v1::GetRankPlanRequest, v1::GetRankPlanResponse>(
      "GetRankPlan", [this](Call* call, grpc::CallbackServerContext*, auto* request,
                            auto* response) { OnGetRankPlan(call, request, response); });
  Register<Caller::kJob, v1::GetRankPlansRequest, v1::GetRankPlansResponse>(
      "GetRankPlans", [this](Call* call, grpc::CallbackServerContext*, auto* request,
                             auto* response) { OnGetRankPlans(call, request, response); });
  Serve<Caller::kJob>("ReportStep", &PlannerServiceImpl::OnReportStep);
  Serve<Caller::kJob>("ReportStepBatch", &PlannerServiceImpl::OnReportStepBatch);
  MarkMethodCallback(
      MethodIndex<v1::ReportStepsRequest, v1::ReportStepsResponse>("ReportSteps"),
      new grpc::internal::CallbackBidiHandler<PendingRequest<v1::ReportStepsRequest>,
                                              v1::ReportStepsResponse>(
          [this](grpc::CallbackServerContext* context) { return OpenReportStream(context); }));
  Serve<Caller::kJob>("UploadProfile", &PlannerServiceImpl::OnUploadProfile);
  Serve<Caller::kJob>("UpdateJobConfig", &PlannerServiceImpl::OnUpdateJobConfig);
  Serve<Caller::kJob>("GetJob", &PlannerServiceImpl::OnGetJob);
  Serve<Caller::kAdmin>("ListJobs", &PlannerServiceImpl::OnListJobs);
  Serve<Caller::kAdminOrJob>("DeleteJob", &PlannerServiceImpl::OnDeleteJob);
}

void PlannerServiceImpl::Finish(Call* call, const char* method, Clock::time_point start,
                                const absl::Status& status) {
  Record(method, start, status);
  call->Reply(ToGrpcStatus(status));
}

void PlannerServiceImpl::Record(const char* method, Clock::time_point start,
                                const absl::Status& status) const {
  if (options_.metrics == nullptr) return;
  options_.metrics->ObserveRpc(method, status.code(), SecondsSince(start));
}

template <typename Body>
void PlannerServiceImpl::Guarded(Call* call, const char* method, Body body) {
  const Clock::time_point start = Clock::now();
  absl::Status failure;
  try {
    body(start);
    return;
  } catch (const std::bad_alloc&) {
    failure = absl::ResourceExhaustedError(
        absl::StrCat(method, ": the planner ran out of memory for this call"));
  } catch (const std::exception& e) {
    failure = absl::InternalError(absl::StrCat(method, ": ", e.what()));
  } catch (...) {
    failure = absl::InternalError(absl::StrCat(method, ": an unknown exception"));
  }
  std::cerr << "sb-planner: " << failure.message() << std::endl;
  Finish(call, method, start, failure);  // ignored when the body had answered the call
}

PlannerServiceImpl::~PlannerServiceImpl() = default;

absl::Status PlannerServiceImpl::AuthorizeJob(grpc::CallbackServerContext* context,
                                              const std::string& job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: empty");
  return registry_->Authorize(job_id, BearerToken(*context));
}

absl::Status PlannerServiceImpl::AuthorizeAdmin(grpc::CallbackServerContext* context) const {
  if (options_.admin_token.empty()) return absl::OkStatus();
  const std::string token = BearerToken(*context);
  if (token.empty()) {
    return absl::UnauthenticatedError(
        "this planner needs the admin token: send \"authorization: Bearer <admin token>\"");
  }
  if (!tools::ConstantTimeEquals(token, options_.admin_token)) {
    return absl::PermissionDeniedError("the token is not this planner's admin token");
  }
  return absl::OkStatus();
}

absl::Status PlannerServiceImpl::AuthorizeAdminOrJob(grpc::CallbackServerContext* context,
                                                     const std::string& job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: empty");
  // Without an admin token there is no admin to act for every job: only the job's own token
  // may then delete it (any local user reaches a loopback planner, and must not be able to end
  // another user's job).
  if (options_.admin_token.empty()) return AuthorizeJob(context, job_id);
  const std::string token = BearerToken(*context);
  if (token.empty()) {
    return absl::UnauthenticatedError(absl::StrCat(
        "no token: send \"authorization: Bearer <token>\" with the planner's admin token or job ",
        Quoted(job_id), "'s own token"));
  }
  if (tools::ConstantTimeEquals(token, options_.admin_token)) return absl::OkStatus();
  absl::Status own = registry_->Authorize(job_id, token);
  if (absl::IsPermissionDenied(own)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the token is neither this planner's admin token nor job ", job_id, "'s own token"));
  }
  return own;
}

template <PlannerServiceImpl::Caller caller>
absl::Status PlannerServiceImpl::PreAuthorize(grpc::CallbackServerContext* context,
                                              int* job_ranks) const {
  if (job_ranks != nullptr) *job_ranks = -1;
  // The admin check needs nothing from the request: done whole here (OK where no admin token is
  // set: CreateJob and ListJobs are then open, and their requests are read).
  if constexpr (caller == Caller::kAdmin) return AuthorizeAdmin(context);
  const bool has_admin = !options_.admin_token.empty();
  const std::string token = BearerToken(*context);
  if (token.empty()) {
    if (caller == Caller::kAdminOrJob && has_admin) {
      return absl::UnauthenticatedError(
          "no token: send \"authorization: Bearer <token>\" with the planner's admin token or "
          "the job's own token");
    }
    return JobRegistry::NoTokenError();
  }
  // The admin token passes for a job call too: the check against the job follows the read, as
  // for every token (AuthorizeJob refuses it there, AuthorizeAdminOrJob takes it).
  if (has_admin && tools::ConstantTimeEquals(token, options_.admin_token)) return absl::OkStatus();
  if (const int ranks = registry_->TokenJobRanks(token); ranks >= 0) {
    if (job_ranks != nullptr) *job_ranks = ranks;
    return absl::OkStatus();
  }
  if (caller == Caller::kAdminOrJob && has_admin) {
    return absl::PermissionDeniedError(
        "the token is neither this planner's admin token nor any job's token");
  }
  // Also the answer to the token of a job deleted before the planner's last restart (the
  // planner remembers deleted jobs' tokens in memory only).
  return absl::PermissionDeniedError(
      "the token is no job's on this planner (a wrong token, or its job was deleted before the "
      "planner restarted): send the token CreateJob returned as \"authorization: Bearer "
      "<token>\", or create a new job");
}

// One call of a method that Register serves, as gRPC's reactor of a client-streaming call
// (a unary client's call is one on the wire). Start checks the caller's token before anything
// is read (PreAuthorize) and finishes the call unread when it fails; else it reads the one
// request, admits it (Admit) and hands it to the method's handler, which answers by Reply.
// The request and its parse live on the call's protobuf arena, which starts in a block inside
// the call: a ReportStep request is some fifty small messages, and allocating and freeing each
// of them on the heap was a tenth of the call's cost. The reactor deletes itself in OnDone,
// which gRPC runs after Finish and every reaction.
template <PlannerServiceImpl::Caller caller, typename Request, typename Response>
class PlannerServiceImpl::UnaryCall final : public grpc::ServerReadReactor<PendingRequest<Request>>,
                                            public PlannerServiceImpl::Call {
 public:
  UnaryCall(PlannerServiceImpl* service, const char* method,
            const OnCall<Request, Response>* on_call, grpc::CallbackServerContext* context,
            Response* response)
      : service_(service),
        method_(method),
        on_call_(on_call),
        context_(context),
        response_(response),
        arena_(ArenaOptionsIn(initial_block_)),
        request_(&arena_, JobIdPath<Request>()) {}

  // Refuses the call unread, or starts reading its request.
  void Start() {
    const Clock::time_point start = Clock::now();
    const absl::Status refusal = service_->PreAuthorize<caller>(context_);
    if (!refusal.ok()) {
      service_->Finish(this, method_, start, refusal);
      return;
    }
    this->StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok && context_->IsCancelled()) {  // the call ended before its request came
      Reply(grpc::Status(grpc::StatusCode::CANCELLED, ""));
      return;
    }
    if (!ok) {  // the client half-closed without a request
      service_->Finish(this, method_, Clock::now(),
                       absl::InvalidArgumentError(
                           absl::StrCat(method_, ": the call ended without a request; send one ",
                                        Request::descriptor()->full_name(), " message")));
      return;
    }
    {
      // The request's memory is reserved until the handler returns (one that parks, as
      // GetRankPlan, holds a small request: it is not counted while parked).
      ParseBudget::Hold hold;
      const Request* request = nullptr;
      service_->Guarded(this, method_, [&](Clock::time_point start) {
        absl::StatusOr<const Request*> admitted =
            service_->Admit<caller>(context_, method_, request_, &hold);
        if (admitted.ok()) {
          request = *admitted;
        } else {
          service_->Finish(this, method_, start, admitted.status());
        }
      });
      if (request != nullptr) (*on_call_)(this, context_, request, response_);
    }
    std::function<void()> on_cancel;
    {
      absl::MutexLock lock(&mu_);
      handled_ = true;
      if (cancelled_) on_cancel = std::move(on_cancel_);
    }
    if (on_cancel) on_cancel();  // the cancellation came while the handler ran
  }

  void OnCancel() override {
    std::function<void()> on_cancel;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      if (!handled_) return;  // told once the handler returns (OnReadDone)
      on_cancel = std::move(on_cancel_);
    }
    if (on_cancel) on_cancel();
  }

  void OnDone() override {
    std::function<void()> on_done;
    {
      absl::MutexLock lock(&mu_);
      on_done = std::move(on_done_);
    }
    if (on_done) on_done();
    delete this;
  }

  void Reply(const grpc::Status& status) override {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
    }
    this->Finish(status);
  }

  void OnEnd(std::function<void()> on_cancel, std::function<void()> on_done) override {
    absl::MutexLock lock(&mu_);
    on_cancel_ = std::move(on_cancel);
    on_done_ = std::move(on_done);
  }

 private:
  static google::protobuf::ArenaOptions ArenaOptionsIn(char* block) {
    google::protobuf::ArenaOptions options;
    options.initial_block = block;
    options.initial_block_size = kInitialBlock;
    return options;
  }

  PlannerServiceImpl* const service_;
  const char* const method_;
  const OnCall<Request, Response>* const on_call_;
  grpc::CallbackServerContext* const context_;
  Response* const response_;  // gRPC's, sent by a Reply with OK
  // Bytes: a 16-sample report fits; larger ones take further blocks.
  static constexpr size_t kInitialBlock = 4096;
  alignas(std::max_align_t) char initial_block_[kInitialBlock];
  google::protobuf::Arena arena_;    // after the block it starts in
  PendingRequest<Request> request_;  // after the arena its message is on: destroyed first
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;   // Reply was called
  bool handled_ ABSL_GUARDED_BY(mu_) = false;    // the handler returned
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // OnCancel came
  std::function<void()> on_cancel_ ABSL_GUARDED_BY(mu_);
  std::function<void()> on_done_ ABSL_GUARDED_BY(mu_);
};

template <PlannerServiceImpl::Caller caller, typename Request>
absl::StatusOr<const Request*> PlannerServiceImpl::Admit(grpc::CallbackServerContext* context,
                                                         const char* method,
                                                         const PendingRequest<Request>& request,
                                                         ParseBudget::Hold* hold) {
  // Bytes that are not a Request would fail the parse (gRPC answered that UNIMPLEMENTED, with
  // no message, as if the planner lacked the method).
  if (!request.scan().well_formed) return request.NotA();
  absl::Status status;
  if constexpr (caller == Caller::kAdmin) {
    status = AuthorizeAdmin(context);
  } else if constexpr (caller == Caller::kAdminOrJob) {
    status = AuthorizeAdminOrJob(context, request.scan().job_id);
  } else {
    status = AuthorizeJob(context, request.scan().job_id);
  }
  if (!status.ok()) return status;
  status = parse_budget_.Reserve(request.scan().parsed_bytes, method, hold);
  if (!status.ok()) return status;
  return request.Parse();
}

template <PlannerServiceImpl::Caller caller, typename Request, typename Response>
void PlannerServiceImpl::Register(const char* method, OnCall<Request, Response> on_call) {
  CheckJobIdPath<Request>(method);
  // Shared by the handler's copies, alive as long as the handler (the service).
  auto shared = std::make_shared<const OnCall<Request, Response>>(std::move(on_call));
  const int index = MethodIndex<Request, Response>(method);
  auto handler = [this, method, shared] {
    return new grpc::internal::CallbackClientStreamingHandler<PendingRequest<Request>, Response>(
        [this, method, shared](grpc::CallbackServerContext* context, Response* response) {
          auto* call = new UnaryCall<caller, Request, Response>(this, method, shared.get(), context,
                                                                response);
          call->Start();
          return call;
        });
  };
  // A unary method's server reads its request before the call starts (gRPC registers it with
  // the core so); a streaming method's reads nothing until the reactor asks. MarkMethodStreamed
  // makes the method streaming for the server (what generated "streamed unary" services do:
  // one read, one write), then MarkMethodCallback serves it on the callback API. Each takes
  // ownership of a handler (the second replaces and deletes the first): one each.
  MarkMethodStreamed(index, handler());
  MarkMethodCallback(index, handler());
}

template <PlannerServiceImpl::Caller caller, typename Request, typename Response>
void PlannerServiceImpl::Serve(const char* method,
                               absl::Status (PlannerServiceImpl::*handle)(const Request&,
                                                                          Response*)) {
  Register<caller, Request, Response>(
      method, [this, method, handle](Call* call, grpc::CallbackServerContext*,
                                     const Request* request, Response* response) {
        Guarded(call, method, [&](Clock::time_point start) {
          Finish(call, method, start, (this->*handle)(*request, response));
        });
      });
}

absl::Status PlannerServiceImpl::OnCreateJob(const v1::CreateJobRequest& request,
                                             v1::CreateJobResponse* response) {
  absl::StatusOr<JobSettings> settings = ConfigFromProto(request.config(), options_.limits);
  if (!settings.ok()) return settings.status();
  absl::StatusOr<CreatedJob> job =
      registry_->CreateJob(request.name(), *settings, request.profile());
  if (!job.ok()) return job.status();
  if (options_.metrics != nullptr) {
    options_.metrics->AddJob(job->job_id);
    options_.metrics->SetJobs(registry_->job_count());
  }
  response->set_job_id(job->job_id);
  response->set_job_token(job->job_token);
  *response->mutable_config() = ConfigToProto(job->settings);
  return absl::OkStatus();
}

absl::Status PlannerServiceImpl::OnJoinJob(const v1::JoinJobRequest& request,
                                           v1::JoinJobResponse* response) {
  int64_t rank_next_step = 0;
  auto joined =
      registry_->JoinJob(request.job_id(), request.rank(), &rank_next_step, request.host());
  if (!joined.ok()) return joined.status();
  *response->mutable_config() = ConfigToProto(joined->first);
  response->set_next_step(joined->second);
  response->set_rank_next_step(rank_next_step);
  return absl::OkStatus();
}

absl::Status PlannerServiceImpl::OnSubmitBatch(const v1::SubmitBatchRequest& request,
                                               v1::SubmitBatchResponse* response) {
  // Converted only: the registry checks the batch against the job's config, once.
  absl::StatusOr<std::vector<Sample>> batch = SamplesFromProto(request.samples(), options_.limits);
  if (!batch.ok()) return batch.status();
  const Clock::time_point plan_start = Clock::now();
  absl::StatusOr<SubmitResult> result =
      registry_->SubmitBatch(request.job_id(), request.step(), *batch, request.planned_locally());
  if (!result.ok()) return result.status();
  if (options_.metrics != nullptr) {
    if (!result->repeated) {
      options_.metrics->ObservePlan(request.job_id(), *result->plan, SecondsSince(plan_start),
                                    result->plan->planned_locally ? nullptr : &result->plan_phases);
      options_.metrics->SetExchangeRate(request.job_id(), result->exchange_bytes_per_second);
    }
    if ((!result->repeated && result->plan->planned_locally) || result->switched_to_local) {
      options_.metrics->ObserveLocalPlan(request.job_id(), result->skipped_steps);
    }
  }
  response->set_step(result->step);
  response->mutable_deferred_ids()->Assign(result->deferred_ids.begin(),
                                           result->deferred_ids.end());
  FiguresToProto(*result->plan, response->mutable_figures());
  // Also after a repeat: the first attempt may have planned the step and failed after.
  WakeWaiters(request.job_id(), request.step());
  // Older steps are packed once the waiting ranks have their plans (pack_in_submit false).
  registry_->PackHistory(request.job_id());
  return absl::OkStatus();
}

bool PlannerServiceImpl::TryComplete(const std::shared_ptr<Wait>& wait, int* world_size) {
  bool ready = false;
  absl::StatusOr<std::shared_ptr<const StepPlan>> plan =
      registry_->GetPlan(wait->job_id, wait->step, wait->ranks.front(), &ready, world_size);
  if (!plan.ok()) {
    wait->Complete(plan.status(), nullptr);
    return true;
  }
  if (!ready) return false;
  wait->Complete(absl::OkStatus(), plan->get());
  return true;
}

absl::Status PlannerServiceImpl::Park(const std::shared_ptr<Wait>& wait, int world_size) {
  absl::MutexLock lock(&waiters_mu_);
  if (waiting_ >= options_.max_waiting_calls) {
    return absl::ResourceExhaustedError(
        absl::StrCat(wait->method, ": ", waiting_,
                     " calls are waiting for plans, this planner's limit; ask "
                     "again once the step is submitted"));
  }
  const int per_job = options_.max_waiting_calls_per_job_extra + 2 * world_size;
  int& of_job = waiting_per_job_[wait->job_id];
  if (of_job >= per_job) {
    return absl::ResourceExhaustedError(absl::StrCat(
        wait->method, ": ", of_job, " calls of job ", wait->job_id,
        " are waiting for plans, its limit (2 per rank + ",
        options_.max_waiting_calls_per_job_extra, "); ask again once the step is submitted"));
  }
  if (waiters_[{wait->job_id, wait->step}].insert(wait).second) {
    ++of_job;
    ++waiting_;
    WaitingChanged();
  }
  return absl::OkStatus();
}

void PlannerServiceImpl::Unpark(const std::shared_ptr<Wait>& wait) {
  absl::MutexLock lock(&waiters_mu_);
  auto it = waiters_.find({wait->job_id, wait->step});
  if (it == waiters_.end() || it->second.erase(wait) == 0) return;
  if (it->second.empty()) waiters_.erase(it);
  --waiting_;
  if (--waiting_per_job_[wait->job_id] <= 0) waiting_per_job_.erase(wait->job_id);
  WaitingChanged();
}

void PlannerServiceImpl::Await(Call* call, const std::shared_ptr<Wait>& wait) {
  wait->call = call;
  call->OnEnd(
      [this, wait] {
        Unpark(wait);
        wait->Complete(absl::CancelledError(absl::StrCat(wait->method,
                                                         ": cancelled or past its deadline while "
                                                         "waiting for the step's plan")),
                       nullptr);
      },
      [this, wait] { Unpark(wait); });
}

void PlannerServiceImpl::WakeWaiters(const std::string& job_id, int64_t step) {
  // The step's waiters, and those of every earlier step: a planned_locally submit may skip
  // steps (their ranks ran local plans), whose waiters would otherwise wait for a plan that no
  // longer comes until their deadline, or for ever without one (each holding a place under
  // --max_waiting_calls). They are answered as a fresh call would be: FAILED_PRECONDITION.
  std::vector<std::shared_ptr<Wait>> woken;
  {
    absl::MutexLock lock(&waiters_mu_);
    for (auto it = waiters_.lower_bound({job_id, std::numeric_limits<int64_t>::min()});
         it != waiters_.end() && it->first.first == job_id && it->first.second <= step;) {
      woken.insert(woken.end(), it->second.begin(), it->second.end());
      it = waiters_.erase(it);
    }
    if (woken.empty()) return;
    waiting_ -= static_cast<int>(woken.size());
    if ((waiting_per_job_[job_id] -= static_cast<int>(woken.size())) <= 0) {
      waiting_per_job_.erase(job_id);
    }
    WaitingChanged();
  }
  Complete(std::move(woken));
}

void PlannerServiceImpl::WakeJob(const std::string& job_id, const absl::Status& why) {
  std::vector<std::shared_ptr<Wait>> woken;
  {
    absl::MutexLock lock(&waiters_mu_);
    for (auto it = waiters_.lower_bound({job_id, std::numeric_limits<int64_t>::min()});
         it != waiters_.end() && it->first.first == job_id;) {
      woken.insert(woken.end(), it->second.begin(), it->second.end());
      waiting_ -= static_cast<int>(it->second.size());
      it = waiters_.erase(it);
    }
    waiting_per_job_.erase(job_id);
    WaitingChanged();
  }
  for (const std::shared_ptr<Wait>& wait : woken) wait->Complete(why, nullptr);
}

void PlannerServiceImpl::Forget(const std::string& job_id, const absl::Status& why) {
  WakeJob(job_id, why);  // its waiting ranks learn now, not at their deadline
  if (options_.metrics != nullptr) {
    options_.metrics->ForgetJob(job_id);
    options_.metrics->SetJobs(registry_->job_count());
    // A quarantined job deleted (DeleteJob removes it) is one failed job less.
    options_.metrics->SetFailedJobs(static_cast<int>(registry_->failed_jobs().size()));
  }
}

std::vector<std::string> PlannerServiceImpl::ExpireIdleJobs(std::chrono::nanoseconds ttl) {
  std::vector<std::string> expired = registry_->ExpireIdleJobs(ttl);
  for (const std::string& job_id : expired) {
    Forget(job_id, absl::NotFoundError(
                       absl::StrCat("job \"", job_id,
                                    "\" was deleted: no call carried its token for the planner's "
                                    "--job_idle_ttl; create a new job")));
    if (options_.metrics != nullptr) options_.metrics->ObserveExpiredJob();
  }
  return expired;
}

void PlannerServiceImpl::Complete(std::vector<std::shared_ptr<Wait>> all) {
  // Answering a thousand waiting ranks (building each rank's plan message and sending it) is
  // the longest part of a large step after the planning: split it over two threads.
  if (all.size() < 256) {
    for (const std::shared_ptr<Wait>& wait : all) TryComplete(wait);
    return;
  }
  const size_t half = all.size() / 2;
  std::thread helper([this, &all, half] {
    for (size_t i = half; i < all.size(); ++i) TryComplete(all[i]);
  });
  for (size_t i = 0; i < half; ++i) TryComplete(all[i]);
  helper.join();
}

// One ReportSteps stream. It reads a report, answers it as a ReportStep call would (the same
// token check, handler and metrics, under method "ReportStep"), writes the answer and only
// then reads the next: one report in flight, answers in order. A report's error ends the
// stream with that error as its status. Finish is called once, under mu_: for such an error,
// when the client closes its side or a write fails, or by Close (the drain) when the stream
// waits for a report, else after the report being answered. The reactor deletes itself in
// OnDone, which gRPC runs after Finish and every reaction, and which first takes the service's
// streams_mu_ (CloseReportStreams holds it while it calls Close) and then mu_.
class PlannerServiceImpl::ReportStream final
    : public grpc::ServerBidiReactor<PendingRequest<v1::ReportStepsRequest>,
                                     v1::ReportStepsResponse> {
 public:
  ReportStream(PlannerServiceImpl* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context) {}

  // Starts reading, or ends the stream at once with `refusal`.
  void Start(const absl::Status& refusal) {
    absl::MutexLock lock(&mu_);
    if (!refusal.ok()) {
      service_->Record("ReportSteps", Clock::now(), refusal);
      FinishOnce(refusal);
      return;
    }
    reading_ = true;
    StartRead(&request_);
  }

  void Close(const absl::Status& why) {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    closing_ = why;
    if (reading_) FinishOnce(why);  // the pending read then completes with ok = false
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client closed its side, the call ended, or Close finished it
      absl::MutexLock lock(&mu_);
      FinishOnce(closing_);
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      // Close finished the stream as this read completed: the report goes unanswered (nothing
      // may be written after Finish), and its client sends it again by a unary call.
      if (finished_) return;
      reading_ = false;
    }
    const Clock::time_point start = Clock::now();
    absl::Status status;
    response_.Clear();
    try {
      // As a unary call is admitted (PlannerServiceImpl::Register): the bytes checked, the
      // report's token, its memory, then the parse.
      ParseBudget::Hold hold;
      absl::StatusOr<const v1::ReportStepsRequest*> request =
          service_->Admit<Caller::kJob>(context_, "ReportStep", request_, &hold);
      status = request.status();
      if (status.ok()) {
        status = service_->OnReportStep((*request)->report(), response_.mutable_response());
      }
    } catch (const std::bad_alloc&) {  // as Guarded answers a unary call
      status =
          absl::ResourceExhaustedError("ReportStep: the planner ran out of memory for this call");
      std::cerr << "sb-planner: " << status.message() << std::endl;
    } catch (const std::exception& e) {
      status = absl::InternalError(absl::StrCat("ReportStep: ", e.what()));
      std::cerr << "sb-planner: " << status.message() << std::endl;
    }
    service_->Record("ReportStep", start, status);
    if (!status.ok()) {
      absl::MutexLock lock(&mu_);
      FinishOnce(status);
      return;
    }
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (!ok) {  // the call is gone; Finish releases it
      FinishOnce(absl::CancelledError("ReportSteps: the client went away"));
      return;
    }
    if (!closing_.ok()) {
      FinishOnce(closing_);
      return;
    }
    reading_ = true;
    StartRead(&request_);
  }

  void OnDone() override {
    service_->ForgetReportStream(this);
    { absl::MutexLock lock(&mu_); }  // a Close still inside it has returned
    delete this;
  }

 private:
  void FinishOnce(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(ToGrpcStatus(status));
  }

  PlannerServiceImpl* const service_;
  grpc::CallbackServerContext* const context_;
  // Each report's bytes, read into it again and again (its message on the heap).
  PendingRequest<v1::ReportStepsRequest> request_{nullptr, JobIdPath<v1::ReportStepsRequest>()};
  v1::ReportStepsResponse response_;
  absl::Mutex mu_;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;   // a read is pending: between reports
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // Finish was called
  absl::Status closing_ ABSL_GUARDED_BY(mu_);   // Close's reason, OK until then
};

grpc::ServerBidiReactor<PendingRequest<v1::ReportStepsRequest>, v1::ReportStepsResponse>*
PlannerServiceImpl::OpenReportStream(grpc::CallbackServerContext* context) {
  auto* stream = new ReportStream(this, context);
  // The token first, before any report is read (Register's UnaryCall does the same); each
  // report is then checked against its job (ReportStream::OnReadDone).
  int job_ranks = -1;
  absl::Status refusal = PreAuthorize<Caller::kJob>(context, &job_ranks);
  if (refusal.ok()) {
    // A job's token holds at most its ranks' streams and a few more; the admin token (job_ranks
    // -1) is not counted per token. The token is the key: the stream's job is named by its
    // reports.
    const int per_token_cap =
        job_ranks < 0 ? -1 : job_ranks + std::max(0, options_.max_report_streams_per_job_extra);
    std::string token = per_token_cap < 0 ? std::string() : BearerToken(*context);
    absl::MutexLock lock(&streams_mu_);
    const auto counted = streams_per_token_.find(token);
    const int held = counted == streams_per_token_.end() ? 0 : counted->second;
    if (streams_closed_) {
      refusal = absl::UnavailableError(
          "ReportSteps: the planner is shutting down; report by ReportStep (to its successor)");
    } else if (static_cast<int>(streams_.size()) >= options_.max_report_streams) {
      refusal = WithErrorReason(
          absl::ResourceExhaustedError(absl::StrCat(
              "ReportSteps: ", streams_.size(), " report streams are open, the planner's limit ",
              "(--max_report_streams); report by ReportStep")),
          kReasonReportStreamsFull);
    } else if (per_token_cap >= 0 && held >= per_token_cap) {
      refusal = WithErrorReason(
          absl::ResourceExhaustedError(
              absl::StrCat("ReportSteps: this job's token holds ", held,
                           " report streams open, its limit (the job's ranks plus ",
                           options_.max_report_streams_per_job_extra, "); report by ReportStep")),
          kReasonReportStreamsFull);
    } else {
      if (per_token_cap >= 0) ++streams_per_token_[token];
      streams_.emplace(stream, per_token_cap >= 0 ? std::move(token) : std::string());
      StreamsChanged();
    }
  }
  stream->Start(refusal);
  return stream;
}

void PlannerServiceImpl::ForgetReportStream(ReportStream* stream) {
  absl::MutexLock lock(&streams_mu_);
  const auto it = streams_.find(stream);
  if (it == streams_.end()) return;  // refused at its start: never counted
  if (!it->second.empty()) {
    const auto held = streams_per_token_.find(it->second);
    if (held != streams_per_token_.end() && --held->second <= 0) streams_per_token_.erase(held);
  }
  streams_.erase(it);
  StreamsChanged();
}

int PlannerServiceImpl::report_streams() const {
  absl::MutexLock lock(&streams_mu_);
  return static_cast<int>(streams_.size());
}

void PlannerServiceImpl::CloseReportStreams() {
  absl::MutexLock lock(&streams_mu_);
  streams_closed_ = true;
  const absl::Status why = absl::UnavailableError(
      "ReportSteps: the planner is shutting down; report by ReportStep (to its successor)");
  for (const auto& [stream, token] : streams_) stream->Close(why);
}

void PlannerServiceImpl::WaitingChanged() {
  if (options_.metrics != nullptr) options_.metrics->SetWaitingCalls(waiting_);
}

void PlannerServiceImpl::StreamsChanged() {
  if (options_.metrics != nullptr) {
    options_.metrics->SetReportStreams(static_cast<int>(streams_.size()));
  }
}

int PlannerServiceImpl::waiting_calls() const {
  absl::MutexLock lock(&waiters_mu_);
  return waiting_;
}

void PlannerServiceImpl::OnGetRankPlan(Call* call, const v1::GetRankPlanRequest* request,
                                       v1::GetRankPlanResponse* response) {
  Guarded(call, "GetRankPlan", [&](Clock::time_point start) {
    auto wait = std::make_shared<Wait>();
    wait->service = this;
    wait->start = start;
    wait->job_id = request->job_id();
    wait->step = request->step();
    wait->ranks = {request->rank()};
    wait->response = response;
    Await(call, wait);
    int world_size = 0;
    if (TryComplete(wait, &world_size)) return;
    if (absl::Status parked = Park(wait, world_size); !parked.ok()) {
      wait->Complete(parked, nullptr);
      return;
    }
    // The step may have been planned (or the job deleted) between the check and parking.
    if (TryComplete(wait)) Unpark(wait);
  });
}

void PlannerServiceImpl::OnGetRankPlans(Call* call, const v1::GetRankPlansRequest* request,
                                        v1::GetRankPlansResponse* response) {
  Guarded(call, "GetRankPlans", [&](Clock::time_point start) {
    const int count = request->ranks_size();
    if (count < 1 || count > kMaxBatchRanks) {
      Finish(call, "GetRankPlans", start,
             absl::InvalidArgumentError(
                 absl::StrCat("ranks: ", count, " ranks; a call asks for 1 to ", kMaxBatchRanks)));
      return;
    }
    auto wait = std::make_shared<Wait>();
    wait->service = this;
    wait->method = "GetRankPlans";
    wait->start = start;
    wait->job_id = request->job_id();
    wait->step = request->step();
    wait->ranks.assign(request->ranks().begin(), request->ranks().end());
    wait->many = response;
    Await(call, wait);
    // The job, the step and the first rank are checked by the registry's lookup; the other
    // ranks against the job's here, before anything waits.
    int world_size = 0;
    bool ready = false;
    absl::StatusOr<std::shared_ptr<const StepPlan>> plan =
        registry_->GetPlan(wait->job_id, wait->step, wait->ranks.front(), &ready, &world_size);
    if (!plan.ok()) {
      wait->Complete(plan.status(), nullptr);
      return;
    }
    std::vector<int> seen(wait->ranks);
    std::sort(seen.begin(), seen.end());
    for (int k = 0; k < count; ++k) {
      const int r = wait->ranks[k];
      absl::Status bad;
      if (r < 0 || r >= world_size) {
        bad = absl::InvalidArgumentError(
            absl::StrCat("ranks[", k, "]: ", r, " is outside [0, ", world_size, ")"));
      } else if (const auto [lo, hi] = std::equal_range(seen.begin(), seen.end(), r); hi - lo > 1) {
        bad = absl::InvalidArgumentError(
            absl::StrCat("ranks[", k, "]: ", r, " is asked for more than once"));
      }
      if (!bad.ok()) {
        wait->Complete(bad, nullptr);
        return;
      }
    }
    if (ready) {
      wait->Complete(absl::OkStatus(), plan->get());
      return;
    }
    if (absl::Status parked = Park(wait, world_size); !parked.ok()) {
      wait->Complete(parked, nullptr);
      return;
    }
    // The step may have been planned (or the job deleted) between the check and parking.
    if (TryComplete(wait)) Unpark(wait);
    return;
  });
}

absl::Status PlannerServiceImpl::OnReportStep(const v1::ReportStepRequest& request,
                                              v1::ReportStepResponse* response) {
  RankStepReport report = ReportFromProto(request);
  bool switched_to_local = false;
  absl::StatusOr<bool> duplicate = registry_->ReportStep(
      request.job_id(), report.step, report.rank, std::move(report.micro_batches),
      report.wait_seconds, report.planned_locally, &switched_to_local);
  // A rank's report moved the step to the local plan (before the coordinator resubmitted it);
  // counted even when the report itself then failed to be stored: the switch stays.
  if (switched_to_local && options_.metrics != nullptr) {
    options_.metrics->ObserveLocalPlan(request.job_id(), /*skipped_steps=*/0);
  }
  if (!duplicate.ok()) return duplicate.status();
  response->set_duplicate(*duplicate);
  return absl::OkStatus();
}

absl::Status PlannerServiceImpl::OnReportStepBatch(const v1::ReportStepBatchRequest& request,
                                                   v1::ReportStepBatchResponse* response) {
  const int count = request.reports_size();
  if (count < 1 || count > kMaxBatchReports) {
    return absl::InvalidArgumentError(
        absl::StrCat("reports: ", count, " reports; a call carries 1 to ", kMaxBatchReports));
  }
  std::vector<RankStepReport> reports(count);
  for (int k = 0; k < count; ++k) {
    const v1::ReportStepRequest& r = request.reports(k);
    if (!r.job_id().empty() && r.job_id() != request.job_id()) {
      return absl::InvalidArgumentError(
          absl::StrCat("reports[", k, "].job_id: ", Quoted(r.job_id()), " is not the call's job ",
                       request.job_id(), " (leave it empty)"));
    }
    reports[k] = ReportFromProto(r);
  }
  std::vector<JobRegistry::ReportAnswer> answers;
  absl::Status status = registry_->ReportSteps(request.job_id(), reports, &answers);
  // As OnReportStep: a switch to the local plan counts even when its report then failed.
  for (const JobRegistry::ReportAnswer& answer : answers) {
    if (answer.switched_to_local && options_.metrics != nullptr) {
      options_.metrics->ObserveLocalPlan(request.job_id(), /*skipped_steps=*/0);
    }
  }
  if (!status.ok()) {
    if (answers.empty()) return status;  // the job itself (NOT_FOUND)
    const size_t k = answers.size() - 1;
    return WithMessage(status, absl::StrCat("reports[", k, "] (step ", reports[k].step, ", rank ",
                                            reports[k].rank, "): ", status.message(), "; the ", k,
                                            " reports before it were accepted, the ",
                                            reports.size() - k - 1, " after it not looked at"));
  }
  for (const JobRegistry::ReportAnswer& answer : answers) {
    response->add_responses()->set_duplicate(answer.duplicate);
  }
  return absl::OkStatus();
}

absl::Status PlannerServiceImpl::OnUploadProfile(const v1::UploadProfileRequest& request,
                                                 v1::UploadProfileResponse* response) {
  absl::StatusOr<CostCoefficients> fitted =
      registry_->UploadProfile(request.job_id(), request.profile());
  if (!fitted.ok()) return fitted.status();
  absl::StatusOr<ProfileTable> table = ParseProfileTable(request.profile());
  response->set_device(table.ok() ? table->device : "");
  response->set_seconds_per_block(fitted->per_block);
  response->set_seconds_per_token(fitted->per_token);
  response->set_seconds_per_document(fitted->per_sample);
  return absl::OkStatus();
}

absl::Status PlannerServiceImpl::OnUpdateJobConfig(const v1::UpdateJobConfigRequest& request,
                                                   v1::UpdateJobConfigResponse* response) {
  absl::StatusOr<ConfigUpdate> update = ConfigUpdateFromProto(request);
  if (!update.ok()) return update.status();
  absl::StatusOr<JobSettings> now =
      registry_->UpdateJobConfig(request.job_id(), update->values, update->fields);
  if (!now.ok()) return now.status();
  *response->mutable_config() = ConfigToProto(*now);
  return absl::OkStatus();
}

absl::Status PlannerServiceImpl::OnGetJob(const v1::GetJobRequest& request,
                                          v1::GetJobResponse* response) {
  if (request.slowest_ranks() < 0 || request.slowest_ranks() > kMaxSlowestRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("slowest_ranks: ", request.slowest_ranks(), " is outside [0, ",
                     kMaxSlowestRanks, "] (0: the default, ", kDefaultSlowestRanks, ")"));
  }
  absl::StatusOr<JobView> view = registry_->GetJob(request.job_id());
  if (!view.ok()) return view.status();
  SummaryToProto(*view, response->mutable_job());
  const int k = request.slowest_ranks() == 0 ? kDefaultSlowestRanks : request.slowest_ranks();
  for (const SlowRank& slow : SlowestRanks(view->speed_factors, view->hosts.get(), k)) {
    v1::SlowRank* out = response->mutable_job()->add_slowest_ranks();
    out->set_rank(slow.rank);
    out->set_host(slow.host);
    out->set_speed_factor(slow.speed_factor);
  }
  return absl::OkStatus();
}

absl::Status PlannerServiceImpl::OnListJobs(const v1::ListJobsRequest& request,
                                            v1::ListJobsResponse* response) {
  if (request.page_size() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size: ", request.page_size(), " is negative"));
  }
  const int limit =
      request.page_size() == 0 ? options_.default_page_size : std::min(request.page_size(), 1000);
  // The page token is the last job id of the previous page. A page also ends before it passes
  // kListPageBytes (it holds at least one job): a summary carries a speed factor per rank, and a
  // page of 15 jobs of 65,536 ranks (7.9 MB) was more than a client receives by default (4 MiB),
  // and one of 1,000 about 512 MB, built in memory. Jobs are looked up one at a time, so that
  // only the page is held.
  constexpr size_t kListPageBytes = size_t{3} << 20;
  std::string after = request.page_token();
  size_t bytes = 0;
  for (int n = 0; n < limit; ++n) {
    const std::vector<JobView> next = registry_->ListJobs(after, 1);
    if (next.empty()) return absl::OkStatus();
    v1::JobSummary summary;
    SummaryToProto(next.front(), &summary);
    const size_t size = summary.ByteSizeLong() + 8;  // and its tag and length
    if (n > 0 && bytes + size > kListPageBytes) break;
    bytes += size;
    *response->add_jobs() = std::move(summary);
    after = next.front().job_id;
  }
  if (!registry_->ListJobs(after, 1).empty()) response->set_next_page_token(after);
  return absl::OkStatus();
}

absl::Status PlannerServiceImpl::OnDeleteJob(const v1::DeleteJobRequest& request,
                                             v1::DeleteJobResponse* /*response*/) {
  absl::Status deleted = registry_->DeleteJob(request.job_id());
  if (!deleted.ok()) return deleted;
  Forget(request.job_id(),
         absl::NotFoundError(absl::StrCat("job \"", request.job_id(),
                                          "\" was deleted (DeleteJob) while this call waited")));
  return absl::OkStatus();
}

}  // namespace sparsebalance
