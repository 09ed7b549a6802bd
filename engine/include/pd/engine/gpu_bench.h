#pragma once
/// The CUDA device's ceilings for `pdserve bench engine --device cuda` (tools/bench/engine), measured
/// in one run on one device: HBM read bandwidth (a streaming read kernel over a buffer far larger
/// than L2), dense BF16 GEMM throughput (cuBLAS, FP32 accumulation), and the absorbed MLA decode
/// attention kernel alone (engine/cuda, BF16 latent cache) as a fraction of that bandwidth.
/// Declared in every build: without CUDA, or without a visible device, measureDeviceCeilings()
/// returns Unsupported "... no CUDA device ..." and touches nothing.
///
/// Thread rules: measureDeviceCeilings() runs on the caller's thread and owns every resource it
/// uses (freed before it returns); the arithmetic helpers are pure.

#include <cstdint>
#include <filesystem>
#include <string>

#include "pd/common/result.h"
#include "pd/engine/gpu.h"

namespace pd::gpu {

struct DeviceCeilingsConfig {
  ModelDevice device{ModelDevice::Kind::Cuda, 0};
  std::int64_t read_mb = 4096;    ///< streaming-read buffer, MiB (many times any L2)
  std::int64_t gemm_size = 8192;  ///< M = N = K of the BF16 GEMM
  std::int64_t iterations = 20;   ///< timed repetitions of each measurement (after 3 warm-up runs)
  // MLA decode attention (DeepSeek-V3 shapes by default): batch sequences of `context` cached
  // tokens each, one query token per sequence, `heads` heads over a latent of `latent_dim`.
  std::int64_t attention_batch = 64;
  std::int64_t attention_context = 4096;
  std::int64_t attention_heads = 128;
  std::int64_t attention_latent_dim = 576;  ///< kv_lora_rank 512 + qk_rope_head_dim 64
  std::int64_t attention_block_size = 64;
};

struct DeviceCeilings {
  std::string device;                   ///< "cuda:0 (NVIDIA ...)"
  double read_bandwidth = 0.0;          ///< bytes/s, median of the timed reads
  double gemm_flops = 0.0;              ///< FLOP/s (2 M N K per GEMM), median
  double attention_seconds = 0.0;       ///< median time of one MLA decode attention call
  double attention_bytes = 0.0;         ///< the bytes it must read: attentionMinimumBytes()
  double attention_hbm_fraction = 0.0;  ///< attention_bytes / attention_seconds / read_bandwidth
  DeviceCeilingsConfig config;
};

/// The bytes one MLA decode attention call must read at least: every sequence's latent cache
/// once (batch x context x latent_dim x cache element bytes) plus the queries (batch x heads x
/// latent_dim F32). The output writes are not counted.
[[nodiscard]] double attentionMinimumBytes(const DeviceCeilingsConfig& config, std::int64_t cache_element_bytes);

/// bytes / seconds / bandwidth; 0 when any is not positive.
[[nodiscard]] double bandwidthFraction(double bytes, double seconds, double bandwidth);

/// InvalidArgument naming the field for a non-positive or too large size (checked before any
/// device call, in every build).
[[nodiscard]] Status validateDeviceCeilingsConfig(const DeviceCeilingsConfig& config);

/// A checkpoint uploaded to the device (engine/cuda/device_weights.h: pinned staging, chunks,
/// stored dtypes kept) and freed again.
struct WeightUploadResult {
  std::string model;
  std::int64_t tensors = 0;
  std::int64_t fp8_tensors = 0;
  double bytes = 0.0;    ///< the checkpoint's tensor bytes
  double seconds = 0.0;  ///< fit check, allocation and copies, until the last copy has run
};

/// Uploads the checkpoint in `model_dir` to `device` (with room for a minimal KV pool), then
/// frees it. Errors as DeviceWeights::upload (Unsupported "no CUDA device" without one;
/// ResourceExhausted naming each part when it does not fit), or the checkpoint's own.
[[nodiscard]] Result<WeightUploadResult> measureWeightUpload(const std::filesystem::path& model_dir,
                                                             const ModelDevice& device);

/// One sequence's decode steps through the whole model on the device (DeviceDecodeStep), the
/// engine's batch-1 figure: mbu = bytes_per_step / step_seconds / the measured read bandwidth.
struct DecodeStepResult {
  Numerics numerics = Numerics::Fp32;
  std::int64_t context = 0;     ///< cached positions when the timed steps begin
  std::int64_t steps = 0;       ///< timed steps
  double step_seconds = 0.0;    ///< median wall time of step(): launches, the work, the logits copy
  double bytes_per_step = 0.0;  ///< DeviceDecodeStep::batchOneBytes at the timed steps' mean context
};

/// mbu of one step: bytes / seconds / read bandwidth (0 when either is not positive).
[[nodiscard]] double decodeStepMbu(const DecodeStepResult& step, double read_bandwidth);

/// Uploads `model_dir` to `device`, runs one sequence from position 0 up to `context` (token 1 at
/// every position), then times `steps` more steps. Errors as measureWeightUpload, InvalidArgument
/// for context or steps outside 1..65536, the decode step's own otherwise.
[[nodiscard]] Result<DecodeStepResult> measureBatchOneDecode(const std::filesystem::path& model_dir,
                                                             const ModelDevice& device, Numerics numerics,
                                                             std::int64_t context, std::int64_t steps);

/// Measures the three numbers. Unsupported "no CUDA device" without CUDA or without a visible
/// device; InvalidArgument for a bad config or a device index past the visible ones;
/// ResourceExhausted when the buffers do not fit; the CUDA error otherwise.
[[nodiscard]] Result<DeviceCeilings> measureDeviceCeilings(const DeviceCeilingsConfig& config);

}  // namespace pd::gpu
