// CPU-only build of measureDeviceCeilings (pd/engine/gpu_bench.h): there is no CUDA device.
#include <fmt/format.h>

#include "pd/engine/gpu_bench.h"

namespace pd::gpu {

Result<DeviceCeilings> measureDeviceCeilings(const DeviceCeilingsConfig& config) {
  PD_TRY(validateDeviceCeilingsConfig(config));
  return makeError(ErrorCode::Unsupported,
                   fmt::format("bench engine --device {}: no CUDA device: this pdserve was built without CUDA "
                               "(PD_WITH_CUDA=OFF)",
                               modelDeviceName(config.device)));
}

Result<ModelOnDeviceResult> measureModelOnDevice(const std::filesystem::path& /*model_dir*/, const ModelDevice& device,
                                                 const DeviceDecodeBenchConfig& config) {
  PD_TRY(validateDeviceDecodeBenchConfig(config));
  return makeError(ErrorCode::Unsupported,
                   fmt::format("{}: no CUDA device: this pdserve was built without CUDA (PD_WITH_CUDA=OFF)",
                               modelDeviceName(device)));
}

}  // namespace pd::gpu
