// Deterministic elementary functions for planning decisions.
//
// Plans must be byte-identical on every rank and machine (the client's local fallback
// recomputes them), but libm's exp/log/pow may differ in the last bit between versions.
// These use only IEEE-754 +, -, *, / and exact scaling, which round the same everywhere
// (the planner is compiled with -ffp-contract=off so no FMA is fused in). Accuracy: a few
// ulp, far below what the plans need.
#ifndef SPARSEBALANCE_PLANNER_DET_MATH_H_
#define SPARSEBALANCE_PLANNER_DET_MATH_H_

namespace sparsebalance {

// e^x; returns +inf above ~709.8 and 0 below ~-745.
double DetExp(double x);
// Natural logarithm for x > 0; -inf for 0, NaN for negative or NaN input.
double DetLog(double x);
// base^exponent for base > 0 (0 for base == 0 and exponent > 0; 1 for exponent == 0).
double DetPow(double base, double exponent);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_DET_MATH_H_
