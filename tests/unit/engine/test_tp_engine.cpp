// Tensor parallelism in one process: weight shards, and a TP = 2 group (two threads, loopback
// communicator) against TP = 1 on the golden models — same greedy tokens, logits within float32
// tolerance, MTP included.
#include <gtest/gtest.h>

#include <thread>

#include "pd/engine/generate.h"
#include "pd/engine/model_weights.h"
#include "support/host_row_sampling_engine.h"
#include "tp_test_support.h"

namespace pd::decode {
namespace {

using test_support::goldenDir;
using test_support::goldenIds;
using test_support::makeRankEngine;
using test_support::maxAbsDiff;

constexpr double kTpLogitsTol = 1e-4;  // TP only reorders float32 sums

std::vector<float> denseMatrix(const model::WeightMatrix& w) {
  std::vector<float> out(static_cast<std::size_t>(w.rows * w.cols));
  for (std::int64_t r = 0; r < w.rows; ++r) model::dequantizeRow(w, r, out.data() + r * w.cols);
  return out;
}

std::vector<float> columns(const std::vector<float>& m, std::int64_t cols, std::int64_t c0, std::int64_t c1) {
  std::vector<float> out;
  const std::int64_t rows = static_cast<std::int64_t>(m.size()) / cols;
  for (std::int64_t r = 0; r < rows; ++r) out.insert(out.end(), m.begin() + r * cols + c0, m.begin() + r * cols + c1);
  return out;
}

std::vector<float> rows(const std::vector<float>& m, std::int64_t cols, std::int64_t r0, std::int64_t r1) {
  return {m.begin() + r0 * cols, m.begin() + r1 * cols};
}

class TpGolden : public ::testing::TestWithParam<std::string> {
 protected:
  std::filesystem::path dir() const { return goldenDir() / GetParam(); }
  std::vector<std::int32_t> prompt() const { return goldenIds(dir() / "golden.safetensors", "p0.tokens"); }
  std::vector<std::int32_t> greedy() const { return goldenIds(dir() / "golden.safetensors", "p0.greedy"); }
};

// Every sharded matrix holds exactly the rows / columns of the whole one (FP8 scales re-blocked
// where a slice does not start on a 128 boundary).
TEST_P(TpGolden, ShardsAreSlicesOfTheWholeWeights) {
  auto whole = model::ModelWeights::load(dir());
  ASSERT_TRUE(whole.ok()) << whole.error().toString();
  const ModelConfig& c = (*whole)->config();
  for (int rank = 0; rank < 2; ++rank) {
    auto part = model::ModelWeights::load(dir(), {rank, 2});
    ASSERT_TRUE(part.ok()) << part.error().toString();
    const auto heads = model::shardRange(c.num_attention_heads, rank, 2);
    const auto vocab = model::shardRange(c.vocab_size, rank, 2);
    for (std::size_t l = 0; l < (*whole)->layers().size(); ++l) {
      const model::LayerWeights& w = (*whole)->layers()[l];
      const model::LayerWeights& p = (*part)->layers()[l];
      const std::int64_t kvw = c.qk_nope_head_dim + c.v_head_dim;
      EXPECT_EQ(denseMatrix(p.attn.kv_b),
                rows(denseMatrix(w.attn.kv_b), c.kv_lora_rank, heads.begin * kvw, heads.end * kvw));
      EXPECT_EQ(denseMatrix(p.attn.q_b),
                rows(denseMatrix(w.attn.q_b), c.q_lora_rank, heads.begin * c.qkHeadDim(), heads.end * c.qkHeadDim()));
      EXPECT_EQ(denseMatrix(p.attn.o),
                columns(denseMatrix(w.attn.o), w.attn.o.cols, heads.begin * c.v_head_dim, heads.end * c.v_head_dim));
      EXPECT_EQ(denseMatrix(p.attn.kv_a), denseMatrix(w.attn.kv_a)) << "the latent projection is replicated";
      const model::MlpWeights& wm = w.moe ? w.experts[3] : w.dense;
      const model::MlpWeights& pm = p.moe ? p.experts[3] : p.dense;
      const auto inter = model::shardRange(wm.gate.rows, rank, 2);
      EXPECT_EQ(denseMatrix(pm.gate), rows(denseMatrix(wm.gate), c.hidden_size, inter.begin, inter.end)) << l;
      EXPECT_EQ(denseMatrix(pm.up), rows(denseMatrix(wm.up), c.hidden_size, inter.begin, inter.end)) << l;
      EXPECT_EQ(denseMatrix(pm.down), columns(denseMatrix(wm.down), wm.down.cols, inter.begin, inter.end)) << l;
    }
    EXPECT_EQ(denseMatrix((*part)->embedTokens()),
              rows(denseMatrix((*whole)->embedTokens()), c.hidden_size, vocab.begin, vocab.end));
    EXPECT_EQ((*part)->lmHead().rows, vocab.end - vocab.begin);
    ASSERT_NE((*part)->mtp(), nullptr);
    EXPECT_EQ((*part)->mtp()->head.rows, vocab.end - vocab.begin);
  }
}

TEST_P(TpGolden, ModelsThatDoNotSplitAreRejected) {
  auto three = model::ModelWeights::load(dir(), {0, 3});  // 4 heads
  ASSERT_FALSE(three.ok());
  EXPECT_EQ(three.error().code, ErrorCode::InvalidArgument);
  EXPECT_FALSE(model::ModelWeights::load(dir(), {2, 2}).ok());
  // Shard and group must agree.
  auto group = comm::createLoopbackGroup(2);
  auto whole = model::ModelWeights::load(dir());
  ASSERT_TRUE(whole.ok());
  model::CpuEngineOptions o;
  o.tp = group[0].get();
  auto engine = model::createCpuEngine(std::move(whole).value(), o);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.error().code, ErrorCode::InvalidArgument);
}

// One prefill forward (every row's logits and hidden state) by a TP = 2 group vs TP = 1.
TEST_P(TpGolden, PrefillLogitsMatchTp1) {
  const std::vector<std::int32_t> p = prompt();
  auto single = makeRankEngine(dir(), nullptr);
  auto cache1 = model::PagedLatentCache::create(single->config(), 4, 16);
  ASSERT_TRUE(cache1.ok());
  std::vector<std::int32_t> table{0, 1, 2, 3};
  const model::SequenceChunk chunk{p, 0, table, {}, 0};
  model::ForwardOptions fo;
  fo.logits = model::OutputRows::All;
  fo.hidden = model::OutputRows::All;
  auto want = single->forward(std::span(&chunk, 1), cache1->view(), fo);
  ASSERT_TRUE(want.ok());

  auto group = comm::createLoopbackGroup(2);
  std::vector<model::ForwardOutput> got(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      auto engine = makeRankEngine(dir(), group[static_cast<std::size_t>(r)].get());
      auto cache = model::PagedLatentCache::create(engine->config(), 4, 16);
      auto out = engine->forward(std::span(&chunk, 1), cache->view(), fo);
      if (out.ok()) {
        got[static_cast<std::size_t>(r)] = std::move(out).value();
      } else {
        errors[static_cast<std::size_t>(r)] = out.error().toString();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[static_cast<std::size_t>(r)], "");
    const double d = maxAbsDiff(got[static_cast<std::size_t>(r)].logits, want->logits);
    std::printf("  [tp2] %s rank %d logits max|diff| vs tp1 = %.3g\n", GetParam().c_str(), r, d);
    EXPECT_LE(d, kTpLogitsTol);
    EXPECT_LE(maxAbsDiff(got[static_cast<std::size_t>(r)].hidden, want->hidden), kTpLogitsTol);
  }
  EXPECT_EQ(got[0].logits, got[1].logits) << "every rank ends with the same logits";
}

// The leader runs model::generate (prefill, decode steps, MTP drafts) through model::TpLeaderEngine;
// the follower thread mirrors each call on its own shard and cache.
TEST_P(TpGolden, GreedyTokensMatchTheGoldenWithAndWithoutMtp) {
  const std::vector<std::int32_t> want = greedy();
  for (std::int64_t drafts : {0, 1, 2}) {
    auto group = comm::createLoopbackGroup(2);
    Status follower_status = okStatus();
    std::thread follower([&] {
      auto engine = makeRankEngine(dir(), group[1].get());
      follower_status = model::runTpFollower(*engine, *group[1], model::ownedTpCache());
    });
    const auto lead = [&] {
      model::TpLeaderEngine leader(makeRankEngine(dir(), group[0].get()), *group[0]);
      EXPECT_NE(leader.capabilities().backend.find("tp2"), std::string::npos);
      model::GenerateOptions o;
      o.max_tokens = static_cast<std::int64_t>(want.size());
      o.stop_at_eos = false;
      o.mtp_drafts = drafts;
      o.block_size = 16;
      auto res = model::generate(leader, prompt(), o);
      ASSERT_TRUE(res.ok()) << res.error().toString();
      EXPECT_EQ(res->tokens, want) << "mtp drafts " << drafts;
      // A malformed batch fails on both ranks and the group goes on.
      model::ForwardOptions fo;
      const std::vector<std::int32_t> bad_tokens{999999};
      const std::vector<std::int32_t> table{0};
      const model::SequenceChunk bad{bad_tokens, 0, table, {}, 0};
      auto cache = model::PagedLatentCache::create(leader.config(), 1, 16);
      auto out = leader.forward(std::span(&bad, 1), cache->view(), fo);
      ASSERT_FALSE(out.ok());
      EXPECT_EQ(out.error().code, ErrorCode::InvalidArgument);
      ASSERT_TRUE(leader.stop().ok());
      EXPECT_EQ(leader.forward(std::span(&bad, 1), cache->view(), fo).error().code, ErrorCode::Cancelled);
    };  // the leader's destructor stops the follower even when an assertion returned early
    lead();
    follower.join();
    EXPECT_TRUE(follower_status.ok()) << follower_status.error().toString();
  }
}

// The KV relays of a TP = 4 group with scripted follower hooks (a fake of the transport side):
// grantKv collects each follower's own block ids (rank 1 answers with staging ids, ranks 2 and 3
// with none: the descriptor's), refuses an answer of the wrong length or a refusal naming how many
// ranks failed, and awaitKv answers whether every follower's KV landed; the group stays usable
// after each refusal, and a follower without hooks fails closed.
TEST_P(TpGolden, KvRelaysCollectEachRanksOwnBlocksAndWhetherItsKvLanded) {
  auto group = comm::createLoopbackGroup(4);
  std::vector<Status> follower_status(4, okStatus());
  std::vector<std::thread> followers;
  for (int r = 1; r < 4; ++r) {
    followers.emplace_back([&, r] {
      auto engine = makeRankEngine(dir(), group[static_cast<std::size_t>(r)].get());
      model::TpFollowerHooks hooks;
      hooks.grant_kv = [r](std::uint64_t id, std::span<const std::byte> grant,
                           std::uint32_t blocks) -> std::optional<std::vector<std::uint32_t>> {
        EXPECT_EQ(grant.size(), 3U);                                     // the leader's bytes, as they were
        if (id == 2 && r == 2) return std::nullopt;                      // cannot confine
        if (id == 3 && r == 1) return std::vector<std::uint32_t>{1, 2};  // not `blocks` ids
        if (r >= 2) return std::vector<std::uint32_t>{};                 // the descriptor's ids
        std::vector<std::uint32_t> own(blocks);
        for (std::uint32_t b = 0; b < blocks; ++b) own[b] = 100 + b;
        return own;
      };
      hooks.await_kv = [r](std::uint64_t id, std::uint32_t timeout_ms) {
        EXPECT_EQ(timeout_ms, 500U);
        return !(id == 5 && r == 1);
      };
      follower_status[static_cast<std::size_t>(r)] =
          model::runTpFollower(*engine, *group[static_cast<std::size_t>(r)], model::ownedTpCache(), hooks);
    });
  }
  const auto lead = [&] {
    model::TpLeaderEngine leader(makeRankEngine(dir(), group[0].get()), *group[0]);
    const std::vector<std::byte> bytes(3, std::byte{7});
    auto ids = leader.grantKv(1, bytes, 4);
    ASSERT_TRUE(ids.ok()) << ids.error().toString();
    ASSERT_EQ(ids->size(), 4U);
    EXPECT_TRUE((*ids)[0].empty());
    EXPECT_EQ((*ids)[1], (std::vector<std::uint32_t>{100, 101, 102, 103}));
    EXPECT_TRUE((*ids)[2].empty());
    EXPECT_TRUE((*ids)[3].empty());
    auto refused = leader.grantKv(2, bytes, 4);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.error().code, ErrorCode::Internal);
    EXPECT_NE(refused.error().message.find("1 of 3 follower rank(s)"), std::string::npos) << refused.error().message;
    auto short_list = leader.grantKv(3, bytes, 4);
    ASSERT_FALSE(short_list.ok());
    EXPECT_EQ(short_list.error().code, ErrorCode::Internal);
    EXPECT_EQ(leader.grantKv(4, bytes, (1U << 22) + 1).error().code, ErrorCode::InvalidArgument);
    EXPECT_TRUE(leader.awaitKv(4, 500).ok());
    auto missing = leader.awaitKv(5, 500);
    ASSERT_FALSE(missing.ok());
    EXPECT_EQ(missing.error().code, ErrorCode::Internal);
    EXPECT_NE(missing.error().message.find("did not land on 1 of 3"), std::string::npos) << missing.error().message;
    EXPECT_FALSE(leader.broken());
    ASSERT_TRUE(leader.stop().ok());
  };
  lead();
  for (auto& f : followers) f.join();
  for (const Status& s : follower_status) EXPECT_TRUE(s.ok()) << s.error().toString();

  // Followers without hooks answer no to both.
  auto bare = comm::createLoopbackGroup(2);
  Status bare_status = okStatus();
  std::thread follower([&] {
    auto engine = makeRankEngine(dir(), bare[1].get());
    bare_status = model::runTpFollower(*engine, *bare[1], model::ownedTpCache());
  });
  {
    model::TpLeaderEngine leader(makeRankEngine(dir(), bare[0].get()), *bare[0]);
    EXPECT_EQ(leader.grantKv(1, std::vector<std::byte>(1), 1).error().code, ErrorCode::Internal);
    EXPECT_EQ(leader.awaitKv(1, 10).error().code, ErrorCode::Internal);
    EXPECT_TRUE(leader.stop().ok());
  }
  follower.join();
  EXPECT_TRUE(bare_status.ok()) << bare_status.error().toString();
}

// A leader whose local engine samples (the CUDA engine; here HostRowSamplingEngine, which samples
// its logits on the host) is a SamplingEngine itself: generate samples through it, the followers
// run each sampled step with greedy rows (taking part in the same collectives, their tokens
// dropped). Its tokens equal those of a plain leader whose logits are sampled by generate: greedy
// (the golden tokens) and seeded top-k, with MTP drafts. A leader over a plain engine does not
// claim to sample.
TEST_P(TpGolden, ASamplingLeaderSamplesWhileFollowersRunTheSameStepsGreedily) {
  const std::vector<std::int32_t> golden_greedy = greedy();
  pd::SamplingParams seeded;
  seeded.temperature = 0.8;
  seeded.top_k = 20;
  seeded.seed = 7;
  // Generates with a sampling leader or a plain one; the follower's sampled rows come back.
  const auto run = [&](bool sampling_leader, const pd::SamplingParams& params, int& follower_rows) {
    auto group = comm::createLoopbackGroup(2);
    Status follower_status = okStatus();
    std::thread follower([&] {
      auto inner = makeRankEngine(dir(), group[1].get());
      if (sampling_leader) {
        pd::test_support::HostRowSamplingEngine engine(*inner);
        follower_status = model::runTpFollower(engine, *group[1], model::ownedTpCache());
        follower_rows = engine.sampled_rows;
      } else {
        follower_status = model::runTpFollower(*inner, *group[1], model::ownedTpCache());
      }
    });
    std::vector<std::int32_t> tokens;
    {
      std::unique_ptr<model::Engine> local = makeRankEngine(dir(), group[0].get());
      if (sampling_leader) local = std::make_unique<pd::test_support::HostRowSamplingEngine>(std::move(local));
      std::unique_ptr<model::TpLeaderEngine> leader = model::makeTpLeaderEngine(std::move(local), *group[0]);
      EXPECT_EQ(dynamic_cast<model::SamplingEngine*>(leader.get()) != nullptr, sampling_leader);
      model::GenerateOptions o;
      o.max_tokens = static_cast<std::int64_t>(golden_greedy.size());
      o.stop_at_eos = false;
      o.mtp_drafts = 1;
      o.block_size = 16;
      o.sampling = params;
      o.device_sampling = true;  // taken only where the engine samples
      auto res = model::generate(*leader, prompt(), o);
      EXPECT_TRUE(res.ok()) << res.error().toString();
      if (res.ok()) tokens = res->tokens;
    }  // the leader's destructor stops the follower, also after a failed expectation
    follower.join();
    EXPECT_TRUE(follower_status.ok()) << follower_status.error().toString();
    return tokens;
  };
  int rows = 0;
  EXPECT_EQ(run(true, pd::SamplingParams{}, rows), golden_greedy);
  EXPECT_GT(rows, 0) << "the follower ran the sampled steps as sampled calls";
  int plain_rows = 0;
  EXPECT_EQ(run(false, pd::SamplingParams{}, plain_rows), golden_greedy);
  const std::vector<std::int32_t> sampled = run(true, seeded, rows);
  EXPECT_EQ(sampled.size(), golden_greedy.size());
  EXPECT_EQ(sampled, run(false, seeded, plain_rows)) << "seeded top-k: the same tokens either way";
}

INSTANTIATE_TEST_SUITE_P(Golden, TpGolden, ::testing::Values("tiny-bf16", "tiny-fp8"));

}  // namespace
}  // namespace pd::decode
