// Plans one step with the installed planner library and checks the plan, then runs the client
// the way a trainer does: a TrainerSession step and the whole flow through one Balancer, with no
// planner listening (local plans); then, given a planner's address (scripts/test.sh starts the
// installed sb-planner), the whole flow of one rank against it: ten lines in TrainOneRank.
//
//   consumer [PLANNER_HOST:PORT]
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "client/balancer.h"
#include "client/planner_client.h"
#include "client/trainer_session.h"
#include "planner/planner.h"
#include "planner/traces.h"

namespace {

using namespace sparsebalance;

// The trainer's own work on one planned step: here, "training" takes as long as the plan says,
// and every non-empty micro-batch is timed, as a trainer times its forward and backward.
std::vector<MicroBatchTiming> Train(const RankStepPlan& plan) {
  std::vector<MicroBatchTiming> timings;
  for (size_t m = 0; m < plan.micro_batches.size(); ++m) {
    const MicroBatchPlan& mb = plan.micro_batches[m];
    if (mb.samples.empty()) continue;
    MicroBatchTiming timing;
    timing.micro_batch = static_cast<int>(m);
    timing.compute_seconds = mb.predicted_seconds;
    timing.tokens = mb.tokens;
    timings.push_back(timing);
  }
  return timings;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "consumer: %s\n", status.ToString().c_str());
  return 1;
}

// One rank's whole flow against a planner (a trainer of several ranks also sets options.rank,
// options.world and the two collectives any_rank and share_job).
int TrainOneRank(const std::string& planner, const PlannerConfig& config,
                 const std::vector<std::vector<Sample>>& batches) {
  BalancerOptions options;
  options.client.target = planner;
  options.config = config;
  absl::StatusOr<std::unique_ptr<Balancer>> balancer = Balancer::Start(options);  // job created
  if (!balancer.ok()) return Fail(balancer.status());
  for (int64_t step = 0; step + 1 < static_cast<int64_t>(batches.size()); ++step) {
    (*balancer)->Prefetch(step + 1, batches[step + 1]);  // planned while this step trains
    absl::StatusOr<RankStepPlan> plan = (*balancer)->Plan(step, batches[step]);
    if (!plan.ok()) return Fail(plan.status());
    (*balancer)->Report(step, Train(*plan), /*wait_seconds=*/0.0);  // sent in the background
  }
  if (absl::Status delivered = (*balancer)->Finish(); !delivered.ok()) return Fail(delivered);

  const Balancer::Stats stats = (*balancer)->stats();
  if (stats.planned_steps != static_cast<int64_t>(batches.size()) - 1 || stats.local_steps != 0 ||
      stats.buffered_reports != 0) {
    std::fprintf(stderr, "consumer: %lld steps planned, %lld local, %lld reports undelivered\n",
                 static_cast<long long>(stats.planned_steps),
                 static_cast<long long>(stats.local_steps),
                 static_cast<long long>(stats.buffered_reports));
    return 1;
  }
  std::printf(
      "consumer: Balancer trained %lld steps with %s (%lld planned ahead), every report "
      "delivered\n",
      static_cast<long long>(stats.planned_steps), planner.c_str(),
      static_cast<long long>(stats.prefetched_steps));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
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
  if (argc < 2) return 0;
  PlannerConfig one_rank = config;
  one_rank.ranks = 1;
  std::vector<std::vector<Sample>> batches;
  for (int step = 0; step < 5; ++step) batches.push_back(trace->NextBatch(2 * 131072 * 8 / 10));
  return TrainOneRank(argv[1], one_rank, batches);
}
