// PD_CUDA_STATUS / PD_CUDA_TRY and the buffer owners' checks that need no device.
#include <cublas_api.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <limits>
#include <string>

#include "pd/cuda/cuda_check.h"
#include "pd/cuda/cuda_handles.h"

namespace {

using pd::ErrorCode;

cudaError_t returnStatus(cudaError_t status) {
  return status;
}

TEST(CudaCheck, FailureNamesCallReasonFileAndLine) {
  const int line = __LINE__ + 1;
  const pd::Status status = PD_CUDA_STATUS(returnStatus(cudaErrorMemoryAllocation));
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.error().code, ErrorCode::ResourceExhausted);
  EXPECT_EQ(status.error().message, "returnStatus(cudaErrorMemoryAllocation) failed: " +
                                        std::string(cudaGetErrorString(cudaErrorMemoryAllocation)) +
                                        " (cudaErrorMemoryAllocation) at test_cuda_check.cpp:" + std::to_string(line));
}

TEST(CudaCheck, SuccessIsOk) {
  EXPECT_TRUE(PD_CUDA_STATUS(returnStatus(cudaSuccess)).ok());
}

TEST(CudaCheck, CodesSayWhatTheCallerCanDo) {
  EXPECT_EQ(PD_CUDA_STATUS(returnStatus(cudaErrorNoDevice)).error().code, ErrorCode::Unsupported);
  EXPECT_EQ(PD_CUDA_STATUS(returnStatus(cudaErrorInsufficientDriver)).error().code, ErrorCode::Unsupported);
  EXPECT_EQ(PD_CUDA_STATUS(returnStatus(cudaErrorInvalidValue)).error().code, ErrorCode::InvalidArgument);
  EXPECT_EQ(PD_CUDA_STATUS(returnStatus(cudaErrorLaunchFailure)).error().code, ErrorCode::Internal);
}

pd::Status tryTwice(cudaError_t first, int& reached) {
  PD_CUDA_TRY(returnStatus(first));
  ++reached;
  return pd::okStatus();
}

TEST(CudaCheck, TryReturnsTheFirstFailure) {
  int reached = 0;
  EXPECT_TRUE(tryTwice(cudaSuccess, reached).ok());
  EXPECT_EQ(reached, 1);
  const pd::Status failed = tryTwice(cudaErrorInvalidDevice, reached);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(reached, 1);
  EXPECT_NE(failed.error().message.find("returnStatus(first) failed: "), std::string::npos) << failed.error().message;
}

cublasStatus_t returnBlas(cublasStatus_t status) {
  return status;
}

TEST(CudaCheck, CublasStatusesGoThroughTheSameCheck) {
  const pd::Status status = PD_CUDA_STATUS(returnBlas(CUBLAS_STATUS_ALLOC_FAILED));
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.error().code, ErrorCode::ResourceExhausted);
  EXPECT_EQ(status.error().message.rfind("returnBlas(CUBLAS_STATUS_ALLOC_FAILED) failed: ", 0), 0U)
      << status.error().message;
  EXPECT_EQ(PD_CUDA_STATUS(returnBlas(CUBLAS_STATUS_NOT_SUPPORTED)).error().code, ErrorCode::Unsupported);
  EXPECT_TRUE(PD_CUDA_STATUS(returnBlas(CUBLAS_STATUS_SUCCESS)).ok());
}

TEST(CudaBuffers, ByteCountOverflowIsRefusedBeforeAnyCudaCall) {
  const auto huge = std::numeric_limits<std::size_t>::max() / 4;
  auto device = pd::cuda::DeviceBuffer<double>::create(huge);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.error().code, ErrorCode::InvalidArgument);
  auto pinned = pd::cuda::PinnedHostBuffer<double>::create(huge);
  ASSERT_FALSE(pinned.ok());
  EXPECT_EQ(pinned.error().code, ErrorCode::InvalidArgument);
}

TEST(CudaBuffers, EmptyBuffersNeedNoDevice) {
  auto device = pd::cuda::DeviceBuffer<float>::create(0);
  ASSERT_TRUE(device.ok()) << device.error().toString();
  EXPECT_EQ(device->size(), 0U);
  EXPECT_EQ(device->data(), nullptr);
  EXPECT_EQ(pd::cuda::DeviceBuffer<float>{}.size(), 0U);
}

TEST(CudaBuffers, WithoutADeviceAllocationSaysUnsupportedAndNamesTheCall) {
  if (pd::cuda::deviceCount() > 0) GTEST_SKIP() << "a CUDA device is visible; test_cuda_handles covers it";
  auto device = pd::cuda::DeviceBuffer<float>::create(16);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.error().code, ErrorCode::Unsupported) << device.error().toString();
  EXPECT_EQ(device.error().message.rfind("cudaMalloc(&ptr, bytes) failed: ", 0), 0U) << device.error().message;
  EXPECT_NE(device.error().message.find("cuda_handles.h:"), std::string::npos) << device.error().message;
}

}  // namespace
