#pragma once
// The CPU engine's computations that engine/src/cpu/cpu_engine.cpp keeps private, written out
// step for step for the CUDA tests: the host tests check engine/cuda/device_math.h against them,
// the GPU parity tests check the kernels. Everything public in the CPU engine (rope.h,
// sampling.h, kernels.h, dequantizeRow, the engine's traces) is called directly instead.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "pd/engine/kernels.h"
#include "pd/engine/latent_cache.h"

namespace pd::test {

/// cpu_engine.cpp moe()'s routing of one token, line for line (sigmoid, bias for selection,
/// group top-2 (or max without bias), stable_sort of groups, partial_sort of experts with the
/// lower id first on ties, weights renormalized and scaled).
struct CpuRouting {
  std::vector<std::int32_t> idx;
  std::vector<float> weight;
};
inline CpuRouting cpuRouteToken(std::span<const float> logits, std::span<const float> bias, std::int64_t groups,
                                std::int64_t topk_group, std::int64_t top_k, double routed_scaling) {
  using i64 = std::int64_t;
  const auto sz = [](i64 n) { return static_cast<std::size_t>(n); };
  const i64 n_exp = static_cast<i64>(logits.size());
  const i64 per_group = n_exp / groups;
  std::vector<float> score(sz(n_exp)), biased(sz(n_exp)), group_score(sz(groups));
  std::vector<i64> order(sz(std::max(n_exp, groups)));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (i64 e = 0; e < n_exp; ++e) {
    score[sz(e)] = 1.0F / (1.0F + std::exp(-logits[sz(e)]));
    biased[sz(e)] = bias.empty() ? score[sz(e)] : score[sz(e)] + bias[sz(e)];
  }
  if (groups > 1) {
    for (i64 g = 0; g < groups; ++g) {
      const float* gb = biased.data() + g * per_group;
      if (bias.empty()) {
        group_score[sz(g)] = *std::max_element(gb, gb + per_group);
      } else {
        float a = neg_inf, b = neg_inf;
        for (i64 i = 0; i < per_group; ++i) {
          if (gb[i] > a) {
            b = a;
            a = gb[i];
          } else if (gb[i] > b) {
            b = gb[i];
          }
        }
        group_score[sz(g)] = per_group > 1 ? a + b : a;
      }
    }
    std::iota(order.begin(), order.begin() + groups, 0);
    std::stable_sort(order.begin(), order.begin() + groups,
                     [&](i64 x, i64 y) { return group_score[sz(x)] > group_score[sz(y)]; });
    for (i64 gi = topk_group; gi < groups; ++gi) {
      const i64 g = order[sz(gi)];
      std::fill(biased.begin() + g * per_group, biased.begin() + (g + 1) * per_group, neg_inf);
    }
  }
  std::iota(order.begin(), order.begin() + n_exp, 0);
  std::partial_sort(order.begin(), order.begin() + top_k, order.begin() + n_exp, [&](i64 x, i64 y) {
    return biased[sz(x)] > biased[sz(y)] || (biased[sz(x)] == biased[sz(y)] && x < y);
  });
  CpuRouting out;
  float sum = 0.0F;
  for (i64 k = 0; k < top_k; ++k) sum += score[sz(order[sz(k)])];
  for (i64 k = 0; k < top_k; ++k) {
    out.idx.push_back(static_cast<std::int32_t>(order[sz(k)]));
    out.weight.push_back(score[sz(order[sz(k)])] / sum * static_cast<float>(routed_scaling));
  }
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
