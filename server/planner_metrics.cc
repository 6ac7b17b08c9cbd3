#include "server/planner_metrics.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "contract/step_figures.h"

namespace sparsebalance {
namespace {

// Bucket boundaries, one place for all histograms of a kind.
const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {  // seconds
  static const auto* const kBuckets = new prometheus::Histogram::BucketBoundaries{
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
  return *kBuckets;
}
const prometheus::Histogram::BucketBoundaries& RpcBuckets() {  // seconds
  // LatencyBuckets and then up to 120 s: GetRankPlan waits up to 60 s for its step.
  static const auto* const kBuckets = [] {
    auto* buckets = new prometheus::Histogram::BucketBoundaries(LatencyBuckets());
    buckets->insert(buckets->end(), {30, 60, 120});
    return buckets;
  }();
  return *kBuckets;
}
const prometheus::Histogram::BucketBoundaries& PhaseBuckets() {  // seconds
  // A phase of a small step takes microseconds, of a 65,536-sample step tens of milliseconds.
  static const auto* const kBuckets = new prometheus::Histogram::BucketBoundaries{
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1};
  return *kBuckets;
}
const prometheus::Histogram::BucketBoundaries& UnitBuckets() {  // ratios in [0, 1]
  static const auto* const kBuckets = new prometheus::Histogram::BucketBoundaries{
      0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0};
  return *kBuckets;
}
const prometheus::Histogram::BucketBoundaries& ErrorBuckets() {  // relative errors
  static const auto* const kBuckets =
      new prometheus::Histogram::BucketBoundaries{0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0};
  return *kBuckets;
}

// The one series of an unlabelled family, e.g. Single(prometheus::BuildGauge(), ...).
template <typename Builder>
auto& Single(Builder builder, prometheus::Registry& registry, const std::string& name,
             const std::string& help) {
  return builder.Name(name).Help(help).Register(registry).Add({});
}

// A rank is a straggler when it ran this much longer than the planned makespan.
constexpr double kStragglerShare = 0.10;

}  // namespace

std::string StatusCodeLabel(absl::StatusCode code) {
  // Abseil spells the canonical codes as gRPC does ("OK", "INVALID_ARGUMENT", ...), which is
  // what dashboards and alert rules match; it has no name for a code outside the 17.
  std::string name = absl::StatusCodeToString(code);
  return name.empty() ? "OTHER" : name;
}

// A job's series, created on first use and removed with the job.
struct PlannerMetrics::JobSeries {
  // Adds the job's series with `labels` to `family` (a histogram's `buckets` too) and
  // remembers to remove it when the job is forgotten.
  template <typename T, typename... Buckets>
  T* Add(prometheus::Family<T>& family, const prometheus::Labels& labels,
         const Buckets&... buckets) {
    T* series = &family.Add(labels, buckets...);
    removals[series] = [&family, series] { family.Remove(series); };
    return series;
  }
  // Removes one series Add made, before the job is forgotten.
  template <typename T>
  void Remove(T* series) {
    auto it = removals.find(series);
    if (it == removals.end()) return;
    it->second();
    removals.erase(it);
  }
  // Drops the gauges of `by_label` whose label `keep` does not hold (a length bucket with no
  // document in the last plan or step: its old value would read as the last one's).
  template <typename Keep>
  void RemoveBucketsNotIn(std::map<std::string, prometheus::Gauge*>* by_label, Keep keep) {
    for (auto it = by_label->begin(); it != by_label->end();) {
      if (keep(it->first)) {
        ++it;
        continue;
      }
      Remove(it->second);
      it = by_label->erase(it);
    }
  }

  // Each series Add made, by its address: what ForgetJob runs to remove it.
  std::map<const void*, std::function<void()>> removals;
  prometheus::Counter* steps = nullptr;
  prometheus::Gauge* predicted_makespan = nullptr;
  prometheus::Gauge* predicted_gap = nullptr;
  prometheus::Gauge* makespan = nullptr;
  prometheus::Gauge* imbalance = nullptr;
  prometheus::Gauge* bubble = nullptr;
  prometheus::Histogram* prediction_error = nullptr;
  prometheus::Histogram* density = nullptr;
  prometheus::Histogram* recall = nullptr;
  prometheus::Counter* stragglers = nullptr;
  prometheus::Counter* local_plan_steps = nullptr;
  prometheus::Counter* skipped_steps = nullptr;
  prometheus::Gauge* state_bytes = nullptr;    // added with the first value
  prometheus::Gauge* exchange_rate = nullptr;  // added with the first rate (no 0 before it)
  std::vector<prometheus::Gauge*> rank_seconds;
  std::vector<prometheus::Gauge*> speed_factors;
  // Per length bucket label (at most kRecallBuckets each), added as buckets first show up.
  std::map<std::string, prometheus::Gauge*> predicted_bucket_recall;
  std::map<std::string, prometheus::Gauge*> measured_bucket_recall;
  prometheus::Gauge* recall_cost = nullptr;  // added with the first step that measured recall
  // The slowest ranks' series by position (1 first), replaced when the rank or host changes;
  // removed by ForgetJob (not through `removals`: a replaced one is gone already).
  struct Slow {
    int rank = -1;
    std::string host;
    prometheus::Gauge* gauge = nullptr;
  };
  std::vector<Slow> slowest;

  prometheus::Gauge* ExchangeRate(prometheus::Family<prometheus::Gauge>& family,
                                  const std::string& job_id) {
    if (exchange_rate == nullptr) exchange_rate = Add(family, {{"job_id", job_id}});
    return exchange_rate;
  }
};

PlannerMetrics::PlannerMetrics(std::shared_ptr<prometheus::Registry> registry, int max_rank_series,
                               int slow_rank_series)
    : registry_(std::move(registry)),
      max_rank_series_(max_rank_series),
      slow_rank_series_(std::max(0, slow_rank_series)),
      rpcs_(prometheus::BuildCounter()
                .Name("sparsebalance_rpcs_total")
                .Help("PlannerService calls by method and status code")
                .Register(*registry_)),
      rpc_seconds_(prometheus::BuildHistogram()
                       .Name("sparsebalance_rpc_duration_seconds")
                       .Help("Wall time of PlannerService calls (GetRankPlan includes waiting)")
                       .Register(*registry_)),
      plan_seconds_(prometheus::BuildHistogram()
                        .Name("sparsebalance_plan_duration_seconds")
                        .Help("Time to plan a step (SAB + DST) and store it, by policy")
                        .Register(*registry_)),
      plan_phase_seconds_(prometheus::BuildHistogram()
                              .Name("sparsebalance_plan_phase_duration_seconds")
                              .Help("Wall time of each phase of planning a step (validate, table, "
                                    "allocate, place, guards, tune, build), all jobs")
                              .Register(*registry_)),
      predicted_makespan_(prometheus::BuildGauge()
                              .Name("sparsebalance_predicted_makespan_seconds")
                              .Help("Planned step time (slowest rank) of the last step")
                              .Register(*registry_)),
      predicted_gap_(prometheus::BuildGauge()
                         .Name("sparsebalance_plan_gap_ratio")
                         .Help("Planned makespan over its lower bound, minus 1, last step")
                         .Register(*registry_)),
      steps_(prometheus::BuildCounter()
                 .Name("sparsebalance_planned_steps_total")
                 .Help("Steps planned")
                 .Register(*registry_)),
      makespan_(prometheus::BuildGauge()
                    .Name("sparsebalance_step_makespan_seconds")
                    .Help("Measured step time (slowest rank's compute) of the last reported step")
                    .Register(*registry_)),
      imbalance_(prometheus::BuildGauge()
                     .Name("sparsebalance_step_imbalance_ratio")
                     .Help("Max over mean measured rank compute, last reported step")
                     .Register(*registry_)),
      bubble_(prometheus::BuildGauge()
                  .Name("sparsebalance_step_bubble_ratio")
                  .Help("Idle share of ranks x step time, last reported step")
                  .Register(*registry_)),
      prediction_error_(prometheus::BuildHistogram()
                            .Name("sparsebalance_prediction_error_ratio")
                            .Help("|predicted - measured| / measured rank compute, per rank")
                            .Register(*registry_)),
      density_(prometheus::BuildHistogram()
                   .Name("sparsebalance_density_ratio")
                   .Help("Achieved attention density per micro-batch (token-weighted)")
                   .Register(*registry_)),
      recall_(prometheus::BuildHistogram()
                  .Name("sparsebalance_recall_ratio")
                  .Help("Attention recall per micro-batch (token-weighted)")
                  .Register(*registry_)),
      predicted_bucket_recall_(
          prometheus::BuildGauge()
              .Name("sparsebalance_predicted_recall_by_length_ratio")
              .Help("Last plan's predicted attention recall per document length bucket "
                    "(token-weighted, the job's learned recall model)")
              .Register(*registry_)),
      measured_bucket_recall_(
          prometheus::BuildGauge()
              .Name("sparsebalance_measured_recall_by_length_ratio")
              .Help("Attention recall the workers measured in the last fully reported step, "
                    "per document length bucket (token-weighted)")
              .Register(*registry_)),
      recall_cost_(prometheus::BuildGauge()
                       .Name("sparsebalance_recall_measurement_share_ratio")
                       .Help("Time the workers spent measuring recall in the last fully reported "
                             "step, over their attention time")
                       .Register(*registry_)),
      stragglers_(prometheus::BuildCounter()
                      .Name("sparsebalance_straggler_events_total")
                      .Help("Ranks that ran over 10% past the planned makespan")
                      .Register(*registry_)),
      local_plan_steps_(prometheus::BuildCounter()
                            .Name("sparsebalance_local_plan_steps_total")
                            .Help("Steps the trainer ran on its local fallback plan because "
                                  "the planner was unreachable")
                            .Register(*registry_)),
      skipped_steps_(prometheus::BuildCounter()
                         .Name("sparsebalance_skipped_steps_total")
                         .Help("Steps a trainer ran on local plans that the planner never "
                               "saw (their batches were not resubmitted)")
                         .Register(*registry_)),
      rank_seconds_(prometheus::BuildGauge()
                        .Name("sparsebalance_rank_compute_seconds")
                        .Help("Measured compute per rank, last reported step (small jobs only)")
                        .Register(*registry_)),
      speed_factor_(prometheus::BuildGauge()
                        .Name("sparsebalance_rank_speed_factor")
                        .Help("Learned speed factor per rank, median 1 (small jobs only)")
                        .Register(*registry_)),
      exchange_rate_(prometheus::BuildGauge()
                         .Name("sparsebalance_exchange_bytes_per_second")
                         .Help("Learned key/value exchange rate of context parallelism per "
                               "shard (the prior until workers report exchange times)")
                         .Register(*registry_)),
      slowest_rank_(prometheus::BuildGauge()
                        .Name("sparsebalance_slowest_rank_speed_factor")
                        .Help("Learned speed factor of the job's slowest ranks (position 1 is the "
                              "slowest; median rank 1), with their rank and host, after the last "
                              "fully reported step; --slow_rank_series positions")
                        .Register(*registry_)),
      job_state_bytes_(prometheus::BuildGauge()
                           .Name("sparsebalance_job_state_bytes")
                           .Help("Bytes the job's files take in --state_dir (step records, report "
                                 "logs, snapshot); writes past --max_job_state_mb are refused")
                           .Register(*registry_)),
      jobs_(Single(prometheus::BuildGauge(), *registry_, "sparsebalance_jobs",
                   "Jobs this planner holds")),
      state_write_failures_(Single(prometheus::BuildCounter(), *registry_,
                                   "sparsebalance_state_write_failures_total",
                                   "Writes to --state_dir that failed")),
      state_dir_writable_(Single(prometheus::BuildGauge(), *registry_,
                                 "sparsebalance_state_dir_writable",
                                 "1 when the last probe could write --state_dir (health "
                                 "SERVING), 0 when it could not (NOT_SERVING)")),
      unfolded_steps_(Single(prometheus::BuildCounter(), *registry_,
                             "sparsebalance_unfolded_steps_total",
                             "Fully reported steps whose reports could not be folded into "
                             "the latency model (kept; see GetJob's failure)")),
      failed_jobs_(Single(prometheus::BuildGauge(), *registry_, "sparsebalance_failed_jobs",
                          "Jobs whose state files could not be loaded, quarantined in "
                          "<state_dir>/quarantine (ListJobs shows them as FAILED)")),
      jobs_expired_(Single(prometheus::BuildCounter(), *registry_,
                           "sparsebalance_jobs_expired_total",
                           "Jobs deleted because no call carried their token for "
                           "--job_idle_ttl")),
      waiting_calls_(Single(prometheus::BuildGauge(), *registry_, "sparsebalance_waiting_calls",
                            "GetRankPlan calls parked now, waiting for their step's plan")),
      waiting_calls_limit_(Single(prometheus::BuildGauge(), *registry_,
                                  "sparsebalance_waiting_calls_limit",
                                  "Parked GetRankPlan calls the planner takes at once "
                                  "(--max_waiting_calls); one more is RESOURCE_EXHAUSTED")),
      report_streams_(Single(prometheus::BuildGauge(), *registry_, "sparsebalance_report_streams",
                             "ReportSteps streams open now")),
      report_streams_limit_(Single(prometheus::BuildGauge(), *registry_,
                                   "sparsebalance_report_streams_limit",
                                   "ReportSteps streams the planner keeps open at once "
                                   "(--max_report_streams); one more is refused (its client "
                                   "reports by ReportStep)")),
      job_state_limit_(Single(prometheus::BuildGauge(), *registry_,
                              "sparsebalance_job_state_limit_bytes",
                              "Bytes each job may keep in --state_dir (--max_job_state_mb); a "
                              "write past it is refused for that job alone. 0: no bound")) {
  state_dir_writable_.Set(1);
  for (int k = 0; k < kPlanPhases; ++k) {
    plan_phase_histograms_[k] =
        &plan_phase_seconds_.Add({{"phase", kPlanPhaseNames[k]}}, PhaseBuckets());
  }
  prometheus::BuildGauge()
      .Name("sparsebalance_build_info")
      .Help("Constant 1, labelled with the version")
      .Register(*registry_)
      .Add({{"version", "0.1.0"}})
      .Set(1);
}

PlannerMetrics::~PlannerMetrics() = default;

void PlannerMetrics::ObserveRpc(const std::string& method, absl::StatusCode code, double seconds) {
  absl::MutexLock lock(&mu_);
  prometheus::Counter*& counter = rpc_counters_[{method, static_cast<int>(code)}];
  if (counter == nullptr) {
    counter = &rpcs_.Add({{"method", method}, {"code", StatusCodeLabel(code)}});
  }
  counter->Increment();
  prometheus::Histogram*& histogram = rpc_histograms_[method];
  if (histogram == nullptr) histogram = &rpc_seconds_.Add({{"method", method}}, RpcBuckets());
  histogram->Observe(seconds);
}

PlannerMetrics::JobSeries* PlannerMetrics::Series(const std::string& job_id) {
  // A job forgotten already: an observation made after its DeleteJob (the service records a
  // call's metrics after the registry let go of the job) must not bring its series back, where
  // nothing would remove them again.
  if (forgotten_.contains(job_id)) return nullptr;
  std::unique_ptr<JobSeries>& series = jobs_series_[job_id];
  if (series == nullptr) {
    series = std::make_unique<JobSeries>();
    const prometheus::Labels job{{"job_id", job_id}};
    series->steps = series->Add(steps_, job);
    series->prediction_error = series->Add(prediction_error_, job, ErrorBuckets());
    series->density = series->Add(density_, job, UnitBuckets());
    series->recall = series->Add(recall_, job, UnitBuckets());
    series->stragglers = series->Add(stragglers_, job);
    series->local_plan_steps = series->Add(local_plan_steps_, job);
    series->skipped_steps = series->Add(skipped_steps_, job);
  }
  return series.get();
}

void PlannerMetrics::AddJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  Series(job_id);
}

void PlannerMetrics::ObservePlan(const std::string& job_id, const StepPlan& plan, double seconds,
                                 const PlanPhaseSeconds* phases) {
  if (phases != nullptr) {
    for (int k = 0; k < kPlanPhases; ++k) plan_phase_histograms_[k]->Observe((*phases)[k]);
  }
  absl::MutexLock lock(&mu_);
  const std::string policy(PolicyName(plan.policy));
  prometheus::Histogram*& histogram = plan_histograms_[policy];
  if (histogram == nullptr) {
    histogram = &plan_seconds_.Add({{"policy", policy}}, LatencyBuckets());
  }
  histogram->Observe(seconds);
  JobSeries* const found = Series(job_id);
  if (found == nullptr) return;
  JobSeries& series = *found;
  series.steps->Increment();
  if (series.predicted_makespan == nullptr) {  // no 0 before the first plan
    const prometheus::Labels job{{"job_id", job_id}};
    series.predicted_makespan = series.Add(predicted_makespan_, job);
    series.predicted_gap = series.Add(predicted_gap_, job);
  }
  series.predicted_makespan->Set(plan.makespan_seconds);
  series.predicted_gap->Set(plan.gap);
  series.RemoveBucketsNotIn(&series.predicted_bucket_recall, [&](const std::string& label) {
    return std::any_of(plan.buckets.begin(), plan.buckets.end(),
                       [&](const BucketRecallFigures& b) { return b.label == label; });
  });
  for (const BucketRecallFigures& b : plan.buckets) {
    prometheus::Gauge*& gauge = series.predicted_bucket_recall[b.label];
    if (gauge == nullptr) {
      gauge = series.Add(predicted_bucket_recall_, {{"job_id", job_id}, {"bucket", b.label}});
    }
    gauge->Set(b.predicted_recall);
  }
}

void PlannerMetrics::SetExchangeRate(const std::string& job_id, double bytes_per_second) {
  absl::MutexLock lock(&mu_);
  JobSeries* const series = Series(job_id);
  if (series != nullptr) series->ExchangeRate(exchange_rate_, job_id)->Set(bytes_per_second);
}

void PlannerMetrics::ObserveLocalPlan(const std::string& job_id, int64_t skipped_steps) {
  absl::MutexLock lock(&mu_);
  JobSeries* const series = Series(job_id);
  if (series == nullptr) return;
  series->local_plan_steps->Increment();
  if (skipped_steps > 0) series->skipped_steps->Increment(static_cast<double>(skipped_steps));
}

void PlannerMetrics::ObserveStep(const std::string& job_id, const StepStats& stats) {
  if (stats.rank_seconds.empty()) return;
  absl::MutexLock lock(&mu_);
  JobSeries* const found = Series(job_id);
  if (found == nullptr) return;
  JobSeries& series = *found;
  if (series.makespan == nullptr) {  // absent until the first step: a ratio >= 1 is never 0
    const prometheus::Labels job{{"job_id", job_id}};
    series.makespan = series.Add(makespan_, job);
    series.imbalance = series.Add(imbalance_, job);
    series.bubble = series.Add(bubble_, job);
  }
  const double slowest = *std::max_element(stats.rank_seconds.begin(), stats.rank_seconds.end());
  series.makespan->Set(slowest);
  series.imbalance->Set(ImbalanceRatio(stats.rank_seconds));
  series.bubble->Set(BubbleRatio(stats.rank_seconds));
  series.ExchangeRate(exchange_rate_, job_id)->Set(stats.exchange_bytes_per_second);
  for (size_t r = 0; r < stats.rank_seconds.size(); ++r) {
    const double measured = stats.rank_seconds[r];
    if (measured > 0) {
      series.prediction_error->Observe(std::fabs(stats.predicted_rank_seconds[r] - measured) /
                                       measured);
    }
    if (measured > stats.planned_makespan_seconds * (1.0 + kStragglerShare)) {
      series.stragglers->Increment();
    }
  }
  for (double d : stats.densities) series.density->Observe(d);
  for (double r : stats.recalls) series.recall->Observe(r);
  // A step that measured recall replaces the last one's buckets (one that measured none, as
  // when workers measure some steps only, leaves them).
  if (!stats.measured_bucket_recall.empty()) {
    series.RemoveBucketsNotIn(&series.measured_bucket_recall, [&](const std::string& label) {
      return stats.measured_bucket_recall.count(label) > 0;
    });
  }
  for (const auto& [label, recall] : stats.measured_bucket_recall) {
    prometheus::Gauge*& gauge = series.measured_bucket_recall[label];
    if (gauge == nullptr) {
      gauge = series.Add(measured_bucket_recall_, {{"job_id", job_id}, {"bucket", label}});
    }
    gauge->Set(recall);
  }
  if (stats.recall_seconds > 0 && stats.attention_seconds > 0) {
    if (series.recall_cost == nullptr) {
      series.recall_cost = series.Add(recall_cost_, {{"job_id", job_id}});
    }
    series.recall_cost->Set(stats.recall_seconds / stats.attention_seconds);
  }
  const std::vector<SlowRank> slowest_ranks =
      SlowestRanks(stats.speed_factors, stats.hosts.get(), slow_rank_series_);
  series.slowest.resize(std::max(series.slowest.size(), slowest_ranks.size()));
  for (size_t i = 0; i < series.slowest.size(); ++i) {
    JobSeries::Slow& slot = series.slowest[i];
    const SlowRank* now = i < slowest_ranks.size() ? &slowest_ranks[i] : nullptr;
    if (slot.gauge != nullptr &&
        (now == nullptr || now->rank != slot.rank || now->host != slot.host)) {
      slowest_rank_.Remove(slot.gauge);
      slot = JobSeries::Slow{};
    }
    if (now == nullptr) continue;
    if (slot.gauge == nullptr) {
      slot.rank = now->rank;
      slot.host = now->host;
      slot.gauge = &slowest_rank_.Add({{"job_id", job_id},
                                       {"position", absl::StrCat(i + 1)},
                                       {"rank", absl::StrCat(now->rank)},
                                       {"host", now->host}});
    }
    slot.gauge->Set(now->speed_factor);
  }
  const int ranks = static_cast<int>(stats.rank_seconds.size());
  if (ranks <= max_rank_series_) {
    if (series.rank_seconds.empty()) {
      for (int r = 0; r < ranks; ++r) {
        const prometheus::Labels labels{{"job_id", job_id}, {"rank", absl::StrCat(r)}};
        series.rank_seconds.push_back(series.Add(rank_seconds_, labels));
        series.speed_factors.push_back(series.Add(speed_factor_, labels));
      }
    }
    for (int r = 0; r < ranks; ++r) {
      series.rank_seconds[r]->Set(stats.rank_seconds[r]);
      if (r < static_cast<int>(stats.speed_factors.size())) {
        series.speed_factors[r]->Set(stats.speed_factors[r]);
      }
    }
  }
}

void PlannerMetrics::ObserveStateWriteFailure() { state_write_failures_.Increment(); }

void PlannerMetrics::SetStateDirWritable(bool writable) {
  state_dir_writable_.Set(writable ? 1 : 0);
}

void PlannerMetrics::ObserveUnfoldedStep() { unfolded_steps_.Increment(); }

void PlannerMetrics::SetJobStateBytes(const std::string& job_id, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  JobSeries* const series = Series(job_id);
  if (series == nullptr) return;
  if (series->state_bytes == nullptr) {
    series->state_bytes = series->Add(job_state_bytes_, {{"job_id", job_id}});
  }
  series->state_bytes->Set(static_cast<double>(bytes));
}

void PlannerMetrics::SetJobStateLimit(int64_t bytes) {
  job_state_limit_.Set(static_cast<double>(bytes));
}

void PlannerMetrics::SetJobs(int jobs) { jobs_.Set(jobs); }

void PlannerMetrics::SetFailedJobs(int jobs) { failed_jobs_.Set(jobs); }

void PlannerMetrics::ForgetJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  // Job ids are never reused; the last kForgottenJobs are remembered (Series).
  if (forgotten_.insert(job_id).second) {
    forgotten_order_.push_back(job_id);
    if (forgotten_order_.size() > kForgottenJobs) {
      forgotten_.erase(forgotten_order_.front());
      forgotten_order_.pop_front();
    }
  }
  auto it = jobs_series_.find(job_id);
  if (it == jobs_series_.end()) return;
  for (const auto& [series, remove] : it->second->removals) remove();
  for (const JobSeries::Slow& slot : it->second->slowest) {
    if (slot.gauge != nullptr) slowest_rank_.Remove(slot.gauge);
  }
  jobs_series_.erase(it);
}

void PlannerMetrics::ObserveExpiredJob() { jobs_expired_.Increment(); }

void PlannerMetrics::SetCallLimits(int max_waiting_calls, int max_report_streams) {
  waiting_calls_limit_.Set(max_waiting_calls);
  report_streams_limit_.Set(max_report_streams);
}

void PlannerMetrics::SetWaitingCalls(int calls) { waiting_calls_.Set(calls); }

void PlannerMetrics::SetReportStreams(int streams) { report_streams_.Set(streams); }

}  // namespace sparsebalance
