// StepSyncHub and StepSyncClient over loopback, ranks as threads: the all-reduce releases only
// when every rank has arrived, returns the maximum, answers a restarted rank at once, a peer
// that speaks nonsense is dropped without disturbing the others, and a local process without
// the run's secret can neither arrive nor register an address, nor hold a connection open.
#include "worker/step_sync.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace sparsebalance {
namespace {

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

// A raw loopback connection to the hub at `address` (127.0.0.1:port); -1 on failure.
int ConnectRaw(const std::string& address) {
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// What the hub sends on `fd` until it closes it, or nullopt when it keeps it open past `seconds`.
std::optional<std::string> ReadUntilClosed(int fd, double seconds) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int>(seconds * 1e3));
  std::string got;
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    char chunk[256];
    const ssize_t n = recv(fd, chunk, sizeof chunk, 0);
    if (n <= 0) return got;
    got.append(chunk, static_cast<size_t>(n));
  }
  return std::nullopt;
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
  const std::string garbage = absl::StrCat("AUTH ", kSecret, "\nHELLO 99\nARRIVE 1 0 nan-ish\n");
  ASSERT_EQ(send(fd, garbage.data(), garbage.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(garbage.size()));
  EXPECT_EQ(ReadUntilClosed(fd, 10.0), "OK\n") << "the hub should close the connection";
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
// documents split to it) and arrived for a rank; now the hub answers DENIED, closes it,
// counts it and acts on nothing it sent, and says so on stderr without the secret.
TEST(StepSyncTest, AConnectionWithoutTheSecretCannotRegisterAnAddressOrArrive) {
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StartHub(/*ranks=*/2);
  ASSERT_TRUE(hub.ok()) << hub.status();
  const std::string address = (*hub)->address();
  ASSERT_TRUE(RegisterRankAddress(address, kSecret, 1, "127.0.0.1:1111").ok());
  const std::string secret = kSecret;
  std::string near_miss = secret;
  near_miss.back() ^= 1;
  const std::vector<std::pair<const char*, std::string>> hostile = {
      {"no AUTH line", "ADDRESS 1 127.0.0.1:6666\n"},
      {"no AUTH line, arriving", "HELLO 1\nARRIVE 1 0 5\n"},
      {"a wrong secret", "AUTH not-the-secret-at-all-xyz\nADDRESS 1 127.0.0.1:6666\n"},
      {"the secret but its last bit", "AUTH " + near_miss + "\nHELLO 1\nARRIVE 1 0 5\n"},
      {"a prefix of the secret", "AUTH " + secret.substr(0, 20) + "\nADDRESS 1 127.0.0.1:6666\n"},
      {"an empty secret", "AUTH \nADDRESS 1 127.0.0.1:6666\n"},
      {"AUTH not first", "WHERE 1\nAUTH " + secret + "\nADDRESS 1 127.0.0.1:6666\n"},
      {"a first line longer than any AUTH line", std::string(4096, 'A')},
  };
  int64_t refused = 0;
  ::testing::internal::CaptureStderr();
  for (const auto& [what, bytes] : hostile) {
    SCOPED_TRACE(what);
    // EXPECT, not ASSERT, while stderr is captured.
    const int fd = ConnectRaw(address);
    EXPECT_GE(fd, 0);
    if (fd < 0) continue;
    EXPECT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
    EXPECT_EQ(ReadUntilClosed(fd, 10.0), "DENIED\n");
    close(fd);
    EXPECT_EQ((*hub)->refused_connections(), ++refused);
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, HasSubstr("dropped a connection: its first line is not AUTH"));
  EXPECT_THAT(log, HasSubstr("does not hold the run's secret"));
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
  EXPECT_EQ(ReadUntilClosed(silent, 10.0), "DENIED\n");
  EXPECT_EQ(ReadUntilClosed(unfinished, 10.0), "DENIED\n");
  close(silent);
  close(unfinished);
  EXPECT_EQ((*hub)->refused_connections(), 2);
  // An honest rank, slower than the deadline between its lines once authenticated, is served.
  std::unique_ptr<StepSyncClient> rank0 = ConnectOrDie((*hub)->address(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  EXPECT_EQ(rank0->AllReduceMax(1, kPlanPhase, 2.0, 30).value_or(-1), 2.0);
  EXPECT_EQ((*hub)->refused_connections(), 2);
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
