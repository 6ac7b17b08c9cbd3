// Measured kernel times on a grid of length x density for one device: the latency model's
// prior. `sb-profile` (kernels/) writes it; `sb-planner` and `sb-sim` read it.
//
// File format (text, version 1; '#' starts a comment, blank lines are skipped):
//
//   sparsebalance-profile 1
//   device NVIDIA H100 80GB HBM3
//   shape heads=32 head_dim=128 block_size=64 local_blocks=1
//   # length(tokens)  density  seconds(one layer, forward+backward, attention + linear part)
//   8192    1.0   0.0123
//   8192    0.3   0.0071
//   ...
//
// Every data row is one document of `length` tokens run through one transformer layer
// (forward and backward) with block-sparse attention at `density`. At least three rows with
// at least two distinct lengths are needed to fit the model.
#ifndef SPARSEBALANCE_PLANNER_PROFILE_TABLE_H_
#define SPARSEBALANCE_PLANNER_PROFILE_TABLE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "planner/types.h"

namespace sparsebalance {

struct ProfileRow {
  int64_t length = 0;    // tokens
  double density = 0.0;  // (0, 1]
  double seconds = 0.0;  // one layer, forward + backward
};

struct ProfileTable {
  std::string device;
  ModelShape shape;  // `layers` is unused: rows are per layer
  std::vector<ProfileRow> rows;
};

absl::StatusOr<ProfileTable> ParseProfileTable(absl::string_view text);
std::string FormatProfileTable(const ProfileTable& table);

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
