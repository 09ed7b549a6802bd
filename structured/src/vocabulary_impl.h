#pragma once
// TokenVocabulary's prepared tables, shared with the Matcher. Private to pd_structured.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pd/structured/token_vocabulary.h"

namespace pd::structured {
namespace detail {

/// A byte trie in preorder: node i's children start at i + 1 and the next sibling of a child c is
/// at end[c], so a whole subtree is skipped by jumping to its end. Node 0 is the root.
struct TokenTrie {
  std::vector<std::uint8_t> byte;
  std::vector<std::uint32_t> end;
  std::vector<TokenId> token;                            // the token ending at the node, or -1
  std::vector<std::pair<std::uint32_t, TokenId>> twins;  // further tokens with the same bytes
  std::vector<std::uint8_t> has_twins;
  std::size_t max_depth = 0;

  /// Builds the trie of (bytes, id) pairs.
  static TokenTrie build(std::vector<std::pair<std::string_view, TokenId>> tokens);
};

inline void setBit(MaskWord* mask, TokenId id) {
  const auto i = static_cast<std::size_t>(id);
  mask[i / 64] |= MaskWord{1} << (i % 64);
}

}  // namespace detail

class TokenVocabulary::Impl {
 public:
  std::size_t size = 0;
  std::size_t mask_words = 0;
  std::vector<std::optional<std::string>> bytes;  // indexed by id; nullopt: never text
  std::vector<TokenId> stops;
  std::vector<std::pair<std::string, TokenId>> added;  // sorted by content
  detail::TokenTrie all;                               // every text token
  // Tokens that are not "plain string text": plain = no '"', no '\\', no control byte, whole UTF-8
  // characters only. Inside a pattern-free string a plain token of at most `room` characters is
  // always allowed, so only the other tokens need a walk.
  detail::TokenTrie unplain;
  std::vector<std::vector<MaskWord>> plain_upto;  // [k]: plain tokens of at most k characters
  std::uint32_t max_plain_chars = 0;
  // Every plain token with its code points (plain_cps[plain_begin[i] .. plain_begin[i + 1])), for
  // the per-pattern-state masks (Grammar::Impl::patternMask).
  std::vector<TokenId> plain_ids;
  std::vector<std::uint32_t> plain_begin;
  std::vector<std::uint32_t> plain_cps;
};

}  // namespace pd::structured
