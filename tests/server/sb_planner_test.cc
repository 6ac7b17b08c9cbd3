// sb-planner as a process: it prints where it listens, serves PlannerService and the
// grpc.health.v1 service, and on SIGTERM turns NOT_SERVING, drains and exits 0.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "client/planner_client.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "server/plan_store.h"
#include "sparsebalance/planner/v1/planner.grpc.pb.h"
#include "tests/server/health_check.h"
#include "tests/server/raw_grpc_caller.h"
#include "tests/server/test_support.h"
#include "tests/server/tmpfs_mount.h"
#include "tests/support/scratch_dir.h"
#include "tools/child_process.h"
#include "tools/tool_support.h"

namespace sparsebalance {
namespace {

namespace v1 = ::sparsebalance::planner::v1;
using test_support::HealthStatus;

// GET /metrics over a plain socket.
std::string Scrape(int port) {
  const int fd = test_support::ConnectLoopback(port);
  if (fd < 0) return "";
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return "";
  }
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof buffer)) > 0) response.append(buffer, n);
  close(fd);
  return response;
}

// CreateJob of a job of `world_size` ranks (defaults elsewhere), with a 5-second deadline.
grpc::Status CreateJob(v1::PlannerService::Stub& stub, int world_size,
                       v1::CreateJobResponse* response) {
  v1::CreateJobRequest create;
  create.mutable_config()->set_world_size(world_size);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return stub.CreateJob(&context, create, response);
}

std::string StateDir() { return test_support::ScratchDir("sb_planner") + "/state"; }

// A fresh file for a planner's output.
std::string LogPath() { return test_support::ScratchFile("sb_planner_log"); }

// A report of every non-empty micro-batch of `plan`: fixed times, density and recall.
std::vector<MicroBatchTiming> FixedTimings(const RankStepPlan& plan, double attention_seconds) {
  std::vector<MicroBatchTiming> timings;
  for (size_t m = 0; m < plan.micro_batches.size(); ++m) {
    if (plan.micro_batches[m].samples.empty()) continue;
    MicroBatchTiming t;
    t.micro_batch = static_cast<int>(m);
    t.compute_seconds = 0.5;
    t.attention_seconds = attention_seconds;
    t.tokens = plan.micro_batches[m].tokens;
    t.achieved_density = 0.3;
    t.recall = 0.9;
    timings.push_back(t);
  }
  return timings;
}

// A job of one rank on the planner at `port` (a fresh client with the job's token): created
// with `config`, joined, `samples` documents of 100 tokens submitted, planned and reported.
// What the attack tests ask of a planner once its attackers have gone.
void ExpectAJobRunsOneStep(int port, const PlannerConfig& config, int samples) {
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", port);
  absl::StatusOr<std::unique_ptr<PlannerClient>> client = PlannerClient::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->CreateJob("after-the-attack", config).ok());
  ASSERT_TRUE((*client)->JoinJob(0).ok());
  std::vector<Sample> batch(samples);
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].id = 1000000 + i;
    batch[i].length = 100;
  }
  absl::StatusOr<std::vector<uint64_t>> submitted = (*client)->SubmitBatch(0, batch);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  absl::StatusOr<RankStepPlan> plan = (*client)->GetRankPlan(0, 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<bool> reported = (*client)->ReportStep(0, 0, FixedTimings(*plan, 0.2), 0.0);
  ASSERT_TRUE(reported.ok()) << reported.status();
}

// sb-planner on free loopback ports with a short drain, once it listens; its log is in the
// test's temporary folder (never on `state_dir`'s disk, which a test may remount read-only).
// `extra` flags come last and so win over these.
std::unique_ptr<tools::PlannerProcess> StartPlanner(const std::string& state_dir,
                                                    const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {"--listen=127.0.0.1:0", "--drain_seconds=2",
                                   "--drain_notice_seconds=0.2", "--state_dir=" + state_dir,
                                   "--metrics_listen=127.0.0.1:0"};
  args.insert(args.end(), extra.begin(), extra.end());
  absl::StatusOr<std::unique_ptr<tools::PlannerProcess>> planner =
      tools::PlannerProcess::Start(SB_PLANNER_PATH, args, LogPath());
  EXPECT_TRUE(planner.ok()) << planner.status();
  return planner.ok() ? *std::move(planner) : nullptr;
}

TEST(SbPlannerTest, ServesReportsHealthAndDrainsOnSigterm) {
  std::unique_ptr<tools::PlannerProcess> planner = StartPlanner(StateDir());
  ASSERT_NE(planner, nullptr);
  const int port = planner->port();
  ASSERT_GT(port, 0) << planner->listening_line();
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  EXPECT_EQ(HealthStatus(channel, "sparsebalance.planner.v1.PlannerService"), 1);  // SERVING

  auto stub = v1::PlannerService::NewStub(channel);
  v1::CreateJobResponse job;
  ASSERT_TRUE(CreateJob(*stub, /*world_size=*/4, &job).ok());
  EXPECT_EQ(job.job_token().size(), 64u);
  EXPECT_EQ(job.job_id().size(), 16u);

  const int metrics_port = planner->metrics_port();
  ASSERT_GT(metrics_port, 0) << planner->listening_line();
  const std::string scraped = Scrape(metrics_port);
  EXPECT_NE(scraped.find("sparsebalance_build_info{version=\"0.1.0\"} 1"), std::string::npos)
      << scraped;
  EXPECT_NE(scraped.find("sparsebalance_rpcs_total{code=\"OK\",method=\"CreateJob\"} 1"),
            std::string::npos)
      << scraped;
  EXPECT_NE(scraped.find("sparsebalance_jobs 1"), std::string::npos) << scraped;

  EXPECT_EQ(planner->Stop(), 0);
}

std::string ReadText(const std::string& path) { return tools::ReadFile(path).value_or(""); }

// A rank reporting through the client library holds a ReportSteps stream open between
// reports. The drain ends it (UNAVAILABLE) instead of waiting on it: with a 60 s drain the
// planner still exits by itself, within the 20 s Stop allows before it kills.
TEST(SbPlannerTest, TheDrainEndsOpenReportStreams) {
  std::unique_ptr<tools::PlannerProcess> planner =
      StartPlanner(StateDir(), {"--drain_seconds=60", "--drain_notice_seconds=0.1"});
  ASSERT_NE(planner, nullptr);
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", planner->port());
  options.report_stream = true;
  absl::StatusOr<std::unique_ptr<PlannerClient>> client = PlannerClient::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  PlannerConfig config;
  config.ranks = 1;
  ASSERT_TRUE((*client)->CreateJob("drain", config).ok());
  ASSERT_TRUE((*client)->JoinJob(0).ok());
  std::vector<Sample> batch;
  for (int i = 0; i < 4; ++i) {
    Sample s;
    s.id = static_cast<uint64_t>(i);
    s.length = 1000 + 500 * i;
    batch.push_back(s);
  }
  ASSERT_TRUE((*client)->SubmitBatch(0, batch).ok());
  absl::StatusOr<RankStepPlan> plan = (*client)->GetRankPlan(0, 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<bool> reported = (*client)->ReportStep(0, 0, FixedTimings(*plan, 0.2), 0.0);
  ASSERT_TRUE(reported.ok()) << reported.status();  // the stream is open now, and stays
  EXPECT_EQ(planner->Stop(/*grace_seconds=*/20), 0) << ReadText(planner->log_path());
}

// The sweeper thread of --job_idle_ttl (a period of a tenth of the TTL, at least a second)
// deletes a job nobody calls for, counts it and says so; the planner still stops cleanly.
TEST(SbPlannerTest, AnIdleJobIsDeletedByTheSweeper) {
  std::unique_ptr<tools::PlannerProcess> planner = StartPlanner(StateDir(), {"--job_idle_ttl=1s"});
  ASSERT_NE(planner, nullptr);
  auto stub = v1::PlannerService::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", planner->port()), grpc::InsecureChannelCredentials()));
  v1::CreateJobResponse job;
  ASSERT_TRUE(CreateJob(*stub, /*world_size=*/2, &job).ok());
  const absl::StatusOr<std::string> line = planner->WaitForLine("deleted: idle", 15.0);
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_NE(line->find(job.job_id()), std::string::npos) << *line;
  EXPECT_NE(line->find("--job_idle_ttl=1s"), std::string::npos) << *line;
  const std::string scraped = Scrape(planner->metrics_port());
  EXPECT_NE(scraped.find("sparsebalance_jobs 0"), std::string::npos) << scraped;
  EXPECT_NE(scraped.find("sparsebalance_jobs_expired_total 1"), std::string::npos) << scraped;
  v1::GetJobRequest get;
  get.set_job_id(job.job_id());
  v1::GetJobResponse got;
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer " + job.job_token());
  EXPECT_EQ(stub->GetJob(&context, get, &got).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(planner->Stop(), 0);
}

TEST(SbPlannerTest, MutualTlsAdmitsClientsWithACertificateOnly) {
  // A throwaway CA, a server certificate for localhost/127.0.0.1 and a client certificate.
  const std::string dir = test_support::ScratchDir("sb_tls");
  const std::string script = absl::StrCat(
      "cd ", dir, " && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem ",
      "-days 2 -subj /CN=sb-test-ca && ",
      "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost",
      " && printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > ext.cnf && ",
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem",
      " -days 2 -extfile ext.cnf && ",
      "openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=rank && ",
      "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem",
      " -days 2 2>/dev/null >/dev/null");
  ASSERT_EQ(std::system((script + " 2>/dev/null").c_str()), 0) << "openssl failed";
  std::unique_ptr<tools::PlannerProcess> planner = StartPlanner(
      StateDir(), {"--tls_cert=" + dir + "/server.pem", "--tls_key=" + dir + "/server.key",
                   "--tls_client_ca=" + dir + "/ca.pem", "--health_listen=127.0.0.1:0"});
  ASSERT_NE(planner, nullptr);
  const std::string line = planner->listening_line();
  const int port = planner->port();
  ASSERT_GT(port, 0) << line;
  EXPECT_NE(line.find("(TLS)"), std::string::npos) << line;

  // The plaintext health-only listener (for probes that cannot speak TLS): health, nothing else.
  absl::StatusOr<std::string> health_line = planner->WaitForLine("health only (plaintext) on ");
  ASSERT_TRUE(health_line.ok()) << health_line.status();
  const int health_port =
      tools::PortAfter(*health_line + "\n", "health only (plaintext) on 127.0.0.1:");
  ASSERT_GT(health_port, 0) << *health_line;
  auto health_channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", health_port),
                                            grpc::InsecureChannelCredentials());
  EXPECT_EQ(HealthStatus(health_channel, "sparsebalance.planner.v1.PlannerService"), 1);
  {
    auto stub = v1::PlannerService::NewStub(health_channel);
    v1::CreateJobResponse created;
    EXPECT_EQ(CreateJob(*stub, /*world_size=*/2, &created).error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }

  ClientOptions options;
  options.target = absl::StrCat("localhost:", port);
  options.call_timeout_seconds = 5;
  options.root_certs_pem = ReadText(dir + "/ca.pem");
  options.cert_chain_pem = ReadText(dir + "/client.pem");
  options.private_key_pem = ReadText(dir + "/client.key");
  PlannerConfig config;
  config.ranks = 2;
  absl::StatusOr<std::unique_ptr<PlannerClient>> with_cert = PlannerClient::Connect(options);
  ASSERT_TRUE(with_cert.ok());
  absl::StatusOr<JobHandle> job = (*with_cert)->CreateJob("tls", config);
  EXPECT_TRUE(job.ok()) << job.status();

  options.cert_chain_pem.clear();
  options.private_key_pem.clear();
  absl::StatusOr<std::unique_ptr<PlannerClient>> without_cert = PlannerClient::Connect(options);
  ASSERT_TRUE(without_cert.ok());
  EXPECT_EQ((*without_cert)->CreateJob("tls", config).status().code(),
            absl::StatusCode::kUnavailable);

  options.root_certs_pem.clear();  // plaintext against a TLS planner
  absl::StatusOr<std::unique_ptr<PlannerClient>> plaintext = PlannerClient::Connect(options);
  ASSERT_TRUE(plaintext.ok());
  EXPECT_EQ((*plaintext)->CreateJob("tls", config).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(planner->Stop(), 0);
}

TEST(SbPlannerTest, AKilledPlannerRestartsWithItsJobsAndPlans) {
  const std::string state_dir = StateDir();
  v1::CreateJobResponse job;
  v1::GetRankPlanResponse before;
  v1::SubmitBatchRequest batch;
  {
    std::unique_ptr<tools::PlannerProcess> planner = StartPlanner(state_dir);
    ASSERT_NE(planner, nullptr);
    const int port = planner->port();
    auto stub = v1::PlannerService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
    v1::CreateJobRequest create;
    create.mutable_config()->set_world_size(2);
    grpc::ClientContext c1;
    ASSERT_TRUE(stub->CreateJob(&c1, create, &job).ok());
    batch.set_job_id(job.job_id());
    batch.set_step(0);
    for (int i = 0; i < 10; ++i) {
      v1::Sample* s = batch.add_samples();
      s->set_id(i);
      s->set_length(1000 + 1500 * i);
    }
    v1::SubmitBatchResponse submitted;
    grpc::ClientContext c2;
    c2.AddMetadata("authorization", "Bearer " + job.job_token());
    ASSERT_TRUE(stub->SubmitBatch(&c2, batch, &submitted).ok());
    v1::GetRankPlanRequest get;
    get.set_job_id(job.job_id());
    get.set_rank(1);
    grpc::ClientContext c3;
    c3.AddMetadata("authorization", "Bearer " + job.job_token());
    ASSERT_TRUE(stub->GetRankPlan(&c3, get, &before).ok());
    EXPECT_EQ(planner->Kill(), 128 + SIGKILL);
  }
  std::unique_ptr<tools::PlannerProcess> planner = StartPlanner(state_dir);
  ASSERT_NE(planner, nullptr);
  const int port = planner->port();
  const std::string line = planner->listening_line();
  EXPECT_NE(line.find("(1 jobs reloaded)"), std::string::npos) << line;
  auto stub = v1::PlannerService::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  v1::GetRankPlanRequest get;
  get.set_job_id(job.job_id());
  get.set_rank(1);
  v1::GetRankPlanResponse after;
  grpc::ClientContext c4;
  c4.AddMetadata("authorization", "Bearer " + job.job_token());
  ASSERT_TRUE(stub->GetRankPlan(&c4, get, &after).ok());
  EXPECT_EQ(after.SerializeAsString(), before.SerializeAsString());
  // Step 1 comes next; resubmitting step 0 gives the same answer.
  v1::SubmitBatchResponse again;
  grpc::ClientContext c5;
  c5.AddMetadata("authorization", "Bearer " + job.job_token());
  EXPECT_TRUE(stub->SubmitBatch(&c5, batch, &again).ok());
  EXPECT_EQ(planner->Stop(), 0);
}

// sb-planner run to its exit with its output (stdout and stderr together) and exit code.
std::pair<int, std::string> RunPlanner(const std::string& args) {
  FILE* pipe = popen((std::string(SB_PLANNER_PATH) + " " + args + " 2>&1").c_str(), "r");
  std::string output;
  char buffer[1024];
  while (fgets(buffer, sizeof buffer, pipe) != nullptr) output += buffer;
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

// Issue 11: without --admin_token_file (the container's default, bound to 0.0.0.0) anyone could
// list and delete every job. Beyond loopback a token is now required, or an explicit opt-out.
TEST(SbPlannerTest, RefusesToListenBeyondLoopbackWithoutAnAdminToken) {
  const std::string state = StateDir();
  const auto [code, output] = RunPlanner(
      "--listen=0.0.0.0:0 --metrics_listen=127.0.0.1:0 "
      "--state_dir=" +
      state);
  EXPECT_EQ(code, 2) << output;
  EXPECT_NE(output.find("--admin_token_file"), std::string::npos) << output;
  EXPECT_NE(output.find("--insecure_no_admin_token"), std::string::npos) << output;
  {
    std::unique_ptr<tools::PlannerProcess> planner =
        StartPlanner(state, {"--listen=0.0.0.0:0", "--insecure_no_admin_token"});
    ASSERT_NE(planner, nullptr);
    EXPECT_GT(planner->port(), 0) << planner->listening_line();
    EXPECT_EQ(planner->Stop(), 0);
  }
  const std::string token = state + "-admin";
  std::ofstream(token) << "s3cret\n";
  std::unique_ptr<tools::PlannerProcess> planner =
      StartPlanner(state, {"--listen=0.0.0.0:0", "--admin_token_file=" + token});
  ASSERT_NE(planner, nullptr);
  EXPECT_GT(planner->port(), 0) << planner->listening_line();
  EXPECT_EQ(planner->Stop(), 0);
}

// --plan_threads outside [0, 64] is a usage error naming the flag and its range; in range the
// planner serves (the plans' independence of it: plan_threads_test).
TEST(SbPlannerTest, PlanThreadsOutsideItsRangeIsAUsageError) {
  const std::string state = StateDir();
  for (const char* bad : {"-1", "65"}) {
    const auto [code, output] = RunPlanner(
        std::string("--listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --plan_threads=") + bad +
        " --state_dir=" + state);
    EXPECT_EQ(code, 2) << output;
    EXPECT_NE(output.find(std::string("--plan_threads=") + bad + " is outside [0, 64]"),
              std::string::npos)
        << output;
  }
  std::unique_ptr<tools::PlannerProcess> planner = StartPlanner(state, {"--plan_threads=3"});
  ASSERT_NE(planner, nullptr);
  EXPECT_GT(planner->port(), 0) << planner->listening_line();
  EXPECT_EQ(planner->Stop(), 0);
}

// Every numeric limit outside its range is a usage error naming the flag: --max_jobs=-1,
// --max_world_size=0 and the like started a planner that reported healthy and refused every
// call, --max_message_bytes=-1 lifted gRPC's size limit, --drain_seconds=nan drained for "nan s".
// A transport quota below the largest request (default 256 MiB) would cancel every such request.
TEST(SbPlannerTest, LimitsOutsideTheirRangeAreUsageErrors) {
  const std::string state = StateDir();
  for (const char* bad :
       {"--max_jobs=-1 is outside [1, 1048576]", "--max_world_size=0 is outside [1, 1048576]",
        "--max_samples=-5 is outside [1, 16777216]", "--max_waiting_calls=-1 is outside [0, ",
        "--max_message_bytes=-1 is outside [1024, ", "--max_rank_series=-1 is outside [0, ",
        "--max_request_memory_mb=0 is outside [1, 1048576]",
        "--max_transport_memory_mb=15 is outside [16, 1048576]",
        "--max_transport_memory_mb=255 MiB is less than --max_message_bytes=268435456",
        "--max_job_state_mb=-1 is outside [0, 16777216]",
        "--drain_seconds=nan is not a number of seconds", "--state_check_seconds=-1 is not"}) {
    const std::string flag(bad, std::string(bad).find(' '));
    const auto [code, output] = RunPlanner("--listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 " +
                                           flag + " --state_dir=" + state);
    EXPECT_EQ(code, 2) << flag << ": " << output;
    EXPECT_NE(output.find(bad), std::string::npos) << output;
  }
}

// Issue 11: NOT_SERVING during the drain was visible only on an already open Watch stream (the
// port closed at once). Now health checks see it for --drain_notice_seconds first.
TEST(SbPlannerTest, HealthChecksSeeNotServingDuringTheDrain) {
  std::unique_ptr<tools::PlannerProcess> planner =
      StartPlanner(StateDir(), {"--drain_notice_seconds=5", "--drain_seconds=6"});
  ASSERT_NE(planner, nullptr);
  const int port = planner->port();
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  ASSERT_EQ(HealthStatus(channel, "sparsebalance.planner.v1.PlannerService"), 1);
  planner->Signal(SIGTERM);
  int seen = 1;
  for (int i = 0; i < 2000 && seen == 1; ++i) {  // until it turns (it must before the port closes)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    seen = HealthStatus(channel, "sparsebalance.planner.v1.PlannerService");
  }
  EXPECT_EQ(seen, 2) << "health answered " << seen << " (2: NOT_SERVING; < 0: -code)";
  EXPECT_EQ(planner->Wait(), 0);
}

// Issue 11: the planner started SERVING on a read-only state directory, and a full or
// read-only one answered every call UNAVAILABLE. Now it refuses to start on one, and while it
// runs health follows whether the directory can be written. Needs root for the tmpfs.
TEST(SbPlannerTest, HealthFollowsWhetherTheStateDirCanBeWritten) {
  test_support::TmpfsMount disk("4m");
  if (!disk.mounted()) GTEST_SKIP() << disk.error();
  const std::string state = disk.path() + "/state";
  auto health_until = [](const std::shared_ptr<grpc::Channel>& channel, int want) {
    int seen = 0;
    for (int i = 0; i < 1500 && seen != want; ++i) {  // probes run every 0.2 s
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      seen = HealthStatus(channel, "sparsebalance.planner.v1.PlannerService");
    }
    return seen;
  };
  {
    std::unique_ptr<tools::PlannerProcess> planner =
        StartPlanner(state, {"--state_check_seconds=0.2"});
    ASSERT_NE(planner, nullptr);
    const int port = planner->port();
    auto channel =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    ASSERT_EQ(HealthStatus(channel, "sparsebalance.planner.v1.PlannerService"), 1);
    ASSERT_TRUE(disk.Remount(/*read_only=*/true)) << std::strerror(errno);
    EXPECT_EQ(health_until(channel, 2), 2);
    const std::string scraped = Scrape(planner->metrics_port());
    EXPECT_NE(scraped.find("sparsebalance_state_dir_writable 0"), std::string::npos) << scraped;
    ASSERT_TRUE(disk.Remount(/*read_only=*/false)) << std::strerror(errno);
    EXPECT_EQ(health_until(channel, 1), 1);
    EXPECT_EQ(planner->Stop(), 0);
  }
  ASSERT_TRUE(disk.Remount(/*read_only=*/true)) << std::strerror(errno);
  const auto [code, output] =
      RunPlanner("--listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --state_dir=" + state);
  EXPECT_NE(code, 0) << output;
  EXPECT_NE(output.find("--state_dir"), std::string::npos) << output;
  EXPECT_NE(output.find("Read-only"), std::string::npos) << output;
  disk.Remount(/*read_only=*/false);
}

// GetJob of `job` (with its token): its summary, or a default one when the call fails.
v1::JobSummary GetJob(v1::PlannerService::Stub& stub, const v1::CreateJobResponse& job) {
  v1::GetJobRequest request;
  request.set_job_id(job.job_id());
  v1::GetJobResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  context.AddMetadata("authorization", "Bearer " + job.job_token());
  const grpc::Status status = stub.GetJob(&context, request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response.job();
}

// SubmitBatch of `samples` samples of 100 tokens (ids from `first_id`) as `job`'s step `step`.
grpc::Status SubmitSamples(v1::PlannerService::Stub& stub, const v1::CreateJobResponse& job,
                           int64_t step, int samples, uint64_t first_id) {
  v1::SubmitBatchRequest request;
  request.set_job_id(job.job_id());
  request.set_step(step);
  for (int i = 0; i < samples; ++i) {
    v1::Sample* s = request.add_samples();
    s->set_id(first_id + static_cast<uint64_t>(i));
    s->set_length(100);
  }
  v1::SubmitBatchResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  context.AddMetadata("authorization", "Bearer " + job.job_token());
  return stub.SubmitBatch(&context, request, &response);
}

// The value of the series `name{job_id="<job_id>"}` in a scrape, or -1 when it has none.
double JobSeries(const std::string& scraped, const std::string& name, const std::string& job_id) {
  const std::string key = absl::StrCat(name, "{job_id=\"", job_id, "\"} ");
  const size_t at = scraped.find(key);
  if (at == std::string::npos) return -1;
  double value = -1;
  const size_t end = scraped.find('\n', at);
  EXPECT_TRUE(absl::SimpleAtod(scraped.substr(at + key.size(), end - at - key.size()), &value));
  return value;
}

// Defect: health followed only a 23-byte probe of the state directory, so with 8 KiB left on
// the disk every SubmitBatch failed (its step record did not fit) while health said SERVING
// and sparsebalance_state_dir_writable stayed 1. Now a failed write turns health NOT_SERVING
// and keeps it so while the writes keep failing and while the disk cannot take a write of that
// size; once the disk is freed, the idle planner turns SERVING by itself. Needs root.
TEST(SbPlannerTest, HealthStaysNotServingWhileTheStoresWritesFail) {
  test_support::TmpfsMount disk("4m");
  if (!disk.mounted()) GTEST_SKIP() << disk.error();
  const std::string state = disk.path() + "/state";
  std::unique_ptr<tools::PlannerProcess> planner =
      StartPlanner(state, {"--state_check_seconds=0.2"});
  ASSERT_NE(planner, nullptr);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", planner->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::PlannerService::NewStub(channel);
  const std::string service = "sparsebalance.planner.v1.PlannerService";
  v1::CreateJobResponse job;
  ASSERT_TRUE(CreateJob(*stub, /*world_size=*/8, &job).ok());
  // 4,096 samples a step: a record of some 150 KB.
  ASSERT_TRUE(SubmitSamples(*stub, job, 0, 4096, 0).ok());

  // The disk filled to 8 KiB: room for the probe of old, not for a step record.
  const std::string filler = disk.path() + "/filler";
  const int fd = open(filler.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  const std::string chunk(4096, 'x');
  while (write(fd, chunk.data(), chunk.size()) > 0) {
  }
  const off_t full = lseek(fd, 0, SEEK_END);
  ASSERT_EQ(ftruncate(fd, full - 8192), 0) << std::strerror(errno);
  close(fd);

  // Every submit fails as a store failure, and health is NOT_SERVING (the gauge 0) throughout.
  int failures = 0;
  int serving_seen = 0;
  bool not_serving = false;
  for (int i = 0; i < 30; ++i) {  // 3 s
    const grpc::Status status = SubmitSamples(*stub, job, 1, 4096, 0);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
    EXPECT_EQ(ErrorReason(FromGrpcStatus(status)), kReasonStateDirFailure)
        << status.error_message();
    ++failures;
    // The first failure's flip is published by the health thread: waited for once.
    for (int wait = 0; !not_serving && wait < 100; ++wait) {
      not_serving = HealthStatus(channel, service) == 2;
      if (!not_serving) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ASSERT_TRUE(not_serving) << "health stayed SERVING after a failed SubmitBatch";
    if (HealthStatus(channel, service) != 2) ++serving_seen;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(serving_seen, 0) << "health turned SERVING while " << failures
                             << " submits failed in a row";
  std::string scraped = Scrape(planner->metrics_port());
  EXPECT_NE(scraped.find("sparsebalance_state_dir_writable 0"), std::string::npos) << scraped;

  // Idle, the disk still nearly full: the probes of a record's size fail; NOT_SERVING stays.
  for (int i = 0; i < 10; ++i) {  // 2.5 s
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    EXPECT_EQ(HealthStatus(channel, service), 2) << "after " << (i + 1) * 250 << " ms idle";
  }

  // The disk freed, with no call made: SERVING again, the gauge 1, and the step is planned.
  ASSERT_EQ(unlink(filler.c_str()), 0) << std::strerror(errno);
  int seen = 0;
  for (int i = 0; i < 250 && seen != 1; ++i) {  // probes every second while NOT_SERVING
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    seen = HealthStatus(channel, service);
  }
  EXPECT_EQ(seen, 1);
  scraped = Scrape(planner->metrics_port());
  EXPECT_NE(scraped.find("sparsebalance_state_dir_writable 1"), std::string::npos) << scraped;
  const grpc::Status planned = SubmitSamples(*stub, job, 1, 4096, 0);
  EXPECT_TRUE(planned.ok()) << planned.error_message();
  EXPECT_EQ(planner->Stop(), 0);
}

// The defect: one job's caller filled the state directory shared by every job, and then every
// write failed as a store failure: health NOT_SERVING, every job's calls refused. With
// --max_job_state_mb the job is refused alone (RESOURCE_EXHAUSTED, reason JOB_STATE_QUOTA, the
// job and the flag named), another job goes on planning and reporting, health stays SERVING,
// the job's bytes are in GetJob and the metrics, a restart reloads what it stored with the same
// bytes, and deleting it takes its series away.
TEST(SbPlannerTest, AJobAtItsStateBoundIsRefusedAloneWhileHealthStaysServing) {
  const std::string state_dir = StateDir();
  const std::vector<std::string> flags = {"--max_job_state_mb=1"};
  v1::CreateJobResponse big;
  int64_t refused_step = -1;
  int64_t held = 0;
  {
    std::unique_ptr<tools::PlannerProcess> planner = StartPlanner(state_dir, flags);
    ASSERT_NE(planner, nullptr);
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", planner->port()),
                                       grpc::InsecureChannelCredentials());
    auto stub = v1::PlannerService::NewStub(channel);
    ASSERT_TRUE(CreateJob(*stub, /*world_size=*/8, &big).ok());
    // 4,096 samples a step: a record of some 150 KB, so that a few steps fill 1 MiB.
    for (int64_t step = 0; step < 64 && refused_step < 0; ++step) {
      const grpc::Status status = SubmitSamples(*stub, big, step, 4096, 0);
      if (status.ok()) continue;
      refused_step = step;
      EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << status.error_message();
      EXPECT_TRUE(IsJobStateQuota(FromGrpcStatus(status))) << status.error_message();
      EXPECT_NE(status.error_message().find(absl::StrCat("job \"", big.job_id(), "\"")),
                std::string::npos)
          << status.error_message();
      EXPECT_NE(status.error_message().find("--max_job_state_mb=1"), std::string::npos)
          << status.error_message();
    }
    ASSERT_GE(refused_step, 2);
    EXPECT_EQ(HealthStatus(channel, "sparsebalance.planner.v1.PlannerService"), 1);  // SERVING

    // Another job plans and reports as before, through the client library.
    ClientOptions options;
    options.target = absl::StrCat("127.0.0.1:", planner->port());
    absl::StatusOr<std::unique_ptr<PlannerClient>> client = PlannerClient::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    PlannerConfig config;
    config.ranks = 2;
    ASSERT_TRUE((*client)->CreateJob("small", config).ok());
    for (int r = 0; r < 2; ++r) ASSERT_TRUE((*client)->JoinJob(r).ok());
    for (int64_t step = 0; step < 3; ++step) {
      std::vector<Sample> batch;
      for (int i = 0; i < 8; ++i) {
        Sample s;
        s.id = static_cast<uint64_t>(i);
        s.length = 1000 + 100 * i;
        batch.push_back(s);
      }
      ASSERT_TRUE((*client)->SubmitBatch(step, batch).ok());
      for (int r = 0; r < 2; ++r) {
        absl::StatusOr<RankStepPlan> plan = (*client)->GetRankPlan(step, r);
        ASSERT_TRUE(plan.ok()) << plan.status();
        absl::StatusOr<bool> reported =
            (*client)->ReportStep(step, r, FixedTimings(*plan, 0.0), 0.0);
        ASSERT_TRUE(reported.ok()) << reported.status();
      }
    }
    EXPECT_EQ(HealthStatus(channel, "sparsebalance.planner.v1.PlannerService"), 1);

    const v1::JobSummary summary = GetJob(*stub, big);
    held = summary.state_bytes();
    EXPECT_EQ(summary.next_step(), refused_step);
    EXPECT_EQ(held, test_support::FolderBytes(state_dir + "/" + big.job_id()));
    EXPECT_LE(held, 1 << 20);
    const std::string scraped = Scrape(planner->metrics_port());
    EXPECT_EQ(JobSeries(scraped, "sparsebalance_job_state_bytes", big.job_id()),
              static_cast<double>(held))
        << scraped;
    EXPECT_NE(scraped.find("sparsebalance_job_state_limit_bytes 1048576"), std::string::npos)
        << scraped;
    EXPECT_NE(scraped.find("sparsebalance_state_write_failures_total 0"), std::string::npos)
        << scraped;
    EXPECT_EQ(planner->Kill(), 128 + SIGKILL);
  }
  // Restarted, the job has every step it stored and the same bytes; deleting it removes them and
  // its series.
  std::unique_ptr<tools::PlannerProcess> planner = StartPlanner(state_dir, flags);
  ASSERT_NE(planner, nullptr);
  EXPECT_NE(planner->listening_line().find("(2 jobs reloaded)"), std::string::npos)
      << planner->listening_line();
  auto stub = v1::PlannerService::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", planner->port()), grpc::InsecureChannelCredentials()));
  const v1::JobSummary summary = GetJob(*stub, big);
  EXPECT_EQ(summary.next_step(), refused_step);
  EXPECT_EQ(summary.state_bytes(), held);
  EXPECT_EQ(
      JobSeries(Scrape(planner->metrics_port()), "sparsebalance_job_state_bytes", big.job_id()),
      static_cast<double>(held));
  const grpc::Status again = SubmitSamples(*stub, big, refused_step, 4096, 0);
  EXPECT_TRUE(IsJobStateQuota(FromGrpcStatus(again))) << again.error_message();
  v1::DeleteJobRequest remove;
  remove.set_job_id(big.job_id());
  v1::DeleteJobResponse removed;
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer " + big.job_token());
  ASSERT_TRUE(stub->DeleteJob(&context, remove, &removed).ok());
  EXPECT_EQ(
      JobSeries(Scrape(planner->metrics_port()), "sparsebalance_job_state_bytes", big.job_id()),
      -1);
  EXPECT_EQ(planner->Stop(), 0);
}

// A line of a process's /proc/<pid>/status, in KiB ("VmRSS", "VmHWM"); -1 when it has none.
int64_t ProcStatusKib(pid_t pid, const std::string& key) {
  std::istringstream status(ReadText(absl::StrCat("/proc/", pid, "/status")));
  for (std::string line; std::getline(status, line);) {
    int64_t kib = 0;
    if (absl::StartsWith(line, key + ":") &&
        absl::SimpleAtoi(
            absl::StripAsciiWhitespace(absl::StripSuffix(line.substr(key.size() + 1), "kB")),
            &kib)) {
      return kib;
    }
  }
  return -1;
}

// Defect: gRPC received each request whole before the planner's request guard could look at
// it, with nothing bounding what it held (not even --max_message_bytes, which gRPC checks only
// once a request is whole), so unauthenticated calls that sent all but the last byte of large
// requests and then stalled pinned that much each, for as long as they liked: 16 calls of
// 200 MiB took an idle planner to 3.2 GiB (its pod's limit is 2 GiB). Now gRPC's buffers share
// one quota, --max_transport_memory_mb, whose reclaimer cancels calls past it. Scaled down: 24
// calls over 8 connections, each stalling 1 byte short of a 32 MiB request (768 MiB in all, which
// the planner held before), against a quota of 64 MiB. Then a job of 65,536 samples a step plans
// and reports as usual.
TEST(SbPlannerTest, StalledLargeRequestsStayWithinTheTransportQuota) {
  constexpr int kQuotaMib = 64;
  constexpr uint32_t kMessageBytes = 32 << 20;
  std::unique_ptr<tools::PlannerProcess> planner =
      StartPlanner(StateDir(), {absl::StrCat("--max_message_bytes=", kMessageBytes),
                                absl::StrCat("--max_transport_memory_mb=", kQuotaMib)});
  ASSERT_NE(planner, nullptr);
  const int64_t idle_kib = ProcStatusKib(planner->pid(), "VmRSS");
  ASSERT_GT(idle_kib, 0);
  {
    std::vector<std::unique_ptr<test_support::RawGrpcConnection>> connections;
    for (int c = 0; c < 8; ++c) {
      connections.push_back(test_support::RawGrpcConnection::Connect(planner->port()));
      ASSERT_NE(connections.back(), nullptr);
    }
    std::vector<std::thread> callers;
    for (int i = 0; i < 24; ++i) {
      callers.emplace_back([&connections, i] {
        test_support::RawGrpcConnection& connection = *connections[i % connections.size()];
        const uint32_t stream = connection.StartCall(
            "/sparsebalance.planner.v1.PlannerService/SubmitBatch", kMessageBytes);
        if (stream != 0) connection.SendPayload(stream, kMessageBytes - 1, false, 2.0);
      });
    }
    for (std::thread& caller : callers) caller.join();
    // Measured: 768 MiB more without the quota, 86-117 MiB with it.
    const int64_t grown_mib = (ProcStatusKib(planner->pid(), "VmHWM") - idle_kib) >> 10;
    EXPECT_LT(grown_mib, 4 * kQuotaMib)
        << "the planner's peak grew by " << grown_mib << " MiB while 24 calls sent 32 MiB each";
  }  // the attackers' connections close

  PlannerConfig config;
  config.micro_batches = 64;  // 65,536 samples of 100 tokens in 64 micro-batches of 131,072
  ExpectAJobRunsOneStep(planner->port(), config, 65536);
  EXPECT_EQ(planner->Stop(), 0);
}

// Defect: a unary method's request was read whole by gRPC before the planner could look at the
// call's token, so callers with no token (or a made-up one) could make it hold up to the
// transport quota, which bounds it only softly (1,024 stalled 4 MiB calls over 8 connections
// took a planner to 2.1-2.8 GiB, its pod's limit being 2 GiB). Now the token is checked before
// any of the request is read (PlannerServiceImpl::Register), and such a call is finished at
// once. Scaled down: 48 calls over 8 connections, half without a token and half with a wrong
// one, each trying to send all but 1 byte of an 8 MiB request (384 MiB in all, which the
// planner held before), with a quota too large to bound them. Every call is ended by the
// planner and its peak grows by little; a job's calls then work as usual.
TEST(SbPlannerTest, CallsWithoutAValidTokenAreRefusedBeforeTheirRequestIsRead) {
  constexpr int kCalls = 48;
  constexpr uint32_t kMessageBytes = 8 << 20;
  std::unique_ptr<tools::PlannerProcess> planner = StartPlanner(
      StateDir(),
      {absl::StrCat("--max_message_bytes=", kMessageBytes), "--max_transport_memory_mb=4096"});
  ASSERT_NE(planner, nullptr);
  const int64_t idle_kib = ProcStatusKib(planner->pid(), "VmRSS");
  ASSERT_GT(idle_kib, 0);
  const std::string wrong_token(64, 'a');
  {
    std::vector<std::unique_ptr<test_support::RawGrpcConnection>> connections;
    for (int c = 0; c < 8; ++c) {
      connections.push_back(test_support::RawGrpcConnection::Connect(planner->port()));
      ASSERT_NE(connections.back(), nullptr);
    }
    std::vector<uint32_t> streams(kCalls, 0);
    std::vector<std::thread> callers;
    for (int i = 0; i < kCalls; ++i) {
      callers.emplace_back([&, i] {
        test_support::RawGrpcConnection& connection = *connections[i % connections.size()];
        streams[i] =
            connection.StartCall(i % 4 < 2 ? "/sparsebalance.planner.v1.PlannerService/SubmitBatch"
                                           : "/sparsebalance.planner.v1.PlannerService/ReportSteps",
                                 kMessageBytes, i % 2 == 0 ? "" : wrong_token);
        if (streams[i] != 0)
          connections[i % connections.size()]->SendPayload(streams[i], kMessageBytes - 1, false,
                                                           2.0);
      });
    }
    for (std::thread& caller : callers) caller.join();
    const int64_t grown_mib = (ProcStatusKib(planner->pid(), "VmHWM") - idle_kib) >> 10;
    EXPECT_LT(grown_mib, 64) << "the planner's peak grew by " << grown_mib << " MiB while "
                             << kCalls << " calls without a valid token sent 8 MiB each";
    for (int i = 0; i < kCalls; ++i) {
      EXPECT_TRUE(streams[i] == 0 || connections[i % connections.size()]->Ended(streams[i]))
          << "call " << i << " was not ended by the planner";
    }
  }

  ExpectAJobRunsOneStep(planner->port(), PlannerConfig{}, 1024);
  EXPECT_EQ(planner->Stop(), 0);
}

// Sets an environment variable for its scope: the processes started meanwhile inherit it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() { unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

// An sb-planner whose next fsync of a folder fails (EIO) once the test creates `folder_fault`,
// and whose next fsync of a file fails once it creates `file_fault` (fsync_fault_shim.cc,
// preloaded). Its state probe waits a day: the probe's fsync would take the file fault.
std::unique_ptr<tools::PlannerProcess> StartFaultyPlanner(const std::string& state_dir,
                                                          const std::string& folder_fault,
                                                          const std::string& file_fault) {
  ScopedEnv preload("LD_PRELOAD", SB_FSYNC_FAULT_SHIM_PATH);
  ScopedEnv folder("SB_FAIL_FOLDER_FSYNC", folder_fault);
  ScopedEnv file("SB_FAIL_FILE_FSYNC", file_fault);
  return StartPlanner(state_dir, {"--state_check_seconds=86400"});
}

// A context that carries `job`'s token, with a 10-second deadline.
std::unique_ptr<grpc::ClientContext> JobContext(const v1::CreateJobResponse& job) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  context->AddMetadata("authorization", "Bearer " + job.job_token());
  return context;
}

// A change the planner had made but could not make durable (the folder's fsync failing after the
// rename that replaced a step's record) was answered INTERNAL while the planner kept its old
// state in memory; its restart loaded the change. A refused switch of step 0 to the local plan
// became the plan served after a restart, so the ranks' reports against the plan they had were
// refused; a refused SubmitBatch of step 1 had a plan after it. Now the planner exits with code
// 3 after one line naming the file and the errno (its callers see UNAVAILABLE, an outcome they
// do not know), and restarted it serves what the disk holds, which a repeat of the call gets.
// The same for a join whose joins.log fsync fails and a DeleteJob whose rename is not synced.
TEST(SbPlannerTest, AChangeThatCannotBeMadeDurableEndsThePlannerAndItsRestartServesIt) {
  const std::string state_dir = StateDir();
  const std::string faults = std::filesystem::path(state_dir).parent_path().string();
  const std::string folder_fault = faults + "/fail-folder-fsync";
  const std::string file_fault = faults + "/fail-file-fsync";
  std::unique_ptr<tools::PlannerProcess> planner;
  std::unique_ptr<v1::PlannerService::Stub> stub;
  auto start = [&] {
    planner = StartFaultyPlanner(state_dir, folder_fault, file_fault);
    ASSERT_NE(planner, nullptr);
    stub = v1::PlannerService::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", planner->port()), grpc::InsecureChannelCredentials()));
  };
  // `call` with the fault `fault` armed: the planner ends with its exit code and a line that
  // names `file`.
  auto ends_planner = [&](const std::string& fault, const std::string& file,
                          const std::function<grpc::Status()>& call) {
    std::ofstream(fault) << "armed\n";
    const grpc::Status status = call();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
    EXPECT_EQ(planner->WaitFor(10), kExitStateDirSyncFailed);
    const std::string log = ReadText(planner->log_path());
    EXPECT_NE(log.find("cannot fsync"), std::string::npos) << log;
    EXPECT_NE(log.find(file), std::string::npos) << log;
    EXPECT_NE(log.find("(errno 5)"), std::string::npos) << log;
    EXPECT_FALSE(std::filesystem::exists(fault));
  };
  ASSERT_NO_FATAL_FAILURE(start());
  v1::CreateJobResponse job;
  ASSERT_TRUE(CreateJob(*stub, /*world_size=*/2, &job).ok());
  v1::JoinJobRequest join;
  join.set_job_id(job.job_id());
  v1::JoinJobResponse joined;
  ASSERT_TRUE(stub->JoinJob(JobContext(job).get(), join, &joined).ok());
  auto batch = [&](int64_t step) {
    v1::SubmitBatchRequest request;
    request.set_job_id(job.job_id());
    request.set_step(step);
    for (int i = 0; i < 10; ++i) {
      v1::Sample* s = request.add_samples();
      s->set_id(100 * step + i);
      s->set_length(1000 + 1500 * i);
    }
    return request;
  };
  auto submit = [&](const v1::SubmitBatchRequest& request) {
    v1::SubmitBatchResponse response;
    return stub->SubmitBatch(JobContext(job).get(), request, &response);
  };
  auto rank0_plan = [&](int64_t step) {
    v1::GetRankPlanRequest request;
    request.set_job_id(job.job_id());
    request.set_step(step);
    v1::GetRankPlanResponse response;
    const grpc::Status status = stub->GetRankPlan(JobContext(job).get(), request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.plan();
  };
  ASSERT_TRUE(submit(batch(0)).ok());
  EXPECT_FALSE(rank0_plan(0).planned_locally());

  // Step 0 switched to the local plan: its record is replaced, the folder's fsync fails.
  v1::SubmitBatchRequest local = batch(0);
  local.set_planned_locally(true);
  ends_planner(folder_fault, "step-0.pb", [&] { return submit(local); });
  ASSERT_NO_FATAL_FAILURE(start());
  EXPECT_TRUE(rank0_plan(0).planned_locally());  // what the disk holds
  EXPECT_TRUE(submit(local).ok());               // the repeat gets it

  // Step 1 planned: its new record's folder fsync fails.
  ends_planner(folder_fault, "step-1.pb", [&] { return submit(batch(1)); });
  ASSERT_NO_FATAL_FAILURE(start());
  EXPECT_EQ(GetJob(*stub, job).next_step(), 2);
  EXPECT_TRUE(submit(batch(1)).ok());

  // Rank 1 joins: its record is appended to joins.log, whose fsync fails.
  join.set_rank(1);
  ends_planner(file_fault, "joins.log",
               [&] { return stub->JoinJob(JobContext(job).get(), join, &joined); });
  ASSERT_NO_FATAL_FAILURE(start());
  EXPECT_EQ(GetJob(*stub, job).joined_ranks(), 2);
  EXPECT_TRUE(stub->JoinJob(JobContext(job).get(), join, &joined).ok());

  // The job deleted: its folder is renamed away, the state directory's fsync fails.
  v1::DeleteJobRequest remove;
  remove.set_job_id(job.job_id());
  v1::DeleteJobResponse removed;
  ends_planner(folder_fault, "renaming " + state_dir + "/" + job.job_id(),
               [&] { return stub->DeleteJob(JobContext(job).get(), remove, &removed); });
  ASSERT_NO_FATAL_FAILURE(start());
  v1::GetJobRequest get;
  get.set_job_id(job.job_id());
  v1::GetJobResponse got;
  // The restarted planner knows the job's token no more (it remembers deleted jobs' tokens in
  // memory only): the call is refused before its request is read, saying why it may be so.
  const grpc::Status gone = stub->GetJob(JobContext(job).get(), get, &got);
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::PERMISSION_DENIED) << gone.error_message();
  EXPECT_TRUE(absl::StrContains(gone.error_message(), "its job was deleted"))
      << gone.error_message();
  EXPECT_EQ(planner->Stop(), 0);
}

}  // namespace
}  // namespace sparsebalance
