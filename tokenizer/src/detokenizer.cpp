#include "pd/tokenizer/detokenizer.h"

#include "unicode_class.h"

namespace pd::tokenizer {

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(&tokenizer), skip_special_(skip_special_tokens) {}

std::string IncrementalDetokenizer::push(TokenId id) {
  const auto bytes = tokenizer_->tokenBytes(id);
  if (!bytes || bytes->empty() || (skip_special_ && tokenizer_->isSpecial(id))) return {};
  pending_.append(*bytes);
  // Everything up to the start of a trailing incomplete sequence is final: a lead byte always
  // restarts the lossy decoder, so what precedes it decodes the same whatever follows.
  std::string out;
  std::size_t pos = 0;
  std::size_t run = 0;
  while (pos < pending_.size()) {
    if (static_cast<unsigned char>(pending_[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const detail::Utf8Step step = detail::utf8Step(pending_, pos);
    if (step.valid) {
      pos += step.length;
    } else if (step.truncated) {
      break;
    } else {
      out.append(pending_, run, pos - run);
      out.append("\xEF\xBF\xBD");
      pos += step.length;
      run = pos;
    }
  }
  out.append(pending_, run, pos - run);
  pending_.erase(0, pos);
  return out;
}

std::string IncrementalDetokenizer::push(std::span<const TokenId> ids) {
  std::string out;
  for (const TokenId id : ids) out += push(id);
  return out;
}

std::string IncrementalDetokenizer::peekRemainder() const {
  std::string out;
  detail::appendLossyUtf8(out, pending_);
  return out;
}

std::string IncrementalDetokenizer::finish() {
  std::string out = peekRemainder();
  pending_.clear();
  return out;
}

}  // namespace pd::tokenizer
