#pragma once
/// Parsing and validation of OpenAI request bodies for POST /v1/chat/completions and
/// POST /v1/completions (docs/api.md lists every parameter and rule).
///
/// The body must be valid UTF-8 without lone surrogate escapes, a JSON object, and each known
/// parameter must have the right type and range. Every top-level parameter is either honoured or
/// refused: a parameter the endpoint does not know (and one of `stream_options`) is a 400 naming
/// it, and known features this server does not offer (echo, suffix, best_of, legacy
/// `functions`, non-text response formats and modalities, stored completions, non-text content
/// parts) are refused unless given their neutral value (docs/api.md has the table). Each message's
/// fields are checked against its role the same way: passed to the chat template (`name`,
/// `reasoning_content`, `tool_calls`, ...) or a 400 naming the message index and the field. `tools`,
/// `tool_choice`, `parallel_tool_calls` and `response_format` become the output constraint
/// (pd/structured/response_constraint.h) and the chat template's tools.
///
/// Errors: InvalidArgument with a message for the client that names the parameter but never
/// repeats the client's text (an unknown parameter's name is repeated only when it is a short
/// identifier). Checks that need the model (name, context length, vocabulary) happen later, in
/// the API server.
///
/// Thread rules: pure functions.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/result.h"
#include "pd/router/completion_backend.h"
#include "pd/router/prompt_renderer.h"
#include "pd/structured/response_constraint.h"

namespace pd::router {

enum class Endpoint { ChatCompletions, Completions };

/// Largest `top_logprobs` (chat) / `logprobs` (completions) accepted.
inline constexpr int kMaxTopLogprobs = 20;
/// Most stop strings / stop token ids accepted.
inline constexpr std::size_t kMaxStopSequences = 16;

struct CompletionParams {
  Endpoint endpoint = Endpoint::ChatCompletions;
  std::string model;
  ChatConversation conversation;  ///< chat only
  /// completions only: exactly one of the two is set.
  std::optional<std::string> prompt_text;
  std::optional<std::vector<TokenId>> prompt_token_ids;
  /// max_completion_tokens if given, else max_tokens; unset: the endpoint's default.
  std::optional<std::int64_t> max_tokens;
  /// sampling.top_logprobs: alternatives per token when logprobs is on; sampling.seed unused.
  SamplingParams sampling = openAiSamplingDefaults();
  std::optional<std::int64_t> seed;
  /// OpenAI `n`: choices to generate (1..pd::kMaxChoices; the API server applies router.max_n).
  std::int64_t n = 1;
  std::vector<std::string> stop;
  std::vector<TokenId> stop_token_ids;
  bool ignore_eos = false;
  bool skip_special_tokens = true;          ///< extension (vLLM): drop special tokens from the text
  bool include_stop_str_in_output = false;  ///< extension (vLLM): the matched stop string ends the text
  bool stream = false;
  bool include_usage = false;  ///< stream_options.include_usage
  bool logprobs = false;
  bool return_token_ids = false;
  /// `user` and `safety_identifier`: who the end user is, logged with the request id (nothing
  /// else uses them); each at most kMaxUserBytes.
  std::string user;
  std::string safety_identifier;
  /// `response_format` json_object / json_schema, or `tool_choice` "required" / a named function:
  /// what the workers constrain the output to (Kind::None: free text). Compiled by the API server.
  structured::ResponseConstraint constraint;
  /// chat: `tools` were given and `tool_choice` is not "none": the output is parsed for tool calls.
  bool parse_tool_calls = false;
};

/// Longest `user` / `safety_identifier` accepted (bytes).
inline constexpr std::size_t kMaxUserBytes = 256;

/// Parses a request body for `endpoint`.
[[nodiscard]] Result<CompletionParams> parseCompletionRequest(Endpoint endpoint, std::string_view body);

}  // namespace pd::router
