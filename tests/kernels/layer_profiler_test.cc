// sb-profile writes a table the planner reads and fits: the format is agreed by test.
#include "kernels/layer_profiler.h"

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "contract/block_geometry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/profile_table.h"

namespace sparsebalance {
namespace kernels {
namespace {

using ::testing::HasSubstr;

// What a profile table records of the shape: heads, head_dim, block_size, local_blocks.
std::tuple<int, int, int, int> AttentionShape(const ModelShape& s) {
  return {s.heads, s.head_dim, s.block_size, s.local_blocks};
}

// Runs a command; returns its exit status and standard output.
int RunCommand(const std::string& command, std::string* output) {
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) output->append(buffer, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(LayerProfilerTest, FormattedProfileRoundTripsThroughTheTableReader) {
  Profile profile;
  profile.device_name = "Test Device\n9000";
  profile.options.shape.heads = 8;
  profile.options.shape.head_dim = 64;
  profile.options.shape.block_size = 128;
  profile.options.shape.local_blocks = 2;
  profile.options.repeats = 3;
  profile.points = {{1024, 1.0, 0.5, 0.4, 0.1, 36}, {2048, 0.25, 0.75, 0.5, 0.25, 60}};
  const std::string text = FormatProfile(profile);
  absl::StatusOr<ProfileTable> table = ParseProfileTable(text);
  ASSERT_TRUE(table.ok()) << table.status() << "\n" << text;
  EXPECT_EQ(table->device, "Test Device 9000");
  EXPECT_EQ(AttentionShape(table->shape), AttentionShape(profile.options.shape));
  std::vector<std::tuple<int64_t, double, double>> rows, points;
  for (const ProfileRow& r : table->rows) rows.emplace_back(r.length, r.density, r.seconds);
  for (const ProfilePoint& p : profile.points) points.emplace_back(p.length, p.density, p.seconds);
  EXPECT_EQ(rows, points);
  // The split and the way it was measured are comments for people.
  EXPECT_THAT(text, HasSubstr("\n# written by sb-profile: median of 3 run(s);"));
  EXPECT_THAT(text, HasSubstr("\n#   2048 0.25 0.5 0.25 60\n"));
}

TEST(LayerProfilerTest, PointsCountTheContractsBlocksAndAddUp) {
  ProfileOptions options;
  options.shape.heads = 2;
  options.shape.head_dim = 64;
  options.shape.block_size = 64;
  options.shape.local_blocks = 1;
  options.lengths = {300, 640};
  options.densities = {1.0, 0.25};
  options.threads = 1;
  int seen = 0;
  absl::StatusOr<Profile> profile = RunProfile(options, [&seen](const ProfilePoint&) { ++seen; });
  ASSERT_TRUE(profile.ok()) << profile.status();
  EXPECT_THAT(profile->device_name, HasSubstr("(1 thread, fp32 reference)"));
  ASSERT_EQ(profile->points.size(), 4u);
  EXPECT_EQ(seen, 4);
  for (const ProfilePoint& p : profile->points) {
    EXPECT_EQ(p.active_blocks, 2 * ActiveBlocks(p.length, p.density, 64, 1)) << p.length;
    EXPECT_GT(p.attention_seconds, 0.0);
    EXPECT_GT(p.linear_seconds, 0.0);
    EXPECT_DOUBLE_EQ(p.seconds, p.attention_seconds + p.linear_seconds);
  }
  EXPECT_EQ(profile->points[2].length, 640);
  EXPECT_EQ(profile->points[2].density, 1.0);
}

TEST(LayerProfilerTest, SbProfileOnTheCpuWritesATableThePlannerFits) {
  const std::string out = ::testing::TempDir() + "/sb_profile_test.profile";
  std::string log;
  const std::string command = std::string(SB_PROFILE_PATH) +
                              " --device=cpu --heads=1 --head_dim=64 --block_size=64"
                              " --local_blocks=1 --lengths=512,1024,2048 --densities=1,0.2"
                              " --repeats=3 --threads=2 --out=" +
                              out + " 2>&1";
  ASSERT_EQ(RunCommand(command, &log), 0) << log;
  std::ifstream in(out);
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<ProfileTable> table = ParseProfileTable(text.str());
  ASSERT_TRUE(table.ok()) << table.status() << "\n" << text.str();
  EXPECT_THAT(table->device, HasSubstr("cpu"));
  EXPECT_EQ(AttentionShape(table->shape), std::make_tuple(1, 64, 64, 1));
  ASSERT_EQ(table->rows.size(), 6u);
  EXPECT_EQ(table->rows[0].length, 512);
  EXPECT_EQ(table->rows[5].density, 0.2);
  ModelShape shape;  // the 7B-class default the planner scales to
  absl::StatusOr<CostCoefficients> fit = FitProfile(*table, shape);
  ASSERT_TRUE(fit.ok()) << fit.status() << "\n" << text.str();
  EXPECT_GT(fit->per_block, 0.0);
}

TEST(LayerProfilerTest, BadFlagsAreErrorsThatNameThem) {
  for (const auto& [flags, message] : std::vector<std::pair<std::string, std::string>>{
           {"--densities=0.5,1.5", "densities[1]=1.5 is outside (0, 1]"},
           {"--lengths=100,x", "--lengths: \"x\" is not a number"},
           {"--block_size=32", "block_size=32 is not supported"},
           {"--head_dim=96", "head_dim=96 is not supported"},
           {"--device=tpu", "device=tpu is not known"},
       }) {
    std::string log;
    EXPECT_EQ(RunCommand(std::string(SB_PROFILE_PATH) + " " + flags + " 2>&1", &log), 2) << flags;
    EXPECT_THAT(log, HasSubstr(message));
  }
  std::string help;
  RunCommand(std::string(SB_PROFILE_PATH) + " --help 2>&1", &help);
  EXPECT_THAT(help, HasSubstr("--lengths"));
  EXPECT_THAT(help, HasSubstr("profile table"));
}

}  // namespace
}  // namespace kernels
}  // namespace sparsebalance
