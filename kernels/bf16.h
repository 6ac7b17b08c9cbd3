// bf16 <-> fp32 on the host (round to nearest even), for feeding the CUDA kernels and reading
// their results. bf16 values are stored as uint16_t.
#ifndef SPARSEBALANCE_KERNELS_BF16_H_
#define SPARSEBALANCE_KERNELS_BF16_H_

#include <cstdint>
#include <cstring>

namespace sparsebalance {
namespace kernels {

inline uint16_t FloatToBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN stays a (quiet) NaN
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float Bf16ToFloat(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_BF16_H_
