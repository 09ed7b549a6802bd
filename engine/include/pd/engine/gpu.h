#pragma once
/// The GPU entry points that exist in every build. Without CUDA (or without a device) they
/// report ErrorCode::Unsupported, so callers and tests never need an #ifdef.
/// Thread rules: thread-safe; each call synchronizes its own stream before returning.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "pd/common/result.h"

namespace pd::gpu {

/// Number of visible CUDA devices; 0 in a CPU-only build or on a machine without a GPU.
[[nodiscard]] int deviceCount();

/// Whether this binary was built with the CUDA kernels.
[[nodiscard]] bool builtWithCuda();

/// Total memory of CUDA device `index` in bytes (cudaMemGetInfo's total): what
/// gpu_memory_utilization is a fraction of. Unsupported without CUDA or a device; InvalidArgument
/// for an index outside the visible devices.
[[nodiscard]] Result<std::uint64_t> deviceTotalMemory(int index);

/// Where the model runs (`--model.device`): the CPU engine, or CUDA device `index`.
struct ModelDevice {
  enum class Kind { Cpu, Cuda };
  Kind kind = Kind::Cpu;
  int index = 0;  ///< CUDA only
  friend bool operator==(const ModelDevice&, const ModelDevice&) = default;
};

/// The CUDA device index, or -1 for cpu (comm::joinDeviceGroup's "no device").
[[nodiscard]] inline int cudaIndexOrNone(const ModelDevice& device) {
  return device.kind == ModelDevice::Kind::Cuda ? device.index : -1;
}

/// "cpu", "cuda" (device 0) or "cuda:N"; InvalidArgument naming the text otherwise.
[[nodiscard]] Result<ModelDevice> parseModelDevice(std::string_view text);
/// "cpu", "cuda:0", ...
[[nodiscard]] std::string modelDeviceName(const ModelDevice& device);

/// The CUDA engine's numerics (`--model.numerics`, docs/gpu.md "Numerics modes"):
/// - Fp32: FP32 activations and accumulation; the golden tolerances hold (the parity mode);
/// - Bf16: every BF16 linear multiplies its weights as stored (no FP32 copy) with its input rounded
///   to BF16, accumulating in FP32 (cublasGemmEx); norms, attention and the residual stay FP32.
enum class Numerics { Fp32, Bf16 };

/// "fp32" or "bf16"; InvalidArgument naming the text otherwise.
[[nodiscard]] Result<Numerics> parseNumerics(std::string_view text);
[[nodiscard]] const char* numericsName(Numerics numerics);
/// The numerics modes are the CUDA engine's: InvalidArgument for anything but Fp32 on the CPU.
/// The one check the CLI (--check-config), the workers and the model commands all make.
[[nodiscard]] Status checkNumericsOnDevice(const ModelDevice& device, Numerics numerics);

/// Whether the engine can run on `device` here, checked before any model is loaded: OK for the
/// CPU. For CUDA, Unsupported "no CUDA device ..." when this build has no CUDA or no device is
/// visible, InvalidArgument when the index is past the visible devices; OK for a visible device
/// (model::createCudaEngine, pd/engine/cuda_engine.h, then runs the model there).
[[nodiscard]] Status checkModelDevice(const ModelDevice& device);
/// checkModelDevice for `count` consecutive devices from `first` (a worker's ranks on one
/// machine: cuda:N .. cuda:N+count-1); OK for the CPU.
[[nodiscard]] Status checkModelDevices(const ModelDevice& first, int count);

/// y += a * x computed on device 0: the smoke kernel that keeps the CUDA build path alive.
/// Its CPU twin is the obvious loop; tests compare the two.
Status axpy(float a, std::span<const float> x, std::span<float> y);

}  // namespace pd::gpu
