// Built-in generators of realistic long-tail document lengths, trace files, and pre-packing.
//
// A `TraceGenerator` yields documents (as `Sample`s with sequential ids from 0) forever,
// deterministically from its seed; `NextBatch` draws one step's global batch.
//
//   absl::StatusOr<TraceGenerator> gen = TraceGenerator::Builtin("pretrain", /*seed=*/1);
//   std::vector<Sample> batch = gen->NextBatch(/*token_budget=*/32 * 4 * 131072 * 85 / 100);
#ifndef SPARSEBALANCE_PLANNER_TRACES_H_
#define SPARSEBALANCE_PLANNER_TRACES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "planner/random.h"
#include "planner/types.h"

namespace sparsebalance {

// Names of the built-in traces: "pretrain", "prolong".
const std::vector<std::string>& BuiltinTraceNames();

// Sensitivity for documents whose trace has none: Beta(1, 8), drawn by inverse CDF
// s = 1 - (1 - u)^(1/8): mean 1/9, about 9% of documents above 0.26.
double DrawSensitivity(Rng& rng);

// One document of a trace file line.
struct TraceRecord {
  int64_t length = 0;             // tokens
  double sensitivity = -1.0;      // < 0: not given (drawn with DrawSensitivity)
  std::vector<int64_t> segments;  // optional pre-packed documents, summing to length
};

// Parses a trace file: one document per line, `LENGTH [SENSITIVITY] [SEG:SEG:...]`,
// whitespace-separated; blank lines and lines starting with '#' are skipped. A second field
// with ':' is the segment list (a one-document record needs none). Errors name the line
// number and the field.
absl::StatusOr<std::vector<TraceRecord>> ParseTraceFile(absl::string_view text);

class TraceGenerator {
 public:
  // `name` is one of BuiltinTraceNames().
  static absl::StatusOr<TraceGenerator> Builtin(absl::string_view name, uint64_t seed);
  // Cycles through the records of a trace file in order (a non-empty list).
  static absl::StatusOr<TraceGenerator> FromRecords(std::vector<TraceRecord> records,
                                                    uint64_t seed);

  // Pre-packs documents into sequences of exactly `pack_length` tokens (the documents are
  // concatenated and cut, as pretraining packers do); each sequence is one Sample whose
  // `segments` are the document pieces and whose sensitivity is the largest of theirs.
  // 0 turns packing off. Must be called before the first Next().
  void SetPackLength(int64_t pack_length) { pack_length_ = pack_length; }

  // The next sample (a document, or a packed sequence). Ids are 0, 1, 2, ...
  Sample Next();

  // Samples whose total length stays within `token_budget`: draws until the next sample
  // would exceed it (that sample is kept for the next batch). Always at least one sample.
  std::vector<Sample> NextBatch(int64_t token_budget);

 private:
  TraceGenerator(int builtin, std::vector<TraceRecord> records, uint64_t seed);
  // The next document, its sensitivity drawn when the trace has none.
  TraceRecord NextDocument();
  // Packing: moves partial_ to the next document (a segment of a pre-packed record counts as
  // one) and sets partial_left_ to its length.
  void AdvancePackDocument();

  int builtin_ = -1;                  // index into the built-in table; -1 for file traces
  std::vector<TraceRecord> records_;  // file traces
  size_t next_record_ = 0;
  // Separate streams, so that the lengths do not depend on which sensitivities were drawn.
  Rng length_rng_;
  Rng sensitivity_rng_;
  int64_t pack_length_ = 0;
  uint64_t next_id_ = 0;
  bool has_pending_ = false;
  Sample pending_;              // drawn by NextBatch but over budget
  TraceRecord partial_;         // packing: the document (or pre-packed record) being cut
  size_t partial_segment_ = 0;  // packing: the segment of partial_ being cut
  int64_t partial_left_ = 0;    // packing: tokens of that document not yet packed
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_TRACES_H_
