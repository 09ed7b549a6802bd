#pragma once
/// Chat template rendering: the `chat_template` of tokenizer_config.json (Jinja), rendered as
/// Hugging Face transformers' apply_chat_template does (jinja2 with trim_blocks and
/// lstrip_blocks, `bos_token` / `eos_token` / `pad_token` from the config), character for
/// character. The interpreter covers the Jinja subset DeepSeek's templates (V3, R1, V3.1 style)
/// and similar ones use; docs/tokenizer.md lists it. A template that uses anything outside the
/// subset (an unknown statement, filter, test, method or function) fails in create(), never
/// at request time.
///
/// Errors: create() returns InvalidArgument naming line:column. render() returns
/// InvalidArgument when the request data does not fit the template (messages not a JSON array,
/// a template expression failing on the data, e.g. adding a string to null, or the template's
/// own raise_exception()).
///
/// Thread rules: immutable after create(); render() is const and may run on any number of
/// threads at once. Copyable (the parsed template is shared, read-only).

#include <memory>
#include <string>
#include <string_view>

#include "pd/common/result.h"
#include "pd/tokenizer/tokenizer.h"

namespace pd::chat {

namespace jinja {
class Template;
}  // namespace jinja

/// Template variables that come from the tokenizer config.
struct SpecialTokens {
  std::string bos_token;
  std::string eos_token;
  std::string pad_token;
};

/// One rendering request. JSON texts keep this header free of a JSON library; they are parsed
/// once per render.
struct ChatRequest {
  /// JSON array of messages, OpenAI style: {"role", "content" (string or null), "tool_calls"...}.
  std::string_view messages_json;
  /// JSON array of tool definitions, or empty / "null" for none (passed as `tools`).
  std::string_view tools_json;
  bool add_generation_prompt = false;
  /// JSON object of extra template variables (e.g. {"thinking": true}), or empty.
  std::string_view extra_context_json;
};

class ChatTemplate {
 public:
  [[nodiscard]] static Result<ChatTemplate> create(std::string_view source, SpecialTokens tokens);
  /// The tokenizer's chat template with its bos/eos/pad strings. NotFound if it has none.
  [[nodiscard]] static Result<ChatTemplate> fromTokenizer(const tokenizer::Tokenizer& tokenizer);

  /// The prompt text. Encode it with add_special_tokens=false: the template writes the BOS.
  [[nodiscard]] Result<std::string> render(const ChatRequest& request) const;

 private:
  ChatTemplate(std::shared_ptr<const jinja::Template> tmpl, SpecialTokens tokens);
  std::shared_ptr<const jinja::Template> template_;
  SpecialTokens tokens_;
};

}  // namespace pd::chat
