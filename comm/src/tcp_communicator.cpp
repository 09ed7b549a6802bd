// The TCP Communicator (tcp_communicator.h): wire format, the rendezvous at rank 0, and the
// collectives as a gather to rank 0 followed by a scatter from it.
#include "pd/comm/tcp_communicator.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

#include "pd/common/log.h"

namespace pd::comm {
namespace {

using Clock = std::chrono::steady_clock;

// Integers and floats travel in host byte order; every supported host is little-endian.
static_assert(std::endian::native == std::endian::little);

constexpr std::uint32_t kMagic = 0x63746470;  // "pdtc" on the wire
constexpr std::uint32_t kProtocolVersion = 1;
constexpr int kMaxRanks = 1024;
constexpr auto kNoDeadline = Clock::time_point::max();
constexpr auto kJoinTick = std::chrono::milliseconds(10);        // while_joining cadence
constexpr auto kRetryInterval = std::chrono::milliseconds(150);  // between attempts to reach rank 0
constexpr auto kConnectAttempt = std::chrono::seconds(2);        // one connect() to one address
constexpr auto kHelloDeadline = std::chrono::seconds(10);        // a connection must say hello by then
constexpr std::size_t kMaxHelloBytes = 256;
constexpr std::size_t kMaxReasonBytes = 1024;
constexpr std::size_t kReduceChunk = std::size_t{1} << 16;  // floats received per step of a reduction
// A peer whose machine vanished is noticed after ~idle + interval * count = 5 s of silence.
constexpr int kKeepIdleS = 2;
constexpr int kKeepIntervalS = 1;
constexpr int kKeepCount = 3;

enum class Kind : std::uint32_t {
  Hello = 1,
  Accept = 2,
  Reject = 3,
  GroupComplete = 4,
  AllReduceSum = 5,
  AllGather = 6,
  Broadcast = 7,
  Barrier = 8,
};

std::string_view kindName(std::uint32_t kind) {
  switch (static_cast<Kind>(kind)) {
    case Kind::Hello:
      return "hello";
    case Kind::Accept:
      return "accept";
    case Kind::Reject:
      return "reject";
    case Kind::GroupComplete:
      return "group-complete";
    case Kind::AllReduceSum:
      return "allReduceSum";
    case Kind::AllGather:
      return "allGather";
    case Kind::Broadcast:
      return "broadcast";
    case Kind::Barrier:
      return "barrier";
  }
  return "unknown";
}

// Precedes every message; `bytes` of payload follow.
struct WireHeader {
  std::uint32_t magic;
  std::uint32_t kind;
  std::uint64_t seq;  // the collective's number (1, 2, ...), 0 during the rendezvous
  std::uint64_t bytes;
};
static_assert(sizeof(WireHeader) == 24 && std::has_unique_object_representations_v<WireHeader>);

// A follower's introduction; `version` comes first so that any version can be refused cleanly.
struct HelloBody {
  std::uint32_t version;
  std::uint32_t rank;
  std::uint32_t size;
  std::uint32_t reserved;
  std::uint64_t group_key;
};
static_assert(sizeof(HelloBody) == 24 && std::has_unique_object_representations_v<HelloBody>);

using HeaderBytes = std::array<std::byte, sizeof(WireHeader)>;

HeaderBytes encodeHeader(Kind kind, std::uint64_t seq, std::uint64_t bytes) {
  const WireHeader h{kMagic, static_cast<std::uint32_t>(kind), seq, bytes};
  HeaderBytes out;
  std::memcpy(out.data(), &h, sizeof(h));
  return out;
}

WireHeader decodeHeader(const HeaderBytes& raw) {
  WireHeader h;
  std::memcpy(&h, raw.data(), sizeof(h));
  return h;
}

// Header and payload as one buffer (rendezvous messages, which are small).
std::vector<std::byte> encodeMessage(Kind kind, std::span<const std::byte> payload) {
  const HeaderBytes head = encodeHeader(kind, 0, payload.size());
  std::vector<std::byte> out(head.size() + payload.size());
  std::memcpy(out.data(), head.data(), head.size());
  if (!payload.empty()) std::memcpy(out.data() + head.size(), payload.data(), payload.size());
  return out;
}

// Owns a socket descriptor. Shutting it down, not only closing it, reaches the peer even when a
// forked process still holds a copy of the descriptor.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Socket& operator=(Socket&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { reset(); }

  [[nodiscard]] int fd() const { return fd_; }
  [[nodiscard]] bool valid() const { return fd_ >= 0; }
  // Ends both directions (the peer reads EOF at once) but keeps the descriptor, so a concurrent
  // poll() in checkPeers() never sees it closed and reused.
  void shutdownBoth() const {
    if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
  }
  void reset() {
    if (fd_ < 0) return;
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

struct Endpoint {
  std::string host;
  int port = 0;
};

// "host:port" or "[v6addr]:port".
Result<Endpoint> parseAddress(std::string_view address) {
  const auto bad = [&](std::string_view why) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("tcp communicator: address '{}': {}", address, why));
  };
  std::string_view host;
  std::string_view port;
  if (address.starts_with('[')) {
    const std::size_t close = address.find(']');
    if (close == std::string_view::npos || close + 1 >= address.size() || address[close + 1] != ':') {
      return bad("expected [v6addr]:port");
    }
    host = address.substr(1, close - 1);
    port = address.substr(close + 2);
  } else {
    const std::size_t colon = address.rfind(':');
    if (colon == std::string_view::npos) return bad("expected host:port");
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
    if (host.find(':') != std::string_view::npos) return bad("an IPv6 address needs brackets: [v6addr]:port");
  }
  if (host.empty()) return bad("empty host");
  int value = -1;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc{} || end != port.data() + port.size() || value < 0 || value > 65535) {
    return bad("the port must be a number 0..65535");
  }
  return Endpoint{std::string(host), value};
}

// Milliseconds until `until` for poll(), rounded up; -1 for no deadline.
int pollTimeoutMs(Clock::time_point until) {
  if (until == kNoDeadline) return -1;
  const auto left = until - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<std::int64_t>(ms, INT_MAX));
}

Clock::time_point deadlineAfter(std::chrono::milliseconds timeout) {
  return Clock::now() + timeout;
}

std::string socketAddressText(const sockaddr_storage& addr) {
  char text[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
    return fmt::format("{}:{}", text, ntohs(in->sin_port));
  }
  if (addr.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {  // an IPv4 peer of the dual-stack listener
      inet_ntop(AF_INET, &in6->sin6_addr.s6_addr[12], text, sizeof(text));
      return fmt::format("{}:{}", text, ntohs(in6->sin6_port));
    }
    inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text));
    return fmt::format("[{}]:{}", text, ntohs(in6->sin6_port));
  }
  return "?";
}

// No delay for small messages; keep-alive so that a vanished machine is noticed while idle.
Status tuneConnection(int fd) {
  const int one = 1;
  const std::array<std::array<int, 3>, 5> options{{
      {IPPROTO_TCP, TCP_NODELAY, one},
      {SOL_SOCKET, SO_KEEPALIVE, one},
      {IPPROTO_TCP, TCP_KEEPIDLE, kKeepIdleS},
      {IPPROTO_TCP, TCP_KEEPINTVL, kKeepIntervalS},
      {IPPROTO_TCP, TCP_KEEPCNT, kKeepCount},
  }};
  for (const auto& [level, name, value] : options) {
    if (setsockopt(fd, level, name, &value, sizeof(value)) != 0) {
      return makeError(ErrorCode::Io, fmt::format("setsockopt({}, {}): {}", level, name, std::strerror(errno)));
    }
  }
  return okStatus();
}

Result<Socket> listenOnFamily(int family, int port) {
  Socket s(socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!s.valid()) return makeError(ErrorCode::Io, fmt::format("socket(): {}", std::strerror(errno)));
  const int one = 1;
  const int zero = 0;
  if (setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) {
    return makeError(ErrorCode::Io, fmt::format("setsockopt(SO_REUSEADDR): {}", std::strerror(errno)));
  }
  sockaddr_storage addr{};
  socklen_t len = 0;
  if (family == AF_INET6) {
    // Dual stack: IPv4 peers arrive as v4-mapped addresses.
    if (setsockopt(s.fd(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero)) != 0) {
      return makeError(ErrorCode::Io, fmt::format("setsockopt(IPV6_V6ONLY): {}", std::strerror(errno)));
    }
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&addr);
    in6->sin6_family = AF_INET6;
    in6->sin6_addr = in6addr_any;
    in6->sin6_port = htons(static_cast<std::uint16_t>(port));
    len = sizeof(sockaddr_in6);
  } else {
    auto* in = reinterpret_cast<sockaddr_in*>(&addr);
    in->sin_family = AF_INET;
    in->sin_addr.s_addr = htonl(INADDR_ANY);
    in->sin_port = htons(static_cast<std::uint16_t>(port));
    len = sizeof(sockaddr_in);
  }
  if (bind(s.fd(), reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
    return makeError(ErrorCode::Io, fmt::format("bind(port {}): {}", port, std::strerror(errno)));
  }
  if (listen(s.fd(), SOMAXCONN) != 0) {
    return makeError(ErrorCode::Io, fmt::format("listen(port {}): {}", port, std::strerror(errno)));
  }
  return s;
}

// Listens on `port` of every interface: dual-stack IPv6, or IPv4 where the host has no IPv6.
Result<Socket> listenOn(int port) {
  auto v6 = listenOnFamily(AF_INET6, port);
  if (v6.ok()) return v6;
  auto v4 = listenOnFamily(AF_INET, port);
  if (v4.ok()) return v4;
  return makeError(ErrorCode::Io, fmt::format("tcp communicator: cannot listen: {} (IPv6); {} (IPv4)",
                                              v6.error().message, v4.error().message));
}

Result<int> boundPort(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return makeError(ErrorCode::Io, fmt::format("getsockname(): {}", std::strerror(errno)));
  }
  if (addr.ss_family == AF_INET6) return static_cast<int>(ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port));
  return static_cast<int>(ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port));
}

// A connection accepted by rank 0 that has not finished its hello yet.
struct PendingHello {
  Socket socket;
  std::vector<std::byte> received;
  std::size_t expected = sizeof(WireHeader);  // grows to header + body once the header is in
  Clock::time_point since;
  std::string from;
};

// How one attempt to reach rank 0 ended: a socket accepted into the group, or why not (worth
// another attempt).
struct JoinAttempt {
  Socket socket;
  std::string failure;
};

class TcpCommunicator final : public Communicator {
 public:
  TcpCommunicator(const TcpOptions& options, std::string leader_address)
      : rank_(options.rank),
        size_(options.size),
        group_key_(options.group_key),
        timeout_(options.timeout),
        leader_address_(std::move(leader_address)),
        while_joining_(options.while_joining),
        links_(static_cast<std::size_t>(options.size)) {}

  TcpCommunicator(const TcpCommunicator&) = delete;
  TcpCommunicator& operator=(const TcpCommunicator&) = delete;
  TcpCommunicator(TcpCommunicator&&) = delete;
  TcpCommunicator& operator=(TcpCommunicator&&) = delete;
  ~TcpCommunicator() override = default;

  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] int size() const override { return size_; }
  [[nodiscard]] std::string kind() const override { return "tcp"; }

  // Rank 0: accepts hellos until every rank is connected, then tells each that the group is complete.
  Status lead(Socket listener, Clock::time_point until) {
    std::vector<PendingHello> pending;
    int joined = 0;
    while (joined < size_ - 1) {
      if (Clock::now() >= until) return joinTimeout(joined);
      if (while_joining_) PD_TRY(while_joining_());
      std::vector<pollfd> fds;
      fds.push_back({listener.fd(), POLLIN, 0});
      for (const PendingHello& p : pending) fds.push_back({p.socket.fd(), POLLIN, 0});
      for (int r = 1; r < size_; ++r) {
        if (link(r).valid()) fds.push_back({link(r).fd(), POLLIN | POLLRDHUP, 0});
      }
      const int timeout_ms = pollTimeoutMs(std::min(until, Clock::now() + kJoinTick));
      if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
        if (errno == EINTR) continue;
        return makeError(ErrorCode::Io, fmt::format("tcp group: poll(): {}", std::strerror(errno)));
      }
      // A joined rank sends nothing before the group is complete: readiness means it left.
      std::size_t next = 1 + pending.size();
      for (int r = 1; r < size_; ++r) {
        if (!link(r).valid()) continue;
        if (fds[next++].revents != 0) {
          return makeError(ErrorCode::PeerFailed,
                           fmt::format("tcp group: rank {} left before the group was complete", r));
        }
      }
      for (std::size_t i = 0; i < pending.size(); ++i) {
        if (fds[1 + i].revents != 0) joined += readHello(pending[i]) ? 1 : 0;
      }
      const auto now = Clock::now();
      std::erase_if(pending, [&](const PendingHello& p) {
        if (p.socket.valid() && now - p.since > kHelloDeadline) {
          log::warn("comm", "tcp group: dropped a connection from {} that sent no hello", p.from);
          return true;
        }
        return !p.socket.valid();
      });
      if (fds[0].revents != 0) acceptConnections(listener.fd(), pending);
    }
    listener.reset();  // the group is closed to newcomers
    for (int r = 1; r < size_; ++r) {
      PD_TRY(sendMessage(r, Kind::GroupComplete, {}, deadlineAfter(timeout_)));
    }
    while_joining_ = nullptr;
    log::info("comm", "tcp group: all {} ranks joined", size_);
    return okStatus();
  }

  // Ranks 1..: connects to rank 0 (retrying until `until`), says hello and waits for the group.
  Status follow(const Endpoint& leader, Clock::time_point until) {
    std::string last_failure = "no attempt finished";
    while (!link(0).valid()) {
      if (Clock::now() >= until) {
        return makeError(ErrorCode::Timeout, fmt::format("tcp group: rank {} could not join rank 0 at {} within the "
                                                         "join timeout: {}",
                                                         rank_, leader_address_, last_failure));
      }
      if (while_joining_) PD_TRY(while_joining_());
      PD_ASSIGN_OR_RETURN(JoinAttempt attempt, attemptJoin(leader, until));
      if (attempt.socket.valid()) {
        link(0) = std::move(attempt.socket);
        break;
      }
      last_failure = std::move(attempt.failure);
      const auto retry_at = std::min(until, Clock::now() + kRetryInterval);
      while (Clock::now() < retry_at) {
        if (while_joining_) PD_TRY(while_joining_());
        std::this_thread::sleep_for(std::min<Clock::duration>(kJoinTick, retry_at - Clock::now()));
      }
    }
    HeaderBytes raw;
    PD_ASSIGN_OR_RETURN(std::string broken, recvWhileJoining(link(0).fd(), raw, until));
    if (!broken.empty()) {
      return makeError(
          ErrorCode::PeerFailed,
          fmt::format("tcp group: rank 0 at {} failed before the group was complete: {}", leader_address_, broken));
    }
    const WireHeader h = decodeHeader(raw);
    if (h.magic != kMagic || h.kind != static_cast<std::uint32_t>(Kind::GroupComplete) || h.bytes != 0) {
      return makeError(ErrorCode::Corrupt, fmt::format("tcp group: rank 0 at {} sent {} instead of group-complete",
                                                       leader_address_, kindName(h.kind)));
    }
    while_joining_ = nullptr;
    return okStatus();
  }

  Status allReduceSum(std::span<float> data) override {
    return collective("allReduceSum", [&]() -> Status {
      if (size_ == 1) return okStatus();
      const auto bytes = std::as_writable_bytes(data);
      const auto until = deadlineAfter(timeout_);
      if (rank_ != 0) return exchangeWithLeader(Kind::AllReduceSum, bytes, bytes, until);
      // data already holds rank 0's values; adding ranks 1.. in order is the rank-order sum.
      for (int r = 1; r < size_; ++r) {
        PD_TRY(recvHeader(r, Kind::AllReduceSum, bytes.size(), until, true));
        PD_TRY(recvAndAdd(r, data, until));
      }
      return sendToFollowers(Kind::AllReduceSum, bytes, -1, until);
    });
  }

  Status allGather(std::span<const std::byte> send, std::span<std::byte> recv) override {
    return collective("allGather", [&]() -> Status {
      if (recv.size() != send.size() * static_cast<std::size_t>(size_)) {
        return makeError(ErrorCode::InvalidArgument, "tcp group: allGather: recv must be size() times send");
      }
      if (size_ == 1) {
        if (!send.empty()) std::memmove(recv.data(), send.data(), send.size());
        return okStatus();
      }
      const auto until = deadlineAfter(timeout_);
      if (rank_ != 0) return exchangeWithLeader(Kind::AllGather, send, recv, until);
      if (!send.empty()) std::memmove(recv.data(), send.data(), send.size());
      for (int r = 1; r < size_; ++r) {
        PD_TRY(recvHeader(r, Kind::AllGather, send.size(), until, true));
        PD_TRY(recvExact(r, recv.subspan(static_cast<std::size_t>(r) * send.size(), send.size()), until, true));
      }
      return sendToFollowers(Kind::AllGather, recv, -1, until);
    });
  }

  Status broadcast(std::span<std::byte> data, int root) override {
    return collective("broadcast", [&] { return doBroadcast(data, root, true); });
  }

  Status checkPeers() override {
    {
      std::lock_guard lock(watch_mu_);
      if (watched_error_) return *watched_error_;
    }
    std::vector<pollfd> fds;
    std::vector<int> ranks;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ || (rank_ != 0 && r != 0) || !link(r).valid()) continue;
      fds.push_back({link(r).fd(), POLLRDHUP, 0});
      ranks.push_back(r);
    }
    if (fds.empty()) return okStatus();
    while (poll(fds.data(), fds.size(), 0) < 0) {
      if (errno != EINTR) return makeError(ErrorCode::Io, fmt::format("tcp group: poll(): {}", std::strerror(errno)));
    }
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0) {
        return makeError(ErrorCode::PeerFailed, fmt::format("tcp group, rank {} of {}: rank {} closed the connection",
                                                            rank_, size_, ranks[i]));
      }
    }
    return okStatus();
  }

  Status broadcastUnbounded(std::span<std::byte> data, int root) override {
    return collective("broadcastUnbounded", [&] { return doBroadcast(data, root, false); });
  }

  Status barrier() override {
    return collective("barrier", [&]() -> Status {
      if (size_ == 1) return okStatus();
      const auto until = deadlineAfter(timeout_);
      if (rank_ != 0) return exchangeWithLeader(Kind::Barrier, {}, {}, until);
      for (int r = 1; r < size_; ++r) PD_TRY(recvHeader(r, Kind::Barrier, 0, until, true));
      return sendToFollowers(Kind::Barrier, {}, -1, until);
    });
  }

 private:
  Socket& link(int r) { return links_[static_cast<std::size_t>(r)]; }

  // Runs one collective: numbers it, and turns its failure into a broken group.
  template <class Op>
  Status collective(std::string_view name, Op&& op) {
    if (broken_) return *broken_;
    op_ = name;
    ++seq_;
    Status s = rank_ == 0 && size_ > 1 ? checkFollowersConnected() : okStatus();
    if (s.ok()) s = std::forward<Op>(op)();
    if (!s.ok()) breakGroup(s.error());
    return s;
  }

  // Shuts every connection down, so each peer fails at once instead of waiting for a deadline
  // (the descriptors are closed by the destructor: checkPeers() may be polling them).
  void breakGroup(const Error& error) {
    log::warn("comm", "tcp group: rank {} leaves the group: {}", rank_, error.toString());
    broken_ = error;
    {
      std::lock_guard lock(watch_mu_);
      watched_error_ = error;
    }
    for (const Socket& s : links_) s.shutdownBoth();
  }

  std::string where() const { return fmt::format("tcp group, rank {} of {}: {} #{}", rank_, size_, op_, seq_); }

  Error peerClosed(int peer) const {
    return makeError(ErrorCode::PeerFailed, fmt::format("{}: rank {} closed the connection", where(), peer));
  }
  Error peerError(int peer, int err) const {
    return makeError(ErrorCode::PeerFailed,
                     fmt::format("{}: connection to rank {} failed: {}", where(), peer, std::strerror(err)));
  }

  // Rank 0, before a collective: a follower that hung up since the last one fails it at once.
  Status checkFollowersConnected() {
    std::vector<pollfd> fds;
    for (int r = 1; r < size_; ++r) fds.push_back({link(r).fd(), POLLRDHUP, 0});
    while (poll(fds.data(), fds.size(), 0) < 0) {
      if (errno != EINTR) return makeError(ErrorCode::Io, fmt::format("{}: poll(): {}", where(), std::strerror(errno)));
    }
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) return peerClosed(static_cast<int>(i) + 1);
    }
    return okStatus();
  }

  // Waits until `fd` is ready for `events` (or has an error or hang-up to report): true, or false
  // once `until` passed. While joining it calls while_joining every tick. With watch_followers
  // (rank 0 gathering, when no follower may leave) a hang-up of another follower fails at once.
  Result<bool> pollReady(int fd, short events, Clock::time_point until, bool watch_followers) {
    std::vector<pollfd> fds{{fd, events, 0}};
    if (watch_followers) {
      for (int r = 1; r < size_; ++r) {
        if (link(r).fd() != fd) fds.push_back({link(r).fd(), POLLRDHUP, 0});
      }
    }
    while (true) {
      const auto now = Clock::now();
      if (now >= until) return false;
      auto slice_end = until;
      if (while_joining_) {
        PD_TRY(while_joining_());
        slice_end = std::min(until, now + kJoinTick);
      }
      if (poll(fds.data(), fds.size(), pollTimeoutMs(slice_end)) < 0) {
        if (errno == EINTR) continue;
        return makeError(ErrorCode::Io, fmt::format("{}: poll(): {}", where(), std::strerror(errno)));
      }
      if (fds[0].revents != 0) return true;
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        for (int r = 1; r < size_; ++r) {
          if (link(r).fd() == fds[i].fd) return peerClosed(r);
        }
      }
    }
  }

  Status waitFor(int peer, short events, Clock::time_point until, bool watch_followers) {
    PD_ASSIGN_OR_RETURN(const bool ready, pollReady(link(peer).fd(), events, until, watch_followers));
    if (ready) return okStatus();
    return makeError(ErrorCode::Timeout, fmt::format("{}: rank {} did not {} within the {} ms deadline", where(), peer,
                                                     events == POLLIN ? "send" : "receive", timeout_.count()));
  }

  Status recvExact(int peer, std::span<std::byte> out, Clock::time_point until, bool watch_followers) {
    const int fd = link(peer).fd();
    std::size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = recv(fd, out.data() + done, out.size() - done, 0);
      if (n > 0) {
        done += static_cast<std::size_t>(n);
      } else if (n == 0) {
        return peerClosed(peer);
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        PD_TRY(waitFor(peer, POLLIN, until, watch_followers));
      } else if (errno != EINTR) {
        return peerError(peer, errno);
      }
    }
    return okStatus();
  }

  // Sends the header and the payload in as few system calls as the socket buffer allows.
  Status sendMessage(int peer, Kind kind, std::span<const std::byte> payload, Clock::time_point until) {
    const HeaderBytes head = encodeHeader(kind, seq_, payload.size());
    const int fd = link(peer).fd();
    const std::size_t total = head.size() + payload.size();
    std::size_t done = 0;
    while (done < total) {
      std::array<iovec, 2> iov{};
      std::size_t count = 0;
      if (done < head.size()) {
        iov[count++] = {const_cast<std::byte*>(head.data() + done), head.size() - done};
        if (!payload.empty()) iov[count++] = {const_cast<std::byte*>(payload.data()), payload.size()};
      } else {
        iov[count++] = {const_cast<std::byte*>(payload.data() + (done - head.size())), total - done};
      }
      msghdr msg{};
      msg.msg_iov = iov.data();
      msg.msg_iovlen = count;
      const ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
      if (n >= 0) {
        done += static_cast<std::size_t>(n);
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        PD_TRY(waitFor(peer, POLLOUT, until, false));
      } else if (errno != EINTR) {
        return peerError(peer, errno);
      }
    }
    return okStatus();
  }

  // Reads a header from `peer` and checks it is this collective's, with `bytes` of payload.
  Status recvHeader(int peer, Kind kind, std::uint64_t bytes, Clock::time_point until, bool watch_followers) {
    HeaderBytes raw;
    PD_TRY(recvExact(peer, raw, until, watch_followers));
    const WireHeader h = decodeHeader(raw);
    if (h.magic != kMagic) {
      return makeError(ErrorCode::Corrupt, fmt::format("{}: rank {} sent a message with magic {:#x}, not {:#x}",
                                                       where(), peer, h.magic, kMagic));
    }
    if (h.kind != static_cast<std::uint32_t>(kind) || h.seq != seq_ || h.bytes != bytes) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("{}: rank {} is in {} #{} with {} bytes, this rank in {} #{} with {} bytes (every "
                                   "rank must call the same collectives in the same order with the same sizes)",
                                   where(), peer, kindName(h.kind), h.seq, h.bytes,
                                   kindName(static_cast<std::uint32_t>(kind)), seq_, bytes));
    }
    return okStatus();
  }

  // Rank 0: adds rank `peer`'s floats into `data`, a chunk at a time.
  Status recvAndAdd(int peer, std::span<float> data, Clock::time_point until) {
    scratch_.resize(std::min(data.size(), kReduceChunk));
    for (std::size_t off = 0; off < data.size(); off += kReduceChunk) {
      const std::size_t n = std::min(kReduceChunk, data.size() - off);
      PD_TRY(recvExact(peer, std::as_writable_bytes(std::span(scratch_).first(n)), until, true));
      float* dst = data.data() + off;
      for (std::size_t i = 0; i < n; ++i) dst[i] += scratch_[i];
    }
    return okStatus();
  }

  // A follower's side of a gather-and-scatter collective: send this rank's part, get the result.
  Status exchangeWithLeader(Kind kind, std::span<const std::byte> send, std::span<std::byte> recv,
                            Clock::time_point until) {
    PD_TRY(sendMessage(0, kind, send, until));
    PD_TRY(recvHeader(0, kind, recv.size(), until, false));
    return recvExact(0, recv, until, false);
  }

  Status sendToFollowers(Kind kind, std::span<const std::byte> payload, int except, Clock::time_point until) {
    for (int r = 1; r < size_; ++r) {
      if (r != except) PD_TRY(sendMessage(r, kind, payload, until));
    }
    return okStatus();
  }

  // A root other than 0 sends to rank 0, which forwards to the others. Without `bounded` the
  // wait for the first byte has no deadline; the rest of the message follows at once.
  Status doBroadcast(std::span<std::byte> data, int root, bool bounded) {
    if (root < 0 || root >= size_) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("tcp group: broadcast root {} outside 0..{}", root, size_ - 1));
    }
    if (size_ == 1) return okStatus();
    if (rank_ == root) {
      const auto until = deadlineAfter(timeout_);
      return rank_ == 0 ? sendToFollowers(Kind::Broadcast, data, -1, until)
                        : sendMessage(0, Kind::Broadcast, data, until);
    }
    const int source = rank_ == 0 ? root : 0;
    PD_TRY(
        recvHeader(source, Kind::Broadcast, data.size(), bounded ? deadlineAfter(timeout_) : kNoDeadline, rank_ == 0));
    const auto until = deadlineAfter(timeout_);
    PD_TRY(recvExact(source, data, until, rank_ == 0));
    return rank_ == 0 ? sendToFollowers(Kind::Broadcast, data, root, until) : okStatus();
  }

  Status joinTimeout(int joined) const {
    std::string missing;
    for (int r = 1; r < size_; ++r) {
      if (!links_[static_cast<std::size_t>(r)].valid()) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
    }
    return makeError(ErrorCode::Timeout, fmt::format("tcp group: only {} of {} ranks joined rank 0 within the join "
                                                     "timeout; missing ranks: {}",
                                                     joined + 1, size_, missing));
  }

  // Rank 0: takes every connection waiting in the listen queue.
  static void acceptConnections(int listener, std::vector<PendingHello>& pending) {
    while (true) {
      sockaddr_storage addr{};
      socklen_t len = sizeof(addr);
      const int fd = accept4(listener, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) log::warn("comm", "tcp group: accept(): {}", std::strerror(errno));
        return;
      }
      Socket s(fd);
      if (Status tuned = tuneConnection(fd); !tuned.ok()) {
        log::warn("comm", "tcp group: dropped a connection: {}", tuned.error().toString());
        continue;
      }
      pending.push_back(PendingHello{std::move(s), {}, sizeof(WireHeader), Clock::now(), socketAddressText(addr)});
    }
  }

  // Rank 0: reads what arrived of a hello and, once it is whole, accepts or refuses the rank.
  // True when the rank joined; a connection that is done with (refused, malformed) is reset.
  bool readHello(PendingHello& p) {
    while (p.received.size() < p.expected) {
      std::array<std::byte, kMaxHelloBytes> buf;
      const ssize_t n = recv(p.socket.fd(), buf.data(), p.expected - p.received.size(), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
      if (n <= 0) {
        p.socket.reset();
        return false;
      }
      p.received.insert(p.received.end(), buf.begin(), buf.begin() + n);
      if (p.received.size() == sizeof(WireHeader) && p.expected == sizeof(WireHeader)) {
        HeaderBytes raw;
        std::copy_n(p.received.begin(), raw.size(), raw.begin());
        const WireHeader h = decodeHeader(raw);
        if (h.magic != kMagic || h.kind != static_cast<std::uint32_t>(Kind::Hello) || h.bytes < sizeof(std::uint32_t) ||
            h.bytes > kMaxHelloBytes - sizeof(WireHeader)) {
          log::warn("comm", "tcp group: dropped a connection from {} that did not say a pdserve hello", p.from);
          p.socket.reset();
          return false;
        }
        p.expected = sizeof(WireHeader) + h.bytes;
      }
    }
    const std::string refusal = checkHello(std::span(p.received).subspan(sizeof(WireHeader)));
    if (!refusal.empty()) {
      log::warn("comm", "tcp group: refused {}: {}", p.from, refusal);
      const auto reply = encodeMessage(Kind::Reject, std::as_bytes(std::span(refusal)));
      (void)send(p.socket.fd(), reply.data(), reply.size(), MSG_NOSIGNAL);
      p.socket.reset();
      return false;
    }
    HelloBody hello;
    std::memcpy(&hello, p.received.data() + sizeof(WireHeader), sizeof(hello));
    const auto reply = encodeMessage(Kind::Accept, {});
    if (send(p.socket.fd(), reply.data(), reply.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(reply.size())) {
      log::warn("comm", "tcp group: rank {} from {} left while joining", hello.rank, p.from);
      p.socket.reset();
      return false;
    }
    log::info("comm", "tcp group: rank {} joined from {}", hello.rank, p.from);
    link(static_cast<int>(hello.rank)) = std::move(p.socket);
    return true;
  }

  // Why a hello body is refused, or empty when the rank may join.
  std::string checkHello(std::span<const std::byte> body) {
    std::uint32_t version = 0;
    std::memcpy(&version, body.data(), sizeof(version));
    if (version != kProtocolVersion) {
      return fmt::format("protocol version {}, rank 0 speaks {}", version, kProtocolVersion);
    }
    if (body.size() != sizeof(HelloBody)) return fmt::format("malformed hello of {} bytes", body.size());
    HelloBody hello;
    std::memcpy(&hello, body.data(), sizeof(hello));
    if (hello.size != static_cast<std::uint32_t>(size_)) {
      return fmt::format("the rank expects a group of {} ranks, rank 0 has {}", hello.size, size_);
    }
    if (hello.group_key != group_key_) {
      return fmt::format("group key {:#x} differs from rank 0's {:#x} (another model or group?)", hello.group_key,
                         group_key_);
    }
    if (hello.rank < 1 || hello.rank >= static_cast<std::uint32_t>(size_)) {
      return fmt::format("rank {} is outside 1..{}", hello.rank, size_ - 1);
    }
    if (link(static_cast<int>(hello.rank)).valid()) return fmt::format("rank {} is already connected", hello.rank);
    return {};
  }

  // One try at rank 0: resolve, connect, hello, answer. Errors are final (refused, deadline,
  // while_joining); an unreachable or vanishing rank 0 is a failure worth retrying.
  Result<JoinAttempt> attemptJoin(const Endpoint& leader, Clock::time_point until) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* list = nullptr;
    const std::string port = std::to_string(leader.port);
    if (const int rc = getaddrinfo(leader.host.c_str(), port.c_str(), &hints, &list); rc != 0) {
      return JoinAttempt{{}, fmt::format("cannot resolve '{}': {}", leader.host, gai_strerror(rc))};
    }
    const std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owner(list, &freeaddrinfo);
    std::string failure = "no address";
    for (const addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
      PD_ASSIGN_OR_RETURN(JoinAttempt attempt, connectTo(*ai, until));
      if (!attempt.socket.valid()) {
        failure = std::move(attempt.failure);
        continue;
      }
      return handshake(std::move(attempt.socket), until);
    }
    return JoinAttempt{{}, std::move(failure)};
  }

  Result<JoinAttempt> connectTo(const addrinfo& ai, Clock::time_point until) {
    Socket s(socket(ai.ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!s.valid()) return JoinAttempt{{}, fmt::format("socket(): {}", std::strerror(errno))};
    if (connect(s.fd(), ai.ai_addr, ai.ai_addrlen) != 0 && errno != EINPROGRESS) {
      return JoinAttempt{{}, fmt::format("connect(): {}", std::strerror(errno))};
    }
    PD_ASSIGN_OR_RETURN(const bool ready,
                        pollReady(s.fd(), POLLOUT, std::min(until, Clock::now() + kConnectAttempt), false));
    if (!ready) return JoinAttempt{{}, "connect(): no answer"};
    int err = 0;
    socklen_t len = sizeof(err);
    if (getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err != 0) return JoinAttempt{{}, fmt::format("connect(): {}", std::strerror(err))};
    if (Status tuned = tuneConnection(s.fd()); !tuned.ok()) return JoinAttempt{{}, tuned.error().message};
    return JoinAttempt{std::move(s), {}};
  }

  Result<JoinAttempt> handshake(Socket s, Clock::time_point until) {
    const HelloBody hello{kProtocolVersion, static_cast<std::uint32_t>(rank_), static_cast<std::uint32_t>(size_), 0,
                          group_key_};
    const auto message = encodeMessage(Kind::Hello, std::as_bytes(std::span(&hello, 1)));
    // A fresh connection's send buffer takes the few bytes at once.
    if (send(s.fd(), message.data(), message.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(message.size())) {
      return JoinAttempt{{}, fmt::format("sending the hello: {}", std::strerror(errno))};
    }
    HeaderBytes raw;
    PD_ASSIGN_OR_RETURN(std::string broken, recvWhileJoining(s.fd(), raw, until));
    if (!broken.empty()) return JoinAttempt{{}, "before answering the hello: " + broken};
    const WireHeader h = decodeHeader(raw);
    if (h.magic == kMagic && h.kind == static_cast<std::uint32_t>(Kind::Accept) && h.bytes == 0) {
      return JoinAttempt{std::move(s), {}};
    }
    if (h.magic != kMagic || h.kind != static_cast<std::uint32_t>(Kind::Reject) || h.bytes > kMaxReasonBytes) {
      return makeError(ErrorCode::Corrupt, fmt::format("tcp group: {} answered the hello of rank {} with something "
                                                       "other than accept or reject",
                                                       leader_address_, rank_));
    }
    std::string reason(h.bytes, '\0');
    PD_ASSIGN_OR_RETURN(std::string cut, recvWhileJoining(s.fd(), std::as_writable_bytes(std::span(reason)), until));
    if (!cut.empty()) reason = "(reason lost: " + cut + ")";
    return makeError(ErrorCode::PeerFailed,
                     fmt::format("tcp group: rank 0 at {} refused rank {}: {}", leader_address_, rank_, reason));
  }

  // Reads exactly out.size() bytes while joining. Deadline and while_joining end it with an
  // error; a closed or reset connection is a value: why, for the caller to judge (empty = done).
  Result<std::string> recvWhileJoining(int fd, std::span<std::byte> out, Clock::time_point until) {
    std::size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = recv(fd, out.data() + done, out.size() - done, 0);
      if (n > 0) {
        done += static_cast<std::size_t>(n);
      } else if (n == 0) {
        return std::string("the connection was closed");
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        PD_ASSIGN_OR_RETURN(const bool ready, pollReady(fd, POLLIN, until, false));
        if (!ready) {
          return makeError(ErrorCode::Timeout,
                           fmt::format("tcp group: rank {} reached rank 0 at {}, but the group was not complete "
                                       "within the join timeout",
                                       rank_, leader_address_));
        }
      } else if (errno != EINTR) {
        return std::string(std::strerror(errno));
      }
    }
    return std::string();
  }

  const int rank_;
  const int size_;
  const std::uint64_t group_key_;
  const std::chrono::milliseconds timeout_;
  const std::string leader_address_;
  std::function<Status()> while_joining_;  // cleared once joined
  std::vector<Socket> links_;              // rank 0: links_[r] to rank r; others: links_[0] to rank 0
  std::vector<float> scratch_;             // rank 0: a chunk of a follower's floats
  std::uint64_t seq_ = 0;                  // collectives started
  std::string_view op_ = "join";
  std::optional<Error> broken_;
  std::mutex watch_mu_;                 // guards watched_error_ (checkPeers() runs on other threads)
  std::optional<Error> watched_error_;  // broken_, for checkPeers()
};

}  // namespace

Result<HostPort> parseHostPort(std::string_view address) {
  PD_ASSIGN_OR_RETURN(Endpoint e, parseAddress(address));
  return HostPort{std::move(e.host), e.port};
}

Result<std::unique_ptr<Communicator>> createTcpCommunicator(const TcpOptions& options) {
  if (options.size < 1 || options.size > kMaxRanks || options.rank < 0 || options.rank >= options.size) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("tcp communicator: rank {} of size {} (size 1..{})",
                                                             options.rank, options.size, kMaxRanks));
  }
  if (options.timeout.count() <= 0 || options.join_timeout.count() <= 0) {
    return makeError(ErrorCode::InvalidArgument, "tcp communicator: timeout and join_timeout must be positive");
  }
  PD_ASSIGN_OR_RETURN(const Endpoint leader, parseAddress(options.address));
  if (options.rank != 0 && leader.port == 0) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("tcp communicator: rank {} needs rank 0's port in '{}'",
                                                             options.rank, options.address));
  }
  auto comm = std::make_unique<TcpCommunicator>(options, options.address);
  if (options.size == 1) return std::unique_ptr<Communicator>(std::move(comm));
  const auto until = deadlineAfter(options.join_timeout);
  if (options.rank == 0) {
    PD_ASSIGN_OR_RETURN(Socket listener, listenOn(leader.port));
    PD_ASSIGN_OR_RETURN(const int port, boundPort(listener.fd()));
    log::info("comm", "tcp group: rank 0 listens on port {} for {} ranks", port, options.size);
    if (options.on_listening) options.on_listening(port);
    PD_TRY(comm->lead(std::move(listener), until));
  } else {
    PD_TRY(comm->follow(leader, until));
  }
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace pd::comm
