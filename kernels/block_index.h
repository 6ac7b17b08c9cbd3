// The block index of block-sparse causal attention over a varlen batch (DESIGN.md section 9):
// for every (sequence, head, query block) a CSR row of ascending kept key blocks, each with a
// FULL/PARTIAL flag, and the exact CSC transpose that the backward walks per key block. One
// format for the CPU reference and the CUDA kernels (kernels/cuda_attention.h uploads it).
//
// Blocks start at each sequence's first token, so no block spans two documents and nothing
// attends across documents; a sequence's last block may be short.
//
//   absl::StatusOr<BlockIndex> index = MakeBlockIndex({0, 100, 300}, /*heads=*/2,
//                                                     /*block_size=*/64, kept_rows);
//   for (int64_t e = index->row_ptr[r]; e < index->row_ptr[r + 1]; ++e) ... index->col_idx[e]
#ifndef SPARSEBALANCE_KERNELS_BLOCK_INDEX_H_
#define SPARSEBALANCE_KERNELS_BLOCK_INDEX_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "contract/host_device.h"

namespace sparsebalance {
namespace kernels {

// How a kept block is computed.
enum BlockFlag : uint8_t {
  kBlockFull = 0,     // every (query, key) pair of the block is visible: no masking
  kBlockPartial = 1,  // the causal diagonal, or a key block cut by the end of its document
};

struct BlockIndex {
  int block_size = 64;  // tokens per block: 64 or 128
  int heads = 0;
  // Token offsets: sequence s holds tokens [cu_seqlens[s], cu_seqlens[s+1]) (int32 prefix
  // sums, as in FlashAttention's varlen API); tensors are [total_tokens, heads, head_dim].
  std::vector<int32_t> cu_seqlens;
  // Block offsets: prefix sums of ceil(length_s / block_size), one entry more than sequences.
  std::vector<int32_t> cu_blocks;

  // CSR over rows (sequence, head, query block) in that order, see RowId.
  std::vector<int64_t> row_ptr;  // rows() + 1 offsets into col_idx / flags
  std::vector<int32_t> col_idx;  // key block within its sequence, ascending within a row
  std::vector<uint8_t> flags;    // a BlockFlag per CSR entry

  // CSC over columns (sequence, head, key block), numbered like rows (RowId).
  std::vector<int64_t> col_ptr;    // rows() + 1 offsets into row_idx / col_flags
  std::vector<int32_t> row_idx;    // query block within its sequence, ascending within a column
  std::vector<uint8_t> col_flags;  // the BlockFlag of the same (row, column) entry

  int sequences() const { return cu_seqlens.empty() ? 0 : static_cast<int>(cu_seqlens.size()) - 1; }
  int32_t total_tokens() const { return cu_seqlens.empty() ? 0 : cu_seqlens.back(); }
  int32_t length(int seq) const { return cu_seqlens[seq + 1] - cu_seqlens[seq]; }
  int32_t blocks(int seq) const { return cu_blocks[seq + 1] - cu_blocks[seq]; }
  // Rows of the CSR (and columns of the CSC): sum of blocks over sequences, times heads.
  int64_t rows() const { return cu_blocks.empty() ? 0 : int64_t{cu_blocks.back()} * heads; }
  // Kept (query block, key block) pairs over all rows.
  int64_t active_blocks() const { return static_cast<int64_t>(col_idx.size()); }
  int64_t RowId(int seq, int head, int32_t block) const {
    return int64_t{cu_blocks[seq]} * heads + int64_t{head} * blocks(seq) + block;
  }
};

// The flag of the kept pair (query block i, key block j) of a sequence of `length` tokens.
// Inline for the device too.
SB_HOST_DEVICE inline BlockFlag FlagOf(int32_t length, int block_size, int32_t query_block,
                                       int32_t key_block) {
  const int64_t key_end = (int64_t{key_block} + 1) * block_size;
  return key_block == query_block || key_end > length ? kBlockPartial : kBlockFull;
}

// Input checks shared by every kernel entry point; each error names the field and index.
absl::Status ValidateCuSeqlens(absl::Span<const int32_t> cu_seqlens);
absl::Status ValidateBlockSize(int block_size);
absl::Status ValidateHeadDim(int head_dim);
absl::Status ValidateHeads(int heads);
// CPU threads: non-negative, 0 meaning every hardware thread.
absl::Status ValidateThreads(int threads);
// `name` has `size` elements where `expected` are needed.
absl::Status CheckSize(absl::string_view name, size_t size, size_t expected);

// Builds the index from the kept key blocks of every row (`rows[RowId(s, h, i)]`, ascending,
// each in [0, i]): flags, block offsets and the CSC transpose.
absl::StatusOr<BlockIndex> MakeBlockIndex(absl::Span<const int32_t> cu_seqlens, int heads,
                                          int block_size,
                                          const std::vector<std::vector<int32_t>>& rows);

// Fills col_ptr / row_idx / col_flags from the CSR part.
void BuildTranspose(BlockIndex* index);

// Checks every invariant: sizes, offsets, rows ascending and causal, flags, and that the CSC
// is exactly the transpose of the CSR. O(active blocks + rows).
absl::Status ValidateBlockIndex(const BlockIndex& index);

}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_BLOCK_INDEX_H_
