#include "planner/block_math.h"

#include <algorithm>
#include <cmath>

namespace sparsebalance {
namespace {

// log2(kDensityQuantum).
constexpr int kDensityShift = 16;
static_assert(int64_t{1} << kDensityShift == kDensityQuantum);
// Up to this many rows ActiveBlocks sums directly instead of calling FloorSum.
constexpr int64_t kDirectSumRows = 96;

}  // namespace

int64_t QuantizeDensity(double density) {
  if (!(density > 0.0)) return 1;  // also catches NaN; validation rejects these earlier
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

int64_t FloorSum(int64_t n, int64_t m, int64_t a, int64_t b) {
  // The classic Euclid-like reduction (as in AtCoder Library's floor_sum).
  int64_t sum = 0;
  while (true) {
    if (a >= m) {
      sum += (n - 1) * n / 2 * (a / m);
      a %= m;
    }
    if (b >= m) {
      sum += n * (b / m);
      b %= m;
    }
    const int64_t y_max = a * n + b;
    if (y_max < m) break;
    n = y_max / m;
    b = y_max % m;
    std::swap(m, a);
  }
  return sum;
}

int64_t ActiveBlocks(int64_t length, double density, int block_size, int local_blocks) {
  const int64_t rows = QueryBlocks(length, block_size);
  if (rows == 0) return 0;
  const int64_t q = QuantizeDensity(density);
  const int64_t anchors = static_cast<int64_t>(local_blocks) + 2;
  // With n = i+1: rows n <= anchors keep all n blocks. Beyond, k = max(anchors, ceil(q*n/Q)),
  // and ceil(q*n/Q) > anchors exactly when n >= n_free = floor(anchors*Q/q) + 1.
  const int64_t full = std::min(rows, anchors);
  int64_t total = full * (full + 1) / 2;
  if (rows <= anchors) return total;
  const int64_t n_free = std::max(anchors + 1, anchors * kDensityQuantum / q + 1);
  const int64_t last_anchored = std::min(rows, n_free - 1);
  total += (last_anchored - anchors) * anchors;
  if (rows >= n_free) {
    // sum_{n=n_free}^{rows} ceil(q*n/Q) = sum_{i=0}^{cnt-1} floor((q*i + q*n_free + Q-1) / Q).
    // Short runs (most documents) are summed directly: Q is a power of two, so each term is a
    // shift, cheaper than FloorSum's divisions.
    const int64_t count = rows - n_free + 1;
    if (count <= kDirectSumRows) {
      int64_t numerator = q * n_free + kDensityQuantum - 1;
      for (int64_t i = 0; i < count; ++i, numerator += q) total += numerator >> kDensityShift;
    } else {
      total += FloorSum(count, kDensityQuantum, q, q * n_free + kDensityQuantum - 1);
    }
  }
  return total;
}

int64_t ActiveBlocksBySum(int64_t length, double density, int block_size, int local_blocks) {
  const int64_t rows = QueryBlocks(length, block_size);
  const int64_t q = QuantizeDensity(density);
  int64_t total = 0;
  for (int64_t i = 0; i < rows; ++i) total += KeptBlocks(i, q, local_blocks);
  return total;
}

}  // namespace sparsebalance
