// kernels/cuda_attention.h for sm_90: the kernels of kernels/cuda_attention_impl.inc compiled by
// nvcc, with `rt` on the CUDA runtime and cuBLAS. Every launch, copy and GEMM goes on the
// caller's stream. A launch's configuration error is returned with the kernel's name; with
// launch checks on (debug builds, or SB_CUDA_LAUNCH_CHECKS=1 in the environment) each launch also
// waits for its stream, so that a fault inside a kernel is reported by that kernel's name rather
// than by a later call.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "contract/block_geometry.h"
#include "kernels/block_selection.h"
#include "kernels/cuda_attention.h"
#include "kernels/cuda_portable.h"

namespace sparsebalance {
namespace kernels {
namespace cuda {
namespace rt {

using Dim3 = dim3;

absl::Status Check(cudaError_t error, const std::string& what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

cudaStream_t ToCuda(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

bool LaunchChecks() {
  static const bool enabled = [] {
    const char* value = std::getenv("SB_CUDA_LAUNCH_CHECKS");
    if (value != nullptr && value[0] != '\0') return value[0] == '1';
#ifdef NDEBUG
    return false;
#else
    return true;
#endif
  }();
  return enabled;
}

int DeviceCount(std::string* why) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    if (why != nullptr) *why = cudaGetErrorString(error);
    cudaGetLastError();  // clear the sticky error for later calls
    return 0;
  }
  if (count == 0 && why != nullptr) *why = "the CUDA runtime sees no device";
  return count;
}

absl::StatusOr<std::string> DeviceName() {
  cudaDeviceProp properties;
  if (absl::Status s = Check(cudaGetDeviceProperties(&properties, 0), "cudaGetDeviceProperties");
      !s.ok()) {
    return s;
  }
  return std::string(properties.name);
}

absl::Status Synchronize(Stream stream) {
  return Check(cudaStreamSynchronize(ToCuda(stream)), "cudaStreamSynchronize");
}

absl::Status Allocate(void** pointer, size_t bytes) {
  return Check(cudaMalloc(pointer, bytes), absl::StrCat("cudaMalloc of ", bytes, " bytes"));
}

void Free(void* pointer) { cudaFree(pointer); }

// Stream-ordered allocation (the device's default memory pool): usable by work queued on
// `stream` after this call, returned to the pool once the stream's earlier work is done.
absl::Status AllocateAsync(void** pointer, size_t bytes, Stream stream) {
  return Check(cudaMallocAsync(pointer, bytes, ToCuda(stream)),
               absl::StrCat("cudaMallocAsync of ", bytes, " bytes"));
}

void FreeAsync(void* pointer, Stream stream) { cudaFreeAsync(pointer, ToCuda(stream)); }

absl::Status CopyToDevice(void* dst, const void* src, size_t bytes, Stream stream) {
  // From pageable memory the call returns once `src` has been staged: the caller may reuse it.
  return Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ToCuda(stream)),
               "cudaMemcpyAsync to the device");
}

absl::Status CopyToHost(void* dst, const void* src, size_t bytes, Stream stream) {
  if (absl::Status s =
          Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ToCuda(stream)),
                "cudaMemcpyAsync to the host");
      !s.ok()) {
    return s;
  }
  return rt::Synchronize(stream);
}

absl::Status Zero(void* pointer, size_t bytes, Stream stream) {
  return Check(cudaMemsetAsync(pointer, 0, bytes, ToCuda(stream)), "cudaMemsetAsync");
}

// Launches `kernel` (`name` in errors) with `shared` bytes of dynamic shared memory, raising
// its limit first where that is above the default 48 KiB.
template <typename... Params, typename... Args>
absl::Status Launch(const char* name, void (*kernel)(Params...), Dim3 grid, Dim3 block,
                    size_t shared, Stream stream, Args... args) {
  if (shared > 48 * 1024) {
    if (absl::Status s =
            Check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(shared)),
                  absl::StrCat("cudaFuncSetAttribute(", name, ")"));
        !s.ok()) {
      return s;
    }
  }
  kernel<<<grid, block, shared, ToCuda(stream)>>>(args...);
  if (absl::Status s = Check(cudaGetLastError(), absl::StrCat("launching ", name)); !s.ok()) {
    return s;
  }
  if (!LaunchChecks()) return absl::OkStatus();
  cudaStreamSynchronize(ToCuda(stream));
  return Check(cudaGetLastError(), absl::StrCat(name, " (SB_CUDA_LAUNCH_CHECKS)"));
}

// One cuBLAS handle per thread, bound to the stream of each call.
absl::Status GemmColumnMajorBf16(bool a_transposed, bool b_transposed, int64_t rows, int64_t cols,
                                 int64_t depth, const void* a, int64_t lda, const void* b,
                                 int64_t ldb, void* c, int64_t ldc, Stream stream) {
  struct Handle {
    cublasHandle_t handle = nullptr;
    cublasStatus_t status = cublasCreate(&handle);
    ~Handle() {
      if (handle != nullptr) cublasDestroy(handle);
    }
  };
  thread_local Handle blas;
  if (blas.status != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cublasCreate failed with status ", static_cast<int>(blas.status)));
  }
  if (const cublasStatus_t status = cublasSetStream(blas.handle, ToCuda(stream));
      status != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cublasSetStream failed with status ", static_cast<int>(status)));
  }
  const float alpha = 1.0f;
  const float beta = 0.0f;
  const cublasStatus_t status =
      cublasGemmEx(blas.handle, a_transposed ? CUBLAS_OP_T : CUBLAS_OP_N,
                   b_transposed ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(rows),
                   static_cast<int>(cols), static_cast<int>(depth), &alpha, a, CUDA_R_16BF,
                   static_cast<int>(lda), b, CUDA_R_16BF, static_cast<int>(ldb), &beta, c,
                   CUDA_R_16BF, static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (status != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cublasGemmEx failed with status ", static_cast<int>(status)));
  }
  return absl::OkStatus();
}

}  // namespace rt

#include "kernels/cuda_attention_impl.inc"

}  // namespace cuda
}  // namespace kernels
}  // namespace sparsebalance
