#include "proto/wire.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/latency_model.h"
#include "planner/planner.h"
#include "planner/random.h"

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
  EXPECT_EQ(s->planner.selection, SelectionMode::kTopK);
  EXPECT_EQ(s->planner.anchor_threshold, kDefaultAnchorThreshold);
  EXPECT_EQ(s->history_steps, kDefaultHistorySteps);
  // A config of a client older than context parallelism: no splitting, the sparse policy.
  EXPECT_EQ(s->planner.max_shards, 1);
  EXPECT_EQ(s->planner.shard_policy, ShardPolicy::kSparse);
  EXPECT_EQ(s->planner.shard_min_length, 0);
}

TEST(ConfigUpdateFromProtoTest, CarriesTheShardSettings) {
  v1::UpdateJobConfigRequest request;
  request.mutable_config()->set_max_shards(2);
  request.mutable_config()->set_shard_policy(v1::SHARD_POLICY_DENSE);
  request.mutable_config()->set_shard_min_length(4096);
  for (const char* f : {"max_shards", "shard_policy", "shard_min_length"}) {
    request.mutable_update_mask()->add_paths(f);
  }
  absl::StatusOr<ConfigUpdate> update = ConfigUpdateFromProto(request);
  ASSERT_TRUE(update.ok()) << update.status();
  EXPECT_EQ(update->values.planner.max_shards, 2);
  EXPECT_EQ(update->values.planner.shard_policy, ShardPolicy::kDense);
  EXPECT_EQ(update->values.planner.shard_min_length, 4096);
  request.mutable_config()->set_max_shards(0);  // as at creation: no splitting
  EXPECT_EQ(ConfigUpdateFromProto(request)->values.planner.max_shards, 1);
  request.mutable_config()->set_shard_policy(static_cast<v1::ShardPolicy>(12));
  absl::StatusOr<ConfigUpdate> bad = ConfigUpdateFromProto(request);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("config.shard_policy"));
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
  c.set_bucket_recall_margin(0.02);
  c.set_document_recall_floor(0.4);
  c.set_selection(v1::SELECTION_ANCHOR);
  c.set_anchor_threshold(0.2);
  c.set_max_shards(4);
  c.set_shard_policy(v1::SHARD_POLICY_STATIC);
  c.set_shard_min_length(8192);
  absl::StatusOr<JobSettings> s = ConfigFromProto(c, WireLimits());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(ConfigToProto(*s).SerializeAsString(), c.SerializeAsString());
  EXPECT_EQ(s->planner.max_shards, 4);
  EXPECT_EQ(s->planner.shard_policy, ShardPolicy::kStatic);
  EXPECT_EQ(s->planner.shard_min_length, 8192);
  EXPECT_EQ(s->planner.selection, SelectionMode::kAnchor);
  EXPECT_EQ(s->planner.anchor_threshold, 0.2);
  EXPECT_EQ(s->planner.shape.local_blocks, 0);  // an explicit shape keeps local_blocks = 0
}

TEST(ConfigUpdateFromProtoTest, CarriesTheSelection) {
  v1::UpdateJobConfigRequest request;
  request.mutable_config()->set_selection(v1::SELECTION_ANCHOR);
  request.mutable_config()->set_anchor_threshold(0.3);
  request.mutable_update_mask()->add_paths("selection");
  request.mutable_update_mask()->add_paths("anchor_threshold");
  absl::StatusOr<ConfigUpdate> update = ConfigUpdateFromProto(request);
  ASSERT_TRUE(update.ok()) << update.status();
  EXPECT_EQ(update->values.planner.selection, SelectionMode::kAnchor);
  EXPECT_EQ(update->values.planner.anchor_threshold, 0.3);
  request.mutable_config()->set_selection(static_cast<v1::Selection>(9));
  absl::StatusOr<ConfigUpdate> bad = ConfigUpdateFromProto(request);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("config.selection"));
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
        BadConfig{"bucket_margin", [](v1::JobConfig* c) { c->set_bucket_recall_margin(-0.5); },
                  absl::StatusCode::kInvalidArgument, "config.bucket_recall_margin"},
        BadConfig{"recall_floor", [](v1::JobConfig* c) { c->set_document_recall_floor(1.0); },
                  absl::StatusCode::kInvalidArgument, "config.document_recall_floor"},
        BadConfig{"anchor_threshold_zero", [](v1::JobConfig* c) { c->set_anchor_threshold(0.0); },
                  absl::StatusCode::kInvalidArgument, "config.anchor_threshold"},
        BadConfig{"anchor_threshold_above_one",
                  [](v1::JobConfig* c) { c->set_anchor_threshold(1.5); },
                  absl::StatusCode::kInvalidArgument, "config.anchor_threshold"},
        BadConfig{"unknown_selection",
                  [](v1::JobConfig* c) { c->set_selection(static_cast<v1::Selection>(7)); },
                  absl::StatusCode::kInvalidArgument, "config.selection"},
        BadConfig{"unknown_policy",
                  [](v1::JobConfig* c) { c->set_policy(static_cast<v1::Policy>(42)); },
                  absl::StatusCode::kInvalidArgument, "config.policy"},
        BadConfig{"unknown_mode",
                  [](v1::JobConfig* c) { c->set_dst_mode(static_cast<v1::DstMode>(9)); },
                  absl::StatusCode::kInvalidArgument, "config.dst_mode"},
        BadConfig{"history", [](v1::JobConfig* c) { c->set_history_steps(-1); },
                  absl::StatusCode::kInvalidArgument, "config.history_steps"},
        // MinimalConfig has 4 ranks: a document cannot be split over more.
        BadConfig{"max_shards_above_world", [](v1::JobConfig* c) { c->set_max_shards(5); },
                  absl::StatusCode::kInvalidArgument, "config.max_shards = 5"},
        BadConfig{"negative_max_shards", [](v1::JobConfig* c) { c->set_max_shards(-2); },
                  absl::StatusCode::kInvalidArgument, "config.max_shards"},
        BadConfig{"unknown_shard_policy",
                  [](v1::JobConfig* c) { c->set_shard_policy(static_cast<v1::ShardPolicy>(8)); },
                  absl::StatusCode::kInvalidArgument, "config.shard_policy"},
        BadConfig{"negative_shard_min_length",
                  [](v1::JobConfig* c) { c->set_shard_min_length(-1); },
                  absl::StatusCode::kInvalidArgument, "config.shard_min_length"}),
    [](const ::testing::TestParamInfo<BadConfig>& info) { return info.param.name; });

google::protobuf::RepeatedPtrField<v1::Sample> Samples(std::vector<Sample> samples) {
  google::protobuf::RepeatedPtrField<v1::Sample> out;
  for (const Sample& s : samples) SampleToProto(s, out.Add());
  return out;
}

TEST(SamplesFromProtoTest, RoundTripsAndDefaultsSensitivity) {
  const std::vector<Sample> in = {{7, 1000, 0.25, 3, {}}, {9, 300, 0.0, 0, {100, 200}}};
  auto wire = Samples(in);
  wire[1].clear_sensitivity();
  absl::StatusOr<std::vector<Sample>> out = SamplesFromProto(wire, WireLimits());
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
      {{{1, 10, 0, 0, {8, -2}}}, "samples[0].segments[1]"},
      {{{1, 10, 0, 0, {12, -2}}}, "samples[0].segments[0]"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::vector<Sample>> out = SamplesFromProto(Samples(c.samples), WireLimits());
    ASSERT_TRUE(out.ok()) << out.status();  // converted; the job's config refuses them
    const absl::Status status = ValidateBatch(*out, config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
  }
  WireLimits small;
  small.max_samples = 1;
  absl::StatusOr<std::vector<Sample>> out =
      SamplesFromProto(Samples({{1, 10, 0, 0, {}}, {2, 10, 0, 0, {}}}), small);
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
      ASSERT_EQ(got.samples_size(), static_cast<int>(want.samples.size()));
      ASSERT_EQ(got.sample_ids_size(), got.samples_size());  // the old form, for old readers
      ASSERT_EQ(got.densities_size(), got.samples_size());
      EXPECT_EQ(got.layer_densities_size(), 0);  // none planned
      for (int k = 0; k < got.samples_size(); ++k) {
        const PlannedSample& w = want.samples[k];
        EXPECT_EQ(got.samples(k).id(), w.id);
        EXPECT_EQ(got.samples(k).length(), w.length);
        EXPECT_EQ(got.samples(k).density(), w.density);
        EXPECT_EQ(got.sample_ids(k), w.id);
        EXPECT_EQ(got.densities(k), w.density);
      }
      EXPECT_EQ(got.tokens(), want.tokens);
      seen += want.samples.size();
    }
    EXPECT_EQ(p.figures().makespan_seconds(), plan->makespan_seconds);
    EXPECT_EQ(p.figures().predicted_recall(), plan->predicted_recall);
  }
  EXPECT_EQ(seen, batch.size());
}

// A planned sample (not a shard) with its segments and layer densities.
PlannedSample Planned(uint64_t id, int64_t length, double density,
                      std::vector<int64_t> segments = {}, std::vector<double> layers = {}) {
  PlannedSample p;
  p.id = id;
  p.length = length;
  p.density = density;
  p.segments = std::move(segments);
  p.layer_densities = std::move(layers);
  return p;
}

// A one-rank plan holding `samples` in its only micro-batch.
StepPlan OneMicroBatchPlan(std::vector<PlannedSample> samples) {
  StepPlan plan;
  MicroBatchPlan& mb = plan.ranks.emplace_back().micro_batches.emplace_back();
  for (const PlannedSample& p : samples) mb.tokens += p.length;
  mb.default_density = 0.3;
  mb.predicted_seconds = 0.25;
  mb.samples = std::move(samples);
  return plan;
}

TEST(MicroBatchFromProtoTest, RoundTripsSegmentsAndLayerDensities) {
  const StepPlan plan =
      OneMicroBatchPlan({Planned(7, 3000, 0.25, {1000, 1500, 500}, {0.5, 0.25, 1.0}),
                         Planned(9, 64, 1.0, {}, {}), Planned(11, 100, 0.1, {99, 1}, {})});
  const v1::RankPlan wire = RankPlanToProto(plan, 3, 0);
  // Old readers still find ids, densities and (one entry per sample) layer densities.
  const v1::MicroBatch& m = wire.micro_batches(0);
  EXPECT_EQ(m.sample_ids_size(), 3);
  EXPECT_EQ(m.densities(2), 0.1);
  ASSERT_EQ(m.layer_densities_size(), 3);
  EXPECT_EQ(m.layer_densities(0).densities_size(), 3);
  EXPECT_EQ(m.layer_densities(1).densities_size(), 0);
  // Through bytes, as a reader gets it.
  v1::RankPlan read;
  ASSERT_TRUE(read.ParseFromString(wire.SerializeAsString()));
  absl::StatusOr<std::vector<MicroBatchPlan>> got = MicroBatchesFromProto(read);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 1u);
  const MicroBatchPlan& want = plan.ranks[0].micro_batches[0];
  const MicroBatchPlan& mb = (*got)[0];
  ASSERT_EQ(mb.samples.size(), want.samples.size());
  for (size_t k = 0; k < mb.samples.size(); ++k) {
    EXPECT_EQ(mb.samples[k].id, want.samples[k].id);
    EXPECT_EQ(mb.samples[k].length, want.samples[k].length);
    EXPECT_EQ(mb.samples[k].density, want.samples[k].density);
    EXPECT_EQ(mb.samples[k].segments, want.samples[k].segments);
    EXPECT_EQ(mb.samples[k].layer_densities, want.samples[k].layer_densities);
  }
  EXPECT_EQ(mb.tokens, want.tokens);
  EXPECT_EQ(mb.default_density, want.default_density);
  EXPECT_EQ(mb.predicted_seconds, want.predicted_seconds);
}

TEST(MicroBatchFromProtoTest, ReadsAnOlderPlannersMessageWithoutLengths) {
  // What a planner older than PlannedSample wrote: ids, densities, maybe layer densities.
  v1::MicroBatch m;
  m.add_sample_ids(5);
  m.add_densities(0.4);
  m.add_sample_ids(6);
  m.add_densities(1.0);
  m.add_layer_densities()->add_densities(0.5);
  m.add_layer_densities();
  m.set_tokens(300);
  m.set_default_density(0.3);
  absl::StatusOr<MicroBatchPlan> mb = MicroBatchFromProto(m);
  ASSERT_TRUE(mb.ok()) << mb.status();
  ASSERT_EQ(mb->samples.size(), 2u);
  EXPECT_EQ(mb->samples[0].id, 5u);
  EXPECT_EQ(mb->samples[0].density, 0.4);
  EXPECT_EQ(mb->samples[0].length, 0);  // unknown until joined to the batch
  EXPECT_EQ(mb->samples[0].layer_densities, std::vector<double>{0.5});
  EXPECT_EQ(mb->samples[1].id, 6u);
  EXPECT_TRUE(mb->samples[1].layer_densities.empty());
  EXPECT_EQ(mb->tokens, 300);
  // The batch fills the lengths and segments in.
  std::vector<MicroBatchPlan> plan = {*mb};
  const std::vector<Sample> batch = {{5, 100, 0.0, 0, {60, 40}}, {6, 200, 0.0, 0, {}}};
  ASSERT_TRUE(CompletePlannedSamples(batch, &plan).ok());
  EXPECT_EQ(plan[0].samples[0].length, 100);
  EXPECT_EQ(plan[0].samples[0].segments, (std::vector<int64_t>{60, 40}));
  EXPECT_EQ(plan[0].samples[1].length, 200);
  // An empty micro-batch reads as empty in either form.
  absl::StatusOr<MicroBatchPlan> empty = MicroBatchFromProto(v1::MicroBatch());
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->samples.empty());
}

TEST(MicroBatchFromProtoTest, BadPlannedSamplesNameTheMicroBatchSampleAndField) {
  auto error_of = [](const StepPlan& plan) {
    absl::StatusOr<std::vector<MicroBatchPlan>> got =
        MicroBatchesFromProto(RankPlanToProto(plan, 0, 0));
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(got.status().message());
  };
  EXPECT_THAT(
      error_of(OneMicroBatchPlan({Planned(1, 10, 0.3, {}, {}), Planned(2, 0, 0.3, {}, {})})),
      HasSubstr("micro_batches[0].samples[1].length: 0 tokens"));
  EXPECT_THAT(error_of(OneMicroBatchPlan({Planned(1, -5, 0.3, {}, {})})),
              HasSubstr("micro_batches[0].samples[0].length: -5"));
  EXPECT_THAT(error_of(OneMicroBatchPlan({Planned(1, 10, 0.0, {}, {})})),
              HasSubstr("micro_batches[0].samples[0].density: 0 is outside (0, 1]"));
  EXPECT_THAT(error_of(OneMicroBatchPlan({Planned(1, 10, std::nan(""), {}, {})})),
              HasSubstr("micro_batches[0].samples[0].density"));
  EXPECT_THAT(error_of(OneMicroBatchPlan({Planned(1, 10, 0.3, {4, 0, 6}, {})})),
              HasSubstr("micro_batches[0].samples[0].segments[1]: 0 tokens"));
  EXPECT_THAT(error_of(OneMicroBatchPlan({Planned(1, 10, 0.3, {4, 5}, {})})),
              HasSubstr("micro_batches[0].samples[0].segments: sum to 9 tokens but length is 10"));
  EXPECT_THAT(error_of(OneMicroBatchPlan({Planned(1, 10, 0.3, {8, 8}, {})})),
              HasSubstr("micro_batches[0].samples[0].segments[1]"));
  EXPECT_THAT(error_of(OneMicroBatchPlan({Planned(1, 10, 0.3, {}, {0.5, 1.5})})),
              HasSubstr("micro_batches[0].samples[0].layer_densities[1]: 1.5"));
  // The old form's own checks.
  v1::RankPlan old;
  v1::MicroBatch* m = old.add_micro_batches();
  m->add_sample_ids(1);
  m->add_sample_ids(2);
  m->add_densities(0.3);
  EXPECT_THAT(std::string(MicroBatchesFromProto(old).status().message()),
              HasSubstr("micro_batches[0].densities: 1 values for 2 sample_ids"));
  m->add_densities(-1.0);
  EXPECT_THAT(std::string(MicroBatchesFromProto(old).status().message()),
              HasSubstr("micro_batches[0].densities[1]: -1"));
  m->set_densities(1, 0.3);
  m->add_layer_densities();
  EXPECT_THAT(std::string(MicroBatchesFromProto(old).status().message()),
              HasSubstr("micro_batches[0].layer_densities: 1 entries for 2 sample_ids"));
  m->add_layer_densities()->add_densities(2.0);
  EXPECT_THAT(std::string(MicroBatchesFromProto(old).status().message()),
              HasSubstr("micro_batches[0].layer_densities[1].densities[0]: 2"));
}

// A document of 1000 tokens split over ranks {2, 0, 3} at tokens 384 and 768 (blocks of 64),
// each rank's shard (if any) and then an unsplit sample in its one micro-batch.
StepPlan ShardedPlan() {
  const std::vector<int> group = {2, 0, 3};
  const int64_t cuts[] = {0, 384, 768, 1000};
  StepPlan plan;
  plan.ranks.resize(4);
  for (int r = 0; r < 4; ++r) {
    MicroBatchPlan& mb = plan.ranks[r].micro_batches.emplace_back();
    mb.default_density = 0.3;
    for (int j = 0; j < 3; ++j) {
      if (group[j] != r) continue;
      PlannedSample p = Planned(5, 1000, 0.25);
      p.shard_begin = cuts[j];
      p.shard_end = cuts[j + 1];
      p.shard_index = j;
      p.shard_group = group;
      mb.samples.push_back(p);
    }
    mb.samples.push_back(Planned(static_cast<uint64_t>(10 + r), 200, 0.5, {120, 80}, {}));
    for (const PlannedSample& p : mb.samples) mb.tokens += p.QueryTokens();
  }
  return plan;
}

TEST(MicroBatchFromProtoTest, ShardsRoundTripByteIdentical) {
  const StepPlan plan = ShardedPlan();
  for (int r : {0, 2, 3}) {
    const v1::RankPlan wire = RankPlanToProto(plan, 8, r);
    const v1::PlannedSample& shard = wire.micro_batches(0).samples(0);
    ASSERT_TRUE(shard.has_shard());
    EXPECT_EQ(shard.shard().group_size(), 3);
    EXPECT_EQ(shard.shard().group(shard.shard().index()), r);
    EXPECT_FALSE(wire.micro_batches(0).samples(1).has_shard());
    v1::RankPlan read;
    ASSERT_TRUE(read.ParseFromString(wire.SerializeAsString()));
    absl::StatusOr<std::vector<MicroBatchPlan>> got =
        MicroBatchesFromProto(read, PlanContext{4, 64});
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), 1u);
    const MicroBatchPlan& want = plan.ranks[r].micro_batches[0];
    EXPECT_EQ((*got)[0].samples, want.samples);  // every field, the shard's included
    EXPECT_EQ((*got)[0].tokens, want.tokens);
    // And back to the wire: the same bytes.
    StepPlan again = plan;
    again.ranks[r].micro_batches = *got;
    EXPECT_EQ(RankPlanToProto(again, 8, r).SerializeAsString(), wire.SerializeAsString());
  }
  // Rank 1 holds no shard: its samples read unsharded.
  absl::StatusOr<std::vector<MicroBatchPlan>> one =
      MicroBatchesFromProto(RankPlanToProto(plan, 8, 1), PlanContext{4, 64});
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ((*one)[0].samples.size(), 1u);
  EXPECT_FALSE((*one)[0].samples[0].sharded());
  EXPECT_EQ((*one)[0].samples[0].QueryTokens(), 200);
}

TEST(MicroBatchFromProtoTest, OldReadersSeeShardsAsTheirSamplesAndNewReadersOldMessagesUnsharded) {
  // A reader older than shards parses the message without the field: it still finds every
  // sample's id, length and density, in `samples` and in the old form.
  const v1::RankPlan wire = RankPlanToProto(ShardedPlan(), 8, 3);
  v1::RankPlan old = wire;
  for (v1::MicroBatch& m : *old.mutable_micro_batches()) {
    for (v1::PlannedSample& p : *m.mutable_samples()) p.clear_shard();  // what it cannot see
  }
  const v1::MicroBatch& m = old.micro_batches(0);
  ASSERT_EQ(m.samples_size(), 2);
  EXPECT_EQ(m.samples(0).id(), 5u);
  EXPECT_EQ(m.samples(0).length(), 1000);
  EXPECT_EQ(m.samples(0).density(), 0.25);
  EXPECT_EQ(m.sample_ids(0), 5u);
  EXPECT_EQ(m.densities(0), 0.25);
  EXPECT_EQ(m.sample_ids(1), 13u);
  // A message without the field (an older planner's) reads as unsharded samples.
  absl::StatusOr<std::vector<MicroBatchPlan>> got = MicroBatchesFromProto(old, PlanContext{4, 64});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_FALSE((*got)[0].samples[0].sharded());
  EXPECT_EQ((*got)[0].samples[0].QueryTokens(), 1000);
  EXPECT_EQ((*got)[0].samples[0].shard_begin, 0);
  EXPECT_EQ((*got)[0].samples[0].shard_end, 0);
}

TEST(MicroBatchFromProtoTest, BadShardsNameTheMicroBatchSampleAndField) {
  struct Case {
    void (*mutate)(v1::Shard*, v1::PlannedSample*);
    const char* message;
  };
  // Rank 0's plan holds shard 1 ([384, 768)) of sample 5, group {2, 0, 3}.
  const Case cases[] = {
      {[](v1::Shard* s, v1::PlannedSample*) { s->set_begin(-64); },
       "micro_batches[0].samples[0].shard.begin: -64 is outside [0, end 768)"},
      {[](v1::Shard* s, v1::PlannedSample*) { s->set_begin(768); },
       "micro_batches[0].samples[0].shard.begin: 768 is outside [0, end 768)"},
      {[](v1::Shard* s, v1::PlannedSample*) { s->set_end(1064); },
       "micro_batches[0].samples[0].shard.end: 1064 is past the sample's length 1000"},
      {[](v1::Shard* s, v1::PlannedSample*) { s->set_begin(400); },
       "micro_batches[0].samples[0].shard.begin: 400 is not a multiple of the block size 64"},
      {[](v1::Shard*, v1::PlannedSample* p) {
         p->add_segments(500);
         p->add_segments(500);
       },
       "micro_batches[0].samples[0].segments: a shard's sample is one document"},
      {[](v1::Shard* s, v1::PlannedSample*) { s->set_group(2, 0); },
       "micro_batches[0].samples[0].shard.group[2]: rank 0 is in the group twice"},
      {[](v1::Shard* s, v1::PlannedSample*) { s->set_group(2, 4); },
       "micro_batches[0].samples[0].shard.group[2]: rank 4 is outside [0, 4)"},
      {[](v1::Shard* s, v1::PlannedSample*) { s->set_group(0, -1); },
       "micro_batches[0].samples[0].shard.group[0]: rank -1 is outside [0, 4)"},
      {[](v1::Shard* s, v1::PlannedSample*) { s->clear_group(); },
       "micro_batches[0].samples[0].shard.group: 0 ranks; need [1, 64]"},
      {[](v1::Shard* s, v1::PlannedSample*) { s->set_index(3); },
       "micro_batches[0].samples[0].shard.index: 3 is outside [0, 3)"},
      {[](v1::Shard* s, v1::PlannedSample*) { s->set_index(-1); },
       "micro_batches[0].samples[0].shard.index: -1 is outside [0, 3)"},
      {[](v1::Shard* s, v1::PlannedSample*) { s->set_index(2); },
       "micro_batches[0].samples[0].shard.group[2]: rank 3 runs this shard, but this is rank "
       "0's plan"},
  };
  for (const Case& c : cases) {
    v1::RankPlan wire = RankPlanToProto(ShardedPlan(), 8, 0);
    v1::PlannedSample* p = wire.mutable_micro_batches(0)->mutable_samples(0);
    c.mutate(p->mutable_shard(), p);
    absl::StatusOr<std::vector<MicroBatchPlan>> got = MicroBatchesFromProto(wire, {4, 64});
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(got.status().message()), HasSubstr(c.message));
  }
  // A reader that does not know the job skips the checks that need it, and says so in
  // wire.h; the others still hold.
  v1::RankPlan wire = RankPlanToProto(ShardedPlan(), 8, 0);
  wire.mutable_micro_batches(0)->mutable_samples(0)->mutable_shard()->set_begin(400);
  EXPECT_TRUE(MicroBatchesFromProto(wire).ok());
  wire.mutable_micro_batches(0)->mutable_samples(0)->mutable_shard()->set_group(2, 9);
  EXPECT_TRUE(MicroBatchesFromProto(wire).ok());
  EXPECT_THAT(std::string(MicroBatchesFromProto(wire, {4, 0}).status().message()),
              HasSubstr("shard.group[2]: rank 9 is outside [0, 4)"));
  wire.mutable_micro_batches(0)->mutable_samples(0)->mutable_shard()->set_group(2, -9);
  EXPECT_THAT(std::string(MicroBatchesFromProto(wire).status().message()),
              HasSubstr("shard.group[2]: rank -9 is outside [0, world size)"));
}

MicroBatchTiming MeasuredTiming() {
  MicroBatchTiming t;
  t.micro_batch = 1;
  t.compute_seconds = 0.5;
  t.attention_seconds = 0.2;
  t.tokens = 1024;
  t.achieved_density = 0.3;
  t.recall = 0.81;
  t.documents = {{7, 0, 0.9, {0.8, 1.0}, 8}, {7, 1, 0.25, {}, 3}, {9, 0, 1.0, {1.0, 1.0}, 1}};
  t.recall_seconds = 0.004;
  return t;
}

TEST(TimingProtoTest, MeasuredRecallRoundTripsEveryField) {
  const MicroBatchTiming t = MeasuredTiming();
  v1::MicroBatchReport report;
  TimingToProto(t, &report);
  ASSERT_EQ(report.documents_size(), 3);
  EXPECT_EQ(report.documents(0).layer_recall_size(), 2);
  EXPECT_EQ(report.documents(1).rows(), 3);
  EXPECT_EQ(report.recall_seconds(), 0.004);
  const MicroBatchTiming back = TimingFromProto(report);
  EXPECT_EQ(back.micro_batch, t.micro_batch);
  EXPECT_EQ(back.compute_seconds, t.compute_seconds);
  EXPECT_EQ(back.attention_seconds, t.attention_seconds);
  EXPECT_EQ(back.tokens, t.tokens);
  EXPECT_EQ(back.achieved_density, t.achieved_density);
  EXPECT_EQ(back.recall, t.recall);
  EXPECT_EQ(back.documents, t.documents);
  EXPECT_EQ(back.recall_seconds, t.recall_seconds);
  EXPECT_EQ(back.exchange_seconds, 0.0);  // no shards measured
  EXPECT_TRUE(ValidateMeasuredRecall({t, back}, /*layers=*/2).ok());
  MicroBatchTiming exchanged = t;
  exchanged.exchange_seconds = 0.125;
  v1::MicroBatchReport with_exchange;
  TimingToProto(exchanged, &with_exchange);
  EXPECT_EQ(with_exchange.exchange_seconds(), 0.125);
  EXPECT_EQ(TimingFromProto(with_exchange).exchange_seconds, 0.125);
  // A report without measurements (an older worker, or --recall_rows=0) stays valid.
  MicroBatchTiming plain = t;
  plain.documents.clear();
  plain.recall_seconds = 0.0;
  v1::MicroBatchReport old;
  TimingToProto(plain, &old);
  EXPECT_EQ(old.documents_size(), 0);
  EXPECT_TRUE(TimingFromProto(old).documents.empty());
  EXPECT_TRUE(ValidateMeasuredRecall({plain}, 2).ok());
}

TEST(TimingProtoTest, BadMeasuredRecallNamesTheMicroBatchDocumentAndField) {
  struct Case {
    void (*mutate)(MicroBatchTiming*);
    const char* message;
  };
  const Case cases[] = {
      {[](MicroBatchTiming* t) { t->documents[2].recall = 1.5; },
       "micro_batches[1].documents[2].recall: 1.5 is outside [0, 1]"},
      {[](MicroBatchTiming* t) { t->documents[0].recall = std::nan(""); },
       "micro_batches[1].documents[0].recall: nan"},
      {[](MicroBatchTiming* t) { t->documents[0].layer_recall = {0.5}; },
       "micro_batches[1].documents[0].layer_recall: 1 values; expected none or one per layer (2)"},
      {[](MicroBatchTiming* t) { t->documents[2].layer_recall[1] = -0.1; },
       "micro_batches[1].documents[2].layer_recall[1]: -0.1 is outside [0, 1]"},
      {[](MicroBatchTiming* t) { t->documents[1].rows = 0; },
       "micro_batches[1].documents[1].rows: 0 must be at least 1"},
      {[](MicroBatchTiming* t) { t->documents[1].document = -1; },
       "micro_batches[1].documents[1].document: -1 is negative"},
      {[](MicroBatchTiming* t) { t->documents[1].document = 0; },
       "micro_batches[1].documents[1]: sample 7 document 0 is reported twice"},
      {[](MicroBatchTiming* t) { t->recall_seconds = -1.0; },
       "micro_batches[1].recall_seconds: -1 is not a finite number >= 0"},
      {[](MicroBatchTiming* t) { t->recall_seconds = std::numeric_limits<double>::infinity(); },
       "micro_batches[1].recall_seconds: inf"},
  };
  for (const Case& c : cases) {
    MicroBatchTiming bad = MeasuredTiming();
    c.mutate(&bad);
    // Through the wire, as sb-planner receives it, second in the report.
    v1::MicroBatchReport report;
    TimingToProto(bad, &report);
    const absl::Status s = ValidateMeasuredRecall({MeasuredTiming(), TimingFromProto(report)}, 2);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
  }
}

// Repeats are found pairwise in a micro-batch of up to 32 documents and by sorting in a larger
// one: both name the repeat at the lowest position after its original.
TEST(MeasuredRecallTest, TheFirstRepeatIsNamedInSmallAndLargeMicroBatches) {
  for (int count : {8, 32, 33, 200}) {
    MicroBatchTiming t = MeasuredTiming();
    t.documents.clear();
    for (int k = 0; k < count; ++k) {
      t.documents.push_back({static_cast<uint64_t>(100 + k / 2), k % 2, 0.5, {}, 1});
    }
    EXPECT_TRUE(ValidateMeasuredRecall({t}, 2).ok()) << count << " documents";
    // Two repeats: of documents[3] at count - 2, of documents[0] at count - 1 (later).
    t.documents[count - 2] = t.documents[3];
    t.documents[count - 1] = t.documents[0];
    const absl::Status s = ValidateMeasuredRecall({t}, 2);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << count;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr(absl::StrCat("micro_batches[0].documents[", count - 2,
                                       "]: sample 101 "
                                       "document 1 is reported twice")))
        << count;
  }
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

// A message rewritten for context (a batch's report) keeps the code and the error reason that
// tells clients to fall back, and the reason still reaches the wire.
TEST(StatusConversionTest, ANewMessageKeepsTheCodeAndTheReason) {
  const absl::Status failed =
      WithErrorReason(absl::ResourceExhaustedError("append: disk full"), kReasonStateDirFailure);
  const absl::Status renamed = WithMessage(failed, "reports[2]: append: disk full");
  EXPECT_EQ(renamed.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(renamed.message(), "reports[2]: append: disk full");
  EXPECT_EQ(ErrorReason(renamed), kReasonStateDirFailure);
  EXPECT_EQ(ErrorReason(FromGrpcStatus(ToGrpcStatus(renamed))), kReasonStateDirFailure);
}

// --- Upper bounds (planner/types.h) as the wire sees them: the attacks that once got through.

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int32_t kInt32Max = std::numeric_limits<int32_t>::max();

struct BoundCase {
  const char* name;
  void (*mutate)(v1::JobConfig*);
  absl::StatusCode code;
  const char* field;
  const char* limit;  // the bound the message must name
};

class ConfigBoundTest : public ::testing::TestWithParam<BoundCase> {};

TEST_P(ConfigBoundTest, IsRefusedNamingTheFieldAndTheBound) {
  v1::JobConfig c = MinimalConfig();
  GetParam().mutate(&c);
  absl::StatusOr<JobSettings> s = ConfigFromProto(c, WireLimits());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), GetParam().code) << s.status();
  EXPECT_THAT(std::string(s.status().message()),
              ::testing::AllOf(HasSubstr(GetParam().field), HasSubstr(GetParam().limit)));
}

INSTANTIATE_TEST_SUITE_P(
    Table, ConfigBoundTest,
    ::testing::Values(
        // Attack: one rank, one micro-batch of INT64_MAX tokens.
        BoundCase{"capacity_int64_max",
                  [](v1::JobConfig* c) {
                    c->set_world_size(1);
                    c->set_micro_batches(1);
                    c->set_micro_batch_capacity(kInt64Max);
                  },
                  absl::StatusCode::kInvalidArgument, "config.micro_batch_capacity", "1073741824"},
        BoundCase{"capacity_just_above",
                  [](v1::JobConfig* c) { c->set_micro_batch_capacity((int64_t{1} << 30) + 1); },
                  absl::StatusCode::kInvalidArgument, "config.micro_batch_capacity", "1073741824"},
        // Attack: micro_batches 2^31 - 1 with 65,536 ranks.
        BoundCase{"micro_batches_int32_max",
                  [](v1::JobConfig* c) {
                    c->set_world_size(65536);
                    c->set_micro_batches(kInt32Max);
                  },
                  absl::StatusCode::kInvalidArgument, "config.micro_batches", "65536"},
        BoundCase{"plan_slots",
                  [](v1::JobConfig* c) {
                    c->set_world_size(65536);
                    c->set_micro_batches(17);
                  },
                  absl::StatusCode::kInvalidArgument, "config.micro_batches", "1048576"},
        BoundCase{"world_size_above_the_planner_limit",
                  [](v1::JobConfig* c) { c->set_world_size(kInt32Max); },
                  absl::StatusCode::kResourceExhausted, "config.world_size", "65536"},
        BoundCase{"layers", [](v1::JobConfig* c) { c->mutable_shape()->set_layers(kInt32Max); },
                  absl::StatusCode::kInvalidArgument, "config.shape.layers", "4096"},
        BoundCase{"heads", [](v1::JobConfig* c) { c->mutable_shape()->set_heads(kInt32Max); },
                  absl::StatusCode::kInvalidArgument, "config.shape.heads", "4096"},
        BoundCase{"head_dim", [](v1::JobConfig* c) { c->mutable_shape()->set_head_dim(kInt32Max); },
                  absl::StatusCode::kInvalidArgument, "config.shape.head_dim", "4096"},
        BoundCase{"local_blocks",
                  [](v1::JobConfig* c) { c->mutable_shape()->set_local_blocks(kInt32Max); },
                  absl::StatusCode::kInvalidArgument, "config.shape.local_blocks", "16777216"},
        BoundCase{"negative_layers", [](v1::JobConfig* c) { c->mutable_shape()->set_layers(-7); },
                  absl::StatusCode::kInvalidArgument, "config.shape.layers", "-7"}),
    [](const ::testing::TestParamInfo<BoundCase>& info) { return info.param.name; });

// Found by registry_fuzzer: the default history (64 steps) was not held to a lower
// max_history_steps, so Restore, which checks it, refused the job (and the whole state).
TEST(ConfigFromProtoTest, DefaultHistoryStepsObeyTheLimit) {
  WireLimits limits;
  limits.max_history_steps = 8;
  absl::StatusOr<JobSettings> s = ConfigFromProto(MinimalConfig(), limits);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->history_steps, 8);
  absl::StatusOr<JobSettings> again = ConfigFromProto(ConfigToProto(*s), limits);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->history_steps, 8);
  EXPECT_EQ(ConfigFromProto(MinimalConfig(), WireLimits())->history_steps, kDefaultHistorySteps);
}

TEST(ConfigFromProtoTest, AcceptsEveryBoundExactly) {
  v1::JobConfig c;
  c.set_world_size(65536);
  c.set_micro_batches(16);  // 2^20 plan slots
  c.set_micro_batch_capacity(int64_t{1} << 30);
  c.mutable_shape()->set_layers(4096);
  c.mutable_shape()->set_heads(4096);
  c.mutable_shape()->set_head_dim(4096);
  c.mutable_shape()->set_local_blocks(1 << 24);
  absl::StatusOr<JobSettings> s = ConfigFromProto(c, WireLimits());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->planner.micro_batch_capacity, kMaxMicroBatchCapacity);
}

TEST(SamplesFromProtoTest, AttackInputsAreRefusedNamingTheIndexAndField) {
  PlannerConfig config;
  config.ranks = 1;
  config.micro_batch_capacity = kMaxMicroBatchCapacity;
  struct Case {
    std::vector<Sample> samples;
    const char* message;
  };
  const std::vector<Case> cases = {
      // The wrapping segments: their sum used to wrap to the length and pass.
      {{{1, 1, 0, 0, {kInt64Max, kInt64Max, 3}}}, "samples[0].segments[0]"},
      {{{1, 10, 0, 0, {}},
        {2, 10, 0, 0, {}},
        {3, 10, 0, 0, {}},
        {4, 10, 0, 0, {5, kInt64Max, kInt64Max, 3}}},
       "samples[3].segments[1]"},
      {{{1, 10, 0, 0, {5, 5, 1}}}, "samples[0].segments[2]"},
      {{{1, kInt64Max, 0, 0, {}}}, "samples[0].length"},
      {{{1, 10, 0, 0, {std::numeric_limits<int64_t>::min(), 10}}}, "samples[0].segments[0]"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::vector<Sample>> out = SamplesFromProto(Samples(c.samples), WireLimits());
    ASSERT_TRUE(out.ok()) << out.status();
    const absl::Status status = ValidateBatch(*out, config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
  }
}

// Property: a JobConfig and samples with extreme values anywhere are refused with a message
// naming a field, or accepted and planned into a plan that passes CheckPlan.
TEST(WireBoundsTest, ExtremeRequestsAreRefusedOrPlanValidly) {
  const std::vector<int64_t> kInt64s = {kInt64Max,
                                        std::numeric_limits<int64_t>::min(),
                                        kInt32Max,
                                        -1,
                                        0,
                                        1,
                                        3,
                                        64,
                                        4096,
                                        int64_t{1} << 30,
                                        (int64_t{1} << 30) + 1};
  const std::vector<double> kDoubles = {std::numeric_limits<double>::quiet_NaN(),
                                        std::numeric_limits<double>::infinity(),
                                        -1.0,
                                        0.0,
                                        1e-300,
                                        0.3,
                                        1.0,
                                        1.5};
  Rng rng(77);
  auto pick = [&rng](const auto& pool) { return pool[rng.NextU64() % pool.size()]; };
  bool wild = false;
  auto int32_or = [&](int32_t sane) {
    return wild && rng.NextU64() % 3 == 0 ? static_cast<int32_t>(pick(kInt64s)) : sane;
  };
  auto int64_or = [&](int64_t sane) {
    return wild && rng.NextU64() % 3 == 0 ? pick(kInt64s) : sane;
  };
  auto double_or = [&](double sane) {
    return wild && rng.NextU64() % 3 == 0 ? pick(kDoubles) : sane;
  };
  int planned = 0;
  for (int k = 0; k < 1000; ++k) {
    wild = rng.NextU64() % 2 == 0;
    v1::JobConfig c;
    c.set_world_size(int32_or(1 + static_cast<int32_t>(rng.NextU64() % 8)));
    c.set_micro_batches(int32_or(static_cast<int32_t>(rng.NextU64() % 4)));
    c.set_micro_batch_capacity(int64_or(rng.NextU64() % 2 == 0 ? 0 : 8192));
    if (rng.NextU64() % 2 == 0) {
      v1::ModelShape* shape = c.mutable_shape();
      shape->set_layers(int32_or(0));
      shape->set_heads(int32_or(0));
      shape->set_head_dim(int32_or(0));
      shape->set_block_size(int32_or(64));
      shape->set_local_blocks(int32_or(1));
    }
    c.set_density_min(double_or(0));
    c.set_density_max(double_or(0));
    c.set_density_default(double_or(0));
    c.set_policy(static_cast<v1::Policy>(int32_or(static_cast<int32_t>(rng.NextU64() % 7))));
    c.set_overflow(static_cast<v1::OverflowPolicy>(int32_or(rng.NextU64() % 2 == 0 ? 1 : 2)));
    c.set_history_steps(int32_or(0));
    const std::string where = absl::StrCat("case ", k, ": ", c.ShortDebugString());
    absl::StatusOr<JobSettings> settings = ConfigFromProto(c, WireLimits());
    if (!settings.ok()) {
      EXPECT_THAT(settings.status().code(), ::testing::AnyOf(absl::StatusCode::kInvalidArgument,
                                                             absl::StatusCode::kResourceExhausted))
          << where;
      EXPECT_THAT(std::string(settings.status().message()), HasSubstr("config.")) << where;
      continue;
    }
    wild = rng.NextU64() % 2 == 0;
    google::protobuf::RepeatedPtrField<v1::Sample> wire;
    const int n = 1 + static_cast<int>(rng.NextU64() % 5);
    for (int i = 0; i < n; ++i) {
      v1::Sample* s = wire.Add();
      s->set_id(static_cast<uint64_t>(i));
      s->set_length(int64_or(1 + static_cast<int64_t>(rng.NextU64() % 8000)));
      if (rng.NextU64() % 2 == 0) s->set_sensitivity(double_or(rng.Uniform()));
      if (rng.NextU64() % 3 == 0) {
        s->add_segments(int64_or(s->length() / 2));
        s->add_segments(int64_or(s->length() - s->length() / 2));
      }
    }
    absl::StatusOr<std::vector<Sample>> batch = SamplesFromProto(wire, WireLimits());
    ASSERT_TRUE(batch.ok()) << where << ": " << batch.status();
    if (absl::Status status = ValidateBatch(*batch, settings->planner); !status.ok()) {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << where;
      EXPECT_THAT(std::string(status.message()), HasSubstr("samples")) << where;
      continue;
    }
    absl::StatusOr<StepPlan> plan = PlanStepLocally(*batch, settings->planner);
    if (!plan.ok()) {
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << where;
      continue;
    }
    ++planned;
    EXPECT_TRUE(CheckPlan(*plan, *batch, settings->planner).ok()) << where;
  }
  EXPECT_GT(planned, 50);
}

}  // namespace
}  // namespace sparsebalance
