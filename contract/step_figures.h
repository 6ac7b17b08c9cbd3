// The figures that describe one training step's balance, defined once for every room that
// reports them (the planner's plan, sb-sim, sb-run's summary, the service's metrics): the
// imbalance ratio, the bubble ratio, the makespan lower bound (DESIGN.md section 4) and
// quantiles of a list of times.
//
//   const std::vector<double> rank_seconds = {1.0, 2.0, 3.0};
//   double imbalance = ImbalanceRatio(rank_seconds);  // 3 / 2 = 1.5
//   double bubble = BubbleRatio(rank_seconds);        // 1 - 2 / 3
#ifndef SPARSEBALANCE_CONTRACT_STEP_FIGURES_H_
#define SPARSEBALANCE_CONTRACT_STEP_FIGURES_H_

#include <vector>

#include "absl/types/span.h"

namespace sparsebalance {

// max / mean of the ranks' times (seconds): 1 is perfect balance. 1 when there are no ranks
// or every time is 0.
double ImbalanceRatio(absl::Span<const double> rank_seconds);

// The idle share of ranks x makespan: 1 - mean / max of the ranks' times, in [0, 1). 0 when
// there are no ranks or every time is 0.
double BubbleRatio(absl::Span<const double> rank_seconds);

// No plan beats this step time (DESIGN.md section 4): max(total / sum_r(1 / h_r),
// largest * min_r h_r), where `total` is the work of the step at speed 1 (seconds), `largest`
// the largest indivisible piece of it, and h_r the ranks' speed factors (seconds per unit of
// work, > 0). 0 without ranks.
double MakespanLowerBound(double total, double largest, absl::Span<const double> speed_factors);

// The q-quantile (q in [0, 1], clamped) of `values` by linear interpolation between the
// closest ranks: Quantile(v, 0.5) is the median, 0 the smallest, 1 the largest. 0 when empty.
double Quantile(std::vector<double> values, double q);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_CONTRACT_STEP_FIGURES_H_
