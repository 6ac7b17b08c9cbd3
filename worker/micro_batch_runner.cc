#include "worker/micro_batch_runner.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/layer_runner.h"
#include "kernels/linear_cpu.h"
#include "planner/planner.h"
#include "worker/shard_layer.h"
#include "worker/step_inputs.h"
#include "worker/synthetic_inputs.h"

namespace sparsebalance {
namespace {

absl::Status CheckPlan(const MicroBatchPlan& micro_batch, int layers) {
  if (micro_batch.samples.empty()) return absl::InvalidArgumentError("micro-batch: no samples");
  for (size_t k = 0; k < micro_batch.samples.size(); ++k) {
    const PlannedSample& p = micro_batch.samples[k];
    const std::string where = absl::StrCat("samples[", k, "]");
    if (p.length < 1 || p.length > kMaxMicroBatchCapacity) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".length: ", p.length, " is not a token count in [1, 2^30]"));
    }
    if (absl::Status s = ValidateSegments(p.length, p.segments, where); !s.ok()) return s;
    if (!(p.density > 0.0 && p.density <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".density: ", p.density, " is outside (0, 1]"));
    }
    if (p.sharded()) {
      const int shards = static_cast<int>(p.shard_group.size());
      if (shards < 2 || p.shard_index < 0 || p.shard_index >= shards || !p.segments.empty() ||
          p.shard_begin < 0 || p.shard_end <= p.shard_begin || p.shard_end > p.length) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": shard ", p.shard_index, " of ", shards, " ranks, tokens [", p.shard_begin,
            ", ", p.shard_end, ") of ", p.length,
            " is not a shard (2+ ranks, an index among them, a token range, no segments)"));
      }
    }
    if (!p.layer_densities.empty() && static_cast<int>(p.layer_densities.size()) != layers) {
      return absl::InvalidArgumentError(absl::StrCat(where,
                                                     ".layer_densities: ", p.layer_densities.size(),
                                                     " values for a model of ", layers, " layers"));
    }
    for (size_t l = 0; l < p.layer_densities.size(); ++l) {
      if (!(p.layer_densities[l] > 0.0 && p.layer_densities[l] <= 1.0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ".layer_densities[", l, "]: ", p.layer_densities[l], " is outside (0, 1]"));
      }
    }
  }
  return absl::OkStatus();
}

// Each document's density at `layer`: its sample's density for that layer where planned.
std::vector<double> DensitiesAt(const MicroBatchPlan& micro_batch, const MicroBatchDocuments& docs,
                                int layer) {
  std::vector<double> out;
  out.reserve(docs.sample_of.size());
  for (size_t sample : docs.sample_of) {
    const PlannedSample& p = micro_batch.samples[sample];
    out.push_back(p.layer_densities.empty() ? p.density : p.layer_densities[layer]);
  }
  return out;
}

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Every layer of the model is the one layer kernels::LayerRunner runs, on the same inputs.
class LayerwiseRunner : public MicroBatchRunner {
 public:
  LayerwiseRunner(std::unique_ptr<kernels::LayerRunner> layer, const ModelShape& shape,
                  const MicroBatchRunnerOptions& options, bool cpu)
      : layer_(std::move(layer)), shape_(shape), cpu_(cpu) {
    run_.exact_recall = options.exact_recall;
    run_.probe_recall = !options.exact_recall && options.recall_rows > 0;
    run_.sampling.rows = std::max(1, options.recall_rows);
    run_.sampling.max_pair_share = options.recall_pair_share;
    run_.selection = options.selection;
    run_.anchor_threshold = options.anchor_threshold;
  }
  using MicroBatchRunner::Run;

  std::string device_name() const override { return layer_->device_name(); }

  absl::StatusOr<MicroBatchResult> Run(const MicroBatchPlan& micro_batch,
                                       const MicroBatchContext& context) override {
    if (absl::Status s = CheckPlan(micro_batch, shape_.layers); !s.ok()) return s;
    std::vector<size_t> sharded, unsplit;
    for (size_t k = 0; k < micro_batch.samples.size(); ++k) {
      (micro_batch.samples[k].sharded() ? sharded : unsplit).push_back(k);
    }
    if (sharded.empty()) return RunUnsplit(micro_batch, context.recall_seed);
    if (!cpu_) {
      return absl::UnimplementedError(
          absl::StrCat("samples[", sharded[0],
                       "] is a shard of a split document: context parallelism runs on the CPU "
                       "only so far (the NCCL send/recv path is not built)"));
    }
    if (context.exchange == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "samples[", sharded[0],
          "] is a shard of a split document but this rank has no shard exchange (CPU ranks "
          "of a job with max_shards > 1 need --sync)"));
    }
    // The plan's order (ascending id), kept even if a plan lists them otherwise.
    std::stable_sort(sharded.begin(), sharded.end(), [&](size_t a, size_t b) {
      return micro_batch.samples[a].id < micro_batch.samples[b].id;
    });
    MicroBatchResult result;
    result.samples.resize(micro_batch.samples.size());
    double density_sum = 0.0, recall_sum = 0.0, estimate_sum = 0.0;
    for (size_t k : sharded) {
      absl::Status s = RunShard(micro_batch.samples[k], context, &result, &result.samples[k],
                                &density_sum, &estimate_sum);
      if (!s.ok()) return absl::Status(s.code(), absl::StrCat("samples[", k, "]: ", s.message()));
      recall_sum += result.samples[k].recall * result.samples[k].tokens * shape_.layers;
    }
    if (!unsplit.empty()) {
      MicroBatchPlan rest;
      for (size_t k : unsplit) rest.samples.push_back(micro_batch.samples[k]);
      absl::StatusOr<MicroBatchResult> r = RunUnsplit(rest, context.recall_seed);
      if (!r.ok()) return r.status();
      for (size_t i = 0; i < unsplit.size(); ++i) {
        const SampleResult& sample = r->samples[i];
        result.samples[unsplit[i]] = sample;
        density_sum += sample.achieved_density * sample.tokens * shape_.layers;
        recall_sum += sample.recall * sample.tokens * shape_.layers;
      }
      estimate_sum += r->estimated_recall * static_cast<double>(r->tokens) * shape_.layers;
      result.compute_seconds += r->compute_seconds;
      result.attention_seconds += r->attention_seconds;
      result.recall_seconds += r->recall_seconds;
      result.documents = std::move(r->documents);
    }
    for (const SampleResult& sample : result.samples) {
      result.tokens += sample.tokens;
      result.active_blocks += sample.active_blocks;
      result.causal_blocks += sample.causal_blocks;
    }
    const double weight = static_cast<double>(result.tokens) * shape_.layers;
    result.achieved_density = density_sum / weight;
    result.recall = std::clamp(recall_sum / weight, 0.0, 1.0);
    result.estimated_recall = std::clamp(estimate_sum / weight, 0.0, 1.0);
    return result;
  }

 private:
  // Runs one shard of a split document over every layer through the exchange; adds its times
  // to `mb` and its figures to `sample` (and the token- and layer-weighted sums).
  absl::Status RunShard(const PlannedSample& p, const MicroBatchContext& context,
                        MicroBatchResult* mb, SampleResult* sample, double* density_sum,
                        double* estimate_sum) {
    // The unsplit document's tensors (DocumentsOf: its first document's id is the sample's),
    // this shard's rows; made before any clock starts, like the unsplit inputs.
    const DocumentTensors doc = MakeDocument(p.id, p.length, shape_.heads, shape_.head_dim);
    const int64_t stride = int64_t{shape_.heads} * shape_.head_dim;
    auto rows = [&](const std::vector<float>& x) {
      return std::vector<float>(x.begin() + p.shard_begin * stride,
                                x.begin() + p.shard_end * stride);
    };
    const std::vector<float> q = rows(doc.q), k = rows(doc.k), v = rows(doc.v);
    // The gradient of the document's mean output, as the unsplit runner's.
    const std::vector<float> dout(q.size(), 1.0f / static_cast<float>(p.length));
    const int64_t tokens = p.QueryTokens();
    const int64_t hidden = stride;
    std::vector<float> x(static_cast<size_t>(tokens * 4 * hidden), 0.01f), y(x.size()),
        dx(x.size()), w(static_cast<size_t>(4 * hidden * hidden), 0.01f), wt(w.size(), 0.01f);
    ShardLayerInput in;
    in.key.step = context.step;
    in.key.micro_batch = context.micro_batch;
    in.key.sample_id = p.id;
    in.group = p.shard_group;
    in.shard_index = p.shard_index;
    in.document_length = static_cast<int32_t>(p.length);
    in.shard_begin = static_cast<int32_t>(p.shard_begin);
    in.shard_end = static_cast<int32_t>(p.shard_end);
    in.heads = shape_.heads;
    in.head_dim = shape_.head_dim;
    in.selection.block_size = shape_.block_size;
    in.selection.local_blocks = shape_.local_blocks;
    in.selection.mode = run_.selection;
    in.selection.anchor_threshold = run_.anchor_threshold;
    in.selection.threads = 1;
    in.attention.threads = 1;
    in.q = q;
    in.k = k;
    in.v = v;
    in.dout = dout;
    sample->tokens = tokens;
    const int block_size = shape_.block_size;
    for (int layer = 0; layer < shape_.layers; ++layer) {
      in.key.layer = layer;
      in.density = p.layer_densities.empty() ? p.density : p.layer_densities[layer];
      const double start = ThreadCpuSeconds();
      absl::StatusOr<ShardLayerResult> r = RunShardLayer(*context.exchange, in);
      if (!r.ok()) return r.status();
      const double middle = ThreadCpuSeconds();
      // The shard's linear part: the layer runner's GEMMs on its tokens.
      for (auto [in_dim, out_dim] : {std::pair<int64_t, int64_t>{hidden, 3 * hidden},
                                     {hidden, hidden},
                                     {hidden, 4 * hidden},
                                     {4 * hidden, hidden}}) {
        kernels::MatmulCpu(tokens, out_dim, in_dim, x.data(), in_dim, 1, w.data(), y.data(), 1);
        kernels::MatmulCpu(tokens, in_dim, out_dim, y.data(), out_dim, 1, wt.data(), dx.data(), 1);
        kernels::MatmulCpu(in_dim, out_dim, tokens, x.data(), 1, in_dim, y.data(), w.data(), 1);
      }
      const double end = ThreadCpuSeconds();
      // Own compute on the thread's CPU clock; the exchange on the wall clock.
      const double attention = (middle - start) - r->exchange_cpu_seconds + r->exchange_seconds;
      mb->attention_seconds += attention;
      mb->compute_seconds += attention + (end - middle);
      mb->exchange_seconds += r->exchange_seconds;
      sample->exchange_seconds += r->exchange_seconds;
      sample->exchange_bytes += r->key_value_bytes_received;
      // Figures of the shard's rows, as the layer runner's Summarize of the same rows.
      const kernels::ShardSelection& sel = r->selection;
      double kept_share = 0.0, estimate = 0.0, weight = 0.0;
      for (int h = 0; h < sel.heads; ++h) {
        for (int32_t i = sel.first_block(); i < sel.first_block() + sel.query_blocks(); ++i) {
          const int64_t row = sel.Row(h, i);
          const double row_tokens =
              std::min<int64_t>(int64_t{i + 1} * block_size, p.shard_end) - int64_t{i} * block_size;
          const int64_t kept = sel.row_ptr[row + 1] - sel.row_ptr[row];
          kept_share += row_tokens * static_cast<double>(kept) / (i + 1);
          estimate += row_tokens * sel.estimated_recall[row];
          weight += row_tokens;
          sample->active_blocks += kept;
          sample->causal_blocks += i + 1;
        }
      }
      const double achieved = weight > 0 ? kept_share / weight : 1.0;
      const double recall = weight > 0 ? std::clamp(estimate / weight, 0.0, 1.0) : 1.0;
      *density_sum += achieved * static_cast<double>(tokens);
      *estimate_sum += recall * static_cast<double>(tokens);
      sample->achieved_density += achieved / shape_.layers;
      sample->recall += recall / shape_.layers;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<MicroBatchResult> RunUnsplit(const MicroBatchPlan& micro_batch,
                                              uint64_t recall_seed) {
    const MicroBatchDocuments docs = DocumentsOf(micro_batch);
    std::vector<double> densities = DensitiesAt(micro_batch, docs, 0);
    // Each document's index inside its sample (DocumentRecall.document).
    std::vector<int> document_of(docs.ids.size());
    for (size_t i = 1; i < docs.ids.size(); ++i) {
      document_of[i] = docs.sample_of[i] == docs.sample_of[i - 1] ? document_of[i - 1] + 1 : 0;
    }
    // Inputs are the data loader's work, not the step's: made before any clock starts.
    VarlenBatch varlen;
    kernels::LayerBatch batch;
    for (size_t i = 0; i < docs.ids.size(); ++i) {
      varlen.Append(MakeDocument(docs.ids[i], docs.lengths[i], shape_.heads, shape_.head_dim),
                    docs.lengths[i]);
      const uint64_t sample_id = micro_batch.samples[docs.sample_of[i]].id;
      batch.documents.push_back(
          {docs.lengths[i], densities[i], Mix(Mix(recall_seed) ^ sample_id) ^ Mix(document_of[i])});
    }
    batch.q = std::move(varlen.q);
    batch.k = std::move(varlen.k);
    batch.v = std::move(varlen.v);
    if (absl::Status s = layer_->Load(std::move(batch)); !s.ok()) return s;

    MicroBatchResult result;
    result.samples.resize(micro_batch.samples.size());
    std::vector<double> density_sum(result.samples.size()), recall_sum(result.samples.size());
    double estimate_sum = 0.0;
    std::vector<kernels::DocumentMeasurement> figures;  // of the densities measured last
    const bool measured = run_.probe_recall || run_.exact_recall;
    std::vector<DocumentRecallMeasurement> measurements(measured ? docs.ids.size() : 0);
    for (int layer = 0; layer < shape_.layers; ++layer) {
      bool changed = false;
      if (layer > 0) {
        std::vector<double> next = DensitiesAt(micro_batch, docs, layer);
        changed = next != densities;
        if (changed) {
          densities = std::move(next);
          if (absl::Status s = layer_->SetDensities(densities); !s.ok()) return s;
        }
      }
      // Layers at the same densities see the same inputs, so they keep the same blocks and
      // recall: the (exact, off-the-clock) recall is measured once per distinct densities.
      const bool fresh = layer == 0 || changed;
      // Every layer selects blocks as the job says (top-k or anchor); only the recall is
      // measured once per distinct densities. (A layer that kept the defaults ran top-k in an
      // anchor job, while its figures were the first layer's anchor ones.)
      kernels::RunOptions run = run_;
      if (!fresh) run.exact_recall = run.probe_recall = false;
      absl::StatusOr<kernels::LayerMeasurement> m = layer_->Run(run);
      if (!m.ok()) return m.status();
      result.attention_seconds += m->attention_seconds;
      result.compute_seconds += m->seconds();
      result.recall_seconds += m->recall_seconds;
      if (fresh) figures = std::move(m->documents);
      for (size_t d = 0; d < figures.size(); ++d) {
        SampleResult& sample = result.samples[docs.sample_of[d]];
        const kernels::DocumentMeasurement& doc = figures[d];
        if (layer == 0) sample.tokens += doc.tokens;
        sample.active_blocks += doc.active_blocks;
        sample.causal_blocks += doc.causal_blocks;
        density_sum[docs.sample_of[d]] += doc.achieved_density * static_cast<double>(doc.tokens);
        recall_sum[docs.sample_of[d]] += doc.recall * static_cast<double>(doc.tokens);
        estimate_sum += doc.estimated_recall * static_cast<double>(doc.tokens);
        if (measured) {
          DocumentRecallMeasurement& out = measurements[d];
          out.layer_recall.push_back(doc.recall);
          out.rows = layer == 0 ? doc.recall_rows : std::min(out.rows, doc.recall_rows);
        }
      }
    }
    for (size_t d = 0; d < measurements.size(); ++d) {
      DocumentRecallMeasurement& out = measurements[d];
      out.sample_id = micro_batch.samples[docs.sample_of[d]].id;
      out.document = document_of[d];
      double sum = 0.0;
      for (double r : out.layer_recall) sum += r;
      out.recall = std::clamp(sum / static_cast<double>(out.layer_recall.size()), 0.0, 1.0);
    }
    result.documents = std::move(measurements);
    // Token- and layer-weighted means, per sample and over the micro-batch.
    double all_density = 0.0, all_recall = 0.0;
    for (size_t k = 0; k < result.samples.size(); ++k) {
      SampleResult& sample = result.samples[k];
      const double weight = static_cast<double>(sample.tokens) * shape_.layers;
      sample.achieved_density = density_sum[k] / weight;
      sample.recall = std::clamp(recall_sum[k] / weight, 0.0, 1.0);
      result.tokens += sample.tokens;
      result.active_blocks += sample.active_blocks;
      result.causal_blocks += sample.causal_blocks;
      all_density += density_sum[k];
      all_recall += recall_sum[k];
    }
    const double weight = static_cast<double>(result.tokens) * shape_.layers;
    result.achieved_density = all_density / weight;
    result.recall = std::clamp(all_recall / weight, 0.0, 1.0);
    result.estimated_recall = std::clamp(estimate_sum / weight, 0.0, 1.0);
    return result;
  }

  std::unique_ptr<kernels::LayerRunner> layer_;
  ModelShape shape_;
  bool cpu_;
  kernels::RunOptions run_;  // how a layer at fresh densities measures recall
};

}  // namespace

absl::StatusOr<std::unique_ptr<MicroBatchRunner>> MicroBatchRunner::Create(
    const std::string& device, const ModelShape& shape, bool exact_recall) {
  MicroBatchRunnerOptions options;
  options.exact_recall = exact_recall;
  return Create(device, shape, options);
}

absl::StatusOr<std::unique_ptr<MicroBatchRunner>> MicroBatchRunner::Create(
    const std::string& device, const ModelShape& shape,
    const MicroBatchRunnerOptions& runner_options) {
  if (device != "cpu" && device != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat("--device=", device, ": expected cpu or cuda"));
  }
  if (device == "cuda" && runner_options.exact_recall) {
    return absl::InvalidArgumentError("--exact_recall: only with --device=cpu");
  }
  if (runner_options.recall_rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--recall_rows=", runner_options.recall_rows,
                                                   ": must be >= 0 (0: the estimate)"));
  }
  if (!(runner_options.recall_pair_share > 0.0) ||
      !std::isfinite(runner_options.recall_pair_share)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--recall_budget=", runner_options.recall_pair_share,
                     ": must be a positive share of the kept pairs"));
  }
  if (!(runner_options.anchor_threshold > 0.0 && runner_options.anchor_threshold <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("anchor_threshold=", runner_options.anchor_threshold, ": must be in (0, 1]"));
  }
  kernels::LayerRunnerOptions options;
  options.device = device;
  options.threads = 1;  // one rank, one core: its own work on its own thread
  absl::StatusOr<std::unique_ptr<kernels::LayerRunner>> layer =
      kernels::LayerRunner::Create(shape, options);
  if (!layer.ok()) {
    return absl::Status(layer.status().code(),
                        absl::StrCat("--device=", device, ": ", layer.status().message()));
  }
  return Over(*std::move(layer), shape, runner_options, /*cpu=*/device == "cpu");
}

std::unique_ptr<MicroBatchRunner> MicroBatchRunner::Over(
    std::unique_ptr<kernels::LayerRunner> layer, const ModelShape& shape,
    const MicroBatchRunnerOptions& options, bool cpu) {
  return std::unique_ptr<MicroBatchRunner>(
      new LayerwiseRunner(std::move(layer), shape, options, cpu));
}

}  // namespace sparsebalance
