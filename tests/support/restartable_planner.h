// A planner service on a loopback port that a test can stop and start again on the same port
// (the same JobRegistry, so jobs survive, as they do across a real restart with its state
// directory), with its Prometheus metrics readable. For client tests of the planner going away
// and coming back (trainer_session_test, balancer_test).
//
//   RestartablePlanner planner;                 // listening on a free port
//   planner.Stop();  ...  planner.Start(planner.port());
//   double steps = planner.Counter("sparsebalance_local_plan_steps_total", job_id);
#ifndef SPARSEBALANCE_TESTS_SUPPORT_RESTARTABLE_PLANNER_H_
#define SPARSEBALANCE_TESTS_SUPPORT_RESTARTABLE_PLANNER_H_

#include <chrono>
#include <memory>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "server/job_registry.h"
#include "server/planner_metrics.h"
#include "server/planner_service.h"
#include "tests/server/test_support.h"

namespace sparsebalance {
namespace test_support {

class RestartablePlanner {
 public:
  RestartablePlanner()
      : metrics_registry_(std::make_shared<prometheus::Registry>()),
        metrics_(metrics_registry_, /*max_rank_series=*/8),
        registry_(JobRegistry::Options{}, CountingHex()),
        service_(&registry_, ServiceOptions(&metrics_)) {
    Start(0);
  }
  ~RestartablePlanner() { Stop(); }
  RestartablePlanner(const RestartablePlanner&) = delete;
  RestartablePlanner& operator=(const RestartablePlanner&) = delete;

  // Listens on `port` (0: a free one, kept for later restarts).
  void Start(int port) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::InsecureServerCredentials(),
                             &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  // Stops listening at once (calls in flight are cancelled); Start(port()) comes back.
  void Stop() {
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now());
      server_->Wait();
      server_.reset();
    }
  }
  int port() const { return port_; }
  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }
  JobRegistry& registry() { return registry_; }
  PlannerServiceImpl& service() { return service_; }

  // The value of counter `name` for job `job_id` (0 when it has no series yet).
  double Counter(const std::string& name, const std::string& job_id) {
    return Value(absl::StrCat(name, "{job_id=\"", job_id, "\"}"));
  }
  // Calls of `method` that ended with code `code` (e.g. "OK"), as sparsebalance_rpcs_total
  // counts them (0 when it has no series yet).
  double Calls(const std::string& method, const std::string& code = "OK") {
    return Value(
        absl::StrCat("sparsebalance_rpcs_total{code=\"", code, "\",method=\"", method, "\"}"));
  }

 private:
  // The value of `series` (name and labels as the text exposition writes them), 0 when absent.
  double Value(const std::string& series) {
    std::ostringstream text;
    prometheus::TextSerializer().Serialize(text, metrics_registry_->Collect());
    const std::string prefix = series + " ";
    std::istringstream lines(text.str());
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind(prefix, 0) == 0) return std::stod(line.substr(prefix.size()));
    }
    return 0;
  }
  static PlannerServiceImpl::Options ServiceOptions(PlannerMetrics* metrics) {
    PlannerServiceImpl::Options options;
    options.metrics = metrics;
    return options;
  }

  std::shared_ptr<prometheus::Registry> metrics_registry_;
  PlannerMetrics metrics_;
  JobRegistry registry_;
  PlannerServiceImpl service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace test_support
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_TESTS_SUPPORT_RESTARTABLE_PLANNER_H_
