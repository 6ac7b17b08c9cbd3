// tools/listen_address.h: every listen address sb-planner takes is parsed strictly; a wrong one
// is INVALID_ARGUMENT naming the flag and its value and saying what is wrong.
#include "tools/listen_address.h"

#include <string>

#include "gtest/gtest.h"

namespace sparsebalance::tools {
namespace {

ListenAddressRules Grpc() { return {}; }
ListenAddressRules Metrics() {
  ListenAddressRules rules;
  rules.allow_host_names = false;
  rules.allow_unix_sockets = false;
  return rules;
}

// The error message for --flag=value, or "" when it parses.
std::string Error(const std::string& value, const ListenAddressRules& rules = Grpc()) {
  absl::StatusOr<ListenAddress> parsed = ParseListenAddress("listen", value, rules);
  if (parsed.ok()) return "";
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(parsed.status().message());
}

TEST(ListenAddressTest, AcceptsIpAddressesHostNamesAndSockets) {
  absl::StatusOr<ListenAddress> a = ParseListenAddress("listen", "127.0.0.1:50151", Grpc());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 50151);
  EXPECT_TRUE(a->loopback);
  EXPECT_FALSE(a->wildcard);
  EXPECT_EQ(LocalDialTarget(*a), "127.0.0.1:50151");

  a = ParseListenAddress("listen", "0.0.0.0:1", Grpc());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->port, 1);
  EXPECT_FALSE(a->loopback);
  EXPECT_TRUE(a->wildcard);
  EXPECT_EQ(LocalDialTarget(*a), "127.0.0.1:1");

  a = ParseListenAddress("listen", "[::]:65535", Grpc());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "::");
  EXPECT_EQ(a->port, 65535);
  EXPECT_TRUE(a->wildcard);
  EXPECT_EQ(LocalDialTarget(*a), "[::1]:65535");

  a = ParseListenAddress("listen", "[::1]:9151", Grpc());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->loopback);
  EXPECT_EQ(LocalDialTarget(*a), "[::1]:9151");

  a = ParseListenAddress("listen", "10.1.2.3:0", Grpc());  // 0: a free port, where allowed
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->port, 0);
  EXPECT_FALSE(a->loopback);

  a = ParseListenAddress("listen", "LocalHost:80", Grpc());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->loopback);
  a = ParseListenAddress("listen", "planner-0.sb.svc:50151", Grpc());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(a->loopback);

  a = ParseListenAddress("listen", "unix:/run/sb.sock", Grpc());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->unix_socket);
  EXPECT_TRUE(a->loopback);
  EXPECT_EQ(LocalDialTarget(*a), "unix:/run/sb.sock");
  EXPECT_EQ(Error("unix-abstract:sb"), "");
}

TEST(ListenAddressTest, RefusesPortsOutOfRange) {
  EXPECT_EQ(Error(":99999"),
            "--listen=:99999: port 99999 is out of range: 1..65535 (or 0: pick a free port)");
  EXPECT_EQ(Error("127.0.0.1:65536"),
            "--listen=127.0.0.1:65536: port 65536 is out of range: 1..65535 (or 0: pick a free "
            "port)");
  EXPECT_EQ(Error("127.0.0.1:123456"),
            "--listen=127.0.0.1:123456: port \"123456\" is not a "
            "number in 1..65535 (or 0: pick a free port)");
  for (const char* port : {"-1", "+80", "80a", "0x50", " 80", ""}) {
    const std::string message = Error(std::string("127.0.0.1:") + port);
    EXPECT_NE(message.find("is not a number in 1..65535"), std::string::npos) << message;
  }
  ListenAddressRules no_zero;
  no_zero.port_zero_picks_free_port = false;
  EXPECT_EQ(Error("127.0.0.1:0", no_zero),
            "--listen=127.0.0.1:0: port 0 is out of range: 1..65535");
}

TEST(ListenAddressTest, RefusesMissingOrMalformedHosts) {
  EXPECT_EQ(Error(":50151"),
            "--listen=:50151: no host; write 0.0.0.0:50151 for every interface or "
            "127.0.0.1:50151 for this machine only");
  EXPECT_EQ(Error("50151"),
            "--listen=50151: no port; give host:port, e.g. 127.0.0.1:50151 or "
            "0.0.0.0:50151");
  EXPECT_EQ(Error(""), "--listen=: empty; give host:port, e.g. 127.0.0.1:50151");
  EXPECT_EQ(Error("::1:50151"), "--listen=::1:50151: an IPv6 host needs brackets: [::1]:50151");
  EXPECT_EQ(Error("[::1:50151"), "--listen=[::1:50151: unbalanced [ ] around an IPv6 host");
  EXPECT_EQ(Error("[zz]:1"), "--listen=[zz]:1: [zz] is not an IPv6 address");
  EXPECT_EQ(Error("256.0.0.1:1"), "--listen=256.0.0.1:1: 256.0.0.1 is not an IPv4 address");
  EXPECT_EQ(Error("127.1:1"), "--listen=127.1:1: 127.1 is not an IPv4 address");
  EXPECT_EQ(Error("a_b:1"), "--listen=a_b:1: \"a_b\" is not an IP address or host name");
  EXPECT_EQ(Error("-a.b:1"), "--listen=-a.b:1: \"-a.b\" is not an IP address or host name");
  EXPECT_EQ(Error("a..b:1"), "--listen=a..b:1: \"a..b\" is not an IP address or host name");
  EXPECT_EQ(Error("unix:"), "--listen=unix:: give a socket name after unix:");
}

TEST(ListenAddressTest, MetricsListenersTakeIpAddressesOnly) {
  EXPECT_EQ(Error("0.0.0.0:9151", Metrics()), "");
  EXPECT_EQ(Error("[::]:9151", Metrics()), "");
  EXPECT_EQ(Error("localhost:9151", Metrics()),
            "--listen=localhost:9151: give an IP address, not the name localhost (e.g. "
            "127.0.0.1 for this machine, 0.0.0.0 for every interface)");
  EXPECT_EQ(Error("unix:/x", Metrics()),
            "--listen=unix:/x: this listener takes host:port, not a socket");
}

}  // namespace
}  // namespace sparsebalance::tools
