// libFuzzer target for request validation: arbitrary bytes as a SubmitBatchRequest and as a
// CreateJobRequest's config. Validation must never crash; what it accepts must plan into a
// plan that passes CheckPlan. Built by scripts/test.sh with clang (-fsanitize=fuzzer,address)
// and run briefly; `FUZZ_SECONDS=600 bash scripts/fuzz.sh` runs it longer.
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

}  // namespace
}  // namespace sparsebalance

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  sparsebalance::CheckRequest(data, size);
  sparsebalance::CheckConfig(data, size);
  return 0;
}
