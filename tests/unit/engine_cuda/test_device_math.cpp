// The CUDA kernels' arithmetic (engine/cuda/device_math.h) compiled for the host and checked
// against the CPU engine: value decode, YaRN RoPE, RMSNorm (through the engine's own trace),
// noaux_tc routing, the split-KV softmax merge, sampling, the FP8 and grouped GEMVs' reduction
// order, and the MoE grouping and combine.
// Runs on every machine; the GPU parity tests (tests/gpu) then check the kernels themselves.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_reference.h"
#include "device_math.h"
#include "pd/common/dtype.h"
#include "pd/common/kv_format.h"
#include "pd/engine/engine.h"
#include "pd/engine/kernels.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/model_factory.h"
#include "pd/engine/model_weights.h"
#include "pd/engine/rope.h"
#include "pd/engine/sampling.h"

namespace {

namespace fs = std::filesystem;
namespace gm = pd::gpu::math;
using pd::DType;
using std::int64_t;

const fs::path kGoldenDir = fs::path(PD_TEST_DATA_DIR) / "golden";

std::uint32_t bitsOf(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// ------------------------------------------------------------------------------------------
// Value decode.

TEST(DeviceMath, Fp8DecodeEqualsTheCpuTableForEveryCode) {
  for (int code = 0; code < 256; ++code) {
    const float cpu = pd::fp8e4m3ToFloat(static_cast<std::uint8_t>(code));
    const float hd = gm::fp8e4m3Decode(static_cast<std::uint8_t>(code));
    if (std::isnan(cpu)) {
      EXPECT_TRUE(std::isnan(hd)) << code;
    } else {
      EXPECT_EQ(bitsOf(hd), bitsOf(cpu)) << "code " << code;
    }
  }
}

TEST(DeviceMath, Bf16RoundTripEqualsTheCpuConversion) {
  std::mt19937 rng(7);
  std::vector<float> values{0.0F, -0.0F, 1.0F, -1.5F, 3.0e38F, -3.4e38F, 1e-40F, INFINITY, -INFINITY, NAN};
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 20000; ++i) {
    const std::uint32_t b = bits(rng);
    float f;
    std::memcpy(&f, &b, sizeof f);
    values.push_back(f);
  }
  for (const float v : values) {
    ASSERT_EQ(gm::bf16Encode(v), pd::floatToBf16(v)) << v;
    const auto h = static_cast<std::uint16_t>(bitsOf(v) >> 16);
    const float a = gm::bf16Decode(h);
    const float b = pd::bf16ToFloat(h);
    ASSERT_TRUE(bitsOf(a) == bitsOf(b) || (std::isnan(a) && std::isnan(b)));
  }
}

// e4m3 encode: every float whose bits are a multiple of 1021 apart (about 4.2 million, every
// exponent and many mantissas), the e4m3 codes themselves and the midpoints between neighbours (the
// ties), each encoded as pd::floatToFp8e4m3 encodes it.
TEST(DeviceMath, Fp8EncodeEqualsTheCpuConversion) {
  for (std::uint64_t b = 0; b <= 0xFFFFFFFFULL; b += 1021) {
    const auto bits = static_cast<std::uint32_t>(b);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    ASSERT_EQ(gm::fp8e4m3Encode(f), pd::floatToFp8e4m3(f)) << "bits " << bits;
  }
  for (unsigned code = 0; code < 256; ++code) {
    const float v = pd::fp8e4m3ToFloat(static_cast<std::uint8_t>(code));
    const float next = pd::fp8e4m3ToFloat(static_cast<std::uint8_t>(code + 1 < 256 ? code + 1 : code));
    for (const float x : {v, (v + next) / 2, -v, -(v + next) / 2, std::nextafter(v, 1e9F), std::nextafter(v, -1e9F)}) {
      ASSERT_EQ(gm::fp8e4m3Encode(x), pd::floatToFp8e4m3(x)) << "near code " << code << ": " << x;
    }
  }
}

// The FP8 KV cache's token format (pd/common/kv_format.h) as the kernels write and read it: the
// bytes kvFp8EncodeToken writes, whole or tile by tile as the scatter kernel writes them, are
// pd::encodeKvToken's, and every value kvFp8At reads is pd::decodeKvToken's (bit-equal).
TEST(DeviceMath, KvFp8TokensAreTheHostCachesBytes) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (const int d : {1, 5, 63, 64, 65, 128, 576}) {
    EXPECT_EQ(static_cast<std::uint64_t>(gm::kvFp8TokenBytes(d)), pd::kvTokenBytes(DType::F8E4M3, d)) << d;
    EXPECT_EQ(static_cast<std::uint64_t>(gm::kvFp8ScaleOffset(d)), pd::kvFp8ScaleOffset(d)) << d;
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<float> x(static_cast<std::size_t>(d));
      for (auto& v : x) v = normal(rng) * std::pow(10.0F, normal(rng) * 2);
      if (trial % 7 == 0) std::fill(x.begin(), x.begin() + std::min(d, 64), 0.0F);  // a zero tile
      if (trial % 11 == 0) x[0] = -0.0F;
      std::vector<std::byte> host(pd::kvTokenBytes(DType::F8E4M3, d));
      pd::encodeKvToken(DType::F8E4M3, x, host.data());
      std::vector<std::uint8_t> device(host.size(), 0xCD);
      gm::kvFp8EncodeToken(x.data(), d, device.data());
      ASSERT_EQ(std::memcmp(device.data(), host.data(), host.size()), 0) << "d " << d << " trial " << trial;
      std::vector<std::uint8_t> tiled(host.size(), 0xCD);
      for (int t = 0; t * gm::kKvFp8Tile < d; ++t) gm::kvFp8EncodeTile(x.data(), d, t, tiled.data());
      gm::kvFp8ZeroPadding(d, tiled.data());
      ASSERT_EQ(tiled, device);
      std::vector<float> values(static_cast<std::size_t>(d));
      pd::decodeKvToken(DType::F8E4M3, host.data(), values);
      for (int i = 0; i < d; ++i) {
        ASSERT_EQ(bitsOf(gm::kvFp8At(device.data(), d, i)), bitsOf(values[static_cast<std::size_t>(i)]))
            << "d " << d << " trial " << trial << " value " << i;
      }
    }
  }
  EXPECT_EQ(gm::kKvFp8Tile, pd::kKvFp8Tile);
}

// A random FP8 matrix with block scales, owning its storage.
struct Fp8Matrix {
  std::vector<std::uint8_t> q;
  std::vector<float> scales;
  pd::model::WeightMatrix w;
};
Fp8Matrix randomFp8(int64_t rows, int64_t cols, std::mt19937& rng, int64_t block = 128) {
  Fp8Matrix m;
  std::normal_distribution<float> normal(0.0F, 100.0F);
  std::uniform_real_distribution<float> scale(0.001F, 0.01F);
  m.q.resize(static_cast<std::size_t>(rows * cols));
  for (auto& v : m.q) v = pd::floatToFp8e4m3(normal(rng));
  m.w.dtype = DType::F8E4M3;
  m.w.rows = rows;
  m.w.cols = cols;
  m.w.block_rows = block;
  m.w.block_cols = block;
  m.scales.resize(static_cast<std::size_t>(m.w.scaleRows() * m.w.scaleCols()));
  for (auto& s : m.scales) s = scale(rng);
  m.w.data = m.q.data();
  m.w.scale_inv = m.scales.data();
  return m;
}

TEST(DeviceMath, BlockScaledFp8EqualsDequantizeRowAcrossBlockBoundaries) {
  std::mt19937 rng(11);
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {129, 257}, {300, 130}, {7, 1000}}) {
    const Fp8Matrix m = randomFp8(rows, cols, rng);
    std::vector<float> row(static_cast<std::size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      pd::model::dequantizeRow(m.w, r, row.data());
      for (int64_t c = 0; c < cols; ++c) {
        const float hd = gm::fp8BlockScaledValue(
            m.q[static_cast<std::size_t>(r * cols + c)],
            m.scales[static_cast<std::size_t>(gm::fp8ScaleIndex(r, c, m.w.scaleCols(), 128, 128))]);
        ASSERT_EQ(bitsOf(hd), bitsOf(row[static_cast<std::size_t>(c)]))
            << rows << "x" << cols << " at " << r << "," << c;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// RoPE.

std::vector<float> deviceInvFreq(const pd::ModelConfig& cfg) {
  const int64_t dim = cfg.qk_rope_head_dim;
  std::vector<float> f(static_cast<std::size_t>(dim / 2));
  double low = 0.0, high = 0.0;
  if (cfg.rope_scaling) {
    const auto& s = *cfg.rope_scaling;
    gm::yarnCorrectionRange(dim, cfg.rope_theta, s.original_max_position_embeddings, s.beta_fast, s.beta_slow, low,
                            high);
  }
  for (int64_t j = 0; j < dim / 2; ++j) {
    float v = gm::ropeBaseFrequency(j, dim, static_cast<float>(cfg.rope_theta));
    if (cfg.rope_scaling) v = gm::yarnFrequency(v, j, low, high, static_cast<float>(cfg.rope_scaling->factor));
    f[static_cast<std::size_t>(j)] = v;
  }
  return f;
}

TEST(DeviceMath, YarnFrequenciesAndRotationEqualTheCpuRope) {
  std::vector<pd::ModelConfig> configs;
  for (const char* preset : {"tiny", "deepseek-v3-layers=1"}) {
    auto c = pd::presetConfig(preset);
    ASSERT_TRUE(c.ok()) << c.error().toString();
    configs.push_back(*c);
  }
  auto golden = pd::ModelConfig::load(kGoldenDir / "tiny-bf16");
  ASSERT_TRUE(golden.ok());
  configs.push_back(*golden);
  configs.push_back(configs[1]);
  configs.back().rope_scaling.reset();  // plain RoPE too
  bool saw_yarn = false;
  for (const auto& cfg : configs) {
    saw_yarn = saw_yarn || cfg.rope_scaling.has_value();
    auto cpu = pd::model::ropeInvFreq(cfg);
    ASSERT_TRUE(cpu.ok());
    const std::vector<float> hd = deviceInvFreq(cfg);
    ASSERT_EQ(hd.size(), cpu->size());
    for (std::size_t j = 0; j < hd.size(); ++j) ASSERT_EQ(bitsOf(hd[j]), bitsOf((*cpu)[j])) << j;
    const int64_t half = static_cast<int64_t>(hd.size());
    std::vector<float> cs(hd.size()), sn(hd.size());
    std::mt19937 rng(3);
    std::normal_distribution<float> normal;
    for (const int64_t pos : {int64_t{0}, int64_t{1}, int64_t{17}, int64_t{4095}, int64_t{163839}}) {
      pd::model::ropeCosSin(*cpu, pos, cs.data(), sn.data());
      std::vector<float> x(static_cast<std::size_t>(2 * half));
      for (auto& v : x) v = normal(rng);
      std::vector<float> y = x;
      pd::model::applyRope(x.data(), cs.data(), sn.data(), half);
      for (int64_t j = 0; j < half; ++j) {
        const float angle = gm::ropeAngle(pos, hd[static_cast<std::size_t>(j)]);
        gm::ropeRotatePair(y[static_cast<std::size_t>(2 * j)], y[static_cast<std::size_t>(2 * j + 1)], gm::cosF(angle),
                           gm::sinF(angle));
      }
      for (std::size_t i = 0; i < x.size(); ++i) ASSERT_EQ(bitsOf(y[i]), bitsOf(x[i])) << "pos " << pos << " i " << i;
    }
  }
  EXPECT_TRUE(saw_yarn);
}

// ------------------------------------------------------------------------------------------
// RMSNorm, against the CPU engine itself: its final hidden states are the final norm of the
// residual after the last layer, both of which its trace reports.

TEST(DeviceMath, RmsNormEqualsTheCpuEnginesFinalNorm) {
  auto weights = pd::model::ModelWeights::load(kGoldenDir / "tiny-bf16");
  ASSERT_TRUE(weights.ok()) << weights.error().toString();
  const pd::ModelConfig cfg = (*weights)->config();
  const std::vector<float> final_norm = (*weights)->finalNorm();
  auto engine = pd::model::createCpuEngine(std::move(*weights), pd::model::CpuEngineOptions{1, std::nullopt, false});
  ASSERT_TRUE(engine.ok()) << engine.error().toString();
  auto cache = pd::model::PagedLatentCache::create(cfg, 4, 16);
  ASSERT_TRUE(cache.ok());
  const std::vector<std::int32_t> tokens{5, 77, 300, 1999, 42, 8};
  const std::vector<std::int32_t> table{0};
  const pd::model::SequenceChunk chunk{tokens, 0, table};
  pd::model::ForwardTrace trace;
  pd::model::ForwardOptions o;
  o.logits = pd::model::OutputRows::None;
  o.hidden = pd::model::OutputRows::All;
  o.trace = &trace;
  auto out = (*engine)->forward(std::span(&chunk, 1), cache->view(), o);
  ASSERT_TRUE(out.ok()) << out.error().toString();
  const int64_t d = cfg.hidden_size;
  const auto n = static_cast<int64_t>(tokens.size());
  const float* last = trace.layer_hidden.data() + (cfg.num_hidden_layers - 1) * n * d;
  for (int64_t t = 0; t < n; ++t) {
    double ss = 0.0;
    for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(last[t * d + i]) * last[t * d + i];
    const float inv = gm::rmsInverse(ss, d, static_cast<float>(cfg.rms_norm_eps));
    for (int64_t i = 0; i < d; ++i) {
      const float v = gm::rmsNormValue(last[t * d + i], inv, final_norm[static_cast<std::size_t>(i)]);
      ASSERT_EQ(bitsOf(v), bitsOf(out->hidden[static_cast<std::size_t>(t * d + i)])) << t << "," << i;
    }
  }
}

// ------------------------------------------------------------------------------------------
// Routing.

void expectSameRouting(const std::vector<float>& logits, const std::vector<float>& bias, int64_t groups,
                       int64_t topk_group, int64_t top_k) {
  const auto n = static_cast<int64_t>(logits.size());
  const pd::test::CpuRouting cpu = pd::test::cpuRouteToken(logits, bias, groups, topk_group, top_k, 2.5);
  gm::RoutingShape shape{n, groups, topk_group, top_k, 2.5F};
  std::vector<float> score(logits.size()), biased(logits.size()), group_score(static_cast<std::size_t>(groups));
  std::vector<std::int32_t> idx(static_cast<std::size_t>(top_k));
  std::vector<float> w(static_cast<std::size_t>(top_k));
  gm::routeNoauxTc(logits.data(), bias.empty() ? nullptr : bias.data(), shape, score.data(), biased.data(),
                   group_score.data(), idx.data(), w.data());
  ASSERT_EQ(idx, cpu.idx) << "experts " << n << " groups " << groups;
  for (std::size_t k = 0; k < w.size(); ++k) ASSERT_EQ(bitsOf(w[k]), bitsOf(cpu.weight[k])) << k;
}

TEST(DeviceMath, NoauxTcRoutingEqualsTheCpuEngineIncludingTies) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  struct Shape {
    int64_t experts, groups, topk_group, top_k;
  };
  const std::vector<Shape> shapes{{16, 4, 2, 4}, {256, 8, 4, 8}, {16, 1, 1, 2}, {12, 3, 1, 3}, {8, 8, 3, 2}};
  int ties = 0;
  for (const Shape& s : shapes) {
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<float> logits(static_cast<std::size_t>(s.experts));
      std::vector<float> bias(trial % 2 == 0 ? logits.size() : 0);
      // A third of the trials draw from 3 values only, so experts and groups tie.
      const bool tie_heavy = trial % 3 == 0;
      for (auto& v : logits) v = tie_heavy ? static_cast<float>(static_cast<int>(rng() % 3)) : normal(rng);
      {
        for (auto& b : bias) b = tie_heavy ? 0.25F * static_cast<float>(rng() % 2) : 0.05F * normal(rng);
      }
      ties += tie_heavy ? 1 : 0;
      expectSameRouting(logits, bias, s.groups, s.topk_group, s.top_k);
    }
  }
  EXPECT_GT(ties, 100);
}

// ------------------------------------------------------------------------------------------
// Split-KV merge: the kernel's split attention equals the CPU engine's one-pass attention.

TEST(DeviceMath, SplitSoftmaxMergeEqualsTheCpuEnginesAttention) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  const pd::model::KernelTable& k = pd::model::kernelTable(pd::model::detectCpuIsa());
  const int64_t ld = 40;
  const int64_t heads = 3;
  const int64_t bs = 16;
  for (const int64_t ctx : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{100}, int64_t{513}}) {
    const int64_t blocks = (ctx + bs - 1) / bs;
    auto cache = pd::model::PagedLatentCache::create(1, ld, blocks + 2, bs, DType::F32);
    ASSERT_TRUE(cache.ok());
    std::vector<std::int32_t> table;
    for (int64_t b = 0; b < blocks; ++b) table.push_back(static_cast<std::int32_t>(blocks + 1 - b));  // reversed
    std::vector<float> lat(static_cast<std::size_t>(ld));
    for (int64_t p = 0; p < ctx; ++p) {
      for (auto& v : lat) v = normal(rng);
      pd::model::writeLatent(cache->view(), 0, table, p, lat.data());
    }
    std::vector<float> q(static_cast<std::size_t>(heads * ld));
    for (auto& v : q) v = normal(rng);
    const float scale = 0.3F;
    const std::vector<float> cpu =
        pd::test::cpuLatentAttention(k, cache->view(), 0, table, ctx, q.data(), heads, scale);
    for (const int64_t split : {int64_t{1}, int64_t{7}, int64_t{64}, int64_t{512}}) {
      const int64_t nsplit = (ctx + split - 1) / split + 1;  // one more: an empty split merges as nothing
      for (int64_t h = 0; h < heads; ++h) {
        std::vector<gm::SoftmaxPartial> parts(static_cast<std::size_t>(nsplit));
        std::vector<float> o(static_cast<std::size_t>(nsplit * ld), 0.0F);
        for (int64_t s = 0; s < nsplit; ++s) {
          const int64_t p0 = s * split;
          const int64_t p1 = std::min(ctx, p0 + split);
          auto& part = parts[static_cast<std::size_t>(s)];
          std::vector<float> sc;
          for (int64_t p = p0; p < p1; ++p) {
            pd::model::readLatent(cache->view(), 0, table, p, lat.data());
            float dot = 0.0F;
            for (int64_t i = 0; i < ld; ++i)
              dot += q[static_cast<std::size_t>(h * ld + i)] * lat[static_cast<std::size_t>(i)];
            sc.push_back(dot * scale);
            part.max = std::max(part.max, sc.back());
          }
          for (int64_t p = p0; p < p1; ++p) {
            const float e = gm::expF(sc[static_cast<std::size_t>(p - p0)] - part.max);
            part.sum += e;
            pd::model::readLatent(cache->view(), 0, table, p, lat.data());
            for (int64_t i = 0; i < ld; ++i)
              o[static_cast<std::size_t>(s * ld + i)] += e * lat[static_cast<std::size_t>(i)];
          }
        }
        const gm::SoftmaxPartial total = gm::mergePartials(parts.data(), nsplit);
        for (int64_t i = 0; i < ld; ++i) {
          const float merged = gm::mergedOutput(o.data() + i, ld, parts.data(), nsplit, total);
          const float want = cpu[static_cast<std::size_t>(h * ld + i)];
          ASSERT_NEAR(merged, want, 2e-5F * (1.0F + std::fabs(want))) << "ctx " << ctx << " split " << split;
        }
      }
    }
  }
}

// The prefill kernels' arithmetic, chunk by chunk as MlaPrefillAttention runs it (the latents of
// a chunk up-projected by kv_b, one running softmax per row and head), against the plain
// prefill attention in double, for causal rows of one sequence and chunks that split the context
// anywhere.
TEST(DeviceMath, PrefillAttentionInChunksEqualsOneSoftmaxOverTheContext) {
  std::mt19937 rng(21);
  std::normal_distribution<float> normal;
  const int64_t heads = 3;
  const int64_t nope = 8;
  const int64_t rope = 4;
  const int64_t v = 6;
  const int64_t rank = 12;
  const int64_t ld = rank + rope;
  const int64_t qk = nope + rope;
  const int64_t kvw = heads * (nope + v);
  const int64_t bs = 16;
  const float scale = 0.25F;
  std::vector<float> kv_b(static_cast<std::size_t>(kvw * rank));
  for (auto& x : kv_b) x = normal(rng) * 0.3F;
  for (const int64_t ctx : {int64_t{1}, int64_t{17}, int64_t{256}, int64_t{257}, int64_t{700}}) {
    const int64_t blocks = (ctx + bs - 1) / bs;
    auto cache = pd::model::PagedLatentCache::create(1, ld, blocks + 1, bs, DType::F32);
    ASSERT_TRUE(cache.ok());
    std::vector<std::int32_t> table;
    for (int64_t b = 0; b < blocks; ++b) table.push_back(static_cast<std::int32_t>(blocks - b));  // reversed
    std::vector<float> lat(static_cast<std::size_t>(ld));
    for (int64_t p = 0; p < ctx; ++p) {
      for (auto& x : lat) x = normal(rng);
      pd::model::writeLatent(cache->view(), 0, table, p, lat.data());
    }
    // The rows of a chunk of up to 5 new tokens ending at ctx: row t attends [0, ctx_len[t]).
    std::vector<int64_t> ctx_len;
    for (int64_t c = std::max<int64_t>(1, ctx - 4); c <= ctx; ++c) ctx_len.push_back(c);
    const auto rows = static_cast<int64_t>(ctx_len.size());
    std::vector<float> q(static_cast<std::size_t>(rows * heads * qk));
    for (auto& x : q) x = normal(rng);
    for (const int64_t chunk : {int64_t{7}, int64_t{64}, int64_t{256}}) {
      std::vector<gm::RunningSoftmax> state(static_cast<std::size_t>(rows * heads));
      std::vector<float> acc(static_cast<std::size_t>(rows * heads * v), 0.0F);
      for (int64_t first = 0; first < ctx; first += chunk) {
        const int64_t count = std::min(chunk, ctx - first);
        std::vector<float> lc(static_cast<std::size_t>(count * ld));
        for (int64_t p = 0; p < count; ++p) {
          pd::model::readLatent(cache->view(), 0, table, first + p, lc.data() + p * ld);
        }
        std::vector<float> kv(static_cast<std::size_t>(count * kvw));  // the SGEMM's output
        for (int64_t p = 0; p < count; ++p) {
          for (int64_t j = 0; j < kvw; ++j) {
            float sum = 0.0F;
            for (int64_t i = 0; i < rank; ++i) {
              sum += kv_b[static_cast<std::size_t>(j * rank + i)] * lc[static_cast<std::size_t>(p * ld + i)];
            }
            kv[static_cast<std::size_t>(p * kvw + j)] = sum;
          }
        }
        for (int64_t t = 0; t < rows; ++t) {
          const int64_t n = std::min(first + count, ctx_len[static_cast<std::size_t>(t)]) - first;
          if (n <= 0) continue;
          for (int64_t h = 0; h < heads; ++h) {
            const float* qh = q.data() + (t * heads + h) * qk;
            std::vector<float> w(static_cast<std::size_t>(n));
            for (int64_t p = 0; p < n; ++p) {
              const float* k = kv.data() + p * kvw + h * (nope + v);
              float dot = 0.0F;
              for (int64_t i = 0; i < nope; ++i) dot += qh[i] * k[i];
              for (int64_t i = 0; i < rope; ++i) dot += qh[nope + i] * lc[static_cast<std::size_t>(p * ld + rank + i)];
              w[static_cast<std::size_t>(p)] = dot;
            }
            auto& st = state[static_cast<std::size_t>(t * heads + h)];
            const float factor = gm::runningSoftmaxStep(st, w.data(), n, scale);
            for (int64_t i = 0; i < v; ++i) {
              float& a = acc[static_cast<std::size_t>((t * heads + h) * v + i)];
              a = gm::runningOutputStep(a, factor, w.data(), kv.data() + h * (nope + v) + nope + i, kvw, n);
            }
          }
        }
      }
      const std::vector<float> want = pd::test::referencePrefillAttention(
          cache->view(), 0, table, ctx_len, q.data(), kv_b.data(), heads, nope, rope, v, rank, scale);
      for (int64_t t = 0; t < rows; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t i = 0; i < v; ++i) {
            const auto hi = static_cast<std::size_t>((t * heads + h) * v + i);
            const float got = gm::runningOutputFinal(acc[hi], state[static_cast<std::size_t>(t * heads + h)]);
            const float ref = want[hi];
            ASSERT_NEAR(got, ref, 2e-5F * (1.0F + std::fabs(ref)))
                << "ctx " << ctx << " row " << t << " chunk " << chunk << " head " << h << " i " << i;
          }
        }
      }
    }
  }
}

// The running softmax keeps what came before when the maximum moves: two chunks equal one.
TEST(DeviceMath, RunningSoftmaxRescalesWhenTheMaximumMoves) {
  std::vector<float> all{0.5F, -1.0F, 3.0F, 2.0F, 7.0F, -4.0F};
  gm::RunningSoftmax one;
  std::vector<float> w1 = all;
  EXPECT_EQ(gm::runningSoftmaxStep(one, w1.data(), 6, 0.5F), 1.0F);  // from empty: no rescale
  gm::RunningSoftmax two;
  std::vector<float> a(all.begin(), all.begin() + 3);
  std::vector<float> b(all.begin() + 3, all.end());
  gm::runningSoftmaxStep(two, a.data(), 3, 0.5F);
  EXPECT_EQ(two.max, 1.5F);
  const float factor = gm::runningSoftmaxStep(two, b.data(), 3, 0.5F);
  EXPECT_EQ(two.max, 3.5F);
  EXPECT_FLOAT_EQ(factor, std::exp(1.5F - 3.5F));
  EXPECT_NEAR(two.sum, one.sum, 1e-6F * one.sum);
  const float values[6] = {1, 2, 3, 4, 5, 6};
  const float acc1 = gm::runningOutputStep(0.0F, 1.0F, w1.data(), values, 1, 6);
  float acc2 = gm::runningOutputStep(0.0F, 1.0F, a.data(), values, 1, 3);
  acc2 = gm::runningOutputStep(acc2, factor, b.data(), values + 3, 1, 3);
  EXPECT_NEAR(gm::runningOutputFinal(acc2, two), gm::runningOutputFinal(acc1, one), 1e-6F);
}

TEST(DeviceMath, EmptyPartialsMergeAsNothing) {
  const gm::SoftmaxPartial empty;
  EXPECT_EQ(gm::mergeFactor(empty.max, 3.0F), 0.0F);
  const gm::SoftmaxPartial parts[3] = {empty, {2.0F, 1.5F}, empty};
  const gm::SoftmaxPartial total = gm::mergePartials(parts, 3);
  EXPECT_EQ(total.max, 2.0F);
  EXPECT_EQ(total.sum, 1.5F);
}

// ------------------------------------------------------------------------------------------
// Sampling: the serial draw over the device transforms reproduces the CPU Sampler token for
// token (same seed, same logits, penalties from the tokens drawn so far).

TEST(DeviceMath, SamplingEqualsTheCpuSamplerTokenForToken) {
  struct Case {
    double temperature;
    int64_t top_k;
    double top_p, min_p, presence, frequency;
  };
  const std::vector<Case> cases{{1.0, 0, 1.0, 0.0, 0.0, 0.0},  {0.7, 0, 1.0, 0.0, 0.5, 0.3},
                                {1.3, 40, 1.0, 0.0, 0.0, 0.0}, {0.8, 0, 0.9, 0.0, 0.0, 0.0},
                                {1.0, 0, 1.0, 0.05, 0.0, 0.0}, {0.9, 50, 0.8, 0.02, 1.0, 0.5},
                                {2.0, 1, 1.0, 0.0, 0.0, 0.0}};
  const int64_t vocab = 1000;
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0F, 3.0F);
  int distinct_draws = 0;
  for (const Case& c : cases) {
    for (const std::uint64_t seed : {std::uint64_t{0}, std::uint64_t{42}, std::uint64_t{0xFFFFFFFFFFFFFFFFULL}}) {
      pd::SamplingParams params;
      params.temperature = c.temperature;
      params.top_k = c.top_k;
      params.top_p = c.top_p;
      params.min_p = c.min_p;
      params.presence_penalty = c.presence;
      params.frequency_penalty = c.frequency;
      params.seed = seed;
      pd::model::Sampler sampler(params);
      std::vector<int64_t> counts(static_cast<std::size_t>(vocab), 0);
      const gm::SamplingTransform transform{1.0 / c.temperature, c.top_k, c.top_p, c.min_p};
      std::vector<std::int32_t> seen;
      for (std::uint64_t step = 0; step < 60; ++step) {
        std::vector<float> logits(static_cast<std::size_t>(vocab));
        for (auto& v : logits) v = normal(rng);
        logits[step % 7] = logits[(step % 7) + 1];  // some ties
        const std::int32_t cpu = sampler.sample(logits).token;
        std::vector<float> work = logits;
        for (int64_t t = 0; t < vocab; ++t) {
          const int64_t n = counts[static_cast<std::size_t>(t)];
          if (n > 0 && (c.presence != 0.0 || c.frequency != 0.0)) {
            work[static_cast<std::size_t>(t)] =
                gm::penalizedLogit(work[static_cast<std::size_t>(t)], n, c.presence, c.frequency);
          }
        }
        std::vector<std::int32_t> order(static_cast<std::size_t>(vocab));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
          return work[static_cast<std::size_t>(a)] > work[static_cast<std::size_t>(b)];
        });
        const std::int32_t hd = gm::drawToken(work.data(), vocab, order.data(), transform, gm::uniformAt(seed, step));
        ASSERT_EQ(hd, cpu) << "case temperature " << c.temperature << " top_k " << c.top_k << " top_p " << c.top_p
                           << " min_p " << c.min_p << " seed " << seed << " step " << step;
        ++counts[static_cast<std::size_t>(hd)];
        if (std::find(seen.begin(), seen.end(), hd) == seen.end()) seen.push_back(hd);
      }
      distinct_draws += static_cast<int>(seen.size());
    }
  }
  EXPECT_GT(distinct_draws, 200);  // the draws really vary
}

// Under an allowed-token mask: the device's way (tokens outside the mask set to -inf after the
// penalties and logit_bias, the whole row sorted, then drawToken or the greedy argmax) picks the
// CPU Sampler's token, for masks dense enough for its dense path and sparse enough for its
// gather path, with ties, top-k larger than what the mask allows, and every filter.
TEST(DeviceMath, MaskedSamplingEqualsTheCpuSamplerTokenForToken) {
  struct Case {
    double temperature;
    int64_t top_k;
    double top_p, min_p;
  };
  const std::vector<Case> cases{{0.0, 0, 1.0, 0.0},  {1.0, 0, 1.0, 0.0},    {0.7, 40, 1.0, 0.0},  {0.8, 0, 0.9, 0.0},
                                {1.0, 0, 1.0, 0.05}, {0.9, 500, 0.8, 0.02}, {1.2, 1000, 1.0, 0.0}};
  const int64_t vocab = 1000;  // not a multiple of 64: the last word has bits past the vocabulary
  const int64_t words = gm::maskWords(vocab);
  ASSERT_EQ(words, 16);
  std::mt19937 rng(29);
  std::normal_distribution<float> normal(0.0F, 3.0F);
  std::uniform_int_distribution<int64_t> any_token(0, vocab - 1);
  int distinct = 0;
  for (const Case& c : cases) {
    for (const int64_t allowed_tokens :
         {int64_t{1}, int64_t{7}, int64_t{60}, int64_t{500}}) {  // 60 * 16 < 1000: sparse
      pd::SamplingParams params;
      params.temperature = c.temperature;
      params.top_k = c.top_k;
      params.top_p = c.top_p;
      params.min_p = c.min_p;
      params.presence_penalty = 0.4;
      params.seed = 17 + static_cast<std::uint64_t>(allowed_tokens);
      params.logit_bias = {{3, 2.5F}, {998, -1.0F}};
      pd::model::Sampler sampler(params);
      std::vector<int64_t> counts(static_cast<std::size_t>(vocab), 0);
      std::uint64_t draws = 0;
      std::vector<std::int32_t> seen;
      for (int step = 0; step < 25; ++step) {
        std::vector<float> logits(static_cast<std::size_t>(vocab));
        for (auto& v : logits) v = normal(rng);
        std::vector<std::uint64_t> mask(static_cast<std::size_t>(words), 0);
        for (int64_t k = 0; k < allowed_tokens; ++k) {
          const int64_t t = any_token(rng);
          mask[static_cast<std::size_t>(t / 64)] |= std::uint64_t{1} << (t % 64);
        }
        mask.back() |= ~std::uint64_t{0} << (vocab % 64);  // bits past the vocabulary: ignored by both
        ASSERT_TRUE(gm::maskAllowsSome(mask.data(), vocab));
        // Ties between allowed tokens (lowest id wins in both).
        std::vector<int64_t> allowed;
        for (int64_t t = 0; t < vocab; ++t) {
          if (gm::tokenAllowed(mask.data(), t)) allowed.push_back(t);
        }
        if (allowed.size() >= 2)
          logits[static_cast<std::size_t>(allowed[1])] = logits[static_cast<std::size_t>(allowed[0])];
        const std::int32_t cpu = sampler.sample(logits, mask).token;
        std::vector<float> work = logits;
        for (int64_t t = 0; t < vocab; ++t) {
          const int64_t n = counts[static_cast<std::size_t>(t)];
          if (n > 0)
            work[static_cast<std::size_t>(t)] = gm::penalizedLogit(work[static_cast<std::size_t>(t)], n, 0.4, 0.0);
        }
        for (const auto& b : params.logit_bias) work[static_cast<std::size_t>(b.token)] += b.bias;
        for (int64_t t = 0; t < vocab; ++t) {
          if (!gm::tokenAllowed(mask.data(), t)) work[static_cast<std::size_t>(t)] = -INFINITY;
        }
        std::int32_t hd = 0;
        if (c.temperature == 0.0) {
          for (int64_t t = 1; t < vocab; ++t) {
            if (work[static_cast<std::size_t>(t)] > work[static_cast<std::size_t>(hd)])
              hd = static_cast<std::int32_t>(t);
          }
        } else {
          std::vector<std::int32_t> order(static_cast<std::size_t>(vocab));
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
            return work[static_cast<std::size_t>(a)] > work[static_cast<std::size_t>(b)];
          });
          const gm::SamplingTransform transform{1.0 / c.temperature, c.top_k, c.top_p, c.min_p};
          hd = gm::drawToken(work.data(), vocab, order.data(), transform, gm::uniformAt(params.seed, draws++));
        }
        ASSERT_EQ(hd, cpu) << "temperature " << c.temperature << " top_k " << c.top_k << " top_p " << c.top_p
                           << " min_p " << c.min_p << " allowed " << allowed_tokens << " step " << step;
        ASSERT_TRUE(gm::tokenAllowed(mask.data(), hd));
        ++counts[static_cast<std::size_t>(hd)];
        if (std::find(seen.begin(), seen.end(), hd) == seen.end()) seen.push_back(hd);
      }
      distinct += static_cast<int>(seen.size());
    }
  }
  EXPECT_GT(distinct, 150);  // the draws really vary
}

TEST(DeviceMath, MaskHelpersReadTheSamplersBitOrder) {
  EXPECT_EQ(gm::maskWords(1), 1);
  EXPECT_EQ(gm::maskWords(64), 1);
  EXPECT_EQ(gm::maskWords(65), 2);
  EXPECT_EQ(gm::maskWords(129280), 2020);
  std::vector<std::uint64_t> mask(2, 0);
  mask[1] = std::uint64_t{1} << 3;  // token 67
  EXPECT_TRUE(gm::tokenAllowed(mask.data(), 67));
  EXPECT_FALSE(gm::tokenAllowed(mask.data(), 3));
  EXPECT_TRUE(gm::maskAllowsSome(mask.data(), 68));
  EXPECT_FALSE(gm::maskAllowsSome(mask.data(), 67));  // token 67 is past a 67-token vocabulary
  mask[1] = 0;
  mask[0] = std::uint64_t{1} << 63;
  EXPECT_TRUE(gm::maskAllowsSome(mask.data(), 64));
  EXPECT_FALSE(gm::maskAllowsSome(std::vector<std::uint64_t>(2, 0).data(), 128));
}

// ------------------------------------------------------------------------------------------
// FP8 GEMV reduction order.

TEST(DeviceMath, Fp8GemvOrderAgreesWithTheCpuMatmul) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal;
  const pd::model::KernelTable& k = pd::model::kernelTable(pd::model::detectCpuIsa());
  for (const auto& [rows, cols] :
       std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 127}, {130, 128}, {64, 129}, {17, 1000}, {256, 7168}}) {
    const Fp8Matrix m = randomFp8(rows, cols, rng);
    std::vector<float> x(static_cast<std::size_t>(cols));
    for (auto& v : x) v = normal(rng);
    std::vector<float> cpu(static_cast<std::size_t>(rows));
    k.matmul(m.w, 0, rows, x.data(), cols, 1, cpu.data(), rows);
    std::vector<float> row(static_cast<std::size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      const float hd =
          gm::fp8GemvRow(m.q.data() + r * cols, m.scales.data() + (r / 128) * m.w.scaleCols(), cols, 128, x.data());
      pd::model::dequantizeRow(m.w, r, row.data());
      double mag = 0.0;
      for (int64_t c = 0; c < cols; ++c)
        mag += std::fabs(static_cast<double>(row[static_cast<std::size_t>(c)]) * x[static_cast<std::size_t>(c)]);
      ASSERT_NEAR(hd, cpu[static_cast<std::size_t>(r)], 1e-6 * mag + 1e-30) << rows << "x" << cols << " row " << r;
    }
  }
}

// ------------------------------------------------------------------------------------------
// Top-n logprobs.

TEST(DeviceMath, TopTokensAreTheCpuSamplersTopLogprobsIncludingTies) {
  std::mt19937 rng(37);
  std::normal_distribution<float> normal;
  for (const int64_t vocab : {1, 7, 1000, 129280}) {
    for (const int64_t n : {1, 5, 20}) {
      std::vector<float> raw(static_cast<std::size_t>(vocab));
      // Few distinct values, so ties are everywhere (lower id first on ties).
      for (auto& v : raw) v = std::round(normal(rng) * 2.0F) / 2.0F;
      pd::SamplingParams p;
      p.top_logprobs = n;
      pd::model::Sampler sampler(p);
      const pd::SampledToken want = sampler.sample(raw);
      const int64_t k = std::min(n, vocab);
      ASSERT_EQ(static_cast<int64_t>(want.top.size()), k);
      std::vector<std::int32_t> ids(static_cast<std::size_t>(k));
      gm::topTokens(raw.data(), vocab, k, ids.data());
      // The log-sum-exp as the draw kernel computes it.
      float raw_max = raw[0];
      for (const float v : raw) raw_max = std::max(raw_max, v);
      double sum = 0.0;
      for (const float v : raw) sum += std::exp(static_cast<double>(v) - raw_max);
      const double lse = static_cast<double>(raw_max) + std::log(sum);
      for (int64_t i = 0; i < k; ++i) {
        const auto at = static_cast<std::size_t>(i);
        ASSERT_EQ(ids[at], want.top[at].token) << "vocab " << vocab << " n " << n << " entry " << i;
        ASSERT_EQ(bitsOf(gm::rawLogprob(raw[static_cast<std::size_t>(ids[at])], lse)), bitsOf(want.top[at].logprob));
      }
      // The kernel's split: shares of every 7th candidate reduced with ranksBefore give the same.
      float prev_v = 0.0F;
      int64_t prev = -1;
      for (int64_t i = 0; i < k; ++i) {
        int64_t best = -1;
        for (int64_t first = 0; first < 7; ++first) {
          const int64_t c = gm::bestAfter(raw.data(), first, vocab, 7, prev_v, prev);
          if (c >= 0 && (best < 0 || gm::ranksBefore(raw[static_cast<std::size_t>(c)], c,
                                                     raw[static_cast<std::size_t>(best)], best))) {
            best = c;
          }
        }
        ASSERT_EQ(best, ids[static_cast<std::size_t>(i)]) << "split scan, entry " << i;
        prev = best;
        prev_v = raw[static_cast<std::size_t>(best)];
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// Grouped GEMV (the MoE experts on the device).

TEST(DeviceMath, GroupedGemvRowIsTheFp8GemvForFp8AndCloseToTheCpuForEveryKind) {
  std::mt19937 rng(23);
  std::normal_distribution<float> normal;
  const pd::model::KernelTable& k = pd::model::kernelTable(pd::model::detectCpuIsa());
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 127}, {130, 129}, {17, 1000}}) {
    std::vector<float> x(static_cast<std::size_t>(cols));
    for (auto& v : x) v = normal(rng);
    // FP8: the very order of the FP8 GEMV, so bit-equal to it.
    const Fp8Matrix m = randomFp8(rows, cols, rng);
    for (int64_t r = 0; r < rows; ++r) {
      const float* scale_row = m.scales.data() + (r / 128) * m.w.scaleCols();
      const float grouped = gm::gemvRow(gm::GemvWeights::Fp8, m.q.data(), scale_row, r, cols, 128, x.data());
      const float fp8 = gm::fp8GemvRow(m.q.data() + r * cols, scale_row, cols, 128, x.data());
      ASSERT_EQ(bitsOf(grouped), bitsOf(fp8)) << rows << "x" << cols << " row " << r;
    }
    // F32 and BF16 against the CPU engine's matmul of the same values (BF16: of the inputs
    // rounded to BF16, the bf16 mode's rule).
    std::vector<float> wf(static_cast<std::size_t>(rows * cols));
    for (auto& v : wf) v = normal(rng);
    std::vector<std::uint16_t> wb(wf.size());
    std::vector<float> wb_values(wf.size());
    for (std::size_t i = 0; i < wf.size(); ++i) {
      wb[i] = pd::floatToBf16(wf[i]);
      wb_values[i] = pd::bf16ToFloat(wb[i]);
    }
    std::vector<float> xb(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) xb[i] = pd::bf16ToFloat(pd::floatToBf16(x[i]));
    for (const bool bf16 : {false, true}) {
      pd::model::WeightMatrix w;
      w.dtype = DType::F32;
      w.rows = rows;
      w.cols = cols;
      w.data = bf16 ? wb_values.data() : wf.data();
      std::vector<float> cpu(static_cast<std::size_t>(rows));
      k.matmul(w, 0, rows, bf16 ? xb.data() : x.data(), cols, 1, cpu.data(), rows);
      for (int64_t r = 0; r < rows; ++r) {
        const float hd = bf16 ? gm::gemvRow(gm::GemvWeights::Bf16, wb.data(), nullptr, r, cols, 128, x.data())
                              : gm::gemvRow(gm::GemvWeights::F32, wf.data(), nullptr, r, cols, 128, x.data());
        double mag = 0.0;
        for (int64_t c = 0; c < cols; ++c) {
          const auto at = static_cast<std::size_t>(r * cols + c);
          const float wv = bf16 ? wb_values[at] : wf[at];
          const float xv = bf16 ? xb[static_cast<std::size_t>(c)] : x[static_cast<std::size_t>(c)];
          mag += std::fabs(static_cast<double>(wv) * xv);
        }
        ASSERT_NEAR(hd, cpu[static_cast<std::size_t>(r)], 1e-6 * mag + 1e-30)
            << (bf16 ? "bf16 " : "f32 ") << rows << "x" << cols << " row " << r;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// MoE grouping and combine.

// Random top-k choices: each token's ids distinct, as routing gives them.
std::vector<std::int32_t> randomChoices(int64_t tokens, int64_t top_k, int64_t experts, std::mt19937& rng) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(experts));
  std::iota(ids.begin(), ids.end(), 0);
  std::vector<std::int32_t> chosen;
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(ids.begin(), ids.end(), rng);
    chosen.insert(chosen.end(), ids.begin(), ids.begin() + top_k);
  }
  return chosen;
}

TEST(DeviceMath, MoeGroupingIsAStableSortOfTheSlotsByExpert) {
  std::mt19937 rng(29);
  for (const auto& [tokens, top_k, experts] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {1, 1, 1}, {1, 8, 256}, {3, 2, 4}, {64, 8, 256}, {64, 6, 64}, {17, 4, 5}}) {
    const std::vector<std::int32_t> chosen = randomChoices(tokens, top_k, experts, rng);
    const int64_t slots = tokens * top_k;
    std::vector<std::int32_t> offsets(static_cast<std::size_t>(experts + 1), 99);
    std::vector<std::int32_t> slot_of(static_cast<std::size_t>(slots), 99);
    ASSERT_TRUE(gm::groupByExpert(chosen.data(), slots, experts, offsets.data(), slot_of.data()));
    // The definition: slots in a stable sort by expert id; expert e begins after every lower id.
    std::vector<int64_t> order(static_cast<std::size_t>(slots));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return chosen[static_cast<std::size_t>(a)] < chosen[static_cast<std::size_t>(b)];
    });
    for (int64_t row = 0; row < slots; ++row) {
      ASSERT_EQ(slot_of[static_cast<std::size_t>(order[static_cast<std::size_t>(row)])], row);
    }
    for (int64_t e = 0; e <= experts; ++e) {
      const auto below = std::count_if(chosen.begin(), chosen.end(), [&](std::int32_t id) { return id < e; });
      ASSERT_EQ(offsets[static_cast<std::size_t>(e)], below) << "expert " << e;
    }
    std::vector<std::int32_t> distinct = chosen;
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    EXPECT_EQ(gm::expertsWithRows(offsets.data(), experts), static_cast<std::int32_t>(distinct.size()));
  }
}

TEST(DeviceMath, MoeGroupingRefusesAnIdOutsideTheExpertsAndGroupsNothing) {
  for (const std::int32_t bad : {-1, 4, 1000}) {
    const std::vector<std::int32_t> chosen{0, 3, bad, 1};
    std::vector<std::int32_t> offsets(5, 7);
    std::vector<std::int32_t> slot_of(4, 7);
    EXPECT_FALSE(gm::groupByExpert(chosen.data(), 4, 4, offsets.data(), slot_of.data()));
    EXPECT_EQ(offsets, std::vector<std::int32_t>(5, 0));
    EXPECT_EQ(slot_of, std::vector<std::int32_t>(4, -1));
  }
}

TEST(DeviceMath, MoeCombineAddsTheExpertsInAscendingIdOrderThenTheSharedExpert) {
  std::mt19937 rng(31);
  std::normal_distribution<float> normal;
  const int64_t d = 37;
  for (const auto& [tokens, top_k, experts] :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 1, 2}, {5, 8, 256}, {9, 3, 7}}) {
    const std::vector<std::int32_t> chosen = randomChoices(tokens, top_k, experts, rng);
    const int64_t slots = tokens * top_k;
    std::vector<std::int32_t> offsets(static_cast<std::size_t>(experts + 1));
    std::vector<std::int32_t> slot_of(static_cast<std::size_t>(slots));
    ASSERT_TRUE(gm::groupByExpert(chosen.data(), slots, experts, offsets.data(), slot_of.data()));
    std::vector<float> weight(static_cast<std::size_t>(slots));
    for (auto& v : weight) v = std::fabs(normal(rng));
    std::vector<float> gout(static_cast<std::size_t>((slots + tokens) * d));
    for (auto& v : gout) v = normal(rng);
    const float* shared = gout.data() + slots * d;
    for (int64_t t = 0; t < tokens; ++t) {
      const auto at = static_cast<std::size_t>(t * top_k);
      // The CPU engine's combine: its k sorted by expert id, y += w * expert row, then + shared.
      std::vector<int64_t> ks(static_cast<std::size_t>(top_k));
      std::iota(ks.begin(), ks.end(), 0);
      std::sort(ks.begin(), ks.end(), [&](int64_t a, int64_t b) {
        return chosen[at + static_cast<std::size_t>(a)] < chosen[at + static_cast<std::size_t>(b)];
      });
      for (int64_t j = 0; j < d; ++j) {
        float fused = 0.0F;  // with fma, as the kernel's math does
        double exact = 0.0;
        for (const int64_t k : ks) {
          const auto i = at + static_cast<std::size_t>(k);
          const float g =
              gout[static_cast<std::size_t>(slot_of[i]) * static_cast<std::size_t>(d) + static_cast<std::size_t>(j)];
          fused = std::fma(weight[i], g, fused);
          exact += static_cast<double>(weight[i]) * g;
        }
        const float shared_j = shared[t * d + j];
        const float with = gm::moeCombine(chosen.data() + at, weight.data() + at, slot_of.data() + at, top_k,
                                          gout.data(), d, j, shared + t * d);
        const float without = gm::moeCombine(chosen.data() + at, weight.data() + at, slot_of.data() + at, top_k,
                                             gout.data(), d, j, nullptr);
        ASSERT_EQ(bitsOf(without), bitsOf(fused)) << "token " << t << " column " << j;
        ASSERT_EQ(bitsOf(with), bitsOf(fused + shared_j)) << "token " << t << " column " << j;
        ASSERT_NEAR(without, exact, 1e-5 * (1.0 + std::fabs(exact)));
      }
    }
  }
}

TEST(DeviceMath, MoeCombineOrderIsTheExpertIdsNotTheRoutingRank) {
  // Routing ranked experts 5, 9, 2, whose rows are 1e8, -1e8 and 1. In rank order the sum is
  // 1e8 - 1e8 + 1 = 1, and in descending id order (9, 5, 2) -1e8 + 1e8 + 1 = 1; in ascending id
  // order (2, 5, 9) it is 1 + 1e8 (the 1 is lost in float) - 1e8 = 0, what the CPU engine computes.
  const std::vector<std::int32_t> ranked{5, 9, 2};
  const std::vector<std::int32_t> slot_of{0, 1, 2};
  const std::vector<float> weight{1.0F, 1.0F, 1.0F};
  const std::vector<float> gout{1e8F, -1e8F, 1.0F};
  EXPECT_EQ(gm::moeCombine(ranked.data(), weight.data(), slot_of.data(), 3, gout.data(), 1, 0, nullptr), 0.0F);
  // A failed grouping (every slot -1) adds no expert: only the shared row remains.
  const std::vector<std::int32_t> failed{-1, -1, -1};
  const float shared = 2.5F;
  EXPECT_EQ(gm::moeCombine(ranked.data(), weight.data(), failed.data(), 3, gout.data(), 1, 0, &shared), 2.5F);
}

}  // namespace
