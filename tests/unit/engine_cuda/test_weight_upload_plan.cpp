// The host plan of the device weight upload (engine/cuda/weight_upload_plan.h): the arena layout
// and the chunking through the pinned staging buffer. Runs everywhere; the upload itself is
// checked on a device by tests/gpu/test_device_weights.cpp.
#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <vector>

#include "device_memory_plan.h"
#include "pd/engine/model_config.h"
#include "pd/engine/safetensors.h"
#include "support/test_files.h"
#include "weight_upload_plan.h"

namespace {

using pd::gpu::kDeviceTensorAlignment;
using pd::gpu::layoutDeviceTensors;
using pd::gpu::planUploadChunks;
using pd::gpu::UploadChunk;

// Every byte of every tensor in exactly one piece, in order; pieces packed from staging offset
// 0; every chunk in (0, chunk] and full except the last.
void expectCoversExactly(const std::vector<std::uint64_t>& sizes, const std::vector<UploadChunk>& chunks,
                         std::uint64_t chunk) {
  std::vector<std::uint64_t> next(sizes.size(), 0);  // the next byte expected of each tensor
  std::size_t last_tensor = 0;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    const UploadChunk& k = chunks[c];
    ASSERT_GT(k.bytes, 0U);
    ASSERT_LE(k.bytes, chunk);
    if (c + 1 < chunks.size()) {
      EXPECT_EQ(k.bytes, chunk) << "chunk " << c << " is not full";
    }
    std::uint64_t staging = 0;
    for (const auto& p : k.pieces) {
      ASSERT_LT(p.tensor, sizes.size());
      ASSERT_GE(p.tensor, last_tensor) << "tensors out of order";
      last_tensor = p.tensor;
      EXPECT_GT(p.bytes, 0U);
      EXPECT_EQ(p.staging_offset, staging);
      EXPECT_EQ(p.source_offset, next[p.tensor]) << "tensor " << p.tensor;
      next[p.tensor] += p.bytes;
      staging += p.bytes;
    }
    EXPECT_EQ(staging, k.bytes);
  }
  for (std::size_t t = 0; t < sizes.size(); ++t) EXPECT_EQ(next[t], sizes[t]) << "tensor " << t;
}

TEST(WeightUploadPlan, SmallTensorsShareAChunkAndLargeOnesSpanSeveral) {
  const std::vector<std::uint64_t> sizes{10, 0, 7, 100, 3, 64, 1};
  auto chunks = planUploadChunks(sizes, 32);
  ASSERT_TRUE(chunks.ok()) << chunks.error().toString();
  expectCoversExactly(sizes, *chunks, 32);
  ASSERT_EQ(chunks->size(), 6U);  // 185 bytes in chunks of 32
  // The first chunk: all of tensors 0 and 2, then the first 15 bytes of tensor 3.
  ASSERT_EQ((*chunks)[0].pieces.size(), 3U);
  EXPECT_EQ((*chunks)[0].pieces[2].tensor, 3U);
  EXPECT_EQ((*chunks)[0].pieces[2].bytes, 15U);
  EXPECT_EQ((*chunks)[0].pieces[2].staging_offset, 17U);
  EXPECT_EQ(chunks->back().bytes, 185U - 5 * 32);
}

TEST(WeightUploadPlan, EdgeCases) {
  EXPECT_FALSE(planUploadChunks(std::vector<std::uint64_t>{1}, 0).ok());
  auto none = planUploadChunks(std::vector<std::uint64_t>{}, 8);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  auto empties = planUploadChunks(std::vector<std::uint64_t>{0, 0}, 8);
  ASSERT_TRUE(empties.ok());
  EXPECT_TRUE(empties->empty());
  // Exactly one chunk's worth: one chunk, no empty trailer.
  auto exact = planUploadChunks(std::vector<std::uint64_t>{8, 8}, 16);
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(exact->size(), 1U);
}

TEST(WeightUploadPlan, RandomSizesAreCoveredExactly) {
  std::mt19937_64 rng(17);
  for (int round = 0; round < 200; ++round) {
    std::vector<std::uint64_t> sizes(rng() % 40);
    for (auto& s : sizes) s = rng() % 4 == 0 ? 0 : rng() % 5000;
    const std::uint64_t chunk = 1 + rng() % 3000;
    auto chunks = planUploadChunks(sizes, chunk);
    ASSERT_TRUE(chunks.ok());
    expectCoversExactly(sizes, *chunks, chunk);
  }
}

TEST(WeightUploadPlan, LayoutIsAlignedAndDisjoint) {
  const std::vector<std::uint64_t> sizes{1, 256, 0, 257, 3};
  auto layout = layoutDeviceTensors(sizes);
  ASSERT_TRUE(layout.ok());
  const std::vector<std::uint64_t> want{0, 256, 512, 512, 1024};
  EXPECT_EQ(layout->offsets, want);
  EXPECT_EQ(layout->total, 1280U);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(layout->offsets[i] % kDeviceTensorAlignment, 0U);
    if (i + 1 < sizes.size()) {
      EXPECT_LE(layout->offsets[i] + sizes[i], layout->offsets[i + 1]);
    }
  }
  const std::uint64_t huge = std::numeric_limits<std::uint64_t>::max() / 2;
  EXPECT_FALSE(layoutDeviceTensors(std::vector<std::uint64_t>{huge, huge, huge}).ok());
}

// The golden checkpoints as the upload sees them: the arena holds every tensor, and the memory
// plan's weight bytes (computed from the config alone) are the checkpoint's own bytes.
TEST(WeightUploadPlan, GoldenCheckpointsPlan) {
  for (const char* name : {"tiny-bf16", "tiny-fp8"}) {
    const auto dir = pd::test::goldenDir() / name;
    auto ckpt = pd::Checkpoint::open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.error().toString();
    auto config = pd::ModelConfig::load(dir);
    ASSERT_TRUE(config.ok()) << config.error().toString();
    std::vector<std::uint64_t> sizes;
    for (const auto* t : ckpt->tensors()) sizes.push_back(t->data.size());
    auto layout = layoutDeviceTensors(sizes);
    ASSERT_TRUE(layout.ok());
    EXPECT_GE(layout->total, ckpt->totalTensorBytes());
    EXPECT_LT(layout->total, ckpt->totalTensorBytes() + sizes.size() * kDeviceTensorAlignment);
    EXPECT_EQ(pd::gpu::checkpointLayoutBytes(*config), ckpt->totalTensorBytes()) << name;
    auto chunks = planUploadChunks(sizes, std::uint64_t{1} << 20);
    ASSERT_TRUE(chunks.ok());
    expectCoversExactly(sizes, *chunks, std::uint64_t{1} << 20);
  }
}

}  // namespace
