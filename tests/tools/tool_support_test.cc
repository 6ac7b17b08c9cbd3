// tools/tool_support.h: the command line a user types (each case in a child process: flags are
// process-wide and the usage message can be set once), fatal errors, and file reads.
#include "tools/tool_support.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "gtest/gtest.h"

ABSL_FLAG(int, test_count, 3, "a number for the tests");
ABSL_FLAG(bool, test_verbose, false, "a switch for the tests");
ABSL_FLAG(std::string, test_name, "", "a string for the tests");

namespace sparsebalance::tools {
namespace {

// InitTool on `args` (argv[0] first), then prints the flags and exits 0.
void InitAndPrint(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  InitTool(static_cast<int>(args.size()), argv.data(),
           "sb-test: a test.\n  sb-test --test_count=N");
  std::cerr << "count=" << absl::GetFlag(FLAGS_test_count)
            << " verbose=" << absl::GetFlag(FLAGS_test_verbose)
            << " name=" << absl::GetFlag(FLAGS_test_name) << std::endl;
  std::exit(0);
}

TEST(InitToolTest, ParsesBothFlagForms) {
  EXPECT_EXIT(
      InitAndPrint({"/bin/sb-test", "--test_count=5", "--test_verbose", "--test_name", "x y"}),
      ::testing::ExitedWithCode(0), "count=5 verbose=1 name=x y");
  EXPECT_EXIT(InitAndPrint({"sb-test", "--test_count", "6", "--notest_verbose"}),
              ::testing::ExitedWithCode(0), "count=6 verbose=0");
}

TEST(InitToolTest, AnUnknownFlagIsAUsageErrorNamingIt) {
  EXPECT_EXIT(InitAndPrint({"/usr/bin/sb-test", "--test_count=5", "--bogus=1"}),
              ::testing::ExitedWithCode(kExitUsage),
              "^sb-test: unknown flag --bogus \\(see sb-test --help\\)");
}

TEST(InitToolTest, AHyphenatedNameGetsTheUnderscoreSpellingSuggested) {
  EXPECT_EXIT(InitAndPrint({"sb-test", "--test-count=5"}), ::testing::ExitedWithCode(kExitUsage),
              "unknown flag --test-count; flag names are spelled with '_': --test_count");
}

TEST(InitToolTest, AValueThatDoesNotParseIsAUsageErrorNamingTheFlag) {
  EXPECT_EXIT(InitAndPrint({"sb-test", "--test_count=abc"}), ::testing::ExitedWithCode(kExitUsage),
              "sb-test: --test_count=abc: ");
  EXPECT_EXIT(InitAndPrint({"sb-test", "--test_count"}), ::testing::ExitedWithCode(kExitUsage),
              "--test_count needs a value");
}

TEST(InitToolTest, APositionalArgumentIsAUsageError) {
  EXPECT_EXIT(InitAndPrint({"sb-test", "--test_count=5", "extra"}),
              ::testing::ExitedWithCode(kExitUsage), "unexpected argument \"extra\"");
}

TEST(InitToolTest, HelpListsTheFlagsUnderTheBinarysNameAndExits) {
  // Abseil prints --help to stdout; the message and flags are what a user acts on.
  EXPECT_EXIT(
      {
        dup2(STDERR_FILENO, STDOUT_FILENO);
        InitAndPrint({"sb-test", "--help"});
      },
      ::testing::ExitedWithCode(1), "sb-test: a test.(.|\n)*Flags from sb-test(.|\n)*--test_count");
}

TEST(FatalTest, PrintsTheBinaryAndMessageAndExitsWithTheCode) {
  EXPECT_EXIT(Fatal("the disk is full", 3), ::testing::ExitedWithCode(3),
              "^sparsebalance: the disk is full\n");
  EXPECT_EXIT(UsageError("--steps must be positive"), ::testing::ExitedWithCode(kExitUsage),
              "--steps must be positive \\(see sparsebalance --help\\)");
}

std::string TempPath(const std::string& name) { return ::testing::TempDir() + name; }

TEST(ReadFileTest, AMissingFileIsNotFoundAndNamesThePath) {
  const std::string path = TempPath("tool_support_test_no_such_file");
  absl::StatusOr<std::string> text = ReadFile(path);
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(text.status().message().find(path), absl::string_view::npos) << text.status();
}

TEST(ReadFileTest, ReadsExactlyWhatWriteFileWrote) {
  const std::string path = TempPath("tool_support_test_bytes");
  const std::string bytes("a\0b\nno newline at the end", 26);
  ASSERT_TRUE(WriteFile(path, bytes).ok());
  absl::StatusOr<std::string> text = ReadFile(path);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, bytes);
  ASSERT_TRUE(WriteFile(path, "shorter").ok());  // replaces, not appends
  EXPECT_EQ(ReadFile(path).value_or(""), "shorter");
}

TEST(WriteFileTest, AnUnwritablePathIsAnErrorNamingIt) {
  const std::string path = TempPath("tool_support_test_no_such_dir/out.json");
  absl::Status status = WriteFile(path, "{}");
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find(path), absl::string_view::npos) << status;
}

// A secret's file is 0600 from its creation under any umask (sb-run wrote job tokens with the
// umask's mode and chmod'ed them after: readable by others in between), is made 0600 when it
// was there with another mode, and is never written through a symlink.
TEST(WritePrivateFileTest, TheFileIsTheOwnersAloneFromTheStart) {
  const mode_t old_umask = umask(0);
  const std::string path = TempPath("tool_support_test_secret");
  unlink(path.c_str());
  ASSERT_TRUE(WritePrivateFile(path, "token\n").ok());
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(ReadFile(path).value_or(""), "token\n");
  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  ASSERT_TRUE(WritePrivateFile(path, "new").ok());
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(ReadFile(path).value_or(""), "new");
  const std::string link = TempPath("tool_support_test_secret_link");
  unlink(link.c_str());
  ASSERT_EQ(symlink(path.c_str(), link.c_str()), 0);
  EXPECT_FALSE(WritePrivateFile(link, "through the link").ok());
  EXPECT_EQ(ReadFile(path).value_or(""), "new");
  unlink(link.c_str());
  unlink(path.c_str());
  umask(old_umask);
}

// sb-planner's default --plan_threads: a container's CPU limit caps the host's CPUs.
TEST(UsableCpusTest, ACgroupLimitCapsTheCpus) {
  EXPECT_EQ(CpusUnderLimit(64, "max 100000\n"), 64);
  EXPECT_EQ(CpusUnderLimit(64, "200000 100000\n"), 2);
  EXPECT_EQ(CpusUnderLimit(64, "150000 100000"), 2);  // 1.5 CPUs: two threads, each throttled
  EXPECT_EQ(CpusUnderLimit(64, "50000 100000\n"), 1);
  EXPECT_EQ(CpusUnderLimit(2, "800000 100000\n"), 2);  // a limit above the CPUs there are
  EXPECT_EQ(CpusUnderLimit(8, ""), 8);
  EXPECT_EQ(CpusUnderLimit(8, "garbage"), 8);
  EXPECT_EQ(CpusUnderLimit(8, "-1 100000"), 8);
  EXPECT_GE(UsableCpus(), 1);
}

}  // namespace
}  // namespace sparsebalance::tools
