// Tensor-parallel KV path in one process over real UCX: a leader (rank 0) and a TpFollowerWorker
// (rank 1, a thread; loopback communicator) each register their own KV pool; the descriptor lists
// both ranks' targets; a real prefill worker (PrefillEngine + TransportKvSink) writes the prompt's
// KV into both pools; then the TP = 2 group decodes the golden greedy tokens from those pools. And
// write confinement on a follower: the leader's grant (TpLeaderEngine::grantKv) confines the
// follower's transport to the request's blocks, so a write elsewhere is refused there too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <thread>

#include "pd/decode/kv_pool.h"
#include "pd/decode/tp_worker.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/kvtransfer/staging_transport.h"
#include "pd/kvtransfer/ucx_transport.h"
#include "pd/prefill/prefill_engine.h"
#include "pd/prefill/transport_kv_sink.h"
#include "tp_test_support.h"
#include "unit/kvtransfer/kv_test_util.h"

namespace pd::decode {
namespace {

namespace kvt = kvtransfer;
using namespace std::chrono_literals;
using test_support::goldenDir;
using test_support::goldenIds;
using test_support::makeRankEngine;

constexpr std::uint64_t kModelHash = 0x7470'7470'7470'7470ULL;
constexpr std::int64_t kBlocks = 16;
constexpr std::int64_t kBlockSize = 8;

class TpKv : public ::testing::TestWithParam<std::string> {};

// A receiving transport on `path` (kvtransfer.path: direct or staging) for a pool in host memory.
Result<std::unique_ptr<kvt::Transport>> receiver(const kvt::CompatInfo& compat, const std::string& path,
                                                 const std::string& name) {
  kvt::KvTransferConfig cfg;
  cfg.path = path;
  cfg.staging_receive_blocks = 12;
  kvt::UcxTransportOptions tx;
  tx.compat = compat;
  tx.name = name;
  PD_ASSIGN_OR_RETURN(kvt::KvTransport kv, kvt::createKvTransport(cfg, tx, kvt::KvTransportUse::Receive, false));
  return std::move(kv.transport);
}

// The prompt's KV from a real prefill worker into every rank's pool, then greedy decoding by the
// TP = 2 group over them. `path`: every rank's kvtransfer.path. On the staging path each rank's
// grant picks staging blocks of its own, and the leader's are made to differ from the follower's
// (an earlier request holds its first ones), so KV reaches both pools only if the descriptor
// names each rank's own blocks (KvTarget::block_ids).
void prefillIntoEveryRankAndDecode(const std::string& model, const std::string& path) {
  const bool staging = path == "staging";
  const std::filesystem::path dir = goldenDir() / model;
  const std::vector<std::int32_t> prompt = goldenIds(dir / "golden.safetensors", "p0.tokens");
  const std::vector<std::int32_t> greedy = goldenIds(dir / "golden.safetensors", "p0.greedy");
  auto group = comm::createLoopbackGroup(2, comm::LoopbackOptions{60s});

  // Rank 1: its own pool, transport and serving loop.
  std::promise<TpFollowerWorker*> follower_ready;
  Status follower_status = okStatus();
  std::thread follower([&] {
    TpFollowerOptions o;
    o.decode.num_blocks = kBlocks;
    o.decode.block_size = kBlockSize;
    o.decode.kv_dtype = "f32";
    o.model_hash = kModelHash;
    o.kvtransfer.path = path;
    o.kvtransfer.staging_receive_blocks = 12;
    auto w = TpFollowerWorker::start(makeRankEngine(dir, group[1].get()), *group[1], o);
    if (!w.ok()) {
      follower_status = w.error();
      follower_ready.set_value(nullptr);
      return;
    }
    follower_ready.set_value(w->get());
    follower_status = (*w)->run();
  });

  // Rank 0, the leader: the same start-up steps by hand (DecodeServer does them in the worker).
  const auto lead = [&] {
    model::TpLeaderEngine leader(makeRankEngine(dir, group[0].get()), *group[0]);
    auto memory = leader.allocateCache(kBlocks, kBlockSize, DType::F32);
    ASSERT_TRUE(memory.ok());
    auto pool = KvPool::create(std::move(memory).value());
    ASSERT_TRUE(pool.ok());
    const kvt::CompatInfo compat = pool->compat(kModelHash, 2);
    auto transport = receiver(compat, path, "test-tp-leader-kv");
    ASSERT_TRUE(transport.ok()) << transport.error().toString();
    auto region = (*transport)->registerRegion(pool->memory());
    ASSERT_TRUE(region.ok());
    const kvt::RegionLayout layout = pool->regionLayout(*region);
    auto mine = (*transport)->exportTarget(0, std::span(&layout, 1));
    ASSERT_TRUE(mine.ok());
    auto targets = exchangeKvTargets(*group[0], *mine);
    ASSERT_TRUE(targets.ok()) << targets.error().toString();
    ASSERT_EQ(targets->size(), 2U);
    EXPECT_EQ((*targets)[1].tp_rank, 1U);
    TpFollowerWorker* worker = follower_ready.get_future().get();
    ASSERT_NE(worker, nullptr) << follower_status.error().toString();
    EXPECT_EQ(worker->transferPath(), staging ? kvt::KvTransferPath::Staging : kvt::KvTransferPath::Direct);

    // The descriptor: every rank's target, the same pool block ids everywhere (4.., so that
    // staging ids and pool ids differ).
    constexpr std::uint64_t kRequest = 42;
    kvt::KvDescriptor d;
    d.compat = compat;
    d.num_tokens = static_cast<std::uint32_t>(prompt.size());
    d.timeout_ms = 60000;
    const auto prompt_blocks = (static_cast<std::int64_t>(prompt.size()) + kBlockSize - 1) / kBlockSize;
    std::vector<std::int32_t> table;
    for (std::int64_t b = 0; b < 8; ++b) table.push_back(static_cast<std::int32_t>(b + 4));
    for (std::int64_t b = 0; b < prompt_blocks; ++b) d.block_ids.push_back(static_cast<std::uint32_t>(b + 4));
    d.targets = *targets;
    if (staging) {
      // An earlier request on the leader only holds its first staging blocks.
      kvt::KvDescriptor earlier = d;
      earlier.num_tokens = 2 * kBlockSize;
      earlier.block_ids = {0, 1};
      ASSERT_TRUE((*transport)->expect(7, kvt::Clock::now() + 60s, [](std::uint64_t, auto) {}).ok());
      ASSERT_TRUE((*transport)->grant(7, earlier).ok());
    }
    ASSERT_TRUE(leader.expectKv(kRequest, d.timeout_ms).ok());
    std::promise<Result<kvt::CompletionRecord>> arrived;
    ASSERT_TRUE((*transport)
                    ->expect(kRequest, kvt::Clock::now() + 60s,
                             [&](std::uint64_t, Result<kvt::CompletionRecord> r) { arrived.set_value(std::move(r)); })
                    .ok());
    // As DecodeLoop does: the leader's grant draws the transfer id, every follower keeps it.
    auto granted = (*transport)->grant(kRequest, d);
    ASSERT_TRUE(granted.ok()) << granted.error().toString();
    const std::vector<std::uint8_t> granted_bytes = kvt::encode(*granted);
    auto own_ids =
        leader.grantKv(kRequest, std::as_bytes(std::span(granted_bytes)), static_cast<std::uint32_t>(prompt_blocks));
    ASSERT_TRUE(own_ids.ok()) << own_ids.error().toString();
    ASSERT_EQ(own_ids->size(), 2U);
    d = std::move(granted).value();
    if (staging) {
      // Each rank names its own staging blocks; the descriptor keeps the pool's.
      ASSERT_EQ((*own_ids)[1].size(), static_cast<std::size_t>(prompt_blocks));
      d.targets[1].block_ids = (*own_ids)[1];
      EXPECT_EQ(d.targets[0].block_ids.size(), static_cast<std::size_t>(prompt_blocks));
      EXPECT_NE(d.targets[0].block_ids, d.targets[1].block_ids);
      EXPECT_EQ(d.block_ids[0], 4U);
    } else {
      EXPECT_TRUE((*own_ids)[1].empty());
      EXPECT_TRUE(d.targets[0].block_ids.empty());
    }
    // What the prefill worker gets: the descriptor through the wire.
    auto wired = kvt::decodeKvDescriptor(kvt::encode(d));
    ASSERT_TRUE(wired.ok()) << wired.error().toString();
    ASSERT_EQ(*wired, d);

    // The prefill worker: unsharded engine, its own transport, the real sink.
    auto prefill_model = makeRankEngine(dir, nullptr);
    kvt::UcxTransportOptions ptx;
    ptx.compat = compat;
    ptx.name = "test-tp-prefill-kv";
    auto prefill_tx = kvt::createUcxTransport(ptx);
    ASSERT_TRUE(prefill_tx.ok());
    auto prefill =
        prefill::PrefillEngine::create(*prefill_model, {.chunk_size = 16, .cache_blocks = 16, .block_size = 8});
    ASSERT_TRUE(prefill.ok());
    (*prefill)->start();
    std::promise<Status> sent;
    auto sink =
        prefill::TransportKvSink::create(**prefill_tx, d, kvt::Clock::now() + 60s,
                                         [&](const kvt::TransferId&, Status s) { sent.set_value(std::move(s)); });
    ASSERT_TRUE(sink.ok()) << sink.error().toString();
    prefill::PrefillRequest r;
    r.id = kRequest;
    r.tokens = prompt;
    r.sink = std::move(sink).value();
    ASSERT_TRUE((*prefill)->submit(std::move(r)).ok());
    auto record = arrived.get_future().get();
    ASSERT_TRUE(record.ok()) << record.error().toString();
    EXPECT_TRUE(sent.get_future().get().ok());
    EXPECT_EQ(record->first_token, greedy[0]);
    // As DecodeLoop does before the request runs: every follower holds the KV too (a staging rank
    // copies it into its pool when its own record arrives, which may be after ours).
    ASSERT_TRUE(leader.awaitKv(kRequest, 60000).ok());
    // A request the follower never expected is not in its pool: refused at once, group intact.
    auto unknown = leader.awaitKv(kRequest + 1, 60000);
    ASSERT_FALSE(unknown.ok());
    EXPECT_EQ(unknown.error().code, ErrorCode::Internal) << unknown.error().toString();

    // Both ranks' pools hold the prompt's KV, identically, in every layer.
    const model::LatentCacheView& a = pool->view();
    const model::LatentCacheView& b = worker->pool().view();
    for (std::size_t l = 0; l < a.layers.size(); ++l) {
      for (std::int64_t p = 0; p < static_cast<std::int64_t>(prompt.size()) - 1; ++p) {
        std::vector<float> x(static_cast<std::size_t>(a.latent_dim)), y(x.size());
        model::readLatent(a, static_cast<std::int64_t>(l), table, p, x.data());
        model::readLatent(b, static_cast<std::int64_t>(l), table, p, y.data());
        ASSERT_EQ(x, y) << "layer " << l << " position " << p;
        ASSERT_TRUE(std::any_of(x.begin(), x.end(), [](float v) { return v != 0.0F; })) << "layer " << l;
      }
    }

    // Greedy decoding by the TP group over the two pools.
    std::vector<std::int32_t> tokens{record->first_token};
    for (std::size_t i = 1; i < greedy.size(); ++i) {
      const std::vector<std::int32_t> in{tokens.back()};
      const model::SequenceChunk chunk{in, static_cast<std::int64_t>(prompt.size() + i - 1), table, {}, 0};
      auto out = leader.forward(std::span(&chunk, 1), a, {});
      ASSERT_TRUE(out.ok()) << out.error().toString();
      tokens.push_back(
          static_cast<std::int32_t>(std::max_element(out->logits.begin(), out->logits.end()) - out->logits.begin()));
    }
    EXPECT_EQ(tokens, greedy);
    ASSERT_TRUE(leader.stop().ok());
    (*prefill)->stop();
    if (staging) (void)(*transport)->cancelExpect(7);
    EXPECT_TRUE((*transport)->deregisterRegion(*region).ok());
  };
  lead();
  follower.join();
  EXPECT_TRUE(follower_status.ok()) << follower_status.error().toString();
}

TEST_P(TpKv, PrefillWritesEveryRanksPoolAndTheGroupDecodesTheGoldenTokens) {
  prefillIntoEveryRankAndDecode(GetParam(), "direct");
}

TEST_P(TpKv, OnTheStagingPathEveryRankReceivesAtItsOwnStagingBlocks) {
  prefillIntoEveryRankAndDecode(GetParam(), "staging");
}

// The bits of positions [0, n) of blocks `blocks` of every layer of `view` (the test's KV is a
// random pattern: compared as floats, its NaNs would never be equal).
std::vector<std::uint32_t> latents(const model::LatentCacheView& view, const std::vector<std::int32_t>& blocks,
                                   std::int64_t n) {
  std::vector<std::uint32_t> out;
  std::vector<float> x(static_cast<std::size_t>(view.latent_dim));
  for (std::size_t l = 0; l < view.layers.size(); ++l) {
    for (std::int64_t p = 0; p < n; ++p) {
      model::readLatent(view, static_cast<std::int64_t>(l), blocks, p, x.data());
      const std::size_t at = out.size();
      out.resize(at + x.size());
      std::memcpy(out.data() + at, x.data(), x.size() * sizeof(float));
    }
  }
  return out;
}

TEST_P(TpKv, AFollowerRankRefusesWritesToBlocksTheRequestDoesNotHold) {
  const std::filesystem::path dir = goldenDir() / GetParam();
  auto group = comm::createLoopbackGroup(2, comm::LoopbackOptions{60s});
  std::promise<TpFollowerWorker*> follower_ready;
  Status follower_status = okStatus();
  std::int64_t follower_pending = -1;
  std::thread follower([&] {
    TpFollowerOptions o;
    o.decode.num_blocks = kBlocks;
    o.decode.block_size = kBlockSize;
    o.decode.kv_dtype = "f32";
    o.model_hash = kModelHash;
    auto w = TpFollowerWorker::start(makeRankEngine(dir, group[1].get()), *group[1], o);
    if (!w.ok()) {
      follower_status = w.error();
      follower_ready.set_value(nullptr);
      return;
    }
    follower_ready.set_value(w->get());
    follower_status = (*w)->run();
    follower_pending = (*w)->transportStats().pending_receives;
  });

  const auto lead = [&] {
    model::TpLeaderEngine leader(makeRankEngine(dir, group[0].get()), *group[0]);
    auto pool = KvPool::create(leader.config(), kBlocks, kBlockSize, DType::F32);
    ASSERT_TRUE(pool.ok());
    const kvt::CompatInfo compat = pool->compat(kModelHash, 2);
    kvt::UcxTransportOptions tx;
    tx.compat = compat;
    tx.name = "test-tp-leader-kv";
    auto transport = kvt::createUcxTransport(tx);
    ASSERT_TRUE(transport.ok()) << transport.error().toString();
    auto region = (*transport)->registerRegion(pool->memory());
    ASSERT_TRUE(region.ok());
    const kvt::RegionLayout layout = pool->regionLayout(*region);
    auto mine = (*transport)->exportTarget(0, std::span(&layout, 1));
    ASSERT_TRUE(mine.ok());
    auto targets = exchangeKvTargets(*group[0], *mine);
    ASSERT_TRUE(targets.ok()) << targets.error().toString();
    TpFollowerWorker* worker = follower_ready.get_future().get();
    ASSERT_NE(worker, nullptr) << follower_status.error().toString();

    kvt::UcxTransportOptions ptx;
    ptx.compat = compat;
    ptx.name = "test-tp-prefill-kv";
    auto prefill_tx = kvt::createUcxTransport(ptx);
    ASSERT_TRUE(prefill_tx.ok());
    constexpr std::uint32_t kTokens = 2 * kBlockSize;
    kvt::testutil::SourceKv source(compat, kTokens, 7);
    kvt::testutil::ScopedRegion src(**prefill_tx, source.bytes);
    ASSERT_TRUE(src.ok());

    // Opens request `id` on both ranks the way DecodeLoop does (expect, grant, grantKv) with
    // `blocks`, then sends its KV to `write_to` instead (a forged descriptor when they differ);
    // returns the leader's receive outcome.
    const auto transfer = [&](std::uint64_t id, std::vector<std::uint32_t> blocks,
                              std::vector<std::uint32_t> write_to) -> Result<kvt::CompletionRecord> {
      kvt::KvDescriptor d;
      d.compat = compat;
      d.num_tokens = kTokens;
      d.timeout_ms = 60000;
      d.block_ids = std::move(blocks);
      d.targets = *targets;
      PD_TRY(leader.expectKv(id, d.timeout_ms));
      auto arrived = std::make_shared<std::promise<Result<kvt::CompletionRecord>>>();
      PD_TRY(
          (*transport)->expect(id, kvt::Clock::now() + 60s, [arrived](std::uint64_t, Result<kvt::CompletionRecord> r) {
            arrived->set_value(std::move(r));
          }));
      PD_ASSIGN_OR_RETURN(kvt::KvDescriptor granted, (*transport)->grant(id, d));
      const std::vector<std::uint8_t> bytes = kvt::encode(granted);
      PD_TRY(leader.grantKv(id, std::as_bytes(std::span(bytes)), 2));
      granted.block_ids = std::move(write_to);
      auto sent = std::make_shared<std::promise<Status>>();
      PD_TRY((*prefill_tx)->beginTransfer(granted, kvt::Clock::now() + 60s, [sent](const kvt::TransferId&, Status s) {
        sent->set_value(std::move(s));
      }));
      PD_TRY((*prefill_tx)->put(granted.transfer_id, source.chunkPuts(src.id(), 0, kTokens)));
      kvt::CompletionRecord record;
      record.transfer_id = granted.transfer_id;
      record.num_tokens = kTokens;
      PD_TRY((*prefill_tx)->finish(record));
      PD_TRY(sent->get_future().get());
      auto outcome = arrived->get_future().get();
      PD_TRY(leader.cancelKv(id));  // the follower's (re-armed) expectation ends with the request
      return outcome;
    };

    // A granted transfer lands on both ranks, identically.
    const std::vector<std::int32_t> own{2, 3};
    auto ok = transfer(51, {2, 3}, {2, 3});
    ASSERT_TRUE(ok.ok()) << ok.error().toString();
    const std::vector<std::uint32_t> leader_kv = latents(pool->view(), own, kTokens);
    EXPECT_EQ(latents(worker->pool().view(), own, kTokens), leader_kv);
    EXPECT_TRUE(std::any_of(leader_kv.begin(), leader_kv.end(), [](std::uint32_t v) { return v != 0; }));

    // A descriptor edited to name blocks 6 and 7 (another request's): refused on the leader and
    // on the follower, whose blocks stay as they were.
    const std::vector<std::int32_t> victim{6, 7};
    const std::vector<std::uint32_t> before = latents(worker->pool().view(), victim, kTokens);
    const std::uint64_t dropped_before = worker->transportStats().bytes_dropped;
    auto forged = transfer(52, {4, 5}, {6, 7});
    ASSERT_FALSE(forged.ok());
    EXPECT_EQ(forged.error().code, ErrorCode::Corrupt) << forged.error().toString();
    EXPECT_EQ(latents(worker->pool().view(), victim, kTokens), before) << "the follower took the forged writes";
    EXPECT_EQ(latents(pool->view(), victim, kTokens), before);
    EXPECT_GT(worker->transportStats().bytes_dropped, dropped_before);

    ASSERT_TRUE(leader.stop().ok());
    EXPECT_TRUE((*transport)->deregisterRegion(*region).ok());
  };
  lead();
  follower.join();
  EXPECT_TRUE(follower_status.ok()) << follower_status.error().toString();
  EXPECT_EQ(follower_pending, 0) << "the follower still expects KV after the group stopped";
}

INSTANTIATE_TEST_SUITE_P(Golden, TpKv, ::testing::Values("tiny-bf16", "tiny-fp8"));

}  // namespace
}  // namespace pd::decode
