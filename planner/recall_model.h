// The planner's view of attention quality: per-sample density floors and a recall proxy.
//
// Recall of a document at density rho is modelled as 1 - (1 - rho)^g(s), where the exponent
// g falls with the document's sparsity sensitivity s: g(s) = 1.25 + 4.75 * (1 - s)^2, so a
// tolerant document (s = 0, g = 6) keeps 0.88 of its attention mass at rho = 0.3, and the most
// sensitive one (s = 1, g = 1.25) only 0.36. The simulator uses the same model as its ground
// truth; workers measure the real recall.
//
// A sample's floor (the lowest density DST may give it) is
// density_min + s * (density_max - density_min): a sensitivity of 1 means dense attention.
// Its base density (what every policy gives it without tuning) is the job's default density,
// raised to the floor where the floor is higher.
#ifndef SPARSEBALANCE_PLANNER_RECALL_MODEL_H_
#define SPARSEBALANCE_PLANNER_RECALL_MODEL_H_

#include "planner/types.h"

namespace sparsebalance {

inline constexpr double kRecallExponentMin = 1.25;  // g at sensitivity 1
inline constexpr double kRecallExponentMax = 6.0;   // g at sensitivity 0

// g(s) above; s is clamped to [0, 1].
double RecallExponent(double sensitivity);
// 1 - (1 - rho)^g(s), in [0, 1].
double PredictedRecall(double sensitivity, double density);

double DensityFloor(double sensitivity, const PlannerConfig& config);
double BaseDensity(double sensitivity, const PlannerConfig& config);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_RECALL_MODEL_H_
