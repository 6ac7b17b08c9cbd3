// The CPU reference equals dense causal attention at density 1 and the masked dense reference
// at any density, forward and backward; its gradients match finite differences.
#include "kernels/attention_cpu.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_selection.h"
#include "reference.h"

namespace sparsebalance {
namespace kernels {
namespace {

using ::testing::HasSubstr;
using testing::MakeProblem;
using testing::Problem;

struct Result {
  std::vector<float> out, lse, dq, dk, dv;
};

Result RunBoth(const Problem& p, const BlockIndex& index, int threads = 2) {
  const size_t n = p.q.size();
  Result r{std::vector<float>(n), std::vector<float>(static_cast<size_t>(p.cu.back()) * p.heads),
           std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  AttentionOptions options;
  options.threads = threads;
  absl::Status fwd = AttentionForward(index, p.head_dim, p.q, p.k, p.v, options,
                                      absl::MakeSpan(r.out), absl::MakeSpan(r.lse));
  EXPECT_TRUE(fwd.ok()) << fwd;
  absl::Status bwd =
      AttentionBackward(index, p.head_dim, p.q, p.k, p.v, r.out, r.lse, p.dout, options,
                        absl::MakeSpan(r.dq), absl::MakeSpan(r.dk), absl::MakeSpan(r.dv));
  EXPECT_TRUE(bwd.ok()) << bwd;
  return r;
}

BlockIndex Select(const Problem& p, int block_size, double density, int local_blocks = 1) {
  SelectionOptions options;
  options.block_size = block_size;
  options.local_blocks = local_blocks;
  std::vector<double> densities(p.cu.size() - 1, density);
  absl::StatusOr<Selection> sel =
      SelectBlocks(p.cu, p.heads, p.head_dim, p.q, p.k, densities, options);
  EXPECT_TRUE(sel.ok()) << sel.status();
  return sel->index;
}

// The dense reference for `p` under `mask` (none: causal), softmax scale 1/sqrt(head_dim).
testing::DenseResult Reference(const Problem& p, int block_size, const testing::BlockMask& mask) {
  return testing::DenseAttention(p.cu, p.heads, p.head_dim, block_size, mask, p.q, p.k, p.v, p.dout,
                                 1.0 / std::sqrt(static_cast<float>(p.head_dim)));
}

// The kernel's result equals the reference: the output (and the log-sum-exp, unless a row keeps
// nothing and it is undefined) to 1e-5, the gradients to 1e-4.
void ExpectEqualsReference(const Result& r, const testing::DenseResult& dense,
                           bool compare_lse = true) {
  EXPECT_LE(testing::MaxAbsDiff(r.out, dense.out), 1e-5);
  if (compare_lse) {
    EXPECT_LE(testing::MaxAbsDiff(r.lse, dense.lse), 1e-5);
  }
  EXPECT_LE(testing::MaxAbsDiff(r.dq, dense.dq), 1e-4);
  EXPECT_LE(testing::MaxAbsDiff(r.dk, dense.dk), 1e-4);
  EXPECT_LE(testing::MaxAbsDiff(r.dv, dense.dv), 1e-4);
}

TEST(AttentionCpuTest, FullDensityEqualsDenseCausalAttention) {
  // Odd lengths (not multiples of the block size), several documents and heads.
  const std::vector<int32_t> lengths = {1, 200, 64, 333, 129};
  for (int head_dim : {64, 128}) {
    for (int block_size : {64, 128}) {
      const Problem p = MakeProblem(lengths, 3, head_dim, 100 + head_dim + block_size);
      const BlockIndex index = Select(p, block_size, 1.0);
      SCOPED_TRACE(::testing::Message() << "head_dim " << head_dim << " block " << block_size);
      ExpectEqualsReference(RunBoth(p, index), Reference(p, block_size, testing::BlockMask{}));
    }
  }
}

TEST(AttentionCpuTest, AnyDensityEqualsTheMaskedDenseReference) {
  const std::vector<int32_t> lengths = {700, 65, 1, 450};
  for (int head_dim : {64, 128}) {
    for (double density : {0.5, 0.2, 0.01}) {
      const int block_size = density == 0.2 ? 128 : 64;
      const Problem p = MakeProblem(lengths, 2, head_dim, 7 + head_dim);
      const BlockIndex index = Select(p, block_size, density, density == 0.01 ? 0 : 1);
      SCOPED_TRACE(::testing::Message() << "head_dim " << head_dim << " density " << density);
      ExpectEqualsReference(RunBoth(p, index),
                            Reference(p, block_size, testing::BlockMask::FromIndex(index)));
    }
  }
}

TEST(AttentionCpuTest, ArbitraryRowsWithoutTheDiagonalFollowTheMask) {
  // Rows need not come from SelectBlocks: any causal subset, even one that skips the diagonal
  // or is empty.
  const Problem p = MakeProblem({400, 130}, 2, 64, 55);
  std::mt19937 rng(3);
  std::vector<std::vector<int32_t>> rows;
  for (int32_t blocks : {7, 3}) {
    for (int h = 0; h < 2; ++h) {
      for (int32_t i = 0; i < blocks; ++i) {
        std::vector<int32_t> row;
        for (int32_t j = 0; j <= i; ++j) {
          if (j == 0 || rng() % 2 == 0) row.push_back(j);
        }
        rows.push_back(row);
      }
    }
  }
  rows[1 * 7 + 3].clear();  // sequence 0, head 1, query block 3 keeps nothing: output 0
  absl::StatusOr<BlockIndex> index = MakeBlockIndex(p.cu, 2, 64, rows);
  ASSERT_TRUE(index.ok()) << index.status();
  const Result r = RunBoth(p, *index, /*threads=*/1);
  for (const float x : r.out) ASSERT_TRUE(std::isfinite(x));
  ExpectEqualsReference(r, Reference(p, 64, testing::BlockMask::FromIndex(*index)),
                        /*compare_lse=*/false);
}

TEST(AttentionCpuTest, GradientsMatchFiniteDifferences) {
  // loss = sum(out * dout), evaluated in double by the dense reference (which the forward
  // matches to 1e-5); central differences on sampled coordinates of q, k and v.
  const Problem p = MakeProblem({150, 70}, 2, 64, 77);
  const int block_size = 64;
  const BlockIndex index = Select(p, block_size, 0.5, 0);
  const testing::BlockMask mask = testing::BlockMask::FromIndex(index);
  const Result r = RunBoth(p, index);
  auto loss = [&](const std::vector<float>& q, const std::vector<float>& k,
                  const std::vector<float>& v) {
    const testing::DenseResult d =
        testing::DenseAttention(p.cu, p.heads, p.head_dim, block_size, mask, q, k, v, {}, 0.125);
    double sum = 0.0;
    for (size_t i = 0; i < d.out.size(); ++i) sum += d.out[i] * p.dout[i];
    return sum;
  };
  std::mt19937 rng(5);
  const float eps = 1e-2f;  // inputs are O(1); fp32 inputs round the step, so use it exactly
  for (int which = 0; which < 3; ++which) {
    const std::vector<float>& grad = which == 0 ? r.dq : which == 1 ? r.dk : r.dv;
    for (int n = 0; n < 24; ++n) {
      const size_t i = rng() % p.q.size();
      std::vector<float> q = p.q, k = p.k, v = p.v;
      std::vector<float>& x = which == 0 ? q : which == 1 ? k : v;
      const float x0 = x[i];
      x[i] = x0 + eps;
      const double up = loss(q, k, v);
      const double step_up = double{x[i]} - x0;
      x[i] = x0 - eps;
      const double down = loss(q, k, v);
      const double step_down = x0 - double{x[i]};
      const double numeric = (up - down) / (step_up + step_down);
      EXPECT_NEAR(grad[i], numeric, 2e-4 + 1e-3 * std::fabs(numeric))
          << "tensor " << which << " element " << i;
    }
  }
}

TEST(AttentionCpuTest, TimeFollowsActiveBlocksNotLength) {
  // Not a timing assertion: at low density the forward visits only the kept blocks, which the
  // index says; here we check the count the benchmark divides by.
  const Problem p = MakeProblem({4096}, 1, 64, 9);
  const BlockIndex dense = Select(p, 64, 1.0);
  const BlockIndex sparse = Select(p, 64, 0.1);
  EXPECT_EQ(dense.active_blocks(), 64 * 65 / 2);
  EXPECT_LT(sparse.active_blocks() * 5, dense.active_blocks());
}

TEST(AttentionCpuTest, BadInputIsAnErrorNamingTheField) {
  const Problem p = MakeProblem({100, 30}, 2, 64, 3);
  const BlockIndex index = Select(p, 64, 1.0);
  std::vector<float> out(p.q.size()), lse(static_cast<size_t>(p.cu.back()) * 2);
  std::vector<float> short_v(p.v.begin(), p.v.end() - 1);
  AttentionOptions options;
  absl::Status s = AttentionForward(index, 64, p.q, p.k, short_v, options, absl::MakeSpan(out),
                                    absl::MakeSpan(lse));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("v has 16639 elements; expected 16640"));
  s = AttentionForward(index, 128, p.q, p.k, p.v, options, absl::MakeSpan(out),
                       absl::MakeSpan(lse));
  EXPECT_THAT(s.message(), HasSubstr("q has 16640 elements; expected 33280"));
  s = AttentionForward(index, 80, p.q, p.k, p.v, options, absl::MakeSpan(out), absl::MakeSpan(lse));
  EXPECT_THAT(s.message(), HasSubstr("head_dim=80 is not supported"));
  std::vector<float> short_lse(lse.size() + 1);
  s = AttentionForward(index, 64, p.q, p.k, p.v, options, absl::MakeSpan(out),
                       absl::MakeSpan(short_lse));
  EXPECT_THAT(s.message(), HasSubstr("lse has 261 elements; expected 260"));
  BlockIndex broken = index;
  broken.cu_seqlens[1] = 200;
  s = AttentionForward(broken, 64, p.q, p.k, p.v, options, absl::MakeSpan(out),
                       absl::MakeSpan(lse));
  EXPECT_THAT(s.message(), HasSubstr("cu_seqlens[2]=130 is not greater than cu_seqlens[1]=200"));
  std::vector<float> dq(p.q.size()), dk(p.q.size()), dv(p.q.size() + 5);
  s = AttentionBackward(index, 64, p.q, p.k, p.v, out, lse, p.dout, options, absl::MakeSpan(dq),
                        absl::MakeSpan(dk), absl::MakeSpan(dv));
  EXPECT_THAT(s.message(), HasSubstr("dv has 16645 elements"));
  options.softmax_scale = -1.0f;
  s = AttentionForward(index, 64, p.q, p.k, p.v, options, absl::MakeSpan(out), absl::MakeSpan(lse));
  EXPECT_THAT(s.message(), HasSubstr("softmax_scale=-1"));
  options.softmax_scale = 0.0f;
  options.threads = -3;
  s = AttentionForward(index, 64, p.q, p.k, p.v, options, absl::MakeSpan(out), absl::MakeSpan(lse));
  EXPECT_THAT(s.message(), HasSubstr("threads=-3 must be non-negative"));
  s = AttentionBackward(index, 64, p.q, p.k, p.v, out, lse, p.dout, options, absl::MakeSpan(dq),
                        absl::MakeSpan(dk), absl::MakeSpan(dv));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

TEST(AttentionCpuTest, MoreThreadsThanHeadsRunAsManyAsThereAreHeads) {
  // 2 sequences x 2 heads = 4 tasks: INT_MAX threads sized a workspace per thread (bad_alloc,
  // a MemoryError in Python) before the pool was capped at the tasks.
  const Problem p = MakeProblem({100, 30}, 2, 64, 3);
  const BlockIndex index = Select(p, 64, 0.5);
  const Result one = RunBoth(p, index, /*threads=*/1);
  const Result many = RunBoth(p, index, std::numeric_limits<int>::max());
  EXPECT_EQ(many.out, one.out);
  EXPECT_EQ(many.dq, one.dq);
  EXPECT_EQ(many.dk, one.dk);
}

}  // namespace
}  // namespace kernels
}  // namespace sparsebalance
