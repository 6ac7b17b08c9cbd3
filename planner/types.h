// Value types shared by the planner, the service, the client's local fallback and the simulator.
//
// A step's global batch is a list of `Sample`s; `PlanStep` (planner.h) turns it into a
// `StepPlan`: for every rank its micro-batches, and in each its `PlannedSample`s (id, length,
// segments and density: a rank runs its part without looking the ids up in the batch).
//
//   PlannerConfig config;  config.ranks = 32;  config.micro_batches = 4;
//   absl::StatusOr<StepPlan> plan = PlanStep(batch, config, model);
#ifndef SPARSEBALANCE_PLANNER_TYPES_H_
#define SPARSEBALANCE_PLANNER_TYPES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "contract/layer_shape.h"
#include "contract/selection_mode.h"

namespace sparsebalance {

// A document, or a pre-packed sequence made of several documents (`segments`).
struct Sample {
  uint64_t id = 0;           // index into the dataset shared by all ranks; unique in a batch
  int64_t length = 0;        // tokens
  double sensitivity = 0.0;  // [0,1]: 0 tolerates sparsity, 1 needs dense attention
  uint64_t group = 0;        // samples with the same non-zero group land on one rank
  // Document lengths (tokens) inside a pre-packed sample; they sum to `length`. Empty means
  // one document. Attention never crosses documents, so cost is computed per segment.
  std::vector<int64_t> segments;
};

// How documents are placed on ranks and whether densities are tuned (DESIGN.md section 5).
enum class Policy {
  kSequential,     // contiguous chunks in arrival order, fixed density
  kTokens,         // balance token counts (verl balance_batch), fixed density
  kFlops,          // balance dense cost L^2 + c*L (WLB-LLM style), fixed density
  kSab,            // sparsity-aware batching, fixed density
  kDst,            // sequential placement + dynamic sparsity tuning
  kSparseBalance,  // SAB + DST
};

// How DST chooses the step's target makespan.
enum class DstMode {
  kMin,       // fastest: stragglers cut to their floors
  kMean,      // stragglers cut towards the mean rank time (default)
  kMax,       // no cut, only raise: pure accuracy
  kQuantile,  // cut towards the `dst_quantile` of rank times
};

// How documents are split over groups of ranks when PlannerConfig::max_shards > 1 (context
// parallelism, context_parallel.h). A document longer than the micro-batch capacity is split
// under every shard policy; the policies differ in which other documents are split, into how
// many shards, where the cuts fall and which ranks form a group.
enum class ShardPolicy {
  // Per document and step, by predicted sparse cost (at the planned density, with the
  // key/value exchange): a document is split when its cost would exceed about half a rank's
  // mean load, over as few ranks as bring each shard below that; cuts balance the shards'
  // sparse cost plus exchange; groups are the least loaded ranks. The default.
  kSparse,
  // The same with dense cost (density 1) for every choice, as Megatron-style dynamic context
  // parallelism does; the plan then runs at the planned densities.
  kDense,
  // Every document of at least `shard_min_length` tokens over `max_shards` ranks, equal-token
  // cuts, fixed groups of consecutive ranks (static context parallelism).
  kStatic,
};

// What happens when the batch does not fit in ranks x micro-batches x capacity.
enum class OverflowPolicy {
  kError,  // INVALID_ARGUMENT naming the capacity
  kDefer,  // plan what fits; `StepPlan::deferred_ids` go to the next step
};

struct PlannerConfig {
  int ranks = 1;                          // data-parallel world size
  int micro_batches = 1;                  // per rank and step
  int64_t micro_batch_capacity = 131072;  // tokens per micro-batch
  ModelShape shape;
  double density_min = 0.05;     // lowest density DST may give an insensitive sample
  double density_max = 1.0;      // highest density DST may raise a sample to
  double density_default = 0.3;  // density every sample gets without DST
  Policy policy = Policy::kSparseBalance;
  DstMode dst_mode = DstMode::kMean;
  double dst_quantile = 0.5;  // used by DstMode::kQuantile, in [0,1]
  OverflowPolicy overflow = OverflowPolicy::kError;
  // Recall guards (recall_model.h), enforced on every tuned plan but in DstMode::kMin: no length
  // bucket's predicted recall falls more than `bucket_recall_margin` below its recall at the
  // default densities (1: no bucket guard), and no document is given less predicted recall than
  // `document_recall_floor` (0: no floor) unless even density_max cannot reach it.
  double bucket_recall_margin = 0.01;
  double document_recall_floor = 0.0;
  // How workers select blocks within each document's density (contract/selection_mode.h):
  // top-k keeps k_i blocks per row; anchor-guided thresholding keeps at most k_i, only those
  // whose estimated weight is at least `anchor_threshold` (tau, in (0, 1]) times the best
  // anchor block's. The planner plans with densities either way; workers report the achieved
  // density.
  SelectionMode selection = SelectionMode::kTopK;
  double anchor_threshold = kDefaultAnchorThreshold;
  // Context parallelism: the most ranks one document may be split over, in
  // [1, min(ranks, kMaxShards)]; 1 turns splitting off (a document longer than the capacity is
  // then an error). Only documents without segments and outside a group (Sample::group) are
  // split.
  int max_shards = 1;
  ShardPolicy shard_policy = ShardPolicy::kSparse;
  // kStatic only: documents of at least this many tokens are split; 0 means half the
  // micro-batch capacity.
  int64_t shard_min_length = 0;
};

// The most ranks one document may be split over: 64 (ProLong's 512K stage uses 8).
inline constexpr int kMaxShards = 64;

// Upper bounds on what a config and a batch may hold. Each is far above any real training
// job yet small enough that every integer the planner computes from accepted values provably
// fits in int64 (and every index in int), whatever a client sends. With B >= 1 the block
// size, L <= kMaxMicroBatchCapacity = 2^30 a document's tokens, rows = ceil(L / B) <= 2^30:
//  - active blocks of one document: <= rows (rows + 1) / 2 < 2^59 (contract/block_geometry.h;
//    its FloorSum terms stay below 2^59 too, as its comment shows);
//  - KeptBlocks' q * n: q <= kDensityQuantum = 2^16, n <= 2^30, so < 2^46; the anchors'
//    (local_blocks + 2) * 2^16 <= (2^24 + 2) * 2^16 < 2^41;
//  - ranks x micro_batches x capacity <= kMaxPlanSlots x 2^30 = 2^50 tokens;
//  - a batch's tokens <= kMaxBatchSamples x 2^30 = 2^54; a sample's segment sum <= its length;
//  - the dense work of one block, B^2 x head_dim x heads x layers <= 2^14 x 2^36 = 2^50.
// ValidateConfig and ValidateBatch enforce them and name the bound when one is crossed.

// Tokens per micro-batch: 2^30 (about a billion) is ~100x the longest contexts trained today,
// and keeps a document's active-block count below 2^59 (see above).
inline constexpr int64_t kMaxMicroBatchCapacity = int64_t{1} << 30;
// Micro-batches per rank and step (gradient-accumulation steps): 2^16, far beyond practice.
inline constexpr int kMaxMicroBatches = 1 << 16;
// Ranks x micro-batches: a plan holds one MicroBatchPlan (about 100 bytes, and the placer 12
// bytes of scratch) per slot, so 2^20 slots bound a plan's memory to ~100 MB before samples.
// It also bounds the rank count, which the service limits further (WireLimits).
inline constexpr int kMaxPlanSlots = 1 << 20;
// Samples per batch: the placer indexes samples with int; 2^24 keeps a batch's token total
// below 2^54 and sits well above the service's own per-request limit (WireLimits).
inline constexpr int kMaxBatchSamples = 1 << 24;
// kMaxLayers, kMaxHeads, kMaxHeadDim and kMaxLocalBlocks bound ModelShape: contract/layer_shape.h.

// Validates every field; the message names the field, the limit it crossed and what to do.
absl::Status ValidateConfig(const PlannerConfig& config);

// One sample as the planner placed it: all a rank needs to run it, without the batch.
struct PlannedSample {
  uint64_t id = 0;  // the batch sample's id
  // Tokens, as in the batch. 0 only in a plan read from a message of an older planner (which
  // sent ids and densities alone) until CompletePlannedSamples (planner.h) fills it.
  int64_t length = 0;
  double density = 0.0;  // (0, 1]: share of causal key blocks kept, in every layer by default
  // Document lengths (tokens) inside a pre-packed sample, as in the batch: they sum to
  // `length`, and attention never crosses them. Empty means one document of `length`.
  std::vector<int64_t> segments;
  // Optional: one density per layer, each in (0, 1]; empty means `density` in every layer.
  // The planner does not vary densities by layer (yet); trainers that do may fill it.
  std::vector<double> layer_densities;
  // Context parallelism (ShardPolicy): set when this is one shard of a document split over a
  // group of ranks. The shard's queries are the sample's tokens [shard_begin, shard_end)
  // (shard_begin a multiple of the block size); its keys and values are the document's tokens
  // [0, shard_end), held by the group: shard_group[j] is the rank that runs shard j (ring
  // order), shard_index is this shard's j. Every rank of the group runs its shard in the same
  // micro-batch, before the micro-batch's unsplit samples, sharded samples in ascending id.
  // Empty shard_group: the whole sample runs on this rank (shard_begin = shard_end = 0).
  int64_t shard_begin = 0;
  int64_t shard_end = 0;
  int shard_index = 0;
  std::vector<int> shard_group;

  bool sharded() const { return !shard_group.empty(); }
  // Query tokens this rank runs: the shard's, or the whole sample's.
  int64_t QueryTokens() const { return sharded() ? shard_end - shard_begin : length; }
  // The documents the kernels run, in order: `segments`, or {length} for one document.
  std::vector<int64_t> Documents() const {
    return segments.empty() ? std::vector<int64_t>{length} : segments;
  }
  bool operator==(const PlannedSample& o) const {
    return id == o.id && length == o.length && density == o.density && segments == o.segments &&
           layer_densities == o.layer_densities && shard_begin == o.shard_begin &&
           shard_end == o.shard_end && shard_index == o.shard_index && shard_group == o.shard_group;
  }
};

// What the model sees of a micro-batch.
struct MicroBatchFeatures {
  double active_blocks = 0.0;   // sum over documents of A(L, rho) (a shard: its rows' part)
  double tokens = 0.0;          // query tokens
  double documents = 0.0;       // segments of pre-packed samples count separately; a shard is one
  double exchange_bytes = 0.0;  // key/value exchange of its shards (ShardExchangeBytes)
  bool operator==(const MicroBatchFeatures& o) const {
    return active_blocks == o.active_blocks && tokens == o.tokens && documents == o.documents &&
           exchange_bytes == o.exchange_bytes;
  }
};

struct MicroBatchPlan {
  std::vector<PlannedSample> samples;  // in placement order
  double default_density = 0.0;        // the job's default density at planning time
  int64_t tokens = 0;                  // sum of the samples' QueryTokens()
  double predicted_seconds = 0.0;      // including the rank's speed factor (and key/value exchange)
  // What BuildPlan summed for the prediction (LatencyModel::PlanFeatures of the samples, in
  // their order), so that folding the step's reports need not compute it again. Not on the wire
  // nor in the store: a plan read back has features_known false.
  MicroBatchFeatures features;
  bool features_known = false;
};

struct RankPlan {
  std::vector<MicroBatchPlan> micro_batches;  // exactly config.micro_batches (some may be empty)
  double predicted_seconds = 0.0;             // sum over micro-batches
};

// Recall measured on one document of a planned sample.
struct DocumentRecallMeasurement {
  uint64_t sample_id = 0;            // a sample of the micro-batch's plan
  int document = 0;                  // index into the sample's Documents()
  double recall = 0.0;               // [0, 1]: softmax mass kept, mean over sampled rows and layers
  std::vector<double> layer_recall;  // optional: one per model layer, each in [0, 1]
  int rows = 0;                      // query rows measured per layer, at least 1
  bool operator==(const DocumentRecallMeasurement& o) const {
    return sample_id == o.sample_id && document == o.document && recall == o.recall &&
           layer_recall == o.layer_recall && rows == o.rows;
  }
};

// One micro-batch as a rank measured it (MicroBatchReport on the wire).
struct MicroBatchTiming {
  int micro_batch = 0;             // index in the rank's plan
  double compute_seconds = 0.0;    // forward + backward
  double attention_seconds = 0.0;  // the attention part of compute_seconds
  int64_t tokens = 0;
  double achieved_density = 0.0;  // token-weighted fraction of causal key blocks run
  double recall = 0.0;            // token-weighted attention recall, [0, 1]
  // Recall measured on sampled query rows of the micro-batch's documents (DocumentRecall on
  // the wire): what the planner learns its recall curves from. Optional.
  std::vector<DocumentRecallMeasurement> documents;
  double recall_seconds = 0.0;  // time spent measuring them, not part of compute_seconds
  // Context parallelism: time the micro-batch's shards spent exchanging keys, values and their
  // gradients with their groups (part of compute_seconds). 0 without shards.
  double exchange_seconds = 0.0;
};

// One rank's report of one step (ReportStepRequest on the wire): what a ReportStepBatch call
// carries several of.
struct RankStepReport {
  int64_t step = 0;
  int rank = 0;
  std::vector<MicroBatchTiming> micro_batches;
  double wait_seconds = 0.0;  // time the rank idled for the others
  bool planned_locally = false;
};

// Predicted recall of one length bucket in a plan (recall_model.h's buckets).
struct BucketRecallFigures {
  int bucket = 0;
  std::string label;       // RecallBucketLabel, e.g. "8K-32K"
  int64_t length_min = 0;  // tokens, inclusive (RecallBucketRange)
  int64_t length_max = 0;
  int64_t tokens = 0;             // placed tokens of the bucket's documents
  double predicted_recall = 0.0;  // token-weighted, at the plan's densities
  double default_recall = 0.0;    // token-weighted, at the default (base) densities
  bool operator==(const BucketRecallFigures& o) const {
    return bucket == o.bucket && label == o.label && length_min == o.length_min &&
           length_max == o.length_max && tokens == o.tokens &&
           predicted_recall == o.predicted_recall && default_recall == o.default_recall;
  }
};

struct StepPlan {
  Policy policy = Policy::kSparseBalance;
  std::vector<RankPlan> ranks;
  std::vector<uint64_t> deferred_ids;  // OverflowPolicy::kDefer: samples left for the next step
  double makespan_seconds = 0.0;       // predicted step time: the slowest rank
  double lower_bound_seconds = 0.0;    // perfect balance at the plan's densities (DESIGN.md 4)
  double gap = 0.0;                    // makespan / lower bound - 1
  double imbalance_ratio = 1.0;        // max / mean predicted rank time
  double bubble_ratio = 0.0;           // idle share of ranks x makespan
  double mean_density = 0.0;           // token-weighted
  double predicted_recall = 0.0;       // token-weighted, planner's recall model (recall_model.h)
  // Per length bucket that holds placed documents, ascending.
  std::vector<BucketRecallFigures> buckets;
  // The trainer's fallback plan (PlanStepLocally) rather than one made with the job's learned
  // model: what the ranks ran while the planner was unreachable.
  bool planned_locally = false;
};

absl::string_view PolicyName(Policy policy);
absl::StatusOr<Policy> ParsePolicy(absl::string_view name);
absl::string_view DstModeName(DstMode mode);
// Accepts "min", "mean", "max" and "quantile:Q" (Q in [0,1]); sets `quantile` for the last.
absl::StatusOr<DstMode> ParseDstMode(absl::string_view text, double* quantile);
absl::string_view ShardPolicyName(ShardPolicy policy);
// "sparse", "dense" or "static"; INVALID_ARGUMENT otherwise.
absl::StatusOr<ShardPolicy> ParseShardPolicy(absl::string_view name);
absl::string_view OverflowPolicyName(OverflowPolicy policy);
absl::StatusOr<OverflowPolicy> ParseOverflowPolicy(absl::string_view name);

// All policies, in the order reports list them.
const std::vector<Policy>& AllPolicies();

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_TYPES_H_
