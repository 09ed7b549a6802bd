#pragma once
// The C-level boundary between C++20 host code (gpu_cuda.cpp) and nvcc-compiled kernels
// (gpu_kernels.cu, compiled as C++17). Returns an empty string on success, else the CUDA error.

#include <string>

namespace pd::gpu::kernels {

int deviceCount();
std::string axpy(float a, const float* x, float* y, int n);

}  // namespace pd::gpu::kernels
