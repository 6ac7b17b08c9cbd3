#include "worker/micro_batch_runner.h"

#include <time.h>

#include <algorithm>
#include <fstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/types/span.h"
#include "kernels/attention_cpu.h"
#include "kernels/block_selection.h"
#include "kernels/linear_cpu.h"
#include "worker/synthetic_inputs.h"

#ifdef SB_KERNELS_WITH_CUDA
#include <cuda_runtime.h>

#include "kernels/bf16.h"
#include "kernels/cuda_attention.h"
#endif

namespace sparsebalance {
namespace {

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The linear part of a layer, as sb-profile measures it: QKV projection, output projection,
// MLP up (4x) and down; activations [tokens][in] times weights [in][out].
struct Linear {
  int64_t in = 0;
  int64_t out = 0;
};
std::vector<Linear> LayerLinears(int64_t hidden) {
  return {{hidden, 3 * hidden}, {hidden, hidden}, {hidden, 4 * hidden}, {4 * hidden, hidden}};
}

absl::Status CheckInputs(const std::vector<uint64_t>& ids, const std::vector<int64_t>& lengths,
                         const std::vector<double>& densities) {
  if (ids.size() != lengths.size() || ids.size() != densities.size()) {
    return absl::InvalidArgumentError(absl::StrCat("micro-batch: ", ids.size(), " ids, ",
                                                   lengths.size(), " lengths, ", densities.size(),
                                                   " densities; they must match"));
  }
  if (ids.empty()) return absl::InvalidArgumentError("micro-batch: no documents");
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] <= 0 || lengths[i] > (int64_t{1} << 30)) {
      return absl::InvalidArgumentError(
          absl::StrCat("lengths[", i, "]: ", lengths[i], " is not a positive token count"));
    }
  }
  return absl::OkStatus();
}

// Token-weighted recall and density over the index's rows.
void Summarize(const kernels::BlockIndex& index, const std::vector<float>& row_recall,
               MicroBatchResult* out) {
  double recall_sum = 0.0;
  double density_sum = 0.0;
  double weight_sum = 0.0;
  for (int s = 0; s < index.sequences(); ++s) {
    const int32_t length = index.length(s);
    for (int h = 0; h < index.heads; ++h) {
      for (int32_t i = 0; i < index.blocks(s); ++i) {
        const int64_t row = index.RowId(s, h, i);
        const double tokens =
            std::min<int64_t>(index.block_size, length - int64_t{i} * index.block_size);
        const int64_t kept = index.row_ptr[row + 1] - index.row_ptr[row];
        recall_sum += tokens * row_recall[row];
        density_sum += tokens * static_cast<double>(kept) / (i + 1);
        weight_sum += tokens;
        out->causal_blocks += i + 1;
      }
    }
  }
  out->active_blocks = index.active_blocks();
  out->recall = weight_sum > 0 ? std::clamp(recall_sum / weight_sum, 0.0, 1.0) : 1.0;
  out->achieved_density = weight_sum > 0 ? density_sum / weight_sum : 1.0;
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

class CpuRunner : public MicroBatchRunner {
 public:
  CpuRunner(const ModelShape& shape, bool exact_recall)
      : shape_(shape), exact_recall_(exact_recall) {}

  std::string device_name() const override {
    return absl::StrCat("cpu ", CpuModel(), " (1 thread per rank, fp32 reference)");
  }

  absl::StatusOr<MicroBatchResult> Run(const std::vector<uint64_t>& ids,
                                       const std::vector<int64_t>& lengths,
                                       const std::vector<double>& densities) override {
    if (absl::Status s = CheckInputs(ids, lengths, densities); !s.ok()) return s;
    // Inputs are the data loader's work, not the step's: made before the clock starts.
    VarlenBatch batch;
    for (size_t i = 0; i < ids.size(); ++i) {
      batch.Append(MakeDocument(ids[i], lengths[i], shape_.heads, shape_.head_dim), lengths[i]);
    }
    const int64_t tokens = batch.cu_seqlens.back();
    const size_t n = batch.q.size();
    out_.assign(n, 0.0f);
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

    kernels::SelectionOptions select;
    select.block_size = shape_.block_size;
    select.local_blocks = shape_.local_blocks;
    select.threads = 1;
    kernels::AttentionOptions attention;
    attention.threads = 1;

    MicroBatchResult result;
    result.tokens = tokens;
    double off_clock = 0.0;
    const double start = ThreadCpuSeconds();
    for (int layer = 0; layer < shape_.layers; ++layer) {
      const double attention_start = ThreadCpuSeconds();
      absl::StatusOr<kernels::Selection> selection = kernels::SelectBlocks(
          batch.cu_seqlens, shape_.heads, shape_.head_dim, batch.q, batch.k, densities, select);
      if (!selection.ok()) return selection.status();
      if (absl::Status s = kernels::AttentionForward(selection->index, shape_.head_dim, batch.q,
                                                     batch.k, batch.v, attention,
                                                     absl::MakeSpan(out_), absl::MakeSpan(lse_));
          !s.ok()) {
        return s;
      }
      if (absl::Status s = kernels::AttentionBackward(
              selection->index, shape_.head_dim, batch.q, batch.k, batch.v, out_, lse_, dout_,
              attention, absl::MakeSpan(dq_), absl::MakeSpan(dk_), absl::MakeSpan(dv_));
          !s.ok()) {
        return s;
      }
      result.attention_seconds += ThreadCpuSeconds() - attention_start;
      for (const Linear& l : LayerLinears(hidden)) {
        kernels::MatmulCpu(tokens, l.out, l.in, x_.data(), l.in, 1, w_.data(), y_.data(), 1);
        kernels::MatmulCpu(tokens, l.in, l.out, y_.data(), l.out, 1, wt_.data(), dx_.data(), 1);
        kernels::MatmulCpu(l.in, l.out, tokens, x_.data(), 1, l.in, y_.data(), w_.data(), 1);
      }
      if (layer == 0) {
        // Every layer sees the same inputs here, so one layer's recall is the micro-batch's.
        std::vector<float> recall = selection->estimated_recall;
        if (exact_recall_) {
          // A measurement aid, not the step's work: its time is taken off the clock.
          const double exact_start = ThreadCpuSeconds();
          absl::StatusOr<std::vector<float>> exact =
              kernels::ExactRecall(selection->index, shape_.head_dim, batch.q, batch.k, 0.0f, 1);
          if (!exact.ok()) return exact.status();
          recall = *std::move(exact);
          off_clock += ThreadCpuSeconds() - exact_start;
        }
        Summarize(selection->index, recall, &result);
      }
    }
    result.compute_seconds = ThreadCpuSeconds() - start - off_clock;
    return result;
  }

 private:
  ModelShape shape_;
  bool exact_recall_;
  std::vector<float> out_, dout_, dq_, dk_, dv_, lse_, x_, y_, dx_, w_, wt_;
};

#ifdef SB_KERNELS_WITH_CUDA
absl::Status CudaCheck(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

class CudaRunner : public MicroBatchRunner {
 public:
  explicit CudaRunner(const ModelShape& shape) : shape_(shape) {}
  ~CudaRunner() override {
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (middle_ != nullptr) cudaEventDestroy(middle_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
  }
  absl::Status Init() {
    if (absl::Status s = CudaCheck(cudaEventCreate(&start_), "cudaEventCreate"); !s.ok()) return s;
    if (absl::Status s = CudaCheck(cudaEventCreate(&middle_), "cudaEventCreate"); !s.ok()) {
      return s;
    }
    return CudaCheck(cudaEventCreate(&stop_), "cudaEventCreate");
  }
  std::string device_name() const override {
    absl::StatusOr<std::string> name = kernels::cuda::DeviceName();
    return name.ok() ? *name : "cuda";
  }

  absl::StatusOr<MicroBatchResult> Run(const std::vector<uint64_t>& ids,
                                       const std::vector<int64_t>& lengths,
                                       const std::vector<double>& densities) override {
    if (absl::Status s = CheckInputs(ids, lengths, densities); !s.ok()) return s;
    VarlenBatch batch;
    for (size_t i = 0; i < ids.size(); ++i) {
      batch.Append(MakeDocument(ids[i], lengths[i], shape_.heads, shape_.head_dim), lengths[i]);
    }
    const int64_t tokens = batch.cu_seqlens.back();
    const size_t n = batch.q.size();
    const int64_t hidden = int64_t{shape_.heads} * shape_.head_dim;
    using kernels::cuda::DeviceBuffer;
    auto upload = [&](const std::vector<float>& host) -> absl::StatusOr<DeviceBuffer> {
      std::vector<uint16_t> bf16(host.size());
      for (size_t i = 0; i < host.size(); ++i) bf16[i] = kernels::FloatToBf16(host[i]);
      absl::StatusOr<DeviceBuffer> buffer = DeviceBuffer::Allocate(bf16.size() * 2);
      if (!buffer.ok()) return buffer.status();
      if (absl::Status s = buffer->CopyFromHost(bf16.data(), bf16.size() * 2); !s.ok()) return s;
      return buffer;
    };
    auto zeros = [&](size_t bytes) -> absl::StatusOr<DeviceBuffer> {
      absl::StatusOr<DeviceBuffer> buffer = DeviceBuffer::Allocate(bytes);
      if (buffer.ok()) {
        if (absl::Status s = buffer->Zero(); !s.ok()) return s;
      }
      return buffer;
    };
    absl::StatusOr<DeviceBuffer> q = upload(batch.q), k = upload(batch.k), v = upload(batch.v);
    absl::StatusOr<DeviceBuffer> out = zeros(n * 2), dout = zeros(n * 2), dq = zeros(n * 2),
                                 dk = zeros(n * 2), dv = zeros(n * 2);
    const size_t rows = static_cast<size_t>(tokens) * shape_.heads;
    absl::StatusOr<DeviceBuffer> lse = zeros(rows * 4), delta = zeros(rows * 4);
    const size_t widest = static_cast<size_t>(tokens) * 4 * hidden * 2;
    absl::StatusOr<DeviceBuffer> x = zeros(widest), y = zeros(widest), dx = zeros(widest),
                                 w = zeros(static_cast<size_t>(4 * hidden * hidden) * 2);
    for (const absl::StatusOr<DeviceBuffer>* b :
         {&q, &k, &v, &out, &dout, &dq, &dk, &dv, &lse, &delta, &x, &y, &dx, &w}) {
      if (!b->ok()) return b->status();
    }
    kernels::SelectionOptions select;
    select.block_size = shape_.block_size;
    select.local_blocks = shape_.local_blocks;
    MicroBatchResult result;
    result.tokens = tokens;
    float attention_ms_total = 0.0f;
    float linear_ms_total = 0.0f;
    for (int layer = 0; layer < shape_.layers; ++layer) {
      if (absl::Status s = CudaCheck(cudaEventRecord(start_), "cudaEventRecord"); !s.ok()) {
        return s;
      }
      absl::StatusOr<kernels::Selection> selection = kernels::cuda::SelectBlocks(
          batch.cu_seqlens, shape_.heads, shape_.head_dim, q->data(), k->data(), densities, select);
      if (!selection.ok()) return selection.status();
      absl::StatusOr<kernels::cuda::DeviceBlockIndex> index =
          kernels::cuda::DeviceBlockIndex::Upload(selection->index);
      if (!index.ok()) return index.status();
      if (absl::Status s =
              kernels::cuda::Forward(*index, shape_.head_dim, q->data(), k->data(), v->data(), 0.0f,
                                     out->data(), static_cast<float*>(lse->data()));
          !s.ok()) {
        return s;
      }
      if (absl::Status s = kernels::cuda::Backward(
              *index, shape_.head_dim, q->data(), k->data(), v->data(), out->data(),
              static_cast<const float*>(lse->data()), dout->data(), 0.0f,
              static_cast<float*>(delta->data()), dq->data(), dk->data(), dv->data());
          !s.ok()) {
        return s;
      }
      cudaEventRecord(middle_);
      for (const Linear& l : LayerLinears(hidden)) {
        for (absl::Status s : {kernels::cuda::MatmulBf16(tokens, l.out, l.in, x->data(), false,
                                                         w->data(), false, y->data()),
                               kernels::cuda::MatmulBf16(tokens, l.in, l.out, y->data(), false,
                                                         w->data(), true, dx->data()),
                               kernels::cuda::MatmulBf16(l.in, l.out, tokens, x->data(), true,
                                                         y->data(), false, w->data())}) {
          if (!s.ok()) return s;
        }
      }
      cudaEventRecord(stop_);
      if (absl::Status s = CudaCheck(cudaEventSynchronize(stop_), "cudaEventSynchronize");
          !s.ok()) {
        return s;
      }
      float attention_ms = 0.0f;
      float linear_ms = 0.0f;
      cudaEventElapsedTime(&attention_ms, start_, middle_);
      cudaEventElapsedTime(&linear_ms, middle_, stop_);
      attention_ms_total += attention_ms;
      linear_ms_total += linear_ms;
      if (layer == 0) Summarize(selection->index, selection->estimated_recall, &result);
    }
    result.attention_seconds = attention_ms_total * 1e-3;
    result.compute_seconds = (attention_ms_total + linear_ms_total) * 1e-3;
    return result;
  }

 private:
  ModelShape shape_;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t middle_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};
#endif  // SB_KERNELS_WITH_CUDA

}  // namespace

absl::StatusOr<std::unique_ptr<MicroBatchRunner>> MicroBatchRunner::Create(
    const std::string& device, const ModelShape& shape, bool exact_recall) {
  if (device == "cpu") return std::unique_ptr<MicroBatchRunner>(new CpuRunner(shape, exact_recall));
  if (device == "cuda") {
#ifdef SB_KERNELS_WITH_CUDA
    std::string why;
    if (kernels::cuda::DeviceCount(&why) == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("--device=cuda: no CUDA device (", why, "); use --device=cpu"));
    }
    if (exact_recall) {
      return absl::InvalidArgumentError("--exact_recall: only with --device=cpu");
    }
    auto runner = std::make_unique<CudaRunner>(shape);
    if (absl::Status s = runner->Init(); !s.ok()) return s;
    return std::unique_ptr<MicroBatchRunner>(std::move(runner));
#else
    return absl::FailedPreconditionError(
        "--device=cuda: this build has no CUDA kernels (configure with nvcc and SB_WITH_CUDA=ON)");
#endif
  }
  return absl::InvalidArgumentError(absl::StrCat("--device=", device, ": expected cpu or cuda"));
}

}  // namespace sparsebalance
