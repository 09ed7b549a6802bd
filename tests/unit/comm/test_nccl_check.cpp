// NCCL results through PD_CUDA_STATUS: the codes a caller acts on and the message's parts.
#include <gtest/gtest.h>

#include <string>

#include "nccl_handles.h"

namespace {

using pd::ErrorCode;

ncclResult_t returnResult(ncclResult_t result) {
  return result;
}

TEST(NcclCheck, FailureNamesCallReasonFileAndLine) {
  const int line = __LINE__ + 1;
  const pd::Status status = PD_CUDA_STATUS(returnResult(ncclRemoteError));
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.error().code, ErrorCode::PeerFailed);
  EXPECT_EQ(status.error().message,
            "returnResult(ncclRemoteError) failed: " + std::string(ncclGetErrorString(ncclRemoteError)) +
                " at test_nccl_check.cpp:" + std::to_string(line));
}

TEST(NcclCheck, CodesSayWhatTheCallerCanDo) {
  EXPECT_TRUE(PD_CUDA_STATUS(returnResult(ncclSuccess)).ok());
  EXPECT_EQ(PD_CUDA_STATUS(returnResult(ncclSystemError)).error().code, ErrorCode::PeerFailed);
  EXPECT_EQ(PD_CUDA_STATUS(returnResult(ncclInvalidArgument)).error().code, ErrorCode::InvalidArgument);
  EXPECT_EQ(PD_CUDA_STATUS(returnResult(ncclInvalidUsage)).error().code, ErrorCode::InvalidArgument);
  EXPECT_EQ(PD_CUDA_STATUS(returnResult(ncclInternalError)).error().code, ErrorCode::Internal);
}

}  // namespace
