// The synthetic attention inputs: deterministic per document id, shaped [tokens, heads,
// head_dim], with the structure the recall figures rely on (a sink key that every query
// favours), and varlen batches whose cu_seqlens are the running token counts.
#include "worker/synthetic_inputs.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace sparsebalance {
namespace {

float Dot(const std::vector<float>& a, size_t i, const std::vector<float>& b, size_t j, int d) {
  float sum = 0.0f;
  for (int x = 0; x < d; ++x) sum += a[i + x] * b[j + x];
  return sum;
}

TEST(SyntheticInputsTest, TheSameIdGivesTheSameTensorsAndAnotherIdOthers) {
  const DocumentTensors a = MakeDocument(42, 256, 2, 16);
  const DocumentTensors b = MakeDocument(42, 256, 2, 16);
  const DocumentTensors c = MakeDocument(43, 256, 2, 16);
  ASSERT_EQ(a.q.size(), size_t{256} * 2 * 16);
  EXPECT_EQ(a.k.size(), a.q.size());
  EXPECT_EQ(a.v.size(), a.q.size());
  EXPECT_EQ(a.q, b.q);
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.v, b.v);
  EXPECT_NE(a.q, c.q);
}

TEST(SyntheticInputsTest, EveryQueryScoresTheSinkKeyAboveATypicalKey) {
  constexpr int kHeads = 2, kDim = 32;
  constexpr int64_t kLength = 512;
  const DocumentTensors doc = MakeDocument(7, kLength, kHeads, kDim);
  for (int h = 0; h < kHeads; ++h) {
    int sink_wins = 0, queries = 0;
    for (int64_t t = kLength / 2; t < kLength; t += 7) {
      const size_t q = (static_cast<size_t>(t) * kHeads + h) * kDim;
      const float sink = Dot(doc.q, q, doc.k, static_cast<size_t>(h) * kDim, kDim);
      // A key far from the query (locality favours near ones): half a document back.
      const size_t far = (static_cast<size_t>(t - kLength / 2 + 1) * kHeads + h) * kDim;
      sink_wins += sink > Dot(doc.q, q, doc.k, far, kDim);
      ++queries;
    }
    EXPECT_GT(sink_wins, queries * 9 / 10) << "head " << h;
  }
}

TEST(SyntheticInputsTest, VarlenBatchConcatenatesDocumentsBehindPrefixSums) {
  VarlenBatch batch;
  const DocumentTensors a = MakeDocument(1, 100, 1, 8);
  const DocumentTensors b = MakeDocument(2, 28, 1, 8);
  batch.Append(a, 100);
  batch.Append(b, 28);
  EXPECT_EQ(batch.cu_seqlens, (std::vector<int32_t>{0, 100, 128}));
  ASSERT_EQ(batch.q.size(), size_t{128} * 8);
  EXPECT_TRUE(std::equal(a.k.begin(), a.k.end(), batch.k.begin()));
  EXPECT_TRUE(std::equal(b.v.begin(), b.v.end(), batch.v.begin() + 800));
}

TEST(SyntheticInputsTest, TinyDocumentsHaveNoNeedlesButValidTensors) {
  for (int64_t length : {1, 2, 3}) {
    const DocumentTensors doc = MakeDocument(9, length, 1, 4);
    EXPECT_EQ(doc.q.size(), static_cast<size_t>(length) * 4);
    for (float x : doc.q) EXPECT_TRUE(std::isfinite(x));
  }
}

}  // namespace
}  // namespace sparsebalance
