// The mutual challenge-response that opens every connection to the step-sync hub and to a
// rank's shard-exchange port (wire formats: worker/step_sync.h, worker/shard_exchange.h). The
// listener sends a fresh nonce; the connecting side answers with its own nonce and its proof; the
// listener checks it (in constant time) and answers with its own proof, which the connecting side
// checks before it sends anything else. A proof is HMAC-SHA256 keyed with the run's secret over
// a label naming the protocol and the side that proves, both nonces and the listener's address as
// both ends see it (tools::ChallengeProof): the secret never crosses the wire, a proof is good
// for one connection only, cannot be reflected back to its sender or into the other protocol,
// and cannot be relayed from another port (a process that took over a stale port and forwards
// the handshake to the real listener sees both ends disagree on the address).
//
//   absl::StatusOr<std::string> nonce = tools::RandomBytes(kAuthNonceBytes);  // the listener's
//   absl::StatusOr<std::string> proof = AuthProof(secret, AuthRole::kHubClient, *nonce,
//                                                 client_nonce, ListenerEndpoint(fd, false));
#ifndef SPARSEBALANCE_WORKER_PEER_AUTH_H_
#define SPARSEBALANCE_WORKER_PEER_AUTH_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace sparsebalance {

// Who proves: each protocol's two sides have labels of their own.
enum class AuthRole {
  kHubClient,         // a rank (or a lookup) connecting to the step-sync hub
  kHub,               // the hub, answering it
  kExchangeSender,    // a rank connecting to a peer's shard-exchange port
  kExchangeReceiver,  // that peer, answering it
};

// Bytes of each side's nonce, and of a proof (HMAC-SHA256).
inline constexpr size_t kAuthNonceBytes = 32;
inline constexpr size_t kAuthProofBytes = 32;

// Connections a listener (the hub, each rank's exchange) keeps while they have not yet
// authenticated. Each holds a hub slot or an exchange reader thread for up to the auth timeout;
// a newer one beyond this many drops the oldest, refused and counted, so a flood of idle
// connections holds at most this many, while an honest peer (which authenticates within a
// round trip) still gets through unless the flood outpaces its handshake.
inline constexpr int kMaxPendingAuthConnections = 64;

// The proof of `role` on the connection whose listener sent `listener_nonce`, whose connecting
// side `client_nonce`, and whose listener is at `listener_endpoint` (ListenerEndpoint).
absl::StatusOr<std::string> AuthProof(absl::string_view secret, AuthRole role,
                                      absl::string_view listener_nonce,
                                      absl::string_view client_nonce,
                                      absl::string_view listener_endpoint);

// The listener's "ip:port" of the connected TCP socket `fd`: its own address when `listening`
// (an accepted socket), its peer's when not (a connected one). Empty when the socket has none.
std::string ListenerEndpoint(int fd, bool listening);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_WORKER_PEER_AUTH_H_
