#include "worker/run_summary.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "contract/step_figures.h"
#include "nlohmann/json.hpp"

namespace sparsebalance {
namespace {

// Members in the order written (people read the lines too).
using Json = nlohmann::ordered_json;

// Seconds and ratios to 6 decimals (microseconds): the lines stay short and what the workers
// measure is not more precise than that.
double Round6(double x) { return std::round(x * 1e6) / 1e6; }

// `json[key]` as a T; INVALID_ARGUMENT naming the key when it is missing or of another type.
template <typename T>
absl::Status Get(const Json& json, const char* key, T* out) {
  const auto it = json.find(key);
  const bool fits = it != json.end() && (std::is_same_v<T, bool>          ? it->is_boolean()
                                         : std::is_same_v<T, std::string> ? it->is_string()
                                                                          : it->is_number());
  if (!fits) {
    return absl::InvalidArgumentError(absl::StrCat("step line: field ", key, " missing or not a ",
                                                   std::is_same_v<T, bool>          ? "boolean"
                                                   : std::is_same_v<T, std::string> ? "string"
                                                                                    : "number",
                                                   " in: ", json.dump()));
  }
  *out = it->get<T>();
  return absl::OkStatus();
}

}  // namespace

std::string FormatStepLine(const StepLine& s) {
  Json json;
  json["step"] = s.step;
  json["rank"] = s.rank;
  json["compute_seconds"] = Round6(s.compute_seconds);
  json["attention_seconds"] = Round6(s.attention_seconds);
  json["wait_seconds"] = Round6(s.wait_seconds);
  json["predicted_seconds"] = Round6(s.predicted_seconds);
  json["tokens"] = s.tokens;
  json["density"] = Round6(s.density);
  json["recall"] = Round6(s.recall);
  json["local_fallback"] = s.local_fallback;
  json["acked"] = s.acked;
  json["plan_digest"] = s.plan_digest;
  json["wall_start"] = Round6(s.wall_start);
  json["wall_end"] = Round6(s.wall_end);
  json["estimated_recall"] = Round6(s.estimated_recall);
  json["recall_seconds"] = Round6(s.recall_seconds);
  json["exchange_seconds"] = Round6(s.exchange_seconds);
  if (!s.shards.empty()) {
    Json shards = Json::array();
    for (const ShardLine& shard : s.shards) {
      Json j;
      j["sample"] = shard.sample;
      j["index"] = shard.index;
      j["shards"] = shard.shards;
      j["begin"] = shard.begin;
      j["end"] = shard.end;
      j["length"] = shard.length;
      j["exchange_seconds"] = Round6(shard.exchange_seconds);
      j["exchange_bytes"] = shard.exchange_bytes;
      shards.push_back(std::move(j));
    }
    json["shards"] = std::move(shards);
  }
  return json.dump();
}

absl::StatusOr<StepLine> ParseStepLine(const std::string& line) {
  const Json json = Json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("step line: not a JSON object: ", line));
  }
  StepLine s;
  for (absl::Status status :
       {Get(json, "step", &s.step), Get(json, "rank", &s.rank),
        Get(json, "compute_seconds", &s.compute_seconds),
        Get(json, "attention_seconds", &s.attention_seconds),
        Get(json, "wait_seconds", &s.wait_seconds),
        Get(json, "predicted_seconds", &s.predicted_seconds), Get(json, "tokens", &s.tokens),
        Get(json, "density", &s.density), Get(json, "recall", &s.recall)}) {
    if (!status.ok()) return status;
  }
  // Optional: lines written before these fields existed still read.
  Get(json, "local_fallback", &s.local_fallback).IgnoreError();
  Get(json, "acked", &s.acked).IgnoreError();
  Get(json, "plan_digest", &s.plan_digest).IgnoreError();
  Get(json, "wall_start", &s.wall_start).IgnoreError();
  Get(json, "wall_end", &s.wall_end).IgnoreError();
  Get(json, "estimated_recall", &s.estimated_recall).IgnoreError();
  Get(json, "recall_seconds", &s.recall_seconds).IgnoreError();
  Get(json, "exchange_seconds", &s.exchange_seconds).IgnoreError();
  if (const auto it = json.find("shards"); it != json.end()) {
    if (!it->is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat("step line: field shards is not a list in: ", line));
    }
    for (size_t i = 0; i < it->size(); ++i) {
      const Json& j = (*it)[i];
      ShardLine shard;
      for (const absl::Status& status :
           {Get(j, "sample", &shard.sample), Get(j, "index", &shard.index),
            Get(j, "shards", &shard.shards), Get(j, "begin", &shard.begin),
            Get(j, "end", &shard.end), Get(j, "length", &shard.length),
            Get(j, "exchange_seconds", &shard.exchange_seconds),
            Get(j, "exchange_bytes", &shard.exchange_bytes)}) {
        if (!status.ok()) {
          return absl::Status(status.code(), absl::StrCat("shards[", i, "]: ", status.message()));
        }
      }
      s.shards.push_back(shard);
    }
  }
  return s;
}

absl::StatusOr<std::vector<StepLine>> ReadStepLines(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::map<std::pair<int64_t, int>, StepLine> latest;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    absl::StatusOr<StepLine> s = ParseStepLine(line);
    if (!s.ok()) return s.status();
    latest[{s->step, s->rank}] = *s;
  }
  std::vector<StepLine> out;
  for (auto& [key, s] : latest) out.push_back(std::move(s));
  return out;
}

absl::StatusOr<RunResult> SummarizeRun(const std::string& name, const std::string& path,
                                       int ranks) {
  absl::StatusOr<std::vector<StepLine>> lines = ReadStepLines(path);
  if (!lines.ok()) return lines.status();
  RunResult run;
  run.name = name;
  run.ranks = ranks;
  std::map<int64_t, std::vector<StepLine>> by_step;
  for (const StepLine& s : *lines) by_step[s.step].push_back(s);
  double density_tokens = 0, recall_tokens = 0, estimate_tokens = 0, tokens = 0, error_sum = 0;
  double recall_seconds = 0, attention_seconds = 0;
  int64_t error_count = 0;
  for (auto& [step, rows] : by_step) {
    if (static_cast<int>(rows.size()) != ranks) continue;  // an incomplete step
    std::sort(rows.begin(), rows.end(),
              [](const StepLine& a, const StepLine& b) { return a.rank < b.rank; });
    double max = 0;
    std::vector<double> rank_seconds;
    bool local = false;
    for (const StepLine& r : rows) {
      max = std::max(max, r.compute_seconds);
      rank_seconds.push_back(r.compute_seconds);
      density_tokens += r.density * r.tokens;
      recall_tokens += r.recall * r.tokens;
      estimate_tokens += r.estimated_recall * r.tokens;
      recall_seconds += r.recall_seconds;
      attention_seconds += r.attention_seconds;
      tokens += r.tokens;
      local = local || r.local_fallback;
      if (r.compute_seconds > 0 && r.predicted_seconds > 0) {
        error_sum += std::abs(r.compute_seconds - r.predicted_seconds) / r.compute_seconds;
        ++error_count;
      }
    }
    run.mean_step_seconds += max;
    run.imbalance += ImbalanceRatio(rank_seconds);
    run.bubble_ratio += BubbleRatio(rank_seconds);
    run.local_plan_steps += local ? 1 : 0;
    run.steps[step] = rows;
  }
  const double n = static_cast<double>(run.steps.size());
  if (n == 0) return absl::FailedPreconditionError(absl::StrCat(path, ": no complete step"));
  run.mean_step_seconds /= n;
  run.imbalance /= n;
  run.bubble_ratio /= n;
  run.mean_density = tokens > 0 ? density_tokens / tokens : 0;
  run.mean_recall = tokens > 0 ? recall_tokens / tokens : 0;
  run.mean_estimated_recall = tokens > 0 ? estimate_tokens / tokens : 0;
  run.recall_cost = attention_seconds > 0 ? recall_seconds / attention_seconds : 0;
  run.prediction_error = error_count > 0 ? error_sum / error_count : 0;
  return run;
}

std::string FormatSummary(const std::vector<RunResult>& runs) {
  std::string out = absl::StrFormat("%-30s", "measured by the workers");
  for (const RunResult& r : runs) absl::StrAppendFormat(&out, " %15s", r.name);
  out += "\n";
  auto row = [&](const char* label, auto value) {
    absl::StrAppendFormat(&out, "%-30s", label);
    for (const RunResult& r : runs) absl::StrAppend(&out, " ", value(r));
    out += "\n";
  };
  row("steps", [](const RunResult& r) { return absl::StrFormat("%15d", r.steps.size()); });
  row("mean step time (s)",
      [](const RunResult& r) { return absl::StrFormat("%15.3f", r.mean_step_seconds); });
  row("imbalance (max/mean rank)",
      [](const RunResult& r) { return absl::StrFormat("%15.3f", r.imbalance); });
  row("bubble ratio", [](const RunResult& r) { return absl::StrFormat("%15.3f", r.bubble_ratio); });
  row("mean density", [](const RunResult& r) { return absl::StrFormat("%15.3f", r.mean_density); });
  row("mean recall", [](const RunResult& r) { return absl::StrFormat("%15.3f", r.mean_recall); });
  row("mean estimated recall",
      [](const RunResult& r) { return absl::StrFormat("%15.3f", r.mean_estimated_recall); });
  row("recall probe / attention",
      [](const RunResult& r) { return absl::StrFormat("%14.2f%%", 100 * r.recall_cost); });
  row("prediction error",
      [](const RunResult& r) { return absl::StrFormat("%14.1f%%", 100 * r.prediction_error); });
  row("steps on local plans",
      [](const RunResult& r) { return absl::StrFormat("%15d", r.local_plan_steps); });
  if (runs.size() >= 2 && runs.back().mean_step_seconds > 0) {
    absl::StrAppendFormat(&out, "%-30s %15s %14.2fx\n", "speed-up vs the first", "",
                          runs.front().mean_step_seconds / runs.back().mean_step_seconds);
  }
  return out;
}

std::string SummaryJson(const std::vector<RunResult>& runs) {
  Json json;
  json["runs"] = Json::array();
  for (const RunResult& r : runs) {
    Json run;
    run["policy"] = r.name;
    run["ranks"] = r.ranks;
    run["steps"] = r.steps.size();
    run["mean_step_seconds"] = Round6(r.mean_step_seconds);
    run["imbalance"] = Round6(r.imbalance);
    run["bubble_ratio"] = Round6(r.bubble_ratio);
    run["mean_density"] = Round6(r.mean_density);
    run["mean_recall"] = Round6(r.mean_recall);
    run["mean_estimated_recall"] = Round6(r.mean_estimated_recall);
    run["recall_cost"] = Round6(r.recall_cost);
    run["prediction_error"] = Round6(r.prediction_error);
    run["local_plan_steps"] = r.local_plan_steps;
    json["runs"].push_back(std::move(run));
  }
  return json.dump() + "\n";
}

std::string TimelineSvg(const std::vector<RunResult>& runs) {
  const double width = 900, left = 150, row_height = 18, panel_gap = 40, top = 30;
  double longest = 0;
  for (const RunResult& r : runs) {
    double total = 0;
    for (const auto& [step, rows] : r.steps) {
      double max = 0;
      for (const StepLine& s : rows) max = std::max(max, s.compute_seconds);
      total += max;
    }
    longest = std::max(longest, total);
  }
  const double scale = longest > 0 ? (width - left - 20) / longest : 1;
  double height = top;
  for (const RunResult& r : runs) height += r.ranks * row_height + panel_gap + 20;
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" "
      "fill=\"white\"/>\n<text x=\"10\" y=\"18\" font-size=\"14\">Per-rank step timeline "
      "(measured compute in colour, waiting for the slowest rank in grey; same batches)</text>\n",
      width, height);
  double y = top + 10;
  const char* colours[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948"};
  for (size_t p = 0; p < runs.size(); ++p) {
    const RunResult& r = runs[p];
    absl::StrAppendFormat(&svg,
                          "<text x=\"10\" y=\"%.0f\" font-weight=\"bold\">%s: %.2f s/step, "
                          "imbalance %.2f</text>\n",
                          y + 4, r.name, r.mean_step_seconds, r.imbalance);
    y += 12;
    for (int rank = 0; rank < r.ranks; ++rank) {
      absl::StrAppendFormat(&svg, "<text x=\"10\" y=\"%.0f\">rank %d</text>\n", y + row_height - 5,
                            rank);
      double x = left;
      int step_index = 0;
      for (const auto& [step, rows] : r.steps) {
        double max = 0;
        for (const StepLine& s : rows) max = std::max(max, s.compute_seconds);
        const double compute = rows[rank].compute_seconds;
        absl::StrAppendFormat(&svg,
                              "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
                              "fill=\"%s\"><title>step %d rank %d: %.3f s</title></rect>\n",
                              x, y + 2, compute * scale, row_height - 4, colours[step_index % 6],
                              step, rank, compute);
        absl::StrAppendFormat(&svg,
                              "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
                              "fill=\"#d0d0d0\"/>\n",
                              x + compute * scale, y + 2, (max - compute) * scale, row_height - 4);
        x += max * scale;
        ++step_index;
      }
      y += row_height;
    }
    y += panel_gap;
  }
  absl::StrAppendFormat(&svg,
                        "<text x=\"%.0f\" y=\"%.0f\">time (s of compute) -&gt; full width "
                        "= %.2f s</text>\n</svg>\n",
                        left, y - 10, longest);
  return svg;
}

}  // namespace sparsebalance
