#include "pd/router/openai_request.h"

#include <fmt/format.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cmath>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <utility>

#include "pd/common/choices.h"
#include "pd/router/json_text.h"

namespace pd::router {
namespace {

namespace json = boost::json;

constexpr std::size_t kMaxJsonDepth = 64;
constexpr std::size_t kMaxStopTokenIds = 1024;

Error bad(std::string message) {
  return makeError(ErrorCode::InvalidArgument, std::move(message));
}

/// The value of a parameter, or nullptr when absent or null (null means "use the default").
const json::value* field(const json::object& o, std::string_view name) {
  const auto it = o.find(name);
  if (it == o.end() || it->value().is_null()) return nullptr;
  return &it->value();
}

Result<std::optional<bool>> getBool(const json::object& o, std::string_view name) {
  const json::value* v = field(o, name);
  if (v == nullptr) return std::optional<bool>{};
  if (!v->is_bool()) return bad(fmt::format("'{}' must be a boolean", name));
  return std::optional<bool>{v->get_bool()};
}

Result<std::optional<double>> getNumber(const json::object& o, std::string_view name, double lo, double hi,
                                        bool lo_open = false) {
  const json::value* v = field(o, name);
  if (v == nullptr) return std::optional<double>{};
  double d = 0.0;
  if (v->is_double()) {
    d = v->get_double();
  } else if (v->is_int64()) {
    d = static_cast<double>(v->get_int64());
  } else if (v->is_uint64()) {
    d = static_cast<double>(v->get_uint64());
  } else {
    return bad(fmt::format("'{}' must be a number", name));
  }
  if (!std::isfinite(d) || d > hi || d < lo || (lo_open && d == lo)) {
    return bad(fmt::format("'{}' must be {} {} and {}", name, lo_open ? "greater than" : "between", lo,
                           lo_open ? fmt::format("at most {}", hi) : fmt::format("{}", hi)));
  }
  return std::optional<double>{d};
}

/// An integer; a float with an integral value (16.0) is accepted as that integer.
Result<std::optional<std::int64_t>> getInt(const json::object& o, std::string_view name, std::int64_t lo,
                                           std::int64_t hi) {
  const json::value* v = field(o, name);
  if (v == nullptr) return std::optional<std::int64_t>{};
  std::int64_t n = 0;
  bool in_range = true;
  bool too_large = false;  // meaningful when !in_range
  if (v->is_int64()) {
    n = v->get_int64();
  } else if (v->is_uint64()) {
    in_range = false;  // above INT64_MAX
    too_large = true;
  } else if (v->is_double() && std::trunc(v->get_double()) == v->get_double() && std::isfinite(v->get_double())) {
    const double d = v->get_double();
    in_range = d >= -9.2e18 && d <= 9.2e18;
    too_large = d > 0;
    if (in_range) n = static_cast<std::int64_t>(d);
  } else {
    return bad(fmt::format("'{}' must be an integer", name));
  }
  if (!in_range || n < lo || n > hi) {
    if (hi == std::numeric_limits<std::int64_t>::max()) {
      if (lo == std::numeric_limits<std::int64_t>::min())
        return bad(fmt::format("'{}' must be a 64-bit integer", name));
      if (!in_range && too_large) return bad(fmt::format("'{}' is too large (at most {})", name, hi));
      return bad(fmt::format("'{}' must be at least {}", name, lo));
    }
    return bad(fmt::format("'{}' must be an integer between {} and {}", name, lo, hi));
  }
  return std::optional<std::int64_t>{n};
}

Result<std::optional<std::string>> getString(const json::object& o, std::string_view name) {
  const json::value* v = field(o, name);
  if (v == nullptr) return std::optional<std::string>{};
  if (!v->is_string()) return bad(fmt::format("'{}' must be a string", name));
  return std::optional<std::string>{std::string(v->get_string())};
}

Result<TokenId> tokenIdOf(const json::value& v, std::string_view name) {
  if (v.is_int64() && v.get_int64() >= 0 && v.get_int64() <= std::numeric_limits<TokenId>::max()) {
    return static_cast<TokenId>(v.get_int64());
  }
  if (v.is_int64() && v.get_int64() >= 0) {
    return bad(fmt::format("'{}' contains a token id outside the vocabulary", name));
  }
  if (v.is_uint64()) return bad(fmt::format("'{}' contains a token id outside the vocabulary", name));
  return bad(fmt::format("'{}' must contain only non-negative integer token ids", name));
}

Result<std::vector<TokenId>> tokenIds(const json::array& a, std::string_view name) {
  std::vector<TokenId> ids;
  ids.reserve(a.size());
  for (const auto& v : a) {
    PD_ASSIGN_OR_RETURN(TokenId id, tokenIdOf(v, name));
    ids.push_back(id);
  }
  return ids;
}

/// Every top-level parameter an endpoint knows (docs/api.md lists what each does). Anything else
/// is refused: a client that sends a parameter expects it to act, so ignoring it would be a
/// silent wrong answer. An unknown parameter set to null asks for nothing (null means "not
/// set", as for known ones: clients that serialize every field of their model send those).
struct KnownParameter {
  std::string_view name;
  bool chat;
  bool completions;
};
constexpr KnownParameter kKnownParameters[] = {
    // Both endpoints.
    {"model", true, true},
    {"max_tokens", true, true},
    {"max_completion_tokens", true, true},
    {"temperature", true, true},
    {"top_p", true, true},
    {"top_k", true, true},
    {"min_p", true, true},
    {"seed", true, true},
    {"stop", true, true},
    {"stop_token_ids", true, true},
    {"presence_penalty", true, true},
    {"frequency_penalty", true, true},
    {"logit_bias", true, true},
    {"logprobs", true, true},
    {"n", true, true},
    {"stream", true, true},
    {"stream_options", true, true},
    {"user", true, true},
    {"ignore_eos", true, true},
    {"skip_special_tokens", true, true},
    {"include_stop_str_in_output", true, true},
    {"return_token_ids", true, true},
    // Chat only.
    {"messages", true, false},
    {"top_logprobs", true, false},
    {"chat_template_kwargs", true, false},
    {"tools", true, true},
    {"tool_choice", true, true},
    {"parallel_tool_calls", true, true},
    {"functions", true, false},
    {"function_call", true, false},
    {"response_format", true, true},
    {"store", true, false},
    {"metadata", true, false},
    {"service_tier", true, false},
    {"modalities", true, false},
    {"safety_identifier", true, false},
    // Completions only.
    {"prompt", false, true},
    {"best_of", false, true},
    {"echo", false, true},
    {"suffix", false, true},
};

/// A parameter name fit to repeat in an error message: a short identifier, never free text.
bool printableName(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (const char c : name) {
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
          c == '.')) {
      return false;
    }
  }
  return true;
}

Status refuseUnknown(const json::object& o, Endpoint endpoint) {
  for (const auto& kv : o) {
    const std::string_view name = kv.key();
    if (kv.value().is_null()) continue;
    bool known = false;
    for (const auto& k : kKnownParameters) {
      if (k.name == name) known = endpoint == Endpoint::ChatCompletions ? k.chat : k.completions;
    }
    if (known) continue;
    const std::string_view path = endpoint == Endpoint::ChatCompletions ? "/v1/chat/completions" : "/v1/completions";
    if (!printableName(name)) return bad(fmt::format("the request has a parameter that {} does not know", path));
    return bad(fmt::format("'{}' is not a parameter {} supports", name, path));
  }
  return okStatus();
}

/// The service features OpenAI has and this server does not: accepted at their neutral value only.
Status refuseUnsupportedService(const json::object& o, Endpoint endpoint) {
  if (endpoint != Endpoint::ChatCompletions) return okStatus();
  if (const auto* v = field(o, "parallel_tool_calls"); v != nullptr && !v->is_bool()) {
    return bad("'parallel_tool_calls' must be a boolean");
  }
  if (const auto* v = field(o, "function_call")) {
    if (!v->is_string() || (v->get_string() != "none" && v->get_string() != "auto")) {
      return bad("'function_call' is not supported (legacy function calling): use 'tools' and 'tool_choice'");
    }
  }
  if (const auto* v = field(o, "store")) {
    if (!v->is_bool()) return bad("'store' must be a boolean");
    if (v->get_bool()) return bad("'store' is not supported: completions are not stored");
  }
  if (const auto* v = field(o, "metadata")) {
    if (!v->is_object()) return bad("'metadata' must be an object");
    if (!v->get_object().empty()) return bad("'metadata' is not supported: completions are not stored");
  }
  if (const auto* v = field(o, "service_tier")) {
    if (!v->is_string() || (v->get_string() != "auto" && v->get_string() != "default")) {
      return bad("'service_tier' must be \"auto\" or \"default\": this server has one tier");
    }
  }
  if (const auto* v = field(o, "modalities")) {
    if (!v->is_array()) return bad("'modalities' must be an array");
    for (const auto& m : v->get_array()) {
      if (!m.is_string() || m.get_string() != "text") return bad("'modalities' other than \"text\" are not supported");
    }
  }
  return okStatus();
}

/// Refuses a known OpenAI feature this server does not offer, when the client actually uses it.
Status refuseUnsupported(const json::object& o, Endpoint endpoint) {
  if (const auto* v = field(o, "best_of")) {
    if (!v->is_int64() || v->get_int64() != 1) return bad("'best_of' must be 1: it is not supported");
  }
  if (const auto* v = field(o, "echo")) {
    if (!v->is_bool()) return bad("'echo' must be a boolean");
    if (v->get_bool()) return bad("'echo' is not supported");
  }
  if (const auto* v = field(o, "suffix")) {
    if (!v->is_string()) return bad("'suffix' must be a string");
    if (!v->get_string().empty()) return bad("'suffix' is not supported");
  }
  if (const auto* v = field(o, "functions")) {
    if (!v->is_array()) return bad("'functions' must be an array");
    if (!v->get_array().empty()) return bad("'functions' (legacy function calling) is not supported: use 'tools'");
  }
  if (endpoint == Endpoint::Completions) {
    for (std::string_view name : {"tools", "tool_choice", "parallel_tool_calls"}) {
      if (field(o, name) != nullptr) return bad(fmt::format("'{}' is only accepted by /v1/chat/completions", name));
    }
  }
  return refuseUnsupportedService(o, endpoint);
}

/// `response_format`, `tools`, `tool_choice` and `parallel_tool_calls` (docs/api.md): the output
/// constraint, the tools the chat template renders, and whether tool calls are parsed.
Status parseOutputControls(const json::object& o, CompletionParams& p) {
  PD_ASSIGN_OR_RETURN(auto parallel, getBool(o, "parallel_tool_calls"));
  const json::value* tools = field(o, "tools");
  const json::value* tool_choice = field(o, "tool_choice");
  PD_ASSIGN_OR_RETURN(structured::ResponseConstraint from_tools,
                      structured::toolChoiceConstraint(tools, tool_choice, parallel.value_or(true)));
  PD_ASSIGN_OR_RETURN(structured::ResponseConstraint from_format,
                      structured::responseFormatConstraint(field(o, "response_format")));
  if (from_tools.constrained() && from_format.constrained()) {
    return bad("'response_format' cannot be combined with a 'tool_choice' that requires a tool call");
  }
  p.constraint = from_tools.constrained() ? std::move(from_tools) : std::move(from_format);
  const bool none = tool_choice != nullptr && tool_choice->is_string() && tool_choice->get_string() == "none";
  if (tools != nullptr && !tools->get_array().empty() && !none) {
    p.parse_tool_calls = true;
    p.conversation.tools_json = json::serialize(*tools);
  }
  return okStatus();
}

// Role bits: where a message field is accepted.
constexpr unsigned kSystem = 1U << 0U;  // system and developer
constexpr unsigned kUser = 1U << 1U;
constexpr unsigned kAssistant = 1U << 2U;
constexpr unsigned kTool = 1U << 3U;
constexpr unsigned kAnyRole = kSystem | kUser | kAssistant | kTool;

/// The fields a chat message may carry, by role (docs/api.md "Messages"). Everything else in a
/// message is refused by name: a client that sends a field expects it to act.
struct MessageField {
  std::string_view name;
  unsigned roles;          // where it is accepted
  std::string_view where;  // for the refusal when sent on another role
};
constexpr MessageField kMessageFields[] = {
    {"role", kAnyRole, ""},
    {"content", kAnyRole, ""},
    {"name", kAnyRole, ""},
    {"tool_calls", kAssistant, "assistant"},
    {"reasoning_content", kAssistant, "assistant"},
    {"reasoning", kAssistant, "assistant"},
    {"refusal", kAssistant, "assistant"},
    {"tool_call_id", kTool, "tool"},
};

/// OpenAI message fields this server knows but does not offer: refused with the reason.
struct RefusedMessageField {
  std::string_view name;
  std::string_view why;
};
constexpr RefusedMessageField kRefusedMessageFields[] = {
    {"function_call", "(legacy function calling) is not supported: use 'tool_calls'"},
    {"audio", "is not supported: this server reads and writes text only"},
};

unsigned roleBit(std::string_view role) {
  if (role == "system" || role == "developer") return kSystem;
  if (role == "user") return kUser;
  if (role == "assistant") return kAssistant;
  return kTool;
}

Status checkMessageFields(const json::object& m, std::string_view role, std::size_t i) {
  const unsigned bit = roleBit(role);
  for (const auto& kv : m) {
    if (kv.value().is_null()) continue;  // null means "not set", as for top-level parameters
    const std::string_view name = kv.key();
    bool known = false;
    for (const auto& f : kMessageFields) {
      if (f.name != name) continue;
      known = true;
      if ((f.roles & bit) == 0) {
        return bad(fmt::format("'messages[{}].{}' is only allowed on {} messages", i, name, f.where));
      }
    }
    if (known) continue;
    for (const auto& f : kRefusedMessageFields) {
      if (f.name == name) return bad(fmt::format("'messages[{}].{}' {}", i, name, f.why));
    }
    if (!printableName(name)) return bad(fmt::format("'messages[{}]' has a field that messages do not have", i));
    return bad(fmt::format("'messages[{}].{}' is not a field of a {} message", i, name, role));
  }
  return okStatus();
}

/// Refuses any field of `o` (a part, a tool call) outside `allowed`, naming it under `where`.
Status checkObjectFields(const json::object& o, std::initializer_list<std::string_view> allowed,
                         const std::string& where, std::string_view what) {
  for (const auto& kv : o) {
    if (kv.value().is_null()) continue;
    if (std::find(allowed.begin(), allowed.end(), kv.key()) != allowed.end()) continue;
    if (!printableName(kv.key())) return bad(fmt::format("'{}' has a field that {} do not have", where, what));
    return bad(fmt::format("'{}.{}' is not a field of {}", where, std::string_view(kv.key()), what));
  }
  return okStatus();
}

/// A string-valued optional message field.
Result<std::optional<std::string>> messageString(const json::object& m, std::string_view name, std::size_t i) {
  const json::value* v = field(m, name);
  if (v == nullptr) return std::optional<std::string>{};
  if (!v->is_string()) return bad(fmt::format("'messages[{}].{}' must be a string", i, name));
  return std::optional<std::string>{std::string(v->get_string())};
}

/// An assistant message's `tool_calls` as the chat templates read them:
/// [{"id", "type": "function", "function": {"name", "arguments": "<JSON text>"}}].
Result<json::array> normalizeToolCalls(const json::value& calls, std::size_t i) {
  if (!calls.is_array()) return bad(fmt::format("'messages[{}].tool_calls' must be an array", i));
  json::array out;
  for (std::size_t k = 0; k < calls.get_array().size(); ++k) {
    const std::string where = fmt::format("messages[{}].tool_calls[{}]", i, k);
    const json::object* call = calls.get_array()[k].if_object();
    if (call == nullptr) return bad("'" + where + "' must be an object");
    PD_TRY(checkObjectFields(*call, {"id", "type", "function"}, where, "a tool call"));
    const json::value* type = field(*call, "type");
    if (type != nullptr && (!type->is_string() || type->get_string() != "function")) {
      return bad("'" + where + ".type' must be 'function'");
    }
    const json::value* fn = field(*call, "function");
    if (fn == nullptr || !fn->is_object()) return bad("'" + where + ".function' must be an object");
    PD_TRY(checkObjectFields(fn->get_object(), {"name", "arguments"}, where + ".function", "a tool call's function"));
    const json::value* name = field(fn->get_object(), "name");
    if (name == nullptr || !name->is_string() || name->get_string().empty()) {
      return bad("'" + where + ".function.name' must be a non-empty string");
    }
    const json::value* args = field(fn->get_object(), "arguments");
    if (args != nullptr && !args->is_string()) return bad("'" + where + ".function.arguments' must be a string");
    const json::value* id = field(*call, "id");
    if (id != nullptr && !id->is_string()) return bad("'" + where + ".id' must be a string");
    out.push_back(json::object{
        {"id", id != nullptr ? json::value(id->get_string()) : json::value(fmt::format("call_{}", k))},
        {"type", "function"},
        {"function", json::object{{"name", name->get_string()},
                                  {"arguments", args != nullptr ? args->get_string() : json::string("{}")}}}});
  }
  return out;
}

/// Content part types OpenAI and vLLM define that this text-only server refuses by name.
constexpr std::string_view kMediaPartTypes[] = {"image_url", "input_image", "image",      "image_embeds", "input_audio",
                                                "audio_url", "video_url",   "input_file", "file"};

/// A message's content as one string: a string, or parts joined with "\n" (text parts; an
/// assistant's refusal parts are text too, as vLLM renders them). nullopt: absent or null.
Result<std::optional<std::string>> messageContent(const json::object& m, std::string_view role, std::size_t i) {
  const json::value* content = field(m, "content");
  if (content == nullptr) return std::optional<std::string>{};
  if (content->is_string()) return std::optional<std::string>{std::string(content->get_string())};
  if (!content->is_array()) {
    return bad(fmt::format("'messages[{}].content' must be a string or an array of text parts", i));
  }
  std::string text;
  const json::array& parts = content->get_array();
  for (std::size_t k = 0; k < parts.size(); ++k) {
    const std::string where = fmt::format("messages[{}].content[{}]", i, k);
    const json::object* p = parts[k].if_object();
    const json::value* type = p != nullptr ? field(*p, "type") : nullptr;
    if (type == nullptr || !type->is_string()) return bad("'" + where + "' must be an object with a string 'type'");
    const std::string_view t = type->get_string();
    std::string_view key;
    if (t == "text") {
      key = "text";
    } else if (t == "refusal" && role == "assistant") {
      key = "refusal";
    } else if (t == "refusal") {
      return bad("'" + where + "': 'refusal' parts are only allowed in assistant messages");
    } else if (std::find(std::begin(kMediaPartTypes), std::end(kMediaPartTypes), t) != std::end(kMediaPartTypes)) {
      return bad(
          fmt::format("'{}': '{}' parts are not supported: only text parts are (the model reads text only)", where, t));
    } else if (printableName(t)) {
      return bad(fmt::format("'{}.type': '{}' is not a content part type: only text parts are supported", where, t));
    } else {
      return bad("'" + where + ".type' is not a content part type: only text parts are supported");
    }
    PD_TRY(checkObjectFields(*p, {"type", key}, where, fmt::format("a {} part", t)));
    const json::value* value = field(*p, key);
    if (value == nullptr || !value->is_string()) {
      return bad(fmt::format("'{}.{}' must be a string", where, key));
    }
    if (k > 0) text += '\n';
    text.append(value->get_string());
  }
  return std::optional<std::string>{std::move(text)};
}

/// One message in its two forms: structured, and the object the chat template reads.
struct ParsedMessage {
  ChatMessage msg;
  json::object template_view;
};

/// One message, validated field by field.
Result<ParsedMessage> parseMessage(const json::object& m, std::size_t i) {
  const json::value* role = field(m, "role");
  if (role == nullptr || !role->is_string()) return bad(fmt::format("'messages[{}].role' must be a string", i));
  const std::string_view r = role->get_string();
  if (r != "system" && r != "developer" && r != "user" && r != "assistant" && r != "tool") {
    if (r == "function") {
      return bad(fmt::format("'messages[{}].role': 'function' (legacy) is not supported: use 'tool'", i));
    }
    return bad(fmt::format("'messages[{}].role' must be system, developer, user, assistant or tool", i));
  }
  PD_TRY(checkMessageFields(m, r, i));
  ParsedMessage parsed;
  ChatMessage& msg = parsed.msg;
  json::object& out = parsed.template_view;
  msg.role = std::string(r);
  PD_ASSIGN_OR_RETURN(auto name, messageString(m, "name", i));
  json::array calls_normalized;
  if (const json::value* calls = field(m, "tool_calls")) {
    PD_ASSIGN_OR_RETURN(calls_normalized, normalizeToolCalls(*calls, i));
    if (!calls_normalized.empty()) msg.tool_calls_json = json::serialize(calls_normalized);
  }
  if (r == "tool") {
    PD_ASSIGN_OR_RETURN(auto id, messageString(m, "tool_call_id", i));
    if (!id) return bad(fmt::format("'messages[{}].tool_call_id' must be a string", i));
    msg.tool_call_id = std::move(*id);
  }
  PD_ASSIGN_OR_RETURN(auto content, messageContent(m, r, i));
  PD_ASSIGN_OR_RETURN(auto refusal, messageString(m, "refusal", i));
  if (refusal) {
    // What the model said when it refused: the turn's text, as long as there is no other.
    if ((content && !content->empty()) || !calls_normalized.empty()) {
      return bad(fmt::format("'messages[{}].refusal' cannot be combined with 'content' or 'tool_calls'", i));
    }
    content = std::move(refusal);
  }
  if (!content && r != "assistant") return bad(fmt::format("'messages[{}].content' is required", i));
  PD_ASSIGN_OR_RETURN(auto reasoning, messageString(m, "reasoning_content", i));
  PD_ASSIGN_OR_RETURN(auto reasoning_alias, messageString(m, "reasoning", i));
  if (reasoning && reasoning_alias) {
    return bad(fmt::format("'messages[{}].reasoning' and 'reasoning_content' are the same field: send one", i));
  }
  if (reasoning_alias) reasoning = std::move(reasoning_alias);
  msg.content = content.value_or("");
  msg.name = name.value_or("");
  msg.reasoning_content = reasoning.value_or("");

  // A developer message is the system message of newer OpenAI models; the DeepSeek templates
  // know only `system`, and would drop it without a word.
  out = json::object{{"role", r == "developer" ? std::string_view("system") : r}, {"content", msg.content}};
  // The DeepSeek templates render an assistant turn's calls only when its content is null.
  if (!msg.tool_calls_json.empty()) {
    if (!content) out["content"] = nullptr;
    out["tool_calls"] = std::move(calls_normalized);
  }
  if (r == "tool") out["tool_call_id"] = msg.tool_call_id;
  if (name) out["name"] = msg.name;
  if (reasoning) out["reasoning_content"] = msg.reasoning_content;
  return parsed;
}

Result<ChatConversation> parseMessages(const json::object& o) {
  const json::value* v = field(o, "messages");
  if (v == nullptr) return bad("'messages' is required");
  if (!v->is_array()) return bad("'messages' must be an array");
  const json::array& in = v->get_array();
  if (in.empty()) return bad("'messages' must not be empty");
  ChatConversation conv;
  json::array normalized;
  normalized.reserve(in.size());
  for (std::size_t i = 0; i < in.size(); ++i) {
    if (!in[i].is_object()) return bad(fmt::format("'messages[{}]' must be an object", i));
    PD_ASSIGN_OR_RETURN(ParsedMessage parsed, parseMessage(in[i].get_object(), i));
    normalized.push_back(std::move(parsed.template_view));
    conv.messages.push_back(std::move(parsed.msg));
  }
  conv.messages_json = json::serialize(normalized);
  if (const json::value* kw = field(o, "chat_template_kwargs")) {
    if (!kw->is_object()) return bad("'chat_template_kwargs' must be an object");
    // The variables the router sets itself (tokenizer/src/chat_template.cpp) are not the
    // client's to replace: the validated messages, the special tokens, the generation prompt.
    for (const std::string_view reserved :
         {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token"}) {
      if (kw->as_object().contains(reserved)) {
        return bad(fmt::format("'chat_template_kwargs' may not set '{}': the router sets it", reserved));
      }
    }
    conv.template_kwargs_json = json::serialize(*kw);
  }
  return conv;
}

Status parsePrompt(const json::object& o, CompletionParams& p) {
  const json::value* v = field(o, "prompt");
  if (v == nullptr) return bad("'prompt' is required");
  if (v->is_string()) {
    p.prompt_text = std::string(v->get_string());
    return okStatus();
  }
  if (!v->is_array()) return bad("'prompt' must be a string or an array of token ids");
  const json::array& a = v->get_array();
  if (a.empty()) return bad("'prompt' must not be empty");
  if (a.size() == 1 && a[0].is_string()) {
    p.prompt_text = std::string(a[0].get_string());
    return okStatus();
  }
  if (a.size() == 1 && a[0].is_array()) {
    if (a[0].get_array().empty()) return bad("'prompt' must not be empty");
    PD_ASSIGN_OR_RETURN(p.prompt_token_ids, tokenIds(a[0].get_array(), "prompt"));
    return okStatus();
  }
  if (a[0].is_string() || a[0].is_array()) {
    return bad("'prompt' with several prompts (a batch) is not supported: send one prompt per request");
  }
  PD_ASSIGN_OR_RETURN(p.prompt_token_ids, tokenIds(a, "prompt"));
  return okStatus();
}

Status parseStop(const json::object& o, CompletionParams& p) {
  if (const json::value* v = field(o, "stop")) {
    if (v->is_string()) {
      if (v->get_string().empty()) return bad("'stop' strings must not be empty");
      p.stop.emplace_back(v->get_string());
    } else if (v->is_array()) {
      if (v->get_array().size() > kMaxStopSequences) {
        return bad(fmt::format("'stop' may hold at most {} sequences", kMaxStopSequences));
      }
      for (const auto& s : v->get_array()) {
        if (!s.is_string()) return bad("'stop' must be a string or an array of strings");
        if (s.get_string().empty()) return bad("'stop' strings must not be empty");
        p.stop.emplace_back(s.get_string());
      }
    } else {
      return bad("'stop' must be a string or an array of strings");
    }
  }
  if (const json::value* v = field(o, "stop_token_ids")) {
    if (!v->is_array()) return bad("'stop_token_ids' must be an array of token ids");
    if (v->get_array().size() > kMaxStopTokenIds) {
      return bad(fmt::format("'stop_token_ids' may hold at most {} ids", kMaxStopTokenIds));
    }
    PD_ASSIGN_OR_RETURN(p.stop_token_ids, tokenIds(v->get_array(), "stop_token_ids"));
  }
  return okStatus();
}

// OpenAI's logit_bias: {"<token id>": bias in [-100, 100], ...}; ids the model's vocabulary does
// not have are ignored by the sampler, as OpenAI ignores them.
Status parseLogitBias(const json::object& o, CompletionParams& p) {
  const json::value* v = field(o, "logit_bias");
  if (v == nullptr || v->is_null()) return okStatus();
  if (!v->is_object()) return bad("'logit_bias' must be an object mapping token ids to numbers");
  const json::object& map = v->get_object();
  if (map.size() > kMaxLogitBias) return bad(fmt::format("'logit_bias' may hold at most {} tokens", kMaxLogitBias));
  for (const auto& kv : map) {
    const std::string_view key = kv.key();
    std::int64_t id = 0;
    bool digits = !key.empty() && key.size() <= 10;
    for (const char c : key) {
      digits = digits && c >= '0' && c <= '9';
      if (digits) id = id * 10 + (c - '0');
    }
    if (!digits || id > std::numeric_limits<TokenId>::max()) {
      return bad("'logit_bias' keys must be token ids (non-negative integers)");
    }
    if (!kv.value().is_number()) return bad("'logit_bias' values must be numbers between -100 and 100");
    const double bias = kv.value().to_number<double>();
    if (!(bias >= -100.0 && bias <= 100.0)) return bad("'logit_bias' values must be numbers between -100 and 100");
    for (const auto& seen : p.sampling.logit_bias) {
      if (seen.token == id) return bad(fmt::format("'logit_bias' names token {} twice", id));
    }
    p.sampling.logit_bias.push_back({static_cast<TokenId>(id), static_cast<float>(bias)});
  }
  return okStatus();
}

Status parseSampling(const json::object& o, CompletionParams& p) {
  PD_ASSIGN_OR_RETURN(auto temperature, getNumber(o, "temperature", 0.0, 2.0));
  PD_ASSIGN_OR_RETURN(auto top_p, getNumber(o, "top_p", 0.0, 1.0, /*lo_open=*/true));
  PD_ASSIGN_OR_RETURN(auto top_k, getInt(o, "top_k", -1, std::numeric_limits<std::int32_t>::max()));
  PD_ASSIGN_OR_RETURN(
      auto seed, getInt(o, "seed", std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max()));
  PD_ASSIGN_OR_RETURN(auto presence, getNumber(o, "presence_penalty", -2.0, 2.0));
  PD_ASSIGN_OR_RETURN(auto frequency, getNumber(o, "frequency_penalty", -2.0, 2.0));
  if (temperature) p.sampling.temperature = *temperature;
  if (top_p) p.sampling.top_p = *top_p;
  if (top_k) p.sampling.top_k = *top_k < 0 ? 0 : *top_k;  // -1 (vLLM) and 0 both mean "off"
  p.seed = seed;
  if (presence) p.sampling.presence_penalty = *presence;
  if (frequency) p.sampling.frequency_penalty = *frequency;
  PD_ASSIGN_OR_RETURN(auto min_p, getNumber(o, "min_p", 0.0, 1.0));
  if (min_p) p.sampling.min_p = *min_p;
  return parseLogitBias(o, p);
}

Status parseLogprobs(const json::object& o, Endpoint endpoint, CompletionParams& p) {
  if (endpoint == Endpoint::ChatCompletions) {
    PD_ASSIGN_OR_RETURN(auto logprobs, getBool(o, "logprobs"));
    PD_ASSIGN_OR_RETURN(auto top, getInt(o, "top_logprobs", 0, kMaxTopLogprobs));
    p.logprobs = logprobs.value_or(false);
    if (top) {
      if (!p.logprobs) return bad("'top_logprobs' requires 'logprobs' to be true");
      p.sampling.top_logprobs = *top;
    }
    return okStatus();
  }
  PD_ASSIGN_OR_RETURN(auto logprobs, getInt(o, "logprobs", 0, kMaxTopLogprobs));
  if (logprobs) {
    p.logprobs = true;
    p.sampling.top_logprobs = *logprobs;
  }
  return okStatus();
}

Status parseStreaming(const json::object& o, CompletionParams& p) {
  PD_ASSIGN_OR_RETURN(auto stream, getBool(o, "stream"));
  p.stream = stream.value_or(false);
  if (const json::value* v = field(o, "stream_options")) {
    if (!p.stream) return bad("'stream_options' is only allowed when 'stream' is true");
    if (!v->is_object()) return bad("'stream_options' must be an object");
    for (const auto& kv : v->get_object()) {
      if (kv.key() == "include_usage" || kv.value().is_null()) continue;
      if (!printableName(kv.key())) return bad("'stream_options' has a field this server does not know");
      return bad(fmt::format("'stream_options.{}' is not supported", std::string_view(kv.key())));
    }
    PD_ASSIGN_OR_RETURN(auto include_usage, getBool(v->get_object(), "include_usage"));
    p.include_usage = include_usage.value_or(false);
  }
  return okStatus();
}

}  // namespace

Result<CompletionParams> parseCompletionRequest(Endpoint endpoint, std::string_view body) {
  if (!isValidUtf8(body)) return bad("the request body is not valid UTF-8");
  if (hasLoneSurrogateEscape(body)) return bad("the request body contains an unpaired UTF-16 surrogate escape");
  json::parse_options options;
  options.max_depth = kMaxJsonDepth;
  boost::system::error_code ec;
  const json::value root = json::parse(body, ec, json::storage_ptr(), options);
  if (ec) return bad("the request body is not valid JSON");
  if (!root.is_object()) return bad("the request body must be a JSON object");
  const json::object& o = root.get_object();

  CompletionParams p;
  p.endpoint = endpoint;
  PD_ASSIGN_OR_RETURN(auto model, getString(o, "model"));
  if (!model || model->empty()) return bad("'model' is required");
  p.model = std::move(*model);

  PD_TRY(refuseUnknown(o, endpoint));
  PD_TRY(refuseUnsupported(o, endpoint));
  if (endpoint == Endpoint::ChatCompletions) {
    PD_ASSIGN_OR_RETURN(p.conversation, parseMessages(o));
  } else {
    PD_TRY(parsePrompt(o, p));
  }

  PD_ASSIGN_OR_RETURN(auto max_tokens, getInt(o, "max_tokens", 1, std::numeric_limits<std::int64_t>::max()));
  PD_ASSIGN_OR_RETURN(auto max_completion_tokens,
                      getInt(o, "max_completion_tokens", 1, std::numeric_limits<std::int64_t>::max()));
  p.max_tokens = max_completion_tokens ? max_completion_tokens : max_tokens;
  PD_ASSIGN_OR_RETURN(auto n, getInt(o, "n", 1, pd::kMaxChoices));
  p.n = n.value_or(1);

  PD_TRY(parseOutputControls(o, p));
  PD_TRY(parseSampling(o, p));
  PD_TRY(parseStop(o, p));
  PD_TRY(parseLogprobs(o, endpoint, p));
  PD_TRY(parseStreaming(o, p));

  PD_ASSIGN_OR_RETURN(auto ignore_eos, getBool(o, "ignore_eos"));
  p.ignore_eos = ignore_eos.value_or(false);
  PD_ASSIGN_OR_RETURN(auto return_token_ids, getBool(o, "return_token_ids"));
  p.return_token_ids = return_token_ids.value_or(false);
  PD_ASSIGN_OR_RETURN(auto skip_special, getBool(o, "skip_special_tokens"));
  p.skip_special_tokens = skip_special.value_or(true);
  PD_ASSIGN_OR_RETURN(auto include_stop, getBool(o, "include_stop_str_in_output"));
  p.include_stop_str_in_output = include_stop.value_or(false);
  for (const auto& [name, out] :
       {std::pair<std::string_view, std::string*>{"user", &p.user},
        std::pair<std::string_view, std::string*>{"safety_identifier", &p.safety_identifier}}) {
    PD_ASSIGN_OR_RETURN(auto value, getString(o, name));
    if (value && value->size() > kMaxUserBytes) {
      return bad(fmt::format("'{}' may be at most {} bytes long", name, kMaxUserBytes));
    }
    *out = value.value_or("");
  }
  return p;
}

}  // namespace pd::router
