// How a query block chooses its key blocks beyond the anchors (kernels/block_selection.h), as
// the planner's job config (planner/types.h) and the kernels agree on it.
//
//   kTopK:   the best-scoring blocks up to the density's budget k_i (KeptBlocks).
//   kAnchor: anchor-guided thresholding: only blocks whose pooled score is at least
//            log(anchor_threshold) below the best anchor's (sink block 0, the diagonal and the
//            local blocks), best first, still at most k_i: never more blocks than top-k.
#ifndef SPARSEBALANCE_CONTRACT_SELECTION_MODE_H_
#define SPARSEBALANCE_CONTRACT_SELECTION_MODE_H_

namespace sparsebalance {

enum class SelectionMode {
  kTopK,
  kAnchor,
};

// tau of kAnchor, in (0, 1]: a block is kept when its estimated weight (exp of its pooled
// score) is at least tau times the best anchor's.
inline constexpr double kDefaultAnchorThreshold = 0.05;

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_CONTRACT_SELECTION_MODE_H_
