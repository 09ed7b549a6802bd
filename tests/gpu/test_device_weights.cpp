// Device weights (engine/cuda/device_weights.h) on a real device: the golden tiny-bf16 and
// tiny-fp8 checkpoints uploaded through a small pinned staging buffer (so tensors span chunks
// and chunks hold several tensors) and read back bit-equal, dtypes and shapes kept (FP8 stays
// FP8 beside its F32 block scales); the fit check refusing before any allocation; device memory
// back to its baseline after the weights die. Where no device is visible the program prints why
// and exits 77 (ctest: skipped, never passed).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "device_ops.h"
#include "device_weights.h"
#include "gpu/gpu_test_main.h"
#include "pd/engine/gpu.h"
#include "pd/engine/model_config.h"
#include "pd/engine/safetensors.h"

namespace {

namespace fs = std::filesystem;
using pd::gpu::DeviceWeights;

fs::path golden(const char* name) {
  return fs::path(PD_TEST_DATA_DIR) / "golden" / name;
}

DeviceWeights::Options smallOptions() {
  DeviceWeights::Options o;
  o.serving = pd::gpu::DeviceServingShape{64, 64, pd::DType::BF16, 64, 4096, 8};
  o.staging_bytes = std::uint64_t{1} << 20;  // 512 KiB halves: the tiny models' big tensors span chunks
  return o;
}

void uploadAndReadBack(const char* name, bool expect_fp8) {
  const fs::path dir = golden(name);
  auto ckpt = pd::Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().toString();
  auto config = pd::ModelConfig::load(dir);
  ASSERT_TRUE(config.ok()) << config.error().toString();
  auto weights = DeviceWeights::upload(*ckpt, *config, smallOptions());
  ASSERT_TRUE(weights.ok()) << weights.error().toString();
  const auto host = ckpt->tensors();
  ASSERT_EQ(weights->tensors().size(), host.size());
  EXPECT_GE(weights->deviceBytes(), ckpt->totalTensorBytes());
  std::size_t fp8 = 0;
  std::size_t bigger_than_half = 0;
  for (const pd::TensorView* t : host) {
    const DeviceWeights::Tensor* d = weights->find(t->name);
    ASSERT_NE(d, nullptr) << t->name;
    EXPECT_EQ(d->dtype, t->dtype) << t->name;
    EXPECT_EQ(d->shape, t->shape) << t->name;
    ASSERT_EQ(d->bytes, t->data.size()) << t->name;
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(d->data) % pd::gpu::kDeviceTensorAlignment, 0U) << t->name;
    auto back = weights->readBack(*d);
    ASSERT_TRUE(back.ok()) << back.error().toString();
    ASSERT_EQ(back->size(), t->data.size());
    EXPECT_EQ(std::memcmp(back->data(), t->data.data(), t->data.size()), 0) << t->name << " differs after upload";
    if (t->dtype == pd::DType::F8E4M3) {
      ++fp8;
      const std::string scale = t->name.substr(0, t->name.size() - std::string("weight").size()) + "weight_scale_inv";
      const DeviceWeights::Tensor* s = weights->find(scale);
      ASSERT_NE(s, nullptr) << scale;
      EXPECT_EQ(s->dtype, pd::DType::F32) << scale;
    }
    if (t->data.size() > (std::uint64_t{512} << 10)) ++bigger_than_half;
  }
  EXPECT_EQ(fp8 > 0, expect_fp8) << name;
  EXPECT_GT(bigger_than_half, 0U) << "no tensor spanned two staging chunks";
  std::printf("%s: %zu tensors (%zu FP8, %zu spanning staging chunks) bit-equal after upload\n", name, host.size(), fp8,
              bigger_than_half);
  EXPECT_EQ(weights->find("no.such.tensor"), nullptr);
}

TEST(DeviceWeights, TinyBf16ReadsBackBitEqual) {
  uploadAndReadBack("tiny-bf16", false);
}

TEST(DeviceWeights, TinyFp8StaysFp8AndReadsBackBitEqual) {
  uploadAndReadBack("tiny-fp8", true);
}

TEST(DeviceWeights, TooLargeFailsBeforeAllocatingAndNamesEachPart) {
  const fs::path dir = golden("tiny-bf16");
  auto ckpt = pd::Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok());
  auto config = pd::ModelConfig::load(dir);
  ASSERT_TRUE(config.ok());
  auto before = pd::gpu::deviceMemoryInfo();
  ASSERT_TRUE(before.ok());
  DeviceWeights::Options o = smallOptions();
  o.serving.kv_blocks = std::int64_t{1} << 32;  // a KV pool no device holds (hundreds of TB)
  auto r = DeviceWeights::upload(*ckpt, *config, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, pd::ErrorCode::ResourceExhausted);
  for (const char* part : {"weights", "KV pool", "workspace", "free"}) {
    EXPECT_NE(r.error().message.find(part), std::string::npos) << part << ": " << r.error().message;
  }
  std::printf("%s\n", r.error().message.c_str());
  auto bad =
      DeviceWeights::upload(*ckpt, *config, DeviceWeights::Options{.device = {pd::gpu::ModelDevice::Kind::Cuda, 4096}});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, pd::ErrorCode::InvalidArgument);
}

TEST(DeviceWeights, DeviceMemoryReturnsToItsBaseline) {
  const fs::path dir = golden("tiny-fp8");
  auto ckpt = pd::Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok());
  auto config = pd::ModelConfig::load(dir);
  ASSERT_TRUE(config.ok());
  {  // warm-up: the context and the runtime's own allocations
    auto w = DeviceWeights::upload(*ckpt, *config, smallOptions());
    ASSERT_TRUE(w.ok()) << w.error().toString();
  }
  auto baseline = pd::gpu::deviceMemoryInfo();
  ASSERT_TRUE(baseline.ok());
  for (int i = 0; i < 20; ++i) {
    auto w = DeviceWeights::upload(*ckpt, *config, smallOptions());
    ASSERT_TRUE(w.ok()) << w.error().toString();
  }
  auto after = pd::gpu::deviceMemoryInfo();
  ASSERT_TRUE(after.ok());
  // Other processes may allocate meanwhile; this one's 20 arenas (each the model's size) may not.
  const std::int64_t lost = static_cast<std::int64_t>(baseline->free) - static_cast<std::int64_t>(after->free);
  std::printf("free device memory: %llu before, %llu after 20 uploads\n",
              static_cast<unsigned long long>(baseline->free), static_cast<unsigned long long>(after->free));
  EXPECT_LT(lost, static_cast<std::int64_t>(ckpt->totalTensorBytes())) << "device memory leaked";
}

}  // namespace

int main(int argc, char** argv) {
  return pd::testutil::runGpuTests(argc, argv, "the device weight tests");
}
