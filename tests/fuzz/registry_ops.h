// The byte format registry_fuzzer.cc reads as a sequence of JobRegistry operations, shared with
// the seed-corpus generator (make_registry_corpus.cc) so that both agree on it.
//
// An input is a list of operations, each an opcode byte (taken modulo kOpCount) and its
// fields; a field past the end of the input reads as zeros. Fields are little-endian:
//   slot      u8: which job, modulo (jobs created so far + 1); the extra value is an id
//             that never existed
//   step      u8 mode, then per mode: kStepNext (the job's next step), kStepLast (the last
//             planned one), kStepRaw + i64, kStepAhead + u8 (next step + that many)
//   blob      u16 length, then that many bytes (a serialized proto message, or text)
//
//   RegistryOps ops;
//   ops.Create(config).Join(0, 0).Submit(0, RegistryOps::Step::Next(), false, request);
//   std::string bytes = ops.bytes();
#ifndef SPARSEBALANCE_TESTS_FUZZ_REGISTRY_OPS_H_
#define SPARSEBALANCE_TESTS_FUZZ_REGISTRY_OPS_H_

#include <cstdint>
#include <string>

namespace sparsebalance {
namespace fuzz {

enum Op : uint8_t {
  kCreateJob = 0,    // blob JobConfig, blob profile text
  kJoinJob,          // slot, i32 rank
  kSubmitBatch,      // slot, step, u8 flags (bit 0: planned_locally), blob SubmitBatchRequest
  kGetPlan,          // slot, step, i32 rank
  kReportStep,       // slot, step, blob ReportStepRequest (rank, micro-batches, wait, local)
  kUpdateJobConfig,  // slot, blob UpdateJobConfigRequest (config and update_mask)
  kUploadProfile,    // slot, blob profile text
  kDeleteJob,        // slot
  kRestart,          // destroy the registry and the store, reopen, Restore()
  kGetJob,           // slot (GetJob and ListJobs)
  // slot, step, blob ReportStepBatchRequest (each report's step replaced by the op's step)
  kReportSteps,
  kOpCount,
};

enum StepMode : uint8_t { kStepNext = 0, kStepLast, kStepRaw, kStepAhead, kStepModes };

// Writes operations in the format above.
class RegistryOps {
 public:
  struct Step {
    static Step Next() { return {kStepNext, 0}; }
    static Step Last() { return {kStepLast, 0}; }
    static Step Raw(int64_t step) { return {kStepRaw, step}; }
    static Step Ahead(uint8_t delta) { return {kStepAhead, delta}; }
    StepMode mode;
    int64_t value;
  };

  RegistryOps& Create(const std::string& config, const std::string& profile = "") {
    return Byte(kCreateJob).Blob(config).Blob(profile);
  }
  RegistryOps& Join(uint8_t slot, int32_t rank) { return Byte(kJoinJob).Byte(slot).I32(rank); }
  RegistryOps& Submit(uint8_t slot, Step step, bool planned_locally, const std::string& request) {
    return Byte(kSubmitBatch)
        .Byte(slot)
        .StepField(step)
        .Byte(planned_locally ? 1 : 0)
        .Blob(request);
  }
  RegistryOps& GetPlan(uint8_t slot, Step step, int32_t rank) {
    return Byte(kGetPlan).Byte(slot).StepField(step).I32(rank);
  }
  RegistryOps& Report(uint8_t slot, Step step, const std::string& request) {
    return Byte(kReportStep).Byte(slot).StepField(step).Blob(request);
  }
  RegistryOps& Update(uint8_t slot, const std::string& request) {
    return Byte(kUpdateJobConfig).Byte(slot).Blob(request);
  }
  RegistryOps& Upload(uint8_t slot, const std::string& profile) {
    return Byte(kUploadProfile).Byte(slot).Blob(profile);
  }
  RegistryOps& Delete(uint8_t slot) { return Byte(kDeleteJob).Byte(slot); }
  RegistryOps& Restart() { return Byte(kRestart); }
  RegistryOps& Get(uint8_t slot) { return Byte(kGetJob).Byte(slot); }
  RegistryOps& ReportBatch(uint8_t slot, Step step, const std::string& request) {
    return Byte(kReportSteps).Byte(slot).StepField(step).Blob(request);
  }

  const std::string& bytes() const { return bytes_; }

 private:
  RegistryOps& Byte(uint8_t b) {
    bytes_.push_back(static_cast<char>(b));
    return *this;
  }
  RegistryOps& I32(int32_t v) { return Le(static_cast<uint64_t>(static_cast<uint32_t>(v)), 4); }
  RegistryOps& Le(uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) Byte(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  RegistryOps& StepField(Step step) {
    Byte(step.mode);
    if (step.mode == kStepRaw) Le(static_cast<uint64_t>(step.value), 8);
    if (step.mode == kStepAhead) Byte(static_cast<uint8_t>(step.value));
    return *this;
  }
  RegistryOps& Blob(const std::string& blob) {
    const size_t size = blob.size() < 0xffff ? blob.size() : 0xffff;
    Le(size, 2);
    bytes_.append(blob, 0, size);
    return *this;
  }

  std::string bytes_;
};

}  // namespace fuzz
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_TESTS_FUZZ_REGISTRY_OPS_H_
