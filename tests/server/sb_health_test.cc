// Issue 16, deployment: sb-planner refuses a wrong listen address at start (it used to bind a
// random port for `--listen=:99999`), and sb-health, the container's health check, passes on a
// serving planner and for the whole drain (a drain is not a crash), while readiness turns
// NOT_SERVING as soon as the drain starts.
#include <sys/wait.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "sparsebalance/planner/v1/planner.grpc.pb.h"
#include "tests/support/scratch_dir.h"
#include "tools/child_process.h"

namespace sparsebalance {
namespace {

namespace v1 = ::sparsebalance::planner::v1;
constexpr char kReadiness[] = "sparsebalance.planner.v1.PlannerService";

// `binary args` run to its exit: exit code and output (stdout and stderr together).
std::pair<int, std::string> RunToExit(const std::string& binary, const std::string& args) {
  FILE* pipe = popen((binary + " " + args + " 2>&1").c_str(), "r");
  std::string output;
  char buffer[1024];
  while (fgets(buffer, sizeof buffer, pipe) != nullptr) output += buffer;
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

std::pair<int, std::string> Probe(int port, const std::string& service = "") {
  return RunToExit(SB_HEALTH_PATH, absl::StrCat("--address=127.0.0.1:", port, " --service='",
                                                service, "' --timeout_seconds=5"));
}

std::string TempDir(const char* name) { return test_support::ScratchDir(name); }

TEST(SbPlannerAddressTest, RefusesEveryBadListenAddressNamingTheFlag) {
  const std::string state = TempDir("sb_address") + "/state";
  const std::string good =
      "--listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --state_dir=" + state + " ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--listen=:99999", "--listen=:99999: port 99999 is out of range"},
      {"--listen=127.0.0.1:65536", "--listen=127.0.0.1:65536: port 65536 is out of range"},
      {"--listen=:50151", "--listen=:50151: no host"},
      {"--listen=127.0.0.1", "--listen=127.0.0.1: no port"},
      {"--listen=garbage", "--listen=garbage: no port"},
      {"--listen=::1:50151", "needs brackets: [::1]:50151"},
      {"--listen=300.1.1.1:50151", "300.1.1.1 is not an IPv4 address"},
      {"--listen=127.0.0.1:-1", "port \"-1\" is not a number"},
      {"--metrics_listen=127.0.0.1:99999", "--metrics_listen=127.0.0.1:99999: port 99999"},
      {"--metrics_listen=:9151", "--metrics_listen=:9151: no host"},
      {"--metrics_listen=localhost:9151", "give an IP address, not the name localhost"},
      {"--health_listen=127.0.0.1:123456", "--health_listen=127.0.0.1:123456: port"},
      {"--health_listen=x_y:1", "--health_listen=x_y:1: \"x_y\" is not an IP address"},
  };
  for (const auto& [flag, message] : cases) {
    const auto [code, output] = RunToExit(SB_PLANNER_PATH, good + flag);
    EXPECT_EQ(code, 2) << flag << ": " << output;
    EXPECT_NE(output.find(message), std::string::npos) << flag << ": " << output;
    EXPECT_EQ(output.find("listening on"), std::string::npos) << flag << ": " << output;
  }
}

TEST(SbHealthTest, LivenessPassesThroughTheDrainWhileReadinessFails) {
  absl::StatusOr<std::unique_ptr<tools::PlannerProcess>> started = tools::PlannerProcess::Start(
      SB_PLANNER_PATH,
      {"--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0", "--health_listen=127.0.0.1:0",
       "--state_dir=" + TempDir("sb_health") + "/state", "--drain_seconds=4",
       "--drain_notice_seconds=1"},
      TempDir("sb_health_log") + "/planner.log");
  ASSERT_TRUE(started.ok()) << started.status();
  tools::PlannerProcess& planner = **started;
  absl::StatusOr<std::string> line = planner.WaitForLine("health only (plaintext) on ");
  ASSERT_TRUE(line.ok()) << line.status();
  const int health_port = tools::PortAfter(*line + "\n", "health only (plaintext) on 127.0.0.1:");
  ASSERT_GT(health_port, 0) << *line;
  const int port = planner.port();

  // Serving: liveness and readiness pass on both listeners; an unknown service does not.
  for (int p : {health_port, port}) {
    for (const std::string service : {"", kReadiness}) {
      const auto [code, output] = Probe(p, service);
      EXPECT_EQ(code, 0) << output;
      EXPECT_NE(output.find(": SERVING"), std::string::npos) << output;
    }
  }
  {
    const auto [code, output] = Probe(health_port, "no.such.Service");
    EXPECT_EQ(code, 1) << output;
    EXPECT_NE(output.find("NOT_FOUND"), std::string::npos) << output;
  }
  {
    const auto [code, output] = RunToExit(SB_HEALTH_PATH, "--address=127.0.0.1:99999");
    EXPECT_EQ(code, 2) << output;
    EXPECT_NE(output.find("--address=127.0.0.1:99999: port 99999 is out of range"),
              std::string::npos)
        << output;
  }

  // A call in flight keeps the drain going after the main port closes: a rank waiting for a
  // step that is never submitted (the drain's deadline cancels it).
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  auto stub = v1::PlannerService::NewStub(channel);
  v1::CreateJobRequest create;
  create.mutable_config()->set_world_size(2);
  v1::CreateJobResponse job;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ASSERT_TRUE(stub->CreateJob(&context, create, &job).ok());
  }
  grpc::ClientContext waiting;
  waiting.AddMetadata("authorization", "Bearer " + job.job_token());
  waiting.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::GetRankPlanRequest get;
  get.set_job_id(job.job_id());
  get.set_rank(0);
  v1::GetRankPlanResponse plan;
  grpc::Status waited;
  std::thread waiter([&] { waited = stub->GetRankPlan(&waiting, get, &plan); });

  planner.Signal(SIGTERM);
  // Readiness fails at once (the notice), on the health listener too.
  int code = 0;
  std::string output;
  for (int i = 0; i < 200; ++i) {
    std::tie(code, output) = Probe(health_port, kReadiness);
    if (code != 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(code, 1) << output;
  EXPECT_NE(output.find("NOT_SERVING"), std::string::npos) << output;
  // After the notice the main port closes while the drain goes on ...
  for (int i = 0; i < 400; ++i) {
    std::tie(code, output) = Probe(port);
    if (code != 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(code, 1) << output;
  EXPECT_NE(output.find("no answer"), std::string::npos) << output;
  // ... and liveness on the health listener still passes: Docker must not call it unhealthy.
  std::tie(code, output) = Probe(health_port);
  const bool still_draining = planner.Running();
  EXPECT_TRUE(still_draining) << "the drain ended before the check; nothing was tested";
  EXPECT_EQ(code, 0) << output;
  EXPECT_NE(output.find(": SERVING"), std::string::npos) << output;
  std::tie(code, output) = Probe(health_port, kReadiness);
  EXPECT_EQ(code, 1) << output;

  EXPECT_EQ(planner.Wait(), 0);
  waiter.join();
  EXPECT_FALSE(waited.ok());  // cancelled at the drain's deadline
  // Once the planner has exited, liveness fails: that is what a crash looks like.
  std::tie(code, output) = Probe(health_port);
  EXPECT_EQ(code, 1) << output;
  EXPECT_NE(output.find("no answer"), std::string::npos) << output;
}

}  // namespace
}  // namespace sparsebalance
