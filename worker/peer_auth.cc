#include "worker/peer_auth.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "absl/strings/str_cat.h"
#include "tools/secret.h"

namespace sparsebalance {
namespace {

// Distinct per protocol and direction, and versioned with the protocols ("SBA2", CHALLENGE 2).
absl::string_view Label(AuthRole role) {
  switch (role) {
    case AuthRole::kHubClient:
      return "sparsebalance step-sync v2: client proves";
    case AuthRole::kHub:
      return "sparsebalance step-sync v2: hub proves";
    case AuthRole::kExchangeSender:
      return "sparsebalance shard-exchange v2: sender proves";
    case AuthRole::kExchangeReceiver:
      return "sparsebalance shard-exchange v2: receiver proves";
  }
  return "";
}

}  // namespace

absl::StatusOr<std::string> AuthProof(absl::string_view secret, AuthRole role,
                                      absl::string_view listener_nonce,
                                      absl::string_view client_nonce,
                                      absl::string_view listener_endpoint) {
  return tools::ChallengeProof(secret, Label(role), listener_nonce, client_nonce,
                               listener_endpoint);
}

std::string ListenerEndpoint(int fd, bool listening) {
  sockaddr_in addr{};
  socklen_t len = sizeof addr;
  const int got = listening ? getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len)
                            : getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  char host[INET_ADDRSTRLEN] = {};
  if (got != 0 || addr.sin_family != AF_INET ||
      inet_ntop(AF_INET, &addr.sin_addr, host, sizeof host) == nullptr) {
    return "";
  }
  return absl::StrCat(host, ":", ntohs(addr.sin_port));
}

}  // namespace sparsebalance
