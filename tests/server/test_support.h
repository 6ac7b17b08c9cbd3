// Helpers shared by the server and client tests: deterministic ids and tokens, batches from
// the pretrain trace, timings that follow a plan's predictions, and whole-file reads and
// writes for tests that damage state files.
#ifndef SPARSEBALANCE_TESTS_SERVER_TEST_SUPPORT_H_
#define SPARSEBALANCE_TESTS_SERVER_TEST_SUPPORT_H_

#include <atomic>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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

// Replaces a file's bytes (as an attacker or a bad disk would).
inline void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
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

}  // namespace sparsebalance::test_support

#endif  // SPARSEBALANCE_TESTS_SERVER_TEST_SUPPORT_H_
