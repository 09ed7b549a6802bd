// The decode worker's prefix cache (KvBlockManager with prefix_cache_blocks > 0; docs/kv-memory.md
// "Prefix reuse on the decode side"): the hash chain and its token checks, reference counts of
// blocks shared between the cache and requests, LRU eviction (leaves first) under pool pressure
// and capacity, never evicting a block a request holds, and the late-write quarantine.
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "pd/decode/kv_block_manager.h"

namespace pd::decode {
namespace {

constexpr std::uint64_t kModel = 0x5eed;

// `n` tokens counting up from `first`.
std::vector<std::int32_t> tokens(std::int32_t first, std::int64_t n) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

std::vector<std::int32_t> table(const KvBlockManager& m, std::uint64_t id) {
  const auto t = m.blockTable(id);
  return {t.begin(), t.end()};
}

// Admits `id` on `prompt`, caches its first `blocks` blocks and releases it (a finished request).
void finishAndCache(KvBlockManager& m, std::uint64_t id, const std::vector<std::int32_t>& prompt, std::int64_t blocks,
                    std::int64_t expect_added) {
  const std::vector<std::int32_t> shared = m.matchPrefix(prompt, (static_cast<std::int64_t>(prompt.size()) - 1) / 4);
  ASSERT_TRUE(m.admit(id, static_cast<std::int64_t>(prompt.size()), 0, shared).ok());
  EXPECT_EQ(m.cachePrefix(id, prompt, blocks), expect_added);
  ASSERT_TRUE(m.release(id));
}

TEST(DecodePrefixCache, TurnTwoFindsTurnOnesBlocksByTheHashChainAndTheirTokens) {
  KvBlockManager m(16, 4, 0, 8, kModel);
  const std::vector<std::int32_t> turn1 = tokens(100, 18);  // 4 full blocks + 2 tokens
  ASSERT_TRUE(m.admit(1, 18).ok());
  const std::vector<std::int32_t> t1 = table(m, 1);
  EXPECT_EQ(m.cachePrefix(1, turn1, 4), 4);
  EXPECT_EQ(m.cachedBlocks(), 4);
  EXPECT_EQ(m.idleCachedBlocks(), 0);  // request 1 still holds them
  EXPECT_EQ(m.refCount(t1[0]), 2);
  ASSERT_TRUE(m.release(1));
  EXPECT_EQ(m.idleCachedBlocks(), 4);
  EXPECT_EQ(m.freeBlocks(), 16);  // idle cached blocks count as free
  EXPECT_FALSE(m.isFullyFree());
  EXPECT_TRUE(m.isFreeButPrefixCache());

  // Turn 2: turn 1's prompt plus more tokens; every cached block matches, in position order.
  std::vector<std::int32_t> turn2 = turn1;
  for (std::int32_t t = 500; t < 510; ++t) turn2.push_back(t);
  EXPECT_EQ(m.matchPrefix(turn2, 100), std::vector<std::int32_t>(t1.begin(), t1.begin() + 4));
  EXPECT_EQ(m.matchPrefix(turn2, 2), std::vector<std::int32_t>(t1.begin(), t1.begin() + 2));
  // A changed token in block 2 ends the match after block 1.
  std::vector<std::int32_t> changed = turn2;
  changed[9] = 7;
  EXPECT_EQ(m.matchPrefix(changed, 100), std::vector<std::int32_t>(t1.begin(), t1.begin() + 2));
  // The token after a block must be the cached one (the block's last MTP row pairs with it).
  changed = turn2;
  changed[8] = 7;  // first token of block 2
  EXPECT_EQ(m.matchPrefix(changed, 100), std::vector<std::int32_t>(t1.begin(), t1.begin() + 1));
  // A prompt that ends exactly after block 1 has no next token to compare: it matches.
  EXPECT_EQ(m.matchPrefix(std::span(turn2).first(8), 100), std::vector<std::int32_t>(t1.begin(), t1.begin() + 2));
  EXPECT_TRUE(m.matchPrefix(tokens(0, 18), 100).empty());
  EXPECT_EQ(m.clearPrefixCache(), 4);
  EXPECT_TRUE(m.isFullyFree());
}

TEST(DecodePrefixCache, SharedBlocksAreCountedOncePerHolderAndReturnToTheCache) {
  KvBlockManager m(12, 4, 1, 8, kModel);
  const std::vector<std::int32_t> prompt = tokens(1, 13);
  finishAndCache(m, 1, prompt, 3, 3);
  const std::vector<std::int32_t> shared = m.matchPrefix(prompt, 3);
  ASSERT_EQ(shared.size(), 3U);
  // Two requests share the three cached blocks; each gets its own last block.
  ASSERT_TRUE(m.admit(2, 13, 0, shared).ok());
  ASSERT_TRUE(m.admit(3, 13, 1, shared).ok());
  for (const std::int32_t b : shared) EXPECT_EQ(m.refCount(b), 3);
  const std::vector<std::int32_t> t2 = table(m, 2);
  EXPECT_NE(t2[3], table(m, 3)[3]);
  EXPECT_EQ(std::vector<std::int32_t>(t2.begin(), t2.begin() + 3), shared);
  EXPECT_EQ(m.idleCachedBlocks(), 0);
  // 12 blocks: 3 shared, 2 own last blocks, 1 spare; none idle.
  EXPECT_EQ(m.freeBlocks(), 6);
  EXPECT_EQ(m.availableBlocks(), 5);
  // A fork shares the cached blocks too.
  ASSERT_TRUE(m.fork(3, 4).ok());
  for (const std::int32_t b : shared) EXPECT_EQ(m.refCount(b), 4);
  // Caching again what is cached adds nothing.
  EXPECT_EQ(m.cachePrefix(2, prompt, 3), 0);
  EXPECT_TRUE(m.release(2));
  EXPECT_TRUE(m.release(4));
  EXPECT_TRUE(m.release(3));
  for (const std::int32_t b : shared) EXPECT_EQ(m.refCount(b), 1);
  EXPECT_EQ(m.idleCachedBlocks(), 3);
  EXPECT_TRUE(m.isFreeButPrefixCache());
  // Shared blocks must be cached and fewer than the prompt's blocks.
  EXPECT_EQ(m.admit(5, 12, 0, shared).error().code, ErrorCode::InvalidArgument);
  const std::vector<std::int32_t> stray{shared[0], 11};
  EXPECT_EQ(m.admit(5, 13, 0, stray).error().code, ErrorCode::InvalidArgument);
  EXPECT_TRUE(m.isFreeButPrefixCache());
}

TEST(DecodePrefixCache, PressureEvictsIdleBlocksLeastRecentlyUsedLeavesFirstNeverHeldOnes) {
  KvBlockManager m(8, 4, 0, 8, kModel);
  const std::vector<std::int32_t> a = tokens(1, 13);    // chain A: 3 blocks
  const std::vector<std::int32_t> b = tokens(100, 13);  // chain B: 3 blocks
  finishAndCache(m, 1, a, 3, 3);
  finishAndCache(m, 2, b, 3, 3);
  EXPECT_EQ(m.cachedBlocks(), 6);
  // Chain A is used again (and released): B is now the least recently used.
  finishAndCache(m, 3, a, 3, 0);
  const std::vector<std::int32_t> a_blocks = m.matchPrefix(a, 3);
  const std::vector<std::int32_t> b_blocks = m.matchPrefix(b, 3);
  ASSERT_EQ(a_blocks.size(), 3U);
  ASSERT_EQ(b_blocks.size(), 3U);
  // A 3-block request: 2 free blocks, then B's leaf goes first.
  ASSERT_TRUE(m.admit(4, 12).ok());
  EXPECT_EQ(m.prefixEvictions(), 1);
  EXPECT_EQ(m.matchPrefix(b, 3).size(), 2U);  // B's root and middle block are still there
  EXPECT_EQ(m.matchPrefix(a, 3).size(), 3U);
  // Request 5 holds chain A (its own last block evicts B's middle one); pressure takes the rest
  // of B, then refuses rather than touch A.
  ASSERT_TRUE(m.admit(5, 13, 0, a_blocks).ok());
  EXPECT_EQ(m.prefixEvictions(), 2);
  EXPECT_EQ(m.freeBlocks(), 1);                                  // B's idle root
  EXPECT_EQ(m.grow(5, 24).error().code, ErrorCode::Overloaded);  // 2 more blocks needed, 1 can be had
  ASSERT_TRUE(m.grow(5, 20).ok());
  EXPECT_EQ(m.prefixEvictions(), 3);
  EXPECT_TRUE(m.matchPrefix(b, 3).empty());
  for (const std::int32_t blk : a_blocks) EXPECT_EQ(m.refCount(blk), 2);
  EXPECT_EQ(m.admit(6, 1).error().code, ErrorCode::Overloaded);
  EXPECT_TRUE(m.release(4));
  EXPECT_TRUE(m.release(5));
  EXPECT_TRUE(m.isFreeButPrefixCache());
  EXPECT_EQ(m.matchPrefix(a, 3), a_blocks);
}

TEST(DecodePrefixCache, CapacityDisplacesIdleBlocksAndLeavesOutWhatItCannotHold) {
  KvBlockManager m(16, 4, 0, 3, kModel);
  finishAndCache(m, 1, tokens(1, 17), 4, 3);  // capacity 3: the fourth block stays out
  EXPECT_EQ(m.cachedBlocks(), 3);
  EXPECT_EQ(m.freeBlocks(), 16);
  // A new chain displaces the idle ones (least recently used: the leaves first).
  finishAndCache(m, 2, tokens(200, 9), 2, 2);
  EXPECT_EQ(m.cachedBlocks(), 3);
  EXPECT_EQ(m.prefixEvictions(), 2);
  EXPECT_EQ(m.matchPrefix(tokens(1, 17), 4).size(), 1U);
  // While every cached block is held, nothing can be displaced: the offer is left out.
  const auto held1 = m.matchPrefix(tokens(1, 17), 4);
  const auto held2 = m.matchPrefix(tokens(200, 9), 2);
  ASSERT_TRUE(m.admit(3, 17, 0, held1).ok());
  ASSERT_TRUE(m.admit(4, 9, 0, held2).ok());
  ASSERT_TRUE(m.admit(5, 9).ok());
  EXPECT_EQ(m.cachePrefix(5, tokens(300, 9), 2), 0);
  EXPECT_EQ(m.prefixEvictions(), 2);
  for (std::uint64_t id : {3, 4, 5}) EXPECT_TRUE(m.release(id));
  EXPECT_TRUE(m.isFreeButPrefixCache());
}

TEST(DecodePrefixCache, QuarantinedRequestsKeepSharedBlocksCachedAndCacheNothing) {
  KvBlockManager m(8, 4, 0, 8, kModel);
  const std::vector<std::int32_t> prompt = tokens(1, 13);
  finishAndCache(m, 1, prompt, 3, 3);
  const auto shared = m.matchPrefix(prompt, 3);
  ASSERT_TRUE(m.admit(2, 13, 0, shared).ok());
  // Aborted while its KV was awaited (rma): its own block is held back, the shared ones stay
  // cached (the cache is a holder that is not quarantined) and are not counted as quarantined.
  EXPECT_EQ(m.quarantine(2), 4);
  EXPECT_EQ(m.quarantinedBlocks(), 1);
  EXPECT_EQ(m.cachePrefix(2, prompt, 3), 0);
  EXPECT_EQ(m.freeBlocks(), 4);
  // Pressure cannot take the shared blocks while the quarantined request holds them.
  EXPECT_EQ(m.admit(3, 20).error().code, ErrorCode::Overloaded);
  EXPECT_TRUE(m.release(2));
  EXPECT_EQ(m.quarantinedBlocks(), 0);
  EXPECT_TRUE(m.isFreeButPrefixCache());
  ASSERT_TRUE(m.admit(3, 32).ok());  // the whole pool: every cached block evicted
  EXPECT_EQ(m.cachedBlocks(), 0);
  EXPECT_TRUE(m.release(3));
  EXPECT_TRUE(m.isFullyFree());
}

TEST(DecodePrefixCache, TwinsAreSkippedAndAnotherNextTokenKeepsAVariantOfItsOwn) {
  KvBlockManager m(16, 4, 0, 16, kModel);
  const std::vector<std::int32_t> prompt = tokens(1, 13);
  // Two concurrent requests with the same prompt, each with its own blocks: the first caches
  // them; the second's twins are skipped (the chain goes on through the cached ones).
  ASSERT_TRUE(m.admit(1, 13).ok());
  ASSERT_TRUE(m.admit(2, 13).ok());
  EXPECT_EQ(m.cachePrefix(1, prompt, 3), 3);
  EXPECT_EQ(m.cachePrefix(2, prompt, 3), 0);
  const std::vector<std::int32_t> first = table(m, 1);
  EXPECT_EQ(m.matchPrefix(prompt, 3), std::vector<std::int32_t>(first.begin(), first.begin() + 3));
  for (std::uint64_t id : {1, 2}) EXPECT_TRUE(m.release(id));
  // Conversations sharing a system prompt that ends inside block 1: another conversation's block
  // 1 has the same tokens but pairs its last MTP row with another next token, so it is cached as a
  // variant of its own, and that conversation's later turn finds its whole chain.
  std::vector<std::int32_t> other = prompt;
  other[8] = 999;
  const std::vector<std::int32_t> other_shared = m.matchPrefix(other, 3);
  ASSERT_EQ(other_shared.size(), 1U);  // block 1 pairs with token 9 in the cache, 999 here
  ASSERT_TRUE(m.admit(3, 13, 0, other_shared).ok());
  EXPECT_EQ(m.cachePrefix(3, other, 3), 2);  // its variant of block 1, and block 2
  const std::vector<std::int32_t> third = table(m, 3);
  EXPECT_TRUE(m.release(3));
  EXPECT_EQ(m.matchPrefix(other, 3), std::vector<std::int32_t>(third.begin(), third.begin() + 3));
  EXPECT_EQ(m.matchPrefix(prompt, 3), std::vector<std::int32_t>(first.begin(), first.begin() + 3));
  EXPECT_EQ(m.cachedBlocks(), 5);
  EXPECT_TRUE(m.isFreeButPrefixCache());
  EXPECT_EQ(m.clearPrefixCache(), 5);
  EXPECT_TRUE(m.isFullyFree());
}

// Random admissions with shared prefixes, growth, caching, quarantine and release: every count
// stays consistent with the holders and the pool ends free but for the cache.
TEST(DecodePrefixCache, RandomWalkKeepsEveryCountConsistent) {
  std::mt19937_64 rng(19);
  const auto rand = [&](std::uint64_t n) { return rng() % n; };
  KvBlockManager m(24, 4, 1, 10, kModel);
  std::vector<std::vector<std::int32_t>> prompts;
  for (int p = 0; p < 4; ++p) prompts.push_back(tokens(1000 * p, 30));
  std::vector<std::pair<std::uint64_t, std::size_t>> live;
  std::uint64_t next = 1;
  for (int step = 0; step < 3000; ++step) {
    if (live.empty() || rand(3) != 0) {
      const std::size_t p = rand(prompts.size());
      const auto len = static_cast<std::int64_t>(5 + rand(25));
      const std::span<const std::int32_t> prompt(prompts[p].data(), static_cast<std::size_t>(len));
      const auto shared = m.matchPrefix(prompt, (len - 1) / 4);
      if (m.admit(next, len, 0, shared).ok()) live.emplace_back(next, p);
      ++next;
    } else {
      const std::size_t i = rand(live.size());
      const auto [id, p] = live[i];
      const auto len = static_cast<std::int64_t>(m.blockTable(id).size()) * 4;
      switch (rand(4)) {
        case 0:
          (void)m.grow(id, len + 4);
          break;
        case 1:
          (void)m.quarantine(id);
          break;
        default:
          (void)m.cachePrefix(id, prompts[p], std::min<std::int64_t>(len / 4 - 1, 6));
          EXPECT_TRUE(m.release(id));
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
    ASSERT_LE(m.cachedBlocks(), 10);
    std::int64_t referenced = 0;
    for (std::int32_t b = 0; b < m.numBlocks(); ++b) referenced += m.refCount(b) > 0 ? 1 : 0;
    ASSERT_EQ(referenced + m.freeBlocks() - m.idleCachedBlocks(), m.numBlocks());
  }
  EXPECT_GT(m.prefixEvictions(), 0);
  for (const auto& [id, p] : live) EXPECT_TRUE(m.release(id));
  EXPECT_TRUE(m.isFreeButPrefixCache());
  m.clearPrefixCache();
  EXPECT_TRUE(m.isFullyFree());
}

}  // namespace
}  // namespace pd::decode
