#include "planner/plan_threads.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <thread>

namespace sparsebalance {

// One ParallelFor in flight: its ranges are claimed through `next`, and `done` counts those
// that have returned. It lives on the caller's stack. A range that throws (std::bad_alloc in a
// large plan) leaves its exception in `error` for the caller to rethrow: on a helper thread it
// would end the process.
struct PlanThreads::Loop {
  absl::FunctionRef<void(size_t, size_t)> body;
  size_t n = 0;
  size_t chunks = 0;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // written once, by whoever set `failed`
};

namespace {

// How long a helper keeps looking for the next loop before it sleeps: a plan runs some 60 loops,
// most of them back to back, and waking a sleeping thread takes longer than many of them (tens
// of microseconds on a virtual machine). Between plans (the caller destroying the last plan and
// checking the next batch, about 1.2 ms at 65,536 samples) the helpers sleep.
constexpr std::chrono::microseconds kSpinFor(200);

void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield" ::: "memory");  // a hint, as pause: no call into the kernel
#else
  std::this_thread::yield();
#endif
}

}  // namespace

PlanThreads::PlanThreads(int threads) {
  const int helpers = std::clamp(threads, 1, kMaxPlanThreads) - 1;
  helpers_.reserve(helpers);
  for (int i = 0; i < helpers; ++i) helpers_.emplace_back([this] { Help(); });
}

PlanThreads::~PlanThreads() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    wake_.SignalAll();
  }
  for (std::thread& t : helpers_) t.join();
}

void PlanThreads::Drain(Loop& loop) {
  for (size_t c = loop.next.fetch_add(1); c < loop.chunks; c = loop.next.fetch_add(1)) {
    // Range c of `chunks` near-equal ranges: [c n / chunks, (c + 1) n / chunks).
    const size_t begin = c * loop.n / loop.chunks;
    const size_t end = (c + 1) * loop.n / loop.chunks;
    if (begin < end) {
      try {
        loop.body(begin, end);
      } catch (...) {
        bool expected = false;
        if (loop.failed.compare_exchange_strong(expected, true)) {
          loop.error = std::current_exception();
        }
      }
    }
    loop.done.fetch_add(1);
  }
}

void PlanThreads::Help() {
  uint64_t seen = 0;  // loops_ when this helper last looked at loop_
  while (!stop_) {
    const auto until = std::chrono::steady_clock::now() + kSpinFor;
    while (loops_.load() == seen && !stop_ && std::chrono::steady_clock::now() < until) {
      for (int i = 0; i < 64; ++i) Pause();
    }
    if (loops_.load() == seen) {
      absl::MutexLock lock(&mu_);
      while (loops_.load() == seen && !stop_) wake_.Wait(&mu_);
      continue;
    }
    const uint64_t announced = loops_.load();
    // Counted in before the loop is read: a caller that withdraws its loop after this waits
    // for us to leave, and one that withdrew it before leaves a null here. Draining a loop
    // whose ranges are all claimed does nothing.
    active_.fetch_add(1);
    if (Loop* loop = loop_.load(); loop != nullptr) Drain(*loop);
    active_.fetch_sub(1);
    seen = announced;
  }
}

void PlanThreads::Run(size_t n, size_t chunks, absl::FunctionRef<void(size_t, size_t)> body) {
  Share(n, chunks, body, nullptr);
}

void PlanThreads::RunBeside(size_t n, size_t chunks, absl::FunctionRef<void(size_t, size_t)> body,
                            absl::FunctionRef<void()> alone) {
  Share(n, chunks, body, &alone);
}

void PlanThreads::Share(size_t n, size_t chunks, absl::FunctionRef<void(size_t, size_t)> body,
                        const absl::FunctionRef<void()>* alone) {
  Loop loop{body, n, std::max<size_t>(1, std::min(chunks, n)), {0}, {0}, {false}, nullptr};
  Loop* none = nullptr;
  if (helpers_.empty() || !loop_.compare_exchange_strong(none, &loop)) {
    // Alone, or the helpers are busy with another caller's loop.
    if (alone != nullptr) (*alone)();
    body(0, n);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    loops_.fetch_add(1);  // only the caller holding loop_ moves it
    wake_.SignalAll();
  }
  // An exception from alone() must not leave the loop shared (it lives on this stack): it is
  // kept until the ranges are done, and rethrown before theirs.
  std::exception_ptr alone_error;
  if (alone != nullptr) {
    try {
      (*alone)();
    } catch (...) {
      alone_error = std::current_exception();
    }
  }
  Drain(loop);
  loop_.store(nullptr);
  // Every range has been claimed; wait for those still running and for helpers that may hold
  // the loop (a few microseconds: the ranges are short). A helper counted in active_ may be in
  // another caller's loop that started since: that one ends as quickly.
  while (loop.done.load() != loop.chunks || active_.load() != 0) Pause();
  if (alone_error != nullptr) std::rethrow_exception(alone_error);
  if (loop.error != nullptr) std::rethrow_exception(loop.error);
}

size_t ChunkCount(const PlanThreads* threads, size_t n) {
  if (n == 0) return 0;
  if (threads == nullptr || threads->size() == 1 || n < kMinParallelItems) return 1;
  // A few ranges per thread, so that a thread slowed by the machine does not hold up the rest.
  return std::min(n, static_cast<size_t>(threads->size()) * 4);
}

void ParallelChunks(PlanThreads* threads, size_t n,
                    absl::FunctionRef<void(size_t, size_t, size_t)> body) {
  const size_t chunks = ChunkCount(threads, n);
  if (chunks <= 1) {
    if (n > 0) body(0, 0, n);
    return;
  }
  // Run over chunk numbers: each range is one chunk.
  threads->Run(chunks, chunks, [&](size_t first, size_t last) {
    for (size_t c = first; c < last; ++c) body(c, c * n / chunks, (c + 1) * n / chunks);
  });
}

void ParallelFor(PlanThreads* threads, size_t n, absl::FunctionRef<void(size_t, size_t)> body) {
  ParallelChunks(threads, n, [&](size_t, size_t begin, size_t end) { body(begin, end); });
}

void ParallelEach(PlanThreads* threads, size_t n, absl::FunctionRef<void(size_t)> body) {
  if (threads == nullptr || threads->size() == 1 || n < 2) {
    for (size_t i = 0; i < n; ++i) body(i);
    return;
  }
  threads->Run(n, n, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) body(i);
  });
}

void ParallelBeside(PlanThreads* threads, const SideLoop* side, absl::FunctionRef<void()> alone) {
  if (side == nullptr || side->n == 0) {
    alone();
    return;
  }
  const size_t chunks = side->chunks == 0 ? ChunkCount(threads, side->n)
                        : threads == nullptr || threads->size() == 1
                            ? 1
                            : std::min(side->chunks, side->n);
  if (chunks <= 1) {
    alone();
    side->body(0, side->n);
    return;
  }
  threads->RunBeside(side->n, chunks, side->body, alone);
}

}  // namespace sparsebalance
