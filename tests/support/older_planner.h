// A planner as an older release serves it, for client tests of the calls added since: a gRPC
// service on a loopback port that forwards the calls a trainer makes (CreateJob, JoinJob,
// SubmitBatch, GetRankPlan, ReportStep) to a real planner, with their metadata and deadlines,
// and answers the newer ones (GetRankPlans, ReportStepBatch, the ReportSteps stream...)
// UNIMPLEMENTED, as the generated base class does for any method a service does not override.
//
//   RestartablePlanner planner;
//   OlderPlanner older(planner.target());
//   ... clients connect to older.target() ...
#ifndef SPARSEBALANCE_TESTS_SUPPORT_OLDER_PLANNER_H_
#define SPARSEBALANCE_TESTS_SUPPORT_OLDER_PLANNER_H_

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "sparsebalance/planner/v1/planner.grpc.pb.h"

namespace sparsebalance::test_support {

class OlderPlanner final : public v1::PlannerService::Service {
 public:
  explicit OlderPlanner(const std::string& planner)
      : stub_(v1::PlannerService::NewStub(
            grpc::CreateChannel(planner, grpc::InsecureChannelCredentials()))) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~OlderPlanner() override {
    server_->Shutdown();
    server_->Wait();
  }
  OlderPlanner(const OlderPlanner&) = delete;
  OlderPlanner& operator=(const OlderPlanner&) = delete;

  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }

  grpc::Status CreateJob(grpc::ServerContext* context, const v1::CreateJobRequest* request,
                         v1::CreateJobResponse* response) override {
    return Forward(&Stub::CreateJob, context, *request, response);
  }
  grpc::Status JoinJob(grpc::ServerContext* context, const v1::JoinJobRequest* request,
                       v1::JoinJobResponse* response) override {
    return Forward(&Stub::JoinJob, context, *request, response);
  }
  grpc::Status SubmitBatch(grpc::ServerContext* context, const v1::SubmitBatchRequest* request,
                           v1::SubmitBatchResponse* response) override {
    return Forward(&Stub::SubmitBatch, context, *request, response);
  }
  grpc::Status GetRankPlan(grpc::ServerContext* context, const v1::GetRankPlanRequest* request,
                           v1::GetRankPlanResponse* response) override {
    return Forward(&Stub::GetRankPlan, context, *request, response);
  }
  grpc::Status ReportStep(grpc::ServerContext* context, const v1::ReportStepRequest* request,
                          v1::ReportStepResponse* response) override {
    return Forward(&Stub::ReportStep, context, *request, response);
  }

 private:
  using Stub = v1::PlannerService::Stub;

  // The call as the client made it: its token and deadline.
  template <typename Request, typename Response>
  grpc::Status Forward(grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                                    Response*),
                       grpc::ServerContext* context, const Request& request, Response* response) {
    grpc::ClientContext forwarded;
    for (const auto& [key, value] : context->client_metadata()) {
      if (key == "authorization") {
        forwarded.AddMetadata(std::string(key.data(), key.size()),
                              std::string(value.data(), value.size()));
      }
    }
    forwarded.set_deadline(context->deadline());
    return (stub_.get()->*method)(&forwarded, request, response);
  }

  std::unique_ptr<Stub> stub_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace sparsebalance::test_support

#endif  // SPARSEBALANCE_TESTS_SUPPORT_OLDER_PLANNER_H_
