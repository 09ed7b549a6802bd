// The device memory plan: checkpoint bytes against real checkpoints, the KV pool arithmetic, and
// the error a user gets when the model does not fit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include "device_memory_plan.h"
#include "pd/engine/model_factory.h"
#include "pd/engine/safetensors.h"
#include "pd/engine/serving_engine.h"

namespace {

namespace fs = std::filesystem;
const fs::path kGoldenDir = fs::path(PD_TEST_DATA_DIR) / "golden";

TEST(DeviceMemoryPlan, CheckpointBytesEqualTheGoldenCheckpoints) {
  for (const char* model : {"tiny-bf16", "tiny-fp8"}) {
    auto config = pd::ModelConfig::load(kGoldenDir / model);
    ASSERT_TRUE(config.ok()) << config.error().toString();
    auto checkpoint = pd::Checkpoint::open(kGoldenDir / model);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.error().toString();
    EXPECT_EQ(pd::gpu::checkpointLayoutBytes(*config), checkpoint->totalTensorBytes()) << model;
  }
}

TEST(DeviceMemoryPlan, DeepSeekV3InFp8IsAbout690GB) {
  auto config = pd::presetConfig("deepseek-v3-layers=61");
  ASSERT_TRUE(config.ok());
  const std::uint64_t bf16 = pd::gpu::checkpointLayoutBytes(*config);
  config->quantization = pd::Fp8Quantization{};
  const std::uint64_t fp8 = pd::gpu::checkpointLayoutBytes(*config);
  std::printf("deepseek-v3 checkpoint layout: %.2f GB in FP8, %.2f GB in BF16\n", static_cast<double>(fp8) / 1e9,
              static_cast<double>(bf16) / 1e9);
  // The published FP8 checkpoint (671B main + 14B MTP parameters) is about 688 GB.
  EXPECT_GT(fp8, 670'000'000'000ULL);
  EXPECT_LT(fp8, 700'000'000'000ULL);
  EXPECT_GT(bf16, 2 * fp8 - 50'000'000'000ULL);  // BF16 doubles every quantized weight
}

TEST(DeviceMemoryPlan, KvPoolAndWorkspaceFollowTheShape) {
  auto config = pd::presetConfig("tiny");
  ASSERT_TRUE(config.ok());
  pd::gpu::DeviceServingShape shape{100, 64, pd::DType::BF16, 256, 4096, 64};
  auto plan = pd::gpu::planDeviceMemory(*config, shape);
  ASSERT_TRUE(plan.ok()) << plan.error().toString();
  EXPECT_EQ(plan->kv_pool, static_cast<std::uint64_t>(config->kvLayers() * 100 * 64 * config->latentDim() * 2));
  EXPECT_EQ(plan->weights, pd::gpu::checkpointLayoutBytes(*config));
  shape.kv_dtype = pd::DType::F32;
  shape.max_batch_tokens *= 2;
  auto bigger = pd::gpu::planDeviceMemory(*config, shape);
  ASSERT_TRUE(bigger.ok());
  EXPECT_EQ(bigger->kv_pool, 2 * plan->kv_pool);
  EXPECT_GT(bigger->workspace, plan->workspace);
  EXPECT_EQ(plan->total(), plan->weights + plan->kv_pool + plan->workspace);

  shape.kv_dtype = pd::DType::F8E4M3;  // kv_format.h tokens: the codes and a float32 scale per 64 values
  auto fp8 = pd::gpu::planDeviceMemory(*config, shape);
  ASSERT_TRUE(fp8.ok());
  EXPECT_EQ(fp8->kv_pool, static_cast<std::uint64_t>(config->kvLayers() * 100 * 64) *
                              pd::kvTokenBytes(pd::DType::F8E4M3, config->latentDim()));
  shape.kv_dtype = pd::DType::I32;
  EXPECT_EQ(pd::gpu::planDeviceMemory(*config, shape).error().code, pd::ErrorCode::InvalidArgument);
  shape.kv_dtype = pd::DType::BF16;
  shape.kv_blocks = 0;
  EXPECT_EQ(pd::gpu::planDeviceMemory(*config, shape).error().code, pd::ErrorCode::InvalidArgument);
}

TEST(DeviceMemoryPlan, ANonFittingModelNamesEveryPart) {
  const pd::gpu::DeviceMemoryPlan plan{688'600'000'000ULL, 9'600'000'000ULL, 1'300'000'000ULL};
  const std::uint64_t h200 = 139'800'000'000ULL;
  auto s = pd::gpu::checkDeviceFit(plan, h200, 500'000'000ULL, "cuda:0");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, pd::ErrorCode::ResourceExhausted);
  const std::string& m = s.error().message;
  for (const char* part : {"cuda:0", "weights 688.6 GB", "KV pool 9.6 GB", "workspace 1.3 GB", "= 699.5 GB",
                           "139.8 GB are free", "0.5 GB kept in reserve"}) {
    EXPECT_NE(m.find(part), std::string::npos) << "missing '" << part << "' in: " << m;
  }
  const pd::gpu::DeviceMemoryPlan small{100, 20, 30};
  EXPECT_TRUE(pd::gpu::checkDeviceFit(small, 200, 50, "cuda:0").ok());
  EXPECT_FALSE(pd::gpu::checkDeviceFit(small, 200, 51, "cuda:0").ok());  // the reserve counts
  EXPECT_FALSE(pd::gpu::checkDeviceFit(small, 40, 100, "cuda:0").ok());  // reserve above free
}

}  // namespace

// --- The KV pool from --gpu_memory_utilization (planKvPool) -----------------------------------

namespace {

pd::ModelConfig deepSeekV3Fp8() {
  auto config = pd::presetConfig("deepseek-v3-layers=61");
  EXPECT_TRUE(config.ok());
  config->quantization = pd::Fp8Quantization{};
  return *config;
}

constexpr std::uint64_t kH200Bytes = 141'000'000'000ULL;
constexpr std::uint64_t kH20Bytes = 96'000'000'000ULL;

// Every byte of the budget is accounted for: the pool is as large as whole blocks allow.
void expectTight(const pd::gpu::KvPoolPlan& p) {
  const std::uint64_t fixed = p.weights + p.workspace + p.graph_reserve + p.runtime_reserve;
  EXPECT_LE(fixed + p.kvPoolBytes(), p.budget);
  EXPECT_GT(fixed + p.kvPoolBytes() + p.block_bytes, p.budget);
}

TEST(KvPoolPlan, BlockBytesForBf16AndFp8WithItsScales) {
  const pd::ModelConfig c = deepSeekV3Fp8();
  ASSERT_EQ(c.kvLayers(), 62);    // 61 layers + the MTP layer
  ASSERT_EQ(c.latentDim(), 576);  // 512 + 64
  EXPECT_EQ(pd::gpu::kvBlockBytes(c, 64, pd::gpu::KvCacheDtype::Bf16), 62ULL * 64 * 576 * 2);
  EXPECT_EQ(pd::gpu::kvBlockBytes(c, 64, pd::gpu::KvCacheDtype::Fp8E4m3), 62ULL * 64 * (576 + 9 * 4));
  EXPECT_EQ(pd::gpu::parseKvCacheDtype("bf16").value(), pd::gpu::KvCacheDtype::Bf16);
  EXPECT_EQ(pd::gpu::parseKvCacheDtype("fp8").value(), pd::gpu::KvCacheDtype::Fp8E4m3);
  EXPECT_EQ(pd::gpu::parseKvCacheDtype("f32").error().code, pd::ErrorCode::InvalidArgument);
}

TEST(KvPoolPlan, RankWeightsSplitTheShardedTensorsOnly) {
  const pd::ModelConfig c = deepSeekV3Fp8();
  const std::uint64_t whole = pd::gpu::checkpointLayoutBytes(c);
  EXPECT_EQ(pd::gpu::rankWeightBytes(c, 1), whole);
  const std::uint64_t tp8 = pd::gpu::rankWeightBytes(c, 8);
  const std::uint64_t tp16 = pd::gpu::rankWeightBytes(c, 16);
  // The replicated part (q_a, kv_a, norms, routers, eh_proj) is about 1.3 GB: each rank holds it whole.
  const std::uint64_t replicated8 = tp8 - whole / 8;
  const std::uint64_t replicated16 = tp16 - whole / 16;
  EXPECT_GT(replicated8, 1'000'000'000ULL);
  EXPECT_LT(replicated8, 1'600'000'000ULL);
  // The same replicated bytes at TP 16 (up to the rounding of each split tensor).
  EXPECT_NEAR(static_cast<double>(replicated16) * 16 / 15, static_cast<double>(replicated8) * 8 / 7, 5e7);
}

TEST(KvPoolPlan, DeepSeekV3Fp8OnH200Tp8) {
  const pd::ModelConfig c = deepSeekV3Fp8();
  pd::gpu::GpuMemoryBudget b;
  b.device_total_bytes = kH200Bytes;
  b.utilization = 0.9;
  b.tp_size = 8;
  auto p = pd::gpu::planKvPool(c, b);
  ASSERT_TRUE(p.ok()) << p.error().toString();
  std::printf("H200 TP8 bf16: %s\n", pd::gpu::describeKvPoolPlan(*p, b).c_str());
  expectTight(*p);
  EXPECT_EQ(p->budget, 126'900'000'000ULL);
  EXPECT_EQ(p->weights, pd::gpu::rankWeightBytes(c, 8));
  // The numbers written in docs/gpu.md ("The GPU memory plan").
  EXPECT_EQ(p->num_blocks, 7768);
  EXPECT_EQ(p->kvTokens(), 7768 * 64);

  b.kv_dtype = pd::gpu::KvCacheDtype::Fp8E4m3;
  auto fp8 = pd::gpu::planKvPool(c, b);
  ASSERT_TRUE(fp8.ok());
  std::printf("H200 TP8 fp8:  %s\n", pd::gpu::describeKvPoolPlan(*fp8, b).c_str());
  expectTight(*fp8);
  EXPECT_EQ(fp8->num_blocks, 14623);  // 1.88 x: 612 bytes a token (codes and scales) against 1152

  b.kv_dtype = pd::gpu::KvCacheDtype::Bf16;
  b.utilization = 0.95;
  auto more = pd::gpu::planKvPool(c, b);
  ASSERT_TRUE(more.ok());
  // 5% of 141 GB more budget is all pool (to a block either way: the remainders differ).
  const auto extra = static_cast<double>((more->budget - p->budget) / p->block_bytes);
  EXPECT_NEAR(static_cast<double>(more->num_blocks - p->num_blocks), extra, 1.0);
}

TEST(KvPoolPlan, DeepSeekV3Fp8OnH20Tp16) {
  const pd::ModelConfig c = deepSeekV3Fp8();
  pd::gpu::GpuMemoryBudget b;
  b.device_total_bytes = kH20Bytes;
  b.utilization = 0.9;
  b.tp_size = 16;
  auto p = pd::gpu::planKvPool(c, b);
  ASSERT_TRUE(p.ok()) << p.error().toString();
  std::printf("H20 TP16 bf16: %s\n", pd::gpu::describeKvPoolPlan(*p, b).c_str());
  expectTight(*p);
  EXPECT_EQ(p->num_blocks, 8373);
  b.kv_dtype = pd::gpu::KvCacheDtype::Fp8E4m3;
  auto fp8 = pd::gpu::planKvPool(c, b);
  ASSERT_TRUE(fp8.ok());
  std::printf("H20 TP16 fp8:  %s\n", pd::gpu::describeKvPoolPlan(*fp8, b).c_str());
  EXPECT_EQ(fp8->num_blocks, 15761);
}

// What a decode worker on a GPU sizes its pool with (model::planGpuKvPool, an automatic
// decode.num_blocks): the plan's blocks for the pool's dtype, and the plan's line for the log.
TEST(KvPoolPlan, TheDecodeWorkersPoolOnAGpuIsThePlans) {
  const pd::ModelConfig c = deepSeekV3Fp8();
  auto bf16 = pd::model::planGpuKvPool(c, kH200Bytes, 0.9, 8, 64, pd::DType::BF16);
  ASSERT_TRUE(bf16.ok()) << bf16.error().toString();
  EXPECT_EQ(bf16->num_blocks, 7768);
  EXPECT_NE(bf16->description.find("KV pool 7768 blocks x 64 tokens"), std::string::npos) << bf16->description;
  auto h20 = pd::model::planGpuKvPool(c, kH20Bytes, 0.9, 16, 64, pd::DType::BF16);
  ASSERT_TRUE(h20.ok());
  EXPECT_EQ(h20->num_blocks, 8373);
  // An F32 pool (decode.kv_dtype f32) mirrors as F32: twice the bytes a block, half the blocks.
  auto f32 = pd::model::planGpuKvPool(c, kH200Bytes, 0.9, 8, 64, pd::DType::F32);
  ASSERT_TRUE(f32.ok());
  EXPECT_NEAR(static_cast<double>(f32->num_blocks), 7768.0 / 2.0, 1.0);
  EXPECT_NE(f32->description.find(", f32,"), std::string::npos) << f32->description;
  // An FP8 pool (decode.kv_dtype fp8): 612 bytes a token against BF16's 1152, so 1.88 x the blocks.
  auto fp8 = pd::model::planGpuKvPool(c, kH200Bytes, 0.9, 8, 64, pd::DType::F8E4M3);
  ASSERT_TRUE(fp8.ok());
  EXPECT_EQ(fp8->num_blocks, 14623);
  EXPECT_EQ(pd::model::planGpuKvPool(c, kH200Bytes, 0.9, 8, 64, pd::DType::I32).error().code,
            pd::ErrorCode::InvalidArgument);
  // H20 at TP8 holds no pool (87 GB of weights in an 86.4 GB budget): refused, naming the parts.
  auto none = pd::model::planGpuKvPool(c, kH20Bytes, 0.9, 8, 64, pd::DType::BF16);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().code, pd::ErrorCode::ResourceExhausted);
}

TEST(KvPoolPlan, TooLittleMemoryNamesEveryPart) {
  const pd::ModelConfig c = deepSeekV3Fp8();
  pd::gpu::GpuMemoryBudget b;
  b.device_total_bytes = kH20Bytes;
  b.tp_size = 8;  // 87 GB of weights on a 96 GB device at 0.9
  auto p = pd::gpu::planKvPool(c, b);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.error().code, pd::ErrorCode::ResourceExhausted);
  for (const char* part : {"86.4 GB of 96.0 GB", "gpu_memory_utilization 0.90", "weights", "tensor parallel 8",
                           "workspace", "CUDA graphs 2.1 GB", "runtime 1.1 GB", "a block needs 4.6 MB"}) {
    EXPECT_NE(p.error().message.find(part), std::string::npos) << "missing '" << part << "' in " << p.error().message;
  }
}

TEST(KvPoolPlan, RefusesUtilizationOutsideZeroToOneAndEmptyShapes) {
  auto tiny = pd::presetConfig("tiny");
  ASSERT_TRUE(tiny.ok());
  pd::gpu::GpuMemoryBudget b;
  b.device_total_bytes = 4'000'000'000ULL;
  b.graph_reserve_bytes = 0;
  b.runtime_reserve_bytes = 0;
  for (double bad : {0.0, -0.1, 1.01, std::nan("")}) {
    b.utilization = bad;
    EXPECT_EQ(pd::gpu::planKvPool(*tiny, b).error().code, pd::ErrorCode::InvalidArgument) << bad;
  }
  b.utilization = 1.0;
  auto whole = pd::gpu::planKvPool(*tiny, b);
  ASSERT_TRUE(whole.ok()) << whole.error().toString();
  EXPECT_EQ(whole->budget, b.device_total_bytes);
  expectTight(*whole);
  b.tp_size = 0;
  EXPECT_EQ(pd::gpu::planKvPool(*tiny, b).error().code, pd::ErrorCode::InvalidArgument);
  b.tp_size = 1;
  b.device_total_bytes = 0;
  EXPECT_EQ(pd::gpu::planKvPool(*tiny, b).error().code, pd::ErrorCode::InvalidArgument);
  b.device_total_bytes = 4'000'000'000ULL;
  b.kv_block_size = 0;
  EXPECT_EQ(pd::gpu::planKvPool(*tiny, b).error().code, pd::ErrorCode::InvalidArgument);
}

}  // namespace
