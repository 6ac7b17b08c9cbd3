// The latency model's prior from a profile table (contract/profile_format.h: the format,
// written by sb-profile): FitProfile turns measured one-layer times into cost coefficients.
//
//   absl::StatusOr<CostCoefficients> c = FitProfile(*ParseProfileTable(text), shape);
#ifndef SPARSEBALANCE_PLANNER_PROFILE_TABLE_H_
#define SPARSEBALANCE_PLANNER_PROFILE_TABLE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "contract/profile_format.h"
#include "planner/types.h"

namespace sparsebalance {

// Coefficients of the latency model (DESIGN.md section 4) for a whole model step of one
// micro-batch: t = sum_s [per_block * A(L_s, rho_s) + per_token * L_s + per_sample * docs_s]
//                  + per_micro_batch.   All in seconds.
struct CostCoefficients {
  double per_block = 0.0;        // seconds per active attention block, all layers, fwd+bwd
  double per_token = 0.0;        // seconds per token of the linear part, all layers
  double per_sample = 0.0;       // seconds per document (launches, varlen set-up)
  double per_micro_batch = 0.0;  // seconds per non-empty micro-batch
};

// Fits per-layer coefficients to the table (non-negative least squares on relative error) and
// scales them to `shape`: per_block by layers * (B^2 * head_dim * heads) relative to the
// profile's, per_token by layers * (heads * head_dim)^2 relative, per_sample by layers.
absl::StatusOr<CostCoefficients> FitProfile(const ProfileTable& table, const ModelShape& shape);

// Minimises sum_i w_i (x_i . c - y_i)^2 subject to c >= 0, for up to 4 columns, exactly (by
// trying every active set). `rows` holds the x_i.
std::vector<double> NonNegativeLeastSquares(const std::vector<std::vector<double>>& rows,
                                            const std::vector<double>& targets,
                                            const std::vector<double>& weights);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_PROFILE_TABLE_H_
