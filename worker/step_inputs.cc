#include "worker/step_inputs.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "planner/traces.h"

namespace sparsebalance {

absl::StatusOr<std::vector<Sample>> BatchForStep(const BatchSpec& spec, int64_t step) {
  if (spec.token_budget <= 0 || spec.max_length <= 0 || spec.min_length > spec.max_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch: token_budget ", spec.token_budget, ", lengths [", spec.min_length, ", ",
        spec.max_length, "]: need a positive budget and a non-empty length range"));
  }
  absl::StatusOr<TraceGenerator> gen =
      TraceGenerator::Builtin(spec.trace, spec.seed * 1000003 + static_cast<uint64_t>(step));
  if (!gen.ok()) return gen.status();
  std::vector<Sample> batch;
  int64_t total = 0;
  if (spec.long_document > 0) {
    Sample s;
    s.id = LongDocumentId(step);
    s.length = spec.long_document;
    batch.push_back(s);
    total = s.length;
  }
  if (batch.empty() && spec.token_budget < spec.min_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch: token_budget ", spec.token_budget, " is below min_length ", spec.min_length,
        ": no document can fit; raise the budget (sb-worker --fill) or lower min_length"));
  }
  constexpr int kMaxDraws = 999999;  // draw indices stay below the 10^6 of an id's step
  int64_t skipped = 0;               // in-range documents passed over the budget
  for (int draws = 0; draws < kMaxDraws; ++draws) {
    Sample s = gen->Next();
    if (s.length > spec.max_length || s.length < spec.min_length) continue;
    if (total + s.length > spec.token_budget) {
      // The batch ends at the first document that does not fit, once it holds one; before
      // that a document longer than the whole budget is passed over, not the end.
      if (!batch.empty()) break;
      ++skipped;
      continue;
    }
    total += s.length;
    s.id = static_cast<uint64_t>(step) * 1000000 + static_cast<uint64_t>(draws);
    batch.push_back(std::move(s));
  }
  if (batch.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch: none of ", kMaxDraws, " documents drawn from trace ", spec.trace,
        " has a length in [", spec.min_length, ", ", spec.max_length, "] within token_budget ",
        spec.token_budget, " (", skipped,
        " in range were longer); raise the budget (sb-worker --fill) or widen the range"));
  }
  return batch;
}

absl::StatusOr<int64_t> StepTokenBudget(double fill, int ranks, int micro_batches,
                                        int64_t capacity) {
  if (!(std::isfinite(fill) && fill > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("fill: ", fill, " must be a positive finite share of the capacity"));
  }
  const double tokens = fill * ranks * micro_batches * static_cast<double>(capacity);
  // Checked in double: a product beyond int64 would make the cast undefined.
  if (!(tokens >= 1 && tokens < 0x1p63)) {
    return absl::InvalidArgumentError(
        absl::StrCat("fill: ", fill, " x ", ranks, " ranks x ", micro_batches, " micro-batches x ",
                     capacity, " tokens = ", tokens, " is no step budget in [1, 2^63) tokens"));
  }
  return static_cast<int64_t>(tokens);
}

uint64_t LongDocumentId(int64_t step) { return static_cast<uint64_t>(step) * 1000000 + 999999; }

std::string PlanDigest(const std::vector<MicroBatchPlan>& micro_batches) {
  uint64_t hash = 1469598103934665603ULL;
  auto mix = [&hash](uint64_t word) {
    for (int b = 0; b < 8; ++b) {
      hash ^= (word >> (8 * b)) & 0xff;
      hash *= 1099511628211ULL;
    }
  };
  auto mix_double = [&mix](double d) {
    uint64_t bits = 0;
    std::memcpy(&bits, &d, sizeof bits);
    mix(bits);
  };
  for (const MicroBatchPlan& mb : micro_batches) {
    mix(mb.samples.size());
    for (const PlannedSample& p : mb.samples) {
      mix(p.id);
      mix(static_cast<uint64_t>(p.length));
      mix(p.segments.size());
      for (int64_t segment : p.segments) mix(static_cast<uint64_t>(segment));
      mix_double(p.density);
      mix(p.layer_densities.size());
      for (double d : p.layer_densities) mix_double(d);
      if (p.sharded()) {  // unsplit samples hash as before shards existed
        mix(static_cast<uint64_t>(p.shard_begin));
        mix(static_cast<uint64_t>(p.shard_end));
        mix(static_cast<uint64_t>(p.shard_index));
        for (int r : p.shard_group) mix(static_cast<uint64_t>(r));
      }
    }
  }
  return absl::StrFormat("%016x", hash);
}

MicroBatchDocuments DocumentsOf(const MicroBatchPlan& micro_batch) {
  MicroBatchDocuments out;
  for (size_t i = 0; i < micro_batch.samples.size(); ++i) {
    const PlannedSample& p = micro_batch.samples[i];
    const std::vector<int64_t> documents = p.Documents();
    for (size_t d = 0; d < documents.size(); ++d) {
      // Odd multiplier (2^64 / golden ratio): distinct d give distinct ids for one sample.
      out.ids.push_back(p.id ^ (static_cast<uint64_t>(d) * 0x9E3779B97F4A7C15ULL));
      out.lengths.push_back(documents[d]);
      out.densities.push_back(p.density);
      out.sample_of.push_back(i);
    }
  }
  return out;
}

}  // namespace sparsebalance
