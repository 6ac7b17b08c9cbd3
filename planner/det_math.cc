#include "planner/det_math.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace sparsebalance {
namespace {

// The tables below hold correctly rounded values (computed once with 60-digit decimal
// arithmetic); everything else is IEEE-754 +, -, *, / and exact scaling by powers of two.

constexpr double kLn2Hi = 6.93147180369123816490e-01;  // 32 significant bits: e*kLn2Hi exact
constexpr double kLn2Lo = 1.90821492927058770002e-10;

// exp: x = (64k + j) ln2/64 + r, e^x = 2^k * 2^(j/64) * e^r with |r| <= ln2/128.
constexpr int kExpTableBits = 6;
constexpr int kExpTableSize = 1 << kExpTableBits;
constexpr double kSixtyFourOverLn2 = 0x1.71547652b82fep+6;
constexpr double kLn2Over64Hi = 0x1.62e42ff000000p-7;  // 32 significant bits: kd*kLn2Over64Hi exact
constexpr double kLn2Over64Lo = -0x1.718432a1b0e26p-41;
// 2^(j/64), j = 0..63.
constexpr double kExp2Table[kExpTableSize] = {
    0x1.0000000000000p+0, 0x1.02c9a3e778061p+0, 0x1.059b0d3158574p+0, 0x1.0874518759bc8p+0,
    0x1.0b5586cf9890fp+0, 0x1.0e3ec32d3d1a2p+0, 0x1.11301d0125b51p+0, 0x1.1429aaea92de0p+0,
    0x1.172b83c7d517bp+0, 0x1.1a35beb6fcb75p+0, 0x1.1d4873168b9aap+0, 0x1.2063b88628cd6p+0,
    0x1.2387a6e756238p+0, 0x1.26b4565e27cddp+0, 0x1.29e9df51fdee1p+0, 0x1.2d285a6e4030bp+0,
    0x1.306fe0a31b715p+0, 0x1.33c08b26416ffp+0, 0x1.371a7373aa9cbp+0, 0x1.3a7db34e59ff7p+0,
    0x1.3dea64c123422p+0, 0x1.4160a21f72e2ap+0, 0x1.44e086061892dp+0, 0x1.486a2b5c13cd0p+0,
    0x1.4bfdad5362a27p+0, 0x1.4f9b2769d2ca7p+0, 0x1.5342b569d4f82p+0, 0x1.56f4736b527dap+0,
    0x1.5ab07dd485429p+0, 0x1.5e76f15ad2148p+0, 0x1.6247eb03a5585p+0, 0x1.6623882552225p+0,
    0x1.6a09e667f3bcdp+0, 0x1.6dfb23c651a2fp+0, 0x1.71f75e8ec5f74p+0, 0x1.75feb564267c9p+0,
    0x1.7a11473eb0187p+0, 0x1.7e2f336cf4e62p+0, 0x1.82589994cce13p+0, 0x1.868d99b4492edp+0,
    0x1.8ace5422aa0dbp+0, 0x1.8f1ae99157736p+0, 0x1.93737b0cdc5e5p+0, 0x1.97d829fde4e50p+0,
    0x1.9c49182a3f090p+0, 0x1.a0c667b5de565p+0, 0x1.a5503b23e255dp+0, 0x1.a9e6b5579fdbfp+0,
    0x1.ae89f995ad3adp+0, 0x1.b33a2b84f15fbp+0, 0x1.b7f76f2fb5e47p+0, 0x1.bcc1e904bc1d2p+0,
    0x1.c199bdd85529cp+0, 0x1.c67f12e57d14bp+0, 0x1.cb720dcef9069p+0, 0x1.d072d4a07897cp+0,
    0x1.d5818dcfba487p+0, 0x1.da9e603db3285p+0, 0x1.dfc97337b9b5fp+0, 0x1.e502ee78b3ff6p+0,
    0x1.ea4afa2a490dap+0, 0x1.efa1bee615a27p+0, 0x1.f50765b6e4540p+0, 0x1.fa7c1819e90d8p+0,
};

// log: m in [sqrt(1/2), sqrt(2)) is written as c * (1+s)/(1-s) with c = i/64, so
// log m = log(i/64) + 2 atanh(s), |s| <= 0.0056.
constexpr int kLogTableFirst = 45;  // i = 45..91 covers [sqrt(1/2), sqrt(2)) * 64
constexpr int kLogTableLast = 91;
// log(i/64), i = 45..91.
constexpr double kLogTable[kLogTableLast - kLogTableFirst + 1] = {
    -0x1.68ac83e9c6a14p-2, -0x1.522ae0738a3d8p-2, -0x1.3c25277333184p-2, -0x1.269621134db92p-2,
    -0x1.1178e8227e47cp-2, -0x1.f991c6cb3b379p-3, -0x1.d1037f2655e7bp-3, -0x1.a93ed3c8ad9e3p-3,
    -0x1.823c16551a3c2p-3, -0x1.5bf406b543db2p-3, -0x1.365fcb0159016p-3, -0x1.1178e8227e47cp-3,
    -0x1.da727638446a2p-4, -0x1.9335e5d594989p-4, -0x1.4d3115d207eacp-4, -0x1.08598b59e3a07p-4,
    -0x1.894aa149fb343p-5, -0x1.0415d89e74444p-5, -0x1.0205658935847p-6, 0x0.0p+0,
    0x1.fc0a8b0fc03e4p-7,  0x1.f829b0e783300p-6,  0x1.77458f632dcfcp-5,  0x1.f0a30c01162a6p-5,
    0x1.341d7961bd1d1p-4,  0x1.6f0d28ae56b4cp-4,  0x1.a926d3a4ad563p-4,  0x1.e27076e2af2e6p-4,
    0x1.0d77e7cd08e59p-3,  0x1.29552f81ff523p-3,  0x1.44d2b6ccb7d1ep-3,  0x1.5ff3070a793d4p-3,
    0x1.7ab890210d909p-3,  0x1.9525a9cf456b4p-3,  0x1.af3c94e80bff3p-3,  0x1.c8ff7c79a9a22p-3,
    0x1.e27076e2af2e6p-3,  0x1.fb9186d5e3e2bp-3,  0x1.0a324e27390e3p-2,  0x1.1675cababa60ep-2,
    0x1.22941fbcf7966p-2,  0x1.2e8e2bae11d31p-2,  0x1.3a64c556945eap-2,  0x1.4618bc21c5ec2p-2,
    0x1.51aad872df82dp-2,  0x1.5d1bdbf5809cap-2,  0x1.686c81e9b14afp-2,
};

// Rounds to the nearest integer (ties to even) with one add and one subtract, exact and the
// same everywhere in the default rounding mode, for |x| < 2^51. (IEEE semantics forbid the
// compiler from folding it to x; the planner is never built with -ffast-math.)
double RoundToInteger(double x) {
  constexpr double kShifter = 0x1.8p52;
  return (x + kShifter) - kShifter;
}

// 2^k for a normal exponent, built from its bits.
double PowerOfTwo(int k) {
  const uint64_t bits = static_cast<uint64_t>(k + 1023) << 52;
  double out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// 2 atanh(s) for |s| <= 0.0079: the series to s^11 leaves a relative error below 1e-22.
double TwiceAtanh(double s) {
  const double s2 = s * s;
  const double p =
      1.0 + s2 * (1.0 / 3 + s2 * (1.0 / 5 + s2 * (1.0 / 7 + s2 * (1.0 / 9 + s2 * (1.0 / 11)))));
  return 2.0 * s * p;
}

}  // namespace

double DetExp(double x) {
  // One test for the usual case; NaN fails it too.
  if (!(x >= -745.13 && x <= 709.78)) {
    if (std::isnan(x)) return x;
    return x > 0 ? std::numeric_limits<double>::infinity() : 0.0;
  }
  const double kd = RoundToInteger(x * kSixtyFourOverLn2);
  const int n = static_cast<int>(kd);
  const double r = (x - kd * kLn2Over64Hi) - kd * kLn2Over64Lo;
  // e^r by its Taylor series to r^6 (the remainder is below 1e-19 for |r| <= 0.0055).
  const double p =
      1.0 + r * (1.0 + r * (1.0 / 2 +
                            r * (1.0 / 6 + r * (1.0 / 24 + r * (1.0 / 120 + r * (1.0 / 720))))));
  const int j = n & (kExpTableSize - 1);
  // floor(n / 64): n - j is a multiple of 64, and an arithmetic shift needs no sign fix-up.
  const int k = (n - j) >> kExpTableBits;
  const double scaled = kExp2Table[j] * p;
  // k in [-1021, 1022] in one unsigned comparison: exact scaling, no libm call.
  if (static_cast<unsigned>(k + 1021) < 2044u) return scaled * PowerOfTwo(k);
  return std::ldexp(scaled, k);
}

double DetLog(double x) {
  // One test for the usual case (positive and finite); NaN fails it too.
  if (!(x > 0 && x <= std::numeric_limits<double>::max())) {
    if (std::isnan(x) || x < 0) return std::numeric_limits<double>::quiet_NaN();
    if (x == 0) return -std::numeric_limits<double>::infinity();
    return x;  // +inf
  }
  // x = m * 2^e with m in [sqrt(1/2), sqrt(2)).
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
  const double i = RoundToInteger(m * 64.0);
  const double c = i / 64.0;           // exact
  const double s = (m - c) / (m + c);  // m - c is exact (Sterbenz)
  const double table = kLogTable[static_cast<int>(i) - kLogTableFirst];  // log(1) is 0
  return (e * kLn2Hi + table) + (TwiceAtanh(s) + e * kLn2Lo);
}

double DetPow(double base, double exponent) {
  if (exponent == 0.0) return 1.0;  // as std::pow, even for 0, inf and NaN bases
  if (base == 0.0) return exponent > 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return DetExp(exponent * DetLog(base));
}

}  // namespace sparsebalance
