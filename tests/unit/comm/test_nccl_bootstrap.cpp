// The NCCL bootstrap's logic on CPU: ranks are threads of a loopback group, NCCL is a fake
// CommunicatorFactory. Who makes the id, that every rank gets it, the frame checked as hostile
// bytes, a rank that never arrives, a rank that fails or hangs in its join, and the
// deadline-bounded wait (awaitNccl) that every NCCL call goes through.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "pd/comm/communicator.h"
#include "pd/comm/nccl_bootstrap.h"
#include "pd/comm/nccl_communicator.h"

namespace pd::comm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

NcclId testId(std::uint8_t seed) {
  NcclId id{};
  for (std::size_t i = 0; i < id.size(); ++i) id[i] = static_cast<std::byte>(seed + i * 7 + 1);
  return id;
}

// What a join behaves like on one rank.
enum class JoinBehaviour { Succeed, Fail, Hang };

// The ranks' shared record of what the fake NCCL saw.
struct FakeNccl {
  std::mutex mu;
  int ids_made = 0;
  std::optional<Error> make_id_error;
  std::vector<JoinBehaviour> behaviour;  // per rank
  struct Join {
    NcclId id;
    int rank, size, device;
  };
  std::vector<Join> joins;
  std::atomic<int> live_comms{0};
  std::atomic<int> aborts{0};
};

class FakeComm final : public Communicator {
 public:
  FakeComm(FakeNccl& nccl, int rank, int size) : nccl_(nccl), rank_(rank), size_(size) { ++nccl_.live_comms; }
  ~FakeComm() override { --nccl_.live_comms; }
  FakeComm(const FakeComm&) = delete;
  FakeComm& operator=(const FakeComm&) = delete;
  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] int size() const override { return size_; }
  [[nodiscard]] std::string kind() const override { return "fake-nccl"; }
  Status allReduceSum(std::span<float> /*data*/) override { return okStatus(); }
  Status allGather(std::span<const std::byte> /*send*/, std::span<std::byte> /*recv*/) override { return okStatus(); }
  Status broadcast(std::span<std::byte> /*data*/, int /*root*/) override { return okStatus(); }
  Status barrier() override { return okStatus(); }

 private:
  FakeNccl& nccl_;
  int rank_, size_;
};

class FakeFactory final : public CommunicatorFactory {
 public:
  explicit FakeFactory(FakeNccl& nccl) : nccl_(nccl) {}
  Result<NcclId> makeId() override {
    std::lock_guard lock(nccl_.mu);
    if (nccl_.make_id_error) return *nccl_.make_id_error;
    ++nccl_.ids_made;
    return testId(static_cast<std::uint8_t>(nccl_.ids_made));
  }
  Result<std::unique_ptr<Communicator>> join(const NcclId& id, int rank, int size, int device,
                                             Clock::time_point deadline,
                                             const std::function<Status()>& peers) override {
    JoinBehaviour behaviour = JoinBehaviour::Succeed;
    {
      std::lock_guard lock(nccl_.mu);
      nccl_.joins.push_back({id, rank, size, device});
      if (static_cast<std::size_t>(rank) < nccl_.behaviour.size()) behaviour = nccl_.behaviour[rank];
    }
    if (behaviour == JoinBehaviour::Fail) return makeError(ErrorCode::Internal, "fake ncclCommInitRank failed");
    if (behaviour == JoinBehaviour::Hang) {
      // An init that never completes: only the deadline (or a peer failure) ends the wait.
      PD_TRY(awaitNccl([] { return Result<NcclProgress>(NcclProgress::InProgress); }, peers, [this] { ++nccl_.aborts; },
                       deadline, "fake init"));
    }
    return std::unique_ptr<Communicator>(new FakeComm(nccl_, rank, size));
  }

 private:
  FakeNccl& nccl_;
};

struct RankResult {
  std::optional<Result<std::unique_ptr<Communicator>>> result;
  Clock::duration took{};
};

// Runs bootstrapCommunicator on every rank listed in `present` (threads of one loopback group);
// the others never arrive. tags[r] / devices[r] are rank r's options.
std::vector<RankResult> runRanks(FakeNccl& nccl, int size, const std::vector<std::uint64_t>& tags,
                                 std::vector<bool> present = {}, std::chrono::milliseconds group_timeout = 5000ms,
                                 std::chrono::milliseconds join_timeout = 5000ms) {
  if (present.empty()) present.assign(size, true);
  LoopbackOptions lo;
  lo.timeout = group_timeout;
  auto group = createLoopbackGroup(size, lo);
  std::vector<RankResult> results(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    if (!present[r]) continue;
    threads.emplace_back([&, r] {
      FakeFactory factory(nccl);
      NcclBootstrapOptions options;
      options.device = 10 + r;
      options.group_tag = tags[r];
      options.join_timeout = join_timeout;
      const auto start = Clock::now();
      results[r].result = bootstrapCommunicator(*group[r], factory, options);
      results[r].took = Clock::now() - start;
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// The rank's error code; nullopt when it succeeded.
std::optional<ErrorCode> codeOf(const RankResult& r) {
  if (r.result->ok()) return std::nullopt;
  return r.result->error().code;
}

TEST(NcclBootstrap, RankZeroMakesTheIdAndEveryRankJoinsWithItOnItsDevice) {
  FakeNccl nccl;
  auto results = runRanks(nccl, 4, {7, 7, 7, 7});
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(results[r].result->ok()) << r << ": " << results[r].result->error().toString();
    EXPECT_EQ((**results[r].result)->rank(), r);
    EXPECT_EQ((**results[r].result)->size(), 4);
  }
  EXPECT_EQ(nccl.ids_made, 1);  // one id, made by rank 0 only
  ASSERT_EQ(nccl.joins.size(), 4U);
  std::vector<bool> seen(4, false);
  for (const auto& j : nccl.joins) {
    EXPECT_EQ(j.id, testId(1)) << "rank " << j.rank << " joined with another id";
    EXPECT_EQ(j.size, 4);
    EXPECT_EQ(j.device, 10 + j.rank);
    seen[j.rank] = true;
  }
  EXPECT_EQ(seen, std::vector<bool>(4, true));
  EXPECT_EQ(nccl.live_comms.load(), 4);
}

TEST(NcclBootstrap, RankZeroWithoutAnIdFailsEveryRankBeforeAnyJoin) {
  FakeNccl nccl;
  nccl.make_id_error = Error{ErrorCode::Unsupported, "no CUDA device"};
  auto results = runRanks(nccl, 3, {1, 1, 1});
  EXPECT_EQ(codeOf(results[0]), ErrorCode::Unsupported);
  EXPECT_EQ(codeOf(results[1]), ErrorCode::PeerFailed);
  EXPECT_EQ(codeOf(results[2]), ErrorCode::PeerFailed);
  EXPECT_TRUE(nccl.joins.empty());
}

TEST(NcclBootstrap, ARankOfAnotherJobRefusesTheIdAndNoRankEntersNccl) {
  FakeNccl nccl;
  auto results = runRanks(nccl, 3, {5, 5, 6});
  EXPECT_EQ(codeOf(results[2]), ErrorCode::InvalidArgument);
  EXPECT_NE(results[2].result->error().message.find("group tag"), std::string::npos);
  EXPECT_EQ(codeOf(results[0]), ErrorCode::PeerFailed);
  EXPECT_EQ(codeOf(results[1]), ErrorCode::PeerFailed);
  EXPECT_NE(results[0].result->error().message.find("1 rank(s) refused"), std::string::npos);
  EXPECT_TRUE(nccl.joins.empty());
}

TEST(NcclBootstrap, ARankThatNeverArrivesFailsTheOthersWithinTheGroupDeadline) {
  FakeNccl nccl;
  auto results = runRanks(nccl, 3, {1, 1, 1}, {true, true, false}, 300ms);
  for (int r : {0, 1}) {
    EXPECT_EQ(codeOf(results[r]), ErrorCode::PeerFailed) << r;
    EXPECT_LT(results[r].took, 5s) << r;
  }
  EXPECT_TRUE(nccl.joins.empty());
}

TEST(NcclBootstrap, ARankWhoseJoinFailsFailsEveryRankAndTheJoinedOnesDropTheirCommunicators) {
  FakeNccl nccl;
  nccl.behaviour = {JoinBehaviour::Succeed, JoinBehaviour::Fail, JoinBehaviour::Succeed};
  auto results = runRanks(nccl, 3, {1, 1, 1});
  EXPECT_EQ(codeOf(results[1]), ErrorCode::Internal);
  EXPECT_EQ(codeOf(results[0]), ErrorCode::PeerFailed);
  EXPECT_EQ(codeOf(results[2]), ErrorCode::PeerFailed);
  EXPECT_EQ(nccl.joins.size(), 3U);
  EXPECT_EQ(nccl.live_comms.load(), 0);
}

TEST(NcclBootstrap, AJoinThatHangsIsAbortedAtItsDeadline) {
  FakeNccl nccl;
  nccl.behaviour = {JoinBehaviour::Succeed, JoinBehaviour::Hang};
  auto results = runRanks(nccl, 2, {1, 1}, {}, 5000ms, 200ms);
  EXPECT_EQ(codeOf(results[1]), ErrorCode::Timeout);
  EXPECT_GE(results[1].took, 200ms);
  EXPECT_LT(results[1].took, 4s);
  EXPECT_EQ(codeOf(results[0]), ErrorCode::PeerFailed);
  EXPECT_EQ(nccl.aborts.load(), 1);
  EXPECT_EQ(nccl.live_comms.load(), 0);
}

TEST(NcclBootstrap, AHostileFrameIsRefused) {
  // The "rank 0" here is the test: it broadcasts bytes of its own, then takes part in the
  // agreement as a well-behaved rank 0 would.
  auto group = createLoopbackGroup(2);
  std::optional<Result<std::unique_ptr<Communicator>>> got;
  FakeNccl nccl;
  std::thread follower([&] {
    FakeFactory factory(nccl);
    got = bootstrapCommunicator(*group[1], factory, {});
  });
  auto frame = encodeNcclIdFrame(nullptr, 2, 0);
  frame[0] = std::byte{'X'};
  ASSERT_TRUE(group[0]->broadcast(frame, 0).ok());
  float flag = 0.0F;
  ASSERT_TRUE(group[0]->allReduceSum(std::span(&flag, 1)).ok());
  follower.join();
  EXPECT_EQ(flag, 1.0F);  // the follower said it refused
  ASSERT_FALSE(got->ok());
  EXPECT_EQ(got->error().code, ErrorCode::Corrupt);
  EXPECT_TRUE(nccl.joins.empty());
}

TEST(NcclIdFrame, RoundTripsAndRefusesEveryBadField) {
  const NcclId id = testId(42);
  const auto frame = encodeNcclIdFrame(&id, 16, 0x1234'5678'9abc'def0ULL);
  auto back = decodeNcclIdFrame(frame, 16, 0x1234'5678'9abc'def0ULL);
  ASSERT_TRUE(back.ok()) << back.error().toString();
  EXPECT_EQ(*back, id);

  auto code = [&](std::span<const std::byte> bytes, int ranks = 16, std::uint64_t tag = 0x1234'5678'9abc'def0ULL) {
    auto r = decodeNcclIdFrame(bytes, ranks, tag);
    return r.ok() ? std::nullopt : std::optional<ErrorCode>(r.error().code);
  };
  EXPECT_EQ(code(std::span(frame).first(frame.size() - 1)), ErrorCode::Corrupt);  // short
  std::vector<std::byte> longer(frame.begin(), frame.end());
  longer.push_back(std::byte{0});
  EXPECT_EQ(code(longer), ErrorCode::Corrupt);
  EXPECT_EQ(code(frame, 8), ErrorCode::InvalidArgument);      // another group size
  EXPECT_EQ(code(frame, 16, 1), ErrorCode::InvalidArgument);  // another job's tag
  EXPECT_EQ(code(frame, 0), ErrorCode::InvalidArgument);
  auto mutated = [&](std::size_t at, std::byte value) {
    auto m = frame;
    m[at] = value;
    return m;
  };
  EXPECT_EQ(code(mutated(0, std::byte{0})), ErrorCode::Corrupt);           // magic
  EXPECT_EQ(code(mutated(4, std::byte{9})), ErrorCode::Corrupt);           // version
  EXPECT_EQ(code(mutated(6, std::byte{7})), ErrorCode::Corrupt);           // unknown status
  EXPECT_EQ(code(mutated(6, std::byte{1})), ErrorCode::PeerFailed);        // rank 0 failed
  EXPECT_EQ(code(mutated(12, std::byte{64})), ErrorCode::Corrupt);         // id length
  EXPECT_EQ(code(mutated(11, std::byte{1})), ErrorCode::InvalidArgument);  // rank count's high byte
  const NcclId zero{};
  EXPECT_EQ(code(encodeNcclIdFrame(&zero, 16, 0x1234'5678'9abc'def0ULL)), ErrorCode::Corrupt);
  EXPECT_EQ(code(encodeNcclIdFrame(nullptr, 16, 0)), ErrorCode::PeerFailed);
  // Every single-byte change of the header is refused (the id bytes themselves are opaque).
  for (std::size_t at = 0; at < kNcclIdFrameBytes - kNcclIdBytes; ++at) {
    EXPECT_NE(code(mutated(at, frame[at] ^ std::byte{0x80})), std::nullopt) << "header byte " << at;
  }
}

TEST(AwaitNccl, ReturnsWhenDoneAndKeepsTheErrorOfAFailedPoll) {
  int polls = 0;
  int aborts = 0;
  const auto far = Clock::now() + 10s;
  Status s =
      awaitNccl([&]() -> Result<NcclProgress> { return ++polls < 5 ? NcclProgress::InProgress : NcclProgress::Done; },
                [] { return okStatus(); }, [&] { ++aborts; }, far, "op");
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(polls, 5);
  EXPECT_EQ(aborts, 0);

  s = awaitNccl([]() -> Result<NcclProgress> { return makeError(ErrorCode::PeerFailed, "ncclRemoteError"); },
                [] { return okStatus(); }, [&] { ++aborts; }, far, "allreduce");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::PeerFailed);
  EXPECT_NE(s.error().message.find("allreduce: ncclRemoteError"), std::string::npos);
  EXPECT_EQ(aborts, 1);
}

TEST(AwaitNccl, NeverWaitsPastItsDeadline) {
  int aborts = 0;
  const auto start = Clock::now();
  Status s = awaitNccl([]() -> Result<NcclProgress> { return NcclProgress::InProgress; }, [] { return okStatus(); },
                       [&] { ++aborts; }, start + 100ms, "init");
  const auto took = Clock::now() - start;
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::Timeout);
  EXPECT_GE(took, 100ms);
  EXPECT_LT(took, 3s);
  EXPECT_EQ(aborts, 1);
}

TEST(AwaitNccl, APeerFailureAbortsLongBeforeTheDeadline) {
  int aborts = 0;
  std::atomic<bool> peer_dead{false};
  std::thread killer([&] {
    std::this_thread::sleep_for(50ms);  // the wait must already be polling; ordering is not asserted
    peer_dead = true;
  });
  const auto start = Clock::now();
  Status s = awaitNccl([]() -> Result<NcclProgress> { return NcclProgress::InProgress; },
                       [&]() -> Status {
                         if (peer_dead) return makeError(ErrorCode::PeerFailed, "rank 3 exited");
                         return okStatus();
                       },
                       [&] { ++aborts; }, start + 60s, "allreduce", 5ms);
  killer.join();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::PeerFailed);
  EXPECT_NE(s.error().message.find("rank 3 exited"), std::string::npos);
  EXPECT_LT(Clock::now() - start, 30s);
  EXPECT_EQ(aborts, 1);
}

TEST(JoinDeviceGroup, OnlyCudaGroupsOfSeveralRanksJoinAndEachRankTakesItsLocalDevice) {
  FakeNccl nccl;
  FakeFactory factory(nccl);
  auto single = createLoopbackGroup(1);
  auto none = joinDeviceGroup(*single[0], 0, 0, 1, 1s, &factory);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, nullptr);  // one rank: no collective to make
  auto pair = createLoopbackGroup(2);
  std::vector<std::optional<Result<std::unique_ptr<Communicator>>>> got(2);
  for (int first_device : {-1, 2}) {  // cpu, then cuda:2
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        FakeFactory f(nccl);
        got[r] = joinDeviceGroup(*pair[r], first_device, r, 9, 1s, &f);
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(got[r]->ok()) << got[r]->error().toString();
      EXPECT_EQ(**got[r] == nullptr, first_device < 0) << first_device;
    }
  }
  ASSERT_EQ(nccl.joins.size(), 2U);  // the CPU round joined nothing
  for (const auto& j : nccl.joins) EXPECT_EQ(j.device, 2 + j.rank);
}

TEST(NcclFactory, WithoutADeviceOrNcclItSaysUnsupported) {
  // This machine has no GPU (the GPU machine's tests are under tests/gpu): the real factory
  // refuses at once, whichever way the binary was built.
  auto factory = ncclCommunicatorFactory();
  auto id = factory->makeId();
  if (id.ok()) GTEST_SKIP() << "a CUDA device is visible: covered by the gpu tests";
  EXPECT_EQ(id.error().code, ErrorCode::Unsupported) << id.error().toString();
  auto joined = factory->join(testId(1), 0, 1, 0, Clock::now() + 1s, [] { return okStatus(); });
  ASSERT_FALSE(joined.ok());
  EXPECT_EQ(joined.error().code, ErrorCode::Unsupported);
}

}  // namespace
}  // namespace pd::comm
