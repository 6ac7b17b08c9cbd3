// A gRPC caller written by hand over HTTP/2, for tests that play a hostile client: it opens calls
// with no token (or a given one) and sends their request's bytes as far as it likes (all but the
// last ones, then nothing), which grpc's own client never does. It follows the server's flow
// control and answers SETTINGS and PING as any peer must (so keepalive does not end it). No TLS,
// loopback only.
//
//   std::unique_ptr<RawGrpcConnection> c = RawGrpcConnection::Connect(port);
//   const uint32_t stream = c->StartCall("/sparsebalance.planner.v1.PlannerService/SubmitBatch",
//                                        /*message_bytes=*/64 << 20);
//   c->SendPayload(stream, (64 << 20) - 1, /*end_stream=*/false, /*timeout_seconds=*/5);
#ifndef SPARSEBALANCE_TESTS_SERVER_RAW_GRPC_CALLER_H_
#define SPARSEBALANCE_TESTS_SERVER_RAW_GRPC_CALLER_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace sparsebalance::test_support {

// A TCP connection to 127.0.0.1:`port`; -1 when it cannot connect.
inline int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

class RawGrpcConnection {
 public:
  // A connection to 127.0.0.1:`port` that has sent HTTP/2's preface and its SETTINGS; null when
  // it cannot connect.
  static std::unique_ptr<RawGrpcConnection> Connect(int port) {
    const int fd = ConnectLoopback(port);
    if (fd < 0) return nullptr;
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    std::unique_ptr<RawGrpcConnection> connection(new RawGrpcConnection(fd));
    std::string hello = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    hello += Frame(kSettings, 0, 0, "");
    if (!connection->Write(hello)) return nullptr;
    connection->reader_ = std::thread([c = connection.get()] { c->Read(); });
    return connection;
  }

  RawGrpcConnection(const RawGrpcConnection&) = delete;
  RawGrpcConnection& operator=(const RawGrpcConnection&) = delete;
  ~RawGrpcConnection() {
    shutdown(fd_, SHUT_RDWR);  // ends the reader's read()
    if (reader_.joinable()) reader_.join();
    close(fd_);
  }

  // Opens a call of `path` (e.g. "/sparsebalance.planner.v1.PlannerService/SubmitBatch") with no
  // authorization (or "authorization: Bearer <token>" when `token` is given) and sends the 5-byte
  // gRPC prefix of one uncompressed request message of `message_bytes` bytes; its stream id (0
  // when the write failed).
  uint32_t StartCall(const std::string& path, uint32_t message_bytes,
                     const std::string& token = "") {
    std::vector<std::pair<std::string, std::string>> headers = {
        {":method", "POST"},
        {":scheme", "http"},
        {":path", path},
        {":authority", "127.0.0.1"},
        {"content-type", "application/grpc"},
        {"te", "trailers"}};
    if (!token.empty()) headers.emplace_back("authorization", "Bearer " + token);
    std::string block;
    for (const auto& [name, value] : headers) {
      block.push_back('\0');  // HPACK: a literal field, never indexed, with a literal name
      AppendHpackString(name, &block);
      AppendHpackString(value, &block);
    }
    std::string prefix(5, '\0');
    for (int i = 0; i < 4; ++i) prefix[1 + i] = static_cast<char>(message_bytes >> (24 - 8 * i));
    uint32_t stream = 0;
    {
      // HTTP/2 needs a connection's new stream ids in increasing order: a server ignores a
      // HEADERS frame with a lower id than one it has seen.
      std::lock_guard<std::mutex> start_lock(start_mu_);
      {
        std::lock_guard<std::mutex> lock(mu_);
        stream = next_stream_;
        next_stream_ += 2;
        streams_[stream];
      }
      if (!Write(Frame(kHeaders, kEndHeaders, stream, block))) return 0;
    }
    return SendPayloadBytes(stream, prefix, /*end_stream=*/false, 5.0) == 5 ? stream : 0;
  }

  // Sends `bytes` more bytes of the message of `stream` (zeros), as the server's flow control
  // lets them, with END_STREAM on the last frame when `end_stream`. Returns the bytes sent: fewer
  // when the server's windows stayed shut for `timeout_seconds` or the stream or connection
  // ended meanwhile.
  size_t SendPayload(uint32_t stream, size_t bytes, bool end_stream, double timeout_seconds) {
    const std::string zeros(kFrameBytes, '\0');
    size_t sent = 0;
    while (sent < bytes) {
      const size_t chunk = std::min(bytes - sent, zeros.size());
      const size_t n = SendPayloadBytes(stream, zeros.substr(0, chunk),
                                        end_stream && sent + chunk == bytes, timeout_seconds);
      sent += n;
      if (n < chunk) break;
    }
    return sent;
  }

  // Whether the server has ended `stream` (trailers or RST_STREAM) or the connection.
  bool Ended(uint32_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_ || streams_[stream].ended;
  }
  // Whether the server sent GOAWAY or the connection closed.
  bool Closed() {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_ || goaway_;
  }

 private:
  static constexpr uint8_t kData = 0x0, kHeaders = 0x1, kRstStream = 0x3, kSettings = 0x4,
                           kPing = 0x6, kGoaway = 0x7, kWindowUpdate = 0x8;
  static constexpr uint8_t kEndStream = 0x1, kAck = 0x1, kEndHeaders = 0x4;
  static constexpr size_t kFrameBytes = 16384;  // HTTP/2's default SETTINGS_MAX_FRAME_SIZE

  struct Stream {
    int64_t window_delta = 0;  // WINDOW_UPDATEs received minus bytes sent
    bool ended = false;
  };

  explicit RawGrpcConnection(int fd) : fd_(fd) {}

  static std::string Frame(uint8_t type, uint8_t flags, uint32_t stream,
                           const std::string& payload) {
    std::string frame(9, '\0');
    const size_t n = payload.size();
    frame[0] = static_cast<char>(n >> 16);
    frame[1] = static_cast<char>(n >> 8);
    frame[2] = static_cast<char>(n);
    frame[3] = static_cast<char>(type);
    frame[4] = static_cast<char>(flags);
    for (int i = 0; i < 4; ++i) frame[5 + i] = static_cast<char>(stream >> (24 - 8 * i));
    return frame + payload;
  }

  // An HPACK string literal, not Huffman-coded: its length as a 7-bit-prefix integer, then it.
  static void AppendHpackString(const std::string& s, std::string* out) {
    size_t n = s.size();
    if (n < 127) {
      out->push_back(static_cast<char>(n));
    } else {
      out->push_back(static_cast<char>(127));
      for (n -= 127; n >= 128; n >>= 7) out->push_back(static_cast<char>((n & 127) | 128));
      out->push_back(static_cast<char>(n));
    }
    *out += s;
  }

  bool Write(const std::string& bytes) {
    std::lock_guard<std::mutex> lock(write_mu_);
    for (size_t done = 0; done < bytes.size();) {
      const ssize_t n = send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }

  // One DATA frame's worth at most (`data` no longer than kFrameBytes), split as the windows
  // allow; the bytes sent.
  size_t SendPayloadBytes(uint32_t stream, const std::string& data, bool end_stream,
                          double timeout_seconds) {
    size_t sent = 0;
    while (sent < data.size() || (end_stream && data.empty())) {
      size_t n = 0;
      {
        std::unique_lock<std::mutex> lock(mu_);
        auto open = [&] {
          return closed_ || goaway_ || streams_[stream].ended ||
                 (connection_window_ > 0 && initial_window_ + streams_[stream].window_delta > 0);
        };
        if (!changed_.wait_for(lock, std::chrono::duration<double>(timeout_seconds), open) ||
            closed_ || goaway_ || streams_[stream].ended) {
          return sent;
        }
        const int64_t window =
            std::min(connection_window_, initial_window_ + streams_[stream].window_delta);
        n = std::min<size_t>(data.size() - sent, static_cast<size_t>(window));
        connection_window_ -= static_cast<int64_t>(n);
        streams_[stream].window_delta -= static_cast<int64_t>(n);
      }
      const bool last = end_stream && sent + n == data.size();
      if (!Write(Frame(kData, last ? kEndStream : 0, stream, data.substr(sent, n)))) return sent;
      sent += n;
      if (data.empty()) break;
    }
    return sent;
  }

  bool ReadFully(char* out, size_t n) {
    for (size_t done = 0; done < n;) {
      const ssize_t got = read(fd_, out + done, n - done);
      if (got <= 0) return false;
      done += static_cast<size_t>(got);
    }
    return true;
  }

  static uint32_t Be32(const std::string& s, size_t at) {
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) v = (v << 8) | static_cast<uint8_t>(s[at + i]);
    return v;
  }

  // The reader thread: applies the server's SETTINGS and WINDOW_UPDATEs, acknowledges its
  // SETTINGS and PINGs, and notes streams and the connection ending.
  void Read() {
    while (true) {
      char header[9];
      if (!ReadFully(header, sizeof header)) break;
      const size_t length = (size_t{static_cast<uint8_t>(header[0])} << 16) |
                            (size_t{static_cast<uint8_t>(header[1])} << 8) |
                            static_cast<uint8_t>(header[2]);
      const uint8_t type = static_cast<uint8_t>(header[3]);
      const uint8_t flags = static_cast<uint8_t>(header[4]);
      const uint32_t stream = Be32(std::string(header + 5, 4), 0) & 0x7fffffffu;
      std::string payload(length, '\0');
      if (!ReadFully(payload.data(), length)) break;
      std::lock_guard<std::mutex> lock(mu_);
      if (type == kSettings && (flags & kAck) == 0) {
        for (size_t at = 0; at + 6 <= payload.size(); at += 6) {
          const uint16_t id = static_cast<uint16_t>((static_cast<uint8_t>(payload[at]) << 8) |
                                                    static_cast<uint8_t>(payload[at + 1]));
          if (id == 0x4) initial_window_ = Be32(payload, at + 2);  // SETTINGS_INITIAL_WINDOW_SIZE
        }
        Write(Frame(kSettings, kAck, 0, ""));
      } else if (type == kPing && (flags & kAck) == 0) {
        Write(Frame(kPing, kAck, 0, payload));
      } else if (type == kWindowUpdate && payload.size() == 4) {
        const int64_t increment = Be32(payload, 0) & 0x7fffffffu;
        if (stream == 0) {
          connection_window_ += increment;
        } else {
          streams_[stream].window_delta += increment;
        }
      } else if (type == kRstStream || (type == kHeaders && (flags & kEndStream) != 0)) {
        streams_[stream].ended = true;
      } else if (type == kGoaway) {
        goaway_ = true;
      }
      changed_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    changed_.notify_all();
  }

  const int fd_;
  std::mutex start_mu_;  // one new stream at a time (ids in order)
  std::mutex write_mu_;  // one frame at a time on the socket
  std::mutex mu_;
  std::condition_variable changed_;
  int64_t connection_window_ = 65535;  // HTTP/2's initial connection window
  int64_t initial_window_ = 65535;     // the server's SETTINGS_INITIAL_WINDOW_SIZE
  uint32_t next_stream_ = 1;
  std::map<uint32_t, Stream> streams_;
  bool goaway_ = false;
  bool closed_ = false;
  std::thread reader_;
};

}  // namespace sparsebalance::test_support

#endif  // SPARSEBALANCE_TESTS_SERVER_RAW_GRPC_CALLER_H_
