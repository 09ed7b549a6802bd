#pragma once
/// The PromptRenderer over the real tokenizer and chat template of a model (or tokenizer)
/// folder: chats go through the tokenizer_config.json chat template (with the generation prompt)
/// and are encoded without added special tokens (the template writes the BOS); plain prompts
/// are encoded with the tokenizer_config.json BOS rule.
///
/// Errors: load() passes on the tokenizer's NotFound / Io / Corrupt / Unsupported and the
/// template's InvalidArgument; NotFound when the tokenizer has no chat template. Rendering
/// errors are InvalidArgument and never quote the request's text.
///
/// Thread rules: immutable after load(); every method is thread-safe.

#include <filesystem>
#include <memory>

#include "pd/router/prompt_renderer.h"
#include "pd/tokenizer/chat_template.h"
#include "pd/tokenizer/tokenizer.h"

namespace pd::router {

class TokenizerPromptRenderer final : public PromptRenderer {
 public:
  /// Loads DIR/tokenizer.json and DIR/tokenizer_config.json.
  [[nodiscard]] static Result<std::unique_ptr<TokenizerPromptRenderer>> load(const std::filesystem::path& dir);
  [[nodiscard]] static Result<std::unique_ptr<TokenizerPromptRenderer>> create(tokenizer::Tokenizer tokenizer);

  [[nodiscard]] Result<std::vector<TokenId>> renderChat(const ChatConversation& conversation) const override;
  [[nodiscard]] Result<TimedPrompt> renderChatTimed(const ChatConversation& conversation) const override;
  [[nodiscard]] Result<std::vector<TokenId>> tokenize(std::string_view text) const override;
  [[nodiscard]] std::size_t vocabSize() const override;

  /// The tokenizer, for the backend's detokenization.
  [[nodiscard]] const tokenizer::Tokenizer& tokenizer() const { return tokenizer_; }

 private:
  TokenizerPromptRenderer(tokenizer::Tokenizer tokenizer, chat::ChatTemplate chat_template);
  tokenizer::Tokenizer tokenizer_;
  chat::ChatTemplate template_;
};

}  // namespace pd::router
