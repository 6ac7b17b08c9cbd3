// A real sb-planner child process for tests that kill and restart it: stdout and stderr go to
// a log file, and it counts as started once it prints its "listening on" line (port() then says
// where). Also a grpc.health.v1 check by hand, for tests that watch SERVING/NOT_SERVING.
//
//   absl::StatusOr<std::unique_ptr<PlannerProcess>> planner = PlannerProcess::Start(
//       SB_PLANNER_PATH, {"--listen=127.0.0.1:0", "--state_dir=" + dir}, dir + ".log");
//   ... connect to 127.0.0.1:(*planner)->port() ...
//   (*planner)->Kill();  // SIGKILL and reap
#ifndef SPARSEBALANCE_TESTS_SERVER_PLANNER_PROCESS_H_
#define SPARSEBALANCE_TESTS_SERVER_PLANNER_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

extern char** environ;

namespace sparsebalance::test_process {

// The whole file, or "" when it cannot be read.
inline std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// How a waitpid() status reads in a message: "exit 2", "signal 9".
inline std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("signal ", WTERMSIG(status));
  return absl::StrCat("wait status ", status);
}

// The port after `prefix` on a complete (newline-ended) line of `log`; 0 when there is none.
inline int PortAfter(const std::string& log, const std::string& prefix) {
  const size_t at = log.find(prefix);
  if (at == std::string::npos) return 0;
  const size_t begin = at + prefix.size();
  if (log.find('\n', begin) == std::string::npos) return 0;  // the line is still being written
  size_t end = begin;
  while (end < log.size() && log[end] >= '0' && log[end] <= '9') ++end;
  int port = 0;
  return absl::SimpleAtoi(log.substr(begin, end - begin), &port) ? port : 0;
}

class PlannerProcess {
 public:
  // Spawns `binary` with `args`, its output in `log_path` (truncated), and waits up to
  // `start_timeout_seconds` for its listening line. FAILED_PRECONDITION (with the log) when it
  // exits first, DEADLINE_EXCEEDED when it stays silent (it is killed then).
  static absl::StatusOr<std::unique_ptr<PlannerProcess>> Start(
      const std::string& binary, const std::vector<std::string>& args, const std::string& log_path,
      double start_timeout_seconds = 20.0) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    std::vector<std::string> strings = {binary};
    strings.insert(strings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& s : strings) argv.push_back(s.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, binary.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) {
      return absl::InternalError(absl::StrCat("cannot spawn ", binary, ": errno ", rc));
    }
    std::unique_ptr<PlannerProcess> process(new PlannerProcess(pid, log_path));
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(static_cast<int>(start_timeout_seconds * 1e3));
    while (true) {
      const std::string log = ReadText(log_path);
      process->port_ = PortAfter(log, "listening on 127.0.0.1:");
      if (process->port_ > 0) {
        process->metrics_port_ = PortAfter(log, "metrics on http://127.0.0.1:");
        return process;
      }
      std::string how;
      if (!process->Running(&how)) {
        return absl::FailedPreconditionError(
            absl::StrCat("sb-planner ended (", how, ") before listening: ", ReadText(log_path)));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("sb-planner printed no listening line in ",
                                                        start_timeout_seconds, " s: ", log));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  ~PlannerProcess() { Kill(); }
  PlannerProcess(const PlannerProcess&) = delete;
  PlannerProcess& operator=(const PlannerProcess&) = delete;

  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  const std::string& log_path() const { return log_path_; }

  // False once the process has ended; `how` then says how ("exit 2", "signal 9").
  bool Running(std::string* how) {
    if (pid_ > 0) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        ended_ = DescribeWaitStatus(status);
      }
    }
    if (pid_ > 0) return true;
    if (how != nullptr) *how = ended_;
    return false;
  }

  // SIGKILLs the process (when it still runs) and reaps it.
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    ended_ = DescribeWaitStatus(status);
  }

 private:
  PlannerProcess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}

  pid_t pid_;
  std::string log_path_;
  std::string ended_;
  int port_ = 0;
  int metrics_port_ = 0;
};

// grpc.health.v1.Health/Check of `service` by hand: HealthCheckRequest{service} is field 1 (a
// string), HealthCheckResponse{status} field 1 (an enum). Returns 1 for SERVING, 2 for
// NOT_SERVING, minus the gRPC status code when the call fails.
inline int HealthStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                        double timeout_seconds = 2.0) {
  grpc::GenericStub stub(channel);
  std::string request = "\x0a";
  request.push_back(static_cast<char>(service.size()));
  request += service;
  grpc::Slice slice(request);
  grpc::ByteBuffer send(&slice, 1);
  grpc::ByteBuffer receive;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(static_cast<int>(timeout_seconds * 1e3)));
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &send, &receive,
                 [&](grpc::Status s) {
                   std::lock_guard<std::mutex> lock(mu);
                   status = std::move(s);
                   done = true;
                   cv.notify_one();
                 });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  if (!status.ok()) return -static_cast<int>(status.error_code());
  std::vector<grpc::Slice> slices;
  receive.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : 0;
}

}  // namespace sparsebalance::test_process

#endif  // SPARSEBALANCE_TESTS_SERVER_PLANNER_PROCESS_H_
