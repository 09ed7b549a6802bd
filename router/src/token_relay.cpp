#include "token_relay.h"

#include <utility>

namespace pd::router {

TokenRelay::TokenRelay(const tokenizer::Tokenizer& tokenizer, const GenerationRequest& request)
    : tokenizer_(tokenizer),
      max_tokens_(request.max_tokens),
      logprobs_(request.logprobs),
      detok_(tokenizer, request.skip_special_tokens),
      stops_(request.stop, request.include_stop_str_in_output) {}

TokenRelay::Step TokenRelay::push(std::span<const TokenId> ids, std::span<const SampledToken> logprobs) {
  Step step;
  TokenDelta delta;
  for (std::size_t i = 0; i < ids.size() && emitted_ < max_tokens_; ++i) {
    const TokenId id = ids[i];
    ++emitted_;
    delta.token_ids.push_back(id);
    if (logprobs_ && i < logprobs.size()) delta.logprobs.push_back(withText(logprobs[i]));
    auto stop = stops_.push(detok_.push(id));
    delta.text += stop.text;
    if (stop.matched) {
      step.stop_matched = true;
      break;
    }
  }
  if (!delta.token_ids.empty()) step.delta = std::move(delta);
  return step;
}

TokenRelay::Finish TokenRelay::finish(FinishReason reason) {
  Finish end;
  auto tail = stops_.push(detok_.finish());
  end.event.text = std::move(tail.text);
  end.stop_matched = tail.matched;
  if (!tail.matched) {
    end.event.text += stops_.flush();
    end.event.end.reason = reason;
  }
  return end;
}

LogprobEntry TokenRelay::withText(const SampledToken& sampled) const {
  LogprobEntry out{sampled, tokenText(sampled.token), {}};
  for (const auto& t : sampled.top) out.top_text.push_back(tokenText(t.token));
  return out;
}

std::string TokenRelay::tokenText(TokenId id) const {
  const TokenId ids[] = {id};
  return tokenizer_.decode(ids);
}

}  // namespace pd::router
