// Places a step's samples on ranks and into micro-batches (DESIGN.md section 5): the
// sparsity-aware batching (SAB) and the baselines it is compared with.
//
//   absl::StatusOr<Assignment> a = AssignSamples(batch, config, model, densities);
//   // a->ranks[r][m] lists indices into `batch`
#ifndef SPARSEBALANCE_PLANNER_SAMPLE_ASSIGNER_H_
#define SPARSEBALANCE_PLANNER_SAMPLE_ASSIGNER_H_

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/context_parallel.h"
#include "planner/latency_model.h"
#include "planner/types.h"

namespace sparsebalance {

class PlanThreads;

class SampleTable;  // sample_table.h
struct SideLoop;    // plan_threads.h

struct Assignment {
  // ranks[r][m]: indices into the batch of the samples in micro-batch m of rank r, in
  // placement order. A split document is in none of them but in `shards`.
  std::vector<std::vector<std::vector<int>>> ranks;
  std::vector<int> deferred;  // indices of samples left for the next step (kDefer), ascending
  // Documents split over groups of ranks (context_parallel.h), when config.max_shards > 1.
  std::vector<ShardedDocument> shards;
};

// Gives an assignment's arrays back to the calling thread's placement workspace: the next
// AssignSamples on this thread reuses them instead of allocating a vector per micro-batch and
// rank (about 20,000 at 65,536 samples over 4,096 ranks, freed serially when each plan ended).
// Optional; PlanStep does it. A step of more than kKeptScratchSamples samples is freed instead.
void RecycleAssignment(Assignment&& assignment);

// Places every sample (or defers what does not fit under kDefer: the balancing policies place
// the samples that the step's tokens hold in arrival order before the later ones, so that the
// latest are deferred) by `config.policy`:
//  - sequential (and dst): contiguous chunks in arrival order, micro-batches filled in order;
//  - tokens: balance token counts; flops: balance dense cost (the model at density 1);
//    both ignore rank speed, as those packers do;
//  - sab (and sparsebalance): balance predicted time at `densities` (one per sample),
//    speed factors included.
// Balancing policies place the largest first on the rank that minimises its resulting time
// within token capacity, keep groups on one rank, break near-ties towards the rank with the
// least untunable (sensitive) work, then improve by moves and swaps between the most and the
// least loaded rank. With config.max_shards > 1 the documents PlanShards splits are placed
// first, and the other samples around them. The batch and config must be valid (ValidateBatch,
// ValidateConfig).
absl::StatusOr<Assignment> AssignSamples(const std::vector<Sample>& batch,
                                         const PlannerConfig& config, const LatencyModel& model,
                                         const std::vector<double>& densities);
// The same, counting blocks through the step's SampleTable when given (PlanStep's), which
// keeps them for the phases after placement. Without context parallelism only. The samples'
// costs are counted on `threads` when given (the placement does not depend on them). `side`, a
// loop that does not depend on the placement nor the placement on it, runs once before the
// call returns: on the helpers while the calling thread deals the units to parts
// (ParallelBeside), otherwise on the threads before placing.
absl::StatusOr<Assignment> AssignSamples(const std::vector<Sample>& batch,
                                         const PlannerConfig& config, const LatencyModel& model,
                                         const std::vector<double>& densities,
                                         const SampleTable* table, PlanThreads* threads = nullptr,
                                         const SideLoop* side = nullptr);

namespace sample_assigner_internal {
// The deal of units to parts in a balanced placement (sample_assigner.cc's DealToParts), the loop
// whose every step waits on the one before, written twice; declared here for the test that
// compares the two. The units, largest first: unit k of n costs the double at costs + order[k] *
// stride (bytes). Each goes to the part where it ends with the least time, (load + cost) *
// per_rate[p], ties to the first, among `parts` parts (at most 8) that start empty. Writes unit
// k's part to part_of[k] and each part's count of units to count[p + 1], count[0] = 0.
void DealUnitsScalar(int parts, const double* per_rate, const int* order, const char* costs,
                     size_t stride, int n, int* part_of, int* count);
// The same with the parts' loads in AVX2 registers, the same results bit for bit, where the CPU
// has AVX2 and the inputs allow it (costs >= 0 and not NaN, rates finite and > 0); false, having
// dealt nothing, elsewhere.
bool DealUnitsVector(int parts, const double* per_rate, const int* order, const char* costs,
                     size_t stride, int n, int* part_of, int* count);
}  // namespace sample_assigner_internal

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_SAMPLE_ASSIGNER_H_
