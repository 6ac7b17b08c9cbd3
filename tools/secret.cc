#include "tools/secret.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>

#include <climits>
#include <cstdint>
#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace sparsebalance::tools {

absl::StatusOr<std::string> RandomBytes(size_t n) {
  std::string bytes(n, '\0');
  if (n == 0) return bytes;
  std::ifstream urandom("/dev/urandom", std::ios::binary);
  urandom.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!urandom) return absl::InternalError("cannot read /dev/urandom for random bytes");
  return bytes;
}

absl::StatusOr<std::string> RandomHex(int n) {
  static constexpr char kHex[] = "0123456789abcdef";
  if (n < 0) return absl::InvalidArgumentError("a random secret of a negative length");
  absl::StatusOr<std::string> bytes = RandomBytes(static_cast<size_t>((n + 1) / 2));
  if (!bytes.ok()) return bytes.status();
  std::string out;
  for (unsigned char b : *bytes) {
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

std::string Sha256(absl::string_view data) {
  std::string digest(SHA256_DIGEST_LENGTH, '\0');
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(),
         reinterpret_cast<unsigned char*>(digest.data()));
  return digest;
}

absl::StatusOr<std::string> HmacSha256(absl::string_view key, absl::string_view message) {
  if (key.size() > static_cast<size_t>(INT_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("HMAC key of ", key.size(), " bytes"));
  }
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int mac_bytes = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac,
           &mac_bytes) == nullptr ||
      mac_bytes != kHmacSha256Bytes) {
    return absl::InternalError("OpenSSL could not compute an HMAC-SHA256");
  }
  return std::string(reinterpret_cast<const char*>(mac), mac_bytes);
}

absl::StatusOr<std::string> ChallengeProof(absl::string_view secret, absl::string_view label,
                                           absl::string_view listener_nonce,
                                           absl::string_view client_nonce,
                                           absl::string_view channel) {
  std::string message;
  for (absl::string_view field : {label, listener_nonce, client_nonce, channel}) {
    if (field.size() > UINT32_MAX) {
      return absl::InvalidArgumentError("a challenge-response field over 4 GiB");
    }
    const uint32_t n = static_cast<uint32_t>(field.size());
    for (int shift = 24; shift >= 0; shift -= 8) {
      message.push_back(static_cast<char>((n >> shift) & 0xff));
    }
    message.append(field.data(), field.size());
  }
  return HmacSha256(secret, message);
}

}  // namespace sparsebalance::tools
