#include "server/job_state.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "planner/planner.h"
#include "proto/wire.h"

namespace sparsebalance {
namespace {

bool Positive(double x) { return std::isfinite(x) && x > 0.0; }

}  // namespace

bool StateFinite(const LatencyModelState& st) {
  for (double v : st.weights) {
    if (!std::isfinite(v)) return false;
  }
  for (double v : st.covariance) {
    if (!std::isfinite(v)) return false;
  }
  for (double v : st.speed_factors) {
    if (!Positive(v)) return false;
  }
  return std::isfinite(st.rank_error_variance);
}

// The measured recalls of one micro-batch: their own rules (proto/wire.h's
// ValidateMeasuredRecall), then against the micro-batch's plan: each for a planned sample, its
// document index within the sample's documents.
absl::Status ValidateDocumentRecalls(const MicroBatchPlan& planned, int layers,
                                     const MicroBatchTiming& timing, const std::string& where) {
  if (absl::Status s = ValidateMeasuredRecall(timing, layers, where); !s.ok()) return s;
  std::map<uint64_t, size_t> documents_of;  // planned sample id -> its document count
  for (const PlannedSample& p : planned.samples) {
    documents_of[p.id] = p.segments.empty() ? 1 : p.segments.size();
  }
  for (size_t k = 0; k < timing.documents.size(); ++k) {
    const DocumentRecallMeasurement& d = timing.documents[k];
    const std::string at = absl::StrCat(where, ".documents[", k, "]");
    auto it = documents_of.find(d.sample_id);
    if (it == documents_of.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ".sample_id: ", d.sample_id, " is not planned in this micro-batch"));
    }
    if (static_cast<size_t>(d.document) >= it->second) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".document: ", d.document,
                                                     " is outside [0, ", it->second,
                                                     ") for sample id ", d.sample_id));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateReport(const StepPlan& plan, int rank, int layers,
                            const std::vector<MicroBatchTiming>& micro_batches, double wait_seconds,
                            bool complete) {
  if (!std::isfinite(wait_seconds) || wait_seconds < 0 || wait_seconds > kMaxReportedSeconds) {
    return absl::InvalidArgumentError(absl::StrCat("wait_seconds: ", wait_seconds,
                                                   " is not a finite number in [0, ",
                                                   kMaxReportedSeconds, "]"));
  }
  if (rank < 0 || rank >= static_cast<int>(plan.ranks.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", rank, " is outside [0, ", plan.ranks.size(), ")"));
  }
  const std::vector<MicroBatchPlan>& planned = plan.ranks[rank].micro_batches;
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
    if (planned[m.micro_batch].samples.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".micro_batch: ", m.micro_batch,
                                                     " was planned empty; do not report it"));
    }
    if (!Positive(m.compute_seconds) || m.compute_seconds > kMaxReportedSeconds) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".compute_seconds: ", m.compute_seconds,
                                                     " is not a finite number in (0, ",
                                                     kMaxReportedSeconds, "]"));
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
    if (absl::Status s = ValidateDocumentRecalls(planned[m.micro_batch], layers, m, where);
        !s.ok()) {
      return s;
    }
  }
  if (complete) {
    for (size_t k = 0; k < planned.size(); ++k) {
      if (!seen[k] && !planned[k].samples.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("micro_batches: rank ", rank, "'s plan has ", planned[k].samples.size(),
                         " samples in micro-batch ", k,
                         " but the report has no timing for it; report every "
                         "non-empty planned micro-batch once"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateStoredPlan(const std::vector<Sample>& batch, const PlannerConfig& config,
                                StepPlan* plan_ptr) {
  StepPlan& plan = *plan_ptr;
  if (static_cast<int>(plan.ranks.size()) != config.ranks) {
    return absl::DataLossError(
        absl::StrCat("the plan has ", plan.ranks.size(), " ranks; the job has ", config.ranks));
  }
  std::map<uint64_t, bool> placed;
  for (const Sample& s : batch) placed[s.id] = false;
  for (int r = 0; r < config.ranks; ++r) {
    RankPlan& rank = plan.ranks[r];
    if (static_cast<int>(rank.micro_batches.size()) != config.micro_batches) {
      return absl::DataLossError(absl::StrCat("plan rank ", r, " has ", rank.micro_batches.size(),
                                              " micro-batches; the job has ",
                                              config.micro_batches));
    }
    if (!std::isfinite(rank.predicted_seconds)) {
      return absl::DataLossError(absl::StrCat("plan rank ", r, ": predicted_seconds not finite"));
    }
    // Every planned sample is in the batch with its length and segments from here on.
    if (absl::Status s = CompletePlannedSamples(batch, &rank.micro_batches); !s.ok()) {
      return absl::DataLossError(absl::StrCat("plan rank ", r, ": ", s.message()));
    }
    for (size_t k = 0; k < rank.micro_batches.size(); ++k) {
      const MicroBatchPlan& mb = rank.micro_batches[k];
      const std::string where = absl::StrCat("plan rank ", r, " micro-batch ", k);
      int64_t tokens = 0;
      for (const PlannedSample& p : mb.samples) {
        if (placed[p.id]) {
          return absl::DataLossError(absl::StrCat(where, ": sample id ", p.id, " is placed twice"));
        }
        placed[p.id] = true;
        if (!(p.density > 0.0 && p.density <= 1.0)) {
          return absl::DataLossError(
              absl::StrCat(where, ": density ", p.density, " is outside (0, 1]"));
        }
        tokens += p.length;  // the batch's lengths, which are bounded (ValidateBatch)
      }
      if (tokens != mb.tokens) {
        return absl::DataLossError(
            absl::StrCat(where, ": tokens ", mb.tokens, " but its samples sum to ", tokens));
      }
      if (!std::isfinite(mb.predicted_seconds) || !std::isfinite(mb.default_density)) {
        return absl::DataLossError(absl::StrCat(where, ": a figure is not finite"));
      }
    }
  }
  for (uint64_t id : plan.deferred_ids) {
    auto it = placed.find(id);
    if (it == placed.end() || it->second) {
      return absl::DataLossError(
          absl::StrCat("deferred sample id ", id, " is not in the batch or was also placed"));
    }
  }
  for (double f : {plan.makespan_seconds, plan.lower_bound_seconds, plan.gap, plan.imbalance_ratio,
                   plan.bubble_ratio, plan.mean_density, plan.predicted_recall}) {
    if (!std::isfinite(f)) return absl::DataLossError("the plan's figures are not finite");
  }
  for (BucketRecallFigures& b : plan.buckets) {
    if (b.length_min < 1 || b.length_min > config.micro_batch_capacity ||
        !std::isfinite(b.predicted_recall) || !std::isfinite(b.default_recall)) {
      return absl::DataLossError("the plan's bucket recall figures are out of range");
    }
    b.bucket = RecallBucket(b.length_min, config.micro_batch_capacity);
  }
  return absl::OkStatus();
}

}  // namespace sparsebalance
