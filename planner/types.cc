#include "planner/types.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace sparsebalance {
namespace {

bool InUnitInterval(double x) { return std::isfinite(x) && x > 0.0 && x <= 1.0; }

// An enumerator and the name flags, reports and the Python module use for it.
template <typename Enum>
struct NamedValue {
  Enum value;
  absl::string_view name;
};

constexpr NamedValue<Policy> kPolicyNames[] = {
    {Policy::kSequential, "sequential"},
    {Policy::kTokens, "tokens"},
    {Policy::kFlops, "flops"},
    {Policy::kSab, "sab"},
    {Policy::kDst, "dst"},
    {Policy::kSparseBalance, "sparsebalance"},
};
constexpr NamedValue<DstMode> kDstModeNames[] = {
    {DstMode::kMin, "min"},
    {DstMode::kMean, "mean"},
    {DstMode::kMax, "max"},
    {DstMode::kQuantile, "quantile"},
};
// A new enumerator needs its name here (a switch would have warned).
static_assert(std::size(kPolicyNames) == static_cast<size_t>(Policy::kSparseBalance) + 1);
static_assert(std::size(kDstModeNames) == static_cast<size_t>(DstMode::kQuantile) + 1);

// The name of `value` in `names`; "unknown" for a value outside the enum.
template <typename Enum, size_t N>
absl::string_view NameOf(const NamedValue<Enum> (&names)[N], Enum value) {
  for (const NamedValue<Enum>& named : names) {
    if (named.value == value) return named.name;
  }
  return "unknown";
}

}  // namespace

absl::Status ValidateConfig(const PlannerConfig& c) {
  auto bad = [](absl::string_view field, auto value, absl::string_view want) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.", field, " = ", value, " is invalid: ", want));
  };
  // A positive count of at most `limit` (named `limit_name` in the message).
  auto out_of_range = [&](absl::string_view field, int64_t value, int64_t limit,
                          absl::string_view limit_name) -> absl::Status {
    if (value < 1) return bad(field, value, "need at least 1");
    if (value > limit) {
      return bad(field, value, absl::StrCat("above the limit of ", limit, " (", limit_name, ")"));
    }
    return absl::OkStatus();
  };
  if (c.ranks < 1) return bad("ranks", c.ranks, "need at least one rank");
  if (absl::Status st = out_of_range("micro_batches", c.micro_batches, kMaxMicroBatches,
                                     "2^16, kMaxMicroBatches");
      !st.ok()) {
    return st;
  }
  if (c.micro_batch_capacity < 1) {
    return bad("micro_batch_capacity", c.micro_batch_capacity, "need a positive token count");
  }
  if (c.micro_batch_capacity > kMaxMicroBatchCapacity) {
    return bad("micro_batch_capacity", c.micro_batch_capacity,
               absl::StrCat("above the limit of ", kMaxMicroBatchCapacity,
                            " tokens (2^30, kMaxMicroBatchCapacity)"));
  }
  // Both are at most 2^31 - 1, so the product fits in int64.
  const int64_t slots = int64_t{c.ranks} * c.micro_batches;
  if (slots > kMaxPlanSlots) {
    return bad("micro_batches", c.micro_batches,
               absl::StrCat("ranks x micro_batches = ", c.ranks, " x ", c.micro_batches, " = ",
                            slots, " plan slots is above the limit of ", kMaxPlanSlots,
                            " (2^20, kMaxPlanSlots); use fewer micro-batches or ranks"));
  }
  const ModelShape& s = c.shape;
  if (absl::Status st = out_of_range("shape.layers", s.layers, kMaxLayers, "2^12, kMaxLayers");
      !st.ok()) {
    return st;
  }
  if (absl::Status st = out_of_range("shape.heads", s.heads, kMaxHeads, "2^12, kMaxHeads");
      !st.ok()) {
    return st;
  }
  if (absl::Status st =
          out_of_range("shape.head_dim", s.head_dim, kMaxHeadDim, "2^12, kMaxHeadDim");
      !st.ok()) {
    return st;
  }
  if (s.block_size != 64 && s.block_size != 128) {
    return bad("shape.block_size", s.block_size, "supported block sizes are 64 and 128");
  }
  if (s.local_blocks < 0) return bad("shape.local_blocks", s.local_blocks, "need >= 0");
  if (s.local_blocks > kMaxLocalBlocks) {
    return bad(
        "shape.local_blocks", s.local_blocks,
        absl::StrCat("above the limit of ", kMaxLocalBlocks, " blocks (2^24, kMaxLocalBlocks)"));
  }
  if (!InUnitInterval(c.density_min)) return bad("density_min", c.density_min, "need (0, 1]");
  if (!InUnitInterval(c.density_max)) return bad("density_max", c.density_max, "need (0, 1]");
  if (!InUnitInterval(c.density_default)) {
    return bad("density_default", c.density_default, "need (0, 1]");
  }
  if (c.density_min > c.density_max) {
    return bad("density_min", c.density_min, absl::StrCat("above density_max ", c.density_max));
  }
  if (c.density_default < c.density_min || c.density_default > c.density_max) {
    return bad("density_default", c.density_default,
               absl::StrCat("need density_min ", c.density_min,
                            " <= density_default <= ", "density_max ", c.density_max));
  }
  if (!(c.dst_quantile >= 0.0 && c.dst_quantile <= 1.0)) {
    return bad("dst_quantile", c.dst_quantile, "need [0, 1]");
  }
  if (!(c.bucket_recall_margin >= 0.0 && c.bucket_recall_margin <= 1.0)) {
    return bad("bucket_recall_margin", c.bucket_recall_margin,
               "need [0, 1] (recall a length bucket may lose, e.g. 0.01 for one point)");
  }
  if (!(c.document_recall_floor >= 0.0 && c.document_recall_floor < 1.0)) {
    return bad("document_recall_floor", c.document_recall_floor, "need [0, 1); 0 is no floor");
  }
  if (c.selection != SelectionMode::kTopK && c.selection != SelectionMode::kAnchor) {
    return bad("selection", static_cast<int>(c.selection), "need top-k or anchor");
  }
  if (!(c.anchor_threshold > 0.0 && c.anchor_threshold <= 1.0)) {
    return bad("anchor_threshold", c.anchor_threshold,
               "need (0, 1] (a kept block's weight relative to the best anchor's)");
  }
  if (c.max_shards < 1 || c.max_shards > std::min(c.ranks, kMaxShards)) {
    return bad("max_shards", c.max_shards,
               absl::StrCat("need [1, min(ranks ", c.ranks, ", ", kMaxShards,
                            ")]: the ranks one document may be split over (1: no splitting)"));
  }
  if (c.shard_policy != ShardPolicy::kSparse && c.shard_policy != ShardPolicy::kDense &&
      c.shard_policy != ShardPolicy::kStatic) {
    return bad("shard_policy", static_cast<int>(c.shard_policy), "need sparse, dense or static");
  }
  if (c.shard_min_length < 0 || c.shard_min_length > kMaxMicroBatchCapacity) {
    return bad("shard_min_length", c.shard_min_length,
               absl::StrCat("need [0, ", kMaxMicroBatchCapacity,
                            "] tokens (0: half the micro-batch capacity)"));
  }
  return absl::OkStatus();
}

absl::string_view PolicyName(Policy policy) { return NameOf(kPolicyNames, policy); }

const std::vector<Policy>& AllPolicies() {
  static const auto* const kAll =
      new std::vector<Policy>{Policy::kSequential, Policy::kTokens, Policy::kFlops,
                              Policy::kSab,        Policy::kDst,    Policy::kSparseBalance};
  return *kAll;
}

absl::StatusOr<Policy> ParsePolicy(absl::string_view name) {
  std::vector<std::string> names;
  for (Policy p : AllPolicies()) {
    if (PolicyName(p) == name) return p;
    names.emplace_back(PolicyName(p));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown policy \"", name, "\"; choose one of: ", absl::StrJoin(names, ", ")));
}

absl::string_view DstModeName(DstMode mode) { return NameOf(kDstModeNames, mode); }

absl::StatusOr<DstMode> ParseDstMode(absl::string_view text, double* quantile) {
  if (text == "min") return DstMode::kMin;
  if (text == "mean") return DstMode::kMean;
  if (text == "max") return DstMode::kMax;
  constexpr absl::string_view kPrefix = "quantile:";
  if (text.substr(0, kPrefix.size()) == kPrefix) {
    double q = 0;
    if (!absl::SimpleAtod(text.substr(kPrefix.size()), &q) || !(q >= 0.0 && q <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("DST mode \"", text, "\": the quantile must be a number in [0, 1]"));
    }
    if (quantile != nullptr) *quantile = q;
    return DstMode::kQuantile;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown DST mode \"", text, "\"; choose one of: min, mean, max, quantile:Q"));
}

absl::string_view ShardPolicyName(ShardPolicy policy) {
  switch (policy) {
    case ShardPolicy::kDense:
      return "dense";
    case ShardPolicy::kStatic:
      return "static";
    default:
      return "sparse";
  }
}

absl::StatusOr<ShardPolicy> ParseShardPolicy(absl::string_view name) {
  if (name == "sparse") return ShardPolicy::kSparse;
  if (name == "dense") return ShardPolicy::kDense;
  if (name == "static") return ShardPolicy::kStatic;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown shard policy \"", name, "\"; choose sparse, dense or static"));
}

absl::string_view OverflowPolicyName(OverflowPolicy policy) {
  return policy == OverflowPolicy::kDefer ? "defer" : "error";
}

absl::StatusOr<OverflowPolicy> ParseOverflowPolicy(absl::string_view name) {
  if (name == "error") return OverflowPolicy::kError;
  if (name == "defer") return OverflowPolicy::kDefer;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown overflow policy \"", name, "\"; choose error or defer"));
}

}  // namespace sparsebalance
