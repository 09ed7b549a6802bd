// The OpenAI API through the whole system (`pdserve up`: router + prefill + decode processes)
// on a make-model checkpoint with the real DeepSeek-V3 tokenizer: streaming and non-streaming
// agree, usage counts are right, stop strings cut exactly, an OpenAI-SDK-shaped request works
// unchanged, and the error cases answer with their status and OpenAI-style JSON.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "pd/common/http_client.h"
#include "pd/common/subprocess.h"
#include "support/local_cluster.h"
#include "support/role_process.h"
#include "support/test_files.h"
#include "support/test_model.h"

namespace pd::test {
namespace {

namespace json = boost::json;
using namespace std::chrono_literals;

struct ChatResult {
  int status = 0;
  std::string content;
  std::string finish_reason;
  std::vector<std::int64_t> token_ids;
  std::vector<std::int64_t> prompt_token_ids;
  std::int64_t prompt_tokens = -1;
  std::int64_t completion_tokens = -1;
  std::string raw;
};

std::vector<std::int64_t> ids(const json::value& v) {
  std::vector<std::int64_t> out;
  for (const auto& t : v.as_array()) out.push_back(t.to_number<std::int64_t>());
  return out;
}

class E2eChat : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_dir_ = std::make_unique<TempDir>();
    makeDefaultModel(model_dir_->path() / "m");
    if (HasFatalFailure()) return;
    cluster_ = std::make_unique<LocalCluster>(std::vector<std::string>{
        "--model.path=" + (model_dir_->path() / "m").string(), "--model.cache_dir=" + model_dir_->path().string(),
        "--router.port=0", "--router.max_body_bytes=65536", "--log.level=warn"});
  }
  static void TearDownTestSuite() {
    cluster_.reset();
    model_dir_.reset();
  }
  void SetUp() override { ASSERT_FALSE(cluster_->url().empty()); }

  static json::object chatBody(const std::string& content, int max_tokens) {
    return json::object{{"model", "pdserve-default"},
                        {"messages", json::array{json::object{{"role", "user"}, {"content", content}}}},
                        {"max_tokens", max_tokens},
                        {"temperature", 0},
                        {"return_token_ids", true}};
  }

  static ChatResult chat(const json::object& body) {
    ChatResult r;
    const auto response = postJson(*cluster_, "/v1/chat/completions", json::serialize(body));
    r.status = response.status;
    r.raw = response.body;
    if (r.status != 200) return r;
    const auto doc = json::parse(response.body);
    const auto& choice = doc.at("choices").as_array().at(0).as_object();
    r.content = std::string(choice.at("message").at("content").as_string());
    r.finish_reason = std::string(choice.at("finish_reason").as_string());
    if (choice.contains("token_ids")) r.token_ids = ids(choice.at("token_ids"));
    if (doc.as_object().contains("prompt_token_ids")) r.prompt_token_ids = ids(doc.at("prompt_token_ids"));
    r.prompt_tokens = doc.at("usage").at("prompt_tokens").to_number<std::int64_t>();
    r.completion_tokens = doc.at("usage").at("completion_tokens").to_number<std::int64_t>();
    return r;
  }

  static ChatResult chatStream(json::object body) {
    body["stream"] = true;
    body["stream_options"] = json::object{{"include_usage", true}};
    ChatResult r;
    http::Client client(cluster_->host(), cluster_->port());
    http::ClientRequest req;
    req.method = "POST";
    req.target = "/v1/chat/completions";
    req.headers.push_back({"Content-Type", "application/json"});
    req.body = json::serialize(body);
    bool done = false;
    auto response = client.streamEvents(req, 120s, [&](const http::SseEvent& event) {
      if (event.data == "[DONE]") {
        done = true;
        return true;
      }
      const auto doc = json::parse(event.data);
      if (doc.as_object().contains("prompt_token_ids")) r.prompt_token_ids = ids(doc.at("prompt_token_ids"));
      const auto& usage = doc.at("usage");
      if (usage.is_object()) {
        r.prompt_tokens = usage.at("prompt_tokens").to_number<std::int64_t>();
        r.completion_tokens = usage.at("completion_tokens").to_number<std::int64_t>();
      }
      for (const auto& c : doc.at("choices").as_array()) {
        const auto& delta = c.at("delta").as_object();
        if (delta.contains("content")) r.content += std::string(delta.at("content").as_string());
        if (c.as_object().contains("token_ids")) {
          for (auto id : ids(c.at("token_ids"))) r.token_ids.push_back(id);
        }
        if (c.at("finish_reason").is_string()) r.finish_reason = std::string(c.at("finish_reason").as_string());
      }
      return true;
    });
    EXPECT_TRUE(response.ok()) << (response.ok() ? "" : response.error().toString());
    if (!response.ok()) return r;
    r.status = response->status;
    EXPECT_TRUE(done || r.status != 200) << "stream ended without [DONE]";
    return r;
  }

  static std::unique_ptr<TempDir> model_dir_;
  static std::unique_ptr<LocalCluster> cluster_;
};

std::unique_ptr<TempDir> E2eChat::model_dir_;
std::unique_ptr<LocalCluster> E2eChat::cluster_;

TEST_F(E2eChat, StreamingAndNonStreamingAgreeAndUsageCountsAreRight) {
  const auto body = chatBody("Tell me about the sea.", 24);
  const ChatResult plain = chat(body);
  ASSERT_EQ(plain.status, 200) << plain.raw;
  const ChatResult streamed = chatStream(body);
  ASSERT_EQ(streamed.status, 200);
  EXPECT_EQ(streamed.content, plain.content);
  EXPECT_EQ(streamed.token_ids, plain.token_ids);
  EXPECT_EQ(streamed.finish_reason, plain.finish_reason);
  EXPECT_EQ(streamed.prompt_tokens, plain.prompt_tokens);
  EXPECT_EQ(streamed.completion_tokens, plain.completion_tokens);
  EXPECT_EQ(plain.prompt_tokens, static_cast<std::int64_t>(plain.prompt_token_ids.size()));
  EXPECT_EQ(plain.completion_tokens, static_cast<std::int64_t>(plain.token_ids.size()));
  EXPECT_GT(plain.prompt_tokens, 5);
  if (plain.finish_reason == "length") {
    EXPECT_EQ(plain.completion_tokens, 24);
  }
  // Greedy is deterministic: the same request gives the same answer.
  EXPECT_EQ(chat(body).token_ids, plain.token_ids);
}

// The byte offset of the n-th UTF-8 character boundary at or after `from`.
std::size_t charBoundary(const std::string& s, std::size_t from) {
  while (from < s.size() && (static_cast<unsigned char>(s[from]) & 0xC0) == 0x80) ++from;
  return from;
}

TEST_F(E2eChat, StopStringsCutExactly) {
  auto body = chatBody("Write a long story.", 40);
  body["ignore_eos"] = true;
  const ChatResult full = chat(body);
  ASSERT_EQ(full.status, 200) << full.raw;
  ASSERT_GE(full.content.size(), 12U) << "the model said too little to pick a stop string from";
  // Two characters from the middle of the answer.
  const std::size_t start = charBoundary(full.content, full.content.size() / 2);
  const std::size_t end = charBoundary(full.content, charBoundary(full.content, start + 1) + 1);
  const std::string stop = full.content.substr(start, end - start);
  ASSERT_FALSE(stop.empty());
  const std::string expected = full.content.substr(0, full.content.find(stop));

  body["stop"] = json::array{stop.c_str()};
  const ChatResult cut = chat(body);
  ASSERT_EQ(cut.status, 200) << cut.raw;
  EXPECT_EQ(cut.content, expected);
  EXPECT_EQ(cut.finish_reason, "stop");
  EXPECT_LT(cut.completion_tokens, full.completion_tokens);
  const ChatResult cut_streamed = chatStream(body);
  EXPECT_EQ(cut_streamed.content, expected);
  EXPECT_EQ(cut_streamed.finish_reason, "stop");
}

TEST_F(E2eChat, AnOpenAiSdkRequestWorksUnchanged) {
  // Headers and body as the OpenAI Python SDK (1.x) sends them for
  // client.chat.completions.create(model=..., messages=[...], max_tokens=8).
  http::Client client(cluster_->host(), cluster_->port());
  http::ClientRequest req;
  req.method = "POST";
  req.target = "/v1/chat/completions";
  req.headers = {{"Accept", "application/json"},
                 {"Content-Type", "application/json"},
                 {"User-Agent", "OpenAI/Python 1.54.4"},
                 {"X-Stainless-Lang", "python"},
                 {"X-Stainless-Package-Version", "1.54.4"},
                 {"X-Stainless-OS", "Linux"},
                 {"X-Stainless-Arch", "x64"},
                 {"X-Stainless-Runtime", "CPython"},
                 {"X-Stainless-Runtime-Version", "3.11.2"},
                 {"X-Stainless-Retry-Count", "0"},
                 {"Authorization", "Bearer EMPTY"},
                 {"Accept-Encoding", "gzip, deflate"},
                 {"Connection", "keep-alive"}};
  req.body = R"({"messages":[{"role":"system","content":"You are helpful."},{"role":"user","content":"Say hi"}],)"
             R"("model":"pdserve-default","max_tokens":8})";
  auto response = client.send(req, 120s);
  ASSERT_TRUE(response.ok()) << response.error().toString();
  ASSERT_EQ(response->status, 200) << response->body;
  EXPECT_NE(response->header("Content-Type").find("application/json"), std::string_view::npos);
  const auto doc = json::parse(response->body).as_object();
  EXPECT_TRUE(doc.at("id").as_string().starts_with("chatcmpl-"));
  EXPECT_EQ(doc.at("object").as_string(), "chat.completion");
  EXPECT_TRUE(doc.at("created").is_int64());
  EXPECT_EQ(doc.at("model").as_string(), "pdserve-default");
  const auto& choice = doc.at("choices").as_array().at(0).as_object();
  EXPECT_EQ(choice.at("message").at("role").as_string(), "assistant");
  EXPECT_TRUE(choice.at("message").at("content").is_string());
  EXPECT_TRUE(choice.at("finish_reason").is_string());
  EXPECT_EQ(doc.at("usage").at("total_tokens").to_number<std::int64_t>(),
            doc.at("usage").at("prompt_tokens").to_number<std::int64_t>() +
                doc.at("usage").at("completion_tokens").to_number<std::int64_t>());
}

// Status and an OpenAI-style error body ({"error":{"message","type",...}}) that does not echo input.
void expectError(const http::ClientResponse& r, int status, const std::string& must_not_contain = "") {
  EXPECT_EQ(r.status, status) << r.body;
  json::error_code ec;
  const auto doc = json::parse(r.body, ec);
  ASSERT_FALSE(ec) << "not JSON: " << r.body;
  ASSERT_TRUE(doc.is_object() && doc.as_object().contains("error")) << r.body;
  EXPECT_TRUE(doc.at("error").at("message").is_string());
  if (!must_not_contain.empty()) {
    EXPECT_EQ(r.body.find(must_not_contain), std::string::npos) << r.body;
  }
}

TEST_F(E2eChat, BadRequestsGetTheirStatusAndJsonBody) {
  expectError(postJson(*cluster_, "/v1/chat/completions", R"({"model":"pdserve-default","messages":[)"), 400);
  expectError(postJson(*cluster_, "/v1/chat/completions",
                       "{\"model\":\"pdserve-default\",\"messages\":[{\"role\":\"user\",\"content\":\"\xC3\x28\"}]}"),
              400);
  expectError(postJson(*cluster_, "/v1/chat/completions",
                       R"({"model":"pdserve-default","messages":[{"role":"user","content":"\ud800"}]})"),
              400);
  expectError(postJson(*cluster_, "/v1/chat/completions",
                       R"({"model":"secret-model-xyz","messages":[{"role":"user","content":"hi"}]})"),
              404, "secret-model-xyz");  // as OpenAI and vLLM answer: model_not_found
  expectError(
      postJson(
          *cluster_, "/v1/chat/completions",
          R"({"model":"pdserve-default","messages":[{"role":"user","content":"hi"}],"n":17})"),  // over router.max_n
      400);
  expectError(postJson(*cluster_, "/v1/chat/completions",
                       R"({"model":"pdserve-default","messages":[{"role":"user","content":"hi"}],"temperature":-1})"),
              400);
  // prompt + max_tokens beyond the model's context (4096 for the default preset)
  expectError(
      postJson(*cluster_, "/v1/completions", R"({"model":"pdserve-default","prompt":"hi","max_tokens":100000})"), 400);
  // token ids outside the vocabulary
  expectError(postJson(*cluster_, "/v1/completions", R"({"model":"pdserve-default","prompt":[1,2,999999999]})"), 400);
  // body over router.max_body_bytes (64 KiB here)
  const std::string big = R"({"model":"pdserve-default","prompt":")" + std::string(100000, 'a') + "\"}";
  expectError(postJson(*cluster_, "/v1/completions", big), 413);
}

TEST_F(E2eChat, ProbesAndModelsAnswer) {
  const auto health = getPath(cluster_->host(), cluster_->port(), "/health");
  EXPECT_EQ(health.status, 200);
  const auto ready = getPath(cluster_->host(), cluster_->port(), "/ready");
  EXPECT_EQ(ready.status, 200);
  const auto models = getPath(cluster_->host(), cluster_->port(), "/v1/models");
  ASSERT_EQ(models.status, 200);
  EXPECT_NE(models.body.find("pdserve-default"), std::string::npos);
  const auto metrics = getPath(cluster_->host(), cluster_->port(), "/metrics");
  ASSERT_EQ(metrics.status, 200);
  EXPECT_NE(metrics.body.find("pdserve_router_"), std::string::npos);
}

TEST(E2eRouterAlone, ApiKeysAreRequiredAndProbesStayOpen) {
  TempDir dir;
  {
    std::ofstream keys(dir.path() / "keys");
    keys << "sk-test-1\n";
  }
  // No workers at all: the router still starts, probes answer, /ready says not ready.
  RoleProcess router("router",
                     {"--router.port=0", "--model.tokenizer=" PD_TOKENIZER_DIR,
                      "--router.api_keys_file=" + (dir.path() / "keys").string(), "--router.decode_workers=127.0.0.1:1",
                      "--router.prefill_workers=127.0.0.1:1", "--log.level=warn"});
  ASSERT_TRUE(router.ready());
  EXPECT_EQ(getPath(router.host(), router.port(), "/health").status, 200);
  EXPECT_EQ(getPath(router.host(), router.port(), "/ready").status, 503);
  const std::string body = R"({"model":"pdserve-default","messages":[{"role":"user","content":"hi"}]})";
  http::Client client(router.host(), router.port());
  http::ClientRequest req;
  req.method = "POST";
  req.target = "/v1/chat/completions";
  req.headers = {{"Content-Type", "application/json"}};
  req.body = body;
  auto missing = client.send(req, 30s);
  ASSERT_TRUE(missing.ok());
  expectError(*missing, 401);
  req.headers.push_back({"Authorization", "Bearer sk-wrong"});
  auto wrong = client.send(req, 30s);
  ASSERT_TRUE(wrong.ok());
  expectError(*wrong, 401, "sk-wrong");
  req.headers.back().value = "Bearer sk-test-1";
  auto no_workers = client.send(req, 30s);
  ASSERT_TRUE(no_workers.ok());
  expectError(*no_workers, 503);
  EXPECT_EQ(router.signal(SIGTERM), true);
  EXPECT_EQ(router.wait(30s), 0);
}

}  // namespace
}  // namespace pd::test
