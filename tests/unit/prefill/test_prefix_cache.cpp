// The prefill prefix cache alone: its hash chain, reference counts, LRU eviction under pressure
// and capacity, sharing between requests, variants by next token, and that a hash is never
// trusted without its tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "pd/prefill/prefix_cache.h"

namespace pd::prefill {
namespace {

constexpr std::int64_t kB = 4;  // tokens per block

std::vector<std::int32_t> seq(std::int32_t first, std::int64_t n) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

std::vector<std::int32_t> blocksOf(const std::vector<PrefixCache::Hit>& hits) {
  std::vector<std::int32_t> out;
  for (const auto& h : hits) out.push_back(h.block);
  return out;
}

std::vector<std::uint64_t> keysOf(const std::vector<PrefixCache::Hit>& hits) {
  std::vector<std::uint64_t> out;
  for (const auto& h : hits) out.push_back(h.entry);
  return out;
}

TEST(PrefixCacheChain, KeysDependOnEveryEarlierBlockAndTheModel) {
  const auto a = seq(0, 12);
  auto b = a;
  b[1] = 99;  // differs in block 0 only
  const auto ka = PrefixCache::chain(7, a, kB, 10);
  const auto kb = PrefixCache::chain(7, b, kB, 10);
  ASSERT_EQ(ka.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_NE(ka[i], kb[i]) << "block " << i;
  const auto other_model = PrefixCache::chain(8, a, kB, 10);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_NE(ka[i], other_model[i]);
  // Same prefix, different tail: the shared blocks' keys agree.
  auto c = a;
  c[10] = 5;
  const auto kc = PrefixCache::chain(7, c, kB, 10);
  EXPECT_EQ(kc[0], ka[0]);
  EXPECT_EQ(kc[1], ka[1]);
  EXPECT_NE(kc[2], ka[2]);
  // Only full blocks, at most max_blocks.
  EXPECT_EQ(PrefixCache::chain(7, seq(0, 11), kB, 10).size(), 2u);
  EXPECT_EQ(PrefixCache::chain(7, a, kB, 1).size(), 1u);
}

TEST(PrefixCache, InsertThenAcquireTheLongestCachedPrefix) {
  PrefixCache cache(8, kB, 1);
  const auto prompt = seq(10, 10);  // 2 full blocks + 2 tokens
  EXPECT_TRUE(cache.acquire(prompt, 10).empty());
  // The partial third block is never taken.
  const auto back = cache.insert(prompt, 0, std::vector<std::int32_t>{5, 6, 7});
  EXPECT_EQ(back, (std::vector<std::int32_t>{7}));
  EXPECT_EQ(cache.stats().cached_blocks, 2);
  EXPECT_EQ(cache.stats().idle_blocks, 2);

  auto longer = seq(10, 9);  // the cached blocks and the token after them, then others
  longer.push_back(1);
  const auto hits = cache.acquire(longer, 10);
  EXPECT_EQ(blocksOf(hits), (std::vector<std::int32_t>{5, 6}));
  EXPECT_EQ(cache.stats().idle_blocks, 0);
  cache.release(keysOf(hits));
  EXPECT_EQ(cache.stats().idle_blocks, 2);
  // max_blocks bounds the match (the engine keeps the last token to compute).
  const auto one = cache.acquire(longer, 1);
  EXPECT_EQ(blocksOf(one), (std::vector<std::int32_t>{5}));
  cache.release(keysOf(one));
  // A prompt differing in the first block matches nothing, even if later blocks agree.
  auto diverged = seq(10, 8);
  diverged[0] = 0;
  EXPECT_TRUE(cache.acquire(diverged, 10).empty());
}

TEST(PrefixCache, ConcurrentRequestsShareBlocksAndEvictionSparesReferencedOnes) {
  PrefixCache cache(8, kB, 1);
  const auto prompt = seq(0, 9);
  EXPECT_TRUE(cache.insert(prompt, 0, std::vector<std::int32_t>{1, 2}).empty());
  const auto a = cache.acquire(prompt, 2);
  const auto b = cache.acquire(prompt, 2);
  EXPECT_EQ(blocksOf(a), blocksOf(b));
  EXPECT_TRUE(cache.evict(10).empty()) << "referenced blocks are never evicted";
  cache.release(keysOf(a));
  EXPECT_TRUE(cache.evict(10).empty()) << "still referenced by b";
  cache.release(keysOf(b));
  auto freed = cache.evict(10);
  std::ranges::sort(freed);
  EXPECT_EQ(freed, (std::vector<std::int32_t>{1, 2}));
  EXPECT_EQ(cache.stats().cached_blocks, 0);
  EXPECT_EQ(cache.stats().evictions, 2);
  EXPECT_TRUE(cache.acquire(prompt, 2).empty());
}

TEST(PrefixCache, EvictsLeastRecentlyUsedFirstLeavesBeforeRoots) {
  PrefixCache cache(16, kB, 1);
  const auto x = seq(100, 9);
  const auto y = seq(200, 9);
  EXPECT_TRUE(cache.insert(x, 0, std::vector<std::int32_t>{1, 2}).empty());
  EXPECT_TRUE(cache.insert(y, 0, std::vector<std::int32_t>{3, 4}).empty());
  // Touch x: y is now the least recently used, its leaf (block 4) before its root (block 3).
  cache.release(keysOf(cache.acquire(x, 2)));
  EXPECT_EQ(cache.evict(1), (std::vector<std::int32_t>{4}));
  EXPECT_EQ(cache.evict(1), (std::vector<std::int32_t>{3}));
  EXPECT_EQ(cache.evict(1), (std::vector<std::int32_t>{2}));
  EXPECT_EQ(blocksOf(cache.acquire(x, 2)), (std::vector<std::int32_t>{1}));
}

TEST(PrefixCache, CapacityDisplacesIdleBlocksAndRefusesWhenAllAreReferenced) {
  PrefixCache cache(2, kB, 1);
  const auto x = seq(100, 9);
  const auto y = seq(200, 9);
  EXPECT_TRUE(cache.insert(x, 0, std::vector<std::int32_t>{1, 2}).empty());
  // y displaces x's two idle blocks (returned to the caller to free).
  auto back = cache.insert(y, 0, std::vector<std::int32_t>{3, 4});
  std::ranges::sort(back);
  EXPECT_EQ(back, (std::vector<std::int32_t>{1, 2}));
  EXPECT_EQ(cache.stats().cached_blocks, 2);
  EXPECT_EQ(cache.stats().evictions, 2);
  EXPECT_TRUE(cache.acquire(x, 2).empty());
  // With y referenced, nothing can be displaced: x's blocks come back untaken.
  const auto held = cache.acquire(y, 2);
  EXPECT_EQ(cache.insert(x, 0, std::vector<std::int32_t>{5, 6}), (std::vector<std::int32_t>{5, 6}));
  cache.release(keysOf(held));
  EXPECT_EQ(cache.stats().cached_blocks, 2);
}

TEST(PrefixCache, AlreadyCachedBlocksComeBackAndASuffixExtendsTheChain) {
  PrefixCache cache(8, kB, 1);
  const auto first = seq(0, 9);
  EXPECT_TRUE(cache.insert(first, 0, std::vector<std::int32_t>{1, 2}).empty());
  // Another request computed the same blocks concurrently: its copies are not taken.
  EXPECT_EQ(cache.insert(first, 0, std::vector<std::int32_t>{7, 8}), (std::vector<std::int32_t>{7, 8}));
  // A second turn reused blocks 0-1 and computed block 2: only block 2 is offered, from index 2.
  auto second = seq(0, 13);
  const auto hits = cache.acquire(second, 2);
  ASSERT_EQ(hits.size(), 2u);
  EXPECT_TRUE(cache.insert(second, 2, std::vector<std::int32_t>{3}).empty());
  cache.release(keysOf(hits));
  EXPECT_EQ(blocksOf(cache.acquire(second, 3)), (std::vector<std::int32_t>{1, 2, 3}));
  // A block whose parent is not cached is unreachable and therefore not taken.
  const auto orphan = seq(500, 9);
  EXPECT_EQ(cache.insert(orphan, 1, std::vector<std::int32_t>{9}), (std::vector<std::int32_t>{9}));
}

TEST(PrefixCache, ABlockMatchesOnlyThePromptsThatFollowItWithItsNextToken) {
  // The MTP latent at a block's last position depends on the token after the block, so each
  // next token is its own variant of the block.
  PrefixCache cache(8, kB, 1);
  auto x = seq(0, 8);
  x.push_back(100);  // block 0 followed by 4, block 1 by 100
  auto y = seq(0, 8);
  y.push_back(200);
  EXPECT_TRUE(cache.insert(x, 0, std::vector<std::int32_t>{1, 2}).empty());
  // y's block 0 is x's (same next token 4): not taken; its block 1 is a new variant.
  EXPECT_EQ(cache.insert(y, 0, std::vector<std::int32_t>{3, 4}), (std::vector<std::int32_t>{3}));
  EXPECT_EQ(cache.stats().cached_blocks, 3);
  const auto hx = cache.acquire(x, 2);
  EXPECT_EQ(blocksOf(hx), (std::vector<std::int32_t>{1, 2}));
  const auto hy = cache.acquire(y, 2);
  EXPECT_EQ(blocksOf(hy), (std::vector<std::int32_t>{1, 4}));
  auto z = seq(0, 8);
  z.push_back(300);  // no variant of block 1 is followed by 300
  const auto hz = cache.acquire(z, 2);
  EXPECT_EQ(blocksOf(hz), (std::vector<std::int32_t>{1}));
  // A prompt that ends with a block has no token after it: that block cannot match.
  const auto hend = cache.acquire(seq(0, 8), 2);
  EXPECT_EQ(blocksOf(hend), (std::vector<std::int32_t>{1}));
  for (const auto* h : {&hx, &hy, &hz, &hend}) cache.release(keysOf(*h));
  // Other tokens in block 1 are another chain under the shared block 0, not a variant.
  auto w = seq(0, 4);
  for (std::int32_t t : {4, 5, 6, 99, 100}) w.push_back(t);  // block 1 differs from x's
  EXPECT_TRUE(cache.insert(w, 1, std::vector<std::int32_t>{5}).empty());
  EXPECT_EQ(blocksOf(cache.acquire(w, 2)), (std::vector<std::int32_t>{1, 5}));
  EXPECT_EQ(blocksOf(cache.acquire(x, 2)), (std::vector<std::int32_t>{1, 2}));
}

}  // namespace
}  // namespace pd::prefill
