// Layout arithmetic: descriptor validation and the planning of layer slices into puts.

#include <gtest/gtest.h>

#include "pd/kvtransfer/layout.h"

namespace pd::kvtransfer {
namespace {

constexpr std::uint64_t kBase = 1ULL << 40;

// A valid descriptor: 3 layers of block size 4, 8 BF16 values per token (16 bytes), 10 blocks in
// one region, layer-major.
KvDescriptor smallDescriptor() {
  KvDescriptor d;
  d.transfer_id = TransferId{0, 9};
  d.compat.block_size = 4;
  d.compat.num_layers = 3;
  d.compat.kv_dim = 8;
  d.num_tokens = 10;
  d.timeout_ms = 1000;
  d.block_ids = {7, 2, 3};
  const std::uint64_t block = 4ULL * 16;
  d.targets.push_back(KvTarget{0, {1, 2, 3}, {KvRegion{kBase, 3ULL * 10 * block, 0, 3, 10ULL * block, block, {9}}}});
  return d;
}

std::string validationError(const KvDescriptor& d) {
  const Status s = validateDescriptor(d);
  return s.ok() ? std::string() : s.error().message;
}

TEST(KvLayout, ValidDescriptorPasses) {
  EXPECT_EQ(validationError(smallDescriptor()), "");
}

TEST(KvLayout, PlansOnePutPerBlockRunAndMergesContiguousBlocks) {
  const KvDescriptor d = smallDescriptor();
  // Layer 1, tokens 1..9: block 7 slots 1..3, then blocks 2 and 3 (contiguous: merged).
  auto puts = planLayerPuts(d, 0, LayerSlice{1, 1, 9});
  ASSERT_TRUE(puts.ok()) << puts.error().toString();
  const std::uint64_t layer1 = kBase + 10ULL * 64;
  ASSERT_EQ(puts.value().size(), 2U);
  EXPECT_EQ(puts.value()[0], (PlannedPut{0, layer1 + 7ULL * 64 + 16, 0, 3ULL * 16}));
  EXPECT_EQ(puts.value()[1], (PlannedPut{0, layer1 + 2ULL * 64, 3ULL * 16, 6ULL * 16}));
}

// Decode tensor parallelism on the staging path: each rank receives at staging blocks of its own
// (KvTarget::block_ids); a target without a list of its own is written at the descriptor's ids.
TEST(KvLayout, ATargetWithBlockIdsOfItsOwnIsWrittenAtThem) {
  KvDescriptor d = smallDescriptor();
  KvTarget second = d.targets[0];
  second.tp_rank = 1;
  second.worker_address = {4, 5, 6};
  second.block_ids = {0, 1, 5};
  d.compat.tp_size = 2;
  d.targets.push_back(second);
  ASSERT_EQ(validationError(d), "");
  const std::uint64_t layer1 = kBase + 10ULL * 64;
  auto own = planLayerPuts(d, 1, LayerSlice{1, 1, 9});
  ASSERT_TRUE(own.ok()) << own.error().toString();
  ASSERT_EQ(own->size(), 2U);  // blocks 0 and 1 merge; 5 is apart
  EXPECT_EQ((*own)[0], (PlannedPut{0, layer1 + 16, 0, 7ULL * 16}));
  EXPECT_EQ((*own)[1], (PlannedPut{0, layer1 + 5ULL * 64, 7ULL * 16, 2ULL * 16}));
  auto shared = planLayerPuts(d, 0, LayerSlice{1, 1, 9});
  ASSERT_TRUE(shared.ok());
  EXPECT_EQ((*shared)[0], (PlannedPut{0, layer1 + 7ULL * 64 + 16, 0, 3ULL * 16}));

  // Its own list must cover the tokens and stay inside its region.
  d.targets[1].block_ids = {0, 1};
  EXPECT_NE(validationError(d).find("target 1: 10 tokens need 3 blocks of 4, its own block list has 2"),
            std::string::npos)
      << validationError(d);
  d.targets[1].block_ids = {0, 1, 10};
  EXPECT_NE(validationError(d).find("target 1 region 0: block 10"), std::string::npos) << validationError(d);
}

TEST(KvLayout, SplitRegionsPerLayerAreFound) {
  KvDescriptor d = smallDescriptor();
  auto& regions = d.targets[0].regions;
  regions = {KvRegion{kBase, 640, 0, 1, 0, 64, {1}}, KvRegion{kBase + 4096, 2ULL * 640, 1, 2, 640, 64, {2}}};
  ASSERT_EQ(validationError(d), "");
  auto puts = planLayerPuts(d, 0, LayerSlice{2, 0, 1});
  ASSERT_TRUE(puts.ok());
  ASSERT_EQ(puts.value().size(), 1U);
  EXPECT_EQ(puts.value()[0], (PlannedPut{1, kBase + 4096 + 640 + 7ULL * 64, 0, 16}));
}

TEST(KvLayout, SlicesOutsideTheRequestAreRefused) {
  const KvDescriptor d = smallDescriptor();
  EXPECT_FALSE(planLayerPuts(d, 0, LayerSlice{3, 0, 1}).ok());  // layer
  EXPECT_FALSE(planLayerPuts(d, 0, LayerSlice{0, 8, 3}).ok());  // tokens 8..10 of 10
  EXPECT_FALSE(planLayerPuts(d, 1, LayerSlice{0, 0, 1}).ok());  // target
  EXPECT_TRUE(planLayerPuts(d, 0, LayerSlice{0, 0, 0}).ok());   // empty slice: nothing to do
  EXPECT_TRUE(planLayerPuts(d, 0, LayerSlice{0, 0, 0}).value().empty());
}

TEST(KvLayout, ValidationNamesWhatIsWrong) {
  struct Case {
    const char* expect;
    void (*mutate)(KvDescriptor&);
  };
  const Case cases[] = {
      {"block_size is 0", [](KvDescriptor& d) { d.compat.block_size = 0; }},
      {"num_tokens is 0", [](KvDescriptor& d) { d.num_tokens = 0; }},
      {"timeout_ms is 0", [](KvDescriptor& d) { d.timeout_ms = 0; }},
      {"need 4 blocks", [](KvDescriptor& d) { d.num_tokens = 13; }},
      {"no targets", [](KvDescriptor& d) { d.targets.clear(); }},
      {"tp_rank 1 >= tp_size 1", [](KvDescriptor& d) { d.targets[0].tp_rank = 1; }},
      {"listed twice",
       [](KvDescriptor& d) {
         d.compat.tp_size = 2;
         d.targets.push_back(d.targets[0]);
       }},
      {"empty worker address", [](KvDescriptor& d) { d.targets[0].worker_address.clear(); }},
      {"empty remote key", [](KvDescriptor& d) { d.targets[0].regions[0].rkey.clear(); }},
      {"layers 2..2 are in no region", [](KvDescriptor& d) { d.targets[0].regions[0].num_layers = 2; }},
      {"in two regions", [](KvDescriptor& d) { d.targets[0].regions.push_back(d.targets[0].regions[0]); }},
      {"ends past the region", [](KvDescriptor& d) { d.block_ids[1] = 10; }},
      {"block stride", [](KvDescriptor& d) { d.targets[0].regions[0].block_stride = 63; }},
      {"wraps the address space", [](KvDescriptor& d) { d.targets[0].regions[0].base_address = ~0ULL - 8; }},
      {"num_layers 0", [](KvDescriptor& d) { d.compat.num_layers = 0; }},
  };
  for (const auto& c : cases) {
    KvDescriptor d = smallDescriptor();
    c.mutate(d);
    EXPECT_NE(validationError(d).find(c.expect), std::string::npos) << c.expect << " vs: " << validationError(d);
  }
  KvDescriptor f16 = smallDescriptor();
  f16.compat.kv_dtype = DType::F16;
  EXPECT_EQ(validateDescriptor(f16).error().code, ErrorCode::Unsupported);
}

// Strides near 2^64 must not overflow into a bounds check that passes.
TEST(KvLayout, HugeStridesDoNotOverflowTheBoundsCheck) {
  KvDescriptor d = smallDescriptor();
  d.targets[0].regions[0].layer_stride = 1ULL << 63;
  EXPECT_FALSE(validateDescriptor(d).ok());
  d = smallDescriptor();
  d.targets[0].regions[0].block_stride = (1ULL << 62) + 1;
  EXPECT_FALSE(validateDescriptor(d).ok());
}

TEST(KvLayout, RequestBytesOfARealPrompt) {
  KvDescriptor d;
  d.compat.num_layers = 61;
  d.num_tokens = 1024;
  EXPECT_EQ(requestKvBytes(d), 1024ULL * 61 * 1152);  // ~72 MB
  d.present_tokens = 768;                             // the decode worker's prefix cache holds 12 blocks: only 4 cross
  EXPECT_EQ(requestKvBytes(d), 256ULL * 61 * 1152);
}

// Decode-side prefix reuse: the present blocks are read-only on the decode side, so no put may
// plan into them, and validation refuses a present count that is not whole blocks short of the
// prompt's last token.
TEST(KvLayout, PresentTokensAreNeverWrittenAndMustBeWholeBlocksShortOfThePrompt) {
  KvDescriptor d = smallDescriptor();
  d.present_tokens = 8;  // blocks 7 and 2 are present; block 3 holds tokens 8..9
  ASSERT_EQ(validationError(d), "");
  EXPECT_FALSE(planLayerPuts(d, 0, LayerSlice{0, 0, 10}).ok());
  EXPECT_FALSE(planLayerPuts(d, 0, LayerSlice{1, 7, 1}).ok());
  auto puts = planLayerPuts(d, 0, LayerSlice{1, 8, 2});
  ASSERT_TRUE(puts.ok()) << puts.error().toString();
  ASSERT_EQ(puts.value().size(), 1U);
  EXPECT_EQ(puts.value()[0], (PlannedPut{0, kBase + 10ULL * 64 + 3ULL * 64, 0, 2ULL * 16}));
  for (const std::uint32_t bad : {2U, 10U, 12U, 16U}) {
    d.present_tokens = bad;
    EXPECT_NE(validationError(d), "") << bad;
  }
}

}  // namespace
}  // namespace pd::kvtransfer
