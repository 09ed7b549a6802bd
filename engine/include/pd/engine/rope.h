#pragma once
/// Rotary position embedding as DeepSeek-V3 uses it: interleaved pairs (x[2j], x[2j+1]) rotated
/// by pos * f'_j, with YaRN-corrected frequencies when rope_scaling is "yarn" (golden/README.md
/// §3.5, computed in float32 the way the reference does).
/// Thread rules: pure functions.

#include <cstdint>
#include <vector>

#include "pd/common/result.h"
#include "pd/engine/model_config.h"

namespace pd::model {

/// f'_j for j in [0, qk_rope_head_dim / 2). Unsupported for a rope_scaling type other than yarn.
Result<std::vector<float>> ropeInvFreq(const ModelConfig& config);

/// cos/sin of float32(pos * inv_freq[j]) for every j: out_cos/out_sin [inv_freq.size()].
void ropeCosSin(const std::vector<float>& inv_freq, std::int64_t pos, float* out_cos, float* out_sin);

/// Rotates x[0, 2 * half) in place: (a, b) -> (a cos - b sin, a sin + b cos) per pair.
void applyRope(float* x, const float* cos, const float* sin, std::int64_t half);

}  // namespace pd::model
