#include "proto/wire.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"
#include "planner/planner.h"

namespace sparsebalance {
namespace {

absl::Status ConfigError(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("config.", field, ": ", what));
}

// A density of a plan: finite and in (0, 1].
bool PlanDensity(double density) { return density > 0.0 && density <= 1.0; }

// `field` names the list, e.g. "samples[3].layer_densities".
absl::Status CheckLayerDensities(const std::vector<double>& densities, absl::string_view field) {
  for (size_t l = 0; l < densities.size(); ++l) {
    if (!PlanDensity(densities[l])) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", l, "]: ", densities[l], " is outside (0, 1]"));
    }
  }
  return absl::OkStatus();
}

// A planned sample's shard from the wire into `p` (whose length and segments are read), with
// the checks MicroBatchFromProto (wire.h) lists; `where` names the sample, e.g. "samples[2]".
absl::Status ReadShard(const v1::Shard& shard, int rank, const PlanContext& job,
                       const std::string& where, PlannedSample* p) {
  const std::string at = where + ".shard";
  if (!p->segments.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".segments: a shard's sample is one document; this one has ",
                     p->segments.size(), " segments"));
  }
  if (shard.begin() < 0 || shard.begin() >= shard.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ".begin: ", shard.begin(), " is outside [0, end ", shard.end(), ")"));
  }
  if (shard.end() > p->length) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ".end: ", shard.end(), " is past the sample's length ", p->length));
  }
  if (job.block_size > 0 && shard.begin() % job.block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        at, ".begin: ", shard.begin(), " is not a multiple of the block size ", job.block_size));
  }
  if (shard.group_size() < 1 || shard.group_size() > kMaxShards) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ".group: ", shard.group_size(), " ranks; need [1, ", kMaxShards, "]"));
  }
  std::set<int> ranks;
  for (int j = 0; j < shard.group_size(); ++j) {
    const int r = shard.group(j);
    if (r < 0 || (job.world_size > 0 && r >= job.world_size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ".group[", j, "]: rank ", r, " is outside [0, ",
          job.world_size > 0 ? absl::StrCat(job.world_size, ")") : std::string("world size)")));
    }
    if (!ranks.insert(r).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ".group[", j, "]: rank ", r, " is in the group twice"));
    }
  }
  if (shard.index() < 0 || shard.index() >= shard.group_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ".index: ", shard.index(), " is outside [0, ", shard.group_size(), ")"));
  }
  if (rank >= 0 && shard.group(shard.index()) != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ".group[", shard.index(), "]: rank ", shard.group(shard.index()),
                     " runs this shard, but this is rank ", rank, "'s plan"));
  }
  p->shard_begin = shard.begin();
  p->shard_end = shard.end();
  p->shard_index = shard.index();
  p->shard_group.assign(shard.group().begin(), shard.group().end());
  return absl::OkStatus();
}

// One value of an enum on both sides of the wire. An enum's table lists every value once, and
// last what the wire's zero value (*_UNSPECIFIED) means: the planner's default.
template <typename Ours, typename Wire>
struct EnumRow {
  Ours ours;
  Wire wire;
};

constexpr EnumRow<Policy, v1::Policy> kPolicies[] = {
    {Policy::kSequential, v1::POLICY_SEQUENTIAL},
    {Policy::kTokens, v1::POLICY_TOKENS},
    {Policy::kFlops, v1::POLICY_FLOPS},
    {Policy::kSab, v1::POLICY_SAB},
    {Policy::kDst, v1::POLICY_DST},
    {Policy::kSparseBalance, v1::POLICY_SPARSEBALANCE},
    {Policy::kSparseBalance, v1::POLICY_UNSPECIFIED},  // the planner's default
};

constexpr EnumRow<DstMode, v1::DstMode> kDstModes[] = {
    {DstMode::kMin, v1::DST_MODE_MIN},          {DstMode::kMean, v1::DST_MODE_MEAN},
    {DstMode::kMax, v1::DST_MODE_MAX},          {DstMode::kQuantile, v1::DST_MODE_QUANTILE},
    {DstMode::kMean, v1::DST_MODE_UNSPECIFIED},  // the planner's default
};

constexpr EnumRow<OverflowPolicy, v1::OverflowPolicy> kOverflowPolicies[] = {
    {OverflowPolicy::kError, v1::OVERFLOW_POLICY_ERROR},
    {OverflowPolicy::kDefer, v1::OVERFLOW_POLICY_DEFER},
    {OverflowPolicy::kError, v1::OVERFLOW_POLICY_UNSPECIFIED},  // the planner's default
};

constexpr EnumRow<SelectionMode, v1::Selection> kSelections[] = {
    {SelectionMode::kTopK, v1::SELECTION_TOPK},
    {SelectionMode::kAnchor, v1::SELECTION_ANCHOR},
    {SelectionMode::kTopK, v1::SELECTION_UNSPECIFIED},  // the planner's default
};

constexpr EnumRow<ShardPolicy, v1::ShardPolicy> kShardPolicies[] = {
    {ShardPolicy::kSparse, v1::SHARD_POLICY_SPARSE},
    {ShardPolicy::kDense, v1::SHARD_POLICY_DENSE},
    {ShardPolicy::kStatic, v1::SHARD_POLICY_STATIC},
    {ShardPolicy::kSparse, v1::SHARD_POLICY_UNSPECIFIED},  // the planner's default
};

// `value` read from the wire; one the table lacks is INVALID_ARGUMENT naming `field`.
template <typename Ours, typename Wire, size_t N>
absl::StatusOr<Ours> FromWire(const EnumRow<Ours, Wire> (&table)[N], Wire value,
                              absl::string_view field) {
  for (const EnumRow<Ours, Wire>& row : table) {
    if (row.wire == value) return row.ours;
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ": unknown value ", value));
}

// `value` for the wire: its first row (the zero value only for a value outside the enum).
template <typename Ours, typename Wire, size_t N>
Wire ToWire(const EnumRow<Ours, Wire> (&table)[N], Ours value) {
  for (const EnumRow<Ours, Wire>& row : table) {
    if (row.ours == value) return row.wire;
  }
  return Wire{};
}

}  // namespace

absl::StatusOr<JobSettings> ConfigFromProto(const v1::JobConfig& in, const WireLimits& limits) {
  JobSettings out;
  PlannerConfig& c = out.planner;
  if (in.world_size() > limits.max_world_size) {
    return absl::ResourceExhaustedError(absl::StrCat("config.world_size: ", in.world_size(),
                                                     " ranks is above this planner's limit of ",
                                                     limits.max_world_size));
  }
  if (in.world_size() < 1) {
    return ConfigError("world_size", absl::StrCat(in.world_size(), "; need at least one rank"));
  }
  if (in.micro_batches() < 0) {
    return ConfigError("micro_batches", absl::StrCat(in.micro_batches(), "; need >= 1 (0: 1)"));
  }
  if (in.micro_batch_capacity() < 0) {
    return ConfigError("micro_batch_capacity",
                       absl::StrCat(in.micro_batch_capacity(), " tokens; need >= 1 (0: 131072)"));
  }
  c.ranks = in.world_size();
  c.micro_batches = in.micro_batches() == 0 ? 1 : in.micro_batches();
  c.micro_batch_capacity = in.micro_batch_capacity() == 0 ? 131072 : in.micro_batch_capacity();
  const v1::ModelShape& s = in.shape();
  if (s.layers() != 0) c.shape.layers = s.layers();
  if (s.heads() != 0) c.shape.heads = s.heads();
  if (s.head_dim() != 0) c.shape.head_dim = s.head_dim();
  if (s.block_size() != 0) c.shape.block_size = s.block_size();
  if (in.has_shape()) c.shape.local_blocks = s.local_blocks();
  if (in.density_min() != 0) c.density_min = in.density_min();
  if (in.density_max() != 0) c.density_max = in.density_max();
  if (in.density_default() != 0) c.density_default = in.density_default();
  absl::StatusOr<Policy> policy = PolicyFromProto(in.policy(), "config.policy");
  if (!policy.ok()) return policy.status();
  c.policy = *policy;
  absl::StatusOr<DstMode> mode = DstModeFromProto(in.dst_mode(), "config.dst_mode");
  if (!mode.ok()) return mode.status();
  c.dst_mode = *mode;
  c.dst_quantile = in.dst_quantile();
  if (in.has_bucket_recall_margin()) c.bucket_recall_margin = in.bucket_recall_margin();
  c.document_recall_floor = in.document_recall_floor();
  absl::StatusOr<SelectionMode> selection = SelectionFromProto(in.selection(), "config.selection");
  if (!selection.ok()) return selection.status();
  c.selection = *selection;
  if (in.has_anchor_threshold()) c.anchor_threshold = in.anchor_threshold();
  if (in.max_shards() < 0) {
    return ConfigError("max_shards",
                       absl::StrCat(in.max_shards(), "; need >= 1 (0: 1, no splitting)"));
  }
  c.max_shards = in.max_shards() == 0 ? 1 : in.max_shards();
  absl::StatusOr<ShardPolicy> shard_policy =
      ShardPolicyFromProto(in.shard_policy(), "config.shard_policy");
  if (!shard_policy.ok()) return shard_policy.status();
  c.shard_policy = *shard_policy;
  c.shard_min_length = in.shard_min_length();
  absl::StatusOr<OverflowPolicy> overflow = OverflowFromProto(in.overflow(), "config.overflow");
  if (!overflow.ok()) return overflow.status();
  c.overflow = *overflow;
  if (in.history_steps() < 0 || in.history_steps() > limits.max_history_steps) {
    return ConfigError("history_steps", absl::StrCat(in.history_steps(), " is outside [0, ",
                                                     limits.max_history_steps, "]"));
  }
  // The default obeys the limit too: a job created with more history than the limit allows
  // would be refused when the planner restores it under the same limit.
  out.history_steps = in.history_steps() == 0
                          ? std::min(kDefaultHistorySteps, limits.max_history_steps)
                          : in.history_steps();
  if (absl::Status status = ValidateConfig(c); !status.ok()) return status;
  return out;
}

absl::StatusOr<Policy> PolicyFromProto(v1::Policy policy, absl::string_view field) {
  return FromWire(kPolicies, policy, field);
}

absl::StatusOr<DstMode> DstModeFromProto(v1::DstMode mode, absl::string_view field) {
  return FromWire(kDstModes, mode, field);
}

absl::StatusOr<OverflowPolicy> OverflowFromProto(v1::OverflowPolicy policy,
                                                 absl::string_view field) {
  return FromWire(kOverflowPolicies, policy, field);
}

absl::StatusOr<SelectionMode> SelectionFromProto(v1::Selection selection, absl::string_view field) {
  return FromWire(kSelections, selection, field);
}

absl::StatusOr<ShardPolicy> ShardPolicyFromProto(v1::ShardPolicy policy, absl::string_view field) {
  return FromWire(kShardPolicies, policy, field);
}

v1::ShardPolicy ShardPolicyToProto(ShardPolicy policy) { return ToWire(kShardPolicies, policy); }

v1::Policy PolicyToProto(Policy policy) { return ToWire(kPolicies, policy); }

v1::Selection SelectionToProto(SelectionMode selection) { return ToWire(kSelections, selection); }

v1::DstMode DstModeToProto(DstMode mode) { return ToWire(kDstModes, mode); }

v1::OverflowPolicy OverflowToProto(OverflowPolicy policy) {
  return ToWire(kOverflowPolicies, policy);
}

v1::JobConfig ConfigToProto(const JobSettings& settings) {
  const PlannerConfig& c = settings.planner;
  v1::JobConfig out;
  out.set_world_size(c.ranks);
  out.set_micro_batches(c.micro_batches);
  out.set_micro_batch_capacity(c.micro_batch_capacity);
  v1::ModelShape* s = out.mutable_shape();
  s->set_layers(c.shape.layers);
  s->set_heads(c.shape.heads);
  s->set_head_dim(c.shape.head_dim);
  s->set_block_size(c.shape.block_size);
  s->set_local_blocks(c.shape.local_blocks);
  out.set_density_min(c.density_min);
  out.set_density_max(c.density_max);
  out.set_density_default(c.density_default);
  out.set_policy(PolicyToProto(c.policy));
  out.set_dst_mode(DstModeToProto(c.dst_mode));
  out.set_dst_quantile(c.dst_quantile);
  out.set_overflow(OverflowToProto(c.overflow));
  out.set_history_steps(settings.history_steps);
  out.set_bucket_recall_margin(c.bucket_recall_margin);
  out.set_document_recall_floor(c.document_recall_floor);
  out.set_selection(SelectionToProto(c.selection));
  out.set_anchor_threshold(c.anchor_threshold);
  out.set_max_shards(c.max_shards);
  out.set_shard_policy(ShardPolicyToProto(c.shard_policy));
  out.set_shard_min_length(c.shard_min_length);
  return out;
}

absl::StatusOr<ConfigUpdate> ConfigUpdateFromProto(const v1::UpdateJobConfigRequest& request) {
  const v1::JobConfig& in = request.config();
  ConfigUpdate out;
  PlannerConfig& c = out.values.planner;
  c.dst_quantile = in.dst_quantile();
  c.density_min = in.density_min();
  c.density_max = in.density_max();
  c.density_default = in.density_default();
  c.bucket_recall_margin = in.bucket_recall_margin();
  c.document_recall_floor = in.document_recall_floor();
  c.anchor_threshold = in.anchor_threshold();
  c.max_shards = in.max_shards() == 0 ? 1 : in.max_shards();  // as at creation: 0 is no splitting
  c.shard_min_length = in.shard_min_length();
  out.values.history_steps = in.history_steps();
  out.fields.assign(request.update_mask().paths().begin(), request.update_mask().paths().end());
  for (const std::string& field : out.fields) {
    if (field == "policy") {
      absl::StatusOr<Policy> policy = PolicyFromProto(in.policy(), "config.policy");
      if (!policy.ok()) return policy.status();
      c.policy = *policy;
    } else if (field == "dst_mode") {
      absl::StatusOr<DstMode> mode = DstModeFromProto(in.dst_mode(), "config.dst_mode");
      if (!mode.ok()) return mode.status();
      c.dst_mode = *mode;
    } else if (field == "overflow") {
      absl::StatusOr<OverflowPolicy> overflow = OverflowFromProto(in.overflow(), "config.overflow");
      if (!overflow.ok()) return overflow.status();
      c.overflow = *overflow;
    } else if (field == "selection") {
      absl::StatusOr<SelectionMode> selection =
          SelectionFromProto(in.selection(), "config.selection");
      if (!selection.ok()) return selection.status();
      c.selection = *selection;
    } else if (field == "shard_policy") {
      absl::StatusOr<ShardPolicy> policy =
          ShardPolicyFromProto(in.shard_policy(), "config.shard_policy");
      if (!policy.ok()) return policy.status();
      c.shard_policy = *policy;
    }
  }
  return out;
}

absl::StatusOr<std::vector<Sample>> SamplesFromProto(
    const google::protobuf::RepeatedPtrField<v1::Sample>& samples, const WireLimits& limits) {
  if (samples.size() > limits.max_samples) {
    return absl::ResourceExhaustedError(absl::StrCat("samples: ", samples.size(),
                                                     " samples is above this planner's limit of ",
                                                     limits.max_samples, " per batch"));
  }
  std::vector<Sample> out;
  out.reserve(samples.size());
  for (int i = 0; i < samples.size(); ++i) {
    const v1::Sample& in = samples[i];
    if (in.segments_size() > limits.max_segments) {
      return absl::ResourceExhaustedError(
          absl::StrCat("samples[", i, "].segments: ", in.segments_size(),
                       " segments is above this planner's limit of ", limits.max_segments));
    }
    Sample s;
    s.id = in.id();
    s.length = in.length();
    s.sensitivity = in.has_sensitivity() ? in.sensitivity() : 0.0;
    s.group = in.group();
    s.segments.assign(in.segments().begin(), in.segments().end());
    out.push_back(std::move(s));
  }
  return out;
}

void SampleToProto(const Sample& sample, v1::Sample* out) {
  out->set_id(sample.id);
  out->set_length(sample.length);
  out->set_sensitivity(sample.sensitivity);
  out->set_group(sample.group);
  out->mutable_segments()->Assign(sample.segments.begin(), sample.segments.end());
}

void TimingToProto(const MicroBatchTiming& timing, v1::MicroBatchReport* out) {
  out->set_micro_batch(timing.micro_batch);
  out->set_compute_seconds(timing.compute_seconds);
  out->set_attention_seconds(timing.attention_seconds);
  out->set_tokens(timing.tokens);
  out->set_achieved_density(timing.achieved_density);
  out->set_recall(timing.recall);
  for (const DocumentRecallMeasurement& d : timing.documents) {
    v1::DocumentRecall* m = out->add_documents();
    m->set_sample_id(d.sample_id);
    m->set_document(d.document);
    m->set_recall(d.recall);
    m->mutable_layer_recall()->Assign(d.layer_recall.begin(), d.layer_recall.end());
    m->set_rows(d.rows);
  }
  out->set_recall_seconds(timing.recall_seconds);
  out->set_exchange_seconds(timing.exchange_seconds);
}

void ReportToProto(const RankStepReport& report, v1::ReportStepRequest* out) {
  out->set_step(report.step);
  out->set_rank(report.rank);
  out->set_wait_seconds(report.wait_seconds);
  out->set_planned_locally(report.planned_locally);
  for (const MicroBatchTiming& m : report.micro_batches) TimingToProto(m, out->add_micro_batches());
}

RankStepReport ReportFromProto(const v1::ReportStepRequest& request) {
  RankStepReport report;
  report.step = request.step();
  report.rank = request.rank();
  report.wait_seconds = request.wait_seconds();
  report.planned_locally = request.planned_locally();
  report.micro_batches.reserve(request.micro_batches_size());
  for (const v1::MicroBatchReport& m : request.micro_batches()) {
    report.micro_batches.push_back(TimingFromProto(m));
  }
  return report;
}

MicroBatchTiming TimingFromProto(const v1::MicroBatchReport& report) {
  MicroBatchTiming t;
  t.micro_batch = report.micro_batch();
  t.compute_seconds = report.compute_seconds();
  t.attention_seconds = report.attention_seconds();
  t.tokens = report.tokens();
  t.achieved_density = report.achieved_density();
  t.recall = report.recall();
  t.documents.reserve(report.documents_size());
  for (const v1::DocumentRecall& m : report.documents()) {
    DocumentRecallMeasurement d;
    d.sample_id = m.sample_id();
    d.document = m.document();
    d.recall = m.recall();
    d.layer_recall.assign(m.layer_recall().begin(), m.layer_recall().end());
    d.rows = m.rows();
    t.documents.push_back(std::move(d));
  }
  t.recall_seconds = report.recall_seconds();
  t.exchange_seconds = report.exchange_seconds();
  return t;
}

absl::Status ValidateMeasuredRecall(const MicroBatchTiming& timing, int layers,
                                    absl::FunctionRef<std::string()> where) {
  if (!std::isfinite(timing.recall_seconds) || timing.recall_seconds < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where(), ".recall_seconds: ", timing.recall_seconds, " is not a finite number >= 0"));
  }
  // Error prefixes are built only for the document that fails: a report of a micro-batch of
  // hundreds of documents is checked on every ReportStep.
  const std::vector<DocumentRecallMeasurement>& documents = timing.documents;
  for (size_t k = 0; k < documents.size(); ++k) {
    const DocumentRecallMeasurement& d = documents[k];
    auto at = [&] { return absl::StrCat(where(), ".documents[", k, "]"); };
    if (d.document < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(at(), ".document: ", d.document, " is negative"));
    }
    if (!(d.recall >= 0.0 && d.recall <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(at(), ".recall: ", d.recall, " is outside [0, 1]"));
    }
    if (!d.layer_recall.empty() && static_cast<int>(d.layer_recall.size()) != layers) {
      return absl::InvalidArgumentError(absl::StrCat(at(), ".layer_recall: ", d.layer_recall.size(),
                                                     " values; expected none or one per layer (",
                                                     layers, ")"));
    }
    for (size_t l = 0; l < d.layer_recall.size(); ++l) {
      if (!(d.layer_recall[l] >= 0.0 && d.layer_recall[l] <= 1.0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            at(), ".layer_recall[", l, "]: ", d.layer_recall[l], " is outside [0, 1]"));
      }
    }
    if (d.rows < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(at(), ".rows: ", d.rows, " must be at least 1 (rows measured per layer)"));
    }
  }
  // Repeats: the first one named is the one at the lowest position after its original, as a
  // scan in order finds it. Up to kPairwise documents (a micro-batch's usual count) every pair
  // is compared in place; more are sorted by (sample, document, position).
  constexpr size_t kPairwise = 32;
  size_t repeat = documents.size();
  auto same = [](const DocumentRecallMeasurement& a, const DocumentRecallMeasurement& b) {
    return a.sample_id == b.sample_id && a.document == b.document;
  };
  if (documents.size() <= kPairwise) {
    for (size_t k = 1; k < documents.size() && repeat == documents.size(); ++k) {
      for (size_t i = 0; i < k; ++i) {
        if (same(documents[i], documents[k])) {
          repeat = k;
          break;
        }
      }
    }
  } else {
    std::vector<std::tuple<uint64_t, int, size_t>> keys;
    keys.reserve(documents.size());
    for (size_t k = 0; k < documents.size(); ++k) {
      keys.emplace_back(documents[k].sample_id, documents[k].document, k);
    }
    std::sort(keys.begin(), keys.end());
    for (size_t i = 1; i < keys.size(); ++i) {
      if (std::get<0>(keys[i]) == std::get<0>(keys[i - 1]) &&
          std::get<1>(keys[i]) == std::get<1>(keys[i - 1])) {
        repeat = std::min(repeat, std::get<2>(keys[i]));
      }
    }
  }
  if (repeat < documents.size()) {
    const DocumentRecallMeasurement& d = documents[repeat];
    return absl::InvalidArgumentError(absl::StrCat(where(), ".documents[", repeat, "]: sample ",
                                                   d.sample_id, " document ", d.document,
                                                   " is reported twice"));
  }
  return absl::OkStatus();
}

absl::Status ValidateMeasuredRecall(const std::vector<MicroBatchTiming>& micro_batches,
                                    int layers) {
  for (size_t m = 0; m < micro_batches.size(); ++m) {
    if (absl::Status s = ValidateMeasuredRecall(
            micro_batches[m], layers, [m] { return absl::StrCat("micro_batches[", m, "]"); });
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

v1::PlanFigures FiguresToProto(const StepPlan& plan) {
  v1::PlanFigures out;
  FiguresToProto(plan, &out);
  return out;
}

void FiguresToProto(const StepPlan& plan, v1::PlanFigures* out_ptr) {
  v1::PlanFigures& out = *out_ptr;
  out.set_makespan_seconds(plan.makespan_seconds);
  out.set_lower_bound_seconds(plan.lower_bound_seconds);
  out.set_gap(plan.gap);
  out.set_imbalance_ratio(plan.imbalance_ratio);
  out.set_bubble_ratio(plan.bubble_ratio);
  out.set_mean_density(plan.mean_density);
  out.set_predicted_recall(plan.predicted_recall);
  out.mutable_buckets()->Reserve(static_cast<int>(plan.buckets.size()));
  for (const BucketRecallFigures& b : plan.buckets) {
    v1::BucketRecall* bucket = out.add_buckets();
    bucket->set_bucket(b.label);
    bucket->set_length_min(b.length_min);
    bucket->set_length_max(b.length_max);
    bucket->set_tokens(b.tokens);
    bucket->set_predicted_recall(b.predicted_recall);
    bucket->set_default_recall(b.default_recall);
  }
}

v1::RankPlan RankPlanToProto(const StepPlan& plan, int64_t step, int rank) {
  v1::RankPlan out;
  RankPlanToProto(plan, step, rank, &out);
  return out;
}

void RankPlanToProto(const StepPlan& plan, int64_t step, int rank, v1::RankPlan* out_ptr,
                     bool figures, bool old_form) {
  v1::RankPlan& out = *out_ptr;
  out.set_step(step);
  out.set_rank(rank);
  out.set_policy(PolicyToProto(plan.policy));
  const RankPlan& r = plan.ranks[rank];
  out.mutable_micro_batches()->Reserve(static_cast<int>(r.micro_batches.size()));
  for (const MicroBatchPlan& mb : r.micro_batches) {
    v1::MicroBatch* m = out.add_micro_batches();
    const int n = static_cast<int>(mb.samples.size());
    m->mutable_samples()->Reserve(n);
    if (old_form) {
      m->mutable_sample_ids()->Reserve(n);
      m->mutable_densities()->Reserve(n);
    }
    bool layered = false;
    for (const PlannedSample& p : mb.samples) {
      v1::PlannedSample* sample = m->add_samples();
      sample->set_id(p.id);
      sample->set_length(p.length);
      sample->set_density(p.density);
      if (!p.segments.empty()) {
        sample->mutable_segments()->Assign(p.segments.begin(), p.segments.end());
      }
      if (!p.layer_densities.empty()) {
        sample->mutable_layer_densities()->Assign(p.layer_densities.begin(),
                                                  p.layer_densities.end());
      }
      if (p.sharded()) {
        v1::Shard* shard = sample->mutable_shard();
        shard->set_begin(p.shard_begin);
        shard->set_end(p.shard_end);
        shard->set_index(p.shard_index);
        shard->mutable_group()->Assign(p.shard_group.begin(), p.shard_group.end());
      }
      if (old_form) {  // for readers older than `samples`
        m->add_sample_ids(p.id);
        m->add_densities(p.density);
        layered = layered || !p.layer_densities.empty();
      }
    }
    if (layered) {
      for (const PlannedSample& p : mb.samples) {
        m->add_layer_densities()->mutable_densities()->Assign(p.layer_densities.begin(),
                                                              p.layer_densities.end());
      }
    }
    m->set_default_density(mb.default_density);
    m->set_tokens(mb.tokens);
    m->set_predicted_seconds(mb.predicted_seconds);
  }
  out.set_predicted_seconds(r.predicted_seconds);
  if (figures) FiguresToProto(plan, out.mutable_figures());
  out.set_planned_locally(plan.planned_locally);
}

absl::StatusOr<MicroBatchPlan> MicroBatchFromProto(const v1::MicroBatch& m, int rank,
                                                   const PlanContext& job) {
  MicroBatchPlan mb;
  mb.default_density = m.default_density();
  mb.tokens = m.tokens();
  mb.predicted_seconds = m.predicted_seconds();
  if (m.samples_size() > 0 || m.sample_ids_size() == 0) {
    mb.samples.reserve(m.samples_size());
    for (int k = 0; k < m.samples_size(); ++k) {
      const v1::PlannedSample& in = m.samples(k);
      const std::string where = absl::StrCat("samples[", k, "]");
      if (in.length() < 1 || in.length() > kMaxMicroBatchCapacity) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".length: ", in.length(),
                                                       " tokens is outside [1, ",
                                                       kMaxMicroBatchCapacity, "]"));
      }
      if (!PlanDensity(in.density())) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".density: ", in.density(), " is outside (0, 1]"));
      }
      PlannedSample& p = mb.samples.emplace_back();
      p.id = in.id();
      p.length = in.length();
      p.density = in.density();
      p.segments.assign(in.segments().begin(), in.segments().end());
      p.layer_densities.assign(in.layer_densities().begin(), in.layer_densities().end());
      if (absl::Status s = ValidateSegments(p.length, p.segments, where); !s.ok()) return s;
      if (absl::Status s = CheckLayerDensities(p.layer_densities, where + ".layer_densities");
          !s.ok()) {
        return s;
      }
      if (in.has_shard()) {
        if (absl::Status s = ReadShard(in.shard(), rank, job, where, &p); !s.ok()) return s;
      }
    }
    return mb;
  }
  // An older planner's message: ids and densities (and maybe layer densities), no lengths.
  if (m.densities_size() != m.sample_ids_size()) {
    return absl::InvalidArgumentError(absl::StrCat("densities: ", m.densities_size(),
                                                   " values for ", m.sample_ids_size(),
                                                   " sample_ids; need one per sample"));
  }
  if (m.layer_densities_size() != 0 && m.layer_densities_size() != m.sample_ids_size()) {
    return absl::InvalidArgumentError(absl::StrCat("layer_densities: ", m.layer_densities_size(),
                                                   " entries for ", m.sample_ids_size(),
                                                   " sample_ids; need none or one per sample"));
  }
  mb.samples.resize(m.sample_ids_size());
  for (int k = 0; k < m.sample_ids_size(); ++k) {
    PlannedSample& p = mb.samples[k];
    p.id = m.sample_ids(k);
    p.density = m.densities(k);
    if (!PlanDensity(p.density)) {
      return absl::InvalidArgumentError(
          absl::StrCat("densities[", k, "]: ", p.density, " is outside (0, 1]"));
    }
    if (m.layer_densities_size() > 0) {
      const auto& layers = m.layer_densities(k).densities();
      p.layer_densities.assign(layers.begin(), layers.end());
      if (absl::Status s = CheckLayerDensities(p.layer_densities,
                                               absl::StrCat("layer_densities[", k, "].densities"));
          !s.ok()) {
        return s;
      }
    }
  }
  return mb;
}

absl::StatusOr<std::vector<MicroBatchPlan>> MicroBatchesFromProto(const v1::RankPlan& plan,
                                                                  const PlanContext& job) {
  std::vector<MicroBatchPlan> out;
  out.reserve(plan.micro_batches_size());
  for (int m = 0; m < plan.micro_batches_size(); ++m) {
    absl::StatusOr<MicroBatchPlan> mb =
        MicroBatchFromProto(plan.micro_batches(m), plan.rank(), job);
    if (!mb.ok()) {
      return absl::Status(mb.status().code(),
                          absl::StrCat("micro_batches[", m, "].", mb.status().message()));
    }
    out.push_back(*std::move(mb));
  }
  return out;
}

namespace {

constexpr char kErrorInfoUrl[] = "type.googleapis.com/sparsebalance.planner.v1.ErrorInfo";
constexpr char kErrorDomain[] = "sparsebalance.planner.v1";

}  // namespace

absl::Status WithErrorReason(absl::Status status, absl::string_view reason) {
  if (!status.ok()) status.SetPayload(kErrorInfoUrl, absl::Cord(reason));
  return status;
}

absl::Status WithMessage(const absl::Status& status, absl::string_view message) {
  absl::Status out(status.code(), message);
  status.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

std::string ErrorReason(const absl::Status& status) {
  absl::optional<absl::Cord> reason = status.GetPayload(kErrorInfoUrl);
  return reason.has_value() ? std::string(*reason) : std::string();
}

bool IsJobStateQuota(const absl::Status& status) {
  return status.code() == absl::StatusCode::kResourceExhausted &&
         ErrorReason(status) == kReasonJobStateQuota;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbers.
  const auto code = static_cast<grpc::StatusCode>(status.code());
  const std::string reason = ErrorReason(status);
  if (reason.empty()) return grpc::Status(code, std::string(status.message()));
  v1::RpcStatus details;
  details.set_code(static_cast<int>(status.code()));
  details.set_message(std::string(status.message()));
  v1::ErrorInfo info;
  info.set_reason(reason);
  info.set_domain(kErrorDomain);
  google::protobuf::Any* any = details.add_details();
  any->set_type_url(kErrorInfoUrl);
  any->set_value(info.SerializeAsString());
  return grpc::Status(code, std::string(status.message()), details.SerializeAsString());
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  v1::RpcStatus details;
  if (!status.error_details().empty() && details.ParseFromString(status.error_details())) {
    for (const google::protobuf::Any& any : details.details()) {
      v1::ErrorInfo info;
      if (any.type_url() == kErrorInfoUrl && info.ParseFromString(any.value())) {
        out = WithErrorReason(std::move(out), info.reason());
      }
    }
  }
  return out;
}

namespace {
bool HostNameChar(char c) {
  return absl::ascii_isalnum(c) || c == '.' || c == '-' || c == '_' || c == ':';
}
}  // namespace

std::string Quoted(absl::string_view text) {
  return absl::StrCat(absl::CEscape(text.substr(0, kMaxQuoted)),
                      text.size() > kMaxQuoted ? "..." : "");
}

absl::Status ValidateHostName(const std::string& host, absl::string_view field) {
  if (static_cast<int>(host.size()) > kMaxHostName) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", host.size(), " characters; at most ", kMaxHostName));
  }
  for (size_t i = 0; i < host.size(); ++i) {
    const char c = host[i];
    if (!HostNameChar(c)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": character ", i, " (byte ",
                                                     static_cast<int>(static_cast<uint8_t>(c)),
                                                     ") is not one of [A-Za-z0-9._:-]"));
    }
  }
  return absl::OkStatus();
}

std::string SanitizeHostName(std::string host) {
  if (static_cast<int>(host.size()) > kMaxHostName) host.resize(kMaxHostName);
  for (char& c : host) {
    if (!HostNameChar(c)) c = '-';
  }
  return host;
}

}  // namespace sparsebalance
