// Writes registry_fuzzer's seed corpus (tests/fuzz/corpus/registry/): one small file per
// operation sequence below, in the format of registry_ops.h. Deterministic: rerunning it
// rewrites the same bytes.
//
//   build-fuzz/tests/fuzz/make_registry_corpus tests/fuzz/corpus/registry
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "planner/latency_model.h"
#include "planner/planner.h"
#include "proto/wire.h"
#include "tests/fuzz/registry_ops.h"

namespace sparsebalance {
namespace fuzz {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int32_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

using Step = RegistryOps::Step;

v1::JobConfig Config(int32_t world_size, int32_t micro_batches, int64_t capacity) {
  v1::JobConfig c;
  c.set_world_size(world_size);
  c.set_micro_batches(micro_batches);
  c.set_micro_batch_capacity(capacity);
  return c;
}

std::string Batch(const std::vector<Sample>& samples) {
  v1::SubmitBatchRequest request;
  for (const Sample& s : samples) SampleToProto(s, request.add_samples());
  return request.SerializeAsString();
}

std::vector<Sample> Uniform(int n, int64_t length) {
  std::vector<Sample> out;
  for (int i = 0; i < n; ++i)
    out.push_back({static_cast<uint64_t>(i + 1), length + 37 * i, 0.0, 0, {}});
  return out;
}

// A report of every non-empty micro-batch of `rank` in the plan the registry makes for a
// fresh job (PlanStep at the default prior: what the registry's new job plans), scaled
// timings, so the report passes validation.
std::string Report(const PlannerConfig& config, const std::vector<Sample>& batch, int rank,
                   double seconds_scale, double wait_seconds, bool planned_locally) {
  const LatencyModel model(config.shape, config.ranks, kDefaultCostPrior);
  absl::StatusOr<StepPlan> plan =
      planned_locally ? PlanStepLocally(batch, config) : PlanStep(batch, config, model);
  v1::ReportStepRequest request;
  request.set_rank(rank);
  request.set_wait_seconds(wait_seconds);
  request.set_planned_locally(planned_locally);
  if (!plan.ok()) return request.SerializeAsString();
  const RankPlan& r = plan->ranks[rank];
  for (int m = 0; m < static_cast<int>(r.micro_batches.size()); ++m) {
    const MicroBatchPlan& mb = r.micro_batches[m];
    if (mb.samples.empty()) continue;
    MicroBatchTiming t;
    t.micro_batch = m;
    t.compute_seconds = seconds_scale * (mb.predicted_seconds > 0 ? mb.predicted_seconds : 1.0);
    t.attention_seconds = 0.5 * t.compute_seconds;
    t.tokens = mb.tokens;
    t.achieved_density = 0.3;
    t.recall = 0.9;
    TimingToProto(t, request.add_micro_batches());
  }
  return request.SerializeAsString();
}

PlannerConfig Planner(const v1::JobConfig& c) {
  absl::StatusOr<JobSettings> s = ConfigFromProto(c, WireLimits());
  return s.ok() ? s->planner : PlannerConfig{};
}

// A sequence that starts by creating a job with `config` (slot 0) and joining `ranks` to it.
RegistryOps JoinedJob(const v1::JobConfig& config, const std::vector<int32_t>& ranks) {
  RegistryOps ops;
  ops.Create(config.SerializeAsString());
  for (int32_t rank : ranks) ops.Join(0, rank);
  return ops;
}

std::string Update(const v1::JobConfig& config, const std::vector<std::string>& fields) {
  v1::UpdateJobConfigRequest request;
  *request.mutable_config() = config;
  for (const std::string& f : fields) request.mutable_update_mask()->add_paths(f);
  return request.SerializeAsString();
}

constexpr const char* kProfile =
    "sparsebalance-profile 1\n"
    "device test\n"
    "shape heads=32 head_dim=128 block_size=64 local_blocks=1\n"
    "8192 1.0 0.0123\n"
    "8192 0.3 0.0071\n"
    "32768 1.0 0.09\n"
    "32768 0.3 0.04\n";

std::vector<std::pair<std::string, std::string>> Seeds() {
  std::vector<std::pair<std::string, std::string>> seeds;
  auto add = [&](const std::string& name, const RegistryOps& ops) {
    seeds.emplace_back(name, ops.bytes());
  };
  // Part 1's attacks, as RPC sequences.
  add("attack_capacity_int64_max",
      JoinedJob(Config(1, 1, kInt64Max), {0})
          .Submit(0, Step::Next(), false, Batch({{1, kInt64Max, 0.0, 0, {}}})));
  {
    // The largest allowed capacity, a full-size sample and its report: the fold that used to
    // meet non-finite features.
    const v1::JobConfig c = Config(1, 1, int64_t{1} << 30);
    const std::vector<Sample> batch = {{1, int64_t{1} << 30, 0.0, 0, {}}};
    add("capacity_at_the_bound_and_fold",
        JoinedJob(c, {0})
            .Submit(0, Step::Next(), false, Batch(batch))
            .Report(0, Step::Last(), Report(Planner(c), batch, 0, 1.0, 0.0, false))
            .Restart()
            .GetPlan(0, Step::Last(), 0));
  }
  add("attack_segments_wrap",
      JoinedJob(Config(1, 1, 0), {0})
          .Submit(0, Step::Next(), false, Batch({{1, 1, 0.0, 0, {kInt64Max, kInt64Max, 3}}}))
          .Submit(0, Step::Next(), true, Batch({{1, 1, 0.0, 0, {kInt64Max, kInt64Max, 3}}})));
  {
    RegistryOps ops;
    ops.Create(Config(65536, kInt32Max, 0).SerializeAsString())
        .Create(Config(16, kInt32Max, 0).SerializeAsString())
        .Create(Config(16, 65536, 0).SerializeAsString())
        .Create(Config(1, 1, kInt64Max).SerializeAsString());
    add("attack_micro_batches_and_world_size", ops);
  }
  {
    RegistryOps ops;
    for (int field = 0; field < 4; ++field) {
      v1::JobConfig c = Config(2, 1, 0);
      v1::ModelShape* s = c.mutable_shape();
      s->set_layers(field == 0 ? kInt32Max : 32);
      s->set_heads(field == 1 ? kInt32Max : 32);
      s->set_head_dim(field == 2 ? kInt32Max : 128);
      s->set_local_blocks(field == 3 ? kInt32Max : 1);
      ops.Create(c.SerializeAsString());
    }
    add("attack_shape_dimensions", ops);
  }
  // A repeated ReportStep with different timings: harmless, the first one counts.
  {
    const v1::JobConfig c = Config(2, 2, 8192);
    const std::vector<Sample> batch = Uniform(8, 1500);
    const PlannerConfig p = Planner(c);
    add("repeated_report_different_timings",
        JoinedJob(c, {0, 1})
            .Submit(0, Step::Next(), false, Batch(batch))
            .Report(0, Step::Last(), Report(p, batch, 0, 1.0, 0.01, false))
            .Report(0, Step::Last(), Report(p, batch, 0, 3.0, 0.5, false))
            .Restart()
            .Report(0, Step::Last(), Report(p, batch, 0, 0.2, 0.0, false))
            .Report(0, Step::Last(), Report(p, batch, 1, 1.1, 0.0, false))
            .Submit(0, Step::Next(), false, Batch(Uniform(8, 900)))
            .Restart()
            .GetPlan(0, Step::Raw(0), 1));
  }
  // A node's reports in one ReportStepBatch: rank 0's, its repeat, rank 1's (the step folds),
  // then a batch whose second report names a rank outside the job.
  {
    const v1::JobConfig c = Config(2, 2, 8192);
    const std::vector<Sample> batch = Uniform(8, 1500);
    const PlannerConfig p = Planner(c);
    auto node = [&](const std::vector<std::string>& reports) {
      v1::ReportStepBatchRequest request;
      for (const std::string& r : reports) request.add_reports()->ParseFromString(r);
      return request.SerializeAsString();
    };
    const std::string rank0 = Report(p, batch, 0, 1.0, 0.0, false);
    const std::string rank1 = Report(p, batch, 1, 1.2, 0.1, false);
    const std::vector<Sample> next = Uniform(8, 900);
    v1::ReportStepRequest outside;
    outside.ParseFromString(Report(p, next, 1, 1.0, 0.0, false));
    outside.set_rank(7);
    add("report_batch_of_a_node",
        JoinedJob(c, {0, 1})
            .Submit(0, Step::Next(), false, Batch(batch))
            .ReportBatch(0, Step::Last(), node({rank0, rank0, rank1}))
            .Submit(0, Step::Next(), false, Batch(next))
            .ReportBatch(0, Step::Last(),
                         node({Report(p, next, 0, 1.0, 0.0, false), outside.SerializeAsString(),
                               Report(p, next, 1, 1.0, 0.0, false)}))
            .Restart()
            .GetPlan(0, Step::Raw(0), 1));
  }
  // A ReportStep with NaN wait_seconds and planned_locally on a step holding the planner's plan.
  {
    const v1::JobConfig c = Config(2, 1, 8192);
    const std::vector<Sample> batch = Uniform(4, 2000);
    add("report_nan_wait_planned_locally",
        JoinedJob(c, {0, 1})
            .Submit(0, Step::Next(), false, Batch(batch))
            .Report(0, Step::Last(), Report(Planner(c), batch, 0, 1.0, kNaN, true))
            .GetPlan(0, Step::Last(), 0)
            .Restart());
  }
  // planned_locally SubmitBatch with step INT64_MAX, and with step 1e15.
  add("local_submit_step_int64_max",
      JoinedJob(Config(1, 1, 0), {0})
          .Submit(0, Step::Raw(kInt64Max), true, Batch(Uniform(3, 100)))
          .GetPlan(0, Step::Raw(kInt64Max), 0)
          .Restart());
  {
    const v1::JobConfig c = Config(1, 1, 0);
    const std::vector<Sample> batch = Uniform(3, 100);
    add("local_submit_step_1e15",
        JoinedJob(c, {0})
            .Submit(0, Step::Raw(1000000000000000), true, Batch(batch))
            .Report(0, Step::Last(), Report(Planner(c), batch, 0, 1.0, 0.0, true))
            .Submit(0, Step::Next(), false, Batch(Uniform(2, 50)))
            .Join(0, 0)
            .Restart()
            .GetPlan(0, Step::Raw(1000000000000000), 0)
            .Submit(0, Step::Raw(1000000000000000), true, Batch(batch)));
  }
  // A whole job life: config updates (one invalid), a profile, history trimming, two jobs, a
  // deletion and restarts.
  {
    const v1::JobConfig c = Config(2, 2, 4096);
    v1::JobConfig u;
    u.set_history_steps(2);
    u.set_policy(v1::POLICY_TOKENS);
    u.set_density_min(kNaN);
    RegistryOps ops;
    ops.Create(c.SerializeAsString())
        .Create(Config(3, 1, 0).SerializeAsString(), kProfile)
        .Join(0, 0)
        .Join(0, 1)
        .Submit(0, Step::Next(), false, Batch(Uniform(6, 500)))
        .Update(0, Update(u, {"history_steps", "policy"}))
        .Update(0, Update(u, {"density_min"}))
        .Update(0, Update(u, {"world_size"}))
        .Submit(0, Step::Next(), false, Batch(Uniform(5, 700)))
        .Submit(0, Step::Next(), false, Batch(Uniform(4, 300)))
        .Upload(0, kProfile)
        .Upload(1, "sparsebalance-profile 1\nshape heads=0\n")
        .Delete(1)
        .Restart()
        .Get(0)
        .Get(1)
        .Submit(1, Step::Next(), false, Batch(Uniform(2, 10)))
        .Delete(0)
        .Restart();
    add("lifecycle_update_profile_delete_restart", ops);
  }
  // Steps out of order, a different batch for a planned step, a local switch on repeat.
  {
    const std::vector<Sample> batch = Uniform(5, 1000);
    RegistryOps ops = JoinedJob(Config(2, 1, 0), {1});
    ops.Submit(0, Step::Ahead(3), false, Batch(batch))
        .Submit(0, Step::Next(), false, Batch(batch))
        .Submit(0, Step::Last(), false, Batch(Uniform(5, 999)))
        .Submit(0, Step::Last(), true, Batch(batch))
        .GetPlan(0, Step::Last(), 1)
        .GetPlan(0, Step::Raw(-1), 0)
        .Report(0, Step::Raw(-5), "")
        .Restart()
        .Submit(0, Step::Last(), false, Batch(batch));
    add("out_of_order_and_local_switch", ops);
  }
  return seeds;
}

}  // namespace
}  // namespace fuzz
}  // namespace sparsebalance

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr,
                 "usage: make_registry_corpus DIR\n"
                 "Writes registry_fuzzer's seed inputs into DIR (which must exist), e.g.\n"
                 "  make_registry_corpus tests/fuzz/corpus/registry\n");
    return 2;
  }
  for (const auto& [name, bytes] : sparsebalance::fuzz::Seeds()) {
    const std::string path = std::string(argv[1]) + "/" + name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) {
      std::fprintf(stderr, "make_registry_corpus: cannot write %s\n", path.c_str());
      return 1;
    }
  }
  return 0;
}
