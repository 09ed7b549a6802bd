#pragma once
/// The generation vocabulary every module shares: one token id type, the sampling parameters,
/// a token's logprob. Serialized only at the JSON edges (worker_api.h, the router's responses).
///
/// Thread rules: plain values.

#include <cstdint>

#include "pd/common/result.h"

namespace pd {

/// A vocabulary index. Signed so that it matches the model's int32 tensors and the wire.
using TokenId = std::int32_t;

struct SamplingParams {
  double temperature = 0.0;        ///< 0 = greedy
  std::int64_t top_k = 0;          ///< 0 = no limit
  double top_p = 1.0;              ///< (0, 1]
  double min_p = 0.0;              ///< [0, 1]
  double presence_penalty = 0.0;   ///< [-2, 2]
  double frequency_penalty = 0.0;  ///< [-2, 2]
  std::uint64_t seed = 0;
  std::int64_t top_logprobs = 0;  ///< how many alternatives to report per token (0..20)
};

/// InvalidArgument naming the field when a value is out of range.
Status validate(const SamplingParams& params);

struct TokenLogprob {
  std::int32_t token = 0;
  float logprob = 0.0F;
};

}  // namespace pd
