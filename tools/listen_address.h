// Strict parsing of the host:port a server listens on, so that a wrong --listen is refused at
// start with a message naming the flag, instead of being handed to gRPC or civetweb, which
// bind something else without a word (`:99999` used to bind a random port).
//
//   absl::StatusOr<ListenAddress> listen = ParseListenAddress("listen", value, {});
//   if (!listen.ok()) tools::UsageError(listen.status().message());
//   ... listen->loopback, listen->port (0: a free port is picked) ...
#ifndef SPARSEBALANCE_TOOLS_LISTEN_ADDRESS_H_
#define SPARSEBALANCE_TOOLS_LISTEN_ADDRESS_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace sparsebalance::tools {

// What a listener accepts beyond "IP:port" with a port in 1..65535.
struct ListenAddressRules {
  bool port_zero_picks_free_port = true;  // port 0: the OS picks one (the flag says so)
  bool allow_host_names = true;           // "localhost", "planner-0.example": gRPC resolves them
  bool allow_unix_sockets = true;         // gRPC's "unix:PATH" and "unix-abstract:NAME"
};

struct ListenAddress {
  std::string host;  // as given, IPv6 without brackets; a Unix socket's whole value
  int port = 0;      // 0: a free port, picked when the listener starts; 0 for a Unix socket
  bool unix_socket = false;
  bool loopback = false;  // reachable from this machine only (127.0.0.0/8, ::1, localhost, unix)
  bool wildcard = false;  // every interface (0.0.0.0, ::)
};

// Parses `value`, the value of --`flag`. Accepted: IPV4:PORT, [IPV6]:PORT, HOSTNAME:PORT
// (when allowed), unix:PATH / unix-abstract:NAME (when allowed). INVALID_ARGUMENT naming
// `--flag=value` and what is wrong with it otherwise: no port, a port that is not a decimal
// number in 1..65535 (or 0 where allowed), an empty host (":50151": write 0.0.0.0:50151 for
// every interface), an IPv6 address without brackets, a malformed host.
absl::StatusOr<ListenAddress> ParseListenAddress(absl::string_view flag, absl::string_view value,
                                                 const ListenAddressRules& rules);

// The address a client on this machine dials to reach a listener on `address`: a wildcard
// host becomes the matching loopback address (0.0.0.0 -> 127.0.0.1, :: -> [::1]); IPv6 gets
// its brackets back. Unix sockets are returned as given.
std::string LocalDialTarget(const ListenAddress& address);

}  // namespace sparsebalance::tools

#endif  // SPARSEBALANCE_TOOLS_LISTEN_ADDRESS_H_
