// libFuzzer target for request validation: arbitrary bytes as a SubmitBatchRequest, as a
// CreateJobRequest's config and as a RankPlan (what a client reads). Validation must never
// crash; an accepted batch must plan into a plan that passes CheckPlan, and an accepted plan
// holds only planned samples that obey the planner's rules. Built by scripts/test.sh with clang
// (-fsanitize=fuzzer,address) and run briefly; `FUZZ_SECONDS=600 bash scripts/fuzz.sh` runs it
// longer.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "planner/latency_model.h"
#include "planner/planner.h"
#include "proto/wire.h"

namespace sparsebalance {
namespace {

void CheckRequest(const uint8_t* data, size_t size) {
  v1::SubmitBatchRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return;
  PlannerConfig config;
  config.ranks = 4;
  config.micro_batches = 2;
  config.micro_batch_capacity = 16384;
  config.overflow = request.step() % 2 == 0 ? OverflowPolicy::kError : OverflowPolicy::kDefer;
  config.policy = AllPolicies()[static_cast<uint64_t>(request.step()) % AllPolicies().size()];
  WireLimits limits;
  limits.max_samples = 512;
  limits.max_segments = 64;
  absl::StatusOr<std::vector<Sample>> batch = SamplesFromProto(request.samples(), limits);
  if (!batch.ok()) {
    if (batch.status().message().empty()) std::abort();  // every refusal says why
    return;
  }
  if (absl::Status status = ValidateBatch(*batch, config); !status.ok()) {
    if (status.message().empty()) std::abort();
    return;
  }
  const LatencyModel model(config.shape, config.ranks, kDefaultCostPrior);
  absl::StatusOr<StepPlan> plan = PlanStep(*batch, config, model);
  if (plan.ok() && !CheckPlan(*plan, *batch, config).ok()) {
    std::fprintf(stderr, "accepted batch gave an invalid plan: %s\n",
                 std::string(CheckPlan(*plan, *batch, config).message()).c_str());
    std::abort();
  }
}

void CheckConfig(const uint8_t* data, size_t size) {
  v1::JobConfig config;
  if (!config.ParseFromArray(data, static_cast<int>(size))) return;
  absl::StatusOr<JobSettings> settings = ConfigFromProto(config, WireLimits());
  if (settings.ok() && !ValidateConfig(settings->planner).ok()) std::abort();
  if (!settings.ok() && settings.status().message().empty()) std::abort();
}

void CheckRankPlanMessage(const uint8_t* data, size_t size) {
  v1::RankPlan plan;
  if (!plan.ParseFromArray(data, static_cast<int>(size))) return;
  absl::StatusOr<std::vector<MicroBatchPlan>> read = MicroBatchesFromProto(plan);
  if (!read.ok()) {
    if (read.status().message().empty()) std::abort();
    return;
  }
  for (const MicroBatchPlan& mb : *read) {
    for (const PlannedSample& p : mb.samples) {
      // Length 0 only in the old form (no `samples`), to be filled from the batch.
      if (p.length < 0 || p.length > kMaxMicroBatchCapacity) std::abort();
      if (!(p.density > 0.0 && p.density <= 1.0)) std::abort();
      if (p.length > 0 && !ValidateSegments(p.length, p.segments, "sample").ok()) std::abort();
      for (double d : p.layer_densities) {
        if (!(d > 0.0 && d <= 1.0)) std::abort();
      }
    }
  }
}

}  // namespace
}  // namespace sparsebalance

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  sparsebalance::CheckRequest(data, size);
  sparsebalance::CheckConfig(data, size);
  sparsebalance::CheckRankPlanMessage(data, size);
  return 0;
}
