// Accounting of the decode KV pool: admission by reservation, growth, the two "does not fit"
// answers, and that every path returns the pool to fully free.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "pd/decode/kv_block_manager.h"

namespace pd::decode {
namespace {

TEST(KvBlockManager, AdmitAllocatesPromptBlocksAndReservesTheRest) {
  KvBlockManager m(10, 4);
  ASSERT_TRUE(m.isFullyFree());
  ASSERT_TRUE(m.admit(1, 5, 12).ok());  // 2 blocks now, 3 reserved
  EXPECT_EQ(m.blockTable(1).size(), 2U);
  EXPECT_EQ(m.freeBlocks(), 8);
  EXPECT_EQ(m.availableBlocks(), 7);
  EXPECT_FALSE(m.isFullyFree());
  ASSERT_TRUE(m.grow(1, 9).ok());
  EXPECT_EQ(m.blockTable(1).size(), 3U);
  EXPECT_EQ(m.freeBlocks(), 7);
  EXPECT_EQ(m.availableBlocks(), 7);  // growth comes out of the reservation
  ASSERT_TRUE(m.grow(1, 12).ok());
  EXPECT_EQ(m.blockTable(1).size(), 3U);
  const Status beyond = m.grow(1, 13);
  ASSERT_FALSE(beyond.ok());
  EXPECT_EQ(beyond.error().code, ErrorCode::InvalidArgument);
  EXPECT_TRUE(m.release(1));
  EXPECT_FALSE(m.release(1));
  EXPECT_TRUE(m.isFullyFree());
}

TEST(KvBlockManager, NeverFitsIsResourceExhaustedFullNowIsOverloaded) {
  KvBlockManager m(4, 8);
  const Status huge = m.admit(1, 8, 33);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.error().code, ErrorCode::ResourceExhausted);
  EXPECT_TRUE(m.isFullyFree());

  ASSERT_TRUE(m.admit(2, 1, 24).ok());  // 1 block allocated, 3 reserved
  const Status full = m.admit(3, 1, 16);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.error().code, ErrorCode::Overloaded);
  ASSERT_TRUE(m.admit(4, 8, 8).ok());  // exactly the last block
  EXPECT_EQ(m.availableBlocks(), 0);
  const Status one_more = m.admit(5, 1, 1);
  ASSERT_FALSE(one_more.ok());
  EXPECT_EQ(one_more.error().code, ErrorCode::Overloaded);

  EXPECT_TRUE(m.release(2));  // retrying after a release succeeds
  EXPECT_TRUE(m.admit(3, 1, 16).ok());
  EXPECT_TRUE(m.release(3));
  EXPECT_TRUE(m.release(4));
  EXPECT_TRUE(m.isFullyFree());
}

TEST(KvBlockManager, RejectsBadInputWithoutHoldingAnything) {
  KvBlockManager m(4, 8);
  EXPECT_EQ(m.admit(1, 0, 8).error().code, ErrorCode::InvalidArgument);
  EXPECT_EQ(m.admit(1, 9, 8).error().code, ErrorCode::InvalidArgument);
  ASSERT_TRUE(m.admit(1, 8, 8).ok());
  EXPECT_EQ(m.admit(1, 8, 8).error().code, ErrorCode::InvalidArgument);
  EXPECT_EQ(m.grow(7, 1).error().code, ErrorCode::NotFound);
  EXPECT_TRUE(m.blockTable(7).empty());
  EXPECT_TRUE(m.release(1));
  EXPECT_TRUE(m.isFullyFree());
}

TEST(KvBlockManager, LiveRequestsNeverShareABlock) {
  KvBlockManager m(64, 2);
  std::vector<std::uint64_t> live;
  std::uint64_t next = 1;
  std::uint64_t rng = 12345;
  const auto rand = [&](std::uint64_t mod) {
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (rng >> 33) % mod;
  };
  for (int iter = 0; iter < 2000; ++iter) {
    const auto op = rand(3);
    if (op == 0 || live.empty()) {
      const auto prompt = static_cast<std::int64_t>(1 + rand(10));
      const auto reserve = prompt + static_cast<std::int64_t>(rand(10));
      const Status s = m.admit(next, prompt, reserve);
      if (s.ok()) {
        live.push_back(next);
      } else {
        EXPECT_EQ(s.error().code, ErrorCode::Overloaded);
      }
      ++next;
    } else if (op == 1) {
      const std::uint64_t id = live[rand(live.size())];
      const auto want = static_cast<std::int64_t>(m.blockTable(id).size()) * 2 + 1;
      (void)m.grow(id, want);  // may exceed the reservation: then nothing changes
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
  for (const std::uint64_t id : live) EXPECT_TRUE(m.release(id));
  EXPECT_TRUE(m.isFullyFree());
}

}  // namespace
}  // namespace pd::decode
