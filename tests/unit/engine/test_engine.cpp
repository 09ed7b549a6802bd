// The CPU model engine against DeepSeek's reference outputs (tests/data/golden, README §6
// tolerances), plus the engine's own invariants: chunked prefill == one shot, decode == prefill,
// batched == alone, sinks, errors, speculative generation == plain generation.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "pd/common/kv_format.h"
#include "pd/engine/engine.h"
#include "pd/engine/generate.h"
#include "pd/engine/model_factory.h"
#include "pd/engine/model_weights.h"
#include "pd/engine/rope.h"
#include "pd/engine/safetensors.h"
#include "pd/engine/sampling.h"
#include "support/test_files.h"

namespace pd::model {
namespace {

namespace fs = std::filesystem;

const fs::path kGoldenDir = fs::path(PD_TEST_DATA_DIR) / "golden";

// README §6 tolerances.
constexpr double kLogitsTol = 1e-3;
constexpr double kStateTol = 2e-4;
constexpr double kRouteTol = 1e-5;

class Golden {
 public:
  explicit Golden(const fs::path& path) : file_(open(path)) {}

  std::vector<float> f32(const std::string& name) const {
    const TensorView* t = find(name, DType::F32);
    std::vector<float> v(static_cast<std::size_t>(t->numel()));
    std::memcpy(v.data(), t->data.data(), t->data.size());
    return v;
  }
  std::vector<std::int32_t> ids(const std::string& name) const {
    const TensorView* t = file_.find(name);
    EXPECT_NE(t, nullptr) << name;
    std::vector<std::int32_t> v(static_cast<std::size_t>(t->numel()));
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (t->dtype == DType::I64) {
        std::int64_t x;
        std::memcpy(&x, t->data.data() + i * 8, 8);
        v[i] = static_cast<std::int32_t>(x);
      } else {
        std::memcpy(&v[i], t->data.data() + i * 4, 4);
      }
    }
    return v;
  }
  const SafetensorsFile& file() const { return file_; }

 private:
  static SafetensorsFile open(const fs::path& path) {
    auto r = SafetensorsFile::open(path);
    PD_CHECK_MSG(r.ok(), "cannot open golden file");
    return std::move(r).value();
  }
  const TensorView* find(const std::string& name, DType dtype) const {
    const TensorView* t = file_.find(name);
    PD_CHECK_MSG(t != nullptr && t->dtype == dtype, "golden tensor missing or of another dtype");
    return t;
  }
  SafetensorsFile file_;
};

double maxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0.0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

// Checks and prints a max |Δ| so that test logs carry the measured numbers.
void expectClose(const std::string& what, const std::vector<float>& got, const std::vector<float>& want, double tol) {
  const double d = maxAbsDiff(got, want);
  std::printf("  [golden] %-44s max|diff| = %.3g (tolerance %.0e)\n", what.c_str(), d, tol);
  EXPECT_LE(d, tol) << what;
}

std::vector<float> rows(const std::vector<float>& v, std::int64_t width, std::int64_t r0, std::int64_t r1) {
  return {v.begin() + r0 * width, v.begin() + r1 * width};
}

std::vector<std::int32_t> iotaBlocks(std::int64_t n, std::int32_t first = 0) {
  std::vector<std::int32_t> b(static_cast<std::size_t>(n));
  std::iota(b.begin(), b.end(), first);
  return b;
}

// Reads [positions, width) of the latent cache: c_kv (first r) or k_pe (last dr) parts.
std::vector<float> readCache(const LatentCacheView& cache, std::int64_t layer, const std::vector<std::int32_t>& table,
                             std::int64_t p0, std::int64_t p1, std::int64_t part_begin, std::int64_t part_end) {
  std::vector<float> row(static_cast<std::size_t>(cache.latent_dim));
  std::vector<float> out;
  for (std::int64_t p = p0; p < p1; ++p) {
    readLatent(cache, layer, table, p, row.data());
    out.insert(out.end(), row.begin() + part_begin, row.begin() + part_end);
  }
  return out;
}

std::unique_ptr<Engine> makeEngine(const std::string& model, int threads = 2) {
  auto e = createCpuEngine(kGoldenDir / model, CpuEngineOptions{threads, std::nullopt});
  PD_CHECK_MSG(e.ok(), "cannot create the engine on the golden model");
  return std::move(e).value();
}

class GoldenModel : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    engine_ = makeEngine(GetParam());
    golden_ = std::make_unique<Golden>(kGoldenDir / GetParam() / "golden.safetensors");
    prompt_ = golden_->ids("p0.tokens");
    greedy_ = golden_->ids("p0.greedy");
  }
  const ModelConfig& cfg() const { return engine_->config(); }
  std::string name(const std::string& what) const { return GetParam() + " " + what; }

  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Golden> golden_;
  std::vector<std::int32_t> prompt_;
  std::vector<std::int32_t> greedy_;
};

TEST_P(GoldenModel, RopeFrequenciesAndSoftmaxScale) {
  auto inv = ropeInvFreq(cfg());
  ASSERT_TRUE(inv.ok());
  const std::vector<float> want{1.0F,
                                0.23717081546783447F,
                                0.04999999701976776F,
                                0.007905694656074047F,
                                0.0024999999441206455F,
                                0.0007905694656074047F,
                                0.0002500000118743628F,
                                7.905694656074047e-05F};
  ASSERT_EQ(inv->size(), want.size());
  for (std::size_t j = 0; j < want.size(); ++j) EXPECT_NEAR((*inv)[j], want[j], 1e-7 * want[j]) << j;
  EXPECT_NEAR(cfg().softmaxScale(), 0.18713033519502428, 1e-12);
}

TEST_P(GoldenModel, PrefillMatchesEveryGoldenTensorOnBothAttentionPaths) {
  const std::int64_t n = static_cast<std::int64_t>(prompt_.size());
  const std::int64_t layers = cfg().num_hidden_layers;
  const std::int64_t r = cfg().kv_lora_rank;
  const std::int64_t ld = cfg().latentDim();
  const std::int64_t k = cfg().num_experts_per_tok;
  for (const AttentionPath path : {AttentionPath::Prefill, AttentionPath::Absorbed}) {
    const std::string tag = path == AttentionPath::Prefill ? "prefill-path " : "absorbed-path ";
    auto cache = PagedLatentCache::create(cfg(), 8, 16);
    ASSERT_TRUE(cache.ok());
    // Blocks out of order, to exercise the paging.
    const std::vector<std::int32_t> table{5, 2, 7};
    const SequenceChunk chunk{prompt_, 0, table};
    ForwardTrace trace;
    ForwardOptions o;
    o.attention = path;
    o.logits = OutputRows::All;
    o.hidden = OutputRows::All;
    o.trace = &trace;
    auto out = engine_->forward(std::span<const SequenceChunk>(&chunk, 1), cache->view(), o);
    ASSERT_TRUE(out.ok()) << out.error().toString();
    expectClose(name(tag + "logits_all"), out->logits, golden_->f32("p0.logits_all"), kLogitsTol);
    expectClose(name(tag + "hidden_final"), out->hidden, golden_->f32("p0.hidden_final"), kStateTol);
    expectClose(name(tag + "hidden_layers"), trace.layer_hidden, golden_->f32("p0.hidden_layers"), kStateTol);
    std::vector<float> kv, pe;
    for (std::int64_t l = 0; l < layers; ++l) {
      const std::vector<float> a = readCache(cache->view(), l, table, 0, n, 0, r);
      const std::vector<float> b = readCache(cache->view(), l, table, 0, n, r, ld);
      kv.insert(kv.end(), a.begin(), a.end());
      pe.insert(pe.end(), b.begin(), b.end());
    }
    expectClose(name(tag + "kv_cache"), kv, golden_->f32("p0.kv_cache"), kStateTol);
    expectClose(name(tag + "pe_cache"), pe, golden_->f32("p0.pe_cache"), kStateTol);
    // Routing: same expert sets; weights matched by expert id.
    const std::vector<std::int32_t> idx = golden_->ids("p0.moe_topk_idx");
    const std::vector<float> w = golden_->f32("p0.moe_topk_weight");
    ASSERT_EQ(trace.topk_idx.size(), idx.size());
    double wmax = 0.0;
    for (std::size_t row = 0; row < idx.size() / static_cast<std::size_t>(k); ++row) {
      for (std::int64_t j = 0; j < k; ++j) {
        const std::size_t want_at = row * static_cast<std::size_t>(k) + static_cast<std::size_t>(j);
        const auto it =
            std::find(trace.topk_idx.begin() + static_cast<std::ptrdiff_t>(row * static_cast<std::size_t>(k)),
                      trace.topk_idx.begin() + static_cast<std::ptrdiff_t>((row + 1) * static_cast<std::size_t>(k)),
                      idx[want_at]);
        ASSERT_NE(it, trace.topk_idx.begin() + static_cast<std::ptrdiff_t>((row + 1) * static_cast<std::size_t>(k)))
            << "expert set differs at row " << row;
        wmax = std::max(
            wmax,
            std::abs(static_cast<double>(trace.topk_weight[static_cast<std::size_t>(it - trace.topk_idx.begin())]) -
                     w[want_at]));
      }
    }
    std::printf("  [golden] %-44s max|diff| = %.3g (tolerance %.0e)\n", name(tag + "moe_topk_weight").c_str(), wmax,
                kRouteTol);
    EXPECT_LE(wmax, kRouteTol);
  }
}

TEST_P(GoldenModel, GreedyDecodeMatchesGoldenLogitsTokensAndCache) {
  const std::int64_t n = static_cast<std::int64_t>(prompt_.size());
  const std::int64_t g = static_cast<std::int64_t>(greedy_.size());
  const std::int64_t vocab = cfg().vocab_size;
  const std::int64_t d = cfg().hidden_size;
  auto cache = PagedLatentCache::create(cfg(), 4, 16);
  ASSERT_TRUE(cache.ok());
  const std::vector<std::int32_t> table{3, 0, 2, 1};
  std::vector<float> logits, hidden;
  std::vector<std::int32_t> tokens;
  ForwardOptions o;
  o.attention = AttentionPath::Prefill;
  o.logits = OutputRows::Last;
  o.hidden = OutputRows::Last;
  SequenceChunk chunk{prompt_, 0, table};
  auto out = engine_->forward(std::span<const SequenceChunk>(&chunk, 1), cache->view(), o);
  ASSERT_TRUE(out.ok());
  o.attention = AttentionPath::Absorbed;
  for (std::int64_t t = 0;; ++t) {
    logits.insert(logits.end(), out->logits.begin(), out->logits.end());
    hidden.insert(hidden.end(), out->hidden.begin(), out->hidden.end());
    tokens.push_back(argmax(out->logits));
    if (t + 1 == g) break;
    const std::int32_t feed = greedy_[static_cast<std::size_t>(t)];  // teacher-forced, as the golden ran
    chunk = SequenceChunk{std::span<const std::int32_t>(&feed, 1), n + t, table};
    out = engine_->forward(std::span<const SequenceChunk>(&chunk, 1), cache->view(), o);
    ASSERT_TRUE(out.ok());
  }
  EXPECT_EQ(tokens, greedy_);
  expectClose(name("decode_logits"), logits, golden_->f32("p0.decode_logits"), kLogitsTol);
  expectClose(name("decode_hidden"), hidden, golden_->f32("p0.decode_hidden"), kStateTol);
  ASSERT_EQ(logits.size(), static_cast<std::size_t>(g * vocab));
  ASSERT_EQ(hidden.size(), static_cast<std::size_t>(g * d));
  std::vector<float> kv, pe;
  for (std::int64_t l = 0; l < cfg().num_hidden_layers; ++l) {
    const std::vector<float> a = readCache(cache->view(), l, table, 0, n + g - 1, 0, cfg().kv_lora_rank);
    const std::vector<float> b =
        readCache(cache->view(), l, table, 0, n + g - 1, cfg().kv_lora_rank, cfg().latentDim());
    kv.insert(kv.end(), a.begin(), a.end());
    pe.insert(pe.end(), b.begin(), b.end());
  }
  expectClose(name("kv_cache_decode"), kv, golden_->f32("p0.kv_cache_decode"), kStateTol);
  expectClose(name("pe_cache_decode"), pe, golden_->f32("p0.pe_cache_decode"), kStateTol);
}

// MTP inputs of the golden runs: t = prompt ‖ greedy; h[i] = hidden_final (i < N) or decode_hidden.
struct MtpInputs {
  std::vector<std::int32_t> tokens;  // t[i + 1] for each run position i
  std::vector<float> hidden;         // h[i]
};

MtpInputs mtpInputs(const Golden& golden, std::int64_t first, std::int64_t last, std::int64_t d) {
  std::vector<std::int32_t> t = golden.ids("p0.tokens");
  const std::vector<std::int32_t> greedy = golden.ids("p0.greedy");
  const auto n = static_cast<std::int64_t>(t.size());
  t.insert(t.end(), greedy.begin(), greedy.end());
  const std::vector<float> hf = golden.f32("p0.hidden_final");
  const std::vector<float> hd = golden.f32("p0.decode_hidden");
  MtpInputs in;
  for (std::int64_t i = first; i <= last; ++i) {
    in.tokens.push_back(t[static_cast<std::size_t>(i + 1)]);
    const float* h = i < n ? hf.data() + i * d : hd.data() + (i - n + 1) * d;
    in.hidden.insert(in.hidden.end(), h, h + d);
  }
  return in;
}

TEST_P(GoldenModel, MtpRunsMatchGolden) {
  ASSERT_TRUE(engine_->capabilities().mtp);
  const std::int64_t n = static_cast<std::int64_t>(prompt_.size());
  const std::int64_t g = static_cast<std::int64_t>(greedy_.size());
  const std::int64_t d = cfg().hidden_size;
  const std::int64_t r = cfg().kv_lora_rank;
  const std::int64_t mtp_layer = cfg().num_hidden_layers;
  const std::int64_t k = cfg().num_experts_per_tok;
  struct Run {
    std::string suffix;
    bool zero;
  };
  // Positions 0 .. N+G-2, with (vLLM) and without (SGLang, pdserve) zeroing position 0; one shot
  // on each attention path and incrementally (prompt rows at once, then one row per step).
  for (const Run& run : {Run{"_nozero", false}, Run{"_vllm", true}}) {
    const MtpInputs in = mtpInputs(*golden_, 0, n + g - 2, d);
    for (const char* mode : {"prefill-path", "absorbed-path", "incremental"}) {
      auto cache = PagedLatentCache::create(cfg(), 5, 16);
      ASSERT_TRUE(cache.ok());
      const std::vector<std::int32_t> table{4, 1, 3, 0};
      ForwardOptions o;
      o.logits = OutputRows::All;
      o.mtp_zero_position0_embedding = run.zero;
      std::vector<float> logits;
      if (std::string(mode) == "incremental") {
        std::int64_t p = 0;
        while (p < n + g - 1) {
          const std::int64_t cnt = p == 0 ? n : 1;
          const SequenceChunk c{std::span<const std::int32_t>(in.tokens.data() + p, static_cast<std::size_t>(cnt)), p,
                                table,
                                std::span<const float>(in.hidden.data() + p * d, static_cast<std::size_t>(cnt * d))};
          o.attention = AttentionPath::Auto;
          auto out = engine_->forwardMtp(std::span<const SequenceChunk>(&c, 1), cache->view(), o);
          ASSERT_TRUE(out.ok()) << out.error().toString();
          logits.insert(logits.end(), out->logits.begin(), out->logits.end());
          p += cnt;
        }
      } else {
        const SequenceChunk c{in.tokens, 0, table, in.hidden};
        o.attention = std::string(mode) == "prefill-path" ? AttentionPath::Prefill : AttentionPath::Absorbed;
        auto out = engine_->forwardMtp(std::span<const SequenceChunk>(&c, 1), cache->view(), o);
        ASSERT_TRUE(out.ok()) << out.error().toString();
        logits = out->logits;
      }
      const std::string tag = std::string(mode) + " mtp_logits" + run.suffix;
      expectClose(name(tag), logits, golden_->f32("p0.mtp_logits" + run.suffix), kLogitsTol);
      expectClose(name(std::string(mode) + " mtp_kv_cache" + run.suffix),
                  readCache(cache->view(), mtp_layer, table, 0, n + g - 1, 0, r),
                  golden_->f32("p0.mtp_kv_cache" + run.suffix), kStateTol);
      expectClose(name(std::string(mode) + " mtp_pe_cache" + run.suffix),
                  readCache(cache->view(), mtp_layer, table, 0, n + g - 1, r, cfg().latentDim()),
                  golden_->f32("p0.mtp_pe_cache" + run.suffix), kStateTol);
      // The drafts after each decode step.
      const std::vector<float> want = golden_->f32("p0.mtp_logits" + run.suffix);
      for (std::int64_t row = n - 1; row < n + g - 1; ++row) {
        const std::span<const float> a(logits.data() + row * cfg().vocab_size,
                                       static_cast<std::size_t>(cfg().vocab_size));
        const std::span<const float> b(want.data() + row * cfg().vocab_size,
                                       static_cast<std::size_t>(cfg().vocab_size));
        EXPECT_EQ(argmax(a), argmax(b)) << tag << " draft row " << row;
      }
    }
  }
  // The run over positions 1 .. N-1 only (cache slot k holds position k + 1).
  const MtpInputs in = mtpInputs(*golden_, 1, n - 1, d);
  auto cache = PagedLatentCache::create(cfg(), 3, 16);
  ASSERT_TRUE(cache.ok());
  const std::vector<std::int32_t> table{2, 0, 1};
  SequenceChunk c{in.tokens, 0, table, in.hidden};
  c.rope_offset = 1;
  ForwardTrace trace;
  ForwardOptions o;
  o.logits = OutputRows::All;
  o.trace = &trace;
  auto out = engine_->forwardMtp(std::span<const SequenceChunk>(&c, 1), cache->view(), o);
  ASSERT_TRUE(out.ok());
  expectClose(name("mtp_logits"), out->logits, golden_->f32("p0.mtp_logits"), kLogitsTol);
  expectClose(name("mtp_hidden_in"), trace.mtp_input, golden_->f32("p0.mtp_hidden_in"), kStateTol);
  expectClose(name("mtp_kv_cache"), readCache(cache->view(), mtp_layer, table, 0, n - 1, 0, r),
              golden_->f32("p0.mtp_kv_cache"), kStateTol);
  expectClose(name("mtp_pe_cache"), readCache(cache->view(), mtp_layer, table, 0, n - 1, r, cfg().latentDim()),
              golden_->f32("p0.mtp_pe_cache"), kStateTol);
  const std::vector<std::int32_t> idx = golden_->ids("p0.mtp_topk_idx");
  const std::vector<float> w = golden_->f32("p0.mtp_topk_weight");
  ASSERT_EQ(trace.topk_idx.size(), idx.size());
  double wmax = 0.0;
  for (std::size_t i = 0; i < idx.size(); i += static_cast<std::size_t>(k)) {
    std::set<std::int32_t> a(trace.topk_idx.begin() + static_cast<std::ptrdiff_t>(i),
                             trace.topk_idx.begin() + static_cast<std::ptrdiff_t>(i + static_cast<std::size_t>(k)));
    std::set<std::int32_t> b(idx.begin() + static_cast<std::ptrdiff_t>(i),
                             idx.begin() + static_cast<std::ptrdiff_t>(i + static_cast<std::size_t>(k)));
    ASSERT_EQ(a, b) << "MTP expert set, row " << i / static_cast<std::size_t>(k);
    for (std::size_t j = i; j < i + static_cast<std::size_t>(k); ++j) {
      for (std::size_t m = i; m < i + static_cast<std::size_t>(k); ++m) {
        if (trace.topk_idx[m] == idx[j])
          wmax = std::max(wmax, std::abs(static_cast<double>(trace.topk_weight[m]) - w[j]));
      }
    }
  }
  std::printf("  [golden] %-44s max|diff| = %.3g (tolerance %.0e)\n", name("mtp_topk_weight").c_str(), wmax, kRouteTol);
  EXPECT_LE(wmax, kRouteTol);
}

// An FP8 cache (e4m3, a scale per 64 values: kv_format.h) against F32 and BF16 caches on the
// golden models: the prompt's logits move by a bounded multiple of what a BF16 cache moves them
// (e4m3 keeps 3 mantissa bits, BF16 7), the cache holds what a BF16 cache would within FP8's
// step, and MTP speculation still never changes the tokens.
TEST_P(GoldenModel, AnFp8CacheStaysWithinItsPrecisionOfTheF32Cache) {
  ForwardOptions fo;
  fo.logits = OutputRows::All;
  const std::vector<std::int32_t> table = iotaBlocks(4);
  const SequenceChunk chunk{prompt_, 0, table};
  auto f32 = PagedLatentCache::create(cfg(), 4, 16, DType::F32);
  auto bf16 = PagedLatentCache::create(cfg(), 4, 16, DType::BF16);
  auto fp8 = PagedLatentCache::create(cfg(), 4, 16, DType::F8E4M3);
  ASSERT_TRUE(f32.ok() && bf16.ok() && fp8.ok());
  EXPECT_EQ(fp8->bytes(),
            static_cast<std::size_t>(cfg().kvLayers() * 4 * 16) * kvTokenBytes(DType::F8E4M3, cfg().latentDim()));
  const auto vocab = static_cast<std::size_t>(cfg().vocab_size);
  std::vector<std::vector<float>> fp8_logits;
  for (const AttentionPath path : {AttentionPath::Prefill, AttentionPath::Absorbed}) {
    fo.attention = path;
    auto a = engine_->forward(std::span<const SequenceChunk>(&chunk, 1), f32->view(), fo);
    auto h = engine_->forward(std::span<const SequenceChunk>(&chunk, 1), bf16->view(), fo);
    auto b = engine_->forward(std::span<const SequenceChunk>(&chunk, 1), fp8->view(), fo);
    ASSERT_TRUE(a.ok() && h.ok()) << "F32 and BF16 caches";
    ASSERT_TRUE(b.ok()) << b.error().toString();
    const double d_bf16 = maxAbsDiff(a->logits, h->logits);
    const double d_fp8 = maxAbsDiff(a->logits, b->logits);
    int same = 0;
    for (std::size_t p = 0; p < prompt_.size(); ++p) {
      same += argmax(std::span<const float>(a->logits.data() + p * vocab, vocab)) ==
              argmax(std::span<const float>(b->logits.data() + p * vocab, vocab));
    }
    std::printf("  [fp8 kv] %-36s max|logit diff| vs F32: fp8 %.3g, bf16 %.3g; argmax equal %d/%zu\n",
                name(path == AttentionPath::Prefill ? "prefill path" : "absorbed path").c_str(), d_fp8, d_bf16, same,
                prompt_.size());
    EXPECT_GT(d_fp8, d_bf16);  // the cache really is coarser than BF16
    EXPECT_GE(same, static_cast<int>(prompt_.size()) * 3 / 4);
    fp8_logits.push_back(std::move(b->logits));
  }
  // Both attention paths read the FP8 tiles alike (the absorbed path dequantizes whole blocks, the
  // prefill path reads rows): they agree as closely as they do on an F32 cache.
  EXPECT_LT(maxAbsDiff(fp8_logits[0], fp8_logits[1]), 1e-3);
  // Layer 0's latents (the later layers' inputs already differ) are the F32 cache's within half
  // an e4m3 step of their tile's scale.
  const std::int64_t ld = cfg().latentDim();
  std::vector<float> x(static_cast<std::size_t>(ld)), y(static_cast<std::size_t>(ld));
  for (std::int64_t layer = 0; layer < 1; ++layer) {
    for (std::int64_t p = 0; p < static_cast<std::int64_t>(prompt_.size()); ++p) {
      readLatent(f32->view(), layer, table, p, x.data());
      readLatent(fp8->view(), layer, table, p, y.data());
      for (std::int64_t i = 0; i < ld; ++i) {
        float amax = 0;
        for (std::int64_t j = i / kKvFp8Tile * kKvFp8Tile; j < std::min(ld, (i / kKvFp8Tile + 1) * kKvFp8Tile); ++j) {
          amax = std::max(amax, std::fabs(x[static_cast<std::size_t>(j)]));
        }
        const float xi = x[static_cast<std::size_t>(i)];
        ASSERT_LE(std::fabs(xi - y[static_cast<std::size_t>(i)]),
                  std::max(std::fabs(xi) * 0x1p-4F, amax / 448.0F * 0x1p-10F) * 1.001F)
            << "layer " << layer << " position " << p << " value " << i;
      }
    }
  }
  // Speculation and chunking never change the output, FP8 cache or not. (The random golden
  // models' greedy tokens are not FP8-stable: their first token already differs from the golden
  // one; EngineFp8Kv below measures a trained model.)
  std::vector<std::vector<std::int32_t>> runs;
  for (const std::int64_t drafts : {0, 2, 3}) {
    GenerateOptions o;
    o.max_tokens = static_cast<std::int64_t>(greedy_.size());
    o.mtp_drafts = drafts;
    o.block_size = 16;
    o.cache_dtype = DType::F8E4M3;
    o.prefill_chunk = drafts == 2 ? 7 : 0;
    auto res = generate(*engine_, prompt_, o);
    ASSERT_TRUE(res.ok()) << res.error().toString();
    runs.push_back(res->tokens);
  }
  EXPECT_EQ(runs[1], runs[0]);
  EXPECT_EQ(runs[2], runs[0]);
  EXPECT_EQ(runs[0].size(), greedy_.size());
}

// The embedded default model (trained, models/tiny-dsv3), teacher-forced: each prompt plus the
// F32 cache's 32 greedy tokens run through an F32 and an FP8 cache; at the generated positions the
// FP8 cache's top token is the F32 cache's at least 90 % of the time (measured: see the line
// printed). Free-running greedy tokens are not compared: one flip changes everything after it.
TEST(EngineFp8Kv, OnTheTrainedDefaultModelTheTopTokenMostlyStays) {
  pd::test::TempDir dir;
  auto model = ensureDefaultModel(dir.path());
  ASSERT_TRUE(model.ok()) << model.error().toString();
  auto engine = createCpuEngine(*model, CpuEngineOptions{2, std::nullopt});
  ASSERT_TRUE(engine.ok()) << engine.error().toString();
  Engine& e = **engine;
  const auto vocab = static_cast<std::size_t>(e.config().vocab_size);
  std::uint32_t state = 12345;
  int same = 0;
  int total = 0;
  double worst = 0;
  for (const std::int64_t length : {5, 40, 130, 300}) {
    std::vector<std::int32_t> seq;
    for (std::int64_t i = 0; i < length; ++i) {
      state = state * 1664525U + 1013904223U;
      seq.push_back(static_cast<std::int32_t>(10 + (state >> 8) % 4000));
    }
    GenerateOptions o;
    o.max_tokens = 32;
    o.stop_at_eos = false;
    auto greedy = generate(e, seq, o);
    ASSERT_TRUE(greedy.ok()) << greedy.error().toString();
    seq.insert(seq.end(), greedy->tokens.begin(), greedy->tokens.end());
    const std::vector<std::int32_t> table = iotaBlocks((static_cast<std::int64_t>(seq.size()) + 15) / 16);
    const SequenceChunk chunk{seq, 0, table};
    ForwardOptions fo;
    fo.logits = OutputRows::All;
    std::vector<float> logits[2];
    for (int fp8 = 0; fp8 < 2; ++fp8) {
      auto cache = PagedLatentCache::create(e.config(), static_cast<std::int64_t>(table.size()), 16,
                                            fp8 != 0 ? DType::F8E4M3 : DType::F32);
      ASSERT_TRUE(cache.ok());
      auto out = e.forward(std::span<const SequenceChunk>(&chunk, 1), cache->view(), fo);
      ASSERT_TRUE(out.ok()) << out.error().toString();
      logits[fp8] = std::move(out->logits);
    }
    worst = std::max(worst, maxAbsDiff(logits[0], logits[1]));
    for (std::size_t p = static_cast<std::size_t>(length) - 1; p + 1 < seq.size(); ++p) {
      same += argmax(std::span<const float>(logits[0].data() + p * vocab, vocab)) ==
              argmax(std::span<const float>(logits[1].data() + p * vocab, vocab));
      ++total;
    }
  }
  std::printf("  [fp8 kv] default model: top token equal at %d of %d generated positions; max|logit diff| %.3g\n", same,
              total, worst);
  EXPECT_GE(same * 10, total * 9);
}

TEST_P(GoldenModel, GenerateGreedyWithAndWithoutMtpGivesTheGoldenTokens) {
  for (const std::int64_t drafts : {0, 1, 2, 3}) {
    GenerateOptions o;
    o.max_tokens = static_cast<std::int64_t>(greedy_.size());
    o.mtp_drafts = drafts;
    o.block_size = 16;
    o.prefill_chunk = drafts == 2 ? 7 : 0;
    auto res = generate(*engine_, prompt_, o);
    ASSERT_TRUE(res.ok()) << res.error().toString();
    EXPECT_EQ(res->tokens, greedy_) << "mtp drafts " << drafts;
    if (drafts > 0) {
      EXPECT_GT(res->drafts_proposed, 0);
      EXPECT_LE(res->drafts_accepted, res->drafts_proposed);
    }
  }
}

TEST_P(GoldenModel, SampledGenerationIsSeededAndUnchangedByMtp) {
  GenerateOptions o;
  o.max_tokens = 12;
  o.stop_at_eos = false;
  o.sampling.temperature = 1.0;
  o.sampling.top_p = 0.9;
  o.sampling.seed = 77;
  auto a = generate(*engine_, prompt_, o);
  auto b = generate(*engine_, prompt_, o);
  o.mtp_drafts = 2;
  auto c = generate(*engine_, prompt_, o);
  o.mtp_drafts = 0;
  o.sampling.seed = 78;
  auto other = generate(*engine_, prompt_, o);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && other.ok());
  EXPECT_EQ(a->tokens, b->tokens);
  EXPECT_EQ(a->tokens, c->tokens);
  EXPECT_NE(a->tokens, other->tokens);
}

TEST_P(GoldenModel, FinalHiddenFeedsTheMtpLikeThePrefillWorkerDoes) {
  // What a prefill worker does: prefill in chunks, then the MTP over the prompt.
  const std::int64_t n = static_cast<std::int64_t>(prompt_.size());
  auto cache = PagedLatentCache::create(cfg(), 4, 16);
  ASSERT_TRUE(cache.ok());
  const std::vector<std::int32_t> table = iotaBlocks(3);
  std::vector<float> hidden;
  ForwardOutput last;
  for (std::int64_t c0 = 0; c0 < n; c0 += 16) {
    const std::int64_t c1 = std::min(n, c0 + 16);
    const SequenceChunk c{std::span<const std::int32_t>(prompt_.data() + c0, static_cast<std::size_t>(c1 - c0)), c0,
                          table};
    ForwardOptions o;
    o.hidden = OutputRows::All;
    auto out = engine_->forward(std::span<const SequenceChunk>(&c, 1), cache->view(), o);
    ASSERT_TRUE(out.ok());
    hidden.insert(hidden.end(), out->hidden.begin(), out->hidden.end());
    last = std::move(out).value();
  }
  expectClose(name("chunked-16 hidden_final"), hidden, golden_->f32("p0.hidden_final"), kStateTol);
  const std::int32_t first = argmax(last.logits);
  EXPECT_EQ(first, greedy_[0]);
  std::vector<std::int32_t> shifted(prompt_.begin() + 1, prompt_.end());
  shifted.push_back(first);
  const SequenceChunk m{shifted, 0, table, hidden};
  ForwardOptions o;
  o.logits = OutputRows::All;
  auto out = engine_->forwardMtp(std::span<const SequenceChunk>(&m, 1), cache->view(), o);
  ASSERT_TRUE(out.ok());
  // `pdserve logits` writes exactly these rows as mtp_logits_nozero [N, vocab].
  expectClose(name("mtp_logits_nozero first N rows"), out->logits,
              rows(golden_->f32("p0.mtp_logits_nozero"), cfg().vocab_size, 0, n), kLogitsTol);
}

std::string goldenModelName(const ::testing::TestParamInfo<std::string>& param) {
  return param.param == "tiny-bf16" ? "bf16" : "fp8";
}

TEST_P(GoldenModel, EveryInstructionSetMatchesGolden) {
  const std::vector<float> want = golden_->f32("p0.logits_all");
  for (const CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512}) {
    if (!cpuSupports(isa)) continue;
    auto e = createCpuEngine(kGoldenDir / GetParam(), CpuEngineOptions{1, isa});
    ASSERT_TRUE(e.ok());
    EXPECT_EQ((*e)->capabilities().backend, "cpu/" + std::string(cpuIsaName(isa)));
    auto cache = PagedLatentCache::create(cfg(), 3, 16);
    ASSERT_TRUE(cache.ok());
    const std::vector<std::int32_t> table = iotaBlocks(3);
    for (const AttentionPath path : {AttentionPath::Prefill, AttentionPath::Absorbed}) {
      const SequenceChunk c{prompt_, 0, table};
      ForwardOptions o;
      o.attention = path;
      o.logits = OutputRows::All;
      auto out = (*e)->forward(std::span<const SequenceChunk>(&c, 1), cache->view(), o);
      ASSERT_TRUE(out.ok());
      expectClose(name(std::string(cpuIsaName(isa)) + (path == AttentionPath::Prefill ? " prefill" : " absorbed") +
                       " logits_all"),
                  out->logits, want, kLogitsTol);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Tiny, GoldenModel, ::testing::Values("tiny-bf16", "tiny-fp8"), goldenModelName);

TEST(GoldenFp8, DequantizedWeightsAreExact) {
  auto weights = ModelWeights::load(kGoldenDir / "tiny-fp8");
  ASSERT_TRUE(weights.ok()) << weights.error().toString();
  const Golden golden(kGoldenDir / "tiny-fp8" / "golden.safetensors");
  int checked = 0;
  for (const TensorView& t : golden.file().tensors()) {
    if (t.name.rfind("dequant.", 0) != 0) continue;
    auto w = (*weights)->matrix(t.name.substr(8));
    ASSERT_TRUE(w.ok()) << w.error().toString();
    EXPECT_EQ(w->dtype, DType::F8E4M3) << t.name;
    std::vector<float> got(static_cast<std::size_t>(w->rows * w->cols));
    for (std::int64_t r = 0; r < w->rows; ++r) dequantizeRow(*w, r, got.data() + r * w->cols);
    const std::vector<float> want = golden.f32(t.name);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << t.name << " not bit-exact";
    ++checked;
  }
  EXPECT_EQ(checked, 12);
}

// --- invariants of the engine itself -----------------------------------------------------------

class EngineInvariants : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = makeEngine("tiny-fp8");
    const Golden golden(kGoldenDir / "tiny-fp8" / "golden.safetensors");
    prompt_ = golden.ids("p0.tokens");
  }
  const ModelConfig& cfg() const { return engine_->config(); }

  // Logits of every prompt position, prefilled in chunks of `chunk` tokens.
  std::vector<float> chunkedLogits(std::int64_t chunk, AttentionPath path) {
    auto cache = PagedLatentCache::create(cfg(), 3, 16);
    PD_CHECK(cache.ok());
    const std::vector<std::int32_t> table = iotaBlocks(3);
    std::vector<float> out;
    const auto n = static_cast<std::int64_t>(prompt_.size());
    for (std::int64_t c0 = 0; c0 < n; c0 += chunk) {
      const std::int64_t c1 = std::min(n, c0 + chunk);
      const SequenceChunk c{std::span<const std::int32_t>(prompt_.data() + c0, static_cast<std::size_t>(c1 - c0)), c0,
                            table};
      ForwardOptions o;
      o.attention = path;
      o.logits = OutputRows::All;
      auto r = engine_->forward(std::span<const SequenceChunk>(&c, 1), cache->view(), o);
      PD_CHECK(r.ok());
      out.insert(out.end(), r->logits.begin(), r->logits.end());
    }
    return out;
  }

  std::unique_ptr<Engine> engine_;
  std::vector<std::int32_t> prompt_;
};

TEST_F(EngineInvariants, ChunkedPrefillEqualsOneShot) {
  for (const AttentionPath path : {AttentionPath::Prefill, AttentionPath::Absorbed}) {
    const std::vector<float> one_shot = chunkedLogits(static_cast<std::int64_t>(prompt_.size()), path);
    for (const std::int64_t chunk : {1, 7, 16, 39}) {
      EXPECT_LE(maxAbsDiff(chunkedLogits(chunk, path), one_shot), 1e-5) << "chunk " << chunk;
    }
  }
  // The two attention paths agree up to rounding.
  EXPECT_LE(maxAbsDiff(chunkedLogits(40, AttentionPath::Prefill), chunkedLogits(40, AttentionPath::Absorbed)), 1e-4);
}

TEST_F(EngineInvariants, BatchOfSequencesEqualsEachAlone) {
  // Three sequences of different lengths, prefilled together then decoded together (one with
  // three query tokens, as in MTP verification), against each run alone.
  const std::vector<std::int32_t> a(prompt_.begin(), prompt_.end());
  const std::vector<std::int32_t> b(prompt_.begin() + 5, prompt_.begin() + 28);
  const std::vector<std::int32_t> c{7, 1999, 3, 512, 42, 42, 1000, 5, 9};
  const std::vector<std::int32_t> next_a{11}, next_b{12, 13, 14}, next_c{15};
  const std::vector<std::vector<std::int32_t>> prompts{a, b, c};
  const std::vector<std::vector<std::int32_t>> nexts{next_a, next_b, next_c};
  const std::vector<std::vector<std::int32_t>> tables{{0, 1, 2}, {3, 4}, {5}};
  for (const AttentionPath path : {AttentionPath::Prefill, AttentionPath::Absorbed}) {
    auto shared = PagedLatentCache::create(cfg(), 6, 16);
    ASSERT_TRUE(shared.ok());
    std::vector<SequenceChunk> batch;
    for (std::size_t s = 0; s < 3; ++s) batch.push_back({prompts[s], 0, tables[s]});
    ForwardOptions o;
    o.attention = path;
    o.logits = OutputRows::All;
    o.hidden = OutputRows::Last;
    auto together = engine_->forward(batch, shared->view(), o);
    ASSERT_TRUE(together.ok());
    std::vector<SequenceChunk> step;
    for (std::size_t s = 0; s < 3; ++s) {
      step.push_back({nexts[s], static_cast<std::int64_t>(prompts[s].size()), tables[s]});
    }
    ForwardOptions so;
    so.attention = AttentionPath::Absorbed;
    so.logits = OutputRows::All;
    auto step_together = engine_->forward(step, shared->view(), so);
    ASSERT_TRUE(step_together.ok());
    std::size_t row = 0, step_row = 0;
    const auto vocab = static_cast<std::size_t>(cfg().vocab_size);
    for (std::size_t s = 0; s < 3; ++s) {
      auto alone_cache = PagedLatentCache::create(cfg(), 6, 16);
      ASSERT_TRUE(alone_cache.ok());
      const SequenceChunk one{prompts[s], 0, tables[s]};
      auto alone = engine_->forward(std::span<const SequenceChunk>(&one, 1), alone_cache->view(), o);
      ASSERT_TRUE(alone.ok());
      const std::vector<float> mine(
          together->logits.begin() + static_cast<std::ptrdiff_t>(row * vocab),
          together->logits.begin() + static_cast<std::ptrdiff_t>((row + prompts[s].size()) * vocab));
      EXPECT_LE(maxAbsDiff(mine, alone->logits), 1e-5) << "sequence " << s;
      const std::vector<float> mine_h(
          together->hidden.begin() + static_cast<std::ptrdiff_t>(s * static_cast<std::size_t>(cfg().hidden_size)),
          together->hidden.begin() +
              static_cast<std::ptrdiff_t>((s + 1) * static_cast<std::size_t>(cfg().hidden_size)));
      EXPECT_LE(maxAbsDiff(mine_h, alone->hidden), 1e-5);
      row += prompts[s].size();
      const SequenceChunk one_step{nexts[s], static_cast<std::int64_t>(prompts[s].size()), tables[s]};
      auto alone_step = engine_->forward(std::span<const SequenceChunk>(&one_step, 1), alone_cache->view(), so);
      ASSERT_TRUE(alone_step.ok());
      const std::vector<float> mine_step(
          step_together->logits.begin() + static_cast<std::ptrdiff_t>(step_row * vocab),
          step_together->logits.begin() + static_cast<std::ptrdiff_t>((step_row + nexts[s].size()) * vocab));
      EXPECT_LE(maxAbsDiff(mine_step, alone_step->logits), 1e-5) << "decode step, sequence " << s;
      step_row += nexts[s].size();
    }
  }
}

TEST_F(EngineInvariants, DecodeStepLogitsEqualPrefillLogitsAtTheSamePositions) {
  const std::vector<float> prefill = chunkedLogits(static_cast<std::int64_t>(prompt_.size()), AttentionPath::Prefill);
  auto cache = PagedLatentCache::create(cfg(), 3, 16);
  ASSERT_TRUE(cache.ok());
  const std::vector<std::int32_t> table = iotaBlocks(3);
  std::vector<float> decoded;
  for (std::size_t p = 0; p < prompt_.size(); ++p) {
    const SequenceChunk c{std::span<const std::int32_t>(&prompt_[p], 1), static_cast<std::int64_t>(p), table};
    ForwardOptions o;
    o.attention = AttentionPath::Absorbed;
    auto r = engine_->forward(std::span<const SequenceChunk>(&c, 1), cache->view(), o);
    ASSERT_TRUE(r.ok());
    decoded.insert(decoded.end(), r->logits.begin(), r->logits.end());
  }
  EXPECT_LE(maxAbsDiff(decoded, prefill), 1e-4);
}

class RecordingSink : public LatentKvSink {
 public:
  struct Call {
    std::int64_t layer;
    std::size_t sequence;
    std::int64_t start;
    std::vector<float> latent;
  };
  void onLayer(std::int64_t kv_layer, std::size_t sequence, std::int64_t start_pos,
               std::span<const float> latent) override {
    calls.push_back({kv_layer, sequence, start_pos, {latent.begin(), latent.end()}});
  }
  std::vector<Call> calls;
};

TEST_F(EngineInvariants, SinkGetsEveryLayersLatentAsTheCacheHoldsIt) {
  auto cache = PagedLatentCache::create(cfg(), 4, 16);
  ASSERT_TRUE(cache.ok());
  const std::vector<std::int32_t> t0{0, 1}, t1{2, 3};
  const std::vector<std::int32_t> second(prompt_.begin() + 20, prompt_.begin() + 27);
  const std::vector<SequenceChunk> batch{{std::span<const std::int32_t>(prompt_.data(), 20), 0, t0}, {second, 9, t1}};
  RecordingSink sink;
  ForwardOptions o;
  o.sink = &sink;
  // Sequence 1 starts at position 9: give it something cached first.
  const SequenceChunk pre{std::span<const std::int32_t>(prompt_.data(), 9), 0, t1};
  ASSERT_TRUE(engine_->forward(std::span<const SequenceChunk>(&pre, 1), cache->view(), {}).ok());
  ASSERT_TRUE(engine_->forward(batch, cache->view(), o).ok());
  ASSERT_EQ(sink.calls.size(), static_cast<std::size_t>(2 * cfg().num_hidden_layers));
  for (std::size_t i = 0; i < sink.calls.size(); ++i) {
    const auto& c = sink.calls[i];
    EXPECT_EQ(c.layer, static_cast<std::int64_t>(i / 2));
    EXPECT_EQ(c.sequence, i % 2);
    const std::int64_t n = c.sequence == 0 ? 20 : 7;
    EXPECT_EQ(c.start, c.sequence == 0 ? 0 : 9);
    ASSERT_EQ(c.latent.size(), static_cast<std::size_t>(n * cfg().latentDim()));
    const auto& table = c.sequence == 0 ? t0 : t1;
    EXPECT_EQ(readCache(cache->view(), c.layer, table, c.start, c.start + n, 0, cfg().latentDim()), c.latent);
  }
}

TEST_F(EngineInvariants, Bf16CacheStaysCloseToFloat32) {
  const std::vector<std::int32_t> table = iotaBlocks(3);
  const SequenceChunk c{prompt_, 0, table};
  ForwardOptions o;
  o.logits = OutputRows::All;
  auto f32 = PagedLatentCache::create(cfg(), 3, 16, DType::F32);
  auto bf16 = PagedLatentCache::create(cfg(), 3, 16, DType::BF16);
  ASSERT_TRUE(f32.ok() && bf16.ok());
  for (const AttentionPath path : {AttentionPath::Prefill, AttentionPath::Absorbed}) {
    o.attention = path;
    auto a = engine_->forward(std::span<const SequenceChunk>(&c, 1), f32->view(), o);
    auto b = engine_->forward(std::span<const SequenceChunk>(&c, 1), bf16->view(), o);
    ASSERT_TRUE(a.ok() && b.ok());
    const double d = maxAbsDiff(a->logits, b->logits);
    EXPECT_GT(d, 0.0);  // the cache really is BF16
    EXPECT_LT(d, 0.5);
    int same = 0;
    const auto vocab = static_cast<std::size_t>(cfg().vocab_size);
    for (std::size_t p = 0; p < prompt_.size(); ++p) {
      same += argmax(std::span<const float>(a->logits.data() + p * vocab, vocab)) ==
              argmax(std::span<const float>(b->logits.data() + p * vocab, vocab));
    }
    EXPECT_GE(same, static_cast<int>(prompt_.size()) * 9 / 10);
  }
}

TEST_F(EngineInvariants, MalformedBatchesAreInvalidArgumentAndWriteNothing) {
  auto cache = PagedLatentCache::create(cfg(), 2, 16);
  ASSERT_TRUE(cache.ok());
  const std::vector<std::int32_t> table{0, 1};
  const std::vector<std::int32_t> bad_token{5, static_cast<std::int32_t>(cfg().vocab_size)};
  const std::vector<std::int32_t> ok_tokens{5, 6};
  const std::vector<std::int32_t> long_prompt(33, 3);
  const std::vector<std::int32_t> bad_table{0, 9};
  const auto expectInvalid = [&](const SequenceChunk& c, bool mtp = false) {
    auto r = mtp ? engine_->forwardMtp(std::span<const SequenceChunk>(&c, 1), cache->view(), {})
                 : engine_->forward(std::span<const SequenceChunk>(&c, 1), cache->view(), {});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code, ErrorCode::InvalidArgument) << r.error().toString();
  };
  expectInvalid({bad_token, 0, table});
  expectInvalid({long_prompt, 0, table});                      // 2 blocks of 16 < 33 positions
  expectInvalid({ok_tokens, 15, bad_table});                   // block id 9 of 2
  expectInvalid({std::span<const std::int32_t>(), 0, table});  // empty chunk
  expectInvalid({ok_tokens, 0, table}, /*mtp=*/true);          // no prev_hidden
  auto big = PagedLatentCache::create(cfg(), 20, 16);
  ASSERT_TRUE(big.ok());
  const std::vector<std::int32_t> big_table = iotaBlocks(20);
  const SequenceChunk beyond{ok_tokens, cfg().max_position_embeddings - 1, big_table};
  auto r = engine_->forward(std::span<const SequenceChunk>(&beyond, 1), big->view(), {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("max_position_embeddings"), std::string::npos);
  auto wrong_dim = PagedLatentCache::create(2, 10, 2, 16, DType::F32);
  ASSERT_TRUE(wrong_dim.ok());
  const SequenceChunk c{ok_tokens, 0, table};
  EXPECT_FALSE(engine_->forward(std::span<const SequenceChunk>(&c, 1), wrong_dim->view(), {}).ok());
  // Nothing was written by the failed calls.
  std::vector<float> row(static_cast<std::size_t>(cfg().latentDim()));
  readLatent(cache->view(), 0, table, 0, row.data());
  EXPECT_TRUE(std::all_of(row.begin(), row.end(), [](float v) { return v == 0.0F; }));
}

// A make-model checkpoint without q LoRA (a direct q_proj, as DeepSeek-V2-Lite) and with FP8
// blocks that do not divide the matrices: the engine's own invariants must hold there too.
TEST(MadeModel, DirectQProjAndPartialFp8BlocksAreConsistent) {
  const fs::path dir = fs::temp_directory_path() / ("pd_engine_test_noqlora_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto config = presetConfig("tiny");
  ASSERT_TRUE(config.ok());
  ASSERT_TRUE(setDimension(*config, "q_lora_rank", 0).ok());
  ASSERT_TRUE(setDimension(*config, "hidden_size", 320).ok());  // 320 = 2.5 blocks of 128
  config->quantization = Fp8Quantization{};
  MakeModelOptions mo;
  mo.seed = 3;
  ASSERT_TRUE(makeModel(*config, dir, mo).ok());
  auto engine = createCpuEngine(dir, CpuEngineOptions{2, std::nullopt});
  ASSERT_TRUE(engine.ok()) << engine.error().toString();
  Engine& e = **engine;
  EXPECT_EQ(e.capabilities().weight_dtype, DType::F8E4M3);
  const std::vector<std::int32_t> prompt{5, 17,   300, 2000, 9,  9,  41, 1024, 77,   3,
                                         8, 1500, 600, 12,   13, 14, 15, 16,   1999, 2};
  const std::vector<std::int32_t> table = iotaBlocks(2);
  const auto run = [&](std::int64_t chunk, AttentionPath path) {
    auto cache = PagedLatentCache::create(e.config(), 2, 16);
    PD_CHECK(cache.ok());
    std::vector<float> logits;
    for (std::size_t c0 = 0; c0 < prompt.size(); c0 += static_cast<std::size_t>(chunk)) {
      const std::size_t c1 = std::min(prompt.size(), c0 + static_cast<std::size_t>(chunk));
      const SequenceChunk c{std::span<const std::int32_t>(prompt.data() + c0, c1 - c0), static_cast<std::int64_t>(c0),
                            table};
      ForwardOptions o;
      o.attention = path;
      o.logits = OutputRows::All;
      auto out = e.forward(std::span<const SequenceChunk>(&c, 1), cache->view(), o);
      PD_CHECK(out.ok());
      logits.insert(logits.end(), out->logits.begin(), out->logits.end());
    }
    return logits;
  };
  const std::vector<float> one_shot = run(20, AttentionPath::Prefill);
  double scale = 0.0;
  for (const float v : one_shot) scale = std::max(scale, static_cast<double>(std::abs(v)));
  EXPECT_GT(scale, 0.5);
  EXPECT_LE(maxAbsDiff(run(6, AttentionPath::Prefill), one_shot), 1e-5);
  EXPECT_LE(maxAbsDiff(run(1, AttentionPath::Absorbed), one_shot), 1e-4);
  fs::remove_all(dir);
}

// Writes a copy of tiny-fp8 with one change to its tensors, in a temp dir.
class BrokenCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("pd_engine_test_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    fs::copy_file(kGoldenDir / "tiny-fp8" / "config.json", dir_ / "config.json");
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Copies every tensor except `drop`; `reshape` gets its two dims swapped.
  void write(const std::string& drop, const std::string& reshape) {
    auto src = SafetensorsFile::open(kGoldenDir / "tiny-fp8" / "model.safetensors");
    ASSERT_TRUE(src.ok());
    std::vector<TensorToWrite> out;
    for (const TensorView& t : src->tensors()) {
      if (t.name == drop) continue;
      TensorToWrite w{t.name, t.dtype, t.shape, t.data};
      if (t.name == reshape) std::swap(w.shape[0], w.shape[1]);
      out.push_back(w);
    }
    ASSERT_TRUE(writeSafetensors(dir_ / "model.safetensors", out).ok());
  }
  void expectError(const std::string& mentions) {
    auto w = ModelWeights::load(dir_);
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.error().message.find(mentions), std::string::npos) << w.error().toString();
    auto e = createCpuEngine(dir_);
    EXPECT_FALSE(e.ok());
  }

  fs::path dir_;
};

TEST_F(BrokenCheckpoint, MissingTensorIsNamed) {
  write("model.layers.1.mlp.experts.3.up_proj.weight", "");
  expectError("model.layers.1.mlp.experts.3.up_proj.weight");
}

TEST_F(BrokenCheckpoint, WrongShapeIsNamed) {
  write("", "model.layers.2.self_attn.kv_b_proj.weight");
  expectError("model.layers.2.self_attn.kv_b_proj.weight");
}

TEST_F(BrokenCheckpoint, Fp8WeightWithoutScaleIsNamed) {
  write("model.layers.0.self_attn.o_proj.weight_scale_inv", "");
  expectError("model.layers.0.self_attn.o_proj.weight_scale_inv");
}

TEST_F(BrokenCheckpoint, IntactCopyLoads) {
  write("", "");
  auto w = ModelWeights::load(dir_);
  EXPECT_TRUE(w.ok()) << w.error().toString();
}

}  // namespace
}  // namespace pd::model
