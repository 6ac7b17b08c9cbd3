// Directories and files a test writes in (state directories, planner logs, certificates),
// under gtest's TempDir (TEST_TMPDIR, else /tmp). Each is removed when the test program ends,
// unless a test of the program failed: then they are kept and their paths printed, so that
// the failure can be looked into. (Each CTest run left some 800 of them in /tmp before, about
// 70 MB a day of CI runs.)
//
//   const std::string state = test_support::ScratchDir("sb_planner") + "/state";
//   const std::string log = test_support::ScratchFile("sb_planner_log");
#ifndef SPARSEBALANCE_TESTS_SUPPORT_SCRATCH_DIR_H_
#define SPARSEBALANCE_TESTS_SUPPORT_SCRATCH_DIR_H_

#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

#include "gtest/gtest.h"

namespace sparsebalance::test_support {
namespace scratch_internal {

struct Scratch {
  std::mutex mu;
  std::vector<std::string> paths;
  pid_t owner = 0;  // the process that made them
};

// Never destroyed: the exit handler below runs after static destructors may have begun.
inline Scratch& Paths() {
  static Scratch* scratch = new Scratch;
  return *scratch;
}

inline void RemoveAtExit() {
  Scratch& scratch = Paths();
  std::lock_guard<std::mutex> lock(scratch.mu);
  // A death test's forked child (EXPECT_EXIT) exits through here too, with its parent's list:
  // the parent still reads those paths after the child is gone.
  if (getpid() != scratch.owner) return;
  const bool failed = ::testing::UnitTest::GetInstance()->Failed();
  for (const std::string& path : scratch.paths) {
    if (failed) {
      std::fprintf(stderr, "test scratch kept for the failure: %s\n", path.c_str());
      continue;
    }
    std::error_code ignored;  // a path a test removed itself, or a busy mount point
    std::filesystem::remove_all(path, ignored);
  }
  scratch.paths.clear();
}

inline void Keep(const std::string& path) {
  static std::once_flag registered;
  std::call_once(registered, [] { std::atexit(RemoveAtExit); });
  Scratch& scratch = Paths();
  std::lock_guard<std::mutex> lock(scratch.mu);
  if (scratch.owner != getpid()) {  // the first path, or the first made in a death test's child
    scratch.owner = getpid();
    scratch.paths.clear();
  }
  scratch.paths.push_back(path);
}

}  // namespace scratch_internal

// A fresh directory <TempDir>/<prefix>_XXXXXX (mode 0700), removed with what it holds when the
// program ends (above). Aborts the program when it cannot be made: no test can go on.
inline std::string ScratchDir(const std::string& prefix) {
  std::string pattern = ::testing::TempDir() + prefix + "_XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) {
    std::fprintf(stderr, "mkdtemp %s: %s\n", pattern.c_str(), std::strerror(errno));
    std::abort();
  }
  scratch_internal::Keep(pattern);
  return pattern;
}

// A fresh empty file <TempDir>/<prefix>_XXXXXX, removed the same way.
inline std::string ScratchFile(const std::string& prefix) {
  std::string pattern = ::testing::TempDir() + prefix + "_XXXXXX";
  const int fd = mkstemp(pattern.data());
  if (fd < 0) {
    std::fprintf(stderr, "mkstemp %s: %s\n", pattern.c_str(), std::strerror(errno));
    std::abort();
  }
  close(fd);
  scratch_internal::Keep(pattern);
  return pattern;
}

}  // namespace sparsebalance::test_support

#endif  // SPARSEBALANCE_TESTS_SUPPORT_SCRATCH_DIR_H_
