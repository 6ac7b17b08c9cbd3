#include "server/job_state.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "planner/planner.h"
#include "proto/wire.h"

namespace sparsebalance {
namespace {

// How far a stored density may pass its bounds by rounding: as CheckPlan allows (planner.cc).
constexpr double kDensitySlack = 1e-9;

bool Positive(double x) { return std::isfinite(x) && x > 0.0; }

bool HoldsShard(const MicroBatchPlan& micro_batch) {
  return std::any_of(micro_batch.samples.begin(), micro_batch.samples.end(),
                     [](const PlannedSample& p) { return p.sharded(); });
}

// Where one shard of a split document was found in a stored plan.
struct StoredShard {
  int rank = 0;
  int micro_batch = 0;
  const PlannedSample* sample = nullptr;
};

// The shards of one split document, as a stored plan holds them: one per rank of the group
// (shard j on group[j], all with the same group), all in one micro-batch index, their token
// ranges tiling [0, length) with block-aligned cuts. DATA_LOSS naming the sample.
absl::Status CheckStoredShards(uint64_t id, std::vector<StoredShard> shards, int block_size) {
  const std::string what = absl::StrCat("split sample id ", id);
  const PlannedSample& first = *shards.front().sample;
  if (shards.size() != first.shard_group.size()) {
    return absl::DataLossError(absl::StrCat(what, ": ", shards.size(), " shards for a group of ",
                                            first.shard_group.size(), " ranks"));
  }
  std::sort(shards.begin(), shards.end(), [](const StoredShard& a, const StoredShard& b) {
    return a.sample->shard_begin < b.sample->shard_begin;
  });
  std::vector<bool> indices(first.shard_group.size(), false);
  int64_t next = 0;
  for (const StoredShard& s : shards) {
    const PlannedSample& p = *s.sample;
    if (p.shard_group != first.shard_group || p.length != first.length) {
      return absl::DataLossError(absl::StrCat(what, ": its shards disagree on the group"));
    }
    if (p.shard_index < 0 || p.shard_index >= static_cast<int>(indices.size()) ||
        indices[p.shard_index] || p.shard_group[p.shard_index] != s.rank) {
      return absl::DataLossError(absl::StrCat(what, ": shard ", p.shard_index, " on rank ", s.rank,
                                              " does not fit its group"));
    }
    indices[p.shard_index] = true;
    if (s.micro_batch != shards.front().micro_batch) {
      return absl::DataLossError(absl::StrCat(what, ": its shards are in different micro-batches"));
    }
    if (p.shard_begin != next || p.shard_end <= p.shard_begin || p.shard_begin % block_size != 0) {
      return absl::DataLossError(absl::StrCat(what, ": shard [", p.shard_begin, ", ", p.shard_end,
                                              ") leaves a gap, overlaps or is not block-aligned"));
    }
    next = p.shard_end;
  }
  if (next != first.length) {
    return absl::DataLossError(
        absl::StrCat(what, ": its shards end at token ", next, " of ", first.length));
  }
  return absl::OkStatus();
}

}  // namespace

const PlannedSample* PlannedSampleFinder::Find(uint64_t id) {
  const std::vector<PlannedSample>& samples = *samples_;
  if (next_ > 0 && samples[next_ - 1].id == id) return &samples[next_ - 1];
  if (next_ < samples.size() && samples[next_].id == id) return &samples[next_++];
  auto by_first = [](const auto& a, const auto& b) { return a.first < b.first; };
  if (by_id_.empty()) {
    for (const PlannedSample& p : samples) by_id_.emplace_back(p.id, &p);
    std::sort(by_id_.begin(), by_id_.end(), by_first);
  }
  auto it = std::lower_bound(by_id_.begin(), by_id_.end(), std::make_pair(id, nullptr), by_first);
  return it == by_id_.end() || it->first != id ? nullptr : it->second;
}

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
  return std::isfinite(st.rank_error_variance) && std::isfinite(st.exchange_u) &&
         std::isfinite(st.exchange_uu);
}

// The measured recalls of one micro-batch: their own rules (proto/wire.h's
// ValidateMeasuredRecall), then against the micro-batch's plan: each for a planned sample, its
// document index within the sample's documents. `where` names the micro-batch in a message.
absl::Status ValidateDocumentRecalls(const MicroBatchPlan& planned, int layers,
                                     const MicroBatchTiming& timing,
                                     absl::FunctionRef<std::string()> where) {
  if (absl::Status s = ValidateMeasuredRecall(timing, layers, where); !s.ok()) return s;
  PlannedSampleFinder finder(&planned.samples);
  for (size_t k = 0; k < timing.documents.size(); ++k) {
    const DocumentRecallMeasurement& d = timing.documents[k];
    const PlannedSample* sample = finder.Find(d.sample_id);
    if (sample == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ".documents[", k,
                                                     "].sample_id: ", d.sample_id,
                                                     " is not planned in this micro-batch"));
    }
    const size_t documents = sample->segments.empty() ? 1 : sample->segments.size();
    if (static_cast<size_t>(d.document) >= documents) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ".documents[", k,
                                                     "].document: ", d.document, " is outside [0, ",
                                                     documents, ") for sample id ", d.sample_id));
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
    // Built only for a message: this runs on every ReportStep.
    auto where = [k] { return absl::StrCat("micro_batches[", k, "]"); };
    if (m.micro_batch < 0 || m.micro_batch >= static_cast<int>(planned.size())) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ".micro_batch: ", m.micro_batch,
                                                     " is outside [0, ", planned.size(), ")"));
    }
    if (seen[m.micro_batch]) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ".micro_batch: ", m.micro_batch, " is reported twice"));
    }
    seen[m.micro_batch] = true;
    if (planned[m.micro_batch].samples.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ".micro_batch: ", m.micro_batch,
                                                     " was planned empty; do not report it"));
    }
    if (!Positive(m.compute_seconds) || m.compute_seconds > kMaxReportedSeconds) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ".compute_seconds: ", m.compute_seconds,
                       " is not a finite number in (0, ", kMaxReportedSeconds, "]"));
    }
    if (!std::isfinite(m.attention_seconds) || m.attention_seconds < 0 ||
        m.attention_seconds > m.compute_seconds) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), ".attention_seconds: ", m.attention_seconds, " is not in [0, compute_seconds]"));
    }
    // Part of compute_seconds, and (as the latency model needs) less than all of it.
    if (!std::isfinite(m.exchange_seconds) || m.exchange_seconds < 0 ||
        (m.exchange_seconds > 0 && m.exchange_seconds >= m.compute_seconds)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ".exchange_seconds: ", m.exchange_seconds,
                       " is not in [0, compute_seconds ", m.compute_seconds, ")"));
    }
    if (m.exchange_seconds > 0 && !HoldsShard(planned[m.micro_batch])) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ".exchange_seconds: ", m.exchange_seconds,
                       " is a report for a shard that was not "
                       "planned: micro-batch ",
                       m.micro_batch, " of rank ", rank,
                       "'s plan holds no shard of a split document; report 0"));
    }
    if (!(m.recall >= 0.0 && m.recall <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ".recall: ", m.recall, " is outside [0, 1]"));
    }
    if (!(m.achieved_density >= 0.0 && m.achieved_density <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ".achieved_density: ", m.achieved_density, " is outside [0, 1]"));
    }
    if (m.tokens != planned[m.micro_batch].tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), ".tokens: ", m.tokens, " but the plan has ", planned[m.micro_batch].tokens));
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
                                const PlannedDensities* planned_with, StepPlan* plan_ptr) {
  StepPlan& plan = *plan_ptr;
  if (static_cast<int>(plan.ranks.size()) != config.ranks) {
    return absl::DataLossError(
        absl::StrCat("the plan has ", plan.ranks.size(), " ranks; the job has ", config.ranks));
  }
  // Where the record keeps the density settings the step was planned with, every density is
  // within their bounds (the planner keeps each in [floor, density_max], the floor at or above
  // density_min; kDensitySlack absorbs rounding). A record of an older planner: (0, 1] alone.
  double lowest = 0.0;
  double highest = 1.0;
  if (planned_with != nullptr) {
    const PlannedDensities& d = *planned_with;
    if (!(std::isfinite(d.density_min) && std::isfinite(d.density_max) && d.density_min > 0.0 &&
          d.density_min <= d.density_default && d.density_default <= d.density_max &&
          d.density_max <= 1.0)) {
      return absl::DataLossError(absl::StrCat(
          "the step was planned with density_min ", d.density_min, ", density_default ",
          d.density_default, ", density_max ", d.density_max, ", which no config has"));
    }
    lowest = d.density_min - kDensitySlack;
    highest = d.density_max + kDensitySlack;
  }
  const auto outside = [&](double density) {
    return planned_with != nullptr && !(density >= lowest && density <= highest);
  };
  // Every micro-batch's default density is the config's density_default when the step was
  // planned: the record's planned_with's, or else the first micro-batch's (< 0 until it is seen).
  double default_density = planned_with != nullptr ? planned_with->density_default : -1.0;
  std::map<uint64_t, std::vector<StoredShard>> split;  // id -> its shards
  const SamplesById by_id = IndexSamplesById(batch);
  // Per batch sample (by its index), whether the plan places it. Every planned id is in the
  // batch once CompletePlannedSamples has passed.
  std::vector<char> placed_at(batch.size(), 0);
  auto placed = [&](uint64_t id) -> char& { return placed_at[by_id.at(id) - batch.data()]; };
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
    if (absl::Status s = CompletePlannedSamples(by_id, &rank.micro_batches); !s.ok()) {
      return absl::DataLossError(absl::StrCat("plan rank ", r, ": ", s.message()));
    }
    for (size_t k = 0; k < rank.micro_batches.size(); ++k) {
      const MicroBatchPlan& mb = rank.micro_batches[k];
      const std::string where = absl::StrCat("plan rank ", r, " micro-batch ", k);
      int64_t tokens = 0;
      for (const PlannedSample& p : mb.samples) {
        if (p.sharded()) {
          // Its group's ranks: in range of this job (MicroBatchesFromProto did not know it).
          for (int g : p.shard_group) {
            if (g >= config.ranks) {
              return absl::DataLossError(
                  absl::StrCat(where, ": sample id ", p.id, "'s shard group names rank ", g));
            }
          }
          split[p.id].push_back({r, static_cast<int>(k), &p});
        } else if (placed(p.id)) {
          return absl::DataLossError(absl::StrCat(where, ": sample id ", p.id, " is placed twice"));
        } else {
          placed(p.id) = 1;
        }
        if (!(p.density > 0.0 && p.density <= 1.0)) {
          return absl::DataLossError(
              absl::StrCat(where, ": density ", p.density, " is outside (0, 1]"));
        }
        if (outside(p.density)) {
          return absl::DataLossError(
              absl::StrCat(where, ": sample id ", p.id, "'s density ", p.density,
                           " is outside the [", planned_with->density_min, ", ",
                           planned_with->density_max, "] its step was planned with"));
        }
        for (double layer : p.layer_densities) {
          if (outside(layer)) {
            return absl::DataLossError(
                absl::StrCat(where, ": sample id ", p.id, "'s layer density ", layer,
                             " is outside the [", planned_with->density_min, ", ",
                             planned_with->density_max, "] its step was planned with"));
          }
        }
        // The batch's lengths, which are bounded (ValidateBatch); a shard's query tokens.
        tokens += p.QueryTokens();
      }
      if (tokens != mb.tokens) {
        return absl::DataLossError(
            absl::StrCat(where, ": tokens ", mb.tokens, " but its samples sum to ", tokens));
      }
      if (!std::isfinite(mb.predicted_seconds)) {
        return absl::DataLossError(absl::StrCat(where, ": a figure is not finite"));
      }
      if (default_density < 0.0) {
        if (!(mb.default_density > 0.0 && mb.default_density <= 1.0)) {
          return absl::DataLossError(
              absl::StrCat(where, ": default density ", mb.default_density, " is outside (0, 1]"));
        }
        default_density = mb.default_density;
      } else if (mb.default_density != default_density) {
        return absl::DataLossError(absl::StrCat(
            where, ": default density ", mb.default_density, " is not the ", default_density,
            planned_with != nullptr ? " density_default its step was planned with"
                                    : " of the plan's first micro-batch"));
      }
    }
  }
  for (const auto& [id, shards] : split) {
    if (placed(id)) {
      return absl::DataLossError(absl::StrCat("sample id ", id, " is placed whole and split"));
    }
    placed(id) = 1;
    if (absl::Status s = CheckStoredShards(id, shards, config.shape.block_size); !s.ok()) return s;
  }
  for (uint64_t id : plan.deferred_ids) {
    if (by_id.count(id) == 0 || placed(id)) {
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
