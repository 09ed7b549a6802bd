#include "pd/engine/moe_routing.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "pd/common/check.h"

namespace pd::model {

void routeToken(std::span<const float> logits, std::span<const float> bias, std::int64_t groups,
                std::int64_t topk_group, std::int64_t top_k, double routed_scaling, std::span<std::int32_t> chosen,
                std::span<float> weight, RoutingScratch& scratch) {
  using i64 = std::int64_t;
  const auto sz = [](i64 n) { return static_cast<std::size_t>(n); };
  const i64 n_exp = static_cast<i64>(logits.size());
  PD_CHECK(groups >= 1 && n_exp % groups == 0 && topk_group >= 1 && topk_group <= groups);
  const i64 per_group = n_exp / groups;
  PD_CHECK(top_k >= 1 && top_k <= (groups > 1 ? topk_group * per_group : n_exp));
  PD_CHECK(bias.empty() || static_cast<i64>(bias.size()) == n_exp);
  PD_CHECK(static_cast<i64>(chosen.size()) == top_k && static_cast<i64>(weight.size()) == top_k);
  std::vector<float>& score = scratch.score;
  std::vector<float>& biased = scratch.biased;
  std::vector<float>& group_score = scratch.group_score;
  std::vector<i64>& order = scratch.order;
  score.resize(sz(n_exp));
  biased.resize(sz(n_exp));
  group_score.resize(sz(groups));
  order.resize(sz(std::max(n_exp, groups)));
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
        float a = neg_inf;  // the two largest
        float b = neg_inf;
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
  float sum = 0.0F;
  for (i64 k = 0; k < top_k; ++k) sum += score[sz(order[sz(k)])];
  for (i64 k = 0; k < top_k; ++k) {
    chosen[sz(k)] = static_cast<std::int32_t>(order[sz(k)]);
    weight[sz(k)] = score[sz(order[sz(k)])] / sum * static_cast<float>(routed_scaling);
  }
}

}  // namespace pd::model
