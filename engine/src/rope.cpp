#include "pd/engine/rope.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>

namespace pd::model {

Result<std::vector<float>> ropeInvFreq(const ModelConfig& config) {
  const std::int64_t dim = config.qk_rope_head_dim;
  if (dim <= 0 || dim % 2 != 0) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("qk_rope_head_dim must be even and positive, not {}", dim));
  }
  const auto base = static_cast<float>(config.rope_theta);
  std::vector<float> freq(static_cast<std::size_t>(dim / 2));
  for (std::int64_t j = 0; j < dim / 2; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(dim);
    freq[static_cast<std::size_t>(j)] = 1.0F / std::pow(base, exponent);
  }
  if (!config.rope_scaling) return freq;
  const RopeScaling& s = *config.rope_scaling;
  if (s.type != "yarn") {
    return makeError(ErrorCode::Unsupported,
                     fmt::format("rope_scaling type '{}' is not supported (only yarn)", s.type));
  }
  // Correction range in double, as the reference computes it with Python floats.
  const auto correction_dim = [&](double rotations) {
    return static_cast<double>(dim) *
           std::log(static_cast<double>(s.original_max_position_embeddings) / (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(config.rope_theta));
  };
  double low = std::max(std::floor(correction_dim(s.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(s.beta_slow)), static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  const auto factor = static_cast<float>(s.factor);
  for (std::int64_t j = 0; j < dim / 2; ++j) {
    float ramp = (static_cast<float>(j) - static_cast<float>(low)) / static_cast<float>(high - low);
    ramp = std::clamp(ramp, 0.0F, 1.0F);
    const float smooth = 1.0F - ramp;
    float& f = freq[static_cast<std::size_t>(j)];
    f = f / factor * (1.0F - smooth) + f * smooth;
  }
  return freq;
}

void ropeCosSin(const std::vector<float>& inv_freq, std::int64_t pos, float* out_cos, float* out_sin) {
  const auto p = static_cast<float>(pos);
  for (std::size_t j = 0; j < inv_freq.size(); ++j) {
    const float angle = p * inv_freq[j];
    out_cos[j] = std::cos(angle);
    out_sin[j] = std::sin(angle);
  }
}

void applyRope(float* x, const float* cos, const float* sin, std::int64_t half) {
  for (std::int64_t j = 0; j < half; ++j) {
    const float a = x[2 * j];
    const float b = x[2 * j + 1];
    x[2 * j] = a * cos[j] - b * sin[j];
    x[2 * j + 1] = a * sin[j] + b * cos[j];
  }
}

}  // namespace pd::model
