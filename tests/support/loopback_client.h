// A PlannerClient for a planner that a test runs on loopback, shared by the client tests and the
// end-to-end tests (which differ only in their deadlines).
//
//   std::unique_ptr<PlannerClient> admin = test_support::ConnectLoopback(port, "", "", 5.0);
//   std::unique_ptr<PlannerClient> rank =
//       test_support::ConnectLoopback(port, job->job_id, job->token, 5.0);
#ifndef SPARSEBALANCE_TESTS_SUPPORT_LOOPBACK_CLIENT_H_
#define SPARSEBALANCE_TESTS_SUPPORT_LOOPBACK_CLIENT_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/planner_client.h"
#include "gtest/gtest.h"

namespace sparsebalance::test_support {

// A client of the planner on 127.0.0.1:`port`, calling as job `job_id` with `token` (both
// empty: admin calls only), with `call_timeout_seconds` on every call and `plan_timeout_seconds` on
// GetRankPlan (0: the client's default), reporting on a ReportSteps stream with
// `report_stream`. Null, and a test failure, when it cannot be made.
inline std::unique_ptr<PlannerClient> ConnectLoopback(int port, const std::string& job_id,
                                                      const std::string& token,
                                                      double call_timeout_seconds,
                                                      double plan_timeout_seconds = 0.0,
                                                      bool report_stream = false) {
  ClientOptions options;
  options.report_stream = report_stream;
  options.target = absl::StrCat("127.0.0.1:", port);
  options.job_id = job_id;
  options.token = token;
  options.call_timeout_seconds = call_timeout_seconds;
  if (plan_timeout_seconds > 0) options.plan_timeout_seconds = plan_timeout_seconds;
  absl::StatusOr<std::unique_ptr<PlannerClient>> client = PlannerClient::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

}  // namespace sparsebalance::test_support

#endif  // SPARSEBALANCE_TESTS_SUPPORT_LOOPBACK_CLIENT_H_
