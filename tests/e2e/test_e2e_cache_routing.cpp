// Cache-aware routing through real processes (docs/routing.md): a router, two prefill workers with
// the prefix cache on and a decode worker, over real HTTP and UCX. Every later turn of a
// conversation goes to the prefill worker holding its prefix (cached_tokens > 0 every time), while
// round_robin misses; an imbalanced load falls back to the least loaded worker; a killed worker
// is never chosen, although the router's index still says it holds the prefix.
//
// Ordering is by construction: before a later turn the test waits until the router's index has
// caught up with what the workers hold (the router's pdserve_router_kv_index_blocks against the
// workers' pdserve_prefill_prefix_cache_blocks), and it reads decisions from the router's metrics.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <future>
#include <memory>
#include <string>
#include <thread>
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
using Clock = std::chrono::steady_clock;

struct Answer {
  int status = 0;
  std::string text;
  std::int64_t prompt_tokens = -1;
  std::int64_t cached_tokens = 0;
};

/// A metric's value in a Prometheus text body: the first line starting with `series` (name and
/// labels exactly as rendered); -1 when absent.
double metricValue(const std::string& body, const std::string& series) {
  return sampleValue(body, series).value_or(-1);
}

std::string getMetrics(const RoleProcess& p) {
  return scrapeMetrics(p.host(), p.port()).value_or(std::string());
}

template <class Pred>
bool waitFor(Pred pred, std::chrono::milliseconds timeout = 30s) {
  for (const auto until = Clock::now() + timeout; Clock::now() < until;) {
    if (pred()) return true;
    std::this_thread::sleep_for(20ms);  // polling metrics we cannot subscribe to
  }
  return pred();
}

class Cluster {
 public:
  Cluster(const std::string& model_dir, const std::vector<std::string>& router_flags) {
    const std::string model = "--model.path=" + model_dir;
    decode_ = std::make_unique<RoleProcess>(
        "decode", std::vector<std::string>{model, "--decode.port=0", "--decode.threads=1", "--decode.num_blocks=512",
                                           "--log.level=warn"});
    for (int i = 0; i < 2; ++i) {
      prefill_.push_back(std::make_unique<RoleProcess>(
          "prefill", std::vector<std::string>{model, "--prefill.port=0", "--prefill.threads=1",
                                              "--prefill.chunk_size=16", "--prefill.cache_block_size=16",
                                              "--prefill.prefix_cache_blocks=256", "--log.level=warn"}));
    }
    ok_ = decode_->ready() && prefill_[0]->ready() && prefill_[1]->ready();
    if (!ok_) return;
    std::vector<std::string> rf{model,
                                "--router.port=0",
                                "--router.prefill_workers=" + prefill_[0]->hostPort() + "," + prefill_[1]->hostPort(),
                                "--router.decode_workers=" + decode_->hostPort(),
                                "--router.health_interval_ms=100",
                                "--router.kv_events_interval_ms=10",
                                "--log.level=warn"};
    rf.insert(rf.end(), router_flags.begin(), router_flags.end());
    router_ = std::make_unique<RoleProcess>("router", rf);
    ok_ = router_->ready() && waitRouterServing(router_->host(), router_->port());
  }
  [[nodiscard]] bool ok() const { return ok_; }
  RoleProcess& prefill(int i) { return *prefill_[static_cast<std::size_t>(i)]; }
  RoleProcess& router() { return *router_; }

  Answer complete(const std::string& prompt) {
    Answer a;
    http::Client client(router_->host(), router_->port());
    http::ClientRequest req;
    req.method = "POST";
    req.target = "/v1/completions";
    req.headers = {{"Content-Type", "application/json"}};
    req.body = json::serialize(json::object{
        {"model", "pdserve-default"}, {"prompt", prompt}, {"max_tokens", 8}, {"ignore_eos", true}, {"temperature", 0}});
    auto response = client.send(req, 120s);
    if (!response.ok()) {
      ADD_FAILURE() << response.error().toString();
      return a;
    }
    a.status = response->status;
    if (a.status != 200) return a;
    const auto doc = json::parse(response->body);
    a.text = std::string(doc.at("choices").as_array().at(0).at("text").as_string());
    const auto& usage = doc.at("usage").as_object();
    a.prompt_tokens = usage.at("prompt_tokens").to_number<std::int64_t>();
    if (usage.contains("prompt_tokens_details")) {
      a.cached_tokens = usage.at("prompt_tokens_details").at("cached_tokens").to_number<std::int64_t>();
    }
    return a;
  }

  /// Blocks prefill worker `i`'s prefix cache holds (its own metric).
  double cachedBlocks(int i) { return metricValue(getMetrics(prefill(i)), "pdserve_prefill_prefix_cache_blocks"); }
  /// Blocks the router's index says prefill worker `i` holds.
  double indexedBlocks(int i) {
    return metricValue(getMetrics(*router_),
                       "pdserve_router_kv_index_blocks{worker=\"" + prefill(i).hostPort() + "\"}");
  }
  double decisions(const std::string& reason) {
    return metricValue(getMetrics(*router_),
                       "pdserve_router_routing_decisions_total{role=\"prefill\",reason=\"" + reason + "\"}");
  }
  /// Waits until the workers' prefix caches hold more blocks than `before` blocks in all (the
  /// last prompt's blocks went in: each prompt here adds at least one), then, when the router
  /// follows KV events, until its index holds as many per worker. Returns the new total.
  double settle(double before, bool indexed) {
    double total = 0;
    EXPECT_TRUE(waitFor([&] {
      total = cachedBlocks(0) + cachedBlocks(1);
      return total > before;
    })) << "the prefix caches did not grow";
    if (indexed) {
      EXPECT_TRUE(indexCaughtUp()) << "the router's index did not catch up";
    }
    return total;
  }
  /// Waits until the router's index holds as many blocks per worker as the workers report.
  bool indexCaughtUp() {
    return waitFor([&] {
      for (int i = 0; i < 2; ++i) {
        if (indexedBlocks(i) != cachedBlocks(i)) return false;
      }
      return true;
    });
  }

 private:
  std::unique_ptr<RoleProcess> decode_;
  std::vector<std::unique_ptr<RoleProcess>> prefill_;
  std::unique_ptr<RoleProcess> router_;
  bool ok_ = false;
};

class CacheRoutingE2e : public DefaultModelSuite<CacheRoutingE2e> {};

// A conversation's first turn: distinct per conversation from its first block on.
std::string opening(int conversation) {
  std::string text = "Conversation " + std::to_string(conversation) + " begins:";
  for (int i = 0; i < 12; ++i) text += " item " + std::to_string(conversation * 100 + i) + " is on the list;";
  return text;
}

std::string nextTurn(const std::string& prompt, const Answer& answer, int turn) {
  return prompt + answer.text + " Then question " + std::to_string(turn) + " follows, and the answer is";
}

struct RunResult {
  int later_turns = 0;
  int hits = 0;  // later turns with cached_tokens > 0
};

// 3 conversations x 3 turns, interleaved (turn t of every conversation, then turn t + 1). Each
// request waits until the previous one's blocks are cached (and indexed, with `indexed`).
RunResult converse(Cluster& c, bool indexed) {
  constexpr int kConversations = 3;
  constexpr int kTurns = 3;
  std::vector<std::string> prompts;
  for (int i = 0; i < kConversations; ++i) prompts.push_back(opening(i));
  RunResult r;
  double cached = 0;
  for (int t = 0; t < kTurns; ++t) {
    for (int i = 0; i < kConversations; ++i) {
      const Answer a = c.complete(prompts[static_cast<std::size_t>(i)]);
      EXPECT_EQ(a.status, 200);
      cached = c.settle(cached, indexed);
      if (t > 0) {
        ++r.later_turns;
        if (a.cached_tokens > 0) ++r.hits;
      }
      prompts[static_cast<std::size_t>(i)] = nextTurn(prompts[static_cast<std::size_t>(i)], a, t + 1);
    }
  }
  return r;
}

TEST_F(CacheRoutingE2e, LaterTurnsGoWhereTheirPrefixIsCachedWhileRoundRobinMisses) {
  RunResult aware;
  {
    Cluster c(modelDir(), {"--router.prefill_policy=cache_aware"});
    ASSERT_TRUE(c.ok());
    aware = converse(c, true);
    EXPECT_GT(c.decisions("cache_hit"), 0);
  }
  EXPECT_EQ(aware.hits, aware.later_turns) << "cache_aware: a later turn found no cached prefix";
  RunResult rr;
  {
    Cluster c(modelDir(), {"--router.prefill_policy=round_robin"});
    ASSERT_TRUE(c.ok());
    rr = converse(c, false);
  }
  // Round robin over 2 workers with 3 conversations sends turn 2 of each to the other worker.
  EXPECT_LT(rr.hits, rr.later_turns) << "round_robin never missed";
  std::printf("[cache-routing e2e] later turns with cached_tokens > 0: cache_aware %d/%d, round_robin %d/%d\n",
              aware.hits, aware.later_turns, rr.hits, rr.later_turns);
}

TEST_F(CacheRoutingE2e, ImbalanceFallsBackToTheLeastLoadedWorker) {
  // Any gap in load is an imbalance; a stopped worker stays in rotation (many failed polls allowed).
  Cluster c(modelDir(), {"--router.prefill_policy=cache_aware", "--router.cache_aware_balance_abs=0",
                         "--router.cache_aware_balance_rel=1", "--router.health_failures=1000"});
  ASSERT_TRUE(c.ok());
  const std::string prompt = opening(7);
  ASSERT_EQ(c.complete(prompt).status, 200);
  c.settle(0, true);
  const int holder = c.cachedBlocks(0) > 0 ? 0 : 1;
  ASSERT_GT(c.cachedBlocks(holder), 0);
  ASSERT_EQ(c.cachedBlocks(1 - holder), 0);
  // Stop the holder: the next turn goes to it (cache hit) and waits there.
  const double hits_before = c.decisions("cache_hit");
  ASSERT_TRUE(c.prefill(holder).signal(SIGSTOP));
  auto stuck = std::async(std::launch::async, [&] { return c.complete(prompt + " One more question:"); });
  ASSERT_TRUE(waitFor([&] { return c.decisions("cache_hit") > hits_before; }));
  // The holder has a request the router still waits for, the other none: imbalance.
  const Answer moved = c.complete(prompt + " A different question:");
  EXPECT_EQ(moved.status, 200);
  EXPECT_EQ(moved.cached_tokens, 0) << "it went to the worker without the prefix";
  EXPECT_GE(c.decisions("imbalance"), 1);
  ASSERT_TRUE(c.prefill(holder).signal(SIGCONT));
  const Answer late = stuck.get();
  EXPECT_EQ(late.status, 200);
  EXPECT_GT(late.cached_tokens, 0);
}

TEST_F(CacheRoutingE2e, AKilledWorkerIsNeverChosenAlthoughTheIndexSaysItHoldsThePrefix) {
  Cluster c(modelDir(), {"--router.prefill_policy=cache_aware", "--router.health_failures=1"});
  ASSERT_TRUE(c.ok());
  const std::string prompt = opening(9);
  ASSERT_EQ(c.complete(prompt).status, 200);
  c.settle(0, true);
  const int holder = c.cachedBlocks(0) > 0 ? 0 : 1;
  const double indexed = c.indexedBlocks(holder);
  ASSERT_GT(indexed, 0);
  const std::string holder_key = c.prefill(holder).hostPort();
  ASSERT_TRUE(c.prefill(holder).signal(SIGKILL));
  ASSERT_TRUE(c.prefill(holder).wait(10s).has_value());
  ASSERT_TRUE(waitFor([&] {
    return metricValue(getMetrics(c.router()),
                       "pdserve_router_worker_in_rotation{role=\"prefill\",worker=\"" + holder_key + "\"}") == 0;
  }));
  // Its events are lost with it: the index still says it holds the prefix.
  EXPECT_EQ(c.indexedBlocks(holder), indexed);
  // The first goes to the survivor, which computes the prefix (nothing cached); the next ones find
  // it there.
  for (int i = 0; i < 3; ++i) {
    const Answer a = c.complete(prompt + " Question " + std::to_string(i) + ":");
    EXPECT_EQ(a.status, 200);
    if (i == 0) {
      EXPECT_EQ(a.cached_tokens, 0);
      const int survivor = 1 - holder;
      EXPECT_TRUE(waitFor([&] {
        const double held = c.cachedBlocks(survivor);
        return held > 0 && c.indexedBlocks(survivor) == held;
      }));
    } else {
      EXPECT_GT(a.cached_tokens, 0);
    }
  }
  // Never tried on the dead worker: no prefill retried.
  EXPECT_EQ(metricValue(getMetrics(c.router()), "pdserve_router_retries_total{leg=\"prefill\"}"), 0);
}

}  // namespace
}  // namespace pd::test
