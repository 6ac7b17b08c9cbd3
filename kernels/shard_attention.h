// Context parallelism on the CPU (issue 15, DESIGN.md section 9): one document of `length`
// tokens split into P contiguous shards at block-aligned cuts (cuts[0] = 0 < ... < cuts[P] =
// length). Rank j holds q, k, v of tokens [cuts[j], cuts[j+1]) and its queries attend causally
// to the keys [0, cuts[j+1]) that ranks 0..j hold ("key chunks", one per owner). The pieces, in
// the order a rank runs them:
//   1. PoolKeyBlocks on its own tokens, gathered by concatenation in rank order, then
//      SelectShardBlocks: the shard's rows of the unsplit SelectBlocks, bit for bit.
//   2. NeededKeyBlocks: which key blocks of an owner's chunk the shard keeps (what to send).
//   3. ShardForwardChunk per owner chunk (partial out and LSE), MergeAttentionPartial: the
//      unsplit AttentionForward rows.
//   4. ShardBackwardChunk per owner chunk: dq (summed over chunks), dk and dv of the chunk's
//      tokens (summed at the owner over the shards): the unsplit AttentionBackward.
// Tensors are fp32 [tokens, heads, head_dim] of the shard or chunk; lse is [heads, tokens].
// Work is proportional to the kept blocks (the CPU reference's tiles, kernels/attention_cpu.h).
//
//   absl::StatusOr<ShardSelection> sel = SelectShardBlocks(length, cuts[j], cuts[j + 1], heads,
//                                                          head_dim, q_j, pooled, 0.3, options);
//   for (int o = 0; o <= j; ++o) {
//     ShardForwardChunk(*sel, head_dim, q_j, cuts[o], cuts[o + 1], k_o, v_o, attention,
//                       out_o, lse_o);
//     MergeAttentionPartial(tokens, heads, head_dim, out_o, lse_o, out, lse);  // from 0, -inf
//   }
#ifndef SPARSEBALANCE_KERNELS_SHARD_ATTENTION_H_
#define SPARSEBALANCE_KERNELS_SHARD_ATTENTION_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/attention_cpu.h"
#include "kernels/block_selection.h"

namespace sparsebalance {
namespace kernels {

// The kept key blocks of one shard's query blocks, in block numbers of the document.
struct ShardSelection {
  int block_size = 64;  // tokens per block
  int heads = 0;
  int32_t document_length = 0;  // tokens
  int32_t shard_begin = 0;      // first query token, a multiple of block_size
  int32_t shard_end = 0;        // one past the last query token
  // CSR over rows (head, query block of the shard), row Row(h, i): ascending key blocks of
  // the document, each <= the row's query block i.
  std::vector<int64_t> row_ptr;  // rows() + 1 offsets into col_idx
  std::vector<int32_t> col_idx;
  // Per row, Selection::estimated_recall of the same document row.
  std::vector<float> estimated_recall;

  int32_t tokens() const { return shard_end - shard_begin; }
  int32_t first_block() const { return shard_begin / block_size; }
  int32_t query_blocks() const { return (tokens() + block_size - 1) / block_size; }
  int64_t rows() const { return int64_t{heads} * query_blocks(); }
  // `query_block` is a block of the document in [first_block(), first_block() + query_blocks()).
  int64_t Row(int head, int32_t query_block) const {
    return int64_t{head} * query_blocks() + (query_block - first_block());
  }
  int64_t active_blocks() const { return static_cast<int64_t>(col_idx.size()); }
};

// cuts[0] = 0 < cuts[1] < ... < cuts.back() = document_length, every cut but the last a
// multiple of block_size; errors name the cut.
absl::Status ValidateCuts(absl::Span<const int32_t> cuts, int32_t document_length, int block_size);

// 0 <= shard_begin < shard_end <= document_length, shard_begin a multiple of block_size and
// shard_end one too unless it is document_length.
absl::Status ValidateShardRange(int32_t document_length, int32_t shard_begin, int32_t shard_end,
                                int block_size);

// Mean of k over each block of `tokens` tokens (k is [tokens, heads, head_dim], blocks start at
// its first token), summed in token order exactly as SelectBlocks pools: [ceil(tokens /
// block_size), heads, head_dim]. Concatenating the results of ranks 0..j gives the pooled keys
// of the document's blocks [0, ceil(cuts[j+1] / block_size)).
absl::StatusOr<std::vector<float>> PoolKeyBlocks(int32_t tokens, int heads, int head_dim,
                                                 int block_size, absl::Span<const float> k);

// The rows of SelectBlocks({0, document_length}, ..., {density}, options) for the query blocks
// of [shard_begin, shard_end), from the shard's q ([shard tokens, heads, head_dim]) and the
// pooled keys of blocks [0, ceil(shard_end / block_size)) (PoolKeyBlocks' layout). Identical
// kept blocks and estimated recall; time O(shard blocks x key blocks x head_dim) per head.
absl::StatusOr<ShardSelection> SelectShardBlocks(int32_t document_length, int32_t shard_begin,
                                                 int32_t shard_end, int heads, int head_dim,
                                                 absl::Span<const float> q,
                                                 absl::Span<const float> pooled_k, double density,
                                                 const SelectionOptions& options);

// Sizes, offsets, and rows ascending and causal; errors name the field.
absl::Status ValidateShardSelection(const ShardSelection& selection);

// The key blocks of the chunk [chunk_begin, chunk_end) that some row of `selection` keeps
// (union over heads and rows), ascending: the blocks the chunk's owner has to send. The chunk
// lies within the shard's keys [0, shard_end) and starts on a block; it ends on a block or at
// the document's end.
absl::StatusOr<std::vector<int32_t>> NeededKeyBlocks(const ShardSelection& selection,
                                                     int32_t chunk_begin, int32_t chunk_end);

// Partial attention of the shard's queries (q: [shard tokens, heads, head_dim]) over the kept
// key blocks inside the chunk [chunk_begin, chunk_end) (k_chunk, v_chunk: [chunk tokens, heads,
// head_dim]; blocks the shard does not keep are never read). Writes out and lse ([heads, shard
// tokens]) of the chunk alone: out 0 and lse -inf on rows that keep no block of it.
absl::Status ShardForwardChunk(const ShardSelection& selection, int head_dim,
                               absl::Span<const float> q, int32_t chunk_begin, int32_t chunk_end,
                               absl::Span<const float> k_chunk, absl::Span<const float> v_chunk,
                               const AttentionOptions& options, absl::Span<float> out,
                               absl::Span<float> lse);

// Merges a partial (out_part, lse_part) into the running (out, lse) exactly: lse <- logaddexp(
// lse, lse_part), out <- exp(lse_old - lse) out + exp(lse_part - lse) out_part; start the
// running pair at out 0 and lse -inf. Merging every chunk's partial gives AttentionForward's
// rows. `tokens` query tokens: out tensors [tokens, heads, head_dim], lse [heads, tokens].
absl::Status MergeAttentionPartial(int32_t tokens, int heads, int head_dim,
                                   absl::Span<const float> out_part,
                                   absl::Span<const float> lse_part, absl::Span<float> out,
                                   absl::Span<float> lse);

// The backward of the shard over one key chunk, from the merged out and lse of the shard and
// dout (all [shard tokens, ...] like q): ADDS the chunk's dq contribution to dq (shard tokens)
// and the shard's dk, dv contributions to dk_chunk, dv_chunk (chunk tokens), for the owner to
// sum. Summed over every (shard, chunk) pair they equal AttentionBackward's dq, dk, dv.
absl::Status ShardBackwardChunk(const ShardSelection& selection, int head_dim,
                                absl::Span<const float> q, int32_t chunk_begin, int32_t chunk_end,
                                absl::Span<const float> k_chunk, absl::Span<const float> v_chunk,
                                absl::Span<const float> out, absl::Span<const float> lse,
                                absl::Span<const float> dout, const AttentionOptions& options,
                                absl::Span<float> dq, absl::Span<float> dk_chunk,
                                absl::Span<float> dv_chunk);

// Everything ShardedAttentionReference computed, in the unsplit layouts.
struct ShardedAttentionResult {
  std::vector<ShardSelection> selections;  // one per shard
  std::vector<float> out;                  // [length, heads, head_dim]
  std::vector<float> lse;                  // [heads, length]
  std::vector<float> dq, dk, dv;           // [length, heads, head_dim]; empty without dout
  // Key and value bytes the shards receive from other ranks (fp32): every other owner's whole
  // chunk, and only the blocks NeededKeyBlocks names.
  int64_t prefix_exchange_bytes = 0;
  int64_t needed_exchange_bytes = 0;
};

// Runs all shards of one document through the pieces above in one process, with memory copies
// standing in for the exchange: each rank pools its keys, the pooled keys are gathered, each
// shard selects, receives only its needed key/value blocks of each owner's chunk (the others
// are NaN, so reading one would show), runs the forward per chunk and merges, then (when dout
// is not empty) the backward per chunk, dk and dv going back to their owner. q, k, v, dout:
// [length, heads, head_dim] of the whole document, length = cuts.back().
absl::StatusOr<ShardedAttentionResult> ShardedAttentionReference(
    absl::Span<const int32_t> cuts, int heads, int head_dim, absl::Span<const float> q,
    absl::Span<const float> k, absl::Span<const float> v, absl::Span<const float> dout,
    double density, const SelectionOptions& selection_options,
    const AttentionOptions& attention_options);

}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_SHARD_ATTENTION_H_
