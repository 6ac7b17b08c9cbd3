#include "planner/sample_assigner.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "planner/recall_model.h"

namespace sparsebalance {
namespace {

// Candidate ranks (feasible, least loaded first) considered for each placement: more than
// one so that a much faster rank slightly behind in the queue can still win.
constexpr int kCandidates = 4;
// Placements whose resulting time is within this share of the best count as a tie, broken
// towards the rank with the least untunable work (so every rank keeps room for DST).
constexpr double kTieShare = 0.005;

// Ranks ordered by (time, rank) in an indexed binary heap: O(log R) updates, the first rank in
// O(1), and ranks in order by a best-first walk from the root, all on contiguous arrays (the
// planner visits a few of the least loaded ranks per sample, 65,536 times at scale).
template <bool kLargestFirst>
class RankHeap {
 public:
  explicit RankHeap(int ranks) : time_(ranks, 0.0), heap_(ranks), position_(ranks) {
    // Equal times: ordered by rank, which this initial layout already satisfies.
    for (int i = 0; i < ranks; ++i) {
      heap_[i] = kLargestFirst ? ranks - 1 - i : i;
      position_[heap_[i]] = i;
    }
  }

  void Update(int rank, double time) {
    time_[rank] = time;
    SiftUp(position_[rank]);
    SiftDown(position_[rank]);
  }
  int First() const { return heap_[0]; }

  // Calls visit(rank) for ranks in heap order until it returns false or all were visited.
  template <typename Visit>
  void VisitInOrder(Visit visit) {
    frontier_.clear();
    const auto later = [this](int a, int b) { return Before(heap_[b], heap_[a]); };
    frontier_.push_back(0);
    while (!frontier_.empty()) {
      std::pop_heap(frontier_.begin(), frontier_.end(), later);
      const int at = frontier_.back();
      frontier_.pop_back();
      if (!visit(heap_[at])) return;
      for (int child = 2 * at + 1; child <= 2 * at + 2; ++child) {
        if (child < static_cast<int>(heap_.size())) {
          frontier_.push_back(child);
          std::push_heap(frontier_.begin(), frontier_.end(), later);
        }
      }
    }
  }

 private:
  bool Before(int a, int b) const {
    if (time_[a] != time_[b]) return kLargestFirst ? time_[a] > time_[b] : time_[a] < time_[b];
    return kLargestFirst ? a > b : a < b;
  }
  void Swap(int i, int j) {
    std::swap(heap_[i], heap_[j]);
    position_[heap_[i]] = i;
    position_[heap_[j]] = j;
  }
  void SiftUp(int i) {
    while (i > 0 && Before(heap_[i], heap_[(i - 1) / 2])) {
      Swap(i, (i - 1) / 2);
      i = (i - 1) / 2;
    }
  }
  void SiftDown(int i) {
    const int n = static_cast<int>(heap_.size());
    while (true) {
      int best = i;
      for (int child = 2 * i + 1; child <= 2 * i + 2 && child < n; ++child) {
        if (Before(heap_[child], heap_[best])) best = child;
      }
      if (best == i) return;
      Swap(i, best);
      i = best;
    }
  }

  std::vector<double> time_;   // per rank
  std::vector<int> heap_;      // ranks in heap layout
  std::vector<int> position_;  // per rank, its index in heap_
  std::vector<int> frontier_;  // VisitInOrder's scratch
};

// Samples that must stay together: a non-zero group, or a single sample.
struct Unit {
  std::vector<int> members;  // batch indices, longest first
  double cost = 0.0;         // balancing metric (seconds, tokens, ...), speed excluded
  double rigid = 0.0;        // part of cost that DST cannot cut (floor at or above density)
  int first = 0;             // smallest batch index: ties and arrival order
  int64_t longest = 0;       // tokens of the longest member
};

struct RankState {
  double load = 0.0;  // sum of unit costs
  double rigid = 0.0;
  std::vector<int64_t> free;  // free tokens per micro-batch
  std::vector<int> units;     // unit indices
};

class Placer {
 public:
  Placer(const std::vector<Sample>& batch, const PlannerConfig& config,
         std::vector<Unit> units, std::vector<double> speed)
      : batch_(batch), config_(config), units_(std::move(units)), speed_(std::move(speed)),
        ranks_(config.ranks), micro_batch_of_(batch.size(), -1), least_loaded_(config.ranks),
        most_loaded_(config.ranks), max_free_(config.ranks, config.micro_batch_capacity) {
    for (RankState& r : ranks_) r.free.assign(config.micro_batches, config.micro_batch_capacity);
  }

  absl::StatusOr<Assignment> Sequential();
  absl::StatusOr<Assignment> Balanced();

 private:
  double Time(int r) const { return speed_[r] * ranks_[r].load; }
  // Worst-fit of the unit's members into `free` (the micro-batch with most room first);
  // writes the chosen micro-batches to `slots` when given. False if a member does not fit.
  bool FitWorst(const Unit& unit, const std::vector<int64_t>& free, std::vector<int>* slots) const;
  // Next-fit in arrival order from micro-batch `*cursor`, then first-fit.
  bool FitInOrder(const Unit& unit, const std::vector<int64_t>& free, int* cursor,
                  std::vector<int>* slots) const;
  void Place(int u, int r, const std::vector<int>& slots);
  // Refreshes the rank's place in the heaps and its largest free micro-batch.
  void Updated(int r);
  void Remove(int u, int r);
  absl::Status Overflow(int u, std::vector<int>* deferred) const;
  bool FitsAfterSwap(int u, int v, int r) const;
  void ImproveMaxRank();
  Assignment Collect(std::vector<int> deferred) const;

  const std::vector<Sample>& batch_;
  const PlannerConfig& config_;
  std::vector<Unit> units_;
  std::vector<double> speed_;
  std::vector<RankState> ranks_;
  std::vector<int> micro_batch_of_;  // per batch index, -1 while unplaced
  RankHeap<false> least_loaded_;
  RankHeap<true> most_loaded_;
  std::vector<int64_t> max_free_;  // per rank, the most free tokens of one micro-batch
  mutable std::vector<int64_t> scratch_;      // FitWorst's copy of free tokens for groups
};

bool Placer::FitWorst(const Unit& unit, const std::vector<int64_t>& free_in,
                      std::vector<int>* slots) const {
  if (slots != nullptr) slots->clear();
  if (unit.members.size() == 1) {  // the common case: no copy
    const int i = unit.members.front();
    const int best =
        static_cast<int>(std::max_element(free_in.begin(), free_in.end()) - free_in.begin());
    if (free_in[best] < batch_[i].length) return false;
    if (slots != nullptr) slots->push_back(best);
    return true;
  }
  std::vector<int64_t>& free = scratch_;
  free = free_in;
  for (int i : unit.members) {
    const int64_t length = batch_[i].length;
    const int best = static_cast<int>(std::max_element(free.begin(), free.end()) - free.begin());
    if (free[best] < length) return false;
    free[best] -= length;
    if (slots != nullptr) slots->push_back(best);
  }
  return true;
}

bool Placer::FitInOrder(const Unit& unit, const std::vector<int64_t>& free_in, int* cursor,
                        std::vector<int>* slots) const {
  std::vector<int64_t> free = free_in;
  slots->clear();
  // Members in arrival order, as a plain sampler would see them.
  std::vector<int> members = unit.members;
  std::sort(members.begin(), members.end());
  for (int i : members) {
    const int64_t length = batch_[i].length;
    int m = *cursor;
    while (m < config_.micro_batches && free[m] < length) ++m;
    if (m == config_.micro_batches) {
      m = 0;
      while (m < config_.micro_batches && free[m] < length) ++m;
      if (m == config_.micro_batches) return false;
    } else {
      *cursor = m;
    }
    free[m] -= length;
    slots->push_back(m);
  }
  return true;
}

void Placer::Place(int u, int r, const std::vector<int>& slots) {
  RankState& rank = ranks_[r];
  const Unit& unit = units_[u];
  for (size_t k = 0; k < unit.members.size(); ++k) {
    const int i = unit.members[k];
    micro_batch_of_[i] = slots[k];
    rank.free[slots[k]] -= batch_[i].length;
  }
  rank.load += unit.cost;
  rank.rigid += unit.rigid;
  rank.units.push_back(u);
  Updated(r);
}

void Placer::Remove(int u, int r) {
  RankState& rank = ranks_[r];
  const Unit& unit = units_[u];
  for (int i : unit.members) {
    rank.free[micro_batch_of_[i]] += batch_[i].length;
    micro_batch_of_[i] = -1;
  }
  rank.load -= unit.cost;
  rank.rigid -= unit.rigid;
  if (rank.units.size() == 1) rank.load = rank.rigid = 0.0;  // no drift from +/- rounding
  rank.units.erase(std::find(rank.units.begin(), rank.units.end(), u));
  Updated(r);
}

void Placer::Updated(int r) {
  least_loaded_.Update(r, Time(r));
  most_loaded_.Update(r, Time(r));
  max_free_[r] = *std::max_element(ranks_[r].free.begin(), ranks_[r].free.end());
}

absl::Status Placer::Overflow(int u, std::vector<int>* deferred) const {
  if (config_.overflow == OverflowPolicy::kDefer) {
    for (int i : units_[u].members) deferred->push_back(i);
    return absl::OkStatus();
  }
  const int i = units_[u].members.front();
  int64_t total = 0;
  for (const Sample& s : batch_) total += s.length;
  return absl::InvalidArgumentError(absl::StrCat(
      "samples[", i, "] (id ", batch_[i].id, ", ", batch_[i].length, " tokens",
      units_[u].members.size() > 1 ? absl::StrCat(", group ", batch_[i].group) : "",
      ") does not fit: ranks x micro_batches x micro_batch_capacity = ", config_.ranks, " x ",
      config_.micro_batches, " x ", config_.micro_batch_capacity, " tokens for a batch of ",
      total, " tokens; raise micro_batches or micro_batch_capacity, or use overflow policy "
      "defer"));
}

absl::StatusOr<Assignment> Placer::Sequential() {
  std::vector<int> order(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) order[u] = static_cast<int>(u);
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return units_[a].first < units_[b].first; });
  std::vector<int> cursor(config_.ranks, 0);
  std::vector<int> deferred;
  std::vector<int> slots;
  const int64_t n = static_cast<int64_t>(batch_.size());
  for (int u : order) {
    // Contiguous chunks of equal sample count: rank of the unit's first sample.
    const int home = static_cast<int>(static_cast<int64_t>(units_[u].first) * config_.ranks / n);
    bool placed = false;
    for (int k = 0; k < config_.ranks && !placed; ++k) {
      const int r = (home + k) % config_.ranks;
      if (FitInOrder(units_[u], ranks_[r].free, &cursor[r], &slots)) {
        Place(u, r, slots);
        placed = true;
      }
    }
    if (!placed) {
      absl::Status status = Overflow(u, &deferred);
      if (!status.ok()) return status;
    }
  }
  return Collect(std::move(deferred));
}

absl::StatusOr<Assignment> Placer::Balanced() {
  // Largest first; ties in arrival order (first indices are unique, so the order is total).
  // The keys carry what the candidate search reads, so that it does not chase each unit.
  struct Key {
    double cost;
    int first;
    int unit;
    int64_t longest;
    bool single;
  };
  std::vector<Key> keys(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    const Unit& unit = units_[u];
    keys[u] = {unit.cost, unit.first, static_cast<int>(u), unit.longest,
               unit.members.size() == 1};
  }
  std::sort(keys.begin(), keys.end(), [](const Key& a, const Key& b) {
    return a.cost != b.cost ? a.cost > b.cost : a.first < b.first;
  });
  std::vector<int> deferred;
  std::vector<int> slots;
  std::vector<int> candidates;
  for (const Key& key : keys) {
    const int u = key.unit;
    const Unit& unit = units_[u];
    candidates.clear();
    least_loaded_.VisitInOrder([&](int r) {
      if (max_free_[r] >= key.longest &&
          (key.single || FitWorst(unit, ranks_[r].free, nullptr))) {
        candidates.push_back(r);
      }
      return static_cast<int>(candidates.size()) < kCandidates;
    });
    if (candidates.empty()) {
      absl::Status status = Overflow(u, &deferred);
      if (!status.ok()) return status;
      continue;
    }
    double best_time = 0.0;
    for (size_t k = 0; k < candidates.size(); ++k) {
      const int r = candidates[k];
      const double t = speed_[r] * (ranks_[r].load + key.cost);
      if (k == 0 || t < best_time) best_time = t;
    }
    int chosen = -1;
    for (int r : candidates) {
      const double t = speed_[r] * (ranks_[r].load + unit.cost);
      if (t > best_time * (1.0 + kTieShare)) continue;
      if (chosen < 0 || ranks_[r].rigid < ranks_[chosen].rigid ||
          (ranks_[r].rigid == ranks_[chosen].rigid &&
           (t < speed_[chosen] * (ranks_[chosen].load + unit.cost) ||
            (t == speed_[chosen] * (ranks_[chosen].load + unit.cost) && r < chosen)))) {
        chosen = r;
      }
    }
    FitWorst(unit, ranks_[chosen].free, &slots);
    Place(u, chosen, slots);
  }
  ImproveMaxRank();
  std::sort(deferred.begin(), deferred.end());
  return Collect(std::move(deferred));
}

bool Placer::FitsAfterSwap(int u, int v, int r) const {
  // Would unit u fit on rank r once unit v has left it?
  const Unit& unit = units_[u];
  const Unit& leaving = units_[v];
  if (unit.members.size() == 1 && leaving.members.size() == 1) {
    const int64_t length = batch_[unit.members.front()].length;
    const int freed = micro_batch_of_[leaving.members.front()];
    const std::vector<int64_t>& free = ranks_[r].free;
    for (int m = 0; m < config_.micro_batches; ++m) {
      const int64_t room = free[m] + (m == freed ? batch_[leaving.members.front()].length : 0);
      if (room >= length) return true;
    }
    return false;
  }
  std::vector<int64_t> free = ranks_[r].free;
  for (int i : leaving.members) free[micro_batch_of_[i]] += batch_[i].length;
  return FitWorst(unit, free, nullptr);
}

void Placer::ImproveMaxRank() {
  if (config_.ranks < 2) return;
  // Nothing beats the lower bound: max(total / sum(1/h), largest unit on the fastest rank).
  double total = 0.0;
  double largest = 0.0;
  double inverse_speed = 0.0;
  double min_speed = speed_[0];
  for (const Unit& unit : units_) largest = std::max(largest, unit.cost);
  for (int r = 0; r < config_.ranks; ++r) {
    total += ranks_[r].load;
    inverse_speed += 1.0 / speed_[r];
    min_speed = std::min(min_speed, speed_[r]);
  }
  const double bound = std::max(total / inverse_speed, largest * min_speed);
  const int limit = 4 * config_.ranks + 64;
  struct Candidate {
    double time;  // resulting max(time of hi, time of lo)
    int u;        // unit leaving hi
    int v;        // unit leaving lo, -1 for a move
  };
  std::vector<Candidate> candidates;
  std::vector<std::pair<double, int>> lo_units;  // (cost, unit) of the idle rank, ascending
  std::vector<int> slots;
  for (int iter = 0; iter < limit; ++iter) {
    const int hi = most_loaded_.First();
    const int lo = least_loaded_.First();
    const double current = Time(hi);
    if (hi == lo || current <= bound * (1.0 + 1e-6)) return;
    const double h_hi = speed_[hi];
    const double h_lo = speed_[lo];
    const double load_hi = ranks_[hi].load;
    const double load_lo = ranks_[lo].load;
    // Moving cost d from hi to lo gives max(h_hi (load_hi - d), h_lo (load_lo + d)), lowest
    // at d* below; look at moves and swaps whose transferred cost is nearest to it.
    const double ideal = (h_hi * load_hi - h_lo * load_lo) / (h_hi + h_lo);
    auto time_after = [&](double d) {
      return std::max(h_hi * (load_hi - d), h_lo * (load_lo + d));
    };
    const double improving = current * (1.0 - 1e-9);
    candidates.clear();
    lo_units.clear();
    for (int v : ranks_[lo].units) lo_units.push_back({units_[v].cost, v});
    std::sort(lo_units.begin(), lo_units.end());
    for (int u : ranks_[hi].units) {
      const double c = units_[u].cost;
      if (const double t = time_after(c); t < improving) candidates.push_back({t, u, -1});
      // Swap partners with cost near c - d*: the neighbours of that point in lo's list.
      auto it = std::lower_bound(lo_units.begin(), lo_units.end(),
                                 std::make_pair(c - ideal, -1));
      for (int k = 0; k < 2; ++k) {
        if (k == 1) {
          if (it == lo_units.begin()) break;
          --it;
        }
        if (it == lo_units.end()) continue;
        const double d = c - it->first;
        if (d <= 0) continue;
        if (const double t = time_after(d); t < improving) {
          candidates.push_back({t, u, it->second});
        }
      }
    }
    std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
      if (a.time != b.time) return a.time < b.time;
      if (a.u != b.u) return a.u < b.u;
      return a.v < b.v;
    });
    const Candidate* chosen = nullptr;
    for (const Candidate& c : candidates) {
      const bool fits = c.v < 0 ? FitWorst(units_[c.u], ranks_[lo].free, nullptr)
                                : FitsAfterSwap(c.u, c.v, lo) && FitsAfterSwap(c.v, c.u, hi);
      if (fits) {
        chosen = &c;
        break;
      }
    }
    if (chosen == nullptr) return;
    const int u = chosen->u;
    const int v = chosen->v;
    Remove(u, hi);
    if (v >= 0) {
      Remove(v, lo);
      FitWorst(units_[v], ranks_[hi].free, &slots);
      Place(v, hi, slots);
    }
    FitWorst(units_[u], ranks_[lo].free, &slots);
    Place(u, lo, slots);
  }
}

Assignment Placer::Collect(std::vector<int> deferred) const {
  Assignment out;
  out.ranks.resize(config_.ranks);
  for (int r = 0; r < config_.ranks; ++r) {
    out.ranks[r].resize(config_.micro_batches);
    for (int u : ranks_[r].units) {
      for (int i : units_[u].members) out.ranks[r][micro_batch_of_[i]].push_back(i);
    }
  }
  out.deferred = std::move(deferred);
  return out;
}

}  // namespace

absl::StatusOr<Assignment> AssignSamples(const std::vector<Sample>& batch,
                                         const PlannerConfig& config, const LatencyModel& model,
                                         const std::vector<double>& densities) {
  const Policy policy = config.policy;
  std::vector<double> speed(config.ranks, 1.0);
  if (policy == Policy::kSab || policy == Policy::kSparseBalance) {
    for (int r = 0; r < config.ranks && r < model.ranks(); ++r) speed[r] = model.speed_factor(r);
  }
  // Units: groups (keyed by group id, ordered by first appearance) and single samples.
  std::vector<Unit> units;
  std::map<uint64_t, int> unit_of_group;
  for (int i = 0; i < static_cast<int>(batch.size()); ++i) {
    const Sample& s = batch[i];
    int u;
    if (s.group != 0) {
      auto [it, inserted] = unit_of_group.emplace(s.group, static_cast<int>(units.size()));
      if (inserted) units.push_back(Unit{{}, 0.0, 0.0, i, 0});
      u = it->second;
    } else {
      u = static_cast<int>(units.size());
      units.push_back(Unit{{}, 0.0, 0.0, i, 0});
    }
    double cost = 0.0;
    switch (policy) {
      case Policy::kTokens:
        cost = static_cast<double>(s.length);
        break;
      case Policy::kFlops:
        cost = model.SampleSeconds(s, 1.0);
        break;
      default:
        cost = model.SampleSeconds(s, densities[i]);
        break;
    }
    units[u].members.push_back(i);
    units[u].cost += cost;
    if (DensityFloor(s.sensitivity, config) >= densities[i]) units[u].rigid += cost;
  }
  for (Unit& unit : units) {
    std::stable_sort(unit.members.begin(), unit.members.end(),
                     [&](int a, int b) { return batch[a].length > batch[b].length; });
    unit.longest = batch[unit.members.front()].length;
  }
  Placer placer(batch, config, std::move(units), std::move(speed));
  if (policy == Policy::kSequential || policy == Policy::kDst) return placer.Sequential();
  return placer.Balanced();
}

}  // namespace sparsebalance
