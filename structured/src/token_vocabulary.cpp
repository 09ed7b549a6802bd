#include "pd/structured/token_vocabulary.h"

#include <algorithm>

#include "pd/tokenizer/tokenizer.h"
#include "vocabulary_impl.h"

namespace pd::structured {
namespace detail {

TokenTrie TokenTrie::build(std::vector<std::pair<std::string_view, TokenId>> tokens) {
  std::sort(tokens.begin(), tokens.end());
  TokenTrie t;
  auto add = [&t](std::uint8_t b) {
    t.byte.push_back(b);
    t.end.push_back(0);
    t.token.push_back(-1);
    t.has_twins.push_back(0);
    return static_cast<std::uint32_t>(t.byte.size() - 1);
  };
  std::vector<std::uint32_t> path{add(0)};
  std::string_view prev;
  bool first = true;
  for (const auto& [bytes, id] : tokens) {
    std::size_t common = 0;
    while (common < prev.size() && common < bytes.size() && prev[common] == bytes[common]) ++common;
    if (!first && common == bytes.size() && common == prev.size()) {
      t.twins.emplace_back(path.back(), id);
      t.has_twins[path.back()] = 1;
      continue;
    }
    while (path.size() - 1 > common) {
      t.end[path.back()] = static_cast<std::uint32_t>(t.byte.size());
      path.pop_back();
    }
    for (std::size_t d = common; d < bytes.size(); ++d) path.push_back(add(static_cast<std::uint8_t>(bytes[d])));
    t.token[path.back()] = id;
    t.max_depth = std::max(t.max_depth, bytes.size());
    prev = bytes;
    first = false;
  }
  while (!path.empty()) {
    t.end[path.back()] = static_cast<std::uint32_t>(t.byte.size());
    path.pop_back();
  }
  return t;
}

namespace {

// The code points of valid UTF-8 (a plain token), appended to `out`.
void appendCodePoints(std::string_view bytes, std::vector<std::uint32_t>& out) {
  for (std::size_t i = 0; i < bytes.size();) {
    const auto b = static_cast<std::uint8_t>(bytes[i]);
    std::size_t len = 1;
    std::uint32_t cp = b;
    if (b >= 0xF0) {
      len = 4;
      cp = b & 0x07U;
    } else if (b >= 0xE0) {
      len = 3;
      cp = b & 0x0FU;
    } else if (b >= 0xC0) {
      len = 2;
      cp = b & 0x1FU;
    }
    for (std::size_t k = 1; k < len; ++k) cp = (cp << 6U) | (static_cast<std::uint8_t>(bytes[i + k]) & 0x3FU);
    out.push_back(cp);
    i += len;
  }
}

// Characters of a plain token (see TokenVocabulary::Impl::unplain), or nullopt if it is not plain.
std::optional<std::uint32_t> plainChars(std::string_view bytes) {
  std::uint32_t chars = 0;
  for (std::size_t i = 0; i < bytes.size();) {
    const auto b = static_cast<std::uint8_t>(bytes[i]);
    if (b == '"' || b == '\\' || b < 0x20) return std::nullopt;
    std::size_t len = 1;
    std::uint32_t cp = b;
    std::uint32_t min = 0;
    if (b >= 0x80) {
      if (b >= 0xC2 && b <= 0xDF) {
        len = 2;
        cp = b & 0x1FU;
        min = 0x80;
      } else if (b >= 0xE0 && b <= 0xEF) {
        len = 3;
        cp = b & 0x0FU;
        min = 0x800;
      } else if (b >= 0xF0 && b <= 0xF4) {
        len = 4;
        cp = b & 0x07U;
        min = 0x10000;
      } else {
        return std::nullopt;
      }
      if (i + len > bytes.size()) return std::nullopt;
      for (std::size_t k = 1; k < len; ++k) {
        const auto c = static_cast<std::uint8_t>(bytes[i + k]);
        if ((c & 0xC0U) != 0x80U) return std::nullopt;
        cp = (cp << 6U) | (c & 0x3FU);
      }
      if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return std::nullopt;
    }
    i += len;
    ++chars;
  }
  return chars;
}

}  // namespace
}  // namespace detail

TokenVocabulary::TokenVocabulary(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TokenVocabulary::~TokenVocabulary() = default;

Result<std::shared_ptr<const TokenVocabulary>> TokenVocabulary::fromTokenBytes(
    std::vector<std::optional<std::string>> token_bytes, std::size_t model_vocab_size, std::vector<TokenId> stop_tokens,
    std::vector<std::pair<std::string, TokenId>> added_tokens) {
  if (model_vocab_size < token_bytes.size()) {
    return makeError(ErrorCode::InvalidArgument, "token vocabulary: model vocabulary size " +
                                                     std::to_string(model_vocab_size) + " < " +
                                                     std::to_string(token_bytes.size()) + " tokens");
  }
  if (stop_tokens.empty()) return makeError(ErrorCode::InvalidArgument, "token vocabulary: no stop token");
  auto impl = std::make_unique<Impl>();
  impl->size = model_vocab_size;
  impl->mask_words = (model_vocab_size + 63) / 64;
  token_bytes.resize(model_vocab_size);
  for (const TokenId id : stop_tokens) {
    if (id < 0 || static_cast<std::size_t>(id) >= model_vocab_size) {
      return makeError(ErrorCode::InvalidArgument,
                       "token vocabulary: stop token " + std::to_string(id) + " out of range");
    }
    token_bytes[static_cast<std::size_t>(id)].reset();  // a stop token never stands for text
  }
  for (const auto& [content, id] : added_tokens) {
    if (id < 0 || static_cast<std::size_t>(id) >= model_vocab_size) {
      return makeError(ErrorCode::InvalidArgument,
                       "token vocabulary: added token " + std::to_string(id) + " out of range");
    }
    token_bytes[static_cast<std::size_t>(id)].reset();  // named whole by a grammar, never text
  }
  std::sort(added_tokens.begin(), added_tokens.end());
  impl->added = std::move(added_tokens);
  std::sort(stop_tokens.begin(), stop_tokens.end());
  stop_tokens.erase(std::unique(stop_tokens.begin(), stop_tokens.end()), stop_tokens.end());
  impl->stops = std::move(stop_tokens);
  impl->bytes = std::move(token_bytes);

  std::vector<std::pair<std::string_view, TokenId>> all;
  std::vector<std::pair<std::string_view, TokenId>> unplain;
  std::vector<std::pair<std::uint32_t, TokenId>> plain;
  for (std::size_t i = 0; i < impl->bytes.size(); ++i) {
    if (!impl->bytes[i]) continue;
    const std::string_view b = *impl->bytes[i];
    const auto id = static_cast<TokenId>(i);
    if (b.empty())
      return makeError(ErrorCode::InvalidArgument, "token vocabulary: token " + std::to_string(i) + " is empty");
    all.emplace_back(b, id);
    if (const auto chars = detail::plainChars(b)) {
      plain.emplace_back(*chars, id);
      impl->max_plain_chars = std::max(impl->max_plain_chars, *chars);
      impl->plain_ids.push_back(id);
      impl->plain_begin.push_back(static_cast<std::uint32_t>(impl->plain_cps.size()));
      detail::appendCodePoints(b, impl->plain_cps);
    } else {
      unplain.emplace_back(b, id);
    }
  }
  impl->plain_begin.push_back(static_cast<std::uint32_t>(impl->plain_cps.size()));
  impl->all = detail::TokenTrie::build(std::move(all));
  impl->unplain = detail::TokenTrie::build(std::move(unplain));
  std::sort(plain.begin(), plain.end());
  impl->plain_upto.assign(impl->max_plain_chars + 1, std::vector<MaskWord>(impl->mask_words, 0));
  std::size_t next = 0;
  for (std::uint32_t k = 0; k <= impl->max_plain_chars; ++k) {
    if (k > 0) impl->plain_upto[k] = impl->plain_upto[k - 1];
    for (; next < plain.size() && plain[next].first == k; ++next)
      detail::setBit(impl->plain_upto[k].data(), plain[next].second);
  }
  return std::shared_ptr<const TokenVocabulary>(new TokenVocabulary(std::move(impl)));
}

Result<std::shared_ptr<const TokenVocabulary>> TokenVocabulary::fromTokenizer(const tokenizer::Tokenizer& tokenizer,
                                                                              std::size_t model_vocab_size,
                                                                              std::vector<TokenId> stop_tokens) {
  std::vector<std::optional<std::string>> bytes(tokenizer.vocabSize());
  std::vector<std::pair<std::string, TokenId>> added;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    const auto id = static_cast<TokenId>(i);
    if (!tokenizer.isKnownId(id)) continue;
    if (tokenizer.isAddedToken(id)) {
      if (const auto content = tokenizer.tokenString(id)) added.emplace_back(std::string(*content), id);
      continue;
    }
    if (const auto b = tokenizer.tokenBytes(id)) bytes[i] = std::string(*b);
  }
  if (stop_tokens.empty()) {
    if (!tokenizer.eosId())
      return makeError(ErrorCode::InvalidArgument, "token vocabulary: the tokenizer has no EOS token");
    stop_tokens.push_back(*tokenizer.eosId());
  }
  return fromTokenBytes(std::move(bytes), model_vocab_size == 0 ? tokenizer.vocabSize() : model_vocab_size,
                        std::move(stop_tokens), std::move(added));
}

std::size_t TokenVocabulary::size() const {
  return impl_->size;
}
std::size_t TokenVocabulary::maskWords() const {
  return impl_->mask_words;
}
std::span<const TokenId> TokenVocabulary::stopTokens() const {
  return impl_->stops;
}
bool TokenVocabulary::isStopToken(TokenId id) const {
  return std::binary_search(impl_->stops.begin(), impl_->stops.end(), id);
}
std::optional<TokenId> TokenVocabulary::addedToken(std::string_view content) const {
  const auto it = std::lower_bound(impl_->added.begin(), impl_->added.end(), content,
                                   [](const auto& entry, std::string_view key) { return entry.first < key; });
  if (it == impl_->added.end() || it->first != content) return std::nullopt;
  return it->second;
}

std::optional<std::string_view> TokenVocabulary::tokenBytes(TokenId id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= impl_->bytes.size() || !impl_->bytes[static_cast<std::size_t>(id)]) {
    return std::nullopt;
  }
  return std::string_view(*impl_->bytes[static_cast<std::size_t>(id)]);
}

}  // namespace pd::structured
