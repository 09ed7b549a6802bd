#include "device_decode_step.h"

#include <cublas_v2.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>

#include "gpu_kernels.h"
#include "pd/common/kv_format.h"
#include "pd/common/log.h"
#include "pd/cuda/cuda_check.h"
#include "pd/engine/kernels.h"
#include "pd/engine/model_weights.h"
#include "pd/engine/rope.h"

namespace pd::gpu {
namespace {

using i64 = std::int64_t;
constexpr auto sz(i64 n) {
  return static_cast<std::size_t>(n);
}

static_assert(kMaxDecodeBatch == kFp8GemvMaxTokens);
static_assert(kMaxDecodeLatentDim == kernels::kMlaMaxLatentDim);

// Captured steps held at most (each a few hundred kB to a few MB of graph): every row count
// 1..64 in two context bands, or fewer counts in more bands.
constexpr std::size_t kMaxDecodeGraphs = 128;
// cuBLAS's workspace, set once before any capture so that captured GEMMs never allocate.
constexpr std::size_t kBlasWorkspaceBytes = std::size_t{32} << 20;

// What one step's captured (or eager) part computes with: the rows, the attention's context
// bound, the embedding table's choice, and what happens to each layer's new latents.
struct StepShape {
  i64 n = 0;
  i64 attention_context = 0;
  bool mtp = false;
  const std::uint8_t* zero = nullptr;  // MTP rows whose embedding is zeroed, or null
  bool collect = false;                // copy each layer's latents to the host buffer
  bool signal_layers = false;          // with collect: record layer_done[kv layer] after each copy (eager only)
  bool round = false;                  // round the latents to BF16 first
  // The prefill attention path (MlaPrefillAttention) over these segments of the plan's rows;
  // null: the absorbed decode attention. Never captured: its launches depend on the contexts.
  const std::vector<PrefillSegment>* segments = nullptr;
  i64 table_entries = 0;  // the plan's block_tables entries (prefill path)
};

// A linear layer y = W x on the device: an FP32 matrix for cuBLAS, the checkpoint's BF16 matrix
// as stored (bf16 numerics mode), or FP8 with block scales. Exactly one of f32, bf16, q is set.
struct Linear {
  i64 rows = 0;
  i64 cols = 0;
  const float* f32 = nullptr;
  const std::uint16_t* bf16 = nullptr;
  const std::uint8_t* q = nullptr;
  const float* scale_inv = nullptr;
  i64 block_rows = 128;
  i64 block_cols = 128;
};

struct Mlp {
  Linear gate, up, down;
};

// One of the experts' three linears over every expert of a layer, for the grouped GEMV: device
// arrays of the experts' matrices (and FP8 scales), all of one kind and shape.
struct GroupedLinear {
  math::GemvWeights kind = math::GemvWeights::F32;
  const void* const* weights = nullptr;  // device [experts]
  const float* const* scales = nullptr;  // device [experts], FP8 only
  i64 rows = 0;
  i64 cols = 0;
  i64 block_rows = 128;
  i64 block_cols = 128;
};

struct Layer {
  const float* input_norm = nullptr;
  const float* post_norm = nullptr;
  std::optional<Linear> q_a;  // q_lora_rank > 0: q_a, q_a_norm, q_b; otherwise q
  const float* q_a_norm = nullptr;
  Linear q;  // q_b or q
  Linear kv_a;
  const float* kv_a_norm = nullptr;
  const float* kv_b = nullptr;  // FP32 [heads * (nope + v), kv_lora_rank]
  Linear o;
  bool moe = false;
  Mlp dense;
  Linear router;
  const float* router_bias = nullptr;
  std::vector<Mlp> experts;
  GroupedLinear expert_gate, expert_up, expert_down;  // the experts' linears, grouped
  std::optional<Mlp> shared;
};

// The MTP layer: eh_proj over [enorm(embedding) ; hnorm(previous hidden)], one decoder layer,
// shared_head.norm and shared_head.head.
struct MtpLayer {
  const float* embed = nullptr;  // FP32 [vocab, hidden]: the layer's own copy, else the main one
  const float* enorm = nullptr;
  const float* hnorm = nullptr;
  Linear eh_proj;
  Layer block;
  const float* head_norm = nullptr;
  Linear head;
};

// Runs a BatchedGemm (decode_step_plan.h) on the device: alpha 1, beta 0.
// One product of a BF16 weight matrix `a` and BF16 inputs `b` into FP32 `c`, accumulated in FP32
// (the bf16 numerics mode); `g` as for runGemm, unbatched.
Status runGemmBf16(cublasHandle_t handle, const BatchedGemm& g, const std::uint16_t* a, const std::uint16_t* b,
                   float* c) {
  const auto i = [](i64 v) { return static_cast<int>(v); };
  const float one = 1.0F;
  const float zero = 0.0F;
  if (g.batch != 1) return makeError(ErrorCode::Internal, "device step: a batched BF16 product");
  const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  PD_CUDA_TRY(cublasGemmEx(handle, ta, tb, i(g.m), i(g.n), i(g.k), &one, a + g.a_offset, CUDA_R_16BF, i(g.lda), b,
                           CUDA_R_16BF, i(g.ldb), &zero, c, CUDA_R_32F, i(g.ldc), CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT));
  return okStatus();
}

Status runGemm(cublasHandle_t handle, const BatchedGemm& g, const float* a, const float* b, float* c) {
  const float one = 1.0F;
  const float zero = 0.0F;
  const auto i = [](i64 v) { return static_cast<int>(v); };
  const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (g.batch == 1) {
    PD_CUDA_TRY(cublasSgemm(handle, ta, tb, i(g.m), i(g.n), i(g.k), &one, a + g.a_offset, i(g.lda), b, i(g.ldb), &zero,
                            c, i(g.ldc)));
    return okStatus();
  }
  PD_CUDA_TRY(cublasSgemmStridedBatched(handle, ta, tb, i(g.m), i(g.n), i(g.k), &one, a + g.a_offset, i(g.lda),
                                        g.stride_a, b, i(g.ldb), g.stride_b, &zero, c, i(g.ldc), g.stride_c,
                                        i(g.batch)));
  return okStatus();
}

}  // namespace

struct DeviceDecodeStep::Impl {
  const ModelConfig& cfg;
  const DeviceWeights& weights;
  // Tensor parallelism (Options::tp; null: one rank). cfg with this rank's attention heads (for
  // the absorbed products, absorbQueryGemm and valueUpGemm, and every per-head size); its
  // vocabulary rows of the embeddings and LM heads.
  comm::DeviceCollectives* tp = nullptr;
  ModelConfig head_cfg;
  model::ShardRange vocab_rows;
  DecodeCacheShape cache_shape;
  cuda::Stream stream;
  cuda::BlasHandle blas;                                             // after the stream it runs on
  std::vector<cuda::DeviceBuffer<float>> owned;                      // FP32 copies
  std::vector<cuda::DeviceBuffer<const void*>> owned_weight_tables;  // GroupedLinear::weights
  std::vector<cuda::DeviceBuffer<const float*>> owned_scale_tables;  // GroupedLinear::scales
  std::vector<Layer> layers;
  const float* embed = nullptr;  // FP32 [vocab, hidden]
  const float* final_norm = nullptr;
  Linear head;
  std::optional<MtpLayer> mtp;
  i64 cache_layers = 0;  // main layers, + 1 with the MTP layer
  cuda::DeviceBuffer<float> inv_freq;
  // [layers, num_blocks, block_size, latent_dim]: `cache` for an F32 shape, `cache_bf16` for BF16;
  // `cache_fp8` for F8E4M3: [layers, num_blocks, block_size] tokens of kvFp8TokenBytes bytes.
  cuda::DeviceBuffer<float> cache;
  cuda::DeviceBuffer<std::uint16_t> cache_bf16;
  cuda::DeviceBuffer<std::uint8_t> cache_fp8;
  // Or memory the caller owns (useExternalCache: the device KV pool), of the same layout; then
  // none of the three above is allocated.
  std::byte* external_cache = nullptr;
  std::optional<MlaDecodeAttention> attention;
  std::optional<MlaPrefillAttention> prefill_attention;  // workspace of one chunk, kMaxDecodeBatch rows
  std::optional<DeviceSampler> sampler;                  // kMaxDecodeBatch rows of the vocabulary
  float softmax_scale = 1.0F;
  float eps = 1e-6F;
  // Workspaces for kMaxDecodeBatch tokens.
  cuda::DeviceBuffer<float> h, xn, qa, q, kv, latent, q_cat, o_lat, o, attn_out, ffn_out, router_logits, gx, act, up,
      gout, logits, cat, prev, sel;
  cuda::DeviceBuffer<float> head_mine, head_all;                      // tensor parallelism: the LM head's slices
  std::optional<cuda::PinnedHostBuffer<float>> staging;               // writeCache's host side, grown on demand
  std::optional<cuda::PinnedHostBuffer<std::uint16_t>> staging_bf16;  // the same for a BF16 cache
  std::optional<cuda::PinnedHostBuffer<std::byte>> staging_tokens;    // writeCacheTokens's host side
  cuda::DeviceBuffer<std::int64_t> positions, ctx_len, table_begin, write_slots;
  // [kMaxDecodeBatch]: the step's token ids, the rows whose logits it returns, the MTP rows whose
  // embedding is zeroed; the gather kernel reads them on the device.
  cuda::DeviceBuffer<std::int32_t> token_ids, logit_row_ids;
  cuda::DeviceBuffer<std::uint8_t> zero_rows;
  cuda::DeviceBuffer<std::int32_t> block_tables, topk_idx;
  // MoE grouping on the device: offsets [experts + 1], slot_of [kMaxDecodeBatch * top_k], and a
  // flag set when routing chose an id outside the experts (checked when run() ends).
  cuda::DeviceBuffer<std::int32_t> moe_offsets, slot_of, moe_failed;
  cuda::DeviceBuffer<std::int32_t> experts_used;  // [cache_layers]: experts with rows in the last run
  cuda::DeviceBuffer<float> topk_weight;
  i64 max_table_blocks = 0;
  i64 allocated_blocks = 0;  // cache_shape.num_blocks + paddingBlocks(block_size)
  gpu::Numerics numerics = gpu::Numerics::Fp32;
  // bf16 mode: a linear's input rounded to BF16 and packed, [kMaxDecodeBatch, xb_cols].
  cuda::DeviceBuffer<std::uint16_t> xb;
  i64 xb_cols = 0;
  // [cache_layers, kMaxDecodeBatch, latent_dim]: each layer's latents for the collector.
  std::optional<cuda::PinnedHostBuffer<float>> collected;
  // [cache_layers]: recorded after each layer's copy into `collected` in an eager step, so that
  // the host hands the layer to the collector while the device computes the next ones.
  std::vector<cuda::Event> layer_done;
  // CUDA graphs (Options::cuda_graphs); declared last, so released before what they point into.
  bool cuda_graphs = true;
  cuda::DeviceBuffer<std::byte> blas_workspace;
  DeviceDecodeStep::GraphStats graph_stats;  // held: graphs.size(), filled in by graphStats()
  DecodeGraphCache<cuda::Graph> graphs{kMaxDecodeGraphs};

  Impl(const ModelConfig& c, const DeviceWeights& w, DecodeCacheShape shape, cuda::Stream s, cuda::BlasHandle b)
      : cfg(c),
        weights(w),
        head_cfg(c),
        vocab_rows{0, c.vocab_size},
        cache_shape(shape),
        stream(std::move(s)),
        blas(std::move(b)) {}

  // This rank's part of a width split over the ranks (shardRange: the sizes ModelWeights cut).
  [[nodiscard]] int tpRank() const { return tp != nullptr ? tp->rank() : 0; }
  [[nodiscard]] int tpSize() const { return tp != nullptr ? tp->size() : 1; }
  [[nodiscard]] i64 localHeads() const { return head_cfg.num_attention_heads; }
  [[nodiscard]] i64 shardWidth(i64 full) const {
    const model::ShardRange r = model::shardRange(full, tpRank(), tpSize());
    return r.end - r.begin;
  }
  [[nodiscard]] i64 vocabRows() const { return vocab_rows.end - vocab_rows.begin; }

  // Sums a partial [count] result over the ranks on the step's stream (nothing on one rank).
  [[nodiscard]] Status reduce(float* x, i64 count) {
    if (tp == nullptr) return okStatus();
    return tp->allReduceSum(x, sz(count), stream.get());
  }
  // Waits for the stream; with tensor parallelism never past the collectives' deadline.
  [[nodiscard]] Status finish() {
    if (tp != nullptr) return tp->awaitStream(stream.get());
    return stream.synchronize();
  }

  [[nodiscard]] bool hasCache() const {
    return external_cache != nullptr || cache.size() > 0 || cache_bf16.size() > 0 || cache_fp8.size() > 0;
  }
  // The cache's first byte, whichever memory holds it.
  [[nodiscard]] std::byte* cacheBytes() const {
    if (external_cache != nullptr) return external_cache;
    if (cache_shape.dtype == DType::BF16) return reinterpret_cast<std::byte*>(cache_bf16.data());
    if (cache_shape.dtype == DType::F8E4M3) return reinterpret_cast<std::byte*>(cache_fp8.data());
    return reinterpret_cast<std::byte*>(cache.data());
  }

  [[nodiscard]] Result<const DeviceWeights::Tensor*> tensor(const std::string& name,
                                                            std::vector<std::int64_t> shape) const {
    const DeviceWeights::Tensor* t = weights.find(name);
    if (t == nullptr) return makeError(ErrorCode::NotFound, fmt::format("device decode: no tensor '{}'", name));
    if (t->shape != shape) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("device decode: tensor '{}' has {} dims, expected {}",
                                                               name, fmt::join(t->shape, "x"), fmt::join(shape, "x")));
    }
    return t;
  }

  // An FP32 device copy of a tensor of any weight dtype (FP8 dequantized with its block scales),
  // converted on the host from the device bytes: BF16 values are exact in FP32.
  [[nodiscard]] Result<const float*> f32Copy(const DeviceWeights::Tensor& t, const std::string& name) {
    if (t.dtype == DType::F32) return static_cast<const float*>(t.data);
    i64 n = 1;
    for (const std::int64_t dim : t.shape) n *= dim;
    PD_ASSIGN_OR_RETURN(const std::vector<std::byte> bytes, weights.readBack(t));
    std::vector<float> host(sz(n));
    if (t.dtype == DType::BF16 || t.dtype == DType::F16) {
      std::vector<std::uint16_t> bits(sz(n));
      std::memcpy(bits.data(), bytes.data(), sz(n) * 2);
      for (i64 i = 0; i < n; ++i) {
        host[sz(i)] = t.dtype == DType::BF16 ? bf16ToFloat(bits[sz(i)]) : f16ToFloat(bits[sz(i)]);
      }
    } else if (t.dtype == DType::F8E4M3) {
      if (t.shape.size() != 2) return makeError(ErrorCode::InvalidArgument, fmt::format("FP8 '{}' is not 2-D", name));
      const DeviceWeights::Tensor* s = weights.find(name + "_scale_inv");
      if (s == nullptr || s->dtype != DType::F32) {
        return makeError(ErrorCode::InvalidArgument, fmt::format("FP8 tensor '{}' has no F32 scale tensor", name));
      }
      PD_ASSIGN_OR_RETURN(const std::vector<std::byte> sbytes, weights.readBack(*s));
      model::WeightMatrix m;
      m.dtype = DType::F8E4M3;
      m.rows = t.shape[0];
      m.cols = t.shape[1];
      m.data = bytes.data();
      m.scale_inv = reinterpret_cast<const float*>(sbytes.data());
      if (cfg.quantization) {
        m.block_rows = cfg.quantization->block_out;
        m.block_cols = cfg.quantization->block_in;
      }
      if (t.block_rows > 0 && t.block_cols > 0) {  // re-blocked by a tensor-parallel slice
        m.block_rows = t.block_rows;
        m.block_cols = t.block_cols;
      }
      const std::vector<std::int64_t> want{m.scaleRows(), m.scaleCols()};
      if (s->shape != want) {
        return makeError(ErrorCode::InvalidArgument, fmt::format("scale of '{}' has the wrong shape", name));
      }
      for (i64 r = 0; r < m.rows; ++r) model::dequantizeRow(m, r, host.data() + r * m.cols);
    } else {
      return makeError(ErrorCode::Unsupported,
                       fmt::format("device decode: tensor '{}' has dtype {}", name, dtypeName(t.dtype)));
    }
    PD_ASSIGN_OR_RETURN(cuda::DeviceBuffer<float> buf, cuda::DeviceBuffer<float>::create(sz(n)));
    PD_TRY(buf.copyFromHost(host, stream));
    PD_TRY(stream.synchronize());  // `host` dies here
    owned.push_back(std::move(buf));
    return static_cast<const float*>(owned.back().data());
  }

  [[nodiscard]] Result<const float*> vector(const std::string& name, i64 n) {
    PD_ASSIGN_OR_RETURN(const DeviceWeights::Tensor* t, tensor(name, {n}));
    return f32Copy(*t, name);
  }
  [[nodiscard]] Result<const float*> matrixF32(const std::string& name, i64 rows, i64 cols) {
    PD_ASSIGN_OR_RETURN(const DeviceWeights::Tensor* t, tensor(name, {rows, cols}));
    return f32Copy(*t, name);
  }
  [[nodiscard]] Result<Linear> linear(const std::string& name, i64 rows, i64 cols) {
    PD_ASSIGN_OR_RETURN(const DeviceWeights::Tensor* t, tensor(name, {rows, cols}));
    Linear l;
    l.rows = rows;
    l.cols = cols;
    if (t->dtype == DType::BF16 && numerics == gpu::Numerics::Bf16) {
      l.bf16 = static_cast<const std::uint16_t*>(t->data);  // multiplied as stored: no copy
      return l;
    }
    if (t->dtype != DType::F8E4M3) {
      PD_ASSIGN_OR_RETURN(l.f32, f32Copy(*t, name));
      return l;
    }
    if (cfg.quantization) {
      l.block_rows = cfg.quantization->block_out;
      l.block_cols = cfg.quantization->block_in;
    }
    if (t->block_rows > 0 && t->block_cols > 0) {  // re-blocked by a tensor-parallel slice
      l.block_rows = t->block_rows;
      l.block_cols = t->block_cols;
    }
    const i64 srows = (rows + l.block_rows - 1) / l.block_rows;
    const i64 scols = (cols + l.block_cols - 1) / l.block_cols;
    PD_ASSIGN_OR_RETURN(const DeviceWeights::Tensor* s, tensor(name + "_scale_inv", {srows, scols}));
    if (s->dtype != DType::F32) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("device decode: '{}_scale_inv' is not F32", name));
    }
    l.q = static_cast<const std::uint8_t*>(t->data);
    l.scale_inv = static_cast<const float*>(s->data);
    return l;
  }
  [[nodiscard]] Result<Mlp> mlp(const std::string& prefix, i64 width) {
    const i64 d = cfg.hidden_size;
    Mlp m;
    PD_ASSIGN_OR_RETURN(m.gate, linear(prefix + "gate_proj.weight", width, d));
    PD_ASSIGN_OR_RETURN(m.up, linear(prefix + "up_proj.weight", width, d));
    PD_ASSIGN_OR_RETURN(m.down, linear(prefix + "down_proj.weight", d, width));
    return m;
  }

  // Groups one linear (`which`) of every expert for the grouped GEMV: the experts must all hold it
  // the same way (FP32 copy, BF16, or FP8 with the same blocks) at the same shape.
  [[nodiscard]] Result<GroupedLinear> grouped(const std::vector<Mlp>& experts, Linear Mlp::*which,
                                              const std::string& name) {
    GroupedLinear g;
    if (experts.empty()) return g;
    const Linear& first = experts.front().*which;
    g.kind = first.f32 != nullptr    ? math::GemvWeights::F32
             : first.bf16 != nullptr ? math::GemvWeights::Bf16
                                     : math::GemvWeights::Fp8;
    g.rows = first.rows;
    g.cols = first.cols;
    g.block_rows = first.block_rows;
    g.block_cols = first.block_cols;
    std::vector<const void*> w;
    std::vector<const float*> sc;
    for (const Mlp& e : experts) {
      const Linear& l = e.*which;
      const void* data = g.kind == math::GemvWeights::F32    ? static_cast<const void*>(l.f32)
                         : g.kind == math::GemvWeights::Bf16 ? static_cast<const void*>(l.bf16)
                                                             : static_cast<const void*>(l.q);
      if (data == nullptr || l.rows != g.rows || l.cols != g.cols ||
          (g.kind == math::GemvWeights::Fp8 &&
           (l.scale_inv == nullptr || l.block_rows != g.block_rows || l.block_cols != g.block_cols))) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("device decode: the experts' {} are not all stored alike", name));
      }
      w.push_back(data);
      sc.push_back(l.scale_inv);
    }
    PD_ASSIGN_OR_RETURN(cuda::DeviceBuffer<const void*> wt, cuda::DeviceBuffer<const void*>::create(w.size()));
    PD_TRY(wt.copyFromHost(w, stream));
    g.weights = wt.data();
    owned_weight_tables.push_back(std::move(wt));
    if (g.kind == math::GemvWeights::Fp8) {
      PD_ASSIGN_OR_RETURN(cuda::DeviceBuffer<const float*> st, cuda::DeviceBuffer<const float*>::create(sc.size()));
      PD_TRY(st.copyFromHost(sc, stream));
      g.scales = st.data();
      owned_scale_tables.push_back(std::move(st));
    }
    PD_TRY(stream.synchronize());  // `w` and `sc` die here
    return g;
  }

  [[nodiscard]] Result<Layer> makeLayer(i64 index) {
    const ModelConfig& c = cfg;
    const std::string p = fmt::format("model.layers.{}.", index);
    const i64 d = c.hidden_size;
    const i64 heads = localHeads();
    Layer l;
    PD_ASSIGN_OR_RETURN(l.input_norm, vector(p + "input_layernorm.weight", d));
    PD_ASSIGN_OR_RETURN(l.post_norm, vector(p + "post_attention_layernorm.weight", d));
    if (c.q_lora_rank > 0) {
      PD_ASSIGN_OR_RETURN(Linear q_a, linear(p + "self_attn.q_a_proj.weight", c.q_lora_rank, d));
      l.q_a = q_a;
      PD_ASSIGN_OR_RETURN(l.q_a_norm, vector(p + "self_attn.q_a_layernorm.weight", c.q_lora_rank));
      PD_ASSIGN_OR_RETURN(l.q, linear(p + "self_attn.q_b_proj.weight", heads * c.qkHeadDim(), c.q_lora_rank));
    } else {
      PD_ASSIGN_OR_RETURN(l.q, linear(p + "self_attn.q_proj.weight", heads * c.qkHeadDim(), d));
    }
    PD_ASSIGN_OR_RETURN(l.kv_a, linear(p + "self_attn.kv_a_proj_with_mqa.weight", c.latentDim(), d));
    PD_ASSIGN_OR_RETURN(l.kv_a_norm, vector(p + "self_attn.kv_a_layernorm.weight", c.kv_lora_rank));
    PD_ASSIGN_OR_RETURN(l.kv_b, matrixF32(p + "self_attn.kv_b_proj.weight", heads * (c.qk_nope_head_dim + c.v_head_dim),
                                          c.kv_lora_rank));
    PD_ASSIGN_OR_RETURN(l.o, linear(p + "self_attn.o_proj.weight", d, heads * c.v_head_dim));
    l.moe = c.isMoeLayer(index);
    if (!l.moe) {
      PD_ASSIGN_OR_RETURN(l.dense, mlp(p + "mlp.", shardWidth(c.intermediate_size)));
    } else {
      PD_ASSIGN_OR_RETURN(l.router, linear(p + "mlp.gate.weight", c.n_routed_experts, d));
      const std::string bias = p + "mlp.gate.e_score_correction_bias";
      if (weights.find(bias) != nullptr || c.topk_method == "noaux_tc") {
        PD_ASSIGN_OR_RETURN(l.router_bias, vector(bias, c.n_routed_experts));
      }
      for (i64 e = 0; e < c.n_routed_experts; ++e) {
        PD_ASSIGN_OR_RETURN(Mlp m, mlp(fmt::format("{}mlp.experts.{}.", p, e), shardWidth(c.moe_intermediate_size)));
        l.experts.push_back(m);
      }
      PD_ASSIGN_OR_RETURN(l.expert_gate, grouped(l.experts, &Mlp::gate, p + "mlp.experts.*.gate_proj"));
      PD_ASSIGN_OR_RETURN(l.expert_up, grouped(l.experts, &Mlp::up, p + "mlp.experts.*.up_proj"));
      PD_ASSIGN_OR_RETURN(l.expert_down, grouped(l.experts, &Mlp::down, p + "mlp.experts.*.down_proj"));
      if (c.n_shared_experts > 0) {
        PD_ASSIGN_OR_RETURN(Mlp m,
                            mlp(p + "mlp.shared_experts.", shardWidth(c.moe_intermediate_size * c.n_shared_experts)));
        l.shared = m;
      }
    }
    return l;
  }

  [[nodiscard]] Status bindMtp() {
    const ModelConfig& c = cfg;
    const i64 d = c.hidden_size;
    const i64 index = c.num_hidden_layers;
    const std::string p = fmt::format("model.layers.{}.", index);
    MtpLayer t;
    PD_ASSIGN_OR_RETURN(t.enorm, vector(p + "enorm.weight", d));
    PD_ASSIGN_OR_RETURN(t.hnorm, vector(p + "hnorm.weight", d));
    PD_ASSIGN_OR_RETURN(t.eh_proj, linear(p + "eh_proj.weight", d, 2 * d));
    PD_ASSIGN_OR_RETURN(t.block, makeLayer(index));
    PD_ASSIGN_OR_RETURN(t.head_norm, vector(p + "shared_head.norm.weight", d));
    t.head = head;
    if (weights.find(p + "shared_head.head.weight") != nullptr) {
      PD_ASSIGN_OR_RETURN(t.head, linear(p + "shared_head.head.weight", vocabRows(), d));
    }
    t.embed = embed;
    if (weights.find(p + "embed_tokens.weight") != nullptr) {
      PD_ASSIGN_OR_RETURN(t.embed, matrixF32(p + "embed_tokens.weight", vocabRows(), d));
    }
    mtp = t;
    return okStatus();
  }

  // The device cache of cache_shape (allocated here unless `external`, memory of the same layout
  // the caller owns) and what depends on it (attention splits, block tables).
  [[nodiscard]] Status allocateCache(std::byte* external) {
    const ModelConfig& c = cfg;
    const DecodeCacheShape& cs = cache_shape;
    const i64 ld = c.latentDim();
    const i64 slots = cs.num_blocks * cs.block_size;
    const i64 max_ctx = c.max_position_embeddings > 0 ? std::min(c.max_position_embeddings, slots) : slots;
    // The caller's blocks, then the padding blocks of padded graph rows (padDecodeStep).
    allocated_blocks = cs.num_blocks + paddingBlocks(cs.block_size);
    const i64 allocated_slots = allocated_blocks * cs.block_size;
    external_cache = external;
    if (external != nullptr) {
      // nothing to allocate: the caller's memory holds cache_layers x allocated_slots tokens
    } else if (cs.dtype == DType::BF16) {
      PD_ASSIGN_OR_RETURN(cache_bf16,
                          cuda::DeviceBuffer<std::uint16_t>::create(sz(cache_layers * allocated_slots * ld)));
    } else if (cs.dtype == DType::F8E4M3) {
      PD_ASSIGN_OR_RETURN(cache_fp8, cuda::DeviceBuffer<std::uint8_t>::create(sz(cache_layers * allocated_slots) *
                                                                              kvTokenBytes(DType::F8E4M3, ld)));
    } else {
      PD_ASSIGN_OR_RETURN(cache, cuda::DeviceBuffer<float>::create(sz(cache_layers * allocated_slots * ld)));
    }
    PD_ASSIGN_OR_RETURN(MlaDecodeAttention att,
                        MlaDecodeAttention::create({kMaxDecodeBatch, localHeads(), ld, max_ctx}));
    attention.emplace(std::move(att));
    max_table_blocks = (max_ctx + cs.block_size - 1) / cs.block_size;
    // Real rows' tables plus one block for each padded row.
    PD_ASSIGN_OR_RETURN(block_tables, cuda::DeviceBuffer<std::int32_t>::create(
                                          sz(kMaxDecodeBatch * max_table_blocks + kMaxDecodeBatch)));
    return okStatus();
  }

  // One decoder layer on h (the previous block's output `delta` still to be added, or null);
  // afterwards `delta` is this layer's FFN output.
  [[nodiscard]] Status runLayer(const Layer& layer, i64 kv_layer, const StepShape& shape, const float*& delta) {
    const i64 n = shape.n;
    const i64 d = cfg.hidden_size;
    PD_TRY(rmsNormResidual(h.data(), delta, layer.input_norm, xn.data(), n, d, eps, stream));
    PD_TRY(attentionBlock(layer, kv_layer, shape));
    PD_TRY(rmsNormResidual(h.data(), attn_out.data(), layer.post_norm, xn.data(), n, d, eps, stream));
    if (layer.moe) {
      PD_TRY(moeBlock(layer, n, kv_layer));
    } else {
      PD_TRY(runMlp(layer.dense, xn.data(), n, ffn_out.data()));
    }
    PD_TRY(reduce(ffn_out.data(), n * d));  // each rank's part of the widths (and experts' widths)
    delta = ffn_out.data();
    return okStatus();
  }

  // y[t * y_stride + r] = W[r] . x[t * x_stride ...] for t < n.
  [[nodiscard]] Status apply(const Linear& w, const float* x, i64 x_stride, i64 n, float* y, i64 y_stride) {
    if (n <= 0) return okStatus();
    if (w.bf16 != nullptr) {
      if (n > kMaxDecodeBatch || w.cols > xb_cols) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("device step: a BF16 linear of {} columns over {} rows (workspace {} x {})",
                                     w.cols, n, kMaxDecodeBatch, xb_cols));
      }
      PD_CUDA_TRY(kernels::launchRowsToBf16(x, x_stride, n, w.cols, xb.data(), stream.get()));
      return runGemmBf16(blas.get(), linearGemm(w.rows, w.cols, n, w.cols, y_stride), w.bf16, xb.data(), y);
    }
    if (w.f32 == nullptr) {
      kernels::Fp8GemvArgs a;
      a.q = w.q;
      a.scale_inv = w.scale_inv;
      a.rows = static_cast<int>(w.rows);
      a.cols = static_cast<int>(w.cols);
      a.block_rows = static_cast<int>(w.block_rows);
      a.block_cols = static_cast<int>(w.block_cols);
      a.scale_cols = static_cast<int>((w.cols + w.block_cols - 1) / w.block_cols);
      a.x = x;
      a.x_stride = x_stride;
      a.tokens = static_cast<int>(n);
      a.y = y;
      a.y_stride = y_stride;
      return fp8Gemv(a, stream);
    }
    return runGemm(blas.get(), linearGemm(w.rows, w.cols, n, x_stride, y_stride), w.f32, x, y);
  }

  // SwiGLU MLP of n rows of x (stride hidden) into out (stride hidden).
  [[nodiscard]] Status runMlp(const Mlp& m, const float* x, i64 n, float* out) {
    const i64 d = cfg.hidden_size;
    const i64 width = m.gate.rows;
    PD_TRY(apply(m.gate, x, d, n, act.data(), width));
    PD_TRY(apply(m.up, x, d, n, up.data(), width));
    PD_CUDA_TRY(kernels::launchSiluMul(act.data(), up.data(), n * width, stream.get()));
    return apply(m.down, act.data(), width, n, out, d);
  }

  [[nodiscard]] Status attentionBlock(const Layer& l, i64 kv_layer, const StepShape& shape) {
    const ModelConfig& c = cfg;
    const i64 n = shape.n;
    const i64 d = c.hidden_size;
    const i64 heads = localHeads();
    const i64 dn = c.qk_nope_head_dim;
    const i64 dr = c.qk_rope_head_dim;
    const i64 dv = c.v_head_dim;
    const i64 qk = dn + dr;
    const i64 r = c.kv_lora_rank;
    const i64 ld = r + dr;
    const cudaStream_t s = stream.get();
    if (l.q_a) {
      const i64 qr = c.q_lora_rank;
      PD_TRY(apply(*l.q_a, xn.data(), d, n, qa.data(), qr));
      PD_TRY(rmsNormResidual(qa.data(), nullptr, l.q_a_norm, qa.data(), n, qr, eps, stream));
      PD_TRY(apply(l.q, qa.data(), qr, n, q.data(), heads * qk));
    } else {
      PD_TRY(apply(l.q, xn.data(), d, n, q.data(), heads * qk));
    }
    PD_TRY(apply(l.kv_a, xn.data(), d, n, kv.data(), ld));
    // latent = [RMSNorm(kv[:r]) ; RoPE(kv[r:])], as the CPU engine's writeLatent input.
    PD_TRY(rmsNormRows(kv.data(), ld, l.kv_a_norm, latent.data(), ld, n, r, eps, stream));
    PD_CUDA_TRY(cudaMemcpy2DAsync(latent.data() + r, sz(ld) * sizeof(float), kv.data() + r, sz(ld) * sizeof(float),
                                  sz(dr) * sizeof(float), sz(n), cudaMemcpyDeviceToDevice, s));
    const i64 half = dr / 2;
    PD_TRY(ropeInterleaved(latent.data(), RopeShape{n, 1, ld, ld, r, half}, inv_freq.data(), positions.data(), stream));
    PD_TRY(ropeInterleaved(q.data(), RopeShape{n, heads, heads * qk, qk, dn, half}, inv_freq.data(), positions.data(),
                           stream));
    const i64 layer_slots = kv_layer * allocated_blocks * cache_shape.block_size;
    const bool bf16_cache = cache_shape.dtype == DType::BF16;
    const bool fp8_cache = cache_shape.dtype == DType::F8E4M3;
    void* layer_cache = cacheBytes() + sz(layer_slots) * kvTokenBytes(cache_shape.dtype, ld);
    // The collector gets the latents as computed (the host cache rounds them as it stores them,
    // and a KV sink gets what the CPU engine's sink gets); the cache and the attention get them
    // rounded as the host cache holds them (an FP8 cache encodes them as it stores them).
    if (shape.collect) {  // into pinned memory: a plain copy node when captured
      PD_CUDA_TRY(cudaMemcpyAsync(collected->data() + kv_layer * kMaxDecodeBatch * ld, latent.data(),
                                  sz(n * ld) * sizeof(float), cudaMemcpyDeviceToHost, s));
      if (shape.signal_layers) PD_TRY(layer_done[sz(kv_layer)].record(stream));
    }
    if (shape.round) PD_TRY(roundToBf16(latent.data(), n * ld, stream));
    // Each row's latent into its cache slot: one scatter over the uploaded slots.
    // (A BF16 cache rounds as it stores: the attention below reads the rounded values.)
    const i64 cache_slots = allocated_blocks * cache_shape.block_size;
    if (fp8_cache) {
      PD_TRY(scatterRowsKvFp8(latent.data(), n, write_slots.data(), static_cast<std::uint8_t*>(layer_cache),
                              cache_slots, ld, stream));
    } else if (bf16_cache) {
      PD_TRY(scatterRowsBf16(latent.data(), n, write_slots.data(), static_cast<std::uint16_t*>(layer_cache),
                             cache_slots, ld, stream));
    } else {
      PD_TRY(
          scatterRows(latent.data(), n, write_slots.data(), static_cast<float*>(layer_cache), cache_slots, ld, stream));
    }
    if (shape.segments != nullptr) {
      // Prefill path: keys and values up-projected per context chunk, o [n, heads, v] directly.
      MlaPrefillAttention::Batch pb;
      pb.q = q.data();
      pb.rows = n;
      pb.cache_layer = layer_cache;
      pb.cache_dtype = cache_shape.dtype;
      pb.block_size = cache_shape.block_size;
      pb.num_blocks = allocated_blocks;
      pb.block_tables = block_tables.data();
      pb.table_entries = shape.table_entries;
      pb.ctx_len = ctx_len.data();
      pb.segments = *shape.segments;
      pb.kv_b = l.kv_b;
      pb.scale = softmax_scale;
      pb.out = o.data();
      PD_TRY(prefill_attention->run(pb, blas.get(), stream));
      PD_TRY(apply(l.o, o.data(), heads * dv, n, attn_out.data(), d));
      return reduce(attn_out.data(), n * d);  // each rank's heads
    }
    // q_cat[t][h] = (W_UK_h^T q_nope[t][h] ; q_pe[t][h]).
    PD_TRY(runGemm(blas.get(), absorbQueryGemm(head_cfg, n), l.kv_b, q.data(), q_cat.data()));
    PD_CUDA_TRY(cudaMemcpy2DAsync(q_cat.data() + r, sz(ld) * sizeof(float), q.data() + dn, sz(qk) * sizeof(float),
                                  sz(dr) * sizeof(float), sz(n * heads), cudaMemcpyDeviceToDevice, s));
    MlaDecodeAttention::Batch b;
    b.q_cat = q_cat.data();
    b.tokens = n;
    b.cache_layer = layer_cache;
    b.cache_dtype = cache_shape.dtype;
    b.block_size = cache_shape.block_size;
    b.num_blocks = allocated_blocks;
    b.block_tables = block_tables.data();
    b.table_begin = table_begin.data();
    b.ctx_len = ctx_len.data();
    b.max_context_in_batch = shape.attention_context;
    b.scale = softmax_scale;
    b.out = o_lat.data();
    PD_TRY(attention->run(b, stream));
    // o[t][h] = W_UV_h o_lat[t][h][:r].
    PD_TRY(runGemm(blas.get(), valueUpGemm(head_cfg, n), l.kv_b, o_lat.data(), o.data()));
    PD_TRY(apply(l.o, o.data(), heads * dv, n, attn_out.data(), d));
    return reduce(attn_out.data(), n * d);  // each rank's heads
  }

  // Everything of a step between its uploads and its LM head: the embedding rows, every layer (or
  // the MTP layer) and the final norm into xn. This is what a CUDA graph captures: it reads its
  // per-step inputs from device buffers that run() fills first, and it never waits for the host.
  [[nodiscard]] Status forwardBody(const StepShape& shape) {
    const i64 n = shape.n;
    const i64 d = cfg.hidden_size;
    const float* table = shape.mtp ? mtp->embed : embed;
    // A rank's vocabulary rows, zeros for the others' ids: the sum over the ranks is the embedding.
    PD_TRY(gatherShardRows(table, vocab_rows.begin, vocabRows(), token_ids.data(), shape.zero, n, d, h.data(), stream));
    PD_TRY(reduce(h.data(), n * d));
    const float* delta = nullptr;  // the previous block's output, added into h by the next norm
    const float* out_norm = final_norm;
    if (!shape.mtp) {
      for (std::size_t l = 0; l < layers.size(); ++l) PD_TRY(runLayer(layers[l], static_cast<i64>(l), shape, delta));
    } else {
      // h = eh_proj [enorm(embedding) ; hnorm(prev_hidden)], then the MTP block on its own KV layer.
      const MtpLayer& mt = *mtp;
      PD_TRY(rmsNormResidual(h.data(), nullptr, mt.enorm, xn.data(), n, d, eps, stream));
      PD_TRY(rmsNormResidual(prev.data(), nullptr, mt.hnorm, attn_out.data(), n, d, eps, stream));
      const std::size_t row = sz(d) * sizeof(float);
      const cudaStream_t s = stream.get();
      PD_CUDA_TRY(cudaMemcpy2DAsync(cat.data(), 2 * row, xn.data(), row, row, sz(n), cudaMemcpyDeviceToDevice, s));
      PD_CUDA_TRY(
          cudaMemcpy2DAsync(cat.data() + d, 2 * row, attn_out.data(), row, row, sz(n), cudaMemcpyDeviceToDevice, s));
      PD_TRY(apply(mt.eh_proj, cat.data(), 2 * d, n, h.data(), d));
      PD_TRY(runLayer(mt.block, cfg.num_hidden_layers, shape, delta));
      out_norm = mt.head_norm;
    }
    return rmsNormResidual(h.data(), delta, out_norm, xn.data(), n, d, eps, stream);
  }

  // Runs forwardBody as a CUDA graph when graphs are on (see DecodeGraphCache for when a key is
  // eager, captured or replayed), else eagerly with the exact context.
  // `signalled`: whether the body ran eagerly with each collected layer's event recorded (then
  // the caller may hand layers over as they complete; never inside a captured graph).
  [[nodiscard]] Status runBody(StepShape shape, bool& signalled) {
    signalled = false;
    StepShape eager = shape;
    eager.signal_layers = shape.collect;
    if (!cuda_graphs || shape.segments != nullptr) {
      ++graph_stats.eager;
      signalled = eager.signal_layers;
      return forwardBody(eager);
    }
    DecodeGraphKey key;
    key.tokens = shape.n;
    key.attention_context =
        graphAttentionContext(shape.attention_context, kernels::kMlaSplitPositions, attention->limits().max_context);
    key.mtp = shape.mtp;
    key.zero_embedding = shape.zero != nullptr;
    key.collect_latents = shape.collect;
    key.round_latents = shape.round;
    auto [entry, action] = graphs.use(key);
    if (action == DecodeGraphCache<cuda::Graph>::Action::Eager) {
      ++graph_stats.eager;
      signalled = eager.signal_layers;
      return forwardBody(eager);
    }
    if (action == DecodeGraphCache<cuda::Graph>::Action::Capture) {
      StepShape banded = shape;
      banded.attention_context = key.attention_context;
      Result<cuda::Graph> graph = cuda::Graph::capture(stream, [&]() { return forwardBody(banded); });
      if (!graph.ok()) {
        entry->eager_only = true;
        ++graph_stats.capture_failures;
        ++graph_stats.eager;
        log::warn("cuda",
                  "decode step: capturing {} rows (context {}) as a CUDA graph failed, the shape stays eager: {}",
                  key.tokens, key.attention_context, graph.error().toString());
        signalled = eager.signal_layers;
        return forwardBody(eager);
      }
      entry->graph.emplace(std::move(*graph));
      ++graph_stats.captured;
      return entry->graph->launch(stream);
    }
    ++graph_stats.replayed;
    return entry->graph->launch(stream);
  }

  // logits [k, vocab] = head x for k rows of x (stride hidden). With tensor parallelism each rank
  // multiplies its vocabulary rows, the slices are gathered (padded to the largest) and put in
  // place, and the stream is awaited within the collectives' deadline before anything reads them.
  [[nodiscard]] Status lmHead(const Linear& head_w, const float* x, i64 k) {
    const i64 d = cfg.hidden_size;
    const i64 vocab = cfg.vocab_size;
    if (tp == nullptr) return apply(head_w, x, d, k, logits.data(), vocab);
    const int ranks = tpSize();
    const i64 pad = (vocab + ranks - 1) / ranks;
    PD_TRY(apply(head_w, x, d, k, head_mine.data(), pad));
    PD_TRY(tp->allGather(head_mine.data(), head_all.data(), sz(k * pad), stream.get()));
    for (int r = 0; r < ranks; ++r) {
      const model::ShardRange v = model::shardRange(vocab, r, ranks);
      if (v.end <= v.begin) continue;
      PD_CUDA_TRY(cudaMemcpy2DAsync(logits.data() + v.begin, sz(vocab) * sizeof(float), head_all.data() + r * k * pad,
                                    sz(pad) * sizeof(float), sz(v.end - v.begin) * sizeof(float), sz(k),
                                    cudaMemcpyDeviceToDevice, stream.get()));
    }
    return tp->awaitStream(stream.get());
  }

  // The experts' `g` over the grouped rows of x (stride x_stride) into y (stride y_stride).
  [[nodiscard]] Status applyGrouped(const GroupedLinear& g, const float* x, i64 x_stride, float* y, i64 y_stride) {
    kernels::GroupedGemvArgs a;
    a.kind = g.kind;
    a.weights = g.weights;
    a.scales = g.scales;
    a.groups = static_cast<int>(cfg.n_routed_experts);
    a.rows = static_cast<int>(g.rows);
    a.cols = static_cast<int>(g.cols);
    a.block_rows = static_cast<int>(g.block_rows);
    a.block_cols = static_cast<int>(g.block_cols);
    a.scale_cols = static_cast<int>((g.cols + g.block_cols - 1) / g.block_cols);
    a.offsets = moe_offsets.data();
    a.x = x;
    a.x_stride = x_stride;
    a.y = y;
    a.y_stride = y_stride;
    return groupedGemv(a, stream);
  }

  // Routing, grouping, the experts and the combine, all on the device: nothing crosses to the
  // host and nothing waits (a bad routing id is flagged and reported when run() ends).
  [[nodiscard]] Status moeBlock(const Layer& l, i64 n, i64 kv_layer) {
    const ModelConfig& c = cfg;
    const i64 d = c.hidden_size;
    const i64 n_exp = c.n_routed_experts;
    const i64 top_k = c.num_experts_per_tok;
    PD_TRY(apply(l.router, xn.data(), d, n, router_logits.data(), n_exp));
    math::RoutingShape shape;
    shape.experts = n_exp;
    shape.groups = c.n_group;
    shape.topk_group = c.topk_group;
    shape.top_k = top_k;
    shape.routed_scaling = static_cast<float>(c.routed_scaling_factor);
    PD_TRY(routeNoauxTc(router_logits.data(), l.router_bias, shape, n, topk_idx.data(), topk_weight.data(), stream));
    // Group (token, k) slots by expert, as the CPU engine does: expert e's rows are
    // [moe_offsets[e], moe_offsets[e + 1]) of gx.
    PD_TRY(moeGroup(topk_idx.data(), n, top_k, n_exp, moe_offsets.data(), slot_of.data(), moe_failed.data(),
                    experts_used.data() + kv_layer, stream));
    PD_TRY(moeGather(xn.data(), slot_of.data(), n, top_k, d, gx.data(), stream));
    const i64 slots = n * top_k;
    const i64 width = l.expert_gate.rows;
    PD_TRY(applyGrouped(l.expert_gate, gx.data(), d, act.data(), width));
    PD_TRY(applyGrouped(l.expert_up, gx.data(), d, up.data(), width));
    PD_CUDA_TRY(kernels::launchSiluMul(act.data(), up.data(), slots * width, stream.get()));
    PD_TRY(applyGrouped(l.expert_down, act.data(), width, gout.data(), d));
    const float* shared = nullptr;
    if (l.shared) {
      PD_TRY(runMlp(*l.shared, xn.data(), n, gout.data() + slots * d));
      shared = gout.data() + slots * d;
    }
    // out[t] = sum over the chosen experts in ascending id order of w * y, then + shared.
    return moeCombine(topk_idx.data(), topk_weight.data(), slot_of.data(), n, top_k, gout.data(), d, shared,
                      ffn_out.data(), stream);
  }
};

DeviceDecodeStep::DeviceDecodeStep(std::unique_ptr<Impl> impl, DecodeCacheShape cache)
    : impl_(std::move(impl)), cache_shape_(cache) {}

DeviceDecodeStep::~DeviceDecodeStep() {
  if (impl_) {
    const Status status = PD_CUDA_STATUS(cudaSetDevice(impl_->weights.device().index));
    if (!status.ok()) cuda::detail::logReleaseFailure(status);
  }
}

Result<std::unique_ptr<DeviceDecodeStep>> DeviceDecodeStep::create(const DeviceWeights& weights,
                                                                   const ModelConfig& config, const Options& options) {
  PD_TRY(checkDecodeModel(config));
  const ModelConfig& c = config;
  const DecodeCacheShape& cs = options.cache;
  PD_TRY(checkCacheShape(cs));
  PD_CUDA_TRY(cudaSetDevice(weights.device().index));
  PD_ASSIGN_OR_RETURN(cuda::Stream stream, cuda::Stream::create());
  PD_ASSIGN_OR_RETURN(cuda::BlasHandle blas, cuda::BlasHandle::create(stream));
  PD_CUDA_TRY(cublasSetMathMode(blas.get(), CUBLAS_PEDANTIC_MATH));
  PD_CUDA_TRY(cublasSetPointerMode(blas.get(), CUBLAS_POINTER_MODE_HOST));
  auto impl = std::make_unique<Impl>(config, weights, cs, std::move(stream), std::move(blas));
  Impl& m = *impl;
  m.numerics = options.numerics;
  m.cuda_graphs = options.cuda_graphs;
  if (options.tp != nullptr && options.tp->size() > 1) {
    m.tp = options.tp;
    const int rank = m.tpRank();
    const int ranks = m.tpSize();
    if (rank < 0 || rank >= ranks || c.num_attention_heads % ranks != 0) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("device step: rank {} of {} tensor-parallel ranks ({} attention heads)", rank, ranks,
                                   c.num_attention_heads));
    }
    m.head_cfg.num_attention_heads = c.num_attention_heads / ranks;
    m.vocab_rows = model::shardRange(c.vocab_size, rank, ranks);
    if (m.cuda_graphs && !m.tp->capturable()) {
      log::info("cuda", "decode step: {} collectives are not captured, so steps run eagerly (no CUDA graphs)",
                m.tp->kind());
      m.cuda_graphs = false;
    }
  }
  PD_ASSIGN_OR_RETURN(m.blas_workspace, cuda::DeviceBuffer<std::byte>::create(kBlasWorkspaceBytes));
  PD_CUDA_TRY(cublasSetWorkspace(m.blas.get(), m.blas_workspace.data(), m.blas_workspace.bytes()));
  m.softmax_scale = static_cast<float>(c.softmaxScale());
  m.eps = static_cast<float>(c.rms_norm_eps);
  PD_ASSIGN_OR_RETURN(m.embed, m.matrixF32("model.embed_tokens.weight", m.vocabRows(), c.hidden_size));
  for (i64 l = 0; l < c.num_hidden_layers; ++l) {
    PD_ASSIGN_OR_RETURN(Layer layer, m.makeLayer(l));
    m.layers.push_back(std::move(layer));
  }
  PD_ASSIGN_OR_RETURN(m.final_norm, m.vector("model.norm.weight", c.hidden_size));
  PD_ASSIGN_OR_RETURN(m.head, m.linear("lm_head.weight", m.vocabRows(), c.hidden_size));
  if (c.num_nextn_predict_layers > 0) PD_TRY(m.bindMtp());
  m.cache_layers = c.num_hidden_layers + (m.mtp ? 1 : 0);
  PD_ASSIGN_OR_RETURN(const std::vector<float> freq, model::ropeInvFreq(c));
  PD_ASSIGN_OR_RETURN(m.inv_freq, cuda::DeviceBuffer<float>::create(freq.size()));
  PD_TRY(m.inv_freq.copyFromHost(freq, m.stream));

  const i64 n = kMaxDecodeBatch;
  const i64 d = c.hidden_size;
  const i64 heads = m.localHeads();
  const i64 ld = c.latentDim();
  const i64 qk = c.qkHeadDim();
  PD_TRY(m.allocateCache(nullptr));
  i64 widest = c.intermediate_size;
  widest = std::max(widest, c.moe_intermediate_size * std::max<i64>(c.n_shared_experts, 1));
  const i64 top_k = std::max<i64>(c.num_experts_per_tok, 1);
  const auto make = [](cuda::DeviceBuffer<float>& b, i64 count) -> Status {
    PD_ASSIGN_OR_RETURN(b, cuda::DeviceBuffer<float>::create(sz(std::max<i64>(count, 1))));
    return okStatus();
  };
  PD_TRY(make(m.h, n * d));
  PD_TRY(make(m.xn, n * d));
  PD_TRY(make(m.qa, n * std::max<i64>(c.q_lora_rank, 1)));
  PD_TRY(make(m.q, n * heads * qk));
  PD_TRY(make(m.kv, n * ld));
  PD_TRY(make(m.latent, n * ld));
  PD_TRY(make(m.q_cat, n * heads * ld));
  PD_TRY(make(m.o_lat, n * heads * ld));
  PD_TRY(make(m.o, n * heads * c.v_head_dim));
  PD_TRY(make(m.attn_out, n * d));
  PD_TRY(make(m.ffn_out, n * d));
  PD_TRY(make(m.router_logits, n * std::max<i64>(c.n_routed_experts, 1)));
  PD_TRY(make(m.gx, n * top_k * d));
  PD_TRY(make(m.act, n * top_k * widest));
  PD_TRY(make(m.up, n * top_k * widest));
  PD_TRY(make(m.gout, (n * top_k + n) * d));
  PD_TRY(make(m.logits, n * c.vocab_size));
  if (m.tp != nullptr) {  // the LM head's slice of every rank, padded to the largest
    const i64 pad = (c.vocab_size + m.tpSize() - 1) / m.tpSize();
    PD_TRY(make(m.head_mine, n * pad));
    PD_TRY(make(m.head_all, m.tpSize() * n * pad));
  }
  PD_TRY(make(m.topk_weight, n * top_k));
  PD_TRY(make(m.cat, n * 2 * d));
  PD_TRY(make(m.prev, n * d));
  PD_TRY(make(m.sel, n * d));
  if (m.numerics == gpu::Numerics::Bf16) {
    // The widest input of any linear: eh_proj's [emb ; h], o_proj's heads x v, an MLP's down_proj.
    m.xb_cols = std::max({2 * d, heads * c.v_head_dim, widest, std::max<i64>(c.q_lora_rank, 1)});
    PD_ASSIGN_OR_RETURN(m.xb, cuda::DeviceBuffer<std::uint16_t>::create(sz(n * m.xb_cols)));
  }
  PD_ASSIGN_OR_RETURN(DeviceSampler sampler, DeviceSampler::create(n, c.vocab_size));
  m.sampler.emplace(std::move(sampler));
  PD_ASSIGN_OR_RETURN(
      MlaPrefillAttention prefill,
      MlaPrefillAttention::create({n, heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank}));
  m.prefill_attention.emplace(std::move(prefill));
  PD_ASSIGN_OR_RETURN(cuda::PinnedHostBuffer<float> collected,
                      cuda::PinnedHostBuffer<float>::create(sz(m.cache_layers * n * ld)));
  m.collected.emplace(std::move(collected));
  m.layer_done.reserve(sz(m.cache_layers));
  for (i64 l = 0; l < m.cache_layers; ++l) {
    PD_ASSIGN_OR_RETURN(cuda::Event e, cuda::Event::create());
    m.layer_done.push_back(std::move(e));
  }
  PD_ASSIGN_OR_RETURN(m.topk_idx, cuda::DeviceBuffer<std::int32_t>::create(sz(n * top_k)));
  PD_ASSIGN_OR_RETURN(m.slot_of, cuda::DeviceBuffer<std::int32_t>::create(sz(n * top_k)));
  PD_ASSIGN_OR_RETURN(m.moe_offsets,
                      cuda::DeviceBuffer<std::int32_t>::create(sz(std::max<i64>(c.n_routed_experts, 1) + 1)));
  PD_ASSIGN_OR_RETURN(m.moe_failed, cuda::DeviceBuffer<std::int32_t>::create(1));
  PD_ASSIGN_OR_RETURN(m.experts_used, cuda::DeviceBuffer<std::int32_t>::create(sz(m.cache_layers)));
  PD_ASSIGN_OR_RETURN(m.positions, cuda::DeviceBuffer<std::int64_t>::create(sz(n)));
  PD_ASSIGN_OR_RETURN(m.write_slots, cuda::DeviceBuffer<std::int64_t>::create(sz(n)));
  PD_ASSIGN_OR_RETURN(m.token_ids, cuda::DeviceBuffer<std::int32_t>::create(sz(n)));
  PD_ASSIGN_OR_RETURN(m.logit_row_ids, cuda::DeviceBuffer<std::int32_t>::create(sz(n)));
  PD_ASSIGN_OR_RETURN(m.zero_rows, cuda::DeviceBuffer<std::uint8_t>::create(sz(n)));
  PD_ASSIGN_OR_RETURN(m.ctx_len, cuda::DeviceBuffer<std::int64_t>::create(sz(n)));
  PD_ASSIGN_OR_RETURN(m.table_begin, cuda::DeviceBuffer<std::int64_t>::create(sz(n)));
  PD_TRY(m.stream.synchronize());
  return std::unique_ptr<DeviceDecodeStep>(new DeviceDecodeStep(std::move(impl), cs));
}

Result<std::vector<float>> DeviceDecodeStep::step(std::span<const DecodeSequence> batch) {
  PD_ASSIGN_OR_RETURN(const DecodeStepPlan plan, planDecodeStep(impl_->cfg, cache_shape_, batch));
  std::vector<std::int64_t> rows(sz(plan.tokens));
  std::iota(rows.begin(), rows.end(), 0);
  Request request;
  request.logit_rows = rows;
  PD_ASSIGN_OR_RETURN(Output out, run(plan, request));
  return std::move(out.logits);
}

namespace {

double linearBytes(const Linear& l) {
  const double elements = static_cast<double>(l.rows) * static_cast<double>(l.cols);
  if (l.f32 != nullptr) return 4.0 * elements;
  if (l.bf16 != nullptr) return 2.0 * elements;
  const i64 scale_rows = (l.rows + l.block_rows - 1) / l.block_rows;
  const i64 scale_cols = (l.cols + l.block_cols - 1) / l.block_cols;
  const double scales = static_cast<double>(scale_rows) * static_cast<double>(scale_cols);
  return elements + 4.0 * scales;  // FP8 bytes and their F32 block scales
}

double mlpBytes(const Mlp& m) {
  return linearBytes(m.gate) + linearBytes(m.up) + linearBytes(m.down);
}

}  // namespace

double DeviceDecodeStep::stepBytes(std::span<const std::int64_t> contexts,
                                   std::span<const std::int32_t> experts_used) const {
  const Impl& m = *impl_;
  const ModelConfig& c = m.cfg;
  const double d = static_cast<double>(c.hidden_size);
  const double heads = static_cast<double>(m.localHeads());
  const double ld = static_cast<double>(c.latentDim());
  double positions = 0.0;  // cached latents every layer reads
  for (const std::int64_t ctx : contexts) positions += static_cast<double>(std::max<std::int64_t>(ctx, 1));
  double bytes = 4.0 * d * static_cast<double>(contexts.size());  // the embedding rows (FP32 copy)
  for (std::size_t i = 0; i < m.layers.size(); ++i) {
    const Layer& l = m.layers[i];
    bytes += 4.0 * 2.0 * d;  // input and post-attention norms
    if (l.q_a) bytes += linearBytes(*l.q_a) + 4.0 * static_cast<double>(c.q_lora_rank);
    bytes += linearBytes(l.q) + linearBytes(l.kv_a) + 4.0 * static_cast<double>(c.kv_lora_rank);
    // kv_b (FP32): W_UK for the absorbed query, W_UV for the values.
    bytes += 4.0 * heads * static_cast<double>(c.qk_nope_head_dim + c.v_head_dim) * static_cast<double>(c.kv_lora_rank);
    bytes += linearBytes(l.o);
    bytes += static_cast<double>(kvTokenBytes(cache_shape_.dtype, ld)) * positions;  // the layer's latents
    if (!l.moe) {
      bytes += mlpBytes(l.dense);
      continue;
    }
    bytes += linearBytes(l.router);
    if (!l.experts.empty() && i < experts_used.size()) {
      const auto used = std::min<std::int64_t>(std::max<std::int32_t>(experts_used[i], 0),
                                               static_cast<std::int64_t>(l.experts.size()));
      bytes += static_cast<double>(used) * mlpBytes(l.experts.front());
    }
    if (l.shared) bytes += mlpBytes(*l.shared);
  }
  return bytes + 4.0 * d + linearBytes(m.head);  // final norm, LM head
}

double DeviceDecodeStep::batchOneBytes(std::int64_t context) const {
  // One token chooses exactly num_experts_per_tok distinct experts in every MoE layer.
  const std::vector<std::int32_t> used(
      impl_->layers.size(), static_cast<std::int32_t>(std::max<std::int64_t>(impl_->cfg.num_experts_per_tok, 0)));
  const std::int64_t contexts[] = {context};
  return stepBytes(contexts, used);
}

Result<std::vector<std::int32_t>> DeviceDecodeStep::expertsUsedLastRun() {
  Impl& m = *impl_;
  std::vector<std::int32_t> used(sz(m.cache_layers), 0);
  PD_CUDA_TRY(cudaSetDevice(m.weights.device().index));
  PD_TRY(m.experts_used.copyToHost(used, m.stream));
  PD_TRY(m.stream.synchronize());
  return used;
}

DeviceDecodeStep::GraphStats DeviceDecodeStep::graphStats() const {
  GraphStats stats = impl_->graph_stats;
  stats.held = static_cast<std::int64_t>(impl_->graphs.size());
  return stats;
}

bool DeviceDecodeStep::hasMtp() const {
  return impl_->mtp.has_value();
}

std::int64_t DeviceDecodeStep::cacheLayers() const {
  return impl_->cache_layers;
}

namespace {

// Whether `plan` is one this step can run: the sizes agree, every slot and block id is inside
// the cache, the contexts fit the attention workspace.
Status checkPlan(const DecodeStepPlan& plan, const DecodeCacheShape& cs, i64 max_context, i64 max_table_blocks,
                 i64 vocab) {
  const i64 n = plan.tokens;
  const auto bad = [](std::string what) {
    return makeError(ErrorCode::InvalidArgument, "device step: " + std::move(what));
  };
  if (n <= 0 || n > kMaxDecodeBatch) return bad(fmt::format("{} rows; a step takes 1..{}", n, kMaxDecodeBatch));
  if (plan.token_ids.size() != sz(n) || plan.positions.size() != sz(n) || plan.ctx_len.size() != sz(n) ||
      plan.table_begin.size() != sz(n) || plan.write_slot.size() != sz(n)) {
    return bad("the plan's per-row arrays do not have one entry per row");
  }
  const i64 slots = cs.num_blocks * cs.block_size;
  for (i64 t = 0; t < n; ++t) {
    if (plan.token_ids[sz(t)] < 0 || plan.token_ids[sz(t)] >= vocab) {
      return bad(fmt::format("row {}: token id {} outside [0, {})", t, plan.token_ids[sz(t)], vocab));
    }
    if (plan.write_slot[sz(t)] < 0 || plan.write_slot[sz(t)] >= slots) {
      return bad(fmt::format("row {} writes slot {} outside the cache's {}", t, plan.write_slot[sz(t)], slots));
    }
    if (plan.ctx_len[sz(t)] < 1 || plan.ctx_len[sz(t)] > plan.max_context) {
      return bad(fmt::format("row {} attends to {} positions (the plan's maximum is {})", t, plan.ctx_len[sz(t)],
                             plan.max_context));
    }
    const i64 blocks = (plan.ctx_len[sz(t)] + cs.block_size - 1) / cs.block_size;
    if (plan.table_begin[sz(t)] < 0 || plan.table_begin[sz(t)] + blocks > static_cast<i64>(plan.block_tables.size())) {
      return bad(fmt::format("row {}'s block table runs past the plan's tables", t));
    }
  }
  for (const std::int32_t id : plan.block_tables) {
    if (id < 0 || id >= cs.num_blocks) return bad(fmt::format("block id {} outside [0, {})", id, cs.num_blocks));
  }
  if (plan.max_context > max_context) {
    return bad(
        fmt::format("a context of {} positions exceeds the step's {} (the cache's positions, at most "
                    "max_position_embeddings)",
                    plan.max_context, max_context));
  }
  if (static_cast<i64>(plan.block_tables.size()) > kMaxDecodeBatch * max_table_blocks) {
    return bad("block tables longer than the model's context");
  }
  return okStatus();
}

}  // namespace

Result<DeviceDecodeStep::Output> DeviceDecodeStep::run(const DecodeStepPlan& plan, const Request& request) {
  Impl& m = *impl_;
  const ModelConfig& c = m.cfg;
  if (!m.attention || !m.hasCache()) {
    return makeError(ErrorCode::ResourceExhausted, "device step: no device cache (a cache shape did not fit)");
  }
  PD_TRY(checkPlan(plan, cache_shape_, m.attention->limits().max_context, m.max_table_blocks, c.vocab_size));
  const i64 n = plan.tokens;
  const i64 d = c.hidden_size;
  for (const auto rows : {request.logit_rows, request.hidden_rows}) {
    for (const std::int64_t r : rows) {
      if (r < 0 || r >= n) {
        return makeError(ErrorCode::InvalidArgument, fmt::format("device step: output row {} outside [0, {})", r, n));
      }
    }
  }
  if (!request.sample_rows.empty() && request.sample_rows.size() != request.logit_rows.size()) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("device step: {} sampling requests for {} logit rows",
                                                             request.sample_rows.size(), request.logit_rows.size()));
  }
  if (request.mtp) {
    if (!m.mtp) return makeError(ErrorCode::Unsupported, "the checkpoint has no MTP layer");
    if (static_cast<i64>(request.prev_hidden.size()) != n * d) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("device step: MTP needs {} x {} previous hidden "
                                                               "values, got {}",
                                                               n, d, request.prev_hidden.size()));
    }
    if (!request.zero_embedding.empty() && static_cast<i64>(request.zero_embedding.size()) != n) {
      return makeError(ErrorCode::InvalidArgument, "device step: zero_embedding needs one flag per row");
    }
  }
  PD_CUDA_TRY(cudaSetDevice(m.weights.device().index));
  const cudaStream_t s = m.stream.get();
  // With graphs, a step on the absorbed path runs (warm-up, capture, replay alike) with its rows
  // padded to graphRowBucket(n): the body computes `rows` rows, the outputs are the first n.
  const bool prefill_path = request.prefill_attention;
  const i64 body_rows = m.cuda_graphs && !prefill_path ? graphRowBucket(n) : n;
  std::optional<DecodeStepPlan> padded;
  if (body_rows > n) padded.emplace(padDecodeStep(plan, body_rows, cache_shape_));
  const DecodeStepPlan& body = padded ? *padded : plan;
  // Every per-step input goes to its device buffer first: the body (or its graph) reads them there.
  PD_TRY(m.positions.copyFromHost(body.positions, m.stream));
  PD_TRY(m.ctx_len.copyFromHost(body.ctx_len, m.stream));
  PD_TRY(m.table_begin.copyFromHost(body.table_begin, m.stream));
  PD_TRY(m.write_slots.copyFromHost(body.write_slot, m.stream));  // checkPlan, padDecodeStep: inside the cache
  PD_TRY(m.block_tables.copyFromHost(body.block_tables, m.stream));
  PD_TRY(m.token_ids.copyFromHost(body.token_ids, m.stream));  // checkPlan: in the vocabulary
  PD_CUDA_TRY(cudaMemsetAsync(m.moe_failed.data(), 0, sizeof(std::int32_t), s));
  PD_CUDA_TRY(cudaMemsetAsync(m.experts_used.data(), 0, m.experts_used.bytes(), s));
  StepShape shape;
  shape.n = body_rows;
  shape.attention_context = plan.max_context;
  shape.mtp = request.mtp;
  shape.collect = request.collector != nullptr;
  shape.round = request.round_latents_to_bf16;
  std::vector<PrefillSegment> segments;
  if (request.prefill_attention) {
    segments = prefillSegments(plan);
    shape.segments = &segments;
    shape.table_entries = static_cast<i64>(plan.block_tables.size());
  }
  if (request.mtp) {
    PD_TRY(m.prev.copyFromHost(request.prev_hidden, m.stream));
    if (body_rows > n) {  // padded rows: a zero hidden state, their embedding kept
      PD_CUDA_TRY(cudaMemsetAsync(m.prev.data() + n * d, 0, sz((body_rows - n) * d) * sizeof(float), s));
    }
    if (!request.zero_embedding.empty()) {
      PD_TRY(m.zero_rows.copyFromHost(request.zero_embedding, m.stream));
      if (body_rows > n) PD_CUDA_TRY(cudaMemsetAsync(m.zero_rows.data() + n, 0, sz(body_rows - n), s));
      shape.zero = m.zero_rows.data();
    }
  }
  bool signalled = false;
  PD_TRY(m.runBody(shape, signalled));
  // The collector's layers: in an eager step each as soon as its copy is done, while the device
  // computes the next layers (the KV sink's puts overlap the step); after a replayed graph, all
  // once the step is over (below).
  const i64 ld = c.latentDim();
  const i64 first_layer = request.mtp ? c.num_hidden_layers : 0;
  const i64 last_layer = request.mtp ? c.num_hidden_layers : c.num_hidden_layers - 1;
  const auto collect = [&](i64 layer) -> Status {
    const float* at = m.collected->data() + layer * kMaxDecodeBatch * ld;
    return request.collector->onLatents(layer, std::span<const float>(at, sz(n * ld)));
  };
  if (request.collector != nullptr && signalled) {
    for (i64 layer = first_layer; layer <= last_layer; ++layer) {
      PD_TRY(m.layer_done[sz(layer)].synchronize());
      PD_TRY(collect(layer));
      ++m.graph_stats.streamed_layers;
    }
  }
  const Linear* out_head = request.mtp ? &m.mtp->head : &m.head;
  Output out;
  const auto k = static_cast<i64>(request.logit_rows.size());
  if (k > 0) {
    // The LM head over the chosen rows only, gathered unless they are rows 0..k-1.
    bool leading = true;
    for (i64 i = 0; i < k; ++i) leading = leading && request.logit_rows[sz(i)] == i;
    const float* x = m.xn.data();
    if (!leading) {
      // The rows were checked to lie in [0, n) above.
      const std::vector<std::int32_t> rows(request.logit_rows.begin(), request.logit_rows.end());
      PD_TRY(m.logit_row_ids.copyFromHost(rows, m.stream));
      PD_TRY(gatherRows(m.xn.data(), n, m.logit_row_ids.data(), nullptr, k, d, m.sel.data(), m.stream));
      x = m.sel.data();
    }
    PD_TRY(m.lmHead(*out_head, x, k));
    if (!request.sample_rows.empty()) {
      PD_ASSIGN_OR_RETURN(out.sampled, m.sampler->sample(m.logits.data(), request.sample_rows, m.stream));
    } else {
      out.logits.resize(sz(k * c.vocab_size));
      PD_TRY(m.logits.copyToHost(out.logits, m.stream));
    }
  }
  // Main model: hidden after the final norm; MTP: the block output before shared_head.norm.
  const float* hidden_src = request.mtp ? m.h.data() : m.xn.data();
  out.hidden.resize(request.hidden_rows.size() * sz(d));
  for (std::size_t i = 0; i < request.hidden_rows.size(); ++i) {
    PD_CUDA_TRY(cudaMemcpyAsync(out.hidden.data() + i * sz(d), hidden_src + request.hidden_rows[i] * d,
                                sz(d) * sizeof(float), cudaMemcpyDeviceToHost, s));
  }
  std::vector<std::int32_t> moe_failed(1, 0);
  PD_TRY(m.moe_failed.copyToHost(moe_failed, m.stream));
  PD_TRY(m.finish());
  if (moe_failed[0] != 0) {
    return makeError(ErrorCode::Internal, "device step: MoE routing chose an expert outside the model's experts");
  }
  if (request.collector != nullptr && !signalled) {
    for (i64 layer = first_layer; layer <= last_layer; ++layer) PD_TRY(collect(layer));
  }
  return out;
}

namespace {
// The tokens of a cache write's runs (slots[i] .. + counts[i]), each run inside [0, cache_slots).
Result<i64> runTokens(std::span<const std::int64_t> slots, std::span<const std::int64_t> counts, i64 cache_slots) {
  i64 total = 0;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] < 0 || counts[i] <= 0 || slots[i] + counts[i] > cache_slots) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("device cache write: slots [{}, {}) outside [0, {})",
                                                               slots[i], slots[i] + counts[i], cache_slots));
    }
    total += counts[i];
  }
  return total;
}
}  // namespace

Status DeviceDecodeStep::writeCache(std::int64_t kv_layer, std::span<const std::int64_t> slots,
                                    std::span<const std::int64_t> counts, std::span<const float> values) {
  Impl& m = *impl_;
  const i64 ld = m.cfg.latentDim();
  const i64 cache_slots = cache_shape_.num_blocks * cache_shape_.block_size;
  if (kv_layer < 0 || kv_layer >= m.cache_layers || slots.size() != counts.size() || !m.hasCache()) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("device cache write: layer {} of {}, {} slots and {} counts", kv_layer, m.cache_layers,
                                 slots.size(), counts.size()));
  }
  PD_ASSIGN_OR_RETURN(const i64 total, runTokens(slots, counts, cache_slots));
  if (static_cast<i64>(values.size()) != total * ld) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("device cache write: {} values for {} slots of {}", values.size(), total, ld));
  }
  if (cache_shape_.dtype == DType::F8E4M3) {
    return makeError(ErrorCode::InvalidArgument, "device cache write: an FP8 cache takes tokens (writeCacheTokens)");
  }
  if (total == 0) return okStatus();
  PD_CUDA_TRY(cudaSetDevice(m.weights.device().index));
  const i64 layer_offset = kv_layer * m.allocated_blocks * cache_shape_.block_size * ld;
  i64 at = 0;
  // Every writeCache ends synchronized, so a staging buffer is free when the next one starts.
  if (cache_shape_.dtype == DType::BF16) {
    // Encoded on the host (exact for latents a BF16 host cache held), then copied.
    if (!m.staging_bf16 || m.staging_bf16->size() < values.size()) {
      m.staging_bf16.reset();
      PD_ASSIGN_OR_RETURN(cuda::PinnedHostBuffer<std::uint16_t> buf,
                          cuda::PinnedHostBuffer<std::uint16_t>::create(values.size()));
      m.staging_bf16.emplace(std::move(buf));
    }
    std::uint16_t* bits = m.staging_bf16->data();
    for (std::size_t i = 0; i < values.size(); ++i) bits[i] = math::bf16Encode(values[i]);
    for (std::size_t i = 0; i < slots.size(); ++i) {
      PD_CUDA_TRY(cudaMemcpyAsync(reinterpret_cast<std::uint16_t*>(m.cacheBytes()) + layer_offset + slots[i] * ld,
                                  bits + at * ld, sz(counts[i] * ld) * sizeof(std::uint16_t), cudaMemcpyHostToDevice,
                                  m.stream.get()));
      at += counts[i];
    }
    return m.stream.synchronize();
  }
  if (!m.staging || m.staging->size() < values.size()) {
    m.staging.reset();
    PD_ASSIGN_OR_RETURN(cuda::PinnedHostBuffer<float> buf, cuda::PinnedHostBuffer<float>::create(values.size()));
    m.staging.emplace(std::move(buf));
  }
  std::memcpy(m.staging->data(), values.data(), values.size_bytes());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    PD_CUDA_TRY(cudaMemcpyAsync(reinterpret_cast<float*>(m.cacheBytes()) + layer_offset + slots[i] * ld,
                                m.staging->data() + at * ld, sz(counts[i] * ld) * sizeof(float), cudaMemcpyHostToDevice,
                                m.stream.get()));
    at += counts[i];
  }
  return m.stream.synchronize();
}

Status DeviceDecodeStep::writeCacheTokens(std::int64_t kv_layer, std::span<const std::int64_t> slots,
                                          std::span<const std::int64_t> counts, std::span<const std::byte> tokens) {
  Impl& m = *impl_;
  const i64 ld = m.cfg.latentDim();
  const i64 cache_slots = cache_shape_.num_blocks * cache_shape_.block_size;
  if (cache_shape_.dtype != DType::F8E4M3 || !m.hasCache()) {
    return makeError(ErrorCode::InvalidArgument, "device cache write: tokens go to an FP8 cache only");
  }
  if (kv_layer < 0 || kv_layer >= m.cache_layers || slots.size() != counts.size()) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("device cache write: layer {} of {}, {} slots and {} counts", kv_layer, m.cache_layers,
                                 slots.size(), counts.size()));
  }
  PD_ASSIGN_OR_RETURN(const i64 total, runTokens(slots, counts, cache_slots));
  const std::size_t token = kvTokenBytes(DType::F8E4M3, ld);
  if (tokens.size() != sz(total) * token) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("device cache write: {} bytes for {} tokens of {} bytes",
                                                             tokens.size(), total, token));
  }
  if (total == 0) return okStatus();
  PD_CUDA_TRY(cudaSetDevice(m.weights.device().index));
  // Every write ends synchronized, so the staging buffer is free when the next one starts.
  if (!m.staging_tokens || m.staging_tokens->size() < tokens.size()) {
    m.staging_tokens.reset();
    PD_ASSIGN_OR_RETURN(cuda::PinnedHostBuffer<std::byte> buf,
                        cuda::PinnedHostBuffer<std::byte>::create(tokens.size()));
    m.staging_tokens.emplace(std::move(buf));
  }
  std::memcpy(m.staging_tokens->data(), tokens.data(), tokens.size());
  const std::size_t layer_offset = sz(kv_layer * m.allocated_blocks * cache_shape_.block_size) * token;
  i64 at = 0;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    PD_CUDA_TRY(cudaMemcpyAsync(m.cacheBytes() + layer_offset + sz(slots[i]) * token,
                                m.staging_tokens->data() + sz(at) * token, sz(counts[i]) * token,
                                cudaMemcpyHostToDevice, m.stream.get()));
    at += counts[i];
  }
  return m.stream.synchronize();
}

Status DeviceDecodeStep::setCacheShape(const DecodeCacheShape& shape) {
  if (shape == cache_shape_ && impl_->hasCache() && impl_->external_cache == nullptr) return okStatus();
  return replaceCache(shape, nullptr);
}

Status DeviceDecodeStep::useExternalCache(const DecodeCacheShape& shape, void* memory) {
  if (memory == nullptr) return makeError(ErrorCode::InvalidArgument, "device cache: no memory");
  if (shape == cache_shape_ && impl_->external_cache == static_cast<std::byte*>(memory)) return okStatus();
  return replaceCache(shape, static_cast<std::byte*>(memory));
}

std::uint64_t DeviceDecodeStep::cacheBytesFor(const DecodeCacheShape& shape) const {
  const i64 slots = (shape.num_blocks + paddingBlocks(shape.block_size)) * shape.block_size;
  return static_cast<std::uint64_t>(impl_->cache_layers) * static_cast<std::uint64_t>(slots) *
         kvTokenBytes(shape.dtype, impl_->cfg.latentDim());
}

bool DeviceDecodeStep::usesExternalCache(const void* memory) const {
  return impl_->external_cache != nullptr && impl_->external_cache == static_cast<const std::byte*>(memory);
}

Status DeviceDecodeStep::replaceCache(const DecodeCacheShape& shape, std::byte* external) {
  Impl& m = *impl_;
  PD_TRY(checkCacheShape(shape));
  PD_CUDA_TRY(cudaSetDevice(m.weights.device().index));
  PD_TRY(m.stream.synchronize());
  // The graphs point into the cache, the attention workspace and the block tables: they go too.
  m.graphs.clear();
  // Free the old cache first, so that the new one may take its place.
  m.cache = {};
  m.cache_bf16 = {};
  m.cache_fp8 = {};
  m.external_cache = nullptr;
  m.attention.reset();
  m.block_tables = {};
  cache_shape_ = shape;
  m.cache_shape = shape;
  return m.allocateCache(external);
}

}  // namespace pd::gpu
