// CUDA build of pd/engine/gpu.h: argument checks and error mapping around the kernels.
#include <limits>

#include "gpu_kernels.h"
#include "pd/engine/gpu.h"

namespace pd::gpu {

bool builtWithCuda() {
  return true;
}
int deviceCount() {
  return kernels::deviceCount();
}

Status axpy(float a, std::span<const float> x, std::span<float> y) {
  if (x.size() != y.size()) return makeError(ErrorCode::InvalidArgument, "axpy: x and y differ in length");
  if (x.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return makeError(ErrorCode::InvalidArgument, "axpy: too many elements");
  }
  if (deviceCount() == 0) return makeError(ErrorCode::Unsupported, "axpy: no CUDA device visible");
  if (std::string err = kernels::axpy(a, x.data(), y.data(), static_cast<int>(x.size())); !err.empty()) {
    return makeError(ErrorCode::Internal, "axpy: " + err);
  }
  return okStatus();
}

}  // namespace pd::gpu
