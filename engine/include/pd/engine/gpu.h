#pragma once
/// The GPU entry points that exist in every build. Without CUDA (or without a device) they
/// report ErrorCode::Unsupported, so callers and tests never need an #ifdef.
/// Thread rules: thread-safe; each call synchronizes its own stream before returning.

#include <span>

#include "pd/common/result.h"

namespace pd::gpu {

/// Number of visible CUDA devices; 0 in a CPU-only build or on a machine without a GPU.
[[nodiscard]] int deviceCount();

/// Whether this binary was built with the CUDA kernels.
[[nodiscard]] bool builtWithCuda();

/// y += a * x computed on device 0: the smoke kernel that keeps the CUDA build path alive.
/// Its CPU twin is the obvious loop; tests compare the two.
Status axpy(float a, std::span<const float> x, std::span<float> y);

}  // namespace pd::gpu
