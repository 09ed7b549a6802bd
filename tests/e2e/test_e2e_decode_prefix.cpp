// Decode-side prefix reuse through real processes (router, prefill and decode workers over real
// HTTP and UCX; docs/kv-memory.md "Prefix reuse on the decode side"): turn 2 of a conversation,
// sent to the decode worker that served turn 1, transfers only the blocks after the ones its
// prefix cache holds (the prefill worker's put bytes, the decode worker's received bytes and hit
// metric), and generates exactly the greedy tokens of a deployment without the decode cache; the
// pool is free at the end but for the cache, which the status reports. A pool too small to keep the
// cache evicts (metric) and still answers the same tokens. That the pool then holds a cold
// prefill's KV bit for bit is checked where the pool can be read: test_prefill_worker.cpp
// (PrefillWorkerPresentBlocks). Each test runs with one decode rank and with a tensor-parallel
// decode worker of two ranks (`decode.tensor_parallel` 2, its follower a process it spawns),
// whose follower must hold the same shared blocks as its leader for the tokens to come out the
// same.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "pd/common/http_client.h"
#include "pd/common/worker_api.h"
#include "support/metrics_text.h"
#include "support/role_process.h"
#include "support/router_serving.h"
#include "support/test_files.h"
#include "support/test_model.h"
#include "support/worker_status.h"

namespace pd::test {
namespace {

namespace json = boost::json;
using namespace std::chrono_literals;

std::string history(int words) {
  std::string text = "A long conversation:";
  for (int i = 0; i < words; ++i) text += " the river " + std::to_string(i * 7) + " runs to the sea;";
  return text;
}

struct Answer {
  std::vector<std::int64_t> token_ids;
  std::int64_t prompt_tokens = -1;
  std::int64_t cached_tokens = 0;
};

double metricOf(const RoleProcess& p, const std::string& series) {
  const auto body = scrapeMetrics(p.host(), p.port());
  return body ? sampleValue(*body, series).value_or(-1) : -1;
}

// A router, a prefill worker and a decode worker of `decode_tp` ranks with 16-token blocks and
// chunks (one block per reuse granule); `decode_flags` add to the decode worker's.
class Deployment {
 public:
  Deployment(const std::string& model_dir, int decode_tp, std::vector<std::string> decode_flags) {
    const std::string model = "--model.path=" + model_dir;
    std::vector<std::string> df{model,
                                "--decode.port=0",
                                "--decode.threads=1",
                                "--decode.block_size=16",
                                "--decode.local_prefill_chunk_size=16",
                                "--decode.tensor_parallel=" + std::to_string(decode_tp),
                                "--log.level=warn"};
    df.insert(df.end(), decode_flags.begin(), decode_flags.end());
    decode_ = std::make_unique<RoleProcess>("decode", df);
    prefill_ = std::make_unique<RoleProcess>(
        "prefill", std::vector<std::string>{model, "--prefill.port=0", "--prefill.threads=1", "--prefill.chunk_size=16",
                                            "--prefill.cache_block_size=16", "--log.level=warn"});
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
    auto response = client.send(req, 120s);
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

  [[nodiscard]] double prefillMetric(const std::string& series) const { return metricOf(*prefill_, series); }
  [[nodiscard]] double decodeMetric(const std::string& series) const { return metricOf(*decode_, series); }

  // The decode worker's status once its last request has ended (nothing running or waiting).
  std::optional<worker_api::WorkerStatus> decodeStatusWhenIdle() const {
    return waitWorkerStatus(decode_->host(), decode_->port(), workerIsClean, 30s, 20ms);
  }

 private:
  std::unique_ptr<RoleProcess> decode_;
  std::unique_ptr<RoleProcess> prefill_;
  std::unique_ptr<RoleProcess> router_;
  bool ok_ = false;
};

// The parameter: the decode worker's tensor-parallel ranks.
class DecodePrefixE2e : public DefaultModelSuite<DecodePrefixE2e>, public ::testing::WithParamInterface<int> {
 protected:
  static int tp() { return GetParam(); }
};

const std::string kTurn1 = history(30);
const std::string kTurn2 = kTurn1 + " and then, after all that, what does the river do next?";
const std::string kOther = "Something else entirely:" + history(30).substr(20);

constexpr const char* kPutBytes = "pdserve_kv_put_bytes_total";
constexpr const char* kHitTokens = "pdserve_decode_prefix_cache_hit_tokens_total";

TEST_P(DecodePrefixE2e, SecondTurnTransfersOnlyTheNewBlocksAndGeneratesTheSameTokens) {
  std::vector<Answer> off;
  double off_turn2_bytes = 0;
  {
    Deployment d(modelDir(), tp(), {"--decode.prefix_cache_blocks=0"});
    ASSERT_TRUE(d.ok());
    off.push_back(d.complete(kTurn1));
    const double before = d.prefillMetric(kPutBytes);
    off.push_back(d.complete(kTurn2));
    off_turn2_bytes = d.prefillMetric(kPutBytes) - before;
    EXPECT_EQ(d.decodeMetric(kHitTokens), 0) << "cache off: nothing reused";
  }
  ASSERT_GT(off_turn2_bytes, 0);
  Deployment d(modelDir(), tp(), {"--decode.prefix_cache_blocks=64"});
  ASSERT_TRUE(d.ok());
  const Answer t1 = d.complete(kTurn1);
  EXPECT_EQ(t1.token_ids, off[0].token_ids);
  EXPECT_EQ(d.decodeMetric(kHitTokens), 0);
  ASSERT_GT(t1.prompt_tokens, 64);
  // Turn 1's full prompt blocks short of its last token are cached.
  const auto after_t1 = d.decodeStatusWhenIdle();
  ASSERT_TRUE(after_t1.has_value());
  EXPECT_EQ(after_t1->prefix_cache_blocks, (t1.prompt_tokens - 1) / 16);
  EXPECT_EQ(after_t1->prefix_cache_capacity, 64);

  const double put_before = d.prefillMetric(kPutBytes);
  const double received_before = d.decodeMetric("pdserve_kv_received_bytes_total");
  const Answer t2 = d.complete(kTurn2);
  const double put = d.prefillMetric(kPutBytes) - put_before;
  const double received = d.decodeMetric("pdserve_kv_received_bytes_total") - received_before;
  EXPECT_EQ(t2.token_ids, off[1].token_ids) << "greedy tokens differ with decode-side reuse";
  ASSERT_EQ(t2.prompt_tokens, off[1].prompt_tokens);
  // Every full block of turn 1's prompt (short of its last token) was present: only the rest
  // crossed, in exact proportion to the tokens.
  const double present = d.decodeMetric(kHitTokens);
  EXPECT_EQ(present, static_cast<double>((t1.prompt_tokens - 1) / 16 * 16));
  EXPECT_EQ(
      put, off_turn2_bytes * (static_cast<double>(t2.prompt_tokens) - present) / static_cast<double>(t2.prompt_tokens));
  // Every rank's pool gets the same bytes; the leader counts its own.
  EXPECT_EQ(received * tp(), put);
  EXPECT_LT(put, off_turn2_bytes / 2);
  // cached_tokens stays what the prefill worker reused (its own prefix cache).
  EXPECT_EQ(t2.cached_tokens, off[1].cached_tokens);
  // The pool is free but for the cache (idle cached blocks count as free).
  const auto end = d.decodeStatusWhenIdle();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->free_blocks, end->total_blocks);
  EXPECT_EQ(end->prefix_cache_blocks, (t2.prompt_tokens - 1) / 16);
  EXPECT_EQ(d.decodeMetric("pdserve_decode_prefix_cache_blocks"), static_cast<double>(end->prefix_cache_blocks));
  EXPECT_EQ(d.decodeMetric("pdserve_kv_blocks_free"), static_cast<double>(end->total_blocks));
}

TEST_P(DecodePrefixE2e, EvictionUnderPressureKeepsTheTokens) {
  std::vector<Answer> off;
  {
    Deployment d(modelDir(), tp(), {"--decode.prefix_cache_blocks=0"});
    ASSERT_TRUE(d.ok());
    for (const auto* p : {&kTurn1, &kOther, &kTurn2}) off.push_back(d.complete(*p));
  }
  ASSERT_GT(off[2].prompt_tokens, 0);
  // A pool just large enough for turn 2 (its prompt, 12 tokens, the headroom of 2 and one more):
  // turn 1's cached blocks and the other prompt's do not fit together.
  const std::string blocks = std::to_string((off[2].prompt_tokens + 12 + 15) / 16 + 3);
  Deployment d(modelDir(), tp(), {"--decode.prefix_cache_blocks=" + blocks, "--decode.num_blocks=" + blocks});
  ASSERT_TRUE(d.ok());
  std::vector<Answer> on;
  for (const auto* p : {&kTurn1, &kOther, &kTurn2}) on.push_back(d.complete(*p));
  EXPECT_GT(d.decodeMetric("pdserve_decode_prefix_cache_evictions_total"), 0);
  for (std::size_t i = 0; i < on.size(); ++i) EXPECT_EQ(on[i].token_ids, off[i].token_ids) << "request " << i;
  const auto end = d.decodeStatusWhenIdle();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->free_blocks, end->total_blocks);
}

INSTANTIATE_TEST_SUITE_P(Ranks, DecodePrefixE2e, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& p) { return "Tp" + std::to_string(p.param); });

}  // namespace
}  // namespace pd::test
