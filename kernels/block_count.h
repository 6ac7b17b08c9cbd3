// How many key blocks a query block keeps at a density (DESIGN.md section 4), in the same
// integer arithmetic as planner/block_math.h, so that the kernels run exactly the blocks the
// planner's latency model predicts. kernels/ must not depend on planner/, hence the copy;
// tests/kernels/block_count_test.cc checks that both agree.
//
//   const int64_t q = QuantizeDensity(0.3);
//   const int64_t kept = KeptBlocks(/*query_block=*/40, q, /*local_blocks=*/1);
#ifndef SPARSEBALANCE_KERNELS_BLOCK_COUNT_H_
#define SPARSEBALANCE_KERNELS_BLOCK_COUNT_H_

#include <cstdint>

namespace sparsebalance {
namespace kernels {

// Densities are used as multiples of 1/kDensityQuantum.
inline constexpr int64_t kDensityQuantum = 65536;

// round(density * kDensityQuantum) clamped to [1, kDensityQuantum].
int64_t QuantizeDensity(double density);

// Query (and key) blocks of a document: ceil(length / block_size); length in tokens.
int64_t QueryBlocks(int64_t length, int block_size);

// Anchors of query block i (0-based): the sink block 0, the diagonal and up to `local_blocks`
// blocks before it, counted once each: min(i+1, local_blocks+2).
int64_t AnchorBlocks(int64_t query_block, int local_blocks);

// k_i = clamp(ceil(q * (i+1) / kDensityQuantum), AnchorBlocks(i), i+1) for a quantized
// density q in [1, kDensityQuantum].
int64_t KeptBlocks(int64_t query_block, int64_t q, int local_blocks);

// Sum of KeptBlocks over the query blocks of a document of `length` tokens.
int64_t ActiveBlocks(int64_t length, double density, int block_size, int local_blocks);

}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_BLOCK_COUNT_H_
