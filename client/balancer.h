// Balancer: a trainer's whole SparseBalance flow behind one object, one per rank: creating or
// joining the job and sharing its token with the other ranks, planning each step (prefetched in
// the background while the step before trains), the one collective that agrees on local plans,
// reports sent in the background, a loud fallback while the planner is away, resume from a
// checkpoint, and the final flush; optionally a node's reports and plans through its first rank
// (gather_reports, plan_group and scatter_plans). It wraps PlannerClient and TrainerSession
// (trainer_session.h).
//
//   BalancerOptions options;  options.client.target = "planner:50151";
//   options.config = config;  options.rank = rank;  options.world = world;
//   options.any_rank = ...;  options.share_job = ...;   // collectives; defaults serve world == 1
//   absl::StatusOr<std::unique_ptr<Balancer>> balancer = Balancer::Start(std::move(options));
//   for (int64_t step = (*balancer)->next_step(); step < steps; ++step) {
//     (*balancer)->Prefetch(step + 1, BatchOf(step + 1));         // planned while step trains
//     absl::StatusOr<RankStepPlan> plan = (*balancer)->Plan(step, BatchOf(step));
//     ... run plan->micro_batches, time them ...
//     (*balancer)->Report(step, timings, wait_seconds);
//   }
//   absl::Status flushed = (*balancer)->Finish();
#ifndef SPARSEBALANCE_CLIENT_BALANCER_H_
#define SPARSEBALANCE_CLIENT_BALANCER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/planner_client.h"
#include "planner/types.h"

namespace sparsebalance {

struct BalancerOptions {
  ClientOptions client;  // target and timeouts; job_id/token are filled by Start
  int rank = 0;
  int world = 1;
  // Resume/join this job (its token in client.token); empty: rank 0 creates one from `config`
  // (with client.admin_token).
  std::string job_id;
  std::string job_name = "sparsebalance";
  PlannerConfig config;  // the new job's config; also the local fallback's config when offline
  // Planner unreachable at Start: an UNAVAILABLE error naming the target and the reason, unless
  // true (then every step runs on the local plan, with a warning).
  bool allow_offline_start = false;
  bool prefetch = true;  // plan step N+1 in the background while step N trains (see Prefetch)
  // Whether the trainer runs shards of split documents (PlannedSample::sharded, context
  // parallelism: sb-worker does). False for one that runs every document whole
  // (sparsebalance.torch): there a shard, which plans hold once the job's max_shards is raised
  // above 1 by UpdateJobConfig, would train its whole document on each rank of its group with
  // the wrong loss weight. Plan then refuses such a step on every rank.
  bool runs_shards = true;
  double warn_interval_seconds = 60;  // at most one fallback warning per this many seconds
  // Collectives over the trainer's ranks (torch.distributed in Python), called from the thread
  // that calls Start and Plan, never with a lock held; they may throw (the step is then not
  // final). The defaults serve world == 1; world > 1 needs both.
  std::function<bool(bool)> any_rank;                    // true when any rank passed true
  std::function<JobHandle(const JobHandle&)> share_job;  // rank 0's handle to every rank (empty
                                                         // job_id: offline)
  // Reports through a group leader (optional; usually a node's ranks, the leader its first): a
  // collective over the group, called by each member from the thread that calls Report (or
  // SkipReport), with its report encoded (opaque bytes, never empty). It returns to the leader
  // every member's encoded report, its own included, and to the others an empty vector. The leader
  // then sends its group's reports of a step in one ReportStepBatch call, on which the planner
  // spends a fraction of a ReportStep's CPU per report (README, Service load); the others send
  // none. A leader's buffer (client.max_buffered_reports) counts every rank's reports. It may throw
  // (the report is then lost). Unset: each rank sends its own reports.
  std::function<std::vector<std::string>(const std::string&)> gather_reports;
  // Plans through a group leader (optional; usually a node's ranks, the same groups as
  // gather_reports'): plan_group is this rank's group, its leader first (at most 1,024 ranks),
  // and scatter_plans a collective over it, called by each member from the thread that calls
  // Plan: the leader passes one payload per member in plan_group's order, the others an empty
  // vector, and each member gets back its own. The leader fetches its group's plans of a step in
  // one GetRankPlans call (prefetched as its own plan is) and hands each member its plan; the
  // others make no plan calls and do not prefetch. At 4,096 ranks in nodes of 8 this takes the
  // planner's CPU a step from 0.29 to 0.17 s with gather_reports (README, Service load). Rank 0,
  // which submits each step's batch, must lead its group. It may throw (the step is then not
  // final). Unset: each rank fetches its own plan.
  std::vector<int> plan_group;
  std::function<std::string(const std::vector<std::string>&)> scatter_plans;
  std::function<void(const std::string&)> warn;  // default: one line on stderr
  // The clock of warn_interval_seconds (seconds, any origin); default: a steady clock.
  std::function<double()> now_seconds;
};

// One rank's step loop. Every rank calls Plan for every step, in order, with the same global
// batch. Thread-safe, but meant for one training thread: a background thread plans prefetched
// steps and sends reports; the two share the TrainerSession under a mutex.
class Balancer {
 public:
  // Rank 0 with an empty job_id creates the job; a given job_id is joined (resume). share_job
  // then gives every rank the handle, and every rank joins (JoinJob: config and next_step);
  // the ranks start at the least of their next steps, found with any_rank (one call for a new
  // job, about 2 log2(step) + 1 for a joined one).
  // Every rank makes the same calls to share_job and any_rank, whatever fails: an error on one
  // rank is an error on all (the others say so and point to it). The planner unreachable is
  // UNAVAILABLE naming the target and the reason unless allow_offline_start; other errors are
  // returned as they are.
  static absl::StatusOr<std::unique_ptr<Balancer>> Start(BalancerOptions options);
  ~Balancer();  // stops the background thread (waits for its current call; no flush)
  Balancer(const Balancer&) = delete;
  Balancer& operator=(const Balancer&) = delete;

  // Plans `step` in the background once the step before is final (its Plan returned), with
  // what that step deferred carried in. `batch` must be what Plan(step, ...) will get; ignored
  // when options.prefetch is false, and on a plan group's members (their leader prefetches
  // their plans with its own). A later Prefetch of the same step replaces one not started.
  void Prefetch(int64_t step, std::vector<Sample> batch);
  // This rank's plan of `step`: the prefetched one (waits for it) or planned now; with
  // scatter_plans, a member's is the one its group's leader hands over (scatter_plans), and the
  // leader hands them over here. Then one collective, any_rank(fell back or failed): if any
  // rank fell back, every rank runs the local plan (TrainerSession::LocalPlan). Only then the
  // step is final and a prefetch of step + 1 starts. Errors as TrainerSession::Plan's (the
  // planner away, busy or failing is a fallback, not an error); INVALID_ARGUMENT when `batch` is
  // not the one Prefetch(step) planned. A leader's error is its members' too, with its code and
  // a message that names the leader; a leader that fell back has its members plan locally with
  // it. A rank's error is every rank's: when the first collective says a rank fell back or
  // failed, a second any_rank(failed) follows on every rank, and the ranks that did not fail
  // return ABORTED pointing to the one that did (no rank runs the step). Without
  // options.runs_shards, a planner's plan holding a shard is such an error of its rank:
  // FAILED_PRECONDITION naming the step and the sample.
  absl::StatusOr<RankStepPlan> Plan(int64_t step, const std::vector<Sample>& batch);
  // Queues this rank's timings of `step`; the background thread sends them in order (kept while
  // the planner is away, bounded by client.max_buffered_reports). Offline: not kept.
  void Report(int64_t step, std::vector<MicroBatchTiming> timings, double wait_seconds);
  // With options.gather_reports: takes part in the group's gather of `step` without a report
  // (a step this rank does not report), so that the other members' reports still go. Without
  // it, nothing.
  void SkipReport(int64_t step);
  // Sends everything queued (reports, and on rank 0 the batches of steps run on local plans),
  // retrying for up to `timeout_seconds`. UNAVAILABLE naming what is left (reports, local steps)
  // when the planner is still away or busy or, on ranks > 0, rank 0 has not resubmitted its
  // local steps yet; another error when the planner refused a report for good (it is dropped).
  // OK offline.
  absl::Status Finish(double timeout_seconds = 10);
  // From a checkpoint: the step the trainer runs next and the samples carried into it (what
  // carried() returned when the checkpoint was taken). Drops prefetches made before it.
  void Resume(int64_t next_step, std::vector<Sample> carried);

  const JobHandle& job() const;         // job id and token ("" when offline)
  const PlannerConfig& config() const;  // the job's config (from JoinJob) or options.config
  // The step to run next: at Start the least over the ranks of the step JoinJob says each
  // resumes at (the first it has not reported; 0 for a new job), the same on every rank, then
  // Resume's next_step or the latest planned step + 1. A step run again that this rank had
  // reported before it joined is not reported again (Report skips it).
  // With carried(), what a checkpoint saves.
  int64_t next_step() const;
  // The samples the latest final step deferred: they go ahead of the next step's batch. Save
  // them in a checkpoint with the next step (a prefetched step does not change them).
  std::vector<Sample> carried() const;

  struct Stats {
    int64_t planned_steps = 0;  // steps whose plan Plan returned
    int64_t local_steps = 0;    // of them, run on the local plan
    // Of them, planned in the background by Prefetch: on a plan group's member, by its
    // leader's (the plan it handed over was fetched while the step before trained).
    int64_t prefetched_steps = 0;
    double plan_wait_seconds = 0;  // total time Plan() blocked waiting for a plan (seconds)
    double last_plan_wait_seconds = 0;
    int64_t buffered_reports = 0;  // queued or kept while the planner is away
    int64_t dropped_reports = 0;   // given up (refused for good, or the buffer overflowed)
    bool planner_reachable = true;
    std::string last_error;  // why the latest step fell back
  };
  Stats stats() const;

 private:
  struct State;
  explicit Balancer(std::unique_ptr<State> state);
  // The background thread: prefetches and reports, until stopped.
  void Work();

  std::unique_ptr<State> state_;
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_CLIENT_BALANCER_H_
