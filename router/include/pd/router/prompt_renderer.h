#pragma once
/// The seam between the OpenAI front end and the tokenizer / chat template (common/tokenizer.h
/// and common/chat_template.h, built in parallel). The front end validates the request and
/// hands over normalized messages; a renderer turns them into prompt token ids.
///
/// Errors: InvalidArgument when the messages do not fit the template or the text cannot be
/// tokenized (the front end answers 400 with the message, which must not echo request text).
///
/// Thread rules: thread-safe and const; called concurrently from the HTTP io threads.

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/result.h"
#include "pd/router/completion_backend.h"

namespace pd::router {

struct ChatMessage {
  std::string role;     ///< system, developer, user, assistant or tool
  std::string content;  ///< text parts joined with "\n"; "" for a null content
  /// assistant: the calls it made, as normalized JSON (`[{"id","type","function":{"name",
  /// "arguments"}}]`); empty: none. tool: the id of the call it answers.
  std::string tool_calls_json;
  std::string tool_call_id;
  std::string name;               ///< the participant's `name`, passed to the template; "" if none
  std::string reasoning_content;  ///< assistant: earlier reasoning, passed to the template; "" if none
};

/// A validated chat conversation in two equivalent forms: structured, and as the normalized
/// JSON array (`[{"role":..,"content":".."}]`, content always a string) that a Jinja chat
/// template takes directly.
struct ChatConversation {
  std::vector<ChatMessage> messages;
  std::string messages_json;
  /// `chat_template_kwargs` of the request as a JSON object text, or empty.
  std::string template_kwargs_json;
  /// The request's `tools` (a JSON array text) for the template's `tools` variable; empty: none.
  std::string tools_json;
};

/// A chat prompt's ids and when the template was done (the rest was the tokenizer's time).
struct TimedPrompt {
  std::vector<TokenId> ids;
  std::chrono::system_clock::time_point templated;
};

class PromptRenderer {
 public:
  PromptRenderer() = default;
  virtual ~PromptRenderer() = default;
  PromptRenderer(const PromptRenderer&) = delete;
  PromptRenderer& operator=(const PromptRenderer&) = delete;
  PromptRenderer(PromptRenderer&&) = delete;
  PromptRenderer& operator=(PromptRenderer&&) = delete;
  /// The prompt ids of a conversation, with the generation prompt for the assistant appended.
  [[nodiscard]] virtual Result<std::vector<TokenId>> renderChat(const ChatConversation& conversation) const = 0;
  /// renderChat() with the time the template's text was ready (the router's `router.template`
  /// and `router.tokenize` spans). The default cannot tell: it reports the template done at once.
  [[nodiscard]] virtual Result<TimedPrompt> renderChatTimed(const ChatConversation& conversation) const {
    const auto start = std::chrono::system_clock::now();
    PD_ASSIGN_OR_RETURN(auto ids, renderChat(conversation));
    return TimedPrompt{std::move(ids), start};
  }
  /// The ids of a plain-text prompt (/v1/completions), with the model's BOS rule applied.
  [[nodiscard]] virtual Result<std::vector<TokenId>> tokenize(std::string_view text) const = 0;
  /// One past the largest valid token id; token-id prompts and stop ids are checked against it.
  [[nodiscard]] virtual std::size_t vocabSize() const = 0;
};

}  // namespace pd::router
