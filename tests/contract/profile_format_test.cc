#include "contract/profile_format.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/random.h"

namespace sparsebalance {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kHeader[] =
    "sparsebalance-profile 1\n"
    "device test\n"
    "shape heads=32 head_dim=128 block_size=64 local_blocks=1\n";

ProfileTable SampleTable() {
  ProfileTable table;
  table.device = "NVIDIA H100 80GB HBM3";
  table.shape.heads = 16;
  table.shape.head_dim = 64;
  table.shape.block_size = 128;
  table.shape.local_blocks = 2;
  table.rows = {{4096, 1.0, 0.0123}, {4096, 0.3, 0.0071},        {65536, 0.125, 0.25},
                {1, 0.5, 1.5e-6},    {131072, 0.05, 3.14159265}, {8191, 0.999, 0.000123456789}};
  return table;
}

std::string ParseError(absl::string_view text) {
  absl::StatusOr<ProfileTable> table = ParseProfileTable(text);
  EXPECT_FALSE(table.ok()) << text;
  if (table.ok()) return "";
  EXPECT_EQ(table.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(table.status().message());
}

TEST(ProfileTableFormatTest, FormatThenParseRoundTrips) {
  const ProfileTable table = SampleTable();
  const std::string text = FormatProfileTable(table);
  absl::StatusOr<ProfileTable> parsed = ParseProfileTable(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << text;
  EXPECT_EQ(parsed->device, table.device);
  EXPECT_EQ(parsed->shape.heads, table.shape.heads);
  EXPECT_EQ(parsed->shape.head_dim, table.shape.head_dim);
  EXPECT_EQ(parsed->shape.block_size, table.shape.block_size);
  EXPECT_EQ(parsed->shape.local_blocks, table.shape.local_blocks);
  ASSERT_EQ(parsed->rows.size(), table.rows.size());
  for (size_t i = 0; i < table.rows.size(); ++i) {
    EXPECT_EQ(parsed->rows[i].length, table.rows[i].length) << i;
    EXPECT_EQ(parsed->rows[i].density, table.rows[i].density) << i;
    EXPECT_EQ(parsed->rows[i].seconds, table.rows[i].seconds) << i;
  }
  // And the text is a fixed point.
  EXPECT_EQ(FormatProfileTable(*parsed), text);
}

TEST(ProfileTableFormatTest, RoundTripKeepsNineSignificantDigitsOfRandomTimes) {
  Rng rng(1);
  ProfileTable table = SampleTable();
  table.rows.clear();
  for (int i = 0; i < 200; ++i) {
    const int64_t length = 1 + static_cast<int64_t>(rng.NextU64() % 400000);
    const double density = static_cast<double>(1 + rng.NextU64() % 1000) / 1000.0;
    const double seconds = std::exp(rng.Uniform() * 20.0 - 15.0);
    table.rows.push_back({length, density, seconds});
  }
  absl::StatusOr<ProfileTable> parsed = ParseProfileTable(FormatProfileTable(table));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->rows.size(), table.rows.size());
  for (size_t i = 0; i < table.rows.size(); ++i) {
    EXPECT_EQ(parsed->rows[i].length, table.rows[i].length);
    EXPECT_EQ(parsed->rows[i].density, table.rows[i].density);
    EXPECT_NEAR(parsed->rows[i].seconds, table.rows[i].seconds, 1e-8 * table.rows[i].seconds);
  }
}

TEST(ProfileTableParseTest, SkipsCommentsBlankLinesAndWhitespace) {
  absl::StatusOr<ProfileTable> table = ParseProfileTable(
      "# written by sb-profile\n"
      "\n"
      "  sparsebalance-profile   1  \n"
      "device  NVIDIA H200  \n"
      "\t# comment\n"
      "shape heads=8 head_dim=64 block_size=128 local_blocks=0\n"
      "8192  0.3   0.5\n"
      "16384 1 2\r\n");
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->device, "NVIDIA H200");
  EXPECT_EQ(table->shape.heads, 8);
  EXPECT_EQ(table->shape.head_dim, 64);
  EXPECT_EQ(table->shape.block_size, 128);
  EXPECT_EQ(table->shape.local_blocks, 0);
  ASSERT_EQ(table->rows.size(), 2u);
  EXPECT_EQ(table->rows[0].length, 8192);
  EXPECT_EQ(table->rows[0].density, 0.3);
  EXPECT_EQ(table->rows[0].seconds, 0.5);
  EXPECT_EQ(table->rows[1].length, 16384);
}

TEST(ProfileTableParseTest, ErrorsNameTheLine) {
  const std::string head = kHeader;  // lines 1-3
  struct Case {
    std::string text;
    int line;               // the profile line the error names
    std::string complaint;  // and what it says is wrong there
  };
  const Case cases[] = {
      {"hello 1\n", 1, "sparsebalance-profile 1"},
      {"# comment\n\nsparsebalance-profile\n", 3, "header"},
      {"# comment\n\nsparsebalance-profile 2\n", 3, "version 2"},
      {head + "8192 0.3 0.1\n8192 1.5 0.2\n", 5, "density \"1.5\""},
      {head + "8192 0 0.1\n", 4, "density \"0\""},
      {head + "8192 nan 0.1\n", 4, "density \"nan\""},
      {head + "8192 dense 0.1\n", 4, "density \"dense\""},
      {head + "\n# c\n8192 0.3\n", 6, "three fields"},
      {head + "8192 0.3 0.1 7\n", 4, "three fields"},
      {head + "0 0.3 0.1\n", 4, "length \"0\""},
      {head + "8k 0.3 0.1\n", 4, "length \"8k\""},
      {head + "8192 0.3 0\n", 4, "seconds \"0\""},
      {head + "8192 0.3 inf\n", 4, "seconds \"inf\""},
      {head + "8192 0.3 -1\n", 4, "seconds \"-1\""},
      {"sparsebalance-profile 1\nshape heads=32 rows=3\n", 2, "\"rows\""},
      {"sparsebalance-profile 1\nshape heads=x\n", 2, "heads=x"},
      {"sparsebalance-profile 1\n\nshape block_size=32\n", 3, "block_size"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(ParseError(c.text),
                AllOf(HasSubstr(absl::StrCat("profile line ", c.line)), HasSubstr(c.complaint)))
        << c.text;
  }
}

TEST(ProfileTableParseTest, MissingPartsAreNamed) {
  EXPECT_THAT(ParseError(""), HasSubstr("no header"));
  EXPECT_THAT(ParseError("# only comments\n\n"), HasSubstr("no header"));
  EXPECT_THAT(ParseError("sparsebalance-profile 1\ndevice x\n8192 0.3 0.1\n"),
              HasSubstr("no \"shape"));
  EXPECT_THAT(ParseError(kHeader), HasSubstr("no data rows"));
}

TEST(ProfileTableFormatTest, NoteAndBreakdownAreCommentsTheReaderSkips) {
  ProfileTable table = SampleTable();
  table.note = "measured\nby a test";
  for (size_t i = 0; i < table.rows.size(); ++i) {
    table.breakdown.push_back({0.25 * table.rows[i].seconds, 0.75 * table.rows[i].seconds,
                               static_cast<int64_t>(100 + i)});
  }
  const std::string text = FormatProfileTable(table);
  EXPECT_THAT(text, HasSubstr("\n# measured by a test\n"));
  EXPECT_THAT(text, HasSubstr("\n#   4096 0.3 0.001775 0.005325 101\n"));
  absl::StatusOr<ProfileTable> parsed = ParseProfileTable(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << text;
  EXPECT_TRUE(parsed->note.empty());
  EXPECT_TRUE(parsed->breakdown.empty());
  ASSERT_EQ(parsed->rows.size(), table.rows.size());
  for (size_t i = 0; i < table.rows.size(); ++i) {
    EXPECT_EQ(parsed->rows[i].length, table.rows[i].length) << i;
    EXPECT_EQ(parsed->rows[i].density, table.rows[i].density) << i;
    EXPECT_EQ(parsed->rows[i].seconds, table.rows[i].seconds) << i;
  }
  // Without note and breakdown the text is the plain table.
  parsed->device = table.device;
  table.note.clear();
  table.breakdown.clear();
  EXPECT_EQ(FormatProfileTable(*parsed), FormatProfileTable(table));
}

}  // namespace
}  // namespace sparsebalance
