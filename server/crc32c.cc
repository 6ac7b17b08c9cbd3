#include "server/crc32c.h"

#include <array>
#include <cstddef>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace sparsebalance {
namespace crc32c_internal {
namespace {

// tables[0] is the classic byte-at-a-time table of the reflected polynomial 0x82F63B78;
// tables[k][b] is the register after b followed by k zero bytes, so that 8 bytes advance in
// one step of eight lookups.
using Tables = std::array<std::array<uint32_t, 256>, 8>;

const Tables& SliceTables() {
  static const Tables tables = [] {
    Tables t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) != 0 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[0][i] = c;
    }
    for (int k = 1; k < 8; ++k) {
      for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
    }
    return t;
  }();
  return tables;
}

// Four bytes as a little-endian number, whatever the host's order.
uint32_t Le32(const unsigned char* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

}  // namespace

uint32_t ExtendPortable(uint32_t crc, absl::string_view data) {
  const Tables& t = SliceTables();
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  size_t n = data.size();
  for (; n >= 8; p += 8, n -= 8) {
    const uint32_t lo = crc ^ Le32(p);
    const uint32_t hi = Le32(p + 4);
    crc = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
          t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
  }
  for (; n > 0; ++p, --n) crc = t[0][(crc ^ *p) & 0xff] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)

bool HasHardware() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}

// The crc32 instruction implements exactly this register update (the same polynomial,
// reflected, no inversion).
__attribute__((target("sse4.2"))) uint32_t ExtendHardware(uint32_t crc, absl::string_view data) {
  const char* p = data.data();
  size_t n = data.size();
  uint64_t c = crc;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t word;
    std::memcpy(&word, p, sizeof(word));
    c = _mm_crc32_u64(c, word);
  }
  auto c32 = static_cast<uint32_t>(c);
  for (; n > 0; ++p, --n) c32 = _mm_crc32_u8(c32, static_cast<unsigned char>(*p));
  return c32;
}

#else

bool HasHardware() { return false; }
uint32_t ExtendHardware(uint32_t crc, absl::string_view data) { return ExtendPortable(crc, data); }

#endif

}  // namespace crc32c_internal

uint32_t Crc32cExtend(uint32_t crc, absl::string_view data) {
  return crc32c_internal::HasHardware() ? crc32c_internal::ExtendHardware(crc, data)
                                        : crc32c_internal::ExtendPortable(crc, data);
}

}  // namespace sparsebalance
