// The CUDA kernels against the CPU reference (bf16 inputs: relative L2 <= 2e-2). Compiled in
// every build; skipped, saying so, where no CUDA device is usable.
#include "kernels/cuda_attention.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "contract/block_geometry.h"
#include "gtest/gtest.h"
#include "kernels/attention_cpu.h"
#include "kernels/bf16.h"
#include "kernels/block_selection.h"
#include "kernels/recall_probe.h"
#include "reference.h"

namespace sparsebalance {
namespace kernels {
namespace {

#define SKIP_WITHOUT_DEVICE()                           \
  do {                                                  \
    std::string why;                                    \
    if (cuda::DeviceCount(&why) == 0) {                 \
      GTEST_SKIP() << "no CUDA device (" << why << ")"; \
    }                                                   \
  } while (0)

// fp32 values rounded to bf16 (what the GPU sees), and their bf16 bits.
struct Bf16Tensor {
  std::vector<float> values;
  std::vector<uint16_t> bits;
};

Bf16Tensor RandomBf16(size_t n, uint32_t seed) {
  Bf16Tensor t;
  t.values = testing::RandomTensor(n, seed);
  t.bits.resize(n);
  for (size_t i = 0; i < n; ++i) {
    t.bits[i] = FloatToBf16(t.values[i]);
    t.values[i] = Bf16ToFloat(t.bits[i]);
  }
  return t;
}

cuda::DeviceBuffer Upload(const void* data, size_t bytes) {
  absl::StatusOr<cuda::DeviceBuffer> buffer = cuda::DeviceBuffer::Allocate(bytes);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_TRUE(buffer->CopyFromHost(data, bytes).ok());
  return *std::move(buffer);
}

std::vector<float> DownloadBf16(const cuda::DeviceBuffer& buffer, size_t n) {
  std::vector<uint16_t> bits(n);
  EXPECT_TRUE(buffer.CopyToHost(bits.data(), n * 2).ok());
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(bits[i]);
  return out;
}

TEST(CudaAttentionTest, BuildFlagAgreesWithTheLibrary) {
#if defined(SB_KERNELS_WITH_CUDA)
  EXPECT_TRUE(cuda::Compiled());
#else
  EXPECT_FALSE(cuda::Compiled());
  EXPECT_EQ(cuda::DeviceCount(), 0);
  EXPECT_EQ(cuda::DeviceBuffer::Allocate(16).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cuda::ProbeRecall(cuda::DeviceBlockIndex{}, 64, nullptr, nullptr, RecallRows{})
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
#endif
}

void CompareWithCpu(const std::vector<int32_t>& lengths, int heads, int head_dim, int block_size,
                    double density) {
  const std::vector<int32_t> cu = testing::CuSeqlens(lengths);
  const size_t n = static_cast<size_t>(cu.back()) * heads * head_dim;
  const size_t n_lse = static_cast<size_t>(cu.back()) * heads;
  const Bf16Tensor q = RandomBf16(n, 1), k = RandomBf16(n, 2), v = RandomBf16(n, 3),
                   dout = RandomBf16(n, 4);
  cuda::DeviceBuffer dq_ = Upload(q.bits.data(), n * 2), dk_ = Upload(k.bits.data(), n * 2),
                     dv_ = Upload(v.bits.data(), n * 2), ddout = Upload(dout.bits.data(), n * 2);
  SelectionOptions options;
  options.block_size = block_size;
  const std::vector<double> densities(lengths.size(), density);
  // Selection: the same counts as the CPU, the anchors, and nearly the same blocks (pooled
  // sums may round differently, so near-ties can go either way).
  absl::StatusOr<Selection> gpu_sel =
      cuda::SelectBlocks(cu, heads, head_dim, dq_.data(), dk_.data(), densities, options);
  ASSERT_TRUE(gpu_sel.ok()) << gpu_sel.status();
  absl::StatusOr<Selection> cpu_sel =
      SelectBlocks(cu, heads, head_dim, q.values, k.values, densities, options);
  ASSERT_TRUE(cpu_sel.ok());
  const BlockIndex& index = gpu_sel->index;
  ASSERT_TRUE(ValidateBlockIndex(index).ok());
  ASSERT_EQ(index.row_ptr, cpu_sel->index.row_ptr);  // k_i per row
  int64_t same = 0;
  for (size_t e = 0; e < index.col_idx.size(); ++e)
    same += index.col_idx[e] == cpu_sel->index.col_idx[e];
  EXPECT_GE(same, static_cast<int64_t>(0.95 * index.col_idx.size()));
  for (size_t r = 0; r < gpu_sel->estimated_recall.size(); ++r) {
    EXPECT_NEAR(gpu_sel->estimated_recall[r], cpu_sel->estimated_recall[r], 2e-2);
  }
  // Forward and backward over the GPU's index, on both devices.
  absl::StatusOr<cuda::DeviceBlockIndex> dindex = cuda::DeviceBlockIndex::Upload(index);
  ASSERT_TRUE(dindex.ok()) << dindex.status();
  absl::StatusOr<cuda::DeviceBuffer> out = cuda::DeviceBuffer::Allocate(n * 2);
  absl::StatusOr<cuda::DeviceBuffer> lse = cuda::DeviceBuffer::Allocate(n_lse * 4);
  absl::StatusOr<cuda::DeviceBuffer> delta = cuda::DeviceBuffer::Allocate(n_lse * 4);
  absl::StatusOr<cuda::DeviceBuffer> gq = cuda::DeviceBuffer::Allocate(n * 2);
  absl::StatusOr<cuda::DeviceBuffer> gk = cuda::DeviceBuffer::Allocate(n * 2);
  absl::StatusOr<cuda::DeviceBuffer> gv = cuda::DeviceBuffer::Allocate(n * 2);
  ASSERT_TRUE(out.ok() && lse.ok() && delta.ok() && gq.ok() && gk.ok() && gv.ok());
  ASSERT_TRUE(cuda::Forward(*dindex, head_dim, dq_.data(), dk_.data(), dv_.data(), 0.0f,
                            out->data(), static_cast<float*>(lse->data()))
                  .ok());
  ASSERT_TRUE(cuda::Backward(*dindex, head_dim, dq_.data(), dk_.data(), dv_.data(), out->data(),
                             static_cast<const float*>(lse->data()), ddout.data(), 0.0f,
                             static_cast<float*>(delta->data()), gq->data(), gk->data(), gv->data())
                  .ok());
  ASSERT_TRUE(cuda::Synchronize().ok());
  std::vector<float> c_out(n), c_lse(n_lse), c_dq(n), c_dk(n), c_dv(n);
  AttentionOptions cpu;
  ASSERT_TRUE(AttentionForward(index, head_dim, q.values, k.values, v.values, cpu,
                               absl::MakeSpan(c_out), absl::MakeSpan(c_lse))
                  .ok());
  ASSERT_TRUE(AttentionBackward(index, head_dim, q.values, k.values, v.values, c_out, c_lse,
                                dout.values, cpu, absl::MakeSpan(c_dq), absl::MakeSpan(c_dk),
                                absl::MakeSpan(c_dv))
                  .ok());
  std::vector<float> g_lse(n_lse);
  ASSERT_TRUE(lse->CopyToHost(g_lse.data(), n_lse * 4).ok());
  EXPECT_LE(testing::RelativeL2(DownloadBf16(*out, n), c_out), 2e-2);
  EXPECT_LE(testing::MaxAbsDiff(g_lse, c_lse), 2e-2);
  EXPECT_LE(testing::RelativeL2(DownloadBf16(*gq, n), c_dq), 2e-2);
  EXPECT_LE(testing::RelativeL2(DownloadBf16(*gk, n), c_dk), 2e-2);
  EXPECT_LE(testing::RelativeL2(DownloadBf16(*gv, n), c_dv), 2e-2);
}

TEST(CudaAttentionTest, DenseVarlenMatchesTheCpuReference) {
  SKIP_WITHOUT_DEVICE();
  for (int head_dim : {64, 128}) {
    for (int block_size : {64, 128}) {
      SCOPED_TRACE(::testing::Message() << "head_dim " << head_dim << " block " << block_size);
      CompareWithCpu({1, 200, 64, 333, 129}, 3, head_dim, block_size, 1.0);
    }
  }
}

TEST(CudaAttentionTest, SparseMatchesTheCpuReference) {
  SKIP_WITHOUT_DEVICE();
  for (double density : {0.3, 0.1}) {
    SCOPED_TRACE(::testing::Message() << "density " << density);
    CompareWithCpu({2000, 777, 65}, 2, 128, 64, density);
    CompareWithCpu({1500, 300}, 2, 64, 128, density);
  }
}

// The device probe against the CPU probe on the same (bf16-rounded) inputs and sampled rows.
TEST(CudaAttentionTest, RecallProbeMatchesTheCpuProbe) {
  SKIP_WITHOUT_DEVICE();
  for (int head_dim : {64, 128}) {
    const std::vector<int32_t> cu = testing::CuSeqlens({1, 2000, 777, 65});
    const int heads = 3;
    const size_t n = static_cast<size_t>(cu.back()) * heads * head_dim;
    const Bf16Tensor q = RandomBf16(n, 7), k = RandomBf16(n, 8);
    cuda::DeviceBuffer dq = Upload(q.bits.data(), n * 2), dk = Upload(k.bits.data(), n * 2);
    absl::StatusOr<Selection> sel =
        SelectBlocks(cu, heads, head_dim, q.values, k.values, {1.0, 0.1, 0.3, 0.5}, {});
    ASSERT_TRUE(sel.ok());
    const std::vector<uint64_t> seeds = {1, 2, 3, 4};
    RecallSampling sampling;
    sampling.rows = 16;
    const RecallRows rows = SampleRecallRows(sel->index, seeds, sampling);
    absl::StatusOr<RecallProbe> cpu = ProbeRecall(sel->index, head_dim, q.values, k.values, rows);
    ASSERT_TRUE(cpu.ok());
    absl::StatusOr<cuda::DeviceBlockIndex> dindex = cuda::DeviceBlockIndex::Upload(sel->index);
    ASSERT_TRUE(dindex.ok());
    absl::StatusOr<RecallProbe> gpu =
        cuda::ProbeRecall(*dindex, head_dim, dq.data(), dk.data(), rows);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    ASSERT_EQ(gpu->row_recall.size(), cpu->row_recall.size());
    for (size_t e = 0; e < cpu->row_recall.size(); ++e) {
      EXPECT_NEAR(gpu->row_recall[e], cpu->row_recall[e], 1e-4) << "row " << e;
    }
    for (size_t s = 0; s < cpu->document_recall.size(); ++s) {
      EXPECT_NEAR(gpu->document_recall[s], cpu->document_recall[s], 1e-4) << "document " << s;
    }
    EXPECT_EQ(gpu->document_recall[0], 1.0);
  }
}

TEST(CudaAttentionTest, BadInputIsAnErrorNotACrash) {
  SKIP_WITHOUT_DEVICE();
  const std::vector<int32_t> cu = {0, 100, 90};
  absl::StatusOr<Selection> sel =
      cuda::SelectBlocks(cu, 1, 64, nullptr, nullptr, {0.5, 0.5}, SelectionOptions{});
  EXPECT_EQ(sel.status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<Selection> density =
      cuda::SelectBlocks({0, 100}, 1, 64, nullptr, nullptr, {1.5}, SelectionOptions{});
  EXPECT_EQ(density.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kernels
}  // namespace sparsebalance
