// The tensor transport of context parallelism between CPU ranks (issue 15, DESIGN.md section
// 9): direct rank-to-rank TCP connections, their addresses exchanged through the step-sync hub
// (worker/step_sync.h: ADDRESS / WHERE). Each rank listens on 127.0.0.1 (a free port),
// registers its address, connects to a peer on its first message to it and keeps the
// connection. A connection opens with a mutual challenge-response on the run's secret (the
// step-sync hub's, see worker/step_sync.h for where it comes from; proofs: worker/peer_auth.h,
// HMAC-SHA256 under the secret of both nonces and the receiver's address):
//
//   magic "SBA2" (u32) | receiver nonce (32 bytes)                      receiver -> sender
//   magic "SBA2" (u32) | sender nonce (32 bytes) | sender's proof (32)  sender -> receiver
//   1 (u8) | receiver's proof (32)  or  0 (u8: refused, then closed)    receiver -> sender
//
// The secret never crosses the wire, and the sender checks the receiver's proof before it sends
// a frame: what answers at a stale or taken-over address learns nothing and is refused
// (UNAUTHENTICATED naming the peer and the address).
//
// Then each message is a binary frame, a fixed header then the payload:
//
//   magic "SBX1" (u32) | from rank (i32) | step (i64) | micro-batch (i32) | layer (i32) |
//   sample id (u64) | kind (i32) | reserved (i32) | payload bytes (u64) | payload
//
// (host byte order: the ranks share a machine). Received frames go to a mailbox keyed by
// (from rank, ExchangeKey) on the receiver's reader threads, so a send never waits for the
// receiver to ask: a rank may send everything its peers need before it waits for anything,
// and messages of different steps, micro-batches, samples, layers and kinds never mix.
// Receive waits for one message at most the exchange's timeout, then DEADLINE_EXCEEDED naming
// the peer, the kind and the key (a peer that never arrives fails, never hangs).
// The port takes any local connection, of any user: one that does not prove the secret
// (checked in constant time) within auth_timeout_seconds, or then sends a frame whose header
// names no other rank of the job, no known kind or more payload than the job's shapes allow,
// is refused: closed, counted (refused_connections()) and reported in one line on stderr (the first
// ten, then one a minute: RefusalLog) that never holds the secret, and nothing it sent reaches
// Receive; the exchange goes on serving its peers. What the handshake leaves open is the hub's
// (worker/step_sync.h). Each connection has a reader thread, joined as the next connection comes in
// once it has ended, so that refused connections leave none behind; at most
// kMaxPendingAuthConnections of them wait to authenticate (worker/peer_auth.h), a newer connection
// dropping the oldest (refused the same way), so a flood of idle connections holds a bounded number
// of threads.
//
//   ShardExchangeOptions options;
//   options.secret = secret;  // the run's (sb-run's --sync_secret_file)
//   options.world_size = ranks;
//   options.max_payload_bytes = MaxShardPayloadBytes(longest_document, heads, head_dim);
//   auto ex = ShardExchange::Start(rank, hub->address(), options);
//   ExchangeKey key{step, micro_batch, sample_id, layer, ExchangeKind::kPooledKeys};
//   (*ex)->Send(peer, key, bytes);
//   absl::StatusOr<std::string> got = (*ex)->Receive(peer, key);
#ifndef SPARSEBALANCE_WORKER_SHARD_EXCHANGE_H_
#define SPARSEBALANCE_WORKER_SHARD_EXCHANGE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/peer_auth.h"

namespace sparsebalance {

enum class ExchangeKind : int32_t {
  kPooledKeys = 1,  // a shard's pooled key blocks and its token range, to the later shards
  kKeyRequest = 2,  // the key blocks a shard needs of an owner's chunk
  kKeyValues = 3,   // those blocks' keys and values, owner to shard
  kGradients = 4,   // their key and value gradients, shard back to the owner
};
const char* ExchangeKindName(ExchangeKind kind);

struct ExchangeKey {
  int64_t step = 0;
  int32_t micro_batch = 0;
  uint64_t sample_id = 0;
  int32_t layer = 0;
  ExchangeKind kind = ExchangeKind::kPooledKeys;

  auto Tie() const { return std::tie(step, micro_batch, sample_id, layer, kind); }
  bool operator<(const ExchangeKey& o) const { return Tie() < o.Tie(); }
  bool operator==(const ExchangeKey& o) const { return Tie() == o.Tie(); }
  // "pooled keys of sample 7 (step 3, micro-batch 0, layer 1)"
  std::string ToString() const;
};

struct ShardExchangeOptions {
  // The run's secret, proven to the hub and to every peer (CheckSyncSecret: required; there is
  // no unauthenticated mode).
  std::string secret;
  // A connection that has not proven the secret by then is dropped, seconds.
  double auth_timeout_seconds = 5.0;
  // Longest wait for one message (and for a peer's address at the hub), seconds.
  double timeout_seconds = 120.0;
  // Ranks of the job (> this rank): frames claiming to come from a rank outside it are refused.
  int world_size = 0;
  // Largest payload a peer may send in one frame, bytes (> 0): the job's shapes bound it
  // (worker/shard_layer.h: MaxShardPayloadBytes); a larger header is refused before anything
  // is allocated for it.
  uint64_t max_payload_bytes = 0;
};

class ShardExchange {
 public:
  // Listens on 127.0.0.1 and registers the address as `rank`'s with the hub at `hub_address`.
  static absl::StatusOr<std::unique_ptr<ShardExchange>> Start(
      int rank, const std::string& hub_address, const ShardExchangeOptions& options = {});
  ~ShardExchange();
  ShardExchange(const ShardExchange&) = delete;
  ShardExchange& operator=(const ShardExchange&) = delete;

  int rank() const { return rank_; }
  std::string address() const;  // host:port this rank listens on
  const ShardExchangeOptions& options() const { return options_; }

  // Sends one message to `peer` (connecting first if needed: its address from the hub). A
  // broken connection is replaced once (the peer may have restarted). UNAVAILABLE or
  // DEADLINE_EXCEEDED naming the peer when it cannot be reached.
  absl::Status Send(int peer, const ExchangeKey& key, absl::string_view payload);
  // The oldest message from `peer` under `key`, waiting up to the timeout.
  absl::StatusOr<std::string> Receive(int peer, const ExchangeKey& key);

  int64_t bytes_sent() const { return bytes_sent_.load(); }
  int64_t bytes_received() const { return bytes_received_.load(); }
  // Incoming connections dropped for not proving the secret (in time, or before
  // kMaxPendingAuthConnections newer ones came), or for a frame header no peer of the job sends.
  int64_t refused_connections() const { return refused_connections_.load(); }
  // The lines written about them (the first few, then one a minute: RefusalLog).
  const RefusalLog& refusal_log() const { return refusal_log_; }

 private:
  ShardExchange(int rank, std::string hub_address, const ShardExchangeOptions& options,
                int listen_fd, int port);
  void AcceptLoop();
  // The receiver's side of the challenge-response on `fd` (reader: its serial number): whether
  // the connection proved the secret in time (refused and reported if not) and was answered
  // with this exchange's proof.
  bool Authenticate(int fd, int64_t reader);
  // The sender's side on a fresh connection `fd` to `peer` at `address`: OK once both proved
  // the secret; PERMISSION_DENIED when the peer refuses it, UNAUTHENTICATED when what answers
  // does not prove it (nothing else was sent to it).
  absl::Status ProveToPeer(int fd, int peer, const std::string& address);
  void ReportRefused(int from, const std::string& why);  // counts and names a dropped connection
  void ReadLoop(int fd, int64_t reader);
  absl::StatusOr<int> Connection(int peer);  // under send_mu_

  const int rank_;
  const std::string hub_address_;
  const ShardExchangeOptions options_;
  const int listen_fd_;
  const int port_;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> bytes_sent_{0};
  std::atomic<int64_t> bytes_received_{0};
  std::atomic<int64_t> refused_connections_{0};
  RefusalLog refusal_log_;

  std::mutex send_mu_;
  std::map<int, int> out_fds_;  // peer -> connected socket

  std::mutex mu_;  // guards what follows
  std::condition_variable arrived_;
  std::map<std::pair<int, ExchangeKey>, std::deque<std::string>> mailbox_;
  std::set<int> in_fds_;
  std::set<int> closed_peers_;  // peers whose connection to us closed (a hint in errors)
  // One reader thread per incoming connection, by serial number, until joined; those whose
  // connection ended, to be joined by the acceptor (or at the end).
  std::map<int64_t, std::thread> readers_;
  std::vector<int64_t> ended_readers_;
  // The connections (reader serial -> fd) that have not authenticated yet, oldest first: at most
  // kMaxPendingAuthConnections (worker/peer_auth.h).
  std::map<int64_t, int> pending_auth_;
  int64_t next_reader_ = 0;
  std::thread acceptor_;
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_WORKER_SHARD_EXCHANGE_H_
