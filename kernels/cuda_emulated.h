// The CUDA kernels of kernels/cuda_attention.h compiled as host code and run by the emulator of
// kernels/cuda_emulator.h: the same kernel bodies and launch code, one fiber per CUDA thread,
// on any machine. For tests (tests/kernels/cuda_emulated_test.cc runs them against the CPU
// reference in the test command) and for reading a kernel's behaviour in a debugger; far too
// slow for training. Device pointers are host pointers from DeviceBuffer (or any host memory).
//
//   absl::StatusOr<cuda_emulated::DeviceBuffer> q = cuda_emulated::DeviceBuffer::Allocate(bytes);
//   emu::ResetTransfers();
//   absl::Status s = cuda_emulated::Forward(*index, head_dim, q->data(), ...,
//   cuda_emulated::Stream{}); emu::Transfers().to_host_bytes;  // what crossed to the host since
//   the reset
#ifndef SPARSEBALANCE_KERNELS_CUDA_EMULATED_H_
#define SPARSEBALANCE_KERNELS_CUDA_EMULATED_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/block_index.h"
#include "kernels/block_selection.h"
#include "kernels/cuda_emulator.h"
#include "kernels/recall_probe.h"

namespace sparsebalance {
namespace kernels {
namespace cuda_emulated {

#include "kernels/cuda_api.inc"  // IWYU pragma: export

}  // namespace cuda_emulated
}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_CUDA_EMULATED_H_
