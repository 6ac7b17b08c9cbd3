// A job.pb or step-<n>.pb as a test reads and rewrites it (the store's frame: plan_store.h),
// for tests that change stored state as a bad disk, an older planner or an attacker would.
//
//   state::v1::StepRecord record;
//   ASSERT_TRUE(test_support::ReadStateFile(path, &record));
//   record.set_step(9);
//   test_support::WriteStateFile(path, record);  // framed, its checksum right
#ifndef SPARSEBALANCE_TESTS_SERVER_STATE_FILES_H_
#define SPARSEBALANCE_TESTS_SERVER_STATE_FILES_H_

#include <string>

#include "absl/status/statusor.h"
#include "google/protobuf/message_lite.h"
#include "server/plan_store.h"
#include "tests/server/test_support.h"

namespace sparsebalance::test_support {

// Parses the message of the state file at `path` (either format) into `message`; false when
// its frame does not check or its body does not parse. `legacy` (when given): whether the file
// is of the previous format (no frame).
inline bool ReadStateFile(const std::string& path, google::protobuf::MessageLite* message,
                          bool* legacy = nullptr) {
  const std::string bytes = ReadBytes(path);
  bool old_format = false;
  absl::StatusOr<absl::string_view> body = StateFileBody(bytes, path, &old_format);
  if (legacy != nullptr) *legacy = old_format;
  return body.ok() && message->ParseFromArray(body->data(), static_cast<int>(body->size()));
}

// Writes `message` to `path` as the store writes it, or with `legacy` as planners before the
// frame did (the bare message).
inline void WriteStateFile(const std::string& path, const google::protobuf::MessageLite& message,
                           bool legacy = false) {
  const std::string body = message.SerializeAsString();
  WriteBytes(path, legacy ? body : FrameStateFile(body));
}

}  // namespace sparsebalance::test_support

#endif  // SPARSEBALANCE_TESTS_SERVER_STATE_FILES_H_
