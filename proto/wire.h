// Translation between the wire contract (planner.proto) and the planner's own types, shared by
// sb-planner and the client: defaults for zero values, validation whose messages name the
// field and index, and the one absl::Status -> grpc::Status conversion.
//
//   absl::StatusOr<PlannerConfig> config = ConfigFromProto(request.config());
//   absl::StatusOr<std::vector<Sample>> batch = SamplesFromProto(request.samples(), limits);
//   *response.mutable_plan() = RankPlanToProto(plan, step, rank);
//   absl::StatusOr<std::vector<MicroBatchPlan>> mine = MicroBatchesFromProto(response.plan());
#ifndef SPARSEBALANCE_PROTO_WIRE_H_
#define SPARSEBALANCE_PROTO_WIRE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/support/status.h"
#include "planner/types.h"
#include "sparsebalance/planner/v1/planner.pb.h"

namespace sparsebalance {

namespace v1 = ::sparsebalance::planner::v1;

// Defaults for JobConfig fields left at zero.
inline constexpr int kDefaultHistorySteps = 64;

// Limits on what one request may carry; each has its own RESOURCE_EXHAUSTED message.
struct WireLimits {
  int max_samples = 1 << 20;   // samples per SubmitBatch
  int max_segments = 1 << 16;  // segments per sample
  int max_world_size = 65536;  // ranks per job
  int max_history_steps = 4096;
};

// A caller's string (a job id, an update_mask path) as an error message quotes it: C-escaped,
// its first kMaxQuoted bytes and "..." after longer ones. Quoted whole, a 20 KB job id made the
// answer's status larger than gRPC's 16 KiB metadata limit, and the caller got
// RESOURCE_EXHAUSTED (which clients take for the planner being busy) instead of the error.
inline constexpr size_t kMaxQuoted = 80;
std::string Quoted(absl::string_view text);

// Checks a worker's host name (JoinJobRequest.host, ClientOptions::host_name): empty, or at
// most kMaxHostName characters of [A-Za-z0-9._:-]. INVALID_ARGUMENT naming `field`.
inline constexpr int kMaxHostName = 253;
absl::Status ValidateHostName(const std::string& host, absl::string_view field = "host");
// `host` made valid for ValidateHostName: other characters become '-', cut to kMaxHostName.
std::string SanitizeHostName(std::string host);

// A job config with its bounded history length (the planner's PlannerConfig has no history).
struct JobSettings {
  PlannerConfig planner;
  int history_steps = kDefaultHistorySteps;
};

// Fills defaults for zero fields (shape 32x32x128, blocks of 64, 1 local block, densities
// 0.05/1.0/0.3, sparsebalance, mean, error) and validates; messages name "config.<field>".
// RESOURCE_EXHAUSTED for this planner's own limit on the world size; INVALID_ARGUMENT,
// naming the bound, for everything else, including the arithmetic upper bounds that
// ValidateConfig enforces (planner/types.h: capacity, micro-batches, plan slots, shape).
absl::StatusOr<JobSettings> ConfigFromProto(const v1::JobConfig& config, const WireLimits& limits);
v1::JobConfig ConfigToProto(const JobSettings& settings);

// What an UpdateJobConfigRequest asks to change: the values (enums converted; INVALID_ARGUMENT
// naming "config.<field>" for an unknown value of a field the mask names) and the field names
// of its update_mask, which JobRegistry::UpdateJobConfig applies and checks.
struct ConfigUpdate {
  JobSettings values;
  std::vector<std::string> fields;
};
absl::StatusOr<ConfigUpdate> ConfigUpdateFromProto(const v1::UpdateJobConfigRequest& request);

// Converts the samples, checking only this planner's limits (RESOURCE_EXHAUSTED naming
// "samples" or "samples[i].segments"). Whether they fit a job is the job's to check
// (ValidateBatch against its config: JobRegistry::SubmitBatch, PlanStep).
absl::StatusOr<std::vector<Sample>> SamplesFromProto(
    const google::protobuf::RepeatedPtrField<v1::Sample>& samples, const WireLimits& limits);
void SampleToProto(const Sample& sample, v1::Sample* out);

// Enum conversions; the UNSPECIFIED values map to the planner's defaults, unknown values are
// INVALID_ARGUMENT naming `field`.
absl::StatusOr<Policy> PolicyFromProto(v1::Policy policy, absl::string_view field);
absl::StatusOr<DstMode> DstModeFromProto(v1::DstMode mode, absl::string_view field);
absl::StatusOr<OverflowPolicy> OverflowFromProto(v1::OverflowPolicy policy,
                                                 absl::string_view field);
v1::Policy PolicyToProto(Policy policy);
v1::DstMode DstModeToProto(DstMode mode);
v1::OverflowPolicy OverflowToProto(OverflowPolicy policy);
absl::StatusOr<SelectionMode> SelectionFromProto(v1::Selection selection, absl::string_view field);
v1::Selection SelectionToProto(SelectionMode selection);
absl::StatusOr<ShardPolicy> ShardPolicyFromProto(v1::ShardPolicy policy, absl::string_view field);
v1::ShardPolicy ShardPolicyToProto(ShardPolicy policy);

// Both ways with the measured recall (documents, recall_seconds) and exchange_seconds;
// TimingFromProto converts without checking: ValidateMeasuredRecall (and the registry's
// ValidateReport, which also checks exchange_seconds against the plan) check.
void TimingToProto(const MicroBatchTiming& timing, v1::MicroBatchReport* out);
MicroBatchTiming TimingFromProto(const v1::MicroBatchReport& report);
// A rank's report of a step and back, without checking (the registry checks it against the
// plan); the message's job_id is left alone.
void ReportToProto(const RankStepReport& report, v1::ReportStepRequest* out);
RankStepReport ReportFromProto(const v1::ReportStepRequest& request);

// Checks a micro-batch's measured recall against a model of `layers` layers: recall_seconds
// finite and >= 0; per document, a non-negative index, (sample_id, document) reported once,
// recall in [0, 1], layer_recall empty or one per layer (each in [0, 1]), rows >= 1.
// INVALID_ARGUMENT naming `<where>.documents[k].<field>`, e.g.
// "micro_batches[0].documents[2].recall: 1.5 is outside [0, 1]"; `where` is called only for a
// message (a report is checked on every ReportStep). Which samples the plan gave the
// micro-batch is the registry's to check.
absl::Status ValidateMeasuredRecall(const MicroBatchTiming& timing, int layers,
                                    absl::FunctionRef<std::string()> where);
// The same for every micro-batch of a report, `where` being "micro_batches[m]".
absl::Status ValidateMeasuredRecall(const std::vector<MicroBatchTiming>& micro_batches, int layers);

v1::PlanFigures FiguresToProto(const StepPlan& plan);
// The same into `out` (a message on an arena stays on it: no copy).
void FiguresToProto(const StepPlan& plan, v1::PlanFigures* out);
// One rank's part of a step plan.
v1::RankPlan RankPlanToProto(const StepPlan& plan, int64_t step, int rank);
// The same into `out` (e.g. a message on an arena, or a response being built). Without
// `figures` the step's figures (the same in every rank's part) are left out. Without
// `old_form` so is the deprecated copy of the samples that readers older than
// MicroBatch.samples take (sample_ids, densities and MicroBatch.layer_densities): for the
// planner's own step records (server/state_codec.h), where that copy doubled the bytes of a
// job with per-layer densities.
void RankPlanToProto(const StepPlan& plan, int64_t step, int rank, v1::RankPlan* out,
                     bool figures = true, bool old_form = true);
// What a reader of a rank plan knows of its job, for the checks of shards that need it; 0: not
// known, and that check is left to a reader that knows the job (the service checks stored
// plans against the job's config: server/job_state.h ValidateStoredPlan; TrainerSession passes
// its config).
struct PlanContext {
  int world_size = 0;  // shard groups' ranks must be in [0, world_size)
  int block_size = 0;  // a shard's first token must be a multiple of it
};

// A micro-batch from the wire, checked: `samples` when present; otherwise (an older planner's
// message) the ids and densities, with length 0 (unknown) for CompletePlannedSamples
// (planner.h) to fill from the step's batch. Lengths in [1, kMaxMicroBatchCapacity] (or 0 in
// the old form), segments as ValidateSegments requires, densities and layer densities in
// (0, 1]. A shard: no segments, 0 <= shard.begin < shard.end <= length, shard.begin a multiple
// of job.block_size (when known), shard.group's ranks distinct, >= 0 and below job.world_size
// (when known), at most kMaxShards of them, shard.index in range and shard.group[index] ==
// `rank` (when `rank` >= 0: the rank whose plan it is). INVALID_ARGUMENT naming
// `samples[k].<field>` (`densities` or `sample_ids` in the old form; `shard.begin` etc.).
absl::StatusOr<MicroBatchPlan> MicroBatchFromProto(const v1::MicroBatch& micro_batch, int rank = -1,
                                                   const PlanContext& job = {});
// Every micro-batch of a rank plan (its shards checked against plan.rank()), the same way;
// messages name `micro_batches[m]` first.
absl::StatusOr<std::vector<MicroBatchPlan>> MicroBatchesFromProto(const v1::RankPlan& plan,
                                                                  const PlanContext& job = {});

// Machine-readable reasons an error can carry (ErrorInfo.reason in planner.proto), as an
// absl::Status payload on this side and in the gRPC status details on the wire.
inline constexpr char kReasonStateDirFailure[] = "STATE_DIR_FAILURE";
// A ReportSteps stream refused at the planner's --max_report_streams: report by ReportStep.
inline constexpr char kReasonReportStreamsFull[] = "REPORT_STREAMS_FULL";
// A write refused because it would take one job's files in --state_dir past the planner's
// --max_job_state_mb (RESOURCE_EXHAUSTED). Unlike the planner being busy it does not pass by
// itself: clients do not retry the call (IsTransient is false for it).
inline constexpr char kReasonJobStateQuota[] = "JOB_STATE_QUOTA";
// True for such a refusal (RESOURCE_EXHAUSTED with the reason kReasonJobStateQuota). The job's
// history must be pruned (UpdateJobConfig history_steps), the job deleted, or the bound raised.
bool IsJobStateQuota(const absl::Status& status);
// The most reports one ReportStepBatch call may carry, and ranks one GetRankPlans may ask for.
inline constexpr int kMaxBatchReports = 1024;
inline constexpr int kMaxBatchRanks = 1024;
// `status` with `reason` attached (an OK status stays OK).
absl::Status WithErrorReason(absl::Status status, absl::string_view reason);
// The reason attached to `status`, or "" when it carries none.
std::string ErrorReason(const absl::Status& status);
// `status` (not OK) with its message replaced by `message`, its code and payloads (the reason)
// kept: for adding context to an error on its way out.
absl::Status WithMessage(const absl::Status& status, absl::string_view message);

// The gRPC status for an absl::Status (same code and message, and its reason as an RpcStatus
// with an ErrorInfo in the details); gRPC 1.51 has no converter.
grpc::Status ToGrpcStatus(const absl::Status& status);
// And back, for the client (the reason included).
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PROTO_WIRE_H_
