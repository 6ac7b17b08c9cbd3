// TrainerSession: one rank's step loop against sb-planner (plan, run, report) that never stalls
// training. When the planner stays unreachable past the deadline, or fails the step for any other
// reason than the trainer's input, Plan computes the step locally with planner/ (the same plan
// on every rank that falls back: same batch, same config, same model) and says so in
// `local_fallback`. Ranks must agree on which plan they use: a trainer should all-reduce
// `local_fallback` and, if any rank fell back, every rank uses LocalPlan().
//
//   TrainerSession session(client.get(), rank, /*coordinator=*/rank == 0, joined->first);
//   absl::StatusOr<RankStepPlan> plan = session.Plan(step, batch);   // never stalls training
//   ... run plan->micro_batches ...
//   session.Report(step, measurements, wait_seconds);               // buffered while away
//
// Coming back: the coordinator keeps the batches of the steps it ran on local plans (bounded
// like the reports) and, once the planner answers again, submits them first, marked
// planned_locally: the planner records the local plans, so the reports buffered meanwhile fit
// them and reach the latency model, and the job's steps go on in order. Steps whose batches were
// dropped from that buffer are skipped by the planner (metric sparsebalance_skipped_steps_total).
//
// Deferred samples (overflow=defer) are never dropped: the session carries the samples a step
// deferred into its next step's batch, ahead of the new ones, on every rank alike (the planner's
// plan and the local plan both name them); a batch that overflows defers its latest samples, so
// the carried ones are placed first. Pass only new samples; a carried sample that the
// trainer passes again itself is planned once (a batch plans an id once), so a trainer whose
// ids are dataset indices holds back a document drawn again while its copy is carried (a new
// epoch) for the step after, as sparsebalance.torch's Balancer does (`held`). `carried()` lists
// what still waits (e.g. after the last step).
#ifndef SPARSEBALANCE_CLIENT_TRAINER_SESSION_H_
#define SPARSEBALANCE_CLIENT_TRAINER_SESSION_H_

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/planner_client.h"
#include "planner/types.h"

namespace sparsebalance {

// The per-rank step helper. Not thread-safe: one per rank thread.
class TrainerSession {
 public:
  // `config` is the job's (JoinJob returns it); the local fallback plans with it. `client`
  // must outlive the session; a null one makes Plan, Report and Flush return INVALID_ARGUMENT.
  TrainerSession(PlannerClient* client, int rank, bool coordinator, PlannerConfig config);

  // This rank's plan for `step`: the coordinator submits `batch` (every rank passes the same
  // global batch), every rank gets its part. On every error of the planner's calls that the
  // trainer's input did not cause, the plan is computed locally and marked local_fallback: the
  // planner unreachable (UNAVAILABLE, DEADLINE_EXCEEDED) or busy (RESOURCE_EXHAUSTED), failing
  // (INTERNAL, UNKNOWN, ABORTED, CANCELLED, DATA_LOSS; INTERNAL also for a plan of another rank
  // or step), or without a plan of the step (FAILED_PRECONDITION: out of order, skipped, older
  // than its history), or at the job's bound in its state directory (IsJobStateQuota: the
  // coordinator tries once a step, resubmitting the last local step's batch, until the planner
  // has room). Errors of the trainer's input (INVALID_ARGUMENT: a bad batch;
  // ALREADY_EXISTS: another batch for a planned step; NOT_FOUND: the job; UNAUTHENTICATED,
  // PERMISSION_DENIED: the token) are returned: they would fail locally too, or must be fixed;
  // FAILED_PRECONDITION when the planner's plan names a sample that `batch` lacks or differs
  // from, or breaks the job's config (CheckRankPlan: a sample twice, a deferred sample planned or
  // not in the batch, a micro-batch count other than config.micro_batches, a micro-batch above
  // micro_batch_capacity, layer densities of another model). Every planned sample carries its
  // length and segments. The step's batch is the samples the previous step deferred followed by
  // `batch`; calling Plan again for the same step (a retry) carries the same ones.
  absl::StatusOr<RankStepPlan> Plan(int64_t step, const std::vector<Sample>& batch);
  // Plan, fetching with this rank's plan those of the other ranks of `group` (e.g. its node's;
  // `group` holds this rank, at most 1,024 distinct ranks) in one GetRankPlans call. `encoded`
  // gets every plan of `group`, in its order, as bytes for that rank's Adopt. It is left empty
  // when the plan returned is not from that call: a local fallback (fallback_reason() says
  // why), or a planner without GetRankPlans (this rank's plan then came by GetRankPlan, and
  // the others must fetch their own by Plan). INVALID_ARGUMENT when `group` lacks this rank.
  absl::StatusOr<RankStepPlan> Plan(int64_t step, const std::vector<Sample>& batch,
                                    const std::vector<int>& group,
                                    std::vector<std::string>* encoded);
  // This rank's plan of `step` as another rank fetched it (Plan's `encoded`, e.g. by its node's
  // leader), taken as Plan takes the planner's: the step's batch is what was carried in plus
  // `batch`, the plan's lengths come from it, and the step's deferred samples are carried on.
  // INVALID_ARGUMENT for bytes that are not a plan of this rank's `step`, INTERNAL for a
  // malformed plan, FAILED_PRECONDITION when it does not fit the batch or the config (as Plan).
  absl::StatusOr<RankStepPlan> Adopt(int64_t step, const std::vector<Sample>& batch,
                                     const std::string& encoded);
  // The locally computed plan of `step` (what every falling-back rank uses), with the same
  // carried samples as Plan. Remembers that this rank ran `step` locally (its report says so;
  // the coordinator resubmits the batch later).
  absl::StatusOr<RankStepPlan> LocalPlan(int64_t step, const std::vector<Sample>& batch);
  // Samples deferred by the latest planned step and not planned since: they go ahead of the
  // next step's batch.
  const std::vector<Sample>& carried() const { return carried_; }
  // A restarted trainer's state from its checkpoint: `next_step` is the step it runs next and
  // `carried` what carried() held when that step's predecessor was planned (the samples to go
  // ahead of next_step's batch). Without it, deferred documents of the step before the restart
  // would be lost.
  void Restore(int64_t next_step, std::vector<Sample> carried);
  // Why the latest Plan ran the local plan (the planner's error); OK when the plan came from the
  // planner.
  const absl::Status& fallback_reason() const { return fallback_reason_; }
  // Reports this rank's timings; while the planner is away, or refuses reports for a reason of
  // its own (IsTransient: RESOURCE_EXHAUSTED, INTERNAL, UNKNOWN, ABORTED, CANCELLED), reports
  // are kept (bounded: the oldest go first) and sent, in order, before the next report. A report
  // the planner refuses for its content (INVALID_ARGUMENT, ALREADY_EXISTS, ...) or at the job's
  // bound in its state directory (IsJobStateQuota: sent again, it would be refused again) is
  // dropped and its error returned.
  absl::Status Report(int64_t step, const std::vector<MicroBatchTiming>& micro_batches,
                      double wait_seconds);
  // Reports of other ranks too (each RankStepReport names its rank), e.g. the reports of this
  // rank's node that a node leader gathered: kept and sent like this rank's own, several at a
  // time in one ReportStepBatch call. Each report's planned_locally is set from this rank's
  // record of the steps it ran locally (every rank of a step runs the same plan).
  absl::Status Report(std::vector<RankStepReport> reports);
  // Sends what is buffered now (e.g. at the end of training): the coordinator's locally
  // planned steps, then the reports. The planner's error while it is still away or busy
  // (IsTransient; everything stays buffered); reports of steps the coordinator has not
  // resubmitted yet stay too. A refusal at the job's bound in the planner's state directory
  // (IsJobStateQuota) drops the queued batches and the refused reports, and is returned.
  absl::Status Flush();
  size_t buffered_reports() const { return pending_.size(); }
  // Batches of locally planned steps the coordinator has not told the planner about yet.
  size_t unsent_local_steps() const { return local_batches_.size(); }
  // Reports given up (the planner refused them for good, or the buffer overflowed).
  int64_t dropped_reports() const { return dropped_reports_; }

 private:
  absl::Status FlushPending();
  // Sends the pending reports (at least two) by ReportStepBatch calls, taking off those the
  // planner answered. UNAVAILABLE and the like: the planner is away (all stay). Any other
  // error (a report refused, or a planner without the call) leaves the rest to FlushPending's
  // one-by-one path, which tells each report's own error apart; the ones the batch took come
  // back there as duplicates.
  absl::Status FlushBatches();
  // Coordinator: submits the batches of locally planned steps, oldest first. The planner's
  // error when it is still away, busy or failing inside (IsTransient; that batch and the rest
  // stay queued); a batch it refuses for good is dropped.
  absl::Status ResubmitLocalSteps();
  // INVALID_ARGUMENT when the session has no client.
  absl::Status CheckClient() const;
  // The batch `step` plans: the samples carried into it, then `batch` (those not carried).
  std::vector<Sample> StepBatch(int64_t step, const std::vector<Sample>& batch);
  // The planner's `plan` of `step`, whose whole batch is `full`: its lengths filled in from it,
  // its deferred samples carried, a step the planner recorded as local remembered.
  absl::StatusOr<RankStepPlan> Take(int64_t step, const std::vector<Sample>& full,
                                    RankStepPlan plan);
  // The local plan of a step whose whole batch is `full`.
  absl::StatusOr<RankStepPlan> PlanLocally(int64_t step, const std::vector<Sample>& full);
  // After `step` was planned from `full`: its deferred samples wait for the next step.
  void Carry(int64_t step, const std::vector<Sample>& full, const std::vector<uint64_t>& ids);

  PlannerClient* client_;
  int rank_;
  bool coordinator_;
  PlannerConfig config_;
  size_t buffer_limit_;  // reports, local steps and batches kept (max_buffered_reports, >= 1)
  std::deque<RankStepReport> pending_;
  bool batches_refused_ = false;  // the planner lacks ReportStepBatch: one call per report
  bool groups_refused_ = false;   // the planner lacks GetRankPlans: GetRankPlan
  std::deque<std::pair<int64_t, std::vector<Sample>>> local_batches_;  // coordinator only
  std::deque<int64_t> local_steps_;  // steps this rank ran locally, ascending, bounded
  int64_t dropped_reports_ = 0;
  int64_t last_planner_step_ = -1;  // the latest step whose plan came from the planner
  std::vector<Sample> carried_;     // deferred by step carried_from_, for the next step
  int64_t carried_from_ = -1;
  std::vector<Sample> carried_in_;  // what step carried_in_step_ was given (for retries)
  int64_t carried_in_step_ = -1;
  absl::Status fallback_reason_;
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_CLIENT_TRAINER_SESSION_H_
