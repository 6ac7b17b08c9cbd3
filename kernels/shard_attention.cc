#include "kernels/shard_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "contract/block_geometry.h"
#include "kernels/attention_cpu_tiles.h"
#include "kernels/block_index.h"
#include "kernels/parallel.h"

namespace sparsebalance {
namespace kernels {
namespace {

float ResolveScale(float softmax_scale, int head_dim) {
  return softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

absl::Status ValidateSoftmaxScale(float softmax_scale) {
  if (!(softmax_scale >= 0.0f) || !std::isfinite(softmax_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "softmax_scale=", softmax_scale, " must be positive (or 0 for 1/sqrt(head_dim))"));
  }
  return absl::OkStatus();
}

// The chunk [chunk_begin, chunk_end) is one owner's keys inside the shard's key range.
absl::Status ValidateChunk(const ShardSelection& selection, int32_t chunk_begin,
                           int32_t chunk_end) {
  const int block_size = selection.block_size;
  if (chunk_begin < 0 || chunk_begin % block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk_begin=", chunk_begin, " must be a non-negative multiple of block_size=", block_size,
        " (an owner's key chunk starts on a block)"));
  }
  if (chunk_end <= chunk_begin || chunk_end > selection.shard_end) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk_end=", chunk_end, " must be in (chunk_begin=", chunk_begin,
        ", shard_end=", selection.shard_end, "]: the shard's queries see keys [0, shard_end)"));
  }
  if (chunk_end != selection.document_length && chunk_end % block_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_end=", chunk_end, " must be a multiple of block_size=", block_size,
                     " or the document's end ", selection.document_length));
  }
  return absl::OkStatus();
}

// The kept blocks of a shard that fall in one key chunk, as the tiles read them: a CSR over the
// shard's rows (head, query block) and its CSC over (head, key block of the chunk); block
// numbers are the document's.
struct ChunkIndex {
  int32_t key_block0 = 0;
  int32_t key_blocks = 0;
  std::vector<int64_t> row_ptr;  // selection.rows() + 1
  std::vector<int32_t> col_idx;
  std::vector<uint8_t> flags;
  std::vector<int64_t> col_ptr;  // heads * key_blocks + 1
  std::vector<int32_t> row_idx;
  std::vector<uint8_t> col_flags;
};

// Time O(rows x log(row length) + kept blocks in the chunk).
ChunkIndex MakeChunkIndex(const ShardSelection& selection, int32_t chunk_begin, int32_t chunk_end) {
  const int block_size = selection.block_size;
  const int32_t query_blocks = selection.query_blocks();
  ChunkIndex c;
  c.key_block0 = chunk_begin / block_size;
  c.key_blocks = static_cast<int32_t>(QueryBlocks(chunk_end - chunk_begin, block_size));
  const int32_t key_end = c.key_block0 + c.key_blocks;
  c.row_ptr.reserve(selection.rows() + 1);
  c.row_ptr.push_back(0);
  c.col_ptr.assign(int64_t{selection.heads} * c.key_blocks + 1, 0);
  for (int h = 0; h < selection.heads; ++h) {
    for (int32_t il = 0; il < query_blocks; ++il) {
      const int32_t i = selection.first_block() + il;
      const int64_t r = selection.Row(h, i);
      const int32_t* first = selection.col_idx.data() + selection.row_ptr[r];
      const int32_t* last = selection.col_idx.data() + selection.row_ptr[r + 1];
      for (const int32_t* e = std::lower_bound(first, last, c.key_block0);
           e != last && *e < key_end; ++e) {
        c.col_idx.push_back(*e);
        c.flags.push_back(FlagOf(selection.document_length, block_size, i, *e));
        ++c.col_ptr[int64_t{h} * c.key_blocks + (*e - c.key_block0) + 1];
      }
      c.row_ptr.push_back(static_cast<int64_t>(c.col_idx.size()));
    }
  }
  for (size_t col = 1; col < c.col_ptr.size(); ++col) c.col_ptr[col] += c.col_ptr[col - 1];
  c.row_idx.resize(c.col_idx.size());
  c.col_flags.resize(c.col_idx.size());
  // Rows in ascending order leave each column's rows ascending (counting sort).
  std::vector<int64_t> next(c.col_ptr.begin(), c.col_ptr.end() - 1);
  for (int h = 0; h < selection.heads; ++h) {
    for (int32_t il = 0; il < query_blocks; ++il) {
      const int64_t r = int64_t{h} * query_blocks + il;
      for (int64_t e = c.row_ptr[r]; e < c.row_ptr[r + 1]; ++e) {
        const int64_t slot = next[int64_t{h} * c.key_blocks + (c.col_idx[e] - c.key_block0)]++;
        c.row_idx[slot] = selection.first_block() + il;
        c.col_flags[slot] = c.flags[e];
      }
    }
  }
  return c;
}

// Runs `fn` (the forward or backward tiles) on every head of the (shard, chunk) piece; `base`
// holds the tensors at their first element.
void RunChunkHeads(const ShardSelection& selection, const ChunkIndex& chunk, int head_dim,
                   const AttentionOptions& options, bool backward, const HeadTask& base,
                   HeadFn fn) {
  const int heads = selection.heads;
  const int32_t query_blocks = selection.query_blocks();
  const int workers = std::min(ResolveThreads(options.threads), heads);
  std::vector<TileWorkspace> workspaces(workers);
  const float scale = ResolveScale(options.softmax_scale, head_dim);
  ParallelFor(heads, workers, [&](int worker, int64_t h) {
    HeadTask task = base;
    task.block_size = selection.block_size;
    task.head_dim = head_dim;
    task.length = selection.document_length;
    task.blocks = query_blocks;
    task.query_block0 = selection.first_block();
    task.key_block0 = chunk.key_block0;
    task.key_blocks = chunk.key_blocks;
    task.scale = scale;
    task.token_stride = int64_t{heads} * head_dim;
    task.row_ptr = chunk.row_ptr.data() + h * query_blocks;
    task.col_idx = chunk.col_idx.data();
    task.flags = chunk.flags.data();
    task.col_ptr = chunk.col_ptr.data() + h * chunk.key_blocks;
    task.row_idx = chunk.row_idx.data();
    task.col_flags = chunk.col_flags.data();
    task.SetTensors(base, h * head_dim, h * selection.tokens());
    task.workspace = workspaces[worker].Get(
        WorkspaceFloats(selection.block_size, head_dim, query_blocks, chunk.key_blocks, backward));
    fn(task);
  });
}

// The checks ShardForwardChunk and ShardBackwardChunk share.
absl::Status ValidateChunkCall(const ShardSelection& selection, int head_dim, int32_t chunk_begin,
                               int32_t chunk_end, const AttentionOptions& options,
                               absl::Span<const float> q, absl::Span<const float> k_chunk,
                               absl::Span<const float> v_chunk, size_t out_size, size_t lse_size) {
  if (absl::Status s = ValidateShardSelection(selection); !s.ok()) return s;
  if (absl::Status s = ValidateHeadDim(head_dim); !s.ok()) return s;
  if (absl::Status s = ValidateSoftmaxScale(options.softmax_scale); !s.ok()) return s;
  if (absl::Status s = ValidateThreads(options.threads); !s.ok()) return s;
  if (absl::Status s = ValidateChunk(selection, chunk_begin, chunk_end); !s.ok()) return s;
  const size_t token_floats = static_cast<size_t>(selection.heads) * head_dim;
  if (absl::Status s = CheckSize("q", q.size(), selection.tokens() * token_floats); !s.ok()) {
    return s;
  }
  const size_t chunk_floats = static_cast<size_t>(chunk_end - chunk_begin) * token_floats;
  if (absl::Status s = CheckSize("k_chunk", k_chunk.size(), chunk_floats); !s.ok()) return s;
  if (absl::Status s = CheckSize("v_chunk", v_chunk.size(), chunk_floats); !s.ok()) return s;
  if (absl::Status s = CheckSize("out", out_size, q.size()); !s.ok()) return s;
  return CheckSize("lse", lse_size, static_cast<size_t>(selection.tokens()) * selection.heads);
}

}  // namespace

absl::Status ValidateCuts(absl::Span<const int32_t> cuts, int32_t document_length, int block_size) {
  if (absl::Status s = ValidateBlockSize(block_size); !s.ok()) return s;
  if (cuts.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuts has ", cuts.size(), " entries; it needs shards+1 >= 2 (0, then each shard's end)"));
  }
  if (cuts[0] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuts[0]=", cuts[0], " must be 0 (the first shard starts the document)"));
  }
  for (size_t c = 1; c < cuts.size(); ++c) {
    if (cuts[c] <= cuts[c - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuts[", c, "]=", cuts[c], " is not greater than cuts[", c - 1,
                       "]=", cuts[c - 1], ": every shard has tokens"));
    }
    if (c + 1 < cuts.size() && cuts[c] % block_size != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuts[", c, "]=", cuts[c], " is not a multiple of block_size=", block_size,
                       ": shards are cut between blocks"));
    }
  }
  if (cuts.back() != document_length) {
    return absl::InvalidArgumentError(absl::StrCat("cuts[", cuts.size() - 1, "]=", cuts.back(),
                                                   " must be the document's length ",
                                                   document_length));
  }
  return absl::OkStatus();
}

absl::Status ValidateShardRange(int32_t document_length, int32_t shard_begin, int32_t shard_end,
                                int block_size) {
  if (absl::Status s = ValidateBlockSize(block_size); !s.ok()) return s;
  if (document_length < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("document_length=", document_length, " must be at least 1 token"));
  }
  if (shard_begin < 0 || shard_begin >= document_length || shard_begin % block_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_begin=", shard_begin, " must be a multiple of block_size=", block_size,
                     " in [0, document_length=", document_length, ")"));
  }
  if (shard_end <= shard_begin || shard_end > document_length) {
    return absl::InvalidArgumentError(absl::StrCat("shard_end=", shard_end, " must be in (",
                                                   "shard_begin=", shard_begin,
                                                   ", document_length=", document_length, "]"));
  }
  if (shard_end != document_length && shard_end % block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("shard_end=", shard_end,
                                                   " must be a multiple of block_size=", block_size,
                                                   " or the document's end ", document_length));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> PoolKeyBlocks(int32_t tokens, int heads, int head_dim,
                                                 int block_size, absl::Span<const float> k) {
  if (tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("tokens=", tokens, " must be at least 1"));
  }
  if (absl::Status s = ValidateHeads(heads); !s.ok()) return s;
  if (absl::Status s = ValidateHeadDim(head_dim); !s.ok()) return s;
  if (absl::Status s = ValidateBlockSize(block_size); !s.ok()) return s;
  const int64_t stride = int64_t{heads} * head_dim;
  if (absl::Status s = CheckSize("k", k.size(), static_cast<size_t>(tokens * stride)); !s.ok()) {
    return s;
  }
  const int32_t blocks = static_cast<int32_t>(QueryBlocks(tokens, block_size));
  std::vector<float> pooled(blocks * stride);
  std::vector<float> head(int64_t{blocks} * head_dim);
  for (int h = 0; h < heads; ++h) {
    MeanPoolBlocks(k.data() + int64_t{h} * head_dim, stride, tokens, block_size, head_dim,
                   head.data());
    for (int32_t b = 0; b < blocks; ++b) {
      std::copy_n(head.data() + int64_t{b} * head_dim, head_dim,
                  pooled.data() + b * stride + int64_t{h} * head_dim);
    }
  }
  return pooled;
}

absl::StatusOr<ShardSelection> SelectShardBlocks(int32_t document_length, int32_t shard_begin,
                                                 int32_t shard_end, int heads, int head_dim,
                                                 absl::Span<const float> q,
                                                 absl::Span<const float> pooled_k, double density,
                                                 const SelectionOptions& options) {
  if (absl::Status s =
          ValidateShardRange(document_length, shard_begin, shard_end, options.block_size);
      !s.ok()) {
    return s;
  }
  if (!(density > 0.0 && density <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("density=", density, " is outside (0, 1]"));
  }
  const int32_t cu[] = {0, document_length};
  const double densities[] = {density};
  if (absl::Status s = ValidateSelectionInputs(cu, heads, head_dim, densities, options); !s.ok()) {
    return s;
  }
  const int block_size = options.block_size;
  const int64_t stride = int64_t{heads} * head_dim;
  ShardSelection selection;
  selection.block_size = block_size;
  selection.heads = heads;
  selection.document_length = document_length;
  selection.shard_begin = shard_begin;
  selection.shard_end = shard_end;
  if (absl::Status s = CheckSize("q", q.size(), static_cast<size_t>(selection.tokens() * stride));
      !s.ok()) {
    return s;
  }
  const int32_t key_blocks = static_cast<int32_t>(QueryBlocks(shard_end, block_size));
  if (absl::Status s =
          CheckSize("pooled_k", pooled_k.size(), static_cast<size_t>(key_blocks * stride));
      !s.ok()) {
    return s;
  }
  const float scale = ResolveScale(options.softmax_scale, head_dim);
  const int64_t density_q = QuantizeDensity(density);
  const int32_t query_blocks = selection.query_blocks();
  std::vector<std::vector<int32_t>> kept(selection.rows());
  selection.estimated_recall.assign(selection.rows(), 1.0f);
  ParallelFor(heads, options.threads, [&](int, int64_t h) {
    std::vector<float> q_mean(int64_t{query_blocks} * head_dim);
    MeanPoolBlocks(q.data() + h * head_dim, stride, selection.tokens(), block_size, head_dim,
                   q_mean.data());
    std::vector<float> k_mean(int64_t{key_blocks} * head_dim);
    for (int32_t b = 0; b < key_blocks; ++b) {
      std::copy_n(pooled_k.data() + b * stride + h * head_dim, head_dim,
                  k_mean.data() + int64_t{b} * head_dim);
    }
    std::vector<float> scores(key_blocks);
    std::vector<double> pairs(key_blocks);
    for (int32_t il = 0; il < query_blocks; ++il) {
      const int32_t i = selection.first_block() + il;
      for (int32_t j = 0; j <= i; ++j) {
        scores[j] = PooledScore(&q_mean[int64_t{il} * head_dim], &k_mean[int64_t{j} * head_dim],
                                head_dim, scale);
      }
      const int64_t row = selection.Row(static_cast<int>(h), i);
      kept[row] = SelectDocumentRow(
          document_length, i, density_q, options, absl::MakeConstSpan(scores.data(), i + 1),
          absl::MakeSpan(pairs.data(), i + 1), &selection.estimated_recall[row]);
    }
  });
  for (int h = 0; h < heads; ++h) {
    for (int32_t il = 0; il < query_blocks; ++il) {
      const int32_t i = selection.first_block() + il;
      if (std::isnan(selection.estimated_recall[selection.Row(h, i)])) {
        return NonFiniteScoresError(0, h, i);  // SelectRow's mark: the one document
      }
    }
  }
  selection.row_ptr.reserve(selection.rows() + 1);
  selection.row_ptr.push_back(0);
  for (const std::vector<int32_t>& row : kept) {
    selection.col_idx.insert(selection.col_idx.end(), row.begin(), row.end());
    selection.row_ptr.push_back(static_cast<int64_t>(selection.col_idx.size()));
  }
  return selection;
}

absl::Status ValidateShardSelection(const ShardSelection& selection) {
  if (absl::Status s = ValidateHeads(selection.heads); !s.ok()) return s;
  if (absl::Status s = ValidateShardRange(selection.document_length, selection.shard_begin,
                                          selection.shard_end, selection.block_size);
      !s.ok()) {
    return s;
  }
  const int64_t rows = selection.rows();
  if (absl::Status s = CheckSize("selection.row_ptr", selection.row_ptr.size(), rows + 1);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          CheckSize("selection.estimated_recall", selection.estimated_recall.size(), rows);
      !s.ok()) {
    return s;
  }
  if (selection.row_ptr[0] != 0 || selection.row_ptr[rows] != selection.active_blocks()) {
    return absl::InvalidArgumentError(absl::StrCat("selection.row_ptr must run from 0 to ",
                                                   selection.active_blocks(), " (col_idx size)"));
  }
  for (int h = 0; h < selection.heads; ++h) {
    for (int32_t il = 0; il < selection.query_blocks(); ++il) {
      const int32_t i = selection.first_block() + il;
      const int64_t r = selection.Row(h, i);
      if (selection.row_ptr[r + 1] < selection.row_ptr[r]) {
        return absl::InvalidArgumentError(
            absl::StrCat("selection.row_ptr[", r + 1, "] is below selection.row_ptr[", r, "]"));
      }
      int32_t previous = -1;
      for (int64_t e = selection.row_ptr[r]; e < selection.row_ptr[r + 1]; ++e) {
        const int32_t j = selection.col_idx[e];
        if (j <= previous || j > i) {
          return absl::InvalidArgumentError(
              absl::StrCat("selection.col_idx[", e, "]=", j, " (head ", h, ", query block ", i,
                           ") must be ascending and in [0, ", i, "]"));
        }
        previous = j;
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> NeededKeyBlocks(const ShardSelection& selection,
                                                     int32_t chunk_begin, int32_t chunk_end) {
  if (absl::Status s = ValidateShardSelection(selection); !s.ok()) return s;
  if (absl::Status s = ValidateChunk(selection, chunk_begin, chunk_end); !s.ok()) return s;
  const int32_t first = chunk_begin / selection.block_size;
  const int32_t end =
      first + static_cast<int32_t>(QueryBlocks(chunk_end - chunk_begin, selection.block_size));
  std::vector<char> needed(end - first, 0);
  for (int64_t r = 0; r < selection.rows(); ++r) {
    const int32_t* row_end = selection.col_idx.data() + selection.row_ptr[r + 1];
    for (const int32_t* e =
             std::lower_bound(selection.col_idx.data() + selection.row_ptr[r], row_end, first);
         e != row_end && *e < end; ++e) {
      needed[*e - first] = 1;
    }
  }
  std::vector<int32_t> blocks;
  for (int32_t j = first; j < end; ++j) {
    if (needed[j - first]) blocks.push_back(j);
  }
  return blocks;
}

absl::Status ShardForwardChunk(const ShardSelection& selection, int head_dim,
                               absl::Span<const float> q, int32_t chunk_begin, int32_t chunk_end,
                               absl::Span<const float> k_chunk, absl::Span<const float> v_chunk,
                               const AttentionOptions& options, absl::Span<float> out,
                               absl::Span<float> lse) {
  if (absl::Status s = ValidateChunkCall(selection, head_dim, chunk_begin, chunk_end, options, q,
                                         k_chunk, v_chunk, out.size(), lse.size());
      !s.ok()) {
    return s;
  }
  HeadTask base;
  base.q = q.data();
  base.k = k_chunk.data();
  base.v = v_chunk.data();
  base.out_w = out.data();
  base.lse_w = lse.data();
  RunChunkHeads(selection, MakeChunkIndex(selection, chunk_begin, chunk_end), head_dim, options,
                /*backward=*/false, base, ForwardHeadFn());
  return absl::OkStatus();
}

absl::Status MergeAttentionPartial(int32_t tokens, int heads, int head_dim,
                                   absl::Span<const float> out_part,
                                   absl::Span<const float> lse_part, absl::Span<float> out,
                                   absl::Span<float> lse) {
  if (tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("tokens=", tokens, " must be at least 1"));
  }
  if (absl::Status s = ValidateHeads(heads); !s.ok()) return s;
  if (absl::Status s = ValidateHeadDim(head_dim); !s.ok()) return s;
  const size_t elements = static_cast<size_t>(tokens) * heads * head_dim;
  const size_t rows = static_cast<size_t>(tokens) * heads;
  if (absl::Status s = CheckSize("out_part", out_part.size(), elements); !s.ok()) return s;
  if (absl::Status s = CheckSize("lse_part", lse_part.size(), rows); !s.ok()) return s;
  if (absl::Status s = CheckSize("out", out.size(), elements); !s.ok()) return s;
  if (absl::Status s = CheckSize("lse", lse.size(), rows); !s.ok()) return s;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int h = 0; h < heads; ++h) {
    for (int32_t t = 0; t < tokens; ++t) {
      const size_t r = static_cast<size_t>(h) * tokens + t;
      const float b = lse_part[r];
      if (b == kNegInf) continue;  // the partial saw no key of this row
      float* o = out.data() + (static_cast<size_t>(t) * heads + h) * head_dim;
      const float* p = out_part.data() + (static_cast<size_t>(t) * heads + h) * head_dim;
      const float a = lse[r];
      if (a == kNegInf) {
        std::copy_n(p, head_dim, o);
        lse[r] = b;
        continue;
      }
      const double m = std::max(a, b);
      const double wa = std::exp(a - m);
      const double wb = std::exp(b - m);
      const double sum = wa + wb;
      for (int d = 0; d < head_dim; ++d) {
        o[d] = static_cast<float>((wa * o[d] + wb * p[d]) / sum);
      }
      lse[r] = static_cast<float>(m + std::log(sum));
    }
  }
  return absl::OkStatus();
}

absl::Status ShardBackwardChunk(const ShardSelection& selection, int head_dim,
                                absl::Span<const float> q, int32_t chunk_begin, int32_t chunk_end,
                                absl::Span<const float> k_chunk, absl::Span<const float> v_chunk,
                                absl::Span<const float> out, absl::Span<const float> lse,
                                absl::Span<const float> dout, const AttentionOptions& options,
                                absl::Span<float> dq, absl::Span<float> dk_chunk,
                                absl::Span<float> dv_chunk) {
  if (absl::Status s = ValidateChunkCall(selection, head_dim, chunk_begin, chunk_end, options, q,
                                         k_chunk, v_chunk, out.size(), lse.size());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckSize("dout", dout.size(), q.size()); !s.ok()) return s;
  if (absl::Status s = CheckSize("dq", dq.size(), q.size()); !s.ok()) return s;
  if (absl::Status s = CheckSize("dk_chunk", dk_chunk.size(), k_chunk.size()); !s.ok()) return s;
  if (absl::Status s = CheckSize("dv_chunk", dv_chunk.size(), k_chunk.size()); !s.ok()) return s;
  HeadTask base;
  base.q = q.data();
  base.k = k_chunk.data();
  base.v = v_chunk.data();
  base.out = out.data();
  base.dout = dout.data();
  base.lse_in = lse.data();
  base.dq = dq.data();
  base.dk = dk_chunk.data();
  base.dv = dv_chunk.data();
  base.accumulate = true;
  RunChunkHeads(selection, MakeChunkIndex(selection, chunk_begin, chunk_end), head_dim, options,
                /*backward=*/true, base, BackwardHeadFn());
  return absl::OkStatus();
}

absl::StatusOr<ShardedAttentionResult> ShardedAttentionReference(
    absl::Span<const int32_t> cuts, int heads, int head_dim, absl::Span<const float> q,
    absl::Span<const float> k, absl::Span<const float> v, absl::Span<const float> dout,
    double density, const SelectionOptions& selection_options,
    const AttentionOptions& attention_options) {
  const int block_size = selection_options.block_size;
  if (absl::Status s = ValidateHeads(heads); !s.ok()) return s;
  if (absl::Status s = ValidateHeadDim(head_dim); !s.ok()) return s;
  if (cuts.empty()) {
    return absl::InvalidArgumentError("cuts is empty; it needs 0, then each shard's end");
  }
  const int32_t length = cuts.back();
  if (absl::Status s = ValidateCuts(cuts, length, block_size); !s.ok()) return s;
  const int64_t stride = int64_t{heads} * head_dim;
  const size_t elements = static_cast<size_t>(length * stride);
  if (absl::Status s = CheckSize("q", q.size(), elements); !s.ok()) return s;
  if (absl::Status s = CheckSize("k", k.size(), elements); !s.ok()) return s;
  if (absl::Status s = CheckSize("v", v.size(), elements); !s.ok()) return s;
  const bool backward = !dout.empty();
  if (backward) {
    if (absl::Status s = CheckSize("dout", dout.size(), elements); !s.ok()) return s;
  }
  const int shards = static_cast<int>(cuts.size()) - 1;
  auto tokens_of = [&](int r) { return cuts[r + 1] - cuts[r]; };
  // What rank r holds: its own tokens' rows of a document tensor.
  auto own = [&](absl::Span<const float> x, int r) {
    return std::vector<float>(x.begin() + cuts[r] * stride, x.begin() + cuts[r + 1] * stride);
  };
  std::vector<std::vector<float>> q_r(shards), k_r(shards), v_r(shards), dout_r(shards);
  for (int r = 0; r < shards; ++r) {
    q_r[r] = own(q, r);
    k_r[r] = own(k, r);
    v_r[r] = own(v, r);
    if (backward) dout_r[r] = own(dout, r);
  }

  // 1. Each rank pools its keys; the all-gather concatenates them in rank order.
  std::vector<float> pooled;
  for (int r = 0; r < shards; ++r) {
    absl::StatusOr<std::vector<float>> mine =
        PoolKeyBlocks(tokens_of(r), heads, head_dim, block_size, k_r[r]);
    if (!mine.ok()) return mine.status();
    pooled.insert(pooled.end(), mine->begin(), mine->end());
  }
  ShardedAttentionResult result;
  for (int j = 0; j < shards; ++j) {
    const size_t prefix = static_cast<size_t>(QueryBlocks(cuts[j + 1], block_size) * stride);
    absl::StatusOr<ShardSelection> selection =
        SelectShardBlocks(length, cuts[j], cuts[j + 1], heads, head_dim, q_r[j],
                          absl::MakeConstSpan(pooled.data(), prefix), density, selection_options);
    if (!selection.ok()) return selection.status();
    result.selections.push_back(*std::move(selection));
  }

  // 2. Each owner o < j sends shard j the blocks of its chunk that j keeps; the rest stay NaN.
  struct Received {
    std::vector<int32_t> blocks;  // NeededKeyBlocks
    std::vector<float> k, v;      // the owner's chunk layout
  };
  std::vector<std::vector<Received>> received(shards);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int j = 0; j < shards; ++j) {
    received[j].resize(j);
    for (int o = 0; o < j; ++o) {
      absl::StatusOr<std::vector<int32_t>> blocks =
          NeededKeyBlocks(result.selections[j], cuts[o], cuts[o + 1]);
      if (!blocks.ok()) return blocks.status();
      Received& in = received[j][o];
      in.blocks = *std::move(blocks);
      in.k.assign(k_r[o].size(), nan);
      in.v.assign(v_r[o].size(), nan);
      for (int32_t b : in.blocks) {
        const int64_t first = int64_t{b} * block_size - cuts[o];
        const int64_t last = std::min<int64_t>(first + block_size, tokens_of(o));
        std::copy(k_r[o].begin() + first * stride, k_r[o].begin() + last * stride,
                  in.k.begin() + first * stride);
        std::copy(v_r[o].begin() + first * stride, v_r[o].begin() + last * stride,
                  in.v.begin() + first * stride);
        result.needed_exchange_bytes += 2 * (last - first) * stride * int64_t{sizeof(float)};
      }
      result.prefix_exchange_bytes += 2 * int64_t{tokens_of(o)} * stride * int64_t{sizeof(float)};
    }
  }
  auto chunk_k = [&](int j, int o) -> absl::Span<const float> {
    return o == j ? absl::MakeConstSpan(k_r[j]) : absl::MakeConstSpan(received[j][o].k);
  };
  auto chunk_v = [&](int j, int o) -> absl::Span<const float> {
    return o == j ? absl::MakeConstSpan(v_r[j]) : absl::MakeConstSpan(received[j][o].v);
  };

  // 3. Forward: a partial per owner chunk, merged.
  result.out.assign(elements, 0.0f);
  result.lse.assign(static_cast<size_t>(length) * heads, 0.0f);
  std::vector<std::vector<float>> out_r(shards), lse_r(shards);
  for (int j = 0; j < shards; ++j) {
    const int32_t tokens = tokens_of(j);
    out_r[j].assign(q_r[j].size(), 0.0f);
    lse_r[j].assign(static_cast<size_t>(tokens) * heads, -std::numeric_limits<float>::infinity());
    std::vector<float> out_part(q_r[j].size());
    std::vector<float> lse_part(lse_r[j].size());
    for (int o = 0; o <= j; ++o) {
      if (absl::Status s = ShardForwardChunk(
              result.selections[j], head_dim, q_r[j], cuts[o], cuts[o + 1], chunk_k(j, o),
              chunk_v(j, o), attention_options, absl::MakeSpan(out_part), absl::MakeSpan(lse_part));
          !s.ok()) {
        return s;
      }
      if (absl::Status s =
              MergeAttentionPartial(tokens, heads, head_dim, out_part, lse_part,
                                    absl::MakeSpan(out_r[j]), absl::MakeSpan(lse_r[j]));
          !s.ok()) {
        return s;
      }
    }
    std::copy(out_r[j].begin(), out_r[j].end(), result.out.begin() + cuts[j] * stride);
    for (int h = 0; h < heads; ++h) {
      std::copy_n(lse_r[j].begin() + int64_t{h} * tokens, tokens,
                  result.lse.begin() + int64_t{h} * length + cuts[j]);
    }
  }
  if (!backward) return result;

  // 4. Backward: dq stays with the shard; dk, dv of the kept blocks go back to their owner.
  result.dq.assign(elements, 0.0f);
  result.dk.assign(elements, 0.0f);
  result.dv.assign(elements, 0.0f);
  std::vector<std::vector<float>> dk_r(shards), dv_r(shards);
  for (int r = 0; r < shards; ++r) {
    dk_r[r].assign(k_r[r].size(), 0.0f);
    dv_r[r].assign(v_r[r].size(), 0.0f);
  }
  for (int j = 0; j < shards; ++j) {
    std::vector<float> dq(q_r[j].size(), 0.0f);
    for (int o = 0; o <= j; ++o) {
      std::vector<float> dk_sent, dv_sent;
      absl::Span<float> dk_chunk = absl::MakeSpan(dk_r[j]);
      absl::Span<float> dv_chunk = absl::MakeSpan(dv_r[j]);
      if (o != j) {
        dk_sent.assign(k_r[o].size(), 0.0f);
        dv_sent.assign(v_r[o].size(), 0.0f);
        dk_chunk = absl::MakeSpan(dk_sent);
        dv_chunk = absl::MakeSpan(dv_sent);
      }
      if (absl::Status s =
              ShardBackwardChunk(result.selections[j], head_dim, q_r[j], cuts[o], cuts[o + 1],
                                 chunk_k(j, o), chunk_v(j, o), out_r[j], lse_r[j], dout_r[j],
                                 attention_options, absl::MakeSpan(dq), dk_chunk, dv_chunk);
          !s.ok()) {
        return s;
      }
      if (o == j) continue;
      // The owner adds what it receives: the rows of the blocks it sent.
      for (int32_t b : received[j][o].blocks) {
        const int64_t first = (int64_t{b} * block_size - cuts[o]) * stride;
        const int64_t last =
            std::min<int64_t>(int64_t{b + 1} * block_size - cuts[o], tokens_of(o)) * stride;
        for (int64_t x = first; x < last; ++x) {
          dk_r[o][x] += dk_sent[x];
          dv_r[o][x] += dv_sent[x];
        }
      }
    }
    std::copy(dq.begin(), dq.end(), result.dq.begin() + cuts[j] * stride);
  }
  for (int r = 0; r < shards; ++r) {
    std::copy(dk_r[r].begin(), dk_r[r].end(), result.dk.begin() + cuts[r] * stride);
    std::copy(dv_r[r].begin(), dv_r[r].end(), result.dv.begin() + cuts[r] * stride);
  }
  return result;
}

}  // namespace kernels
}  // namespace sparsebalance
