#include "proto/wire.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/latency_model.h"
#include "planner/planner.h"

namespace sparsebalance {
namespace {

using ::testing::HasSubstr;

v1::JobConfig MinimalConfig() {
  v1::JobConfig c;
  c.set_world_size(4);
  return c;
}

TEST(ConfigFromProtoTest, ZeroFieldsTakeDefaults) {
  absl::StatusOr<JobSettings> s = ConfigFromProto(MinimalConfig(), WireLimits());
  ASSERT_TRUE(s.ok()) << s.status();
  const PlannerConfig defaults;
  EXPECT_EQ(s->planner.ranks, 4);
  EXPECT_EQ(s->planner.micro_batches, 1);
  EXPECT_EQ(s->planner.micro_batch_capacity, 131072);
  EXPECT_EQ(s->planner.shape.block_size, defaults.shape.block_size);
  EXPECT_EQ(s->planner.shape.local_blocks, defaults.shape.local_blocks);
  EXPECT_EQ(s->planner.density_default, defaults.density_default);
  EXPECT_EQ(s->planner.policy, Policy::kSparseBalance);
  EXPECT_EQ(s->planner.dst_mode, DstMode::kMean);
  EXPECT_EQ(s->planner.overflow, OverflowPolicy::kError);
  EXPECT_EQ(s->history_steps, kDefaultHistorySteps);
}

TEST(ConfigFromProtoTest, RoundTripsEveryField) {
  v1::JobConfig c = MinimalConfig();
  c.set_micro_batches(3);
  c.set_micro_batch_capacity(65536);
  c.mutable_shape()->set_layers(8);
  c.mutable_shape()->set_heads(16);
  c.mutable_shape()->set_head_dim(64);
  c.mutable_shape()->set_block_size(128);
  c.mutable_shape()->set_local_blocks(0);
  c.set_density_min(0.1);
  c.set_density_max(0.9);
  c.set_density_default(0.4);
  c.set_policy(v1::POLICY_FLOPS);
  c.set_dst_mode(v1::DST_MODE_QUANTILE);
  c.set_dst_quantile(0.75);
  c.set_overflow(v1::OVERFLOW_POLICY_DEFER);
  c.set_history_steps(10);
  absl::StatusOr<JobSettings> s = ConfigFromProto(c, WireLimits());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(ConfigToProto(*s).SerializeAsString(), c.SerializeAsString());
  EXPECT_EQ(s->planner.shape.local_blocks, 0);  // an explicit shape keeps local_blocks = 0
}

struct BadConfig {
  const char* name;
  void (*mutate)(v1::JobConfig*);
  absl::StatusCode code;
  const char* field;
};

class BadConfigTest : public ::testing::TestWithParam<BadConfig> {};

TEST_P(BadConfigTest, IsRefusedNamingTheField) {
  v1::JobConfig c = MinimalConfig();
  GetParam().mutate(&c);
  WireLimits limits;
  limits.max_world_size = 1024;
  absl::StatusOr<JobSettings> s = ConfigFromProto(c, limits);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), GetParam().code) << s.status();
  EXPECT_THAT(std::string(s.status().message()), HasSubstr(GetParam().field));
}

INSTANTIATE_TEST_SUITE_P(
    Table, BadConfigTest,
    ::testing::Values(
        BadConfig{"zero_ranks", [](v1::JobConfig* c) { c->set_world_size(0); },
                  absl::StatusCode::kInvalidArgument, "config.world_size"},
        BadConfig{"negative_ranks", [](v1::JobConfig* c) { c->set_world_size(-3); },
                  absl::StatusCode::kInvalidArgument, "config.world_size"},
        BadConfig{"too_many_ranks", [](v1::JobConfig* c) { c->set_world_size(5000); },
                  absl::StatusCode::kResourceExhausted, "config.world_size"},
        BadConfig{"negative_micro_batches", [](v1::JobConfig* c) { c->set_micro_batches(-1); },
                  absl::StatusCode::kInvalidArgument, "config.micro_batches"},
        BadConfig{"negative_capacity", [](v1::JobConfig* c) { c->set_micro_batch_capacity(-5); },
                  absl::StatusCode::kInvalidArgument, "config.micro_batch_capacity"},
        BadConfig{"block_size", [](v1::JobConfig* c) { c->mutable_shape()->set_block_size(96); },
                  absl::StatusCode::kInvalidArgument, "config.shape.block_size"},
        BadConfig{"nan_density",
                  [](v1::JobConfig* c) {
                    c->set_density_default(std::numeric_limits<double>::quiet_NaN());
                  },
                  absl::StatusCode::kInvalidArgument, "config.density_default"},
        BadConfig{"density_above_one", [](v1::JobConfig* c) { c->set_density_max(1.5); },
                  absl::StatusCode::kInvalidArgument, "config.density_max"},
        BadConfig{"min_above_default", [](v1::JobConfig* c) { c->set_density_min(0.5); },
                  absl::StatusCode::kInvalidArgument, "config.density_default"},
        BadConfig{"quantile", [](v1::JobConfig* c) { c->set_dst_quantile(2.0); },
                  absl::StatusCode::kInvalidArgument, "config.dst_quantile"},
        BadConfig{"unknown_policy",
                  [](v1::JobConfig* c) { c->set_policy(static_cast<v1::Policy>(42)); },
                  absl::StatusCode::kInvalidArgument, "config.policy"},
        BadConfig{"unknown_mode",
                  [](v1::JobConfig* c) { c->set_dst_mode(static_cast<v1::DstMode>(9)); },
                  absl::StatusCode::kInvalidArgument, "config.dst_mode"},
        BadConfig{"history", [](v1::JobConfig* c) { c->set_history_steps(-1); },
                  absl::StatusCode::kInvalidArgument, "config.history_steps"}),
    [](const ::testing::TestParamInfo<BadConfig>& info) { return info.param.name; });

google::protobuf::RepeatedPtrField<v1::Sample> Samples(std::vector<Sample> samples) {
  google::protobuf::RepeatedPtrField<v1::Sample> out;
  for (const Sample& s : samples) SampleToProto(s, out.Add());
  return out;
}

TEST(SamplesFromProtoTest, RoundTripsAndDefaultsSensitivity) {
  PlannerConfig config;
  config.ranks = 2;
  const std::vector<Sample> in = {{7, 1000, 0.25, 3, {}}, {9, 300, 0.0, 0, {100, 200}}};
  auto wire = Samples(in);
  wire[1].clear_sensitivity();
  absl::StatusOr<std::vector<Sample>> out = SamplesFromProto(wire, config, WireLimits());
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 2u);
  EXPECT_EQ((*out)[0].id, 7u);
  EXPECT_EQ((*out)[0].sensitivity, 0.25);
  EXPECT_EQ((*out)[0].group, 3u);
  EXPECT_EQ((*out)[1].sensitivity, 0.0);
  EXPECT_EQ((*out)[1].segments, (std::vector<int64_t>{100, 200}));
}

TEST(SamplesFromProtoTest, BadSamplesNameTheIndexAndField) {
  PlannerConfig config;
  config.ranks = 2;
  config.micro_batch_capacity = 4096;
  struct Case {
    std::vector<Sample> samples;
    const char* message;
  };
  const std::vector<Case> cases = {
      {{}, "samples"},
      {{{1, 10, 0, 0, {}}, {1, 20, 0, 0, {}}}, "samples[1].id"},
      {{{1, 10, 0, 0, {}}, {2, -4, 0, 0, {}}}, "samples[1].length"},
      {{{1, 0, 0, 0, {}}}, "samples[0].length"},
      {{{1, 5000, 0, 0, {}}}, "micro_batch_capacity"},
      {{{1, 10, 1.5, 0, {}}}, "samples[0].sensitivity"},
      {{{1, 10, std::numeric_limits<double>::quiet_NaN(), 0, {}}}, "samples[0].sensitivity"},
      {{{1, 10, 0, 0, {4, 5}}}, "samples[0].segments"},
      {{{1, 10, 0, 0, {12, -2}}}, "samples[0].segments[1]"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::vector<Sample>> out =
        SamplesFromProto(Samples(c.samples), config, WireLimits());
    ASSERT_FALSE(out.ok()) << c.message;
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(out.status().message()), HasSubstr(c.message));
  }
  WireLimits small;
  small.max_samples = 1;
  absl::StatusOr<std::vector<Sample>> out =
      SamplesFromProto(Samples({{1, 10, 0, 0, {}}, {2, 10, 0, 0, {}}}), config, small);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(RankPlanToProtoTest, CarriesTheRanksMicroBatchesAndTheStepFigures) {
  PlannerConfig config;
  config.ranks = 3;
  config.micro_batches = 2;
  std::vector<Sample> batch;
  for (uint64_t i = 0; i < 12; ++i) {
    batch.push_back({i, 1000 + 500 * static_cast<int64_t>(i), 0.0, 0, {}});
  }
  LatencyModel model(config.shape, config.ranks, CostCoefficients{1.7e-5, 1e-4, 2e-3, 0.05});
  absl::StatusOr<StepPlan> plan = PlanStep(batch, config, model);
  ASSERT_TRUE(plan.ok()) << plan.status();
  size_t seen = 0;
  for (int r = 0; r < config.ranks; ++r) {
    const v1::RankPlan p = RankPlanToProto(*plan, 17, r);
    EXPECT_EQ(p.step(), 17);
    EXPECT_EQ(p.rank(), r);
    EXPECT_EQ(p.policy(), v1::POLICY_SPARSEBALANCE);
    ASSERT_EQ(p.micro_batches_size(), 2);
    for (int m = 0; m < 2; ++m) {
      const MicroBatchPlan& want = plan->ranks[r].micro_batches[m];
      const v1::MicroBatch& got = p.micro_batches(m);
      EXPECT_EQ(std::vector<uint64_t>(got.sample_ids().begin(), got.sample_ids().end()),
                want.sample_ids);
      EXPECT_EQ(std::vector<double>(got.densities().begin(), got.densities().end()),
                want.densities);
      EXPECT_EQ(got.tokens(), want.tokens);
      seen += want.sample_ids.size();
    }
    EXPECT_EQ(p.figures().makespan_seconds(), plan->makespan_seconds);
    EXPECT_EQ(p.figures().predicted_recall(), plan->predicted_recall);
  }
  EXPECT_EQ(seen, batch.size());
}

TEST(StatusConversionTest, KeepsCodeAndMessageBothWays) {
  for (absl::StatusCode code :
       {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
        absl::StatusCode::kFailedPrecondition, absl::StatusCode::kAlreadyExists,
        absl::StatusCode::kUnauthenticated, absl::StatusCode::kPermissionDenied,
        absl::StatusCode::kResourceExhausted, absl::StatusCode::kUnavailable}) {
    const absl::Status status(code, "samples[3].id: duplicate");
    const grpc::Status wire = ToGrpcStatus(status);
    EXPECT_EQ(static_cast<int>(wire.error_code()), static_cast<int>(code));
    EXPECT_EQ(wire.error_message(), "samples[3].id: duplicate");
    EXPECT_EQ(FromGrpcStatus(wire), status);
  }
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

}  // namespace
}  // namespace sparsebalance
