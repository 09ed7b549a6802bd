#pragma once
/// A PromptRenderer stand-in for the real tokenizer and chat template: one token per byte
/// (id = byte + 10) after a BOS (id 1); a chat renders as "<|role|>content" per message plus
/// "<|assistant|>". Deterministic, so tests can predict prompt ids and usage counts exactly.
/// Thread rules: thread-safe (immutable after setup; set fail_with before serving).

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pd/router/prompt_renderer.h"

namespace pd::fakes {

class FakePromptRenderer final : public router::PromptRenderer {
 public:
  static constexpr pd::TokenId kBos = 1;
  static constexpr std::size_t kVocab = 266;

  /// The ids tokenize() gives for `text`.
  static std::vector<pd::TokenId> idsOf(std::string_view text) {
    std::vector<pd::TokenId> ids{kBos};
    for (char c : text) ids.push_back(static_cast<pd::TokenId>(static_cast<unsigned char>(c)) + 10);
    return ids;
  }
  static std::string chatText(const std::vector<router::ChatMessage>& messages) {
    std::string text;
    for (const auto& m : messages) text += "<|" + m.role + "|>" + m.content;
    return text + "<|assistant|>";
  }

  [[nodiscard]] Result<std::vector<pd::TokenId>> renderChat(
      const router::ChatConversation& conversation) const override {
    if (fail_with) return *fail_with;
    return idsOf(chatText(conversation.messages));
  }
  [[nodiscard]] Result<std::vector<pd::TokenId>> tokenize(std::string_view text) const override {
    if (fail_with) return *fail_with;
    return idsOf(text);
  }
  [[nodiscard]] std::size_t vocabSize() const override { return kVocab; }

  std::optional<Error> fail_with;  ///< every call fails with this when set
};

}  // namespace pd::fakes
