// The cluster simulator behind `sb-sim`: every policy plans each step with the real planner
// (learning the cost from the simulated reports, starting from a profile table whose
// coefficients differ from the truth, and learning recall from simulated recall reports,
// starting from the sensitivity prior), and the simulator "runs" the plan with a hidden
// ground truth the planner does not share: a cost outside the latency model's class,
// multiplicative noise, optional slow ranks, and a recall curve per document that is not of
// the planner's form 1 - (1 - rho)^g.
//
// Hidden recall truth (HiddenRecallCurve). For a document of L tokens and hidden sensitivity s
// (the trace's, or drawn from Beta(1, 8)), with u = clamp(log2(L / 1024), 0, 7) / 7 (0 at 1K
// tokens and below, 1 at 128K) and z1, z2 standard normal:
//   anchor mass  a    = clamp((0.55 - 0.35 u) (1 - 0.5 s) e^{0.3 z1}, 0.02, 0.9)
//   concentration beta = clamp((0.12 + 0.18 u) (1 + 1.5 s) e^{0.3 z2}, 0.04, 0.95)
//   needle ("answer far back"): with probability 0.03 (L < 8K), 0.12 (8K <= L < 32K) or 0.35
//     (L >= 32K), plus 0.3 s, a mass m ~ U(0.04, 0.16) that top-k keeps only once x >= tau,
//     tau ~ U(0.25, 0.6); otherwise m = 0
//   recall_true(rho) = a + (1 - a - m) x^beta + m [x >= tau]
// where x is the share of the document's non-anchor key blocks that density rho keeps
// ((A(L, rho) - A(L, 0+)) / (A(L, 1) - A(L, 0+)), 1 when every block is an anchor). Short
// documents keep most of their mass in the sink and local blocks and concentrate the rest;
// long ones spread it and more often hold a needle, so at the same density they lose more.
// The planner is given none of this: by default Sample.sensitivity is 0 (SensitivityPrior),
// and it learns only from RecallObservations: after each step every placed document reports
// recall_true(rho) + N(0, r (1 - r) / rows), clamped to [0, 1] (rows = min(recall_rows, L)).
//
// Hidden cost truth (CostTruth::kEfficiency, the default). Seconds of one document, all layers,
// forward + backward, with A = A(L, rho) and the linear truth's a, b (GroundTruthCoefficients):
//   a A (1/3 (1 + 0.15 (1 - rho)) + 2/3 (1 + 0.8 (1 - rho))) (1 + 0.5 e^{-L/4096})
//   + b L + (1 ms + 2 ms sqrt(L / 128K))
// (sparse backward gains less than forward; short documents cost more per block; per-document
// overhead grows with length), plus c = 50 ms per micro-batch, times the slow-rank factor and
// the noise. CostTruth::kLinear is a A + b L + 2 ms, inside the latency model's class.
//
//   SimOptions options;  options.ranks = 32;
//   absl::StatusOr<SimReport> report = RunSimulation(options);
#ifndef SPARSEBALANCE_SIM_SIMULATOR_H_
#define SPARSEBALANCE_SIM_SIMULATOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "planner/profile_table.h"
#include "planner/traces.h"
#include "planner/types.h"
#include "sim/sim_report.h"

namespace sparsebalance {

enum class CostTruth { kLinear, kEfficiency };
// What the planner is told of each document's sensitivity: nothing (0), the hidden truth's s,
// or s plus N(0, SD) clamped to [0, 1].
enum class SensitivityPrior { kNone, kTrue, kNoisy };

absl::string_view CostTruthName(CostTruth truth);
// "linear" or "efficiency"; INVALID_ARGUMENT naming --cost_truth otherwise.
absl::StatusOr<CostTruth> ParseCostTruth(absl::string_view text);
// "none", "true" or "noisy:SD" (SD >= 0); sets *sd for the last. INVALID_ARGUMENT naming
// --sensitivity_prior otherwise.
absl::StatusOr<SensitivityPrior> ParseSensitivityPrior(absl::string_view text, double* sd);

// A row of the comparison: a placement policy, alone or with context parallelism (documents
// split over up to SimOptions::max_shards ranks by a ShardPolicy). A Policy alone converts.
struct SimPolicy {
  SimPolicy(Policy p = Policy::kSparseBalance)  // NOLINT(google-explicit-constructor): a row
      : policy(p) {}
  SimPolicy(Policy p, ShardPolicy shards)
      : policy(p), context_parallel(true), shard_policy(shards) {}
  Policy policy;
  bool context_parallel = false;
  ShardPolicy shard_policy = ShardPolicy::kSparse;
};
// "sequential", ..., "sparsebalance" alone; "static-cp" (flops placement, static context
// parallelism), "dense-cp" (flops placement, dense-cost dynamic context parallelism, as
// Megatron's), and "<policy>-cp" (the policy with sparse-cost context parallelism, e.g.
// "sparsebalance-cp").
std::string SimPolicyName(const SimPolicy& policy);
// INVALID_ARGUMENT naming the choices otherwise.
absl::StatusOr<SimPolicy> ParseSimPolicy(absl::string_view name);
// All policies, then with max_shards > 1 static-cp, dense-cp and sparsebalance-cp.
std::vector<SimPolicy> DefaultSimPolicies(int max_shards);

struct SimOptions {
  std::string trace = "pretrain";          // built-in name, or a label for `trace_records`
  std::vector<TraceRecord> trace_records;  // when non-empty, the trace (from a file)
  int64_t pack_length = 0;                 // tokens; 0 = documents are samples
  int ranks = 32;
  int micro_batches = 4;
  int64_t capacity = 131072;  // tokens per micro-batch
  double fill = 0.85;         // share of ranks x micro-batches x capacity per step
  int steps = 30;
  std::vector<SimPolicy> policies = DefaultSimPolicies(1);
  // Context parallelism of the "-cp" rows: the most ranks a document is split over. The
  // trace's documents are cut to max_shards x capacity tokens (a row without context
  // parallelism cuts them to the capacity: what it can train).
  int max_shards = 1;
  // The hidden truth of the key/value exchange: bytes per second per rank and seconds per
  // message (one per layer and ring step, each way).
  double exchange_bandwidth = 40e9;
  double exchange_latency = 20e-6;
  DstMode mode = DstMode::kMean;
  double quantile = 0.5;
  int slow_ranks = 0;
  double slow_factor = 1.5;  // ground-truth speed factor of the slow ranks
  double noise = 0.05;       // standard deviation of the multiplicative noise
  uint64_t seed = 1;
  double density_default = 0.3;
  double density_min = 0.05;
  double density_max = 1.0;
  ModelShape shape;  // 7B-class: 32 layers, 32 heads x 128, blocks of 64
  // Ground truth: attention time of a dense 128K-token document over its linear time.
  double attention_ratio = 2.7;
  double seconds_per_token = 1.0e-4;  // ground-truth linear time, all layers, fwd+bwd
  int warmup_steps = 20;              // prediction error is reported after these steps
  CostTruth cost_truth = CostTruth::kEfficiency;
  SensitivityPrior sensitivity_prior = SensitivityPrior::kNone;
  double sensitivity_noise = 0.0;  // SD of kNoisy
  int recall_rows = 32;            // query rows a worker measures recall on, per document
  // The planner's recall guards (PlannerConfig): 1 turns the bucket guard off.
  double bucket_recall_margin = PlannerConfig().bucket_recall_margin;
  double document_recall_floor = PlannerConfig().document_recall_floor;
  // Prior: when set, the latency model starts from this measured table; otherwise from a
  // synthetic table made from the truth with attention time x0.6 and linear time x1.4.
  bool has_profile = false;
  ProfileTable profile;
};

// The hidden cost of the simulated cluster (seconds, all layers, forward + backward): the
// linear truth's coefficients (and the efficiency truth's a, b).
CostCoefficients GroundTruthCoefficients(const SimOptions& options);
// The truth's seconds of one document at one density (no micro-batch overhead, speed factor or
// noise), under options.cost_truth.
double TrueDocumentSeconds(const SimOptions& options, int64_t length, double density);

// One document's hidden recall curve (see above).
struct HiddenRecallCurve {
  double anchor = 0.0;            // a
  double concentration = 1.0;     // beta
  double needle = 0.0;            // m (0: none)
  double needle_threshold = 1.0;  // tau
};
// Deterministic in (seed, sample id, document index within the sample).
HiddenRecallCurve DrawHiddenRecallCurve(uint64_t seed, uint64_t sample_id, int document,
                                        int64_t length, double sensitivity);
// x: the share of non-anchor key blocks density rho keeps, in [0, 1].
double KeptShare(int64_t length, double density, const ModelShape& shape);
// recall_true at a kept share x.
double TrueRecall(const HiddenRecallCurve& curve, double kept_share);

// The profile table the planner starts from when none is given (see SimOptions::profile).
ProfileTable SyntheticProfile(const SimOptions& options);
// The truth's seconds of shard [begin, end) of a document of `length` tokens at `density`
// (block-aligned begin): its rows' attention, its tokens' other work and a per-document
// overhead (as TrueDocumentSeconds), without the exchange.
double TrueShardSeconds(const SimOptions& options, int64_t length, int64_t begin, int64_t end,
                        double density);
// The truth's exchange seconds of shard `index` of a document whose shard starts at token
// `begin`: 2 x index x layers messages of exchange_latency, plus ShardExchangeBytes over
// exchange_bandwidth.
double TrueExchangeSeconds(const SimOptions& options, int index, int64_t begin);

// Ranks that run slow_factor times slower: spread evenly over the ranks.
std::vector<int> SlowRanks(const SimOptions& options);

absl::StatusOr<SimReport> RunSimulation(const SimOptions& options);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SIM_SIMULATOR_H_
