#include "worker/peer_auth.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <ostream>
#include <utility>

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

RefusalLog::RefusalLog(std::ostream& out, int burst, absl::Duration interval,
                       std::function<absl::Time()> clock)
    : out_(out), burst_(burst), interval_(interval), clock_(std::move(clock)) {}

void RefusalLog::Write(absl::string_view line) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_();
  if (written_ >= burst_ && now - last_ < interval_) {
    ++unwritten_;
    ++unwritten_since_last_;
    return;
  }
  std::string text(line);
  if (written_ >= burst_) {
    if (!text.empty() && text.back() == '\n') text.pop_back();
    absl::StrAppend(&text, " [", unwritten_since_last_,
                    unwritten_since_last_ == 1 ? " refusal" : " refusals",
                    " since the last line not written: at most one line every ",
                    absl::FormatDuration(interval_), " after the first ", burst_, "]\n");
  }
  out_ << text << std::flush;
  ++written_;
  unwritten_since_last_ = 0;
  last_ = now;
}

int64_t RefusalLog::written() const {
  absl::MutexLock lock(&mu_);
  return written_;
}

int64_t RefusalLog::unwritten() const {
  absl::MutexLock lock(&mu_);
  return unwritten_;
}

}  // namespace sparsebalance
