#include "worker/step_sync.h"

#include <arpa/inet.h>
#include <fcntl.h>
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
#include <optional>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tools/secret.h"
#include "worker/peer_auth.h"

namespace sparsebalance {
namespace {

using Clock = std::chrono::steady_clock;

bool SendAll(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

std::string FormatValue(double value) { return absl::StrCat(value); }

Clock::time_point DeadlineIn(double seconds) {
  return Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// Milliseconds from now to `deadline` for poll(), rounded up, 0 once it passed.
int MillisecondsUntil(Clock::time_point deadline) {
  const int64_t us =
      std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>((us + 999) / 1000, 0, 1 << 30));
}

// The version in the hub's CHALLENGE line: 2 since the secret stopped crossing the wire
// (version 1 opened with "AUTH <secret>").
constexpr char kHubProtocolVersion[] = "2";

// Longest first line the hub reads from a connection that has not authenticated, bytes:
// "AUTH <nonce hex> <proof hex>".
constexpr size_t kMaxAuthLineBytes = 5 + 2 * kAuthNonceBytes + 1 + 2 * kAuthProofBytes;

// Longest line either side reads once authenticated, bytes: the protocol's lines are a few
// dozen (an ARRIVE with the longest step and value, an ADDRESS with an IPv4 host:port), so an
// authenticated peer cannot grow the hub's buffer without bound.
constexpr size_t kMaxHubLineBytes = 512;

// `hex` (exactly 2 x `bytes` hex digits) as raw bytes, or nullopt.
std::optional<std::string> DecodeHex(absl::string_view hex, size_t bytes) {
  if (hex.size() != 2 * bytes) return std::nullopt;
  for (char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return std::nullopt;
  }
  return absl::HexStringToBytes(hex);
}

// One released or pending (step, phase).
struct Round {
  std::set<int> arrived;
  double max_value = 0.0;
  bool released = false;
};

}  // namespace

absl::Status CheckSyncSecret(absl::string_view secret) {
  if (secret.size() < kMinSyncSecretBytes || secret.size() > kMaxSyncSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "secret: ", secret.size(), " bytes, not ", kMinSyncSecretBytes, " to ", kMaxSyncSecretBytes,
        " (sb-run draws 64 random hex digits for each run; an empty secret is never accepted)"));
  }
  for (char c : secret) {
    if (c < '!' || c > '~') {
      return absl::InvalidArgumentError(
          "secret: holds a space, a control or a non-ASCII character (a secret file holds one "
          "word; sb-run's are hex digits)");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StepSyncHub>> StepSyncHub::Start(int ranks,
                                                                const StepSyncHubOptions& options) {
  if (ranks < 1) return absl::InvalidArgumentError(absl::StrCat("ranks: ", ranks, " < 1"));
  if (absl::Status s = CheckSyncSecret(options.secret); !s.ok()) return s;
  if (!(options.auth_timeout_seconds > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("auth_timeout_seconds: ", options.auth_timeout_seconds, " must be positive"));
  }
  const int port = options.port;
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("step sync: socket() failed");
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(fd, 256) != 0) {
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("step sync: cannot listen on port ", port, ": ", std::strerror(errno)));
  }
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  std::unique_ptr<StepSyncHub> hub(new StepSyncHub(ranks, options, fd, ntohs(addr.sin_port)));
  if (pipe2(hub->wake_fds_, O_CLOEXEC) != 0) return absl::InternalError("step sync: pipe failed");
  hub->thread_ = std::thread([h = hub.get()] { h->Serve(); });
  return hub;
}

StepSyncHub::StepSyncHub(int ranks, StepSyncHubOptions options, int listen_fd, int port)
    : ranks_(ranks), options_(std::move(options)), listen_fd_(listen_fd), port_(port) {}

StepSyncHub::~StepSyncHub() {
  if (wake_fds_[1] >= 0) {
    const char byte = 0;
    ssize_t ignored = write(wake_fds_[1], &byte, 1);
    (void)ignored;
  }
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
  for (int fd : wake_fds_) {
    if (fd >= 0) close(fd);
  }
}

std::string StepSyncHub::address() const { return absl::StrCat("127.0.0.1:", port_); }

void StepSyncHub::Serve() {
  struct Peer {
    bool authenticated = false;
    int64_t serial = 0;               // order of arrival: the oldest unauthenticated goes first
    Clock::time_point auth_deadline;  // while not authenticated
    std::string nonce;                // the challenge it was sent, while not authenticated
    std::string endpoint;             // the hub's address as this connection sees it
    int rank = -1;                    // -1 until HELLO
    std::string buffer;
  };
  std::map<int, Peer> peers;      // by fd
  std::map<int, int> fd_of_rank;  // the live connection of each rank
  std::map<std::pair<int64_t, int>, Round> rounds;
  std::map<int, std::string> addresses;  // shard-exchange listen addresses by rank
  int64_t next_serial = 0;
  auto release = [&](const std::pair<int64_t, int>& key, const Round& round) {
    const std::string line = absl::StrCat("RELEASE ", key.first, " ", key.second, " ",
                                          FormatValue(round.max_value), "\n");
    for (int rank : round.arrived) {
      auto it = fd_of_rank.find(rank);
      if (it != fd_of_rank.end()) SendAll(it->second, line);
    }
  };
  // A connection that did not prove the secret: counted and reported (never with what it sent)
  // before it is told so; the caller closes it.
  auto refuse = [&](int fd, absl::string_view why) {
    ++refused_connections_;
    refusal_log_.Write(absl::StrCat("step sync: the hub at ", address(),
                                    " dropped a connection: ", why,
                                    " (a stray or hostile local process, or a worker of another "
                                    "run?)\n"));
    SendAll(fd, "DENIED\n");
  };
  // Checks an AUTH line against the challenge `peer` was sent and, when it proves the secret,
  // proves the hub's in turn.
  auto authenticate = [&](int fd, Peer& peer, const std::string& line) {
    std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
    std::optional<std::string> client_nonce, proof;
    if (parts.size() == 3 && parts[0] == "AUTH") {
      client_nonce = DecodeHex(parts[1], kAuthNonceBytes);
      proof = DecodeHex(parts[2], kAuthProofBytes);
    }
    if (!client_nonce || !proof) {
      refuse(fd, "its first line is not AUTH <nonce> <proof> (an older worker's AUTH <secret>?)");
      return false;
    }
    absl::StatusOr<std::string> expected =
        AuthProof(options_.secret, AuthRole::kHubClient, peer.nonce, *client_nonce, peer.endpoint);
    absl::StatusOr<std::string> answer =
        AuthProof(options_.secret, AuthRole::kHub, peer.nonce, *client_nonce, peer.endpoint);
    if (!expected.ok() || !answer.ok()) {
      refuse(fd, absl::StrCat("no proof to check it against: ",
                              (expected.ok() ? answer : expected).status().message()));
      return false;
    }
    if (!tools::ConstantTimeEquals(*proof, *expected)) {
      refuse(fd, "its AUTH line does not prove the run's secret");
      return false;
    }
    peer.authenticated = true;
    peer.nonce.clear();
    return SendAll(fd, absl::StrCat("OK ", absl::BytesToHexString(*answer), "\n"));
  };
  auto handle = [&](int fd, Peer& peer, const std::string& line) {
    if (!peer.authenticated) return authenticate(fd, peer, line);
    std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (parts.size() == 2 && parts[0] == "HELLO") {
      int rank = -1;
      if (!absl::SimpleAtoi(parts[1], &rank) || rank < 0 || rank >= ranks_) return false;
      peer.rank = rank;
      fd_of_rank[rank] = fd;
      return true;
    }
    if ((parts.size() == 3 && parts[0] == "ADDRESS") ||
        (parts.size() == 2 && parts[0] == "WHERE")) {
      int rank = -1;
      if (!absl::SimpleAtoi(parts[1], &rank) || rank < 0 || rank >= ranks_) return false;
      if (parts[0] == "ADDRESS") {
        addresses[rank] = parts[2];
        return SendAll(fd, "OK\n");
      }
      auto it = addresses.find(rank);
      return SendAll(
          fd, absl::StrCat("AT ", rank, " ", it == addresses.end() ? "-" : it->second, "\n"));
    }
    int64_t step = 0;
    int phase = 0;
    double value = 0.0;
    if (parts.size() != 4 || parts[0] != "ARRIVE" || peer.rank < 0 ||
        !absl::SimpleAtoi(parts[1], &step) || !absl::SimpleAtoi(parts[2], &phase) ||
        !absl::SimpleAtod(parts[3], &value)) {
      return false;
    }
    const std::pair<int64_t, int> key{step, phase};
    Round& round = rounds[key];
    if (round.released) {
      SendAll(fd,
              absl::StrCat("RELEASE ", step, " ", phase, " ", FormatValue(round.max_value), "\n"));
      return true;
    }
    if (round.arrived.empty() || value > round.max_value) round.max_value = value;
    round.arrived.insert(peer.rank);
    if (static_cast<int>(round.arrived.size()) == ranks_) {
      round.released = true;
      release(key, round);
      // Keep the recent rounds only (a restarted rank asks about the last few).
      while (rounds.size() > 64) rounds.erase(rounds.begin());
    }
    return true;
  };
  // A line past its bound: refused before authentication, closed with a reason after.
  auto overlong = [&](int fd, const Peer& peer) {
    if (!peer.authenticated) {
      refuse(fd, absl::StrCat("its first line runs past ", kMaxAuthLineBytes,
                              " bytes, longer than any AUTH line"));
      return;
    }
    std::cerr << absl::StrCat(
                     "step sync: the hub at ", address(), " closed the connection of ",
                     peer.rank >= 0 ? absl::StrCat("rank ", peer.rank) : std::string("a worker"),
                     ": a line runs past ", kMaxHubLineBytes,
                     " bytes, longer than any line of the protocol (a broken or hostile worker?)\n")
              << std::flush;
  };
  auto drop = [&](int fd) {
    auto it = peers.find(fd);
    if (it == peers.end()) return;
    if (it->second.rank >= 0) {
      auto owner = fd_of_rank.find(it->second.rank);
      if (owner != fd_of_rank.end() && owner->second == fd) fd_of_rank.erase(owner);
    }
    close(fd);
    peers.erase(it);
  };
  // A new connection: the oldest unauthenticated one makes room for it when
  // kMaxPendingAuthConnections wait already; then it is sent its challenge.
  auto admit = [&](int fd) {
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int pending = 0;
    int oldest = -1;
    for (const auto& [other, peer] : peers) {
      if (peer.authenticated) continue;
      ++pending;
      if (oldest < 0 || peer.serial < peers.at(oldest).serial) oldest = other;
    }
    if (pending >= kMaxPendingAuthConnections) {
      refuse(oldest, absl::StrCat("it had not authenticated when ", kMaxPendingAuthConnections,
                                  " newer connections waited to (a flood of connections?)"));
      drop(oldest);
    }
    Peer peer;
    peer.serial = next_serial++;
    peer.auth_deadline = DeadlineIn(options_.auth_timeout_seconds);
    peer.endpoint = ListenerEndpoint(fd, /*listening=*/true);
    absl::StatusOr<std::string> nonce = tools::RandomBytes(kAuthNonceBytes);
    if (!nonce.ok() || peer.endpoint.empty()) {
      refuse(fd, nonce.ok() ? "its socket has no local address" : nonce.status().message());
      close(fd);
      return;
    }
    peer.nonce = *std::move(nonce);
    if (!SendAll(fd, absl::StrCat("CHALLENGE ", kHubProtocolVersion, " ",
                                  absl::BytesToHexString(peer.nonce), "\n"))) {
      close(fd);
      return;
    }
    peers[fd] = std::move(peer);
  };
  while (true) {
    std::vector<pollfd> fds = {{listen_fd_, POLLIN, 0}, {wake_fds_[0], POLLIN, 0}};
    // Wake up for the first authentication deadline, so that a silent connection is dropped.
    int timeout_ms = -1;
    for (const auto& [fd, peer] : peers) {
      fds.push_back({fd, POLLIN, 0});
      if (!peer.authenticated) {
        const int left = MillisecondsUntil(peer.auth_deadline);
        timeout_ms = timeout_ms < 0 ? left : std::min(timeout_ms, left);
      }
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) break;
    if (fds[0].revents & POLLIN) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) admit(fd);
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const int fd = fds[i].fd;
      auto it = peers.find(fd);
      if (it == peers.end()) continue;  // made room for a newer connection above
      Peer& peer = it->second;
      char chunk[4096];
      const ssize_t n = recv(fd, chunk, sizeof chunk, 0);
      bool ok = n > 0;
      if (ok) {
        peer.buffer.append(chunk, static_cast<size_t>(n));
        size_t end;
        while (ok && (end = peer.buffer.find('\n')) != std::string::npos) {
          if (end > (peer.authenticated ? kMaxHubLineBytes : kMaxAuthLineBytes)) break;
          const std::string line = peer.buffer.substr(0, end);
          peer.buffer.erase(0, end + 1);
          ok = handle(fd, peer, line);
        }
        // What is left of the buffer is a line's start (or a line too long, kept from above).
        const size_t limit = peer.authenticated ? kMaxHubLineBytes : kMaxAuthLineBytes;
        if (ok && std::min(peer.buffer.find('\n'), peer.buffer.size()) > limit) {
          overlong(fd, peer);
          ok = false;
        }
      }
      if (!ok) drop(fd);
    }
    std::vector<int> late;
    const Clock::time_point now = Clock::now();
    for (const auto& [fd, peer] : peers) {
      if (!peer.authenticated && now >= peer.auth_deadline) late.push_back(fd);
    }
    for (int fd : late) {
      refuse(fd, absl::StrCat("it sent no AUTH line within ", options_.auth_timeout_seconds, " s"));
      drop(fd);
    }
  }
  for (const auto& [fd, peer] : peers) close(fd);
}

namespace {

// The IPv4 socket address of "host:port".
absl::StatusOr<sockaddr_in> ParseAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("address ", address, " is not host:port"));
  }
  const std::string host = address.substr(0, colon);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host == "localhost" ? "127.0.0.1" : host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("address ", address, ": ", host, " is not an IPv4 address"));
  }
  return addr;
}

// The next line from `fd` (without its newline), reading into `buffer` what arrives until then;
// UNAVAILABLE when the hub closes the connection, DEADLINE_EXCEEDED at `deadline`, DATA_LOSS
// for a line past kMaxHubLineBytes (what answers may not be the hub yet).
absl::StatusOr<std::string> ReadLine(int fd, std::string* buffer, const std::string& hub_address,
                                     Clock::time_point deadline) {
  while (true) {
    const size_t end = buffer->find('\n');
    if (std::min(end, buffer->size()) > kMaxHubLineBytes) {
      return absl::DataLossError(absl::StrCat("step sync: what answers at ", hub_address,
                                              " sent a line longer than ", kMaxHubLineBytes,
                                              " bytes, which the hub never does"));
    }
    if (end != std::string::npos) {
      std::string line = buffer->substr(0, end);
      buffer->erase(0, end + 1);
      return line;
    }
    pollfd p{fd, POLLIN, 0};
    const int left_ms = MillisecondsUntil(deadline);
    const int ready = left_ms > 0 ? poll(&p, 1, left_ms) : 0;
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("step sync: the hub at ", hub_address, " did not answer"));
    }
    char chunk[256];
    const ssize_t n = recv(fd, chunk, sizeof chunk, 0);
    if (n <= 0) {
      return absl::UnavailableError(
          absl::StrCat("step sync: the hub at ", hub_address, " closed the connection"));
    }
    buffer->append(chunk, static_cast<size_t>(n));
  }
}

// The client's side of the challenge-response (worker/peer_auth.h) on a fresh connection `fd`
// to `hub_address`: answers the hub's CHALLENGE with this side's nonce and proof, then checks
// the hub's proof. OK once both hold the run's secret; PERMISSION_DENIED when the hub refuses
// `secret` (another run's); UNAUTHENTICATED when what answers does not prove the secret (not
// this run's hub: nothing but the proof was sent to it); FAILED_PRECONDITION for a hub of
// another protocol version.
absl::Status AuthenticateToHub(int fd, const std::string& secret, std::string* buffer,
                               const std::string& hub_address, Clock::time_point deadline) {
  auto impostor = [&](absl::string_view what) {
    return absl::UnauthenticatedError(absl::StrCat(
        "step sync: what answers at ", hub_address, " ", what,
        ": it is not this run's hub (a stray or hostile process on the hub's port?); this worker "
        "sent it nothing else"));
  };
  absl::StatusOr<std::string> challenge = ReadLine(fd, buffer, hub_address, deadline);
  if (!challenge.ok()) return challenge.status();
  std::vector<absl::string_view> parts = absl::StrSplit(*challenge, ' ');
  if (parts.size() != 3 || parts[0] != "CHALLENGE") {
    return impostor("did not open with the hub's CHALLENGE line");
  }
  if (parts[1] != kHubProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step sync: the hub at ", hub_address, " speaks protocol version ", parts[1],
        ", this worker ", kHubProtocolVersion, " (sb-run and sb-worker of different builds?)"));
  }
  const std::optional<std::string> hub_nonce = DecodeHex(parts[2], kAuthNonceBytes);
  if (!hub_nonce) return impostor("sent a CHALLENGE without a nonce");
  const std::string endpoint = ListenerEndpoint(fd, /*listening=*/false);
  absl::StatusOr<std::string> nonce = tools::RandomBytes(kAuthNonceBytes);
  if (!nonce.ok()) return nonce.status();
  absl::StatusOr<std::string> proof =
      AuthProof(secret, AuthRole::kHubClient, *hub_nonce, *nonce, endpoint);
  absl::StatusOr<std::string> hub_proof =
      AuthProof(secret, AuthRole::kHub, *hub_nonce, *nonce, endpoint);
  if (!proof.ok()) return proof.status();
  if (!hub_proof.ok()) return hub_proof.status();
  if (!SendAll(fd, absl::StrCat("AUTH ", absl::BytesToHexString(*nonce), " ",
                                absl::BytesToHexString(*proof), "\n"))) {
    return absl::UnavailableError(
        absl::StrCat("step sync: the hub at ", hub_address, " closed the connection"));
  }
  absl::StatusOr<std::string> answer = ReadLine(fd, buffer, hub_address, deadline);
  if (!answer.ok()) return answer.status();
  if (*answer == "DENIED") {
    return absl::PermissionDeniedError(absl::StrCat(
        "step sync: the hub at ", hub_address,
        " refused this worker's secret (is the secret file the one sb-run wrote for this run?)"));
  }
  const std::optional<std::string> offered =
      answer->rfind("OK ", 0) == 0 ? DecodeHex(answer->substr(3), kAuthProofBytes) : std::nullopt;
  if (!offered || !tools::ConstantTimeEquals(*offered, *hub_proof)) {
    return impostor("did not prove the run's secret in answer to this worker's");
  }
  return absl::OkStatus();
}

// Sends one line to the hub on a fresh connection, once both sides proved the secret, and
// returns its one-line answer.
absl::StatusOr<std::string> AskHub(const std::string& hub_address, const std::string& secret,
                                   const std::string& line, double timeout_seconds) {
  if (absl::Status s = CheckSyncSecret(secret); !s.ok()) return s;
  absl::StatusOr<sockaddr_in> addr = ParseAddress(hub_address);
  if (!addr.ok()) return addr.status();
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("step sync: socket() failed");
  if (connect(fd, reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("step sync: cannot reach the hub at ", hub_address));
  }
  const Clock::time_point deadline = DeadlineIn(timeout_seconds);
  std::string buffer;
  absl::StatusOr<std::string> answer;
  if (absl::Status s = AuthenticateToHub(fd, secret, &buffer, hub_address, deadline); !s.ok()) {
    answer = s;
  } else if (!SendAll(fd, line)) {
    answer = absl::UnavailableError(
        absl::StrCat("step sync: the hub at ", hub_address, " closed the connection"));
  } else {
    answer = ReadLine(fd, &buffer, hub_address, deadline);
  }
  close(fd);
  return answer;
}

}  // namespace

absl::Status RegisterRankAddress(const std::string& hub_address, const std::string& secret,
                                 int rank, const std::string& address, double timeout_seconds) {
  absl::StatusOr<std::string> answer = AskHub(
      hub_address, secret, absl::StrCat("ADDRESS ", rank, " ", address, "\n"), timeout_seconds);
  if (!answer.ok()) return answer.status();
  if (*answer != "OK") {
    return absl::InvalidArgumentError(
        absl::StrCat("step sync: the hub refused rank ", rank, "'s address ", address));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> LookupRankAddress(const std::string& hub_address,
                                              const std::string& secret, int rank,
                                              double timeout_seconds) {
  const Clock::time_point deadline = DeadlineIn(timeout_seconds);
  const std::string want = absl::StrCat("AT ", rank, " ");
  while (true) {
    absl::StatusOr<std::string> answer = AskHub(
        hub_address, secret, absl::StrCat("WHERE ", rank, "\n"), std::max(1.0, timeout_seconds));
    if (!answer.ok()) return answer.status();
    if (answer->rfind(want, 0) != 0) {
      return absl::DataLossError(absl::StrCat("step sync: bad answer from the hub: ", *answer));
    }
    const std::string address = answer->substr(want.size());
    if (address != "-") return address;
    if (Clock::now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "rank ", rank, " did not register its shard-exchange address with the hub at ",
          hub_address, " within ", timeout_seconds, " s (is it running?)"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

absl::StatusOr<std::unique_ptr<StepSyncClient>> StepSyncClient::Connect(const std::string& address,
                                                                        const std::string& secret,
                                                                        int rank,
                                                                        double timeout_seconds) {
  absl::StatusOr<sockaddr_in> parsed = ParseAddress(address);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("sync ", parsed.status().message()));
  }
  if (absl::Status s = CheckSyncSecret(secret); !s.ok()) return s;
  sockaddr_in addr = *parsed;
  const Clock::time_point deadline = DeadlineIn(timeout_seconds);
  while (true) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::InternalError("step sync: socket() failed");
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      // Answered at once by a live hub; a few seconds even when the caller's time is short.
      std::string buffer;
      if (absl::Status s =
              AuthenticateToHub(fd, secret, &buffer, address, std::max(deadline, DeadlineIn(5.0)));
          !s.ok()) {
        close(fd);
        return s;
      }
      if (!SendAll(fd, absl::StrCat("HELLO ", rank, "\n"))) {
        close(fd);
        return absl::UnavailableError(
            absl::StrCat("step sync: the hub at ", address, " closed the connection"));
      }
      auto client = std::unique_ptr<StepSyncClient>(new StepSyncClient(address, secret, rank, fd));
      client->buffer_ = std::move(buffer);
      return client;
    }
    close(fd);
    if (Clock::now() > deadline) {
      return absl::UnavailableError(absl::StrCat("step sync: cannot reach the hub at ", address));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

StepSyncClient::~StepSyncClient() {
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<double> StepSyncClient::AllReduceMax(int64_t step, int phase, double value,
                                                    double timeout_seconds) {
  absl::StatusOr<double> result = Exchange(step, phase, value, timeout_seconds);
  if (result.ok() || result.status().code() != absl::StatusCode::kUnavailable) return result;
  // The connection broke: reconnect once and arrive again (arriving twice is harmless).
  absl::StatusOr<std::unique_ptr<StepSyncClient>> fresh = Connect(address_, secret_, rank_, 10);
  if (!fresh.ok()) return fresh.status();
  close(fd_);
  fd_ = (*fresh)->fd_;
  (*fresh)->fd_ = -1;
  buffer_ = std::move((*fresh)->buffer_);
  return Exchange(step, phase, value, timeout_seconds);
}

absl::StatusOr<double> StepSyncClient::Exchange(int64_t step, int phase, double value,
                                                double timeout_seconds) {
  if (!SendAll(fd_, absl::StrCat("ARRIVE ", step, " ", phase, " ", FormatValue(value), "\n"))) {
    return absl::UnavailableError("step sync: the hub connection is closed");
  }
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  const std::string want = absl::StrCat("RELEASE ", step, " ", phase, " ");
  while (true) {
    size_t end;
    while ((end = buffer_.find('\n')) != std::string::npos) {
      const std::string line = buffer_.substr(0, end);
      buffer_.erase(0, end + 1);
      if (line.rfind(want, 0) == 0) {
        double max_value = 0.0;
        if (!absl::SimpleAtod(line.substr(want.size()), &max_value)) {
          return absl::DataLossError(absl::StrCat("step sync: bad line from the hub: ", line));
        }
        return max_value;
      }
    }
    const int64_t left_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left_ms <= 0) {
      return absl::DeadlineExceededError(absl::StrCat("step sync: step ", step, " phase ", phase,
                                                      ": other ranks did not arrive within ",
                                                      timeout_seconds, " s"));
    }
    pollfd p{fd_, POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(std::min<int64_t>(left_ms, 1000)));
    if (ready < 0 && errno != EINTR) return absl::UnavailableError("step sync: poll failed");
    if (ready <= 0) continue;
    char chunk[1024];
    const ssize_t n = recv(fd_, chunk, sizeof chunk, 0);
    if (n <= 0) return absl::UnavailableError("step sync: the hub closed the connection");
    buffer_.append(chunk, static_cast<size_t>(n));
  }
}

}  // namespace sparsebalance
