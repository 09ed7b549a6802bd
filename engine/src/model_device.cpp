// --model.device: parsing and the check that the named device can run the engine.
#include <fmt/format.h>

#include <charconv>

#include "pd/engine/cuda_engine.h"
#include "pd/engine/gpu.h"

namespace pd::gpu {

Result<ModelDevice> parseModelDevice(std::string_view text) {
  if (text == "cpu") return ModelDevice{};
  if (text == "cuda") return ModelDevice{ModelDevice::Kind::Cuda, 0};
  constexpr std::string_view kCudaPrefix = "cuda:";
  if (text.starts_with(kCudaPrefix)) {
    const std::string_view digits = text.substr(kCudaPrefix.size());
    int index = -1;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (!digits.empty() && ec == std::errc() && end == digits.data() + digits.size() && index >= 0) {
      return ModelDevice{ModelDevice::Kind::Cuda, index};
    }
  }
  return makeError(ErrorCode::InvalidArgument, fmt::format("model.device '{}' is not one of cpu, cuda, cuda:N", text));
}

Result<Numerics> parseNumerics(std::string_view text) {
  if (text == "fp32") return Numerics::Fp32;
  if (text == "bf16") return Numerics::Bf16;
  return makeError(ErrorCode::InvalidArgument, fmt::format("model.numerics '{}': expected fp32 or bf16", text));
}

const char* numericsName(Numerics numerics) {
  return numerics == Numerics::Bf16 ? "bf16" : "fp32";
}

Status checkNumericsOnDevice(const ModelDevice& device, Numerics numerics) {
  if (numerics == Numerics::Fp32 || device.kind == ModelDevice::Kind::Cuda) return okStatus();
  return makeError(ErrorCode::InvalidArgument,
                   fmt::format("model.numerics {} needs model.device cuda: the CPU engine computes in FP32",
                               numericsName(numerics)));
}

std::string modelDeviceName(const ModelDevice& device) {
  if (device.kind == ModelDevice::Kind::Cpu) return "cpu";
  return fmt::format("cuda:{}", device.index);
}

Status checkModelDevice(const ModelDevice& device) {
  if (device.kind == ModelDevice::Kind::Cpu) return okStatus();
  if (!builtWithCuda()) {
    return makeError(ErrorCode::Unsupported,
                     fmt::format("model.device {}: no CUDA device: this pdserve was built without CUDA "
                                 "(PD_WITH_CUDA=OFF)",
                                 modelDeviceName(device)));
  }
  const int count = deviceCount();
  if (count == 0) {
    return makeError(ErrorCode::Unsupported,
                     fmt::format("model.device {}: no CUDA device is visible to this process (check the driver, "
                                 "CUDA_VISIBLE_DEVICES and the container's GPU access)",
                                 modelDeviceName(device)));
  }
  if (device.index >= count) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("model.device {}: only {} CUDA device(s) are visible (cuda:0 .. cuda:{})",
                                 modelDeviceName(device), count, count - 1));
  }
  return okStatus();
}

Status checkModelDevices(const ModelDevice& first, int count) {
  PD_TRY(checkModelDevice(first));
  ModelDevice last = first;
  if (first.kind == ModelDevice::Kind::Cuda) last.index += count - 1;
  return checkModelDevice(last);
}

}  // namespace pd::gpu

namespace pd::model {

Status checkCudaEngineOptions(const CudaEngineOptions& options) {
  if (options.batch_invariant) {
    return makeError(ErrorCode::Unsupported, "model.batch_invariant: the CUDA engine has no batch-invariant mode yet");
  }
  return okStatus();
}

}  // namespace pd::model
