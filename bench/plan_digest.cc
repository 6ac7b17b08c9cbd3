// Digests of the plans of a fixed set of steps, for changes to planning that must not change a
// plan (speed work): build before and after, run both, compare the outputs.
//
//   build/bench/sb-plan-digest > before.txt   # on the old code
//   build/bench/sb-plan-digest > after.txt    # on the new
//   diff before.txt after.txt                 # no output: the same plans, bit for bit
//
// Each line is a case (trace, samples over ranks, micro-batches x capacity, policy, mode, guard,
// recall floor, splitting, overflow) and the FNV-1a hash of its plan's CanonicalPlanText (every
// double in hex), planned on 1 and on 2 threads; the last line hashes them all. The cases cover
// both built-in traces, sizes up to 65,536 samples over 4,096 ranks (placement in parts), three
// policies and modes, the bucket guard on and off, a document recall floor, defer with an
// overfull step, and documents split over ranks. Exits 1 when a case's plans differ between 1
// and 2 threads (they must not: plan_threads.h), 0 otherwise.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "planner/latency_model.h"
#include "planner/plan_threads.h"
#include "planner/planner.h"
#include "planner/recall_model.h"
#include "planner/traces.h"
#include "planner/types.h"

namespace sparsebalance {
namespace {

uint64_t Fnv1a(const std::string& text, uint64_t hash = 1469598103934665603ULL) {
  for (const unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ULL;
  }
  return hash;
}

struct Case {
  int samples;
  int ranks;
  int micro_batches;
  int64_t capacity;
  Policy policy;
  DstMode mode;
  double bucket_margin;  // 1: the bucket guard off
  double recall_floor;
  int max_shards;
  bool defer;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (const Policy policy : {Policy::kSparseBalance, Policy::kDst, Policy::kSab}) {
    for (const DstMode mode : {DstMode::kMean, DstMode::kMin, DstMode::kMax}) {
      cases.push_back({4096, 256, 4, 131072, policy, mode, 0.01, 0.0, 1, false});
      cases.push_back({2048, 64, 2, 65536, policy, mode, 1.0, 0.5, 1, true});
    }
  }
  cases.push_back(
      {65536, 4096, 4, 131072, Policy::kSparseBalance, DstMode::kMean, 0.01, 0.0, 1, false});
  cases.push_back(
      {16384, 1024, 4, 131072, Policy::kSparseBalance, DstMode::kMean, 0.01, 0.0, 1, false});
  cases.push_back(
      {8192, 512, 2, 65536, Policy::kSparseBalance, DstMode::kMean, 0.01, 0.0, 4, true});
  cases.push_back(
      {20000, 512, 2, 65536, Policy::kSparseBalance, DstMode::kMean, 0.01, 0.0, 1, true});
  return cases;
}

int Run() {
  PlanThreads one(1);
  PlanThreads two(2);
  uint64_t all = Fnv1a("");
  int plans = 0;
  int mismatches = 0;
  uint64_t seed = 1;
  for (const Case& c : Cases()) {
    for (const char* trace : {"pretrain", "prolong"}) {
      PlannerConfig config;
      config.ranks = c.ranks;
      config.micro_batches = c.micro_batches;
      config.micro_batch_capacity = c.capacity;
      config.policy = c.policy;
      config.dst_mode = c.mode;
      config.bucket_recall_margin = c.bucket_margin;
      config.document_recall_floor = c.recall_floor;
      config.max_shards = c.max_shards;
      if (c.defer) config.overflow = OverflowPolicy::kDefer;
      const std::string name = absl::StrCat(
          trace, " ", c.samples, "/", c.ranks, " ", c.micro_batches, "x", c.capacity, " ",
          PolicyName(c.policy), " ", DstModeName(c.mode), " margin ", c.bucket_margin, " floor ",
          c.recall_floor, " shards ", c.max_shards, c.defer ? " defer" : "");
      const absl::StatusOr<ValidConfig> valid = ValidConfig::Check(config);
      absl::StatusOr<TraceGenerator> generator = TraceGenerator::Builtin(trace, seed++);
      if (!valid.ok() || !generator.ok()) {
        std::fprintf(
            stderr, "sb-plan-digest: %s: %s\n", name.c_str(),
            std::string(!valid.ok() ? valid.status().message() : generator.status().message())
                .c_str());
        return 2;
      }
      // Lengths above what the config can place whole (or in max_shards pieces) are cut to it.
      const int64_t longest = c.capacity * c.max_shards;
      std::vector<Sample> batch;
      for (int i = 0; i < c.samples; ++i) {
        Sample s = generator->Next();
        s.length = std::min(s.length, longest);
        batch.push_back(s);
      }
      const LatencyModel model(config.shape, c.ranks, kDefaultCostPrior);
      const RecallModel recall(config.micro_batch_capacity, config.shape.layers);
      uint64_t digest[2] = {0, 0};
      PlanThreads* pools[2] = {&one, &two};
      for (int k = 0; k < 2; ++k) {
        const absl::StatusOr<StepPlan> plan = PlanStep(batch, *valid, model, recall, pools[k]);
        digest[k] = Fnv1a(plan.ok() ? CanonicalPlanText(*plan)
                                    : absl::StrCat("error: ", plan.status().ToString()));
        all = Fnv1a(absl::StrCat(digest[k]), all);
        ++plans;
      }
      std::printf("%016llx %s\n", static_cast<unsigned long long>(digest[0]), name.c_str());
      if (digest[1] != digest[0]) {
        ++mismatches;
        std::fprintf(stderr, "sb-plan-digest: %s: 2 threads gave %016llx, 1 thread %016llx\n",
                     name.c_str(), static_cast<unsigned long long>(digest[1]),
                     static_cast<unsigned long long>(digest[0]));
      }
    }
  }
  std::printf("%016llx all %d plans\n", static_cast<unsigned long long>(all), plans);
  return mismatches == 0 ? 0 : 1;
}

}  // namespace
}  // namespace sparsebalance

int main() { return sparsebalance::Run(); }
