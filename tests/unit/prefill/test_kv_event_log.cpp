// The prefill worker's KV event log (kv_event_log.h): numbered events from the prefix cache,
// bounded memory, and a snapshot for readers that are behind, follow another instance or are lost.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "pd/common/prefix_hash.h"
#include "pd/prefill/kv_event_log.h"
#include "pd/prefill/prefix_cache.h"

namespace pd::prefill {
namespace {

constexpr std::int64_t kB = 4;

std::vector<std::int32_t> seq(std::int32_t first, std::int64_t n) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

TEST(KvEventLog, NumbersEventsAndSnapshotsNewReaders) {
  KvEventLog log("inst", 9, kB, 8);
  EXPECT_EQ(log.lastSeq(), 0u);
  const auto first = log.read("", 0);
  EXPECT_TRUE(first.snapshot);  // a reader that knows no instance
  EXPECT_EQ(first.seq, 0u);
  EXPECT_TRUE(first.blocks.empty());
  EXPECT_EQ(first.model_hash, 9u);
  EXPECT_EQ(first.block_size, kB);
  log.stored(100);
  log.stored(200);
  log.stored(100);   // already held: no event
  log.removed(300);  // not held: no event
  log.removed(100);
  const auto events = log.read("inst", 0);
  ASSERT_FALSE(events.snapshot);
  ASSERT_EQ(events.events.size(), 3u);
  EXPECT_EQ(events.events[0], (worker_api::KvEvent{1, true, 100}));
  EXPECT_EQ(events.events[1], (worker_api::KvEvent{2, true, 200}));
  EXPECT_EQ(events.events[2], (worker_api::KvEvent{3, false, 100}));
  EXPECT_EQ(events.seq, 3u);
  EXPECT_FALSE(events.more);
  const auto none = log.read("inst", 3);
  EXPECT_FALSE(none.snapshot);
  EXPECT_TRUE(none.events.empty());
  EXPECT_EQ(none.seq, 3u);
  // Paging: at most max_events, `more` while others follow.
  const auto page = log.read("inst", 1, 1);
  ASSERT_EQ(page.events.size(), 1u);
  EXPECT_EQ(page.seq, 2u);
  EXPECT_TRUE(page.more);
}

TEST(KvEventLog, SnapshotForAnotherInstanceAFutureSeqOrEventsNoLongerKept) {
  KvEventLog log("new", 1, kB, 4);
  for (std::uint64_t b = 1; b <= 6; ++b) log.stored(b);  // events 1..6, only 3..6 kept
  const auto expect_snapshot = [&](std::string_view instance, std::uint64_t after) {
    const auto r = log.read(instance, after);
    EXPECT_TRUE(r.snapshot) << instance << " " << after;
    EXPECT_TRUE(r.events.empty());
    EXPECT_EQ(r.seq, 6u);
    EXPECT_EQ(r.blocks, (std::vector<std::uint64_t>{1, 2, 3, 4, 5, 6}));
  };
  expect_snapshot("old", 6);  // the worker restarted: whatever the reader had is gone
  expect_snapshot("new", 7);  // a number never issued
  expect_snapshot("new", 1);  // event 2 was dropped
  const auto kept = log.read("new", 2);
  ASSERT_FALSE(kept.snapshot);
  EXPECT_EQ(kept.events.front().seq, 3u);
  EXPECT_EQ(kept.events.size(), 4u);
}

TEST(KvEventLog, PrefixCacheReportsStoredEvictedAndDisplacedBlocks) {
  KvEventLog log("inst", 5, kB, 64);
  PrefixCache cache(2, kB, 5, &log);
  const auto a = seq(0, 9);  // 2 full blocks and the token after them
  const auto keys_a = prefixHashChain(5, a, kB, 10);
  ASSERT_EQ(keys_a, PrefixCache::chain(5, a, kB, 10));  // one hash chain, shared with the router
  EXPECT_TRUE(cache.insert(a, 0, std::vector<std::int32_t>{10, 11}).empty());
  auto r = log.read("inst", 0);
  ASSERT_EQ(r.events.size(), 2u);
  EXPECT_TRUE(r.events[0].stored);
  EXPECT_EQ(r.events[0].block, keys_a[0]);
  EXPECT_EQ(r.events[1].block, keys_a[1]);
  // A full cache displaces an idle block of another chain: reported removed, the new one stored.
  const auto b = seq(50, 5);
  const auto keys_b = prefixHashChain(5, b, kB, 10);
  const auto back = cache.insert(b, 0, std::vector<std::int32_t>{12});
  EXPECT_EQ(back.size(), 1u);
  r = log.read("inst", 2);
  ASSERT_EQ(r.events.size(), 2u);
  EXPECT_FALSE(r.events[0].stored);
  EXPECT_TRUE(r.events[1].stored);
  EXPECT_EQ(r.events[1].block, keys_b[0]);
  // Eviction under pressure.
  const auto freed = cache.evict(5);
  EXPECT_EQ(freed.size(), 2u);
  EXPECT_EQ(log.heldBlocks(), 0u);
  r = log.read("inst", 4);
  ASSERT_EQ(r.events.size(), 2u);
  EXPECT_FALSE(r.events[0].stored);
  EXPECT_FALSE(r.events[1].stored);
  // A reader that applies every event holds what the cache holds: nothing.
  EXPECT_TRUE(log.read("", 0).blocks.empty());
}

TEST(KvEventLog, AKeyCachedWithTwoNextTokensIsOneStoredBlockUntilBothLeave) {
  KvEventLog log("inst", 5, kB, 64);
  PrefixCache cache(4, kB, 5, &log);
  auto a = seq(0, 4);
  a.push_back(100);
  auto b = seq(0, 4);
  b.push_back(200);
  const auto key = prefixHashChain(5, a, kB, 1).at(0);
  EXPECT_TRUE(cache.insert(a, 0, std::vector<std::int32_t>{1}).empty());
  EXPECT_TRUE(cache.insert(b, 0, std::vector<std::int32_t>{2}).empty());  // the same key, another variant
  EXPECT_EQ(cache.stats().cached_blocks, 2);
  auto r = log.read("inst", 0);
  ASSERT_EQ(r.events.size(), 1u);
  EXPECT_TRUE(r.events[0].stored);
  EXPECT_EQ(r.events[0].block, key);
  EXPECT_EQ(cache.evict(1).size(), 1u);
  EXPECT_EQ(log.heldBlocks(), 1u) << "one variant is still cached";
  EXPECT_EQ(cache.evict(1).size(), 1u);
  r = log.read("inst", 1);
  ASSERT_EQ(r.events.size(), 1u);
  EXPECT_FALSE(r.events[0].stored);
  EXPECT_EQ(log.heldBlocks(), 0u);
}

TEST(KvEventLog, InstanceIdsDiffer) {
  const std::string a = randomInstanceId();
  const std::string b = randomInstanceId();
  EXPECT_EQ(a.size(), 16u);
  EXPECT_NE(a, b);
  EXPECT_TRUE(parseHash64Hex(a).has_value());
}

}  // namespace
}  // namespace pd::prefill
