// sb-health: one grpc.health.v1.Health/Check call, for container health checks (Docker's
// HEALTHCHECK has no gRPC client of its own). Exit 0 when the service is SERVING, 1 otherwise
// (NOT_SERVING, unknown service, unreachable, timeout); one line on stdout says which.
#include <chrono>
#include <cstdint>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "tools/listen_address.h"
#include "tools/tool_support.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50152",
          "the planner's health listener (--health_listen) or its --listen, as host:port; a "
          "wildcard host (0.0.0.0, [::]) means this machine, so a --listen value can be passed "
          "as it is. Plaintext only");
ABSL_FLAG(std::string, service, "",
          "the service to check: \"\" (the default) is the process as a whole, SERVING until it "
          "exits (liveness); sparsebalance.planner.v1.PlannerService is NOT_SERVING while the "
          "planner drains or cannot write its state (readiness)");
ABSL_FLAG(double, timeout_seconds, 3.0, "deadline of the call");

namespace sparsebalance {
namespace {

// grpc.health.v1.HealthCheckResponse.ServingStatus.
const char* StatusName(int64_t status) {
  switch (status) {
    case 0:
      return "UNKNOWN";
    case 1:
      return "SERVING";
    case 2:
      return "NOT_SERVING";
    case 3:
      return "SERVICE_UNKNOWN";
    default:
      return "an unknown status";
  }
}

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

// HealthCheckResponse{status = 1 (enum)} from its wire bytes: the last value of field 1, 0
// (UNKNOWN) when absent; other fields are skipped. INTERNAL when the bytes do not parse.
absl::StatusOr<int64_t> ParseStatus(const std::string& bytes) {
  int64_t status = 0;
  size_t i = 0;
  auto varint = [&bytes, &i](uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 64 && i < bytes.size(); shift += 7) {
      const auto byte = static_cast<unsigned char>(bytes[i++]);
      *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  };
  while (i < bytes.size()) {
    uint64_t key = 0;
    uint64_t value = 0;
    if (!varint(&key)) return absl::InternalError("malformed HealthCheckResponse");
    switch (key & 7) {
      case 0:  // varint
        if (!varint(&value)) return absl::InternalError("malformed HealthCheckResponse");
        if ((key >> 3) == 1) status = static_cast<int64_t>(value);
        break;
      case 2:  // length-delimited
        if (!varint(&value) || value > bytes.size() - i) {
          return absl::InternalError("malformed HealthCheckResponse");
        }
        i += value;
        break;
      case 1:
        i += 8;
        break;
      case 5:
        i += 4;
        break;
      default:
        return absl::InternalError("malformed HealthCheckResponse");
    }
  }
  if (i > bytes.size()) return absl::InternalError("malformed HealthCheckResponse");
  return status;
}

int Main(int argc, char** argv) {
  tools::InitTool(argc, argv,
                  "one grpc.health.v1 Check of an sb-planner, for container health checks: exit "
                  "0 when SERVING, 1 otherwise.\n\n"
                  "  sb-health --address=127.0.0.1:50152                # liveness (service \"\")\n"
                  "  sb-health --address=127.0.0.1:50152 \\\n"
                  "            --service=sparsebalance.planner.v1.PlannerService  # readiness");
  tools::ListenAddressRules dial;
  dial.port_zero_picks_free_port = false;
  absl::StatusOr<tools::ListenAddress> address =
      tools::ParseListenAddress("address", absl::GetFlag(FLAGS_address), dial);
  if (!address.ok()) tools::UsageError(address.status().message());
  const std::string target = tools::LocalDialTarget(*address);
  const std::string service = absl::GetFlag(FLAGS_service);
  const std::string what = absl::StrCat(target, " service \"", service, "\"");

  std::string request = "\x0a";  // HealthCheckRequest{service = 1 (string)}
  AppendVarint(service.size(), &request);
  request += service;
  grpc::Slice slice(request);
  grpc::ByteBuffer send(&slice, 1);
  grpc::ByteBuffer receive;
  grpc::ClientContext context;
  context.set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_timeout_seconds) * 1e3)));
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  absl::Notification done;
  grpc::Status call;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &send, &receive,
                 [&call, &done](grpc::Status s) {
                   call = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (call.error_code() == grpc::StatusCode::NOT_FOUND) {
    std::cout << "sb-health: " << what << ": unknown to the server (NOT_FOUND)" << std::endl;
    return tools::kExitFailure;
  }
  if (!call.ok()) {
    std::cout << "sb-health: " << what << ": no answer (code " << call.error_code() << ": "
              << call.error_message() << ")" << std::endl;
    return tools::kExitFailure;
  }
  std::vector<grpc::Slice> slices;
  if (!receive.Dump(&slices).ok()) {
    std::cout << "sb-health: " << what << ": unreadable answer" << std::endl;
    return tools::kExitFailure;
  }
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  absl::StatusOr<int64_t> status = ParseStatus(bytes);
  if (!status.ok()) {
    std::cout << "sb-health: " << what << ": " << status.status().message() << std::endl;
    return tools::kExitFailure;
  }
  std::cout << "sb-health: " << what << ": " << StatusName(*status) << std::endl;
  return *status == 1 ? 0 : tools::kExitFailure;
}

}  // namespace
}  // namespace sparsebalance

int main(int argc, char** argv) { return sparsebalance::Main(argc, argv); }
