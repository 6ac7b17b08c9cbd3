// sb-planner's durable state in --state_dir, one folder per job:
//
//   <state_dir>/<job_id>/job.pb             JobSnapshot: config, token, model, next step
//   <state_dir>/<job_id>/step-<n>.pb        StepRecord: the batch and the whole plan
//   <state_dir>/<job_id>/step-<n>.reports   ReportRecords, appended (framed, below)
//   <state_dir>/<job_id>/joins.log          JoinRecords: ranks that joined since job.pb said so
//
// Callers hand the store C++ values (StoredJob, a step's batch and plan, StoredReport) and get
// C++ values back; the store alone turns them into the storage protos of state.proto and bytes
// (state_codec.h).
//   <state_dir>/.deleted-<job_id>/          a job being deleted (RetireJob), never loaded
//   <state_dir>/quarantine/<job_id>/        a job whose files did not load, with a REASON file
//
// Snapshots and step records are written to a temporary file (`<name>.tmp`), fsync'ed and
// renamed over the old one (then the folder is fsync'ed), so a crash leaves the old or the new
// version, never a torn one; Open() removes the `*.tmp` a crash left behind. SubmitBatch returns
// only after its step record is durable. Reports are appended with write() before the call is
// acknowledged: they survive the planner process dying (SIGKILL, OOM); `--fsync_reports` also
// syncs each append, for machine crashes, at a cost per report; the job snapshot written after
// each SubmitBatch (the model with its folded steps) is synced under the same flag, and a step
// folded since is refolded from its reports on load. A rank's first JoinJob is appended to the
// job's joins.log and synced before it is acknowledged, ranks joining at once sharing an fsync
// (one record, not a rewrite of job.pb: rewriting and syncing the snapshot, which grows with
// the ranks, for every join made a 4,096-rank job's joins cost the planner seconds); the ranks
// joined are those job.pb lists and those joins.log adds.
//
// Steps that leave a job's history (trimmed) have their files removed once a snapshot holds
// their folds; job.pb's first_kept_step is the history's first step when it was written, and
// LoadAll removes (never loads, never folds) files of steps below it that a failed removal or a
// trim whose snapshot failed kept: a step is folded once, whatever files are left.
//
// A change that cannot be made durable once it is made ends the process: after the rename of
// a synced write has replaced the file, its folder's fsync failing (also after RetireJob's and
// Quarantine's renames), a joins.log fsync failing, or a report log that a failed append cannot
// be cut back from. Answered as an error, its caller would keep the old state while the
// directory holds the new one, which a restart loads; undone, the undo could fail the same way,
// and after a failed fsync no later one proves anything durable (PostgreSQL's "fsyncgate"). The
// store writes one line to stderr naming the file and the errno and exits with
// kExitStateDirSyncFailed; the restarted planner serves what the directory holds, and the
// calls in flight, UNAVAILABLE to their clients, are repeated harmlessly. So a write that the
// store refuses (CreateJob, SaveJob, SaveStep, AppendReports, RetireJob...) has left nothing of
// itself in the directory.
//
// A report log (and the joins log) is a sequence of records, each
//
//   magic (4 bytes: E2 9C 53 B7) | length of body (uint32 LE) | crc (uint32 LE) | body
//
// where crc is the CRC32C of the 4 length bytes and the body (a serialized ReportRecord, or a
// JoinRecord in joins.log). An
// append that fails part-way (ENOSPC after half a record) is cut off again with ftruncate() to
// the size before it, so the next append starts on a record boundary. A crash mid-append can
// still leave a torn record; the loader skips what does not frame or check (counting the bytes
// in LoadedStep::skipped_bytes) and resynchronises on the next magic word, so a torn record in
// the middle loses only itself. Logs of the previous version (4-byte LE length + body, no
// magic, no crc) are recognised per file, loaded up to their first torn record, and rewritten
// in the framed format before the first new append to them.
//
// job.pb and each step-<n>.pb are one such record (magic, length, crc, then the serialized
// JobSnapshot or StepRecord; FrameStateFile), so that a byte changed on disk after the write is
// found at load: a file whose frame does not check (its magic, its length against its size, its
// CRC32C) does not load and its job is quarantined, like one that does not parse. Files of the
// previous format (the bare message, no frame) are recognised per file (StateFileBody) and
// loaded as before, with the value checks of the restore alone to find damage in them; they are
// left as they are: a job's next snapshot replaces its job.pb, and its step records go as their
// steps leave the history.
//
// Bytes per job: the store counts the bytes each job's files hold (their sizes: step records,
// report logs, the spare record, job.pb, joins.log), from the files at LoadAll and from each
// write and removal after it (a stat of the files a call replaces, never a walk of the folder).
// With a bound (Open's max_job_bytes, sb-planner's --max_job_state_mb), a step record or report
// append that would take its job past it is refused with JobStateQuota (below), for that job
// alone: the other jobs, health and what the job stored are untouched. job.pb and joins.log
// are counted but never refused: their size is bounded by the job's config (its ranks and
// history), not by what callers send, and refusing them would refuse JoinJob or strand a trimmed
// step's files. The bound covers the files a job keeps, not a replaced record's temporary copy
// while it is written.
//
// Failures: an I/O failure of the directory is a StoreFailure (below): RESOURCE_EXHAUSTED when
// the disk or quota is full, INTERNAL otherwise; clients must not retry it. Nothing of the
// refused write is in the directory (a change made that cannot be made durable ends the process
// instead, above). sb-planner's health is NOT_SERVING from a store failure until a probe as
// large as the failed write succeeds (store_health.h; TakeFailedWriteBytes, CheckWritable). A
// job whose files do not parse is moved to quarantine/ by LoadAll and listed in Loaded::failed;
// the other jobs load. Job ids are checked (IsValidJobId) before they become paths, the top
// level is listed with lstat (symlinks and files are ignored) and removals never follow a
// symlink, so nothing outside --state_dir is touched.
//
//   absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir, false);
//   if (!store.ok()) return store.status();  // e.g. "state_dir: cannot create ...: Read-only..."
//   (*store)->CreateJob(job);                 // then SaveStep, AppendReport, SaveJob, ...
#ifndef SPARSEBALANCE_SERVER_PLAN_STORE_H_
#define SPARSEBALANCE_SERVER_PLAN_STORE_H_

#include <sys/stat.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "planner/latency_model.h"
#include "planner/profile_table.h"
#include "planner/recall_model.h"
#include "planner/types.h"
#include "proto/wire.h"

namespace sparsebalance {

class PlanThreads;

// The exit code of a planner that ended itself because the state directory could not make a
// change durable once it was made (a folder's fsync after a rename; the header comment): its
// supervisor restarts it, and the restart serves what the directory holds.
inline constexpr int kExitStateDirSyncFailed = 3;

// A failure of the state directory (disk full, read-only, I/O error). Not retryable by clients.
// Code RESOURCE_EXHAUSTED for ENOSPC/EDQUOT/EFBIG, INTERNAL otherwise; the message is
// "state_dir: " + `message` (what failed, on which path, and the errno text). Its one typed
// signal is the error reason kReasonStateDirFailure (proto/wire.h), attached here and carried
// unchanged through the registry to the gRPC status details the client reads; nothing
// recognises it by its message.
absl::Status StoreFailure(absl::StatusCode code, absl::string_view message);
bool IsStoreFailure(const absl::Status& status);

// A write refused because it would take job `job_id`'s files past the store's bound: code
// RESOURCE_EXHAUSTED with the reason kReasonJobStateQuota (proto/wire.h), the message naming the
// job (Quoted), the bytes it keeps, the `write` refused (e.g. "step 7's record (2641 bytes
// more)") and the bound with its flag, --max_job_state_mb. Never a store failure: the directory
// is fine, the job is at its bound.
// (IsJobStateQuota, proto/wire.h, recognises it.)
absl::Status JobStateQuota(absl::string_view job_id, int64_t job_bytes, absl::string_view write,
                           int64_t max_job_bytes);

// job.pb and step-<n>.pb as the store writes them: one framed record (see above) whose body is
// `body`, a serialized JobSnapshot or StepRecord.
std::string FrameStateFile(absl::string_view body);
// The serialized message in the bytes of a job.pb or step-<n>.pb found at `path`: the body of a
// framed file whose frame checks, or a file of the previous format whole (`*legacy` set). A
// framed file whose frame does not check (one flipped bit anywhere, a cut or a longer file) is
// DATA_LOSS naming `path` and what is wrong.
absl::StatusOr<absl::string_view> StateFileBody(absl::string_view bytes, absl::string_view path,
                                                bool* legacy);

// Job ids the store accepts as folder names: 8 to 64 characters of [0-9a-z]. Anything else is
// refused before it is used in a path (no '/', '.', '..').
bool IsValidJobId(absl::string_view id);

// A job as job.pb holds it: everything but its steps.
struct StoredJob {
  std::string job_id;
  std::string name;
  std::string token;
  JobSettings settings;
  LatencyModelState model;  // the learned state, with `prior` enough to rebuild the model
  CostCoefficients prior;
  RecallModelState recall;  // empty curves: none learned (an older planner's snapshot)
  int64_t next_step = 0;
  std::vector<bool> joined;           // per rank
  std::vector<int64_t> folded_steps;  // steps of the history whose reports are in the model
  int64_t unfolded_steps = 0;
  std::string fold_failure;
  // The history's first step (next_step when it holds none): every step below it has left the
  // history, folded into `model` or never to be. LoadAll removes the files of steps below it
  // that a failed removal left, and loads none of them. 0 in an older planner's snapshot.
  int64_t first_kept_step = 0;
};

// The density settings of the config a step was planned with (PlannerConfig's density_min,
// density_max, density_default), kept in its record: a restart checks the plan's densities
// against them (ValidateStoredPlan), as the job's config may have changed since.
struct PlannedDensities {
  double density_min = 0.0;
  double density_max = 0.0;
  double density_default = 0.0;
};

// One rank's acknowledged report of a step, as its report log holds it.
struct StoredReport {
  int rank = 0;
  std::vector<MicroBatchTiming> micro_batches;
  double wait_seconds = 0.0;  // seconds
};

class PlanStore {
 public:
  struct LoadedStep {
    int64_t step = 0;
    std::vector<Sample> batch;
    StepPlan plan;
    bool folded = false;
    // The recall model its per-layer densities were computed from, where the record has it
    // (SaveStep's layer_recall).
    std::optional<RecallModelState> layer_recall;
    // The density settings it was planned with, where the record has them (SaveStep's
    // planned_with; records of older planners do not).
    std::optional<PlannedDensities> planned_with;
    std::vector<StoredReport> reports;  // in the order they were appended
    int64_t skipped_bytes = 0;          // torn or corrupt bytes of the report log that were skipped
  };
  struct LoadedJob {
    std::string job_id;               // the folder's name, never the snapshot's contents
    StoredJob job;                    // `joined` includes the ranks of joins.log
    std::vector<LoadedStep> steps;    // ascending step, from the snapshot's first_kept_step
    int64_t joins_log_bytes = 0;      // the size of its joins.log (0: none)
    int64_t joins_skipped_bytes = 0;  // torn or corrupt bytes of joins.log that were skipped
  };
  struct FailedJob {
    std::string job_id;
    std::string reason;  // why its files could not be loaded
    std::string path;    // where its files are now (inside <dir>/quarantine/)
  };
  struct Loaded {
    std::vector<LoadedJob> jobs;    // job id order
    std::vector<FailedJob> failed;  // quarantined now or in an earlier run, job id order
  };

  // Opens the state directory: creates it (mode 0700: it holds job tokens), refuses one it
  // cannot write (CheckWritable), removes the `*.tmp` files a crash left in it and in its job
  // folders, and finishes the removals of retired jobs that a crash interrupted. With
  // `max_job_bytes` > 0, each job's files are bounded to that many bytes (see "Bytes per job"
  // above); 0: unbounded (still counted).
  static absl::StatusOr<std::unique_ptr<PlanStore>> Open(const std::string& dir, bool fsync_reports,
                                                         int64_t max_job_bytes = 0);

  // Creates, writes, fsyncs and removes a probe file in the directory: a store failure when the
  // disk is read-only, full or failing. The probe holds at least `bytes` bytes (a short text
  // when 0), so that it can show that a write of that size fits again (StoreHealth). With
  // `free_bytes` > 0 the file system must also report at least that many bytes free to this
  // process (statvfs): a write larger than any probe should be is shown to fit by that.
  absl::Status CheckWritable(int64_t bytes = 0, int64_t free_bytes = 0);
  // The size in bytes of the largest write that failed as a store failure since the last call
  // (0: none, or only failures of no known size: a removal, a folder sync), and forgets it.
  // sb-planner's health probes with that many bytes before it turns SERVING again.
  int64_t TakeFailedWriteBytes();

  // A new job: creates its folder (ALREADY_EXISTS when there is one) and its synced job.pb.
  absl::Status CreateJob(const StoredJob& job);
  // Replaces the snapshot of an existing job. `sync` false: a snapshot that only adds what the
  // step records and the appended reports already hold (the one after a submit); synced like
  // the reports (--fsync_reports), atomically renamed either way. Never re-creates a deleted
  // job: FAILED_PRECONDITION (not a store failure) when its folder is gone. The same holds for
  // SaveStep and AppendReport.
  absl::Status SaveJob(const StoredJob& job, bool sync = true);
  // Writes step `step`'s record (synced): its batch, its whole plan, and whether its reports
  // are folded; with `layer_recall`, the recall model the plan's per-layer densities were
  // computed from (which lets a restarted planner keep the step compact: JobRegistry::Restore);
  // with `planned_with`, the density settings of the config the plan was made with (which a
  // restart checks the plan's densities against).
  // JobStateQuota when the record would take the job past its bound (nothing written then).
  absl::Status SaveStep(const std::string& job_id, int64_t step, const std::vector<Sample>& batch,
                        const StepPlan& plan, bool folded,
                        const RecallModelState* layer_recall = nullptr,
                        const PlannedDensities* planned_with = nullptr);
  // Appends one framed record; on failure the log is cut back to its size before the call.
  // JobStateQuota when the record would take the job past its bound (nothing written then).
  absl::Status AppendReport(const std::string& job_id, int64_t step, const StoredReport& report);
  // Appends a framed record per report of step `step` in one write (and with --fsync_reports
  // one fsync), e.g. a node's reports that came in one ReportStepBatch call: all or none, the
  // log cut back to its size before the call on failure; JobStateQuota as AppendReport.
  absl::Status AppendReports(const std::string& job_id, int64_t step,
                             absl::Span<const StoredReport> reports);
  // Records that `rank` joined the job: one framed JoinRecord appended to its joins.log (on
  // failure the log is cut back to its size before the call). Returns the log's size after it,
  // for SyncJoins. FAILED_PRECONDITION when the job's folder is gone.
  absl::StatusOr<int64_t> AppendJoin(const std::string& job_id, int rank);
  // Makes the job's joins.log durable up to byte `end` (an AppendJoin's answer): one fsync
  // covers every join appended before it, so ranks joining at once share a few (a group
  // commit). Call it without holding a lock that other joins need.
  absl::Status SyncJoins(const std::string& job_id, int64_t end);
  // Removes a step that left the job's history. Its record stays in the job's folder as a
  // spare (a `*.tmp` file, never loaded) for the next SaveStep of the job to write over: on
  // the machines measured, writing over cached pages costs a fraction of new ones.
  absl::Status DropStep(const std::string& job_id, int64_t step);

  // Deleting in two parts: RetireJob renames <dir>/<id> to <dir>/.deleted-<id> and fsyncs the
  // directory, so a restart never loads it (quick); RemoveRetired deletes those files (slow
  // for thousands of steps: call it without holding locks; failures are left to the next
  // Open(), which finishes removals that a crash interrupted).
  absl::Status RetireJob(const std::string& job_id);
  void RemoveRetired(const std::string& job_id);

  // Moves a job's folder to <dir>/quarantine/<job_id> (with a REASON file holding `reason`,
  // replacing an earlier quarantined folder of the same id); later LoadAll calls list it in
  // `failed` until DeleteQuarantined (NOT_FOUND when there is none).
  absl::Status Quarantine(const std::string& job_id, const std::string& reason);
  absl::Status DeleteQuarantined(const std::string& job_id);

  // Every job folder, loaded or failed. A job whose files do not check, parse or decode
  // (damaged, truncated or garbage job.pb or step-N.pb, a config or model that cannot be a job's,
  // unreadable files, step files without a job.pb) is quarantined here and listed in `failed`; the
  // other jobs load. An empty folder (a CreateJob a crash interrupted) is removed. Entries that are
  // not folders, symlinks and folders whose names are not job ids are left alone. Fails only when
  // `dir` itself cannot be listed. With `threads`, each job's steps are loaded on them
  // (plan_threads.h); the answer is the same.
  absl::StatusOr<Loaded> LoadAll(PlanThreads* threads = nullptr);

  // The bytes job `job_id`'s files hold (0 for a job the store does not hold: never created,
  // retired, quarantined).
  int64_t JobBytes(const std::string& job_id) const;
  // OK when job `job_id` has room for a write of its own below its bound; JobStateQuota when it
  // is at or past it already (a lowered bound at restart, or job.pb and joins.log, which are
  // never refused, took it there): for refusing a new step before planning it.
  absl::Status CheckJobRoom(const std::string& job_id) const;
  int64_t max_job_bytes() const { return max_job_bytes_; }
  // Called with a job's bytes when CreateJob made it and each time a write or removal changes
  // them (not at LoadAll, nor when the job is retired or quarantined), under the store's lock of
  // its counts: keep it short (e.g. set a gauge). Set it before the store is used.
  void set_job_bytes_observer(std::function<void(const std::string& job_id, int64_t bytes)> f) {
    job_bytes_observer_ = std::move(f);
  }

  const std::string& dir() const { return dir_; }
  ~PlanStore();

 private:
  struct ReportLog {
    int fd = -1;
    off_t size = 0;  // bytes: where the next record starts
  };

  PlanStore(std::string dir, bool fsync_reports, int64_t max_job_bytes)
      : dir_(std::move(dir)), fsync_reports_(fsync_reports), max_job_bytes_(max_job_bytes) {}
  std::string JobDir(const std::string& job_id) const;
  // Loads one job folder; an error says why the job cannot be loaded (to quarantine it).
  // `*bytes_held` receives the sizes of its files, summed.
  absl::StatusOr<LoadedJob> LoadJob(const std::string& job_id, PlanThreads* threads,
                                    int64_t* bytes_held) const;
  // Loads step `step` of the job in `job_dir`: its record, and its report log if it has one.
  absl::StatusOr<LoadedStep> LoadStep(const std::string& job_dir, int64_t step,
                                      bool has_reports) const;
  // Opens the report log of (job, step) for appending, rewriting a log of the previous format
  // (and counting the bytes that changed).
  absl::StatusOr<ReportLog> OpenReportLog(const std::string& job_id, int64_t step);
  // Counts `bytes` more for job `job_id` when that keeps it within its bound (or `bytes` <= 0,
  // or there is no bound); JobStateQuota naming `write` otherwise, and nothing counted. A job the
  // store does not count (retired meanwhile) is let through: its write finds no folder.
  absl::Status ReserveBytes(const std::string& job_id, int64_t bytes, absl::string_view write);
  // Adds `delta` to the bytes of a job the store counts (a correction after a write, a removal,
  // or a write that is never refused).
  void AddBytes(const std::string& job_id, int64_t delta);
  void ForgetBytes(const std::string& job_id);
  // Creates the (empty) report log of a step just saved, so that the step's first report opens
  // a file instead of creating one (an inode allocation, tens of microseconds on ext4). Not
  // kept open: nothing holds the file before a report. A failure is left to the first append,
  // which opens the log itself and reports what fails.
  void CreateReportLog(const std::string& job_id, int64_t step) const;
  // Opens the job's joins.log with `flags` (O_WRONLY | O_CREAT | O_APPEND, or O_RDONLY) into
  // *fd and stats it: FAILED_PRECONDITION when the job's folder is gone, a store failure when
  // it cannot be opened or is not a regular file (*fd closed then).
  absl::StatusOr<struct stat> OpenJoinsLog(const std::string& job_id, int flags, int* fd) const;
  // Closes the report logs held open for `job_id` (all steps, or only `step` when >= 0).
  void CloseReportLogsLocked(const std::string& job_id, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(logs_mu_);
  // Open()'s cleanup after a crash: `*.tmp` files and interrupted removals.
  void SweepAfterCrash();
  // `status`, unchanged; when it is a store failure, a write of `bytes` failed
  // (TakeFailedWriteBytes).
  absl::Status NoteWrite(absl::Status status, int64_t bytes);

  const std::string dir_;
  const bool fsync_reports_;
  const int64_t max_job_bytes_;                 // 0: unbounded
  std::atomic<int64_t> failed_write_bytes_{0};  // TakeFailedWriteBytes
  std::function<void(const std::string&, int64_t)> job_bytes_observer_;
  // Bytes per job held (LoadAll, CreateJob), changed by each write and removal. A job's writes
  // come one at a time from its caller (JobRegistry holds the job's lock).
  mutable absl::Mutex bytes_mu_;
  std::map<std::string, int64_t> job_bytes_ ABSL_GUARDED_BY(bytes_mu_);
  // Report logs kept open between appends (an open and a close per report cost as much as the
  // rest of ReportStep): by (job, step), at most kMaxOpenReportLogs. Held across each append,
  // so records of one log never interleave, and across RetireJob and Quarantine, so no log is
  // opened in a folder that is moving away.
  static constexpr size_t kMaxOpenReportLogs = 64;
  absl::Mutex logs_mu_;
  std::map<std::pair<std::string, int64_t>, ReportLog> report_logs_ ABSL_GUARDED_BY(logs_mu_);
  // Per job, the bytes of its joins.log known durable (SyncJoins); held through each sync.
  absl::Mutex joins_sync_mu_;
  std::map<std::string, int64_t> joins_synced_ ABSL_GUARDED_BY(joins_sync_mu_);
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SERVER_PLAN_STORE_H_
