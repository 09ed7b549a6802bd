// CPU-only build of pd/engine/gpu.h: every device entry point says Unsupported.
#include "pd/engine/gpu.h"

namespace pd::gpu {

bool builtWithCuda() {
  return false;
}
int deviceCount() {
  return 0;
}

Status axpy(float /*a*/, std::span<const float> /*x*/, std::span<float> /*y*/) {
  return makeError(ErrorCode::Unsupported, "axpy: this pdserve was built without CUDA (PD_WITH_CUDA=OFF)");
}

}  // namespace pd::gpu
