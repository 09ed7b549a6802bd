// The decode engine loop thread, fed through the kvtransfer seam: the decode pool is registered
// with a loopback transport, a "prefill worker" in the test puts each layer's latent KV into the
// admitted blocks through the real layout/descriptor code and finishes with a completion record,
// and the loop decodes the golden greedy tokens. Also: deadline, abort and shutdown on the loop.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include "fakes/loopback_transport.h"
#include "pd/decode/decode_loop.h"
#include "pd/decode/kv_pool.h"
#include "pd/engine/engine.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/safetensors.h"
#include "pd/engine/sampling.h"
#include "pd/kvtransfer/layout.h"
#include "unit/decode/golden_support.h"

namespace pd::decode {
namespace {

namespace fs = std::filesystem;
using kvtransfer::fakes::LoopbackFabric;
using kvtransfer::fakes::LoopbackTransport;

using test_support::goldenDir;
using test_support::goldenIds;

constexpr auto kWait = std::chrono::seconds(60);

std::unique_ptr<model::Engine> makeEngine(const std::string& model) {
  auto e = model::createCpuEngine(goldenDir() / model, model::CpuEngineOptions{2, std::nullopt, false});
  PD_CHECK_MSG(e.ok(), "cannot create the engine on the golden model");
  return std::move(e).value();
}

// A stream read by the test thread while the loop thread writes it.
class Stream {
 public:
  TokenEventSink sink() {
    return [this](const TokenEvent& e) {
      std::lock_guard lock(mutex_);
      for (const auto& t : e.tokens) tokens_.push_back(t.token);
      if (e.finish) {
        ++finish_events_;
        finish_ = e.finish;
        error_ = e.error;
      }
      done_.notify_all();
    };
  }
  // Waits for the end of the stream; false on timeout.
  bool waitFinished() {
    std::unique_lock lock(mutex_);
    return done_.wait_for(lock, kWait, [this] { return finish_events_ > 0; });
  }
  std::vector<std::int32_t> tokens() {
    std::lock_guard lock(mutex_);
    return tokens_;
  }
  std::optional<FinishReason> finish() {
    std::lock_guard lock(mutex_);
    return finish_;
  }
  std::optional<Error> error() {
    std::lock_guard lock(mutex_);
    return error_;
  }
  int finishEvents() {
    std::lock_guard lock(mutex_);
    return finish_events_;
  }
  // Waits until the stream has at least `n` tokens; false on timeout.
  bool waitTokens(std::size_t n) {
    std::unique_lock lock(mutex_);
    return done_.wait_for(lock, kWait, [&] { return tokens_.size() >= n; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  std::vector<std::int32_t> tokens_;
  std::optional<FinishReason> finish_;
  std::optional<Error> error_;
  int finish_events_ = 0;
};

// The model engine with a gate (a fake of the layer below the loop): once hold() is called, the
// next forward announces itself (waitEntered) and waits until release(); later forwards pass.
class GatedEngine final : public model::Engine {
 public:
  explicit GatedEngine(model::Engine& inner) : inner_(inner) {}
  [[nodiscard]] const ModelConfig& config() const override { return inner_.config(); }
  [[nodiscard]] model::EngineCapabilities capabilities() const override { return inner_.capabilities(); }
  Result<model::ForwardOutput> forward(std::span<const model::SequenceChunk> batch, const model::LatentCacheView& cache,
                                       const model::ForwardOptions& options) override {
    gate();
    return inner_.forward(batch, cache, options);
  }
  Result<model::ForwardOutput> forwardMtp(std::span<const model::SequenceChunk> batch,
                                          const model::LatentCacheView& cache,
                                          const model::ForwardOptions& options) override {
    gate();
    return inner_.forwardMtp(batch, cache, options);
  }
  void hold() {
    std::lock_guard lock(mutex_);
    held_ = true;
    entered_ = false;
  }
  bool waitEntered() {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, kWait, [this] { return entered_; });
  }
  void release() {
    {
      std::lock_guard lock(mutex_);
      held_ = false;
    }
    changed_.notify_all();
  }

 private:
  void gate() {
    std::unique_lock lock(mutex_);
    if (!held_) return;
    entered_ = true;
    changed_.notify_all();
    changed_.wait(lock, [this] { return !held_; });
  }
  model::Engine& inner_;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool held_ = false;
  bool entered_ = false;
};

// The sending side of one request: layer latents staged contiguously per layer in a registered
// buffer and put into the decode pool as each layer is computed (docs/kv-transfer.md).
class PutSink : public model::LatentKvSink {
 public:
  PutSink(kvtransfer::Transport& tx, kvtransfer::TransferId request_id, std::int64_t layers, std::int64_t tokens,
          std::int64_t dim)
      : tx_(tx),
        request_id_(request_id),
        tokens_(tokens),
        dim_(dim),
        staging_(static_cast<std::size_t>(layers * tokens * dim)) {
    auto r = tx_.registerRegion(std::as_writable_bytes(std::span<float>(staging_)));
    PD_CHECK(r.ok());
    region_ = *r;
  }
  void onLayer(std::int64_t kv_layer, std::size_t /*sequence*/, std::int64_t start_pos,
               std::span<const float> latent) override {
    const auto at = static_cast<std::size_t>((kv_layer * tokens_ + start_pos) * dim_);
    std::memcpy(staging_.data() + at, latent.data(), latent.size_bytes());
    kvtransfer::LayerPut put;
    put.slice = kvtransfer::LayerSlice{static_cast<std::uint32_t>(kv_layer), static_cast<std::uint32_t>(start_pos),
                                       static_cast<std::uint32_t>(latent.size() / static_cast<std::size_t>(dim_))};
    put.local_region = region_;
    put.local_offset = at * sizeof(float);
    const Status s = tx_.put(request_id_, std::span<const kvtransfer::LayerPut>(&put, 1));
    EXPECT_TRUE(s.ok()) << s.error().toString();
  }

 private:
  kvtransfer::Transport& tx_;
  kvtransfer::TransferId request_id_;
  std::int64_t tokens_;
  std::int64_t dim_;
  std::vector<float> staging_;
  kvtransfer::RegionId region_ = 0;
};

// (golden model, overlapped steps: DecodeEngineOptions::overlap_steps)
class DecodeLoopGolden : public ::testing::TestWithParam<std::tuple<std::string, bool>> {
 protected:
  [[nodiscard]] std::string model() const { return std::get<0>(GetParam()); }
  // The loop's options with this case's overlap setting.
  [[nodiscard]] DecodeEngineOptions withOverlap(DecodeEngineOptions o) const {
    o.overlap_steps = std::get<1>(GetParam());
    return o;
  }

 protected:
  void SetUp() override {
    decode_engine_ = makeEngine(model());
    prefill_engine_ = makeEngine(model());
    const fs::path file = goldenDir() / model() / "golden.safetensors";
    prompt_ = goldenIds(file, "p0.tokens");
    greedy_ = goldenIds(file, "p0.greedy");
    auto p = KvPool::create(decode_engine_->config(), 64, 8, DType::F32);
    ASSERT_TRUE(p.ok()) << p.error().toString();
    pool_ = std::make_unique<KvPool>(std::move(p).value());
  }

  // The decode pool registered with `decode_tx` and exported as rank 0's only target; `region`
  // gets the registration, which the test deregisters at its end.
  Result<std::vector<kvtransfer::KvTarget>> exportPool(kvtransfer::Transport& decode_tx,
                                                       kvtransfer::RegionId& region) const {
    PD_ASSIGN_OR_RETURN(region, decode_tx.registerRegion(pool_->memory()));
    const kvtransfer::RegionLayout layout = pool_->regionLayout(region);
    PD_ASSIGN_OR_RETURN(kvtransfer::KvTarget target,
                        decode_tx.exportTarget(0, std::span<const kvtransfer::RegionLayout>(&layout, 1)));
    return std::vector<kvtransfer::KvTarget>{std::move(target)};
  }

  DecodeRequest request(std::uint64_t id, std::int64_t max_tokens, Stream& s) const {
    DecodeRequest r;
    r.id = id;
    r.prompt_tokens = static_cast<std::int64_t>(prompt_.size());
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    r.sink = s.sink();
    return r;
  }

  // The "prefill worker" on the test thread: main model and MTP layer over the prompt in its own
  // cache, each layer put into the descriptor's blocks, then the completion record.
  void shipKv(kvtransfer::Transport& prefill_tx, const kvtransfer::KvDescriptor& desc) {
    const ModelConfig& cfg = decode_engine_->config();
    ASSERT_TRUE(
        prefill_tx.beginTransfer(desc, kvtransfer::Clock::now() + kWait, [](const kvtransfer::TransferId&, Status) {})
            .ok());
    const auto n = static_cast<std::int64_t>(prompt_.size());
    PutSink sink(prefill_tx, desc.transfer_id, cfg.kvLayers(), n, cfg.latentDim());
    auto local = model::PagedLatentCache::create(cfg, 1, n, DType::F32);
    ASSERT_TRUE(local.ok());
    const std::vector<std::int32_t> table{0};
    model::ForwardOptions fo;
    fo.hidden = model::OutputRows::All;
    fo.sink = &sink;
    const model::SequenceChunk chunk{prompt_, 0, table};
    auto out = prefill_engine_->forward(std::span<const model::SequenceChunk>(&chunk, 1), local->view(), fo);
    ASSERT_TRUE(out.ok());
    const auto d = static_cast<std::size_t>(cfg.hidden_size);
    const model::SequenceChunk mtp{std::span<const std::int32_t>(prompt_).subspan(1), 0, table,
                                   std::span<const float>(out->hidden.data(), static_cast<std::size_t>(n - 1) * d)};
    model::ForwardOptions mo;
    mo.logits = model::OutputRows::None;
    mo.sink = &sink;
    ASSERT_TRUE(prefill_engine_->forwardMtp(std::span<const model::SequenceChunk>(&mtp, 1), local->view(), mo).ok());
    kvtransfer::CompletionRecord rec;
    rec.transfer_id = desc.transfer_id;
    rec.num_tokens = static_cast<std::uint32_t>(n);
    rec.first_token = model::argmax(out->logits);
    rec.hidden_state.assign(out->hidden.end() - static_cast<std::ptrdiff_t>(d), out->hidden.end());
    ASSERT_TRUE(prefill_tx.finish(std::move(rec)).ok());
  }

  // A prefill attempt that gives up: its transport sends the failure record.
  static void failAttempt(kvtransfer::Transport& prefill_tx, const kvtransfer::KvDescriptor& desc, ErrorCode code) {
    const Status begun =
        prefill_tx.beginTransfer(desc, kvtransfer::Clock::now() + kWait, [](const kvtransfer::TransferId&, Status) {});
    ASSERT_TRUE(begun.ok()) << begun.error().toString();
    ASSERT_TRUE(prefill_tx.abort(desc.transfer_id, code, "injected prefill failure").ok());
  }

  std::unique_ptr<model::Engine> decode_engine_;
  std::unique_ptr<model::Engine> prefill_engine_;  // the "prefill worker" runs on the test thread
  std::unique_ptr<KvPool> pool_;
  std::vector<std::int32_t> prompt_;
  std::vector<std::int32_t> greedy_;
};

TEST_P(DecodeLoopGolden, KvPutThroughTheTransportThenDecodedEqualsGolden) {
  const ModelConfig& cfg = decode_engine_->config();
  auto fabric = std::make_shared<LoopbackFabric>();
  const kvtransfer::CompatInfo compat = pool_->compat(/*model_hash=*/0x5eed, /*tp_size=*/1);
  LoopbackTransport decode_tx(fabric, compat);
  LoopbackTransport prefill_tx(fabric, compat);
  kvtransfer::RegionId region = 0;
  auto targets = exportPool(decode_tx, region);
  ASSERT_TRUE(targets.ok()) << targets.error().toString();

  Stream stream;
  {
    DecodeLoop loop(*decode_engine_, *pool_, withOverlap(DecodeEngineOptions{1, 8}));
    const std::uint64_t id = 77;
    DecodeRequest r = request(id, static_cast<std::int64_t>(greedy_.size()), stream);
    r.kv_deadline = Clock::now() + kWait;
    auto opened = loop.openStream(std::move(r), decode_tx, compat, *targets, 60000);
    ASSERT_TRUE(opened.ok()) << opened.error().toString();
    const kvtransfer::KvDescriptor& desc = *opened;
    EXPECT_TRUE(kvtransfer::validateDescriptor(desc).ok());
    EXPECT_EQ(desc.num_tokens, prompt_.size());

    std::mutex done_mutex;
    std::optional<Status> sent;
    ASSERT_TRUE(prefill_tx
                    .beginTransfer(desc, kvtransfer::Clock::now() + kWait,
                                   [&](const kvtransfer::TransferId&, Status s) {
                                     std::lock_guard lock(done_mutex);
                                     sent = std::move(s);
                                   })
                    .ok());

    // The prefill worker: main model and MTP layer over the prompt in its own cache.
    const auto n = static_cast<std::int64_t>(prompt_.size());
    PutSink sink(prefill_tx, desc.transfer_id, cfg.kvLayers(), n, cfg.latentDim());
    auto local = model::PagedLatentCache::create(cfg, 1, n, DType::F32);
    ASSERT_TRUE(local.ok());
    const std::vector<std::int32_t> table{0};
    model::ForwardOptions fo;
    fo.hidden = model::OutputRows::All;
    fo.sink = &sink;
    const model::SequenceChunk chunk{prompt_, 0, table};
    auto out = prefill_engine_->forward(std::span<const model::SequenceChunk>(&chunk, 1), local->view(), fo);
    ASSERT_TRUE(out.ok());
    const auto d = static_cast<std::size_t>(cfg.hidden_size);
    const model::SequenceChunk mtp{std::span<const std::int32_t>(prompt_).subspan(1), 0, table,
                                   std::span<const float>(out->hidden.data(), static_cast<std::size_t>(n - 1) * d)};
    model::ForwardOptions mo;
    mo.logits = model::OutputRows::None;
    mo.sink = &sink;
    ASSERT_TRUE(prefill_engine_->forwardMtp(std::span<const model::SequenceChunk>(&mtp, 1), local->view(), mo).ok());
    kvtransfer::CompletionRecord rec;
    rec.transfer_id = desc.transfer_id;
    rec.num_tokens = static_cast<std::uint32_t>(n);
    rec.first_token = model::argmax(out->logits);
    rec.hidden_state.assign(out->hidden.end() - static_cast<std::ptrdiff_t>(d), out->hidden.end());
    ASSERT_TRUE(prefill_tx.finish(std::move(rec)).ok());

    ASSERT_TRUE(stream.waitFinished());
    EXPECT_EQ(stream.tokens(), greedy_);
    EXPECT_EQ(stream.finish(), FinishReason::Length);
    {
      std::lock_guard lock(done_mutex);
      ASSERT_TRUE(sent.has_value());
      EXPECT_TRUE(sent->ok());
    }
    bool free = false;
    loop.runOnLoop([&](DecodeEngine& e) { free = e.blocks().isFullyFree(); });
    EXPECT_TRUE(free);
  }
  EXPECT_EQ(stream.finishEvents(), 1);
  EXPECT_TRUE(decode_tx.deregisterRegion(region).ok());
}

TEST_P(DecodeLoopGolden, AFailedOpenHoldsNothing) {
  auto fabric = std::make_shared<LoopbackFabric>();
  const kvtransfer::CompatInfo compat = pool_->compat(0x5eed, 1);
  // Declared before the loop, so destroyed after it: its pending expectations are answered into
  // a closed inbox (what a worker that stops the loop before the transport does).
  LoopbackTransport decode_tx(fabric, compat);
  Stream refused;
  Stream ok;
  Stream left_open;
  {
    auto small_pool = KvPool::create(decode_engine_->config(), 8, 8, DType::F32);
    ASSERT_TRUE(small_pool.ok());
    DecodeLoop loop(*decode_engine_, *small_pool, withOverlap(DecodeEngineOptions{0, 8}));
    DecodeRequest big = request(1, 40, refused);
    big.prompt_tokens = 8 * 8 + 1;  // the prompt alone is more than 8 blocks of 8
    big.kv_deadline = Clock::now() + kWait;
    auto opened = loop.openStream(std::move(big), decode_tx, compat, {}, 1000);
    ASSERT_FALSE(opened.ok());
    EXPECT_EQ(opened.error().code, ErrorCode::ResourceExhausted);
    EXPECT_FALSE(decode_tx.cancelExpect(1)) << "the refused request's expectation is still armed";
    DecodeRequest small = request(3, 4, ok);
    small.kv_deadline = Clock::now() + kWait;
    auto opened_ok = loop.openStream(std::move(small), decode_tx, compat, {}, 1000);
    ASSERT_TRUE(opened_ok.ok()) << opened_ok.error().toString();
    auto dup = loop.openStream(request(3, 4, refused), decode_tx, compat, {}, 1000);
    ASSERT_FALSE(dup.ok());
    EXPECT_EQ(dup.error().code, ErrorCode::InvalidArgument);
    EXPECT_TRUE(decode_tx.cancelExpect(3));  // the transport gives up: the loop ends the stream
    ASSERT_TRUE(ok.waitFinished());
    EXPECT_EQ(ok.finish(), FinishReason::Error);
    EXPECT_EQ(ok.error()->code, ErrorCode::Cancelled);
    bool free = false;
    loop.runOnLoop([&](DecodeEngine& e) { free = e.blocks().isFullyFree(); });
    EXPECT_TRUE(free);
    // Left pending at shutdown: the loop ends the stream, the transport answers later.
    DecodeRequest pending = request(2, 4, left_open);
    pending.kv_deadline = Clock::now() + kWait;
    ASSERT_TRUE(loop.openStream(std::move(pending), decode_tx, compat, {}, 1000).ok());
  }
  EXPECT_EQ(left_open.finish(), FinishReason::Aborted);
  EXPECT_EQ(refused.finishEvents(), 0);
  EXPECT_EQ(ok.finishEvents(), 1);
}

TEST_P(DecodeLoopGolden, DeadlineAbortAndShutdownEndEveryStreamAndFreeEveryBlock) {
  Stream expires;
  Stream aborted;
  Stream at_shutdown;
  {
    DecodeLoop loop(*decode_engine_, *pool_, withOverlap(DecodeEngineOptions{1, 8}));
    DecodeRequest r = request(1, 8, expires);
    r.kv_deadline = Clock::now() + std::chrono::milliseconds(50);  // the loop wakes up for it
    ASSERT_TRUE(loop.admit(std::move(r)).ok());
    ASSERT_TRUE(loop.admit(request(2, 8, aborted)).ok());
    ASSERT_TRUE(loop.admit(request(3, 8, at_shutdown)).ok());
    loop.postAbort(2);
    ASSERT_TRUE(expires.waitFinished());
    ASSERT_TRUE(aborted.waitFinished());
    EXPECT_EQ(expires.finish(), FinishReason::Error);
    ASSERT_TRUE(expires.error().has_value());
    EXPECT_EQ(expires.error()->code, ErrorCode::Timeout);
    EXPECT_EQ(aborted.finish(), FinishReason::Aborted);
    loop.postKvReady(2, kvtransfer::CompletionRecord{});  // too late: ignored
    std::size_t held = 0;
    std::size_t holding_blocks = 0;
    loop.runOnLoop([&](DecodeEngine& e) {
      held = e.numRequests();
      holding_blocks = e.blocks().numRequests();
    });
    EXPECT_EQ(held, 1U);
    EXPECT_EQ(holding_blocks, 1U);  // the expired and the aborted request gave theirs back
  }
  EXPECT_EQ(at_shutdown.finish(), FinishReason::Aborted);
  for (Stream* s : {&expires, &aborted, &at_shutdown}) EXPECT_EQ(s->finishEvents(), 1);
  // Shutdown released request 3's blocks too: ~DecodeEngine aborts it through a PD_CHECKed release.
}

// Prefill retries (docs/internal-api.md): a failure record while attempts remain keeps the
// blocks and re-arms the same transfer id; the next attempt on the same descriptor decodes.
TEST_P(DecodeLoopGolden, AFailureRecordWhileAttemptsRemainKeepsTheBlocksForTheNextAttempt) {
  auto fabric = std::make_shared<LoopbackFabric>();
  const kvtransfer::CompatInfo compat = pool_->compat(0x5eed, 1);
  LoopbackTransport decode_tx(fabric, compat);
  LoopbackTransport prefill_a(fabric, compat);
  LoopbackTransport prefill_b(fabric, compat);
  kvtransfer::RegionId region = 0;
  auto targets = exportPool(decode_tx, region);
  ASSERT_TRUE(targets.ok()) << targets.error().toString();
  Stream stream;
  {
    DecodeLoop loop(*decode_engine_, *pool_, withOverlap(DecodeEngineOptions{1, 8, nullptr}));
    DecodeRequest r = request(5, static_cast<std::int64_t>(greedy_.size()), stream);
    r.kv_deadline = Clock::now() + kWait;
    r.prefill_attempts = 3;
    auto opened = loop.openStream(std::move(r), decode_tx, compat, *targets, 60000);
    ASSERT_TRUE(opened.ok()) << opened.error().toString();
    std::vector<std::int32_t> held;
    const auto snapshot = [&] {
      std::int64_t retries = 0;
      loop.runOnLoop([&](DecodeEngine& e) {
        const auto table = e.blocks().blockTable(5);
        held.assign(table.begin(), table.end());
        retries = e.stats().prefill_retries;
      });
      return retries;
    };
    snapshot();
    const std::vector<std::int32_t> admitted = held;
    // Two attempts fail (different codes), each absorbed: same blocks, stream still open.
    failAttempt(prefill_a, *opened, ErrorCode::PeerFailed);
    failAttempt(prefill_a, *opened, ErrorCode::Cancelled);
    EXPECT_EQ(snapshot(), 2);
    EXPECT_EQ(held, admitted);
    EXPECT_EQ(stream.finishEvents(), 0);
    EXPECT_TRUE(stream.tokens().empty());
    // The third attempt, from another prefill worker, completes on the same descriptor.
    shipKv(prefill_b, *opened);
    ASSERT_TRUE(stream.waitFinished());
    EXPECT_EQ(stream.tokens(), greedy_);
    EXPECT_EQ(stream.finish(), FinishReason::Length);
    bool free = false;
    loop.runOnLoop([&](DecodeEngine& e) { free = e.blocks().isFullyFree(); });
    EXPECT_TRUE(free);
  }
  EXPECT_FALSE(decode_tx.cancelExpect(5)) << "an expectation outlived the request";
  EXPECT_TRUE(decode_tx.deregisterRegion(region).ok());
}

TEST_P(DecodeLoopGolden, TheLastAttemptsFailureAndTheDeadlineEndTheRequest) {
  auto fabric = std::make_shared<LoopbackFabric>();
  const kvtransfer::CompatInfo compat = pool_->compat(0x5eed, 1);
  LoopbackTransport decode_tx(fabric, compat);
  LoopbackTransport prefill_tx(fabric, compat);
  kvtransfer::RegionId region = 0;
  auto targets = exportPool(decode_tx, region);
  ASSERT_TRUE(targets.ok()) << targets.error().toString();
  Stream out_of_attempts;
  Stream deadline;
  Stream aborted;
  {
    DecodeLoop loop(*decode_engine_, *pool_, withOverlap(DecodeEngineOptions{0, 8, nullptr}));
    // Two attempts: the second failure ends the stream with that failure's code.
    DecodeRequest a = request(1, 4, out_of_attempts);
    a.kv_deadline = Clock::now() + kWait;
    a.prefill_attempts = 2;
    auto da = loop.openStream(std::move(a), decode_tx, compat, *targets, 60000);
    ASSERT_TRUE(da.ok());
    failAttempt(prefill_tx, *da, ErrorCode::Internal);
    EXPECT_EQ(out_of_attempts.finishEvents(), 0);
    failAttempt(prefill_tx, *da, ErrorCode::PeerFailed);
    ASSERT_TRUE(out_of_attempts.waitFinished());
    EXPECT_EQ(out_of_attempts.finish(), FinishReason::Error);
    EXPECT_EQ(out_of_attempts.error()->code, ErrorCode::PeerFailed);
    // The deadline covers every attempt: after an absorbed failure the original deadline holds.
    DecodeRequest b = request(2, 4, deadline);
    b.kv_deadline = Clock::now() + std::chrono::milliseconds(200);
    b.prefill_attempts = 5;
    auto db = loop.openStream(std::move(b), decode_tx, compat, *targets, 200);
    ASSERT_TRUE(db.ok());
    failAttempt(prefill_tx, *db, ErrorCode::Internal);
    ASSERT_TRUE(deadline.waitFinished());
    EXPECT_EQ(deadline.error()->code, ErrorCode::Timeout);
    // Aborted while attempts remain: the expectation is cancelled, not re-armed.
    DecodeRequest c = request(3, 4, aborted);
    c.kv_deadline = Clock::now() + kWait;
    c.prefill_attempts = 5;
    auto dc = loop.openStream(std::move(c), decode_tx, compat, *targets, 60000);
    ASSERT_TRUE(dc.ok());
    loop.postAbort(3);
    ASSERT_TRUE(aborted.waitFinished());
    EXPECT_EQ(aborted.finish(), FinishReason::Aborted);
    EXPECT_FALSE(decode_tx.cancelExpect(3)) << "the aborted request is still expected";
    EXPECT_FALSE(decode_tx.cancelExpect(2)) << "the expired request is still expected";
    bool free = false;
    loop.runOnLoop([&](DecodeEngine& e) { free = e.blocks().isFullyFree(); });
    EXPECT_TRUE(free);
  }
  for (Stream* s : {&out_of_attempts, &deadline, &aborted}) EXPECT_EQ(s->finishEvents(), 1);
  EXPECT_TRUE(decode_tx.deregisterRegion(region).ok());
}

// Overlapped steps, ordered by construction: a decode step is held inside the model engine while
// the test opens a second request, ships its KV and sees its first token streamed, and aborts
// the first request; the abort takes effect only when the held step completes, and both streams
// end as they should with every block free.
class DecodeLoopOverlap : public DecodeLoopGolden {};

TEST_P(DecodeLoopOverlap, WhileAStepComputesTheLoopAdmitsStreamsFirstTokensAndDefersAborts) {
  auto fabric = std::make_shared<LoopbackFabric>();
  const kvtransfer::CompatInfo compat = pool_->compat(0x5eed, 1);
  LoopbackTransport decode_tx(fabric, compat);
  LoopbackTransport prefill_tx(fabric, compat);
  kvtransfer::RegionId region = 0;
  auto targets = exportPool(decode_tx, region);
  ASSERT_TRUE(targets.ok()) << targets.error().toString();
  const auto want = static_cast<std::int64_t>(std::min<std::size_t>(greedy_.size(), 6));
  ASSERT_GE(want, 3);

  GatedEngine gated(*decode_engine_);
  Stream a;
  Stream b;
  {
    DecodeLoop loop(gated, *pool_, withOverlap(DecodeEngineOptions{0, 8}));
    struct Release {
      GatedEngine& engine;
      ~Release() { engine.release(); }  // before the loop waits for its step, even on a failure
    } release{gated};

    // A runs; its first decode step enters the engine and is held there.
    gated.hold();
    DecodeRequest ra = request(1, want, a);
    ra.kv_deadline = Clock::now() + kWait;
    auto da = loop.openStream(std::move(ra), decode_tx, compat, *targets, 60000);
    ASSERT_TRUE(da.ok()) << da.error().toString();
    shipKv(prefill_tx, *da);
    ASSERT_TRUE(gated.waitEntered()) << "A's decode step never reached the engine";
    ASSERT_TRUE(a.waitTokens(1));

    // While it is held: B is admitted (its descriptor comes back), its KV arrives and its first
    // token streams.
    DecodeRequest rb = request(2, want, b);
    rb.kv_deadline = Clock::now() + kWait;
    auto opened = std::make_shared<std::promise<Result<kvtransfer::KvDescriptor>>>();
    loop.openStreamAsync(std::move(rb), decode_tx, compat, *targets, 60000,
                         [opened](Result<kvtransfer::KvDescriptor> r) { opened->set_value(std::move(r)); });
    auto future = opened->get_future();
    ASSERT_EQ(future.wait_for(kWait), std::future_status::ready) << "the open waited for the running step";
    auto db = future.get();
    ASSERT_TRUE(db.ok()) << db.error().toString();
    shipKv(prefill_tx, *db);
    ASSERT_TRUE(b.waitTokens(1)) << "B's first token waited for the running step";
    EXPECT_EQ(b.tokens(), std::vector<std::int32_t>{greedy_[0]});
    EXPECT_EQ(a.tokens().size(), 1U) << "A's held step already streamed";

    // A's abort is deferred: the command has run (runOnLoop after it, FIFO) and A still runs.
    loop.postAbort(1);
    std::size_t running = 0;
    loop.runOnLoop([&](DecodeEngine& e) { running = e.numRunning(); });
    EXPECT_EQ(running, 1U);
    EXPECT_EQ(a.finishEvents(), 0);

    gated.release();
    ASSERT_TRUE(a.waitFinished());
    EXPECT_EQ(a.finish(), FinishReason::Aborted);
    // The held step's token streamed before the abort took effect.
    EXPECT_EQ(a.tokens(), (std::vector<std::int32_t>{greedy_[0], greedy_[1]}));
    ASSERT_TRUE(b.waitFinished());
    EXPECT_EQ(b.finish(), FinishReason::Length);
    EXPECT_EQ(b.tokens(), std::vector<std::int32_t>(greedy_.begin(), greedy_.begin() + want));
    bool free = false;
    loop.runOnLoop([&](DecodeEngine& e) { free = e.blocks().isFullyFree(); });
    EXPECT_TRUE(free);
  }
  EXPECT_EQ(a.finishEvents(), 1);
  EXPECT_EQ(b.finishEvents(), 1);
  EXPECT_TRUE(decode_tx.deregisterRegion(region).ok());
}

INSTANTIATE_TEST_SUITE_P(Golden, DecodeLoopOverlap,
                         ::testing::Combine(::testing::Values("tiny-bf16", "tiny-fp8"), ::testing::Values(true)),
                         [](const ::testing::TestParamInfo<std::tuple<std::string, bool>>& p) {
                           std::string name = std::get<0>(p.param);
                           for (char& ch : name) ch = ch == '-' ? '_' : ch;
                           return name;
                         });

INSTANTIATE_TEST_SUITE_P(Golden, DecodeLoopGolden,
                         ::testing::Combine(::testing::Values("tiny-bf16", "tiny-fp8"), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<std::string, bool>>& p) {
                           std::string name = std::get<0>(p.param) + (std::get<1>(p.param) ? "_overlap" : "");
                           for (char& ch : name) ch = ch == '-' ? '_' : ch;
                           return name;
                         });

}  // namespace
}  // namespace pd::decode
