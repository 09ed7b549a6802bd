#pragma once
/// One check for every CUDA runtime, cuBLAS and NCCL call: PD_CUDA_STATUS(call) evaluates the
/// call and turns a failure into an Error naming the call, the reason, the file and the line:
///   "cudaMalloc(&ptr, bytes) failed: out of memory (cudaErrorMemoryAllocation) at gpu_cuda.cpp:42"
/// PD_CUDA_TRY(call) returns that Error from the enclosing function. Kernel launches are checked
/// with PD_CUDA_TRY(cudaGetLastError()) right after the launch.
///
/// A status type takes part through an overload of pd::cuda::checkCall visible where the macro
/// is used: this header has cudaError_t and cublasStatus_t; comm/cuda/nccl_handles.h adds
/// ncclResult_t. The ErrorCode says what a caller can do: out of memory -> ResourceExhausted,
/// no device or driver -> Unsupported, a peer's failure (NCCL) -> PeerFailed, else Internal.
/// Thread rules: pure functions.

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <string_view>

#include "pd/common/result.h"

namespace pd::cuda {

/// "<call> failed: <why> at <file's last component>:<line>" with `code`.
[[nodiscard]] Error callError(ErrorCode code, std::string_view call, std::string_view why, std::string_view file,
                              int line);

[[nodiscard]] Status checkCall(cudaError_t status, std::string_view call, std::string_view file, int line);
[[nodiscard]] Status checkCall(cublasStatus_t status, std::string_view call, std::string_view file, int line);

}  // namespace pd::cuda

/// Status of one CUDA / cuBLAS / NCCL call (see the file comment).
#define PD_CUDA_STATUS(call) ::pd::cuda::checkCall((call), #call, __FILE__, __LINE__)
/// Returns the failure of one CUDA / cuBLAS / NCCL call from the enclosing function.
#define PD_CUDA_TRY(call) PD_TRY(PD_CUDA_STATUS(call))
