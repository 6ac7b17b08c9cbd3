// A grpc.health.v1 check by hand (no generated health stubs needed), for tests that watch a
// planner turn SERVING and NOT_SERVING. Starting the planner itself: tools/child_process.h.
//
//   EXPECT_EQ(test_support::HealthStatus(channel, "sparsebalance.planner.v1.PlannerService"), 1);
#ifndef SPARSEBALANCE_TESTS_SERVER_HEALTH_CHECK_H_
#define SPARSEBALANCE_TESTS_SERVER_HEALTH_CHECK_H_

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace sparsebalance::test_support {

// grpc.health.v1.Health/Check of `service` by hand: HealthCheckRequest{service} is field 1 (a
// string), HealthCheckResponse{status} field 1 (an enum). Returns 1 for SERVING, 2 for
// NOT_SERVING, minus the gRPC status code when the call fails.
inline int HealthStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                        double timeout_seconds = 2.0) {
  grpc::GenericStub stub(channel);
  std::string request = "\x0a";
  request.push_back(static_cast<char>(service.size()));
  request += service;
  grpc::Slice slice(request);
  grpc::ByteBuffer send(&slice, 1);
  grpc::ByteBuffer receive;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(static_cast<int>(timeout_seconds * 1e3)));
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &send, &receive,
                 [&](grpc::Status s) {
                   std::lock_guard<std::mutex> lock(mu);
                   status = std::move(s);
                   done = true;
                   cv.notify_one();
                 });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  if (!status.ok()) return -static_cast<int>(status.error_code());
  std::vector<grpc::Slice> slices;
  receive.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : 0;
}

}  // namespace sparsebalance::test_support

#endif  // SPARSEBALANCE_TESTS_SERVER_HEALTH_CHECK_H_
