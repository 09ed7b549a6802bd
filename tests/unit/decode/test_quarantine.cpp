// The rma late-write guard (decode_engine.h, "Late writes"): with quarantine_late_writes a request
// aborted while its KV is awaited keeps its blocks out of the free list until the transfer's
// record arrives or its deadline (transfer budget + receive grace) passes, so a prefill that is
// still putting cannot write into another request's blocks. Checked on the engine alone, through
// the loop and the loopback fake transport (late puts land only in the quarantined blocks), and on
// a DecodeServer whose data path is rma (/v1/internal/status and /metrics report the blocks). Off
// (the am path) nothing changes: the blocks are freed at once and the expectation cancelled.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "fakes/loopback_transport.h"
#include "pd/common/http_client.h"
#include "pd/common/metrics.h"
#include "pd/common/worker_api.h"
#include "pd/decode/decode_engine.h"
#include "pd/decode/decode_loop.h"
#include "pd/decode/decode_metrics.h"
#include "pd/decode/decode_server.h"
#include "pd/decode/kv_pool.h"
#include "pd/engine/engine.h"
#include "pd/kvtransfer/layout.h"
#include "unit/decode/golden_support.h"

namespace pd::decode {
namespace {

using namespace std::chrono_literals;
using kvtransfer::fakes::LoopbackFabric;
using kvtransfer::fakes::LoopbackTransport;
using test_support::goldenDir;

constexpr auto kWait = 30s;

std::unique_ptr<model::Engine> makeEngine() {
  auto e = model::createCpuEngine(goldenDir() / "tiny-bf16", model::CpuEngineOptions{1, std::nullopt, false});
  PD_CHECK_MSG(e.ok(), "cannot create the engine on the golden model");
  return std::move(e).value();
}

// A stream's end, read by the test thread while the engine (or loop) thread writes it.
class Stream {
 public:
  TokenEventSink sink() {
    return [this](const TokenEvent& e) {
      std::lock_guard lock(mutex_);
      if (e.finish) {
        ++finish_events_;
        finish_ = e.finish;
        done_.notify_all();
      }
    };
  }
  bool waitFinished() {
    std::unique_lock lock(mutex_);
    return done_.wait_for(lock, kWait, [this] { return finish_events_ > 0; });
  }
  std::optional<FinishReason> finish() {
    std::lock_guard lock(mutex_);
    return finish_;
  }
  int finishEvents() {
    std::lock_guard lock(mutex_);
    return finish_events_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  std::optional<FinishReason> finish_;
  int finish_events_ = 0;
};

DecodeRequest request(std::uint64_t id, std::int64_t prompt, std::int64_t max_tokens, Stream& s,
                      Clock::time_point deadline) {
  DecodeRequest r;
  r.id = id;
  r.prompt_tokens = prompt;
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  r.kv_deadline = deadline;
  r.sink = s.sink();
  return r;
}

std::set<std::int32_t> asSet(std::span<const std::int32_t> blocks) {
  return {blocks.begin(), blocks.end()};
}

// ---------------------------------------------------------------------------------------------
// The engine alone: which ends quarantine, what releases it, and what the gauges say.

class QuarantineEngine : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = makeEngine();
    auto p = KvPool::create(engine_->config(), 16, 4, DType::F32);
    ASSERT_TRUE(p.ok());
    pool_ = std::make_unique<KvPool>(std::move(p).value());
  }
  DecodeEngineOptions options(bool quarantine) {
    DecodeEngineOptions o;
    o.metrics = &metrics_;
    o.quarantine_late_writes = quarantine;
    return o;
  }

  std::unique_ptr<model::Engine> engine_;
  std::unique_ptr<KvPool> pool_;
  metrics::Registry registry_;
  DecodeMetrics metrics_{registry_};
};

TEST_F(QuarantineEngine, AnAbortWhileAwaitingKvHoldsTheBlocksUntilTheTransfersRecord) {
  const Clock::time_point t0 = Clock::now();
  DecodeEngine dec(*engine_, *pool_, options(true));
  Stream s1;
  int stops = 0;
  int ends = 0;
  DecodeRequest r = request(1, 10, 6, s1, t0 + 1h);  // 3 blocks of 4 for the prompt
  r.stop_kv_wait = [&stops] { ++stops; };
  r.end_kv_attempts = [&ends] { ++ends; };
  auto b1 = dec.admit(std::move(r));
  ASSERT_TRUE(b1.ok());
  ASSERT_EQ(b1->size(), 3U);
  EXPECT_EQ(dec.blocks().availableBlocks(), 13);

  EXPECT_TRUE(dec.abort(1));
  EXPECT_EQ(s1.finish(), FinishReason::Aborted);  // the stream ends at once
  EXPECT_EQ(dec.numRequests(), 0U);
  EXPECT_EQ(dec.numQuarantined(), 1U);
  EXPECT_EQ(dec.stats().quarantined, 1);
  EXPECT_EQ(stops, 0) << "the expectation must stay armed: its record ends the quarantine";
  EXPECT_EQ(ends, 1);
  EXPECT_EQ(dec.blocks().quarantinedBlocks(), 3);
  EXPECT_EQ(dec.blocks().freeBlocks(), 13);
  EXPECT_EQ(dec.blocks().availableBlocks(), 13);  // quarantined blocks are not available
  EXPECT_FALSE(dec.blocks().isFullyFree());
  EXPECT_EQ(dec.nextKvDeadline(), t0 + 1h);
  DecodeMetrics::Snapshot m = metrics_.snapshot();
  EXPECT_EQ(m.quarantined_blocks, 3);
  EXPECT_EQ(m.free_blocks, 13);
  EXPECT_NE(registry_.render().find("pdserve_kv_blocks_quarantined 3"), std::string::npos);

  // Everything else can be admitted, but never into the quarantined blocks.
  Stream s2;
  auto b2 = dec.admit(request(2, 13 * 4, 1, s2, t0 + 1h));
  ASSERT_TRUE(b2.ok()) << b2.error().toString();
  for (const std::int32_t b : *b2) EXPECT_FALSE(asSet(*b1).contains(b)) << "block " << b << " reused";
  Stream s3;
  auto full = dec.admit(request(3, 1, 1, s3, t0 + 1h));
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.error().code, ErrorCode::Overloaded);

  // The prefill side's failure record (sent after its last put was flushed) ends the quarantine.
  EXPECT_TRUE(dec.onKvReady(1, makeError(ErrorCode::Cancelled, "prefill cancelled")).ok());
  EXPECT_EQ(dec.numQuarantined(), 0U);
  EXPECT_EQ(dec.blocks().quarantinedBlocks(), 0);
  EXPECT_EQ(stops, 0) << "an answered expectation needs no cancel";
  EXPECT_EQ(dec.onKvReady(1, makeError(ErrorCode::Cancelled, "again")).error().code, ErrorCode::NotFound);
  EXPECT_TRUE(dec.abort(2));
  EXPECT_EQ(dec.numQuarantined(), 1U);
  // A completion record ends it as well.
  kvtransfer::CompletionRecord late;
  late.num_tokens = 52;
  EXPECT_TRUE(dec.onKvReady(2, std::move(late)).ok());
  EXPECT_EQ(dec.numQuarantined(), 0U);
  EXPECT_TRUE(dec.blocks().isFullyFree());
  EXPECT_EQ(metrics_.snapshot().quarantined_blocks, 0);
  EXPECT_EQ(metrics_.snapshot().free_blocks, 16);
  EXPECT_EQ(s1.finishEvents(), 1);
  EXPECT_EQ(s2.finishEvents(), 1);
}

TEST_F(QuarantineEngine, TheDeadlineEndsTheQuarantineAndCancelsTheExpectation) {
  const Clock::time_point t0 = Clock::now();
  DecodeEngine dec(*engine_, *pool_, options(true));
  Stream s;
  int stops = 0;
  DecodeRequest r = request(1, 10, 6, s, t0 + 1h);
  r.stop_kv_wait = [&stops] { ++stops; };
  ASSERT_TRUE(dec.admit(std::move(r)).ok());
  Stream waiting;
  ASSERT_TRUE(dec.admit(request(2, 4, 2, waiting, t0 + 2h)).ok());
  EXPECT_TRUE(dec.abort(1));
  EXPECT_EQ(dec.nextKvDeadline(), t0 + 1h);  // the loop wakes up for the quarantine too
  dec.step(t0 + 1h - 1ms);
  EXPECT_EQ(dec.numQuarantined(), 1U);
  dec.step(t0 + 1h);
  EXPECT_EQ(dec.numQuarantined(), 0U);
  EXPECT_EQ(stops, 1);
  EXPECT_EQ(dec.blocks().quarantinedBlocks(), 0);
  EXPECT_EQ(dec.nextKvDeadline(), t0 + 2h);
  EXPECT_TRUE(dec.abort(2));
  dec.step(t0 + 2h);
  EXPECT_TRUE(dec.blocks().isFullyFree());
}

TEST_F(QuarantineEngine, EndsOnTheTransfersOwnOutcomeAreFreedAtOnce) {
  const Clock::time_point t0 = Clock::now();
  DecodeEngine dec(*engine_, *pool_, options(true));
  std::vector<Stream> s(4);
  std::vector<int> stops(4, 0);
  for (std::uint64_t id = 0; id < 4; ++id) {
    // 0: a failure record; 1: a record that does not match; 2: the deadline; 3: an abort after
    // the deadline (the grace has passed: nothing can be in flight).
    const Clock::time_point deadline = id >= 2 ? t0 - 1ms : t0 + 1h;
    DecodeRequest r = request(id, 10, 6, s[id], deadline);
    r.stop_kv_wait = [&stops, id] { ++stops[id]; };
    ASSERT_TRUE(dec.admit(std::move(r)).ok());
  }
  EXPECT_TRUE(dec.onKvReady(0, makeError(ErrorCode::PeerFailed, "prefill died")).ok());
  kvtransfer::CompletionRecord wrong;
  wrong.num_tokens = 3;
  EXPECT_TRUE(dec.onKvReady(1, std::move(wrong)).ok());
  EXPECT_TRUE(dec.abort(3));
  dec.step(t0);
  EXPECT_EQ(dec.numQuarantined(), 0U);
  EXPECT_EQ(dec.stats().quarantined, 0);
  EXPECT_TRUE(dec.blocks().isFullyFree());
  EXPECT_EQ(s[0].finish(), FinishReason::Error);
  EXPECT_EQ(s[1].finish(), FinishReason::Error);
  EXPECT_EQ(s[2].finish(), FinishReason::Error);
  EXPECT_EQ(s[3].finish(), FinishReason::Aborted);
  EXPECT_EQ(stops, (std::vector<int>{1, 1, 1, 1}));  // as on the am path
}

TEST_F(QuarantineEngine, OffTheBlocksAreFreedAtOnceAndReusedFirst) {
  // The am path's behaviour, unchanged — and the hazard the guard exists for: the next
  // admission gets exactly the blocks an rma sender may still be writing.
  const Clock::time_point t0 = Clock::now();
  DecodeEngine dec(*engine_, *pool_, options(false));
  Stream s1;
  Stream s2;
  int stops = 0;
  int ends = 0;
  DecodeRequest r = request(1, 10, 6, s1, t0 + 1h);
  r.stop_kv_wait = [&stops] { ++stops; };
  r.end_kv_attempts = [&ends] { ++ends; };
  auto b1 = dec.admit(std::move(r));
  ASSERT_TRUE(b1.ok());
  EXPECT_TRUE(dec.abort(1));
  EXPECT_EQ(stops, 1);
  EXPECT_EQ(ends, 0);
  EXPECT_EQ(dec.numQuarantined(), 0U);
  EXPECT_TRUE(dec.blocks().isFullyFree());
  auto b2 = dec.admit(request(2, 10, 6, s2, t0 + 1h));
  ASSERT_TRUE(b2.ok());
  EXPECT_EQ(*b2, *b1);
  EXPECT_TRUE(dec.abort(2));
  EXPECT_TRUE(dec.blocks().isFullyFree());
}

TEST_F(QuarantineEngine, DestructionEndsEveryQuarantineAndCancelsItsExpectation) {
  int stops = 0;
  Stream s;
  {
    DecodeEngine dec(*engine_, *pool_, options(true));
    DecodeRequest r = request(1, 10, 6, s, Clock::now() + 1h);
    r.stop_kv_wait = [&stops] { ++stops; };
    ASSERT_TRUE(dec.admit(std::move(r)).ok());
  }  // aborted at destruction: quarantined, then released with the engine
  EXPECT_EQ(s.finish(), FinishReason::Aborted);
  EXPECT_EQ(stops, 1);
  EXPECT_EQ(metrics_.snapshot().quarantined_blocks, 0);
  EXPECT_EQ(metrics_.snapshot().free_blocks, 16);
}

// ---------------------------------------------------------------------------------------------
// Through the loop and the loopback transport: a prefill keeps putting after the abort.

class QuarantineLoop : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = makeEngine();
    auto p = KvPool::create(engine_->config(), 32, 8, DType::F32);
    ASSERT_TRUE(p.ok());
    pool_ = std::make_unique<KvPool>(std::move(p).value());
    compat_ = pool_->compat(0x5eed, 1);
    decode_tx_ = std::make_unique<LoopbackTransport>(fabric_, compat_);
    prefill_tx_ = std::make_unique<LoopbackTransport>(fabric_, compat_);
    auto region = decode_tx_->registerRegion(pool_->memory());
    ASSERT_TRUE(region.ok());
    region_ = *region;
    const kvtransfer::RegionLayout layout = pool_->regionLayout(region_);
    auto target = decode_tx_->exportTarget(0, std::span<const kvtransfer::RegionLayout>(&layout, 1));
    ASSERT_TRUE(target.ok());
    targets_.push_back(*target);
    const ModelConfig& cfg = engine_->config();
    layers_ = cfg.kvLayers();
    dim_ = cfg.latentDim();
    staging_.assign(static_cast<std::size_t>(layers_ * kPrompt * dim_), 7.0F);  // the "late" bytes
    auto staged = prefill_tx_->registerRegion(std::as_writable_bytes(std::span<float>(staging_)));
    ASSERT_TRUE(staged.ok());
    staging_region_ = *staged;
  }
  void TearDown() override {
    EXPECT_TRUE(prefill_tx_->deregisterRegion(staging_region_).ok());
    EXPECT_TRUE(decode_tx_->deregisterRegion(region_).ok());
  }

  DecodeEngineOptions options() {
    DecodeEngineOptions o;
    o.metrics = &metrics_;
    o.quarantine_late_writes = true;
    return o;
  }
  // Puts layer `layer` of the prompt into the descriptor's blocks.
  Status putLayer(const kvtransfer::TransferId& id, std::int64_t layer) {
    kvtransfer::LayerPut put;
    put.slice = kvtransfer::LayerSlice{static_cast<std::uint32_t>(layer), 0, static_cast<std::uint32_t>(kPrompt)};
    put.local_region = staging_region_;
    put.local_offset = static_cast<std::uint64_t>(layer * kPrompt * dim_) * sizeof(float);
    return prefill_tx_->put(id, std::span<const kvtransfer::LayerPut>(&put, 1));
  }
  // True when any value of `blocks` in any layer is nonzero (the pool starts zeroed).
  bool written(std::span<const std::int32_t> blocks) const {
    const model::LatentCacheView& v = pool_->view();
    const auto* base = reinterpret_cast<const float*>(pool_->memory().data());
    const std::uint64_t layer_stride = pool_->layerStride() / sizeof(float);
    const std::uint64_t block_stride = pool_->blockStride() / sizeof(float);
    for (std::int64_t l = 0; l < layers_; ++l) {
      for (const std::int32_t b : blocks) {
        const float* p =
            base + static_cast<std::uint64_t>(l) * layer_stride + static_cast<std::uint64_t>(b) * block_stride;
        const auto n = static_cast<std::size_t>(v.block_size * v.latent_dim);
        if (std::any_of(p, p + n, [](float x) { return x != 0.0F; })) return true;
      }
    }
    return false;
  }
  // The engine's quarantine as the loop thread sees it.
  std::size_t quarantined(DecodeLoop& loop) {
    std::size_t n = 0;
    loop.runOnLoop([&](DecodeEngine& e) { n = e.numQuarantined(); });
    return n;
  }
  bool waitQuarantined(DecodeLoop& loop, std::size_t n) {
    const auto until = Clock::now() + kWait;
    while (quarantined(loop) != n) {
      if (Clock::now() > until) return false;
      std::this_thread::sleep_for(5ms);
    }
    return true;
  }
  static std::vector<std::int32_t> ids(const kvtransfer::KvDescriptor& d) {
    return {d.block_ids.begin(), d.block_ids.end()};
  }

  static constexpr std::int64_t kPrompt = 20;  // 3 blocks of 8
  std::unique_ptr<model::Engine> engine_;
  std::unique_ptr<KvPool> pool_;
  metrics::Registry registry_;
  DecodeMetrics metrics_{registry_};
  std::shared_ptr<LoopbackFabric> fabric_ = std::make_shared<LoopbackFabric>();
  kvtransfer::CompatInfo compat_;
  std::unique_ptr<LoopbackTransport> decode_tx_;
  std::unique_ptr<LoopbackTransport> prefill_tx_;
  kvtransfer::RegionId region_ = 0;
  kvtransfer::RegionId staging_region_ = 0;
  std::vector<kvtransfer::KvTarget> targets_;
  std::int64_t layers_ = 0;
  std::int64_t dim_ = 0;
  std::vector<float> staging_;
};

TEST_F(QuarantineLoop, LatePutsOfAnAbortedRequestLandOnlyInItsQuarantinedBlocks) {
  Stream aborted;
  Stream next;
  {
    DecodeLoop loop(*engine_, *pool_, options());
    auto d1 =
        loop.openStream(request(1, kPrompt, 4, aborted, Clock::now() + kWait), *decode_tx_, compat_, targets_, 30000);
    ASSERT_TRUE(d1.ok()) << d1.error().toString();
    ASSERT_TRUE(
        prefill_tx_->beginTransfer(*d1, kvtransfer::Clock::now() + kWait, [](const kvtransfer::TransferId&, Status) {})
            .ok());
    ASSERT_TRUE(putLayer(d1->transfer_id, 0).ok());

    loop.postAbort(1);  // the router cancels while the prefill is mid-transfer
    ASSERT_TRUE(aborted.waitFinished());
    EXPECT_EQ(aborted.finish(), FinishReason::Aborted);
    EXPECT_EQ(quarantined(loop), 1U);
    EXPECT_EQ(metrics_.snapshot().quarantined_blocks, static_cast<std::int64_t>(d1->block_ids.size()));

    // The next request gets other blocks; the late puts of request 1 do not touch them.
    auto d2 =
        loop.openStream(request(2, kPrompt, 4, next, Clock::now() + kWait), *decode_tx_, compat_, targets_, 30000);
    ASSERT_TRUE(d2.ok()) << d2.error().toString();
    for (const std::uint32_t b : d2->block_ids) {
      EXPECT_EQ(std::count(d1->block_ids.begin(), d1->block_ids.end(), b), 0) << "block " << b << " reused";
    }
    for (std::int64_t l = 1; l < layers_; ++l) ASSERT_TRUE(putLayer(d1->transfer_id, l).ok());
    EXPECT_TRUE(written(ids(*d1)));
    EXPECT_FALSE(written(ids(*d2))) << "a late put reached another request's blocks";

    // The prefill gives up (router's cancel): its failure record ends the quarantine.
    ASSERT_TRUE(prefill_tx_->abort(d1->transfer_id, ErrorCode::Cancelled, "cancelled by the router").ok());
    ASSERT_TRUE(waitQuarantined(loop, 0));
    EXPECT_FALSE(decode_tx_->cancelExpect(1)) << "the expectation outlived the quarantine";
    EXPECT_EQ(metrics_.snapshot().quarantined_blocks, 0);
    loop.postAbort(2);
    ASSERT_TRUE(next.waitFinished());
  }
  EXPECT_EQ(aborted.finishEvents(), 1);
  EXPECT_EQ(next.finishEvents(), 1);
  EXPECT_EQ(metrics_.snapshot().free_blocks, 32);
}

TEST_F(QuarantineLoop, ACompletionRecordOrTheDeadlineEndsTheQuarantine) {
  std::vector<Stream> s(3);
  {
    DecodeLoop loop(*engine_, *pool_, options());
    // 1: the transfer completes after the abort.
    auto d1 =
        loop.openStream(request(1, kPrompt, 4, s[0], Clock::now() + kWait), *decode_tx_, compat_, targets_, 30000);
    ASSERT_TRUE(d1.ok());
    ASSERT_TRUE(
        prefill_tx_->beginTransfer(*d1, kvtransfer::Clock::now() + kWait, [](const kvtransfer::TransferId&, Status) {})
            .ok());
    loop.postAbort(1);
    ASSERT_TRUE(s[0].waitFinished());
    for (std::int64_t l = 0; l < layers_; ++l) ASSERT_TRUE(putLayer(d1->transfer_id, l).ok());
    kvtransfer::CompletionRecord rec;
    rec.transfer_id = d1->transfer_id;
    rec.num_tokens = static_cast<std::uint32_t>(kPrompt);
    ASSERT_TRUE(prefill_tx_->finish(std::move(rec)).ok());
    ASSERT_TRUE(waitQuarantined(loop, 0));

    // 2: attempts remain, but after the abort a failure record is not absorbed any more: it ends
    // the quarantine instead of re-arming the expectation.
    DecodeRequest r2 = request(2, kPrompt, 4, s[1], Clock::now() + kWait);
    r2.prefill_attempts = 3;
    auto d2 = loop.openStream(std::move(r2), *decode_tx_, compat_, targets_, 30000);
    ASSERT_TRUE(d2.ok());
    loop.postAbort(2);
    ASSERT_TRUE(s[1].waitFinished());
    ASSERT_TRUE(
        prefill_tx_->beginTransfer(*d2, kvtransfer::Clock::now() + kWait, [](const kvtransfer::TransferId&, Status) {})
            .ok());
    ASSERT_TRUE(prefill_tx_->abort(d2->transfer_id, ErrorCode::Internal, "prefill failed").ok());
    ASSERT_TRUE(waitQuarantined(loop, 0));
    EXPECT_FALSE(decode_tx_->cancelExpect(2)) << "re-armed after the abort";

    // 3: nothing ever arrives; the loop wakes up at the deadline and cancels the expectation.
    const auto deadline = Clock::now() + 300ms;
    auto d3 = loop.openStream(request(3, kPrompt, 4, s[2], deadline), *decode_tx_, compat_, targets_, 100);
    ASSERT_TRUE(d3.ok());
    loop.postAbort(3);
    ASSERT_TRUE(s[2].waitFinished());
    EXPECT_EQ(quarantined(loop), 1U);
    ASSERT_TRUE(waitQuarantined(loop, 0));
    EXPECT_GE(Clock::now(), deadline);
    EXPECT_FALSE(decode_tx_->cancelExpect(3)) << "the expectation outlived the quarantine";
    bool free = false;
    loop.runOnLoop([&](DecodeEngine& e) { free = e.blocks().isFullyFree(); });
    EXPECT_TRUE(free);
  }
  for (Stream& st : s) {
    EXPECT_EQ(st.finish(), FinishReason::Aborted);
    EXPECT_EQ(st.finishEvents(), 1);
  }
}

// ---------------------------------------------------------------------------------------------
// A decode worker whose data path is rma (real HTTP, real UCX over tcp): a client that goes away
// while its KV is awaited leaves quarantined blocks, reported by /v1/internal/status and
// /metrics, until kv_timeout_ms + receive_grace_ms have passed.

worker_api::WorkerStatus statusOf(const DecodeServer& server) {
  http::Client client("127.0.0.1", server.port());
  http::ClientRequest req;
  req.target = std::string(worker_api::kStatusPath);
  auto r = client.send(req, kWait);
  PD_CHECK_MSG(r.ok() && r->status == 200, "GET /v1/internal/status failed");
  auto s = worker_api::parseWorkerStatus(r->body);
  PD_CHECK_MSG(s.ok(), "bad status body");
  return *s;
}

TEST(QuarantineServer, RmaStatusReportsQuarantinedBlocksUntilTheGracedDeadline) {
  DecodeServerOptions o;
  o.decode.port = 0;
  o.decode.block_size = 8;
  o.decode.num_blocks = 16;
  o.decode.kv_dtype = "f32";
  o.decode.num_speculative_tokens = 0;
  o.decode.threads = 1;
  o.kvtransfer.data_path = "rma";
  o.kvtransfer.ucx_tls = "tcp";
  o.kvtransfer.receive_grace_ms = 1000;
  o.model_hash = 0x1234;
  auto server = DecodeServer::start(makeEngine(), o);
  ASSERT_TRUE(server.ok()) << server.error().toString();
  DecodeServer& srv = **server;

  worker_api::DecodeOpen open;
  open.request_id = "cmpl-gone";
  open.prompt_tokens = 20;  // 3 blocks of 8
  open.max_tokens = 4;
  open.kv_timeout_ms = 1000;
  const auto opened = Clock::now();
  {
    // Read the descriptor line, then close the connection: the client is gone.
    http::Client client("127.0.0.1", srv.port());
    http::ClientRequest req;
    req.method = "POST";
    req.target = std::string(worker_api::kDecodeOpenPath);
    req.body = worker_api::toJson(open);
    auto r = client.streamLines(req, kWait, [](std::string_view) { return false; });
    ASSERT_TRUE(r.ok()) << r.error().toString();
  }
  ASSERT_TRUE(srv.waitIdle(10s));  // the stream ended
  const worker_api::WorkerStatus held = statusOf(srv);
  ASSERT_LT(Clock::now(), opened + 1800ms) << "too slow to see the quarantine";
  {  // well before kv_timeout_ms + receive_grace_ms
    EXPECT_EQ(held.quarantined_blocks, 3);
    EXPECT_EQ(held.free_blocks, 13);
    EXPECT_EQ(held.total_blocks, 16);
    http::Client client("127.0.0.1", srv.port());
    http::ClientRequest req;
    req.target = "/metrics";
    auto m = client.send(req, kWait);
    ASSERT_TRUE(m.ok());
    EXPECT_NE(m->body.find("pdserve_kv_blocks_quarantined 3"), std::string::npos);
  }
  worker_api::WorkerStatus after = held;
  const auto until = Clock::now() + kWait;
  while (after.quarantined_blocks != 0 && Clock::now() < until) {
    std::this_thread::sleep_for(20ms);
    after = statusOf(srv);
  }
  EXPECT_GE(Clock::now(), opened + 2000ms) << "released before the graced deadline";
  EXPECT_EQ(after.quarantined_blocks, 0);
  EXPECT_EQ(after.free_blocks, 16);
  EXPECT_EQ(srv.transportStats().pending_receives, 0);
  srv.stop(0ms);
}

}  // namespace
}  // namespace pd::decode
