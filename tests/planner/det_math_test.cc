#include "planner/det_math.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "gtest/gtest.h"
#include "planner/random.h"

namespace sparsebalance {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr int kCases = 20000;

// Distance in units in the last place between two finite doubles of the same sign.
int64_t UlpDistance(double a, double b) {
  int64_t ia = 0;
  int64_t ib = 0;
  std::memcpy(&ia, &a, sizeof(a));
  std::memcpy(&ib, &b, sizeof(b));
  return ia > ib ? ia - ib : ib - ia;
}

double RelativeError(double got, double want) {
  return want == 0.0 ? std::fabs(got) : std::fabs(got - want) / std::fabs(want);
}

// The accuracy the planner relies on: within 1e-15 relative and 4 ulps of the libm result.
::testing::AssertionResult MatchesLibm(double got, double want) {
  if (RelativeError(got, want) <= 1e-15 && UlpDistance(got, want) <= 4) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << got << " vs libm's " << want << ": relative error " << RelativeError(got, want) << ", "
         << UlpDistance(got, want) << " ulps";
}

TEST(DetExpTest, AgreesWithStdExpOverTheNormalRange) {
  Rng rng(1);
  for (int i = 0; i < kCases; ++i) {
    // Both small arguments (where the reduction is trivial) and the whole normal range.
    const double x = i % 2 == 0 ? -708.0 + 1417.0 * rng.Uniform() : 4.0 * rng.Uniform() - 2.0;
    ASSERT_TRUE(MatchesLibm(DetExp(x), std::exp(x))) << "x = " << x;
  }
}

TEST(DetExpTest, SubnormalResultsAreWithinAFewSubnormalUlps) {
  Rng rng(2);
  for (int i = 0; i < kCases; ++i) {
    const double x = -745.0 + 37.0 * rng.Uniform();  // e^x below DBL_MIN
    const double want = std::exp(x);
    ASSERT_LE(UlpDistance(DetExp(x), want), 4) << "x = " << x;
  }
}

TEST(DetExpTest, EdgeCases) {
  EXPECT_EQ(DetExp(0.0), 1.0);
  EXPECT_EQ(DetExp(-0.0), 1.0);
  EXPECT_EQ(DetExp(kInf), kInf);
  EXPECT_EQ(DetExp(-kInf), 0.0);
  EXPECT_TRUE(std::isnan(DetExp(kNaN)));
  EXPECT_EQ(DetExp(710.0), kInf);
  EXPECT_EQ(DetExp(1e300), kInf);
  EXPECT_EQ(DetExp(-746.0), 0.0);
  EXPECT_EQ(DetExp(-1e300), 0.0);
  EXPECT_TRUE(std::isfinite(DetExp(709.7)));
  EXPECT_LE(RelativeError(DetExp(1.0), M_E), 1e-15);
  EXPECT_LE(RelativeError(DetExp(1e-300), 1.0), 1e-16);
}

TEST(DetLogTest, AgreesWithStdLogOverTheWholeRange) {
  Rng rng(3);
  for (int i = 0; i < kCases; ++i) {
    // Mantissa in [1, 2), exponent over normal and subnormal magnitudes.
    const int exponent = static_cast<int>(rng.NextU64() % 2098) - 1074;
    const double x = std::ldexp(1.0 + rng.Uniform(), exponent);
    if (x == 0.0 || std::isinf(x)) continue;
    ASSERT_TRUE(MatchesLibm(DetLog(x), std::log(x))) << "x = " << x;
  }
}

TEST(DetLogTest, AgreesWithStdLogNearOne) {
  // log(x) is near zero here, the hardest case for relative accuracy.
  Rng rng(4);
  for (int i = 0; i < kCases; ++i) {
    const double x = 1.0 + std::ldexp(rng.Uniform() - 0.5, -static_cast<int>(rng.NextU64() % 40));
    if (x == 1.0) continue;
    ASSERT_TRUE(MatchesLibm(DetLog(x), std::log(x))) << "x = " << x;
  }
}

TEST(DetLogTest, EdgeCases) {
  EXPECT_EQ(DetLog(1.0), 0.0);
  EXPECT_EQ(DetLog(0.0), -kInf);
  EXPECT_EQ(DetLog(-0.0), -kInf);
  EXPECT_EQ(DetLog(kInf), kInf);
  EXPECT_TRUE(std::isnan(DetLog(-1.0)));
  EXPECT_TRUE(std::isnan(DetLog(-1e-300)));
  EXPECT_TRUE(std::isnan(DetLog(-kInf)));
  EXPECT_TRUE(std::isnan(DetLog(kNaN)));
  EXPECT_LE(RelativeError(DetLog(std::numeric_limits<double>::denorm_min()),
                          std::log(std::numeric_limits<double>::denorm_min())),
            1e-15);
  EXPECT_LE(RelativeError(DetLog(std::numeric_limits<double>::max()),
                          std::log(std::numeric_limits<double>::max())),
            1e-15);
  EXPECT_LE(RelativeError(DetLog(2.0), M_LN2), 1e-15);
  EXPECT_LE(RelativeError(DetLog(M_E), 1.0), 1e-15);
}

TEST(DetPowTest, AgreesWithStdPowWhereThePlannerUsesIt) {
  // The recall model raises (1 - rho) in [0, 1] to exponents in [0.25, 6].
  Rng rng(5);
  for (int i = 0; i < kCases; ++i) {
    const double base = rng.Uniform();
    const double exponent = 0.25 + 5.75 * rng.Uniform();
    if (base == 0.0) continue;
    const double want = std::pow(base, exponent);
    const double scale = std::max(1.0, std::fabs(exponent * std::log(base)));
    ASSERT_LE(RelativeError(DetPow(base, exponent), want), 1e-15 * scale)
        << base << "^" << exponent;
  }
}

TEST(DetPowTest, AgreesWithStdPowOverWideRanges) {
  // exp(y log b) loses about |y log b| ulp of relative accuracy to the rounding of y log b, so
  // the tolerance grows with the size of the result's logarithm.
  Rng rng(6);
  for (int i = 0; i < kCases; ++i) {
    const double base =
        std::ldexp(1.0 + rng.Uniform(), static_cast<int>(rng.NextU64() % 200) - 100);
    const double exponent = 20.0 * rng.Uniform() - 10.0;
    const double want = std::pow(base, exponent);
    const double scale = std::max(1.0, std::fabs(exponent * std::log(base)));
    ASSERT_LE(RelativeError(DetPow(base, exponent), want), 1e-15 * scale)
        << base << "^" << exponent;
  }
}

TEST(DetPowTest, EdgeCases) {
  EXPECT_EQ(DetPow(0.0, 2.0), 0.0);
  EXPECT_EQ(DetPow(0.0, 0.25), 0.0);
  EXPECT_EQ(DetPow(1.0, 123.456), 1.0);
  EXPECT_EQ(DetPow(7.5, 0.0), 1.0);
  EXPECT_EQ(DetPow(1e-300, 0.0), 1.0);
  EXPECT_LE(RelativeError(DetPow(2.0, 10.0), 1024.0), 1e-15);
  EXPECT_LE(RelativeError(DetPow(0.3, 1.0), 0.3), 1e-15);
  EXPECT_LE(RelativeError(DetPow(4.0, 0.5), 2.0), 1e-15);
  EXPECT_EQ(DetPow(0.5, 2000.0), 0.0);  // underflows like std::pow
  EXPECT_EQ(DetPow(2.0, 2000.0), kInf);
  EXPECT_TRUE(std::isnan(DetPow(-2.0, 2.0)));
  EXPECT_TRUE(std::isnan(DetPow(kNaN, 2.0)));
}

}  // namespace
}  // namespace sparsebalance
