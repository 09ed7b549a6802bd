// Accounting of the decode KV pool: admission on the prompt's blocks and the headroom, growth
// block by block until the free list runs dry, the two "does not fit" answers, and that every
// path returns the pool to fully free; choices (n > 1) sharing a prompt's blocks by reference
// count with a private copy of the last one.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <vector>

#include "pd/decode/kv_block_manager.h"

namespace pd::decode {
namespace {

TEST(KvBlockManager, AdmitAllocatesOnlyThePromptAndGrowsOnDemand) {
  KvBlockManager m(10, 4);
  ASSERT_TRUE(m.isFullyFree());
  ASSERT_TRUE(m.admit(1, 5).ok());  // 2 blocks, nothing reserved
  EXPECT_EQ(m.blockTable(1).size(), 2U);
  EXPECT_EQ(m.freeBlocks(), 8);
  EXPECT_EQ(m.usedBlocks(), 2);
  EXPECT_EQ(m.availableBlocks(), 8);
  EXPECT_FALSE(m.isFullyFree());
  ASSERT_TRUE(m.grow(1, 9).ok());
  EXPECT_EQ(m.blockTable(1).size(), 3U);
  EXPECT_EQ(m.freeBlocks(), 7);
  ASSERT_TRUE(m.grow(1, 12).ok());  // still 3 blocks
  EXPECT_EQ(m.blockTable(1).size(), 3U);
  ASSERT_TRUE(m.grow(1, 40).ok());  // the whole pool: no reservation bounds it
  EXPECT_EQ(m.freeBlocks(), 0);
  const Status dry = m.grow(1, 41);
  ASSERT_FALSE(dry.ok());
  EXPECT_EQ(dry.error().code, ErrorCode::Overloaded);
  EXPECT_TRUE(m.release(1));
  EXPECT_FALSE(m.release(1));
  EXPECT_TRUE(m.isFullyFree());
}

TEST(KvBlockManager, GrowIsAllOrNothing) {
  KvBlockManager m(4, 2);
  ASSERT_TRUE(m.admit(1, 2).ok());
  ASSERT_TRUE(m.admit(2, 2).ok());
  const Status s = m.grow(1, 8);  // needs 3 more, 2 free
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::Overloaded);
  EXPECT_EQ(m.blockTable(1).size(), 1U);
  EXPECT_EQ(m.freeBlocks(), 2);
  EXPECT_TRUE(m.release(1));
  EXPECT_TRUE(m.release(2));
  EXPECT_TRUE(m.isFullyFree());
}

TEST(KvBlockManager, NeverFitsIsResourceExhaustedFullNowIsOverloaded) {
  KvBlockManager m(4, 8);
  const Status huge = m.admit(1, 33);  // 5 blocks: more than the pool
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.error().code, ErrorCode::ResourceExhausted);
  EXPECT_TRUE(m.isFullyFree());

  ASSERT_TRUE(m.admit(2, 24).ok());  // 3 blocks
  const Status full = m.admit(3, 16);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.error().code, ErrorCode::Overloaded);
  ASSERT_TRUE(m.admit(4, 8).ok());  // exactly the last block
  EXPECT_EQ(m.availableBlocks(), 0);
  const Status one_more = m.admit(5, 1);
  ASSERT_FALSE(one_more.ok());
  EXPECT_EQ(one_more.error().code, ErrorCode::Overloaded);

  EXPECT_TRUE(m.release(2));  // retrying after a release succeeds
  EXPECT_TRUE(m.admit(3, 16).ok());
  EXPECT_TRUE(m.release(3));
  EXPECT_TRUE(m.release(4));
  EXPECT_TRUE(m.isFullyFree());
}

TEST(KvBlockManager, AdmissionLeavesTheHeadroomWhichGrowthMayUse) {
  KvBlockManager m(8, 4, /*headroom_blocks=*/2);
  EXPECT_EQ(m.availableBlocks(), 6);
  ASSERT_TRUE(m.admit(1, 16).ok());  // 4 blocks; 4 free
  EXPECT_EQ(m.availableBlocks(), 2);
  const Status three = m.admit(2, 12);  // 3 blocks would leave 1 < 2 free
  ASSERT_FALSE(three.ok());
  EXPECT_EQ(three.error().code, ErrorCode::Overloaded);
  ASSERT_TRUE(m.admit(2, 8).ok());  // 2 blocks leave exactly the headroom
  EXPECT_EQ(m.availableBlocks(), 0);
  EXPECT_EQ(m.admit(3, 1).error().code, ErrorCode::Overloaded);
  ASSERT_TRUE(m.grow(1, 24).ok());  // growth takes the headroom
  EXPECT_EQ(m.freeBlocks(), 0);
  EXPECT_EQ(m.availableBlocks(), 0);
  // A prompt larger than the pool is ResourceExhausted even with the headroom counted out.
  EXPECT_EQ(m.admit(4, 33).error().code, ErrorCode::ResourceExhausted);
  EXPECT_TRUE(m.release(1));
  EXPECT_TRUE(m.release(2));
  EXPECT_TRUE(m.isFullyFree());
}

TEST(KvBlockManager, QuarantinedBlocksAreNeitherFreeNorGrown) {
  KvBlockManager m(4, 4);
  ASSERT_TRUE(m.admit(1, 8).ok());
  EXPECT_EQ(m.quarantine(1), 2);
  EXPECT_EQ(m.quarantine(1), 0);
  EXPECT_TRUE(m.isQuarantined(1));
  EXPECT_EQ(m.quarantinedBlocks(), 2);
  EXPECT_EQ(m.freeBlocks(), 2);
  EXPECT_EQ(m.grow(1, 12).error().code, ErrorCode::InvalidArgument);
  EXPECT_TRUE(m.release(1));
  EXPECT_EQ(m.quarantinedBlocks(), 0);
  EXPECT_TRUE(m.isFullyFree());
}

TEST(KvBlockManager, RejectsBadInputWithoutHoldingAnything) {
  KvBlockManager m(4, 8);
  EXPECT_EQ(m.admit(1, 0).error().code, ErrorCode::InvalidArgument);
  ASSERT_TRUE(m.admit(1, 8).ok());
  EXPECT_EQ(m.admit(1, 8).error().code, ErrorCode::InvalidArgument);
  EXPECT_EQ(m.grow(7, 1).error().code, ErrorCode::NotFound);
  EXPECT_TRUE(m.blockTable(7).empty());
  EXPECT_TRUE(m.release(1));
  EXPECT_TRUE(m.isFullyFree());
}

TEST(KvBlockManager, LiveRequestsNeverShareABlock) {
  KvBlockManager m(64, 2, 3);
  std::vector<std::uint64_t> live;
  std::uint64_t next = 1;
  std::uint64_t rng = 12345;
  const auto rand = [&](std::uint64_t mod) {
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (rng >> 33) % mod;
  };
  int dry = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    const auto op = rand(3);
    if (op == 0 || live.empty()) {
      const auto prompt = static_cast<std::int64_t>(1 + rand(10));
      const Status s = m.admit(next, prompt);
      if (s.ok()) {
        live.push_back(next);
      } else {
        EXPECT_EQ(s.error().code, ErrorCode::Overloaded);
      }
      ++next;
    } else if (op == 1) {
      const std::uint64_t id = live[rand(live.size())];
      const auto want = static_cast<std::int64_t>(m.blockTable(id).size()) * 2 + 1;
      const auto before = m.blockTable(id).size();
      const Status s = m.grow(id, want);
      if (!s.ok()) {
        ++dry;
        EXPECT_EQ(s.error().code, ErrorCode::Overloaded);
        EXPECT_EQ(m.blockTable(id).size(), before);
      }
    } else {
      const auto at = rand(live.size());
      EXPECT_TRUE(m.release(live[at]));
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(at));
    }
    std::set<std::int32_t> owned;
    std::size_t total = 0;
    for (const std::uint64_t id : live) {
      for (const std::int32_t b : m.blockTable(id)) owned.insert(b);
      total += m.blockTable(id).size();
    }
    ASSERT_EQ(owned.size(), total) << "a block is owned twice";
    ASSERT_EQ(static_cast<std::int64_t>(total) + m.freeBlocks(), m.numBlocks());
    ASSERT_GE(m.availableBlocks(), 0);
  }
  EXPECT_GT(dry, 0) << "the walk never ran the pool dry";
  for (const std::uint64_t id : live) EXPECT_TRUE(m.release(id));
  EXPECT_TRUE(m.isFullyFree());
}

// n = 3 over a 10-token prompt in blocks of 4: blocks 0..2 hold the prompt, two spares wait for
// the children; each child shares blocks 0 and 1 and gets its own copy of block 2.
TEST(KvBlockManager, ForkSharesFullBlocksAndCopiesTheLast) {
  KvBlockManager m(16, 4);
  ASSERT_TRUE(m.admit(1, 10, 2).ok());
  EXPECT_EQ(m.blockTable(1).size(), 3U);
  EXPECT_EQ(m.usedBlocks(), 5);  // prompt + 2 spares
  EXPECT_EQ(m.sharedBlocks(), 0);
  const std::vector<std::int32_t> parent(m.blockTable(1).begin(), m.blockTable(1).end());
  std::set<std::int32_t> copies;
  for (std::uint64_t child = 2; child <= 3; ++child) {
    auto copy = m.fork(1, child);
    ASSERT_TRUE(copy.ok()) << copy.error().toString();
    EXPECT_EQ(copy->src, parent.back());
    const auto table = m.blockTable(child);
    ASSERT_EQ(table.size(), 3U);
    EXPECT_EQ(table[0], parent[0]);
    EXPECT_EQ(table[1], parent[1]);
    EXPECT_EQ(table[2], copy->dst);
    EXPECT_NE(copy->dst, parent.back());
    copies.insert(copy->dst);
  }
  EXPECT_EQ(copies.size(), 2U);
  EXPECT_EQ(m.refCount(parent[0]), 3);
  EXPECT_EQ(m.refCount(parent[1]), 3);
  EXPECT_EQ(m.refCount(parent[2]), 1);
  EXPECT_EQ(m.sharedBlocks(), 2);
  EXPECT_EQ(m.usedBlocks(), 5);  // forking took nothing from the free list
  // No spare left: a fourth choice cannot fork.
  EXPECT_EQ(m.fork(1, 4).error().code, ErrorCode::InvalidArgument);
  EXPECT_FALSE(m.contains(4));
  // Each choice grows on its own fresh blocks; nothing shared is handed out again.
  ASSERT_TRUE(m.grow(2, 13).ok());
  ASSERT_TRUE(m.grow(3, 13).ok());
  EXPECT_NE(m.blockTable(2)[3], m.blockTable(3)[3]);
  EXPECT_EQ(m.refCount(m.blockTable(2)[3]), 1);
  EXPECT_EQ(m.usedBlocks(), 7);
}

// A shared block is free only when its last holder lets go, whatever the release order.
TEST(KvBlockManager, SharedBlocksFreeOnlyWithTheirLastHolder) {
  for (const std::vector<std::uint64_t>& order :
       std::vector<std::vector<std::uint64_t>>{{1, 2, 3}, {3, 2, 1}, {2, 1, 3}, {2, 3, 1}, {3, 1, 2}, {1, 3, 2}}) {
    KvBlockManager m(8, 4);
    ASSERT_TRUE(m.admit(1, 9, 2).ok());  // blocks a b c + 2 spares
    ASSERT_TRUE(m.fork(1, 2).ok());
    ASSERT_TRUE(m.fork(1, 3).ok());
    ASSERT_TRUE(m.grow(3, 14).ok());
    const std::int32_t shared = m.blockTable(1)[0];
    std::int64_t free_before = m.freeBlocks();
    for (std::size_t k = 0; k < order.size(); ++k) {
      const std::size_t own = m.blockTable(order[k]).size() - 2;  // its private blocks
      ASSERT_TRUE(m.release(order[k]));
      const bool last = k + 1 == order.size();
      EXPECT_EQ(m.refCount(shared), static_cast<std::int32_t>(order.size() - k - 1));
      // Private blocks come back at once; the two shared ones only with the last holder.
      EXPECT_EQ(m.freeBlocks(), free_before + static_cast<std::int64_t>(own) + (last ? 2 : 0));
      free_before = m.freeBlocks();
    }
    EXPECT_TRUE(m.isFullyFree());
  }
}

// Unused spares go back at once (a choice whose stream never attached), and with release().
TEST(KvBlockManager, SparesReturnWhenUnused) {
  KvBlockManager m(8, 4, 1);
  // The spares count for admission: 2 + 4 blocks need 6 of the 7 available.
  EXPECT_EQ(m.admit(9, 8, 6).error().code, ErrorCode::Overloaded);
  EXPECT_EQ(m.admit(9, 8, 7).error().code, ErrorCode::ResourceExhausted);
  EXPECT_EQ(m.admit(9, 8, -1).error().code, ErrorCode::InvalidArgument);
  ASSERT_TRUE(m.admit(1, 8, 4).ok());
  EXPECT_EQ(m.freeBlocks(), 2);
  ASSERT_TRUE(m.fork(1, 2).ok());
  EXPECT_EQ(m.releaseSpares(1), 3);
  EXPECT_EQ(m.freeBlocks(), 5);
  EXPECT_EQ(m.releaseSpares(1), 0);
  EXPECT_EQ(m.fork(1, 3).error().code, ErrorCode::InvalidArgument);
  EXPECT_EQ(m.fork(7, 3).error().code, ErrorCode::NotFound);
  EXPECT_EQ(m.fork(1, 2).error().code, ErrorCode::InvalidArgument);  // 2 exists
  ASSERT_TRUE(m.admit(4, 1, 1).ok());
  EXPECT_TRUE(m.release(4));  // spares go with release() too
  EXPECT_TRUE(m.release(2));
  EXPECT_TRUE(m.release(1));
  EXPECT_TRUE(m.isFullyFree());
}

// Preempting one choice (its release while the others run and grow) frees only its own blocks;
// the survivors keep the shared prompt and can take the freed blocks.
TEST(KvBlockManager, PreemptingOneChoiceKeepsTheSharedPrompt) {
  KvBlockManager m(6, 2);
  ASSERT_TRUE(m.admit(1, 4, 2).ok());  // 2 prompt blocks + 2 spares: 4 used
  ASSERT_TRUE(m.fork(1, 2).ok());
  ASSERT_TRUE(m.fork(1, 3).ok());
  ASSERT_TRUE(m.grow(1, 5).ok());
  ASSERT_TRUE(m.grow(2, 5).ok());
  EXPECT_EQ(m.freeBlocks(), 0);
  EXPECT_EQ(m.grow(3, 5).error().code, ErrorCode::Overloaded);  // the pool ran dry
  const std::int32_t shared = m.blockTable(3)[0];
  ASSERT_TRUE(m.release(2));     // the engine preempts the latest: choice 2
  EXPECT_EQ(m.freeBlocks(), 2);  // its copy and its grown block; the shared block stays
  EXPECT_EQ(m.refCount(shared), 2);
  ASSERT_TRUE(m.grow(3, 6).ok());
  EXPECT_EQ(m.blockTable(3)[0], shared);
  EXPECT_TRUE(m.release(1));
  EXPECT_EQ(m.refCount(shared), 1);
  EXPECT_TRUE(m.release(3));
  EXPECT_TRUE(m.isFullyFree());
}

// Late writes: a quarantined holder keeps its blocks (shared ones included) from the free list;
// a block counts as quarantined only while every holder is quarantined.
TEST(KvBlockManager, QuarantineWithSharedBlocks) {
  KvBlockManager m(8, 4);
  ASSERT_TRUE(m.admit(1, 8, 1).ok());  // 2 prompt blocks + 1 spare
  EXPECT_EQ(m.quarantine(1), 3);
  EXPECT_EQ(m.quarantinedBlocks(), 3);
  EXPECT_EQ(m.fork(1, 2).error().code, ErrorCode::InvalidArgument);  // quarantined: no fork
  ASSERT_TRUE(m.release(1));
  EXPECT_EQ(m.quarantinedBlocks(), 0);
  EXPECT_TRUE(m.isFullyFree());

  ASSERT_TRUE(m.admit(1, 8, 1).ok());
  ASSERT_TRUE(m.fork(1, 2).ok());
  const std::int32_t shared = m.blockTable(1)[0];
  EXPECT_EQ(m.quarantine(2), 2);
  EXPECT_EQ(m.quarantinedBlocks(), 1);  // its copy; the shared block still has a live holder
  EXPECT_TRUE(m.isQuarantined(2));
  EXPECT_EQ(m.grow(2, 9).error().code, ErrorCode::InvalidArgument);
  ASSERT_TRUE(m.release(1));  // now only the quarantined choice holds the shared block
  EXPECT_EQ(m.quarantinedBlocks(), 2);
  EXPECT_EQ(m.refCount(shared), 1);
  EXPECT_EQ(m.freeBlocks(), 6);
  ASSERT_TRUE(m.release(2));
  EXPECT_EQ(m.quarantinedBlocks(), 0);
  EXPECT_TRUE(m.isFullyFree());
}

// A random walk over admissions with choices, forks, growth, releases and quarantines: every
// block's reference count is the number of tables and spare lists holding it, the free list holds
// exactly the unreferenced blocks, and the pool is fully free at the end.
TEST(KvBlockManager, RandomWalkWithChoicesKeepsReferenceCountsExact) {
  KvBlockManager m(48, 2, 2);
  std::vector<std::uint64_t> live;
  std::map<std::uint64_t, std::int64_t> spares;  // what each request may still fork
  std::uint64_t next = 1;
  std::uint64_t rng = 777;
  const auto rand = [&](std::uint64_t mod) {
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (rng >> 33) % mod;
  };
  std::int64_t forks = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const auto op = rand(5);
    if (op == 0 || live.empty()) {
      const auto prompt = static_cast<std::int64_t>(1 + rand(9));
      const auto spare = static_cast<std::int64_t>(rand(4));
      if (m.admit(next, prompt, spare).ok()) {
        live.push_back(next);
        spares[next] = spare;
      }
      ++next;
    } else if (op == 1) {
      const std::uint64_t parent = live[rand(live.size())];
      auto copy = m.fork(parent, next);
      if (spares[parent] > 0 && !m.isQuarantined(parent)) {
        ASSERT_TRUE(copy.ok()) << copy.error().toString();
        --spares[parent];
        live.push_back(next);
        spares[next] = 0;
        ++forks;
      } else {
        ASSERT_FALSE(copy.ok());
      }
      ++next;
    } else if (op == 2) {
      const std::uint64_t id = live[rand(live.size())];
      (void)m.grow(id, static_cast<std::int64_t>(m.blockTable(id).size()) * 2 + 1);
    } else if (op == 3) {
      const auto at = rand(live.size());
      ASSERT_TRUE(m.release(live[at]));
      spares.erase(live[at]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(at));
    } else {
      const std::uint64_t id = live[rand(live.size())];
      if (rand(4) == 0) {
        (void)m.quarantine(id);
      } else {
        m.releaseSpares(id);
        spares[id] = 0;
      }
    }
    // Tables hold each block at most once per request; counts add up to the references.
    std::map<std::int32_t, std::int32_t> held;
    for (const std::uint64_t id : live) {
      std::set<std::int32_t> mine(m.blockTable(id).begin(), m.blockTable(id).end());
      ASSERT_EQ(mine.size(), m.blockTable(id).size());
      for (const std::int32_t b : mine) ++held[b];
    }
    std::int64_t referenced = 0;
    for (std::int32_t b = 0; b < m.numBlocks(); ++b) {
      if (m.refCount(b) > 0) ++referenced;
      // Spares are held but not in a table, so a table count never exceeds the reference count.
      ASSERT_LE(held[b], m.refCount(b));
    }
    ASSERT_EQ(referenced + m.freeBlocks(), m.numBlocks());
  }
  EXPECT_GT(forks, 50);
  for (const std::uint64_t id : live) EXPECT_TRUE(m.release(id));
  EXPECT_TRUE(m.isFullyFree());
}

}  // namespace
}  // namespace pd::decode
