// A planner whose answers a test writes, for client tests of answers a real planner gives
// rarely or never: a plan of another rank or step, a plan that breaks the job's config, an error
// such as RESOURCE_EXHAUSTED at its --max_waiting_calls. A gRPC service on a loopback port: each
// call a trainer makes is answered by the function the test set for its method (with the
// request); a method without one answers UNIMPLEMENTED, as the generated base class does.
// `observe`, when set, sees every call first with its bearer token. Set the functions before a
// client calls; `Parse` writes a message from protobuf's text format.
//
//   ScriptedPlanner planner;
//   planner.get_rank_plan = [](const v1::GetRankPlanRequest&, v1::GetRankPlanResponse* out) {
//     *out = ScriptedPlanner::Parse<v1::GetRankPlanResponse>("plan { step: 0 rank: 1 }");
//     return grpc::Status::OK;
//   };
#ifndef SPARSEBALANCE_TESTS_SUPPORT_SCRIPTED_PLANNER_H_
#define SPARSEBALANCE_TESTS_SUPPORT_SCRIPTED_PLANNER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "sparsebalance/planner/v1/planner.grpc.pb.h"

namespace sparsebalance::test_support {

class ScriptedPlanner final : public v1::PlannerService::Service {
 public:
  template <typename Request, typename Response>
  using Answer = std::function<grpc::Status(const Request&, Response*)>;

  ScriptedPlanner() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~ScriptedPlanner() override {
    server_->Shutdown();
    server_->Wait();
  }
  ScriptedPlanner(const ScriptedPlanner&) = delete;
  ScriptedPlanner& operator=(const ScriptedPlanner&) = delete;

  // `text` in protobuf's text format as a `Message` (a test failure when it does not parse).
  template <typename Message>
  static Message Parse(const std::string& text) {
    Message message;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &message)) << text;
    return message;
  }
  // An answer that is always `text` (as Parse reads it).
  template <typename Request, typename Response>
  static Answer<Request, Response> Always(const std::string& text) {
    const Response response = Parse<Response>(text);
    return [response](const Request&, Response* out) {
      *out = response;
      return grpc::Status::OK;
    };
  }
  // An answer that is always the error `code` with `message`.
  template <typename Request, typename Response>
  static Answer<Request, Response> Refuse(grpc::StatusCode code, const std::string& message) {
    return [code, message](const Request&, Response*) { return grpc::Status(code, message); };
  }

  int port() const { return port_; }
  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }
  // Calls of `method` (e.g. "GetRankPlan") answered so far.
  int Calls(const std::string& method) const {
    absl::MutexLock lock(&mu_);
    auto it = calls_.find(method);
    return it == calls_.end() ? 0 : it->second;
  }

  // Called with each call's method, its "authorization: Bearer" token ("" without one) and
  // request, from the service's threads.
  std::function<void(const std::string&, const std::string&, const google::protobuf::Message&)>
      observe;
  Answer<v1::CreateJobRequest, v1::CreateJobResponse> create_job;
  Answer<v1::JoinJobRequest, v1::JoinJobResponse> join_job;
  Answer<v1::SubmitBatchRequest, v1::SubmitBatchResponse> submit_batch;
  Answer<v1::GetRankPlanRequest, v1::GetRankPlanResponse> get_rank_plan;
  Answer<v1::GetRankPlansRequest, v1::GetRankPlansResponse> get_rank_plans;
  Answer<v1::ReportStepRequest, v1::ReportStepResponse> report_step;
  Answer<v1::ReportStepBatchRequest, v1::ReportStepBatchResponse> report_step_batch;

  grpc::Status CreateJob(grpc::ServerContext* context, const v1::CreateJobRequest* request,
                         v1::CreateJobResponse* response) override {
    return Answered(context, "CreateJob", create_job, *request, response);
  }
  grpc::Status JoinJob(grpc::ServerContext* context, const v1::JoinJobRequest* request,
                       v1::JoinJobResponse* response) override {
    return Answered(context, "JoinJob", join_job, *request, response);
  }
  grpc::Status SubmitBatch(grpc::ServerContext* context, const v1::SubmitBatchRequest* request,
                           v1::SubmitBatchResponse* response) override {
    return Answered(context, "SubmitBatch", submit_batch, *request, response);
  }
  grpc::Status GetRankPlan(grpc::ServerContext* context, const v1::GetRankPlanRequest* request,
                           v1::GetRankPlanResponse* response) override {
    return Answered(context, "GetRankPlan", get_rank_plan, *request, response);
  }
  grpc::Status GetRankPlans(grpc::ServerContext* context, const v1::GetRankPlansRequest* request,
                            v1::GetRankPlansResponse* response) override {
    return Answered(context, "GetRankPlans", get_rank_plans, *request, response);
  }
  grpc::Status ReportStep(grpc::ServerContext* context, const v1::ReportStepRequest* request,
                          v1::ReportStepResponse* response) override {
    return Answered(context, "ReportStep", report_step, *request, response);
  }
  grpc::Status ReportStepBatch(grpc::ServerContext* context,
                               const v1::ReportStepBatchRequest* request,
                               v1::ReportStepBatchResponse* response) override {
    return Answered(context, "ReportStepBatch", report_step_batch, *request, response);
  }

 private:
  template <typename Request, typename Response>
  grpc::Status Answered(grpc::ServerContext* context, const std::string& method,
                        const Answer<Request, Response>& answer, const Request& request,
                        Response* response) {
    {
      absl::MutexLock lock(&mu_);
      ++calls_[method];
    }
    if (observe) {
      std::string bearer;
      auto it = context->client_metadata().find("authorization");
      if (it != context->client_metadata().end()) {
        bearer.assign(it->second.data(), it->second.size());
        if (bearer.rfind("Bearer ", 0) == 0) bearer.erase(0, 7);
      }
      observe(method, bearer, request);
    }
    if (!answer) return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, method + ": not scripted");
    return answer(request, response);
  }

  mutable absl::Mutex mu_;
  std::map<std::string, int> calls_ ABSL_GUARDED_BY(mu_);
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace sparsebalance::test_support

#endif  // SPARSEBALANCE_TESTS_SUPPORT_SCRIPTED_PLANNER_H_
