// Helpers shared by the server and client tests: deterministic ids and tokens, batches from
// the pretrain trace, timings that follow a plan's predictions, and whole-file reads and
// writes for tests that damage state files.
#ifndef SPARSEBALANCE_TESTS_SERVER_TEST_SUPPORT_H_
#define SPARSEBALANCE_TESTS_SERVER_TEST_SUPPORT_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "planner/latency_model.h"
#include "planner/traces.h"
#include "planner/types.h"
#include "proto/wire.h"

namespace sparsebalance::test_support {

// The bytes of a file ("" when it cannot be read).
inline std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

// The bytes of the regular files in `dir` (a job's folder in a state directory), as a walk of
// it finds them: what the store's count of a job's bytes must equal.
inline int64_t FolderBytes(const std::string& dir) {
  int64_t bytes = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    if (std::filesystem::is_regular_file(entry.symlink_status())) {
      bytes += static_cast<int64_t>(entry.file_size());
    }
  }
  return bytes;
}

// Replaces a file's bytes (as an attacker or a bad disk would).
inline void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// count()'s value once it is `expected` (a change another thread makes a little later, such
// as a stream's end reaching the service after its client saw it), or after 2 s.
template <typename Count>
int Settled(int expected, Count count) {
  for (int i = 0; i < 200 && count() != expected; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return count();
}

// Stands in for the CSPRNG: "aaa..1", "aaa..2", ... (thread-safe).
inline std::function<std::string(int)> CountingHex() {
  auto counter = std::make_shared<std::atomic<int>>(0);
  return [counter](int n) {
    std::string s = absl::StrCat(++*counter);
    return std::string(n - s.size(), 'a') + s;
  };
}

// A job of `ranks` ranks with 2 micro-batches of 65536 tokens (the size PretrainBatch fills).
inline JobSettings SmallJob(int ranks, int history_steps = 8) {
  JobSettings s;
  s.planner.ranks = ranks;
  s.planner.micro_batches = 2;
  s.planner.micro_batch_capacity = 65536;
  s.history_steps = history_steps;
  return s;
}

// Pretrain documents that fit a micro-batch of `capacity` tokens, filling `fill` of
// ranks x micro_batches x capacity.
inline std::vector<Sample> PretrainBatch(uint64_t seed, int ranks, double fill = 0.6,
                                         int micro_batches = 2, int64_t capacity = 65536) {
  absl::StatusOr<TraceGenerator> gen = TraceGenerator::Builtin("pretrain", seed);
  std::vector<Sample> batch;
  int64_t total = 0;
  const double budget = fill * ranks * micro_batches * static_cast<double>(capacity);
  while (true) {
    Sample s = gen->Next();
    if (s.length > capacity) continue;
    if (static_cast<double>(total + s.length) > budget) break;
    total += s.length;
    batch.push_back(s);
  }
  return batch;
}

// Timings of a rank's planned micro-batches: `factor` times the predicted seconds.
inline std::vector<MicroBatchTiming> TimingsOf(const std::vector<MicroBatchPlan>& micro_batches,
                                               double factor = 1.0) {
  std::vector<MicroBatchTiming> out;
  for (size_t m = 0; m < micro_batches.size(); ++m) {
    const MicroBatchPlan& mb = micro_batches[m];
    if (mb.samples.empty()) continue;
    const double seconds = factor * mb.predicted_seconds;
    MicroBatchTiming t;
    t.micro_batch = static_cast<int>(m);
    t.compute_seconds = seconds;
    t.attention_seconds = 0.3 * seconds;
    t.tokens = mb.tokens;
    t.achieved_density = 0.3;
    t.recall = 0.9;
    out.push_back(t);
  }
  return out;
}

// Adds to each of `timings` (a report of rank `rank` of `plan`) a measured recall for every
// document of its micro-batch: recall(sample, document index).
inline void AddDocumentRecalls(const StepPlan& plan, int rank,
                               const std::function<double(const PlannedSample&, size_t)>& recall,
                               std::vector<MicroBatchTiming>* timings) {
  for (MicroBatchTiming& m : *timings) {
    for (const PlannedSample& p : plan.ranks[rank].micro_batches[m.micro_batch].samples) {
      for (size_t d = 0; d < p.Documents().size(); ++d) {
        DocumentRecallMeasurement r;
        r.sample_id = p.id;
        r.document = static_cast<int>(d);
        r.recall = recall(p, d);
        r.rows = 4;
        m.documents.push_back(r);
      }
    }
  }
}

// Each layer's recall for every document measurement already in `timings` (a report of `rank`
// on `plan`), as sb-worker's probe reports them: recall(p, d, l, rho) of layer l at the density
// the plan gave that layer (the sample's density where it has none per layer), appended to the
// document's layer_recall.
inline void AddLayerRecalls(
    const StepPlan& plan, int rank, int layers,
    const std::function<double(const PlannedSample&, const DocumentRecallMeasurement&, int,
                               double)>& recall,
    std::vector<MicroBatchTiming>* timings) {
  for (MicroBatchTiming& m : *timings) {
    const std::vector<PlannedSample>& samples =
        plan.ranks[rank].micro_batches[m.micro_batch].samples;
    for (DocumentRecallMeasurement& d : m.documents) {
      const PlannedSample& p =
          *std::find_if(samples.begin(), samples.end(),
                        [&](const PlannedSample& q) { return q.id == d.sample_id; });
      for (int l = 0; l < layers; ++l) {
        const double rho = p.layer_densities.empty() ? p.density : p.layer_densities[l];
        d.layer_recall.push_back(recall(p, d, l, rho));
      }
    }
  }
}

// A step of a job of `ranks` >= 4 ranks (SmallJob: 2 micro-batches of 65536 tokens, blocks of
// 64) whose plan splits document 1 (40,000 tokens) over ranks {2, 0, 3} (ring order) at tokens
// 13,312 and 26,624, in micro-batch 0 of each, and gives every rank one unsplit document in
// micro-batch 1: a plan of context parallelism made by hand, so that tests of the contract do
// not depend on the planner's choices. Predictions from `model`.
struct ShardedStep {
  std::vector<Sample> batch;
  StepPlan plan;
  std::vector<int> group = {2, 0, 3};
};
inline ShardedStep MakeShardedStep(const LatencyModel& model, int ranks) {
  ShardedStep out;
  const int64_t cuts[] = {0, 13312, 26624, 40000};
  out.batch.push_back({1, 40000, 0.0, 0, {}});
  out.plan.ranks.resize(ranks);
  for (int r = 0; r < ranks; ++r) {
    const uint64_t id = 100 + static_cast<uint64_t>(r);
    out.batch.push_back({id, 8000 + 1000 * r, 0.0, 0, {}});
    RankPlan& rank = out.plan.ranks[r];
    rank.micro_batches.resize(2);
    for (int j = 0; j < 3; ++j) {
      if (out.group[j] != r) continue;
      PlannedSample p;
      p.id = 1;
      p.length = 40000;
      p.density = 0.3;
      p.shard_begin = cuts[j];
      p.shard_end = cuts[j + 1];
      p.shard_index = j;
      p.shard_group = out.group;
      rank.micro_batches[0].samples.push_back(p);
    }
    PlannedSample whole;
    whole.id = id;
    whole.length = 8000 + 1000 * r;
    whole.density = 0.3;
    rank.micro_batches[1].samples.push_back(whole);
    for (MicroBatchPlan& mb : rank.micro_batches) {
      mb.default_density = 0.3;
      for (const PlannedSample& p : mb.samples) mb.tokens += p.QueryTokens();
      mb.predicted_seconds =
          mb.samples.empty() ? 0.0 : model.PredictSeconds(r, model.PlanFeatures(mb));
      rank.predicted_seconds += mb.predicted_seconds;
    }
    out.plan.makespan_seconds = std::max(out.plan.makespan_seconds, rank.predicted_seconds);
  }
  out.plan.lower_bound_seconds = out.plan.makespan_seconds;
  out.plan.mean_density = 0.3;
  return out;
}

// Timings of rank `rank` in a ShardedStep's plan: the predictions, and on a shard's micro-batch
// an exchange of its bytes at `bytes_per_second` on top (part of compute_seconds).
inline std::vector<MicroBatchTiming> ShardedTimings(const ShardedStep& step,
                                                    const LatencyModel& model, int rank,
                                                    double bytes_per_second) {
  std::vector<MicroBatchTiming> out = TimingsOf(step.plan.ranks[rank].micro_batches);
  for (MicroBatchTiming& t : out) {
    const MicroBatchFeatures f =
        model.PlanFeatures(step.plan.ranks[rank].micro_batches[t.micro_batch]);
    if (f.exchange_bytes <= 0) continue;
    t.exchange_seconds = f.exchange_bytes / bytes_per_second;
    t.compute_seconds =
        model.PredictSeconds(rank, f) - model.ExchangeSeconds(f) + t.exchange_seconds;
  }
  return out;
}

}  // namespace sparsebalance::test_support

#endif  // SPARSEBALANCE_TESTS_SERVER_TEST_SUPPORT_H_
