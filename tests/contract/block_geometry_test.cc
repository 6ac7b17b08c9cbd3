#include "contract/block_geometry.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "planner/random.h"
#include "planner/types.h"  // kMaxMicroBatchCapacity, the longest document a plan holds

namespace sparsebalance {
namespace {

constexpr int kBlockSizes[] = {64, 128};

// A length that is often not a multiple of the block size and sometimes tiny.
int64_t RandomLength(Rng& rng) {
  switch (rng.NextU64() % 4) {
    case 0:
      return 1 + static_cast<int64_t>(rng.NextU64() % 300);  // one to a few blocks
    case 1:
      return 64 * (1 + static_cast<int64_t>(rng.NextU64() % 64)) +
             static_cast<int64_t>(rng.NextU64() % 3) - 1;  // around a block boundary
    default:
      return 1 + static_cast<int64_t>(std::exp(rng.Uniform() * std::log(340000.0)));
  }
}

// A random document's block geometry: its length (tokens), block size (tokens), local blocks
// and query blocks.
struct DocumentBlocks {
  int64_t length;
  int block;
  int local;
  int64_t n;
};

DocumentBlocks RandomDocument(Rng& rng) {
  DocumentBlocks d;
  d.length = RandomLength(rng);
  d.block = kBlockSizes[rng.NextU64() % 2];
  d.local = static_cast<int>(rng.NextU64() % 4);
  d.n = QueryBlocks(d.length, d.block);
  return d;
}

double RandomDensity(Rng& rng) {
  switch (rng.NextU64() % 4) {
    case 0:
      return static_cast<double>(1 + rng.NextU64() % kDensityQuantum) / kDensityQuantum;
    case 1:
      return std::exp(rng.Uniform() * std::log(1e-6));  // very sparse, anchors dominate
    default:
      return rng.Uniform() + 1e-12;
  }
}

TEST(QuantizeDensityTest, StaysWithinOneAndTheQuantum) {
  EXPECT_EQ(QuantizeDensity(1.0), kDensityQuantum);
  EXPECT_EQ(QuantizeDensity(0.5), kDensityQuantum / 2);
  EXPECT_EQ(QuantizeDensity(0.0), 1);
  EXPECT_EQ(QuantizeDensity(-0.5), 1);
  EXPECT_EQ(QuantizeDensity(1e-12), 1);
  EXPECT_EQ(QuantizeDensity(std::numeric_limits<double>::quiet_NaN()), 1);
  EXPECT_EQ(QuantizeDensity(2.0), kDensityQuantum);
  EXPECT_EQ(QuantizeDensity(1e300), kDensityQuantum);
  EXPECT_EQ(QuantizeDensity(std::numeric_limits<double>::infinity()), kDensityQuantum);
  Rng rng(1);
  int64_t previous = 0;
  double previous_density = 0.0;
  for (int i = 0; i < 20000; ++i) {
    const double density = previous_density + rng.Uniform() * 1e-4;
    if (density > 1.0) break;
    const int64_t q = QuantizeDensity(density);
    ASSERT_GE(q, 1);
    ASSERT_LE(q, kDensityQuantum);
    ASSERT_GE(q, previous) << "not monotone at " << density;
    if (density >= 1.0 / kDensityQuantum) {
      // Round to nearest: within half a quantum of the density.
      ASSERT_LE(std::fabs(static_cast<double>(q) / kDensityQuantum - density),
                0.5 / kDensityQuantum + 1e-15)
          << density;
    }
    previous = q;
    previous_density = density;
  }
}

TEST(QueryBlocksTest, IsTheCeilingOfLengthOverBlockSize) {
  EXPECT_EQ(QueryBlocks(0, 64), 0);
  EXPECT_EQ(QueryBlocks(-5, 64), 0);
  EXPECT_EQ(QueryBlocks(1, 64), 1);
  EXPECT_EQ(QueryBlocks(64, 64), 1);
  EXPECT_EQ(QueryBlocks(65, 64), 2);
  EXPECT_EQ(QueryBlocks(128, 128), 1);
  EXPECT_EQ(QueryBlocks(131072, 64), 2048);
  EXPECT_EQ(QueryBlocks(131073, 128), 1025);
}

TEST(KeptBlocksTest, RespectsAnchorsAndCausality) {
  Rng rng(2);
  for (int c = 0; c < 20000; ++c) {
    const int64_t i = static_cast<int64_t>(rng.NextU64() % 5000);
    const int local = static_cast<int>(rng.NextU64() % 4);
    const int64_t q = QuantizeDensity(RandomDensity(rng));
    const int64_t kept = KeptBlocks(i, q, local);
    const int64_t anchors = AnchorBlocks(i, local);
    ASSERT_EQ(anchors, std::min<int64_t>(i + 1, local + 2));
    ASSERT_GE(kept, anchors) << "i=" << i << " q=" << q << " local=" << local;
    ASSERT_LE(kept, i + 1) << "i=" << i << " q=" << q << " local=" << local;
    // The definition: clamp(ceil(rho * (i+1)), anchors, i+1) with rho = q / Q.
    const int64_t by_density = (q * (i + 1) + kDensityQuantum - 1) / kDensityQuantum;
    ASSERT_EQ(kept, std::clamp(by_density, anchors, i + 1));
  }
  EXPECT_EQ(KeptBlocks(0, 1, 0), 1);  // the first row keeps its only block
  EXPECT_EQ(KeptBlocks(9, kDensityQuantum, 1), 10);
  EXPECT_EQ(KeptBlocks(9, 1, 1), 3);  // sink, one local block, diagonal
}

TEST(FloorSumTest, MatchesBruteForce) {
  Rng rng(3);
  for (int c = 0; c < 3000; ++c) {
    const int64_t n = 1 + static_cast<int64_t>(rng.NextU64() % 2000);
    const int64_t m = 1 + static_cast<int64_t>(rng.NextU64() % (c % 2 == 0 ? 100 : 70000));
    const int64_t a = static_cast<int64_t>(rng.NextU64() % 140000);
    const int64_t b = static_cast<int64_t>(rng.NextU64() % 140000);
    int64_t want = 0;
    for (int64_t i = 0; i < n; ++i) want += (a * i + b) / m;
    ASSERT_EQ(FloorSum(n, m, a, b), want) << "n=" << n << " m=" << m << " a=" << a << " b=" << b;
  }
  EXPECT_EQ(FloorSum(1, 1, 0, 0), 0);
  EXPECT_EQ(FloorSum(5, 1, 0, 3), 15);
  EXPECT_EQ(FloorSum(4, 10, 6, 3), 0 + 0 + 1 + 2);
}

TEST(ActiveBlocksTest, ClosedFormMatchesDirectSummation) {
  Rng rng(4);
  for (int c = 0; c < 4000; ++c) {
    const int64_t length = RandomLength(rng);
    const double density = RandomDensity(rng);
    const int block = kBlockSizes[rng.NextU64() % 2];
    const int local = static_cast<int>(rng.NextU64() % 4);
    ASSERT_EQ(ActiveBlocks(length, density, block, local),
              ActiveBlocksBySum(length, density, block, local))
        << "length=" << length << " density=" << density << " block=" << block
        << " local=" << local;
  }
}

TEST(ActiveBlocksTest, RowRangesAreTheKeptBlocksOfThoseRowsAndAddUpToTheDocument) {
  Rng rng(11);
  for (int c = 0; c < 500; ++c) {
    const int64_t rows = 1 + static_cast<int64_t>(rng.NextU64() % 3000);
    const double density = RandomDensity(rng);
    const int local = static_cast<int>(rng.NextU64() % 4);
    const int64_t q = QuantizeDensity(density);
    // Three cuts split the document into four shards; their blocks are the rows' k_i and sum
    // to the whole document's A(L, rho).
    std::vector<int64_t> cuts = {0, static_cast<int64_t>(rng.NextU64() % (rows + 1)),
                                 static_cast<int64_t>(rng.NextU64() % (rows + 1)),
                                 static_cast<int64_t>(rng.NextU64() % (rows + 1)), rows};
    std::sort(cuts.begin(), cuts.end());
    int64_t total = 0;
    for (size_t j = 0; j + 1 < cuts.size(); ++j) {
      int64_t by_sum = 0;
      for (int64_t i = cuts[j]; i < cuts[j + 1]; ++i) by_sum += KeptBlocks(i, q, local);
      const int64_t shard = ActiveBlocksInRows(cuts[j], cuts[j + 1], density, local);
      ASSERT_EQ(shard, by_sum) << "rows [" << cuts[j] << ", " << cuts[j + 1] << ")";
      total += shard;
    }
    ASSERT_EQ(total, ActiveBlocks(rows * 64, density, 64, local)) << "rows=" << rows;
  }
  EXPECT_EQ(ActiveBlocksInRows(5, 5, 0.3, 1), 0);
  EXPECT_EQ(ActiveBlocksInRows(7, 3, 0.3, 1), 0);
  EXPECT_EQ(ActiveBlocksInRows(-4, 2, 1.0, 1), 3);  // rows 0 and 1 keep 1 and 2 blocks
}

// The rows past the anchors are summed in 32-bit lanes, eight at a time, when there are at most
// 96 of them: every such count (full lanes, a masked tail of each length, both) at densities
// from the least quantum to 1, where the lanes' terms are largest.
TEST(ActiveBlocksTest, ShortRunsPastTheAnchorsMatchDirectSummation) {
  for (int local = 0; local <= 3; ++local) {
    const int64_t anchors = local + 2;
    for (int64_t q : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{255}, int64_t{4097},
                      int64_t{32768}, kDensityQuantum - 1, kDensityQuantum}) {
      const int64_t n_free = std::max(anchors + 1, anchors * kDensityQuantum / q + 1);
      const double density = static_cast<double>(q) / kDensityQuantum;
      for (int64_t count = 1; count <= 100; ++count) {
        const int64_t rows = n_free - 1 + count;
        ASSERT_EQ(ActiveBlocks(rows, density, 1, local), ActiveBlocksBySum(rows, density, 1, local))
            << "rows=" << rows << " q=" << q << " local=" << local;
      }
    }
  }
}

// ActiveBlocks' shortcuts and paths, each against direct summation and asked twice (a kept
// answer must be the counted one): the triangle at full density (also at a density just below 1
// that quantizes to it) and where no row passes its anchors; documents summed without the kept
// answers (up to 96 rows past the anchors) and the longer ones kept, on both sides of that edge.
TEST(ActiveBlocksTest, ShortcutsAndKeptAnswersMatchDirectSummation) {
  ASSERT_EQ(QuantizeDensity(1.0 - 1e-6), kDensityQuantum);
  ASSERT_LT(QuantizeDensity(0.9999), kDensityQuantum);
  for (int local = 0; local <= 3; ++local) {
    const int64_t anchors = local + 2;
    for (double density : {1.0, 1.0 - 1e-6, 0.9999, 0.3, 1e-9}) {
      for (int64_t rows : {int64_t{0}, int64_t{1}, anchors - 1, anchors, anchors + 1, anchors + 95,
                           anchors + 96, anchors + 97, anchors + 500, int64_t{70000}}) {
        for (int block : kBlockSizes) {
          const int64_t length = rows * block;
          const int64_t want = ActiveBlocksBySum(length, density, block, local);
          for (int pass = 0; pass < 2; ++pass) {
            ASSERT_EQ(ActiveBlocks(length, density, block, local), want)
                << "rows=" << rows << " density=" << density << " local=" << local;
          }
          if (QuantizeDensity(density) == kDensityQuantum) {
            EXPECT_EQ(want, rows * (rows + 1) / 2);
          }
        }
      }
    }
  }
}

TEST(ActiveBlocksTest, ClosedFormMatchesDirectSummationForMillionTokenDocuments) {
  Rng rng(7);
  for (int c = 0; c < 40; ++c) {
    const int64_t length = 1000000 + static_cast<int64_t>(rng.NextU64() % 15000000);
    const double density = RandomDensity(rng);
    const int block = kBlockSizes[rng.NextU64() % 2];
    const int local = static_cast<int>(rng.NextU64() % 4);
    ASSERT_EQ(ActiveBlocks(length, density, block, local),
              ActiveBlocksBySum(length, density, block, local))
        << "length=" << length << " density=" << density;
  }
}

TEST(ActiveBlocksTest, ExhaustiveOverSmallDocumentsAndQuantizedDensities) {
  for (int block : kBlockSizes) {
    for (int local = 0; local <= 3; ++local) {
      for (int64_t length : {1, 2, 63, 64, 65, 127, 128, 129, 191, 200, 500, 1000, 4097}) {
        for (int64_t q = 1; q <= kDensityQuantum; q += 257) {
          const double density = static_cast<double>(q) / kDensityQuantum;
          ASSERT_EQ(ActiveBlocks(length, density, block, local),
                    ActiveBlocksBySum(length, density, block, local))
              << "length=" << length << " q=" << q << " block=" << block << " local=" << local;
        }
      }
    }
  }
}

TEST(ActiveBlocksTest, DenseAttentionKeepsTheWholeCausalTriangle) {
  Rng rng(5);
  for (int c = 0; c < 2000; ++c) {
    const auto [length, block, local, n] = RandomDocument(rng);
    ASSERT_EQ(ActiveBlocks(length, 1.0, block, local), n * (n + 1) / 2) << "length=" << length;
  }
  EXPECT_EQ(ActiveBlocks(1, 1.0, 64, 1), 1);
  EXPECT_EQ(ActiveBlocks(131072, 1.0, 64, 1), int64_t{2048} * 2049 / 2);
}

TEST(ActiveBlocksTest, TinyDocumentsAreFullyKeptAtAnyDensity) {
  for (int block : kBlockSizes) {
    for (int local = 0; local <= 3; ++local) {
      for (double density : {1e-9, 0.01, 0.3, 1.0}) {
        EXPECT_EQ(ActiveBlocks(0, density, block, local), 0);
        EXPECT_EQ(ActiveBlocks(1, density, block, local), 1);
        EXPECT_EQ(ActiveBlocks(block, density, block, local), 1);
        EXPECT_EQ(ActiveBlocks(block + 1, density, block, local), 3);  // rows 1 and 2: 1 + 2
        // Up to local + 2 rows everything is an anchor.
        const int64_t rows = local + 2;
        EXPECT_EQ(ActiveBlocks(rows * block, density, block, local), rows * (rows + 1) / 2);
      }
    }
  }
}

TEST(ActiveBlocksTest, NonDecreasingInDensityAndBoundedByAnchorsAndTriangle) {
  Rng rng(6);
  for (int c = 0; c < 300; ++c) {
    const auto [length, block, local, n] = RandomDocument(rng);
    int64_t anchored = 0;  // every row at its anchors only
    for (int64_t i = 0; i < n; ++i) anchored += AnchorBlocks(i, local);
    int64_t previous = 0;
    for (int64_t q = 1; q <= kDensityQuantum; q += 1 + static_cast<int64_t>(rng.NextU64() % 2000)) {
      const int64_t a =
          ActiveBlocks(length, static_cast<double>(q) / kDensityQuantum, block, local);
      ASSERT_GE(a, previous) << "length=" << length << " q=" << q;
      ASSERT_GE(a, anchored);
      ASSERT_LE(a, n * (n + 1) / 2);
      previous = a;
    }
    EXPECT_EQ(ActiveBlocks(length, 1e-9, block, local), anchored);
  }
}

TEST(ActiveBlocksTest, ApproximatelyProportionalToDensityForLongDocuments) {
  // With n rows, sum ceil(rho * k) over k <= n is rho n^2 / 2 + O(n).
  const int64_t n = 2048;
  for (double density : {0.05, 0.1, 0.3, 0.5, 0.9}) {
    const double a = static_cast<double>(ActiveBlocks(n * 64, density, 64, 1));
    EXPECT_NEAR(a / (density * n * n / 2.0), 1.0, 0.02) << density;
  }
}

// --- Every function is total: extreme inputs neither overflow nor divide by zero. ---

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();

TEST(QueryBlocksTest, ExactForEveryLengthAndBlockSize) {
  // (length + block - 1) / block used to overflow here.
  EXPECT_EQ(QueryBlocks(kInt64Max, 64), kInt64Max / 64 + 1);
  EXPECT_EQ(QueryBlocks(kInt64Max, 1), kInt64Max);
  EXPECT_EQ(QueryBlocks(kInt64Max - 63, 64), (kInt64Max - 63) / 64);  // a multiple of 64
  EXPECT_EQ(QueryBlocks(kInt64Min, 64), 0);
  EXPECT_EQ(QueryBlocks(1000, 0), 1000);  // block_size < 1 counts as 1
  EXPECT_EQ(QueryBlocks(1000, -64), 1000);
  EXPECT_EQ(QueryBlocks(kMaxMicroBatchCapacity, 64), int64_t{1} << 24);
}

TEST(KeptBlocksTest, ExactWithoutOverflowForHugeRows) {
  Rng rng(11);
  for (int c = 0; c < 20000; ++c) {
    const int64_t i = static_cast<int64_t>(rng.NextU64() >> (1 + rng.NextU64() % 63));
    const int64_t q = 1 + static_cast<int64_t>(rng.NextU64() % kDensityQuantum);
    const int local = static_cast<int>(rng.NextU64() % 5) == 0 ? kMaxLocalBlocks : 1;
    const __int128 n = static_cast<__int128>(std::min(i, kInt64Max - 1)) + 1;
    const __int128 by_density = (q * n + kDensityQuantum - 1) / kDensityQuantum;
    const __int128 anchors = std::min<__int128>(n, local + 2);
    const __int128 want = std::clamp<__int128>(by_density, anchors, n);
    ASSERT_EQ(static_cast<__int128>(KeptBlocks(i, q, local)), want) << "i=" << i << " q=" << q;
  }
  EXPECT_EQ(KeptBlocks(kInt64Max, kDensityQuantum, 1), kInt64Max);  // i capped at max - 1
  EXPECT_EQ(KeptBlocks(-1, 100, 1), 0);
  EXPECT_EQ(KeptBlocks(9, kInt64Max, 1), 10);  // q clamped to the quantum
  EXPECT_EQ(KeptBlocks(9, kInt64Min, 1), 3);   // and to 1
  EXPECT_EQ(AnchorBlocks(kInt64Max, 1), 3);
  EXPECT_EQ(AnchorBlocks(kInt64Max, std::numeric_limits<int>::max()),
            int64_t{std::numeric_limits<int>::max()} + 2);
  EXPECT_EQ(AnchorBlocks(-5, 1), 0);
  EXPECT_EQ(AnchorBlocks(5, -3), 2);  // negative local_blocks count as 0
}

TEST(FloorSumTest, ExactAtTheEdgesOfItsDomain) {
  const int64_t n = int64_t{1} << 31;
  EXPECT_EQ(FloorSum(n, 1, 1, 0), n * (n - 1) / 2);
  EXPECT_EQ(FloorSum(n, n, n, n - 1), n * (n - 1) / 2 + 0);
  // Splitting the range anywhere gives the same sum: a check that needs no O(n) reference.
  Rng rng(12);
  for (int c = 0; c < 2000; ++c) {
    const int64_t count = 1 + static_cast<int64_t>(rng.NextU64() % n);
    const int64_t m = 1 + static_cast<int64_t>(rng.NextU64() % n);
    const int64_t a = static_cast<int64_t>(rng.NextU64() % (int64_t{1} << 16));
    const int64_t b = static_cast<int64_t>(rng.NextU64() % (int64_t{1} << 40));
    const int64_t split = static_cast<int64_t>(rng.NextU64() % count);
    const int64_t whole = FloorSum(count, m, a, b);
    ASSERT_LT(whole, kInt64Max);
    ASSERT_EQ(whole, FloorSum(split, m, a, b) + FloorSum(count - split, m, a, b + a * split))
        << "n=" << count << " m=" << m << " a=" << a << " b=" << b << " split=" << split;
  }
}

TEST(FloorSumTest, OutsideItsDomainClampsOrSaturatesInsteadOfWrapping) {
  EXPECT_EQ(FloorSum(0, 5, 3, 2), 0);
  EXPECT_EQ(FloorSum(-7, 5, 3, 2), 0);
  EXPECT_EQ(FloorSum(4, 0, 1, 0), 0 + 1 + 2 + 3);      // m < 1 counts as 1
  EXPECT_EQ(FloorSum(4, 10, -6, -3), 0);               // negative a, b count as 0
  EXPECT_EQ(FloorSum(kInt64Max, 1, 1, 0), kInt64Max);  // n (n - 1) / 2 overflows
  EXPECT_EQ(FloorSum(int64_t{1} << 31, 1, kInt64Max, 0), kInt64Max);
  EXPECT_EQ(FloorSum(3, 1, 0, kInt64Max), kInt64Max);  // n * b overflows
  EXPECT_EQ(FloorSum(kInt64Max, kInt64Max, kInt64Max - 1, kInt64Max - 1), kInt64Max);
}

TEST(ActiveBlocksTest, LargestDocumentsAndWindowsMatchDirectSummation) {
  Rng rng(13);
  for (int local : {0, 12345, kMaxLocalBlocks}) {
    for (int block : kBlockSizes) {
      const double density = RandomDensity(rng);
      const int64_t length = kMaxMicroBatchCapacity - static_cast<int64_t>(rng.NextU64() % 100);
      ASSERT_EQ(ActiveBlocks(length, density, block, local),
                ActiveBlocksBySum(length, density, block, local))
          << "length=" << length << " density=" << density << " block=" << block
          << " local=" << local;
    }
  }
}

TEST(ActiveBlocksTest, ExtremeInputsAreClampedIntoTheDomain) {
  const int64_t rows = kMaxBlockMathRows;
  const int64_t triangle = rows * (rows + 1) / 2;  // < 2^62
  EXPECT_EQ(ActiveBlocks(kInt64Max, 1.0, 1, 1), triangle);
  EXPECT_EQ(ActiveBlocks(kInt64Max, 1.0, 64, 1), triangle);
  EXPECT_EQ(ActiveBlocks(kInt64Max, std::numeric_limits<double>::infinity(), 64, 1), triangle);
  EXPECT_EQ(ActiveBlocks(kInt64Max, 1.0, 64, std::numeric_limits<int>::max()), triangle);
  EXPECT_EQ(ActiveBlocks(rows, 1.0, 1, 1), triangle);  // exactly at the domain's edge
  const int64_t sparse = ActiveBlocks(kInt64Max, std::numeric_limits<double>::quiet_NaN(), 64,
                                      std::numeric_limits<int>::min());
  // NaN density counts as q = 1, and negative local_blocks as 0 (sink and diagonal only).
  EXPECT_EQ(sparse, ActiveBlocks(rows, 1e-12, 1, 0));
  EXPECT_GE(sparse, 1 + 2 * (rows - 1));
  EXPECT_EQ(ActiveBlocks(kInt64Min, 0.5, 64, 1), 0);
  EXPECT_EQ(ActiveBlocks(1000, 0.5, 0, 1), ActiveBlocks(1000, 0.5, 1, 1));
  for (double density : {1e-9, 0.3, 0.999}) {
    const int64_t a = ActiveBlocks(kInt64Max, density, 64, kMaxLocalBlocks);
    EXPECT_GT(a, 0) << density;
    EXPECT_LE(a, triangle) << density;
  }
}

// The per-density loop that ActiveBlocksOfQueryBlocksSum must equal, in 128 bits (a sum of up to
// 64 counts below 2^62 each), with the saturation the header documents.
int64_t LoopSum(int64_t rows, const std::vector<double>& densities, int local) {
  __int128 sum = 0;
  for (double d : densities) sum += ActiveBlocksOfQueryBlocks(rows, d, local);
  return sum < kInt64Max ? static_cast<int64_t>(sum) : kInt64Max;
}

// A density for the layer sums: mostly near a shared one (as a sample's layers are), sometimes
// at an edge: full or quantized to full, tiny, or outside (0, 1] (clamped).
double LayerDensity(Rng& rng, double around) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  constexpr double kEdges[] = {
      1.0,  1.0 - 1e-6, 1e-9,  1e-300, 0.0,
      -0.0, -0.5,       -kInf, kInf,   std::numeric_limits<double>::quiet_NaN(),
      1.5};
  switch (rng.NextU64() % 8) {
    case 0:
      return kEdges[rng.NextU64() % (sizeof(kEdges) / sizeof(kEdges[0]))];
    case 1:
      return RandomDensity(rng);
    default:
      return std::clamp(around * (0.5 + rng.Uniform()), 1e-6, 1.0);
  }
}

// Rows where a layer's run past its anchors is just below, at or just above the lengths where
// the counts change how they sum a run (96: directly or by FloorSum; 1024: in the vector lanes
// or not), or zero; documents up to the longest the counts take (and beyond: clamped).
int64_t LayerRows(Rng& rng, int local, double around) {
  const int64_t anchors = std::clamp(local, 0, kMaxLocalBlocks) + int64_t{2};
  const int64_t q = QuantizeDensity(around);
  const int64_t n_free = std::max(anchors + 1, anchors * kDensityQuantum / q + 1);
  switch (rng.NextU64() % 7) {
    case 0:
      return static_cast<int64_t>(rng.NextU64() % 8) - 1 + (rng.NextU64() % 2 == 0 ? anchors : 0);
    case 1:
      return n_free - 1 + 94 + static_cast<int64_t>(rng.NextU64() % 5);  // runs of 94-98
    case 2:
      return n_free - 1 + 1022 + static_cast<int64_t>(rng.NextU64() % 5);  // runs of 1022-1026
    case 3:
      return n_free - 3 + static_cast<int64_t>(rng.NextU64() % 5);  // runs of 0-2
    case 4:
      return kMaxBlockMathRows - static_cast<int64_t>(rng.NextU64() % 3) +
             (rng.NextU64() % 4 == 0 ? 1000 : 0);
    default:
      return static_cast<int64_t>(std::exp(rng.Uniform() * std::log(1e6)));
  }
}

// Both ways of ActiveBlocksOfQueryBlocksSum (the AVX2 lanes where the CPU has them, and the
// plain loop), and the dispatching function, equal the per-density loop; also the row ranges'
// sums the loop of ActiveBlocksInRows.
TEST(ActiveBlocksSumTest, EqualsThePerDensityLoopOnEveryPath) {
  Rng rng(23);
  int vector_sums = 0;
  constexpr size_t kCounts[] = {0, 1, 2, 7, 8, 9, 31, 32, 33, 64};
  constexpr int kLocals[] = {0, 1, 3, 100, kMaxLocalBlocks, -5, std::numeric_limits<int>::max()};
  for (int c = 0; c < 20000; ++c) {
    const int local = c % 3 == 0 ? kLocals[rng.NextU64() % 7] : static_cast<int>(rng.NextU64() % 4);
    const double around = RandomDensity(rng);
    const int64_t rows =
        c % 50 == 0 ? (c % 100 == 0 ? kInt64Min : kInt64Max) : LayerRows(rng, local, around);
    std::vector<double> densities(kCounts[c % (sizeof(kCounts) / sizeof(kCounts[0]))]);
    for (double& d : densities) d = LayerDensity(rng, around);
    const int64_t want = LoopSum(rows, densities, local);
    const auto where = [&] {
      return ::testing::Message() << "rows=" << rows << " local=" << local
                                  << " count=" << densities.size() << " around=" << around;
    };
    ASSERT_EQ(block_geometry_internal::ActiveBlocksSumScalar(rows, densities.data(),
                                                             densities.size(), local),
              want)
        << where();
    int64_t vector = -1;
    if (block_geometry_internal::ActiveBlocksSumVector(rows, densities.data(), densities.size(),
                                                       local, &vector)) {
      ++vector_sums;
      ASSERT_EQ(vector, want) << where();
    }
    ASSERT_EQ(ActiveBlocksOfQueryBlocksSum(rows, densities.data(), densities.size(), local), want)
        << where();
    // A shard's rows: a range inside the document, sometimes empty, reversed or out of range.
    const int64_t end = c % 7 == 0 ? rows : static_cast<int64_t>(rng.NextU64() % 5000) - 10;
    const int64_t begin = c % 5 == 0 ? static_cast<int64_t>(rng.NextU64() % 20) - 5
                                     : static_cast<int64_t>(rng.NextU64() % 5000) - 10;
    __int128 in_rows = 0;
    for (double d : densities) in_rows += ActiveBlocksInRows(begin, end, d, local);
    if (LoopSum(std::max(begin, end), densities, local) < kInt64Max) {
      ASSERT_EQ(ActiveBlocksInRowsSum(begin, end, densities.data(), densities.size(), local),
                static_cast<int64_t>(in_rows))
          << where() << " begin=" << begin << " end=" << end;
    }
  }
#if defined(__x86_64__) || defined(__i386__)
  if (__builtin_cpu_supports("avx2")) {
    EXPECT_GT(vector_sums, 15000);
  }
#endif
}

// Full density at the longest document in every layer: the sum passes INT64_MAX and saturates
// (the lanes decline it, the loop saturates), as does a row range's sum there.
TEST(ActiveBlocksSumTest, SaturatesInsteadOfWrapping) {
  const int64_t triangle = kMaxBlockMathRows * (kMaxBlockMathRows + 1) / 2;
  const std::vector<double> dense(4, 1.0);  // 4 (2^61 + 2^30) > INT64_MAX
  EXPECT_EQ(ActiveBlocksOfQueryBlocksSum(kMaxBlockMathRows, dense.data(), 1, 1), triangle);
  EXPECT_EQ(ActiveBlocksOfQueryBlocksSum(kMaxBlockMathRows, dense.data(), 4, 1), kInt64Max);
  EXPECT_EQ(block_geometry_internal::ActiveBlocksSumScalar(kMaxBlockMathRows, dense.data(), 4, 1),
            kInt64Max);
  int64_t unset = -1;
  EXPECT_FALSE(block_geometry_internal::ActiveBlocksSumVector(kMaxBlockMathRows, dense.data(), 4, 1,
                                                              &unset));
  EXPECT_EQ(unset, -1);
  EXPECT_EQ(ActiveBlocksInRowsSum(1, kMaxBlockMathRows, dense.data(), 4, 1), kInt64Max);
  EXPECT_EQ(ActiveBlocksOfQueryBlocksSum(5, nullptr, 0, 1), 0);
  EXPECT_EQ(ActiveBlocksInRowsSum(0, 5, nullptr, 0, 1), 0);
}

}  // namespace
}  // namespace sparsebalance
