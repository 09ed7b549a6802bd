// The OpenAI front end's output parsing and constraints over real HTTP on port 0 with a scripted
// backend (fakes/fake_completion_backend.h): R1 reasoning split into reasoning_content with
// reasoning_tokens, DeepSeek-V3 tool calls parsed into message.tool_calls / delta.tool_calls
// (streaming equals non-streaming for every way of cutting the text into stream events), and the
// constraint a request carries to the backend (compiled first: an unsupported feature is a 400).

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fakes/fake_completion_backend.h"
#include "fakes/fake_prompt_renderer.h"
#include "pd/common/http_client.h"
#include "pd/common/metrics.h"
#include "pd/router/api_server.h"
#include "pd/structured/response_constraint.h"

namespace {

namespace json = boost::json;
using namespace std::chrono_literals;
using pd::FinishReason;
using pd::fakes::FakeCompletionBackend;
using pd::fakes::FakePromptRenderer;
using pd::fakes::Script;
using pd::router::ApiServer;
using pd::router::ApiServerOptions;
namespace structured = pd::structured;

constexpr std::string_view kModel = "test-model";
const pd::http::Headers kJsonHeaders{{"Content-Type", "application/json"}};

const std::string kToolCallText =
    "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
    "{\"utc_offset\": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";

std::string chatBody(std::string_view extra = {}) {
  return fmt::format(R"({{"model":"{}","messages":[{{"role":"user","content":"Hi"}}]{}{}}})", kModel,
                     extra.empty() ? "" : ",", extra);
}

constexpr std::string_view kTools =
    R"("tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object",
    "properties":{"city":{"type":"string","maxLength":10}},"required":["city"]}}},
    {"type":"function","function":{"name":"get_time"}}])";

/// The text cut into pieces at `cuts` (byte offsets, may split a UTF-8 character: the front end's
/// sanitizer holds an incomplete one back).
std::vector<std::string> cutAt(const std::string& text, std::vector<std::size_t> cuts) {
  std::vector<std::string> pieces;
  std::size_t from = 0;
  for (const std::size_t c : cuts) {
    pieces.push_back(text.substr(from, c - from));
    from = c;
  }
  pieces.push_back(text.substr(from));
  return pieces;
}

struct Parsed {
  int status = 0;
  std::string body;
  std::optional<std::string> content;  // nullopt: null
  std::string reasoning;
  json::array tool_calls;  // [{"id","name","arguments"}]
  std::string finish_reason;
  std::int64_t reasoning_tokens = -1;
};

class ApiServerOutputTest : public ::testing::Test {
 protected:
  void start(bool reasoning, bool prompt_opens_think) {
    ApiServerOptions o;
    o.served_model_name = std::string(kModel);
    o.max_model_len = 4096;
    o.http.io_threads = 2;
    o.request_timeout = 10s;
    o.tool_parser = structured::ToolCallFormat::DeepSeekV3;
    o.reasoning_parser = reasoning;
    o.prompt_opens_think = prompt_opens_think;
    // A byte vocabulary with the tool-call markers: enough to compile constraints.
    std::vector<std::optional<std::string>> bytes;
    for (int b = 0; b < 256; ++b) bytes.emplace_back(std::string(1, static_cast<char>(b)));
    bytes.emplace_back(std::nullopt);  // 256: EOS
    std::vector<std::pair<std::string, pd::TokenId>> added;
    pd::TokenId id = 257;
    for (const char* m : {"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                          "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"}) {
      added.emplace_back(m, id++);
      bytes.emplace_back(std::nullopt);
    }
    auto vocabulary = structured::TokenVocabulary::fromTokenBytes(bytes, bytes.size(), {256}, added);
    ASSERT_TRUE(vocabulary.ok()) << vocabulary.error().toString();
    o.grammars = std::make_shared<structured::GrammarCache>(*vocabulary, structured::ToolCallFormat::DeepSeekV3,
                                                            structured::GrammarOptions{}, 8);
    auto s = ApiServer::start(std::move(o), backend_, renderer_, registry_);
    ASSERT_TRUE(s.ok()) << s.error().toString();
    server_ = std::move(s).value();
  }

  Parsed whole(const std::string& body) {
    pd::http::Client client("127.0.0.1", server_->port());
    auto r = client.send({"POST", "/v1/chat/completions", kJsonHeaders, body}, 10s);
    EXPECT_TRUE(r.ok());
    Parsed p;
    if (!r.ok()) return p;
    p.status = r->status;
    p.body = r->body;
    if (p.status != 200) return p;
    const auto doc = json::parse(r->body);
    const auto& choice = doc.at("choices").at(0);
    const auto& message = choice.at("message").as_object();
    if (message.at("content").is_string()) p.content = std::string(message.at("content").as_string());
    if (const auto* rc = message.if_contains("reasoning_content"); rc != nullptr && rc->is_string()) {
      p.reasoning = std::string(rc->as_string());
    }
    if (const auto* calls = message.if_contains("tool_calls")) {
      for (const auto& c : calls->as_array()) {
        EXPECT_EQ(c.at("type").as_string(), "function");
        p.tool_calls.push_back(json::object{{"id", c.at("id")},
                                            {"name", c.at("function").at("name")},
                                            {"arguments", c.at("function").at("arguments")}});
      }
    }
    p.finish_reason = std::string(choice.at("finish_reason").as_string());
    if (const auto* d = doc.at("usage").as_object().if_contains("completion_tokens_details")) {
      p.reasoning_tokens = d->at("reasoning_tokens").as_int64();
    }
    return p;
  }

  Parsed streamed(const std::string& body) {
    pd::http::Client client("127.0.0.1", server_->port());
    Parsed p;
    bool any_content = false;
    auto r = client.streamEvents(
        {"POST", "/v1/chat/completions", kJsonHeaders, body}, 10s, [&](const pd::http::SseEvent& e) {
          if (e.data == "[DONE]") return true;
          const auto doc = json::parse(e.data);
          if (const auto* u = doc.as_object().if_contains("usage"); u && u->is_object()) {
            if (const auto* d = u->as_object().if_contains("completion_tokens_details")) {
              p.reasoning_tokens = d->at("reasoning_tokens").as_int64();
            }
          }
          for (const auto& c : doc.at("choices").as_array()) {
            const auto& delta = c.at("delta").as_object();
            if (const auto* t = delta.if_contains("content")) {
              any_content = any_content || !t->as_string().empty();
              p.content = p.content.value_or("") + std::string(t->as_string());
            }
            if (const auto* rc = delta.if_contains("reasoning_content")) {
              p.reasoning += rc->as_string();
            }
            if (const auto* calls = delta.if_contains("tool_calls")) {
              for (const auto& d : calls->as_array()) {
                const auto i = static_cast<std::size_t>(d.at("index").as_int64());
                if (i == p.tool_calls.size()) {
                  p.tool_calls.push_back(
                      json::object{{"id", d.at("id")}, {"name", d.at("function").at("name")}, {"arguments", ""}});
                }
                EXPECT_LT(i, p.tool_calls.size());
                if (i < p.tool_calls.size()) {
                  p.tool_calls[i].as_object()["arguments"].as_string() += d.at("function").at("arguments").as_string();
                }
              }
            }
            if (c.at("finish_reason").is_string()) {
              p.finish_reason = std::string(c.at("finish_reason").as_string());
            }
          }
          return true;
        });
    EXPECT_TRUE(r.ok());
    if (r.ok()) p.status = r->status;
    // The role chunk carries content "": a stream with nothing else has null content.
    if (!any_content) p.content.reset();
    if (p.content && p.content->empty()) p.content.reset();
    return p;
  }

  FakeCompletionBackend backend_;
  FakePromptRenderer renderer_;
  pd::metrics::Registry registry_;
  std::unique_ptr<ApiServer> server_;
};

TEST_F(ApiServerOutputTest, ToolCallsAreParsedAndStreamedTheSameAtEveryCut) {
  start(false, false);
  backend_.setScript(Script::fromPieces({kToolCallText}));
  const Parsed plain = whole(chatBody(kTools));
  ASSERT_EQ(plain.status, 200) << plain.body;
  EXPECT_EQ(plain.finish_reason, "tool_calls");
  EXPECT_EQ(plain.content, std::optional<std::string>("Sure."));
  ASSERT_EQ(plain.tool_calls.size(), 2U) << plain.body;
  EXPECT_EQ(plain.tool_calls[0].at("name").as_string(), "get_weather");
  EXPECT_EQ(plain.tool_calls[0].at("arguments").as_string(), "{\"city\": \"Paris\"}");
  EXPECT_EQ(plain.tool_calls[1].at("name").as_string(), "get_time");
  EXPECT_EQ(plain.tool_calls[1].at("arguments").as_string(), "{\"utc_offset\": 2}");
  EXPECT_NE(plain.tool_calls[0].at("id"), plain.tool_calls[1].at("id"));
  EXPECT_EQ(plain.reasoning_tokens, -1);  // no reasoning parser: no details
  for (std::size_t cut = 1; cut < kToolCallText.size(); cut += 7) {
    backend_.setScript(Script::fromPieces(cutAt(kToolCallText, {cut / 2, cut})));
    const Parsed s = streamed(chatBody(std::string(kTools) + R"(,"stream":true)"));
    ASSERT_EQ(s.status, 200);
    EXPECT_EQ(s.finish_reason, "tool_calls") << cut;
    EXPECT_EQ(s.content, plain.content) << cut;
    ASSERT_EQ(s.tool_calls.size(), 2U) << cut;
    for (std::size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(s.tool_calls[i].at("name"), plain.tool_calls[i].at("name")) << cut;
      EXPECT_EQ(s.tool_calls[i].at("arguments"), plain.tool_calls[i].at("arguments")) << cut;
    }
  }
}

TEST_F(ApiServerOutputTest, WithoutToolsOrWithToolChoiceNoneTheMarkersStayContent) {
  start(false, false);
  backend_.setScript(Script::fromPieces({kToolCallText}));
  const Parsed none = whole(chatBody(std::string(kTools) + R"(,"tool_choice":"none")"));
  ASSERT_EQ(none.status, 200);
  EXPECT_EQ(none.finish_reason, "stop");
  EXPECT_TRUE(none.tool_calls.empty());
  EXPECT_EQ(none.content, std::optional<std::string>(kToolCallText));
  const Parsed no_tools = whole(chatBody());
  EXPECT_EQ(no_tools.content, std::optional<std::string>(kToolCallText));
}

TEST_F(ApiServerOutputTest, ReasoningIsSplitAndCountedTheSameStreamedAtEveryCut) {
  start(true, false);
  const std::vector<std::string> tokens = {"<think>", "The sky", " is blue", ".</think>", "\n\n", "Blue", "."};
  backend_.setScript(Script::fromPieces(tokens));
  const Parsed plain = whole(chatBody());
  ASSERT_EQ(plain.status, 200) << plain.body;
  EXPECT_EQ(plain.reasoning, "The sky is blue.");
  EXPECT_EQ(plain.content, std::optional<std::string>("Blue."));
  EXPECT_EQ(plain.finish_reason, "stop");
  EXPECT_EQ(plain.reasoning_tokens, 4);  // <think>, two pieces, the piece that closes it
  const Parsed s = streamed(chatBody(R"("stream":true,"stream_options":{"include_usage":true})"));
  EXPECT_EQ(s.reasoning, plain.reasoning);
  EXPECT_EQ(s.content, plain.content);
  EXPECT_EQ(s.reasoning_tokens, plain.reasoning_tokens);
  std::string text;
  for (const auto& t : tokens) text += t;
  for (std::size_t cut = 1; cut < text.size(); ++cut) {
    backend_.setScript(Script::fromPieces(cutAt(text, {cut})));
    const Parsed c = streamed(chatBody(R"("stream":true)"));
    EXPECT_EQ(c.reasoning, plain.reasoning) << cut;
    EXPECT_EQ(c.content, plain.content) << cut;
  }
}

TEST_F(ApiServerOutputTest, ReasoningOpenedByThePromptThenToolCalls) {
  start(true, true);
  backend_.setScript(Script::fromPieces({"Need the weather.", "</think>", kToolCallText}));
  const Parsed plain = whole(chatBody(kTools));
  ASSERT_EQ(plain.status, 200) << plain.body;
  EXPECT_EQ(plain.reasoning, "Need the weather.");
  EXPECT_EQ(plain.content, std::optional<std::string>("Sure."));
  EXPECT_EQ(plain.tool_calls.size(), 2U);
  EXPECT_EQ(plain.finish_reason, "tool_calls");
  EXPECT_EQ(plain.reasoning_tokens, 2);
  const Parsed s = streamed(chatBody(std::string(kTools) + R"(,"stream":true)"));
  EXPECT_EQ(s.reasoning, plain.reasoning);
  EXPECT_EQ(s.content, plain.content);
  ASSERT_EQ(s.tool_calls.size(), plain.tool_calls.size());
  for (std::size_t i = 0; i < s.tool_calls.size(); ++i) {  // ids are per response
    EXPECT_EQ(s.tool_calls[i].at("name"), plain.tool_calls[i].at("name"));
    EXPECT_EQ(s.tool_calls[i].at("arguments"), plain.tool_calls[i].at("arguments"));
  }
}

TEST_F(ApiServerOutputTest, ConstraintsReachTheBackendCompiledAndEncoded) {
  start(true, true);
  backend_.setScript(Script::fromPieces({"{}"}));
  // json_schema: encoded for the workers; no reasoning split on a constrained answer.
  const Parsed a = whole(chatBody(
      R"("response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object"},"strict":true}})"));
  ASSERT_EQ(a.status, 200) << a.body;
  EXPECT_EQ(a.content, std::optional<std::string>("{}"));
  EXPECT_TRUE(a.reasoning.empty());
  auto requests = backend_.requests();
  ASSERT_EQ(requests.size(), 1U);
  auto decoded = structured::decodeConstraint(requests[0].constraint);
  ASSERT_TRUE(decoded.ok()) << requests[0].constraint;
  EXPECT_EQ(decoded->kind, structured::ResponseConstraint::Kind::JsonSchema);
  EXPECT_EQ(decoded->schema_json, R"({"type":"object"})");
  // tool_choice named: the tool-call constraint of that one function, with the format.
  ASSERT_EQ(
      whole(chatBody(std::string(kTools) + R"(,"tool_choice":{"type":"function","function":{"name":"get_time"}})"))
          .status,
      200);
  requests = backend_.requests();
  ASSERT_EQ(requests.size(), 2U);
  decoded = structured::decodeConstraint(requests[1].constraint);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(decoded->kind, structured::ResponseConstraint::Kind::ToolCalls);
  ASSERT_EQ(decoded->tools.size(), 1U);
  EXPECT_EQ(decoded->tools[0].name, "get_time");
  EXPECT_EQ(requests[1].tool_call_format, "deepseek_v3");
  // Free text carries no constraint.
  ASSERT_EQ(whole(chatBody()).status, 200);
  EXPECT_TRUE(backend_.requests().back().constraint.empty());
}

TEST_F(ApiServerOutputTest, BadConstraintsAre400NamingTheProblem) {
  start(false, false);
  backend_.setScript(Script::fromPieces({"x"}));
  const Parsed feature = whole(chatBody(
      R"("response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"string","not":{"const":"a"}}}})"));
  EXPECT_EQ(feature.status, 400);
  EXPECT_NE(feature.body.find("'not'"), std::string::npos) << feature.body;
  EXPECT_EQ(whole(chatBody(R"("response_format":{"type":"xml"})")).status, 400);
  EXPECT_EQ(whole(chatBody(R"("tool_choice":"required")")).status, 400);  // no tools
  EXPECT_EQ(
      whole(chatBody(std::string(kTools) + R"(,"tool_choice":"required","response_format":{"type":"json_object"})"))
          .status,
      400);
  EXPECT_EQ(whole(chatBody(R"("response_format":{"type":"json_object"},"ignore_eos":true)")).status, 400);
  EXPECT_EQ(whole(chatBody(R"("functions":[{"name":"f"}])")).status, 400);
  EXPECT_TRUE(backend_.requests().empty());
  // Tool and assistant-with-calls messages are accepted; a tool message needs its call id.
  const std::string round_trip = fmt::format(
      R"({{"model":"{}","messages":[{{"role":"user","content":"Hi"}},{{"role":"assistant","content":null,
      "tool_calls":[{{"id":"call_1","type":"function","function":{{"name":"get_time","arguments":"{{}}"}}}}]}},
      {{"role":"tool","tool_call_id":"call_1","content":"12:00"}}],{}}})",
      kModel, kTools);
  EXPECT_EQ(whole(round_trip).status, 200) << whole(round_trip).body;
}

}  // namespace
