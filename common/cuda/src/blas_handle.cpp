// cuBLAS's half of cuda_check.h and cuda_handles.h, in its own file so that a binary that never
// uses cuBLAS does not pull libcublas in.
#include <cublas_v2.h>
#include <fmt/format.h>

#include "pd/cuda/cuda_check.h"
#include "pd/cuda/cuda_handles.h"

namespace pd::cuda {

Status checkCall(cublasStatus_t status, std::string_view call, std::string_view file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return okStatus();
  ErrorCode code = ErrorCode::Internal;
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      code = ErrorCode::ResourceExhausted;
      break;
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      code = ErrorCode::Unsupported;
      break;
    case CUBLAS_STATUS_INVALID_VALUE:
      code = ErrorCode::InvalidArgument;
      break;
    default:
      break;
  }
  return callError(code, call, cublasGetStatusString(status), file, line);
}

Result<BlasHandle> BlasHandle::create(const Stream& stream) {
  cublasHandle_t handle = nullptr;
  PD_CUDA_TRY(cublasCreate(&handle));
  BlasHandle owner(handle);
  PD_CUDA_TRY(cublasSetStream(owner.get(), stream.get()));
  return owner;
}

void BlasHandle::Deleter::operator()(cublasHandle_t handle) const noexcept {
  detail::logReleaseFailure(PD_CUDA_STATUS(cublasDestroy(handle)));
}

}  // namespace pd::cuda
