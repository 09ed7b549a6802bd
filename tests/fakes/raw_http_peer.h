#pragma once
/// A misbehaving HTTP peer for tests: a plain blocking TCP socket to 127.0.0.1 that sends exactly
/// the bytes given (malformed requests, partial headers, pipelined requests) and reads raw bytes
/// back. Every read gives up after `read_timeout`, so a test cannot hang on it.
/// Thread rules: one thread.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace pd::fakes {

class RawHttpPeer {
 public:
  explicit RawHttpPeer(std::uint16_t port, std::chrono::milliseconds read_timeout = std::chrono::seconds(5)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = fd_ >= 0 && ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(read_timeout.count() / 1000);
    tv.tv_usec = static_cast<suseconds_t>((read_timeout.count() % 1000) * 1000);
    if (fd_ >= 0) ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  RawHttpPeer(const RawHttpPeer&) = delete;
  RawHttpPeer& operator=(const RawHttpPeer&) = delete;
  RawHttpPeer(RawHttpPeer&&) = delete;
  RawHttpPeer& operator=(RawHttpPeer&&) = delete;
  ~RawHttpPeer() { close(); }

  [[nodiscard]] bool connected() const { return connected_; }

  /// Sends all of `bytes`; false if the connection refused them.
  bool send(std::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      bytes.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
  }

  /// Reads until the peer closes (or the read timeout); `closed` says whether it closed.
  std::string readAll(bool* closed = nullptr) {
    std::string out;
    bool eof = false;
    for (;;) {
      char buf[4096];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n == 0) {
        eof = true;
        break;
      }
      if (n < 0) {
        eof = errno == ECONNRESET;
        break;
      }
      out.append(buf, static_cast<std::size_t>(n));
    }
    if (closed != nullptr) *closed = eof;
    return out;
  }

  /// Reads until `marker` has been seen (or close / timeout); returns everything read.
  std::string readUntil(std::string_view marker) {
    std::string out;
    while (out.find(marker) == std::string::npos) {
      char buf[4096];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) break;
      out.append(buf, static_cast<std::size_t>(n));
    }
    return out;
  }

  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

}  // namespace pd::fakes
