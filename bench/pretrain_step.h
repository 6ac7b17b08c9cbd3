// The step the planning benchmarks plan (sb-planner-bench, sb-plan-count): `samples` documents
// of the built-in pretrain trace (seed 7) over `ranks` ranks, 4 micro-batches of 131,072 tokens
// each, a fresh latency model at the benchmarks' prior and the prior recall model.
//
//   const PretrainStep step(65536, 4096, Policy::kSparseBalance, /*max_shards=*/1);
//   absl::StatusOr<StepPlan> plan = PlanStep(step.batch, step.config, step.model);
#ifndef SPARSEBALANCE_BENCH_PRETRAIN_STEP_H_
#define SPARSEBALANCE_BENCH_PRETRAIN_STEP_H_

#include <vector>

#include "absl/status/statusor.h"
#include "planner/latency_model.h"
#include "planner/recall_model.h"
#include "planner/traces.h"
#include "planner/types.h"

namespace sparsebalance {

inline PlannerConfig PretrainConfig(int ranks, Policy policy, int max_shards) {
  PlannerConfig config;
  config.ranks = ranks;
  config.micro_batches = 4;
  config.micro_batch_capacity = 131072;
  config.policy = policy;
  config.max_shards = max_shards;
  return config;
}

struct PretrainStep {
  PretrainStep(int samples, int ranks, Policy policy, int max_shards)
      : config(PretrainConfig(ranks, policy, max_shards)),
        model(config.shape, ranks, CostCoefficients{1.7e-5, 1e-4, 2e-3, 0.05}),
        recall(config.micro_batch_capacity, config.shape.layers) {
    absl::StatusOr<TraceGenerator> generator = TraceGenerator::Builtin("pretrain", 7);
    for (int i = 0; i < samples; ++i) batch.push_back(generator->Next());
  }

  PlannerConfig config;
  std::vector<Sample> batch;
  LatencyModel model;
  RecallModel recall;
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_BENCH_PRETRAIN_STEP_H_
