#pragma once
/// DeepSeek-V3's noaux_tc expert routing of one token, the CPU engine's (the reference's) order:
/// sigmoid scores; the correction bias added for selection only; groups scored by the sum of
/// their two best biased scores (the max without a bias), the best `topk_group` groups kept
/// (stable order: the lower group first on ties); the `top_k` best biased experts of those, the
/// lower id first on ties; weights = their unbiased scores renormalized to sum 1, times
/// `routed_scaling`. One definition for the CPU engine's MoE and the GPU kernels' parity tests.
///
/// Thread rules: a pure function; `scratch` is the caller's (one per thread).

#include <cstdint>
#include <span>
#include <vector>

namespace pd::model {

/// Buffers routeToken() reuses between calls (no allocation once grown).
struct RoutingScratch {
  std::vector<float> score;
  std::vector<float> biased;
  std::vector<float> group_score;
  std::vector<std::int64_t> order;
};

/// Routes one token: `logits` has one router logit per expert, `bias` one correction per expert
/// or is empty; `chosen` and `weight` receive top_k experts and weights, best first. The sizes
/// must be consistent (n_experts divisible by groups, 1 <= topk_group <= groups, 1 <= top_k <=
/// the experts in topk_group groups); PD_CHECKed.
void routeToken(std::span<const float> logits, std::span<const float> bias, std::int64_t groups,
                std::int64_t topk_group, std::int64_t top_k, double routed_scaling, std::span<std::int32_t> chosen,
                std::span<float> weight, RoutingScratch& scratch);

}  // namespace pd::model
