#pragma once
// The CPU engine's computations for the CUDA tests: the host tests check
// engine/cuda/device_math.h against them, the GPU parity tests check the kernels. Routing is the
// engine's own model::routeToken; the latent attention of one query token is written out here,
// step for step, because cpu_engine.cpp's is fused into its batched, threaded forward.
// Everything else public in the CPU engine (rope.h, sampling.h, kernels.h, dequantizeRow, the
// engine's traces) is called directly.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "pd/engine/kernels.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/moe_routing.h"

namespace pd::test {

/// The CPU engine's routing of one token (model::routeToken, which its moe() calls).
struct CpuRouting {
  std::vector<std::int32_t> idx;
  std::vector<float> weight;
};
inline CpuRouting cpuRouteToken(std::span<const float> logits, std::span<const float> bias, std::int64_t groups,
                                std::int64_t topk_group, std::int64_t top_k, double routed_scaling) {
  CpuRouting out;
  out.idx.resize(static_cast<std::size_t>(top_k));
  out.weight.resize(static_cast<std::size_t>(top_k));
  model::RoutingScratch scratch;
  model::routeToken(logits, bias, groups, topk_group, top_k, routed_scaling, out.idx, out.weight, scratch);
  return out;
}

/// cpu_engine.cpp absorbedAttention()'s latent attention for one query token and `heads` heads:
/// scores = L q (per cache block, the kernel table's matmul), scaled softmax over positions
/// [0, ctx), o_lat = p^T L (matmulTransposed). q_cat [heads, latent_dim]; returns o_lat
/// [heads, latent_dim].
inline std::vector<float> cpuLatentAttention(const model::KernelTable& k, const model::LatentCacheView& cache,
                                             std::int64_t layer, std::span<const std::int32_t> block_table,
                                             std::int64_t ctx, const float* q_cat, std::int64_t heads, float scale) {
  using i64 = std::int64_t;
  const i64 ld = cache.latent_dim;
  const i64 bs = cache.block_size;
  const i64 nblocks = (ctx + bs - 1) / bs;
  const i64 stride = nblocks * bs;
  std::vector<float> scores(static_cast<std::size_t>(heads * stride), 0.0F);
  // An FP8 cache's tiles are read as F32 rows first, as the CPU engine's absorbed attention does.
  std::vector<float> dequantized;
  if (cache.dtype == DType::F8E4M3) {
    dequantized.resize(static_cast<std::size_t>(ctx * ld));
    for (i64 p = 0; p < ctx; ++p) model::readLatent(cache, layer, block_table, p, dequantized.data() + p * ld);
  }
  const auto block = [&](i64 b, i64 rows) {
    model::WeightMatrix m;
    m.dtype = dequantized.empty() ? cache.dtype : DType::F32;
    m.rows = rows;
    m.cols = ld;
    m.data = dequantized.empty()
                 ? static_cast<const void*>(cache.slot(layer, block_table[static_cast<std::size_t>(b)], 0))
                 : static_cast<const void*>(dequantized.data() + b * bs * ld);
    return m;
  };
  for (i64 b = 0; b < nblocks; ++b) {
    const i64 rows = std::min(bs, ctx - b * bs);
    k.matmul(block(b, rows), 0, rows, q_cat, ld, heads, scores.data() + b * bs, stride);
  }
  for (i64 h = 0; h < heads; ++h) {
    float* sc = scores.data() + h * stride;
    float mx = -std::numeric_limits<float>::infinity();
    for (i64 p = 0; p < ctx; ++p) {
      sc[p] *= scale;
      mx = std::max(mx, sc[p]);
    }
    float sum = 0.0F;
    for (i64 p = 0; p < ctx; ++p) {
      sc[p] = std::exp(sc[p] - mx);
      sum += sc[p];
    }
    const float inv = 1.0F / sum;
    for (i64 p = 0; p < ctx; ++p) sc[p] *= inv;
    std::fill(sc + ctx, sc + stride, 0.0F);
  }
  std::vector<float> o(static_cast<std::size_t>(heads * ld), 0.0F);
  for (i64 b = 0; b < nblocks; ++b) {
    const i64 rows = std::min(bs, ctx - b * bs);
    k.matmulTransposed(block(b, rows), 0, rows, scores.data() + b * bs, stride, heads, o.data(), ld);
  }
  return o;
}

/// Prefill attention (the CPU engine's AttentionPath::Prefill) of query rows of one sequence,
/// written out plainly in double: per position p, the cached latent's first `rank` values
/// up-projected by kv_b [heads * (nope + v), rank] into k_nope and v per head, k_pe its last `rope`
/// values; row t's scores scale * q[t][h] . [k_nope ; k_pe] over positions [0, ctx_len[t]),
/// softmax, the weighted values. q [rows, heads, nope + rope]; returns [rows, heads, v].
inline std::vector<float> referencePrefillAttention(const model::LatentCacheView& cache, std::int64_t layer,
                                                    std::span<const std::int32_t> block_table,
                                                    std::span<const std::int64_t> ctx_len, const float* q,
                                                    const float* kv_b, std::int64_t heads, std::int64_t nope,
                                                    std::int64_t rope, std::int64_t v, std::int64_t rank, float scale) {
  using i64 = std::int64_t;
  const auto at = [](i64 i) { return static_cast<std::size_t>(i); };
  const i64 ld = rank + rope;
  const i64 qk = nope + rope;
  const i64 kvw = heads * (nope + v);
  const i64 ctx = ctx_len.empty() ? 0 : *std::max_element(ctx_len.begin(), ctx_len.end());
  std::vector<float> lat(at(ctx * ld));
  for (i64 p = 0; p < ctx; ++p) model::readLatent(cache, layer, block_table, p, lat.data() + p * ld);
  std::vector<double> kv(at(ctx * kvw));  // [p][h * (nope + v) + j]: k_nope then v
  for (i64 p = 0; p < ctx; ++p) {
    for (i64 j = 0; j < kvw; ++j) {
      double sum = 0.0;
      for (i64 i = 0; i < rank; ++i) sum += static_cast<double>(kv_b[j * rank + i]) * lat[at(p * ld + i)];
      kv[at(p * kvw + j)] = sum;
    }
  }
  const auto rows = static_cast<i64>(ctx_len.size());
  std::vector<float> out(at(rows * heads * v));
  std::vector<double> scores(at(ctx));
  for (i64 t = 0; t < rows; ++t) {
    const i64 n = ctx_len[at(t)];
    for (i64 h = 0; h < heads; ++h) {
      const float* qh = q + (t * heads + h) * qk;
      double mx = -std::numeric_limits<double>::infinity();
      for (i64 p = 0; p < n; ++p) {
        const double* k = kv.data() + p * kvw + h * (nope + v);
        double dot = 0.0;
        for (i64 j = 0; j < nope; ++j) dot += k[j] * qh[j];
        for (i64 j = 0; j < rope; ++j) dot += static_cast<double>(qh[nope + j]) * lat[at(p * ld + rank + j)];
        scores[at(p)] = dot * scale;
        mx = std::max(mx, scores[at(p)]);
      }
      double sum = 0.0;
      for (i64 p = 0; p < n; ++p) {
        scores[at(p)] = std::exp(scores[at(p)] - mx);
        sum += scores[at(p)];
      }
      for (i64 j = 0; j < v; ++j) {
        double acc = 0.0;
        for (i64 p = 0; p < n; ++p) acc += scores[at(p)] * kv[at(p * kvw + h * (nope + v) + nope + j)];
        out[at((t * heads + h) * v + j)] = static_cast<float>(acc / sum);
      }
    }
  }
  return out;
}

}  // namespace pd::test
