#pragma once
/// OpenAI response bodies: whole responses, stream chunks (each framed as one server-sent
/// event) and error objects, in the exact shapes of the OpenAI API (docs/api.md). All text goes
/// through JsonWriter, so model output with invalid UTF-8 still yields valid JSON.
/// Thread rules: pure functions.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pd/router/completion_backend.h"
#include "pd/router/openai_request.h"
#include "pd/structured/tool_call_parser.h"

namespace pd::router {

/// An error as the OpenAI API reports it: {"error":{"message","type","param","code"}}.
struct ApiError {
  int status = 400;
  std::string type = "invalid_request_error";
  std::string code;  ///< empty: null
  std::string message;
  std::string param;  ///< the offending parameter (`messages[0].role`); empty: null
};

/// A 400 `invalid_request_error`. Its `param` is the parameter the message starts with, quoted
/// ("'temperature' must be ..."): request messages name the parameter that way and only ever
/// quote names the parser wrote or checked to be short identifiers, never free client text.
[[nodiscard]] ApiError invalidRequest(std::string message, std::string code = {});
[[nodiscard]] std::string errorJson(const ApiError& error);

/// What every body of one response shares.
struct ResponseShape {
  Endpoint endpoint = Endpoint::ChatCompletions;
  std::string id;
  std::int64_t created = 0;
  std::string model;
  bool include_usage = false;     ///< streams: "usage": null on chunks, then a usage chunk
  bool return_token_ids = false;  ///< add prompt_token_ids / token_ids
  bool logprobs = false;
  /// The choice a chunk is for (OpenAI `index`); each choice of an n > 1 request has its own copy.
  std::int64_t index = 0;
};

struct Usage {
  std::int64_t prompt_tokens = 0;
  std::int64_t completion_tokens = 0;
  std::int64_t cached_tokens = 0;
  /// completion_tokens_details.reasoning_tokens; negative: omitted (no reasoning parser).
  std::int64_t reasoning_tokens = -1;
};

/// A chat delta's parts besides content, when the router parses the output (chat_output.h):
/// `delta.reasoning_content` and `delta.tool_calls` (each omitted when empty).
struct ChatDeltaParts {
  std::string reasoning;
  std::vector<structured::ToolCallDelta> tool_calls;
  [[nodiscard]] bool empty() const { return reasoning.empty() && tool_calls.empty(); }
};

/// A whole chat message's parts besides content: `message.reasoning_content` (omitted when
/// empty; null when reasoning is parsed but there was none), `message.tool_calls`; with tool
/// calls an empty content is null and a Stop finish is "tool_calls".
struct ChatMessageParts {
  bool reasoning_parsed = false;
  std::string reasoning;
  std::vector<structured::ToolCall> tool_calls;
};

/// Accumulates completions-style logprobs text offsets across chunks.
struct LogprobCursor {
  std::int64_t text_offset = 0;
};

/// "data: <json>\n\n"
[[nodiscard]] std::string sseData(std::string_view json);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

/// Chat streams begin with a chunk carrying the assistant role (and, on request, the prompt ids).
[[nodiscard]] std::string chatRoleChunk(const ResponseShape& shape, const std::vector<TokenId>& prompt_ids);
/// A chunk of new text and tokens. `prompt_ids` is non-null on the first completions chunk when
/// prompt ids are to be returned.
[[nodiscard]] std::string deltaChunk(const ResponseShape& shape, std::string_view text, const std::vector<TokenId>& ids,
                                     const std::vector<LogprobEntry>& logprobs, LogprobCursor& cursor,
                                     const std::vector<TokenId>* prompt_ids);
[[nodiscard]] std::string finishChunk(const ResponseShape& shape, FinishReason reason,
                                      const std::vector<TokenId>* prompt_ids, bool tool_calls = false);
/// A chat chunk of parsed output: content (omitted when empty), reasoning and tool-call deltas.
[[nodiscard]] std::string chatPartsChunk(const ResponseShape& shape, std::string_view content,
                                         const ChatDeltaParts& parts, const std::vector<TokenId>& ids,
                                         const std::vector<LogprobEntry>& logprobs, LogprobCursor& cursor);
[[nodiscard]] std::string usageChunk(const ResponseShape& shape, const Usage& usage);
/// One choice of a whole non-streaming response.
struct ChoiceOutput {
  std::string_view text;
  const std::vector<TokenId>* ids = nullptr;
  const std::vector<LogprobEntry>* logprobs = nullptr;
  FinishReason reason = FinishReason::Stop;
  const ChatMessageParts* parts = nullptr;  ///< as fullResponse's `parts`
};
/// The whole non-streaming response of n >= 1 choices (index = position in `choices`).
[[nodiscard]] std::string fullResponseChoices(const ResponseShape& shape, const std::vector<ChoiceOutput>& choices,
                                              const Usage& usage, const std::vector<TokenId>& prompt_ids);
/// The whole non-streaming response.
[[nodiscard]] std::string fullResponse(const ResponseShape& shape, std::string_view text,
                                       const std::vector<TokenId>& ids, const std::vector<LogprobEntry>& logprobs,
                                       FinishReason reason, const Usage& usage, const std::vector<TokenId>& prompt_ids,
                                       const ChatMessageParts* parts = nullptr);

}  // namespace pd::router
