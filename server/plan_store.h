// sb-planner's durable state in --state_dir, one folder per job:
//
//   <state_dir>/<job_id>/job.pb             JobSnapshot: config, token, model, next step
//   <state_dir>/<job_id>/step-<n>.pb        StepRecord: the batch and the whole plan
//   <state_dir>/<job_id>/step-<n>.reports   ReportRecords, appended (length-prefixed)
//
// Snapshots and step records are written to a temporary file, fsync'ed and renamed over the
// old one (then the folder is fsync'ed), so a crash leaves the old or the new version, never a
// torn one; SubmitBatch returns only after its step record is durable. Reports are appended
// with write() before the call is acknowledged: they survive the planner process dying
// (SIGKILL, OOM); `--fsync_reports` also syncs each append, for machine crashes, at a cost per
// report; the job snapshot written after each SubmitBatch (the model with its folded steps) is
// synced under the same flag, and a step folded since is refolded from its reports on load. A torn
// last report (a crash mid-append) is dropped on load.
#ifndef SPARSEBALANCE_SERVER_PLAN_STORE_H_
#define SPARSEBALANCE_SERVER_PLAN_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "sparsebalance/state/v1/state.pb.h"

namespace sparsebalance {

class PlanStore {
 public:
  struct LoadedStep {
    state::v1::StepRecord record;
    std::vector<state::v1::ReportRecord> reports;
  };
  struct LoadedJob {
    state::v1::JobSnapshot job;
    std::vector<LoadedStep> steps;  // ascending step
  };

  // Opens (creating, mode 0700: it holds job tokens) the state directory.
  static absl::StatusOr<std::unique_ptr<PlanStore>> Open(const std::string& dir,
                                                         bool fsync_reports);

  // `sync` false: a snapshot that only adds what the step records and the appended reports
  // already hold (the one after a submit); synced like the reports (--fsync_reports),
  // atomically renamed either way.
  absl::Status SaveJob(const state::v1::JobSnapshot& job, bool sync = true);
  absl::Status SaveStep(const std::string& job_id, const state::v1::StepRecord& step);
  absl::Status AppendReport(const std::string& job_id, int64_t step,
                            const state::v1::ReportRecord& report);
  // Removes a step that left the job's history.
  absl::Status DropStep(const std::string& job_id, int64_t step);
  absl::Status DeleteJob(const std::string& job_id);
  // Every job in the directory, in job id order.
  absl::StatusOr<std::vector<LoadedJob>> LoadAll() const;

  const std::string& dir() const { return dir_; }
  ~PlanStore();

 private:
  PlanStore(std::string dir, bool fsync_reports)
      : dir_(std::move(dir)), fsync_reports_(fsync_reports) {}
  std::string JobDir(const std::string& job_id) const;
  // Closes the report logs held open for `job_id` (all steps, or only `step` when >= 0).
  void CloseReportLogs(const std::string& job_id, int64_t step) ABSL_LOCKS_EXCLUDED(logs_mu_);

  const std::string dir_;
  const bool fsync_reports_;
  // Report logs kept open between appends (an open and a close per report cost as much as the
  // rest of ReportStep): by (job, step), at most kMaxOpenReportLogs.
  static constexpr size_t kMaxOpenReportLogs = 64;
  absl::Mutex logs_mu_;
  std::map<std::pair<std::string, int64_t>, int> report_logs_ ABSL_GUARDED_BY(logs_mu_);
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SERVER_PLAN_STORE_H_
