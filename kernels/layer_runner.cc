#include "kernels/layer_runner.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/types/span.h"
#include "kernels/attention_cpu.h"
#include "kernels/block_index.h"
#include "kernels/block_selection.h"
#include "kernels/cuda_attention.h"
#include "kernels/linear_cpu.h"
#include "kernels/parallel.h"
#include "kernels/recall_probe.h"

#ifdef SB_KERNELS_WITH_CUDA
#include <cuda_runtime.h>

#include "kernels/bf16.h"
#endif

namespace sparsebalance {
namespace kernels {
namespace {

// Longest document, in tokens (cu_seqlens are int32).
constexpr int64_t kMaxDocumentTokens = int64_t{1} << 30;

// One GEMM of the layer's linear part: activations [tokens][in] times weights [in][out].
struct Linear {
  int64_t in = 0;
  int64_t out = 0;
};

// QKV projection, output projection, MLP up (4x) and down.
std::vector<Linear> LayerLinears(int64_t hidden) {
  return {{hidden, 3 * hidden}, {hidden, hidden}, {hidden, 4 * hidden}, {4 * hidden, hidden}};
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "model name")) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
      }
    }
  }
  return "unknown CPU";
}

absl::Status CheckDensities(const std::vector<double>& densities, size_t documents) {
  if (densities.size() != documents) {
    return absl::InvalidArgumentError(absl::StrCat(densities.size(), " densities for ", documents,
                                                   " loaded documents; they must match"));
  }
  for (size_t i = 0; i < densities.size(); ++i) {
    if (!(densities[i] > 0.0 && densities[i] <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("densities[", i, "]=", densities[i], " is outside (0, 1]"));
    }
  }
  return absl::OkStatus();
}

// Checks the batch against the shape and returns its cu_seqlens and densities.
absl::Status CheckBatch(const ModelShape& shape, const LayerBatch& batch,
                        std::vector<int32_t>* cu_seqlens, std::vector<double>* densities,
                        std::vector<uint64_t>* seeds) {
  if (batch.documents.empty()) return absl::InvalidArgumentError("layer batch: no documents");
  cu_seqlens->assign(1, 0);
  densities->clear();
  seeds->clear();
  int64_t tokens = 0;
  for (size_t i = 0; i < batch.documents.size(); ++i) {
    const LayerDocument& d = batch.documents[i];
    if (d.length < 1 || d.length > kMaxDocumentTokens) {
      return absl::InvalidArgumentError(absl::StrCat("layer batch: documents[", i, "].length ",
                                                     d.length, " is not in [1, 2^30] tokens"));
    }
    tokens += d.length;
    if (tokens > kMaxDocumentTokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer batch: ", tokens, "+ tokens, more than 2^30"));
    }
    cu_seqlens->push_back(static_cast<int32_t>(tokens));
    densities->push_back(d.density);
    seeds->push_back(d.recall_seed);
  }
  if (absl::Status s = CheckDensities(*densities, densities->size()); !s.ok()) return s;
  const size_t elements = static_cast<size_t>(tokens) * shape.heads * shape.head_dim;
  for (auto [name, tensor] : {std::pair<const char*, const std::vector<float>*>{"q", &batch.q},
                              {"k", &batch.k},
                              {"v", &batch.v}}) {
    if (tensor->size() != elements) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer batch: ", name, " holds ", tensor->size(), " values; ", tokens,
                       " tokens x ", shape.heads, " heads x ", shape.head_dim, " need ", elements));
    }
  }
  return absl::OkStatus();
}

// The token-weighted mean over document s's CSR rows (all heads) of a value per CSR row.
double TokenWeighted(const BlockIndex& index, const std::vector<float>& row_values, int s) {
  const int32_t length = index.length(s);
  double sum = 0.0;
  double weight = 0.0;
  for (int h = 0; h < index.heads; ++h) {
    for (int32_t i = 0; i < index.blocks(s); ++i) {
      const double tokens =
          std::min<int64_t>(index.block_size, length - int64_t{i} * index.block_size);
      sum += tokens * row_values[index.RowId(s, h, i)];
      weight += tokens;
    }
  }
  return weight > 0 ? std::clamp(sum / weight, 0.0, 1.0) : 1.0;
}

// Per-document kept and causal blocks, achieved density and the block scores' estimated
// recall (token-weighted over the document's rows and heads), which is also `recall` until a
// measurement replaces it.
void Summarize(const BlockIndex& index, const std::vector<float>& estimated_recall,
               LayerMeasurement* out) {
  out->documents.assign(index.sequences(), DocumentMeasurement{});
  for (int s = 0; s < index.sequences(); ++s) {
    DocumentMeasurement& doc = out->documents[s];
    const int32_t length = index.length(s);
    double density_sum = 0.0;
    double weight_sum = 0.0;
    for (int h = 0; h < index.heads; ++h) {
      for (int32_t i = 0; i < index.blocks(s); ++i) {
        const int64_t row = index.RowId(s, h, i);
        const double tokens =
            std::min<int64_t>(index.block_size, length - int64_t{i} * index.block_size);
        const int64_t kept = index.row_ptr[row + 1] - index.row_ptr[row];
        density_sum += tokens * static_cast<double>(kept) / (i + 1);
        weight_sum += tokens;
        doc.active_blocks += kept;
        doc.causal_blocks += i + 1;
      }
    }
    doc.tokens = length;
    doc.estimated_recall = TokenWeighted(index, estimated_recall, s);
    doc.recall = doc.estimated_recall;
    doc.achieved_density = weight_sum > 0 ? density_sum / weight_sum : 1.0;
    out->active_blocks += doc.active_blocks;
    out->causal_blocks += doc.causal_blocks;
  }
}

// Replaces each document's recall by the probe's.
void UseProbe(const RecallRows& rows, const RecallProbe& probe, LayerMeasurement* out) {
  for (size_t s = 0; s < out->documents.size(); ++s) {
    out->documents[s].recall = probe.document_recall[s];
    out->documents[s].recall_rows = rows.count(static_cast<int>(s));
  }
}

absl::Status CheckRunOptions(const RunOptions& options) {
  if (!(options.anchor_threshold > 0.0 && options.anchor_threshold <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("anchor_threshold=", options.anchor_threshold, " is outside (0, 1]"));
  }
  if (options.probe_recall && !options.exact_recall)
    return ValidateRecallSampling(options.sampling);
  return absl::OkStatus();
}

// Seconds on the clock the CPU runner times by (see the header): the calling thread's CPU
// time with one kernel thread, the wall clock with several.
class CpuClock {
 public:
  explicit CpuClock(int threads) : thread_time_(ResolveThreads(threads) == 1) {}
  double Now() const {
    if (!thread_time_) {
      return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
          .count();
    }
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }

 private:
  bool thread_time_;
};

// What both runners share: the shape, and the loaded batch's boundaries and densities.
class BatchRunner : public LayerRunner {
 public:
  explicit BatchRunner(const ModelShape& shape) : shape_(shape) {}
  using LayerRunner::Run;

  // A batch that fails to load leaves none loaded.
  absl::Status Load(LayerBatch batch) final {
    absl::Status s = CheckBatch(shape_, batch, &cu_seqlens_, &densities_, &seeds_);
    if (s.ok()) s = Prepare(std::move(batch));
    if (!s.ok()) cu_seqlens_.clear();
    return s;
  }

  absl::Status SetDensities(const std::vector<double>& densities) override {
    if (absl::Status s = CheckDensities(densities, densities_.size()); !s.ok()) return s;
    densities_ = densities;
    return absl::OkStatus();
  }

 protected:
  // Prepares the buffers of a checked batch whose boundaries and densities are kept already.
  virtual absl::Status Prepare(LayerBatch batch) = 0;
  absl::Status CheckLoaded() const {
    return cu_seqlens_.size() < 2 ? absl::FailedPreconditionError("layer runner: no batch loaded")
                                  : absl::OkStatus();
  }

  const ModelShape shape_;
  std::vector<int32_t> cu_seqlens_;  // token offsets of the documents, from 0
  std::vector<double> densities_;    // one per document
  std::vector<uint64_t> seeds_;      // the documents' recall_seed
};

class CpuLayerRunner : public BatchRunner {
 public:
  CpuLayerRunner(const ModelShape& shape, int threads)
      : BatchRunner(shape), threads_(threads), clock_(threads) {}

  std::string device_name() const override {
    const int threads = ResolveThreads(threads_);
    return absl::StrCat("cpu ", CpuModel(), " (", threads, threads == 1 ? " thread" : " threads",
                        ", fp32 reference)");
  }

  absl::Status Prepare(LayerBatch batch) override {
    batch_ = std::move(batch);
    const int64_t tokens = cu_seqlens_.back();
    const size_t n = batch_.q.size();
    out_.assign(n, 0.0f);
    // The gradient of the mean of the outputs: the values do not change the work.
    dout_.assign(n, 1.0f / static_cast<float>(std::max<int64_t>(1, tokens)));
    dq_.assign(n, 0.0f);
    dk_.assign(n, 0.0f);
    dv_.assign(n, 0.0f);
    lse_.assign(static_cast<size_t>(tokens) * shape_.heads, 0.0f);
    const int64_t hidden = int64_t{shape_.heads} * shape_.head_dim;
    x_.assign(static_cast<size_t>(tokens) * 4 * hidden, 0.01f);
    y_.assign(x_.size(), 0.0f);
    dx_.assign(x_.size(), 0.0f);
    w_.assign(static_cast<size_t>(4 * hidden * hidden), 0.01f);
    wt_.assign(w_.size(), 0.01f);
    return absl::OkStatus();
  }

  absl::StatusOr<LayerMeasurement> Run(const RunOptions& options) override {
    if (absl::Status s = CheckLoaded(); !s.ok()) return s;
    if (absl::Status s = CheckRunOptions(options); !s.ok()) return s;
    SelectionOptions select;
    select.block_size = shape_.block_size;
    select.local_blocks = shape_.local_blocks;
    select.mode = options.selection;
    select.anchor_threshold = options.anchor_threshold;
    select.threads = threads_;
    AttentionOptions attention;
    attention.threads = threads_;
    const int64_t tokens = cu_seqlens_.back();
    LayerMeasurement m;
    const double start = clock_.Now();
    absl::StatusOr<Selection> selection = SelectBlocks(cu_seqlens_, shape_.heads, shape_.head_dim,
                                                       batch_.q, batch_.k, densities_, select);
    if (!selection.ok()) return selection.status();
    if (absl::Status s =
            AttentionForward(selection->index, shape_.head_dim, batch_.q, batch_.k, batch_.v,
                             attention, absl::MakeSpan(out_), absl::MakeSpan(lse_));
        !s.ok()) {
      return s;
    }
    if (absl::Status s = AttentionBackward(
            selection->index, shape_.head_dim, batch_.q, batch_.k, batch_.v, out_, lse_, dout_,
            attention, absl::MakeSpan(dq_), absl::MakeSpan(dk_), absl::MakeSpan(dv_));
        !s.ok()) {
      return s;
    }
    const double middle = clock_.Now();
    for (const Linear& l : LayerLinears(int64_t{shape_.heads} * shape_.head_dim)) {
      // Forward Y = X W, input gradient dX = dY W^T, weight gradient dW = X^T dY; the values
      // do not matter, only the shapes.
      MatmulCpu(tokens, l.out, l.in, x_.data(), l.in, 1, w_.data(), y_.data(), threads_);
      MatmulCpu(tokens, l.in, l.out, y_.data(), l.out, 1, wt_.data(), dx_.data(), threads_);
      MatmulCpu(l.in, l.out, tokens, x_.data(), 1, l.in, y_.data(), w_.data(), threads_);
    }
    const double end = clock_.Now();
    m.attention_seconds = middle - start;
    m.linear_seconds = end - middle;
    Summarize(selection->index, selection->estimated_recall, &m);
    if (options.exact_recall) {
      // A measurement aid, not the layer's work: after the clock stopped.
      absl::StatusOr<std::vector<float>> exact =
          ExactRecall(selection->index, shape_.head_dim, batch_.q, batch_.k, 0.0f, threads_);
      if (!exact.ok()) return exact.status();
      for (int s = 0; s < selection->index.sequences(); ++s) {
        m.documents[s].recall = TokenWeighted(selection->index, *exact, s);
        m.documents[s].recall_rows = selection->index.length(s);
      }
    } else if (options.probe_recall) {
      // Measured, not the layer's work: on its own clock (recall_seconds).
      const RecallRows rows = SampleRecallRows(selection->index, seeds_, options.sampling);
      absl::StatusOr<RecallProbe> probe =
          ProbeRecall(selection->index, shape_.head_dim, batch_.q, batch_.k, rows, 0.0f, threads_);
      if (!probe.ok()) return probe.status();
      m.recall_seconds = clock_.Now() - end;
      UseProbe(rows, *probe, &m);
    }
    return m;
  }

 private:
  int threads_;
  CpuClock clock_;
  LayerBatch batch_;
  std::vector<float> out_, dout_, dq_, dk_, dv_, lse_, x_, y_, dx_, w_, wt_;
};

#ifdef SB_KERNELS_WITH_CUDA
absl::Status CudaCheck(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

class CudaLayerRunner : public BatchRunner {
 public:
  explicit CudaLayerRunner(const ModelShape& shape) : BatchRunner(shape) {}
  ~CudaLayerRunner() override {
    for (cudaEvent_t event : {start_, middle_, stop_}) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  // Its own stream, which does not wait for (or hold up) the legacy default stream.
  absl::Status Init() {
    if (absl::Status s = CudaCheck(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                                   "cudaStreamCreateWithFlags");
        !s.ok()) {
      return s;
    }
    for (cudaEvent_t* event : {&start_, &middle_, &stop_}) {
      if (absl::Status s = CudaCheck(cudaEventCreate(event), "cudaEventCreate"); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  std::string device_name() const override {
    absl::StatusOr<std::string> name = cuda::DeviceName();
    return name.ok() ? *name : "cuda";
  }

  absl::Status Prepare(LayerBatch batch) override {
    const int64_t tokens = cu_seqlens_.back();
    const size_t n = batch.q.size();
    const int64_t hidden = int64_t{shape_.heads} * shape_.head_dim;
    using cuda::DeviceBuffer;
    auto upload = [&](const std::vector<float>& host, DeviceBuffer* out) -> absl::Status {
      std::vector<uint16_t> bf16(host.size());
      for (size_t i = 0; i < host.size(); ++i) bf16[i] = FloatToBf16(host[i]);
      absl::StatusOr<DeviceBuffer> buffer = DeviceBuffer::Allocate(bf16.size() * 2);
      if (!buffer.ok()) return buffer.status();
      if (absl::Status s = buffer->CopyFromHost(bf16.data(), bf16.size() * 2, stream()); !s.ok()) {
        return s;
      }
      *out = *std::move(buffer);
      return absl::OkStatus();
    };
    auto zeros = [&](size_t bytes, DeviceBuffer* out) -> absl::Status {
      absl::StatusOr<DeviceBuffer> buffer = DeviceBuffer::Allocate(bytes);
      if (!buffer.ok()) return buffer.status();
      if (absl::Status s = buffer->Zero(stream()); !s.ok()) return s;
      *out = *std::move(buffer);
      return absl::OkStatus();
    };
    const size_t rows = static_cast<size_t>(tokens) * shape_.heads;
    const size_t widest = static_cast<size_t>(tokens) * 4 * hidden * 2;
    for (absl::Status s : {upload(batch.q, &q_), upload(batch.k, &k_), upload(batch.v, &v_)}) {
      if (!s.ok()) return s;
    }
    for (auto [buffer, bytes] : {std::pair<DeviceBuffer*, size_t>{&out_, n * 2},
                                 {&dout_, n * 2},
                                 {&dq_, n * 2},
                                 {&dk_, n * 2},
                                 {&dv_, n * 2},
                                 {&lse_, rows * 4},
                                 {&delta_, rows * 4},
                                 {&x_, widest},
                                 {&y_, widest},
                                 {&dx_, widest},
                                 {&w_, static_cast<size_t>(4 * hidden * hidden) * 2}}) {
      if (absl::Status s = zeros(bytes, buffer); !s.ok()) return s;
    }
    return cuda::Synchronize(stream());
  }

  absl::StatusOr<LayerMeasurement> Run(const RunOptions& options) override {
    if (absl::Status s = CheckLoaded(); !s.ok()) return s;
    if (absl::Status s = CheckRunOptions(options); !s.ok()) return s;
    if (options.exact_recall) {
      return absl::InvalidArgumentError("exact recall: only on the CPU (--device=cpu)");
    }
    SelectionOptions select;
    select.block_size = shape_.block_size;
    select.local_blocks = shape_.local_blocks;
    select.mode = options.selection;
    select.anchor_threshold = options.anchor_threshold;
    const int64_t tokens = cu_seqlens_.back();
    const int64_t hidden = int64_t{shape_.heads} * shape_.head_dim;
    const cuda::Stream on = stream();
    if (absl::Status s = CudaCheck(cudaEventRecord(start_, stream_), "cudaEventRecord"); !s.ok()) {
      return s;
    }
    absl::StatusOr<cuda::DeviceSelection> chosen = cuda::SelectBlocks(
        cu_seqlens_, shape_.heads, shape_.head_dim, q_.data(), k_.data(), densities_, select, on);
    if (!chosen.ok()) return chosen.status();
    const cuda::DeviceBlockIndex* index = &chosen->index;
    if (absl::Status s = cuda::Forward(*index, shape_.head_dim, q_.data(), k_.data(), v_.data(),
                                       0.0f, out_.data(), static_cast<float*>(lse_.data()), on);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = cuda::Backward(*index, shape_.head_dim, q_.data(), k_.data(), v_.data(),
                                        out_.data(), static_cast<const float*>(lse_.data()),
                                        dout_.data(), 0.0f, static_cast<float*>(delta_.data()),
                                        dq_.data(), dk_.data(), dv_.data(), on);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CudaCheck(cudaEventRecord(middle_, stream_), "cudaEventRecord"); !s.ok()) {
      return s;
    }
    for (const Linear& l : LayerLinears(hidden)) {
      for (absl::Status s : {cuda::MatmulBf16(tokens, l.out, l.in, x_.data(), false, w_.data(),
                                              false, y_.data(), on),
                             cuda::MatmulBf16(tokens, l.in, l.out, y_.data(), false, w_.data(),
                                              true, dx_.data(), on),
                             cuda::MatmulBf16(l.in, l.out, tokens, x_.data(), true, y_.data(),
                                              false, w_.data(), on)}) {
        if (!s.ok()) return s;
      }
    }
    if (absl::Status s = CudaCheck(cudaEventRecord(stop_, stream_), "cudaEventRecord"); !s.ok()) {
      return s;
    }
    if (absl::Status s = CudaCheck(cudaEventSynchronize(stop_), "cudaEventSynchronize"); !s.ok()) {
      return s;
    }
    float attention_ms = 0.0f;
    float linear_ms = 0.0f;
    cudaEventElapsedTime(&attention_ms, start_, middle_);
    cudaEventElapsedTime(&linear_ms, middle_, stop_);
    LayerMeasurement m;
    m.attention_seconds = attention_ms * 1e-3;
    m.linear_seconds = linear_ms * 1e-3;
    // The figures need each row's count and estimated recall, not its blocks: only those come
    // to the host (after the timed part).
    BlockIndex counts = chosen->index.shape();
    std::vector<float> estimated_recall;
    if (absl::Status s = chosen->DownloadCounts(&counts.row_ptr, &estimated_recall, on); !s.ok()) {
      return s;
    }
    Summarize(counts, estimated_recall, &m);
    if (options.probe_recall) {
      // Synchronous (it copies its result back): the host's wall clock times it.
      const auto probe_start = std::chrono::steady_clock::now();
      const RecallRows rows = SampleRecallRows(counts, seeds_, options.sampling);
      absl::StatusOr<RecallProbe> probe =
          cuda::ProbeRecall(*index, shape_.head_dim, q_.data(), k_.data(), rows, on);
      if (!probe.ok()) return probe.status();
      m.recall_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - probe_start).count();
      UseProbe(rows, *probe, &m);
    }
    return m;
  }

 private:
  cuda::Stream stream() const { return cuda::Stream{stream_}; }

  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t middle_ = nullptr;
  cudaEvent_t stop_ = nullptr;
  cuda::DeviceBuffer q_, k_, v_, out_, dout_, dq_, dk_, dv_, lse_, delta_, x_, y_, dx_, w_;
};
#endif  // SB_KERNELS_WITH_CUDA

}  // namespace

absl::StatusOr<std::unique_ptr<LayerRunner>> LayerRunner::Create(
    const ModelShape& shape, const LayerRunnerOptions& options) {
  if (absl::Status s = ValidateHeads(shape.heads); !s.ok()) return s;
  if (absl::Status s = ValidateHeadDim(shape.head_dim); !s.ok()) return s;
  if (absl::Status s = ValidateBlockSize(shape.block_size); !s.ok()) return s;
  if (shape.local_blocks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("local_blocks=", shape.local_blocks, " must be non-negative"));
  }
  if (absl::Status s = ValidateThreads(options.threads); !s.ok()) return s;
  if (options.device == "cpu") {
    return std::unique_ptr<LayerRunner>(new CpuLayerRunner(shape, options.threads));
  }
  if (options.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("device=", options.device, " is not known; use cpu or cuda"));
  }
  std::string why;
  if (cuda::DeviceCount(&why) == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("device=cuda but no CUDA device is usable (", why,
                     "); run on a GPU machine or use --device=cpu"));
  }
#ifdef SB_KERNELS_WITH_CUDA
  auto runner = std::make_unique<CudaLayerRunner>(shape);
  if (absl::Status s = runner->Init(); !s.ok()) return s;
  return std::unique_ptr<LayerRunner>(std::move(runner));
#else
  return absl::FailedPreconditionError("device=cuda: this build has no CUDA kernels");
#endif
}

}  // namespace kernels
}  // namespace sparsebalance
