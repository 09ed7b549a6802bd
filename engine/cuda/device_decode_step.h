#pragma once
/// One decode step of a DeepSeek-V3 model resident on one CUDA device, in the `fp32` numerics
/// mode (FP32 activations and accumulation), following the CPU engine (engine/src/cpu) op for op:
/// embedding; per layer RMSNorm, MLA (q_a -> norm -> q_b or q, kv_a -> norm + RoPE, the new latent
/// written to the paged device cache, W_UK absorbed into the query, split-KV attention over the
/// latents, W_UV, o_proj; or, with Request::prefill_attention, keys and values up-projected per
/// context chunk, MlaPrefillAttention), residual + RMSNorm, then the dense MLP or MoE (noaux_tc routing, the
/// chosen experts grouped on the device, the weighted combine in ascending expert order, plus the
/// shared expert); the final norm and the LM head. Logits come back to the host.
///
/// Dense products: cuBLAS SGEMM in pedantic FP32 math (no TF32) over FP32 copies of the BF16 / F16
/// weights (BF16 values are exact in FP32, so the products are the CPU engine's); FP8 e4m3 linears
/// stay FP8 and run through the block-scaled FP8 GEMV (device_ops.h), except kv_b, which the
/// absorbed attention multiplies per head on both sides and which is therefore kept as an FP32
/// copy dequantized on the host. The routed experts' linears, whatever their dtype, run through
/// the grouped GEMV (one launch per linear for all experts). The FP32 copies are made once at
/// create(): fp32 mode is the golden-parity mode, not the memory-saving one.
///
/// The same step runs the rows of prefill chunks and MTP verify (one row per new token, each
/// attending to the positions up to its own: every row's latent is written to the device cache
/// before the layer's attention reads it) and the MTP layer (run()), with a collector that receives
/// each layer's new latents on the host after the step (the CudaEngine mirrors them into the
/// caller's cache).
///
/// Options::numerics Bf16 is the bf16 mode (BF16 linears multiplied as stored, their inputs rounded
/// to BF16, FP32 accumulation). The device cache is F32 or BF16 (DecodeCacheShape::dtype). Steps run as CUDA graphs
/// (Options::cuda_graphs). The MoE runs
/// on the device without a host round trip: grouping by expert, one grouped GEMV launch per
/// expert linear, the combine (docs/gpu.md).
///
/// Private to the CUDA backend (engine/cuda) and its tests.
/// Thread rules: one thread at a time (the engine's); all work is ordered on the step's own stream.
/// The DeviceWeights must outlive the step.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "decode_step_plan.h"
#include "device_ops.h"
#include "device_weights.h"
#include "pd/comm/device_collectives.h"
#include "pd/common/result.h"
#include "pd/cuda/cuda_handles.h"
#include "pd/engine/gpu.h"
#include "pd/engine/model_config.h"

namespace pd::gpu {

class DeviceDecodeStep {
 public:
  struct Options {
    DecodeCacheShape cache;  ///< the device latent cache this step owns (F32 or BF16)
    /// Fp32: FP32 copies of the BF16 linears, SGEMM. Bf16: the BF16 linears multiplied as stored
    /// (no copy) with their inputs rounded to BF16, FP32 accumulation (cublasGemmEx); FP8
    /// linears, kv_b, the embedding, norms, attention and the residual are as in Fp32.
    gpu::Numerics numerics = gpu::Numerics::Fp32;
    /// Steps run as CUDA graphs: per DecodeGraphKey (rows, attention
    /// context band, MTP, latent collection and rounding), the first step runs eagerly, the second
    /// is captured, later ones replay it (one launch for the embedding, every layer and the final
    /// norm). A capture that fails leaves its key eager, with a warning. false: always eager.
    bool cuda_graphs = true;
    /// Tensor parallelism (docs/tensor-parallel.md, "On GPUs"): `weights` hold rank tp->rank()'s
    /// shard of tp->size() (weight_shard.h), and the step sums the partial embedding, attention
    /// output and FFN output over the ranks (allReduceSum on the device) and gathers the
    /// vocabulary slices of the LM head, so every rank holds the whole hidden states and logits.
    /// Not owned; null: one rank. Collectives that cannot be captured turn cuda_graphs off.
    comm::DeviceCollectives* tp = nullptr;
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

  /// Receives each layer's new latents [tokens, latent_dim] (float32, on the host, in row order,
  /// as the device cache holds them), in KV-layer order. A step that runs eagerly (the prefill
  /// attention path, graphs off, a shape that stays eager) hands over layer l as soon as its copy
  /// to the host is done, while the device computes the later layers: the host waits on the
  /// layer's event (recorded after the copy), so a KV sink puts layer l during layers l+1.. (the
  /// issue's "copied device -> pinned on the layer's stream event and put while the next layer
  /// computes"). A replayed CUDA graph hands them all over after the step (no event inside it).
  /// Layers already handed over stay handed over if the step then fails.
  class LatentCollector {
   public:
    virtual ~LatentCollector() = default;
    [[nodiscard]] virtual Status onLatents(std::int64_t kv_layer, std::span<const float> latents) = 0;
  };

  struct Request {
    bool mtp = false;                    ///< run the MTP layer (kv layer num_hidden_layers) instead of the main layers
    std::span<const float> prev_hidden;  ///< mtp: [tokens, hidden] main-model final hidden states
    std::span<const std::uint8_t> zero_embedding;  ///< mtp: per row, 1 = zero its token embedding (or empty)
    std::span<const std::int64_t> logit_rows;      ///< rows whose logits to return, each in [0, tokens)
    std::span<const std::int64_t> hidden_rows;     ///< rows whose hidden states to return
    LatentCollector* collector = nullptr;          ///< null: latents go only to the device cache
    /// Round each new latent to BF16 (math::bf16Round) before the cache and the attention see it,
    /// as a BF16 host cache would hold it. The collector gets the latents before the rounding, as
    /// the CPU engine's sink does.
    bool round_latents_to_bf16 = false;

    /// When not empty: one sampling request per logit row; the rows are sampled on the device
    /// (DeviceSampler) and only the tokens and logprobs come back, not the logits.
    std::span<const DeviceSampler::Row> sample_rows;
    /// The prefill attention path (MlaPrefillAttention, the CPU engine's AttentionPath::Prefill):
    /// keys and values up-projected per context chunk once for each run of rows reading one
    /// sequence (prefillSegments), instead of one absorbed query per row. Such steps run eagerly.
    bool prefill_attention = false;
  };
  struct Output {
    std::vector<float> logits;  ///< [logit_rows, vocab_size]
    /// [hidden_rows, hidden_size]: after the final norm (main); the MTP block output before
    /// shared_head.norm (mtp), as model::Engine documents.
    std::vector<float> hidden;
    std::vector<DeviceSampler::Sampled> sampled;  ///< [logit_rows] when sample_rows was given (logits empty)
  };
  /// Runs the rows of `plan` (made by planDecodeStep for this step's cache shape) through the main
  /// model or the MTP layer. InvalidArgument for rows or sizes that do not fit the plan or the
  /// step (nothing launched); Unsupported for mtp without an MTP layer. Blocks until the outputs
  /// are on the host.
  [[nodiscard]] Result<Output> run(const DecodeStepPlan& plan, const Request& request);

  /// The bytes one main-model step of one sequence reads from device memory when `context`
  /// positions (the new one included) are in its cache: every weight it multiplies as the step
  /// holds it (FP32 copies, BF16 as stored, FP8 with its scales), top_k routed experts and the
  /// shared expert of each MoE layer, the norms, one embedding row, the LM head, and the latent
  /// cache of every layer. The routing bias, the workspaces and the logits are not counted.
  /// stepBytes() with one sequence and num_experts_per_tok experts in every MoE layer.
  [[nodiscard]] double batchOneBytes(std::int64_t context) const;

  /// The same count for a main-model step of several sequences: `contexts` [sequences] the cached
  /// positions of each (the new one included), `experts_used` [main layers] the distinct experts
  /// that got rows in each MoE layer (expertsUsedLastRun(); entries of dense layers are ignored).
  [[nodiscard]] double stepBytes(std::span<const std::int64_t> contexts,
                                 std::span<const std::int32_t> experts_used) const;

  /// Per KV layer (main layers, then MTP), how many distinct experts got rows in the last run()
  /// (0 for dense layers and layers the run did not reach). Blocks until the counts are on the host.
  [[nodiscard]] Result<std::vector<std::int32_t>> expertsUsedLastRun();

  /// How the steps ran since create(): eagerly, captured (then launched), replayed; captures that
  /// failed (their keys stay eager); graphs held now.
  struct GraphStats {
    std::int64_t eager = 0;
    std::int64_t captured = 0;
    std::int64_t replayed = 0;
    std::int64_t capture_failures = 0;
    std::int64_t held = 0;
    /// Layers handed to a collector while their step was still running (LatentCollector).
    std::int64_t streamed_layers = 0;
  };
  [[nodiscard]] GraphStats graphStats() const;

  /// Whether the checkpoint's MTP layer was bound (config num_nextn_predict_layers > 0).
  [[nodiscard]] bool hasMtp() const;
  /// KV layers of the device cache: main layers, then the MTP layer when bound.
  [[nodiscard]] std::int64_t cacheLayers() const;

  /// Copies host latents into the device cache: values [sum of runs' counts, latent_dim] float32
  /// go to the runs' slots of `kv_layer`, in order. InvalidArgument for a slot or layer outside
  /// the cache. Blocks until the copy is done (the host values may be freed after).
  [[nodiscard]] Status writeCache(std::int64_t kv_layer, std::span<const std::int64_t> slots,
                                  std::span<const std::int64_t> counts, std::span<const float> values);
  /// The same for an FP8 cache (F8E4M3 shape; InvalidArgument otherwise): `tokens` holds the runs'
  /// tokens as the host cache stores them (kvTokenBytes(F8E4M3, latent_dim) bytes each), copied
  /// as they are.
  [[nodiscard]] Status writeCacheTokens(std::int64_t kv_layer, std::span<const std::int64_t> slots,
                                        std::span<const std::int64_t> counts, std::span<const std::byte> tokens);

  /// Replaces the device cache by one of `shape` (its contents are lost) and resizes what depends
  /// on it; nothing happens when the shape is the current one. InvalidArgument for a bad shape,
  /// ResourceExhausted when the device memory is not there (the step is then unusable until a
  /// shape that fits is set).
  [[nodiscard]] Status setCacheShape(const DecodeCacheShape& shape);
  /// Makes `memory` (device memory on this step's GPU, cacheBytesFor(shape) bytes, owned by the
  /// caller and kept alive while in use) the device cache: layer l's tokens start at
  /// l * (num_blocks + padding blocks) * block_size tokens; nothing is allocated or copied. A later
  /// setCacheShape() leaves it for a cache of the step's own. InvalidArgument for a bad shape or no
  /// memory.
  [[nodiscard]] Status useExternalCache(const DecodeCacheShape& shape, void* memory);
  /// The bytes a cache of `shape` takes (its blocks plus the step's padding blocks, every KV layer).
  [[nodiscard]] std::uint64_t cacheBytesFor(const DecodeCacheShape& shape) const;
  /// Whether `memory` is the cache in use (useExternalCache).
  [[nodiscard]] bool usesExternalCache(const void* memory) const;

  [[nodiscard]] const DecodeCacheShape& cacheShape() const { return cache_shape_; }

  ~DeviceDecodeStep();
  DeviceDecodeStep(const DeviceDecodeStep&) = delete;
  DeviceDecodeStep& operator=(const DeviceDecodeStep&) = delete;

  struct Impl;

 private:
  explicit DeviceDecodeStep(std::unique_ptr<Impl> impl, DecodeCacheShape cache);
  [[nodiscard]] Status replaceCache(const DecodeCacheShape& shape, std::byte* external);
  std::unique_ptr<Impl> impl_;
  DecodeCacheShape cache_shape_;
};

}  // namespace pd::gpu
