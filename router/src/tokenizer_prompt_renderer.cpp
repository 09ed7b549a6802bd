#include "pd/router/tokenizer_prompt_renderer.h"

#include <utility>

namespace pd::router {

TokenizerPromptRenderer::TokenizerPromptRenderer(tokenizer::Tokenizer tokenizer, chat::ChatTemplate chat_template)
    : tokenizer_(std::move(tokenizer)), template_(std::move(chat_template)) {}

Result<std::unique_ptr<TokenizerPromptRenderer>> TokenizerPromptRenderer::load(const std::filesystem::path& dir) {
  PD_ASSIGN_OR_RETURN(auto tok, tokenizer::Tokenizer::load(dir));
  return create(std::move(tok));
}

Result<std::unique_ptr<TokenizerPromptRenderer>> TokenizerPromptRenderer::create(tokenizer::Tokenizer tokenizer) {
  PD_ASSIGN_OR_RETURN(auto tmpl, chat::ChatTemplate::fromTokenizer(tokenizer));
  return std::unique_ptr<TokenizerPromptRenderer>(new TokenizerPromptRenderer(std::move(tokenizer), std::move(tmpl)));
}

Result<std::vector<TokenId>> TokenizerPromptRenderer::renderChat(const ChatConversation& conversation) const {
  PD_ASSIGN_OR_RETURN(auto prompt, renderChatTimed(conversation));
  return std::move(prompt.ids);
}

Result<TimedPrompt> TokenizerPromptRenderer::renderChatTimed(const ChatConversation& conversation) const {
  chat::ChatRequest request;
  request.messages_json = conversation.messages_json;
  request.add_generation_prompt = true;
  request.extra_context_json = conversation.template_kwargs_json;
  request.tools_json = conversation.tools_json;
  auto text = template_.render(request);
  if (!text.ok()) {
    return makeError(ErrorCode::InvalidArgument,
                     "the messages do not fit the model's chat template: " + text.error().message);
  }
  const auto templated = std::chrono::system_clock::now();
  auto ids = tokenizer_.encode(text.value(), /*add_special_tokens=*/false);
  if (!ids.ok())
    return makeError(ErrorCode::InvalidArgument, "the rendered chat cannot be tokenized: " + ids.error().message);
  return TimedPrompt{std::move(ids).value(), templated};
}

Result<std::vector<TokenId>> TokenizerPromptRenderer::tokenize(std::string_view text) const {
  auto ids = tokenizer_.encode(text, /*add_special_tokens=*/true);
  if (!ids.ok()) return makeError(ErrorCode::InvalidArgument, "the prompt cannot be tokenized: " + ids.error().message);
  return ids;
}

std::size_t TokenizerPromptRenderer::vocabSize() const {
  return tokenizer_.vocabSize();
}

}  // namespace pd::router
