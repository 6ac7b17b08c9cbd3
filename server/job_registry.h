// Every job's state and the logic of every PlannerService call, without the network: the gRPC
// adapters (server/) only translate requests to these methods and statuses back. Unit-tested
// directly. Thread-safe: a registry lock for the job table and one lock per job.
//
//   JobRegistry registry(JobRegistry::Options{}, RandomHex);
//   absl::StatusOr<CreatedJob> job = registry.CreateJob("demo", settings, /*profile=*/"");
//   absl::StatusOr<SubmitResult> r = registry.SubmitBatch(job->job_id, 0, batch);
//
// Semantics (DESIGN.md section 6): steps are planned in order from 0; repeating the same batch
// for a planned step returns the stored answer, a different one is ALREADY_EXISTS; a report
// for a (step, rank) is accepted once and repeats are harmless; a step's reports are folded
// into the latency model, in rank order, when the last rank has reported, so every replica and
// every rank's local fallback learn the same model. Plans and reports of the last
// `history_steps` steps are kept; older ones are dropped.
//
// Robustness (README "Reliability"): every call validates all of its input before it changes
// anything; a step whose reports cannot be folded into the model is kept and counted, never
// an error for anyone; a deleted job is marked under its lock before its files go, so no
// writer can bring it back; on Restore a job whose files are invalid is quarantined and listed
// as failed while every other job is served; a store failure (disk full, read-only) carries
// the reason kReasonStateDirFailure and is reported through Options::on_store_failure. A store
// failure leaves nothing of the refused write on disk (a change the store made but cannot make
// durable ends the process instead: plan_store.h), so a call that keeps its old state in memory
// on one serves what a restart loads. A step is folded into the model once across restarts: the
// snapshot's first_kept_step marks the steps that left the history (plan_store.h).
//
// Per-job bound on the state directory (the store's max_job_bytes, plan_store.h): a new step
// or report that would take the job's files past it is RESOURCE_EXHAUSTED with the reason
// kReasonJobStateQuota, for that job alone and never a store failure (health stays SERVING).
// Nothing of the call is kept; everything acknowledged before stays, on disk and in memory. The
// job can still join ranks, fetch the plans it has, repeat a submitted batch, report what fits
// and change its config; a SubmitBatch is refused before it is planned once the job is at its
// bound. Room comes back when the history is trimmed (UpdateJobConfig with a smaller
// history_steps drops the oldest steps at once) or the job is deleted.
#ifndef SPARSEBALANCE_SERVER_JOB_REGISTRY_H_
#define SPARSEBALANCE_SERVER_JOB_REGISTRY_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "planner/latency_model.h"
#include "planner/planner.h"
#include "planner/types.h"
#include "proto/wire.h"
#include "server/job_state.h"
#include "server/plan_store.h"
#include "server/step_pack.h"
#include "server/step_reports.h"

namespace sparsebalance {

// What the ranks measured in a step whose every rank has reported (for metrics).
struct StepStats {
  int64_t step = 0;
  Policy policy = Policy::kSparseBalance;
  std::vector<double> rank_seconds;            // measured compute per rank
  std::vector<double> predicted_rank_seconds;  // what the plan predicted per rank
  std::vector<double> wait_seconds;            // reported idle time per rank
  std::vector<double> densities;               // achieved, per micro-batch
  std::vector<double> recalls;                 // per micro-batch
  std::vector<double> speed_factors;           // the model's, after folding the step
  double exchange_bytes_per_second = 0.0;      // the model's learned rate, after the step
  double planned_makespan_seconds = 0.0;
  // Measured document recall, token-weighted, per length bucket label (recall_model.h) of the
  // documents whose recall was reported; empty when none was.
  std::map<std::string, double> measured_bucket_recall;
  double recall_seconds = 0.0;     // spent measuring recall, summed over the step's reports
  double attention_seconds = 0.0;  // attention time, summed over the step's reports
  // Host name per rank, as JoinJob gave it ("" unknown); shared with the job, never null.
  std::shared_ptr<const std::vector<std::string>> hosts;
};

// A rank the latency model finds slow (SlowestRanks).
struct SlowRank {
  int rank = 0;
  std::string host;           // "" when the rank sent none
  double speed_factor = 0.0;  // learned, median rank 1; larger is slower
};

// The `k` ranks with the largest speed factors, slowest first (ties: lower rank first), with
// their host names (`hosts` may be shorter or null: "" then). O(ranks log k).
std::vector<SlowRank> SlowestRanks(const std::vector<double>& speed_factors,
                                   const std::vector<std::string>* hosts, int k);

struct CreatedJob {
  std::string job_id;
  std::string job_token;
  JobSettings settings;
};

struct SubmitResult {
  int64_t step = 0;
  std::vector<uint64_t> deferred_ids;
  // The whole step's plan: the one the registry keeps (shared, never copied per submit).
  std::shared_ptr<const StepPlan> plan;
  bool repeated = false;  // the step had been planned with this batch before
  // planned_locally submissions: steps jumped over (never planned here), and whether an
  // existing plan of the step was replaced by the trainer's local one.
  int64_t skipped_steps = 0;
  bool switched_to_local = false;
  // The job's learned key/value exchange rate (bytes per second) when the step was answered.
  double exchange_bytes_per_second = 0.0;
  // Where the planning's wall time went (PlanStep's phases), for a step planned by this
  // call; all 0 for a repeat or a trainer's local plan.
  PlanPhaseSeconds plan_phases{};
};

struct JobView {
  std::string job_id;
  // A job whose state files could not be loaded (quarantined by Restore): only job_id, name
  // (when known) and failure are set; only DeleteJob acts on it.
  bool failed = false;
  // failed: why. Otherwise why the last step that could not be folded was not.
  std::string failure;
  std::string name;
  JobSettings settings;
  int64_t next_step = 0;
  int joined_ranks = 0;
  bool has_plan = false;
  std::shared_ptr<const StepPlan> last_plan;  // shared with the history: plans are immutable
  std::vector<double> speed_factors;
  // The latency model's learned key/value exchange rate (context parallelism), bytes per second.
  double exchange_bytes_per_second = 0.0;
  CostCoefficients coefficients;
  int64_t steps_folded = 0;  // fully reported steps the latency model has learned from
  std::vector<RecallCurveSummary> recall_curves;  // the learned recall model's curves
  int64_t micro_batch_capacity = 0;               // for the curves' bucket labels
  int64_t unfolded_steps = 0;  // fully reported steps that could not be folded (kept)
  // Host name per rank, as JoinJob gave it ("" unknown); null for a failed job.
  std::shared_ptr<const std::vector<std::string>> hosts;
  // Bytes its files take in the state directory (PlanStore::JobBytes); 0 without a store.
  int64_t state_bytes = 0;
};

// A latency model's learned key/value exchange rate in bytes per second (0 when it has none).
double ExchangeBytesPerSecond(const LatencyModel& model);

// Steps are numbered from 0 and below this bound (so that step + 1 and step differences never
// overflow; 2^48 steps of a millisecond each are 8,900 years).
inline constexpr int64_t kMaxStep = int64_t{1} << 48;

class JobRegistry {
 public:
  struct Options {
    WireLimits limits;
    int max_jobs = 1024;
    // When set, every change is written here before it is acknowledged (plan_store.h), and
    // Restore() reloads the jobs. Not owned.
    PlanStore* store = nullptr;
    // Called (under the job's lock: keep it short) when a step's last report arrives.
    std::function<void(const std::string& job_id, const StepStats& stats)> on_step;
    // Called (under the job's lock) when a fully reported step cannot be folded into the
    // model; the step is kept and the job goes on learning from later steps.
    std::function<void(const std::string& job_id, int64_t step, const absl::Status& why)>
        on_fold_failure;
    // Called for every failure of the store (IsStoreFailure), also those the registry absorbs
    // (a snapshot that only repeats what durable records hold): health turns NOT_SERVING.
    std::function<void(const absl::Status& failure)> on_store_failure;
    // A planned_locally SubmitBatch may jump at most this many steps past the next one.
    int64_t max_skipped_steps = int64_t{1} << 20;
    // The clock of the idle TTL (ExpireIdleJobs); null: std::chrono::steady_clock::now.
    std::function<std::chrono::steady_clock::time_point()> now;
    // Threads each SubmitBatch's planning is split over (plans do not depend on them); null:
    // the calling thread alone. Not owned.
    PlanThreads* plan_threads = nullptr;
    // SubmitBatch packs the steps that leave the newest kUnpackedSteps (3-5 ms at 1,024 ranks).
    // false: the caller calls PackHistory after it, once the step's waiting ranks have their
    // plans (sb-planner does), so that their wait does not include it.
    bool pack_in_submit = true;
  };
  // `random_hex(n)` returns n random hexadecimal characters (from a CSPRNG in production):
  // job ids and tokens are drawn from it.
  JobRegistry(Options options, std::function<std::string(int)> random_hex);

  // Reloads every job of options.store (after a restart): the same plans are served, reports
  // already acknowledged count, and steps continue where they stopped. Every loaded field is
  // validated; a job whose files are invalid is quarantined (PlanStore::Quarantine) and listed
  // by failed_jobs() and ListJobs, and the others are served. Fails only when the state
  // directory cannot be listed.
  absl::Status Restore();
  // Jobs whose files could not be loaded (failed views), in id order.
  std::vector<JobView> failed_jobs() const;

  absl::StatusOr<CreatedJob> CreateJob(const std::string& name, const JobSettings& settings,
                                       const std::string& profile);
  // OK when `token` is the job's token (compared in constant time); UNAUTHENTICATED when it is
  // empty, PERMISSION_DENIED when it is another; NOT_FOUND for an unknown job.
  // A job expired by ExpireIdleJobs (recently) is NOT_FOUND saying so. An authorized call
  // counts as the job's activity for the idle TTL.
  absl::Status Authorize(const std::string& job_id, const std::string& token) const;
  // Authorize's answer to a call without a token (UNAUTHENTICATED, saying what to send).
  static absl::Status NoTokenError();
  // Whether `token` is some job's, and that job's ranks: -1 when it is no job's, the ranks for
  // a live job's, 0 for one of the last kMaxRetiredTokens deleted or expired jobs' (so that
  // their late callers still get Authorize's NOT_FOUND saying why). The planner asks it before
  // it reads a request's body, which names the job (Authorize checks the token against that
  // job after), and caps the ReportSteps streams a token holds by the ranks. Tokens are looked
  // up by their SHA-256 digests, so the lookup's time tells nothing about how close an offered
  // token is to a real one.
  int TokenJobRanks(absl::string_view token) const;
  static constexpr size_t kMaxRetiredTokens = 4096;

  // Marks `rank` joined; returns the settings and the next step to plan.
  // With `rank_next_step`, also the first kept step this rank has not reported (or the next
  // step): where a restarted rank resumes. `host` is the worker's host name (ValidateHostName;
  // "" keeps the one the rank gave before); kept in memory only, a restart forgets it until
  // the rank joins again.
  absl::StatusOr<std::pair<JobSettings, int64_t>> JoinJob(const std::string& job_id, int rank,
                                                          int64_t* rank_next_step = nullptr,
                                                          const std::string& host = "");
  // Checks `batch` against the job's config (ValidateBatch: INVALID_ARGUMENT naming
  // "samples[i].<field>") and plans `step` (steps in order). With `planned_locally` the step's plan
  // is the trainer's fallback plan (PlanStepLocally), a step past the next one is accepted (the
  // steps between are skipped: the trainer ran them alone and no longer has their batches), and a
  // step already planned with the same batch but not reported yet switches to the local plan.
  absl::StatusOr<SubmitResult> SubmitBatch(const std::string& job_id, int64_t step,
                                           const std::vector<Sample>& batch,
                                           bool planned_locally = false);
  // The plan of `step` with `*ready` true; for a step not planned yet, OK with `*ready` false
  // (the service waits and asks again). FAILED_PRECONDITION for a step dropped from history.
  // `world_size`, when given, receives the job's ranks.
  absl::StatusOr<std::shared_ptr<const StepPlan>> GetPlan(const std::string& job_id, int64_t step,
                                                          int rank, bool* ready,
                                                          int* world_size = nullptr) const;
  // Accepts one rank's report for a planned step; returns true when it is a repeat of the
  // acknowledged report (nothing changed); a repeat that differs is ALREADY_EXISTS naming what
  // differs. The report must cover every non-empty micro-batch of the rank's plan once.
  // FAILED_PRECONDITION for a rank that has not joined or a step not planned.
  // `planned_locally`: the rank ran the step's local fallback plan; a step still holding the
  // planner's plan and no report switches to the local plan, and a step whose reports are
  // against the other plan is FAILED_PRECONDITION. `switched_to_local` (when given) says whether
  // this report made that switch (the step then counts as run on a local plan).
  // `micro_batches` is taken by value: the registry keeps it (move it in).
  absl::StatusOr<bool> ReportStep(const std::string& job_id, int64_t step, int rank,
                                  std::vector<MicroBatchTiming> micro_batches, double wait_seconds,
                                  bool planned_locally = false, bool* switched_to_local = nullptr);
  // ReportStep's answer to one report of a batch.
  struct ReportAnswer {
    bool duplicate = false;
    bool switched_to_local = false;
  };
  // ReportStep for each of `reports` in order, under the job's lock once. `answers` receives
  // one answer per report looked at. The first report refused ends the call with its error;
  // its answer is the last (only its switched_to_local means anything: a switch stays even when
  // the report then failed), the reports before it stay accepted and those after it were not
  // looked at. Consecutive new reports of one step are stored in one append (one write, and
  // with --fsync_reports one fsync); when the store refuses it, the first of them is the one
  // refused. A planned_locally report, which may switch its step to the local plan, is taken
  // alone. The reports' micro-batches are moved from.
  absl::Status ReportSteps(const std::string& job_id, std::vector<RankStepReport>& reports,
                           std::vector<ReportAnswer>* answers);
  // Replaces the model's prior with a fitted profile table; returns the fitted coefficients.
  absl::StatusOr<CostCoefficients> UploadProfile(const std::string& job_id,
                                                 const std::string& profile);
  // Applies the fields named in `fields` ("policy", "dst_mode", "dst_quantile",
  // "density_min", "density_max", "density_default", "overflow", "history_steps") from
  // `update`; anything else, or an invalid result, is INVALID_ARGUMENT and changes nothing.
  absl::StatusOr<JobSettings> UpdateJobConfig(const std::string& job_id, const JobSettings& update,
                                              const std::vector<std::string>& fields);
  absl::StatusOr<JobView> GetJob(const std::string& job_id) const;
  // Jobs in id order after `after` (exclusive), at most `limit`.
  // Failed jobs are listed too (JobView::failed).
  std::vector<JobView> ListJobs(const std::string& after, int limit) const;
  // Marks the job deleted under its lock (every later call of it is NOT_FOUND, and no write of
  // it can land), retires its folder atomically, and removes its files without any lock held.
  // Also removes a failed job's quarantined files.
  absl::Status DeleteJob(const std::string& job_id);
  // Deletes, as DeleteJob does, every job with no authorized call (Authorize) for `ttl` (since
  // it was created or reloaded when it had none); returns their ids. A job called while it is
  // being checked stays. Failed jobs are left for DeleteJob.
  std::vector<std::string> ExpireIdleJobs(std::chrono::nanoseconds ttl);
  int job_count() const;
  // The live jobs' ids, ascending.
  std::vector<std::string> job_ids() const;
  // Packs the job's steps older than its kUnpackedSteps newest (see Options::pack_in_submit);
  // nothing for an unknown job. Steps packed (for tests) by PackedSteps, and the bytes they
  // take packed by PackedBytes (0 for an unknown job).
  void PackHistory(const std::string& job_id);
  int PackedSteps(const std::string& job_id) const;
  int64_t PackedBytes(const std::string& job_id) const;

 private:
  // A step's measured document recalls, as the models' fold takes them.
  struct MeasuredRecalls {
    explicit MeasuredRecalls(const RecallModel& model) : sums(model) {}
    RecallStepSums sums;  // every measurement: a document's all-layers recall and its layers'
    // Per length bucket: the measured documents' tokens and token-weighted all-layers recall
    // (StepStats::measured_bucket_recall; doubles, summed in the order the reports came).
    std::array<double, kRecallBuckets> tokens{};
    std::array<double, kRecallBuckets> recall{};
    int reports = 0;      // the reports added
    absl::Status status;  // the first measurement `sums` refused: none is added after it
  };
  // A kept step. The newest kUnpackedSteps steps of a job, and any older one a call has
  // needed since the last SubmitBatch, hold their batch, plan and reports as values; the others
  // hold them packed (step_pack.h: about a tenth of the memory) and are unpacked (Unpack) by
  // the calls that need them. Packing changes nothing a caller can see: it keeps every value
  // but a folded step's documents' measured recalls (MicroBatchTiming::documents), which only
  // the fold reads.
  struct StepRecord {
    std::vector<Sample> batch;
    // Immutable once made; shared with waiting GetRankPlan calls instead of copied (a plan of
    // 16,384 samples copied for each of 1,024 ranks costs more than the planning). Null while
    // the step is packed.
    std::shared_ptr<const StepPlan> plan;
    // When the plan carries per-layer densities: what they were made from, so that packing
    // leaves them out (step_pack.h); null otherwise. A step read back from the store has one
    // where its record kept the recall model and it gives the densities back (StoredRecipe).
    std::shared_ptr<const LayerDensityRecipe> layers;
    StepReports reports;  // by rank, with the seconds each waited
    // Its reports' measured recalls, added as each report is taken (AddMeasuredRecalls), so
    // that the fold does not walk every report's documents again; made by the first report,
    // kept through packing, dropped by the fold. RecallStepSums do not depend on the order the
    // reports came in: the fold folds the same state from these as from all the reports at
    // once, which it does when they are not all here (a step restored from the store).
    std::optional<MeasuredRecalls> measured;
    // While packed: the batch, plan, reports and waits (PackStep), and which ranks reported.
    std::string packed;
    std::vector<bool> reported;
    // The step's reports are in the model, or could not be folded (counted in the job's
    // unfolded_steps): either way they are not folded again.
    bool folded = false;

    bool is_packed() const { return plan == nullptr; }
    bool HasReport(int rank) const {
      return is_packed() ? rank < static_cast<int>(reported.size()) && reported[rank]
                         : reports.has(rank);
    }
  };
  // Steps a job keeps unpacked whatever is asked of the older ones: the newest two, so that a
  // trainer that plans a step ahead (reports of step N arriving after step N+1 is planned)
  // never waits for an unpack.
  static constexpr int kUnpackedSteps = 2;
  struct Job {
    Job(const ValidConfig& c, int history, const CostCoefficients& prior)
        : config(c),
          history_steps(history),
          model(c.get().shape, c.get().ranks, prior),
          recall(c.get().micro_batch_capacity, c.get().shape.layers),
          hosts(std::make_shared<std::vector<std::string>>(c.get().ranks)) {}
    // The settings as JobSettings (views, snapshots, replies).
    JobSettings settings() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return {config.get(), history_steps};
    }
    mutable absl::Mutex mu;
    std::string name;
    std::string token;
    // Checked once, when the job was created or its config last changed; every step is planned
    // and every batch checked with it as it is.
    ValidConfig config ABSL_GUARDED_BY(mu);
    int history_steps ABSL_GUARDED_BY(mu);
    LatencyModel model ABSL_GUARDED_BY(mu);
    // Learned from the workers' measured document recalls (recall_model.h).
    RecallModel recall ABSL_GUARDED_BY(mu);
    std::vector<bool> joined ABSL_GUARDED_BY(mu);
    int64_t next_step ABSL_GUARDED_BY(mu) = 0;
    std::map<int64_t, StepRecord> history ABSL_GUARDED_BY(mu);
    // Set by DeleteJob, under mu, before the job's files go: every call that finds it answers
    // NOT_FOUND. Writers read it under mu; Authorize reads it without (its answer is advisory:
    // the call it admits checks again under mu), so that a token check never waits for the
    // job's lock, held through each report's append to its log.
    std::atomic<bool> deleted{false};
    int64_t unfolded_steps ABSL_GUARDED_BY(mu) = 0;
    std::string fold_failure ABSL_GUARDED_BY(mu);
    // Host name per rank (JoinJob). Views and StepStats share it: JoinJob changes it in place
    // only while nothing else holds it, and replaces it otherwise.
    std::shared_ptr<std::vector<std::string>> hosts ABSL_GUARDED_BY(mu);
    // Where this process's last append to the job's joins.log ended (PlanStore::AppendJoin):
    // a JoinJob answers once the log is durable that far. 0: none appended.
    int64_t joins_appended ABSL_GUARDED_BY(mu) = 0;
    // The idle TTL's clock (Options::now) at the last authorized call, nanoseconds since its
    // epoch. Written without the lock (Authorize holds none).
    std::atomic<int64_t> last_active_ns{0};
  };
  struct FailedJob {
    std::string reason;
    std::string path;
  };

  // The job, or null when it does not exist. Callers lock job->mu and check LiveOrNotFound.
  std::shared_ptr<Job> Find(const std::string& job_id) const;
  static absl::Status LiveOrNotFound(const std::string& job_id, const Job& job)
      ABSL_SHARED_LOCKS_REQUIRED(job.mu);
  // A store call's status, unchanged; store failures (IsStoreFailure) are also reported
  // through on_store_failure.
  absl::Status Stored(absl::Status status) const;
  // Builds and validates one job from its files (Restore).
  absl::StatusOr<std::shared_ptr<Job>> RestoreJob(PlanStore::LoadedJob& loaded);
  // One stored step of a job being restored, checked (its batch against `batch_config`, its
  // plan against `config`, its reports against its plan) and made a record; `folded` holds the
  // steps the job's snapshot lists as folded. An error is DATA_LOSS and names the file.
  static absl::StatusOr<StepRecord> RestoreStep(const PlannerConfig& config,
                                                const ValidConfig& batch_config,
                                                const std::set<int64_t>& folded,
                                                PlanStore::LoadedStep& step);
  static std::shared_ptr<const LayerDensityRecipe> StoredRecipe(const PlannerConfig& config,
                                                                const PlanStore::LoadedStep& step,
                                                                const StepPlan& plan,
                                                                const std::vector<Sample>& batch);
  // A fully reported step's reports as the latency model's observations: per reported
  // micro-batch its time against its planned features (`model` counts them for a plan read
  // back from the store).
  static void ObservationsOf(const StepRecord& record, const LatencyModel& model,
                             std::vector<Observation>* observations);
  // Adds rank `rank`'s report of the step planned as `plan` (its micro-batches' `timings`) to
  // `measured`: per measured document one recall for all layers (layer -1) and one per measured
  // layer, each at the density the plan gave it, and the document's tokens and recall to its
  // length bucket's. ValidateReport has checked every micro-batch, sample and document index.
  // After a measurement the sums refuse (measured->status), none is added.
  static void AddMeasuredRecalls(const StepPlan& plan, int rank,
                                 const std::vector<MicroBatchTiming>& timings,
                                 MeasuredRecalls* measured);
  // Drops the oldest steps beyond history_steps, and with `drop_files` their files. A step's
  // report log is what restore refolds it from while the durable snapshot keeps the step (at or
  // after its first_kept_step) and does not list it folded: a caller whose snapshot with the
  // step's fold was not written keeps the files. The next snapshot written has the step below
  // its first_kept_step, so files of it that are still there (kept, or a DropStep that failed)
  // are removed at restore and never folded a second time.
  void TrimHistory(const std::string& id, Job& job, bool drop_files = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);
  // A packed step's values back (no-op for an unpacked one); INTERNAL (never expected) when the
  // packed bytes do not unpack, and then the record is left as it was.
  static absl::Status Unpack(StepRecord& record);
  // Packs `step` unless it is one of the job's kUnpackedSteps newest (or packed already).
  static void PackIfOld(Job& job, int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);
  // ReportStep's work on a live job, its lock held: CheckReport, then TakeReports.
  absl::StatusOr<bool> ReportLocked(const std::string& job_id, Job& job, int64_t step, int rank,
                                    std::vector<MicroBatchTiming> micro_batches,
                                    double wait_seconds, bool planned_locally,
                                    bool* switched_to_local) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);
  // ReportStep's checks of a report (everything is checked before anything changes): true for
  // a repeat of an acknowledged report. Otherwise `record` is the step's, and `local` is set
  // when the report switches the step to its local plan (a planned_locally report of a step
  // that holds the planner's plan and no report yet).
  absl::StatusOr<bool> CheckReport(const std::string& job_id, Job& job, int64_t step, int rank,
                                   const std::vector<MicroBatchTiming>& micro_batches,
                                   double wait_seconds, bool planned_locally, StepRecord** record,
                                   std::optional<StepPlan>* local)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);
  // Takes checked new reports of `step` (distinct ranks, none reported yet): stored in one
  // append (one write, one fsync), then kept, and the step folded once every rank reported.
  // When the store refuses them none is kept. Their micro-batches are moved from.
  absl::Status TakeReports(const std::string& job_id, Job& job, int64_t step, StepRecord& record,
                           absl::Span<StoredReport> reports) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);
  // PackIfOld for every kept step.
  // With `threads`, the records are packed on them (plan_threads.h).
  static void PackOldSteps(Job& job, PlanThreads* threads = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);
  // What the store keeps of the job (its job.pb).
  static StoredJob Snapshot(const std::string& id, const Job& job)
      ABSL_SHARED_LOCKS_REQUIRED(job.mu);
  // Writes the job's snapshot to the store (no-op without one).
  absl::Status SaveJob(const std::string& id, const Job& job, bool sync = true) const
      ABSL_SHARED_LOCKS_REQUIRED(job.mu);
  // Writes a step's record, with the density settings of `planned_with`, the config its plan was
  // made with (the job's when it was planned: its config may change later).
  absl::Status SaveStep(const std::string& id, int64_t step, const StepRecord& record,
                        const PlannerConfig& planned_with) const;
  // The job's view, with its bytes in the store.
  JobView View(const std::string& id, const Job& job) const ABSL_SHARED_LOCKS_REQUIRED(job.mu);
  // Options::now in nanoseconds since its epoch.
  int64_t NowNanos() const;
  // DeleteJob of a live job; with `idle_before_ns`, only if its last activity is before it
  // (FAILED_PRECONDITION otherwise: it was called meanwhile).
  absl::Status DeleteLiveJob(const std::string& job_id, const std::shared_ptr<Job>& job,
                             const int64_t* idle_before_ns);
  // Replaces a step's plan by `plan` (the trainer's local fallback plan, made with
  // `planned_with`, the job's config) and saves the step record; on failure the record is
  // unchanged.
  absl::Status ReplacePlan(const std::string& id, int64_t step, StepRecord& record, StepPlan plan,
                           const PlannerConfig& planned_with) const;
  // Folds a step whose every rank has reported into the model (in rank order). Never fails: a
  // step that cannot be folded is kept, counted and reported (on_fold_failure), and the model
  // is left as it was.
  void Fold(const std::string& id, Job& job, int64_t step, StepRecord& record)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);

  const Options options_;
  const std::function<std::string(int)> random_hex_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, FailedJob> failed_ ABSL_GUARDED_BY(mu_);
  // Ids of the last jobs ExpireIdleJobs deleted (at most 4096, oldest dropped first), so that
  // their late callers learn why the job is gone.
  std::set<std::string> expired_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> expired_order_ ABSL_GUARDED_BY(mu_);
  // SHA-256 digests of the live jobs' tokens and of the last kMaxRetiredTokens deleted ones
  // (retired_order_, oldest first): TokenJobRanks. Under their own lock, so that a call's
  // first check never waits for mu_.
  void AddToken(const std::string& token, int ranks);
  void RetireToken(const std::string& token);
  mutable absl::Mutex tokens_mu_;
  // Digest -> the job's ranks (0 once retired).
  std::map<std::string, int> token_digests_ ABSL_GUARDED_BY(tokens_mu_);
  std::deque<std::string> retired_order_ ABSL_GUARDED_BY(tokens_mu_);
};

// Canonical bytes of a batch (ids, lengths, sensitivities, groups, segments): equal batches,
// equal bytes.
std::string BatchFingerprint(const std::vector<Sample>& batch);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SERVER_JOB_REGISTRY_H_
