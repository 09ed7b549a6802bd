// shardTensors (engine/cuda/weight_shard.h): what a tensor-parallel rank of the CUDA engine
// uploads. On the golden checkpoints: one rank gives every tensor the device step binds, under its
// checkpoint name and shape, with the checkpoint's values (norms as F32); two ranks give the
// documented slices (heads, widths, vocabulary rows), whose values put side by side are the whole
// tensor's (FP8 weights compared dequantized, so re-blocked scales are checked too).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "pd/engine/kernels.h"
#include "pd/engine/model_weights.h"
#include "pd/engine/safetensors.h"
#include "weight_shard.h"

namespace {

namespace fs = std::filesystem;
using pd::gpu::HostTensor;
using i64 = std::int64_t;

fs::path golden(const std::string& name) {
  return fs::path(PD_TEST_DATA_DIR) / "golden" / name;
}

std::unique_ptr<pd::model::ModelWeights> load(const std::string& name, int rank, int size) {
  auto w = pd::model::ModelWeights::load(golden(name), {rank, size});
  EXPECT_TRUE(w.ok()) << w.error().toString();
  return w.ok() ? std::move(w).value() : nullptr;
}

std::map<std::string, HostTensor> byName(const std::vector<HostTensor>& tensors) {
  std::map<std::string, HostTensor> m;
  for (const HostTensor& t : tensors) EXPECT_TRUE(m.emplace(t.name, t).second) << "twice: " << t.name;
  return m;
}

// A host tensor as a float32 matrix (FP8 dequantized with its scale tensor and blocks).
std::vector<float> values(const std::map<std::string, HostTensor>& all, const HostTensor& t) {
  const i64 rows = t.shape.at(0);
  const i64 cols = t.shape.size() > 1 ? t.shape[1] : 1;
  pd::model::WeightMatrix m;
  m.dtype = t.dtype;
  m.rows = rows;
  m.cols = cols;
  m.data = t.data.data();
  if (t.dtype == pd::DType::F8E4M3) {
    const HostTensor& s = all.at(t.name + "_scale_inv");
    m.scale_inv = reinterpret_cast<const float*>(s.data.data());
    m.block_rows = t.block_rows;
    m.block_cols = t.block_cols;
    EXPECT_EQ(s.shape, (std::vector<i64>{m.scaleRows(), m.scaleCols()})) << t.name;
  }
  std::vector<float> out(static_cast<std::size_t>(rows * cols));
  for (i64 r = 0; r < rows; ++r) pd::model::dequantizeRow(m, r, out.data() + r * cols);
  return out;
}

TEST(WeightShard, OneRankIsTheCheckpointUnderItsNames) {
  for (const std::string name : {"tiny-bf16", "tiny-fp8"}) {
    auto w = load(name, 0, 1);
    ASSERT_TRUE(w);
    auto tensors = pd::gpu::shardTensors(*w);
    ASSERT_TRUE(tensors.ok()) << tensors.error().toString();
    const auto all = byName(*tensors);
    const pd::Checkpoint& ck = w->checkpoint();
    std::size_t matrices = 0;
    for (const HostTensor& t : *tensors) {
      const pd::TensorView* v = ck.find(t.name);
      ASSERT_NE(v, nullptr) << name << ": '" << t.name << "' is not in the checkpoint";
      EXPECT_EQ(t.shape, v->shape) << name << " " << t.name;
      if (t.dtype == v->dtype) {
        ASSERT_EQ(t.data.size(), v->data.size()) << t.name;
        EXPECT_EQ(std::memcmp(t.data.data(), v->data.data(), t.data.size()), 0) << name << " " << t.name;
        ++matrices;
      } else {
        // Norms and biases: F32 copies of the stored BF16 values.
        ASSERT_EQ(t.dtype, pd::DType::F32) << t.name;
        EXPECT_EQ(t.shape.size(), 1U) << t.name;
        pd::model::WeightMatrix m;
        m.dtype = v->dtype;
        m.rows = 1;
        m.cols = v->shape.at(0);
        m.data = v->data.data();
        std::vector<float> want(static_cast<std::size_t>(m.cols));
        pd::model::dequantizeRow(m, 0, want.data());
        EXPECT_EQ(std::memcmp(want.data(), t.data.data(), t.data.size()), 0) << name << " " << t.name;
      }
    }
    EXPECT_GT(matrices, 100U) << name;
    // Everything the model has except what the device step never binds, and nothing twice.
    for (const pd::TensorView* v : ck.tensors()) {
      EXPECT_EQ(all.count(v->name), 1U) << name << ": '" << v->name << "' is not uploaded";
    }
  }
}

TEST(WeightShard, TwoRanksHoldTheDocumentedSlicesOfEveryTensor) {
  for (const std::string name : {"tiny-bf16", "tiny-fp8"}) {
    auto whole_w = load(name, 0, 1);
    auto r0_w = load(name, 0, 2);
    auto r1_w = load(name, 1, 2);
    ASSERT_TRUE(whole_w && r0_w && r1_w);
    auto whole_t = pd::gpu::shardTensors(*whole_w);
    auto r0_t = pd::gpu::shardTensors(*r0_w);
    auto r1_t = pd::gpu::shardTensors(*r1_w);
    ASSERT_TRUE(whole_t.ok() && r0_t.ok() && r1_t.ok());
    const auto whole = byName(*whole_t);
    const auto r0 = byName(*r0_t);
    const auto r1 = byName(*r1_t);
    ASSERT_EQ(r0.size(), whole.size()) << name;
    ASSERT_EQ(r1.size(), whole.size()) << name;
    const pd::ModelConfig& c = whole_w->config();
    int rows_split = 0;
    int cols_split = 0;
    int reblocked = 0;
    for (const auto& [tname, t] : whole) {
      if (tname.ends_with("_scale_inv")) continue;
      const HostTensor& a = r0.at(tname);
      const HostTensor& b = r1.at(tname);
      EXPECT_EQ(a.dtype, t.dtype) << tname;
      if (b.block_cols != t.block_cols || b.block_rows != t.block_rows) ++reblocked;  // rank 1 starts mid-block
      const std::vector<float> full = values(whole, t);
      const std::vector<float> va = values(r0, a);
      const std::vector<float> vb = values(r1, b);
      if (a.shape == t.shape) {  // replicated
        EXPECT_EQ(va, full) << name << " " << tname;
        EXPECT_EQ(vb, full) << name << " " << tname;
        continue;
      }
      ASSERT_EQ(t.shape.size(), 2U) << tname;
      const i64 rows = t.shape[0];
      const i64 cols = t.shape[1];
      std::vector<float> joined;
      if (a.shape[1] == cols) {  // rows split: rank 0's rows, then rank 1's
        ++rows_split;
        EXPECT_EQ(a.shape[0] + b.shape[0], rows) << tname;
        joined = va;
        joined.insert(joined.end(), vb.begin(), vb.end());
      } else {  // columns split
        ++cols_split;
        EXPECT_EQ(a.shape[0], rows) << tname;
        EXPECT_EQ(a.shape[1] + b.shape[1], cols) << tname;
        for (i64 r = 0; r < rows; ++r) {
          joined.insert(joined.end(), va.begin() + r * a.shape[1], va.begin() + (r + 1) * a.shape[1]);
          joined.insert(joined.end(), vb.begin() + r * b.shape[1], vb.begin() + (r + 1) * b.shape[1]);
        }
      }
      EXPECT_EQ(joined, full) << name << " " << tname << ": the two slices are not the whole tensor";
    }
    // q_b, kv_b, gate and up of every MLP, the embedding and the head split by rows; o_proj and
    // every down_proj by columns.
    const i64 experts = c.n_routed_experts + 1;  // routed + shared, per MoE layer
    const i64 moe_layers = c.num_hidden_layers - c.first_k_dense_replace + c.num_nextn_predict_layers;
    EXPECT_GE(cols_split, moe_layers * experts) << name;
    EXPECT_GE(rows_split, 2 * moe_layers * experts) << name;
    if (name == "tiny-fp8") {
      // Expert widths of 64 cut at 32: the down_proj column slices no longer start on a 128 block.
      EXPECT_GT(reblocked, 0) << name;
    }
    EXPECT_EQ(r0.at("lm_head.weight").shape[0] + r1.at("lm_head.weight").shape[0], c.vocab_size);
    EXPECT_EQ(r0.at("model.layers.0.self_attn.o_proj.weight").shape[1], c.num_attention_heads / 2 * c.v_head_dim);
  }
}

}  // namespace
