#pragma once
/// `pdserve bench engine --device cuda`: the CUDA device's ceilings (pd/engine/gpu_bench.h) and
/// the MLA decode attention kernel alone as a fraction of the measured HBM bandwidth, and with a
/// model the weight upload (once) and decode steps through the whole model at each batch size
/// (mbu_batch1, mbu_by_batch) and a prompt's prefill (prefill_gemm_fraction), reported as text or
/// one JSON object. What is not measured (decode and prefill without a model; batches over a decode
/// step's 64 sequences; prefill with --prefill_tokens 0) is null with the reason, never estimated.
///
/// Thread rules: runDeviceEngineBench() runs on the caller's thread; the reports are pure.

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "pd/common/result.h"
#include "pd/engine/gpu_bench.h"

namespace pd::bench {

/// Why figures are absent from a device report.
inline constexpr const char* kDevicePrefillMissing =
    "prefill_gemm_fraction is not measured: it needs --model and --prefill_tokens > 0";
inline constexpr const char* kDeviceDecodeNeedsModel = "mbu_batch1 needs --model: no model, no decode step";
inline constexpr const char* kDeviceBatchOverStep =
    "batches over 64 are not measured: a device decode step takes at most 64 sequences";

struct DeviceEngineBenchConfig {
  gpu::DeviceCeilingsConfig ceilings;
  std::filesystem::path model;  ///< empty: no weight upload, no decode
  gpu::Numerics numerics = gpu::Numerics::Fp32;
  std::int64_t decode_context = 256;  ///< cached positions before the timed decode steps
  std::int64_t decode_steps = 8;      ///< timed decode steps per batch
  bool cuda_graphs = true;            ///< model.cuda_graphs (DeviceDecodeBenchConfig::cuda_graphs)
  std::int64_t prefill_tokens = 512;  ///< prompt length of the prefill measurement (0: none)
  /// Batch sizes to report; those over gpu::kMaxDeviceDecodeBatch are reported as not measured.
  std::vector<std::int64_t> batches{1, 8, 32, 64, 128};
};

struct DeviceEngineBenchResult {
  gpu::DeviceCeilings ceilings;
  std::optional<gpu::WeightUploadResult> upload;  ///< when a model was given
  std::vector<gpu::DecodeStepResult> decode;      ///< when a model was given: one per measured batch
  std::vector<std::int64_t> unmeasured_batches;   ///< configured batches over a step's limit
  std::optional<gpu::PrefillResult> prefill;      ///< with a model and prefill_tokens > 0
};

/// Measures the ceilings on the configured device, then (with a model) uploads its weights once
/// and times the decode batches (gpu::measureModelOnDevice). Errors as measureDeviceCeilings /
/// measureModelOnDevice; InvalidArgument for no batch at all.
[[nodiscard]] Result<DeviceEngineBenchResult> runDeviceEngineBench(const DeviceEngineBenchConfig& config);

[[nodiscard]] std::string deviceReportText(const DeviceEngineBenchResult& result);
/// One line: {"backend": "cuda", "device": ..., "read_bandwidth_gbs", "gemm_bf16_tflops",
/// "attention_hbm_fraction", "attention_ms", "attention_bytes", "attention_batch",
/// "attention_context", "attention_heads", "attention_latent_dim", "mbu_batch1": number or null,
/// "mbu_by_batch": {"<batch>": number or null, ...} (every configured batch; {} without a model),
/// "decode": [] or [{"batch", "numerics", "context", "steps", "step_ms", "tokens_per_s",
/// "experts_per_moe_layer", "bytes_per_step", "gbs", "mbu", "cuda_graphs"}, ...],
/// "prefill_gemm_fraction": number or null, "prefill": null or {"tokens", "numerics", "repetitions",
/// "seconds", "tokens_per_s", "flops", "tflops", "cuda_graphs"}, "note": ..., "weight_upload": null
/// or {"model", "tensors", "fp8_tensors", "bytes", "seconds", "gbs"}}.
[[nodiscard]] std::string deviceReportJson(const DeviceEngineBenchResult& result);

}  // namespace pd::bench
