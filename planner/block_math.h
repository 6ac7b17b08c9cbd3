// Block counting for causal block-sparse attention (DESIGN.md section 4), shared by the cost
// model and, later, the kernels, so that the planner predicts exactly the blocks they run.
//
// Densities are quantized to multiples of 1/kDensityQuantum before use so that the number of
// key blocks kept for query block i, k_i = clamp(ceil(rho * (i+1)), anchors_i, i+1), is exact
// integer arithmetic, identical on CPU, GPU and in the planner, and so that the sum over a
// document has a closed form (O(log) instead of O(blocks)).
//
//   int64_t a = ActiveBlocks(/*length=*/32768, /*density=*/0.3, /*block_size=*/64,
//                            /*local_blocks=*/1);
#ifndef SPARSEBALANCE_PLANNER_BLOCK_MATH_H_
#define SPARSEBALANCE_PLANNER_BLOCK_MATH_H_

#include <cstdint>

namespace sparsebalance {

inline constexpr int64_t kDensityQuantum = 65536;

// round(density * kDensityQuantum), at least 1 and at most kDensityQuantum.
int64_t QuantizeDensity(double density);

// Query blocks of a document: ceil(length / block_size).
int64_t QueryBlocks(int64_t length, int block_size);

// Anchor blocks of query block i (0-based): the sink block 0, the diagonal and up to
// `local_blocks` blocks before it, without double counting: min(i+1, local_blocks+2).
int64_t AnchorBlocks(int64_t query_block, int local_blocks);

// Key blocks kept for query block i at a quantized density q (in 1..kDensityQuantum).
int64_t KeptBlocks(int64_t query_block, int64_t q, int local_blocks);

// A(L, rho): the sum of KeptBlocks over the document's query blocks (closed form).
int64_t ActiveBlocks(int64_t length, double density, int block_size, int local_blocks);

// The same by direct summation, O(blocks): the definition, used to test the closed form.
int64_t ActiveBlocksBySum(int64_t length, double density, int block_size, int local_blocks);

// sum_{i=0}^{n-1} floor((a*i + b) / m) for n, m > 0 and a, b >= 0 (exact, O(log)).
int64_t FloorSum(int64_t n, int64_t m, int64_t a, int64_t b);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_BLOCK_MATH_H_
