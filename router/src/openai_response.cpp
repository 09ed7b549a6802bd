#include "openai_response.h"

#include <algorithm>
#include <cctype>

#include "json_writer.h"
#include "pd/router/json_text.h"

namespace pd::router {
namespace {

bool isChat(const ResponseShape& s) {
  return s.endpoint == Endpoint::ChatCompletions;
}

/// The OpenAI finish_reason: only Stop and Length reach a response; a Stop after tool calls is
/// "tool_calls".
std::string_view openAiFinishReason(FinishReason r, bool tool_calls = false) {
  if (r == FinishReason::Length) return "length";
  return tool_calls ? "tool_calls" : "stop";
}

void writeToolCallDeltas(JsonWriter& w, const std::vector<structured::ToolCallDelta>& calls) {
  w.beginArray();
  for (const auto& c : calls) {
    w.beginObject();
    w.key("index").number(static_cast<std::int64_t>(c.index));
    if (!c.id.empty()) w.key("id").string(c.id).key("type").string("function");
    w.key("function").beginObject();
    if (!c.name.empty()) w.key("name").string(c.name);
    w.key("arguments").string(c.arguments);
    w.endObject();
    w.endObject();
  }
  w.endArray();
}

void writeCommon(JsonWriter& w, const ResponseShape& s, bool chunk) {
  w.key("id").string(s.id);
  w.key("object").string(isChat(s) ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion");
  w.key("created").number(s.created);
  w.key("model").string(s.model);
}

void writeIds(JsonWriter& w, const std::vector<TokenId>& ids) {
  w.beginArray();
  for (TokenId id : ids) w.number(static_cast<std::int64_t>(id));
  w.endArray();
}

void writeBytes(JsonWriter& w, std::string_view token) {
  w.beginArray();
  for (char c : token) w.number(static_cast<std::int64_t>(static_cast<unsigned char>(c)));
  w.endArray();
}

void writeUsage(JsonWriter& w, const Usage& u) {
  w.beginObject();
  w.key("prompt_tokens").number(u.prompt_tokens);
  w.key("completion_tokens").number(u.completion_tokens);
  w.key("total_tokens").number(u.prompt_tokens + u.completion_tokens);
  if (u.reasoning_tokens >= 0) {
    w.key("completion_tokens_details").beginObject().key("reasoning_tokens").number(u.reasoning_tokens).endObject();
  }
  if (u.cached_tokens > 0) {
    w.key("prompt_tokens_details").beginObject().key("cached_tokens").number(u.cached_tokens).endObject();
  }
  w.endObject();
}

/// Chat: {"content":[{"token","logprob","bytes","top_logprobs":[...]}]}
void writeChatLogprobs(JsonWriter& w, const std::vector<LogprobEntry>& lps) {
  w.beginObject().key("content").beginArray();
  for (const auto& lp : lps) {
    w.beginObject();
    w.key("token").string(lp.text);
    w.key("logprob").number(static_cast<double>(lp.sampled.logprob));
    w.key("bytes");
    writeBytes(w, lp.text);
    w.key("top_logprobs").beginArray();
    for (std::size_t i = 0; i < lp.sampled.top.size() && i < lp.top_text.size(); ++i) {
      w.beginObject();
      w.key("token").string(lp.top_text[i]);
      w.key("logprob").number(static_cast<double>(lp.sampled.top[i].logprob));
      w.key("bytes");
      writeBytes(w, lp.top_text[i]);
      w.endObject();
    }
    w.endArray();
    w.endObject();
  }
  w.endArray().endObject();
}

/// Completions (legacy): {"tokens","token_logprobs","top_logprobs":[{token: logprob}],"text_offset"}
void writeCompletionLogprobs(JsonWriter& w, const std::vector<LogprobEntry>& lps, LogprobCursor& cursor) {
  w.beginObject();
  w.key("tokens").beginArray();
  for (const auto& lp : lps) w.string(lp.text);
  w.endArray();
  w.key("token_logprobs").beginArray();
  for (const auto& lp : lps) w.number(static_cast<double>(lp.sampled.logprob));
  w.endArray();
  w.key("top_logprobs").beginArray();
  for (const auto& lp : lps) {
    w.beginObject();
    for (std::size_t i = 0; i < lp.sampled.top.size() && i < lp.top_text.size(); ++i) {
      w.key(lp.top_text[i]).number(static_cast<double>(lp.sampled.top[i].logprob));
    }
    w.endObject();
  }
  w.endArray();
  w.key("text_offset").beginArray();
  for (const auto& lp : lps) {
    w.number(cursor.text_offset);
    cursor.text_offset += static_cast<std::int64_t>(sanitizeUtf8(lp.text).size());
  }
  w.endArray();
  w.endObject();
}

void writeLogprobs(JsonWriter& w, const ResponseShape& s, const std::vector<LogprobEntry>& lps, LogprobCursor& cursor) {
  if (!s.logprobs) {
    w.null();
  } else if (isChat(s)) {
    writeChatLogprobs(w, lps);
  } else {
    writeCompletionLogprobs(w, lps, cursor);
  }
}

/// One streamed choice; `delta_text` null means an empty chat delta ({}).
std::string chunk(const ResponseShape& s, const std::string_view* delta_text, bool role,
                  const std::vector<TokenId>& ids, const std::vector<LogprobEntry>& lps, LogprobCursor& cursor,
                  std::optional<FinishReason> finish, const std::vector<TokenId>* prompt_ids,
                  const ChatDeltaParts* parts = nullptr, bool tool_calls_finish = false) {
  JsonWriter w;
  w.beginObject();
  writeCommon(w, s, true);
  w.key("choices").beginArray().beginObject();
  w.key("index").number(s.index);
  if (isChat(s)) {
    w.key("delta").beginObject();
    if (role) w.key("role").string("assistant");
    if (delta_text != nullptr && (parts == nullptr || !delta_text->empty())) w.key("content").string(*delta_text);
    if (parts != nullptr && !parts->reasoning.empty()) w.key("reasoning_content").string(parts->reasoning);
    if (parts != nullptr && !parts->tool_calls.empty()) {
      w.key("tool_calls");
      writeToolCallDeltas(w, parts->tool_calls);
    }
    w.endObject();
  } else {
    w.key("text").string(delta_text != nullptr ? *delta_text : std::string_view{});
  }
  w.key("logprobs");
  if (finish || role) {
    w.null();
  } else {
    writeLogprobs(w, s, lps, cursor);
  }
  w.key("finish_reason");
  if (finish) {
    w.string(openAiFinishReason(*finish, tool_calls_finish));
  } else {
    w.null();
  }
  if (s.return_token_ids) {
    if (!isChat(s) && prompt_ids != nullptr) {
      w.key("prompt_token_ids");
      writeIds(w, *prompt_ids);
    }
    if (!role) {
      w.key("token_ids");
      writeIds(w, ids);
    }
  }
  w.endObject().endArray();
  if (s.include_usage) w.key("usage").null();
  if (s.return_token_ids && isChat(s) && prompt_ids != nullptr) {
    w.key("prompt_token_ids");
    writeIds(w, *prompt_ids);
  }
  w.endObject();
  return sseData(w.take());
}

}  // namespace

ApiError invalidRequest(std::string message, std::string code) {
  std::string param;
  if (message.size() > 2 && message[0] == '\'') {
    const std::size_t end = message.find('\'', 1);
    const std::string_view name = std::string_view(message).substr(1, end == std::string::npos ? 0 : end - 1);
    const bool identifier = !name.empty() && name.size() <= 96 && std::all_of(name.begin(), name.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == '.' || c == '[' || c == ']' ||
             c == '-';
    });
    if (identifier) param = std::string(name);
  }
  return ApiError{400, "invalid_request_error", std::move(code), std::move(message), std::move(param)};
}

std::string errorJson(const ApiError& e) {
  JsonWriter w;
  w.beginObject().key("error").beginObject();
  w.key("message").string(e.message);
  w.key("type").string(e.type);
  w.key("param");
  if (e.param.empty()) {
    w.null();
  } else {
    w.string(e.param);
  }
  w.key("code");
  if (e.code.empty()) {
    w.null();
  } else {
    w.string(e.code);
  }
  w.endObject().endObject();
  return w.take();
}

std::string sseData(std::string_view json) {
  std::string out;
  out.reserve(json.size() + 8);
  out += "data: ";
  out += json;
  out += "\n\n";
  return out;
}

std::string chatRoleChunk(const ResponseShape& shape, const std::vector<TokenId>& prompt_ids) {
  LogprobCursor unused;
  const std::string_view empty;
  return chunk(shape, &empty, true, {}, {}, unused, std::nullopt, &prompt_ids);
}

std::string deltaChunk(const ResponseShape& shape, std::string_view text, const std::vector<TokenId>& ids,
                       const std::vector<LogprobEntry>& logprobs, LogprobCursor& cursor,
                       const std::vector<TokenId>* prompt_ids) {
  return chunk(shape, &text, false, ids, logprobs, cursor, std::nullopt, prompt_ids);
}

std::string finishChunk(const ResponseShape& shape, FinishReason reason, const std::vector<TokenId>* prompt_ids,
                        bool tool_calls) {
  LogprobCursor unused;
  return chunk(shape, nullptr, false, {}, {}, unused, reason, prompt_ids, nullptr, tool_calls);
}

std::string chatPartsChunk(const ResponseShape& shape, std::string_view content, const ChatDeltaParts& parts,
                           const std::vector<TokenId>& ids, const std::vector<LogprobEntry>& logprobs,
                           LogprobCursor& cursor) {
  return chunk(shape, &content, false, ids, logprobs, cursor, std::nullopt, nullptr, &parts);
}

std::string usageChunk(const ResponseShape& shape, const Usage& usage) {
  JsonWriter w;
  w.beginObject();
  writeCommon(w, shape, true);
  w.key("choices").beginArray().endArray();
  w.key("usage");
  writeUsage(w, usage);
  w.endObject();
  return sseData(w.take());
}

std::string fullResponse(const ResponseShape& shape, std::string_view text, const std::vector<TokenId>& ids,
                         const std::vector<LogprobEntry>& logprobs, FinishReason reason, const Usage& usage,
                         const std::vector<TokenId>& prompt_ids, const ChatMessageParts* parts) {
  return fullResponseChoices(shape, {ChoiceOutput{text, &ids, &logprobs, reason, parts}}, usage, prompt_ids);
}

std::string fullResponseChoices(const ResponseShape& shape, const std::vector<ChoiceOutput>& choices,
                                const Usage& usage, const std::vector<TokenId>& prompt_ids) {
  JsonWriter w;
  w.beginObject();
  writeCommon(w, shape, false);
  const std::vector<TokenId> no_ids;
  const std::vector<LogprobEntry> no_logprobs;
  w.key("choices").beginArray();
  for (std::size_t index = 0; index < choices.size(); ++index) {
    const ChoiceOutput& c = choices[index];
    const std::string_view text = c.text;
    const ChatMessageParts* parts = c.parts;
    const std::vector<TokenId>& ids = c.ids != nullptr ? *c.ids : no_ids;
    const std::vector<LogprobEntry>& logprobs = c.logprobs != nullptr ? *c.logprobs : no_logprobs;
    LogprobCursor cursor;
    const bool tool_calls = parts != nullptr && !parts->tool_calls.empty();
    w.beginObject();
    w.key("index").number(static_cast<std::int64_t>(index));
    if (isChat(shape)) {
      w.key("message").beginObject().key("role").string("assistant").key("content");
      if (tool_calls && text.empty()) {
        w.null();
      } else {
        w.string(text);
      }
      if (parts != nullptr && parts->reasoning_parsed) {
        w.key("reasoning_content");
        if (parts->reasoning.empty()) {
          w.null();
        } else {
          w.string(parts->reasoning);
        }
      }
      if (tool_calls) {
        w.key("tool_calls").beginArray();
        for (const auto& call : parts->tool_calls) {
          w.beginObject().key("id").string(call.id).key("type").string("function");
          w.key("function")
              .beginObject()
              .key("name")
              .string(call.name)
              .key("arguments")
              .string(call.arguments)
              .endObject();
          w.endObject();
        }
        w.endArray();
      }
      w.endObject();
    } else {
      w.key("text").string(text);
    }
    w.key("logprobs");
    writeLogprobs(w, shape, logprobs, cursor);
    w.key("finish_reason").string(openAiFinishReason(c.reason, tool_calls));
    if (shape.return_token_ids) {
      if (!isChat(shape)) {
        w.key("prompt_token_ids");
        writeIds(w, prompt_ids);
      }
      w.key("token_ids");
      writeIds(w, ids);
    }
    w.endObject();
  }
  w.endArray();
  w.key("usage");
  writeUsage(w, usage);
  if (shape.return_token_ids && isChat(shape)) {
    w.key("prompt_token_ids");
    writeIds(w, prompt_ids);
  }
  w.endObject();
  return w.take();
}

}  // namespace pd::router
