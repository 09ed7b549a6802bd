// Grammar-constrained decoding inside the decode engine (DecodeRequest::grammar) on the golden
// tiny checkpoint with its MTP layer: sampled outputs (temperature 1, several seeds, a batch) are
// valid for the grammar and end with its stop token; with MTP drafts (trimmed to what the grammar
// accepts) the outputs are exactly those without; a first token the grammar refuses ends the
// request with Corrupt; ignore_eos with a grammar is refused at admission. An engine that samples
// its own rows gets the grammar's masks and gives the same tokens.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "golden_support.h"
#include "pd/decode/decode_engine.h"
#include "pd/decode/kv_pool.h"
#include "pd/engine/engine.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/model_factory.h"
#include "pd/structured/grammar.h"
#include "pd/structured/token_vocabulary.h"
#include "support/host_row_sampling_engine.h"

namespace pd::decode {
namespace {

constexpr std::int64_t kContext = 8;
constexpr std::int64_t kBatch = 4;
constexpr std::int32_t kOpenBrace = '{';

// Proposes the known output token with probability 1/2, else a token the grammar never allows
// (200) or a text token that is usually wrong ('1'): accepted, trimmed and rejected drafts all occur.
class KnownAnswerDrafter final : public MtpDrafter {
 public:
  KnownAnswerDrafter(model::Engine& engine, KvPool& pool, const std::vector<std::vector<std::int32_t>>* known)
      : MtpDrafter(engine, pool), known_(known) {}

 private:
  std::int32_t choose(std::uint64_t request_id, std::int64_t output_index, std::int32_t) override {
    const auto& seq = (*known_)[request_id - 1];
    const int pick = static_cast<int>(draws_() % 4);
    if (pick < 2 && output_index < static_cast<std::int64_t>(seq.size())) {
      return seq[static_cast<std::size_t>(output_index)];
    }
    return pick == 2 ? 200 : '1';
  }
  const std::vector<std::vector<std::int32_t>>* known_;
  std::mt19937_64 draws_{7};
};

struct Outcome {
  std::vector<std::vector<std::int32_t>> tokens;
  std::vector<std::optional<FinishReason>> finish;
  std::vector<std::optional<Error>> error;
  DecodeStats stats;
};

class ConstrainedDecode : public ::testing::Test {
 protected:
  void SetUp() override {
    auto e = model::createCpuEngine(test_support::goldenDir() / "tiny-bf16",
                                    model::CpuEngineOptions{2, std::nullopt, false});
    ASSERT_TRUE(e.ok()) << e.error().toString();
    engine_ = std::move(e).value();
    ASSERT_TRUE(engine_->capabilities().mtp);
    const ModelConfig& cfg = engine_->config();
    eos_ = static_cast<TokenId>(cfg.eos_token_id);
    // Ids 32..126 are their ASCII bytes; every other id never appears in constrained text.
    std::vector<std::optional<std::string>> bytes(static_cast<std::size_t>(cfg.vocab_size));
    for (int b = 32; b < 127; ++b) {
      if (b != eos_) bytes[static_cast<std::size_t>(b)] = std::string(1, static_cast<char>(b));
    }
    auto vocabulary =
        structured::TokenVocabulary::fromTokenBytes(bytes, static_cast<std::size_t>(cfg.vocab_size), {eos_});
    ASSERT_TRUE(vocabulary.ok()) << vocabulary.error().toString();
    auto grammar = structured::Grammar::fromJsonSchema(
        R"({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            "b": {"enum": ["x", "yy"]}}, "required": ["a", "b"], "additionalProperties": false})",
        *vocabulary);
    ASSERT_TRUE(grammar.ok()) << grammar.error().toString();
    grammar_ = *grammar;
  }

  /// kBatch requests (seeds 1.., temperature 1) decoded to the end with `drafts` MTP drafts.
  /// `known`: with drafts, the KnownAnswerDrafter proposes from these outputs (else the MTP layer's own).
  /// `verify_engine`: the engine the decode engine runs (default the CPU engine; drafts come from
  /// the CPU engine either way).
  Outcome run(std::int64_t drafts, std::int32_t first_token,
              const std::vector<std::vector<std::int32_t>>* known = nullptr, std::int64_t max_tokens = 200,
              model::Engine* verify_engine = nullptr) {
    const ModelConfig& cfg = engine_->config();
    constexpr std::int64_t kBlock = 16;
    const std::int64_t per_seq = (kContext + max_tokens + drafts + kBlock - 1) / kBlock + 1;
    auto pool = KvPool::create(cfg, kBatch * per_seq, kBlock, DType::F32);
    EXPECT_TRUE(pool.ok());
    if (!pool.ok()) return {};
    DecodeEngine dec(verify_engine != nullptr ? *verify_engine : *engine_, *pool, DecodeEngineOptions{drafts, kBatch},
                     known != nullptr ? std::make_unique<KnownAnswerDrafter>(*engine_, *pool, known) : nullptr);
    Outcome out;
    out.tokens.resize(kBatch);
    out.finish.resize(kBatch);
    out.error.resize(kBatch);
    std::mt19937_64 rng(42);  // the same prompt KV and hidden states in every run
    std::normal_distribution<float> normal(0.0F, 1.0F);
    std::vector<float> latent(static_cast<std::size_t>(cfg.latentDim()));
    for (std::int64_t i = 0; i < kBatch; ++i) {
      DecodeRequest r;
      r.id = static_cast<std::uint64_t>(i + 1);
      r.prompt_tokens = kContext;
      r.max_tokens = max_tokens;
      r.sampling.temperature = 1.0;
      r.sampling.seed = static_cast<std::uint64_t>(i + 1);
      r.grammar = grammar_;
      const auto k = static_cast<std::size_t>(i);
      r.sink = [&out, k](const TokenEvent& e) {
        for (const auto& t : e.tokens) out.tokens[k].push_back(t.token);
        if (e.finish) out.finish[k] = e.finish;
        if (e.error) out.error[k] = e.error;
      };
      auto blocks = dec.admit(std::move(r));
      EXPECT_TRUE(blocks.ok()) << blocks.error().toString();
      if (!blocks.ok()) return out;
      for (std::int64_t l = 0; l < cfg.kvLayers(); ++l) {
        for (std::int64_t p = 0; p < kContext; ++p) {
          for (float& v : latent) v = normal(rng);
          model::writeLatent(pool->view(), l, *blocks, p, latent.data());
        }
      }
      kvtransfer::CompletionRecord rec;
      rec.num_tokens = static_cast<std::uint32_t>(kContext);
      rec.first_token = first_token;
      rec.hidden_state.resize(static_cast<std::size_t>(cfg.hidden_size));
      for (float& v : rec.hidden_state) v = normal(rng);
      EXPECT_TRUE(dec.onKvReady(static_cast<std::uint64_t>(i + 1), std::move(rec)).ok());
    }
    while (dec.hasWork()) dec.step(Clock::now());
    EXPECT_TRUE(dec.blocks().isFullyFree());
    out.stats = dec.stats();
    return out;
  }

  std::unique_ptr<model::Engine> engine_;
  TokenId eos_ = 0;
  std::shared_ptr<const structured::Grammar> grammar_;
};

TEST_F(ConstrainedDecode, SampledOutputsAreValidAndMtpChangesNothing) {
  const Outcome plain = run(0, kOpenBrace);
  const Outcome spec = run(2, kOpenBrace, &plain.tokens);
  // Drafts the grammar refuses are trimmed before verification; the rest are verified, and some
  // are accepted: every path of constrained speculation ran.
  EXPECT_GT(spec.stats.drafts_accepted, 0);
  EXPECT_GT(spec.stats.drafts_proposed, spec.stats.drafts_accepted);
  const Outcome own = run(2, kOpenBrace);  // the MTP layer's own drafts: almost all refused
  EXPECT_EQ(own.tokens, plain.tokens);
  for (std::size_t i = 0; i < plain.tokens.size(); ++i) {
    EXPECT_EQ(spec.tokens[i], plain.tokens[i]) << "request " << i;
    ASSERT_EQ(plain.finish[i], FinishReason::Stop) << "request " << i;
    ASSERT_GE(plain.tokens[i].size(), 2U);
    EXPECT_EQ(plain.tokens[i].back(), eos_);
    std::string text;
    for (std::size_t t = 0; t + 1 < plain.tokens[i].size(); ++t) {
      text += static_cast<char>(plain.tokens[i][t]);
    }
    // Valid JSON of the schema's shape, checked by an independent parser.
    boost::system::error_code ec;
    const auto value = boost::json::parse(text, ec);
    ASSERT_FALSE(ec) << text;
    const auto& o = value.as_object();
    EXPECT_EQ(o.size(), 2U) << text;
    EXPECT_LE(o.at("a").as_array().size(), 3U) << text;
    const std::string b(o.at("b").as_string());
    EXPECT_TRUE(b == "x" || b == "yy") << text;
  }
}

// An engine that samples (the CUDA engine's forwardSampled; here host_row_sampling_engine.h, a
// host Sampler per row under the row's mask) gives the host path's tokens: each row is sampled
// under the grammar's mask after the drafts before it, with and without MTP drafts (known-answer
// drafts, so some are accepted, some trimmed, some rejected).
TEST_F(ConstrainedDecode, AnEngineThatSamplesUnderTheMasksGivesTheHostTokens) {
  const Outcome plain = run(0, kOpenBrace);
  pd::test_support::HostRowSamplingEngine sampling_engine(*engine_);
  for (const std::int64_t drafts : {0, 2}) {
    const int masked_before = sampling_engine.masked_rows;
    const Outcome sampled = run(drafts, kOpenBrace, drafts > 0 ? &plain.tokens : nullptr, 200, &sampling_engine);
    EXPECT_EQ(sampled.tokens, plain.tokens) << drafts << " drafts";
    EXPECT_EQ(sampled.finish, plain.finish) << drafts << " drafts";
    // Every decode-step token came from the engine (the first is the prefill side's), all masked.
    EXPECT_EQ(sampled.stats.engine_sampled_tokens, sampled.stats.tokens_generated) << drafts << " drafts";
    EXPECT_GE(sampling_engine.masked_rows - masked_before, sampled.stats.engine_sampled_tokens) << drafts << " drafts";
    if (drafts > 0) {
      EXPECT_GT(sampled.stats.drafts_accepted, 0);
      EXPECT_GT(sampled.stats.drafts_proposed, sampled.stats.drafts_accepted);
    }
  }
}

TEST_F(ConstrainedDecode, AFirstTokenTheGrammarRefusesEndsTheRequest) {
  const Outcome out = run(0, 'x');
  for (std::size_t i = 0; i < out.tokens.size(); ++i) {
    EXPECT_EQ(out.finish[i], FinishReason::Error);
    ASSERT_TRUE(out.error[i].has_value());
    EXPECT_EQ(out.error[i]->code, ErrorCode::Corrupt);
  }
}

TEST_F(ConstrainedDecode, IgnoreEosWithAGrammarIsRefused) {
  const ModelConfig& cfg = engine_->config();
  auto pool = KvPool::create(cfg, 4, 16, DType::F32);
  ASSERT_TRUE(pool.ok());
  DecodeEngine dec(*engine_, *pool, DecodeEngineOptions{0, 1});
  DecodeRequest r;
  r.id = 1;
  r.prompt_tokens = 4;
  r.max_tokens = 4;
  r.ignore_eos = true;
  r.grammar = grammar_;
  r.sink = [](const TokenEvent&) {};
  auto admitted = dec.admit(std::move(r));
  ASSERT_FALSE(admitted.ok());
  EXPECT_EQ(admitted.error().code, ErrorCode::InvalidArgument);
}

}  // namespace
}  // namespace pd::decode
