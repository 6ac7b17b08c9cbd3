// The CUDA kernels (sm_90, bf16 in, fp32 accumulate) behind a header free of CUDA types, so
// that code built without CUDA compiles against it: device pointers are void* (bf16 tensors
// as 16-bit storage) and float*, streams are cuda::Stream, errors are absl::Status. Built with
// SB_WITH_CUDA; otherwise every call returns FAILED_PRECONDITION and DeviceCount() is 0. The
// declarations live in kernels/cuda_api.inc, shared with the host-emulated build of the same
// kernels (kernels/cuda_emulated.h) that the tests run without a GPU.
//
// Same layouts and block index as the CPU reference (kernels/attention_cpu.h):
//   q, k, v, out, dout, dq, dk, dv: bf16 [total_tokens, heads, head_dim]
//   lse, delta: fp32 [heads, total_tokens]
//
//   if (cuda::DeviceCount() == 0) return;  // no GPU: use the CPU reference
//   const cuda::Stream stream{torch_stream};  // or {} for the legacy default stream
//   absl::StatusOr<cuda::DeviceBlockIndex> index =
//       cuda::DeviceBlockIndex::Upload(host_index, stream);
//   absl::Status s = cuda::Forward(*index, head_dim, q, k, v, scale, out, lse, stream);
#ifndef SPARSEBALANCE_KERNELS_CUDA_ATTENTION_H_
#define SPARSEBALANCE_KERNELS_CUDA_ATTENTION_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/block_index.h"
#include "kernels/block_selection.h"
#include "kernels/recall_probe.h"

namespace sparsebalance {
namespace kernels {
namespace cuda {

#include "kernels/cuda_api.inc"  // IWYU pragma: export

}  // namespace cuda
}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_CUDA_ATTENTION_H_
