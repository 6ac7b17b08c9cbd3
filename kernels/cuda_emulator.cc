#include "kernels/cuda_emulator.h"

// Fibers switch by hand on x86-64 Linux, with swapcontext elsewhere and under sanitizers (see
// Switch below).
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define SB_EMU_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SB_EMU_SANITIZED 1
#endif
#if defined(__x86_64__) && defined(__linux__) && !defined(SB_EMU_SANITIZED)
#define SB_EMU_FAST_SWITCH 1
#else
#define SB_EMU_FAST_SWITCH 0
#endif

#if !SB_EMU_FAST_SWITCH
#include <ucontext.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
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
// The most one lane passes in a warp exchange (an MMA's A and B fragments: 24 bytes).
constexpr size_t kMaxShareBytes = 32;

// Switching fibers. glibc's swapcontext saves and restores the signal mask with a system call
// and the floating-point environment on every switch: two thirds of an emulated kernel test's
// time went there. On x86-64 a switch here saves only what the ABI says a callee keeps (rbx, rbp,
// r12-r15 and the stack pointer) and costs a few nanoseconds. Elsewhere, and under sanitizers
// (which must see stack switches through swapcontext), it is swapcontext.

#if SB_EMU_FAST_SWITCH
}  // namespace
}  // namespace emu
}  // namespace kernels
}  // namespace sparsebalance

// sb_emu_switch(save, load): pushes the callee-saved registers, stores the stack pointer in
// *save, takes `load` as the stack pointer and pops what the other side pushed (or what
// PrepareStack laid out), returning into it.
extern "C" void sb_emu_switch(void** save, void* load);
asm(R"(
  .text
  .globl sb_emu_switch
  .hidden sb_emu_switch
  .type sb_emu_switch, @function
sb_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size sb_emu_switch, .-sb_emu_switch
)");

namespace sparsebalance {
namespace kernels {
namespace emu {
namespace {

// A fiber's or the scheduler's saved stack pointer.
struct Context {
  void* sp = nullptr;
};

void Switch(Context* save, const Context& load) { sb_emu_switch(&save->sp, load.sp); }

// Lays out a fresh stack so that the first switch to it "returns" into entry() as if entry had
// been called: six zero registers (rbp = 0 ends backtraces), entry's address, then a null return
// address, with the stack pointer 8 bytes past a 16-byte boundary at entry as the ABI wants.
// entry never returns.
void PrepareStack(Context* context, char* stack, size_t bytes, void (*entry)()) {
  char* top = stack + bytes;
  top -= reinterpret_cast<uintptr_t>(top) % 16;
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;
  *--sp = reinterpret_cast<void*>(entry);
  for (int i = 0; i < 6; ++i) *--sp = nullptr;
  context->sp = sp;
}
#else
struct Context {
  ucontext_t context;
};

void Switch(Context* save, const Context& load) { swapcontext(&save->context, &load.context); }

void PrepareStack(Context* context, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&context->context);
  context->context.uc_stack.ss_sp = stack;
  context->context.uc_stack.ss_size = bytes;
  context->context.uc_link = nullptr;  // entry never returns
  makecontext(&context->context, entry, 0);
}
#endif

enum class Wait { kNone, kBlock, kWarp, kDone };

struct Fiber {
  Context context;
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
    Switch(&current_->context, scheduler_);
  }
  void* dynamic_shared() { return dynamic_.data(); }
  void* StaticShared(const void* key, size_t bytes) {
    std::vector<unsigned char>& array = static_[key];
    if (array.empty()) array.assign(std::max<size_t>(bytes, 1), 0);
    return array.data();
  }
  unsigned char* slots(unsigned warp, unsigned set) {
    return &slots_[(warp * 2 + set) * kWarpSize * kMaxShareBytes];
  }

 private:
  [[noreturn]] static void Entry();

  Context scheduler_;
  std::vector<Fiber> fibers_;
  std::vector<std::unique_ptr<char[]>> stacks_;
  Fiber* current_ = nullptr;
  const std::function<void()>* thread_ = nullptr;
  std::vector<unsigned char> dynamic_;
  std::map<const void*, std::vector<unsigned char>> static_;
  std::vector<unsigned char> slots_;  // per warp, two sets of 32 exchange slots
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
  // Back to the scheduler for good: a fiber that is done is never switched to again, and its
  // stack is laid out afresh for the next CTA.
  Context finished;
  Switch(&finished, r.scheduler_);
  std::abort();
}

absl::Status Runner::RunCta(const char* name, const LaunchShape& shape, const Index3& block,
                            const std::function<void()>& thread) {
  const unsigned threads = shape.block.x * shape.block.y * shape.block.z;
  const unsigned warps = (threads + kWarpSize - 1) / kWarpSize;
  if (fibers_.size() < threads) fibers_.resize(threads);
  // Not zeroed: a fiber touches only the pages of its stack that it uses.
  while (stacks_.size() < threads) stacks_.emplace_back(new char[kStackBytes]);
  dynamic_.assign(std::max<size_t>(shape.dynamic_shared, 1), 0);
  static_.clear();
  slots_.assign(static_cast<size_t>(warps) * 2 * kWarpSize * kMaxShareBytes, 0);
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
    PrepareStack(&f.context, stacks_[t].get(), kStackBytes, &Runner::Entry);
  }
  while (true) {
    for (unsigned t = 0; t < threads; ++t) {
      if (fibers_[t].wait != Wait::kNone) continue;
      current_ = &fibers_[t];
      Switch(&scheduler_, fibers_[t].context);
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

void WarpShare(const void* mine, size_t bytes, void* lanes) {
  Runner& r = *runner;
  Fiber& f = r.current();
  const unsigned t =
      f.ids.thread.x + f.ids.block_dim.x * (f.ids.thread.y + f.ids.block_dim.y * f.ids.thread.z);
  const unsigned warp = t / kWarpSize;
  // Two slot sets taken in turn: a lane may reach its next exchange (and write) before a slower
  // lane has read this one, but not its next-but-one.
  unsigned char* slots = r.slots(warp, f.exchanges % 2);
  ++f.exchanges;
  std::memcpy(slots + (t % kWarpSize) * kMaxShareBytes, mine, bytes);
  r.Yield(Wait::kWarp);
  for (unsigned lane = 0; lane < kWarpSize; ++lane) {
    std::memcpy(static_cast<unsigned char*>(lanes) + lane * bytes, slots + lane * kMaxShareBytes,
                bytes);
  }
}

void WarpExchange(uint64_t value, uint64_t (&lanes)[32]) {
  WarpShare(&value, sizeof(value), lanes);
}

unsigned LaneId() {
  const ThreadIds& ids = Current();
  return (ids.thread.x + ids.block_dim.x * (ids.thread.y + ids.block_dim.y * ids.thread.z)) %
         kWarpSize;
}

float ShflXor(float value, unsigned lane_mask) {
  float lanes[kWarpSize];
  WarpShare(&value, sizeof(value), lanes);
  return lanes[LaneId() ^ (lane_mask % kWarpSize)];
}

namespace {

float Bf16Half(uint32_t pair, int half) {
  return Bf16ToFloat(static_cast<uint16_t>(half == 0 ? pair & 0xffffu : pair >> 16));
}

}  // namespace

void MmaBf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
  struct Fragments {
    uint32_t a[4];
    uint32_t b[2];
  };
  Fragments mine;
  std::memcpy(mine.a, a, sizeof(mine.a));
  std::memcpy(mine.b, b, sizeof(mine.b));
  Fragments all[kWarpSize];
  WarpShare(&mine, sizeof(mine), all);
  // The whole A (16 x 16) and B (16 x 8) from their fragments (PTX ISA, mma.m16n8k16, .bf16):
  // lane = 4 * group + index; A's registers 0..3 hold rows (group, group + 8, group, group + 8)
  // and columns (2 index, 2 index, 2 index + 8, 2 index + 8) and the next column; B's
  // registers 0..1 hold rows (2 index, 2 index + 8) and the next row, column group.
  float am[16][16];
  float bm[16][8];
  for (unsigned lane = 0; lane < kWarpSize; ++lane) {
    const unsigned group = lane / 4;
    const unsigned index = lane % 4;
    for (int reg = 0; reg < 4; ++reg) {
      const unsigned row = group + (reg % 2) * 8;
      const unsigned col = 2 * index + (reg / 2) * 8;
      am[row][col] = Bf16Half(all[lane].a[reg], 0);
      am[row][col + 1] = Bf16Half(all[lane].a[reg], 1);
    }
    for (int reg = 0; reg < 2; ++reg) {
      const unsigned row = 2 * index + reg * 8;
      bm[row][group] = Bf16Half(all[lane].b[reg], 0);
      bm[row + 1][group] = Bf16Half(all[lane].b[reg], 1);
    }
  }
  // D's registers 0..3: rows (group, group, group + 8, group + 8), columns 2 index (+ 1).
  const unsigned lane = LaneId();
  for (int reg = 0; reg < 4; ++reg) {
    const unsigned row = lane / 4 + (reg / 2) * 8;
    const unsigned col = 2 * (lane % 4) + reg % 2;
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) sum += am[row][k] * bm[k][col];  // exact products in fp32
    d[reg] = c[reg] + sum;
  }
}

void LdMatrixX4(uint32_t (&r)[4], const void* row, bool transposed) {
  const uint16_t* mine = static_cast<const uint16_t*>(row);
  const uint16_t* rows[kWarpSize];
  WarpShare(&mine, sizeof(mine), rows);
  // Matrix i's rows come from lanes 8 i .. 8 i + 7. Each lane gets, of every matrix, row
  // lane / 4 at columns 2 (lane % 4) and the next (transposed: those rows, column lane / 4).
  const unsigned lane = LaneId();
  const unsigned group = lane / 4;
  const unsigned index = lane % 4;
  for (unsigned i = 0; i < 4; ++i) {
    uint16_t lo = 0;
    uint16_t hi = 0;
    if (transposed) {
      lo = rows[i * 8 + 2 * index][group];
      hi = rows[i * 8 + 2 * index + 1][group];
    } else {
      lo = rows[i * 8 + group][2 * index];
      hi = rows[i * 8 + group][2 * index + 1];
    }
    r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
}

void AtomicAdd(float* address, float value) {
  // CTAs run on several OS threads: a compare-and-swap loop on the float's bits.
  uint32_t expected = 0;
  __atomic_load(reinterpret_cast<uint32_t*>(address), &expected, __ATOMIC_RELAXED);
  while (true) {
    float current = 0.0f;
    std::memcpy(&current, &expected, sizeof(current));
    const float next = current + value;
    uint32_t desired = 0;
    std::memcpy(&desired, &next, sizeof(desired));
    if (__atomic_compare_exchange(reinterpret_cast<uint32_t*>(address), &expected, &desired, false,
                                  __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
      return;
    }
  }
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
