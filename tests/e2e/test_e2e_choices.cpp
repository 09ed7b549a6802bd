// n > 1 through real processes (router, prefill and decode workers over real HTTP and UCX, MTP on):
// one prefill per request whatever n (the prefill worker's counter), n choices sharing the prompt's
// decode blocks, each choice equal to the n = 1 answer seeded choiceSeed(seed, i) (choice 0: the
// seed itself; greedy: every choice is the greedy answer), reproducible, streaming equal to
// non-streaming per choice, chat and completions; the decode pool fully free after every request;
// n over router.max_n is a 400 naming the cap.
#include <gtest/gtest.h>

#include <algorithm>
#include <boost/json.hpp>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "pd/common/choices.h"
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

struct Choice {
  std::vector<std::int64_t> ids;
  std::string text;
  std::string finish_reason;
};

struct Answer {
  int status = 0;
  std::string body;
  std::vector<Choice> choices;
  std::int64_t prompt_tokens = -1;
  std::int64_t completion_tokens = -1;
};

// A GET /metrics value of `name` (with its labels, if any) on host:port; -1 when absent.
double metric(const std::string& host, std::uint16_t port, const std::string& name) {
  const auto body = scrapeMetrics(host, port);
  return body ? sampleValue(*body, name).value_or(-1) : -1;
}

class ChoicesE2e : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>();
    makeDefaultModel(dir_->path() / "m");
    const std::string model = "--model.path=" + (dir_->path() / "m").string();
    // Blocks of 16 tokens: the prompts below span several, the last one partial.
    decode_ = std::make_unique<RoleProcess>(
        "decode",
        std::vector<std::string>{model, "--decode.port=0", "--decode.threads=1", "--decode.num_blocks=256",
                                 "--decode.block_size=16", "--decode.num_speculative_tokens=1", "--log.level=warn"});
    prefill_ = std::make_unique<RoleProcess>(
        "prefill", std::vector<std::string>{model, "--prefill.port=0", "--prefill.threads=1", "--log.level=warn"});
    ASSERT_TRUE(decode_->ready() && prefill_->ready());
    router_ = std::make_unique<RoleProcess>(
        "router", std::vector<std::string>{model, "--router.port=0", "--router.prefill_workers=" + prefill_->hostPort(),
                                           "--router.decode_workers=" + decode_->hostPort(), "--router.max_n=4",
                                           "--log.level=warn"});
    ASSERT_TRUE(router_->ready() && waitRouterServing(router_->host(), router_->port()));
  }
  static void TearDownTestSuite() {
    router_.reset();
    prefill_.reset();
    decode_.reset();
    dir_.reset();
  }
  void SetUp() override { ASSERT_TRUE(router_ != nullptr); }

  // Prefills answered ok so far (the labelled series appears with the first one).
  static double prefills() {
    return std::max(0.0, metric(prefill_->host(), prefill_->port(), R"(pdserve_prefill_requests_total{outcome="ok"})"));
  }
  // The decode pool is fully free: every block of every choice came back.
  static void expectPoolFree() {
    const double total = metric(decode_->host(), decode_->port(), "pdserve_kv_blocks_total");
    ASSERT_GT(total, 0);
    EXPECT_EQ(metric(decode_->host(), decode_->port(), "pdserve_kv_blocks_free"), total);
  }

  static json::object chat(std::int64_t n, std::int64_t max_tokens, std::optional<std::int64_t> seed) {
    json::object body{{"messages", json::array{json::object{{"role", "user"},
                                                            {"content",
                                                             "Tell me about the river and the sea, at length "
                                                             "and in detail, please."}}}},
                      {"max_tokens", max_tokens},
                      {"ignore_eos", true},
                      {"n", n}};
    if (seed) {
      body["temperature"] = 1.0;
      body["seed"] = *seed;
    } else {
      body["temperature"] = 0;
    }
    return body;
  }

  static Answer ask(json::object body) {
    body["model"] = "pdserve-default";
    body["return_token_ids"] = true;
    const bool is_chat = body.contains("messages");
    http::Client client(router_->host(), router_->port());
    http::ClientRequest req;
    req.method = "POST";
    req.target = is_chat ? "/v1/chat/completions" : "/v1/completions";
    req.headers = {{"Content-Type", "application/json"}};
    req.body = json::serialize(body);
    Answer a;
    auto response = client.send(req, 120s);
    EXPECT_TRUE(response.ok()) << (response.ok() ? "" : response.error().toString());
    if (!response.ok()) return a;
    a.status = response->status;
    a.body = response->body;
    if (a.status != 200) return a;
    const auto doc = json::parse(response->body);
    const auto& choices = doc.at("choices").as_array();
    for (std::size_t i = 0; i < choices.size(); ++i) {
      const auto& c = choices[i].as_object();
      EXPECT_EQ(c.at("index").to_number<std::int64_t>(), static_cast<std::int64_t>(i));
      Choice out;
      for (const auto& t : c.at("token_ids").as_array()) out.ids.push_back(t.to_number<std::int64_t>());
      out.text = std::string(is_chat ? c.at("message").at("content").as_string() : c.at("text").as_string());
      out.finish_reason = std::string(c.at("finish_reason").as_string());
      a.choices.push_back(std::move(out));
    }
    a.prompt_tokens = doc.at("usage").at("prompt_tokens").to_number<std::int64_t>();
    a.completion_tokens = doc.at("usage").at("completion_tokens").to_number<std::int64_t>();
    return a;
  }

  // The streamed answer: each choice's token ids and text (by its index) and its finish chunks.
  static std::map<std::int64_t, Choice> askStreaming(json::object body) {
    body["model"] = "pdserve-default";
    body["return_token_ids"] = true;
    body["stream"] = true;
    http::Client client(router_->host(), router_->port());
    http::ClientRequest req;
    req.method = "POST";
    req.target = "/v1/chat/completions";
    req.headers = {{"Content-Type", "application/json"}};
    req.body = json::serialize(body);
    std::map<std::int64_t, Choice> out;
    auto response = client.send(req, 120s);
    EXPECT_TRUE(response.ok() && response->status == 200);
    if (!response.ok()) return out;
    int done = 0;
    std::size_t at = 0;
    const std::string& text = response->body;
    while ((at = text.find("data: ", at)) != std::string::npos) {
      const std::size_t end = text.find("\n\n", at);
      const std::string data = text.substr(at + 6, end - at - 6);
      at = end;
      if (data == "[DONE]") {
        ++done;
        continue;
      }
      const auto chunk = json::parse(data);
      for (const auto& c : chunk.at("choices").as_array()) {
        Choice& choice = out[c.at("index").to_number<std::int64_t>()];
        if (const auto* ids = c.as_object().if_contains("token_ids")) {
          for (const auto& t : ids->as_array()) choice.ids.push_back(t.to_number<std::int64_t>());
        }
        if (const auto* content = c.at("delta").as_object().if_contains("content")) {
          choice.text += std::string(content->as_string());
        }
        if (!c.at("finish_reason").is_null()) {
          EXPECT_TRUE(choice.finish_reason.empty()) << "a second finish for one choice";
          choice.finish_reason = std::string(c.at("finish_reason").as_string());
        }
      }
    }
    EXPECT_EQ(done, 1);
    return out;
  }

  static std::unique_ptr<TempDir> dir_;
  static std::unique_ptr<RoleProcess> decode_;
  static std::unique_ptr<RoleProcess> prefill_;
  static std::unique_ptr<RoleProcess> router_;
};
std::unique_ptr<TempDir> ChoicesE2e::dir_;
std::unique_ptr<RoleProcess> ChoicesE2e::decode_;
std::unique_ptr<RoleProcess> ChoicesE2e::prefill_;
std::unique_ptr<RoleProcess> ChoicesE2e::router_;

TEST_F(ChoicesE2e, SeededChoicesShareOnePrefillAndEachEqualsItsOwnSeededAnswer) {
  constexpr std::int64_t kSeed = 7;
  const double before = prefills();
  const Answer three = ask(chat(3, 12, kSeed));
  ASSERT_EQ(three.status, 200) << three.body;
  EXPECT_EQ(prefills() - before, 1) << "n = 3 must prefill the prompt once";
  expectPoolFree();
  ASSERT_EQ(three.choices.size(), 3U);
  for (const Choice& c : three.choices) {
    EXPECT_EQ(c.ids.size(), 12U);
    EXPECT_EQ(c.finish_reason, "length");
  }
  EXPECT_EQ(three.completion_tokens, 36) << "usage sums the choices";
  EXPECT_GT(three.prompt_tokens, 16);
  EXPECT_TRUE(three.choices[0].ids != three.choices[1].ids || three.choices[1].ids != three.choices[2].ids)
      << "the choices' seeds had no effect";
  // Each choice is the n = 1 answer of its own seed: choice 0 of the request's, choice i of
  // choiceSeed(seed, i) (docs/api.md).
  for (std::int64_t i = 0; i < 3; ++i) {
    const Answer alone = ask(chat(1, 12, static_cast<std::int64_t>(pd::choiceSeed(kSeed, i))));
    ASSERT_EQ(alone.status, 200) << alone.body;
    EXPECT_EQ(alone.choices.at(0).ids, three.choices[static_cast<std::size_t>(i)].ids) << "choice " << i;
  }
  // Reproducible, and streaming gives every choice the same tokens.
  const Answer again = ask(chat(3, 12, kSeed));
  ASSERT_EQ(again.choices.size(), 3U);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(again.choices[i].ids, three.choices[i].ids) << i;
  const auto streamed = askStreaming(chat(3, 12, kSeed));
  ASSERT_EQ(streamed.size(), 3U);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(streamed.at(static_cast<std::int64_t>(i)).ids, three.choices[i].ids) << i;
    EXPECT_EQ(streamed.at(static_cast<std::int64_t>(i)).text, three.choices[i].text) << i;
    EXPECT_EQ(streamed.at(static_cast<std::int64_t>(i)).finish_reason, "length") << i;
  }
  expectPoolFree();
}

TEST_F(ChoicesE2e, GreedyChoicesAreTheGreedyAnswerForChatAndCompletions) {
  const Answer one = ask(chat(1, 10, std::nullopt));
  ASSERT_EQ(one.status, 200) << one.body;
  const double before = prefills();
  const Answer four = ask(chat(4, 10, std::nullopt));
  ASSERT_EQ(four.status, 200) << four.body;
  EXPECT_EQ(prefills() - before, 1);
  ASSERT_EQ(four.choices.size(), 4U);
  for (const Choice& c : four.choices) EXPECT_EQ(c.ids, one.choices.at(0).ids);
  json::object completion{{"prompt", "The sea is"}, {"max_tokens", 8}, {"ignore_eos", true}, {"temperature", 0}};
  const Answer plain = ask(completion);
  completion["n"] = 2;
  const Answer two = ask(completion);
  ASSERT_EQ(two.choices.size(), 2U);
  for (const Choice& c : two.choices) {
    EXPECT_EQ(c.ids, plain.choices.at(0).ids);
    EXPECT_EQ(c.text, plain.choices.at(0).text);
  }
  EXPECT_EQ(two.completion_tokens, 16);
  expectPoolFree();
}

TEST_F(ChoicesE2e, MoreChoicesThanTheCapIsA400NamingIt) {
  const Answer five = ask(chat(5, 4, std::nullopt));
  EXPECT_EQ(five.status, 400);
  EXPECT_NE(five.body.find("router.max_n"), std::string::npos) << five.body;
  EXPECT_NE(five.body.find("at most 4"), std::string::npos) << five.body;
  const Answer best_of = ask(json::object{{"prompt", "x"}, {"best_of", 2}});
  EXPECT_EQ(best_of.status, 400);
}

}  // namespace
}  // namespace pd::test
