#include "planner/sample_assigner.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "contract/step_figures.h"
#include "planner/plan_threads.h"
#include "planner/rank_queue.h"
#include "planner/recall_model.h"
#include "planner/sample_table.h"
#include "planner/thread_scratch.h"

namespace sparsebalance {
namespace {

// Candidate ranks (feasible, least loaded first) considered for each placement: more than
// one so that a much faster rank slightly behind in the queue can still win.
constexpr int kCandidates = 4;
// Placements whose resulting time is within this share of the best count as a tie, broken
// towards the rank with the least untunable work (so every rank keeps room for DST).
constexpr double kTieShare = 0.005;
// A balanced placement of many units over many ranks is split into parts: each part is a
// consecutive block of ranks, the units are dealt to the parts largest first (DealToParts), and
// each part places its own units on its own ranks (Placer::PlaceInParts), the parts at once
// when planning has threads; what fits no part's ranks, and the moves and swaps after, see
// every rank. A part per kRanksPerPart ranks, at most kMaxParts, and only with at least
// kMinUnitsPerRank units a rank (fewer leave the parts' loads too coarse to even out). The
// count depends on the job alone, never on the threads, so a plan is the same bytes on any
// number of them. At 65,536 samples over 4,096 ranks a whole-job placement was the only serial
// phase of planning, and its heap of 4,096 ranks outgrew the first-level cache. Parts of 256
// ranks planned a little faster than parts of 512 on one thread and two, and left a smaller
// gap to the lower bound in sb-sim at 1,024 ranks (0.8-1.5% against 1.1-1.9%).
constexpr int kRanksPerPart = 256;
constexpr int kMaxParts = 8;
constexpr int kMinUnitsPerRank = 4;

// The ranks by time (planner/rank_queue.h), the first kCandidates of them read off at once.
template <bool kLargestFirst>
using RankQueue = RankQueueOf<kLargestFirst, kCandidates>;

// One sample of a unit. All members sit in one flat array, each with its length and
// micro-batch, so that placing a unit reads one contiguous range rather than a vector per unit
// and the samples themselves.
struct Member {
  int index = 0;       // into the batch
  int slot = -1;       // micro-batch while placed, -1 otherwise
  int64_t length = 0;  // tokens
};

// Samples that must stay together: a non-zero group, or a single sample. Units are numbered
// in the order the policy places them, and their members laid out in that order (BuildUnits),
// so that placement streams through both. 40 bytes, where 56 took 3.7 MB at 65,536 samples:
// its longest member's tokens are read off that member (the first), and the rank's list is
// linked one way. BuildUnits' layout of the units took 0.33-0.34 ms where it took 0.39-0.47 on
// two threads (0.62-0.65 where 0.79-0.84 on one).
struct Unit {
  double cost = 0.0;   // balancing metric (seconds, tokens, ...), speed excluded
  double rigid = 0.0;  // part of cost that DST cannot cut (floor at or above density)
  int first = 0;       // smallest batch index: arrival order, which breaks ties
  int begin = 0;       // members are Workspace::members[begin, begin + size), longest first
  int size = 0;
  // While placed: the rank, the unit's placement number (its entry in the list of the lane
  // that placed it, Placer::Lane), and the next unit in the list of the rank's units (-1 at
  // the end), which is latest placed first.
  int rank = -1;
  int placement = -1;
  int next = -1;
};

// Items ahead whose data a walk in a known, scattered order asks the CPU to fetch: BuildUnits
// laying the units out in placement order reads the tallies (2.6 MB at 65,536 samples) all
// over, and waiting for each was two thirds of it; Collect reads the units (3.7 MB) part by part
// in placement order, cold. A hint: results do not change.
constexpr size_t kGatherAhead = 16;

// A unit as BuildUnits gathers it, in arrival order.
struct Tally {
  double cost = 0.0;
  double rigid = 0.0;
  int64_t length = 0;  // tokens: the sample's, or its group's members' summed
  int first = 0;
  int size = 0;
  int next_member = 0;  // where its next member goes in Workspace::members
};

struct RankState {
  double base = 0.0;  // the shards' load, placed before the units (context parallelism)
  double load = 0.0;  // base plus the sum of unit costs
  double rigid = 0.0;
  double speed = 1.0;    // speed factor h_r: time = speed * load
  int64_t max_free = 0;  // tokens, the most free of one micro-batch
  // Its units, a list through Unit::next, latest placed first: their order is not observable
  // (ImproveMaxRank sorts what it reads off the lists by keys that tell every unit apart), and
  // a unit put at the head writes no earlier unit, where one put at the tail wrote the last.
  int head = -1;
  int units = 0;
};

// The arrays of one call besides its inputs and result. AssignSamples keeps one per thread
// (until the thread ends) and reuses it: at 65,536 samples over 4,096 ranks they take about
// 10 MB, and faulting that much fresh memory in costs more than the whole placement (about
// 10 us a 4 KiB page on the 2-core development VM). Every call sizes and overwrites what it
// reads, so no result depends on an earlier call.
struct Workspace {
  // BuildUnits.
  std::vector<int> unit_of;                       // per sample
  std::vector<std::pair<uint64_t, int>> grouped;  // (group, sample) of grouped samples
  std::vector<Tally> tallies;                     // units in arrival order
  std::vector<double> costs;                      // per sample, in the policy's metric
  std::vector<uint64_t> keys;                     // LargestFirstKeys' sort keys and
  std::vector<uint64_t> sorted;                   // its second buffer
  std::vector<int> radix_place;                   // its counts and places per pass
  std::vector<int> order;                         // placement order of arrival units
  std::vector<int> part_of;                       // DealToParts': per place in `order`
  std::vector<int> dealt;                         // and `order` part by part
  // Placer.
  std::vector<Unit> units;  // in placement order
  std::vector<Member> members;
  std::vector<RankState> ranks;
  std::vector<int64_t> free;  // tokens, [rank * micro_batches + micro-batch]
  std::vector<int> placed;    // members placed, same layout: Collect reserves exactly
  // Units in the order they were placed, a unit placed again (moved) listed again: a rank's
  // samples go out in this order (Collect). An entry is stale unless Unit::placement names it.
  // With parts, those placed after them (Part::placements holds each part's).
  std::vector<int> placements;
  RankQueue<false> least_loaded;
  RankQueue<true> most_loaded;
  // The parts (kRanksPerPart): units[part_begin[p], part_begin[p + 1]) are part p's, largest
  // first; a single part (the whole placement) when part_begin has two entries. Each part's
  // ranks in a queue by their index in the part, its placements, the units that fit none of its
  // ranks, and its scratch. Each part starts a cache line of its own: the vectors' ends move
  // with every placement, and parts that shared a line slowed each other's threads (16,384
  // samples over 1,024 ranks planned 2.3 ms slower on two threads than in one part).
  std::vector<int> part_begin;
  struct alignas(64) Part {
    RankQueue<false> queue;
    std::vector<int> placements;
    std::vector<int> unplaced;
    std::vector<int64_t> fit_free;
    absl::Status error;
    double largest = 0.0;  // the largest cost of its units
  };
  std::vector<Part> parts;
  // Collect: the arrays of an assignment given back (RecycleAssignment), reused by the next.
  std::vector<std::vector<std::vector<int>>> spare_ranks;
};

// The calling thread's workspace: no sharing between concurrent calls. Kept between steps, but
// a step of more than kKeptScratchSamples samples frees it when it ends (AssignSamples).
Workspace& ThreadWorkspace() {
  thread_local Workspace workspace;
  return workspace;
}

// A cost as a sort key: unsigned numbers in the order of the doubles (negatives reversed,
// below positives), then reversed for largest first.
uint64_t CostKey(double cost) {
  if (cost == 0.0) cost = 0.0;  // -0.0 as 0.0
  uint64_t bits;
  std::memcpy(&bits, &cost, sizeof(bits));
  bits = (bits >> 63) != 0 ? ~bits : bits | (uint64_t{1} << 63);
  return ~bits;
}

// The units' largest-first order (LargestFirstKeys, then SortLargestFirst): the indices of
// `tallies` by cost, largest first, costs that agree to 2^-19
// of themselves in index order: a stable radix sort of the top 31 bits of the costs' keys (sign,
// exponent and 19 bits of mantissa), whose order is that of the costs (none is NaN). Costs that
// close are ties to the greedy that follows, and the 33 lower bits took three of the six passes.
// At scale (65,536 units) std::sort's comparisons of such keys mispredict at every other step.
// Each key is those 31 bits above the index in one 64-bit word, which the bits below them
// leave room for: half the bytes each pass moved of (CostKey, index) pairs. The keys are made
// on the threads; the sort runs on the calling thread, which BuildUnits shares with other work
// (ParallelBeside). Least significant digit first; each pass keeps the order of equal digits, so
// ties stay in index order, and the result is that of any stable sort by those bits: here by
// those bits less the least key's, whose span is narrower than 31 bits (23 at 65,536 samples
// over 4,096 ranks: two passes of 12-bit digits where three of 11 sorted all 31), the digits
// counted ahead of the passes (SortLargestFirst), and the passes on the calling thread: the sort
// took 0.66-0.70 ms where three passes spread over two threads took 0.75-0.81, and 0.66-0.75
// where three took 0.77-0.86 on one.
constexpr int kLowBit = 33;  // the sort's bits: 33-63
constexpr uint64_t kIndexBits = (uint64_t{1} << kLowBit) - 1;
static_assert(kMaxBatchSamples <= kIndexBits, "a unit's index fits below the sorted bits");

//
// Units from `later` on in arrival order (OverflowFirstUnit; none where it is the unit count)
// are placed after all earlier ones: their keys get the top bit, which no cost's key has
// (costs are not negative), so they sort after every earlier unit, largest first among
// themselves.
void LargestFirstKeys(const std::vector<Tally>& tallies, size_t later, Workspace* ws,
                      PlanThreads* threads) {
  std::vector<uint64_t>& keys = ws->keys;
  keys.resize(tallies.size());
  ParallelFor(threads, tallies.size(), [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const uint64_t tier = i >= later ? uint64_t{1} << 63 : 0;
      keys[i] = (CostKey(tallies[i].cost) & ~kIndexBits) | tier | i;
    }
  });
}

// Under OverflowPolicy::kDefer, where the units' tokens exceed the `room` left in the step's
// micro-batches: the first unit in arrival order that the room cannot hold after every unit
// before it (the units from there on are placed after all earlier ones, into what they leave);
// the unit count where it holds them all. So a batch that overflows defers its latest samples
// rather than those that the largest-first walk reaches last: a trainer passes the samples an
// earlier step deferred first (TrainerSession carries them ahead of the new ones), and without
// this a sample of a size that rarely fits at the walk's end was deferred step after step
// (PlanStepTest.DeferredSamplesWaitFewStepsInASteadyOverflow: 128-189 of its 400 steps, at
// most 5 now). An earlier unit can still be deferred, where the room's tokens do not pack.
size_t OverflowFirstUnit(const std::vector<Tally>& tallies, const PlannerConfig& config,
                         int64_t room) {
  if (config.overflow != OverflowPolicy::kDefer) return tallies.size();
  int64_t tokens = 0;
  for (size_t u = 0; u < tallies.size(); ++u) {
    tokens += tallies[u].length;
    if (tokens > room) return u;
  }
  return tallies.size();
}

// Writes the order of the keys LargestFirstKeys made to `order`. Each pass's digits are
// counted before it: digit 0's out of the counts of the keys' low kMaxDigitBits bits, taken in
// the same read as the least and most keys (digit 0 is the low bits less the least's, modulo
// the digit's width), and the later digits' in the first pass that sorts (in a read of their
// own where digit 0 is the same for all keys). One read of the keys less: the sort took
// 0.26-0.27 ms where a read that counted every digit made it 0.38-0.39 (alone, warm).
void SortLargestFirst(Workspace* ws, std::vector<int>* order) {
  std::vector<uint64_t>& keys = ws->keys;
  std::vector<uint64_t>& sorted = ws->sorted;
  const size_t n = keys.size();
  sorted.resize(n);
  order->resize(n);
  if (n == 0) return;
  constexpr int kMaxDigitBits = 12;
  constexpr size_t kScatterAhead = 48;  // see ask_ahead
  constexpr uint64_t kLowBits = (uint64_t{1} << kMaxDigitBits) - 1;
  // The counts of the low bits, then [pass * buckets + value]: the count of each digit value,
  // then where its first key goes.
  std::vector<int>& place = ws->radix_place;
  place.assign(kLowBits + 1, 0);
  uint64_t least = keys[0] >> kLowBit;
  uint64_t most = least;
  for (const uint64_t key : keys) {
    least = std::min(least, key >> kLowBit);
    most = std::max(most, key >> kLowBit);
    ++place[(key >> kLowBit) & kLowBits];
  }
  if (most == least) {
    for (size_t k = 0; k < n; ++k) (*order)[k] = static_cast<int>(keys[k] & kIndexBits);
    return;
  }
  // As few passes as cover the span, of digits of equal width, at most kMaxDigitBits.
  const int span = 64 - __builtin_clzll(most - least);
  const int passes = (span + kMaxDigitBits - 1) / kMaxDigitBits;
  const int digit_bits = (span + passes - 1) / passes;
  const size_t buckets = size_t{1} << digit_bits;
  auto digit = [&](uint64_t key, int pass) {
    return (((key >> kLowBit) - least) >> (pass * digit_bits)) & (buckets - 1);
  };
  place.resize(kLowBits + 1 + passes * buckets);
  int* const count = &place[kLowBits + 1];
  std::fill(count, count + passes * buckets, 0);
  for (uint64_t low = 0; low <= kLowBits; ++low) {
    count[(low - least) & (buckets - 1)] += place[low];
  }
  // A digit that all keys share needs no pass. The top digit sorts (least's is 0, most's is
  // not), and its pass writes the indices.
  auto sorts = [&](int pass) {
    return count[pass * buckets + digit(keys[0], pass)] != static_cast<int>(n);
  };
  auto first_places = [&](int pass) {
    int* next = &count[pass * buckets];
    int sum = 0;
    for (size_t b = 0; b < buckets; ++b) sum += std::exchange(next[b], sum);
    return next;
  };
  // Each pass writes the keys to 2^digit_bits places at once, more lines than the first-level
  // cache holds, and the lines are cold in a plan (the side loop runs beside): it asks for the
  // place of the key kScatterAhead on (hint: the place moves on by then, mostly within the
  // line). In a 2-thread plan the first pass took 0.19-0.26 ms where 0.34-0.46, the last
  // 0.13-0.20 where 0.14-0.24 (48 ahead; 16: 0.26-0.28 and 0.14-0.16; 96: as 48).
  auto ask_ahead = [&](auto* out, const int* next, size_t i, int pass) {
    if (i + kScatterAhead < n)
      __builtin_prefetch(&out[next[digit(keys[i + kScatterAhead], pass)]], 1);
  };
  const int last = passes - 1;
  if (last > 0) {
    if (sorts(0)) {
      int* next = first_places(0);
      for (size_t i = 0; i < n; ++i) {
        ask_ahead(sorted.data(), next, i, 0);
        const uint64_t key = keys[i];
        sorted[next[digit(key, 0)]++] = key;
        for (int pass = 1; pass < passes; ++pass) ++count[pass * buckets + digit(key, pass)];
      }
      keys.swap(sorted);
    } else {
      for (const uint64_t key : keys) {
        for (int pass = 1; pass < passes; ++pass) ++count[pass * buckets + digit(key, pass)];
      }
    }
  }
  for (int pass = 1; pass < last; ++pass) {
    if (!sorts(pass)) continue;
    int* next = first_places(pass);
    for (size_t i = 0; i < n; ++i) {
      ask_ahead(sorted.data(), next, i, pass);
      sorted[next[digit(keys[i], pass)]++] = keys[i];
    }
    keys.swap(sorted);
  }
  int* next = first_places(last);
  for (size_t i = 0; i < n; ++i) {
    ask_ahead(order->data(), next, i, last);
    (*order)[next[digit(keys[i], last)]++] = static_cast<int>(keys[i] & kIndexBits);
  }
}

// How many parts a balanced placement of `units` units is split into (kRanksPerPart).
int PartCount(const PlannerConfig& config, int units) {
  const int parts = std::min(kMaxParts, config.ranks / kRanksPerPart);
  if (parts < 2 || units < int64_t{kMinUnitsPerRank} * config.ranks) return 1;
  return parts;
}

// Part p's ranks: [PartFirstRank(p), PartFirstRank(p + 1)).
int PartFirstRank(int part, int parts, int ranks) {
  return static_cast<int>(int64_t{part} * ranks / parts);
}

// The deal asks for the costs this many units ahead (kGatherAhead's hint): `order` scatters
// them over the tallies (2.6 MB at 65,536 units), which the threads wrote, and beside the side
// loop most are misses. The deal in a 2-thread plan took 0.57-0.59 ms where 0.74-0.83 at 16
// ahead (0.61-0.69 at 32, 0.55-0.62 at 160).
constexpr int kDealAhead = 96;

// The deals' parts, kMaxParts of them: per_rate and no load for those of `parts`, those past it
// never chosen (an infinite load, rate 1), so that the loops have a fixed count and no branch.
// Zeroes count.
void StartDeal(int parts, const double* per_rate, std::array<double, kMaxParts>* rate,
               std::array<double, kMaxParts>* load, int* count) {
  rate->fill(1.0);
  load->fill(std::numeric_limits<double>::infinity());
  for (int p = 0; p < parts; ++p) {
    (*rate)[p] = per_rate[p];
    (*load)[p] = 0.0;
  }
  std::fill(count, count + kMaxParts + 1, 0);
}

}  // namespace

namespace sample_assigner_internal {

// DealToParts' deal (sample_assigner.h): a unit's part depends on every earlier unit's.
void DealUnitsScalar(int parts, const double* per_rate, const int* order, const char* costs,
                     size_t stride, int n, int* part_of, int* count) {
  std::array<double, kMaxParts> rate;
  std::array<double, kMaxParts> load;
  StartDeal(parts, per_rate, &rate, &load, count);
  for (int k = 0; k < n; ++k) {
    if (k + kDealAhead < n) __builtin_prefetch(costs + order[k + kDealAhead] * stride);
    double cost;
    std::memcpy(&cost, costs + order[k] * stride, sizeof(cost));
    int best = 0;
    double best_time = (load[0] + cost) * rate[0];
    for (int p = 1; p < kMaxParts; ++p) {
      const double time = (load[p] + cost) * rate[p];
      const bool better = time < best_time;
      best = better ? p : best;
      best_time = better ? time : best_time;
    }
    load[best] += cost;
    part_of[k] = best;
    ++count[best + 1];
  }
}

#if defined(__x86_64__) || defined(__i386__)
// Lanes of `yes` where `mask` has all ones, of `no` where zeros (and/andnot/or: 2 cycles where
// vblendvpd takes 3).
__attribute__((target("avx2"))) inline __m256d Blend(__m256d mask, __m256d no, __m256d yes) {
  return _mm256_or_pd(_mm256_andnot_pd(mask, no), _mm256_and_pd(mask, yes));
}

// The same deal with the 8 parts' loads in two AVX2 registers (parts 0-3, 4-7), about 19 cycles a
// unit where DealUnitsScalar's 7 compares in a row took 40: at 65,536 units, 0.43-0.44 ms where
// 0.87-0.97 (alone, warm), and 0.48-0.53 ms in a 2-thread plan (kDealAhead) where the scalar
// deal took 1.44-1.78 (at 16 ahead). The step's chain is only: blend this unit's times out of the
// two candidates per part, computed beside the chain while the unit before was chosen (its load
// before or after the unit before, plus this cost, times the part's per_rate: the same
// operations as DealUnitsScalar's, so the same bits); their minimum over a tree of 3 vminpd;
// the parts equal to it (ties, rare once the parts have loads, take the first on a branch).
// The minimum is exact only where no time is NaN: so costs must be >= 0 (not NaN) and
// per_rate finite and > 0; it returns false, what it wrote undefined, otherwise.
__attribute__((target("avx2"))) bool DealUnitsAvx2(int parts, const double* per_rate,
                                                   const int* order, const char* costs,
                                                   size_t stride, int n, int* part_of, int* count) {
  for (int p = 0; p < parts; ++p) {
    if (!(per_rate[p] > 0.0 && per_rate[p] < std::numeric_limits<double>::infinity())) {
      return false;
    }
  }
  std::array<double, kMaxParts> rate;
  std::array<double, kMaxParts> load;
  StartDeal(parts, per_rate, &rate, &load, count);
  if (n == 0) return true;
  const __m256d rate_lo = _mm256_loadu_pd(&rate[0]);
  const __m256d rate_hi = _mm256_loadu_pd(&rate[4]);
  const __m256i part_lo = _mm256_setr_epi64x(0, 1, 2, 3);
  const __m256i part_hi = _mm256_setr_epi64x(4, 5, 6, 7);
  auto cost_at = [&](int k) {
    double cost;
    std::memcpy(&cost, costs + order[k] * stride, sizeof(cost));
    return cost;
  };
  // Before unit k: the loads before unit k - 1, and with unit k - 1 added to each (`added`),
  // unit k - 1's part as lanes of all ones (`chosen`), and unit k's times with either load.
  __m256d load_lo = _mm256_loadu_pd(&load[0]);
  __m256d load_hi = _mm256_loadu_pd(&load[4]);
  __m256d added_lo = load_lo;
  __m256d added_hi = load_hi;
  __m256d chosen_lo = _mm256_setzero_pd();
  __m256d chosen_hi = _mm256_setzero_pd();
  double cost = cost_at(0);
  if (!(cost >= 0.0)) return false;
  __m256d cost_v = _mm256_set1_pd(cost);
  __m256d before_lo = _mm256_mul_pd(_mm256_add_pd(load_lo, cost_v), rate_lo);
  __m256d before_hi = _mm256_mul_pd(_mm256_add_pd(load_hi, cost_v), rate_hi);
  __m256d after_lo = before_lo;
  __m256d after_hi = before_hi;
  for (int k = 0; k < n; ++k) {
    if (k + kDealAhead < n) __builtin_prefetch(costs + order[k + kDealAhead] * stride);
    const __m256d time_lo = Blend(chosen_lo, before_lo, after_lo);
    const __m256d time_hi = Blend(chosen_hi, before_hi, after_hi);
    load_lo = Blend(chosen_lo, load_lo, added_lo);
    load_hi = Blend(chosen_hi, load_hi, added_hi);
    __m256d least = _mm256_min_pd(time_lo, time_hi);
    least = _mm256_min_pd(least, _mm256_permute_pd(least, 0b0101));
    least = _mm256_min_pd(least, _mm256_permute2f128_pd(least, least, 1));
    // Equal times have equal bits (none is NaN, none -0.0: loads start at +0.0, and +0.0 plus
    // -0.0 is +0.0): an integer compare, 1 cycle where vcmppd takes 4 (0.43 ms where 0.47).
    chosen_lo = _mm256_castsi256_pd(
        _mm256_cmpeq_epi64(_mm256_castpd_si256(time_lo), _mm256_castpd_si256(least)));
    chosen_hi = _mm256_castsi256_pd(
        _mm256_cmpeq_epi64(_mm256_castpd_si256(time_hi), _mm256_castpd_si256(least)));
    const unsigned equal = _mm256_movemask_pd(chosen_lo) | _mm256_movemask_pd(chosen_hi) << 4;
    const int best = __builtin_ctz(equal);
    if ((equal & (equal - 1)) != 0) {
      const __m256i best_v = _mm256_set1_epi64x(best);
      chosen_lo = _mm256_castsi256_pd(_mm256_cmpeq_epi64(best_v, part_lo));
      chosen_hi = _mm256_castsi256_pd(_mm256_cmpeq_epi64(best_v, part_hi));
    }
    part_of[k] = best;
    ++count[best + 1];
    if (k + 1 == n) break;
    added_lo = _mm256_add_pd(load_lo, cost_v);
    added_hi = _mm256_add_pd(load_hi, cost_v);
    cost = cost_at(k + 1);
    if (!(cost >= 0.0)) return false;
    cost_v = _mm256_set1_pd(cost);
    before_lo = _mm256_mul_pd(_mm256_add_pd(load_lo, cost_v), rate_lo);
    before_hi = _mm256_mul_pd(_mm256_add_pd(load_hi, cost_v), rate_hi);
    after_lo = _mm256_mul_pd(_mm256_add_pd(added_lo, cost_v), rate_lo);
    after_hi = _mm256_mul_pd(_mm256_add_pd(added_hi, cost_v), rate_hi);
  }
  return true;
}
#endif

// DealUnitsAvx2 where the CPU has AVX2 and it takes the inputs; false where it does not deal.
#if defined(__x86_64__) || defined(__i386__)
bool DealUnitsVector(int parts, const double* per_rate, const int* order, const char* costs,
                     size_t stride, int n, int* part_of, int* count) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2 && DealUnitsAvx2(parts, per_rate, order, costs, stride, n, part_of, count);
}
#else
bool DealUnitsVector(int, const double*, const int*, const char*, size_t, int, int*, int*) {
  return false;
}
#endif

}  // namespace sample_assigner_internal

namespace {

// Deals the units (`tallies`), largest first as SortLargestFirst left them (`order`), to the parts
// (kRanksPerPart): each to the part where it ends with the least load for the part's speed
// (the sum of its ranks' 1 / speed factor), ties to the first. Then lists `order` part by
// part, each part's largest first, and sets ws->part_begin. Tokens are not dealt: a unit that
// fits none of its part's ranks is placed after the parts, on any rank.
void DealToParts(const PlannerConfig& config, const std::vector<double>& speed,
                 const std::vector<Tally>& tallies, Workspace* ws, std::vector<int>* order) {
  const int n = static_cast<int>(order->size());
  const int parts = PartCount(config, n);
  std::vector<int>& part_begin = ws->part_begin;
  if (parts == 1) {
    part_begin.assign({0, n});
    return;
  }
  // Per part: 1 / its rate (the sum of its ranks' 1 / speed).
  std::array<double, kMaxParts> per_rate{};
  for (int p = 0; p < parts; ++p) {
    double rate = 0.0;
    const int end = PartFirstRank(p + 1, parts, config.ranks);
    for (int r = PartFirstRank(p, parts, config.ranks); r < end; ++r) {
      rate += 1.0 / speed[r];  // speed factors are > 0
    }
    per_rate[p] = 1.0 / rate;
  }
  // Each unit's part, by its place in `order`, then the places counted out.
  std::vector<int>& part_of = ws->part_of;
  part_of.resize(n);
  std::array<int, kMaxParts + 1> start{};
  const char* costs = reinterpret_cast<const char*>(&tallies[0].cost);
  if (!sample_assigner_internal::DealUnitsVector(parts, per_rate.data(), order->data(), costs,
                                                 sizeof(Tally), n, part_of.data(), start.data())) {
    sample_assigner_internal::DealUnitsScalar(parts, per_rate.data(), order->data(), costs,
                                              sizeof(Tally), n, part_of.data(), start.data());
  }
  for (int p = 0; p < parts; ++p) start[p + 1] += start[p];
  part_begin.assign(start.begin(), start.begin() + parts + 1);
  std::vector<int>& dealt = ws->dealt;
  dealt.resize(n);
  for (int k = 0; k < n; ++k) dealt[start[part_of[k]]++] = (*order)[k];
  order->swap(dealt);
}

// Fills ws->units and ws->members with the batch's units in the order they are placed:
// arrival order (of their first samples), or with `largest_first` by cost, largest first,
// near-ties in arrival order (SortLargestFirst); with `speed` (the ranks' factors) also dealt to
// parts (DealToParts), each part's largest first. Members are laid out unit by unit in that order,
// each unit's in arrival order, then stably longest first.
// The tokens a step's micro-batches hold: ranks x micro_batches x capacity (at most 2^50,
// ValidateConfig).
int64_t StepRoom(const PlannerConfig& config) {
  return int64_t{config.ranks} * config.micro_batches * config.micro_batch_capacity;
}

// `room`: the tokens the step's micro-batches hold for these samples (less what shards took).
void BuildUnits(const std::vector<Sample>& batch, const PlannerConfig& config,
                const LatencyModel& model, const std::vector<double>& densities, bool largest_first,
                int64_t room, Workspace* ws, const SampleTable* table = nullptr,
                PlanThreads* threads = nullptr, const std::vector<double>* speed = nullptr,
                const SideLoop* side = nullptr) {
  const int n = static_cast<int>(batch.size());
  // Each sample's cost on the threads (the table's memo is per sample), and its tally as a unit
  // of its own, numbered by its index: the units when no sample has a group, which the same
  // loop finds out (a serial pass over the batch for it cost 0.14 ms at 65,536 samples, alone
  // on every thread count). With groups, the units are tallied again below.
  std::vector<double>& costs = ws->costs;
  std::vector<Tally>& tallies = ws->tallies;
  costs.resize(n);
  tallies.resize(n);
  std::atomic<bool> any_group{false};
  ParallelFor(threads, n, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const Sample& s = batch[i];
      switch (config.policy) {
        case Policy::kTokens:
          costs[i] = static_cast<double>(s.length);
          break;
        case Policy::kFlops:
          costs[i] = model.SampleSeconds(s, 1.0);
          break;
        default:
          costs[i] = table != nullptr ? model.SampleSeconds(table->FeaturesAt(s, i, densities[i]))
                                      : model.SampleSeconds(s, densities[i]);
          break;
      }
      if (s.group != 0) any_group.store(true, std::memory_order_relaxed);
      Tally& unit = tallies[i];  // as the loop below would tally it
      unit = Tally{};
      unit.first = static_cast<int>(i);
      unit.size = 1;
      unit.cost += costs[i];
      if (DensityFloor(s.sensitivity, config) >= densities[i]) unit.rigid += costs[i];
      unit.length = s.length;
    }
  });
  const bool ungrouped = !any_group.load(std::memory_order_relaxed);  // the loop has returned
  std::vector<int>& unit_of = ws->unit_of;
  if (!ungrouped) {
    // Units in arrival order: groups (keyed by group id, ordered by first appearance) and
    // single samples. unit_of[i] first holds the sample's leader, the first sample of its group
    // (sorted (group, index) pairs give them), then the sample's unit.
    std::vector<std::pair<uint64_t, int>>& grouped = ws->grouped;
    unit_of.resize(n);
    grouped.clear();
    for (int i = 0; i < n; ++i) {
      unit_of[i] = i;
      if (batch[i].group != 0) grouped.emplace_back(batch[i].group, i);
    }
    std::sort(grouped.begin(), grouped.end());
    for (size_t k = 1; k < grouped.size(); ++k) {
      if (grouped[k].first == grouped[k - 1].first) {
        unit_of[grouped[k].second] = unit_of[grouped[k - 1].second];
      }
    }
    tallies.clear();
    for (int i = 0; i < n; ++i) {
      const Sample& s = batch[i];
      if (unit_of[i] == i) {  // a leader opens a unit
        unit_of[i] = static_cast<int>(tallies.size());
        tallies.emplace_back();
        tallies.back().first = i;
      } else {  // its leader came earlier and already has its unit
        unit_of[i] = unit_of[unit_of[i]];
      }
      Tally& unit = tallies[unit_of[i]];
      const double cost = costs[i];
      ++unit.size;
      unit.cost += cost;
      unit.length += s.length;
      if (DensityFloor(s.sensitivity, config) >= densities[i]) unit.rigid += cost;
    }
  }
  // Arrival numbers follow first indices, so they break cost ties in arrival order.
  const int unit_count = static_cast<int>(tallies.size());
  std::vector<int>& order = ws->order;
  if (largest_first) {
    LargestFirstKeys(tallies, OverflowFirstUnit(tallies, config, room), ws, threads);
  }
  // The sort and the deal run on the calling thread (about 0.7 and 0.9 ms at 65,536 samples
  // over 4,096 ranks; a unit's part depends on every earlier unit's): `side` runs on the
  // helpers meanwhile.
  ParallelBeside(threads, side, [&] {
    if (largest_first) {
      SortLargestFirst(ws, &order);
    } else {
      order.resize(unit_count);
      for (int p = 0; p < unit_count; ++p) order[p] = p;
    }
    if (largest_first && speed != nullptr) {
      DealToParts(config, *speed, tallies, ws, &order);
    } else {
      ws->part_begin.assign({0, unit_count});
    }
  });
  std::vector<Unit>& units = ws->units;
  std::vector<Member>& members = ws->members;
  units.resize(unit_count);
  members.resize(n);
  if (ungrouped) {  // unit p is sample order[p], its only member members[p]
    ParallelFor(threads, unit_count, [&](size_t begin, size_t end) {
      for (size_t p = begin; p < end; ++p) {
        if (p + kGatherAhead < end) __builtin_prefetch(&tallies[order[p + kGatherAhead]]);
        const Tally& tally = tallies[order[p]];
        Unit& unit = units[p];
        unit = Unit{};
        unit.cost = tally.cost;
        unit.rigid = tally.rigid;
        unit.first = tally.first;
        unit.begin = static_cast<int>(p);
        unit.size = 1;
        members[p] = Member{tally.first, -1, tally.length};
      }
    });
    return;
  }
  int begin = 0;
  for (int p = 0; p < unit_count; ++p) {
    Tally& tally = tallies[order[p]];
    Unit& unit = units[p];
    unit = Unit{};
    unit.cost = tally.cost;
    unit.rigid = tally.rigid;
    unit.first = tally.first;
    unit.begin = begin;
    unit.size = tally.size;
    tally.next_member = begin;
    begin += tally.size;
  }
  // Samples in arrival order, so each unit's members are too.
  for (int i = 0; i < n; ++i) {
    members[tallies[unit_of[i]].next_member++] = Member{i, -1, batch[i].length};
  }
  for (const Unit& unit : units) {
    if (unit.size > 1) {
      const auto first = members.begin() + unit.begin;
      std::stable_sort(first, first + unit.size,
                       [](const Member& a, const Member& b) { return a.length > b.length; });
    }
  }
}

class Placer {
 public:
  // Places the units of ws (BuildUnits) and keeps its state in ws.
  // `prefill`, when given, holds the shards already placed (their load and tokens stay), and
  // `original` the batch index of each of `batch`'s samples (for error messages).
  Placer(const std::vector<Sample>& batch, const PlannerConfig& config,
         const std::vector<double>& speed, Workspace* ws, const ShardLayout* prefill = nullptr,
         const std::vector<int>* original = nullptr)
      : batch_(batch),
        config_(config),
        micro_batches_(config.micro_batches),
        units_(ws->units),
        members_(ws->members),
        ranks_(ws->ranks),
        free_(ws->free),
        placed_(ws->placed),
        placements_(ws->placements),
        least_loaded_(ws->least_loaded),
        most_loaded_(ws->most_loaded),
        part_begin_(ws->part_begin),
        parts_(ws->parts),
        spare_ranks_(ws->spare_ranks),
        original_(original) {
    ranks_.assign(config.ranks, RankState{});
    for (int r = 0; r < config.ranks; ++r) {
      ranks_[r].speed = speed[r];
      ranks_[r].max_free = config.micro_batch_capacity;
    }
    free_.assign(static_cast<size_t>(config.ranks) * micro_batches_, config.micro_batch_capacity);
    if (prefill != nullptr) {
      for (size_t k = 0; k < free_.size(); ++k) free_[k] -= prefill->tokens[k];
      for (int r = 0; r < config.ranks; ++r) {
        // Shards keep their density (DST does not tune them): rigid work.
        ranks_[r].base = ranks_[r].load = ranks_[r].rigid = prefill->rank_load[r];
        Updated(r, whole_);
      }
    }
    placed_.assign(free_.size(), 0);
    placements_.clear();
  }

  absl::StatusOr<Assignment> Sequential();
  // With `threads`, the parts of the units (ws->part_begin) are placed on them.
  absl::StatusOr<Assignment> Balanced(PlanThreads* threads = nullptr);

 private:
  // Where placements are recorded: the whole placement's queue, list and scratch (whole_), or
  // one part's while the parts are placed at once (PlaceInParts), whose threads each touch only
  // their own part's ranks, units and lane.
  struct Lane {
    RankQueue<false>* queue = nullptr;  // the ranks by time while balancing, else null
    int first = 0;                      // the queue's i-th rank is rank first + i
    // Its placements in order; the k-th is numbered numbered + k (Unit::placement). A part's
    // are numbered from its first unit's number (it places no more units than it has), and
    // those after the parts from the unit count, so that no two lanes' numbers meet and the
    // parts' lists need not be copied into one.
    std::vector<int>* placements = nullptr;
    int numbered = 0;
    std::vector<int64_t>* fit_free = nullptr;
    absl::Status* error = nullptr;  // the first InRange failure
    // At least the most free tokens of any micro-batch of the lane's ranks: a unit with a
    // longer member fits none of them. Set by a walk that visited every rank; ranks only fill
    // while units are placed, so it stays an upper bound. Without it, each unit of an
    // overfull step that fits nowhere walked every rank: 9.6 s to place a step of 98,304
    // samples over 4,096 ranks, a fifth of them deferred.
    int64_t most_free = std::numeric_limits<int64_t>::max();
  };

  double Time(int r) const { return ranks_[r].speed * ranks_[r].load; }
  // Free tokens of the rank's micro-batches: micro_batches_ entries.
  int64_t* Free(int r) { return &free_[static_cast<size_t>(r) * micro_batches_]; }
  const int64_t* Free(int r) const { return &free_[static_cast<size_t>(r) * micro_batches_]; }
  // Whether a worst-fit of the unit's members into `free` (the micro-batch with most room
  // first, longest member first) places them all; `scratch` holds a copy of `free`.
  bool FitsWorst(const Unit& unit, const int64_t* free, std::vector<int64_t>& scratch) const;
  bool FitsWorst(const Unit& unit, const int64_t* free) const {
    return FitsWorst(unit, free, fit_free_);
  }
  // Next-fit in arrival order from micro-batch `*cursor`, then first-fit; slots[k] is the
  // micro-batch of the unit's k-th member (longest first), as Place takes them.
  bool FitInOrder(const Unit& unit, const int64_t* free, int* cursor,
                  std::vector<int>* slots) const;
  // Places the unit on rank r by the worst-fit of FitsWorst, which must succeed.
  void PlaceWorst(int u, int r, Lane& lane);
  // Places the unit's k-th member (longest first) in micro-batch slots[k].
  void Place(int u, int r, const std::vector<int>& slots);
  // Adds the placed unit to the rank's load and list; the caller checked InRange(u, r).
  void Attach(int u, int r, Lane& lane);
  // Whether u and r index a unit and a rank. A false answer is a bug (the batch and config
  // were validated, so every cost is finite and non-negative and every choice is a rank), but
  // it must never become an out-of-bounds write: it records the lane's error, which the
  // placement returns, and the caller writes nothing. Inline, as it runs per placement.
  bool InRange(int u, int r, Lane& lane) {
    if (u >= 0 && u < static_cast<int>(units_.size()) && r >= 0 && r < config_.ranks) return true;
    OutOfRange(u, r, lane);
    return false;
  }
  // Records InRange's error.
  void OutOfRange(int u, int r, Lane& lane);
  void Remove(int u, int r);
  // Refreshes the rank's place in the lane's queue and its largest free micro-batch.
  void Updated(int r, Lane& lane);
  // Places unit u on the lane's ranks: false when it fits none of them.
  absl::StatusOr<bool> PlaceBalanced(int u, Lane& lane);
  // Places each part's units on its ranks (on `threads` when given), then lists in `rest`, in
  // the whole placement's order, the units that fit none of their part's ranks.
  absl::Status PlaceInParts(PlanThreads* threads, std::vector<int>* rest);
  absl::Status Overflow(int u, std::vector<int>* deferred) const;
  bool FitsAfterSwap(int u, int v, int r) const;
  // Moves and swaps between the most and the least loaded rank; `largest`: the largest unit
  // cost.
  void ImproveMaxRank(double largest);
  // The assignment, rank by rank in placement order. With `threads`, the ranks' lists are made
  // on them, and each part's placements (Part::placements) gathered on them too.
  Assignment Collect(std::vector<int> deferred, PlanThreads* threads = nullptr) const;

  const std::vector<Sample>& batch_;
  const PlannerConfig& config_;
  const int micro_batches_;
  // The workspace's arrays (see Workspace).
  std::vector<Unit>& units_;
  std::vector<Member>& members_;
  std::vector<RankState>& ranks_;
  std::vector<int64_t>& free_;
  std::vector<int>& placed_;
  std::vector<int>& placements_;
  RankQueue<false>& least_loaded_;  // kept while balancing (Sequential never reads it)
  RankQueue<true>& most_loaded_;    // ImproveMaxRank's, which keeps it up to date itself
  const std::vector<int>& part_begin_;
  std::vector<Workspace::Part>& parts_;
  std::vector<std::vector<std::vector<int>>>& spare_ranks_;
  const std::vector<int>* original_;  // batch index of each sample of batch_, or null
  absl::Status error_;
  // Small scratch reused across calls of the methods below.
  mutable std::vector<int64_t> fit_free_;   // FitsWorst's and FitInOrder's free tokens
  mutable std::vector<int64_t> swap_free_;  // FitsAfterSwap's free tokens
  mutable std::vector<int> arrival_;        // FitInOrder's member places in arrival order
  // The whole placement's lane; its queue is least_loaded_ once Balanced starts.
  Lane whole_{nullptr, 0, &placements_, 0, &fit_free_, &error_};
};

bool Placer::FitsWorst(const Unit& unit, const int64_t* free_in, std::vector<int64_t>& free) const {
  const int64_t* end_in = free_in + micro_batches_;
  if (unit.size == 1) {  // the common case: no copy
    return *std::max_element(free_in, end_in) >= members_[unit.begin].length;
  }
  free.assign(free_in, end_in);
  for (int k = unit.begin; k < unit.begin + unit.size; ++k) {
    const auto best = std::max_element(free.begin(), free.end());
    if (*best < members_[k].length) return false;
    *best -= members_[k].length;
  }
  return true;
}

bool Placer::FitInOrder(const Unit& unit, const int64_t* free_in, int* cursor,
                        std::vector<int>* slots) const {
  std::vector<int64_t>& free = fit_free_;
  free.assign(free_in, free_in + micro_batches_);
  slots->resize(unit.size);
  // Members in arrival order, as a plain sampler would see them: their places in the unit.
  std::vector<int>& order = arrival_;
  order.resize(unit.size);
  for (int k = 0; k < unit.size; ++k) order[k] = k;
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return members_[unit.begin + a].index < members_[unit.begin + b].index;
  });
  for (int k : order) {
    const int64_t length = members_[unit.begin + k].length;
    int m = *cursor;
    while (m < micro_batches_ && free[m] < length) ++m;
    if (m == micro_batches_) {
      m = 0;
      while (m < micro_batches_ && free[m] < length) ++m;
      if (m == micro_batches_) return false;
    } else {
      *cursor = m;
    }
    free[m] -= length;
    (*slots)[k] = m;
  }
  return true;
}

void Placer::OutOfRange(int u, int r, Lane& lane) {
  if (lane.error->ok()) {
    *lane.error = absl::InternalError(absl::StrCat("sample placement chose unit ", u, " and rank ",
                                                   r, " outside [0, ", units_.size(), ") x [0, ",
                                                   config_.ranks, "); the step was not planned"));
  }
}

// Inline, as are Attach and Updated that it calls: they run once per placement, and their calls
// cost about 60 instructions of a placement's 1,000.
inline void Placer::PlaceWorst(int u, int r, Lane& lane) {
  if (!InRange(u, r, lane)) return;
  // The same choices as FitsWorst, made on the rank's own free tokens.
  const Unit& unit = units_[u];
  int64_t* free = Free(r);
  for (int k = unit.begin; k < unit.begin + unit.size; ++k) {
    Member& member = members_[k];
    const int m = static_cast<int>(std::max_element(free, free + micro_batches_) - free);
    member.slot = m;
    free[m] -= member.length;
    ++placed_[static_cast<size_t>(r) * micro_batches_ + m];
  }
  Attach(u, r, lane);
}

void Placer::Place(int u, int r, const std::vector<int>& slots) {
  if (!InRange(u, r, whole_)) return;
  const Unit& unit = units_[u];
  int64_t* free = Free(r);
  for (int k = 0; k < unit.size; ++k) {
    Member& member = members_[unit.begin + k];
    member.slot = slots[k];
    free[slots[k]] -= member.length;
    ++placed_[static_cast<size_t>(r) * micro_batches_ + slots[k]];
  }
  Attach(u, r, whole_);
}

inline void Placer::Attach(int u, int r, Lane& lane) {
  RankState& rank = ranks_[r];
  Unit& unit = units_[u];
  rank.load += unit.cost;
  rank.rigid += unit.rigid;
  unit.rank = r;
  unit.placement = lane.numbered + static_cast<int>(lane.placements->size());
  lane.placements->push_back(u);
  unit.next = rank.head;
  rank.head = u;
  ++rank.units;
  Updated(r, lane);
}

void Placer::Remove(int u, int r) {
  if (!InRange(u, r, whole_)) return;
  RankState& rank = ranks_[r];
  Unit& unit = units_[u];
  int64_t* free = Free(r);
  for (int k = unit.begin; k < unit.begin + unit.size; ++k) {
    Member& member = members_[k];
    free[member.slot] += member.length;
    --placed_[static_cast<size_t>(r) * micro_batches_ + member.slot];
    member.slot = -1;
  }
  rank.load -= unit.cost;
  rank.rigid -= unit.rigid;
  if (rank.units == 1) {  // no drift from +/- rounding
    rank.load = rank.rigid = rank.base;
  }
  // Its predecessor from the head: only the moves of ImproveMaxRank remove units.
  int prev = -1;
  for (int v = rank.head; v >= 0 && v != u; v = units_[v].next) prev = v;
  (prev >= 0 ? units_[prev].next : rank.head) = unit.next;
  unit.rank = unit.placement = unit.next = -1;
  --rank.units;
  Updated(r, whole_);
}

inline void Placer::Updated(int r, Lane& lane) {
  if (lane.queue != nullptr) lane.queue->Update(r - lane.first, Time(r));
  const int64_t* free = Free(r);
  ranks_[r].max_free = *std::max_element(free, free + micro_batches_);
}

absl::Status Placer::Overflow(int u, std::vector<int>* deferred) const {
  const Unit& unit = units_[u];
  // A group that fits no rank even with every micro-batch empty (by the fit this placement
  // uses) fits no step: refused under either policy, the error naming the group rather than the
  // batch's total (a single sample always fits an empty rank: ValidateBatch). Deferred, it came
  // back every step and was deferred again, never trained, and the trainer was not told.
  if (unit.size > 1) {
    const std::vector<int64_t> empty(micro_batches_, config_.micro_batch_capacity);
    int cursor = 0;
    std::vector<int> slots;
    const bool sequential = config_.policy == Policy::kSequential || config_.policy == Policy::kDst;
    if (!(sequential ? FitInOrder(unit, empty.data(), &cursor, &slots)
                     : FitsWorst(unit, empty.data()))) {
      const int i = members_[unit.begin].index;
      int64_t tokens = 0;
      int64_t longest = 0;
      for (int k = unit.begin; k < unit.begin + unit.size; ++k) {
        tokens += members_[k].length;
        longest = std::max(longest, members_[k].length);
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "samples[", original_ != nullptr ? (*original_)[i] : i, "].group: group ",
          batch_[i].group, " (", unit.size, " samples, ", tokens, " tokens, the longest ", longest,
          ") does not fit any rank even with its ", config_.micro_batches, " micro-batches of ",
          config_.micro_batch_capacity,
          " tokens empty (a group trains on one rank); split the group, or raise micro_batches or "
          "micro_batch_capacity"));
    }
  }
  if (config_.overflow == OverflowPolicy::kDefer) {
    for (int k = unit.begin; k < unit.begin + unit.size; ++k) {
      deferred->push_back(members_[k].index);
    }
    return absl::OkStatus();
  }
  const int i = members_[unit.begin].index;
  int64_t total = 0;
  for (const Sample& s : batch_) total += s.length;
  return absl::InvalidArgumentError(absl::StrCat(
      "samples[", original_ != nullptr ? (*original_)[i] : i, "] (id ", batch_[i].id, ", ",
      batch_[i].length, " tokens", unit.size > 1 ? absl::StrCat(", group ", batch_[i].group) : "",
      ") does not fit: ranks x micro_batches x micro_batch_capacity = ", config_.ranks, " x ",
      config_.micro_batches, " x ", config_.micro_batch_capacity, " tokens for a batch of ", total,
      " tokens; raise micro_batches or micro_batch_capacity, or use overflow policy "
      "defer"));
}

absl::StatusOr<Assignment> Placer::Sequential() {
  std::vector<int> cursor(config_.ranks, 0);
  std::vector<int> deferred;
  std::vector<int> slots;
  const int64_t n = static_cast<int64_t>(batch_.size());
  // Units come in arrival order (BuildUnits).
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
    const Unit& unit = units_[u];
    // Contiguous chunks of equal sample count: rank of the unit's first sample.
    const int home = static_cast<int>(static_cast<int64_t>(unit.first) * config_.ranks / n);
    // FitInOrder fails without moving the cursor when the first member in arrival order fits
    // in no micro-batch: skip such ranks cheaply (they are many when the batch overflows).
    const int64_t first_length = batch_[unit.first].length;
    bool placed = false;
    for (int k = 0; k < config_.ranks && !placed; ++k) {
      const int r = (home + k) % config_.ranks;
      if (ranks_[r].max_free >= first_length && FitInOrder(unit, Free(r), &cursor[r], &slots)) {
        Place(u, r, slots);
        placed = true;
      }
    }
    if (!placed) {
      absl::Status status = Overflow(u, &deferred);
      if (!status.ok()) return status;
    }
  }
  if (!error_.ok()) return error_;
  std::sort(deferred.begin(), deferred.end());
  return Collect(std::move(deferred));
}

absl::StatusOr<bool> Placer::PlaceBalanced(int u, Lane& lane) {
  const Unit& unit = units_[u];
  const int64_t longest = members_[unit.begin].length;
  if (longest > lane.most_free) return false;
  auto takes = [&](int r) {
    return ranks_[r].max_free >= longest &&
           (unit.size == 1 || FitsWorst(unit, Free(r), *lane.fit_free));
  };
  // The usual case first: the kCandidates least loaded ranks all take the unit, so they are the
  // candidates the walk below would find (the same ranks; the choice after does not depend on
  // their order), read off the queue's first ranks.
  std::array<int, kCandidates> candidates{};
  int count = lane.queue->FirstRanks(&candidates);
#pragma GCC unroll 4
  for (int& r : candidates) r += lane.first;  // those past count: not read
  // The chosen rank's free tokens are written last (PlaceWorst), scattered over the part's:
  // asked for now, for every candidate, they arrive while the choice is made (AssignSamples
  // at 65,536 samples over 4,096 ranks, one thread: 0.05-0.1 ms faster of 6.1-6.2).
  if (count == kCandidates) {
#pragma GCC unroll 4
    for (int r : candidates) __builtin_prefetch(Free(r));
  }
  if (count < kCandidates ||
      !std::all_of(candidates.begin(), candidates.end(), [&](int r) { return takes(r); })) {
    count = 0;
    int64_t most_free = 0;
    lane.queue->VisitInOrder([&](int i) {
      const int r = lane.first + i;
      most_free = std::max(most_free, ranks_[r].max_free);
      if (takes(r)) candidates[count++] = r;
      return count < kCandidates;
    });
    if (count < kCandidates) lane.most_free = most_free;  // the walk visited every rank
  }
  if (count == 0) return false;
  // Fewer candidates are padded with copies of the first, which change neither the best time
  // nor the choice below (a copy is never strictly better than its original), so that the loops
  // have a fixed count and unroll: loops of `count` cost 100 instructions more a placement.
  for (int k = count; k < kCandidates; ++k) candidates[k] = candidates[0];
  std::array<double, kCandidates> times;
  double best_time = 0.0;
#pragma GCC unroll 4
  for (int k = 0; k < kCandidates; ++k) {
    const RankState& rank = ranks_[candidates[k]];
    times[k] = rank.speed * (rank.load + unit.cost);
    if (k == 0 || times[k] < best_time) best_time = times[k];
  }
  int chosen = -1;
  double chosen_time = 0.0;
#pragma GCC unroll 4
  for (int k = 0; k < kCandidates; ++k) {
    const int r = candidates[k];
    const RankState& rank = ranks_[r];
    const double t = times[k];
    if (t > best_time * (1.0 + kTieShare)) continue;
    if (chosen < 0 || rank.rigid < ranks_[chosen].rigid ||
        (rank.rigid == ranks_[chosen].rigid &&
         (t < chosen_time || (t == chosen_time && r < chosen)))) {
      chosen = r;
      chosen_time = t;
    }
  }
  if (chosen < 0) {
    // Only reachable with a NaN or negative cost, which validation excludes.
    return absl::InternalError(absl::StrCat("no rank chosen for samples[",
                                            members_[unit.begin].index, "] (cost ", unit.cost,
                                            "); the step was not planned"));
  }
  PlaceWorst(u, chosen, lane);
  if (!lane.error->ok()) return *lane.error;
  return true;
}

absl::Status Placer::PlaceInParts(PlanThreads* threads, std::vector<int>* rest) {
  const int parts = static_cast<int>(part_begin_.size()) - 1;
  parts_.resize(parts);
  auto place_part = [&](int p) {
    Workspace::Part& part = parts_[p];
    part.placements.clear();
    part.unplaced.clear();
    part.error = absl::OkStatus();
    const int first = PartFirstRank(p, parts, config_.ranks);
    part.queue.Reset(PartFirstRank(p + 1, parts, config_.ranks) - first, [](int) { return 0.0; });
    Lane lane{&part.queue, first, &part.placements, part_begin_[p], &part.fit_free, &part.error};
    double largest = 0.0;
    for (int u = part_begin_[p]; u < part_begin_[p + 1]; ++u) {
      largest = std::max(largest, units_[u].cost);
      absl::StatusOr<bool> placed = PlaceBalanced(u, lane);
      if (!placed.ok()) {
        part.error = placed.status();
        return;
      }
      if (!*placed) part.unplaced.push_back(u);
    }
    part.largest = largest;
  };
  ParallelEach(threads, parts, [&](size_t p) { place_part(static_cast<int>(p)); });
  for (const Workspace::Part& part : parts_) {
    if (!part.error.ok()) return part.error;
  }
  // Every rank's time in the whole placement's queue, whose placements come after the parts'.
  least_loaded_.Reset(config_.ranks, [&](int r) { return Time(r); });
  whole_.numbered = static_cast<int>(units_.size());
  // What is left, in the order of the whole placement: largest first, ties in arrival order.
  rest->clear();
  for (const Workspace::Part& part : parts_) {
    rest->insert(rest->end(), part.unplaced.begin(), part.unplaced.end());
  }
  std::sort(rest->begin(), rest->end(), [&](int a, int b) {
    const Unit& x = units_[a];
    const Unit& y = units_[b];
    return x.cost != y.cost ? x.cost > y.cost : x.first < y.first;
  });
  return absl::OkStatus();
}

absl::StatusOr<Assignment> Placer::Balanced(PlanThreads* threads) {
  least_loaded_.Reset(config_.ranks, [&](int r) { return Time(r); });  // shards placed before
  whole_.queue = &least_loaded_;
  std::vector<int> deferred;
  // The largest unit cost, for ImproveMaxRank's lower bound: taken as the units are placed
  // rather than in a pass of its own over them (3.7 MB at 65,536 samples, cold by then: 0.2 ms).
  double largest = 0.0;
  auto place = [&](int u) {
    absl::StatusOr<bool> placed = PlaceBalanced(u, whole_);
    if (!placed.ok()) return placed.status();
    return *placed ? absl::OkStatus() : Overflow(u, &deferred);
  };
  if (part_begin_.size() > 2) {
    std::vector<int> rest;
    if (absl::Status status = PlaceInParts(threads, &rest); !status.ok()) return status;
    for (const Workspace::Part& part : parts_) largest = std::max(largest, part.largest);
    for (int u : rest) {
      if (absl::Status status = place(u); !status.ok()) return status;
    }
  } else {
    // Units come largest first (BuildUnits).
    for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
      largest = std::max(largest, units_[u].cost);
      if (absl::Status status = place(u); !status.ok()) return status;
    }
  }
  ImproveMaxRank(largest);
  if (!error_.ok()) return error_;
  std::sort(deferred.begin(), deferred.end());
  return Collect(std::move(deferred), threads);
}

bool Placer::FitsAfterSwap(int u, int v, int r) const {
  // Would unit u fit on rank r once unit v has left it?
  const Unit& unit = units_[u];
  const Unit& leaving = units_[v];
  const int64_t* free = Free(r);
  if (unit.size == 1 && leaving.size == 1) {
    const int64_t length = members_[unit.begin].length;
    const Member& freed = members_[leaving.begin];
    for (int m = 0; m < micro_batches_; ++m) {
      const int64_t room = free[m] + (m == freed.slot ? freed.length : 0);
      if (room >= length) return true;
    }
    return false;
  }
  swap_free_.assign(free, free + micro_batches_);
  for (int k = leaving.begin; k < leaving.begin + leaving.size; ++k) {
    swap_free_[members_[k].slot] += members_[k].length;
  }
  return FitsWorst(unit, swap_free_.data());
}

void Placer::ImproveMaxRank(double largest) {
  if (config_.ranks < 2) return;
  // Nothing beats the lower bound: max(total / sum(1/h), largest unit on the fastest rank).
  double total = 0.0;
  std::vector<double> speeds;
  for (const RankState& rank : ranks_) {
    total += rank.load;
    speeds.push_back(rank.speed);
  }
  const double bound = MakespanLowerBound(total, largest, speeds);
  const int limit = 4 * config_.ranks + 64;
  // Only this search reads the most loaded rank: each move below changes hi and lo alone.
  most_loaded_.Reset(config_.ranks, [&](int r) { return Time(r); });
  // Ties between candidates, and between units of equal cost, are broken in arrival order
  // (Unit::first; -1 for no unit), whatever order the units were placed in.
  struct Candidate {
    double time;  // resulting max(time of hi, time of lo)
    int u_first;  // arrival order of u and v
    int v_first;
    int u;  // unit leaving hi
    int v;  // unit leaving lo, -1 for a move
  };
  struct LoUnit {
    double cost;
    int first;
    int unit;
  };
  const auto lo_before = [](const LoUnit& a, const LoUnit& b) {
    return a.cost != b.cost ? a.cost < b.cost : a.first < b.first;
  };
  std::vector<Candidate> candidates;
  std::vector<LoUnit> lo_units;  // the idle rank's, by (cost, first)
  for (int iter = 0; iter < limit; ++iter) {
    const int hi = most_loaded_.First();
    const int lo = least_loaded_.First();
    const double current = Time(hi);
    if (hi == lo || current <= bound * (1.0 + 1e-6)) return;
    const double h_hi = ranks_[hi].speed;
    const double h_lo = ranks_[lo].speed;
    const double load_hi = ranks_[hi].load;
    const double load_lo = ranks_[lo].load;
    // Moving cost d from hi to lo gives max(h_hi (load_hi - d), h_lo (load_lo + d)), lowest
    // at d* below; look at moves and swaps whose transferred cost is nearest to it.
    const double ideal = (h_hi * load_hi - h_lo * load_lo) / (h_hi + h_lo);
    auto time_after = [&](double d) {
      return std::max(h_hi * (load_hi - d), h_lo * (load_lo + d));
    };
    const double improving = current * (1.0 - 1e-9);
    candidates.clear();
    lo_units.clear();
    for (int v = ranks_[lo].head; v >= 0; v = units_[v].next) {
      lo_units.push_back({units_[v].cost, units_[v].first, v});
    }
    std::sort(lo_units.begin(), lo_units.end(), lo_before);
    for (int u = ranks_[hi].head; u >= 0; u = units_[u].next) {
      const double c = units_[u].cost;
      const int u_first = units_[u].first;
      if (const double t = time_after(c); t < improving) {
        candidates.push_back({t, u_first, -1, u, -1});
      }
      // Swap partners with cost near c - d*: the neighbours of that point in lo's list.
      auto it =
          std::lower_bound(lo_units.begin(), lo_units.end(), LoUnit{c - ideal, -1, -1}, lo_before);
      for (int k = 0; k < 2; ++k) {
        if (k == 1) {
          if (it == lo_units.begin()) break;
          --it;
        }
        if (it == lo_units.end()) continue;
        const double d = c - it->cost;
        if (d <= 0) continue;
        if (const double t = time_after(d); t < improving) {
          candidates.push_back({t, u_first, it->first, u, it->unit});
        }
      }
    }
    std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
      if (a.time != b.time) return a.time < b.time;
      if (a.u_first != b.u_first) return a.u_first < b.u_first;
      return a.v_first < b.v_first;
    });
    const Candidate* chosen = nullptr;
    for (const Candidate& c : candidates) {
      const bool fits = c.v < 0 ? FitsWorst(units_[c.u], Free(lo))
                                : FitsAfterSwap(c.u, c.v, lo) && FitsAfterSwap(c.v, c.u, hi);
      if (fits) {
        chosen = &c;
        break;
      }
    }
    if (chosen == nullptr) return;
    const int u = chosen->u;
    const int v = chosen->v;
    Remove(u, hi);
    if (v >= 0) {
      Remove(v, lo);
      PlaceWorst(v, hi, whole_);
    }
    PlaceWorst(u, lo, whole_);
    most_loaded_.Update(hi, Time(hi));
    most_loaded_.Update(lo, Time(lo));
  }
}

Assignment Placer::Collect(std::vector<int> deferred, PlanThreads* threads) const {
  Assignment out;
  // An earlier assignment's vectors when one was given back (RecycleAssignment), emptied: its
  // micro-batches keep their capacity, so that a step like the last allocates nothing here.
  out.ranks = std::move(spare_ranks_);
  spare_ranks_.clear();
  out.ranks.resize(config_.ranks);
  ParallelFor(threads, config_.ranks, [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r) {
      std::vector<std::vector<int>>& rank = out.ranks[r];
      rank.resize(micro_batches_);
      for (int m = 0; m < micro_batches_; ++m) {
        rank[m].clear();
        rank[m].reserve(placed_[r * micro_batches_ + m]);
      }
    }
  });
  // In placement order, which is each rank's order of its units (a moved unit last on its new
  // rank): a pass over a lane's placements (numbered from `numbered`) rather than a walk of
  // each rank's list, whose every step waits for the previous one. Each unit is asked for
  // 2 kGatherAhead placements ahead, and its members kGatherAhead ahead, once it has come.
  auto gather = [&](const std::vector<int>& placements, int numbered) {
    for (size_t j = 0; j < placements.size(); ++j) {
      if (j + 2 * kGatherAhead < placements.size()) {
        __builtin_prefetch(&units_[placements[j + 2 * kGatherAhead]]);
      }
      if (j + kGatherAhead < placements.size()) {
        __builtin_prefetch(&members_[units_[placements[j + kGatherAhead]].begin]);
      }
      const Unit& unit = units_[placements[j]];
      if (unit.placement != numbered + static_cast<int>(j)) continue;
      std::vector<std::vector<int>>& rank = out.ranks[unit.rank];
      for (int k = unit.begin; k < unit.begin + unit.size; ++k) {
        rank[members_[k].slot].push_back(members_[k].index);
      }
    }
  };
  // A part's placements that are still live (not moved since) lie on the part's ranks alone,
  // and come before every later placement of those ranks: the parts' on the threads, then the
  // rest (the units placed after the parts, and the moves) in order.
  if (part_begin_.size() > 2) {
    const int parts = static_cast<int>(part_begin_.size()) - 1;
    ParallelEach(threads, parts, [&](size_t q) { gather(parts_[q].placements, part_begin_[q]); });
  }
  gather(placements_, whole_.numbered);
  out.deferred = std::move(deferred);
  return out;
}

// One placement with context parallelism: PlanShards at `share`, then the other samples
// around the shards (indices mapped back to the batch).
absl::StatusOr<Assignment> AssignAroundShards(
    const std::vector<Sample>& batch, const PlannerConfig& config, const LatencyModel& model,
    const std::vector<double>& densities, const std::vector<double>& speed, bool sequential,
    absl::StatusOr<ShardLayout> layout, Workspace* workspace) {
  if (!layout.ok()) return layout.status();
  if (layout->documents.empty() && layout->unplaced.empty()) {
    BuildUnits(batch, config, model, densities, /*largest_first=*/!sequential, StepRoom(config),
               workspace);
    Placer placer(batch, config, speed, workspace);
    return sequential ? placer.Sequential() : placer.Balanced();
  }
  std::vector<int> original;
  std::vector<Sample> rest;
  std::vector<double> rest_densities;
  std::vector<char> unplaced(batch.size(), 0);
  for (int i : layout->unplaced) unplaced[i] = 1;
  for (int i = 0; i < static_cast<int>(batch.size()); ++i) {
    if (layout->sharded[i] != 0 || unplaced[i] != 0) continue;
    original.push_back(i);
    rest.push_back(batch[i]);
    rest_densities.push_back(densities[i]);
  }
  Assignment out;
  if (rest.empty()) {
    out.ranks.assign(config.ranks, std::vector<std::vector<int>>(config.micro_batches));
  } else {
    int64_t room = StepRoom(config);
    for (const int64_t tokens : layout->tokens) room -= tokens;
    BuildUnits(rest, config, model, rest_densities, /*largest_first=*/!sequential, room, workspace);
    Placer placer(rest, config, speed, workspace, &*layout, &original);
    absl::StatusOr<Assignment> placed = sequential ? placer.Sequential() : placer.Balanced();
    if (!placed.ok()) return placed.status();
    out = *std::move(placed);
    for (auto& rank : out.ranks) {
      for (auto& micro_batch : rank) {
        for (int& i : micro_batch) i = original[i];
      }
    }
    for (int& i : out.deferred) i = original[i];
  }
  out.deferred.insert(out.deferred.end(), layout->unplaced.begin(), layout->unplaced.end());
  std::sort(out.deferred.begin(), out.deferred.end());
  out.shards = std::move(layout->documents);
  return out;
}

// A sample's cost in the policy's balancing metric (BuildUnits' costs).
double MetricCost(const std::vector<Sample>& batch, const PlannerConfig& config,
                  const LatencyModel& model, int i, double density) {
  switch (config.policy) {
    case Policy::kTokens:
      return static_cast<double>(batch[i].length);
    case Policy::kFlops:
      return model.SampleSeconds(batch[i], 1.0);
    default:
      return model.SampleSeconds(batch[i], density);
  }
}

// The predicted makespan of an assignment in the policy's balancing metric (`metric`: each
// sample's MetricCost) (speed factors
// applied, micro-batch overheads left out): what AssignSamples compares its candidates by.
double PlacedMakespan(const std::vector<Sample>& batch, const PlannerConfig& config,
                      const LatencyModel& model, const std::vector<double>& densities,
                      const std::vector<double>& speed, const std::vector<double>& metric,
                      const Assignment& a) {
  std::vector<double> load(config.ranks, 0.0);
  for (int r = 0; r < config.ranks; ++r) {
    for (const std::vector<int>& micro_batch : a.ranks[r]) {
      for (int i : micro_batch) load[r] += metric[i];
    }
  }
  for (const ShardedDocument& d : a.shards) {
    const Sample& s = batch[d.sample];
    for (size_t j = 0; j < d.group.size(); ++j) {
      const int64_t begin = d.cuts[j];
      const int64_t end = d.cuts[j + 1];
      double c = 0.0;
      switch (config.policy) {
        case Policy::kTokens:
          c = static_cast<double>(end - begin);
          break;
        case Policy::kFlops:
          c = ShardSeconds(model, s.length, begin, end, 1.0);
          break;
        default:
          c = ShardSeconds(model, s.length, begin, end, densities[d.sample]);
          break;
      }
      load[d.group[j]] += c;
    }
  }
  double makespan = 0.0;
  for (int r = 0; r < config.ranks; ++r) makespan = std::max(makespan, speed[r] * load[r]);
  return makespan;
}

}  // namespace

absl::StatusOr<Assignment> AssignSamples(const std::vector<Sample>& batch,
                                         const PlannerConfig& config, const LatencyModel& model,
                                         const std::vector<double>& densities) {
  return AssignSamples(batch, config, model, densities, nullptr);
}

absl::StatusOr<Assignment> AssignSamples(const std::vector<Sample>& batch,
                                         const PlannerConfig& config, const LatencyModel& model,
                                         const std::vector<double>& densities,
                                         const SampleTable* table, PlanThreads* threads,
                                         const SideLoop* side) {
  const Policy policy = config.policy;
  const bool sequential = policy == Policy::kSequential || policy == Policy::kDst;
  std::vector<double> speed(config.ranks, 1.0);
  if (policy == Policy::kSab || policy == Policy::kSparseBalance) {
    for (int r = 0; r < config.ranks && r < model.ranks(); ++r) speed[r] = model.speed_factor(r);
  }
  // Per thread (ThreadWorkspace); a step of more than kKeptScratchSamples samples frees it when
  // it ends (after the placer that reads it, declared below).
  Workspace& workspace = ThreadWorkspace();
  struct ReleaseLarge {
    Workspace& ws;
    bool large;
    ~ReleaseLarge() {
      if (large) ws = Workspace{};
    }
  } release{workspace, batch.size() > kKeptScratchSamples};
  if (config.max_shards > 1) {
    ParallelBeside(threads, side, [] {});  // nothing serial to go beside: on the threads
    // Splitting fewer documents exchanges less; splitting more evens out steps whose ranks are
    // capacity-bound or too few for their longest documents. Shards are tried at pieces of at
    // most 1, 1/2 and 1/4 of the mean rank (static: once), and the placement with the least
    // predicted makespan in the policy's metric is kept (ties: fewer splits).
    const bool adaptive = config.shard_policy != ShardPolicy::kStatic;
    // Each sample's cost in the policy's metric, once for all candidates; and what no placement
    // can beat in it (splitting allowed): a candidate within 1% of that ends the search.
    const int n = static_cast<int>(batch.size());
    std::vector<double> metric(n);
    double total = 0.0;
    double piece = 0.0;
    for (int i = 0; i < n; ++i) {
      metric[i] = MetricCost(batch, config, model, i, densities[i]);
      total += metric[i];
      piece = std::max(piece, Splittable(batch[i]) ? metric[i] / config.max_shards : metric[i]);
    }
    const double bound = MakespanLowerBound(total, piece, speed);
    // PlanShards chooses by the same costs when its metric is the placer's.
    const bool same_metric =
        config.shard_policy == ShardPolicy::kDense
            ? config.policy == Policy::kFlops
            : config.policy != Policy::kTokens && config.policy != Policy::kFlops;
    std::optional<Assignment> best;
    double best_makespan = 0.0;
    bool unsplit_tried = false;  // a layout without shards places like no splitting at all
    for (double share : {1.0, 0.5, 0.25}) {
      absl::StatusOr<ShardLayout> layout = PlanShards(batch, config, model, densities, speed, share,
                                                      same_metric ? &metric : nullptr);
      if (!layout.ok()) return layout.status();
      const bool unsplit = layout->documents.empty() && layout->unplaced.empty();
      if (unsplit && unsplit_tried) continue;
      unsplit_tried = unsplit_tried || unsplit;
      absl::StatusOr<Assignment> candidate = AssignAroundShards(
          batch, config, model, densities, speed, sequential, std::move(layout), &workspace);
      if (!candidate.ok()) return candidate.status();
      const double makespan =
          PlacedMakespan(batch, config, model, densities, speed, metric, *candidate);
      if (!best.has_value() || makespan < best_makespan * (1.0 - 1e-9)) {
        best = *std::move(candidate);
        best_makespan = makespan;
      }
      if (!adaptive || best_makespan <= bound * 1.01) break;
    }
    return *std::move(best);
  }
  BuildUnits(batch, config, model, densities, /*largest_first=*/!sequential, StepRoom(config),
             &workspace, table, threads, sequential ? nullptr : &speed, side);
  Placer placer(batch, config, speed, &workspace);
  if (sequential) return placer.Sequential();
  return placer.Balanced(threads);
}

void RecycleAssignment(Assignment&& assignment) {
  size_t members = 0;
  for (const std::vector<std::vector<int>>& rank : assignment.ranks) {
    for (const std::vector<int>& micro_batch : rank) members += micro_batch.capacity();
  }
  // A large step's arrays are freed, as its workspace is (kKeptScratchSamples).
  if (members > kKeptScratchSamples) return;
  ThreadWorkspace().spare_ranks = std::move(assignment.ranks);
}

}  // namespace sparsebalance
