// CPU reference of block-sparse causal attention (DESIGN.md section 9), fp32: the forward
// (online softmax over the kept blocks, saves the log-sum-exp) and the backward (recomputes P
// from the LSE; dK/dV per key block through the CSC, dQ accumulated per query block).
// Threads work on whole (sequence, head) pairs, and time is proportional to the active
// blocks. Layouts follow FlashAttention's varlen API:
//   q, k, v, out, dout, dq, dk, dv: [total_tokens, heads, head_dim] row-major fp32
//   lse: [heads, total_tokens] (natural log of the softmax denominator of each query)
//
//   AttentionOptions options;
//   absl::Status s = AttentionForward(selection.index, /*head_dim=*/128, q, k, v, options,
//                                     absl::MakeSpan(out), absl::MakeSpan(lse));
#ifndef SPARSEBALANCE_KERNELS_ATTENTION_CPU_H_
#define SPARSEBALANCE_KERNELS_ATTENTION_CPU_H_

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/block_index.h"

namespace sparsebalance {
namespace kernels {

struct AttentionOptions {
  float softmax_scale = 0.0f;  // 0 means 1/sqrt(head_dim)
  int threads = 0;             // 0 means the hardware concurrency
};

// head_dim is 64 or 128; every tensor's size is checked against the index.
absl::Status AttentionForward(const BlockIndex& index, int head_dim, absl::Span<const float> q,
                              absl::Span<const float> k, absl::Span<const float> v,
                              const AttentionOptions& options, absl::Span<float> out,
                              absl::Span<float> lse);

// Gradients of sum(out * dout) with respect to q, k and v; `out` and `lse` come from
// AttentionForward with the same inputs and index.
absl::Status AttentionBackward(const BlockIndex& index, int head_dim, absl::Span<const float> q,
                               absl::Span<const float> k, absl::Span<const float> v,
                               absl::Span<const float> out, absl::Span<const float> lse,
                               absl::Span<const float> dout, const AttentionOptions& options,
                               absl::Span<float> dq, absl::Span<float> dk, absl::Span<float> dv);

// Floating-point operations of one kept block, counted as FlashAttention does (matmuls only):
// forward 4 * B^2 * head_dim, backward 2.5x that.
double ForwardFlopsPerBlock(int block_size, int head_dim);
double BackwardFlopsPerBlock(int block_size, int head_dim);

}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_ATTENTION_CPU_H_
