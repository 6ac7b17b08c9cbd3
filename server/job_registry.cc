#include "server/job_registry.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <set>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "planner/plan_threads.h"
#include "planner/planner.h"
#include "planner/profile_table.h"
#include "planner/sparsity_tuner.h"
#include "server/step_pack.h"
#include "tools/secret.h"

namespace sparsebalance {
namespace {

constexpr int kJobIdHexChars = 16;
constexpr int kTokenHexChars = 64;  // 256 bits

// The settings UpdateJobConfig may change while the job runs (its update_mask names), each
// with how it is copied from the request's values.
struct RuntimeSetting {
  const char* name;
  void (*copy)(const JobSettings& from, JobSettings& to);
};

template <auto Field>
void CopyPlannerSetting(const JobSettings& from, JobSettings& to) {
  to.planner.*Field = from.planner.*Field;
}

void CopyHistorySteps(const JobSettings& from, JobSettings& to) {
  to.history_steps = from.history_steps;
}

constexpr RuntimeSetting kRuntimeSettings[] = {
    {"policy", &CopyPlannerSetting<&PlannerConfig::policy>},
    {"dst_mode", &CopyPlannerSetting<&PlannerConfig::dst_mode>},
    {"dst_quantile", &CopyPlannerSetting<&PlannerConfig::dst_quantile>},
    {"density_min", &CopyPlannerSetting<&PlannerConfig::density_min>},
    {"density_max", &CopyPlannerSetting<&PlannerConfig::density_max>},
    {"density_default", &CopyPlannerSetting<&PlannerConfig::density_default>},
    {"overflow", &CopyPlannerSetting<&PlannerConfig::overflow>},
    {"bucket_recall_margin", &CopyPlannerSetting<&PlannerConfig::bucket_recall_margin>},
    {"document_recall_floor", &CopyPlannerSetting<&PlannerConfig::document_recall_floor>},
    {"selection", &CopyPlannerSetting<&PlannerConfig::selection>},
    {"anchor_threshold", &CopyPlannerSetting<&PlannerConfig::anchor_threshold>},
    {"max_shards", &CopyPlannerSetting<&PlannerConfig::max_shards>},
    {"shard_policy", &CopyPlannerSetting<&PlannerConfig::shard_policy>},
    {"shard_min_length", &CopyPlannerSetting<&PlannerConfig::shard_min_length>},
    {"history_steps", &CopyHistorySteps},
};

// The entry of kRuntimeSettings named `name`, or null.
const RuntimeSetting* FindRuntimeSetting(const std::string& name) {
  for (const RuntimeSetting& setting : kRuntimeSettings) {
    if (name == setting.name) return &setting;
  }
  return nullptr;
}

}  // namespace

double ExchangeBytesPerSecond(const LatencyModel& model) {
  const double seconds_per_byte = model.exchange_seconds_per_byte();
  return seconds_per_byte > 0 ? 1.0 / seconds_per_byte : 0.0;
}

namespace {

absl::Status NotFound(const std::string& job_id) {
  return absl::NotFoundError(absl::StrCat("job \"", Quoted(job_id), "\" does not exist"));
}

// Expired jobs remembered for their late callers' error message.
constexpr size_t kMaxExpiredIds = 4096;

template <typename T>
void Append(std::string* out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out->append(bytes, sizeof(T));
}

bool IsLowerHex(const std::string& s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// What a kept step's batch is checked against (at restore, and when the step is submitted
// again): the job's config with the two settings that bound a batch, and that UpdateJobConfig
// may have tightened since the step was planned, at their loosest. `overflow` may have become
// `error` after a step deferred samples, and `max_shards` may have been lowered after a step
// split a document longer than the capacity; checked against the config as it is now, such a
// step's repeat was refused, and at restart the whole job was quarantined. Its bounds still
// keep every sum of the batch from overflowing (ValidateBatch).
absl::StatusOr<ValidConfig> KeptBatchConfig(const PlannerConfig& config) {
  PlannerConfig loosest = config;
  loosest.overflow = OverflowPolicy::kDefer;
  loosest.max_shards = std::min(config.ranks, kMaxShards);
  return ValidConfig::Check(loosest);
}

}  // namespace

std::string BatchFingerprint(const std::vector<Sample>& batch) {
  std::string out;
  out.reserve(batch.size() * 40);
  for (const Sample& s : batch) {
    Append(&out, s.id);
    Append(&out, s.length);
    Append(&out, s.sensitivity);
    Append(&out, s.group);
    Append(&out, static_cast<uint64_t>(s.segments.size()));
    for (int64_t segment : s.segments) Append(&out, segment);
  }
  return out;
}

std::vector<SlowRank> SlowestRanks(const std::vector<double>& speed_factors,
                                   const std::vector<std::string>* hosts, int k) {
  const int n = static_cast<int>(speed_factors.size());
  k = std::clamp(k, 0, n);
  std::vector<int> order(n);
  for (int r = 0; r < n; ++r) order[r] = r;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
    return speed_factors[a] != speed_factors[b] ? speed_factors[a] > speed_factors[b] : a < b;
  });
  std::vector<SlowRank> out;
  out.reserve(k);
  for (int i = 0; i < k; ++i) {
    const int r = order[i];
    const bool known = hosts != nullptr && r < static_cast<int>(hosts->size());
    out.push_back({r, known ? (*hosts)[r] : std::string(), speed_factors[r]});
  }
  return out;
}

JobRegistry::JobRegistry(Options options, std::function<std::string(int)> random_hex)
    : options_(std::move(options)), random_hex_(std::move(random_hex)) {}

std::shared_ptr<JobRegistry::Job> JobRegistry::Find(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : it->second;
}

absl::Status JobRegistry::LiveOrNotFound(const std::string& job_id, const Job& job) {
  return job.deleted.load(std::memory_order_relaxed) ? NotFound(job_id) : absl::OkStatus();
}

absl::Status JobRegistry::Stored(absl::Status status) const {
  if (IsStoreFailure(status) && options_.on_store_failure) options_.on_store_failure(status);
  return status;
}

absl::Status JobRegistry::SaveJob(const std::string& id, const Job& job, bool sync) const {
  if (options_.store == nullptr) return absl::OkStatus();
  return Stored(options_.store->SaveJob(Snapshot(id, job), sync));
}

StoredJob JobRegistry::Snapshot(const std::string& id, const Job& job) {
  StoredJob out;
  out.job_id = id;
  out.name = job.name;
  out.token = job.token;
  out.settings = job.settings();
  out.model = job.model.state();
  out.prior = job.model.prior();
  out.recall = job.recall.state();
  out.next_step = job.next_step;
  out.joined = job.joined;
  for (const auto& [step, record] : job.history) {
    if (record.folded) out.folded_steps.push_back(step);
  }
  // A step below it left the history before this snapshot, its fold (if any) in `model`: files
  // of it that a failed trim kept are removed at load, never folded again (PlanStore::LoadAll).
  out.first_kept_step = job.history.empty() ? job.next_step : job.history.begin()->first;
  out.unfolded_steps = job.unfolded_steps;
  out.fold_failure = job.fold_failure;
  return out;
}

absl::Status JobRegistry::SaveStep(const std::string& id, int64_t step, const StepRecord& record,
                                   const PlannerConfig& planned_with) const {
  if (options_.store == nullptr) return absl::OkStatus();
  // With the recipe's recall model, so that a restart can keep the step compact (RestoreJob),
  // and the densities the plan was made with, which a restart checks it against.
  const PlannedDensities densities{planned_with.density_min, planned_with.density_max,
                                   planned_with.density_default};
  return Stored(options_.store->SaveStep(
      id, step, record.batch, *record.plan, record.folded,
      record.layers != nullptr ? &record.layers->recall.state() : nullptr, &densities));
}

void JobRegistry::TrimHistory(const std::string& id, Job& job, bool drop_files) {
  while (static_cast<int>(job.history.size()) > job.history_steps) {
    const int64_t dropped = job.history.begin()->first;
    job.history.erase(job.history.begin());
    // A step file left behind is dropped again at the next restart: not worth failing for.
    if (options_.store != nullptr && drop_files) {
      Stored(options_.store->DropStep(id, dropped)).IgnoreError();
    }
  }
}

absl::Status JobRegistry::Unpack(StepRecord& record) {
  if (!record.is_packed()) return absl::OkStatus();
  absl::StatusOr<PackedStepContents> step = UnpackStep(record.packed, record.layers.get());
  if (!step.ok()) return step.status();
  record.batch = std::move(step->batch);
  record.plan = std::make_shared<const StepPlan>(std::move(step->plan));
  record.reports = std::move(step->reports);
  std::string().swap(record.packed);
  std::vector<bool>().swap(record.reported);
  return absl::OkStatus();
}

namespace {

// Packs an unpacked record (JobRegistry::StepRecord) and frees its values. A folded step's
// reports go without their documents' measured recalls: only the fold reads them (a repeated
// report is compared without them, ReportDifference), and they are most of a report's bytes.
template <typename Record>
void Pack(Record& record) {
  if (record.folded) {
    for (int rank = 0; rank < record.reports.slots(); ++rank) {
      if (!record.reports.has(rank)) continue;
      for (MicroBatchTiming& m : record.reports.timings(rank))
        std::vector<DocumentRecallMeasurement>().swap(m.documents);
    }
  }
  record.packed = PackStep(record.batch, *record.plan, record.reports, record.layers.get());
  record.reported.assign(record.reports.slots(), false);
  for (int rank = 0; rank < record.reports.slots(); ++rank) {
    record.reported[rank] = record.reports.has(rank);
  }
  std::vector<Sample>().swap(record.batch);
  record.plan.reset();
  record.reports.Clear();
}

}  // namespace

void JobRegistry::PackIfOld(Job& job, int64_t step) {
  auto newest = job.history.rbegin();
  for (int i = 0; i < kUnpackedSteps && newest != job.history.rend(); ++i, ++newest) {
    if (newest->first == step) return;
  }
  auto it = job.history.find(step);
  if (it != job.history.end() && !it->second.is_packed()) Pack(it->second);
}

void JobRegistry::PackOldSteps(Job& job, PlanThreads* threads) {
  const int old = static_cast<int>(job.history.size()) - kUnpackedSteps;
  std::vector<StepRecord*> unpacked;
  auto it = job.history.begin();
  for (int i = 0; i < old; ++i, ++it) {
    if (!it->second.is_packed()) unpacked.push_back(&it->second);
  }
  // Each record on its own (a restored 4,096-rank job packs 60 steps: 0.57 s one after another).
  ParallelEach(threads, unpacked.size(), [&](size_t k) { Pack(*unpacked[k]); });
}

absl::Status JobRegistry::Restore() {
  if (options_.store == nullptr) return absl::OkStatus();
  absl::StatusOr<PlanStore::Loaded> loaded = options_.store->LoadAll(options_.plan_threads);
  if (!loaded.ok()) return loaded.status();
  std::map<std::string, FailedJob> failed;
  for (const PlanStore::FailedJob& f : loaded->failed) failed[f.job_id] = {f.reason, f.path};
  std::map<std::string, std::shared_ptr<Job>> jobs;
  for (PlanStore::LoadedJob& l : loaded->jobs) {
    absl::StatusOr<std::shared_ptr<Job>> job = RestoreJob(l);
    if (job.ok()) {
      jobs[l.job_id] = *std::move(job);
      continue;
    }
    const std::string reason(job.status().message());
    std::string path = options_.store->dir() + "/" + l.job_id;
    if (absl::Status moved = options_.store->Quarantine(l.job_id, reason); moved.ok()) {
      path = options_.store->dir() + "/quarantine/" + l.job_id;
    }
    failed[l.job_id] = {reason, path};
  }
  absl::MutexLock lock(&mu_);
  // A reloaded job's idle time counts from now: the planner did not see it while down.
  for (auto& [id, job] : jobs) job->last_active_ns.store(NowNanos(), std::memory_order_relaxed);
  for (auto& [id, job] : jobs) {
    int ranks = 0;
    {
      absl::MutexLock job_lock(&job->mu);
      ranks = job->config.get().ranks;
    }
    AddToken(job->token, ranks);
    jobs_[id] = std::move(job);
  }
  for (auto& [id, f] : failed) failed_[id] = std::move(f);
  return absl::OkStatus();
}

// The recipe of a restored step's per-layer densities (StepRecord::layers): the recall model
// its record keeps with the job's config, where they give back its densities bit for bit.
// Without it the step keeps its layer densities in memory when packed: a per-layer job of
// 16,384 samples over 1,024 ranks held 5.4 MB a kept step after a restart (346 MiB for its 64),
// where it holds 1.1 MB as before the restart (sb-server-bench's History/restart:1). Null where the
// record has none (an older planner's, a plan without per-layer densities), where its recall model
// does not fit the job, or where this release's LayerDensities would not give the same densities:
// those are kept as stored.
std::shared_ptr<const LayerDensityRecipe> JobRegistry::StoredRecipe(
    const PlannerConfig& config, const PlanStore::LoadedStep& step, const StepPlan& plan,
    const std::vector<Sample>& batch) {
  if (!step.layer_recall.has_value()) return nullptr;
  RecallModel recall(config.micro_batch_capacity, config.shape.layers);
  if (!recall.set_state(*step.layer_recall).ok()) return nullptr;
  auto recipe =
      std::make_shared<const LayerDensityRecipe>(LayerDensityRecipe{config, std::move(recall)});
  return RecipeGivesLayerDensities(batch, plan, *recipe) ? recipe : nullptr;
}

absl::StatusOr<JobRegistry::StepRecord> JobRegistry::RestoreStep(const PlannerConfig& config,
                                                                 const ValidConfig& batch_config,
                                                                 const std::set<int64_t>& folded,
                                                                 PlanStore::LoadedStep& step) {
  const int64_t n = step.step;
  const std::string where = absl::StrCat("step-", n, ".pb: ");
  if (n < 0 || n >= kMaxStep) {
    return absl::DataLossError(absl::StrCat(where, "step ", n, " is outside [0, 2^48)"));
  }
  StepRecord record;
  record.batch = std::move(step.batch);
  if (absl::Status s = ValidateBatch(record.batch, batch_config); !s.ok()) {
    return absl::DataLossError(absl::StrCat(where, s.message()));
  }
  // Fills the lengths of a plan stored by an older planner from this batch.
  if (absl::Status s = ValidateStoredPlan(
          record.batch, config, step.planned_with.has_value() ? &*step.planned_with : nullptr,
          &step.plan);
      !s.ok()) {
    return absl::DataLossError(absl::StrCat(where, s.message()));
  }
  record.plan = std::make_shared<const StepPlan>(std::move(step.plan));
  record.layers = StoredRecipe(config, step, *record.plan, record.batch);
  record.folded = step.folded || folded.count(n) > 0;
  for (StoredReport& report : step.reports) {
    if (absl::Status s =
            ValidateReport(*record.plan, report.rank, config.shape.layers, report.micro_batches,
                           report.wait_seconds, /*complete=*/false);
        !s.ok()) {
      return absl::DataLossError(
          absl::StrCat("step-", n, ".reports: rank ", report.rank, ": ", s.message()));
    }
    // The first acknowledged report of a rank counts (a later one cannot have been
    // acknowledged: ReportStep answers repeats from memory).
    if (record.reports.has(report.rank)) continue;
    record.reports.Put(report.rank, std::move(report.micro_batches), report.wait_seconds);
  }
  return record;
}

absl::StatusOr<std::shared_ptr<JobRegistry::Job>> JobRegistry::RestoreJob(PlanStore::LoadedJob& l) {
  const std::string& id = l.job_id;  // the folder's name: the file's own id is not trusted
  StoredJob& stored = l.job;         // its config and model are decoded and checked (DecodeJob)
  absl::StatusOr<ValidConfig> valid = ValidConfig::Check(stored.settings.planner);
  if (!valid.ok()) return absl::DataLossError(absl::StrCat("job.pb: ", valid.status().message()));
  const PlannerConfig& config = valid->get();
  if (stored.name.size() > 64) return absl::DataLossError("job.pb: name above 64 characters");
  if (stored.token.size() != kTokenHexChars || !IsLowerHex(stored.token)) {
    return absl::DataLossError(
        absl::StrCat("job.pb: the token is not ", kTokenHexChars, " hexadecimal characters"));
  }
  if (stored.next_step < 0 || stored.next_step > kMaxStep) {
    return absl::DataLossError(
        absl::StrCat("job.pb: next_step ", stored.next_step, " is outside [0, 2^48]"));
  }
  if (stored.unfolded_steps < 0) return absl::DataLossError("job.pb: unfolded_steps < 0");
  auto job = std::make_shared<Job>(*valid, stored.settings.history_steps, stored.prior);
  absl::MutexLock job_lock(&job->mu);
  job->model.set_state(stored.model);
  // An older planner's snapshot has no recall model: the job starts learning it now.
  if (!stored.recall.curves.empty()) {
    if (absl::Status s = job->recall.set_state(stored.recall); !s.ok()) {
      return absl::DataLossError(absl::StrCat("job.pb: ", s.message()));
    }
  }
  job->name = std::move(stored.name);
  job->token = std::move(stored.token);
  job->unfolded_steps = stored.unfolded_steps;
  job->fold_failure = stored.fold_failure.substr(0, 1024);
  job->joined.assign(config.ranks, false);
  for (int r = 0; r < static_cast<int>(stored.joined.size()) && r < config.ranks; ++r) {
    job->joined[r] = stored.joined[r];
  }
  // A join the last process appended but never synced (it died first, so never acknowledged
  // it) is synced before the rank's retry is answered: as if this process had appended it.
  job->joins_appended = l.joins_log_bytes;
  job->next_step = stored.next_step;
  const std::set<int64_t> folded(stored.folded_steps.begin(), stored.folded_steps.end());
  // Batches of the history are checked against the loosest config they may have been planned
  // with (KeptBatchConfig).
  absl::StatusOr<ValidConfig> batch_config = KeptBatchConfig(config);
  if (!batch_config.ok()) return absl::DataLossError(batch_config.status().message());
  // Each step is checked and made a record on the threads, on its own (its batch validated and
  // indexed, its plan and reports checked: 0.46 s one after another for a 4,096-rank job's 64
  // kept steps), then added in step order; the first failing step in step order is the job's
  // error, as one pass would find it.
  std::vector<absl::StatusOr<StepRecord>> records(l.steps.size(),
                                                  absl::UnknownError("not restored"));
  ParallelEach(options_.plan_threads, l.steps.size(), [&](size_t k) {
    records[k] = RestoreStep(config, *batch_config, folded, l.steps[k]);
  });
  for (size_t k = 0; k < l.steps.size(); ++k) {
    if (!records[k].ok()) return records[k].status();
    const int64_t n = l.steps[k].step;
    // A step record written just before a crash that kept the snapshot from landing.
    job->next_step = std::max(job->next_step, n + 1);
    job->history[n] = *std::move(records[k]);
  }
  // Steps whose last report landed but whose fold's snapshot did not (a crash in between),
  // folded before the history is trimmed: a step beyond it is folded too, not dropped unfolded.
  bool refolded = false;
  for (auto& [n, record] : job->history) {
    if (!record.folded && record.reports.count() == config.ranks) {
      Fold(id, *job, n, record);
      refolded = true;
    }
  }
  // Their files go once a snapshot holds their folds (TrimHistory).
  TrimHistory(id, *job,
              /*drop_files=*/!refolded || options_.store == nullptr || SaveJob(id, *job).ok());
  PackOldSteps(*job, options_.plan_threads);
  return job;
}

std::vector<JobView> JobRegistry::failed_jobs() const {
  absl::MutexLock lock(&mu_);
  std::vector<JobView> out;
  for (const auto& [id, f] : failed_) {
    JobView v;
    v.job_id = id;
    v.failed = true;
    v.failure = f.reason;
    out.push_back(std::move(v));
  }
  return out;
}

absl::StatusOr<CreatedJob> JobRegistry::CreateJob(const std::string& name,
                                                  const JobSettings& settings,
                                                  const std::string& profile) {
  if (name.size() > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: ", name.size(), " characters; at most 64"));
  }
  absl::StatusOr<ValidConfig> config = ValidConfig::Check(settings.planner);
  if (!config.ok()) return config.status();
  if (settings.history_steps < 1 || settings.history_steps > options_.limits.max_history_steps) {
    return absl::InvalidArgumentError(absl::StrCat("config.history_steps: ", settings.history_steps,
                                                   " is outside [1, ",
                                                   options_.limits.max_history_steps, "]"));
  }
  CostCoefficients prior = kDefaultCostPrior;
  if (!profile.empty()) {
    absl::StatusOr<ProfileTable> table = ParseProfileTable(profile);
    if (!table.ok())
      return absl::InvalidArgumentError(absl::StrCat("profile: ", table.status().message()));
    absl::StatusOr<CostCoefficients> fitted = FitProfile(*table, settings.planner.shape);
    if (!fitted.ok())
      return absl::InvalidArgumentError(absl::StrCat("profile: ", fitted.status().message()));
    prior = *fitted;
  }
  auto job = std::make_shared<Job>(*config, settings.history_steps, prior);
  job->name = name;
  job->token = random_hex_(kTokenHexChars);
  job->last_active_ns.store(NowNanos(), std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  if (static_cast<int>(jobs_.size() + failed_.size()) >= options_.max_jobs) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this planner holds ", jobs_.size() + failed_.size(),
                     " jobs, its limit; delete finished (or failed) jobs first"));
  }
  std::string id;
  do {
    id = random_hex_(kJobIdHexChars);
  } while (jobs_.count(id) > 0 || failed_.count(id) > 0);
  absl::MutexLock job_lock(&job->mu);
  job->joined.assign(settings.planner.ranks, false);
  if (options_.store != nullptr) {
    if (absl::Status s = Stored(options_.store->CreateJob(Snapshot(id, *job))); !s.ok()) return s;
  }
  AddToken(job->token, settings.planner.ranks);
  jobs_[id] = job;
  return CreatedJob{id, job->token, settings};
}

absl::Status JobRegistry::NoTokenError() {
  return absl::UnauthenticatedError(
      "no job token: send the token CreateJob returned as \"authorization: Bearer <token>\"");
}

absl::Status JobRegistry::Authorize(const std::string& job_id, const std::string& token) const {
  // No token: the same answer whether the job exists or not (NOT_FOUND for an absent job told
  // a caller without any token which ids exist).
  if (token.empty()) return NoTokenError();
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) {
    absl::MutexLock lock(&mu_);
    if (expired_.count(job_id) > 0) {
      return absl::NotFoundError(absl::StrCat(
          "job \"", Quoted(job_id),
          "\" was deleted: no call carried its token for the planner's --job_idle_ttl; create "
          "a new job"));
    }
    return NotFound(job_id);
  }
  if (!tools::ConstantTimeEquals(token, job->token)) {
    return absl::PermissionDeniedError(absl::StrCat("the token is not job ", job_id, "'s"));
  }
  job->last_active_ns.store(NowNanos(), std::memory_order_relaxed);
  return job->deleted.load(std::memory_order_acquire) ? NotFound(job_id) : absl::OkStatus();
}

int JobRegistry::TokenJobRanks(absl::string_view token) const {
  if (token.empty()) return -1;
  const std::string digest = tools::Sha256(token);
  absl::ReaderMutexLock lock(&tokens_mu_);
  const auto it = token_digests_.find(digest);
  return it == token_digests_.end() ? -1 : it->second;
}

void JobRegistry::AddToken(const std::string& token, int ranks) {
  const std::string digest = tools::Sha256(token);
  absl::MutexLock lock(&tokens_mu_);
  token_digests_[digest] = ranks;
}

void JobRegistry::RetireToken(const std::string& token) {
  absl::MutexLock lock(&tokens_mu_);
  const std::string digest = tools::Sha256(token);
  if (const auto it = token_digests_.find(digest); it != token_digests_.end()) it->second = 0;
  retired_order_.push_back(digest);
  if (retired_order_.size() > kMaxRetiredTokens) {
    token_digests_.erase(retired_order_.front());
    retired_order_.pop_front();
  }
}

absl::StatusOr<std::pair<JobSettings, int64_t>> JobRegistry::JoinJob(const std::string& job_id,
                                                                     int rank,
                                                                     int64_t* rank_next_step,
                                                                     const std::string& host) {
  if (absl::Status s = ValidateHostName(host); !s.ok()) return s;
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  std::pair<JobSettings, int64_t> joined;
  int64_t durable_end = 0;  // the joins.log bytes this answer promises durable
  bool appended = false;
  {
    absl::MutexLock lock(&job->mu);
    if (absl::Status s = LiveOrNotFound(job_id, *job); !s.ok()) return s;
    if (rank < 0 || rank >= job->config.get().ranks) {
      return absl::InvalidArgumentError(absl::StrCat("rank: ", rank, " is outside [0, ",
                                                     job->config.get().ranks, ") of job ", job_id));
    }
    if (!job->joined[rank] && options_.store != nullptr) {
      // One record appended to the job's joins.log, not a rewrite of its snapshot: a job's
      // joins are linear in its ranks, not quadratic. Synced below, outside the lock.
      absl::StatusOr<int64_t> end = options_.store->AppendJoin(job_id, rank);
      if (!end.ok()) return Stored(end.status());
      job->joins_appended = std::max(job->joins_appended, *end);
      appended = true;
    }
    // After the append: a join refused by the store changes nothing, its host name included.
    if (!host.empty() &&
        (rank >= static_cast<int>(job->hosts->size()) || (*job->hosts)[rank] != host)) {
      // Copied when a view or a step's stats hold it (they keep what they saw), else changed
      // in place: copying it at every join made a job's joins quadratic in its ranks. Only
      // the holder of mu makes new holders, so a count of 1 read under it stays 1.
      if (job->hosts.use_count() > 1) {
        job->hosts = std::make_shared<std::vector<std::string>>(*job->hosts);
      }
      job->hosts->resize(std::max<size_t>(job->hosts->size(), job->config.get().ranks));
      (*job->hosts)[rank] = host;
    }
    job->joined[rank] = true;
    // A rank that finds itself joined answers once every join appended so far is durable
    // (its own may be one that another call is still syncing).
    durable_end = job->joins_appended;
    if (rank_next_step != nullptr) {
      *rank_next_step = job->next_step;
      for (const auto& [step, record] : job->history) {
        if (!record.HasReport(rank)) {
          *rank_next_step = step;
          break;
        }
      }
    }
    joined = std::make_pair(job->settings(), job->next_step);
  }
  if (durable_end > 0) {
    // Outside the job's lock, so that the ranks joining meanwhile append theirs and one fsync
    // covers them all (PlanStore::SyncJoins).
    if (absl::Status s = Stored(options_.store->SyncJoins(job_id, durable_end)); !s.ok()) {
      absl::MutexLock lock(&job->mu);
      // Deleted meanwhile (its folder gone): NOT_FOUND, as every call on a deleted job.
      if (job->deleted.load(std::memory_order_relaxed)) return NotFound(job_id);
      if (appended) job->joined[rank] = false;  // not acknowledged: it joins again
      return s;
    }
  }
  return joined;
}

absl::StatusOr<SubmitResult> JobRegistry::SubmitBatch(const std::string& job_id, int64_t step,
                                                      const std::vector<Sample>& batch,
                                                      bool planned_locally) {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  absl::MutexLock lock(&job->mu);
  if (absl::Status s = LiveOrNotFound(job_id, *job); !s.ok()) return s;
  // The one check of the batch against the job's config, before anything else (a repeat with an
  // invalid batch is INVALID_ARGUMENT, not ALREADY_EXISTS). A step planned already is checked as
  // restore checks it (KeptBatchConfig): the same batch again gets the same answer after
  // UpdateJobConfig tightened overflow or max_shards.
  if (step >= 0 && step < job->next_step) {
    absl::StatusOr<ValidConfig> kept = KeptBatchConfig(job->config.get());
    if (!kept.ok()) return kept.status();
    if (absl::Status s = ValidateBatch(batch, *kept); !s.ok()) return s;
  } else if (absl::Status s = ValidateBatch(batch, job->config); !s.ok()) {
    return s;
  }
  if (step < 0 || step >= kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: ", step, " is outside [0, 2^48); steps count from 0"));
  }
  if (step < job->next_step) {
    auto it = job->history.find(step);
    if (it == job->history.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step, " was planned but is older than the ", job->history_steps,
                       " steps kept; the next step is ", job->next_step));
    }
    StepRecord& record = it->second;
    if (absl::Status s = Unpack(record); !s.ok()) return s;
    if (BatchFingerprint(record.batch) != BatchFingerprint(batch)) {
      return absl::AlreadyExistsError(
          absl::StrCat("step ", step, " was planned with a different batch; submit step ",
                       job->next_step, " next"));
    }
    SubmitResult result{step, {}, {}, true};
    if (planned_locally && !record.plan->planned_locally) {
      if (!record.reports.empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("step ", step,
                         " already has reports against the planner's plan; its ranks must all "
                         "run one plan"));
      }
      absl::StatusOr<StepPlan> local = PlanStepLocally(record.batch, job->config);
      if (!local.ok()) return local.status();
      if (absl::Status s = ReplacePlan(job_id, step, record, *std::move(local), job->config.get());
          !s.ok()) {
        return s;
      }
      result.switched_to_local = true;
    }
    result.deferred_ids = record.plan->deferred_ids;
    result.plan = record.plan;
    result.exchange_bytes_per_second = ExchangeBytesPerSecond(job->model);
    return result;
  }
  if (step > job->next_step && !planned_locally) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, " is out of order: job ", job_id, " plans step ", job->next_step,
        " next (a trainer that ran steps on local plans submits with planned_locally)"));
  }
  const int64_t skipped = step - job->next_step;
  if (skipped > options_.max_skipped_steps) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step: ", step, " would skip ", skipped, " steps after step ", job->next_step - 1,
        "; a planned_locally submit may skip at most ", options_.max_skipped_steps));
  }
  // A job at its bound in the state directory is refused before the planning, which its record
  // could not be stored from (SaveStep refuses a record past the bound in any case).
  if (options_.store != nullptr) {
    if (absl::Status s = options_.store->CheckJobRoom(job_id); !s.ok()) return s;
  }
  PlanPhaseSeconds phases{};
  absl::StatusOr<StepPlan> plan =
      planned_locally
          ? PlanStepLocally(batch, job->config)
          : PlanStep(batch, job->config, job->model, job->recall, options_.plan_threads, &phases);
  if (!plan.ok()) return plan.status();
  StepRecord record;
  record.batch = batch;
  record.plan = std::make_shared<const StepPlan>(*std::move(plan));
  // The recipe is a copy of the recall model (about 70 KB at 32 layers), where the densities it
  // lets packing leave out take 32 doubles a sample.
  if (!planned_locally && PlansLayerDensities(job->config.get(), job->recall, batch.size())) {
    record.layers = std::make_shared<const LayerDensityRecipe>(
        LayerDensityRecipe{job->config.get(), job->recall});
  }
  // Durable before it is acknowledged: the step record (fsync'ed).
  if (absl::Status s = SaveStep(job_id, step, record, job->config.get()); !s.ok()) return s;
  job->history[step] = std::move(record);
  job->next_step = step + 1;
  // The snapshot after it only moves next_step (which Restore also takes from the step
  // records) and carries the model (which Restore refolds from the report logs): the step is
  // acknowledged even when it cannot be written (on_store_failure reports that). Written before
  // the history is trimmed, and the trimmed steps' files dropped only once it is: a step's report
  // log is what a restart refolds it from until a snapshot holds its fold.
  const bool saved = SaveJob(job_id, *job, /*sync=*/false).ok();
  TrimHistory(job_id, *job, /*drop_files=*/saved);
  if (options_.pack_in_submit) PackOldSteps(*job);
  const std::shared_ptr<const StepPlan>& planned = job->history[step].plan;
  SubmitResult result{step, planned->deferred_ids, planned, false};
  result.skipped_steps = skipped;
  result.exchange_bytes_per_second = ExchangeBytesPerSecond(job->model);
  result.plan_phases = phases;
  return result;
}

absl::Status JobRegistry::ReplacePlan(const std::string& id, int64_t step, StepRecord& record,
                                      StepPlan plan, const PlannerConfig& planned_with) const {
  StepRecord updated = record;
  updated.plan = std::make_shared<const StepPlan>(std::move(plan));
  updated.layers.reset();    // a local plan (PlanStepLocally) has no per-layer densities
  updated.measured.reset();  // measured against the plan replaced (no report was taken yet)
  if (absl::Status s = SaveStep(id, step, updated, planned_with); !s.ok()) return s;
  record = std::move(updated);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const StepPlan>> JobRegistry::GetPlan(const std::string& job_id,
                                                                     int64_t step, int rank,
                                                                     bool* ready,
                                                                     int* world_size) const {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  absl::MutexLock lock(&job->mu);
  if (absl::Status s = LiveOrNotFound(job_id, *job); !s.ok()) return s;
  if (rank < 0 || rank >= job->config.get().ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", rank, " is outside [0, ", job->config.get().ranks, ")"));
  }
  if (step < 0 || step >= kMaxStep) {
    return absl::InvalidArgumentError(absl::StrCat("step: ", step, " is outside [0, 2^48)"));
  }
  if (world_size != nullptr) *world_size = job->config.get().ranks;
  *ready = false;
  if (step >= job->next_step) return std::shared_ptr<const StepPlan>();
  auto it = job->history.find(step);
  if (it == job->history.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, " is older than the steps kept; the next step is ", job->next_step));
  }
  if (absl::Status s = Unpack(it->second); !s.ok()) return s;
  *ready = true;
  return it->second.plan;
}

namespace {

// What differs between an acknowledged report and its repeat ("" when nothing does).
std::string ReportDifference(const std::vector<MicroBatchTiming>& before, double wait_before,
                             const std::vector<MicroBatchTiming>& now, double wait_now) {
  if (before.size() != now.size()) {
    return absl::StrCat("micro_batches: ", now.size(), " timings, acknowledged with ",
                        before.size());
  }
  std::string differs;
  // Names the first field whose value differs: "<field>: <now>, acknowledged as <before>".
  auto compare = [&differs](absl::string_view field, auto was, auto is) {
    if (differs.empty() && was != is) {
      differs = absl::StrCat(field, ": ", is, ", acknowledged as ", was);
    }
  };
  for (size_t k = 0; k < now.size() && differs.empty(); ++k) {
    const MicroBatchTiming& a = before[k];
    const MicroBatchTiming& b = now[k];
    const std::string at = absl::StrCat("micro_batches[", k, "].");
    compare(at + "micro_batch", a.micro_batch, b.micro_batch);
    compare(at + "compute_seconds", a.compute_seconds, b.compute_seconds);
    compare(at + "attention_seconds", a.attention_seconds, b.attention_seconds);
    compare(at + "tokens", a.tokens, b.tokens);
    compare(at + "achieved_density", a.achieved_density, b.achieved_density);
    compare(at + "recall", a.recall, b.recall);
    compare(at + "exchange_seconds", a.exchange_seconds, b.exchange_seconds);
  }
  compare("wait_seconds", wait_before, wait_now);
  return differs;
}

}  // namespace

absl::StatusOr<bool> JobRegistry::ReportStep(const std::string& job_id, int64_t step, int rank,
                                             std::vector<MicroBatchTiming> micro_batches,
                                             double wait_seconds, bool planned_locally,
                                             bool* switched_to_local) {
  if (switched_to_local != nullptr) *switched_to_local = false;
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  absl::MutexLock lock(&job->mu);
  if (absl::Status s = LiveOrNotFound(job_id, *job); !s.ok()) return s;
  return ReportLocked(job_id, *job, step, rank, std::move(micro_batches), wait_seconds,
                      planned_locally, switched_to_local);
}

absl::Status JobRegistry::ReportSteps(const std::string& job_id,
                                      std::vector<RankStepReport>& reports,
                                      std::vector<ReportAnswer>* answers) {
  answers->clear();
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  absl::MutexLock lock(&job->mu);
  if (absl::Status s = LiveOrNotFound(job_id, *job); !s.ok()) return s;
  answers->reserve(reports.size());
  // New reports of one step, checked and not taken yet: taken in one append when a report of
  // another step, a repeat of one of their ranks, a report that may switch the step to its
  // local plan, a refused report or the end of the batch comes. A node's reports of a step
  // thus cost one write (and one fsync) instead of one each.
  std::vector<StoredReport> pending;
  absl::flat_hash_set<int> pending_ranks;
  int64_t pending_step = -1;
  StepRecord* pending_record = nullptr;
  size_t pending_first = 0;
  auto take_pending = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(job->mu) {
    if (pending.empty()) return absl::OkStatus();
    absl::Status taken =
        TakeReports(job_id, *job, pending_step, *pending_record, absl::MakeSpan(pending));
    if (!taken.ok()) answers->resize(pending_first + 1);  // none taken: the first is refused
    pending.clear();
    pending_ranks.clear();
    return taken;
  };
  for (size_t k = 0; k < reports.size(); ++k) {
    RankStepReport& report = reports[k];
    if (!pending.empty() && (report.step != pending_step || report.planned_locally ||
                             pending_ranks.contains(report.rank))) {
      if (absl::Status s = take_pending(); !s.ok()) return s;
    }
    ReportAnswer answer;
    if (report.planned_locally) {  // it may switch the step to its local plan: alone, as ReportStep
      absl::StatusOr<bool> duplicate =
          ReportLocked(job_id, *job, report.step, report.rank, std::move(report.micro_batches),
                       report.wait_seconds, /*planned_locally=*/true, &answer.switched_to_local);
      answer.duplicate = duplicate.ok() && *duplicate;
      answers->push_back(answer);
      if (!duplicate.ok()) return duplicate.status();
      continue;
    }
    StepRecord* record = nullptr;
    std::optional<StepPlan> local;  // never set: the report is not planned_locally
    absl::StatusOr<bool> duplicate =
        CheckReport(job_id, *job, report.step, report.rank, report.micro_batches,
                    report.wait_seconds, /*planned_locally=*/false, &record, &local);
    if (!duplicate.ok()) {
      if (absl::Status s = take_pending(); !s.ok()) return s;
      answers->push_back(answer);
      return duplicate.status();
    }
    answer.duplicate = *duplicate;
    answers->push_back(answer);
    if (*duplicate) continue;
    if (pending.empty()) {
      pending_step = report.step;
      pending_record = record;
      pending_first = k;
    }
    pending_ranks.insert(report.rank);
    pending.push_back(
        StoredReport{report.rank, std::move(report.micro_batches), report.wait_seconds});
  }
  return take_pending();
}

absl::StatusOr<bool> JobRegistry::ReportLocked(const std::string& job_id, Job& job, int64_t step,
                                               int rank,
                                               std::vector<MicroBatchTiming> micro_batches,
                                               double wait_seconds, bool planned_locally,
                                               bool* switched_to_local) {
  if (switched_to_local != nullptr) *switched_to_local = false;
  StepRecord* record = nullptr;
  std::optional<StepPlan> local;
  absl::StatusOr<bool> duplicate = CheckReport(job_id, job, step, rank, micro_batches, wait_seconds,
                                               planned_locally, &record, &local);
  if (!duplicate.ok() || *duplicate) return duplicate;
  if (local.has_value()) {
    if (absl::Status s = ReplacePlan(job_id, step, *record, *std::move(local), job.config.get());
        !s.ok()) {
      return s;
    }
    if (switched_to_local != nullptr) *switched_to_local = true;
  }
  StoredReport report{rank, std::move(micro_batches), wait_seconds};
  if (absl::Status s = TakeReports(job_id, job, step, *record, absl::MakeSpan(&report, 1));
      !s.ok()) {
    return s;
  }
  return false;
}

absl::StatusOr<bool> JobRegistry::CheckReport(const std::string& job_id, Job& job, int64_t step,
                                              int rank,
                                              const std::vector<MicroBatchTiming>& micro_batches,
                                              double wait_seconds, bool planned_locally,
                                              StepRecord** record_out,
                                              std::optional<StepPlan>* local) {
  const PlannerConfig& config = job.config.get();
  if (rank < 0 || rank >= config.ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", rank, " is outside [0, ", config.ranks, ")"));
  }
  if (step < 0 || step >= kMaxStep) {
    return absl::InvalidArgumentError(absl::StrCat("step: ", step, " is outside [0, 2^48)"));
  }
  if (!job.joined[rank]) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " has not joined job ", job_id, "; call JoinJob first"));
  }
  auto it = job.history.find(step);
  if (it == job.history.end()) {
    return absl::FailedPreconditionError(
        step >= job.next_step
            ? absl::StrCat("step ", step, " has not been planned; the next step is ", job.next_step)
            : absl::StrCat("step ", step, " is older than the steps kept"));
  }
  StepRecord& record = it->second;
  if (absl::Status s = Unpack(record); !s.ok()) return s;
  if (record.reports.has(rank)) {
    const std::string differs =
        ReportDifference(record.reports.timings(rank), record.reports.wait_seconds(rank),
                         micro_batches, wait_seconds);
    if (differs.empty() && planned_locally == record.plan->planned_locally) return true;
    return absl::AlreadyExistsError(absl::StrCat("rank ", rank, "'s report of step ", step,
                                                 " was acknowledged already and this one differs: ",
                                                 differs.empty() ? "planned_locally" : differs));
  }
  // Everything is checked before anything changes: against the plan the step will hold.
  *record_out = &record;
  if (planned_locally != record.plan->planned_locally) {
    if (!planned_locally || !record.reports.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "planned_locally: rank ", rank, " ran the ", planned_locally ? "local" : "planner's",
          " plan of step ", step, " but the step's other ranks ran the ",
          planned_locally ? "planner's" : "local", " one; all ranks of a step must run one plan"));
    }
    absl::StatusOr<StepPlan> planned = PlanStepLocally(record.batch, job.config);
    if (!planned.ok()) return planned.status();
    *local = *std::move(planned);
  }
  if (absl::Status s = ValidateReport(local->has_value() ? **local : *record.plan, rank,
                                      job.config.get().shape.layers, micro_batches, wait_seconds,
                                      /*complete=*/true);
      !s.ok()) {
    return s;
  }
  return false;
}

absl::Status JobRegistry::TakeReports(const std::string& job_id, Job& job, int64_t step,
                                      StepRecord& record, absl::Span<StoredReport> reports) {
  if (options_.store != nullptr) {
    if (absl::Status s = Stored(options_.store->AppendReports(job_id, step, reports)); !s.ok()) {
      return s;
    }
  }
  const int ranks = job.config.get().ranks;
  record.reports.Reserve(ranks);
  for (StoredReport& report : reports) {
    if (!record.folded) {
      if (!record.measured.has_value()) record.measured.emplace(job.recall);
      AddMeasuredRecalls(*record.plan, report.rank, report.micro_batches, &*record.measured);
    }
    record.reports.Put(report.rank, std::move(report.micro_batches), report.wait_seconds);
  }
  if (record.reports.count() == ranks && !record.folded) {
    Fold(job_id, job, step, record);
    // A late step (one before the newest two) is not needed unpacked once folded.
    PackIfOld(job, step);
  }
  return absl::OkStatus();
}

void JobRegistry::Fold(const std::string& id, Job& job, int64_t step, StepRecord& record) {
  // Once, whatever happens: a step that cannot be folded now never can.
  record.folded = true;
  auto fail = [&](const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu) {
    ++job.unfolded_steps;
    job.fold_failure = absl::StrCat("step ", step, ": ", why.message()).substr(0, 1024);
    if (options_.on_fold_failure) options_.on_fold_failure(id, step, why);
  };
  // The measured recalls were added as the reports were taken (TakeReports); a step restored
  // from the store has them added now, from all its reports (the same sums: RecallStepSums).
  // At 65,536 documents that each measured 32 layers, adding them here took 10.8-11.0 ms of the
  // fold, which the last report waited for.
  if (!record.measured.has_value() || record.measured->reports != record.reports.count()) {
    record.measured.emplace(job.recall);
    for (int rank = 0; rank < record.reports.slots(); ++rank) {
      if (record.reports.has(rank)) {
        AddMeasuredRecalls(*record.plan, rank, record.reports.timings(rank), &*record.measured);
      }
    }
  }
  const MeasuredRecalls measured = *std::move(record.measured);
  record.measured.reset();
  std::vector<Observation> observations;
  ObservationsOf(record, job.model, &observations);
  // The recall model learns from the measured document recalls, independently of the latency
  // model: a step whose times cannot be folded still says what its densities kept.
  // Steps without measurements (workers that do not measure) leave the curves as they are.
  absl::Status recall_status = measured.status;
  if (recall_status.ok() && measured.sums.size() > 0) {
    recall_status = job.recall.ObserveStep(measured.sums);
  }
  if (const absl::Status& s = recall_status; !s.ok()) {
    ++job.unfolded_steps;
    job.fold_failure = absl::StrCat("step ", step, ": recall: ", s.message()).substr(0, 1024);
    if (options_.on_fold_failure) options_.on_fold_failure(id, step, s);
  }
  const LatencyModelState before = job.model.state();
  if (absl::Status s = job.model.ObserveStep(std::move(observations)); !s.ok()) return fail(s);
  if (!StateFinite(job.model.state())) {
    job.model.set_state(before);
    return fail(absl::InvalidArgumentError(
        "folding the reports made the model's state non-finite; the model was kept as before"));
  }
  if (options_.on_step) {
    StepStats stats;
    stats.step = step;
    stats.policy = record.plan->policy;
    stats.planned_makespan_seconds = record.plan->makespan_seconds;
    for (int rank = 0; rank < record.reports.slots(); ++rank) {
      if (!record.reports.has(rank)) continue;
      double seconds = 0.0;
      for (const MicroBatchTiming& m : record.reports.timings(rank)) {
        seconds += m.compute_seconds;
        stats.densities.push_back(m.achieved_density);
        stats.recalls.push_back(m.recall);
      }
      stats.rank_seconds.push_back(seconds);
      stats.predicted_rank_seconds.push_back(record.plan->ranks[rank].predicted_seconds);
      stats.wait_seconds.push_back(record.reports.wait_seconds(rank));
    }
    stats.speed_factors = job.model.speed_factors();
    stats.hosts = job.hosts;
    stats.exchange_bytes_per_second = ExchangeBytesPerSecond(job.model);
    const int64_t capacity = job.config.get().micro_batch_capacity;
    for (int rank = 0; rank < record.reports.slots(); ++rank) {
      if (!record.reports.has(rank)) continue;
      for (const MicroBatchTiming& m : record.reports.timings(rank)) {
        stats.recall_seconds += m.recall_seconds;
        stats.attention_seconds += m.attention_seconds;
      }
    }
    for (int b = 0; b < kRecallBuckets; ++b) {
      if (measured.tokens[b] > 0) {
        stats.measured_bucket_recall[RecallBucketLabel(b, capacity)] =
            measured.recall[b] / measured.tokens[b];
      }
    }
    options_.on_step(id, stats);
  }
  // No snapshot here: the next SubmitBatch writes one (the model with its folded marks), and
  // until then a restart refolds this step from its report log (Restore). Writing one per
  // fold cost a file create and rename (and ext4's flush-on-rename) per step.
}

void JobRegistry::ObservationsOf(const StepRecord& record, const LatencyModel& model,
                                 std::vector<Observation>* observations) {
  // Room for a micro-batch per timing. Counting the documents first cost a walk of their own over
  // the reports' scattered vectors.
  size_t count = 0;
  const StepReports& reports = record.reports;
  for (int rank = 0; rank < reports.slots(); ++rank) {
    if (reports.has(rank)) count += reports.timings(rank).size();
  }
  observations->reserve(count);
  for (int rank = 0; rank < reports.slots(); ++rank) {
    if (!reports.has(rank)) continue;
    for (const MicroBatchTiming& m : reports.timings(rank)) {
      const MicroBatchPlan& planned = record.plan->ranks[rank].micro_batches[m.micro_batch];
      Observation o;
      o.rank = rank;
      o.micro_batch = m.micro_batch;
      // BuildPlan's sum when the plan was made here; a plan read back from the store has none.
      o.features = planned.features_known ? planned.features : model.PlanFeatures(planned);
      o.measured_seconds = m.compute_seconds;
      o.exchange_seconds = m.exchange_seconds;
      observations->push_back(o);
    }
  }
}

void JobRegistry::AddMeasuredRecalls(const StepPlan& plan, int rank,
                                     const std::vector<MicroBatchTiming>& timings,
                                     MeasuredRecalls* measured) {
  ++measured->reports;
  const int64_t capacity = measured->sums.capacity();
  // One finder for every micro-batch (its sorted ids' room reused; a hash map per micro-batch
  // cost more in allocations than the lookups).
  PlannedSampleFinder finder;
  for (const MicroBatchTiming& m : timings) {
    if (m.documents.empty()) continue;
    const MicroBatchPlan& planned = plan.ranks[rank].micro_batches[m.micro_batch];
    finder.Reset(&planned.samples);
    for (const DocumentRecallMeasurement& d : m.documents) {
      const PlannedSample* found = finder.Find(d.sample_id);
      if (found == nullptr) continue;
      const PlannedSample& sample = *found;
      const int64_t length = sample.segments.empty() ? sample.length : sample.segments[d.document];
      const int b = RecallBucket(length, capacity);
      measured->tokens[b] += static_cast<double>(length);
      measured->recall[b] += static_cast<double>(length) * d.recall;
      if (!measured->status.ok()) continue;
      measured->status = measured->sums.AddDocument(length, sample.density, d.recall,
                                                    sample.layer_densities, d.layer_recall);
    }
  }
}

absl::StatusOr<CostCoefficients> JobRegistry::UploadProfile(const std::string& job_id,
                                                            const std::string& profile) {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  absl::StatusOr<ProfileTable> table = ParseProfileTable(profile);
  if (!table.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("profile: ", table.status().message()));
  }
  absl::MutexLock lock(&job->mu);
  if (absl::Status s = LiveOrNotFound(job_id, *job); !s.ok()) return s;
  absl::StatusOr<CostCoefficients> fitted = FitProfile(*table, job->config.get().shape);
  if (!fitted.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("profile: ", fitted.status().message()));
  }
  // A new prior restarts learning; the speed factors stay (they are about the ranks).
  LatencyModel model(job->config.get().shape, job->config.get().ranks, *fitted);
  LatencyModelState state = model.state();
  state.speed_factors = job->model.speed_factors();
  model.set_state(state);
  std::swap(job->model, model);
  if (absl::Status s = SaveJob(job_id, *job); !s.ok()) {
    std::swap(job->model, model);
    return s;
  }
  return *fitted;
}

absl::StatusOr<JobSettings> JobRegistry::UpdateJobConfig(const std::string& job_id,
                                                         const JobSettings& update,
                                                         const std::vector<std::string>& fields) {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  absl::MutexLock lock(&job->mu);
  if (absl::Status s = LiveOrNotFound(job_id, *job); !s.ok()) return s;
  JobSettings next = job->settings();
  if (fields.empty()) {
    return absl::InvalidArgumentError("update_mask: names no field; e.g. \"policy\"");
  }
  for (const std::string& field : fields) {
    const RuntimeSetting* setting = FindRuntimeSetting(field);
    if (setting == nullptr) {
      std::vector<std::string> changeable;
      for (const RuntimeSetting& s : kRuntimeSettings) changeable.emplace_back(s.name);
      return absl::InvalidArgumentError(absl::StrCat(
          "update_mask: \"", Quoted(field),
          "\" cannot change at run time; changeable: ", absl::StrJoin(changeable, ", ")));
    }
    setting->copy(update, next);
    if (field == "history_steps" &&
        (next.history_steps < 1 || next.history_steps > options_.limits.max_history_steps)) {
      return absl::InvalidArgumentError(absl::StrCat("config.history_steps: ", next.history_steps,
                                                     " is outside [1, ",
                                                     options_.limits.max_history_steps, "]"));
    }
  }
  absl::StatusOr<ValidConfig> valid = ValidConfig::Check(next.planner);
  if (!valid.ok()) return valid.status();
  const ValidConfig previous = job->config;
  const int previous_history = job->history_steps;
  job->config = *valid;
  job->history_steps = next.history_steps;
  if (absl::Status s = SaveJob(job_id, *job); !s.ok()) {
    job->config = previous;
    job->history_steps = previous_history;
    return s;
  }
  TrimHistory(job_id, *job);
  return next;
}

JobView JobRegistry::View(const std::string& id, const Job& job) const {
  JobView v;
  v.job_id = id;
  v.name = job.name;
  v.settings = job.settings();
  v.next_step = job.next_step;
  v.joined_ranks = static_cast<int>(std::count(job.joined.begin(), job.joined.end(), true));
  if (!job.history.empty()) {
    v.has_plan = true;
    v.last_plan = job.history.rbegin()->second.plan;
  }
  v.speed_factors = job.model.speed_factors();
  v.exchange_bytes_per_second = ExchangeBytesPerSecond(job.model);
  v.coefficients = job.model.coefficients();
  v.steps_folded = job.model.state().steps_observed;
  v.recall_curves = job.recall.Curves();
  v.micro_batch_capacity = job.config.get().micro_batch_capacity;
  v.unfolded_steps = job.unfolded_steps;
  v.failure = job.fold_failure;
  v.hosts = job.hosts;
  if (options_.store != nullptr) v.state_bytes = options_.store->JobBytes(id);
  return v;
}

absl::StatusOr<JobView> JobRegistry::GetJob(const std::string& job_id) const {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  absl::ReaderMutexLock lock(&job->mu);
  if (absl::Status s = LiveOrNotFound(job_id, *job); !s.ok()) return s;
  return View(job_id, *job);
}

std::vector<JobView> JobRegistry::ListJobs(const std::string& after, int limit) const {
  // Live and failed jobs merged in id order.
  std::vector<std::pair<std::string, std::shared_ptr<Job>>> page;
  std::map<std::string, std::string> failed;
  {
    absl::MutexLock lock(&mu_);
    auto live = jobs_.upper_bound(after);
    auto dead = failed_.upper_bound(after);
    while (static_cast<int>(page.size()) < limit &&
           (live != jobs_.end() || dead != failed_.end())) {
      if (dead == failed_.end() || (live != jobs_.end() && live->first < dead->first)) {
        page.emplace_back(live->first, live->second);
        ++live;
      } else {
        page.emplace_back(dead->first, nullptr);
        failed[dead->first] = dead->second.reason;
        ++dead;
      }
    }
  }
  std::vector<JobView> out;
  for (const auto& [id, job] : page) {
    if (job == nullptr) {
      JobView v;
      v.job_id = id;
      v.failed = true;
      v.failure = failed[id];
      out.push_back(std::move(v));
      continue;
    }
    absl::ReaderMutexLock lock(&job->mu);
    if (job->deleted.load(std::memory_order_relaxed)) continue;
    out.push_back(View(id, *job));
  }
  return out;
}

int JobRegistry::job_count() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(jobs_.size());
}

std::vector<std::string> JobRegistry::job_ids() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids;
  ids.reserve(jobs_.size());
  for (const auto& [id, job] : jobs_) ids.push_back(id);
  return ids;
}

void JobRegistry::PackHistory(const std::string& job_id) {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return;
  absl::MutexLock lock(&job->mu);
  PackOldSteps(*job);
}

int JobRegistry::PackedSteps(const std::string& job_id) const {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return 0;
  absl::MutexLock lock(&job->mu);
  int packed = 0;
  for (const auto& [step, record] : job->history) packed += record.is_packed() ? 1 : 0;
  return packed;
}

int64_t JobRegistry::PackedBytes(const std::string& job_id) const {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return 0;
  absl::MutexLock lock(&job->mu);
  int64_t bytes = 0;
  for (const auto& [step, record] : job->history) {
    if (record.is_packed()) bytes += static_cast<int64_t>(record.packed.size());
  }
  return bytes;
}

absl::Status JobRegistry::DeleteJob(const std::string& job_id) {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) {
    absl::MutexLock lock(&mu_);
    if (failed_.count(job_id) == 0) return NotFound(job_id);
    if (options_.store != nullptr) {
      if (absl::Status s = Stored(options_.store->DeleteQuarantined(job_id)); !s.ok()) return s;
    }
    failed_.erase(job_id);
    return absl::OkStatus();
  }
  return DeleteLiveJob(job_id, job, nullptr);
}

int64_t JobRegistry::NowNanos() const {
  const std::chrono::steady_clock::time_point now =
      options_.now ? options_.now() : std::chrono::steady_clock::now();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count();
}

std::vector<std::string> JobRegistry::ExpireIdleJobs(std::chrono::nanoseconds ttl) {
  const int64_t idle_before = NowNanos() - ttl.count();
  std::vector<std::pair<std::string, std::shared_ptr<Job>>> idle;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) {
      if (job->last_active_ns.load(std::memory_order_relaxed) < idle_before) {
        idle.emplace_back(id, job);
      }
    }
  }
  std::vector<std::string> expired;
  for (const auto& [id, job] : idle) {
    // Not deleted: called meanwhile, already deleted, or the store failed (reported through
    // on_store_failure; the next sweep tries again).
    if (!DeleteLiveJob(id, job, &idle_before).ok()) continue;
    expired.push_back(id);
    absl::MutexLock lock(&mu_);
    if (expired_.insert(id).second) expired_order_.push_back(id);
    if (expired_order_.size() > kMaxExpiredIds) {
      expired_.erase(expired_order_.front());
      expired_order_.pop_front();
    }
  }
  return expired;
}

absl::Status JobRegistry::DeleteLiveJob(const std::string& job_id, const std::shared_ptr<Job>& job,
                                        const int64_t* idle_before_ns) {
  std::map<int64_t, StepRecord> doomed;  // freed after the lock is released
  {
    absl::MutexLock lock(&job->mu);
    if (absl::Status s = LiveOrNotFound(job_id, *job); !s.ok()) return s;
    if (idle_before_ns != nullptr &&
        job->last_active_ns.load(std::memory_order_relaxed) >= *idle_before_ns) {
      return absl::FailedPreconditionError(
          absl::StrCat("job \"", job_id, "\" was called while it expired; kept"));
    }
    // The folder is renamed away atomically, so a restart never loads it again; then no writer
    // can reach it: every one checks `deleted` under this lock first.
    if (options_.store != nullptr) {
      if (absl::Status s = Stored(options_.store->RetireJob(job_id)); !s.ok()) return s;
    }
    job->deleted.store(true, std::memory_order_release);
    doomed.swap(job->history);
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it != jobs_.end() && it->second == job) jobs_.erase(it);
  }
  RetireToken(job->token);
  // Thousands of step files: removed with no lock held, so no other call waits for them.
  if (options_.store != nullptr) options_.store->RemoveRetired(job_id);
  return absl::OkStatus();
}

}  // namespace sparsebalance
