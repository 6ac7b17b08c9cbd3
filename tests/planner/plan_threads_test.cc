// PlanThreads: every index of a loop runs once, loops from two callers at once both finish, a
// loop beside serial work runs on the helpers meanwhile, and
// a plan is the same bytes with any number of planning threads (the client's local fallback
// plans on one thread and must agree with the planner, which plans on several).
#include "planner/plan_threads.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "planner/planner.h"
#include "planner/recall_model.h"
#include "random_cases.h"

namespace sparsebalance {
namespace {

using test_util::FailureBudget;
using test_util::MakeModel;
using test_util::MakeRandomCase;
using test_util::RandomCase;

TEST(PlanThreadsTest, EveryIndexRunsOnce) {
  for (int threads : {1, 2, 3, 8}) {
    PlanThreads pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (size_t n : {size_t{0}, size_t{1}, size_t{511}, size_t{512}, size_t{513}, size_t{10007}}) {
      std::vector<std::atomic<int>> runs(n);
      ParallelFor(&pool, n, [&](size_t begin, size_t end) {
        ASSERT_LE(begin, end);
        ASSERT_LE(end, n);
        for (size_t i = begin; i < end; ++i) runs[i].fetch_add(1);
      });
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(runs[i].load(), 1)
            << "index " << i << " of " << n << ", " << threads << " threads";
      }
    }
  }
}

// ParallelEach runs every item once however few there are, and shares even two items with
// the helpers: the helper that takes an item waits there until the caller has taken the other,
// which it could not if the loop ran on the calling thread alone.
TEST(PlanThreadsTest, ParallelEachRunsEveryItemOnceAndSharesFewItems) {
  for (int threads : {1, 2, 3}) {
    PlanThreads pool(threads);
    for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{5}, size_t{64}}) {
      std::vector<std::atomic<int>> runs(n);
      ParallelEach(&pool, n, [&](size_t i) { runs[i].fetch_add(1); });
      ParallelEach(nullptr, n, [&](size_t i) { runs[i].fetch_add(1); });
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(runs[i].load(), 2) << "item " << i << " of " << n << ", " << threads;
      }
    }
  }
  PlanThreads pool(2);
  std::atomic<int> started{0};
  std::set<std::thread::id> ran_on;
  absl::Mutex mu;
  ParallelEach(&pool, 2, [&](size_t) {
    {
      absl::MutexLock lock(&mu);
      ran_on.insert(std::this_thread::get_id());
    }
    started.fetch_add(1);
    // Both items in flight at once, or (a helper never coming) the caller alone after 10 s.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (started.load() < 2 && std::chrono::steady_clock::now() < until) {
      std::this_thread::yield();
    }
  });
  EXPECT_EQ(ran_on.size(), 2u);
}

TEST(PlanThreadsTest, SizeIsClamped) {
  EXPECT_EQ(PlanThreads(0).size(), 1);
  EXPECT_EQ(PlanThreads(-3).size(), 1);
  EXPECT_EQ(PlanThreads(kMaxPlanThreads + 5).size(), kMaxPlanThreads);
}

// Two jobs planning at once share the pool: the second caller runs its loop alone, and both
// loops cover their indices once.
TEST(PlanThreadsTest, ConcurrentCallersBothFinish) {
  PlanThreads pool(3);
  constexpr size_t kItems = 4096;
  constexpr int kLoops = 200;
  auto caller = [&](std::vector<std::atomic<int>>* runs) {
    for (int loop = 0; loop < kLoops; ++loop) {
      ParallelFor(&pool, kItems, [&](size_t begin, size_t end) {
        for (size_t i = begin; i < end; ++i) (*runs)[i].fetch_add(1);
      });
    }
  };
  std::vector<std::atomic<int>> a(kItems), b(kItems);
  std::thread other(caller, &b);
  caller(&a);
  other.join();
  for (size_t i = 0; i < kItems; ++i) {
    ASSERT_EQ(a[i].load(), kLoops) << i;
    ASSERT_EQ(b[i].load(), kLoops) << i;
  }
}

// A range that throws (std::bad_alloc in a plan too large for memory) must not end the process
// from a helper thread: the caller gets the exception once every range has returned, and the
// pool goes on working.
TEST(PlanThreadsTest, AnExceptionInARangeReachesTheCaller) {
  PlanThreads pool(3);
  for (int attempt = 0; attempt < 20; ++attempt) {
    std::atomic<int> ran{0};
    EXPECT_THROW(ParallelFor(&pool, 10000,
                             [&](size_t begin, size_t end) {
                               ran.fetch_add(static_cast<int>(end - begin));
                               if (begin <= 7777 && 7777 < end) throw std::bad_alloc();
                             }),
                 std::bad_alloc);
    EXPECT_EQ(ran.load(), 10000);  // every range ran: nothing is left touching the loop
    std::vector<std::atomic<int>> runs(4096);
    ParallelFor(&pool, runs.size(), [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) runs[i].fetch_add(1);
    });
    for (size_t i = 0; i < runs.size(); ++i) ASSERT_EQ(runs[i].load(), 1) << i;
  }
}

// ParallelBeside: alone() runs once on the calling thread, the side loop's indices once each;
// with helpers the side loop is under way while alone() still runs (alone() waits to see one of
// its indices done by another thread), and an exception from alone() reaches the caller only
// once every range has returned.
TEST(PlanThreadsTest, ParallelBesideRunsTheSideLoopOnTheHelpersMeanwhile) {
  for (int threads : {1, 2, 3, 8}) {
    PlanThreads pool(threads);
    for (size_t n : {size_t{0}, size_t{1}, size_t{511}, size_t{600}, size_t{10007}}) {
      const std::thread::id caller = std::this_thread::get_id();
      std::vector<std::atomic<int>> runs(n);
      std::atomic<int> elsewhere{0};  // side indices run on another thread
      auto body = [&](size_t begin, size_t end) {
        for (size_t i = begin; i < end; ++i) runs[i].fetch_add(1);
        if (std::this_thread::get_id() != caller) elsewhere.fetch_add(1);
      };
      const SideLoop side{n, body};
      const bool shared = threads > 1 && n >= kMinParallelItems;
      int alone_runs = 0;
      ParallelBeside(&pool, &side, [&] {
        ++alone_runs;
        if (!shared) return;
        // A helper takes a range while this thread is still here (it may have to be woken).
        for (int k = 0; k < 100000 && elsewhere.load() == 0; ++k) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
        EXPECT_GT(elsewhere.load(), 0) << threads << " threads, " << n << " items";
      });
      EXPECT_EQ(alone_runs, 1);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(runs[i].load(), 1) << "index " << i << " of " << n << ", " << threads;
      }
    }
    int alone_runs = 0;
    ParallelBeside(&pool, nullptr, [&] { ++alone_runs; });
    EXPECT_EQ(alone_runs, 1);

    std::atomic<int> ran{0};
    auto count = [&](size_t begin, size_t end) { ran.fetch_add(static_cast<int>(end - begin)); };
    const SideLoop side{10000, count};
    EXPECT_THROW(ParallelBeside(&pool, &side, [] { throw std::bad_alloc(); }), std::bad_alloc);
    // Shared with helpers, every range has returned; on one thread none had started.
    EXPECT_EQ(ran.load(), threads > 1 ? 10000 : 0);
  }
}

// A random case's config (densities, block shape, overflow, slow ranks) with policy and DST mode
// taken in turn (every pair within 24 seeds), scaled to enough ranks that planning's per-rank
// loops are split (kMinParallelItems), with a trace batch that has groups, pre-packed samples,
// sensitivities and, with splitting, documents longer than the capacity.
RandomCase LargeCase(uint64_t seed) {
  RandomCase c = MakeRandomCase(seed, /*max_samples=*/1);
  PlannerConfig& config = c.config;
  config.policy = AllPolicies()[seed % AllPolicies().size()];
  config.dst_mode = test_util::AllDstModes()[(seed / AllPolicies().size()) % 4];
  config.ranks = 520 + static_cast<int>((seed * 389) % 700);
  config.micro_batches = 1 + static_cast<int>(seed % 4);
  config.micro_batch_capacity = 16384;
  config.max_shards = (seed / 2) % 2 == 0 ? 8 : 1;  // every policy, with and without
  config.shape.layers = seed % 2 == 0 ? 4 : 2;
  const double fill = 0.4 + 0.1 * static_cast<double>(seed % 8);  // 0.4-1.1: some overflow
  c.batch = test_util::TraceBatch(config, seed, fill);
  const int64_t longest = config.max_shards * config.micro_batch_capacity;
  for (size_t i = 0; i < c.batch.size(); ++i) {
    Sample& s = c.batch[i];
    s.length = std::min(s.length, longest);
    if (config.max_shards == 1) s.length = std::min(s.length, config.micro_batch_capacity);
    s.sensitivity = static_cast<double>((i * 7919 + seed) % 101) / 100.0;
    if (i % 13 == 5) {
      s.group = 1 + i % 97;
      s.length = std::min(s.length, config.micro_batch_capacity);  // a group's are never split
    }
    if (i % 11 == 3 && s.length >= 2 && s.length <= config.micro_batch_capacity) {
      s.segments = {s.length / 2, s.length - s.length / 2};
    }
  }
  c.speed.assign(config.ranks, 1.0);
  for (int r = 0; r < config.ranks; r += 17) c.speed[r] = 0.7 + 0.05 * (r % 13);
  return c;
}

// Plans of random large cases (every policy and DST mode, groups, pre-packed samples, overflow,
// slow ranks), with and without context parallelism and a learned recall model, at 1-8 threads;
// most of over 512 ranks with 5 samples a rank, whose placement is split into parts.
TEST(PlanThreadsTest, PlansAreTheSameBytesWithAnyNumberOfThreads) {
  PlanThreads two(2), three(3), eight(8);
  FailureBudget budget;
  int planned = 0;
  int split = 0;
  int in_parts = 0;
  std::set<std::pair<Policy, DstMode>> covered;
  for (uint64_t seed = 0; seed < 24; ++seed) {
    const RandomCase c = LargeCase(seed);
    const absl::StatusOr<ValidConfig> valid = ValidConfig::Check(c.config);
    ASSERT_TRUE(valid.ok()) << valid.status();
    const LatencyModel model = MakeModel(c.config, c.speed);
    const RecallModel recall =
        seed % 2 == 0 ? test_util::LearnedRecall(c.config)
                      : RecallModel(c.config.micro_batch_capacity, c.config.shape.layers);
    const absl::StatusOr<StepPlan> alone = PlanStep(c.batch, *valid, model, recall);
    if (!alone.ok()) continue;  // an overflowing kError case: nothing to compare
    ++planned;
    covered.insert({c.config.policy, c.config.dst_mode});
    const std::string expected = CanonicalPlanText(*alone);
    if (expected.find('{') != std::string::npos) ++split;
    // Placed in parts (sample_assigner.cc's kRanksPerPart), the parts on the threads.
    const bool balanced = c.config.policy != Policy::kSequential && c.config.policy != Policy::kDst;
    if (balanced && c.config.max_shards == 1 && c.config.ranks >= 512 &&
        c.batch.size() >= 5 * static_cast<size_t>(c.config.ranks)) {
      ++in_parts;
    }
    for (PlanThreads* pool : {&two, &three, &eight}) {
      budget.Run([&] {
        const absl::StatusOr<StepPlan> plan = PlanStep(c.batch, *valid, model, recall, pool);
        ASSERT_TRUE(plan.ok()) << test_util::Describe(c) << ": " << plan.status();
        EXPECT_EQ(CanonicalPlanText(*plan), expected)
            << test_util::Describe(c) << ", " << pool->size() << " threads";
      });
    }
  }
  budget.Summarize();
  EXPECT_GE(planned, 16);
  EXPECT_GE(covered.size(), 16u);  // most policy and mode pairs planned (not only refused)
  EXPECT_GE(split, 2);             // some plans split documents over ranks
  EXPECT_GE(in_parts, 4);          // some placed in parts
}

}  // namespace
}  // namespace sparsebalance
