// CUDA build of pd/engine/gpu.h: argument checks, device owners and checked copies around the
// kernels.
#include <fmt/format.h>

#include <limits>

#include "gpu_kernels.h"
#include "pd/cuda/cuda_handles.h"
#include "pd/engine/gpu.h"

namespace pd::gpu {

bool builtWithCuda() {
  return true;
}
int deviceCount() {
  return cuda::deviceCount();
}

Result<std::uint64_t> deviceTotalMemory(int index) {
  const int count = deviceCount();
  if (count == 0) return makeError(ErrorCode::Unsupported, "no CUDA device is visible to this process");
  if (index < 0 || index >= count) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("cuda:{}: only {} CUDA device(s) are visible", index, count));
  }
  PD_CUDA_TRY(cudaSetDevice(index));
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  PD_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<std::uint64_t>(total_bytes);
}

Status axpy(float a, std::span<const float> x, std::span<float> y) {
  if (x.size() != y.size()) return makeError(ErrorCode::InvalidArgument, "axpy: x and y differ in length");
  if (x.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return makeError(ErrorCode::InvalidArgument, "axpy: too many elements");
  }
  if (deviceCount() == 0) return makeError(ErrorCode::Unsupported, "axpy: no CUDA device visible");
  PD_CUDA_TRY(cudaSetDevice(0));
  // Declared in acquisition order: the buffers die before the stream their copies ran on.
  PD_ASSIGN_OR_RETURN(cuda::Stream stream, cuda::Stream::create());
  PD_ASSIGN_OR_RETURN(auto dx, cuda::DeviceBuffer<float>::create(x.size()));
  PD_ASSIGN_OR_RETURN(auto dy, cuda::DeviceBuffer<float>::create(y.size()));
  PD_TRY(dx.copyFromHost(x, stream));
  PD_TRY(dy.copyFromHost(y, stream));
  PD_CUDA_TRY(kernels::launchAxpy(a, dx.data(), dy.data(), static_cast<int>(x.size()), stream.get()));
  PD_TRY(dy.copyToHost(y, stream));
  return stream.synchronize();
}

}  // namespace pd::gpu
