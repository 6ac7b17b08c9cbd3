// What one `sb-sim` run measured, and its three renderings: a table for the terminal, JSON
// for scripts, and an SVG picture (per-rank timeline of one step per policy, and step time
// over the steps).
#ifndef SPARSEBALANCE_SIM_SIM_REPORT_H_
#define SPARSEBALANCE_SIM_SIM_REPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "planner/types.h"

namespace sparsebalance {

// The scenario, echoed into the report so that a figure can be reproduced.
struct SimScenario {
  std::string trace;        // "pretrain", "prolong" or a file path
  int64_t pack_length = 0;  // tokens, 0 = documents are samples
  int ranks = 0;
  int micro_batches = 0;
  int64_t capacity = 0;  // tokens per micro-batch
  double fill = 0.0;     // share of ranks x micro-batches x capacity filled per step
  int steps = 0;
  std::string mode;  // DST mode, e.g. "mean" or "quantile:0.75"
  int slow_ranks = 0;
  double slow_factor = 1.0;  // ground-truth speed factor of the slow ranks
  double noise = 0.0;        // multiplicative noise (standard deviation) per micro-batch
  uint64_t seed = 0;
  double density_default = 0.0;
  double density_min = 0.0;
  std::string cost_truth;             // "efficiency" or "linear"
  std::string sensitivity_prior;      // "none", "true" or "noisy:SD"
  int recall_rows = 0;                // query rows per simulated recall measurement
  double bucket_recall_margin = 0.0;  // the planner's recall guards
  double document_recall_floor = 0.0;
  int max_shards = 1;  // context parallelism of the "-cp" rows
};

// Recall of one length bucket (planner/recall_model.h's buckets) under one policy, over all
// steps: the hidden truth next to the planner's prediction at planning time.
struct BucketRecallResult {
  int bucket = 0;
  std::string label;              // RecallBucketLabel, e.g. "32K+"
  double tokens = 0.0;            // placed tokens of the bucket's documents, all steps
  double true_recall = 0.0;       // token-weighted hidden true recall (0 without tokens)
  double predicted_recall = 0.0;  // token-weighted, the planner's recall model when planning
  // g of the planner's learned curve at the end (all layers, sensitivity 0), and the g the
  // planner's own fit (RecallModel, no prior, nothing forgotten) reaches on the noise-free true
  // recalls at the densities this policy planned (what a perfect learner of that form reaches).
  double learned_exponent = 0.0;
  double truth_exponent = 0.0;
  double prior_exponent = 0.0;  // g the planner started from (sensitivity 0)
};

// Results of one policy, measured by the simulator's hidden ground truth.
struct PolicyResult {
  Policy policy = Policy::kSequential;
  std::string name;                  // the row's name (SimPolicyName); empty: PolicyName(policy)
  std::vector<double> step_seconds;  // measured step time (slowest rank) per step
  double mean_step_seconds = 0.0;
  double speedup_vs_sequential = 0.0;       // mean step time of sequential / this
  double speedup_vs_flops = 0.0;            // 0 when flops did not run
  double imbalance_ratio = 0.0;             // mean over steps of max/mean rank compute
  double bubble_ratio = 0.0;                // mean over steps of idle / (ranks x step time)
  double mean_density = 0.0;                // token-weighted, over all steps
  double mean_recall = 0.0;                 // token-weighted hidden TRUE recall, over all steps
  double mean_predicted_recall = 0.0;       // token-weighted, the planner's recall model
  std::vector<BucketRecallResult> buckets;  // all kRecallBuckets, ascending
  double median_gap = 0.0;                  // median over steps of planned makespan / bound - 1
  double median_prediction_error = 0.0;     // median |predicted - measured| / measured rank time,
                                            // over steps after the warm-up (see sb-sim --help)
  double mean_plan_seconds = 0.0;           // wall time of the planner per step
  // Context parallelism: split documents per step (mean) and the share of rank time spent
  // exchanging keys and values.
  double split_documents = 0.0;
  double exchange_share = 0.0;
  std::vector<double> learned_speed_factors;  // per rank, at the end of the run
  // One step's timeline (the last): [rank][micro_batch] measured seconds, run back to back.
  std::vector<std::vector<double>> timeline;
  double timeline_step_seconds = 0.0;
};

struct SimReport {
  SimScenario scenario;
  std::vector<PolicyResult> results;  // in the order the policies were requested
};

// A fixed-width table, one row per policy, with a header line describing the scenario, then a
// second table of true (and predicted) recall per length bucket for each policy.
std::string FormatTable(const SimReport& report);
// The whole report as a JSON object (scenario, then results with every field above).
std::string FormatJson(const SimReport& report);
// A standalone SVG document: for each policy a per-rank timeline of the last step (one bar
// per rank, one segment per micro-batch, the idle tail shaded), then a line chart of step time
// over the steps for all policies.
std::string FormatSvg(const SimReport& report);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SIM_SIM_REPORT_H_
