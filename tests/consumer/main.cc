// Plans one step with the installed planner library and checks the plan, then runs the client
// the way a trainer does: a TrainerSession step and the whole flow through one Balancer, with no
// planner listening (local plans).
#include <cstdio>
#include <memory>
#include <vector>

#include "client/balancer.h"
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
  // The whole flow in one object; a trainer of several ranks also passes any_rank and share_job.
  BalancerOptions flow;
  flow.client = options;
  flow.config = config;
  flow.allow_offline_start = true;  // no planner here: local plans, with a warning
  absl::StatusOr<std::unique_ptr<Balancer>> balancer = Balancer::Start(flow);
  if (!balancer.ok()) return 1;
  for (int64_t step = 0; step < 3; ++step) {
    (*balancer)->Prefetch(step + 1, batch);  // planned while this step trains
    absl::StatusOr<RankStepPlan> plan = (*balancer)->Plan(step, batch);
    if (!plan.ok() || !plan->local_fallback) return 1;
    (*balancer)->Report(step, {}, 0.0);
  }
  if (!(*balancer)->Finish().ok() || (*balancer)->stats().local_steps != 3) return 1;
  std::printf("consumer: Balancer ran 3 steps offline on local plans\n");
  return 0;
}
