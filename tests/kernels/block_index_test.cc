// The block index: flags, the exact CSC transpose, and bad input named precisely.
#include "kernels/block_index.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference.h"

namespace sparsebalance {
namespace kernels {
namespace {

using ::testing::HasSubstr;

// Random causal rows, each holding its diagonal and a random subset of earlier blocks.
std::vector<std::vector<int32_t>> RandomRows(const std::vector<int32_t>& cu, int heads,
                                             int block_size, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> rows;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    const int32_t blocks = (cu[s + 1] - cu[s] + block_size - 1) / block_size;
    for (int h = 0; h < heads; ++h) {
      for (int32_t i = 0; i < blocks; ++i) {
        std::vector<int32_t> row;
        for (int32_t j = 0; j < i; ++j) {
          if (rng() % 3 == 0) row.push_back(j);
        }
        row.push_back(i);
        rows.push_back(row);
      }
    }
  }
  return rows;
}

TEST(BlockIndexTest, TransposeIsExactAndFlagsMarkTheDiagonal) {
  const std::vector<int32_t> cu = testing::CuSeqlens({1, 64, 65, 300, 129});
  for (int block_size : {64, 128}) {
    const int heads = 3;
    absl::StatusOr<BlockIndex> index =
        MakeBlockIndex(cu, heads, block_size, RandomRows(cu, heads, block_size, 5));
    ASSERT_TRUE(index.ok()) << index.status();
    ASSERT_TRUE(ValidateBlockIndex(*index).ok());
    EXPECT_EQ(index->col_ptr.back(), index->active_blocks());
    // Every CSC entry (column j, row i) is a CSR entry (row i, column j), with the same flag,
    // and columns list rows ascending.
    for (int s = 0; s < index->sequences(); ++s) {
      for (int h = 0; h < heads; ++h) {
        for (int32_t j = 0; j < index->blocks(s); ++j) {
          const int64_t c = index->RowId(s, h, j);
          for (int64_t e = index->col_ptr[c]; e < index->col_ptr[c + 1]; ++e) {
            if (e > index->col_ptr[c]) {
              EXPECT_LT(index->row_idx[e - 1], index->row_idx[e]);
            }
            const int64_t r = index->RowId(s, h, index->row_idx[e]);
            bool found = false;
            for (int64_t f = index->row_ptr[r]; f < index->row_ptr[r + 1]; ++f) {
              if (index->col_idx[f] == j) {
                found = true;
                EXPECT_EQ(index->flags[f], index->col_flags[e]);
              }
            }
            EXPECT_TRUE(found);
          }
        }
        for (int32_t i = 0; i < index->blocks(s); ++i) {
          const int64_t r = index->RowId(s, h, i);
          for (int64_t e = index->row_ptr[r]; e < index->row_ptr[r + 1]; ++e) {
            EXPECT_EQ(index->flags[e] == kBlockPartial, index->col_idx[e] == i);
          }
        }
      }
    }
  }
}

TEST(BlockIndexTest, FlagOfMarksCutKeyBlocksPartial) {
  EXPECT_EQ(FlagOf(200, 64, 2, 1), kBlockFull);
  EXPECT_EQ(FlagOf(200, 64, 2, 2), kBlockPartial);
  EXPECT_EQ(FlagOf(200, 64, 3, 3), kBlockPartial);  // 8 tokens: cut and diagonal
  EXPECT_EQ(FlagOf(100, 64, 5, 1), kBlockPartial);  // key block past the end
}

TEST(BlockIndexTest, BadInputIsAnErrorNamingTheField) {
  const std::vector<std::vector<int32_t>> one_row = {{0}};
  struct Case {
    std::vector<int32_t> cu;
    int heads;
    int block_size;
    const char* message;
  };
  for (const Case& c : std::vector<Case>{
           {{0, 10, 10}, 1, 64, "cu_seqlens[2]=10 is not greater than cu_seqlens[1]=10"},
           {{0, 20, 5}, 1, 64, "cu_seqlens[2]=5"},
           {{1, 20}, 1, 64, "cu_seqlens[0]=1"},
           {{0}, 1, 64, "cu_seqlens has 1 entries"},
           {{0, 10}, 0, 64, "heads=0"},
           {{0, 10}, 1, 32, "block_size=32 is not supported"},
           {{0, 100}, 1, 64, "rows has 1 elements; expected 2"},
       }) {
    absl::StatusOr<BlockIndex> index = MakeBlockIndex(c.cu, c.heads, c.block_size, one_row);
    EXPECT_EQ(index.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(index.status().message(), HasSubstr(c.message));
  }
  // A key block after the query block, and a row out of order.
  absl::StatusOr<BlockIndex> acausal = MakeBlockIndex({0, 100}, 1, 64, {{0}, {0, 2}});
  EXPECT_THAT(acausal.status().message(), HasSubstr("key block 2 must be in [0, 1]"));
  absl::StatusOr<BlockIndex> unsorted = MakeBlockIndex({0, 200}, 1, 64, {{0}, {1}, {2, 1}});
  EXPECT_EQ(unsorted.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(BlockIndexTest, ValidateCatchesACorruptedIndex) {
  const std::vector<int32_t> cu = testing::CuSeqlens({300, 77});
  absl::StatusOr<BlockIndex> good = MakeBlockIndex(cu, 2, 64, RandomRows(cu, 2, 64, 9));
  ASSERT_TRUE(good.ok());
  {
    BlockIndex bad = *good;
    bad.row_idx[3] += 1;
    EXPECT_THAT(ValidateBlockIndex(bad).message(), HasSubstr("not the transpose"));
  }
  {
    BlockIndex bad = *good;
    bad.flags[0] = bad.flags[0] == kBlockFull ? kBlockPartial : kBlockFull;
    EXPECT_THAT(ValidateBlockIndex(bad).message(), HasSubstr("index.flags[0]"));
  }
  {
    BlockIndex bad = *good;
    bad.col_idx.pop_back();
    EXPECT_THAT(ValidateBlockIndex(bad).message(), HasSubstr("index.flags has"));
  }
  {
    BlockIndex bad = *good;
    bad.cu_blocks[1] += 1;
    EXPECT_THAT(ValidateBlockIndex(bad).message(), HasSubstr("index.cu_blocks[1]"));
  }
  {
    BlockIndex bad = *good;
    bad.col_ptr[2] = bad.col_ptr[1] - 1;
    EXPECT_EQ(ValidateBlockIndex(bad).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(BlockIndexTest, ValidateRefusesARowPointerPastTheEntriesBeforeWalkingTheRow) {
  // By hand: one sequence of 2 blocks, 1 head; row 0 keeps block 0, row 1 nothing.
  BlockIndex index;
  index.block_size = 64;
  index.heads = 1;
  index.cu_seqlens = {0, 128};
  index.cu_blocks = {0, 2};
  index.row_ptr = {0, 1, 1};
  index.col_idx = {0};
  index.flags = {FlagOf(128, 64, 0, 0)};
  index.col_ptr = {0, 1, 1};
  index.row_idx = {0};
  index.col_flags = index.flags;
  ASSERT_TRUE(ValidateBlockIndex(index).ok()) << ValidateBlockIndex(index);
  // Both ends still right, row 0 running far past the one entry: walking it read col_idx and
  // flags out of bounds.
  index.row_ptr[1] = 1 << 20;
  const absl::Status status = ValidateBlockIndex(index);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("index.row_ptr[0..1]=[0, 1048576) is outside the 1"))
      << status;
  index.row_ptr = {0, -1, 1};
  EXPECT_THAT(ValidateBlockIndex(index).message(), HasSubstr("index.row_ptr"));
}

}  // namespace
}  // namespace kernels
}  // namespace sparsebalance
