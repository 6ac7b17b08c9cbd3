// Child processes for the tools and tests that start other binaries: a ChildProcess (spawned
// with its output in files, waited for, stopped with SIGTERM then SIGKILL), and a
// PlannerProcess, an sb-planner child that counts as started once it prints where it listens.
//
//   absl::StatusOr<std::unique_ptr<PlannerProcess>> planner = PlannerProcess::Start(
//       FindToolBinary("sb-planner").value(), {"--listen=127.0.0.1:0"}, "planner.log");
//   ... connect to (*planner)->address() ...
//   int code = (*planner)->Stop();  // SIGTERM, its drain, SIGKILL if it outlasts the grace
#ifndef SPARSEBALANCE_TOOLS_CHILD_PROCESS_H_
#define SPARSEBALANCE_TOOLS_CHILD_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace sparsebalance::tools {

// Where a child's standard output and error go: a path each (empty: inherited from this
// process), appended to or truncated. The same path for both gives one log in order. An
// aggregate: `{log}`, `{log, log}`, `{log, "", /*append=*/false}`.
struct ChildOutput {
  std::string stdout_path = "";
  std::string stderr_path = "";
  bool append = true;
};

// A started process, SIGKILLed and reaped when destroyed while still running. Every live child
// is also in a process-wide list that Fatal() and the StopChildrenOnSignals() handler kill.
// Exit codes read as a shell's: the exit status, or 128 + the signal that ended it.
class ChildProcess {
 public:
  // Spawns args[0] (a path) with args. INVALID_ARGUMENT for no args, INTERNAL when spawning fails.
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(const std::vector<std::string>& args,
                                                             const ChildOutput& output = {});
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }  // -1 once reaped
  // False once it has ended; `how` then says how ("exit 2", "signal 9").
  bool Running(std::string* how = nullptr);
  // Blocks until it ends; its exit code.
  int Wait();
  // Its exit code, or -1 when it still runs after `seconds`.
  int WaitFor(double seconds);
  void Signal(int signal);
  // SIGKILL and reap; the exit code (128 + 9, or how it had ended before).
  int Kill();
  // SIGTERM, then SIGKILL if it still runs after `grace_seconds`; the exit code.
  int Stop(double grace_seconds = 10.0);

 private:
  explicit ChildProcess(pid_t pid) : pid_(pid) {}
  void Reaped(int status);

  pid_t pid_;
  int exit_code_ = -1;
  std::string how_;
};

// An sb-planner child with its stdout and stderr in `log_path` (truncated). Start() returns once
// the planner has printed its "listening on HOST:PORT" line (it serves by then).
class PlannerProcess {
 public:
  // FAILED_PRECONDITION (with the log) when it exits first, DEADLINE_EXCEEDED (it is killed)
  // when it prints no listening line within `start_timeout_seconds`.
  static absl::StatusOr<std::unique_ptr<PlannerProcess>> Start(const std::string& binary,
                                                               const std::vector<std::string>& args,
                                                               const std::string& log_path,
                                                               double start_timeout_seconds = 20.0);

  pid_t pid() const { return process_->pid(); }  // -1 once it has ended
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }       // 0 when the line names none
  const std::string& address() const { return address_; }  // "HOST:PORT"
  const std::string& listening_line() const { return listening_line_; }
  const std::string& log_path() const { return log_path_; }
  // The first complete line of the log that holds `text`, waiting up to `timeout_seconds`.
  absl::StatusOr<std::string> WaitForLine(absl::string_view text, double timeout_seconds = 10.0);

  bool Running(std::string* how = nullptr) { return process_->Running(how); }
  int Wait() { return process_->Wait(); }
  int WaitFor(double seconds) { return process_->WaitFor(seconds); }
  void Signal(int signal) { process_->Signal(signal); }
  int Kill() { return process_->Kill(); }
  int Stop(double grace_seconds = 15.0) { return process_->Stop(grace_seconds); }

 private:
  PlannerProcess(std::unique_ptr<ChildProcess> process, std::string log_path)
      : process_(std::move(process)), log_path_(std::move(log_path)) {}

  std::unique_ptr<ChildProcess> process_;
  std::string log_path_;
  std::string listening_line_;
  std::string address_;
  int port_ = 0;
  int metrics_port_ = 0;
};

// The port after `prefix` on a complete (newline-ended) line of `text`; 0 when there is none.
int PortAfter(absl::string_view text, absl::string_view prefix);

// The path of another SparseBalance binary: in `bin_dir` when given, else next to this one (an
// install: everything in bin/) or in a sibling folder of the build tree (server/, worker/,
// kernels/, sim/, bench/). NOT_FOUND names where it looked.
absl::StatusOr<std::string> FindToolBinary(const std::string& name,
                                           const std::string& bin_dir = "");

// SIGKILLs every live ChildProcess of this process; async-signal-safe.
void KillAllChildren();
// On SIGINT and SIGTERM: KillAllChildren(), then exit 128 + the signal.
void StopChildrenOnSignals();

}  // namespace sparsebalance::tools

#endif  // SPARSEBALANCE_TOOLS_CHILD_PROCESS_H_
