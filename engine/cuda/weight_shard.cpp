// shardTensors (weight_shard.h): ModelWeights' bound (and sliced) weights as named host tensors.
#include "weight_shard.h"

#include <fmt/format.h>

namespace pd::gpu {
namespace {

using model::LayerWeights;
using model::MlpWeights;
using model::WeightMatrix;

class Collector {
 public:
  Status matrix(const std::string& name, const WeightMatrix& m) {
    const std::size_t element = dtypeSize(m.dtype);
    if (element == 0 || m.rows < 0 || m.cols < 0 || (m.data == nullptr && m.rows * m.cols > 0)) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("weight shard: '{}' ({}, {}x{}) cannot be uploaded",
                                                               name, dtypeName(m.dtype), m.rows, m.cols));
    }
    HostTensor t;
    t.name = name;
    t.dtype = m.dtype;
    t.shape = {m.rows, m.cols};
    t.data = {static_cast<const std::byte*>(m.data), static_cast<std::size_t>(m.rows * m.cols) * element};
    if (m.dtype != DType::F8E4M3) {
      out_.push_back(std::move(t));
      return okStatus();
    }
    if (m.scale_inv == nullptr || m.block_rows <= 0 || m.block_cols <= 0) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("weight shard: FP8 '{}' has no block scales", name));
    }
    t.block_rows = m.block_rows;
    t.block_cols = m.block_cols;
    out_.push_back(std::move(t));
    HostTensor s;
    s.name = name + "_scale_inv";
    s.dtype = DType::F32;
    s.shape = {m.scaleRows(), m.scaleCols()};
    s.data = {reinterpret_cast<const std::byte*>(m.scale_inv),
              static_cast<std::size_t>(m.scaleRows() * m.scaleCols()) * sizeof(float)};
    out_.push_back(std::move(s));
    return okStatus();
  }
  void vector(const std::string& name, const std::vector<float>& v) {
    HostTensor t;
    t.name = name;
    t.dtype = DType::F32;
    t.shape = {static_cast<std::int64_t>(v.size())};
    t.data = {reinterpret_cast<const std::byte*>(v.data()), v.size() * sizeof(float)};
    out_.push_back(std::move(t));
  }
  Status mlp(const std::string& prefix, const MlpWeights& m) {
    PD_TRY(matrix(prefix + "gate_proj.weight", m.gate));
    PD_TRY(matrix(prefix + "up_proj.weight", m.up));
    return matrix(prefix + "down_proj.weight", m.down);
  }
  Status layer(std::int64_t index, const LayerWeights& l) {
    const std::string p = fmt::format("model.layers.{}.", index);
    vector(p + "input_layernorm.weight", l.input_norm);
    vector(p + "post_attention_layernorm.weight", l.post_norm);
    const model::AttentionWeights& a = l.attn;
    if (a.q_a.rows > 0) {
      PD_TRY(matrix(p + "self_attn.q_a_proj.weight", a.q_a));
      vector(p + "self_attn.q_a_layernorm.weight", a.q_a_norm);
      PD_TRY(matrix(p + "self_attn.q_b_proj.weight", a.q_b));
    } else {
      PD_TRY(matrix(p + "self_attn.q_proj.weight", a.q));
    }
    PD_TRY(matrix(p + "self_attn.kv_a_proj_with_mqa.weight", a.kv_a));
    vector(p + "self_attn.kv_a_layernorm.weight", a.kv_a_norm);
    PD_TRY(matrix(p + "self_attn.kv_b_proj.weight", a.kv_b));
    PD_TRY(matrix(p + "self_attn.o_proj.weight", a.o));
    if (!l.moe) return mlp(p + "mlp.", l.dense);
    PD_TRY(matrix(p + "mlp.gate.weight", l.router));
    if (!l.router_bias.empty()) vector(p + "mlp.gate.e_score_correction_bias", l.router_bias);
    for (std::size_t e = 0; e < l.experts.size(); ++e) {
      PD_TRY(mlp(fmt::format("{}mlp.experts.{}.", p, e), l.experts[e]));
    }
    if (l.shared) PD_TRY(mlp(p + "mlp.shared_experts.", *l.shared));
    return okStatus();
  }
  std::vector<HostTensor> take() { return std::move(out_); }

 private:
  std::vector<HostTensor> out_;
};

}  // namespace

Result<std::vector<HostTensor>> shardTensors(const model::ModelWeights& w) {
  Collector c;
  PD_TRY(c.matrix("model.embed_tokens.weight", w.embedTokens()));
  const std::vector<LayerWeights>& layers = w.layers();
  for (std::size_t l = 0; l < layers.size(); ++l) PD_TRY(c.layer(static_cast<std::int64_t>(l), layers[l]));
  c.vector("model.norm.weight", w.finalNorm());
  PD_TRY(c.matrix("lm_head.weight", w.lmHead()));
  if (const model::MtpWeights* m = w.mtp(); m != nullptr) {
    const std::int64_t index = static_cast<std::int64_t>(layers.size());
    const std::string p = fmt::format("model.layers.{}.", index);
    c.vector(p + "enorm.weight", m->enorm);
    c.vector(p + "hnorm.weight", m->hnorm);
    PD_TRY(c.matrix(p + "eh_proj.weight", m->eh_proj));
    PD_TRY(c.layer(index, m->block));
    c.vector(p + "shared_head.norm.weight", m->head_norm);
    // ModelWeights shares the main head / embedding when the layer has no copy of its own.
    if (m->head.data != w.lmHead().data) PD_TRY(c.matrix(p + "shared_head.head.weight", m->head));
    if (m->embed.data != w.embedTokens().data) PD_TRY(c.matrix(p + "embed_tokens.weight", m->embed));
  }
  return c.take();
}

}  // namespace pd::gpu
