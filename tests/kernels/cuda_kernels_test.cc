// The CUDA kernels against the CPU reference, on two executors of the same kernel source
// (kernels/cuda_attention_impl.inc): the GPU (kernels::cuda, skipped without a device) and the
// host emulator (kernels::cuda_emulated, one fiber per CUDA thread), which runs everywhere, so
// every test command exercises the kernels' indexing, masking, barriers and launch code.
//
// Tolerances, from the error of what is compared. Both sides read the same bf16 inputs (as
// fp32); the kernels accumulate in fp32 in another order than the reference (relative error
// about sqrt(n) * 2^-24 of the summed magnitudes, below 1e-5 here) and round each output to
// bf16 (at most 2^-9 of its value, 2^-9 / sqrt(3) = 1.1e-3 as an RMS over many values). So
// for the scalar kernels every element must be within 2^-8 of its reference value plus 1e-4 of
// the tensor's largest, and the relative L2 error at most 2e-3; the LSE (fp32) within 1e-4. The
// tensor-core kernels also round MMA operands to bf16 (P in the forward, P^T and dS^T in the
// backward), which widens their bounds (CompareAttention says by how much and why). The
// backward is compared with the reference run on the kernels' own (bf16) forward output and LSE,
// so that its error is its own, not the forward's rounding passed on through rowsum(dO * O).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "contract/block_geometry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/attention_cpu.h"
#include "kernels/bf16.h"
#include "kernels/block_index.h"
#include "kernels/block_selection.h"
#include "kernels/cuda_attention.h"
#include "kernels/cuda_emulated.h"
#include "kernels/cuda_emulator.h"
#include "kernels/recall_probe.h"
#include "reference.h"

namespace sparsebalance {
namespace kernels {
namespace {

// One executor's API (the namespaces share their declarations, kernels/cuda_api.inc).
#define SB_KERNEL_API(Name, ns)                                                            \
  struct Name {                                                                            \
    using Buffer = ns::DeviceBuffer;                                                       \
    using Index = ns::DeviceBlockIndex;                                                    \
    using Stream = ns::Stream;                                                             \
    using Selection = ns::DeviceSelection;                                                 \
    using Path = ns::KernelPath;                                                           \
    static constexpr bool kEmulated = std::is_same_v<Buffer, cuda_emulated::DeviceBuffer>; \
    static int DeviceCount(std::string* why) { return ns::DeviceCount(why); }              \
    template <typename... A>                                                               \
    static auto SelectBlocks(A&&... a) {                                                   \
      return ns::SelectBlocks(std::forward<A>(a)...);                                      \
    }                                                                                      \
    template <typename... A>                                                               \
    static auto Forward(A&&... a) {                                                        \
      return ns::Forward(std::forward<A>(a)...);                                           \
    }                                                                                      \
    template <typename... A>                                                               \
    static auto Backward(A&&... a) {                                                       \
      return ns::Backward(std::forward<A>(a)...);                                          \
    }                                                                                      \
    template <typename... A>                                                               \
    static auto ProbeRecall(A&&... a) {                                                    \
      return ns::ProbeRecall(std::forward<A>(a)...);                                       \
    }                                                                                      \
    template <typename... A>                                                               \
    static auto MatmulBf16(A&&... a) {                                                     \
      return ns::MatmulBf16(std::forward<A>(a)...);                                        \
    }                                                                                      \
    static absl::Status Synchronize() { return ns::Synchronize(ns::Stream{}); }            \
  };
SB_KERNEL_API(Device, cuda)
SB_KERNEL_API(Emulated, cuda_emulated)
#undef SB_KERNEL_API

// fp32 values rounded to bf16 (what the kernels see), and their bf16 bits.
struct Bf16Tensor {
  std::vector<float> values;
  std::vector<uint16_t> bits;
};

Bf16Tensor ToBf16(std::vector<float> values) {
  Bf16Tensor t;
  t.bits.resize(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    t.bits[i] = FloatToBf16(values[i]);
    values[i] = Bf16ToFloat(t.bits[i]);
  }
  t.values = std::move(values);
  return t;
}

// How far a kernel's tensor may be from the reference: each element within 2^-8 of its
// reference value plus `absolute`, and the relative L2 error at most `relative_l2`.
struct Tolerance {
  double absolute;
  double relative_l2;
};

double Largest(const std::vector<float>& values) {
  double largest = 0.0;
  for (float v : values) largest = std::max(largest, std::fabs(static_cast<double>(v)));
  return largest;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 const std::string& what, const Tolerance& tolerance) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  size_t first_bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double limit =
        std::ldexp(std::fabs(static_cast<double>(want[i])), -8) + tolerance.absolute;
    if (!(std::fabs(static_cast<double>(got[i]) - want[i]) <= limit)) {
      if (bad++ == 0) first_bad = i;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size()
                    << " elements out of tolerance, the first at " << first_bad << " ("
                    << (bad > 0 ? got[first_bad] : 0.0f) << " vs "
                    << (bad > 0 ? want[first_bad] : 0.0f) << ")";
  EXPECT_LE(testing::RelativeL2(got, want), tolerance.relative_l2) << what;
}

// cu_blocks of a batch: prefix sums of each sequence's query blocks.
std::vector<int32_t> QueryBlockOffsets(const std::vector<int32_t>& cu, int block_size) {
  std::vector<int32_t> out(1, 0);
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    out.push_back(out.back() + static_cast<int32_t>(QueryBlocks(cu[s + 1] - cu[s], block_size)));
  }
  return out;
}

template <typename Api>
class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (Api::DeviceCount(&why) == 0) GTEST_SKIP() << "no CUDA device (" << why << ")";
  }

  typename Api::Buffer Upload(const void* data, size_t bytes) {
    absl::StatusOr<typename Api::Buffer> buffer = Api::Buffer::Allocate(bytes);
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    EXPECT_TRUE(buffer->CopyFromHost(data, bytes).ok());
    return *std::move(buffer);
  }
  typename Api::Buffer Scratch(size_t bytes) {
    absl::StatusOr<typename Api::Buffer> buffer = Api::Buffer::Allocate(bytes);
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    return *std::move(buffer);
  }
  std::vector<float> DownloadBf16(const typename Api::Buffer& buffer, size_t n) {
    std::vector<uint16_t> bits(n);
    EXPECT_TRUE(buffer.CopyToHost(bits.data(), n * 2).ok());
    std::vector<float> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(bits[i]);
    return out;
  }
  std::vector<float> DownloadFloat(const typename Api::Buffer& buffer, size_t n) {
    std::vector<float> out(n);
    EXPECT_TRUE(buffer.CopyToHost(out.data(), n * 4).ok());
    return out;
  }

  // Forward and backward over `index` on the executor (both kernel paths) and on the CPU
  // reference.
  void CompareAttention(const BlockIndex& index, int head_dim, const Bf16Tensor& q,
                        const Bf16Tensor& k, const Bf16Tensor& v, const Bf16Tensor& dout) {
    using Path = typename Api::Path;
    for (Path path : {Path::kScalar, Path::kTensorCore}) {
      SCOPED_TRACE(path == Path::kScalar ? "scalar kernels" : "tensor-core kernels");
      CompareAttention(index, head_dim, q, k, v, dout, path);
    }
  }

  void CompareAttention(const BlockIndex& index, int head_dim, const Bf16Tensor& q,
                        const Bf16Tensor& k, const Bf16Tensor& v, const Bf16Tensor& dout,
                        typename Api::Path path) {
    const size_t n = q.values.size();
    const size_t n_lse = static_cast<size_t>(index.total_tokens()) * index.heads;
    typename Api::Buffer dq_in = Upload(q.bits.data(), n * 2), dk_in = Upload(k.bits.data(), n * 2),
                         dv_in = Upload(v.bits.data(), n * 2),
                         ddout = Upload(dout.bits.data(), n * 2);
    typename Api::Buffer out = Scratch(n * 2), lse = Scratch(n_lse * 4), delta = Scratch(n_lse * 4),
                         gq = Scratch(n * 2), gk = Scratch(n * 2), gv = Scratch(n * 2);
    const typename Api::Stream stream{};
    absl::StatusOr<typename Api::Index> dindex = Api::Index::Upload(index, stream);
    ASSERT_TRUE(dindex.ok()) << dindex.status();
    ASSERT_TRUE(Api::Forward(*dindex, head_dim, dq_in.data(), dk_in.data(), dv_in.data(), 0.0f,
                             out.data(), static_cast<float*>(lse.data()), stream, path)
                    .ok());
    ASSERT_TRUE(Api::Backward(*dindex, head_dim, dq_in.data(), dk_in.data(), dv_in.data(),
                              out.data(), static_cast<const float*>(lse.data()), ddout.data(), 0.0f,
                              static_cast<float*>(delta.data()), gq.data(), gk.data(), gv.data(),
                              stream, path)
                    .ok());
    ASSERT_TRUE(Api::Synchronize().ok());
    const std::vector<float> g_out = DownloadBf16(out, n), g_lse = DownloadFloat(lse, n_lse);

    std::vector<float> c_out(n), c_lse(n_lse), c_dq(n), c_dk(n), c_dv(n);
    ASSERT_TRUE(AttentionForward(index, head_dim, q.values, k.values, v.values, {},
                                 absl::MakeSpan(c_out), absl::MakeSpan(c_lse))
                    .ok());
    // The scalar kernels round only their outputs. The tensor-core forward also rounds P to
    // bf16 before P V: each output moves by at most 2^-9 sum_j p_j |v_j| / l <= 2^-9 max |v|.
    const bool tensor_cores = path == Api::Path::kTensorCore;
    const Tolerance scalar{1e-4 * Largest(c_out), 2e-3};
    const Tolerance forward =
        tensor_cores ? Tolerance{std::ldexp(Largest(v.values), -9) + scalar.absolute, 3e-3}
                     : scalar;
    ExpectClose(g_out, c_out, "out", forward);
    for (size_t i = 0; i < n_lse; ++i) {
      if (std::isinf(c_lse[i])) {
        EXPECT_EQ(g_lse[i], c_lse[i]) << "lse " << i << " (a row without kept keys)";
      } else {
        EXPECT_NEAR(g_lse[i], c_lse[i], 1e-4 * std::max(1.0f, std::fabs(c_lse[i]))) << "lse " << i;
      }
    }
    // The reference backward on the kernels' own forward output.
    ASSERT_TRUE(AttentionBackward(index, head_dim, q.values, k.values, v.values, g_out, g_lse,
                                  dout.values, {}, absl::MakeSpan(c_dq), absl::MakeSpan(c_dk),
                                  absl::MakeSpan(c_dv))
                    .ok());
    // The tensor-core backward also rounds P^T (for dV) and dS^T (for dK and dQ) to bf16: each
    // gradient moves by up to 2^-9 of the magnitudes it sums, which cancel to a few times the
    // largest gradient here: 2^-7 of it per element, 4e-3 in relative L2.
    for (auto [got, want, name] :
         {std::tuple<const typename Api::Buffer*, const std::vector<float>*, const char*>{
              &gq, &c_dq, "dq"},
          {&gk, &c_dk, "dk"},
          {&gv, &c_dv, "dv"}}) {
      const Tolerance backward = tensor_cores ? Tolerance{std::ldexp(Largest(*want), -7), 4e-3}
                                              : Tolerance{1e-4 * Largest(*want), 2e-3};
      ExpectClose(DownloadBf16(*got, n), *want, name, backward);
    }
  }

  // Selection on the executor (its index) against the CPU's selection from the same values:
  // the same blocks, since the pooled scores are computed with the same roundings.
  BlockIndex SelectAndCompare(const std::vector<int32_t>& cu, int heads, int head_dim,
                              const Bf16Tensor& q, const Bf16Tensor& k,
                              const std::vector<double>& densities,
                              const SelectionOptions& options) {
    const size_t n = q.values.size();
    typename Api::Buffer dq_in = Upload(q.bits.data(), n * 2), dk_in = Upload(k.bits.data(), n * 2);
    absl::StatusOr<typename Api::Selection> on_device =
        Api::SelectBlocks(cu, heads, head_dim, dq_in.data(), dk_in.data(), densities, options,
                          typename Api::Stream{});
    EXPECT_TRUE(on_device.ok()) << on_device.status();
    if (!on_device.ok()) return {};
    EXPECT_EQ(on_device->index.shape().cu_blocks, QueryBlockOffsets(cu, options.block_size));
    EXPECT_TRUE(on_device->index.shape().row_ptr.empty());  // the CSR stays on the device
    absl::StatusOr<Selection> got = on_device->Download();
    EXPECT_TRUE(got.ok()) << got.status();
    absl::StatusOr<Selection> want =
        SelectBlocks(cu, heads, head_dim, q.values, k.values, densities, options);
    EXPECT_TRUE(want.ok()) << want.status();
    if (!got.ok() || !want.ok()) return {};
    EXPECT_TRUE(ValidateBlockIndex(got->index).ok());
    EXPECT_EQ(got->index.row_ptr, want->index.row_ptr);
    EXPECT_EQ(got->index.col_idx, want->index.col_idx);
    EXPECT_EQ(got->index.flags, want->index.flags);
    EXPECT_EQ(got->estimated_recall, want->estimated_recall);
    return got->index;
  }

  void SelectAndRun(const std::vector<int32_t>& lengths, int heads, int head_dim, int block_size,
                    double density, float input_scale = 1.0f) {
    SCOPED_TRACE(::testing::Message() << "head_dim " << head_dim << ", block " << block_size
                                      << ", density " << density << ", scale " << input_scale);
    const std::vector<int32_t> cu = testing::CuSeqlens(lengths);
    const size_t n = static_cast<size_t>(cu.back()) * heads * head_dim;
    const Bf16Tensor q = ToBf16(testing::RandomTensor(n, 1, input_scale)),
                     k = ToBf16(testing::RandomTensor(n, 2, input_scale)),
                     v = ToBf16(testing::RandomTensor(n, 3)),
                     dout = ToBf16(testing::RandomTensor(n, 4));
    SelectionOptions options;
    options.block_size = block_size;
    const BlockIndex index = SelectAndCompare(
        cu, heads, head_dim, q, k, std::vector<double>(lengths.size(), density), options);
    if (::testing::Test::HasFailure()) return;
    CompareAttention(index, head_dim, q, k, v, dout);
  }
};

using Executors = ::testing::Types<Device, Emulated>;
class ExecutorNames {
 public:
  template <typename T>
  static std::string GetName(int) {
    return T::kEmulated ? "Emulated" : "Device";
  }
};
TYPED_TEST_SUITE(CudaKernelsTest, Executors, ExecutorNames);

TYPED_TEST(CudaKernelsTest, DenseVarlenMatchesTheCpuReference) {
  for (int head_dim : {64, 128}) {
    for (int block_size : {64, 128}) {
      this->SelectAndRun({1, 200, 64, 333, 129}, 2, head_dim, block_size, 1.0);
    }
  }
}

TYPED_TEST(CudaKernelsTest, SparseVarlenMatchesTheCpuReference) {
  this->SelectAndRun({700, 65, 1, 390}, 2, 128, 64, 0.3);
  this->SelectAndRun({600, 300}, 2, 64, 128, 0.1);
}

// The selection's other rules on the same scores: anchor-guided thresholding, a mass threshold,
// no local blocks and several of them, one density per document.
TYPED_TEST(CudaKernelsTest, SelectionModesKeepTheCpusBlocks) {
  const std::vector<int32_t> cu = testing::CuSeqlens({900, 1, 333, 520});
  const int heads = 2;
  const int head_dim = 64;
  const size_t n = static_cast<size_t>(cu.back()) * heads * head_dim;
  const Bf16Tensor q = ToBf16(testing::RandomTensor(n, 41, 2.0f)),
                   k = ToBf16(testing::RandomTensor(n, 42, 2.0f));
  const std::vector<double> densities = {0.2, 1.0, 0.5, 0.05};
  for (int variant = 0; variant < 4; ++variant) {
    SCOPED_TRACE(::testing::Message() << "variant " << variant);
    SelectionOptions options;
    options.block_size = variant == 3 ? 128 : 64;
    options.local_blocks = variant == 1 ? 0 : (variant == 2 ? 3 : 1);
    if (variant == 0 || variant == 3) {
      options.mode = SelectionMode::kAnchor;
      options.anchor_threshold = variant == 0 ? 0.05 : 0.5;
    }
    if (variant >= 2) options.mass_threshold = 0.9;
    this->SelectAndCompare(cu, heads, head_dim, q, k, densities, options);
  }
}

TYPED_TEST(CudaKernelsTest, OneTokenDocuments) {
  this->SelectAndRun({1, 1, 65, 1, 2}, 3, 64, 64, 1.0);
}

// Large logits (inputs x 3: logits with a standard deviation near 9) and needles, keys equal to
// an earlier query x 4: rows whose softmax sits on one or two keys, where the online max and
// the rescaling decide every digit.
TYPED_TEST(CudaKernelsTest, SharpSoftmaxWithNeedles) {
  const std::vector<int32_t> lengths = {300, 129};
  const int heads = 2;
  for (int head_dim : {64, 128}) {
    SCOPED_TRACE(::testing::Message() << "head_dim " << head_dim);
    const std::vector<int32_t> cu = testing::CuSeqlens(lengths);
    const size_t n = static_cast<size_t>(cu.back()) * heads * head_dim;
    std::vector<float> q = testing::RandomTensor(n, 11, 3.0f),
                       k = testing::RandomTensor(n, 12, 3.0f);
    const int64_t stride = int64_t{heads} * head_dim;
    for (int32_t needle : {5, 70, 250, 310, 400}) {  // key token (batch), query 3..40 later
      const int32_t query = std::min(needle + 3 + needle % 37, cu.back() - 1);
      for (int h = 0; h < heads; ++h) {
        for (int d = 0; d < head_dim; ++d) {
          k[needle * stride + h * head_dim + d] = 4.0f * q[query * stride + h * head_dim + d];
        }
      }
    }
    const BlockIndex index = this->SelectAndCompare(cu, heads, head_dim, ToBf16(q), ToBf16(k),
                                                    {0.5, 1.0}, SelectionOptions{});
    if (::testing::Test::HasFailure()) return;
    this->CompareAttention(index, head_dim, ToBf16(q), ToBf16(k),
                           ToBf16(testing::RandomTensor(n, 13)),
                           ToBf16(testing::RandomTensor(n, 14)));
  }
}

// A hand-made index: rows without their diagonal, rows keeping one far block, and empty rows
// (out 0, LSE -inf, no gradient), which selection never makes but the format allows.
TYPED_TEST(CudaKernelsTest, EmptyRowsAndRowsWithoutTheDiagonal) {
  const std::vector<int32_t> cu = testing::CuSeqlens({300, 100});
  const int heads = 2;
  const int head_dim = 64;
  const int block_size = 64;
  std::vector<std::vector<int32_t>> rows;
  for (int s = 0; s < 2; ++s) {
    const int32_t blocks = static_cast<int32_t>(QueryBlocks(cu[s + 1] - cu[s], block_size));
    for (int h = 0; h < heads; ++h) {
      for (int32_t i = 0; i < blocks; ++i) {
        switch ((i + h + s) % 4) {
          case 0:
            rows.push_back({});
            break;
          case 1:
            rows.push_back({0});
            break;
          case 2:
            rows.push_back(i > 1 ? std::vector<int32_t>{0, i - 1} : std::vector<int32_t>{0});
            break;
          default:
            rows.push_back({i});
            break;
        }
      }
    }
  }
  absl::StatusOr<BlockIndex> index = MakeBlockIndex(cu, heads, block_size, rows);
  ASSERT_TRUE(index.ok()) << index.status();
  const size_t n = static_cast<size_t>(cu.back()) * heads * head_dim;
  this->CompareAttention(*index, head_dim, ToBf16(testing::RandomTensor(n, 21)),
                         ToBf16(testing::RandomTensor(n, 22)), ToBf16(testing::RandomTensor(n, 23)),
                         ToBf16(testing::RandomTensor(n, 24)));
}

TYPED_TEST(CudaKernelsTest, RecallProbeMatchesTheCpuProbe) {
  const std::vector<int32_t> cu = testing::CuSeqlens({1, 700, 300, 65});
  const int heads = 2;
  const int head_dim = 64;
  const size_t n = static_cast<size_t>(cu.back()) * heads * head_dim;
  const Bf16Tensor q = ToBf16(testing::RandomTensor(n, 7)), k = ToBf16(testing::RandomTensor(n, 8));
  typename TypeParam::Buffer dq = this->Upload(q.bits.data(), n * 2),
                             dk = this->Upload(k.bits.data(), n * 2);
  absl::StatusOr<Selection> sel =
      SelectBlocks(cu, heads, head_dim, q.values, k.values, {1.0, 0.1, 0.3, 0.5}, {});
  ASSERT_TRUE(sel.ok());
  RecallSampling sampling;
  sampling.rows = 16;
  const RecallRows rows = SampleRecallRows(sel->index, {1, 2, 3, 4}, sampling);
  absl::StatusOr<RecallProbe> cpu = ProbeRecall(sel->index, head_dim, q.values, k.values, rows);
  ASSERT_TRUE(cpu.ok());
  absl::StatusOr<typename TypeParam::Index> dindex = TypeParam::Index::Upload(sel->index, {});
  ASSERT_TRUE(dindex.ok());
  absl::StatusOr<RecallProbe> got = TypeParam::ProbeRecall(*dindex, head_dim, dq.data(), dk.data(),
                                                           rows, typename TypeParam::Stream{});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->row_recall.size(), cpu->row_recall.size());
  for (size_t e = 0; e < cpu->row_recall.size(); ++e) {
    EXPECT_NEAR(got->row_recall[e], cpu->row_recall[e], 1e-5) << "row " << e;
  }
  for (size_t s = 0; s < cpu->document_recall.size(); ++s) {
    EXPECT_NEAR(got->document_recall[s], cpu->document_recall[s], 1e-5) << "document " << s;
  }
  EXPECT_EQ(got->document_recall[0], 1.0);
}

// Row-major C = op(A) op(B) through cuBLAS's column-major GEMM, every transpose combination,
// against a plain loop (bf16 inputs, fp32 sums, one bf16 rounding: 2^-8 relative).
TYPED_TEST(CudaKernelsTest, MatmulBf16MatchesALoop) {
  const int64_t m = 5, n = 7, k = 33;
  for (bool at : {false, true}) {
    for (bool bt : {false, true}) {
      const Bf16Tensor a = ToBf16(testing::RandomTensor(m * k, 31)),
                       b = ToBf16(testing::RandomTensor(k * n, 32));
      typename TypeParam::Buffer da = this->Upload(a.bits.data(), a.bits.size() * 2),
                                 db = this->Upload(b.bits.data(), b.bits.size() * 2),
                                 dc = this->Scratch(m * n * 2);
      ASSERT_TRUE(TypeParam::MatmulBf16(m, n, k, da.data(), at, db.data(), bt, dc.data(),
                                        typename TypeParam::Stream{})
                      .ok());
      const std::vector<float> c = this->DownloadBf16(dc, m * n);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double want = 0.0;
          for (int64_t l = 0; l < k; ++l) {
            want += static_cast<double>(at ? a.values[l * m + i] : a.values[i * k + l]) *
                    (bt ? b.values[j * k + l] : b.values[l * n + j]);
          }
          EXPECT_NEAR(c[i * n + j], want, std::ldexp(std::fabs(want), -8) + 1e-5)
              << "a_transposed " << at << " b_transposed " << bt << " at " << i << ", " << j;
        }
      }
    }
  }
}

TYPED_TEST(CudaKernelsTest, BadInputIsAnErrorNotACrash) {
  const std::vector<int32_t> cu = {0, 100, 90};
  EXPECT_EQ(TypeParam::SelectBlocks(cu, 1, 64, nullptr, nullptr, std::vector<double>{0.5, 0.5},
                                    SelectionOptions{}, typename TypeParam::Stream{})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TypeParam::SelectBlocks(std::vector<int32_t>{0, 100}, 1, 64, nullptr, nullptr,
                                    std::vector<double>{1.5}, SelectionOptions{},
                                    typename TypeParam::Stream{})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// The CUDA path's selection keeps its recalls on the device; a NaN in q (a NaN total of a row's
// masses) read 1.0 there as on the CPU. The download names the row, as the CPU's selection does.
TYPED_TEST(CudaKernelsTest, ANanInQIsAnErrorWhenTheSelectionIsDownloaded) {
  const std::vector<int32_t> cu = testing::CuSeqlens({100, 1000});
  const int heads = 2;
  const int head_dim = 64;
  const size_t n = static_cast<size_t>(cu.back()) * heads * head_dim;
  std::vector<float> values = testing::RandomTensor(n, 45);
  values[(static_cast<size_t>(100 + 600) * heads + 1) * head_dim + 5] = std::nanf("");
  const Bf16Tensor q = ToBf16(values), k = ToBf16(testing::RandomTensor(n, 46));
  typename TypeParam::Buffer dq = this->Upload(q.bits.data(), n * 2),
                             dk = this->Upload(k.bits.data(), n * 2);
  absl::StatusOr<typename TypeParam::Selection> on_device = TypeParam::SelectBlocks(
      cu, heads, head_dim, dq.data(), dk.data(), std::vector<double>{0.5, 0.1}, SelectionOptions{},
      typename TypeParam::Stream{});
  ASSERT_TRUE(on_device.ok()) << on_device.status();
  const absl::StatusOr<Selection> got = on_device->Download();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status().message(),
              ::testing::HasSubstr("sequence 1, head 1, query block 9 are NaN"));
  std::vector<int64_t> offsets;
  std::vector<float> recalls;
  EXPECT_EQ(on_device->DownloadCounts(&offsets, &recalls, typename TypeParam::Stream{}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CudaBuildTest, BuildFlagAgreesWithTheLibrary) {
#if defined(SB_KERNELS_WITH_CUDA)
  EXPECT_TRUE(cuda::Compiled());
#else
  EXPECT_FALSE(cuda::Compiled());
  EXPECT_EQ(cuda::DeviceCount(), 0);
  EXPECT_EQ(cuda::DeviceBuffer::Allocate(16).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cuda::ProbeRecall(cuda::DeviceBlockIndex{}, 64, nullptr, nullptr, RecallRows{},
                              cuda::Stream{})
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
#endif
  EXPECT_TRUE(cuda_emulated::Compiled());
}

// The device path keeps scores and index on the device: selection reads back one count (the
// index's size) and uploads only the batch's shape; the forward and backward copy nothing.
TEST(CudaEmulatedTest, SelectionAndAttentionKeepTheirDataOnTheDevice) {
  const std::vector<int32_t> cu = testing::CuSeqlens({500, 64, 300});
  const int heads = 2;
  const int head_dim = 64;
  const size_t n = static_cast<size_t>(cu.back()) * heads * head_dim;
  const size_t n_lse = static_cast<size_t>(cu.back()) * heads;
  std::vector<uint16_t> bits(n);
  const std::vector<float> values = testing::RandomTensor(n, 51);
  for (size_t i = 0; i < n; ++i) bits[i] = FloatToBf16(values[i]);
  std::vector<cuda_emulated::DeviceBuffer> buffers;
  for (size_t bytes :
       {n * 2, n * 2, n * 2, n * 2, n * 2, n * 2, n * 2, n * 2, n_lse * 4, n_lse * 4}) {
    absl::StatusOr<cuda_emulated::DeviceBuffer> b = cuda_emulated::DeviceBuffer::Allocate(bytes);
    ASSERT_TRUE(b.ok());
    buffers.push_back(*std::move(b));
  }
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(buffers[i].CopyFromHost(bits.data(), n * 2).ok());
  auto* q = buffers[0].data();
  auto* k = buffers[1].data();
  auto* v = buffers[2].data();
  auto* dout = buffers[3].data();
  const cuda_emulated::Stream stream{};
  emu::ResetTransfers();
  absl::StatusOr<cuda_emulated::DeviceSelection> selection = cuda_emulated::SelectBlocks(
      cu, heads, head_dim, q, k, {0.3, 1.0, 0.5}, SelectionOptions{}, stream);
  ASSERT_TRUE(selection.ok()) << selection.status();
  emu::TransferStats moved = emu::Transfers();
  EXPECT_EQ(moved.to_host_copies, 1);
  EXPECT_EQ(moved.to_host_bytes, 8);
  // cu_seqlens and cu_blocks (int32), triangle offsets (int64) and quantized densities (int64).
  EXPECT_EQ(moved.to_device_bytes, static_cast<int64_t>(cu.size() * (4 + 4 + 8) + 3 * 8));
  EXPECT_GT(selection->index.active_blocks(), 0);
  emu::ResetTransfers();
  ASSERT_TRUE(cuda_emulated::Forward(selection->index, head_dim, q, k, v, 0.0f, buffers[4].data(),
                                     static_cast<float*>(buffers[8].data()), stream)
                  .ok());
  ASSERT_TRUE(cuda_emulated::Backward(selection->index, head_dim, q, k, v, buffers[4].data(),
                                      static_cast<const float*>(buffers[8].data()), dout, 0.0f,
                                      static_cast<float*>(buffers[9].data()), buffers[5].data(),
                                      buffers[6].data(), buffers[7].data(), stream)
                  .ok());
  moved = emu::Transfers();
  EXPECT_EQ(moved.to_host_copies + moved.to_device_copies, 0);
  // The per-document figures read each row's count and estimate, never the blocks.
  emu::ResetTransfers();
  std::vector<int64_t> row_ptr;
  std::vector<float> estimated_recall;
  ASSERT_TRUE(selection->DownloadCounts(&row_ptr, &estimated_recall, stream).ok());
  const int64_t rows = selection->index.shape().rows();
  EXPECT_EQ(emu::Transfers().to_host_bytes, (rows + 1) * 8 + rows * 4);
  absl::StatusOr<Selection> whole = selection->Download(stream);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(row_ptr, whole->index.row_ptr);
  EXPECT_EQ(estimated_recall, whole->estimated_recall);
}

// The emulator's own checks: a launch above the shared-memory limit fails as the driver's would,
// and threads waiting at different barriers are reported, not hung.
TEST(CudaEmulatorTest, RefusesWhatTheDriverRefuses) {
  emu::LaunchShape shape;
  shape.grid = {2, 1, 1};
  shape.block = {64, 1, 1};
  shape.dynamic_shared = 64 * 1024;  // the limit was not raised: 48 KiB
  absl::Status s = emu::Run("TooMuchShared", shape, [] {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("TooMuchShared"), std::string::npos) << s;
  shape.dynamic_shared = 0;
  shape.block = {1025, 1, 1};
  EXPECT_EQ(emu::Run("TooManyThreads", shape, [] {}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaEmulatorTest, ReportsThreadsStuckAtDifferentBarriers) {
  emu::LaunchShape shape;
  shape.block = {32, 1, 1};
  absl::Status s = emu::Run("Divergent", shape, [] {
    if (emu::Current().thread.x < 16) {
      emu::SyncThreads();  // half the warp here, half at the exchange: neither can go on
    } else {
      uint64_t lanes[32];
      emu::WarpExchange(1, lanes);
      emu::SyncThreads();
    }
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
}

TEST(CudaEmulatorTest, BarriersAndWarpExchangesOrderTheThreads) {
  emu::LaunchShape shape;
  shape.grid = {3, 1, 1};
  shape.block = {96, 1, 1};
  std::vector<int> sums(3 * 96, -1);
  std::vector<uint64_t> lane_sums(3 * 96, 0);
  ASSERT_TRUE(emu::Run("Ordered", shape, [&] {
                static const char key = 0;
                int* shared = static_cast<int*>(emu::StaticShared(&key, 96 * sizeof(int)));
                const unsigned t = emu::Current().thread.x;
                const unsigned b = emu::Current().block.x;
                shared[t] = static_cast<int>(t + b);
                emu::SyncThreads();  // every thread's value is in before any is read
                int sum = 0;
                for (int i = 0; i < 96; ++i) sum += shared[i];
                sums[b * 96 + t] = sum;
                uint64_t lanes[32];
                for (int round = 0; round < 3; ++round) {  // slots reused across exchanges
                  emu::WarpExchange(t * 10 + round, lanes);
                  for (uint64_t v : lanes)
                    lane_sums[b * 96 + t] +=
                        v % 10 == static_cast<uint64_t>(round) ? v / 10 : 1000000;
                }
              }).ok());
  for (unsigned b = 0; b < 3; ++b) {
    for (unsigned t = 0; t < 96; ++t) {
      EXPECT_EQ(sums[b * 96 + t], 96 * 95 / 2 + 96 * static_cast<int>(b));
      const uint64_t warp = t / 32;
      EXPECT_EQ(lane_sums[b * 96 + t], 3 * (32 * warp * 32 + 32 * 31 / 2));
    }
  }
}

// Every thread's stack and registers survive the switches: each of up to 1,024 threads recurses
// through barriers, keeping integers, doubles and a local array live across each one, and a
// second launch of another shape runs on the reused fibers.
int64_t KeepAcrossBarriers(unsigned t, int depth, double* scaled) {
  if (depth == 0) return 0;
  int64_t local[16];
  for (int i = 0; i < 16; ++i) local[i] = static_cast<int64_t>(t) * 31 + depth * 7 + i;
  const double factor = 1.0 + depth * 0.25 + t * 1e-3;
  emu::SyncThreads();  // every thread switches away and back with all of the above live
  const int64_t below = KeepAcrossBarriers(t, depth - 1, scaled);
  emu::SyncThreads();
  *scaled = *scaled * factor + static_cast<double>(local[depth % 16]);
  int64_t sum = below;
  for (int64_t v : local) sum += v;
  return sum;
}

TEST(CudaEmulatorTest, EachThreadKeepsItsStackAndRegistersAcrossBarriers) {
  constexpr int kDepth = 12;
  for (unsigned threads : {1024u, 33u}) {
    SCOPED_TRACE(::testing::Message() << threads << " threads");
    emu::LaunchShape shape;
    shape.grid = {2, 1, 1};
    shape.block = {threads, 1, 1};
    std::vector<int64_t> sums(2 * threads, -1);
    std::vector<double> scaled(2 * threads, 0.0);
    ASSERT_TRUE(emu::Run("Keep", shape, [&] {
                  const unsigned t = emu::Current().thread.x;
                  const unsigned slot = emu::Current().block.x * threads + t;
                  double value = 1.0;
                  sums[slot] = KeepAcrossBarriers(t, kDepth, &value);
                  scaled[slot] = value;
                }).ok());
    for (unsigned slot = 0; slot < 2 * threads; ++slot) {
      const unsigned t = slot % threads;
      double value = 1.0;
      int64_t sum = 0;
      for (int depth = 1; depth <= kDepth; ++depth) {  // the innermost call finishes first
        value = value * (1.0 + depth * 0.25 + t * 1e-3) +
                static_cast<double>(int64_t{t} * 31 + depth * 7 + depth % 16);
        for (int i = 0; i < 16; ++i) sum += int64_t{t} * 31 + depth * 7 + i;
      }
      ASSERT_EQ(sums[slot], sum) << "thread " << t;
      ASSERT_EQ(scaled[slot], value) << "thread " << t;
    }
  }
}

}  // namespace
}  // namespace kernels
}  // namespace sparsebalance
