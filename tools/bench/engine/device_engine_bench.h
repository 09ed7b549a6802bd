#pragma once
/// `pdserve bench engine --device cuda`: the CUDA device's ceilings (pd/engine/gpu_bench.h) and
/// the MLA decode attention kernel alone as a fraction of the measured HBM bandwidth, reported as
/// text or one JSON object. The device-resident engine does not exist yet (docs/gpu.md), so the
/// engine's own figures (mbu_batch1, prefill_gemm_fraction) are reported as null with the reason,
/// never estimated.
///
/// Thread rules: runDeviceEngineBench() runs on the caller's thread; the reports are pure.

#include <filesystem>
#include <optional>
#include <string>

#include "pd/common/result.h"
#include "pd/engine/gpu_bench.h"

namespace pd::bench {

/// Why the engine's figures are absent from a device report.
inline constexpr const char* kDeviceEngineMissing =
    "the device-resident CUDA engine is not built yet (docs/gpu.md): decode MBU and prefill are not measured";

struct DeviceEngineBenchConfig {
  gpu::DeviceCeilingsConfig ceilings;
  std::filesystem::path model;  ///< empty: no weight upload
};

struct DeviceEngineBenchResult {
  gpu::DeviceCeilings ceilings;
  std::optional<gpu::WeightUploadResult> upload;  ///< when a model was given
};

/// Measures the ceilings on the configured device, then uploads the model's weights (if any) and
/// frees them. Errors as measureDeviceCeilings / measureWeightUpload.
[[nodiscard]] Result<DeviceEngineBenchResult> runDeviceEngineBench(const DeviceEngineBenchConfig& config);

[[nodiscard]] std::string deviceReportText(const DeviceEngineBenchResult& result);
/// One line: {"backend": "cuda", "device": ..., "read_bandwidth_gbs", "gemm_bf16_tflops",
/// "attention_hbm_fraction", "attention_ms", "attention_bytes", "attention_batch",
/// "attention_context", "attention_heads", "attention_latent_dim", "mbu_batch1": null,
/// "prefill_gemm_fraction": null, "note": ..., "weight_upload": null or {"model", "tensors",
/// "fp8_tensors", "bytes", "seconds", "gbs"}}.
[[nodiscard]] std::string deviceReportJson(const DeviceEngineBenchResult& result);

}  // namespace pd::bench
