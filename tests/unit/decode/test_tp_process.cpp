// Tensor parallelism across processes: rank 1 is a forked process joined over the shared-memory
// communicator; TP = 2 gives the golden greedy tokens (= TP = 1), and a follower that dies makes
// the leader's next call fail instead of hanging.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>

#include "pd/comm/process_group.h"
#include "pd/comm/shm_communicator.h"
#include "pd/decode/tp_worker.h"
#include "tp_test_support.h"

namespace pd::decode {
namespace {

using namespace std::chrono_literals;
using comm::TpGroupOptions;
using comm::TpProcessGroup;
using test_support::goldenDir;
using test_support::goldenIds;
using test_support::makeRankEngine;

int waitExit(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

comm::ShmOptions groupOptions() {
  comm::ShmOptions o;
  o.name = comm::uniqueShmName();
  o.size = 2;
  o.timeout = 20s;
  o.join_timeout = 60s;
  return o;
}

// Forks rank 1 before this process starts any thread. `body` runs in the child, which exits
// with its result.
template <class F>
pid_t forkFollower(comm::ShmOptions o, F body) {
  const pid_t pid = fork();
  if (pid == 0) {
    o.rank = 1;
    auto comm = comm::createShmCommunicator(o);
    _exit(comm.ok() ? body(**comm) : 10);
  }
  return pid;
}

class TpProcess : public ::testing::TestWithParam<std::string> {};

TEST_P(TpProcess, TwoProcessesGiveTheGoldenGreedyTokens) {
  const std::filesystem::path dir = goldenDir() / GetParam();
  const comm::ShmOptions o = groupOptions();
  const pid_t child = forkFollower(o, [&](comm::Communicator& comm) {
    auto engine = makeRankEngine(dir, &comm);
    return model::runTpFollower(*engine, comm, model::ownedTpCache()).ok() ? 0 : 11;
  });
  ASSERT_GT(child, 0);
  auto comm = comm::createShmCommunicator(o);
  ASSERT_TRUE(comm.ok()) << comm.error().toString();
  const auto lead = [&] {
    model::TpLeaderEngine leader(makeRankEngine(dir, comm->get()), **comm);
    for (std::int64_t drafts : {0, 1}) {
      model::GenerateOptions g;
      const std::vector<std::int32_t> want = goldenIds(dir / "golden.safetensors", "p0.greedy");
      g.max_tokens = static_cast<std::int64_t>(want.size());
      g.stop_at_eos = false;
      g.mtp_drafts = drafts;
      auto res = model::generate(leader, goldenIds(dir / "golden.safetensors", "p0.tokens"), g);
      ASSERT_TRUE(res.ok()) << res.error().toString();
      EXPECT_EQ(res->tokens, want) << "mtp drafts " << drafts;
    }
  };
  lead();
  EXPECT_EQ(waitExit(child), 0);
}

TEST_P(TpProcess, ADeadFollowerFailsTheLeadersCall) {
  const std::filesystem::path dir = goldenDir() / GetParam();
  const comm::ShmOptions o = groupOptions();
  const pid_t child = forkFollower(o, [](comm::Communicator&) { return 0; });  // joins, then exits
  ASSERT_GT(child, 0);
  auto comm = comm::createShmCommunicator(o);
  ASSERT_TRUE(comm.ok()) << comm.error().toString();
  model::TpLeaderEngine leader(makeRankEngine(dir, comm->get()), **comm);
  const std::vector<std::int32_t> tokens{1, 2, 3};
  const std::vector<std::int32_t> table{0};
  const model::SequenceChunk chunk{tokens, 0, table, {}, 0};
  auto cache = model::PagedLatentCache::create(leader.config(), 1, 16);
  const auto t0 = std::chrono::steady_clock::now();
  auto out = leader.forward(std::span(&chunk, 1), cache->view(), {});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.error().code, ErrorCode::PeerFailed) << out.error().toString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_EQ(leader.forward(std::span(&chunk, 1), cache->view(), {}).error().code, ErrorCode::PeerFailed);
  EXPECT_EQ(waitExit(child), 0);
}

INSTANTIATE_TEST_SUITE_P(Golden, TpProcess, ::testing::Values("tiny-bf16", "tiny-fp8"));

// TpProcessGroup spawns real processes; a rank that exits before joining fails start() at once
// (not after the join timeout), and one that never joins gives a Timeout.
TpGroupOptions spawning(std::vector<std::string> argv, std::chrono::milliseconds join_timeout) {
  TpGroupOptions o;
  o.size = 2;
  o.child_argv = std::move(argv);
  o.join_timeout = join_timeout;
  return o;
}

TEST(TpProcessGroup, ARankThatExitsFailsStartAtOnce) {
  for (const std::string address : {"", "127.0.0.1:0"}) {
    const auto t0 = std::chrono::steady_clock::now();
    TpGroupOptions o = spawning({"/bin/sh", "-c", "exit 3"}, 30s);
    o.dist_init_address = address;
    auto g = TpProcessGroup::start(o);
    ASSERT_FALSE(g.ok()) << address;
    EXPECT_EQ(g.error().code, ErrorCode::PeerFailed) << g.error().toString();
    EXPECT_NE(g.error().message.find("rank 1 exited with status 3"), std::string::npos) << g.error().message;
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  }
}

TEST(TpProcessGroup, ARankThatNeverJoinsTimesOut) {
  for (const std::string address : {"", "127.0.0.1:0"}) {
    TpGroupOptions o = spawning({"/bin/sh", "-c", "exec sleep 20"}, 300ms);
    o.dist_init_address = address;
    auto g = TpProcessGroup::start(o);
    ASSERT_FALSE(g.ok()) << address;
    EXPECT_EQ(g.error().code, ErrorCode::Timeout) << g.error().toString();
  }
}

TEST(TpProcessGroup, BadShapesAreRejected) {
  TpGroupOptions one = spawning({"/bin/true"}, 1s);
  one.size = 1;
  EXPECT_EQ(TpProcessGroup::start(one).error().code, ErrorCode::InvalidArgument) << "a group needs two ranks";
  TpGroupOptions remote = spawning({"/bin/true"}, 1s);
  remote.size = 4;
  remote.rank = 2;
  remote.local_ranks = 2;
  EXPECT_EQ(TpProcessGroup::start(remote).error().code, ErrorCode::InvalidArgument)
      << "ranks on another machine need a rendezvous address";
  remote.rank = 3;
  remote.dist_init_address = "127.0.0.1:1";
  EXPECT_EQ(TpProcessGroup::start(remote).error().code, ErrorCode::InvalidArgument) << "ranks 3..4 of 4";
}

}  // namespace
}  // namespace pd::decode
