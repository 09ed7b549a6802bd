#include "pd/common/model/model_weights.h"

#include <fmt/format.h>

#include <string>
#include <utility>

namespace pd::model {
namespace {

std::string shapeText(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool aligned(const void* p, std::size_t alignment) {
  return reinterpret_cast<std::uintptr_t>(p) % alignment == 0;
}

// Binds tensors of one checkpoint by name; every failure names the tensor.
class Binder {
 public:
  Binder(const ModelConfig& config, const Checkpoint& checkpoint) : config_(config), checkpoint_(checkpoint) {}

  Result<WeightMatrix> matrix(const std::string& name, std::int64_t rows, std::int64_t cols) const {
    const TensorView* t = checkpoint_.find(name);
    if (t == nullptr) return makeError(ErrorCode::NotFound, fmt::format("checkpoint has no tensor '{}'", name));
    if (t->shape.size() != 2 || (rows >= 0 && t->shape[0] != rows) || (cols >= 0 && t->shape[1] != cols)) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("tensor '{}' has shape {}, expected [{}, {}]", name,
                                                               shapeText(t->shape), rows, cols));
    }
    WeightMatrix w;
    w.dtype = t->dtype;
    w.rows = t->shape[0];
    w.cols = t->shape[1];
    w.data = t->data.data();
    switch (t->dtype) {
      case DType::F32:
      case DType::BF16:
      case DType::F16:
        if (!aligned(w.data, dtypeSize(t->dtype))) {
          return makeError(ErrorCode::Corrupt, fmt::format("tensor '{}' is not aligned to its element size", name));
        }
        return w;
      case DType::F8E4M3:
        break;
      default:
        return makeError(ErrorCode::Unsupported, fmt::format("tensor '{}' has dtype {}; weights must be BF16, F16, "
                                                             "F32 or F8_E4M3",
                                                             name, dtypeName(t->dtype)));
    }
    if (config_.quantization) {
      w.block_rows = config_.quantization->block_out;
      w.block_cols = config_.quantization->block_in;
    }
    const std::string scale_name = name + "_scale_inv";
    const TensorView* s = checkpoint_.find(scale_name);
    if (s == nullptr) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("FP8 tensor '{}' has no scale tensor '{}'", name, scale_name));
    }
    const std::vector<std::int64_t> want{w.scaleRows(), w.scaleCols()};
    if (s->dtype != DType::F32 || s->shape != want) {
      return makeError(
          ErrorCode::InvalidArgument,
          fmt::format("scale tensor '{}' is {} {}, expected F32 {} for {}x{} blocks", scale_name, dtypeName(s->dtype),
                      shapeText(s->shape), shapeText(want), w.block_rows, w.block_cols));
    }
    if (!aligned(s->data.data(), sizeof(float))) {
      return makeError(ErrorCode::Corrupt, fmt::format("tensor '{}' is not aligned to its element size", scale_name));
    }
    w.scale_inv = reinterpret_cast<const float*>(s->data.data());
    return w;
  }

  Result<std::vector<float>> vector(const std::string& name, std::int64_t n) const {
    const TensorView* t = checkpoint_.find(name);
    if (t == nullptr) return makeError(ErrorCode::NotFound, fmt::format("checkpoint has no tensor '{}'", name));
    if (t->shape != std::vector<std::int64_t>{n}) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("tensor '{}' has shape {}, expected [{}]", name, shapeText(t->shape), n));
    }
    if (t->dtype != DType::F32 && t->dtype != DType::BF16 && t->dtype != DType::F16) {
      return makeError(ErrorCode::Unsupported,
                       fmt::format("tensor '{}' has dtype {}; expected BF16, F16 or F32", name, dtypeName(t->dtype)));
    }
    WeightMatrix as_row{t->dtype, 1, n, t->data.data()};
    std::vector<float> out(static_cast<std::size_t>(n));
    dequantizeRow(as_row, 0, out.data());
    return out;
  }

  Result<MlpWeights> mlp(const std::string& prefix, std::int64_t width) const {
    const std::int64_t hidden = config_.hidden_size;
    MlpWeights m;
    PD_ASSIGN_OR_RETURN(m.gate, matrix(prefix + "gate_proj.weight", width, hidden));
    PD_ASSIGN_OR_RETURN(m.up, matrix(prefix + "up_proj.weight", width, hidden));
    PD_ASSIGN_OR_RETURN(m.down, matrix(prefix + "down_proj.weight", hidden, width));
    return m;
  }

  Result<LayerWeights> layer(std::int64_t index) const {
    const ModelConfig& c = config_;
    const std::string p = fmt::format("model.layers.{}.", index);
    const std::int64_t hidden = c.hidden_size;
    const std::int64_t heads = c.num_attention_heads;
    LayerWeights l;
    PD_ASSIGN_OR_RETURN(l.input_norm, vector(p + "input_layernorm.weight", hidden));
    PD_ASSIGN_OR_RETURN(l.post_norm, vector(p + "post_attention_layernorm.weight", hidden));
    AttentionWeights& a = l.attn;
    if (c.q_lora_rank > 0) {
      PD_ASSIGN_OR_RETURN(a.q_a, matrix(p + "self_attn.q_a_proj.weight", c.q_lora_rank, hidden));
      PD_ASSIGN_OR_RETURN(a.q_a_norm, vector(p + "self_attn.q_a_layernorm.weight", c.q_lora_rank));
      PD_ASSIGN_OR_RETURN(a.q_b, matrix(p + "self_attn.q_b_proj.weight", heads * c.qkHeadDim(), c.q_lora_rank));
    } else {
      PD_ASSIGN_OR_RETURN(a.q, matrix(p + "self_attn.q_proj.weight", heads * c.qkHeadDim(), hidden));
    }
    PD_ASSIGN_OR_RETURN(a.kv_a, matrix(p + "self_attn.kv_a_proj_with_mqa.weight", c.latentDim(), hidden));
    PD_ASSIGN_OR_RETURN(a.kv_a_norm, vector(p + "self_attn.kv_a_layernorm.weight", c.kv_lora_rank));
    PD_ASSIGN_OR_RETURN(
        a.kv_b, matrix(p + "self_attn.kv_b_proj.weight", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank));
    PD_ASSIGN_OR_RETURN(a.o, matrix(p + "self_attn.o_proj.weight", hidden, heads * c.v_head_dim));
    l.moe = c.isMoeLayer(index);
    if (!l.moe) {
      PD_ASSIGN_OR_RETURN(l.dense, mlp(p + "mlp.", c.intermediate_size));
      return l;
    }
    PD_ASSIGN_OR_RETURN(l.router, matrix(p + "mlp.gate.weight", c.n_routed_experts, hidden));
    const std::string bias_name = p + "mlp.gate.e_score_correction_bias";
    if (checkpoint_.find(bias_name) != nullptr || c.topk_method == "noaux_tc") {
      PD_ASSIGN_OR_RETURN(l.router_bias, vector(bias_name, c.n_routed_experts));
    }
    l.experts.reserve(static_cast<std::size_t>(c.n_routed_experts));
    for (std::int64_t e = 0; e < c.n_routed_experts; ++e) {
      PD_ASSIGN_OR_RETURN(MlpWeights m, mlp(fmt::format("{}mlp.experts.{}.", p, e), c.moe_intermediate_size));
      l.experts.push_back(m);
    }
    if (c.n_shared_experts > 0) {
      PD_ASSIGN_OR_RETURN(l.shared, mlp(p + "mlp.shared_experts.", c.moe_intermediate_size * c.n_shared_experts));
    }
    return l;
  }

 private:
  const ModelConfig& config_;
  const Checkpoint& checkpoint_;
};

}  // namespace

ModelWeights::ModelWeights(ModelConfig config, Checkpoint checkpoint)
    : config_(std::move(config)), checkpoint_(std::move(checkpoint)) {}

ModelWeights::~ModelWeights() = default;

Result<std::unique_ptr<ModelWeights>> ModelWeights::load(const std::filesystem::path& dir) {
  PD_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::load(dir));
  PD_ASSIGN_OR_RETURN(Checkpoint checkpoint, Checkpoint::open(dir));
  return fromCheckpoint(std::move(config), std::move(checkpoint));
}

Result<std::unique_ptr<ModelWeights>> ModelWeights::fromCheckpoint(ModelConfig config, Checkpoint checkpoint) {
  if (config.scoring_func != "sigmoid") {
    return makeError(ErrorCode::Unsupported,
                     fmt::format("scoring_func '{}' is not supported (DeepSeek-V3 uses sigmoid)", config.scoring_func));
  }
  if (config.n_group < 1 || config.n_routed_experts % config.n_group != 0 || config.topk_group > config.n_group ||
      config.num_experts_per_tok > config.n_routed_experts || config.qk_rope_head_dim % 2 != 0) {
    return makeError(ErrorCode::InvalidArgument, "model config: inconsistent expert groups or odd rope dimension");
  }
  PD_TRY(validateCheckpoint(config, checkpoint));
  std::unique_ptr<ModelWeights> w(new ModelWeights(std::move(config), std::move(checkpoint)));
  PD_TRY(w->bind());
  return w;
}

Status ModelWeights::bind() {
  const ModelConfig& c = config_;
  const Binder b(c, checkpoint_);
  PD_ASSIGN_OR_RETURN(embed_, b.matrix("model.embed_tokens.weight", c.vocab_size, c.hidden_size));
  layers_.clear();
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
    PD_ASSIGN_OR_RETURN(LayerWeights layer, b.layer(l));
    layers_.push_back(std::move(layer));
  }
  PD_ASSIGN_OR_RETURN(final_norm_, b.vector("model.norm.weight", c.hidden_size));
  PD_ASSIGN_OR_RETURN(lm_head_, b.matrix("lm_head.weight", c.vocab_size, c.hidden_size));
  linear_dtype_ = layers_.empty() ? embed_.dtype : layers_[0].attn.kv_a.dtype;
  if (c.num_nextn_predict_layers > 0) {
    const std::int64_t index = c.num_hidden_layers;
    const std::string p = fmt::format("model.layers.{}.", index);
    MtpWeights m;
    PD_ASSIGN_OR_RETURN(m.enorm, b.vector(p + "enorm.weight", c.hidden_size));
    PD_ASSIGN_OR_RETURN(m.hnorm, b.vector(p + "hnorm.weight", c.hidden_size));
    PD_ASSIGN_OR_RETURN(m.eh_proj, b.matrix(p + "eh_proj.weight", c.hidden_size, 2 * c.hidden_size));
    PD_ASSIGN_OR_RETURN(m.block, b.layer(index));
    PD_ASSIGN_OR_RETURN(m.head_norm, b.vector(p + "shared_head.norm.weight", c.hidden_size));
    // The layer's own head and embedding copies when present; the main model's otherwise.
    m.head = lm_head_;
    if (checkpoint_.find(p + "shared_head.head.weight") != nullptr) {
      PD_ASSIGN_OR_RETURN(m.head, b.matrix(p + "shared_head.head.weight", c.vocab_size, c.hidden_size));
    }
    m.embed = embed_;
    if (checkpoint_.find(p + "embed_tokens.weight") != nullptr) {
      PD_ASSIGN_OR_RETURN(m.embed, b.matrix(p + "embed_tokens.weight", c.vocab_size, c.hidden_size));
    }
    mtp_ = std::move(m);
  }
  return okStatus();
}

Result<WeightMatrix> ModelWeights::matrix(const std::string& name) const {
  return Binder(config_, checkpoint_).matrix(name, -1, -1);
}

}  // namespace pd::model
