#include "server/planner_metrics.h"

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace sparsebalance {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string Exposition(prometheus::Registry& registry) {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, registry.Collect());
  return out.str();
}

StepStats Stats(int ranks) {
  StepStats s;
  s.planned_makespan_seconds = 10.0;
  for (int r = 0; r < ranks; ++r) {
    s.rank_seconds.push_back(r == 0 ? 12.0 : 8.0);  // rank 0 runs 20% over the plan
    s.predicted_rank_seconds.push_back(10.0);
    s.wait_seconds.push_back(r == 0 ? 0.0 : 4.0);
    s.densities.push_back(0.3);
    s.recalls.push_back(0.9);
    s.speed_factors.push_back(r == 0 ? 1.2 : 1.0);
  }
  return s;
}

// Every one of `series` (a line of the exposition, or its start) is in `text`.
void ExpectExposed(const std::string& text, const std::vector<std::string>& series) {
  for (const std::string& line : series) EXPECT_THAT(text, HasSubstr(line));
}

TEST(PlannerMetricsTest, StepFiguresFollowWhatTheRanksMeasured) {
  auto registry = std::make_shared<prometheus::Registry>();
  PlannerMetrics metrics(registry, /*max_rank_series=*/4);
  metrics.ObserveStep("small", Stats(4));
  // mean = (12 + 3*8)/4 = 9: imbalance 12/9, bubble 1 - 9/12.
  ExpectExposed(Exposition(*registry),
                {"sparsebalance_step_makespan_seconds{job_id=\"small\"} 12",
                 "sparsebalance_step_imbalance_ratio{job_id=\"small\"} 1.333333",
                 "sparsebalance_step_bubble_ratio{job_id=\"small\"} 0.25",
                 "sparsebalance_straggler_events_total{job_id=\"small\"} 1",
                 "sparsebalance_recall_ratio_count{job_id=\"small\"} 4",
                 "sparsebalance_rank_speed_factor{job_id=\"small\",rank=\"0\"} 1.2",
                 "sparsebalance_build_info{version=\"0.1.0\"} 1"});
}

TEST(PlannerMetricsTest, RecallIsExportedPerLengthBucketAndGoesWithTheJob) {
  auto registry = std::make_shared<prometheus::Registry>();
  PlannerMetrics metrics(registry, /*max_rank_series=*/4);
  StepStats stats = Stats(2);
  stats.measured_bucket_recall = {{"<2K", 0.97}, {"32K+", 0.61}};
  stats.recall_seconds = 0.5;
  stats.attention_seconds = 20.0;
  metrics.ObserveStep("j", stats);
  StepPlan plan;
  BucketRecallFigures long_documents;
  long_documents.label = "32K+";
  long_documents.predicted_recall = 0.64;
  plan.buckets.push_back(long_documents);
  metrics.ObservePlan("j", plan, 0.001);
  std::string text = Exposition(*registry);
  ExpectExposed(
      text, {"sparsebalance_measured_recall_by_length_ratio{bucket=\"32K+\",job_id=\"j\"} 0.61",
             "sparsebalance_measured_recall_by_length_ratio{bucket=\"<2K\",job_id=\"j\"} 0.97",
             "sparsebalance_predicted_recall_by_length_ratio{bucket=\"32K+\",job_id=\"j\"} 0.64",
             "sparsebalance_recall_measurement_share_ratio{job_id=\"j\"} 0.025"});
  metrics.ForgetJob("j");
  EXPECT_THAT(Exposition(*registry), Not(HasSubstr("job_id=\"j\"")));
}

// The learned exchange rate is exported for every job the planner planned for, sharded or not
// (the prior until workers report exchanges), and goes with the job.
TEST(PlannerMetricsTest, TheExchangeRateFollowsThePlansAndTheFoldedSteps) {
  auto registry = std::make_shared<prometheus::Registry>();
  PlannerMetrics metrics(registry, /*max_rank_series=*/4);
  metrics.ObservePlan("j", StepPlan{}, 0.001);
  metrics.SetExchangeRate("j", 25e9);
  EXPECT_THAT(Exposition(*registry),
              HasSubstr("sparsebalance_exchange_bytes_per_second{job_id=\"j\"} 25000000000"));
  StepStats stats = Stats(2);
  stats.exchange_bytes_per_second = 7.5e9;
  metrics.ObserveStep("j", stats);
  EXPECT_THAT(Exposition(*registry),
              HasSubstr("sparsebalance_exchange_bytes_per_second{job_id=\"j\"} 7500000000"));
  metrics.ForgetJob("j");
  EXPECT_THAT(Exposition(*registry), Not(HasSubstr("exchange_bytes_per_second{")));
}

TEST(PlannerMetricsTest, LargeJobsExportNoPerRankSeriesAndDeletedJobsNone) {
  auto registry = std::make_shared<prometheus::Registry>();
  PlannerMetrics metrics(registry, /*max_rank_series=*/4);
  metrics.ObserveStep("large", Stats(16));
  metrics.ObserveStep("small", Stats(2));
  std::string text = Exposition(*registry);
  EXPECT_THAT(text, Not(HasSubstr("rank_compute_seconds{job_id=\"large\"")));
  EXPECT_THAT(text, HasSubstr("sparsebalance_rank_compute_seconds{job_id=\"small\",rank=\"1\"} 8"));
  metrics.ForgetJob("small");
  text = Exposition(*registry);
  EXPECT_THAT(text, Not(HasSubstr("job_id=\"small\"")));
  EXPECT_THAT(text, HasSubstr("job_id=\"large\""));
}

TEST(PlannerMetricsTest, RpcsAndPlansAreCountedByBoundedLabels) {
  auto registry = std::make_shared<prometheus::Registry>();
  PlannerMetrics metrics(registry, 4);
  metrics.ObserveRpc("SubmitBatch", absl::StatusCode::kOk, 0.002);
  metrics.ObserveRpc("SubmitBatch", absl::StatusCode::kOk, 0.004);
  metrics.ObserveRpc("SubmitBatch", absl::StatusCode::kAlreadyExists, 0.001);
  StepPlan plan;
  plan.policy = Policy::kSab;
  plan.makespan_seconds = 5.0;
  plan.gap = 0.01;
  metrics.ObservePlan("j", plan, 0.003);
  metrics.ObserveStateWriteFailure();
  metrics.SetJobs(3);
  ExpectExposed(Exposition(*registry),
                {"sparsebalance_rpcs_total{code=\"OK\",method=\"SubmitBatch\"} 2",
                 "sparsebalance_rpcs_total{code=\"ALREADY_EXISTS\",method=\"SubmitBatch\"} 1",
                 "sparsebalance_rpc_duration_seconds_count{method=\"SubmitBatch\"} 3",
                 "sparsebalance_plan_duration_seconds_count{policy=\"sab\"} 1",
                 "sparsebalance_predicted_makespan_seconds{job_id=\"j\"} 5",
                 "sparsebalance_planned_steps_total{job_id=\"j\"} 1",
                 "sparsebalance_state_write_failures_total 1", "sparsebalance_jobs 3"});
}

// Planning's phases: one histogram series per phase from the start, one observation per plan
// made here, none for a trainer's local plan (ObservePlan without phases).
TEST(PlannerMetricsTest, PlanPhasesAreObservedPerPhaseForPlansMadeHere) {
  auto registry = std::make_shared<prometheus::Registry>();
  PlannerMetrics metrics(registry, 4);
  std::string text = Exposition(*registry);
  for (const char* phase : kPlanPhaseNames) {
    EXPECT_THAT(text,
                HasSubstr(absl::StrCat("sparsebalance_plan_phase_duration_seconds_count{phase=\"",
                                       phase, "\"} 0")));
  }
  PlanPhaseSeconds phases{};
  phases[3] = 0.03;  // place
  phases[5] = 0.2;   // tune
  metrics.ObservePlan("j", StepPlan{}, 0.3, &phases);
  metrics.ObservePlan("j", StepPlan{}, 0.3);  // a local plan
  ExpectExposed(Exposition(*registry),
                {"sparsebalance_plan_phase_duration_seconds_count{phase=\"place\"} 1",
                 "sparsebalance_plan_phase_duration_seconds_sum{phase=\"place\"} 0.03",
                 "sparsebalance_plan_phase_duration_seconds_bucket{phase=\"place\",le=\"0.025\"} 0",
                 "sparsebalance_plan_phase_duration_seconds_bucket{phase=\"place\",le=\"0.05\"} 1",
                 "sparsebalance_plan_phase_duration_seconds_sum{phase=\"tune\"} 0.2",
                 "sparsebalance_plan_phase_duration_seconds_count{phase=\"validate\"} 1",
                 "sparsebalance_plan_duration_seconds_count{policy=\"sparsebalance\"} 2"});
}

TEST(PlannerMetricsTest, CodeLabelsAreTheNamesDashboardsAndAlertsMatch) {
  // deploy/prometheus rules and the Grafana dashboards select on these spellings.
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kOk), "OK");
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kInvalidArgument), "INVALID_ARGUMENT");
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kResourceExhausted), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kUnavailable), "UNAVAILABLE");
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kUnauthenticated), "UNAUTHENTICATED");
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kDataLoss), "DATA_LOSS");
  EXPECT_EQ(StatusCodeLabel(static_cast<absl::StatusCode>(99)), "OTHER");
}

TEST(PlannerMetricsTest, StepGaugesAreAbsentUntilTheJobsFirstStep) {
  auto registry = std::make_shared<prometheus::Registry>();
  PlannerMetrics metrics(registry, 4);
  metrics.SetExchangeRate("j", 1e9);  // the job's series exist from here on
  std::string text = Exposition(*registry);
  EXPECT_THAT(text, HasSubstr("sparsebalance_exchange_bytes_per_second{job_id=\"j\"}"));
  for (const char* gauge : {"step_imbalance_ratio", "step_bubble_ratio", "step_makespan_seconds",
                            "predicted_makespan_seconds", "plan_gap_ratio"}) {
    EXPECT_THAT(text, Not(HasSubstr(absl::StrCat("sparsebalance_", gauge, "{job_id=\"j\"}"))))
        << gauge;
  }
  StepPlan plan;
  plan.makespan_seconds = 5.0;
  plan.gap = 0.02;
  metrics.ObservePlan("j", plan, 0.001);
  text = Exposition(*registry);
  EXPECT_THAT(text, HasSubstr("sparsebalance_plan_gap_ratio{job_id=\"j\"} 0.02"));
  EXPECT_THAT(text, Not(HasSubstr("sparsebalance_step_imbalance_ratio{job_id=\"j\"}")));
  metrics.ObserveStep("j", Stats(4));
  EXPECT_THAT(Exposition(*registry),
              HasSubstr("sparsebalance_step_imbalance_ratio{job_id=\"j\"} 1.333333"));
}

// A job's counters start at 0 when it is created or reloaded (AddJob): a counter that first
// shows up at 5 is no increase to Prometheus, so the local-plan steps that a restart's resubmits
// record at once never raised SparseBalanceLocalPlanFallback. Its gauges stay absent until
// they have a value.
TEST(PlannerMetricsTest, AJobsCountersStartAtZeroAndItsGaugesAbsent) {
  auto registry = std::make_shared<prometheus::Registry>();
  PlannerMetrics metrics(registry, 4);
  metrics.AddJob("j");
  std::string text = Exposition(*registry);
  ExpectExposed(text, {"sparsebalance_local_plan_steps_total{job_id=\"j\"} 0",
                       "sparsebalance_skipped_steps_total{job_id=\"j\"} 0",
                       "sparsebalance_planned_steps_total{job_id=\"j\"} 0"});
  for (const char* gauge :
       {"exchange_bytes_per_second", "step_makespan_seconds", "predicted_makespan_seconds"}) {
    EXPECT_THAT(text, Not(HasSubstr(absl::StrCat("sparsebalance_", gauge, "{job_id=\"j\"}"))))
        << gauge;
  }
  metrics.ObserveLocalPlan("j", /*skipped_steps=*/2);
  text = Exposition(*registry);
  ExpectExposed(text, {"sparsebalance_local_plan_steps_total{job_id=\"j\"} 1",
                       "sparsebalance_skipped_steps_total{job_id=\"j\"} 2"});
}

// An observation of a job made after ForgetJob (a call that raced DeleteJob: the service records
// its metrics after the registry let go of the job) adds none of its series back.
TEST(PlannerMetricsTest, AForgottenJobsSeriesDoNotComeBack) {
  auto registry = std::make_shared<prometheus::Registry>();
  PlannerMetrics metrics(registry, 4);
  metrics.AddJob("gone");
  metrics.AddJob("kept");
  metrics.ForgetJob("gone");
  StepPlan plan;
  plan.makespan_seconds = 5.0;
  metrics.ObservePlan("gone", plan, 0.001);
  metrics.SetExchangeRate("gone", 1e9);
  metrics.ObserveLocalPlan("gone", 1);
  metrics.ObserveStep("gone", Stats(4));
  metrics.ObservePlan("kept", plan, 0.001);
  const std::string text = Exposition(*registry);
  EXPECT_THAT(text, Not(HasSubstr("job_id=\"gone\""))) << text;
  EXPECT_THAT(text, HasSubstr("sparsebalance_planned_steps_total{job_id=\"kept\"} 1"));
}

// A job's bytes in --state_dir: a gauge from its first value on, following every change, gone
// with the job and not brought back by a write that raced its deletion; the bound beside it.
TEST(PlannerMetricsTest, AJobsStateBytesFollowItsWritesAndGoWithTheJob) {
  auto registry = std::make_shared<prometheus::Registry>();
  PlannerMetrics metrics(registry, 4);
  metrics.AddJob("j");
  metrics.AddJob("other");
  EXPECT_THAT(Exposition(*registry), Not(HasSubstr("sparsebalance_job_state_bytes{")));
  metrics.SetJobStateLimit(int64_t{8} << 30);
  metrics.SetJobStateBytes("j", 5000);
  metrics.SetJobStateBytes("j", 4200);  // a step dropped from its history
  metrics.SetJobStateBytes("other", 700);
  ExpectExposed(Exposition(*registry), {"sparsebalance_job_state_bytes{job_id=\"j\"} 4200",
                                        "sparsebalance_job_state_bytes{job_id=\"other\"} 700",
                                        "sparsebalance_job_state_limit_bytes 8589934592"});
  metrics.ForgetJob("j");
  metrics.SetJobStateBytes("j", 100);
  const std::string text = Exposition(*registry);
  EXPECT_THAT(text, Not(HasSubstr("job_id=\"j\""))) << text;
  EXPECT_THAT(text, HasSubstr("sparsebalance_job_state_bytes{job_id=\"other\"} 700"));
}

// The recall of a length bucket is the last plan's (or the last measured step's): a bucket
// with no document there has no series, rather than an older step's value read as the last.
TEST(PlannerMetricsTest, ABucketAbsentFromTheLastPlanOrStepHasNoRecallSeries) {
  auto registry = std::make_shared<prometheus::Registry>();
  PlannerMetrics metrics(registry, 4);
  StepPlan plan;
  plan.buckets.push_back({0, "<2K", 1, 2047, 100, 0.9, 0.9});
  plan.buckets.push_back({3, "32K+", 32768, 131072, 100, 0.7, 0.8});
  metrics.ObservePlan("j", plan, 0.001);
  const std::string predicted = "sparsebalance_predicted_recall_by_length_ratio{bucket=\"32K+\"";
  EXPECT_THAT(Exposition(*registry), HasSubstr(predicted));
  plan.buckets.pop_back();
  metrics.ObservePlan("j", plan, 0.001);
  std::string text = Exposition(*registry);
  EXPECT_THAT(text, Not(HasSubstr(predicted)));
  EXPECT_THAT(text, HasSubstr("sparsebalance_predicted_recall_by_length_ratio{bucket=\"<2K\""));

  StepStats stats = Stats(2);
  stats.measured_bucket_recall = {{"<2K", 0.97}, {"32K+", 0.61}};
  metrics.ObserveStep("j", stats);
  const std::string measured = "sparsebalance_measured_recall_by_length_ratio{bucket=\"32K+\"";
  EXPECT_THAT(Exposition(*registry), HasSubstr(measured));
  stats.measured_bucket_recall = {{"<2K", 0.95}};
  metrics.ObserveStep("j", stats);
  EXPECT_THAT(Exposition(*registry), Not(HasSubstr(measured)));
  stats.measured_bucket_recall.clear();  // a step that measured nothing leaves the last one's
  metrics.ObserveStep("j", stats);
  EXPECT_THAT(
      Exposition(*registry),
      HasSubstr("sparsebalance_measured_recall_by_length_ratio{bucket=\"<2K\",job_id=\"j\"} 0.95"));
  metrics.ForgetJob("j");
  EXPECT_THAT(Exposition(*registry), Not(HasSubstr("job_id=\"j\"")));
}

TEST(PlannerMetricsTest, RpcLatencyBucketsCoverTheLongPoll) {
  auto registry = std::make_shared<prometheus::Registry>();
  PlannerMetrics metrics(registry, 4);
  metrics.ObserveRpc("GetRankPlan", absl::StatusCode::kOk, 59.0);  // waited for its step
  metrics.ObserveRpc("GetRankPlan", absl::StatusCode::kOk, 0.003);
  ExpectExposed(Exposition(*registry),
                {"sparsebalance_rpc_duration_seconds_bucket{method=\"GetRankPlan\",le=\"30\"} 1",
                 "sparsebalance_rpc_duration_seconds_bucket{method=\"GetRankPlan\",le=\"60\"} 2",
                 "sparsebalance_rpc_duration_seconds_bucket{method=\"GetRankPlan\",le=\"120\"} 2"});
}

TEST(PlannerMetricsTest, SlowestRanksFollowTheSetWithBoundedLabelsAndGoWithTheJob) {
  auto registry = std::make_shared<prometheus::Registry>();
  PlannerMetrics metrics(registry, /*max_rank_series=*/4, /*slow_rank_series=*/2);
  StepStats stats = Stats(1000);  // far above max_rank_series: the slow ranks still show
  stats.speed_factors.assign(1000, 1.0);
  stats.speed_factors[700] = 1.8;
  stats.speed_factors[3] = 1.5;
  stats.speed_factors[9] = 1.2;
  auto hosts = std::make_shared<std::vector<std::string>>(1000);
  (*hosts)[700] = "node-7";
  (*hosts)[3] = "node-0";
  stats.hosts = hosts;
  metrics.ObserveStep("big", stats);
  std::string text = Exposition(*registry);
  ExpectExposed(text, {"sparsebalance_slowest_rank_speed_factor{host=\"node-7\",job_id=\"big\","
                       "position=\"1\",rank=\"700\"} 1.8",
                       "sparsebalance_slowest_rank_speed_factor{host=\"node-0\",job_id=\"big\","
                       "position=\"2\",rank=\"3\"} 1.5"});
  EXPECT_THAT(text, Not(HasSubstr("rank=\"9\"")));
  EXPECT_THAT(text, Not(HasSubstr("sparsebalance_rank_speed_factor{job_id=\"big\"")));
  // Rank 3 recovers: position 2 is rank 9 now, and rank 3's series is gone (not left stale).
  stats.speed_factors[3] = 1.0;
  metrics.ObserveStep("big", stats);
  text = Exposition(*registry);
  EXPECT_THAT(text, HasSubstr("position=\"2\",rank=\"9\"} 1.2"));
  EXPECT_THAT(text, Not(HasSubstr("rank=\"3\"")));
  EXPECT_THAT(text, HasSubstr("position=\"1\",rank=\"700\"} 1.8"));
  metrics.ForgetJob("big");
  EXPECT_THAT(Exposition(*registry), Not(HasSubstr("job_id=\"big\"")));
}

}  // namespace
}  // namespace sparsebalance
