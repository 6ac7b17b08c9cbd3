#include "planner/rank_queue.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace sparsebalance {
namespace {

// The placement's count of first ranks (sample_assigner.cc's kCandidates).
constexpr int kCandidates = 4;
template <bool kLargestFirst>
using RankQueue = RankQueueOf<kLargestFirst, kCandidates>;

// The ranks in order by (time, rank), least first, or largest first.
std::vector<int> Sorted(const std::vector<double>& times, bool largest_first) {
  std::vector<int> ranks(times.size());
  for (size_t r = 0; r < ranks.size(); ++r) ranks[r] = static_cast<int>(r);
  std::sort(ranks.begin(), ranks.end(), [&](int a, int b) {
    if (times[a] != times[b]) return largest_first ? times[a] > times[b] : times[a] < times[b];
    return largest_first ? a > b : a < b;
  });
  return ranks;
}

template <bool kLargestFirst>
std::vector<int> Visited(RankQueue<kLargestFirst>& queue, size_t limit) {
  std::vector<int> visited;
  queue.VisitInOrder([&](int r) {
    visited.push_back(r);
    return visited.size() < limit;
  });
  return visited;
}

// The queue's order equals a sorted reference's after each of many random updates: the first
// rank, the first kCandidates, a whole walk and one cut short, on rank counts below, at and
// above kCandidates, powers of two and not, with many equal times (ties go by rank) and signed
// zeros.
template <bool kLargestFirst>
void ExpectOrderLikeSorted() {
  std::mt19937_64 random(7);
  for (int ranks : {1, 2, 3, 4, 5, 7, 8, 9, 31, 64, 100, 512}) {
    SCOPED_TRACE(absl::StrCat("ranks ", ranks, kLargestFirst ? ", largest first" : ""));
    std::vector<double> times(ranks);
    auto draw = [&]() {
      switch (random() % 4) {
        case 0:
          return static_cast<double>(random() % 5);  // ties
        case 1:
          return (random() % 2) != 0 ? -0.0 : 0.0;
        default:
          return std::ldexp(static_cast<double>(random() % 1000000), -10) - 100.0;
      }
    };
    for (double& time : times) time = draw();
    RankQueue<kLargestFirst> queue;
    queue.Reset(ranks, [&](int r) { return times[r]; });
    for (int step = 0; step < 2000; ++step) {
      const std::vector<int> sorted = Sorted(times, kLargestFirst);
      ASSERT_EQ(queue.First(), sorted[0]) << "step " << step;
      std::array<int, kCandidates> first;
      const int count = queue.FirstRanks(&first);
      ASSERT_EQ(count, std::min(ranks, kCandidates)) << "step " << step;
      for (int k = 0; k < count; ++k) ASSERT_EQ(first[k], sorted[k]) << "step " << step;
      if (step % 50 == 0) {
        ASSERT_EQ(Visited(queue, sorted.size()), sorted) << "step " << step;
        const size_t cut = 1 + random() % sorted.size();
        ASSERT_EQ(Visited(queue, cut), std::vector<int>(sorted.begin(), sorted.begin() + cut))
            << "step " << step;
      }
      // Mostly one of the first ranks, as the placement updates them, grown; else any rank, any
      // time.
      int r;
      if (random() % 4 != 0) {
        r = sorted[random() % count];
        times[r] += (kLargestFirst ? -1.0 : 1.0) * static_cast<double>(random() % 8);
      } else {
        r = static_cast<int>(random() % ranks);
        times[r] = draw();
      }
      queue.Update(r, times[r]);
    }
  }
}

TEST(RankQueueTest, LeastFirstOrderIsTheSortedOrder) { ExpectOrderLikeSorted<false>(); }

TEST(RankQueueTest, LargestFirstOrderIsTheSortedOrder) { ExpectOrderLikeSorted<true>(); }

// A queue reset to fewer ranks forgets the ranks it had.
TEST(RankQueueTest, ResetToFewerRanks) {
  RankQueue<false> queue;
  queue.Reset(100, [](int r) { return 100.0 - r; });
  queue.Reset(3, [](int r) { return static_cast<double>(r % 2); });
  std::array<int, kCandidates> first;
  ASSERT_EQ(queue.FirstRanks(&first), 3);
  EXPECT_EQ(first[0], 0);
  EXPECT_EQ(first[1], 2);
  EXPECT_EQ(first[2], 1);
  EXPECT_EQ(Visited(queue, 10), (std::vector<int>{0, 2, 1}));
}

}  // namespace
}  // namespace sparsebalance
