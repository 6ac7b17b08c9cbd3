// The plan types of planner/types.h as Python classes, and the pure planner functions a trainer
// may call without a planner (validation, the local fallback plan).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/python/bindings.h"
#include "client/python/record.h"
#include "planner/planner.h"
#include "planner/recall_model.h"
#include "planner/types.h"

namespace sparsebalance {
namespace python {
namespace {

// Enums also accept their planner names ("sparsebalance", "mean", "defer") wherever a field or
// argument expects them: `config.policy = "tokens"`.
template <typename E, typename Parse>
void AcceptNames(py::enum_<E>& cls, Parse parse) {
  cls.def(py::init([parse](const std::string& name) { return parse(name); }),
          "From the planner's name, e.g. the value of --policy.");
  py::implicitly_convertible<std::string, E>();
}

}  // namespace

void BindPlanTypes(py::module_& m) {
  py::enum_<Policy> policy(m, "Policy", "How documents are placed on ranks (DESIGN.md section 5).");
  policy.value("SEQUENTIAL", Policy::kSequential)
      .value("TOKENS", Policy::kTokens)
      .value("FLOPS", Policy::kFlops)
      .value("SAB", Policy::kSab)
      .value("DST", Policy::kDst)
      .value("SPARSEBALANCE", Policy::kSparseBalance);
  policy.def_property_readonly(
      "label", [](Policy p) { return std::string(PolicyName(p)); },
      "The planner's name: 'sequential', 'tokens', 'flops', 'sab', 'dst', 'sparsebalance'.");
  AcceptNames(policy, [](const std::string& name) {
    return ValueOrThrow(ParsePolicy(name), ErrorKind::kPlanner);
  });

  py::enum_<DstMode> dst_mode(m, "DstMode", "How DST chooses the step's target makespan.");
  dst_mode.value("MIN", DstMode::kMin)
      .value("MEAN", DstMode::kMean)
      .value("MAX", DstMode::kMax)
      .value("QUANTILE", DstMode::kQuantile);
  dst_mode.def_property_readonly("label", [](DstMode d) { return std::string(DstModeName(d)); });
  AcceptNames(dst_mode, [](const std::string& name) {
    double quantile = 0.5;
    return ValueOrThrow(ParseDstMode(name, &quantile), ErrorKind::kPlanner);
  });

  py::enum_<OverflowPolicy> overflow(m, "OverflowPolicy",
                                     "What happens when a batch does not fit the step.");
  overflow.value("ERROR", OverflowPolicy::kError).value("DEFER", OverflowPolicy::kDefer);
  overflow.def_property_readonly(
      "label", [](OverflowPolicy o) { return std::string(OverflowPolicyName(o)); });
  AcceptNames(overflow, [](const std::string& name) {
    return ValueOrThrow(ParseOverflowPolicy(name), ErrorKind::kPlanner);
  });

  py::enum_<SelectionMode> selection(
      m, "SelectionMode",
      "How a query block chooses key blocks within its budget (contract/selection_mode.h).");
  selection.value("TOPK", SelectionMode::kTopK).value("ANCHOR", SelectionMode::kAnchor);
  selection.def_property_readonly(
      "label",
      [](SelectionMode s) { return std::string(s == SelectionMode::kAnchor ? "anchor" : "topk"); },
      "The name select_blocks takes: 'topk' or 'anchor'.");
  AcceptNames(selection, [](const std::string& name) {
    if (name == "topk") return SelectionMode::kTopK;
    if (name == "anchor") return SelectionMode::kAnchor;
    throw py::value_error(
        absl::StrCat("selection: '", name, "' is not a selection mode ('topk' or 'anchor')"));
  });

  py::enum_<ShardPolicy> shard_policy(
      m, "ShardPolicy",
      "How documents are split over groups of ranks when PlannerConfig.max_shards > 1 "
      "(context parallelism).");
  shard_policy.value("SPARSE", ShardPolicy::kSparse)
      .value("DENSE", ShardPolicy::kDense)
      .value("STATIC", ShardPolicy::kStatic);
  shard_policy.def_property_readonly(
      "label", [](ShardPolicy p) { return std::string(ShardPolicyName(p)); },
      "The planner's name: 'sparse', 'dense' or 'static'.");
  AcceptNames(shard_policy, [](const std::string& name) {
    return ValueOrThrow(ParseShardPolicy(name), ErrorKind::kPlanner);
  });

  Record<Sample>(m, "Sample", "A document of the global batch (or a pre-packed sequence).")
      .Field("id", &Sample::id, "index into the dataset shared by all ranks; unique in a batch")
      .Field("length", &Sample::length, "tokens")
      .Field("sensitivity", &Sample::sensitivity, "[0, 1]: 0 tolerates sparsity, 1 needs dense")
      .Field("group", &Sample::group, "samples with the same non-zero group land on one rank")
      .Field("segments", &Sample::segments, "document lengths inside a pre-packed sample")
      .Done();

  Record<ModelShape>(m, "ModelShape", "The attention shape the cost model and kernels share.")
      .Field("layers", &ModelShape::layers, "transformer layers")
      .Field("heads", &ModelShape::heads, "attention heads")
      .Field("head_dim", &ModelShape::head_dim, "64 or 128")
      .Field("block_size", &ModelShape::block_size, "tokens per attention block: 64 or 128")
      .Field("local_blocks", &ModelShape::local_blocks,
             "key blocks before the diagonal always kept")
      .Done();

  Record<PlannerConfig>(m, "PlannerConfig", "A job's planning configuration.")
      .Field("ranks", &PlannerConfig::ranks, "data-parallel world size")
      .Field("micro_batches", &PlannerConfig::micro_batches, "per rank and step")
      .Field("micro_batch_capacity", &PlannerConfig::micro_batch_capacity, "tokens per micro-batch")
      .Field("shape", &PlannerConfig::shape, "ModelShape")
      .Field("density_min", &PlannerConfig::density_min, "lowest density DST may give")
      .Field("density_max", &PlannerConfig::density_max, "highest density DST may raise to")
      .Field("density_default", &PlannerConfig::density_default, "density without DST")
      .Field("policy", &PlannerConfig::policy, "Policy (or its name)")
      .Field("dst_mode", &PlannerConfig::dst_mode, "DstMode (or its name)")
      .Field("dst_quantile", &PlannerConfig::dst_quantile, "for DstMode.QUANTILE, in [0, 1]")
      .Field("overflow", &PlannerConfig::overflow, "OverflowPolicy (or its name)")
      .Field("selection", &PlannerConfig::selection,
             "SelectionMode (or 'topk' / 'anchor'): how workers select blocks in a budget")
      .Field("anchor_threshold", &PlannerConfig::anchor_threshold,
             "tau of SelectionMode.ANCHOR, in (0, 1]: a kept block's estimated weight relative "
             "to the best anchor block's")
      .Field("max_shards", &PlannerConfig::max_shards,
             "context parallelism: the most ranks one document may be split over, in "
             "[1, min(ranks, 64)]; 1: no splitting")
      .Field("shard_policy", &PlannerConfig::shard_policy,
             "ShardPolicy (or 'sparse' / 'dense' / 'static'): which documents are split, how")
      .Field("shard_min_length", &PlannerConfig::shard_min_length,
             "ShardPolicy.STATIC only: documents of at least this many tokens are split; 0: half "
             "the micro-batch capacity")
      .Def(
          "validate",
          [](const PlannerConfig& c) { ThrowIfError(ValidateConfig(c), ErrorKind::kPlanner); },
          "Raises PlannerError (INVALID_ARGUMENT, naming the field) when a field is invalid.")
      .Done();

  Record<PlannedSample>(m, "PlannedSample",
                        "One sample of a micro-batch as planned: all a rank needs to run it.")
      .Field("id", &PlannedSample::id, "the batch sample's id")
      .Field("length", &PlannedSample::length, "tokens")
      .Field("density", &PlannedSample::density, "(0, 1]: share of causal key blocks kept")
      .Field("segments", &PlannedSample::segments,
             "document lengths inside a pre-packed sample (sum = length); empty: one document")
      .Field("layer_densities", &PlannedSample::layer_densities,
             "optional, one per layer; empty: density in every layer")
      .Field("shard_begin", &PlannedSample::shard_begin,
             "a shard of a split document: its first query token (a multiple of the block size)")
      .Field(
          "shard_end", &PlannedSample::shard_end,
          "a shard: its query tokens end here (exclusive); keys/values are tokens [0, shard_end)")
      .Field("shard_index", &PlannedSample::shard_index, "a shard: its position in shard_group")
      .Field("shard_group", &PlannedSample::shard_group,
             "a shard: the ranks running shards 0, 1, ... (ring order); empty: not split")
      .Def("documents", &PlannedSample::Documents,
           "The documents the kernels run (tokens each): segments, or [length].")
      .Def("sharded", &PlannedSample::sharded,
           "True when this is one shard of a document split over shard_group.")
      .Def("query_tokens", &PlannedSample::QueryTokens,
           "Query tokens this rank runs: shard_end - shard_begin for a shard, else length.")
      .Done();

  Record<MicroBatchPlan>(m, "MicroBatchPlan", "One micro-batch of a rank's step plan.")
      .Field("samples", &MicroBatchPlan::samples, "list of PlannedSample, in placement order")
      .Field("default_density", &MicroBatchPlan::default_density, "the job's default density")
      .Field("tokens", &MicroBatchPlan::tokens,
             "query tokens in the micro-batch (a shard counts shard_end - shard_begin)")
      .Field("predicted_seconds", &MicroBatchPlan::predicted_seconds,
             "with the rank's speed factor")
      .Done();

  Record<RankPlan>(m, "RankPlan", "One rank's part of a StepPlan.")
      .Field("micro_batches", &RankPlan::micro_batches, "list of MicroBatchPlan")
      .Field("predicted_seconds", &RankPlan::predicted_seconds, "sum over micro-batches")
      .Done();

  Record<DocumentRecallMeasurement>(
      m, "DocumentRecallMeasurement",
      "One document's recall as a rank measured it (DocumentRecall on the wire).")
      .Field("sample_id", &DocumentRecallMeasurement::sample_id, "a sample of the micro-batch")
      .Field("document", &DocumentRecallMeasurement::document,
             "index into the sample's documents()")
      .Field("recall", &DocumentRecallMeasurement::recall,
             "[0, 1]: softmax mass kept, mean over sampled rows (and heads) and layers")
      .Field("layer_recall", &DocumentRecallMeasurement::layer_recall,
             "optional: one per model layer, each in [0, 1]")
      .Field("rows", &DocumentRecallMeasurement::rows, "query rows measured per layer, >= 1")
      .Done();

  Record<MicroBatchTiming>(m, "MicroBatchTiming", "One micro-batch as a rank measured it.")
      .Field("micro_batch", &MicroBatchTiming::micro_batch, "index in the rank's plan")
      .Field("compute_seconds", &MicroBatchTiming::compute_seconds, "forward + backward")
      .Field("attention_seconds", &MicroBatchTiming::attention_seconds,
             "the attention part of compute_seconds")
      .Field("tokens", &MicroBatchTiming::tokens, "tokens run")
      .Field("achieved_density", &MicroBatchTiming::achieved_density,
             "token-weighted share of causal key blocks run")
      .Field("recall", &MicroBatchTiming::recall, "token-weighted attention recall, [0, 1]")
      .Field("documents", &MicroBatchTiming::documents,
             "list of DocumentRecallMeasurement: recall measured on sampled query rows (what "
             "the planner learns its recall curves from); optional")
      .Field("recall_seconds", &MicroBatchTiming::recall_seconds,
             "time spent measuring them, not part of compute_seconds")
      .Field("exchange_seconds", &MicroBatchTiming::exchange_seconds,
             "the part of compute_seconds the micro-batch's shards spent exchanging keys, values "
             "and their gradients with their groups; 0 without shards")
      .Done();

  Record<RankStepReport>(m, "RankStepReport",
                         "One rank's report of one step (PlannerClient.report_step_batch).")
      .Field("step", &RankStepReport::step, "the step")
      .Field("rank", &RankStepReport::rank, "the rank that ran it")
      .Field("micro_batches", &RankStepReport::micro_batches, "list of MicroBatchTiming")
      .Field("wait_seconds", &RankStepReport::wait_seconds, "time the rank idled for the others")
      .Field("planned_locally", &RankStepReport::planned_locally,
             "the rank ran the step's local fallback plan")
      .Done();

  Record<StepPlan>(m, "StepPlan", "A whole step's plan (every rank), e.g. plan_step_locally's.")
      .Field("policy", &StepPlan::policy, "Policy")
      .Field("ranks", &StepPlan::ranks, "list of RankPlan")
      .Field("deferred_ids", &StepPlan::deferred_ids, "samples left for the next step")
      .Field("makespan_seconds", &StepPlan::makespan_seconds, "predicted step time")
      .Field("lower_bound_seconds", &StepPlan::lower_bound_seconds, "perfect balance")
      .Field("gap", &StepPlan::gap, "makespan / lower bound - 1")
      .Field("imbalance_ratio", &StepPlan::imbalance_ratio, "max / mean predicted rank time")
      .Field("bubble_ratio", &StepPlan::bubble_ratio, "idle share of ranks x makespan")
      .Field("mean_density", &StepPlan::mean_density, "token-weighted")
      .Field("predicted_recall", &StepPlan::predicted_recall, "token-weighted, recall model")
      .Field("planned_locally", &StepPlan::planned_locally, "the trainer's fallback plan")
      .Done();

  m.def(
      "validate_batch",
      [](const std::vector<Sample>& batch, const PlannerConfig& config) {
        ThrowIfError(ValidateBatch(batch, config), ErrorKind::kPlanner);
      },
      py::arg("batch"), py::arg("config"),
      "Raises PlannerError (INVALID_ARGUMENT naming samples[i] and the field) for a bad batch.");
  m.def(
      "plan_step_locally",
      [](const std::vector<Sample>& batch, const PlannerConfig& config) {
        return ValueOrThrow(PlanStepLocally(batch, config), ErrorKind::kPlanner);
      },
      py::arg("batch"), py::arg("config"), py::call_guard<py::gil_scoped_release>(),
      "The plan every rank computes alike without the planner (TrainerSession's fallback).");
  m.attr("RECALL_BUCKETS") = kRecallBuckets;
  m.def(
      "recall_bucket",
      [](int64_t length, int64_t capacity) {
        if (capacity < 1) throw py::value_error("capacity: need >= 1 tokens");
        if (length < 1) throw py::value_error("length: need >= 1 tokens");
        return RecallBucket(length, capacity);
      },
      py::arg("length"), py::arg("capacity"),
      "The planner's length bucket of a document, 0 .. RECALL_BUCKETS - 1: [1, C/64), "
      "[C/64, C/16), [C/16, C/4), [C/4, C] for the micro-batch capacity C.");
  m.def(
      "recall_bucket_range",
      [](int bucket, int64_t capacity) {
        if (bucket < 0 || bucket >= kRecallBuckets) {
          throw py::value_error(
              absl::StrCat("bucket: ", bucket, " is not in [0, ", kRecallBuckets, ")"));
        }
        if (capacity < 1) throw py::value_error("capacity: need >= 1 tokens");
        const LengthRange range = RecallBucketRange(bucket, capacity);
        return std::make_pair(range.min, range.max);
      },
      py::arg("bucket"), py::arg("capacity"),
      "(min, max) tokens of a length bucket, both inclusive.");
  m.def(
      "recall_bucket_label",
      [](int bucket, int64_t capacity) {
        if (bucket < 0 || bucket >= kRecallBuckets) {
          throw py::value_error(
              absl::StrCat("bucket: ", bucket, " is not in [0, ", kRecallBuckets, ")"));
        }
        if (capacity < 1) throw py::value_error("capacity: need >= 1 tokens");
        return RecallBucketLabel(bucket, capacity);
      },
      py::arg("bucket"), py::arg("capacity"),
      "The bucket's label as the planner prints it, e.g. '<2K', '2K-8K' at capacity 128K.");
  m.def(
      "policies",
      [] {
        std::vector<Policy> out = AllPolicies();
        return out;
      },
      "Every policy, in the order reports list them.");
}

}  // namespace python
}  // namespace sparsebalance
