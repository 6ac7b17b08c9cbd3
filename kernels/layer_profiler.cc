#include "kernels/layer_profiler.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "kernels/attention_cpu.h"
#include "kernels/bf16.h"
#include "kernels/block_index.h"
#include "kernels/block_selection.h"
#include "kernels/cuda_attention.h"
#include "kernels/linear_cpu.h"
#include "kernels/parallel.h"

namespace sparsebalance {
namespace kernels {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// One GEMM of the layer's linear part: activations [tokens][in] times weights [in][out].
struct Linear {
  int64_t in = 0;
  int64_t out = 0;
};

// QKV projection, output projection, MLP up (4x) and down.
std::vector<Linear> LayerLinears(int64_t hidden) {
  return {{hidden, 3 * hidden}, {hidden, hidden}, {hidden, 4 * hidden}, {4 * hidden, hidden}};
}

// Deterministic values in [-1, 1) (splitmix64), so that runs are comparable.
void Fill(uint64_t seed, std::vector<float>* values) {
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  for (float& x : *values) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    x = static_cast<float>(static_cast<double>(z >> 40) / static_cast<double>(1ull << 23) - 1.0);
  }
}

std::string CpuName(int threads) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  std::string model = "unknown CPU";
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "model name")) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        model = std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
      }
      break;
    }
  }
  return absl::StrCat("cpu ", model, " (", threads, " threads, fp32 reference)");
}

struct Timing {
  double attention = 0.0;  // seconds
  double linear = 0.0;     // seconds
  int64_t active_blocks = 0;
};

// Inputs of one length, reused for every density.
struct CpuBuffers {
  std::vector<float> q, k, v, out, lse, dout, dq, dk, dv;
  std::vector<float> x, y, dx, w, wt;  // linear part
};

void PrepareCpu(const ProfileOptions& o, int64_t length, CpuBuffers* b) {
  const size_t n = static_cast<size_t>(length) * o.heads * o.head_dim;
  for (std::vector<float>* t : {&b->q, &b->k, &b->v, &b->dout}) t->resize(n);
  Fill(o.seed, &b->q);
  Fill(o.seed + 1, &b->k);
  Fill(o.seed + 2, &b->v);
  Fill(o.seed + 3, &b->dout);
  for (std::vector<float>* t : {&b->out, &b->dq, &b->dk, &b->dv}) t->assign(n, 0.0f);
  b->lse.assign(static_cast<size_t>(length) * o.heads, 0.0f);
  const int64_t hidden = int64_t{o.heads} * o.head_dim;
  const size_t widest = static_cast<size_t>(length) * 4 * hidden;
  b->x.resize(widest);
  Fill(o.seed + 4, &b->x);
  b->y.resize(widest);
  Fill(o.seed + 5, &b->y);
  b->dx.assign(widest, 0.0f);
  b->w.resize(static_cast<size_t>(4 * hidden * hidden));
  Fill(o.seed + 6, &b->w);
  b->wt.resize(b->w.size());
  Fill(o.seed + 7, &b->wt);
}

absl::StatusOr<Timing> MeasureCpu(const ProfileOptions& o, int64_t length, double density,
                                  CpuBuffers* b) {
  Timing timing;
  const std::vector<int32_t> cu_seqlens = {0, static_cast<int32_t>(length)};
  SelectionOptions select;
  select.block_size = o.block_size;
  select.local_blocks = o.local_blocks;
  select.threads = o.threads;
  AttentionOptions attention;
  attention.threads = o.threads;
  const Clock::time_point start = Clock::now();
  absl::StatusOr<Selection> selection =
      SelectBlocks(cu_seqlens, o.heads, o.head_dim, b->q, b->k, {density}, select);
  if (!selection.ok()) return selection.status();
  if (absl::Status s = AttentionForward(selection->index, o.head_dim, b->q, b->k, b->v, attention,
                                        absl::MakeSpan(b->out), absl::MakeSpan(b->lse));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = AttentionBackward(selection->index, o.head_dim, b->q, b->k, b->v, b->out,
                                         b->lse, b->dout, attention, absl::MakeSpan(b->dq),
                                         absl::MakeSpan(b->dk), absl::MakeSpan(b->dv));
      !s.ok()) {
    return s;
  }
  timing.attention = SecondsSince(start);
  timing.active_blocks = selection->index.active_blocks();
  const Clock::time_point linear_start = Clock::now();
  for (const Linear& l : LayerLinears(int64_t{o.heads} * o.head_dim)) {
    // Forward Y = X W, input gradient dX = dY W^T, weight gradient dW = X^T dY; the values do
    // not matter, only the shapes.
    MatmulCpu(length, l.out, l.in, b->x.data(), l.in, 1, b->w.data(), b->y.data(), o.threads);
    MatmulCpu(length, l.in, l.out, b->y.data(), l.out, 1, b->wt.data(), b->dx.data(), o.threads);
    MatmulCpu(l.in, l.out, length, b->x.data(), 1, l.in, b->y.data(), b->w.data(), o.threads);
  }
  timing.linear = SecondsSince(linear_start);
  return timing;
}

// Device buffers of one length, reused for every density.
struct CudaBuffers {
  cuda::DeviceBuffer q, k, v, out, dout, dq, dk, dv, lse, delta, x, y, dx, w;
};

absl::Status PrepareCuda(const ProfileOptions& o, int64_t length, CudaBuffers* b) {
  const size_t n = static_cast<size_t>(length) * o.heads * o.head_dim;
  const int64_t hidden = int64_t{o.heads} * o.head_dim;
  const size_t widest = static_cast<size_t>(length) * 4 * hidden;
  const size_t weights = static_cast<size_t>(4 * hidden * hidden);
  std::vector<float> values;
  std::vector<uint16_t> bf16;
  int seed = 0;
  for (auto [buffer, elements, bytes_per, fill] :
       {std::tuple<cuda::DeviceBuffer*, size_t, size_t, bool>{&b->q, n, 2, true},
        {&b->k, n, 2, true},
        {&b->v, n, 2, true},
        {&b->dout, n, 2, true},
        {&b->out, n, 2, false},
        {&b->dq, n, 2, false},
        {&b->dk, n, 2, false},
        {&b->dv, n, 2, false},
        {&b->lse, static_cast<size_t>(length) * o.heads, 4, false},
        {&b->delta, static_cast<size_t>(length) * o.heads, 4, false},
        {&b->x, widest, 2, true},
        {&b->y, widest, 2, true},
        {&b->dx, widest, 2, false},
        {&b->w, weights, 2, true}}) {
    absl::StatusOr<cuda::DeviceBuffer> buf = cuda::DeviceBuffer::Allocate(elements * bytes_per);
    if (!buf.ok()) return buf.status();
    *buffer = *std::move(buf);
    if (!fill) continue;
    values.resize(elements);
    Fill(o.seed + seed++, &values);
    bf16.resize(elements);
    for (size_t i = 0; i < elements; ++i) bf16[i] = FloatToBf16(values[i]);
    if (absl::Status s = buffer->CopyFromHost(bf16.data(), elements * 2); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<Timing> MeasureCuda(const ProfileOptions& o, int64_t length, double density,
                                   CudaBuffers* b) {
  Timing timing;
  const std::vector<int32_t> cu_seqlens = {0, static_cast<int32_t>(length)};
  SelectionOptions select;
  select.block_size = o.block_size;
  select.local_blocks = o.local_blocks;
  if (absl::Status s = cuda::Synchronize(); !s.ok()) return s;
  const Clock::time_point start = Clock::now();
  absl::StatusOr<Selection> selection = cuda::SelectBlocks(
      cu_seqlens, o.heads, o.head_dim, b->q.data(), b->k.data(), {density}, select);
  if (!selection.ok()) return selection.status();
  absl::StatusOr<cuda::DeviceBlockIndex> index = cuda::DeviceBlockIndex::Upload(selection->index);
  if (!index.ok()) return index.status();
  if (absl::Status s = cuda::Forward(*index, o.head_dim, b->q.data(), b->k.data(), b->v.data(),
                                     0.0f, b->out.data(), static_cast<float*>(b->lse.data()));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = cuda::Backward(*index, o.head_dim, b->q.data(), b->k.data(), b->v.data(),
                                      b->out.data(), static_cast<const float*>(b->lse.data()),
                                      b->dout.data(), 0.0f, static_cast<float*>(b->delta.data()),
                                      b->dq.data(), b->dk.data(), b->dv.data());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = cuda::Synchronize(); !s.ok()) return s;
  timing.attention = SecondsSince(start);
  timing.active_blocks = selection->index.active_blocks();
  const Clock::time_point linear_start = Clock::now();
  for (const Linear& l : LayerLinears(int64_t{o.heads} * o.head_dim)) {
    for (absl::Status s : {
             cuda::MatmulBf16(length, l.out, l.in, b->x.data(), false, b->w.data(), false,
                              b->y.data()),
             cuda::MatmulBf16(length, l.in, l.out, b->y.data(), false, b->w.data(), true,
                              b->dx.data()),
             cuda::MatmulBf16(l.in, l.out, length, b->x.data(), true, b->y.data(), false,
                              b->w.data()),
         }) {
      if (!s.ok()) return s;
    }
  }
  if (absl::Status s = cuda::Synchronize(); !s.ok()) return s;
  timing.linear = SecondsSince(linear_start);
  return timing;
}

}  // namespace

absl::Status ValidateProfileOptions(const ProfileOptions& o) {
  if (o.device != "cpu" && o.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("device=", o.device, " is not known; use cpu or cuda"));
  }
  if (absl::Status s = ValidateHeads(o.heads); !s.ok()) return s;
  if (absl::Status s = ValidateHeadDim(o.head_dim); !s.ok()) return s;
  if (absl::Status s = ValidateBlockSize(o.block_size); !s.ok()) return s;
  if (o.local_blocks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("local_blocks=", o.local_blocks, " must be non-negative"));
  }
  if (o.repeats < 1) {
    return absl::InvalidArgumentError(absl::StrCat("repeats=", o.repeats, " must be at least 1"));
  }
  if (o.lengths.empty() || o.densities.empty()) {
    return absl::InvalidArgumentError("lengths and densities each need at least one value");
  }
  for (size_t i = 0; i < o.lengths.size(); ++i) {
    if (o.lengths[i] < 1 || o.lengths[i] > (int64_t{1} << 30)) {
      return absl::InvalidArgumentError(
          absl::StrCat("lengths[", i, "]=", o.lengths[i], " must be in [1, 2^30] tokens"));
    }
  }
  for (size_t i = 0; i < o.densities.size(); ++i) {
    if (!(o.densities[i] > 0.0 && o.densities[i] <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("densities[", i, "]=", o.densities[i], " is outside (0, 1]"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Profile> RunProfile(const ProfileOptions& options,
                                   const std::function<void(const ProfilePoint&)>& progress) {
  if (absl::Status s = ValidateProfileOptions(options); !s.ok()) return s;
  Profile profile;
  profile.options = options;
  const bool on_cuda = options.device == "cuda";
  if (on_cuda) {
    std::string why;
    if (cuda::DeviceCount(&why) == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("--device=cuda but no CUDA device is usable (", why,
                       "); run on a GPU machine or use --device=cpu"));
    }
    absl::StatusOr<std::string> name = cuda::DeviceName();
    if (!name.ok()) return name.status();
    profile.device_name = *name;
  } else {
    profile.device_name = CpuName(ResolveThreads(options.threads));
  }
  for (int64_t length : options.lengths) {
    CpuBuffers cpu;
    CudaBuffers gpu;
    if (on_cuda) {
      if (absl::Status s = PrepareCuda(options, length, &gpu); !s.ok()) return s;
    } else {
      PrepareCpu(options, length, &cpu);
    }
    for (double density : options.densities) {
      // The GPU's first launch of each shape pays for module loading: one unmeasured run.
      const int runs = options.repeats + (on_cuda ? 1 : 0);
      std::vector<Timing> timings;
      for (int r = 0; r < runs; ++r) {
        absl::StatusOr<Timing> t = on_cuda ? MeasureCuda(options, length, density, &gpu)
                                           : MeasureCpu(options, length, density, &cpu);
        if (!t.ok()) return t.status();
        if (on_cuda && r == 0) continue;
        timings.push_back(*t);
      }
      std::sort(timings.begin(), timings.end(), [](const Timing& a, const Timing& b) {
        return a.attention + a.linear < b.attention + b.linear;
      });
      const Timing& median = timings[(timings.size() - 1) / 2];
      ProfilePoint point;
      point.length = length;
      point.density = density;
      point.attention_seconds = median.attention;
      point.linear_seconds = median.linear;
      point.seconds = median.attention + median.linear;
      point.active_blocks = median.active_blocks;
      profile.points.push_back(point);
      if (progress) progress(point);
    }
  }
  return profile;
}

std::string FormatProfile(const Profile& profile) {
  const ProfileOptions& o = profile.options;
  std::string device = profile.device_name.empty() ? "unknown" : profile.device_name;
  std::replace(device.begin(), device.end(), '\n', ' ');
  std::string out = "sparsebalance-profile 1\n";
  absl::StrAppend(&out, "device ", device, "\n");
  absl::StrAppend(&out, "shape heads=", o.heads, " head_dim=", o.head_dim,
                  " block_size=", o.block_size, " local_blocks=", o.local_blocks, "\n");
  absl::StrAppend(&out, "# written by sb-profile: median of ", o.repeats,
                  " run(s); selection + attention fwd/bwd + QKV/O/MLP GEMMs fwd/bwd\n");
  out += "# length(tokens) density seconds(one layer, forward+backward)\n";
  for (const ProfilePoint& p : profile.points) {
    absl::StrAppend(&out, absl::StrFormat("%d %.6g %.9g\n", p.length, p.density, p.seconds));
  }
  out += "# length density attention_seconds linear_seconds active_blocks(all heads)\n";
  for (const ProfilePoint& p : profile.points) {
    absl::StrAppend(&out, absl::StrFormat("#   %d %.6g %.6g %.6g %d\n", p.length, p.density,
                                          p.attention_seconds, p.linear_seconds, p.active_blocks));
  }
  return out;
}

}  // namespace kernels
}  // namespace sparsebalance
