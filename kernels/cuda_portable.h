// The portability layer of the CUDA kernels (kernels/cuda_attention_impl.inc): the same kernel
// source compiles with nvcc for the device and with the host compiler for the emulator
// (kernels/cuda_emulator.h). Kernels use these names instead of CUDA's built-ins:
//
//   SB_GLOBAL void SB_LAUNCH_BOUNDS(128) Kernel(Params p) {
//     SB_DYNAMIC_SHARED(float, smem);              // extern __shared__ float smem[];
//     SB_STATIC_SHARED(float, partial, 128);       // __shared__ float partial[128];
//     const unsigned t = gpu::ThreadIdx().x;      // threadIdx.x
//     gpu::SyncThreads();                          // __syncthreads()
//     float x = gpu::ToFloat(p.q[t]);              // __bfloat162float
//   }
//
// Host-side launches and memory go through the `rt` wrappers that each of the two translation
// units defines before including the kernels (cuda_attention.cu, cuda_emulated.cc).
#ifndef SPARSEBALANCE_KERNELS_CUDA_PORTABLE_H_
#define SPARSEBALANCE_KERNELS_CUDA_PORTABLE_H_

#include <math.h>
#include <string.h>

#include <cstdint>

#if defined(__CUDACC__)

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#define SB_GLOBAL __global__
#define SB_DEVICE __device__
#define SB_INLINE __forceinline__
#define SB_LAUNCH_BOUNDS(threads) __launch_bounds__(threads)
#define SB_UNROLL _Pragma("unroll")
#define SB_NO_UNROLL _Pragma("unroll 1")
#define SB_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#define SB_STATIC_SHARED(type, name, count) __shared__ type name[count]

namespace sparsebalance {
namespace kernels {
namespace gpu {

using Bf16 = __nv_bfloat16;
SB_DEVICE SB_INLINE uint3 ThreadIdx() { return threadIdx; }
SB_DEVICE SB_INLINE uint3 BlockIdx() { return blockIdx; }
SB_DEVICE SB_INLINE dim3 BlockDim() { return blockDim; }
SB_DEVICE SB_INLINE dim3 GridDim() { return gridDim; }
SB_DEVICE SB_INLINE void SyncThreads() { __syncthreads(); }
SB_DEVICE SB_INLINE float ToFloat(Bf16 x) { return __bfloat162float(x); }
SB_DEVICE SB_INLINE Bf16 ToBf16(float x) { return __float2bfloat16(x); }
// Sums and products rounded as written: never fused into an FMA, so that a device result can
// equal the host's bit for bit (block scores, which decide the selection).
SB_DEVICE SB_INLINE float AddRn(float a, float b) { return __fadd_rn(a, b); }
SB_DEVICE SB_INLINE float MulRn(float a, float b) { return __fmul_rn(a, b); }

// The tensor-core path's warp-level operations (PTX ISA: mma.sync m16n8k16 bf16 with fp32
// accumulation, ldmatrix .x4, shuffles): the emulator implements the same fragment layouts.
SB_DEVICE SB_INLINE unsigned LaneId() { return threadIdx.x % 32; }
SB_DEVICE SB_INLINE float ShflXor(float value, unsigned lane_mask) {
  return __shfl_xor_sync(0xffffffffu, value, static_cast<int>(lane_mask));
}
SB_DEVICE SB_INLINE void MmaBf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                 const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}
// Lane l passes the shared-memory address of row l % 8 of matrix l / 8.
SB_DEVICE SB_INLINE void LdMatrixX4(uint32_t (&r)[4], const void* row) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
SB_DEVICE SB_INLINE void LdMatrixX4Trans(uint32_t (&r)[4], const void* row) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
// Two floats as a bf16 pair (round to nearest even), `lo` in the low half.
SB_DEVICE SB_INLINE uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &pair, sizeof(bits));
  return bits;
}
SB_DEVICE SB_INLINE void AtomicAdd(float* address, float value) { atomicAdd(address, value); }
// 16 bytes from `src` to `dst`, both 16-byte aligned (bf16 x 8).
SB_DEVICE SB_INLINE void Copy16(void* dst, const void* src) {
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
}
SB_DEVICE SB_INLINE void Zero16(void* dst) { *static_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0); }

}  // namespace gpu
}  // namespace kernels
}  // namespace sparsebalance

#else  // the host emulator

#include "kernels/cuda_emulator.h"

#define SB_GLOBAL
#define SB_DEVICE
#define SB_INLINE inline
#define SB_LAUNCH_BOUNDS(threads)
#define SB_UNROLL
#define SB_NO_UNROLL
// `type` and `name` are a declaration's parts, which parentheses would break.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define SB_DYNAMIC_SHARED(type, name) \
  type* name = static_cast<type*>(::sparsebalance::kernels::emu::DynamicShared())
#define SB_STATIC_SHARED(type, name, count) \
  static const char name##_key = 0;         \
  type* name = static_cast<type*>(          \
      ::sparsebalance::kernels::emu::StaticShared(&name##_key, sizeof(type) * (count)))
// NOLINTEND(bugprone-macro-parentheses)

namespace sparsebalance {
namespace kernels {
namespace gpu {

using Bf16 = emu::Bf16;
inline emu::Index3 ThreadIdx() { return emu::Current().thread; }
inline emu::Index3 BlockIdx() { return emu::Current().block; }
inline emu::Index3 BlockDim() { return emu::Current().block_dim; }
inline emu::Index3 GridDim() { return emu::Current().grid_dim; }
inline void SyncThreads() { emu::SyncThreads(); }
inline float ToFloat(Bf16 x) { return emu::ToFloat(x); }
inline Bf16 ToBf16(float x) { return emu::ToBf16(x); }
inline float AddRn(float a, float b) { return a + b; }
inline float MulRn(float a, float b) { return a * b; }
inline unsigned LaneId() { return emu::LaneId(); }
inline float ShflXor(float value, unsigned lane_mask) { return emu::ShflXor(value, lane_mask); }
inline void MmaBf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                    const float (&c)[4]) {
  emu::MmaBf16(d, a, b, c);
}
inline void LdMatrixX4(uint32_t (&r)[4], const void* row) { emu::LdMatrixX4(r, row, false); }
inline void LdMatrixX4Trans(uint32_t (&r)[4], const void* row) { emu::LdMatrixX4(r, row, true); }
inline uint32_t PackBf16(float lo, float hi) {
  return static_cast<uint32_t>(FloatToBf16(lo)) | (static_cast<uint32_t>(FloatToBf16(hi)) << 16);
}
inline void AtomicAdd(float* address, float value) { emu::AtomicAdd(address, value); }
inline void Copy16(void* dst, const void* src) { memcpy(dst, src, 16); }
inline void Zero16(void* dst) { memset(dst, 0, 16); }

}  // namespace gpu
}  // namespace kernels
}  // namespace sparsebalance

#endif

#endif  // SPARSEBALANCE_KERNELS_CUDA_PORTABLE_H_
