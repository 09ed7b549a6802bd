#include "pd/engine/model_weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>
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

// Cuts tensor-parallel slices out of bound matrices; copies land in `owned`.
class Slicer {
 public:
  explicit Slicer(std::vector<std::unique_ptr<std::byte[]>>& owned) : owned_(owned) {}

  // Rows [r0, r1): the data stays in place; FP8 scales are re-blocked when r0 is not on a block
  // boundary (block height gcd(r0, block_rows), so every new block lies inside one old block).
  WeightMatrix rows(const WeightMatrix& w, std::int64_t r0, std::int64_t r1) {
    WeightMatrix out = w;
    out.rows = r1 - r0;
    out.data = static_cast<const std::byte*>(w.data) + static_cast<std::size_t>(r0 * w.cols) * dtypeSize(w.dtype);
    if (w.dtype != DType::F8E4M3) return out;
    if (r0 % w.block_rows == 0) {
      out.scale_inv = w.scale_inv + (r0 / w.block_rows) * w.scaleCols();
      return out;
    }
    out.block_rows = std::gcd(r0, w.block_rows);
    const std::int64_t scale_cols = w.scaleCols();
    float* scales = allocate<float>(out.scaleRows() * scale_cols);
    for (std::int64_t i = 0; i < out.scaleRows(); ++i) {
      const float* src = w.scale_inv + ((r0 + i * out.block_rows) / w.block_rows) * scale_cols;
      std::memcpy(scales + i * scale_cols, src, static_cast<std::size_t>(scale_cols) * sizeof(float));
    }
    out.scale_inv = scales;
    return out;
  }

  // Columns [c0, c1): copied out row by row; FP8 scales re-blocked as for rows.
  WeightMatrix cols(const WeightMatrix& w, std::int64_t c0, std::int64_t c1) {
    WeightMatrix out = w;
    out.cols = c1 - c0;
    const std::size_t es = dtypeSize(w.dtype);
    std::byte* data = allocate<std::byte>(w.rows * out.cols * static_cast<std::int64_t>(es));
    const auto* src = static_cast<const std::byte*>(w.data);
    for (std::int64_t r = 0; r < w.rows; ++r) {
      std::memcpy(data + static_cast<std::size_t>(r * out.cols) * es,
                  src + static_cast<std::size_t>(r * w.cols + c0) * es, static_cast<std::size_t>(out.cols) * es);
    }
    out.data = data;
    if (w.dtype != DType::F8E4M3) return out;
    out.block_cols = std::gcd(c0, w.block_cols);
    const std::int64_t old_cols = w.scaleCols();
    const std::int64_t new_cols = out.scaleCols();
    float* scales = allocate<float>(w.scaleRows() * new_cols);
    for (std::int64_t i = 0; i < w.scaleRows(); ++i) {
      for (std::int64_t j = 0; j < new_cols; ++j) {
        scales[i * new_cols + j] = w.scale_inv[i * old_cols + (c0 + j * out.block_cols) / w.block_cols];
      }
    }
    out.scale_inv = scales;
    return out;
  }

  void mlp(MlpWeights& m, int rank, int size) {
    const ShardRange r = shardRange(m.gate.rows, rank, size);
    m.gate = rows(m.gate, r.begin, r.end);
    m.up = rows(m.up, r.begin, r.end);
    m.down = cols(m.down, r.begin, r.end);
  }

  void layer(LayerWeights& l, const ModelConfig& c, int rank, int size) {
    const ShardRange heads = shardRange(c.num_attention_heads, rank, size);
    AttentionWeights& a = l.attn;
    const std::int64_t qk = c.qkHeadDim();
    if (a.q_b.rows > 0) a.q_b = rows(a.q_b, heads.begin * qk, heads.end * qk);
    if (a.q.rows > 0) a.q = rows(a.q, heads.begin * qk, heads.end * qk);
    const std::int64_t kvw = c.qk_nope_head_dim + c.v_head_dim;
    a.kv_b = rows(a.kv_b, heads.begin * kvw, heads.end * kvw);
    a.o = cols(a.o, heads.begin * c.v_head_dim, heads.end * c.v_head_dim);
    if (!l.moe) {
      mlp(l.dense, rank, size);
      return;
    }
    for (MlpWeights& e : l.experts) mlp(e, rank, size);
    if (l.shared) mlp(*l.shared, rank, size);
  }

 private:
  template <class T>
  T* allocate(std::int64_t count) {
    owned_.push_back(std::make_unique<std::byte[]>(static_cast<std::size_t>(count) * sizeof(T)));
    return reinterpret_cast<T*>(owned_.back().get());
  }

  std::vector<std::unique_ptr<std::byte[]>>& owned_;
};

}  // namespace

ShardRange shardRange(std::int64_t n, int rank, int size) {
  return {n * rank / size, n * (rank + 1) / size};
}

ModelWeights::ModelWeights(ModelConfig config, Checkpoint checkpoint, TpShard shard)
    : config_(std::move(config)), checkpoint_(std::move(checkpoint)), shard_(shard) {}

ModelWeights::~ModelWeights() = default;

Result<std::unique_ptr<ModelWeights>> ModelWeights::load(const std::filesystem::path& dir, TpShard shard) {
  PD_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::load(dir));
  PD_ASSIGN_OR_RETURN(Checkpoint checkpoint, Checkpoint::open(dir));
  return fromCheckpoint(std::move(config), std::move(checkpoint), shard);
}

Result<std::unique_ptr<ModelWeights>> ModelWeights::fromCheckpoint(ModelConfig config, Checkpoint checkpoint,
                                                                   TpShard shard) {
  if (shard.size < 1 || shard.rank < 0 || shard.rank >= shard.size) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("tensor-parallel shard: rank {} of size {}", shard.rank, shard.size));
  }
  if (shard.size > 1) {
    const std::int64_t shared_width = config.moe_intermediate_size * std::max<std::int64_t>(1, config.n_shared_experts);
    if (config.num_attention_heads % shard.size != 0 || config.vocab_size < shard.size ||
        config.intermediate_size < shard.size || config.moe_intermediate_size < shard.size ||
        shared_width < shard.size) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("tensor parallel size {} does not divide the model: {} attention heads (must be a "
                                   "multiple), intermediate sizes {} / {}, vocab {}",
                                   shard.size, config.num_attention_heads, config.intermediate_size,
                                   config.moe_intermediate_size, config.vocab_size));
    }
  }
  if (config.scoring_func != "sigmoid") {
    return makeError(ErrorCode::Unsupported,
                     fmt::format("scoring_func '{}' is not supported (DeepSeek-V3 uses sigmoid)", config.scoring_func));
  }
  if (config.n_group < 1 || config.n_routed_experts % config.n_group != 0 || config.topk_group > config.n_group ||
      config.num_experts_per_tok > config.n_routed_experts || config.qk_rope_head_dim % 2 != 0) {
    return makeError(ErrorCode::InvalidArgument, "model config: inconsistent expert groups or odd rope dimension");
  }
  PD_TRY(validateCheckpoint(config, checkpoint));
  std::unique_ptr<ModelWeights> w(new ModelWeights(std::move(config), std::move(checkpoint), shard));
  PD_TRY(w->bind());
  if (shard.size > 1) PD_TRY(w->applyShard());
  return w;
}

Status ModelWeights::applyShard() {
  const ModelConfig& c = config_;
  const int rank = shard_.rank;
  const int size = shard_.size;
  Slicer slicer(owned_);
  const ShardRange vocab = shardRange(c.vocab_size, rank, size);
  // The MTP layer may share the main embedding / head: slice those from the unsliced originals.
  const WeightMatrix embed_full = embed_;
  const WeightMatrix head_full = lm_head_;
  embed_ = slicer.rows(embed_full, vocab.begin, vocab.end);
  lm_head_ = slicer.rows(head_full, vocab.begin, vocab.end);
  for (LayerWeights& l : layers_) slicer.layer(l, c, rank, size);
  if (mtp_) {
    MtpWeights& m = *mtp_;
    const auto same = [](const WeightMatrix& a, const WeightMatrix& b) { return a.data == b.data; };
    m.embed = same(m.embed, embed_full) ? embed_ : slicer.rows(m.embed, vocab.begin, vocab.end);
    m.head = same(m.head, head_full) ? lm_head_ : slicer.rows(m.head, vocab.begin, vocab.end);
    slicer.layer(m.block, c, rank, size);
  }
  return okStatus();
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
