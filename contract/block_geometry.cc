#include "contract/block_geometry.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <memory>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace sparsebalance {
namespace {

// log2(kDensityQuantum).
constexpr int kDensityShift = 16;
static_assert(int64_t{1} << kDensityShift == kDensityQuantum);
// Up to this many rows ActiveBlocks sums directly instead of calling FloorSum.
constexpr int64_t kDirectSumRows = 96;
// Runs past the anchors up to this many rows ActiveBlocksSumAvx2 sums in its lanes, longer ones
// with FloorSum (through the kept answers). With 32 layers in the lanes, summing a run costs
// about what FloorSum does at 1,500 rows: on the 2-core development machine, 32 layers of
// documents of 1,000-1,100 rows took 2.7 us in the lanes and 4.1 us by FloorSum, of 2,000-2,100
// rows 5.4 and 4.1 us. In sb-planner-bench's BM_LayerBlocks/1 (the pretrain trace) the lanes
// took 440 ns a sample summing runs up to 96 rows, 280 up to 384, 265-271 up to 1,024 and 257 up
// to 2,048 (the loop of ActiveBlocksOfQueryBlocks, BM_LayerBlocks/0: 830-910 ns).
constexpr int64_t kLaneSumRows = 1024;

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

namespace block_geometry_internal {

int64_t ActiveBlocksSumScalar(int64_t rows, const double* densities, size_t count,
                              int local_blocks) {
  int64_t sum = 0;
  for (size_t i = 0; i < count; ++i) {
    if (__builtin_add_overflow(sum, ActiveBlocksOfQueryBlocks(rows, densities[i], local_blocks),
                               &sum)) {
      return std::numeric_limits<int64_t>::max();
    }
  }
  return sum;
}

#if defined(__x86_64__) || defined(__i386__)
// Four layers of ActiveBlocksSumAvx2's pass, in the four double lanes of an AVX2 register, and what
// they add to it: the densities' quanta, and ActiveBlocksOfRows' split of each layer's rows into
// those that keep their anchors (n < n_free) and the run past them, sum_{i=0}^{count-1}
// floor((start + q i) / Q) with start = q n_free + Q - 1, whose lanes the pass's loop sums.
struct FourLayers {
  __m128i low;       // start mod Q of each summed run (int32 lanes); 0 elsewhere
  __m128i step;      // q
  __m128i run;       // the run's count where it is summed below, else 0
  __m256d last;      // n_free - 1 capped at rows, where it is summed below, else 0
  __m256d head;      // (start >> 16) * count, the same lanes
  __m256d longest;   // the run's count, the same lanes
  unsigned dense;    // lanes at full density (q = Q): the triangle
  unsigned counted;  // lanes whose rows are counted here (last, head, run)
  unsigned kept;     // lanes whose run is longer than kLaneSumRows: the kept answers
};

// Every operation on doubles here is exact. The quanta are Quantize's (the same operations in
// the same order, no contraction: contract/CMakeLists.txt). The quotient anchors * Q / q,
// truncated, is ActiveBlocksOfRows' integer one: with a = anchors * Q = k q + r, 0 <= r < q, a and
// q are doubles exactly, and if r = 0 so is k. Otherwise k < a/q <= k + 1 - 1/q; rounding is
// monotone, so the double quotient is at least k, and it rounds up to k + 1 only from within half
// an ulp of it, (k + 1) 2^-53, which is less than 1/q since q (k + 1) <= a + q < 2^53. The rest are
// integers below 2^53 (n_free < 2^42; where a run is summed, n_free <= rows <= 2^31, so start <=
// 2^47 + 2^16 and (start >> 16) * count < 2^42). Lanes at or past `layers` (at most 4) are not
// counted and their densities not read.
__attribute__((target("avx2"))) inline FourLayers QuantizeAndSplit(const double* densities,
                                                                   int layers, int64_t rows,
                                                                   int64_t anchors) {
  static_assert((kMaxLocalBlocks + 2 + 1) * kDensityQuantum < (int64_t{1} << 53));
  const __m256d zero = _mm256_setzero_pd();
  const __m256d one = _mm256_set1_pd(1.0);
  const __m256d quantum = _mm256_set1_pd(static_cast<double>(kDensityQuantum));
  const __m256d no_fraction = _mm256_set1_pd(4503599627370496.0);  // 2^52, as Quantize
  const __m256d all_rows = _mm256_set1_pd(static_cast<double>(rows));
  const __m256i in_pass =
      _mm256_cmpgt_epi64(_mm256_set1_epi64x(layers), _mm256_setr_epi64x(0, 1, 2, 3));
  const __m256d valid = _mm256_castsi256_pd(in_pass);
  // Quantize: NaN and non-positive densities to 0 (vmaxpd returns its second operand where the
  // first is NaN), +inf to 1, then round(density * Q), at least 1.
  __m256d density = _mm256_maskload_pd(densities, in_pass);
  density = _mm256_min_pd(_mm256_max_pd(density, zero), one);
  const __m256d q = _mm256_max_pd(
      _mm256_sub_pd(_mm256_add_pd(_mm256_mul_pd(density, quantum), no_fraction), no_fraction), one);
  const __m256d dense = _mm256_and_pd(valid, _mm256_cmp_pd(q, quantum, _CMP_EQ_OQ));
  // ActiveBlocksOfRows' n_free, last_anchored, count and start.
  const __m256d quotient = _mm256_round_pd(
      _mm256_div_pd(_mm256_set1_pd(static_cast<double>(anchors * kDensityQuantum)), q),
      _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256d n_free =
      _mm256_max_pd(_mm256_set1_pd(static_cast<double>(anchors + 1)), _mm256_add_pd(quotient, one));
  const __m256d last = _mm256_min_pd(all_rows, _mm256_sub_pd(n_free, one));
  const __m256d run = _mm256_max_pd(_mm256_add_pd(_mm256_sub_pd(all_rows, n_free), one), zero);
  const __m256d start =
      _mm256_add_pd(_mm256_mul_pd(q, n_free), _mm256_set1_pd(kDensityQuantum - 1.0));
  const __m256d head = _mm256_floor_pd(_mm256_mul_pd(start, _mm256_set1_pd(1.0 / 65536)));
  const __m256d low = _mm256_sub_pd(start, _mm256_mul_pd(head, quantum));
  const __m256d sparse = _mm256_andnot_pd(dense, valid);
  const __m256d is_long =
      _mm256_cmp_pd(run, _mm256_set1_pd(static_cast<double>(kLaneSumRows)), _CMP_GT_OQ);
  const __m256d counted = _mm256_andnot_pd(is_long, sparse);
  const __m256d summed = _mm256_and_pd(counted, _mm256_cmp_pd(run, zero, _CMP_GT_OQ));
  FourLayers four;
  four.low = _mm256_cvttpd_epi32(_mm256_and_pd(summed, low));
  four.step = _mm256_cvttpd_epi32(q);
  four.run = _mm256_cvttpd_epi32(_mm256_and_pd(summed, run));
  four.last = _mm256_and_pd(counted, last);
  four.head = _mm256_and_pd(summed, _mm256_mul_pd(head, run));
  four.longest = _mm256_and_pd(summed, run);
  four.dense = static_cast<unsigned>(_mm256_movemask_pd(dense));
  four.counted = static_cast<unsigned>(_mm256_movemask_pd(counted));
  four.kept = static_cast<unsigned>(_mm256_movemask_pd(_mm256_and_pd(sparse, is_long)));
  return four;
}

// The four double lanes' sum, an integer below 2^53: exact.
__attribute__((target("avx2"))) inline int64_t LaneSum(__m256d v) {
  const __m128d pair = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return static_cast<int64_t>(_mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair))));
}

// ActiveBlocksSumScalar with 32 layers per pass: four at a time in double lanes, up to the runs
// (QuantizeAndSplit), and the runs no longer than kLaneSumRows in four AVX2 registers of eight
// 32-bit lanes, summed as DirectCeilingSum sums one but with a layer per lane: term i of every
// layer's run at once, (low + q i) >> 16, lanes past their run's count masked off. low + q i <
// (kLaneSumRows + 1) Q < 2^31, each term is below kLaneSumRows, so each lane's sum is below
// kLaneSumRows^2 and the four registers' below 2^22: 32-bit lanes and signed compares are exact.
// Longer runs go to the kept answers (KeptActiveBlocksOfRows, as ActiveBlocksOfQueryBlocks sends
// them: rows - anchors >= count > kLaneSumRows >= kDirectSumRows there). The same integers as the
// scalar loop, in another order.
__attribute__((target("avx2"))) bool ActiveBlocksSumAvx2(int64_t rows, const double* densities,
                                                         size_t count, int local_blocks,
                                                         int64_t* sum) {
  static_assert((kLaneSumRows + 1) * kDensityQuantum < (int64_t{1} << 31));
  static_assert(4 * kLaneSumRows * kLaneSumRows < (int64_t{1} << 31));
  static_assert(kLaneSumRows >= kDirectSumRows);
  rows = std::clamp<int64_t>(rows, 0, kMaxBlockMathRows);
  const int64_t anchors = static_cast<int64_t>(std::clamp(local_blocks, 0, kMaxLocalBlocks)) + 2;
  // Every layer's count is at most the triangle (< 2^62): below this check no sum overflows.
  const int64_t triangle = rows * (rows + 1) / 2;
  if (triangle > 0 && count > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) /
                                  static_cast<uint64_t>(triangle)) {
    return false;
  }
  if (rows <= anchors) {  // every row keeps all its blocks, at any density
    *sum = triangle * static_cast<int64_t>(count);
    return true;
  }
  constexpr size_t kPassLayers = 32;
  int64_t total = 0;
  for (size_t first = 0; first < count; first += kPassLayers) {
    const auto layers = static_cast<int>(std::min(kPassLayers, count - first));
    std::array<FourLayers, kPassLayers / 4> four{};  // lanes past the pass's layers sum nothing
    __m256d last = _mm256_setzero_pd();
    __m256d head = _mm256_setzero_pd();
    __m256d longest = _mm256_setzero_pd();
    int dense = 0;
    int counted = 0;
    for (int g = 0; 4 * g < layers; ++g) {
      FourLayers& f = four[g];
      f = QuantizeAndSplit(densities + first + 4 * g, layers - 4 * g, rows, anchors);
      last = _mm256_add_pd(last, f.last);
      head = _mm256_add_pd(head, f.head);
      longest = _mm256_max_pd(longest, f.longest);
      dense += __builtin_popcount(f.dense);
      counted += __builtin_popcount(f.counted);
      for (unsigned kept = f.kept; kept != 0; kept &= kept - 1) {
        const int64_t q = Quantize(densities[first + 4 * g + __builtin_ctz(kept)]);
        total += KeptActiveBlocksOfRows(rows, q, anchors);
      }
    }
    // ActiveBlocksOfRows' anchored rows of each counted layer, (anchors + 1) anchors / 2 + (last -
    // anchors) anchors, and the runs' (start >> 16) * count.
    total += dense * triangle + counted * (anchors * (anchors + 1) / 2) +
             (LaneSum(last) - counted * anchors) * anchors + LaneSum(head);
    __m256i terms0 = _mm256_set_m128i(four[1].low, four[0].low);
    __m256i terms1 = _mm256_set_m128i(four[3].low, four[2].low);
    __m256i terms2 = _mm256_set_m128i(four[5].low, four[4].low);
    __m256i terms3 = _mm256_set_m128i(four[7].low, four[6].low);
    const __m256i step0 = _mm256_set_m128i(four[1].step, four[0].step);
    const __m256i step1 = _mm256_set_m128i(four[3].step, four[2].step);
    const __m256i step2 = _mm256_set_m128i(four[5].step, four[4].step);
    const __m256i step3 = _mm256_set_m128i(four[7].step, four[6].step);
    const __m256i run0 = _mm256_set_m128i(four[1].run, four[0].run);
    const __m256i run1 = _mm256_set_m128i(four[3].run, four[2].run);
    const __m256i run2 = _mm256_set_m128i(four[5].run, four[4].run);
    const __m256i run3 = _mm256_set_m128i(four[7].run, four[6].run);
    __m256i sums0 = _mm256_setzero_si256();
    __m256i sums1 = _mm256_setzero_si256();
    __m256i sums2 = _mm256_setzero_si256();
    __m256i sums3 = _mm256_setzero_si256();
    const __m128d most =
        _mm_max_pd(_mm256_castpd256_pd128(longest), _mm256_extractf128_pd(longest, 1));
    const auto terms =
        static_cast<int32_t>(_mm_cvtsd_f64(_mm_max_sd(most, _mm_unpackhi_pd(most, most))));
    __m256i index = _mm256_setzero_si256();
    const __m256i next = _mm256_set1_epi32(1);
    for (int32_t i = 0; i < terms; ++i) {
      sums0 = _mm256_add_epi32(sums0, _mm256_and_si256(_mm256_srli_epi32(terms0, kDensityShift),
                                                       _mm256_cmpgt_epi32(run0, index)));
      sums1 = _mm256_add_epi32(sums1, _mm256_and_si256(_mm256_srli_epi32(terms1, kDensityShift),
                                                       _mm256_cmpgt_epi32(run1, index)));
      sums2 = _mm256_add_epi32(sums2, _mm256_and_si256(_mm256_srli_epi32(terms2, kDensityShift),
                                                       _mm256_cmpgt_epi32(run2, index)));
      sums3 = _mm256_add_epi32(sums3, _mm256_and_si256(_mm256_srli_epi32(terms3, kDensityShift),
                                                       _mm256_cmpgt_epi32(run3, index)));
      terms0 = _mm256_add_epi32(terms0, step0);
      terms1 = _mm256_add_epi32(terms1, step1);
      terms2 = _mm256_add_epi32(terms2, step2);
      terms3 = _mm256_add_epi32(terms3, step3);
      index = _mm256_add_epi32(index, next);
    }
    const __m256i all =
        _mm256_add_epi32(_mm256_add_epi32(sums0, sums1), _mm256_add_epi32(sums2, sums3));
    const __m128i half =
        _mm_add_epi32(_mm256_castsi256_si128(all), _mm256_extracti128_si256(all, 1));
    const __m128i quarter = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
    total += _mm_cvtsi128_si32(_mm_add_epi32(quarter, _mm_shuffle_epi32(quarter, 1)));
  }
  *sum = total;
  return true;
}
#endif

#if defined(__x86_64__) || defined(__i386__)
bool ActiveBlocksSumVector(int64_t rows, const double* densities, size_t count, int local_blocks,
                           int64_t* sum) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2 && ActiveBlocksSumAvx2(rows, densities, count, local_blocks, sum);
}
#else
bool ActiveBlocksSumVector(int64_t, const double*, size_t, int, int64_t*) { return false; }
#endif

}  // namespace block_geometry_internal

int64_t ActiveBlocksOfQueryBlocksSum(int64_t rows, const double* densities, size_t count,
                                     int local_blocks) {
  int64_t sum = 0;
  if (block_geometry_internal::ActiveBlocksSumVector(rows, densities, count, local_blocks, &sum)) {
    return sum;
  }
  return block_geometry_internal::ActiveBlocksSumScalar(rows, densities, count, local_blocks);
}

int64_t ActiveBlocksInRowsSum(int64_t first_row, int64_t end_row, const double* densities,
                              size_t count, int local_blocks) {
  first_row = std::clamp<int64_t>(first_row, 0, kMaxBlockMathRows);
  end_row = std::clamp<int64_t>(end_row, 0, kMaxBlockMathRows);
  if (end_row <= first_row) return 0;
  const int64_t to_end = ActiveBlocksOfQueryBlocksSum(end_row, densities, count, local_blocks);
  if (to_end == std::numeric_limits<int64_t>::max()) return to_end;
  // Every layer's prefix sum to first_row is at most its sum to end_row: this one is exact too.
  return to_end - ActiveBlocksOfQueryBlocksSum(first_row, densities, count, local_blocks);
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
