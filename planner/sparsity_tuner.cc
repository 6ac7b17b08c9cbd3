#include "planner/sparsity_tuner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "planner/block_math.h"
#include "planner/det_math.h"
#include "planner/recall_model.h"

namespace sparsebalance {
namespace {

// Highest density used where density_max is 1: the recall slope vanishes at 1, so the
// multiplier that reaches exactly 1 is 0 (log -inf).
constexpr double kAlmostDense = 1.0 - 1e-9;
constexpr int kMaxSolverIterations = 60;
// Recall AllocateDensities keeps above its base (token-weighted, absolute).
constexpr double kAllocationRecallMargin = 1e-3;
constexpr int kRecallGuardIterations = 8;
// Relative precision of a rank's time budget in the per-rank solve.
constexpr double kBudgetTolerance = 1e-6;

struct Item {
  int index = 0;          // into the batch
  double weight = 0.0;    // tokens: recall is token-weighted
  double floor = 0.0;     // lowest density allowed
  double base = 0.0;      // density without tuning
  double g_minus_1 = 0.0; // recall exponent - 1
  double offset = 0.0;    // log(per_block * tri / (weight * g)): where the multiplier sits
  int doc_begin = 0;      // documents' query-block counts in `docs`
  int doc_end = 0;
};

struct RankWork {
  double speed = 1.0;
  double fixed = 0.0;  // seconds (speed excluded) that do not depend on density
  std::vector<Item> items;
};

class Tuner {
 public:
  Tuner(const std::vector<Sample>& batch, const Assignment& assignment,
        const PlannerConfig& config, const LatencyModel& model, const std::vector<double>& base);

  // Densities for the target makespan `target` (seconds).
  std::vector<double> Solve(double target) const;
  // Over all items (of every rank) at once: the densities in [floor, density_max] with the
  // least predicted attention time whose token-weighted recall is at least `target`.
  std::vector<double> SolveForRecall(double target) const;
  double Recall(const std::vector<double>& densities) const;
  // Predicted rank time at each item's base (or floor) density.
  double RankSeconds(const RankWork& rank, bool at_floor) const;

  const std::vector<RankWork>& ranks() const { return ranks_; }

 private:
  // Surrogate active blocks of one document of `rows` query blocks at density rho:
  // ceil(rho*n) ~ rho*n + 1/2, continuous and monotone in rho (the exact count is used for
  // the plan's figures). Its derivative in rho goes to `slope`.
  double SurrogateBlocks(int64_t rows, double rho, double* slope) const;
  double ItemBlocks(const Item& item, double rho, double* slope) const;
  double Density(const Item& item, double log_multiplier, double lo, double hi) const;
  // Densities of one rank's items that fit `budget` attention seconds (speed excluded).
  void SolveRank(const RankWork& rank, double budget, bool lower,
                 std::vector<double>* densities) const;

  const std::vector<Sample>& batch_;
  const PlannerConfig& config_;
  const std::vector<double>& base_;
  double per_block_ = 0.0;
  double anchors_ = 0.0;
  std::vector<int64_t> docs_;  // query blocks per document
  std::vector<RankWork> ranks_;
};

Tuner::Tuner(const std::vector<Sample>& batch, const Assignment& assignment,
             const PlannerConfig& config, const LatencyModel& model,
             const std::vector<double>& base)
    : batch_(batch), config_(config), base_(base) {
  const CostCoefficients coef = model.coefficients();
  per_block_ = coef.per_block;
  anchors_ = config.shape.local_blocks + 2.0;
  const int block = config.shape.block_size;
  ranks_.resize(assignment.ranks.size());
  for (size_t r = 0; r < assignment.ranks.size(); ++r) {
    RankWork& rank = ranks_[r];
    rank.speed = r < static_cast<size_t>(model.ranks()) ? model.speed_factor(static_cast<int>(r))
                                                          : 1.0;
    for (const std::vector<int>& micro_batch : assignment.ranks[r]) {
      if (!micro_batch.empty()) rank.fixed += coef.per_micro_batch;
      for (int i : micro_batch) {
        const Sample& s = batch[i];
        Item item;
        item.index = i;
        item.weight = static_cast<double>(s.length);
        item.floor = std::min(DensityFloor(s.sensitivity, config), base[i]);
        item.base = base[i];
        item.g_minus_1 = RecallExponent(s.sensitivity) - 1.0;
        item.doc_begin = static_cast<int>(docs_.size());
        double triangle = 0.0;
        auto add_doc = [&](int64_t length) {
          const int64_t rows = QueryBlocks(length, block);
          docs_.push_back(rows);
          triangle += 0.5 * static_cast<double>(rows) * static_cast<double>(rows + 1);
        };
        if (s.segments.empty()) {
          add_doc(s.length);
        } else {
          for (int64_t segment : s.segments) add_doc(segment);
        }
        item.doc_end = static_cast<int>(docs_.size());
        const double docs = static_cast<double>(item.doc_end - item.doc_begin);
        rank.fixed += coef.per_token * item.weight + coef.per_sample * docs;
        const double price = per_block_ * triangle;  // seconds per unit of density, about
        item.offset = DetLog(std::max(price, 1e-300) /
                             (item.weight * (item.g_minus_1 + 1.0)));
        rank.items.push_back(item);
      }
    }
  }
}

double Tuner::SurrogateBlocks(int64_t rows_int, double rho, double* slope) const {
  const double rows = static_cast<double>(rows_int);
  const double a = anchors_;
  const double full = std::min(rows, a);
  double blocks = 0.5 * full * (full + 1.0);
  if (rows <= a) {
    if (slope != nullptr) *slope = 0.0;
    return blocks;
  }
  // Rows beyond the anchors keep max(a, rho*n + 1/2) blocks; the switch is at n = (a-1/2)/rho.
  const double m = std::clamp((a - 0.5) / rho, a, rows);
  blocks += a * (m - a) + rho * 0.5 * (rows * rows - m * m) + 0.5 * (rows - m);
  if (slope != nullptr) *slope = 0.5 * (rows * rows - m * m);
  return blocks;
}

double Tuner::ItemBlocks(const Item& item, double rho, double* slope) const {
  double blocks = 0.0;
  double total_slope = 0.0;
  for (int d = item.doc_begin; d < item.doc_end; ++d) {
    double s = 0.0;
    blocks += SurrogateBlocks(docs_[d], rho, &s);
    total_slope += s;
  }
  if (slope != nullptr) *slope = total_slope;
  return blocks;
}

double Tuner::Density(const Item& item, double log_multiplier, double lo, double hi) const {
  // Stationarity of weight * recall(rho) - multiplier * price * rho:
  // (1 - rho)^(g-1) = multiplier * price / (weight * g).
  const double rho = 1.0 - DetExp((log_multiplier + item.offset) / item.g_minus_1);
  return std::clamp(rho, lo, hi);
}

void Tuner::SolveRank(const RankWork& rank, double budget, bool lower,
                      std::vector<double>* densities) const {
  const size_t n = rank.items.size();
  std::vector<double> lo(n);
  std::vector<double> hi(n);
  for (size_t k = 0; k < n; ++k) {
    const Item& item = rank.items[k];
    lo[k] = lower ? item.floor : item.base;
    hi[k] = lower ? item.base : std::max(item.base, config_.density_max);
  }
  auto excess = [&](double x, double* derivative) {
    double blocks = 0.0;
    double d = 0.0;
    for (size_t k = 0; k < n; ++k) {
      const Item& item = rank.items[k];
      const double rho = Density(item, x, lo[k], hi[k]);
      double slope = 0.0;
      blocks += ItemBlocks(item, rho, &slope);
      if (rho > lo[k] && rho < hi[k]) d -= slope * (1.0 - rho) / item.g_minus_1;
    }
    if (derivative != nullptr) *derivative = per_block_ * d;
    return per_block_ * blocks - budget;
  };
  // Bracket: below x_min every item sits at hi, above x_max at lo.
  double x_min = 0.0;
  double x_max = 0.0;
  for (size_t k = 0; k < n; ++k) {
    const Item& item = rank.items[k];
    const double at_hi = item.g_minus_1 * DetLog(1.0 - std::min(hi[k], kAlmostDense)) - item.offset;
    const double at_lo = item.g_minus_1 * DetLog(1.0 - std::min(lo[k], kAlmostDense)) - item.offset;
    x_min = k == 0 ? at_hi : std::min(x_min, at_hi);
    x_max = k == 0 ? at_lo : std::max(x_max, at_lo);
  }
  double x = x_min;
  if (n == 0 || excess(x_min, nullptr) <= 0) {
    x = x_min;  // everything at its upper bound fits
  } else if (excess(x_max, nullptr) >= 0) {
    x = x_max;  // even the lower bounds do not fit: that is the best this rank can do
  } else {
    // Safeguarded Newton on the (decreasing) excess: bisect whenever a step leaves the
    // bracket.
    double a = x_min;
    double b = x_max;
    x = 0.5 * (a + b);
    for (int iter = 0; iter < kMaxSolverIterations; ++iter) {
      double derivative = 0.0;
      const double f = excess(x, &derivative);
      if (std::fabs(f) <= kBudgetTolerance * budget) break;
      if (f > 0) {
        a = x;
      } else {
        b = x;
      }
      double next = derivative < 0 ? x - f / derivative : 0.5 * (a + b);
      if (!(next > a && next < b)) next = 0.5 * (a + b);
      if (b - a <= 1e-12 * std::max(1.0, std::fabs(x))) break;
      x = next;
    }
    // End on the feasible side so the rank does not overshoot its budget.
    if (excess(x, nullptr) > 0) x = b;
  }
  for (size_t k = 0; k < n; ++k) {
    (*densities)[rank.items[k].index] = Density(rank.items[k], x, lo[k], hi[k]);
  }
}

double Tuner::RankSeconds(const RankWork& rank, bool at_floor) const {
  double blocks = 0.0;
  for (const Item& item : rank.items) {
    blocks += ItemBlocks(item, at_floor ? item.floor : item.base, nullptr);
  }
  return rank.speed * (rank.fixed + per_block_ * blocks);
}

std::vector<double> Tuner::Solve(double target) const {
  std::vector<double> densities = base_;
  for (const RankWork& rank : ranks_) {
    if (rank.items.empty()) continue;
    const double budget = target / rank.speed - rank.fixed;
    const double now = RankSeconds(rank, /*at_floor=*/false);
    if (now > target) {
      SolveRank(rank, budget, /*lower=*/true, &densities);
    } else if (now < target) {
      SolveRank(rank, budget, /*lower=*/false, &densities);
    }
  }
  return densities;
}

std::vector<double> Tuner::SolveForRecall(double target) const {
  std::vector<const Item*> items;
  for (const RankWork& rank : ranks_) {
    for (const Item& item : rank.items) items.push_back(&item);
  }
  std::vector<double> densities = base_;
  if (items.empty()) return densities;
  const size_t n = items.size();
  const double hi_density = config_.density_max;
  // Recall at each item's bounds, and the multiplier range over which items move.
  std::vector<double> recall_lo(n);
  std::vector<double> recall_hi(n);
  std::vector<double> scale(n);  // exp(offset): (1-rho)^g = (1-rho) * exp(x) * scale
  double tokens = 0.0;
  double x_min = 0.0;
  double x_max = 0.0;
  for (size_t k = 0; k < n; ++k) {
    const Item& item = *items[k];
    const double s = batch_[item.index].sensitivity;
    recall_lo[k] = PredictedRecall(s, item.floor);
    recall_hi[k] = PredictedRecall(s, hi_density);
    scale[k] = DetExp(item.offset);
    tokens += item.weight;
    const double at_hi = item.g_minus_1 * DetLog(1.0 - std::min(hi_density, kAlmostDense)) -
                         item.offset;
    const double at_lo = item.g_minus_1 * DetLog(1.0 - std::min(item.floor, kAlmostDense)) -
                         item.offset;
    x_min = k == 0 ? at_hi : std::min(x_min, at_hi);
    x_max = k == 0 ? at_lo : std::max(x_max, at_lo);
  }
  // Token-weighted recall at multiplier e^x (decreasing in x). At the stationary point
  // (1-rho)^(g-1) = e^(x + offset), so (1-rho)^g = (1-rho) e^x scale: one exp per item.
  auto recall_at = [&](double x) {
    const double ex = DetExp(x);
    double weighted = 0.0;
    for (size_t k = 0; k < n; ++k) {
      const Item& item = *items[k];
      const double u = DetExp((x + item.offset) / item.g_minus_1);  // 1 - rho
      const double rho = 1.0 - u;
      double r;
      if (rho <= item.floor) {
        r = recall_lo[k];
      } else if (rho >= hi_density) {
        r = recall_hi[k];
      } else {
        r = 1.0 - u * ex * scale[k];
      }
      weighted += item.weight * r;
    }
    return weighted / tokens;
  };
  double x = x_min;
  if (recall_at(x_max) >= target) {
    x = x_max;  // every item at its floor already keeps the recall
  } else if (recall_at(x_min) < target) {
    x = x_min;  // unreachable: everything at density_max is the best there is
  } else {
    // Illinois false position on the monotone recall; ends on the side that keeps it.
    double a = x_min;
    double b = x_max;
    double fa = recall_at(a) - target;  // >= 0
    double fb = recall_at(b) - target;  // < 0
    int side = 0;
    for (int iter = 0; iter < kMaxSolverIterations && b - a > 1e-9; ++iter) {
      const double c = fa > fb ? a - fa * (b - a) / (fb - fa) : 0.5 * (a + b);
      const double m = (c > a && c < b) ? c : 0.5 * (a + b);
      const double fm = recall_at(m) - target;
      if (fm >= 0) {
        a = m;
        fa = fm;
        if (side == -1) fb *= 0.5;
        side = -1;
      } else {
        b = m;
        fb = fm;
        if (side == 1) fa *= 0.5;
        side = 1;
      }
      if (fa < 1e-9) break;
    }
    x = a;
  }
  for (size_t k = 0; k < n; ++k) {
    densities[items[k]->index] = Density(*items[k], x, items[k]->floor, hi_density);
  }
  return densities;
}

double Tuner::Recall(const std::vector<double>& densities) const {
  double weighted = 0.0;
  double tokens = 0.0;
  for (const RankWork& rank : ranks_) {
    for (const Item& item : rank.items) {
      weighted += item.weight * PredictedRecall(batch_[item.index].sensitivity,
                                                densities[item.index]);
      tokens += item.weight;
    }
  }
  return tokens > 0 ? weighted / tokens : 0.0;
}

double Quantile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  const double pos = q * static_cast<double>(values.size() - 1);
  const size_t i = static_cast<size_t>(pos);
  if (i + 1 >= values.size()) return values.back();
  return values[i] + (pos - static_cast<double>(i)) * (values[i + 1] - values[i]);
}

}  // namespace

std::vector<double> AllocateDensities(const std::vector<Sample>& batch,
                                      const PlannerConfig& config, const LatencyModel& model,
                                      const std::vector<double>& base) {
  Assignment all;
  all.ranks.assign(1, std::vector<std::vector<int>>(1));
  for (int i = 0; i < static_cast<int>(batch.size()); ++i) all.ranks[0][0].push_back(i);
  Tuner tuner(batch, all, config, model, base);
  const double target = tuner.Recall(base);
  // Aim a little above: the per-rank tuning that follows moves densities away from this
  // optimum, which costs a little recall (it is concave), and should not have to back off.
  std::vector<double> densities =
      tuner.SolveForRecall(std::min(target + kAllocationRecallMargin, 1.0));
  // Never hand back less recall than base (e.g. when even density_max cannot reach it).
  return tuner.Recall(densities) >= target ? densities : base;
}

std::vector<double> TuneDensities(const std::vector<Sample>& batch, const Assignment& assignment,
                                  const PlannerConfig& config, const LatencyModel& model,
                                  const std::vector<double>& base, double min_recall) {
  Tuner tuner(batch, assignment, config, model, base);
  if (tuner.ranks().empty()) return base;
  std::vector<double> at_base;
  double at_floor_max = 0.0;
  for (const RankWork& rank : tuner.ranks()) {
    at_base.push_back(tuner.RankSeconds(rank, /*at_floor=*/false));
    at_floor_max = std::max(at_floor_max, tuner.RankSeconds(rank, /*at_floor=*/true));
  }
  const double base_max = *std::max_element(at_base.begin(), at_base.end());
  double target = base_max;
  switch (config.dst_mode) {
    case DstMode::kMin:
      target = at_floor_max;
      break;
    case DstMode::kMean: {
      double sum = 0.0;
      for (double t : at_base) sum += t;
      target = sum / static_cast<double>(at_base.size());
      break;
    }
    case DstMode::kMax:
      target = base_max;
      break;
    case DstMode::kQuantile:
      target = Quantile(at_base, config.dst_quantile);
      break;
  }
  // No rank can go below its floors, so the step cannot be faster than the slowest floor.
  target = std::min(std::max(target, at_floor_max), base_max);
  std::vector<double> densities = tuner.Solve(target);
  if (config.dst_mode == DstMode::kMin) return densities;
  const double base_recall = std::min(min_recall, tuner.Recall(base));
  if (tuner.Recall(densities) >= base_recall) return densities;
  // Cutting the stragglers lost more recall than raising the others won back: find the
  // lowest target between this one and the base makespan (pure raising, which never loses
  // recall) that keeps the recall.
  double lo = target;
  double hi = base_max;
  std::vector<double> best = tuner.Solve(hi);
  for (int iter = 0; iter < kRecallGuardIterations; ++iter) {
    const double mid = 0.5 * (lo + hi);
    std::vector<double> candidate = tuner.Solve(mid);
    if (tuner.Recall(candidate) >= base_recall) {
      hi = mid;
      best = std::move(candidate);
    } else {
      lo = mid;
    }
  }
  return best;
}

}  // namespace sparsebalance
