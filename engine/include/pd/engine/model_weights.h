#pragma once
/// The weights of a DeepSeek-V3-architecture checkpoint, bound by layer and role. Linear weights
/// stay in the checkpoint's dtype inside the memory-mapped file (resident memory is about the
/// checkpoint's size); only norm weights and router biases are copied out, as float32.
///
/// Thread rules: immutable after load(); every method is thread-safe.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include "pd/common/result.h"
#include "pd/engine/kernels.h"
#include "pd/engine/model_config.h"
#include "pd/engine/safetensors.h"

namespace pd::model {

/// SwiGLU MLP: down(silu(gate(x)) * up(x)). Dense layers, routed and shared experts.
struct MlpWeights {
  WeightMatrix gate;  ///< [width, hidden]
  WeightMatrix up;    ///< [width, hidden]
  WeightMatrix down;  ///< [hidden, width]
};

/// Multi-head latent attention of one layer.
struct AttentionWeights {
  WeightMatrix q_a;              ///< [q_lora_rank, hidden]; empty (rows 0) without q LoRA
  std::vector<float> q_a_norm;   ///< [q_lora_rank]
  WeightMatrix q_b;              ///< [H * (dn + dr), q_lora_rank]
  WeightMatrix q;                ///< [H * (dn + dr), hidden]; only without q LoRA
  WeightMatrix kv_a;             ///< [kv_lora_rank + dr, hidden]
  std::vector<float> kv_a_norm;  ///< [kv_lora_rank]
  WeightMatrix kv_b;             ///< [H * (dn + dv), kv_lora_rank], head-major
  WeightMatrix o;                ///< [hidden, H * dv]
};

struct LayerWeights {
  std::vector<float> input_norm;  ///< [hidden]
  std::vector<float> post_norm;   ///< [hidden]
  AttentionWeights attn;
  bool moe = false;
  MlpWeights dense;                  ///< when !moe
  WeightMatrix router;               ///< [n_routed_experts, hidden] when moe
  std::vector<float> router_bias;    ///< e_score_correction_bias [n_routed_experts]; empty if absent
  std::vector<MlpWeights> experts;   ///< [n_routed_experts] when moe
  std::optional<MlpWeights> shared;  ///< width moe_intermediate_size * n_shared_experts
};

/// The (first) next-token-prediction layer, stored as model.layers.{num_hidden_layers}.
struct MtpWeights {
  std::vector<float> enorm;  ///< [hidden]
  std::vector<float> hnorm;  ///< [hidden]
  WeightMatrix eh_proj;      ///< [hidden, 2 * hidden]: embedding half first
  LayerWeights block;
  std::vector<float> head_norm;  ///< shared_head.norm [hidden]
  WeightMatrix head;             ///< shared_head.head [vocab, hidden]
  WeightMatrix embed;            ///< the layer's embed_tokens copy [vocab, hidden]
};

/// Which tensor-parallel shard of the weights to bind (docs/tensor-parallel.md). Rank r of
/// size s keeps attention heads [H r/s, H (r+1)/s) (rows of q_b / q and kv_b, columns of o),
/// the range [w r/s, w (r+1)/s) of every MLP's intermediate width w (rows of gate and up,
/// columns of down: dense, routed and shared experts), and vocab rows [V r/s, V (r+1)/s) of
/// the embeddings and LM heads. Everything else (q_a, kv_a, norms, router, eh_proj) is whole.
/// Row slices stay in the mapped file; column slices and FP8 scales that no longer line up with
/// their blocks are copied out (the rest of the file is never touched, so never resident).
/// size 1 binds exactly the unsharded weights.
struct TpShard {
  int rank = 0;
  int size = 1;
};

/// [begin, end) of rank `rank`'s part of n items split over `size` ranks (sizes differ by <= 1).
struct ShardRange {
  std::int64_t begin = 0;
  std::int64_t end = 0;
};
[[nodiscard]] ShardRange shardRange(std::int64_t n, int rank, int size);

class ModelWeights {
 public:
  /// Reads `dir`/config.json and the checkpoint in `dir`, validates every tensor against the
  /// config (missing, unexpected, wrong shape or dtype, FP8 weight without its scale) and binds
  /// them (`shard`'s part only). InvalidArgument / NotFound / Corrupt / Unsupported with a
  /// message naming the tensor; InvalidArgument for a shard the model cannot be split into.
  static Result<std::unique_ptr<ModelWeights>> load(const std::filesystem::path& dir, TpShard shard = {});
  /// Binds an already-open checkpoint to `config` (same checks).
  static Result<std::unique_ptr<ModelWeights>> fromCheckpoint(ModelConfig config, Checkpoint checkpoint,
                                                              TpShard shard = {});

  ModelWeights(const ModelWeights&) = delete;
  ModelWeights& operator=(const ModelWeights&) = delete;
  ~ModelWeights();

  [[nodiscard]] const ModelConfig& config() const { return config_; }
  /// The shard bound; the matrices below have the shard's shapes (e.g. embedTokens() has the
  /// shard's vocab rows, starting at token shardRange(vocab_size, rank, size).begin).
  [[nodiscard]] const TpShard& shard() const { return shard_; }
  [[nodiscard]] const WeightMatrix& embedTokens() const { return embed_; }
  [[nodiscard]] const std::vector<LayerWeights>& layers() const { return layers_; }
  [[nodiscard]] const std::vector<float>& finalNorm() const { return final_norm_; }
  [[nodiscard]] const WeightMatrix& lmHead() const { return lm_head_; }
  /// nullptr when the checkpoint has no MTP layer.
  [[nodiscard]] const MtpWeights* mtp() const { return mtp_ ? &*mtp_ : nullptr; }
  /// The dtype of the quantizable linear weights (F8E4M3, BF16, ...).
  [[nodiscard]] DType linearDtype() const { return linear_dtype_; }
  /// Bytes of every tensor in the checkpoint.
  [[nodiscard]] std::uint64_t checkpointBytes() const { return checkpoint_.totalTensorBytes(); }
  /// The underlying checkpoint (every tensor, e.g. to pre-fault its pages).
  [[nodiscard]] const Checkpoint& checkpoint() const { return checkpoint_; }
  /// Looks up any weight matrix by its Hugging Face name (tests compare dequantization).
  [[nodiscard]] Result<WeightMatrix> matrix(const std::string& name) const;

 private:
  ModelWeights(ModelConfig config, Checkpoint checkpoint, TpShard shard);
  Status bind();
  Status applyShard();

  ModelConfig config_;
  Checkpoint checkpoint_;
  DType linear_dtype_ = DType::BF16;
  WeightMatrix embed_;
  std::vector<LayerWeights> layers_;
  std::vector<float> final_norm_;
  WeightMatrix lm_head_;
  std::optional<MtpWeights> mtp_;
  TpShard shard_;
  std::vector<std::unique_ptr<std::byte[]>> owned_;  // copied-out slices (sharded weights only)
};

}  // namespace pd::model
