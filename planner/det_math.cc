#include "planner/det_math.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace sparsebalance {
namespace {

constexpr double kLn2Hi = 6.93147180369123816490e-01;
constexpr double kLn2Lo = 1.90821492927058770002e-10;
constexpr double kInvLn2 = 1.44269504088896338700e+00;

constexpr double kInverseFactorial[14] = {1.0,
                                          1.0,
                                          1.0 / 2,
                                          1.0 / 6,
                                          1.0 / 24,
                                          1.0 / 120,
                                          1.0 / 720,
                                          1.0 / 5040,
                                          1.0 / 40320,
                                          1.0 / 362880,
                                          1.0 / 3628800,
                                          1.0 / 39916800,
                                          1.0 / 479001600,
                                          1.0 / 6227020800.0};
constexpr double kInverseOdd[14] = {1.0,      1.0 / 3,  1.0 / 5,  1.0 / 7,  1.0 / 9,
                                    1.0 / 11, 1.0 / 13, 1.0 / 15, 1.0 / 17, 1.0 / 19,
                                    1.0 / 21, 1.0 / 23, 1.0 / 25, 1.0 / 27};

// 2^k for a normal exponent, built from its bits.
double PowerOfTwo(int k) {
  const uint64_t bits = static_cast<uint64_t>(k + 1023) << 52;
  double out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

}  // namespace

double DetExp(double x) {
  if (std::isnan(x)) return x;
  if (x > 709.78) return std::numeric_limits<double>::infinity();
  if (x < -745.13) return 0.0;
  // x = k*ln2 + r with |r| <= ln2/2; e^x = 2^k * e^r.
  const double kd = std::nearbyint(x * kInvLn2);
  const int k = static_cast<int>(kd);
  const double r = (x - kd * kLn2Hi) - kd * kLn2Lo;
  // Taylor series of e^r to degree 13 by Horner's rule: the remainder is below 1e-17 for
  // |r| <= 0.35. The coefficients 1/i! are compile-time constants (correctly rounded).
  double sum = kInverseFactorial[13];
  for (int i = 12; i >= 0; --i) sum = sum * r + kInverseFactorial[i];
  if (k > -1022 && k < 1023) return sum * PowerOfTwo(k);  // exact scaling, no libm call
  return std::ldexp(sum, k);
}

double DetLog(double x) {
  if (std::isnan(x) || x < 0) return std::numeric_limits<double>::quiet_NaN();
  if (x == 0) return -std::numeric_limits<double>::infinity();
  if (std::isinf(x)) return x;
  // x = m * 2^e with m in [sqrt(1/2), sqrt(2)); log x = e*ln2 + log m.
  int e = 0;
  double m = 0.0;
  uint64_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  const int biased = static_cast<int>((bits >> 52) & 0x7ff);
  if (biased == 0) {
    m = std::frexp(x, &e);  // subnormal: rare, let libm normalise (exact)
  } else {
    e = biased - 1022;  // x = m * 2^e with m in [0.5, 1)
    bits = (bits & 0x800fffffffffffffULL) | (static_cast<uint64_t>(1022) << 52);
    std::memcpy(&m, &bits, sizeof m);
  }
  if (m < 0.70710678118654752440) {
    m *= 2.0;
    e -= 1;
  }
  // log m = 2 atanh(s), s = (m-1)/(m+1), |s| <= 0.1716: the series converges fast.
  const double s = (m - 1.0) / (m + 1.0);
  // 2 atanh(s) = 2 sum_k s^(2k+1) / (2k+1); 15 terms leave an error below 1e-23 here.
  const double s2 = s * s;
  double sum = 1.0 / 29.0;
  for (int k = 13; k >= 0; --k) sum = sum * s2 + kInverseOdd[k];
  return 2.0 * s * sum + e * kLn2Lo + e * kLn2Hi;
}

double DetPow(double base, double exponent) {
  if (exponent == 0.0) return 1.0;  // as std::pow, even for 0, inf and NaN bases
  if (base == 0.0) return exponent > 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return DetExp(exponent * DetLog(base));
}

}  // namespace sparsebalance
