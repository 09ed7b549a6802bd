#pragma once
/// The Hugging Face `config.json` of a DeepSeek-V3-architecture model (model_type deepseek_v3,
/// and deepseek_v2-style configs with `q_lora_rank: null`), the tensor layout it implies, and
/// validation of a checkpoint against it.
/// Thread rules: plain values; functions are pure.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "pd/common/dtype.h"
#include "pd/common/result.h"
#include "pd/engine/safetensors.h"

namespace pd {

struct RopeScaling {
  std::string type = "yarn";
  double factor = 1.0;
  std::int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 1.0;

  bool operator==(const RopeScaling&) const = default;
};

struct Fp8Quantization {
  std::string fmt = "e4m3";
  std::string activation_scheme = "dynamic";
  std::int64_t block_out = 128;  ///< weight_block_size[0]: rows per scale block
  std::int64_t block_in = 128;   ///< weight_block_size[1]: columns per scale block

  bool operator==(const Fp8Quantization&) const = default;
};

struct ModelConfig {
  std::string model_type = "deepseek_v3";
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;      ///< dense MLP width
  std::int64_t moe_intermediate_size = 0;  ///< each routed expert's width
  std::int64_t num_hidden_layers = 0;
  std::int64_t first_k_dense_replace = 0;
  std::int64_t moe_layer_freq = 1;
  std::int64_t num_attention_heads = 0;
  std::int64_t q_lora_rank = 0;  ///< 0 = no q LoRA (a direct q_proj); JSON null maps here
  std::int64_t kv_lora_rank = 0;
  std::int64_t qk_nope_head_dim = 0;
  std::int64_t qk_rope_head_dim = 0;
  std::int64_t v_head_dim = 0;
  std::int64_t n_routed_experts = 0;
  std::int64_t num_experts_per_tok = 0;
  std::int64_t n_group = 1;
  std::int64_t topk_group = 1;
  std::int64_t n_shared_experts = 0;
  double routed_scaling_factor = 1.0;
  std::string scoring_func = "sigmoid";
  std::string topk_method = "noaux_tc";
  bool norm_topk_prob = true;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::int64_t max_position_embeddings = 0;
  std::optional<RopeScaling> rope_scaling;
  std::optional<Fp8Quantization> quantization;  ///< set for FP8 block-quantized checkpoints
  std::int64_t num_nextn_predict_layers = 0;    ///< MTP layers, stored after the main layers
  std::int64_t bos_token_id = 0;
  std::int64_t eos_token_id = 1;
  bool tie_word_embeddings = false;

  bool operator==(const ModelConfig&) const = default;

  /// Parses config.json text. Unknown keys are ignored (HF configs carry many); missing required
  /// keys, wrong types and inconsistent values are InvalidArgument naming the key and `source`.
  /// Every problem found is reported, one per line. JSON `null` counts as absent, except
  /// `q_lora_rank: null`, which means 0 (a direct q_proj). rope_scaling missing keys take the
  /// Hugging Face defaults (beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 0).
  static Result<ModelConfig> fromJson(std::string_view json_text, const std::string& source);
  /// Reads `dir/config.json` (NotFound when absent, Io when unreadable).
  static Result<ModelConfig> load(const std::filesystem::path& dir);
  /// config.json text in the Hugging Face DeepSeek-V3 key names (what make-model writes),
  /// pretty-printed; `fromJson(toJson())` gives back an equal config.
  [[nodiscard]] std::string toJson() const;
  /// The consistency rules fromJson applies, for configs built in code (presets + overrides).
  /// InvalidArgument listing every broken rule by key name.
  [[nodiscard]] Status validate() const;

  /// True for layers (main or MTP) whose FFN is MoE: layer >= first_k_dense_replace and
  /// layer % moe_layer_freq == 0, as in Hugging Face's DeepSeek-V3 code.
  [[nodiscard]] bool isMoeLayer(std::int64_t layer) const;
  [[nodiscard]] std::int64_t qkHeadDim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  /// Latent KV values per token per layer: kv_lora_rank + qk_rope_head_dim (576 for V3).
  [[nodiscard]] std::int64_t latentDim() const { return kv_lora_rank + qk_rope_head_dim; }
  /// Layers holding latent KV: main layers + MTP layers.
  [[nodiscard]] std::int64_t kvLayers() const { return num_hidden_layers + num_nextn_predict_layers; }
  /// (dn + dr)^-0.5, times the YaRN mscale^2 when rope_scaling is yarn (golden README 3.4).
  [[nodiscard]] double softmaxScale() const;
};

/// Where a tensor belongs in the DeepSeek-V3 layout and what it must look like.
struct TensorSpec {
  std::string name;
  std::vector<std::int64_t> shape;
  /// The dtype make-model writes. Validation accepts BF16/F16/F32 for floating tensors, and
  /// F8_E4M3 for quantizable linear weights when the config is FP8 (then `<name>_scale_inv`,
  /// F32 [ceil(out/bo), ceil(in/bi)], is expected too and listed as its own spec).
  DType dtype = DType::BF16;
  bool quantizable = false;  ///< a linear weight that FP8 checkpoints store as F8_E4M3
  bool is_scale = false;     ///< a weight_scale_inv tensor
};

/// Every tensor of the Hugging Face layout for `config`, including the MTP layers
/// (`model.layers.{num_hidden_layers + k}.*` with enorm, hnorm, eh_proj, shared_head and the
/// embed_tokens copy), and `weight_scale_inv` entries when config.quantization is set.
[[nodiscard]] std::vector<TensorSpec> expectedTensors(const ModelConfig& config);

/// Compares a checkpoint with expectedTensors(config): reports every missing tensor, every
/// unexpected one, and every shape or dtype mismatch, all in one InvalidArgument message (a count
/// line naming the checkpoint folder, then one line per problem). An F8_E4M3 weight needs its
/// F32 `_scale_inv`; a weight kept in BF16/F16/F32 under an FP8 config needs none (and a scale
/// next to it is unexpected); F8_E4M3 without a quantization_config is a dtype mismatch.
Status validateCheckpoint(const ModelConfig& config, const Checkpoint& checkpoint);

}  // namespace pd
