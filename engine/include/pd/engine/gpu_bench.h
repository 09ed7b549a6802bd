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
#include <optional>
#include <string>
#include <vector>

#include "pd/common/result.h"
#include "pd/engine/gpu.h"
#include "pd/engine/model_config.h"

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
/// stored dtypes kept).
struct WeightUploadResult {
  std::string model;
  std::int64_t tensors = 0;
  std::int64_t fp8_tensors = 0;
  double bytes = 0.0;    ///< the checkpoint's tensor bytes
  double seconds = 0.0;  ///< fit check, allocation and copies, until the last copy has run
};

/// Decode steps of `batch` sequences through the whole model on the device (DeviceDecodeStep):
/// mbu = bytes_per_step / step_seconds / the measured read bandwidth.
struct DecodeStepResult {
  Numerics numerics = Numerics::Fp32;
  std::int64_t batch = 1;       ///< sequences per step
  std::int64_t context = 0;     ///< cached positions of each sequence when the timed steps begin
  std::int64_t steps = 0;       ///< timed steps
  double step_seconds = 0.0;    ///< median wall time of step(): launches, the work, the logits copy
  bool cuda_graphs = false;     ///< every timed step replayed a captured CUDA graph
  double experts_used = 0.0;    ///< distinct routed experts per MoE layer, mean over layers and timed steps
  double bytes_per_step = 0.0;  ///< DeviceDecodeStep::stepBytes at the timed steps' mean context and
                                ///< the experts the routing chose (mean over the timed steps)
};

/// mbu of one step: bytes / seconds / read bandwidth (0 when either is not positive).
[[nodiscard]] double decodeStepMbu(const DecodeStepResult& step, double read_bandwidth);

/// A prompt of one sequence prefilled through the whole model on the device the way the CUDA
/// engine runs a prompt today: its tokens as rows of decode steps, 64 rows a step, each step
/// attending causally on the path the engine's Auto picks for it (gpu::preferPrefillAttention:
/// up-projected while the rows are a large part of the context, absorbed after), only the last
/// row's logits computed and copied back. gemm fraction = devicePrefillFlops (the absorbed
/// formulation's count, a fixed measure of the work) / seconds / the BF16 GEMM ceiling.
struct PrefillResult {
  Numerics numerics = Numerics::Fp32;
  std::int64_t tokens = 0;       ///< prompt length (positions 0 .. tokens-1)
  std::int64_t repetitions = 0;  ///< timed prompts
  double seconds = 0.0;          ///< median wall time of one whole prompt, until its logits are on the host
  double flops = 0.0;            ///< devicePrefillFlops(config, tokens)
  bool cuda_graphs = false;      ///< every absorbed-path step of the timed prompts replayed a captured graph
};

/// The FLOPs (2 x multiply-adds) a prefill of `tokens` tokens from position 0 performs on the
/// device, counted as the CPU engine counts its ForwardStats::flops on the absorbed path: every
/// linear applied (q_a, q_b or q, kv_a, o_proj; the dense MLP, or the router, top_k routed experts
/// and the shared experts per token), the absorbed attention (scores and values over the latent
/// for every (query, key) pair, W_UK and W_UV per head), and the LM head for the last row only.
/// Embedding gathers, norms, RoPE and routing are not counted. Main layers only (no MTP).
[[nodiscard]] double devicePrefillFlops(const ModelConfig& config, std::int64_t tokens);

/// flops / seconds / gemm_flops (0 when any is not positive).
[[nodiscard]] double prefillGemmFraction(const PrefillResult& prefill, double gemm_flops);

/// The largest batch one decode step takes (the step's workspaces: kMaxDecodeBatch).
inline constexpr std::int64_t kMaxDeviceDecodeBatch = 64;

struct DeviceDecodeBenchConfig {
  Numerics numerics = Numerics::Fp32;
  std::int64_t context = 256;  ///< cached positions per sequence before the timed steps
  std::int64_t steps = 8;      ///< timed steps per batch
  /// Decode steps replay CUDA graphs (model.cuda_graphs): two untimed steps per batch first (its
  /// warm-up and its capture), so that the timed steps are replays.
  bool cuda_graphs = true;
  /// Batches to time, each 1..kMaxDeviceDecodeBatch (larger ones are the caller's to report as
  /// not measured).
  std::vector<std::int64_t> batches{1, 8, 32, 64};
  /// Prompt length of the prefill measurement (0: none; cut to the model's
  /// max_position_embeddings); the prompt is timed `prefill_repetitions` times after one untimed
  /// run (two with CUDA graphs: every step's warm-up, then its capture).
  std::int64_t prefill_tokens = 512;
  std::int64_t prefill_repetitions = 3;
};
/// InvalidArgument for context or steps outside 1..65536, no batches, a batch outside
/// 1..kMaxDeviceDecodeBatch, prefill_tokens outside 0..65536 or prefill_repetitions outside
/// 1..1000 (checked before any device call, in every build).
[[nodiscard]] Status validateDeviceDecodeBenchConfig(const DeviceDecodeBenchConfig& config);

struct ModelOnDeviceResult {
  WeightUploadResult upload;
  std::vector<DecodeStepResult> decode;  ///< one per configured batch, in its order
  std::optional<PrefillResult> prefill;  ///< when prefill_tokens > 0
};

/// Uploads `model_dir` to `device` once (timed: `upload`), then fills the cache of the largest
/// batch's sequences up to `context` positions (untimed; sequence s feeds token (1 + 7919 s + 104729
/// p) mod vocab at position p, so the rows route to different experts) and times `steps` steps of
/// each batch's first sequences at the positions after; then, when prefill_tokens > 0, times a
/// prompt of sequence 0's tokens from position 0 (PrefillResult; a prompt longer than the model's
/// max_position_embeddings is cut to it, and PrefillResult::tokens says so). Frees everything
/// before returning. Errors
/// as DeviceWeights::upload (Unsupported "no CUDA device" without one; ResourceExhausted naming
/// each part when it does not fit), the checkpoint's, the config's, or the decode step's.
[[nodiscard]] Result<ModelOnDeviceResult> measureModelOnDevice(const std::filesystem::path& model_dir,
                                                               const ModelDevice& device,
                                                               const DeviceDecodeBenchConfig& config);

/// Measures the three numbers. Unsupported "no CUDA device" without CUDA or without a visible
/// device; InvalidArgument for a bad config or a device index past the visible ones;
/// ResourceExhausted when the buffers do not fit; the CUDA error otherwise.
[[nodiscard]] Result<DeviceCeilings> measureDeviceCeilings(const DeviceCeilingsConfig& config);

}  // namespace pd::gpu
