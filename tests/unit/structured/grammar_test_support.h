#pragma once
// Shared by the grammar tests: a hand-made byte vocabulary and mask helpers.

#include <gtest/gtest.h>

#include <bit>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "pd/structured/grammar.h"
#include "pd/structured/token_vocabulary.h"

namespace pd::structured::testing {

/// Tokens: every byte 0x00..0xFF alone (ids 0..255), then `extra` (ids 256...), then the stop
/// token (the last id).
inline std::shared_ptr<const TokenVocabulary> byteVocabulary(const std::vector<std::string>& extra = {}) {
  std::vector<std::optional<std::string>> bytes;
  for (int b = 0; b < 256; ++b) bytes.emplace_back(std::string(1, static_cast<char>(b)));
  for (const auto& e : extra) bytes.emplace_back(e);
  const auto stop = static_cast<TokenId>(bytes.size());
  bytes.emplace_back(std::nullopt);
  auto vocab = TokenVocabulary::fromTokenBytes(std::move(bytes), static_cast<std::size_t>(stop) + 1, {stop});
  EXPECT_TRUE(vocab.ok()) << vocab.error().toString();
  return std::move(vocab).value();
}

inline bool allowed(const std::vector<MaskWord>& mask, TokenId id) {
  const auto i = static_cast<std::size_t>(id);
  return ((mask[i / 64] >> (i % 64)) & 1U) != 0;
}

inline std::size_t countAllowed(const std::vector<MaskWord>& mask) {
  std::size_t n = 0;
  for (const auto w : mask) n += static_cast<std::size_t>(std::popcount(w));
  return n;
}

/// The `k`-th allowed token (0-based), or -1.
inline TokenId nthAllowed(const std::vector<MaskWord>& mask, std::size_t k) {
  for (std::size_t w = 0; w < mask.size(); ++w) {
    const auto n = static_cast<std::size_t>(std::popcount(mask[w]));
    if (k >= n) {
      k -= n;
      continue;
    }
    MaskWord word = mask[w];
    for (std::size_t i = 0; i < k; ++i) word &= word - 1;
    return static_cast<TokenId>(w * 64 + static_cast<std::size_t>(std::countr_zero(word)));
  }
  return -1;
}

}  // namespace pd::structured::testing
