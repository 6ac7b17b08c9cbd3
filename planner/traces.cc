#include "planner/traces.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "planner/det_math.h"

namespace sparsebalance {
namespace {

// A point of a built-in trace's inverse CDF: the `u` quantile of document length is `tokens`.
// Between knots, log(length) is linear in u, so each interval is a truncated log-uniform piece.
struct LengthKnot {
  double u;
  double tokens;
};

// "pretrain": a web/code pretraining mix, targets p50 3.2K, p90 5.8K, p99 26K, p99.9 120K, max
// 128K tokens, and 2.4% of documents above 8K holding ~22% of the tokens and ~80% of sum L^2
// (the attention cost). The 0.976 knot at 8192 pins the 2.4%; the 0.1 knot sets the body's mean
// so that the tail's token share lands on 22%, and the tail's L^2 share then comes out at ~81%
// (all targets fit together; none had to give).
//
//   u        0     0.1    0.5    0.9    0.976  0.99    0.999    1
//   tokens   64    1300   3200   5800   8192   26000   120000   131072
//
// Measured over 1M draws (seed 1): p50 3202, p90 5800, p99 25814, p99.9 118936, max 131070;
// 2.40% of documents above 8192 with 21.9% of the tokens and 81.3% of sum L^2.
constexpr LengthKnot kPretrainKnots[] = {
    {0.0, 64.0},     {0.1, 1300.0},   {0.5, 3200.0},     {0.9, 5800.0},
    {0.976, 8192.0}, {0.99, 26000.0}, {0.999, 120000.0}, {1.0, 131072.0},
};

// "prolong": a long-context continued-pretraining mix (ProLong-like), targets p50 1.9K, p90 6K,
// p99 16K, p99.9 47K and a tail up to 340K tokens. The 0.1 knot (512) is not a target, only a
// plausible share of short documents.
//
//   u        0     0.1    0.5    0.9    0.99    0.999   1
//   tokens   64    512    1900   6000   16000   47000   340000
//
// Measured over 1M draws (seed 1): p50 1902, p90 6000, p99 15985, p99.9 46706, max 339893.
constexpr LengthKnot kProlongKnots[] = {
    {0.0, 64.0},     {0.1, 512.0},     {0.5, 1900.0},   {0.9, 6000.0},
    {0.99, 16000.0}, {0.999, 47000.0}, {1.0, 340000.0},
};

struct BuiltinTrace {
  const char* name;
  const LengthKnot* knots;
  size_t knot_count;
};

// Same order as BuiltinTraceNames().
constexpr BuiltinTrace kBuiltinTraces[] = {
    {"pretrain", kPretrainKnots, sizeof(kPretrainKnots) / sizeof(kPretrainKnots[0])},
    {"prolong", kProlongKnots, sizeof(kProlongKnots) / sizeof(kProlongKnots[0])},
};

// Inverse CDF at u in [0, 1): log-linear interpolation between knots, rounded to whole tokens
// and kept within [1, last knot].
int64_t LengthAt(const BuiltinTrace& trace, double u) {
  size_t i = 1;
  while (i + 1 < trace.knot_count && u >= trace.knots[i].u) ++i;
  const LengthKnot& lo = trace.knots[i - 1];
  const LengthKnot& hi = trace.knots[i];
  const double t = (u - lo.u) / (hi.u - lo.u);
  const double log_lo = DetLog(lo.tokens);
  const double tokens = DetExp(log_lo + t * (DetLog(hi.tokens) - log_lo));
  const int64_t max_tokens = static_cast<int64_t>(trace.knots[trace.knot_count - 1].tokens);
  return std::min(max_tokens, std::max<int64_t>(1, std::llround(tokens)));
}

// The checks shared by trace files and in-memory records; `where` starts the message
// ("trace line 7", "trace record 3").
absl::Status ValidateRecord(const TraceRecord& record, absl::string_view where) {
  if (record.length <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": length ", record.length, " is not a positive integer"));
  }
  // Negative means "not given"; NaN fails both comparisons, so test for it explicitly.
  if (std::isnan(record.sensitivity) || record.sensitivity > 1.0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": sensitivity ", record.sensitivity, " is outside [0, 1]"));
  }
  if (record.segments.empty()) return absl::OkStatus();
  int64_t sum = 0;
  for (size_t i = 0; i < record.segments.size(); ++i) {
    const int64_t segment = record.segments[i];
    if (segment <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": segment ", i + 1, " is ", segment,
                                                     ", not a positive token count"));
    }
    if (segment > std::numeric_limits<int64_t>::max() - sum) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": segments sum past 2^63 but length is ", record.length));
    }
    sum += segment;
  }
  if (sum != record.length) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": segments sum to ", sum,
                                                   " but length is ", record.length,
                                                   "; make the segments add up to the length"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ParsePositive(absl::string_view field, absl::string_view what,
                                      absl::string_view where) {
  int64_t value = 0;
  if (!absl::SimpleAtoi(field, &value) || value <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", what, " \"", field, "\" is not a positive integer"));
  }
  return value;
}

absl::Status ParseSegments(absl::string_view field, absl::string_view where,
                           std::vector<int64_t>* segments) {
  for (absl::string_view piece : absl::StrSplit(field, ':')) {
    absl::StatusOr<int64_t> segment = ParsePositive(piece, "segment", where);
    if (!segment.ok()) return segment.status();
    segments->push_back(*segment);
  }
  return absl::OkStatus();
}

absl::Status ParseSensitivity(absl::string_view field, absl::string_view where,
                              double* sensitivity) {
  if (!absl::SimpleAtod(field, sensitivity) || std::isnan(*sensitivity)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": sensitivity \"", field, "\" is not a number in [0, 1]"));
  }
  if (*sensitivity < 0.0 || *sensitivity > 1.0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": sensitivity ", field, " is outside [0, 1]"));
  }
  return absl::OkStatus();
}

}  // namespace

const std::vector<std::string>& BuiltinTraceNames() {
  static const std::vector<std::string>* const kNames = [] {
    auto* names = new std::vector<std::string>();
    for (const BuiltinTrace& trace : kBuiltinTraces) names->push_back(trace.name);
    return names;
  }();
  return *kNames;
}

double DrawSensitivity(Rng& rng) {
  // Inverse CDF of Beta(1, 8): F(s) = 1 - (1 - s)^8. 1 - u is in (0, 1], so DetPow's base is
  // positive and s stays in [0, 1).
  return 1.0 - DetPow(1.0 - rng.Uniform(), 1.0 / 8.0);
}

absl::StatusOr<std::vector<TraceRecord>> ParseTraceFile(absl::string_view text) {
  std::vector<TraceRecord> records;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    const std::string where = absl::StrCat("trace line ", line_number);
    const std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r\f\v"), absl::SkipEmpty());
    if (fields.size() > 3) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", fields.size(), " fields; expected LENGTH [SENSITIVITY] [SEG:SEG:...]"));
    }
    TraceRecord record;
    absl::StatusOr<int64_t> length = ParsePositive(fields[0], "length", where);
    if (!length.ok()) return length.status();
    record.length = *length;
    if (fields.size() == 3) {
      absl::Status status = ParseSensitivity(fields[1], where, &record.sensitivity);
      if (!status.ok()) return status;
      status = ParseSegments(fields[2], where, &record.segments);
      if (!status.ok()) return status;
    } else if (fields.size() == 2) {
      // A lone second field is the segment list only when it has a ':' (a list of one
      // document would repeat the length).
      absl::Status status = absl::StrContains(fields[1], ':')
                                ? ParseSegments(fields[1], where, &record.segments)
                                : ParseSensitivity(fields[1], where, &record.sensitivity);
      if (!status.ok()) return status;
    }
    absl::Status status = ValidateRecord(record, where);
    if (!status.ok()) return status;
    records.push_back(std::move(record));
  }
  if (records.empty()) {
    return absl::InvalidArgumentError(
        "trace file has no documents; write one line LENGTH [SENSITIVITY] [SEG:SEG:...] per "
        "document");
  }
  return records;
}

TraceGenerator::TraceGenerator(int builtin, std::vector<TraceRecord> records, uint64_t seed)
    : builtin_(builtin),
      records_(std::move(records)),
      length_rng_(Rng::Mix(seed, 1)),
      sensitivity_rng_(Rng::Mix(seed, 2)) {}

absl::StatusOr<TraceGenerator> TraceGenerator::Builtin(absl::string_view name, uint64_t seed) {
  const std::vector<std::string>& names = BuiltinTraceNames();
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return TraceGenerator(static_cast<int>(i), {}, seed);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown built-in trace \"", name,
                                                 "\"; use one of: ", absl::StrJoin(names, ", "),
                                                 ", or pass a trace file"));
}

absl::StatusOr<TraceGenerator> TraceGenerator::FromRecords(std::vector<TraceRecord> records,
                                                           uint64_t seed) {
  if (records.empty()) {
    return absl::InvalidArgumentError(
        "trace has no documents; pass at least one record (a trace file with one line per "
        "document)");
  }
  for (size_t i = 0; i < records.size(); ++i) {
    absl::Status status = ValidateRecord(records[i], absl::StrCat("trace record ", i + 1));
    if (!status.ok()) return status;
  }
  return TraceGenerator(-1, std::move(records), seed);
}

TraceRecord TraceGenerator::NextDocument() {
  TraceRecord document;
  if (builtin_ >= 0) {
    document.length = LengthAt(kBuiltinTraces[builtin_], length_rng_.Uniform());
  } else {
    document = records_[next_record_];
    next_record_ = (next_record_ + 1) % records_.size();
  }
  if (document.sensitivity < 0.0) document.sensitivity = DrawSensitivity(sensitivity_rng_);
  return document;
}

void TraceGenerator::AdvancePackDocument() {
  if (partial_segment_ + 1 < partial_.segments.size()) {
    ++partial_segment_;
  } else {
    partial_ = NextDocument();
    partial_segment_ = 0;
  }
  partial_left_ = partial_.segments.empty() ? partial_.length : partial_.segments[partial_segment_];
}

Sample TraceGenerator::Next() {
  if (has_pending_) {
    has_pending_ = false;
    return std::move(pending_);
  }
  Sample sample;
  sample.id = next_id_++;
  if (pack_length_ <= 0) {
    TraceRecord document = NextDocument();
    sample.length = document.length;
    sample.sensitivity = document.sensitivity;
    sample.segments = std::move(document.segments);
    return sample;
  }
  sample.length = pack_length_;
  int64_t room = pack_length_;  // tokens of this sequence still to fill
  while (room > 0) {
    if (partial_left_ == 0) AdvancePackDocument();
    const int64_t piece = std::min(room, partial_left_);
    sample.segments.push_back(piece);
    sample.sensitivity = std::max(sample.sensitivity, partial_.sensitivity);
    partial_left_ -= piece;
    room -= piece;
  }
  return sample;
}

std::vector<Sample> TraceGenerator::NextBatch(int64_t token_budget) {
  std::vector<Sample> batch;
  int64_t tokens = 0;
  while (true) {
    Sample sample = Next();
    if (!batch.empty() && sample.length > token_budget - tokens) {
      pending_ = std::move(sample);
      has_pending_ = true;
      return batch;
    }
    tokens += sample.length;
    batch.push_back(std::move(sample));
  }
}

}  // namespace sparsebalance
