// Structured outputs, tool calls and R1 reasoning through the whole system (`pdserve up`: router +
// prefill + decode processes, MTP speculation on) on a random-weight make-model checkpoint with the
// real DeepSeek-V3 tokenizer whose chat template is R1's (the generation prompt opens `<think>`):
//  - response_format json_schema: many sampled generations over the schema suite
//    (tests/data/structured/schema_suite.jsonl) all finish and validate with python3-jsonschema
//    (tests/unit/structured/check_outputs.py), though the weights are random; json_object gives an
//    object; an unsupported schema feature is a 400 naming it;
//  - tool_choice required / named: parseable OpenAI tool_calls of the listed tools with arguments
//    valid for their schemas, finish_reason tool_calls; streamed deltas add up to the same calls;
//    a round trip through an assistant tool_calls message and a tool message is served;
//  - reasoning: everything before `</think>` is reasoning_content (the prompt opened it), counted
//    in usage.completion_tokens_details.reasoning_tokens; streaming equals non-streaming.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <cstdlib>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "pd/common/http_client.h"
#include "pd/common/subprocess.h"
#include "pd/tokenizer/tokenizer.h"
#include "support/local_cluster.h"
#include "support/test_files.h"
#include "support/test_model.h"

namespace pd::test {
namespace {

namespace json = boost::json;
using namespace std::chrono_literals;

struct Answer {
  int status = 0;
  std::string raw;
  std::string content;
  bool content_null = false;
  std::string reasoning;
  std::string finish_reason;
  std::vector<std::int64_t> token_ids;
  json::array tool_calls;  // [{"id","name","arguments"}]
  std::int64_t completion_tokens = -1;
  std::int64_t reasoning_tokens = -1;
};

json::array weatherTools() {
  const json::value weather = json::parse(R"({"type": "function", "function": {"name": "get_weather",
      "description": "Current weather of a city",
      "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": false}}})");
  const json::value time = json::parse(R"({"type": "function", "function": {"name": "get_time",
      "parameters": {"type": "object", "properties": {"utc_offset": {"type": "integer"}},
        "required": ["utc_offset"], "additionalProperties": false}}})");
  return json::array{weather, time};
}

class E2eStructured : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>();
    const auto model = dir_->path() / "m";
    makeDefaultModel(model);
    if (HasFatalFailure()) return;
    // R1's generation prompt: the DeepSeek-V3 template with `<think>\n` after the assistant tag.
    auto config = json::parse(readFile(model / "tokenizer_config.json")).as_object();
    std::string tmpl(config.at("chat_template").as_string());
    const std::string tail = "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}";
    const auto at = tmpl.find(tail);
    ASSERT_NE(at, std::string::npos);
    tmpl.replace(at, tail.size(),
                 "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}");
    config["chat_template"] = tmpl;
    std::ofstream(model / "tokenizer_config.json") << json::serialize(config);
    auto tok = tokenizer::Tokenizer::load(model);
    ASSERT_TRUE(tok.ok()) << tok.error().toString();
    tokenizer_ = std::make_unique<tokenizer::Tokenizer>(std::move(*tok));
    cluster_ = std::make_unique<LocalCluster>(
        std::vector<std::string>{"--model.path=" + model.string(), "--model.cache_dir=" + dir_->path().string(),
                                 "--router.port=0", "--decode.num_speculative_tokens=1", "--log.level=warn"});
  }
  static void TearDownTestSuite() {
    cluster_.reset();
    tokenizer_.reset();
    dir_.reset();
  }
  void SetUp() override { ASSERT_FALSE(cluster_->url().empty()); }

  static json::object chatBody(const std::string& content, int max_tokens) {
    return json::object{{"model", "pdserve-default"},
                        {"messages", json::array{json::object{{"role", "user"}, {"content", content}}}},
                        {"max_tokens", max_tokens},
                        {"temperature", 0},
                        {"return_token_ids", true}};
  }

  static Answer chat(const json::object& body) {
    Answer a;
    const auto response = postJson(*cluster_, "/v1/chat/completions", json::serialize(body));
    a.status = response.status;
    a.raw = response.body;
    if (a.status != 200) return a;
    const auto doc = json::parse(response.body);
    const auto& choice = doc.at("choices").as_array().at(0).as_object();
    const auto& message = choice.at("message").as_object();
    a.content_null = message.at("content").is_null();
    if (!a.content_null) a.content = std::string(message.at("content").as_string());
    if (const auto* r = message.if_contains("reasoning_content"); r != nullptr && r->is_string()) {
      a.reasoning = std::string(r->as_string());
    }
    if (const auto* calls = message.if_contains("tool_calls")) {
      for (const auto& c : calls->as_array()) {
        EXPECT_EQ(c.at("type").as_string(), "function");
        a.tool_calls.push_back(json::object{{"id", c.at("id")},
                                            {"name", c.at("function").at("name")},
                                            {"arguments", c.at("function").at("arguments")}});
      }
    }
    a.finish_reason = std::string(choice.at("finish_reason").as_string());
    for (const auto& t : choice.at("token_ids").as_array()) a.token_ids.push_back(t.to_number<std::int64_t>());
    const auto& usage = doc.at("usage").as_object();
    a.completion_tokens = usage.at("completion_tokens").to_number<std::int64_t>();
    if (const auto* d = usage.if_contains("completion_tokens_details")) {
      a.reasoning_tokens = d->at("reasoning_tokens").to_number<std::int64_t>();
    }
    return a;
  }

  /// The same request streamed, its deltas added up as a client does.
  static Answer chatStream(json::object body) {
    body["stream"] = true;
    body["stream_options"] = json::object{{"include_usage", true}};
    Answer a;
    http::Client client(cluster_->host(), cluster_->port());
    http::ClientRequest req;
    req.method = "POST";
    req.target = "/v1/chat/completions";
    req.headers.push_back({"Content-Type", "application/json"});
    req.body = json::serialize(body);
    bool done = false;
    bool any_content = false;
    auto response = client.streamEvents(req, 120s, [&](const http::SseEvent& event) {
      if (event.data == "[DONE]") {
        done = true;
        return true;
      }
      const auto doc = json::parse(event.data);
      if (const auto& usage = doc.at("usage"); usage.is_object()) {
        a.completion_tokens = usage.at("completion_tokens").to_number<std::int64_t>();
        if (const auto* d = usage.as_object().if_contains("completion_tokens_details")) {
          a.reasoning_tokens = d->at("reasoning_tokens").to_number<std::int64_t>();
        }
      }
      for (const auto& c : doc.at("choices").as_array()) {
        const auto& delta = c.at("delta").as_object();
        if (const auto* t = delta.if_contains("content")) {
          a.content += std::string(t->as_string());
          any_content = any_content || !t->as_string().empty();
        }
        if (const auto* r = delta.if_contains("reasoning_content")) a.reasoning += std::string(r->as_string());
        if (const auto* calls = delta.if_contains("tool_calls")) {
          for (const auto& d : calls->as_array()) {
            const auto index = static_cast<std::size_t>(d.at("index").to_number<std::int64_t>());
            if (index == a.tool_calls.size()) {
              // A call's first delta carries its id, type and name.
              EXPECT_EQ(d.at("type").as_string(), "function");
              a.tool_calls.push_back(
                  json::object{{"id", d.at("id")}, {"name", d.at("function").at("name")}, {"arguments", ""}});
            }
            EXPECT_LT(index, a.tool_calls.size()) << event.data;
            if (index >= a.tool_calls.size()) continue;
            auto& args = a.tool_calls[index].as_object()["arguments"].as_string();
            args += d.at("function").at("arguments").as_string();
          }
        }
        if (const auto* ids = c.as_object().if_contains("token_ids")) {
          for (const auto& t : ids->as_array()) a.token_ids.push_back(t.to_number<std::int64_t>());
        }
        if (c.at("finish_reason").is_string()) a.finish_reason = std::string(c.at("finish_reason").as_string());
      }
      return true;
    });
    EXPECT_TRUE(response.ok()) << (response.ok() ? "" : response.error().toString());
    if (!response.ok()) return a;
    a.status = response->status;
    a.content_null = !any_content;
    EXPECT_TRUE(done || a.status != 200) << "stream ended without [DONE]";
    return a;
  }

  static std::unique_ptr<TempDir> dir_;
  static std::unique_ptr<tokenizer::Tokenizer> tokenizer_;
  static std::unique_ptr<LocalCluster> cluster_;
};

std::unique_ptr<TempDir> E2eStructured::dir_;
std::unique_ptr<tokenizer::Tokenizer> E2eStructured::tokenizer_;
std::unique_ptr<LocalCluster> E2eStructured::cluster_;

json::object jsonSchemaFormat(const json::value& schema) {
  return json::object{{"type", "json_schema"},
                      {"json_schema", json::object{{"name", "answer"}, {"schema", schema}, {"strict", true}}}};
}

// Several generations per schema of the suite, sampled (temperature 1, a seed each), sent four at
// a time so that the decode worker batches them: every one finishes (finish_reason stop) and the
// independent checker validates every output against its schema.
TEST_F(E2eStructured, JsonSchemaOutputsValidateOnRandomWeights) {
  constexpr int kPerSchema = 4;
  std::vector<std::pair<json::value, std::string>> jobs;  // schema, suite name
  std::ifstream suite(std::filesystem::path(PD_TEST_DATA_DIR) / "structured" / "schema_suite.jsonl");
  std::string line;
  while (std::getline(suite, line)) {
    const auto row = json::parse(line).as_object();
    if (!row.contains("schema")) continue;
    const std::string name(row.at("name").as_string());
    // A map's keys are strings without a maxLength: a random model almost never closes one
    // (docs/structured-outputs.md, "Termination").
    if (name == "map_of_ints") continue;
    for (int i = 0; i < kPerSchema; ++i) jobs.emplace_back(row.at("schema"), name);
  }
  ASSERT_GE(jobs.size(), std::size_t{15 * kPerSchema});
  const TempDir out;
  const auto out_path = out.path() / "outputs.jsonl";
  std::ofstream rows(out_path);
  for (std::size_t start = 0; start < jobs.size(); start += 4) {
    std::vector<std::future<Answer>> batch;
    for (std::size_t j = start; j < std::min(jobs.size(), start + 4); ++j) {
      json::object body = chatBody("Answer in JSON.", 400);
      body["temperature"] = 1.0;
      body["seed"] = static_cast<std::int64_t>(1000 + j);
      body["response_format"] = jsonSchemaFormat(jobs[j].first);
      batch.push_back(std::async(std::launch::async, [body] { return chat(body); }));
    }
    for (std::size_t j = start; j < std::min(jobs.size(), start + 4); ++j) {
      const Answer a = batch[j - start].get();
      ASSERT_EQ(a.status, 200) << jobs[j].second << ": " << a.raw;
      EXPECT_EQ(a.finish_reason, "stop") << jobs[j].second << ": " << a.content;
      // With a constraint the output is the value itself: no reasoning split.
      EXPECT_TRUE(a.reasoning.empty()) << jobs[j].second;
      rows << json::serialize(json::object{{"schema", jobs[j].first}, {"output", a.content}}) << "\n";
    }
  }
  rows.close();
  const std::string cmd = "python3 '" + std::string(PD_STRUCTURED_CHECKER) + "' '" + out_path.string() + "'";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

TEST_F(E2eStructured, JsonSchemaStreamingEqualsNonStreaming) {
  json::object body = chatBody("A person, please.", 200);
  body["response_format"] = jsonSchemaFormat(json::parse(
      R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["name", "age"]})"));
  const Answer plain = chat(body);
  ASSERT_EQ(plain.status, 200) << plain.raw;
  EXPECT_EQ(plain.finish_reason, "stop");
  const auto value = json::parse(plain.content);
  EXPECT_TRUE(value.as_object().contains("name") && value.as_object().contains("age")) << plain.content;
  const Answer streamed = chatStream(body);
  ASSERT_EQ(streamed.status, 200);
  EXPECT_EQ(streamed.content, plain.content);
  EXPECT_EQ(streamed.token_ids, plain.token_ids);
  EXPECT_EQ(streamed.finish_reason, plain.finish_reason);
}

TEST_F(E2eStructured, JsonObjectGivesAnObject) {
  json::object body = chatBody("Any JSON object.", 120);
  body["response_format"] = json::object{{"type", "json_object"}};
  const Answer a = chat(body);
  ASSERT_EQ(a.status, 200) << a.raw;
  // Its strings have no length bound, so a random model may run out of tokens inside one; what it
  // wrote is still the start of an object, and a finished one parses.
  const auto first = a.content.find_first_not_of(" \t\n");
  ASSERT_NE(first, std::string::npos) << a.content;
  EXPECT_EQ(a.content[first], '{') << a.content;
  if (a.finish_reason == "stop") {
    EXPECT_TRUE(json::parse(a.content).is_object()) << a.content;
  }
}

TEST_F(E2eStructured, UnsupportedSchemaFeatureIs400NamingIt) {
  json::object body = chatBody("x", 16);
  body["response_format"] = jsonSchemaFormat(
      json::parse(R"({"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^x": {}}})"));
  const Answer a = chat(body);
  EXPECT_EQ(a.status, 400) << a.raw;
  EXPECT_NE(a.raw.find("patternProperties"), std::string::npos) << a.raw;
  EXPECT_NE(a.raw.find("invalid_request_error"), std::string::npos) << a.raw;
  // A named function the tools do not define, and a tool whose parameters use an unsupported keyword.
  json::object named = chatBody("x", 16);
  named["tools"] = weatherTools();
  named["tool_choice"] = json::object{{"type", "function"}, {"function", json::object{{"name", "nope"}}}};
  EXPECT_EQ(chat(named).status, 400);
  json::object bad_tool = chatBody("x", 16);
  bad_tool["tools"] = json::array{json::parse(R"({"type": "function", "function": {"name": "f",
      "parameters": {"type": "object", "properties": {"v": {"type": "integer", "multipleOf": 3}}}}})")};
  bad_tool["tool_choice"] = "required";
  const Answer b = chat(bad_tool);
  EXPECT_EQ(b.status, 400) << b.raw;
  EXPECT_NE(b.raw.find("multipleOf"), std::string::npos) << b.raw;
}

void expectValidWeatherOrTimeCall(const json::value& call) {
  const std::string name(call.at("name").as_string());
  ASSERT_TRUE(name == "get_weather" || name == "get_time") << name;
  EXPECT_TRUE(call.at("id").as_string().starts_with("call_")) << call;
  const auto args = json::parse(call.at("arguments").as_string()).as_object();
  if (name == "get_weather") {
    EXPECT_EQ(args.size(), 2U) << call;
    EXPECT_LE(args.at("city").as_string().size(), 12U * 4) << call;
    const std::string unit(args.at("unit").as_string());
    EXPECT_TRUE(unit == "celsius" || unit == "fahrenheit") << call;
  } else {
    EXPECT_EQ(args.size(), 1U) << call;
    EXPECT_TRUE(args.at("utc_offset").is_int64() || args.at("utc_offset").is_uint64()) << call;
  }
}

TEST_F(E2eStructured, ToolChoiceRequiredGivesParseableToolCalls) {
  for (const bool parallel : {true, false}) {
    for (int seed = 0; seed < 3; ++seed) {
      json::object body = chatBody("What is the weather in Paris?", 600);
      body["tools"] = weatherTools();
      body["tool_choice"] = "required";
      body["parallel_tool_calls"] = parallel;
      body["temperature"] = 1.0;
      body["seed"] = seed;
      const Answer a = chat(body);
      ASSERT_EQ(a.status, 200) << a.raw;
      EXPECT_EQ(a.finish_reason, "tool_calls") << a.raw;
      ASSERT_GE(a.tool_calls.size(), 1U) << a.raw;
      if (!parallel) {
        EXPECT_EQ(a.tool_calls.size(), 1U) << a.raw;
      }
      EXPECT_TRUE(a.content_null) << a.raw;
      EXPECT_TRUE(a.reasoning.empty()) << a.raw;
      for (const auto& call : a.tool_calls) expectValidWeatherOrTimeCall(call);
    }
  }
}

TEST_F(E2eStructured, NamedToolChoiceCallsThatFunctionAndStreamsTheSameCalls) {
  json::object body = chatBody("What time is it in Tokyo?", 200);
  body["tools"] = weatherTools();
  body["tool_choice"] = json::object{{"type", "function"}, {"function", json::object{{"name", "get_time"}}}};
  const Answer plain = chat(body);
  ASSERT_EQ(plain.status, 200) << plain.raw;
  EXPECT_EQ(plain.finish_reason, "tool_calls");
  ASSERT_EQ(plain.tool_calls.size(), 1U) << plain.raw;
  EXPECT_EQ(plain.tool_calls[0].at("name").as_string(), "get_time");
  expectValidWeatherOrTimeCall(plain.tool_calls[0]);

  const Answer streamed = chatStream(body);
  ASSERT_EQ(streamed.status, 200);
  EXPECT_EQ(streamed.finish_reason, "tool_calls");
  EXPECT_EQ(streamed.token_ids, plain.token_ids);
  ASSERT_EQ(streamed.tool_calls.size(), plain.tool_calls.size());
  EXPECT_EQ(streamed.tool_calls[0].at("name"), plain.tool_calls[0].at("name"));
  EXPECT_EQ(streamed.tool_calls[0].at("arguments"), plain.tool_calls[0].at("arguments"));
  EXPECT_EQ(streamed.content, plain.content);
}

TEST_F(E2eStructured, ToolRoundTripThroughToolMessagesIsServed) {
  json::object first = chatBody("Weather in Oslo?", 200);
  first["tools"] = weatherTools();
  first["tool_choice"] = json::object{{"type", "function"}, {"function", json::object{{"name", "get_weather"}}}};
  const Answer call = chat(first);
  ASSERT_EQ(call.status, 200) << call.raw;
  ASSERT_EQ(call.tool_calls.size(), 1U);
  const json::value& c = call.tool_calls[0];
  json::object second = chatBody("", 8);
  second["tools"] = weatherTools();
  second["messages"] = json::array{
      json::object{{"role", "user"}, {"content", "Weather in Oslo?"}},
      json::object{
          {"role", "assistant"},
          {"content", nullptr},
          {"tool_calls", json::array{json::object{
                             {"id", c.at("id")},
                             {"type", "function"},
                             {"function", json::object{{"name", c.at("name")}, {"arguments", c.at("arguments")}}}}}}},
      json::object{{"role", "tool"}, {"tool_call_id", c.at("id")}, {"content", "{\"temperature\": 3}"}}};
  const Answer answer = chat(second);
  ASSERT_EQ(answer.status, 200) << answer.raw;
  // The template rendered the call and its output: the prompt holds the tool-call markers.
  const auto doc = json::parse(answer.raw);
  std::vector<std::int32_t> prompt;
  for (const auto& t : doc.at("prompt_token_ids").as_array()) prompt.push_back(static_cast<std::int32_t>(t.as_int64()));
  const std::string text = tokenizer_->decode(prompt);
  EXPECT_NE(text.find("<｜tool▁calls▁begin｜>"), std::string::npos) << text;
  EXPECT_NE(text.find("<｜tool▁output▁begin｜>{\"temperature\": 3}<｜tool▁output▁end｜>"), std::string::npos) << text;
  // A tool message without its tool_call_id is refused.
  second["messages"].as_array().back().as_object().erase("tool_call_id");
  EXPECT_EQ(chat(second).status, 400);
}

// The R1 template opens <think> in the prompt, so the answer is reasoning until </think>; a random
// model does not write </think>, so all of it is reasoning: the detokenized tokens, counted.
TEST_F(E2eStructured, ReasoningFromThePromptIsReasoningContentStreamedTheSame) {
  const json::object body = chatBody("Think about the sky.", 24);
  const Answer plain = chat(body);
  ASSERT_EQ(plain.status, 200) << plain.raw;
  std::vector<std::int32_t> ids(plain.token_ids.begin(), plain.token_ids.end());
  const std::string text = tokenizer_->decode(ids, /*skip_special_tokens=*/true);
  ASSERT_EQ(text.find("</think>"), std::string::npos) << "the random model wrote </think>; pick another prompt";
  EXPECT_EQ(plain.reasoning, text);
  EXPECT_TRUE(plain.content.empty());
  EXPECT_EQ(plain.reasoning_tokens, plain.completion_tokens);
  const Answer streamed = chatStream(body);
  ASSERT_EQ(streamed.status, 200);
  EXPECT_EQ(streamed.reasoning, plain.reasoning);
  EXPECT_EQ(streamed.content, plain.content);
  EXPECT_EQ(streamed.reasoning_tokens, plain.reasoning_tokens);
  EXPECT_EQ(streamed.token_ids, plain.token_ids);
}

}  // namespace
}  // namespace pd::test
