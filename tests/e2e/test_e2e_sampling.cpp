// The request fields that steer a generation act through the whole system (`pdserve up` on
// models/tiny-dsv3, MTP on): logit_bias (prefill's first token and decode's), min_p,
// stop_token_ids, ignore_eos, skip_special_tokens, include_stop_str_in_output,
// max_completion_tokens over max_tokens, and seed. Each check compares with a greedy baseline
// from the same cluster, so it holds for any weights.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "support/local_cluster.h"
#include "support/test_files.h"

namespace pd::test {
namespace {

namespace json = boost::json;
namespace fs = std::filesystem;

const fs::path kModel = fs::path(PD_TEST_DATA_DIR) / ".." / ".." / "models" / "tiny-dsv3";
constexpr std::int64_t kEos = 1;                                    // tokenizer_config.json of the model
constexpr std::string_view kEosText = "<｜end▁of▁sentence｜>";      // its text
constexpr std::string_view kStoppingQuestion = "What is a river?";  // greedy: 13 tokens, then EOS

struct Answer {
  std::vector<std::int64_t> ids;
  std::string text;
  std::string finish_reason;
};

class E2eSampling : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cache_ = std::make_unique<TempDir>();
    cluster_ = std::make_unique<LocalCluster>(
        std::vector<std::string>{"--model.path=" + kModel.string(), "--model.cache_dir=" + cache_->path().string(),
                                 "--router.port=0", "--decode.num_speculative_tokens=1", "--log.level=warn"});
    // up prints READY once the router listens; it routes once its polls put the workers in rotation.
    for (int i = 0; i < 600 && getPath(cluster_->host(), cluster_->port(), "/ready").status != 200; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  static void TearDownTestSuite() {
    cluster_.reset();
    cache_.reset();
  }
  void SetUp() override { ASSERT_FALSE(cluster_->url().empty()); }

  /// POSTs `body` (with return_token_ids) to /v1/completions when it has a prompt, else to chat.
  static Answer ask(json::object body) {
    body["model"] = "pdserve-default";
    body["return_token_ids"] = true;
    const bool chat = body.contains("messages");
    const auto response = postJson(*cluster_, chat ? "/v1/chat/completions" : "/v1/completions", json::serialize(body));
    EXPECT_EQ(response.status, 200) << response.body;
    if (response.status != 200) return {};
    const auto doc = json::parse(response.body);
    const auto& choice = doc.at("choices").as_array().at(0).as_object();
    Answer a;
    for (const auto& t : choice.at("token_ids").as_array()) a.ids.push_back(t.to_number<std::int64_t>());
    a.text = std::string(chat ? choice.at("message").at("content").as_string() : choice.at("text").as_string());
    a.finish_reason = std::string(choice.at("finish_reason").as_string());
    return a;
  }
  static json::object greedy(std::int64_t max_tokens) {
    return json::object{{"prompt", "The sea is"}, {"max_tokens", max_tokens}, {"temperature", 0}, {"ignore_eos", true}};
  }
  static json::object question() {
    return json::object{{"messages", json::array{json::object{{"role", "user"}, {"content", kStoppingQuestion}}}},
                        {"max_tokens", 32},
                        {"temperature", 0}};
  }

  static std::unique_ptr<TempDir> cache_;
  static std::unique_ptr<LocalCluster> cluster_;
};
std::unique_ptr<TempDir> E2eSampling::cache_;
std::unique_ptr<LocalCluster> E2eSampling::cluster_;

TEST_F(E2eSampling, LogitBiasForcesAndForbidsTokensFromTheFirstOn) {
  const Answer base = ask(greedy(8));
  ASSERT_EQ(base.ids.size(), 8U);
  // +100 on a token no greedy step picked: every token is it, the first (prefill's) included.
  std::int64_t forced = 500;
  while (std::find(base.ids.begin(), base.ids.end(), forced) != base.ids.end()) ++forced;
  json::object force = greedy(8);
  force["logit_bias"] = json::object{{std::to_string(forced), 100}};
  EXPECT_EQ(ask(force).ids, std::vector<std::int64_t>(8, forced));
  // -100 on the greedy first token: the answer starts elsewhere.
  json::object forbid = greedy(8);
  forbid["logit_bias"] = json::object{{std::to_string(base.ids[0]), -100}};
  const Answer other = ask(forbid);
  ASSERT_FALSE(other.ids.empty());
  EXPECT_NE(other.ids[0], base.ids[0]);
  for (const auto id : other.ids) EXPECT_NE(id, base.ids[0]);
}

TEST_F(E2eSampling, MinPOfOneKeepsOnlyTheMostLikelyToken) {
  const Answer base = ask(greedy(12));
  bool hot_differs = false;
  for (const int seed : {1, 2, 3}) {
    json::object hot = greedy(12);
    hot["temperature"] = 2.0;
    hot["seed"] = seed;
    hot_differs = hot_differs || ask(hot).ids != base.ids;  // without min_p, temperature 2 wanders
    hot["min_p"] = 1.0;
    EXPECT_EQ(ask(hot).ids, base.ids) << "seed " << seed;
  }
  EXPECT_TRUE(hot_differs) << "temperature 2 without min_p never left the greedy path: the check above proves nothing";
}

TEST_F(E2eSampling, StopTokenIdsEndTheAnswerAtTheFirstOccurrence) {
  const Answer base = ask(greedy(12));
  ASSERT_EQ(base.ids.size(), 12U);
  std::size_t at = 3;  // the first position whose token did not occur before it
  while (at < base.ids.size() && std::find(base.ids.begin(), base.ids.begin() + static_cast<std::ptrdiff_t>(at),
                                           base.ids[at]) != base.ids.begin() + static_cast<std::ptrdiff_t>(at)) {
    ++at;
  }
  ASSERT_LT(at, base.ids.size());
  json::object body = greedy(12);
  body["stop_token_ids"] = json::array{base.ids[at]};
  const Answer stopped = ask(body);
  EXPECT_EQ(stopped.ids,
            std::vector<std::int64_t>(base.ids.begin(), base.ids.begin() + static_cast<std::ptrdiff_t>(at) + 1));
  EXPECT_EQ(stopped.finish_reason, "stop");
}

TEST_F(E2eSampling, IgnoreEosAndSkipSpecialTokens) {
  const Answer base = ask(question());
  ASSERT_EQ(base.finish_reason, "stop");
  ASSERT_FALSE(base.ids.empty());
  EXPECT_EQ(base.ids.back(), kEos);
  EXPECT_EQ(base.text.find(kEosText), std::string::npos);

  json::object keep = question();
  keep["skip_special_tokens"] = false;
  const Answer kept = ask(keep);
  EXPECT_EQ(kept.ids, base.ids);
  EXPECT_EQ(kept.text, base.text + std::string(kEosText));

  json::object past = question();
  past["ignore_eos"] = true;
  const Answer longer = ask(past);
  EXPECT_EQ(longer.finish_reason, "length");
  EXPECT_EQ(longer.ids.size(), 32U);
  EXPECT_TRUE(std::equal(base.ids.begin(), base.ids.end(), longer.ids.begin()));  // EOS, then more
}

TEST_F(E2eSampling, IncludeStopStrInOutputKeepsTheMatch) {
  const Answer base = ask(greedy(16));
  ASSERT_GE(base.text.size(), 8U);
  const std::string stop = base.text.substr(4, 3);
  const std::size_t at = base.text.find(stop);
  json::object body = greedy(16);
  body["stop"] = stop;
  const Answer cut = ask(body);
  EXPECT_EQ(cut.text, base.text.substr(0, at));
  EXPECT_EQ(cut.finish_reason, "stop");
  body["include_stop_str_in_output"] = true;
  const Answer kept = ask(body);
  EXPECT_EQ(kept.text, base.text.substr(0, at + stop.size()));
  EXPECT_EQ(kept.finish_reason, "stop");
}

TEST_F(E2eSampling, MaxCompletionTokensWinsAndSeedsRepeat) {
  json::object body = greedy(10);
  body["max_completion_tokens"] = 3;
  const Answer a = ask(body);
  EXPECT_EQ(a.ids.size(), 3U);
  EXPECT_EQ(a.finish_reason, "length");

  json::object sampled = greedy(12);
  sampled["temperature"] = 1.5;
  sampled["seed"] = 99;
  EXPECT_EQ(ask(sampled).ids, ask(sampled).ids);
}

}  // namespace
}  // namespace pd::test
