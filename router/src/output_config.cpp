// configureOutput (api_server.h): the router's output constraints and parsers from its config and
// the model's tokenizer.
#include "pd/common/log.h"
#include "pd/router/api_server.h"
#include "pd/structured/worker_grammars.h"

namespace pd::router {

Status configureOutput(ApiServerOptions& options, const RouterConfig& config, const tokenizer::Tokenizer& tokenizer,
                       std::size_t model_vocab_size) {
  const std::string& chat_template = tokenizer.chatTemplateSource();
  if (config.tool_parser == "auto") {
    options.tool_parser = structured::detectToolCallFormat(chat_template);
  } else if (config.tool_parser == "none") {
    options.tool_parser.reset();
  } else {
    options.tool_parser = structured::parseToolCallFormat(config.tool_parser);
    if (!options.tool_parser) {
      return makeError(ErrorCode::InvalidArgument,
                       "router.tool_parser must be auto, deepseek_v3, deepseek_v31 or none");
    }
  }
  const structured::ReasoningStyle style = structured::detectReasoning(chat_template);
  if (config.reasoning_parser == "auto") {
    options.reasoning_parser = style.uses_think;
  } else if (config.reasoning_parser == "deepseek_r1") {
    options.reasoning_parser = true;
  } else if (config.reasoning_parser == "none") {
    options.reasoning_parser = false;
  } else {
    return makeError(ErrorCode::InvalidArgument, "router.reasoning_parser must be auto, deepseek_r1 or none");
  }
  options.prompt_opens_think = options.reasoning_parser && style.prompt_opens_think;

  auto vocabulary = structured::TokenVocabulary::fromTokenizer(tokenizer, model_vocab_size);
  if (!vocabulary.ok()) {
    log::warn("router", "response_format and tool_choice required / named are off: {}", vocabulary.error().toString());
    options.grammars.reset();
  } else {
    options.grammars = std::make_shared<structured::GrammarCache>(
        std::move(vocabulary).value(), options.tool_parser.value_or(structured::ToolCallFormat::DeepSeekV3),
        structured::servingGrammarOptions(), 64);
  }
  log::info("router", "tool parser {}, reasoning parser {}{}",
            options.tool_parser ? structured::toolCallFormatName(*options.tool_parser) : "none",
            options.reasoning_parser ? "deepseek_r1" : "none",
            options.prompt_opens_think ? " (the prompt opens <think>)" : "");
  return okStatus();
}

}  // namespace pd::router
