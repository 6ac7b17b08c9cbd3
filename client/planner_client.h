// The C++ client of sb-planner for trainers: one PlannerClient per process, a TrainerSession
// per rank. No gRPC or protobuf types appear here (pimpl), so a trainer links it without
// seeing them.
//
//   ClientOptions options;  options.target = "planner:50151";
//   options.job_id = id;  options.token = token;
//   auto client = PlannerClient::Connect(options);
//   TrainerSession session(client->get(), rank, /*coordinator=*/rank == 0);
//   absl::StatusOr<RankStepPlan> plan = session.Plan(step, batch);   // never stalls training
//   ... run plan->micro_batches ...
//   session.Report(step, measurements, wait_seconds);               // buffered while away
//
// Every call has a deadline; UNAVAILABLE (and only it) is retried with exponential backoff
// and jitter by gRPC's retry policy. When the planner stays unreachable past the deadline,
// TrainerSession::Plan computes the step locally with planner/ (the same plan on every rank
// that falls back: same batch, same config, same model) and says so in `local_fallback`.
// Ranks must agree on which plan they use: a trainer should all-reduce `local_fallback` and,
// if any rank fell back, every rank uses LocalPlan().
//
// Coming back: the coordinator keeps the batches of the steps it ran on local plans (bounded
// like the reports) and, once the planner answers again, submits them first, marked
// planned_locally: the planner records the local plans, so the reports buffered meanwhile fit
// them and reach the latency model, and the job's steps go on in order. Steps whose batches were
// dropped from that buffer are skipped by the planner (metric sparsebalance_skipped_steps_total).
#ifndef SPARSEBALANCE_CLIENT_PLANNER_CLIENT_H_
#define SPARSEBALANCE_CLIENT_PLANNER_CLIENT_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/types.h"

namespace sparsebalance {

struct ClientOptions {
  std::string target = "127.0.0.1:50151";  // host:port of sb-planner
  std::string job_id;
  std::string token;                   // the job token (CreateJob's answer)
  std::string admin_token;             // for CreateJob/ListJobs/DeleteJob when the planner has one
  double call_timeout_seconds = 10.0;  // deadline of every call but GetRankPlan
  double plan_timeout_seconds = 60.0;  // how long GetRankPlan waits for the step's plan
  // TLS: when root_certs_pem is set the channel is TLS; with cert_chain_pem and
  // private_key_pem it presents a client certificate (mutual TLS).
  std::string root_certs_pem;
  std::string cert_chain_pem;
  std::string private_key_pem;
  int max_buffered_reports = 4096;  // reports kept while the planner is away
};

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
};

class PlannerClient {
 public:
  static absl::StatusOr<std::unique_ptr<PlannerClient>> Connect(const ClientOptions& options);
  ~PlannerClient();
  PlannerClient(const PlannerClient&) = delete;
  PlannerClient& operator=(const PlannerClient&) = delete;

  // Creates a job; afterwards this client speaks for it (its id and token are set).
  absl::StatusOr<JobHandle> CreateJob(const std::string& name, const PlannerConfig& config,
                                      int history_steps = 0);
  // Deletes a job and its state (admin token when the planner has one).
  absl::Status DeleteJob(const std::string& job_id);
  // Announces `rank`; returns the job's config and the next step the planner will plan. With
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
  // (planner.h) fills them from the batch, as TrainerSession::Plan does. INTERNAL for a plan
  // that fails MicroBatchFromProto's checks.
  absl::StatusOr<RankStepPlan> GetRankPlan(int64_t step, int rank);
  // Returns true when the planner had this (step, rank) already.
  absl::StatusOr<bool> ReportStep(int64_t step, int rank,
                                  const std::vector<MicroBatchTiming>& micro_batches,
                                  double wait_seconds, bool planned_locally = false);

  const ClientOptions& options() const;

 private:
  struct Impl;
  explicit PlannerClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The per-rank step helper. Not thread-safe: one per rank thread.
class TrainerSession {
 public:
  // `config` is the job's (JoinJob returns it); the local fallback plans with it.
  TrainerSession(PlannerClient* client, int rank, bool coordinator, PlannerConfig config);

  // This rank's plan for `step`: the coordinator submits `batch` (every rank passes the same
  // global batch), every rank gets its part. If the planner cannot be reached (UNAVAILABLE or
  // DEADLINE_EXCEEDED), the plan is computed locally and marked local_fallback. Other errors
  // (a bad batch, a wrong token) are returned: they would fail locally too, or must be fixed;
  // FAILED_PRECONDITION when the planner's plan names a sample that `batch` lacks or differs
  // from. Every planned sample carries its length and segments.
  absl::StatusOr<RankStepPlan> Plan(int64_t step, const std::vector<Sample>& batch);
  // The locally computed plan of `step` (what every falling-back rank uses). Remembers that this
  // rank ran `step` locally (its report says so; the coordinator resubmits the batch later).
  absl::StatusOr<RankStepPlan> LocalPlan(int64_t step, const std::vector<Sample>& batch);
  // Reports this rank's timings; while the planner is away reports are kept (bounded: the
  // oldest go first) and sent, in order, before the next report.
  absl::Status Report(int64_t step, const std::vector<MicroBatchTiming>& micro_batches,
                      double wait_seconds);
  // Sends what is buffered now (e.g. at the end of training): the coordinator's locally
  // planned steps, then the reports. UNAVAILABLE while the planner is still away (everything
  // stays buffered); reports of steps the coordinator has not resubmitted yet stay too.
  absl::Status Flush();
  size_t buffered_reports() const { return pending_.size(); }
  // Batches of locally planned steps the coordinator has not told the planner about yet.
  size_t unsent_local_steps() const { return local_batches_.size(); }
  // Reports given up (the planner refused them for good, or the buffer overflowed).
  int64_t dropped_reports() const { return dropped_reports_; }

 private:
  struct PendingReport {
    int64_t step;
    std::vector<MicroBatchTiming> micro_batches;
    double wait_seconds;
    bool planned_locally;
  };
  absl::Status FlushPending();
  // Coordinator: submits the batches of locally planned steps, oldest first. UNAVAILABLE when
  // the planner is still away (the rest stay queued).
  absl::Status ResubmitLocalSteps();
  size_t BufferLimit() const;

  PlannerClient* client_;
  int rank_;
  bool coordinator_;
  PlannerConfig config_;
  std::deque<PendingReport> pending_;
  std::deque<std::pair<int64_t, std::vector<Sample>>> local_batches_;  // coordinator only
  std::deque<int64_t> local_steps_;  // steps this rank ran locally, ascending, bounded
  int64_t dropped_reports_ = 0;
  int64_t last_planner_step_ = -1;  // the latest step whose plan came from the planner
};

// True when the planner cannot serve now: not reachable (UNAVAILABLE), past the deadline, or
// unable to write its state directory (ErrorReason kReasonStateDirFailure: disk full or
// read-only). The session then plans locally and keeps its reports until the planner is back.
bool IsUnreachable(const absl::Status& status);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_CLIENT_PLANNER_CLIENT_H_
