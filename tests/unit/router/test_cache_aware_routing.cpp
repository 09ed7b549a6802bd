// Cache-aware routing (docs/routing.md): the router's PrefixIndex fed by KV events, the
// cache_aware / power_of_two / decode affinity policies, and the registry following a prefill
// worker's events (a fake worker over real HTTP): restarts clear, garbled answers are refused.
#include <gtest/gtest.h>

#include <chrono>
#include <numeric>
#include <set>
#include <thread>

#include "fakes/fake_workers.h"
#include "pd/common/metrics.h"
#include "pd/common/prefix_hash.h"
#include "pd/router/prefix_index.h"
#include "pd/router/router_config.h"
#include "pd/router/worker_policy.h"
#include "pd/router/worker_registry.h"

namespace pd::router {
namespace {

using namespace std::chrono_literals;
using worker_api::KvEvent;
using worker_api::KvEvents;

constexpr std::int64_t kB = 4;
constexpr std::uint64_t kModel = 0xab;

std::vector<TokenId> tokens(TokenId first, std::int64_t n) {
  std::vector<TokenId> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

KvEvents snapshot(std::string instance, std::uint64_t seq, std::vector<std::uint64_t> blocks) {
  KvEvents e;
  e.instance_id = std::move(instance);
  e.model_hash = kModel;
  e.block_size = kB;
  e.seq = seq;
  e.snapshot = true;
  e.blocks = std::move(blocks);
  return e;
}

KvEvents events(std::string instance, std::vector<KvEvent> list) {
  KvEvents e;
  e.instance_id = std::move(instance);
  e.model_hash = kModel;
  e.block_size = kB;
  e.seq = list.empty() ? 0 : list.back().seq;
  e.events = std::move(list);
  return e;
}

std::vector<std::uint64_t> chainOf(const std::vector<TokenId>& prompt, std::int64_t blocks) {
  return prefixHashChain(kModel, prompt, kB, blocks);
}

WorkerView worker(const std::string& host, std::int64_t running = 0, std::int64_t free_blocks = 100) {
  WorkerView v;
  v.address = WorkerAddress{host, 1};
  v.status.running_requests = running;
  v.status.free_blocks = free_blocks;
  v.status.block_size = kB;
  return v;
}

TEST(PrefixIndexTest, LongestLeadingRunOfHeldBlocks) {
  PrefixIndex index(100);
  const auto prompt = tokens(0, 18);  // 4 full blocks + 2
  const auto keys = chainOf(prompt, 4);
  ASSERT_TRUE(index.apply("a:1", snapshot("ia", 5, {keys[0], keys[1], keys[3]})).ok());
  ASSERT_TRUE(index.apply("b:1", snapshot("ib", 1, {keys[0]})).ok());
  const std::vector<std::string> workers{"a:1", "b:1", "unknown:1"};
  // a holds blocks 0, 1 and 3: the run stops at the missing block 2.
  EXPECT_EQ(index.cachedTokens(workers, prompt), (std::vector<std::int64_t>{2 * kB, kB, 0}));
  // Another prompt sharing only block 0.
  auto other = prompt;
  other[5] = 999;
  EXPECT_EQ(index.cachedTokens(workers, other), (std::vector<std::int64_t>{kB, kB, 0}));
  // Events continue the index: block 2 stored, block 0 removed.
  ASSERT_TRUE(index.apply("a:1", events("ia", {{6, true, keys[2]}})).ok());
  EXPECT_EQ(index.cachedTokens(workers, prompt)[0], 4 * kB);
  ASSERT_TRUE(index.apply("a:1", events("ia", {{7, false, keys[0]}})).ok());
  EXPECT_EQ(index.cachedTokens(workers, prompt)[0], 0);
  EXPECT_EQ(index.cursor("a:1").after, 7u);
  EXPECT_EQ(index.cursor("a:1").instance, "ia");
  EXPECT_EQ(index.blocks("a:1"), 3);
}

TEST(PrefixIndexTest, RefusesEventsThatDoNotContinueTheIndexAndForgetsTheWorker) {
  metrics::Registry metrics;
  PrefixIndex index(3, &metrics);
  const auto keys = chainOf(tokens(0, 16), 4);
  ASSERT_TRUE(index.apply("a:1", snapshot("ia", 5, {keys[0]})).ok());
  // A gap (event 6 lost): refused, and the worker forgotten so its next read asks for a snapshot.
  auto gap = index.apply("a:1", events("ia", {{7, true, keys[1]}}));
  ASSERT_FALSE(gap.ok());
  EXPECT_EQ(gap.error().code, ErrorCode::Corrupt);
  EXPECT_EQ(index.cursor("a:1").instance, "");
  EXPECT_EQ(index.blocks("a:1"), 0);
  // Events of an instance the index does not follow (a restarted worker's) are refused too.
  ASSERT_TRUE(index.apply("a:1", snapshot("ia", 5, {keys[0]})).ok());
  EXPECT_FALSE(index.apply("a:1", events("other", {{6, true, keys[1]}})).ok());
  // A restart's snapshot replaces everything the old instance held.
  ASSERT_TRUE(index.apply("a:1", snapshot("ia", 5, {keys[0]})).ok());
  ASSERT_TRUE(index.apply("a:1", snapshot("ib", 0, {})).ok());
  EXPECT_EQ(index.blocks("a:1"), 0);
  // Another chain root or block size mid-stream, an instance id unfit for a query string.
  ASSERT_TRUE(index.apply("a:1", snapshot("ia", 5, {keys[0]})).ok());
  auto rooted = events("ia", {{6, true, keys[1]}});
  rooted.model_hash = kModel + 1;
  EXPECT_FALSE(index.apply("a:1", rooted).ok());
  EXPECT_FALSE(index.apply("a:1", snapshot("a&after=0", 1, {})).ok());
  // Bounded memory: more than 3 blocks, by snapshot or by events.
  EXPECT_FALSE(index.apply("a:1", snapshot("ia", 1, {1, 2, 3, 4})).ok());
  ASSERT_TRUE(index.apply("a:1", snapshot("ia", 1, {1, 2, 3})).ok());
  EXPECT_FALSE(index.apply("a:1", events("ia", {{2, true, 9}})).ok());
  EXPECT_EQ(index.blocks("a:1"), 0);
  const std::string text = metrics.render();
  EXPECT_NE(text.find("pdserve_router_kv_events_total{outcome=\"refused\"} 6"), std::string::npos) << text;
  EXPECT_NE(text.find("pdserve_router_kv_index_blocks{worker=\"a:1\"} 0"), std::string::npos) << text;
}

// Equal candidates are taken in turn, not always the first: under light sequential load every
// pick sees the same polled status, and "first on ties" once left a restarted worker idle for 200
// requests (E2eHeal under load).
TEST(CacheAwarePolicyTest, TiesAreTakenInTurn) {
  PrefixIndex index(100);
  auto cache_aware = makeCacheAwarePolicy(index, {.balance_abs = 4, .balance_rel = 1.5});
  auto least_queued = makePrefillPolicy("least_queued_tokens").value();
  const auto prompt = tokens(0, 16);
  std::vector<WorkerView> c{worker("a"), worker("b"), worker("c", 1)};
  for (WorkerPolicy* policy : {cache_aware.get(), least_queued.get()}) {
    std::vector<std::size_t> picks;
    for (int i = 0; i < 4; ++i) picks.push_back(policy->choose(c, {prompt}).index);
    EXPECT_EQ(picks, (std::vector<std::size_t>{0, 1, 0, 1})) << "c is busier: never picked";
  }
}

TEST(CacheAwarePolicyTest, PicksTheLongestCachedPrefixThenTheLeastLoaded) {
  PrefixIndex index(100);
  auto policy = makeCacheAwarePolicy(index, {.balance_abs = 4, .balance_rel = 1.5});
  const auto prompt = tokens(0, 16);
  const auto keys = chainOf(prompt, 4);
  std::vector<WorkerView> c{worker("a"), worker("b", 1), worker("c", 2)};
  // Nothing cached anywhere: the least loaded.
  auto choice = policy->choose(c, {prompt});
  EXPECT_EQ(choice.index, 0u);
  EXPECT_EQ(choice.reason, "least_load");
  // c holds 3 blocks, b 1: c although it is the most loaded (within the balance thresholds).
  ASSERT_TRUE(index.apply("b:1", snapshot("ib", 1, {keys[0]})).ok());
  ASSERT_TRUE(index.apply("c:1", snapshot("ic", 1, {keys[0], keys[1], keys[2]})).ok());
  choice = policy->choose(c, {prompt});
  EXPECT_EQ(choice.index, 2u);
  EXPECT_EQ(choice.reason, "cache_hit");
  // Equal prefixes: the less loaded of them.
  ASSERT_TRUE(index.apply("b:1", snapshot("ib", 2, {keys[0], keys[1], keys[2]})).ok());
  EXPECT_EQ(policy->choose(c, {prompt}).index, 1u);
  // Imbalance: b runs 8 more than a (gap > 4 and ratio > 1.5): the least loaded, cache or not.
  c[1].status.running_requests = 8;
  c[2].status.running_requests = 6;
  c[2].in_flight = 7;  // the router's own requests awaiting an answer count when more than the poll
  choice = policy->choose(c, {prompt});
  EXPECT_EQ(choice.index, 0u);
  EXPECT_EQ(choice.reason, "imbalance");
  // A gap within the absolute threshold is not imbalance.
  c[0].status.running_requests = 4;
  choice = policy->choose(c, {prompt});
  EXPECT_EQ(choice.reason, "cache_hit");
  EXPECT_EQ(choice.index, 2u);
}

TEST(CacheAwarePolicyTest, WorkWaitingBehindASmallReuseOutweighsIt) {
  // a holds 8 of the prompt's 40 tokens. With 20 tokens of the router's own requests still
  // waiting there, b (nothing cached, nothing waiting) gets the prompt to its first token sooner.
  PrefixIndex index(100);
  auto policy = makeCacheAwarePolicy(index, {});
  const auto prompt = tokens(0, 40);
  ASSERT_TRUE(index.apply("a:1", snapshot("ia", 1, chainOf(prompt, 2))).ok());
  std::vector<WorkerView> c{worker("a"), worker("b")};
  c[0].in_flight = 1;
  c[0].in_flight_tokens = 20;
  auto choice = policy->choose(c, {prompt});
  EXPECT_EQ(choice.index, 1u);
  EXPECT_EQ(choice.reason, "least_load");
  // 4 tokens waiting: the reuse (8) is worth more than the wait.
  c[0].in_flight_tokens = 4;
  choice = policy->choose(c, {prompt});
  EXPECT_EQ(choice.index, 0u);
  EXPECT_EQ(choice.reason, "cache_hit");
  EXPECT_EQ(choice.work_tokens, 32);  // what a computes: the 32 uncached tokens
  // Polled queued tokens count the same way.
  c[0].in_flight_tokens = 0;
  c[0].status.queued_tokens = 30;
  EXPECT_EQ(policy->choose(c, {prompt}).index, 1u);
}

TEST(CacheAwarePolicyTest, AWorkerOutOfRotationIsNeverChosenWhateverTheIndexSays) {
  // The index still believes "dead" holds the whole prompt (its events stopped): the policy only
  // ranks the candidates the registry offers, so the prompt goes to one of them.
  PrefixIndex index(100);
  auto policy = makeCacheAwarePolicy(index, {});
  const auto prompt = tokens(0, 16);
  ASSERT_TRUE(index.apply("dead:1", snapshot("id", 4, chainOf(prompt, 4))).ok());
  std::vector<WorkerView> c{worker("b", 3), worker("c", 1)};
  for (int i = 0; i < 10; ++i) {
    const auto choice = policy->choose(c, {prompt});
    EXPECT_EQ(choice.index, 1u);
    EXPECT_EQ(choice.reason, "least_load");
  }
}

TEST(PowerOfTwoPolicyTest, TakesTheLessLoadedOfTwoDistinctDraws) {
  auto policy = makePowerOfTwoPolicy(42);
  std::vector<WorkerView> c{worker("a", 5), worker("b", 0), worker("c", 9), worker("d", 7)};
  std::set<std::size_t> seen;
  for (int i = 0; i < 200; ++i) {
    const auto choice = policy->choose(c, {});
    ASSERT_LT(choice.index, c.size());
    EXPECT_EQ(choice.reason, "power_of_two");
    EXPECT_NE(choice.index, 2u);  // the most loaded loses every pair it is drawn in
    seen.insert(choice.index);
  }
  EXPECT_EQ(seen, (std::set<std::size_t>{0, 1, 3}));
  // Two candidates: always the less loaded one.
  std::vector<WorkerView> two{worker("a", 3), worker("b", 1)};
  for (int i = 0; i < 20; ++i) EXPECT_EQ(policy->choose(two, {}).index, 1u);
  std::vector<WorkerView> one{worker("a", 3)};
  EXPECT_EQ(policy->choose(one, {}).index, 0u);
  EXPECT_TRUE(makePrefillPolicy("power_of_two").ok());
  EXPECT_FALSE(makePrefillPolicy("cache_aware").ok());  // without the index
  EXPECT_TRUE(isPrefillPolicy("auto"));
  EXPECT_FALSE(isPrefillPolicy("random"));
}

TEST(DecodeAffinityPolicyTest, TheConversationsWorkerWhileItHasRoom) {
  auto policy = makeDecodeAffinityPolicy(2);
  std::vector<WorkerView> c{worker("a", 0, 100), worker("b", 0, 50)};
  const auto turn1 = tokens(0, 10);
  auto choice = policy->choose(c, {turn1});
  EXPECT_EQ(choice.index, 0u);  // most free blocks
  EXPECT_EQ(choice.reason, "most_free_blocks");
  // Turn 2 extends turn 1; a now has fewer free blocks than b, but it has room: a.
  auto turn2 = turn1;
  for (TokenId t = 100; t < 110; ++t) turn2.push_back(t);
  c[0].status.free_blocks = 20;
  choice = policy->choose(c, {turn2});
  EXPECT_EQ(choice.index, 0u);
  EXPECT_EQ(choice.reason, "affinity");
  // No room on a (the prompt's 5 blocks and one to grow): most free blocks instead.
  c[0].status.free_blocks = 5;
  auto turn3 = turn2;
  turn3.push_back(7);
  choice = policy->choose(c, {turn3});
  EXPECT_EQ(choice.index, 1u);
  EXPECT_EQ(choice.reason, "most_free_blocks");
  // The conversation followed to b: its next turn prefers b.
  c[0].status.free_blocks = 100;
  auto turn4 = turn3;
  for (TokenId t = 200; t < 204; ++t) turn4.push_back(t);
  choice = policy->choose(c, {turn4});
  EXPECT_EQ(choice.index, 1u);
  EXPECT_EQ(choice.reason, "affinity");
  // The worker left rotation: no affinity to a candidate that is not there.
  std::vector<WorkerView> only_a{worker("a", 0, 100)};
  auto turn5 = turn4;
  for (TokenId t = 300; t < 304; ++t) turn5.push_back(t);
  choice = policy->choose(only_a, {turn5});
  EXPECT_EQ(choice.index, 0u);
  EXPECT_EQ(choice.reason, "most_free_blocks");
  // Bounded: two other conversations push the oldest ones out.
  (void)policy->choose(c, {tokens(1000, 8)});
  (void)policy->choose(c, {tokens(2000, 8)});
  auto turn6 = turn5;
  turn6.push_back(1);
  std::vector<WorkerView> rich_b{worker("a", 0, 10), worker("b", 0, 100)};
  EXPECT_EQ(policy->choose(rich_b, {turn6}).reason, "most_free_blocks");
}

// The registry reads a fake prefill worker's KV events into its index.
class KvEventFollowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefill_ = std::make_unique<fakes::FakePrefillWorker>(std::vector<fakes::FakeDecodeWorker*>{});
    RegistryOptions o;
    o.health_interval = 10ms;
    o.health_timeout = 500ms;
    o.prefill_workers = {parseWorkerAddress(prefill_->address(), "test").value()};
    o.kv_events = true;
    o.kv_events_interval = 5ms;
    o.metrics = &metrics_;
    options_ = o;
  }

  void start() { registry_ = WorkerRegistry::start(options_).value(); }

  template <class Pred>
  static bool waitFor(Pred pred, std::chrono::milliseconds timeout = 5000ms) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      if (pred()) return true;
      std::this_thread::sleep_for(5ms);
    }
    return pred();
  }

  metrics::Registry metrics_;
  RegistryOptions options_;
  // The fake worker's kv-events state. Declared before prefill_ and registry_, so it outlives
  // them: the registry polls the handler until it is destroyed, after the test body returned.
  std::mutex mu_;
  std::string instance_ = "first";
  std::vector<KvEvent> log_;
  std::atomic<int> mode_{0};
  std::unique_ptr<fakes::FakePrefillWorker> prefill_;
  std::unique_ptr<WorkerRegistry> registry_;
};

TEST_F(KvEventFollowTest, SnapshotThenEventsThenARestartClearsTheIndex) {
  // The worker's state (mu_, instance_, log_): an instance id and a list of events; it answers as
  // the real log does.
  prefill_->setKvEvents([&](const http::Request& r) {
    std::lock_guard lock(mu_);
    const bool same = r.query.find("instance=" + instance_) != std::string::npos;
    KvEvents e;
    e.instance_id = instance_;
    e.model_hash = kModel;
    e.block_size = kB;
    e.seq = log_.empty() ? 0 : log_.back().seq;
    if (!same) {
      e.snapshot = true;
      for (const auto& ev : log_) {
        if (ev.stored) e.blocks.push_back(ev.block);
      }
      return worker_api::toJson(e);
    }
    const auto at = r.query.find("after=");
    const std::uint64_t after = std::stoull(r.query.substr(at + 6));
    for (const auto& ev : log_) {
      if (ev.seq > after) e.events.push_back(ev);
    }
    if (e.events.empty()) e.seq = after;
    return worker_api::toJson(e);
  });
  start();
  const PrefixIndex* index = registry_->prefixIndex();
  ASSERT_NE(index, nullptr);
  const std::string key = prefill_->address();
  ASSERT_TRUE(waitFor([&] { return index->cursor(key).instance == "first"; }));
  {
    std::lock_guard lock(mu_);
    log_ = {{1, true, 11}, {2, true, 22}, {3, true, 33}};
  }
  ASSERT_TRUE(waitFor([&] { return index->blocks(key) == 3; }));
  {
    std::lock_guard lock(mu_);
    log_.push_back({4, false, 22});
  }
  ASSERT_TRUE(waitFor([&] { return index->blocks(key) == 2 && index->cursor(key).after == 4; }));
  // Restart: a new instance holding nothing. The index follows it and holds nothing.
  {
    std::lock_guard lock(mu_);
    instance_ = "second";
    log_.clear();
  }
  ASSERT_TRUE(waitFor([&] { return index->cursor(key).instance == "second"; }));
  EXPECT_EQ(index->blocks(key), 0);
}

TEST_F(KvEventFollowTest, GarbledOrForeignAnswersAreRefused) {
  prefill_->setKvEvents([&](const http::Request&) -> std::string {
    KvEvents e;
    e.instance_id = "w";
    e.model_hash = kModel;
    e.block_size = kB;
    e.snapshot = true;
    e.blocks = {1, 2};
    if (mode_.load() == 0) return worker_api::toJson(e);
    if (mode_.load() == 1) return "{\"instance_id\":\"w\",\"seq\":";  // cut
    e.model_hash = kModel + 1;                                        // another model than the worker's status says
    return worker_api::toJson(e);
  });
  start();
  const PrefixIndex* index = registry_->prefixIndex();
  const std::string key = prefill_->address();
  ASSERT_TRUE(waitFor([&] { return index->blocks(key) == 2; }));
  mode_ = 1;
  ASSERT_TRUE(waitFor([&] { return index->blocks(key) == 0; }));
  mode_ = 0;
  ASSERT_TRUE(waitFor([&] { return index->blocks(key) == 2; }));
  mode_ = 2;
  ASSERT_TRUE(waitFor([&] { return index->blocks(key) == 0; }));
  const std::string text = metrics_.render();
  EXPECT_NE(text.find("pdserve_router_kv_index_blocks{worker=\"" + key + "\"} 0"), std::string::npos) << text;
}

TEST(RouterConfigPolicyTest, AutoIsCacheAwareWithMoreThanOnePrefillWorker) {
  RouterConfig cfg;
  cfg.prefill_workers = {"p:1"};
  EXPECT_EQ(resolvePrefillPolicy(cfg), "least_queued_tokens");
  cfg.prefill_workers = {"p:1", "p:2"};
  EXPECT_EQ(resolvePrefillPolicy(cfg), "cache_aware");
  EXPECT_TRUE(registryOptionsFromConfig(cfg).value().kv_events);
  cfg.prefill_policy = "round_robin";
  EXPECT_EQ(resolvePrefillPolicy(cfg), "round_robin");
  EXPECT_FALSE(registryOptionsFromConfig(cfg).value().kv_events);
}

}  // namespace
}  // namespace pd::router
