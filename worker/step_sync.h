// The per-step synchronisation of CPU workers: what the gradient all-reduce is on GPUs (NCCL),
// so that a fast rank really waits for the slowest and its waiting time is real. A hub (run
// by sb-run, like torchrun's rendezvous store) and one client per rank, over TCP with one text
// line per message (nonces and proofs in lower-case hex):
//
//   hub  -> any   CHALLENGE 2 <hub nonce>           (on accepting; 2: the protocol's version)
//   any  -> hub   AUTH <client nonce> <proof>       (first on every connection)
//   hub  -> any   OK <hub's proof>  or  DENIED      (DENIED: the hub then closes it)
//   rank -> hub   HELLO <rank>                      (on every connect; replaces an old one)
//   rank -> hub   ARRIVE <step> <phase> <value>
//   hub  -> rank  RELEASE <step> <phase> <max value over ranks>
//
// A (step, phase) is released when every rank has arrived; arriving again (a restarted rank)
// is harmless and, once released, answered at once. Phases: kPlanPhase (all-reduce of "I fell
// back to the local plan") and kGradientPhase (the step's end).
//
// The hub is also the address book of the ranks' shard exchange (worker/shard_exchange.h), on
// connections of their own (no HELLO, so they never replace a rank's step-sync connection):
//
//   rank -> hub   ADDRESS <rank> <host:port>        (registers; a restarted rank replaces it)
//   hub  -> rank  OK
//   rank -> hub   WHERE <rank>
//   hub  -> rank  AT <rank> <host:port>  or  AT <rank> -   (not registered yet)
//
// Authentication: the port takes connections from any local process, of any user, so the hub,
// its clients and the shard exchange share the run's secret (sb-run draws it from the kernel's
// CSPRNG for each run and hands it to each worker in a 0600 file, never on a command line), and
// each connection opens with a mutual challenge-response on it (worker/peer_auth.h): the proofs
// are HMAC-SHA256 under the secret of both sides' fresh nonces and the hub's address, so the
// secret never crosses the wire, a proof is good for one connection only, and the client checks
// the hub's before it sends anything else (a process that took the hub's port over learns
// nothing and is refused: UNAUTHENTICATED naming the address). A connection is acted on only
// after its AUTH line proves the secret (checked in constant time); a wrong or missing proof,
// none within auth_timeout_seconds, or a first line longer than any AUTH line, is answered
// DENIED and closed, counted (refused_connections()) and reported in one line on stderr (the first
// ten, then one a minute: RefusalLog) that never holds the secret. At most
// kMaxPendingAuthConnections connections wait to authenticate: a newer one drops the oldest
// (refused the same way). Once authenticated, a line longer than any of the protocol's (512 bytes)
// closes its connection, with a line on stderr. Left open: a local process can still flood the port
// fast enough to crowd honest connections out (denial of service, not access), and loopback traffic
// after the handshake is not encrypted or authenticated frame by frame, which only root
// (CAP_NET_RAW) could read or alter, and root can read the secret's file anyway. There is no
// unauthenticated mode: an empty or short secret is refused (CheckSyncSecret), tests included.
//
//   auto hub = StepSyncHub::Start(/*ranks=*/4, {secret});  // in the launcher
//   auto sync = StepSyncClient::Connect((*hub)->address(), secret, rank);
//   absl::StatusOr<double> any = sync->AllReduceMax(step, kPlanPhase, fell_back ? 1 : 0);
#ifndef SPARSEBALANCE_WORKER_STEP_SYNC_H_
#define SPARSEBALANCE_WORKER_STEP_SYNC_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/peer_auth.h"

namespace sparsebalance {

inline constexpr int kPlanPhase = 0;
inline constexpr int kGradientPhase = 1;

// Bounds of the run's secret, bytes: enough to be unguessable, and one word of a secret file.
inline constexpr size_t kMinSyncSecretBytes = 16;
inline constexpr size_t kMaxSyncSecretBytes = 256;

// OK when `secret` can be a run's secret: kMinSyncSecretBytes to kMaxSyncSecretBytes printable
// ASCII characters, no spaces (sb-run's: 64 hex digits). INVALID_ARGUMENT naming what is wrong,
// never quoting the secret.
absl::Status CheckSyncSecret(absl::string_view secret);

struct StepSyncHubOptions {
  std::string secret;  // the run's secret (CheckSyncSecret): required
  int port = 0;        // on 127.0.0.1; 0: a free port
  // A connection that has not proven the secret by then is dropped, seconds.
  double auth_timeout_seconds = 5.0;
};

class StepSyncHub {
 public:
  // Listens on 127.0.0.1 and serves until destroyed.
  static absl::StatusOr<std::unique_ptr<StepSyncHub>> Start(int ranks,
                                                            const StepSyncHubOptions& options);
  ~StepSyncHub();
  std::string address() const;  // host:port
  // Connections dropped for a wrong or missing proof, none in time, or to make room for newer
  // ones (kMaxPendingAuthConnections).
  int64_t refused_connections() const { return refused_connections_.load(); }
  // The lines written about them (the first few, then one a minute: RefusalLog).
  const RefusalLog& refusal_log() const { return refusal_log_; }

 private:
  StepSyncHub(int ranks, StepSyncHubOptions options, int listen_fd, int port);
  void Serve();

  const int ranks_;
  const StepSyncHubOptions options_;
  const int listen_fd_;
  const int port_;
  std::atomic<int64_t> refused_connections_{0};
  RefusalLog refusal_log_;
  int wake_fds_[2] = {-1, -1};  // a pipe that ends Serve()
  std::thread thread_;
};

// Each call below proves `secret` to the hub first, and checks the hub's proof before it sends
// anything else: PERMISSION_DENIED when the hub refuses it (a secret of another run),
// UNAUTHENTICATED naming the address when what answers there does not prove the secret (not
// this run's hub), INVALID_ARGUMENT when CheckSyncSecret does.

// Registers `rank`'s shard-exchange listen address with the hub at `hub_address`.
absl::Status RegisterRankAddress(const std::string& hub_address, const std::string& secret,
                                 int rank, const std::string& address, double timeout_seconds = 60);
// The address `rank` registered, asking again until it has or `timeout_seconds` passed
// (DEADLINE_EXCEEDED naming the rank).
absl::StatusOr<std::string> LookupRankAddress(const std::string& hub_address,
                                              const std::string& secret, int rank,
                                              double timeout_seconds = 60);

class StepSyncClient {
 public:
  // Connects (waiting up to `timeout_seconds` for a hub that is still starting), and the hub
  // and this client prove `secret` to each other.
  static absl::StatusOr<std::unique_ptr<StepSyncClient>> Connect(const std::string& address,
                                                                 const std::string& secret,
                                                                 int rank,
                                                                 double timeout_seconds = 60);
  ~StepSyncClient();
  // Blocks until every rank has arrived at (step, phase); returns the largest value. Reconnects
  // once if the hub connection broke. DEADLINE_EXCEEDED after `timeout_seconds`.
  absl::StatusOr<double> AllReduceMax(int64_t step, int phase, double value,
                                      double timeout_seconds = 600);

 private:
  StepSyncClient(std::string address, std::string secret, int rank, int fd)
      : address_(std::move(address)), secret_(std::move(secret)), rank_(rank), fd_(fd) {}
  absl::StatusOr<double> Exchange(int64_t step, int phase, double value, double timeout_seconds);

  std::string address_;
  std::string secret_;
  int rank_;
  int fd_;
  std::string buffer_;  // bytes read past the last line
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_WORKER_STEP_SYNC_H_
