// Large per-step arrays kept per thread between plans and reused: faulting fresh pages in costs
// more than whole phases of a plan (about 10 us a 4 KiB page on the development VM, at 65,536
// samples megabytes a phase), and every user overwrites what it reads, so nothing carries over
// from one plan to the next but capacity.
//
//   ThreadScratch<TableStorage> storage(batch.size());
//   storage->terms.resize(...);
#ifndef SPARSEBALANCE_PLANNER_THREAD_SCRATCH_H_
#define SPARSEBALANCE_PLANNER_THREAD_SCRATCH_H_

#include <cstddef>

namespace sparsebalance {

// A step of more samples than this releases its threads' scratch when it ends instead of keeping
// it, so that one very large batch (up to kMaxBatchSamples, 2^24) does not leave each planning
// thread holding gigabytes.
inline constexpr size_t kKeptScratchSamples = size_t{1} << 18;

// The calling thread's Storage for one step, or storage of its own where a holder on the same
// thread has the thread's already (a call made while another on this thread is still planning).
template <typename Storage>
class ThreadScratch {
 public:
  // For a step of `samples` samples.
  explicit ThreadScratch(size_t samples)
      : large_(samples > kKeptScratchSamples), held_(Shared().in_use ? &own_ : &Shared()) {
    held_->in_use = true;
  }
  ~ThreadScratch() {
    if (large_) held_->storage = Storage{};  // frees it
    held_->in_use = false;
  }
  ThreadScratch(const ThreadScratch&) = delete;
  ThreadScratch& operator=(const ThreadScratch&) = delete;

  Storage& operator*() const { return held_->storage; }
  Storage* operator->() const { return &held_->storage; }

 private:
  struct Held {
    Storage storage;
    bool in_use = false;
  };
  static Held& Shared() {
    thread_local Held held;
    return held;
  }
  bool large_;
  Held own_;
  Held* held_;
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_THREAD_SCRATCH_H_
