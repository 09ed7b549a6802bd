// Conditional disaggregation through real processes (router, prefill and decode workers over
// real HTTP and UCX): with --router.remote_prefill_min_tokens, a short prompt is prefilled by its
// decode worker itself (no prefill worker, no KV transfer) and a long one by the prefill worker,
// and both generate exactly the tokens of a deployment where every prompt goes to the prefill
// worker (greedy, and seeded while streaming); the decision shows in the router's, the decode
// worker's and the prefill worker's metrics.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "pd/common/http_client.h"
#include "support/metrics_text.h"
#include "support/role_process.h"
#include "support/router_serving.h"
#include "support/test_files.h"
#include "support/test_model.h"

namespace pd::test {
namespace {

namespace json = boost::json;
using namespace std::chrono_literals;

const std::string kShort = "Tell me about rivers.";  // a few tokens
std::string longPrompt() {
  std::string text = "A long conversation:";
  for (int i = 0; i < 30; ++i) text += " the river " + std::to_string(i * 7) + " runs to the sea;";
  return text;
}

// A metric sample of `url`'s /metrics: `series` is the name with its labels as printed, e.g.
// name{where="local",reason="short_prompt"}; 0 when absent (counters not yet incremented).
double metric(const RoleProcess& p, const std::string& series) {
  const auto body = scrapeMetrics(p.host(), p.port());
  EXPECT_TRUE(body.has_value());
  return body ? sampleValue(*body, series).value_or(0) : -1;
}

class Deployment {
 public:
  Deployment(const std::string& model_dir, std::vector<std::string> router_flags) {
    const std::string model = "--model.path=" + model_dir;
    // Local prefill takes the prefill worker's chunks: the same KV, so the same tokens.
    decode_ = std::make_unique<RoleProcess>(
        "decode", std::vector<std::string>{model, "--decode.port=0", "--decode.threads=1", "--decode.num_blocks=256",
                                           "--decode.local_prefill_chunk_size=16", "--log.level=warn"});
    prefill_ = std::make_unique<RoleProcess>(
        "prefill", std::vector<std::string>{model, "--prefill.port=0", "--prefill.threads=1", "--prefill.chunk_size=16",
                                            "--log.level=warn"});
    ok_ = decode_->ready() && prefill_->ready();
    if (!ok_) return;
    std::vector<std::string> rf{model, "--router.port=0", "--router.prefill_workers=" + prefill_->hostPort(),
                                "--router.decode_workers=" + decode_->hostPort(), "--log.level=warn"};
    rf.insert(rf.end(), router_flags.begin(), router_flags.end());
    router_ = std::make_unique<RoleProcess>("router", rf);
    ok_ = router_->ready() && waitRouterServing(router_->host(), router_->port());
  }
  [[nodiscard]] bool ok() const { return ok_; }
  const RoleProcess& router() const { return *router_; }
  const RoleProcess& prefill() const { return *prefill_; }
  const RoleProcess& decode() const { return *decode_; }

  // Greedy completion: its token ids.
  std::vector<std::int64_t> complete(const std::string& prompt) {
    http::Client client(router_->host(), router_->port());
    const std::string body = json::serialize(json::object{{"model", "pdserve-default"},
                                                          {"prompt", prompt},
                                                          {"max_tokens", 12},
                                                          {"ignore_eos", true},
                                                          {"temperature", 0},
                                                          {"return_token_ids", true}});
    auto response = client.send({"POST", "/v1/completions", {{"Content-Type", "application/json"}}, body}, 120s);
    std::vector<std::int64_t> ids;
    EXPECT_TRUE(response.ok()) << (response.ok() ? "" : response.error().toString());
    if (!response.ok()) return ids;
    EXPECT_EQ(response->status, 200) << response->body;
    if (response->status != 200) return ids;
    const auto doc = json::parse(response->body);
    const auto* token_ids = doc.at("choices").at(0).as_object().if_contains("token_ids");
    EXPECT_TRUE(token_ids != nullptr && token_ids->is_array()) << response->body;
    if (token_ids == nullptr || !token_ids->is_array()) return ids;
    for (const auto& t : token_ids->as_array()) {
      EXPECT_TRUE(t.is_int64()) << response->body;
      if (t.is_int64()) ids.push_back(t.as_int64());
    }
    return ids;
  }

  // Seeded streaming chat: the concatenated content of its chunks.
  std::string streamChat(const std::string& text) {
    http::Client client(router_->host(), router_->port());
    const std::string body =
        json::serialize(json::object{{"model", "pdserve-default"},
                                     {"messages", json::array{json::object{{"role", "user"}, {"content", text}}}},
                                     {"max_tokens", 16},
                                     {"temperature", 0.8},
                                     {"seed", 42},
                                     {"stream", true}});
    auto response = client.send({"POST", "/v1/chat/completions", {{"Content-Type", "application/json"}}, body}, 120s);
    EXPECT_TRUE(response.ok());
    if (!response.ok()) return {};
    EXPECT_EQ(response->status, 200) << response->body;
    std::string content;
    std::size_t at = 0;
    while ((at = response->body.find("data: ", at)) != std::string::npos) {
      const std::size_t end = response->body.find("\n\n", at);
      const std::string data = response->body.substr(at + 6, end - at - 6);
      at = end;
      if (data == "[DONE]") break;
      const auto doc = json::parse(data);
      const auto& choices = doc.at("choices").as_array();
      if (choices.empty()) continue;
      const auto& delta = choices.at(0).at("delta").as_object();
      if (const auto* c = delta.if_contains("content"); c != nullptr && c->is_string()) content += c->as_string();
    }
    return content;
  }

 private:
  std::unique_ptr<RoleProcess> decode_;
  std::unique_ptr<RoleProcess> prefill_;
  std::unique_ptr<RoleProcess> router_;
  bool ok_ = false;
};

class LocalPrefillE2e : public DefaultModelSuite<LocalPrefillE2e> {};

TEST_F(LocalPrefillE2e, ShortPromptsArePrefilledByTheDecodeWorkerWithTheSameTokens) {
  std::vector<std::int64_t> remote_short;
  std::vector<std::int64_t> remote_long;
  std::string remote_chat;
  {
    Deployment d(modelDir(), {});
    ASSERT_TRUE(d.ok());
    remote_short = d.complete(kShort);
    remote_long = d.complete(longPrompt());
    remote_chat = d.streamChat(kShort);
    EXPECT_EQ(metric(d.router(), R"(pdserve_router_prefills_total{where="remote",reason="disabled"})"), 3);
    EXPECT_EQ(metric(d.decode(), "pdserve_decode_local_prefills_total"), 0);
  }
  Deployment d(modelDir(), {"--router.remote_prefill_min_tokens=64"});
  ASSERT_TRUE(d.ok());
  const double prefilled_before = metric(d.prefill(), "pdserve_prefill_prompt_tokens_total");
  EXPECT_EQ(d.complete(kShort), remote_short) << "a local prefill changed the greedy tokens";
  EXPECT_EQ(d.streamChat(kShort), remote_chat) << "a local prefill changed the seeded stream";
  // Neither short prompt reached the prefill worker; the decode worker prefilled both.
  EXPECT_EQ(metric(d.prefill(), "pdserve_prefill_prompt_tokens_total"), prefilled_before);
  EXPECT_EQ(metric(d.decode(), "pdserve_decode_local_prefills_total"), 2);
  EXPECT_EQ(metric(d.router(), R"(pdserve_router_prefills_total{where="local",reason="short_prompt"})"), 2);
  // A long prompt still goes to the prefill worker.
  EXPECT_EQ(d.complete(longPrompt()), remote_long);
  EXPECT_GT(metric(d.prefill(), "pdserve_prefill_prompt_tokens_total"), prefilled_before);
  EXPECT_EQ(metric(d.router(), R"(pdserve_router_prefills_total{where="remote",reason="long_prompt"})"), 1);
  EXPECT_EQ(metric(d.decode(), "pdserve_decode_local_prefills_total"), 2);
  // Every block is free again.
  EXPECT_EQ(metric(d.decode(), "pdserve_kv_blocks_free"), metric(d.decode(), "pdserve_kv_blocks_total"));
}

}  // namespace
}  // namespace pd::test
