#include <cuda_runtime.h>

#include "gpu_kernels.h"

namespace pd::gpu::kernels {
namespace {

constexpr int kAxpyThreads = 256;

__global__ void __launch_bounds__(kAxpyThreads) axpyKernel(float a, const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}

}  // namespace

cudaError_t launchAxpy(float a, const float* x, float* y, int n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  axpyKernel<<<(n + kAxpyThreads - 1) / kAxpyThreads, kAxpyThreads, 0, stream>>>(a, x, y, n);
  return cudaGetLastError();
}

}  // namespace pd::gpu::kernels
