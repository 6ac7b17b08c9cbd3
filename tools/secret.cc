#include "tools/secret.h"

#include <fstream>

#include "absl/status/status.h"

namespace sparsebalance::tools {

absl::StatusOr<std::string> RandomHex(int n) {
  static constexpr char kHex[] = "0123456789abcdef";
  if (n < 0) return absl::InvalidArgumentError("a random secret of a negative length");
  std::ifstream urandom("/dev/urandom", std::ios::binary);
  std::string bytes((n + 1) / 2, '\0');
  urandom.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!urandom) return absl::InternalError("cannot read /dev/urandom for a random secret");
  std::string out;
  for (unsigned char b : bytes) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  out.resize(n);
  return out;
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  }
  return diff == 0;
}

}  // namespace sparsebalance::tools
