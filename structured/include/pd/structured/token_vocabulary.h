#pragma once
/// The generation vocabulary seen as byte strings, prepared once for grammar-constrained decoding:
/// every token's bytes, a byte trie over them (so a step's mask is a walk that prunes whole
/// subtrees, never a scan of the vocabulary), and the precomputed masks of "plain string" tokens
/// (docs/structured-outputs.md).
///
/// Which tokens can appear in constrained text: every vocabulary token except the added tokens
/// (BOS, EOS, the chat-format and tool-call markers), which never stand for literal text. The stop
/// tokens (EOS by default) are allowed exactly when the grammar's value is complete. Ids between
/// the tokenizer's size and the model's vocabulary size (padding rows) are never allowed.
///
/// Ownership: built once per tokenizer and shared (shared_ptr<const>) by every Grammar compiled
/// against it; a Grammar keeps its vocabulary alive.
/// Thread rules: immutable after create(); every const method may be called from any thread.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pd/common/generation.h"
#include "pd/common/result.h"

namespace pd::tokenizer {
class Tokenizer;
}

namespace pd::structured {

/// A bitset over token ids: bit i of word i / 64 is token i. Masks are sized by maskWords().
using MaskWord = std::uint64_t;

class TokenVocabulary {
 public:
  /// Builds the vocabulary from explicit token bytes: `token_bytes[i]` is the text token i stands
  /// for, nullopt for ids that never appear in constrained text. `model_vocab_size` (>= the table's
  /// size) sizes the masks. `stop_tokens` are the ids that end a sequence (at least one).
  /// InvalidArgument for an empty stop list, a stop id out of range, or empty token bytes.
  /// `added_tokens` (content, id) are the tokens a grammar may name whole, such as the
  /// tool-call markers; they are never text.
  [[nodiscard]] static Result<std::shared_ptr<const TokenVocabulary>> fromTokenBytes(
      std::vector<std::optional<std::string>> token_bytes, std::size_t model_vocab_size,
      std::vector<TokenId> stop_tokens, std::vector<std::pair<std::string, TokenId>> added_tokens = {});

  /// The same from a loaded tokenizer: added tokens are excluded, stop tokens default to the
  /// tokenizer's EOS when `stop_tokens` is empty. `model_vocab_size` 0 means the tokenizer's size.
  /// About 0.2 s for DeepSeek-V3 (docs/benchmarks.md).
  [[nodiscard]] static Result<std::shared_ptr<const TokenVocabulary>> fromTokenizer(
      const tokenizer::Tokenizer& tokenizer, std::size_t model_vocab_size = 0, std::vector<TokenId> stop_tokens = {});

  TokenVocabulary(const TokenVocabulary&) = delete;
  TokenVocabulary& operator=(const TokenVocabulary&) = delete;
  ~TokenVocabulary();

  /// The model's vocabulary size: masks cover ids [0, size()).
  [[nodiscard]] std::size_t size() const;
  /// Words a mask needs: ceil(size() / 64).
  [[nodiscard]] std::size_t maskWords() const;
  [[nodiscard]] std::span<const TokenId> stopTokens() const;
  [[nodiscard]] bool isStopToken(TokenId id) const;
  /// The id of an added token by its content (e.g. "<｜tool▁calls▁begin｜>"); nullopt if none.
  [[nodiscard]] std::optional<TokenId> addedToken(std::string_view content) const;
  /// The bytes of a token usable in constrained text; nullopt for stop, added and padding ids.
  [[nodiscard]] std::optional<std::string_view> tokenBytes(TokenId id) const;

  class Impl;
  [[nodiscard]] const Impl& impl() const { return *impl_; }

 private:
  explicit TokenVocabulary(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pd::structured
