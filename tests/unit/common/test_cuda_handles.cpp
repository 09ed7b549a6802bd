// The CUDA owners on a device: streams, events, device and pinned buffers, cuBLAS handles.
// Every test skips, saying why, where no CUDA device is visible.
#include <cublas_v2.h>
#include <gtest/gtest.h>

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

}  // namespace
