// Planning speed: one PlanStep of a pretrain batch, per policy, scale and planning threads
// (the third number: 1 plans on the calling thread, more split the work, plan_threads.h).
//   sb-planner-bench --benchmark_filter='sparsebalance'
// README "Planning speed" lists the figures measured on the 2-core development machine.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "bench/pretrain_step.h"
#include "benchmark/benchmark.h"
#include "contract/block_geometry.h"
#include "planner/planner.h"
#include "planner/random.h"
#include "planner/traces.h"

namespace sparsebalance {
namespace {

// `samples` documents from the pretrain trace over `ranks` ranks with 4 micro-batches of
// 131072 tokens each (the bars: 512 over 64 and 65,536 over 4,096), planned with `policy` on
// state.range(2) threads. With `max_shards` > 1, context parallelism (sparse-cost shards,
// planner/context_parallel.h). With `phases`, each of PlanStep's phases (PlanPhaseSeconds) gets
// a counter: its mean wall time per plan (ms). Every run reports the plan's predicted makespan
// and its gap to the lower bound (StepPlan::gap), so that a faster plan is not a worse one.
// With `in_plan_order`, the batch is first laid out in the order its plan places the samples
// (rank by rank), so that every phase after placement reads it front to back: how much of a
// plan's time the samples' scattered order costs.
void PlanPretrainBatch(benchmark::State& state, Policy policy, int max_shards, bool phases,
                       bool in_plan_order = false, bool destroy_untimed = false) {
  const int samples = static_cast<int>(state.range(0));
  const int ranks = static_cast<int>(state.range(1));
  const int threads = static_cast<int>(state.range(2));
  const PretrainStep pretrain(samples, ranks, policy, max_shards);
  std::vector<Sample> batch = pretrain.batch;
  const LatencyModel& model = pretrain.model;
  const RecallModel& recall = pretrain.recall;
  absl::StatusOr<ValidConfig> valid = ValidConfig::Check(pretrain.config);
  if (!valid.ok()) {
    state.SkipWithError(std::string(valid.status().message()).c_str());
    return;
  }
  PlanThreads pool(threads);
  if (in_plan_order) {
    const absl::StatusOr<StepPlan> plan = PlanStep(batch, *valid, model, recall, &pool);
    if (!plan.ok()) {
      state.SkipWithError(std::string(plan.status().message()).c_str());
      return;
    }
    // The trace numbers its samples from 0 in batch order.
    std::vector<Sample> ordered;
    for (const RankPlan& rank : plan->ranks) {
      for (const MicroBatchPlan& micro_batch : rank.micro_batches) {
        for (const PlannedSample& planned : micro_batch.samples) {
          ordered.push_back(pretrain.batch[planned.id - pretrain.batch.front().id]);
        }
      }
    }
    batch = std::move(ordered);
  }
  PlanPhaseSeconds step{};
  PlanPhaseSeconds total{};
  double makespan = 0.0;
  double gap = 0.0;
  for (auto _ : state) {
    absl::StatusOr<StepPlan> plan =
        PlanStep(batch, *valid, model, recall, &pool, phases ? &step : nullptr);
    if (!plan.ok()) {
      state.SkipWithError(std::string(plan.status().message()).c_str());
      break;
    }
    for (int k = 0; k < kPlanPhases; ++k) total[k] += step[k];
    // Read after the loop, so the plan is not optimized away. (Not through
    // benchmark::DoNotOptimize: Debian's google-benchmark 1.7 hands a double to it as "+m,r",
    // and GCC 12 read back 0 for the plan's makespan.)
    makespan = plan->makespan_seconds;
    gap = plan->gap;
    if (destroy_untimed) {
      state.PauseTiming();
      plan = absl::StatusOr<StepPlan>();  // the plan freed off the clock
      state.ResumeTiming();
    }
  }
  // What the plan achieves, beside how fast it came (the same batch every iteration).
  state.counters["makespan_ms"] = benchmark::Counter(1e3 * makespan);
  state.counters["gap_pct"] = benchmark::Counter(100.0 * gap);
  state.counters["samples/s"] = benchmark::Counter(static_cast<double>(samples),
                                                   benchmark::Counter::kIsIterationInvariantRate);
  if (!phases) return;
  const double plans = static_cast<double>(std::max<int64_t>(1, state.iterations()));
  for (int k = 0; k < kPlanPhases; ++k) {
    state.counters[std::string(kPlanPhaseNames[k]) + "_ms"] = 1e3 * total[k] / plans;
  }
}

void BM_PlanStep(benchmark::State& state, Policy policy, int max_shards) {
  PlanPretrainBatch(state, policy, max_shards, /*phases=*/false);
}

// PlanStep alone: BM_PlanStep's sparsebalance plan, each plan freed with the clock stopped. In
// BM_PlanStep the caller frees each plan before the next one starts (about 1 ms of a 2-thread
// plan at 65,536/4,096, on one thread: 65,536 planned samples in some 20,000 heap blocks); the
// service frees a plan only when it packs the step, after its ranks have their plans.
//   sb-planner-bench --benchmark_filter='BM_PlanStepAlone'
void BM_PlanStepAlone(benchmark::State& state) {
  PlanPretrainBatch(state, Policy::kSparseBalance, /*max_shards=*/1, /*phases=*/false,
                    /*in_plan_order=*/false, /*destroy_untimed=*/true);
}
BENCHMARK(BM_PlanStepAlone)
    ->Args({16384, 1024, 2})
    ->Args({65536, 4096, 1})
    ->Args({65536, 4096, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Where a plan's time goes: the sparsebalance plan of BM_PlanStep, phase by phase.
//   sb-planner-bench --benchmark_filter=PlanPhases
void BM_PlanPhases(benchmark::State& state) {
  PlanPretrainBatch(state, Policy::kSparseBalance, /*max_shards=*/1, /*phases=*/true);
}
BENCHMARK(BM_PlanPhases)
    ->Args({16384, 1024, 1})
    ->Args({65536, 4096, 1})
    ->Args({65536, 4096, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The same with the batch laid out in plan order (PlanPretrainBatch): run beside BM_PlanPhases,
// the difference is what the samples' scattered order costs a plan (README "Planning speed").
//   sb-planner-bench --benchmark_filter='PlanPhases.*/65536/4096/1/'
void BM_PlanPhasesInPlanOrder(benchmark::State& state) {
  PlanPretrainBatch(state, Policy::kSparseBalance, /*max_shards=*/1, /*phases=*/true,
                    /*in_plan_order=*/true);
}
BENCHMARK(BM_PlanPhasesInPlanOrder)
    ->Args({65536, 4096, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Active blocks of the documents of a plan with a density per layer: the pretrain trace's first
// 65,536 samples (each document of the packed ones) at 32 layer densities each, spread around a
// sample density in [0.1, 0.5] (as LayerDensities spreads them), at the default block size and
// window. Counted layer by layer (ActiveBlocksOfQueryBlocks in a loop: state.range(0) = 0) or
// all layers at once (ActiveBlocksOfQueryBlocksSum: 1). Time per sample.
//   sb-planner-bench --benchmark_filter=LayerBlocks
void BM_LayerBlocks(benchmark::State& state) {
  constexpr int kSamples = 65536;
  constexpr int kLayers = 32;
  const ModelShape shape;
  absl::StatusOr<TraceGenerator> generator = TraceGenerator::Builtin("pretrain", 7);
  Rng rng(11);
  std::vector<std::vector<int64_t>> rows(kSamples);
  std::vector<double> densities(static_cast<size_t>(kSamples) * kLayers);
  for (int i = 0; i < kSamples; ++i) {
    const Sample s = generator->Next();
    for (int64_t length : s.segments.empty() ? std::vector<int64_t>{s.length} : s.segments) {
      rows[i].push_back(QueryBlocks(length, shape.block_size));
    }
    const double density = 0.1 + 0.4 * rng.Uniform();
    for (int l = 0; l < kLayers; ++l) {
      densities[static_cast<size_t>(i) * kLayers + l] =
          std::min(1.0, density * (0.5 + static_cast<double>(l) / kLayers + 0.1 * rng.Uniform()));
    }
  }
  const bool at_once = state.range(0) == 1;
  int64_t blocks = 0;
  for (auto _ : state) {
    for (int i = 0; i < kSamples; ++i) {
      const double* layer = &densities[static_cast<size_t>(i) * kLayers];
      for (int64_t r : rows[i]) {
        if (at_once) {
          blocks += ActiveBlocksOfQueryBlocksSum(r, layer, kLayers, shape.local_blocks);
        } else {
          for (int l = 0; l < kLayers; ++l) {
            blocks += ActiveBlocksOfQueryBlocks(r, layer[l], shape.local_blocks);
          }
        }
      }
    }
  }
  benchmark::DoNotOptimize(blocks);
  state.SetItemsProcessed(state.iterations() * kSamples);
  state.counters["ns_per_sample"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * kSamples,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_LayerBlocks)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

#define SB_PLAN_BENCH(name, policy, max_shards)            \
  BENCHMARK_CAPTURE(BM_PlanStep, name, policy, max_shards) \
      ->Args({512, 64, 1})                                 \
      ->Args({8192, 512, 1})                               \
      ->Args({16384, 1024, 1})                             \
      ->Args({65536, 4096, 1})                             \
      ->Unit(benchmark::kMillisecond)                      \
      ->UseRealTime()

SB_PLAN_BENCH(sequential, Policy::kSequential, 1);
SB_PLAN_BENCH(flops, Policy::kFlops, 1);
SB_PLAN_BENCH(sab, Policy::kSab, 1);
SB_PLAN_BENCH(dst, Policy::kDst, 1);
SB_PLAN_BENCH(sparsebalance, Policy::kSparseBalance, 1)
    ->Args({16384, 1024, 2})
    ->Args({65536, 4096, 2})
    ->Args({65536, 4096, 4});
SB_PLAN_BENCH(sparsebalance_cp8, Policy::kSparseBalance, 8);

}  // namespace
}  // namespace sparsebalance

BENCHMARK_MAIN();
