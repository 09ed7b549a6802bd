#pragma once
/// A chat response's output split as DeepSeek models write it (docs/api.md, "Tool calls" and
/// "Reasoning"): R1's `<think>…</think>` into reasoning_content, then the model's tool-call
/// section into OpenAI tool calls, the rest content. Both parsers (pd/structured/tool_call_parser.h)
/// hold back only text that may still become a marker, so a stream split anywhere gives what the
/// whole text gives: streaming equals non-streaming by construction.
///
/// Thread rules: one object per response, used by one thread at a time.

#include <optional>
#include <string>
#include <string_view>

#include "openai_response.h"
#include "pd/structured/tool_call_parser.h"

namespace pd::router {

/// How the router reads a model's output (from --router.tool_parser / reasoning_parser and the
/// chat template).
struct OutputParsing {
  /// The tool-call format parsed out of the output; nullopt: tool calls are not parsed.
  std::optional<structured::ToolCallFormat> tool_format;
  /// Reasoning is split out of chat answers.
  bool reasoning = false;
  /// The template's generation prompt already opens `<think>` (R1).
  bool prompt_opens_think = false;
};

class ChatOutputParser {
 public:
  /// `tool_format` nullopt: no tool-call parsing (tools absent or tool_choice none);
  /// `reasoning` false: no reasoning split. Call ids are `id_prefix` + index.
  ChatOutputParser(std::optional<structured::ToolCallFormat> tool_format, bool reasoning, bool prompt_opens_think,
                   std::string id_prefix);

  struct Piece {
    std::string content;
    ChatDeltaParts parts;
    [[nodiscard]] bool empty() const { return content.empty() && parts.empty(); }
  };
  [[nodiscard]] Piece feed(std::string_view text);
  /// The output ended: what the parsers held back.
  [[nodiscard]] Piece finish();

  /// True while the text being fed is reasoning.
  [[nodiscard]] bool inReasoning() const { return reasoning_ && reasoning_->inReasoning(); }
  [[nodiscard]] bool parsesReasoning() const { return reasoning_.has_value(); }
  [[nodiscard]] bool sawToolCalls() const { return tools_ && tools_->sawToolCalls(); }

 private:
  Piece afterReasoning(std::string reasoning, std::string_view content, bool final);

  std::optional<structured::ReasoningParser> reasoning_;
  std::optional<structured::ToolCallParser> tools_;
};

}  // namespace pd::router
