#include "server/request_guard.h"

#include <cstdint>
#include <random>
#include <string>

#include "gmock/gmock.h"
#include "google/protobuf/stubs/logging.h"
#include "gtest/gtest.h"
#include "sparsebalance/planner/v1/planner.pb.h"

namespace sparsebalance {
namespace {

namespace v1 = ::sparsebalance::planner::v1;
using ::testing::HasSubstr;

constexpr int kJobIdAtTop[] = {1};
constexpr int kJobIdInReport[] = {1, 1};

// The scan's estimate against what the parse takes (SpaceUsedLong of the message parsed on the
// heap): at least that, and not far above it.
template <typename Message>
void ExpectEstimateCovers(const std::string& bytes, double at_most_times, const char* what) {
  const RequestScan scan = ScanRequest(Message::descriptor(), bytes, kJobIdAtTop);
  ASSERT_TRUE(scan.well_formed) << what;
  Message parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes)) << what;
  const size_t used = parsed.SpaceUsedLong();
  EXPECT_GE(scan.parsed_bytes, used) << what << ": " << bytes.size() << " bytes on the wire";
  EXPECT_LE(static_cast<double>(scan.parsed_bytes), at_most_times * static_cast<double>(used))
      << what;
}

v1::SubmitBatchRequest Batch(int samples) {
  v1::SubmitBatchRequest request;
  request.set_job_id("0123456789abcdef");
  request.set_step(7);
  for (int i = 0; i < samples; ++i) {
    v1::Sample* s = request.add_samples();
    s->set_id(1000 + i);
    s->set_length(100 + 37 * i);
    if (i % 5 == 0) {
      s->add_segments(50);
      s->add_segments(50 + 37 * i);
    }
  }
  return request;
}

v1::ReportStepBatchRequest Reports(int reports) {
  v1::ReportStepBatchRequest request;
  request.set_job_id("0123456789abcdef");
  for (int r = 0; r < reports; ++r) {
    v1::ReportStepRequest* report = request.add_reports();
    report->set_step(3);
    report->set_rank(r);
    for (int m = 0; m < 2; ++m) {
      v1::MicroBatchReport* mb = report->add_micro_batches();
      mb->set_micro_batch(m);
      mb->set_compute_seconds(0.5);
      for (int d = 0; d < 4; ++d) {
        v1::DocumentRecall* doc = mb->add_documents();
        doc->set_sample_id(100 * m + d);
        doc->set_recall(0.9);
        for (int l = 0; l < 32; ++l) doc->add_layer_recall(0.9);
      }
    }
  }
  return request;
}

// What a request will take once parsed, for the requests clients send: at least what the parse
// takes (so the budget is never short), within 3x of it (so a request that fits is not refused
// for a gross overestimate).
TEST(ScanRequestTest, EstimatesCoverWhatTheParseTakesForTheServicesRequests) {
  for (int samples : {0, 1, 16, 4096}) {
    ExpectEstimateCovers<v1::SubmitBatchRequest>(Batch(samples).SerializeAsString(), 3.0,
                                                 "SubmitBatch");
  }
  for (int reports : {1, 64}) {
    ExpectEstimateCovers<v1::ReportStepBatchRequest>(Reports(reports).SerializeAsString(), 3.0,
                                                     "ReportStepBatch");
  }
  v1::GetRankPlansRequest plans;
  plans.set_job_id("0123456789abcdef");
  for (int r = 0; r < 1024; ++r) plans.add_ranks(r);
  ExpectEstimateCovers<v1::GetRankPlansRequest>(plans.SerializeAsString(), 3.0, "GetRankPlans");
}

// What an attacker sends to make the parse large for its bytes: empty messages, packed zeros,
// unknown fields, unknown groups. The estimate still covers what the parse takes.
TEST(ScanRequestTest, EstimatesCoverWhatTheParseTakesForHostileBytes) {
  std::string empty_samples = "\x0a\x02xy";
  for (int i = 0; i < 100000; ++i) empty_samples.append("\x1a\x00", 2);
  ExpectEstimateCovers<v1::SubmitBatchRequest>(empty_samples, 3.0, "empty samples");
  const RequestScan scan =
      ScanRequest(v1::SubmitBatchRequest::descriptor(), empty_samples, kJobIdAtTop);
  EXPECT_GT(scan.parsed_bytes, 30 * empty_samples.size());  // what made the attack work

  v1::Sample zeros;
  for (int i = 0; i < 100000; ++i) zeros.add_segments(0);
  ExpectEstimateCovers<v1::Sample>(zeros.SerializeAsString(), 4.0, "packed zeros");

  std::string unknown_varints = Batch(4).SerializeAsString();
  for (int i = 0; i < 100000; ++i) unknown_varints.append("\xf8\x07\x00", 3);  // field 127
  ExpectEstimateCovers<v1::SubmitBatchRequest>(unknown_varints, 4.0, "unknown varints");

  std::string unknown_groups = Batch(4).SerializeAsString();
  for (int i = 0; i < 20000; ++i) unknown_groups.append("\xfb\x07\xf8\x07\x00\xfc\x07", 7);
  ExpectEstimateCovers<v1::SubmitBatchRequest>(unknown_groups, 4.0, "unknown groups");

  // A known field sent with another wire type is kept as an unknown field.
  std::string wrong_type = Batch(1).SerializeAsString();
  for (int i = 0; i < 100000; ++i) wrong_type.append("\x10\x01", 2);  // step (varint) is fine
  for (int i = 0; i < 100000; ++i) wrong_type.append("\x15\x00\x00\x00\x00", 5);  // step, fixed32
  ExpectEstimateCovers<v1::SubmitBatchRequest>(wrong_type, 4.0, "wrong wire types");
}

// The job id is read where the parse would put it: the last occurrence wins, a report's
// inside a ReportStepsRequest.
TEST(ScanRequestTest, TheJobIdIsTheOneTheParsedMessageHolds) {
  v1::SubmitBatchRequest first = Batch(2);
  first.set_job_id("first");
  v1::SubmitBatchRequest second;
  second.set_job_id("second");
  const std::string both = first.SerializeAsString() + second.SerializeAsString();
  v1::SubmitBatchRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(both));
  EXPECT_EQ(ScanRequest(v1::SubmitBatchRequest::descriptor(), both, kJobIdAtTop).job_id,
            parsed.job_id());
  EXPECT_EQ(parsed.job_id(), "second");

  v1::ReportStepsRequest stream;
  stream.mutable_report()->set_job_id("deep");
  stream.mutable_report()->set_step(4);
  EXPECT_EQ(
      ScanRequest(v1::ReportStepsRequest::descriptor(), stream.SerializeAsString(), kJobIdInReport)
          .job_id,
      "deep");
  EXPECT_EQ(
      ScanRequest(v1::ReportStepsRequest::descriptor(), stream.SerializeAsString(), kJobIdAtTop)
          .job_id,
      "");  // field 1 there is the report, not a string
  EXPECT_EQ(ScanRequest(v1::SubmitBatchRequest::descriptor(), "", kJobIdAtTop).job_id, "");
  EXPECT_EQ(ScanRequest(v1::SubmitBatchRequest::descriptor(), first.SerializeAsString(), {}).job_id,
            "");
}

TEST(ScanRequestTest, MalformedBytesAreNotWellFormed) {
  const v1::SubmitBatchRequest batch = Batch(3);
  const std::string good = batch.SerializeAsString();
  for (const std::string& bad :
       {std::string("\x0a\x7f"
                    "abc"),  // a length past the end
        std::string("\x10\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 12),  // an 11-byte varint
        std::string("\x10", 1),                                               // a varint cut short
        std::string("\x00\x01", 2),                                           // field 0
        std::string("\x0e\x01", 2),                                           // wire type 6
        std::string("\xfc\x07", 2),          // an end group without its start
        std::string("\xfb\x07\x00", 3),      // a group without its end
        good.substr(0, good.size() - 1)}) {  // the last sample cut short
    EXPECT_FALSE(ScanRequest(v1::SubmitBatchRequest::descriptor(), bad, kJobIdAtTop).well_formed)
        << testing::PrintToString(bad);
    v1::SubmitBatchRequest parsed;
    EXPECT_FALSE(parsed.ParseFromString(bad)) << testing::PrintToString(bad);
  }
  // Nesting past the parse's recursion limit (unknown groups: the protos do not recurse).
  std::string deep;
  for (int k = 0; k < 120; ++k) deep.append("\xfb\x07", 2);
  for (int k = 0; k < 120; ++k) deep.append("\xfc\x07", 2);
  EXPECT_FALSE(ScanRequest(v1::SubmitBatchRequest::descriptor(), deep, kJobIdAtTop).well_formed);
  v1::SubmitBatchRequest parsed;
  EXPECT_FALSE(parsed.ParseFromString(deep));
}

// The scan never refuses what the parse accepts: the service answers INVALID_ARGUMENT for bytes
// the scan calls malformed, so a false "malformed" would refuse a valid request. Random byte
// changes to valid requests, each checked both ways.
TEST(ScanRequestTest, WhateverTheParseAcceptsTheScanCallsWellFormed) {
  const google::protobuf::LogSilencer quiet;  // the parse logs each invalid UTF-8 string
  std::mt19937_64 random(17);
  const std::string submit = Batch(6).SerializeAsString();
  const std::string reports = Reports(2).SerializeAsString();
  int parsed_count = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const bool is_submit = trial % 2 == 0;
    std::string bytes = is_submit ? submit : reports;
    const int changes = 1 + static_cast<int>(random() % 4);
    for (int c = 0; c < changes; ++c) {
      const size_t at = random() % bytes.size();
      switch (random() % 3) {
        case 0:
          bytes[at] = static_cast<char>(random());
          break;
        case 1:
          bytes.erase(at, 1 + random() % 3);
          break;
        default:
          bytes.insert(at, 1, static_cast<char>(random()));
          break;
      }
      if (bytes.empty()) bytes = "\x10\x01";
    }
    // Whether the parse takes the bytes as a Message, each property checked where it does.
    auto check = [&](auto message) {
      const bool parses = message.ParseFromString(bytes);
      const RequestScan scan = ScanRequest(message.GetDescriptor(), bytes, kJobIdAtTop);
      if (parses) {
        EXPECT_TRUE(scan.well_formed) << testing::PrintToString(bytes);
        EXPECT_EQ(scan.job_id, message.job_id());
        EXPECT_GE(scan.parsed_bytes, message.SpaceUsedLong());
      }
      return parses;
    };
    const bool parses =
        is_submit ? check(v1::SubmitBatchRequest()) : check(v1::ReportStepBatchRequest());
    parsed_count += parses;
  }
  EXPECT_GT(parsed_count, 1000);  // the property was tried on many parseable inputs
}

TEST(ParseBudgetTest, ReservationsShareTheLimitAndGoBackWithTheirHold) {
  ParseBudget budget(1000);
  ParseBudget::Hold a, b, c;
  EXPECT_TRUE(budget.Reserve(600, "SubmitBatch", &a).ok());
  absl::Status refused = budget.Reserve(500, "SubmitBatch", &b);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("try again"));
  EXPECT_TRUE(budget.Reserve(400, "ReportStep", &c).ok());
  EXPECT_EQ(budget.in_use(), 1000u);
  a.Reset();
  EXPECT_EQ(budget.in_use(), 400u);
  EXPECT_TRUE(budget.Reserve(500, "SubmitBatch", &b).ok());
  {
    ParseBudget::Hold scoped;
    EXPECT_TRUE(budget.Reserve(100, "GetJob", &scoped).ok());
    EXPECT_EQ(budget.in_use(), 1000u);
  }
  EXPECT_EQ(budget.in_use(), 900u);
  absl::Status alone = budget.Reserve(1001, "SubmitBatch", &a);
  EXPECT_EQ(alone.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(alone.message(), HasSubstr("above the planner's limit"));
  EXPECT_EQ(budget.in_use(), 900u);  // a refusal reserves nothing
  // A hold reserved again gives back what it held first.
  EXPECT_TRUE(budget.Reserve(50, "SubmitBatch", &b).ok());
  EXPECT_EQ(budget.in_use(), 450u);
}

}  // namespace
}  // namespace sparsebalance
