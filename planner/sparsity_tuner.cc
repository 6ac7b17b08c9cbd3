#include "planner/sparsity_tuner.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <type_traits>
#include <utility>
#include <vector>

#include "contract/step_figures.h"
#include "planner/det_math.h"
#include "planner/recall_model.h"
#include "planner/sample_table.h"

namespace sparsebalance {
namespace {

constexpr int kMaxSolverIterations = 60;
// Items whose exponentials are taken at once (DetExpAll), in a buffer on the stack.
constexpr size_t kBatch = 256;
// Ranks whose estimated time is within this share of the largest are recounted exactly.
constexpr double kNearMaxShare = 0.01;
// Solves per rank at most, each correcting the continuous estimate by the exact block count.
constexpr int kExactPasses = 4;
// Recall AllocateDensities keeps above its base (token-weighted, absolute), and never more
// than a tenth of the recall still missing (near 1 any margin would force dense attention).
constexpr double kAllocationRecallMargin = 1e-3;
// The recall guard's search over the target (TuneDensities): at most this many solves, ending
// once its bracket is this share of its first width.
constexpr int kRecallGuardIterations = 10;
constexpr double kRecallGuardResolution = 1.0 / 256.0;
// A cut that could shorten the step by less than this share of its makespan at base is not
// made: the plan only raises (the target is the base makespan, which keeps the recall).
// Placement often balances a step to within a few hundredths of a percent; the recall guard's
// search over so narrow a bracket took four to six solves, about three quarters of the tune
// phase in sb-load's 1,024-rank round, to win at most that share of the step, well inside the
// latency model's error. The same holds where the slowest rank's floors bound the target.
constexpr double kMinCutShare = 1e-3;
// Rounds of the per-bucket guard: each raises the weight of the buckets still below their
// minimum recall (x4), after which the buckets still below take back part of their cuts.
constexpr int kTuneGuardRounds = 1;
constexpr double kBucketWeightGrowth = 4.0;
// Raised ranks stop kNoiseMarginZ typical model errors below the target, at most
// kMaxNoiseMargin of it.
constexpr double kNoiseMarginZ = 1.0;
constexpr double kMaxNoiseMargin = 0.2;
// The exact search of a rank's multiplier x (Tuner::SolveRank) ends once its bracket is this
// narrow relative to max(1, |x|). Across it densities move by under the density quantum (2^-16)
// for recall exponents g of 1.25 and up (the prior's range; d rho / dx = (1 - rho) / (g - 1)),
// so no exact count can change inside; for flatter curves it ends a little further under the
// budget, never over. Several documents' counts often jump at one x, leaving no x within a
// block of the budget; at 1e-12 the search then spent some forty evaluations closing in on it.
constexpr double kExactSearchWidth = 1e-7;
// Relative precision of a rank's time budget in the per-rank solve.
constexpr double kBudgetTolerance = 1e-6;
// A rank's exact time over its budget by at most this share of it is rounding (the budget and
// the blocks' price are summed in other orders), not over.
constexpr double kRoundingShare = 1e-12;
// Absolute precision of the token-weighted recall in the step-level allocation.
constexpr double kRecallTolerance = 1e-6;

// One step of the safeguarded Newton searches below, for a root of a monotone function with
// value f and slope `derivative` at *x, bracketed by [a, b]: moves *x by Newton's step when the
// slope is negative and the step lands strictly inside the bracket, else to the midpoint.
// False (and *x unchanged) once the bracket is narrower than 1e-12 relative to max(1, |scale|).
bool NewtonStep(double f, double derivative, double a, double b, double scale, double* x) {
  double next = derivative < 0 ? *x - f / derivative : 0.5 * (a + b);
  if (!(next > a && next < b)) next = 0.5 * (a + b);
  if (b - a <= 1e-12 * std::max(1.0, std::fabs(scale))) return false;
  *x = next;
  return true;
}

// LogOneMinus(rho) where it is known without a DetLog: the table's for the sample's base or
// floor, `log_max` for density_max; false where it must be worked out (the callers do that
// in batches through DetLogAll).
bool KnownLogOneMinus(const SampleTerms& terms, double rho, double density_max, double log_max,
                      double* log) {
  if (rho == terms.base) {
    *log = terms.log_base;
  } else if (rho == terms.floor) {
    *log = terms.log_floor;
  } else if (rho == density_max) {
    *log = log_max;
  } else {
    return false;
  }
  return true;
}

// What the solves read of an item: 64 bytes (its tokens and the price's offset without bucket
// weights, which only SetBucketWeights reads, are in ItemRecallTerms and the table). The set-up
// writes every item and the rank passes read them back: at 88 bytes an item that was a quarter
// more memory traffic. 1 / (g - 1) is worked out where an item sits off its bounds (InvG1): kept,
// it made an item 72 bytes.
struct Item {
  double floor = 0.0;      // lowest density allowed
  double base = 0.0;       // density without tuning
  double g_minus_1 = 0.0;  // recall exponent - 1
  double log_floor = 0.0;  // log(1 - floor)
  double log_base = 0.0;   // log(1 - base)
  // log(per_block * tri / (weight * g)) (SampleTerms::price_offset), less the log of the item's
  // bucket weight (the per-bucket guard's multipliers): where the multiplier sits.
  double offset = 0.0;
  int index = 0;      // into the batch
  int doc_begin = 0;  // its sample's documents in the table's document arrays
  int doc_end = 0;

  double InvG1() const { return 1.0 / g_minus_1; }
};

// A range of one of the tuner's flat arrays: a rank's items (ItemRange), the tuner's ranks.
template <typename T>
class Range {
 public:
  Range() = default;
  Range(const T* begin, const T* end) : begin_(begin), end_(end) {}
  const T* begin() const { return begin_; }
  const T* end() const { return end_; }
  size_t size() const { return static_cast<size_t>(end_ - begin_); }
  bool empty() const { return begin_ == end_; }
  const T& operator[](size_t k) const { return begin_[k]; }

 private:
  const T* begin_ = nullptr;
  const T* end_ = nullptr;
};
using ItemRange = Range<Item>;

struct RankWork {
  double speed = 1.0;
  double fixed = 0.0;  // seconds (speed excluded) that do not depend on density
  ItemRange items;
  // The multiplier x of the rank's last solve (NaN before the first): the next solve starts
  // there. The recall guard solves every rank again for a dozen nearby targets, and the exact
  // passes for budgets a few blocks apart; from the last root Newton needs two or three steps
  // where the bracket's midpoint needs six or more. Only the search's path depends on it: a
  // solve ends within the same tolerance of its root from any start.
  mutable double last_x = std::numeric_limits<double>::quiet_NaN();
  // The rank's surrogate blocks with every item at its upper ([lower][0]) or lower ([lower][1])
  // bound, for a cut (lower) or a raise; NaN until a solve needs them. They do not depend on
  // the budget or the bucket weights, and every solve of the rank checks them.
  mutable double bound_blocks[2][2] = {
      {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::quiet_NaN()},
      {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::quiet_NaN()}};
};

// An item's share of BucketRecall's sums: its token-weighted recall and its document's length
// bucket, or with several documents its recall and bucket -1 (each document's share is added
// from the table's arrays).
struct BucketShare {
  double recall;
  int bucket;
};

// What the recall sums (Tuner::Recall, BucketRecall) read of an item, apart from its Item: 40
// bytes where an Item is 88. They stream over every item, and reading whole Items (7 MB at
// 65,536 samples) was most of their time on two threads.
struct ItemRecallTerms {
  int index = 0;      // into the batch
  int doc_begin = 0;  // its sample's documents in the table's document arrays
  int doc_end = 0;
  // The length bucket of its document, or -1 where it has several: BucketRecall needs the
  // documents' tokens and buckets then only (the item's weight is its one document's tokens).
  // Read from the table's arrays in placement order there, they were two of its three cache
  // misses per item; the set-up reads the bucket beside the tokens.
  int bucket = -1;
  double weight = 0.0;  // tokens
  // The item's predicted recall at the density it was last asked at (Tuner::ItemRecall; NaN:
  // none yet).
  double kept_density = std::numeric_limits<double>::quiet_NaN();
  double kept_recall = 0.0;
};

// Sample i's TunerSample at density `base`, from the table (its document arrays `doc_tokens` and
// `doc_buckets`), but for its log_base (and its log_floor where its floor is its base) where
// KnownLogOneMinus does not know them: false then, for LogBatch to work them out. Inlined: the
// set-up without records calls it per item, where a call (its record through memory) made the
// tune phase 0.7 ms slower on one thread at 65,536 samples.
__attribute__((always_inline)) inline bool FillSample(const SampleTable& table, size_t i,
                                                      double base, double density_max,
                                                      double log_max, const int64_t* doc_tokens,
                                                      const int* doc_buckets, TunerSample* sample) {
  const SampleTerms& terms = table[i];
  // The sample's length, from its documents' tokens (they sum to it): reading it from the
  // Sample was another cache miss per item, two thirds of the set-up's time.
  int64_t tokens = 0;
  for (int d = terms.doc_begin; d < terms.doc_end; ++d) tokens += doc_tokens[d];
  sample->weight = static_cast<double>(tokens);
  sample->doc_begin = terms.doc_begin;
  sample->doc_end_or_bucket =
      terms.doc_end - terms.doc_begin == 1 ? ~doc_buckets[terms.doc_begin] : terms.doc_end;
  sample->g_minus_1 = terms.exponent - 1.0;
  sample->offset = terms.price_offset;
  sample->base = base;
  const bool known = KnownLogOneMinus(terms, base, density_max, log_max, &sample->log_base);
  // Never above base: a sample whose floor is above what it was given stays there (and takes
  // the base's logarithm, set with it where it is worked out).
  if (terms.floor < base) {
    sample->floor = terms.floor;
    sample->log_floor = terms.log_floor;
  } else {
    sample->floor = base;
    sample->log_floor = sample->log_base;
  }
  return known;
}

// LogOneMinus of the bases of records (TunerSample or Item) that FillSample left without it,
// kBatch at a time through DetLogAll, each set in its record (and as its log_floor where its
// floor is its base). WorkOut() at the end works out those left.
template <typename Record>
class LogBatch {
 public:
  LogBatch() = default;
  LogBatch(const LogBatch&) = delete;
  LogBatch& operator=(const LogBatch&) = delete;
  void Add(Record* record) {
    records_[count_] = record;
    logs_[count_++] = 1.0 - std::min(record->base, kAlmostDense);  // as LogOneMinus
    if (count_ == kBatch) WorkOut();
  }
  void WorkOut() {
    if (count_ == 0) return;
    DetLogAll(logs_.data(), logs_.data(), count_);
    for (size_t q = 0; q < count_; ++q) {
      Record& record = *records_[q];
      record.log_base = logs_[q];
      if (record.floor == record.base) record.log_floor = record.log_base;
    }
    count_ = 0;
  }

 private:
  std::array<double, kBatch> logs_;  // LogOneMinus's arguments, then its values
  std::array<Record*, kBatch> records_;
  size_t count_ = 0;
};

// A serial sum over the items of a ParallelChunks loop, made while the loop runs: each range
// publishes how far its summands are in place, and whichever thread finds the next items in
// item order in place adds them (and those in place after them), unless another thread is
// adding, which then finds them too. The adds are the serial loop's, in its order, whatever the
// threads. Run after the loops instead, the step allocation's sums were a fifth of it on two
// threads.
class OrderedSum {
 public:
  // For ParallelChunks(threads, n, ...), split into `chunks` ranges (ChunkCount).
  OrderedSum(size_t n, size_t chunks) : n_(n), chunks_(chunks), ready_(chunks) {
    for (size_t c = 0; c < chunks; ++c) ready_[c].store(c * n / chunks);
  }
  // Range `chunk`'s items [begin, end) are worked out, their summands in a buffer of the calling
  // thread: added from there by add_own() where they are next in item order and no other thread
  // is adding (on one thread, always), else put in place by store() for add(from, to), which
  // adds those of items [from, to) from their place. Either runs on one thread at a time.
  template <typename AddOwn, typename Store, typename Add>
  void Offer(size_t chunk, size_t begin, size_t end, const AddOwn& add_own, const Store& store,
             const Add& add) {
    if (!adding_.exchange(true)) {
      if (next_ == begin) {
        add_own();
        next_ = end;
      } else {
        store();
      }
      ready_[chunk].store(end);
      Drain(add);
      return;
    }
    store();
    ready_[chunk].store(end);
    if (!adding_.exchange(true)) Drain(add);
  }

 private:
  // Holding adding_: adds what is in place next in order, and again while a range published more
  // while it did (and no other thread took over).
  template <typename Add>
  void Drain(const Add& add) {
    for (;;) {
      size_t at = next_;
      size_t c = chunk_;
      for (; c < chunks_; ++c) {
        const size_t ready = ready_[c].load();
        if (at < ready) {
          add(at, ready);
          at = ready;
        }
        if (at < (c + 1) * n_ / chunks_) break;  // range c not done yet
      }
      next_ = at;
      chunk_ = c;
      adding_.store(false);
      // A range that published after this thread looked left its items to it: look again.
      if (c == chunks_ || ready_[c].load() <= at || adding_.exchange(true)) return;
    }
  }

  const size_t n_;
  const size_t chunks_;
  std::vector<std::atomic<size_t>> ready_;  // per range, the end of its summands in place
  std::atomic<bool> adding_{false};
  size_t next_ = 0;   // the first item not added (under adding_)
  size_t chunk_ = 0;  // its range
};

// The tuner's large arrays, kept per thread between calls: fresh pages cost more than the
// tuning itself at 65,536 samples (a page fault per 4 KiB), and every call overwrites what
// it uses, so nothing carries over but capacity. The per-item scratch arrays only grow
// (Scratch): a vector resized up again zero-fills what it had shrunk away, serially.
struct TunerStorage {
  std::vector<Item> items;
  std::vector<ItemRecallTerms> recall_terms;  // per item, as `items`
  std::vector<double> weighted;  // Recall's weighted recalls put in place (OrderedSum), per item
  std::vector<BucketShare> bucket_shares;  // BucketRecall's, as `weighted`
  std::vector<int> order;                  // the items' samples (Tuner::Tuner)
  // Per rank: its work, and where its items start (one more entry: the items' end).
  std::vector<RankWork> ranks;
  std::vector<size_t> first_item;
};

// `v` with room for n entries, grown (never shrunk) so that its first n are not rewritten.
template <typename T>
T* Scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

class Tuner {
 public:
  // With `threads`, the items are built and the ranks solved on them (plan_threads.h).
  // With `samples`, the items are built from their samples' records there (TunerSamples).
  Tuner(const std::vector<Sample>& batch, const Assignment& assignment, const PlannerConfig& config,
        const LatencyModel& model, const SampleTable& table, const std::vector<double>& base,
        PlanThreads* threads = nullptr, const TunerSamples* samples = nullptr);
  Tuner(const Tuner&) = delete;
  Tuner& operator=(const Tuner&) = delete;

  // Densities for the target makespan `target` (seconds), given each rank's time at base
  // (`at_base`, blocks counted exactly). With `cut` false no rank is lowered.
  std::vector<double> Solve(double target, const std::vector<double>& at_base, bool cut) const;
  // Token-weighted recall of the items at `densities`, and with `bucket_recall` BucketRecall's
  // figures in the same pass: the bucket guard asks for them right after, and a second pass over
  // the items cost about 0.15 ms on two threads at 65,536 samples.
  double Recall(const std::vector<double>& densities,
                std::array<double, kRecallBuckets>* bucket_recall = nullptr) const;
  // Item k's predicted recall at density rho: the table's, which keeps it (the plan's figures
  // ask again at the same densities), and the item keeps it too, in item order: the bucket guard
  // asks again right after Recall, and reading the table's (its sample's terms, then its kept
  // answer, scattered over the batch) stalled on every item, most of BucketRecall's time. From
  // one thread per item, as its sample's kept answers require.
  double ItemRecall(size_t k, double rho) const {
    ItemRecallTerms& item = recall_terms_[k];
    if (!(item.kept_density == rho)) {
      item.kept_density = rho;
      item.kept_recall = table_.Recall(static_cast<size_t>(item.index), rho);
    }
    return item.kept_recall;
  }
  // Token-weighted recall per length bucket (0 for a bucket without documents).
  std::array<double, kRecallBuckets> BucketRecall(const std::vector<double>& densities) const;
  // Weights the recall of bucket b by 1 + extra[b] in the trade-off against time: the
  // multipliers of the per-bucket guard's constraints.
  void SetBucketWeights(const std::array<double, kRecallBuckets>& extra);
  // Whether a sample has a document in one of `buckets`.
  bool InBuckets(const Item& item, const std::vector<int>& buckets) const;
  ItemRange items() const { return ItemRange(items_, items_ + item_count_); }
  // Predicted rank time at each item's base (or floor) density.
  double RankSeconds(const RankWork& rank, bool at_floor) const;
  // The same with the blocks counted exactly.
  double ExactRankSeconds(const RankWork& rank, bool at_floor) const;

  Range<RankWork> ranks() const { return Range<RankWork>(ranks_, ranks_ + rank_count_); }

  // What the walks over a rank's items read of their samples, which lie scattered over the batch:
  // their documents' query blocks (RankSeconds and the solves' estimates) and the table's kept
  // counts (ExactRankSeconds, ExactBlocks). The table counts blocks from its own arrays
  // (SampleTable::ActiveBlocksAt): fetching the samples too only took fill buffers from these.
  enum Fetch : unsigned { kRows = 1, kCounts = 2 };
  // Asks the CPU to fetch them for `rank`: the rank after the one walked, or for its exact
  // counts the rank being solved (they come after its first solve). At 65,536 samples waiting
  // for them was most of ExactRankSeconds' time and half of SolveRank's. A hint: results do not
  // change.
  void Prefetch(const RankWork& rank, unsigned what) const;
  // Asks the CPU to fetch the items of `rank` themselves, two ranks ahead of the walk: Prefetch,
  // a rank ahead, reads them, and then waited on them (the walks read the items in bursts of a
  // rank, which the hardware's prefetcher did not run ahead of). A hint, as Prefetch.
  void PrefetchItems(const RankWork& rank) const;

 private:
  // Per item of the rank being solved: its bounds and the multipliers x at which it reaches
  // them (x_hi: at or below, the upper bound; x_lo: at or above, the lower one), so the search
  // skips exp() there; and the multiplier at and above which every item of the rank sits at its
  // lower bound. One solve's scratch: each thread that solves ranks has its own, kept so that a
  // solve does not allocate.
  struct Bounds {
    double lo, hi, x_hi, x_lo;
  };
  struct SolveScratch {
    std::vector<Bounds> bounds;
    double x_max = 0.0;
  };

  // Recall's and BucketRecall's pass over the items: the token-weighted recall (returned, with
  // kTotal) and the per-bucket recalls (in *bucket_recall, with kBuckets), summed in item order.
  template <bool kTotal, bool kBuckets>
  double RecallSums(const std::vector<double>& densities,
                    std::array<double, kRecallBuckets>* bucket_recall) const;
  // EstimatedActiveBlocks with the job's anchors: what the solves work on (the exact count is
  // used for the plan's figures). Its derivative in rho goes to `slope`.
  double SurrogateBlocks(int64_t rows, double rho, double* slope) const;
  double ItemBlocks(const Item& item, double rho, double* slope) const;
  // Densities of one rank's items whose exact attention time fits `budget` seconds (speed
  // excluded), when the bounds allow.
  void SolveRank(const RankWork& rank, double budget, bool lower, SolveScratch& scratch,
                 std::vector<double>* densities) const;
  // Returns the multiplier x it settled on (see DensityAt).
  double SolveRankOnce(const RankWork& rank, double budget, bool lower, SolveScratch& scratch,
                       std::vector<double>* densities) const;
  // After SolveRankOnce of `rank` (the scratch is the rank's): the density of its k-th item at
  // multiplier e^x, and every item's.
  double DensityAt(const RankWork& rank, const SolveScratch& scratch, size_t k, double x) const;
  void DensitiesAt(const RankWork& rank, const SolveScratch& scratch, double x,
                   std::vector<double>* densities) const;
  // Exact active blocks of a rank's items at `densities` (what the plan will count).
  double ExactBlocks(const RankWork& rank, const std::vector<double>& densities) const;

  const PlannerConfig& config_;
  // Active blocks are counted through it (SampleTable::FeaturesAt keeps the last count).
  const SampleTable& table_;
  const std::vector<double>& base_;
  PlanThreads* threads_ = nullptr;
  double total_weight_ = 0.0;  // tokens of every item, summed in item order
  double per_block_ = 0.0;
  double anchors_ = 0.0;
  double log_max_ = 0.0;       // log(1 - density_max)
  double noise_margin_ = 0.0;  // share of the target that raised ranks leave free
  // This tuner's ranks: the first rank_count_ of storage_->ranks, which only grows (Scratch).
  RankWork* ranks_ = nullptr;
  size_t rank_count_ = 0;
  // This tuner's items: the first item_count_ of storage_->items, which only grows (Scratch).
  Item* items_ = nullptr;
  ItemRecallTerms* recall_terms_ = nullptr;  // the same items' (storage_->recall_terms)
  size_t item_count_ = 0;
  // Items live in a per-thread TunerStorage when it is free (the usual case), else in `own_`;
  // `storage_` points at the one in use.
  ThreadScratch<TunerStorage> storage_;
  // The table's document arrays (SampleTable::doc_rows), which the items' doc_begin index.
  const int64_t* docs_ = nullptr;  // query blocks
  const int64_t* doc_tokens_ = nullptr;
  const int* doc_buckets_ = nullptr;  // recall_model.h's length buckets
};

Tuner::Tuner(const std::vector<Sample>& batch, const Assignment& assignment,
             const PlannerConfig& config, const LatencyModel& model, const SampleTable& table,
             const std::vector<double>& base, PlanThreads* threads, const TunerSamples* samples)
    : config_(config),
      table_(table),
      base_(base),
      threads_(threads),
      storage_(batch.size()),
      docs_(table.doc_rows()),
      doc_tokens_(table.doc_tokens()),
      doc_buckets_(table.doc_buckets()) {
  const CostCoefficients coef = model.coefficients();
  per_block_ = coef.per_block;
  anchors_ = config.shape.local_blocks + 2.0;
  log_max_ = LogOneMinus(config.density_max);
  noise_margin_ = std::min(kNoiseMarginZ * model.rank_error_sd(), kMaxNoiseMargin);
  rank_count_ = assignment.ranks.size();
  ranks_ = Scratch(storage_->ranks, rank_count_);  // each rank is set in the loop below
  // Items in the order of the placed samples, rank by rank and micro-batch by micro-batch; a
  // rank's items start at first_item[r]. The samples are gathered rank by rank on the threads: a
  // serial copy of the placed order was 0.1 ms of the set-up at 65,536 samples, with the helper
  // thread idle. So are the ranks' item counts, summed after: with the ranks' work set up front
  // (a vector of 4,096), their serial count (reading every rank's micro-batch lists, scattered
  // over the heap) was 0.07 ms of it.
  size_t* const first_item = Scratch(storage_->first_item, rank_count_ + 1);
  first_item[0] = 0;
  ParallelFor(threads_, rank_count_, [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r) {
      size_t count = 0;
      for (const std::vector<int>& micro_batch : assignment.ranks[r]) count += micro_batch.size();
      first_item[r + 1] = count;
    }
  });
  for (size_t r = 0; r < rank_count_; ++r) first_item[r + 1] += first_item[r];
  item_count_ = first_item[rank_count_];
  int* const order = Scratch(storage_->order, item_count_);
  items_ = Scratch(storage_->items, item_count_);
  Item* const items = items_;
  recall_terms_ = Scratch(storage_->recall_terms, item_count_);
  // Each rank's items from its samples and its seconds that do not depend on density, in one loop
  // over the ranks on the threads: in three (the samples gathered, the items built in ranges of
  // items, the ranks' sums) they took 1.3 ms on two threads at 65,536 samples, two of the loops
  // waiting on their helper and the sums reading each item's fixed seconds back. The tokens of
  // the items: whole numbers, summed exactly in any order (as integers).
  std::atomic<int64_t> total_tokens{0};
  ParallelFor(threads_, assignment.ranks.size(), [&](size_t begin, size_t end) {
    // The range's samples in item order first, so that each can be fetched ahead.
    int* next = order + first_item[begin];
    for (size_t r = begin; r < end; ++r) {
      for (const std::vector<int>& micro_batch : assignment.ranks[r]) {
        next = std::copy(micro_batch.begin(), micro_batch.end(), next);
      }
    }
    const size_t last = first_item[end];
    LogBatch<Item> logs;  // the items' logarithms that FillSample leaves
    int64_t tokens = 0;
    // The loop compiled for each source of the items: with both in one, the table's path was
    // 0.7 ms slower on one thread at 65,536 samples than on its own.
    auto build = [&](auto with_records) {
      size_t k = first_item[begin];
      for (size_t r = begin; r < end; ++r) {
        RankWork& rank = ranks_[r];
        rank = RankWork();  // it may hold an earlier call's
        rank.items = ItemRange(items + first_item[r], items + first_item[r + 1]);
        rank.speed =
            r < static_cast<size_t>(model.ranks()) ? model.speed_factor(static_cast<int>(r)) : 1.0;
        // The rank's fixed seconds, summed in a local: in rank.fixed every add waited for the
        // last one's store (the items' stores may alias it, for all the compiler knows).
        double fixed = 0.0;
        for (const std::vector<int>& micro_batch : assignment.ranks[r]) {
          if (!micro_batch.empty()) fixed += coef.per_micro_batch;
          for (size_t j = 0; j < micro_batch.size(); ++j, ++k) {
            const int i = order[k];
            // The samples lie scattered over the batch. With their records, each is one cache line,
            // fetched ahead. Else their terms (two cache lines) and base are fetched ahead, and
            // their documents' tokens half as far ahead, where the terms that say where they are
            // (for a pre-packed sample) have come. Without the tokens fetched the set-up waited on
            // them for two thirds of its time, after the terms.
            TunerSample from_table;
            const TunerSample* sample = &from_table;
            bool log_known = true;
            if constexpr (decltype(with_records)::value) {
              if (k + kFetchAhead < last) __builtin_prefetch(&(*samples)[order[k + kFetchAhead]]);
              sample = &(*samples)[i];
            } else {
              if (k + kFetchAhead < last) {
                const int ahead = order[k + kFetchAhead];
                __builtin_prefetch(&table[ahead]);
                __builtin_prefetch(&table[ahead].doc_end);
                __builtin_prefetch(&base[ahead]);
              }
              if (k + kFetchAhead / 2 < last) {
                const int d = table.Documents(order[k + kFetchAhead / 2]).first;
                __builtin_prefetch(&doc_tokens_[d]);
                __builtin_prefetch(&doc_buckets_[d]);
              }
              log_known = FillSample(table, i, base[i], config.density_max, log_max_, doc_tokens_,
                                     doc_buckets_, &from_table);
            }
            const int doc_end = sample->doc_end();
            const double weight = sample->weight;
            tokens += static_cast<int64_t>(weight);  // whole numbers: exact
            const double documents = static_cast<double>(doc_end - sample->doc_begin);
            fixed += coef.per_token * weight + coef.per_sample * documents;
            items[k] = {sample->floor,
                        sample->base,
                        sample->g_minus_1,
                        sample->log_floor,
                        sample->log_base,
                        sample->offset,
                        i,
                        sample->doc_begin,
                        doc_end};
            if (!log_known) logs.Add(&items[k]);
            // Its recall is read when asked (ItemRecall): at base the table keeps it, PlanStep's
            // recall guards have just worked it out (SampleTable::WarmRecalls), and most items
            // leave their base.
            recall_terms_[k] = {i,       sample->doc_begin,
                                doc_end, sample->bucket(),
                                weight,  std::numeric_limits<double>::quiet_NaN(),
                                0.0};
          }
        }
        rank.fixed = fixed;
      }
    };
    if (samples != nullptr) {
      build(std::true_type{});
    } else {
      build(std::false_type{});
    }
    logs.WorkOut();
    total_tokens.fetch_add(tokens);
  });
  total_weight_ = static_cast<double>(total_tokens.load());
  // Shards of split documents keep their density: fixed work on each rank of their group, and
  // the overhead of a micro-batch that holds nothing else.
  std::set<std::pair<int, int>> shard_only;  // (rank, micro-batch) holding shards alone
  for (const ShardedDocument& d : assignment.shards) {
    const Sample& s = batch[d.sample];
    for (size_t j = 0; j < d.group.size(); ++j) {
      const int r = d.group[j];
      RankWork& rank = ranks_[r];
      rank.fixed += ShardSeconds(model, s.length, d.cuts[j], d.cuts[j + 1], base[d.sample]);
      if (assignment.ranks[r][d.micro_batch].empty() &&
          shard_only.insert({r, d.micro_batch}).second) {
        rank.fixed += coef.per_micro_batch;
      }
    }
  }
}

double Tuner::SurrogateBlocks(int64_t rows, double rho, double* slope) const {
  return EstimatedActiveBlocks(rows, rho, anchors_, slope);
}

void Tuner::PrefetchItems(const RankWork& rank) const {
  if (rank.items.empty()) return;
  // Every cache line the items touch: one a line's width apart from the first byte, and the
  // last byte's line, which that stride may step over.
  constexpr size_t kLine = 64;
  const auto* const first = reinterpret_cast<const char*>(rank.items.begin());
  const size_t bytes = rank.items.size() * sizeof(Item);
  for (size_t offset = 0; offset < bytes; offset += kLine) __builtin_prefetch(first + offset);
  __builtin_prefetch(first + bytes - 1);
}

void Tuner::Prefetch(const RankWork& rank, unsigned what) const {
  for (const Item& item : rank.items) {
    if (what & kRows) __builtin_prefetch(&docs_[item.doc_begin]);
    if (what & kCounts) table_.PrefetchBlocks(static_cast<size_t>(item.index));
  }
}

double Tuner::ItemBlocks(const Item& item, double rho, double* slope) const {
  double blocks = 0.0;
  double total_slope = 0.0;
  for (int d = item.doc_begin; d < item.doc_end; ++d) {
    double s = 0.0;
    blocks += SurrogateBlocks(docs_[d], rho, &s);
    total_slope += s;
  }
  if (slope != nullptr) *slope = total_slope;
  return blocks;
}

void Tuner::SolveRank(const RankWork& rank, double budget, bool lower, SolveScratch& scratch,
                      std::vector<double>* densities) const {
  // The search works on a continuous estimate of the active blocks; the plan counts them
  // exactly. Shrink the budget by any exact overshoot and solve again (once or twice at most:
  // the estimate is within a block per row).
  const auto over = [&] { return per_block_ * ExactBlocks(rank, *densities) - budget; };
  const double rounding = kRoundingShare * budget;
  Prefetch(rank, kCounts);  // read after the first solve, which hides the wait
  double target = budget;
  double x = 0.0;
  double excess = 0.0;
  for (int pass = 0; pass < kExactPasses; ++pass) {
    x = SolveRankOnce(rank, target, lower, scratch, densities);
    excess = over();
    if (excess <= rounding) return;
    // Overshoot a little: the exact count moves in whole blocks (half a block more, as the
    // search below aims: an excess of a hundredth of a block, corrected by itself, moved no
    // count and took all the passes).
    target -= 1.5 * excess + 0.5 * per_block_ + kBudgetTolerance * budget;
  }
  // Still over: each document's exact count jumps by whole blocks where the estimate is smooth,
  // and the corrections above can keep landing past a jump. The exact time only falls as x
  // grows, so search x between the last one tried (over) and x_max, where every item sits at
  // its lower bound: a raise's base densities, which fit, or a cut's floors, the most the rank
  // can cut (kept when even they are over). It stops within a block of the budget, or at a jump
  // of several blocks (kExactSearchWidth). (Before, a raised rank fell back to its base
  // densities and lost its whole raise.) The steps are regula falsi (Illinois) on the excess,
  // aimed at half a block under the budget: the exact count follows the smooth estimate within
  // a block per row, so it lands in a few evaluations where bisection took some twenty (each a
  // pass over the rank's items and their exact counts).
  const double band = per_block_ + kBudgetTolerance * budget;  // accepted: this far under
  const double aim = -0.5 * per_block_;
  double over_x = x;
  double over_g = excess - aim;  // > 0
  double fit_x = scratch.x_max;
  DensitiesAt(rank, scratch, fit_x, densities);
  const double at_max = over();
  if (at_max > rounding || at_max >= -band) return;  // over at best, or already close enough
  double fit_g = at_max - aim;                       // < 0
  int kept = 0;  // +1: the over end kept (the fit end moved) in a row; -1: the fit end kept
  for (int iter = 0; iter < kMaxSolverIterations; ++iter) {
    if (fit_x - over_x <= kExactSearchWidth * std::max(1.0, std::fabs(fit_x))) break;
    double mid = over_x + (fit_x - over_x) * over_g / (over_g - fit_g);
    if (!(mid > over_x && mid < fit_x)) mid = 0.5 * (over_x + fit_x);
    DensitiesAt(rank, scratch, mid, densities);
    const double e = over();
    if (e > rounding) {
      over_x = mid;
      over_g = e - aim;
      if (kept < 0) fit_g *= 0.5;
      kept = std::min(kept, 0) - 1;
      continue;
    }
    fit_x = mid;
    if (e >= -band) return;  // densities are at fit_x
    fit_g = e - aim;
    if (kept > 0) over_g *= 0.5;
    kept = std::max(kept, 0) + 1;
  }
  DensitiesAt(rank, scratch, fit_x, densities);
}

double Tuner::DensityAt(const RankWork& rank, const SolveScratch& scratch, size_t k,
                        double x) const {
  const Bounds& b = scratch.bounds[k];
  if (x <= b.x_hi) return b.hi;
  if (x >= b.x_lo) return b.lo;
  const Item& item = rank.items[k];
  return std::clamp(1.0 - DetExp((x + item.offset) * item.InvG1()), b.lo, b.hi);
}

void Tuner::DensitiesAt(const RankWork& rank, const SolveScratch& scratch, double x,
                        std::vector<double>* densities) const {
  for (size_t k = 0; k < rank.items.size(); ++k) {
    (*densities)[rank.items[k].index] = DensityAt(rank, scratch, k, x);
  }
}

double Tuner::ExactRankSeconds(const RankWork& rank, bool at_floor) const {
  double blocks = 0.0;
  for (const Item& item : rank.items) {
    blocks += table_.ActiveBlocksAt(item.index, at_floor ? item.floor : item.base);
  }
  return rank.speed * (rank.fixed + per_block_ * blocks);
}

double Tuner::ExactBlocks(const RankWork& rank, const std::vector<double>& densities) const {
  double blocks = 0.0;
  for (const Item& item : rank.items) {
    blocks += table_.ActiveBlocksAt(item.index, densities[item.index]);
  }
  return blocks;
}

double Tuner::SolveRankOnce(const RankWork& rank, double budget, bool lower, SolveScratch& scratch,
                            std::vector<double>* densities) const {
  const size_t n = rank.items.size();
  std::vector<Bounds>& bounds = scratch.bounds;
  bounds.resize(n);
  double x_min = 0.0;
  double x_max = 0.0;
  for (size_t k = 0; k < n; ++k) {
    const Item& item = rank.items[k];
    Bounds& b = bounds[k];
    b.lo = lower ? item.floor : item.base;
    b.hi = lower ? item.base : std::max(item.base, config_.density_max);
    const double log_lo = lower ? item.log_floor : item.log_base;
    const double log_hi = lower ? item.log_base : std::min(item.log_base, log_max_);
    b.x_hi = item.g_minus_1 * log_hi - item.offset;
    b.x_lo = item.g_minus_1 * log_lo - item.offset;
    x_min = k == 0 ? b.x_hi : std::min(x_min, b.x_hi);
    x_max = k == 0 ? b.x_lo : std::max(x_max, b.x_lo);
  }
  scratch.x_max = x_max;
  // The density of item k at multiplier e^x: stationarity of
  // weight * recall(rho) - e^x * price * rho gives (1 - rho)^(g-1) = e^(x + offset).
  auto excess = [&](double x, double* derivative) {
    double blocks = 0.0;
    double d = 0.0;
    for (size_t k = 0; k < n; ++k) {
      const Item& item = rank.items[k];
      const double rho = DensityAt(rank, scratch, k, x);
      double slope = 0.0;
      blocks += ItemBlocks(item, rho, &slope);
      if (rho > bounds[k].lo && rho < bounds[k].hi) d -= slope * (1.0 - rho) * item.InvG1();
    }
    if (derivative != nullptr) *derivative = per_block_ * d;
    return per_block_ * blocks - budget;
  };
  if (n == 0) return x_max;
  // excess(x_min) (at = 0: every item at its upper bound) or excess(x_max) (at = 1: at its
  // lower bound), summed as excess sums them, once per rank and direction.
  auto excess_at_bound = [&](int at) {
    double& blocks = rank.bound_blocks[lower ? 1 : 0][at];
    if (std::isnan(blocks)) {
      blocks = 0.0;
      for (size_t k = 0; k < n; ++k) {
        blocks += ItemBlocks(rank.items[k], at == 0 ? bounds[k].hi : bounds[k].lo, nullptr);
      }
    }
    return per_block_ * blocks - budget;
  };
  // Safeguarded Newton on the (decreasing) excess over the bracket [a, b]: bisect whenever a
  // step leaves it. At x_min every item sits at its upper bound, at x_max at its lower one;
  // when the one at x_min fits, or the one at x_max does not, that bound is the answer (the
  // best this rank can do). A warm start inside the bracket (last_x) is evaluated first, and
  // its sign says which of the two ends can be the answer.
  double a = x_min;
  double b = x_max;
  double x = 0.5 * (a + b);
  double f = 0.0;
  double derivative = 0.0;
  bool evaluated = false;  // f and derivative are those at x
  if (rank.last_x > a && rank.last_x < b) {
    x = rank.last_x;
    f = excess(x, &derivative);
    evaluated = true;
    if (f > 0 && excess_at_bound(1) >= 0) x = x_max;
    if (f <= 0 && excess_at_bound(0) <= 0) x = x_min;
  } else if (excess_at_bound(0) <= 0) {
    x = x_min;
  } else if (excess_at_bound(1) >= 0) {
    x = x_max;
  }
  if (x != x_min && x != x_max) {
    for (int iter = 0; iter < kMaxSolverIterations; ++iter) {
      if (!evaluated) f = excess(x, &derivative);
      evaluated = true;
      // Accepted: within the budget by at most its tolerance. Newton aims at the middle of
      // that band; aimed at the budget itself it converges from whichever side the curvature
      // puts it on, and from above it would end over the budget (then at b below, which can
      // be far from the root).
      if (f <= 0 && f >= -kBudgetTolerance * budget) break;
      if (f > 0) {
        a = x;
      } else {
        b = x;
      }
      if (!NewtonStep(f + 0.5 * kBudgetTolerance * budget, derivative, a, b, /*scale=*/x, &x)) {
        break;
      }
      evaluated = false;
    }
    // End on the feasible side so the rank does not overshoot its budget.
    if (!evaluated) f = excess(x, nullptr);
    if (f > 0) x = b;
    rank.last_x = x;
  }
  DensitiesAt(rank, scratch, x, densities);
  return x;
}

double Tuner::RankSeconds(const RankWork& rank, bool at_floor) const {
  double blocks = 0.0;
  for (const Item& item : rank.items) {
    blocks += ItemBlocks(item, at_floor ? item.floor : item.base, nullptr);
  }
  return rank.speed * (rank.fixed + per_block_ * blocks);
}

std::vector<double> Tuner::Solve(double target, const std::vector<double>& at_base,
                                 bool cut) const {
  std::vector<double> densities = base_;
  // Ranks that are raised stop short of the target by the model's typical error: a rank
  // raised exactly to T is as likely as not to finish after it, and with many ranks at T
  // the slowest of them sets a step time well above T.
  const double raise_to = target * (1.0 - noise_margin_);
  // Each rank writes only its own items' densities.
  ParallelFor(threads_, rank_count_, [&](size_t begin, size_t end) {
    SolveScratch scratch;
    for (size_t r = begin; r < end; ++r) {
      if (r + 2 < end) PrefetchItems(ranks_[r + 2]);
      if (r + 1 < end) Prefetch(ranks_[r + 1], kRows);
      const RankWork& rank = ranks_[r];
      if (rank.items.empty()) continue;
      const double now = at_base[r];
      if (now > target && cut) {
        SolveRank(rank, target / rank.speed - rank.fixed, /*lower=*/true, scratch, &densities);
      } else if (now < raise_to) {
        SolveRank(rank, raise_to / rank.speed - rank.fixed, /*lower=*/false, scratch, &densities);
      }
    }
  });
  return densities;
}

template <bool kTotal, bool kBuckets>
double Tuner::RecallSums(const std::vector<double>& densities,
                         std::array<double, kRecallBuckets>* bucket_recall) const {
  // The items of every rank in order (they are contiguous): their recalls (and each item's share
  // of the bucket sums: its recall, its documents' tokens and buckets, scattered over the batch)
  // on the threads, summed in item order as they come (OrderedSum). Summed after the loop, the
  // 65,536 dependent adds of each were a serial stretch of the tune phase with the helper idle
  // (0.05 to 0.1 ms each). The tokens are whole numbers, summed exactly in any order: per range,
  // as integers.
  const size_t n = item_count_;
  double* const weighted_recalls = Scratch(storage_->weighted, kTotal ? n : 0);
  BucketShare* const shares = Scratch(storage_->bucket_shares, kBuckets ? n : 0);
  const size_t chunks = ChunkCount(threads_, n);
  std::vector<std::array<int64_t, kRecallBuckets>> chunk_tokens(kBuckets ? chunks : 0);
  double total = 0.0;
  std::array<double, kRecallBuckets> weighted{};
  // Adds items [first, first + m), their summands in `recalls` and `share`.
  auto add = [&](const double* recalls, const BucketShare* share, size_t first, size_t m) {
    if constexpr (kTotal) {
      double sum = total;  // in a local while it adds: `recalls` might alias it
      for (size_t j = 0; j < m; ++j) sum += recalls[j];
      total = sum;
    }
    if constexpr (kBuckets) {
      std::array<double, kRecallBuckets> local = weighted;  // as `sum`
      for (size_t j = 0; j < m; ++j) {
        if (share[j].bucket >= 0) {
          local[share[j].bucket] += share[j].recall;
          continue;
        }
        const ItemRecallTerms& item = recall_terms_[first + j];
        for (int d = item.doc_begin; d < item.doc_end; ++d) {
          local[doc_buckets_[d]] += static_cast<double>(doc_tokens_[d]) * share[j].recall;
        }
      }
      weighted = local;
    }
  };
  OrderedSum sum(n, chunks);
  ParallelChunks(threads_, n, [&](size_t chunk, size_t begin, size_t end) {
    std::array<int64_t, kRecallBuckets> tokens{};
    std::array<double, kBatch> own_recalls;
    std::array<BucketShare, kBatch> own_shares;
    for (size_t first = begin; first < end; first += kBatch) {
      const size_t last = std::min(first + kBatch, end);
      for (size_t k = first; k < last; ++k) {
        // The densities and the table's answers lie scattered over the batch: fetched ahead, a
        // DetLog and a DetExp per item do not hide a wait for them. (Right after a Recall at the
        // same densities the items keep their answers: BucketRecall alone reads them there.)
        if (k + kFetchAhead < end) {
          const ItemRecallTerms& ahead = recall_terms_[k + kFetchAhead];
          __builtin_prefetch(&densities[ahead.index]);
          if constexpr (kTotal) table_.PrefetchRecall(static_cast<size_t>(ahead.index));
          if (kBuckets && ahead.bucket < 0) {
            __builtin_prefetch(&doc_tokens_[ahead.doc_begin]);
            __builtin_prefetch(&doc_buckets_[ahead.doc_begin]);
          }
        }
        const ItemRecallTerms& item = recall_terms_[k];
        const double recall = ItemRecall(k, densities[item.index]);
        const double item_weighted = item.weight * recall;
        if constexpr (kTotal) own_recalls[k - first] = item_weighted;
        if constexpr (kBuckets) {
          if (item.bucket >= 0) {
            // Its weight is its document's tokens, a whole number.
            tokens[item.bucket] += static_cast<int64_t>(item.weight);
            own_shares[k - first] = {item_weighted, item.bucket};
          } else {
            for (int d = item.doc_begin; d < item.doc_end; ++d) {
              tokens[doc_buckets_[d]] += doc_tokens_[d];
            }
            own_shares[k - first] = {recall, -1};
          }
        }
      }
      const size_t m = last - first;
      sum.Offer(
          chunk, first, last, [&] { add(own_recalls.data(), own_shares.data(), first, m); },
          [&] {
            if constexpr (kTotal) {
              std::copy(own_recalls.begin(), own_recalls.begin() + m, weighted_recalls + first);
            }
            if constexpr (kBuckets) {
              std::copy(own_shares.begin(), own_shares.begin() + m, shares + first);
            }
          },
          [&](size_t from, size_t to) {
            add(weighted_recalls + from, shares + from, from, to - from);
          });
    }
    if constexpr (kBuckets) chunk_tokens[chunk] = tokens;
  });
  if constexpr (kBuckets) {
    std::array<int64_t, kRecallBuckets> tokens{};
    for (const std::array<int64_t, kRecallBuckets>& part : chunk_tokens) {
      for (int b = 0; b < kRecallBuckets; ++b) tokens[b] += part[b];
    }
    for (int b = 0; b < kRecallBuckets; ++b) {
      (*bucket_recall)[b] = tokens[b] > 0 ? weighted[b] / static_cast<double>(tokens[b]) : 0.0;
    }
  }
  return total_weight_ > 0 ? total / total_weight_ : 0.0;
}

double Tuner::Recall(const std::vector<double>& densities,
                     std::array<double, kRecallBuckets>* bucket_recall) const {
  if (bucket_recall == nullptr) return RecallSums<true, false>(densities, nullptr);
  return RecallSums<true, true>(densities, bucket_recall);
}

std::array<double, kRecallBuckets> Tuner::BucketRecall(const std::vector<double>& densities) const {
  std::array<double, kRecallBuckets> recall;
  RecallSums<false, true>(densities, &recall);
  return recall;
}

// Buckets whose recall (BucketRecall's `recall`) is below `minimum` (entries < 0: unguarded).
std::vector<int> ViolatedBuckets(const std::array<double, kRecallBuckets>& recall,
                                 const std::vector<double>& minimum) {
  std::vector<int> violated;
  if (minimum.empty()) return violated;
  for (int b = 0; b < kRecallBuckets; ++b) {
    // The slack absorbs summation order, as in TuneDensities' token-weighted guard.
    if (minimum[b] >= 0 && recall[b] < minimum[b] - 1e-12) violated.push_back(b);
  }
  return violated;
}

void Tuner::SetBucketWeights(const std::array<double, kRecallBuckets>& extra) {
  for (size_t k = 0; k < item_count_; ++k) {
    Item& item = items_[k];
    double weighted = 0.0;
    for (int d = item.doc_begin; d < item.doc_end; ++d) {
      weighted += static_cast<double>(doc_tokens_[d]) * (1.0 + extra[doc_buckets_[d]]);
    }
    item.offset = table_[static_cast<size_t>(item.index)].price_offset -
                  DetLog(weighted / recall_terms_[k].weight);
  }
}

// The length bucket of sample i, or of most of its tokens when it is pre-packed, from the
// table's document buckets.
int MainBucket(const SampleTable& table, size_t i) {
  const auto [first, last] = table.Documents(i);
  if (last - first == 1) return table.doc_buckets()[first];
  std::array<int64_t, kRecallBuckets> tokens{};
  for (int d = first; d < last; ++d) tokens[table.doc_buckets()[d]] += table.doc_tokens()[d];
  return static_cast<int>(std::max_element(tokens.begin(), tokens.end()) - tokens.begin());
}

bool Tuner::InBuckets(const Item& item, const std::vector<int>& buckets) const {
  for (int d = item.doc_begin; d < item.doc_end; ++d) {
    if (std::find(buckets.begin(), buckets.end(), doc_buckets_[d]) != buckets.end()) return true;
  }
  return false;
}

// A solve's densities and, where its recall pass summed them beside its own, their per-bucket
// recalls (Tuner::BucketRecall's figures).
struct Tuned {
  std::vector<double> densities;
  std::optional<std::array<double, kRecallBuckets>> bucket_recall;
};

// The per-bucket guard around a solve (DESIGN.md section 11). While some length bucket's recall
// is below its minimum, that bucket's recall weighs more (x4 a round, the constraint's
// multiplier) and the solve runs again, for kBucketGuardIterations rounds. Then each bucket still
// below takes back part of its cuts: its samples below `base` move towards base by the least
// share that meets the minimum. `base` meets every minimum (the callers make sure of it) and a
// sample at or above base is not touched, so this always ends with every bucket guarded, and
// never above base where it changes anything.
// `tuned` is the solve's result, as solve() returns them.
template <typename Solve>
std::vector<double> GuardBuckets(Tuner& tuner, const std::vector<double>& minimum,
                                 const std::vector<double>& base, Tuned tuned, int rounds,
                                 const Solve& solve) {
  std::vector<double>& densities = tuned.densities;
  // The buckets below their minimum at `densities`: from the recalls the solve's recall pass
  // summed beside its own where it has them.
  auto violated_buckets = [&] {
    return ViolatedBuckets(
        tuned.bucket_recall ? *tuned.bucket_recall : tuner.BucketRecall(densities), minimum);
  };
  std::array<double, kRecallBuckets> extra{};
  for (int round = 0; round < rounds; ++round) {
    const std::vector<int> violated = violated_buckets();
    if (violated.empty()) return std::move(densities);
    for (int b : violated) extra[b] = extra[b] > 0 ? extra[b] * kBucketWeightGrowth : 1.0;
    tuner.SetBucketWeights(extra);
    tuned = solve();
  }
  for (int pass = 0; pass < kRecallBuckets; ++pass) {
    const std::vector<int> violated = violated_buckets();
    tuned.bucket_recall.reset();  // the densities change below
    if (violated.empty()) break;
    const int bucket = violated.front();
    const std::vector<int> only = {bucket};
    std::vector<int> cut;  // items of the bucket below base
    for (size_t k = 0; k < tuner.items().size(); ++k) {
      const Item& item = tuner.items()[k];
      if (densities[item.index] < base[item.index] && tuner.InBuckets(item, only)) {
        cut.push_back(static_cast<int>(k));
      }
    }
    const std::vector<double> cut_densities = densities;
    auto restore = [&](double share, std::vector<double>* out) {
      for (int k : cut) {
        const int i = tuner.items()[k].index;
        (*out)[i] = cut_densities[i] + share * (base[i] - cut_densities[i]);
      }
    };
    double lo = 0.0;  // share of the cut taken back that still violates
    double hi = 1.0;  // share that meets the minimum (all of it does)
    std::vector<double> trial = densities;
    for (int iter = 0; iter < kMaxSolverIterations && hi - lo > 1e-9; ++iter) {
      const double mid = 0.5 * (lo + hi);
      restore(mid, &trial);
      if (tuner.BucketRecall(trial)[bucket] >= minimum[bucket] - 1e-12) {
        hi = mid;
      } else {
        lo = mid;
      }
    }
    restore(hi, &densities);
  }
  return std::move(densities);
}

// AllocateDensities' search: per group of samples one multiplier e^x, found by a safeguarded
// Newton search on the group's token-weighted recall (a few evaluations, each over every item
// of the group). Its items are built straight from the table, every group's in one pass over
// the batch. What every evaluation reads, an array a term (structure of arrays), so that it
// works on several items at once (EvaluateRecalls):
struct RecallTerms {
  double* x_at_hi;  // at or below this x the item sits at density_max
  double* x_at_lo;  // at or above, at its floor
  // log(per_block * tri / (weight * g)): where the multiplier sits (SampleTerms::price_offset)
  double* offset;
  double* inv_g1;            // 1 / (g - 1)
  double* scale;             // e^offset
  double* weight;            // tokens
  double* weight_g_over_g1;  // weight * (g / (g - 1)), the slope's first product
  double* at_hi;             // weight * recall at density_max
  double* at_lo;             // weight * recall at the floor

  // The arrays of n items, in `storage` (grown as Scratch grows it).
  static RecallTerms In(std::vector<double>& storage, size_t n) {
    double* const p = Scratch(storage, 9 * n);
    return {p, p + n, p + 2 * n, p + 3 * n, p + 4 * n, p + 5 * n, p + 6 * n, p + 7 * n, p + 8 * n};
  }
};

// Item k's weighted recall and slope share (as EvaluateRecalls), `v` its e^((x + offset) / (g -
// 1)).
inline void EvaluateItem(const RecallTerms& t, size_t k, double x, double ex, double v,
                         double* recall, double* slope) {
  if (x <= t.x_at_hi[k]) {
    *recall = t.at_hi[k];
    *slope = 0.0;
  } else if (x >= t.x_at_lo[k]) {
    *recall = t.at_lo[k];
    *slope = 0.0;
  } else {
    const double pow_g_minus_1 = ex * t.scale[k];  // (1-rho)^(g-1)
    // d rho / dx = -(1-rho)/(g-1)
    *recall = t.weight[k] * (1.0 - v * pow_g_minus_1);
    *slope = t.weight_g_over_g1[k] * pow_g_minus_1 * v;
  }
}

// kLanes doubles (GCC vector extensions; as det_math.cc's kernels).
template <int kLanes>
struct Lanes {
  typedef double D __attribute__((vector_size(8 * kLanes)));
};

// Items [first, first + m) at multiplier e^x (ex = e^x): in one_minus[first, first + m) each
// one's e^((x + offset) / (g - 1)) (1 - rho off its bounds), in recall[0, m) its weighted
// recall and in slope[0, m) its share of the recall's slope (0 at a bound), kLanes items at a
// time: the same operations as EvaluateItem, lane by lane (the same bits), the bound tests as
// selects. One item at a time with branches, this was two thirds of an evaluation's
// instructions (about 46 an item beside its DetExp).
template <int kLanes>
__attribute__((always_inline)) inline void EvaluateLanes(const RecallTerms& t, size_t first,
                                                         size_t m, double x, double ex,
                                                         double* one_minus, double* recall,
                                                         double* slope) {
  using D = typename Lanes<kLanes>::D;
  double* const u = one_minus + first;
  size_t j = 0;
  for (; j + kLanes <= m; j += kLanes) {
    D offset, inv_g1;
    std::memcpy(&offset, t.offset + first + j, sizeof offset);
    std::memcpy(&inv_g1, t.inv_g1 + first + j, sizeof inv_g1);
    const D v = (x + offset) * inv_g1;
    std::memcpy(u + j, &v, sizeof v);
  }
  for (; j < m; ++j) u[j] = (x + t.offset[first + j]) * t.inv_g1[first + j];
  DetExpAll(u, u, m);
  D xs;
  for (int lane = 0; lane < kLanes; ++lane) xs[lane] = x;
  const D zero = {};
  for (j = 0; j + kLanes <= m; j += kLanes) {
    const size_t k = first + j;
    D v, scale, weight, weight_g, x_at_hi, x_at_lo, at_hi, at_lo;
    std::memcpy(&v, u + j, sizeof v);
    std::memcpy(&scale, t.scale + k, sizeof scale);
    std::memcpy(&weight, t.weight + k, sizeof weight);
    std::memcpy(&weight_g, t.weight_g_over_g1 + k, sizeof weight_g);
    std::memcpy(&x_at_hi, t.x_at_hi + k, sizeof x_at_hi);
    std::memcpy(&x_at_lo, t.x_at_lo + k, sizeof x_at_lo);
    std::memcpy(&at_hi, t.at_hi + k, sizeof at_hi);
    std::memcpy(&at_lo, t.at_lo + k, sizeof at_lo);
    const D pow_g_minus_1 = ex * scale;
    const D inner_recall = weight * (1.0 - v * pow_g_minus_1);
    const D inner_slope = weight_g * pow_g_minus_1 * v;
    const auto is_hi = xs <= x_at_hi;
    const auto is_lo = xs >= x_at_lo;
    const D r = is_hi ? at_hi : is_lo ? at_lo : inner_recall;
    const D s = (is_hi | is_lo) ? zero : inner_slope;
    std::memcpy(recall + j, &r, sizeof r);
    std::memcpy(slope + j, &s, sizeof s);
  }
  for (; j < m; ++j) EvaluateItem(t, first + j, x, ex, u[j], recall + j, slope + j);
}

void EvaluateRecallsBaseline(const RecallTerms& t, size_t first, size_t m, double x, double ex,
                             double* one_minus, double* recall, double* slope) {
  EvaluateLanes<2>(t, first, m, x, ex, one_minus, recall, slope);
}
#if defined(__x86_64__) || defined(__i386__)
// "avx2" does not enable FMA (det_math.cc): the same bits as the baseline version.
__attribute__((target("avx2"))) void EvaluateRecallsAvx2(const RecallTerms& t, size_t first,
                                                         size_t m, double x, double ex,
                                                         double* one_minus, double* recall,
                                                         double* slope) {
  EvaluateLanes<4>(t, first, m, x, ex, one_minus, recall, slope);
}
#endif

// EvaluateLanes with the widest vectors the CPU has.
void EvaluateRecalls(const RecallTerms& t, size_t first, size_t m, double x, double ex,
                     double* one_minus, double* recall, double* slope) {
#if defined(__x86_64__) || defined(__i386__)
  static const auto impl =
      __builtin_cpu_supports("avx2") ? EvaluateRecallsAvx2 : EvaluateRecallsBaseline;
#else
  static const auto impl = EvaluateRecallsBaseline;
#endif
  impl(t, first, m, x, ex, one_minus, recall, slope);
}
// What the densities at the answer read besides the term, once.
struct RecallOutput {
  double floor;  // lowest density allowed (never above base)
  int index;     // into the batch
};
// A sample's summands of its group's sums before the search, in batch order.
struct StartSummands {
  double weight;
  double start;        // weight * the item's multiplier at base
  double base_recall;  // weight * recall at base
};
// An item's weighted recalls at x_max and x_min at the first evaluation (NaN where it is off
// its bounds there).
struct BoundPart {
  double at_x_max;
  double at_x_min;
};

// The search's arrays, kept per thread between steps as the tuner's are (TunerStorage). Each
// group's items are a range of the item arrays, the groups one after another.
struct AllocationStorage {
  std::vector<uint8_t> group;           // per sample
  std::vector<StartSummands> summands;  // per sample
  std::vector<double> terms;            // RecallTerms' arrays
  std::vector<RecallOutput> outputs;
  // Per item, its weighted recall and slope at the multiplier evaluated, and at the first
  // evaluation its BoundPart, where put in place (OrderedSum).
  std::vector<double> part_recall;
  std::vector<double> part_slope;
  std::vector<BoundPart> bound_part;
  // Per item, e^((x + offset) / (g - 1)) at the last evaluation's x: 1 - rho where the item is
  // off its bounds, and what its density is clamped from at a bound.
  std::vector<double> one_minus;
};

// A group's items summed in item order before its search.
struct GroupSums {
  double tokens = 0.0;
  double start = 0.0;  // token-weighted multipliers at base
  double base = 0.0;   // weighted recalls at base
};

// One group's search: the densities in [floor, density_max] of items [begin, begin + count)
// with the least predicted attention time whose token-weighted recall is at least `target`
// (or the most recall there is), a safeguarded Newton search on the group's recall over its
// multiplier x. It asks for one evaluation at a time (Next), which SolveGroups runs for every
// group still searching in one pass over their items: one group after another, the 4 length
// buckets' searches took a dozen loops on the threads, each with its start and its tail.
class GroupSearch {
 public:
  // An evaluation asked for: the recall at x and its derivative, and with at_bounds the recalls
  // at x_max and x_min, where every item sits at a bound (the first evaluation).
  struct Ask {
    double x;
    bool at_bounds;
  };
  // Its answer: the token-weighted recall, its derivative in x, and at_bounds[0] and [1] the
  // weighted recalls at x_max and x_min (NaN where an item is off its bounds there).
  struct Answer {
    double recall;
    double derivative;
    double at_bounds[2];
  };

  // `x_min` and `x_max` are the least x_at_hi and the greatest x_at_lo of the group's items.
  GroupSearch(size_t begin, size_t count, double target, double x_min, double x_max,
              const GroupSums& sums)
      : begin_(begin), count_(count), target_(target), x_min_(x_min), x_max_(x_max) {
    tokens_ = sums.tokens;
    // Newton starts where the bulk of the tokens would sit at their base densities: the answer
    // keeps about their recall, so Newton begins close. It is evaluated there first, whether the
    // search runs or not (it mostly does), with the recalls at x_min and x_max, where every
    // item sits at a bound, in the same pass.
    const double x_first = std::clamp(sums.start / tokens_, x_min, x_max);
    x_start_ = x_first == x_min || x_first == x_max ? 0.5 * (x_min + x_max) : x_first;
    ask_ = {x_start_, /*at_bounds=*/true};
  }

  size_t begin() const { return begin_; }
  size_t count() const { return count_; }
  double tokens() const { return tokens_; }
  double x_min() const { return x_min_; }
  double x_max() const { return x_max_; }
  // The evaluation the search waits for; none once it is done.
  const Ask* Next() const { return stage_ == kDone ? nullptr : &ask_; }
  // Takes the answer to Next().
  void Take(const Answer& answer) {
    searched_ = ask_.x;
    switch (stage_) {
      case kFirst:
        first_recall_ = answer.recall;
        first_derivative_ = answer.derivative;
        at_bounds_[0] = answer.at_bounds[0];
        at_bounds_[1] = answer.at_bounds[1];
        AtMax();
        break;
      case kAtMax:
        FromMax(answer.recall);
        break;
      case kAtMin:
        FromMin(answer.recall);
        break;
      case kNewton:
        Newton(answer.recall, answer.derivative);
        break;
      case kDone:
        break;
    }
  }
  // Once done: the multiplier it settled on, the recall there, and whether the last evaluation
  // was there (one_minus holds the items' values at it).
  double x() const { return x_; }
  double recall() const { return recall_; }
  bool kept() const { return searched_ == x_; }

 private:
  enum Stage { kFirst, kAtMax, kAtMin, kNewton, kDone };

  // The recall at x_max or x_min from the first evaluation's bound sums, unless an item is off
  // its bounds there (a NaN bound): then evaluated in full.
  void AtMax() {
    if (std::isnan(at_bounds_[0])) {
      Evaluate(kAtMax, x_max_);
    } else {
      FromMax(at_bounds_[0] / tokens_);
    }
  }
  void FromMax(double recall) {
    if (recall >= target_) {
      Finish(x_max_, recall);  // every item at its floor already keeps the recall
    } else if (std::isnan(at_bounds_[1])) {
      Evaluate(kAtMin, x_min_);
    } else {
      FromMin(at_bounds_[1] / tokens_);
    }
  }
  void FromMin(double recall) {
    if (recall < target_) {
      Finish(x_min_, recall);  // unreachable: everything at density_max is the best there is
      return;
    }
    // Safeguarded Newton on the monotone recall (bisection when a step leaves the bracket);
    // ends on the side that keeps the recall.
    a_ = x_min_;  // recall(a) >= target
    b_ = x_max_;  // recall(b) < target
    recall_a_ = recall;
    x_ = x_start_;
    iter_ = 0;
    // The first evaluation's, unless a full evaluation at a bound came since.
    if (searched_ == x_) {
      Newton(first_recall_, first_derivative_);
    } else {
      Evaluate(kNewton, x_);
    }
  }
  void Newton(double r, double derivative) {
    const double f = r - target_;
    if (f >= 0) {
      a_ = x_;
      recall_a_ = r;
      if (f < kRecallTolerance) return Finish(a_, recall_a_);
    } else {
      b_ = x_;
    }
    // Newton aims at the middle of the accepted band [target, target + tolerance]: aimed at
    // the target itself, it approaches from whichever side the curvature puts it on, and
    // from below it never lands in the band (it took eight or nine steps where two do).
    if (!NewtonStep(r - (target_ + 0.5 * kRecallTolerance), derivative, a_, b_, /*scale=*/a_,
                    &x_) ||
        ++iter_ == kMaxSolverIterations) {
      return Finish(a_, recall_a_);
    }
    Evaluate(kNewton, x_);
  }
  void Evaluate(Stage stage, double x) {
    stage_ = stage;
    ask_ = {x, /*at_bounds=*/false};
  }
  void Finish(double x, double recall) {
    stage_ = kDone;
    x_ = x;
    recall_ = recall;
  }

  size_t begin_;
  size_t count_;
  double target_;
  double x_min_;
  double x_max_;
  double tokens_ = 0.0;
  double x_start_ = 0.0;
  Stage stage_ = kFirst;
  Ask ask_ = {0.0, false};
  double searched_ = std::numeric_limits<double>::quiet_NaN();  // the last multiplier evaluated
  double first_recall_ = 0.0;
  double first_derivative_ = 0.0;
  double at_bounds_[2] = {0.0, 0.0};
  double a_ = 0.0;
  double b_ = 0.0;
  double recall_a_ = 0.0;
  int iter_ = 0;
  double x_ = 0.0;
  double recall_ = 0.0;
};

// Runs the searches to their ends, each round evaluating every group that asks in one pass over
// their items (a loop on the threads over their ranges one after another).
void SolveGroups(AllocationStorage& st, const RecallTerms& terms,
                 std::vector<GroupSearch>& searches, PlanThreads* threads) {
  double* const part_recall = st.part_recall.data();
  double* const part_slope = st.part_slope.data();
  BoundPart* const bound_part = st.bound_part.data();
  double* const one_minus = st.one_minus.data();
  // A group evaluated in this round: its ask, e^x, its items' place in the round's items (their
  // index less `shift`), and its sums as they are added.
  struct Evaluation {
    GroupSearch* search;
    GroupSearch::Ask ask;
    double ex;
    size_t first;  // in the round's items
    size_t shift;  // item index - round index
    double weighted, slope, at_x_max, at_x_min;
  };
  std::vector<Evaluation> round;
  for (;;) {
    round.clear();
    size_t total = 0;
    for (GroupSearch& search : searches) {
      const GroupSearch::Ask* ask = search.Next();
      if (ask == nullptr) continue;
      round.push_back(
          {&search, *ask, DetExp(ask->x), total, search.begin() - total, 0.0, 0.0, 0.0, 0.0});
      total += search.count();
    }
    if (round.empty()) return;
    // Evaluation of round item j (in round.first order).
    auto evaluation_of = [&](size_t j) {
      size_t e = 0;
      while (e + 1 < round.size() && round[e + 1].first <= j) ++e;
      return e;
    };
    // Token-weighted recall at multiplier e^x (decreasing in x) and its derivative in x. At the
    // stationary point (1-rho)^(g-1) = e^(x + offset), so (1-rho)^g = (1-rho) e^x scale and
    // d recall / d rho = g e^x scale: one exp per item. Each item's weighted recall and slope
    // are worked out on the threads and summed in item order as they come (OrderedSum), each
    // group's in its own sums. An item at a bound adds no slope: subtracting its 0 leaves the
    // sum's bits as they are (it starts at +0 and is never -0). At the first evaluation the
    // weighted recalls at x_max and x_min are summed too, NaN where an item is off its bounds.
    // Adds m items of evaluation `ev`, their parts in recall, slope and bounds; in locals while
    // they add, as the sums' references might alias the parts.
    auto add_parts = [&](Evaluation& ev, const double* recall, const double* slope,
                         const BoundPart* bounds, size_t m) {
      double w = ev.weighted;
      double s = ev.slope;
      for (size_t j = 0; j < m; ++j) {
        w += recall[j];
        s -= slope[j];
      }
      ev.weighted = w;
      ev.slope = s;
      if (!ev.ask.at_bounds) return;
      double at_max = ev.at_x_max;
      double at_min = ev.at_x_min;
      for (size_t j = 0; j < m; ++j) {
        at_max += bounds[j].at_x_max;
        at_min += bounds[j].at_x_min;
      }
      ev.at_x_max = at_max;
      ev.at_x_min = at_min;
    };
    // Adds round items [from, to) from their place.
    auto add = [&](size_t from, size_t to) {
      for (size_t e = evaluation_of(from); from < to; ++e) {
        Evaluation& ev = round[e];
        const size_t end = std::min(to, ev.first + ev.search->count());
        const size_t k = from + ev.shift;
        add_parts(ev, part_recall + k, part_slope + k, bound_part + k, end - from);
        from = end;
      }
    };
    const size_t chunks = ChunkCount(threads, total);
    OrderedSum sum(total, chunks);
    ParallelChunks(threads, total, [&](size_t chunk, size_t lo, size_t hi) {
      // kBatch items at a time (EvaluateRecalls). Each one's 1 - rho is worked out (and kept in
      // one_minus) for the items at a bound too, so that the densities at the answer need only
      // one_minus: reading the terms again there was a tenth of the allocation's time.
      std::array<double, kBatch> own_recall;
      std::array<double, kBatch> own_slope;
      std::array<BoundPart, kBatch> own_bounds;
      constexpr double kOff = std::numeric_limits<double>::quiet_NaN();
      size_t e = evaluation_of(lo);
      for (size_t first_j = lo; first_j < hi;) {
        Evaluation& ev = round[e];
        const size_t group_end = ev.first + ev.search->count();
        if (first_j == group_end) {
          ++e;
          continue;
        }
        // A batch within one group: its items [first, last).
        const size_t last_j = std::min({first_j + kBatch, hi, group_end});
        const size_t first = first_j + ev.shift;
        const size_t last = last_j + ev.shift;
        if (ev.ask.at_bounds) {
          const double x_min = ev.search->x_min();
          const double x_max = ev.search->x_max();
          for (size_t k = first; k < last; ++k) {
            own_bounds[k - first] = {x_max <= terms.x_at_hi[k]   ? terms.at_hi[k]
                                     : x_max >= terms.x_at_lo[k] ? terms.at_lo[k]
                                                                 : kOff,
                                     x_min <= terms.x_at_hi[k]   ? terms.at_hi[k]
                                     : x_min >= terms.x_at_lo[k] ? terms.at_lo[k]
                                                                 : kOff};
          }
        }
        const size_t m = last - first;
        EvaluateRecalls(terms, first, m, ev.ask.x, ev.ex, one_minus, own_recall.data(),
                        own_slope.data());
        sum.Offer(
            chunk, first_j, last_j,
            [&] { add_parts(ev, own_recall.data(), own_slope.data(), own_bounds.data(), m); },
            [&] {
              std::copy(own_recall.begin(), own_recall.begin() + m, part_recall + first);
              std::copy(own_slope.begin(), own_slope.begin() + m, part_slope + first);
              if (ev.ask.at_bounds) {
                std::copy(own_bounds.begin(), own_bounds.begin() + m, bound_part + first);
              }
            },
            add);
        first_j = last_j;
      }
    });
    for (Evaluation& ev : round) {
      const double tokens = ev.search->tokens();
      ev.search->Take({ev.weighted / tokens, ev.slope / tokens, {ev.at_x_max, ev.at_x_min}});
    }
  }
}

}  // namespace

std::vector<double> AllocateDensities(const std::vector<Sample>& batch, const PlannerConfig& config,
                                      const LatencyModel& model, const RecallModel& recall,
                                      const std::vector<double>& base, double base_recall,
                                      bool per_bucket) {
  const SampleTable table(batch, config, model, recall);
  return AllocateDensities(batch, config, model, table, base, base_recall, per_bucket);
}

std::vector<double> AllocateDensities(const std::vector<Sample>& batch, const PlannerConfig& config,
                                      const LatencyModel& /*model*/, const SampleTable& table,
                                      const std::vector<double>& base, double base_recall,
                                      bool per_bucket, PlanThreads* threads) {
  const size_t n = batch.size();
  std::vector<double> densities = base;
  if (n == 0) return densities;
  ThreadScratch<AllocationStorage> scratch(n);
  AllocationStorage& st = *scratch;
  const double hi_density = config.density_max;
  const double log_hi = LogOneMinus(hi_density);
  // The samples solved together: all of them, or those of one length bucket at a time (a
  // pre-packed sample goes with the bucket that holds most of its tokens). Each group's items
  // are its samples in batch order, the groups one after another: counted per range of samples
  // first, so that each range writes its items in place.
  const int groups = per_bucket ? kRecallBuckets : 1;
  const size_t chunks = ChunkCount(threads, n);
  using Counts = std::array<size_t, kRecallBuckets>;
  std::vector<Counts> counts(chunks, Counts{});
  uint8_t* const group_of = Scratch(st.group, n);
  if (per_bucket) {
    ParallelChunks(threads, n, [&](size_t chunk, size_t begin, size_t end) {
      Counts count{};
      for (size_t i = begin; i < end; ++i) {
        const int g = MainBucket(table, i);
        group_of[i] = static_cast<uint8_t>(g);
        ++count[g];
      }
      counts[chunk] = count;
    });
  } else {
    for (size_t c = 0; c < chunks; ++c) counts[c][0] = (c + 1) * n / chunks - c * n / chunks;
  }
  std::array<size_t, kRecallBuckets + 1> group_begin{};
  for (int g = 0; g < groups; ++g) {
    group_begin[g + 1] = group_begin[g];
    for (const Counts& count : counts) group_begin[g + 1] += count[g];
  }
  std::vector<Counts> next(chunks);  // each range's first item per group
  Counts at{};
  for (int g = 0; g < groups; ++g) at[g] = group_begin[g];
  for (size_t c = 0; c < chunks; ++c) {
    next[c] = at;
    for (int g = 0; g < groups; ++g) at[g] += counts[c][g];
  }
  const RecallTerms terms = RecallTerms::In(st.terms, n);
  RecallOutput* const outputs = Scratch(st.outputs, n);
  StartSummands* const summands = Scratch(st.summands, n);
  Scratch(st.part_recall, n);
  Scratch(st.part_slope, n);
  Scratch(st.bound_part, n);
  Scratch(st.one_minus, n);
  // Each group's sums before its search, in item order (batch order within the group) as the
  // items come (OrderedSum).
  std::array<GroupSums, kRecallBuckets> sums{};
  OrderedSum ordered(n, chunks);
  auto add_summands = [&](const StartSummands* summand, const uint8_t* group_ids, size_t m) {
    std::array<GroupSums, kRecallBuckets> local = sums;  // the summands might alias `sums`
    for (size_t j = 0; j < m; ++j) {
      GroupSums& group = local[per_bucket ? group_ids[j] : 0];
      group.tokens += summand[j].weight;
      group.start += summand[j].start;
      group.base += summand[j].base_recall;
    }
    sums = local;
  };
  auto add = [&](size_t from, size_t to) {
    add_summands(summands + from, group_of + from, to - from);
  };
  // The least x_at_hi and the greatest x_at_lo per range and group, combined after in range
  // order (a min or max keeps the first extreme it meets, as one pass in item order would).
  using GroupBounds = std::array<std::pair<double, double>, kRecallBuckets>;
  std::vector<GroupBounds> bounds(chunks);
  ParallelChunks(threads, n, [&](size_t chunk, size_t begin, size_t end) {
    Counts slot_of = next[chunk];
    GroupBounds range_bounds{};
    std::array<size_t, kBatch> slot;  // each sample's item
    // LogOneMinus of each base: the table's where the base is its base or floor or
    // density_max, else worked out through DetLogAll.
    std::array<double, kBatch> log_base;
    std::array<double, kBatch> logs;
    std::array<size_t, kBatch> log_of;  // the sample of each
    // The three exponentials an item needs, through DetExpAll.
    std::array<double, 3 * kBatch> exp_of;
    std::array<StartSummands, kBatch> own;  // the batch's summands
    double* const at_lo = exp_of.data();
    double* const at_hi = at_lo + kBatch;
    double* const scale = at_hi + kBatch;
    for (size_t first = begin; first < end; first += kBatch) {
      const size_t m = std::min(kBatch, end - first);
      size_t unknown = 0;
      for (size_t j = 0; j < m; ++j) {
        const size_t i = first + j;
        const SampleTerms& t = table[i];
        const double rho = base[i];
        slot[j] = slot_of[per_bucket ? group_of[i] : 0]++;
        if (!KnownLogOneMinus(t, rho, hi_density, log_hi, &log_base[j])) {
          log_of[unknown] = j;
          logs[unknown++] = 1.0 - std::min(rho, kAlmostDense);  // as LogOneMinus
        }
      }
      DetLogAll(logs.data(), logs.data(), unknown);
      for (size_t q = 0; q < unknown; ++q) log_base[log_of[q]] = logs[q];
      for (size_t j = 0; j < m; ++j) {
        const SampleTerms& t = table[first + j];
        const double g = (t.exponent - 1.0) + 1.0;
        // Never above base: a sample whose floor is above what it was given stays there.
        at_lo[j] = g * (t.floor < base[first + j] ? t.log_floor : log_base[j]);
        at_hi[j] = g * log_hi;
        scale[j] = t.price_offset;
      }
      DetExpAll(at_lo, at_lo, m);
      if (hi_density < 1.0) DetExpAll(at_hi, at_hi, m);
      DetExpAll(scale, scale, m);
      for (size_t j = 0; j < m; ++j) {
        const size_t i = first + j;
        const SampleTerms& t = table[i];
        const double rho = base[i];
        const double g_minus_1 = t.exponent - 1.0;
        const double g = g_minus_1 + 1.0;
        const bool floor_below = t.floor < rho;
        const double log_lo = floor_below ? t.log_floor : log_base[j];
        const double weight = static_cast<double>(table.Tokens(i));
        const double offset = t.price_offset;
        const size_t k = slot[j];
        const double x_at_hi = g_minus_1 * log_hi - offset;
        const double x_at_lo = g_minus_1 * log_lo - offset;
        terms.x_at_hi[k] = x_at_hi;
        terms.x_at_lo[k] = x_at_lo;
        terms.offset[k] = offset;
        terms.inv_g1[k] = 1.0 / g_minus_1;
        terms.scale[k] = scale[j];
        terms.weight[k] = weight;
        terms.weight_g_over_g1[k] = weight * (g / g_minus_1);
        // The table's recall at base (PlanStep's recall guards have just worked it out and kept
        // it): each sample from one thread, as its kept answers require.
        own[j] = {weight, weight * (g_minus_1 * log_base[j] - offset),
                  weight * table.Recall(i, rho)};
        terms.at_hi[k] = weight * (hi_density >= 1.0 ? 1.0 : 1.0 - at_hi[j]);
        terms.at_lo[k] = weight * (1.0 - at_lo[j]);
        outputs[k] = {floor_below ? t.floor : rho, static_cast<int>(i)};
        const int g_of = per_bucket ? group_of[i] : 0;
        auto& [x_min, x_max] = range_bounds[g_of];
        const bool seen = k > next[chunk][g_of];  // not the range's first item of its group
        x_min = seen ? std::min(x_min, x_at_hi) : x_at_hi;
        x_max = seen ? std::max(x_max, x_at_lo) : x_at_lo;
      }
      ordered.Offer(
          chunk, first, first + m, [&] { add_summands(own.data(), group_of + first, m); },
          [&] { std::copy(own.begin(), own.begin() + m, summands + first); }, add);
    }
    bounds[chunk] = range_bounds;
  });
  std::vector<GroupSearch> searches;
  std::vector<int> searched_group;            // per search, its group
  std::array<double, kRecallBuckets> keep{};  // per group, the recall it must not fall below
  for (int g = 0; g < groups; ++g) {
    const size_t begin = group_begin[g];
    const size_t count = group_begin[g + 1] - begin;
    if (count == 0) continue;
    double x_min = 0.0;
    double x_max = 0.0;
    bool any = false;
    for (size_t c = 0; c < chunks; ++c) {
      if (counts[c][g] == 0) continue;
      x_min = any ? std::min(x_min, bounds[c][g].first) : bounds[c][g].first;
      x_max = any ? std::max(x_max, bounds[c][g].second) : bounds[c][g].second;
      any = true;
    }
    const GroupSums& group = sums[g];
    keep[g] = per_bucket ? (group.tokens > 0 ? group.base / group.tokens : 0.0) : base_recall;
    // Aim a little above: the per-rank tuning that follows moves densities away from this
    // optimum, which costs a little recall (it is concave), and should not have to back off.
    const double margin = std::min(kAllocationRecallMargin, 0.1 * (1.0 - keep[g]));
    searches.emplace_back(begin, count, keep[g] + margin, x_min, x_max, group);
    searched_group.push_back(g);
  }
  SolveGroups(st, terms, searches, threads);
  std::array<double, kRecallBuckets> x_of{};
  std::array<bool, kRecallBuckets> kept{};
  std::array<bool, kRecallBuckets> solved{};
  for (size_t q = 0; q < searches.size(); ++q) {
    const GroupSearch& search = searches[q];
    const int g = searched_group[q];
    // Never hand back less recall than base (e.g. when even density_max cannot reach it).
    if (search.recall() < keep[g]) continue;
    x_of[g] = search.x();
    kept[g] = search.kept();
    solved[g] = true;
  }
  if (std::find(solved.begin(), solved.end(), true) == solved.end()) return densities;
  // The densities at each group's answer, in place of the base.
  const double* const one_minus = st.one_minus.data();
  ParallelFor(threads, n, [&](size_t begin, size_t end) {
    for (int g = 0; g < groups; ++g) {
      if (!solved[g]) continue;
      const double x = x_of[g];
      for (size_t k = std::max(begin, group_begin[g]); k < std::min(end, group_begin[g + 1]); ++k) {
        const double u = kept[g] ? one_minus[k] : DetExp((x + terms.offset[k]) * terms.inv_g1[k]);
        densities[outputs[k].index] = std::clamp(1.0 - u, outputs[k].floor, hi_density);
      }
    }
  });
  return densities;
}

double EstimatedActiveBlocks(int64_t rows_int, double rho, double anchors, double* slope) {
  const double rows = static_cast<double>(rows_int);
  const double a = anchors;
  const double full = std::min(rows, a);
  double blocks = 0.5 * full * (full + 1.0);
  if (rows <= a) {
    if (slope != nullptr) *slope = 0.0;
    return blocks;
  }
  // Rows n beyond the anchors keep max(a, rho*n + 1/2) blocks; the switch is at
  // m = (a-1/2)/rho. Rows m+1..rows are summed, not integrated: the integral lacks rho/2 a
  // row, and came out 1.5-2% under the exact count of sb-load's documents (4-64 rows), which
  // the tuner's exact passes then had to find and correct, a pass or two per rank solve.
  const double m_free = (a - 0.5) / rho;
  const double m = std::clamp(m_free, a, rows);
  blocks += a * (m - a) + rho * 0.5 * (rows * rows - m * m) + (0.5 * rho + 0.5) * (rows - m);
  if (slope != nullptr) {
    // d/drho, with the switch moving (dm/drho = -m/rho) while it lies inside (a, rows).
    *slope = 0.5 * (rows * rows - m * m) + 0.5 * (rows - m) +
             (m_free > a && m_free < rows ? 0.5 * m : 0.0);
  }
  return blocks;
}

std::vector<double> LayerDensities(const Sample& sample, double density, double floor,
                                   const PlannerConfig& config, const RecallModel& recall) {
  std::vector<double> rho;
  LayerDensities(sample, density, floor, config, recall, &rho);
  return rho;
}

void LayerDensities(const Sample& sample, double density, double floor, const PlannerConfig& config,
                    const RecallModel& recall, std::vector<double>* densities) {
  densities->clear();
  const int layers = config.shape.layers;
  if (layers < 2 || !recall.HasLayerCurves()) return;
  const double lo = std::min(floor, density);
  const double hi = std::max(config.density_max, density);
  // Nothing to move at a bound: every layer would sit there. Asked first, since it needs no
  // curve: the tuner leaves many samples at their floor or at density_max.
  if (density >= hi || density <= lo) return;
  // Per layer: g, then 1 / (g - 1) and log g; and the solve's exponentials. On the stack for up
  // to kStackLayers layers: BuildPlan asks for every planned sample.
  constexpr int kStackLayers = 64;
  std::array<double, 4 * kStackLayers> stack;
  std::vector<double> heap(layers > kStackLayers ? 4 * static_cast<size_t>(layers) : 0);
  double* const g = layers > kStackLayers ? heap.data() : stack.data();
  double* const inverse = g + layers;  // 1 / (g - 1)
  double* const log_g = inverse + layers;
  double* const exponentials = log_g + layers;
  std::fill(g, g + layers, 0.0);
  // One exponent per layer for the sample: its documents' layer curves, token-weighted. Each
  // document's exponents come in one call, which looks its bucket and all-layers exponent up
  // once rather than once per layer.
  const int64_t* const first = sample.segments.empty() ? &sample.length : sample.segments.data();
  const size_t documents = sample.segments.empty() ? 1 : sample.segments.size();
  for (size_t d = 0; d < documents; ++d) {
    recall.LayerExponents(first[d], sample.sensitivity, exponentials);
    const auto length = static_cast<double>(first[d]);
    for (int l = 0; l < layers; ++l) g[l] += length * exponentials[l];
  }
  for (int l = 0; l < layers; ++l) {
    // g = 1 makes recall linear in density: its marginal is flat, keep the solve defined.
    g[l] = std::max(g[l] / static_cast<double>(sample.length), 1.0 + 1e-6);
  }
  const auto [lo_g, hi_g] = std::minmax_element(g, g + layers);
  if (*hi_g <= 1.05 * *lo_g) return;
  // The per-layer loops below run two layers to a register (Pair; SSE2, any x86-64) and sum
  // four layers side by side, layer l into lane l % 4 of two Pairs, joined as ((0 + 1) + (2 +
  // 3)), then the layers past the last four in order. Where one sum ran layer by layer (and the
  // bracket's minimum below was kept in memory, 11% of the function's time) the function took
  // about a fifth more of its own time (perf's samples per step of ServerStep learn:2,
  // 65,536/4,096: 262 against 218).
  using Pair = double __attribute__((vector_size(16)));
  const int paired = layers & ~3;  // layers in whole fours
  auto load = [](const double* p) {
    Pair v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  };
  auto store = [](double* p, Pair v) { std::memcpy(p, &v, sizeof(v)); };
  auto join = [](Pair low, Pair high) { return (low[0] + low[1]) + (high[0] + high[1]); };
  const Pair ones = {1.0, 1.0};
  for (int l = 0; l < paired; l += 2) store(inverse + l, ones / (load(g + l) - ones));
  for (int l = paired; l < layers; ++l) inverse[l] = 1.0 / (g[l] - 1.0);
  DetLogAll(g, log_g, layers);
  // Stationarity of sum_l recall_l(rho_l) - mu sum_l rho_l: g (1 - rho)^(g - 1) = mu, so
  // rho_l(mu) = 1 - (mu / g_l)^(1 / (g_l - 1)), clamped; the mean falls as mu rises. at(log mu)
  // sets rho and returns the mean's excess over `density`, its slope (the unclamped layers'
  // -(mu / g_l)^(1 / (g_l - 1)) / (g_l - 1), over the layers) and its second derivative (the
  // same terms over (g_l - 1) again).
  std::vector<double>& rho = *densities;
  rho.resize(layers);
  const Pair lo_pair = {lo, lo};
  const Pair hi_pair = {hi, hi};
  auto at = [&](double log_mu, double* slope, double* curvature) {
    const Pair mu = {log_mu, log_mu};
    for (int l = 0; l < paired; l += 2) {
      store(exponentials + l, (mu - load(log_g + l)) * load(inverse + l));
    }
    for (int l = paired; l < layers; ++l) exponentials[l] = (log_mu - log_g[l]) * inverse[l];
    DetExpAll(exponentials, exponentials, layers);
    // Per layer: rho = clamp(1 - e, lo, hi); where it is inside (lo, hi), e / (g - 1) falls and
    // e / (g - 1)^2 bends.
    std::array<Pair, 2> sums{};
    std::array<Pair, 2> falls{};
    std::array<Pair, 2> bends{};
    for (int l = 0; l < paired; l += 2) {
      const Pair e = load(exponentials + l);
      const Pair inverse_pair = load(inverse + l);
      const Pair r = ones - e;
      const Pair clamped = r < lo_pair ? lo_pair : (hi_pair < r ? hi_pair : r);  // std::clamp
      store(rho.data() + l, clamped);
      const Pair fall = ((r > lo_pair) & (r < hi_pair)) ? e * inverse_pair : Pair{};
      const int k = (l >> 1) & 1;
      sums[k] += clamped;
      falls[k] += fall;
      bends[k] += fall * inverse_pair;
    }
    double sum = join(sums[0], sums[1]);
    double fell = join(falls[0], falls[1]);
    double bent = join(bends[0], bends[1]);
    for (int l = paired; l < layers; ++l) {
      const double r = 1.0 - exponentials[l];
      rho[l] = std::clamp(r, lo, hi);
      sum += rho[l];
      if (r > lo && r < hi) {
        const double fall = exponentials[l] * inverse[l];
        fell += fall;
        bent += fall * inverse[l];
      }
    }
    *slope = -fell / layers;
    *curvature = -bent / layers;
    return sum / layers - density;
  };
  // Bracket: at mu = max g every layer sits at lo (density 0 or below); at log mu = a every
  // layer's density is at least `density`: rho_l is `density` at log g_l + (g_l - 1) log(1 -
  // density), and -60 alone is not low enough next to density 1 (a layer of exponent 8 sat
  // near 0.96 there, and the mean fell short).
  const double log_gap = DetLog(1.0 - density);  // finite: density < hi <= 1
  double lowest = -60.0;
  double sum_g = 0.0;
  for (int l = 0; l < layers; ++l) {
    lowest = std::min(lowest, log_g[l] + (g[l] - 1.0) * log_gap - 1.0);
    sum_g += g[l];
  }
  double a = lowest;  // mean >= density
  const double mean_g = sum_g / layers;
  double b = DetLog(*hi_g) + 1.0;  // mean <= density
  // Safeguarded Halley steps (NewtonStep with Halley's slope, f' - f f'' / (2 f')) from where a
  // layer of the mean exponent would sit at `density`: the mean is smooth between the points
  // where a layer meets a bound, and a few steps land within rounding of `density`, where
  // bisection to 1e-12 of log mu took about 46 evaluations (at 65,536 samples of 32 layers
  // each, 700 ms of a 2-thread plan). Newton's steps took 4.21 evaluations a sample there (|f|
  // about 1e-2, 1e-4, 1e-8, then 1e-16; a fifth in a quarter of the samples), Halley's cubic
  // ones 3.13 (sb-server-bench's learn:2 step, 360,831 solves).
  double x = std::clamp(DetLog(mean_g) + (mean_g - 1.0) * log_gap, a, b);
  for (int iter = 0; iter < kMaxSolverIterations; ++iter) {
    double slope = 0.0;
    double curvature = 0.0;
    const double f = at(x, &slope, &curvature);
    if (std::fabs(f) <= 1e-14) break;
    (f > 0 ? a : b) = x;
    const double halley = slope - f * curvature / (2.0 * slope);
    if (!NewtonStep(f, halley < 0 ? halley : slope, a, b, /*scale=*/x, &x)) break;
  }
  // Rescale so the mean is `density` up to rounding (the search ends within about 1e-14 of
  // it, or with a bracket of 1e-12 in log mu), keeping every layer within its bounds.
  double mean = 0.0;
  for (double r : rho) mean += r;
  mean /= layers;
  if (mean != density && mean > 0) {
    for (double& r : rho) r = std::clamp(r * density / mean, lo, hi);
  }
}

bool PlansLayerDensities(const PlannerConfig& config, const RecallModel& recall, size_t samples) {
  // A valid config has at most kMaxLayers (2^12) layers and a batch at most 2^24 samples: the
  // product fits.
  return (config.policy == Policy::kDst || config.policy == Policy::kSparseBalance) &&
         static_cast<int64_t>(samples) * config.shape.layers <= kMaxPlannedLayerDensities &&
         recall.HasLayerCurves();
}

void PlannedLayerDensities(const Sample& sample, double density, const PlannerConfig& config,
                           const RecallModel& recall, std::vector<double>* densities) {
  LayerDensities(sample, density, std::min(DensityFloor(sample.sensitivity, config), density),
                 config, recall, densities);
}

TunerSamples::TunerSamples(size_t n) : storage_(n) { records_ = Scratch(storage_->records, n); }

void TunerSamples::Fill(const SampleTable& table, const PlannerConfig& config,
                        const std::vector<double>& base, size_t begin, size_t end) {
  const double log_max = LogOneMinus(config.density_max);
  LogBatch<TunerSample> logs;
  for (size_t i = begin; i < end; ++i) {
    if (!FillSample(table, i, base[i], config.density_max, log_max, table.doc_tokens(),
                    table.doc_buckets(), &records_[i])) {
      logs.Add(&records_[i]);
    }
  }
  logs.WorkOut();
}

std::vector<double> TuneDensities(const std::vector<Sample>& batch, const Assignment& assignment,
                                  const PlannerConfig& config, const LatencyModel& model,
                                  const RecallModel& recall, const std::vector<double>& base,
                                  double min_recall, const std::vector<double>& bucket_min_recall) {
  const SampleTable table(batch, config, model, recall);
  return TuneDensities(batch, assignment, config, model, table, base, min_recall,
                       bucket_min_recall);
}

std::vector<double> TuneDensities(const std::vector<Sample>& batch, const Assignment& assignment,
                                  const PlannerConfig& config, const LatencyModel& model,
                                  const SampleTable& table, const std::vector<double>& base,
                                  double min_recall, const std::vector<double>& bucket_min_recall,
                                  PlanThreads* threads, const TunerSamples* samples) {
  Tuner tuner(batch, assignment, config, model, table, base, threads, samples);
  if (tuner.ranks().empty()) return base;
  // Rank times at base, blocks counted exactly (as the plan's figures count them: MAX mode
  // must not exceed the base makespan).
  std::vector<double> at_base(tuner.ranks().size());
  ParallelFor(threads, tuner.ranks().size(), [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r) {
      if (r + 2 < end) tuner.PrefetchItems(tuner.ranks()[r + 2]);
      if (r + 1 < end) tuner.Prefetch(tuner.ranks()[r + 1], Tuner::kCounts);
      at_base[r] = tuner.ExactRankSeconds(tuner.ranks()[r], /*at_floor=*/false);
    }
  });
  const double base_max = *std::max_element(at_base.begin(), at_base.end());
  const bool min_mode = config.dst_mode == DstMode::kMin;
  double target = base_max;
  switch (config.dst_mode) {
    case DstMode::kMin:  // the floors' makespan, below
      break;
    case DstMode::kMean: {
      double sum = 0.0;
      for (double t : at_base) sum += t;
      target = sum / static_cast<double>(at_base.size());
      break;
    }
    case DstMode::kMax:
      target = base_max;
      break;
    case DstMode::kQuantile:
      target = Quantile(at_base, config.dst_quantile);
      break;
  }
  // No rank can go below its floors, so the step cannot be faster than the slowest floor. The
  // floors only raise the target, so where it is within kMinCutShare of the base makespan
  // already (the plan only raises) they are not worked out: estimated, then recounted exactly
  // over the ranks near their maximum.
  if (min_mode || !(base_max - target < kMinCutShare * base_max)) {
    std::vector<double> at_floor(tuner.ranks().size());
    ParallelFor(threads, tuner.ranks().size(), [&](size_t begin, size_t end) {
      for (size_t r = begin; r < end; ++r) {
        if (r + 2 < end) tuner.PrefetchItems(tuner.ranks()[r + 2]);
        if (r + 1 < end) tuner.Prefetch(tuner.ranks()[r + 1], Tuner::kRows);
        at_floor[r] = tuner.RankSeconds(tuner.ranks()[r], /*at_floor=*/true);
      }
    });
    const double floor_estimate = *std::max_element(at_floor.begin(), at_floor.end());
    double at_floor_max = 0.0;
    for (size_t r = 0; r < at_floor.size(); ++r) {
      if (at_floor[r] >= floor_estimate * (1.0 - kNearMaxShare)) {
        at_floor_max =
            std::max(at_floor_max, tuner.ExactRankSeconds(tuner.ranks()[r], /*at_floor=*/true));
      }
    }
    if (min_mode) target = at_floor_max;
    target = std::min(std::max(target, at_floor_max), base_max);
  }
  if (!min_mode && base_max - target < kMinCutShare * base_max) target = base_max;
  const bool cut = config.dst_mode != DstMode::kMax;
  if (min_mode) return tuner.Solve(target, at_base, cut);
  // The slack absorbs summation order (the caller sums in batch order, the tuner by rank).
  const double base_recall = min_recall - 1e-12;
  // With the bucket guard, each recall pass sums the bucket recalls too, which the guard asks for
  // next where the densities returned are the last ones summed.
  const bool guarded = !bucket_min_recall.empty();
  auto solve = [&] {
    Tuned tuned{tuner.Solve(target, at_base, cut), std::nullopt};
    std::array<double, kRecallBuckets> bucket_recall;
    const double recall_at_target =
        tuner.Recall(tuned.densities, guarded ? &bucket_recall : nullptr);
    if (recall_at_target >= base_recall) {
      if (guarded) tuned.bucket_recall = bucket_recall;
      return tuned;
    }
    // Cutting the stragglers lost more recall than raising the others won back: find the
    // lowest target between this one and the base makespan (pure raising, which never loses
    // recall) that keeps the recall.
    // The recall is monotone in the target; the search keeps a bracket [lo, hi] (lo loses
    // recall, hi keeps it) and ends once it is kRecallGuardResolution of the first one wide,
    // the width eight halvings reach. Its steps are regula falsi on the recall's shortfall
    // (Illinois: the end kept twice in a row has its shortfall halved, so both ends move),
    // kept a tenth of the bracket inside it; bisection while the shortfall at hi is unknown,
    // and once only halvings still reach the width within kRecallGuardIterations solves.
    // In sb-load's 1,024-rank round it takes four to six solves where bisection took nine.
    double lo = target;
    double hi = base_max;
    double short_lo = recall_at_target - base_recall;            // < 0
    double short_hi = std::numeric_limits<double>::quiet_NaN();  // >= 0 once known
    int kept = 0;  // +1: hi kept (lo moved) in a row; -1: lo kept
    const double resolution = kRecallGuardResolution * (hi - lo);
    Tuned best;  // at hi, once a target below base_max kept the recall
    for (int iter = 0; iter < kRecallGuardIterations && hi - lo > resolution; ++iter) {
      double mid = 0.5 * (lo + hi);
      // Bisection from here on once only halvings can still reach the resolution in time.
      const bool halve = hi - lo > std::ldexp(resolution, kRecallGuardIterations - iter - 1);
      if (!halve && !std::isnan(short_hi) && short_hi > short_lo) {
        const double interpolated = lo + (hi - lo) * (-short_lo) / (short_hi - short_lo);
        const double inset = 0.1 * (hi - lo);
        mid = std::clamp(interpolated, lo + inset, hi - inset);
      }
      std::vector<double> candidate = tuner.Solve(mid, at_base, cut);
      const double shortfall =
          tuner.Recall(candidate, guarded ? &bucket_recall : nullptr) - base_recall;
      best.bucket_recall.reset();  // summed for the last candidate only
      if (shortfall >= 0) {
        hi = mid;
        short_hi = shortfall;
        best.densities = std::move(candidate);
        if (guarded) best.bucket_recall = bucket_recall;
        if (kept < 0) short_lo *= 0.5;
        kept = std::min(kept, 0) - 1;
      } else {
        lo = mid;
        short_lo = shortfall;
        if (kept > 0 && !std::isnan(short_hi)) short_hi *= 0.5;
        kept = std::max(kept, 0) + 1;
      }
    }
    if (best.densities.empty()) return Tuned{tuner.Solve(base_max, at_base, cut), std::nullopt};
    return best;
  };
  Tuned tuned = solve();
  if (!guarded) return std::move(tuned.densities);
  // Each bucket's guard, then: its fallback only raises samples back to base (never above a
  // rank's base time), which keeps the token-weighted recall too.
  return GuardBuckets(tuner, bucket_min_recall, base, std::move(tuned), kTuneGuardRounds, solve);
}

}  // namespace sparsebalance
