#include "planner/recall_model.h"

#include <algorithm>

#include "planner/det_math.h"

namespace sparsebalance {

double RecallExponent(double sensitivity) {
  const double tolerance = 1.0 - std::clamp(sensitivity, 0.0, 1.0);
  return kRecallExponentMin + (kRecallExponentMax - kRecallExponentMin) * tolerance * tolerance;
}

double PredictedRecall(double sensitivity, double density) {
  const double rho = std::clamp(density, 0.0, 1.0);
  return 1.0 - DetPow(1.0 - rho, RecallExponent(sensitivity));
}

double DensityFloor(double sensitivity, const PlannerConfig& config) {
  const double s = std::clamp(sensitivity, 0.0, 1.0);
  // Written as a convex combination so that s = 0 and s = 1 give the bounds exactly.
  return (1.0 - s) * config.density_min + s * config.density_max;
}

double BaseDensity(double sensitivity, const PlannerConfig& config) {
  return std::clamp(std::max(config.density_default, DensityFloor(sensitivity, config)),
                    config.density_min, config.density_max);
}

}  // namespace sparsebalance
