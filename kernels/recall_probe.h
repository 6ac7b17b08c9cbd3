// The recall probe: the TRUE share of softmax mass that block-sparse attention keeps, measured
// on a few sampled query rows per document rather than estimated from the pooled block scores
// that chose the blocks (block_selection.h), which cannot see a single key that carries a
// row's mass. For each sampled row the full causal row over its document is computed (fp32 dot
// products, fp64 softmax with max subtraction) and the mass inside the row's kept blocks
// summed; a document's recall is the mean over its sampled rows and the heads.
//
// Sampling (SampleRecallRows) is deterministic in a per-document seed, always takes the
// document's last rows (where a retrieval's answer sits), stratifies the others over the
// document and stays within a cost budget relative to the attention's own work.
//
//   RecallRows rows = SampleRecallRows(index, seeds, RecallSampling{});
//   absl::StatusOr<RecallProbe> probe = ProbeRecall(index, head_dim, q, k, rows);
//   // probe->document_recall[s]: mean kept mass of document s over rows->rows(s) rows.
#ifndef SPARSEBALANCE_KERNELS_RECALL_PROBE_H_
#define SPARSEBALANCE_KERNELS_RECALL_PROBE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/block_index.h"

namespace sparsebalance {
namespace kernels {

struct RecallSampling {
  int rows = 8;       // query rows per document (fewer when it is shorter); >= 1
  int last_rows = 1;  // the document's last rows, always among them; in [1, rows]
  // Cost bound: per head, the (query, key) pairs the probe computes for a document's rows
  // beyond its last ones stay within this share of the (query, key) pairs its kept blocks
  // hold (the attention's work); rows are dropped (fewer strata) until they fit. A row whose
  // every causal block is kept costs nothing: its recall is 1 exactly. Positive (above 1
  // lets the probe outgrow the attention: tests).
  double max_pair_share = 0.05;
};

absl::Status ValidateRecallSampling(const RecallSampling& sampling);

// Sampled query rows, CSR over documents: document s's rows are
// rows[offsets[s] .. offsets[s + 1]), token positions within the document, ascending.
struct RecallRows {
  std::vector<int64_t> offsets{0};
  std::vector<int32_t> rows;
  int documents() const { return static_cast<int>(offsets.size()) - 1; }
  int count(int document) const {
    return static_cast<int>(offsets[document + 1] - offsets[document]);
  }
};

// The rows of document s: its last min(last_rows, length) rows, then one row drawn uniformly
// (from `seeds[s]`) in each of R - last equal strata of the rest, with R the largest count in
// [last, min(rows, length)] whose rows fit the budget. Same index, seeds and sampling: same
// rows. `seeds` has one entry per document of `index` (checked by the caller).
RecallRows SampleRecallRows(const BlockIndex& index, absl::Span<const uint64_t> seeds,
                            const RecallSampling& sampling);

// Per head, the (query, key) pairs inside document s's kept blocks: the attention's work that
// the budget is relative to.
double KeptPairsPerHead(const BlockIndex& index, int document);

struct RecallProbe {
  std::vector<double> document_recall;  // per document: mean over its rows and the heads
  std::vector<double> row_recall;       // per sampled row (RecallRows order): mean over heads
};

// The exact kept softmax mass of every sampled row, for every head. q and k are fp32
// [total_tokens, heads, head_dim]; softmax_scale 0 means 1/sqrt(head_dim). A document with no
// sampled rows gets recall 1 (nothing measured: callers sample at least one). Parallel over
// (document, head) on `threads` (0: the hardware concurrency).
absl::StatusOr<RecallProbe> ProbeRecall(const BlockIndex& index, int head_dim,
                                        absl::Span<const float> q, absl::Span<const float> k,
                                        const RecallRows& rows, float softmax_scale = 0.0f,
                                        int threads = 1);

// The per-(row, head) recalls (`per_head[e * heads + h]`) of `rows` summed up into a
// RecallProbe; shared by the CPU and CUDA probes.
RecallProbe SummarizeProbe(const RecallRows& rows, int heads, absl::Span<const double> per_head);

// Checks `rows` against `index`: one CSR entry per document, rows ascending, inside their
// document. Errors name the field and index.
absl::Status ValidateRecallRows(const BlockIndex& index, const RecallRows& rows);

}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_RECALL_PROBE_H_
