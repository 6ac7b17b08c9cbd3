#include "kernels/block_count.h"

#include <algorithm>
#include <cmath>

namespace sparsebalance {
namespace kernels {

int64_t QuantizeDensity(double density) {
  if (!(density > 0.0)) return 1;  // also NaN; callers validate densities before this
  const double scaled = std::nearbyint(density * static_cast<double>(kDensityQuantum));
  return std::clamp<int64_t>(static_cast<int64_t>(std::min(scaled, 1e18)), 1, kDensityQuantum);
}

int64_t QueryBlocks(int64_t length, int block_size) {
  return length <= 0 ? 0 : (length + block_size - 1) / block_size;
}

int64_t AnchorBlocks(int64_t query_block, int local_blocks) {
  return std::min<int64_t>(query_block + 1, static_cast<int64_t>(local_blocks) + 2);
}

int64_t KeptBlocks(int64_t query_block, int64_t q, int local_blocks) {
  const int64_t n = query_block + 1;
  const int64_t by_density = (q * n + kDensityQuantum - 1) / kDensityQuantum;  // ceil(rho*n)
  return std::clamp(by_density, AnchorBlocks(query_block, local_blocks), n);
}

int64_t ActiveBlocks(int64_t length, double density, int block_size, int local_blocks) {
  // The kernels only need this for reports and benchmarks, so the plain O(blocks) sum is fine
  // (the planner has the closed form).
  const int64_t q = QuantizeDensity(density);
  int64_t total = 0;
  for (int64_t i = 0; i < QueryBlocks(length, block_size); ++i) {
    total += KeptBlocks(i, q, local_blocks);
  }
  return total;
}

}  // namespace kernels
}  // namespace sparsebalance
