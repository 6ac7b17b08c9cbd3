#include "kernels/block_index.h"

#include "absl/strings/str_cat.h"
#include "contract/block_geometry.h"

namespace sparsebalance {
namespace kernels {

absl::Status ValidateCuSeqlens(absl::Span<const int32_t> cu_seqlens) {
  if (cu_seqlens.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("cu_seqlens has ", cu_seqlens.size(),
                     " entries; it needs sequences+1 >= 2 (0, then each sequence's end)"));
  }
  if (cu_seqlens[0] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cu_seqlens[0]=", cu_seqlens[0], " must be 0 (token offsets start at 0)"));
  }
  for (size_t s = 1; s < cu_seqlens.size(); ++s) {
    if (cu_seqlens[s] <= cu_seqlens[s - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cu_seqlens[", s, "]=", cu_seqlens[s], " is not greater than cu_seqlens[", s - 1,
          "]=", cu_seqlens[s - 1], ": offsets must increase (every sequence has a token)"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateBlockSize(int block_size) {
  if (block_size != 64 && block_size != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size=", block_size, " is not supported; use 64 or 128"));
  }
  return absl::OkStatus();
}

absl::Status ValidateHeadDim(int head_dim) {
  if (head_dim != 64 && head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim=", head_dim, " is not supported; use 64 or 128"));
  }
  return absl::OkStatus();
}

absl::Status ValidateHeads(int heads) {
  if (heads < 1) {
    return absl::InvalidArgumentError(absl::StrCat("heads=", heads, " must be at least 1"));
  }
  return absl::OkStatus();
}

absl::Status ValidateThreads(int threads) {
  if (threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads=", threads, " must be non-negative (0: all cores)"));
  }
  return absl::OkStatus();
}

absl::Status CheckSize(absl::string_view name, size_t size, size_t expected) {
  if (size != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has ", size, " elements; expected ", expected));
  }
  return absl::OkStatus();
}

namespace {

// Fills cu_blocks from cu_seqlens (already validated).
void FillBlockOffsets(BlockIndex* index) {
  index->cu_blocks.assign(1, 0);
  for (int s = 0; s < index->sequences(); ++s) {
    index->cu_blocks.push_back(index->cu_blocks.back() + static_cast<int32_t>(QueryBlocks(
                                                             index->length(s), index->block_size)));
  }
}

}  // namespace

absl::StatusOr<BlockIndex> MakeBlockIndex(absl::Span<const int32_t> cu_seqlens, int heads,
                                          int block_size,
                                          const std::vector<std::vector<int32_t>>& rows) {
  if (absl::Status s = ValidateCuSeqlens(cu_seqlens); !s.ok()) return s;
  if (absl::Status s = ValidateHeads(heads); !s.ok()) return s;
  if (absl::Status s = ValidateBlockSize(block_size); !s.ok()) return s;
  BlockIndex index;
  index.block_size = block_size;
  index.heads = heads;
  index.cu_seqlens.assign(cu_seqlens.begin(), cu_seqlens.end());
  FillBlockOffsets(&index);
  if (absl::Status s = CheckSize("rows", rows.size(), static_cast<size_t>(index.rows())); !s.ok()) {
    return s;
  }
  index.row_ptr.assign(1, 0);
  for (int s = 0; s < index.sequences(); ++s) {
    for (int h = 0; h < heads; ++h) {
      for (int32_t i = 0; i < index.blocks(s); ++i) {
        const int64_t r = index.RowId(s, h, i);
        int32_t previous = -1;
        for (int32_t j : rows[r]) {
          if (j <= previous || j > i) {
            return absl::InvalidArgumentError(absl::StrCat(
                "rows[", r, "] (sequence ", s, ", head ", h, ", query block ", i, "): key block ",
                j, " must be in [0, ", i, "] and above the previous ", previous));
          }
          previous = j;
          index.col_idx.push_back(j);
          index.flags.push_back(FlagOf(index.length(s), block_size, i, j));
        }
        index.row_ptr.push_back(static_cast<int64_t>(index.col_idx.size()));
      }
    }
  }
  BuildTranspose(&index);
  return index;
}

void BuildTranspose(BlockIndex* index) {
  const int64_t rows = index->rows();
  const int64_t entries = index->active_blocks();
  index->col_ptr.assign(rows + 1, 0);
  index->row_idx.assign(entries, 0);
  index->col_flags.assign(entries, kBlockFull);
  // Counting sort: visiting rows in ascending order leaves each column's rows ascending.
  for (int s = 0; s < index->sequences(); ++s) {
    for (int h = 0; h < index->heads; ++h) {
      for (int32_t i = 0; i < index->blocks(s); ++i) {
        const int64_t r = index->RowId(s, h, i);
        for (int64_t e = index->row_ptr[r]; e < index->row_ptr[r + 1]; ++e) {
          ++index->col_ptr[index->RowId(s, h, index->col_idx[e]) + 1];
        }
      }
    }
  }
  for (int64_t c = 0; c < rows; ++c) index->col_ptr[c + 1] += index->col_ptr[c];
  std::vector<int64_t> next(index->col_ptr.begin(), index->col_ptr.end() - 1);
  for (int s = 0; s < index->sequences(); ++s) {
    for (int h = 0; h < index->heads; ++h) {
      for (int32_t i = 0; i < index->blocks(s); ++i) {
        const int64_t r = index->RowId(s, h, i);
        for (int64_t e = index->row_ptr[r]; e < index->row_ptr[r + 1]; ++e) {
          const int64_t slot = next[index->RowId(s, h, index->col_idx[e])]++;
          index->row_idx[slot] = i;
          index->col_flags[slot] = index->flags[e];
        }
      }
    }
  }
}

absl::Status ValidateBlockIndex(const BlockIndex& index) {
  if (absl::Status s = ValidateCuSeqlens(index.cu_seqlens); !s.ok()) return s;
  if (absl::Status s = ValidateHeads(index.heads); !s.ok()) return s;
  if (absl::Status s = ValidateBlockSize(index.block_size); !s.ok()) return s;
  if (absl::Status s =
          CheckSize("index.cu_blocks", index.cu_blocks.size(), index.cu_seqlens.size());
      !s.ok()) {
    return s;
  }
  if (index.cu_blocks[0] != 0) {
    return absl::InvalidArgumentError("index.cu_blocks[0] must be 0");
  }
  for (int s = 0; s < index.sequences(); ++s) {
    if (index.blocks(s) != QueryBlocks(index.length(s), index.block_size)) {
      return absl::InvalidArgumentError(
          absl::StrCat("index.cu_blocks[", s + 1, "]=", index.cu_blocks[s + 1],
                       " does not match cu_seqlens", " (sequence ", s, " of ", index.length(s),
                       " tokens has ", QueryBlocks(index.length(s), index.block_size), " blocks)"));
    }
  }
  const size_t rows = static_cast<size_t>(index.rows());
  const size_t entries = index.col_idx.size();
  if (absl::Status s = CheckSize("index.row_ptr", index.row_ptr.size(), rows + 1); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckSize("index.col_ptr", index.col_ptr.size(), rows + 1); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckSize("index.flags", index.flags.size(), entries); !s.ok()) return s;
  if (absl::Status s = CheckSize("index.row_idx", index.row_idx.size(), entries); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckSize("index.col_flags", index.col_flags.size(), entries); !s.ok()) {
    return s;
  }
  if (index.row_ptr[0] != 0 || index.row_ptr[rows] != static_cast<int64_t>(entries)) {
    return absl::InvalidArgumentError(absl::StrCat("index.row_ptr must run from 0 to ", entries));
  }
  if (index.col_ptr[0] != 0 || index.col_ptr[rows] != static_cast<int64_t>(entries)) {
    return absl::InvalidArgumentError(absl::StrCat("index.col_ptr must run from 0 to ", entries));
  }
  for (size_t c = 0; c < rows; ++c) {
    if (index.col_ptr[c + 1] < index.col_ptr[c]) {
      return absl::InvalidArgumentError(
          absl::StrCat("index.col_ptr[", c + 1, "] is below index.col_ptr[", c, "]"));
    }
  }
  // Walk every row; each entry must be found next in its column's CSC list.
  std::vector<int64_t> next(index.col_ptr.begin(), index.col_ptr.end() - 1);
  for (int s = 0; s < index.sequences(); ++s) {
    for (int h = 0; h < index.heads; ++h) {
      for (int32_t i = 0; i < index.blocks(s); ++i) {
        const int64_t r = index.RowId(s, h, i);
        if (index.row_ptr[r + 1] < index.row_ptr[r]) {
          return absl::InvalidArgumentError(
              absl::StrCat("index.row_ptr[", r + 1, "] is below index.row_ptr[", r, "]"));
        }
        // Only the ends of row_ptr are checked above: a row in between must stay inside the
        // entries before it is walked.
        if (index.row_ptr[r] < 0 || index.row_ptr[r + 1] > static_cast<int64_t>(entries)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "index.row_ptr[", r, "..", r + 1, "]=[", index.row_ptr[r], ", ", index.row_ptr[r + 1],
              ") is outside the ", entries, " entries of index.col_idx"));
        }
        int32_t previous = -1;
        for (int64_t e = index.row_ptr[r]; e < index.row_ptr[r + 1]; ++e) {
          const int32_t j = index.col_idx[e];
          if (j <= previous || j > i) {
            return absl::InvalidArgumentError(
                absl::StrCat("index.col_idx[", e, "]=", j, " (row ", r, ", query block ", i,
                             ") must be ascending and in [0, ", i, "]"));
          }
          previous = j;
          if (index.flags[e] != FlagOf(index.length(s), index.block_size, i, j)) {
            return absl::InvalidArgumentError(
                absl::StrCat("index.flags[", e, "]=", int{index.flags[e]}, " is wrong for query",
                             " block ", i, ", key block ", j));
          }
          const int64_t c = index.RowId(s, h, j);
          const int64_t slot = next[c]++;
          if (slot >= index.col_ptr[c + 1] || index.row_idx[slot] != i ||
              index.col_flags[slot] != index.flags[e]) {
            return absl::InvalidArgumentError(absl::StrCat(
                "index CSC column ", c, " is not the transpose of the CSR at row ", r));
          }
        }
      }
    }
  }
  for (size_t c = 0; c < rows; ++c) {
    if (next[c] != index.col_ptr[c + 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("index CSC column ", c, " holds entries that no CSR row has"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kernels
}  // namespace sparsebalance
