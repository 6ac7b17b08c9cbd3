// sb-sim: compares batching policies on a simulated cluster. `sb-sim --help` explains.
#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "planner/traces.h"
#include "sim/simulator.h"
#include "tools/tool_support.h"

// Defaults are SimOptions' (sim/simulator.h).
// Scenario
ABSL_FLAG(std::string, trace, sparsebalance::SimOptions().trace,
          "pretrain or prolong (built-in long-tail generators), or a file: one document per "
          "line, \"LENGTH [SENSITIVITY] [SEG:SEG:...]\", '#' comments. Documents without a "
          "sensitivity draw one from Beta(1, 8) (mean 0.11)");
ABSL_FLAG(int64_t, pack, sparsebalance::SimOptions().pack_length,
          "pre-pack documents into sequences of this many tokens (e.g. 131072); 0 = off");
ABSL_FLAG(int, ranks, sparsebalance::SimOptions().ranks, "data-parallel ranks");
ABSL_FLAG(int, micro_batches, sparsebalance::SimOptions().micro_batches,
          "micro-batches per rank and step");
ABSL_FLAG(int64_t, capacity, sparsebalance::SimOptions().capacity, "tokens per micro-batch");
ABSL_FLAG(double, fill, sparsebalance::SimOptions().fill,
          "global batch = fill x ranks x micro_batches x capacity tokens");
ABSL_FLAG(int, steps, sparsebalance::SimOptions().steps, "training steps to simulate");
ABSL_FLAG(uint64_t, seed, sparsebalance::SimOptions().seed, "seed of the trace and the noise");
ABSL_FLAG(int, slow_ranks, sparsebalance::SimOptions().slow_ranks,
          "ranks that run --slow_factor times slower; no policy is told which: the latency "
          "model has to find them");
ABSL_FLAG(double, slow_factor, sparsebalance::SimOptions().slow_factor,
          "ground-truth slowdown of the --slow_ranks");
ABSL_FLAG(double, noise, sparsebalance::SimOptions().noise,
          "multiplicative noise per micro-batch, standard deviation");
ABSL_FLAG(std::string, cost_truth, "efficiency",
          "hidden cost: efficiency (outside the latency model's class, see Cost truth below) "
          "or linear (the model's own form)");
ABSL_FLAG(std::string, sensitivity_prior, "none",
          "what the planner is told of each document's hidden sensitivity: none (0), true, or "
          "noisy:SD (true plus normal noise of standard deviation SD, clamped to [0, 1])");
ABSL_FLAG(int, recall_rows, sparsebalance::SimOptions().recall_rows,
          "query rows a simulated worker measures each document's recall on: the measurement "
          "noise is sqrt(r (1 - r) / rows)");
// Planner
ABSL_FLAG(double, bucket_recall_margin, sparsebalance::SimOptions().bucket_recall_margin,
          "recall guard: no length bucket's predicted recall may fall more than this below its "
          "recall at the default density (1 turns the guard off)");
ABSL_FLAG(double, document_recall_floor, sparsebalance::SimOptions().document_recall_floor,
          "recall guard: each document's predicted recall at least this, in [0, 1); 0 = off");
ABSL_FLAG(std::string, policies, "",
          "the policies to compare, comma-separated, from sequential,tokens,flops,sab,dst,"
          "sparsebalance and the context-parallel rows static-cp, dense-cp and <policy>-cp "
          "(e.g. sparsebalance-cp); empty: all six, and with --max_shards > 1 the three "
          "context-parallel rows static-cp,dense-cp,sparsebalance-cp");
ABSL_FLAG(int, max_shards, sparsebalance::SimOptions().max_shards,
          "context parallelism of the -cp rows: the most ranks one document is split over "
          "(1: none). Documents are cut to max_shards x capacity tokens; rows without context "
          "parallelism cut them to the capacity");
ABSL_FLAG(double, exchange_gbps, sparsebalance::SimOptions().exchange_bandwidth / 1e9,
          "hidden truth of the key/value exchange: GB/s per rank (the planner's prior is 25)");
ABSL_FLAG(double, exchange_latency_us, sparsebalance::SimOptions().exchange_latency * 1e6,
          "hidden truth of the key/value exchange: microseconds per message (one per layer and "
          "ring step, each way)");
ABSL_FLAG(std::string, mode, "mean", "DST target: min | mean | max | quantile:Q");
ABSL_FLAG(double, density, sparsebalance::SimOptions().density_default,
          "default density every sample gets without tuning");
ABSL_FLAG(double, density_min, sparsebalance::SimOptions().density_min,
          "lowest density for an insensitive sample");
ABSL_FLAG(std::string, profile, "",
          "start the latency model from this profile table (sb-profile output) instead of the "
          "synthetic one");
// Model shape (7B-class defaults)
ABSL_FLAG(int, layers, sparsebalance::SimOptions().shape.layers, "transformer layers");
ABSL_FLAG(int, heads, sparsebalance::SimOptions().shape.heads, "attention heads");
ABSL_FLAG(int, head_dim, sparsebalance::SimOptions().shape.head_dim, "64 or 128");
ABSL_FLAG(int, block, sparsebalance::SimOptions().shape.block_size,
          "tokens per attention block: 64 or 128");
ABSL_FLAG(int, local_blocks, sparsebalance::SimOptions().shape.local_blocks,
          "key blocks before the diagonal that every query block keeps");
ABSL_FLAG(double, attention_ratio, sparsebalance::SimOptions().attention_ratio,
          "ground truth: attention time of a dense 128K document over its linear time");
// Output
ABSL_FLAG(std::string, json, "", "write the whole report to this file as JSON");
ABSL_FLAG(std::string, svg, "",
          "write a picture to this file: per-rank timeline of the last step for each policy, "
          "and step time over the steps");

namespace sparsebalance {
namespace {

constexpr char kUsage[] =
    R"(run a simulated data-parallel cluster under each batching policy and compare step
time and attention recall, side by side.

  sb-sim [--flag=value ...]            (--flag value works too; flag names use _)

The simulator's truth is hidden: the planner learns cost from measured micro-batch times and
recall from measured document recall, as it would in a real job.

Cost truth (--cost_truth=efficiency, the default)
  t(micro-batch on rank r) = h_r * ( sum_docs [ATT(L, rho) + b*L + d(L)] + c ) * (1 + noise*z)
  ATT(L, rho) = a*A(L, rho) * (1/3 (1 + 0.15 (1 - rho)) + 2/3 (1 + 0.8 (1 - rho)))
                            * (1 + 0.5 exp(-L/4096))
  (forward is a third of dense attention, backward two thirds; sparse backward gains less than
  forward, short documents cost more per block); d(L) = 1 ms + 2 ms sqrt(L/128K).
  A(L, rho) = active key blocks of causal block-sparse attention (DESIGN.md section 4):
  k_i = clamp(ceil(rho*(i+1)), anchors_i, i+1) per query block, anchors = sink + diagonal +
  local blocks. b = 1e-4 s/token; a such that a*A(128K, 1) = attention_ratio * b * 128K;
  c = 50 ms per micro-batch; h_r = slow_factor on slow ranks, else 1; z standard normal.
  --cost_truth=linear: ATT = a*A(L, rho), d = 2 ms (the latency model's own form). The planner
  never sees any of it: it starts from a profile table (synthetic: attention x0.6 and linear
  x1.4 of the truth) and learns from the measured times.

Recall truth (hidden; not the planner's form 1 - (1 - rho)^g)
  Each document (L tokens, hidden sensitivity s: the trace's, else Beta(1, 8)) draws
    u = clamp(log2(L/1K), 0, 7)/7
    anchor mass   a    = clamp((0.55 - 0.35u)(1 - 0.5s) exp(0.3 z1), 0.02, 0.9)
    concentration beta = clamp((0.12 + 0.18u)(1 + 1.5s) exp(0.3 z2), 0.04, 0.95)
    needle ("answer far back"), with probability 0.03 (L < 8K), 0.12 (8K-32K), 0.35 (32K+),
      plus 0.3s: mass m ~ U(0.04, 0.16) kept only once x >= tau, tau ~ U(0.25, 0.6)
    recall_true(rho) = a + (1 - a - m) x^beta + m [x >= tau]
  x = share of the non-anchor key blocks that density rho keeps. Long documents are more
  sensitive than short ones. The planner is told s only with --sensitivity_prior; it learns
  its curves (planner/recall_model.h) from simulated reports: each placed document's
  recall_true(rho) plus N(0, r(1 - r)/rows) noise, rows = min(--recall_rows, L). Reported
  recall is the hidden true recall, token-weighted, in all and per length bucket, next to the
  planner's prediction. DST floors: density_min + s*(1 - density_min) for the s it is told.

Context parallelism (--max_shards > 1): the -cp rows split documents over groups of ranks
(planner/context_parallel.h): static-cp splits every document of at least half the capacity
over max_shards consecutive ranks in equal-token shards (flops placement); dense-cp chooses
shards and cuts per document and step by dense cost (Megatron-style, flops placement);
<policy>-cp by predicted sparse cost with the exchange. Hidden exchange truth per shard j:
2 j layers messages of --exchange_latency_us plus 2 x (tokens before it) x 4 heads head_dim B x
layers over --exchange_gbps, not scaled by the rank's speed; a micro-batch holding shards starts
when its group's ranks have all finished their previous micro-batch.

Columns: step = mean step time (slowest rank, seconds); imbalance = max/mean rank compute;
bubble = idle share of ranks x step time; gap = planned makespan over the lower bound
(median); recall = hidden true recall (true/predicted per length bucket in the second table);
pred err = median |predicted - measured| / measured rank time after step 20.

Example (scenario S1 of the README):
  sb-sim --trace=pretrain --ranks=32 --micro_batches=4 --capacity=131072 --fill=0.85
Context parallelism (scenario CP1 of the README):
  sb-sim --ranks=256 --micro_batches=2 --max_shards=8 --policies=sab,sparsebalance,static-cp,dense-cp,sparsebalance-cp)";

// The options the flags give; a wrong value is a usage error that names its flag.
SimOptions OptionsFromFlags() {
  SimOptions o;
  o.trace = absl::GetFlag(FLAGS_trace);
  o.pack_length = absl::GetFlag(FLAGS_pack);
  o.ranks = absl::GetFlag(FLAGS_ranks);
  o.micro_batches = absl::GetFlag(FLAGS_micro_batches);
  o.capacity = absl::GetFlag(FLAGS_capacity);
  o.fill = absl::GetFlag(FLAGS_fill);
  o.steps = absl::GetFlag(FLAGS_steps);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.slow_ranks = absl::GetFlag(FLAGS_slow_ranks);
  o.slow_factor = absl::GetFlag(FLAGS_slow_factor);
  o.noise = absl::GetFlag(FLAGS_noise);
  const std::string cost_truth = absl::GetFlag(FLAGS_cost_truth);
  absl::StatusOr<CostTruth> truth = ParseCostTruth(cost_truth);
  if (!truth.ok()) tools::UsageError(std::string(truth.status().message()));
  o.cost_truth = *truth;
  const std::string prior = absl::GetFlag(FLAGS_sensitivity_prior);
  absl::StatusOr<SensitivityPrior> sensitivity_prior =
      ParseSensitivityPrior(prior, &o.sensitivity_noise);
  if (!sensitivity_prior.ok()) {
    tools::UsageError(std::string(sensitivity_prior.status().message()));
  }
  o.sensitivity_prior = *sensitivity_prior;
  o.recall_rows = absl::GetFlag(FLAGS_recall_rows);
  o.bucket_recall_margin = absl::GetFlag(FLAGS_bucket_recall_margin);
  o.document_recall_floor = absl::GetFlag(FLAGS_document_recall_floor);
  if (o.recall_rows < 1) tools::UsageError("--recall_rows must be at least 1");
  o.max_shards = absl::GetFlag(FLAGS_max_shards);
  if (o.max_shards < 1 || o.max_shards > std::min(o.ranks, kMaxShards)) {
    tools::UsageError(absl::StrCat("--max_shards=", o.max_shards, " needs [1, min(--ranks ",
                                   o.ranks, ", ", kMaxShards, ")]"));
  }
  o.exchange_bandwidth = absl::GetFlag(FLAGS_exchange_gbps) * 1e9;
  o.exchange_latency = absl::GetFlag(FLAGS_exchange_latency_us) * 1e-6;
  if (!(o.exchange_bandwidth > 0) || !(o.exchange_latency >= 0)) {
    tools::UsageError("--exchange_gbps needs > 0 and --exchange_latency_us >= 0");
  }
  o.policies.clear();
  const std::string policies = absl::GetFlag(FLAGS_policies);
  for (absl::string_view p : absl::StrSplit(policies, ',', absl::SkipEmpty())) {
    absl::StatusOr<SimPolicy> policy = ParseSimPolicy(p);
    if (!policy.ok()) {
      tools::UsageError(absl::StrCat("--policies=", policies, ": ", policy.status().message()));
    }
    o.policies.push_back(*policy);
  }
  if (o.policies.empty()) o.policies = DefaultSimPolicies(o.max_shards);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  absl::StatusOr<DstMode> dst_mode = ParseDstMode(mode, &o.quantile);
  if (!dst_mode.ok()) {
    tools::UsageError(absl::StrCat("--mode=", mode, ": ", dst_mode.status().message()));
  }
  o.mode = *dst_mode;
  o.density_default = absl::GetFlag(FLAGS_density);
  o.density_min = absl::GetFlag(FLAGS_density_min);
  if (const std::string path = absl::GetFlag(FLAGS_profile); !path.empty()) {
    absl::StatusOr<std::string> text = tools::ReadFile(path);
    if (!text.ok()) tools::UsageError(absl::StrCat("--profile: ", text.status().message()));
    absl::StatusOr<ProfileTable> table = ParseProfileTable(*text);
    if (!table.ok()) {
      tools::UsageError(absl::StrCat("--profile=", path, ": ", table.status().message()));
    }
    o.profile = *table;
    o.has_profile = true;
  }
  o.shape.layers = absl::GetFlag(FLAGS_layers);
  o.shape.heads = absl::GetFlag(FLAGS_heads);
  o.shape.head_dim = absl::GetFlag(FLAGS_head_dim);
  o.shape.block_size = absl::GetFlag(FLAGS_block);
  o.shape.local_blocks = absl::GetFlag(FLAGS_local_blocks);
  o.attention_ratio = absl::GetFlag(FLAGS_attention_ratio);
  // A trace that is not built in is a file.
  bool builtin = false;
  for (const std::string& n : BuiltinTraceNames()) builtin = builtin || n == o.trace;
  if (!builtin) {
    absl::StatusOr<std::string> text = tools::ReadFile(o.trace);
    if (!text.ok()) {
      tools::UsageError(absl::StrCat("--trace=", o.trace,
                                     ": neither a built-in trace (pretrain, prolong) nor a "
                                     "readable file (",
                                     text.status().message(), ")"));
    }
    absl::StatusOr<std::vector<TraceRecord>> records = ParseTraceFile(*text);
    if (!records.ok()) {
      tools::UsageError(absl::StrCat("--trace=", o.trace, ": ", records.status().message()));
    }
    o.trace_records = std::move(*records);
  }
  return o;
}

// Writes `text` to the file a report flag names, and says so.
void WriteReport(const std::string& flag, const std::string& path, const std::string& text) {
  if (path.empty()) return;
  if (absl::Status s = tools::WriteFile(path, text); !s.ok()) {
    tools::Fatal(absl::StrCat("--", flag, ": ", s.message()));
  }
  std::cout << "wrote " << path << "\n";
}

int Main(int argc, char** argv) {
  tools::InitTool(argc, argv, kUsage);
  const SimOptions options = OptionsFromFlags();
  absl::StatusOr<SimReport> report = RunSimulation(options);
  if (!report.ok()) tools::Fatal(report.status().message());
  std::cout << FormatTable(*report);
  WriteReport("json", absl::GetFlag(FLAGS_json), FormatJson(*report));
  WriteReport("svg", absl::GetFlag(FLAGS_svg), FormatSvg(*report));
  return 0;
}

}  // namespace
}  // namespace sparsebalance

int main(int argc, char** argv) { return sparsebalance::Main(argc, argv); }
