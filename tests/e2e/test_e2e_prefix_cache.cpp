// The prefill prefix cache through real processes (router, prefill and decode workers over real
// HTTP and UCX): a second turn that repeats the first turn's prompt reuses its blocks
// (usage.prompt_tokens_details.cached_tokens, the prefill worker's hit metric) and generates
// exactly the greedy tokens a deployment with the cache off generates; a pool too small to keep
// everything evicts (metric) and still answers the same tokens.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "pd/common/http_client.h"
#include "pd/common/subprocess.h"
#include "support/metrics_text.h"
#include "support/role_process.h"
#include "support/router_serving.h"
#include "support/test_files.h"
#include "support/test_model.h"

namespace pd::test {
namespace {

namespace json = boost::json;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A few hundred tokens: several 16-token blocks.
std::string history(int words) {
  std::string text = "A long conversation:";
  for (int i = 0; i < words; ++i) text += " the river " + std::to_string(i * 7) + " runs to the sea;";
  return text;
}

struct Answer {
  std::vector<std::int64_t> token_ids;
  std::int64_t prompt_tokens = -1;
  std::int64_t cached_tokens = 0;
  double seconds = 0.0;
};

// One deployment: a prefill worker with the given prefix-cache flags, a decode worker, a router.
class Deployment {
 public:
  Deployment(const std::string& model_dir, std::vector<std::string> prefill_flags) {
    const std::string model = "--model.path=" + model_dir;
    decode_ = std::make_unique<RoleProcess>(
        "decode", std::vector<std::string>{model, "--decode.port=0", "--decode.threads=1", "--decode.num_blocks=256",
                                           "--log.level=warn"});
    std::vector<std::string> pf{model,
                                "--prefill.port=0",
                                "--prefill.threads=1",
                                "--prefill.chunk_size=16",
                                "--prefill.cache_block_size=16",
                                "--log.level=warn"};
    pf.insert(pf.end(), prefill_flags.begin(), prefill_flags.end());
    prefill_ = std::make_unique<RoleProcess>("prefill", pf);
    ok_ = decode_->ready() && prefill_->ready();
    if (!ok_) return;
    router_ = std::make_unique<RoleProcess>(
        "router", std::vector<std::string>{model, "--router.port=0", "--router.prefill_workers=" + prefill_->hostPort(),
                                           "--router.decode_workers=" + decode_->hostPort(), "--log.level=warn"});
    ok_ = router_->ready() && waitRouterServing(router_->host(), router_->port());
  }
  [[nodiscard]] bool ok() const { return ok_; }

  Answer complete(const std::string& prompt) {
    Answer a;
    http::Client client(router_->host(), router_->port());
    http::ClientRequest req;
    req.method = "POST";
    req.target = "/v1/completions";
    req.headers = {{"Content-Type", "application/json"}};
    req.body = json::serialize(json::object{{"model", "pdserve-default"},
                                            {"prompt", prompt},
                                            {"max_tokens", 12},
                                            {"ignore_eos", true},
                                            {"temperature", 0},
                                            {"return_token_ids", true}});
    const auto start = Clock::now();
    auto response = client.send(req, 120s);
    a.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    EXPECT_TRUE(response.ok()) << (response.ok() ? "" : response.error().toString());
    if (!response.ok()) return a;
    EXPECT_EQ(response->status, 200) << response->body;
    if (response->status != 200) return a;
    const auto doc = json::parse(response->body);
    for (const auto& t : doc.at("choices").as_array().at(0).at("token_ids").as_array()) {
      a.token_ids.push_back(t.to_number<std::int64_t>());
    }
    const auto& usage = doc.at("usage").as_object();
    a.prompt_tokens = usage.at("prompt_tokens").to_number<std::int64_t>();
    if (usage.contains("prompt_tokens_details")) {
      a.cached_tokens = usage.at("prompt_tokens_details").at("cached_tokens").to_number<std::int64_t>();
    }
    return a;
  }

  // A counter or gauge of the prefill worker's /metrics (-1 when absent).
  double prefillMetric(const std::string& name) {
    const auto body = scrapeMetrics(prefill_->host(), prefill_->port());
    return body ? sampleValue(*body, name).value_or(-1) : -1;
  }

 private:
  std::unique_ptr<RoleProcess> decode_;
  std::unique_ptr<RoleProcess> prefill_;
  std::unique_ptr<RoleProcess> router_;
  bool ok_ = false;
};

class PrefixCacheE2e : public DefaultModelSuite<PrefixCacheE2e> {};

const std::string kTurn1 = history(30);
const std::string kTurn2 = kTurn1 + " and then, after all that, what does the river do next?";
const std::string kOther = "Something else entirely:" + history(30).substr(20);

TEST_F(PrefixCacheE2e, SecondTurnReusesTheFirstTurnsBlocksAndGeneratesTheSameTokens) {
  std::vector<Answer> off;
  {
    Deployment d(modelDir(), {"--prefill.prefix_cache_blocks=0"});
    ASSERT_TRUE(d.ok());
    off.push_back(d.complete(kTurn1));
    off.push_back(d.complete(kTurn2));
    EXPECT_EQ(off[1].cached_tokens, 0) << "cache off: nothing reused";
    EXPECT_EQ(d.prefillMetric("pdserve_prefill_prefix_cache_hit_tokens_total"), 0);
  }
  Deployment d(modelDir(), {"--prefill.prefix_cache_blocks=64"});
  ASSERT_TRUE(d.ok());
  const Answer t1 = d.complete(kTurn1);
  const Answer t2 = d.complete(kTurn2);
  EXPECT_EQ(t1.cached_tokens, 0);
  EXPECT_EQ(t1.token_ids, off[0].token_ids);
  ASSERT_GT(t1.prompt_tokens, 64);
  // Turn 2 reuses turn 1's full 16-token blocks (short of its last token) and no more.
  EXPECT_GT(t2.cached_tokens, 0);
  EXPECT_EQ(t2.cached_tokens % 16, 0);
  EXPECT_LE(t2.cached_tokens, t1.prompt_tokens);
  EXPECT_GE(t2.cached_tokens, t1.prompt_tokens - 1 - 16);
  EXPECT_EQ(t2.token_ids, off[1].token_ids) << "greedy tokens differ with the prefix cache on";
  EXPECT_EQ(d.prefillMetric("pdserve_prefill_prefix_cache_hit_tokens_total"), static_cast<double>(t2.cached_tokens));
  EXPECT_GT(d.prefillMetric("pdserve_prefill_prefix_cache_blocks"), 0);
  std::printf(
      "[prefix-cache e2e] turn 2: %lld prompt tokens, %lld cached; request %.1f ms (cache on) vs %.1f ms (off)\n",
      static_cast<long long>(t2.prompt_tokens), static_cast<long long>(t2.cached_tokens), t2.seconds * 1e3,
      off[1].seconds * 1e3);
}

TEST_F(PrefixCacheE2e, EvictionUnderPressureKeepsTheTokens) {
  std::vector<Answer> off;
  {
    Deployment d(modelDir(), {"--prefill.prefix_cache_blocks=0", "--prefill.cache_blocks=24"});
    ASSERT_TRUE(d.ok());
    for (const auto* p : {&kTurn1, &kOther, &kTurn2}) off.push_back(d.complete(*p));
  }
  // A pool of 24 blocks: turn 1's blocks, then another prompt's, do not fit together.
  Deployment d(modelDir(), {"--prefill.prefix_cache_blocks=24", "--prefill.cache_blocks=24"});
  ASSERT_TRUE(d.ok());
  std::vector<Answer> on;
  for (const auto* p : {&kTurn1, &kOther, &kTurn2}) on.push_back(d.complete(*p));
  EXPECT_GT(d.prefillMetric("pdserve_prefill_prefix_cache_evictions_total"), 0);
  for (std::size_t i = 0; i < on.size(); ++i) EXPECT_EQ(on[i].token_ids, off[i].token_ids) << "request " << i;
}

}  // namespace
}  // namespace pd::test
