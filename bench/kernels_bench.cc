// CPU reference speed (Google Benchmark): forward + backward of block-sparse attention on one
// document, per density, and block selection. kernels/README.md lists the figures measured on
// the 2-core development machine and the bar (density 0.1 at most 0.2x the time of 1.0 at 16K
// tokens). Counters: active blocks (all heads), seconds per active block, GFLOP/s (matmul
// FLOPs of the kept blocks, FlashAttention's count) in total and per thread.
//   sb-kernels-bench --benchmark_filter='FwdBwd/16384'
#include <cstdint>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/attention_cpu.h"
#include "kernels/bf16.h"
#include "kernels/block_selection.h"
#include "kernels/cuda_attention.h"
#include "kernels/parallel.h"
#include "kernels/shard_attention.h"

namespace sparsebalance {
namespace kernels {
namespace {

constexpr int kHeads = 2;  // one (sequence, head) task per core of the development machine

std::vector<float> Values(size_t n, uint32_t seed) {
  std::vector<float> out(n);
  uint32_t state = seed * 2654435761u + 1;
  for (float& x : out) {
    state = state * 1664525u + 1013904223u;
    x = static_cast<float>(state >> 8) / static_cast<float>(1u << 24) * 2.0f - 1.0f;
  }
  return out;
}

// Args: length (tokens), density (per mille), head_dim, block_size.
void BM_AttentionFwdBwd(benchmark::State& state) {
  const int32_t length = static_cast<int32_t>(state.range(0));
  const double density = static_cast<double>(state.range(1)) / 1000.0;
  const int head_dim = static_cast<int>(state.range(2));
  const int block_size = static_cast<int>(state.range(3));
  const size_t n = static_cast<size_t>(length) * kHeads * head_dim;
  const std::vector<float> q = Values(n, 1), k = Values(n, 2), v = Values(n, 3),
                           dout = Values(n, 4);
  std::vector<float> out(n), lse(static_cast<size_t>(length) * kHeads), dq(n), dk(n), dv(n);
  SelectionOptions select;
  select.block_size = block_size;
  absl::StatusOr<Selection> sel =
      SelectBlocks({0, length}, kHeads, head_dim, q, k, {density}, select);
  if (!sel.ok()) {
    state.SkipWithError(std::string(sel.status().message()).c_str());
    return;
  }
  AttentionOptions options;
  for (auto _ : state) {
    absl::Status s = AttentionForward(sel->index, head_dim, q, k, v, options, absl::MakeSpan(out),
                                      absl::MakeSpan(lse));
    if (s.ok()) {
      s = AttentionBackward(sel->index, head_dim, q, k, v, out, lse, dout, options,
                            absl::MakeSpan(dq), absl::MakeSpan(dk), absl::MakeSpan(dv));
    }
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      break;
    }
    benchmark::DoNotOptimize(dq.data());
  }
  const double blocks = static_cast<double>(sel->index.active_blocks());
  const double flops = blocks * (ForwardFlopsPerBlock(block_size, head_dim) +
                                 BackwardFlopsPerBlock(block_size, head_dim));
  const int threads = ResolveThreads(0);
  state.counters["active_blocks"] = blocks;
  state.counters["s_per_block"] = benchmark::Counter(
      blocks, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["GFLOPs"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOPs_per_core"] =
      benchmark::Counter(flops * 1e-9 / threads, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_AttentionFwdBwd)
    ->ArgNames({"length", "density_permille", "head_dim", "block"})
    ->Args({16384, 1000, 128, 64})
    ->Args({16384, 300, 128, 64})
    ->Args({16384, 100, 128, 64})
    ->Args({16384, 1000, 64, 128})
    ->Args({16384, 100, 64, 128})
    ->Args({4096, 1000, 128, 64})
    ->Args({4096, 100, 128, 64})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MeasureProcessCPUTime();

// Args: length (tokens), density (per mille).
void BM_SelectBlocks(benchmark::State& state) {
  const int32_t length = static_cast<int32_t>(state.range(0));
  const double density = static_cast<double>(state.range(1)) / 1000.0;
  const int head_dim = 128;
  const size_t n = static_cast<size_t>(length) * kHeads * head_dim;
  const std::vector<float> q = Values(n, 1), k = Values(n, 2);
  for (auto _ : state) {
    absl::StatusOr<Selection> sel =
        SelectBlocks({0, length}, kHeads, head_dim, q, k, {density}, SelectionOptions{});
    benchmark::DoNotOptimize(sel->index.col_idx.data());
  }
}
BENCHMARK(BM_SelectBlocks)
    ->ArgNames({"length", "density_permille"})
    ->Args({16384, 100})
    ->Args({131072, 100})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Context parallelism on the CPU: one document, selection + forward + backward, unsplit
// (shards = 1: SelectBlocks, AttentionForward, AttentionBackward) or split into `shards` even
// block-aligned shards run one after another in this process by ShardedAttentionReference
// (pooled-key gather, per-shard selection, per-chunk partials merged, per-chunk backward,
// memory copies for the exchange). Counters: key/value bytes the shards receive, whole prefix
// and only the needed blocks.
//   sb-kernels-bench --benchmark_filter=Document
void BM_Document(benchmark::State& state) {
  const int32_t length = static_cast<int32_t>(state.range(0));
  const int shards = static_cast<int>(state.range(1));
  const double density = static_cast<double>(state.range(2)) / 1000.0;
  constexpr int kDocHeads = 8;
  constexpr int kHeadDim = 128;
  constexpr int kBlock = 64;
  const size_t n = static_cast<size_t>(length) * kDocHeads * kHeadDim;
  const std::vector<float> q = Values(n, 1), k = Values(n, 2), v = Values(n, 3),
                           dout = Values(n, 4);
  SelectionOptions select;
  select.block_size = kBlock;
  AttentionOptions options;
  std::vector<int32_t> cuts = {0};
  const int32_t blocks = length / kBlock;
  for (int j = 1; j < shards; ++j) cuts.push_back(blocks * j / shards * kBlock);
  cuts.push_back(length);
  std::vector<float> out(n), lse(static_cast<size_t>(length) * kDocHeads), dq(n), dk(n), dv(n);
  for (auto _ : state) {
    if (shards == 1) {
      absl::StatusOr<Selection> sel =
          SelectBlocks({0, length}, kDocHeads, kHeadDim, q, k, {density}, select);
      absl::Status s = sel.status();
      if (s.ok()) {
        s = AttentionForward(sel->index, kHeadDim, q, k, v, options, absl::MakeSpan(out),
                             absl::MakeSpan(lse));
      }
      if (s.ok()) {
        s = AttentionBackward(sel->index, kHeadDim, q, k, v, out, lse, dout, options,
                              absl::MakeSpan(dq), absl::MakeSpan(dk), absl::MakeSpan(dv));
      }
      if (!s.ok()) {
        state.SkipWithError(std::string(s.message()).c_str());
        break;
      }
      benchmark::DoNotOptimize(dq.data());
    } else {
      absl::StatusOr<ShardedAttentionResult> r = ShardedAttentionReference(
          cuts, kDocHeads, kHeadDim, q, k, v, dout, density, select, options);
      if (!r.ok()) {
        state.SkipWithError(std::string(r.status().message()).c_str());
        break;
      }
      state.counters["prefix_bytes"] = static_cast<double>(r->prefix_exchange_bytes);
      state.counters["needed_bytes"] = static_cast<double>(r->needed_exchange_bytes);
      benchmark::DoNotOptimize(r->dq.data());
    }
  }
}
BENCHMARK(BM_Document)
    ->ArgNames({"length", "shards", "density_permille"})
    ->Args({16384, 1, 300})
    ->Args({16384, 4, 300})
    ->Args({16384, 4, 100})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MeasureProcessCPUTime()
    ->Iterations(1);

// GPU (sm_90, bf16): block selection, forward and backward separately, one document of 32
// heads x 128, timed by synchronising the device around each call, on the tensor-core kernels
// (tensor_cores:1) or the scalar reference kernels (tensor_cores:0, up to 32K tokens: they are
// far slower). Counters: TFLOP/s against the dense causal equivalent (what the same attention
// would cost dense: 4 * L^2/2 * d * heads forward, 2.5x backward), and against the kept blocks
// (what the kernels compute). Skips without a device.
//   sb-kernels-bench --benchmark_filter=Cuda
constexpr int kGpuHeads = 32;
constexpr int kHeadDim = 128;

// False (the benchmark skipped, saying why) without a CUDA device.
bool HaveDevice(benchmark::State& state) {
  std::string why;
  if (cuda::DeviceCount(&why) > 0) return true;
  state.SkipWithError(("no CUDA device: " + why).c_str());
  return false;
}

// `n` bf16 values of Values(n, seed) on the device.
absl::StatusOr<cuda::DeviceBuffer> DeviceValues(size_t n, uint32_t seed) {
  const std::vector<float> host = Values(n, seed);
  std::vector<uint16_t> bf16(n);
  for (size_t i = 0; i < n; ++i) bf16[i] = FloatToBf16(host[i]);
  absl::StatusOr<cuda::DeviceBuffer> buffer = cuda::DeviceBuffer::Allocate(n * 2);
  if (!buffer.ok()) return buffer;
  if (absl::Status s = buffer->CopyFromHost(bf16.data(), n * 2); !s.ok()) return s;
  return buffer;
}

void BM_CudaAttention(benchmark::State& state) {
  if (!HaveDevice(state)) return;
  const int32_t length = static_cast<int32_t>(state.range(0));
  const double density = static_cast<double>(state.range(1)) / 1000.0;
  const bool backward = state.range(2) != 0;
  const cuda::KernelPath path =
      state.range(3) != 0 ? cuda::KernelPath::kTensorCore : cuda::KernelPath::kScalar;
  const size_t n = static_cast<size_t>(length) * kGpuHeads * kHeadDim;
  auto device = [&](uint32_t seed) { return DeviceValues(n, seed); };
  absl::StatusOr<cuda::DeviceBuffer> q = device(1), k = device(2), v = device(3), dout = device(4),
                                     out = device(5), dq = device(6), dk = device(7),
                                     dv = device(8);
  absl::StatusOr<cuda::DeviceBuffer> lse =
      cuda::DeviceBuffer::Allocate(static_cast<size_t>(length) * kGpuHeads * 4);
  absl::StatusOr<cuda::DeviceBuffer> delta =
      cuda::DeviceBuffer::Allocate(static_cast<size_t>(length) * kGpuHeads * 4);
  for (const auto* b : {&q, &k, &v, &dout, &out, &dq, &dk, &dv, &lse, &delta}) {
    if (!b->ok()) {
      state.SkipWithError(std::string(b->status().message()).c_str());
      return;
    }
  }
  absl::StatusOr<cuda::DeviceSelection> sel = cuda::SelectBlocks(
      {0, length}, kGpuHeads, kHeadDim, q->data(), k->data(), {density}, {}, cuda::Stream{});
  if (!sel.ok()) {
    state.SkipWithError(std::string(sel.status().message()).c_str());
    return;
  }
  const cuda::DeviceBlockIndex* index = &sel->index;
  auto forward = [&] {
    return cuda::Forward(*index, kHeadDim, q->data(), k->data(), v->data(), 0.0f, out->data(),
                         static_cast<float*>(lse->data()), cuda::Stream{}, path);
  };
  if (absl::Status s = forward(); !s.ok()) {  // also the LSE the backward needs
    state.SkipWithError(std::string(s.message()).c_str());
    return;
  }
  for (auto _ : state) {
    absl::Status s = backward
                         ? cuda::Backward(*index, kHeadDim, q->data(), k->data(), v->data(),
                                          out->data(), static_cast<float*>(lse->data()),
                                          dout->data(), 0.0f, static_cast<float*>(delta->data()),
                                          dq->data(), dk->data(), dv->data(), cuda::Stream{}, path)
                         : forward();
    if (s.ok()) s = cuda::Synchronize();
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      break;
    }
  }
  const double per_block =
      backward ? BackwardFlopsPerBlock(64, kHeadDim) : ForwardFlopsPerBlock(64, kHeadDim);
  const double blocks = static_cast<double>(sel->index.active_blocks());
  const double dense_flops = (backward ? 2.5 : 1.0) * 4.0 * 0.5 * static_cast<double>(length) *
                             length * kHeadDim * kGpuHeads;
  state.counters["active_blocks"] = blocks;
  state.counters["TFLOPs_dense_equivalent"] =
      benchmark::Counter(dense_flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["TFLOPs_active_blocks"] =
      benchmark::Counter(blocks * per_block * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_CudaAttention)
    ->ArgNames({"length", "density_permille", "backward", "tensor_cores"})
    ->ArgsProduct({{8192, 32768, 131072}, {1000, 300, 100}, {0, 1}, {1}})
    ->ArgsProduct({{8192, 32768}, {1000, 300, 100}, {0, 1}, {0}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// GPU block selection alone (pooling, scores, each row's choice, the CSR/CSC index), 32 heads x
// 128, one document.
void BM_CudaSelection(benchmark::State& state) {
  if (!HaveDevice(state)) return;
  const int32_t length = static_cast<int32_t>(state.range(0));
  const double density = static_cast<double>(state.range(1)) / 1000.0;
  const size_t n = static_cast<size_t>(length) * kGpuHeads * kHeadDim;
  absl::StatusOr<cuda::DeviceBuffer> q = DeviceValues(n, 1), k = DeviceValues(n, 2);
  if (!q.ok() || !k.ok()) {
    state.SkipWithError(std::string((q.ok() ? k : q).status().message()).c_str());
    return;
  }
  int64_t blocks = 0;
  for (auto _ : state) {
    absl::StatusOr<cuda::DeviceSelection> sel = cuda::SelectBlocks(
        {0, length}, kGpuHeads, kHeadDim, q->data(), k->data(), {density}, {}, cuda::Stream{});
    absl::Status s = sel.ok() ? cuda::Synchronize() : sel.status();
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      break;
    }
    blocks = sel->index.active_blocks();
  }
  state.counters["active_blocks"] = static_cast<double>(blocks);
}
BENCHMARK(BM_CudaSelection)
    ->ArgNames({"length", "density_permille"})
    ->ArgsProduct({{8192, 32768, 131072}, {1000, 300, 100}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace kernels
}  // namespace sparsebalance

BENCHMARK_MAIN();
