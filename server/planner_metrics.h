// sb-planner's Prometheus metrics (DESIGN.md section 8), kept in a prometheus-cpp Registry that
// main serves on its own port. Labels are bounded: job_id (at most --max_jobs; not `job`,
// which Prometheus keeps for the scrape job), method, code,
// policy; nothing per step, and per-rank series only for jobs of at most `max_rank_series`
// ranks; for jobs of any size the `slow_rank_series` slowest ranks, by position (rank and host
// labels change with the set, the old series is removed). A job's step gauges appear with its
// first fully reported step; every series of a job goes with ForgetJob. The README's metrics
// table lists every series.
//
//   auto registry = std::make_shared<prometheus::Registry>();
//   PlannerMetrics metrics(registry, /*max_rank_series=*/64);
//   metrics.ObserveRpc("SubmitBatch", absl::StatusCode::kOk, 0.004);
#ifndef SPARSEBALANCE_SERVER_PLANNER_METRICS_H_
#define SPARSEBALANCE_SERVER_PLANNER_METRICS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "planner/planner.h"
#include "planner/types.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/job_registry.h"

namespace sparsebalance {

class PlannerMetrics {
 public:
  PlannerMetrics(std::shared_ptr<prometheus::Registry> registry, int max_rank_series,
                 int slow_rank_series = 8);
  ~PlannerMetrics();

  // One RPC: its method, status code and wall time in seconds.
  void ObserveRpc(const std::string& method, absl::StatusCode code, double seconds);
  // A newly planned step: planning wall time (seconds) and the plan's predicted figures; with
  // `phases` (a step planned here, not a trainer's local plan), where the planning went.
  void ObservePlan(const std::string& job_id, const StepPlan& plan, double seconds,
                   const PlanPhaseSeconds* phases = nullptr);
  // A step recorded with the trainer's local fallback plan, after `skipped_steps` steps the
  // planner never saw.
  void ObserveLocalPlan(const std::string& job_id, int64_t skipped_steps);
  // The job's learned key/value exchange rate of context parallelism (bytes per second), set
  // with every planned step (and every fully reported one, through StepStats).
  void SetExchangeRate(const std::string& job_id, double bytes_per_second);
  // A step whose every rank has reported: what the ranks measured.
  void ObserveStep(const std::string& job_id, const StepStats& stats);
  // A write to --state_dir that failed (the call, if any, returned INTERNAL or
  // RESOURCE_EXHAUSTED with reason STATE_DIR_FAILURE).
  void ObserveStateWriteFailure();
  // Whether the last probe of --state_dir could write it (health follows it).
  void SetStateDirWritable(bool writable);
  // The bytes a job's files take in --state_dir (PlanStore::JobBytes), and the bound on them
  // (--max_job_state_mb in bytes; 0: none), for an alert before a job's writes are refused.
  void SetJobStateBytes(const std::string& job_id, int64_t bytes);
  void SetJobStateLimit(int64_t bytes);
  // A fully reported step whose reports could not be folded into the latency model.
  void ObserveUnfoldedStep();
  void SetJobs(int jobs);
  // Jobs whose state files could not be loaded (quarantined).
  void SetFailedJobs(int jobs);
  // A job created or reloaded: its counters and histograms from 0, so that the first steps
  // it records count in an increase() over them (a counter that first shows up at 5 counts as
  // no increase: the local-plan steps a restart's resubmits record never raised the alert).
  void AddJob(const std::string& job_id);
  // Drops a deleted (or expired) job's series; an observation of it made after this call (a
  // call that raced the deletion) adds none back.
  void ForgetJob(const std::string& job_id);
  // A job deleted by the idle TTL (--job_idle_ttl).
  void ObserveExpiredJob();
  // The service's capped resources, now and at their caps (set once, at start-up):
  // GetRankPlan calls parked for their step (--max_waiting_calls) and open ReportSteps streams
  // (--max_report_streams). Past a cap the next call is refused with RESOURCE_EXHAUSTED.
  void SetCallLimits(int max_waiting_calls, int max_report_streams);
  void SetWaitingCalls(int calls);
  void SetReportStreams(int streams);

 private:
  struct JobSeries;
  // The job's series, made at its first use; null for a job forgotten already.
  JobSeries* Series(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgotten jobs remembered (ids in the order forgotten, the oldest dropped past the count).
  static constexpr size_t kForgottenJobs = 4096;

  std::shared_ptr<prometheus::Registry> registry_;
  const int max_rank_series_;
  const int slow_rank_series_;
  prometheus::Family<prometheus::Counter>& rpcs_;
  prometheus::Family<prometheus::Histogram>& rpc_seconds_;
  prometheus::Family<prometheus::Histogram>& plan_seconds_;
  prometheus::Family<prometheus::Histogram>& plan_phase_seconds_;
  prometheus::Family<prometheus::Gauge>& predicted_makespan_;
  prometheus::Family<prometheus::Gauge>& predicted_gap_;
  prometheus::Family<prometheus::Counter>& steps_;
  prometheus::Family<prometheus::Gauge>& makespan_;
  prometheus::Family<prometheus::Gauge>& imbalance_;
  prometheus::Family<prometheus::Gauge>& bubble_;
  prometheus::Family<prometheus::Histogram>& prediction_error_;
  prometheus::Family<prometheus::Histogram>& density_;
  prometheus::Family<prometheus::Histogram>& recall_;
  prometheus::Family<prometheus::Gauge>& predicted_bucket_recall_;
  prometheus::Family<prometheus::Gauge>& measured_bucket_recall_;
  prometheus::Family<prometheus::Gauge>& recall_cost_;
  prometheus::Family<prometheus::Counter>& stragglers_;
  prometheus::Family<prometheus::Counter>& local_plan_steps_;
  prometheus::Family<prometheus::Counter>& skipped_steps_;
  prometheus::Family<prometheus::Gauge>& rank_seconds_;
  prometheus::Family<prometheus::Gauge>& speed_factor_;
  prometheus::Family<prometheus::Gauge>& exchange_rate_;
  prometheus::Family<prometheus::Gauge>& slowest_rank_;
  prometheus::Family<prometheus::Gauge>& job_state_bytes_;
  prometheus::Gauge& jobs_;
  prometheus::Counter& state_write_failures_;
  prometheus::Gauge& state_dir_writable_;
  prometheus::Counter& unfolded_steps_;
  prometheus::Gauge& failed_jobs_;
  prometheus::Counter& jobs_expired_;
  prometheus::Gauge& waiting_calls_;
  prometheus::Gauge& waiting_calls_limit_;
  prometheus::Gauge& report_streams_;
  prometheus::Gauge& report_streams_limit_;
  prometheus::Gauge& job_state_limit_;

  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<JobSeries>> jobs_series_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> forgotten_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> forgotten_order_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, int>, prometheus::Counter*> rpc_counters_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, prometheus::Histogram*> rpc_histograms_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, prometheus::Histogram*> plan_histograms_ ABSL_GUARDED_BY(mu_);
  std::array<prometheus::Histogram*, kPlanPhases> plan_phase_histograms_{};  // made at start
};

// The `code` label: absl::StatusCodeToString ("OK", "INVALID_ARGUMENT", ..., the names gRPC
// uses too), or "OTHER" for a value outside the canonical codes.
std::string StatusCodeLabel(absl::StatusCode code);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SERVER_PLANNER_METRICS_H_
