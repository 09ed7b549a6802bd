// The TCP communicator across real processes (fork) and threads on 127.0.0.1: collectives and
// their rank-order sums, the rendezvous (retries, refusals, junk connections), and failures that
// must end in PeerFailed or Timeout within a bound instead of a hang.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <thread>

#include "communicator_test_support.h"
#include "pd/comm/communicator.h"
#include "pd/comm/tcp_communicator.h"

namespace pd::comm {
namespace {

using namespace std::chrono_literals;
using test::exercise;
using test::forkRanks;
using test::waitExit;
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kGroupKey = 0x5eed'cafe'f00d'0001ULL;

// A TCP socket bound to a free loopback port (not listening: connections to it are refused);
// the port in *port. -1 on failure.
int boundLoopbackSocket(int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  *port = ntohs(addr.sin_port);
  return fd;
}

// Hands rank 0's port to the other ranks, across fork: rank 0 publishes it once per reader
// (-1 when it could not listen), each reader takes one. Readers close their write end first, so a
// publisher that died makes them read end-of-file instead of waiting forever.
class PortPipe {
 public:
  PortPipe() {
    if (pipe(fds_.data()) != 0) std::abort();
  }
  PortPipe(const PortPipe&) = delete;
  PortPipe& operator=(const PortPipe&) = delete;
  PortPipe(PortPipe&&) = delete;
  PortPipe& operator=(PortPipe&&) = delete;
  ~PortPipe() {
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
    }
  }

  void publish(int port, int readers) {
    for (int i = 0; i < readers; ++i) {
      if (write(fds_[1], &port, sizeof(port)) != static_cast<ssize_t>(sizeof(port))) std::abort();
    }
  }
  int receive() {
    if (fds_[1] >= 0) {
      close(fds_[1]);
      fds_[1] = -1;
    }
    int port = -1;
    return read(fds_[0], &port, sizeof(port)) == static_cast<ssize_t>(sizeof(port)) ? port : -1;
  }

 private:
  std::array<int, 2> fds_{-1, -1};
};

TcpOptions rankOptions(int rank, int size, int port) {
  TcpOptions o;
  o.address = fmt::format("127.0.0.1:{}", port);
  o.rank = rank;
  o.size = size;
  o.group_key = kGroupKey;
  o.timeout = 10s;
  o.join_timeout = 10s;
  return o;
}

// Joins as `o.rank`: rank 0 listens on a free port and publishes it to `readers` ranks, the
// others read rank 0's port first.
Result<std::unique_ptr<Communicator>> joinGroup(TcpOptions o, PortPipe& ports, int readers) {
  if (o.rank != 0) {
    const int port = ports.receive();
    if (port <= 0) return makeError(ErrorCode::Internal, "rank 0 published no port");
    o.address = fmt::format("127.0.0.1:{}", port);
    return createTcpCommunicator(o);
  }
  bool published = false;
  o.address = "127.0.0.1:0";
  o.on_listening = [&](int port) {
    ports.publish(port, readers);
    published = true;
  };
  auto comm = createTcpCommunicator(o);
  if (!published) ports.publish(-1, readers);
  return comm;
}

// A whole group as threads of this process; rank 0 listens on a free port and the others
// connect to `host`:port. Element r is rank r; empty elements and errors when joining failed.
struct ThreadGroup {
  std::vector<std::unique_ptr<Communicator>> ranks;
  std::vector<std::string> errors;
};

ThreadGroup threadGroup(int n, const std::string& host, const TcpOptions& base) {
  ThreadGroup g;
  g.ranks.resize(static_cast<std::size_t>(n));
  g.errors.resize(static_cast<std::size_t>(n));
  std::promise<int> port;
  auto port_future = port.get_future();
  const auto join = [&](int r, const TcpOptions& o) {
    auto comm = createTcpCommunicator(o);
    if (comm.ok()) {
      g.ranks[static_cast<std::size_t>(r)] = std::move(*comm);
    } else {
      g.errors[static_cast<std::size_t>(r)] = comm.error().toString();
    }
  };
  std::vector<std::thread> threads;
  TcpOptions leader = base;
  leader.rank = 0;
  leader.size = n;
  leader.address = "127.0.0.1:0";
  leader.on_listening = [&](int p) { port.set_value(p); };
  threads.emplace_back(join, 0, leader);
  if (port_future.wait_for(5s) == std::future_status::ready) {
    const int p = port_future.get();
    for (int r = 1; r < n; ++r) {
      TcpOptions o = base;
      o.rank = r;
      o.size = n;
      o.address = fmt::format("{}:{}", host, p);
      threads.emplace_back(join, r, o);
    }
  }
  for (auto& t : threads) t.join();
  return g;
}

// Runs `body(rank)` on a thread per rank and returns each rank's result.
template <class F>
std::vector<std::string> onEveryRank(int n, F body) {
  std::vector<std::string> results(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { results[static_cast<std::size_t>(r)] = body(r); });
  for (auto& t : threads) t.join();
  return results;
}

std::string statusText(const Status& s) {
  return s.ok() ? "ok" : s.error().toString();
}

TEST(TcpCommunicator, CollectivesAcrossProcesses) {
  for (int n : {2, 3, 4}) {
    constexpr std::size_t kBig = std::size_t{1} << 20;
    PortPipe ports;
    const TcpOptions base = rankOptions(0, n, 0);
    auto pids = forkRanks(n, [&](int rank) {
      TcpOptions mine = base;
      mine.rank = rank;
      auto comm = joinGroup(mine, ports, 0);
      if (!comm.ok()) return 10;
      return exercise(**comm, kBig).empty() ? 0 : 11;
    });
    auto comm = joinGroup(base, ports, n - 1);
    ASSERT_TRUE(comm.ok()) << comm.error().toString();
    EXPECT_EQ((*comm)->kind(), "tcp");
    EXPECT_EQ((*comm)->rank(), 0);
    EXPECT_EQ((*comm)->size(), n);
    EXPECT_EQ(exercise(**comm, kBig), "") << "size " << n;
    for (pid_t p : pids) EXPECT_EQ(waitExit(p), 0) << "size " << n;
  }
}

TEST(TcpCommunicator, NamesAndIpv6LiteralsReachRankZero) {
  std::vector<std::string> hosts{"localhost"};
  {
    // IPv6 only where this machine has a loopback for it.
    const int fd = socket(AF_INET6, SOCK_STREAM, 0);
    sockaddr_in6 addr{};
    addr.sin6_family = AF_INET6;
    addr.sin6_addr = in6addr_loopback;
    if (fd >= 0 && bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) hosts.emplace_back("[::1]");
    if (fd >= 0) close(fd);
  }
  for (const std::string& host : hosts) {
    ThreadGroup g = threadGroup(3, host, rankOptions(0, 3, 0));
    for (const std::string& e : g.errors) ASSERT_EQ(e, "") << host;
    const auto results = onEveryRank(3, [&](int r) { return exercise(*g.ranks[static_cast<std::size_t>(r)], 5000); });
    for (const std::string& e : results) EXPECT_EQ(e, "") << host;
  }
}

TEST(TcpCommunicator, SizeOneNeedsNoNetwork) {
  TcpOptions o = rankOptions(0, 1, 0);
  bool listened = false;
  o.on_listening = [&](int) { listened = true; };
  auto comm = createTcpCommunicator(o);
  ASSERT_TRUE(comm.ok()) << comm.error().toString();
  EXPECT_FALSE(listened);
  EXPECT_EQ(exercise(**comm, 1000), "");
  std::vector<std::byte> b(8, std::byte{1});
  EXPECT_TRUE((*comm)->broadcastUnbounded(b, 0).ok());
  const Status bad = (*comm)->broadcast(b, 1);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, ErrorCode::InvalidArgument);
}

TEST(TcpCommunicator, BadOptionsAreRejected) {
  const auto code = [](const TcpOptions& o) {
    auto comm = createTcpCommunicator(o);
    return comm.ok() ? std::string("ok") : std::string(errorCodeName(comm.error().code));
  };
  const std::string invalid(errorCodeName(ErrorCode::InvalidArgument));
  TcpOptions o = rankOptions(0, 2, 0);
  o.join_timeout = 50ms;
  for (int size : {0, -1, 1025}) {
    o.size = size;
    EXPECT_EQ(code(o), invalid) << "size " << size;
  }
  o.size = 2;
  for (int rank : {-1, 2}) {
    o.rank = rank;
    EXPECT_EQ(code(o), invalid) << "rank " << rank;
  }
  o.rank = 0;
  for (const char* address : {"", "127.0.0.1", ":80", "host:", "host:http", "host:70000", "host:-1", "::1:80", "[::1]",
                              "[::1]80", "[]:80", "[::1:80"}) {
    o.address = address;
    EXPECT_EQ(code(o), invalid) << "address '" << address << "'";
  }
  o.address = "127.0.0.1:0";
  o.rank = 1;
  EXPECT_EQ(code(o), invalid) << "a follower needs rank 0's port";
  o.rank = 0;
  o.timeout = 0ms;
  EXPECT_EQ(code(o), invalid);
  o.timeout = 1s;
  o.join_timeout = -5ms;
  EXPECT_EQ(code(o), invalid);
}

TEST(TcpCommunicator, KilledFollowerFailsTheOthersQuickly) {
  PortPipe ports;
  TcpOptions base = rankOptions(0, 3, 0);
  base.timeout = 20s;  // the death must be noticed long before this
  auto pids = forkRanks(3, [&](int rank) {
    TcpOptions mine = base;
    mine.rank = rank;
    auto comm = joinGroup(mine, ports, 0);
    if (!comm.ok() || !(*comm)->barrier().ok()) return 10;
    if (rank == 2) raise(SIGKILL);
    std::vector<float> v(1 << 16, 1.0F);
    const auto t0 = Clock::now();
    const Status s = (*comm)->allReduceSum(v);
    if (s.ok() || s.error().code != ErrorCode::PeerFailed) return 11;
    return Clock::now() - t0 < 2s ? 0 : 12;
  });
  auto comm = joinGroup(base, ports, 2);
  ASSERT_TRUE(comm.ok()) << comm.error().toString();
  ASSERT_TRUE((*comm)->barrier().ok());
  std::vector<float> v(1 << 16, 1.0F);
  const auto t0 = Clock::now();
  const Status s = (*comm)->allReduceSum(v);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::PeerFailed) << s.error().toString();
  EXPECT_NE(s.error().message.find("rank 2"), std::string::npos) << s.error().message;
  EXPECT_LT(Clock::now() - t0, 2s);
  // The group stays broken: later calls fail at once with the same error.
  const Status later = (*comm)->barrier();
  ASSERT_FALSE(later.ok());
  EXPECT_EQ(later.error().message, s.error().message);
  EXPECT_EQ(waitExit(pids[0]), 0) << "rank 1 fails fast too";
  EXPECT_EQ(waitExit(pids[1]), 128 + SIGKILL);
}

// checkPeers() (the leader's idle watchdog): OK while every connection is up, PeerFailed naming
// the rank once one is gone, without any collective; callable from another thread while a
// collective runs.
TEST(TcpCommunicator, CheckPeersSeesADroppedConnectionWithoutACollective) {
  PortPipe ports;
  TcpOptions base = rankOptions(0, 3, 0);
  auto pids = forkRanks(3, [&](int rank) {
    TcpOptions mine = base;
    mine.rank = rank;
    auto comm = joinGroup(mine, ports, 0);
    if (!comm.ok() || !(*comm)->barrier().ok()) return 10;
    if (!(*comm)->checkPeers().ok()) return 11;
    if (!(*comm)->barrier().ok()) return 12;  // rank 0 checked its peers before this
    if (rank == 2) raise(SIGKILL);
    std::vector<std::byte> data(8);
    (void)(*comm)->broadcastUnbounded(data, 0);  // ends when rank 0 leaves the group
    return 0;
  });
  auto comm = joinGroup(base, ports, 2);
  ASSERT_TRUE(comm.ok()) << comm.error().toString();
  ASSERT_TRUE((*comm)->barrier().ok());
  EXPECT_TRUE((*comm)->checkPeers().ok());
  ASSERT_TRUE((*comm)->barrier().ok());
  ASSERT_EQ(waitExit(pids[1]), 128 + SIGKILL);
  const auto deadline = Clock::now() + 2s;
  Status s = okStatus();
  std::thread watcher([&] {  // from another thread, as the leader's watchdog does
    while (Clock::now() < deadline && (s = (*comm)->checkPeers()).ok()) std::this_thread::sleep_for(5ms);
  });
  watcher.join();
  ASSERT_FALSE(s.ok()) << "checkPeers did not see rank 2 go";
  EXPECT_EQ(s.error().code, ErrorCode::PeerFailed);
  EXPECT_NE(s.error().message.find("rank 2"), std::string::npos) << s.error().message;
  // The next collective fails too, which breaks the group and ends rank 1's wait.
  std::vector<std::byte> data(8);
  EXPECT_FALSE((*comm)->broadcast(data, 0).ok());
  EXPECT_FALSE((*comm)->checkPeers().ok()) << "a broken group stays broken for the watchdog";
  EXPECT_EQ(waitExit(pids[0]), 0);
}

TEST(TcpCommunicator, LeaderDeathWakesAFollowerWaitingUnbounded) {
  PortPipe ports;
  TcpOptions base = rankOptions(0, 2, 0);
  base.timeout = 100ms;  // the unbounded wait outlives it
  const pid_t leader = fork();
  if (leader == 0) {
    auto comm = joinGroup(base, ports, 1);
    if (!comm.ok()) _exit(10);
    while (true) pause();  // joined; waits to be killed
  }
  TcpOptions mine = base;
  mine.rank = 1;
  auto comm = joinGroup(mine, ports, 0);
  Clock::time_point killed_at;
  std::thread killer([&] {
    std::this_thread::sleep_for(300ms);
    killed_at = Clock::now();
    kill(leader, SIGKILL);
  });
  Status s = okStatus();
  if (comm.ok()) {
    std::vector<std::byte> data(64);
    s = (*comm)->broadcastUnbounded(data, 0);
  }
  const auto returned_at = Clock::now();
  killer.join();
  EXPECT_EQ(waitExit(leader), 128 + SIGKILL);
  ASSERT_TRUE(comm.ok()) << comm.error().toString();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::PeerFailed) << s.error().toString();
  EXPECT_GE(returned_at, killed_at) << "waited past the 100 ms collective deadline";
  EXPECT_LT(returned_at - killed_at, 2s);
}

// A stopped process keeps its connections open: only the deadline ends the wait, on either side.
TEST(TcpCommunicator, StoppedPeerTimesOutWithinTheDeadline) {
  for (int stopped : {1, 0}) {
    PortPipe ports;
    TcpOptions base = rankOptions(0, 2, 0);
    base.timeout = 300ms;
    const pid_t child = fork();
    if (child == 0) {
      TcpOptions mine = base;
      mine.rank = stopped;
      auto comm = joinGroup(mine, ports, 1);
      if (!comm.ok()) _exit(10);
      raise(SIGSTOP);
      _exit(0);
    }
    TcpOptions mine = base;
    mine.rank = 1 - stopped;
    auto comm = joinGroup(mine, ports, 1);
    int status = 0;
    const bool child_stopped = waitpid(child, &status, WUNTRACED) == child && WIFSTOPPED(status);
    Status s = okStatus();
    auto took = Clock::duration::zero();
    if (comm.ok() && child_stopped) {
      const auto t0 = Clock::now();
      s = (*comm)->barrier();
      took = Clock::now() - t0;
    }
    kill(child, SIGKILL);
    EXPECT_EQ(waitExit(child), 128 + SIGKILL);
    ASSERT_TRUE(comm.ok()) << comm.error().toString();
    ASSERT_TRUE(child_stopped);
    ASSERT_FALSE(s.ok()) << "stopped rank " << stopped;
    EXPECT_EQ(s.error().code, ErrorCode::Timeout) << s.error().toString();
    EXPECT_GE(took, 300ms);
    EXPECT_LT(took, 1500ms);
    EXPECT_EQ(statusText((*comm)->barrier()), s.error().toString()) << "broken: the same error at once";
  }
}

TEST(TcpCommunicator, RanksThatNeverJoinGiveATimeout) {
  TcpOptions o = rankOptions(0, 3, 0);
  o.join_timeout = 300ms;
  int calls = 0;
  o.while_joining = [&] {
    ++calls;
    return okStatus();
  };
  auto t0 = Clock::now();
  auto leader = createTcpCommunicator(o);
  auto took = Clock::now() - t0;
  ASSERT_FALSE(leader.ok());
  EXPECT_EQ(leader.error().code, ErrorCode::Timeout) << leader.error().toString();
  EXPECT_NE(leader.error().message.find("missing ranks: 1, 2"), std::string::npos) << leader.error().message;
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 2s);
  EXPECT_GE(calls, 5) << "while_joining is called every few ms";

  // A follower whose rank 0 never listens: a bound port that refuses connections.
  int blocked_port = 0;
  const int blocker = boundLoopbackSocket(&blocked_port);
  ASSERT_GE(blocker, 0);
  o = rankOptions(1, 2, blocked_port);
  o.join_timeout = 300ms;
  t0 = Clock::now();
  auto follower = createTcpCommunicator(o);
  took = Clock::now() - t0;
  close(blocker);
  ASSERT_FALSE(follower.ok());
  EXPECT_EQ(follower.error().code, ErrorCode::Timeout) << follower.error().toString();
  EXPECT_NE(follower.error().message.find("refused"), std::string::npos) << follower.error().message;
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 2s);
}

TEST(TcpCommunicator, WhileJoiningErrorEndsTheWait) {
  TcpOptions o = rankOptions(1, 2, 9);  // nothing listens on port 9 here
  const auto t0 = Clock::now();
  o.while_joining = [&]() -> Status {
    if (Clock::now() - t0 > 100ms) return makeError(ErrorCode::Cancelled, "the local launcher gave up");
    return okStatus();
  };
  auto follower = createTcpCommunicator(o);
  ASSERT_FALSE(follower.ok());
  EXPECT_EQ(follower.error().code, ErrorCode::Cancelled);
  EXPECT_LT(Clock::now() - t0, 1s);
  o.rank = 0;
  o.address = "127.0.0.1:0";
  auto leader = createTcpCommunicator(o);
  ASSERT_FALSE(leader.ok());
  EXPECT_EQ(leader.error().code, ErrorCode::Cancelled);
}

TEST(TcpCommunicator, FollowerStartingBeforeRankZeroRetries) {
  // A free port: bind port 0, note it, release it.
  int port = 0;
  const int probe = boundLoopbackSocket(&port);
  ASSERT_GE(probe, 0);
  close(probe);

  // The leader starts only once the follower's first attempt has failed: while_joining runs
  // before the first attempt and then again in the wait before each retry, so its second call
  // proves a refusal (ordered by construction, not by a sleep). The join deadline is generous so
  // that a loaded machine cannot turn slowness into a failure; the assertion is that it joins.
  std::promise<void> refused;
  int calls = 0;
  TcpOptions follower_options = rankOptions(1, 2, port);
  follower_options.join_timeout = 120s;
  follower_options.while_joining = [&] {
    if (++calls == 2) refused.set_value();
    return okStatus();
  };
  auto follower = std::async(std::launch::async, [&] { return createTcpCommunicator(follower_options); });
  ASSERT_EQ(refused.get_future().wait_for(60s), std::future_status::ready);
  TcpOptions leader_options = rankOptions(0, 2, port);
  leader_options.join_timeout = 120s;
  auto leader = createTcpCommunicator(leader_options);
  auto joined = follower.get();
  ASSERT_TRUE(leader.ok()) << leader.error().toString();
  ASSERT_TRUE(joined.ok()) << joined.error().toString();
  std::array<Communicator*, 2> group{leader->get(), joined->get()};
  const auto results = onEveryRank(2, [&](int r) { return exercise(*group[static_cast<std::size_t>(r)], 1000); });
  EXPECT_EQ(results[0], "");
  EXPECT_EQ(results[1], "");
}

// Opens a plain connection to 127.0.0.1:port and sends `bytes` (none: a silent client).
int rawConnection(int port, std::string_view bytes) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) return -1;
  if (!bytes.empty() && send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(bytes.size())) {
    return -1;
  }
  return fd;
}

TEST(TcpCommunicator, WrongHellosAreRefusedAndTheGroupStillForms) {
  constexpr int kSize = 3;
  std::promise<int> port_promise;
  auto port_future = port_promise.get_future();
  TcpOptions leader_options = rankOptions(0, kSize, 0);
  leader_options.on_listening = [&](int p) { port_promise.set_value(p); };
  auto leader = std::async(std::launch::async, [&] { return createTcpCommunicator(leader_options); });
  ASSERT_EQ(port_future.wait_for(5s), std::future_status::ready);
  const int port = port_future.get();

  const auto refusal = [&](const TcpOptions& o) {
    auto comm = createTcpCommunicator(o);
    if (comm.ok()) return std::string("accepted");
    EXPECT_EQ(comm.error().code, ErrorCode::PeerFailed) << comm.error().toString();
    return comm.error().message;
  };
  TcpOptions other_key = rankOptions(1, kSize, port);
  other_key.group_key = kGroupKey + 1;
  EXPECT_NE(refusal(other_key).find("group key"), std::string::npos);
  EXPECT_NE(refusal(rankOptions(1, kSize + 1, port)).find("group of 4 ranks, rank 0 has 3"), std::string::npos);

  // Junk and silence from non-pdserve clients do not stop the rendezvous.
  const int junk = rawConnection(port, "GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  const int silent = rawConnection(port, "");
  EXPECT_GE(junk, 0);
  EXPECT_GE(silent, 0);

  // Two processes claim rank 1: whichever comes second is refused.
  auto first = std::async(std::launch::async, [&] { return createTcpCommunicator(rankOptions(1, kSize, port)); });
  std::this_thread::sleep_for(300ms);
  auto second = std::async(std::launch::async, [&] { return createTcpCommunicator(rankOptions(1, kSize, port)); });
  for (int i = 0; i < 500; ++i) {
    if (first.wait_for(10ms) == std::future_status::ready || second.wait_for(0ms) == std::future_status::ready) break;
  }
  auto rank2 = createTcpCommunicator(rankOptions(2, kSize, port));
  auto a = first.get();
  auto b = second.get();
  auto zero = leader.get();
  if (junk >= 0) close(junk);
  if (silent >= 0) close(silent);
  ASSERT_TRUE(zero.ok()) << zero.error().toString();
  ASSERT_TRUE(rank2.ok()) << rank2.error().toString();
  ASSERT_NE(a.ok(), b.ok()) << "exactly one rank 1 joins";
  const auto& refused = a.ok() ? b : a;
  EXPECT_EQ(refused.error().code, ErrorCode::PeerFailed);
  EXPECT_NE(refused.error().message.find("rank 1 is already connected"), std::string::npos) << refused.error().message;
  std::array<Communicator*, kSize> group{zero->get(), a.ok() ? a->get() : b->get(), rank2->get()};
  const auto results = onEveryRank(kSize, [&](int r) { return exercise(*group[static_cast<std::size_t>(r)], 1000); });
  for (const std::string& e : results) EXPECT_EQ(e, "");
}

TEST(TcpCommunicator, MismatchedCollectivesBreakTheGroup) {
  TcpOptions base = rankOptions(0, 2, 0);
  base.timeout = 5s;
  {
    ThreadGroup g = threadGroup(2, "127.0.0.1", base);
    for (const std::string& e : g.errors) ASSERT_EQ(e, "");
    const auto results = onEveryRank(2, [&](int r) {
      std::vector<float> v(r == 0 ? 16 : 8, 1.0F);  // lengths differ
      return statusText(g.ranks[static_cast<std::size_t>(r)]->allReduceSum(v));
    });
    EXPECT_NE(results[0].find("InvalidArgument"), std::string::npos) << results[0];
    EXPECT_NE(results[1].find("PeerFailed"), std::string::npos) << results[1];
  }
  {
    ThreadGroup g = threadGroup(2, "127.0.0.1", base);
    for (const std::string& e : g.errors) ASSERT_EQ(e, "");
    const auto t0 = Clock::now();
    const auto results = onEveryRank(2, [&](int r) {
      Communicator& comm = *g.ranks[static_cast<std::size_t>(r)];
      if (r == 0) return statusText(comm.barrier());
      std::vector<std::byte> b(4);
      return statusText(comm.broadcast(b, 1));  // a different collective
    });
    EXPECT_NE(results[0].find("InvalidArgument"), std::string::npos) << results[0];
    EXPECT_NE(results[0].find("broadcast"), std::string::npos) << results[0];
    EXPECT_LT(Clock::now() - t0, 2s) << "noticed at once, not at the deadline";
    std::vector<float> v(4);
    EXPECT_EQ(statusText(g.ranks[0]->allReduceSum(v)), results[0]) << "broken: the same error";
  }
}

}  // namespace
}  // namespace pd::comm
