#include "tools/tool_support.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "tools/child_process.h"

namespace sparsebalance::tools {
namespace {

std::string& MutableToolName() {
  static std::string* name = new std::string("sparsebalance");
  return *name;
}

// The flag `name` names on a command line, or null. "noNAME" names the boolean NAME.
absl::CommandLineFlag* FindFlag(absl::string_view name, bool has_value) {
  if (absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name)) return flag;
  if (!has_value && absl::StartsWith(name, "no")) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name.substr(2));
    if (flag != nullptr && flag->IsOfType<bool>()) return flag;
  }
  return nullptr;
}

// Abseil's --help family, handled inside ParseCommandLine rather than registered as flags.
bool IsUsageFlag(absl::string_view name) {
  for (absl::string_view usage : {"help", "helpfull", "helpshort", "helppackage", "helpon",
                                  "helpmatch", "version", "only_check_args"}) {
    if (name == usage) return true;
  }
  return false;
}

// Checks every flag on the command line before Abseil parses it, so that a wrong one ends the
// process with kExitUsage and a message that names it (Abseil's own errors exit 1 and say
// "flag 'x'"). Abseil then parses the same command line; anything not checked here (the
// contents of a --flagfile) is left to it.
void CheckFlags(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") return;
    if (arg.size() < 2 || arg[0] != '-') continue;  // a positional argument: after the parse
    absl::string_view body = arg.substr(arg[1] == '-' ? 2 : 1);
    const size_t eq = body.find('=');
    const absl::string_view name = body.substr(0, eq);
    const bool has_value = eq != absl::string_view::npos;
    if (IsUsageFlag(name)) continue;
    absl::CommandLineFlag* flag = FindFlag(name, has_value);
    if (flag == nullptr) {
      const std::string underscored = absl::StrReplaceAll(name, {{"-", "_"}});
      if (underscored != name && FindFlag(underscored, has_value) != nullptr) {
        UsageError(absl::StrCat("unknown flag --", name, "; flag names are spelled with '_': --",
                                underscored));
      }
      UsageError(absl::StrCat("unknown flag --", name));
    }
    if (flag->IsOfType<bool>() && !has_value) continue;
    std::string value;
    if (has_value) {
      value = std::string(body.substr(eq + 1));
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      UsageError(absl::StrCat("--", name, " needs a value"));
    }
    // Parsing sets the flag; Abseil sets it again to the same value below.
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      UsageError(absl::StrCat("--", name, "=", value, ": ", error));
    }
  }
}

}  // namespace

const std::string& ToolName() { return MutableToolName(); }

void InitTool(int argc, char** argv, absl::string_view usage) {
  if (argc > 0 && argv[0] != nullptr) {
    const absl::string_view self = argv[0];
    MutableToolName() = std::string(self.substr(self.rfind('/') + 1));
  }
  absl::SetProgramUsageMessage(usage);
  // --help lists the flags of this project's sources (Abseil's default looks for a source file
  // named like the binary), under the binary's name rather than a build path.
  absl::FlagsUsageConfig config;
  config.normalize_filename = [](absl::string_view path) {
    return absl::StrContains(path, "absl/") ? std::string(path) : ToolName();
  };
  config.contains_help_flags = [](absl::string_view path) { return path == ToolName(); };
  absl::SetFlagsUsageConfig(config);
  CheckFlags(argc, argv);
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    UsageError(absl::StrCat("unexpected argument \"", positional[1],
                            "\": every input is a flag, like --name=value"));
  }
}

void Fatal(absl::string_view message, int exit_code) {
  std::cerr << ToolName() << ": " << message << std::endl;
  KillAllChildren();
  std::exit(exit_code);
}

void UsageError(absl::string_view message) {
  Fatal(absl::StrCat(message, " (see ", ToolName(), " --help)"), kExitUsage);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int error = errno != 0 ? errno : ENOENT;
    return absl::ErrnoToStatus(error, absl::StrCat("cannot read ", path));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::InternalError(absl::StrCat("cannot read ", path, ": read failed"));
  return text.str();
}

absl::Status WriteFile(const std::string& path, absl::string_view text) {
  errno = 0;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (out) out.write(text.data(), static_cast<std::streamsize>(text.size()));
  if (out) out.close();
  if (!out) {
    return absl::ErrnoToStatus(errno != 0 ? errno : EIO, absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

absl::Status WritePrivateFile(const std::string& path, absl::string_view text) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", path));
  int error = fchmod(fd, 0600) == 0 ? 0 : errno;
  for (size_t done = 0; error == 0 && done < text.size();) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) error = errno;
    if (n > 0) done += static_cast<size_t>(n);
  }
  if (close(fd) != 0 && error == 0) error = errno;
  if (error != 0) return absl::ErrnoToStatus(error, absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

int CpusUnderLimit(int cpus, absl::string_view cpu_max) {
  const std::vector<absl::string_view> fields =
      absl::StrSplit(cpu_max, absl::ByAnyChar(" \n"), absl::SkipEmpty());
  int64_t quota = 0;
  int64_t period = 0;
  if (fields.size() != 2 || !absl::SimpleAtoi(fields[0], &quota) ||
      !absl::SimpleAtoi(fields[1], &period) || quota <= 0 || period <= 0) {
    return cpus;  // "max": no limit (or a file this does not understand)
  }
  return static_cast<int>(std::min<int64_t>(cpus, (quota + period - 1) / period));
}

int UsableCpus() {
  int cpus = static_cast<int>(std::thread::hardware_concurrency());
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = CPU_COUNT(&set);
  if (absl::StatusOr<std::string> max = ReadFile("/sys/fs/cgroup/cpu.max"); max.ok()) {
    cpus = CpusUnderLimit(cpus, *max);
  }
  return std::max(cpus, 1);
}

}  // namespace sparsebalance::tools
