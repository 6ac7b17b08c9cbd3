#include "server/state_codec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/wire.h"

namespace sparsebalance {
namespace {

bool AllFinite(const google::protobuf::RepeatedField<double>& values) {
  return std::all_of(values.begin(), values.end(), [](double v) { return std::isfinite(v); });
}

// A stored job keeps working under any flags: its config is checked for validity, never
// against this planner's limits on new requests.
WireLimits StoredLimits() {
  WireLimits limits;
  limits.max_world_size = std::numeric_limits<int>::max();
  limits.max_history_steps = std::numeric_limits<int>::max();
  return limits;
}

state::v1::ModelState EncodeModel(const LatencyModelState& st, const CostCoefficients& p) {
  state::v1::ModelState out;
  out.mutable_weights()->Assign(st.weights.begin(), st.weights.end());
  out.mutable_covariance()->Assign(st.covariance.begin(), st.covariance.end());
  out.mutable_speed_factors()->Assign(st.speed_factors.begin(), st.speed_factors.end());
  out.set_rank_error_variance(st.rank_error_variance);
  out.set_steps_observed(st.steps_observed);
  for (double c : {p.per_block, p.per_token, p.per_sample, p.per_micro_batch}) out.add_prior(c);
  out.set_exchange_u(st.exchange_u);
  out.set_exchange_uu(st.exchange_uu);
  return out;
}

// The model of a job of `ranks` ranks; DATA_LOSS when its sizes are not the job's or a value is
// not finite (speed factors: not positive).
absl::Status DecodeModel(const state::v1::ModelState& in, int ranks, StoredJob* out) {
  if (in.weights_size() != 4 || in.covariance_size() != 16 || in.prior_size() != 4 ||
      in.speed_factors_size() != ranks) {
    return absl::DataLossError(
        absl::StrCat("job.pb model: ", in.weights_size(), " weights, ", in.covariance_size(),
                     " covariance entries, ", in.prior_size(), " prior coefficients and ",
                     in.speed_factors_size(), " speed factors; want 4, 16, 4 and ", ranks));
  }
  if (!AllFinite(in.weights()) || !AllFinite(in.covariance()) || !AllFinite(in.prior()) ||
      !std::isfinite(in.rank_error_variance()) || in.rank_error_variance() < 0 ||
      in.steps_observed() < 0) {
    return absl::DataLossError(
        "job.pb model: a weight, covariance, prior or error value is not "
        "finite (or negative)");
  }
  for (int r = 0; r < in.speed_factors_size(); ++r) {
    if (!(std::isfinite(in.speed_factors(r)) && in.speed_factors(r) > 0.0)) {
      return absl::DataLossError(absl::StrCat("job.pb model: speed_factors[", r, "] = ",
                                              in.speed_factors(r), " is not positive and finite"));
    }
  }
  // Both 0 in a snapshot of a planner older than them (LatencyModel::set_state keeps the prior).
  if (!(std::isfinite(in.exchange_u()) && in.exchange_u() >= 0 && std::isfinite(in.exchange_uu()) &&
        in.exchange_uu() >= 0)) {
    return absl::DataLossError(absl::StrCat("job.pb model: exchange sums ", in.exchange_u(), ", ",
                                            in.exchange_uu(), " are not finite and >= 0"));
  }
  for (double c : in.prior()) {
    if (!(c >= 0)) return absl::DataLossError("job.pb model: a prior coefficient is negative");
  }
  out->prior = CostCoefficients{in.prior(0), in.prior(1), in.prior(2), in.prior(3)};
  LatencyModelState& st = out->model;
  std::copy(in.weights().begin(), in.weights().end(), st.weights.begin());
  std::copy(in.covariance().begin(), in.covariance().end(), st.covariance.begin());
  st.speed_factors.assign(in.speed_factors().begin(), in.speed_factors().end());
  st.rank_error_variance = in.rank_error_variance();
  st.steps_observed = in.steps_observed();
  st.exchange_u = in.exchange_u();
  st.exchange_uu = in.exchange_uu();
  return absl::OkStatus();
}

// A recall model's state (the job snapshot's, and a per-layer step record's layer_recall).
void EncodeRecall(const RecallModelState& recall, state::v1::RecallState* out) {
  for (const RecallCurveSums& c : recall.curves) {
    state::v1::RecallCurveSums* sums = out->add_curves();
    sums->mutable_documents()->Assign(c.documents.begin(), c.documents.end());
    sums->mutable_recall()->Assign(c.recall.begin(), c.recall.end());
    sums->mutable_density()->Assign(c.density.begin(), c.density.end());
  }
  out->set_steps_observed(recall.steps_observed);
}

// DATA_LOSS naming `field` (e.g. "job.pb recall") where a curve has not kRecallDensityBins bins;
// the curves' count and values are checked by RecallModel::set_state against the job.
absl::StatusOr<RecallModelState> DecodeRecall(const state::v1::RecallState& in,
                                              absl::string_view field) {
  RecallModelState out;
  for (int i = 0; i < in.curves_size(); ++i) {
    const state::v1::RecallCurveSums& c = in.curves(i);
    if (c.documents_size() != kRecallDensityBins || c.recall_size() != kRecallDensityBins ||
        c.density_size() != kRecallDensityBins) {
      return absl::DataLossError(
          absl::StrCat(field, ".curves[", i, "]: not ", kRecallDensityBins, " density bins"));
    }
    RecallCurveSums& sums = out.curves.emplace_back();
    std::copy(c.documents().begin(), c.documents().end(), sums.documents.begin());
    std::copy(c.recall().begin(), c.recall().end(), sums.recall.begin());
    std::copy(c.density().begin(), c.density().end(), sums.density.begin());
  }
  out.steps_observed = in.steps_observed();
  return out;
}

}  // namespace

state::v1::JobSnapshot EncodeJob(const StoredJob& job) {
  state::v1::JobSnapshot out;
  out.set_job_id(job.job_id);
  out.set_name(job.name);
  out.set_token(job.token);
  *out.mutable_config() = ConfigToProto(job.settings);
  *out.mutable_model() = EncodeModel(job.model, job.prior);
  out.set_next_step(job.next_step);
  for (bool joined : job.joined) out.add_joined(joined);
  out.mutable_folded_steps()->Assign(job.folded_steps.begin(), job.folded_steps.end());
  out.set_unfolded_steps(job.unfolded_steps);
  out.set_fold_failure(job.fold_failure);
  EncodeRecall(job.recall, out.mutable_recall());
  out.set_first_kept_step(job.first_kept_step);
  return out;
}

absl::StatusOr<StoredJob> DecodeJob(const state::v1::JobSnapshot& in) {
  StoredJob out;
  absl::StatusOr<JobSettings> settings = ConfigFromProto(in.config(), StoredLimits());
  if (!settings.ok()) {
    return absl::DataLossError(absl::StrCat("job.pb: ", settings.status().message()));
  }
  out.settings = *std::move(settings);
  if (absl::Status s = DecodeModel(in.model(), out.settings.planner.ranks, &out); !s.ok()) {
    return s;
  }
  out.job_id = in.job_id();
  out.name = in.name();
  out.token = in.token();
  out.next_step = in.next_step();
  out.joined.assign(in.joined().begin(), in.joined().end());
  out.folded_steps.assign(in.folded_steps().begin(), in.folded_steps().end());
  out.unfolded_steps = in.unfolded_steps();
  out.fold_failure = in.fold_failure();
  out.first_kept_step = in.first_kept_step();
  // The recall model's shape (layers) is checked against the job when it is restored.
  absl::StatusOr<RecallModelState> recall = DecodeRecall(in.recall(), "job.pb recall");
  if (!recall.ok()) return recall.status();
  out.recall = *std::move(recall);
  return out;
}

void EncodeStep(int64_t step, const std::vector<Sample>& batch, const StepPlan& plan, bool folded,
                const RecallModelState* layer_recall, const PlannedDensities* planned_with,
                state::v1::StepRecord* out) {
  out->set_step(step);
  for (const Sample& s : batch) SampleToProto(s, out->add_batch());
  out->mutable_ranks()->Reserve(static_cast<int>(plan.ranks.size()));
  for (int r = 0; r < static_cast<int>(plan.ranks.size()); ++r) {
    // The step's figures once, in ranks[0] (DecodeStep reads them there): each rank's part of
    // the wire carries them, but a record of 1,024 ranks would hold 1,024 copies. Without the
    // samples' old form, which held each layer density a second time: the record of a step of
    // 65,536 samples planned per layer (32 layers) took 34.8 MB where it takes 18.3
    // (sb-server-bench record_mb).
    RankPlanToProto(plan, step, r, out->add_ranks(), /*figures=*/r == 0, /*old_form=*/false);
  }
  out->mutable_deferred_ids()->Assign(plan.deferred_ids.begin(), plan.deferred_ids.end());
  out->set_folded(folded);
  if (layer_recall != nullptr) EncodeRecall(*layer_recall, out->mutable_layer_recall());
  if (planned_with != nullptr) {
    state::v1::PlannedDensities* densities = out->mutable_planned_with();
    densities->set_density_min(planned_with->density_min);
    densities->set_density_max(planned_with->density_max);
    densities->set_density_default(planned_with->density_default);
  }
}

absl::StatusOr<PlanStore::LoadedStep> DecodeStep(const state::v1::StepRecord& in) {
  PlanStore::LoadedStep out;
  out.step = in.step();
  out.folded = in.folded();
  if (in.has_layer_recall()) {
    absl::StatusOr<RecallModelState> recall = DecodeRecall(in.layer_recall(), "layer_recall");
    if (!recall.ok()) return recall.status();
    out.layer_recall = *std::move(recall);
  }
  if (in.has_planned_with()) {
    out.planned_with =
        PlannedDensities{in.planned_with().density_min(), in.planned_with().density_max(),
                         in.planned_with().density_default()};
  }
  out.batch.reserve(in.batch_size());
  for (const v1::Sample& s : in.batch()) {
    out.batch.push_back(Sample{s.id(),
                               s.length(),
                               s.sensitivity(),
                               s.group(),
                               {s.segments().begin(), s.segments().end()}});
  }
  StepPlan& plan = out.plan;
  for (int r = 0; r < in.ranks_size(); ++r) {
    RankPlan rank;
    rank.predicted_seconds = in.ranks(r).predicted_seconds();
    absl::StatusOr<std::vector<MicroBatchPlan>> micro_batches = MicroBatchesFromProto(in.ranks(r));
    if (!micro_batches.ok()) {
      return absl::DataLossError(absl::StrCat("ranks[", r, "].", micro_batches.status().message()));
    }
    rank.micro_batches = *std::move(micro_batches);
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
    for (const v1::BucketRecall& b : f.buckets()) {
      BucketRecallFigures bucket;
      // The bucket's index needs the job's capacity: ValidateStoredPlan sets it.
      bucket.label = b.bucket();
      bucket.length_min = b.length_min();
      bucket.length_max = b.length_max();
      bucket.tokens = b.tokens();
      bucket.predicted_recall = b.predicted_recall();
      bucket.default_recall = b.default_recall();
      plan.buckets.push_back(std::move(bucket));
    }
    plan.planned_locally = first.planned_locally();
  }
  plan.deferred_ids.assign(in.deferred_ids().begin(), in.deferred_ids().end());
  return out;
}

void EncodeReport(const StoredReport& report, state::v1::ReportRecord* out) {
  out->set_rank(report.rank);
  out->set_wait_seconds(report.wait_seconds);
  out->mutable_micro_batches()->Reserve(static_cast<int>(report.micro_batches.size()));
  for (const MicroBatchTiming& m : report.micro_batches) TimingToProto(m, out->add_micro_batches());
}

StoredReport DecodeReport(const state::v1::ReportRecord& in) {
  StoredReport out;
  out.rank = in.rank();
  out.wait_seconds = in.wait_seconds();
  out.micro_batches.reserve(in.micro_batches_size());
  for (const v1::MicroBatchReport& m : in.micro_batches()) {
    out.micro_batches.push_back(TimingFromProto(m));
  }
  return out;
}

}  // namespace sparsebalance
