#include "contract/step_figures.h"

#include <algorithm>
#include <cstddef>

namespace sparsebalance {
namespace {

double Mean(absl::Span<const double> values) {
  double sum = 0.0;
  for (double v : values) sum += v;
  return values.empty() ? 0.0 : sum / static_cast<double>(values.size());
}

}  // namespace

double ImbalanceRatio(absl::Span<const double> rank_seconds) {
  if (rank_seconds.empty()) return 1.0;
  const double mean = Mean(rank_seconds);
  return mean > 0 ? *std::max_element(rank_seconds.begin(), rank_seconds.end()) / mean : 1.0;
}

double BubbleRatio(absl::Span<const double> rank_seconds) {
  if (rank_seconds.empty()) return 0.0;
  const double slowest = *std::max_element(rank_seconds.begin(), rank_seconds.end());
  return slowest > 0 ? 1.0 - Mean(rank_seconds) / slowest : 0.0;
}

double MakespanLowerBound(double total, double largest, absl::Span<const double> speed_factors) {
  if (speed_factors.empty()) return 0.0;
  double inverse_speed = 0.0;
  double min_speed = speed_factors[0];
  for (double h : speed_factors) {
    inverse_speed += 1.0 / h;
    min_speed = std::min(min_speed, h);
  }
  return std::max(inverse_speed > 0 ? total / inverse_speed : 0.0, largest * min_speed);
}

double Quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const double pos = std::clamp(q, 0.0, 1.0) * static_cast<double>(values.size() - 1);
  const size_t i = static_cast<size_t>(pos);
  if (i + 1 >= values.size()) return values.back();
  return values[i] + (pos - static_cast<double>(i)) * (values[i + 1] - values[i]);
}

}  // namespace sparsebalance
