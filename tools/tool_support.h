// What every SparseBalance binary does the same way: one flag convention (Abseil flags,
// --snake_case names), --help set-up, "binary: message" fatal errors and whole-file reads.
//
//   int main(int argc, char** argv) {
//     sparsebalance::tools::InitTool(argc, argv, "sb-x: what it does.\n  sb-x --in=FILE");
//     absl::StatusOr<std::string> text = sparsebalance::tools::ReadFile(absl::GetFlag(FLAGS_in));
//     if (!text.ok()) sparsebalance::tools::Fatal(text.status().message());
#ifndef SPARSEBALANCE_TOOLS_TOOL_SUPPORT_H_
#define SPARSEBALANCE_TOOLS_TOOL_SUPPORT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace sparsebalance::tools {

// Exit codes: a run that failed, and a command line that was wrong (what `--help` fixes).
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// Sets the --help text (`usage`: what the binary does and a command line or two), makes --help
// list this project's flags under the binary's name, and parses the command line. A wrong
// command line ends the process with kExitUsage and a message naming the flag: an unknown flag
// (a name spelled with '-' gets the '_' spelling suggested), a value that does not parse, or a
// positional argument (no binary takes one).
void InitTool(int argc, char** argv, absl::string_view usage);

// The binary's name for messages (argv[0]'s last component; "sparsebalance" before InitTool).
const std::string& ToolName();

// Prints "binary: message" to stderr, stops every child process that child_process.h started
// (SIGKILL) and exits with `exit_code`.
[[noreturn]] void Fatal(absl::string_view message, int exit_code = kExitFailure);
// Fatal(message + " (see binary --help)", kExitUsage): a flag value that parsed but is wrong.
[[noreturn]] void UsageError(absl::string_view message);

// The whole file; NOT_FOUND or PERMISSION_DENIED (or INTERNAL) with a message naming the path.
absl::StatusOr<std::string> ReadFile(const std::string& path);
// Replaces the file with `text`; the error names the path.
absl::Status WriteFile(const std::string& path, absl::string_view text);
// The same for a secret (a job token): the file is created with mode 0600 (made 0600 if it was
// there already) before any byte is written, never readable by others in between as a file
// written first and chmod'ed after was; a symlink at `path` is refused (ELOOP).
absl::Status WritePrivateFile(const std::string& path, absl::string_view text);

// The CPUs this process may use: its affinity mask, and under a cgroup v2 CPU limit (a
// container's `cpus`, a pod's limits.cpu; /sys/fs/cgroup/cpu.max) that limit rounded up.
// std::thread::hardware_concurrency counts the host's, and threads beyond the quota are only
// throttled. At least 1.
int UsableCpus();
// `cpus` capped by the text of a cgroup v2 cpu.max file ("max 100000": no limit, or
// "QUOTA PERIOD" in microseconds: ceil(QUOTA / PERIOD)); anything else leaves `cpus` as it is.
int CpusUnderLimit(int cpus, absl::string_view cpu_max);

}  // namespace sparsebalance::tools

#endif  // SPARSEBALANCE_TOOLS_TOOL_SUPPORT_H_
