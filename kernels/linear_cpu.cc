#include "kernels/linear_cpu.h"

#include <algorithm>
#include <cstring>

#include "kernels/parallel.h"

namespace sparsebalance {
namespace kernels {
namespace {

constexpr int64_t kRowBlock = 32;     // rows of C per task
constexpr int64_t kDepthBlock = 256;  // k per pass, so that the B panel stays in cache
constexpr int64_t kColBlock = 512;    // columns of C per pass

}  // namespace

void MatmulCpu(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row_stride,
               int64_t a_col_stride, const float* b, float* c, int threads) {
  const int64_t tasks = (m + kRowBlock - 1) / kRowBlock;
  ParallelFor(tasks, threads, [&](int, int64_t task) {
    const int64_t m0 = task * kRowBlock;
    const int64_t m1 = std::min(m, m0 + kRowBlock);
    for (int64_t i = m0; i < m1; ++i) std::memset(c + i * n, 0, sizeof(float) * n);
    for (int64_t n0 = 0; n0 < n; n0 += kColBlock) {
      const int64_t n1 = std::min(n, n0 + kColBlock);
      for (int64_t k0 = 0; k0 < k; k0 += kDepthBlock) {
        const int64_t k1 = std::min(k, k0 + kDepthBlock);
        for (int64_t i = m0; i < m1; ++i) {
          float* __restrict c_row = c + i * n;
          for (int64_t kk = k0; kk < k1; ++kk) {
            const float a_ik = a[i * a_row_stride + kk * a_col_stride];
            const float* __restrict b_row = b + kk * n;
            for (int64_t j = n0; j < n1; ++j) c_row[j] += a_ik * b_row[j];
          }
        }
      }
    }
  });
}

}  // namespace kernels
}  // namespace sparsebalance
