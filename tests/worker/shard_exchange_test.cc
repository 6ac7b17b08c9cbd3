// The shard exchange over loopback with ranks as threads (addresses through a real step-sync
// hub), and RunShardLayer on it: a document split over 4 ranks gives the unsplit document's
// attention outputs and gradients, a shard whose peer never arrives fails with an error
// naming the peer instead of hanging, a local process without the run's secret gets nothing
// into Receive, nor holds more than a bounded number of idle connections, one writing frame
// headers no peer sends loses its connection while the exchange goes on, without leaving
// threads behind, and one that listens at a rank's address learns nothing of the secret and
// is refused by the sender.
//
// Tolerance (tests/kernels/shard_attention_test.cc establishes it): the sharded pass groups
// the same fp32 products by chunk and merges partials in double, so it differs from the
// unsplit pass by rounding only; |sharded - unsplit| <= 1e-5 x the largest unsplit magnitude
// (for lse, of max(1, max |lse|)).
#include "worker/shard_exchange.h"

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

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/attention_cpu.h"
#include "kernels/block_selection.h"
#include "tests/worker/raw_socket.h"
#include "tools/secret.h"
#include "worker/peer_auth.h"
#include "worker/shard_layer.h"
#include "worker/step_sync.h"
#include "worker/synthetic_inputs.h"

namespace sparsebalance {
namespace {

using test_support::ConnectRaw;
using test_support::RawListener;
using test_support::RecvExactly;
using test_support::SendRaw;
using test_support::ServeOnce;
using test_support::StillOpen;
using ::testing::HasSubstr;
using ::testing::Not;

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

// The opening's magic (worker/shard_exchange.h), and protocol 1's, which sent the secret itself.
constexpr uint32_t kAuthMagic = 0x32414253;     // "SBA2"
constexpr uint32_t kOldAuthMagic = 0x31414253;  // "SBA1"

std::string U32(uint32_t value) { return std::string(reinterpret_cast<const char*>(&value), 4); }

std::string Nonce() { return tools::RandomBytes(kAuthNonceBytes).value(); }

// The receiver's challenge nonce on `fd` (after "SBA2"), or "" when it sends none.
std::string ReadChallenge(int fd) {
  const std::optional<std::string> wire = RecvExactly(fd, 4 + kAuthNonceBytes);
  if (!wire || wire->substr(0, 4) != U32(kAuthMagic)) return "";
  return wire->substr(4);
}

// A proof of `secret` as `role` (an honest sender's: kExchangeSender) on the connection `fd`
// of a sender, for the receiver's `challenge` and the sender's `nonce`.
std::string Proof(int fd, const std::string& challenge, const std::string& nonce,
                  const std::string& secret = kSecret, AuthRole role = AuthRole::kExchangeSender) {
  return AuthProof(secret, role, challenge, nonce, ListenerEndpoint(fd, /*listening=*/false))
      .value();
}

// The sender's answer to a challenge as the wire carries it.
std::string Answer(const std::string& nonce, const std::string& proof,
                   uint32_t magic = kAuthMagic) {
  return U32(magic) + nonce + proof;
}

// What a sender that holds `secret` sends on a raw connection `fd`: reads the challenge and
// answers it; false when there is none or the answer cannot be sent.
bool SendOpening(int fd, const std::string& secret = kSecret) {
  const std::string challenge = ReadChallenge(fd);
  const std::string nonce = Nonce();
  return !challenge.empty() && SendRaw(fd, Answer(nonce, Proof(fd, challenge, nonce, secret)));
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
    ASSERT_TRUE(SendOpening(fd));  // even a holder of the secret
    ASSERT_TRUE(SendHeader(fd, header));
    EXPECT_TRUE(ClosedByPeer(fd, 10.0)) << "the exchange keeps a hostile connection open";
    close(fd);
    EXPECT_EQ(a->refused_connections(), ++refused);
  }
  // A header for a second frame that then never comes, still open while the peer talks.
  const int idle = ConnectRaw(a->address());
  ASSERT_GE(idle, 0);
  ASSERT_TRUE(SendOpening(idle));
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
  ASSERT_TRUE(SendOpening(fd));
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
// proves the run's secret, and one that does not (a wrong proof, one for another challenge or
// address, a proof of the other side or protocol, the secret itself as protocol 1 sent it, or
// nothing in time) is dropped and counted.
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
  auto send_frame = [&](int fd) {
    return SendHeader(fd, forged) && send(fd, "forged", 6, MSG_NOSIGNAL) == 6;
  };
  // An honest answer, recorded from an accepted connection of its own, to be replayed.
  std::string recorded;
  {
    const int fd = ConnectRaw(a->address());
    ASSERT_GE(fd, 0);
    const std::string challenge = ReadChallenge(fd);
    ASSERT_FALSE(challenge.empty());
    const std::string nonce = Nonce();
    recorded = Answer(nonce, Proof(fd, challenge, nonce));
    ASSERT_TRUE(SendRaw(fd, recorded));
    ASSERT_EQ(RecvExactly(fd, 1 + kAuthProofBytes).value_or("").substr(0, 1), "\x01");
    close(fd);
  }
  // An answer to the challenge on `fd`, given the challenge, then the forged frame.
  using Forge = std::function<std::string(int fd, const std::string& challenge)>;
  auto answer_then_frame = [&](Forge forge) {
    return [&, forge](int fd) {
      const std::string challenge = ReadChallenge(fd);
      return !challenge.empty() && SendRaw(fd, forge(fd, challenge)) && send_frame(fd);
    };
  };
  struct Hostile {
    const char* what;
    std::function<bool(int)> send;
  };
  const std::vector<Hostile> hostile = {
      {"a frame with no opening", send_frame},
      {"the secret itself, as protocol 1's opening sent it",
       [&](int fd) {
         return SendRaw(fd, U32(kOldAuthMagic) + U32(sizeof kSecret - 1) + secret) &&
                send_frame(fd);
       }},
      {"a wrong proof",
       answer_then_frame([](int, const std::string&) { return Answer(Nonce(), Nonce()); })},
      {"a proof under the secret but its last bit",
       answer_then_frame([&](int fd, const std::string& challenge) {
         const std::string nonce = Nonce();
         return Answer(nonce, Proof(fd, challenge, nonce, near_miss));
       })},
      {"a proof for another address (relayed from another port)",
       answer_then_frame([&](int, const std::string& challenge) {
         const std::string nonce = Nonce();
         return Answer(
             nonce,
             AuthProof(secret, AuthRole::kExchangeSender, challenge, nonce, "127.0.0.1:1").value());
       })},
      {"the receiver's proof reflected as the sender's",
       answer_then_frame([&](int fd, const std::string& challenge) {
         const std::string nonce = Nonce();
         return Answer(nonce, Proof(fd, challenge, nonce, secret, AuthRole::kExchangeReceiver));
       })},
      {"the hub client's proof, of the other protocol",
       answer_then_frame([&](int fd, const std::string& challenge) {
         const std::string nonce = Nonce();
         return Answer(nonce, Proof(fd, challenge, nonce, secret, AuthRole::kHubClient));
       })},
      {"an honest answer replayed from an earlier connection",
       answer_then_frame([&](int, const std::string&) { return recorded; })},
      {"the right proof under another magic",
       answer_then_frame([&](int fd, const std::string& challenge) {
         const std::string nonce = Nonce();
         return Answer(nonce, Proof(fd, challenge, nonce), /*magic=*/0x31584253);
       })},
      {"nothing at all", [](int) { return true; }},
      {"an answer cut short",
       [&](int fd) {
         const std::string challenge = ReadChallenge(fd);
         const std::string nonce = Nonce();
         return SendRaw(fd, Answer(nonce, Proof(fd, challenge, nonce)).substr(0, 13));
       }},
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

// A process that took over a rank's port (after the rank, or racing it), or listens at an
// address the hub still holds for it, received the secret from the first peer that sent to it
// (protocol 1's opening). Now it hears a nonce and a proof only, and a sender refuses a receiver
// that cannot prove the secret in turn (a wrong proof, the sender's own reflected, a real
// receiver's replayed from an earlier connection, or no challenge at all) with an error naming
// the rank and the address, before it sends a frame.
TEST(ShardExchangeTest, AListenerAtARanksAddressLearnsNoSecretAndIsRefused) {
  std::unique_ptr<StepSyncHub> hub = StartHub(2);
  ASSERT_NE(hub, nullptr);
  RawListener fake;
  ASSERT_TRUE(RegisterRankAddress(hub->address(), kSecret, 1, fake.address).ok());
  const std::string secret = kSecret;
  const std::string fake_nonce = Nonce();
  // A real receiver's proof, recorded from the honest fake's connection below.
  std::string recorded_proof;
  // What the fake answers with, given the sender's 68-byte answer (magic, nonce, proof).
  using Verdict = std::function<std::string(const std::string& answer)>;
  auto script = [&](const Verdict& verdict) {
    return [&, verdict](int fd, std::string* got) {
      if (!SendRaw(fd, U32(kAuthMagic) + fake_nonce)) return;
      const std::optional<std::string> answer =
          RecvExactly(fd, 4 + kAuthNonceBytes + kAuthProofBytes);
      if (!answer) return;
      *got += *answer;
      SendRaw(fd, verdict(*answer));
    };
  };
  auto send_to_fake = [&] {
    std::unique_ptr<ShardExchange> sender = StartExchange(0, hub->address(), /*timeout=*/1);
    if (sender == nullptr) return absl::InternalError("no exchange");
    return sender->Send(1, Key(7, ExchangeKind::kPooledKeys), "payload");
  };
  // A listener that sends no challenge (as a receiver of protocol 1 did not) hears nothing.
  std::future<std::string> silent = ServeOnce(fake, [](int, std::string*) {});
  absl::Status sent = send_to_fake();
  EXPECT_EQ(sent.code(), absl::StatusCode::kDeadlineExceeded) << sent;
  EXPECT_THAT(sent.message(), HasSubstr(absl::StrCat("rank 1 at ", fake.address)));
  EXPECT_EQ(silent.get(), "");

  // A fake that knows the secret (as rank 1 does): the sender accepts it and sends its frame,
  // which shows that the refusals below are for the proof alone.
  std::future<std::string> honest =
      ServeOnce(fake, script([&](const std::string& answer) {
                  recorded_proof = AuthProof(secret, AuthRole::kExchangeReceiver, fake_nonce,
                                             answer.substr(4, kAuthNonceBytes), fake.address)
                                       .value();
                  return "\x01" + recorded_proof;
                }));
  sent = send_to_fake();
  std::string got = honest.get();
  EXPECT_THAT(got, Not(HasSubstr(secret)));
  EXPECT_TRUE(sent.ok()) << sent;
  EXPECT_THAT(got, HasSubstr("payload"));
  ASSERT_FALSE(recorded_proof.empty());

  const std::vector<std::pair<const char*, Verdict>> forged = {
      {"a wrong proof", [](const std::string&) { return "\x01" + Nonce(); }},
      {"the sender's proof reflected",
       [](const std::string& answer) { return "\x01" + answer.substr(4 + kAuthNonceBytes); }},
      {"a real receiver's proof replayed from an earlier connection",
       [&](const std::string&) { return "\x01" + recorded_proof; }},
      {"an acceptance without a proof (protocol 1)",
       [](const std::string&) { return std::string("\x01"); }},
  };
  for (const auto& [what, verdict] : forged) {
    SCOPED_TRACE(what);
    std::future<std::string> fake_got = ServeOnce(fake, script(verdict));
    sent = send_to_fake();
    EXPECT_EQ(sent.code(), absl::StatusCode::kUnauthenticated) << sent;
    EXPECT_THAT(sent.message(),
                HasSubstr(absl::StrCat("what answers at ", fake.address, " for rank 1")));
    EXPECT_THAT(sent.message(), Not(HasSubstr(secret)));
    got = fake_got.get();
    EXPECT_EQ(got.size(), 4 + kAuthNonceBytes + kAuthProofBytes) << "a frame reached it";
    EXPECT_THAT(got, Not(HasSubstr(secret)));
  }
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
  // Each was counted; only the first few were written to stderr (RefusalLog).
  EXPECT_EQ(a->refusal_log().written(), RefusalLog::kDefaultBurst);
  EXPECT_EQ(a->refusal_log().unwritten(), 320 - RefusalLog::kDefaultBurst);

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

// Each connection that has not authenticated holds a reader thread until the auth timeout, and
// there was no bound on them: a local process could open thousands (threads, stacks). Now at
// most kMaxPendingAuthConnections wait; a newer one drops the oldest at once (refused and
// counted), so a flood holds a bounded number of readers, honest ranks (which authenticate
// within a round trip) still connect and exchange, and once the flood ends its readers are
// gone and joined.
TEST(ShardExchangeTest, IdleConnectionsBeyondTheCapAreDroppedAndRanksStillExchange) {
  std::unique_ptr<StepSyncHub> hub = StartHub(3);
  ASSERT_NE(hub, nullptr);
  // No deadline ends an idle connection during this test: only the cap does.
  std::unique_ptr<ShardExchange> a =
      StartExchange(0, hub->address(), 30, kMaxPayloadBytes, /*auth_timeout_seconds=*/60);
  std::unique_ptr<ShardExchange> b = StartExchange(1, hub->address());
  std::unique_ptr<ShardExchange> c = StartExchange(2, hub->address());
  ASSERT_TRUE(a && b && c);
  auto flood = [&](int connections) {
    std::vector<int> idle;
    for (int i = 0; i < connections; ++i) {
      const int fd = ConnectRaw(a->address());
      EXPECT_GE(fd, 0);
      if (fd < 0) break;
      EXPECT_FALSE(ReadChallenge(fd).empty()) << "connection " << i;  // admitted, in order
      idle.push_back(fd);
    }
    return idle;
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  auto wait_for_threads = [&](int most) {
    while (RunningThreads() > most && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return RunningThreads();
  };
  // A first flood, closed at once: the C library's caches of stacks and arenas fill up.
  const int threads = RunningThreads();
  for (int fd : flood(30)) close(fd);
  EXPECT_EQ(wait_for_threads(threads), threads);
  const int warm_up_refused = static_cast<int>(a->refused_connections());
  const int mappings = CountLines("maps");

  constexpr int kExtra = 20;
  const std::vector<int> idle = flood(kMaxPendingAuthConnections + kExtra);
  ASSERT_EQ(idle.size(), static_cast<size_t>(kMaxPendingAuthConnections + kExtra));
  // The first kExtra made room for the later ones, at once: their readers end.
  EXPECT_EQ(wait_for_threads(threads + kMaxPendingAuthConnections),
            threads + kMaxPendingAuthConnections)
      << "more readers than the cap wait to authenticate";
  int closed = 0;
  for (int i = 0; i < kExtra; ++i) {
    const double left =
        std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
    closed += ClosedByPeer(idle[i], std::max(left, 0.0)) ? 1 : 0;
  }
  EXPECT_EQ(closed, kExtra) << "idle connections beyond the cap are kept";
  EXPECT_EQ(a->refused_connections(), warm_up_refused + kExtra);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(StillOpen(std::vector<int>(idle.begin() + kExtra, idle.end())),
            kMaxPendingAuthConnections);

  // Honest ranks connect and exchange while the flood holds the cap, both ways (b's connection
  // finds the cap full and drops one more idle one; c's comes once b's has authenticated).
  ASSERT_TRUE(b->Send(0, Key(7, ExchangeKind::kPooledKeys), "from b").ok());
  ASSERT_TRUE(c->Send(0, Key(7, ExchangeKind::kPooledKeys), "from c").ok());
  ASSERT_TRUE(a->Send(1, Key(7, ExchangeKind::kKeyRequest), "to b").ok());
  EXPECT_EQ(a->Receive(1, Key(7, ExchangeKind::kPooledKeys)).value_or(""), "from b");
  EXPECT_EQ(a->Receive(2, Key(7, ExchangeKind::kPooledKeys)).value_or(""), "from c");
  EXPECT_EQ(b->Receive(0, Key(7, ExchangeKind::kKeyRequest)).value_or(""), "to b");
  EXPECT_EQ(a->refused_connections(), warm_up_refused + kExtra + 1);

  // The flood ends: its readers end (each refused as it closes), and the next connection joins
  // them; what stays is the readers of the three honest connections (b and c to a, a to b).
  for (int fd : idle) close(fd);
  EXPECT_EQ(wait_for_threads(threads + 3), threads + 3) << "readers of the flood still run";
  const int last = ConnectRaw(a->address());
  ASSERT_GE(last, 0);
  ASSERT_TRUE(SendOpening(last, "not-the-run's-secret-0123456789"));
  EXPECT_TRUE(ClosedByPeer(last, 10.0));
  close(last);
  EXPECT_LT(CountLines("maps"), mappings + 50) << "the readers of the flood are kept";
  EXPECT_EQ(a->refused_connections(), warm_up_refused + kExtra + kMaxPendingAuthConnections + 1);
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
