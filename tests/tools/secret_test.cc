// Random secrets and their comparison (tools/secret.h): hex of the asked length, different on
// every draw, and a comparison that looks at whole strings.
#include "tools/secret.h"

#include <set>
#include <string>

#include "gtest/gtest.h"

namespace sparsebalance::tools {
namespace {

TEST(SecretTest, RandomHexHasTheAskedLengthInHexDigitsAndDiffersEveryDraw) {
  std::set<std::string> seen;
  for (int n : {0, 1, 7, 64}) {
    absl::StatusOr<std::string> hex = RandomHex(n);
    ASSERT_TRUE(hex.ok()) << hex.status();
    EXPECT_EQ(hex->size(), static_cast<size_t>(n));
    EXPECT_EQ(hex->find_first_not_of("0123456789abcdef"), std::string::npos) << *hex;
  }
  for (int i = 0; i < 100; ++i) seen.insert(RandomHex(64).value());
  EXPECT_EQ(seen.size(), 100u) << "256-bit draws repeated";
  EXPECT_EQ(RandomHex(-1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SecretTest, ConstantTimeEqualsComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "xbc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_FALSE(ConstantTimeEquals("", "a"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("a\0b", 3), std::string("a\0c", 3)));
}

}  // namespace
}  // namespace sparsebalance::tools
