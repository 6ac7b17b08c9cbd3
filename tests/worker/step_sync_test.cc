// StepSyncHub and StepSyncClient over loopback, ranks as threads: the all-reduce releases only
// when every rank has arrived, returns the maximum, answers a restarted rank at once, a peer
// that speaks nonsense or an endless line is dropped without disturbing the others, a local
// process without the run's secret can neither arrive nor register an address, nor hold a
// connection open, nor crowd the hub with idle connections, and one that listens in the hub's
// place learns nothing of the secret and is refused by the clients.
#include "worker/step_sync.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/raw_socket.h"
#include "tools/secret.h"
#include "worker/peer_auth.h"

namespace sparsebalance {
namespace {

using test_support::ConnectRaw;
using test_support::RawListener;
using test_support::ReadUntilClosed;
using test_support::SendRaw;
using test_support::ServeOnce;
using test_support::StillOpen;
using ::testing::HasSubstr;
using ::testing::Not;

// The run's secret of these tests (sb-run draws 64 random hex digits instead).
const char kSecret[] = "step-sync-test-secret-0123456789";

absl::StatusOr<std::unique_ptr<StepSyncHub>> StartHub(int ranks,
                                                      double auth_timeout_seconds = 5.0) {
  StepSyncHubOptions options;
  options.secret = kSecret;
  options.auth_timeout_seconds = auth_timeout_seconds;
  return StepSyncHub::Start(ranks, options);
}

std::unique_ptr<StepSyncClient> ConnectOrDie(const std::string& address, int rank) {
  absl::StatusOr<std::unique_ptr<StepSyncClient>> client =
      StepSyncClient::Connect(address, kSecret, rank);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

// The next line on `fd` (without its newline), or nullopt when none comes within `seconds`
// (read a byte at a time, so that nothing after it is consumed).
std::optional<std::string> ReadLineRaw(int fd, double seconds = 10.0) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int>(seconds * 1e3));
  std::string line;
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    char c;
    if (recv(fd, &c, 1, 0) != 1) return std::nullopt;
    if (c == '\n') return line;
    line.push_back(c);
  }
  return std::nullopt;
}

std::string Hex(const std::string& bytes) { return absl::BytesToHexString(bytes); }

std::string Nonce() { return tools::RandomBytes(kAuthNonceBytes).value(); }

// The raw nonce of the hub's "CHALLENGE 2 <nonce>" line on `fd`, or "" when it sends none.
std::string ReadChallenge(int fd) {
  std::optional<std::string> line = ReadLineRaw(fd);
  if (!line) return "";
  std::vector<std::string> parts = absl::StrSplit(*line, ' ');
  if (parts.size() != 3 || parts[0] != "CHALLENGE" || parts[1] != "2") return "";
  return absl::HexStringToBytes(parts[2]);
}

// The AUTH line of a client that answers `hub_nonce` with `client_nonce`, proving `secret` as
// `role` (an honest client: kHubClient) to the hub at `endpoint`.
std::string AuthLine(const std::string& hub_nonce, const std::string& client_nonce,
                     const std::string& endpoint, const std::string& secret = kSecret,
                     AuthRole role = AuthRole::kHubClient) {
  return absl::StrCat("AUTH ", Hex(client_nonce), " ",
                      Hex(AuthProof(secret, role, hub_nonce, client_nonce, endpoint).value()),
                      "\n");
}

// What an honest client does on a raw connection `fd` to the hub at `address`: answers its
// challenge with the secret's proof; true when the hub accepts it.
bool AuthenticateRaw(int fd, const std::string& address) {
  const std::string nonce = ReadChallenge(fd);
  if (nonce.empty() || !SendRaw(fd, AuthLine(nonce, Nonce(), address))) return false;
  const std::optional<std::string> answer = ReadLineRaw(fd);
  return answer && answer->rfind("OK ", 0) == 0;
}

TEST(StepSyncTest, AllReduceMaxReturnsTheLargestValueToEveryRank) {
  constexpr int kRanks = 4;
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StartHub(kRanks);
  ASSERT_TRUE(hub.ok()) << hub.status();
  std::vector<std::future<absl::StatusOr<double>>> results;
  for (int rank = 0; rank < kRanks; ++rank) {
    results.push_back(std::async(std::launch::async, [&, rank] {
      std::unique_ptr<StepSyncClient> client = ConnectOrDie((*hub)->address(), rank);
      return client->AllReduceMax(/*step=*/7, kGradientPhase, /*value=*/rank * 1.5,
                                  /*timeout_seconds=*/30);
    }));
  }
  for (auto& result : results) {
    absl::StatusOr<double> max_value = result.get();
    ASSERT_TRUE(max_value.ok()) << max_value.status();
    EXPECT_EQ(*max_value, 4.5);
  }
}

TEST(StepSyncTest, ARoundIsNotReleasedUntilEveryRankArrives) {
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StartHub(/*ranks=*/2);
  ASSERT_TRUE(hub.ok()) << hub.status();
  std::unique_ptr<StepSyncClient> alone = ConnectOrDie((*hub)->address(), 0);
  absl::StatusOr<double> result = alone->AllReduceMax(1, kPlanPhase, 1.0, /*timeout=*/0.3);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded) << result.status();
  EXPECT_NE(result.status().message().find("step 1 phase 0"), std::string::npos);
}

TEST(StepSyncTest, RoundsAreKeptApartByStepAndPhase) {
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StartHub(/*ranks=*/2);
  ASSERT_TRUE(hub.ok()) << hub.status();
  auto other = std::async(std::launch::async, [&] {
    std::unique_ptr<StepSyncClient> client = ConnectOrDie((*hub)->address(), 1);
    const double plan = client->AllReduceMax(3, kPlanPhase, 0.0, 30).value_or(-1);
    const double gradient = client->AllReduceMax(3, kGradientPhase, 2.0, 30).value_or(-1);
    return std::make_pair(plan, gradient);
  });
  std::unique_ptr<StepSyncClient> client = ConnectOrDie((*hub)->address(), 0);
  EXPECT_EQ(client->AllReduceMax(3, kPlanPhase, 1.0, 30).value_or(-1), 1.0);
  EXPECT_EQ(client->AllReduceMax(3, kGradientPhase, 0.5, 30).value_or(-1), 2.0);
  const auto [plan, gradient] = other.get();
  EXPECT_EQ(plan, 1.0);
  EXPECT_EQ(gradient, 2.0);
}

TEST(StepSyncTest, ARestartedRankIsAnsweredAtOnceForAReleasedRound) {
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StartHub(/*ranks=*/2);
  ASSERT_TRUE(hub.ok()) << hub.status();
  auto other = std::async(std::launch::async, [&] {
    return ConnectOrDie((*hub)->address(), 1)->AllReduceMax(5, kGradientPhase, 3.0, 30);
  });
  {
    std::unique_ptr<StepSyncClient> first = ConnectOrDie((*hub)->address(), 0);
    EXPECT_EQ(first->AllReduceMax(5, kGradientPhase, 1.0, 30).value_or(-1), 3.0);
  }
  EXPECT_EQ(other.get().value_or(-1), 3.0);
  // Rank 0 restarts (a new connection) and arrives again at the released round: the other
  // rank has moved on, yet the answer comes at once and is the same.
  std::unique_ptr<StepSyncClient> restarted = ConnectOrDie((*hub)->address(), 0);
  EXPECT_EQ(restarted->AllReduceMax(5, kGradientPhase, 1.0, /*timeout=*/5).value_or(-1), 3.0);
}

TEST(StepSyncTest, APeerThatSpeaksNonsenseIsDroppedAndTheOthersGoOn) {
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StartHub(/*ranks=*/2);
  ASSERT_TRUE(hub.ok()) << hub.status();
  const std::string address = (*hub)->address();
  const int fd = ConnectRaw(address);
  ASSERT_GE(fd, 0);
  // With the secret, a rank out of range, then an ARRIVE before HELLO: the hub closes this
  // connection.
  ASSERT_TRUE(AuthenticateRaw(fd, address));
  ASSERT_TRUE(SendRaw(fd, "HELLO 99\nARRIVE 1 0 nan-ish\n"));
  EXPECT_EQ(ReadUntilClosed(fd, 10.0), "") << "the hub should close the connection";
  close(fd);

  auto other = std::async(std::launch::async, [&] {
    return ConnectOrDie(address, 1)->AllReduceMax(1, kPlanPhase, 0.0, 30);
  });
  EXPECT_EQ(ConnectOrDie(address, 0)->AllReduceMax(1, kPlanPhase, 0.0, 30).value_or(-1), 0.0);
  EXPECT_EQ(other.get().value_or(-1), 0.0);
  EXPECT_EQ((*hub)->refused_connections(), 0) << "nonsense after the secret is no refusal";
}

// Any local process, of any user, can connect to the hub. Without the run's secret as its
// first line it registered a false shard-exchange address for a rank (redirecting the
// documents split to it) and arrived for a rank; now the hub answers a connection that does not
// prove the secret (a wrong proof, one for another challenge, the hub's own proof reflected,
// the secret itself as the old protocol sent it) DENIED, closes it, counts it and acts on
// nothing it sent, and says so on stderr without the secret.
TEST(StepSyncTest, AConnectionWithoutTheSecretCannotRegisterAnAddressOrArrive) {
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StartHub(/*ranks=*/2);
  ASSERT_TRUE(hub.ok()) << hub.status();
  const std::string address = (*hub)->address();
  ASSERT_TRUE(RegisterRankAddress(address, kSecret, 1, "127.0.0.1:1111").ok());
  const std::string secret = kSecret;
  std::string near_miss = secret;
  near_miss.back() ^= 1;
  // An honest client's AUTH line, recorded from a connection of its own, to be replayed.
  std::string recorded;
  {
    const int fd = ConnectRaw(address);
    ASSERT_GE(fd, 0);
    const std::string nonce = ReadChallenge(fd);
    ASSERT_FALSE(nonce.empty());
    recorded = AuthLine(nonce, Nonce(), address);
    ASSERT_TRUE(SendRaw(fd, recorded));
    ASSERT_THAT(ReadLineRaw(fd).value_or(""), ::testing::StartsWith("OK "));
    close(fd);
  }
  // What a hostile process sends, given the hub's challenge nonce.
  using Forge = std::function<std::string(const std::string& nonce)>;
  const std::vector<std::pair<const char*, Forge>> hostile = {
      {"no AUTH line", [](const std::string&) { return "ADDRESS 1 127.0.0.1:6666\n"; }},
      {"no AUTH line, arriving", [](const std::string&) { return "HELLO 1\nARRIVE 1 0 5\n"; }},
      {"the secret itself, as protocol 1 sent it",
       [&](const std::string&) { return "AUTH " + secret + "\nADDRESS 1 127.0.0.1:6666\n"; }},
      {"a wrong proof",
       [&](const std::string&) {
         return absl::StrCat("AUTH ", Hex(Nonce()), " ", Hex(Nonce()),
                             "\nADDRESS 1 127.0.0.1:6666\n");
       }},
      {"a proof under the secret but its last bit",
       [&](const std::string& nonce) {
         return AuthLine(nonce, Nonce(), address, near_miss) + "HELLO 1\nARRIVE 1 0 5\n";
       }},
      {"a proof for another address (relayed from another port)",
       [&](const std::string& nonce) {
         return AuthLine(nonce, Nonce(), "127.0.0.1:1") + "ADDRESS 1 127.0.0.1:6666\n";
       }},
      {"the hub's proof reflected as the client's",
       [&](const std::string& nonce) {
         return AuthLine(nonce, Nonce(), address, secret, AuthRole::kHub) +
                "ADDRESS 1 127.0.0.1:6666\n";
       }},
      {"the exchange sender's proof, of the other protocol",
       [&](const std::string& nonce) {
         return AuthLine(nonce, Nonce(), address, secret, AuthRole::kExchangeSender) +
                "ADDRESS 1 127.0.0.1:6666\n";
       }},
      {"an honest AUTH line replayed from an earlier connection",
       [&](const std::string&) { return recorded + "ADDRESS 1 127.0.0.1:6666\n"; }},
      {"an empty AUTH line",
       [](const std::string&) { return "AUTH \nADDRESS 1 127.0.0.1:6666\n"; }},
      {"AUTH not first",
       [&](const std::string& nonce) {
         return "WHERE 1\n" + AuthLine(nonce, Nonce(), address) + "ADDRESS 1 127.0.0.1:6666\n";
       }},
      {"a first line longer than any AUTH line",
       [](const std::string&) { return std::string(4096, 'A'); }},
  };
  int64_t refused = 0;
  ::testing::internal::CaptureStderr();
  for (const auto& [what, forge] : hostile) {
    SCOPED_TRACE(what);
    // EXPECT, not ASSERT, while stderr is captured.
    const int fd = ConnectRaw(address);
    EXPECT_GE(fd, 0);
    if (fd < 0) continue;
    const std::string nonce = ReadChallenge(fd);
    EXPECT_FALSE(nonce.empty());
    const std::string bytes = forge(nonce);
    EXPECT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
    EXPECT_EQ(ReadUntilClosed(fd, 10.0), "DENIED\n");
    close(fd);
    EXPECT_EQ((*hub)->refused_connections(), ++refused);
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, HasSubstr("dropped a connection: its first line is not AUTH <nonce> <proof>"));
  EXPECT_THAT(log, HasSubstr("does not prove the run's secret"));
  EXPECT_THAT(log, Not(HasSubstr(secret.substr(0, 20))));

  // The library refuses another run's secret the same way, with an error that says so.
  absl::Status other_run =
      RegisterRankAddress(address, "another-runs-secret-0123456789", 1, "127.0.0.1:6666");
  EXPECT_EQ(other_run.code(), absl::StatusCode::kPermissionDenied) << other_run;
  EXPECT_THAT(other_run.message(), HasSubstr("refused this worker's secret"));
  absl::Status other_client =
      StepSyncClient::Connect(address, "another-runs-secret-0123456789", 0).status();
  EXPECT_EQ(other_client.code(), absl::StatusCode::kPermissionDenied) << other_client;
  EXPECT_EQ((*hub)->refused_connections(), refused + 2);

  // Rank 1's address is the one it registered, and step 1's round waits for the real rank 1
  // (no false arrival released it, at 5 or at all).
  EXPECT_EQ(LookupRankAddress(address, kSecret, 1).value_or(""), "127.0.0.1:1111");
  std::unique_ptr<StepSyncClient> rank0 = ConnectOrDie(address, 0);
  absl::StatusOr<double> early = rank0->AllReduceMax(1, kPlanPhase, 0.0, /*timeout=*/0.5);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded) << early.status();
  auto rank1 = std::async(std::launch::async, [&] {
    return ConnectOrDie(address, 1)->AllReduceMax(1, kPlanPhase, 0.0, 30);
  });
  EXPECT_EQ(rank0->AllReduceMax(1, kPlanPhase, 0.0, 30).value_or(-1), 0.0);
  EXPECT_EQ(rank1.get().value_or(-1), 0.0);
}

// A connection that sends nothing, or an AUTH line that never ends, is dropped at the
// authentication deadline instead of being kept for ever.
TEST(StepSyncTest, AConnectionThatDoesNotAuthenticateInTimeIsDropped) {
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub =
      StartHub(/*ranks=*/1, /*auth_timeout_seconds=*/0.3);
  ASSERT_TRUE(hub.ok()) << hub.status();
  const int silent = ConnectRaw((*hub)->address());
  const int unfinished = ConnectRaw((*hub)->address());
  ASSERT_GE(silent, 0);
  ASSERT_GE(unfinished, 0);
  ASSERT_EQ(send(unfinished, "AUTH step", 9, MSG_NOSIGNAL), 9);
  EXPECT_THAT(ReadUntilClosed(silent, 10.0).value_or(""), ::testing::EndsWith("\nDENIED\n"));
  EXPECT_THAT(ReadUntilClosed(unfinished, 10.0).value_or(""), ::testing::EndsWith("\nDENIED\n"));
  close(silent);
  close(unfinished);
  EXPECT_EQ((*hub)->refused_connections(), 2);
  // An honest rank, slower than the deadline between its lines once authenticated, is served.
  std::unique_ptr<StepSyncClient> rank0 = ConnectOrDie((*hub)->address(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  EXPECT_EQ(rank0->AllReduceMax(1, kPlanPhase, 2.0, 30).value_or(-1), 2.0);
  EXPECT_EQ((*hub)->refused_connections(), 2);
}

// A process that took over the hub's port (after the hub, or racing it) sent a CHALLENGE, or
// nothing, and read what the client sent: with protocol 1 the secret itself, at once. Now the
// client sends a nonce and a proof only, and refuses a listener that cannot prove the secret in
// turn (a wrong proof, the client's own reflected, a real hub's replayed from an earlier
// connection) with an error naming the address, before it sends anything else.
TEST(StepSyncTest, AListenerInTheHubsPlaceLearnsNoSecretAndIsRefused) {
  RawListener fake;
  const std::string secret = kSecret;
  // A listener that sends no challenge at all (as a hub of protocol 1 did not) hears nothing.
  std::future<std::string> silent = ServeOnce(fake, [](int, std::string*) {});
  absl::Status status = RegisterRankAddress(fake.address, kSecret, 0, "127.0.0.1:7", 0.5);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(status.message(), HasSubstr(fake.address));
  EXPECT_EQ(silent.get(), "");

  const std::string fake_nonce = Nonce();
  // A real hub's answer, recorded from the connection of the honest fake below.
  std::string recorded_proof;
  // What the fake answers the AUTH line `auth` with, given the client's nonce.
  using Answer = std::function<std::string(const std::vector<std::string>& auth)>;
  auto script = [&](const Answer& answer) {
    return [&, answer](int fd, std::string* got) {
      if (!SendRaw(fd, absl::StrCat("CHALLENGE 2 ", Hex(fake_nonce), "\n"))) return;
      const std::optional<std::string> line = ReadLineRaw(fd);
      if (!line) return;
      *got += *line + "\n";
      SendRaw(fd, answer(absl::StrSplit(*line, ' ')));
    };
  };
  // First a fake that knows the secret (as the real hub does): the client accepts it, which
  // shows that the refusals below are for the proof alone.
  std::future<std::string> honest = ServeOnce(
      fake, script([&](const auto& auth) {
        const std::string client_nonce = absl::HexStringToBytes(auth.at(1));
        recorded_proof =
            AuthProof(secret, AuthRole::kHub, fake_nonce, client_nonce, fake.address).value();
        return absl::StrCat("OK ", Hex(recorded_proof), "\n");
      }));
  status = StepSyncClient::Connect(fake.address, kSecret, 0, 5).status();
  EXPECT_THAT(honest.get(), Not(HasSubstr(secret)));
  ASSERT_TRUE(status.ok()) << status;
  ASSERT_FALSE(recorded_proof.empty());

  const std::vector<std::pair<const char*, Answer>> forged = {
      {"a wrong proof", [](const auto&) { return absl::StrCat("OK ", Hex(Nonce()), "\n"); }},
      {"the client's proof reflected",
       [](const auto& auth) { return absl::StrCat("OK ", auth.at(2), "\n"); }},
      {"a real hub's proof replayed from an earlier connection",
       [&](const auto&) { return absl::StrCat("OK ", Hex(recorded_proof), "\n"); }},
      {"an OK without a proof (protocol 1)", [](const auto&) { return std::string("OK\n"); }},
  };
  for (const auto& [what, answer] : forged) {
    SCOPED_TRACE(what);
    for (int call = 0; call < 3; ++call) {
      std::future<std::string> got = ServeOnce(fake, script(answer));
      if (call == 0) status = StepSyncClient::Connect(fake.address, kSecret, 0, 5).status();
      if (call == 1) status = RegisterRankAddress(fake.address, kSecret, 0, "127.0.0.1:7", 5);
      if (call == 2) status = LookupRankAddress(fake.address, kSecret, 0, 5).status();
      EXPECT_EQ(status.code(), absl::StatusCode::kUnauthenticated) << status;
      EXPECT_THAT(status.message(), HasSubstr(fake.address));
      EXPECT_THAT(status.message(), HasSubstr("not this run's hub"));
      EXPECT_THAT(status.message(), Not(HasSubstr(secret)));
      const std::string sent = got.get();
      EXPECT_THAT(sent, ::testing::StartsWith("AUTH ")) << sent;
      EXPECT_THAT(sent, Not(HasSubstr(secret)));
      // Nothing after the AUTH line: no HELLO, ADDRESS or WHERE reached the impostor.
      EXPECT_EQ(sent.find('\n'), sent.size() - 1) << sent;
    }
  }
}

// A process on another port that relays the handshake between a client and the real hub learns
// nothing, and gets in nowhere: the proofs name the hub's address, which the two ends see
// differently through the relay.
TEST(StepSyncTest, AHandshakeRelayedThroughAnotherPortIsRefused) {
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StartHub(/*ranks=*/1);
  ASSERT_TRUE(hub.ok()) << hub.status();
  RawListener relay;
  std::future<std::string> relayed = ServeOnce(relay, [&](int client, std::string* got) {
    const int upstream = ConnectRaw((*hub)->address());
    for (int line = 0; line < 3; ++line) {  // CHALLENGE up to down, AUTH down to up, the verdict
      const int from = line == 1 ? client : upstream;
      const int to = line == 1 ? upstream : client;
      const std::optional<std::string> text = ReadLineRaw(from);
      if (!text) break;
      if (from == client) *got += *text + "\n";
      SendRaw(to, *text + "\n");
    }
    close(upstream);
  });
  ::testing::internal::CaptureStderr();
  absl::Status status = StepSyncClient::Connect(relay.address, kSecret, 0, 5).status();
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_FALSE(status.ok());
  EXPECT_EQ((*hub)->refused_connections(), 1);
  EXPECT_THAT(log, HasSubstr("does not prove the run's secret"));
  EXPECT_THAT(relayed.get(), Not(HasSubstr(kSecret)));
  EXPECT_TRUE(StepSyncClient::Connect((*hub)->address(), kSecret, 0, 5).ok());
}

// Each connection that has not authenticated held a hub slot until the auth timeout, without
// bound: a local process could open thousands. Now at most kMaxPendingAuthConnections wait; a
// newer connection drops the oldest at once (refused, counted), so honest ranks, which
// authenticate within a round trip, still get through while the flood holds the rest.
TEST(StepSyncTest, IdleConnectionsBeyondTheCapAreDroppedAndRanksStillGetThrough) {
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub =
      StartHub(/*ranks=*/2, /*auth_timeout_seconds=*/60);  // no deadline ends one here
  ASSERT_TRUE(hub.ok()) << hub.status();
  const std::string address = (*hub)->address();
  constexpr int kExtra = 10;
  std::vector<int> idle;
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < kMaxPendingAuthConnections + kExtra; ++i) {
    const int fd = ConnectRaw(address);
    EXPECT_GE(fd, 0);
    if (fd < 0) break;
    EXPECT_FALSE(ReadChallenge(fd).empty());  // admitted, in this order
    idle.push_back(fd);
  }
  // The first kExtra made room for the later ones, at once: answered DENIED and closed.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int denied = 0;
  for (int i = 0; i < kExtra && i < static_cast<int>(idle.size()); ++i) {
    const double left =
        std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
    denied += ReadUntilClosed(idle[i], std::max(left, 0.0)) == "DENIED\n" ? 1 : 0;
  }
  EXPECT_EQ(denied, kExtra) << "idle connections beyond the cap are kept";
  EXPECT_EQ((*hub)->refused_connections(), kExtra);
  // The others are still held (the hub closes none of them before the deadline).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(StillOpen(std::vector<int>(idle.begin() + kExtra, idle.end())),
            kMaxPendingAuthConnections);
  // Honest ranks connect, register, look up and all-reduce while the flood holds the cap; each
  // of their connections that finds the cap full drops one more idle one (the first does).
  auto rank1 = std::async(std::launch::async, [&] {
    return ConnectOrDie(address, 1)->AllReduceMax(1, kPlanPhase, 3.0, 30);
  });
  EXPECT_TRUE(RegisterRankAddress(address, kSecret, 0, "127.0.0.1:1234", 10).ok());
  EXPECT_EQ(LookupRankAddress(address, kSecret, 0, 10).value_or(""), "127.0.0.1:1234");
  std::unique_ptr<StepSyncClient> rank0 = ConnectOrDie(address, 0);
  EXPECT_EQ(rank0 ? rank0->AllReduceMax(1, kPlanPhase, 1.0, 30).value_or(-1) : -1, 3.0);
  EXPECT_EQ(rank1.get().value_or(-1), 3.0);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_GT((*hub)->refused_connections(), kExtra);
  EXPECT_LE((*hub)->refused_connections(), kExtra + 4) << "4 honest connections";
  EXPECT_THAT(log, HasSubstr("newer connections waited to"));
  for (int fd : idle) close(fd);
}

// Every refused connection wrote a line to stderr: a local process connecting in a loop could
// fill a worker's log. The first ten are written, the rest counted.
TEST(StepSyncTest, RefusalsPastTheFirstTenAreCountedNotEachWritten) {
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StartHub(/*ranks=*/1);
  ASSERT_TRUE(hub.ok()) << hub.status();
  const std::string address = (*hub)->address();
  constexpr int kRefused = 60;
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < kRefused; ++i) {
    const int fd = ConnectRaw(address);
    ASSERT_GE(fd, 0);
    ASSERT_FALSE(ReadChallenge(fd).empty());
    ASSERT_TRUE(SendRaw(fd, "AUTH 00 00\n"));  // no proof of anything
    EXPECT_EQ(ReadUntilClosed(fd, 10), "DENIED\n");
    close(fd);
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ((*hub)->refused_connections(), kRefused);
  const std::vector<absl::string_view> lines = absl::StrSplit(log, '\n', absl::SkipEmpty());
  EXPECT_EQ(lines.size(), static_cast<size_t>(RefusalLog::kDefaultBurst)) << log;
  EXPECT_EQ((*hub)->refusal_log().unwritten(), kRefused - RefusalLog::kDefaultBurst);
  // The hub serves on.
  std::unique_ptr<StepSyncClient> rank0 = ConnectOrDie(address, 0);
  EXPECT_EQ(rank0 ? rank0->AllReduceMax(1, kPlanPhase, 2.0, 30).value_or(-1) : -1, 2.0);
}

TEST(RefusalLogTest, WritesTheFirstLinesThenOneAnIntervalSayingHowManyWentUnwritten) {
  std::ostringstream out;
  absl::Time now = absl::FromUnixSeconds(1000);
  RefusalLog log(out, /*burst=*/2, absl::Minutes(1), [&now] { return now; });
  for (int i = 0; i < 5; ++i) log.Write(absl::StrCat("refused ", i, "\n"));
  EXPECT_EQ(out.str(), "refused 0\nrefused 1\n");
  EXPECT_EQ(log.written(), 2);
  EXPECT_EQ(log.unwritten(), 3);
  now += absl::Seconds(59);
  log.Write("refused 5\n");
  EXPECT_EQ(log.written(), 2);
  now += absl::Seconds(2);  // a minute after the last line written
  log.Write("refused 6\n");
  EXPECT_EQ(log.written(), 3);
  EXPECT_EQ(log.unwritten(), 4);
  EXPECT_THAT(out.str(), HasSubstr("refused 6 [4 refusals since the last line not written: at "
                                   "most one line every 1m after the first 2]\n"));
  log.Write("refused 7\n");  // the interval starts again
  EXPECT_EQ(log.written(), 3);
  now += absl::Minutes(1);
  log.Write("refused 8\n");
  EXPECT_THAT(out.str(), HasSubstr("refused 8 [1 refusal since the last line not written"));
}

// An authenticated peer's bytes went into its buffer without bound until a newline came: one
// endless line could take the hub's memory. Now a line longer than any of the protocol's
// closes that connection, with a line on stderr, and the hub serves the others on.
TEST(StepSyncTest, AnAuthenticatedPeerSendingAnEndlessLineIsDisconnected) {
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StartHub(/*ranks=*/2);
  ASSERT_TRUE(hub.ok()) << hub.status();
  const std::string address = (*hub)->address();
  const int fd = ConnectRaw(address);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(AuthenticateRaw(fd, address));
  ASSERT_TRUE(SendRaw(fd, "HELLO 1\nARRIVE 1 0 "));
  ::testing::internal::CaptureStderr();
  // Up to 64 MiB of one line's digits, until the hub closes the connection. The kernel's
  // loopback buffers take several MiB before the hub reads any (a bound of 4 MiB failed 1 run
  // in 20 under load): far more than that ends sending only if the hub closed.
  constexpr int64_t kEndless = int64_t{64} << 20;
  const std::string chunk(64 << 10, '7');
  int64_t sent = 0;
  while (sent < kEndless && SendRaw(fd, chunk)) sent += chunk.size();
  const std::optional<std::string> rest = ReadUntilClosed(fd, 10.0);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(rest.has_value()) << "the hub keeps reading an endless line";
  EXPECT_LT(sent, kEndless) << "the hub took 64 MiB of one line";
  EXPECT_THAT(log, HasSubstr("closed the connection of rank 1: a line runs past"));
  close(fd);
  EXPECT_EQ((*hub)->refused_connections(), 0) << "a peer that proved the secret is no refusal";
  // The hub goes on: both ranks all-reduce (rank 1 on a new connection).
  auto rank1 = std::async(std::launch::async, [&] {
    return ConnectOrDie(address, 1)->AllReduceMax(2, kPlanPhase, 2.0, 30);
  });
  EXPECT_EQ(ConnectOrDie(address, 0)->AllReduceMax(2, kPlanPhase, 1.0, 30).value_or(-1), 2.0);
  EXPECT_EQ(rank1.get().value_or(-1), 2.0);
}

TEST(StepSyncTest, BadAddressesAndRankCountsAreRefusedWithTheirField) {
  EXPECT_EQ(StartHub(/*ranks=*/0).status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status no_port = StepSyncClient::Connect("localhost", kSecret, 0).status();
  EXPECT_EQ(no_port.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_port.message().find("not host:port"), std::string::npos) << no_port;
  absl::Status bad_host = StepSyncClient::Connect("planner.example:5", kSecret, 0).status();
  EXPECT_EQ(bad_host.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_host.message().find("IPv4"), std::string::npos) << bad_host;
}

// There is no unauthenticated mode: an empty, short or multi-word secret is refused by the hub
// and by every client before anything is sent, naming the field and never quoting it.
TEST(StepSyncTest, AnEmptyShortOrMultiWordSecretIsRefused) {
  const std::string long_secret(kMaxSyncSecretBytes + 1, 'x');
  for (const std::string& secret :
       {std::string(), std::string("short-secret"), std::string("two words of a secret"),
        std::string("a-secret-with-a-newline\n-in-it"), long_secret}) {
    SCOPED_TRACE(secret);
    StepSyncHubOptions options;
    options.secret = secret;
    absl::Status hub = StepSyncHub::Start(1, options).status();
    EXPECT_EQ(hub.code(), absl::StatusCode::kInvalidArgument) << hub;
    EXPECT_THAT(hub.message(), HasSubstr("secret: "));
    if (!secret.empty()) {
      EXPECT_THAT(hub.message(), Not(HasSubstr(secret)));
    }
    EXPECT_EQ(StepSyncClient::Connect("127.0.0.1:1", secret, 0, 0.1).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(RegisterRankAddress("127.0.0.1:1", secret, 0, "127.0.0.1:2", 0.1).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(LookupRankAddress("127.0.0.1:1", secret, 0, 0.1).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(CheckSyncSecret(std::string(kMinSyncSecretBytes, '!')).ok());
  EXPECT_TRUE(CheckSyncSecret(std::string(kMaxSyncSecretBytes, '~')).ok());
}

}  // namespace
}  // namespace sparsebalance
