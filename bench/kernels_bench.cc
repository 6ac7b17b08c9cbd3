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
#include "kernels/block_selection.h"
#include "kernels/parallel.h"

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

}  // namespace
}  // namespace kernels
}  // namespace sparsebalance

BENCHMARK_MAIN();
