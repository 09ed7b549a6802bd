// --model.device: parsing and the device check (test_model_device_cli.cpp runs pdserve with it).
#include <gtest/gtest.h>

#include <string>

#include "pd/engine/cuda_engine.h"
#include "pd/engine/gpu.h"
#include "pd/engine/serving_engine.h"

namespace {

using pd::gpu::ModelDevice;

TEST(ModelDevice, ParsesCpuCudaAndCudaIndex) {
  EXPECT_EQ(*pd::gpu::parseModelDevice("cpu"), ModelDevice{});
  EXPECT_EQ(*pd::gpu::parseModelDevice("cuda"), (ModelDevice{ModelDevice::Kind::Cuda, 0}));
  EXPECT_EQ(*pd::gpu::parseModelDevice("cuda:3"), (ModelDevice{ModelDevice::Kind::Cuda, 3}));
  EXPECT_EQ(pd::gpu::modelDeviceName(ModelDevice{ModelDevice::Kind::Cuda, 3}), "cuda:3");
  for (const char* bad : {"", "gpu", "CUDA", "cuda:", "cuda:-1", "cuda:1x", "cuda:99999999999", " cpu"}) {
    auto d = pd::gpu::parseModelDevice(bad);
    ASSERT_FALSE(d.ok()) << "'" << bad << "'";
    EXPECT_EQ(d.error().code, pd::ErrorCode::InvalidArgument);
    EXPECT_NE(d.error().message.find("cpu, cuda, cuda:N"), std::string::npos) << d.error().message;
  }
}

TEST(ModelDevice, CpuIsAlwaysFineCudaNeedsADevice) {
  EXPECT_TRUE(pd::gpu::checkModelDevice(ModelDevice{}).ok());
  const auto cuda = pd::gpu::checkModelDevice(ModelDevice{ModelDevice::Kind::Cuda, 0});
  if (pd::gpu::deviceCount() == 0) {
    ASSERT_FALSE(cuda.ok());
    EXPECT_EQ(cuda.error().code, pd::ErrorCode::Unsupported);
    EXPECT_NE(cuda.error().message.find("no CUDA device"), std::string::npos) << cuda.error().message;
    // The CUDA engine's factory says the same, before it reads anything.
    auto engine = pd::model::createCudaEngine("/nonexistent-model", {});
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.error().code, pd::ErrorCode::Unsupported);
    EXPECT_NE(engine.error().message.find("no CUDA device"), std::string::npos) << engine.error().message;
  } else {
    EXPECT_TRUE(cuda.ok()) << cuda.error().toString();
    const auto past = pd::gpu::checkModelDevice(ModelDevice{ModelDevice::Kind::Cuda, pd::gpu::deviceCount()});
    ASSERT_FALSE(past.ok());
    EXPECT_EQ(past.error().code, pd::ErrorCode::InvalidArgument);
  }
}

// The batch-invariant mode exists on the CPU engine only: asking for it on CUDA is refused before
// anything loads (GPU or not), and the model folder is never read.
TEST(ModelDevice, BatchInvariantOnCudaIsUnsupported) {
  auto loaded = pd::model::loadServingEngine("/nonexistent-model-folder", 1, nullptr,
                                             ModelDevice{ModelDevice::Kind::Cuda, 0}, true);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.error().code, pd::ErrorCode::Unsupported);
  EXPECT_NE(loaded.error().message.find("batch-invariant"), std::string::npos) << loaded.error().message;
}

TEST(ModelDevice, ParsesNumerics) {
  EXPECT_EQ(*pd::gpu::parseNumerics("fp32"), pd::gpu::Numerics::Fp32);
  EXPECT_EQ(*pd::gpu::parseNumerics("bf16"), pd::gpu::Numerics::Bf16);
  EXPECT_STREQ(pd::gpu::numericsName(pd::gpu::Numerics::Bf16), "bf16");
  EXPECT_STREQ(pd::gpu::numericsName(pd::gpu::Numerics::Fp32), "fp32");
  for (const char* bad : {"", "fp16", "BF16", "bf16 "}) {
    const auto n = pd::gpu::parseNumerics(bad);
    ASSERT_FALSE(n.ok()) << bad;
    EXPECT_EQ(n.error().code, pd::ErrorCode::InvalidArgument);
  }
}

// createCudaEngine itself refuses the batch-invariant mode, first, in every build (with CUDA or
// without, with a device or without): the one place that check lives.
TEST(ModelDevice, CreateCudaEngineRefusesTheBatchInvariantModeFirst) {
  pd::model::CudaEngineOptions options;
  options.batch_invariant = true;
  const auto engine = pd::model::createCudaEngine("/nonexistent-model-folder", options);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.error().code, pd::ErrorCode::Unsupported);
  EXPECT_NE(engine.error().message.find("batch-invariant"), std::string::npos) << engine.error().message;
}

// The numerics modes are the CUDA engine's: asking the CPU engine for bf16 is refused before the
// model folder is read.
TEST(ModelDevice, Bf16NumericsOnTheCpuEngineAreInvalidArgument) {
  auto loaded = pd::model::loadServingEngine("/nonexistent-model-folder", 1, nullptr, ModelDevice{}, false,
                                             pd::gpu::Numerics::Bf16);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.error().code, pd::ErrorCode::InvalidArgument);
  EXPECT_NE(loaded.error().message.find("model.numerics bf16"), std::string::npos) << loaded.error().message;
}

}  // namespace
