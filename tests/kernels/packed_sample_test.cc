// A pre-packed sample (several documents concatenated) runs through the CPU reference kernels
// with its segments as separate varlen entries: its attention output and gradients dQ/dK/dV
// equal those of each document run on its own, and selection keeps exactly the planner's
// ActiveBlocks for each document. The negative control runs the packed sample as one sequence
// (its documents attend to each other): a different output, the bug segments fix.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "contract/block_geometry.h"
#include "gtest/gtest.h"
#include "kernels/attention_cpu.h"
#include "kernels/block_selection.h"
#include "planner/types.h"
#include "reference.h"

namespace sparsebalance {
namespace kernels {
namespace {

constexpr int kHeads = 2;
constexpr int kHeadDim = 64;
constexpr int kBlockSize = 64;
constexpr int kLocalBlocks = 1;

struct Attended {
  BlockIndex index;
  std::vector<float> out, dq, dk, dv;
};

// Selection at `density` for every sequence of `cu`, then forward and backward.
Attended Attend(const std::vector<int32_t>& cu, double density, const std::vector<float>& q,
                const std::vector<float>& k, const std::vector<float>& v,
                const std::vector<float>& dout) {
  SelectionOptions select;
  select.block_size = kBlockSize;
  select.local_blocks = kLocalBlocks;
  select.threads = 2;
  const std::vector<double> densities(cu.size() - 1, density);
  absl::StatusOr<Selection> selection = SelectBlocks(cu, kHeads, kHeadDim, q, k, densities, select);
  EXPECT_TRUE(selection.ok()) << selection.status();
  Attended r;
  r.index = selection->index;
  const size_t n = q.size();
  r.out.assign(n, 0.0f);
  r.dq.assign(n, 0.0f);
  r.dk.assign(n, 0.0f);
  r.dv.assign(n, 0.0f);
  std::vector<float> lse(static_cast<size_t>(cu.back()) * kHeads);
  AttentionOptions options;
  options.threads = 2;
  absl::Status fwd = AttentionForward(r.index, kHeadDim, q, k, v, options, absl::MakeSpan(r.out),
                                      absl::MakeSpan(lse));
  EXPECT_TRUE(fwd.ok()) << fwd;
  absl::Status bwd =
      AttentionBackward(r.index, kHeadDim, q, k, v, r.out, lse, dout, options, absl::MakeSpan(r.dq),
                        absl::MakeSpan(r.dk), absl::MakeSpan(r.dv));
  EXPECT_TRUE(bwd.ok()) << bwd;
  return r;
}

std::vector<float> Slice(const std::vector<float>& t, int64_t start, int64_t length) {
  const int64_t stride = int64_t{kHeads} * kHeadDim;
  return {t.begin() + start * stride, t.begin() + (start + length) * stride};
}

// max |a - b| over max |b|: the error relative to the tensor's scale.
double RelativeMaxError(const std::vector<float>& a, const std::vector<float>& b) {
  double scale = 0.0;
  for (float x : b) scale = std::max(scale, std::fabs(double{x}));
  return testing::MaxAbsDiff(a, b) / std::max(scale, 1e-30);
}

// Kept (query block, key block) pairs of sequence `seq`, head `head`.
int64_t KeptPairs(const BlockIndex& index, int seq, int head) {
  const int64_t first = index.RowId(seq, head, 0);
  return index.row_ptr[first + index.blocks(seq)] - index.row_ptr[first];
}

struct Packed {
  PlannedSample sample;
  std::vector<int32_t> cu;  // one varlen entry per document
  std::vector<float> q, k, v, dout;
};

Packed MakePacked(std::vector<int64_t> segments, double density, uint32_t seed) {
  Packed p;
  p.sample.id = 7;
  p.sample.density = density;
  for (int64_t s : segments) p.sample.length += s;
  p.sample.segments = std::move(segments);
  p.cu.push_back(0);
  for (int64_t d : p.sample.Documents()) p.cu.push_back(p.cu.back() + static_cast<int32_t>(d));
  const size_t n = static_cast<size_t>(p.sample.length) * kHeads * kHeadDim;
  p.q = testing::RandomTensor(n, seed);
  p.k = testing::RandomTensor(n, seed + 1);
  p.v = testing::RandomTensor(n, seed + 2);
  p.dout = testing::RandomTensor(n, seed + 3);
  return p;
}

TEST(PackedSampleTest, DocumentsAsVarlenEntriesEqualEachDocumentAlone) {
  // Lengths off the block grid, a one-token document and one exactly one block long.
  for (double density : {1.0, 0.4, 0.1}) {
    const Packed p = MakePacked({130, 64, 333, 1, 200}, density, 11);
    const Attended packed = Attend(p.cu, density, p.q, p.k, p.v, p.dout);
    for (size_t d = 0; d + 1 < p.cu.size(); ++d) {
      const int64_t start = p.cu[d];
      const int64_t length = p.cu[d + 1] - start;
      const Attended alone = Attend({0, static_cast<int32_t>(length)}, density,
                                    Slice(p.q, start, length), Slice(p.k, start, length),
                                    Slice(p.v, start, length), Slice(p.dout, start, length));
      SCOPED_TRACE(::testing::Message() << "density " << density << " document " << d);
      EXPECT_LE(RelativeMaxError(Slice(packed.out, start, length), alone.out), 1e-5);
      EXPECT_LE(RelativeMaxError(Slice(packed.dq, start, length), alone.dq), 1e-5);
      EXPECT_LE(RelativeMaxError(Slice(packed.dk, start, length), alone.dk), 1e-5);
      EXPECT_LE(RelativeMaxError(Slice(packed.dv, start, length), alone.dv), 1e-5);
      // Selection keeps exactly the planner's count for the document, in every head.
      const int64_t planned = ActiveBlocks(length, density, kBlockSize, kLocalBlocks);
      for (int h = 0; h < kHeads; ++h) {
        EXPECT_EQ(KeptPairs(packed.index, static_cast<int>(d), h), planned) << "head " << h;
        EXPECT_EQ(KeptPairs(alone.index, 0, h), planned) << "head " << h;
      }
    }
  }
}

TEST(PackedSampleTest, PackedOutputEqualsMaskedDenseReferencePerDocument) {
  // The same property against the slow double-precision definition: causal attention within
  // each document, at density 1 (every block kept).
  const Packed p = MakePacked({100, 190, 37}, 1.0, 21);
  const Attended packed = Attend(p.cu, 1.0, p.q, p.k, p.v, p.dout);
  const testing::DenseResult dense =
      testing::DenseAttention(p.cu, kHeads, kHeadDim, kBlockSize, testing::BlockMask{}, p.q, p.k,
                              p.v, p.dout, 1.0 / std::sqrt(double{kHeadDim}));
  EXPECT_LE(testing::RelativeL2(packed.out, dense.out), 1e-5);
  EXPECT_LE(testing::RelativeL2(packed.dq, dense.dq), 1e-5);
  EXPECT_LE(testing::RelativeL2(packed.dk, dense.dk), 1e-5);
  EXPECT_LE(testing::RelativeL2(packed.dv, dense.dv), 1e-5);
}

TEST(PackedSampleTest, OneSequenceLetsDocumentsAttendAcrossBoundaries) {
  // The bug segments fix: run as one sequence, every document after the first attends to the
  // documents before it. Dense (density 1) so that only the boundaries differ.
  const Packed p = MakePacked({130, 64, 333}, 1.0, 31);
  const Attended documents = Attend(p.cu, 1.0, p.q, p.k, p.v, p.dout);
  const Attended one =
      Attend({0, static_cast<int32_t>(p.sample.length)}, 1.0, p.q, p.k, p.v, p.dout);
  // The first document sees nothing before it: the same either way.
  EXPECT_LE(RelativeMaxError(Slice(one.out, 0, 130), Slice(documents.out, 0, 130)), 1e-5);
  // The later ones differ by far more than rounding.
  const int64_t later = p.sample.length - 130;
  EXPECT_GT(RelativeMaxError(Slice(one.out, 130, later), Slice(documents.out, 130, later)), 1e-2);
  EXPECT_GT(RelativeMaxError(one.dk, documents.dk), 1e-2);
  // And it runs more blocks than the planner costs the sample for.
  int64_t planned = 0;
  for (int64_t d : p.sample.Documents()) planned += ActiveBlocks(d, 1.0, kBlockSize, kLocalBlocks);
  EXPECT_GT(one.index.active_blocks(), documents.index.active_blocks());
  EXPECT_EQ(documents.index.active_blocks(), planned * kHeads);
}

}  // namespace
}  // namespace kernels
}  // namespace sparsebalance
