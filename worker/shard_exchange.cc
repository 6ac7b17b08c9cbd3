#include "worker/shard_exchange.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <new>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tools/secret.h"
#include "worker/peer_auth.h"
#include "worker/step_sync.h"

namespace sparsebalance {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x31584253;  // "SBX1" little-endian
// "SBA2" little-endian: the challenge-response opening ("SBA1" sent the secret itself).
constexpr uint32_t kAuthMagic = 0x32414253;

// The receiver's challenge, and the sender's answer to it (worker/peer_auth.h).
#pragma pack(push, 1)
struct AuthChallenge {
  uint32_t magic;
  char nonce[kAuthNonceBytes];
};
struct AuthResponse {
  uint32_t magic;
  char nonce[kAuthNonceBytes];
  char proof[kAuthProofBytes];
};
#pragma pack(pop)
static_assert(sizeof(AuthChallenge) == 36, "the challenge is 36 bytes");
static_assert(sizeof(AuthResponse) == 68, "the challenge's answer is 68 bytes");
// The receiver's verdict: kAccepted followed by its own proof, or kRefused.
constexpr char kAccepted = 1;
constexpr char kRefused = 0;

#pragma pack(push, 1)
struct FrameHeader {
  uint32_t magic;
  int32_t from;
  int64_t step;
  int32_t micro_batch;
  int32_t layer;
  uint64_t sample_id;
  int32_t kind;
  int32_t reserved;
  uint64_t bytes;
};
#pragma pack(pop)
static_assert(sizeof(FrameHeader) == 48, "the frame header is 48 bytes");

// A payload is read in pieces of at most this many bytes (1 MiB), so memory grows with the bytes
// that actually arrive, not with what a header claims.
constexpr uint64_t kReadPieceBytes = uint64_t{1} << 20;

bool SendAll(int fd, const char* data, size_t size) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = send(fd, data + done, size - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

bool RecvAll(int fd, char* data, size_t size) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = recv(fd, data + done, size - done, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

Clock::time_point DeadlineIn(double seconds) {
  return Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

enum class ReadResult { kDone, kClosed, kLate };

// RecvAll that gives up at `deadline`, however slowly the bytes trickle in.
ReadResult RecvAllBy(int fd, char* data, size_t size, Clock::time_point deadline) {
  size_t done = 0;
  while (done < size) {
    const int64_t left_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left_ms <= 0) return ReadResult::kLate;
    pollfd p{fd, POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(std::min<int64_t>(left_ms, 1 << 30)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return ReadResult::kClosed;
    if (ready == 0) continue;
    const ssize_t n = recv(fd, data + done, size - done, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return ReadResult::kClosed;
    done += static_cast<size_t>(n);
  }
  return ReadResult::kDone;
}

// Why a frame header is refused, or empty when a peer of the job may send it. `from`: the rank
// the connection's earlier frames came from (-1: none yet).
std::string RefuseHeader(const FrameHeader& h, int from, int rank, const ShardExchangeOptions& o) {
  if (h.magic != kMagic) {
    return absl::StrCat("its frame header's magic ", h.magic, " is not \"SBX1\"");
  }
  if (h.from < 0 || h.from >= o.world_size || h.from == rank) {
    return absl::StrCat("its frame header names rank ", h.from, ", no other rank of a job of ",
                        o.world_size);
  }
  if (from >= 0 && h.from != from) {
    return absl::StrCat("its frame header names rank ", h.from, " on a connection of rank ", from);
  }
  if (h.kind < static_cast<int32_t>(ExchangeKind::kPooledKeys) ||
      h.kind > static_cast<int32_t>(ExchangeKind::kGradients)) {
    return absl::StrCat("its frame header's kind ", h.kind, " is no message kind (1 to 4)");
  }
  if (h.bytes > o.max_payload_bytes) {
    return absl::StrCat("its frame header announces ", h.bytes, " payload bytes, more than the ",
                        o.max_payload_bytes, " the job's shapes allow");
  }
  return "";
}

}  // namespace

const char* ExchangeKindName(ExchangeKind kind) {
  switch (kind) {
    case ExchangeKind::kPooledKeys:
      return "pooled keys";
    case ExchangeKind::kKeyRequest:
      return "key block request";
    case ExchangeKind::kKeyValues:
      return "key/value blocks";
    case ExchangeKind::kGradients:
      return "key/value gradients";
  }
  return "unknown message";
}

std::string ExchangeKey::ToString() const {
  return absl::StrCat(ExchangeKindName(kind), " of sample ", sample_id, " (step ", step,
                      ", micro-batch ", micro_batch, ", layer ", layer, ")");
}

absl::StatusOr<std::unique_ptr<ShardExchange>> ShardExchange::Start(
    int rank, const std::string& hub_address, const ShardExchangeOptions& options) {
  if (rank < 0) return absl::InvalidArgumentError(absl::StrCat("rank: ", rank, " < 0"));
  if (!(options.timeout_seconds > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_seconds: ", options.timeout_seconds, " must be positive"));
  }
  if (options.world_size <= rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: ", options.world_size, " must exceed the rank ", rank));
  }
  if (options.max_payload_bytes == 0) {
    return absl::InvalidArgumentError(
        "max_payload_bytes: 0; set it from the job's shapes (MaxShardPayloadBytes)");
  }
  if (absl::Status s = CheckSyncSecret(options.secret); !s.ok()) return s;
  if (!(options.auth_timeout_seconds > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("auth_timeout_seconds: ", options.auth_timeout_seconds, " must be positive"));
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("shard exchange: socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(fd, 64) != 0) {
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("shard exchange: rank ", rank, " cannot listen: ", std::strerror(errno)));
  }
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  std::unique_ptr<ShardExchange> ex(
      new ShardExchange(rank, hub_address, options, fd, ntohs(addr.sin_port)));
  ex->acceptor_ = std::thread([e = ex.get()] { e->AcceptLoop(); });
  if (absl::Status s = RegisterRankAddress(hub_address, options.secret, rank, ex->address(),
                                           options.timeout_seconds);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("shard exchange: rank ", rank, ": ", s.message()));
  }
  return ex;
}

ShardExchange::ShardExchange(int rank, std::string hub_address, const ShardExchangeOptions& options,
                             int listen_fd, int port)
    : rank_(rank),
      hub_address_(std::move(hub_address)),
      options_(options),
      listen_fd_(listen_fd),
      port_(port) {}

ShardExchange::~ShardExchange() {
  stopping_ = true;
  shutdown(listen_fd_, SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  std::map<int64_t, std::thread> readers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : in_fds_) shutdown(fd, SHUT_RDWR);
    readers.swap(readers_);
  }
  for (auto& [serial, t] : readers) t.join();
  close(listen_fd_);  // each reader closed its own connection
  for (const auto& [peer, fd] : out_fds_) close(fd);
}

std::string ShardExchange::address() const { return absl::StrCat("127.0.0.1:", port_); }

void ShardExchange::AcceptLoop() {
  while (!stopping_) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return;  // shut down
    }
    // The readers whose connections ended since the last one: joined here, so that connections
    // that come and go (refused ones above all) leave no thread behind.
    std::vector<std::thread> ended;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) {
        close(fd);
        return;
      }
      for (int64_t serial : ended_readers_) {
        auto it = readers_.find(serial);
        ended.push_back(std::move(it->second));
        readers_.erase(it);
      }
      ended_readers_.clear();
      // Room for this connection among those waiting to authenticate: the oldest one goes.
      if (pending_auth_.size() >= static_cast<size_t>(kMaxPendingAuthConnections)) {
        auto oldest = pending_auth_.begin();
        ReportRefused(
            -1, absl::StrCat("it had not proven the run's secret when ", kMaxPendingAuthConnections,
                             " newer connections waited to (a flood of connections?)"));
        shutdown(oldest->second, SHUT_RDWR);  // its reader ends at once, and closes it
        pending_auth_.erase(oldest);
      }
      in_fds_.insert(fd);
      const int64_t serial = next_reader_++;
      pending_auth_.emplace(serial, fd);
      readers_.emplace(serial, std::thread([this, fd, serial] { ReadLoop(fd, serial); }));
    }
    for (std::thread& t : ended) t.join();
  }
}

void ShardExchange::ReportRefused(int from, const std::string& why) {
  ++refused_connections_;
  // One write, so that the lines of readers refusing at once do not interleave.
  refusal_log_.Write(absl::StrCat("shard exchange: rank ", rank_, " dropped an incoming connection",
                                  from >= 0 ? absl::StrCat(" of rank ", from) : std::string(), ": ",
                                  why, " (a stray or hostile local process?)\n"));
}

bool ShardExchange::Authenticate(int fd, int64_t reader) {
  const Clock::time_point deadline = DeadlineIn(options_.auth_timeout_seconds);
  // Whether this connection still waits to authenticate; false once the acceptor dropped it to
  // make room (and counted it). Either way it waits no more.
  auto still_pending = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_auth_.erase(reader) > 0;
  };
  auto refuse = [&](const std::string& why) {
    if (!still_pending()) return false;
    // Counted before the answer, which tells an honest sender with another run's secret why
    // its messages go nowhere.
    ReportRefused(-1, why);
    SendAll(fd, &kRefused, 1);
    return false;
  };
  auto unproven = [&](ReadResult read) {
    return refuse(read == ReadResult::kLate
                      ? absl::StrCat("it did not prove the run's secret within ",
                                     options_.auth_timeout_seconds, " s")
                      : std::string("it closed before proving the run's secret"));
  };
  AuthChallenge challenge{kAuthMagic, {}};
  absl::StatusOr<std::string> nonce = tools::RandomBytes(kAuthNonceBytes);
  const std::string endpoint = ListenerEndpoint(fd, /*listening=*/true);
  if (!nonce.ok()) return refuse(std::string(nonce.status().message()));
  if (endpoint.empty()) return refuse("its socket has no local address");
  std::memcpy(challenge.nonce, nonce->data(), kAuthNonceBytes);
  if (!SendAll(fd, reinterpret_cast<const char*>(&challenge), sizeof challenge)) {
    return unproven(ReadResult::kClosed);
  }
  AuthResponse response;
  const ReadResult read =
      RecvAllBy(fd, reinterpret_cast<char*>(&response), sizeof response, deadline);
  if (read != ReadResult::kDone) return unproven(read);
  if (response.magic != kAuthMagic) {
    return refuse(absl::StrCat("its first bytes (", response.magic,
                               ") are not the \"SBA2\" answer to the challenge"));
  }
  const absl::string_view client_nonce(response.nonce, kAuthNonceBytes);
  absl::StatusOr<std::string> expected =
      AuthProof(options_.secret, AuthRole::kExchangeSender, *nonce, client_nonce, endpoint);
  absl::StatusOr<std::string> answer =
      AuthProof(options_.secret, AuthRole::kExchangeReceiver, *nonce, client_nonce, endpoint);
  if (!expected.ok() || !answer.ok()) {
    return refuse(absl::StrCat("no proof to check it against: ",
                               (expected.ok() ? answer : expected).status().message()));
  }
  if (!tools::ConstantTimeEquals(absl::string_view(response.proof, kAuthProofBytes), *expected)) {
    return refuse("it does not prove the run's secret");
  }
  if (!still_pending()) return false;
  // The receiver proves the secret in turn: the sender sends no frame before it checked this.
  const std::string verdict = std::string(1, kAccepted) + *answer;
  return SendAll(fd, verdict.data(), verdict.size());
}

void ShardExchange::ReadLoop(int fd, int64_t reader) {
  int from = -1;
  std::string refused;
  const bool authenticated = Authenticate(fd, reader);
  while (authenticated) {
    FrameHeader h;
    if (!RecvAll(fd, reinterpret_cast<char*>(&h), sizeof h)) break;
    refused = RefuseHeader(h, from, rank_, options_);
    if (!refused.empty()) break;
    from = h.from;
    std::string payload;
    bool complete = true;
    try {
      payload.reserve(std::min(h.bytes, kReadPieceBytes));
      while (complete && payload.size() < h.bytes) {
        const size_t at = payload.size();
        const size_t piece = std::min(h.bytes - at, kReadPieceBytes);
        payload.resize(at + piece);
        complete = RecvAll(fd, payload.data() + at, piece);
      }
    } catch (const std::bad_alloc&) {
      // A frame the shapes allow but memory does not: this connection ends, not the worker.
      refused = absl::StrCat("no memory for its frame of ", h.bytes, " payload bytes");
      break;
    }
    if (!complete) break;  // the connection closed mid-frame
    bytes_received_ += static_cast<int64_t>(sizeof h + h.bytes);
    ExchangeKey key;
    key.step = h.step;
    key.micro_batch = h.micro_batch;
    key.layer = h.layer;
    key.sample_id = h.sample_id;
    key.kind = static_cast<ExchangeKind>(h.kind);
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_peers_.erase(from);
      mailbox_[{from, key}].push_back(std::move(payload));
    }
    arrived_.notify_all();
  }
  if (!refused.empty()) ReportRefused(from, refused);
  std::lock_guard<std::mutex> lock(mu_);
  // Closed here, not at destruction, so connections that come and go hold no descriptors.
  in_fds_.erase(fd);
  close(fd);
  if (from >= 0) closed_peers_.insert(from);
  ended_readers_.push_back(reader);
  arrived_.notify_all();
}

absl::Status ShardExchange::ProveToPeer(int fd, int peer, const std::string& address) {
  const Clock::time_point deadline = DeadlineIn(options_.timeout_seconds);
  auto failed = [&](ReadResult read, absl::string_view waiting_for) {
    if (read == ReadResult::kLate) {
      return absl::DeadlineExceededError(absl::StrCat("rank ", peer, " at ", address, " sent no ",
                                                      waiting_for, " within ",
                                                      options_.timeout_seconds, " s"));
    }
    return absl::UnavailableError(
        absl::StrCat("rank ", peer, " at ", address, " closed the connection"));
  };
  auto impostor = [&](absl::string_view what) {
    return absl::UnauthenticatedError(absl::StrCat(
        "what answers at ", address, " for rank ", peer, " ", what,
        ": it is not that rank's exchange in this run (a stray or hostile process on the port?); "
        "no frame was sent to it"));
  };
  AuthChallenge challenge;
  ReadResult read = RecvAllBy(fd, reinterpret_cast<char*>(&challenge), sizeof challenge, deadline);
  if (read != ReadResult::kDone) return failed(read, "challenge");
  if (challenge.magic != kAuthMagic) return impostor("did not open with the \"SBA2\" challenge");
  const absl::string_view peer_nonce(challenge.nonce, kAuthNonceBytes);
  absl::StatusOr<std::string> nonce = tools::RandomBytes(kAuthNonceBytes);
  if (!nonce.ok()) return nonce.status();
  const std::string endpoint = ListenerEndpoint(fd, /*listening=*/false);
  absl::StatusOr<std::string> proof =
      AuthProof(options_.secret, AuthRole::kExchangeSender, peer_nonce, *nonce, endpoint);
  absl::StatusOr<std::string> expected =
      AuthProof(options_.secret, AuthRole::kExchangeReceiver, peer_nonce, *nonce, endpoint);
  if (!proof.ok()) return proof.status();
  if (!expected.ok()) return expected.status();
  AuthResponse response{kAuthMagic, {}, {}};
  std::memcpy(response.nonce, nonce->data(), kAuthNonceBytes);
  std::memcpy(response.proof, proof->data(), kAuthProofBytes);
  if (!SendAll(fd, reinterpret_cast<const char*>(&response), sizeof response)) {
    return failed(ReadResult::kClosed, "");
  }
  char verdict = kRefused;
  read = RecvAllBy(fd, &verdict, 1, deadline);
  if (read != ReadResult::kDone) return failed(read, "answer to this rank's proof");
  if (verdict == kRefused) {
    return absl::PermissionDeniedError(absl::StrCat(
        "rank ", peer, " at ", address,
        " refused this rank's secret (do both run with the secret file sb-run wrote for this "
        "run?)"));
  }
  if (verdict != kAccepted) return impostor("answered this rank's proof with neither 1 nor 0");
  std::string offered(kAuthProofBytes, '\0');
  read = RecvAllBy(fd, offered.data(), offered.size(), deadline);
  if (read != ReadResult::kDone || !tools::ConstantTimeEquals(offered, *expected)) {
    return impostor("did not prove the run's secret in answer to this rank's");
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ShardExchange::Connection(int peer) {
  auto it = out_fds_.find(peer);
  if (it != out_fds_.end()) return it->second;
  absl::StatusOr<std::string> address =
      LookupRankAddress(hub_address_, options_.secret, peer, options_.timeout_seconds);
  if (!address.ok()) return address.status();
  const size_t colon = address->rfind(':');
  int port = 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (colon == std::string::npos || !absl::SimpleAtoi(address->substr(colon + 1), &port) ||
      inet_pton(AF_INET, address->substr(0, colon).c_str(), &addr.sin_addr) != 1) {
    return absl::DataLossError(
        absl::StrCat("rank ", peer, " registered the bad address ", *address));
  }
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("shard exchange: socket() failed");
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to rank ", peer, " at ", *address,
                                               ": ", std::strerror(errno)));
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (absl::Status s = ProveToPeer(fd, peer, *address); !s.ok()) {
    close(fd);
    return s;
  }
  out_fds_[peer] = fd;
  return fd;
}

absl::Status ShardExchange::Send(int peer, const ExchangeKey& key, absl::string_view payload) {
  if (peer < 0 || peer == rank_) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard exchange: rank ", rank_, " cannot send to rank ", peer));
  }
  FrameHeader h{};
  h.magic = kMagic;
  h.from = rank_;
  h.step = key.step;
  h.micro_batch = key.micro_batch;
  h.layer = key.layer;
  h.sample_id = key.sample_id;
  h.kind = static_cast<int32_t>(key.kind);
  h.bytes = payload.size();
  std::lock_guard<std::mutex> lock(send_mu_);
  absl::Status last;
  for (int attempt = 0; attempt < 2; ++attempt) {
    absl::StatusOr<int> fd = Connection(peer);
    if (!fd.ok()) {
      last = fd.status();
      break;
    }
    if (SendAll(*fd, reinterpret_cast<const char*>(&h), sizeof h) &&
        SendAll(*fd, payload.data(), payload.size())) {
      bytes_sent_ += static_cast<int64_t>(sizeof h + payload.size());
      return absl::OkStatus();
    }
    // Broken (the peer restarted?): forget the connection and look its address up again.
    close(*fd);
    out_fds_.erase(peer);
    last = absl::UnavailableError(absl::StrCat("the connection to rank ", peer, " broke"));
  }
  return absl::Status(last.code(),
                      absl::StrCat("shard exchange: rank ", rank_, " sending ", key.ToString(),
                                   " to rank ", peer, ": ", last.message()));
}

absl::StatusOr<std::string> ShardExchange::Receive(int peer, const ExchangeKey& key) {
  const Clock::time_point deadline =
      Clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(options_.timeout_seconds * 1000));
  std::unique_lock<std::mutex> lock(mu_);
  const std::pair<int, ExchangeKey> slot{peer, key};
  while (true) {
    auto it = mailbox_.find(slot);
    if (it != mailbox_.end() && !it->second.empty()) {
      std::string payload = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) mailbox_.erase(it);
      return payload;
    }
    if (arrived_.wait_until(lock, deadline) == std::cv_status::timeout &&
        Clock::now() >= deadline) {
      const bool closed = closed_peers_.count(peer) > 0;
      return absl::DeadlineExceededError(absl::StrCat(
          "shard exchange: rank ", rank_, " waited ", options_.timeout_seconds, " s for ",
          key.ToString(), " from rank ", peer, " in vain",
          closed ? " (its connection closed: did it fail?)" : " (is it running that sample?)"));
    }
  }
}

}  // namespace sparsebalance
