// The OpenAI front end end to end over real HTTP on port 0: a real server, a real client, a
// scripted backend (fakes/fake_completion_backend.h) and a byte-level fake tokenizer.

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/json.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fakes/fake_completion_backend.h"
#include "fakes/fake_prompt_renderer.h"
#include "fakes/raw_http_peer.h"
#include "pd/common/http_client.h"
#include "pd/common/metrics.h"
#include "pd/router/api_server.h"
#include "pd/trace/trace_context.h"
#include "pd/trace/tracer.h"

namespace {

namespace json = boost::json;
using namespace std::chrono_literals;
using pd::FinishReason;
using pd::TokenId;
using pd::fakes::FakeCompletionBackend;
using pd::fakes::FakePromptRenderer;
using pd::fakes::RawHttpPeer;
using pd::fakes::Script;
using pd::http::ClientResponse;
using pd::router::ApiServer;
using pd::router::ApiServerOptions;
using pd::router::TokenDelta;

constexpr std::string_view kModel = "test-model";
constexpr std::string_view kMarker = "ZQX-secret-input";
const pd::http::Headers kJsonHeaders{{"Content-Type", "application/json"}};

std::string chatBody(std::string_view extra = {}, std::string_view content = "Hi") {
  return fmt::format(R"({{"model":"{}","messages":[{{"role":"user","content":"{}"}}]{}{}}})", kModel, content,
                     extra.empty() ? "" : ",", extra);
}

std::string completionBody(std::string_view prompt_json, std::string_view extra = {}) {
  return fmt::format(R"({{"model":"{}","prompt":{}{}{}}})", kModel, prompt_json, extra.empty() ? "" : ",", extra);
}

/// Prompt ids the fake renderer gives the default chat body.
std::vector<TokenId> chatPromptIds(std::string_view content = "Hi") {
  return FakePromptRenderer::idsOf(FakePromptRenderer::chatText({{"user", std::string(content)}}));
}

json::value parseJson(std::string_view text) {
  boost::system::error_code ec;
  json::value v = json::parse(text, ec);
  EXPECT_FALSE(ec) << "not JSON: " << text;
  return v;
}

std::vector<std::int64_t> intsOf(const json::value& v) {
  std::vector<std::int64_t> out;
  for (const auto& x : v.as_array()) out.push_back(x.to_number<std::int64_t>());
  return out;
}

std::vector<std::int64_t> toInts(const std::vector<TokenId>& ids) {
  return {ids.begin(), ids.end()};
}

template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout = 5s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(2ms);
  }
  return pred();
}

struct Streamed {
  ClientResponse response;
  std::vector<std::string> data;  ///< each event's data, "[DONE]" included
  std::vector<json::value> chunks() const {
    std::vector<json::value> out;
    for (const auto& d : data) {
      if (d != "[DONE]") out.push_back(parseJson(d));
    }
    return out;
  }
};

class ApiServerTest : public ::testing::Test {
 protected:
  static ApiServerOptions defaultOptions() {
    ApiServerOptions o;
    o.served_model_name = std::string(kModel);
    o.max_model_len = 128;
    o.http.io_threads = 4;
    o.request_timeout = 10s;
    return o;
  }

  void start(ApiServerOptions o = defaultOptions()) {
    auto s = ApiServer::start(std::move(o), backend_, renderer_, registry_);
    ASSERT_TRUE(s.ok()) << s.error().toString();
    server_ = std::move(s).value();
  }

  ClientResponse send(std::string method, std::string path, std::string body = {},
                      pd::http::Headers headers = kJsonHeaders) {
    pd::http::Client client("127.0.0.1", server_->port());
    auto r = client.send({std::move(method), std::move(path), std::move(headers), std::move(body)}, 10s);
    EXPECT_TRUE(r.ok()) << r.error().toString();
    return r.ok() ? std::move(r).value() : ClientResponse{};
  }
  ClientResponse post(std::string path, std::string body, pd::http::Headers headers = kJsonHeaders) {
    return send("POST", std::move(path), std::move(body), std::move(headers));
  }

  /// Streams a request; stops (closing the connection) after `stop_after` events if >= 0.
  Streamed stream(std::string path, std::string body, int stop_after = -1, pd::http::Headers headers = kJsonHeaders) {
    pd::http::Client client("127.0.0.1", server_->port());
    Streamed out;
    auto r = client.streamEvents({"POST", std::move(path), std::move(headers), std::move(body)}, 10s,
                                 [&](const pd::http::SseEvent& e) {
                                   out.data.push_back(e.data);
                                   return stop_after < 0 || static_cast<int>(out.data.size()) < stop_after;
                                 });
    EXPECT_TRUE(r.ok()) << r.error().toString();
    if (r.ok()) out.response = std::move(r).value();
    return out;
  }

  /// The body is an OpenAI error object with exactly these fields and never the marker.
  static void expectError(const ClientResponse& r, int status, std::string_view type, std::string_view code,
                          std::string_view message_part) {
    EXPECT_EQ(r.status, status) << r.body;
    EXPECT_EQ(r.header("Content-Type"), "application/json");
    EXPECT_EQ(r.body.find(kMarker), std::string::npos) << "echoes input: " << r.body;
    const json::value v = parseJson(r.body);
    ASSERT_TRUE(v.is_object());
    ASSERT_EQ(v.as_object().size(), 1u) << r.body;
    const json::object& e = v.at("error").as_object();
    EXPECT_EQ(e.size(), 4u);
    EXPECT_EQ(e.at("type").as_string(), type);
    // param: null, or the parameter the message names first (OpenAI's field; the SDKs expose it).
    if (!e.at("param").is_null()) {
      const std::string param(e.at("param").as_string());
      const std::string message(e.at("message").as_string());
      EXPECT_TRUE(message.starts_with("'" + param + "'") || (param == "model" && status == 404)) << r.body;
    }
    if (code.empty()) {
      EXPECT_TRUE(e.at("code").is_null()) << r.body;
    } else {
      EXPECT_EQ(e.at("code").as_string(), code) << r.body;
    }
    EXPECT_NE(std::string(e.at("message").as_string()).find(message_part), std::string::npos) << r.body;
  }

  pd::metrics::Registry registry_;  // outlives the backend and the server
  FakeCompletionBackend backend_;   // outlives the server (it may deliver late events)
  FakePromptRenderer renderer_;
  std::unique_ptr<ApiServer> server_;
};

TEST_F(ApiServerTest, ChatCompletionNonStreaming) {
  backend_.setScript(Script::fromPieces({"Hel", "lo", "!"}));
  start();
  const auto r = post("/v1/chat/completions", chatBody());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.header("Content-Type"), "application/json");
  const json::value v = parseJson(r.body);
  EXPECT_TRUE(std::string(v.at("id").as_string()).starts_with("chatcmpl-"));
  EXPECT_EQ(r.header("X-Request-Id"), v.at("id").as_string());
  EXPECT_EQ(v.at("object").as_string(), "chat.completion");
  EXPECT_TRUE(v.at("created").is_int64());
  EXPECT_EQ(v.at("model").as_string(), kModel);
  const auto& choices = v.at("choices").as_array();
  ASSERT_EQ(choices.size(), 1u);
  EXPECT_EQ(choices[0].at("index").as_int64(), 0);
  EXPECT_EQ(choices[0].at("message").at("role").as_string(), "assistant");
  EXPECT_EQ(choices[0].at("message").at("content").as_string(), "Hello!");
  EXPECT_TRUE(choices[0].at("logprobs").is_null());
  EXPECT_EQ(choices[0].at("finish_reason").as_string(), "stop");
  const auto prompt_tokens = static_cast<std::int64_t>(chatPromptIds().size());
  EXPECT_EQ(v.at("usage").at("prompt_tokens").as_int64(), prompt_tokens);
  EXPECT_EQ(v.at("usage").at("completion_tokens").as_int64(), 3);
  EXPECT_EQ(v.at("usage").at("total_tokens").as_int64(), prompt_tokens + 3);
  EXPECT_FALSE(v.as_object().contains("prompt_token_ids"));
  EXPECT_FALSE(choices[0].as_object().contains("token_ids"));
}

TEST_F(ApiServerTest, ChatStreamingMatchesNonStreaming) {
  backend_.setScript(Script::fromPieces({"Hel", "lo", " wor", "ld"}, FinishReason::Length));
  start();
  const auto whole = parseJson(post("/v1/chat/completions", chatBody()).body);
  const Streamed s = stream("/v1/chat/completions", chatBody(R"("stream":true)"));
  EXPECT_EQ(s.response.status, 200);
  EXPECT_EQ(s.response.header("Content-Type"), "text/event-stream; charset=utf-8");
  ASSERT_FALSE(s.data.empty());
  EXPECT_EQ(s.data.back(), "[DONE]");
  const auto chunks = s.chunks();
  ASSERT_EQ(chunks.size(), 6u);  // role, 4 pieces, finish
  std::string text;
  for (const auto& c : chunks) {
    EXPECT_EQ(c.at("object").as_string(), "chat.completion.chunk");
    EXPECT_EQ(c.at("id"), chunks[0].at("id"));
    EXPECT_EQ(c.at("model").as_string(), kModel);
    EXPECT_FALSE(c.as_object().contains("usage"));
    const auto& choice = c.at("choices").as_array().at(0);
    EXPECT_EQ(choice.at("index").as_int64(), 0);
    if (const auto* content = choice.at("delta").as_object().if_contains("content")) text += content->as_string();
  }
  EXPECT_EQ(chunks[0].at("choices").at(0).at("delta"), parseJson(R"({"role":"assistant","content":""})"));
  EXPECT_TRUE(chunks[0].at("choices").at(0).at("finish_reason").is_null());
  EXPECT_EQ(chunks.back().at("choices").at(0).at("delta"), parseJson("{}"));
  EXPECT_EQ(chunks.back().at("choices").at(0).at("finish_reason").as_string(), "length");
  EXPECT_EQ(text, whole.at("choices").at(0).at("message").at("content").as_string());
  EXPECT_EQ(whole.at("choices").at(0).at("finish_reason").as_string(), "length");
}

// n = 3 through the front end (the fake backend starts one generation per choice, the default
// CompletionBackend::startChoices): one choice per index, each with its own finish, usage summed
// over the choices with the prompt once; streaming chunks carry their choice's index, every
// choice gets a role chunk and a finish chunk, and one [DONE] ends the stream.
TEST_F(ApiServerTest, SeveralChoicesNonStreamingAndStreaming) {
  backend_.setScript(Script::fromPieces({"Hel", "lo", "!"}));
  start();
  const auto r = post("/v1/chat/completions", chatBody(R"("n":3,"seed":5)"));
  ASSERT_EQ(r.status, 200) << r.body;
  const json::value v = parseJson(r.body);
  const auto& choices = v.at("choices").as_array();
  ASSERT_EQ(choices.size(), 3u);
  for (std::int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(choices[static_cast<std::size_t>(i)].at("index").as_int64(), i);
    EXPECT_EQ(choices[static_cast<std::size_t>(i)].at("message").at("content").as_string(), "Hello!");
    EXPECT_EQ(choices[static_cast<std::size_t>(i)].at("finish_reason").as_string(), "stop");
  }
  const auto prompt_tokens = static_cast<std::int64_t>(chatPromptIds().size());
  EXPECT_EQ(v.at("usage").at("prompt_tokens").as_int64(), prompt_tokens);
  EXPECT_EQ(v.at("usage").at("completion_tokens").as_int64(), 9);
  EXPECT_EQ(v.at("usage").at("total_tokens").as_int64(), prompt_tokens + 9);
  // Each choice is its own generation with its own seed: choice 0 keeps the client's.
  const auto requests = backend_.requests();
  ASSERT_EQ(requests.size(), 3u);
  std::set<std::int64_t> seeds;
  for (const auto& g : requests) seeds.insert(g.seed.value_or(-1));
  EXPECT_EQ(seeds.size(), 3u);
  EXPECT_TRUE(seeds.contains(5));

  const Streamed s =
      stream("/v1/chat/completions", chatBody(R"("n":3,"stream":true,"stream_options":{"include_usage":true})"));
  EXPECT_EQ(s.response.status, 200);
  ASSERT_FALSE(s.data.empty());
  EXPECT_EQ(s.data.back(), "[DONE]");
  EXPECT_EQ(std::count(s.data.begin(), s.data.end(), "[DONE]"), 1);
  std::map<std::int64_t, std::string> text;
  std::map<std::int64_t, int> roles;
  std::map<std::int64_t, int> finishes;
  std::optional<json::value> usage;
  for (const auto& c : s.chunks()) {
    if (c.at("choices").as_array().empty()) {
      usage = c.at("usage");
      continue;
    }
    const auto& choice = c.at("choices").at(0);
    const std::int64_t index = choice.at("index").as_int64();
    const auto& delta = choice.at("delta").as_object();
    if (delta.contains("role")) ++roles[index];
    if (const auto* content = delta.if_contains("content")) text[index] += content->as_string();
    if (!choice.at("finish_reason").is_null()) ++finishes[index];
  }
  for (std::int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(text[i], "Hello!") << i;
    EXPECT_EQ(roles[i], 1) << i;
    EXPECT_EQ(finishes[i], 1) << i;
  }
  ASSERT_TRUE(usage.has_value());
  EXPECT_EQ(usage->at("completion_tokens").as_int64(), 9);
}

// One choice failing fails the request and aborts the others.
TEST_F(ApiServerTest, OneChoiceFailingFailsTheRequest) {
  Script failing = Script::fromPieces({"a"});
  failing.error = pd::makeError(pd::ErrorCode::PeerFailed, "the decode worker died");
  backend_.setScript(failing);
  start();
  const auto r = post("/v1/chat/completions", chatBody(R"("n":2)"));
  EXPECT_EQ(r.status, 502) << r.body;
}

TEST_F(ApiServerTest, IncludeUsageAddsNullUsageAndAFinalUsageChunk) {
  backend_.setScript(Script::fromPieces({"a", "b"}));
  start();
  const Streamed s =
      stream("/v1/chat/completions", chatBody(R"("stream":true,"stream_options":{"include_usage":true})"));
  const auto chunks = s.chunks();
  ASSERT_EQ(chunks.size(), 5u);  // role, a, b, finish, usage
  for (std::size_t i = 0; i + 1 < chunks.size(); ++i) EXPECT_TRUE(chunks[i].at("usage").is_null());
  const auto& last = chunks.back();
  EXPECT_TRUE(last.at("choices").as_array().empty());
  const auto prompt_tokens = static_cast<std::int64_t>(chatPromptIds().size());
  EXPECT_EQ(last.at("usage"), parseJson(fmt::format(R"({{"prompt_tokens":{},"completion_tokens":2,"total_tokens":{}}})",
                                                    prompt_tokens, prompt_tokens + 2)));
  EXPECT_EQ(s.data.back(), "[DONE]");
}

TEST_F(ApiServerTest, CompletionsWithTokenIdsAndReturnTokenIdsAgreeAcrossModes) {
  backend_.setScript(Script::fromPieces({"x", "y", "z"}));
  start();
  const std::string body = completionBody("[1,72,105]", R"("max_tokens":3,"return_token_ids":true)");
  const ClientResponse r = post("/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  const json::value v = parseJson(r.body);
  EXPECT_TRUE(std::string(v.at("id").as_string()).starts_with("cmpl-"));
  EXPECT_EQ(v.at("object").as_string(), "text_completion");
  const auto& choice = v.at("choices").at(0);
  EXPECT_EQ(choice.at("text").as_string(), "xyz");
  EXPECT_EQ(intsOf(choice.at("prompt_token_ids")), (std::vector<std::int64_t>{1, 72, 105}));
  EXPECT_EQ(intsOf(choice.at("token_ids")), (std::vector<std::int64_t>{1000, 1001, 1002}));
  EXPECT_EQ(v.at("usage").at("prompt_tokens").as_int64(), 3);
  EXPECT_EQ(v.at("usage").at("completion_tokens").as_int64(), 3);

  const Streamed s = stream("/v1/completions",
                            completionBody("[1,72,105]", R"("max_tokens":3,"return_token_ids":true,"stream":true)"));
  const auto chunks = s.chunks();
  ASSERT_EQ(chunks.size(), 4u);  // x, y, z, finish
  std::string text;
  std::vector<std::int64_t> ids;
  for (const auto& c : chunks) {
    EXPECT_EQ(c.at("object").as_string(), "text_completion");
    const auto& ch = c.at("choices").at(0);
    text += ch.at("text").as_string();
    for (auto id : intsOf(ch.at("token_ids"))) ids.push_back(id);
  }
  EXPECT_EQ(intsOf(chunks[0].at("choices").at(0).at("prompt_token_ids")), (std::vector<std::int64_t>{1, 72, 105}));
  EXPECT_FALSE(chunks[1].at("choices").at(0).as_object().contains("prompt_token_ids"));
  EXPECT_EQ(text, "xyz");
  EXPECT_EQ(ids, (std::vector<std::int64_t>{1000, 1001, 1002}));
  EXPECT_EQ(chunks.back().at("choices").at(0).at("finish_reason").as_string(), "stop");
}

TEST_F(ApiServerTest, ChatReturnTokenIds) {
  backend_.setScript(Script::fromPieces({"a", "b"}));
  start();
  const json::value v = parseJson(post("/v1/chat/completions", chatBody(R"("return_token_ids":true)")).body);
  EXPECT_EQ(intsOf(v.at("prompt_token_ids")), toInts(chatPromptIds()));
  EXPECT_EQ(intsOf(v.at("choices").at(0).at("token_ids")), (std::vector<std::int64_t>{1000, 1001}));
  const auto chunks = stream("/v1/chat/completions", chatBody(R"("return_token_ids":true,"stream":true)")).chunks();
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_EQ(intsOf(chunks[0].at("prompt_token_ids")), toInts(chatPromptIds()));
  EXPECT_EQ(intsOf(chunks[1].at("choices").at(0).at("token_ids")), (std::vector<std::int64_t>{1000}));
  EXPECT_EQ(intsOf(chunks[2].at("choices").at(0).at("token_ids")), (std::vector<std::int64_t>{1001}));
}

TEST_F(ApiServerTest, RequestReachesTheBackendWithEveryParameter) {
  backend_.setScript(Script::fromPieces({"ok"}));
  start();
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(post("/v1/chat/completions",
                 chatBody(R"("max_tokens":7,"temperature":0.5,"top_p":0.8,"top_k":40,"seed":-3,"stop":["\n","END"],)"
                          R"("stop_token_ids":[5],"presence_penalty":0.25,"frequency_penalty":-0.25,)"
                          R"("logprobs":true,"top_logprobs":2,"ignore_eos":true,"user":"u")"))
                .status,
            200);
  ASSERT_EQ(post("/v1/chat/completions", chatBody()).status, 200);
  ASSERT_EQ(post("/v1/completions", completionBody(R"("abc")")).status, 200);
  const auto reqs = backend_.requests();
  ASSERT_EQ(reqs.size(), 3u);
  const auto& g = reqs[0];
  EXPECT_TRUE(g.request_id.starts_with("chatcmpl-"));
  EXPECT_EQ(g.prompt_token_ids, chatPromptIds());
  EXPECT_EQ(g.max_tokens, 7);
  EXPECT_EQ(g.sampling.temperature, 0.5);
  EXPECT_EQ(g.sampling.top_p, 0.8);
  EXPECT_EQ(g.sampling.top_k, 40);
  EXPECT_EQ(g.seed, -3);
  EXPECT_EQ(g.sampling.presence_penalty, 0.25);
  EXPECT_EQ(g.sampling.frequency_penalty, -0.25);
  EXPECT_EQ(g.stop, (std::vector<std::string>{"\n", "END"}));
  EXPECT_EQ(g.stop_token_ids, std::vector<TokenId>{5});
  EXPECT_TRUE(g.ignore_eos);
  EXPECT_TRUE(g.logprobs);
  EXPECT_EQ(g.sampling.top_logprobs, 2);
  EXPECT_GT(g.deadline, t0 + 9s);
  EXPECT_LT(g.deadline, t0 + 11s);
  // Defaults: chat may use the rest of the context; completions generate 16.
  EXPECT_EQ(reqs[1].max_tokens, 128 - static_cast<std::int64_t>(chatPromptIds().size()));
  EXPECT_FALSE(reqs[1].logprobs);
  EXPECT_FALSE(reqs[1].seed);
  EXPECT_EQ(reqs[2].max_tokens, 16);
  EXPECT_EQ(reqs[2].prompt_token_ids, FakePromptRenderer::idsOf("abc"));
  EXPECT_NE(reqs[0].request_id, reqs[1].request_id);
}

TEST_F(ApiServerTest, InvalidRequestsGet400WithoutEchoingInput) {
  start();
  expectError(post("/v1/chat/completions", "{\"model\": \"ZQX-secret-input"), 400, "invalid_request_error", "",
              "not valid JSON");
  expectError(post("/v1/chat/completions", chatBody({}, "ZQX-secret-input \xC0\x80")), 400, "invalid_request_error", "",
              "not valid UTF-8");
  expectError(post("/v1/chat/completions", chatBody({}, "ZQX-secret-input \\udc00")), 400, "invalid_request_error", "",
              "surrogate");
  expectError(post("/v1/chat/completions", chatBody(R"("n":17)")), 400, "invalid_request_error", "",
              "'n' must be at most 16 (router.max_n)");
  expectError(post("/v1/chat/completions", chatBody(R"("temperature":"ZQX-secret-input")")), 400,
              "invalid_request_error", "", "'temperature'");
  expectError(post("/v1/completions", completionBody("[1,266]")), 400, "invalid_request_error", "",
              "outside the vocabulary");
  expectError(post("/v1/completions", completionBody("[1]", R"("stop_token_ids":[300])")), 400, "invalid_request_error",
              "", "outside the vocabulary");
  // The error's param names the parameter, as OpenAI's does; an unknown parameter included.
  const auto param = [&](const std::string& extra) {
    const auto r = post("/v1/chat/completions", chatBody(extra));
    EXPECT_EQ(r.status, 400) << r.body;
    const json::value doc = parseJson(r.body);
    const json::value& p = doc.at("error").at("param");
    return p.is_string() ? std::string(p.as_string()) : std::string("null");
  };
  EXPECT_EQ(param(R"("temperature":9)"), "temperature");
  EXPECT_EQ(param(R"("repetition_penalty":1.2)"), "repetition_penalty");
  EXPECT_EQ(param(R"("stream":true,"stream_options":{"extra":1})"), "stream_options.extra");
  EXPECT_EQ(param(R"("ZQX-secret-input and more":1)"), "null");
  EXPECT_TRUE(backend_.requests().empty());
}

TEST_F(ApiServerTest, UnknownModelIs404) {
  start();
  const std::string body = R"({"model":"ZQX-secret-input","messages":[{"role":"user","content":"x"}]})";
  expectError(post("/v1/chat/completions", body), 404, "invalid_request_error", "model_not_found", "does not exist");
  const json::value doc = parseJson(post("/v1/chat/completions", body).body);
  EXPECT_EQ(doc.at("error").at("param").as_string(), "model");
}

TEST_F(ApiServerTest, ContextLengthIsEnforced) {
  backend_.setScript(Script::fromPieces({"ok"}));
  start();
  const auto room = 128 - static_cast<std::int64_t>(chatPromptIds().size());
  expectError(post("/v1/chat/completions", chatBody(fmt::format(R"("max_tokens":{})", room + 1))), 400,
              "invalid_request_error", "context_length_exceeded", "context length of 128");
  EXPECT_EQ(post("/v1/chat/completions", chatBody(fmt::format(R"("max_tokens":{})", room))).status, 200);
  std::string ids = "[1";
  for (int i = 1; i < 128; ++i) ids += ",20";
  ids += "]";
  expectError(post("/v1/completions", completionBody(ids)), 400, "invalid_request_error", "context_length_exceeded",
              "leaves no room");
  // Near the end of the context the completions default shrinks to what fits.
  std::string long_prompt = "[1";
  for (int i = 1; i < 120; ++i) long_prompt += ",20";
  long_prompt += "]";
  EXPECT_EQ(post("/v1/completions", completionBody(long_prompt)).status, 200);
  EXPECT_EQ(backend_.requests().back().max_tokens, 8);
}

TEST_F(ApiServerTest, RendererErrors) {
  start();
  renderer_.fail_with = pd::makeError(pd::ErrorCode::InvalidArgument, "conversation roles must alternate");
  expectError(post("/v1/chat/completions", chatBody()), 400, "invalid_request_error", "", "roles must alternate");
  renderer_.fail_with = pd::makeError(pd::ErrorCode::Internal, "template exploded at /secret/path");
  const auto r = post("/v1/chat/completions", chatBody());
  expectError(r, 500, "server_error", "internal_error", "could not be rendered");
  EXPECT_EQ(r.body.find("/secret/path"), std::string::npos);
}

TEST_F(ApiServerTest, HttpLevelErrorsUseTheOpenAiShape) {
  ApiServerOptions o = defaultOptions();
  o.http.max_body_bytes = 2048;
  start(o);
  expectError(post("/v1/chat/completions", chatBody({}, std::string(4096, 'a'))), 413, "invalid_request_error",
              "request_too_large", "larger than the limit");
  expectError(send("GET", "/v1/chat/completions"), 405, "invalid_request_error", "", "not allowed");
  expectError(post("/v1/embeddings", "{}"), 404, "invalid_request_error", "not_found", "no such endpoint");
}

TEST_F(ApiServerTest, ApiKeysAreRequiredExceptOnProbes) {
  ApiServerOptions o = defaultOptions();
  o.api_keys = pd::router::ApiKeySet({"sk-good", "sk-other"});
  backend_.setScript(Script::fromPieces({"ok"}));
  start(o);
  const auto missing = post("/v1/chat/completions", chatBody());
  expectError(missing, 401, "invalid_request_error", "invalid_api_key", "missing API key");
  EXPECT_EQ(missing.header("WWW-Authenticate"), "Bearer");
  expectError(post("/v1/chat/completions", chatBody(),
                   {{"Content-Type", "application/json"}, {"Authorization", "Bearer ZQX-secret-input"}}),
              401, "invalid_request_error", "invalid_api_key", "invalid API key");
  expectError(post("/v1/chat/completions", chatBody(), {{"Authorization", "Basic c2stZ29vZA=="}}), 401,
              "invalid_request_error", "invalid_api_key", "invalid API key");
  EXPECT_EQ(post("/v1/chat/completions", chatBody(), {{"Authorization", "bearer sk-other"}}).status, 200);
  EXPECT_EQ(post("/v1/completions", completionBody(R"("a")"), {{"Authorization", "Bearer sk-good"}}).status, 200);
  expectError(send("GET", "/v1/models"), 401, "invalid_request_error", "invalid_api_key", "missing");
  EXPECT_EQ(send("GET", "/v1/models", {}, {{"Authorization", "Bearer sk-good"}}).status, 200);
  EXPECT_EQ(send("GET", "/health").status, 200);
  EXPECT_EQ(send("GET", "/ready").status, 200);
  EXPECT_EQ(send("GET", "/metrics").status, 200);
  EXPECT_EQ(backend_.requests().size(), 2u);
}

// Per-key limits: a key at its max_concurrent gets 429 "requests" with the configured
// Retry-After, other keys go on, and the slot is back once the client has its answer.
TEST_F(ApiServerTest, KeyConcurrencyLimitIs429UntilTheRequestEnds) {
  ApiServerOptions o = defaultOptions();
  o.api_keys = pd::router::ApiKeySet::withLimits({{"sk-one", {.max_concurrent = 1}}, {"sk-free", {}}});
  o.retry_after = std::chrono::seconds(7);
  Script stuck;
  stuck.hang = true;
  backend_.setScript(stuck);
  start(o);
  const pd::http::Headers one{{"Content-Type", "application/json"}, {"Authorization", "Bearer sk-one"}};
  const pd::http::Headers free{{"Content-Type", "application/json"}, {"Authorization", "Bearer sk-free"}};
  const std::string body = chatBody();
  {
    RawHttpPeer a(server_->port());
    ASSERT_TRUE(
        a.send(fmt::format("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-one\r\n"
                           "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
                           body.size(), body)));
    ASSERT_TRUE(eventually([&] { return backend_.active() == 1; }));
    const auto r = post("/v1/chat/completions", body, one);
    expectError(r, 429, "requests", "rate_limit_exceeded", "1 request(s) in flight");
    EXPECT_EQ(r.header("Retry-After"), "7");
    backend_.setScript(Script::fromPieces({"ok"}));
    EXPECT_EQ(post("/v1/chat/completions", body, free).status, 200) << "another key is not limited";
  }  // the client hangs up: its generation is aborted and its slot freed
  ASSERT_TRUE(backend_.waitIdle(5s));
  EXPECT_EQ(post("/v1/chat/completions", body, one).status, 200);
  EXPECT_EQ(post("/v1/chat/completions", body, one).status, 200);
  const std::string metrics = send("GET", "/metrics").body;
  EXPECT_NE(metrics.find(R"(pdserve_router_rate_limited_total{limit="concurrent"} 1)"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find(R"(pdserve_router_requests_total{endpoint="/v1/chat/completions",status="429"} 1)"),
            std::string::npos);
}

// tokens_per_minute: prompt + max_tokens reserved at admission, corrected to what was used when
// the answer goes out; 429 "tokens" with the seconds until the window has room.
TEST_F(ApiServerTest, KeyTokenLimitReservesThenChargesWhatWasUsed) {
  const auto prompt = static_cast<std::int64_t>(chatPromptIds().size());
  ApiServerOptions o = defaultOptions();
  o.max_model_len = 4096;
  // Room for two requests that each generate one token, but not for two whole reservations.
  o.api_keys = pd::router::ApiKeySet::withLimits({{"sk-tok", {.tokens_per_minute = 2 * prompt + 11}}});
  backend_.setScript(Script::fromPieces({"ok"}));
  start(o);
  const pd::http::Headers tok{{"Content-Type", "application/json"}, {"Authorization", "Bearer sk-tok"}};
  const std::string body = chatBody(R"("max_tokens":10)");
  ClientResponse r = post("/v1/chat/completions", body, tok);
  ASSERT_EQ(r.status, 200) << r.body;
  r = post("/v1/chat/completions", body, tok);
  ASSERT_EQ(r.status, 200) << "the first request was charged prompt + 1, not prompt + 10: " << r.body;
  r = post("/v1/chat/completions", body, tok);
  expectError(r, 429, "tokens", "rate_limit_exceeded", "tokens per minute");
  ASSERT_FALSE(r.header("Retry-After").empty());
  const int retry = std::stoi(std::string(r.header("Retry-After")));
  EXPECT_GE(retry, 1);
  EXPECT_LE(retry, 60);
  // A reservation larger than the whole limit can never be admitted: no Retry-After.
  r = post("/v1/chat/completions", chatBody(fmt::format(R"("max_tokens":{})", prompt + 12)), tok);
  expectError(r, 429, "tokens", "rate_limit_exceeded", "more than this API key's limit");
  EXPECT_EQ(r.header("Retry-After"), "");
  EXPECT_EQ(backend_.requests().size(), 2u);
  EXPECT_NE(send("GET", "/metrics").body.find(R"(pdserve_router_rate_limited_total{limit="tokens"} 2)"),
            std::string::npos);
}

TEST_F(ApiServerTest, NotReadyIs503WithRetryAfter) {
  backend_.setReady(false);
  start();
  const auto r = post("/v1/chat/completions", chatBody());
  expectError(r, 503, "server_error", "service_unavailable", "no prefill and decode workers are ready");
  EXPECT_EQ(r.header("Retry-After"), "1");
  EXPECT_EQ(send("GET", "/ready").status, 503);
  EXPECT_EQ(send("GET", "/health").status, 200);
  backend_.setReady(true);
  EXPECT_EQ(send("GET", "/ready").body, R"({"status":"ready"})");
}

TEST_F(ApiServerTest, ProbesAnswerHeadWithoutABody) {
  start();
  for (const char* path : {"/health", "/ready"}) {
    RawHttpPeer peer(server_->port());
    ASSERT_TRUE(peer.send(std::string("HEAD ") + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
    const std::string bytes = peer.readAll();
    EXPECT_EQ(bytes.rfind("HTTP/1.1 200", 0), 0u) << path << ": " << bytes;
    // Nothing after the head: the body GET would send is left out.
    EXPECT_EQ(bytes.find("\r\n\r\n"), bytes.size() - 4) << path << ": " << bytes;
  }
  backend_.setReady(false);
  RawHttpPeer peer(server_->port());
  ASSERT_TRUE(peer.send("HEAD /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
  EXPECT_EQ(peer.readAll().rfind("HTTP/1.1 503", 0), 0u);
}

TEST_F(ApiServerTest, QueueLimitIs429UntilTheQueueDrains) {
  ApiServerOptions o = defaultOptions();
  o.max_queued_requests = 2;
  o.retry_after = std::chrono::seconds(7);
  Script stuck;
  stuck.hang = true;  // admitted but never gets a first token
  backend_.setScript(stuck);
  start(o);
  const std::string body = chatBody();
  const std::string raw = fmt::format(
      "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
      body.size(), body);
  {
    RawHttpPeer a(server_->port());
    RawHttpPeer b(server_->port());
    ASSERT_TRUE(a.send(raw));
    ASSERT_TRUE(b.send(raw));
    ASSERT_TRUE(eventually([&] { return backend_.active() == 2; }));
    const auto r = post("/v1/chat/completions", body);
    expectError(r, 429, "requests", "rate_limit_exceeded", "too many requests");
    EXPECT_EQ(r.header("Retry-After"), "7");
  }  // both waiting clients hang up: their generations are aborted and the queue drains
  ASSERT_TRUE(backend_.waitIdle(5s));
  EXPECT_EQ(backend_.aborts(), 2);
  backend_.setScript(Script::fromPieces({"ok"}));
  EXPECT_EQ(post("/v1/chat/completions", body).status, 200);
}

TEST_F(ApiServerTest, BackendErrorsMapToStatuses) {
  start();
  auto failWith = [&](pd::ErrorCode code, std::string message, bool at_start) {
    Script s;
    (at_start ? s.start_error : s.error) = pd::makeError(code, std::move(message));
    backend_.setScript(s);
    return post("/v1/chat/completions", chatBody());
  };
  const auto overloaded = failWith(pd::ErrorCode::Overloaded, "all decode pools full", true);
  expectError(overloaded, 503, "server_error", "service_unavailable", "retry later");
  EXPECT_EQ(overloaded.header("Retry-After"), "1");
  const auto failed = failWith(pd::ErrorCode::PeerFailed, "decode 10.0.0.7:9000 reset", false);
  expectError(failed, 502, "server_error", "upstream_error", "a worker failed");
  EXPECT_EQ(failed.body.find("10.0.0.7"), std::string::npos);  // internals stay in the log
  expectError(failWith(pd::ErrorCode::Timeout, "prefill timed out", false), 504, "server_error", "upstream_timeout",
              "did not answer in time");
  expectError(failWith(pd::ErrorCode::ResourceExhausted, "the prompt does not fit any decode worker's KV pool", true),
              400, "invalid_request_error", "", "does not fit any decode worker");
  expectError(failWith(pd::ErrorCode::Internal, "bug", false), 500, "server_error", "internal_error", "internal");
}

TEST_F(ApiServerTest, ErrorAfterTheFirstTokenEndsTheStreamWithAnErrorEvent) {
  Script s = Script::fromPieces({"par", "tial"});
  s.error = pd::makeError(pd::ErrorCode::PeerFailed, "decode worker died");
  backend_.setScript(s);
  start();
  const Streamed st = stream("/v1/chat/completions", chatBody(R"("stream":true)"));
  EXPECT_EQ(st.response.status, 200);
  ASSERT_GE(st.data.size(), 3u);
  EXPECT_EQ(st.data.back(), "[DONE]");
  const json::value err = parseJson(st.data[st.data.size() - 2]);
  EXPECT_EQ(err.at("error").at("code").as_string(), "upstream_error");
  // Non-streaming: nothing was sent yet, so the status says it.
  expectError(post("/v1/chat/completions", chatBody()), 502, "server_error", "upstream_error", "a worker failed");
}

TEST_F(ApiServerTest, ClientDisconnectMidStreamAbortsTheGeneration) {
  std::vector<std::string> pieces(2000, "tok ");
  Script s = Script::fromPieces(pieces);
  s.delay = 2ms;
  backend_.setScript(s);
  start();
  const Streamed st = stream("/v1/chat/completions", chatBody(R"("stream":true)"), /*stop_after=*/3);
  EXPECT_FALSE(st.response.complete);
  ASSERT_TRUE(backend_.waitIdle(5s)) << "the generation kept running after the client left";
  EXPECT_EQ(backend_.aborts(), 1);
  EXPECT_TRUE(eventually([&] { return server_->inFlight() == 0; }));
  const std::string metrics = send("GET", "/metrics").body;
  EXPECT_NE(metrics.find("pdserve_router_requests_total{endpoint=\"/v1/chat/completions\",status=\"499\"} 1"),
            std::string::npos)
      << metrics;
}

TEST_F(ApiServerTest, DeadlineAbortsAndAnswers504) {
  ApiServerOptions o = defaultOptions();
  o.request_timeout = 300ms;
  Script stuck;
  stuck.hang = true;
  backend_.setScript(stuck);
  start(o);
  const auto t0 = std::chrono::steady_clock::now();
  expectError(post("/v1/chat/completions", chatBody()), 504, "server_error", "timeout", "time limit");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  ASSERT_TRUE(backend_.waitIdle(5s));

  Script slow = Script::fromPieces({"a"});
  slow.hang = true;  // one token, then nothing
  backend_.setScript(slow);
  const Streamed st = stream("/v1/chat/completions", chatBody(R"("stream":true)"));
  ASSERT_GE(st.data.size(), 4u);
  EXPECT_EQ(parseJson(st.data[st.data.size() - 2]).at("error").at("code").as_string(), "timeout");
  EXPECT_EQ(st.data.back(), "[DONE]");
  ASSERT_TRUE(backend_.waitIdle(5s));
  EXPECT_EQ(backend_.aborts(), 2);
}

TEST_F(ApiServerTest, InvalidUtf8FromTheModelIsEscapedTheSameWayInBothModes) {
  Script s;
  s.deltas.push_back(TokenDelta{{1000}, "ok \xFF", {}});
  s.deltas.push_back(TokenDelta{{1001}, "\xE2\x82", {}});  // first two bytes of the euro sign
  s.deltas.push_back(TokenDelta{{1002}, "\xAC!\x01\"", {}});
  backend_.setScript(s);
  start();
  const std::string expected = "ok \xEF\xBF\xBD\xE2\x82\xAC!\x01\"";
  const ClientResponse r = post("/v1/chat/completions", chatBody());
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(parseJson(r.body).at("choices").at(0).at("message").at("content").as_string(), expected);
  std::string streamed;
  for (const auto& c : stream("/v1/chat/completions", chatBody(R"("stream":true)")).chunks()) {
    if (const auto* t = c.at("choices").at(0).at("delta").as_object().if_contains("content"))
      streamed += t->as_string();
  }
  EXPECT_EQ(streamed, expected);
  EXPECT_EQ(parseJson(r.body).at("usage").at("completion_tokens").as_int64(), 3);
}

TEST_F(ApiServerTest, LogprobsInBothApiShapes) {
  Script s;
  TokenDelta d{{1000}, "a", {}};
  d.logprobs.push_back({{1000, -0.5F, {{1001, -1.0F}}}, "a", {"b"}});
  s.deltas.push_back(d);
  TokenDelta e{{1001}, "\xFF", {}};
  e.logprobs.push_back({{1001, -std::numeric_limits<float>::infinity(), {}}, "\xFF", {}});
  s.deltas.push_back(e);
  backend_.setScript(s);
  start();
  const json::value chat =
      parseJson(post("/v1/chat/completions", chatBody(R"("logprobs":true,"top_logprobs":1)")).body);
  EXPECT_EQ(chat.at("choices").at(0).at("logprobs"),
            parseJson(R"({"content":[{"token":"a","logprob":-0.5,"bytes":[97],)"
                      R"("top_logprobs":[{"token":"b","logprob":-1,"bytes":[98]}]},)"
                      R"({"token":"\ufffd","logprob":-9999,"bytes":[255],"top_logprobs":[]}]})"));
  const json::value cmpl = parseJson(post("/v1/completions", completionBody(R"("q")", R"("logprobs":1)")).body);
  EXPECT_EQ(cmpl.at("choices").at(0).at("logprobs"),
            parseJson(R"({"tokens":["a","\ufffd"],"token_logprobs":[-0.5,-9999],"top_logprobs":[{"b":-1},{}],)"
                      R"("text_offset":[0,1]})"));
  const auto chunks = stream("/v1/completions", completionBody(R"("q")", R"("logprobs":1,"stream":true)")).chunks();
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[1].at("choices").at(0).at("logprobs").at("text_offset"), parseJson("[1]"));
}

TEST_F(ApiServerTest, ModelsEndpoint) {
  start();
  const ClientResponse r = send("GET", "/v1/models");
  ASSERT_EQ(r.status, 200);
  const json::value v = parseJson(r.body);
  EXPECT_EQ(v.at("object").as_string(), "list");
  const auto& m = v.at("data").at(0);
  EXPECT_EQ(m.at("id").as_string(), kModel);
  EXPECT_EQ(m.at("object").as_string(), "model");
  EXPECT_EQ(m.at("owned_by").as_string(), "pdserve");
  EXPECT_EQ(m.at("max_model_len").as_int64(), 128);
  EXPECT_EQ(m.at("vocab_size").as_int64(), static_cast<std::int64_t>(renderer_.vocabSize()));
  EXPECT_GT(m.at("vocab_size").as_int64(), 0);
  EXPECT_TRUE(m.at("created").is_int64());
}

TEST_F(ApiServerTest, MetricsCountRequestsAndLatencies) {
  backend_.setScript(Script::fromPieces({"a", "b", "c"}));
  start();
  ASSERT_EQ(post("/v1/chat/completions", chatBody()).status, 200);
  ASSERT_EQ(stream("/v1/chat/completions", chatBody(R"("stream":true)")).response.status, 200);
  ASSERT_EQ(post("/v1/chat/completions", chatBody(R"("n":17)")).status, 400);
  const ClientResponse r = send("GET", "/metrics");
  EXPECT_EQ(r.header("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  for (std::string_view line : {
           "pdserve_router_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2\n",
           "pdserve_router_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1\n",
           "pdserve_router_time_to_first_token_seconds_count 2\n",
           "pdserve_router_time_per_output_token_seconds_count 2\n",
           "pdserve_router_e2e_request_latency_seconds_count 2\n",
           "pdserve_router_requests_in_flight 0\n",
           "pdserve_router_requests_waiting 0\n",
           "pdserve_router_generation_tokens_total 6\n",
           "pdserve_router_retries_total{leg=\"prefill\"} 0\n",
           "# TYPE pdserve_router_e2e_request_latency_seconds histogram\n",
       }) {
    EXPECT_NE(r.body.find(line), std::string::npos) << "missing: " << line << "\n" << r.body;
  }
}

TEST_F(ApiServerTest, DozensOfConcurrentStreams) {
  std::vector<std::string> pieces;
  for (int i = 0; i < 20; ++i) pieces.push_back("t" + std::to_string(i) + " ");
  Script s = Script::fromPieces(pieces);
  s.delay = 1ms;
  backend_.setScript(s);
  std::string expected;
  for (const auto& p : pieces) expected += p;
  start();
  constexpr int kClients = 48;
  std::atomic<int> good{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      pd::http::Client client("127.0.0.1", server_->port());
      std::string text;
      bool done = false;
      const bool streaming = t % 4 != 0;
      pd::http::ClientRequest req{"POST", "/v1/chat/completions", kJsonHeaders,
                                  chatBody(streaming ? R"("stream":true)" : "")};
      if (streaming) {
        auto r = client.streamEvents(req, 20s, [&](const pd::http::SseEvent& e) {
          if (e.data == "[DONE]") {
            done = true;
            return true;
          }
          boost::system::error_code ec;
          const auto v = json::parse(e.data, ec);
          if (ec) return false;
          if (const auto* c = v.at("choices").at(0).at("delta").as_object().if_contains("content")) {
            text += c->as_string();
          }
          return true;
        });
        if (r.ok() && r->status == 200 && done && text == expected) ++good;
      } else {
        auto r = client.send(req, 20s);
        if (r.ok() && r->status == 200 &&
            json::parse(r->body).at("choices").at(0).at("message").at("content").as_string() == expected) {
          ++good;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(good.load(), kClients);
  EXPECT_TRUE(backend_.waitIdle(5s));
  EXPECT_EQ(server_->inFlight(), 0);
  EXPECT_EQ(backend_.aborts(), 0);
}

TEST_F(ApiServerTest, ExactRequestsOfTheOpenAiPythonSdk) {
  ApiServerOptions o = defaultOptions();
  o.api_keys = pd::router::ApiKeySet({"sk-test"});
  backend_.setScript(Script::fromPieces({"Hi", " there"}));
  start(o);
  // Headers and bodies as openai-python 1.x sends them (httpx), byte for byte apart from Host.
  const pd::http::Headers sdk_headers{{"Accept-Encoding", "gzip, deflate"},
                                      {"Connection", "keep-alive"},
                                      {"Accept", "application/json"},
                                      {"Content-Type", "application/json"},
                                      {"User-Agent", "OpenAI/Python 1.54.4"},
                                      {"X-Stainless-Lang", "python"},
                                      {"X-Stainless-Package-Version", "1.54.4"},
                                      {"X-Stainless-OS", "Linux"},
                                      {"X-Stainless-Arch", "x64"},
                                      {"X-Stainless-Runtime", "CPython"},
                                      {"X-Stainless-Runtime-Version", "3.11.2"},
                                      {"Authorization", "Bearer sk-test"},
                                      {"X-Stainless-Async", "false"},
                                      {"x-stainless-retry-count", "0"}};
  const std::string stream_body =
      R"({"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hi"}],)"
      R"("model":"test-model","max_tokens":8,"stream":true,"stream_options":{"include_usage":true},"temperature":0})";
  const Streamed st = stream("/v1/chat/completions", stream_body, -1, sdk_headers);
  ASSERT_EQ(st.response.status, 200);
  const auto chunks = st.chunks();
  ASSERT_EQ(chunks.size(), 5u);
  for (const auto& c : chunks) {
    // The fields the SDK's ChatCompletionChunk model requires.
    for (std::string_view k : {"id", "object", "created", "model", "choices"}) EXPECT_TRUE(c.as_object().contains(k));
  }
  EXPECT_EQ(chunks.back().at("usage").at("completion_tokens").as_int64(), 2);

  const std::string chat_body =
      R"({"messages":[{"role":"user","content":[{"type":"text","text":"Say hi"}]}],"model":"test-model",)"
      R"("max_completion_tokens":8,"n":1,"seed":7,"temperature":0.2,"top_p":1,"user":"someone"})";
  const ClientResponse chat = post("/v1/chat/completions", chat_body, sdk_headers);
  ASSERT_EQ(chat.status, 200) << chat.body;
  EXPECT_EQ(parseJson(chat.body).at("choices").at(0).at("message").at("content").as_string(), "Hi there");

  const ClientResponse cmpl = post(
      "/v1/completions", R"({"model":"test-model","prompt":[1,72,105],"max_tokens":4,"temperature":0})", sdk_headers);
  ASSERT_EQ(cmpl.status, 200) << cmpl.body;
  EXPECT_EQ(parseJson(cmpl.body).at("choices").at(0).at("text").as_string(), "Hi there");
}

TEST_F(ApiServerTest, StopCutsInFlightStreamsAndAbortsTheirGenerations) {
  Script s = Script::fromPieces({"a"});
  s.hang = true;
  backend_.setScript(s);
  start();
  std::thread client([&] {
    pd::http::Client c("127.0.0.1", server_->port());
    // The stream is cut, so the client sees an error; only the server side matters here.
    (void)c.streamLines({"POST", "/v1/chat/completions", kJsonHeaders, chatBody(R"("stream":true)")}, 10s,
                        [](std::string_view) { return true; });
  });
  ASSERT_TRUE(eventually([&] { return backend_.active() == 1; }));
  server_->stop(std::chrono::milliseconds(50));
  client.join();
  EXPECT_TRUE(backend_.waitIdle(5s));
  EXPECT_EQ(backend_.aborts(), 1);
  EXPECT_EQ(server_->inFlight(), 0);
}

TEST(ApiKeySet, AcceptsOnlyConfiguredKeys) {
  const pd::router::ApiKeySet keys({"alpha", "beta"});
  EXPECT_EQ(keys.find("alpha"), std::optional<std::size_t>(0));
  EXPECT_EQ(keys.find("beta"), std::optional<std::size_t>(1));
  EXPECT_EQ(keys.find("gamma"), std::nullopt);
  EXPECT_EQ(pd::router::ApiKeySet({"x", "y", "x"}).find("x"), std::optional<std::size_t>(0)) << "first match wins";
  EXPECT_TRUE(keys.accepts("alpha"));
  EXPECT_TRUE(keys.accepts("beta"));
  EXPECT_FALSE(keys.accepts("alph"));
  EXPECT_FALSE(keys.accepts("alphaa"));
  EXPECT_FALSE(keys.accepts(""));
  EXPECT_TRUE(keys.acceptsAuthorization("Bearer alpha"));
  EXPECT_TRUE(keys.acceptsAuthorization("BEARER   beta "));
  EXPECT_FALSE(keys.acceptsAuthorization("alpha"));
  EXPECT_FALSE(keys.acceptsAuthorization("Bearer"));
  EXPECT_FALSE(keys.acceptsAuthorization("Token alpha"));
}

TEST(ApiKeySet, LoadsAKeyFile) {
  const auto dir = std::filesystem::temp_directory_path() / ("pd_api_keys_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir / "keys") << "# team keys\n\n  sk-one  \r\nsk-two\n";
    std::ofstream(dir / "empty") << "# nothing\n\n";
  }
  auto keys = pd::router::ApiKeySet::fromFile(dir / "keys");
  ASSERT_TRUE(keys.ok()) << keys.error().toString();
  EXPECT_EQ(keys->size(), 2u);
  EXPECT_TRUE(keys->accepts("sk-one"));
  EXPECT_TRUE(keys->accepts("sk-two"));
  EXPECT_FALSE(keys->accepts("# team keys"));
  auto empty = pd::router::ApiKeySet::fromFile(dir / "empty");
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.error().code, pd::ErrorCode::InvalidArgument);
  auto missing = pd::router::ApiKeySet::fromFile(dir / "nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, pd::ErrorCode::NotFound);

  // Optional limits after the key, in any order, and trailing comments; old files read the same.
  {
    std::ofstream(dir / "limits") << "sk-a max_concurrent=2 tokens_per_minute=5000\n"
                                     "sk-b\ttokens_per_minute=7   # team b\n"
                                     "sk-c # no limits\n"
                                     "sk#d\n";
  }
  auto limited = pd::router::ApiKeySet::fromFile(dir / "limits");
  ASSERT_TRUE(limited.ok()) << limited.error().toString();
  ASSERT_EQ(limited->size(), 4u);
  EXPECT_EQ(limited->find("sk-a"), std::optional<std::size_t>(0));
  EXPECT_EQ(limited->find("sk-b"), std::optional<std::size_t>(1));
  EXPECT_EQ(limited->find("sk-c"), std::optional<std::size_t>(2));
  EXPECT_EQ(limited->find("sk#d"), std::optional<std::size_t>(3));
  EXPECT_EQ(limited->find("sk-a max_concurrent=2 tokens_per_minute=5000"), std::nullopt);
  EXPECT_EQ(limited->findAuthorization("Bearer sk-b"), std::optional<std::size_t>(1));
  const std::vector<pd::router::KeyLimits> expected{{2, 5000}, {0, 7}, {0, 0}, {0, 0}};
  EXPECT_EQ(limited->limits(), expected);
  // Bad fields are refused naming the line, never echoing the key.
  for (const char* bad :
       {"sk-secret max_concurrent=0\n", "sk-secret max_concurrent=x\n", "sk-secret tokens_per_minute=\n",
        "sk-secret max_concurrent\n", "sk-secret other words\n", "sk-secret burst=3\n",
        "sk-secret tokens_per_minute=99999999999999999999\n", "# a\nsk-secret\nsk-secret max_concurrent=1\n"}) {
    std::ofstream(dir / "bad") << bad;
    auto r = pd::router::ApiKeySet::fromFile(dir / "bad");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().code, pd::ErrorCode::InvalidArgument);
    EXPECT_EQ(r.error().message.find("sk-secret"), std::string::npos) << r.error().message;
    EXPECT_NE(r.error().message.find("line "), std::string::npos) << r.error().message;
  }

  // The router's config section becomes server options; the key file is read there.
  pd::router::RouterConfig cfg;
  cfg.port = 0;
  cfg.io_threads = 3;
  cfg.max_body_bytes = 4096;
  cfg.max_queued_requests = 5;
  cfg.request_timeout_ms = 1500;
  cfg.retry_after_s = 4;
  cfg.served_model_name = "served";
  cfg.api_keys_file = dir / "keys";
  auto o = pd::router::apiServerOptionsFromConfig(cfg, 2048);
  ASSERT_TRUE(o.ok()) << o.error().toString();
  EXPECT_EQ(o->http.io_threads, 3);
  EXPECT_EQ(o->http.max_body_bytes, 4096u);
  EXPECT_EQ(o->max_queued_requests, 5);
  EXPECT_EQ(o->request_timeout, std::chrono::milliseconds(1500));
  EXPECT_EQ(o->retry_after, std::chrono::seconds(4));
  EXPECT_EQ(o->served_model_name, "served");
  EXPECT_EQ(o->max_model_len, 2048);
  EXPECT_TRUE(o->api_keys.accepts("sk-two"));
  cfg.api_keys_file = dir / "empty";
  EXPECT_FALSE(pd::router::apiServerOptionsFromConfig(cfg, 2048).ok());
  std::filesystem::remove_all(dir);
}

// A client's traceparent with the router's tracing off: passed through to the backend (which puts
// it into the workers' calls) unchanged; a malformed one is dropped.
TEST_F(ApiServerTest, TracingOffPassesAValidClientTraceparentToTheBackend) {
  backend_.setScript(Script::fromPieces({"a"}));
  start();
  const std::string valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  pd::http::Headers headers = kJsonHeaders;
  headers.push_back({"traceparent", valid});
  ASSERT_EQ(post("/v1/chat/completions", chatBody(), headers).status, 200);
  headers.back().value = "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01";  // upper case: malformed
  ASSERT_EQ(post("/v1/chat/completions", chatBody(), headers).status, 200);
  const auto requests = backend_.requests();
  ASSERT_EQ(requests.size(), 2u);
  EXPECT_EQ(pd::trace::formatTraceparent(requests[0].trace), valid);
  EXPECT_FALSE(requests[1].trace.valid());
}

// With a tracer: router.request continues the client's trace, the backend gets its context (a new
// span id, the client's trace id and flags), and the front end's phase spans are exported.
TEST_F(ApiServerTest, TracedRequestContinuesTheClientsTraceAndExportsItsPhases) {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("pd-api-trace-{}", ::getpid());
  std::filesystem::create_directories(dir);
  pd::trace::TraceConfig tc;
  tc.file = (dir / "spans.jsonl").string();
  tc.sample_ratio = 0.0;  // only the client's sampled flag makes this trace recorded
  auto tracer = pd::trace::Tracer::create(tc, "pdserve-router", nullptr);
  ASSERT_TRUE(tracer.ok()) << tracer.error().toString();
  backend_.setScript(Script::fromPieces({"a", "b"}));
  ApiServerOptions o = defaultOptions();
  o.tracer = tracer->get();
  start(std::move(o));
  const auto client = pd::trace::parseTraceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
  ASSERT_TRUE(client.has_value());
  pd::http::Headers headers = kJsonHeaders;
  headers.push_back({"traceparent", pd::trace::formatTraceparent(*client)});
  const Streamed s = stream("/v1/chat/completions", chatBody(R"("stream":true)"), -1, headers);
  ASSERT_EQ(s.response.status, 200);
  server_->stop();
  const auto requests = backend_.requests();
  ASSERT_EQ(requests.size(), 1u);
  EXPECT_EQ(requests[0].trace.trace_id, client->trace_id);
  EXPECT_NE(requests[0].trace.span_id, client->span_id);
  EXPECT_TRUE(requests[0].trace.sampled());
  EXPECT_NE(requests[0].handed_at, std::chrono::system_clock::time_point{});
  (*tracer)->exporter()->flush();
  std::ifstream in(tc.file);
  std::stringstream text;
  text << in.rdbuf();
  const std::string spans = text.str();
  for (const char* name :
       {"router.request", "router.validate", "router.template", "router.tokenize", "router.stream"}) {
    EXPECT_NE(spans.find(fmt::format(R"("name":"{}")", name)), std::string::npos) << name;
  }
  EXPECT_NE(spans.find(client->trace_id.hex()), std::string::npos);
  EXPECT_NE(spans.find(R"("parentSpanId":"00f067aa0ba902b7")"), std::string::npos);  // router.request's parent
  server_.reset();
  std::filesystem::remove_all(dir);
}

/// Sends this process's stderr to a file while it lives (the log's lines, for tests of them).
class StderrCapture {
 public:
  explicit StderrCapture(std::filesystem::path file) : file_(std::move(file)) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    const int fd = ::open(file_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    EXPECT_GE(fd, 0);
    ::dup2(fd, 2);
    ::close(fd);
  }
  StderrCapture(const StderrCapture&) = delete;
  StderrCapture& operator=(const StderrCapture&) = delete;
  ~StderrCapture() { restore(); }
  /// Restores stderr; returns what was written meanwhile.
  std::string restore() {
    if (saved_ >= 0) {
      std::fflush(stderr);
      ::dup2(saved_, 2);
      ::close(saved_);
      saved_ = -1;
    }
    std::ifstream in(file_);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

 private:
  std::filesystem::path file_;
  int saved_ = -1;
};

// The per-request line of a request the backend failed: the outcome and both error codes, the
// phases, and never the prompt (router.log_prompts is off).
TEST_F(ApiServerTest, FailedRequestLogsOneLineWithItsErrorCodesAndNoPrompt) {
  Script script = Script::fromPieces({"a"});
  script.error = pd::makeError(pd::ErrorCode::PeerFailed, "decode worker 10.0.0.1:9 vanished");
  backend_.setScript(script);
  start();
  const auto file = std::filesystem::temp_directory_path() / fmt::format("pd-api-log-{}.txt", ::getpid());
  std::string log;
  {
    StderrCapture capture(file);
    const auto r = post("/v1/chat/completions", chatBody({}, kMarker));
    EXPECT_EQ(r.status, 502);  // not streaming: nothing went out before the error
    // The line follows the answer (on the backend's thread): wait until it is in the file.
    EXPECT_TRUE(eventually([&] {
      std::fflush(stderr);
      std::ifstream in(file);
      std::stringstream text;
      text << in.rdbuf();
      return text.str().find("[router] request id=") != std::string::npos;
    }));
    log = capture.restore();
  }
  std::filesystem::remove(file);
  EXPECT_EQ(log.find(kMarker), std::string::npos) << log;
  const auto at = log.find("[router] request id=chatcmpl-");
  ASSERT_NE(at, std::string::npos) << log;
  const std::string line = log.substr(at, log.find('\n', at) - at);
  EXPECT_NE(line.find(" status=502 "), std::string::npos) << line;
  EXPECT_NE(line.find(" outcome=error "), std::string::npos) << line;
  EXPECT_NE(line.find(" error_code=upstream_error "), std::string::npos) << line;
  EXPECT_NE(line.find(" backend_error=PeerFailed "), std::string::npos) << line;
  EXPECT_NE(line.find(" completion_tokens=1 "), std::string::npos) << line;
  EXPECT_NE(line.find(" ttft_ms="), std::string::npos) << line;
  EXPECT_NE(line.find(" template_ms="), std::string::npos) << line;
  EXPECT_EQ(line.find("prompt="), std::string::npos) << line;
}

}  // namespace

namespace pd::router {
namespace {

/// A renderer whose renderChat() parks until released: the stand-in for a chat template and
/// tokenizer busy with a huge prompt. Thread rules: thread-safe.
class ParkingRenderer final : public PromptRenderer {
 public:
  [[nodiscard]] Result<std::vector<TokenId>> renderChat(const ChatConversation& conversation) const override {
    std::unique_lock lock(mu_);
    ++entered_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return released_; });
    return inner_.renderChat(conversation);
  }
  [[nodiscard]] Result<std::vector<TokenId>> tokenize(std::string_view text) const override {
    return inner_.tokenize(text);
  }
  [[nodiscard]] std::size_t vocabSize() const override { return inner_.vocabSize(); }

  bool waitEntered(int n) const {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, 10s, [&] { return entered_ >= n; });
  }
  void release() {
    std::lock_guard lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  FakePromptRenderer inner_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  mutable int entered_ = 0;
  bool released_ = false;
};

double metricValue(const std::string& text, const std::string& name) {
  const auto at = text.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + name.size() + 2));
}

// Issue 21: 8 large requests being templated stalled /health for 2.6 s. Templating now runs on
// the CPU pool: with its only thread parked inside a template and its queue full, the probes
// and /metrics still answer from the io threads, and one request more gets 503 + Retry-After.
TEST(ApiServerCpuPool, ProbesAnswerWhileTemplatingBlocksAndAFullQueueIs503) {
  pd::metrics::Registry registry;
  FakeCompletionBackend backend;
  backend.setScript(Script::fromPieces({"ok"}));
  ParkingRenderer renderer;
  ApiServerOptions o;
  o.served_model_name = std::string(kModel);
  o.max_model_len = 2 << 20;  // room for the ~1M-token prompts of the fake renderer
  o.http.io_threads = 2;
  o.http.max_body_bytes = 4 << 20;
  o.cpu_threads = 1;
  o.cpu_queue = 1;
  o.cpu_inline_bytes = 4096;  // the default: a small body is prepared on its io thread
  auto server = ApiServer::start(o, backend, renderer, registry);
  ASSERT_TRUE(server.ok()) << server.error().toString();
  const std::uint16_t port = server.value()->port();
  const auto call = [port](std::string method, std::string path, std::string body = {}) {
    pd::http::Client client("127.0.0.1", port);
    auto r = client.send({std::move(method), std::move(path), kJsonHeaders, std::move(body)}, 20s);
    EXPECT_TRUE(r.ok()) << r.error().toString();
    return r.ok() ? std::move(r).value() : ClientResponse{};
  };
  const std::string big = chatBody({}, std::string(1 << 20, 'a'));  // a ~1 MB prompt

  std::vector<std::thread> clients;
  std::vector<int> statuses(2, 0);
  clients.emplace_back([&] { statuses[0] = call("POST", "/v1/chat/completions", big).status; });
  ASSERT_TRUE(renderer.waitEntered(1));  // the pool's thread is parked in the template
  clients.emplace_back([&] { statuses[1] = call("POST", "/v1/chat/completions", big).status; });
  // The second waits in the queue: /metrics (an io thread) says so.
  ASSERT_TRUE(eventually(
      [&] { return metricValue(call("GET", "/metrics").body, "pdserve_router_cpu_queue_depth") == 1.0; }, 10s));
  EXPECT_EQ(call("GET", "/health").status, 200);
  const ClientResponse refused = call("POST", "/v1/chat/completions", big);
  EXPECT_EQ(refused.status, 503) << refused.body;
  EXPECT_EQ(refused.header("Retry-After"), "1");
  EXPECT_EQ(metricValue(call("GET", "/metrics").body, "pdserve_router_cpu_queue_rejected_total"), 1.0);
  // A small body does not wait for the pool (its tokens take microseconds); the fake renderer's
  // completions path (tokenize) does not park.
  EXPECT_EQ(call("POST", "/v1/completions", completionBody("\"Hi\"")).status, 200);

  renderer.release();
  for (auto& t : clients) t.join();
  EXPECT_EQ(statuses[0], 200);
  EXPECT_EQ(statuses[1], 200);
}

}  // namespace
}  // namespace pd::router
