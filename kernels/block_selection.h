// Dynamic block selection (DESIGN.md section 9): mean-pooled Q and K per block give a score
// for every causal (query block, key block) pair; each row keeps its anchors (sink block 0,
// the diagonal and `local_blocks` before it), then the best-scoring blocks until it holds
// k_i = KeptBlocks(i, QuantizeDensity(density)) blocks, or, with a mass threshold, until the
// estimated share of softmax mass kept reaches it. In SelectionMode::kAnchor (anchor-guided
// thresholding) a block is added only while its score is at least s_a + log(tau), s_a the best
// anchor's score and tau = anchor_threshold: k_i is then a cap, not a count. A row whose k_i
// covers every causal block keeps them all in either mode. Tensors are fp32 [total_tokens,
// heads, head_dim]; densities are per sequence.
//
//   absl::StatusOr<Selection> sel = SelectBlocks(cu_seqlens, heads, head_dim, q, k,
//                                                /*densities=*/{0.3, 1.0}, SelectionOptions{});
//   // sel->index is the CSR/CSC block index, sel->estimated_recall one value per CSR row.
#ifndef SPARSEBALANCE_KERNELS_BLOCK_SELECTION_H_
#define SPARSEBALANCE_KERNELS_BLOCK_SELECTION_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "contract/host_device.h"
#include "contract/selection_mode.h"
#include "kernels/block_index.h"

namespace sparsebalance {
namespace kernels {

struct SelectionOptions {
  int block_size = 64;   // tokens per block: 64 or 128
  int local_blocks = 1;  // key blocks before the diagonal that every row keeps
  // Stop adding blocks to a row once its estimated kept mass reaches this share, in (0, 1];
  // 1 keeps exactly k_i blocks per row (the planner's count).
  double mass_threshold = 1.0;
  // kTopK keeps k_i blocks per row; kAnchor keeps, within k_i, only the blocks scoring at
  // least s_a + log(anchor_threshold) (contract/selection_mode.h).
  SelectionMode mode = SelectionMode::kTopK;
  double anchor_threshold = kDefaultAnchorThreshold;  // tau, in (0, 1]; read in kAnchor only
  float softmax_scale = 0.0f;                         // 0 means 1/sqrt(head_dim)
  int threads = 0;  // CPU threads; 0 means the hardware concurrency
};

struct Selection {
  BlockIndex index;
  // Per CSR row: the block scores' estimate of the softmax mass the row keeps, in [0, 1]; 1
  // exactly when the row keeps every causal block.
  std::vector<float> estimated_recall;
};

// Every field of `options` and every density in (0, 1]; errors name the field.
absl::Status ValidateSelectionInputs(absl::Span<const int32_t> cu_seqlens, int heads, int head_dim,
                                     absl::Span<const double> densities,
                                     const SelectionOptions& options);

// Selects the kept blocks on the CPU.
absl::StatusOr<Selection> SelectBlocks(absl::Span<const int32_t> cu_seqlens, int heads,
                                       int head_dim, absl::Span<const float> q,
                                       absl::Span<const float> k,
                                       absl::Span<const double> densities,
                                       const SelectionOptions& options);

// The rule of SelectBlocks for one row, shared with the CUDA path: `scores[j]` (softmax
// logits of the pooled blocks) and `pairs[j]` (visible (query, key) token pairs) for every key
// block j in [0, query_block]. Keeps the anchors, then blocks by descending score (ties: lower
// j first) until `kept_cap` blocks or the mass threshold; in SelectionMode::kAnchor also
// only while scores[j] >= s_a + log(anchor_threshold), s_a = the highest score among the
// anchors. Block j's estimated mass is pairs[j] * exp(scores[j]). Returns the kept blocks
// ascending and sets *estimated_recall. Unless every causal block is kept anyway, a score of NaN
// or +infinity keeps every causal block and sets *estimated_recall to NaN: the caller refuses
// the input (CheckRowRecalls).
std::vector<int32_t> SelectRow(int32_t query_block, int local_blocks, int64_t kept_cap,
                               double mass_threshold, absl::Span<const float> scores,
                               absl::Span<const double> pairs, float* estimated_recall,
                               SelectionMode mode = SelectionMode::kTopK,
                               double anchor_threshold = 1.0);

// INVALID_ARGUMENT for a row whose scores SelectRow (or the CUDA path's selection) found NaN or
// +infinity: q or k holds one.
absl::Status NonFiniteScoresError(int sequence, int head, int32_t query_block);
// The first row of `index` whose estimated recall (`recall[RowId(s, h, i)]`) is NaN, as
// NonFiniteScoresError; OK when there is none.
absl::Status CheckRowRecalls(const BlockIndex& index, absl::Span<const float> recall);

// The row rule of SelectFromScores for query block `query_block` of a document of `length`
// tokens at the quantized density `density_q` (QuantizeDensity): SelectRow with the
// VisiblePairs of each key block (written to `pairs`, query_block + 1 entries) and the
// KeptBlocks cap. `scores` holds the query_block + 1 logits of key blocks 0..query_block.
std::vector<int32_t> SelectDocumentRow(int32_t length, int32_t query_block, int64_t density_q,
                                       const SelectionOptions& options,
                                       absl::Span<const float> scores, absl::Span<double> pairs,
                                       float* estimated_recall);

// Scores of one row for SelectFromScores: the i + 1 softmax logits of query block i's key
// blocks 0..i.
using KeepRow = std::function<void(int32_t query_block, absl::Span<const float> scores)>;

// The host half of block selection, shared by the CPU and CUDA paths: for every (sequence,
// head), in parallel on `options.threads`, `score_rows(s, h, keep_row)` must call keep_row
// once for each query block of sequence s with its scores; keep_row applies SelectRow at the
// sequence's density. Inputs are checked by the caller (ValidateSelectionInputs).
absl::StatusOr<Selection> SelectFromScores(
    absl::Span<const int32_t> cu_seqlens, int heads, absl::Span<const double> densities,
    const SelectionOptions& options,
    const std::function<void(int sequence, int head, const KeepRow& keep_row)>& score_rows);

// The pooling of SelectBlocks for one head: pooled[b * head_dim + d] is the mean of
// x[t * token_stride + d] over the tokens t of block b of [0, tokens) (blocks start at token 0;
// the last may be short), summed in token order. A rank that pools its own block-aligned tokens
// this way gets the same bits as SelectBlocks pooling the whole document.
void MeanPoolBlocks(const float* x, int64_t token_stride, int32_t tokens, int block_size,
                    int head_dim, float* pooled);

// The score of SelectBlocks for a (query block, key block) pair of pooled rows:
// scale * dot(q_mean, k_mean), summed over d in order.
float PooledScore(const float* q_mean, const float* k_mean, int head_dim, float scale);

// Visible (query, key) token pairs of query block i and key block j <= i of a sequence of
// `length` tokens: the weight of a block score in the estimated mass. Inline for the device too.
SB_HOST_DEVICE inline double VisiblePairs(int32_t length, int block_size, int32_t query_block,
                                          int32_t key_block) {
  const int64_t left = length - int64_t{query_block} * block_size;
  const int64_t rows = left < block_size ? left : block_size;
  if (key_block < query_block) return static_cast<double>(rows) * block_size;  // a whole block
  return static_cast<double>(rows) * (rows + 1) / 2;                           // causal triangle
}

// Exact recall per CSR row: for each query token the softmax mass (over all its causal keys in
// its document) that falls inside the row's kept blocks, averaged over the row's tokens.
// O(tokens^2 * head_dim) per head: tests and the CPU reference only.
absl::StatusOr<std::vector<float>> ExactRecall(const BlockIndex& index, int head_dim,
                                               absl::Span<const float> q, absl::Span<const float> k,
                                               float softmax_scale = 0.0f, int threads = 0);

}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_BLOCK_SELECTION_H_
