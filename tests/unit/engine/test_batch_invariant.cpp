// The batch-invariant engine mode (CpuEngineOptions::batch_invariant, docs/engine.md): a token's
// logits and latent KV are bit-identical however the token is batched or chunked. On the golden
// checkpoints (BF16 and FP8 weights), with an F32 and a BF16 cache, on every kernel set the CPU
// runs (generic, AVX2, AVX-512; one it lacks is skipped), against one forward of the whole sequence:
//  - the same tokens in chunks of 1, 3, 7, 16, 17 and 33 (a decode step is a chunk of one);
//  - the sequence in one forward with two other sequences (other lengths, other blocks);
//  - the MTP layer over the sequence in chunks.
// And, as a check that these comparisons can fail: the default mode (its prefill attention path
// and its one-token GEMV sum in other orders) differs somewhere in the same comparisons.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "pd/engine/engine.h"
#include "pd/engine/kernels.h"
#include "pd/engine/latent_cache.h"

namespace pd::model {
namespace {

namespace fs = std::filesystem;

const fs::path kGoldenDir = fs::path(PD_TEST_DATA_DIR) / "golden";
constexpr std::int64_t kBlockSize = 8;
constexpr std::int64_t kBlocks = 32;
constexpr std::int64_t kTokens = 70;  // several blocks, several 16- and 33-token chunks

// The bits of a float vector (NaN-safe equality).
std::vector<std::uint32_t> bits(const std::vector<float>& v) {
  std::vector<std::uint32_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * sizeof(float));
  return out;
}

// One sequence's outputs: logits and final hidden state of every token, its MTP logits, and the
// latent KV of every position in every layer (bits).
struct Outputs {
  std::vector<std::uint32_t> logits, hidden, mtp_logits, kv;
};

class BatchInvariant : public ::testing::TestWithParam<std::tuple<std::string, DType, CpuIsa>> {
 protected:
  void SetUp() override {
    const CpuIsa isa = std::get<2>(GetParam());
    if (!cpuSupports(isa)) GTEST_SKIP() << "this CPU cannot run the " << cpuIsaName(isa) << " kernels";
    for (const bool invariant : {true, false}) {
      CpuEngineOptions o;
      o.threads = 2;
      o.isa = isa;
      o.batch_invariant = invariant;
      auto e = createCpuEngine(kGoldenDir / std::get<0>(GetParam()), o);
      ASSERT_TRUE(e.ok()) << e.error().toString();
      (invariant ? invariant_ : default_) = std::move(e).value();
    }
    const std::int64_t vocab = invariant_->config().vocab_size;
    for (std::int64_t i = 0; i < kTokens; ++i) tokens_.push_back(static_cast<std::int32_t>((i * 37 + 11) % vocab));
  }

  // Runs `tokens` (block table `table`) in forwards of `chunk` tokens, each together with the
  // `others` sequences' next chunks of the same size (their own blocks, in a batch), then the MTP
  // layer in the same chunks; returns the first sequence's outputs.
  static Outputs run(Engine& engine, const std::vector<std::int32_t>& tokens, std::int64_t chunk, int others) {
    const ModelConfig& cfg = engine.config();
    auto cache = PagedLatentCache::create(cfg, kBlocks, kBlockSize, std::get<1>(GetParam()));
    EXPECT_TRUE(cache.ok());
    const std::int64_t per_seq = (kTokens + kBlockSize - 1) / kBlockSize;
    // Sequence s uses blocks in reverse order from its own range: no two share a block.
    std::vector<std::vector<std::int32_t>> tables(static_cast<std::size_t>(others + 1));
    std::vector<std::vector<std::int32_t>> seq_tokens(static_cast<std::size_t>(others + 1));
    for (int s = 0; s <= others; ++s) {
      for (std::int64_t b = per_seq - 1; b >= 0; --b) {
        tables[static_cast<std::size_t>(s)].push_back(static_cast<std::int32_t>(s * per_seq + b));
      }
      seq_tokens[static_cast<std::size_t>(s)] = tokens;
      if (s > 0) {
        // Other contents and a shorter length.
        auto& t = seq_tokens[static_cast<std::size_t>(s)];
        t.resize(static_cast<std::size_t>(kTokens - 9 * s));
        for (auto& x : t) x = static_cast<std::int32_t>((x + 101 * s) % cfg.vocab_size);
      }
    }
    Outputs r;
    std::vector<float> hidden_all;
    const auto forward = [&](bool mtp) {
      for (std::int64_t p = 0; p < kTokens; p += chunk) {
        std::vector<SequenceChunk> batch;
        std::vector<std::int64_t> rows;  // the first sequence's rows in this forward
        for (int s = 0; s <= others; ++s) {
          const auto& t = seq_tokens[static_cast<std::size_t>(s)];
          const std::int64_t n = std::min<std::int64_t>(chunk, static_cast<std::int64_t>(t.size()) - p);
          if (n <= 0) continue;
          SequenceChunk c{std::span(t).subspan(static_cast<std::size_t>(p), static_cast<std::size_t>(n)), p,
                          tables[static_cast<std::size_t>(s)]};
          if (mtp) {
            // The MTP layer pairs token i + 1 with the main model's hidden state of token i: here
            // simply token i with hidden i of the first sequence (the same for every sequence).
            c.prev_hidden = std::span<const float>(hidden_all)
                                .subspan(static_cast<std::size_t>(p * cfg.hidden_size),
                                         static_cast<std::size_t>(n * cfg.hidden_size));
          }
          batch.push_back(c);
        }
        ForwardOptions o;
        o.logits = OutputRows::All;
        o.hidden = mtp ? OutputRows::None : OutputRows::All;
        auto out = mtp ? engine.forwardMtp(batch, cache->view(), o) : engine.forward(batch, cache->view(), o);
        EXPECT_TRUE(out.ok()) << out.error().toString();
        if (!out.ok()) return;
        const std::int64_t n0 = static_cast<std::int64_t>(batch[0].tokens.size());
        const std::vector<float> logits(out->logits.begin(),
                                        out->logits.begin() + static_cast<std::ptrdiff_t>(n0 * cfg.vocab_size));
        const auto lb = bits(logits);
        std::vector<std::uint32_t>& into = mtp ? r.mtp_logits : r.logits;
        into.insert(into.end(), lb.begin(), lb.end());
        if (!mtp) {
          const std::vector<float> h(out->hidden.begin(),
                                     out->hidden.begin() + static_cast<std::ptrdiff_t>(n0 * cfg.hidden_size));
          hidden_all.insert(hidden_all.end(), h.begin(), h.end());
        }
      }
    };
    forward(false);
    r.hidden = bits(hidden_all);
    if (cfg.num_nextn_predict_layers > 0) forward(true);
    std::vector<float> x(static_cast<std::size_t>(cache->view().latent_dim));
    for (std::size_t l = 0; l < cache->view().layers.size(); ++l) {
      for (std::int64_t p = 0; p < kTokens; ++p) {
        readLatent(cache->view(), static_cast<std::int64_t>(l), tables[0], p, x.data());
        const auto b = bits(x);
        r.kv.insert(r.kv.end(), b.begin(), b.end());
      }
    }
    return r;
  }

  // Whether every comparison against the one-forward run holds on `engine`; with `expect`, each
  // failing one is reported.
  bool allEqual(Engine& engine, bool expect) {
    const Outputs whole = run(engine, tokens_, kTokens, 0);
    EXPECT_FALSE(whole.logits.empty());
    bool equal = true;
    const auto check = [&](const Outputs& other, const std::string& what) {
      const bool same = other.logits == whole.logits && other.hidden == whole.hidden &&
                        other.mtp_logits == whole.mtp_logits && other.kv == whole.kv;
      if (expect) {
        EXPECT_EQ(other.logits, whole.logits) << what << ": logits";
        EXPECT_EQ(other.hidden, whole.hidden) << what << ": hidden states";
        EXPECT_EQ(other.mtp_logits, whole.mtp_logits) << what << ": MTP logits";
        EXPECT_EQ(other.kv, whole.kv) << what << ": latent KV";
      }
      equal = equal && same;
    };
    for (const std::int64_t chunk : {1, 3, 7, 16, 17, 33}) {
      check(run(engine, tokens_, chunk, 0), "chunks of " + std::to_string(chunk));
    }
    check(run(engine, tokens_, kTokens, 2), "one forward with two other sequences");
    check(run(engine, tokens_, 16, 2), "chunks of 16 with two other sequences");
    return equal;
  }

  std::unique_ptr<Engine> invariant_;
  std::unique_ptr<Engine> default_;
  std::vector<std::int32_t> tokens_;
};

TEST_P(BatchInvariant, EveryChunkingAndBatchGivesTheBitsOfOneForward) {
  ASSERT_LE(kTokens, kBlocks / 3 * kBlockSize) << "three sequences must fit the cache";
  EXPECT_TRUE(allEqual(*invariant_, true));
}

TEST_P(BatchInvariant, TheDefaultModeDiffersSomewhere) {
  EXPECT_FALSE(allEqual(*default_, false))
      << "the default mode gave the same bits everywhere: these comparisons could not fail";
}

INSTANTIATE_TEST_SUITE_P(Golden, BatchInvariant,
                         ::testing::Combine(::testing::Values("tiny-bf16", "tiny-fp8"),
                                            ::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Values(CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512)),
                         [](const ::testing::TestParamInfo<std::tuple<std::string, DType, CpuIsa>>& p) {
                           std::string name = std::get<0>(p.param);
                           for (char& c : name) {
                             if (c == '-') c = '_';
                           }
                           return name + (std::get<1>(p.param) == DType::F32 ? "_f32_cache_" : "_bf16_cache_") +
                                  std::string(cpuIsaName(std::get<2>(p.param)));
                         });

}  // namespace
}  // namespace pd::model
