// What the planner service does per step, without the network: JobRegistry::SubmitBatch (plan
// with the job's learned model, store the step) and every rank's ReportStep (validate, store,
// and on the last one fold the step into the latency and recall models), with a real PlanStore
// in a temporary directory, on a job whose model has already learned from kWarmSteps steps and
// goes on learning (learn 1; learn 2 also from each layer's recall, below), or that plans with its
// prior and is never reported to (learn 0).
//
//   sb-server-bench --benchmark_filter='ServerStep' --benchmark_repetitions=3
//
// Counters per step, in the calling thread's CPU time: submit_ms (plan, and store the step when the
// third argument is 1), reports_ms (all ranks' ReportStep), fold_ms (the last rank's ReportStep:
// validate, store, fold), report_us (mean of the other ranks' ReportStep, microseconds),
// record_mb (with a store: the size of the last step's record on disk, MB). The same
// job without a store (third argument 0) separates planning and folding from storing. The fifth
// argument is the planning threads (JobRegistry::Options::plan_threads, as sb-planner's
// --plan_threads); with more than one, submit_wall_ms is what the submit took on the clock (the
// helpers' CPU is not the calling thread's). README "Planning speed" reports them.
//
// The batch is the pretrain trace at a realistic fill: `samples` documents over `ranks` ranks,
// two micro-batches per rank whose capacity puts the batch at 85% of the step's tokens
// (documents longer than the capacity are cut to it). Timings come from a hidden truth the
// model does not share (other coefficients, 5% of the ranks 1.3x slower, 5% noise), and every
// document reports a measured recall. With learn 2 it reports each layer's too, as sb-worker's
// recall probe does (on by default on CPU, --recall_rows on CUDA): the job then learns a curve
// per layer, and its plans split each sample's density over the layers (LayerDensities).
//
// RoundStep is the same with sb-load's step scenario's batch instead (README "Service load"):
// documents of 256-4,096 tokens, uniform, four micro-batches of 65,536 tokens per rank (about
// 13% full), and its reports (RoundReport). Placement balances it to within a few hundredths of
// a percent, which the pretrain batch never is; its tune phase once cost 3-4x the pretrain
// batch's there (README "Planning speed", twelfth session), unseen by every other benchmark.
#include <malloc.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "planner/latency_model.h"
#include "planner/plan_threads.h"
#include "planner/planner.h"
#include "planner/traces.h"
#include "server/job_registry.h"
#include "server/plan_store.h"

namespace sparsebalance {
namespace {

constexpr int kWarmSteps = 6;
constexpr int kMicroBatches = 2;
constexpr double kFill = 0.85;
// sb-load's step scenario (bench/sb_load.cc Batch and CreateJob).
constexpr int kRoundMicroBatches = 4;
constexpr int64_t kRoundCapacity = 65536;

// The calling thread's CPU time: the counters measure the planner's work, not how busy the
// machine is (the registry runs each call on the caller's thread).
struct Clock {
  using time_point = double;  // seconds
  static double now() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }
};

double Millis(double seconds) { return 1e3 * seconds; }

// What sb-load's rank r reports (bench/sb_load.cc PlanThenReport): its plan 5% slower than
// predicted, half of it attention, each document's recall on the curve 1 - (1 - rho)^4. The
// planner's own prediction as the "truth" is no test of its accuracy, and none is made here:
// RoundStep and History time and weigh that round (its steps come out as balanced as there).
// With `layers` > 0 each document also reports its layers' recalls (exponents 2-6 over the
// layers, at each layer's density), as sb-worker's recall probe does.
std::vector<MicroBatchTiming> RoundReport(const StepPlan& plan, int r, int layers = 0) {
  std::vector<MicroBatchTiming> out;
  const auto& micro_batches = plan.ranks[r].micro_batches;
  for (size_t m = 0; m < micro_batches.size(); ++m) {
    const MicroBatchPlan& mb = micro_batches[m];
    if (mb.samples.empty()) continue;
    MicroBatchTiming& t = out.emplace_back();
    t.micro_batch = static_cast<int>(m);
    t.compute_seconds = std::max(1e-3, mb.predicted_seconds * 1.05);
    t.attention_seconds = 0.5 * t.compute_seconds;
    t.tokens = mb.tokens;
    t.achieved_density = mb.default_density;
    t.recall = 0.9;
    for (const PlannedSample& s : mb.samples) {
      DocumentRecallMeasurement& d =
          t.documents.emplace_back(DocumentRecallMeasurement{s.id, 0, 0.0, {}, 8});
      d.recall = 1.0 - std::pow(1.0 - s.density, 4.0);
      for (int l = 0; l < layers; ++l) {
        const double rho = s.layer_densities.empty() ? s.density : s.layer_densities[l];
        d.layer_recall.push_back(1.0 -
                                 std::pow(1.0 - rho, 2.0 + 4.0 * l / std::max(1, layers - 1)));
      }
    }
    t.recall_seconds = 0.005 * t.attention_seconds;
  }
  return out;
}

// A job, its store and a batch generator; steps are submitted and reported in order.
class ServerStep {
 public:
  // `round_batch`: sb-load's batch (see the top of this file), else the pretrain trace's.
  ServerStep(int samples, int ranks, bool with_store, int threads, bool round_batch = false,
             bool layer_recall = false)
      : ranks_(ranks), layer_recall_(layer_recall), threads_(threads), round_batch_(round_batch) {
    JobRegistry::Options options;
    options.plan_threads = &threads_;
    if (with_store) {
      dir_ = std::filesystem::temp_directory_path() /
             absl::StrCat("sb-server-bench-", getpid(), "-", samples, "-", ranks);
      std::filesystem::remove_all(dir_);
      absl::StatusOr<std::unique_ptr<PlanStore>> store =
          PlanStore::Open(dir_.string(), /*fsync_reports=*/false);
      if (!store.ok()) {
        error_ = std::string(store.status().message());
        return;
      }
      store_ = *std::move(store);
      options.store = store_.get();
    }
    registry_ = std::make_unique<JobRegistry>(options, [this](int n) {
      std::string s;
      for (int i = 0; i < n; ++i) s.push_back("0123456789abcdef"[rng_() % 16]);
      return s;
    });
    absl::StatusOr<TraceGenerator> gen = TraceGenerator::Builtin("pretrain", 7);
    // Capacity for an 85% fill of this many documents (block-aligned).
    std::vector<Sample> probe;
    int64_t tokens = 0;
    for (int i = 0; i < samples; ++i) {
      probe.push_back(gen->Next());
      tokens += probe.back().length;
    }
    const int64_t raw = static_cast<int64_t>(
        std::ceil(static_cast<double>(tokens) / (kFill * ranks * kMicroBatches)));
    capacity_ = round_batch ? kRoundCapacity : std::max<int64_t>(4096, (raw + 63) / 64 * 64);
    samples_ = samples;
    generator_ = std::make_unique<TraceGenerator>(*std::move(gen));

    JobSettings settings;
    settings.planner.ranks = ranks;
    settings.planner.micro_batches = round_batch ? kRoundMicroBatches : kMicroBatches;
    settings.planner.micro_batch_capacity = capacity_;
    settings.planner.overflow = OverflowPolicy::kDefer;
    absl::StatusOr<CreatedJob> job = registry_->CreateJob("bench", settings, "");
    if (!job.ok()) {
      error_ = std::string(job.status().message());
      return;
    }
    id_ = job->job_id;
    for (int r = 0; r < ranks; ++r) {
      if (!registry_->JoinJob(id_, r).ok()) {
        error_ = "join failed";
        return;
      }
    }
    // The hidden truth: another cost than the model's prior, slow ranks, noise.
    layers_ = settings.planner.shape.layers;
    truth_ = std::make_unique<LatencyModel>(settings.planner.shape, ranks,
                                            CostCoefficients{2.6e-5, 0.8e-4, 3e-3, 0.04});
    for (int r = 0; r < ranks; ++r) slow_.push_back(r % 20 == 7 ? 1.3 : 1.0);
  }
  ~ServerStep() {
    registry_.reset();
    store_.reset();
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }
  const std::string& error() const { return error_; }
  int64_t capacity() const { return capacity_; }

  std::vector<Sample> NextBatch() {
    std::vector<Sample> batch;
    if (round_batch_) {
      std::uniform_real_distribution<double> uniform(0.0, 1.0);
      batch.resize(samples_);
      for (int i = 0; i < samples_; ++i) {
        batch[i].id = static_cast<uint64_t>(step_) * 1000000 + static_cast<uint64_t>(i);
        batch[i].length = 256 + static_cast<int64_t>(uniform(rng_) * 3840);
      }
      return batch;
    }
    for (int i = 0; i < samples_; ++i) {
      Sample s = generator_->Next();
      if (s.length > capacity_) {
        s.length = capacity_;
        s.segments.clear();
      }
      batch.push_back(std::move(s));
    }
    return batch;
  }

  // Submits the next step; its plan and how long the call took.
  absl::StatusOr<std::shared_ptr<const StepPlan>> Submit(const std::vector<Sample>& batch,
                                                         double* ms, double* wall_ms) {
    const Clock::time_point start = Clock::now();
    const auto wall = std::chrono::steady_clock::now();
    absl::StatusOr<SubmitResult> result = registry_->SubmitBatch(id_, step_, batch);
    *ms = Millis(Clock::now() - start);
    *wall_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - wall).count();
    if (!result.ok()) return result.status();
    phases_ = result->plan_phases;
    return std::move(result->plan);
  }

  // The phases of the last step's planning (wall time, PlanStep's PlanPhaseSeconds).
  const PlanPhaseSeconds& phases() const { return phases_; }
  // The size of the last submitted step's record in the store (0 without one).
  double record_bytes() const { return record_bytes_; }

  // What rank r measured in the step (the hidden truth).
  std::vector<MicroBatchTiming> Measure(const StepPlan& plan, int r) {
    if (round_batch_) return RoundReport(plan, r);
    std::vector<MicroBatchTiming> out;
    const auto& micro_batches = plan.ranks[r].micro_batches;
    std::normal_distribution<double> noise(0.0, 0.05);
    for (size_t m = 0; m < micro_batches.size(); ++m) {
      const MicroBatchPlan& mb = micro_batches[m];
      if (mb.samples.empty()) continue;
      const MicroBatchFeatures f = truth_->PlanFeatures(mb);
      MicroBatchTiming t;
      t.micro_batch = static_cast<int>(m);
      t.compute_seconds = truth_->PredictSeconds(r, f) * slow_[r] * std::exp(noise(rng_));
      t.attention_seconds = 0.4 * t.compute_seconds;
      t.tokens = mb.tokens;
      double weighted = 0.0;
      for (const PlannedSample& s : mb.samples) {
        weighted += s.density * static_cast<double>(s.QueryTokens());
      }
      t.achieved_density =
          std::min(1.0, weighted / static_cast<double>(std::max<int64_t>(1, mb.tokens)));
      t.recall = 0.9;
      for (const PlannedSample& s : mb.samples) {
        DocumentRecallMeasurement d;
        d.sample_id = s.id;
        d.document = 0;
        d.recall = 1.0 - std::pow(1.0 - s.density, 4.0);
        if (layer_recall_) {
          // Later layers keep less of their attention at the same density (exponents 2-6,
          // each at the density its layer ran); the document's recall is their mean, as
          // sb-worker reports it.
          d.recall = 0.0;
          for (int l = 0; l < layers_; ++l) {
            const double g = 2.0 + 4.0 * l / std::max(1, layers_ - 1);
            const double rho = s.layer_densities.empty() ? s.density : s.layer_densities[l];
            d.layer_recall.push_back(1.0 - std::pow(1.0 - rho, g));
            d.recall += d.layer_recall.back() / layers_;
          }
        }
        d.rows = 8;
        t.documents.push_back(d);
      }
      out.push_back(std::move(t));
    }
    return out;
  }

  // Every rank's report of the step just submitted; the last rank's call (the fold) apart.
  absl::Status ReportAll(const StepPlan& plan, double* others_ms, double* last_ms) {
    std::vector<std::vector<MicroBatchTiming>> reports(ranks_);
    for (int r = 0; r < ranks_; ++r) reports[r] = Measure(plan, r);
    const Clock::time_point start = Clock::now();
    for (int r = 0; r + 1 < ranks_; ++r) {
      absl::StatusOr<bool> ok = registry_->ReportStep(id_, step_, r, reports[r], 0.01);
      if (!ok.ok()) return ok.status();
    }
    const Clock::time_point last = Clock::now();
    absl::StatusOr<bool> ok = registry_->ReportStep(id_, step_, ranks_ - 1, reports.back(), 0.01);
    if (!ok.ok()) return ok.status();
    *others_ms = Millis(last - start);
    *last_ms = Millis(Clock::now() - last);
    ++step_;
    return absl::OkStatus();
  }

  // One whole step (without reports when `report` is false: the model stays as it is); false
  // (with error()) on failure.
  bool Step(double* submit_ms, double* submit_wall_ms, double* others_ms, double* last_ms,
            bool report = true) {
    const std::vector<Sample> batch = NextBatch();
    absl::StatusOr<std::shared_ptr<const StepPlan>> plan = Submit(batch, submit_ms, submit_wall_ms);
    if (!plan.ok()) {
      error_ = std::string(plan.status().message());
      return false;
    }
    if (!dir_.empty()) {
      std::error_code ignored;
      const auto size =
          std::filesystem::file_size(dir_ / id_ / absl::StrCat("step-", step_, ".pb"), ignored);
      record_bytes_ = ignored ? 0.0 : static_cast<double>(size);
    }
    if (!report) {
      ++step_;
      return true;
    }
    if (absl::Status s = ReportAll(**plan, others_ms, last_ms); !s.ok()) {
      error_ = std::string(s.message());
      return false;
    }
    return true;
  }

 private:
  int ranks_ = 0;
  int layers_ = 0;             // the job's model layers
  bool layer_recall_ = false;  // documents report each layer's recall (learn 2)
  PlanThreads threads_;
  bool round_batch_ = false;
  int samples_ = 0;
  int64_t capacity_ = 0;
  int64_t step_ = 0;
  std::filesystem::path dir_;
  std::unique_ptr<PlanStore> store_;
  std::unique_ptr<JobRegistry> registry_;
  std::unique_ptr<TraceGenerator> generator_;
  std::unique_ptr<LatencyModel> truth_;
  std::vector<double> slow_;
  std::string id_;
  std::string error_;
  std::mt19937_64 rng_{42};
  PlanPhaseSeconds phases_{};
  double record_bytes_ = 0.0;
};

void RunServerStep(benchmark::State& state, bool round_batch) {
  const int samples = static_cast<int>(state.range(0));
  const int ranks = static_cast<int>(state.range(1));
  ServerStep job(samples, ranks, state.range(2) != 0, static_cast<int>(state.range(4)), round_batch,
                 /*layer_recall=*/state.range(3) == 2);
  double submit = 0.0, submit_wall = 0.0, others = 0.0, last = 0.0;
  const bool learn = state.range(3) != 0;
  for (int i = 0; learn && i < kWarmSteps && job.error().empty(); ++i) {
    job.Step(&submit, &submit_wall, &others, &last);
  }
  if (!job.error().empty()) {
    state.SkipWithError(job.error().c_str());
    return;
  }
  double submit_sum = 0.0, submit_wall_sum = 0.0, others_sum = 0.0, last_sum = 0.0;
  PlanPhaseSeconds phase_sums{};
  for (auto _ : state) {
    if (!job.Step(&submit, &submit_wall, &others, &last, learn)) {
      state.SkipWithError(job.error().c_str());
      return;
    }
    for (int k = 0; k < kPlanPhases; ++k) phase_sums[k] += job.phases()[k];
    submit_sum += submit;
    submit_wall_sum += submit_wall;
    others_sum += others;
    last_sum += last;
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["submit_ms"] = submit_sum / n;
  state.counters["submit_wall_ms"] = submit_wall_sum / n;
  state.counters["reports_ms"] = (others_sum + last_sum) / n;
  state.counters["fold_ms"] = last_sum / n;
  state.counters["report_us"] = 1e3 * others_sum / n / std::max(1, ranks - 1);
  state.counters["capacity"] = static_cast<double>(job.capacity());
  if (state.range(2) != 0) state.counters["record_mb"] = job.record_bytes() / 1e6;
  // Where the planning inside the submit went (wall time, ms): see BM_PlanPhases.
  for (int k = 0; k < kPlanPhases; ++k) {
    state.counters[std::string("plan_") + kPlanPhaseNames[k] + "_ms"] = 1e3 * phase_sums[k] / n;
  }
}

void BM_ServerStep(benchmark::State& state) { RunServerStep(state, /*round_batch=*/false); }
void BM_RoundStep(benchmark::State& state) { RunServerStep(state, /*round_batch=*/true); }

BENCHMARK(BM_ServerStep)
    ->ArgsProduct({{512}, {64}, {0, 1}, {1}, {1}})
    ->ArgsProduct({{16384}, {1024}, {0, 1}, {1}, {1, 2}})
    ->ArgsProduct({{65536}, {4096}, {0, 1}, {1}, {1, 2}})
    // Planning with the prior model, nothing reported (learn 0), against the learned one.
    ->Args({16384, 1024, 0, 0, 1})
    // Reports that measure every layer (learn 2): per-layer curves and densities.
    ->ArgsProduct({{16384}, {1024}, {0, 1}, {2}, {2}})
    ->ArgsProduct({{65536}, {4096}, {0, 1}, {2}, {2}})
    ->ArgNames({"samples", "ranks", "store", "learn", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK(BM_RoundStep)
    ->ArgsProduct({{16384}, {1024}, {0, 1}, {1}, {1, 2}})
    ->ArgsProduct({{65536}, {4096}, {0, 1}, {1}, {2}})
    ->ArgNames({"samples", "ranks", "store", "learn", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Bytes the process has allocated and not freed (glibc's count; the history's own bytes are
// the difference over a run).
int64_t HeapBytesInUse() { return static_cast<int64_t>(mallinfo2().uordblks); }

// The memory a job's kept history holds: sb-load's step scenario without the network (its
// batch: `samples` documents of 256-4,096 tokens, uniform; `ranks` ranks of 4 micro-batches of
// 65,536 tokens; every rank reporting its plan 5% slower than predicted, with a measured recall
// per document), run for the job's default history of 64 steps plus 6, so that old steps have
// been dropped. history_mib: heap bytes in use after the run minus before the job's first step;
// step_kib: per kept step. One iteration; memory, not time, is the figure. With layers 1 the
// documents also report each layer's recall (RoundReport), so that the job learns per-layer
// curves and its plans carry a density per layer for each sample. With restart 1 the job has a
// state directory (fsync'ed step records, in the system's temporary directory), and the figure
// is the history of a second registry that restored the job from it after the run (restore_s: the
// restore's wall time; 65,536 samples over 4,096 ranks: restoring a job of the size). With
// restart 2 that registry restores on 2 planning threads, as sb-planner --plan_threads=2 does
// (its steps loaded, checked and packed on them); with 1 on the calling thread alone.
void BM_History(benchmark::State& state) {
  const int samples = static_cast<int>(state.range(0));
  const int ranks = static_cast<int>(state.range(1));
  const bool layer_recall = state.range(2) != 0;
  const bool restart = state.range(3) != 0;
  const int restore_threads = state.range(3) == 2 ? 2 : 1;
  PlanThreads restoring(restore_threads);  // the restoring registry's (it outlives it)
  JobRegistry::Options options;
  std::unique_ptr<PlanStore> store;
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / absl::StrCat("sb-history-bench-", getpid());
  if (restart) {
    std::filesystem::remove_all(dir);
    absl::StatusOr<std::unique_ptr<PlanStore>> opened =
        PlanStore::Open(dir.string(), /*fsync_reports=*/false);
    if (!opened.ok()) return state.SkipWithError(std::string(opened.status().message()).c_str());
    store = *std::move(opened);
    options.store = store.get();
  }
  struct RemoveDir {
    const std::filesystem::path& dir;
    bool remove;
    ~RemoveDir() {
      std::error_code ignored;
      if (remove) std::filesystem::remove_all(dir, ignored);
    }
  } remove_dir{dir, restart};
  auto registry = std::make_unique<JobRegistry>(options, [](int n) { return std::string(n, 'a'); });
  JobSettings settings;
  settings.planner.ranks = ranks;
  settings.planner.micro_batches = 4;
  settings.planner.micro_batch_capacity = 65536;
  absl::StatusOr<CreatedJob> job = registry->CreateJob("history", settings, "");
  if (!job.ok()) return state.SkipWithError(std::string(job.status().message()).c_str());
  for (int r = 0; r < ranks; ++r) registry->JoinJob(job->job_id, r).IgnoreError();
  const int steps = settings.history_steps + 6;
  int64_t before = HeapBytesInUse();
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (auto _ : state) {
    for (int step = 0; step < steps; ++step) {
      std::vector<Sample> batch(samples);
      for (int i = 0; i < samples; ++i) {
        batch[i].id = static_cast<uint64_t>(step) * 1000000 + static_cast<uint64_t>(i);
        batch[i].length = 256 + static_cast<int64_t>(uniform(rng) * 3840);
      }
      absl::StatusOr<SubmitResult> planned = registry->SubmitBatch(job->job_id, step, batch);
      if (!planned.ok())
        return state.SkipWithError(std::string(planned.status().message()).c_str());
      for (int r = 0; r < ranks; ++r) {
        const std::vector<MicroBatchTiming> report =
            RoundReport(*planned->plan, r, layer_recall ? settings.planner.shape.layers : 0);
        absl::StatusOr<bool> reported = registry->ReportStep(job->job_id, step, r, report, 0.01);
        if (!reported.ok()) {
          return state.SkipWithError(std::string(reported.status().message()).c_str());
        }
      }
    }
  }
  int64_t after = HeapBytesInUse();
  if (restart) {  // the same history, as a restarted planner holds it
    registry.reset();
    before = HeapBytesInUse();
    options.plan_threads = restore_threads > 1 ? &restoring : nullptr;
    registry = std::make_unique<JobRegistry>(options, [](int n) { return std::string(n, 'a'); });
    const auto start = std::chrono::steady_clock::now();
    if (absl::Status restored = registry->Restore(); !restored.ok()) {
      return state.SkipWithError(std::string(restored.message()).c_str());
    }
    state.counters["restore_s"] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    after = HeapBytesInUse();
  }
  const double bytes = static_cast<double>(after - before);
  state.counters["history_mib"] = bytes / 1048576.0;
  state.counters["step_kib"] = bytes / 1024.0 / settings.history_steps;
}

BENCHMARK(BM_History)
    ->Args({16384, 1024, 0, 0})
    ->Args({16384, 1024, 1, 0})
    ->Args({16384, 1024, 1, 1})
    ->Args({16384, 1024, 1, 2})
    ->Args({65536, 4096, 0, 1})
    ->Args({65536, 4096, 0, 2})
    ->ArgNames({"samples", "ranks", "layers", "restart"})
    ->Iterations(1)
    ->Unit(benchmark::kSecond);

}  // namespace
}  // namespace sparsebalance

BENCHMARK_MAIN();
