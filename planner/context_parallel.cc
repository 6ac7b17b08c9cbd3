#include "planner/context_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "contract/block_geometry.h"

namespace sparsebalance {
namespace {

// Bisection steps of CostBalancedCuts: the largest shard to within 2^-24 of the first guess.
constexpr int kCutIterations = 24;

// Tokens of query blocks [first_row, end_row) of a document of `length` tokens.
int64_t RowTokens(int64_t length, int block, int64_t first_row, int64_t end_row) {
  return std::min(end_row * block, length) - first_row * block;
}

// A document chosen for splitting, before placement.
struct Candidate {
  int sample = 0;
  std::vector<int64_t> cuts;
  std::vector<double> cost;    // per shard, in the placer's metric
  double largest = 0.0;        // the largest of `cost`
  int64_t largest_tokens = 0;  // tokens of the largest shard by tokens
};

class ShardPlacer {
 public:
  ShardPlacer(const PlannerConfig& config, const std::vector<double>& speed, ShardLayout* layout)
      : config_(config), speed_(speed), layout_(*layout) {
    layout_.rank_load.assign(config.ranks, 0.0);
    layout_.tokens.assign(static_cast<size_t>(config.ranks) * config.micro_batches, 0);
    for (int r = 0; r < config.ranks; ++r) by_time_.insert({0.0, r});
  }

  // Places the shards of `c` on the least loaded ranks with room in one micro-batch; false
  // when no micro-batch has enough such ranks.
  bool PlaceDynamic(const Candidate& c) {
    const int shards = static_cast<int>(c.cost.size());
    // Shards by cost, heaviest first, go to the chosen ranks by time, least loaded first.
    std::vector<int> order(shards);
    for (int j = 0; j < shards; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return c.cost[a] > c.cost[b]; });
    int best_m = -1;
    double best_score = 0.0;
    std::vector<int> best_ranks;
    std::vector<int> ranks;
    for (int m = 0; m < config_.micro_batches; ++m) {
      ranks.clear();
      for (const auto& [time, r] : by_time_) {
        if (Capacity() - Tokens(r, m) >= c.largest_tokens) ranks.push_back(r);
        if (static_cast<int>(ranks.size()) == shards) break;
      }
      if (static_cast<int>(ranks.size()) < shards) continue;
      double score = 0.0;
      for (int k = 0; k < shards; ++k) {
        const int r = ranks[k];
        score = std::max(score, speed_[r] * (layout_.rank_load[r] + c.cost[order[k]]));
      }
      if (best_m < 0 || score < best_score) {
        best_m = m;
        best_score = score;
        best_ranks = ranks;
      }
    }
    if (best_m < 0) return false;
    std::vector<int> group(shards);
    for (int k = 0; k < shards; ++k) group[order[k]] = best_ranks[k];
    Commit(c, best_m, std::move(group));
    return true;
  }

  // Places the shards of `c` on one fixed group of consecutive ranks (kStatic).
  bool PlaceStatic(const Candidate& c) {
    const int shards = static_cast<int>(c.cost.size());
    const int groups = config_.ranks / shards;
    int best_g = -1;
    int best_m = -1;
    double best_score = 0.0;
    for (int g = 0; g < groups; ++g) {
      for (int m = 0; m < config_.micro_batches; ++m) {
        double score = 0.0;
        bool fits = true;
        for (int j = 0; j < shards && fits; ++j) {
          const int r = g * shards + j;
          fits = Capacity() - Tokens(r, m) >= c.cuts[j + 1] - c.cuts[j];
          score = std::max(score, speed_[r] * (layout_.rank_load[r] + c.cost[j]));
        }
        if (fits && (best_g < 0 || score < best_score)) {
          best_g = g;
          best_m = m;
          best_score = score;
        }
      }
    }
    if (best_g < 0) return false;
    std::vector<int> group(shards);
    for (int j = 0; j < shards; ++j) group[j] = best_g * shards + j;
    Commit(c, best_m, std::move(group));
    return true;
  }

 private:
  int64_t Capacity() const { return config_.micro_batch_capacity; }
  int64_t& Tokens(int r, int m) {
    return layout_.tokens[static_cast<size_t>(r) * config_.micro_batches + m];
  }

  void Commit(const Candidate& c, int m, std::vector<int> group) {
    for (size_t j = 0; j < group.size(); ++j) {
      const int r = group[j];
      by_time_.erase({speed_[r] * layout_.rank_load[r], r});
      layout_.rank_load[r] += c.cost[j];
      Tokens(r, m) += c.cuts[j + 1] - c.cuts[j];
      by_time_.insert({speed_[r] * layout_.rank_load[r], r});
    }
    layout_.sharded[c.sample] = 1;
    layout_.documents.push_back({c.sample, m, std::move(group), c.cuts});
  }

  const PlannerConfig& config_;
  const std::vector<double>& speed_;
  ShardLayout& layout_;
  std::set<std::pair<double, int>> by_time_;  // (speed x load, rank)
};

}  // namespace

double ShardSeconds(const LatencyModel& model, int64_t length, int64_t begin, int64_t end,
                    double density) {
  const ModelShape& shape = model.shape();
  const CostCoefficients c = model.coefficients();
  const int64_t first_row = begin / shape.block_size;
  const int64_t end_row = QueryBlocks(std::min(end, length), shape.block_size);
  const double blocks =
      static_cast<double>(ActiveBlocksInRows(first_row, end_row, density, shape.local_blocks));
  return c.per_block * blocks + c.per_token * static_cast<double>(end - begin) + c.per_sample +
         model.exchange_seconds_per_byte() * ShardExchangeBytes(shape, begin);
}

std::vector<int64_t> CostBalancedCuts(const LatencyModel& model, int64_t length, double density,
                                      int shards, int64_t capacity, double* largest) {
  const ModelShape& shape = model.shape();
  const int block = shape.block_size;
  const int64_t rows = QueryBlocks(length, block);
  if (shards < 1 || rows < shards) return {};
  // ShardSeconds from a prefix sum of the rows' kept blocks: the bisection below evaluates
  // thousands of candidate shards, each then O(1).
  const CostCoefficients c = model.coefficients();
  const double per_byte = model.exchange_seconds_per_byte();
  const int64_t q = QuantizeDensity(density);
  std::vector<int64_t> kept(rows + 1, 0);
  for (int64_t i = 0; i < rows; ++i) kept[i + 1] = kept[i] + KeptBlocks(i, q, shape.local_blocks);
  auto cost = [&](int64_t first_row, int64_t end_row) {
    const int64_t begin = first_row * block;
    return c.per_block * static_cast<double>(kept[end_row] - kept[first_row]) +
           c.per_token * static_cast<double>(std::min(end_row * block, length) - begin) +
           c.per_sample + per_byte * ShardExchangeBytes(shape, begin);
  };
  // Greedy for a bound on the largest shard: each shard but the last takes the most rows that
  // keep it within `bound` and `capacity` and leave a row for each shard after it.
  std::vector<int64_t> row_cuts(shards + 1, 0);
  auto fits = [&](double bound, std::vector<int64_t>* out) {
    int64_t first = 0;
    (*out)[0] = 0;
    for (int j = 0; j + 1 < shards; ++j) {
      int64_t lo = first + 1;
      int64_t hi = rows - (shards - 1 - j);
      auto ok = [&](int64_t end) {
        return RowTokens(length, block, first, end) <= capacity && cost(first, end) <= bound;
      };
      if (lo > hi || !ok(lo)) return false;
      while (lo < hi) {  // the largest end in [lo, hi] that is ok (ok is monotone in end)
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (ok(mid)) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      first = lo;
      (*out)[j + 1] = first;
    }
    (*out)[shards] = rows;
    return RowTokens(length, block, first, rows) <= capacity && cost(first, rows) <= bound;
  };
  if (!fits(std::numeric_limits<double>::infinity(), &row_cuts)) return {};
  double hi = 0.0;
  for (int j = 0; j < shards; ++j) hi = std::max(hi, cost(row_cuts[j], row_cuts[j + 1]));
  double lo = 0.0;
  std::vector<int64_t> trial(shards + 1, 0);
  for (int iter = 0; iter < kCutIterations; ++iter) {
    const double mid = 0.5 * (lo + hi);
    if (fits(mid, &trial)) {
      hi = mid;
      row_cuts = trial;
    } else {
      lo = mid;
    }
  }
  std::vector<int64_t> cuts(shards + 1);
  double worst = 0.0;
  for (int j = 0; j <= shards; ++j) cuts[j] = std::min(row_cuts[j] * block, length);
  for (int j = 0; j < shards; ++j) worst = std::max(worst, cost(row_cuts[j], row_cuts[j + 1]));
  if (largest != nullptr) *largest = worst;
  return cuts;
}

std::vector<int64_t> EqualTokenCuts(int64_t length, int block_size, int shards, int64_t capacity) {
  const int64_t rows = QueryBlocks(length, block_size);
  if (shards < 1 || rows < shards) return {};
  std::vector<int64_t> cuts(shards + 1);
  for (int j = 0; j <= shards; ++j) {
    cuts[j] = std::min(rows * j / shards * block_size, length);
  }
  for (int j = 0; j < shards; ++j) {
    if (cuts[j + 1] - cuts[j] > capacity) return {};
  }
  return cuts;
}

absl::StatusOr<ShardLayout> PlanShards(const std::vector<Sample>& batch,
                                       const PlannerConfig& config, const LatencyModel& model,
                                       const std::vector<double>& densities,
                                       const std::vector<double>& speed, double target_share,
                                       const std::vector<double>* costs) {
  ShardLayout layout;
  layout.sharded.assign(batch.size(), 0);
  ShardPlacer placer(config, speed, &layout);
  if (config.max_shards < 2) {
    return layout;
  }
  const int64_t capacity = config.micro_batch_capacity;
  const int block = config.shape.block_size;
  const bool dense = config.shard_policy == ShardPolicy::kDense;
  // Costs in the metric shards are chosen by: predicted seconds at the planned density, or at
  // density 1 for kDense.
  auto choice_density = [&](int i) { return dense ? 1.0 : densities[i]; };
  // ... and the metric the placer balances by (AssignSamples): the shards' loads must be in it.
  auto placer_cost = [&](int i, int64_t begin, int64_t end) {
    switch (config.policy) {
      case Policy::kTokens:
        return static_cast<double>(end - begin);
      case Policy::kFlops:
        return ShardSeconds(model, batch[i].length, begin, end, 1.0);
      default:
        return ShardSeconds(model, batch[i].length, begin, end, densities[i]);
    }
  };
  auto must_split = [&](const Sample& s) { return s.length > capacity; };
  auto refuse = [&](int i, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "samples[", i, "] (id ", batch[i].id, ", ", batch[i].length,
        " tokens) is longer than "
        "micro_batch_capacity ",
        capacity, " and ", why,
        "; raise max_shards, micro_batches or micro_batch_capacity, or use overflow policy "
        "defer"));
  };

  std::vector<Candidate> candidates;
  auto make = [&](int i, std::vector<int64_t> cuts) {
    Candidate c;
    c.sample = i;
    for (size_t j = 0; j + 1 < cuts.size(); ++j) {
      c.cost.push_back(placer_cost(i, cuts[j], cuts[j + 1]));
      c.largest = std::max(c.largest, c.cost.back());
      c.largest_tokens = std::max(c.largest_tokens, cuts[j + 1] - cuts[j]);
    }
    c.cuts = std::move(cuts);
    return c;
  };
  const int n = static_cast<int>(batch.size());
  if (config.shard_policy == ShardPolicy::kStatic) {
    const int64_t min_length = config.shard_min_length > 0 ? config.shard_min_length : capacity / 2;
    for (int i = 0; i < n; ++i) {
      const Sample& s = batch[i];
      if (!Splittable(s) || (s.length < min_length && !must_split(s))) continue;
      // max_shards equal shards; a document of fewer query blocks than that (each shard holds
      // at least one) gets as many as it has blocks, on a group of that many ranks. (It was
      // refused, or deferred every step under defer, though two shards would have held it.)
      // (Fewer shards than that are only longer.)
      const int most =
          static_cast<int>(std::min<int64_t>(config.max_shards, QueryBlocks(s.length, block)));
      std::vector<int64_t> cuts;
      if (most >= 2) cuts = EqualTokenCuts(s.length, block, most, capacity);
      if (cuts.empty()) {
        if (!must_split(s)) continue;
        if (config.overflow == OverflowPolicy::kError) {
          return refuse(i, absl::StrCat("max_shards ", config.max_shards,
                                        " equal shards of it do not fit the capacity"));
        }
        layout.unplaced.push_back(i);
        continue;
      }
      candidates.push_back(make(i, std::move(cuts)));
    }
  } else {
    double total = 0.0;
    std::vector<double> cost(n);
    for (int i = 0; i < n; ++i) {
      cost[i] = costs != nullptr ? (*costs)[i] : model.SampleSeconds(batch[i], choice_density(i));
      total += cost[i];
    }
    double inverse_speed = 0.0;
    for (int r = 0; r < config.ranks; ++r) inverse_speed += dense ? 1.0 : 1.0 / speed[r];
    const double target = target_share * total / inverse_speed;
    // Pieces also hold at most the same share of the mean rank's tokens: on ranks whose
    // micro-batches are nearly full, large pieces find no group with room.
    int64_t tokens = 0;
    for (const Sample& s : batch) tokens += s.length;
    const int64_t token_cap = std::min<int64_t>(
        capacity,
        std::max<int64_t>(block, static_cast<int64_t>(target_share * tokens / config.ranks)));
    for (int i = 0; i < n; ++i) {
      const Sample& s = batch[i];
      if (!Splittable(s) || (cost[i] <= target && s.length <= token_cap)) continue;
      const int least =
          static_cast<int>(std::max<int64_t>(2, (s.length + capacity - 1) / capacity));
      if (least > config.max_shards) {
        if (config.overflow == OverflowPolicy::kError) {
          return refuse(i, absl::StrCat("needs at least ", least, " shards, above max_shards ",
                                        config.max_shards));
        }
        layout.unplaced.push_back(i);
        continue;
      }
      // The fewest shards that bring the largest below the target, else the most even split.
      std::vector<int64_t> best;
      double best_largest = 0.0;
      // Each shard holds at least one query block: no more shards than the document has blocks
      // (a guess above that tried only counts that cannot cut it, and the document was refused,
      // or deferred every step under defer, though fewer shards would have held it).
      const int most =
          static_cast<int>(std::min<int64_t>(config.max_shards, QueryBlocks(s.length, block)));
      const int guess =
          static_cast<int>(std::min<double>(most, std::ceil(cost[i] / std::max(target, 1e-300))));
      // Cuts within the token cap where max_shards allows, else within the capacity.
      for (int64_t cap : {token_cap, capacity}) {
        for (int p = std::max(least, guess); p <= most; ++p) {
          double largest = 0.0;
          std::vector<int64_t> cuts =
              CostBalancedCuts(model, s.length, choice_density(i), p, cap, &largest);
          if (cuts.empty()) continue;
          if (best.empty() || largest < best_largest) {
            best = std::move(cuts);
            best_largest = largest;
          }
          if (best_largest <= target) break;
        }
        if (!best.empty()) break;
      }
      // Splitting a document that fits one micro-batch must make its largest piece cheaper
      // than the whole (the exchange can outweigh the rows it spreads).
      if (best.empty() || (!must_split(s) && best_largest >= cost[i])) {
        if (!must_split(s)) continue;
        if (config.overflow == OverflowPolicy::kError) {
          return refuse(i, "no split of it fits the capacity");
        }
        layout.unplaced.push_back(i);
        continue;
      }
      candidates.push_back(make(i, std::move(best)));
    }
  }
  // The heaviest pieces first, as the placer places its samples; ties in batch order.
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) { return a.largest > b.largest; });
  for (const Candidate& c : candidates) {
    const bool placed = config.shard_policy == ShardPolicy::kStatic ? placer.PlaceStatic(c)
                                                                    : placer.PlaceDynamic(c);
    if (placed || !must_split(batch[c.sample])) continue;
    if (config.overflow == OverflowPolicy::kError) {
      return refuse(c.sample, "no group of ranks has room for its shards in one micro-batch");
    }
    layout.unplaced.push_back(c.sample);
  }
  std::sort(layout.unplaced.begin(), layout.unplaced.end());
  return layout;
}

}  // namespace sparsebalance
