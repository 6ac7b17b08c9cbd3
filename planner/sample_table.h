// What planning reads of every sample that a step does not change: its recall exponent under
// the job's recall model, its density floor, its default density and the recall there, and the
// terms of its attention price. PlanStep builds one table per step and every phase reads it
// (AllocateDensities, TuneDensities, BuildPlan and the recall guards), instead of each phase
// computing them again: with a learned model every sample has its own exponent, and each
// recall costs a DetLog and a DetExp, a dozen times per sample and step before the table.
//
//   const SampleTable table(batch, config, model, recall);
//   double g = table[i].exponent;
#ifndef SPARSEBALANCE_PLANNER_SAMPLE_TABLE_H_
#define SPARSEBALANCE_PLANNER_SAMPLE_TABLE_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "planner/det_math.h"
#include "planner/latency_model.h"
#include "planner/recall_model.h"
#include "planner/thread_scratch.h"
#include "planner/types.h"

namespace sparsebalance {

class PlanThreads;

// Highest density the tuner's logarithms use where density_max is 1: the recall slope vanishes
// at 1, so the multiplier that reaches exactly 1 is 0 (log -inf).
inline constexpr double kAlmostDense = 1.0 - 1e-9;

// log(1 - min(rho, kAlmostDense)) (det_math.h).
inline double LogOneMinus(double rho) { return DetLog(1.0 - std::min(rho, kAlmostDense)); }

struct SampleTerms {
  double exponent = 0.0;  // g: RecallModel::SampleExponent
  // The lowest density DST may give the sample: its sensitivity's floor, raised to the density
  // that keeps the document recall floor (where density_max reaches it). May exceed `base`.
  double floor = 0.0;
  double log_floor = 0.0;  // LogOneMinus(floor)
  // What every policy gives it without tuning: BaseDensity, raised to the document recall
  // floor's density (where density_max reaches it).
  double base = 0.0;
  double log_base = 0.0;     // LogOneMinus(base)
  double base_recall = 0.0;  // RecallAt(exponent, base)
  // log(per_block x query-block triangle / (tokens x g)): where the tuner's multiplier for the
  // sample sits (sparsity_tuner.cc).
  double price_offset = 0.0;
  // The sample's documents (one unless it is pre-packed): [doc_begin, doc_end) of the table's
  // document arrays (SampleTable::doc_rows).
  int doc_begin = 0;
  int doc_end = 0;
};

class SampleTable {
 public:
  // With `threads`, the samples' terms are worked out on them (plan_threads.h).
  SampleTable(const std::vector<Sample>& batch, const PlannerConfig& config,
              const LatencyModel& model, const RecallModel& recall, PlanThreads* threads = nullptr);
  SampleTable(const SampleTable&) = delete;
  SampleTable& operator=(const SampleTable&) = delete;
  const SampleTerms& operator[](size_t i) const { return terms_[i]; }
  size_t size() const { return size_; }
  // Sample i's predicted recall at density rho: RecallAt(exponent, rho), known at its base. The
  // last other answer per sample is kept: the recall guards and the plan's figures all ask for
  // the tuned densities' recalls, a DetLog and a DetExp each. Not thread-safe (see FeaturesAt).
  double Recall(size_t i, double rho) const {
    const SampleTerms& t = terms_[i];
    return rho == t.base ? t.base_recall : KeptRecall(i, rho, t.exponent);
  }
  // The same answer, the base, its recall and the exponent read from compact copies (8 bytes a
  // sample each) instead of the 64-byte terms: for the passes over the whole batch in order
  // (the recall guards'), which read nothing else of the terms and were mostly waiting for them.
  double RecallInOrder(size_t i, double rho) const {
    return rho == bases_[i] ? base_recalls_[i] : KeptRecall(i, rho, exponents_[i]);
  }
  // Asks Recall(i, densities[i]) for every sample, on `threads` (each sample's memo from its
  // own thread), so that the serial sums that follow (the recall guards') find them kept.
  void WarmRecalls(const std::vector<double>& densities, PlanThreads* threads) const;
  // The same for the samples [begin, end) alone, on the calling thread: a range of a loop that
  // runs beside other work (PlanStep runs it beside the placement's deal, ParallelBeside).
  void WarmRecalls(const std::vector<double>& densities, size_t begin, size_t end) const;
  // Per document of the batch, sample by sample (SampleTerms::doc_begin): its query blocks
  // (QueryBlocks), tokens and length bucket (RecallBucket). The tuner reads them for every
  // sample in each of its passes.
  const int64_t* doc_rows() const { return doc_rows_; }
  const int64_t* doc_tokens() const { return doc_tokens_; }
  const int* doc_buckets() const { return doc_buckets_; }
  // Sample i's documents, [first, second) of those arrays (SampleTerms::doc_begin, doc_end).
  // Where no sample is pre-packed, document i is sample i's: known without reading its terms,
  // which passes that need nothing else of them then leave alone.
  std::pair<int, int> Documents(size_t i) const {
    if (one_document_each_) return {static_cast<int>(i), static_cast<int>(i) + 1};
    return {terms_[i].doc_begin, terms_[i].doc_end};
  }
  // Sample i's tokens (Sample::length, which its documents' add up to: ValidateBatch), from the
  // document arrays: a pass over the batch in order reads 8 bytes a sample instead of a Sample.
  int64_t Tokens(size_t i) const {
    const auto [first, last] = Documents(i);
    int64_t tokens = 0;
    for (int d = first; d < last; ++d) tokens += doc_tokens_[d];
    return tokens;
  }
  // Every sample's base density (SampleTerms::base), in batch order.
  std::vector<double> BaseDensities() const;
  // LatencyModel::SampleFeatures of sample i (`sample`, batch[i]) at density rho. The last
  // answer per sample is kept: placement, the tuner's rank times at base and the plan's
  // figures all count a sample's blocks at the same density, and counting them
  // (ActiveBlocks) cost a sixth of planning. Not thread-safe (one table per PlanStep call).
  // Inline, so that a kept count is read without a call.
  MicroBatchFeatures FeaturesAt(const Sample& sample, size_t i, double rho) const {
    MicroBatchFeatures f;
    f.active_blocks = ActiveBlocksAt(i, rho);
    f.tokens = static_cast<double>(sample.length);
    f.documents = sample.segments.empty() ? 1.0 : static_cast<double>(sample.segments.size());
    return f;
  }
  // Its active blocks alone: the tuner's exact counts ask for every item of a rank at each
  // solve. They are counted from the table's document arrays, not from the Sample (waiting for
  // it, scattered in placement order, was most of the count's time).
  double ActiveBlocksAt(size_t i, double rho) const {
    const Memo& memo = blocks_[i];
    return memo.density == rho ? memo.value : CountActiveBlocks(i, rho);
  }
  // Ask the CPU to fetch what Recall(i, rho) reads of sample i off its base (its terms' base and
  // recall there, and its kept answer: PrefetchRecall), or what ActiveBlocksAt(i, ..) reads
  // (its kept count: PrefetchBlocks), for walks over the samples in an order other than the
  // batch's (the tuner's). Hints: results do not change.
  // Always inlined: GCC finds a function that only prefetches pure, and drops a call to it whose
  // (void) result is unused, so a prefetch in a function inlined late is never issued.
  __attribute__((always_inline)) void PrefetchRecall(size_t i) const {
    __builtin_prefetch(&terms_[i].base);
    __builtin_prefetch(&recalls_[i]);
  }
  __attribute__((always_inline)) void PrefetchBlocks(size_t i) const {
    __builtin_prefetch(&blocks_[i]);
  }

 private:
  // A per-sample answer kept for the density it was asked at (NaN: none yet).
  struct Memo {
    double density;
    double value;
  };
  // The table's arrays. They live in the thread's Storage kept between steps when it is free
  // (ThreadScratch; the usual case: one table per PlanStep), and only grow: at 65,536 samples
  // allocating and clearing 5 MB anew was a quarter of the table's time on two threads, on one
  // thread alone. Every entry below size_ is written when the table is built.
  struct Storage {
    std::vector<SampleTerms> terms;
    std::vector<double> bases;
    std::vector<double> base_recalls;
    std::vector<double> exponents;
    std::vector<Memo> recalls;
    std::vector<Memo> blocks;
    std::vector<int64_t> doc_rows;
    std::vector<int64_t> doc_tokens;
    std::vector<int> doc_buckets;
  };
  // Recall(i, rho) off the sample's base (its exponent `exponent`): the kept answer, or worked
  // out and kept.
  double KeptRecall(size_t i, double rho, double exponent) const {
    Memo& memo = recalls_[i];
    if (!(memo.density == rho)) memo = {rho, RecallAt(exponent, rho)};
    return memo.value;
  }
  // Counts sample i's active blocks at rho and keeps the count.
  double CountActiveBlocks(size_t i, double rho) const;
  ThreadScratch<Storage> storage_;
  size_t size_ = 0;
  SampleTerms* terms_ = nullptr;
  double* bases_ = nullptr;          // per sample, SampleTerms::base
  double* base_recalls_ = nullptr;   // base_recall
  double* exponents_ = nullptr;      // and exponent
  mutable Memo* recalls_ = nullptr;  // per sample, the last Recall off its base
  int local_blocks_ = 0;
  bool one_document_each_ = false;  // no sample is pre-packed (Documents)
  mutable Memo* blocks_ = nullptr;  // per sample, the last FeaturesAt's active blocks
  int64_t* doc_rows_ = nullptr;
  int64_t* doc_tokens_ = nullptr;
  int* doc_buckets_ = nullptr;
};

// Samples ahead whose data the walks in placement order (the tuner's, BuildPlan's: rank by rank
// and micro-batch by micro-batch) ask the CPU to fetch.
inline constexpr size_t kFetchAhead = 12;

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_SAMPLE_TABLE_H_
