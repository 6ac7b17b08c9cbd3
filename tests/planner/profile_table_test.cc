#include "planner/profile_table.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "contract/block_geometry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/random.h"

namespace sparsebalance {
namespace {

using ::testing::HasSubstr;

// A table measured on `shape` whose times follow t = a*A + b*L + c exactly (one layer).
ProfileTable LinearTable(const ModelShape& shape, double a, double b, double c) {
  ProfileTable table;
  table.device = "synthetic";
  table.shape = shape;
  for (int64_t length : {2048, 4096, 16384, 65536, 131072}) {
    for (double density : {1.0, 0.5, 0.3, 0.1, 0.05}) {
      const double blocks =
          static_cast<double>(ActiveBlocks(length, density, shape.block_size, shape.local_blocks));
      table.rows.push_back({length, density, a * blocks + b * static_cast<double>(length) + c});
    }
  }
  return table;
}

void ExpectRelativeNear(double got, double want, double tolerance, const std::string& what) {
  EXPECT_NEAR(got, want, tolerance * std::fabs(want)) << what;
}

TEST(FitProfileTest, RecoversKnownPerLayerCoefficientsScaledByLayers) {
  ModelShape shape;  // 32 heads x 128, block 64, local 1
  shape.layers = 1;
  const double a = 2.5e-7;
  const double b = 3e-6;
  const double c = 4e-4;
  const ProfileTable table = LinearTable(shape, a, b, c);
  for (int layers : {1, 24, 80}) {
    ModelShape target = shape;
    target.layers = layers;
    absl::StatusOr<CostCoefficients> fit = FitProfile(table, target);
    ASSERT_TRUE(fit.ok()) << fit.status();
    ExpectRelativeNear(fit->per_block, a * layers, 1e-6, absl::StrCat("per_block x", layers));
    ExpectRelativeNear(fit->per_token, b * layers, 1e-6, absl::StrCat("per_token x", layers));
    ExpectRelativeNear(fit->per_sample, c * layers, 1e-6, absl::StrCat("per_sample x", layers));
    EXPECT_EQ(fit->per_micro_batch, 0.0);
  }
}

TEST(FitProfileTest, ScalesToAnotherShape) {
  ModelShape profiled;
  profiled.heads = 16;
  profiled.head_dim = 64;
  profiled.block_size = 64;
  profiled.local_blocks = 0;
  const double a = 1e-7;
  const double b = 2e-6;
  const double c = 1e-4;
  const ProfileTable table = LinearTable(profiled, a, b, c);
  ModelShape target;
  target.layers = 40;
  target.heads = 32;      // 2x heads
  target.head_dim = 128;  // 2x head_dim
  target.block_size = 128;
  // Block work B^2 * head_dim * heads: 4 * 2 * 2 = 16x; width^2: (2 * 2)^2 = 16x.
  absl::StatusOr<CostCoefficients> fit = FitProfile(table, target);
  ASSERT_TRUE(fit.ok()) << fit.status();
  ExpectRelativeNear(fit->per_block, a * 40 * 16, 1e-6, "per_block");
  ExpectRelativeNear(fit->per_token, b * 40 * 16, 1e-6, "per_token");
  ExpectRelativeNear(fit->per_sample, c * 40, 1e-6, "per_sample");
}

TEST(FitProfileTest, RecoversCoefficientsOverRandomShapes) {
  Rng rng(2);
  for (int i = 0; i < 50; ++i) {
    ModelShape shape;
    shape.layers = 1;
    shape.heads = 1 + static_cast<int>(rng.NextU64() % 64);
    shape.head_dim = 32 * (1 + static_cast<int>(rng.NextU64() % 8));
    shape.block_size = rng.NextU64() % 2 == 0 ? 64 : 128;
    shape.local_blocks = static_cast<int>(rng.NextU64() % 4);
    const double a = std::exp(rng.Uniform() * 6.0 - 20.0);
    const double b = std::exp(rng.Uniform() * 6.0 - 16.0);
    const double c = i % 5 == 0 ? 0.0 : std::exp(rng.Uniform() * 6.0 - 12.0);
    absl::StatusOr<CostCoefficients> fit = FitProfile(LinearTable(shape, a, b, c), shape);
    ASSERT_TRUE(fit.ok()) << fit.status();
    ExpectRelativeNear(fit->per_block, a, 1e-6, absl::StrCat("case ", i, " per_block"));
    ExpectRelativeNear(fit->per_token, b, 1e-6, absl::StrCat("case ", i, " per_token"));
    EXPECT_NEAR(fit->per_sample, c, 1e-6 * c + 1e-12) << "case " << i;
  }
}

TEST(FitProfileTest, RejectsTooFewRowsOrLengths) {
  ProfileTable table;
  table.rows = {{8192, 1.0, 0.1}, {8192, 0.3, 0.05}};
  absl::StatusOr<CostCoefficients> fit = FitProfile(table, ModelShape());
  ASSERT_FALSE(fit.ok());
  EXPECT_EQ(fit.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(fit.status().message()), HasSubstr("at least 3 rows"));
  table.rows.push_back({8192, 0.1, 0.03});  // three rows, one length
  fit = FitProfile(table, ModelShape());
  ASSERT_FALSE(fit.ok());
  EXPECT_THAT(std::string(fit.status().message()), HasSubstr("2 distinct lengths"));
}

TEST(FitProfileTest, RejectsATableWithoutAttentionTime) {
  // Time depends on length only: per_block fits to zero.
  ProfileTable table;
  for (int64_t length : {4096, 16384, 65536}) {
    for (double density : {1.0, 0.3}) {
      table.rows.push_back({length, density, 1e-5 * static_cast<double>(length)});
    }
  }
  absl::StatusOr<CostCoefficients> fit = FitProfile(table, ModelShape());
  ASSERT_FALSE(fit.ok());
  EXPECT_EQ(fit.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(fit.status().message()), HasSubstr("degenerate"));
}

// Weighted least squares without constraints by modified Gram-Schmidt on the scaled rows
// (independent of the implementation's normal equations).
// Not inlined: GCC 12 inlined into the test body reports a bogus -Wfree-nonheap-object.
[[gnu::noinline]] std::vector<double> UnconstrainedLeastSquares(
    const std::vector<std::vector<double>>& rows, const std::vector<double>& y,
    const std::vector<double>& w) {
  const size_t n = rows.size();
  const size_t k = rows[0].size();
  std::vector<std::vector<double>> q(k, std::vector<double>(n));
  std::vector<double> target(n);
  for (size_t i = 0; i < n; ++i) {
    const double s = std::sqrt(w[i]);
    for (size_t c = 0; c < k; ++c) q[c][i] = rows[i][c] * s;
    target[i] = y[i] * s;
  }
  std::vector<std::vector<double>> r(k, std::vector<double>(k, 0.0));
  for (size_t c = 0; c < k; ++c) {
    for (size_t p = 0; p < c; ++p) {
      double dot = 0;
      for (size_t i = 0; i < n; ++i) dot += q[p][i] * q[c][i];
      r[p][c] = dot;
      for (size_t i = 0; i < n; ++i) q[c][i] -= dot * q[p][i];
    }
    double norm = 0;
    for (size_t i = 0; i < n; ++i) norm += q[c][i] * q[c][i];
    norm = std::sqrt(norm);
    r[c][c] = norm;
    for (size_t i = 0; i < n; ++i) q[c][i] /= norm;
  }
  std::vector<double> qty(k, 0.0);
  for (size_t c = 0; c < k; ++c) {
    for (size_t i = 0; i < n; ++i) qty[c] += q[c][i] * target[i];
  }
  std::vector<double> x(k, 0.0);
  for (size_t c = k; c-- > 0;) {
    double s = qty[c];
    for (size_t p = c + 1; p < k; ++p) s -= r[c][p] * x[p];
    x[c] = s / r[c][c];
  }
  return x;
}

struct LeastSquaresProblem {
  std::vector<std::vector<double>> rows;
  std::vector<double> targets;
  std::vector<double> weights;
};

// 1-4 columns of very different magnitudes (like blocks, tokens, documents, 1), targets from a
// random truth (each entry negative with probability `negative_share`) plus relative noise.
LeastSquaresProblem RandomProblem(Rng& rng, double negative_share, double noise) {
  LeastSquaresProblem p;
  const size_t k = 1 + rng.NextU64() % 4;
  std::vector<double> truth(k);
  for (size_t c = 0; c < k; ++c) {
    const double magnitude = std::exp(rng.Uniform() * 4.0 - 4.0 * c);
    truth[c] = negative_share > 0 && rng.Uniform() < negative_share ? -magnitude : magnitude;
  }
  const int n = 8 + static_cast<int>(rng.NextU64() % 40);
  for (int i = 0; i < n; ++i) {
    std::vector<double> x(k);
    for (size_t c = 0; c < k; ++c) {
      x[c] = c + 1 == k ? 1.0 : std::exp(rng.Uniform() * 6.0 + 4.0 * static_cast<double>(c));
    }
    double y = 0;
    for (size_t c = 0; c < k; ++c) y += x[c] * truth[c];
    y += noise * (rng.Uniform() - 0.5) * std::fabs(y) + noise * (rng.Uniform() - 0.5);
    p.rows.push_back(x);
    p.targets.push_back(y);
    p.weights.push_back(0.5 + rng.Uniform());
  }
  return p;
}

// Gradient of 0.5 * sum_i w_i (x_i . c - y_i)^2.
std::vector<double> Gradient(const LeastSquaresProblem& p, const std::vector<double>& c) {
  std::vector<double> g(c.size(), 0.0);
  for (size_t i = 0; i < p.rows.size(); ++i) {
    double residual = -p.targets[i];
    for (size_t j = 0; j < c.size(); ++j) residual += p.rows[i][j] * c[j];
    for (size_t j = 0; j < c.size(); ++j) g[j] += p.weights[i] * residual * p.rows[i][j];
  }
  return g;
}

// Draws 300 problems from `seed` (RandomProblem) and solves each with NonNegativeLeastSquares,
// which must give one coefficient per column; then check(problem, solution). Stops at the first
// fatal failure.
template <typename Check>
void SolveRandomProblems(uint64_t seed, double negative_share, double noise, Check check) {
  Rng rng(seed);
  for (int t = 0; t < 300; ++t) {
    SCOPED_TRACE(::testing::Message() << "problem " << t);
    const LeastSquaresProblem p = RandomProblem(rng, negative_share, noise);
    const std::vector<double> got = NonNegativeLeastSquares(p.rows, p.targets, p.weights);
    ASSERT_EQ(got.size(), p.rows.front().size());
    check(p, got);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(NonNegativeLeastSquaresTest, MatchesUnconstrainedSolutionWhenThatIsNonNegative) {
  int compared = 0;
  SolveRandomProblems(
      3, /*negative_share=*/0.0, /*noise=*/0.01,
      [&](const LeastSquaresProblem& p, const std::vector<double>& got) {
        const std::vector<double> free = UnconstrainedLeastSquares(p.rows, p.targets, p.weights);
        bool non_negative = true;
        for (double v : free) non_negative = non_negative && v >= 0;
        if (!non_negative) return;
        ++compared;
        for (size_t c = 0; c < got.size(); ++c) {
          ASSERT_NEAR(got[c], free[c], 1e-6 * std::fabs(free[c]) + 1e-12) << "column " << c;
        }
      });
  EXPECT_GT(compared, 200);
}

TEST(NonNegativeLeastSquaresTest, ReturnsANonNegativeOptimum) {
  // Truths with negative entries: the answer is the constrained optimum, checked by the KKT
  // conditions (zero gradient on the free columns, a non-negative one on the clamped ones).
  int clamped_cases = 0;
  SolveRandomProblems(4, /*negative_share=*/0.4, /*noise=*/0.05,
                      [&](const LeastSquaresProblem& p, const std::vector<double>& got) {
                        const std::vector<double> g = Gradient(p, got);
                        // Scale of the gradient entries: |x_j| |y| summed.
                        for (size_t c = 0; c < got.size(); ++c) {
                          ASSERT_GE(got[c], 0.0) << "column " << c;
                          double scale = 0;
                          for (size_t i = 0; i < p.rows.size(); ++i) {
                            scale += p.weights[i] * std::fabs(p.rows[i][c] * p.targets[i]);
                          }
                          if (got[c] > 0) {
                            ASSERT_NEAR(g[c], 0.0, 1e-7 * scale) << "free column " << c;
                          } else {
                            ++clamped_cases;
                            ASSERT_GE(g[c], -1e-7 * scale) << "clamped column " << c;
                          }
                        }
                      });
  EXPECT_GT(clamped_cases, 50);
}

TEST(NonNegativeLeastSquaresTest, AllNegativeCorrelationGivesZero) {
  const std::vector<std::vector<double>> rows = {{1.0, 1.0}, {2.0, 1.0}, {3.0, 1.0}};
  const std::vector<double> targets = {-1.0, -2.0, -3.0};
  const std::vector<double> weights = {1.0, 1.0, 1.0};
  EXPECT_EQ(NonNegativeLeastSquares(rows, targets, weights), (std::vector<double>{0.0, 0.0}));
}

}  // namespace
}  // namespace sparsebalance
