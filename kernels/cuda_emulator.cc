#include "kernels/cuda_emulator.h"

#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/parallel.h"

namespace sparsebalance {
namespace kernels {
namespace emu {
namespace {

constexpr unsigned kWarpSize = 32;
constexpr unsigned kMaxThreadsPerBlock = 1024;
// Each thread's stack: the kernels keep a head_dim-long row or two in registers (local arrays).
constexpr size_t kStackBytes = 128 * 1024;

enum class Wait { kNone, kBlock, kWarp, kDone };

struct Fiber {
  ucontext_t context;
  ThreadIds ids;
  Wait wait = Wait::kNone;
  unsigned exchanges = 0;  // warp exchanges made: which of the two slot sets the next one uses
};

// One OS thread's CTA runner: its fibers, their stacks and the CTA's shared memory, reused from
// one CTA to the next.
class Runner {
 public:
  absl::Status RunCta(const char* name, const LaunchShape& shape, const Index3& block,
                      const std::function<void()>& thread);

  Fiber& current() { return *current_; }
  void Yield(Wait wait) {
    current_->wait = wait;
    swapcontext(&current_->context, &scheduler_);
  }
  void* dynamic_shared() { return dynamic_.data(); }
  void* StaticShared(const void* key, size_t bytes) {
    std::vector<unsigned char>& array = static_[key];
    if (array.empty()) array.assign(std::max<size_t>(bytes, 1), 0);
    return array.data();
  }
  uint64_t* slots(unsigned warp, unsigned set) { return &slots_[(warp * 2 + set) * kWarpSize]; }

 private:
  static void Entry();

  ucontext_t scheduler_;
  std::vector<Fiber> fibers_;
  std::vector<std::unique_ptr<char[]>> stacks_;
  Fiber* current_ = nullptr;
  const std::function<void()>* thread_ = nullptr;
  std::vector<unsigned char> dynamic_;
  std::map<const void*, std::vector<unsigned char>> static_;
  std::vector<uint64_t> slots_;  // per warp, two sets of 32 exchange slots
};

thread_local Runner* runner = nullptr;

Runner& ThisRunner() {
  thread_local Runner own;
  return own;
}

void Runner::Entry() {
  Runner& r = *runner;
  (*r.thread_)();
  r.current_->wait = Wait::kDone;
  // Returning switches to uc_link, the scheduler.
}

absl::Status Runner::RunCta(const char* name, const LaunchShape& shape, const Index3& block,
                            const std::function<void()>& thread) {
  const unsigned threads = shape.block.x * shape.block.y * shape.block.z;
  const unsigned warps = (threads + kWarpSize - 1) / kWarpSize;
  if (fibers_.size() < threads) fibers_.resize(threads);
  while (stacks_.size() < threads) stacks_.push_back(std::make_unique<char[]>(kStackBytes));
  dynamic_.assign(std::max<size_t>(shape.dynamic_shared, 1), 0);
  static_.clear();
  slots_.assign(static_cast<size_t>(warps) * 2 * kWarpSize, 0);
  thread_ = &thread;
  runner = this;
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = fibers_[t];
    f.ids.thread = {t % shape.block.x, (t / shape.block.x) % shape.block.y,
                    t / (shape.block.x * shape.block.y)};
    f.ids.block = block;
    f.ids.block_dim = shape.block;
    f.ids.grid_dim = shape.grid;
    f.wait = Wait::kNone;
    f.exchanges = 0;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = stacks_[t].get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &scheduler_;
    makecontext(&f.context, &Runner::Entry, 0);
  }
  while (true) {
    for (unsigned t = 0; t < threads; ++t) {
      if (fibers_[t].wait != Wait::kNone) continue;
      current_ = &fibers_[t];
      swapcontext(&scheduler_, &fibers_[t].context);
    }
    // Every fiber has returned or waits at a barrier.
    unsigned live = 0;
    unsigned at_block = 0;
    for (unsigned t = 0; t < threads; ++t) {
      live += fibers_[t].wait != Wait::kDone;
      at_block += fibers_[t].wait == Wait::kBlock;
    }
    if (live == 0) return absl::OkStatus();
    if (at_block == live) {
      for (unsigned t = 0; t < threads; ++t) {
        if (fibers_[t].wait == Wait::kBlock) fibers_[t].wait = Wait::kNone;
      }
      continue;
    }
    bool released = false;
    for (unsigned w = 0; w < warps; ++w) {
      const unsigned first = w * kWarpSize;
      const unsigned last = std::min(threads, first + kWarpSize);
      bool all = true;
      bool any = false;
      for (unsigned t = first; t < last; ++t) {
        if (fibers_[t].wait == Wait::kDone) continue;
        any = true;
        all = all && fibers_[t].wait == Wait::kWarp;
      }
      if (!any || !all) continue;
      for (unsigned t = first; t < last; ++t) {
        if (fibers_[t].wait == Wait::kWarp) fibers_[t].wait = Wait::kNone;
      }
      released = true;
    }
    if (!released) {
      return absl::InternalError(absl::StrCat(
          name, ": the threads of CTA (", block.x, ", ", block.y, ", ", block.z,
          ") wait at different barriers (__syncthreads or a warp exchange in divergent code): "
          "a deadlock on a GPU"));
    }
  }
}

std::atomic<int64_t> to_device_copies{0}, to_device_bytes{0}, to_host_copies{0}, to_host_bytes{0};

}  // namespace

const ThreadIds& Current() { return runner->current().ids; }

void SyncThreads() { runner->Yield(Wait::kBlock); }

void WarpExchange(uint64_t value, uint64_t (&lanes)[32]) {
  Runner& r = *runner;
  Fiber& f = r.current();
  const unsigned t =
      f.ids.thread.x + f.ids.block_dim.x * (f.ids.thread.y + f.ids.block_dim.y * f.ids.thread.z);
  const unsigned warp = t / kWarpSize;
  // Two slot sets taken in turn: a lane may reach its next exchange (and write) before a slower
  // lane has read this one, but not its next-but-one.
  uint64_t* slots = r.slots(warp, f.exchanges % 2);
  ++f.exchanges;
  slots[t % kWarpSize] = value;
  r.Yield(Wait::kWarp);
  std::memcpy(lanes, slots, sizeof(lanes));
}

void* DynamicShared() { return runner->dynamic_shared(); }

void* StaticShared(const void* key, size_t bytes) { return runner->StaticShared(key, bytes); }

absl::Status Run(const char* name, const LaunchShape& shape, const std::function<void()>& thread) {
  const uint64_t threads = uint64_t{shape.block.x} * shape.block.y * shape.block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || shape.block.z > 64) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": invalid block of ", shape.block.x,
                                                   " x ", shape.block.y, " x ", shape.block.z,
                                                   " threads (at most 1024)"));
  }
  const uint64_t ctas = uint64_t{shape.grid.x} * shape.grid.y * shape.grid.z;
  if (shape.grid.x == 0 || shape.grid.y == 0 || shape.grid.z == 0 || shape.grid.y > 65535 ||
      shape.grid.z > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": invalid grid of ", shape.grid.x, " x ",
                                                   shape.grid.y, " x ", shape.grid.z));
  }
  if (shape.dynamic_shared > shape.shared_limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": ", shape.dynamic_shared, " bytes of dynamic shared memory, above the kernel's ",
        shape.shared_limit, " (cudaFuncAttributeMaxDynamicSharedMemorySize)"));
  }
  std::mutex error_mutex;
  absl::Status first_error;
  std::atomic<bool> failed{false};
  ParallelFor(static_cast<int64_t>(ctas), 0, [&](int, int64_t cta) {
    if (failed.load()) return;
    Index3 block;
    block.x = static_cast<unsigned>(cta % shape.grid.x);
    block.y = static_cast<unsigned>((cta / shape.grid.x) % shape.grid.y);
    block.z = static_cast<unsigned>(cta / (uint64_t{shape.grid.x} * shape.grid.y));
    absl::Status s = ThisRunner().RunCta(name, shape, block, thread);
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (first_error.ok()) first_error = s;
      failed = true;
    }
  });
  return first_error;
}

TransferStats Transfers() {
  TransferStats s;
  s.to_device_copies = to_device_copies.load();
  s.to_device_bytes = to_device_bytes.load();
  s.to_host_copies = to_host_copies.load();
  s.to_host_bytes = to_host_bytes.load();
  return s;
}

void ResetTransfers() {
  to_device_copies = 0;
  to_device_bytes = 0;
  to_host_copies = 0;
  to_host_bytes = 0;
}

// Filled with 0xff bytes (a NaN in every float type), as unwritten device memory is garbage: a
// kernel that reads what nothing wrote shows up in its results.
void* Allocate(size_t bytes) {
  void* pointer = std::malloc(std::max<size_t>(bytes, 1));
  if (pointer != nullptr) std::memset(pointer, 0xff, std::max<size_t>(bytes, 1));
  return pointer;
}

void Free(void* pointer) { std::free(pointer); }

void CopyToDevice(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  ++to_device_copies;
  to_device_bytes += static_cast<int64_t>(bytes);
}

void CopyToHost(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  ++to_host_copies;
  to_host_bytes += static_cast<int64_t>(bytes);
}

}  // namespace emu
}  // namespace kernels
}  // namespace sparsebalance
