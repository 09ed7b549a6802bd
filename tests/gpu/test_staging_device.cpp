// The staging KV path on a GPU (label gpu; docs/kv-transfer.md, "Staging path"): a prompt's latent
// KV in device memory on the prefill side moves device -> pinned staging -> UCX (tcp) -> pinned
// staging -> device pool through two StagingTransports with CUDA copiers, and lands bit-exact in the
// pool blocks the decode side granted, with every other block untouched. Where no device is visible
// the program says so and exits 77 (ctest: skipped, never passed).
#include <gtest/gtest.h>

#include <cstdio>

#include "gpu/gpu_test_main.h"
#include "pd/cuda/cuda_handles.h"
#include "pd/kvtransfer/staging_transport.h"
#include "pd/kvtransfer/ucx_transport.h"
#include "unit/kvtransfer/kv_test_util.h"

namespace pd::kvtransfer {
namespace {

std::unique_ptr<StagingTransport> stagingOverUcx(const CompatInfo& compat, const char* name,
                                                 StagingTransportOptions staging) {
  UcxTransportOptions options;
  options.ucx_tls = "tcp";
  options.compat = compat;
  options.connect_timeout = testutil::kHangGuard;
  options.name = name;
  auto ucx = createUcxTransport(options);
  EXPECT_TRUE(ucx.ok()) << ucx.error().toString();
  if (!ucx.ok()) return nullptr;
  std::printf("%s: UCX %s GPU memory\n", name,
              (*ucx)->capabilities().registers_device_memory ? "registers" : "cannot register");
  auto copier = createCudaCopier();
  EXPECT_TRUE(copier.ok()) << copier.error().toString();
  if (!copier.ok()) return nullptr;
  auto t = createStagingTransport(std::move(ucx).value(), std::move(copier).value(), staging);
  EXPECT_TRUE(t.ok()) << t.error().toString();
  return t.ok() ? std::move(t).value() : nullptr;
}

TEST(StagingDevice, APromptMovesDeviceToDeviceBitExact) {
  const CompatInfo compat = testutil::realCompat();
  constexpr std::uint32_t kTokens = 1000;  // the last block partly filled
  constexpr std::uint32_t kPoolBlocks = 40;
  const std::uint64_t tb = compat.tokenBytes();
  const std::uint64_t block_bytes = std::uint64_t{compat.block_size} * tb;
  const std::uint32_t needed = (kTokens + compat.block_size - 1) / compat.block_size;

  auto stream = cuda::Stream::create();
  ASSERT_TRUE(stream.ok()) << stream.error().toString();
  testutil::SourceKv source(compat, kTokens, 77);
  auto device_source = cuda::DeviceBuffer<std::byte>::create(source.bytes.size());
  ASSERT_TRUE(device_source.ok()) << device_source.error().toString();
  ASSERT_TRUE(device_source->copyFromHost(std::span<const std::byte>(source.bytes), *stream).ok());
  const std::uint64_t pool_bytes = block_bytes * kPoolBlocks * compat.num_layers;
  auto device_pool = cuda::DeviceBuffer<std::byte>::create(pool_bytes);
  ASSERT_TRUE(device_pool.ok()) << device_pool.error().toString();
  ASSERT_EQ(cudaMemsetAsync(device_pool->data(), static_cast<int>(testutil::kUntouched), pool_bytes, stream->get()),
            cudaSuccess);
  ASSERT_TRUE(stream->synchronize().ok());

  StagingTransportOptions send;
  send.send_bytes = std::uint64_t{compat.num_layers} * kTokens * tb;
  StagingTransportOptions receive;
  receive.receive_blocks = needed;
  auto sender = stagingOverUcx(compat, "prefill", send);
  auto receiver = stagingOverUcx(compat, "decode", receive);
  ASSERT_TRUE(sender && receiver);

  const RegionId pool_region = receiver->registerRegion({device_pool->data(), pool_bytes}).value();
  const RegionLayout layout{pool_region, 0, 0, compat.num_layers, block_bytes * kPoolBlocks, block_bytes};
  auto target = receiver->exportTarget(0, std::span(&layout, 1));
  ASSERT_TRUE(target.ok()) << target.error().toString();
  KvDescriptor asked;
  asked.compat = compat;
  asked.num_tokens = kTokens;
  asked.timeout_ms = testutil::kHangGuardMs;
  asked.block_ids = testutil::shuffledBlocks(kPoolBlocks, needed, 77);
  asked.targets = {*target};
  testutil::Outcomes out;
  ASSERT_TRUE(receiver->expect(1, Clock::now() + testutil::kHangGuard, out.onArrival()).ok());
  auto granted = receiver->grant(1, asked);
  ASSERT_TRUE(granted.ok()) << granted.error().toString();

  const RegionId src = sender->registerRegion({device_source->data(), source.bytes.size()}).value();
  const auto start = Clock::now();
  ASSERT_TRUE(sender->beginTransfer(*granted, Clock::now() + testutil::kHangGuard, out.onDone()).ok());
  for (std::uint32_t first = 0; first < kTokens; first += 64) {
    ASSERT_TRUE(sender->put(granted->transfer_id, source.chunkPuts(src, first, std::min(64U, kTokens - first))).ok());
  }
  CompletionRecord rec;
  rec.transfer_id = granted->transfer_id;
  rec.num_tokens = kTokens;
  rec.first_token = 5;
  ASSERT_TRUE(sender->finish(rec).ok());
  const auto arrived = out.waitArrival(1, testutil::kHangGuard);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  ASSERT_TRUE(arrived.has_value());
  ASSERT_TRUE(arrived->ok()) << arrived->error().toString();
  const auto done = out.waitDone(granted->transfer_id.lo, testutil::kHangGuard);
  ASSERT_TRUE(done && done->ok());
  std::printf("device -> device over the staging path: %.1f MB in %.1f ms\n",
              static_cast<double>(send.send_bytes) / 1e6, ms);

  std::vector<std::byte> pool(pool_bytes);
  ASSERT_TRUE(device_pool->copyToHost(std::span<std::byte>(pool), *stream).ok());
  ASSERT_TRUE(stream->synchronize().ok());
  std::vector<bool> used(kPoolBlocks, false);
  for (const std::uint32_t b : asked.block_ids) used[b] = true;
  std::uint64_t wrong = 0;
  std::uint64_t stray = 0;
  for (std::uint32_t l = 0; l < compat.num_layers; ++l) {
    for (std::uint32_t t = 0; t < kTokens; ++t) {
      const std::byte* got = pool.data() +
                             (std::uint64_t{l} * kPoolBlocks + asked.block_ids[t / compat.block_size]) * block_bytes +
                             std::uint64_t{t % compat.block_size} * tb;
      wrong += std::memcmp(got, source.tokenPtr(l, t), tb) != 0;
    }
    for (std::uint32_t b = 0; b < kPoolBlocks; ++b) {
      if (used[b]) continue;
      const std::byte* p = pool.data() + (std::uint64_t{l} * kPoolBlocks + b) * block_bytes;
      stray += std::count_if(p, p + block_bytes, [](std::byte x) { return x != testutil::kUntouched; });
    }
  }
  EXPECT_EQ(wrong, 0U) << "tokens that differ from the prefill side's";
  EXPECT_EQ(stray, 0U) << "bytes written outside the granted blocks";
  EXPECT_TRUE(sender->deregisterRegion(src).ok());
  EXPECT_TRUE(receiver->deregisterRegion(pool_region).ok());
}

}  // namespace
}  // namespace pd::kvtransfer

int main(int argc, char** argv) {
  return pd::testutil::runGpuTests(argc, argv, "the staging path device test");
}
