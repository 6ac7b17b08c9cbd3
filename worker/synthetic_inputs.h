// Attention inputs for sb-worker, generated deterministically from a document's id so that
// every run (and every rank that might run the document) sees the same tensors, with the
// structure real attention has, so that recall depends on which blocks are kept:
//   - a sink: token 0's key lines up with every query of its head;
//   - locality: queries and keys share a slowly drifting direction, so nearby keys score high;
//   - retrieval: a few far-back "needle" positions per head whose keys match the queries of a
//     few later positions (distant tokens that matter).
// The rest is Gaussian noise. Tensors are fp32 [tokens, heads, head_dim] (the kernels' layout).
//
//   DocumentTensors doc = MakeDocument(/*id=*/42, /*length=*/4096, /*heads=*/2, /*head_dim=*/64);
#ifndef SPARSEBALANCE_WORKER_SYNTHETIC_INPUTS_H_
#define SPARSEBALANCE_WORKER_SYNTHETIC_INPUTS_H_

#include <cstdint>
#include <vector>

namespace sparsebalance {

struct DocumentTensors {
  std::vector<float> q, k, v;  // [length, heads, head_dim]
  // The needle queries' positions, kRetrievalsPerHead per head, head by head (none below 4
  // tokens): rows whose mass sits on one far-back key (sb-selection-compare measures them).
  std::vector<int64_t> needle_queries;
};

// Needle positions per head: `retrievals` keys in the first half of the document, each
// matched by the queries of one position in the second half.
inline constexpr int kRetrievalsPerHead = 4;

DocumentTensors MakeDocument(uint64_t id, int64_t length, int heads, int head_dim);

// Appends documents into one varlen batch (cu_seqlens prefix sums, tensors concatenated).
struct VarlenBatch {
  std::vector<int32_t> cu_seqlens{0};
  std::vector<float> q, k, v;
  void Append(const DocumentTensors& doc, int64_t length);
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_WORKER_SYNTHETIC_INPUTS_H_
