// CRC32C (Castagnoli, RFC 3720), the checksum of the state directory's framed records
// (plan_store.h). Computed with the CPU's crc32 instruction where it has one (SSE4.2 on
// x86-64: 8 bytes an instruction), else with slicing-by-8 tables; both give the same bits
// (crc32c_test compares them). The byte-at-a-time table this replaces cost 1.4% of the
// planner's CPU in a 4,096-rank step round: a report record of a few hundred bytes is
// checksummed on every ReportStep.
//
//   uint32_t crc = Crc32c("123456789");                     // 0xE3069283
//   uint32_t same = ~Crc32cExtend(Crc32cExtend(~0u, "1234"), "56789");
#ifndef SPARSEBALANCE_SERVER_CRC32C_H_
#define SPARSEBALANCE_SERVER_CRC32C_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace sparsebalance {

// The raw register update over `data` (no inversion before or after), so that a checksum can
// run over pieces: Crc32c(a + b) == ~Crc32cExtend(Crc32cExtend(~0u, a), b).
uint32_t Crc32cExtend(uint32_t crc, absl::string_view data);
// The checksum of `data`: ~Crc32cExtend(~0u, data).
inline uint32_t Crc32c(absl::string_view data) { return ~Crc32cExtend(~uint32_t{0}, data); }

namespace crc32c_internal {
// The two ways Crc32cExtend may take, for the test that compares them. ExtendHardware may only
// be called where HasHardware() is true.
uint32_t ExtendPortable(uint32_t crc, absl::string_view data);
bool HasHardware();
uint32_t ExtendHardware(uint32_t crc, absl::string_view data);
}  // namespace crc32c_internal

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SERVER_CRC32C_H_
