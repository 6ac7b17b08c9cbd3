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
#include <set>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

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

// One released or pending (step, phase).
struct Round {
  std::set<int> arrived;
  double max_value = 0.0;
  bool released = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StepSyncHub>> StepSyncHub::Start(int ranks, int port) {
  if (ranks < 1) return absl::InvalidArgumentError(absl::StrCat("ranks: ", ranks, " < 1"));
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
  std::unique_ptr<StepSyncHub> hub(new StepSyncHub(ranks, fd, ntohs(addr.sin_port)));
  if (pipe2(hub->wake_fds_, O_CLOEXEC) != 0) return absl::InternalError("step sync: pipe failed");
  hub->thread_ = std::thread([h = hub.get()] { h->Serve(); });
  return hub;
}

StepSyncHub::StepSyncHub(int ranks, int listen_fd, int port)
    : ranks_(ranks), listen_fd_(listen_fd), port_(port) {}

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
    int rank = -1;  // -1 until HELLO
    std::string buffer;
  };
  std::map<int, Peer> peers;      // by fd
  std::map<int, int> fd_of_rank;  // the live connection of each rank
  std::map<std::pair<int64_t, int>, Round> rounds;
  std::map<int, std::string> addresses;  // shard-exchange listen addresses by rank
  auto release = [&](const std::pair<int64_t, int>& key, const Round& round) {
    const std::string line = absl::StrCat("RELEASE ", key.first, " ", key.second, " ",
                                          FormatValue(round.max_value), "\n");
    for (int rank : round.arrived) {
      auto it = fd_of_rank.find(rank);
      if (it != fd_of_rank.end()) SendAll(it->second, line);
    }
  };
  auto handle = [&](int fd, Peer& peer, const std::string& line) {
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
  while (true) {
    std::vector<pollfd> fds = {{listen_fd_, POLLIN, 0}, {wake_fds_[0], POLLIN, 0}};
    for (const auto& [fd, peer] : peers) fds.push_back({fd, POLLIN, 0});
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) break;
    if (fds[0].revents & POLLIN) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        const int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        peers[fd] = Peer();
      }
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const int fd = fds[i].fd;
      Peer& peer = peers[fd];
      char chunk[4096];
      const ssize_t n = recv(fd, chunk, sizeof chunk, 0);
      bool ok = n > 0;
      if (ok) {
        peer.buffer.append(chunk, static_cast<size_t>(n));
        size_t end;
        while (ok && (end = peer.buffer.find('\n')) != std::string::npos) {
          const std::string line = peer.buffer.substr(0, end);
          peer.buffer.erase(0, end + 1);
          ok = handle(fd, peer, line);
        }
      }
      if (!ok) {
        if (peer.rank >= 0) {
          auto it = fd_of_rank.find(peer.rank);
          if (it != fd_of_rank.end() && it->second == fd) fd_of_rank.erase(it);
        }
        close(fd);
        peers.erase(fd);
      }
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

// Sends one line to the hub on a fresh connection and returns its one-line answer.
absl::StatusOr<std::string> AskHub(const std::string& hub_address, const std::string& line,
                                   double timeout_seconds) {
  absl::StatusOr<sockaddr_in> addr = ParseAddress(hub_address);
  if (!addr.ok()) return addr.status();
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("step sync: socket() failed");
  if (connect(fd, reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr) != 0 ||
      !SendAll(fd, line)) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("step sync: cannot reach the hub at ", hub_address));
  }
  std::string answer;
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  while (answer.find('\n') == std::string::npos) {
    const int64_t left_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{fd, POLLIN, 0};
    if (left_ms <= 0 || poll(&p, 1, static_cast<int>(left_ms)) <= 0) {
      close(fd);
      return absl::DeadlineExceededError(
          absl::StrCat("step sync: the hub at ", hub_address, " did not answer"));
    }
    char chunk[256];
    const ssize_t n = recv(fd, chunk, sizeof chunk, 0);
    if (n <= 0) {
      close(fd);
      return absl::UnavailableError(
          absl::StrCat("step sync: the hub at ", hub_address, " closed the connection"));
    }
    answer.append(chunk, static_cast<size_t>(n));
  }
  close(fd);
  return answer.substr(0, answer.find('\n'));
}

}  // namespace

absl::Status RegisterRankAddress(const std::string& hub_address, int rank,
                                 const std::string& address, double timeout_seconds) {
  absl::StatusOr<std::string> answer =
      AskHub(hub_address, absl::StrCat("ADDRESS ", rank, " ", address, "\n"), timeout_seconds);
  if (!answer.ok()) return answer.status();
  if (*answer != "OK") {
    return absl::InvalidArgumentError(
        absl::StrCat("step sync: the hub refused rank ", rank, "'s address ", address));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> LookupRankAddress(const std::string& hub_address, int rank,
                                              double timeout_seconds) {
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  const std::string want = absl::StrCat("AT ", rank, " ");
  while (true) {
    absl::StatusOr<std::string> answer =
        AskHub(hub_address, absl::StrCat("WHERE ", rank, "\n"), std::max(1.0, timeout_seconds));
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
                                                                        int rank,
                                                                        double timeout_seconds) {
  absl::StatusOr<sockaddr_in> parsed = ParseAddress(address);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("sync ", parsed.status().message()));
  }
  sockaddr_in addr = *parsed;
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  while (true) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::InternalError("step sync: socket() failed");
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      if (!SendAll(fd, absl::StrCat("HELLO ", rank, "\n"))) {
        close(fd);
        return absl::UnavailableError("step sync: the hub closed the connection");
      }
      return std::unique_ptr<StepSyncClient>(new StepSyncClient(address, rank, fd));
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
  absl::StatusOr<std::unique_ptr<StepSyncClient>> fresh = Connect(address_, rank_, 10);
  if (!fresh.ok()) return fresh.status();
  close(fd_);
  fd_ = (*fresh)->fd_;
  (*fresh)->fd_ = -1;
  buffer_.clear();
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
