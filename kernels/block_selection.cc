#include "kernels/block_selection.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "contract/block_geometry.h"
#include "kernels/parallel.h"

namespace sparsebalance {
namespace kernels {
namespace {

float ResolveScale(float softmax_scale, int head_dim) {
  return softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

}  // namespace

void MeanPoolBlocks(const float* x, int64_t token_stride, int32_t tokens, int block_size,
                    int head_dim, float* pooled) {
  const int32_t blocks = static_cast<int32_t>(QueryBlocks(tokens, block_size));
  std::fill(pooled, pooled + int64_t{blocks} * head_dim, 0.0f);
  for (int32_t t = 0; t < tokens; ++t) {
    const float* row = x + t * token_stride;
    float* mean = pooled + int64_t{t / block_size} * head_dim;
    for (int d = 0; d < head_dim; ++d) mean[d] += row[d];
  }
  for (int32_t b = 0; b < blocks; ++b) {
    const float inv = 1.0f / static_cast<float>(std::min(block_size, tokens - b * block_size));
    for (int d = 0; d < head_dim; ++d) pooled[int64_t{b} * head_dim + d] *= inv;
  }
}

float PooledScore(const float* q_mean, const float* k_mean, int head_dim, float scale) {
  float dot = 0.0f;
  for (int d = 0; d < head_dim; ++d) dot += q_mean[d] * k_mean[d];
  return dot * scale;
}

absl::Status ValidateSelectionInputs(absl::Span<const int32_t> cu_seqlens, int heads, int head_dim,
                                     absl::Span<const double> densities,
                                     const SelectionOptions& options) {
  if (absl::Status s = ValidateCuSeqlens(cu_seqlens); !s.ok()) return s;
  if (absl::Status s = ValidateHeads(heads); !s.ok()) return s;
  if (absl::Status s = ValidateHeadDim(head_dim); !s.ok()) return s;
  if (absl::Status s = ValidateBlockSize(options.block_size); !s.ok()) return s;
  if (absl::Status s = ValidateThreads(options.threads); !s.ok()) return s;
  if (options.local_blocks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("local_blocks=", options.local_blocks, " must be non-negative"));
  }
  if (!(options.mass_threshold > 0.0 && options.mass_threshold <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("mass_threshold=", options.mass_threshold,
                                                   " is outside (0, 1]; 1 turns it off"));
  }
  if (!(options.anchor_threshold > 0.0 && options.anchor_threshold <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("anchor_threshold=", options.anchor_threshold,
                     " is outside (0, 1] (a kept block's weight relative to the best anchor's)"));
  }
  if (options.mode != SelectionMode::kTopK && options.mode != SelectionMode::kAnchor) {
    return absl::InvalidArgumentError(
        absl::StrCat("mode=", static_cast<int>(options.mode), " is not a selection mode"));
  }
  if (!(options.softmax_scale >= 0.0f) || !std::isfinite(options.softmax_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "softmax_scale=", options.softmax_scale, " must be positive (or 0 for 1/sqrt(head_dim))"));
  }
  if (densities.size() != cu_seqlens.size() - 1) {
    return absl::InvalidArgumentError(absl::StrCat("densities has ", densities.size(),
                                                   " entries; expected one per sequence (",
                                                   cu_seqlens.size() - 1, ")"));
  }
  for (size_t s = 0; s < densities.size(); ++s) {
    if (!(densities[s] > 0.0 && densities[s] <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("densities[", s, "]=", densities[s], " is outside (0, 1]"));
    }
  }
  return absl::OkStatus();
}

std::vector<int32_t> SelectRow(int32_t query_block, int local_blocks, int64_t kept_cap,
                               double mass_threshold, absl::Span<const float> scores,
                               absl::Span<const double> pairs, float* estimated_recall,
                               SelectionMode mode, double anchor_threshold) {
  const int32_t n = query_block + 1;
  std::vector<int32_t> kept;
  if (kept_cap >= n) {  // every causal block: nothing to estimate
    kept.resize(n);
    std::iota(kept.begin(), kept.end(), 0);
    *estimated_recall = 1.0f;
    return kept;
  }
  // A score of NaN or +infinity (q or k holds one, or a product overflowed) has no order and
  // makes the row's masses NaN: sorted below it broke std::sort's strict weak ordering
  // (undefined behaviour), and the NaN total made the estimate 1.0. The row keeps every causal
  // block and reports a NaN estimate, which the callers turn into an error (CheckRowRecalls),
  // as the CUDA path does. A score of -infinity is a block no query attends to: kept last.
  for (int32_t j = 0; j < n; ++j) {
    if (!(scores[j] < std::numeric_limits<float>::infinity())) {
      kept.resize(n);
      std::iota(kept.begin(), kept.end(), 0);
      *estimated_recall = std::numeric_limits<float>::quiet_NaN();
      return kept;
    }
  }
  const float max_score = *std::max_element(scores.begin(), scores.begin() + n);
  std::vector<double> mass(n);
  double total = 0.0;
  for (int32_t j = 0; j < n; ++j) {
    mass[j] = pairs[j] * std::exp(static_cast<double>(scores[j] - max_score));
    total += mass[j];
  }
  // Anchors: block 0 and [i - local_blocks, i].
  const int32_t local_start = std::max<int32_t>(1, query_block - local_blocks);
  std::vector<char> is_kept(n, 0);
  is_kept[0] = 1;
  for (int32_t j = local_start; j <= query_block; ++j) is_kept[j] = 1;
  std::vector<int32_t> order;
  for (int32_t j = 1; j < local_start; ++j) order.push_back(j);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  });
  double kept_mass = mass[0];
  for (int32_t j = local_start; j <= query_block; ++j) kept_mass += mass[j];
  int64_t count = n - static_cast<int64_t>(order.size());
  const bool use_threshold = mass_threshold < 1.0;
  // Anchor-guided thresholding: blocks below the best anchor's score + log(tau) stay out.
  double score_floor = -INFINITY;
  if (mode == SelectionMode::kAnchor) {
    double best_anchor = scores[0];
    for (int32_t j = local_start; j <= query_block; ++j) {
      best_anchor = std::max(best_anchor, static_cast<double>(scores[j]));
    }
    score_floor = best_anchor + std::log(anchor_threshold);
  }
  for (int32_t j : order) {
    if (count >= kept_cap) break;
    if (use_threshold && kept_mass >= mass_threshold * total) break;
    if (static_cast<double>(scores[j]) < score_floor) break;  // `order` is by descending score
    is_kept[j] = 1;
    kept_mass += mass[j];
    ++count;
  }
  for (int32_t j = 0; j < n; ++j) {
    if (is_kept[j]) kept.push_back(j);
  }
  *estimated_recall = total > 0.0 ? static_cast<float>(std::min(1.0, kept_mass / total)) : 1.0f;
  return kept;
}

absl::Status NonFiniteScoresError(int sequence, int head, int32_t query_block) {
  return absl::InvalidArgumentError(
      absl::StrCat("q or k holds a NaN or an infinity: the block scores of sequence ", sequence,
                   ", head ", head, ", query block ", query_block,
                   " are NaN or +infinity, so no blocks can be chosen by "
                   "them"));
}

absl::Status CheckRowRecalls(const BlockIndex& index, absl::Span<const float> recall) {
  for (int s = 0; s < index.sequences(); ++s) {
    for (int h = 0; h < index.heads; ++h) {
      for (int32_t i = 0; i < index.blocks(s); ++i) {
        if (std::isnan(recall[index.RowId(s, h, i)])) return NonFiniteScoresError(s, h, i);
      }
    }
  }
  return absl::OkStatus();
}

std::vector<int32_t> SelectDocumentRow(int32_t length, int32_t query_block, int64_t density_q,
                                       const SelectionOptions& options,
                                       absl::Span<const float> scores, absl::Span<double> pairs,
                                       float* estimated_recall) {
  for (int32_t j = 0; j <= query_block; ++j) {
    pairs[j] = VisiblePairs(length, options.block_size, query_block, j);
  }
  return SelectRow(query_block, options.local_blocks,
                   KeptBlocks(query_block, density_q, options.local_blocks), options.mass_threshold,
                   scores, pairs, estimated_recall, options.mode, options.anchor_threshold);
}

absl::StatusOr<Selection> SelectBlocks(absl::Span<const int32_t> cu_seqlens, int heads,
                                       int head_dim, absl::Span<const float> q,
                                       absl::Span<const float> k,
                                       absl::Span<const double> densities,
                                       const SelectionOptions& options) {
  if (absl::Status s = ValidateSelectionInputs(cu_seqlens, heads, head_dim, densities, options);
      !s.ok()) {
    return s;
  }
  const size_t elements = static_cast<size_t>(cu_seqlens.back()) * heads * head_dim;
  if (absl::Status s = CheckSize("q", q.size(), elements); !s.ok()) return s;
  if (absl::Status s = CheckSize("k", k.size(), elements); !s.ok()) return s;
  const int block_size = options.block_size;
  const float scale = ResolveScale(options.softmax_scale, head_dim);
  const int64_t row_stride = int64_t{heads} * head_dim;  // floats between tokens
  return SelectFromScores(
      cu_seqlens, heads, densities, options, [&](int s, int h, const KeepRow& keep_row) {
        const int32_t length = cu_seqlens[s + 1] - cu_seqlens[s];
        const int32_t blocks = static_cast<int32_t>(QueryBlocks(length, block_size));
        // Mean-pooled Q and K per block.
        std::vector<float> q_mean(int64_t{blocks} * head_dim);
        std::vector<float> k_mean(int64_t{blocks} * head_dim);
        const int64_t offset = int64_t{cu_seqlens[s]} * row_stride + int64_t{h} * head_dim;
        MeanPoolBlocks(q.data() + offset, row_stride, length, block_size, head_dim, q_mean.data());
        MeanPoolBlocks(k.data() + offset, row_stride, length, block_size, head_dim, k_mean.data());
        std::vector<float> scores(blocks);
        for (int32_t i = 0; i < blocks; ++i) {
          for (int32_t j = 0; j <= i; ++j) {
            scores[j] = PooledScore(&q_mean[int64_t{i} * head_dim], &k_mean[int64_t{j} * head_dim],
                                    head_dim, scale);
          }
          keep_row(i, absl::MakeConstSpan(scores.data(), i + 1));
        }
      });
}

absl::StatusOr<Selection> SelectFromScores(
    absl::Span<const int32_t> cu_seqlens, int heads, absl::Span<const double> densities,
    const SelectionOptions& options,
    const std::function<void(int sequence, int head, const KeepRow& keep_row)>& score_rows) {
  const int block_size = options.block_size;
  const int sequences = static_cast<int>(cu_seqlens.size()) - 1;
  std::vector<int32_t> cu_blocks(1, 0);
  for (int s = 0; s < sequences; ++s) {
    cu_blocks.push_back(cu_blocks.back() + static_cast<int32_t>(QueryBlocks(
                                               cu_seqlens[s + 1] - cu_seqlens[s], block_size)));
  }
  const int64_t rows = int64_t{cu_blocks.back()} * heads;
  std::vector<std::vector<int32_t>> kept(rows);
  std::vector<float> recall(rows, 1.0f);
  ParallelFor(int64_t{sequences} * heads, options.threads, [&](int, int64_t task) {
    const int s = static_cast<int>(task / heads);
    const int h = static_cast<int>(task % heads);
    const int32_t length = cu_seqlens[s + 1] - cu_seqlens[s];
    const int32_t blocks = cu_blocks[s + 1] - cu_blocks[s];
    const int64_t density_q = QuantizeDensity(densities[s]);
    std::vector<double> pairs(blocks);
    score_rows(s, h, [&](int32_t i, absl::Span<const float> scores) {
      const int64_t row = int64_t{cu_blocks[s]} * heads + int64_t{h} * blocks + i;
      kept[row] = SelectDocumentRow(length, i, density_q, options, scores,
                                    absl::MakeSpan(pairs.data(), i + 1), &recall[row]);
    });
  });
  absl::StatusOr<BlockIndex> index = MakeBlockIndex(cu_seqlens, heads, block_size, kept);
  if (!index.ok()) return index.status();
  if (absl::Status s = CheckRowRecalls(*index, recall); !s.ok()) return s;
  Selection selection;
  selection.index = *std::move(index);
  selection.estimated_recall = std::move(recall);
  return selection;
}

absl::StatusOr<std::vector<float>> ExactRecall(const BlockIndex& index, int head_dim,
                                               absl::Span<const float> q, absl::Span<const float> k,
                                               float softmax_scale, int threads) {
  if (absl::Status s = ValidateBlockIndex(index); !s.ok()) return s;
  if (absl::Status s = ValidateHeadDim(head_dim); !s.ok()) return s;
  if (absl::Status s = ValidateThreads(threads); !s.ok()) return s;
  const int heads = index.heads;
  const size_t elements = static_cast<size_t>(index.total_tokens()) * heads * head_dim;
  if (absl::Status s = CheckSize("q", q.size(), elements); !s.ok()) return s;
  if (absl::Status s = CheckSize("k", k.size(), elements); !s.ok()) return s;
  const float scale = ResolveScale(softmax_scale, head_dim);
  const int block_size = index.block_size;
  const int64_t row_stride = int64_t{heads} * head_dim;
  std::vector<float> recall(index.rows(), 1.0f);
  ParallelFor(int64_t{index.sequences()} * heads, threads, [&](int, int64_t task) {
    const int s = static_cast<int>(task / heads);
    const int h = static_cast<int>(task % heads);
    const int32_t length = index.length(s);
    const int64_t base = int64_t{index.cu_seqlens[s]} * row_stride + int64_t{h} * head_dim;
    std::vector<double> logits(length);
    std::vector<char> in_row(index.blocks(s));
    for (int32_t i = 0; i < index.blocks(s); ++i) {
      const int64_t r = index.RowId(s, h, i);
      std::fill(in_row.begin(), in_row.end(), 0);
      for (int64_t e = index.row_ptr[r]; e < index.row_ptr[r + 1]; ++e) {
        in_row[index.col_idx[e]] = 1;
      }
      double sum_recall = 0.0;
      const int32_t first = i * block_size;
      const int32_t last = std::min(length, first + block_size);
      for (int32_t t = first; t < last; ++t) {
        double max_logit = -INFINITY;
        for (int32_t u = 0; u <= t; ++u) {
          double dot = 0.0;
          for (int d = 0; d < head_dim; ++d) {
            dot += static_cast<double>(q[base + t * row_stride + d]) * k[base + u * row_stride + d];
          }
          logits[u] = dot * scale;
          max_logit = std::max(max_logit, logits[u]);
        }
        double total = 0.0;
        double inside = 0.0;
        for (int32_t u = 0; u <= t; ++u) {
          const double p = std::exp(logits[u] - max_logit);
          total += p;
          if (in_row[u / block_size]) inside += p;
        }
        sum_recall += std::min(1.0, inside / total);
      }
      recall[r] = static_cast<float>(sum_recall / (last - first));
    }
  });
  return recall;
}

}  // namespace kernels
}  // namespace sparsebalance
