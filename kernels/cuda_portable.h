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

}  // namespace gpu
}  // namespace kernels
}  // namespace sparsebalance

#endif

#endif  // SPARSEBALANCE_KERNELS_CUDA_PORTABLE_H_
