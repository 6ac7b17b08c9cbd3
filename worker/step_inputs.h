// What every rank of a job derives alike without talking: the global batch of a step (from a
// trace, a seed and the step number, so a restarted rank regenerates any step), a digest of a
// rank's plan (to check that a plan served after a planner restart is the one served before)
// and the documents a planned micro-batch runs as (packed samples split at their segments).
//
//   MicroBatchDocuments docs = DocumentsOf(plan.micro_batches[m]);
//   // docs.lengths[i] tokens at docs.densities[i], part of samples[docs.sample_of[i]]
#ifndef SPARSEBALANCE_WORKER_STEP_INPUTS_H_
#define SPARSEBALANCE_WORKER_STEP_INPUTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/types.h"

namespace sparsebalance {

struct BatchSpec {
  std::string trace = "pretrain";  // a built-in trace (planner/traces.h)
  uint64_t seed = 1;
  int64_t token_budget = 0;  // tokens per step (e.g. fill x ranks x micro-batches x capacity)
  int64_t max_length = 0;    // documents longer than this are skipped (the micro-batch capacity)
  int64_t min_length = 1;    // and shorter ones too
  // Context parallelism: above 0, every step's batch also holds one document of this many
  // tokens (longer than max_length is the point: it trains split over ranks), drawn first and
  // counted in the budget, id LongDocumentId(step).
  int64_t long_document = 0;
};

// Tokens per step, the budget of BatchForStep: `fill` x ranks x micro-batches x capacity
// (tokens), rounded down. INVALID_ARGUMENT naming fill when it is not a positive finite
// number or the product is no token count in [1, 2^63).
absl::StatusOr<int64_t> StepTokenBudget(double fill, int ranks, int micro_batches,
                                        int64_t capacity);

// The id of a step's long document (BatchSpec::long_document): step * 10^6 + 999999.
uint64_t LongDocumentId(int64_t step);

// The batch of `step`: documents drawn from the trace seeded by (seed, step) until the next
// would pass the budget; documents longer than the whole budget that come before the first
// one that fits are skipped. Ids are unique across steps (step * 10^6 + draw index).
// INVALID_ARGUMENT when no document of the length range fits the budget.
absl::StatusOr<std::vector<Sample>> BatchForStep(const BatchSpec& spec, int64_t step);

// FNV-1a over the micro-batches' planned samples (id, length, segments, density), as 16 hex
// digits.
std::string PlanDigest(const std::vector<MicroBatchPlan>& micro_batches);

// The documents a planned micro-batch runs as, in order: every segment of a pre-packed sample
// is a document of its own (a varlen entry, so attention never crosses a boundary), at its
// sample's density. A sample's tokens, achieved density and recall are the token-weighted sums
// of its documents', so a runner's token-weighted totals over these documents are the
// micro-batch's over its samples.
struct MicroBatchDocuments {
  // What each document's synthetic inputs are made from (MakeDocument): the sample's id for
  // its first document, the id mixed with the document's index for the others, so that the
  // documents of a packed sample differ.
  std::vector<uint64_t> ids;
  std::vector<int64_t> lengths;   // tokens
  std::vector<double> densities;  // the sample's density (layer_densities are not run yet)
  std::vector<size_t> sample_of;  // index into MicroBatchPlan::samples
};
MicroBatchDocuments DocumentsOf(const MicroBatchPlan& micro_batch);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_WORKER_STEP_INPUTS_H_
