// Block geometry and the kept-block rule of causal block-sparse attention (DESIGN.md section 4):
// the one definition that the planner's cost model (planner/) and the block selection of the
// kernels (kernels/) both use, so that the planner predicts exactly the blocks the kernels run.
//
// Densities are quantized to multiples of 1/kDensityQuantum before use so that the number of
// key blocks kept for query block i, k_i = clamp(ceil(rho * (i+1)), anchors_i, i+1), is exact
// integer arithmetic, identical on CPU, GPU and in the planner, and so that the sum over a
// document has a closed form (O(log) instead of O(blocks)).
//
//   int64_t a = ActiveBlocks(/*length=*/32768, /*density=*/0.3, /*block_size=*/64,
//                            /*local_blocks=*/1);
#ifndef SPARSEBALANCE_CONTRACT_BLOCK_GEOMETRY_H_
#define SPARSEBALANCE_CONTRACT_BLOCK_GEOMETRY_H_

#include <cstddef>
#include <cstdint>

#include "contract/host_device.h"
#include "contract/layer_shape.h"

namespace sparsebalance {

inline constexpr int64_t kDensityQuantum = 65536;

// Rows (query blocks) of one document that the counts below take into account: 2^31, twice
// the most a planner-valid document has (kMaxMicroBatchCapacity tokens at block size 1). At
// most that many rows, a document's active blocks stay below rows (rows + 1) / 2 < 2^62, and
// every intermediate below fits in int64. Longer documents count as this many rows.
inline constexpr int64_t kMaxBlockMathRows = int64_t{1} << 31;

// Every function here is total: no input makes it overflow or divide by zero. Inputs outside
// the documented domain are clamped into it, as each comment says; the planner never sends
// such inputs (ValidateConfig, ValidateBatch), so the clamps are defence in depth.

// round(density * kDensityQuantum), at least 1 and at most kDensityQuantum (NaN and
// non-positive densities give 1, +inf gives kDensityQuantum).
int64_t QuantizeDensity(double density);

// Query blocks of a document: ceil(length / block_size), exact for every length; 0 for
// length <= 0. block_size < 1 counts as 1. Inline: the planner asks for every document.
inline int64_t QueryBlocks(int64_t length, int block_size) {
  if (length <= 0) return 0;
  const int64_t block = block_size > 1 ? block_size : 1;
  // Not (length + block - 1) / block, which overflows near INT64_MAX.
  return length / block + (length % block != 0 ? 1 : 0);
}

// Anchor blocks of query block i (0-based): the sink block 0, the diagonal and up to
// `local_blocks` blocks before it, without double counting: min(i+1, local_blocks+2).
// Negative i gives 0; negative local_blocks count as 0. Inline for the device too.
SB_HOST_DEVICE inline int64_t AnchorBlocks(int64_t query_block, int local_blocks) {
  if (query_block < 0) return 0;
  const int64_t anchors = static_cast<int64_t>(local_blocks > 0 ? local_blocks : 0) + 2;
  // query_block + 1 would overflow at INT64_MAX: compare first.
  return query_block < anchors ? query_block + 1 : anchors;
}

// Key blocks kept for query block i at a quantized density q. Exact for every i >= 0 (i is
// capped at INT64_MAX - 1); q is clamped into [1, kDensityQuantum]; negative i gives 0.
// Inline for the device too (the block selection of kernels/cuda_attention_impl.inc).
SB_HOST_DEVICE inline int64_t KeptBlocks(int64_t query_block, int64_t q, int local_blocks) {
  if (query_block < 0) return 0;
  constexpr int64_t kLargest = INT64_MAX - 1;
  const int64_t n = (query_block < kLargest ? query_block : kLargest) + 1;
  q = q < 1 ? 1 : (q > kDensityQuantum ? kDensityQuantum : q);
  // ceil(q * n / Q) without forming q * n: n = hi * Q + lo gives hi * q + ceil(lo * q / Q),
  // where hi * q <= n and lo * q < 2^32. (Q = 2^16.)
  const int64_t hi = n >> 16;
  const int64_t lo = n & (kDensityQuantum - 1);
  const int64_t by_density = hi * q + ((lo * q + kDensityQuantum - 1) >> 16);
  const int64_t anchors = AnchorBlocks(query_block, local_blocks);
  return by_density < anchors ? anchors : (by_density > n ? n : by_density);
}

// A(L, rho): the sum of KeptBlocks over the document's query blocks (closed form). Domain:
// QueryBlocks(length, block_size) <= kMaxBlockMathRows (longer documents are clamped to it),
// local_blocks in [0, kMaxLocalBlocks] (clamped). The result is below 2^62.
int64_t ActiveBlocks(int64_t length, double density, int block_size, int local_blocks);

// The same for a document of `rows` query blocks: ActiveBlocks(length, density, block_size,
// local_blocks) is ActiveBlocksOfQueryBlocks(QueryBlocks(length, block_size), density,
// local_blocks). For callers that hold their documents' rows (the planner's SampleTable, which
// counts every sample's blocks at every density it is planned at): no division by the block
// size. Rows are clamped into [0, kMaxBlockMathRows].
int64_t ActiveBlocksOfQueryBlocks(int64_t rows, double density, int local_blocks);

// Active blocks of query blocks [first_row, end_row) of a document at `density`: the part of
// A(L, rho) that one shard of a document split at block boundaries runs (context parallelism).
// k_i depends on i alone, so this is a difference of two prefix sums. Rows are clamped into
// [0, kMaxBlockMathRows]; an empty or reversed range gives 0.
int64_t ActiveBlocksInRows(int64_t first_row, int64_t end_row, double density, int local_blocks);

// sum_{i < count} ActiveBlocksOfQueryBlocks(rows, densities[i], local_blocks): one document's
// active blocks summed over the densities of its layers, counted for all layers at once (the
// planner's features of a sample planned with a density per layer). Exact while the sum is below
// INT64_MAX (always where count * rows (rows + 1) / 2 is); a larger sum saturates at INT64_MAX.
// Same clamps as ActiveBlocksOfQueryBlocks; count 0 gives 0 (densities may then be null).
int64_t ActiveBlocksOfQueryBlocksSum(int64_t rows, const double* densities, size_t count,
                                     int local_blocks);

// sum_{i < count} ActiveBlocksInRows(first_row, end_row, densities[i], local_blocks): one
// shard's active blocks summed over its layers' densities, the difference of two sums above.
// Exact while ActiveBlocksOfQueryBlocksSum(end_row, ...) is below INT64_MAX; INT64_MAX where it
// is not. Same clamps as ActiveBlocksInRows.
int64_t ActiveBlocksInRowsSum(int64_t first_row, int64_t end_row, const double* densities,
                              size_t count, int local_blocks);

// The same by direct summation, O(blocks): the definition, used to test the closed form.
// Same domain and clamps as ActiveBlocks.
int64_t ActiveBlocksBySum(int64_t length, double density, int block_size, int local_blocks);

// sum_{i=0}^{n-1} floor((a*i + b) / m), exact in O(log), for n in [0, 2^31], m in [1, 2^31]
// and a, b >= 0 whose sum fits in int64. Every term it adds is part of the result and every
// product it forms is below m * (n + 1) <= 2^62 + 2^31, so within that domain nothing
// overflows. Outside it: n <= 0 gives 0, m < 1 counts as 1, negative a or b as 0, and a
// result above INT64_MAX saturates to INT64_MAX (checked arithmetic, never wraps).
int64_t FloorSum(int64_t n, int64_t m, int64_t a, int64_t b);

namespace block_geometry_internal {
// ActiveBlocksOfQueryBlocksSum written twice; declared here for the test that compares the two.
// The plain loop over the densities (saturating):
int64_t ActiveBlocksSumScalar(int64_t rows, const double* densities, size_t count,
                              int local_blocks);
// The same sum with the layers in the lanes of AVX2 registers, the same result, where the CPU has
// AVX2 and the sum cannot reach INT64_MAX; false, having set nothing, elsewhere.
bool ActiveBlocksSumVector(int64_t rows, const double* densities, size_t count, int local_blocks,
                           int64_t* sum);
}  // namespace block_geometry_internal

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_CONTRACT_BLOCK_GEOMETRY_H_
