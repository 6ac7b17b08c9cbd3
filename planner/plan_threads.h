// A few threads that planning's independent loops (per sample, per rank) are split over. Each
// loop body writes only what belongs to its own indices, and every sum over them is taken
// afterwards in index order, so a plan is the same bytes whatever the number of threads: the
// planner plans on several, the client's local fallback on one, and both must agree.
//
//   PlanThreads threads(4);                      // the caller and 3 helpers
//   ParallelFor(&threads, n, [&](size_t begin, size_t end) { ... });
//   ParallelFor(nullptr, n, body);                // the same on the calling thread
//
// One loop runs at a time: a ParallelFor that finds the helpers busy with another call's loop
// (two jobs planning at once) runs its own loop on its calling thread.
#ifndef SPARSEBALANCE_PLANNER_PLAN_THREADS_H_
#define SPARSEBALANCE_PLANNER_PLAN_THREADS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace sparsebalance {

// The most threads a PlanThreads takes (the caller included).
inline constexpr int kMaxPlanThreads = 64;

class PlanThreads {
 public:
  // `threads` in [1, kMaxPlanThreads] (clamped): the calling thread plus threads - 1 helpers.
  explicit PlanThreads(int threads);
  ~PlanThreads();
  PlanThreads(const PlanThreads&) = delete;
  PlanThreads& operator=(const PlanThreads&) = delete;

  int size() const { return static_cast<int>(helpers_.size()) + 1; }

  // Calls body(begin, end) on consecutive ranges that cover [0, n) once, at most `chunks` of
  // them, on the helpers and the calling thread; returns when all have returned. An exception
  // thrown by a range is rethrown here (the first, once every range has returned).
  void Run(size_t n, size_t chunks, absl::FunctionRef<void(size_t, size_t)> body);
  // The same, but the calling thread first runs alone() while the helpers take the ranges;
  // then it takes those left (ParallelBeside).
  void RunBeside(size_t n, size_t chunks, absl::FunctionRef<void(size_t, size_t)> body,
                 absl::FunctionRef<void()> alone);

 private:
  struct Loop;
  // Run and RunBeside: shares the loop, runs alone() first when given.
  void Share(size_t n, size_t chunks, absl::FunctionRef<void(size_t, size_t)> body,
             const absl::FunctionRef<void()>* alone);
  void Help();
  // Claims and runs the loop's ranges until none is left.
  static void Drain(Loop& loop);

  // The loop being shared, if any, and the helpers that may be reading it: a caller leaves
  // only once it has withdrawn its loop and no helper is inside (see Help).
  std::atomic<Loop*> loop_{nullptr};
  std::atomic<int> active_{0};
  std::atomic<uint64_t> loops_{0};  // loops shared so far: loop_'s number
  std::atomic<bool> stop_{false};
  // Helpers that found no loop for a while sleep here until the next one.
  absl::Mutex mu_;
  absl::CondVar wake_;
  std::vector<std::thread> helpers_;
};

// Loops of fewer items than this run on the calling thread: handing them over costs more.
inline constexpr size_t kMinParallelItems = 512;

// body(begin, end) over [0, n) in ranges: on `threads` (when given and the loop is large
// enough) or on the calling thread as one range. The body must write only its own indices'
// results.
void ParallelFor(PlanThreads* threads, size_t n, absl::FunctionRef<void(size_t, size_t)> body);

// body(i) for each i in [0, n), each item a range of its own on `threads` (when given), however
// few the items: for loops of a few heavy items (a restored job's steps, milliseconds each),
// which ParallelFor would leave on the calling thread. Items may run in any order.
void ParallelEach(PlanThreads* threads, size_t n, absl::FunctionRef<void(size_t)> body);

// How many ranges ParallelChunks splits a loop of n items into on `threads`: 1 where
// ParallelFor would run it on the calling thread.
size_t ChunkCount(const PlanThreads* threads, size_t n);

// body(chunk, begin, end) for each of ChunkCount(threads, n) ranges of [0, n), range c being
// [c n / chunks, (c + 1) n / chunks): for loops whose output has no fixed place per index,
// which each range writes to its own buffer and the caller joins in range order.
void ParallelChunks(PlanThreads* threads, size_t n,
                    absl::FunctionRef<void(size_t, size_t, size_t)> body);

// A loop that can run beside serial work it does not depend on (ParallelBeside): body(begin,
// end) over [0, n), writing only its own indices' results, as for ParallelFor. `body` refers to
// a callable that must outlive the SideLoop (a named lambda, not a temporary).
struct SideLoop {
  size_t n;
  absl::FunctionRef<void(size_t, size_t)> body;
  // The ranges it is split into where it is shared: 0 for ChunkCount's (items too few for it,
  // such as blocks of samples, may still be worth sharing).
  size_t chunks = 0;
};

// Runs alone() on the calling thread while the helpers run `side`'s ranges, then the ranges
// left on the calling thread too; returns when both are done. For a serial stretch (the
// placement's sort and deal of units to parts, about 1.6 ms at 65,536 samples over 4,096 ranks)
// that would otherwise leave the helpers idle. Without `side`: alone(). Where ParallelFor would run
// `side` on the calling thread: alone(), then `side` there. alone() must neither read what `side`
// writes nor write what it reads, and must not start loops of its own (they would find the helpers
// taken and run on the calling thread).
void ParallelBeside(PlanThreads* threads, const SideLoop* side, absl::FunctionRef<void()> alone);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_PLAN_THREADS_H_
