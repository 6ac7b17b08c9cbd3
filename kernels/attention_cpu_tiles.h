// Per-(sequence, head) work of the CPU reference on raw pointers, compiled once per x86 ISA
// level (attention_cpu_tiles.inc) and chosen at run time by attention_cpu.cc. Internal.
#ifndef SPARSEBALANCE_KERNELS_ATTENTION_CPU_TILES_H_
#define SPARSEBALANCE_KERNELS_ATTENTION_CPU_TILES_H_

#include <cstdint>

namespace sparsebalance {
namespace kernels {

// One (sequence, head): index slices start at its first row; tensor pointers at its first
// token for its head (consecutive tokens are `token_stride` floats apart); lse at its first
// token with stride 1.
struct HeadTask {
  int block_size = 64;               // tokens, 64 or 128
  int head_dim = 64;                 // 64 or 128
  int32_t length = 0;                // tokens
  int32_t blocks = 0;                // ceil(length / block_size)
  float scale = 0.0f;                // softmax scale
  int64_t token_stride = 0;          // floats
  const int64_t* row_ptr = nullptr;  // blocks + 1 entries (absolute offsets)
  const int32_t* col_idx = nullptr;
  const uint8_t* flags = nullptr;
  const int64_t* col_ptr = nullptr;  // blocks + 1 entries (absolute offsets)
  const int32_t* row_idx = nullptr;
  const uint8_t* col_flags = nullptr;
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* out = nullptr;   // backward input
  const float* dout = nullptr;  // backward input
  const float* lse_in = nullptr;
  float* out_w = nullptr;  // forward output
  float* lse_w = nullptr;  // forward output
  float* dq = nullptr;
  float* dk = nullptr;
  float* dv = nullptr;
  float* workspace = nullptr;  // WorkspaceFloats(...) floats, 64-byte aligned
};

// Floats of workspace one worker needs for a head of `blocks` blocks.
int64_t WorkspaceFloats(int block_size, int head_dim, int32_t blocks, bool backward);

namespace generic {
void ForwardHead(const HeadTask& task);
void BackwardHead(const HeadTask& task);
}  // namespace generic
namespace avx2 {
void ForwardHead(const HeadTask& task);
void BackwardHead(const HeadTask& task);
}  // namespace avx2

}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_ATTENTION_CPU_TILES_H_
