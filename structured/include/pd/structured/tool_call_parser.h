#pragma once
/// Streaming parsers of a DeepSeek model's output text: tool calls in the DeepSeek-V3 and V3.1
/// formats (their chat templates' `<｜tool▁calls▁begin｜>` sections) turned into OpenAI tool calls,
/// and R1's `<think>…</think>` split into reasoning and content (docs/structured-outputs.md).
///
/// Both are pure text machines fed the detokenized output piece by piece; every piece returns what
/// became certain (text that could still be the start of a marker is held back until the next
/// piece or finish()). Feeding a text in any split gives, concatenated, exactly what feeding it
/// whole gives: streaming equals non-streaming by construction, and the tests check every split.
///
/// Formats (the markers are added, non-special tokens of the DeepSeek tokenizers, so they reach the
/// detokenized text even with skip_special_tokens):
///   V3:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>
///         [\n<｜tool▁call▁begin｜>…<｜tool▁call▁end｜>]…<｜tool▁calls▁end｜>
///   V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>
/// Text before the section is content; text after it is content too. Text between calls that is
/// not a marker (other than whitespace) is content. ARGS is passed through as the model wrote it
/// (constrained decoding is what makes it valid JSON).
///
/// Thread rules: a parser belongs to one response stream and is used by one thread at a time.

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pd::structured {

enum class ToolCallFormat { DeepSeekV3, DeepSeekV31 };

/// "deepseek_v3" / "deepseek_v31".
[[nodiscard]] std::string_view toolCallFormatName(ToolCallFormat format);
/// The format a chat template renders tool calls in, or nullopt when it renders none.
[[nodiscard]] std::optional<ToolCallFormat> detectToolCallFormat(std::string_view chat_template);

/// One streamed piece of a tool call, as OpenAI's `delta.tool_calls[]`: the first piece of a call
/// carries its id and name (and possibly arguments), later pieces only argument text.
struct ToolCallDelta {
  std::size_t index = 0;  ///< the call's position in the response (0, 1, ...)
  std::string id;         ///< non-empty on the first piece only
  std::string name;       ///< non-empty on the first piece only
  std::string arguments;  ///< the next part of the JSON arguments text
  friend bool operator==(const ToolCallDelta&, const ToolCallDelta&) = default;
};

/// What one feed() or finish() made certain.
struct ToolParseDelta {
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
  [[nodiscard]] bool empty() const { return content.empty() && tool_calls.empty(); }
};

/// A whole tool call, as OpenAI's `message.tool_calls[]`.
struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;
  friend bool operator==(const ToolCall&, const ToolCall&) = default;
};

/// Deltas added up: the non-streaming response.
struct ToolParseResult {
  std::string content;
  std::vector<ToolCall> tool_calls;
  void add(const ToolParseDelta& delta);
  friend bool operator==(const ToolParseResult&, const ToolParseResult&) = default;
};

class ToolCallParser {
 public:
  /// Call ids are `id_prefix` + the call's index (give each response a unique prefix, e.g.
  /// "call_<request id>_").
  ToolCallParser(ToolCallFormat format, std::string id_prefix);

  /// Takes the next piece of output text.
  [[nodiscard]] ToolParseDelta feed(std::string_view text);
  /// The output ended: releases held-back text (a call cut off inside its name is dropped; one cut
  /// off inside its arguments keeps the arguments seen).
  [[nodiscard]] ToolParseDelta finish();
  /// Whether a tool-call section started (the finish_reason becomes "tool_calls").
  [[nodiscard]] bool sawToolCalls() const { return calls_ > 0; }

  /// feed(text) + finish() on a fresh parser, added up.
  [[nodiscard]] static ToolParseResult parseAll(ToolCallFormat format, std::string id_prefix, std::string_view text);

 private:
  enum class State { Content, BetweenCalls, Type, Name, Fence, Arguments, AfterCalls };
  ToolParseDelta drain(bool final);

  ToolCallFormat format_;
  std::string id_prefix_;
  State state_ = State::Content;
  std::string pending_;  // text received and not yet consumed
  std::size_t calls_ = 0;
};

/// DeepSeek-R1 reasoning: `<think>` opens it (in the output, or already in the prompt as the R1
/// template does), `</think>` closes it; newlines right after `</think>` are dropped. Without
/// `</think>` everything after `<think>` is reasoning; output that does not start with `<think>`
/// (leading whitespace aside) when the prompt did not open it is all content.
struct ReasoningDelta {
  std::string reasoning;
  std::string content;
};

class ReasoningParser {
 public:
  /// `prompt_opened` = the rendered prompt ends inside `<think>` (detectReasoning()).
  explicit ReasoningParser(bool prompt_opened);
  [[nodiscard]] ReasoningDelta feed(std::string_view text);
  [[nodiscard]] ReasoningDelta finish();
  /// True while the text being fed is reasoning (count its tokens as reasoning_tokens).
  [[nodiscard]] bool inReasoning() const { return state_ == State::Reasoning; }

  [[nodiscard]] static ReasoningDelta parseAll(bool prompt_opened, std::string_view text);

 private:
  enum class State { Start, Reasoning, ContentStart, Content };
  ReasoningDelta drain(bool final);

  State state_;
  std::string pending_;
};

/// How a chat template uses `<think>`: whether it has a reasoning section at all, and whether the
/// generation prompt already opens it (R1's `<｜Assistant｜><think>\n`).
struct ReasoningStyle {
  bool uses_think = false;
  bool prompt_opens_think = false;
};
[[nodiscard]] ReasoningStyle detectReasoning(std::string_view chat_template);

}  // namespace pd::structured
