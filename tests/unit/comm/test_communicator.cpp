// Communicator collectives: the loopback group (threads) and the shared-memory communicator
// across real processes (fork), including a peer that dies and one that never arrives.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <thread>

#include "communicator_test_support.h"
#include "pd/comm/communicator.h"
#include "pd/comm/nccl_communicator.h"
#include "pd/comm/shm_communicator.h"

namespace pd::comm {
namespace {

using namespace std::chrono_literals;
using test::exercise;
using test::forkRanks;
using test::waitExit;

TEST(LoopbackCommunicator, CollectivesAcrossThreads) {
  for (int n : {1, 2, 3}) {
    auto group = createLoopbackGroup(n);
    std::vector<std::string> errors(static_cast<std::size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back(
          [&, r] { errors[static_cast<std::size_t>(r)] = exercise(*group[static_cast<std::size_t>(r)], 5000); });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "size " << n << " rank " << r;
  }
}

TEST(LoopbackCommunicator, MissingPeerTimesOut) {
  auto group = createLoopbackGroup(2, LoopbackOptions{100ms});
  std::vector<float> v(4, 1.0F);
  const auto t0 = std::chrono::steady_clock::now();
  Status s = group[0]->allReduceSum(v);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::Timeout);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  // The group is broken: later calls fail at once.
  EXPECT_FALSE(group[1]->barrier().ok());
}

bool shmExists(const std::string& name) {
  return std::filesystem::exists("/dev/shm/" + name);
}

TEST(ShmCommunicator, CollectivesAcrossProcesses) {
  for (int n : {2, 3}) {
    ShmOptions o;
    o.name = uniqueShmName();
    o.size = n;
    o.slot_bytes = 8192;  // small, so that the big allreduce and message go in many pieces
    o.timeout = 10s;
    auto pids = forkRanks(n, [&](int rank) {
      ShmOptions mine = o;
      mine.rank = rank;
      auto comm = createShmCommunicator(mine);
      if (!comm.ok()) return 10;
      return exercise(**comm, 10000).empty() ? 0 : 11;
    });
    o.rank = 0;
    auto comm = createShmCommunicator(o);
    ASSERT_TRUE(comm.ok()) << comm.error().toString();
    EXPECT_EQ((*comm)->kind(), "shm");
    EXPECT_FALSE(shmExists(o.name)) << "the name is unlinked once every rank joined";
    EXPECT_EQ(exercise(**comm, 10000), "");
    for (pid_t p : pids) EXPECT_EQ(waitExit(p), 0);
  }
}

TEST(ShmCommunicator, DeadPeerIsAnErrorNotAHang) {
  ShmOptions o;
  o.name = uniqueShmName();
  o.size = 2;
  o.timeout = 20s;  // the death must be noticed long before this
  auto pids = forkRanks(2, [&](int rank) {
    ShmOptions mine = o;
    mine.rank = rank;
    auto comm = createShmCommunicator(mine);
    return comm.ok() ? 0 : 10;  // joins, then dies without taking part in any collective
  });
  auto comm = createShmCommunicator(o);
  ASSERT_TRUE(comm.ok()) << comm.error().toString();
  std::vector<float> v(16, 1.0F);
  const auto t0 = std::chrono::steady_clock::now();
  Status s = (*comm)->allReduceSum(v);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::PeerFailed) << s.error().toString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_FALSE((*comm)->barrier().ok()) << "the group stays broken";
  EXPECT_EQ(waitExit(pids[0]), 0);
}

TEST(ShmCommunicator, SilentPeerTimesOutWithinTheDeadline) {
  ShmOptions o;
  o.name = uniqueShmName();
  o.size = 2;
  o.timeout = 300ms;
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  auto pids = forkRanks(2, [&](int rank) {
    close(pipefd[1]);
    ShmOptions mine = o;
    mine.rank = rank;
    auto comm = createShmCommunicator(mine);
    char c;
    (void)read(pipefd[0], &c, 1);  // alive but silent until the parent is done
    return comm.ok() ? 0 : 10;
  });
  close(pipefd[0]);
  auto comm = createShmCommunicator(o);
  ASSERT_TRUE(comm.ok()) << comm.error().toString();
  const auto t0 = std::chrono::steady_clock::now();
  Status s = (*comm)->barrier();
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::Timeout) << s.error().toString();
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 3s);
  close(pipefd[1]);
  EXPECT_EQ(waitExit(pids[0]), 0);
}

TEST(ShmCommunicator, RanksThatNeverJoinGiveATimeout) {
  ShmOptions o;
  o.name = uniqueShmName();
  o.size = 2;
  o.join_timeout = 200ms;
  auto comm = createShmCommunicator(o);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.error().code, ErrorCode::Timeout);
  EXPECT_FALSE(shmExists(o.name)) << "no segment left behind";
  o.rank = 1;
  auto follower = createShmCommunicator(o);
  ASSERT_FALSE(follower.ok());
  EXPECT_EQ(follower.error().code, ErrorCode::Timeout);
}

// TEST-ONLY latency injection (netlat experiment): every collective waits the injected latency
// (the ranks' delays overlap, so k collectives take about k latencies), and the sums stay exact.
TEST(ShmCommunicator, InjectedLatencyDelaysEveryCollective) {
  constexpr int kCollectives = 20;
  constexpr auto kLatency = std::chrono::microseconds(2000);
  ShmOptions o;
  o.name = uniqueShmName();
  o.size = 2;
  o.timeout = 10s;
  o.inject_latency = kLatency;
  const auto run = [](Communicator& comm) {
    for (int i = 0; i < kCollectives; ++i) {
      std::vector<float> v(16, static_cast<float>(comm.rank() + i));
      if (!comm.allReduceSum(v).ok()) return 20;
      for (float x : v) {
        if (x != static_cast<float>(2 * i + 1)) return 21;
      }
    }
    return 0;
  };
  auto pids = forkRanks(2, [&](int rank) {
    ShmOptions mine = o;
    mine.rank = rank;
    auto comm = createShmCommunicator(mine);
    return comm.ok() ? run(**comm) : 10;
  });
  auto comm = createShmCommunicator(o);
  ASSERT_TRUE(comm.ok()) << comm.error().toString();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(run(**comm), 0);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, kCollectives * kLatency);
  EXPECT_LT(took, 5s);
  EXPECT_EQ(waitExit(pids[0]), 0);
}

TEST(ShmCommunicator, BadOptionsAreRejected) {
  ShmOptions o;
  o.name = "has/slash";
  EXPECT_EQ(createShmCommunicator(o).error().code, ErrorCode::InvalidArgument);
  o.name = uniqueShmName();
  o.rank = 2;
  o.size = 2;
  EXPECT_EQ(createShmCommunicator(o).error().code, ErrorCode::InvalidArgument);
  o.rank = 0;
  o.slot_bytes = 100;
  EXPECT_EQ(createShmCommunicator(o).error().code, ErrorCode::InvalidArgument);
  o.slot_bytes = 8192;
  o.inject_latency = std::chrono::seconds(2);
  EXPECT_EQ(createShmCommunicator(o).error().code, ErrorCode::InvalidArgument);
}

TEST(NcclCommunicator, UnsupportedWithoutAGpuOrNccl) {
  auto group = createLoopbackGroup(1);
  auto nccl = createNcclCommunicator(*group[0], 0);
  if (nccl.ok()) {
    // A GPU machine: a one-rank NCCL group works like any other.
    EXPECT_EQ((*nccl)->kind(), "nccl");
    EXPECT_EQ(exercise(**nccl, 5000), "");
  } else {
    EXPECT_EQ(nccl.error().code, ErrorCode::Unsupported) << nccl.error().toString();
  }
}

}  // namespace
}  // namespace pd::comm
