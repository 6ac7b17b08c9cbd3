// StepSyncHub and StepSyncClient over loopback, ranks as threads: the all-reduce releases only
// when every rank has arrived, returns the maximum, answers a restarted rank at once, and a
// peer that speaks nonsense is dropped without disturbing the others.
#include "worker/step_sync.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace sparsebalance {
namespace {

std::unique_ptr<StepSyncClient> ConnectOrDie(const std::string& address, int rank) {
  absl::StatusOr<std::unique_ptr<StepSyncClient>> client = StepSyncClient::Connect(address, rank);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

TEST(StepSyncTest, AllReduceMaxReturnsTheLargestValueToEveryRank) {
  constexpr int kRanks = 4;
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StepSyncHub::Start(kRanks);
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
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StepSyncHub::Start(/*ranks=*/2);
  ASSERT_TRUE(hub.ok()) << hub.status();
  std::unique_ptr<StepSyncClient> alone = ConnectOrDie((*hub)->address(), 0);
  absl::StatusOr<double> result = alone->AllReduceMax(1, kPlanPhase, 1.0, /*timeout=*/0.3);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded) << result.status();
  EXPECT_NE(result.status().message().find("step 1 phase 0"), std::string::npos);
}

TEST(StepSyncTest, RoundsAreKeptApartByStepAndPhase) {
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StepSyncHub::Start(/*ranks=*/2);
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
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StepSyncHub::Start(/*ranks=*/2);
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
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StepSyncHub::Start(/*ranks=*/2);
  ASSERT_TRUE(hub.ok()) << hub.status();
  const std::string address = (*hub)->address();
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  // A rank out of range, then an ARRIVE before HELLO: the hub closes this connection.
  const std::string garbage = "HELLO 99\nARRIVE 1 0 nan-ish\n";
  ASSERT_EQ(send(fd, garbage.data(), garbage.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(garbage.size()));
  char byte;
  EXPECT_LE(recv(fd, &byte, 1, 0), 0) << "the hub should close the connection";
  close(fd);

  auto other = std::async(std::launch::async, [&] {
    return ConnectOrDie(address, 1)->AllReduceMax(1, kPlanPhase, 0.0, 30);
  });
  EXPECT_EQ(ConnectOrDie(address, 0)->AllReduceMax(1, kPlanPhase, 0.0, 30).value_or(-1), 0.0);
  EXPECT_EQ(other.get().value_or(-1), 0.0);
}

TEST(StepSyncTest, BadAddressesAndRankCountsAreRefusedWithTheirField) {
  EXPECT_EQ(StepSyncHub::Start(/*ranks=*/0).status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status no_port = StepSyncClient::Connect("localhost", 0).status();
  EXPECT_EQ(no_port.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_port.message().find("not host:port"), std::string::npos) << no_port;
  absl::Status bad_host = StepSyncClient::Connect("planner.example:5", 0).status();
  EXPECT_EQ(bad_host.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_host.message().find("IPv4"), std::string::npos) << bad_host;
}

}  // namespace
}  // namespace sparsebalance
