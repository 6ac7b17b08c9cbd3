#include "planner/traces.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/random.h"
#include "planner/types.h"

namespace sparsebalance {
namespace {

using ::testing::HasSubstr;

constexpr int kDraws = 200000;

std::vector<int64_t> DrawLengths(absl::string_view name, uint64_t seed, int count) {
  absl::StatusOr<TraceGenerator> gen = TraceGenerator::Builtin(name, seed);
  EXPECT_TRUE(gen.ok()) << gen.status();
  std::vector<int64_t> lengths;
  lengths.reserve(count);
  for (int i = 0; i < count; ++i) lengths.push_back(gen->Next().length);
  return lengths;
}

// The empirical q-quantile of `sorted` (ascending).
double Quantile(const std::vector<int64_t>& sorted, double q) {
  return static_cast<double>(sorted[static_cast<size_t>(q * (sorted.size() - 1))]);
}

struct PercentileTarget {
  double q;
  double tokens;
};

void ExpectPercentiles(absl::string_view name, const std::vector<PercentileTarget>& targets,
                       int64_t cap) {
  std::vector<int64_t> lengths = DrawLengths(name, /*seed=*/7, kDraws);
  std::sort(lengths.begin(), lengths.end());
  for (const PercentileTarget& target : targets) {
    EXPECT_NEAR(Quantile(lengths, target.q), target.tokens, 0.1 * target.tokens)
        << name << " quantile " << target.q;
  }
  EXPECT_GE(lengths.front(), 1);
  EXPECT_LE(lengths.back(), cap) << name;
  // The tail reaches close to the cap, so the cap is the real maximum, not an unused bound.
  EXPECT_GT(lengths.back(), cap / 2) << name;
}

TEST(BuiltinTraceTest, PretrainPercentilesMatchTargets) {
  ExpectPercentiles("pretrain", {{0.5, 3200}, {0.9, 5800}, {0.99, 26000}, {0.999, 120000}},
                    /*cap=*/131072);
}

TEST(BuiltinTraceTest, ProlongPercentilesMatchTargets) {
  ExpectPercentiles("prolong", {{0.5, 1900}, {0.9, 6000}, {0.99, 16000}, {0.999, 47000}},
                    /*cap=*/340000);
}

TEST(BuiltinTraceTest, PretrainLongDocumentsHoldTheirShareOfTokensAndCost) {
  const std::vector<int64_t> lengths = DrawLengths("pretrain", /*seed=*/11, kDraws);
  int64_t long_documents = 0;
  double tokens = 0.0;
  double long_tokens = 0.0;
  double squares = 0.0;  // sum of L^2, tokens^2
  double long_squares = 0.0;
  for (int64_t length : lengths) {
    const double l = static_cast<double>(length);
    tokens += l;
    squares += l * l;
    if (length > 8192) {
      ++long_documents;
      long_tokens += l;
      long_squares += l * l;
    }
  }
  EXPECT_NEAR(static_cast<double>(long_documents) / kDraws, 0.024, 0.003);
  EXPECT_NEAR(long_tokens / tokens, 0.22, 0.03);
  EXPECT_NEAR(long_squares / squares, 0.80, 0.03);
}

TEST(BuiltinTraceTest, UnknownNameIsRejectedWithTheKnownNames) {
  absl::StatusOr<TraceGenerator> gen = TraceGenerator::Builtin("c4", 1);
  ASSERT_FALSE(gen.ok());
  EXPECT_EQ(gen.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(gen.status().message()), HasSubstr("pretrain, prolong"));
}

TEST(BuiltinTraceTest, SameSeedGivesSameSequenceAndOtherSeedDiffers) {
  for (const std::string& name : BuiltinTraceNames()) {
    absl::StatusOr<TraceGenerator> a = TraceGenerator::Builtin(name, 42);
    absl::StatusOr<TraceGenerator> b = TraceGenerator::Builtin(name, 42);
    absl::StatusOr<TraceGenerator> c = TraceGenerator::Builtin(name, 43);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    int differing = 0;
    for (uint64_t i = 0; i < 1000; ++i) {
      const Sample sa = a->Next();
      const Sample sb = b->Next();
      const Sample sc = c->Next();
      EXPECT_EQ(sa.id, i);
      EXPECT_EQ(sa.length, sb.length);
      EXPECT_EQ(sa.sensitivity, sb.sensitivity);
      if (sa.length != sc.length || sa.sensitivity != sc.sensitivity) ++differing;
    }
    EXPECT_GT(differing, 900) << name;
  }
}

TEST(DrawSensitivityTest, BetaOneEightMeanAndRange) {
  Rng rng(3);
  double sum = 0.0;
  int above = 0;
  for (int i = 0; i < kDraws; ++i) {
    const double s = DrawSensitivity(rng);
    ASSERT_GE(s, 0.0);
    ASSERT_LE(s, 1.0);
    sum += s;
    if (s > 0.26) ++above;
  }
  EXPECT_NEAR(sum / kDraws, 1.0 / 9.0, 0.002);
  // P(s > 0.26) = 0.74^8 = 0.090.
  EXPECT_NEAR(static_cast<double>(above) / kDraws, 0.090, 0.005);
}

TEST(ParseTraceFileTest, ReadsAllFieldFormsAndSkipsCommentsAndBlankLines) {
  absl::StatusOr<std::vector<TraceRecord>> records = ParseTraceFile(
      "# length [sensitivity] [segments]\n"
      "\n"
      "4096\n"
      "  2048 0.25  \n"
      "\t# indented comment\n"
      "300 100:200\n"
      "120 1 20:100\r\n");
  ASSERT_TRUE(records.ok()) << records.status();
  ASSERT_EQ(records->size(), 4u);
  EXPECT_EQ((*records)[0].length, 4096);
  EXPECT_LT((*records)[0].sensitivity, 0.0);
  EXPECT_TRUE((*records)[0].segments.empty());
  EXPECT_EQ((*records)[1].length, 2048);
  EXPECT_EQ((*records)[1].sensitivity, 0.25);
  EXPECT_EQ((*records)[2].length, 300);
  EXPECT_LT((*records)[2].sensitivity, 0.0);
  EXPECT_EQ((*records)[2].segments, (std::vector<int64_t>{100, 200}));
  EXPECT_EQ((*records)[3].length, 120);
  EXPECT_EQ((*records)[3].sensitivity, 1.0);
  EXPECT_EQ((*records)[3].segments, (std::vector<int64_t>{20, 100}));
}

// The error for `text`, which must fail with INVALID_ARGUMENT.
std::string ParseError(absl::string_view text) {
  absl::StatusOr<std::vector<TraceRecord>> records = ParseTraceFile(text);
  EXPECT_FALSE(records.ok());
  if (records.ok()) return "";
  EXPECT_EQ(records.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(records.status().message());
}

TEST(ParseTraceFileTest, ErrorsNameTheLineAndTheField) {
  const std::string good = "# header\n100\n\n200 0.5\n";  // lines 1-4
  EXPECT_THAT(ParseError(good + "100\n\nabc\n"),
              HasSubstr("trace line 7: length \"abc\" is not a positive integer"));
  EXPECT_THAT(ParseError(good + "0\n"),
              HasSubstr("trace line 5: length \"0\" is not a positive integer"));
  EXPECT_THAT(ParseError("1\n2\n300 1.5\n"),
              HasSubstr("trace line 3: sensitivity 1.5 is outside [0, 1]"));
  EXPECT_THAT(ParseError("300 -0.1 100:200\n"),
              HasSubstr("trace line 1: sensitivity -0.1 is outside [0, 1]"));
  EXPECT_THAT(ParseError("300 high\n"), HasSubstr("trace line 1: sensitivity \"high\""));
  EXPECT_THAT(ParseError("1\n2\n3\n120 0.5 40:60\n"),
              HasSubstr("trace line 4: segments sum to 100 but length is 120"));
  EXPECT_THAT(ParseError("1\n120 0:120\n"),
              HasSubstr("trace line 2: segment \"0\" is not a positive integer"));
  EXPECT_THAT(ParseError("120 60::60\n"),
              HasSubstr("trace line 1: segment \"\" is not a positive integer"));
  EXPECT_THAT(ParseError("120 0.5 60:-60\n"),
              HasSubstr("trace line 1: segment \"-60\" is not a positive integer"));
  EXPECT_THAT(ParseError("120 0.5 60:60 extra\n"), HasSubstr("trace line 1: 4 fields"));
  EXPECT_THAT(ParseError(""), HasSubstr("trace file has no documents"));
  EXPECT_THAT(ParseError("# only a comment\n\n"), HasSubstr("trace file has no documents"));
}

TEST(FromRecordsTest, RejectsEmptyAndInvalidRecords) {
  absl::StatusOr<TraceGenerator> empty = TraceGenerator::FromRecords({}, 1);
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(empty.status().message()), HasSubstr("no documents"));

  TraceRecord good;
  good.length = 10;
  TraceRecord bad;
  bad.length = 120;
  bad.segments = {40, 60};
  absl::StatusOr<TraceGenerator> gen = TraceGenerator::FromRecords({good, bad}, 1);
  ASSERT_FALSE(gen.ok());
  EXPECT_THAT(std::string(gen.status().message()),
              HasSubstr("trace record 2: segments sum to 100 but length is 120"));
}

TEST(FromRecordsTest, CyclesInOrderAndDrawsOnlyMissingSensitivities) {
  std::vector<TraceRecord> records(3);
  records[0].length = 100;
  records[0].sensitivity = 0.7;
  records[1].length = 50;  // no sensitivity: drawn
  records[2].length = 30;
  records[2].sensitivity = 0.0;
  records[2].segments = {10, 20};
  absl::StatusOr<TraceGenerator> gen = TraceGenerator::FromRecords(records, 5);
  ASSERT_TRUE(gen.ok()) << gen.status();
  std::vector<double> drawn;
  for (uint64_t i = 0; i < 9; ++i) {
    const Sample sample = gen->Next();
    const TraceRecord& record = records[i % 3];
    EXPECT_EQ(sample.id, i);
    EXPECT_EQ(sample.length, record.length);
    EXPECT_EQ(sample.segments, record.segments);
    if (record.sensitivity >= 0.0) {
      EXPECT_EQ(sample.sensitivity, record.sensitivity);
    } else {
      EXPECT_GE(sample.sensitivity, 0.0);
      EXPECT_LE(sample.sensitivity, 1.0);
      drawn.push_back(sample.sensitivity);
    }
  }
  // Each pass draws afresh rather than repeating one value.
  ASSERT_EQ(drawn.size(), 3u);
  EXPECT_NE(drawn[0], drawn[1]);
}

TEST(PackingTest, SequencesAreFullAndReproduceTheDocumentStream) {
  constexpr int64_t kPack = 32768;
  for (const std::string& name : BuiltinTraceNames()) {
    absl::StatusOr<TraceGenerator> packed = TraceGenerator::Builtin(name, 9);
    absl::StatusOr<TraceGenerator> plain = TraceGenerator::Builtin(name, 9);
    ASSERT_TRUE(packed.ok() && plain.ok());
    packed->SetPackLength(kPack);

    // Every piece, with whether it opens / closes its sequence.
    struct Piece {
      int64_t tokens;
      bool first;
      bool last;
    };
    std::vector<Piece> pieces;
    for (uint64_t i = 0; i < 2000; ++i) {
      const Sample sample = packed->Next();
      ASSERT_EQ(sample.id, i);
      ASSERT_EQ(sample.length, kPack);
      ASSERT_FALSE(sample.segments.empty());
      int64_t sum = 0;
      for (size_t j = 0; j < sample.segments.size(); ++j) {
        ASSERT_GT(sample.segments[j], 0);
        sum += sample.segments[j];
        pieces.push_back({sample.segments[j], j == 0, j + 1 == sample.segments.size()});
      }
      ASSERT_EQ(sum, kPack);
      ASSERT_GE(sample.sensitivity, 0.0);
      ASSERT_LE(sample.sensitivity, 1.0);
    }

    // Walk the unpacked documents: each is one piece, or pieces split only at sequence ends
    // and continued as the first piece of the next sequence.
    size_t p = 0;
    int documents = 0;
    while (true) {
      const int64_t length = plain->Next().length;
      int64_t covered = 0;
      bool complete = true;
      while (covered < length) {
        if (p == pieces.size()) {
          complete = false;
          break;
        }
        if (covered > 0) {
          ASSERT_TRUE(pieces[p - 1].last && pieces[p].first) << name << " piece " << p;
        }
        covered += pieces[p++].tokens;
      }
      if (!complete) break;
      ASSERT_EQ(covered, length) << name << " document " << documents;
      ++documents;
    }
    EXPECT_GT(documents, 2000) << name;
  }
}

TEST(PackingTest, PrePackedRecordsAreDocumentsAndSensitivityIsTheMax) {
  std::vector<TraceRecord> records(3);
  records[0].length = 100;
  records[0].sensitivity = 0.1;
  records[1].length = 50;
  records[1].sensitivity = 0.9;
  records[2].length = 30;
  records[2].sensitivity = 0.2;
  records[2].segments = {10, 20};
  absl::StatusOr<TraceGenerator> gen = TraceGenerator::FromRecords(records, 1);
  ASSERT_TRUE(gen.ok()) << gen.status();
  gen->SetPackLength(64);
  // Stream: 100(0.1) 50(0.9) 10(0.2) 20(0.2) 100(0.1) 50(0.9) ...
  const std::vector<std::vector<int64_t>> want_segments = {
      {64}, {36, 28}, {22, 10, 20, 12}, {64}, {24, 40}};
  const std::vector<double> want_sensitivity = {0.1, 0.9, 0.9, 0.1, 0.9};
  for (size_t i = 0; i < want_segments.size(); ++i) {
    const Sample sample = gen->Next();
    EXPECT_EQ(sample.id, i);
    EXPECT_EQ(sample.length, 64);
    EXPECT_EQ(sample.segments, want_segments[i]) << "sequence " << i;
    EXPECT_EQ(sample.sensitivity, want_sensitivity[i]) << "sequence " << i;
  }
}

TEST(NextBatchTest, RespectsBudgetAndCarriesTheOverBudgetSampleOver) {
  constexpr int64_t kBudget = 1000000;  // tokens
  absl::StatusOr<TraceGenerator> batched = TraceGenerator::Builtin("pretrain", 21);
  absl::StatusOr<TraceGenerator> single = TraceGenerator::Builtin("pretrain", 21);
  ASSERT_TRUE(batched.ok() && single.ok());
  std::vector<std::vector<Sample>> batches;
  for (int step = 0; step < 50; ++step) batches.push_back(batched->NextBatch(kBudget));

  uint64_t next_id = 0;
  for (size_t b = 0; b < batches.size(); ++b) {
    ASSERT_FALSE(batches[b].empty());
    int64_t tokens = 0;
    for (const Sample& sample : batches[b]) {
      // The batches together are exactly the Next() stream: nothing dropped or repeated.
      const Sample want = single->Next();
      ASSERT_EQ(sample.id, next_id++);
      ASSERT_EQ(sample.id, want.id);
      ASSERT_EQ(sample.length, want.length);
      ASSERT_EQ(sample.sensitivity, want.sensitivity);
      tokens += sample.length;
    }
    EXPECT_LE(tokens, kBudget) << "batch " << b;
    // The batch stopped only because the next sample (kept for the next batch) did not fit.
    if (b + 1 < batches.size()) {
      EXPECT_GT(tokens + batches[b + 1].front().length, kBudget) << "batch " << b;
    }
  }
}

TEST(NextBatchTest, ReturnsOneSampleEvenWhenItExceedsTheBudget) {
  absl::StatusOr<TraceGenerator> gen = TraceGenerator::Builtin("prolong", 4);
  ASSERT_TRUE(gen.ok());
  gen->SetPackLength(4096);
  for (uint64_t i = 0; i < 5; ++i) {
    const std::vector<Sample> batch = gen->NextBatch(/*token_budget=*/1000);
    ASSERT_EQ(batch.size(), 1u);
    EXPECT_EQ(batch[0].id, i);
    EXPECT_EQ(batch[0].length, 4096);
  }
  // A budget of exactly two sequences takes two.
  EXPECT_EQ(gen->NextBatch(8192).size(), 2u);
}

}  // namespace
}  // namespace sparsebalance
