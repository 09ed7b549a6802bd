#pragma once
/// The client-facing half of a generation's tokens: turns the decode worker's token events into
/// the sink's deltas — incremental detokenization (a multi-byte character waits for its last
/// byte; special tokens add text only without skip_special_tokens), stop strings (the text ends
/// right before the first match, or after it with include_stop_str_in_output; a possible prefix
/// is held back) and max_tokens (ids past it are dropped) — and builds the finish event. The decode leg
/// feeds it; it knows nothing about workers or HTTP.
///
/// Thread rules: one object per generation, used by one thread at a time. The tokenizer must
/// outlive it.

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "pd/router/completion_backend.h"
#include "pd/router/stop_strings.h"
#include "pd/tokenizer/detokenizer.h"
#include "pd/tokenizer/tokenizer.h"

namespace pd::router {

class TokenRelay {
 public:
  /// `request` gives max_tokens, the stop strings and their options, skip_special_tokens and
  /// whether logprobs are reported.
  TokenRelay(const tokenizer::Tokenizer& tokenizer, const GenerationRequest& request);

  struct Step {
    std::optional<TokenDelta> delta;  ///< what to hand the sink; none when no id was taken
    bool stop_matched = false;        ///< a stop string matched: the generation ends here
  };
  /// One tokens event: `logprobs` has one entry per id when the worker sent them (else empty).
  [[nodiscard]] Step push(std::span<const TokenId> ids, std::span<const SampledToken> logprobs);

  struct Finish {
    FinishEvent event;
    bool stop_matched = false;  ///< a stop string matched in the released text (reason Stop)
  };
  /// The finish after the decode worker's finish event (`reason` Stop or Length): releases the
  /// held-back text; a stop string matching in it makes the reason Stop.
  [[nodiscard]] Finish finish(FinishReason reason);
  /// The finish after push() reported a stop string: nothing more is released.
  [[nodiscard]] static FinishEvent stopped() { return FinishEvent{}; }

  /// True once a delta with tokens was produced (a retry on another worker is then impossible).
  [[nodiscard]] bool committed() const { return emitted_ > 0; }

 private:
  [[nodiscard]] LogprobEntry withText(const SampledToken& sampled) const;
  [[nodiscard]] std::string tokenText(TokenId id) const;

  const tokenizer::Tokenizer& tokenizer_;
  const std::int64_t max_tokens_;
  const bool logprobs_;
  tokenizer::IncrementalDetokenizer detok_;
  StopStringMatcher stops_;
  std::int64_t emitted_ = 0;
};

}  // namespace pd::router
