#include "planner/plan_threads.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <thread>

namespace sparsebalance {

// One ParallelFor in flight: its ranges are claimed through `next`, and `done` counts those
// that have returned. It lives on the caller's stack; the caller leaves only once every range
// is done and no helper is inside it (PlanThreads::active_).
struct PlanThreads::Loop {
  absl::FunctionRef<void(size_t, size_t)> body;
  size_t n = 0;
  size_t chunks = 0;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
};

PlanThreads::PlanThreads(int threads) {
  const int helpers = std::clamp(threads, 1, kMaxPlanThreads) - 1;
  helpers_.reserve(helpers);
  for (int i = 0; i < helpers; ++i) helpers_.emplace_back([this] { Help(); });
}

PlanThreads::~PlanThreads() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : helpers_) t.join();
}

void PlanThreads::Drain(Loop& loop) {
  for (size_t c = loop.next.fetch_add(1); c < loop.chunks; c = loop.next.fetch_add(1)) {
    // Range c of `chunks` near-equal ranges: [c n / chunks, (c + 1) n / chunks).
    const size_t begin = c * loop.n / loop.chunks;
    const size_t end = (c + 1) * loop.n / loop.chunks;
    if (begin < end) loop.body(begin, end);
    loop.done.fetch_add(1);
  }
}

void PlanThreads::Help() {
  // Loops live on their callers' stacks, so a new one may have an old one's address: they are
  // told apart by number.
  uint64_t seen = 0;
  while (true) {
    Loop* loop = nullptr;
    {
      absl::MutexLock lock(&mu_);
      auto work = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || (loop_ != nullptr && loops_ != seen);
      };
      mu_.Await(absl::Condition(&work));
      if (stop_) return;
      loop = loop_;
      seen = loops_;
      ++active_;
    }
    Drain(*loop);
    absl::MutexLock lock(&mu_);
    --active_;
  }
}

void PlanThreads::Run(size_t n, size_t chunks, absl::FunctionRef<void(size_t, size_t)> body) {
  Loop loop{body, n, std::max<size_t>(1, std::min(chunks, n))};
  bool shared = false;
  {
    absl::MutexLock lock(&mu_);
    if (loop_ == nullptr && !helpers_.empty()) {
      loop_ = &loop;
      ++loops_;
      shared = true;
    }
  }
  if (!shared) {  // the helpers are busy with another caller's loop
    body(0, n);
    return;
  }
  Drain(loop);
  absl::MutexLock lock(&mu_);
  auto finished = [this, &loop]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return loop.done.load() == loop.chunks && active_ == 0;
  };
  // A helper that has not yet woken for this loop sees loop_ cleared and keeps waiting; one
  // inside it holds active_ until it has left.
  loop_ = nullptr;
  mu_.Await(absl::Condition(&finished));
}

void ParallelFor(PlanThreads* threads, size_t n, absl::FunctionRef<void(size_t, size_t)> body) {
  if (n == 0) return;
  if (threads == nullptr || threads->size() == 1 || n < kMinParallelItems) {
    body(0, n);
    return;
  }
  // A few ranges per thread, so that a thread slowed by the machine does not hold up the rest.
  threads->Run(n, static_cast<size_t>(threads->size()) * 4, body);
}

}  // namespace sparsebalance
