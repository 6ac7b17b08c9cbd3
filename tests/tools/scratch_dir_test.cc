// The tests' scratch directories (tests/support/scratch_dir.h): removed when the program that
// made them ends, and never by a death test's forked child that exits with its parent's list.
#include "tests/support/scratch_dir.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace sparsebalance::test_support {
namespace {

std::string ReadLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

TEST(ScratchDirTest, AProgramsScratchIsRemovedWhenItEndsAndItsParentsIsNot) {
  const std::string mine = ScratchDir("scratch_parent");
  const std::string where = ScratchFile("scratch_where");
  std::ofstream(mine + "/kept") << "x";
  // A child that makes none exits with this process's list, and must leave it alone.
  EXPECT_EXIT(std::exit(0), ::testing::ExitedWithCode(0), "");
  ASSERT_TRUE(std::filesystem::exists(mine + "/kept")) << "a child removed its parent's";
  ASSERT_TRUE(std::filesystem::exists(where));
  // The child (forked: it starts with this process's list) makes its own and exits.
  EXPECT_EXIT(
      {
        const std::string its = ScratchDir("scratch_child");
        std::ofstream(its + "/file") << "x";
        std::ofstream(where) << its << "\n";
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
  const std::string its = ReadLine(where);
  ASSERT_FALSE(its.empty());
  EXPECT_FALSE(std::filesystem::exists(its)) << its << " outlived the program that made it";
  EXPECT_TRUE(std::filesystem::exists(mine + "/kept")) << "the child removed its parent's";
}

}  // namespace
}  // namespace sparsebalance::test_support
