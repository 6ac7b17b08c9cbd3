#include "planner/det_math.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

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

// The batch functions against the scalar ones, bit for bit. Both the dispatched versions (AVX2
// where the CPU has it) and the SSE2 baseline are checked.

using ScalarFn = double (*)(double);
using BatchFn = void (*)(const double*, double*, size_t);

uint64_t Bits(double x) {
  uint64_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

double FromBits(uint64_t bits) {
  double x = 0.0;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

std::string Hex(double x) {
  char text[24];
  std::snprintf(text, sizeof text, "0x%016llx", static_cast<unsigned long long>(Bits(x)));
  return text;
}

// After the last element to be written: a NaN payload that none of the inputs has.
const double kGuard = FromBits(0x7ff4000000c0ffeeULL);

// Whether out[0, n) holds scalar(x[0, n)) bit for bit, and out[n] is still kGuard.
::testing::AssertionResult SameBits(ScalarFn scalar, const double* x, const double* out, size_t n,
                                    bool guarded) {
  for (size_t i = 0; i < n; ++i) {
    const double want = scalar(x[i]);
    if (std::memcmp(&want, &out[i], sizeof want) != 0) {
      return ::testing::AssertionFailure()
             << "element " << i << " of " << n << ": x = " << x[i] << " (" << Hex(x[i])
             << "), scalar " << Hex(want) << ", batch " << Hex(out[i]);
    }
  }
  if (guarded && Bits(out[n]) != Bits(kGuard)) {
    return ::testing::AssertionFailure() << "wrote past element " << n;
  }
  return ::testing::AssertionSuccess();
}

// Runs batch over the whole of xs and over every n in [0, 40] at starts 0..7 into xs (and into
// the output), out of place and in place.
void ExpectSameBitsAsScalar(ScalarFn scalar, BatchFn batch, const std::vector<double>& xs) {
  std::vector<double> out(xs.size() + 1, kGuard);
  batch(xs.data(), out.data(), xs.size());
  ASSERT_TRUE(SameBits(scalar, xs.data(), out.data(), xs.size(), true)) << "whole array";
  std::vector<double> in_place = xs;
  batch(in_place.data(), in_place.data(), in_place.size());
  ASSERT_TRUE(SameBits(scalar, xs.data(), in_place.data(), xs.size(), false)) << "in place";

  constexpr size_t kMaxN = 40;
  for (size_t start = 0; start < 8; ++start) {
    for (size_t n = 0; n <= kMaxN && start + n <= xs.size(); ++n) {
      const double* x = xs.data() + start;
      std::vector<double> window(kMaxN + 16, kGuard);
      double* dest = window.data() + (start + 3) % 8;  // unaligned differently from x
      batch(x, dest, n);
      ASSERT_TRUE(SameBits(scalar, x, dest, n, true)) << "start " << start;
      std::copy(x, x + n, dest);
      batch(dest, dest, n);
      ASSERT_TRUE(SameBits(scalar, x, dest, n, true)) << "in place, start " << start;
    }
  }
}

void ExpectExpAllMatches(const std::vector<double>& xs) {
  {
    SCOPED_TRACE("DetExpAll");
    ExpectSameBitsAsScalar(DetExp, DetExpAll, xs);
  }
  SCOPED_TRACE("DetExpAllBaseline");
  ExpectSameBitsAsScalar(DetExp, det_math_internal::DetExpAllBaseline, xs);
}

void ExpectLogAllMatches(const std::vector<double>& xs) {
  {
    SCOPED_TRACE("DetLogAll");
    ExpectSameBitsAsScalar(DetLog, DetLogAll, xs);
  }
  SCOPED_TRACE("DetLogAllBaseline");
  ExpectSameBitsAsScalar(DetLog, det_math_internal::DetLogAllBaseline, xs);
}

constexpr size_t kBatchCases = 1 << 17;

// Random bit patterns: every sign and exponent, NaNs with payloads, infinities, subnormals.
std::vector<double> AnyDoubles(uint64_t seed) {
  Rng rng(seed);
  std::vector<double> xs(kBatchCases);
  for (double& x : xs) x = FromBits(rng.NextU64());
  return xs;
}

// Each special value at a different position relative to the vector lanes, between ordinary
// arguments, then all of them in a row.
std::vector<double> Interleave(const std::vector<double>& specials, double lo, double hi) {
  Rng rng(7);
  std::vector<double> xs;
  for (size_t i = 0; i < specials.size(); ++i) {
    for (size_t pad = 0; pad < i % 7; ++pad) xs.push_back(lo + (hi - lo) * rng.Uniform());
    xs.push_back(specials[i]);
  }
  xs.insert(xs.end(), specials.begin(), specials.end());
  return xs;
}

// Values for both functions: zeros, infinities, NaNs, subnormals, extremes.
std::vector<double> CommonSpecials() {
  const double kMin = std::numeric_limits<double>::min();
  const double kMax = std::numeric_limits<double>::max();
  const double kDenormMin = std::numeric_limits<double>::denorm_min();
  std::vector<double> xs = {0.0,
                            -0.0,
                            kInf,
                            -kInf,
                            kNaN,
                            -kNaN,
                            FromBits(0x7ff0000000000001ULL),  // signalling
                            FromBits(0xfff8deadbeef0001ULL),
                            kDenormMin,
                            -kDenormMin,
                            std::nextafter(kMin, 0.0),  // the largest subnormal
                            -std::nextafter(kMin, 0.0),
                            kMin,
                            -kMin,
                            std::nextafter(kMin, 1.0),
                            kMax,
                            -kMax,
                            std::nextafter(kMax, 0.0),
                            1.0,
                            -1.0,
                            1e-300,
                            -1e-300,
                            1e300,
                            -1e300};
  for (int e = -1074; e <= 1023; e += 7) {
    xs.push_back(std::ldexp(1.0, e));
    xs.push_back(-std::ldexp(1.0, e));
  }
  return xs;
}

// Up to count ulps either side of x.
void AddNeighbours(double x, int count, std::vector<double>* xs) {
  double below = x;
  double above = x;
  xs->push_back(x);
  for (int i = 0; i < count; ++i) {
    below = std::nextafter(below, -kInf);
    above = std::nextafter(above, kInf);
    xs->push_back(below);
    xs->push_back(above);
  }
}

TEST(DetExpAllTest, MatchesDetExpOverTheWholeDoubleRange) { ExpectExpAllMatches(AnyDoubles(11)); }

TEST(DetExpAllTest, MatchesDetExpOverThePlannersRange) {
  Rng rng(12);
  std::vector<double> xs(kBatchCases);
  for (double& x : xs) x = -50.0 + 55.0 * rng.Uniform();
  ExpectExpAllMatches(xs);
}

TEST(DetExpAllTest, MatchesDetExpOnSpecialValues) {
  std::vector<double> specials = CommonSpecials();
  // The range test's edges, and where k = floor(n / 64) leaves [-1021, 1022] (n changes at
  // x = (n + 1/2) ln2 / 64): the scalar's ldexp path, subnormal results, overflow, underflow.
  for (const double edge :
       {709.78, -745.13, 65471.5 * M_LN2 / 64, 65472.5 * M_LN2 / 64, -65344.5 * M_LN2 / 64,
        -65345.5 * M_LN2 / 64, 709.782712893384, -745.1332191019411, -708.3964185322641}) {
    AddNeighbours(edge, 40, &specials);
  }
  for (double x = 700.0; x < 712.0; x += 0.01) specials.push_back(x);
  for (double x = -700.0; x > -750.0; x -= 0.01) specials.push_back(x);
  ExpectExpAllMatches(Interleave(specials, -50.0, 5.0));
}

TEST(DetLogAllTest, MatchesDetLogOverTheWholeDoubleRange) { ExpectLogAllMatches(AnyDoubles(13)); }

TEST(DetLogAllTest, MatchesDetLogOverThePlannersRange) {
  Rng rng(14);
  std::vector<double> xs(kBatchCases);
  for (size_t i = 0; i < xs.size(); ++i) {
    xs[i] = i % 2 == 0 ? 1.0 - rng.Uniform() : 1.0 + (1e6 - 1.0) * rng.Uniform();
  }
  ExpectLogAllMatches(xs);
}

TEST(DetLogAllTest, MatchesDetLogOnSpecialValues) {
  std::vector<double> specials = CommonSpecials();
  // Around 1, and around sqrt(1/2) (where m is doubled) at several exponents.
  AddNeighbours(1.0, 40, &specials);
  for (const int e : {-1060, -1022, -1021, -1, 0, 1, 1023}) {
    AddNeighbours(std::ldexp(0.70710678118654752440, e), 8, &specials);
  }
  // m * 64 exactly halfway between table points (rounded to even).
  for (int i = 90; i <= 182; ++i) specials.push_back(i / 128.0);
  ExpectLogAllMatches(Interleave(specials, 1e-6, 1.0));
}

}  // namespace
}  // namespace sparsebalance
