// The cluster simulator behind `sb-sim`: every policy plans each step with the real planner
// (learning the cost from the simulated reports, starting from a profile table whose
// coefficients differ from the truth), and the simulator "runs" the plan with a hidden
// ground-truth cost, multiplicative noise and optional slow ranks that no policy is told of.
//
//   SimOptions options;  options.ranks = 32;
//   absl::StatusOr<SimReport> report = RunSimulation(options);
#ifndef SPARSEBALANCE_SIM_SIMULATOR_H_
#define SPARSEBALANCE_SIM_SIMULATOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/profile_table.h"
#include "planner/traces.h"
#include "planner/types.h"
#include "sim/sim_report.h"

namespace sparsebalance {

struct SimOptions {
  std::string trace = "pretrain";          // built-in name, or a label for `trace_records`
  std::vector<TraceRecord> trace_records;  // when non-empty, the trace (from a file)
  int64_t pack_length = 0;                 // tokens; 0 = documents are samples
  int ranks = 32;
  int micro_batches = 4;
  int64_t capacity = 131072;  // tokens per micro-batch
  double fill = 0.85;         // share of ranks x micro-batches x capacity per step
  int steps = 30;
  std::vector<Policy> policies = AllPolicies();
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
  // Prior: when set, the latency model starts from this measured table; otherwise from a
  // synthetic table made from the truth with attention time x0.6 and linear time x1.4.
  bool has_profile = false;
  ProfileTable profile;
};

// The hidden cost of the simulated cluster (seconds, all layers, forward + backward).
CostCoefficients GroundTruthCoefficients(const SimOptions& options);
// The profile table the planner starts from when none is given (see SimOptions::profile).
ProfileTable SyntheticProfile(const SimOptions& options);
// Ranks that run slow_factor times slower: spread evenly over the ranks.
std::vector<int> SlowRanks(const SimOptions& options);

absl::StatusOr<SimReport> RunSimulation(const SimOptions& options);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SIM_SIMULATOR_H_
