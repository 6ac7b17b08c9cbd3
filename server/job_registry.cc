#include "server/job_registry.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/arena.h"
#include "planner/planner.h"
#include "planner/profile_table.h"

namespace sparsebalance {
namespace {

constexpr int kJobIdHexChars = 16;
constexpr int kTokenHexChars = 64;  // 256 bits

absl::Status NotFound(const std::string& job_id) {
  return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" does not exist"));
}

template <typename T>
void Append(std::string* out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out->append(bytes, sizeof(T));
}

bool Positive(double x) { return std::isfinite(x) && x > 0.0; }

state::v1::ModelState ModelToProto(const LatencyModel& model) {
  state::v1::ModelState out;
  const LatencyModelState& st = model.state();
  out.mutable_weights()->Assign(st.weights.begin(), st.weights.end());
  out.mutable_covariance()->Assign(st.covariance.begin(), st.covariance.end());
  out.mutable_speed_factors()->Assign(st.speed_factors.begin(), st.speed_factors.end());
  out.set_rank_error_variance(st.rank_error_variance);
  out.set_steps_observed(st.steps_observed);
  const CostCoefficients& p = model.prior();
  for (double c : {p.per_block, p.per_token, p.per_sample, p.per_micro_batch}) out.add_prior(c);
  return out;
}

absl::StatusOr<LatencyModel> ModelFromProto(const state::v1::ModelState& in,
                                            const PlannerConfig& config) {
  if (in.weights_size() != 4 || in.covariance_size() != 16 || in.prior_size() != 4 ||
      in.speed_factors_size() != config.ranks) {
    return absl::DataLossError("state: a job's model snapshot has the wrong shape");
  }
  LatencyModel model(config.shape, config.ranks,
                     CostCoefficients{in.prior(0), in.prior(1), in.prior(2), in.prior(3)});
  LatencyModelState st;
  std::copy(in.weights().begin(), in.weights().end(), st.weights.begin());
  std::copy(in.covariance().begin(), in.covariance().end(), st.covariance.begin());
  st.speed_factors.assign(in.speed_factors().begin(), in.speed_factors().end());
  st.rank_error_variance = in.rank_error_variance();
  st.steps_observed = in.steps_observed();
  model.set_state(st);
  return model;
}

StepPlan StepPlanFromProto(const state::v1::StepRecord& in) {
  StepPlan plan;
  for (const v1::RankPlan& r : in.ranks()) {
    RankPlan rank;
    rank.predicted_seconds = r.predicted_seconds();
    for (const v1::MicroBatch& m : r.micro_batches()) {
      rank.micro_batches.push_back(MicroBatchFromProto(m));
    }
    plan.ranks.push_back(std::move(rank));
  }
  if (in.ranks_size() > 0) {
    const v1::RankPlan& first = in.ranks(0);
    absl::StatusOr<Policy> policy = PolicyFromProto(first.policy(), "policy");
    plan.policy = policy.ok() ? *policy : Policy::kSparseBalance;
    const v1::PlanFigures& f = first.figures();
    plan.makespan_seconds = f.makespan_seconds();
    plan.lower_bound_seconds = f.lower_bound_seconds();
    plan.gap = f.gap();
    plan.imbalance_ratio = f.imbalance_ratio();
    plan.bubble_ratio = f.bubble_ratio();
    plan.mean_density = f.mean_density();
    plan.predicted_recall = f.predicted_recall();
    plan.planned_locally = first.planned_locally();
  }
  plan.deferred_ids.assign(in.deferred_ids().begin(), in.deferred_ids().end());
  return plan;
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

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  // The length of a token is not secret; its bytes are.
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  }
  return diff == 0;
}

JobRegistry::JobRegistry(Options options, std::function<std::string(int)> random_hex)
    : options_(std::move(options)), random_hex_(std::move(random_hex)) {}

std::shared_ptr<JobRegistry::Job> JobRegistry::Find(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : it->second;
}

absl::Status JobRegistry::SaveJob(const std::string& id, const Job& job, bool sync,
                                  bool create) const {
  if (options_.store == nullptr) return absl::OkStatus();
  state::v1::JobSnapshot snapshot;
  snapshot.set_job_id(id);
  snapshot.set_name(job.name);
  snapshot.set_token(job.token);
  *snapshot.mutable_config() = ConfigToProto(job.settings);
  *snapshot.mutable_model() = ModelToProto(job.model);
  snapshot.set_next_step(job.next_step);
  for (bool joined : job.joined) snapshot.add_joined(joined);
  for (const auto& [step, record] : job.history) {
    if (record.folded) snapshot.add_folded_steps(step);
  }
  return create ? options_.store->CreateJob(snapshot) : options_.store->SaveJob(snapshot, sync);
}

absl::Status JobRegistry::SaveStep(const std::string& id, int64_t step,
                                   const StepRecord& record) const {
  if (options_.store == nullptr) return absl::OkStatus();
  // On an arena: a step of 16,384 samples is some 50,000 small messages.
  google::protobuf::Arena arena;
  auto* out = google::protobuf::Arena::CreateMessage<state::v1::StepRecord>(&arena);
  out->set_step(step);
  for (const Sample& s : record.batch) SampleToProto(s, out->add_batch());
  for (int r = 0; r < static_cast<int>(record.plan->ranks.size()); ++r) {
    RankPlanToProto(*record.plan, step, r, out->add_ranks());
  }
  out->mutable_deferred_ids()->Assign(record.plan->deferred_ids.begin(),
                                      record.plan->deferred_ids.end());
  out->set_folded(record.folded);
  return options_.store->SaveStep(id, *out);
}

absl::Status JobRegistry::Restore() {
  if (options_.store == nullptr) return absl::OkStatus();
  absl::StatusOr<PlanStore::Loaded> loaded = options_.store->LoadAll();
  if (!loaded.ok()) return loaded.status();
  WireLimits relaxed = options_.limits;
  relaxed.max_world_size = std::max(relaxed.max_world_size, 1 << 30);
  for (PlanStore::LoadedJob& l : loaded->jobs) {
    const std::string& id = l.job_id;
    absl::StatusOr<JobSettings> settings = ConfigFromProto(l.job.config(), relaxed);
    if (!settings.ok()) {
      return absl::DataLossError(
          absl::StrCat("state: job ", id, ": ", settings.status().message()));
    }
    absl::StatusOr<LatencyModel> model = ModelFromProto(l.job.model(), settings->planner);
    if (!model.ok()) return model.status();
    auto job = std::make_shared<Job>(*settings, model->prior());
    absl::MutexLock job_lock(&job->mu);
    job->model = *model;
    job->name = l.job.name();
    job->token = l.job.token();
    job->joined.assign(settings->planner.ranks, false);
    for (int r = 0; r < l.job.joined_size() && r < settings->planner.ranks; ++r) {
      job->joined[r] = l.job.joined(r);
    }
    job->next_step = l.job.next_step();
    for (PlanStore::LoadedStep& step : l.steps) {
      StepRecord record;
      for (const v1::Sample& s : step.record.batch()) {
        record.batch.push_back(Sample{s.id(),
                                      s.length(),
                                      s.sensitivity(),
                                      s.group(),
                                      {s.segments().begin(), s.segments().end()}});
      }
      record.batch_fingerprint = BatchFingerprint(record.batch);
      record.plan = std::make_shared<const StepPlan>(StepPlanFromProto(step.record));
      record.folded = step.record.folded() ||
                      std::find(l.job.folded_steps().begin(), l.job.folded_steps().end(),
                                step.record.step()) != l.job.folded_steps().end();
      for (const state::v1::ReportRecord& report : step.reports) {
        std::vector<MicroBatchTiming>& measured = record.reports[report.rank()];
        for (const v1::MicroBatchReport& m : report.micro_batches()) {
          measured.push_back(TimingFromProto(m));
        }
        record.waits[report.rank()] = report.wait_seconds();
      }
      // A step record written just before a crash that kept the snapshot from landing.
      job->next_step = std::max(job->next_step, step.record.step() + 1);
      job->history[step.record.step()] = std::move(record);
    }
    // Steps whose last report landed but whose fold's snapshot did not (a crash in between).
    for (auto& [step, record] : job->history) {
      if (!record.folded && static_cast<int>(record.reports.size()) == settings->planner.ranks) {
        if (absl::Status s = Fold(id, *job, step, record); !s.ok()) return s;
      }
    }
    absl::MutexLock lock(&mu_);
    jobs_[id] = job;
  }
  return absl::OkStatus();
}

absl::StatusOr<CreatedJob> JobRegistry::CreateJob(const std::string& name,
                                                  const JobSettings& settings,
                                                  const std::string& profile) {
  if (name.size() > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: ", name.size(), " characters; at most 64"));
  }
  if (absl::Status s = ValidateConfig(settings.planner); !s.ok()) return s;
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
  auto job = std::make_shared<Job>(settings, prior);
  job->name = name;
  job->token = random_hex_(kTokenHexChars);
  {
    absl::MutexLock job_lock(&job->mu);
    job->joined.assign(settings.planner.ranks, false);
  }
  absl::MutexLock lock(&mu_);
  if (static_cast<int>(jobs_.size()) >= options_.max_jobs) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this planner holds ", jobs_.size(), " jobs, its limit; delete finished jobs first"));
  }
  std::string id;
  do {
    id = random_hex_(kJobIdHexChars);
  } while (jobs_.count(id) > 0);
  {
    absl::ReaderMutexLock job_lock(&job->mu);
    if (absl::Status s = SaveJob(id, *job, /*sync=*/true, /*create=*/true); !s.ok()) return s;
  }
  jobs_[id] = job;
  return CreatedJob{id, job->token, settings};
}

absl::Status JobRegistry::Authorize(const std::string& job_id, const std::string& token) const {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  if (token.empty()) {
    return absl::UnauthenticatedError(
        "no job token: send the token CreateJob returned as \"authorization: Bearer <token>\"");
  }
  if (!ConstantTimeEquals(token, job->token)) {
    return absl::PermissionDeniedError(absl::StrCat("the token is not job ", job_id, "'s"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::pair<JobSettings, int64_t>> JobRegistry::JoinJob(const std::string& job_id,
                                                                     int rank,
                                                                     int64_t* rank_next_step) {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  absl::MutexLock lock(&job->mu);
  if (rank < 0 || rank >= job->settings.planner.ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank: ", rank, " is outside [0, ", job->settings.planner.ranks, ") of job ", job_id));
  }
  if (!job->joined[rank]) {
    job->joined[rank] = true;
    if (absl::Status s = SaveJob(job_id, *job); !s.ok()) {
      job->joined[rank] = false;
      return s;
    }
  }
  if (rank_next_step != nullptr) {
    *rank_next_step = job->next_step;
    for (const auto& [step, record] : job->history) {
      if (record.reports.count(rank) == 0) {
        *rank_next_step = step;
        break;
      }
    }
  }
  return std::make_pair(job->settings, job->next_step);
}

absl::StatusOr<SubmitResult> JobRegistry::SubmitBatch(const std::string& job_id, int64_t step,
                                                      const std::vector<Sample>& batch,
                                                      bool planned_locally) {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  absl::MutexLock lock(&job->mu);
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("step: ", step, " is negative"));
  if (step < job->next_step) {
    auto it = job->history.find(step);
    if (it == job->history.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", step, " was planned but is older than the ", job->settings.history_steps,
          " steps kept; the next step is ", job->next_step));
    }
    StepRecord& record = it->second;
    if (record.batch_fingerprint != BatchFingerprint(batch)) {
      return absl::AlreadyExistsError(
          absl::StrCat("step ", step, " was planned with a different batch; submit step ",
                       job->next_step, " next"));
    }
    SubmitResult result{step, {}, {}, true};
    if (planned_locally && !record.plan->planned_locally) {
      if (absl::Status s = SwitchToLocal(job_id, *job, step, record); !s.ok()) return s;
      result.switched_to_local = true;
    }
    result.deferred_ids = record.plan->deferred_ids;
    result.plan = *record.plan;
    return result;
  }
  if (step > job->next_step && !planned_locally) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, " is out of order: job ", job_id, " plans step ", job->next_step,
        " next (a trainer that ran steps on local plans submits with planned_locally)"));
  }
  absl::StatusOr<StepPlan> plan = planned_locally
                                      ? PlanStepLocally(batch, job->settings.planner)
                                      : PlanStep(batch, job->settings.planner, job->model);
  if (!plan.ok()) return plan.status();
  const int64_t skipped = step - job->next_step;
  StepRecord record;
  record.batch_fingerprint = BatchFingerprint(batch);
  record.batch = batch;
  record.plan = std::make_shared<const StepPlan>(*plan);
  // Durable before it is acknowledged: the step record (fsync'ed). The snapshot after it only
  // moves next_step, which Restore also takes from the step records, so it is not synced.
  if (absl::Status s = SaveStep(job_id, step, record); !s.ok()) return s;
  job->history[step] = std::move(record);
  job->next_step = step + 1;
  while (static_cast<int>(job->history.size()) > job->settings.history_steps) {
    const int64_t dropped = job->history.begin()->first;
    job->history.erase(job->history.begin());
    if (options_.store != nullptr) options_.store->DropStep(job_id, dropped).IgnoreError();
  }
  if (absl::Status s = SaveJob(job_id, *job, /*sync=*/false); !s.ok()) return s;
  SubmitResult result{step, plan->deferred_ids, *std::move(plan), false};
  result.skipped_steps = skipped;
  return result;
}

absl::Status JobRegistry::SwitchToLocal(const std::string& id, const Job& job, int64_t step,
                                        StepRecord& record) const {
  if (!record.reports.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step,
                     " already has reports against the planner's plan; its ranks must all "
                     "run one plan"));
  }
  absl::StatusOr<StepPlan> local = PlanStepLocally(record.batch, job.settings.planner);
  if (!local.ok()) return local.status();
  StepRecord updated = record;
  updated.plan = std::make_shared<const StepPlan>(*std::move(local));
  if (absl::Status s = SaveStep(id, step, updated); !s.ok()) return s;
  record = std::move(updated);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const StepPlan>> JobRegistry::GetPlan(const std::string& job_id,
                                                                     int64_t step, int rank,
                                                                     bool* ready) const {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  absl::MutexLock lock(&job->mu);
  if (rank < 0 || rank >= job->settings.planner.ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", rank, " is outside [0, ", job->settings.planner.ranks, ")"));
  }
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("step: ", step, " is negative"));
  *ready = false;
  if (step >= job->next_step) return std::shared_ptr<const StepPlan>();
  auto it = job->history.find(step);
  if (it == job->history.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, " is older than the steps kept; the next step is ", job->next_step));
  }
  *ready = true;
  return it->second.plan;
}

absl::StatusOr<bool> JobRegistry::ReportStep(const std::string& job_id, int64_t step, int rank,
                                             const std::vector<MicroBatchTiming>& micro_batches,
                                             double wait_seconds, bool planned_locally) {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  absl::MutexLock lock(&job->mu);
  const PlannerConfig& config = job->settings.planner;
  if (rank < 0 || rank >= config.ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", rank, " is outside [0, ", config.ranks, ")"));
  }
  if (!job->joined[rank]) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " has not joined job ", job_id, "; call JoinJob first"));
  }
  auto it = job->history.find(step);
  if (it == job->history.end()) {
    return absl::FailedPreconditionError(
        step >= job->next_step
            ? absl::StrCat("step ", step, " has not been planned; the next step is ",
                           job->next_step)
            : absl::StrCat("step ", step, " is older than the steps kept"));
  }
  StepRecord& record = it->second;
  if (record.reports.count(rank) > 0) return true;  // a repeat changes nothing
  if (planned_locally != record.plan->planned_locally) {
    if (!planned_locally || !record.reports.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "planned_locally: rank ", rank, " ran the ", planned_locally ? "local" : "planner's",
          " plan of step ", step, " but the step's other ranks ran the ",
          planned_locally ? "planner's" : "local", " one; all ranks of a step must run one plan"));
    }
    if (absl::Status s = SwitchToLocal(job_id, *job, step, record); !s.ok()) return s;
  }
  if (!std::isfinite(wait_seconds) || wait_seconds < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("wait_seconds: ", wait_seconds, " is not a finite number >= 0"));
  }
  const std::vector<MicroBatchPlan>& planned = record.plan->ranks[rank].micro_batches;
  std::vector<bool> seen(planned.size(), false);
  for (size_t k = 0; k < micro_batches.size(); ++k) {
    const MicroBatchTiming& m = micro_batches[k];
    const std::string where = absl::StrCat("micro_batches[", k, "]");
    if (m.micro_batch < 0 || m.micro_batch >= static_cast<int>(planned.size())) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".micro_batch: ", m.micro_batch,
                                                     " is outside [0, ", planned.size(), ")"));
    }
    if (seen[m.micro_batch]) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".micro_batch: ", m.micro_batch, " is reported twice"));
    }
    seen[m.micro_batch] = true;
    if (planned[m.micro_batch].sample_ids.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".micro_batch: ", m.micro_batch,
                                                     " was planned empty; do not report it"));
    }
    if (!Positive(m.compute_seconds)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".compute_seconds: ", m.compute_seconds,
                                                     " is not a positive finite number"));
    }
    if (!std::isfinite(m.attention_seconds) || m.attention_seconds < 0 ||
        m.attention_seconds > m.compute_seconds) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".attention_seconds: ", m.attention_seconds, " is not in [0, compute_seconds]"));
    }
    if (!(m.recall >= 0.0 && m.recall <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".recall: ", m.recall, " is outside [0, 1]"));
    }
    if (!(m.achieved_density >= 0.0 && m.achieved_density <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".achieved_density: ", m.achieved_density, " is outside [0, 1]"));
    }
    if (m.tokens != planned[m.micro_batch].tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".tokens: ", m.tokens, " but the plan has ", planned[m.micro_batch].tokens));
    }
  }
  if (options_.store != nullptr) {
    state::v1::ReportRecord out;
    out.set_rank(rank);
    out.set_wait_seconds(wait_seconds);
    for (const MicroBatchTiming& m : micro_batches) TimingToProto(m, out.add_micro_batches());
    if (absl::Status s = options_.store->AppendReport(job_id, step, out); !s.ok()) return s;
  }
  record.reports[rank] = micro_batches;
  record.waits[rank] = wait_seconds;
  if (static_cast<int>(record.reports.size()) == config.ranks && !record.folded) {
    if (absl::Status s = Fold(job_id, *job, step, record); !s.ok()) return s;
  }
  return false;
}

absl::Status JobRegistry::Fold(const std::string& id, Job& job, int64_t step, StepRecord& record) {
  std::map<uint64_t, const Sample*> by_id;
  for (const Sample& s : record.batch) by_id[s.id] = &s;
  std::vector<Observation> observations;
  for (const auto& [rank, reports] : record.reports) {
    for (const MicroBatchTiming& m : reports) {
      const MicroBatchPlan& mb = record.plan->ranks[rank].micro_batches[m.micro_batch];
      Observation o;
      o.rank = rank;
      o.micro_batch = m.micro_batch;
      for (size_t k = 0; k < mb.sample_ids.size(); ++k) {
        const MicroBatchFeatures f =
            job.model.SampleFeatures(*by_id[mb.sample_ids[k]], mb.densities[k]);
        o.features.active_blocks += f.active_blocks;
        o.features.tokens += f.tokens;
        o.features.documents += f.documents;
      }
      o.measured_seconds = m.compute_seconds;
      observations.push_back(o);
    }
  }
  record.folded = true;
  if (absl::Status s = job.model.ObserveStep(std::move(observations)); !s.ok()) return s;
  if (options_.on_step) {
    StepStats stats;
    stats.step = step;
    stats.policy = record.plan->policy;
    stats.planned_makespan_seconds = record.plan->makespan_seconds;
    for (const auto& [rank, reports] : record.reports) {
      double seconds = 0.0;
      for (const MicroBatchTiming& m : reports) {
        seconds += m.compute_seconds;
        stats.densities.push_back(m.achieved_density);
        stats.recalls.push_back(m.recall);
      }
      stats.rank_seconds.push_back(seconds);
      stats.predicted_rank_seconds.push_back(record.plan->ranks[rank].predicted_seconds);
      auto wait = record.waits.find(rank);
      stats.wait_seconds.push_back(wait == record.waits.end() ? 0.0 : wait->second);
    }
    stats.speed_factors = job.model.speed_factors();
    options_.on_step(id, stats);
  }
  // No snapshot here: the next SubmitBatch writes one (the model with its folded marks), and
  // until then a restart refolds this step from its report log (Restore). Writing one per
  // fold cost a file create and rename (and ext4's flush-on-rename) per step.
  return absl::OkStatus();
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
  absl::StatusOr<CostCoefficients> fitted = FitProfile(*table, job->settings.planner.shape);
  if (!fitted.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("profile: ", fitted.status().message()));
  }
  // A new prior restarts learning; the speed factors stay (they are about the ranks).
  const std::vector<double> speeds = job->model.speed_factors();
  job->model = LatencyModel(job->settings.planner.shape, job->settings.planner.ranks, *fitted);
  LatencyModelState state = job->model.state();
  state.speed_factors = speeds;
  job->model.set_state(state);
  if (absl::Status s = SaveJob(job_id, *job); !s.ok()) return s;
  return *fitted;
}

absl::StatusOr<JobSettings> JobRegistry::UpdateJobConfig(const std::string& job_id,
                                                         const JobSettings& update,
                                                         const std::vector<std::string>& fields) {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  absl::MutexLock lock(&job->mu);
  JobSettings next = job->settings;
  PlannerConfig& c = next.planner;
  const PlannerConfig& u = update.planner;
  if (fields.empty()) {
    return absl::InvalidArgumentError("update_mask: names no field; e.g. \"policy\"");
  }
  for (const std::string& field : fields) {
    if (field == "policy") {
      c.policy = u.policy;
    } else if (field == "dst_mode") {
      c.dst_mode = u.dst_mode;
    } else if (field == "dst_quantile") {
      c.dst_quantile = u.dst_quantile;
    } else if (field == "density_min") {
      c.density_min = u.density_min;
    } else if (field == "density_max") {
      c.density_max = u.density_max;
    } else if (field == "density_default") {
      c.density_default = u.density_default;
    } else if (field == "overflow") {
      c.overflow = u.overflow;
    } else if (field == "history_steps") {
      if (update.history_steps < 1 || update.history_steps > options_.limits.max_history_steps) {
        return absl::InvalidArgumentError(
            absl::StrCat("config.history_steps: ", update.history_steps, " is outside [1, ",
                         options_.limits.max_history_steps, "]"));
      }
      next.history_steps = update.history_steps;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("update_mask: \"", field,
                       "\" cannot change at run time; changeable: policy, dst_mode, dst_quantile, "
                       "density_min, density_max, density_default, overflow, history_steps"));
    }
  }
  if (absl::Status s = ValidateConfig(c); !s.ok()) return s;
  const JobSettings previous = job->settings;
  job->settings = next;
  if (absl::Status s = SaveJob(job_id, *job); !s.ok()) {
    job->settings = previous;
    return s;
  }
  while (static_cast<int>(job->history.size()) > job->settings.history_steps) {
    const int64_t dropped = job->history.begin()->first;
    job->history.erase(job->history.begin());
    if (options_.store != nullptr) options_.store->DropStep(job_id, dropped).IgnoreError();
  }
  return next;
}

JobView JobRegistry::View(const std::string& id, const Job& job) {
  JobView v;
  v.job_id = id;
  v.name = job.name;
  v.settings = job.settings;
  v.next_step = job.next_step;
  v.joined_ranks = static_cast<int>(std::count(job.joined.begin(), job.joined.end(), true));
  if (!job.history.empty()) {
    v.has_plan = true;
    v.last_plan = job.history.rbegin()->second.plan;
  }
  v.speed_factors = job.model.speed_factors();
  v.coefficients = job.model.coefficients();
  v.steps_folded = job.model.state().steps_observed;
  return v;
}

absl::StatusOr<JobView> JobRegistry::GetJob(const std::string& job_id) const {
  std::shared_ptr<Job> job = Find(job_id);
  if (job == nullptr) return NotFound(job_id);
  absl::ReaderMutexLock lock(&job->mu);
  return View(job_id, *job);
}

std::vector<JobView> JobRegistry::ListJobs(const std::string& after, int limit) const {
  std::vector<std::pair<std::string, std::shared_ptr<Job>>> page;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = jobs_.upper_bound(after);
         it != jobs_.end() && static_cast<int>(page.size()) < limit; ++it) {
      page.emplace_back(it->first, it->second);
    }
  }
  std::vector<JobView> out;
  for (const auto& [id, job] : page) {
    absl::ReaderMutexLock lock(&job->mu);
    out.push_back(View(id, *job));
  }
  return out;
}

int JobRegistry::job_count() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(jobs_.size());
}

absl::Status JobRegistry::DeleteJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  if (jobs_.count(job_id) == 0) return NotFound(job_id);
  if (options_.store != nullptr) {
    if (absl::Status s = options_.store->RetireJob(job_id); !s.ok()) return s;
    options_.store->RemoveRetired(job_id);
  }
  jobs_.erase(job_id);
  return absl::OkStatus();
}

}  // namespace sparsebalance
