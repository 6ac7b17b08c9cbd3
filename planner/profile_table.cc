#include "planner/profile_table.h"

#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "contract/block_geometry.h"

namespace sparsebalance {
namespace {

// Solves the square system a * x = b by Gaussian elimination with partial pivoting; false if
// singular.
bool Solve(std::vector<std::vector<double>> a, std::vector<double> b, std::vector<double>* x) {
  const size_t n = b.size();
  for (size_t col = 0; col < n; ++col) {
    size_t pivot = col;
    for (size_t r = col + 1; r < n; ++r) {
      if (std::fabs(a[r][col]) > std::fabs(a[pivot][col])) pivot = r;
    }
    if (std::fabs(a[pivot][col]) < 1e-300) return false;
    std::swap(a[pivot], a[col]);
    std::swap(b[pivot], b[col]);
    for (size_t r = col + 1; r < n; ++r) {
      const double f = a[r][col] / a[col][col];
      for (size_t c = col; c < n; ++c) a[r][c] -= f * a[col][c];
      b[r] -= f * b[col];
    }
  }
  x->assign(n, 0.0);
  for (size_t i = n; i-- > 0;) {
    double s = b[i];
    for (size_t c = i + 1; c < n; ++c) s -= a[i][c] * (*x)[c];
    (*x)[i] = s / a[i][i];
  }
  return true;
}

}  // namespace

std::vector<double> NonNegativeLeastSquares(const std::vector<std::vector<double>>& rows,
                                            const std::vector<double>& targets,
                                            const std::vector<double>& weights) {
  const size_t cols = rows.empty() ? 0 : rows[0].size();
  std::vector<double> best(cols, 0.0);
  double best_residual = std::numeric_limits<double>::infinity();
  // Columns are scaled to unit weighted norm so that the normal equations stay well
  // conditioned when features differ by orders of magnitude (blocks vs tokens vs 1).
  std::vector<double> scale(cols, 0.0);
  for (size_t c = 0; c < cols; ++c) {
    double s = 0;
    for (size_t i = 0; i < rows.size(); ++i) s += weights[i] * rows[i][c] * rows[i][c];
    scale[c] = s > 0 ? 1.0 / std::sqrt(s) : 0.0;
  }
  for (unsigned mask = 0; mask < (1u << cols); ++mask) {
    std::vector<size_t> active;
    for (size_t c = 0; c < cols; ++c) {
      if ((mask >> c) & 1u && scale[c] > 0) active.push_back(c);
    }
    if (active.size() != static_cast<size_t>(__builtin_popcount(mask))) continue;
    std::vector<double> coef(cols, 0.0);
    if (!active.empty()) {
      const size_t k = active.size();
      std::vector<std::vector<double>> ata(k, std::vector<double>(k, 0.0));
      std::vector<double> atb(k, 0.0);
      for (size_t i = 0; i < rows.size(); ++i) {
        for (size_t p = 0; p < k; ++p) {
          const double xp = rows[i][active[p]] * scale[active[p]];
          atb[p] += weights[i] * xp * targets[i];
          for (size_t q = 0; q < k; ++q) {
            ata[p][q] += weights[i] * xp * rows[i][active[q]] * scale[active[q]];
          }
        }
      }
      std::vector<double> x;
      if (!Solve(ata, atb, &x)) continue;
      bool feasible = true;
      for (size_t p = 0; p < k; ++p) {
        if (x[p] < 0) feasible = false;
        coef[active[p]] = x[p] * scale[active[p]];
      }
      if (!feasible) continue;
    }
    double residual = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      double pred = 0;
      for (size_t c = 0; c < cols; ++c) pred += rows[i][c] * coef[c];
      residual += weights[i] * (pred - targets[i]) * (pred - targets[i]);
    }
    if (residual < best_residual) {
      best_residual = residual;
      best = coef;
    }
  }
  return best;
}

absl::StatusOr<CostCoefficients> FitProfile(const ProfileTable& table, const ModelShape& shape) {
  std::set<int64_t> lengths;
  for (const ProfileRow& row : table.rows) lengths.insert(row.length);
  if (table.rows.size() < 3 || lengths.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile has ", table.rows.size(), " rows over ", lengths.size(),
                     " lengths; fitting needs at least 3 rows and 2 distinct lengths"));
  }
  std::vector<std::vector<double>> x;
  std::vector<double> y;
  std::vector<double> w;
  const ModelShape& p = table.shape;
  for (const ProfileRow& row : table.rows) {
    const double blocks =
        static_cast<double>(ActiveBlocks(row.length, row.density, p.block_size, p.local_blocks));
    x.push_back({blocks, static_cast<double>(row.length), 1.0});
    y.push_back(row.seconds);
    w.push_back(1.0 / (row.seconds * row.seconds));  // relative error
  }
  const std::vector<double> c = NonNegativeLeastSquares(x, y, w);
  const double block_work =
      static_cast<double>(shape.block_size) * shape.block_size * shape.head_dim * shape.heads;
  const double profile_block_work =
      static_cast<double>(p.block_size) * p.block_size * p.head_dim * p.heads;
  const double width = static_cast<double>(shape.heads) * shape.head_dim;
  const double profile_width = static_cast<double>(p.heads) * p.head_dim;
  CostCoefficients out;
  out.per_block = c[0] * shape.layers * block_work / profile_block_work;
  out.per_token = c[1] * shape.layers * (width * width) / (profile_width * profile_width);
  out.per_sample = c[2] * shape.layers;
  out.per_micro_batch = 0.0;
  if (!(out.per_block > 0) || !(out.per_token + out.per_sample > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "profile fit is degenerate (per_block ", out.per_block, ", per_token ", out.per_token,
        "): rows need several lengths and densities so attention and linear time separate"));
  }
  return out;
}

}  // namespace sparsebalance
