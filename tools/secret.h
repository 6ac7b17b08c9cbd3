// Secrets shared by the planner (job tokens) and the CPU workers (the step-sync secret, which
// sb-run draws per run): random bytes and hex from the kernel's CSPRNG, a comparison whose time
// does not depend on where two strings first differ (so that timing a refusal does not reveal a
// secret byte by byte), and HMAC-SHA256 (OpenSSL) with the challenge-response proof built on it,
// with which two ends show each other that they hold a secret without sending it.
//
//   absl::StatusOr<std::string> secret = tools::RandomHex(64);  // 32 random bytes
//   if (!tools::ConstantTimeEquals(offered, *secret)) ... refuse ...
//   absl::StatusOr<std::string> nonce = tools::RandomBytes(32);  // a fresh challenge
//   absl::StatusOr<std::string> proof =
//       tools::ChallengeProof(*secret, "my-protocol client", *nonce, their_nonce, "127.0.0.1:80");
#ifndef SPARSEBALANCE_TOOLS_SECRET_H_
#define SPARSEBALANCE_TOOLS_SECRET_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace sparsebalance::tools {

// `n` random bytes from /dev/urandom (a nonce); INTERNAL when it cannot be read.
absl::StatusOr<std::string> RandomBytes(size_t n);

// `n` lower-case hex digits (n / 2 random bytes, rounded up) from /dev/urandom; INTERNAL when
// it cannot be read.
absl::StatusOr<std::string> RandomHex(int n);

// Whether `a` and `b` are equal, in time that depends on their length only (the length of a
// token is not secret; its bytes are).
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// Bytes of an HMAC-SHA256 value.
inline constexpr size_t kHmacSha256Bytes = 32;

// The SHA-256 digest of `data`: 32 raw bytes (the planner keys job tokens by theirs, so that a
// lookup's time tells nothing about how close an offered token is to a real one).
std::string Sha256(absl::string_view data);

// HMAC-SHA256 (RFC 2104 over SHA-256) of `message` under `key`: kHmacSha256Bytes raw bytes.
// INTERNAL when OpenSSL fails (it does not for keys under 2 GiB).
absl::StatusOr<std::string> HmacSha256(absl::string_view key, absl::string_view message);

// One side's proof in a challenge-response on `secret`: HMAC-SHA256 keyed with `secret` over
// `label`, `listener_nonce`, `client_nonce` and `channel`, each preceded by its length (4 bytes,
// big-endian), so that no two different lists of fields give the same message. `label` names the
// protocol and the side that proves (a proof of one side is never the other's, so it cannot be
// reflected); both nonces make it good for one connection; `channel` names the connection as
// both ends see it (the listener's address), so it cannot be relayed to another.
absl::StatusOr<std::string> ChallengeProof(absl::string_view secret, absl::string_view label,
                                           absl::string_view listener_nonce,
                                           absl::string_view client_nonce,
                                           absl::string_view channel);

}  // namespace sparsebalance::tools

#endif  // SPARSEBALANCE_TOOLS_SECRET_H_
