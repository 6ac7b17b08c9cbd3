// cuda::ProbeRecall (kernels/cuda_attention.h): the recall probe of kernels/recall_probe.h on
// the device. One CTA per (sampled row, head): its threads stride over the row's causal keys
// with an online softmax (running max, total and kept mass per thread, fp32 dot products of
// the bf16 inputs, fp64 sums), then combine; a key is kept when its block is in the row's CSR
// entry (binary search). Rows whose every causal block is kept are 1 without computing.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_attention.h"
#include "kernels/recall_probe.h"

namespace sparsebalance {
namespace kernels {
namespace cuda {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kProbeThreads = 256;

absl::Status Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

struct ProbeParams {
  const int32_t* cu_seqlens;
  const int32_t* cu_blocks;
  const int64_t* row_ptr;
  const int32_t* col_idx;
  const int32_t* row_document;  // per sampled row: its document
  const int32_t* row_token;     // per sampled row: its position in the document
  int heads;
  int head_dim;
  int block_size;
  float scale;
  const bf16* q;
  const bf16* k;
  double* recall;  // [sampled row][head]
};

__device__ bool Kept(const int32_t* cols, int64_t n, int32_t block) {
  int64_t lo = 0;
  int64_t hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (cols[mid] < block) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < n && cols[lo] == block;
}

__global__ void __launch_bounds__(kProbeThreads) ProbeKernel(ProbeParams p) {
  __shared__ float max_s[kProbeThreads];
  __shared__ double total_s[kProbeThreads];
  __shared__ double inside_s[kProbeThreads];
  const int64_t e = blockIdx.x;
  const int h = blockIdx.y;
  const int s = p.row_document[e];
  const int32_t t = p.row_token[e];
  const int32_t block = t / p.block_size;
  const int32_t blocks = p.cu_blocks[s + 1] - p.cu_blocks[s];
  const int64_t r =
      static_cast<int64_t>(p.cu_blocks[s]) * p.heads + static_cast<int64_t>(h) * blocks + block;
  const int64_t first = p.row_ptr[r];
  const int64_t kept_blocks = p.row_ptr[r + 1] - first;
  if (kept_blocks == static_cast<int64_t>(block) + 1) {  // every causal block kept
    if (threadIdx.x == 0) p.recall[e * p.heads + h] = 1.0;
    return;
  }
  const int64_t stride = static_cast<int64_t>(p.heads) * p.head_dim;
  const int64_t base =
      static_cast<int64_t>(p.cu_seqlens[s]) * stride + static_cast<int64_t>(h) * p.head_dim;
  const bf16* query = p.q + base + t * stride;
  float m = -INFINITY;
  double total = 0.0;
  double inside = 0.0;
  for (int32_t u = threadIdx.x; u <= t; u += blockDim.x) {
    const bf16* key = p.k + base + u * stride;
    float dot = 0.0f;
    for (int d = 0; d < p.head_dim; ++d)
      dot += __bfloat162float(query[d]) * __bfloat162float(key[d]);
    const float logit = dot * p.scale;
    if (logit > m) {
      const double rescale = exp(static_cast<double>(m) - logit);  // 0 while m is -inf
      total *= rescale;
      inside *= rescale;
      m = logit;
    }
    const double w = exp(static_cast<double>(logit) - m);
    total += w;
    if (Kept(p.col_idx + first, kept_blocks, u / p.block_size)) inside += w;
  }
  max_s[threadIdx.x] = m;
  total_s[threadIdx.x] = total;
  inside_s[threadIdx.x] = inside;
  __syncthreads();
  if (threadIdx.x != 0) return;
  float global = -INFINITY;
  for (int i = 0; i < blockDim.x; ++i) global = fmaxf(global, max_s[i]);
  double all = 0.0;
  double kept = 0.0;
  for (int i = 0; i < blockDim.x; ++i) {
    if (max_s[i] == -INFINITY) continue;  // a thread without keys
    const double f = exp(static_cast<double>(max_s[i]) - global);
    all += total_s[i] * f;
    kept += inside_s[i] * f;
  }
  const double recall = all > 0.0 ? kept / all : 1.0;
  p.recall[e * p.heads + h] = recall < 0.0 ? 0.0 : (recall > 1.0 ? 1.0 : recall);
}

}  // namespace

absl::StatusOr<RecallProbe> ProbeRecall(const DeviceBlockIndex& index, int head_dim, const void* q,
                                        const void* k, const RecallRows& rows,
                                        float softmax_scale) {
  const BlockIndex& host = index.host();
  if (absl::Status s = ValidateHeadDim(head_dim); !s.ok()) return s;
  if (host.rows() == 0) {
    return absl::InvalidArgumentError("the device block index is empty (not uploaded?)");
  }
  if (absl::Status s = ValidateRecallRows(host, rows); !s.ok()) return s;
  if (q == nullptr || k == nullptr) {
    return absl::InvalidArgumentError("q and k must be device pointers (one is null)");
  }
  if (!(softmax_scale >= 0.0f) || !std::isfinite(softmax_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "softmax_scale=", softmax_scale, " must be positive (or 0 for 1/sqrt(head_dim))"));
  }
  const int64_t sampled = static_cast<int64_t>(rows.rows.size());
  if (sampled > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(sampled, " sampled rows; at most ", INT_MAX));
  }
  std::vector<double> per_head(static_cast<size_t>(sampled) * host.heads, 1.0);
  if (sampled > 0) {
    std::vector<int32_t> row_document(rows.rows.size());
    for (int s = 0; s < rows.documents(); ++s) {
      for (int64_t e = rows.offsets[s]; e < rows.offsets[s + 1]; ++e) row_document[e] = s;
    }
    absl::StatusOr<DeviceBuffer> documents = DeviceBuffer::Allocate(row_document.size() * 4);
    if (!documents.ok()) return documents.status();
    absl::StatusOr<DeviceBuffer> tokens = DeviceBuffer::Allocate(rows.rows.size() * 4);
    if (!tokens.ok()) return tokens.status();
    absl::StatusOr<DeviceBuffer> recall = DeviceBuffer::Allocate(per_head.size() * 8);
    if (!recall.ok()) return recall.status();
    for (absl::Status s : {documents->CopyFromHost(row_document.data(), row_document.size() * 4),
                           tokens->CopyFromHost(rows.rows.data(), rows.rows.size() * 4)}) {
      if (!s.ok()) return s;
    }
    ProbeParams p{};
    p.cu_seqlens = index.cu_seqlens();
    p.cu_blocks = index.cu_blocks();
    p.row_ptr = index.row_ptr();
    p.col_idx = index.col_idx();
    p.row_document = static_cast<const int32_t*>(documents->data());
    p.row_token = static_cast<const int32_t*>(tokens->data());
    p.heads = host.heads;
    p.head_dim = head_dim;
    p.block_size = host.block_size;
    p.scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
    p.q = static_cast<const bf16*>(q);
    p.k = static_cast<const bf16*>(k);
    p.recall = static_cast<double*>(recall->data());
    ProbeKernel<<<dim3(static_cast<unsigned>(sampled), static_cast<unsigned>(host.heads)),
                  kProbeThreads>>>(p);
    if (absl::Status s = Check(cudaGetLastError(), "ProbeKernel"); !s.ok()) return s;
    if (absl::Status s = recall->CopyToHost(per_head.data(), per_head.size() * 8); !s.ok()) {
      return s;
    }
  }
  return SummarizeProbe(rows, host.heads, per_head);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace sparsebalance
