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

namespace {

// Batch versions, written with GCC/Clang vector extensions: two lanes (SSE2) for the baseline
// target and four (AVX2, chosen at run time). Each lane performs exactly the scalar's IEEE
// operations in the same order, so the bits are the same; inputs the scalar sends down a special
// path are left to the scalar function.
template <int kLanes>
struct Vec {
  typedef double D __attribute__((vector_size(8 * kLanes)));
  typedef int64_t I __attribute__((vector_size(8 * kLanes)));
  typedef uint64_t U __attribute__((vector_size(8 * kLanes)));
};

constexpr double kShifter = 0x1.8p52;  // RoundToInteger's: y + kShifter holds round(y) in its bits
constexpr uint64_t kShifterBits = 0x4338000000000000;

#define SB_ALWAYS_INLINE inline __attribute__((always_inline))

// Whether any lane has its sign bit set. The kernels use it for range tests with the operations
// SSE2 has: for limit < 2^63, t | (limit - t) has its sign bit set iff t > limit (unsigned).
template <int kLanes>
SB_ALWAYS_INLINE bool AnySignBit(const typename Vec<kLanes>::U& v) {
  uint64_t any = v[0];
  for (int lane = 1; lane < kLanes; ++lane) any |= v[lane];
  return (any >> 63) != 0;
}

// Lanes: out[0..kLanes) = DetExp(x[0..kLanes)) where the sign bit it sets in slow is clear.
struct DetExpOp {
  static double Scalar(double x) { return DetExp(x); }

  template <int kLanes>
  SB_ALWAYS_INLINE static void Lanes(const double* x, double* out, typename Vec<kLanes>::U& slow) {
    using D = typename Vec<kLanes>::D;
    using U = typename Vec<kLanes>::U;
    D xv;
    std::memcpy(&xv, x, sizeof xv);
    const D shifted = xv * kSixtyFourOverLn2 + kShifter;
    const D kd = shifted - kShifter;
    const D r = (xv - kd * kLn2Over64Hi) - kd * kLn2Over64Lo;
    const D p =
        1.0 + r * (1.0 + r * (1.0 / 2 +
                              r * (1.0 / 6 + r * (1.0 / 24 + r * (1.0 / 120 + r * (1.0 / 720))))));
    // The bits of shifted are kShifterBits + n, and kShifterBits is a multiple of 2^51: so
    // j = n & 63, and masking off j then shifting left by 46 leaves k << 52 (modulo 2^64), the
    // exponent field of 2^k once the bias is added.
    const U n_bits = __builtin_bit_cast(U, shifted);
    const U j = n_bits & (kExpTableSize - 1);
    const U power_bits = ((n_bits & ~uint64_t{kExpTableSize - 1}) << 46) + (uint64_t{1023} << 52);
    D table;
    for (int lane = 0; lane < kLanes; ++lane) table[lane] = kExp2Table[j[lane]];
    const D result = (table * p) * __builtin_bit_cast(D, power_bits);
    // The scalar's fast path is k in [-1021, 1022], i.e. n in [-65344, 65471]: exactly the lanes
    // whose shifted bits lie within kShifterBits + [-65344, 65471] (NaN and infinities do not).
    const U t = n_bits - (kShifterBits - 65344);
    slow |= t | ((65344 + 65471) - t);  // sign bit set iff t > 65344 + 65471
    std::memcpy(out, &result, sizeof result);
  }
};

// Lanes: out[0..kLanes) = DetLog(x[0..kLanes)) where the sign bit it sets in slow is clear.
struct DetLogOp {
  static double Scalar(double x) { return DetLog(x); }

  template <int kLanes>
  SB_ALWAYS_INLINE static void Lanes(const double* x, double* out, typename Vec<kLanes>::U& slow) {
    using D = typename Vec<kLanes>::D;
    using I = typename Vec<kLanes>::I;
    using U = typename Vec<kLanes>::U;
    D xv;
    std::memcpy(&xv, x, sizeof xv);
    const U bits = __builtin_bit_cast(U, xv);
    // m in [0.5, 1) from the significand; the sign bit is dropped so that every lane, even one
    // left to the scalar function, indexes the table in bounds.
    U m_bits = (bits & 0x000fffffffffffff) | (uint64_t{1022} << 52);
    // m < sqrt(1/2): m *= 2 (exactly: exponent field + 1) and e -= 1.
    const I small = __builtin_bit_cast(D, m_bits) < 0.70710678118654752440;
    m_bits += __builtin_bit_cast(U, small) & (uint64_t{1} << 52);
    const D m = __builtin_bit_cast(D, m_bits);
    // With the sign bit, (bits >> 52) - 1 is in [0, 2045] iff x is positive, normal and finite:
    // the scalar's fast path.
    const U biased_minus_1 = (bits >> 52) - 1;
    slow |= biased_minus_1 | (2045 - biased_minus_1);
    // e = biased - 1022 (- 1), converted exactly to double through the shifter's bits.
    const U e_bits = biased_minus_1 + (kShifterBits - 1021) + __builtin_bit_cast(U, small);
    const D e = __builtin_bit_cast(D, e_bits) - kShifter;
    const D shifted = m * 64.0 + kShifter;
    const D i = shifted - kShifter;
    const D c = i / 64.0;
    const D s = (m - c) / (m + c);
    const U index = (__builtin_bit_cast(U, shifted) & 127) - kLogTableFirst;
    D table;
    for (int lane = 0; lane < kLanes; ++lane) table[lane] = kLogTable[index[lane]];
    const D s2 = s * s;
    const D poly =
        1.0 + s2 * (1.0 / 3 + s2 * (1.0 / 5 + s2 * (1.0 / 7 + s2 * (1.0 / 9 + s2 * (1.0 / 11)))));
    const D twice_atanh = 2.0 * s * poly;
    const D result = (e * kLn2Hi + table) + (twice_atanh + e * kLn2Lo);
    std::memcpy(out, &result, sizeof result);
  }
};

// out[i] = Op::Scalar(x[i]) for i < n, x == out or disjoint. The vector kernel fills a block
// and sets the sign bit of slow for lanes the scalar takes a special path on; such a block (rare)
// is redone by the scalar function, from x, which is why an in-place call fills a buffer first.
// With no call in the vector loop, the compiler keeps the constants in registers.
template <typename Op, int kLanes>
SB_ALWAYS_INLINE void ApplyAll(const double* x, double* out, size_t n) {
  constexpr size_t kBlock = 64;
  double buffer[kBlock];
  double* const block = x == out ? buffer : nullptr;
  while (n >= kLanes) {
    const size_t len = (n < kBlock ? n : kBlock) / kLanes * kLanes;
    double* const dest = block != nullptr ? block : out;
    typename Vec<kLanes>::U slow = {};
    for (size_t i = 0; i < len; i += kLanes) Op::template Lanes<kLanes>(x + i, dest + i, slow);
    if (AnySignBit<kLanes>(slow)) {
      for (size_t i = 0; i < len; ++i) dest[i] = Op::Scalar(x[i]);
    }
    if (dest != out) std::memcpy(out, dest, len * sizeof(double));
    x += len;
    out += len;
    n -= len;
  }
  for (size_t i = 0; i < n; ++i) out[i] = Op::Scalar(x[i]);
}

#undef SB_ALWAYS_INLINE

#if defined(__x86_64__) || defined(__i386__)
// "avx2" does not enable FMA, so these give the same bits as the baseline versions. Other
// targets (aarch64: NEON has two double lanes) use the baseline versions alone.
#define SB_DET_MATH_AVX2 1
__attribute__((target("avx2"))) void DetExpAllAvx2(const double* x, double* out, size_t n) {
  ApplyAll<DetExpOp, 4>(x, out, n);
}
__attribute__((target("avx2"))) void DetLogAllAvx2(const double* x, double* out, size_t n) {
  ApplyAll<DetLogOp, 4>(x, out, n);
}
#endif

}  // namespace

namespace det_math_internal {

void DetExpAllBaseline(const double* x, double* out, size_t n) { ApplyAll<DetExpOp, 2>(x, out, n); }
void DetLogAllBaseline(const double* x, double* out, size_t n) { ApplyAll<DetLogOp, 2>(x, out, n); }

}  // namespace det_math_internal

#ifdef SB_DET_MATH_AVX2
void DetExpAll(const double* x, double* out, size_t n) {
  static const auto impl =
      __builtin_cpu_supports("avx2") ? DetExpAllAvx2 : det_math_internal::DetExpAllBaseline;
  impl(x, out, n);
}

void DetLogAll(const double* x, double* out, size_t n) {
  static const auto impl =
      __builtin_cpu_supports("avx2") ? DetLogAllAvx2 : det_math_internal::DetLogAllBaseline;
  impl(x, out, n);
}
#undef SB_DET_MATH_AVX2
#else
void DetExpAll(const double* x, double* out, size_t n) {
  det_math_internal::DetExpAllBaseline(x, out, n);
}
void DetLogAll(const double* x, double* out, size_t n) {
  det_math_internal::DetLogAllBaseline(x, out, n);
}
#endif

double DetPow(double base, double exponent) {
  if (exponent == 0.0) return 1.0;  // as std::pow, even for 0, inf and NaN bases
  if (base == 0.0) return exponent > 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return DetExp(exponent * DetLog(base));
}

}  // namespace sparsebalance
