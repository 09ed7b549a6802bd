#pragma once
/// Incremental detokenization for streamed generation: feed ids one at a time and get text as
/// soon as it is final. Bytes that may still become a character (an incomplete UTF-8 sequence
/// at the end) are held back, so no U+FFFD is emitted that a later token would have completed;
/// an ill-formed sequence that no later byte can fix is emitted as U+FFFD right away. The
/// concatenation of everything push() returned plus finish() equals
/// Tokenizer::decode(all ids, skip_special_tokens), character for character.
///
/// Thread rules: one object per stream, used by one thread at a time. The Tokenizer must
/// outlive it.

#include <span>
#include <string>
#include <string_view>

#include "pd/tokenizer/tokenizer.h"

namespace pd::tokenizer {

class IncrementalDetokenizer {
 public:
  IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens);

  /// Adds one id; returns the text that became final (often empty or a few characters).
  /// Unknown ids (and special ids when skipping them) add nothing, as in Tokenizer::decode.
  [[nodiscard]] std::string push(TokenId id);
  /// Adds several ids; same as concatenating push() of each.
  [[nodiscard]] std::string push(std::span<const TokenId> ids);

  /// What a full decode would add now if the stream ended here: the held-back bytes decoded
  /// lossily (U+FFFD for an incomplete sequence). Does not change the state.
  [[nodiscard]] std::string peekRemainder() const;

  /// Ends the stream: returns peekRemainder() and clears the held-back bytes. The object may be
  /// reused for a new stream afterwards.
  [[nodiscard]] std::string finish();

  /// Number of bytes held back (0..3).
  [[nodiscard]] std::size_t pendingBytes() const { return pending_.size(); }

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::string pending_;  // bytes not yet emitted: a possibly incomplete UTF-8 sequence
};

}  // namespace pd::tokenizer
