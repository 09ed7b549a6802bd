// The device decode step's host side (engine/cuda/decode_step_plan.h): a step's batch checked
// against the model and the device cache before anything is launched, and laid out for the
// device. Host arithmetic: runs in every build, GPU or not.
#include <gtest/gtest.h>

#include <filesystem>
#include <vector>

#include "decode_step_plan.h"
#include "pd/engine/model_config.h"

namespace {

namespace fs = std::filesystem;
using pd::gpu::DecodeCacheShape;
using pd::gpu::DecodeSequence;
using pd::gpu::planDecodeStep;

pd::ModelConfig tiny() {
  auto c = pd::ModelConfig::load(fs::path(PD_TEST_DATA_DIR) / "golden" / "tiny-bf16");
  EXPECT_TRUE(c.ok()) << c.error().toString();
  return *c;
}

TEST(DecodeStepPlan, LaysOutAMixedLengthBatch) {
  const pd::ModelConfig c = tiny();
  const DecodeCacheShape cache{32, 4};
  const std::vector<std::int32_t> a{3, 7};       // positions 0..7
  const std::vector<std::int32_t> b{5};          // positions 0..3
  const std::vector<std::int32_t> t{9, 10, 11};  // positions 0..11 (only 0..8 needed)
  const std::vector<DecodeSequence> batch{{17, 5, a}, {2, 0, b}, {2047, 8, t}};
  auto plan = planDecodeStep(c, cache, batch);
  ASSERT_TRUE(plan.ok()) << plan.error().toString();
  EXPECT_EQ(plan->tokens, 3);
  EXPECT_EQ(plan->token_ids, (std::vector<std::int32_t>{17, 2, 2047}));
  EXPECT_EQ(plan->positions, (std::vector<std::int64_t>{5, 0, 8}));
  EXPECT_EQ(plan->ctx_len, (std::vector<std::int64_t>{6, 1, 9}));
  // Only the blocks each context needs: 2, 1 and 3 (position 8 is block 2's offset 0).
  EXPECT_EQ(plan->block_tables, (std::vector<std::int32_t>{3, 7, 5, 9, 10, 11}));
  EXPECT_EQ(plan->table_begin, (std::vector<std::int64_t>{0, 2, 3}));
  EXPECT_EQ(plan->write_slot, (std::vector<std::int64_t>{7 * 4 + 1, 5 * 4 + 0, 11 * 4 + 0}));
  EXPECT_EQ(plan->max_context, 9);
}

void expectInvalid(const pd::ModelConfig& c, const DecodeCacheShape& cache, const std::vector<DecodeSequence>& batch,
                   const std::string& fragment) {
  auto plan = planDecodeStep(c, cache, batch);
  ASSERT_FALSE(plan.ok()) << "accepted: " << fragment;
  EXPECT_EQ(plan.error().code, pd::ErrorCode::InvalidArgument);
  EXPECT_NE(plan.error().message.find(fragment), std::string::npos) << plan.error().toString();
}

TEST(DecodeStepPlan, RejectsBadBatches) {
  const pd::ModelConfig c = tiny();
  const DecodeCacheShape cache{8, 4};
  const std::vector<std::int32_t> one{0};
  const std::vector<std::int32_t> two{1, 2};
  expectInvalid(c, cache, {}, "0 sequences");
  expectInvalid(c, cache, std::vector<DecodeSequence>(65, {1, 0, one}), "65 sequences");
  expectInvalid(c, cache, {{-1, 0, one}}, "token id -1");
  expectInvalid(c, cache, {{2048, 0, one}}, "token id 2048");
  expectInvalid(c, cache, {{1, -1, one}}, "position -1");
  expectInvalid(c, cache, {{1, 256, std::vector<std::int32_t>(64, 0)}}, "position 256");  // max_position_embeddings
  expectInvalid(c, cache, {{1, 4, one}}, "cannot hold position 4");
  expectInvalid(c, cache, {{1, 0, std::vector<std::int32_t>{8}}}, "block id 8");
  expectInvalid(c, cache, {{1, 5, std::vector<std::int32_t>{0, -3}}}, "block id -3");
  // Two sequences writing position 1 of block 0: the second would overwrite the first's latent.
  expectInvalid(c, cache, {{1, 1, one}, {1, 1, one}}, "another sequence");
  expectInvalid(c, DecodeCacheShape{0, 4}, {{1, 0, one}}, "cache of 0 blocks");
  // The same block at different offsets is fine (a shared prefix block is read, not written).
  EXPECT_TRUE(planDecodeStep(c, cache, {{{1, 5, two}, {1, 2, std::vector<std::int32_t>{1}}}}).ok());
  EXPECT_TRUE(planDecodeStep(c, cache, std::vector<DecodeSequence>(1, {1, 0, one})).ok());
}

TEST(DecodeStepPlan, ChecksTheModel) {
  pd::ModelConfig c = tiny();
  EXPECT_TRUE(pd::gpu::checkDecodeModel(c).ok());
  pd::ModelConfig wide = c;
  wide.kv_lora_rank = 1020;  // latent 1036 > the kernel's 1024
  auto s = pd::gpu::checkDecodeModel(wide);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, pd::ErrorCode::Unsupported);
  pd::ModelConfig odd = c;
  odd.qk_rope_head_dim = 15;
  EXPECT_FALSE(pd::gpu::checkDecodeModel(odd).ok());
  pd::ModelConfig groups = c;
  groups.n_group = 3;  // 16 experts do not split into 3 groups
  EXPECT_FALSE(pd::gpu::checkDecodeModel(groups).ok());
  pd::ModelConfig topk = c;
  topk.num_experts_per_tok = 17;
  EXPECT_FALSE(pd::gpu::checkDecodeModel(topk).ok());
}

}  // namespace
