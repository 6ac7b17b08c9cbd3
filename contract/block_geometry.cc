#include "contract/block_geometry.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <memory>

namespace sparsebalance {
namespace {

// log2(kDensityQuantum).
constexpr int kDensityShift = 16;
static_assert(int64_t{1} << kDensityShift == kDensityQuantum);
// Up to this many rows ActiveBlocks sums directly instead of calling FloorSum.
constexpr int64_t kDirectSumRows = 96;

// QuantizeDensity, inline for ActiveBlocks (the exported function is never inlined: -fPIC).
inline int64_t Quantize(double density) {
  if (!(density > 0.0)) return 1;  // also catches NaN; validation rejects these earlier
  if (!(density < 1.0)) return kDensityQuantum;
  // nearbyint(density * Q) without libm's call (x86-64's baseline has no rounding instruction):
  // below 2^52, adding 2^52 leaves no fraction bits, so the sum is rounded to an integer as
  // nearbyint rounds (the current rounding mode), and subtracting 2^52 again is exact.
  constexpr double kNoFraction = 4503599627370496.0;  // 2^52
  const double scaled =
      (density * static_cast<double>(kDensityQuantum) + kNoFraction) - kNoFraction;
  return std::max<int64_t>(static_cast<int64_t>(scaled), 1);
}

}  // namespace

int64_t QuantizeDensity(double density) { return Quantize(density); }

int64_t FloorSum(int64_t n, int64_t m, int64_t a, int64_t b) {
  if (n <= 0) return 0;
  m = std::max<int64_t>(m, 1);
  a = std::max<int64_t>(a, 0);
  b = std::max<int64_t>(b, 0);
  constexpr int64_t kSaturated = std::numeric_limits<int64_t>::max();
  // The classic Euclid-like reduction (as in AtCoder Library's floor_sum), every step checked:
  // within the documented domain none of the checks fires (see the header).
  int64_t sum = 0;
  auto add = [&](int64_t x, int64_t y) {  // sum += x * y, false on overflow
    int64_t product = 0;
    return !__builtin_mul_overflow(x, y, &product) && !__builtin_add_overflow(sum, product, &sum);
  };
  while (true) {
    if (a >= m) {
      // (n - 1) * n / 2 without overflow: halve the even factor first.
      int64_t pairs = 0;
      const bool ok = n % 2 == 0 ? !__builtin_mul_overflow(n / 2, n - 1, &pairs)
                                 : !__builtin_mul_overflow(n, (n - 1) / 2, &pairs);
      if (!ok || !add(pairs, a / m)) return kSaturated;
      a %= m;
    }
    if (b >= m) {
      if (!add(n, b / m)) return kSaturated;
      b %= m;
    }
    // a, b < m here, so y_max < m * (n + 1).
    int64_t y_max = 0;
    if (__builtin_mul_overflow(a, n, &y_max) || __builtin_add_overflow(y_max, b, &y_max)) {
      return kSaturated;
    }
    if (y_max < m) break;
    n = y_max / m;
    b = y_max % m;
    std::swap(m, a);
  }
  return sum;
}

namespace {

// sum_{i=0}^{count-1} floor((start + q i) / Q) for 0 < q <= Q and count <= kDirectSumRows:
// each term is (start >> 16) plus floor((low + q i) / Q), where low = start mod Q, and
// low + q i < Q + (kDirectSumRows + 8) Q < 2^23, so those run in 32-bit lanes, eight at a time
// in two SSE2 registers (GCC and Clang vector extensions of the baseline x86-64 width, which
// stay in registers and compare in one instruction), the last eight or fewer with the lanes past
// the end masked off. The same integers as the scalar sum, in any order.
int64_t DirectCeilingSum(int64_t start, int64_t q, int64_t count) {
  using Lanes = uint32_t __attribute__((vector_size(16)));
  using Indices = int32_t __attribute__((vector_size(16)));  // SSE2 compares signed lanes
  static_assert((kDirectSumRows + 9) * kDensityQuantum < (int64_t{1} << 31));
  const Indices lane = {0, 1, 2, 3};
  const auto low = static_cast<uint32_t>(start & (kDensityQuantum - 1));
  const auto step = static_cast<uint32_t>(q);
  // low + step * lane, by additions (SSE2 has no 32-bit lane product).
  Lanes first = {low, low + step, low + 2 * step, low + 3 * step};  // terms i, ..., i + 3
  Lanes second = first + 4 * step;                                  // terms i + 4, ..., i + 7
  const Lanes stride = Lanes{} + 8 * step;
  // Each lane adds at most kDirectSumRows / 8 + 1 terms of at most kDirectSumRows + 9.
  Lanes sums{};
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    sums += (first >> kDensityShift) + (second >> kDensityShift);
    first += stride;
    second += stride;
  }
  const auto left = static_cast<int32_t>(count - i);  // in [0, 8)
  sums += ((first >> kDensityShift) & (Lanes)(lane < left)) +
          ((second >> kDensityShift) & (Lanes)(lane + 4 < left));
  return (start >> kDensityShift) * count + (sums[0] + sums[1] + sums[2] + sums[3]);
}

// ActiveBlocks past its checks and shortcuts: `rows` > `anchors` query blocks at quantized
// density q < Q, `anchors` kept blocks per row (sink, diagonal and local).
int64_t ActiveBlocksOfRows(int64_t rows, int64_t q, int64_t anchors) {
  // With n = i+1: rows n <= anchors keep all n blocks. Beyond, k = max(anchors, ceil(q*n/Q)),
  // and ceil(q*n/Q) > anchors exactly when n >= n_free = floor(anchors*Q/q) + 1.
  int64_t total = anchors * (anchors + 1) / 2;
  const int64_t n_free = std::max(anchors + 1, anchors * kDensityQuantum / q + 1);
  const int64_t last_anchored = std::min(rows, n_free - 1);
  total += (last_anchored - anchors) * anchors;
  if (rows >= n_free) {
    // sum_{n=n_free}^{rows} ceil(q*n/Q) = sum_{i=0}^{cnt-1} floor((q*i + q*n_free + Q-1) / Q).
    // Short runs (most documents) are summed directly: Q is a power of two, so each term is a
    // shift, cheaper than FloorSum's divisions.
    const int64_t count = rows - n_free + 1;
    if (count <= kDirectSumRows) {
      total += DirectCeilingSum(q * n_free + kDensityQuantum - 1, q, count);
    } else {
      total += FloorSum(count, kDensityQuantum, q, q * n_free + kDensityQuantum - 1);
    }
  }
  return total;
}

// ActiveBlocksOfRows of a long document, kept. The planner asks for the same (rows, density,
// anchors) several times a step where no table keeps its counts (a shard's rows, the latency
// model's features): answers are kept per thread in a small direct-mapped table. The function
// is pure, so a hit returns exactly what the sum would.
int64_t KeptActiveBlocksOfRows(int64_t rows, int64_t q, int64_t anchors) {
  struct Entry {
    int64_t rows = -1;
    int64_t density_anchors = -1;  // q << 26 | anchors: q <= 2^16, anchors <= 2^24 + 2
    int64_t total = 0;
  };
  constexpr int kCacheBits = 12;
  using Table = std::array<Entry, size_t{1} << kCacheBits>;
  // On the heap, one per thread that asks: 96 KiB of static TLS would be reserved in every
  // thread's stack, and threads made with small stacks (civetweb's, which serve /metrics in
  // sb-planner) then fail to start.
  thread_local std::unique_ptr<Table> table;
  if (table == nullptr) table = std::make_unique<Table>();
  Table& cache = *table;
  const int64_t density_anchors = (q << 26) | anchors;
  const uint64_t hash = static_cast<uint64_t>(rows) * 0x9E3779B97F4A7C15ULL ^
                        static_cast<uint64_t>(density_anchors) * 0xC2B2AE3D27D4EB4FULL;
  Entry& entry = cache[hash >> (64 - kCacheBits)];
  if (entry.rows == rows && entry.density_anchors == density_anchors) return entry.total;
  entry.rows = rows;
  entry.density_anchors = density_anchors;
  entry.total = ActiveBlocksOfRows(rows, q, anchors);
  return entry.total;
}

}  // namespace

int64_t ActiveBlocks(int64_t length, double density, int block_size, int local_blocks) {
  return ActiveBlocksOfQueryBlocks(QueryBlocks(length, block_size), density, local_blocks);
}

int64_t ActiveBlocksOfQueryBlocks(int64_t rows, double density, int local_blocks) {
  // Within the domain (header): rows <= 2^31 and anchors <= 2^24 + 2, so below
  // anchors * (anchors + 1) < 2^49, (last_anchored - anchors) * anchors < 2^55,
  // q * n_free <= anchors * Q + q < 2^41 and the total, at most rows (rows + 1) / 2 < 2^62, all
  // fit in int64.
  rows = std::clamp<int64_t>(rows, 0, kMaxBlockMathRows);
  const int64_t q = Quantize(density);
  const int64_t anchors = static_cast<int64_t>(std::clamp(local_blocks, 0, kMaxLocalBlocks)) + 2;
  // Every row keeps all its blocks at full density (ceil(q n / Q) = n) and where no row has
  // more than its anchors: the triangle. Half of the planner's counts are dense (placement at
  // density 1).
  if (q == kDensityQuantum || rows <= anchors) return rows * (rows + 1) / 2;
  // A short document's sum costs about what a lookup in the kept answers would, and the
  // planner's tables keep its counts already (SampleTable::FeaturesAt).
  if (rows - anchors <= kDirectSumRows) return ActiveBlocksOfRows(rows, q, anchors);
  return KeptActiveBlocksOfRows(rows, q, anchors);
}

int64_t ActiveBlocksInRows(int64_t first_row, int64_t end_row, double density, int local_blocks) {
  first_row = std::clamp<int64_t>(first_row, 0, kMaxBlockMathRows);
  end_row = std::clamp<int64_t>(end_row, 0, kMaxBlockMathRows);
  if (end_row <= first_row) return 0;
  // The prefix sums of k_i.
  return ActiveBlocksOfQueryBlocks(end_row, density, local_blocks) -
         ActiveBlocksOfQueryBlocks(first_row, density, local_blocks);
}

int64_t ActiveBlocksBySum(int64_t length, double density, int block_size, int local_blocks) {
  const int64_t rows = std::min(QueryBlocks(length, block_size), kMaxBlockMathRows);
  const int64_t q = QuantizeDensity(density);
  const int local = std::clamp(local_blocks, 0, kMaxLocalBlocks);
  int64_t total = 0;
  for (int64_t i = 0; i < rows; ++i) total += KeptBlocks(i, q, local);
  return total;
}

}  // namespace sparsebalance
