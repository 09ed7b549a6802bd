// The prefill engine loop against DeepSeek's reference outputs (tests/data/golden): the latent KV
// it ships per layer (main layers and the MTP layer) and its first token, whether the prompt runs
// whole, in chunks or batched with others, into memory or through the loopback transport; and
// its failure paths (cancel, deadline, overload).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fakes/loopback_transport.h"
#include "pd/common/choices.h"
#include "pd/common/dtype.h"
#include "pd/engine/engine.h"
#include "pd/engine/safetensors.h"
#include "pd/prefill/prefill_engine.h"
#include "pd/prefill/transport_kv_sink.h"
#include "unit/prefill/prefill_golden.h"

namespace pd::prefill {
namespace {

namespace kvt = pd::kvtransfer;

using testsupport::expectClose;
using testsupport::Golden;
using testsupport::goldenDir;

// What an in-memory destination saw: every layer's rows by position, and the outcome.
struct Shipped {
  std::map<std::uint32_t, std::map<std::int64_t, std::vector<float>>> rows;  // layer -> pos -> latent
  std::optional<kvt::CompletionRecord> record;
  std::optional<Error> failure;
  int puts = 0;
  std::map<std::uint32_t, int> layer_puts;  // layer -> puts of it
  int endings = 0;
  int admitted = 0;
  int puts_before_admitted = 0;
  std::int64_t cached_tokens = -1;  // what prefixCached() said (-1: never called)
};

class MemorySink final : public KvSink {
 public:
  MemorySink(Shipped& out, std::int64_t latent_dim) : out_(out), dim_(latent_dim) {}
  void admitted() override { ++out_.admitted; }
  void prefixCached(std::int64_t tokens) override { out_.cached_tokens = tokens; }
  Status putLayer(std::uint32_t layer, std::int64_t first_pos, std::span<const float> rows) override {
    if (out_.admitted == 0) ++out_.puts_before_admitted;
    ++out_.puts;
    ++out_.layer_puts[layer];
    for (std::size_t i = 0; i * static_cast<std::size_t>(dim_) < rows.size(); ++i) {
      const auto* row = rows.data() + i * static_cast<std::size_t>(dim_);
      out_.rows[layer][first_pos + static_cast<std::int64_t>(i)] = std::vector<float>(row, row + dim_);
    }
    return okStatus();
  }
  void complete(kvt::CompletionRecord record) override {
    ++out_.endings;
    out_.record = std::move(record);
  }
  void fail(const Error& reason) override {
    ++out_.endings;
    out_.failure = reason;
  }

 private:
  Shipped& out_;
  std::int64_t dim_;
};

// [positions, part] of one layer's shipped rows: c_kv (first r values) or k_pe (the rest).
std::vector<float> part(const Shipped& s, std::uint32_t layer, std::int64_t n, std::int64_t begin, std::int64_t end) {
  std::vector<float> out;
  const auto& rows = s.rows.at(layer);
  for (std::int64_t p = 0; p < n; ++p) {
    const std::vector<float>& row = rows.at(p);
    out.insert(out.end(), row.begin() + begin, row.begin() + end);
  }
  return out;
}

std::vector<float> prefixRows(const std::vector<float>& v, std::int64_t rows, std::int64_t width) {
  return {v.begin(), v.begin() + rows * width};
}

class PrefillGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto e = model::createCpuEngine(goldenDir() / GetParam(), model::CpuEngineOptions{2, std::nullopt, false});
    ASSERT_TRUE(e.ok()) << e.error().toString();
    engine_ = std::move(e).value();
    golden_ = std::make_unique<Golden>(goldenDir() / GetParam() / "golden.safetensors");
    prompt_ = golden_->ids("p0.tokens");
    greedy_ = golden_->ids("p0.greedy");
  }
  const ModelConfig& cfg() const { return engine_->config(); }
  std::int64_t dim() const { return cfg().latentDim(); }

  std::unique_ptr<PrefillEngine> makePrefill(PrefillEngineOptions o) {
    auto p = PrefillEngine::create(*engine_, std::move(o));
    PD_CHECK_MSG(p.ok(), "cannot create the prefill engine");
    return std::move(p).value();
  }
  PrefillRequest request(std::uint64_t id, std::vector<std::int32_t> tokens, Shipped& out) {
    PrefillRequest r;
    r.id = id;
    r.tokens = std::move(tokens);
    r.sink = std::make_unique<MemorySink>(out, dim());
    return r;
  }
  static void drain(PrefillEngine& p) {
    for (int i = 0; i < 10000 && p.step(); ++i) {
    }
  }
  // The golden checks of one prompt's shipped KV, first token and hidden state.
  void expectGolden(const std::string& tag, const Shipped& s) {
    ASSERT_TRUE(s.record.has_value()) << (s.failure ? s.failure->toString() : "no outcome");
    const auto n = static_cast<std::int64_t>(prompt_.size());
    const std::int64_t r = cfg().kv_lora_rank;
    std::vector<float> kv, pe;
    for (std::int64_t l = 0; l < cfg().num_hidden_layers; ++l) {
      const std::vector<float> a = part(s, static_cast<std::uint32_t>(l), n, 0, r);
      const std::vector<float> b = part(s, static_cast<std::uint32_t>(l), n, r, dim());
      kv.insert(kv.end(), a.begin(), a.end());
      pe.insert(pe.end(), b.begin(), b.end());
    }
    const std::string name = GetParam() + " " + tag;
    expectClose(name + " kv_cache", kv, golden_->f32("p0.kv_cache"));
    expectClose(name + " pe_cache", pe, golden_->f32("p0.pe_cache"));
    const auto mtp = static_cast<std::uint32_t>(cfg().num_hidden_layers);
    expectClose(name + " mtp_kv_cache_nozero[:N]", part(s, mtp, n, 0, r),
                prefixRows(golden_->f32("p0.mtp_kv_cache_nozero"), n, r));
    expectClose(name + " mtp_pe_cache_nozero[:N]", part(s, mtp, n, r, dim()),
                prefixRows(golden_->f32("p0.mtp_pe_cache_nozero"), n, dim() - r));
    EXPECT_EQ(s.rows.size(), static_cast<std::size_t>(cfg().kvLayers())) << "layers shipped";
    EXPECT_EQ(s.record->first_token, greedy_[0]);
    EXPECT_EQ(s.record->num_tokens, static_cast<std::uint32_t>(n));
    const std::vector<float> hf = golden_->f32("p0.hidden_final");
    expectClose(name + " hidden_state (last row)", s.record->hidden_state,
                std::vector<float>(hf.end() - cfg().hidden_size, hf.end()));
  }

  std::unique_ptr<model::Engine> engine_;
  std::unique_ptr<Golden> golden_;
  std::vector<std::int32_t> prompt_;
  std::vector<std::int32_t> greedy_;
};

TEST_P(PrefillGolden, WholePromptShipsTheGoldenKvAndFirstToken) {
  auto p = makePrefill({.chunk_size = 512, .block_size = 16});
  Shipped s;
  PrefillRequest r = request(1, prompt_, s);
  r.logprobs = true;
  r.sampling.top_logprobs = 3;
  ASSERT_TRUE(p->submit(std::move(r)).ok());
  drain(*p);
  expectGolden("whole", s);
  EXPECT_EQ(s.endings, 1);
  EXPECT_EQ(s.admitted, 1);
  EXPECT_EQ(s.puts_before_admitted, 0);
  ASSERT_TRUE(s.record->first_logprob.has_value());
  EXPECT_EQ(s.record->first_logprob->token, greedy_[0]);
  ASSERT_EQ(s.record->top_logprobs.size(), 3U);
  EXPECT_EQ(s.record->top_logprobs[0].token, greedy_[0]);
  const PrefillEngineStats st = p->stats();
  EXPECT_EQ(st.completed, 1);
  EXPECT_EQ(st.running_requests, 0);
  EXPECT_EQ(st.free_blocks, 64);
  EXPECT_EQ(st.prompt_tokens, static_cast<std::int64_t>(prompt_.size()));
  EXPECT_GT(st.compute_seconds, 0.0);
}

TEST_P(PrefillGolden, ChunkedPrefillShipsTheSameKvAndToken) {
  // Chunks smaller than a block (3 < 4), straddling blocks (7), a block (4) and several blocks (16).
  for (const std::int64_t chunk : {3, 4, 7, 16}) {
    auto p = makePrefill({.chunk_size = chunk, .block_size = 4});
    Shipped s;
    ASSERT_TRUE(p->submit(request(7, prompt_, s)).ok());
    drain(*p);
    expectGolden("chunk=" + std::to_string(chunk), s);
    // Each layer of each chunk is a put, the MTP layer's on the same chunk grid.
    const auto chunks = (static_cast<std::int64_t>(prompt_.size()) + chunk - 1) / chunk;
    EXPECT_EQ(s.puts, chunks * (cfg().num_hidden_layers + 1));
  }
}

TEST_P(PrefillGolden, BatchedPromptsOfDifferentLengthsMatchEachAlone) {
  const std::vector<std::vector<std::int32_t>> prompts{
      prompt_, {prompt_.begin(), prompt_.begin() + 9}, {prompt_.begin() + 5, prompt_.begin() + 30}, {prompt_[3]}};
  std::vector<Shipped> alone(prompts.size());
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    auto p = makePrefill({.chunk_size = 512, .block_size = 8});
    ASSERT_TRUE(p->submit(request(i, prompts[i], alone[i])).ok());
    drain(*p);
    ASSERT_TRUE(alone[i].record.has_value());
  }
  // Several prompts per forward, a budget that splits them into chunks across steps.
  auto p = makePrefill({.chunk_size = 11, .token_budget = 24, .block_size = 8});
  std::vector<Shipped> together(prompts.size());
  for (std::size_t i = 0; i < prompts.size(); ++i)
    ASSERT_TRUE(p->submit(request(100 + i, prompts[i], together[i])).ok());
  drain(*p);
  expectGolden("batched", together[0]);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(together[i].record.has_value()) << i;
    EXPECT_EQ(together[i].record->first_token, alone[i].record->first_token) << i;
    ASSERT_EQ(together[i].rows.size(), alone[i].rows.size());
    for (const auto& [layer, rows] : alone[i].rows) {
      const auto n = static_cast<std::int64_t>(prompts[i].size());
      expectClose(GetParam() + " batched prompt " + std::to_string(i) + " layer " + std::to_string(layer),
                  part(together[i], layer, n, 0, dim()), part(alone[i], layer, n, 0, dim()));
    }
  }
  EXPECT_EQ(p->stats().free_blocks, 64);
}

TEST_P(PrefillGolden, SampledFirstTokenIsSeeded) {
  auto run = [&](std::uint64_t seed) {
    auto p = makePrefill({.block_size = 16});
    Shipped s;
    PrefillRequest r = request(1, prompt_, s);
    r.sampling.temperature = 1.0;
    r.sampling.seed = seed;
    EXPECT_TRUE(p->submit(std::move(r)).ok());
    drain(*p);
    return s.record ? s.record->first_token : -1;
  };
  const std::int32_t a = run(5);
  EXPECT_EQ(a, run(5));
  bool differs = false;
  for (std::uint64_t seed = 6; seed < 40 && !differs; ++seed) differs = run(seed) != a;
  EXPECT_TRUE(differs) << "the seed never changed the sampled token";
}

// n > 1: one prefill, n first tokens from the same logits; choice 0 is the n = 1 token of the
// seed, choice i the n = 1 token of choiceSeed(seed, i), each with its logprob when asked; one
// choice with a forced first token, or out of range, is refused.
TEST_P(PrefillGolden, ChoicesSampleTheirFirstTokensWithTheirOwnSeeds) {
  auto run = [&](std::uint64_t seed, std::int64_t choices) {
    auto p = makePrefill({.block_size = 16});
    Shipped s;
    PrefillRequest r = request(1, prompt_, s);
    r.sampling.temperature = 1.0;
    r.sampling.seed = seed;
    r.choices = choices;
    r.logprobs = true;
    EXPECT_TRUE(p->submit(std::move(r)).ok());
    drain(*p);
    EXPECT_TRUE(s.record.has_value());
    return s.record.value_or(kvt::CompletionRecord{});
  };
  const kvt::CompletionRecord many = run(21, 8);  // enough choices that some draw another token
  ASSERT_EQ(many.choice_tokens.size(), 7U);
  EXPECT_EQ(many.first_token, run(21, 1).first_token);
  EXPECT_TRUE(run(21, 1).choice_tokens.empty());
  bool differs = false;
  for (std::int64_t i = 1; i < 8; ++i) {
    const kvt::CompletionRecord alone = run(pd::choiceSeed(21, i), 1);
    const pd::SampledToken& c = many.choice_tokens[static_cast<std::size_t>(i - 1)];
    EXPECT_EQ(c.token, alone.first_token) << "choice " << i;
    ASSERT_TRUE(alone.first_logprob.has_value());
    EXPECT_EQ(c.logprob, alone.first_logprob->logprob) << "choice " << i;
    differs = differs || c.token != many.first_token;
  }
  EXPECT_TRUE(differs) << "every choice drew choice 0's token: the seeds had no effect";
  auto p = makePrefill({.block_size = 16});
  Shipped s;
  PrefillRequest forced = request(1, prompt_, s);
  forced.choices = 2;
  forced.forced_first_token = 3;
  EXPECT_EQ(p->submit(std::move(forced)).error().code, ErrorCode::InvalidArgument);
  PrefillRequest none = request(2, prompt_, s);
  none.choices = 0;
  EXPECT_EQ(p->submit(std::move(none)).error().code, ErrorCode::InvalidArgument);
}

TEST_P(PrefillGolden, CancelMidPrefillEndsWithAFailureAndFreesEverything) {
  auto p = makePrefill({.chunk_size = 4, .block_size = 4});
  Shipped running, queued;
  ASSERT_TRUE(p->submit(request(1, prompt_, running)).ok());
  ASSERT_TRUE(p->step());  // first chunk
  ASSERT_TRUE(p->submit(request(2, prompt_, queued)).ok());
  EXPECT_TRUE(p->cancel(1));
  EXPECT_TRUE(p->cancel(2));
  EXPECT_FALSE(p->cancel(3));
  const int puts_before = running.puts;
  (void)p->step();
  EXPECT_EQ(running.puts, puts_before) << "compute went on after the cancel";
  ASSERT_TRUE(running.failure.has_value());
  EXPECT_EQ(running.failure->code, ErrorCode::Cancelled);
  ASSERT_TRUE(queued.failure.has_value());
  EXPECT_EQ(queued.failure->code, ErrorCode::Cancelled);
  EXPECT_EQ(running.endings + queued.endings, 2);
  EXPECT_FALSE(p->step()) << "nothing left to do";
  const PrefillEngineStats st = p->stats();
  EXPECT_EQ(st.queued_requests, 0);
  EXPECT_EQ(st.queued_tokens, 0);
  EXPECT_EQ(st.running_requests, 0);
  EXPECT_EQ(st.failed, 2);
  EXPECT_EQ(st.free_blocks, 64);
  EXPECT_FALSE(p->cancel(1));
}

TEST_P(PrefillGolden, DeadlinesEndRunningAndQueuedRequests) {
  Clock::time_point now{};
  auto p = makePrefill({.chunk_size = 4, .cache_blocks = 10, .block_size = 4, .now = [&] { return now; }});
  Shipped running, queued;
  PrefillRequest a = request(1, prompt_, running);
  a.deadline = now + std::chrono::seconds(1);
  PrefillRequest b = request(2, prompt_, queued);  // waits: the cache holds one prompt
  b.deadline = now + std::chrono::seconds(2);
  ASSERT_TRUE(p->submit(std::move(a)).ok());
  ASSERT_TRUE(p->submit(std::move(b)).ok());
  ASSERT_TRUE(p->step());
  EXPECT_EQ(p->stats().queued_requests, 1);
  EXPECT_EQ(running.admitted, 1);
  EXPECT_EQ(queued.admitted, 0);
  now += std::chrono::seconds(3);
  (void)p->step();
  ASSERT_TRUE(running.failure.has_value());
  EXPECT_EQ(running.failure->code, ErrorCode::Timeout);
  ASSERT_TRUE(queued.failure.has_value());
  EXPECT_EQ(queued.failure->code, ErrorCode::Timeout);
  EXPECT_EQ(queued.admitted, 0) << "a request that ends while queued is never admitted";
  EXPECT_FALSE(p->step());
  const PrefillEngineStats st = p->stats();
  EXPECT_EQ(st.queued_requests + st.running_requests, 0);
  EXPECT_EQ(st.free_blocks, 10);
}

TEST_P(PrefillGolden, SubmitRefusesWhatCannotRun) {
  Shipped s;  // before the engine: its destructor fails the queued request into this sink
  auto p = makePrefill({.max_queued_requests = 1, .cache_blocks = 2, .block_size = 4});
  auto code = [&](PrefillRequest r) {
    Status st = p->submit(std::move(r));
    return st.ok() ? std::optional<ErrorCode>() : std::optional<ErrorCode>(st.error().code);
  };
  EXPECT_EQ(code(request(1, {}, s)), ErrorCode::InvalidArgument);
  EXPECT_EQ(code(request(1, {static_cast<std::int32_t>(cfg().vocab_size)}, s)), ErrorCode::InvalidArgument);
  EXPECT_EQ(code(request(1, prompt_, s)), ErrorCode::ResourceExhausted);
  EXPECT_EQ(code(request(1, {1, 2}, s)), std::nullopt);
  EXPECT_EQ(code(request(2, {1, 2}, s)), ErrorCode::Overloaded);
  EXPECT_EQ(s.endings, 0) << "a refused request's sink is never called";
}

TEST_P(PrefillGolden, EngineThreadServesSubmissions) {
  auto p = makePrefill({.chunk_size = 8, .block_size = 8});
  p->start();
  Shipped s;
  ASSERT_TRUE(p->submit(request(1, prompt_, s)).ok());
  for (int i = 0; i < 2000 && p->stats().completed == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  p->stop();
  expectGolden("threaded", s);
}

// A decode side and a prefill side on one loopback fabric, the decode pool registered as one
// region [layers][kBlocks][block_size][token bytes].
struct LoopbackPair {
  static constexpr std::uint32_t kBlocks = 12;

  LoopbackPair(const ModelConfig& cfg, DType dtype)
      : compat(makeCompat(cfg, dtype)),
        fabric(std::make_shared<kvt::fakes::LoopbackFabric>()),
        decode(fabric, compat),
        prefill(fabric, compat),
        block_bytes(std::uint64_t{compat.block_size} * compat.tokenBytes()),
        pool(block_bytes * kBlocks * compat.num_layers, std::byte{0}) {
    auto r = decode.registerRegion(pool);
    PD_CHECK_MSG(r.ok(), "cannot register the decode pool");
    region = *r;
  }
  ~LoopbackPair() { EXPECT_TRUE(decode.deregisterRegion(region).ok()); }
  LoopbackPair(const LoopbackPair&) = delete;
  LoopbackPair& operator=(const LoopbackPair&) = delete;
  LoopbackPair(LoopbackPair&&) = delete;
  LoopbackPair& operator=(LoopbackPair&&) = delete;

  static kvt::CompatInfo makeCompat(const ModelConfig& cfg, DType dtype) {
    kvt::CompatInfo c;
    c.model_hash = 42;
    c.kv_dtype = dtype;
    c.block_size = 8;
    c.num_layers = static_cast<std::uint32_t>(cfg.kvLayers());
    c.kv_dim = static_cast<std::uint32_t>(cfg.latentDim());
    return c;
  }
  kvt::KvDescriptor descriptor(std::uint64_t id, std::uint32_t num_tokens, std::vector<std::uint32_t> blocks) {
    const kvt::RegionLayout layout{region, 0, 0, compat.num_layers, block_bytes * kBlocks, block_bytes};
    auto target = decode.exportTarget(0, std::span(&layout, 1));
    PD_CHECK_MSG(target.ok(), "cannot export the decode target");
    kvt::KvDescriptor d;
    d.transfer_id = kvt::TransferId{0xfeed, id};  // kept by the decode side's grant (open)
    d.compat = compat;
    d.num_tokens = num_tokens;
    d.timeout_ms = 60000;
    d.block_ids = std::move(blocks);
    d.targets.push_back(*target);
    return d;
  }
  // Expects the record on the decode side and opens the prefill side's sink.
  std::unique_ptr<TransportKvSink> open(const kvt::KvDescriptor& d) {
    const auto deadline = kvt::Clock::now() + std::chrono::seconds(60);
    EXPECT_TRUE(decode
                    .expect(d.transfer_id.lo, deadline,
                            [this](std::uint64_t, Result<kvt::CompletionRecord> r) { arrived = std::move(r); })
                    .ok());
    EXPECT_TRUE(decode.grant(d.transfer_id.lo, d).ok());
    auto sink = TransportKvSink::create(prefill, d, deadline,
                                        [this](const kvt::TransferId&, Status s) { sent = std::move(s); });
    PD_CHECK_MSG(sink.ok(), "cannot open the transport sink");
    return std::move(sink).value();
  }

  // Declared before the transports, which outlive them: a transport's destructor cancels what
  // is still pending into these.
  std::optional<Result<kvt::CompletionRecord>> arrived;
  std::optional<Status> sent;
  kvt::CompatInfo compat;
  std::shared_ptr<kvt::fakes::LoopbackFabric> fabric;
  kvt::fakes::LoopbackTransport decode;
  kvt::fakes::LoopbackTransport prefill;
  std::uint64_t block_bytes;
  std::vector<std::byte> pool;
  kvt::RegionId region = 0;
};

// The loopback transport: a decode-side pool filled by the prefill engine through
// TransportKvSink holds the golden KV at the descriptor's blocks, and the record arrives.
TEST_P(PrefillGolden, LoopbackTransportFillsTheDecodePool) {
  const auto n = static_cast<std::uint32_t>(prompt_.size());
  LoopbackPair lp(cfg(), DType::F32);                                 // F32 is exact, so the golden tolerance applies
  const kvt::KvDescriptor d = lp.descriptor(9, n, {7, 2, 11, 0, 5});  // out of order: exercises paging
  auto p = makePrefill({.chunk_size = 16, .block_size = 8});
  PrefillRequest r;
  r.id = 1009;  // the engine's numbering differs from the decode worker's (the descriptor's 9)
  r.tokens = prompt_;
  r.sink = lp.open(d);
  ASSERT_TRUE(p->submit(std::move(r)).ok());
  drain(*p);

  ASSERT_TRUE(lp.sent.has_value());
  EXPECT_TRUE(lp.sent->ok()) << lp.sent->error().toString();
  ASSERT_TRUE(lp.arrived.has_value());
  ASSERT_TRUE(lp.arrived->ok()) << lp.arrived->error().toString();
  // Read the pool back as the decode worker would.
  Shipped s;
  const kvt::CompatInfo& c = lp.compat;
  for (std::uint32_t l = 0; l < c.num_layers; ++l) {
    for (std::uint32_t t = 0; t < n; ++t) {
      const std::byte* src = lp.pool.data() + l * lp.block_bytes * LoopbackPair::kBlocks +
                             d.block_ids[t / c.block_size] * lp.block_bytes + (t % c.block_size) * c.tokenBytes();
      std::vector<float> row(static_cast<std::size_t>(dim()));
      std::memcpy(row.data(), src, c.tokenBytes());
      s.rows[l][t] = std::move(row);
    }
  }
  s.record = std::move(*lp.arrived).value();
  expectGolden("loopback", s);
  // Blocks not in the descriptor stay untouched.
  for (const std::uint32_t b : {1U, 3U, 4U, 6U, 8U, 9U, 10U}) {
    const std::byte* blk = lp.pool.data() + b * lp.block_bytes;
    EXPECT_TRUE(std::all_of(blk, blk + lp.block_bytes, [](std::byte x) { return x == std::byte{0}; })) << b;
  }
}

TEST_P(PrefillGolden, LoopbackBf16PoolHoldsTheRoundedKv) {
  const auto n = static_cast<std::uint32_t>(prompt_.size());
  LoopbackPair lp(cfg(), DType::BF16);
  const kvt::KvDescriptor d = lp.descriptor(3, n, {0, 1, 2, 3, 4});
  Shipped mem;
  auto p = makePrefill({.chunk_size = 5, .block_size = 8});
  PrefillRequest r;
  r.id = 3;
  r.tokens = prompt_;
  r.sink = lp.open(d);
  ASSERT_TRUE(p->submit(std::move(r)).ok());
  ASSERT_TRUE(p->submit(request(4, prompt_, mem)).ok());
  drain(*p);
  ASSERT_TRUE(lp.arrived.has_value() && lp.arrived->ok());
  ASSERT_TRUE(mem.record.has_value());
  // Every shipped value is the BF16 rounding of what the in-memory destination got.
  const kvt::CompatInfo& c = lp.compat;
  std::size_t mismatches = 0;
  for (std::uint32_t l = 0; l < c.num_layers; ++l) {
    for (std::uint32_t t = 0; t < n; ++t) {
      const std::byte* src = lp.pool.data() + l * lp.block_bytes * LoopbackPair::kBlocks +
                             d.block_ids[t / c.block_size] * lp.block_bytes + (t % c.block_size) * c.tokenBytes();
      const std::vector<float>& want = mem.rows.at(l).at(t);
      for (std::size_t k = 0; k < want.size(); ++k) {
        std::uint16_t bits;
        std::memcpy(&bits, src + 2 * k, 2);
        mismatches += bits != floatToBf16(want[k]) ? 1 : 0;
      }
    }
  }
  EXPECT_EQ(mismatches, 0U);
}

TEST_P(PrefillGolden, LoopbackCancelledRequestSendsAFailureRecord) {
  LoopbackPair lp(cfg(), DType::BF16);
  const kvt::KvDescriptor d = lp.descriptor(4, static_cast<std::uint32_t>(prompt_.size()), {0, 1, 2, 3, 4});
  auto p = makePrefill({.chunk_size = 8, .block_size = 8});
  PrefillRequest r;
  r.id = 4;
  r.tokens = prompt_;
  r.sink = lp.open(d);
  ASSERT_TRUE(p->submit(std::move(r)).ok());
  ASSERT_TRUE(p->step());
  EXPECT_TRUE(p->cancel(4));
  (void)p->step();
  ASSERT_TRUE(lp.sent.has_value());
  EXPECT_EQ(lp.sent->error().code, ErrorCode::Cancelled);
  ASSERT_TRUE(lp.arrived.has_value());
  EXPECT_FALSE(lp.arrived->ok());
  EXPECT_EQ(p->stats().free_blocks, 64);
}

TEST_P(PrefillGolden, DecodePeerKilledMidStreamFailsTheRequest) {
  LoopbackPair lp(cfg(), DType::BF16);
  const kvt::KvDescriptor d = lp.descriptor(5, static_cast<std::uint32_t>(prompt_.size()), {0, 1, 2, 3, 4});
  auto p = makePrefill({.chunk_size = 8, .block_size = 8});
  PrefillRequest r;
  r.id = 5;
  r.tokens = prompt_;
  r.sink = lp.open(d);
  ASSERT_TRUE(p->submit(std::move(r)).ok());
  ASSERT_TRUE(p->step());
  lp.fabric->setPeerDown(d.targets[0].worker_address, true);
  ASSERT_TRUE(lp.sent.has_value()) << "the transport reports a killed peer at once";
  EXPECT_EQ(lp.sent->error().code, ErrorCode::PeerFailed);
  drain(*p);
  const PrefillEngineStats st = p->stats();
  EXPECT_EQ(st.failed, 1);
  EXPECT_EQ(st.completed, 0);
  EXPECT_EQ(st.running_requests, 0);
  EXPECT_EQ(st.free_blocks, 64);
}

// A destination that refuses puts from one layer on: the request fails with its error, nothing
// more is put to it, and a request batched with it is unaffected.
class RefusingSink final : public KvSink {
 public:
  RefusingSink(Shipped& out, std::uint32_t refuse_from) : out_(out), refuse_from_(refuse_from) {}
  Status putLayer(std::uint32_t layer, std::int64_t, std::span<const float>) override {
    ++out_.puts;
    if (layer >= refuse_from_) return makeError(ErrorCode::PeerFailed, "decode peer went away");
    return okStatus();
  }
  void complete(kvt::CompletionRecord record) override {
    ++out_.endings;
    out_.record = std::move(record);
  }
  void fail(const Error& reason) override {
    ++out_.endings;
    out_.failure = reason;
  }

 private:
  Shipped& out_;
  std::uint32_t refuse_from_;
};

TEST_P(PrefillGolden, PutErrorFailsOnlyItsRequest) {
  auto p = makePrefill({.chunk_size = 8, .block_size = 8});
  Shipped bad, good;
  PrefillRequest r;
  r.id = 1;
  r.tokens = prompt_;
  r.sink = std::make_unique<RefusingSink>(bad, 1);
  ASSERT_TRUE(p->submit(std::move(r)).ok());
  ASSERT_TRUE(p->submit(request(2, prompt_, good)).ok());
  drain(*p);
  ASSERT_TRUE(bad.failure.has_value());
  EXPECT_EQ(bad.failure->code, ErrorCode::PeerFailed);
  EXPECT_EQ(bad.puts, 2) << "layer 0 then the refused layer 1; nothing after";
  EXPECT_EQ(bad.endings, 1);
  expectGolden("next to a failed request", good);
  EXPECT_EQ(p->stats().free_blocks, 64);
}

// A destination that runs `on_put` after recording each put (to cancel or move the clock while
// the forward is in progress).
class HookSink final : public KvSink {
 public:
  HookSink(Shipped& out, std::function<void(std::uint32_t layer)> on_put) : out_(out), on_put_(std::move(on_put)) {}
  Status putLayer(std::uint32_t layer, std::int64_t, std::span<const float>) override {
    ++out_.puts;
    on_put_(layer);
    return okStatus();
  }
  void complete(kvt::CompletionRecord record) override {
    ++out_.endings;
    out_.record = std::move(record);
  }
  void fail(const Error& reason) override {
    ++out_.endings;
    out_.failure = reason;
  }

 private:
  Shipped& out_;
  std::function<void(std::uint32_t)> on_put_;
};

TEST_P(PrefillGolden, CancelDuringAForwardStopsItsPutsAtTheNextLayer) {
  auto p = makePrefill({.block_size = 16});
  Shipped s;
  PrefillRequest r;
  r.id = 8;
  r.tokens = prompt_;
  r.sink = std::make_unique<HookSink>(s, [&](std::uint32_t layer) {
    if (layer == 1) {
      EXPECT_TRUE(p->cancel(8));
    }
  });
  ASSERT_TRUE(p->submit(std::move(r)).ok());
  ASSERT_TRUE(p->step());
  EXPECT_EQ(s.puts, 2) << "layers 0 and 1 only";
  ASSERT_TRUE(s.failure.has_value());
  EXPECT_EQ(s.failure->code, ErrorCode::Cancelled);
  EXPECT_FALSE(p->step());
  EXPECT_EQ(p->stats().free_blocks, 64);
  EXPECT_EQ(p->stats().running_requests, 0);
}

TEST_P(PrefillGolden, DeadlineDuringTheMtpLayerFailsTheRequest) {
  Clock::time_point now{};
  auto p = makePrefill({.block_size = 16, .now = [&] { return now; }});
  Shipped s;
  PrefillRequest r;
  r.id = 8;
  r.tokens = prompt_;
  r.deadline = now + std::chrono::seconds(1);
  const auto last_main = static_cast<std::uint32_t>(cfg().num_hidden_layers - 1);
  r.sink = std::make_unique<HookSink>(s, [&](std::uint32_t layer) {
    if (layer == last_main) now += std::chrono::seconds(2);
  });
  ASSERT_TRUE(p->submit(std::move(r)).ok());
  ASSERT_TRUE(p->step());
  EXPECT_EQ(s.puts, cfg().num_hidden_layers) << "the MTP layer is not shipped past the deadline";
  ASSERT_TRUE(s.failure.has_value());
  EXPECT_EQ(s.failure->code, ErrorCode::Timeout);
  EXPECT_FALSE(s.record.has_value());
  EXPECT_EQ(p->stats().free_blocks, 64);
}

TEST_P(PrefillGolden, PrefixCacheSecondTurnEqualsAColdPrefillBitForBit) {
  // Turn 2 of a chat: turn 1's prompt, its greedy answer and a new question.
  const std::vector<std::int32_t> turn1 = prompt_;
  std::vector<std::int32_t> turn2 = prompt_;
  turn2.insert(turn2.end(), greedy_.begin(), greedy_.end());
  turn2.insert(turn2.end(), prompt_.begin(), prompt_.begin() + 5);
  Shipped cold;
  {
    auto p = makePrefill({.chunk_size = 12, .block_size = 4});
    ASSERT_TRUE(p->submit(request(1, turn2, cold)).ok());
    drain(*p);
    ASSERT_TRUE(cold.record.has_value());
    EXPECT_EQ(cold.cached_tokens, -1);
  }
  // Reuse comes in granules of lcm(block 4, chunk 12) = 12 tokens: 10 cached blocks, 9 reused.
  auto p = makePrefill({.chunk_size = 12, .block_size = 4, .prefix_cache_blocks = 32, .model_hash = 5});
  Shipped first;
  ASSERT_TRUE(p->submit(request(1, turn1, first)).ok());
  drain(*p);
  ASSERT_TRUE(first.record.has_value());
  EXPECT_EQ(first.cached_tokens, -1) << "nothing cached yet";
  const auto full = static_cast<std::int64_t>(turn1.size() / 4 * 4);
  EXPECT_EQ(p->stats().prefix_cached_blocks, full / 4);
  EXPECT_EQ(p->stats().free_blocks, 64) << "idle cached blocks count as available";

  Shipped warm;
  ASSERT_TRUE(p->submit(request(2, turn2, warm)).ok());
  drain(*p);
  ASSERT_TRUE(warm.record.has_value()) << (warm.failure ? warm.failure->toString() : "");
  const std::int64_t reused = std::min(full, static_cast<std::int64_t>(turn2.size() - 1)) / 12 * 12;
  ASSERT_GT(reused, 0);
  EXPECT_EQ(warm.cached_tokens, reused);
  const PrefillEngineStats st = p->stats();
  EXPECT_EQ(st.prefix_hit_tokens, reused);
  EXPECT_EQ(st.prefix_miss_tokens, static_cast<std::int64_t>(turn1.size() + turn2.size()) - reused);
  EXPECT_EQ(st.prompt_tokens, static_cast<std::int64_t>(turn1.size() + turn2.size()) - reused)
      << "the cached prefix is not recomputed";
  EXPECT_EQ(st.prefix_cached_blocks, static_cast<std::int64_t>(turn2.size() / 4));
  // Every layer (main and MTP) of every position, the first token and the hidden state: bit-equal.
  EXPECT_EQ(warm.rows.size(), static_cast<std::size_t>(cfg().kvLayers()));
  EXPECT_TRUE(warm.rows == cold.rows) << "the shipped KV differs from a cold prefill's";
  EXPECT_EQ(warm.record->first_token, cold.record->first_token);
  EXPECT_TRUE(warm.record->hidden_state == cold.record->hidden_state);
  // The MTP layer is not recomputed for the cached prefix either: one put of its cached rows,
  // then one per chunk of the suffix (a cold prefill: one per chunk of the prompt).
  const auto mtp = static_cast<std::uint32_t>(cfg().num_hidden_layers);
  const auto chunks = [](std::int64_t tokens) { return static_cast<int>((tokens + 11) / 12); };
  EXPECT_EQ(cold.layer_puts[mtp], chunks(static_cast<std::int64_t>(turn2.size())));
  EXPECT_EQ(warm.layer_puts[mtp], 1 + chunks(static_cast<std::int64_t>(turn2.size()) - reused));
}

TEST_P(PrefillGolden, PrefixCacheSharedByConcurrentRequestsAndEvictedUnderPressure) {
  const auto n = static_cast<std::int64_t>(prompt_.size());
  // Both follow the prompt with its greedy first token (a later turn starts with the answer), so
  // the prompt's last block, cached with that next token, matches both.
  std::vector<std::int32_t> a = prompt_, b = prompt_;
  a.insert(a.end(), {greedy_[0], 1});
  b.insert(b.end(), {greedy_[0], 2});
  std::vector<std::int32_t> big(prompt_.rbegin(), prompt_.rend());  // shares no leading block
  big.insert(big.end(), prompt_.begin(), prompt_.end());
  const std::int64_t pool = (static_cast<std::int64_t>(big.size()) + 3) / 4;  // exactly what `big` needs
  std::map<int, Shipped> cold;
  for (const auto& [i, tokens] : std::map<int, std::vector<std::int32_t>>{{0, a}, {1, b}, {2, big}}) {
    auto p = makePrefill({.chunk_size = 4, .block_size = 4});
    ASSERT_TRUE(p->submit(request(1, tokens, cold[i])).ok());
    drain(*p);
    ASSERT_TRUE(cold[i].record.has_value());
  }
  auto p = makePrefill(
      {.chunk_size = 4, .cache_blocks = pool, .block_size = 4, .prefix_cache_blocks = pool, .model_hash = 9});
  Shipped first;
  ASSERT_TRUE(p->submit(request(1, prompt_, first)).ok());
  drain(*p);
  // Two requests at once share the cached blocks (one step admits both; their MTP passes share
  // forwards and write only their own blocks).
  Shipped wa, wb;
  ASSERT_TRUE(p->submit(request(2, a, wa)).ok());
  ASSERT_TRUE(p->submit(request(3, b, wb)).ok());
  drain(*p);
  EXPECT_EQ(wa.cached_tokens, n / 4 * 4);
  EXPECT_EQ(wb.cached_tokens, n / 4 * 4);
  // Batched together their suffix rows share a forward (and its MoE expert GEMMs), which moves low
  // bits with or without the cache; a wrong or overwritten shared block would be far off.
  EXPECT_EQ(wa.rows.size(), cold[0].rows.size());
  for (const auto& [layer, rows] : cold[0].rows) {
    const auto l = static_cast<std::uint32_t>(layer);
    expectClose("shared a layer " + std::to_string(l), part(wa, l, n + 2, 0, dim()), part(cold[0], l, n + 2, 0, dim()));
    expectClose("shared b layer " + std::to_string(l), part(wb, l, n + 2, 0, dim()), part(cold[1], l, n + 2, 0, dim()));
  }
  ASSERT_TRUE(wa.record && wb.record);
  EXPECT_EQ(wa.record->first_token, cold[0].record->first_token);
  EXPECT_EQ(wb.record->first_token, cold[1].record->first_token);
  // `big` needs the whole pool: admission evicts every idle cached block, and is still exact.
  Shipped wbig;
  ASSERT_TRUE(p->submit(request(4, big, wbig)).ok());
  drain(*p);
  ASSERT_TRUE(wbig.record.has_value()) << (wbig.failure ? wbig.failure->toString() : "");
  EXPECT_EQ(wbig.cached_tokens, -1);
  EXPECT_TRUE(wbig.rows == cold[2].rows);
  EXPECT_GT(p->stats().prefix_evictions, 0);
  // The prompt's blocks are gone (big's own took their place): a cold run, still bit-equal.
  Shipped again;
  ASSERT_TRUE(p->submit(request(5, a, again)).ok());
  drain(*p);
  EXPECT_EQ(again.cached_tokens, -1);
  EXPECT_TRUE(again.rows == cold[0].rows);
  EXPECT_EQ(p->stats().running_requests, 0);
  EXPECT_EQ(p->stats().free_blocks, pool) << "every block free or idle in the cache";
}

TEST(PrefillEngineOptionsTest, FollowTheConfig) {
  PrefillConfig c;
  c.chunk_size = 3;
  c.token_budget = 5;
  c.max_queued_requests = 7;
  c.cache_blocks = 11;
  c.cache_block_size = 13;
  c.prefix_cache_blocks = 12;  // beyond cache_blocks: clamped
  const PrefillEngineOptions o = engineOptions(c);
  EXPECT_EQ(o.prefix_cache_blocks, 11);
  EXPECT_EQ(o.chunk_size, 3);
  EXPECT_EQ(o.token_budget, 5);
  EXPECT_EQ(o.max_queued_requests, 7);
  EXPECT_EQ(o.cache_blocks, 11);
  EXPECT_EQ(o.block_size, 13);
}

std::string modelName(const ::testing::TestParamInfo<std::string>& param) {
  std::string s = param.param;
  std::replace(s.begin(), s.end(), '-', '_');
  return s;
}

INSTANTIATE_TEST_SUITE_P(Tiny, PrefillGolden, ::testing::Values("tiny-bf16", "tiny-fp8"), modelName);

}  // namespace
}  // namespace pd::prefill
