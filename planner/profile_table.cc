#include "planner/profile_table.h"

#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "planner/block_math.h"

namespace sparsebalance {
namespace {

absl::Status LineError(int line, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("profile line ", line, ": ", what));
}

absl::Status ParseShape(absl::string_view rest, int line, ModelShape* shape) {
  for (absl::string_view item :
       absl::StrSplit(rest, absl::ByAnyChar(" \t"), absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, '=');
    int value = 0;
    if (!absl::SimpleAtoi(kv.second, &value) || value < 0) {
      return LineError(line, absl::StrCat("shape field \"", item, "\" needs KEY=non-negative int"));
    }
    if (kv.first == "heads") {
      shape->heads = value;
    } else if (kv.first == "head_dim") {
      shape->head_dim = value;
    } else if (kv.first == "block_size") {
      shape->block_size = value;
    } else if (kv.first == "local_blocks") {
      shape->local_blocks = value;
    } else if (kv.first == "layers") {
      shape->layers = value;
    } else {
      return LineError(line, absl::StrCat("unknown shape field \"", kv.first,
                                          "\" (known: heads, head_dim, block_size, local_blocks)"));
    }
  }
  if (shape->heads < 1 || shape->head_dim < 1) {
    return LineError(line, "shape needs heads >= 1 and head_dim >= 1");
  }
  if (shape->block_size != 64 && shape->block_size != 128) {
    return LineError(line, "shape block_size must be 64 or 128");
  }
  return absl::OkStatus();
}

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

absl::StatusOr<ProfileTable> ParseProfileTable(absl::string_view text) {
  ProfileTable table;
  bool saw_magic = false;
  bool saw_shape = false;
  int line_number = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_number;
    absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipWhitespace());
    if (!saw_magic) {
      if (fields.size() != 2 || fields[0] != "sparsebalance-profile") {
        return LineError(line_number, "expected the header \"sparsebalance-profile 1\"");
      }
      if (fields[1] != "1") {
        return LineError(line_number, absl::StrCat("unsupported profile version ", fields[1],
                                                   "; this build reads version 1"));
      }
      saw_magic = true;
      continue;
    }
    if (fields[0] == "device") {
      table.device = std::string(absl::StripAsciiWhitespace(line.substr(fields[0].size())));
      continue;
    }
    if (fields[0] == "shape") {
      absl::Status status = ParseShape(line.substr(fields[0].size()), line_number, &table.shape);
      if (!status.ok()) return status;
      saw_shape = true;
      continue;
    }
    if (fields.size() != 3) {
      return LineError(line_number, "a data row needs three fields: length density seconds");
    }
    ProfileRow row;
    if (!absl::SimpleAtoi(fields[0], &row.length) || row.length < 1) {
      return LineError(line_number,
                       absl::StrCat("length \"", fields[0], "\" is not a positive integer"));
    }
    if (!absl::SimpleAtod(fields[1], &row.density) || !(row.density > 0 && row.density <= 1)) {
      return LineError(line_number, absl::StrCat("density \"", fields[1], "\" is not in (0, 1]"));
    }
    if (!absl::SimpleAtod(fields[2], &row.seconds) || !std::isfinite(row.seconds) ||
        row.seconds <= 0) {
      return LineError(line_number,
                       absl::StrCat("seconds \"", fields[2], "\" is not a positive finite number"));
    }
    table.rows.push_back(row);
  }
  if (!saw_magic) return absl::InvalidArgumentError("profile is empty: no header line");
  if (!saw_shape) return absl::InvalidArgumentError("profile has no \"shape ...\" line");
  if (table.rows.empty()) return absl::InvalidArgumentError("profile has no data rows");
  return table;
}

std::string FormatProfileTable(const ProfileTable& table) {
  std::string out = "sparsebalance-profile 1\n";
  absl::StrAppend(&out, "device ", table.device.empty() ? "unknown" : table.device, "\n");
  absl::StrAppend(&out, "shape heads=", table.shape.heads, " head_dim=", table.shape.head_dim,
                  " block_size=", table.shape.block_size,
                  " local_blocks=", table.shape.local_blocks, "\n");
  out += "# length(tokens) density seconds(one layer, forward+backward)\n";
  for (const ProfileRow& row : table.rows) {
    absl::StrAppend(&out, absl::StrFormat("%d %.6g %.9g\n", row.length, row.density, row.seconds));
  }
  return out;
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
