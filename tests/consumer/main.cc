// Plans one step with the installed planner library and checks the plan.
#include <cstdio>
#include <vector>

#include "client/planner_client.h"
#include "client/trainer_session.h"
#include "planner/planner.h"
#include "planner/traces.h"

int main() {
  using namespace sparsebalance;
  PlannerConfig config;
  config.ranks = 8;
  config.micro_batches = 2;
  absl::StatusOr<TraceGenerator> trace = TraceGenerator::Builtin("pretrain", 1);
  if (!trace.ok()) return 1;
  std::vector<Sample> batch = trace->NextBatch(8 * 2 * 131072 * 8 / 10);
  LatencyModel model(config.shape, config.ranks, CostCoefficients{1.7e-5, 1e-4, 2e-3, 0.05});
  absl::StatusOr<StepPlan> plan = PlanStep(batch, config, model);
  if (!plan.ok() || !CheckPlan(*plan, batch, config).ok()) {
    std::fprintf(stderr, "consumer: planning failed\n");
    return 1;
  }
  std::printf("consumer: planned %zu samples, makespan %.2f s, gap %.4f\n", batch.size(),
              plan->makespan_seconds, plan->gap);
  // The client library: with no planner listening, a trainer still gets its plan locally.
  ClientOptions options;
  options.target = "127.0.0.1:1";
  options.call_timeout_seconds = 0.5;
  options.plan_timeout_seconds = 0.5;
  absl::StatusOr<std::unique_ptr<PlannerClient>> client = PlannerClient::Connect(options);
  if (!client.ok()) return 1;
  TrainerSession session(client->get(), /*rank=*/0, /*coordinator=*/true, config);
  absl::StatusOr<RankStepPlan> local = session.Plan(0, batch);
  if (!local.ok() || !local->local_fallback) {
    std::fprintf(stderr, "consumer: the client did not fall back\n");
    return 1;
  }
  std::printf("consumer: planner unreachable, rank 0 planned locally (%zu micro-batches)\n",
              local->micro_batches.size());
  return 0;
}
