#include "sim/sim_report.h"

#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "planner/types.h"

namespace sparsebalance {
namespace {

using Json = nlohmann::ordered_json;

// The document, or a discarded value (is_discarded()) when `text` is not valid JSON.
Json ParseJson(const std::string& text) {
  return Json::parse(text, nullptr, /*allow_exceptions=*/false);
}

// The member names of an object, in document order.
std::vector<std::string> Keys(const Json& object) {
  std::vector<std::string> keys;
  for (const auto& member : object.items()) keys.push_back(member.key());
  return keys;
}

// ----------------------------------------------------------------------------------------------
// A minimal XML well-formedness check for what FormatSvg writes: an optional declaration,
// elements with quoted attributes, comments, text with the five predefined entities or
// character references. Returns "" when well-formed, else what is wrong; `root` gets the name
// of the root element.

bool IsNameChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == ':' ||
         c == '.';
}

// Checks that every '&' in `text` starts an entity XML knows; `text` must not contain '<'.
std::string CharDataProblem(absl::string_view text) {
  if (absl::StrContains(text, "<")) return "raw '<' in text or attribute value";
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '&') continue;
    const size_t end = text.find(';', i);
    if (end == absl::string_view::npos) return "'&' without ';'";
    const absl::string_view entity = text.substr(i + 1, end - i - 1);
    if (entity != "amp" && entity != "lt" && entity != "gt" && entity != "quot" &&
        entity != "apos" && !(entity.size() > 1 && entity[0] == '#')) {
      return absl::StrCat("unknown entity &", entity, ";");
    }
  }
  return "";
}

std::string XmlProblem(absl::string_view xml, std::string* root) {
  size_t pos = 0;
  if (absl::StartsWith(xml, "<?xml")) {
    pos = xml.find("?>");
    if (pos == absl::string_view::npos) return "unterminated XML declaration";
    pos += 2;
  }
  std::vector<std::string> open;
  bool root_closed = false;
  while (pos < xml.size()) {
    const size_t lt = xml.find('<', pos);
    const absl::string_view text =
        xml.substr(pos, lt == absl::string_view::npos ? xml.npos : lt - pos);
    if (open.empty() && text.find_first_not_of(" \t\r\n") != absl::string_view::npos) {
      return "text outside the root element";
    }
    if (std::string problem = CharDataProblem(text); !problem.empty()) return problem;
    if (lt == absl::string_view::npos) break;
    pos = lt;
    if (absl::StartsWith(xml.substr(pos), "<!--")) {
      const size_t end = xml.find("-->", pos);
      if (end == absl::string_view::npos) return "unterminated comment";
      pos = end + 3;
      continue;
    }
    const bool closing = absl::StartsWith(xml.substr(pos), "</");
    pos += closing ? 2 : 1;
    const size_t name_start = pos;
    while (pos < xml.size() && IsNameChar(xml[pos])) ++pos;
    const std::string name(xml.substr(name_start, pos - name_start));
    if (name.empty()) return "tag without a name at " + std::to_string(name_start);
    if (closing) {
      if (pos >= xml.size() || xml[pos] != '>') return "bad closing tag </" + name;
      ++pos;
      if (open.empty() || open.back() != name) return "mismatched </" + name + ">";
      open.pop_back();
      if (open.empty()) root_closed = true;
      continue;
    }
    if (root_closed || (open.empty() && !root->empty())) return "second root element " + name;
    if (open.empty()) *root = name;
    // Attributes, then '>' or '/>'.
    std::map<std::string, bool> seen;
    while (true) {
      while (pos < xml.size() && std::isspace(static_cast<unsigned char>(xml[pos]))) ++pos;
      if (pos >= xml.size()) return "unterminated tag <" + name;
      if (absl::StartsWith(xml.substr(pos), "/>")) {
        pos += 2;
        if (open.empty()) root_closed = true;
        break;
      }
      if (xml[pos] == '>') {
        ++pos;
        open.push_back(name);
        break;
      }
      const size_t attr_start = pos;
      while (pos < xml.size() && IsNameChar(xml[pos])) ++pos;
      const std::string attr(xml.substr(attr_start, pos - attr_start));
      if (attr.empty()) return "bad attribute in <" + name;
      if (seen[attr]) return "duplicate attribute " + attr + " in <" + name;
      seen[attr] = true;
      if (pos + 1 >= xml.size() || xml[pos] != '=' ||
          (xml[pos + 1] != '"' && xml[pos + 1] != '\'')) {
        return absl::StrCat("attribute ", attr, " without a quoted value in <", name);
      }
      const char quote = xml[pos + 1];
      const size_t end = xml.find(quote, pos + 2);
      if (end == absl::string_view::npos) return "unterminated attribute " + attr;
      if (std::string problem = CharDataProblem(xml.substr(pos + 2, end - pos - 2));
          !problem.empty()) {
        return problem + " in attribute " + attr;
      }
      pos = end + 1;
    }
  }
  if (!open.empty()) return "unclosed <" + open.back() + ">";
  if (!root_closed) return "no root element";
  return "";
}

int CountOf(absl::string_view haystack, absl::string_view needle) {
  int count = 0;
  for (size_t pos = haystack.find(needle); pos != absl::string_view::npos;
       pos = haystack.find(needle, pos + needle.size())) {
    ++count;
  }
  return count;
}

// ----------------------------------------------------------------------------------------------
// Fixtures.

// A report with deterministic, distinct numbers: rank r's micro-batch m of policy p takes
// 0.1 * (1 + r) + 0.01 * m * (p + 1) seconds, so the last rank is the slowest.
SimReport MakeReport(int ranks, int micro_batches, int steps, const std::vector<Policy>& policies) {
  SimReport report;
  SimScenario& s = report.scenario;
  s.trace = "prolong";
  s.pack_length = 65536;
  s.ranks = ranks;
  s.micro_batches = micro_batches;
  s.capacity = 131072;
  s.fill = 0.9;
  s.steps = steps;
  s.mode = "quantile:0.75";
  s.slow_ranks = 2;
  s.slow_factor = 0.5;
  s.noise = 0.05;
  s.seed = 7;
  s.density_default = 0.3;
  s.density_min = 0.05;
  s.cost_truth = "efficiency";
  s.sensitivity_prior = "noisy:0.1";
  s.recall_rows = 32;
  for (int p = 0; p < static_cast<int>(policies.size()); ++p) {
    PolicyResult r;
    r.policy = policies[p];
    for (int step = 0; step < steps; ++step) {
      r.step_seconds.push_back(10.0 + 0.1 * step - 0.5 * p + 0.2 * (step % 3));
    }
    r.mean_step_seconds = 10.0 - 0.5 * p;
    r.speedup_vs_sequential = 1.0 + 0.1 * p;
    r.speedup_vs_flops = 0.9 + 0.05 * p;
    r.imbalance_ratio = 1.5 - 0.05 * p;
    r.bubble_ratio = 0.2 - 0.02 * p;
    r.mean_density = 0.3;
    r.mean_recall = 0.95;
    r.mean_predicted_recall = 0.9;
    // Two buckets with tokens (2K-8K and 32K+), two without.
    for (int b = 0; b < 4; ++b) {
      BucketRecallResult bucket;
      bucket.bucket = b;
      bucket.label = std::vector<std::string>{"<2K", "2K-8K", "8K-32K", "32K+"}[b];
      bucket.tokens = b % 2 == 1 ? 1000.0 * b : 0.0;
      bucket.true_recall = b % 2 == 1 ? 0.9 + 0.01 * b - 0.02 * p : 0.0;
      bucket.predicted_recall = b % 2 == 1 ? 0.85 : 0.0;
      bucket.learned_exponent = 4.0;
      bucket.truth_exponent = 3.5;
      bucket.prior_exponent = 6.0;
      r.buckets.push_back(bucket);
    }
    r.median_gap = 0.04;
    r.median_prediction_error = 0.03;
    r.mean_plan_seconds = 0.0012;
    for (int rank = 0; rank < ranks; ++rank) {
      r.learned_speed_factors.push_back(rank < 2 ? 0.5 : 1.0);
      std::vector<double> row;
      for (int mb = 0; mb < micro_batches; ++mb) {
        row.push_back(0.1 * (1 + rank) + 0.01 * mb * (p + 1));
      }
      r.timeline.push_back(row);
    }
    r.timeline_step_seconds = r.step_seconds.empty() ? 0.0 : r.step_seconds.back();
    report.results.push_back(r);
  }
  return report;
}

SimReport SmallReport() {
  return MakeReport(/*ranks=*/4, /*micro_batches=*/3, /*steps=*/5,
                    {Policy::kSequential, Policy::kFlops, Policy::kSparseBalance});
}

// The table row of `policy`, split on whitespace.
std::vector<std::string> TableRow(const std::string& table, Policy policy) {
  for (absl::string_view line : absl::StrSplit(table, '\n')) {
    std::vector<std::string> cells = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (!cells.empty() && cells[0] == PolicyName(policy)) return cells;
  }
  return {};
}

// ----------------------------------------------------------------------------------------------
// The test helpers themselves.

TEST(XmlCheckTest, AcceptsWellFormedAndRejectsBroken) {
  std::string root;
  EXPECT_EQ(XmlProblem("<?xml version=\"1.0\"?>\n<a x=\"1&amp;2\"><b/><!-- c --><c>t&lt;</c></a>\n",
                       &root),
            "");
  EXPECT_EQ(root, "a");
  for (const char* xml :
       {"<a><b></a></b>", "<a>", "<a x=1/>", "<a x=\"1\" x=\"2\"/>", "<a>x & y</a>", "<a x=\"<\"/>",
        "<a/><b/>", "text<a/>", "<a>&bogus;</a>"}) {
    root.clear();
    EXPECT_NE(XmlProblem(xml, &root), "") << xml;
  }
}

// ----------------------------------------------------------------------------------------------
// FormatTable.

TEST(FormatTableTest, ListsScenarioAndEveryPolicy) {
  SimReport report = MakeReport(4, 3, 5, AllPolicies());
  report.results[2].speedup_vs_sequential = 1.234;
  const std::string table = FormatTable(report);
  EXPECT_TRUE(absl::StrContains(table, "prolong")) << table;
  EXPECT_TRUE(absl::StrContains(table, "quantile:0.75")) << table;
  EXPECT_TRUE(absl::StrContains(table, "131072")) << table;
  for (Policy policy : AllPolicies()) {
    EXPECT_EQ(TableRow(table, policy).size(), 11u) << PolicyName(policy) << "\n" << table;
  }
  const std::vector<std::string> flops = TableRow(table, Policy::kFlops);
  ASSERT_EQ(flops.size(), 11u);
  EXPECT_EQ(flops[1], "9.000");  // mean step seconds
  EXPECT_EQ(flops[2], "1.23x");  // vs sequential
  EXPECT_EQ(flops[5], "16.0%");  // bubble
  EXPECT_EQ(flops[6], "0.300");  // density
  EXPECT_EQ(flops[10], "1.20");  // plan ms
  EXPECT_TRUE(absl::StrContains(table, "imbalance: max/mean rank compute")) << table;
}

TEST(FormatTableTest, PrintsDashWhenFlopsDidNotRun) {
  SimReport report = SmallReport();
  report.results[0].speedup_vs_flops = 0.0;
  report.results[2].speedup_vs_flops = 1.5;
  const std::string table = FormatTable(report);
  EXPECT_EQ(TableRow(table, Policy::kSequential).at(3), "-") << table;
  EXPECT_EQ(TableRow(table, Policy::kSparseBalance).at(3), "1.50x") << table;
}

TEST(FormatTableTest, RowsAreAlignedToTheRule) {
  SimReport report = MakeReport(4, 3, 5, AllPolicies());
  report.results[0].mean_step_seconds = 1234.5;  // a wide cell must widen its column
  const std::string table = FormatTable(report);
  std::vector<absl::string_view> lines = absl::StrSplit(table, '\n');
  // Two tables (step figures, then recall per bucket), each with its header over a rule and
  // one row per policy as wide as the rule.
  int tables = 0;
  for (size_t rule = 1; rule < lines.size(); ++rule) {
    if (!absl::StartsWith(lines[rule], "---")) continue;
    ++tables;
    const size_t width = lines[rule].size();
    EXPECT_EQ(lines[rule - 1].size(), width) << "header\n" << table;
    ASSERT_LE(rule + AllPolicies().size(), lines.size() - 1) << table;
    for (size_t k = 0; k < AllPolicies().size(); ++k) {
      const absl::string_view line = lines[rule + 1 + k];
      EXPECT_TRUE(absl::StartsWith(line, absl::StrCat(PolicyName(AllPolicies()[k]), " "))) << line;
      EXPECT_EQ(line.size(), width) << line;
    }
  }
  EXPECT_EQ(tables, 2) << table;
}

// The second table: true/predicted recall of every bucket some policy placed tokens in, the
// token-weighted total, and the worst bucket's true recall minus sequential's.
TEST(FormatTableTest, RecallPerBucketTable) {
  SimReport report = SmallReport();  // sequential, flops, sparsebalance
  const std::string table = FormatTable(report);
  EXPECT_TRUE(absl::StrContains(table, "recall 2K-8K")) << table;
  EXPECT_TRUE(absl::StrContains(table, "recall 32K+")) << table;
  EXPECT_FALSE(absl::StrContains(table, "recall <2K")) << table;  // no tokens in any policy
  EXPECT_TRUE(absl::StrContains(table, "cost truth efficiency; sensitivity prior noisy:0.1"))
      << table;
  std::vector<std::string> sb;
  for (absl::string_view line : absl::StrSplit(table, '\n')) {
    if (absl::StartsWith(line, "sparsebalance ")) {
      sb = absl::StrSplit(line, ' ', absl::SkipEmpty());  // the last such line: second table
    }
  }
  // policy, 2K-8K, 32K+, all, worst vs seq ("-4.00", "pt").
  ASSERT_EQ(sb.size(), 6u) << table;
  EXPECT_EQ(sb[1], "0.870/0.850");  // 0.9 + 0.01 - 0.04
  EXPECT_EQ(sb[2], "0.890/0.850");
  EXPECT_EQ(sb[3], "0.950/0.900");
  EXPECT_EQ(sb[4], "-4.00");
}

// ----------------------------------------------------------------------------------------------
// FormatJson.

TEST(FormatJsonTest, ParsesAndHasEveryField) {
  const SimReport report = SmallReport();
  const Json json = ParseJson(FormatJson(report));
  ASSERT_TRUE(json.is_object()) << FormatJson(report);
  ASSERT_TRUE(json.contains("scenario"));
  const Json& scenario = json["scenario"];
  EXPECT_EQ(Keys(scenario), (std::vector<std::string>{"trace",
                                                      "pack_length",
                                                      "ranks",
                                                      "micro_batches",
                                                      "capacity",
                                                      "fill",
                                                      "steps",
                                                      "mode",
                                                      "slow_ranks",
                                                      "slow_factor",
                                                      "noise",
                                                      "seed",
                                                      "density_default",
                                                      "density_min",
                                                      "cost_truth",
                                                      "sensitivity_prior",
                                                      "recall_rows",
                                                      "bucket_recall_margin",
                                                      "document_recall_floor",
                                                      "max_shards"}));
  EXPECT_EQ(scenario["mode"], "quantile:0.75");
  EXPECT_EQ(scenario["capacity"], 131072);

  ASSERT_TRUE(json.contains("results"));
  const Json& results = json["results"];
  ASSERT_EQ(results.size(), report.results.size());
  for (size_t i = 0; i < report.results.size(); ++i) {
    const Json& result = results[i];
    EXPECT_EQ(Keys(result),
              (std::vector<std::string>{
                  "policy", "mean_step_seconds", "speedup_vs_sequential", "speedup_vs_flops",
                  "imbalance_ratio", "bubble_ratio", "mean_density", "mean_recall",
                  "mean_predicted_recall", "buckets", "median_gap", "median_prediction_error",
                  "mean_plan_seconds", "split_documents", "exchange_share", "step_seconds",
                  "learned_speed_factors", "timeline", "timeline_step_seconds"}));
    EXPECT_EQ(result["policy"], std::string(PolicyName(report.results[i].policy)));
    EXPECT_EQ(result["step_seconds"].size(), 5u);
    EXPECT_EQ(result["learned_speed_factors"].size(), 4u);
    const Json& timeline = result["timeline"];
    ASSERT_EQ(timeline.size(), 4u);
    for (const Json& rank : timeline) EXPECT_EQ(rank.size(), 3u);
    EXPECT_EQ(timeline[3][2].get<double>(), report.results[i].timeline[3][2]);
    ASSERT_EQ(result["buckets"].size(), 4u);
    EXPECT_EQ(
        Keys(result["buckets"][3]),
        (std::vector<std::string>{"bucket", "label", "tokens", "true_recall", "predicted_recall",
                                  "learned_exponent", "truth_exponent", "prior_exponent"}));
    EXPECT_EQ(result["buckets"][3]["label"], "32K+");
    EXPECT_EQ(result["buckets"][3]["true_recall"].get<double>(),
              report.results[i].buckets[3].true_recall);
  }
}

TEST(FormatJsonTest, NumbersRoundTrip) {
  SimReport report = SmallReport();
  report.scenario.seed = std::numeric_limits<uint64_t>::max();
  report.results[1].mean_step_seconds = 12.345678901;
  report.results[1].step_seconds[2] = 0.1 + 0.2;  // needs all 17 digits
  report.results[1].median_gap = 1e-300;
  const std::string text = FormatJson(report);
  EXPECT_TRUE(absl::StrContains(text, "\"mean_step_seconds\": 12.345678901,")) << text;
  EXPECT_TRUE(absl::StrContains(text, "\"seed\": 18446744073709551615")) << text;
  const Json json = ParseJson(text);
  ASSERT_FALSE(json.is_discarded());
  const Json& result = json["results"][1];
  EXPECT_EQ(result["mean_step_seconds"].get<double>(), 12.345678901);
  EXPECT_EQ(result["step_seconds"][2].get<double>(), 0.1 + 0.2);
  EXPECT_EQ(result["median_gap"].get<double>(), 1e-300);
  EXPECT_EQ(json["scenario"]["seed"].get<uint64_t>(), std::numeric_limits<uint64_t>::max());
}

TEST(FormatJsonTest, EscapesQuotesBackslashesAndControlCharacters) {
  SimReport report = SmallReport();
  report.scenario.trace = "C:\\traces\\\"long\" docs\n\t\x01.jsonl";
  const std::string text = FormatJson(report);
  EXPECT_TRUE(absl::StrContains(text, R"("C:\\traces\\\"long\" docs\n\t\u0001.jsonl")")) << text;
  const Json json = ParseJson(text);
  ASSERT_FALSE(json.is_discarded()) << text;
  EXPECT_EQ(json["scenario"]["trace"], report.scenario.trace);
}

TEST(FormatJsonTest, InvalidUtf8InATracePathStillGivesValidJson) {
  SimReport report = SmallReport();
  report.scenario.trace = "traces/\xff\xfe.txt";
  const Json json = ParseJson(FormatJson(report));
  ASSERT_FALSE(json.is_discarded());
  EXPECT_EQ(json["scenario"]["trace"], "traces/\xef\xbf\xbd\xef\xbf\xbd.txt");  // U+FFFD each
}

TEST(FormatJsonTest, NonFiniteNumbersBecomeNull) {
  SimReport report = SmallReport();
  report.results[0].mean_recall = std::nan("");
  report.results[0].step_seconds[1] = std::numeric_limits<double>::infinity();
  report.results[0].timeline[0][0] = -std::numeric_limits<double>::infinity();
  const std::string text = FormatJson(report);
  const Json json = ParseJson(text);
  ASSERT_FALSE(json.is_discarded()) << text;
  const Json& result = json["results"][0];
  EXPECT_TRUE(result["mean_recall"].is_null());
  EXPECT_TRUE(result["step_seconds"][1].is_null());
  EXPECT_TRUE(result["step_seconds"][2].is_number());
  EXPECT_TRUE(result["timeline"][0][0].is_null());
}

TEST(FormatJsonTest, EmptyReportIsValid) {
  const Json json = ParseJson(FormatJson(SimReport()));
  ASSERT_FALSE(json.is_discarded()) << FormatJson(SimReport());
  EXPECT_TRUE(json["results"].is_array());
  EXPECT_TRUE(json["results"].empty());
}

// ----------------------------------------------------------------------------------------------
// FormatSvg.

TEST(FormatSvgTest, IsWellFormedStandaloneSvg) {
  const std::string svg = FormatSvg(SmallReport());
  absl::string_view rest = svg;
  if (absl::StartsWith(rest, "<?xml")) rest.remove_prefix(rest.find("?>") + 2);
  while (!rest.empty() && std::isspace(static_cast<unsigned char>(rest.front()))) {
    rest.remove_prefix(1);
  }
  EXPECT_TRUE(absl::StartsWith(rest, "<svg ")) << svg.substr(0, 200);
  EXPECT_TRUE(absl::StrContains(svg, "xmlns=\"http://www.w3.org/2000/svg\""));
  EXPECT_TRUE(absl::StrContains(svg, " width=\""));
  EXPECT_TRUE(absl::StrContains(svg, " height=\""));
  EXPECT_TRUE(absl::StrContains(svg, " viewBox=\"0 0 "));
  EXPECT_EQ(CountOf(svg, "<svg"), 1);
  EXPECT_EQ(CountOf(svg, "</svg>"), 1);
  std::string root;
  EXPECT_EQ(XmlProblem(svg, &root), "");
  EXPECT_EQ(root, "svg");
  for (const PolicyResult& result : SmallReport().results) {
    EXPECT_TRUE(absl::StrContains(svg, PolicyName(result.policy)));
  }
}

TEST(FormatSvgTest, OnePolylinePerPolicy) {
  const SimReport report = MakeReport(4, 3, 20, AllPolicies());
  const std::string svg = FormatSvg(report);
  EXPECT_EQ(CountOf(svg, "<polyline"), static_cast<int>(report.results.size()));
  // The first series has one "x,y" point per step.
  const size_t first = svg.find("<polyline");
  const size_t points = svg.find("points=\"", first) + 8;
  const absl::string_view list(svg.data() + points, svg.find('"', points) - points);
  EXPECT_EQ(CountOf(list, ","), 20);
}

TEST(FormatSvgTest, OneBarPerRankAndPolicyAndOneSegmentPerMicroBatch) {
  const SimReport report = SmallReport();  // 4 ranks x 3 micro-batches x 3 policies
  const std::string svg = FormatSvg(report);
  EXPECT_EQ(CountOf(svg, "class=\"bar\""), 4 * 3);
  EXPECT_EQ(CountOf(svg, "class=\"mb\""), 4 * 3 * 3);
  EXPECT_FALSE(absl::StrContains(svg, "showing"));
}

TEST(FormatSvgTest, DrawsOnlyTheSlowest64Ranks) {
  // Rank r's time grows with r, so ranks 36..99 are the slowest 64.
  const SimReport report = MakeReport(100, 2, 5, {Policy::kTokens, Policy::kSab});
  const std::string svg = FormatSvg(report);
  EXPECT_EQ(CountOf(svg, "showing 64 of 100 ranks"), 2);
  EXPECT_EQ(CountOf(svg, "class=\"bar\""), 64 * 2);
  EXPECT_EQ(CountOf(svg, "class=\"mb\""), 64 * 2 * 2);
  // The first row is always labelled: it must be rank 36, not rank 0.
  EXPECT_TRUE(absl::StrContains(svg, ">r36</text>"));
  EXPECT_FALSE(absl::StrContains(svg, ">r0</text>"));
  std::string root;
  EXPECT_EQ(XmlProblem(svg, &root), "");
}

TEST(FormatSvgTest, EscapesXmlSpecialCharacters) {
  SimReport report = SmallReport();
  report.scenario.trace = "a<b>&\"c'\x01.jsonl";
  report.scenario.mode = "<mean>";
  const std::string svg = FormatSvg(report);
  EXPECT_TRUE(absl::StrContains(svg, "a&lt;b&gt;&amp;&quot;c&apos;?.jsonl")) << svg;
  EXPECT_TRUE(absl::StrContains(svg, "&lt;mean&gt;"));
  EXPECT_FALSE(absl::StrContains(svg, "a<b>"));
  std::string root;
  EXPECT_EQ(XmlProblem(svg, &root), "");
}

TEST(FormatSvgTest, StaysUnderOneMegabyteForALargeRun) {
  const SimReport report = MakeReport(1024, 4, 5000, AllPolicies());
  const std::string svg = FormatSvg(report);
  EXPECT_LT(svg.size(), 1000u * 1000u);
  EXPECT_EQ(CountOf(svg, "class=\"bar\""), 64 * 6);
  EXPECT_EQ(CountOf(svg, "<polyline"), 6);
  std::string root;
  EXPECT_EQ(XmlProblem(svg, &root), "");
}

TEST(FormatSvgTest, SurvivesEmptyAndNonFiniteData) {
  SimReport report = SmallReport();
  report.results[0].timeline.clear();
  report.results[0].step_seconds.clear();
  report.results[1].step_seconds[0] = std::nan("");
  report.results[1].timeline[1][1] = std::numeric_limits<double>::infinity();
  report.results[2].timeline_step_seconds = std::nan("");
  for (const SimReport& r : {report, SimReport()}) {
    const std::string svg = FormatSvg(r);
    std::string root;
    EXPECT_EQ(XmlProblem(svg, &root), "");
    // No number printed as nan or inf; the style sheet is skipped ("dominant-baseline").
    const absl::string_view drawing = absl::string_view(svg).substr(svg.find("</defs>"));
    EXPECT_FALSE(absl::StrContains(drawing, "nan")) << svg;
    EXPECT_FALSE(absl::StrContains(drawing, "inf")) << svg;
    EXPECT_EQ(CountOf(svg, "<polyline"), static_cast<int>(r.results.size()));
  }
  EXPECT_TRUE(absl::StrContains(FormatSvg(report), "no timeline recorded"));
}

}  // namespace
}  // namespace sparsebalance
