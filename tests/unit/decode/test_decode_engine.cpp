// The decode engine fed with KV written by the reference prefill path (in process, through a sink
// that copies each layer into the decode pool at the admitted block ids, as a prefill worker's
// puts would): greedy tokens equal the golden and single-process generation, batching does not
// change tokens, MTP does not change tokens, and every exit path returns the pool to fully free.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "pd/decode/decode_engine.h"
#include "pd/decode/kv_pool.h"
#include "pd/engine/engine.h"
#include "pd/engine/generate.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/safetensors.h"
#include "pd/engine/sampling.h"
#include "support/host_row_sampling_engine.h"
#include "support/resident_cache_engine.h"
#include "unit/decode/golden_support.h"
#include "unit/decode/local_prefill.h"

namespace pd::decode {
namespace {

namespace fs = std::filesystem;

using test_support::goldenDir;
using test_support::goldenIds;
using test_support::prefill;

// The CPU engine with the MTP layer's draft replaced by an oracle that knows the sequence: with
// probability `p` it proposes the true next token, otherwise a wrong one (deterministic). The MTP
// layer still runs (its KV and hidden states are real); only the draft logits are overridden.
// Random tiny weights accept almost no real drafts, so this is what exercises acceptance.
class OracleDraftEngine : public model::Engine {
 public:
  OracleDraftEngine(model::Engine& inner, std::vector<std::int32_t> sequence, double p)
      : inner_(inner), sequence_(std::move(sequence)), p_(p) {}
  const ModelConfig& config() const override { return inner_.config(); }
  model::EngineCapabilities capabilities() const override { return inner_.capabilities(); }
  Result<model::ForwardOutput> forward(std::span<const model::SequenceChunk> batch, const model::LatentCacheView& cache,
                                       const model::ForwardOptions& options) override {
    return inner_.forward(batch, cache, options);
  }
  Result<model::ForwardOutput> forwardMtp(std::span<const model::SequenceChunk> batch,
                                          const model::LatentCacheView& cache,
                                          const model::ForwardOptions& options) override {
    auto out = inner_.forwardMtp(batch, cache, options);
    if (!out.ok() || options.logits != model::OutputRows::Last) return out;
    const auto vocab = static_cast<std::size_t>(config().vocab_size);
    for (std::size_t i = 0; i < batch.size(); ++i) {
      // Row i drafts the token two positions after the chunk's last MTP position.
      const auto target =
          static_cast<std::size_t>(batch[i].start_pos + static_cast<std::int64_t>(batch[i].tokens.size()) + 1);
      if (target >= sequence_.size()) continue;
      rng_ = rng_ * 6364136223846793005ULL + 1442695040888963407ULL;
      const bool right = static_cast<double>(rng_ >> 11) / 9007199254740992.0 < p_;
      const auto token = static_cast<std::size_t>(right ? sequence_[target]
                                                        : (sequence_[target] + 1) % static_cast<std::int32_t>(vocab));
      out->logits[i * vocab + token] = 1e9F;
      ++proposed_;
      proposed_right_ += right ? 1 : 0;
    }
    return out;
  }
  std::int64_t proposedRight() const { return proposed_right_; }

 private:
  model::Engine& inner_;
  std::vector<std::int32_t> sequence_;
  double p_;
  std::uint64_t rng_ = 42;
  std::int64_t proposed_ = 0;
  std::int64_t proposed_right_ = 0;
};

// The CPU engine whose main-model forward fails from the `fail_from`-th call on (a device error).
class FailingEngine : public model::Engine {
 public:
  FailingEngine(model::Engine& inner, int fail_from) : inner_(inner), fail_from_(fail_from) {}
  const ModelConfig& config() const override { return inner_.config(); }
  model::EngineCapabilities capabilities() const override { return inner_.capabilities(); }
  Result<model::ForwardOutput> forward(std::span<const model::SequenceChunk> batch, const model::LatentCacheView& cache,
                                       const model::ForwardOptions& options) override {
    if (++calls_ >= fail_from_) return makeError(ErrorCode::Internal, "injected device failure");
    return inner_.forward(batch, cache, options);
  }
  Result<model::ForwardOutput> forwardMtp(std::span<const model::SequenceChunk> batch,
                                          const model::LatentCacheView& cache,
                                          const model::ForwardOptions& options) override {
    return inner_.forwardMtp(batch, cache, options);
  }

 private:
  model::Engine& inner_;
  int fail_from_;
  int calls_ = 0;
};

// Collects a request's stream and checks that it ends exactly once.
struct Stream {
  std::vector<std::int32_t> tokens;
  std::optional<FinishReason> finish;
  std::optional<Error> error;
  int finish_events = 0;
  bool after_finish = false;
  bool preempted = false;
  std::int64_t preempted_blocks = 0;
  std::vector<std::string> kv_traceparents;  // each event's

  TokenEventSink sink() {
    return [this](const TokenEvent& e) {
      if (finish) after_finish = true;
      kv_traceparents.push_back(e.kv_traceparent);
      for (const auto& t : e.tokens) tokens.push_back(t.token);
      if (e.finish) {
        ++finish_events;
        finish = e.finish;
        error = e.error;
        preempted = e.preempted;
        preempted_blocks = e.preempted_blocks;
        EXPECT_EQ(e.completion_tokens, static_cast<std::int64_t>(tokens.size()));
      }
    };
  }
};

class DecodeGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto e = model::createCpuEngine(goldenDir() / GetParam(), model::CpuEngineOptions{2, std::nullopt, false});
    ASSERT_TRUE(e.ok()) << e.error().toString();
    engine_ = std::move(e).value();
    const fs::path file = goldenDir() / GetParam() / "golden.safetensors";
    prompt_ = goldenIds(file, "p0.tokens");
    greedy_ = goldenIds(file, "p0.greedy");
    auto p = KvPool::create(engine_->config(), 128, 4, DType::F32);  // small blocks: many per sequence
    ASSERT_TRUE(p.ok()) << p.error().toString();
    pool_ = std::make_unique<KvPool>(std::move(p).value());
  }

  DecodeRequest request(std::uint64_t id, std::int64_t prompt_tokens, std::int64_t max_tokens, Stream& s) const {
    DecodeRequest r;
    r.id = id;
    r.prompt_tokens = prompt_tokens;
    r.max_tokens = max_tokens;
    r.ignore_eos = true;  // the golden ran a fixed number of tokens
    r.sink = s.sink();
    return r;
  }

  // Admits, prefills and decodes `prompts` together; returns each one's tokens.
  std::vector<std::vector<std::int32_t>> decodeTogether(const std::vector<std::vector<std::int32_t>>& prompts,
                                                        std::int64_t max_tokens, std::int64_t drafts,
                                                        DecodeStats* stats = nullptr, std::int64_t max_running = 64,
                                                        const pd::SamplingParams& sampling = {}, KvPool* pool = nullptr,
                                                        bool local = false, model::Engine* engine = nullptr) {
    KvPool& kv = pool != nullptr ? *pool : *pool_;
    std::vector<Stream> streams(prompts.size());  // outlives the engine, whose destructor may call sinks
    DecodeEngine dec(engine != nullptr ? *engine : *engine_, kv, DecodeEngineOptions{drafts, max_running});
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      DecodeRequest r = request(i + 1, static_cast<std::int64_t>(prompts[i].size()), max_tokens, streams[i]);
      r.sampling = sampling;
      if (local) r.local_prompt = prompts[i];  // the decode engine prefills it itself
      auto blocks = dec.admit(std::move(r));
      PD_CHECK_MSG(blocks.ok(), "admission failed");
      if (!local) PD_CHECK(dec.onKvReady(i + 1, prefill(*engine_, prompts[i], kv, *blocks, sampling)).ok());
    }
    for (int guard = 0; dec.hasWork() && guard < 1000; ++guard) dec.step(Clock::now());
    EXPECT_EQ(dec.numRequests(), 0U);
    EXPECT_TRUE(dec.blocks().isFullyFree());
    if (stats) *stats = dec.stats();
    std::vector<std::vector<std::int32_t>> out;
    for (const Stream& s : streams) {
      EXPECT_EQ(s.finish_events, 1);
      EXPECT_FALSE(s.after_finish);
      EXPECT_EQ(s.finish, FinishReason::Length);
      out.push_back(s.tokens);
    }
    return out;
  }

  std::unique_ptr<model::Engine> engine_;
  std::unique_ptr<KvPool> pool_;
  std::vector<std::int32_t> prompt_;
  std::vector<std::int32_t> greedy_;
};

TEST_P(DecodeGolden, GreedyTokensEqualGoldenWithAndWithoutMtp) {
  const auto g = static_cast<std::int64_t>(greedy_.size());
  for (const std::int64_t drafts : {0, 1, 2}) {
    DecodeStats stats;
    const auto got = decodeTogether({prompt_}, g, drafts, &stats);
    EXPECT_EQ(got[0], greedy_) << GetParam() << " with " << drafts << " MTP drafts";
    std::printf("  [decode] %s k=%lld: %lld steps for %lld tokens, drafts accepted %lld / %lld\n", GetParam().c_str(),
                static_cast<long long>(drafts), static_cast<long long>(stats.steps), static_cast<long long>(g),
                static_cast<long long>(stats.drafts_accepted), static_cast<long long>(stats.drafts_proposed));
    EXPECT_EQ(stats.steps + stats.drafts_accepted, g - 1);  // every token but the first from a step
  }
}

// Conditional disaggregation: a prompt the decode engine prefills itself (local_prompt) decodes
// to the golden greedy tokens, with and without MTP (whose KV over the prompt it also writes).
TEST_P(DecodeGolden, LocalPrefillGivesTheGoldenTokensWithAndWithoutMtp) {
  const auto g = static_cast<std::int64_t>(greedy_.size());
  for (const std::int64_t drafts : {0, 1, 2}) {
    DecodeStats stats;
    const auto got = decodeTogether({prompt_}, g, drafts, &stats, 64, {}, nullptr, /*local=*/true);
    EXPECT_EQ(got[0], greedy_) << GetParam() << " with " << drafts << " MTP drafts";
    EXPECT_EQ(stats.local_prefills, 1);
    EXPECT_EQ(stats.local_prefill_tokens, static_cast<std::int64_t>(prompt_.size()));
  }
}

// Local and remote prefill give the same stream, seeded sampling included (the first token is
// drawn as a prefill worker draws it), for a batch of mixed lengths, on F32, BF16 and FP8 pools.
TEST_P(DecodeGolden, LocalPrefillEqualsRemotePrefillSeededAndBatched) {
  std::vector<std::vector<std::int32_t>> prompts{
      prompt_, {prompt_.begin(), prompt_.begin() + 7}, {prompt_.rbegin(), prompt_.rend() - 13}, {prompt_[5]}};
  pd::SamplingParams sampling;
  sampling.temperature = 0.9;
  sampling.seed = 1234;
  // A BF16 pool too: the local prefill computes in float32 as a prefill worker does and only its
  // stored KV is rounded, so the tokens still match.
  auto bf16 = KvPool::create(engine_->config(), 128, 4, DType::BF16);
  ASSERT_TRUE(bf16.ok());
  // And an FP8 pool (kv_format.h): the prefill's float32 KV is quantized by tile as it lands, as
  // the local prefill's own writes are.
  auto fp8 = KvPool::create(engine_->config(), 128, 4, DType::F8E4M3);
  ASSERT_TRUE(fp8.ok());
  EXPECT_EQ(fp8->blockStride(), 4 * kvTokenBytes(DType::F8E4M3, engine_->config().latentDim()));
  EXPECT_EQ(fp8->compat(1, 1).tokenBytes(), kvTokenBytes(DType::F8E4M3, engine_->config().latentDim()));
  for (KvPool* pool : {pool_.get(), &*bf16, &*fp8}) {
    for (const std::int64_t drafts : {0, 1}) {
      const auto remote = decodeTogether(prompts, 12, drafts, nullptr, 64, sampling, pool);
      const auto local = decodeTogether(prompts, 12, drafts, nullptr, 64, sampling, pool, /*local=*/true);
      EXPECT_EQ(local, remote) << GetParam() << " with " << drafts << " MTP drafts, pool " << dtypeName(pool->dtype());
    }
  }
}

TEST_P(DecodeGolden, BadLocalPromptsAreRefusedHoldingNothing) {
  DecodeEngine dec(*engine_, *pool_, DecodeEngineOptions{});
  Stream s;
  DecodeRequest r = request(1, static_cast<std::int64_t>(prompt_.size()), 4, s);
  r.local_prompt = {prompt_.begin(), prompt_.end() - 1};  // one token short
  auto short_prompt = dec.admit(r);
  ASSERT_FALSE(short_prompt.ok());
  EXPECT_EQ(short_prompt.error().code, ErrorCode::InvalidArgument);
  r.local_prompt = prompt_;
  r.local_prompt[3] = static_cast<std::int32_t>(engine_->config().vocab_size);
  auto outside = dec.admit(r);
  ASSERT_FALSE(outside.ok());
  EXPECT_EQ(outside.error().code, ErrorCode::InvalidArgument);
  r.local_prompt.clear();
  r.forced_first_token = 3;  // only with a local prompt
  EXPECT_FALSE(dec.admit(r).ok());
  EXPECT_EQ(dec.numRequests(), 0U);
  EXPECT_TRUE(dec.blocks().isFullyFree());
}

TEST_P(DecodeGolden, BatchOfDifferentLengthsEqualsEachAloneAndSingleProcess) {
  std::vector<std::vector<std::int32_t>> prompts{
      prompt_, {prompt_.begin(), prompt_.begin() + 7}, {prompt_.rbegin(), prompt_.rend() - 13}, {prompt_[5]}};
  const std::int64_t max_tokens = 9;
  for (const std::int64_t drafts : {0, 1}) {
    const auto together = decodeTogether(prompts, max_tokens, drafts);
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      const auto alone = decodeTogether({prompts[i]}, max_tokens, drafts);
      EXPECT_EQ(together[i], alone[0]) << "prompt " << i << ", " << drafts << " drafts";
      model::GenerateOptions go;
      go.max_tokens = max_tokens;
      go.stop_at_eos = false;
      go.mtp_drafts = drafts;
      auto ref = model::generate(*engine_, prompts[i], go);
      ASSERT_TRUE(ref.ok()) << ref.error().toString();
      EXPECT_EQ(alone[0], ref->tokens) << "prompt " << i << " vs single-process generate";
    }
  }
}

TEST_P(DecodeGolden, AcceptedDraftsGiveTheSameTokensInFewerSteps) {
  std::vector<std::int32_t> sequence = prompt_;
  sequence.insert(sequence.end(), greedy_.begin(), greedy_.end());
  const auto g = static_cast<std::int64_t>(greedy_.size());
  for (const std::int64_t drafts : {1, 2}) {
    for (const double p : {1.0, 0.6}) {
      OracleDraftEngine oracle(*engine_, sequence, p);
      Stream s;
      DecodeEngine dec(oracle, *pool_, DecodeEngineOptions{drafts, 8});
      auto blocks = dec.admit(request(1, static_cast<std::int64_t>(prompt_.size()), g, s));
      ASSERT_TRUE(blocks.ok());
      ASSERT_TRUE(dec.onKvReady(1, prefill(*engine_, prompt_, *pool_, *blocks)).ok());
      while (dec.hasWork()) dec.step(Clock::now());
      EXPECT_EQ(s.tokens, greedy_) << drafts << " drafts, p = " << p;
      const DecodeStats& st = dec.stats();
      std::printf("  [decode] %s oracle p=%.1f k=%lld: %lld steps for %lld tokens, accepted %lld / %lld\n",
                  GetParam().c_str(), p, static_cast<long long>(drafts), static_cast<long long>(st.steps),
                  static_cast<long long>(g), static_cast<long long>(st.drafts_accepted),
                  static_cast<long long>(st.drafts_proposed));
      EXPECT_EQ(st.steps + st.drafts_accepted, g - 1);
      EXPECT_GT(st.drafts_accepted, 0);
      if (p == 1.0) {
        EXPECT_EQ(st.drafts_accepted, st.drafts_proposed);
      }
      EXPECT_LE(st.drafts_accepted, oracle.proposedRight());
      EXPECT_TRUE(dec.blocks().isFullyFree());
    }
  }
}

TEST_P(DecodeGolden, MoreRequestsThanBatchSlotsGiveTheSameTokens) {
  std::vector<std::vector<std::int32_t>> prompts;
  for (std::size_t len : {40U, 3U, 17U, 28U, 9U}) prompts.emplace_back(prompt_.begin(), prompt_.begin() + len);
  const auto wide = decodeTogether(prompts, 6, 1, nullptr, 64);
  const auto narrow = decodeTogether(prompts, 6, 1, nullptr, 2);  // the rest wait in the ready queue
  EXPECT_EQ(narrow, wide);
  EXPECT_EQ(wide[0], std::vector<std::int32_t>(greedy_.begin(), greedy_.begin() + 6));
}

TEST_P(DecodeGolden, SampledTokensDoNotDependOnSpeculation) {
  pd::SamplingParams sp;
  sp.temperature = 0.8;
  sp.top_k = 50;
  sp.seed = 1234;
  const std::vector<std::vector<std::int32_t>> prompts{prompt_, {prompt_.begin(), prompt_.begin() + 11}};
  const auto plain = decodeTogether(prompts, 12, 0, nullptr, 64, sp);
  EXPECT_NE(plain[0], std::vector<std::int32_t>(greedy_.begin(), greedy_.begin() + 12)) << "sampling had no effect";
  for (const std::int64_t drafts : {1, 2}) {
    EXPECT_EQ(decodeTogether(prompts, 12, drafts, nullptr, 64, sp), plain) << drafts << " drafts";
  }
  // Disaggregated sampling (first token drawn on the prefill side) equals single-process.
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    model::GenerateOptions go;
    go.max_tokens = 12;
    go.stop_at_eos = false;
    go.sampling = sp;
    auto ref = model::generate(*engine_, prompts[i], go);
    ASSERT_TRUE(ref.ok());
    EXPECT_EQ(plain[i], ref->tokens) << "prompt " << i;
  }
  // Drafts that are accepted (an oracle proposing the sampled continuation most of the time) must
  // not shift the sampler's random draws either.
  std::vector<std::int32_t> sequence = prompt_;
  sequence.insert(sequence.end(), plain[0].begin(), plain[0].end());
  OracleDraftEngine oracle(*engine_, sequence, 0.7);
  Stream s;
  DecodeEngine dec(oracle, *pool_, DecodeEngineOptions{2, 8});
  DecodeRequest r = request(1, static_cast<std::int64_t>(prompt_.size()), 12, s);
  r.sampling = sp;
  auto blocks = dec.admit(std::move(r));
  ASSERT_TRUE(blocks.ok());
  ASSERT_TRUE(dec.onKvReady(1, prefill(*engine_, prompt_, *pool_, *blocks, sp)).ok());
  while (dec.hasWork()) dec.step(Clock::now());
  EXPECT_EQ(s.tokens, plain[0]);
  EXPECT_GT(dec.stats().drafts_accepted, 0);
  EXPECT_TRUE(dec.blocks().isFullyFree());
}

// An engine that samples where it computes the logits (a SamplingEngine: the CUDA engine's device
// sampling) is handed every verify row with its request's draw counter and token counts, and the
// streams are the host samplers' tokens for every case of engineSamplingCases() (greedy, top-k,
// penalties, logit_bias and top logprobs), with 0 and 2 MTP drafts, two requests of different
// lengths batched. Here the SamplingEngine
// samples each row with a host Sampler rebuilt from the row's request (support/
// host_row_sampling_engine.h), so a wrong draw or count changes the tokens.
TEST_P(DecodeGolden, AnEngineThatSamplesGivesTheHostSamplersTokens) {
  pd::test_support::HostRowSamplingEngine sampling_engine(*engine_);
  const std::vector<std::vector<std::int32_t>> prompts{prompt_, {prompt_.begin(), prompt_.begin() + 9}};
  const std::vector<pd::SamplingParams> cases = pd::test_support::engineSamplingCases();
  for (std::size_t c = 0; c < cases.size(); ++c) {
    for (const std::int64_t drafts : {0, 2}) {
      DecodeStats host_stats;
      DecodeStats engine_stats;
      const auto host = decodeTogether(prompts, 12, drafts, &host_stats, 64, cases[c]);
      const int rows_before = sampling_engine.sampled_rows;
      const auto sampled =
          decodeTogether(prompts, 12, drafts, &engine_stats, 64, cases[c], nullptr, false, &sampling_engine);
      EXPECT_EQ(sampled, host) << "case " << c << ", " << drafts << " drafts";
      EXPECT_EQ(host_stats.engine_sampled_tokens, 0);
      // Every decode-step token came from the engine (the first token is the prefill side's).
      EXPECT_EQ(engine_stats.engine_sampled_tokens, engine_stats.tokens_generated) << "case " << c;
      EXPECT_GT(sampling_engine.sampled_rows, rows_before) << "case " << c;
    }
  }
}

// The CUDA engine keeps a device copy of the pool and re-reads only what the pool's block epochs
// say changed (model::CacheResidency). Run through a CPU stand-in for that copy (support/
// resident_cache_engine.h: it checks every position a call reads against the pool), the streams
// equal the plain engine's and no position is ever read stale: remote and local prefill (a
// scratch cache in between), 0 and 2 drafts, seeded sampling, a batch of mixed lengths, requests
// waiting for batch slots (their blocks reused), a BF16 pool, and pools shared by successive
// decode engines. The copy re-reads far less than every prefix on every call.
TEST_P(DecodeGolden, AResidentCacheCopyIsNeverStaleAndGivesTheSameTokens) {
  pd::test_support::ResidentCacheEngine resident(*engine_);
  std::vector<std::vector<std::int32_t>> prompts;
  for (std::size_t len : {40U, 3U, 17U, 28U, 9U}) prompts.emplace_back(prompt_.begin(), prompt_.begin() + len);
  pd::SamplingParams sampling;
  sampling.temperature = 0.9;
  sampling.seed = 77;
  auto bf16 = KvPool::create(engine_->config(), 40, 4, DType::BF16);  // small: blocks change owners
  ASSERT_TRUE(bf16.ok());
  for (KvPool* pool : {pool_.get(), &*bf16}) {
    for (const std::int64_t drafts : {0, 2}) {
      for (const bool local : {false, true}) {
        for (const std::int64_t slots : {64, 2}) {
          const auto plain = decodeTogether(prompts, 10, drafts, nullptr, slots, sampling, pool, local);
          const auto copied = decodeTogether(prompts, 10, drafts, nullptr, slots, sampling, pool, local, &resident);
          EXPECT_EQ(copied, plain) << "drafts " << drafts << (local ? " local" : " remote") << ", " << slots
                                   << " slots, pool " << dtypeName(pool->dtype());
          EXPECT_EQ(resident.stale_positions, 0);
        }
      }
    }
  }
  EXPECT_GT(resident.copied_positions, 0);
  // Each call reads its sequences' whole prefixes; the copy re-read a fraction of that.
  EXPECT_LT(resident.copied_positions * 4, resident.read_positions)
      << resident.copied_positions << " copied for " << resident.read_positions << " read";
  std::printf("  [residency] %lld positions copied for %lld read\n", static_cast<long long>(resident.copied_positions),
              static_cast<long long>(resident.read_positions));
}

// model::generate's cache is written by the engine alone, so it gives its blocks fixed epochs:
// an engine with a copy of the cache copies nothing at all, in chunked prefill and with chained
// MTP drafts, and the tokens are the plain engine's.
TEST_P(DecodeGolden, GenerateOnAResidentCacheCopyCopiesNothing) {
  pd::test_support::ResidentCacheEngine resident(*engine_);
  for (const std::int64_t drafts : {0, 2}) {
    model::GenerateOptions go;
    go.max_tokens = 12;
    go.mtp_drafts = drafts;
    go.prefill_chunk = 5;
    go.block_size = 4;
    go.sampling.temperature = 0.8;
    go.sampling.seed = 9;
    auto plain = model::generate(*engine_, prompt_, go);
    auto copied = model::generate(resident, prompt_, go);
    ASSERT_TRUE(plain.ok() && copied.ok());
    EXPECT_EQ(copied->tokens, plain->tokens) << drafts << " drafts";
  }
  EXPECT_EQ(resident.stale_positions, 0);
  EXPECT_EQ(resident.copied_positions, 0);
  EXPECT_GT(resident.read_positions, 0);
}

// n = 3 (header comment of decode_engine.h, "Choices"): one prompt's KV, three sequences sharing
// its blocks. Each choice's tokens equal an n = 1 run seeded choiceSeed(seed, choice) — choice 0
// the plain seed — with and without MTP; the prompt's blocks are shared while they run; the pool
// ends fully free.
TEST_P(DecodeGolden, ChoicesShareThePromptAndEachEqualsItsOwnSeededRun) {
  pd::SamplingParams sp;
  sp.temperature = 0.9;
  sp.top_k = 50;
  sp.seed = 4242;
  const auto n = static_cast<std::int64_t>(prompt_.size());
  std::vector<std::vector<std::int32_t>> alone;
  for (std::int64_t c = 0; c < 3; ++c) {
    pd::SamplingParams own = sp;
    own.seed = pd::choiceSeed(sp.seed, c);
    alone.push_back(decodeTogether({prompt_}, 10, 0, nullptr, 64, own)[0]);
  }
  EXPECT_TRUE(alone[0] != alone[1] || alone[1] != alone[2]) << "the choices' seeds had no effect";
  // Also on a resident copy of the cache (support/resident_cache_engine.h): the forks' copied
  // blocks (KvPool::copyBlock) are re-read, never stale.
  pd::test_support::ResidentCacheEngine resident(*engine_);
  for (const auto& [drafts, dec_engine] : std::vector<std::pair<std::int64_t, model::Engine*>>{
           {0, engine_.get()}, {1, engine_.get()}, {0, &resident}, {1, &resident}}) {
    std::vector<Stream> streams(3);
    {
      DecodeEngine dec(*dec_engine, *pool_, DecodeEngineOptions{drafts, 8});
      DecodeRequest r = request(1, n, 10, streams[0]);
      r.sampling = sp;
      r.choices = 3;
      auto blocks = dec.admit(std::move(r));
      ASSERT_TRUE(blocks.ok()) << blocks.error().toString();
      EXPECT_EQ(dec.blocks().usedBlocks(), static_cast<std::int64_t>(blocks->size()) + 2);  // + the copies
      ASSERT_TRUE(dec.attach(1, 2, 12, streams[2].sink()).ok());
      ASSERT_TRUE(dec.attach(1, 1, 11, streams[1].sink()).ok());
      EXPECT_EQ(dec.attach(1, 1, 13, streams[1].sink()).error().code, ErrorCode::InvalidArgument);  // taken
      EXPECT_EQ(dec.attach(1, 3, 13, streams[1].sink()).error().code, ErrorCode::InvalidArgument);  // out of range
      EXPECT_EQ(dec.attach(1, 2, 1, streams[1].sink()).error().code, ErrorCode::InvalidArgument);   // id in use
      ASSERT_TRUE(dec.onKvReady(1, prefill(*engine_, prompt_, *pool_, *blocks, sp, 0, {}, 3)).ok());
      EXPECT_EQ(dec.attach(1, 1, 14, streams[1].sink()).error().code, ErrorCode::NotFound);  // forked already
      EXPECT_EQ(dec.numRequests(), 3U);
      EXPECT_EQ(dec.blocks().sharedBlocks(), static_cast<std::int64_t>(blocks->size()) - 1);
      for (int guard = 0; dec.hasWork() && guard < 1000; ++guard) dec.step(Clock::now());
      EXPECT_EQ(dec.numRequests(), 0U);
      EXPECT_TRUE(dec.blocks().isFullyFree());
    }
    for (std::size_t c = 0; c < 3; ++c) {
      EXPECT_EQ(streams[c].finish_events, 1);
      EXPECT_EQ(streams[c].finish, FinishReason::Length);
      EXPECT_EQ(streams[c].tokens, alone[c]) << "choice " << c << ", " << drafts << " drafts";
    }
  }
  EXPECT_EQ(resident.stale_positions, 0);
  EXPECT_GT(resident.copied_positions, 0);
}

// Ending one choice (abort, or preemption when the pool runs dry) leaves the others running to
// the same tokens; a request that ends before its KV ends its attached choices with it; an
// attached choice can be aborted before the fork; the pool is fully free after each case.
TEST_P(DecodeGolden, ChoicesEndOnTheirOwnAndWithAParentThatNeverGotItsKv) {
  const auto n = static_cast<std::int64_t>(prompt_.size());
  const auto greedy8 = decodeTogether({prompt_}, 8, 0)[0];
  {
    std::vector<Stream> streams(3);
    DecodeEngine dec(*engine_, *pool_, DecodeEngineOptions{0, 8});
    DecodeRequest r = request(1, n, 8, streams[0]);
    r.choices = 3;
    auto blocks = dec.admit(std::move(r));
    ASSERT_TRUE(blocks.ok());
    ASSERT_TRUE(dec.attach(1, 1, 11, streams[1].sink()).ok());
    ASSERT_TRUE(dec.attach(1, 2, 12, streams[2].sink()).ok());
    ASSERT_TRUE(dec.onKvReady(1, prefill(*engine_, prompt_, *pool_, *blocks, {}, 0, {}, 3)).ok());
    dec.step(Clock::now());
    EXPECT_TRUE(dec.abort(11));  // a stop string on choice 1, say
    for (int guard = 0; dec.hasWork() && guard < 1000; ++guard) dec.step(Clock::now());
    EXPECT_EQ(streams[1].finish, FinishReason::Aborted);
    EXPECT_EQ(streams[0].tokens, greedy8);
    EXPECT_EQ(streams[2].tokens, greedy8);  // greedy: every choice is the same
    EXPECT_TRUE(dec.blocks().isFullyFree());
  }
  {
    std::vector<Stream> streams(3);
    DecodeEngine dec(*engine_, *pool_, DecodeEngineOptions{0, 8});
    DecodeRequest r = request(1, n, 8, streams[0]);
    r.choices = 3;
    ASSERT_TRUE(dec.admit(std::move(r)).ok());
    ASSERT_TRUE(dec.attach(1, 1, 11, streams[1].sink()).ok());
    ASSERT_TRUE(dec.attach(1, 2, 12, streams[2].sink()).ok());
    EXPECT_TRUE(dec.abort(12));  // detached before the fork
    EXPECT_EQ(streams[2].finish, FinishReason::Aborted);
    ASSERT_TRUE(dec.onKvReady(1, makeError(ErrorCode::PeerFailed, "the prefill worker died")).ok());
    for (std::size_t c = 0; c < 2; ++c) {
      EXPECT_EQ(streams[c].finish_events, 1) << c;
      EXPECT_EQ(streams[c].finish, FinishReason::Error) << c;
      ASSERT_TRUE(streams[c].error.has_value());
      EXPECT_EQ(streams[c].error->code, ErrorCode::PeerFailed);
    }
    EXPECT_EQ(dec.numRequests(), 0U);
    EXPECT_TRUE(dec.blocks().isFullyFree());
  }
  {
    // A pool too small for three growing choices: the latest (a choice) is preempted, the others
    // finish with the tokens they would have had alone, and the pool ends free.
    auto small = KvPool::create(engine_->config(), (n + 3) / 4 + 2 + 3, 4, DType::F32);
    ASSERT_TRUE(small.ok());
    std::vector<Stream> streams(3);
    {
      DecodeEngine dec(*engine_, *small, DecodeEngineOptions{0, 8});
      DecodeRequest r = request(1, n, 8, streams[0]);
      r.choices = 3;
      auto blocks = dec.admit(std::move(r));
      ASSERT_TRUE(blocks.ok()) << blocks.error().toString();
      ASSERT_TRUE(dec.attach(1, 1, 11, streams[1].sink()).ok());
      ASSERT_TRUE(dec.attach(1, 2, 12, streams[2].sink()).ok());
      ASSERT_TRUE(dec.onKvReady(1, prefill(*engine_, prompt_, *small, *blocks, {}, 0, {}, 3)).ok());
      for (int guard = 0; dec.hasWork() && guard < 1000; ++guard) dec.step(Clock::now());
      EXPECT_GT(dec.stats().preemptions, 0);
      EXPECT_TRUE(dec.blocks().isFullyFree());
    }
    EXPECT_TRUE(streams[2].preempted);
    EXPECT_EQ(streams[0].tokens, greedy8);
    EXPECT_EQ(streams[0].finish, FinishReason::Length);
  }
  // n > 1 on a resumed leg, and more choices than the engine serves, are refused.
  Stream s;
  DecodeEngineOptions one{0, 8};
  one.max_choices = 1;
  DecodeEngine dec(*engine_, *pool_, one);
  DecodeRequest r = request(1, n, 8, s);
  r.choices = 2;
  EXPECT_EQ(dec.admit(std::move(r)).error().code, ErrorCode::Unsupported);
  DecodeEngine dec2(*engine_, *pool_, DecodeEngineOptions{0, 8});
  DecodeRequest resumed = request(2, n, 8, s);
  resumed.choices = 2;
  resumed.resumed_tokens = {prompt_.back()};
  EXPECT_EQ(dec2.admit(std::move(resumed)).error().code, ErrorCode::InvalidArgument);
  EXPECT_TRUE(dec.blocks().isFullyFree());
  EXPECT_TRUE(dec2.blocks().isFullyFree());
}

TEST_P(DecodeGolden, Bf16PoolEqualsSingleProcessGenerationWithBf16Cache) {
  auto bf16 = KvPool::create(engine_->config(), 64, 8, DType::BF16);
  ASSERT_TRUE(bf16.ok());
  const auto g = static_cast<std::int64_t>(greedy_.size());
  model::GenerateOptions go;
  go.max_tokens = g;
  go.stop_at_eos = false;
  go.cache_dtype = DType::BF16;
  auto ref = model::generate(*engine_, prompt_, go);
  ASSERT_TRUE(ref.ok()) << ref.error().toString();
  for (const std::int64_t drafts : {0, 1}) {
    EXPECT_EQ(decodeTogether({prompt_}, g, drafts, nullptr, 64, {}, &*bf16)[0], ref->tokens) << drafts << " drafts";
  }
}

TEST_P(DecodeGolden, StopTokenEndsTheStreamWithStop) {
  Stream s;
  DecodeEngine dec(*engine_, *pool_, DecodeEngineOptions{1, 8});
  DecodeRequest r = request(1, static_cast<std::int64_t>(prompt_.size()), 24, s);
  r.stop_token_ids = {greedy_[3]};
  const auto stop_at = std::find(greedy_.begin(), greedy_.end(), greedy_[3]) - greedy_.begin();
  auto blocks = dec.admit(std::move(r));
  ASSERT_TRUE(blocks.ok());
  ASSERT_TRUE(dec.onKvReady(1, prefill(*engine_, prompt_, *pool_, *blocks)).ok());
  while (dec.hasWork()) dec.step(Clock::now());
  EXPECT_EQ(s.finish, FinishReason::Stop);
  EXPECT_EQ(s.tokens, std::vector<std::int32_t>(greedy_.begin(), greedy_.begin() + stop_at + 1));
  EXPECT_TRUE(dec.blocks().isFullyFree());
}

TEST_P(DecodeGolden, EveryExitPathFreesEveryBlock) {
  std::map<std::uint64_t, Stream> s;
  DecodeEngine dec(*engine_, *pool_, DecodeEngineOptions{1, 8});
  const auto n = static_cast<std::int64_t>(prompt_.size());
  const Clock::time_point t0 = Clock::now();

  // 1: aborted while waiting for KV; 2: aborted while running; 3: KV deadline passes;
  // 4: the prefill side reports failure; 5: a record that does not match the request;
  // 6: the KV arrives after the request was aborted.
  for (std::uint64_t id = 1; id <= 6; ++id) {
    DecodeRequest r = request(id, n, 20, s[id]);
    r.kv_deadline = id == 3 ? t0 + std::chrono::milliseconds(10) : t0 + std::chrono::hours(1);
    ASSERT_TRUE(dec.admit(std::move(r)).ok());
  }
  EXPECT_TRUE(dec.abort(1));
  EXPECT_FALSE(dec.abort(1));
  ASSERT_TRUE(dec.onKvReady(2, prefill(*engine_, prompt_, *pool_,
                                       {dec.blocks().blockTable(2).begin(), dec.blocks().blockTable(2).end()}))
                  .ok());
  ASSERT_TRUE(dec.onKvReady(4, makeError(ErrorCode::PeerFailed, "prefill worker died")).ok());
  kvtransfer::CompletionRecord wrong;
  wrong.num_tokens = static_cast<std::uint32_t>(n - 1);
  ASSERT_TRUE(dec.onKvReady(5, std::move(wrong)).ok());
  EXPECT_TRUE(dec.abort(6));
  EXPECT_EQ(dec.onKvReady(6, kvtransfer::CompletionRecord{}).error().code, ErrorCode::NotFound);
  dec.step(t0);  // request 2 decodes; 3 still within its deadline
  EXPECT_EQ(s[3].finish_events, 0);
  dec.step(t0 + std::chrono::milliseconds(11));
  EXPECT_EQ(s[3].finish, FinishReason::Error);
  ASSERT_TRUE(s[3].error.has_value());
  EXPECT_EQ(s[3].error->code, ErrorCode::Timeout);
  EXPECT_GE(s[2].tokens.size(), 2U);
  EXPECT_TRUE(dec.abort(2));

  EXPECT_EQ(s[1].finish, FinishReason::Aborted);
  EXPECT_EQ(s[2].finish, FinishReason::Aborted);
  EXPECT_EQ(s[4].finish, FinishReason::Error);
  EXPECT_EQ(s[4].error->code, ErrorCode::PeerFailed);
  EXPECT_EQ(s[5].finish, FinishReason::Error);
  EXPECT_EQ(s[5].error->code, ErrorCode::Corrupt);
  EXPECT_EQ(s[6].finish, FinishReason::Aborted);
  for (auto& [id, st] : s) {
    EXPECT_EQ(st.finish_events, 1) << "request " << id;
    EXPECT_FALSE(st.after_finish) << "request " << id;
  }
  EXPECT_EQ(dec.numRequests(), 0U);
  EXPECT_FALSE(dec.hasWork());
  EXPECT_TRUE(dec.blocks().isFullyFree());
}

TEST_P(DecodeGolden, AnEngineFailureEndsTheBatchWithAnErrorAndFreesEveryBlock) {
  for (const std::int64_t drafts : {0, 1}) {
    FailingEngine failing(*engine_, 3);
    std::vector<Stream> s(3);
    DecodeEngine dec(failing, *pool_, DecodeEngineOptions{drafts, 8});
    for (std::uint64_t id = 1; id <= 3; ++id) {
      auto blocks = dec.admit(request(id, 10 + static_cast<std::int64_t>(id), 20, s[id - 1]));
      ASSERT_TRUE(blocks.ok());
      const std::vector<std::int32_t> prompt(prompt_.begin(), prompt_.begin() + 10 + static_cast<std::ptrdiff_t>(id));
      ASSERT_TRUE(dec.onKvReady(id, prefill(*engine_, prompt, *pool_, *blocks)).ok());
    }
    for (int i = 0; i < 5 && dec.hasWork(); ++i) dec.step(Clock::now());
    EXPECT_FALSE(dec.hasWork());
    for (Stream& st : s) {
      EXPECT_EQ(st.finish, FinishReason::Error);
      ASSERT_TRUE(st.error.has_value());
      EXPECT_EQ(st.error->code, ErrorCode::Internal);
      EXPECT_EQ(st.tokens.size(), 3U);  // the first token and two good steps
      EXPECT_EQ(st.finish_events, 1);
    }
    EXPECT_TRUE(dec.blocks().isFullyFree());
  }
}

TEST_P(DecodeGolden, AdmissionAnswersOverloadedAndResourceExhausted) {
  // 16 blocks of 4 tokens, 2 kept as headroom: a 56-token prompt takes 14, whatever its
  // max_tokens (blocks are granted as tokens come).
  auto small = KvPool::create(engine_->config(), 16, 4, DType::F32);
  ASSERT_TRUE(small.ok());
  std::map<std::uint64_t, Stream> s;
  DecodeEngineOptions options{0, 8};
  options.kv_headroom_blocks = 2;
  DecodeEngine dec(*engine_, *small, options);
  ASSERT_TRUE(dec.admit(request(1, 56, 150, s[1])).ok());
  EXPECT_EQ(dec.blocks().freeBlocks(), 2);
  auto full = dec.admit(request(2, 1, 1, s[2]));  // would eat into the headroom
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.error().code, ErrorCode::Overloaded);
  auto never = dec.admit(request(3, 65, 1, s[3]));  // the prompt alone is 17 blocks
  ASSERT_FALSE(never.ok());
  EXPECT_EQ(never.error().code, ErrorCode::ResourceExhausted);
  auto too_long = dec.admit(request(4, 250, 10, s[4]));
  ASSERT_FALSE(too_long.ok());
  EXPECT_EQ(too_long.error().code, ErrorCode::InvalidArgument);
  auto duplicate = dec.admit(request(1, 1, 1, s[5]));
  ASSERT_FALSE(duplicate.ok());
  EXPECT_EQ(duplicate.error().code, ErrorCode::InvalidArgument);
  EXPECT_TRUE(dec.abort(1));
  EXPECT_TRUE(dec.admit(request(2, 1, 1, s[2])).ok());  // a retry after capacity frees up
  EXPECT_EQ(s[3].finish_events, 0);                     // refused requests never stream
  EXPECT_TRUE(dec.abort(2));
  EXPECT_TRUE(dec.blocks().isFullyFree());
}

// A pool that holds about two of four requests at their full length: the engine preempts the
// latest admitted when a step cannot get a block; each preempted request is resumed as the router
// would (prompt + its tokens so far re-prefilled, the sampler resumed after them) once admission
// lets it in. Every request's tokens equal the same request decoded alone in a roomy pool —
// greedy and seeded, with and without MTP — and the pool ends fully free.
TEST_P(DecodeGolden, PreemptedRequestsResumeToTheSameTokens) {
  std::vector<std::vector<std::int32_t>> prompts;
  for (std::size_t len : {9U, 6U, 11U, 7U}) prompts.emplace_back(prompt_.begin(), prompt_.begin() + len);
  const std::int64_t max_tokens = 14;
  pd::SamplingParams seeded;
  seeded.temperature = 0.9;
  seeded.top_k = 40;
  seeded.seed = 77;
  for (const pd::SamplingParams& sp : {pd::SamplingParams{}, seeded}) {
    for (const std::int64_t drafts : {0, 1}) {
      const auto alone = [&] {
        std::vector<std::vector<std::int32_t>> out;
        for (const auto& p : prompts) out.push_back(decodeTogether({p}, max_tokens, drafts, nullptr, 64, sp)[0]);
        return out;
      }();
      auto tight = KvPool::create(engine_->config(), 12, 4, DType::F32);  // 48 tokens; all four need 88
      ASSERT_TRUE(tight.ok());
      DecodeEngineOptions options{drafts, 8};
      options.kv_headroom_blocks = 1;
      DecodeEngine dec(*engine_, *tight, options);
      struct Job {
        std::vector<std::int32_t> tokens;  // over every leg
        std::deque<Stream> legs;           // stable addresses for the sinks
        bool running = false;              // a leg is admitted and not yet seen to end
        bool skip_first = false;           // the running leg repeats the last token first
        bool done = false;
      };
      std::vector<Job> jobs(prompts.size());
      std::vector<std::size_t> waiting;  // not admitted yet (fresh or preempted)
      for (std::size_t i = 0; i < prompts.size(); ++i) waiting.push_back(i);
      std::uint64_t next_id = 1;
      const auto admitWaiting = [&] {
        std::vector<std::size_t> still;
        for (const std::size_t i : waiting) {
          // As the router resumes (generation_resume.h): the tokens so far but the last are
          // prefilled as resumed tokens, the last is the leg's forced first token.
          Job& job = jobs[i];
          const std::size_t resumed = job.tokens.empty() ? 0 : job.tokens.size() - 1;
          std::vector<std::int32_t> full = prompts[i];
          full.insert(full.end(), job.tokens.begin(), job.tokens.begin() + static_cast<std::ptrdiff_t>(resumed));
          job.legs.emplace_back();
          DecodeRequest r = request(next_id, static_cast<std::int64_t>(full.size()),
                                    max_tokens - static_cast<std::int64_t>(resumed), job.legs.back());
          r.sampling = sp;
          r.resumed_tokens.assign(full.end() - static_cast<std::ptrdiff_t>(resumed), full.end());
          auto blocks = dec.admit(std::move(r));
          if (!blocks.ok()) {
            ASSERT_EQ(blocks.error().code, ErrorCode::Overloaded) << blocks.error().toString();
            job.legs.pop_back();
            still.push_back(i);
            continue;
          }
          job.running = true;
          job.skip_first = !job.tokens.empty();
          kvtransfer::CompletionRecord rec = prefill(*engine_, full, *tight, *blocks, sp, resumed);
          if (job.skip_first) rec.first_token = job.tokens.back();
          ASSERT_TRUE(dec.onKvReady(next_id, std::move(rec)).ok());
          ++next_id;
        }
        waiting = std::move(still);
      };
      admitWaiting();
      ASSERT_LT(waiting.size(), prompts.size());
      for (int guard = 0; guard < 2000 && (dec.hasWork() || !waiting.empty()); ++guard) {
        dec.step(Clock::now());
        for (std::size_t i = 0; i < jobs.size(); ++i) {
          Job& job = jobs[i];
          if (!job.running || !job.legs.back().finish) continue;
          job.running = false;
          Stream& leg = job.legs.back();
          ASSERT_EQ(leg.finish_events, 1);
          auto from = leg.tokens.begin();
          if (job.skip_first && from != leg.tokens.end()) {
            ASSERT_EQ(*from, job.tokens.back());
            ++from;
          }
          job.tokens.insert(job.tokens.end(), from, leg.tokens.end());
          if (leg.preempted) {
            ASSERT_EQ(leg.finish, FinishReason::Aborted);
            ASSERT_TRUE(leg.error.has_value());
            EXPECT_EQ(leg.error->code, ErrorCode::Overloaded);
            if (std::find(waiting.begin(), waiting.end(), i) == waiting.end()) waiting.push_back(i);
          } else {
            ASSERT_EQ(leg.finish, FinishReason::Length) << (leg.error ? leg.error->toString() : "");
            job.done = true;
          }
        }
        admitWaiting();
      }
      const std::string what = fmt::format("temperature {}, {} drafts", sp.temperature, drafts);
      EXPECT_GT(dec.stats().preemptions, 0) << what;
      for (std::size_t i = 0; i < jobs.size(); ++i) {
        EXPECT_TRUE(jobs[i].done) << what << ", request " << i;
        EXPECT_EQ(jobs[i].tokens, alone[i]) << what << ", request " << i << " (" << jobs[i].legs.size() << " legs)";
      }
      EXPECT_EQ(dec.numRequests(), 0U);
      EXPECT_TRUE(dec.blocks().isFullyFree()) << what;
    }
  }
}

// The request that cannot get a block is preempted itself when it is the latest admitted; one
// admitted earlier keeps its blocks and runs on.
TEST_P(DecodeGolden, PreemptionTakesTheLatestAdmittedFirst) {
  auto tight = KvPool::create(engine_->config(), 6, 4, DType::F32);
  ASSERT_TRUE(tight.ok());
  std::map<std::uint64_t, Stream> s;
  DecodeEngine dec(*engine_, *tight, DecodeEngineOptions{0, 8});
  const std::vector<std::int32_t> p1(prompt_.begin(), prompt_.begin() + 8);  // 2 blocks
  const std::vector<std::int32_t> p2(prompt_.begin(), prompt_.begin() + 4);  // 1 block
  auto b1 = dec.admit(request(1, 8, 20, s[1]));
  auto b2 = dec.admit(request(2, 4, 20, s[2]));
  ASSERT_TRUE(b1.ok() && b2.ok());
  // The record's trace context reaches the first event only (the decode server's kv_record span).
  const std::string traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  kvtransfer::CompletionRecord rec2 = prefill(*engine_, p2, *tight, *b2);
  rec2.traceparent = traceparent;
  ASSERT_TRUE(dec.onKvReady(2, std::move(rec2)).ok());
  ASSERT_TRUE(dec.onKvReady(1, prefill(*engine_, p1, *tight, *b1)).ok());
  for (int i = 0; i < 40 && dec.hasWork() && !s[2].finish; ++i) dec.step(Clock::now());
  ASSERT_TRUE(s[2].finish.has_value());
  EXPECT_TRUE(s[2].preempted);
  ASSERT_GE(s[2].kv_traceparents.size(), 2U);
  EXPECT_EQ(s[2].kv_traceparents.front(), traceparent);
  for (std::size_t i = 1; i < s[2].kv_traceparents.size(); ++i) EXPECT_EQ(s[2].kv_traceparents[i], "") << i;
  EXPECT_EQ(s[1].kv_traceparents.front(), "");
  // Its prompt's block and the ones it grew, fewer than the pool's six (the other holds two).
  EXPECT_GE(s[2].preempted_blocks, 1);
  EXPECT_LE(s[2].preempted_blocks, 4);
  EXPECT_EQ(s[1].finish_events, 0);  // the older request still runs
  while (dec.hasWork()) dec.step(Clock::now());
  // Alone it runs into the pool's end too (6 blocks hold 24 positions, it needs 27) and, the
  // latest admitted left, preempts itself: a request never takes an older one's blocks.
  EXPECT_TRUE(s[1].preempted);
  EXPECT_EQ(s[1].preempted_blocks, 6);           // the whole pool
  EXPECT_EQ(s[1].tokens.size(), 24U - 8U + 1U);  // positions 8..23 cached, plus the token after
  EXPECT_EQ(dec.stats().preemptions, 2);
  EXPECT_TRUE(dec.blocks().isFullyFree());
}

// Decode-side prefix reuse (docs/kv-memory.md): turn 1's full prompt blocks enter the prefix cache
// when it ends (a request aborted before its KV arrived caches nothing); turn 2 (turn 1's prompt and
// more) is admitted on them (presentTokens), its prefill writes only the blocks after them, its
// greedy tokens are the golden ones, the shared blocks are never written, and every block ends
// back in the cache or on the free list.
TEST_P(DecodeGolden, PrefixReuseAttachesTurnOnesBlocksReadOnly) {
  // Run by the plain engine, then on a resident copy of the cache (support/resident_cache_engine.h):
  // the shared blocks are read from the copy, never stale.
  const auto run = [&](model::Engine& dec_engine) {
    const auto n = static_cast<std::int64_t>(prompt_.size());
    const auto g = static_cast<std::int64_t>(greedy_.size());
    ASSERT_GE(n, 24);
    DecodeEngineOptions o{1, 8};
    o.prefix_cache_blocks = 64;
    o.local_prefill_chunk_size = 4;  // one pool block per reuse granule
    o.model_hash = 0x5eed;
    std::map<std::uint64_t, Stream> s;
    DecodeEngine dec(dec_engine, *pool_, o);
    const std::vector<std::int32_t> turn1(prompt_.begin(), prompt_.begin() + 18);
    DecodeRequest r1 = request(1, 18, 4, s[1]);
    r1.prompt_token_ids = turn1;
    auto b1 = dec.admit(std::move(r1));
    ASSERT_TRUE(b1.ok());
    EXPECT_EQ(dec.presentTokens(1), 0);
    DecodeRequest r2 = request(2, 18, 4, s[2]);
    r2.prompt_token_ids = turn1;
    ASSERT_TRUE(dec.admit(std::move(r2)).ok());
    EXPECT_TRUE(dec.abort(2));
    EXPECT_EQ(dec.blocks().cachedBlocks(), 0);
    ASSERT_TRUE(dec.onKvReady(1, prefill(*engine_, turn1, *pool_, *b1)).ok());
    for (int guard = 0; dec.hasWork() && guard < 100; ++guard) dec.step(Clock::now());
    ASSERT_EQ(s[1].finish, FinishReason::Length);
    // 18 tokens in blocks of 4: blocks 0..3 are full and before the block of the last token.
    EXPECT_EQ(dec.blocks().cachedBlocks(), 4);
    EXPECT_TRUE(dec.blocks().isFreeButPrefixCache());

    DecodeRequest r3 = request(3, n, g, s[3]);
    r3.prompt_token_ids = prompt_;
    auto b3 = dec.admit(std::move(r3));
    ASSERT_TRUE(b3.ok());
    EXPECT_EQ(dec.presentTokens(3), 16);
    EXPECT_EQ(std::vector<std::int32_t>(b3->begin(), b3->begin() + 4),
              std::vector<std::int32_t>(b1->begin(), b1->begin() + 4));
    for (int i = 0; i < 4; ++i) EXPECT_EQ(dec.blocks().refCount((*b3)[static_cast<std::size_t>(i)]), 2);
    EXPECT_EQ(dec.stats().prefix_hit_tokens, 16);
    const auto present_rows = [&] {
      const std::int64_t dim = pool_->latentDim();
      std::vector<float> rows(static_cast<std::size_t>(pool_->numLayers() * 16 * dim));
      for (std::int64_t l = 0; l < pool_->numLayers(); ++l) {
        for (std::int64_t p = 0; p < 16; ++p) {
          model::readLatent(pool_->view(), l, *b3, p, rows.data() + (l * 16 + p) * dim);
        }
      }
      return rows;
    };
    const std::vector<float> before = present_rows();
    ASSERT_TRUE(dec.onKvReady(3, prefill(*engine_, prompt_, *pool_, *b3, {}, 0, {}, 1, 16)).ok());
    for (int guard = 0; dec.hasWork() && guard < 1000; ++guard) dec.step(Clock::now());
    EXPECT_EQ(s[3].finish, FinishReason::Length);
    EXPECT_EQ(s[3].tokens, greedy_) << "turn 2 on turn 1's blocks";
    EXPECT_EQ(present_rows(), before) << "a shared block was written";
    EXPECT_TRUE(dec.blocks().isFreeButPrefixCache());
    EXPECT_EQ(dec.blocks().cachedBlocks(), (n - 1) / 4);
    EXPECT_EQ(dec.blocks().freeBlocks(), pool_->numBlocks());
  };
  run(*engine_);
  pd::test_support::ResidentCacheEngine resident(*engine_);
  run(resident);
  EXPECT_EQ(resident.stale_positions, 0);
  EXPECT_GT(resident.copied_positions, 0);
}

INSTANTIATE_TEST_SUITE_P(Golden, DecodeGolden, ::testing::Values("tiny-bf16", "tiny-fp8"));

}  // namespace
}  // namespace pd::decode
