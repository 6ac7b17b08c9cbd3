// Plans the planning benchmarks' step (bench/pretrain_step.h) a fixed number of times and prints
// its makespan: a run to count instructions in. The VM this project is measured on drifts by
// 10-30% in speed within an hour, while callgrind's instruction counts are the same on every
// run, so a change to planning can be weighed exactly (scripts/plan-instructions.sh runs this
// under callgrind and prints the instructions per plan by phase).
//
//   sb-plan-count --samples=65536 --ranks=4096 --plans=3
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/pretrain_step.h"
#include "planner/plan_threads.h"
#include "planner/planner.h"
#include "tools/tool_support.h"

ABSL_FLAG(int, samples, 65536, "Documents in the step (1 to 2^24).");
ABSL_FLAG(int, ranks, 4096, "Ranks the step is planned over.");
ABSL_FLAG(int, threads, 1, "Planning threads (1 plans on the calling thread).");
ABSL_FLAG(int, plans, 3, "How many times the step is planned.");

int main(int argc, char** argv) {
  namespace tools = sparsebalance::tools;
  tools::InitTool(argc, argv,
                  "sb-plan-count: plans the planning benchmarks' pretrain step --plans times "
                  "(sparsebalance policy, 4 micro-batches of 131,072 tokens) and prints its "
                  "makespan, for counting instructions with callgrind "
                  "(scripts/plan-instructions.sh).\n"
                  "  sb-plan-count --samples=65536 --ranks=4096 --plans=3");
  const int samples = absl::GetFlag(FLAGS_samples);
  const int ranks = absl::GetFlag(FLAGS_ranks);
  const int threads = absl::GetFlag(FLAGS_threads);
  const int plans = absl::GetFlag(FLAGS_plans);
  if (samples < 1 || samples > sparsebalance::kMaxBatchSamples) {
    tools::UsageError(absl::StrCat("--samples=", samples, " is outside [1, 2^24]"));
  }
  if (threads < 1) tools::UsageError(absl::StrCat("--threads=", threads, " is below 1"));
  if (plans < 1) tools::UsageError(absl::StrCat("--plans=", plans, " is below 1"));
  const sparsebalance::PretrainStep step(samples, ranks, sparsebalance::Policy::kSparseBalance,
                                         /*max_shards=*/1);
  const absl::StatusOr<sparsebalance::ValidConfig> valid =
      sparsebalance::ValidConfig::Check(step.config);
  if (!valid.ok()) tools::UsageError(valid.status().message());
  sparsebalance::PlanThreads pool(threads);
  double makespan = 0.0;
  for (int k = 0; k < plans; ++k) {
    const absl::StatusOr<sparsebalance::StepPlan> plan =
        sparsebalance::PlanStep(step.batch, *valid, step.model, step.recall, &pool);
    if (!plan.ok()) tools::Fatal(plan.status().message());
    makespan = plan->makespan_seconds;
  }
  std::printf("%d plans of %d samples over %d ranks on %d thread(s): makespan %.6f s\n", plans,
              samples, ranks, threads, makespan);
  return 0;
}
