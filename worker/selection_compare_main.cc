// sb-selection-compare: top-k against anchor-guided thresholding (kernels/block_selection.h)
// on sb-worker's synthetic inputs (worker/synthetic_inputs.h), one document per (seed, length),
// at each planned density. For every (length, density, mode) it prints, as min..max over the
// seeds: the achieved density (kept / causal key blocks, all heads), the true recall (kept
// softmax mass, the recall probe on --rows sampled query rows with no cost bound, mean over
// rows and heads), the recall per active block (recall / achieved density), the needle
// queries' recall (rows whose mass sits on one far-back key, in their own head), and, for the
// anchor mode, top-k's recall at the planned density at which top-k achieves the density the
// anchor mode achieved (the same number of active blocks, up to rounding: the same cost).
//
//   sb-selection-compare --lengths=2048,8192,32768 --densities=0.05,0.1,0.2,0.3,0.5 --seeds=1,2,3
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/block_selection.h"
#include "kernels/recall_probe.h"
#include "tools/tool_support.h"
#include "worker/synthetic_inputs.h"

ABSL_FLAG(std::string, lengths, "2048,8192,32768", "document lengths, tokens");
ABSL_FLAG(std::string, densities, "0.05,0.1,0.2,0.3,0.5", "planned densities (the budgets)");
ABSL_FLAG(std::string, taus, "0.05", "anchor thresholds tau in (0, 1], one anchor run each");
ABSL_FLAG(std::string, seeds, "1,2,3", "document ids: one document per seed and length");
ABSL_FLAG(int, heads, 2, "attention heads");
ABSL_FLAG(int, head_dim, 64, "64 or 128");
ABSL_FLAG(int, block_size, 64, "64 or 128");
ABSL_FLAG(int, local_blocks, 1, "key blocks before the diagonal always kept");
ABSL_FLAG(int, rows, 256, "query rows per document the recall is measured on");
ABSL_FLAG(int, threads, 0, "CPU threads (0: all cores)");

namespace sparsebalance {
namespace {

std::vector<double> ParseList(const std::string& flag, const std::string& text) {
  std::vector<double> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    double value = 0.0;
    if (!absl::SimpleAtod(part, &value)) {
      tools::UsageError(absl::StrCat("--", flag, ": \"", part, "\" is not a number"));
    }
    out.push_back(value);
  }
  if (out.empty()) tools::UsageError(absl::StrCat("--", flag, " is empty"));
  return out;
}

struct Figures {
  double achieved = 0.0;       // kept / causal key blocks, all heads
  double recall = 0.0;         // probe: mean over sampled rows and heads
  double needle_recall = 0.0;  // mean over the needle queries, in their heads
};

// Causal (query block, key block) pairs of a document of `blocks` blocks, over the heads.
int64_t CausalPairs(int64_t blocks, int heads) { return blocks * (blocks + 1) / 2 * heads; }

// Kept softmax mass of row `t` of head `h` (document 0 of `index`).
double RowRecall(const kernels::BlockIndex& index, int head_dim, const std::vector<float>& q,
                 const std::vector<float>& k, int h, int64_t t) {
  const int heads = index.heads;
  const int64_t stride = int64_t{heads} * head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const int64_t r = index.RowId(0, h, static_cast<int32_t>(t / index.block_size));
  std::vector<char> kept(index.blocks(0), 0);
  for (int64_t e = index.row_ptr[r]; e < index.row_ptr[r + 1]; ++e) kept[index.col_idx[e]] = 1;
  std::vector<double> logits(t + 1);
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int64_t u = 0; u <= t; ++u) {
    double dot = 0.0;
    for (int d = 0; d < head_dim; ++d) {
      dot +=
          static_cast<double>(q[t * stride + h * head_dim + d]) * k[u * stride + h * head_dim + d];
    }
    logits[u] = dot * scale;
    max_logit = std::max(max_logit, logits[u]);
  }
  double total = 0.0, inside = 0.0;
  for (int64_t u = 0; u <= t; ++u) {
    const double p = std::exp(logits[u] - max_logit);
    total += p;
    if (kept[u / index.block_size]) inside += p;
  }
  return inside / total;
}

Figures Measure(const DocumentTensors& doc, int32_t length, double density,
                const kernels::SelectionOptions& options, int heads, int head_dim, int rows,
                int threads) {
  absl::StatusOr<kernels::Selection> sel =
      kernels::SelectBlocks({0, length}, heads, head_dim, doc.q, doc.k, {density}, options);
  if (!sel.ok()) tools::Fatal(sel.status().ToString());
  const int64_t blocks = sel->index.blocks(0);
  Figures f;
  f.achieved = static_cast<double>(sel->index.active_blocks()) /
               static_cast<double>(CausalPairs(blocks, heads));
  kernels::RecallSampling sampling;
  sampling.rows = rows;
  sampling.max_pair_share = 1e9;  // no cost bound: a measurement, not a training step
  const uint64_t seed = 7;
  const kernels::RecallRows sampled = kernels::SampleRecallRows(sel->index, {seed}, sampling);
  absl::StatusOr<kernels::RecallProbe> probe =
      kernels::ProbeRecall(sel->index, head_dim, doc.q, doc.k, sampled, 0.0f, threads);
  if (!probe.ok()) tools::Fatal(probe.status().ToString());
  f.recall = probe->document_recall[0];
  double needles = 0.0;
  for (size_t n = 0; n < doc.needle_queries.size(); ++n) {
    const int h = static_cast<int>(n / kRetrievalsPerHead);
    needles += RowRecall(sel->index, head_dim, doc.q, doc.k, h, doc.needle_queries[n]);
  }
  f.needle_recall = doc.needle_queries.empty() ? 1.0 : needles / doc.needle_queries.size();
  return f;
}

// The planned density at which top-k achieves `achieved` (bisection: top-k's achieved density
// grows with the planned one), so that both modes are compared at the same cost.
double TopKDensityFor(const DocumentTensors& doc, int32_t length, double achieved,
                      const kernels::SelectionOptions& topk, int heads, int head_dim) {
  double lo = 1e-4, hi = 1.0;
  for (int it = 0; it < 20; ++it) {
    const double mid = 0.5 * (lo + hi);
    absl::StatusOr<kernels::Selection> sel =
        kernels::SelectBlocks({0, length}, heads, head_dim, doc.q, doc.k, {mid}, topk);
    if (!sel.ok()) tools::Fatal(sel.status().ToString());
    const int64_t blocks = sel->index.blocks(0);
    const double got = static_cast<double>(sel->index.active_blocks()) /
                       static_cast<double>(CausalPairs(blocks, heads));
    (got < achieved ? lo : hi) = mid;
  }
  return hi;
}

// "min..max" of `values`, or the value when they agree to the printed digits.
std::string Range(const std::vector<double>& values, int digits) {
  const auto [lo, hi] = std::minmax_element(values.begin(), values.end());
  const std::string a = absl::StrFormat("%.*f", digits, *lo);
  const std::string b = absl::StrFormat("%.*f", digits, *hi);
  return a == b ? a : absl::StrCat(a, "..", b);
}

int Main(int argc, char** argv) {
  tools::InitTool(argc, argv,
                  "top-k against anchor-guided thresholding on sb-worker's synthetic inputs:\n"
                  "achieved density, true recall, recall per active block, needle recall.\n\n"
                  "  sb-selection-compare [--lengths=2048,8192] [--densities=0.1,0.3] "
                  "[--taus=0.05] [--seeds=1,2,3]");
  const std::vector<double> lengths = ParseList("lengths", absl::GetFlag(FLAGS_lengths));
  const std::vector<double> densities = ParseList("densities", absl::GetFlag(FLAGS_densities));
  const std::vector<double> taus = ParseList("taus", absl::GetFlag(FLAGS_taus));
  const std::vector<double> seeds = ParseList("seeds", absl::GetFlag(FLAGS_seeds));
  const int heads = absl::GetFlag(FLAGS_heads);
  const int head_dim = absl::GetFlag(FLAGS_head_dim);
  const int rows = absl::GetFlag(FLAGS_rows);
  const int threads = absl::GetFlag(FLAGS_threads);
  if (rows < 1) tools::UsageError("--rows must be >= 1");
  kernels::SelectionOptions topk;
  topk.block_size = absl::GetFlag(FLAGS_block_size);
  topk.local_blocks = absl::GetFlag(FLAGS_local_blocks);
  topk.threads = threads;

  std::cout << absl::StrFormat("%-7s %-7s %-11s %-13s %-13s %-13s %-13s %-13s\n", "length",
                               "budget", "mode", "achieved", "recall", "recall/dens", "needles",
                               "topk@achieved");
  for (double length_value : lengths) {
    const int32_t length = static_cast<int32_t>(length_value);
    std::vector<DocumentTensors> docs;
    for (double seed : seeds) {
      docs.push_back(MakeDocument(static_cast<uint64_t>(seed), length, heads, head_dim));
    }
    for (double density : densities) {
      // Mode 0: top-k; then one anchor run per tau.
      for (size_t m = 0; m <= taus.size(); ++m) {
        kernels::SelectionOptions options = topk;
        std::string mode = "topk";
        if (m > 0) {
          options.mode = SelectionMode::kAnchor;
          options.anchor_threshold = taus[m - 1];
          mode = absl::StrFormat("anchor%.3g", taus[m - 1]);
        }
        std::vector<double> achieved, recall, per_density, needles, matched;
        for (const DocumentTensors& doc : docs) {
          const Figures f = Measure(doc, length, density, options, heads, head_dim, rows, threads);
          achieved.push_back(f.achieved);
          recall.push_back(f.recall);
          per_density.push_back(f.recall / f.achieved);
          needles.push_back(f.needle_recall);
          if (m > 0) {
            const double planned = TopKDensityFor(doc, length, f.achieved, topk, heads, head_dim);
            matched.push_back(
                Measure(doc, length, planned, topk, heads, head_dim, rows, threads).recall);
          }
        }
        std::cout << absl::StrFormat("%-7d %-7.2f %-11s %-13s %-13s %-13s %-13s %-13s\n", length,
                                     density, mode, Range(achieved, 3), Range(recall, 3),
                                     Range(per_density, 2), Range(needles, 3),
                                     m > 0 ? Range(matched, 3) : std::string("-"));
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace sparsebalance

int main(int argc, char** argv) { return sparsebalance::Main(argc, argv); }
