// The CUDA owners on a device: streams, events, device and pinned buffers, cuBLAS handles.
// Every test skips, saying why, where no CUDA device is visible.
#include <cublas_v2.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

#include "pd/cuda/cuda_handles.h"

namespace {

#define PD_SKIP_WITHOUT_DEVICE()                                                \
  do {                                                                          \
    if (pd::cuda::deviceCount() == 0) GTEST_SKIP() << "no CUDA device visible"; \
    ASSERT_TRUE(PD_CUDA_STATUS(cudaSetDevice(0)).ok());                         \
  } while (false)

TEST(CudaHandles, DeviceBufferRoundTripsThroughPinnedMemory) {
  PD_SKIP_WITHOUT_DEVICE();
  auto stream = pd::cuda::Stream::create();
  ASSERT_TRUE(stream.ok()) << stream.error().toString();
  auto pinned = pd::cuda::PinnedHostBuffer<int>::create(4096);
  ASSERT_TRUE(pinned.ok()) << pinned.error().toString();
  std::iota(pinned->data(), pinned->data() + pinned->size(), -7);
  auto device = pd::cuda::DeviceBuffer<int>::create(4096);
  ASSERT_TRUE(device.ok()) << device.error().toString();
  ASSERT_TRUE(device->copyFromHost(pinned->span(), *stream).ok());
  std::vector<int> back(4096, 0);
  ASSERT_TRUE(device->copyToHost(back, *stream).ok());
  ASSERT_TRUE(stream->synchronize().ok());
  for (int i = 0; i < 4096; ++i) ASSERT_EQ(back[static_cast<size_t>(i)], i - 7) << i;
}

TEST(CudaHandles, CopiesLargerThanTheBufferAreRefused) {
  PD_SKIP_WITHOUT_DEVICE();
  auto stream = pd::cuda::Stream::create();
  ASSERT_TRUE(stream.ok());
  auto device = pd::cuda::DeviceBuffer<float>::create(2);
  ASSERT_TRUE(device.ok());
  std::vector<float> three(3, 1.0F);
  EXPECT_EQ(device->copyFromHost(three, *stream).error().code, pd::ErrorCode::InvalidArgument);
  EXPECT_EQ(device->copyToHost(three, *stream).error().code, pd::ErrorCode::InvalidArgument);
}

TEST(CudaHandles, EventOrdersTwoStreams) {
  PD_SKIP_WITHOUT_DEVICE();
  auto producer = pd::cuda::Stream::create();
  auto consumer = pd::cuda::Stream::create();
  auto ready = pd::cuda::Event::create();
  ASSERT_TRUE(producer.ok() && consumer.ok() && ready.ok());
  auto device = pd::cuda::DeviceBuffer<float>::create(1 << 20);
  ASSERT_TRUE(device.ok());
  std::vector<float> in(1 << 20, 2.5F);
  ASSERT_TRUE(device->copyFromHost(in, *producer).ok());
  ASSERT_TRUE(ready->record(*producer).ok());
  ASSERT_TRUE(ready->waitOn(*consumer).ok());
  std::vector<float> out(1 << 20, 0.0F);
  ASSERT_TRUE(device->copyToHost(out, *consumer).ok());
  ASSERT_TRUE(consumer->synchronize().ok());
  ASSERT_TRUE(ready->synchronize().ok());
  EXPECT_EQ(out, in);
}

TEST(CudaHandles, BlasHandleRunsOnItsStream) {
  PD_SKIP_WITHOUT_DEVICE();
  auto stream = pd::cuda::Stream::create();
  ASSERT_TRUE(stream.ok());
  auto blas = pd::cuda::BlasHandle::create(*stream);
  ASSERT_TRUE(blas.ok()) << blas.error().toString();
  std::vector<float> x{1, 2, 3, 4};
  std::vector<float> y{10, 20, 30, 40};
  auto dx = pd::cuda::DeviceBuffer<float>::create(4);
  auto dy = pd::cuda::DeviceBuffer<float>::create(4);
  ASSERT_TRUE(dx.ok() && dy.ok());
  ASSERT_TRUE(dx->copyFromHost(x, *stream).ok());
  ASSERT_TRUE(dy->copyFromHost(y, *stream).ok());
  const float alpha = 0.5F;
  ASSERT_TRUE(PD_CUDA_STATUS(cublasSaxpy(blas->get(), 4, &alpha, dx->data(), 1, dy->data(), 1)).ok());
  ASSERT_TRUE(dy->copyToHost(y, *stream).ok());
  ASSERT_TRUE(stream->synchronize().ok());
  EXPECT_EQ(y, (std::vector<float>{10.5F, 21.0F, 31.5F, 42.0F}));
}

// The graph redoes its captured work (a cuBLAS call and a copy) on whatever the buffers hold at
// each replay, and nothing of the body runs during the capture itself.
TEST(CudaHandles, GraphReplaysItsCapturedWorkOnTheBuffersCurrentContents) {
  PD_SKIP_WITHOUT_DEVICE();
  auto stream = pd::cuda::Stream::create();
  ASSERT_TRUE(stream.ok());
  auto blas = pd::cuda::BlasHandle::create(*stream);
  ASSERT_TRUE(blas.ok()) << blas.error().toString();
  auto workspace = pd::cuda::DeviceBuffer<std::byte>::create(std::size_t{4} << 20);
  ASSERT_TRUE(workspace.ok());
  ASSERT_TRUE(PD_CUDA_STATUS(cublasSetWorkspace(blas->get(), workspace->data(), workspace->bytes())).ok());
  auto dx = pd::cuda::DeviceBuffer<float>::create(4);
  auto dy = pd::cuda::DeviceBuffer<float>::create(4);
  auto dz = pd::cuda::DeviceBuffer<float>::create(4);
  ASSERT_TRUE(dx.ok() && dy.ok() && dz.ok());
  std::vector<float> x{1, 2, 3, 4};
  std::vector<float> y{10, 20, 30, 40};
  ASSERT_TRUE(dx->copyFromHost(x, *stream).ok());
  ASSERT_TRUE(dy->copyFromHost(y, *stream).ok());
  ASSERT_TRUE(stream->synchronize().ok());
  const float alpha = 2.0F;
  auto graph = pd::cuda::Graph::capture(*stream, [&]() -> pd::Status {
    PD_CUDA_TRY(cublasSaxpy(blas->get(), 4, &alpha, dx->data(), 1, dy->data(), 1));  // y += 2 x
    PD_CUDA_TRY(cudaMemcpyAsync(dz->data(), dy->data(), dy->bytes(), cudaMemcpyDeviceToDevice, stream->get()));
    return pd::okStatus();
  });
  ASSERT_TRUE(graph.ok()) << graph.error().toString();
  std::vector<float> z(4, 0.0F);
  ASSERT_TRUE(dy->copyToHost(z, *stream).ok());
  ASSERT_TRUE(stream->synchronize().ok());
  EXPECT_EQ(z, y) << "the capture ran the body";
  ASSERT_TRUE(graph->launch(*stream).ok());
  ASSERT_TRUE(dz->copyToHost(z, *stream).ok());
  ASSERT_TRUE(stream->synchronize().ok());
  EXPECT_EQ(z, (std::vector<float>{12, 24, 36, 48}));
  x = {100, 0, 0, 1};  // new contents, same buffers
  ASSERT_TRUE(dx->copyFromHost(x, *stream).ok());
  ASSERT_TRUE(graph->launch(*stream).ok());
  ASSERT_TRUE(dz->copyToHost(z, *stream).ok());
  ASSERT_TRUE(stream->synchronize().ok());
  EXPECT_EQ(z, (std::vector<float>{212, 24, 36, 50}));
}

// A body that fails (here: a synchronize, which a capture forbids) gives its error, and the
// stream is usable afterwards.
TEST(CudaHandles, AFailedCaptureEndsTheCaptureAndReportsTheError) {
  PD_SKIP_WITHOUT_DEVICE();
  auto stream = pd::cuda::Stream::create();
  ASSERT_TRUE(stream.ok());
  auto graph = pd::cuda::Graph::capture(*stream, [&]() { return stream->synchronize(); });
  EXPECT_FALSE(graph.ok());
  // The failure was reported; the next launch check (cudaGetLastError) must not see it again.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  auto refused = pd::cuda::Graph::capture(
      *stream, [] { return pd::makeError(pd::ErrorCode::InvalidArgument, "the body's own error"); });
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, pd::ErrorCode::InvalidArgument);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusActive;
  ASSERT_TRUE(PD_CUDA_STATUS(cudaStreamIsCapturing(stream->get(), &capturing)).ok());
  EXPECT_EQ(capturing, cudaStreamCaptureStatusNone);
  auto device = pd::cuda::DeviceBuffer<int>::create(3);
  ASSERT_TRUE(device.ok());
  std::vector<int> in{1, 2, 3};
  std::vector<int> out(3, 0);
  ASSERT_TRUE(device->copyFromHost(in, *stream).ok());
  ASSERT_TRUE(device->copyToHost(out, *stream).ok());
  ASSERT_TRUE(stream->synchronize().ok());
  EXPECT_EQ(out, in);
}

// A failed call reported through PD_CUDA_TRY leaves no stale "last error" behind, which the next
// kernel launch's check would otherwise report as its own failure.
TEST(CudaHandles, AReportedFailureLeavesNoStaleErrorForTheNextLaunchCheck) {
  PD_SKIP_WITHOUT_DEVICE();
  auto huge = pd::cuda::DeviceBuffer<std::uint8_t>::create(std::size_t{1} << 50);  // 1 PiB (plain cudaMalloc)
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.error().code, pd::ErrorCode::ResourceExhausted) << huge.error().toString();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
