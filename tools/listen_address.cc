#include "tools/listen_address.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace sparsebalance::tools {
namespace {

// A DNS name (RFC 1123): dot-separated labels of 1..63 letters, digits and '-', not starting
// or ending with '-', 253 characters at most.
bool IsHostName(absl::string_view host) {
  if (host.empty() || host.size() > 253) return false;
  for (absl::string_view label : absl::StrSplit(host, '.')) {
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') {
      return false;
    }
    for (char c : label) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-') return false;
    }
  }
  return true;
}

// Only digits and dots: meant as an IPv4 address (a DNS name never is all-numeric).
bool LooksNumeric(absl::string_view host) {
  for (char c : host) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c)) && c != '.') return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<ListenAddress> ParseListenAddress(absl::string_view flag, absl::string_view value,
                                                 const ListenAddressRules& rules) {
  const std::string where = absl::StrCat("--", flag, "=", value);
  auto bad = [&where](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", why));
  };
  ListenAddress out;
  for (absl::string_view scheme : {"unix:", "unix-abstract:"}) {
    if (absl::StartsWith(value, scheme)) {
      if (!rules.allow_unix_sockets) return bad("this listener takes host:port, not a socket");
      if (value.size() == scheme.size())
        return bad(absl::StrCat("give a socket name after ", scheme));
      out.host = std::string(value);
      out.unix_socket = out.loopback = true;
      return out;
    }
  }
  if (value.empty()) return bad("empty; give host:port, e.g. 127.0.0.1:50151");
  const size_t colon = value.rfind(':');
  if (colon == absl::string_view::npos) {
    return bad("no port; give host:port, e.g. 127.0.0.1:50151 or 0.0.0.0:50151");
  }
  absl::string_view host = value.substr(0, colon);
  const absl::string_view port_text = value.substr(colon + 1);
  const std::string port_range =
      rules.port_zero_picks_free_port ? "1..65535 (or 0: pick a free port)" : "1..65535";
  if (port_text.empty() || port_text.size() > 5 ||
      !std::all_of(port_text.begin(), port_text.end(),
                   [](char c) { return absl::ascii_isdigit(static_cast<unsigned char>(c)); }) ||
      !absl::SimpleAtoi(port_text, &out.port)) {
    return bad(absl::StrCat("port \"", port_text, "\" is not a number in ", port_range));
  }
  if (out.port > 65535 || (out.port == 0 && !rules.port_zero_picks_free_port)) {
    return bad(absl::StrCat("port ", port_text, " is out of range: ", port_range));
  }
  if (host.empty()) {
    return bad(absl::StrCat("no host; write 0.0.0.0:", port_text, " for every interface or ",
                            "127.0.0.1:", port_text, " for this machine only"));
  }
  if (host.front() == '[') {
    if (host.back() != ']' || host.size() < 3) return bad("unbalanced [ ] around an IPv6 host");
    out.host = std::string(host.substr(1, host.size() - 2));
    in6_addr v6{};
    if (inet_pton(AF_INET6, out.host.c_str(), &v6) != 1) {
      return bad(absl::StrCat("[", out.host, "] is not an IPv6 address"));
    }
    out.loopback = IN6_IS_ADDR_LOOPBACK(&v6);
    out.wildcard = IN6_IS_ADDR_UNSPECIFIED(&v6);
    return out;
  }
  if (absl::StrContains(host, ':')) {
    return bad(absl::StrCat("an IPv6 host needs brackets: [", host, "]:", port_text));
  }
  out.host = std::string(host);
  in_addr v4{};
  if (inet_pton(AF_INET, out.host.c_str(), &v4) == 1) {
    out.loopback = (ntohl(v4.s_addr) >> 24) == 127;
    out.wildcard = v4.s_addr == htonl(INADDR_ANY);
    return out;
  }
  if (LooksNumeric(host)) return bad(absl::StrCat(host, " is not an IPv4 address"));
  if (!IsHostName(host))
    return bad(absl::StrCat("\"", host, "\" is not an IP address or host name"));
  if (!rules.allow_host_names) {
    return bad(absl::StrCat("give an IP address, not the name ", host,
                            " (e.g. 127.0.0.1 for this machine, 0.0.0.0 for every interface)"));
  }
  out.loopback = absl::AsciiStrToLower(host) == "localhost";
  return out;
}

std::string LocalDialTarget(const ListenAddress& address) {
  if (address.unix_socket) return address.host;
  const bool v6 = absl::StrContains(address.host, ':');
  if (address.wildcard) return absl::StrCat(v6 ? "[::1]" : "127.0.0.1", ":", address.port);
  return v6 ? absl::StrCat("[", address.host, "]:", address.port)
            : absl::StrCat(address.host, ":", address.port);
}

}  // namespace sparsebalance::tools
