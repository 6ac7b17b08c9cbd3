// The shard exchange over loopback with ranks as threads (addresses through a real step-sync
// hub), and RunShardLayer on it: a document split over 4 ranks gives the unsplit document's
// attention outputs and gradients, a shard whose peer never arrives fails with an error
// naming the peer instead of hanging, a local process without the run's secret gets nothing
// into Receive, and one writing frame headers no peer sends loses its connection while the
// exchange goes on, without leaving threads behind.
//
// Tolerance (tests/kernels/shard_attention_test.cc establishes it): the sharded pass groups
// the same fp32 products by chunk and merges partials in double, so it differs from the
// unsplit pass by rounding only; |sharded - unsplit| <= 1e-5 x the largest unsplit magnitude
// (for lse, of max(1, max |lse|)).
#include "worker/shard_exchange.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/attention_cpu.h"
#include "kernels/block_selection.h"
#include "worker/shard_layer.h"
#include "worker/step_sync.h"
#include "worker/synthetic_inputs.h"

namespace sparsebalance {
namespace {

using ::testing::HasSubstr;

constexpr double kTolerance = 1e-5;

// The run's secret of these tests (sb-run draws 64 random hex digits instead).
const char kSecret[] = "shard-exchange-test-secret-0123456789";

std::unique_ptr<StepSyncHub> StartHub(int ranks) {
  StepSyncHubOptions options;
  options.secret = kSecret;
  absl::StatusOr<std::unique_ptr<StepSyncHub>> hub = StepSyncHub::Start(ranks, options);
  EXPECT_TRUE(hub.ok()) << hub.status();
  return hub.ok() ? *std::move(hub) : nullptr;
}

// The tests here run at most 4 ranks; their frames stay far below 64 MiB.
constexpr int kWorldSize = 4;
constexpr uint64_t kMaxPayloadBytes = uint64_t{64} << 20;

std::unique_ptr<ShardExchange> StartExchange(int rank, const std::string& hub,
                                             double timeout_seconds = 30,
                                             uint64_t max_payload_bytes = kMaxPayloadBytes,
                                             double auth_timeout_seconds = 5.0) {
  ShardExchangeOptions options;
  options.secret = kSecret;
  options.auth_timeout_seconds = auth_timeout_seconds;
  options.timeout_seconds = timeout_seconds;
  options.world_size = kWorldSize;
  options.max_payload_bytes = max_payload_bytes;
  absl::StatusOr<std::unique_ptr<ShardExchange>> ex = ShardExchange::Start(rank, hub, options);
  EXPECT_TRUE(ex.ok()) << ex.status();
  return ex.ok() ? *std::move(ex) : nullptr;
}

ExchangeKey Key(uint64_t sample, ExchangeKind kind, int layer = 0) {
  ExchangeKey key;
  key.step = 3;
  key.micro_batch = 1;
  key.sample_id = sample;
  key.layer = layer;
  key.kind = kind;
  return key;
}

TEST(ShardExchangeTest, MessagesArriveByPeerAndKeyWhateverTheOrder) {
  std::unique_ptr<StepSyncHub> hub = StartHub(3);
  ASSERT_NE(hub, nullptr);
  std::unique_ptr<ShardExchange> a = StartExchange(0, hub->address());
  std::unique_ptr<ShardExchange> b = StartExchange(1, hub->address());
  std::unique_ptr<ShardExchange> c = StartExchange(2, hub->address());
  ASSERT_TRUE(a && b && c);
  const std::string big(3 << 20, 'x');  // larger than any socket buffer
  ASSERT_TRUE(a->Send(1, Key(7, ExchangeKind::kPooledKeys), "pooled-7").ok());
  ASSERT_TRUE(a->Send(1, Key(7, ExchangeKind::kKeyValues), big).ok());
  ASSERT_TRUE(a->Send(1, Key(8, ExchangeKind::kPooledKeys), "pooled-8").ok());
  ASSERT_TRUE(c->Send(1, Key(7, ExchangeKind::kPooledKeys), "from-c").ok());
  ASSERT_TRUE(a->Send(1, Key(7, ExchangeKind::kPooledKeys, /*layer=*/1), "layer-1").ok());
  ASSERT_TRUE(a->Send(1, Key(7, ExchangeKind::kPooledKeys), "pooled-7-again").ok());
  // Received in another order than sent; each (peer, key) in its own order.
  EXPECT_EQ(*b->Receive(0, Key(8, ExchangeKind::kPooledKeys)), "pooled-8");
  EXPECT_EQ(*b->Receive(2, Key(7, ExchangeKind::kPooledKeys)), "from-c");
  EXPECT_EQ(*b->Receive(0, Key(7, ExchangeKind::kPooledKeys, 1)), "layer-1");
  EXPECT_EQ(*b->Receive(0, Key(7, ExchangeKind::kKeyValues)), big);
  EXPECT_EQ(*b->Receive(0, Key(7, ExchangeKind::kPooledKeys)), "pooled-7");
  EXPECT_EQ(*b->Receive(0, Key(7, ExchangeKind::kPooledKeys)), "pooled-7-again");
  EXPECT_EQ(b->bytes_received(), a->bytes_sent() + c->bytes_sent());
}

TEST(ShardExchangeTest, AMissingMessageOrPeerFailsNamingThePeer) {
  std::unique_ptr<StepSyncHub> hub = StartHub(4);
  ASSERT_NE(hub, nullptr);
  std::unique_ptr<ShardExchange> a = StartExchange(0, hub->address(), /*timeout_seconds=*/0.3);
  std::unique_ptr<ShardExchange> b = StartExchange(1, hub->address(), 0.3);
  ASSERT_TRUE(a && b);
  absl::StatusOr<std::string> got = a->Receive(1, Key(5, ExchangeKind::kGradients));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(got.status().message(), HasSubstr("from rank 1"));
  EXPECT_THAT(got.status().message(), HasSubstr("key/value gradients of sample 5"));
  // Rank 3 never registered: sending to it fails naming it.
  absl::Status sent = a->Send(3, Key(5, ExchangeKind::kPooledKeys), "x");
  EXPECT_EQ(sent.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(sent.message(), HasSubstr("rank 3 did not register"));
  // A peer that went away: the error says its connection closed.
  ASSERT_TRUE(b->Send(0, Key(5, ExchangeKind::kPooledKeys), "x").ok());
  ASSERT_TRUE(a->Receive(1, Key(5, ExchangeKind::kPooledKeys)).ok());
  b.reset();
  got = a->Receive(1, Key(5, ExchangeKind::kKeyValues));
  EXPECT_THAT(got.status().message(), HasSubstr("connection closed"));
  EXPECT_FALSE(a->Send(0, Key(5, ExchangeKind::kPooledKeys), "to myself").ok());
}

// A frame header as the wire carries it (worker/shard_exchange.h), written by hand.
struct RawHeader {
  uint32_t magic = 0x31584253;  // "SBX1"
  int32_t from = 1;
  int64_t step = 3;
  int32_t micro_batch = 1;
  int32_t layer = 0;
  uint64_t sample_id = 7;
  int32_t kind = 1;
  int32_t reserved = 0;
  uint64_t bytes = 0;
};

// A raw loopback connection to `address` (127.0.0.1:port); -1 on failure.
int ConnectRaw(const std::string& address) {
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

bool SendHeader(int fd, const RawHeader& h) {
  char wire[48];
  size_t at = 0;
  auto put = [&](const auto& field) {
    std::memcpy(wire + at, &field, sizeof field);
    at += sizeof field;
  };
  put(h.magic);
  put(h.from);
  put(h.step);
  put(h.micro_batch);
  put(h.layer);
  put(h.sample_id);
  put(h.kind);
  put(h.reserved);
  put(h.bytes);
  return send(fd, wire, sizeof wire, MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof wire);
}

// A connection's opening as the wire carries it: "SBA1", the secret's length and bytes.
std::string Opening(const std::string& secret, uint32_t magic = 0x31414253) {
  std::string wire(8, '\0');
  const uint32_t bytes = static_cast<uint32_t>(secret.size());
  std::memcpy(wire.data(), &magic, 4);
  std::memcpy(wire.data() + 4, &bytes, 4);
  return wire + secret;
}

bool SendBytes(int fd, const std::string& bytes) {
  return send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

bool SendOpening(int fd, const std::string& secret, uint32_t magic = 0x31414253) {
  return SendBytes(fd, Opening(secret, magic));
}

// Whether the other end closes `fd` within `seconds` (reads it to the end).
bool ClosedByPeer(int fd, double seconds) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int>(seconds * 1e3));
  char buffer[256];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) return true;
  }
  return false;
}

TEST(ShardExchangeTest, AHostileFrameHeaderDropsItsConnectionAndTheExchangeServesOn) {
  std::unique_ptr<StepSyncHub> hub = StartHub(2);
  ASSERT_NE(hub, nullptr);
  constexpr uint64_t kMax = 1 << 20;  // this job's largest payload, bytes
  std::unique_ptr<ShardExchange> a = StartExchange(0, hub->address(), 30, kMax);
  std::unique_ptr<ShardExchange> b = StartExchange(1, hub->address(), 30, kMax);
  ASSERT_TRUE(a && b);
  std::vector<std::pair<const char*, RawHeader>> hostile;
  RawHeader h;
  h.bytes = uint64_t{1} << 34;  // allocated at once, this ended the process with bad_alloc
  hostile.emplace_back("16 GiB payload", h);
  h.bytes = kMax + 1;
  hostile.emplace_back("one byte over the shapes' bound", h);
  h = RawHeader{};
  h.kind = 7;
  hostile.emplace_back("unknown kind", h);
  h.kind = 0;
  hostile.emplace_back("kind 0", h);
  h = RawHeader{};
  h.from = kWorldSize;
  hostile.emplace_back("rank outside the job", h);
  h.from = -1;
  hostile.emplace_back("negative rank", h);
  h.from = 0;
  hostile.emplace_back("the receiver's own rank", h);
  h = RawHeader{};
  h.magic = 0x12345678;
  hostile.emplace_back("bad magic", h);
  int64_t refused = 0;
  for (const auto& [what, header] : hostile) {
    SCOPED_TRACE(what);
    const int fd = ConnectRaw(a->address());
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendOpening(fd, kSecret));  // even a holder of the secret
    ASSERT_TRUE(SendHeader(fd, header));
    EXPECT_TRUE(ClosedByPeer(fd, 10.0)) << "the exchange keeps a hostile connection open";
    close(fd);
    EXPECT_EQ(a->refused_connections(), ++refused);
  }
  // A header for a second frame that then never comes, still open while the peer talks.
  const int idle = ConnectRaw(a->address());
  ASSERT_GE(idle, 0);
  ASSERT_TRUE(SendOpening(idle, kSecret));
  RawHeader pending;
  pending.bytes = kMax;  // allowed: memory grows only with the bytes that arrive
  ASSERT_TRUE(SendHeader(idle, pending));

  // The real peer is served as before, up to the bound exactly.
  ASSERT_TRUE(b->Send(0, Key(7, ExchangeKind::kPooledKeys), "real").ok());
  const std::string largest(kMax, 'y');
  ASSERT_TRUE(b->Send(0, Key(7, ExchangeKind::kKeyValues), largest).ok());
  absl::StatusOr<std::string> got = a->Receive(1, Key(7, ExchangeKind::kPooledKeys));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "real");
  got = a->Receive(1, Key(7, ExchangeKind::kKeyValues));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->size(), kMax);
  EXPECT_EQ(a->refused_connections(), refused);
  close(idle);
}

TEST(ShardExchangeTest, AFrameCutShortIsNeverDelivered) {
  std::unique_ptr<StepSyncHub> hub = StartHub(2);
  ASSERT_NE(hub, nullptr);
  std::unique_ptr<ShardExchange> a = StartExchange(0, hub->address(), /*timeout_seconds=*/0.3);
  ASSERT_NE(a, nullptr);
  const int fd = ConnectRaw(a->address());
  ASSERT_GE(fd, 0);
  RawHeader h;
  h.kind = static_cast<int32_t>(ExchangeKind::kPooledKeys);
  h.bytes = 10;
  ASSERT_TRUE(SendOpening(fd, kSecret));
  ASSERT_TRUE(SendHeader(fd, h));
  ASSERT_EQ(send(fd, "abcd", 4, MSG_NOSIGNAL), 4);
  close(fd);  // 6 bytes short
  absl::StatusOr<std::string> got = a->Receive(1, Key(7, ExchangeKind::kPooledKeys));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << "delivered: " << *got;
  EXPECT_EQ(a->bytes_received(), 0);
}

TEST(ShardExchangeTest, StartNeedsTheWorldSizeAndThePayloadBound) {
  ShardExchangeOptions options;
  options.max_payload_bytes = 1024;
  options.world_size = 2;
  absl::StatusOr<std::unique_ptr<ShardExchange>> ex =
      ShardExchange::Start(/*rank=*/2, "127.0.0.1:1", options);
  EXPECT_EQ(ex.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ex.status().message(), HasSubstr("world_size"));
  options.world_size = 3;
  options.max_payload_bytes = 0;
  ex = ShardExchange::Start(2, "127.0.0.1:1", options);
  EXPECT_EQ(ex.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ex.status().message(), HasSubstr("max_payload_bytes"));
  // No unauthenticated mode: an exchange without the run's secret does not start.
  options.max_payload_bytes = 1024;
  ex = ShardExchange::Start(2, "127.0.0.1:1", options);
  EXPECT_EQ(ex.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ex.status().message(), HasSubstr("secret: 0 bytes"));
}

// Any local process, of any user, can connect to a rank's exchange port. Frames with
// well-formed headers claiming to come from a peer went into its mailbox: forged keys, values
// or gradients entered training. Now nothing a connection sends is read as a frame before it
// proves the run's secret, and one that does not (or not in time) is dropped and counted.
TEST(ShardExchangeTest, AConnectionWithoutTheSecretNeverReachesReceive) {
  std::unique_ptr<StepSyncHub> hub = StartHub(2);
  ASSERT_NE(hub, nullptr);
  std::unique_ptr<ShardExchange> a =
      StartExchange(0, hub->address(), 30, kMaxPayloadBytes, /*auth_timeout_seconds=*/0.3);
  std::unique_ptr<ShardExchange> b = StartExchange(1, hub->address());
  ASSERT_TRUE(a && b);
  RawHeader forged;  // pooled keys of sample 7 "from rank 1", what b sends below
  forged.bytes = 6;
  const std::string secret = kSecret;
  std::string near_miss = secret;
  near_miss.back() ^= 1;
  struct Hostile {
    const char* what;
    std::function<bool(int)> send;
  };
  auto opening_then_frame = [&](const std::string& offered, uint32_t magic = 0x31414253) {
    return [&, offered, magic](int fd) {
      return SendOpening(fd, offered, magic) && SendHeader(fd, forged) &&
             send(fd, "forged", 6, MSG_NOSIGNAL) == 6;
    };
  };
  const std::vector<Hostile> hostile = {
      {"a frame with no opening",
       [&](int fd) { return SendHeader(fd, forged) && send(fd, "forged", 6, MSG_NOSIGNAL) == 6; }},
      {"the secret but its last bit", opening_then_frame(near_miss)},
      {"a prefix of the secret", opening_then_frame(secret.substr(0, 20))},
      {"the secret and more", opening_then_frame(secret + "x")},
      {"an empty secret", opening_then_frame("")},
      {"the secret under another magic", opening_then_frame(secret, 0x31584253)},
      {"nothing at all", [](int) { return true; }},
      {"an opening cut short",
       [&](int fd) { return SendBytes(fd, Opening(secret).substr(0, 13)); }},
  };
  int64_t refused = 0;
  for (const Hostile& h : hostile) {
    SCOPED_TRACE(h.what);
    const int fd = ConnectRaw(a->address());
    ASSERT_GE(fd, 0);
    h.send(fd);  // fails part way when the exchange refuses the opening before the frame
    EXPECT_TRUE(ClosedByPeer(fd, 10.0)) << "the exchange keeps an unauthenticated connection";
    close(fd);
    EXPECT_EQ(a->refused_connections(), ++refused);
  }
  // The real rank 1's message is the first and only one under its key.
  ASSERT_TRUE(b->Send(0, Key(7, ExchangeKind::kPooledKeys), "real").ok());
  absl::StatusOr<std::string> got = a->Receive(1, Key(7, ExchangeKind::kPooledKeys));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "real");
  EXPECT_EQ(a->bytes_received(), b->bytes_sent());
  EXPECT_EQ(a->refused_connections(), refused);
}

// A rank of another run (another secret) is told why its messages go nowhere.
TEST(ShardExchangeTest, APeerWithAnotherRunsSecretIsRefusedAndTheSenderSaysSo) {
  std::unique_ptr<StepSyncHub> hub = StartHub(2);
  ASSERT_NE(hub, nullptr);
  std::unique_ptr<ShardExchange> a = StartExchange(0, hub->address());
  ASSERT_NE(a, nullptr);
  StepSyncHubOptions other_options;
  other_options.secret = "another-runs-secret-0123456789";
  absl::StatusOr<std::unique_ptr<StepSyncHub>> other_hub = StepSyncHub::Start(2, other_options);
  ASSERT_TRUE(other_hub.ok()) << other_hub.status();
  ASSERT_TRUE(
      RegisterRankAddress((*other_hub)->address(), other_options.secret, 0, a->address()).ok());
  ShardExchangeOptions options;
  options.secret = other_options.secret;
  options.world_size = kWorldSize;
  options.max_payload_bytes = kMaxPayloadBytes;
  absl::StatusOr<std::unique_ptr<ShardExchange>> other =
      ShardExchange::Start(1, (*other_hub)->address(), options);
  ASSERT_TRUE(other.ok()) << other.status();
  absl::Status sent = (*other)->Send(0, Key(7, ExchangeKind::kPooledKeys), "forged");
  EXPECT_EQ(sent.code(), absl::StatusCode::kPermissionDenied) << sent;
  EXPECT_THAT(sent.message(), HasSubstr("refused this rank's secret"));
  EXPECT_EQ(a->refused_connections(), 1);
  EXPECT_EQ(a->bytes_received(), 0);
}

// The lines of /proc/self/<file> that start with `prefix` (all of them when it is empty).
int CountLines(const std::string& file, const std::string& prefix = "") {
  std::ifstream in("/proc/self/" + file);
  int n = 0;
  for (std::string line; std::getline(in, line);) n += line.rfind(prefix, 0) == 0 ? 1 : 0;
  return n;
}

// The value of "Threads:" in /proc/self/status: the threads running now.
int RunningThreads() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

// Each incoming connection has a reader thread. One that ended stayed unjoined until the
// exchange ended, its stack still mapped (8 MiB of address space, two mappings): refused
// connections piled up without bound (300 of them added 550 mappings). Now a reader is joined
// as the next connection comes in, and one that never authenticates runs until the deadline
// only. (A thread that ended but is not joined no longer counts in /proc's "Threads:", so the
// mappings are what shows it.)
TEST(ShardExchangeTest, RefusedConnectionsLeaveNoThreadsBehind) {
  std::unique_ptr<StepSyncHub> hub = StartHub(2);
  ASSERT_NE(hub, nullptr);
  std::unique_ptr<ShardExchange> a =
      StartExchange(0, hub->address(), 30, kMaxPayloadBytes, /*auth_timeout_seconds=*/0.5);
  std::unique_ptr<ShardExchange> b = StartExchange(1, hub->address());
  ASSERT_TRUE(a && b);
  const std::string wrong(sizeof kSecret - 1, 'w');
  auto refuse = [&](int connections) {
    for (int i = 0; i < connections; ++i) {
      const int fd = ConnectRaw(a->address());
      ASSERT_GE(fd, 0);
      ASSERT_TRUE(SendOpening(fd, wrong));
      ASSERT_TRUE(ClosedByPeer(fd, 10.0));
      close(fd);
    }
  };
  refuse(20);  // the C library's caches of stacks and arenas fill up first
  const int mappings = CountLines("maps");
  refuse(300);
  EXPECT_EQ(a->refused_connections(), 320);
  EXPECT_LT(CountLines("maps"), mappings + 50) << "the readers of refused connections are kept";

  // 50 connections that send nothing hold 50 readers, until the deadline.
  const int threads = RunningThreads();
  std::vector<int> silent;
  for (int i = 0; i < 50; ++i) silent.push_back(ConnectRaw(a->address()));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto seconds_left = [&] {
    return std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
  };
  int closed = 0;
  for (int fd : silent) {
    closed += ClosedByPeer(fd, seconds_left()) ? 1 : 0;
    close(fd);
  }
  EXPECT_EQ(closed, 50) << "silent connections are kept past the deadline";
  while (RunningThreads() > threads && seconds_left() > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_LE(RunningThreads(), threads) << "readers of silent connections still run";
  EXPECT_EQ(a->refused_connections(), 370);
  ASSERT_TRUE(b->Send(0, Key(7, ExchangeKind::kPooledKeys), "real").ok());
  EXPECT_EQ(a->Receive(1, Key(7, ExchangeKind::kPooledKeys)).value_or(""), "real");
}

TEST(ShardLayerTest, ThePayloadBoundHoldsKeysAndValuesOfAWholeDocument) {
  // 2 x 1000 tokens x 4 heads x 64 x 4 bytes, plus a token range.
  EXPECT_EQ(MaxShardPayloadBytes(1000, 4, 64), uint64_t{2} * 1000 * 4 * 64 * 4 + 8);
  EXPECT_EQ(MaxShardPayloadBytes(int64_t{1} << 62, 4096, 4096),
            std::numeric_limits<uint64_t>::max());
}

// One document of `length` tokens (the worker's synthetic inputs) split at `cuts` over ranks
// `group` (threads with real exchanges), each rank holding only its rows.
struct SplitRun {
  std::vector<absl::StatusOr<ShardLayerResult>> results;
};

SplitRun RunSplit(const DocumentTensors& doc, const std::vector<float>& dout, int heads,
                  int head_dim, const std::vector<int32_t>& cuts, double density,
                  const kernels::SelectionOptions& select, int running_ranks,
                  double timeout_seconds) {
  const int shards = static_cast<int>(cuts.size()) - 1;
  std::unique_ptr<StepSyncHub> hub = StartHub(shards);
  const int64_t stride = int64_t{heads} * head_dim;
  auto rows = [&](const std::vector<float>& x, int r) {
    return std::vector<float>(x.begin() + cuts[r] * stride, x.begin() + cuts[r + 1] * stride);
  };
  std::vector<int> group(shards);
  for (int r = 0; r < shards; ++r) group[r] = (r * 3 + 1) % shards;  // not 0..P-1 in order
  std::vector<std::future<absl::StatusOr<ShardLayerResult>>> futures;
  for (int j = 0; j < running_ranks; ++j) {
    futures.push_back(std::async(std::launch::async, [&, j]() -> absl::StatusOr<ShardLayerResult> {
      std::unique_ptr<ShardExchange> ex =
          StartExchange(group[j], hub->address(), timeout_seconds,
                        MaxShardPayloadBytes(cuts.back(), heads, head_dim));
      if (ex == nullptr) return absl::InternalError("no exchange");
      const std::vector<float> q = rows(doc.q, j), k = rows(doc.k, j), v = rows(doc.v, j),
                               d = rows(dout, j);
      ShardLayerInput in;
      in.key = Key(42, ExchangeKind::kPooledKeys, /*layer=*/2);
      in.group = group;
      in.shard_index = j;
      in.document_length = cuts.back();
      in.shard_begin = cuts[j];
      in.shard_end = cuts[j + 1];
      in.heads = heads;
      in.head_dim = head_dim;
      in.density = density;
      in.selection = select;
      in.q = q;
      in.k = k;
      in.v = v;
      in.dout = d;
      return RunShardLayer(*ex, in);
    }));
  }
  SplitRun run;
  for (auto& f : futures) run.results.push_back(f.get());
  return run;
}

double MaxAbs(const std::vector<float>& x, size_t begin, size_t end) {
  double m = 0.0;
  for (size_t i = begin; i < end; ++i) m = std::max(m, std::fabs(double{x[i]}));
  return m;
}

TEST(ShardLayerTest, ADocumentSplitOverFourRanksEqualsTheUnsplitDocument) {
  constexpr int kHeads = 2, kHeadDim = 64, kBlock = 64;
  constexpr int32_t kLength = 1984;  // 31 blocks, the last one full; uneven cuts below
  const std::vector<int32_t> cuts = {0, 768, 1280, 1664, kLength};
  const DocumentTensors doc = MakeDocument(/*id=*/901, kLength, kHeads, kHeadDim);
  std::vector<float> dout(doc.q.size());
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (float& x : dout) x = normal(rng);
  kernels::SelectionOptions select;
  select.block_size = kBlock;
  select.threads = 1;
  for (double density : {0.3, 1.0}) {
    SCOPED_TRACE(density);
    // Unsplit, on the whole document.
    absl::StatusOr<kernels::Selection> sel = kernels::SelectBlocks(
        std::vector<int32_t>{0, kLength}, kHeads, kHeadDim, doc.q, doc.k, {density}, select);
    ASSERT_TRUE(sel.ok()) << sel.status();
    const size_t n = doc.q.size();
    std::vector<float> out(n), lse(static_cast<size_t>(kLength) * kHeads), dq(n), dk(n), dv(n);
    kernels::AttentionOptions attention;
    ASSERT_TRUE(kernels::AttentionForward(sel->index, kHeadDim, doc.q, doc.k, doc.v, attention,
                                          absl::MakeSpan(out), absl::MakeSpan(lse))
                    .ok());
    ASSERT_TRUE(kernels::AttentionBackward(sel->index, kHeadDim, doc.q, doc.k, doc.v, out, lse,
                                           dout, attention, absl::MakeSpan(dq), absl::MakeSpan(dk),
                                           absl::MakeSpan(dv))
                    .ok());
    const SplitRun run = RunSplit(doc, dout, kHeads, kHeadDim, cuts, density, select, 4, 30);
    const int64_t stride = kHeads * kHeadDim;
    const double lse_scale = std::max(1.0, MaxAbs(lse, 0, lse.size()));
    int64_t active = 0, received = 0;
    for (int j = 0; j < 4; ++j) {
      ASSERT_TRUE(run.results[j].ok()) << "shard " << j << ": " << run.results[j].status();
      const ShardLayerResult& r = *run.results[j];
      active += r.selection.active_blocks();
      received += r.key_value_bytes_received;
      EXPECT_EQ(r.key_value_bytes_received > 0, j > 0) << "shard " << j;
      EXPECT_GT(r.exchange_seconds, 0.0);
      const size_t first = cuts[j] * stride, last = cuts[j + 1] * stride;
      for (auto [name, got, want] :
           {std::tuple<const char*, const std::vector<float>*, const std::vector<float>*>{
                "out", &r.out, &out},
            {"dq", &r.dq, &dq},
            {"dk", &r.dk, &dk},
            {"dv", &r.dv, &dv}}) {
        const double scale = MaxAbs(*want, 0, want->size());
        ASSERT_EQ(got->size(), last - first) << name;
        double diff = 0.0;
        for (size_t x = first; x < last; ++x) {
          diff = std::max(diff, std::fabs(double{(*got)[x - first]} - (*want)[x]));
        }
        EXPECT_LE(diff, kTolerance * scale) << name << " of shard " << j;
      }
      const int32_t tokens = cuts[j + 1] - cuts[j];
      double diff = 0.0;
      for (int h = 0; h < kHeads; ++h) {
        for (int32_t t = 0; t < tokens; ++t) {
          diff = std::max(
              diff, std::fabs(double{r.lse[h * tokens + t]} - lse[h * kLength + cuts[j] + t]));
        }
      }
      EXPECT_LE(diff, kTolerance * lse_scale) << "lse of shard " << j;
    }
    EXPECT_EQ(active, sel->index.active_blocks()) << "the shards keep the unsplit blocks";
    // Only the needed blocks travel: at density 0.3 less than every earlier chunk whole.
    int64_t prefix = 0;
    for (int j = 1; j < 4; ++j) prefix += int64_t{cuts[j]} * stride * 2 * 4;
    if (density < 1.0) {
      EXPECT_LT(received, prefix);
    } else {
      EXPECT_EQ(received, prefix);
    }
  }
}

TEST(ShardLayerTest, AShardWhosePeerNeverArrivesFailsNamingItInsteadOfHanging) {
  constexpr int kHeads = 1, kHeadDim = 64;
  const std::vector<int32_t> cuts = {0, 256, 512, 768, 1024};
  const DocumentTensors doc = MakeDocument(/*id=*/3, 1024, kHeads, kHeadDim);
  const std::vector<float> dout(doc.q.size(), 1e-3f);
  kernels::SelectionOptions select;
  select.threads = 1;
  const auto start = std::chrono::steady_clock::now();
  // Shards 0-2 run; shard 3's rank never starts.
  const SplitRun run = RunSplit(doc, dout, kHeads, kHeadDim, cuts, 0.5, select,
                                /*running_ranks=*/3, /*timeout_seconds=*/0.5);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 60.0) << "bounded by the timeouts, not hanging";
  const int missing = (3 * 3 + 1) % 4;  // group[3]
  for (int j = 0; j < 3; ++j) {
    ASSERT_FALSE(run.results[j].ok()) << "shard " << j;
    EXPECT_EQ(run.results[j].status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(run.results[j].status().message(), HasSubstr(absl::StrCat("rank ", missing)))
        << run.results[j].status();
    EXPECT_THAT(run.results[j].status().message(), HasSubstr("sample 42"));
  }
}

}  // namespace
}  // namespace sparsebalance
