#include "sim/sim_report.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace sparsebalance {
namespace {

// The row's name: the policy's, or the name the simulator gave a context-parallel row.
std::string RowName(const PolicyResult& r) {
  return r.name.empty() ? std::string(PolicyName(r.policy)) : r.name;
}

// ----------------------------------------------------------------------------------------------
// Shared number helpers.

// Time from the timeline as drawn: a missing or broken measurement draws as nothing.
double DrawableSeconds(double seconds) {
  return std::isfinite(seconds) && seconds > 0.0 ? seconds : 0.0;
}

double RankTotalSeconds(const std::vector<double>& micro_batch_seconds) {
  double total = 0.0;
  for (double s : micro_batch_seconds) total += DrawableSeconds(s);
  return total;
}

// ----------------------------------------------------------------------------------------------
// Table.

// Seconds with three decimals; below 10 ms three significant digits instead, so that a toy run
// does not print 0.000 for every policy.
std::string TableSeconds(double seconds) {
  if (!std::isfinite(seconds)) return "-";
  if (seconds == 0.0 || std::fabs(seconds) >= 0.01) return absl::StrFormat("%.3f", seconds);
  return absl::StrFormat("%.3g", seconds);
}

std::string TableRatio(double ratio, int decimals) {
  if (!std::isfinite(ratio)) return "-";
  return absl::StrFormat("%.*fx", decimals, ratio);
}

std::string TablePercent(double share) {
  if (!std::isfinite(share)) return "-";
  return absl::StrFormat("%.1f%%", 100.0 * share);
}

std::string TableFixed3(double x) {
  if (!std::isfinite(x)) return "-";
  return absl::StrFormat("%.3f", x);
}

// Appends `rows` (the first is the header) as aligned columns: the first column left-aligned,
// the numbers right-aligned, two spaces between columns; a dashed rule under the header.
void AppendAlignedRows(const std::vector<std::vector<std::string>>& rows, std::string* out) {
  std::vector<size_t> widths(rows.front().size(), 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  size_t total_width = 0;
  for (size_t w : widths) total_width += w + 2;
  total_width -= 2;
  for (size_t r = 0; r < rows.size(); ++r) {
    std::string line;
    for (size_t c = 0; c < rows[r].size(); ++c) {
      if (c > 0) line += "  ";
      const int width = static_cast<int>(widths[c]);
      line += c == 0 ? absl::StrFormat("%-*s", width, rows[r][c])
                     : absl::StrFormat("%*s", width, rows[r][c]);
    }
    line.erase(line.find_last_not_of(' ') + 1);
    absl::StrAppend(out, line, "\n");
    if (r == 0) absl::StrAppend(out, std::string(total_width, '-'), "\n");
  }
}

// ----------------------------------------------------------------------------------------------
// JSON.

// Members in the order written here (scripts and diffs read them in that order). Doubles are
// written in the shortest form that parses back to the same double, so scripts read exactly
// what the simulator measured; JSON has no NaN or infinity, so those become null.
using Json = nlohmann::ordered_json;

Json ScenarioJson(const SimScenario& s) {
  Json out;
  out["trace"] = s.trace;
  out["pack_length"] = s.pack_length;
  out["ranks"] = s.ranks;
  out["micro_batches"] = s.micro_batches;
  out["capacity"] = s.capacity;
  out["fill"] = s.fill;
  out["steps"] = s.steps;
  out["mode"] = s.mode;
  out["slow_ranks"] = s.slow_ranks;
  out["slow_factor"] = s.slow_factor;
  out["noise"] = s.noise;
  out["seed"] = s.seed;
  out["density_default"] = s.density_default;
  out["density_min"] = s.density_min;
  out["cost_truth"] = s.cost_truth;
  out["sensitivity_prior"] = s.sensitivity_prior;
  out["recall_rows"] = s.recall_rows;
  out["bucket_recall_margin"] = s.bucket_recall_margin;
  out["document_recall_floor"] = s.document_recall_floor;
  out["max_shards"] = s.max_shards;
  return out;
}

Json ResultJson(const PolicyResult& r) {
  Json out;
  out["policy"] = RowName(r);
  out["mean_step_seconds"] = r.mean_step_seconds;
  out["speedup_vs_sequential"] = r.speedup_vs_sequential;
  out["speedup_vs_flops"] = r.speedup_vs_flops;
  out["imbalance_ratio"] = r.imbalance_ratio;
  out["bubble_ratio"] = r.bubble_ratio;
  out["mean_density"] = r.mean_density;
  out["mean_recall"] = r.mean_recall;
  out["mean_predicted_recall"] = r.mean_predicted_recall;
  out["buckets"] = Json::array();
  for (const BucketRecallResult& b : r.buckets) {
    Json bucket;
    bucket["bucket"] = b.bucket;
    bucket["label"] = b.label;
    bucket["tokens"] = b.tokens;
    bucket["true_recall"] = b.true_recall;
    bucket["predicted_recall"] = b.predicted_recall;
    bucket["learned_exponent"] = b.learned_exponent;
    bucket["truth_exponent"] = b.truth_exponent;
    bucket["prior_exponent"] = b.prior_exponent;
    out["buckets"].push_back(bucket);
  }
  out["median_gap"] = r.median_gap;
  out["median_prediction_error"] = r.median_prediction_error;
  out["mean_plan_seconds"] = r.mean_plan_seconds;
  out["split_documents"] = r.split_documents;
  out["exchange_share"] = r.exchange_share;
  out["step_seconds"] = r.step_seconds;
  out["learned_speed_factors"] = r.learned_speed_factors;
  out["timeline"] = r.timeline;
  out["timeline_step_seconds"] = r.timeline_step_seconds;
  return out;
}

// ----------------------------------------------------------------------------------------------
// SVG.

// Pixels. The width fits a laptop screen and a two-column paper figure scaled down.
constexpr double kSvgWidth = 960.0;
constexpr double kLeft = 70.0;   // room for rank labels and y tick labels
constexpr double kRight = 24.0;  // room for the last x tick label
constexpr double kPlotWidth = kSvgWidth - kLeft - kRight;
// More ranks than this are not drawn: a bar would be thinner than a pixel, and 1024 ranks x 6
// policies would make a file of several MB. The slowest ranks are the ones worth seeing.
constexpr size_t kMaxDrawnRanks = 64;
constexpr double kMaxBarsHeight = 256.0;  // pixels for the bars of one policy panel
constexpr double kLineChartHeight = 240.0;

struct PolicyColour {
  const char* dark;   // even micro-batches, line chart
  const char* light;  // odd micro-batches
};

// One fixed colour per policy, so a policy keeps its colour across figures and runs.
PolicyColour ColourOf(Policy policy) {
  switch (policy) {
    case Policy::kSequential:
      return {"#6b6b6b", "#b0b0b0"};
    case Policy::kTokens:
      return {"#1f77b4", "#8fbbd9"};
    case Policy::kFlops:
      return {"#e07b10", "#f2bd87"};
    case Policy::kSab:
      return {"#2a9d2a", "#94ce94"};
    case Policy::kDst:
      return {"#8a5cb8", "#c5addb"};
    case Policy::kSparseBalance:
      return {"#d62728", "#ea9293"};
  }
  return {"#000000", "#808080"};
}

std::string XmlEscape(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char ch : text) {
    const unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // XML 1.0 forbids most control characters even as references; show them as '?'.
        out += (c < 0x20 && c != '\t' && c != '\n' && c != '\r') ? '?' : ch;
    }
  }
  return out;
}

// Coordinates in pixels, one decimal: finer than a pixel, and short.
std::string Px(double x) { return absl::StrFormat("%.1f", x); }

// An axis range widened to round tick values 1, 2 or 5 x 10^k apart, about `target` ticks.
struct Axis {
  double lo = 0.0;
  double hi = 1.0;
  std::vector<double> ticks;
};

Axis MakeAxis(double lo, double hi, int target, bool integer_ticks) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) {
    lo = 0.0;
    hi = 1.0;
  }
  if (hi <= lo) hi = lo + (lo == 0.0 ? 1.0 : 0.1 * std::fabs(lo));
  const double raw = (hi - lo) / target;
  double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  if (!(magnitude > 0.0) || !std::isfinite(magnitude)) magnitude = 1.0;
  const double normalized = raw / magnitude;
  double step = magnitude * (normalized < 1.5   ? 1.0
                             : normalized < 3.0 ? 2.0
                             : normalized < 7.0 ? 5.0
                                                : 10.0);
  if (integer_ticks) step = std::max(1.0, std::round(step));
  Axis axis;
  axis.lo = std::floor(lo / step) * step;
  axis.hi = std::ceil(hi / step) * step;
  for (int i = 0;; ++i) {
    double value = axis.lo + i * step;
    if (value > axis.hi + 1e-9 * step) break;
    // lo + i * step can land a hair off zero, which %g would print as 1e-17.
    if (std::fabs(value) < 1e-9 * step) value = 0.0;
    axis.ticks.push_back(value);
  }
  return axis;
}

std::string TickLabel(double value) { return absl::StrFormat("%g", value); }

// The ranks of `timeline` to draw, in rank order: all of them, or the kMaxDrawnRanks with the
// largest total time.
std::vector<size_t> DrawnRanks(const std::vector<std::vector<double>>& timeline) {
  std::vector<size_t> ranks(timeline.size());
  for (size_t i = 0; i < ranks.size(); ++i) ranks[i] = i;
  if (ranks.size() <= kMaxDrawnRanks) return ranks;
  std::vector<double> totals(timeline.size());
  for (size_t i = 0; i < timeline.size(); ++i) totals[i] = RankTotalSeconds(timeline[i]);
  std::stable_sort(ranks.begin(), ranks.end(),
                   [&totals](size_t a, size_t b) { return totals[a] > totals[b]; });
  ranks.resize(kMaxDrawnRanks);
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

// A horizontal time axis at `y` with grid lines up to `grid_top`, labels in seconds.
void AppendTimeAxis(const Axis& axis, double y, double grid_top, std::string* out) {
  const double span = axis.hi - axis.lo;
  absl::StrAppend(out, "<g class=\"axis\">");
  for (double tick : axis.ticks) {
    const std::string x = Px(kLeft + (tick - axis.lo) / span * kPlotWidth);
    absl::StrAppend(out, "<line class=\"grid\" x1=\"", x, "\" y1=\"", Px(grid_top), "\" x2=\"", x,
                    "\" y2=\"", Px(y + 4), "\"/>", "<text x=\"", x, "\" y=\"", Px(y + 15),
                    "\" text-anchor=\"middle\">", TickLabel(tick), "</text>");
  }
  absl::StrAppend(out, "<line class=\"axisline\" x1=\"", Px(kLeft), "\" y1=\"", Px(y), "\" x2=\"",
                  Px(kLeft + kPlotWidth), "\" y2=\"", Px(y), "\"/>", "<text x=\"",
                  Px(kLeft + kPlotWidth), "\" y=\"", Px(y + 27),
                  "\" text-anchor=\"end\">seconds into the step</text></g>\n");
}

// One policy's timeline panel starting at `*y`; advances `*y` past it.
void AppendTimelinePanel(const PolicyResult& result, const Axis& axis, double* y,
                         std::string* out) {
  const PolicyColour colour = ColourOf(result.policy);
  const std::vector<size_t> ranks = DrawnRanks(result.timeline);
  std::string title = absl::StrCat(
      "<tspan font-weight=\"bold\">", XmlEscape(RowName(result)), "</tspan>  last step ",
      std::isfinite(result.timeline_step_seconds)
          ? absl::StrCat(TableSeconds(result.timeline_step_seconds), " s")
          : "not measured");
  if (ranks.size() < result.timeline.size()) {
    absl::StrAppend(&title, "  (showing ", ranks.size(), " of ", result.timeline.size(),
                    " ranks: the slowest, in rank order)");
  }
  absl::StrAppend(out, "<text class=\"title\" x=\"", Px(kLeft), "\" y=\"", Px(*y + 14), "\">",
                  title, "</text>\n");
  const double bars_top = *y + 22;
  if (ranks.empty()) {
    absl::StrAppend(out, "<text x=\"", Px(kLeft), "\" y=\"", Px(bars_top + 12),
                    "\">no timeline recorded</text>\n");
    *y = bars_top + 28;
    return;
  }

  // Pixels per rank row: thick enough to read for a few ranks, within kMaxBarsHeight for many.
  const double pitch =
      std::clamp(std::floor(kMaxBarsHeight / static_cast<double>(ranks.size())), 3.0, 14.0);
  const double bar_height = pitch >= 5.0 ? pitch - 1.0 : pitch - 0.5;
  const double seconds_to_px = kPlotWidth / (axis.hi - axis.lo);
  double slowest = 0.0;  // seconds: where every rank's idle tail ends
  for (const auto& rank : result.timeline) slowest = std::max(slowest, RankTotalSeconds(rank));
  // Label every rank when rows are tall enough, otherwise every k-th row ~10 px apart.
  const size_t label_every = static_cast<size_t>(std::ceil(10.0 / pitch));
  const double label_size = std::min(10.0, std::max(8.0, pitch - 1.0));

  const double bars_bottom = bars_top + static_cast<double>(ranks.size()) * pitch;
  // The grid goes first so that the bars cover it.
  AppendTimeAxis(axis, bars_bottom + 2, bars_top, out);
  absl::StrAppend(out, "<g fill=\"", colour.dark, "\">\n");
  for (size_t row = 0; row < ranks.size(); ++row) {
    const size_t rank = ranks[row];
    const double top = bars_top + static_cast<double>(row) * pitch;
    // The whole step, hatched: whatever the micro-batches do not cover is the idle tail.
    absl::StrAppend(out, "<rect class=\"bar\" x=\"", Px(kLeft), "\" y=\"", Px(top), "\" width=\"",
                    Px(slowest * seconds_to_px), "\" height=\"", Px(bar_height),
                    "\" fill=\"url(#idle)\"/>");
    double start = 0.0;  // seconds
    const std::vector<double>& micro_batches = result.timeline[rank];
    for (size_t mb = 0; mb < micro_batches.size(); ++mb) {
      const double seconds = DrawableSeconds(micro_batches[mb]);
      absl::StrAppend(out, "<rect class=\"mb\" x=\"", Px(kLeft + start * seconds_to_px), "\" y=\"",
                      Px(top), "\" width=\"", Px(seconds * seconds_to_px), "\" height=\"",
                      Px(bar_height), "\"",
                      mb % 2 == 1 ? absl::StrCat(" fill=\"", colour.light, "\"") : "", "/>");
      start += seconds;
    }
    if (row % label_every == 0) {
      absl::StrAppend(out, "<text class=\"rank\" x=\"", Px(kLeft - 4), "\" y=\"",
                      Px(top + bar_height / 2), "\" font-size=\"", Px(label_size), "\">r", rank,
                      "</text>");
    }
    absl::StrAppend(out, "\n");
  }
  absl::StrAppend(out, "</g>\n");
  *y = bars_bottom + 40;
}

// (step number, seconds) points of one series; a long run is cut into buckets that keep their
// minimum and maximum, so the envelope survives and the file stays small.
std::vector<std::pair<double, double>> SeriesPoints(const std::vector<double>& step_seconds,
                                                    size_t max_points) {
  std::vector<std::pair<double, double>> points;
  const size_t n = step_seconds.size();
  const size_t bucket = n <= max_points ? 1 : (n + max_points / 2 - 1) / (max_points / 2);
  for (size_t begin = 0; begin < n; begin += bucket) {
    const size_t end = std::min(n, begin + bucket);
    size_t lo = end;
    size_t hi = end;
    for (size_t i = begin; i < end; ++i) {
      if (!std::isfinite(step_seconds[i])) continue;
      if (lo == end || step_seconds[i] < step_seconds[lo]) lo = i;
      if (hi == end || step_seconds[i] > step_seconds[hi]) hi = i;
    }
    if (lo == end) continue;
    for (size_t i : {std::min(lo, hi), std::max(lo, hi)}) {
      if (!points.empty() && points.back().first == static_cast<double>(i + 1)) continue;
      points.emplace_back(static_cast<double>(i + 1), step_seconds[i]);
    }
  }
  return points;
}

// The line chart of step time over steps starting at `*y`; advances `*y` past it.
void AppendStepChart(const SimReport& report, double* y, std::string* out) {
  absl::StrAppend(out, "<text class=\"heading\" x=\"", Px(kLeft), "\" y=\"", Px(*y + 16),
                  "\">Step time over the steps (measured: slowest rank)</text>\n");
  *y += 28;

  // Legend: entries in rows of up to six.
  constexpr double kLegendEntryWidth = 145.0;
  const size_t per_row = static_cast<size_t>(kPlotWidth / kLegendEntryWidth);
  for (size_t i = 0; i < report.results.size(); ++i) {
    const PolicyResult& result = report.results[i];
    const double x = kLeft + static_cast<double>(i % per_row) * kLegendEntryWidth;
    const size_t legend_row = i / per_row;
    const double row_y = *y + static_cast<double>(legend_row) * 16 + 8;
    absl::StrAppend(out, "<line x1=\"", Px(x), "\" y1=\"", Px(row_y), "\" x2=\"", Px(x + 18),
                    "\" y2=\"", Px(row_y), "\" stroke=\"", ColourOf(result.policy).dark,
                    "\" stroke-width=\"3\"/><text x=\"", Px(x + 23), "\" y=\"", Px(row_y + 4),
                    "\">", XmlEscape(RowName(result)), " ", TableSeconds(result.mean_step_seconds),
                    " s</text>\n");
  }
  const size_t legend_rows = (report.results.size() + per_row - 1) / per_row;
  *y += static_cast<double>(legend_rows) * 16 + 10;

  std::vector<std::vector<std::pair<double, double>>> series;
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  size_t steps = 1;
  for (const PolicyResult& result : report.results) {
    series.push_back(SeriesPoints(result.step_seconds, static_cast<size_t>(2 * kPlotWidth)));
    steps = std::max(steps, result.step_seconds.size());
    for (const auto& point : series.back()) {
      lo = std::min(lo, point.second);
      hi = std::max(hi, point.second);
    }
  }
  const Axis x_axis = MakeAxis(1.0, static_cast<double>(steps), 8, /*integer_ticks=*/true);
  const Axis y_axis = MakeAxis(lo, hi, 5, /*integer_ticks=*/false);
  const double top = *y;
  const double bottom = top + kLineChartHeight;
  auto x_px = [&](double step) {
    return kLeft + (step - x_axis.lo) / (x_axis.hi - x_axis.lo) * kPlotWidth;
  };
  auto y_px = [&](double seconds) {
    return bottom - (seconds - y_axis.lo) / (y_axis.hi - y_axis.lo) * kLineChartHeight;
  };

  absl::StrAppend(out, "<g class=\"axis\">");
  for (double tick : y_axis.ticks) {
    const std::string ty = Px(y_px(tick));
    absl::StrAppend(out, "<line class=\"grid\" x1=\"", Px(kLeft - 4), "\" y1=\"", ty, "\" x2=\"",
                    Px(kLeft + kPlotWidth), "\" y2=\"", ty, "\"/><text x=\"", Px(kLeft - 7),
                    "\" y=\"", Px(y_px(tick) + 4), "\" text-anchor=\"end\">", TickLabel(tick),
                    "</text>");
  }
  for (double tick : x_axis.ticks) {
    const std::string tx = Px(x_px(tick));
    absl::StrAppend(out, "<line class=\"grid\" x1=\"", tx, "\" y1=\"", Px(top), "\" x2=\"", tx,
                    "\" y2=\"", Px(bottom + 4), "\"/><text x=\"", tx, "\" y=\"", Px(bottom + 16),
                    "\" text-anchor=\"middle\">", TickLabel(tick), "</text>");
  }
  absl::StrAppend(out, "<path class=\"axisline\" fill=\"none\" d=\"M", Px(kLeft), " ", Px(top), "V",
                  Px(bottom), "H", Px(kLeft + kPlotWidth), "\"/>");
  absl::StrAppend(out, "<text x=\"", Px(kLeft + kPlotWidth), "\" y=\"", Px(bottom + 30),
                  "\" text-anchor=\"end\">step</text><text transform=\"translate(", Px(kLeft - 48),
                  ",", Px((top + bottom) / 2),
                  ") rotate(-90)\" text-anchor=\"middle\">step time (seconds)</text></g>\n");

  for (size_t i = 0; i < report.results.size(); ++i) {
    const char* colour = ColourOf(report.results[i].policy).dark;
    std::string points;
    for (const auto& point : series[i]) {
      absl::StrAppend(&points, points.empty() ? "" : " ", Px(x_px(point.first)), ",",
                      Px(y_px(point.second)));
    }
    absl::StrAppend(out, "<polyline class=\"series\" fill=\"none\" stroke=\"", colour,
                    "\" stroke-width=\"1.5\" points=\"", points, "\"/>\n");
    // A one-step run has no line to draw; a dot shows where it is.
    if (series[i].size() == 1) {
      absl::StrAppend(out, "<circle cx=\"", Px(x_px(series[i][0].first)), "\" cy=\"",
                      Px(y_px(series[i][0].second)), "\" r=\"3\" fill=\"", colour, "\"/>\n");
    }
  }
  *y = bottom + 40;
}

std::string ScenarioSummary(const SimScenario& s) {
  return absl::StrCat(
      "trace ", s.trace, ", ",
      s.pack_length > 0 ? absl::StrCat("packed to ", s.pack_length, " tokens") : "unpacked", "; ",
      s.ranks, " ranks x ", s.micro_batches, " micro-batches x ", s.capacity, " tokens, fill ",
      absl::StrFormat("%.2f", s.fill), "; ", s.steps, " steps");
}

std::string ScenarioDetails(const SimScenario& s) {
  std::string out = absl::StrFormat(
      "DST mode %s; %d slow ranks at speed factor %.2f; noise %.3f; seed %d; density default "
      "%.3f, min %.3f",
      s.mode, s.slow_ranks, s.slow_factor, s.noise, s.seed, s.density_default, s.density_min);
  if (!s.cost_truth.empty()) {
    absl::StrAppend(&out, absl::StrFormat("; cost truth %s; sensitivity prior %s; recall rows %d; "
                                          "bucket recall margin %.3f, document floor %.3f",
                                          s.cost_truth, s.sensitivity_prior, s.recall_rows,
                                          s.bucket_recall_margin, s.document_recall_floor));
  }
  if (s.max_shards > 1) {
    absl::StrAppend(&out, absl::StrFormat("; context parallelism up to %d ranks", s.max_shards));
  }
  return out;
}

// Context parallelism: for each row that splits documents, the documents split per step and
// the exchange's share of rank time; then sparsebalance-cp against sparsebalance and dense-cp,
// and its gap to the bound with splitting, when those rows ran.
void AppendContextParallelLines(const SimReport& report, std::string* out) {
  const PolicyResult* cp = nullptr;
  const PolicyResult* plain = nullptr;
  const PolicyResult* dense = nullptr;
  std::vector<std::vector<std::string>> rows = {
      {"context parallel", "split docs/step", "exchange share", "gap(median)"}};
  for (const PolicyResult& r : report.results) {
    const std::string name = RowName(r);
    if (name == "sparsebalance-cp") cp = &r;
    if (name == "sparsebalance") plain = &r;
    if (name == "dense-cp") dense = &r;
    if (name.size() > 3 && name.substr(name.size() - 3) == "-cp") {
      rows.push_back({name, absl::StrFormat("%.1f", r.split_documents),
                      TablePercent(r.exchange_share), TablePercent(r.median_gap)});
    }
  }
  if (rows.size() == 1) return;
  absl::StrAppend(out, "\n");
  AppendAlignedRows(rows, out);
  if (cp != nullptr) {
    std::string line = "sparsebalance-cp:";
    if (plain != nullptr) {
      absl::StrAppend(&line, absl::StrFormat(" %.3fx faster than sparsebalance;",
                                             plain->mean_step_seconds / cp->mean_step_seconds));
    }
    if (dense != nullptr) {
      absl::StrAppend(&line, absl::StrFormat(" %.3fx faster than dense-cp;",
                                             dense->mean_step_seconds / cp->mean_step_seconds));
    }
    absl::StrAppend(&line, absl::StrFormat(" planned makespan %s above the bound with splitting "
                                           "(median)\n",
                                           TablePercent(cp->median_gap)));
    absl::StrAppend(out, line);
  }
}

// The per-bucket recall table: for each policy and length bucket the hidden true recall and,
// after a slash, the planner's predicted recall; then the worst bucket's true recall minus
// sequential's (points), when sequential ran. Buckets no policy placed tokens in are left out.
void AppendBucketTable(const SimReport& report, std::string* out) {
  std::vector<int> shown;
  const PolicyResult* sequential = nullptr;
  for (const PolicyResult& r : report.results) {
    if (r.policy == Policy::kSequential && RowName(r) == PolicyName(r.policy)) sequential = &r;
  }
  if (report.results.empty()) return;
  const size_t buckets = report.results.front().buckets.size();
  for (size_t b = 0; b < buckets; ++b) {
    bool any = false;
    for (const PolicyResult& r : report.results) {
      any = any || (b < r.buckets.size() && r.buckets[b].tokens > 0.0);
    }
    if (any) shown.push_back(static_cast<int>(b));
  }
  if (shown.empty()) return;
  std::vector<std::string> header = {"policy"};
  for (int b : shown) {
    header.push_back(absl::StrCat("recall ", report.results.front().buckets[b].label));
  }
  header.push_back("all");
  if (sequential != nullptr) header.push_back("worst vs seq");
  std::vector<std::vector<std::string>> rows = {header};
  for (const PolicyResult& r : report.results) {
    std::vector<std::string> row = {RowName(r)};
    double worst = std::numeric_limits<double>::infinity();
    for (int b : shown) {
      if (static_cast<size_t>(b) >= r.buckets.size() || !(r.buckets[b].tokens > 0.0)) {
        row.push_back("-");
        continue;
      }
      const BucketRecallResult& x = r.buckets[b];
      row.push_back(absl::StrCat(TableFixed3(x.true_recall), "/", TableFixed3(x.predicted_recall)));
      if (sequential != nullptr && static_cast<size_t>(b) < sequential->buckets.size() &&
          sequential->buckets[b].tokens > 0.0) {
        worst = std::min(worst, x.true_recall - sequential->buckets[b].true_recall);
      }
    }
    row.push_back(
        absl::StrCat(TableFixed3(r.mean_recall), "/", TableFixed3(r.mean_predicted_recall)));
    if (sequential != nullptr) {
      // A difference that rounds to zero prints as +0.00, not -0.00.
      const double points = std::fabs(100.0 * worst) < 0.005 ? 0.0 : 100.0 * worst;
      row.push_back(std::isfinite(worst) ? absl::StrFormat("%+.2f pt", points) : "-");
    }
    rows.push_back(row);
  }
  absl::StrAppend(out, "\n");
  AppendAlignedRows(rows, out);
  absl::StrAppend(out,
                  "recall per length bucket: hidden true recall / planner's predicted recall, "
                  "token-weighted over\nall steps; worst vs seq: lowest bucket's true recall "
                  "minus sequential's.\n");
}

}  // namespace

std::string FormatTable(const SimReport& report) {
  const SimScenario& s = report.scenario;
  std::string out =
      absl::StrCat("scenario: ", ScenarioSummary(s), "\n          ", ScenarioDetails(s), "\n\n");
  std::vector<std::vector<std::string>> rows = {{"policy", "step s (mean)", "vs seq", "vs flops",
                                                 "imbalance", "bubble", "density", "recall",
                                                 "gap(median)", "pred err(median)", "plan ms"}};
  for (const PolicyResult& r : report.results) {
    const std::string name = RowName(r);
    rows.push_back({name, TableSeconds(r.mean_step_seconds), TableRatio(r.speedup_vs_sequential, 2),
                    r.speedup_vs_flops == 0.0 ? "-" : TableRatio(r.speedup_vs_flops, 2),
                    TableRatio(r.imbalance_ratio, 3), TablePercent(r.bubble_ratio),
                    TableFixed3(r.mean_density), TableFixed3(r.mean_recall),
                    TablePercent(r.median_gap), TablePercent(r.median_prediction_error),
                    std::isfinite(r.mean_plan_seconds)
                        ? absl::StrFormat("%.2f", 1000.0 * r.mean_plan_seconds)
                        : "-"});
  }
  AppendAlignedRows(rows, &out);
  absl::StrAppend(
      &out,
      "vs seq/vs flops: speedup of mean step time; imbalance: max/mean rank compute; "
      "bubble: idle share\nof ranks x step time; density, recall: token-weighted (recall: the "
      "hidden true recall);\ngap: planned makespan over lower bound; pred err: |predicted - "
      "measured| / measured rank\ntime; plan ms: planner wall time per step.\n");
  AppendContextParallelLines(report, &out);
  AppendBucketTable(report, &out);
  return out;
}

std::string FormatJson(const SimReport& report) {
  Json json;
  json["scenario"] = ScenarioJson(report.scenario);
  json["results"] = Json::array();
  for (const PolicyResult& result : report.results) json["results"].push_back(ResultJson(result));
  // A trace path that is not UTF-8 is written with U+FFFD in place of its bad bytes.
  return json.dump(2, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace) + "\n";
}

std::string FormatSvg(const SimReport& report) {
  std::string body;
  double y = 8.0;  // pixels: top of the next element
  absl::StrAppend(&body, "<text class=\"heading\" x=\"", Px(kLeft), "\" y=\"", Px(y + 16),
                  "\">sb-sim: ", XmlEscape(ScenarioSummary(report.scenario)), "</text>\n",
                  "<text x=\"", Px(kLeft), "\" y=\"", Px(y + 32), "\">",
                  XmlEscape(ScenarioDetails(report.scenario)), "</text>\n");
  y += 48;
  absl::StrAppend(&body, "<text class=\"heading\" x=\"", Px(kLeft), "\" y=\"", Px(y + 16),
                  "\">Per-rank timeline of the last step</text>\n", "<text x=\"", Px(kLeft),
                  "\" y=\"", Px(y + 32),
                  "\">one bar per rank, one segment per micro-batch (alternating shades); "
                  "hatched: idle until the slowest rank. Same time axis in every panel.</text>\n");
  y += 44;

  // One time axis for every panel, so that bar lengths compare across policies.
  double longest = 0.0;  // seconds
  for (const PolicyResult& result : report.results) {
    longest = std::max(longest, DrawableSeconds(result.timeline_step_seconds));
    for (const auto& rank : result.timeline) longest = std::max(longest, RankTotalSeconds(rank));
  }
  const Axis time_axis = MakeAxis(0.0, longest, 8, /*integer_ticks=*/false);
  for (const PolicyResult& result : report.results) {
    AppendTimelinePanel(result, time_axis, &y, &body);
  }
  AppendStepChart(report, &y, &body);

  const std::string width = Px(kSvgWidth);
  const std::string height = Px(std::ceil(y));
  return absl::StrCat(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n",
      "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"", width, "\" height=\"",
      height, "\" viewBox=\"0 0 ", width, " ", height,
      "\" font-family=\"sans-serif\" font-size=\"11\">\n",
      "<defs><pattern id=\"idle\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
      "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#ececec\"/>"
      "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#c4c4c4\" stroke-width=\"2\"/>"
      "</pattern>\n<style>.heading{font-size:14px;font-weight:bold}.grid{stroke:#e0e0e0}"
      ".axisline{stroke:#404040}.rank{text-anchor:end;dominant-baseline:central;fill:#404040}"
      "</style></defs>\n",
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n", body, "</svg>\n");
}

}  // namespace sparsebalance
