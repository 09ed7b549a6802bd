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
  const auto block = [&](i64 b, i64 rows) {
    model::WeightMatrix m;
    m.dtype = cache.dtype;
    m.rows = rows;
    m.cols = ld;
    m.data = cache.slot(layer, block_table[static_cast<std::size_t>(b)], 0);
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

}  // namespace pd::test
