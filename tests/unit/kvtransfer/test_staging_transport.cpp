// The staging KV path (docs/kv-transfer.md, "Staging path"): its two allocators, the host copier,
// and StagingTransport over the loopback fake with host memory standing in for the device. The
// decorator must keep the Transport contract (bytes land where the pool's layout says, one answer
// per transfer and receive) while every byte goes through its staging buffers, and keep staging
// blocks that a late sender may still write out of use.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <future>
#include <mutex>

#include "fakes/loopback_transport.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/kvtransfer/staging_transport.h"
#include "pd/kvtransfer/ucx_transport.h"
#include "staging/staging_arena.h"
#include "staging/staging_block_pool.h"
#include "unit/kvtransfer/kv_test_util.h"

namespace pd::kvtransfer {
namespace {

using fakes::LoopbackFabric;
using fakes::LoopbackTransport;
using staging::StagingArena;
using staging::StagingBlockPool;
using testutil::KvPool;
using testutil::SourceKv;
using testutil::tid;

// ---- the allocators ----------------------------------------------------------------------------

TEST(StagingArenaTest, FirstFitAndNeighboursMergeOnRelease) {
  StagingArena arena(100);
  EXPECT_EQ(arena.allocate(30), 0U);
  EXPECT_EQ(arena.allocate(30), 30U);
  EXPECT_EQ(arena.allocate(30), 60U);
  EXPECT_EQ(arena.allocate(11), std::nullopt);  // 10 left
  EXPECT_EQ(arena.used(), 90U);
  arena.release(30);
  EXPECT_EQ(arena.largestFree(), 30U);
  EXPECT_EQ(arena.allocate(40), std::nullopt);  // 30 + 10 free, not contiguous
  arena.release(60);                            // merges 30..60 with 60..100
  EXPECT_EQ(arena.largestFree(), 70U);
  EXPECT_EQ(arena.allocate(70), 30U);
  arena.release(0);
  arena.release(30);
  EXPECT_EQ(arena.used(), 0U);
  EXPECT_EQ(arena.largestFree(), 100U);
  EXPECT_EQ(arena.allocate(0), std::nullopt);
  EXPECT_EQ(arena.allocate(101), std::nullopt);
}

TEST(StagingBlockPoolTest, HandsOutLowestIdsAndKeepsQuarantinedBlocksUntilTheirEnd) {
  StagingBlockPool pool(4);
  const auto t0 = StagingBlockPool::Clock::time_point{} + std::chrono::hours(1);
  auto a = pool.allocate(2, t0);
  ASSERT_TRUE(a);
  EXPECT_EQ(*a, (std::vector<std::uint32_t>{0, 1}));
  auto b = pool.allocate(2, t0);
  ASSERT_TRUE(b);
  EXPECT_EQ(*b, (std::vector<std::uint32_t>{2, 3}));
  EXPECT_FALSE(pool.allocate(1, t0));

  pool.quarantine(*a, t0 + std::chrono::seconds(10));
  pool.release(*b);
  EXPECT_EQ(pool.freeBlocks(), 2U);
  EXPECT_EQ(pool.quarantinedBlocks(), 2U);
  EXPECT_FALSE(pool.allocate(3, t0 + std::chrono::seconds(9)));  // 0 and 1 still quarantined
  auto c = pool.allocate(3, t0 + std::chrono::seconds(10));      // the quarantine ended
  ASSERT_TRUE(c);
  EXPECT_EQ(*c, (std::vector<std::uint32_t>{0, 1, 2}));
  EXPECT_EQ(pool.quarantinedBlocks(), 0U);
  EXPECT_EQ(pool.freeBlocks(), 1U);
}

TEST(HostCopierTest, CopiesEveryBatchInOrderAndAnswersEachOnce) {
  auto copier = createHostCopier();
  std::vector<std::byte> src(64), dst(64, std::byte{0});
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(i + 1);
  std::mutex mutex;
  std::vector<int> order;
  std::promise<void> all;
  for (int batch = 0; batch < 4; ++batch) {
    std::vector<CopySpan> spans{{dst.data() + batch * 16, src.data() + batch * 16, 8},
                                {dst.data() + batch * 16 + 8, src.data() + batch * 16 + 8, 8}};
    ASSERT_TRUE(copier
                    ->copy(CopyDirection::DeviceToHost, std::move(spans),
                           [&, batch](Status s) {
                             EXPECT_TRUE(s.ok());
                             std::lock_guard lock(mutex);
                             order.push_back(batch);
                             if (order.size() == 4) all.set_value();
                           })
                    .ok());
  }
  all.get_future().wait();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(src, dst);
  auto memory = copier->allocateHost(32);
  ASSERT_TRUE(memory.ok());
  EXPECT_EQ(memory->span().size(), 32U);
  EXPECT_TRUE(std::all_of(memory->span().begin(), memory->span().end(), [](std::byte b) { return b == std::byte{0}; }));
}

TEST(KvTransferPathTest, AutoIsDirectUnlessADevicePoolMeetsATransportWithoutDeviceMemory) {
  using S = KvTransferPathSetting;
  EXPECT_EQ(resolveKvTransferPath(S::Auto, false, false), KvTransferPath::Direct);
  EXPECT_EQ(resolveKvTransferPath(S::Auto, true, true), KvTransferPath::Direct);
  EXPECT_EQ(resolveKvTransferPath(S::Auto, true, false), KvTransferPath::Staging);
  EXPECT_EQ(resolveKvTransferPath(S::Staging, false, true), KvTransferPath::Staging);
  EXPECT_EQ(resolveKvTransferPath(S::Direct, true, false), KvTransferPath::Direct);
  EXPECT_EQ(parseKvTransferPath("staging").value(), S::Staging);
  EXPECT_EQ(parseKvTransferPath("gpu").error().code, ErrorCode::InvalidArgument);
  KvTransferConfig cfg;
  cfg.path = "sideways";
  EXPECT_EQ(validate(cfg).error().code, ErrorCode::InvalidArgument);
}

// A KV pool in GPU memory (the CUDA engine's device pool) with kvtransfer.path direct on a UCX that
// cannot register GPU memory (this machine's: tcp, sm) is refused at startup, naming the fix: UCX
// would take the GPU addresses for host memory.
TEST(KvTransferPathTest, DirectIsRefusedForAGpuPoolWhenUcxCannotRegisterGpuMemory) {
  KvTransferConfig cfg;
  cfg.path = "direct";
  UcxTransportOptions options;
  options.ucx_tls = "tcp";
  options.compat = testutil::realCompat();
  options.name = "gpu-pool";
  auto refused = createKvTransport(cfg, options, KvTransportUse::Receive, /*pool_in_device_memory=*/true);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, ErrorCode::Unsupported);
  EXPECT_NE(refused.error().message.find("use kvtransfer.path staging or auto"), std::string::npos)
      << refused.error().message;
  auto host = createKvTransport(cfg, options, KvTransportUse::Receive, /*pool_in_device_memory=*/false);
  ASSERT_TRUE(host.ok()) << host.error().toString();
  EXPECT_EQ(host->path, KvTransferPath::Direct);
}

// ---- StagingTransport over the loopback fake ---------------------------------------------------

/// A copier that holds every batch until the test releases it, then copies and answers on the
/// test's thread: copies end exactly where the test says.
class GatedCopier final : public DeviceCopier {
 public:
  struct State {
    std::mutex mutex;
    std::deque<std::pair<std::vector<CopySpan>, CopyDoneFn>> held;
  };
  explicit GatedCopier(std::shared_ptr<State> state) : state_(std::move(state)) {}
  ~GatedCopier() override {
    std::deque<std::pair<std::vector<CopySpan>, CopyDoneFn>> held;
    {
      std::lock_guard lock(state_->mutex);
      held.swap(state_->held);
    }
    for (auto& [spans, fn] : held) fn(makeError(ErrorCode::Cancelled, "gated copier shut down"));
  }
  GatedCopier(const GatedCopier&) = delete;
  GatedCopier& operator=(const GatedCopier&) = delete;
  GatedCopier(GatedCopier&&) = delete;
  GatedCopier& operator=(GatedCopier&&) = delete;

  [[nodiscard]] std::string name() const override { return "gated"; }
  Result<StagingMemory> allocateHost(std::size_t bytes) override {
    return StagingMemory(new std::byte[bytes == 0 ? 1 : bytes](), bytes, [](std::byte* p) noexcept { delete[] p; });
  }
  Status copy(CopyDirection /*direction*/, std::vector<CopySpan> spans, CopyDoneFn on_done) override {
    std::lock_guard lock(state_->mutex);
    state_->held.emplace_back(std::move(spans), std::move(on_done));
    return okStatus();
  }

  /// Runs the held batches (and those their callbacks queue); how many ran.
  static int releaseAll(State& state) {
    int n = 0;
    for (;;) {
      std::pair<std::vector<CopySpan>, CopyDoneFn> job;
      {
        std::lock_guard lock(state.mutex);
        if (state.held.empty()) return n;
        job = std::move(state.held.front());
        state.held.pop_front();
      }
      for (const auto& s : job.first) std::memcpy(s.dst, s.src, s.bytes);
      job.second(okStatus());
      ++n;
    }
  }
  static std::size_t heldCount(State& state) {
    std::lock_guard lock(state.mutex);
    return state.held.size();
  }

 private:
  std::shared_ptr<State> state_;
};

struct Outcomes {
  std::mutex mutex;
  std::vector<std::pair<std::uint64_t, Status>> done;
  std::vector<std::pair<std::uint64_t, Result<CompletionRecord>>> arrived;
  TransferDoneFn onDone() {
    return [this](const TransferId& id, Status s) {
      std::lock_guard lock(mutex);
      done.emplace_back(id.lo, std::move(s));
    };
  }
  ArrivalFn onArrival() {
    return [this](std::uint64_t id, Result<CompletionRecord> r) {
      std::lock_guard lock(mutex);
      arrived.emplace_back(id, std::move(r));
    };
  }
  std::size_t doneCount() {
    std::lock_guard lock(mutex);
    return done.size();
  }
  std::size_t arrivedCount() {
    std::lock_guard lock(mutex);
    return arrived.size();
  }
};

constexpr std::uint32_t kStagingBlocks = 4;
constexpr auto kQuarantine = std::chrono::seconds(30);

class StagingTest : public ::testing::Test {
 protected:
  // Sender and receiver each wrap a loopback transport; the copiers are gated, time is fake.
  StagingTest() {
    StagingTransportOptions send;
    send.send_bytes = 2 * std::uint64_t{compat_.num_layers} * 10 * compat_.tokenBytes();  // two 10-token prompts
    sender_ = createStagingTransport(std::make_unique<LoopbackTransport>(fabric_, compat_),
                                     std::make_unique<GatedCopier>(send_copies_), send)
                  .value();
    StagingTransportOptions receive;
    receive.receive_blocks = kStagingBlocks;
    receive.quarantine = kQuarantine;
    receive.now = [this] { return now_; };
    auto inner = std::make_unique<LoopbackTransport>(fabric_, compat_);
    decode_inner_ = inner.get();
    receiver_ =
        createStagingTransport(std::move(inner), std::make_unique<GatedCopier>(receive_copies_), receive).value();
  }

  // Runs every held copy on both sides until none is left.
  void copyAll() {
    while (GatedCopier::releaseAll(*send_copies_) + GatedCopier::releaseAll(*receive_copies_) > 0) {
    }
  }

  // Expects, grants and begins request `n` of `tokens` into pool blocks `blocks`; the granted
  // descriptor.
  KvDescriptor open(KvPool& pool, std::uint64_t n, std::uint32_t tokens, std::vector<std::uint32_t> blocks) {
    const auto deadline = Clock::now() + testutil::kHangGuard;
    EXPECT_TRUE(receiver_->expect(n, deadline, out_.onArrival()).ok());
    auto granted = receiver_->grant(n, pool.descriptor(n, tokens, std::move(blocks), 1000).value());
    EXPECT_TRUE(granted.ok()) << granted.error().toString();
    EXPECT_TRUE(sender_->beginTransfer(granted.value(), deadline, out_.onDone()).ok());
    return granted.value();
  }

  static CompletionRecord record(std::uint64_t n, std::uint32_t tokens) {
    CompletionRecord rec;
    rec.transfer_id = tid(n);
    rec.num_tokens = tokens;
    rec.first_token = static_cast<TokenId>(100 + n);
    return rec;
  }

  Outcomes out_;  // first: the transports answer into it when destroyed
  std::shared_ptr<GatedCopier::State> send_copies_ = std::make_shared<GatedCopier::State>();
  std::shared_ptr<GatedCopier::State> receive_copies_ = std::make_shared<GatedCopier::State>();
  Clock::time_point now_ = Clock::now();
  std::shared_ptr<LoopbackFabric> fabric_ = std::make_shared<LoopbackFabric>();
  CompatInfo compat_ = testutil::smallCompat();
  LoopbackTransport* decode_inner_ = nullptr;  // owned by receiver_
  std::unique_ptr<StagingTransport> sender_;
  std::unique_ptr<StagingTransport> receiver_;
};

TEST_F(StagingTest, KvLandsInThePoolThroughStagingBlocksBeforeTheRecordIsHonoured) {
  KvPool pool(*receiver_, compat_, 8);
  SourceKv source(compat_, 10, 5);
  const RegionId src = sender_->registerRegion(source.bytes).value();
  const KvDescriptor granted = open(pool, 1, 10, {6, 0, 3});
  // The descriptor that goes out names staging blocks in its target; its block ids stay the pool's.
  ASSERT_EQ(granted.targets.size(), 1U);
  EXPECT_EQ(granted.targets[0].block_ids, (std::vector<std::uint32_t>{0, 1, 2}));
  EXPECT_EQ(granted.block_ids, (std::vector<std::uint32_t>{6, 0, 3}));
  EXPECT_EQ(receiver_->stagingStats().receive_blocks_free, kStagingBlocks - 3);

  ASSERT_TRUE(sender_->put(tid(1), source.chunkPuts(src, 0, 6)).ok());
  ASSERT_TRUE(sender_->put(tid(1), source.chunkPuts(src, 6, 4)).ok());
  ASSERT_TRUE(sender_->finish(record(1, 10)).ok());
  // Nothing has been copied out of the "device" yet: the record waits behind the copies.
  EXPECT_EQ(out_.doneCount(), 0U);
  EXPECT_EQ(GatedCopier::heldCount(*send_copies_), 2U);
  EXPECT_EQ(GatedCopier::releaseAll(*send_copies_), 2);
  // The record reached the receiver; the copy into the pool is held, so nothing is delivered.
  ASSERT_EQ(out_.doneCount(), 1U);
  EXPECT_TRUE(out_.done[0].second.ok());
  EXPECT_EQ(out_.arrivedCount(), 0U);
  EXPECT_NE(pool.verify(pool.descriptor(1, 10, {6, 0, 3}, 1000).value(), 5), "");
  EXPECT_EQ(GatedCopier::releaseAll(*receive_copies_), 1);

  ASSERT_EQ(out_.arrivedCount(), 1U);
  ASSERT_TRUE(out_.arrived[0].second.ok());
  EXPECT_EQ(out_.arrived[0].second->first_token, 101);
  EXPECT_EQ(pool.verify(pool.descriptor(1, 10, {6, 0, 3}, 1000).value(), 5), "");
  const StagingStats s = receiver_->stagingStats();
  EXPECT_EQ(s.receive_blocks_free, kStagingBlocks);
  EXPECT_EQ(s.bytes_staged_in, std::uint64_t{compat_.num_layers} * 10 * compat_.tokenBytes());
  EXPECT_EQ(sender_->stagingStats().send_reserved_bytes, 0U);
  EXPECT_EQ(sender_->stagingStats().bytes_staged_out, std::uint64_t{compat_.num_layers} * 10 * compat_.tokenBytes());
  EXPECT_TRUE(sender_->deregisterRegion(src).ok());
  EXPECT_NE(receiver_->capabilities().name.find("staging(gated) over loopback"), std::string::npos);
}

// Decode-side prefix reuse: the leading blocks the decode worker already holds (present_tokens)
// are shared and read-only. Nothing is sent for them, so the copy from the staging blocks into the
// pool must skip them too (a copy of the never-written staging block would overwrite shared KV).
TEST_F(StagingTest, PresentBlocksAreNeitherSentNorOverwrittenByTheCopyIntoThePool) {
  KvPool pool(*receiver_, compat_, 8);
  SourceKv source(compat_, 10, 5);
  const RegionId src = sender_->registerRegion(source.bytes).value();
  const auto deadline = Clock::now() + testutil::kHangGuard;
  ASSERT_TRUE(receiver_->expect(1, deadline, out_.onArrival()).ok());
  KvDescriptor d = pool.descriptor(1, 10, {6, 0, 3}, 1000).value();
  d.present_tokens = compat_.block_size;  // pool block 6 is held already
  auto granted = receiver_->grant(1, d);
  ASSERT_TRUE(granted.ok()) << granted.error().toString();
  EXPECT_EQ(granted->present_tokens, compat_.block_size);
  ASSERT_TRUE(sender_->beginTransfer(*granted, deadline, out_.onDone()).ok());
  ASSERT_TRUE(sender_->put(tid(1), source.chunkPuts(src, compat_.block_size, 10 - compat_.block_size)).ok());
  ASSERT_TRUE(sender_->finish(record(1, 10)).ok());
  copyAll();
  ASSERT_EQ(out_.arrivedCount(), 1U);
  ASSERT_TRUE(out_.arrived[0].second.ok()) << out_.arrived[0].second.error().toString();
  for (std::uint32_t l = 0; l < compat_.num_layers; ++l) {
    EXPECT_TRUE(pool.blockUntouched(l, 6)) << "layer " << l;
    EXPECT_FALSE(pool.blockUntouched(l, 0)) << "layer " << l;
    EXPECT_FALSE(pool.blockUntouched(l, 3)) << "layer " << l;
  }
  EXPECT_EQ(receiver_->stagingStats().bytes_staged_in,
            std::uint64_t{compat_.num_layers} * (10 - compat_.block_size) * compat_.tokenBytes());
  EXPECT_TRUE(sender_->deregisterRegion(src).ok());
}

TEST_F(StagingTest, AFullStagingBufferQueuesTransfersInsteadOfGrowing) {
  // Room for two 10-token prompts: the third waits until one of them is answered.
  KvPool pool(*receiver_, compat_, 16);
  std::vector<std::unique_ptr<SourceKv>> sources;
  std::vector<RegionId> regions;
  const std::vector<std::vector<std::uint32_t>> blocks = {{0, 1, 2}, {3, 4, 5}, {6, 7, 8}};
  for (std::uint64_t n = 1; n <= 3; ++n) {
    sources.push_back(std::make_unique<SourceKv>(compat_, 10, n));
    regions.push_back(sender_->registerRegion(sources.back()->bytes).value());
  }
  // The receiver has 4 staging blocks: a second 3-block receive cannot be granted while the first
  // holds its blocks.
  ASSERT_TRUE(receiver_->expect(1, Clock::now() + testutil::kHangGuard, out_.onArrival()).ok());
  ASSERT_TRUE(receiver_->grant(1, pool.descriptor(1, 10, blocks[0], 1000).value()).ok());
  ASSERT_TRUE(receiver_->expect(2, Clock::now() + testutil::kHangGuard, out_.onArrival()).ok());
  EXPECT_EQ(receiver_->grant(2, pool.descriptor(2, 10, blocks[1], 1000).value()).error().code, ErrorCode::Overloaded);
  EXPECT_TRUE(receiver_->cancelExpect(2));

  // The sender's limit, alone: three transfers to three receivers of their own.
  StagingTransportOptions receive;
  receive.receive_blocks = 16;
  std::vector<std::unique_ptr<StagingTransport>> others;
  std::vector<std::unique_ptr<KvPool>> other_pools;
  for (std::uint64_t n = 11; n <= 13; ++n) {
    auto other =
        createStagingTransport(std::make_unique<LoopbackTransport>(fabric_, compat_), createHostCopier(), receive);
    ASSERT_TRUE(other.ok());
    others.push_back(std::move(*other));
    other_pools.push_back(std::make_unique<KvPool>(*others.back(), compat_, 16));
    ASSERT_TRUE(others.back()->expect(n, Clock::now() + testutil::kHangGuard, out_.onArrival()).ok());
    auto granted = others.back()->grant(n, other_pools.back()->descriptor(n, 10, blocks[n - 11], 1000).value());
    ASSERT_TRUE(granted.ok());
    ASSERT_TRUE(sender_->beginTransfer(*granted, Clock::now() + testutil::kHangGuard, out_.onDone()).ok());
    ASSERT_TRUE(sender_->put(tid(n), sources[n - 11]->chunkPuts(regions[n - 11], 0, 10)).ok());
    ASSERT_TRUE(sender_->finish(record(n, 10)).ok());
  }
  EXPECT_EQ(sender_->stagingStats().transfers_waiting, 1U);
  EXPECT_EQ(sender_->stagingStats().send_reserved_bytes, sender_->stagingStats().send_capacity_bytes);
  EXPECT_EQ(GatedCopier::heldCount(*send_copies_), 2U);  // transfer 13's copy is not even queued
  EXPECT_TRUE(testutil::eventually([&] {
    GatedCopier::releaseAll(*send_copies_);
    return out_.doneCount() == 3 && out_.arrivedCount() == 4;  // 3 arrivals + the cancelled one
  }));
  for (const auto& [id, s] : out_.done) EXPECT_TRUE(s.ok()) << id;
  for (std::uint64_t n = 11; n <= 13; ++n) {
    const KvPool& p = *other_pools[n - 11];
    EXPECT_EQ(p.verify(p.descriptor(n, 10, blocks[n - 11], 1000).value(), n - 10), "") << n;
  }
  EXPECT_EQ(sender_->stagingStats().send_reserved_bytes, 0U);
  EXPECT_EQ(sender_->stagingStats().transfers_waiting, 0U);
  // Request 1 never got its KV: end it for the fixture.
  EXPECT_TRUE(receiver_->cancelExpect(1));
  other_pools.clear();  // before the transports they registered with
}

TEST_F(StagingTest, ATransferLargerThanTheStagingBufferIsRefused) {
  KvPool pool(*receiver_, compat_, 16);
  ASSERT_TRUE(receiver_->expect(1, Clock::now() + testutil::kHangGuard, out_.onArrival()).ok());
  auto granted = receiver_->grant(1, pool.descriptor(1, 16, {0, 1, 2, 3}, 1000).value());
  ASSERT_TRUE(granted.ok());
  KvDescriptor big = *granted;
  big.num_tokens = 21;  // 2 * 10 tokens fit
  EXPECT_EQ(sender_->beginTransfer(big, Clock::now() + testutil::kHangGuard, out_.onDone()).error().code,
            ErrorCode::ResourceExhausted);
  EXPECT_TRUE(receiver_->cancelExpect(1));
}

TEST_F(StagingTest, AbortWaitsForRunningCopiesThenReachesTheReceiverAndQuarantinesItsBlocks) {
  KvPool pool(*receiver_, compat_, 8);
  SourceKv source(compat_, 8, 3);
  const RegionId src = sender_->registerRegion(source.bytes).value();
  open(pool, 4, 8, {1, 2});
  ASSERT_TRUE(sender_->put(tid(4), source.chunkPuts(src, 0, 8)).ok());
  ASSERT_TRUE(sender_->abort(tid(4), ErrorCode::Overloaded, "prefill queue full").ok());
  // The receiver heard the failure record; the sender's on_done waits for its running copy.
  ASSERT_EQ(out_.arrivedCount(), 1U);
  EXPECT_EQ(out_.arrived[0].second.error().code, ErrorCode::Overloaded);
  EXPECT_EQ(out_.doneCount(), 0U);
  EXPECT_EQ(sender_->deregisterRegion(src).error().code, ErrorCode::InvalidArgument);  // still read
  copyAll();
  ASSERT_EQ(out_.doneCount(), 1U);
  EXPECT_EQ(out_.done[0].second.error().code, ErrorCode::Cancelled);
  EXPECT_TRUE(sender_->deregisterRegion(src).ok());
  // Not re-armed: its two staging blocks stay out of use for the quarantine.
  EXPECT_EQ(receiver_->stagingStats().receive_blocks_quarantined, 2U);
  EXPECT_EQ(receiver_->stagingStats().receive_blocks_free, kStagingBlocks - 2);
}

TEST_F(StagingTest, AFailureReArmedFromItsCallbackKeepsTheStagingBlocksForTheRetry) {
  KvPool pool(*receiver_, compat_, 8);
  SourceKv source(compat_, 6, 9);
  const RegionId src = sender_->registerRegion(source.bytes).value();
  const auto deadline = Clock::now() + testutil::kHangGuard;
  int failures = 0;
  std::function<void(std::uint64_t, Result<CompletionRecord>)> on_arrival;
  on_arrival = [&](std::uint64_t id, Result<CompletionRecord> r) {
    if (!r.ok() && failures++ == 0) {
      ASSERT_TRUE(receiver_->expect(id, deadline, on_arrival).ok());  // the decode loop's re-arm
      return;
    }
    out_.onArrival()(id, std::move(r));
  };
  ASSERT_TRUE(receiver_->expect(5, deadline, on_arrival).ok());
  const KvDescriptor granted = receiver_->grant(5, pool.descriptor(5, 6, {7, 4}, 1000).value()).value();
  // Attempt 1 fails on the prefill side.
  ASSERT_TRUE(sender_->beginTransfer(granted, deadline, out_.onDone()).ok());
  ASSERT_TRUE(sender_->abort(tid(5), ErrorCode::Internal, "prefill engine failed").ok());
  EXPECT_EQ(failures, 1);
  EXPECT_EQ(receiver_->stagingStats().receive_blocks_quarantined, 0U);
  EXPECT_EQ(receiver_->stagingStats().receive_blocks_free, kStagingBlocks - 2);
  // Attempt 2 (another prefill worker) writes the same staging blocks and succeeds.
  ASSERT_TRUE(sender_->beginTransfer(granted, deadline, out_.onDone()).ok());
  ASSERT_TRUE(sender_->put(tid(5), source.chunkPuts(src, 0, 6)).ok());
  ASSERT_TRUE(sender_->finish(record(5, 6)).ok());
  copyAll();
  ASSERT_EQ(out_.arrivedCount(), 1U);
  EXPECT_TRUE(out_.arrived[0].second.ok());
  EXPECT_EQ(pool.verify(pool.descriptor(5, 6, {7, 4}, 1000).value(), 9), "");
  EXPECT_EQ(receiver_->stagingStats().receive_blocks_free, kStagingBlocks);
}

TEST_F(StagingTest, CancelDuringTheCopyIntoThePoolAnswersCancelledOnlyWhenTheCopyIsOver) {
  KvPool pool(*receiver_, compat_, 8);
  SourceKv source(compat_, 4, 2);
  const RegionId src = sender_->registerRegion(source.bytes).value();
  open(pool, 6, 4, {3});
  ASSERT_TRUE(sender_->put(tid(6), source.chunkPuts(src, 0, 4)).ok());
  ASSERT_TRUE(sender_->finish(record(6, 4)).ok());
  GatedCopier::releaseAll(*send_copies_);
  ASSERT_EQ(GatedCopier::heldCount(*receive_copies_), 1U);  // staging -> pool, held
  EXPECT_TRUE(receiver_->cancelExpect(6));
  EXPECT_EQ(out_.arrivedCount(), 0U);  // the pool is still being written
  GatedCopier::releaseAll(*receive_copies_);
  ASSERT_EQ(out_.arrivedCount(), 1U);
  EXPECT_EQ(out_.arrived[0].second.error().code, ErrorCode::Cancelled);
  // The sender had flushed its record: nothing can land any more, so no quarantine.
  EXPECT_EQ(receiver_->stagingStats().receive_blocks_free, kStagingBlocks);
  EXPECT_FALSE(receiver_->cancelExpect(6));
}

// A receive that expired while its sender still writes: the sender's late bytes land in the
// quarantined staging blocks, which no other request gets until the quarantine ends, and they
// never reach the pool.
TEST_F(StagingTest, LateWritesOfAnExpiredReceiveStayInQuarantinedStagingBlocks) {
  KvPool pool(*receiver_, compat_, 8);
  SourceKv late(compat_, 8, 1);
  SourceKv fresh(compat_, 8, 2);
  const RegionId late_src = sender_->registerRegion(late.bytes).value();
  const RegionId fresh_src = sender_->registerRegion(fresh.bytes).value();
  open(pool, 7, 8, {0, 1});
  decode_inner_->expireDeadlines(Clock::now() + std::chrono::hours(2));  // the receive's deadline
  ASSERT_EQ(out_.arrivedCount(), 1U);
  EXPECT_EQ(out_.arrived[0].second.error().code, ErrorCode::Timeout);
  EXPECT_EQ(receiver_->stagingStats().receive_blocks_quarantined, 2U);

  // Request 8 gets the other two staging blocks; a third request finds none.
  const KvDescriptor b = open(pool, 8, 8, {4, 5});
  EXPECT_EQ(b.targets[0].block_ids, (std::vector<std::uint32_t>{2, 3}));
  ASSERT_TRUE(receiver_->expect(9, Clock::now() + testutil::kHangGuard, out_.onArrival()).ok());
  EXPECT_EQ(receiver_->grant(9, pool.descriptor(9, 4, {6}, 1000).value()).error().code, ErrorCode::Overloaded);

  // The late sender writes request 7's staging blocks now, while request 8 completes.
  ASSERT_TRUE(sender_->put(tid(7), late.chunkPuts(late_src, 0, 8)).ok());
  ASSERT_TRUE(sender_->put(tid(8), fresh.chunkPuts(fresh_src, 0, 8)).ok());
  ASSERT_TRUE(sender_->finish(record(7, 8)).ok());
  ASSERT_TRUE(sender_->finish(record(8, 8)).ok());
  copyAll();
  ASSERT_EQ(out_.arrivedCount(), 2U);
  EXPECT_TRUE(out_.arrived[1].second.ok());
  EXPECT_EQ(out_.arrived[1].first, 8U);
  // Request 8's blocks hold its own KV; request 7's pool blocks were never written.
  EXPECT_EQ(pool.verify(pool.descriptor(8, 8, {4, 5}, 1000).value(), 2), "");

  // The quarantine ends: request 9 gets the blocks request 7 held.
  now_ += kQuarantine;
  auto granted = receiver_->grant(9, pool.descriptor(9, 4, {6}, 1000).value());
  ASSERT_TRUE(granted.ok());
  EXPECT_EQ(granted->targets[0].block_ids, (std::vector<std::uint32_t>{0}));
  EXPECT_EQ(receiver_->stagingStats().receive_blocks_quarantined, 0U);
  EXPECT_TRUE(receiver_->cancelExpect(9));
}

TEST_F(StagingTest, DeadlinesEndBothSidesAndDestructionAnswersWhatIsPending) {
  auto owned_pool = std::make_unique<KvPool>(*receiver_, compat_, 8);
  KvPool& pool = *owned_pool;
  SourceKv source(compat_, 4, 4);
  const RegionId src = sender_->registerRegion(source.bytes).value();
  open(pool, 10, 4, {2});
  ASSERT_TRUE(sender_->put(tid(10), source.chunkPuts(src, 0, 4)).ok());
  fabric_->setSilent(decode_inner_->address(), true);
  GatedCopier::releaseAll(*send_copies_);
  ASSERT_TRUE(sender_->finish(record(10, 4)).ok());
  EXPECT_EQ(out_.doneCount(), 0U);
  decode_inner_->expireDeadlines(Clock::now() + std::chrono::hours(2));
  ASSERT_EQ(out_.arrivedCount(), 1U);
  EXPECT_EQ(out_.arrived[0].second.error().code, ErrorCode::Timeout);

  // Destroying the sender answers its transfer (the silent peer never acknowledged) with
  // Cancelled; a pending receive on the receiver likewise.
  ASSERT_TRUE(receiver_->expect(11, Clock::now() + testutil::kHangGuard, out_.onArrival()).ok());
  owned_pool.reset();  // deregisters through the receiver
  sender_.reset();
  ASSERT_EQ(out_.doneCount(), 1U);
  EXPECT_EQ(out_.done[0].second.error().code, ErrorCode::Cancelled);
  receiver_.reset();
  ASSERT_EQ(out_.arrivedCount(), 2U);
  EXPECT_EQ(out_.arrived[1].second.error().code, ErrorCode::Cancelled);
}

TEST_F(StagingTest, MisuseIsRefused) {
  KvPool pool(*receiver_, compat_, 8);
  EXPECT_EQ(sender_->put(tid(1), {}).error().code, ErrorCode::NotFound);
  EXPECT_EQ(sender_->finish(record(1, 1)).error().code, ErrorCode::NotFound);
  EXPECT_EQ(sender_->abort(tid(1), ErrorCode::Internal, "x").error().code, ErrorCode::NotFound);
  EXPECT_EQ(receiver_->grant(1, pool.descriptor(1, 4, {0}, 1000).value()).error().code, ErrorCode::NotFound);
  ASSERT_TRUE(receiver_->expect(1, Clock::now() + testutil::kHangGuard, out_.onArrival()).ok());
  EXPECT_EQ(receiver_->expect(1, Clock::now(), out_.onArrival()).error().code, ErrorCode::InvalidArgument);
  EXPECT_EQ(receiver_->grant(1, pool.descriptor(1, 4, {99}, 1000).value()).error().code,
            ErrorCode::InvalidArgument);  // a pool block outside the pool
  KvDescriptor elsewhere = pool.descriptor(1, 4, {0}, 1000).value();
  elsewhere.targets[0].worker_address = {9, 9};
  EXPECT_EQ(receiver_->grant(1, elsewhere).error().code, ErrorCode::InvalidArgument);  // no target of ours
  EXPECT_EQ(
      receiver_->grant(1, pool.descriptor(1, 4 * (kStagingBlocks + 1), {0, 1, 2, 3, 4}, 1000).value()).error().code,
      ErrorCode::ResourceExhausted);
  EXPECT_EQ(receiver_->stagingStats().receive_blocks_free, kStagingBlocks);  // nothing leaked
  EXPECT_TRUE(receiver_->cancelExpect(1));
  EXPECT_FALSE(receiver_->cancelExpect(1));
  EXPECT_EQ(sender_->exportTarget(0, {}).error().code, ErrorCode::InvalidArgument);  // does not receive
  const Status sender_expects = sender_->expect(2, Clock::now() + testutil::kHangGuard, out_.onArrival());
  ASSERT_FALSE(sender_expects.ok());
  EXPECT_EQ(sender_expects.error().code, ErrorCode::InvalidArgument);  // nor expect a record
}

// ---- over real UCX, in one process --------------------------------------------------------------

// A DeepSeek-V3-sized prompt (61 layers, 1024 tokens, 72 MB) put in 16 chunks of 64 tokens, as
// prefill does, between two UCX transports over tcp: direct, and with both ends on the staging path
// (host copier threads, UCX progress threads). Every transfer lands bit-exact in its pool; the
// median time from beginTransfer to the receiver's answer is printed for each path.
TEST(StagingOverUcx, APromptLandsBitExactOnBothPathsAndTheTimesArePrinted) {
  const CompatInfo compat = testutil::realCompat();
  constexpr std::uint32_t kTokens = 1024;
  constexpr int kRounds = 5;
  for (const bool staged : {false, true}) {
    const auto make = [&](const char* name, StagingTransportOptions staging) -> std::unique_ptr<Transport> {
      UcxTransportOptions options;
      options.ucx_tls = "tcp";
      options.data_path = KvDataPath::ActiveMessage;
      options.compat = compat;
      options.connect_timeout = testutil::kHangGuard;
      options.name = name;
      auto t = createUcxTransport(options);
      EXPECT_TRUE(t.ok()) << t.error().toString();
      if (!t.ok() || !staged) return t.ok() ? std::move(t).value() : nullptr;
      auto s = createStagingTransport(std::move(t).value(), createHostCopier(), staging);
      EXPECT_TRUE(s.ok()) << s.error().toString();
      return s.ok() ? std::move(s).value() : nullptr;
    };
    testutil::Outcomes out;
    StagingTransportOptions send;
    send.send_bytes = std::uint64_t{compat.num_layers} * kTokens * compat.tokenBytes();
    StagingTransportOptions receive;
    receive.receive_blocks = kTokens / compat.block_size;
    auto sender = make("sender", send);
    auto receiver = make("receiver", receive);
    ASSERT_TRUE(sender && receiver);
    std::vector<double> ms;
    for (int round = 0; round < kRounds; ++round) {
      const std::uint64_t n = 100 + round;
      KvPool pool(*receiver, compat, 2 * kTokens / compat.block_size);
      SourceKv source(compat, kTokens, n);
      const RegionId src = sender->registerRegion(source.bytes).value();
      const KvDescriptor asked =
          pool.descriptor(n, kTokens, testutil::shuffledBlocks(2 * kTokens / compat.block_size, 16, n), 60000).value();
      ASSERT_TRUE(receiver->expect(n, Clock::now() + testutil::kHangGuard, out.onArrival()).ok());
      auto granted = receiver->grant(n, asked);
      ASSERT_TRUE(granted.ok()) << granted.error().toString();
      const auto start = Clock::now();
      ASSERT_TRUE(sender->beginTransfer(*granted, Clock::now() + testutil::kHangGuard, out.onDone()).ok());
      for (std::uint32_t first = 0; first < kTokens; first += 64) {
        ASSERT_TRUE(sender->put(granted->transfer_id, source.chunkPuts(src, first, 64)).ok());
      }
      CompletionRecord rec;
      rec.transfer_id = granted->transfer_id;
      rec.num_tokens = kTokens;
      ASSERT_TRUE(sender->finish(rec).ok());
      const auto arrived = out.waitArrival(n, testutil::kHangGuard);
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
      ASSERT_TRUE(arrived.has_value());
      ASSERT_TRUE(arrived->ok()) << arrived->error().toString();
      const auto done = out.waitDone(granted->transfer_id.lo, testutil::kHangGuard);
      ASSERT_TRUE(done && done->ok());
      EXPECT_EQ(pool.verify(asked, n), "") << (staged ? "staging" : "direct") << " round " << round;
      EXPECT_TRUE(sender->deregisterRegion(src).ok());
    }
    std::sort(ms.begin(), ms.end());
    std::printf(
        "[ MEASURED ] %s path: 1024 tokens x 61 layers (%.1f MB) over UCX tcp/am in one process: median %.1f "
        "ms, min %.1f ms, max %.1f ms (%d rounds)\n",
        staged ? "staging" : "direct",
        static_cast<double>(std::uint64_t{compat.num_layers} * kTokens * compat.tokenBytes()) / 1e6, ms[ms.size() / 2],
        ms.front(), ms.back(), kRounds);
  }
}

}  // namespace
}  // namespace pd::kvtransfer
