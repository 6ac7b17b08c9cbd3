#include "tools/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tools/tool_support.h"

extern char** environ;

namespace sparsebalance::tools {
namespace {

using Clock = std::chrono::steady_clock;

// Live children, for KillAllChildren(): a plain array of atomics, so that a signal handler may
// read it. A slot holds a pid or 0.
constexpr int kMaxChildren = 1024;
std::atomic<pid_t> g_children[kMaxChildren];

void Register(pid_t pid) {
  for (std::atomic<pid_t>& slot : g_children) {
    pid_t empty = 0;
    if (slot.compare_exchange_strong(empty, pid)) return;
  }
}

void Unregister(pid_t pid) {
  for (std::atomic<pid_t>& slot : g_children) {
    pid_t mine = pid;
    if (slot.compare_exchange_strong(mine, 0)) return;
  }
}

void OnStopSignal(int signal) {
  KillAllChildren();
  _exit(128 + signal);
}

int ExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 255;
}

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("signal ", WTERMSIG(status));
  return absl::StrCat("wait status ", status);
}

// The line of `text` that holds `needle`, if that line is complete (newline-ended).
std::string CompleteLineWith(absl::string_view text, absl::string_view needle) {
  const size_t at = text.find(needle);
  if (at == absl::string_view::npos) return "";
  const size_t end = text.find('\n', at);
  if (end == absl::string_view::npos) return "";  // still being written
  const size_t begin = text.rfind('\n', at);
  const size_t start = begin == absl::string_view::npos ? 0 : begin + 1;
  return std::string(text.substr(start, end - start));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(
    const std::vector<std::string>& args, const ChildOutput& output) {
  if (args.empty()) return absl::InvalidArgumentError("no program to start");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  const int mode = O_WRONLY | O_CREAT | (output.append ? O_APPEND : O_TRUNC);
  if (!output.stdout_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, output.stdout_path.c_str(), mode,
                                     0644);
  }
  if (!output.stderr_path.empty()) {
    if (output.stderr_path == output.stdout_path) {
      posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    } else {
      posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, output.stderr_path.c_str(), mode,
                                       0644);
    }
  }
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (std::string& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, copy[0].c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("cannot start ", args[0], ": ", std::strerror(rc)));
  }
  Register(pid);
  return std::unique_ptr<ChildProcess>(new ChildProcess(pid));
}

ChildProcess::~ChildProcess() { Kill(); }

void ChildProcess::Reaped(int status) {
  Unregister(pid_);
  pid_ = -1;
  exit_code_ = ExitCode(status);
  how_ = DescribeWaitStatus(status);
}

bool ChildProcess::Running(std::string* how) {
  if (pid_ > 0) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) Reaped(status);
  }
  if (pid_ > 0) return true;
  if (how != nullptr) *how = how_;
  return false;
}

int ChildProcess::Wait() {
  if (pid_ > 0) {
    int status = 0;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    Reaped(status);
  }
  return exit_code_;
}

int ChildProcess::WaitFor(double seconds) {
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1e3));
  while (Running()) {
    if (Clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return exit_code_;
}

void ChildProcess::Signal(int signal) {
  if (pid_ > 0) kill(pid_, signal);
}

int ChildProcess::Kill() {
  Signal(SIGKILL);
  return Wait();
}

int ChildProcess::Stop(double grace_seconds) {
  Signal(SIGTERM);
  const int code = WaitFor(grace_seconds);
  return code >= 0 ? code : Kill();
}

absl::StatusOr<std::unique_ptr<PlannerProcess>> PlannerProcess::Start(
    const std::string& binary, const std::vector<std::string>& args, const std::string& log_path,
    double start_timeout_seconds) {
  std::vector<std::string> argv = {binary};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<std::unique_ptr<ChildProcess>> child =
      ChildProcess::Start(argv, {log_path, log_path, /*append=*/false});
  if (!child.ok()) return child.status();
  std::unique_ptr<PlannerProcess> planner(new PlannerProcess(*std::move(child), log_path));
  absl::StatusOr<std::string> line = planner->WaitForLine("listening on ", start_timeout_seconds);
  if (!line.ok()) {
    planner->Kill();
    return line.status();
  }
  const size_t start = line->find("listening on ") + 13;
  planner->listening_line_ = *line;
  planner->address_ = line->substr(start, line->find_first_of(" ;", start) - start);
  planner->port_ = PortAfter(planner->address_.substr(planner->address_.rfind(':')) + "\n", ":");
  // "metrics on http://HOST:PORT/metrics"
  const size_t metrics = line->find("metrics on http://");
  if (metrics != std::string::npos) {
    const size_t slash = line->find('/', metrics + 18);
    const size_t colon = line->rfind(':', slash);
    if (colon != std::string::npos && colon > metrics) {
      planner->metrics_port_ = PortAfter(line->substr(colon) + "\n", ":");
    }
  }
  return planner;
}

absl::StatusOr<std::string> PlannerProcess::WaitForLine(absl::string_view text,
                                                        double timeout_seconds) {
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1e3));
  while (true) {
    // Read before checking for an exit: the last lines of a planner that just ended count.
    const bool running = Running();
    const std::string log = ReadFile(log_path_).value_or("");
    if (std::string line = CompleteLineWith(log, text); !line.empty()) return line;
    std::string how;
    if (!running && !Running(&how)) {
      return absl::FailedPreconditionError(
          absl::StrCat("sb-planner ended (", how, ") before printing \"", text, "\": ", log));
    }
    if (Clock::now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("sb-planner printed no \"", text,
                                                      "\" line in ", timeout_seconds, " s: ", log));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int PortAfter(absl::string_view text, absl::string_view prefix) {
  const size_t at = text.find(prefix);
  if (at == absl::string_view::npos) return 0;
  const size_t begin = at + prefix.size();
  if (text.find('\n', begin) == absl::string_view::npos) return 0;  // still being written
  size_t end = begin;
  while (end < text.size() && text[end] >= '0' && text[end] <= '9') ++end;
  int port = 0;
  return absl::SimpleAtoi(text.substr(begin, end - begin), &port) ? port : 0;
}

absl::StatusOr<std::string> FindToolBinary(const std::string& name, const std::string& bin_dir) {
  namespace fs = std::filesystem;
  std::vector<fs::path> candidates;
  if (!bin_dir.empty()) candidates.push_back(fs::path(bin_dir) / name);
  std::error_code error;
  const fs::path self = fs::canonical("/proc/self/exe", error);
  if (!error) {
    const fs::path dir = self.parent_path();
    candidates.push_back(dir / name);  // installed: everything in bin/
    for (const char* sub : {"server", "worker", "kernels", "sim", "bench"}) {
      candidates.push_back(dir.parent_path() / sub / name);  // the build tree
    }
  }
  std::vector<std::string> tried;
  for (const fs::path& p : candidates) {
    if (fs::exists(p, error)) return p.string();
    tried.push_back(p.string());
  }
  return absl::NotFoundError(
      absl::StrCat("cannot find ", name, " (looked for ", absl::StrJoin(tried, ", "), ")"));
}

void KillAllChildren() {
  for (std::atomic<pid_t>& slot : g_children) {
    const pid_t pid = slot.load();
    if (pid > 0) kill(pid, SIGKILL);
  }
}

void StopChildrenOnSignals() {
  signal(SIGINT, OnStopSignal);
  signal(SIGTERM, OnStopSignal);
}

}  // namespace sparsebalance::tools
