// Accounting of the decode KV pool: admission on the prompt's blocks and the headroom, growth
// block by block until the free list runs dry, the two "does not fit" answers, and that every
// path returns the pool to fully free.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace pd::decode
