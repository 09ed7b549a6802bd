// The device memory plan: checkpoint bytes against real checkpoints, the KV pool arithmetic, and
// the error a user gets when the model does not fit.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "device_memory_plan.h"
#include "pd/engine/model_factory.h"
#include "pd/engine/safetensors.h"

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

  shape.kv_dtype = pd::DType::F8E4M3;
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
