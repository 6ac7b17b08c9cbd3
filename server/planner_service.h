// The gRPC face of JobRegistry: sparsebalance.planner.v1.PlannerService on the callback API.
// Each method checks the caller's token, translates the request (proto/wire.h), calls the
// registry and translates the answer back; no logic of its own. GetRankPlan waits for a step
// that is not planned yet without holding a thread: the call parks in PlanWaiters and is
// finished by the SubmitBatch that plans the step, or by its own deadline or cancellation.
//
//   JobRegistry registry(options, RandomHex);
//   PlannerServiceImpl service(&registry, {.admin_token = token});
//   builder.RegisterService(&service);
#ifndef SPARSEBALANCE_SERVER_PLANNER_SERVICE_H_
#define SPARSEBALANCE_SERVER_PLANNER_SERVICE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "server/job_registry.h"
#include "server/planner_metrics.h"
#include "server/request_guard.h"
#include "sparsebalance/planner/v1/planner.grpc.pb.h"

namespace sparsebalance {

class PlannerServiceImpl final : public v1::PlannerService::Service {
 public:
  struct Options {
    // When non-empty, CreateJob, ListJobs and DeleteJob need "authorization: Bearer <it>"
    // (DeleteJob also takes the job's own token).
    std::string admin_token;
    WireLimits limits;
    int default_page_size = 100;
    PlannerMetrics* metrics = nullptr;  // not owned; none when null
    // GetRankPlan calls parked at once, in all and per job (per job: this many plus two per
    // rank); one more is RESOURCE_EXHAUSTED. A parked call holds about 16 KiB.
    int max_waiting_calls = 16384;
    int max_waiting_calls_per_job_extra = 64;
    // ReportSteps streams open at once, in all and per job token (per job: its ranks plus
    // this many, for streams that reconnect before the planner sees the old one end, so that
    // one job's token cannot take every stream); one more is refused with RESOURCE_EXHAUSTED
    // (its client then reports by ReportStep). An open stream holds about 2 KiB.
    int max_report_streams = 16384;
    int max_report_streams_per_job_extra = 16;
    // Memory the requests in hand may take once parsed, all together (estimated from their
    // bytes before any is parsed: server/request_guard.h); a call that would pass it is
    // RESOURCE_EXHAUSTED, before its parse. A full SubmitBatch of 2^20 samples takes about
    // 100 MiB.
    size_t max_request_memory_bytes = size_t{512} << 20;
  };

  // Serves every method of the service on gRPC's callback API (see Serve in the .cc).
  PlannerServiceImpl(JobRegistry* registry, Options options);
  ~PlannerServiceImpl() override;

  // GetRankPlan calls parked now (for tests and metrics).
  int waiting_calls() const;
  // Deletes the jobs idle for `ttl` (JobRegistry::ExpireIdleJobs) as DeleteJob would: their
  // waiting calls get NOT_FOUND saying why, their series go, and they are counted in
  // sparsebalance_jobs_expired_total. Returns their ids. sb-planner calls it periodically.
  std::vector<std::string> ExpireIdleJobs(std::chrono::nanoseconds ttl);
  // ReportSteps streams open now (for tests and metrics).
  int report_streams() const;
  // For the drain: ends every ReportSteps stream with UNAVAILABLE as soon as it is between
  // reports (a report being answered is answered first), and refuses new ones, so that the
  // server's shutdown does not wait on idle streams; their clients report by ReportStep.
  void CloseReportStreams();

  // Whose token a call must carry: its job's, the planner's admin token, or either. (Public
  // only so that the .cc can define member templates over it: GCC checks access there.)
  enum class Caller { kJob, kAdmin, kAdminOrJob };
  // A parked GetRankPlan call and a ReportSteps stream (defined in the .cc).
  struct Wait;
  class ReportStream;

  // A unary call as its method's handler sees it (the reactor of Register, in the .cc): the
  // handler finishes it with Reply, at once or later (GetRankPlan parks it).
  class Call {
   public:
    virtual ~Call() = default;
    // Finishes the call with `status` (and the response, when OK); only the first counts.
    virtual void Reply(const grpc::Status& status) = 0;
    // `on_cancel` runs when the call is cancelled (or passes its deadline), after the handler
    // returned; `on_done` when the call is gone, after its Reply. Set by the handler.
    virtual void OnEnd(std::function<void()> on_cancel, std::function<void()> on_done) = 0;
  };

 private:
  using Clock = std::chrono::steady_clock;

  // The check of a call's caller made before gRPC reads its request (server/request_guard.h):
  // the token alone, since the job the request names is not known yet. OK when the `caller`
  // may be let send its request: a job's token (of some job: live, or deleted lately) or the
  // admin token where it would be accepted, for kAdmin anyone where no admin token is set.
  // Else the status the call is finished with, unread: UNAUTHENTICATED without a token,
  // PERMISSION_DENIED for another. When OK and `job_ranks` is given, it is set to the ranks of
  // the job whose token it is (JobRegistry::TokenJobRanks), or -1 for the admin token.
  template <Caller caller>
  absl::Status PreAuthorize(grpc::CallbackServerContext* context, int* job_ranks = nullptr) const;
  // Admits a call's request (server/request_guard.h): INVALID_ARGUMENT for bytes that are
  // not a Request, the `caller`'s token checked against the job id read off them, the memory
  // the parse takes reserved into `hold` (RESOURCE_EXHAUSTED naming `method` past
  // Options::max_request_memory_bytes), then the parse. The message lives as long as `request`.
  template <Caller caller, typename Request>
  absl::StatusOr<const Request*> Admit(grpc::CallbackServerContext* context, const char* method,
                                       const PendingRequest<Request>& request,
                                       ParseBudget::Hold* hold);
  // A handler of unary calls: it answers the call (Call::Reply) now or later.
  template <typename Request, typename Response>
  using OnCall =
      std::function<void(Call*, grpc::CallbackServerContext*, const Request*, Response*)>;
  // One call of a method Register serves (defined in the .cc).
  template <Caller caller, typename Request, typename Response>
  class UnaryCall;
  // Answers the calls of PlannerService's method `method` (its name in planner.proto) with
  // `on_call`: what the generated CallbackService does for each method, here once for all. A
  // unary method is registered as client-streaming (the same on the wire), so that its call
  // starts before gRPC has read the request: PreAuthorize refuses a caller without a valid
  // token before any of the request is read, and HTTP/2's flow control then holds such a
  // caller to the stream's window (gRPC reads a unary request whole, up to
  // --max_message_bytes, before a unary handler runs). The request read is then admitted
  // (Admit); `on_call` sees only requests that Admit let through, refused ones are recorded
  // and finished with its error. It uses the pieces the generated code uses
  // (MarkMethodCallback, grpc::internal::CallbackClientStreamingHandler), so it follows the
  // installed gRPC the way generated code does; a request or response type that does not
  // match the method's descriptor stops the planner at start-up.
  template <Caller caller, typename Request, typename Response>
  void Register(const char* method, OnCall<Request, Response> on_call);
  // Registers a method answered at once: the call admitted (its `caller`'s token), then `handle`
  // translates the request, calls the registry and fills the response; the call is recorded
  // and finished with the status it returns.
  template <Caller caller, typename Request, typename Response>
  void Serve(const char* method,
             absl::Status (PlannerServiceImpl::*handle)(const Request&, Response*));
  // The methods, in the order of planner.proto. GetRankPlan answers later (it parks).
  absl::Status OnCreateJob(const v1::CreateJobRequest&, v1::CreateJobResponse*);
  absl::Status OnJoinJob(const v1::JoinJobRequest&, v1::JoinJobResponse*);
  absl::Status OnSubmitBatch(const v1::SubmitBatchRequest&, v1::SubmitBatchResponse*);
  void OnGetRankPlan(Call* call, const v1::GetRankPlanRequest* request,
                     v1::GetRankPlanResponse* response);
  void OnGetRankPlans(Call* call, const v1::GetRankPlansRequest* request,
                      v1::GetRankPlansResponse* response);
  absl::Status OnReportStep(const v1::ReportStepRequest&, v1::ReportStepResponse*);
  absl::Status OnReportStepBatch(const v1::ReportStepBatchRequest&, v1::ReportStepBatchResponse*);
  // A new ReportSteps stream's reactor (one refusing it past the cap or while draining).
  grpc::ServerBidiReactor<PendingRequest<v1::ReportStepsRequest>, v1::ReportStepsResponse>*
  OpenReportStream(grpc::CallbackServerContext* context);
  void ForgetReportStream(ReportStream* stream);
  absl::Status OnUploadProfile(const v1::UploadProfileRequest&, v1::UploadProfileResponse*);
  absl::Status OnUpdateJobConfig(const v1::UpdateJobConfigRequest&, v1::UpdateJobConfigResponse*);
  absl::Status OnGetJob(const v1::GetJobRequest&, v1::GetJobResponse*);
  absl::Status OnListJobs(const v1::ListJobsRequest&, v1::ListJobsResponse*);
  absl::Status OnDeleteJob(const v1::DeleteJobRequest&, v1::DeleteJobResponse*);

  // Records the call in the metrics and finishes it with `status`.
  void Finish(Call* call, const char* method, Clock::time_point start, const absl::Status& status);
  void Record(const char* method, Clock::time_point start, const absl::Status& status) const;
  absl::Status AuthorizeJob(grpc::CallbackServerContext* context, const std::string& job_id);
  absl::Status AuthorizeAdmin(grpc::CallbackServerContext* context) const;
  // The admin token, or `job_id`'s own token; where no admin token is configured, the job's own
  // token alone (there is no admin).
  absl::Status AuthorizeAdminOrJob(grpc::CallbackServerContext* context, const std::string& job_id);
  // Finishes every call parked on (job_id, step).
  void WakeWaiters(const std::string& job_id, int64_t step);
  // Finishes every call parked on any step of `job_id` with `why` (a deleted job: NOT_FOUND).
  void WakeJob(const std::string& job_id, const absl::Status& why);
  // What follows a job's deletion: its waiting calls get `why`, its series go.
  void Forget(const std::string& job_id, const absl::Status& why);
  void Complete(std::vector<std::shared_ptr<Wait>> waits);
  // Parks `wait` unless the caps are reached (RESOURCE_EXHAUSTED, naming the cap).
  absl::Status Park(const std::shared_ptr<Wait>& wait, int world_size);
  void Unpark(const std::shared_ptr<Wait>& wait);
  // Makes `call` the one `wait` answers: its cancellation (or deadline) unparks it and answers
  // CANCELLED, and it is unparked when the call is gone.
  void Await(Call* call, const std::shared_ptr<Wait>& wait);
  // The gauges of parked calls and open streams (PlannerMetrics), after each change.
  void WaitingChanged() ABSL_EXCLUSIVE_LOCKS_REQUIRED(waiters_mu_);
  void StreamsChanged() ABSL_EXCLUSIVE_LOCKS_REQUIRED(streams_mu_);
  // Completes `wait` if its plan exists (or can never exist); false if it must keep waiting
  // (then `world_size`, when given, is the job's).
  bool TryComplete(const std::shared_ptr<Wait>& wait, int* world_size = nullptr);

  JobRegistry* const registry_;
  const Options options_;
  ParseBudget parse_budget_{options_.max_request_memory_bytes};
  // Runs a handler's body; an exception that escapes it (std::bad_alloc above all) is logged
  // and finishes the call with RESOURCE_EXHAUSTED or INTERNAL instead of reaching gRPC.
  template <typename Body>
  void Guarded(Call* call, const char* method, Body body);

  mutable absl::Mutex waiters_mu_;
  std::map<std::pair<std::string, int64_t>, std::set<std::shared_ptr<Wait>>> waiters_
      ABSL_GUARDED_BY(waiters_mu_);
  std::map<std::string, int> waiting_per_job_ ABSL_GUARDED_BY(waiters_mu_);
  int waiting_ ABSL_GUARDED_BY(waiters_mu_) = 0;
  // Open ReportSteps streams; each removes itself in its OnDone, under streams_mu_, so a stream
  // listed here is alive while the mutex is held.
  mutable absl::Mutex streams_mu_;
  // Each with the job token it was opened with ("" for the admin token).
  std::map<ReportStream*, std::string> streams_ ABSL_GUARDED_BY(streams_mu_);
  std::map<std::string, int> streams_per_token_ ABSL_GUARDED_BY(streams_mu_);
  bool streams_closed_ ABSL_GUARDED_BY(streams_mu_) = false;
};

// The bearer token of a call's "authorization" metadata, or "" when there is none.
std::string BearerToken(const grpc::CallbackServerContext& context);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SERVER_PLANNER_SERVICE_H_
