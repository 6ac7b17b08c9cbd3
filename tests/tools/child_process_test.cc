// tools/child_process.h: children that exit, ignore SIGTERM or never start, and a real
// sb-planner that reports its ports, serves on them and stops on SIGTERM.
#include "tools/child_process.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/support/scratch_dir.h"
#include "tools/tool_support.h"

namespace sparsebalance::tools {
namespace {

using Clock = std::chrono::steady_clock;

std::string TempDir() { return test_support::ScratchDir("child_process"); }

std::unique_ptr<ChildProcess> Shell(const std::string& script, const ChildOutput& output = {}) {
  absl::StatusOr<std::unique_ptr<ChildProcess>> child =
      ChildProcess::Start({"/bin/sh", "-c", script}, output);
  EXPECT_TRUE(child.ok()) << child.status();
  return *std::move(child);
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Whether something accepts TCP connections on 127.0.0.1:port.
bool Accepts(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
  close(fd);
  return ok;
}

TEST(ChildProcessTest, ExitCodeAndBothStreamsInOneLog) {
  const std::string log = TempDir() + "/log";
  std::unique_ptr<ChildProcess> child = Shell("echo out; echo err >&2; exit 3", {log, log});
  EXPECT_EQ(child->Wait(), 3);
  std::string how;
  EXPECT_FALSE(child->Running(&how));
  EXPECT_EQ(how, "exit 3");
  EXPECT_EQ(ReadFile(log).value_or(""), "out\nerr\n");
}

TEST(ChildProcessTest, AppendsOrTruncatesItsOutput) {
  const std::string log = TempDir() + "/log";
  EXPECT_EQ(Shell("echo one", {log})->Wait(), 0);
  EXPECT_EQ(Shell("echo two", {log})->Wait(), 0);
  EXPECT_EQ(ReadFile(log).value_or(""), "one\ntwo\n");
  EXPECT_EQ(Shell("echo three", {log, "", /*append=*/false})->Wait(), 0);
  EXPECT_EQ(ReadFile(log).value_or(""), "three\n");
}

TEST(ChildProcessTest, WaitForGivesUpOnARunningChild) {
  std::unique_ptr<ChildProcess> child = Shell("exec sleep 30");
  EXPECT_EQ(child->WaitFor(0.05), -1);
  EXPECT_TRUE(child->Running());
  EXPECT_EQ(child->Stop(), 128 + SIGTERM);
  EXPECT_FALSE(child->Running());
}

TEST(ChildProcessTest, StopKillsAChildThatIgnoresSigterm) {
  std::unique_ptr<ChildProcess> child = Shell("trap '' TERM; exec sleep 30");
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the trap is set
  const Clock::time_point start = Clock::now();
  EXPECT_EQ(child->Stop(/*grace_seconds=*/0.3), 128 + SIGKILL);
  EXPECT_LT(SecondsSince(start), 10.0);
}

TEST(ChildProcessTest, AProgramThatCannotStartIsAnErrorNamingIt) {
  absl::StatusOr<std::unique_ptr<ChildProcess>> child =
      ChildProcess::Start({"/nonexistent/sb-nothing", "--flag"});
  ASSERT_FALSE(child.ok());
  EXPECT_NE(child.status().message().find("/nonexistent/sb-nothing"), absl::string_view::npos)
      << child.status();
  EXPECT_FALSE(ChildProcess::Start({}).ok());
}

TEST(ChildProcessTest, KillAllChildrenKillsEveryLiveOne) {
  std::unique_ptr<ChildProcess> a = Shell("exec sleep 30");
  std::unique_ptr<ChildProcess> b = Shell("exec sleep 30");
  std::unique_ptr<ChildProcess> done = Shell("exit 0");
  EXPECT_EQ(done->Wait(), 0);
  KillAllChildren();
  EXPECT_EQ(a->Wait(), 128 + SIGKILL);
  EXPECT_EQ(b->Wait(), 128 + SIGKILL);
}

TEST(ChildProcessTest, FatalStopsTheChildren) {
  const std::string pid_file = TempDir() + "/pid";
  EXPECT_EXIT(
      {
        std::unique_ptr<ChildProcess> child = Shell("exec sleep 30");
        WriteFile(pid_file, absl::StrCat(child->pid())).IgnoreError();
        Fatal("giving up", 4);
      },
      ::testing::ExitedWithCode(4), "giving up");
  const int pid = std::atoi(ReadFile(pid_file).value_or("0").c_str());
  ASSERT_GT(pid, 0);
  // Killed (a zombie of the dead test child at most, reaped by init): never still sleeping.
  const Clock::time_point start = Clock::now();
  bool gone = false;
  while (!gone && SecondsSince(start) < 10) {
    const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat")).value_or("");
    gone = stat.empty() || stat.find(") Z") != std::string::npos;
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(gone) << "pid " << pid << " still runs";
}

TEST(PlannerProcessTest, StartsReportsItsPortsServesAndStopsOnSigterm) {
  const std::string dir = TempDir();
  absl::StatusOr<std::unique_ptr<PlannerProcess>> planner = PlannerProcess::Start(
      SB_PLANNER_PATH,
      {"--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0", "--state_dir=" + dir + "/state",
       "--drain_seconds=0.5", "--drain_notice_seconds=0.1"},
      dir + "/planner.log");
  ASSERT_TRUE(planner.ok()) << planner.status();
  const int port = (*planner)->port();
  ASSERT_GT(port, 0) << (*planner)->listening_line();
  EXPECT_EQ((*planner)->address(), absl::StrCat("127.0.0.1:", port));
  EXPECT_GT((*planner)->metrics_port(), 0) << (*planner)->listening_line();
  EXPECT_NE((*planner)->metrics_port(), port);
  EXPECT_TRUE(Accepts(port));
  EXPECT_TRUE(Accepts((*planner)->metrics_port()));
  EXPECT_TRUE((*planner)->Running());
  EXPECT_EQ((*planner)->Stop(), 0);  // SIGTERM: drains and exits 0
  EXPECT_FALSE(Accepts(port));
  absl::StatusOr<std::string> stopped = (*planner)->WaitForLine("sb-planner: stopped", 1.0);
  EXPECT_TRUE(stopped.ok()) << stopped.status();
}

TEST(PlannerProcessTest, APlannerThatExitsFirstIsAnErrorWithItsLog) {
  const std::string dir = TempDir();
  absl::StatusOr<std::unique_ptr<PlannerProcess>> planner = PlannerProcess::Start(
      SB_PLANNER_PATH,
      {"--listen=0.0.0.0:0", "--metrics_listen=127.0.0.1:0", "--state_dir=" + dir + "/state"},
      dir + "/planner.log");
  ASSERT_FALSE(planner.ok());
  EXPECT_EQ(planner.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(planner.status().message().find("exit 2"), absl::string_view::npos) << planner.status();
  EXPECT_NE(planner.status().message().find("--admin_token_file"), absl::string_view::npos)
      << planner.status();
}

TEST(PlannerProcessTest, ASilentProcessTimesOutAndIsKilled) {
  const std::string dir = TempDir();
  const Clock::time_point start = Clock::now();
  absl::StatusOr<std::unique_ptr<PlannerProcess>> planner =
      PlannerProcess::Start("/bin/sleep", {"30"}, dir + "/log", /*start_timeout_seconds=*/0.3);
  ASSERT_FALSE(planner.ok());
  EXPECT_EQ(planner.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(SecondsSince(start), 10.0);
}

TEST(PortAfterTest, ReadsThePortOfACompleteLineOnly) {
  EXPECT_EQ(PortAfter("x: listening on 127.0.0.1:4321 (plaintext)\n", "127.0.0.1:"), 4321);
  EXPECT_EQ(PortAfter("x: listening on 127.0.0.1:4321", "127.0.0.1:"), 0);  // still written
  EXPECT_EQ(PortAfter("nothing here\n", "127.0.0.1:"), 0);
}

TEST(FindToolBinaryTest, FindsInTheGivenFolderAndNamesWhereItLooked) {
  const std::string planner_dir = std::filesystem::path(SB_PLANNER_PATH).parent_path().string();
  absl::StatusOr<std::string> found = FindToolBinary("sb-planner", planner_dir);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_TRUE(std::filesystem::equivalent(*found, SB_PLANNER_PATH));
  absl::StatusOr<std::string> missing = FindToolBinary("sb-no-such-tool", "/nonexistent");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/sb-no-such-tool"),
            absl::string_view::npos)
      << missing.status();
}

}  // namespace
}  // namespace sparsebalance::tools
