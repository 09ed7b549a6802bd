#pragma once
/// One decode step of a DeepSeek-V3 model resident on one CUDA device, in the `fp32` numerics
/// mode (FP32 activations and accumulation), following the CPU engine (engine/src/cpu) op for op:
/// embedding; per layer RMSNorm, MLA (q_a -> norm -> q_b or q, kv_a -> norm + RoPE, the new latent
/// written to the paged device cache, W_UK absorbed into the query, split-KV attention over the
/// latents, W_UV, o_proj), residual + RMSNorm, then the dense MLP or MoE (noaux_tc routing, the
/// chosen experts, the weighted combine in ascending expert order, plus the shared expert); the
/// final norm and the LM head. Logits come back to the host.
///
/// Dense products: cuBLAS SGEMM in pedantic FP32 math (no TF32) over FP32 copies of the BF16 / F16
/// weights (BF16 values are exact in FP32, so the products are the CPU engine's); FP8 e4m3 linears
/// stay FP8 and run through the block-scaled FP8 GEMV (device_ops.h), except kv_b, which the
/// absorbed attention multiplies per head on both sides and which is therefore kept as an FP32
/// copy dequantized on the host. The FP32 copies are made once at create(): fp32 mode is the
/// golden-parity mode, not the memory-saving one.
///
/// Not yet here: the MTP layer, prefill chunks (one token per sequence only), a BF16 cache, the bf16
/// numerics mode, CUDA graphs, the `Engine` seam. MoE routing results cross to the host once per
/// MoE layer to group tokens by expert (a synchronize per MoE layer).
///
/// Private to the CUDA backend (engine/cuda) and its tests.
/// Thread rules: one thread at a time (the engine's); all work is ordered on the step's own stream.
/// The DeviceWeights must outlive the step.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "decode_step_plan.h"
#include "device_ops.h"
#include "device_weights.h"
#include "pd/common/result.h"
#include "pd/cuda/cuda_handles.h"
#include "pd/engine/model_config.h"

namespace pd::gpu {

class DeviceDecodeStep {
 public:
  struct Options {
    DecodeCacheShape cache;  ///< the device latent cache this step owns (F32)
  };

  /// Binds every tensor the model needs (NotFound / InvalidArgument naming a missing or misshapen
  /// one), makes the FP32 copies, allocates the cache and the workspaces for kMaxDecodeBatch
  /// sequences. Runs on `weights`' device, which it makes current.
  [[nodiscard]] static Result<std::unique_ptr<DeviceDecodeStep>> create(const DeviceWeights& weights,
                                                                        const ModelConfig& config,
                                                                        const Options& options);

  /// Runs one step (planDecodeStep validates the batch first; nothing is launched when it fails)
  /// and returns the logits [batch.size(), vocab_size]. Blocks until they are on the host.
  [[nodiscard]] Result<std::vector<float>> step(std::span<const DecodeSequence> batch);

  [[nodiscard]] const DecodeCacheShape& cacheShape() const { return cache_shape_; }

  ~DeviceDecodeStep();
  DeviceDecodeStep(const DeviceDecodeStep&) = delete;
  DeviceDecodeStep& operator=(const DeviceDecodeStep&) = delete;

  struct Impl;

 private:
  explicit DeviceDecodeStep(std::unique_ptr<Impl> impl, DecodeCacheShape cache);
  std::unique_ptr<Impl> impl_;
  DecodeCacheShape cache_shape_;
};

}  // namespace pd::gpu
