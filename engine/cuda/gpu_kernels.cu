#include <cuda_runtime.h>

#include "gpu_kernels.h"

namespace pd::gpu::kernels {
namespace {

__global__ void axpyKernel(float a, const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}

// Owns one device allocation; frees it on scope exit (never throws).
struct DeviceFloats {
  float* ptr = nullptr;
  DeviceFloats() = default;
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;
  ~DeviceFloats() {
    if (ptr != nullptr) cudaFree(ptr);
  }
};

std::string describe(const char* what, cudaError_t err) {
  return std::string(what) + ": " + cudaGetErrorString(err);
}

}  // namespace

int deviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

std::string axpy(float a, const float* x, float* y, int n) {
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  DeviceFloats dx;
  DeviceFloats dy;
  if (auto e = cudaMalloc(&dx.ptr, bytes); e != cudaSuccess) return describe("cudaMalloc", e);
  if (auto e = cudaMalloc(&dy.ptr, bytes); e != cudaSuccess) return describe("cudaMalloc", e);
  if (auto e = cudaMemcpy(dx.ptr, x, bytes, cudaMemcpyHostToDevice); e != cudaSuccess) return describe("cudaMemcpy", e);
  if (auto e = cudaMemcpy(dy.ptr, y, bytes, cudaMemcpyHostToDevice); e != cudaSuccess) return describe("cudaMemcpy", e);
  const int threads = 256;
  axpyKernel<<<(n + threads - 1) / threads, threads>>>(a, dx.ptr, dy.ptr, n);
  if (auto e = cudaGetLastError(); e != cudaSuccess) return describe("axpy launch", e);
  if (auto e = cudaMemcpy(y, dy.ptr, bytes, cudaMemcpyDeviceToHost); e != cudaSuccess) return describe("cudaMemcpy", e);
  return {};
}

}  // namespace pd::gpu::kernels
