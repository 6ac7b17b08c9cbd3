// A plain multi-threaded fp32 GEMM for the linear part of a layer in sb-profile's CPU
// profile (QKV and output projections, MLP); not tuned beyond cache blocking.
//
//   MatmulCpu(m, n, k, a, /*a_row_stride=*/k, /*a_col_stride=*/1, b, c, /*threads=*/0);
#ifndef SPARSEBALANCE_KERNELS_LINEAR_CPU_H_
#define SPARSEBALANCE_KERNELS_LINEAR_CPU_H_

#include <cstdint>

namespace sparsebalance {
namespace kernels {

// C[m][n] = sum_k A(m, k) * B[k][n], with A(m, k) = a[m * a_row_stride + k * a_col_stride]
// (a transposed A is a_row_stride = 1, a_col_stride = m); B and C are row-major.
void MatmulCpu(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row_stride,
               int64_t a_col_stride, const float* b, float* c, int threads);

}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_LINEAR_CPU_H_
