#include "pd/cuda/cuda_check.h"

#include <fmt/format.h>

namespace pd::cuda {

Error callError(ErrorCode code, std::string_view call, std::string_view why, std::string_view file, int line) {
  const std::size_t slash = file.find_last_of('/');
  if (slash != std::string_view::npos) file.remove_prefix(slash + 1);
  return makeError(code, fmt::format("{} failed: {} at {}:{}", call, why, file, line));
}

Status checkCall(cudaError_t status, std::string_view call, std::string_view file, int line) {
  if (status == cudaSuccess) return okStatus();
  // A failed call also sets the thread's last error, which a later launch check
  // (PD_CUDA_TRY(cudaGetLastError())) would report as its own: this failure is reported here, so
  // clear it (a sticky error, which breaks the context, stays set whatever is done).
  (void)cudaGetLastError();
  ErrorCode code = ErrorCode::Internal;
  switch (status) {
    case cudaErrorMemoryAllocation:
      code = ErrorCode::ResourceExhausted;
      break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNotSupported:
      code = ErrorCode::Unsupported;
      break;
    case cudaErrorInvalidValue:
      code = ErrorCode::InvalidArgument;
      break;
    default:
      break;
  }
  return callError(code, call, fmt::format("{} ({})", cudaGetErrorString(status), cudaGetErrorName(status)), file,
                   line);
}

}  // namespace pd::cuda
