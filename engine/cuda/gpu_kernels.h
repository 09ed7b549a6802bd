#pragma once
// The boundary between C++20 host code (gpu_cuda.cpp: owners, checks, copies) and the
// nvcc-compiled kernels (gpu_kernels.cu, C++17): launches only, each returning the launch's
// status (cudaGetLastError) for the caller to check.

#include <cuda_runtime_api.h>

namespace pd::gpu::kernels {

/// Queues y[i] += a * x[i] for i < n on `stream` (device pointers).
cudaError_t launchAxpy(float a, const float* x, float* y, int n, cudaStream_t stream);

}  // namespace pd::gpu::kernels
