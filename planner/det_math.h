// Deterministic elementary functions for planning decisions.
//
// Plans must be byte-identical on every rank and machine (the client's local fallback
// recomputes them), but libm's exp/log/pow may differ in the last bit between versions.
// These use only IEEE-754 +, -, *, / and exact scaling, which round the same everywhere
// (the planner is compiled with -ffp-contract=off so no FMA is fused in). Accuracy: a few
// ulp, far below what the plans need.
#ifndef SPARSEBALANCE_PLANNER_DET_MATH_H_
#define SPARSEBALANCE_PLANNER_DET_MATH_H_

#include <cstddef>

namespace sparsebalance {

// e^x; returns +inf above ~709.8 and 0 below ~-745.
double DetExp(double x);
// Natural logarithm for x > 0; -inf for 0, NaN for negative or NaN input.
double DetLog(double x);
// base^exponent for base > 0 (0 for base == 0 and exponent > 0; 1 for exponent == 0).
double DetPow(double base, double exponent);

// Batch versions for loops over many samples: out[i] = DetExp(x[i]) (DetLog(x[i])) for i < n,
// bit for bit, computed several at a time with SIMD. x and out are the same array or disjoint.
void DetExpAll(const double* x, double* out, size_t n);
void DetLogAll(const double* x, double* out, size_t n);

namespace det_math_internal {
// The SSE2 versions, which DetExpAll and DetLogAll use where the CPU lacks AVX2; for tests.
void DetExpAllBaseline(const double* x, double* out, size_t n);
void DetLogAllBaseline(const double* x, double* out, size_t n);
}  // namespace det_math_internal

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_DET_MATH_H_
