#include "server/crc32c.h"

#include <cstdint>
#include <random>
#include <string>

#include "gtest/gtest.h"

namespace sparsebalance {
namespace {

using crc32c_internal::ExtendHardware;
using crc32c_internal::ExtendPortable;
using crc32c_internal::HasHardware;

// RFC 3720 B.4's check values, and the CRC catalogue's "123456789".
TEST(Crc32cTest, MatchesTheCastagnoliCheckValues) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending(32, '\0');
  for (int i = 0; i < 32; ++i) ascending[i] = static_cast<char>(i);
  EXPECT_EQ(Crc32c(ascending), 0x46DD794Eu);
  std::string descending(32, '\0');
  for (int i = 0; i < 32; ++i) descending[i] = static_cast<char>(31 - i);
  EXPECT_EQ(Crc32c(descending), 0x113FDB5Cu);
}

// The record checksum runs over the length bytes, then the body: pieces must chain.
TEST(Crc32cTest, PiecesChainToTheWhole) {
  const std::string text = "The quick brown fox jumps over the lazy dog, twice over.";
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    const uint32_t chained =
        ~Crc32cExtend(Crc32cExtend(~uint32_t{0}, text.substr(0, cut)), text.substr(cut));
    EXPECT_EQ(chained, Crc32c(text)) << "cut at " << cut;
  }
}

// Every length (the 8-byte steps and every tail) at every alignment, and random registers:
// the slicing tables and, where the CPU has it, the crc32 instruction give the same bits as
// the bit-at-a-time definition.
TEST(Crc32cTest, EveryWayGivesTheDefinitionsBits) {
  auto by_definition = [](uint32_t crc, const std::string& data) {
    for (unsigned char byte : data) {
      crc ^= byte;
      for (int k = 0; k < 8; ++k) crc = (crc & 1) != 0 ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    }
    return crc;
  };
  std::mt19937_64 random(7);
  std::string buffer(300, '\0');
  for (char& c : buffer) c = static_cast<char>(random());
  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t length = 0; length + offset <= buffer.size(); length += 1 + length / 16) {
      const std::string data = buffer.substr(offset, length);
      const auto crc = static_cast<uint32_t>(random());
      const uint32_t expected = by_definition(crc, data);
      EXPECT_EQ(ExtendPortable(crc, data), expected) << offset << "+" << length;
      EXPECT_EQ(Crc32cExtend(crc, data), expected) << offset << "+" << length;
      if (HasHardware()) {
        EXPECT_EQ(ExtendHardware(crc, data), expected) << offset << "+" << length;
      }
    }
  }
}

}  // namespace
}  // namespace sparsebalance
