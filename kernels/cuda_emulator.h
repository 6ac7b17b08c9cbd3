// A host emulator of the part of CUDA that the attention kernels use, so that their bodies and
// their launch code (kernels/cuda_attention_impl.inc) compile as host C++ and run in the test
// command on machines without a GPU (kernels/cuda_emulated.h). Not a simulator of timing: it
// checks what the kernels compute and how they synchronise.
//
// - Every CUDA thread of a CTA is a fiber (ucontext) with its own stack, all on one OS thread.
//   SyncThreads() switches to the next fiber; the CTA's fibers go on once every live one (not
//   yet returned) waits there, as __syncthreads does. A warp exchange (the shuffles) waits the
//   same way for the live lanes of the caller's warp (32 consecutive threads). Threads waiting
//   at different barriers are a deadlock on a GPU; here they fail the launch, saying so.
// - CTAs run in any order, spread over the machine's cores, like a GPU's SMs take them.
// - Shared memory is one zeroed arena per CTA (dynamic, then the static arrays); launches check
//   the block size (<= 1024 threads) and the dynamic shared memory against the limit the kernel
//   was given (SetMaxDynamicSharedMemory, at most 227 KiB as on sm_90) as the driver does.
// - Device memory is host memory; copies between it and the host are counted (Transfers), so a
//   test can check that a path keeps its data on the device.
#ifndef SPARSEBALANCE_KERNELS_CUDA_EMULATOR_H_
#define SPARSEBALANCE_KERNELS_CUDA_EMULATOR_H_

#include <cstddef>
#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "kernels/bf16.h"

namespace sparsebalance {
namespace kernels {
namespace emu {

struct Index3 {
  unsigned x = 1;
  unsigned y = 1;
  unsigned z = 1;
};

// bf16 storage as the kernels see it (__nv_bfloat16 on the device).
struct Bf16 {
  uint16_t bits;
};
inline float ToFloat(Bf16 x) { return Bf16ToFloat(x.bits); }
inline Bf16 ToBf16(float x) { return Bf16{FloatToBf16(x)}; }

// The running thread's built-in indices (threadIdx, blockIdx, blockDim, gridDim).
struct ThreadIds {
  Index3 thread;
  Index3 block;
  Index3 block_dim;
  Index3 grid_dim;
};
const ThreadIds& Current();

// __syncthreads().
void SyncThreads();

// Every live lane of the calling warp passes `value`; returns once all of them have, with
// lanes[l] the value of lane l (lanes that returned from the kernel leave 0).
void WarpExchange(uint64_t value, uint64_t (&lanes)[32]);

// The general form: every live lane passes `bytes` (at most 32) at `mine`; `lanes` receives
// 32 x `bytes`, lane by lane.
void WarpShare(const void* mine, size_t bytes, void* lanes);

// The calling thread's lane in its warp.
unsigned LaneId();

// __shfl_xor_sync(0xffffffff, value, lane_mask).
float ShflXor(float value, unsigned lane_mask);

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: D = A B + C for the warp's 16 x 8 tile,
// each lane holding the fragments of the PTX ISA's layout (bf16 pairs, the lower column in the
// low half). Products are exact in fp32; the 16 are summed in order, then C is added.
void MmaBf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]);

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lane l passes the address of row l % 8 of
// matrix l / 8 (8 bf16 each) and receives one bf16 pair of each of the 4 matrices.
void LdMatrixX4(uint32_t (&r)[4], const void* row, bool transposed);

// atomicAdd on a float in device memory.
void AtomicAdd(float* address, float value);

// The CTA's dynamic shared memory, and a static __shared__ array of `bytes` named by `key` (the
// address of a static object at the declaration: one array per declaration and CTA).
void* DynamicShared();
void* StaticShared(const void* key, size_t bytes);

// The most dynamic shared memory a kernel may be given on sm_90 (227 KiB).
inline constexpr size_t kMaxDynamicSharedMemory = 232448;

struct LaunchShape {
  Index3 grid;
  Index3 block;
  size_t dynamic_shared = 0;
  size_t shared_limit = 48 * 1024;  // the kernel's limit: 48 KiB unless raised
};

// Runs `thread` once per thread of `shape`, CTA by CTA over the machine's cores. Errors: an
// invalid shape (as cudaErrorInvalidConfiguration / cudaErrorInvalidValue would be), or threads
// of a CTA stuck at different barriers. `name` goes into the error.
absl::Status Run(const char* name, const LaunchShape& shape, const std::function<void()>& thread);

// Device memory (host memory here) and counted copies.
struct TransferStats {
  int64_t to_device_copies = 0;
  int64_t to_device_bytes = 0;
  int64_t to_host_copies = 0;
  int64_t to_host_bytes = 0;
};
TransferStats Transfers();
void ResetTransfers();
void* Allocate(size_t bytes);
void Free(void* pointer);
void CopyToDevice(void* dst, const void* src, size_t bytes);
void CopyToHost(void* dst, const void* src, size_t bytes);

}  // namespace emu
}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_CUDA_EMULATOR_H_
