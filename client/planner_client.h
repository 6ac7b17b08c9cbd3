// The C++ client of sb-planner for trainers: one PlannerClient per process, speaking every
// PlannerService call with a deadline; UNAVAILABLE (and only it) is retried with exponential
// backoff and jitter by gRPC's retry policy. No gRPC or protobuf types appear here (pimpl), so
// a trainer links it without seeing them. Each rank plans and reports through a TrainerSession
// (trainer_session.h), which falls back to local plans while the planner is away.
//
//   ClientOptions options;  options.target = "planner:50151";
//   options.job_id = id;  options.token = token;
//   absl::StatusOr<std::unique_ptr<PlannerClient>> client = PlannerClient::Connect(options);
//   absl::StatusOr<std::pair<PlannerConfig, int64_t>> joined = (*client)->JoinJob(rank);
#ifndef SPARSEBALANCE_CLIENT_PLANNER_CLIENT_H_
#define SPARSEBALANCE_CLIENT_PLANNER_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/types.h"

namespace sparsebalance {

struct ClientOptions {
  std::string target = "127.0.0.1:50151";  // host:port of sb-planner
  std::string job_id;
  std::string token;        // the job token (CreateJob's answer)
  std::string admin_token;  // for CreateJob/ListJobs/DeleteJob when the planner has one
  // Finite and > 0 (Connect refuses others); above 1e8 s (about 3 years) a call waits 1e8 s.
  double call_timeout_seconds = 10.0;  // deadline of every call but GetRankPlan
  double plan_timeout_seconds = 60.0;  // how long GetRankPlan waits for the step's plan
  // TLS: when root_certs_pem is set the channel is TLS; with cert_chain_pem and
  // private_key_pem it presents a client certificate (mutual TLS).
  std::string root_certs_pem;
  std::string cert_chain_pem;
  std::string private_key_pem;
  int max_buffered_reports = 4096;  // reports kept while the planner is away
  // Report over one long-lived ReportSteps stream instead of a unary ReportStep call per
  // report (a planner without it, or a refused stream: unary calls). Off by default: on the
  // planner's side a streamed report costs as much CPU as a call, or more with thousands of
  // ranks (README, Service load); the stream saves only the sender's call set-up.
  bool report_stream = false;
  // This worker's host name, sent with JoinJob (GetJob's slowest ranks and the slow-rank
  // metrics name it): at most 253 characters of [A-Za-z0-9._:-]. Empty: the machine's
  // (LocalHostName).
  std::string host_name;
};

// The machine's host name (gethostname) in the form JoinJob accepts (characters outside
// [A-Za-z0-9._:-] become '-'); "" when it has none.
std::string LocalHostName();

// A rank's report as bytes (a serialized ReportStepRequest) to hand to another rank, e.g. the
// leader of its node that sends the node's reports in one ReportStepBatch call
// (BalancerOptions::gather_reports), and back. The planner checks the report's contents;
// Decode refuses only bytes that are not a report: INVALID_ARGUMENT.
std::string EncodeRankStepReport(const RankStepReport& report);
absl::StatusOr<RankStepReport> DecodeRankStepReport(const std::string& bytes);

// A job as CreateJob made it.
struct JobHandle {
  std::string job_id;
  std::string token;
  PlannerConfig config;
  int history_steps = 0;
};

// One rank's part of a step plan.
struct RankStepPlan {
  int64_t step = 0;
  int rank = 0;
  std::vector<MicroBatchPlan> micro_batches;
  double predicted_seconds = 0.0;
  double predicted_makespan_seconds = 0.0;
  // Computed on this rank (PlanStepLocally), not by the planner; or the planner's record of a
  // step the trainer ran on its local plan.
  bool local_fallback = false;
  // The step's deferred samples (OverflowPolicy::kDefer), the same on every rank: the next
  // step's batch must hold them again (TrainerSession::Plan carries them itself).
  std::vector<uint64_t> deferred_ids;
};

// A rank's plan that another rank fetched for it (GetRankPlans' `encoded`: a serialized
// GetRankPlanResponse), checked as GetRankPlan checks its answer (with the job's world size and
// block size when given). INVALID_ARGUMENT for bytes that are not a plan, INTERNAL for a plan
// that fails the checks.
absl::StatusOr<RankStepPlan> DecodeRankStepPlan(const std::string& bytes, int world_size = 0,
                                                int block_size = 0);

class PlannerClient {
 public:
  static absl::StatusOr<std::unique_ptr<PlannerClient>> Connect(const ClientOptions& options);
  ~PlannerClient();
  PlannerClient(const PlannerClient&) = delete;
  PlannerClient& operator=(const PlannerClient&) = delete;

  // Creates a job; afterwards this client speaks for it (its id and token are set).
  absl::StatusOr<JobHandle> CreateJob(const std::string& name, const PlannerConfig& config,
                                      int history_steps = 0);
  // Deletes a job and its state. Sends the admin token when the options hold one, else the
  // job token: a job deletes itself without the admin token.
  absl::Status DeleteJob(const std::string& job_id);
  // Announces `rank` (and options.host_name, or the machine's); returns the job's config and
  // the next step the planner will plan. With
  // `rank_next_step`, also the first kept step this rank has not reported (where a restarted
  // rank resumes).
  absl::StatusOr<std::pair<PlannerConfig, int64_t>> JoinJob(int rank,
                                                            int64_t* rank_next_step = nullptr);
  // Replaces the job's cost prior with a profile table (sb-profile's output); returns the
  // device it names.
  absl::StatusOr<std::string> UploadProfile(const std::string& profile_text);
  // Submits a step's global batch (coordinator rank); returns the deferred sample ids.
  // `planned_locally`: the trainer ran this step on its local fallback plan (see the proto).
  absl::StatusOr<std::vector<uint64_t>> SubmitBatch(int64_t step, const std::vector<Sample>& batch,
                                                    bool planned_locally = false);
  // Waits (up to plan_timeout_seconds) for the step's plan and returns this rank's part. A
  // planner older than PlannedSample sends no lengths: they are 0 until CompletePlannedSamples
  // (planner.h) fills them from the batch, as TrainerSession::Plan does. INTERNAL for an answer
  // without a plan, a plan of another step or rank, or one that fails MicroBatchFromProto's
  // checks. A shard of a split document comes with its token range, group and index
  // (PlannedSample::shard_*); given the job's world size and block size (TrainerSession passes
  // its config's), its group's ranks and its first token are checked against them too.
  absl::StatusOr<RankStepPlan> GetRankPlan(int64_t step, int rank, int world_size = 0,
                                           int block_size = 0);
  // The plans of several ranks of `step` in one GetRankPlans call (1 to 1,024 distinct ranks:
  // kMaxBatchRanks in proto/wire.h), e.g. a node leader's for its node: waits as GetRankPlan
  // does and returns them in `ranks`' order, each checked as GetRankPlan checks its own
  // (INTERNAL naming `plans[k]`). With `encoded`, also each plan as bytes to hand to its rank
  // (DecodeRankStepPlan reads them back there), as the Balancer's node plans do
  // (BalancerOptions::scatter_plans).
  absl::StatusOr<std::vector<RankStepPlan>> GetRankPlans(
      int64_t step, const std::vector<int>& ranks, int world_size = 0, int block_size = 0,
      std::vector<std::string>* encoded = nullptr);
  // Returns true when the planner had this (step, rank) already. Sent on the client's
  // ReportSteps stream (opened on the first report, and again after a report's error) when
  // options.report_stream is set and no other report is using it; a report whose stream fails
  // before its answer (the planner restarted, drained, refused the stream or lacks the method)
  // is sent again by a unary call, which the planner answers as a duplicate if the first copy
  // arrived. A stream past call_timeout_seconds without an answer is cancelled:
  // DEADLINE_EXCEEDED.
  absl::StatusOr<bool> ReportStep(int64_t step, int rank,
                                  const std::vector<MicroBatchTiming>& micro_batches,
                                  double wait_seconds, bool planned_locally = false);

  // Several reports of the job in one ReportStepBatch call (1 to 1,024: kMaxBatchReports in
  // proto/wire.h), e.g. a node's ranks gathered to one of them: the planner spends a fraction of
  // a ReportStep's CPU on each. Returns, per report in order, whether the planner had it
  // already. The first report the planner refuses ends the call with its error, which names it
  // (`reports[k]`); the reports before it were accepted, and sending the call again is harmless.
  // Never on the report stream; UNAVAILABLE is retried as for every call.
  absl::StatusOr<std::vector<bool>> ReportStepBatch(const std::vector<RankStepReport>& reports);

  // The options Connect got, with the job this client speaks for now (CreateJob's, once it
  // answered): a copy, as CreateJob on another thread may change the job.
  ClientOptions options() const;

 private:
  struct Impl;
  explicit PlannerClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// True when the planner cannot serve now: not reachable (UNAVAILABLE), past the deadline, or
// unable to write its state directory (ErrorReason kReasonStateDirFailure: disk full or
// read-only). A TrainerSession then plans locally and keeps its reports until the planner is
// back.
bool IsUnreachable(const absl::Status& status);

// True when the planner could not serve a call for a reason of its own that may be gone when the
// call is made again: IsUnreachable, or the planner at one of its limits or out of memory
// (RESOURCE_EXHAUSTED, e.g. --max_waiting_calls), failing inside (INTERNAL, UNKNOWN), or the call
// ABORTED or CANCELLED on its side. A TrainerSession then plans locally and keeps a report for
// later, as while the planner is away. Not the answers about the call itself (INVALID_ARGUMENT,
// NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION, OUT_OF_RANGE, PERMISSION_DENIED,
// UNAUTHENTICATED), a server without the method (UNIMPLEMENTED), DATA_LOSS, or a job at its
// bound in the planner's state directory (IsJobStateQuota, proto/wire.h), which lasts until
// someone acts: a TrainerSession then plans locally without sending the refused batch again, and
// drops a report so refused (dropped_reports()) instead of keeping it.
bool IsTransient(const absl::Status& status);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_CLIENT_PLANNER_CLIENT_H_
