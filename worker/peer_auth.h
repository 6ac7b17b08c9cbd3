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
#include <cstdint>
#include <functional>
#include <iostream>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

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

// The lines a listener writes about the connections it refuses, bounded: a local process that
// connects in a loop must not fill a worker's log (every refusal wrote one line before). The
// first `burst` lines are written; after that at most one line every `interval`, which says how
// many refusals since went unwritten. Every refusal is still counted by its listener
// (refused_connections()). Thread-safe: each line is one write, whole.
//
//   RefusalLog log;  // to std::cerr: 10 lines, then at most one a minute
//   log.Write("shard exchange: rank 3 dropped an incoming connection: ...\n");
class RefusalLog {
 public:
  static constexpr int kDefaultBurst = 10;

  // `clock` is absl::Now but in tests.
  explicit RefusalLog(std::ostream& out = std::cerr, int burst = kDefaultBurst,
                      absl::Duration interval = absl::Minutes(1),
                      std::function<absl::Time()> clock = absl::Now);

  // Writes `line` (ending in a newline), or counts it when the bound is reached.
  void Write(absl::string_view line);

  int64_t written() const;
  int64_t unwritten() const;  // refusals not written so far (also those reported in a later line)

 private:
  std::ostream& out_;
  const int burst_;
  const absl::Duration interval_;
  const std::function<absl::Time()> clock_;
  mutable absl::Mutex mu_;
  int64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t unwritten_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t unwritten_since_last_ ABSL_GUARDED_BY(mu_) = 0;  // since the last line written
  absl::Time last_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_WORKER_PEER_AUTH_H_
