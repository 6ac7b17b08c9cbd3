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
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "server/job_registry.h"
#include "server/planner_metrics.h"
#include "sparsebalance/planner/v1/planner.grpc.pb.h"

namespace sparsebalance {

class PlannerServiceImpl final : public v1::PlannerService::CallbackService {
 public:
  struct Options {
    // When non-empty, CreateJob, ListJobs and DeleteJob need "authorization: Bearer <it>".
    std::string admin_token;
    WireLimits limits;
    int default_page_size = 100;
    PlannerMetrics* metrics = nullptr;  // not owned; none when null
    // GetRankPlan calls parked at once, in all and per job (per job: this many plus two per
    // rank); one more is RESOURCE_EXHAUSTED. A parked call holds about 16 KiB.
    int max_waiting_calls = 16384;
    int max_waiting_calls_per_job_extra = 64;
  };

  PlannerServiceImpl(JobRegistry* registry, Options options);
  ~PlannerServiceImpl() override;

  grpc::ServerUnaryReactor* CreateJob(grpc::CallbackServerContext* context,
                                      const v1::CreateJobRequest* request,
                                      v1::CreateJobResponse* response) override;
  grpc::ServerUnaryReactor* JoinJob(grpc::CallbackServerContext* context,
                                    const v1::JoinJobRequest* request,
                                    v1::JoinJobResponse* response) override;
  grpc::ServerUnaryReactor* SubmitBatch(grpc::CallbackServerContext* context,
                                        const v1::SubmitBatchRequest* request,
                                        v1::SubmitBatchResponse* response) override;
  grpc::ServerUnaryReactor* GetRankPlan(grpc::CallbackServerContext* context,
                                        const v1::GetRankPlanRequest* request,
                                        v1::GetRankPlanResponse* response) override;
  grpc::ServerUnaryReactor* ReportStep(grpc::CallbackServerContext* context,
                                       const v1::ReportStepRequest* request,
                                       v1::ReportStepResponse* response) override;
  grpc::ServerUnaryReactor* UploadProfile(grpc::CallbackServerContext* context,
                                          const v1::UploadProfileRequest* request,
                                          v1::UploadProfileResponse* response) override;
  grpc::ServerUnaryReactor* UpdateJobConfig(grpc::CallbackServerContext* context,
                                            const v1::UpdateJobConfigRequest* request,
                                            v1::UpdateJobConfigResponse* response) override;
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* context,
                                   const v1::GetJobRequest* request,
                                   v1::GetJobResponse* response) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* context,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteJob(grpc::CallbackServerContext* context,
                                      const v1::DeleteJobRequest* request,
                                      v1::DeleteJobResponse* response) override;

  // GetRankPlan calls parked now (for tests and metrics).
  int waiting_calls() const;

  // A parked GetRankPlan call (defined in the .cc).
  struct Wait;

 private:
  using Clock = std::chrono::steady_clock;
  // Records the call in the metrics and finishes it with `status`.
  grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, const char* method,
                                   Clock::time_point start, const absl::Status& status);
  void Record(const char* method, Clock::time_point start, const absl::Status& status) const;
  absl::Status AuthorizeJob(grpc::CallbackServerContext* context, const std::string& job_id);
  absl::Status AuthorizeAdmin(grpc::CallbackServerContext* context) const;
  // Finishes every call parked on (job_id, step).
  void WakeWaiters(const std::string& job_id, int64_t step);
  // Finishes every call parked on any step of `job_id` (a deleted job: NOT_FOUND).
  void WakeJob(const std::string& job_id);
  void Complete(std::vector<std::shared_ptr<Wait>> waits);
  // Parks `wait` unless the caps are reached (RESOURCE_EXHAUSTED, naming the cap).
  absl::Status Park(const std::shared_ptr<Wait>& wait, int world_size);
  void Unpark(const std::shared_ptr<Wait>& wait);
  // Completes `wait` if its plan exists (or can never exist); false if it must keep waiting
  // (then `world_size`, when given, is the job's).
  bool TryComplete(const std::shared_ptr<Wait>& wait, int* world_size = nullptr);

  JobRegistry* const registry_;
  const Options options_;
  // Runs a handler's body; an exception that escapes it (std::bad_alloc above all) is logged
  // and finishes the call with RESOURCE_EXHAUSTED or INTERNAL instead of reaching gRPC.
  template <typename Body>
  grpc::ServerUnaryReactor* Guarded(grpc::CallbackServerContext* context, const char* method,
                                    Body body);
  // A unary call (all but GetRankPlan): `authorize()` and then, when it passes, `body()`,
  // which translates the request, calls the registry, fills the response and returns the
  // call's status; the call is recorded and finished with that status.
  template <typename Authorize, typename Body>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context, const char* method,
                                  Authorize authorize, Body body);

  mutable absl::Mutex waiters_mu_;
  std::map<std::pair<std::string, int64_t>, std::set<std::shared_ptr<Wait>>> waiters_
      ABSL_GUARDED_BY(waiters_mu_);
  std::map<std::string, int> waiting_per_job_ ABSL_GUARDED_BY(waiters_mu_);
  int waiting_ ABSL_GUARDED_BY(waiters_mu_) = 0;
};

// The bearer token of a call's "authorization" metadata, or "" when there is none.
std::string BearerToken(const grpc::CallbackServerContext& context);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SERVER_PLANNER_SERVICE_H_
