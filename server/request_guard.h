// Requests looked at before they are parsed. gRPC parses a request into protobuf objects before
// the method runs, so before its token is checked: a field that costs two bytes on the wire
// (an empty Sample of a SubmitBatch, an unknown varint) takes 30-100 bytes once parsed, and one
// unauthenticated 40 MiB request took 2 GB of the planner (its pod's 2 GiB limit killed it;
// a larger one aborted it on std::bad_alloc inside gRPC, where no handler could answer). So the
// service registers its methods with PendingRequest<T> (the bytes, held as gRPC received them),
// and each call is admitted in order. First, before a byte of the request is read, the caller's
// token alone (PlannerServiceImpl::PreAuthorize: some job's token, or the admin token): a call
// without one is finished unread, so it makes the planner hold no more than HTTP/2's stream
// window (gRPC reads a unary request whole, up to --max_message_bytes, before a unary handler
// runs, so the methods are served as client-streaming calls, the same on the wire). Then, once
// read: bytes that are not a T refused (INVALID_ARGUMENT), the token checked against the job id
// read off the bytes (ScanRequest), the memory the parse will take reserved from the planner's
// ParseBudget (RESOURCE_EXHAUSTED when it does not fit), and only then parsed. A caller with a
// valid token can still send large requests: --max_transport_memory_mb bounds what gRPC holds
// of them (softly), and the ParseBudget what their parse takes.
//
//   const RequestScan scan = ScanRequest(v1::SubmitBatchRequest::descriptor(), bytes, {1});
//   if (!scan.well_formed) ...;         // the parse would fail
//   budget.Reserve(scan.parsed_bytes);  // about what parsing them allocates
//   Authorize(scan.job_id);             // the job id the parsed message will hold
#ifndef SPARSEBALANCE_SERVER_REQUEST_GUARD_H_
#define SPARSEBALANCE_SERVER_REQUEST_GUARD_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "google/protobuf/arena.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/impl/serialization_traits.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace sparsebalance {

// What ScanRequest reads off a message's bytes.
struct RequestScan {
  // The bytes are a well-formed message of the type: tags, lengths, varints and groups in
  // bounds, nesting at most kMaxScanDepth deep. A parse of bytes that are not fails anyway.
  bool well_formed = true;
  // About the bytes the parsed message allocates, its own object included: each message
  // object's size (and its slot in a repeated field), each repeated scalar's element at twice
  // its size (a repeated field's capacity grows by doubling), strings and unknown fields with
  // their container. Measured against SpaceUsedLong of the parsed message it is at least that,
  // and within 2-3x of it for the service's requests (tests/server/request_guard_test.cc).
  size_t parsed_bytes = 0;
  // The string at `job_id_path` (field numbers from the top, e.g. {1} for job_id, {1, 1} for a
  // ReportStepsRequest's report.job_id), its last occurrence as the parse keeps it; empty when
  // absent.
  std::string job_id;
};

// Nesting deeper than protobuf's default recursion limit does not parse.
inline constexpr int kMaxScanDepth = 100;

// Scans `bytes` as a message of `type` (a generated message's descriptor). Linear in the bytes;
// each type's field table is built once per process.
RequestScan ScanRequest(const google::protobuf::Descriptor* type, absl::string_view bytes,
                        absl::Span<const int> job_id_path);

// Memory the requests being admitted and served may take once parsed, all together: each call
// reserves its scan's parsed_bytes before parsing and gives them back when its handler returns.
class ParseBudget {
 public:
  explicit ParseBudget(size_t limit) : limit_(limit) {}
  ParseBudget(const ParseBudget&) = delete;
  ParseBudget& operator=(const ParseBudget&) = delete;

  // A reservation, given back when it goes.
  class Hold {
   public:
    Hold() = default;
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    ~Hold() { Reset(); }
    void Reset() {
      if (budget_ != nullptr) budget_->in_use_.fetch_sub(bytes_, std::memory_order_relaxed);
      budget_ = nullptr;
      bytes_ = 0;
    }

   private:
    friend class ParseBudget;
    ParseBudget* budget_ = nullptr;
    size_t bytes_ = 0;
  };

  // Reserves `bytes` into `hold` (which gives back what it held first): RESOURCE_EXHAUSTED
  // naming `what`, the bytes and the limit when they do not fit beside the others' (or alone).
  absl::Status Reserve(size_t bytes, absl::string_view what, Hold* hold);
  size_t limit() const { return limit_; }
  size_t in_use() const { return in_use_.load(std::memory_order_relaxed); }

 private:
  const size_t limit_;
  std::atomic<size_t> in_use_{0};
};

// A request of message type T as gRPC received it, not parsed yet: its bytes (the slices gRPC
// holds, or one copy of them when they came in several), what ScanRequest found in them, and
// room for the parsed message on the call's arena.
template <typename T>
class PendingRequest {
 public:
  // `arena`: the call's, where Parse puts the message (null: the heap); `job_id_path`: where
  // ScanRequest reads the job id (static storage: the service's constants).
  PendingRequest(google::protobuf::Arena* arena, absl::Span<const int> job_id_path)
      : arena_(arena), job_id_path_(job_id_path) {}
  // gRPC's default message holder needs it (the service always sets its allocator): no job id
  // is read, so a job call through it is refused for an empty job_id.
  PendingRequest() : PendingRequest(nullptr, {}) {}
  PendingRequest(const PendingRequest&) = delete;
  PendingRequest& operator=(const PendingRequest&) = delete;
  ~PendingRequest() {
    if (arena_ == nullptr) delete owned_;
  }

  // Takes the bytes of `buffer` and scans them. Called by gRPC through SerializationTraits
  // (below) for each message received, so it also drops the previous message's bytes and parse
  // (a stream reads into one PendingRequest again and again).
  grpc::Status Read(grpc::ByteBuffer* buffer) {
    slices_.clear();
    joined_.clear();
    parsed_ = nullptr;
    if (owned_ != nullptr) owned_->Clear();
    grpc::Status dumped = buffer->Dump(&slices_);
    if (!dumped.ok()) return dumped;
    if (slices_.size() == 1) {
      bytes_ =
          absl::string_view(reinterpret_cast<const char*>(slices_[0].begin()), slices_[0].size());
    } else {
      for (const grpc::Slice& slice : slices_) {
        joined_.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
      }
      slices_.clear();
      bytes_ = joined_;
    }
    scan_ = ScanRequest(T::descriptor(), bytes_, job_id_path_);
    return grpc::Status::OK;
  }

  const RequestScan& scan() const { return scan_; }
  size_t wire_bytes() const { return bytes_.size(); }

  // The message, parsed from the bytes once; INVALID_ARGUMENT when they are not a T.
  absl::StatusOr<const T*> Parse() const {
    if (parsed_ != nullptr) return parsed_;
    if (owned_ == nullptr) owned_ = google::protobuf::Arena::CreateMessage<T>(arena_);
    if (!scan_.well_formed ||
        !owned_->ParseFromArray(bytes_.data(), static_cast<int>(bytes_.size()))) {
      return NotA();
    }
    parsed_ = owned_;
    return parsed_;
  }

  // INVALID_ARGUMENT: the bytes are not a T.
  absl::Status NotA() const {
    return absl::InvalidArgumentError(absl::StrCat("the request's ", bytes_.size(),
                                                   " bytes are not a valid ",
                                                   T::descriptor()->full_name(), " message"));
  }

 private:
  google::protobuf::Arena* const arena_;
  const absl::Span<const int> job_id_path_;
  std::vector<grpc::Slice> slices_;
  std::string joined_;
  absl::string_view bytes_;
  RequestScan scan_;
  // The parse's (Parse is const: gRPC hands the request to the method as const).
  mutable T* owned_ = nullptr;
  mutable const T* parsed_ = nullptr;
};

}  // namespace sparsebalance

namespace grpc {

// gRPC hands a PendingRequest the bytes as they came (the service parses them itself, once
// admitted). Never serialized: the service only receives these.
template <typename T>
class SerializationTraits<sparsebalance::PendingRequest<T>, void> {
 public:
  static Status Serialize(const sparsebalance::PendingRequest<T>&, ByteBuffer*, bool*) {
    return Status(StatusCode::INTERNAL, "a PendingRequest is never sent");
  }
  static Status Deserialize(ByteBuffer* buffer, sparsebalance::PendingRequest<T>* out) {
    Status read = out->Read(buffer);
    buffer->Clear();
    return read;
  }
};

}  // namespace grpc

#endif  // SPARSEBALANCE_SERVER_REQUEST_GUARD_H_
