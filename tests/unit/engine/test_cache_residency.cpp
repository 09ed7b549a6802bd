// model::CacheResidency: which positions an engine's copy of a paged latent cache re-reads
// before a call, from the blocks' epochs (the CUDA engine's device cache; the decode-level check
// is DecodeGolden.AResidentCacheCopyIsNeverStaleAndGivesTheSameTokens).
#include <gtest/gtest.h>

#include <vector>

#include "pd/engine/cache_residency.h"

namespace pd::model {
namespace {

using Range = CacheResidency::Range;

struct Cache {
  explicit Cache(std::int64_t blocks, bool with_epochs = true) : epochs(static_cast<std::size_t>(blocks)) {
    for (auto& e : epochs) e = nextCacheEpoch();
    view.dtype = DType::F32;
    view.latent_dim = 8;
    view.block_size = 4;
    view.num_blocks = blocks;
    if (with_epochs) view.block_epochs = epochs;
  }
  void touch(std::int32_t b) { epochs[static_cast<std::size_t>(b)] = nextCacheEpoch(); }
  std::vector<std::uint64_t> epochs;
  LatentCacheView view;
};

SequenceChunk chunk(const std::vector<std::int32_t>& tokens, std::int64_t start,
                    const std::vector<std::int32_t>& table) {
  return SequenceChunk{tokens, start, table};
}

TEST(CacheResidency, ReadsEachPrefixOnceThenOnlyWhatItHasNotWritten) {
  Cache c(8);
  CacheResidency r;
  const std::vector<std::int32_t> table{5, 2, 7, 1};  // positions 0..15
  const std::vector<std::int32_t> one{1};
  // 10 positions arrived in the host cache (a prefill): the first call reads all of them.
  auto a = chunk(one, 10, table);
  EXPECT_EQ(r.prepare(std::span(&a, 1), c.view), (std::vector<Range>{{5, 0, 4}, {2, 0, 4}, {7, 0, 2}}));
  // The call wrote position 10; the next reads [0, 11): nothing to copy.
  auto b = chunk(one, 11, table);
  EXPECT_TRUE(r.prepare(std::span(&b, 1), c.view).empty());
  EXPECT_EQ(r.takeCopiedPositions(), 10);
  EXPECT_EQ(r.heldBlocks(), 3);
  // Block 2 changed owner (its epoch moved): read again from its first position.
  c.touch(2);
  auto d = chunk(one, 12, table);
  EXPECT_EQ(r.prepare(std::span(&d, 1), c.view), (std::vector<Range>{{2, 0, 4}}));
}

// Bad input the engine refuses afterwards (a table too short for its chunk, a block id outside
// the cache) is never read past: the ranges stop at the table's end and skip the bad id. (ASan
// checks the "never read past" in the sanitizer run.)
TEST(CacheResidency, ATableTooShortOrABadIdIsNotReadPast) {
  Cache c(8);
  CacheResidency r;
  const std::vector<std::int32_t> short_table{3};  // position 6 needs two blocks
  const std::vector<std::int32_t> one{1};
  auto a = chunk(one, 6, short_table);
  EXPECT_EQ(r.prepare(std::span(&a, 1), c.view), (std::vector<Range>{{3, 0, 4}}));
  const std::vector<std::int32_t> bad_id{4, 99};
  auto b = chunk(one, 6, bad_id);
  EXPECT_EQ(r.prepare(std::span(&b, 1), c.view), (std::vector<Range>{{4, 0, 4}}));
  Cache scratch(8, /*with_epochs=*/false);
  EXPECT_EQ(r.prepare(std::span(&b, 1), scratch.view), (std::vector<Range>{{4, 0, 4}}));
}

TEST(CacheResidency, ASharedPrefixBlockIsReadOnceForTheBatch) {
  Cache c(8);
  CacheResidency r;
  const std::vector<std::int32_t> t1{0, 1};
  const std::vector<std::int32_t> t2{0, 3};
  const std::vector<std::int32_t> two{4, 5};
  const std::vector<SequenceChunk> batch{chunk(two, 6, t1), chunk(two, 5, t2)};
  EXPECT_EQ(r.prepare(batch, c.view), (std::vector<Range>{{0, 0, 4}, {1, 0, 2}, {3, 0, 1}}));
}

TEST(CacheResidency, ACacheWithoutEpochsIsReadWholeAndForgetsWhatItTouched) {
  Cache pool(8);
  Cache scratch(8, /*with_epochs=*/false);
  CacheResidency r;
  const std::vector<std::int32_t> table{0, 1};
  const std::vector<std::int32_t> one{1};
  auto a = chunk(one, 6, table);
  EXPECT_EQ(r.prepare(std::span(&a, 1), pool.view).size(), 2U);
  EXPECT_EQ(r.heldBlocks(), 2);
  // A scratch cache over blocks 0 and 1 of the copy: read whole, and afterwards the copy's
  // blocks 0 and 1 are the scratch's, so the pool's are read again.
  const std::vector<std::int32_t> scratch_table{0};
  const std::vector<std::int32_t> two{1, 2};
  auto s = chunk(two, 2, scratch_table);
  EXPECT_EQ(r.prepare(std::span(&s, 1), scratch.view), (std::vector<Range>{{0, 0, 2}}));
  EXPECT_EQ(r.prepare(std::span(&s, 1), scratch.view), (std::vector<Range>{{0, 0, 2}}));
  EXPECT_EQ(r.heldBlocks(), 1);
  auto b = chunk(one, 7, table);
  EXPECT_EQ(r.prepare(std::span(&b, 1), pool.view), (std::vector<Range>{{0, 0, 4}}));  // block 1 was kept
}

TEST(CacheResidency, AnotherCacheOrGeometryOrAFailedCallStartsOver) {
  Cache a(8);
  Cache b(8);  // the same block ids, other epochs: nothing of a's is taken for b's
  CacheResidency r;
  const std::vector<std::int32_t> table{3};
  const std::vector<std::int32_t> one{1};
  auto x = chunk(one, 3, table);
  EXPECT_EQ(r.prepare(std::span(&x, 1), a.view).size(), 1U);
  EXPECT_EQ(r.prepare(std::span(&x, 1), b.view), (std::vector<Range>{{3, 0, 3}}));
  EXPECT_TRUE(r.prepare(std::span(&x, 1), b.view).empty());
  r.forget();
  EXPECT_EQ(r.prepare(std::span(&x, 1), b.view).size(), 1U);
  Cache wider(8);
  wider.view.block_size = 8;
  EXPECT_EQ(r.prepare(std::span(&x, 1), wider.view).size(), 1U);
}

}  // namespace
}  // namespace pd::model
