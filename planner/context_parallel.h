// Context parallelism (DESIGN.md section 11): which documents of a step are split over a group
// of ranks, into how many shards, where the cuts fall, and which ranks and micro-batch run
// them. AssignSamples (sample_assigner.h) calls PlanShards first when config.max_shards > 1 and
// then places the other samples around the shards.
//
// Under causal sparse attention a contiguous shard's cost grows with its position (query block
// i keeps about rho (i + 1) key blocks) and a shard receives the keys and values of every
// token before it, so equal-token cuts are unequal-cost cuts. ShardPolicy::kSparse and kDense
// cut where the shards' predicted costs (attention rows, tokens, per-document overhead and
// exchange) balance; kStatic cuts equal tokens.
//
//   absl::StatusOr<ShardLayout> layout = PlanShards(batch, config, model, densities, speed);
//   for (const ShardedDocument& d : layout->documents) ...;  // d.group[j] runs shard j
#ifndef SPARSEBALANCE_PLANNER_CONTEXT_PARALLEL_H_
#define SPARSEBALANCE_PLANNER_CONTEXT_PARALLEL_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/latency_model.h"
#include "planner/types.h"

namespace sparsebalance {

// One document split over a group of ranks.
struct ShardedDocument {
  int sample = 0;       // index into the batch
  int micro_batch = 0;  // every rank of the group runs its shard in this micro-batch
  // group[j] is the rank that runs shard j (the ring order); all distinct.
  std::vector<int> group;
  // group.size() + 1 token offsets from 0 to the document's length; shard j holds the queries
  // [cuts[j], cuts[j + 1]), every cut but the last a multiple of the block size.
  std::vector<int64_t> cuts;
  bool operator==(const ShardedDocument& o) const {
    return sample == o.sample && micro_batch == o.micro_batch && group == o.group && cuts == o.cuts;
  }
};

struct ShardLayout {
  std::vector<ShardedDocument> documents;  // in the order they were placed
  std::vector<char> sharded;               // per batch sample: 1 when split
  // Samples that must be split (longer than the capacity) but found no group with room: under
  // OverflowPolicy::kDefer they are deferred (indices into the batch, ascending).
  std::vector<int> unplaced;
  // The shards' work by rank, in the balancing metric of config.policy (seconds at the
  // planned density for sab and sparsebalance, at density 1 for flops, tokens for tokens;
  // speed factors excluded), and their tokens by [rank * micro_batches + micro-batch].
  std::vector<double> rank_load;
  std::vector<int64_t> tokens;
};

// Chooses and places the step's shards under config.shard_policy (types.h). `densities` are
// the samples' planned densities, `speed` the ranks' speed factors (1 for policies that ignore
// them). kSparse and kDense split a document whose cost exceeds `target_share` of the mean
// rank's load, into as few shards as bring each below it (or as even as max_shards allows);
// AssignSamples tries a few shares and keeps the best placement. `costs`, when given, are the
// samples' costs in the metric PlanShards chooses by (SampleSeconds at the planned density, or at
// 1 for kDense), which the caller has already. Only documents without segments are split. A
// document longer than the capacity that no group can hold is an INVALID_ARGUMENT naming it under
// OverflowPolicy::kError and is listed in `unplaced` under kDefer. The batch and config must be
// valid.
absl::StatusOr<ShardLayout> PlanShards(const std::vector<Sample>& batch,
                                       const PlannerConfig& config, const LatencyModel& model,
                                       const std::vector<double>& densities,
                                       const std::vector<double>& speed, double target_share = 1.0,
                                       const std::vector<double>* costs = nullptr);

// Predicted seconds of shard [begin, end) (tokens; begin a multiple of the block size) of a
// document of `length` tokens at `density`: its rows' attention, tokens and per-document
// overhead plus its key/value exchange (speed factor and micro-batch overhead excluded).
double ShardSeconds(const LatencyModel& model, int64_t length, int64_t begin, int64_t end,
                    double density);

// Cuts (P + 1 token offsets, block-aligned) of a document of `length` tokens into P shards of at
// most `capacity` tokens each whose largest ShardSeconds at `density` is as small as the
// greedy bisection finds; empty when P shards cannot hold the document (P x capacity too small,
// or fewer blocks than P). The largest shard's seconds go to `*largest` when given.
std::vector<int64_t> CostBalancedCuts(const LatencyModel& model, int64_t length, double density,
                                      int shards, int64_t capacity, double* largest = nullptr);

// Equal-token cuts at block boundaries (kStatic); empty as above.
std::vector<int64_t> EqualTokenCuts(int64_t length, int block_size, int shards, int64_t capacity);

// Whether a sample may be split: one document (no segments) in no group (a group's samples
// train on one rank, so none of them is spread over several).
inline bool Splittable(const Sample& sample) {
  return sample.segments.empty() && sample.group == 0;
}

// The longest document max_shards shards of at most `capacity` tokens can hold (tokens): every
// cut falls on a block boundary, so each shard but the last holds at most whole blocks of the
// capacity, floor(capacity / block_size) x block_size tokens.
inline int64_t LongestSplittable(int max_shards, int64_t capacity, int block_size) {
  return (max_shards - 1) * (capacity / block_size * block_size) + capacity;
}

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_CONTEXT_PARALLEL_H_
