// The CUDA kernels (sm_90, bf16 in, fp32 accumulate) behind a header free of CUDA types, so
// that code built without CUDA compiles against it: device pointers are void* (bf16 tensors
// as 16-bit storage) and float*, errors are absl::Status. Built with SB_WITH_CUDA; otherwise
// every call returns FAILED_PRECONDITION and DeviceCount() is 0.
//
// Same layouts and block index as the CPU reference (kernels/attention_cpu.h):
//   q, k, v, out, dout, dq, dk, dv: bf16 [total_tokens, heads, head_dim]
//   lse, delta: fp32 [heads, total_tokens]
//
//   if (cuda::DeviceCount() == 0) return;  // no GPU: use the CPU reference
//   absl::StatusOr<cuda::DeviceBlockIndex> index = cuda::DeviceBlockIndex::Upload(host_index);
//   absl::Status s = cuda::Forward(*index, head_dim, q, k, v, scale, out, lse);
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

// Whether this library was built with the CUDA kernels.
bool Compiled();

// CUDA devices usable now; 0 without CUDA, driver or device (then *why, if given, says which).
int DeviceCount(std::string* why = nullptr);

// The name of device 0, e.g. "NVIDIA H100 80GB HBM3".
absl::StatusOr<std::string> DeviceName();

// Waits for all work queued on the device (kernels run on the default stream).
absl::Status Synchronize();

// A device allocation that frees itself; move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  static absl::StatusOr<DeviceBuffer> Allocate(size_t bytes);
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  absl::Status CopyFromHost(const void* src, size_t bytes);
  absl::Status CopyToHost(void* dst, size_t bytes) const;
  absl::Status Zero();

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// A BlockIndex copied to the device (the host copy is kept for sizes and checks).
class DeviceBlockIndex {
 public:
  static absl::StatusOr<DeviceBlockIndex> Upload(const BlockIndex& index);
  const BlockIndex& host() const { return host_; }
  const int32_t* cu_seqlens() const { return static_cast<const int32_t*>(cu_seqlens_.data()); }
  const int32_t* cu_blocks() const { return static_cast<const int32_t*>(cu_blocks_.data()); }
  const int64_t* row_ptr() const { return static_cast<const int64_t*>(row_ptr_.data()); }
  const int32_t* col_idx() const { return static_cast<const int32_t*>(col_idx_.data()); }
  const uint8_t* flags() const { return static_cast<const uint8_t*>(flags_.data()); }
  const int64_t* col_ptr() const { return static_cast<const int64_t*>(col_ptr_.data()); }
  const int32_t* row_idx() const { return static_cast<const int32_t*>(row_idx_.data()); }
  const uint8_t* col_flags() const { return static_cast<const uint8_t*>(col_flags_.data()); }

 private:
  BlockIndex host_;
  DeviceBuffer cu_seqlens_, cu_blocks_, row_ptr_, col_idx_, flags_, col_ptr_, row_idx_, col_flags_;
};

// Block selection: pooling and block scores on the device; the per-row choice (SelectRow,
// identical to the CPU's) and the CSC on the host. q and k are device bf16 tensors.
absl::StatusOr<Selection> SelectBlocks(absl::Span<const int32_t> cu_seqlens, int heads,
                                       int head_dim, const void* q, const void* k,
                                       absl::Span<const double> densities,
                                       const SelectionOptions& options);

// Forward: out (bf16) and lse (fp32). softmax_scale 0 means 1/sqrt(head_dim).
absl::Status Forward(const DeviceBlockIndex& index, int head_dim, const void* q, const void* k,
                     const void* v, float softmax_scale, void* out, float* lse);

// Backward: dq, dk, dv (bf16) of sum(out * dout); `delta` is fp32 scratch of
// heads * total_tokens floats.
absl::Status Backward(const DeviceBlockIndex& index, int head_dim, const void* q, const void* k,
                      const void* v, const void* out, const float* lse, const void* dout,
                      float softmax_scale, float* delta, void* dq, void* dk, void* dv);

// The recall probe (kernels/recall_probe.h) on the device, same contract as the CPU's
// ProbeRecall: the exact kept softmax mass of every sampled row (on the host) and head, with
// q and k device bf16 tensors (fp32 dot products, fp64 sums). Synchronous.
absl::StatusOr<RecallProbe> ProbeRecall(const DeviceBlockIndex& index, int head_dim, const void* q,
                                        const void* k, const RecallRows& rows,
                                        float softmax_scale = 0.0f);

// Row-major bf16 GEMM with fp32 accumulation (cuBLAS): C[m][n] = op(A)[m][k] * op(B)[k][n],
// where a transposed A is stored [k][m] and a transposed B [n][k]. sb-profile's linear part.
absl::Status MatmulBf16(int64_t m, int64_t n, int64_t k, const void* a, bool a_transposed,
                        const void* b, bool b_transposed, void* c);

}  // namespace cuda
}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_CUDA_ATTENTION_H_
