#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>

#include "pd/router/openai_request.h"

namespace {

using pd::router::Endpoint;
using pd::router::parseCompletionRequest;

constexpr std::string_view kMarker = "ZQX-secret-input";

pd::router::CompletionParams parseOk(Endpoint e, std::string_view body) {
  auto r = parseCompletionRequest(e, body);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message) << "\n" << body;
  return r.ok() ? std::move(r).value() : pd::router::CompletionParams{};
}

std::string parseError(Endpoint e, std::string_view body) {
  auto r = parseCompletionRequest(e, body);
  EXPECT_FALSE(r.ok()) << body;
  if (r.ok()) return {};
  EXPECT_EQ(r.error().code, pd::ErrorCode::InvalidArgument);
  EXPECT_EQ(r.error().message.find(kMarker), std::string::npos) << "echoes input: " << r.error().message;
  return r.error().message;
}

TEST(OpenAiRequest, ChatBodyAsTheOpenAiPythonSdkSendsIt) {
  const auto p = parseOk(Endpoint::ChatCompletions,
                         R"({"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],)"
                         R"("model":"m","max_tokens":16,"stream":true,"stream_options":{"include_usage":true},)"
                         R"("temperature":0,"top_p":0.9,"seed":42,"stop":["\n\n"],"presence_penalty":0.5,)"
                         R"("frequency_penalty":-0.5,"logprobs":true,"top_logprobs":3,"n":1,"user":"u-1"})");
  EXPECT_EQ(p.model, "m");
  ASSERT_EQ(p.conversation.messages.size(), 2u);
  EXPECT_EQ(p.conversation.messages[1].role, "user");
  EXPECT_EQ(p.conversation.messages[1].content, "Hi");
  EXPECT_EQ(p.conversation.messages_json,
            R"([{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}])");
  EXPECT_EQ(p.max_tokens, 16);
  EXPECT_TRUE(p.stream);
  EXPECT_TRUE(p.include_usage);
  EXPECT_EQ(p.sampling.temperature, 0.0);
  EXPECT_EQ(p.sampling.top_p, 0.9);
  EXPECT_EQ(p.seed, 42);
  EXPECT_EQ(p.sampling.presence_penalty, 0.5);
  EXPECT_EQ(p.sampling.frequency_penalty, -0.5);
  EXPECT_EQ(p.stop, std::vector<std::string>{"\n\n"});
  EXPECT_TRUE(p.logprobs);
  EXPECT_EQ(p.sampling.top_logprobs, 3);
  EXPECT_EQ(p.user, "u-1");
}

TEST(OpenAiRequest, MinPAndLogitBiasReachTheSamplingParams) {
  const auto p =
      parseOk(Endpoint::ChatCompletions, R"({"model":"m","messages":[{"role":"user","content":"Hi"}],"min_p":0.05,)"
                                         R"("logit_bias":{"128798":-100,"7":2.5}})");
  EXPECT_EQ(p.sampling.min_p, 0.05);
  ASSERT_EQ(p.sampling.logit_bias.size(), 2u);
  EXPECT_EQ(p.sampling.logit_bias[0], (pd::LogitBias{128798, -100.0F}));
  EXPECT_EQ(p.sampling.logit_bias[1], (pd::LogitBias{7, 2.5F}));
  EXPECT_TRUE(pd::validate(p.sampling).ok());
  const auto none = parseOk(Endpoint::Completions, R"({"model":"m","prompt":"x","logit_bias":{}})");
  EXPECT_TRUE(none.sampling.logit_bias.empty());
  EXPECT_EQ(none.sampling.min_p, 0.0);
}

TEST(OpenAiRequest, ContentPartsNullsAndExtensions) {
  const auto p = parseOk(
      Endpoint::ChatCompletions,
      R"({"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},)"
      R"({"role":"assistant","content":null},{"role":"developer","content":"d"}],"max_completion_tokens":5,)"
      R"("max_tokens":9,"top_k":-1,"temperature":null,"stop":"END","stop_token_ids":[7,8],"ignore_eos":true,)"
      R"("return_token_ids":true,"chat_template_kwargs":{"thinking":true},"skip_special_tokens":false,)"
      R"("include_stop_str_in_output":true,"safety_identifier":"s-1","store":false,"service_tier":"auto",)"
      R"("modalities":["text"],"metadata":{},"parallel_tool_calls":true})");
  EXPECT_EQ(p.conversation.messages[0].content, "a\nb");
  EXPECT_EQ(p.conversation.messages[1].content, "");
  EXPECT_EQ(p.max_tokens, 5);  // max_completion_tokens wins
  EXPECT_EQ(p.sampling.top_k, 0);
  EXPECT_EQ(p.sampling.temperature, 1.0);  // null means default
  EXPECT_EQ(p.stop, std::vector<std::string>{"END"});
  EXPECT_EQ(p.stop_token_ids, (std::vector<pd::TokenId>{7, 8}));
  EXPECT_TRUE(p.ignore_eos);
  EXPECT_TRUE(p.return_token_ids);
  EXPECT_EQ(p.conversation.template_kwargs_json, R"({"thinking":true})");
  EXPECT_FALSE(p.skip_special_tokens);
  EXPECT_TRUE(p.include_stop_str_in_output);
  EXPECT_EQ(p.safety_identifier, "s-1");
  const auto defaults = parseOk(Endpoint::Completions, R"({"model":"m","prompt":"x"})");
  EXPECT_TRUE(defaults.skip_special_tokens);
  EXPECT_FALSE(defaults.include_stop_str_in_output);
}

TEST(OpenAiRequest, EveryParameterIsHonouredOrRefusedByName) {
  const std::string chat_base = R"({"model":"m","messages":[{"role":"user","content":"x"}],)";
  const std::string completion_base = R"({"model":"m","prompt":"x",)";
  auto chat = [&](std::string_view extra) {
    return parseError(Endpoint::ChatCompletions, chat_base + std::string(extra) + "}");
  };
  auto completion = [&](std::string_view extra) {
    return parseError(Endpoint::Completions, completion_base + std::string(extra) + "}");
  };
  // Unknown parameters (vendor fields, typos) are named, so the client sees what was not done.
  EXPECT_EQ(chat(R"("repetition_penalty":1.1)"),
            "'repetition_penalty' is not a parameter /v1/chat/completions supports");
  EXPECT_EQ(chat(R"("temprature":0)"), "'temprature' is not a parameter /v1/chat/completions supports");
  EXPECT_EQ(chat(R"("guided_json":{})"), "'guided_json' is not a parameter /v1/chat/completions supports");
  // null asks for nothing, known parameter or not.
  parseOk(Endpoint::ChatCompletions, chat_base + R"("audio":null,"prediction":null,"stream":true,)" +
                                         R"("stream_options":{"include_usage":true,"continuous_usage_stats":null}})");
  EXPECT_EQ(completion(R"("messages":[])"), "'messages' is not a parameter /v1/completions supports");
  EXPECT_EQ(completion(R"("top_logprobs":2)"), "'top_logprobs' is not a parameter /v1/completions supports");
  EXPECT_EQ(completion(R"("tools":[])"), "'tools' is only accepted by /v1/chat/completions");
  EXPECT_EQ(chat(R"("echo":false)"), "'echo' is not a parameter /v1/chat/completions supports");
  // A name that is not a short identifier is not repeated.
  EXPECT_EQ(chat(R"("ZQX-secret-input with spaces":1)"),
            "the request has a parameter that /v1/chat/completions does not know");
  EXPECT_EQ(chat(R"("stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true})"),
            "'stream_options.continuous_usage_stats' is not supported");
  // OpenAI service features: neutral values only.
  EXPECT_NE(chat(R"("store":true)").find("'store' is not supported"), std::string::npos);
  EXPECT_NE(chat(R"("metadata":{"k":"v"})").find("'metadata' is not supported"), std::string::npos);
  EXPECT_NE(chat(R"("service_tier":"flex")").find("'service_tier'"), std::string::npos);
  EXPECT_NE(chat(R"("modalities":["text","audio"])").find("'modalities'"), std::string::npos);
  EXPECT_NE(chat(R"("function_call":{"name":"f"})").find("'function_call' is not supported"), std::string::npos);
  EXPECT_NE(chat(R"("parallel_tool_calls":1)").find("'parallel_tool_calls' must be a boolean"), std::string::npos);
  EXPECT_NE(chat(R"("skip_special_tokens":"no")").find("'skip_special_tokens' must be a boolean"), std::string::npos);
  EXPECT_NE(chat(R"("include_stop_str_in_output":1)").find("'include_stop_str_in_output' must be a boolean"),
            std::string::npos);
  EXPECT_NE(chat(fmt::format(R"("user":"{}")", std::string(257, 'u'))).find("'user' may be at most 256 bytes"),
            std::string::npos);
  EXPECT_NE(chat(R"("safety_identifier":7)").find("'safety_identifier' must be a string"), std::string::npos);
}

TEST(OpenAiRequest, CompletionPromptForms) {
  auto p = parseOk(Endpoint::Completions, R"({"model":"m","prompt":"Once upon"})");
  EXPECT_EQ(p.prompt_text, "Once upon");
  EXPECT_FALSE(p.prompt_token_ids);
  EXPECT_FALSE(p.max_tokens);
  p = parseOk(Endpoint::Completions, R"({"model":"m","prompt":[1,2,3],"logprobs":2,"max_tokens":4.0})");
  EXPECT_EQ(p.prompt_token_ids, (std::vector<pd::TokenId>{1, 2, 3}));
  EXPECT_TRUE(p.logprobs);
  EXPECT_EQ(p.sampling.top_logprobs, 2);
  EXPECT_EQ(p.max_tokens, 4);
  p = parseOk(Endpoint::Completions, R"({"model":"m","prompt":[[5,6]]})");
  EXPECT_EQ(p.prompt_token_ids, (std::vector<pd::TokenId>{5, 6}));
  p = parseOk(Endpoint::Completions, R"({"model":"m","prompt":["one"],"echo":false,"suffix":null,"best_of":1})");
  EXPECT_EQ(p.prompt_text, "one");
}

TEST(OpenAiRequest, MalformedBodies) {
  EXPECT_EQ(parseError(Endpoint::ChatCompletions, "{\"model\": \"m\", "), "the request body is not valid JSON");
  EXPECT_EQ(parseError(Endpoint::ChatCompletions, ""), "the request body is not valid JSON");
  EXPECT_EQ(parseError(Endpoint::ChatCompletions, "[1,2]"), "the request body must be a JSON object");
  EXPECT_EQ(parseError(Endpoint::ChatCompletions, "{\"model\":\"m\xFF\"}"), "the request body is not valid UTF-8");
  EXPECT_EQ(parseError(Endpoint::ChatCompletions, R"({"model":"m","messages":[{"role":"user","content":"\ud800"}]})"),
            "the request body contains an unpaired UTF-16 surrogate escape");
  EXPECT_EQ(parseError(Endpoint::ChatCompletions, std::string(100, '[') + std::string(100, ']')),
            "the request body is not valid JSON");  // nesting limit
}

TEST(OpenAiRequest, RefusesWhatItCannotDo) {
  const std::string base = R"({"model":"m","messages":[{"role":"user","content":"x"}],)";
  auto chat = [&](std::string_view extra) {
    return parseError(Endpoint::ChatCompletions, base + std::string(extra) + "}");
  };
  EXPECT_NE(chat(R"("n":0)").find("'n' must be an integer between 1 and 128"), std::string::npos);
  EXPECT_NE(chat(R"("n":129)").find("'n' must be an integer between 1 and 128"), std::string::npos);
  EXPECT_NE(chat(R"("n":"3")").find("'n' must be an integer"), std::string::npos);
  EXPECT_NE(
      parseError(Endpoint::Completions, R"({"model":"m","prompt":"x","n":2,"best_of":2})").find("'best_of' must be 1"),
      std::string::npos);
  auto three = parseCompletionRequest(Endpoint::ChatCompletions, base + R"("n":3})");
  ASSERT_TRUE(three.ok()) << three.error().toString();
  EXPECT_EQ(three->n, 3);
  auto one = parseCompletionRequest(Endpoint::Completions, R"({"model":"m","prompt":"x"})");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->n, 1);
  EXPECT_NE(chat(R"("temperature":2.5)").find("'temperature' must be between 0 and 2"), std::string::npos);
  EXPECT_NE(chat(R"("temperature":"ZQX-secret-input")").find("'temperature' must be a number"), std::string::npos);
  EXPECT_NE(chat(R"("temperature":1e400)").find("'temperature'"), std::string::npos);
  EXPECT_NE(chat(R"("top_p":0)").find("'top_p' must be greater than 0"), std::string::npos);
  EXPECT_NE(chat(R"("top_k":-2)").find("'top_k'"), std::string::npos);
  EXPECT_NE(chat(R"("max_tokens":0)").find("'max_tokens' must be at least 1"), std::string::npos);
  EXPECT_NE(chat(R"("max_tokens":1.5)").find("'max_tokens' must be an integer"), std::string::npos);
  // Too large is not "too small" (a hostile 1e30 once read "must be at least 1").
  EXPECT_NE(chat(R"("max_tokens":1e30)").find("'max_tokens' is too large"), std::string::npos);
  EXPECT_NE(chat(R"("max_tokens":18446744073709551615)").find("'max_tokens' is too large"), std::string::npos);
  EXPECT_NE(chat(R"("max_completion_tokens":1e30)").find("'max_completion_tokens' is too large"), std::string::npos);
  EXPECT_NE(chat(R"("max_tokens":-1e30)").find("'max_tokens' must be at least 1"), std::string::npos);
  // chat_template_kwargs cannot replace what the router validated and set itself.
  for (const char* key : {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token"}) {
    const std::string body = fmt::format(R"("chat_template_kwargs":{{"thinking":true,"{}":"x"}})", key);
    EXPECT_NE(chat(body).find(fmt::format("'chat_template_kwargs' may not set '{}'", key)), std::string::npos) << key;
  }
  EXPECT_NE(chat(R"("presence_penalty":-3)").find("'presence_penalty'"), std::string::npos);
  EXPECT_NE(chat(R"("top_logprobs":2)").find("requires 'logprobs'"), std::string::npos);
  EXPECT_NE(chat(R"("logprobs":true,"top_logprobs":21)").find("'top_logprobs'"), std::string::npos);
  EXPECT_NE(chat(R"("stream_options":{"include_usage":true})").find("only allowed when 'stream' is true"),
            std::string::npos);
  EXPECT_NE(chat(R"("stop":["a",""])").find("must not be empty"), std::string::npos);
  EXPECT_NE(chat(R"("stop":["1","2","3","4","5","6","7","8","9","10","11","12","13","14","15","16","17"])")
                .find("at most 16"),
            std::string::npos);
  EXPECT_NE(chat(R"("stop_token_ids":[-1])").find("'stop_token_ids'"), std::string::npos);
  EXPECT_NE(chat(R"("tools":[{"type":"function"}])").find("'tools[0].function' must be an object"), std::string::npos);
  EXPECT_NE(chat(R"("tool_choice":"required")").find("'tools' is empty"), std::string::npos);
  EXPECT_NE(chat(R"("functions":[{"name":"f"}])").find("legacy"), std::string::npos);
  EXPECT_NE(chat(R"("logit_bias":{"x":5})").find("token ids"), std::string::npos);
  EXPECT_NE(chat(R"("logit_bias":{"-1":5})").find("token ids"), std::string::npos);
  EXPECT_NE(chat(R"("logit_bias":{"3":101})").find("between -100 and 100"), std::string::npos);
  EXPECT_NE(chat(R"("logit_bias":{"3":"a"})").find("between -100 and 100"), std::string::npos);
  EXPECT_NE(chat(R"("logit_bias":{"3":1,"03":2})").find("twice"), std::string::npos);
  EXPECT_NE(chat(R"("logit_bias":[1])").find("'logit_bias' must be an object"), std::string::npos);
  EXPECT_NE(chat(R"("min_p":1.5)").find("'min_p'"), std::string::npos);
  EXPECT_NE(chat(R"("response_format":{"type":"xml"})").find("'response_format.type'"), std::string::npos);
  EXPECT_NE(chat(R"("response_format":{"type":"json_schema","json_schema":{}})").find("schema' is required"),
            std::string::npos);
  EXPECT_NE(chat(R"("response_format":{"type":"json_object"},"tools":[{"type":"function","function":{"name":"f"}}],)"
                 R"("tool_choice":"required")")
                .find("cannot be combined"),
            std::string::npos);
  EXPECT_NE(chat(R"("seed":"ZQX-secret-input")").find("'seed' must be an integer"), std::string::npos);
  EXPECT_NE(chat(R"("seed":18446744073709551615)").find("'seed'"), std::string::npos);

  auto completion = [](std::string_view body) { return parseError(Endpoint::Completions, body); };
  EXPECT_EQ(completion(R"({"model":"m"})"), "'prompt' is required");
  EXPECT_NE(completion(R"({"model":"m","prompt":["a","b"]})").find("batch"), std::string::npos);
  EXPECT_NE(completion(R"({"model":"m","prompt":[[1],[2]]})").find("batch"), std::string::npos);
  EXPECT_NE(completion(R"({"model":"m","prompt":[1,-2]})").find("token ids"), std::string::npos);
  EXPECT_NE(completion(R"({"model":"m","prompt":[1,"ZQX-secret-input"]})").find("token ids"), std::string::npos);
  EXPECT_EQ(completion(R"({"model":"m","prompt":[]})"), "'prompt' must not be empty");
  EXPECT_NE(completion(R"({"model":"m","prompt":"x","echo":true})").find("'echo'"), std::string::npos);
  EXPECT_NE(completion(R"({"model":"m","prompt":"x","suffix":"ZQX-secret-input"})").find("'suffix'"),
            std::string::npos);
  EXPECT_NE(completion(R"({"model":"m","prompt":"x","best_of":3})").find("'best_of'"), std::string::npos);
  EXPECT_NE(completion(R"({"model":"m","prompt":"x","tools":[]})").find("only accepted by /v1/chat/completions"),
            std::string::npos);
  EXPECT_NE(completion(R"({"model":"m","prompt":"x","logprobs":true})").find("'logprobs' must be an integer"),
            std::string::npos);
  EXPECT_EQ(completion(R"({"prompt":"x"})"), "'model' is required");
  EXPECT_EQ(completion(R"({"model":7,"prompt":"x"})"), "'model' must be a string");
}

TEST(OpenAiRequest, ValidatesMessages) {
  auto chat = [](std::string_view messages) {
    return parseError(Endpoint::ChatCompletions, R"({"model":"m","messages":)" + std::string(messages) + "}");
  };
  EXPECT_EQ(parseError(Endpoint::ChatCompletions, R"({"model":"m"})"), "'messages' is required");
  EXPECT_EQ(chat("[]"), "'messages' must not be empty");
  EXPECT_EQ(chat(R"("ZQX-secret-input")"), "'messages' must be an array");
  EXPECT_EQ(chat(R"([{"role":"ZQX-secret-input","content":"x"}])"),
            "'messages[0].role' must be system, developer, user, assistant or tool");
  EXPECT_EQ(chat(R"([{"role":"tool","content":"x"}])"), "'messages[0].tool_call_id' must be a string");
  EXPECT_EQ(chat(R"([{"role":"user"}])"), "'messages[0].content' is required");
  EXPECT_NE(chat(R"([{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}])").find("only text"),
            std::string::npos);
  EXPECT_NE(chat(R"([{"role":"user","content":5}])").find("must be a string or an array"), std::string::npos);
  EXPECT_EQ(chat(R"([{"role":"assistant","content":"x","tool_calls":[{"id":"1"}]}])"),
            "'messages[0].tool_calls[0].function' must be an object");
  EXPECT_EQ(chat(R"([{"role":"user","content":"x","tool_calls":[]}])"),
            "'messages[0].tool_calls' is only allowed on assistant messages");
  EXPECT_EQ(chat(R"([{"role":"user","content":"x"}, 3])"), "'messages[1]' must be an object");
}

// Every field of every message is honoured (passed to the chat template) or refused with a 400
// naming the field and the message index (docs/api.md "Messages").
TEST(OpenAiRequest, MessageFieldsAreHonouredPerRole) {
  const auto p = parseOk(
      Endpoint::ChatCompletions,
      R"({"model":"m","messages":[{"role":"developer","content":"Be brief.","name":"ops"},)"
      R"({"role":"system","content":[{"type":"text","text":"s"}],"name":null},)"
      R"({"role":"user","content":"Hi","name":"alice"},)"
      R"({"role":"assistant","content":"Hello","name":"bot","reasoning_content":"greet back","refusal":null,)"
      R"("tool_calls":null,"function_call":null,"audio":null},)"
      R"({"role":"assistant","reasoning":"r2","content":[{"type":"text","text":"a"},{"type":"refusal","refusal":"no"}]},)"
      R"({"role":"assistant","refusal":"I can't help with that."},)"
      R"({"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",)"
      R"("function":{"name":"f","arguments":"{}"}}]},)"
      R"({"role":"tool","tool_call_id":"c1","content":[{"type":"text","text":"42"}],"name":"f"}]})");
  const auto& msgs = p.conversation.messages;
  ASSERT_EQ(msgs.size(), 8U);
  EXPECT_EQ(msgs[0].role, "developer");
  EXPECT_EQ(msgs[0].name, "ops");
  EXPECT_EQ(msgs[2].name, "alice");
  EXPECT_EQ(msgs[3].reasoning_content, "greet back");
  EXPECT_EQ(msgs[4].reasoning_content, "r2");  // `reasoning` is vLLM's newer name for it
  EXPECT_EQ(msgs[4].content, "a\nno");         // a refusal part is text, as vLLM renders it
  EXPECT_EQ(msgs[5].content, "I can't help with that.");
  EXPECT_EQ(msgs[7].tool_call_id, "c1");
  // What the template reads: developer as system (the DeepSeek templates know only system),
  // name and reasoning_content passed through.
  EXPECT_EQ(p.conversation.messages_json,
            R"([{"role":"system","content":"Be brief.","name":"ops"},{"role":"system","content":"s"},)"
            R"({"role":"user","content":"Hi","name":"alice"},)"
            R"({"role":"assistant","content":"Hello","name":"bot","reasoning_content":"greet back"},)"
            R"({"role":"assistant","content":"a\nno","reasoning_content":"r2"},)"
            R"({"role":"assistant","content":"I can't help with that."},)"
            R"({"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",)"
            R"("function":{"name":"f","arguments":"{}"}}]},)"
            R"({"role":"tool","content":"42","tool_call_id":"c1","name":"f"}])");
}

TEST(OpenAiRequest, MessageFieldsAreRefusedByNameAndIndex) {
  auto chat = [](std::string_view messages) {
    return parseError(Endpoint::ChatCompletions, R"({"model":"m","messages":)" + std::string(messages) + "}");
  };
  const std::string user0 = R"({"role":"user","content":"x"},)";
  // Unknown fields, per role, at their index.
  EXPECT_EQ(chat("[" + user0 + R"({"role":"user","content":"x","prefix":true}])"),
            "'messages[1].prefix' is not a field of a user message");
  EXPECT_EQ(chat(R"([{"role":"system","content":"x","cache_control":{}}])"),
            "'messages[0].cache_control' is not a field of a system message");
  EXPECT_EQ(chat("[" + user0 + R"({"role":"tool","tool_call_id":"c","content":"x","id":"c"}])"),
            "'messages[1].id' is not a field of a tool message");
  EXPECT_EQ(chat(R"([{"role":"user","content":"x","ZQX-secret-input!":1}])"),
            "'messages[0]' has a field that messages do not have");
  // Fields of another role.
  EXPECT_EQ(chat(R"([{"role":"user","content":"x","tool_call_id":"c"}])"),
            "'messages[0].tool_call_id' is only allowed on tool messages");
  EXPECT_EQ(chat(R"([{"role":"system","content":"x","reasoning_content":"r"}])"),
            "'messages[0].reasoning_content' is only allowed on assistant messages");
  EXPECT_EQ(chat(R"([{"role":"tool","tool_call_id":"c","content":"x","refusal":"r"}])"),
            "'messages[0].refusal' is only allowed on assistant messages");
  EXPECT_EQ(chat(R"([{"role":"developer","content":"x","tool_calls":[]}])"),
            "'messages[0].tool_calls' is only allowed on assistant messages");
  // Known OpenAI fields this server does not offer.
  EXPECT_EQ(chat("[" + user0 + R"({"role":"assistant","function_call":{"name":"f","arguments":"{}"}}])"),
            "'messages[1].function_call' (legacy function calling) is not supported: use 'tool_calls'");
  EXPECT_EQ(chat(R"([{"role":"assistant","content":null,"audio":{"id":"a1"}}])"),
            "'messages[0].audio' is not supported: this server reads and writes text only");
  // Types.
  EXPECT_EQ(chat(R"([{"role":"user","content":"x","name":7}])"), "'messages[0].name' must be a string");
  EXPECT_EQ(chat(R"([{"role":"assistant","content":"x","reasoning_content":["r"]}])"),
            "'messages[0].reasoning_content' must be a string");
  EXPECT_EQ(chat(R"([{"role":"assistant","refusal":true}])"), "'messages[0].refusal' must be a string");
  EXPECT_EQ(chat(R"([{"role":"tool","tool_call_id":5,"content":"x"}])"), "'messages[0].tool_call_id' must be a string");
  EXPECT_EQ(chat(R"([{"role":"assistant","content":"x","refusal":"no"}])"),
            "'messages[0].refusal' cannot be combined with 'content' or 'tool_calls'");
  EXPECT_EQ(chat(R"([{"role":"assistant","content":"x","reasoning":"a","reasoning_content":"b"}])"),
            "'messages[0].reasoning' and 'reasoning_content' are the same field: send one");
  EXPECT_EQ(chat(R"([{"role":"tool","tool_call_id":"c"}])"), "'messages[0].content' is required");
  EXPECT_EQ(chat(R"([{"role":"system","content":null}])"), "'messages[0].content' is required");
  // Content parts: media refused by type name, refusal parts only from the assistant, unknown
  // part fields and types named.
  EXPECT_EQ(chat("[" + user0 +
                 R"({"role":"user","content":[{"type":"text","text":"a"},)"
                 R"({"type":"image_url","image_url":{"url":"ZQX-secret-input"}}]}])"),
            "'messages[1].content[1]': 'image_url' parts are not supported: only text parts are (the model reads text "
            "only)");
  EXPECT_EQ(chat(R"([{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"","format":"wav"}}]}])"),
            "'messages[0].content[0]': 'input_audio' parts are not supported: only text parts are (the model reads "
            "text only)");
  EXPECT_EQ(chat(R"([{"role":"user","content":[{"type":"file","file":{}}]}])"),
            "'messages[0].content[0]': 'file' parts are not supported: only text parts are (the model reads text "
            "only)");
  EXPECT_EQ(chat(R"([{"role":"user","content":[{"type":"refusal","refusal":"x"}]}])"),
            "'messages[0].content[0]': 'refusal' parts are only allowed in assistant messages");
  EXPECT_EQ(chat(R"([{"role":"user","content":[{"type":"hologram"}]}])"),
            "'messages[0].content[0].type': 'hologram' is not a content part type: only text parts are supported");
  EXPECT_EQ(chat(R"([{"role":"user","content":[{"type":"ZQX-secret-input!"}]}])"),
            "'messages[0].content[0].type' is not a content part type: only text parts are supported");
  EXPECT_EQ(chat(R"([{"role":"user","content":[{"type":"text","text":"a","cache_control":{}}]}])"),
            "'messages[0].content[0].cache_control' is not a field of a text part");
  EXPECT_EQ(chat(R"([{"role":"user","content":[{"type":"text"}]}])"), "'messages[0].content[0].text' must be a string");
  EXPECT_EQ(chat(R"([{"role":"user","content":["a"]}])"),
            "'messages[0].content[0]' must be an object with a string 'type'");
  // Tool calls: unknown fields named.
  EXPECT_EQ(chat(R"([{"role":"assistant","tool_calls":[{"id":"c","type":"function","index":0,)"
                 R"("function":{"name":"f","arguments":"{}"}}]}])"),
            "'messages[0].tool_calls[0].index' is not a field of a tool call");
  EXPECT_EQ(chat(R"([{"role":"assistant","tool_calls":[{"id":"c","type":"function",)"
                 R"("function":{"name":"f","arguments":"{}","strict":true}}]}])"),
            "'messages[0].tool_calls[0].function.strict' is not a field of a tool call's function");
}

// Tools, tool_choice and response_format become the output constraint and the template's tools;
// tool and assistant-with-calls messages are normalized as the DeepSeek templates read them.
TEST(OpenAiRequest, ToolsToolMessagesAndResponseFormat) {
  const std::string tools =
      R"("tools":[{"type":"function","function":{"name":"get_time","parameters":{"type":"object"}}}])";
  const std::string messages =
      R"("messages":[{"role":"user","content":"t?"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1",)"
      R"("type":"function","function":{"name":"get_time","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c1",)"
      R"("content":"noon"}])";
  auto named = parseCompletionRequest(Endpoint::ChatCompletions,
                                      R"({"model":"m",)" + messages + "," + tools +
                                          R"(,"tool_choice":{"type":"function","function":{"name":"get_time"}}})");
  ASSERT_TRUE(named.ok()) << named.error().message;
  EXPECT_EQ(named->constraint.kind, pd::structured::ResponseConstraint::Kind::ToolCalls);
  ASSERT_EQ(named->constraint.tools.size(), 1U);
  EXPECT_FALSE(named->constraint.parallel_tool_calls);
  EXPECT_TRUE(named->parse_tool_calls);
  EXPECT_NE(named->conversation.tools_json.find("get_time"), std::string::npos);
  EXPECT_NE(
      named->conversation.messages_json.find(
          R"({"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"get_time","arguments":"{}"}}]})"),
      std::string::npos)
      << named->conversation.messages_json;
  EXPECT_NE(named->conversation.messages_json.find(R"({"role":"tool","content":"noon","tool_call_id":"c1"})"),
            std::string::npos)
      << named->conversation.messages_json;

  auto none = parseCompletionRequest(Endpoint::ChatCompletions,
                                     R"({"model":"m",)" + messages + "," + tools + R"(,"tool_choice":"none"})");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->constraint.constrained());
  EXPECT_FALSE(none->parse_tool_calls);
  EXPECT_TRUE(none->conversation.tools_json.empty());

  auto schema = parseCompletionRequest(
      Endpoint::Completions,
      R"({"model":"m","prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{"type":"integer"}}}})");
  ASSERT_TRUE(schema.ok()) << schema.error().message;
  EXPECT_EQ(schema->constraint.kind, pd::structured::ResponseConstraint::Kind::JsonSchema);
  EXPECT_EQ(schema->constraint.schema_json, R"({"type":"integer"})");
}

}  // namespace
