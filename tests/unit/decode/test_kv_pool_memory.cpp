// The KV pool over memory an engine allocated (Engine::allocateCache), as the CUDA engine's device
// pool is: here a stand-in whose "device" bytes are host pages mapped without access (PROT_NONE),
// so any host read or write of the pool's bytes would crash the test. The pool's layout (layer
// stride from the memory's own spacing, engine blocks after the pool's), its block copies and its
// writes (a local prefill's) must go through the memory's methods, and host access to a device
// view is refused.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "golden_support.h"
#include "pd/common/kv_format.h"
#include "pd/decode/kv_pool.h"
#include "pd/engine/engine.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/model_factory.h"

namespace pd::decode {
namespace {

// "Device" memory: layers of num_blocks + extra blocks each, none of it accessible to the host.
class NoAccessMemory final : public model::CacheMemory {
 public:
  NoAccessMemory(std::int64_t layers, std::int64_t latent_dim, std::int64_t num_blocks, std::int64_t extra_blocks,
                 std::int64_t block_size, DType dtype) {
    view_.dtype = dtype;
    view_.latent_dim = latent_dim;
    view_.block_size = block_size;
    view_.num_blocks = num_blocks;
    view_.on_device = true;
    view_.device = 3;
    layer_bytes_ = static_cast<std::size_t>((num_blocks + extra_blocks) * block_size) * view_.tokenBytes();
    bytes_ = layer_bytes_ * static_cast<std::size_t>(layers);
    base_ = ::mmap(nullptr, bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    PD_CHECK(base_ != MAP_FAILED);
    for (std::int64_t l = 0; l < layers; ++l) {
      view_.layers.push_back(static_cast<std::byte*>(base_) + static_cast<std::size_t>(l) * layer_bytes_);
    }
  }
  ~NoAccessMemory() override { ::munmap(base_, bytes_); }
  NoAccessMemory(const NoAccessMemory&) = delete;
  NoAccessMemory& operator=(const NoAccessMemory&) = delete;

  const model::LatentCacheView& view() const override { return view_; }
  std::size_t bytes() const override { return bytes_; }
  std::string location() const override { return "cuda:3"; }
  Status copyBlock(std::int32_t src, std::int32_t dst) override {
    copies.emplace_back(src, dst);
    return okStatus();
  }
  Status readTokens(std::int64_t /*layer*/, std::int64_t /*first_slot*/, std::span<std::byte> tokens) const override {
    std::fill(tokens.begin(), tokens.end(), std::byte{0});
    return okStatus();
  }
  Status writeTokens(std::int64_t layer, std::int64_t first_slot, std::span<const std::byte> tokens) override {
    writes.push_back({layer, first_slot, std::vector<std::byte>(tokens.begin(), tokens.end())});
    return okStatus();
  }

  struct Write {
    std::int64_t layer;
    std::int64_t slot;
    std::vector<std::byte> bytes;
  };
  std::vector<std::pair<std::int32_t, std::int32_t>> copies;
  std::vector<Write> writes;
  std::size_t layer_bytes_ = 0;

 private:
  model::LatentCacheView view_;
  void* base_ = nullptr;
  std::size_t bytes_ = 0;
};

TEST(KvPoolMemory, ADevicePoolIsLaidOutByItsMemoryAndNeverTouchedByTheHost) {
  auto owned = std::make_unique<NoAccessMemory>(4, 40, 10, 3, 16, DType::F8E4M3);
  NoAccessMemory& memory = *owned;
  auto pool = KvPool::create(std::move(owned));
  ASSERT_TRUE(pool.ok()) << pool.error().toString();
  EXPECT_TRUE(pool->onDevice());
  EXPECT_EQ(pool->location(), "cuda:3");
  EXPECT_EQ(pool->numBlocks(), 10);
  EXPECT_EQ(pool->blockStride(), 16 * kvTokenBytes(DType::F8E4M3, 40));
  // The engine's 3 blocks after the pool's 10 are inside each layer's stride.
  EXPECT_EQ(pool->layerStride(), 13 * pool->blockStride());
  EXPECT_EQ(pool->memory().size(), memory.bytes());
  const kvtransfer::RegionLayout layout = pool->regionLayout(7);
  EXPECT_EQ(layout.layer_stride, memory.layer_bytes_);
  EXPECT_EQ(layout.num_layers, 4U);
  EXPECT_EQ(pool->compat(1, 1).tokenBytes(), kvTokenBytes(DType::F8E4M3, 40));

  // Block copies (copy-on-write of a shared block) and a sequence's writes (local prefill) go
  // through the memory, encoded as the pool stores them.
  pool->enableEpochs();
  pool->copyBlock(2, 5);
  ASSERT_EQ(memory.copies.size(), 1U);
  EXPECT_EQ(memory.copies[0], std::make_pair(2, 5));
  std::vector<float> latent(40);
  for (std::size_t i = 0; i < latent.size(); ++i) latent[i] = 0.25F * static_cast<float>(i) - 3.0F;
  const std::vector<std::int32_t> table{6, 1};
  ASSERT_TRUE(pool->writeLatent(2, table, 19, latent.data()).ok());  // position 19: block 1, offset 3
  ASSERT_EQ(memory.writes.size(), 1U);
  EXPECT_EQ(memory.writes[0].layer, 2);
  EXPECT_EQ(memory.writes[0].slot, 1 * 16 + 3);
  std::vector<std::byte> want(kvTokenBytes(DType::F8E4M3, 40));
  encodeKvToken(DType::F8E4M3, latent, want.data());
  EXPECT_EQ(memory.writes[0].bytes, want);
  // A run of 20 positions from 10 (a local prefill's layer): one copy per block it covers
  // (positions 10..15 in block 6, 16..29 in block 1... of blocks of 16: 6 then 14 tokens).
  std::vector<float> rows(static_cast<std::size_t>(20 * 40));
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = std::cos(static_cast<float>(i));
  ASSERT_TRUE(pool->writeLatents(1, table, 10, rows).ok());
  ASSERT_EQ(memory.writes.size(), 3U);
  EXPECT_EQ(memory.writes[1].slot, 6 * 16 + 10);
  EXPECT_EQ(memory.writes[1].bytes.size(), 6 * want.size());
  EXPECT_EQ(memory.writes[2].slot, 1 * 16 + 0);
  EXPECT_EQ(memory.writes[2].bytes.size(), 14 * want.size());
  encodeKvToken(DType::F8E4M3, std::span<const float>(rows).subspan(7 * 40, 40), want.data());
  EXPECT_TRUE(std::equal(want.begin(), want.end(), memory.writes[2].bytes.begin() + 1 * want.size()));
}

// readLatents, the way a prefill worker ships its prefix cache's KV (its cache may be on the
// device): through readTokens, equal to readLatent position by position, across blocks, for every
// KV dtype; a table too short is refused.
TEST(KvPoolMemory, ReadLatentsThroughTheMemoryEqualsReadLatent) {
  auto config = presetConfig("tiny");
  ASSERT_TRUE(config.ok());
  for (const DType dtype : {DType::F32, DType::BF16, DType::F8E4M3}) {
    auto memory = model::allocateHostCache(*config, 8, 4, dtype);
    ASSERT_TRUE(memory.ok());
    const model::LatentCacheView& v = (*memory)->view();
    const std::vector<std::int32_t> table{5, 2, 7};
    std::vector<float> latent(static_cast<std::size_t>(v.latent_dim));
    for (std::int64_t p = 0; p < 11; ++p) {
      for (std::size_t i = 0; i < latent.size(); ++i) latent[i] = std::sin(static_cast<float>(p * 31 + i));
      model::writeLatent(v, 1, table, p, latent.data());
    }
    std::vector<float> got(static_cast<std::size_t>(11 * v.latent_dim));
    ASSERT_TRUE((*memory)->readLatents(1, table, 11, got.data()).ok());
    for (std::int64_t p = 0; p < 11; ++p) {
      model::readLatent(v, 1, table, p, latent.data());
      EXPECT_TRUE(std::equal(latent.begin(), latent.end(), got.begin() + p * v.latent_dim)) << dtypeName(dtype) << p;
    }
    got.resize(static_cast<std::size_t>(13 * v.latent_dim));
    EXPECT_EQ((*memory)->readLatents(1, table, 13, got.data()).error().code, ErrorCode::InvalidArgument);
  }
}

TEST(KvPoolMemory, HostAccessToADeviceViewIsRefused) {
  NoAccessMemory memory(1, 8, 2, 0, 4, DType::BF16);
  std::vector<float> out(8);
  const std::vector<std::int32_t> table{0};
  EXPECT_DEATH(model::readLatent(memory.view(), 0, table, 0, out.data()), "host access to a device cache");
}

TEST(KvPoolMemory, TheCpuEngineRefusesADeviceCache) {
  auto engine =
      model::createCpuEngine(test_support::goldenDir() / "tiny-bf16", model::CpuEngineOptions{1, std::nullopt});
  ASSERT_TRUE(engine.ok()) << engine.error().toString();
  const ModelConfig& c = (*engine)->config();
  NoAccessMemory memory(c.kvLayers(), c.latentDim(), 4, 0, 16, DType::BF16);
  const std::vector<std::int32_t> tokens{1, 2, 3};
  const std::vector<std::int32_t> table{0};
  const model::SequenceChunk chunk{tokens, 0, table};
  auto out = (*engine)->forward(std::span(&chunk, 1), memory.view(), {});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.error().code, ErrorCode::InvalidArgument);
  EXPECT_NE(out.error().message.find("GPU cache"), std::string::npos) << out.error().message;
}

}  // namespace
}  // namespace pd::decode
