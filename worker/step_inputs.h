// What every rank of a job derives alike without talking: the global batch of a step (from a
// trace, a seed and the step number, so a restarted rank regenerates any step) and a digest of
// a rank's plan (to check that a plan served after a planner restart is the one served before).
#ifndef SPARSEBALANCE_WORKER_STEP_INPUTS_H_
#define SPARSEBALANCE_WORKER_STEP_INPUTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/types.h"

namespace sparsebalance {

struct BatchSpec {
  std::string trace = "pretrain";  // a built-in trace (planner/traces.h)
  uint64_t seed = 1;
  int64_t token_budget = 0;  // tokens per step (e.g. fill x ranks x micro-batches x capacity)
  int64_t max_length = 0;    // documents longer than this are skipped (the micro-batch capacity)
  int64_t min_length = 1;    // and shorter ones too
};

// The batch of `step`: documents drawn from the trace seeded by (seed, step) until the next
// would pass the budget. Ids are unique across steps (step * 10^6 + draw index).
absl::StatusOr<std::vector<Sample>> BatchForStep(const BatchSpec& spec, int64_t step);

// FNV-1a over the micro-batches' sample ids and densities, as 16 hex digits.
std::string PlanDigest(const std::vector<MicroBatchPlan>& micro_batches);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_WORKER_STEP_INPUTS_H_
