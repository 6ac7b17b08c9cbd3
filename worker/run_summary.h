// What sb-run (and the end-to-end tests) make of the workers' step lines: per run, the figures
// a user compares between policies, all from what the workers measured.
//
// Step time is the slowest rank's compute (the step's makespan on dedicated cores); imbalance
// is max / mean rank compute; the bubble ratio is the idle share of ranks x makespan; density
// and recall are token-weighted; prediction error is |measured - predicted| / measured per rank.
#ifndef SPARSEBALANCE_WORKER_RUN_SUMMARY_H_
#define SPARSEBALANCE_WORKER_RUN_SUMMARY_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace sparsebalance {

// A shard of a split document that a rank ran in a step (context parallelism).
struct ShardLine {
  uint64_t sample = 0;  // the document's sample id
  int index = 0;        // shard index in its group
  int shards = 0;       // the group's size
  int64_t begin = 0;    // query tokens [begin, end) of the document
  int64_t end = 0;
  int64_t length = 0;             // the document's tokens
  double exchange_seconds = 0.0;  // its exchange, all layers
  int64_t exchange_bytes = 0;     // key/value bytes it received, all layers
};

// One worker's line for one step (worker_main.cc writes them with FormatStepLine).
struct StepLine {
  int64_t step = 0;
  int rank = 0;
  double compute_seconds = 0.0;
  double attention_seconds = 0.0;
  double wait_seconds = 0.0;
  double predicted_seconds = 0.0;
  int64_t tokens = 0;
  double density = 0.0;
  double recall = 0.0;  // token-weighted: measured (the recall probe) or the estimate
  bool local_fallback = false;
  bool acked = false;
  std::string plan_digest;
  double wall_start = 0.0;        // Unix seconds: the step began (before asking for its plan)
  double wall_end = 0.0;          // Unix seconds: its report was sent (or buffered)
  double estimated_recall = 0.0;  // token-weighted: the block scores' estimate
  double recall_seconds = 0.0;    // the recall probe's time, not part of compute_seconds
  double exchange_seconds = 0.0;  // the shards' exchange, part of compute_seconds (reported)
  std::vector<ShardLine> shards;  // the shards this rank ran (written only when there are any)
};

// One line of JSON (no newline): {"step": 3, "rank": 0, "compute_seconds": 0.25, ...}, the
// fields in the order above, seconds and ratios to 6 decimals.
std::string FormatStepLine(const StepLine& line);
// Parses one line; errors name the missing or malformed field.
absl::StatusOr<StepLine> ParseStepLine(const std::string& line);
// Every line of a file; the last line of a rank and step wins (a restarted rank rewrites one).
absl::StatusOr<std::vector<StepLine>> ReadStepLines(const std::string& path);

struct RunResult {
  std::string name;  // the policy
  int ranks = 0;
  std::map<int64_t, std::vector<StepLine>> steps;  // complete steps only, ranks in order
  double mean_step_seconds = 0.0;
  double imbalance = 0.0;     // mean over steps of max/mean rank compute
  double bubble_ratio = 0.0;  // mean over steps
  double mean_density = 0.0;
  double mean_recall = 0.0;
  double mean_estimated_recall = 0.0;
  // The recall probe's time as a share of the attention time (sum over ranks and steps).
  double recall_cost = 0.0;
  double prediction_error = 0.0;  // mean relative error
  int64_t local_plan_steps = 0;
};

absl::StatusOr<RunResult> SummarizeRun(const std::string& name, const std::string& path, int ranks);
std::string FormatSummary(const std::vector<RunResult>& runs);
std::string SummaryJson(const std::vector<RunResult>& runs);
// One panel per run: each rank's steps laid end to end at the pace of the slowest rank
// (compute in colour, waiting in grey).
std::string TimelineSvg(const std::vector<RunResult>& runs);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_WORKER_RUN_SUMMARY_H_
