#pragma once
/// `pdserve bench engine --device cuda`: the CUDA device's ceilings (pd/engine/gpu_bench.h) and
/// the MLA decode attention kernel alone as a fraction of the measured HBM bandwidth, and with a
/// model the weight upload and batch-1 decode steps through the whole model (mbu_batch1), reported
/// as text or one JSON object. What is not measured (mbu_batch1 without a model;
/// prefill_gemm_fraction, which has no device kernel of its own yet) is null with the reason,
/// never estimated.
///
/// Thread rules: runDeviceEngineBench() runs on the caller's thread; the reports are pure.

#include <filesystem>
#include <optional>
#include <string>

#include "pd/common/result.h"
#include "pd/engine/gpu_bench.h"

namespace pd::bench {

/// Why figures are absent from a device report.
inline constexpr const char* kDevicePrefillMissing =
    "prefill_gemm_fraction is not measured: the device prefill has no kernel of its own yet (docs/gpu.md)";
inline constexpr const char* kDeviceDecodeNeedsModel = "mbu_batch1 needs --model: no model, no decode step";

struct DeviceEngineBenchConfig {
  gpu::DeviceCeilingsConfig ceilings;
  std::filesystem::path model;  ///< empty: no weight upload, no decode
  gpu::Numerics numerics = gpu::Numerics::Fp32;
  std::int64_t decode_context = 256;  ///< cached positions before the timed decode steps
  std::int64_t decode_steps = 8;      ///< timed batch-1 decode steps
};

struct DeviceEngineBenchResult {
  gpu::DeviceCeilings ceilings;
  std::optional<gpu::WeightUploadResult> upload;  ///< when a model was given
  std::optional<gpu::DecodeStepResult> decode;    ///< when a model was given
};

/// Measures the ceilings on the configured device, then uploads the model's weights (if any) and
/// frees them. Errors as measureDeviceCeilings / measureWeightUpload.
[[nodiscard]] Result<DeviceEngineBenchResult> runDeviceEngineBench(const DeviceEngineBenchConfig& config);

[[nodiscard]] std::string deviceReportText(const DeviceEngineBenchResult& result);
/// One line: {"backend": "cuda", "device": ..., "read_bandwidth_gbs", "gemm_bf16_tflops",
/// "attention_hbm_fraction", "attention_ms", "attention_bytes", "attention_batch",
/// "attention_context", "attention_heads", "attention_latent_dim", "mbu_batch1": number or null,
/// "decode": null or {"numerics", "context", "steps", "step_ms", "bytes_per_step", "gbs"},
/// "prefill_gemm_fraction": null, "note": ..., "weight_upload": null or {"model", "tensors",
/// "fp8_tensors", "bytes", "seconds", "gbs"}}.
[[nodiscard]] std::string deviceReportJson(const DeviceEngineBenchResult& result);

}  // namespace pd::bench
