// The device decode step's host side (engine/cuda/decode_step_plan.h): a step's batch checked
// against the model and the device cache before anything is launched, and laid out for the
// device. Host arithmetic: runs in every build, GPU or not.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <random>
#include <vector>

#include "decode_step_plan.h"
#include "device_math.h"
#include "pd/engine/model_config.h"
#include "pd/engine/model_factory.h"

namespace {

namespace fs = std::filesystem;
using pd::gpu::DecodeCacheShape;
using pd::gpu::DecodeSequence;
using pd::gpu::planDecodeStep;

pd::ModelConfig tiny() {
  auto c = pd::ModelConfig::load(fs::path(PD_TEST_DATA_DIR) / "golden" / "tiny-bf16");
  EXPECT_TRUE(c.ok()) << c.error().toString();
  return *c;
}

TEST(DecodeStepPlan, LaysOutAMixedLengthBatch) {
  const pd::ModelConfig c = tiny();
  const DecodeCacheShape cache{32, 4};
  const std::vector<std::int32_t> a{3, 7};       // positions 0..7
  const std::vector<std::int32_t> b{5};          // positions 0..3
  const std::vector<std::int32_t> t{9, 10, 11};  // positions 0..11 (only 0..8 needed)
  const std::vector<DecodeSequence> batch{{17, 5, a}, {2, 0, b}, {2047, 8, t}};
  auto plan = planDecodeStep(c, cache, batch);
  ASSERT_TRUE(plan.ok()) << plan.error().toString();
  EXPECT_EQ(plan->tokens, 3);
  EXPECT_EQ(plan->token_ids, (std::vector<std::int32_t>{17, 2, 2047}));
  EXPECT_EQ(plan->positions, (std::vector<std::int64_t>{5, 0, 8}));
  EXPECT_EQ(plan->ctx_len, (std::vector<std::int64_t>{6, 1, 9}));
  // Only the blocks each context needs: 2, 1 and 3 (position 8 is block 2's offset 0).
  EXPECT_EQ(plan->block_tables, (std::vector<std::int32_t>{3, 7, 5, 9, 10, 11}));
  EXPECT_EQ(plan->table_begin, (std::vector<std::int64_t>{0, 2, 3}));
  EXPECT_EQ(plan->write_slot, (std::vector<std::int64_t>{7 * 4 + 1, 5 * 4 + 0, 11 * 4 + 0}));
  EXPECT_EQ(plan->max_context, 9);
}

// The prefill attention path's segments: consecutive rows reading one sequence share one
// up-projection of its context.
TEST(DecodeStepPlan, PrefillSegmentsGroupTheRowsOfOneSequence) {
  const pd::ModelConfig c = tiny();
  const DecodeCacheShape cache{32, 4};
  const std::vector<std::int32_t> a{3, 7, 8};  // sequence A: positions 0..11
  const std::vector<std::int32_t> b{5, 6};     // sequence B
  const std::vector<std::int32_t> fork{3, 9};  // shares A's first block, then its own
  // A chunk of A (positions 3..9), then B's positions 6 and 7, then a fork of A, then A again.
  std::vector<DecodeSequence> batch;
  for (std::int64_t p = 3; p <= 9; ++p) batch.push_back({1, p, a});
  batch.push_back({1, 6, b});
  batch.push_back({1, 7, b});
  batch.push_back({1, 5, fork});
  batch.push_back({1, 10, a});
  auto plan = planDecodeStep(c, cache, batch);
  ASSERT_TRUE(plan.ok()) << plan.error().toString();
  const std::vector<pd::gpu::PrefillSegment> segs = pd::gpu::prefillSegments(*plan);
  ASSERT_EQ(segs.size(), 4U);
  EXPECT_EQ(segs[0].row_begin, 0);
  EXPECT_EQ(segs[0].row_end, 7);
  EXPECT_EQ(segs[0].context, 10);
  EXPECT_EQ(segs[0].table_begin, plan->table_begin[6]);
  EXPECT_EQ(segs[1].row_begin, 7);
  EXPECT_EQ(segs[1].row_end, 9);
  EXPECT_EQ(segs[1].context, 8);
  // The fork's first block is A's, its second is not: a segment of its own.
  EXPECT_EQ(segs[2].row_begin, 9);
  EXPECT_EQ(segs[2].row_end, 10);
  EXPECT_EQ(segs[2].context, 6);
  EXPECT_EQ(segs[3].row_begin, 10);
  EXPECT_EQ(segs[3].row_end, 11);
  EXPECT_EQ(segs[3].context, 11);
  // Every row's positions are in its segment's table: the first `ctx_len` slots agree.
  for (const auto& s : segs) {
    for (std::int64_t t = s.row_begin; t < s.row_end; ++t) {
      const std::int64_t blocks =
          (plan->ctx_len[static_cast<std::size_t>(t)] + cache.block_size - 1) / cache.block_size;
      for (std::int64_t k = 0; k < blocks; ++k) {
        EXPECT_EQ(plan->block_tables[static_cast<std::size_t>(plan->table_begin[static_cast<std::size_t>(t)] + k)],
                  plan->block_tables[static_cast<std::size_t>(s.table_begin + k)]);
      }
    }
  }
  // A shorter context after a longer one (the same sequence's rows out of order) starts a
  // segment: a segment's context is its last row's.
  std::vector<DecodeSequence> backwards{{1, 9, a}, {1, 4, a}};
  auto back = planDecodeStep(c, cache, backwards);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(pd::gpu::prefillSegments(*back).size(), 2U);
  // A decode step of distinct sequences: one row per segment.
  std::vector<DecodeSequence> decode{{1, 11, a}, {1, 7, b}};
  auto dec = planDecodeStep(c, cache, decode);
  ASSERT_TRUE(dec.ok());
  EXPECT_EQ(pd::gpu::prefillSegments(*dec).size(), 2U);
}

TEST(DecodeStepPlan, CacheShapesAreF32Bf16OrFp8WithPositiveSizes) {
  EXPECT_TRUE(pd::gpu::checkCacheShape({8, 4}).ok());
  EXPECT_TRUE(pd::gpu::checkCacheShape({8, 4, pd::DType::BF16}).ok());
  EXPECT_TRUE(pd::gpu::checkCacheShape({8, 4, pd::DType::F8E4M3}).ok());
  const auto f16 = pd::gpu::checkCacheShape({8, 4, pd::DType::F16});
  ASSERT_FALSE(f16.ok());
  EXPECT_NE(f16.error().message.find("only F32, BF16 and F8_E4M3"), std::string::npos) << f16.error().message;
  EXPECT_FALSE(pd::gpu::checkCacheShape({0, 4}).ok());
  EXPECT_FALSE(pd::gpu::checkCacheShape({8, 0, pd::DType::BF16}).ok());
  EXPECT_FALSE(pd::gpu::checkCacheShape({std::int64_t{1} << 30, 4}).ok());  // 2^32 positions
  EXPECT_TRUE(pd::gpu::checkCacheShape({std::int64_t{1} << 29, 4}).ok());
}

// The CUDA engine's Auto attention path: the cheaper one per step. For DeepSeek-V3's dimensions
// a prompt's first 64 rows are cheaper up-projected (the context is the rows), 64 rows deep in a
// 4k context are cheaper absorbed (re-projecting 4k positions for 64 rows), and a decode step of
// single rows always is.
TEST(DecodeStepPlan, AutoAttentionPicksTheCheaperPathPerStep) {
  auto v3 = pd::presetConfig("deepseek-v3-layers=1");
  ASSERT_TRUE(v3.ok()) << v3.error().toString();
  const DecodeCacheShape cache{128, 64};
  std::vector<std::int32_t> table(128);
  std::iota(table.begin(), table.end(), 0);
  const auto rowsAt = [&](std::int64_t first, std::int64_t n) {
    std::vector<DecodeSequence> rows;
    for (std::int64_t p = first; p < first + n; ++p) rows.push_back({1, p, table});
    auto plan = planDecodeStep(*v3, cache, rows);
    EXPECT_TRUE(plan.ok()) << plan.error().toString();
    return *plan;
  };
  const pd::gpu::DecodeStepPlan start = rowsAt(0, 64);
  const pd::gpu::AttentionCost a = pd::gpu::attentionCost(*v3, start);
  // By hand: heads 128, nope 128, rope 64, v 128, rank 512, latent 576; contexts 1..64 (sum 2080).
  EXPECT_DOUBLE_EQ(a.absorbed, 64 * 2.0 * 128 * 256 * 512 + 2080 * 2.0 * 128 * (576 + 512));
  EXPECT_DOUBLE_EQ(a.prefill, 64 * 2.0 * 128 * 256 * 512 + 2080 * 2.0 * 128 * (128 + 64 + 128));
  EXPECT_TRUE(pd::gpu::preferPrefillAttention(*v3, start));
  EXPECT_FALSE(pd::gpu::preferPrefillAttention(*v3, rowsAt(4032, 64)));
  std::vector<std::vector<std::int32_t>> tables(8);
  std::vector<DecodeSequence> decode;
  for (std::size_t s = 0; s < tables.size(); ++s) {
    for (int b = 0; b < 16; ++b) tables[s].push_back(static_cast<std::int32_t>(s * 16 + static_cast<std::size_t>(b)));
    decode.push_back({1, 1000, tables[s]});
  }
  auto step = planDecodeStep(*v3, cache, decode);
  ASSERT_TRUE(step.ok());
  EXPECT_FALSE(pd::gpu::preferPrefillAttention(*v3, *step));
}

TEST(DecodeGraphs, RowBucketsAreTheSmallestBucketHoldingTheRows) {
  const std::vector<std::int64_t> buckets{1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64};
  for (std::int64_t n = 1; n <= pd::gpu::kMaxDecodeBatch; ++n) {
    const std::int64_t b = pd::gpu::graphRowBucket(n);
    EXPECT_GE(b, n);
    EXPECT_EQ(b, *std::lower_bound(buckets.begin(), buckets.end(), n)) << n;
  }
}

// Padded rows are harmless by construction: they name only the padding blocks past the cache's,
// each writes its own slot, each reads a slot a padded row wrote, and the real rows are untouched.
TEST(DecodeGraphs, PaddedRowsWriteAndReadOnlyThePaddingBlocks) {
  const pd::ModelConfig c = tiny();
  for (const std::int64_t bs : {std::int64_t{1}, std::int64_t{4}, std::int64_t{64}}) {
    const DecodeCacheShape cache{32, bs};
    EXPECT_EQ(pd::gpu::paddingBlocks(bs) * bs >= pd::gpu::kMaxDecodeBatch - 1, true) << bs;
    const std::vector<std::int32_t> a{3, 4, 5, 6};
    const std::vector<std::int32_t> b{7, 8, 9, 10};
    const std::vector<std::int32_t> d{12, 13, 14, 15};
    const std::vector<DecodeSequence> batch{{5, 0, a}, {6, 2, b}, {9, 1, d}};
    auto plan = planDecodeStep(c, cache, batch);
    ASSERT_TRUE(plan.ok()) << plan.error().toString();
    for (const std::int64_t rows : {std::int64_t{3}, std::int64_t{4}, std::int64_t{64}}) {
      const pd::gpu::DecodeStepPlan p = pd::gpu::padDecodeStep(*plan, rows, cache);
      ASSERT_EQ(p.tokens, rows);
      ASSERT_EQ(p.token_ids.size(), static_cast<std::size_t>(rows));
      ASSERT_EQ(p.write_slot.size(), static_cast<std::size_t>(rows));
      // The real rows as planned.
      for (std::size_t t = 0; t < 3; ++t) {
        EXPECT_EQ(p.token_ids[t], plan->token_ids[t]);
        EXPECT_EQ(p.write_slot[t], plan->write_slot[t]);
        EXPECT_EQ(p.table_begin[t], plan->table_begin[t]);
      }
      EXPECT_EQ(p.max_context, plan->max_context);
      const std::int64_t first_padding_slot = cache.num_blocks * bs;
      const std::int64_t end_slot = (cache.num_blocks + pd::gpu::paddingBlocks(bs)) * bs;
      std::vector<std::int64_t> slots(p.write_slot.begin(), p.write_slot.end());
      std::sort(slots.begin(), slots.end());
      EXPECT_EQ(std::adjacent_find(slots.begin(), slots.end()), slots.end()) << "two rows write one slot";
      for (std::int64_t t = 3; t < rows; ++t) {
        const auto i = static_cast<std::size_t>(t);
        EXPECT_EQ(p.token_ids[i], 0);
        EXPECT_EQ(p.positions[i], 0);
        EXPECT_EQ(p.ctx_len[i], 1);
        EXPECT_GE(p.write_slot[i], first_padding_slot);
        EXPECT_LT(p.write_slot[i], end_slot);
        const std::int32_t block = p.block_tables[static_cast<std::size_t>(p.table_begin[i])];
        EXPECT_GE(block, cache.num_blocks);
        // It reads slot 0 of its block, which a padded row of this step writes.
        const std::int64_t read = std::int64_t{block} * bs;
        EXPECT_NE(std::find(p.write_slot.begin() + 3, p.write_slot.end(), read), p.write_slot.end()) << t;
      }
    }
  }
}

void expectInvalid(const pd::ModelConfig& c, const DecodeCacheShape& cache, const std::vector<DecodeSequence>& batch,
                   const std::string& fragment) {
  auto plan = planDecodeStep(c, cache, batch);
  ASSERT_FALSE(plan.ok()) << "accepted: " << fragment;
  EXPECT_EQ(plan.error().code, pd::ErrorCode::InvalidArgument);
  EXPECT_NE(plan.error().message.find(fragment), std::string::npos) << plan.error().toString();
}

TEST(DecodeStepPlan, RejectsBadBatches) {
  const pd::ModelConfig c = tiny();
  const DecodeCacheShape cache{8, 4};
  const std::vector<std::int32_t> one{0};
  const std::vector<std::int32_t> two{1, 2};
  expectInvalid(c, cache, {}, "0 sequences");
  expectInvalid(c, cache, std::vector<DecodeSequence>(65, {1, 0, one}), "65 sequences");
  expectInvalid(c, cache, {{-1, 0, one}}, "token id -1");
  expectInvalid(c, cache, {{2048, 0, one}}, "token id 2048");
  expectInvalid(c, cache, {{1, -1, one}}, "position -1");
  expectInvalid(c, cache, {{1, 256, std::vector<std::int32_t>(64, 0)}}, "position 256");  // max_position_embeddings
  expectInvalid(c, cache, {{1, 4, one}}, "cannot hold position 4");
  expectInvalid(c, cache, {{1, 0, std::vector<std::int32_t>{8}}}, "block id 8");
  expectInvalid(c, cache, {{1, 5, std::vector<std::int32_t>{0, -3}}}, "block id -3");
  // Two sequences writing position 1 of block 0: the second would overwrite the first's latent.
  expectInvalid(c, cache, {{1, 1, one}, {1, 1, one}}, "another sequence");
  expectInvalid(c, DecodeCacheShape{0, 4}, {{1, 0, one}}, "cache of 0 blocks");
  // The same block at different offsets is fine (a shared prefix block is read, not written).
  EXPECT_TRUE(planDecodeStep(c, cache, {{{1, 5, two}, {1, 2, std::vector<std::int32_t>{1}}}}).ok());
  EXPECT_TRUE(planDecodeStep(c, cache, std::vector<DecodeSequence>(1, {1, 0, one})).ok());
}

TEST(DecodeStepPlan, ChecksTheModel) {
  pd::ModelConfig c = tiny();
  EXPECT_TRUE(pd::gpu::checkDecodeModel(c).ok());
  pd::ModelConfig wide = c;
  wide.kv_lora_rank = 1020;  // latent 1036 > the kernel's 1024
  auto s = pd::gpu::checkDecodeModel(wide);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, pd::ErrorCode::Unsupported);
  pd::ModelConfig odd = c;
  odd.qk_rope_head_dim = 15;
  EXPECT_FALSE(pd::gpu::checkDecodeModel(odd).ok());
  pd::ModelConfig groups = c;
  groups.n_group = 3;  // 16 experts do not split into 3 groups
  EXPECT_FALSE(pd::gpu::checkDecodeModel(groups).ok());
  pd::ModelConfig topk = c;
  topk.num_experts_per_tok = 17;
  EXPECT_FALSE(pd::gpu::checkDecodeModel(topk).ok());
}

std::vector<float> randomVector(std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0F, 1.0F);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// The element the gemm must write (an index into the [tokens, heads, width] output) equals the
// CPU engine's formula, summed in the same order; everything else stays untouched.
void expectSameAs(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      ASSERT_TRUE(std::isnan(got[i])) << what << ": element " << i << " written but outside the product";
    } else {
      ASSERT_EQ(got[i], want[i]) << what << ": element " << i;
    }
  }
}

// The absorbed attention's two per-head products, as the device step hands them to cuBLAS, against
// the CPU engine's absorbedAttention formulas (odd sizes, so a stride mix-up cannot hide).
TEST(DecodeStepPlan, AbsorbedGemmsIndexLikeTheCpuEngine) {
  std::vector<pd::ModelConfig> configs{tiny()};
  pd::ModelConfig odd = tiny();
  odd.num_attention_heads = 3;
  odd.kv_lora_rank = 11;
  odd.qk_nope_head_dim = 5;
  odd.qk_rope_head_dim = 4;
  odd.v_head_dim = 7;
  configs.push_back(odd);
  std::mt19937 rng(7);
  for (const pd::ModelConfig& c : configs) {
    for (const std::int64_t n : {1, 3, 64}) {
      const std::int64_t heads = c.num_attention_heads;
      const std::int64_t dn = c.qk_nope_head_dim;
      const std::int64_t dv = c.v_head_dim;
      const std::int64_t qk = c.qkHeadDim();
      const std::int64_t r = c.kv_lora_rank;
      const std::int64_t ld = c.latentDim();
      const auto z = [](std::int64_t v) { return static_cast<std::size_t>(v); };
      const std::vector<float> kv_b = randomVector(z(heads * (dn + dv) * r), rng);
      const std::vector<float> q = randomVector(z(n * heads * qk), rng);
      const std::vector<float> o_lat = randomVector(z(n * heads * ld), rng);
      const float nan = std::nanf("");
      // q_cat[t][h][c] = sum_j kv_b[h(dn+dv) + j][c] q[t][h][j], c < r; the rope columns untouched.
      std::vector<float> want(z(n * heads * ld), nan);
      for (std::int64_t t = 0; t < n; ++t) {
        for (std::int64_t h = 0; h < heads; ++h) {
          for (std::int64_t col = 0; col < r; ++col) {
            float sum = 0.0F;
            for (std::int64_t j = 0; j < dn; ++j)
              sum += kv_b[z((h * (dn + dv) + j) * r + col)] * q[z((t * heads + h) * qk + j)];
            want[z((t * heads + h) * ld + col)] = sum;
          }
        }
      }
      std::vector<float> got(z(n * heads * ld), nan);
      pd::gpu::referenceGemm(pd::gpu::absorbQueryGemm(c, n), kv_b.data(), q.data(), got.data());
      expectSameAs(got, want, "absorbQueryGemm");
      // o[t][h][i] = sum_c kv_b[h(dn+dv) + dn + i][c] o_lat[t][h][c], c < r.
      std::vector<float> want_o(z(n * heads * dv), nan);
      for (std::int64_t t = 0; t < n; ++t) {
        for (std::int64_t h = 0; h < heads; ++h) {
          for (std::int64_t i = 0; i < dv; ++i) {
            float sum = 0.0F;
            for (std::int64_t col = 0; col < r; ++col) {
              sum += kv_b[z((h * (dn + dv) + dn + i) * r + col)] * o_lat[z((t * heads + h) * ld + col)];
            }
            want_o[z((t * heads + h) * dv + i)] = sum;
          }
        }
      }
      std::vector<float> got_o(z(n * heads * dv), nan);
      pd::gpu::referenceGemm(pd::gpu::valueUpGemm(c, n), kv_b.data(), o_lat.data(), got_o.data());
      expectSameAs(got_o, want_o, "valueUpGemm");
    }
  }
}

// y[t * y_stride + row] = W[row] . x[t * x_stride ...] with strides wider than the rows.
TEST(DecodeStepPlan, LinearGemmIndexesRowMajorWeights) {
  std::mt19937 rng(11);
  const std::int64_t rows = 13, cols = 9, n = 5, xs = 12, ys = 17;
  const std::vector<float> w = randomVector(rows * cols, rng);
  const std::vector<float> x = randomVector(n * xs, rng);
  std::vector<float> want(n * ys, std::nanf(""));
  for (std::int64_t t = 0; t < n; ++t) {
    for (std::int64_t row = 0; row < rows; ++row) {
      float sum = 0.0F;
      for (std::int64_t col = 0; col < cols; ++col)
        sum += w[static_cast<std::size_t>(row * cols + col)] * x[static_cast<std::size_t>(t * xs + col)];
      want[static_cast<std::size_t>(t * ys + row)] = sum;
    }
  }
  std::vector<float> got(n * ys, std::nanf(""));
  pd::gpu::referenceGemm(pd::gpu::linearGemm(rows, cols, n, xs, ys), w.data(), x.data(), got.data());
  expectSameAs(got, want, "linearGemm");
}

// The SwiGLU activation the device MLP applies (math::siluMul) against the CPU engine's
// `silu(g) * u` (silu as cpu_engine.cpp writes it: x / (1 + exp(-x))), bit for bit.
TEST(DecodeStepPlan, SiluMulIsTheCpuEnginesActivation) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-30.0F, 30.0F);
  for (int i = 0; i < 100000; ++i) {
    const float g = u(rng);
    const float up = u(rng);
    const float cpu = g / (1.0F + std::exp(-g)) * up;
    ASSERT_EQ(pd::gpu::math::siluMul(g, up), cpu) << g << " " << up;
  }
}

TEST(DecodeGraphs, AttentionContextRoundsTheSplitCountUpToAPowerOfTwo) {
  using pd::gpu::graphAttentionContext;
  constexpr std::int64_t kSplit = 256;
  constexpr std::int64_t kLimit = 32768;
  EXPECT_EQ(graphAttentionContext(1, kSplit, kLimit), 256);     // 1 split
  EXPECT_EQ(graphAttentionContext(256, kSplit, kLimit), 256);   // exactly 1 split
  EXPECT_EQ(graphAttentionContext(257, kSplit, kLimit), 512);   // 2 splits
  EXPECT_EQ(graphAttentionContext(513, kSplit, kLimit), 1024);  // 3 splits -> 4
  EXPECT_EQ(graphAttentionContext(1024, kSplit, kLimit), 1024);
  EXPECT_EQ(graphAttentionContext(1025, kSplit, kLimit), 2048);    // 5 -> 8
  EXPECT_EQ(graphAttentionContext(20000, kSplit, kLimit), 32768);  // 79 -> 128, capped at the limit
  // The limit never shrinks a step below its own context.
  EXPECT_EQ(graphAttentionContext(700, kSplit, 600), 700);
  EXPECT_EQ(graphAttentionContext(700, kSplit, 800), 800);
  // Degenerate inputs pass through.
  EXPECT_EQ(graphAttentionContext(0, kSplit, kLimit), 0);
  EXPECT_EQ(graphAttentionContext(5, 0, kLimit), 5);
  // Every context maps to a band that holds it, and the bands are few: one per power of two.
  std::vector<std::int64_t> bands;
  for (std::int64_t ctx = 1; ctx <= kLimit; ++ctx) {
    const std::int64_t g = graphAttentionContext(ctx, kSplit, kLimit);
    ASSERT_GE(g, ctx);
    ASSERT_EQ(g % kSplit, 0);
    if (bands.empty() || bands.back() != g) bands.push_back(g);
  }
  EXPECT_EQ(bands, (std::vector<std::int64_t>{256, 512, 1024, 2048, 4096, 8192, 16384, 32768}));
}

TEST(DecodeGraphs, AKeyRunsEagerThenCapturesThenReplays) {
  using Cache = pd::gpu::DecodeGraphCache<int>;
  Cache cache(4);
  const pd::gpu::DecodeGraphKey k{.tokens = 8, .attention_context = 512};
  auto [e1, a1] = cache.use(k);
  EXPECT_EQ(a1, Cache::Action::Eager);  // warm-up outside any capture
  auto [e2, a2] = cache.use(k);
  EXPECT_EQ(a2, Cache::Action::Capture);
  EXPECT_EQ(e1, e2);
  e2->graph = 7;  // the capture succeeded
  auto [e3, a3] = cache.use(k);
  EXPECT_EQ(a3, Cache::Action::Replay);
  EXPECT_EQ(*e3->graph, 7);
  // Every field of the key tells steps apart.
  const std::vector<pd::gpu::DecodeGraphKey> others{
      {.tokens = 9, .attention_context = 512},
      {.tokens = 8, .attention_context = 1024},
      {.tokens = 8, .attention_context = 512, .mtp = true},
      {.tokens = 8, .attention_context = 512, .mtp = true, .zero_embedding = true},
      {.tokens = 8, .attention_context = 512, .collect_latents = true},
      {.tokens = 8, .attention_context = 512, .round_latents = true}};
  Cache wide(16);
  ASSERT_EQ(wide.use(k).second, Cache::Action::Eager);
  for (const auto& o : others) EXPECT_EQ(wide.use(o).second, Cache::Action::Eager);
  EXPECT_EQ(wide.size(), others.size() + 1);
}

TEST(DecodeGraphs, AFailedCaptureLeavesTheKeyEager) {
  using Cache = pd::gpu::DecodeGraphCache<int>;
  Cache cache(4);
  const pd::gpu::DecodeGraphKey k{.tokens = 1, .attention_context = 256};
  ASSERT_EQ(cache.use(k).second, Cache::Action::Eager);
  auto [e, a] = cache.use(k);
  ASSERT_EQ(a, Cache::Action::Capture);
  e->eager_only = true;  // what the step does when capture fails
  for (int i = 0; i < 5; ++i) EXPECT_EQ(cache.use(k).second, Cache::Action::Eager);
}

TEST(DecodeGraphs, TheLeastRecentlyUsedKeyIsEvictedAtCapacity) {
  using Cache = pd::gpu::DecodeGraphCache<int>;
  Cache cache(2);
  const pd::gpu::DecodeGraphKey a{.tokens = 1, .attention_context = 256};
  const pd::gpu::DecodeGraphKey b{.tokens = 2, .attention_context = 256};
  const pd::gpu::DecodeGraphKey c{.tokens = 3, .attention_context = 256};
  for (int i = 0; i < 2; ++i) (void)cache.use(a);
  cache.use(a).first->graph = 1;  // a replays
  (void)cache.use(b);
  (void)cache.use(a);  // a is now more recent than b
  EXPECT_EQ(cache.evicted(), 0U);
  (void)cache.use(c);  // full: b goes
  EXPECT_EQ(cache.size(), 2U);
  EXPECT_EQ(cache.evicted(), 1U);
  EXPECT_EQ(cache.use(a).second, Cache::Action::Replay);  // a kept its graph
  EXPECT_EQ(cache.use(b).second, Cache::Action::Eager);   // b starts over (and c goes)
  EXPECT_EQ(cache.evicted(), 2U);
  cache.clear();
  EXPECT_EQ(cache.size(), 0U);
  EXPECT_EQ(cache.use(a).second, Cache::Action::Eager);     // cleared graphs are captured anew
  EXPECT_EQ(Cache(0).use(a).second, Cache::Action::Eager);  // capacity at least 1
}

}  // namespace
