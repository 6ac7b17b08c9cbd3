// A document split into shards at block-aligned cuts selects exactly the unsplit document's
// blocks, and its merged partial forwards and per-chunk backwards equal the unsplit CPU
// reference (and the dense double-precision definition) within fp32 rounding; bad shard input
// is refused naming the argument.
//
// Tolerance. Both sides run the same tiles on the same (query block, key block) products; they
// differ only in where the softmax is rescaled: the unsplit pass rescales its running sums at
// every kept block, the sharded one once per chunk through the merge (exp of LSE differences,
// in double), and dq, dk, dv are sums over the same terms grouped by chunk and shard. Each
// output element is a weighted sum of at most a few thousand terms bounded by the tensor's
// largest magnitude M, so the two roundings differ by a few hundred fp32 ulps of M in the worst
// case seen (measured: below 2e-6 M); kTolerance = 1e-5 bounds |sharded - unsplit| as a share of
// M (for lse, of max(1, max |lse|)).
#include "kernels/shard_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/attention_cpu.h"
#include "kernels/block_selection.h"
#include "reference.h"

namespace sparsebalance {
namespace kernels {
namespace {

using ::testing::HasSubstr;
using testing::MakeProblem;
using testing::Problem;

constexpr double kTolerance = 1e-5;

struct Unsplit {
  Selection selection;
  std::vector<float> out, lse, dq, dk, dv;
};

Unsplit RunUnsplit(const Problem& p, double density, const SelectionOptions& select,
                   const AttentionOptions& attention) {
  Unsplit u;
  absl::StatusOr<Selection> sel =
      SelectBlocks(p.cu, p.heads, p.head_dim, p.q, p.k, {density}, select);
  EXPECT_TRUE(sel.ok()) << sel.status();
  u.selection = *std::move(sel);
  const size_t n = p.q.size();
  u.out.assign(n, 0.0f);
  u.lse.assign(static_cast<size_t>(p.cu.back()) * p.heads, 0.0f);
  u.dq.assign(n, 0.0f);
  u.dk.assign(n, 0.0f);
  u.dv.assign(n, 0.0f);
  absl::Status s = AttentionForward(u.selection.index, p.head_dim, p.q, p.k, p.v, attention,
                                    absl::MakeSpan(u.out), absl::MakeSpan(u.lse));
  EXPECT_TRUE(s.ok()) << s;
  s = AttentionBackward(u.selection.index, p.head_dim, p.q, p.k, p.v, u.out, u.lse, p.dout,
                        attention, absl::MakeSpan(u.dq), absl::MakeSpan(u.dk),
                        absl::MakeSpan(u.dv));
  EXPECT_TRUE(s.ok()) << s;
  return u;
}

double MaxAbs(const std::vector<float>& x) {
  double m = 0.0;
  for (float v : x) m = std::max(m, std::fabs(double{v}));
  return m;
}

// |got - want| <= kTolerance * max(floor, max |want|) everywhere; returns the worst ratio.
double ExpectClose(const char* name, const std::vector<float>& got, const std::vector<float>& want,
                   double floor = 0.0) {
  EXPECT_EQ(got.size(), want.size()) << name;
  const double scale = std::max(floor, MaxAbs(want));
  const double diff = testing::MaxAbsDiff(got, want);
  EXPECT_LE(diff, kTolerance * scale)
      << name << ": max |diff| " << diff << ", max |unsplit| " << scale;
  return scale > 0.0 ? diff / scale : diff;
}

// Every shard's rows are the unsplit rows of its query blocks: kept blocks and estimated recall.
void ExpectSameSelection(const Selection& unsplit, const ShardedAttentionResult& sharded) {
  const BlockIndex& index = unsplit.index;
  int64_t active = 0;
  for (const ShardSelection& sel : sharded.selections) {
    ASSERT_TRUE(ValidateShardSelection(sel).ok());
    active += sel.active_blocks();
    for (int h = 0; h < sel.heads; ++h) {
      for (int32_t i = sel.first_block(); i < sel.first_block() + sel.query_blocks(); ++i) {
        const int64_t u = index.RowId(0, h, i);
        const int64_t r = sel.Row(h, i);
        const std::vector<int32_t> want(index.col_idx.begin() + index.row_ptr[u],
                                        index.col_idx.begin() + index.row_ptr[u + 1]);
        const std::vector<int32_t> got(sel.col_idx.begin() + sel.row_ptr[r],
                                       sel.col_idx.begin() + sel.row_ptr[r + 1]);
        ASSERT_EQ(got, want) << "head " << h << ", query block " << i;
        ASSERT_EQ(sel.estimated_recall[r], unsplit.estimated_recall[u])
            << "head " << h << ", query block " << i;
      }
    }
  }
  EXPECT_EQ(active, index.active_blocks());
}

struct Tolerances {
  double out = 0, lse = 0, dq = 0, dk = 0, dv = 0;
};

// Runs `p` (one document) sharded at `cuts` and unsplit; selections equal exactly, outputs and
// gradients within kTolerance. Returns the worst relative differences seen.
// `dq_floor` raises the magnitude dq's tolerance is relative to, for inputs whose dq cancels
// far below the size of its terms.
Tolerances ExpectShardedEqualsUnsplit(const Problem& p, const std::vector<int32_t>& cuts,
                                      double density, const SelectionOptions& select,
                                      const AttentionOptions& attention, double dq_floor = 0.0) {
  const Unsplit u = RunUnsplit(p, density, select, attention);
  absl::StatusOr<ShardedAttentionResult> r = ShardedAttentionReference(
      cuts, p.heads, p.head_dim, p.q, p.k, p.v, p.dout, density, select, attention);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return {};
  ExpectSameSelection(u.selection, *r);
  Tolerances t;
  t.out = ExpectClose("out", r->out, u.out);
  t.lse = ExpectClose("lse", r->lse, u.lse, /*floor=*/1.0);
  t.dq = ExpectClose("dq", r->dq, u.dq, dq_floor);
  t.dk = ExpectClose("dk", r->dk, u.dk);
  t.dv = ExpectClose("dv", r->dv, u.dv);
  EXPECT_LE(r->needed_exchange_bytes, r->prefix_exchange_bytes);
  return t;
}

// Block-aligned cuts of `length` tokens into `shards` nearly equal shards.
std::vector<int32_t> EvenCuts(int32_t length, int shards, int block_size) {
  const int32_t blocks = (length + block_size - 1) / block_size;
  std::vector<int32_t> cuts = {0};
  for (int j = 1; j < shards; ++j) cuts.push_back(blocks * j / shards * block_size);
  cuts.push_back(length);
  return cuts;
}

SelectionOptions Select(int block_size, SelectionMode mode = SelectionMode::kTopK) {
  SelectionOptions o;
  o.block_size = block_size;
  o.mode = mode;
  o.threads = 2;
  return o;
}

AttentionOptions Attention() {
  AttentionOptions o;
  o.threads = 2;
  return o;
}

TEST(ShardAttentionTest, ShardedEqualsUnsplitAcrossShapesDensitiesAndModes) {
  struct Case {
    int32_t length;
    int shards;
    int block_size;
    int head_dim;
  };
  // Lengths that are not multiples of the block size; 2, 3 and 4 shards.
  const Case cases[] = {{1000, 4, 64, 64},
                        {1100, 3, 128, 128},
                        {777, 2, 64, 128},
                        {1300, 4, 128, 64},
                        {1024, 4, 64, 128}};
  Tolerances worst;
  for (const Case& c : cases) {
    const Problem p = MakeProblem({c.length}, 2, c.head_dim, 7 + c.length);
    const std::vector<int32_t> cuts = EvenCuts(c.length, c.shards, c.block_size);
    for (double density : {1.0, 0.3, 0.1}) {
      for (SelectionMode mode : {SelectionMode::kTopK, SelectionMode::kAnchor}) {
        SCOPED_TRACE(::testing::Message()
                     << "length " << c.length << ", shards " << c.shards << ", block "
                     << c.block_size << ", head_dim " << c.head_dim << ", density " << density
                     << ", mode " << static_cast<int>(mode));
        const Tolerances t =
            ExpectShardedEqualsUnsplit(p, cuts, density, Select(c.block_size, mode), Attention());
        worst.out = std::max(worst.out, t.out);
        worst.lse = std::max(worst.lse, t.lse);
        worst.dq = std::max(worst.dq, t.dq);
        worst.dk = std::max(worst.dk, t.dk);
        worst.dv = std::max(worst.dv, t.dv);
      }
    }
  }
  std::cout << "worst |sharded - unsplit| / max|unsplit|: out " << worst.out << ", lse "
            << worst.lse << ", dq " << worst.dq << ", dk " << worst.dk << ", dv " << worst.dv
            << "\n";
}

TEST(ShardAttentionTest, UnevenCutsAndOneBlockShards) {
  const Problem p = MakeProblem({1000}, 3, 64, 31);
  for (const std::vector<int32_t>& cuts :
       {std::vector<int32_t>{0, 64, 896, 1000}, std::vector<int32_t>{0, 832, 896, 960, 1000},
        std::vector<int32_t>{0, 64, 128, 192, 1000}}) {
    for (double density : {1.0, 0.3}) {
      SCOPED_TRACE(::testing::Message() << "cuts[1] " << cuts[1] << ", density " << density);
      ExpectShardedEqualsUnsplit(p, cuts, density, Select(64), Attention());
    }
  }
}

TEST(ShardAttentionTest, MassThresholdAndWiderLocalWindow) {
  const Problem p = MakeProblem({1500}, 2, 64, 41);
  SelectionOptions select = Select(64);
  select.mass_threshold = 0.8;
  select.local_blocks = 3;
  ExpectShardedEqualsUnsplit(p, EvenCuts(1500, 4, 64), 0.3, select, Attention());
}

// A sharp softmax whose mass sits on needle keys in the first shard: the last shard's queries
// must find them through the gathered pooled keys, and the merge must carry a partial whose LSE
// dwarfs the others.
TEST(ShardAttentionTest, SharpSoftmaxWithNeedleKeysFarBack) {
  for (int head_dim : {64, 128}) {
    for (int block_size : {64, 128}) {
      const int32_t length = 2000;
      const int heads = 2;
      Problem p = MakeProblem({length}, heads, head_dim, 53 + head_dim + block_size);
      const int64_t stride = int64_t{heads} * head_dim;
      const std::vector<int32_t> cuts = EvenCuts(length, 4, block_size);
      const int32_t needle_block = 1;
      for (int h = 0; h < heads; ++h) {
        // Direction u: alternating signs; needle keys along u, the last shard's queries too.
        for (int32_t t = needle_block * block_size; t < (needle_block + 1) * block_size; ++t) {
          for (int d = 0; d < head_dim; ++d) {
            p.k[t * stride + h * head_dim + d] = (d % 2 == 0 ? 6.0f : -6.0f);
          }
        }
        for (int32_t t = cuts[3]; t < length; ++t) {
          for (int d = 0; d < head_dim; ++d) {
            p.q[t * stride + h * head_dim + d] += (d % 2 == 0 ? 1.0f : -1.0f);
          }
        }
      }
      SCOPED_TRACE(::testing::Message() << "head_dim " << head_dim << ", block " << block_size);
      for (double density : {0.3, 0.1}) {
        for (SelectionMode mode : {SelectionMode::kTopK, SelectionMode::kAnchor}) {
          const SelectionOptions select = Select(block_size, mode);
          ExpectShardedEqualsUnsplit(p, cuts, density, select, Attention());
          // At density 0.3 the last shard's rows hold one block beyond their anchors (at 0.1
          // none): every one of them keeps the needle block.
          if (density < 0.3) continue;
          absl::StatusOr<ShardedAttentionResult> r = ShardedAttentionReference(
              cuts, heads, head_dim, p.q, p.k, p.v, {}, density, select, Attention());
          ASSERT_TRUE(r.ok()) << r.status();
          const ShardSelection& last = r->selections.back();
          for (int64_t row = 0; row < last.rows(); ++row) {
            EXPECT_TRUE(std::binary_search(last.col_idx.begin() + last.row_ptr[row],
                                           last.col_idx.begin() + last.row_ptr[row + 1],
                                           needle_block))
                << "row " << row;
          }
          // Logits near 6 * sqrt(head_dim): the needle holds nearly all the mass.
          EXPECT_GT(r->lse[length - 1], 20.0f);
        }
      }
    }
  }
}

// The sharded result equals the dense double-precision definition under the unsplit block mask
// too, so a masking error that both paths shared would still fail.
TEST(ShardAttentionTest, ShardedEqualsDenseDefinition) {
  for (int block_size : {64, 128}) {
    const Problem p = MakeProblem({700}, 2, 64, 61 + block_size);
    const std::vector<int32_t> cuts = EvenCuts(700, 3, block_size);
    const Unsplit u = RunUnsplit(p, 0.3, Select(block_size), Attention());
    const testing::DenseResult dense = testing::DenseAttention(
        p.cu, p.heads, p.head_dim, block_size, testing::BlockMask::FromIndex(u.selection.index),
        p.q, p.k, p.v, p.dout, 1.0 / std::sqrt(64.0f));
    absl::StatusOr<ShardedAttentionResult> r = ShardedAttentionReference(
        cuts, p.heads, p.head_dim, p.q, p.k, p.v, p.dout, 0.3, Select(block_size), Attention());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_LE(testing::MaxAbsDiff(r->out, dense.out), 1e-5);
    EXPECT_LE(testing::MaxAbsDiff(r->lse, dense.lse), 1e-5);
    EXPECT_LE(testing::MaxAbsDiff(r->dq, dense.dq), 1e-4);
    EXPECT_LE(testing::MaxAbsDiff(r->dk, dense.dk), 1e-4);
    EXPECT_LE(testing::MaxAbsDiff(r->dv, dense.dv), 1e-4);
  }
}

TEST(ShardAttentionTest, PooledKeysOfTheShardsConcatenateToTheDocumentsPooling) {
  const int32_t length = 1000;
  const Problem p = MakeProblem({length}, 3, 64, 71);
  const std::vector<int32_t> cuts = {0, 128, 512, 1000};
  const int64_t stride = 3 * 64;
  std::vector<float> gathered;
  for (size_t j = 0; j + 1 < cuts.size(); ++j) {
    absl::StatusOr<std::vector<float>> pooled = PoolKeyBlocks(
        cuts[j + 1] - cuts[j], 3, 64, 64,
        absl::MakeConstSpan(p.k.data() + cuts[j] * stride, (cuts[j + 1] - cuts[j]) * stride));
    ASSERT_TRUE(pooled.ok()) << pooled.status();
    gathered.insert(gathered.end(), pooled->begin(), pooled->end());
  }
  absl::StatusOr<std::vector<float>> whole = PoolKeyBlocks(length, 3, 64, 64, p.k);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(gathered, *whole);  // bit for bit
  ASSERT_EQ(whole->size(), static_cast<size_t>(16 * stride));
  // Block 15 holds tokens 960..999 (40 tokens): its mean, head 2, dim 5.
  double sum = 0.0;
  for (int32_t t = 960; t < length; ++t) sum += p.k[t * stride + 2 * 64 + 5];
  EXPECT_NEAR((*whole)[15 * stride + 2 * 64 + 5], sum / 40, 1e-6);
}

// A chunk's forward leaves rows that keep none of its blocks at out 0, LSE -inf, and merging
// the chunks in any order gives the same result.
TEST(ShardAttentionTest, PartialsOfChunksAndTheirMerge) {
  const int32_t length = 1024;
  const int heads = 2, head_dim = 64, block_size = 64;
  const Problem p = MakeProblem({length}, heads, head_dim, 83);
  const int64_t stride = int64_t{heads} * head_dim;
  const std::vector<int32_t> cuts = {0, 256, 512, 768, 1024};
  const Unsplit u = RunUnsplit(p, 0.1, Select(block_size), Attention());
  absl::StatusOr<ShardedAttentionResult> r = ShardedAttentionReference(
      cuts, heads, head_dim, p.q, p.k, p.v, {}, 0.1, Select(block_size), Attention());
  ASSERT_TRUE(r.ok()) << r.status();
  const ShardSelection& sel = r->selections[3];
  const int32_t tokens = sel.tokens();
  auto span = [&](const std::vector<float>& x, int32_t begin, int32_t end) {
    return absl::MakeConstSpan(x.data() + begin * stride, (end - begin) * stride);
  };
  const auto q = span(p.q, cuts[3], cuts[4]);
  std::vector<std::vector<float>> outs(4), lses(4);
  for (int o = 0; o < 4; ++o) {
    outs[o].assign(q.size(), 1.0f);
    lses[o].assign(static_cast<size_t>(tokens) * heads, 1.0f);
    ASSERT_TRUE(ShardForwardChunk(sel, head_dim, q, cuts[o], cuts[o + 1],
                                  span(p.k, cuts[o], cuts[o + 1]), span(p.v, cuts[o], cuts[o + 1]),
                                  Attention(), absl::MakeSpan(outs[o]), absl::MakeSpan(lses[o]))
                    .ok());
  }
  // Rows of the last shard that keep no block of chunk 1 (at density 0.1 most keep only the
  // sink, the diagonal, the block before it and a few top blocks).
  int empty_rows = 0;
  for (int h = 0; h < heads; ++h) {
    for (int32_t i = sel.first_block(); i < sel.first_block() + sel.query_blocks(); ++i) {
      const int64_t row = sel.Row(h, i);
      const bool keeps = std::any_of(
          sel.col_idx.begin() + sel.row_ptr[row], sel.col_idx.begin() + sel.row_ptr[row + 1],
          [&](int32_t j) { return j * block_size >= cuts[1] && j * block_size < cuts[2]; });
      if (keeps) continue;
      ++empty_rows;
      for (int32_t t = (i - sel.first_block()) * block_size;
           t < std::min(tokens, (i - sel.first_block() + 1) * block_size); ++t) {
        EXPECT_EQ(lses[1][h * tokens + t], -INFINITY);
        for (int d = 0; d < head_dim; ++d) EXPECT_EQ(outs[1][t * stride + h * head_dim + d], 0.0f);
      }
    }
  }
  EXPECT_GT(empty_rows, 0);
  for (const std::vector<int>& order :
       {std::vector<int>{0, 1, 2, 3}, std::vector<int>{3, 1, 0, 2}}) {
    std::vector<float> out(q.size(), 0.0f);
    std::vector<float> lse(static_cast<size_t>(tokens) * heads, -INFINITY);
    for (int o : order) {
      ASSERT_TRUE(MergeAttentionPartial(tokens, heads, head_dim, outs[o], lses[o],
                                        absl::MakeSpan(out), absl::MakeSpan(lse))
                      .ok());
    }
    const std::vector<float> want_out(u.out.begin() + cuts[3] * stride, u.out.end());
    EXPECT_LE(testing::MaxAbsDiff(out, want_out), kTolerance * MaxAbs(want_out));
    for (int h = 0; h < heads; ++h) {
      for (int32_t t = 0; t < tokens; ++t) {
        EXPECT_NEAR(lse[h * tokens + t], u.lse[h * length + cuts[3] + t], kTolerance * 10);
      }
    }
  }
}

// The blocks an owner sends are the union of the shard's kept blocks in its chunk, and never
// more bytes than the whole prefix (the whole prefix at density 1).
TEST(ShardAttentionTest, NeededKeyBlocksAreTheUnionOfKeptBlocks) {
  const int32_t length = 4096;
  const int heads = 4, head_dim = 64, block_size = 64;
  const Problem p = MakeProblem({length}, heads, head_dim, 97);
  const std::vector<int32_t> cuts = EvenCuts(length, 4, block_size);
  for (double density : {1.0, 0.3, 0.1}) {
    absl::StatusOr<ShardedAttentionResult> r = ShardedAttentionReference(
        cuts, heads, head_dim, p.q, p.k, p.v, {}, density, Select(block_size), Attention());
    ASSERT_TRUE(r.ok()) << r.status();
    for (int j = 1; j < 4; ++j) {
      const ShardSelection& sel = r->selections[j];
      for (int o = 0; o < j; ++o) {
        std::vector<char> kept(length / block_size, 0);
        for (int32_t b : sel.col_idx) kept[b] = 1;
        std::vector<int32_t> want;
        for (int32_t b = cuts[o] / block_size; b < cuts[o + 1] / block_size; ++b) {
          if (kept[b]) want.push_back(b);
        }
        absl::StatusOr<std::vector<int32_t>> got = NeededKeyBlocks(sel, cuts[o], cuts[o + 1]);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_EQ(*got, want) << "shard " << j << ", owner " << o;
      }
    }
    if (density == 1.0) {
      EXPECT_EQ(r->needed_exchange_bytes, r->prefix_exchange_bytes);
    } else {
      EXPECT_LE(r->needed_exchange_bytes, r->prefix_exchange_bytes);
    }
    std::cout << "random q, k: 4096 tokens, 4 shards, 4 heads x 64, top-k, density " << density
              << ": key/value bytes received " << r->needed_exchange_bytes << " of "
              << r->prefix_exchange_bytes << " (whole prefix), "
              << 100.0 * r->needed_exchange_bytes / r->prefix_exchange_bytes << "%\n";
  }
}

// Attention concentrated on a few heavy key blocks (the sink and one block per owner), selected
// with anchor-guided thresholding: every row keeps its anchors and the heavy blocks only, so
// each owner sends a block or two instead of its whole chunk.
TEST(ShardAttentionTest, ConcentratedAttentionShrinksTheExchange) {
  const int32_t length = 4096;
  const int heads = 4, head_dim = 64, block_size = 64;
  Problem p = MakeProblem({length}, heads, head_dim, 99);
  const int64_t stride = int64_t{heads} * head_dim;
  const std::vector<int32_t> cuts = EvenCuts(length, 4, block_size);
  std::vector<int32_t> heavy = {0};
  for (int o = 0; o < 4; ++o) heavy.push_back(cuts[o] / block_size + 3);
  for (int h = 0; h < heads; ++h) {
    for (int32_t b : heavy) {
      for (int32_t t = b * block_size; t < (b + 1) * block_size; ++t) {
        for (int d = 0; d < head_dim; ++d) p.k[t * stride + h * head_dim + d] = 6.0f;
      }
    }
    for (int32_t t = 0; t < length; ++t) {
      for (int d = 0; d < head_dim; ++d) p.q[t * stride + h * head_dim + d] += 1.0f;
    }
  }
  // Every row's mass sits on identical heavy keys k_u, so dq = scale * sum_u P_u (dP_u - delta)
  // k_u cancels to ~1e-7 while its terms are O(scale * max|k|): dq's tolerance is relative to
  // that.
  const double dq_floor = 6.0 / std::sqrt(64.0);
  for (double density : {0.3, 0.1}) {
    const SelectionOptions select = Select(block_size, SelectionMode::kAnchor);
    ExpectShardedEqualsUnsplit(p, cuts, density, select, Attention(), dq_floor);
    absl::StatusOr<ShardedAttentionResult> r = ShardedAttentionReference(
        cuts, heads, head_dim, p.q, p.k, p.v, {}, density, select, Attention());
    ASSERT_TRUE(r.ok()) << r.status();
    // Shard 3 needs from owner 0 the sink and owner 0's heavy block, nothing else.
    absl::StatusOr<std::vector<int32_t>> from_first = NeededKeyBlocks(r->selections[3], 0, cuts[1]);
    ASSERT_TRUE(from_first.ok());
    EXPECT_EQ(*from_first, (std::vector<int32_t>{0, heavy[1]}));
    EXPECT_LT(r->needed_exchange_bytes * 4, r->prefix_exchange_bytes);
    std::cout << "concentrated q, k: 4096 tokens, 4 shards, 4 heads x 64, anchor, density "
              << density << ": key/value bytes received " << r->needed_exchange_bytes << " of "
              << r->prefix_exchange_bytes << " (whole prefix), "
              << 100.0 * r->needed_exchange_bytes / r->prefix_exchange_bytes << "%\n";
  }
}

TEST(ShardAttentionTest, BadInputIsRefusedNamingTheArgument) {
  const int32_t length = 1000;
  const int heads = 2, head_dim = 64;
  const Problem p = MakeProblem({length}, heads, head_dim, 101);
  const int64_t stride = int64_t{heads} * head_dim;
  auto expect_invalid = [](const absl::Status& s, const char* text) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(text));
  };
  // Cuts off the block grid, not increasing, not ending at the document's end.
  expect_invalid(ValidateCuts({0, 100, 1000}, length, 64), "cuts[1]=100");
  expect_invalid(ValidateCuts({0, 512, 512, 1000}, length, 64), "cuts[2]=512");
  expect_invalid(ValidateCuts({0, 512, 900}, length, 64), "cuts[2]=900");
  expect_invalid(ValidateCuts({64, 512, 1000}, length, 64), "cuts[0]=64");
  expect_invalid(ShardedAttentionReference({0, 100, 1000}, heads, head_dim, p.q, p.k, p.v, p.dout,
                                           0.3, Select(64), Attention())
                     .status(),
                 "cuts[1]=100");
  expect_invalid(ShardedAttentionReference({0, 512, 1000}, heads, head_dim, p.q, p.k,
                                           absl::MakeConstSpan(p.v.data(), p.v.size() - 1), p.dout,
                                           0.3, Select(64), Attention())
                     .status(),
                 "v has");

  // A shard outside the document or off the block grid.
  const auto q_shard = absl::MakeConstSpan(p.q.data() + 512 * stride, 488 * stride);
  absl::StatusOr<std::vector<float>> pooled = PoolKeyBlocks(length, heads, head_dim, 64, p.k);
  ASSERT_TRUE(pooled.ok());
  expect_invalid(
      SelectShardBlocks(length, 1024, 1100, heads, head_dim, q_shard, *pooled, 0.3, Select(64))
          .status(),
      "shard_begin=1024");
  expect_invalid(
      SelectShardBlocks(length, 500, 1000, heads, head_dim, q_shard, *pooled, 0.3, Select(64))
          .status(),
      "shard_begin=500");
  expect_invalid(
      SelectShardBlocks(length, 512, 1001, heads, head_dim, q_shard, *pooled, 0.3, Select(64))
          .status(),
      "shard_end=1001");
  expect_invalid(
      SelectShardBlocks(length, 512, 1000, heads, head_dim, q_shard, *pooled, 1.5, Select(64))
          .status(),
      "density=1.5");
  // Wrong tensor sizes.
  expect_invalid(SelectShardBlocks(length, 512, 1000, heads, head_dim,
                                   absl::MakeConstSpan(q_shard.data(), q_shard.size() - 1), *pooled,
                                   0.3, Select(64))
                     .status(),
                 "q has");
  expect_invalid(SelectShardBlocks(length, 512, 1000, heads, head_dim, q_shard,
                                   absl::MakeConstSpan(pooled->data(), 8 * stride), 0.3, Select(64))
                     .status(),
                 "pooled_k has");
  expect_invalid(PoolKeyBlocks(100, heads, head_dim, 64, p.k).status(), "k has");

  absl::StatusOr<ShardSelection> sel =
      SelectShardBlocks(length, 512, 1000, heads, head_dim, q_shard, *pooled, 0.3, Select(64));
  ASSERT_TRUE(sel.ok()) << sel.status();
  const auto chunk = [&](int32_t begin, int32_t end) {
    return absl::MakeConstSpan(p.k.data() + begin * stride, (end - begin) * stride);
  };
  std::vector<float> out(q_shard.size()), lse(488 * heads);
  // Chunks off the grid, beyond the shard's keys, or with the wrong size.
  expect_invalid(
      ShardForwardChunk(*sel, head_dim, q_shard, 100, 512, chunk(100, 512), chunk(100, 512),
                        Attention(), absl::MakeSpan(out), absl::MakeSpan(lse)),
      "chunk_begin=100");
  expect_invalid(ShardForwardChunk(*sel, head_dim, q_shard, 0, 500, chunk(0, 500), chunk(0, 500),
                                   Attention(), absl::MakeSpan(out), absl::MakeSpan(lse)),
                 "chunk_end=500");
  expect_invalid(NeededKeyBlocks(*sel, 512, 1100).status(), "chunk_end=1100");
  expect_invalid(ShardForwardChunk(*sel, head_dim, q_shard, 0, 256, chunk(0, 512), chunk(0, 256),
                                   Attention(), absl::MakeSpan(out), absl::MakeSpan(lse)),
                 "k_chunk has");
  expect_invalid(
      ShardForwardChunk(*sel, head_dim, q_shard, 0, 256, chunk(0, 256), chunk(0, 256), Attention(),
                        absl::MakeSpan(out.data(), 10), absl::MakeSpan(lse)),
      "out has");
  std::vector<float> dq(q_shard.size()), dk(256 * stride), dv(256 * stride);
  const auto dout = absl::MakeConstSpan(p.dout.data() + 512 * stride, 488 * stride);
  expect_invalid(ShardBackwardChunk(*sel, head_dim, q_shard, 0, 256, chunk(0, 256), chunk(0, 256),
                                    out, lse, dout, Attention(), absl::MakeSpan(dq),
                                    absl::MakeSpan(dk.data(), 100), absl::MakeSpan(dv)),
                 "dk_chunk has");
  expect_invalid(
      MergeAttentionPartial(488, heads, head_dim, out, absl::MakeConstSpan(lse.data(), 3),
                            absl::MakeSpan(out), absl::MakeSpan(lse)),
      "lse_part has");
  // A negative thread count (it meant every core, as 0 does, where the other kernels refuse it).
  AttentionOptions negative = Attention();
  negative.threads = -1;
  expect_invalid(ShardForwardChunk(*sel, head_dim, q_shard, 0, 256, chunk(0, 256), chunk(0, 256),
                                   negative, absl::MakeSpan(out), absl::MakeSpan(lse)),
                 "threads=-1 must be non-negative");
  // A NaN in the shard's queries: its rows' block scores are NaN, and the selection is refused
  // naming the first (SelectRow's estimate read 1.0 before).
  std::vector<float> q_nan(q_shard.begin(), q_shard.end());
  q_nan[static_cast<size_t>(200) * stride + head_dim + 3] = std::nanf("");  // head 1, block 11
  expect_invalid(
      SelectShardBlocks(length, 512, 1000, heads, head_dim, q_nan, *pooled, 0.3, Select(64))
          .status(),
      "sequence 0, head 1, query block 11 are NaN");
  // A selection edited out of shape.
  ShardSelection broken = *sel;
  broken.col_idx[broken.row_ptr[1] - 1] = 100;  // beyond query block 8 of row (0, 8)
  expect_invalid(ValidateShardSelection(broken), "selection.col_idx");
}

}  // namespace
}  // namespace kernels
}  // namespace sparsebalance
