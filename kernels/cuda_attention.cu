// CUDA kernels of kernels/cuda_attention.h for sm_90: bf16 inputs, fp32 accumulation.
//
// These are the simple, correct kernels (not yet FlashAttention-3's warp-specialised
// TMA/WGMMA design): one CTA per query block (forward, dQ) or key block (dK/dV) of one
// (sequence, head), one thread per token row, tiles staged in shared memory as fp32, scalar
// FMA dot products and an online softmax per key. They walk the same CSR/CSC block index as
// the CPU reference, so their time follows the active blocks too. kernels/README.md says where
// they stand against FA3.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <initializer_list>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "contract/block_geometry.h"
#include "kernels/cuda_attention.h"

namespace sparsebalance {
namespace kernels {
namespace cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kKeyChunk = 32;    // keys staged per step by the forward and dQ kernels
constexpr int kQueryChunk = 16;  // queries staged per step by the dK/dV kernel

absl::Status Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

absl::Status CheckLaunch(const char* kernel) { return Check(cudaGetLastError(), kernel); }

float ResolveScale(float softmax_scale, int head_dim) {
  return softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

// What every attention kernel needs: the index and the tensors (device pointers).
struct Params {
  const int32_t* cu_seqlens;
  const int32_t* cu_blocks;
  const int64_t* row_ptr;
  const int32_t* col_idx;
  const int64_t* col_ptr;
  const int32_t* row_idx;
  int sequences;
  int heads;
  int64_t total_tokens;
  float scale_log2;  // softmax scale * log2(e)
  float scale;       // softmax scale
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const bf16* out;
  const bf16* dout;
  const float* lse_in;
  const float* delta;
  bf16* out_w;
  float* lse_w;
  bf16* dq;
  bf16* dk;
  bf16* dv;
};

// The sequence that item `item` belongs to when sequence s owns items
// [cu_blocks[s] * per_block, cu_blocks[s + 1] * per_block): per_block is 1 for blocks, heads
// for rows (which are numbered (sequence, head, block)).
__device__ int FindSequence(const int32_t* cu_blocks, int sequences, int64_t per_block,
                            int64_t item) {
  int lo = 0;
  int hi = sequences - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (static_cast<int64_t>(cu_blocks[mid]) * per_block <= item) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The tokens of one (sequence, head) that a CTA works on, in [total_tokens][heads][D] tensors:
// token t of the head is at offset + t * stride.
struct HeadTokens {
  int64_t row;     // the CTA's CSR row (or CSC column) number
  int head;        // attention head
  int32_t block;   // query block (CSR row) or key block (CSC column) of the CTA
  int32_t token0;  // the sequence's first token in the batch
  int32_t length;  // tokens in the sequence
  int64_t stride;  // elements between consecutive tokens
  int64_t offset;  // elements to the head's first token
};

// Row (or column) number -> its (sequence, head, block) and where that head's tokens are.
template <int D>
__device__ HeadTokens LocateHead(const Params& p, int64_t row) {
  const int s = FindSequence(p.cu_blocks, p.sequences, p.heads, row);
  const int32_t blocks = p.cu_blocks[s + 1] - p.cu_blocks[s];
  const int64_t rel = row - static_cast<int64_t>(p.cu_blocks[s]) * p.heads;
  HeadTokens at;
  at.row = row;
  at.head = static_cast<int>(rel / blocks);
  at.block = static_cast<int32_t>(rel % blocks);
  at.token0 = p.cu_seqlens[s];
  at.length = p.cu_seqlens[s + 1] - at.token0;
  at.stride = static_cast<int64_t>(p.heads) * D;
  at.offset = static_cast<int64_t>(at.token0) * at.stride + static_cast<int64_t>(at.head) * D;
  return at;
}

// Copies `rows` token rows starting at token `first` of the head `at` of `tensor` into an
// fp32 tile with row stride `ld`; rows at or past the sequence's end are zero.
template <int D>
__device__ void StageRows(const bf16* tensor, const HeadTokens& at, int32_t first, int rows,
                          float* tile, int ld) {
  const bf16* base = tensor + at.offset;
  for (int idx = threadIdx.x; idx < rows * D; idx += blockDim.x) {
    const int r = idx / D;
    const int d = idx % D;
    const int32_t t = first + r;
    tile[r * ld + d] = t < at.length ? __bfloat162float(base[t * at.stride + d]) : 0.0f;
  }
}

// StageRows of the same tokens of two tensors (K and V, or Q and dO).
template <int D>
__device__ void StagePair(const bf16* x, const bf16* y, const HeadTokens& at, int32_t first,
                          int rows, float* x_tile, float* y_tile, int ld) {
  StageRows<D>(x, at, first, rows, x_tile, ld);
  StageRows<D>(y, at, first, rows, y_tile, ld);
}

// Writes values[d] * factor (d < D) as bf16 to token `token` of the head `at` of `tensor`.
template <int D>
__device__ void StoreRow(const float* values, float factor, bf16* tensor, const HeadTokens& at,
                         int32_t token) {
  bf16* out = tensor + at.offset + static_cast<int64_t>(token) * at.stride;
#pragma unroll
  for (int d = 0; d < D; ++d) out[d] = __float2bfloat16(values[d] * factor);
}

// The key walk of the forward and dQ kernels: for every key block j of CSR row at.row, stages
// K and V kKeyChunk keys at a time into ks and vs ([kKeyChunk][D], the whole CTA together),
// then calls visit(c) for each staged key c that the thread's query `query` attends to (causal,
// both inside the sequence).
template <int B, int D, typename Visit>
__device__ __forceinline__ void ForEachKey(const Params& p, const HeadTokens& at, int32_t query,
                                           float* ks, float* vs, Visit visit) {
  for (int64_t e = p.row_ptr[at.row]; e < p.row_ptr[at.row + 1]; ++e) {
    const int32_t j = p.col_idx[e];
    for (int c0 = 0; c0 < B; c0 += kKeyChunk) {
      __syncthreads();
      StagePair<D>(p.k, p.v, at, j * B + c0, kKeyChunk, ks, vs, D);
      __syncthreads();
      if (query >= at.length) continue;
#pragma unroll 1
      for (int c = 0; c < kKeyChunk; ++c) {
        const int32_t key = j * B + c0 + c;
        if (key > query || key >= at.length) continue;
        visit(c);
      }
    }
  }
}

// One CTA per CSR row (query block i of head h of sequence s); thread r owns query i*B + r.
template <int B, int D>
__global__ void __launch_bounds__(B) ForwardKernel(Params p) {
  extern __shared__ float smem[];
  float* qs = smem;                // [B][D+1]
  float* ks = qs + B * (D + 1);    // [kKeyChunk][D]
  float* vs = ks + kKeyChunk * D;  // [kKeyChunk][D]
  const HeadTokens at = LocateHead<D>(p, blockIdx.x);
  const int r = threadIdx.x;
  const int32_t query = at.block * B + r;
  StageRows<D>(p.q, at, at.block * B, B, qs, D + 1);
  float acc[D];
#pragma unroll
  for (int d = 0; d < D; ++d) acc[d] = 0.0f;
  float m = -INFINITY;
  float l = 0.0f;
  ForEachKey<B, D>(p, at, query, ks, vs, [&](int c) {
    float dot = 0.0f;
#pragma unroll
    for (int d = 0; d < D; ++d) dot += qs[r * (D + 1) + d] * ks[c * D + d];
    const float x = dot * p.scale_log2;
    if (x > m) {  // new running maximum: rescale what was summed so far
      const float alpha = exp2f(m - x);
      l *= alpha;
#pragma unroll
      for (int d = 0; d < D; ++d) acc[d] *= alpha;
      m = x;
    }
    const float pr = exp2f(x - m);
    l += pr;
#pragma unroll
    for (int d = 0; d < D; ++d) acc[d] += pr * vs[c * D + d];
  });
  if (query >= at.length) return;
  StoreRow<D>(acc, l > 0.0f ? 1.0f / l : 0.0f, p.out_w, at, query);
  p.lse_w[static_cast<int64_t>(at.head) * p.total_tokens + at.token0 + query] =
      l > 0.0f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

// delta = rowsum(dO * O) per (token, head), fp32 [heads, total_tokens].
template <int D>
__global__ void DeltaKernel(Params p, float* delta) {
  const int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= p.total_tokens * p.heads) return;
  const int64_t t = id / p.heads;
  const int h = static_cast<int>(id % p.heads);
  const int64_t offset = (t * p.heads + h) * D;
  float sum = 0.0f;
  for (int d = 0; d < D; ++d) {
    sum += __bfloat162float(p.dout[offset + d]) * __bfloat162float(p.out[offset + d]);
  }
  delta[static_cast<int64_t>(h) * p.total_tokens + t] = sum;
}

// dQ: one CTA per CSR row, thread r owns query i*B + r; P is recomputed from the LSE.
template <int B, int D>
__global__ void __launch_bounds__(B) DqKernel(Params p) {
  extern __shared__ float smem[];
  float* qs = smem;                // [B][D+1]
  float* gs = qs + B * (D + 1);    // [B][D+1] dO
  float* ks = gs + B * (D + 1);    // [kKeyChunk][D]
  float* vs = ks + kKeyChunk * D;  // [kKeyChunk][D]
  const HeadTokens at = LocateHead<D>(p, blockIdx.x);
  const int r = threadIdx.x;
  const int32_t query = at.block * B + r;
  const bool valid = query < at.length;
  StagePair<D>(p.q, p.dout, at, at.block * B, B, qs, gs, D + 1);
  const int64_t lse_at = static_cast<int64_t>(at.head) * p.total_tokens + at.token0 + query;
  const float lse2 = valid ? p.lse_in[lse_at] * kLog2e : 0.0f;
  const float delta = valid ? p.delta[lse_at] : 0.0f;
  float dq[D];
#pragma unroll
  for (int d = 0; d < D; ++d) dq[d] = 0.0f;
  ForEachKey<B, D>(p, at, query, ks, vs, [&](int c) {
    float dot = 0.0f;
    float dp = 0.0f;
#pragma unroll
    for (int d = 0; d < D; ++d) {
      dot += qs[r * (D + 1) + d] * ks[c * D + d];
      dp += gs[r * (D + 1) + d] * vs[c * D + d];
    }
    const float pr = exp2f(dot * p.scale_log2 - lse2);
    const float ds = pr * (dp - delta);
#pragma unroll
    for (int d = 0; d < D; ++d) dq[d] += ds * ks[c * D + d];
  });
  if (!valid) return;
  StoreRow<D>(dq, p.scale, p.dq, at, query);
}

// dK and dV: one CTA per CSC column (key block j of head h of sequence s), thread c owns key
// j*B + c; dK accumulates in registers, dV in shared memory; queries of the column's rows are
// staged kQueryChunk at a time.
template <int B, int D>
__global__ void __launch_bounds__(B) DkDvKernel(Params p) {
  extern __shared__ float smem[];
  float* ks = smem;                     // [B][D+1]
  float* vs = ks + B * (D + 1);         // [B][D+1]
  float* dvs = vs + B * (D + 1);        // [B][D+1]
  float* qs = dvs + B * (D + 1);        // [kQueryChunk][D]
  float* gs = qs + kQueryChunk * D;     // [kQueryChunk][D] dO
  float* lse2s = gs + kQueryChunk * D;  // [kQueryChunk]
  float* deltas = lse2s + kQueryChunk;  // [kQueryChunk]
  const HeadTokens at = LocateHead<D>(p, blockIdx.x);
  const int c = threadIdx.x;
  const int32_t key = at.block * B + c;
  StagePair<D>(p.k, p.v, at, at.block * B, B, ks, vs, D + 1);
#pragma unroll
  for (int d = 0; d < D; ++d) dvs[c * (D + 1) + d] = 0.0f;
  float dk[D];
#pragma unroll
  for (int d = 0; d < D; ++d) dk[d] = 0.0f;
  const int64_t lse_base = static_cast<int64_t>(at.head) * p.total_tokens + at.token0;
  for (int64_t e = p.col_ptr[at.row]; e < p.col_ptr[at.row + 1]; ++e) {
    const int32_t i = p.row_idx[e];
    for (int q0 = 0; q0 < B; q0 += kQueryChunk) {
      __syncthreads();
      StagePair<D>(p.q, p.dout, at, i * B + q0, kQueryChunk, qs, gs, D);
      if (threadIdx.x < kQueryChunk) {
        const int32_t t = i * B + q0 + threadIdx.x;
        lse2s[threadIdx.x] = t < at.length ? p.lse_in[lse_base + t] * kLog2e : 0.0f;
        deltas[threadIdx.x] = t < at.length ? p.delta[lse_base + t] : 0.0f;
      }
      __syncthreads();
      if (key >= at.length) continue;
#pragma unroll 1
      for (int qq = 0; qq < kQueryChunk; ++qq) {
        const int32_t query = i * B + q0 + qq;
        if (query >= at.length || key > query) continue;
        float dot = 0.0f;
        float dp = 0.0f;
#pragma unroll
        for (int d = 0; d < D; ++d) {
          dot += qs[qq * D + d] * ks[c * (D + 1) + d];
          dp += gs[qq * D + d] * vs[c * (D + 1) + d];
        }
        const float pr = exp2f(dot * p.scale_log2 - lse2s[qq]);
        const float ds = pr * (dp - deltas[qq]);
#pragma unroll
        for (int d = 0; d < D; ++d) {
          dk[d] += ds * qs[qq * D + d];
          dvs[c * (D + 1) + d] += pr * gs[qq * D + d];
        }
      }
    }
  }
  if (key >= at.length) return;
  StoreRow<D>(dk, p.scale, p.dk, at, key);
  StoreRow<D>(dvs + c * (D + 1), 1.0f, p.dv, at, key);
}

// Mean of Q and K over the tokens of every block: grid (blocks over all sequences, heads),
// one thread per dimension; out [blocks][heads][D].
__global__ void PoolKernel(const int32_t* cu_seqlens, const int32_t* cu_blocks, int sequences,
                           int heads, int head_dim, int block_size, const bf16* q, const bf16* k,
                           float* q_mean, float* k_mean) {
  const int32_t b = blockIdx.x;
  const int h = blockIdx.y;
  const int d = threadIdx.x;
  const int lo = FindSequence(cu_blocks, sequences, 1, b);
  const int32_t first = cu_seqlens[lo] + (b - cu_blocks[lo]) * block_size;
  const int32_t last = min(cu_seqlens[lo + 1], first + block_size);
  float q_sum = 0.0f;
  float k_sum = 0.0f;
  for (int32_t t = first; t < last; ++t) {
    const int64_t at = (static_cast<int64_t>(t) * heads + h) * head_dim + d;
    q_sum += __bfloat162float(q[at]);
    k_sum += __bfloat162float(k[at]);
  }
  const int64_t out = (static_cast<int64_t>(b) * heads + h) * head_dim + d;
  q_mean[out] = q_sum / static_cast<float>(last - first);
  k_mean[out] = k_sum / static_cast<float>(last - first);
}

// Block scores (pooled logits) of every causal (query block i, key block j): one CTA per row,
// written lower-triangular per (sequence, head) at tri_base[s] + h*n(n+1)/2 + i(i+1)/2 + j.
__global__ void ScoreKernel(const int32_t* cu_blocks, const int64_t* tri_base, int sequences,
                            int heads, int head_dim, float scale, const float* q_mean,
                            const float* k_mean, float* scores) {
  extern __shared__ float q_row[];
  const int64_t row = blockIdx.x;
  const int lo = FindSequence(cu_blocks, sequences, heads, row);
  const int64_t n = cu_blocks[lo + 1] - cu_blocks[lo];
  const int64_t rel = row - static_cast<int64_t>(cu_blocks[lo]) * heads;
  const int h = static_cast<int>(rel / n);
  const int64_t i = rel % n;
  const int64_t block0 = cu_blocks[lo];
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    q_row[d] = q_mean[((block0 + i) * heads + h) * head_dim + d];
  }
  __syncthreads();
  float* out = scores + tri_base[lo] + h * n * (n + 1) / 2 + i * (i + 1) / 2;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
    const float* key = k_mean + ((block0 + j) * heads + h) * head_dim;
    float dot = 0.0f;
    for (int d = 0; d < head_dim; ++d) dot += q_row[d] * key[d];
    out[j] = dot * scale;
  }
}

template <int B, int D>
size_t ForwardSmem() {
  return sizeof(float) * (B * (D + 1) + 2 * kKeyChunk * D);
}
template <int B, int D>
size_t DqSmem() {
  return sizeof(float) * (2 * B * (D + 1) + 2 * kKeyChunk * D);
}
template <int B, int D>
size_t DkDvSmem() {
  return sizeof(float) * (3 * B * (D + 1) + 2 * kQueryChunk * D + 2 * kQueryChunk);
}

// Launches `kernel` (called `name` in errors) on `rows` CTAs of `threads` threads with `smem`
// bytes of dynamic shared memory, raising its limit to that first.
absl::Status LaunchAttention(void (*kernel)(Params), const char* name, const Params& p,
                             int64_t rows, int threads, size_t smem) {
  const cudaError_t error = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (error != cudaSuccess) {
    return Check(error, absl::StrCat("cudaFuncSetAttribute(", name, ")").c_str());
  }
  kernel<<<static_cast<unsigned>(rows), threads, smem>>>(p);
  return CheckLaunch(name);
}

template <int B, int D>
absl::Status LaunchForward(const Params& p, int64_t rows) {
  return LaunchAttention(ForwardKernel<B, D>, "ForwardKernel", p, rows, B, ForwardSmem<B, D>());
}

template <int B, int D>
absl::Status LaunchBackward(const Params& p, int64_t rows, float* delta) {
  const int64_t items = p.total_tokens * p.heads;
  DeltaKernel<D><<<static_cast<unsigned>((items + 255) / 256), 256>>>(p, delta);
  if (absl::Status s = CheckLaunch("DeltaKernel"); !s.ok()) return s;
  Params with_delta = p;
  with_delta.delta = delta;
  if (absl::Status s =
          LaunchAttention(DqKernel<B, D>, "DqKernel", with_delta, rows, B, DqSmem<B, D>());
      !s.ok()) {
    return s;
  }
  return LaunchAttention(DkDvKernel<B, D>, "DkDvKernel", with_delta, rows, B, DkDvSmem<B, D>());
}

// Calls launch(block size, head_dim) with both as std::integral_constant<int, N>, for the four
// compiled variants (block_size and head_dim are 64 or 128, checked before).
template <typename Launch>
absl::Status DispatchShape(int block_size, int head_dim, Launch launch) {
  using k64 = std::integral_constant<int, 64>;
  using k128 = std::integral_constant<int, 128>;
  if (block_size == 64) return head_dim == 64 ? launch(k64{}, k64{}) : launch(k64{}, k128{});
  return head_dim == 64 ? launch(k128{}, k64{}) : launch(k128{}, k128{});
}

absl::Status CheckPointers(std::initializer_list<std::pair<const char*, const void*>> pointers) {
  for (const auto& [name, pointer] : pointers) {
    if (pointer == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(name, " is a null device pointer"));
    }
  }
  return absl::OkStatus();
}

// The index and the inputs every attention kernel reads; the caller sets the rest.
Params MakeParams(const DeviceBlockIndex& index, int head_dim, float softmax_scale, const void* q,
                  const void* k, const void* v) {
  const BlockIndex& host = index.host();
  Params p{};
  p.q = static_cast<const bf16*>(q);
  p.k = static_cast<const bf16*>(k);
  p.v = static_cast<const bf16*>(v);
  p.cu_seqlens = index.cu_seqlens();
  p.cu_blocks = index.cu_blocks();
  p.row_ptr = index.row_ptr();
  p.col_idx = index.col_idx();
  p.col_ptr = index.col_ptr();
  p.row_idx = index.row_idx();
  p.sequences = host.sequences();
  p.heads = host.heads;
  p.total_tokens = host.total_tokens();
  p.scale = ResolveScale(softmax_scale, head_dim);
  p.scale_log2 = p.scale * kLog2e;
  return p;
}

absl::Status ValidateAttentionArgs(const DeviceBlockIndex& index, int head_dim,
                                   float softmax_scale) {
  if (absl::Status s = ValidateHeadDim(head_dim); !s.ok()) return s;
  if (index.host().rows() == 0) {
    return absl::InvalidArgumentError("the device block index is empty (not uploaded?)");
  }
  if (!(softmax_scale >= 0.0f) || !std::isfinite(softmax_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "softmax_scale=", softmax_scale, " must be positive (or 0 for 1/sqrt(head_dim))"));
  }
  if (index.host().rows() > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("the index has ", index.host().rows(), " rows; at most ", INT_MAX));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status UploadVector(const std::vector<T>& values, DeviceBuffer* buffer) {
  absl::StatusOr<DeviceBuffer> b =
      DeviceBuffer::Allocate(std::max<size_t>(1, values.size()) * sizeof(T));
  if (!b.ok()) return b.status();
  *buffer = *std::move(b);
  if (values.empty()) return absl::OkStatus();
  return buffer->CopyFromHost(values.data(), values.size() * sizeof(T));
}

std::once_flag cublas_once;
cublasHandle_t cublas_handle = nullptr;
cublasStatus_t cublas_init_status = CUBLAS_STATUS_SUCCESS;

}  // namespace

bool Compiled() { return true; }

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

absl::Status Synchronize() { return Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) cudaFree(data_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFree(data_);
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  DeviceBuffer buffer;
  if (absl::Status s = Check(cudaMalloc(&buffer.data_, std::max<size_t>(bytes, 1)), "cudaMalloc");
      !s.ok()) {
    buffer.data_ = nullptr;
    return s;
  }
  buffer.bytes_ = bytes;
  return buffer;
}

absl::Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes) {
  if (bytes > bytes_) {
    return absl::InvalidArgumentError(
        absl::StrCat("copy of ", bytes, " bytes into a device buffer of ", bytes_));
  }
  return Check(cudaMemcpy(data_, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}

absl::Status DeviceBuffer::CopyToHost(void* dst, size_t bytes) const {
  if (bytes > bytes_) {
    return absl::InvalidArgumentError(
        absl::StrCat("copy of ", bytes, " bytes out of a device buffer of ", bytes_));
  }
  return Check(cudaMemcpy(dst, data_, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}

absl::Status DeviceBuffer::Zero() { return Check(cudaMemset(data_, 0, bytes_), "cudaMemset"); }

absl::StatusOr<DeviceBlockIndex> DeviceBlockIndex::Upload(const BlockIndex& index) {
  if (absl::Status s = ValidateBlockIndex(index); !s.ok()) return s;
  DeviceBlockIndex out;
  out.host_ = index;
  for (absl::Status s :
       {UploadVector(index.cu_seqlens, &out.cu_seqlens_),
        UploadVector(index.cu_blocks, &out.cu_blocks_), UploadVector(index.row_ptr, &out.row_ptr_),
        UploadVector(index.col_idx, &out.col_idx_), UploadVector(index.flags, &out.flags_),
        UploadVector(index.col_ptr, &out.col_ptr_), UploadVector(index.row_idx, &out.row_idx_),
        UploadVector(index.col_flags, &out.col_flags_)}) {
    if (!s.ok()) return s;
  }
  return out;
}

absl::StatusOr<Selection> SelectBlocks(absl::Span<const int32_t> cu_seqlens, int heads,
                                       int head_dim, const void* q, const void* k,
                                       absl::Span<const double> densities,
                                       const SelectionOptions& options) {
  if (absl::Status s = ValidateSelectionInputs(cu_seqlens, heads, head_dim, densities, options);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckPointers({{"q", q}, {"k", k}}); !s.ok()) return s;
  const int sequences = static_cast<int>(cu_seqlens.size()) - 1;
  const int block_size = options.block_size;
  std::vector<int32_t> cu_blocks(1, 0);
  std::vector<int64_t> tri_base(1, 0);
  for (int s = 0; s < sequences; ++s) {
    const int64_t n = QueryBlocks(cu_seqlens[s + 1] - cu_seqlens[s], block_size);
    cu_blocks.push_back(cu_blocks.back() + static_cast<int32_t>(n));
    tri_base.push_back(tri_base.back() + int64_t{heads} * n * (n + 1) / 2);
  }
  const int64_t rows = int64_t{cu_blocks.back()} * heads;
  DeviceBuffer d_cu_seqlens, d_cu_blocks, d_tri_base;
  for (absl::Status s :
       {UploadVector(std::vector<int32_t>(cu_seqlens.begin(), cu_seqlens.end()), &d_cu_seqlens),
        UploadVector(cu_blocks, &d_cu_blocks), UploadVector(tri_base, &d_tri_base)}) {
    if (!s.ok()) return s;
  }
  const size_t pooled = static_cast<size_t>(cu_blocks.back()) * heads * head_dim;
  absl::StatusOr<DeviceBuffer> q_mean = DeviceBuffer::Allocate(pooled * sizeof(float));
  if (!q_mean.ok()) return q_mean.status();
  absl::StatusOr<DeviceBuffer> k_mean = DeviceBuffer::Allocate(pooled * sizeof(float));
  if (!k_mean.ok()) return k_mean.status();
  absl::StatusOr<DeviceBuffer> scores =
      DeviceBuffer::Allocate(static_cast<size_t>(tri_base.back()) * sizeof(float));
  if (!scores.ok()) return scores.status();
  PoolKernel<<<dim3(static_cast<unsigned>(cu_blocks.back()), static_cast<unsigned>(heads)),
               head_dim>>>(static_cast<const int32_t*>(d_cu_seqlens.data()),
                           static_cast<const int32_t*>(d_cu_blocks.data()), sequences, heads,
                           head_dim, block_size, static_cast<const bf16*>(q),
                           static_cast<const bf16*>(k), static_cast<float*>(q_mean->data()),
                           static_cast<float*>(k_mean->data()));
  if (absl::Status s = CheckLaunch("PoolKernel"); !s.ok()) return s;
  const float scale = ResolveScale(options.softmax_scale, head_dim);
  ScoreKernel<<<static_cast<unsigned>(rows), 128, head_dim * sizeof(float)>>>(
      static_cast<const int32_t*>(d_cu_blocks.data()),
      static_cast<const int64_t*>(d_tri_base.data()), sequences, heads, head_dim, scale,
      static_cast<const float*>(q_mean->data()), static_cast<const float*>(k_mean->data()),
      static_cast<float*>(scores->data()));
  if (absl::Status s = CheckLaunch("ScoreKernel"); !s.ok()) return s;
  std::vector<float> host_scores(static_cast<size_t>(tri_base.back()));
  if (absl::Status s = scores->CopyToHost(host_scores.data(), host_scores.size() * sizeof(float));
      !s.ok()) {
    return s;
  }
  // The per-row choice on the host, with the CPU path's own rule (SelectRow).
  return SelectFromScores(
      cu_seqlens, heads, densities, options, [&](int s, int h, const KeepRow& keep_row) {
        const int64_t n = cu_blocks[s + 1] - cu_blocks[s];
        for (int32_t i = 0; i < n; ++i) {
          keep_row(i, absl::MakeConstSpan(host_scores.data() + tri_base[s] + h * n * (n + 1) / 2 +
                                              int64_t{i} * (i + 1) / 2,
                                          i + 1));
        }
      });
}

absl::Status Forward(const DeviceBlockIndex& index, int head_dim, const void* q, const void* k,
                     const void* v, float softmax_scale, void* out, float* lse) {
  if (absl::Status s = ValidateAttentionArgs(index, head_dim, softmax_scale); !s.ok()) return s;
  if (absl::Status s = CheckPointers({{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"lse", lse}});
      !s.ok()) {
    return s;
  }
  Params p = MakeParams(index, head_dim, softmax_scale, q, k, v);
  p.out_w = static_cast<bf16*>(out);
  p.lse_w = lse;
  const int64_t rows = index.host().rows();
  return DispatchShape(index.host().block_size, head_dim, [&](auto b, auto d) {
    return LaunchForward<decltype(b)::value, decltype(d)::value>(p, rows);
  });
}

absl::Status Backward(const DeviceBlockIndex& index, int head_dim, const void* q, const void* k,
                      const void* v, const void* out, const float* lse, const void* dout,
                      float softmax_scale, float* delta, void* dq, void* dk, void* dv) {
  if (absl::Status s = ValidateAttentionArgs(index, head_dim, softmax_scale); !s.ok()) return s;
  if (absl::Status s = CheckPointers({{"q", q},
                                      {"k", k},
                                      {"v", v},
                                      {"out", out},
                                      {"lse", lse},
                                      {"dout", dout},
                                      {"delta", delta},
                                      {"dq", dq},
                                      {"dk", dk},
                                      {"dv", dv}});
      !s.ok()) {
    return s;
  }
  Params p = MakeParams(index, head_dim, softmax_scale, q, k, v);
  p.out = static_cast<const bf16*>(out);
  p.dout = static_cast<const bf16*>(dout);
  p.lse_in = lse;
  p.dq = static_cast<bf16*>(dq);
  p.dk = static_cast<bf16*>(dk);
  p.dv = static_cast<bf16*>(dv);
  const int64_t rows = index.host().rows();
  return DispatchShape(index.host().block_size, head_dim, [&](auto b, auto d) {
    return LaunchBackward<decltype(b)::value, decltype(d)::value>(p, rows, delta);
  });
}

absl::Status MatmulBf16(int64_t m, int64_t n, int64_t k, const void* a, bool a_transposed,
                        const void* b, bool b_transposed, void* c) {
  if (m < 1 || n < 1 || k < 1 || m > INT_MAX || n > INT_MAX || k > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("MatmulBf16 dimensions m=", m, " n=", n,
                                                   " k=", k, " must be in [1, ", INT_MAX, "]"));
  }
  if (absl::Status s = CheckPointers({{"a", a}, {"b", b}, {"c", c}}); !s.ok()) return s;
  std::call_once(cublas_once, [] { cublas_init_status = cublasCreate(&cublas_handle); });
  if (cublas_init_status != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cublasCreate failed with status ", static_cast<int>(cublas_init_status)));
  }
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
  const float alpha = 1.0f;
  const float beta = 0.0f;
  const cublasStatus_t status = cublasGemmEx(
      cublas_handle, b_transposed ? CUBLAS_OP_T : CUBLAS_OP_N,
      a_transposed ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
      static_cast<int>(k), &alpha, b, CUDA_R_16BF, static_cast<int>(b_transposed ? k : n), a,
      CUDA_R_16BF, static_cast<int>(a_transposed ? m : k), &beta, c, CUDA_R_16BF,
      static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (status != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cublasGemmEx failed with status ", static_cast<int>(status)));
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace sparsebalance
