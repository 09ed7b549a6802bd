// Every CUDA kernel against the CPU engine on random inputs at several shapes (odd sizes, batch
// 1..64, contexts 1..32k, block boundaries, F32 and BF16 caches, MTP-verify widths). Where no
// device is visible the program prints why and exits 77, which ctest reports as skipped
// (SKIP_RETURN_CODE), never as passed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_reference.h"
#include "device_math.h"
#include "device_memory_plan.h"
#include "device_ops.h"
#include "gpu/gpu_test_main.h"
#include "pd/common/check.h"
#include "pd/common/dtype.h"
#include "pd/common/kv_format.h"
#include "pd/cuda/cuda_handles.h"
#include "pd/engine/gpu.h"
#include "pd/engine/kernels.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/model_factory.h"
#include "pd/engine/rope.h"
#include "pd/engine/sampling.h"

namespace {

namespace gm = pd::gpu::math;
using pd::DType;
using std::int64_t;

template <class T>
pd::cuda::DeviceBuffer<T> upload(const std::vector<T>& host, const pd::cuda::Stream& stream) {
  auto buf = pd::cuda::DeviceBuffer<T>::create(std::max<std::size_t>(host.size(), 1));
  PD_CHECK_MSG(buf.ok(), "device allocation failed");
  PD_CHECK_MSG(buf->copyFromHost(std::span<const T>(host), stream).ok(), "upload failed");
  return std::move(*buf);
}
template <class T>
std::vector<T> download(const pd::cuda::DeviceBuffer<T>& buf, std::size_t n, const pd::cuda::Stream& stream) {
  std::vector<T> host(n);
  PD_CHECK_MSG(buf.copyToHost(std::span<T>(host), stream).ok(), "download failed");
  PD_CHECK_MSG(stream.synchronize().ok(), "stream failed");
  return host;
}

class Kernel : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(cudaSetDevice(0) == cudaSuccess);
    auto s = pd::cuda::Stream::create();
    ASSERT_TRUE(s.ok()) << s.error().toString();
    stream_.emplace(std::move(*s));
  }
  const pd::cuda::Stream& stream() const { return *stream_; }
  std::optional<pd::cuda::Stream> stream_;
  std::mt19937 rng_{1234};
  std::normal_distribution<float> normal_;
  std::vector<float> randn(std::size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = normal_(rng_);
    return v;
  }
};

// ---- RMSNorm ------------------------------------------------------------------------------------

TEST_F(Kernel, RmsNormResidualMatchesCpu) {
  for (const int64_t rows : {1, 3, 64}) {
    for (const int64_t d : {1, 7, 256, 7168}) {
      std::vector<float> h = randn(static_cast<std::size_t>(rows * d));
      const std::vector<float> delta = randn(h.size());
      std::vector<float> w = randn(static_cast<std::size_t>(d));
      auto dh = upload(h, stream());
      auto ddelta = upload(delta, stream());
      auto dw = upload(w, stream());
      auto dout = upload(std::vector<float>(h.size()), stream());
      ASSERT_TRUE(
          pd::gpu::rmsNormResidual(dh.data(), ddelta.data(), dw.data(), dout.data(), rows, d, 1e-6F, stream()).ok());
      const std::vector<float> got_h = download(dh, h.size(), stream());
      const std::vector<float> got = download(dout, h.size(), stream());
      for (int64_t r = 0; r < rows; ++r) {
        double ss = 0.0;
        for (int64_t i = 0; i < d; ++i) {
          float& v = h[static_cast<std::size_t>(r * d + i)];
          v += delta[static_cast<std::size_t>(r * d + i)];
          ss += static_cast<double>(v) * v;
        }
        const float inv = gm::rmsInverse(ss, d, 1e-6F);
        for (int64_t i = 0; i < d; ++i) {
          const auto at = static_cast<std::size_t>(r * d + i);
          ASSERT_EQ(got_h[at], h[at]);
          const float want = gm::rmsNormValue(h[at], inv, w[static_cast<std::size_t>(i)]);
          ASSERT_NEAR(got[at], want, 1e-6F * (1.0F + std::fabs(want))) << rows << "x" << d;
        }
      }
      // In place, without a residual.
      ASSERT_TRUE(pd::gpu::rmsNormResidual(dh.data(), nullptr, dw.data(), dh.data(), rows, d, 1e-6F, stream()).ok());
      const std::vector<float> in_place = download(dh, h.size(), stream());
      for (std::size_t i = 0; i < h.size(); ++i) ASSERT_TRUE(std::isfinite(in_place[i]));
    }
  }
}

// The strided form (one launch for kv_a's latent columns): each row's values bit-equal to
// rmsNormResidual on that row alone, the columns past d and the input untouched.
TEST_F(Kernel, RmsNormResidualStridedRowsEqualEachRowAlone) {
  for (const auto& [rows, d, stride] :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 1, 1}, {64, 512, 576}, {5, 7, 9}, {3, 256, 256}}) {
    const std::vector<float> x = randn(static_cast<std::size_t>(rows * stride));
    const std::vector<float> w = randn(static_cast<std::size_t>(d));
    const std::vector<float> before = randn(x.size());
    auto dx = upload(x, stream());
    auto dw = upload(w, stream());
    auto dout = upload(before, stream());
    ASSERT_TRUE(pd::gpu::rmsNormRows(dx.data(), stride, dw.data(), dout.data(), stride, rows, d, 1e-6F, stream()).ok());
    const auto got = download(dout, x.size(), stream());
    EXPECT_EQ(download(dx, x.size(), stream()), x) << "the input changed";
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<float> row(x.begin() + r * stride, x.begin() + r * stride + d);
      auto drow = upload(row, stream());
      auto drow_out = upload(std::vector<float>(row.size()), stream());
      ASSERT_TRUE(
          pd::gpu::rmsNormResidual(drow.data(), nullptr, dw.data(), drow_out.data(), 1, d, 1e-6F, stream()).ok());
      const auto want = download(drow_out, row.size(), stream());
      for (int64_t i = 0; i < stride; ++i) {
        const auto at = static_cast<std::size_t>(r * stride + i);
        if (i < d) {
          ASSERT_EQ(got[at], want[static_cast<std::size_t>(i)]) << rows << "x" << d << " stride " << stride;
        } else {
          ASSERT_EQ(got[at], before[at]) << "wrote past d at row " << r << " column " << i;
        }
      }
    }
  }
  // Strides below the width are refused before any launch.
  EXPECT_FALSE(pd::gpu::rmsNormRows(nullptr, 3, nullptr, nullptr, 8, 2, 4, 1e-6F, stream()).ok());
}

// ---- RoPE ---------------------------------------------------------------------------------------

TEST_F(Kernel, RopeMatchesCpuYarn) {
  auto cfg = pd::presetConfig("deepseek-v3-layers=1");
  ASSERT_TRUE(cfg.ok());
  auto freq = pd::model::ropeInvFreq(*cfg);
  ASSERT_TRUE(freq.ok());
  const int64_t half = static_cast<int64_t>(freq->size());
  auto dfreq = upload(*freq, stream());
  for (const int64_t rows : {1, 5, 64}) {
    for (const int64_t heads : {1, 16, 128}) {
      const int64_t head_stride = 192;  // q: 128 nope + 64 rope
      const int64_t offset = 128;
      std::vector<float> x = randn(static_cast<std::size_t>(rows * heads * head_stride));
      std::vector<int64_t> pos(static_cast<std::size_t>(rows));
      for (auto& p : pos) p = static_cast<int64_t>(rng_() % 163840);
      pos[0] = 0;
      auto dx = upload(x, stream());
      auto dpos = upload(pos, stream());
      const pd::gpu::RopeShape shape{rows, heads, heads * head_stride, head_stride, offset, half};
      ASSERT_TRUE(pd::gpu::ropeInterleaved(dx.data(), shape, dfreq.data(), dpos.data(), stream()).ok());
      const std::vector<float> got = download(dx, x.size(), stream());
      std::vector<float> cs(static_cast<std::size_t>(half)), sn(static_cast<std::size_t>(half));
      for (int64_t r = 0; r < rows; ++r) {
        pd::model::ropeCosSin(*freq, pos[static_cast<std::size_t>(r)], cs.data(), sn.data());
        for (int64_t h = 0; h < heads; ++h) {
          pd::model::applyRope(x.data() + (r * heads + h) * head_stride + offset, cs.data(), sn.data(), half);
        }
      }
      for (std::size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(got[i], x[i], 4e-6F * (1.0F + std::fabs(x[i]))) << i;
    }
  }
}

// ---- MLA decode attention -----------------------------------------------------------------------

struct MlaCase {
  int64_t heads, latent_dim, block_size;
  DType dtype;
  std::vector<int64_t> ctx;  // one query token each
  bool shared_sequence;      // all tokens of one sequence (MTP verify: ctx, ctx+1, ...)
};

TEST_F(Kernel, MlaDecodeMatchesCpuAbsorbedAttention) {
  const pd::model::KernelTable& k = pd::model::kernelTable(pd::model::detectCpuIsa());
  std::vector<MlaCase> cases{
      {1, 576, 64, DType::F32, {1}, false},
      {16, 576, 64, DType::BF16, {1, 63, 64, 65, 255, 256, 257}, false},
      {8, 40, 16, DType::F32, {}, false},  // 64 tokens, random contexts below
      {128, 576, 64, DType::BF16, {4096, 4097, 4098}, true},
      {16, 576, 64, DType::F32, {32768}, false},
      {16, 576, 64, DType::F8E4M3, {1, 63, 64, 65, 255, 256, 257}, false},  // FP8 tokens (kv_format.h)
      {4, 40, 16, DType::F8E4M3, {1, 17, 300}, false},                      // a short last tile, padding
  };
  for (int i = 0; i < 64; ++i) cases[2].ctx.push_back(1 + static_cast<int64_t>(rng_() % 700));
  for (const MlaCase& c : cases) {
    const auto tokens = static_cast<int64_t>(c.ctx.size());
    const int64_t max_ctx = *std::max_element(c.ctx.begin(), c.ctx.end());
    const int64_t seqs = c.shared_sequence ? 1 : tokens;
    const int64_t blocks_per_seq = (max_ctx + c.block_size - 1) / c.block_size;
    const int64_t num_blocks = seqs * blocks_per_seq + 1;
    auto cache = pd::model::PagedLatentCache::create(1, c.latent_dim, num_blocks, c.block_size, c.dtype);
    ASSERT_TRUE(cache.ok());
    // Blocks handed out in a shuffled order, so that tables jump around the pool.
    std::vector<std::int32_t> pool(static_cast<std::size_t>(num_blocks));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng_);
    std::vector<std::vector<std::int32_t>> tables(static_cast<std::size_t>(seqs));
    std::vector<float> lat(static_cast<std::size_t>(c.latent_dim));
    for (int64_t s = 0; s < seqs; ++s) {
      auto& table = tables[static_cast<std::size_t>(s)];
      table.assign(pool.begin() + s * blocks_per_seq, pool.begin() + (s + 1) * blocks_per_seq);
      const int64_t len = c.shared_sequence ? max_ctx : c.ctx[static_cast<std::size_t>(s)];
      for (int64_t p = 0; p < len; ++p) {
        for (auto& v : lat) v = normal_(rng_);
        pd::model::writeLatent(cache->view(), 0, table, p, lat.data());
      }
    }
    std::vector<std::int32_t> flat;
    std::vector<int64_t> table_begin;
    for (int64_t t = 0; t < tokens; ++t) {
      const auto& table = tables[static_cast<std::size_t>(c.shared_sequence ? 0 : t)];
      table_begin.push_back(static_cast<int64_t>(flat.size()));
      flat.insert(flat.end(), table.begin(), table.end());
    }
    const std::vector<float> q = randn(static_cast<std::size_t>(tokens * c.heads * c.latent_dim));
    const float scale = 1.0F / std::sqrt(192.0F);
    const std::size_t cache_bytes = cache->bytes();
    std::vector<std::uint8_t> cache_host(cache_bytes);
    std::memcpy(cache_host.data(), cache->view().layers[0], cache_bytes);
    auto dcache = upload(cache_host, stream());
    auto dq = upload(q, stream());
    auto dflat = upload(flat, stream());
    auto dbegin = upload(table_begin, stream());
    auto dctx = upload(c.ctx, stream());
    auto dout = upload(std::vector<float>(q.size()), stream());
    auto attn = pd::gpu::MlaDecodeAttention::create({tokens, c.heads, c.latent_dim, max_ctx});
    ASSERT_TRUE(attn.ok()) << attn.error().toString();
    pd::gpu::MlaDecodeAttention::Batch b;
    b.q_cat = dq.data();
    b.tokens = tokens;
    b.cache_layer = dcache.data();
    b.cache_dtype = c.dtype;
    b.block_size = c.block_size;
    b.num_blocks = num_blocks;
    b.block_tables = dflat.data();
    b.table_begin = dbegin.data();
    b.ctx_len = dctx.data();
    b.max_context_in_batch = max_ctx;
    b.scale = scale;
    b.out = dout.data();
    ASSERT_TRUE(attn->run(b, stream()).ok());
    const std::vector<float> got = download(dout, q.size(), stream());
    for (int64_t t = 0; t < tokens; ++t) {
      const auto& table = tables[static_cast<std::size_t>(c.shared_sequence ? 0 : t)];
      const std::vector<float> want =
          pd::test::cpuLatentAttention(k, cache->view(), 0, table, c.ctx[static_cast<std::size_t>(t)],
                                       q.data() + t * c.heads * c.latent_dim, c.heads, scale);
      for (std::size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(got[static_cast<std::size_t>(t * c.heads * c.latent_dim) + i], want[i],
                    2e-4F + 2e-4F * std::fabs(want[i]))
            << "heads " << c.heads << " ctx " << c.ctx[static_cast<std::size_t>(t)] << " token " << t << " i " << i;
      }
    }
  }
}

// ---- MLA prefill attention ------------------------------------------------------------------------

struct PrefillCase {
  int64_t heads, nope, rope, v, rank, block_size;
  DType dtype;
  std::vector<std::pair<int64_t, int64_t>> segments;  // (rows, last row's context) per sequence
};

TEST_F(Kernel, MlaPrefillMatchesThePlainPrefillAttention) {
  std::vector<PrefillCase> cases{
      {1, 8, 4, 8, 16, 16, DType::F32, {{1, 1}}},
      {4, 16, 8, 12, 40, 16, DType::BF16, {{5, 255}, {3, 256}, {7, 257}}},     // chunk boundaries
      {16, 128, 64, 128, 512, 64, DType::F32, {{64, 700}}},                    // V3 head dims, 64 rows
      {16, 128, 64, 128, 512, 64, DType::BF16, {{20, 20}, {1, 513}, {9, 9}}},  // a prompt, a decode row, a prompt
      {4, 16, 8, 12, 40, 16, DType::F8E4M3, {{5, 255}, {3, 257}}},             // FP8 tokens (kv_format.h)
  };
  for (const PrefillCase& c : cases) {
    const int64_t ld = c.rank + c.rope;
    const int64_t qk = c.nope + c.rope;
    const int64_t kvw = c.heads * (c.nope + c.v);
    int64_t blocks_total = 1;
    for (const auto& [rows, ctx] : c.segments) blocks_total += (ctx + c.block_size - 1) / c.block_size;
    auto cache = pd::model::PagedLatentCache::create(1, ld, blocks_total, c.block_size, c.dtype);
    ASSERT_TRUE(cache.ok());
    std::vector<std::int32_t> pool(static_cast<std::size_t>(blocks_total));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng_);
    std::vector<std::int32_t> flat;
    std::vector<int64_t> ctx_len;
    std::vector<pd::gpu::PrefillSegment> segments;
    std::vector<std::vector<std::int32_t>> tables;
    std::size_t next_block = 0;
    std::vector<float> lat(static_cast<std::size_t>(ld));
    for (const auto& [rows, ctx] : c.segments) {
      const int64_t blocks = (ctx + c.block_size - 1) / c.block_size;
      std::vector<std::int32_t> table(pool.begin() + static_cast<std::ptrdiff_t>(next_block),
                                      pool.begin() + static_cast<std::ptrdiff_t>(next_block) + blocks);
      next_block += static_cast<std::size_t>(blocks);
      for (int64_t p = 0; p < ctx; ++p) {
        for (auto& x : lat) x = normal_(rng_);
        pd::model::writeLatent(cache->view(), 0, table, p, lat.data());
      }
      pd::gpu::PrefillSegment seg;
      seg.row_begin = static_cast<int64_t>(ctx_len.size());
      seg.row_end = seg.row_begin + rows;
      seg.table_begin = static_cast<int64_t>(flat.size());
      seg.context = ctx;
      segments.push_back(seg);
      flat.insert(flat.end(), table.begin(), table.end());
      for (int64_t r = 0; r < rows; ++r) ctx_len.push_back(ctx - rows + 1 + r);
      tables.push_back(std::move(table));
    }
    const auto rows = static_cast<int64_t>(ctx_len.size());
    const std::vector<float> q = randn(static_cast<std::size_t>(rows * c.heads * qk));
    std::vector<float> kv_b = randn(static_cast<std::size_t>(kvw * c.rank));
    for (auto& x : kv_b) x *= 0.05F;
    const float scale = 1.0F / std::sqrt(static_cast<float>(qk));
    std::vector<std::uint8_t> cache_host(cache->bytes());
    std::memcpy(cache_host.data(), cache->view().layers[0], cache_host.size());
    auto dcache = upload(cache_host, stream());
    auto dq = upload(q, stream());
    auto dflat = upload(flat, stream());
    auto dctx = upload(ctx_len, stream());
    auto dkvb = upload(kv_b, stream());
    auto dout = upload(std::vector<float>(static_cast<std::size_t>(rows * c.heads * c.v)), stream());
    auto blas = pd::cuda::BlasHandle::create(stream());
    ASSERT_TRUE(blas.ok()) << blas.error().toString();
    ASSERT_EQ(cublasSetMathMode(blas->get(), CUBLAS_PEDANTIC_MATH), CUBLAS_STATUS_SUCCESS);
    auto attn = pd::gpu::MlaPrefillAttention::create({64, c.heads, c.nope, c.rope, c.v, c.rank});
    ASSERT_TRUE(attn.ok()) << attn.error().toString();
    pd::gpu::MlaPrefillAttention::Batch b;
    b.q = dq.data();
    b.rows = rows;
    b.cache_layer = dcache.data();
    b.cache_dtype = c.dtype;
    b.block_size = c.block_size;
    b.num_blocks = blocks_total;
    b.block_tables = dflat.data();
    b.table_entries = static_cast<int64_t>(flat.size());
    b.ctx_len = dctx.data();
    b.segments = segments;
    b.kv_b = dkvb.data();
    b.scale = scale;
    b.out = dout.data();
    const auto status = attn->run(b, blas->get(), stream());
    ASSERT_TRUE(status.ok()) << status.error().toString();
    const std::vector<float> got = download(dout, static_cast<std::size_t>(rows * c.heads * c.v), stream());
    for (std::size_t s = 0; s < segments.size(); ++s) {
      const auto& seg = segments[s];
      const std::span<const int64_t> seg_ctx(ctx_len.data() + seg.row_begin,
                                             static_cast<std::size_t>(seg.row_end - seg.row_begin));
      const std::vector<float> want = pd::test::referencePrefillAttention(
          cache->view(), 0, tables[s], seg_ctx, q.data() + seg.row_begin * c.heads * qk, kv_b.data(), c.heads, c.nope,
          c.rope, c.v, c.rank, scale);
      for (std::size_t i = 0; i < want.size(); ++i) {
        const float g = got[static_cast<std::size_t>(seg.row_begin * c.heads * c.v) + i];
        ASSERT_NEAR(g, want[i], 2e-4F + 2e-4F * std::fabs(want[i]))
            << "heads " << c.heads << " segment " << s << " value " << i;
      }
    }
  }
}

// ---- routing ------------------------------------------------------------------------------------

// Whether two biased scores, or two group scores, are within 1e-5 without being equal.
bool hasNearTie(const float* logits, const std::vector<float>& bias, int64_t experts, int64_t groups) {
  std::vector<float> biased(static_cast<std::size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) {
    biased[static_cast<std::size_t>(e)] =
        gm::sigmoidF(logits[e]) + (bias.empty() ? 0.0F : bias[static_cast<std::size_t>(e)]);
  }
  std::vector<float> group_score;
  const int64_t per_group = experts / groups;
  for (int64_t g = 0; g < groups; ++g) {
    std::vector<float> v(biased.begin() + g * per_group, biased.begin() + (g + 1) * per_group);
    std::sort(v.rbegin(), v.rend());
    group_score.push_back(bias.empty() || per_group == 1 ? v[0] : v[0] + v[1]);
  }
  for (const auto* values : {&biased, &group_score}) {
    for (std::size_t i = 0; i < values->size(); ++i) {
      for (std::size_t j = i + 1; j < values->size(); ++j) {
        const float d = std::fabs((*values)[i] - (*values)[j]);
        if (d > 0.0F && d < 1e-5F) return true;
      }
    }
  }
  return false;
}

TEST_F(Kernel, RoutingMatchesCpuIncludingTies) {
  struct Shape {
    int64_t experts, groups, topk_group, top_k;
  };
  for (const Shape s : {Shape{16, 4, 2, 4}, Shape{256, 8, 4, 8}, Shape{64, 1, 1, 6}}) {
    for (const int64_t tokens : {1, 7, 64}) {
      for (const bool with_bias : {false, true}) {
        // Logits on a coarse grid: many exact ties (which stay exact on the device). A token whose
        // biased scores or group scores come within 1e-5 without being equal is drawn again: the
        // device's expf may differ from the host's by an ulp, and such a near-tie is not a tie.
        std::vector<float> bias;
        if (with_bias) {
          bias.resize(static_cast<std::size_t>(s.experts));
          for (auto& b : bias) b = static_cast<float>(static_cast<int>(rng_() % 5)) / 64.0F;
        }
        std::vector<float> logits(static_cast<std::size_t>(tokens * s.experts));
        for (int64_t t = 0; t < tokens; ++t) {
          float* row = logits.data() + t * s.experts;
          int draws = 0;
          do {
            ASSERT_LT(++draws, 10000) << "no routing input without near-ties at " << s.experts << " experts";
            for (int64_t e = 0; e < s.experts; ++e) {
              row[e] = static_cast<float>(static_cast<int>(rng_() % 40) - 20) * 0.1F;
            }
          } while (hasNearTie(row, bias, s.experts, s.groups));
        }
        auto dl = upload(logits, stream());
        auto db = upload(bias, stream());
        auto didx = upload(std::vector<std::int32_t>(static_cast<std::size_t>(tokens * s.top_k)), stream());
        auto dw = upload(std::vector<float>(static_cast<std::size_t>(tokens * s.top_k)), stream());
        const gm::RoutingShape shape{s.experts, s.groups, s.topk_group, s.top_k, 2.5F};
        ASSERT_TRUE(pd::gpu::routeNoauxTc(dl.data(), with_bias ? db.data() : nullptr, shape, tokens, didx.data(),
                                          dw.data(), stream())
                        .ok());
        const auto idx = download(didx, static_cast<std::size_t>(tokens * s.top_k), stream());
        const auto w = download(dw, static_cast<std::size_t>(tokens * s.top_k), stream());
        for (int64_t t = 0; t < tokens; ++t) {
          const auto cpu =
              pd::test::cpuRouteToken(std::span<const float>(logits).subspan(static_cast<std::size_t>(t * s.experts),
                                                                             static_cast<std::size_t>(s.experts)),
                                      bias, s.groups, s.topk_group, s.top_k, 2.5);
          for (int64_t j = 0; j < s.top_k; ++j) {
            const auto at = static_cast<std::size_t>(t * s.top_k + j);
            ASSERT_EQ(idx[at], cpu.idx[static_cast<std::size_t>(j)]) << "experts " << s.experts << " token " << t;
            ASSERT_NEAR(w[at], cpu.weight[static_cast<std::size_t>(j)], 2e-6F);
          }
        }
      }
    }
  }
}

// ---- FP8 GEMV -----------------------------------------------------------------------------------

TEST_F(Kernel, Fp8GemvIsBitExactToItsHostOrderAndCloseToCpu) {
  const pd::model::KernelTable& k = pd::model::kernelTable(pd::model::detectCpuIsa());
  struct Shape {
    int64_t rows, cols;
  };
  for (const Shape s : {Shape{1, 1}, Shape{129, 127}, Shape{2048, 7168}, Shape{7, 1000}}) {
    std::vector<std::uint8_t> q(static_cast<std::size_t>(s.rows * s.cols));
    for (auto& v : q) v = pd::floatToFp8e4m3(normal_(rng_) * 100.0F);
    const int64_t scale_rows = (s.rows + 127) / 128;
    const int64_t scale_cols = (s.cols + 127) / 128;
    std::vector<float> scales(static_cast<std::size_t>(scale_rows * scale_cols));
    for (auto& v : scales) v = 0.001F + 0.01F * std::fabs(normal_(rng_));
    pd::model::WeightMatrix w;
    w.dtype = DType::F8E4M3;
    w.rows = s.rows;
    w.cols = s.cols;
    w.data = q.data();
    w.scale_inv = scales.data();
    auto dq = upload(q, stream());
    auto ds = upload(scales, stream());
    for (const int64_t tokens : {1, 3, 8, 9, 64}) {
      const int64_t x_stride = s.cols + 3;  // a padded stride
      const std::vector<float> x = randn(static_cast<std::size_t>(tokens * x_stride));
      auto dx = upload(x, stream());
      auto dy = upload(std::vector<float>(static_cast<std::size_t>(tokens * s.rows)), stream());
      pd::gpu::kernels::Fp8GemvArgs a;
      a.q = dq.data();
      a.scale_inv = ds.data();
      a.rows = static_cast<int>(s.rows);
      a.cols = static_cast<int>(s.cols);
      a.scale_cols = static_cast<int>(scale_cols);
      a.x = dx.data();
      a.x_stride = x_stride;
      a.tokens = static_cast<int>(tokens);
      a.y = dy.data();
      a.y_stride = s.rows;
      ASSERT_TRUE(pd::gpu::fp8Gemv(a, stream()).ok());
      const auto y = download(dy, static_cast<std::size_t>(tokens * s.rows), stream());
      std::vector<float> cpu(static_cast<std::size_t>(tokens * s.rows));
      k.matmul(w, 0, s.rows, x.data(), x_stride, tokens, cpu.data(), s.rows);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t r = 0; r < s.rows; ++r) {
          const auto at = static_cast<std::size_t>(t * s.rows + r);
          const float host = gm::fp8GemvRow(q.data() + r * s.cols, scales.data() + (r / 128) * scale_cols, s.cols, 128,
                                            x.data() + t * x_stride);
          ASSERT_EQ(y[at], host) << s.rows << "x" << s.cols << " tokens " << tokens << " t " << t << " r " << r;
          ASSERT_NEAR(y[at], cpu[at], 1e-4F * (1.0F + std::fabs(cpu[at])));
        }
      }
    }
  }
}

// ---- grouped GEMV and the MoE grouping -----------------------------------------------------------

// Every expert's rows against math::gemvRow (the kernel's own order, bit-exact) for FP32, BF16
// and FP8 experts, with empty experts among them; rows no expert owns stay untouched.
TEST_F(Kernel, GroupedGemvIsBitExactToItsHostOrderForEveryKind) {
  const int64_t groups = 6;
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {129, 127}, {64, 1000}}) {
    const int64_t scale_cols = (cols + 127) / 128;
    const int64_t scale_rows = (rows + 127) / 128;
    // Tokens per expert: 0, 3, 0, 9, 1, 0 (16 rows; experts 0, 2 and 5 idle).
    const std::vector<std::int32_t> offsets{0, 0, 3, 3, 12, 13, 13};
    const int64_t total = offsets.back();
    const int64_t x_stride = cols + 2;
    const int64_t y_stride = rows + 1;
    const std::vector<float> x = randn(static_cast<std::size_t>(total * x_stride));
    auto dx = upload(x, stream());
    auto doff = upload(offsets, stream());
    for (const gm::GemvWeights kind : {gm::GemvWeights::F32, gm::GemvWeights::Bf16, gm::GemvWeights::Fp8}) {
      std::vector<std::vector<float>> wf(groups);
      std::vector<std::vector<std::uint16_t>> wb(groups);
      std::vector<std::vector<std::uint8_t>> wq(groups);
      std::vector<std::vector<float>> ws(groups);
      std::vector<pd::cuda::DeviceBuffer<float>> df, dsc;
      std::vector<pd::cuda::DeviceBuffer<std::uint16_t>> db;
      std::vector<pd::cuda::DeviceBuffer<std::uint8_t>> dq;
      std::vector<const void*> ptrs;
      std::vector<const float*> scale_ptrs;
      for (int64_t g = 0; g < groups; ++g) {
        const auto gi = static_cast<std::size_t>(g);
        wf[gi] = randn(static_cast<std::size_t>(rows * cols));
        ws[gi].resize(static_cast<std::size_t>(scale_rows * scale_cols));
        for (auto& v : ws[gi]) v = 0.001F + 0.01F * std::fabs(normal_(rng_));
        if (kind == gm::GemvWeights::F32) {
          df.push_back(upload(wf[gi], stream()));
          ptrs.push_back(df.back().data());
        } else if (kind == gm::GemvWeights::Bf16) {
          for (const float v : wf[gi]) wb[gi].push_back(pd::floatToBf16(v));
          db.push_back(upload(wb[gi], stream()));
          ptrs.push_back(db.back().data());
        } else {
          for (const float v : wf[gi]) wq[gi].push_back(pd::floatToFp8e4m3(v * 100.0F));
          dq.push_back(upload(wq[gi], stream()));
          ptrs.push_back(dq.back().data());
        }
        dsc.push_back(upload(ws[gi], stream()));
        scale_ptrs.push_back(dsc.back().data());
      }
      auto dptrs = upload(ptrs, stream());
      auto dscales = upload(scale_ptrs, stream());
      const float sentinel = -12345.0F;
      auto dy = upload(std::vector<float>(static_cast<std::size_t>(total * y_stride), sentinel), stream());
      pd::gpu::kernels::GroupedGemvArgs a;
      a.kind = kind;
      a.weights = dptrs.data();
      a.scales = dscales.data();
      a.groups = static_cast<int>(groups);
      a.rows = static_cast<int>(rows);
      a.cols = static_cast<int>(cols);
      a.scale_cols = static_cast<int>(scale_cols);
      a.offsets = doff.data();
      a.x = dx.data();
      a.x_stride = x_stride;
      a.y = dy.data();
      a.y_stride = y_stride;
      ASSERT_TRUE(pd::gpu::groupedGemv(a, stream()).ok());
      const auto y = download(dy, static_cast<std::size_t>(total * y_stride), stream());
      for (int64_t g = 0; g < groups; ++g) {
        const auto gi = static_cast<std::size_t>(g);
        const void* w = kind == gm::GemvWeights::F32    ? static_cast<const void*>(wf[gi].data())
                        : kind == gm::GemvWeights::Bf16 ? static_cast<const void*>(wb[gi].data())
                                                        : static_cast<const void*>(wq[gi].data());
        for (int64_t t = offsets[gi]; t < offsets[gi + 1]; ++t) {
          for (int64_t r = 0; r < rows; ++r) {
            const float host =
                gm::gemvRow(kind, w, ws[gi].data() + (r / 128) * scale_cols, r, cols, 128, x.data() + t * x_stride);
            ASSERT_EQ(y[static_cast<std::size_t>(t * y_stride + r)], host)
                << "kind " << static_cast<int>(kind) << " " << rows << "x" << cols << " expert " << g << " row " << t;
          }
          ASSERT_EQ(y[static_cast<std::size_t>(t * y_stride + rows)], sentinel) << "the stride's padding was written";
        }
      }
    }
  }
}

// The row gather (embedding rows, the LM head's chosen rows): each output row is its id's table
// row, repeated and out-of-order ids included, or zeros where flagged.
TEST_F(Kernel, GatherRowsCopiesEachIdsRowAndZeroesTheFlaggedOnes) {
  for (const auto& [table_rows, d] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {129280, 7}, {50, 7168}}) {
    const std::vector<float> table = randn(static_cast<std::size_t>(table_rows * d));
    std::vector<std::int32_t> ids;
    for (int64_t r = 0; r < 64; ++r) ids.push_back(static_cast<std::int32_t>((r * 7919 + 3) % table_rows));
    ids[5] = ids[9];  // a repeated id
    std::vector<std::uint8_t> zero(ids.size(), 0);
    zero[2] = 1;
    zero[63] = 1;
    auto dtable = upload(table, stream());
    auto dids = upload(ids, stream());
    auto dzero = upload(zero, stream());
    for (const bool with_zero : {false, true}) {
      auto dout = upload(std::vector<float>(ids.size() * static_cast<std::size_t>(d), -1.0F), stream());
      ASSERT_TRUE(pd::gpu::gatherRows(dtable.data(), table_rows, dids.data(), with_zero ? dzero.data() : nullptr,
                                      static_cast<int64_t>(ids.size()), d, dout.data(), stream())
                      .ok());
      const auto out = download(dout, ids.size() * static_cast<std::size_t>(d), stream());
      for (std::size_t r = 0; r < ids.size(); ++r) {
        for (int64_t j = 0; j < d; ++j) {
          const float want = with_zero && zero[r] != 0 ? 0.0F : table[static_cast<std::size_t>(ids[r] * d + j)];
          ASSERT_EQ(out[r * static_cast<std::size_t>(d) + static_cast<std::size_t>(j)], want)
              << "row " << r << " column " << j << (with_zero ? " (zero flags)" : "");
        }
      }
    }
  }
}

// The scatter (each new latent into its cache slot): rows land at their slots, nothing else moves.
TEST_F(Kernel, GatherRowsScatterWritesEachRowToItsSlotOnly) {
  for (const auto& [dst_rows, d] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {4096, 576}, {64, 7}}) {
    const int64_t rows = std::min<int64_t>(dst_rows, 64);
    std::vector<std::int64_t> slots(static_cast<std::size_t>(dst_rows));
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng_);
    slots.resize(static_cast<std::size_t>(rows));  // distinct, out of order
    const std::vector<float> src = randn(static_cast<std::size_t>(rows * d));
    const std::vector<float> before = randn(static_cast<std::size_t>(dst_rows * d));
    auto dsrc = upload(src, stream());
    auto dslots = upload(slots, stream());
    auto ddst = upload(before, stream());
    ASSERT_TRUE(pd::gpu::scatterRows(dsrc.data(), rows, dslots.data(), ddst.data(), dst_rows, d, stream()).ok());
    std::vector<float> want = before;
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(src.begin() + r * d, d, want.begin() + slots[static_cast<std::size_t>(r)] * d);
    }
    EXPECT_EQ(download(ddst, want.size(), stream()), want) << dst_rows << " x " << d;
  }
}

// The latents' BF16 rounding (a BF16 cache's values) against the host's pd::floatToBf16: round to
// nearest even, ties, NaN and infinities included, every element and nothing past n.
TEST_F(Kernel, RoundToBf16IsTheHostsFloatToBf16) {
  for (const int64_t n : {int64_t{1}, int64_t{1000}, int64_t{64 * 576 + 3}}) {
    std::vector<float> x = randn(static_cast<std::size_t>(n));
    const std::vector<float> special{0.0F,     -0.0F, 1.0F + 0x1p-8F, 1.0F + 0x1p-7F + 0x1p-8F, 3.4e38F, -INFINITY,
                                     INFINITY, NAN,   1e-40F};
    for (std::size_t i = 0; i < special.size() && i < x.size(); ++i) x[i] = special[i];
    std::vector<float> padded = x;
    padded.push_back(1.2345678F);  // past n: left as it is
    auto dx = upload(padded, stream());
    ASSERT_TRUE(pd::gpu::roundToBf16(dx.data(), n, stream()).ok());
    const auto got = download(dx, padded.size(), stream());
    for (int64_t i = 0; i < n; ++i) {
      const float want = pd::bf16ToFloat(pd::floatToBf16(x[static_cast<std::size_t>(i)]));
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got[static_cast<std::size_t>(i)])) << i;
      } else {
        std::uint32_t a = 0;
        std::uint32_t b = 0;
        std::memcpy(&a, &want, sizeof a);
        std::memcpy(&b, &got[static_cast<std::size_t>(i)], sizeof b);
        ASSERT_EQ(a, b) << "element " << i << " of " << n << ": " << x[static_cast<std::size_t>(i)];
      }
    }
    EXPECT_EQ(got.back(), 1.2345678F) << "wrote past n";
  }
  EXPECT_TRUE(pd::gpu::roundToBf16(nullptr, 0, stream()).ok());  // nothing to do
}

// The scatter into an FP8 cache (pd/common/kv_format.h): each row's token bytes are exactly what
// pd::encodeKvToken writes (codes, zero padding, scales), for latents of several widths (short last
// tiles, zero tiles, wide ranges), and no other token's bytes change.
TEST_F(Kernel, ScatterKvFp8WritesTheHostCachesTokens) {
  for (const int64_t d : {int64_t{1}, int64_t{37}, int64_t{64}, int64_t{576}}) {
    for (const int64_t rows : {int64_t{1}, int64_t{3}, int64_t{64}}) {
      std::vector<float> x = randn(static_cast<std::size_t>(rows * d));
      for (std::size_t i = 0; i < x.size(); ++i) x[i] *= std::pow(10.0F, static_cast<float>(i % 7) - 3.0F);
      std::fill(x.begin(), x.begin() + std::min<int64_t>(d, 64), 0.0F);  // row 0's first tile: zeros
      x.back() = -0.0F;
      const int64_t cache_slots = 2 * rows + 1;
      std::vector<int64_t> slots;
      for (int64_t r = 0; r < rows; ++r) slots.push_back(2 * (rows - 1 - r) + 1);  // odd slots, reversed
      const std::size_t token = pd::kvTokenBytes(DType::F8E4M3, d);
      std::vector<std::uint8_t> before(static_cast<std::size_t>(cache_slots) * token, 0xCD);
      auto dcache = upload(before, stream());
      auto dx = upload(x, stream());
      auto dslots = upload(slots, stream());
      ASSERT_TRUE(
          pd::gpu::scatterRowsKvFp8(dx.data(), rows, dslots.data(), dcache.data(), cache_slots, d, stream()).ok());
      const auto got = download(dcache, before.size(), stream());
      std::vector<std::uint8_t> want = before;
      for (int64_t r = 0; r < rows; ++r) {
        pd::encodeKvToken(
            DType::F8E4M3,
            std::span<const float>(x).subspan(static_cast<std::size_t>(r * d), static_cast<std::size_t>(d)),
            reinterpret_cast<std::byte*>(want.data()) +
                static_cast<std::size_t>(slots[static_cast<std::size_t>(r)]) * token);
      }
      for (std::size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(got[i], want[i]) << "d " << d << " rows " << rows << ": byte " << i % token << " of slot "
                                   << i / token;
      }
    }
  }
  EXPECT_EQ(pd::gpu::scatterRowsKvFp8(nullptr, 2, nullptr, nullptr, 4, 576, stream()).error().code,
            pd::ErrorCode::InvalidArgument);
}

// The grouping, gather and combine kernels against their host functions, on routing's own output
// shape (tokens x top_k distinct ids), and the failure flag for an id outside the experts.
TEST_F(Kernel, MoeGroupGatherAndCombineMatchTheHost) {
  for (const auto& [tokens, top_k, experts] :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 1, 1}, {64, 8, 256}, {7, 3, 5}}) {
    const int64_t slots = tokens * top_k;
    const int64_t d = 133;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(experts));
    std::iota(ids.begin(), ids.end(), 0);
    std::vector<std::int32_t> chosen;
    for (int64_t t = 0; t < tokens; ++t) {
      std::shuffle(ids.begin(), ids.end(), rng_);
      chosen.insert(chosen.end(), ids.begin(), ids.begin() + top_k);
    }
    std::vector<float> weight = randn(static_cast<std::size_t>(slots));
    const std::vector<float> x = randn(static_cast<std::size_t>(tokens * d));
    const std::vector<float> gout = randn(static_cast<std::size_t>((slots + tokens) * d));
    auto dchosen = upload(chosen, stream());
    auto dweight = upload(weight, stream());
    auto dx = upload(x, stream());
    auto dgout = upload(gout, stream());
    auto doff = upload(std::vector<std::int32_t>(static_cast<std::size_t>(experts + 1), 7), stream());
    auto dslot = upload(std::vector<std::int32_t>(static_cast<std::size_t>(slots), 7), stream());
    auto dfailed = upload(std::vector<std::int32_t>{0}, stream());
    auto dgx = upload(std::vector<float>(static_cast<std::size_t>(slots * d)), stream());
    auto dout = upload(std::vector<float>(static_cast<std::size_t>(tokens * d)), stream());
    auto dused = upload(std::vector<std::int32_t>{-1}, stream());
    ASSERT_TRUE(pd::gpu::moeGroup(dchosen.data(), tokens, top_k, experts, doff.data(), dslot.data(), dfailed.data(),
                                  dused.data(), stream())
                    .ok());
    ASSERT_TRUE(pd::gpu::moeGather(dx.data(), dslot.data(), tokens, top_k, d, dgx.data(), stream()).ok());
    const float* shared = dgout.data() + slots * d;
    ASSERT_TRUE(pd::gpu::moeCombine(dchosen.data(), dweight.data(), dslot.data(), tokens, top_k, dgout.data(), d,
                                    shared, dout.data(), stream())
                    .ok());
    std::vector<std::int32_t> offsets(static_cast<std::size_t>(experts + 1));
    std::vector<std::int32_t> slot_of(static_cast<std::size_t>(slots));
    ASSERT_TRUE(gm::groupByExpert(chosen.data(), slots, experts, offsets.data(), slot_of.data()));
    EXPECT_EQ(download(doff, offsets.size(), stream()), offsets);
    EXPECT_EQ(download(dslot, slot_of.size(), stream()), slot_of);
    EXPECT_EQ(download(dfailed, 1, stream())[0], 0);
    EXPECT_EQ(download(dused, 1, stream())[0], gm::expertsWithRows(offsets.data(), experts));
    const auto gx = download(dgx, static_cast<std::size_t>(slots * d), stream());
    for (int64_t i = 0; i < slots; ++i) {
      for (int64_t j = 0; j < d; ++j) {
        ASSERT_EQ(gx[static_cast<std::size_t>(slot_of[static_cast<std::size_t>(i)] * d + j)],
                  x[static_cast<std::size_t>((i / top_k) * d + j)]);
      }
    }
    const auto out = download(dout, static_cast<std::size_t>(tokens * d), stream());
    for (int64_t t = 0; t < tokens; ++t) {
      const auto at = static_cast<std::size_t>(t * top_k);
      for (int64_t j = 0; j < d; ++j) {
        const float host = gm::moeCombine(chosen.data() + at, weight.data() + at, slot_of.data() + at, top_k,
                                          gout.data(), d, j, gout.data() + (slots + t) * d);
        ASSERT_EQ(out[static_cast<std::size_t>(t * d + j)], host) << "token " << t << " column " << j;
      }
    }
  }
  // An id outside the experts: the flag is set and nothing is grouped.
  auto dbad = upload(std::vector<std::int32_t>{0, 9}, stream());
  auto doff = upload(std::vector<std::int32_t>(5, 7), stream());
  auto dslot = upload(std::vector<std::int32_t>(2, 7), stream());
  auto dfailed = upload(std::vector<std::int32_t>{0}, stream());
  ASSERT_TRUE(
      pd::gpu::moeGroup(dbad.data(), 1, 2, 4, doff.data(), dslot.data(), dfailed.data(), nullptr, stream()).ok());
  EXPECT_EQ(download(dfailed, 1, stream())[0], 1);
  EXPECT_EQ(download(doff, 5, stream()), std::vector<std::int32_t>(5, 0));
  EXPECT_EQ(download(dslot, 2, stream()), std::vector<std::int32_t>(2, -1));
}

// ---- sampling -----------------------------------------------------------------------------------

TEST_F(Kernel, SamplingMatchesCpuSampler) {
  for (const int64_t vocab : {1000, 129280}) {
    const int64_t rows = 16;
    auto sampler = pd::gpu::DeviceSampler::create(64, vocab);
    ASSERT_TRUE(sampler.ok()) << sampler.error().toString();
    std::vector<pd::SamplingParams> params(static_cast<std::size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      auto& p = params[static_cast<std::size_t>(r)];
      p.seed = static_cast<std::uint64_t>(r * 7919 + 1);
      p.temperature = r % 4 == 0 ? 0.0 : 0.5 + 0.1 * static_cast<double>(r);
      p.top_k = r % 3 == 1 ? 20 : 0;
      p.top_p = r % 5 == 2 ? 0.9 : 1.0;
      p.min_p = r % 7 == 3 ? 0.05 : 0.0;
      p.presence_penalty = r % 2 == 1 ? 0.5 : 0.0;
      p.frequency_penalty = r % 2 == 1 ? 0.25 : 0.0;
      p.top_logprobs = r % 3 == 0 ? r % 21 : 0;  // 0, 3, 6, 9, 12, 15
      if (r % 4 == 1) {
        // Strong biases, so they decide tokens: one pushes a token up, one past the vocabulary
        // (ignored), one pushes a token down.
        p.logit_bias = {{static_cast<std::int32_t>(r * 31 % vocab), 8.0F},
                        {static_cast<std::int32_t>(vocab + 5), 100.0F},
                        {static_cast<std::int32_t>(r * 17 % vocab), -100.0F}};
      }
    }
    std::vector<std::vector<std::pair<std::int32_t, float>>> biases(static_cast<std::size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      for (const auto& b : params[static_cast<std::size_t>(r)].logit_bias) {
        biases[static_cast<std::size_t>(r)].emplace_back(b.token, b.bias);
      }
    }
    std::vector<pd::model::Sampler> cpu;
    cpu.reserve(params.size());
    for (const auto& p : params) cpu.emplace_back(p);
    std::vector<std::vector<std::pair<std::int32_t, int64_t>>> counts(static_cast<std::size_t>(rows));
    std::vector<std::uint64_t> draws(static_cast<std::size_t>(rows), 0);
    for (int step = 0; step < 8; ++step) {
      const std::vector<float> logits = randn(static_cast<std::size_t>(rows * vocab));
      auto dl = upload(logits, stream());
      std::vector<pd::gpu::DeviceSampler::Row> req(static_cast<std::size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        const auto& p = params[static_cast<std::size_t>(r)];
        auto& q = req[static_cast<std::size_t>(r)];
        q = {p.temperature,
             p.top_k,
             p.top_p,
             p.min_p,
             p.presence_penalty,
             p.frequency_penalty,
             p.seed,
             draws[static_cast<std::size_t>(r)],
             counts[static_cast<std::size_t>(r)]};
        q.logit_bias = biases[static_cast<std::size_t>(r)];
        q.top_logprobs = p.top_logprobs;
      }
      auto got = sampler->sample(dl.data(), req, stream());
      ASSERT_TRUE(got.ok()) << got.error().toString();
      for (int64_t r = 0; r < rows; ++r) {
        const auto row = std::span<const float>(logits).subspan(static_cast<std::size_t>(r * vocab),
                                                                static_cast<std::size_t>(vocab));
        const pd::SampledToken want = cpu[static_cast<std::size_t>(r)].sample(row);
        const auto& g = (*got)[static_cast<std::size_t>(r)];
        ASSERT_EQ(g.token, want.token) << "vocab " << vocab << " row " << r << " step " << step;
        ASSERT_NEAR(g.logprob, want.logprob, 1e-4F);
        ASSERT_EQ(g.top.size(), want.top.size()) << "row " << r;
        for (std::size_t k = 0; k < want.top.size(); ++k) {
          ASSERT_EQ(g.top[k].first, want.top[k].token) << "row " << r << " top " << k;
          ASSERT_NEAR(g.top[k].second, want.top[k].logprob, 1e-4F);
        }
        if (params[static_cast<std::size_t>(r)].temperature > 0.0) ++draws[static_cast<std::size_t>(r)];
        auto& c = counts[static_cast<std::size_t>(r)];
        auto it = std::find_if(c.begin(), c.end(), [&](const auto& e) { return e.first == want.token; });
        if (it == c.end()) {
          c.emplace_back(want.token, 1);
        } else {
          ++it->second;
        }
      }
    }
  }
}

// Allowed-token masks (grammar-constrained decoding): rows with none, a dense mask (the CPU
// Sampler's -inf path), a sparse one (its gather path) and a single allowed token, every filter,
// penalties and logit_bias; the tokens are the CPU Sampler's under the same masks. Then masks of
// the wrong size or allowing nothing are refused before any launch.
TEST_F(Kernel, SamplingUnderMasksMatchesCpuSampler) {
  for (const int64_t vocab : {1000, 129280}) {
    const int64_t rows = 12;
    const int64_t words = pd::gpu::math::maskWords(vocab);
    auto sampler = pd::gpu::DeviceSampler::create(64, vocab);
    ASSERT_TRUE(sampler.ok()) << sampler.error().toString();
    std::vector<pd::SamplingParams> params(static_cast<std::size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      auto& p = params[static_cast<std::size_t>(r)];
      p.seed = static_cast<std::uint64_t>(r * 104729 + 3);
      p.temperature = r % 3 == 0 ? 0.0 : 0.6 + 0.1 * static_cast<double>(r);
      p.top_k = r % 4 == 1 ? 30 : 0;
      p.top_p = r % 4 == 2 ? 0.85 : 1.0;
      p.min_p = r % 5 == 3 ? 0.05 : 0.0;
      p.presence_penalty = r % 2 == 1 ? 0.7 : 0.0;
      p.logit_bias = {{static_cast<std::int32_t>(r * 37 % vocab), 6.0F}};
    }
    std::vector<pd::model::Sampler> cpu;
    cpu.reserve(params.size());
    for (const auto& p : params) cpu.emplace_back(p);
    std::vector<std::vector<std::pair<std::int32_t, float>>> biases(static_cast<std::size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      for (const auto& b : params[static_cast<std::size_t>(r)].logit_bias) {
        biases[static_cast<std::size_t>(r)].emplace_back(b.token, b.bias);
      }
    }
    std::vector<std::vector<std::pair<std::int32_t, int64_t>>> counts(static_cast<std::size_t>(rows));
    std::vector<std::uint64_t> draws(static_cast<std::size_t>(rows), 0);
    std::mt19937_64 bits(99);
    int masked_tokens = 0;
    for (int step = 0; step < 6; ++step) {
      const std::vector<float> logits = randn(static_cast<std::size_t>(rows * vocab));
      auto dl = upload(logits, stream());
      // Row r % 4: 0 no mask, 1 dense (about half), 2 sparse (8 tokens), 3 one token.
      std::vector<std::vector<std::uint64_t>> masks(static_cast<std::size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        auto& m = masks[static_cast<std::size_t>(r)];
        if (r % 4 == 0) continue;
        m.assign(static_cast<std::size_t>(words), 0);
        if (r % 4 == 1) {
          for (auto& w : m) w = bits();
        } else {
          for (int k = 0; k < (r % 4 == 2 ? 8 : 1); ++k) {
            const auto t = static_cast<int64_t>(bits() % static_cast<std::uint64_t>(vocab));
            m[static_cast<std::size_t>(t / 64)] |= std::uint64_t{1} << (t % 64);
          }
        }
        if (vocab % 64 != 0) m.back() &= (std::uint64_t{1} << (vocab % 64)) - 1;
        if (!pd::gpu::math::maskAllowsSome(m.data(), vocab)) m[0] |= 1;
      }
      std::vector<pd::gpu::DeviceSampler::Row> req(static_cast<std::size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        const auto& p = params[static_cast<std::size_t>(r)];
        auto& q = req[static_cast<std::size_t>(r)];
        q = {p.temperature,
             p.top_k,
             p.top_p,
             p.min_p,
             p.presence_penalty,
             p.frequency_penalty,
             p.seed,
             draws[static_cast<std::size_t>(r)],
             counts[static_cast<std::size_t>(r)]};
        q.logit_bias = biases[static_cast<std::size_t>(r)];
        q.allowed = masks[static_cast<std::size_t>(r)];
      }
      auto got = sampler->sample(dl.data(), req, stream());
      ASSERT_TRUE(got.ok()) << got.error().toString();
      for (int64_t r = 0; r < rows; ++r) {
        const auto row = std::span<const float>(logits).subspan(static_cast<std::size_t>(r * vocab),
                                                                static_cast<std::size_t>(vocab));
        const auto& m = masks[static_cast<std::size_t>(r)];
        const pd::SampledToken want = cpu[static_cast<std::size_t>(r)].sample(row, m);
        const auto& g = (*got)[static_cast<std::size_t>(r)];
        ASSERT_EQ(g.token, want.token) << "vocab " << vocab << " row " << r << " step " << step;
        ASSERT_NEAR(g.logprob, want.logprob, 1e-4F);
        if (!m.empty()) {
          ASSERT_TRUE(pd::gpu::math::tokenAllowed(m.data(), g.token)) << "row " << r;
          ++masked_tokens;
        }
        if (params[static_cast<std::size_t>(r)].temperature > 0.0) ++draws[static_cast<std::size_t>(r)];
        auto& c = counts[static_cast<std::size_t>(r)];
        auto it = std::find_if(c.begin(), c.end(), [&](const auto& e) { return e.first == want.token; });
        if (it == c.end()) {
          c.emplace_back(want.token, 1);
        } else {
          ++it->second;
        }
      }
    }
    EXPECT_EQ(masked_tokens, 6 * 9);
    // Refused before any launch: a mask one word short, and one that allows nothing.
    const std::vector<float> logits = randn(static_cast<std::size_t>(vocab));
    auto dl = upload(logits, stream());
    pd::gpu::DeviceSampler::Row bad;
    std::vector<std::uint64_t> short_mask(static_cast<std::size_t>(words - 1), ~std::uint64_t{0});
    bad.allowed = short_mask;
    auto refused = sampler->sample(dl.data(), std::span(&bad, 1), stream());
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.error().code, pd::ErrorCode::InvalidArgument);
    std::vector<std::uint64_t> empty_mask(static_cast<std::size_t>(words), 0);
    bad.allowed = empty_mask;
    refused = sampler->sample(dl.data(), std::span(&bad, 1), stream());
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.error().message.find("allows no token"), std::string::npos) << refused.error().message;
  }
}

// ---- memory plan ----------------------------------------------------------------------------------

TEST_F(Kernel, MemoryPlanAgainstTheRealFreeMemory) {
  auto mem = pd::gpu::deviceMemoryInfo();
  ASSERT_TRUE(mem.ok()) << mem.error().toString();
  ASSERT_GT(mem->free, 0U);
  ASSERT_GE(mem->total, mem->free);
  std::printf("device memory: %.1f GB free of %.1f GB\n", static_cast<double>(mem->free) / 1e9,
              static_cast<double>(mem->total) / 1e9);
  auto tiny = pd::presetConfig("tiny");
  ASSERT_TRUE(tiny.ok());
  const pd::gpu::DeviceServingShape shape{1024, 64, DType::BF16, 512, 8192, 64};
  auto small = pd::gpu::planDeviceMemory(*tiny, shape);
  ASSERT_TRUE(small.ok());
  EXPECT_TRUE(pd::gpu::checkDeviceFit(*small, mem->free, 1'000'000'000ULL, "cuda:0").ok());
  auto v3 = pd::presetConfig("deepseek-v3-layers=61");
  ASSERT_TRUE(v3.ok());
  v3->quantization = pd::Fp8Quantization{};
  auto big = pd::gpu::planDeviceMemory(*v3, shape);
  ASSERT_TRUE(big.ok());
  const auto fit = pd::gpu::checkDeviceFit(*big, mem->free, 1'000'000'000ULL, "cuda:0");
  ASSERT_FALSE(fit.ok());  // 688 GB of weights on one device
  EXPECT_EQ(fit.error().code, pd::ErrorCode::ResourceExhausted);
  std::printf("%s\n", fit.error().message.c_str());
}

// ---- bad shapes -----------------------------------------------------------------------------------

TEST_F(Kernel, BadShapesAreClearErrorsNotLaunches) {
  auto none = pd::gpu::rmsNormResidual(nullptr, nullptr, nullptr, nullptr, 1, 0, 1e-6F, stream());
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().code, pd::ErrorCode::InvalidArgument);
  EXPECT_NE(none.error().message.find("d = 0"), std::string::npos) << none.error().message;
  const gm::RoutingShape bad{300, 7, 2, 4, 1.0F};  // 300 experts do not split into 7 groups
  auto r = pd::gpu::routeNoauxTc(nullptr, nullptr, bad, 1, nullptr, nullptr, stream());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, pd::ErrorCode::InvalidArgument);
  auto attn = pd::gpu::MlaDecodeAttention::create({1, 1, 4096, 10});
  ASSERT_FALSE(attn.ok());
  EXPECT_NE(attn.error().message.find("latent_dim"), std::string::npos);
  pd::gpu::kernels::GroupedGemvArgs g;  // no pointers, no groups
  auto grouped = pd::gpu::groupedGemv(g, stream());
  ASSERT_FALSE(grouped.ok());
  EXPECT_NE(grouped.error().message.find("groups = 0"), std::string::npos) << grouped.error().message;
  auto group = pd::gpu::moeGroup(nullptr, 1, 9, 4, nullptr, nullptr, nullptr, nullptr, stream());
  ASSERT_FALSE(group.ok());
  EXPECT_EQ(group.error().code, pd::ErrorCode::InvalidArgument);
  auto prefill = pd::gpu::MlaPrefillAttention::create({4, 2, 2048, 64, 128, 512});
  ASSERT_FALSE(prefill.ok());
  EXPECT_NE(prefill.error().message.find("nope"), std::string::npos) << prefill.error().message;
  auto small = pd::gpu::MlaPrefillAttention::create({4, 2, 8, 4, 8, 16});
  ASSERT_TRUE(small.ok()) << small.error().toString();
  float dummy_f = 0.0F;
  std::int32_t dummy_i = 0;
  std::int64_t dummy_l = 1;
  const std::vector<pd::gpu::PrefillSegment> gap{{0, 1, 0, 1}, {2, 3, 0, 1}};  // row 1 in no segment
  pd::gpu::MlaPrefillAttention::Batch pb;
  pb.q = &dummy_f;
  pb.rows = 3;
  pb.cache_layer = &dummy_f;
  pb.block_size = 16;
  pb.num_blocks = 1;
  pb.block_tables = &dummy_i;
  pb.table_entries = 1;
  pb.ctx_len = &dummy_l;
  pb.segments = gap;
  pb.kv_b = &dummy_f;
  pb.out = &dummy_f;
  auto blas = pd::cuda::BlasHandle::create(stream());
  ASSERT_TRUE(blas.ok());
  auto bad_segments = small->run(pb, blas->get(), stream());
  ASSERT_FALSE(bad_segments.ok());
  EXPECT_NE(bad_segments.error().message.find("segment 1"), std::string::npos) << bad_segments.error().message;
}

}  // namespace

int main(int argc, char** argv) {
  return pd::testutil::runGpuTests(argc, argv, "the GPU parity tests");
}
