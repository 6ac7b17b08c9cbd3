// sb-sim: compares batching policies on a simulated cluster. `sb-sim --help` explains.
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

namespace sparsebalance {
namespace {

std::string AllPolicyNames() {
  std::vector<std::string> names;
  for (Policy p : AllPolicies()) names.emplace_back(PolicyName(p));
  return absl::StrJoin(names, ",");
}

}  // namespace
}  // namespace sparsebalance

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
// Planner
ABSL_FLAG(std::string, policies, sparsebalance::AllPolicyNames(),
          "the policies to compare, comma-separated, from "
          "sequential,tokens,flops,sab,dst,sparsebalance");
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

Cost model (the hidden ground truth the simulator "runs")
  t(micro-batch on rank r) = h_r * ( sum_docs [a*A(L, rho) + b*L + d] + c ) * (1 + noise*z)
  A(L, rho) = active key blocks of causal block-sparse attention (DESIGN.md section 4):
  k_i = clamp(ceil(rho*(i+1)), anchors_i, i+1) per query block, anchors = sink + diagonal +
  local blocks. b = 1e-4 s/token; a such that a*A(128K, 1) = attention_ratio * b * 128K;
  d = 2 ms per document; c = 50 ms per micro-batch; h_r = slow_factor on slow ranks, else 1;
  z standard normal. The planner never sees a, b, c, d or h: it starts from a profile table
  (synthetic: attention x0.6 and linear x1.4 of the truth) and learns from the measured times.

Recall model
  recall(doc) = 1 - (1 - rho)^g(s), g(s) = 1.25 + 4.75*(1 - s)^2 for sensitivity s; mean recall
  is token-weighted. DST floors: density_min + s*(1 - density_min).

Columns: step = mean step time (slowest rank, seconds); imbalance = max/mean rank compute;
bubble = idle share of ranks x step time; gap = planned makespan over the lower bound
(median); pred err = median |predicted - measured| / measured rank time after step 20.

Example (scenario S1 of the README):
  sb-sim --trace=pretrain --ranks=32 --micro_batches=4 --capacity=131072 --fill=0.85)";

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
  o.policies.clear();
  const std::string policies = absl::GetFlag(FLAGS_policies);
  for (absl::string_view p : absl::StrSplit(policies, ',', absl::SkipEmpty())) {
    absl::StatusOr<Policy> policy = ParsePolicy(p);
    if (!policy.ok()) {
      tools::UsageError(absl::StrCat("--policies=", policies, ": ", policy.status().message()));
    }
    o.policies.push_back(*policy);
  }
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
