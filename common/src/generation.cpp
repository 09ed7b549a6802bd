// Validation of the generation vocabulary (generation.h).
#include "pd/common/generation.h"

#include <cmath>
#include <string>

namespace pd {

Status validate(const SamplingParams& p) {
  const auto bad = [](std::string what) { return makeError(ErrorCode::InvalidArgument, std::move(what)); };
  if (!(p.temperature >= 0.0) || !std::isfinite(p.temperature)) return bad("temperature must be >= 0");
  if (p.top_k < 0) return bad("top_k must be >= 0");
  if (!(p.top_p > 0.0 && p.top_p <= 1.0)) return bad("top_p must be in (0, 1]");
  if (!(p.min_p >= 0.0 && p.min_p <= 1.0)) return bad("min_p must be in [0, 1]");
  if (!(p.presence_penalty >= -2.0 && p.presence_penalty <= 2.0)) return bad("presence_penalty must be in [-2, 2]");
  if (!(p.frequency_penalty >= -2.0 && p.frequency_penalty <= 2.0)) return bad("frequency_penalty must be in [-2, 2]");
  if (p.top_logprobs < 0 || p.top_logprobs > 20) return bad("top_logprobs must be in [0, 20]");
  if (p.logit_bias.size() > kMaxLogitBias) {
    return bad("logit_bias may hold at most " + std::to_string(kMaxLogitBias) + " tokens");
  }
  for (std::size_t i = 0; i < p.logit_bias.size(); ++i) {
    const LogitBias& b = p.logit_bias[i];
    if (b.token < 0) return bad("logit_bias token ids must be >= 0");
    if (!(b.bias >= -100.0F && b.bias <= 100.0F)) return bad("logit_bias values must be in [-100, 100]");
    for (std::size_t j = 0; j < i; ++j) {
      if (p.logit_bias[j].token == b.token) return bad("logit_bias names token " + std::to_string(b.token) + " twice");
    }
  }
  return okStatus();
}

}  // namespace pd

namespace pd {

std::string_view finishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::Stop:
      return "stop";
    case FinishReason::Length:
      return "length";
    case FinishReason::Aborted:
      return "abort";
    case FinishReason::Error:
      return "error";
  }
  return "error";
}

std::optional<FinishReason> parseFinishReason(std::string_view name) {
  for (const FinishReason r : {FinishReason::Stop, FinishReason::Length, FinishReason::Aborted, FinishReason::Error}) {
    if (finishReasonName(r) == name) return r;
  }
  return std::nullopt;
}

}  // namespace pd
