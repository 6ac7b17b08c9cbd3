#include "kernels/recall_probe.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/block_selection.h"
#include "kernels/parallel.h"

namespace sparsebalance {
namespace kernels {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Whether CSR row r keeps every causal key block of its query block.
bool RowIsFull(const BlockIndex& index, int64_t r, int32_t query_block) {
  return index.row_ptr[r + 1] - index.row_ptr[r] == int64_t{query_block} + 1;
}

// Per head, the keys the probe computes for row t of document s: none when every head keeps
// every causal block of the row (recall 1 exactly), else the t + 1 causal keys of each head
// that does not.
double RowCost(const BlockIndex& index, int s, int32_t t) {
  const int32_t block = t / index.block_size;
  int partial_heads = 0;
  for (int h = 0; h < index.heads; ++h) {
    if (!RowIsFull(index, index.RowId(s, h, block), block)) ++partial_heads;
  }
  return static_cast<double>(partial_heads) * (int64_t{t} + 1) / index.heads;
}

// fp32 dot product with independent partial sums (vectorisable without reassociation flags).
float Dot(const float* a, const float* b, int n) {
  constexpr int kLanes = 8;
  float acc[kLanes] = {};
  int d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[d + l] * b[d + l];
  }
  float sum = 0.0f;
  for (; d < n; ++d) sum += a[d] * b[d];
  for (float x : acc) sum += x;
  return sum;
}

}  // namespace

absl::Status ValidateRecallSampling(const RecallSampling& sampling) {
  if (sampling.rows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("recall rows=", sampling.rows, " must be at least 1"));
  }
  if (sampling.last_rows < 1 || sampling.last_rows > sampling.rows) {
    return absl::InvalidArgumentError(absl::StrCat("recall last_rows=", sampling.last_rows,
                                                   " is outside [1, rows=", sampling.rows, "]"));
  }
  if (!(sampling.max_pair_share > 0.0) || !std::isfinite(sampling.max_pair_share)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "recall max_pair_share=", sampling.max_pair_share, " must be a positive share"));
  }
  return absl::OkStatus();
}

double KeptPairsPerHead(const BlockIndex& index, int document) {
  const int32_t length = index.length(document);
  double pairs = 0.0;
  for (int h = 0; h < index.heads; ++h) {
    for (int32_t i = 0; i < index.blocks(document); ++i) {
      const int64_t r = index.RowId(document, h, i);
      for (int64_t e = index.row_ptr[r]; e < index.row_ptr[r + 1]; ++e) {
        pairs += VisiblePairs(length, index.block_size, i, index.col_idx[e]);
      }
    }
  }
  return pairs / index.heads;
}

RecallRows SampleRecallRows(const BlockIndex& index, absl::Span<const uint64_t> seeds,
                            const RecallSampling& sampling) {
  RecallRows out;
  for (int s = 0; s < index.sequences(); ++s) {
    const int32_t length = index.length(s);
    const int32_t last = std::min<int32_t>(sampling.last_rows, length);
    const int32_t most = std::max(last, std::min<int32_t>(sampling.rows, length));
    const int32_t rest = length - last;  // positions [0, rest) are stratified
    const double budget = sampling.max_pair_share * KeptPairsPerHead(index, s);
    std::vector<int32_t> picked;
    for (int32_t count = most; count > last; --count) {
      const int32_t strata = count - last;  // <= rest, so no stratum is empty
      picked.clear();
      double cost = 0.0;
      for (int32_t j = 0; j < strata; ++j) {
        const int64_t lo = int64_t{j} * rest / strata;
        const int64_t hi = int64_t{j + 1} * rest / strata;
        const uint64_t draw = SplitMix64(seeds[s] ^ SplitMix64((uint64_t{1} << 32) * strata + j));
        const int32_t t = static_cast<int32_t>(lo + static_cast<int64_t>(draw % (hi - lo)));
        picked.push_back(t);
        cost += RowCost(index, s, t);
      }
      if (cost <= budget) break;
      picked.clear();
    }
    for (int32_t t = length - last; t < length; ++t) picked.push_back(t);
    out.rows.insert(out.rows.end(), picked.begin(), picked.end());  // ascending by construction
    out.offsets.push_back(static_cast<int64_t>(out.rows.size()));
  }
  return out;
}

absl::Status ValidateRecallRows(const BlockIndex& index, const RecallRows& rows) {
  if (rows.offsets.size() != static_cast<size_t>(index.sequences()) + 1) {
    return absl::InvalidArgumentError(absl::StrCat("recall rows: offsets has ", rows.offsets.size(),
                                                   " entries; expected ", index.sequences() + 1,
                                                   " (documents + 1)"));
  }
  if (rows.offsets.front() != 0 || rows.offsets.back() != static_cast<int64_t>(rows.rows.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("recall rows: offsets run from ", rows.offsets.front(), " to ",
                     rows.offsets.back(), "; expected 0 to ", rows.rows.size(), " (the rows)"));
  }
  for (int s = 0; s < index.sequences(); ++s) {
    if (rows.offsets[s + 1] < rows.offsets[s]) {
      return absl::InvalidArgumentError(
          absl::StrCat("recall rows: offsets[", s + 1, "] is below offsets[", s, "]"));
    }
    for (int64_t e = rows.offsets[s]; e < rows.offsets[s + 1]; ++e) {
      const int32_t t = rows.rows[e];
      if (t < 0 || t >= index.length(s) || (e > rows.offsets[s] && t <= rows.rows[e - 1])) {
        return absl::InvalidArgumentError(
            absl::StrCat("recall rows: rows[", e, "]=", t, " of document ", s,
                         " is not ascending within [0, ", index.length(s), ")"));
      }
    }
  }
  return absl::OkStatus();
}

RecallProbe SummarizeProbe(const RecallRows& rows, int heads, absl::Span<const double> per_head) {
  RecallProbe probe;
  probe.row_recall.resize(rows.rows.size());
  probe.document_recall.assign(rows.documents(), 1.0);
  for (int s = 0; s < rows.documents(); ++s) {
    double sum = 0.0;
    for (int64_t e = rows.offsets[s]; e < rows.offsets[s + 1]; ++e) {
      double row = 0.0;
      for (int h = 0; h < heads; ++h) row += per_head[e * heads + h];
      probe.row_recall[e] = row / heads;
      sum += probe.row_recall[e];
    }
    if (rows.count(s) > 0) probe.document_recall[s] = std::clamp(sum / rows.count(s), 0.0, 1.0);
  }
  return probe;
}

absl::StatusOr<RecallProbe> ProbeRecall(const BlockIndex& index, int head_dim,
                                        absl::Span<const float> q, absl::Span<const float> k,
                                        const RecallRows& rows, float softmax_scale, int threads) {
  if (absl::Status s = ValidateBlockIndex(index); !s.ok()) return s;
  if (absl::Status s = ValidateHeadDim(head_dim); !s.ok()) return s;
  if (absl::Status s = ValidateRecallRows(index, rows); !s.ok()) return s;
  if (absl::Status s = ValidateThreads(threads); !s.ok()) return s;
  const int heads = index.heads;
  const size_t elements = static_cast<size_t>(index.total_tokens()) * heads * head_dim;
  if (absl::Status s = CheckSize("q", q.size(), elements); !s.ok()) return s;
  if (absl::Status s = CheckSize("k", k.size(), elements); !s.ok()) return s;
  if (!(softmax_scale >= 0.0f) || !std::isfinite(softmax_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "softmax_scale=", softmax_scale, " must be positive (or 0 for 1/sqrt(head_dim))"));
  }
  const float scale =
      softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int block_size = index.block_size;
  const int64_t row_stride = int64_t{heads} * head_dim;
  // recall of (sampled row e, head h) at e * heads + h.
  std::vector<double> per_head(rows.rows.size() * heads, 1.0);
  ParallelFor(int64_t{index.sequences()} * heads, threads, [&](int, int64_t task) {
    const int s = static_cast<int>(task / heads);
    const int h = static_cast<int>(task % heads);
    const int64_t base = int64_t{index.cu_seqlens[s]} * row_stride + int64_t{h} * head_dim;
    std::vector<float> logits;
    std::vector<char> kept(index.blocks(s));
    for (int64_t e = rows.offsets[s]; e < rows.offsets[s + 1]; ++e) {
      const int32_t t = rows.rows[e];
      const int32_t block = t / block_size;
      const int64_t r = index.RowId(s, h, block);
      if (RowIsFull(index, r, block)) continue;  // every causal key kept: recall 1 exactly
      std::fill(kept.begin(), kept.begin() + block + 1, 0);
      for (int64_t c = index.row_ptr[r]; c < index.row_ptr[r + 1]; ++c) kept[index.col_idx[c]] = 1;
      logits.resize(static_cast<size_t>(t) + 1);
      const float* query = &q[base + t * row_stride];
      float max_logit = -INFINITY;
      for (int32_t u = 0; u <= t; ++u) {
        logits[u] = Dot(query, &k[base + u * row_stride], head_dim) * scale;
        max_logit = std::max(max_logit, logits[u]);
      }
      double total = 0.0;
      double inside = 0.0;
      for (int32_t u = 0; u <= t; ++u) {
        const double p = std::exp(static_cast<double>(logits[u]) - max_logit);
        total += p;
        if (kept[u / block_size]) inside += p;
      }
      per_head[e * heads + h] = std::clamp(inside / total, 0.0, 1.0);
    }
  });
  return SummarizeProbe(rows, heads, per_head);
}

}  // namespace kernels
}  // namespace sparsebalance
