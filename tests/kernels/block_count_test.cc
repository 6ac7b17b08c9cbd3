// The kernels count exactly the blocks the planner's latency model predicts.
#include "kernels/block_count.h"

#include <cstdint>
#include <random>

#include "gtest/gtest.h"
#include "planner/block_math.h"

namespace sparsebalance {
namespace kernels {
namespace {

TEST(BlockCountTest, QuantizationMatchesThePlanner) {
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int n = 0; n < 100000; ++n) {
    const double density = n < 1000 ? n / 999.0 : unit(rng);
    ASSERT_EQ(kernels::QuantizeDensity(density), sparsebalance::QuantizeDensity(density))
        << density;
  }
  for (double density : {1e-9, 0.5 / 65536, 1.5 / 65536, 0.1, 0.3, 1.0 - 1e-9, 1.0}) {
    EXPECT_EQ(kernels::QuantizeDensity(density), sparsebalance::QuantizeDensity(density));
  }
  EXPECT_EQ(kernels::kDensityQuantum, sparsebalance::kDensityQuantum);
}

TEST(BlockCountTest, KeptAndActiveBlocksMatchThePlanner) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int trial = 0; trial < 3000; ++trial) {
    const int block_size = trial % 2 == 0 ? 64 : 128;
    const int local_blocks = static_cast<int>(rng() % 4);
    const int64_t length = trial % 3 == 0 ? 1 + static_cast<int64_t>(rng() % 600)
                                          : 1 + static_cast<int64_t>(rng() % 140000);
    const double density = trial % 5 == 0 ? 1.0 : 0.001 + 0.999 * unit(rng);
    const int64_t q = kernels::QuantizeDensity(density);
    int64_t sum = 0;
    for (int64_t i = 0; i < kernels::QueryBlocks(length, block_size); ++i) {
      const int64_t kept = kernels::KeptBlocks(i, q, local_blocks);
      ASSERT_EQ(kept, sparsebalance::KeptBlocks(i, q, local_blocks)) << "row " << i;
      ASSERT_EQ(kernels::AnchorBlocks(i, local_blocks),
                sparsebalance::AnchorBlocks(i, local_blocks));
      sum += kept;
    }
    ASSERT_EQ(kernels::QueryBlocks(length, block_size),
              sparsebalance::QueryBlocks(length, block_size));
    ASSERT_EQ(kernels::ActiveBlocks(length, density, block_size, local_blocks),
              sparsebalance::ActiveBlocks(length, density, block_size, local_blocks))
        << "length " << length << " density " << density;
    ASSERT_EQ(sum, sparsebalance::ActiveBlocks(length, density, block_size, local_blocks));
  }
}

}  // namespace
}  // namespace kernels
}  // namespace sparsebalance
