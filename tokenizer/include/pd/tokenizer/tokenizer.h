#pragma once
/// Byte-level BPE tokenizer compatible with Hugging Face `tokenizers` for the DeepSeek-V3
/// `tokenizer.json` (+ `tokenizer_config.json` for the BOS rule). Ids and text are identical to
/// the Rust library's (docs/tokenizer.md lists the conventions and the golden tests).
///
/// Encode: added tokens (special or not) are split off first, anywhere in the text; the text
/// between them is pre-tokenized (the Split sequence of tokenizer.json, with Unicode 16.0
/// classes) and each piece is BPE-merged by rank. Decode: bytes of every id, one lossy UTF-8
/// decode over the concatenation (each ill-formed subsequence becomes one U+FFFD).
///
/// Errors: loading fails with NotFound / Io / Corrupt, or Unsupported for a tokenizer.json that
/// uses a feature this implementation does not have (a normalizer, another pre-tokenizer
/// pattern, byte fallback, ...): nothing is guessed. encode() rejects text that is not valid
/// UTF-8 (InvalidArgument, naming the byte offset). decode() never fails: ids that name no token
/// are dropped, as the reference decoder does (use isKnownId() to reject them first).
///
/// Thread rules: a Tokenizer is immutable after load(); every const method may be called from
/// any number of threads at once, without locks (each thread keeps its own scratch buffers and a
/// small memo of recently merged pieces, which never changes a result). Move-only.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/generation.h"
#include "pd/common/result.h"

namespace pd::tokenizer {

using pd::TokenId;  // the generation vocabulary's (generation.h); valid ids are >= 0

class Tokenizer {
 public:
  /// Loads DIR/tokenizer.json and, when present, DIR/tokenizer_config.json (BOS/EOS flags,
  /// bos/eos/pad token strings, chat template). About 0.3 s of CPU for DeepSeek-V3.
  [[nodiscard]] static Result<Tokenizer> load(const std::filesystem::path& dir);
  /// Same from file contents; `tokenizer_config_json` may be empty (no BOS rule).
  [[nodiscard]] static Result<Tokenizer> fromJson(std::string_view tokenizer_json,
                                                  std::string_view tokenizer_config_json);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;
  ~Tokenizer();

  /// Token ids of `text` (UTF-8). With `add_special_tokens`, the tokenizer_config.json rule of
  /// LlamaTokenizerFast applies: BOS first if `add_bos_token`, EOS last if `add_eos_token`.
  /// Empty text gives no ids (just the BOS with add_special_tokens). InvalidArgument if `text`
  /// is not valid UTF-8.
  [[nodiscard]] Result<std::vector<TokenId>> encode(std::string_view text, bool add_special_tokens = false) const;

  /// Text of `ids`. With `skip_special_tokens`, ids of tokens flagged `special` are dropped
  /// (BOS, EOS, pad, placeholders, <|EOT|>); the chat-format tokens are kept. Unknown ids are
  /// dropped. Always valid UTF-8.
  [[nodiscard]] std::string decode(std::span<const TokenId> ids, bool skip_special_tokens = false) const;

  /// The pre-tokenizer pieces of `text` (no added-token split), as views into `text`; for tests
  /// and debugging. InvalidArgument if `text` is not valid UTF-8.
  [[nodiscard]] Result<std::vector<std::string_view>> preTokenize(std::string_view text) const;

  /// The raw bytes an id stands for (not necessarily valid UTF-8 alone); nullopt if unknown.
  [[nodiscard]] std::optional<std::string_view> tokenBytes(TokenId id) const;
  /// The vocabulary string of an id (byte-level alphabet, e.g. "Ġworld"); nullopt if unknown.
  [[nodiscard]] std::optional<std::string_view> tokenString(TokenId id) const;
  /// Id of a vocabulary string or added-token content; nullopt if none.
  [[nodiscard]] std::optional<TokenId> tokenToId(std::string_view token) const;

  [[nodiscard]] bool isKnownId(TokenId id) const;
  /// True for added tokens (tokenizer.json `added_tokens`: BOS, EOS, the chat-format and tool-call
  /// markers, ...), special or not; the grammar engine keeps them out of constrained text.
  [[nodiscard]] bool isAddedToken(TokenId id) const;
  /// True for ids that decode(..., skip_special_tokens=true) drops.
  [[nodiscard]] bool isSpecial(TokenId id) const;
  /// One past the largest id (128815 for DeepSeek-V3).
  [[nodiscard]] std::size_t vocabSize() const;

  [[nodiscard]] std::optional<TokenId> bosId() const;
  [[nodiscard]] std::optional<TokenId> eosId() const;
  /// tokenizer_config.json strings ("" when absent); the chat template reads them.
  [[nodiscard]] const std::string& bosToken() const;
  [[nodiscard]] const std::string& eosToken() const;
  [[nodiscard]] const std::string& padToken() const;
  /// tokenizer_config.json `chat_template` (the default one when it is a list); "" when absent.
  [[nodiscard]] const std::string& chatTemplateSource() const;

  class Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pd::tokenizer
