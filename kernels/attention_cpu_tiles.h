// Per-(sequence, head) work of the CPU reference on raw pointers, compiled once per x86 ISA
// level (attention_cpu_tiles.inc) and chosen at run time by attention_cpu.cc. Internal.
#ifndef SPARSEBALANCE_KERNELS_ATTENTION_CPU_TILES_H_
#define SPARSEBALANCE_KERNELS_ATTENTION_CPU_TILES_H_

#include <cstdint>
#include <cstdlib>
#include <memory>

namespace sparsebalance {
namespace kernels {

// One (sequence, head), or one piece of it: the query blocks [query_block0, query_block0 +
// blocks) against the key blocks [key_block0, key_block0 + key_blocks) of a sequence of `length`
// tokens (a whole sequence: both start at 0 and key_blocks == blocks; a context-parallel shard
// over one owner's key chunk otherwise, kernels/shard_attention.h). Index slices start at the
// piece's first row (CSR) and first column (CSC); col_idx and row_idx hold block numbers within
// the sequence. q, out, dout, dq point at the first query token for the head, k, v, dk, dv at
// the first key token (consecutive tokens are `token_stride` floats apart); lse at the first
// query token with stride 1.
struct HeadTask {
  int block_size = 64;               // tokens, 64 or 128
  int head_dim = 64;                 // 64 or 128
  int32_t length = 0;                // tokens of the sequence (masks the causal diagonal and end)
  int32_t blocks = 0;                // query blocks of the piece
  int32_t query_block0 = 0;          // first query block, within the sequence
  int32_t key_block0 = 0;            // first key block, within the sequence
  int32_t key_blocks = 0;            // key blocks of the piece
  bool accumulate = false;           // backward: add to dq, dk, dv instead of writing them
  float scale = 0.0f;                // softmax scale
  int64_t token_stride = 0;          // floats
  const int64_t* row_ptr = nullptr;  // blocks + 1 entries (absolute offsets)
  const int32_t* col_idx = nullptr;
  const uint8_t* flags = nullptr;
  const int64_t* col_ptr = nullptr;  // key_blocks + 1 entries (absolute offsets)
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

  // Points the tensors at one head's part of `base`'s: `offset` floats into the token-major
  // tensors, `lse_offset` into the head-major LSE (null pointers stay null).
  void SetTensors(const HeadTask& base, int64_t offset, int64_t lse_offset) {
    auto shift = [&](auto* p) { return p == nullptr ? p : p + offset; };
    q = shift(base.q);
    k = shift(base.k);
    v = shift(base.v);
    out = shift(base.out);
    dout = shift(base.dout);
    out_w = shift(base.out_w);
    dq = shift(base.dq);
    dk = shift(base.dk);
    dv = shift(base.dv);
    lse_in = base.lse_in == nullptr ? nullptr : base.lse_in + lse_offset;
    lse_w = base.lse_w == nullptr ? nullptr : base.lse_w + lse_offset;
  }
};

// 64-byte aligned float scratch, reused across the pieces one worker runs.
struct TileWorkspace {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data;
  int64_t floats = 0;
  float* Get(int64_t n) {
    if (n > floats) {
      const size_t bytes = (static_cast<size_t>(n) * sizeof(float) + 63) / 64 * 64;
      data.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
      floats = n;
    }
    return data.get();
  }
};

using HeadFn = void (*)(const HeadTask&);

// The widest tile code this CPU runs (AVX2+FMA when CPUID has them, else the generic copy).
HeadFn ForwardHeadFn();
HeadFn BackwardHeadFn();

// Floats of workspace one worker needs for a piece of `query_blocks` x `key_blocks` blocks.
int64_t WorkspaceFloats(int block_size, int head_dim, int32_t query_blocks, int32_t key_blocks,
                        bool backward);

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
