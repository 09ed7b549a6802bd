// CPU-only build of pd/engine/gpu.h: every device entry point says Unsupported.
#include <fmt/format.h>

#include "pd/engine/cuda_engine.h"
#include "pd/engine/gpu.h"

namespace pd::gpu {

bool builtWithCuda() {
  return false;
}
int deviceCount() {
  return 0;
}

Result<std::uint64_t> deviceTotalMemory(int /*index*/) {
  return makeError(ErrorCode::Unsupported, "no CUDA device: this pdserve was built without CUDA (PD_WITH_CUDA=OFF)");
}

Status axpy(float /*a*/, std::span<const float> /*x*/, std::span<float> /*y*/) {
  return makeError(ErrorCode::Unsupported, "axpy: this pdserve was built without CUDA (PD_WITH_CUDA=OFF)");
}

}  // namespace pd::gpu

namespace pd::model {

Result<std::unique_ptr<Engine>> createCudaEngine(const std::filesystem::path& /*model_dir*/,
                                                 const CudaEngineOptions& options) {
  PD_TRY(checkCudaEngineOptions(options));
  return makeError(
      ErrorCode::Unsupported,
      fmt::format("model.device {}: no CUDA device: this pdserve was built without CUDA (PD_WITH_CUDA=OFF)",
                  gpu::modelDeviceName(options.device)));
}

}  // namespace pd::model
