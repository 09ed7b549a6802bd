// Statistical test: speculative decoding with temperature > 0 samples exactly the
// model's distribution. Over many seeds, the joint distribution of the first two tokens a decode
// step produces (t1, t2 after the prefill's first token t0) is compared, by a chi-square
// goodness-of-fit test, with the exact distribution p(t1) p(t2 | t1) computed from the model's
// logits under the same temperature and top-k — for MTP off, the real MTP drafts (k = 1, 2), and
// an oracle draft that proposes the most likely token at each position (so drafts are accepted
// often and the acceptance rule decides the output; the real drafts of random tiny weights are
// almost never accepted). A wrong acceptance rule (e.g. drawing again after a rejection, the
// classic "resample from p instead of max(0, p - q)" bug) moves probability mass onto the draft
// and fails this test; the harness checks its own power against exactly that bug.
//
// Significance: each chi-square test rejects at alpha = 1e-4 (6 tests: family-wise < 1e-3).
// The seeds are fixed, so a run is deterministic: the test cannot flake, and a pass says that
// these N = 3000 samples per configuration are consistent with the model's distribution.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "pd/decode/decode_engine.h"
#include "pd/decode/kv_pool.h"
#include "pd/engine/engine.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/sampling.h"
#include "unit/decode/golden_support.h"

namespace pd::decode {
namespace {

using test_support::goldenDir;
using test_support::goldenIds;

constexpr std::int64_t kSamples = 3000;  // per configuration
constexpr std::int64_t kBatch = 64;      // requests decoded together
constexpr double kAlpha = 1e-4;          // per chi-square test
constexpr double kZAlpha = 3.7190;       // standard normal upper quantile of kAlpha
constexpr std::int64_t kPromptLen = 12;

// Upper kAlpha quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty; accurate
// to well under 1 % for df >= 3 at this alpha).
double chiSquareCritical(std::int64_t df) {
  const double v = static_cast<double>(df);
  const double a = 2.0 / (9.0 * v);
  return v * std::pow(1.0 - a + kZAlpha * std::sqrt(a), 3.0);
}

// The sampler's distribution for `logits` (temperature, then top-k; no penalties): what
// model::Sampler draws from, as a full-vocabulary vector.
std::vector<double> samplingDistribution(std::span<const float> logits, const pd::SamplingParams& sp) {
  std::vector<std::int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    const float va = logits[static_cast<std::size_t>(a)];
    const float vb = logits[static_cast<std::size_t>(b)];
    return va > vb || (va == vb && a < b);
  });
  const std::size_t keep = sp.top_k > 0 ? static_cast<std::size_t>(sp.top_k) : logits.size();
  const double mx = logits[static_cast<std::size_t>(order[0])];
  std::vector<double> p(logits.size(), 0.0);
  double total = 0.0;
  for (std::size_t i = 0; i < keep; ++i) {
    const auto t = static_cast<std::size_t>(order[i]);
    p[t] = std::exp((static_cast<double>(logits[t]) - mx) / sp.temperature);
    total += p[t];
  }
  for (double& x : p) x /= total;
  return p;
}

std::int32_t mostLikely(const std::vector<double>& p) {
  return static_cast<std::int32_t>(std::max_element(p.begin(), p.end()) - p.begin());
}

// Records the prompt's latent KV per layer, so that each request's blocks can be filled by a copy
// (what a prefill worker's puts do) instead of a forward per request.
class RecordingSink : public model::LatentKvSink {
 public:
  explicit RecordingSink(std::int64_t latent_dim) : dim_(static_cast<std::size_t>(latent_dim)) {}
  void onLayer(std::int64_t kv_layer, std::size_t /*sequence*/, std::int64_t start_pos,
               std::span<const float> latent) override {
    std::vector<float>& rows = layers_[kv_layer];
    const std::size_t end = static_cast<std::size_t>(start_pos) * dim_ + latent.size();
    if (rows.size() < end) rows.resize(end);
    std::copy(latent.begin(), latent.end(), rows.begin() + static_cast<std::ptrdiff_t>(start_pos) * dim_);
  }
  void writeTo(const model::LatentCacheView& cache, std::span<const std::int32_t> blocks) const {
    for (const auto& [layer, rows] : layers_) {
      for (std::size_t pos = 0; pos * dim_ < rows.size(); ++pos) {
        model::writeLatent(cache, layer, blocks, static_cast<std::int64_t>(pos), rows.data() + pos * dim_);
      }
    }
  }

 private:
  std::size_t dim_;
  std::map<std::int64_t, std::vector<float>> layers_;
};

// The CPU engine whose MTP draft at position `pos` after token `last` is replaced by
// drafts[{pos, last}] when there is one (the MTP layer still runs; only its logits change).
class TableDraftEngine : public model::Engine {
 public:
  TableDraftEngine(model::Engine& inner, std::map<std::pair<std::int64_t, std::int32_t>, std::int32_t> drafts)
      : inner_(inner), drafts_(std::move(drafts)) {}
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
      // The chunk's last token sits at position start_pos + size; the row drafts the next one.
      const std::int64_t pos = batch[i].start_pos + static_cast<std::int64_t>(batch[i].tokens.size()) + 1;
      const auto it = drafts_.find({pos, batch[i].tokens.back()});
      if (it != drafts_.end()) out->logits[i * vocab + static_cast<std::size_t>(it->second)] = 1e9F;
    }
    return out;
  }

 private:
  model::Engine& inner_;
  std::map<std::pair<std::int64_t, std::int32_t>, std::int32_t> drafts_;
};

// Chi-square goodness of fit of `counts` (cell -> count) against `expected` probabilities;
// cells expecting fewer than 5 samples are pooled (a sample in a zero-probability cell fails
// outright). Returns false with a message when the fit is rejected at kAlpha.
struct FitResult {
  bool ok = true;
  double chi2 = 0.0;
  double critical = 0.0;
  std::int64_t df = 0;
  double tv = 0.0;  // total variation distance between the empirical and the exact distribution
  std::string message;
};

template <typename Cell>
FitResult chiSquareFit(const std::map<Cell, std::int64_t>& counts, const std::map<Cell, double>& expected,
                       std::int64_t n) {
  FitResult r;
  double pooled_expected = 0.0;
  std::int64_t pooled_count = 0;
  std::int64_t cells = 0;
  std::int64_t seen = 0;
  for (const auto& [cell, p] : expected) {
    const auto it = counts.find(cell);
    const std::int64_t c = it == counts.end() ? 0 : it->second;
    seen += c;
    const double e = p * static_cast<double>(n);
    r.tv += std::abs(static_cast<double>(c) / static_cast<double>(n) - p) / 2.0;
    if (e < 5.0) {
      pooled_expected += e;
      pooled_count += c;
      continue;
    }
    r.chi2 += (static_cast<double>(c) - e) * (static_cast<double>(c) - e) / e;
    ++cells;
  }
  if (seen != n) {
    r.ok = false;
    r.message = std::to_string(n - seen) + " samples fell outside the support of the model's distribution";
    return r;
  }
  if (pooled_expected > 0.0) {
    r.chi2 += (static_cast<double>(pooled_count) - pooled_expected) *
              (static_cast<double>(pooled_count) - pooled_expected) / std::max(pooled_expected, 1e-9);
    ++cells;
  }
  r.df = cells - 1;
  PD_CHECK(r.df >= 3);
  r.critical = chiSquareCritical(r.df);
  r.ok = r.chi2 <= r.critical;
  if (!r.ok) {
    r.message = "chi-square " + std::to_string(r.chi2) + " > " + std::to_string(r.critical) + " (df " +
                std::to_string(r.df) + ", alpha " + std::to_string(kAlpha) + ")";
  }
  return r;
}

class SpeculativeSampling : public ::testing::Test {
 protected:
  void SetUp() override {
    auto e = model::createCpuEngine(goldenDir() / "tiny-bf16", model::CpuEngineOptions{2, std::nullopt, false});
    ASSERT_TRUE(e.ok()) << e.error().toString();
    engine_ = std::move(e).value();
    const ModelConfig& cfg = engine_->config();
    const auto all = goldenIds(goldenDir() / "tiny-bf16" / "golden.safetensors", "p0.tokens");
    prompt_.assign(all.begin(), all.begin() + kPromptLen);
    sampling_.temperature = 0.7;
    sampling_.top_k = 6;

    // Prefill once: the prompt's KV (main layers and the MTP layer), recorded for every request.
    sink_ = std::make_unique<RecordingSink>(cfg.latentDim());
    const std::int64_t bs = 16;
    auto local = model::PagedLatentCache::create(cfg, 4, bs, DType::F32);
    ASSERT_TRUE(local.ok());
    const std::vector<std::int32_t> table{0, 1, 2, 3};
    model::ForwardOptions fo;
    fo.logits = model::OutputRows::Last;
    fo.hidden = model::OutputRows::All;
    fo.sink = sink_.get();
    const model::SequenceChunk chunk{prompt_, 0, table};
    auto out = engine_->forward(std::span<const model::SequenceChunk>(&chunk, 1), local->view(), fo);
    ASSERT_TRUE(out.ok());
    const auto d = static_cast<std::size_t>(cfg.hidden_size);
    const model::SequenceChunk mtp{std::span<const std::int32_t>(prompt_).subspan(1), 0, table,
                                   std::span<const float>(out->hidden.data(), (prompt_.size() - 1) * d)};
    model::ForwardOptions mo;
    mo.logits = model::OutputRows::None;
    mo.sink = sink_.get();
    ASSERT_TRUE(engine_->forwardMtp(std::span<const model::SequenceChunk>(&mtp, 1), local->view(), mo).ok());
    // The first token is fixed (the prefill's greedy choice), so t1 and t2 have a known law.
    record_.num_tokens = static_cast<std::uint32_t>(kPromptLen);
    record_.first_token = model::argmax(out->logits);
    record_.hidden_state.assign(out->hidden.end() - static_cast<std::ptrdiff_t>(d), out->hidden.end());

    // Exact law: p1 from the row after t0; p2(. | x) for every x in p1's support, by the same
    // absorbed decode forward the engine runs, over a cache holding the prompt's KV.
    sink_->writeTo(local->view(), table);
    const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
    std::vector<std::int32_t> feed{record_.first_token, 0};
    model::ForwardOptions vo;
    vo.attention = model::AttentionPath::Absorbed;
    vo.logits = model::OutputRows::All;
    const auto rows = [&](std::int32_t x) {
      feed[1] = x;
      const model::SequenceChunk c{feed, kPromptLen, table};
      auto r = engine_->forward(std::span<const model::SequenceChunk>(&c, 1), local->view(), vo);
      PD_CHECK(r.ok());
      return std::move(r->logits);
    };
    const std::vector<float> first = rows(0);
    p1_ = samplingDistribution(std::span<const float>(first.data(), vocab), sampling_);
    for (std::size_t x = 0; x < vocab; ++x) {
      if (p1_[x] == 0.0) continue;
      const std::vector<float> l = rows(static_cast<std::int32_t>(x));
      p2_[static_cast<std::int32_t>(x)] =
          samplingDistribution(std::span<const float>(l.data() + vocab, vocab), sampling_);
    }
    // The oracle proposes the most likely token at t1 and, after each possible t1, at t2.
    const std::int64_t t1_pos = kPromptLen + 1;
    oracle_[{t1_pos, record_.first_token}] = mostLikely(p1_);
    for (const auto& [x, p] : p2_) oracle_[{t1_pos + 1, x}] = mostLikely(p);
  }

  // The exact joint law of (t1, t2) and the marginal of t1.
  [[nodiscard]] std::map<std::pair<std::int32_t, std::int32_t>, double> jointLaw() const {
    std::map<std::pair<std::int32_t, std::int32_t>, double> law;
    for (const auto& [x, p] : p2_) {
      for (std::size_t y = 0; y < p.size(); ++y) {
        if (p[y] > 0.0) law[{x, static_cast<std::int32_t>(y)}] = p1_[static_cast<std::size_t>(x)] * p[y];
      }
    }
    return law;
  }
  [[nodiscard]] std::map<std::int32_t, double> firstLaw() const {
    std::map<std::int32_t, double> law;
    for (std::size_t x = 0; x < p1_.size(); ++x) {
      if (p1_[x] > 0.0) law[static_cast<std::int32_t>(x)] = p1_[x];
    }
    return law;
  }

  // Decodes kSamples requests (seeds from seed_base) and returns their (t1, t2).
  std::vector<std::pair<std::int32_t, std::int32_t>> sample(model::Engine& engine, std::int64_t drafts,
                                                            std::uint64_t seed_base, DecodeStats* stats) {
    const ModelConfig& cfg = engine.config();
    auto pool = KvPool::create(cfg, kBatch, 16, DType::F32);  // one block per request: 12 + 4 tokens
    PD_CHECK(pool.ok());
    DecodeEngine dec(engine, *pool, DecodeEngineOptions{drafts, kBatch});
    std::vector<std::pair<std::int32_t, std::int32_t>> out;
    out.reserve(static_cast<std::size_t>(kSamples));
    for (std::int64_t done = 0; done < kSamples; done += kBatch) {
      const std::int64_t b = std::min(kBatch, kSamples - done);
      std::vector<std::vector<std::int32_t>> tokens(static_cast<std::size_t>(b));
      for (std::int64_t i = 0; i < b; ++i) {
        DecodeRequest r;
        r.id = static_cast<std::uint64_t>(done + i + 1);
        r.prompt_tokens = kPromptLen;
        r.max_tokens = 4;  // t0..t3: lets k = 2 draft twice in the first step
        r.ignore_eos = true;
        r.sampling = sampling_;
        r.sampling.seed = seed_base + static_cast<std::uint64_t>(done + i) * 0x9E3779B97F4A7C15ULL;
        std::vector<std::int32_t>* sink_tokens = &tokens[static_cast<std::size_t>(i)];
        r.sink = [sink_tokens](const TokenEvent& e) {
          for (const auto& t : e.tokens) sink_tokens->push_back(t.token);
        };
        auto blocks = dec.admit(std::move(r));
        PD_CHECK(blocks.ok());
        sink_->writeTo(pool->view(), *blocks);
        PD_CHECK(dec.onKvReady(static_cast<std::uint64_t>(done + i + 1), record_).ok());
      }
      while (dec.hasWork()) dec.step(Clock::now());
      for (const auto& t : tokens) {
        PD_CHECK(t.size() == 4);
        PD_CHECK(t[0] == record_.first_token);
        out.emplace_back(t[1], t[2]);
      }
    }
    EXPECT_TRUE(dec.blocks().isFullyFree());
    if (stats != nullptr) *stats = dec.stats();
    return out;
  }

  // Both fits (t1 alone; (t1, t2) jointly) for one configuration.
  void expectModelLaw(const std::vector<std::pair<std::int32_t, std::int32_t>>& samples, const std::string& what) {
    std::map<std::int32_t, std::int64_t> first;
    std::map<std::pair<std::int32_t, std::int32_t>, std::int64_t> joint;
    for (const auto& s : samples) {
      ++first[s.first];
      ++joint[s];
    }
    const auto n = static_cast<std::int64_t>(samples.size());
    const FitResult f = chiSquareFit(first, firstLaw(), n);
    const FitResult j = chiSquareFit(joint, jointLaw(), n);
    std::printf(
        "  [spec-sampling] %-22s t1: chi2 %6.2f / %6.2f (df %2lld) TV %.4f | (t1,t2): chi2 %6.2f / %6.2f "
        "(df %2lld) TV %.4f\n",
        what.c_str(), f.chi2, f.critical, static_cast<long long>(f.df), f.tv, j.chi2, j.critical,
        static_cast<long long>(j.df), j.tv);
    EXPECT_TRUE(f.ok) << what << ", t1: " << f.message;
    EXPECT_TRUE(j.ok) << what << ", (t1, t2): " << j.message;
  }

  std::unique_ptr<model::Engine> engine_;
  std::vector<std::int32_t> prompt_;
  pd::SamplingParams sampling_;
  std::unique_ptr<RecordingSink> sink_;
  kvtransfer::CompletionRecord record_;
  std::vector<double> p1_;
  std::map<std::int32_t, std::vector<double>> p2_;
  std::map<std::pair<std::int64_t, std::int32_t>, std::int32_t> oracle_;
};

TEST_F(SpeculativeSampling, TheHarnessRejectsTheResampleFromPBug) {
  // Power check of the fit on the exact law: draws with the classic wrong rule (accept the
  // draft d if a draw equals it, else emit a fresh draw from p, which may be d again) must be
  // rejected, and draws with the right rule (emit the first draw) accepted.
  const auto vocab = static_cast<std::size_t>(engine_->config().vocab_size);
  std::vector<float> logits(vocab);
  for (std::size_t t = 0; t < vocab; ++t) {
    const double p = p1_[t];
    logits[t] = p > 0.0 ? static_cast<float>(std::log(p) * sampling_.temperature) : -1e30F;
  }
  const std::int32_t d = mostLikely(p1_);
  std::map<std::int32_t, std::int64_t> right;
  std::map<std::int32_t, std::int64_t> wrong;
  for (std::int64_t i = 0; i < kSamples; ++i) {
    pd::SamplingParams sp = sampling_;
    sp.seed = 7 + static_cast<std::uint64_t>(i) * 0x9E3779B97F4A7C15ULL;
    model::Sampler s(sp);
    const std::int32_t first = s.sample(logits).token;
    ++right[first];
    ++wrong[first == d ? d : s.sample(logits).token];
  }
  std::printf("  [spec-sampling] p(most likely t1) = %.3f\n", p1_[static_cast<std::size_t>(d)]);
  EXPECT_TRUE(chiSquareFit(right, firstLaw(), kSamples).ok);
  const FitResult bad = chiSquareFit(wrong, firstLaw(), kSamples);
  std::printf("  [spec-sampling] resample-from-p bug: chi2 %.1f vs critical %.1f\n", bad.chi2, bad.critical);
  EXPECT_FALSE(bad.ok);
}

TEST_F(SpeculativeSampling, TokensFollowTheModelsDistributionWithAndWithoutMtp) {
  // The law is not degenerate: the most likely t1 is neither certain nor negligible.
  const double top = p1_[static_cast<std::size_t>(mostLikely(p1_))];
  ASSERT_GT(top, 0.2);
  ASSERT_LT(top, 0.8);
  TableDraftEngine oracle(*engine_, oracle_);
  struct Config {
    const char* name;
    model::Engine* engine;
    std::int64_t drafts;
  };
  const Config configs[] = {{"MTP off", engine_.get(), 0},
                            {"MTP k=2", engine_.get(), 2},
                            {"oracle draft k=1", &oracle, 1},
                            {"oracle draft k=2", &oracle, 2}};
  std::uint64_t seed_base = 1;
  for (const Config& c : configs) {
    DecodeStats stats;
    const auto samples = sample(*c.engine, c.drafts, seed_base++, &stats);
    std::printf("  [spec-sampling] %-22s drafts accepted %lld / %lld\n", c.name,
                static_cast<long long>(stats.drafts_accepted), static_cast<long long>(stats.drafts_proposed));
    if (c.engine == &oracle) {
      // The acceptance rule is exercised: about p(most likely) of the first drafts are accepted.
      EXPECT_GT(stats.drafts_accepted, kSamples / 10) << c.name;
      EXPECT_LT(stats.drafts_accepted, stats.drafts_proposed) << c.name;
    }
    expectModelLaw(samples, c.name);
  }
}

}  // namespace
}  // namespace pd::decode
