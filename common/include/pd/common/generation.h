#pragma once
/// The generation vocabulary every module shares: one token id type, the sampling parameters, a
/// token's logprob, a sampled token with its alternatives, and how a generation ends. Defined
/// once here and used by the tokenizer, the router, the worker API codecs, prefill, decode and
/// kvtransfer's completion record; serialized only at the JSON edges (worker_api.h, the router's
/// OpenAI responses) and in kvtransfer's binary wire format.
///
/// Thread rules: plain values and pure functions.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "pd/common/result.h"

namespace pd {

/// A vocabulary index. Signed so that it matches the model's int32 tensors and the wire; a valid
/// id is >= 0 (decoders reject negative ones).
using TokenId = std::int32_t;

/// One `logit_bias` entry (OpenAI): `bias` is added to the token's logit before sampling.
struct LogitBias {
  TokenId token = 0;
  float bias = 0.0F;  ///< [-100, 100]
  friend bool operator==(const LogitBias&, const LogitBias&) = default;
};
/// Most logit_bias entries one request may carry.
inline constexpr std::size_t kMaxLogitBias = 1024;

struct SamplingParams {
  double temperature = 0.0;        ///< 0 = greedy
  std::int64_t top_k = 0;          ///< 0 = no limit
  double top_p = 1.0;              ///< (0, 1]
  double min_p = 0.0;              ///< [0, 1]
  double presence_penalty = 0.0;   ///< [-2, 2]
  double frequency_penalty = 0.0;  ///< [-2, 2]
  std::uint64_t seed = 0;
  std::int64_t top_logprobs = 0;  ///< how many alternatives to report per token (0..20)
  /// Added to the logits after the penalties, before temperature and the filters; distinct tokens,
  /// at most kMaxLogitBias. Ids past the model's vocabulary are ignored by the sampler.
  std::vector<LogitBias> logit_bias;
};

/// InvalidArgument naming the field when a value is out of range.
Status validate(const SamplingParams& params);

/// A token and its log-probability under the raw model distribution.
struct TokenLogprob {
  TokenId token = 0;
  float logprob = 0.0F;
  friend bool operator==(const TokenLogprob&, const TokenLogprob&) = default;
};

/// A generated token with its logprob and the most likely alternatives (best first; as many as
/// SamplingParams::top_logprobs asked for).
struct SampledToken {
  TokenId token = 0;
  float logprob = 0.0F;
  std::vector<TokenLogprob> top;
  friend bool operator==(const SampledToken&, const SampledToken&) = default;
};

enum class FinishReason {
  Stop,     ///< EOS or a stop token id or stop string (OpenAI "stop")
  Length,   ///< max_tokens reached (OpenAI "length")
  Aborted,  ///< the client went away or the router cancelled
  Error,    ///< a failure ended it; the error travels beside
};

/// "stop", "length", "abort", "error".
[[nodiscard]] std::string_view finishReasonName(FinishReason reason);
/// The reason finishReasonName() names; nullopt for any other text.
[[nodiscard]] std::optional<FinishReason> parseFinishReason(std::string_view name);

/// How a generation ended, with its usage.
struct GenerationEnd {
  FinishReason reason = FinishReason::Stop;
  std::int64_t prompt_tokens = 0;
  std::int64_t completion_tokens = 0;
  std::int64_t cached_prompt_tokens = 0;  ///< prompt tokens served from a prefix cache
};

}  // namespace pd
