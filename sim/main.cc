// sb-sim: compares batching policies on a simulated cluster. `sb-sim --help` explains.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "planner/traces.h"
#include "sim/simulator.h"

namespace sparsebalance {
namespace {

constexpr char kUsage[] =
    R"(sb-sim: run a simulated data-parallel cluster under each batching policy and
compare step time and attention recall, side by side.

Usage: sb-sim [--flag=value ...]      (--flag value, and _ for -, work too)

Scenario
  --trace=NAME|FILE     pretrain (default) or prolong (built-in long-tail generators), or a
                        file: one document per line, "LENGTH [SENSITIVITY] [SEG:SEG:...]",
                        '#' comments. Documents without a sensitivity draw one from
                        Beta(1, 8) (mean 0.11).
  --pack=TOKENS         pre-pack documents into sequences of TOKENS (e.g. 131072); 0 = off
  --ranks=N             data-parallel ranks (default 32)
  --micro-batches=N     micro-batches per rank and step (default 4)
  --capacity=TOKENS     tokens per micro-batch (default 131072)
  --fill=F              global batch = F x ranks x micro-batches x capacity tokens (0.85)
  --steps=N             training steps to simulate (default 30)
  --seed=N              seed of the trace and the noise (default 1)
  --slow-ranks=N        ranks that run --slow-factor times slower (default 0); no policy is
                        told which: the latency model has to find them
  --slow-factor=X       (default 1.5)
  --noise=X             multiplicative noise per micro-batch, standard deviation (0.05)

Planner
  --policies=LIST       comma-separated, from sequential,tokens,flops,sab,dst,sparsebalance
                        (default: all)
  --mode=M              DST target: min | mean (default) | max | quantile:Q
  --density=X           default density every sample gets without tuning (0.3)
  --density-min=X       lowest density for an insensitive sample (0.05)
  --profile=FILE        start the latency model from this profile table (sb-profile output)
                        instead of the synthetic one

Model shape (7B-class defaults)
  --layers=N (32)  --heads=N (32)  --head-dim=N (128)  --block=64|128 (64)  --local-blocks=N (1)
  --attention-ratio=X   ground truth: attention time of a dense 128K document over its
                        linear time (2.7)

Output
  --json=FILE           the whole report as JSON
  --svg=FILE            per-rank timeline of the last step for each policy, and step time over
                        the steps

Cost model (the hidden ground truth the simulator "runs")
  t(micro-batch on rank r) = h_r * ( sum_docs [a*A(L, rho) + b*L + d] + c ) * (1 + noise*z)
  A(L, rho) = active key blocks of causal block-sparse attention (DESIGN.md section 4):
  k_i = clamp(ceil(rho*(i+1)), anchors_i, i+1) per query block, anchors = sink + diagonal +
  local blocks. b = 1e-4 s/token; a such that a*A(128K, 1) = attention-ratio * b * 128K;
  d = 2 ms per document; c = 50 ms per micro-batch; h_r = slow-factor on slow ranks, else 1;
  z standard normal. The planner never sees a, b, c, d or h: it starts from a profile table
  (synthetic: attention x0.6 and linear x1.4 of the truth) and learns from the measured times.

Recall model
  recall(doc) = 1 - (1 - rho)^g(s), g(s) = 1.25 + 4.75*(1 - s)^2 for sensitivity s; mean recall
  is token-weighted. DST floors: density_min + s*(1 - density_min).

Columns: step = mean step time (slowest rank, seconds); imbalance = max/mean rank compute;
bubble = idle share of ranks x step time; gap = planned makespan over the lower bound
(median); pred err = median |predicted - measured| / measured rank time after step 20.

Example (scenario S1 of the README):
  sb-sim --trace=pretrain --ranks=32 --micro-batches=4 --capacity=131072 --fill=0.85
)";

// Flags as a name -> value map; names use '-' (an '_' in the input is read as '-').
absl::StatusOr<std::map<std::string, std::string>> ParseArgs(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help" || arg == "-help") {
      flags["help"] = "true";
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument \"", arg, "\"; flags look like --ranks=32"));
    }
    std::string name = arg.substr(2);
    std::string value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
    }
    flags[absl::StrReplaceAll(name, {{"_", "-"}})] = value;
  }
  return flags;
}

absl::Status Apply(const std::map<std::string, std::string>& flags, SimOptions* o,
                   std::string* json_path, std::string* svg_path) {
  for (const auto& [name, value] : flags) {
    auto bad = [&](absl::string_view want) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, "=", value, ": ", want, " (see sb-sim --help)"));
    };
    auto as_int = [&](auto* out) -> absl::Status {
      return absl::SimpleAtoi(value, out) ? absl::OkStatus() : bad("expected an integer");
    };
    auto as_double = [&](double* out) -> absl::Status {
      return absl::SimpleAtod(value, out) ? absl::OkStatus() : bad("expected a number");
    };
    absl::Status s;
    if (name == "trace") {
      o->trace = value;
    } else if (name == "pack") {
      s = as_int(&o->pack_length);
    } else if (name == "ranks") {
      s = as_int(&o->ranks);
    } else if (name == "micro-batches") {
      s = as_int(&o->micro_batches);
    } else if (name == "capacity") {
      s = as_int(&o->capacity);
    } else if (name == "fill") {
      s = as_double(&o->fill);
    } else if (name == "steps") {
      s = as_int(&o->steps);
    } else if (name == "seed") {
      s = as_int(&o->seed);
    } else if (name == "slow-ranks") {
      s = as_int(&o->slow_ranks);
    } else if (name == "slow-factor") {
      s = as_double(&o->slow_factor);
    } else if (name == "noise") {
      s = as_double(&o->noise);
    } else if (name == "policies") {
      o->policies.clear();
      for (absl::string_view p : absl::StrSplit(value, ',', absl::SkipEmpty())) {
        absl::StatusOr<Policy> policy = ParsePolicy(p);
        if (!policy.ok()) return bad(policy.status().message());
        o->policies.push_back(*policy);
      }
    } else if (name == "mode") {
      absl::StatusOr<DstMode> mode = ParseDstMode(value, &o->quantile);
      if (!mode.ok()) return bad(mode.status().message());
      o->mode = *mode;
    } else if (name == "density") {
      s = as_double(&o->density_default);
    } else if (name == "density-min") {
      s = as_double(&o->density_min);
    } else if (name == "profile") {
      std::ifstream in(value);
      if (!in) return bad("cannot open the profile file");
      std::stringstream text;
      text << in.rdbuf();
      absl::StatusOr<ProfileTable> table = ParseProfileTable(text.str());
      if (!table.ok()) return bad(table.status().message());
      o->profile = *table;
      o->has_profile = true;
    } else if (name == "layers") {
      s = as_int(&o->shape.layers);
    } else if (name == "heads") {
      s = as_int(&o->shape.heads);
    } else if (name == "head-dim") {
      s = as_int(&o->shape.head_dim);
    } else if (name == "block") {
      s = as_int(&o->shape.block_size);
    } else if (name == "local-blocks") {
      s = as_int(&o->shape.local_blocks);
    } else if (name == "attention-ratio") {
      s = as_double(&o->attention_ratio);
    } else if (name == "json") {
      *json_path = value;
    } else if (name == "svg") {
      *svg_path = value;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, "; run sb-sim --help for the list"));
    }
    if (!s.ok()) return s;
  }
  // A trace that is not built in is a file.
  bool builtin = false;
  for (const std::string& n : BuiltinTraceNames()) builtin = builtin || n == o->trace;
  if (!builtin) {
    std::ifstream in(o->trace);
    if (!in) {
      return absl::InvalidArgumentError(
          absl::StrCat("--trace=", o->trace,
                       ": neither a built-in trace (pretrain, prolong) nor a readable "
                       "file"));
    }
    std::stringstream text;
    text << in.rdbuf();
    absl::StatusOr<std::vector<TraceRecord>> records = ParseTraceFile(text.str());
    if (!records.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--trace=", o->trace, ": ", records.status().message()));
    }
    o->trace_records = std::move(*records);
  }
  return absl::OkStatus();
}

bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  return static_cast<bool>(out);
}

int Main(int argc, char** argv) {
  absl::StatusOr<std::map<std::string, std::string>> flags = ParseArgs(argc, argv);
  if (!flags.ok()) {
    std::cerr << "sb-sim: " << flags.status().message() << "\n";
    return 2;
  }
  if (flags->count("help") > 0) {
    std::cout << kUsage;
    return 0;
  }
  SimOptions options;
  std::string json_path;
  std::string svg_path;
  if (absl::Status s = Apply(*flags, &options, &json_path, &svg_path); !s.ok()) {
    std::cerr << "sb-sim: " << s.message() << "\n";
    return 2;
  }
  absl::StatusOr<SimReport> report = RunSimulation(options);
  if (!report.ok()) {
    std::cerr << "sb-sim: " << report.status().message() << "\n";
    return 1;
  }
  std::cout << FormatTable(*report);
  if (!json_path.empty()) {
    if (!WriteFile(json_path, FormatJson(*report))) {
      std::cerr << "sb-sim: cannot write --json=" << json_path << "\n";
      return 1;
    }
    std::cout << "wrote " << json_path << "\n";
  }
  if (!svg_path.empty()) {
    if (!WriteFile(svg_path, FormatSvg(*report))) {
      std::cerr << "sb-sim: cannot write --svg=" << svg_path << "\n";
      return 1;
    }
    std::cout << "wrote " << svg_path << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace sparsebalance

int main(int argc, char** argv) { return sparsebalance::Main(argc, argv); }
