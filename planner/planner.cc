#include "planner/planner.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "contract/step_figures.h"
#include "planner/context_parallel.h"
#include "planner/plan_threads.h"
#include "planner/recall_model.h"
#include "planner/sample_table.h"
#include "planner/sparsity_tuner.h"
#include "planner/thread_scratch.h"

namespace sparsebalance {
namespace {

// Densities in plans may sit this far outside their bounds (rounding in the tuner).
constexpr double kDensitySlack = 1e-9;

absl::Status SampleError(size_t i, absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("samples[", i, "].", field, ": ", what));
}

// Samples per block of BlockSums.
constexpr size_t kSumBlock = 4096;

size_t SumBlocks(size_t n) { return (n + kSumBlock - 1) / kSumBlock; }

// Block b's samples of n: [first, second).
std::pair<size_t, size_t> SumBlock(size_t b, size_t n) {
  return {b * kSumBlock, std::min(n, (b + 1) * kSumBlock)};
}

// BlockSums' sums of one block. Summed on the stack and returned once: neighbouring blocks'
// sums share cache lines, and two threads adding into them sample by sample made the sums
// slower on two threads than on one.
template <size_t N, typename Add>
std::array<double, N> SumOfBlock(size_t b, size_t n, const Add& add) {
  std::array<double, N> sums{};
  const auto [begin, end] = SumBlock(b, n);
  for (size_t i = begin; i < end; ++i) add(i, sums);
  return sums;
}

// The blocks' sums added in block order.
template <size_t N>
std::array<double, N> JoinBlocks(const std::vector<std::array<double, N>>& partial) {
  std::array<double, N> total{};
  for (const std::array<double, N>& sums : partial) {
    for (size_t k = 0; k < N; ++k) total[k] += sums[k];
  }
  return total;
}

// N sums over samples [0, n) in blocks of kSumBlock: block(b) returns block b's sums; the
// blocks run on `threads`, and their sums are added after in block order. The blocks do not
// depend on the threads, so neither do the sums' bits.
template <size_t N, typename Block>
std::array<double, N> SumBlocksOf(size_t n, PlanThreads* threads, const Block& block) {
  std::vector<std::array<double, N>> partial(SumBlocks(n));
  ParallelEach(threads, partial.size(), [&](size_t b) { partial[b] = block(b); });
  return JoinBlocks(partial);
}

// SumBlocksOf with add(i, sums) adding sample i's terms to its block's sums. `add` is a
// template argument, not a FunctionRef, so that it is inlined into the block's loop: an
// indirect call a sample was a fifth of the guards' sums.
template <size_t N, typename Add>
std::array<double, N> BlockSums(size_t n, PlanThreads* threads, const Add& add) {
  return SumBlocksOf<N>(n, threads, [&](size_t b) { return SumOfBlock<N>(b, n, add); });
}

// BucketTotals' sums: [b] bucket b's recall sum, [kRecallBuckets + b] its tokens,
// [2 kRecallBuckets + b] its recall sum at `also`.
using BucketSums = std::array<double, 3 * kRecallBuckets>;

// BucketTotals' add(i, sums) for BlockSums (the arguments outlive it).
auto BucketAdder(const std::vector<double>& densities, const SampleTable& table,
                 const std::vector<double>& weights, const std::vector<double>* also) {
  return [&densities, &table, &weights, also, buckets = table.doc_buckets(),
          lengths = table.doc_tokens()](size_t i, BucketSums& sum) {
    if (!weights.empty() && weights[i] == 0.0) return;
    const double r = table.RecallInOrder(i, densities[i]);
    const double r_also = also != nullptr ? table.RecallInOrder(i, (*also)[i]) : 0.0;
    // The sample's documents, with their buckets, as the table lists them.
    const auto [first, last] = table.Documents(i);
    for (int d = first; d < last; ++d) {
      const int b = buckets[d];
      const auto length = static_cast<double>(lengths[d]);
      sum[b] += length * r;
      sum[kRecallBuckets + b] += length;
      if (also != nullptr) sum[2 * kRecallBuckets + b] += length * r_also;
    }
  };
}

// BucketTotals' outputs from its sums.
void SplitBucketSums(const BucketSums& sums, std::vector<double>* tokens,
                     std::vector<double>* weighted, std::vector<double>* also_weighted) {
  weighted->assign(sums.begin(), sums.begin() + kRecallBuckets);
  tokens->assign(sums.begin() + kRecallBuckets, sums.begin() + 2 * kRecallBuckets);
  if (also_weighted != nullptr) {
    also_weighted->assign(sums.begin() + 2 * kRecallBuckets, sums.end());
  }
}

// BucketTotals' sums of block b (BlockSums' blocks). Out of line, so that
// scripts/plan-instructions.sh finds the guards' bucket sums: PlanStep takes them block by block
// beside the placement, and again with BucketTotals where samples were deferred.
__attribute__((noinline)) BucketSums BucketBlockSums(size_t b, const std::vector<Sample>& batch,
                                                     const std::vector<double>& densities,
                                                     const SampleTable& table,
                                                     const std::vector<double>& weights,
                                                     const std::vector<double>* also) {
  return SumOfBlock<std::tuple_size_v<BucketSums>>(b, batch.size(),
                                                   BucketAdder(densities, table, weights, also));
}

// BucketTotals' sums, joined.
BucketSums BucketTotalSums(const std::vector<Sample>& batch, const std::vector<double>& densities,
                           const SampleTable& table, const std::vector<double>& weights,
                           PlanThreads* threads, const std::vector<double>* also) {
  return SumBlocksOf<std::tuple_size_v<BucketSums>>(batch.size(), threads, [&](size_t b) {
    return BucketBlockSums(b, batch, densities, table, weights, also);
  });
}

void BucketTotals(const std::vector<Sample>& batch, const std::vector<double>& densities,
                  const SampleTable& table, const std::vector<double>& weights,
                  std::vector<double>* tokens, std::vector<double>* weighted,
                  PlanThreads* threads = nullptr, const std::vector<double>* also = nullptr,
                  std::vector<double>* also_weighted = nullptr) {
  SplitBucketSums(BucketTotalSums(batch, densities, table, weights, threads, also), tokens,
                  weighted, also != nullptr ? also_weighted : nullptr);
}

// Each bucket's recall sum over its tokens (-1 for a bucket without documents), in place.
void DivideByTokens(const std::vector<double>& tokens, std::vector<double>* weighted) {
  for (int b = 0; b < kRecallBuckets; ++b) {
    (*weighted)[b] = tokens[b] > 0 ? (*weighted)[b] / tokens[b] : -1.0;
  }
}

// BucketRecalls from BucketTotals' sums already taken (`at_also`: the recalls at `also`, when
// the sums have them).
std::vector<double> BucketRecallsOf(const BucketSums& sums, std::vector<double>* at_also) {
  std::vector<double> tokens;
  std::vector<double> weighted;
  SplitBucketSums(sums, &tokens, &weighted, at_also);
  DivideByTokens(tokens, &weighted);
  if (at_also != nullptr) DivideByTokens(tokens, at_also);
  return weighted;
}

// Token-weighted predicted recall per length bucket of the documents of the samples with a
// non-zero weight (`weights` empty: all); a bucket without documents gets -1. With `also`, the
// same at densities `also` in the same pass (`at_also`).
std::vector<double> BucketRecalls(const std::vector<Sample>& batch,
                                  const std::vector<double>& densities, const SampleTable& table,
                                  const std::vector<double>& weights,
                                  PlanThreads* threads = nullptr,
                                  const std::vector<double>* also = nullptr,
                                  std::vector<double>* at_also = nullptr) {
  return BucketRecallsOf(BucketTotalSums(batch, densities, table, weights, threads, also),
                         also != nullptr ? at_also : nullptr);
}

// The recall guards of the per-rank tuning when some documents are split: DST tunes only the
// unsplit samples (`items`, weight 1), the shards keep their densities. Given the placed
// samples' minimum total recall `keep` and per-bucket minimums (`minimum`, -1 unguarded), the
// items must make up what the shards leave: per total and per bucket, (minimum x placed tokens
// - shards' recall sum) / items' tokens (-1 for a bucket without items).
void ItemMinimums(const std::vector<Sample>& batch, const std::vector<double>& densities,
                  const SampleTable& table, const std::vector<double>& placed,
                  const std::vector<double>& items, double* keep, std::vector<double>* minimum) {
  std::vector<double> shards(batch.size(), 0.0);
  for (size_t i = 0; i < batch.size(); ++i) shards[i] = placed[i] - items[i];
  auto total = [&](const std::vector<double>& weights, double* tokens) {
    double weighted = 0.0;
    *tokens = 0.0;
    for (size_t i = 0; i < batch.size(); ++i) {
      const double w = static_cast<double>(table.Tokens(i)) * weights[i];
      weighted += w * table.RecallInOrder(i, densities[i]);
      *tokens += w;
    }
    return weighted;
  };
  double placed_tokens = 0.0;
  double item_tokens = 0.0;
  double shard_tokens = 0.0;
  total(placed, &placed_tokens);
  total(items, &item_tokens);
  const double shard_recall = total(shards, &shard_tokens);
  if (item_tokens > 0) *keep = (*keep * placed_tokens - shard_recall) / item_tokens;
  if (minimum->empty()) return;
  std::vector<double> p_tokens, p_sum, i_tokens, i_sum, s_tokens, s_sum;
  BucketTotals(batch, densities, table, placed, &p_tokens, &p_sum);
  BucketTotals(batch, densities, table, items, &i_tokens, &i_sum);
  BucketTotals(batch, densities, table, shards, &s_tokens, &s_sum);
  for (int b = 0; b < kRecallBuckets; ++b) {
    double& m = (*minimum)[b];
    if (m < 0) continue;
    m = i_tokens[b] > 0 ? (m * p_tokens[b] - s_sum[b]) / i_tokens[b] : -1.0;
  }
}

// The per-bucket guard's minimums: each bucket's recall at the default densities less `margin`
// (-1: a bucket without documents, unguarded).
std::vector<double> BucketMinimums(const std::vector<double>& at_default, double margin) {
  std::vector<double> minimum(at_default.size(), -1.0);
  for (size_t b = 0; b < at_default.size(); ++b) {
    if (at_default[b] >= 0) minimum[b] = at_default[b] - margin;
  }
  return minimum;
}

// One shard of a split document as CheckPlan finds it.
struct PlacedShard {
  const PlannedSample* planned = nullptr;
  int rank = 0;
  int micro_batch = 0;
};

template <typename... Parts>
absl::Status ShardError(uint64_t id, const Parts&... what) {
  return absl::FailedPreconditionError(
      absl::StrCat("plan check: split sample id ", id, ": ", what...));
}

absl::Status NoteShard(const PlannedSample& p, size_t index, int rank, int micro_batch,
                       std::map<size_t, std::vector<PlacedShard>>* shards_of) {
  if (p.shard_index < 0 || p.shard_index >= static_cast<int>(p.shard_group.size()) ||
      p.shard_group[p.shard_index] != rank) {
    return ShardError(p.id, "rank ", rank, " holds shard_index ", p.shard_index,
                      " but shard_group is [", absl::StrJoin(p.shard_group, ","), "]");
  }
  (*shards_of)[index].push_back({&p, rank, micro_batch});
  return absl::OkStatus();
}

// The shards of one split document: a group of 2..max_shards distinct ranks, shard j on
// group[j], all in one micro-batch with one density, block-aligned cuts that cover
// [0, length) exactly once in shard order, each within the capacity.
absl::Status CheckShards(const Sample& s, const PlannerConfig& config,
                         std::vector<PlacedShard>* shards) {
  const PlannedSample& first = *shards->front().planned;
  const std::vector<int>& group = first.shard_group;
  const int count = static_cast<int>(group.size());
  if (!s.segments.empty()) return ShardError(s.id, "a pre-packed sample is never split");
  if (count < 2 || count > config.max_shards) {
    return ShardError(s.id, "a group of ", count, " ranks; need 2..max_shards (", config.max_shards,
                      ")");
  }
  std::set<int> distinct;
  for (int r : group) {
    if (r < 0 || r >= config.ranks || !distinct.insert(r).second) {
      return ShardError(s.id, "shard_group [", absl::StrJoin(group, ","),
                        "] repeats a rank or names one outside [0, ", config.ranks, ")");
    }
  }
  std::sort(shards->begin(), shards->end(), [](const PlacedShard& a, const PlacedShard& b) {
    return a.planned->shard_index < b.planned->shard_index;
  });
  int64_t next = 0;
  for (int j = 0; j < static_cast<int>(shards->size()); ++j) {
    const PlacedShard& at = (*shards)[j];
    const PlannedSample& p = *at.planned;
    if (p.shard_index != j) {
      return ShardError(s.id, "shard ", j, " is ", p.shard_index < j ? "planned twice" : "missing");
    }
    if (p.shard_group != group || at.micro_batch != shards->front().micro_batch ||
        p.density != first.density || p.layer_densities != first.layer_densities) {
      return ShardError(s.id, "shard ", j,
                        " differs from shard 0 in its group, micro-batch or "
                        "densities");
    }
    if (p.shard_begin != next) {
      return ShardError(s.id, "shard ", j, " starts at token ", p.shard_begin, " where shard ",
                        j - 1, " ended at ", next,
                        p.shard_begin > next ? " (tokens missed)" : " (tokens repeated)");
    }
    if (p.shard_end <= p.shard_begin || p.shard_end > s.length ||
        p.shard_begin % config.shape.block_size != 0) {
      return ShardError(s.id, "shard ", j, " covers [", p.shard_begin, ", ", p.shard_end,
                        "): need a non-empty range within the ", s.length,
                        " tokens starting at a multiple of the block size ",
                        config.shape.block_size);
    }
    next = p.shard_end;
  }
  if (static_cast<int>(shards->size()) != count) {
    return ShardError(s.id, shards->size(), " shards planned for a group of ", count);
  }
  if (next != s.length) {
    return ShardError(s.id, "the shards end at token ", next, " of ", s.length, " (tokens missed)");
  }
  return absl::OkStatus();
}

// TokenWeightedRecall with the step's table (in blocks: BlockSums; with `threads`, as
// BucketTotals).
double TableRecall(const std::vector<Sample>& batch, const std::vector<double>& densities,
                   const SampleTable& table, const std::vector<double>& weights = {},
                   PlanThreads* threads = nullptr) {
  const std::array<double, 2> sums =
      BlockSums<2>(batch.size(), threads, [&](size_t i, std::array<double, 2>& sum) {
        const double w =
            static_cast<double>(table.Tokens(i)) * (weights.empty() ? 1.0 : weights[i]);
        sum[0] += w * table.RecallInOrder(i, densities[i]);
        sum[1] += w;
      });
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
}

// The index of the first sample whose id an earlier sample of the batch has, or batch.size()
// when every id is distinct.
size_t FirstRepeatedId(const std::vector<Sample>& batch) {
  const size_t n = batch.size();
  // Increasing ids (a step's samples numbered as they are drawn) are distinct: one pass.
  size_t increasing = 1;
  while (increasing < n && batch[increasing - 1].id < batch[increasing].id) ++increasing;
  if (increasing >= n) return n;
  // Otherwise a hash set of the ids seen so far (its hash is seeded per process, so a client
  // cannot choose colliding ids). A radix sort of (id, index) pairs cost more for hashed ids.
  absl::flat_hash_set<uint64_t> seen;
  seen.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (!seen.insert(batch[i].id).second) return i;
  }
  return n;
}

bool MeetsMinimums(const std::vector<double>& recall, const std::vector<double>& minimum) {
  for (size_t b = 0; b < recall.size(); ++b) {
    if (minimum[b] >= 0 && recall[b] < minimum[b] - 1e-12) return false;
  }
  return true;
}

}  // namespace

double TokenWeightedRecall(const std::vector<Sample>& batch, const std::vector<double>& densities,
                           const std::vector<double>& weights) {
  double weighted = 0.0;
  double tokens = 0.0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const double w = static_cast<double>(batch[i].length) * (weights.empty() ? 1.0 : weights[i]);
    weighted += w * PredictedRecall(batch[i].sensitivity, densities[i]);
    tokens += w;
  }
  return tokens > 0 ? weighted / tokens : 0.0;
}

double TokenWeightedRecall(const std::vector<Sample>& batch, const std::vector<double>& densities,
                           const RecallModel& recall, const std::vector<double>& weights) {
  double weighted = 0.0;
  double tokens = 0.0;
  RecallAtMemo recall_at;
  for (size_t i = 0; i < batch.size(); ++i) {
    const double w = static_cast<double>(batch[i].length) * (weights.empty() ? 1.0 : weights[i]);
    weighted += w * recall_at(recall.SampleExponent(batch[i]), densities[i]);
    tokens += w;
  }
  return tokens > 0 ? weighted / tokens : 0.0;
}

absl::StatusOr<ValidConfig> ValidConfig::Check(const PlannerConfig& config) {
  if (absl::Status status = ValidateConfig(config); !status.ok()) return status;
  return ValidConfig(config);
}

absl::Status ValidateSegments(int64_t length, const std::vector<int64_t>& segments,
                              absl::string_view where) {
  // Each segment is checked against what is left of the length before it is added, so the
  // running sum never exceeds the length and cannot wrap.
  int64_t sum = 0;
  for (size_t k = 0; k < segments.size(); ++k) {
    const int64_t segment = segments[k];
    auto error = [&](const auto&... what) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".segments[", k, "]: ", what...));
    };
    if (segment < 1) return error(segment, " tokens; need at least 1");
    if (segment > length) {
      return error(segment, " tokens is above the sample's length ", length,
                   "; each segment must be in [1, length]");
    }
    if (segment > length - sum) {
      return error("segments[0..", k, "] sum to more than the sample's length ", length,
                   "; they must sum to the length");
    }
    sum += segment;
  }
  if (!segments.empty() && sum != length) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".segments: sum to ", sum, " tokens but length is ", length));
  }
  return absl::OkStatus();
}

SamplesById IndexSamplesById(const std::vector<Sample>& batch) {
  SamplesById by_id;
  by_id.reserve(batch.size());
  for (const Sample& s : batch) by_id.emplace(s.id, &s);
  return by_id;
}

absl::Status CompletePlannedSamples(const std::vector<Sample>& batch,
                                    std::vector<MicroBatchPlan>* micro_batches) {
  return CompletePlannedSamples(IndexSamplesById(batch), micro_batches);
}

absl::Status CompletePlannedSamples(const SamplesById& by_id,
                                    std::vector<MicroBatchPlan>* micro_batches) {
  for (size_t m = 0; m < micro_batches->size(); ++m) {
    std::vector<PlannedSample>& samples = (*micro_batches)[m].samples;
    for (size_t k = 0; k < samples.size(); ++k) {
      PlannedSample& p = samples[k];
      auto error = [&](absl::string_view field, const auto&... what) {
        return absl::InvalidArgumentError(
            absl::StrCat("micro_batches[", m, "].samples[", k, "].", field, ": ", what...));
      };
      auto it = by_id.find(p.id);
      if (it == by_id.end()) return error("id", p.id, " is not in the batch");
      const Sample& s = *it->second;
      if (p.length == 0) {  // an older planner's plan: ids and densities only
        p.length = s.length;
        p.segments = s.segments;
      } else if (p.length != s.length) {
        return error("length", p.length, " tokens but the batch's sample id ", s.id, " has ",
                     s.length);
      } else if (p.segments != s.segments) {
        return error("segments", "[", absl::StrJoin(p.segments, ","),
                     "] but the batch's sample id ", s.id, " has [", absl::StrJoin(s.segments, ","),
                     "]");
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckRankPlan(const SamplesById& batch,
                           const std::vector<MicroBatchPlan>& micro_batches,
                           const std::vector<uint64_t>& deferred_ids, const PlannerConfig& config) {
  if (static_cast<int>(micro_batches.size()) != config.micro_batches) {
    return absl::FailedPreconditionError(absl::StrCat("micro_batches: ", micro_batches.size(),
                                                      " micro-batches; the job has ",
                                                      config.micro_batches));
  }
  absl::flat_hash_map<uint64_t, size_t> micro_batch_of;  // planned id -> its micro-batch
  for (size_t m = 0; m < micro_batches.size(); ++m) {
    auto fail = [m](const auto&... what) {
      return absl::FailedPreconditionError(absl::StrCat("micro_batches[", m, "]: ", what...));
    };
    int64_t tokens = 0;
    for (const PlannedSample& p : micro_batches[m].samples) {
      if (auto [at, placed] = micro_batch_of.emplace(p.id, m); !placed) {
        return fail("sample id ", p.id, " is planned on this rank again (first in micro_batches[",
                    at->second, "])");
      }
      if (!p.layer_densities.empty() &&
          static_cast<int>(p.layer_densities.size()) != config.shape.layers) {
        return fail("sample id ", p.id, " has ", p.layer_densities.size(),
                    " layer densities; the model has ", config.shape.layers, " layers");
      }
      // Checked as it grows, the sum stays below the capacity plus one sample's tokens (at most
      // 2^30 each): it never wraps.
      tokens += p.QueryTokens();
      if (tokens > config.micro_batch_capacity) {
        return fail("sample id ", p.id, " brings its query tokens to ", tokens,
                    ", above micro_batch_capacity ", config.micro_batch_capacity);
      }
    }
    // The planner's own count, which a trainer may size its buffers by: it must be its samples'
    // (0: not sent, as by a planner that sends ids and densities alone).
    if (micro_batches[m].tokens != 0 && micro_batches[m].tokens != tokens) {
      return fail("tokens: ", micro_batches[m].tokens, " but its samples' query tokens add up to ",
                  tokens);
    }
  }
  for (uint64_t id : deferred_ids) {
    if (!batch.contains(id)) {
      return absl::FailedPreconditionError(
          absl::StrCat("deferred_ids: sample id ", id, " is not in the batch"));
    }
    if (auto at = micro_batch_of.find(id); at != micro_batch_of.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("deferred_ids: sample id ", id, " is deferred and planned in micro_batches[",
                       at->second, "]"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateBatch(const std::vector<Sample>& batch, const PlannerConfig& config) {
  if (batch.empty()) {
    return absl::InvalidArgumentError("samples: the batch is empty; submit at least one sample");
  }
  // The bounds checked (and the overflow-freedom of the sums) rest on a valid config.
  absl::StatusOr<ValidConfig> valid = ValidConfig::Check(config);
  if (!valid.ok()) return valid.status();
  return ValidateBatch(batch, *valid);
}

namespace {

// The longest sample `s` may be: a document that may be split (Splittable: no segments, no
// group) up to `longest_document`, any other sample one micro-batch.
inline int64_t LongestAllowed(const Sample& s, const PlannerConfig& config,
                              int64_t longest_document) {
  return Splittable(s) ? longest_document : config.micro_batch_capacity;
}

// Whether CheckSampleFields passes sample `s` but for its segments: its length and sensitivity.
inline bool PlainFieldsOk(const Sample& s, const PlannerConfig& config, int64_t longest_document) {
  return s.length >= 1 && s.length <= LongestAllowed(s, config, longest_document) &&
         s.sensitivity >= 0.0 && s.sensitivity <= 1.0;
}

// ValidateBatch's checks of sample i's own fields (all but its id's uniqueness), each with its
// message; the longest a splittable document (Splittable) may be is `longest_document`.
absl::Status CheckSampleFields(size_t i, const Sample& s, const PlannerConfig& config,
                               int64_t longest_document) {
  if (s.length < 1) {
    return SampleError(i, "length", absl::StrCat(s.length, " tokens; need at least 1"));
  }
  // With context parallelism a document (no segments, no group) may be up to
  // `longest_document` long: it is split over up to max_shards ranks (context_parallel.h).
  if (s.length > LongestAllowed(s, config, longest_document)) {
    const int64_t capacity = config.micro_batch_capacity;
    std::string limit;
    std::string fix;
    if (!s.segments.empty() && config.max_shards > 1) {
      limit =
          absl::StrCat("micro_batch_capacity ", capacity, " (a pre-packed sample is never split)");
      fix = "raise the capacity, or pack fewer documents into it";
    } else if (s.group != 0) {
      limit = absl::StrCat("micro_batch_capacity ", capacity, " (a sample of group ", s.group,
                           " trains on one rank and is never split over ranks)");
      fix = "split the document, raise the capacity, or take it out of its group";
    } else if (config.max_shards == 1) {
      limit = absl::StrCat("micro_batch_capacity ", capacity);
      fix = "split the document, raise the capacity, or set max_shards > 1 to split it over ranks";
    } else if (longest_document == config.max_shards * capacity) {
      limit =
          absl::StrCat("max_shards x micro_batch_capacity = ", config.max_shards, " x ", capacity);
      fix = "raise max_shards or the capacity, or split the document";
    } else {
      // Cuts fall on block boundaries: with a capacity that is not a multiple of the block size
      // every shard but the last holds less than the capacity.
      const int64_t whole_blocks = capacity / config.shape.block_size * config.shape.block_size;
      limit = absl::StrCat(longest_document, " tokens, the most max_shards ", config.max_shards,
                           " shards of micro_batch_capacity ", capacity,
                           " hold: shards are cut at block boundaries, so each but the last holds ",
                           whole_blocks, " tokens (whole blocks of ", config.shape.block_size,
                           "), (", config.max_shards, " - 1) x ", whole_blocks, " + ", capacity);
      fix = absl::StrCat("raise max_shards, make the capacity a multiple of the block size ",
                         config.shape.block_size, ", or split the document");
    }
    return SampleError(
        i, "length", absl::StrCat(s.length, " tokens (id ", s.id, ") exceeds ", limit, "; ", fix));
  }
  if (!(s.sensitivity >= 0.0 && s.sensitivity <= 1.0)) {
    return SampleError(i, "sensitivity", absl::StrCat(s.sensitivity, " is outside [0, 1]"));
  }
  // Empty segments are always valid: the field prefix is built only for samples that have
  // segments (formatting it for every sample cost a fifth of the check).
  if (!s.segments.empty()) {
    return ValidateSegments(s.length, s.segments, absl::StrCat("samples[", i, "]"));
  }
  return absl::OkStatus();
}

// What one range of ValidateBatch's pass found: its first sample whose fields fail
// (CheckSampleFields) and its first whose id is not above the previous sample's (the range's
// end where none), and its samples' tokens before the first failing one.
struct BatchRange {
  size_t first_bad = 0;
  size_t first_not_increasing = 0;
  int64_t tokens = 0;
};

BatchRange CheckBatchRange(const std::vector<Sample>& batch, const PlannerConfig& config,
                           int64_t longest_document, size_t begin, size_t end) {
  BatchRange range{end, end, 0};
  for (size_t i = begin; i < end; ++i) {
    const Sample& s = batch[i];
    if (range.first_not_increasing == end && i > 0 && batch[i - 1].id >= s.id) {
      range.first_not_increasing = i;
    }
    // CheckSampleFields' answer, its cheap checks inline: a call and a status a sample cost 18
    // instructions a sample more than the checks themselves.
    if (!PlainFieldsOk(s, config, longest_document) ||
        (!s.segments.empty() && !CheckSampleFields(i, s, config, longest_document).ok())) {
      range.first_bad = i;
      break;
    }
    range.tokens += s.length;
  }
  return range;
}

}  // namespace

absl::Status ValidateBatch(const std::vector<Sample>& batch, const ValidConfig& valid,
                           PlanThreads* threads) {
  const PlannerConfig& config = valid.get();
  if (batch.empty()) {
    return absl::InvalidArgumentError("samples: the batch is empty; submit at least one sample");
  }
  if (batch.size() > static_cast<size_t>(kMaxBatchSamples)) {
    return absl::InvalidArgumentError(
        absl::StrCat("samples: ", batch.size(), " samples is above the limit of ", kMaxBatchSamples,
                     " (2^24, kMaxBatchSamples); split the batch"));
  }
  const size_t n = batch.size();
  // Each length is checked to be in [1, max_shards x micro_batch_capacity] before it is added,
  // and a valid config's capacity is at most kMaxMicroBatchCapacity (2^30) and max_shards at
  // most kMaxShards (2^6), so with at most 2^24 samples the total stays below 2^60: no
  // overflow. A document's rows stay below 2^36 / 64 = 2^30 (blocks of at least 64 tokens).
  // The longest document max_shards block-aligned shards hold (at most max_shards x capacity):
  // a longer one could never be placed, and under overflow=defer would wait for ever.
  const int64_t longest_document =
      LongestSplittable(config.max_shards, config.micro_batch_capacity, config.shape.block_size);
  // One pass in ranges (on the threads where given: 0.24 ms serial at 65,536 samples) checks
  // every sample's fields and whether the ids increase (a step's samples numbered as they are
  // drawn), which makes them distinct. Only a batch whose ids stop increasing before its first
  // failing sample needs FirstRepeatedId's hash set. The answer is the first failing sample in
  // index order, an id repeated there named before its other fields: as one pass would find.
  const size_t chunks = ChunkCount(threads, n);
  std::vector<BatchRange> ranges(chunks);
  ParallelChunks(threads, n, [&](size_t chunk, size_t begin, size_t end) {
    ranges[chunk] = CheckBatchRange(batch, config, longest_document, begin, end);
  });
  size_t first_bad = n;
  size_t first_not_increasing = n;
  int64_t total = 0;
  for (size_t c = 0; c < chunks; ++c) {
    const size_t end = (c + 1) * n / chunks;
    first_not_increasing =
        std::min(first_not_increasing,
                 ranges[c].first_not_increasing == end ? n : ranges[c].first_not_increasing);
    total += ranges[c].tokens;
    if (ranges[c].first_bad != end) {
      first_bad = ranges[c].first_bad;
      break;
    }
  }
  // The ids before first_not_increasing are distinct, so a repeat is at or after it; one past
  // the first failing sample does not matter.
  const size_t repeated =
      first_not_increasing < n && first_not_increasing <= first_bad ? FirstRepeatedId(batch) : n;
  if (repeated <= first_bad && repeated < n) {
    return SampleError(repeated, "id",
                       absl::StrCat(batch[repeated].id, " appears more than once in the batch"));
  }
  if (first_bad < n) {
    return CheckSampleFields(first_bad, batch[first_bad], config, longest_document);
  }
  // A valid config keeps ranks x micro_batches <= 2^20 and the capacity <= 2^30: below 2^50.
  const int64_t capacity =
      static_cast<int64_t>(config.ranks) * config.micro_batches * config.micro_batch_capacity;
  if (config.overflow == OverflowPolicy::kError && total > capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "samples: the batch has ", total,
        " tokens but ranks x micro_batches x "
        "micro_batch_capacity = ",
        config.ranks, " x ", config.micro_batches, " x ", config.micro_batch_capacity, " = ",
        capacity,
        " tokens; raise micro_batches or micro_batch_capacity, or use overflow policy defer"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepPlan> PlanStepLocally(const std::vector<Sample>& batch,
                                         const PlannerConfig& config) {
  absl::StatusOr<ValidConfig> valid = ValidConfig::Check(config);
  if (!valid.ok()) return valid.status();
  return PlanStepLocally(batch, *valid);
}

absl::StatusOr<StepPlan> PlanStepLocally(const std::vector<Sample>& batch,
                                         const ValidConfig& config) {
  const LatencyModel model(config.get().shape, config.get().ranks, kDefaultCostPrior);
  absl::StatusOr<StepPlan> plan = PlanStep(batch, config, model);
  if (plan.ok()) plan->planned_locally = true;
  return plan;
}

absl::StatusOr<StepPlan> PlanStep(const std::vector<Sample>& batch, const PlannerConfig& config,
                                  const LatencyModel& model) {
  absl::StatusOr<ValidConfig> valid = ValidConfig::Check(config);
  if (!valid.ok()) return valid.status();
  return PlanStep(batch, *valid, model);
}

absl::StatusOr<StepPlan> PlanStep(const std::vector<Sample>& batch, const ValidConfig& valid,
                                  const LatencyModel& model) {
  const RecallModel prior(valid.get().micro_batch_capacity, valid.get().shape.layers);
  return PlanStep(batch, valid, model, prior);
}

absl::StatusOr<StepPlan> PlanStep(const std::vector<Sample>& batch, const ValidConfig& valid,
                                  const LatencyModel& model, const RecallModel& recall,
                                  PlanThreads* threads, PlanPhaseSeconds* phases) {
  const PlannerConfig& config = valid.get();
  // Phase(k) ends phase k (kPlanPhaseNames) where the last one ended: a clock read per phase,
  // and none without `phases`.
  using Clock = std::chrono::steady_clock;
  Clock::time_point phase_start;
  if (phases != nullptr) {
    phases->fill(0.0);
    phase_start = Clock::now();
  }
  auto phase = [&](int k) {
    if (phases == nullptr) return;
    const Clock::time_point now = Clock::now();
    (*phases)[k] = std::chrono::duration<double>(now - phase_start).count();
    phase_start = now;
  };
  if (model.ranks() != config.ranks) {
    return absl::InvalidArgumentError(absl::StrCat("the latency model has ", model.ranks(),
                                                   " ranks but config.ranks is ", config.ranks));
  }
  if (recall.capacity() != config.micro_batch_capacity || recall.layers() != config.shape.layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the recall model is for capacity ", recall.capacity(), " and ", recall.layers(),
        " layers but the config has ", config.micro_batch_capacity, " and ", config.shape.layers));
  }
  if (absl::Status status = ValidateBatch(batch, valid, threads); !status.ok()) return status;
  phase(0);
  // Every policy keeps the document recall floor (where density_max reaches it): the table's
  // base densities include it.
  const SampleTable table(batch, config, model, recall, threads);
  const std::vector<double> defaults = table.BaseDensities();
  const bool tuned = config.policy == Policy::kDst || config.policy == Policy::kSparseBalance;
  // bucket_recall_margin 1 turns the bucket guard off (no bucket can lose more than 1).
  const bool guarded =
      tuned && config.dst_mode != DstMode::kMin && config.bucket_recall_margin < 1.0;
  // At the defaults every recall is the table's own (its base), so the sums may run on threads.
  const double default_recall = tuned ? TableRecall(batch, defaults, table, {}, threads) : 0.0;
  phase(1);
  std::vector<double> densities =
      config.policy == Policy::kSparseBalance
          ? AllocateDensities(batch, config, model, table, defaults, default_recall,
                              /*per_bucket=*/guarded, threads)
          : defaults;
  phase(2);
  // The guards below sum the allocated densities' recalls in batch order: worked out on the
  // threads first (a DetLog and a DetExp each, 2.4 ms serial at 65,536 samples), beside the
  // placement's serial sort and deal of units to parts (which read neither the recalls nor the
  // table).
  // With the bucket guard, its sums too, block by block (BlockSums' blocks) as if every sample
  // were placed: they are unless some are deferred or split, and then the sums are taken again.
  const size_t blocks = SumBlocks(batch.size());
  std::vector<BucketSums> guard_blocks(guarded ? blocks : 0);
  const std::vector<double> every_sample;  // BucketTotals' weights: all placed
  // And, where the blocks run on a helper beside the placement's serial sort and deal
  // (ParallelBeside), the tuner's records of the samples at these densities (TunerSamples): its
  // set-up then reads one cache line per sample in placement order instead of about four, and the
  // helper had time to spare there. On one thread the records' pass costs about what it saves.
  const bool tuner_records = tuned && threads != nullptr && threads->size() > 1 && blocks > 1;
  TunerSamples tuner_samples(tuner_records ? batch.size() : 0);
  auto warm_blocks = [&](size_t first, size_t last) {
    for (size_t b = first; b < last; ++b) {
      const auto [begin, end] = SumBlock(b, batch.size());
      table.WarmRecalls(densities, begin, end);
      if (tuner_records) tuner_samples.Fill(table, config, densities, begin, end);
      if (guarded) {
        guard_blocks[b] = BucketBlockSums(b, batch, defaults, table, every_sample, &densities);
      }
    }
  };
  const SideLoop warm{blocks, warm_blocks, blocks};
  absl::StatusOr<Assignment> assignment =
      AssignSamples(batch, config, model, densities, &table, threads, tuned ? &warm : nullptr);
  if (!assignment.ok()) return assignment.status();
  phase(3);
  if (tuned) {
    // The recall every tuned plan keeps (but in kMin): that of the samples it places, at the
    // default densities, in total and per length bucket (less the bucket margin). Deferred
    // samples do not count: they are planned next step.
    double keep = default_recall;
    std::vector<double> placed;
    if (!assignment->deferred.empty() || !assignment->shards.empty()) {
      placed.assign(batch.size(), 1.0);
      for (int i : assignment->deferred) placed[i] = 0.0;
      keep = TableRecall(batch, defaults, table, placed, threads);
    }
    // Per bucket, the recalls at the defaults (for the minimums) and at the allocated densities,
    // in one pass (two passes over the batch cost 0.34 ms on two threads at 65,536 samples).
    std::vector<double> minimum;
    std::vector<double> allocated;
    if (guarded) {
      minimum = BucketMinimums(
          placed.empty()
              ? BucketRecallsOf(JoinBlocks(guard_blocks), &allocated)
              : BucketRecalls(batch, defaults, table, placed, threads, &densities, &allocated),
          config.bucket_recall_margin);
    }
    // The step-level allocation was made for the whole batch; if deferring left the placed
    // samples with less recall than their defaults (in total), or a bucket below its minimum
    // (a pre-packed sample's documents may sit in buckets other than the one it was allocated
    // with), tune from the defaults instead: the guards' fallbacks need a base that meets them.
    bool allocated_kept = true;  // else the tuner's records are not for `densities`
    if ((!placed.empty() && TableRecall(batch, densities, table, placed, threads) < keep) ||
        (guarded && !MeetsMinimums(allocated, minimum))) {
      densities = defaults;
      allocated_kept = false;
    }
    if (!assignment->shards.empty()) {
      // DST tunes the unsplit samples; the split documents' recall counts towards the guards
      // at the densities they keep.
      std::vector<double> items = placed;
      for (const ShardedDocument& d : assignment->shards) items[d.sample] = 0.0;
      ItemMinimums(batch, densities, table, placed, items, &keep, &minimum);
    }
    phase(4);
    densities = TuneDensities(batch, *assignment, config, model, table, densities, keep, minimum,
                              threads, tuner_records && allocated_kept ? &tuner_samples : nullptr);
    phase(5);
  }
  StepPlan plan =
      BuildPlan(batch, config, model, recall, table, *assignment, densities, defaults, threads);
  RecycleAssignment(*std::move(assignment));
  phase(6);
  return plan;
}

StepPlan BuildPlan(const std::vector<Sample>& batch, const PlannerConfig& config,
                   const LatencyModel& model, const Assignment& assignment,
                   const std::vector<double>& densities) {
  const RecallModel prior(config.micro_batch_capacity, config.shape.layers);
  std::vector<double> defaults(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    defaults[i] = BaseDensity(batch[i].sensitivity, config);
  }
  return BuildPlan(batch, config, model, prior, assignment, densities, defaults);
}

StepPlan BuildPlan(const std::vector<Sample>& batch, const PlannerConfig& config,
                   const LatencyModel& model, const RecallModel& recall,
                   const Assignment& assignment, const std::vector<double>& densities,
                   const std::vector<double>& defaults) {
  const SampleTable table(batch, config, model, recall);
  return BuildPlan(batch, config, model, recall, table, assignment, densities, defaults);
}

namespace {

// What BuildPlan reads of a whole sample at its planned density, gathered in batch order (one
// cache line a sample) before the ranks are built: the build walks the samples in placement
// order, scattered over the batch, and reading the sample, its density and default, its terms
// and the table's kept recall and block count there (seven lines a sample) kept the CPU's
// outstanding fetches full; the build was waiting on memory for most of its time.
struct alignas(64) BuildRecord {
  uint64_t id;
  int64_t length;
  double density;
  double recall;          // SampleTable::Recall at `density`
  double default_recall;  // and at the sample's default density
  double active_blocks;   // SampleTable::ActiveBlocksAt `density` (not with per-layer densities)
  double piece;           // its largest indivisible piece (BuildPlan), likewise
  int32_t documents;      // the features' documents: its segments, or 1
  int8_t bucket;          // RecallBucket of a one-document sample
  bool segmented;         // it has segments (read from the batch then)
};
static_assert(sizeof(BuildRecord) == 64);

struct BuildStorage {
  std::vector<BuildRecord> records;
};

}  // namespace

StepPlan BuildPlan(const std::vector<Sample>& batch, const PlannerConfig& config,
                   const LatencyModel& model, const RecallModel& recall, const SampleTable& table,
                   const Assignment& assignment, const std::vector<double>& densities,
                   const std::vector<double>& defaults, PlanThreads* threads) {
  std::vector<BucketRecallFigures> buckets(kRecallBuckets);
  const bool per_layer = PlansLayerDensities(config, recall, batch.size());
  StepPlan plan;
  plan.policy = config.policy;
  plan.ranks.resize(assignment.ranks.size());
  // Shards by (rank, micro-batch): (sample id, split document, shard) in ascending id, the
  // order every rank of a group runs them in.
  std::map<std::pair<int, int>, std::vector<std::tuple<uint64_t, int, int>>> shards_at;
  for (size_t k = 0; k < assignment.shards.size(); ++k) {
    const ShardedDocument& d = assignment.shards[k];
    for (size_t j = 0; j < d.group.size(); ++j) {
      shards_at[{d.group[j], d.micro_batch}].emplace_back(batch[d.sample].id, static_cast<int>(k),
                                                          static_cast<int>(j));
    }
  }
  for (auto& [at, list] : shards_at) std::sort(list.begin(), list.end());
  // A split document sits on several ranks, which may be built on different threads: its
  // recalls are read here, once, so that the table's per-sample memo is not written from two.
  std::vector<std::pair<double, double>> shard_recalls(assignment.shards.size());
  for (size_t k = 0; k < assignment.shards.size(); ++k) {
    const int i = assignment.shards[k].sample;
    const double at = table.Recall(i, densities[i]);
    shard_recalls[k] = {at, defaults[i] == densities[i] ? at : table.Recall(i, defaults[i])};
  }
  // Each rank's share of the plan's figures, summed in plan order on the rank's thread as its
  // samples are planned; the ranks' shares are summed after, in rank order. (One pass over
  // every planned sample after the build, serial, took about 2 ms at 65,536 samples; a pass
  // over each rank's built samples after it was built, with their addends kept for it, about
  // 0.6 ms of a 6 ms build on one thread.)
  struct RankFigures {
    double raw = 0.0;       // seconds, speed excluded
    double exchange = 0.0;  // the shards' key/value exchange in it
    double largest = 0.0;   // seconds, speed excluded: the largest indivisible piece
    double weighted_density = 0.0;
    double weighted_recall = 0.0;
    double tokens = 0.0;
    struct Bucket {
      int64_t tokens = 0;
      double predicted_recall = 0.0;
      double default_recall = 0.0;
    };
    std::array<Bucket, kRecallBuckets> buckets{};
  };
  std::vector<RankFigures> rank_figures(assignment.ranks.size());
  // A sample's largest indivisible piece from its features (see `add` below).
  auto piece_of = [&](const Sample& s, size_t i, const MicroBatchFeatures& f) {
    if (config.max_shards > 1 && Splittable(s)) {
      return model.SampleSeconds(s, densities[i]) / config.max_shards;
    }
    return model.Seconds(f) /* includes the micro-batch term */;
  };
  // Every sample's record (BuildRecord), in batch order on the threads: each sample's kept
  // answers in the table from one thread. Untuned samples (every sample of an untuned policy)
  // keep their default density and its recall.
  ThreadScratch<BuildStorage> build_storage(batch.size());
  std::vector<BuildRecord>& kept_records = build_storage->records;
  if (kept_records.size() < batch.size()) kept_records.resize(batch.size());
  BuildRecord* const records = kept_records.data();
  ParallelFor(threads, batch.size(), [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const Sample& s = batch[i];
      BuildRecord& record = records[i];
      const double rho = densities[i];
      record.id = s.id;
      record.length = s.length;
      record.density = rho;
      record.recall = table.Recall(i, rho);
      record.default_recall = defaults[i] == rho ? record.recall : table.Recall(i, defaults[i]);
      record.segmented = !s.segments.empty();
      record.documents = record.segmented ? static_cast<int32_t>(s.segments.size()) : 1;
      record.bucket = static_cast<int8_t>(RecallBucket(s.length, config.micro_batch_capacity));
      if (!per_layer) {
        const MicroBatchFeatures f = table.FeaturesAt(s, i, rho);
        record.active_blocks = f.active_blocks;
        record.piece = piece_of(s, i, f);
      }
    }
  });
  // Allocates rank r's micro-batches and room for their samples, and asks the CPU to fetch that
  // room, one rank ahead of the rank being built: freshly allocated, it is not in the cache, and
  // writing a planned sample there waited for its lines (the build took 2.30-2.50 ms at 65,536
  // samples on 2 threads without this, 1.94-2.11 ms with it).
  auto allocate_rank = [&](size_t r) {
    std::vector<MicroBatchPlan>& micro_batches = plan.ranks[r].micro_batches;
    micro_batches.resize(assignment.ranks[r].size());
    for (size_t m = 0; m < micro_batches.size(); ++m) {
      std::vector<PlannedSample>& samples = micro_batches[m].samples;
      samples.reserve(assignment.ranks[r][m].size());
      const char* const room = reinterpret_cast<const char*>(samples.data());
      const size_t bytes = samples.capacity() * sizeof(PlannedSample);
      for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(room + b, /*rw=*/1);
    }
  };
  // Builds rank r (allocated); `order` holds the samples its thread plans in the order it plans
  // them, and `next` is the index there of the rank's first, moved past its last.
  auto build_rank = [&](size_t r, const std::vector<int>& order, size_t& next) {
    RankPlan& rank = plan.ranks[r];
    RankFigures& figures = rank_figures[r];
    for (size_t m = 0; m < assignment.ranks[r].size(); ++m) {
      const std::vector<int>& members = assignment.ranks[r][m];
      MicroBatchPlan& mb = rank.micro_batches[m];
      mb.default_density = config.density_default;
      MicroBatchFeatures features;
      // One planned sample (a whole sample, or shard `shard` of split document `split`, the
      // assignment's shards[k]), and what it adds to the rank's figures.
      auto add = [&](int i, const ShardedDocument* split, int shard, size_t k) {
        const BuildRecord& record = records[i];
        // From a full initializer: `emplace_back()` value-initialized the 120 bytes with a
        // `rep stos`, whose start-up cost a fifth of the build (1.80-1.90 ms without it
        // against 2.06-2.19 at 65,536 samples on 2 threads).
        PlannedSample& planned = mb.samples.emplace_back(
            PlannedSample{record.id, record.length, record.density, {}, {}, 0, 0, 0, {}});
        // Most samples have no segments: skip the copy's call (2M instructions a plan).
        if (record.segmented) planned.segments = batch[i].segments;
        if (split != nullptr) {
          planned.shard_begin = split->cuts[shard];
          planned.shard_end = split->cuts[shard + 1];
          planned.shard_index = shard;
          planned.shard_group = split->group;
        }
        if (per_layer) {
          PlannedLayerDensities(batch[i], record.density, config, recall, &planned.layer_densities);
        }
        // What follows reads the sample's fields from its record and the split, not back from
        // `planned`, whose just-written bytes a load may have to wait for.
        const int64_t query_tokens = split != nullptr && !split->group.empty()
                                         ? split->cuts[shard + 1] - split->cuts[shard]
                                         : record.length;  // planned.QueryTokens()
        mb.tokens += query_tokens;
        // A whole sample at one density has the features placement and tuning counted last
        // (SampleTable::FeaturesAt, kept in its record).
        // The record has them unless the job plans per-layer densities.
        const bool from_record = split == nullptr && !per_layer;
        MicroBatchFeatures f;
        if (from_record) {
          f.active_blocks = record.active_blocks;
          f.tokens = static_cast<double>(record.length);
          f.documents = static_cast<double>(record.documents);
        } else if (split == nullptr && planned.layer_densities.empty()) {
          f = table.FeaturesAt(batch[i], i, record.density);
        } else {
          f = model.PlannedSampleFeatures(planned);
        }
        features.active_blocks += f.active_blocks;
        features.tokens += f.tokens;
        features.documents += f.documents;
        features.exchange_bytes += f.exchange_bytes;
        figures.exchange += model.ExchangeSeconds(f);
        // The largest indivisible piece: a whole sample, or with splitting allowed a
        // splittable document's share of it on max_shards ranks (a lower bound on its largest
        // shard: the exchange and per-shard overheads only add).
        const double piece = from_record ? record.piece : piece_of(batch[i], i, f);
        figures.largest = std::max(figures.largest, piece);
        double sample_recall = 0.0;
        double default_recall = 0.0;
        if (split != nullptr) {
          std::tie(sample_recall, default_recall) = shard_recalls[k];
        } else {
          sample_recall = record.recall;  // SampleRecall
          default_recall = record.default_recall;
        }
        // Figures weigh each planned sample by its query tokens: a split document's shards add
        // up to its length.
        const auto w = static_cast<double>(query_tokens);
        figures.weighted_density += w * record.density;  // planned.density
        figures.weighted_recall += w * sample_recall;
        figures.tokens += w;
        // Buckets are per document: a pre-packed sample's documents may fall in several.
        auto add_document = [&](int64_t length, int bucket) {
          RankFigures::Bucket& b = figures.buckets[bucket];
          const int64_t t = split != nullptr ? query_tokens : length;
          b.tokens += t;
          const auto dw = static_cast<double>(t);
          b.predicted_recall += dw * sample_recall;
          b.default_recall += dw * default_recall;
        };
        if (!record.segmented) {
          add_document(record.length, record.bucket);
        } else {
          for (int64_t length : batch[i].segments) {
            add_document(length, RecallBucket(length, config.micro_batch_capacity));
          }
        }
      };
      if (auto it = shards_at.find({static_cast<int>(r), static_cast<int>(m)});
          it != shards_at.end()) {
        for (const auto& [id, k, j] : it->second) {
          add(assignment.shards[k].sample, &assignment.shards[k], j, k);
        }
      }
      for (int i : members) {
        if (next + kFetchAhead < order.size()) {
          __builtin_prefetch(&records[order[next + kFetchAhead]]);
        }
        ++next;
        add(i, nullptr, 0, 0);
      }
      mb.features = features;
      mb.features_known = true;
      const double raw = model.Seconds(features);
      figures.raw += raw;
      mb.predicted_seconds = model.speed_factor(static_cast<int>(r)) * raw;
      rank.predicted_seconds += mb.predicted_seconds;
    }
  };
  ParallelFor(threads, assignment.ranks.size(), [&](size_t begin, size_t end) {
    // The range's placed samples in the order they are planned, whose records are fetched
    // kFetchAhead ahead: the assignment scatters them over the batch.
    std::vector<int> order;
    for (size_t r = begin; r < end; ++r) {
      for (const std::vector<int>& members : assignment.ranks[r]) {
        order.insert(order.end(), members.begin(), members.end());
      }
    }
    size_t next = 0;
    if (begin < end) allocate_rank(begin);
    for (size_t r = begin; r < end; ++r) {
      if (r + 1 < end) allocate_rank(r + 1);
      build_rank(r, order, next);
    }
  });
  double total_raw = 0.0;       // seconds, speed excluded
  double total_exchange = 0.0;  // the shards' key/value exchange in it
  double largest_sample = 0.0;  // seconds, speed excluded, alone in a micro-batch
  double weighted_density = 0.0;
  double weighted_recall = 0.0;
  double tokens = 0.0;
  for (const RankFigures& f : rank_figures) {
    total_raw += f.raw;
    total_exchange += f.exchange;
    largest_sample = std::max(largest_sample, f.largest);
    weighted_density += f.weighted_density;
    weighted_recall += f.weighted_recall;
    tokens += f.tokens;
    for (int b = 0; b < kRecallBuckets; ++b) {
      buckets[b].tokens += f.buckets[b].tokens;
      buckets[b].predicted_recall += f.buckets[b].predicted_recall;
      buckets[b].default_recall += f.buckets[b].default_recall;
    }
  }
  for (int i : assignment.deferred) plan.deferred_ids.push_back(batch[i].id);
  std::vector<double> rank_seconds;
  std::vector<double> speed_factors;
  for (int r = 0; r < static_cast<int>(plan.ranks.size()); ++r) {
    plan.makespan_seconds = std::max(plan.makespan_seconds, plan.ranks[r].predicted_seconds);
    rank_seconds.push_back(plan.ranks[r].predicted_seconds);
    speed_factors.push_back(model.speed_factor(r));
  }
  // With splitting allowed the bound's work leaves out the exchange (a plan that splits less
  // exchanges less) and its largest piece is a splittable document's share (see above).
  plan.lower_bound_seconds =
      MakespanLowerBound(total_raw - total_exchange, largest_sample, speed_factors);
  plan.gap =
      plan.lower_bound_seconds > 0 ? plan.makespan_seconds / plan.lower_bound_seconds - 1.0 : 0.0;
  plan.imbalance_ratio = ImbalanceRatio(rank_seconds);
  plan.bubble_ratio = BubbleRatio(rank_seconds);
  plan.mean_density = tokens > 0 ? weighted_density / tokens : 0.0;
  plan.predicted_recall = tokens > 0 ? weighted_recall / tokens : 0.0;
  for (int b = 0; b < kRecallBuckets; ++b) {
    BucketRecallFigures& figures = buckets[b];
    if (figures.tokens == 0) continue;
    figures.bucket = b;
    figures.label = RecallBucketLabel(b, config.micro_batch_capacity);
    const LengthRange range = RecallBucketRange(b, config.micro_batch_capacity);
    figures.length_min = range.min;
    figures.length_max = range.max;
    figures.predicted_recall /= static_cast<double>(figures.tokens);
    figures.default_recall /= static_cast<double>(figures.tokens);
    plan.buckets.push_back(figures);
  }
  return plan;
}

absl::Status CheckPlan(const StepPlan& plan, const std::vector<Sample>& batch,
                       const PlannerConfig& config) {
  auto fail = [](auto&&... parts) {
    return absl::FailedPreconditionError(absl::StrCat("plan check: ", parts...));
  };
  const SamplesById by_id = IndexSamplesById(batch);
  std::vector<int> seen(batch.size(), 0);
  std::map<uint64_t, int> rank_of_group;
  std::map<size_t, std::vector<PlacedShard>> shards_of;  // by batch index
  if (static_cast<int>(plan.ranks.size()) != config.ranks) {
    return fail("plan has ", plan.ranks.size(), " ranks, config has ", config.ranks);
  }
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    const RankPlan& rank = plan.ranks[r];
    // Its micro-batches, capacity and layer densities (the deferred ids are the whole step's).
    if (absl::Status s = CheckRankPlan(by_id, rank.micro_batches, {}, config); !s.ok()) {
      return fail("rank ", r, " ", s.message());
    }
    for (size_t m = 0; m < rank.micro_batches.size(); ++m) {
      const MicroBatchPlan& mb = rank.micro_batches[m];
      int64_t tokens = 0;
      for (size_t k = 0; k < mb.samples.size(); ++k) {
        const PlannedSample& p = mb.samples[k];
        auto it = by_id.find(p.id);
        if (it == by_id.end()) {
          return fail("rank ", r, " micro-batch ", m, " holds id ", p.id,
                      " that is not in the batch");
        }
        const Sample& s = *it->second;
        const size_t index = it->second - batch.data();
        if (p.sharded()) {
          if (absl::Status st =
                  NoteShard(p, index, static_cast<int>(r), static_cast<int>(m), &shards_of);
              !st.ok()) {
            return st;
          }
        } else {
          ++seen[index];
        }
        if (p.length != s.length || p.segments != s.segments) {
          return fail("sample id ", s.id, " is planned with ", p.length, " tokens in ",
                      p.segments.size(), " segments; the batch has ", s.length, " in ",
                      s.segments.size());
        }
        tokens += p.QueryTokens();
        const double rho = p.density;
        const double floor = DensityFloor(s.sensitivity, config);
        if (!(rho >= floor - kDensitySlack && rho <= config.density_max + kDensitySlack)) {
          return fail("sample id ", s.id, " has density ", rho, " outside [floor ", floor,
                      ", density_max ", config.density_max, "]");
        }
        for (double layer : p.layer_densities) {
          if (!(layer >= floor - kDensitySlack && layer <= config.density_max + kDensitySlack)) {
            return fail("sample id ", s.id, " has layer density ", layer, " outside [floor ", floor,
                        ", density_max ", config.density_max, "]");
          }
        }
        if (s.group != 0) {
          auto [g, inserted] = rank_of_group.emplace(s.group, static_cast<int>(r));
          if (!inserted && g->second != static_cast<int>(r)) {
            return fail("group ", s.group, " is split over ranks ", g->second, " and ", r);
          }
        }
      }
      if (tokens != mb.tokens) {
        return fail("rank ", r, " micro-batch ", m, " says ", mb.tokens, " tokens, holds ", tokens);
      }
    }
  }
  // Every split document: its shards cover its tokens once, in order, on its group.
  for (auto& [i, shards] : shards_of) {
    if (absl::Status st = CheckShards(batch[i], config, &shards); !st.ok()) return st;
    ++seen[i];
  }
  for (uint64_t id : plan.deferred_ids) {
    auto it = by_id.find(id);
    if (it == by_id.end()) return fail("deferred id ", id, " is not in the batch");
    ++seen[it->second - batch.data()];
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    if (seen[i] != 1) {
      return fail("sample id ", batch[i].id, " appears ", seen[i], " times (want exactly once)");
    }
  }
  return absl::OkStatus();
}

std::string CanonicalPlanText(const StepPlan& plan) {
  std::string out = absl::StrCat("policy ", PolicyName(plan.policy), "\n");
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    absl::StrAppend(&out, "rank ", r, absl::StrFormat(" %a\n", plan.ranks[r].predicted_seconds));
    for (const MicroBatchPlan& mb : plan.ranks[r].micro_batches) {
      absl::StrAppend(
          &out, " mb",
          absl::StrFormat(" %d %a %a:", mb.tokens, mb.predicted_seconds, mb.default_density));
      for (const PlannedSample& p : mb.samples) {
        absl::StrAppend(&out, absl::StrFormat(" %d:%d", p.id, p.length));
        if (!p.segments.empty()) absl::StrAppend(&out, "[", absl::StrJoin(p.segments, ","), "]");
        absl::StrAppend(&out, absl::StrFormat("@%a", p.density));
        for (double d : p.layer_densities) absl::StrAppend(&out, absl::StrFormat("/%a", d));
        if (p.sharded()) {
          absl::StrAppend(&out, "{", p.shard_begin, "-", p.shard_end, "#", p.shard_index, "@",
                          absl::StrJoin(p.shard_group, ","), "}");
        }
      }
      out += "\n";
    }
  }
  out += "deferred";
  for (uint64_t id : plan.deferred_ids) absl::StrAppend(&out, " ", id);
  absl::StrAppend(&out,
                  absl::StrFormat("\nfigures %a %a %a %a %a %a %a\n", plan.makespan_seconds,
                                  plan.lower_bound_seconds, plan.gap, plan.imbalance_ratio,
                                  plan.bubble_ratio, plan.mean_density, plan.predicted_recall));
  return out;
}

}  // namespace sparsebalance
