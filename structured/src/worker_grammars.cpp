#include "pd/structured/worker_grammars.h"

#include "pd/tokenizer/tokenizer.h"

namespace pd::structured {

GrammarOptions servingGrammarOptions() {
  GrammarOptions o;
  o.max_whitespace = 2;
  o.unbounded_string_chars = 0;
  return o;
}

std::optional<ToolCallFormat> parseToolCallFormat(std::string_view name) {
  if (name.empty() || name == toolCallFormatName(ToolCallFormat::DeepSeekV3)) return ToolCallFormat::DeepSeekV3;
  if (name == toolCallFormatName(ToolCallFormat::DeepSeekV31)) return ToolCallFormat::DeepSeekV31;
  return std::nullopt;
}

Result<std::shared_ptr<const WorkerGrammars>> WorkerGrammars::load(const std::filesystem::path& tokenizer_dir,
                                                                   std::size_t model_vocab_size,
                                                                   std::size_t cache_capacity) {
  PD_ASSIGN_OR_RETURN(auto tokenizer, tokenizer::Tokenizer::load(tokenizer_dir));
  PD_ASSIGN_OR_RETURN(auto vocabulary, TokenVocabulary::fromTokenizer(tokenizer, model_vocab_size));
  return std::make_shared<const WorkerGrammars>(std::move(vocabulary), cache_capacity);
}

WorkerGrammars::WorkerGrammars(std::shared_ptr<const TokenVocabulary> vocabulary, std::size_t cache_capacity)
    : vocabulary_(std::move(vocabulary)),
      v3_(vocabulary_, ToolCallFormat::DeepSeekV3, servingGrammarOptions(), cache_capacity),
      v31_(vocabulary_, ToolCallFormat::DeepSeekV31, servingGrammarOptions(), cache_capacity) {}

Result<std::shared_ptr<const Grammar>> WorkerGrammars::compile(std::string_view constraint_json,
                                                               std::string_view tool_call_format) const {
  if (constraint_json.empty()) return std::shared_ptr<const Grammar>();
  const std::optional<ToolCallFormat> format = parseToolCallFormat(tool_call_format);
  if (!format) return makeError(ErrorCode::InvalidArgument, "tool_call_format must be deepseek_v3 or deepseek_v31");
  PD_ASSIGN_OR_RETURN(ResponseConstraint constraint, decodeConstraint(constraint_json));
  if (!constraint.constrained()) return std::shared_ptr<const Grammar>();
  return (*format == ToolCallFormat::DeepSeekV31 ? v31_ : v3_).get(constraint);
}

Result<std::shared_ptr<const Grammar>> requestGrammar(const WorkerGrammars* grammars, std::string_view constraint_json,
                                                      std::string_view tool_call_format) {
  if (constraint_json.empty()) return std::shared_ptr<const Grammar>();
  if (grammars == nullptr) {
    return makeError(ErrorCode::Unsupported,
                     "this worker has no tokenizer vocabulary: it cannot honour response_format or tool_choice");
  }
  return grammars->compile(constraint_json, tool_call_format);
}

}  // namespace pd::structured
