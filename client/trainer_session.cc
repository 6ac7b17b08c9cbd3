#include "client/trainer_session.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "planner/planner.h"
#include "proto/wire.h"

namespace sparsebalance {
namespace {

// Whether Plan runs the local plan on `error` from a plan call (SubmitBatch, GetRankPlan(s)):
// on every error the trainer's own input did not cause. Returning one on this rank alone would
// leave it out of the step that the other ranks, falling back, run without it. The planner
// cannot serve now (IsTransient: e.g. RESOURCE_EXHAUSTED at --max_waiting_calls, or a plan that
// failed the client's checks, INTERNAL), a stored step of it is damaged (DATA_LOSS), or it has
// no plan of this step to give (FAILED_PRECONDITION: a step out of order, skipped by a local
// steps' resubmission, or older than its history), which the coordinator then resubmits as
// planned locally, or the job is at its bound in the planner's state directory (IsJobStateQuota:
// the trainer trains on, and the planner takes its steps again once it has room). Returned:
// INVALID_ARGUMENT (the batch), ALREADY_EXISTS (another batch for a planned step), NOT_FOUND (the
// job), UNAUTHENTICATED and PERMISSION_DENIED (the token), UNIMPLEMENTED (not a planner) and
// OUT_OF_RANGE: they must be fixed.
bool PlansLocallyOn(const absl::Status& error) {
  return IsTransient(error) || IsJobStateQuota(error) ||
         error.code() == absl::StatusCode::kDataLoss ||
         error.code() == absl::StatusCode::kFailedPrecondition;
}

}  // namespace

TrainerSession::TrainerSession(PlannerClient* client, int rank, bool coordinator,
                               PlannerConfig config)
    : client_(client),
      rank_(rank),
      coordinator_(coordinator),
      config_(config),
      buffer_limit_(client == nullptr ? 1
                                      : static_cast<size_t>(
                                            std::max(1, client->options().max_buffered_reports))) {}

absl::Status TrainerSession::CheckClient() const {
  if (client_ != nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(
      "client: null; a TrainerSession plans and reports through a PlannerClient "
      "(PlannerClient::Connect)");
}

std::vector<Sample> TrainerSession::StepBatch(int64_t step, const std::vector<Sample>& batch) {
  if (step != carried_in_step_) {  // a new step: it takes what an earlier step deferred
    carried_in_ = carried_from_ < step ? carried_ : std::vector<Sample>{};
    carried_in_step_ = step;
  }
  absl::flat_hash_set<uint64_t> passed;
  for (const Sample& s : batch) passed.insert(s.id);
  std::vector<Sample> full;
  full.reserve(carried_in_.size() + batch.size());
  for (const Sample& s : carried_in_) {
    if (!passed.contains(s.id)) full.push_back(s);  // the trainer may pass it again itself
  }
  full.insert(full.end(), batch.begin(), batch.end());
  return full;
}

void TrainerSession::Carry(int64_t step, const std::vector<Sample>& full,
                           const std::vector<uint64_t>& ids) {
  if (step < carried_from_) return;  // an older step planned again: later ones came since
  const absl::flat_hash_set<uint64_t> deferred(ids.begin(), ids.end());
  carried_.clear();
  for (const Sample& s : full) {
    if (deferred.contains(s.id)) carried_.push_back(s);
  }
  carried_from_ = step;
}

void TrainerSession::Restore(int64_t next_step, std::vector<Sample> carried) {
  carried_ = std::move(carried);
  carried_from_ = next_step - 1;
  carried_in_.clear();
  carried_in_step_ = -1;
}

absl::StatusOr<RankStepPlan> TrainerSession::LocalPlan(int64_t step,
                                                       const std::vector<Sample>& batch) {
  return PlanLocally(step, StepBatch(step, batch));
}

absl::StatusOr<RankStepPlan> TrainerSession::PlanLocally(int64_t step,
                                                         const std::vector<Sample>& batch) {
  absl::StatusOr<StepPlan> plan = PlanStepLocally(batch, config_);
  if (!plan.ok()) return plan.status();
  if (rank_ < 0 || rank_ >= static_cast<int>(plan->ranks.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", rank_, " is outside [0, ", plan->ranks.size(), ")"));
  }
  if (local_steps_.empty() || local_steps_.back() < step) {
    local_steps_.push_back(step);
    if (coordinator_) local_batches_.emplace_back(step, batch);
  }
  while (local_steps_.size() > buffer_limit_) local_steps_.pop_front();
  // The newest stays: the planner needs at least one local step to move past the gap.
  while (local_batches_.size() > buffer_limit_) local_batches_.pop_front();
  RankStepPlan out;
  out.step = step;
  out.rank = rank_;
  out.micro_batches = plan->ranks[rank_].micro_batches;
  out.predicted_seconds = plan->ranks[rank_].predicted_seconds;
  out.predicted_makespan_seconds = plan->makespan_seconds;
  out.local_fallback = true;
  out.deferred_ids = plan->deferred_ids;
  Carry(step, batch, out.deferred_ids);
  return out;
}

absl::Status TrainerSession::ResubmitLocalSteps() {
  while (!local_batches_.empty()) {
    const auto& [step, batch] = local_batches_.front();
    absl::StatusOr<std::vector<uint64_t>> sent =
        client_->SubmitBatch(step, batch, /*planned_locally=*/true);
    // Away, busy or failing inside (IsTransient): the batch stays for the next step's try, as a
    // report refused for such a reason does (the bounded queue drops the oldest). Any other
    // answer is final (e.g. the step left the planner's history): go on without it.
    if (!sent.ok() && IsTransient(sent.status())) return sent.status();
    // The job at its bound in the planner's state directory: every queued batch would be refused
    // alike, now and at every later try until someone makes room. They go, and the refusal is
    // returned so that Plan falls back without a SubmitBatch of its own step: one refused call a
    // step, not one per queued batch. Once the planner has room, the next step's resubmitted
    // batch (planned_locally) moves it past the steps it never saw.
    if (!sent.ok() && IsJobStateQuota(sent.status())) {
      local_batches_.clear();
      return sent.status();
    }
    local_batches_.pop_front();
  }
  return absl::OkStatus();
}

absl::StatusOr<RankStepPlan> TrainerSession::Plan(int64_t step, const std::vector<Sample>& batch) {
  return Plan(step, batch, {}, nullptr);
}

absl::StatusOr<RankStepPlan> TrainerSession::Plan(int64_t step, const std::vector<Sample>& batch,
                                                  const std::vector<int>& group,
                                                  std::vector<std::string>* encoded) {
  if (encoded != nullptr) encoded->clear();
  if (absl::Status s = CheckClient(); !s.ok()) return s;
  const auto me = std::find(group.begin(), group.end(), rank_);
  if (!group.empty() && me == group.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("group: it does not hold this rank (", rank_, ")"));
  }
  const std::vector<Sample> full = StepBatch(step, batch);
  auto fall_back = [&](absl::Status reason) {
    fallback_reason_ = std::move(reason);
    return PlanLocally(step, full);
  };
  if (coordinator_) {
    if (absl::Status s = ResubmitLocalSteps(); !s.ok()) return fall_back(s);
    absl::StatusOr<std::vector<uint64_t>> submitted = client_->SubmitBatch(step, full);
    if (!submitted.ok()) {
      if (PlansLocallyOn(submitted.status())) return fall_back(submitted.status());
      return submitted.status();
    }
  }
  const int block_size = config_.shape.block_size;
  absl::StatusOr<RankStepPlan> plan = absl::UnknownError("not fetched");
  if (!group.empty() && !groups_refused_) {
    std::vector<std::string> parts;
    absl::StatusOr<std::vector<RankStepPlan>> plans =
        client_->GetRankPlans(step, group, config_.ranks, block_size, &parts);
    if (plans.ok()) {
      plan = std::move((*plans)[me - group.begin()]);
      if (encoded != nullptr) *encoded = std::move(parts);
    } else if (plans.status().code() == absl::StatusCode::kUnimplemented) {
      groups_refused_ = true;  // an older planner: every rank fetches its own
    } else {
      plan = plans.status();
    }
  }
  if (group.empty() || groups_refused_) {
    plan = client_->GetRankPlan(step, rank_, config_.ranks, block_size);
  }
  if (!plan.ok() && PlansLocallyOn(plan.status())) return fall_back(plan.status());
  if (!plan.ok()) return plan;
  return Take(step, full, *std::move(plan));
}

absl::StatusOr<RankStepPlan> TrainerSession::Adopt(int64_t step, const std::vector<Sample>& batch,
                                                   const std::string& encoded) {
  absl::StatusOr<RankStepPlan> plan =
      DecodeRankStepPlan(encoded, config_.ranks, config_.shape.block_size);
  if (!plan.ok()) return plan.status();
  if (plan->step != step || plan->rank != rank_) {
    return absl::InvalidArgumentError(absl::StrCat("plan: it is step ", plan->step, " of rank ",
                                                   plan->rank, ", not step ", step, " of rank ",
                                                   rank_));
  }
  return Take(step, StepBatch(step, batch), *std::move(plan));
}

absl::StatusOr<RankStepPlan> TrainerSession::Take(int64_t step, const std::vector<Sample>& full,
                                                  RankStepPlan plan) {
  fallback_reason_ = absl::OkStatus();
  // An older planner's plan has ids and densities only: its lengths and segments come from the
  // batch (and a newer one's must agree with it). Then what the rank would otherwise train
  // wrongly without a word: a sample twice, a deferred one too, too many tokens.
  const SamplesById by_id = IndexSamplesById(full);
  absl::Status fits = CompletePlannedSamples(by_id, &plan.micro_batches);
  if (fits.ok()) fits = CheckRankPlan(by_id, plan.micro_batches, plan.deferred_ids, config_);
  if (!fits.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the planner's plan of step ", step,
                     " does not fit the batch or the job's config: ", fits.message()));
  }
  last_planner_step_ = std::max(last_planner_step_, step);
  Carry(step, full, plan.deferred_ids);
  if (plan.local_fallback) {
    local_steps_.push_back(step);  // the step was switched to the local plan: report it so
    while (local_steps_.size() > buffer_limit_) local_steps_.pop_front();
  }
  return plan;
}

absl::Status TrainerSession::FlushBatches() {
  constexpr size_t kMaxBatch = 1024;  // kMaxBatchReports (proto/wire.h)
  while (pending_.size() >= 2 && !batches_refused_) {
    const size_t count = std::min(pending_.size(), kMaxBatch);
    const std::vector<RankStepReport> batch(pending_.begin(), pending_.begin() + count);
    absl::StatusOr<std::vector<bool>> sent = client_->ReportStepBatch(batch);
    if (!sent.ok()) {
      if (IsUnreachable(sent.status())) return sent.status();
      // An older planner: every later report goes by its own call.
      if (sent.status().code() == absl::StatusCode::kUnimplemented) batches_refused_ = true;
      return absl::OkStatus();
    }
    pending_.erase(pending_.begin(), pending_.begin() + count);
  }
  return absl::OkStatus();
}

absl::Status TrainerSession::FlushPending() {
  if (absl::Status s = FlushBatches(); !s.ok()) return s;
  absl::Status dropped;
  while (!pending_.empty()) {
    const RankStepReport& r = pending_.front();
    absl::StatusOr<bool> sent =
        client_->ReportStep(r.step, r.rank, r.micro_batches, r.wait_seconds, r.planned_locally);
    // The planner away, busy or failing for now: this report and the ones after it wait.
    if (!sent.ok() && IsTransient(sent.status())) return sent.status();
    // A locally planned step the coordinator has not resubmitted yet: the planner learns of it
    // before it plans any later step, so wait while this rank has no later planner's plan.
    if (!sent.ok() && sent.status().code() == absl::StatusCode::kFailedPrecondition &&
        r.step > last_planner_step_) {
      return absl::OkStatus();
    }
    // Anything else refuses the report itself (INVALID_ARGUMENT, ALREADY_EXISTS; the step left
    // the planner's history, or a step the planner skipped) or will be refused again when sent
    // again (the job at its bound in the planner's state directory, IsJobStateQuota): drop it,
    // say so, and go on.
    if (!sent.ok()) {
      ++dropped_reports_;
      if (dropped.ok()) {
        // With the refusal's reason (WithMessage): a report dropped at the job's bound must not
        // read as the planner being busy (IsTransient) to the caller.
        dropped = WithMessage(
            sent.status(),
            absl::StrCat(r.rank == rank_ ? "" : absl::StrCat("rank ", r.rank, "'s "),
                         "report of step ", r.step, " dropped: ", sent.status().message()));
      }
    }
    pending_.pop_front();
  }
  return dropped;
}

absl::Status TrainerSession::Flush() {
  if (absl::Status s = CheckClient(); !s.ok()) return s;
  absl::Status resubmitted;
  if (coordinator_) {
    resubmitted = ResubmitLocalSteps();
    // Refused at the job's bound, the batches are dropped: the reports go on (those that fit).
    if (!resubmitted.ok() && !IsJobStateQuota(resubmitted)) return resubmitted;
  }
  absl::Status flushed = FlushPending();
  return flushed.ok() ? resubmitted : flushed;
}

absl::Status TrainerSession::Report(int64_t step,
                                    const std::vector<MicroBatchTiming>& micro_batches,
                                    double wait_seconds) {
  RankStepReport report;
  report.step = step;
  report.rank = rank_;
  report.micro_batches = micro_batches;
  report.wait_seconds = wait_seconds;
  std::vector<RankStepReport> reports;
  reports.push_back(std::move(report));
  return Report(std::move(reports));
}

absl::Status TrainerSession::Report(std::vector<RankStepReport> reports) {
  if (absl::Status s = CheckClient(); !s.ok()) return s;
  for (RankStepReport& report : reports) {
    report.planned_locally =
        std::find(local_steps_.begin(), local_steps_.end(), report.step) != local_steps_.end();
    pending_.push_back(std::move(report));
  }
  while (pending_.size() > buffer_limit_) {
    pending_.pop_front();
    ++dropped_reports_;
  }
  absl::Status flushed = FlushPending();
  // The planner being away or busy is not the trainer's problem: the reports wait for it.
  return IsTransient(flushed) ? absl::OkStatus() : flushed;
}

}  // namespace sparsebalance
