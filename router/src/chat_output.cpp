#include "chat_output.h"

#include <utility>

namespace pd::router {

ChatOutputParser::ChatOutputParser(std::optional<structured::ToolCallFormat> tool_format, bool reasoning,
                                   bool prompt_opens_think, std::string id_prefix) {
  if (reasoning) reasoning_.emplace(prompt_opens_think);
  if (tool_format) tools_.emplace(*tool_format, std::move(id_prefix));
}

ChatOutputParser::Piece ChatOutputParser::afterReasoning(std::string reasoning, std::string_view content, bool final) {
  Piece piece;
  piece.parts.reasoning = std::move(reasoning);
  if (!tools_) {
    piece.content = std::string(content);
    return piece;
  }
  structured::ToolParseDelta d = tools_->feed(content);
  if (final) {
    structured::ToolParseDelta tail = tools_->finish();
    d.content += tail.content;
    for (auto& c : tail.tool_calls) d.tool_calls.push_back(std::move(c));
  }
  piece.content = std::move(d.content);
  piece.parts.tool_calls = std::move(d.tool_calls);
  return piece;
}

ChatOutputParser::Piece ChatOutputParser::feed(std::string_view text) {
  if (!reasoning_) return afterReasoning({}, text, false);
  structured::ReasoningDelta r = reasoning_->feed(text);
  return afterReasoning(std::move(r.reasoning), r.content, false);
}

ChatOutputParser::Piece ChatOutputParser::finish() {
  if (!reasoning_) return afterReasoning({}, {}, true);
  structured::ReasoningDelta r = reasoning_->finish();
  return afterReasoning(std::move(r.reasoning), r.content, true);
}

}  // namespace pd::router
