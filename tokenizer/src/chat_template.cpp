#include "pd/tokenizer/chat_template.h"

#include <boost/json.hpp>

#include "jinja.h"

namespace pd::chat {
namespace {

Result<boost::json::value> parseRequestJson(std::string_view text, std::string_view what) {
  boost::system::error_code ec;
  boost::json::value v = boost::json::parse(text, ec);
  if (ec) return makeError(ErrorCode::InvalidArgument, std::string(what) + " is not valid JSON: " + ec.message());
  return v;
}

}  // namespace

ChatTemplate::ChatTemplate(std::shared_ptr<const jinja::Template> tmpl, SpecialTokens tokens)
    : template_(std::move(tmpl)), tokens_(std::move(tokens)) {}

Result<ChatTemplate> ChatTemplate::create(std::string_view source, SpecialTokens tokens) {
  PD_ASSIGN_OR_RETURN(auto parsed, jinja::Template::parse(source));
  return ChatTemplate(std::make_shared<const jinja::Template>(std::move(parsed)), std::move(tokens));
}

Result<ChatTemplate> ChatTemplate::fromTokenizer(const tokenizer::Tokenizer& tokenizer) {
  if (tokenizer.chatTemplateSource().empty()) {
    return makeError(ErrorCode::NotFound, "tokenizer_config.json has no chat_template");
  }
  return create(tokenizer.chatTemplateSource(),
                SpecialTokens{tokenizer.bosToken(), tokenizer.eosToken(), tokenizer.padToken()});
}

Result<std::string> ChatTemplate::render(const ChatRequest& request) const {
  auto context = std::make_shared<jinja::ValueDict>();
  PD_ASSIGN_OR_RETURN(auto messages, parseRequestJson(request.messages_json, "messages"));
  if (!messages.is_array()) return makeError(ErrorCode::InvalidArgument, "messages must be a JSON array");
  context->set("messages", jinja::fromJson(messages));
  jinja::Value tools = jinja::Value::none();
  if (!request.tools_json.empty()) {
    PD_ASSIGN_OR_RETURN(auto tools_json, parseRequestJson(request.tools_json, "tools"));
    if (!tools_json.is_array() && !tools_json.is_null()) {
      return makeError(ErrorCode::InvalidArgument, "tools must be a JSON array or null");
    }
    tools = jinja::fromJson(tools_json);
  }
  context->set("tools", std::move(tools));
  context->set("add_generation_prompt", jinja::Value::boolean(request.add_generation_prompt));
  context->set("bos_token", jinja::Value::string(tokens_.bos_token));
  context->set("eos_token", jinja::Value::string(tokens_.eos_token));
  context->set("pad_token", jinja::Value::string(tokens_.pad_token));
  if (!request.extra_context_json.empty()) {
    PD_ASSIGN_OR_RETURN(auto extra, parseRequestJson(request.extra_context_json, "extra context"));
    if (!extra.is_object()) return makeError(ErrorCode::InvalidArgument, "extra context must be a JSON object");
    for (const auto& kv : extra.as_object()) context->set(std::string(kv.key()), jinja::fromJson(kv.value()));
  }
  return template_->render(jinja::Value::dict(std::move(context)));
}

}  // namespace pd::chat
