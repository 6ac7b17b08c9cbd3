#include "server/request_guard.h"

#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/message.h"

namespace sparsebalance {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;

// What each field takes once parsed (bytes, protobuf 3.21 on 64-bit): a repeated message's
// pointer slot, doubled for the repeated field's growth; a string's std::string and the slack
// of its buffer beside its characters; an unknown field's entry in the UnknownFieldSet (16
// bytes, doubled), and a length-delimited one's std::string.
constexpr size_t kRepeatedSlot = 16;
constexpr size_t kStringObject = 48;
constexpr size_t kUnknownField = 32;

struct TypeCosts;

struct FieldCost {
  enum Kind : uint8_t { kUnknown, kMessage, kString, kScalar };
  Kind kind = kUnknown;
  bool repeated = false;
  uint8_t element = 0;    // a scalar's bytes in memory
  uint8_t wire_type = 0;  // a scalar's own wire type: 0 varint, 1 fixed64, 5 fixed32
  const TypeCosts* message = nullptr;
};

struct TypeCosts {
  size_t object = 0;  // the message object, as SpaceUsedLong gives an empty one
  absl::flat_hash_map<uint32_t, FieldCost> fields;

  const FieldCost* Find(uint32_t number) const {
    const auto it = fields.find(number);
    return it == fields.end() ? nullptr : &it->second;
  }
};

// Every type's table, built on first use and kept for the process.
class CostTables {
 public:
  const TypeCosts* Get(const Descriptor* type) {
    absl::MutexLock lock(&mu_);
    return GetLocked(type);
  }

 private:
  const TypeCosts* GetLocked(const Descriptor* type) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto [it, inserted] = tables_.try_emplace(type);
    if (!inserted) return it->second.get();
    it->second = std::make_unique<TypeCosts>();
    TypeCosts* costs = it->second.get();  // in the map before its fields: types may recurse
    const google::protobuf::Message* prototype =
        google::protobuf::MessageFactory::generated_factory()->GetPrototype(type);
    costs->object = prototype != nullptr ? prototype->SpaceUsedLong() : 64;
    for (int k = 0; k < type->field_count(); ++k) {
      const FieldDescriptor* field = type->field(k);
      FieldCost cost;
      cost.repeated = field->is_repeated();
      switch (field->type()) {
        case FieldDescriptor::TYPE_MESSAGE:
          cost.kind = FieldCost::kMessage;
          cost.message = GetLocked(field->message_type());
          break;
        case FieldDescriptor::TYPE_STRING:
        case FieldDescriptor::TYPE_BYTES:
          cost.kind = FieldCost::kString;
          break;
        case FieldDescriptor::TYPE_GROUP:
          cost.kind = FieldCost::kUnknown;  // not in proto3: counted as an unknown group
          break;
        case FieldDescriptor::TYPE_DOUBLE:
        case FieldDescriptor::TYPE_FIXED64:
        case FieldDescriptor::TYPE_SFIXED64:
          cost = {FieldCost::kScalar, cost.repeated, 8, 1, nullptr};
          break;
        case FieldDescriptor::TYPE_FLOAT:
        case FieldDescriptor::TYPE_FIXED32:
        case FieldDescriptor::TYPE_SFIXED32:
          cost = {FieldCost::kScalar, cost.repeated, 4, 5, nullptr};
          break;
        case FieldDescriptor::TYPE_INT64:
        case FieldDescriptor::TYPE_UINT64:
        case FieldDescriptor::TYPE_SINT64:
          cost = {FieldCost::kScalar, cost.repeated, 8, 0, nullptr};
          break;
        case FieldDescriptor::TYPE_BOOL:
          cost = {FieldCost::kScalar, cost.repeated, 1, 0, nullptr};
          break;
        default:  // int32, uint32, sint32, enum
          cost = {FieldCost::kScalar, cost.repeated, 4, 0, nullptr};
          break;
      }
      costs->fields[static_cast<uint32_t>(field->number())] = cost;
    }
    return costs;
  }

  absl::Mutex mu_;
  absl::flat_hash_map<const Descriptor*, std::unique_ptr<TypeCosts>> tables_ ABSL_GUARDED_BY(mu_);
};

CostTables& Tables() {
  static CostTables* tables = new CostTables;
  return *tables;
}

// The table of `type`, through a one-entry cache per thread: a thread serves calls of one
// method after another, and the tables are never freed, so a hit needs no lock.
const TypeCosts* CostsOf(const Descriptor* type) {
  thread_local const Descriptor* cached_type = nullptr;
  thread_local const TypeCosts* cached = nullptr;
  if (type != cached_type) {
    cached = Tables().Get(type);
    cached_type = type;
  }
  return cached;
}

// One scan: the cost so far and the job id found.
class Scanner {
 public:
  explicit Scanner(absl::Span<const int> path) : path_(path) {}

  // Scans the fields of a message of `type` (null: a group's fields, all unknown) in
  // [p, end). `path_at`: the index into the job id path that this message's fields are
  // matched against, -1 when the message is off the path. `group`: the field number whose
  // end-group tag ends the fields (0: they run to `end`), and then *after the position past it.
  bool Fields(const char* p, const char* end, const TypeCosts* type, int depth, int path_at,
              uint32_t group, const char** after) {
    if (depth > kMaxScanDepth) return false;
    while (p < end) {
      uint64_t tag;
      if (!Varint(&p, end, &tag) || tag > 0xFFFFFFFFu) return false;
      const uint32_t number = static_cast<uint32_t>(tag >> 3);
      const int wire_type = static_cast<int>(tag & 7);
      if (number == 0) return false;
      if (wire_type == 4) {  // end group
        if (group == 0 || number != group) return false;
        *after = p;
        return true;
      }
      const FieldCost* field = type != nullptr ? type->Find(number) : nullptr;
      const bool on_path = path_at >= 0 && static_cast<int>(number) == path_[path_at];
      switch (wire_type) {
        case 0: {  // varint
          uint64_t value;
          if (!Varint(&p, end, &value)) return false;
          if (field != nullptr && field->kind == FieldCost::kScalar && field->wire_type == 0) {
            if (field->repeated) cost_ += 2 * field->element;
          } else {
            cost_ += kUnknownField;
          }
          break;
        }
        case 1:
        case 5: {  // fixed64, fixed32
          const size_t size = wire_type == 1 ? 8 : 4;
          if (static_cast<size_t>(end - p) < size) return false;
          p += size;
          if (field != nullptr && field->kind == FieldCost::kScalar &&
              field->wire_type == wire_type) {
            if (field->repeated) cost_ += 2 * field->element;
          } else {
            cost_ += kUnknownField;
          }
          break;
        }
        case 2: {  // length-delimited
          uint64_t length;
          if (!Varint(&p, end, &length) || length > static_cast<uint64_t>(end - p)) return false;
          const char* inner = p;
          p += length;
          if (field != nullptr && field->kind == FieldCost::kMessage) {
            cost_ += field->message->object + (field->repeated ? kRepeatedSlot : 0);
            const int next =
                on_path && path_at + 1 < static_cast<int>(path_.size()) ? path_at + 1 : -1;
            if (!Fields(inner, p, field->message, depth + 1, next, 0, nullptr)) return false;
          } else if (field != nullptr && field->kind == FieldCost::kString) {
            cost_ += kStringObject + length + (field->repeated ? kRepeatedSlot : 0);
            if (on_path && path_at + 1 == static_cast<int>(path_.size())) {
              job_id_.assign(inner, length);  // the last one, as the parse keeps
            }
          } else if (field != nullptr && field->kind == FieldCost::kScalar && field->repeated) {
            // Packed: the elements' count from the bytes.
            size_t count = 0;
            if (field->wire_type == 0) {
              for (const char* q = inner; q < p; ++q) {
                if ((static_cast<uint8_t>(*q) & 0x80) == 0) ++count;
              }
              if (length > 0 && (static_cast<uint8_t>(p[-1]) & 0x80) != 0) return false;
            } else {
              const size_t size = field->wire_type == 1 ? 8 : 4;
              if (length % size != 0) return false;
              count = length / size;
            }
            cost_ += 2 * field->element * count;
          } else {
            cost_ += kUnknownField + kStringObject + length;
          }
          break;
        }
        case 3: {  // start group: kept as an unknown field holding its own fields
          cost_ += kUnknownField + kStringObject;
          const char* past = nullptr;
          if (!Fields(p, end, nullptr, depth + 1, -1, number, &past)) return false;
          p = past;
          break;
        }
        default:
          return false;
      }
    }
    return group == 0;  // a group must end with its end-group tag
  }

  size_t cost() const { return cost_; }
  std::string TakeJobId() { return std::move(job_id_); }

 private:
  static bool Varint(const char** p, const char* end, uint64_t* value) {
    uint64_t result = 0;
    for (int shift = 0; shift < 70 && *p < end; shift += 7) {
      const uint8_t byte = static_cast<uint8_t>(*(*p)++);
      if (shift == 63 && byte > 1) return false;
      result |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if ((byte & 0x80) == 0) {
        *value = result;
        return true;
      }
    }
    return false;
  }

  const absl::Span<const int> path_;
  size_t cost_ = 0;
  std::string job_id_;
};

// Mebibytes with one decimal, for messages.
std::string MiB(size_t bytes) {
  return absl::StrFormat("%.1f", static_cast<double>(bytes) / (1 << 20));
}

}  // namespace

RequestScan ScanRequest(const Descriptor* type, absl::string_view bytes,
                        absl::Span<const int> job_id_path) {
  const TypeCosts* costs = CostsOf(type);
  Scanner scanner(job_id_path);
  RequestScan scan;
  scan.well_formed = scanner.Fields(bytes.data(), bytes.data() + bytes.size(), costs, 0,
                                    job_id_path.empty() ? -1 : 0, 0, nullptr);
  scan.parsed_bytes = costs->object + scanner.cost();
  scan.job_id = scanner.TakeJobId();
  return scan;
}

absl::Status ParseBudget::Reserve(size_t bytes, absl::string_view what, Hold* hold) {
  hold->Reset();
  if (bytes > limit_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": this request would take about ", MiB(bytes),
        " MiB once parsed, above the planner's limit of ", MiB(limit_),
        " MiB for the requests in hand (--max_request_memory_mb); send less at a time"));
  }
  size_t now = in_use_.load(std::memory_order_relaxed);
  do {
    if (now + bytes > limit_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, ": this request would take about ", MiB(bytes), " MiB once parsed, and the ",
          "requests in hand take ", MiB(now), " of the planner's ", MiB(limit_),
          " MiB for them (--max_request_memory_mb); try again"));
    }
  } while (!in_use_.compare_exchange_weak(now, now + bytes, std::memory_order_relaxed));
  hold->budget_ = this;
  hold->bytes_ = bytes;
  return absl::OkStatus();
}

}  // namespace sparsebalance
