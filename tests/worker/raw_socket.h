// Raw loopback sockets for the worker's tests: a process that speaks to the step-sync hub or a
// rank's shard exchange byte by byte (hostile, or honest by hand), and a plain listener in the
// place of either, which records what the other end sends it.
#ifndef SPARSEBALANCE_TESTS_WORKER_RAW_SOCKET_H_
#define SPARSEBALANCE_TESTS_WORKER_RAW_SOCKET_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <functional>
#include <future>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace sparsebalance::test_support {

// A raw connection to `address` (127.0.0.1:port); -1 on failure.
inline int ConnectRaw(const std::string& address) {
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// How many of `fds` are still open from the other end: nothing to read yet, and not closed.
inline int StillOpen(const std::vector<int>& fds) {
  int open = 0;
  for (const int fd : fds) {
    char byte;
    const ssize_t n = recv(fd, &byte, 1, MSG_DONTWAIT);
    open += n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) ? 1 : 0;
  }
  return open;
}

// Whether all of `bytes` went out on `fd`.
inline bool SendRaw(int fd, const std::string& bytes) {
  return send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

// Exactly `n` bytes from `fd`, or nullopt when the other end closes or `seconds` pass first.
inline std::optional<std::string> RecvExactly(int fd, size_t n, double seconds = 10.0) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int>(seconds * 1e3));
  std::string got;
  while (got.size() < n && std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    char chunk[4096];
    const ssize_t r = recv(fd, chunk, std::min(sizeof chunk, n - got.size()), 0);
    if (r <= 0) return std::nullopt;
    got.append(chunk, static_cast<size_t>(r));
  }
  if (got.size() < n) return std::nullopt;
  return got;
}

// What the other end sends on `fd` until it closes it, or nullopt when it keeps it open past
// `seconds`.
inline std::optional<std::string> ReadUntilClosed(int fd, double seconds) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int>(seconds * 1e3));
  std::string got;
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    char chunk[4096];
    const ssize_t n = recv(fd, chunk, sizeof chunk, 0);
    if (n <= 0) return got;
    got.append(chunk, static_cast<size_t>(n));
  }
  return std::nullopt;
}

// A plain socket listening on 127.0.0.1 (a free port): a process in the place of the hub or of
// a rank's exchange.
struct RawListener {
  RawListener() {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(fd, 16) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      ADD_FAILURE() << "cannot listen on 127.0.0.1";
    }
    address = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  }
  ~RawListener() { close(fd); }
  RawListener(const RawListener&) = delete;
  RawListener& operator=(const RawListener&) = delete;

  int fd = -1;
  std::string address;  // 127.0.0.1:port
};

// Accepts one connection on `listener` (within 10 s) and runs `script` on it, which appends what
// it reads to its string; then reads what else the other end sends until it closes (or 10 s).
// The future holds every byte the other end sent.
inline std::future<std::string> ServeOnce(const RawListener& listener,
                                          std::function<void(int fd, std::string* got)> script) {
  return std::async(std::launch::async, [fd = listener.fd, script] {
    std::string got;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 10000) != 1) return got;
    const int conn = accept(fd, nullptr, nullptr);
    if (conn < 0) return got;
    script(conn, &got);
    got += ReadUntilClosed(conn, 10.0).value_or("");
    close(conn);
    return got;
  });
}

}  // namespace sparsebalance::test_support

#endif  // SPARSEBALANCE_TESTS_WORKER_RAW_SOCKET_H_
