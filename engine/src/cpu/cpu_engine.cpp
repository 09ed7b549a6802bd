// The CPU backend of the model engine: DeepSeek-V3 forward (MLA with a paged latent cache, MoE
// with grouped experts, MTP) on float32 activations, matrix products via the ISA kernel table,
// parallel over a ThreadPool. With a tensor-parallel communicator the weights are this rank's
// shard (model_weights.h TpShard) and partial results are summed / gathered across ranks after
// attention, each MLP / MoE, the embedding and the LM head (docs/tensor-parallel.md).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>

#include "pd/comm/communicator.h"
#include "pd/common/kv_format.h"
#include "pd/common/log.h"
#include "pd/engine/engine.h"
#include "pd/engine/model_weights.h"
#include "pd/engine/moe_routing.h"
#include "pd/engine/rope.h"
#include "pd/engine/thread_pool.h"

namespace pd::model {
namespace {

using i64 = std::int64_t;

constexpr auto sz(i64 n) {
  return static_cast<std::size_t>(n);
}

// Grows a workspace buffer (never shrinks, so steady-state calls do not allocate).
float* grow(std::vector<float>& v, i64 n) {
  if (v.size() < sz(n)) v.resize(sz(n));
  return v.data();
}

void rmsNorm(const float* x, const float* w, i64 n, float eps, float* out) {
  double ss = 0.0;
  for (i64 i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float mean = static_cast<float>(ss / static_cast<double>(n));
  const float inv = 1.0F / std::sqrt(mean + eps);
  for (i64 i = 0; i < n; ++i) out[i] = (x[i] * inv) * w[i];
}

float silu(float x) {
  return x / (1.0F + std::exp(-x));
}

// Where each new token of a batch goes.
struct BatchPlan {
  i64 tokens = 0;
  std::vector<i64> seq_begin;   // [n_seq + 1] token offsets
  std::vector<i64> cache_pos;   // [tokens]
  std::vector<float> rope_cos;  // [tokens, dr / 2]
  std::vector<float> rope_sin;
  i64 max_chunk = 0;  // longest chunk
};

// One routed (or shared / dense) expert's share of a MoE step.
struct ExpertWork {
  const MlpWeights* mlp = nullptr;
  i64 width = 0;
  const float* x = nullptr;  // [n, hidden] rows (gathered, or the layer input itself)
  i64 n = 0;
  float* act = nullptr;  // [n, width]
  float* out = nullptr;  // [n, hidden]
};

struct RowTask {
  i64 expert;
  i64 row_begin;
  i64 row_end;
};

class CpuEngine final : public Engine {
 public:
  CpuEngine(std::unique_ptr<ModelWeights> weights, const KernelTable& kernels, int threads, std::vector<float> inv_freq,
            comm::Communicator* tp, bool batch_invariant)
      : weights_(std::move(weights)),
        cfg_(weights_->config()),
        k_(kernels),
        batch_invariant_(batch_invariant),
        pool_(threads),
        inv_freq_(std::move(inv_freq)),
        softmax_scale_(static_cast<float>(cfg_.softmaxScale())),
        eps_(static_cast<float>(cfg_.rms_norm_eps)),
        tp_(tp != nullptr && tp->size() > 1 ? tp : nullptr),
        heads_(cfg_.num_attention_heads / (tp_ ? tp_->size() : 1)),
        vocab_(tp_ ? shardRange(cfg_.vocab_size, tp_->rank(), tp_->size()) : ShardRange{0, cfg_.vocab_size}) {
    if (batch_invariant_) k_.matmul = k_.matmul_batch_invariant;
  }

  [[nodiscard]] const ModelConfig& config() const override { return cfg_; }

  // Reads one byte per page of every tensor, spread over the pool (under tensor parallelism,
  // only the matrices of this rank's shard: the rest of the file never becomes resident).
  void prefault() {
    if (tp_) {
      prefaultShard();
      return;
    }
    const std::vector<const TensorView*> tensors = weights_->checkpoint().tensors();
    std::vector<unsigned> sums(tensors.size());
    pool_.run(static_cast<i64>(tensors.size()), [&](i64 i) {
      const std::span<const std::byte> bytes = tensors[sz(i)]->data;
      unsigned sum = 0;
      for (std::size_t p = 0; p < bytes.size(); p += 4096) sum += static_cast<unsigned>(bytes[p]);
      sums[sz(i)] = sum;
    });
    volatile unsigned keep = std::accumulate(sums.begin(), sums.end(), 0U);
    (void)keep;
  }

  void prefaultShard() {
    std::vector<const WeightMatrix*> mats{&weights_->embedTokens(), &weights_->lmHead()};
    const auto add_layer = [&](const LayerWeights& l) {
      for (const WeightMatrix* w : {&l.attn.q_a, &l.attn.q_b, &l.attn.q, &l.attn.kv_a, &l.attn.kv_b, &l.attn.o,
                                    &l.dense.gate, &l.dense.up, &l.dense.down, &l.router}) {
        mats.push_back(w);
      }
      for (const MlpWeights& e : l.experts) mats.insert(mats.end(), {&e.gate, &e.up, &e.down});
      if (l.shared) mats.insert(mats.end(), {&l.shared->gate, &l.shared->up, &l.shared->down});
    };
    for (const LayerWeights& l : weights_->layers()) add_layer(l);
    if (const MtpWeights* m = weights_->mtp()) {
      add_layer(m->block);
      mats.insert(mats.end(), {&m->eh_proj, &m->head, &m->embed});
    }
    std::vector<unsigned> sums(mats.size());
    pool_.run(static_cast<i64>(mats.size()), [&](i64 i) {
      const WeightMatrix& w = *mats[sz(i)];
      if (w.data == nullptr) return;
      const auto* bytes = static_cast<const std::byte*>(w.data);
      const std::size_t n = sz(w.rows * w.cols) * dtypeSize(w.dtype);
      unsigned sum = 0;
      for (std::size_t p = 0; p < n; p += 4096) sum += static_cast<unsigned>(bytes[p]);
      sums[sz(i)] = sum;
    });
    volatile unsigned keep = std::accumulate(sums.begin(), sums.end(), 0U);
    (void)keep;
  }

  [[nodiscard]] EngineCapabilities capabilities() const override {
    EngineCapabilities c;
    c.backend = fmt::format("cpu/{}", cpuIsaName(k_.isa));
    c.threads = pool_.size();
    c.mtp = weights_->mtp() != nullptr;
    c.weight_dtype = weights_->linearDtype();
    c.batch_invariant = batch_invariant_;
    return c;
  }

  Result<ForwardOutput> forward(std::span<const SequenceChunk> batch, const LatentCacheView& cache,
                                const ForwardOptions& options) override {
    PD_ASSIGN_OR_RETURN(BatchPlan plan, makePlan(batch, cache, cfg_.num_hidden_layers - 1, false));
    ForwardOutput out;
    const i64 d = cfg_.hidden_size;
    const i64 t_count = plan.tokens;
    float* h = grow(ws_.h, t_count * d);
    i64 t = 0;
    for (const SequenceChunk& s : batch) {
      for (const std::int32_t tok : s.tokens) embed(weights_->embedTokens(), tok, h + (t++) * d);
    }
    PD_TRY(reduce(h, t_count * d));
    if (options.trace) clearTrace(*options.trace);
    const auto& layers = weights_->layers();
    for (std::size_t l = 0; l < layers.size(); ++l) {
      PD_TRY(runLayer(layers[l], static_cast<i64>(l), batch, cache, plan, options, out.stats));
      if (options.trace) {
        options.trace->layer_hidden.insert(options.trace->layer_hidden.end(), ws_.h.begin(),
                                           ws_.h.begin() + t_count * d);
      }
    }
    PD_TRY(finish(weights_->finalNorm(), weights_->lmHead(), batch, plan, options, out));
    return out;
  }

  Result<ForwardOutput> forwardMtp(std::span<const SequenceChunk> batch, const LatentCacheView& cache,
                                   const ForwardOptions& options) override {
    const MtpWeights* mtp = weights_->mtp();
    if (mtp == nullptr) return makeError(ErrorCode::Unsupported, "the checkpoint has no MTP layer");
    PD_ASSIGN_OR_RETURN(BatchPlan plan, makePlan(batch, cache, cfg_.num_hidden_layers, true));
    ForwardOutput out;
    const i64 d = cfg_.hidden_size;
    const i64 t_count = plan.tokens;
    float* cat = grow(ws_.mtp_cat, t_count * 2 * d);
    // Token embeddings (the rows of a vocab shard, summed across ranks), then the two norms.
    float* emb = grow(ws_.xn, t_count * d);
    i64 t = 0;
    for (const SequenceChunk& s : batch) {
      for (std::size_t i = 0; i < s.tokens.size(); ++i, ++t) {
        float* row = emb + t * d;
        embed(mtp->embed, s.tokens[i], row);
        if (options.mtp_zero_position0_embedding && s.start_pos + s.rope_offset + static_cast<i64>(i) == 0) {
          std::fill(row, row + d, 0.0F);
        }
      }
    }
    PD_TRY(reduce(emb, t_count * d));
    t = 0;
    for (const SequenceChunk& s : batch) {
      for (std::size_t i = 0; i < s.tokens.size(); ++i, ++t) {
        rmsNorm(emb + t * d, mtp->enorm.data(), d, eps_, cat + t * 2 * d);
        rmsNorm(s.prev_hidden.data() + sz(static_cast<i64>(i) * d), mtp->hnorm.data(), d, eps_, cat + t * 2 * d + d);
      }
    }
    float* h = grow(ws_.h, t_count * d);
    linear(mtp->eh_proj, cat, 2 * d, t_count, h, d, out.stats);
    if (options.trace) {
      clearTrace(*options.trace);
      options.trace->mtp_input.assign(h, h + t_count * d);
    }
    PD_TRY(runLayer(mtp->block, cfg_.num_hidden_layers, batch, cache, plan, options, out.stats));
    if (options.trace) {
      options.trace->layer_hidden.insert(options.trace->layer_hidden.end(), ws_.h.begin(), ws_.h.begin() + t_count * d);
    }
    PD_TRY(finish(mtp->head_norm, mtp->head, batch, plan, options, out, /*normalize_hidden=*/false));
    return out;
  }

 private:
  // Scratch reused across calls; only the engine thread resizes it.
  struct Workspace {
    std::vector<float> h, xn, q, qa, kv, latent, attn_o, q_cat, o_lat, attn_out;
    std::vector<float> ctx_lat, kvb, head_k, head_v, run_max, run_sum, fp8_lat;
    std::vector<float> ffn_out, router_logits, moe_x, moe_act, moe_out, mtp_cat, final_h;
  };

  static void clearTrace(ForwardTrace& trace) {
    trace.layer_hidden.clear();
    trace.topk_idx.clear();
    trace.topk_weight.clear();
    trace.mtp_input.clear();
  }

  Result<BatchPlan> makePlan(std::span<const SequenceChunk> batch, const LatentCacheView& cache, i64 kv_layer,
                             bool mtp) const {
    if (batch.empty()) return makeError(ErrorCode::InvalidArgument, "empty batch");
    if (!isKvDType(cache.dtype)) {
      return makeError(ErrorCode::InvalidArgument, "latent cache dtype must be F32, BF16 or F8_E4M3");
    }
    if (cache.on_device) return makeError(ErrorCode::InvalidArgument, "the CPU engine cannot read a GPU cache");
    if (cache.latent_dim != cfg_.latentDim() || cache.block_size <= 0 ||
        static_cast<i64>(cache.layers.size()) <= kv_layer) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("latent cache has latent_dim {} and {} layers; the model needs latent_dim {} and "
                                   "layer {}",
                                   cache.latent_dim, cache.layers.size(), cfg_.latentDim(), kv_layer));
    }
    BatchPlan plan;
    plan.seq_begin.push_back(0);
    const i64 half = cfg_.qk_rope_head_dim / 2;
    for (std::size_t si = 0; si < batch.size(); ++si) {
      const SequenceChunk& s = batch[si];
      const auto n = static_cast<i64>(s.tokens.size());
      if (n == 0) return makeError(ErrorCode::InvalidArgument, fmt::format("sequence {} has no new tokens", si));
      if (s.start_pos < 0 || s.rope_offset < 0) {
        return makeError(ErrorCode::InvalidArgument, fmt::format("sequence {}: negative position", si));
      }
      for (const std::int32_t tok : s.tokens) {
        if (tok < 0 || tok >= cfg_.vocab_size) {
          return makeError(ErrorCode::InvalidArgument,
                           fmt::format("sequence {}: token id {} outside [0, {})", si, tok, cfg_.vocab_size));
        }
      }
      const i64 end = s.start_pos + n;
      if (static_cast<i64>(s.block_table.size()) * cache.block_size < end) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("sequence {}: {} blocks of {} tokens cannot hold {} positions", si,
                                     s.block_table.size(), cache.block_size, end));
      }
      for (i64 b = 0; b < (end + cache.block_size - 1) / cache.block_size; ++b) {
        const std::int32_t id = s.block_table[sz(b)];
        if (id < 0 || id >= cache.num_blocks) {
          return makeError(ErrorCode::InvalidArgument,
                           fmt::format("sequence {}: block id {} outside [0, {})", si, id, cache.num_blocks));
        }
      }
      if (cfg_.max_position_embeddings > 0 && end + s.rope_offset > cfg_.max_position_embeddings) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("sequence {}: position {} beyond max_position_embeddings {}", si,
                                     end + s.rope_offset - 1, cfg_.max_position_embeddings));
      }
      if (mtp && static_cast<i64>(s.prev_hidden.size()) != n * cfg_.hidden_size) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("sequence {}: MTP needs {} x {} previous hidden values, got {}", si, n,
                                     cfg_.hidden_size, s.prev_hidden.size()));
      }
      plan.max_chunk = std::max(plan.max_chunk, n);
      for (i64 i = 0; i < n; ++i) {
        plan.cache_pos.push_back(s.start_pos + i);
        const std::size_t at = plan.rope_cos.size();
        plan.rope_cos.resize(at + sz(half));
        plan.rope_sin.resize(at + sz(half));
        ropeCosSin(inv_freq_, s.start_pos + i + s.rope_offset, plan.rope_cos.data() + at, plan.rope_sin.data() + at);
      }
      plan.seq_begin.push_back(plan.seq_begin.back() + n);
    }
    plan.tokens = plan.seq_begin.back();
    return plan;
  }

  // Below this many multiply-adds a parallel region costs more than it saves (waking workers
  // takes microseconds, tens of them when the machine is oversubscribed).
  static constexpr i64 kParallelWork = i64{1} << 17;

  template <class Fn>
  void runTasks(i64 n_tasks, i64 work, const Fn& fn) {
    if (work < kParallelWork) {
      for (i64 t = 0; t < n_tasks; ++t) fn(t);
      return;
    }
    pool_.run(n_tasks, fn);
  }

  // y[t] = W x[t] for t < n, rows spread over the pool in multiples of 4.
  void linear(const WeightMatrix& w, const float* x, i64 x_stride, i64 n, float* y, i64 y_stride, ForwardStats& stats) {
    stats.weight_bytes += w.bytes();
    stats.flops += static_cast<std::uint64_t>(2 * w.rows * w.cols * n);
    const i64 units = (w.rows + 3) / 4;
    const i64 work_per_unit = 4 * w.cols * n;
    const i64 grain = work_per_unit * units < kParallelWork
                          ? units
                          : std::max<i64>(1, (kParallelWork / 2) / std::max<i64>(1, work_per_unit));
    pool_.parallelFor(units, grain, [&](i64 u0, i64 u1) {
      const i64 r0 = u0 * 4;
      const i64 r1 = std::min(u1 * 4, w.rows);
      k_.matmul(w, r0, r1, x, x_stride, n, y + r0, y_stride);
    });
  }

  // Row `tok` of an embedding (a vocab shard under TP: zeros for tokens other ranks hold).
  void embed(const WeightMatrix& table, std::int32_t tok, float* out) const {
    if (tok < vocab_.begin || tok >= vocab_.end) {
      std::fill(out, out + cfg_.hidden_size, 0.0F);
      return;
    }
    dequantizeRow(table, tok - vocab_.begin, out);
  }

  // Sums a partial result across the tensor-parallel ranks (nothing without TP).
  Status reduce(float* data, i64 n) {
    if (!tp_) return okStatus();
    return tp_->allReduceSum(std::span<float>(data, sz(n)));
  }

  Status runLayer(const LayerWeights& lw, i64 kv_layer, std::span<const SequenceChunk> batch,
                  const LatentCacheView& cache, const BatchPlan& plan, const ForwardOptions& options,
                  ForwardStats& stats) {
    const i64 d = cfg_.hidden_size;
    const i64 n = plan.tokens;
    float* h = ws_.h.data();
    float* xn = grow(ws_.xn, n * d);
    for (i64 t = 0; t < n; ++t) rmsNorm(h + t * d, lw.input_norm.data(), d, eps_, xn + t * d);
    float* attn = attention(lw.attn, kv_layer, batch, cache, plan, options, stats);
    PD_TRY(reduce(attn, n * d));
    for (i64 i = 0; i < n * d; ++i) h[i] += attn[i];
    for (i64 t = 0; t < n; ++t) rmsNorm(h + t * d, lw.post_norm.data(), d, eps_, xn + t * d);
    float* ffn = lw.moe ? moe(lw, n, options, stats) : dense(lw.dense, n, stats);
    PD_TRY(reduce(ffn, n * d));
    for (i64 i = 0; i < n * d; ++i) h[i] += ffn[i];
    return okStatus();
  }

  // Multi-head latent attention on ws_.xn; returns [tokens, hidden].
  float* attention(const AttentionWeights& a, i64 kv_layer, std::span<const SequenceChunk> batch,
                   const LatentCacheView& cache, const BatchPlan& plan, const ForwardOptions& options,
                   ForwardStats& stats) {
    const i64 d = cfg_.hidden_size;
    const i64 n = plan.tokens;
    const i64 heads = heads_;
    const i64 dn = cfg_.qk_nope_head_dim;
    const i64 dr = cfg_.qk_rope_head_dim;
    const i64 qk = dn + dr;
    const i64 r = cfg_.kv_lora_rank;
    const i64 ld = r + dr;
    const i64 half = dr / 2;
    const float* xn = ws_.xn.data();

    float* q = grow(ws_.q, n * heads * qk);
    if (cfg_.q_lora_rank > 0) {
      const i64 qr = cfg_.q_lora_rank;
      float* qa = grow(ws_.qa, n * qr);
      linear(a.q_a, xn, d, n, qa, qr, stats);
      for (i64 t = 0; t < n; ++t) rmsNorm(qa + t * qr, a.q_a_norm.data(), qr, eps_, qa + t * qr);
      linear(a.q_b, qa, qr, n, q, heads * qk, stats);
    } else {
      linear(a.q, xn, d, n, q, heads * qk, stats);
    }
    float* kv = grow(ws_.kv, n * ld);
    linear(a.kv_a, xn, d, n, kv, ld, stats);
    float* latent = grow(ws_.latent, n * ld);
    for (i64 t = 0; t < n; ++t) {
      const float* cs = plan.rope_cos.data() + t * half;
      const float* sn = plan.rope_sin.data() + t * half;
      rmsNorm(kv + t * ld, a.kv_a_norm.data(), r, eps_, latent + t * ld);
      std::memcpy(latent + t * ld + r, kv + t * ld + r, sz(dr) * sizeof(float));
      applyRope(latent + t * ld + r, cs, sn, half);
      for (i64 hd = 0; hd < heads; ++hd) applyRope(q + (t * heads + hd) * qk + dn, cs, sn, half);
    }
    for (std::size_t s = 0; s < batch.size(); ++s) {
      const i64 b = plan.seq_begin[s];
      for (i64 t = b; t < plan.seq_begin[s + 1]; ++t) {
        writeLatent(cache, kv_layer, batch[s].block_table, plan.cache_pos[sz(t)], latent + t * ld);
      }
      if (options.sink) {
        const i64 cnt = plan.seq_begin[s + 1] - b;
        options.sink->onLayer(kv_layer, s, batch[s].start_pos, std::span<const float>(latent + b * ld, sz(cnt * ld)));
      }
    }
    for (std::size_t s = 0; s < batch.size(); ++s) {
      stats.kv_bytes += static_cast<std::uint64_t>(batch[s].start_pos + static_cast<i64>(batch[s].tokens.size())) *
                        cache.tokenBytes();
    }
    AttentionPath path = options.attention;
    // Batch-invariant mode: every token attends alike, one at a time (the decode step's way),
    // however many tokens its forward holds.
    if (path == AttentionPath::Auto) {
      path = !batch_invariant_ && plan.max_chunk > 16 ? AttentionPath::Prefill : AttentionPath::Absorbed;
    }
    i64 attended = 0;  // (query, key) pairs
    for (i64 t = 0; t < n; ++t) attended += plan.cache_pos[sz(t)] + 1;
    const i64 dv = cfg_.v_head_dim;
    if (path == AttentionPath::Prefill) {
      stats.flops += static_cast<std::uint64_t>(2 * attended * heads * (qk + dv));
    } else {
      stats.flops += static_cast<std::uint64_t>(2 * attended * heads * (ld + r) + 2 * n * heads * (dn + dv) * r);
    }
    float* o = grow(ws_.attn_o, n * heads * dv);
    if (path == AttentionPath::Prefill) {
      prefillAttention(a, kv_layer, batch, cache, plan, o, stats);
    } else {
      absorbedAttention(a, kv_layer, batch, cache, plan, o, stats);
    }
    float* out = grow(ws_.attn_out, n * d);
    linear(a.o, o, heads * dv, n, out, d, stats);
    return out;
  }

  // The cache block holding positions [block_index * block_size, ...) of a sequence, viewed as a
  // [rows, latent_dim] matrix in the cache dtype (the kernels dequantize BF16 themselves; an FP8
  // cache's tiles are dequantized by the caller, absorbedAttention).
  static WeightMatrix cacheBlock(const LatentCacheView& cache, i64 layer, std::span<const std::int32_t> blocks,
                                 i64 block_index, i64 rows) {
    WeightMatrix m;
    m.dtype = cache.dtype;
    m.rows = rows;
    m.cols = cache.latent_dim;
    m.data = cache.slot(layer, blocks[sz(block_index)], 0);
    return m;
  }

  // Absorbed MLA: q_lat = q_nope W_UK (per head), then attention in the latent space as two
  // products per cache block for a group of heads of one query token (scores = L [q_lat ‖ q_pe],
  // o_lat += p^T L), then o = W_UV o_lat.
  void absorbedAttention(const AttentionWeights& a, i64 kv_layer, std::span<const SequenceChunk> batch,
                         const LatentCacheView& cache, const BatchPlan& plan, float* o, ForwardStats& stats) {
    const i64 n = plan.tokens;
    const i64 heads = heads_;
    const i64 dn = cfg_.qk_nope_head_dim;
    const i64 dr = cfg_.qk_rope_head_dim;
    const i64 dv = cfg_.v_head_dim;
    const i64 qk = dn + dr;
    const i64 r = cfg_.kv_lora_rank;
    const i64 ld = r + dr;
    const i64 bs = cache.block_size;
    const float* q = ws_.q.data();
    // Query rows [token][head] = (q_nope W_UK ‖ q_pe), the same width as a cached latent.
    float* q_cat = grow(ws_.q_cat, n * heads * ld);
    float* o_lat = grow(ws_.o_lat, n * heads * ld);
    std::fill(q_cat, q_cat + n * heads * ld, 0.0F);
    stats.weight_bytes += a.kv_b.bytes();
    runTasks(heads, n * heads * dn * r, [&](i64 hd) {
      k_.matmulTransposed(a.kv_b, hd * (dn + dv), hd * (dn + dv) + dn, q + hd * qk, heads * qk, n, q_cat + hd * ld,
                          heads * ld);
    });
    for (i64 t = 0; t < n; ++t) {
      for (i64 hd = 0; hd < heads; ++hd) {
        std::memcpy(q_cat + (t * heads + hd) * ld + r, q + (t * heads + hd) * qk + dn, sz(dr) * sizeof(float));
      }
    }
    std::vector<i64> seq_of(sz(n));
    for (std::size_t s = 0; s < batch.size(); ++s) {
      for (i64 t = plan.seq_begin[s]; t < plan.seq_begin[s + 1]; ++t) seq_of[sz(t)] = static_cast<i64>(s);
    }
    // An FP8 cache (per-tile scales the kernels do not know) is read as F32 rows first: each
    // sequence's context once per call, shared by its tokens and head groups.
    const bool fp8 = cache.dtype == DType::F8E4M3;
    std::vector<i64> fp8_begin(batch.size() + 1, 0);  // sequence s's rows start at row fp8_begin[s]
    if (fp8) {
      for (std::size_t s = 0; s < batch.size(); ++s) {
        fp8_begin[s + 1] = fp8_begin[s] + batch[s].start_pos + static_cast<i64>(batch[s].tokens.size());
      }
      float* rows = grow(ws_.fp8_lat, fp8_begin.back() * ld);
      for (std::size_t s = 0; s < batch.size(); ++s) {
        for (i64 p = 0; p < fp8_begin[s + 1] - fp8_begin[s]; ++p) {
          readLatent(cache, kv_layer, batch[s].block_table, p, rows + (fp8_begin[s] + p) * ld);
        }
      }
    }
    const i64 group = std::min<i64>(heads, 16);
    const i64 groups = (heads + group - 1) / group;
    i64 attended = 0;
    for (i64 t = 0; t < n; ++t) attended += plan.cache_pos[sz(t)] + 1;
    runTasks(n * groups, attended * heads * (ld + r), [&](i64 task) {
      const i64 t = task / groups;
      const i64 h0 = (task % groups) * group;
      const i64 hn = std::min(group, heads - h0);
      const SequenceChunk& seq = batch[sz(seq_of[sz(t)])];
      const float* dequantized = fp8 ? ws_.fp8_lat.data() + fp8_begin[sz(seq_of[sz(t)])] * ld : nullptr;
      const i64 ctx = plan.cache_pos[sz(t)] + 1;  // causal: positions [0, ctx)
      const i64 nblocks = (ctx + bs - 1) / bs;
      thread_local std::vector<float> scores;
      if (scores.size() < sz(hn * nblocks * bs)) scores.resize(sz(hn * nblocks * bs));
      const i64 stride = nblocks * bs;
      const float* qrows = q_cat + (t * heads + h0) * ld;
      const auto block = [&](i64 b, i64 rows) {
        if (!fp8) return cacheBlock(cache, kv_layer, seq.block_table, b, rows);
        WeightMatrix m;
        m.dtype = DType::F32;
        m.rows = rows;
        m.cols = ld;
        m.data = dequantized + b * bs * ld;
        return m;
      };
      for (i64 b = 0; b < nblocks; ++b) {
        const i64 rows = std::min(bs, ctx - b * bs);
        k_.matmul(block(b, rows), 0, rows, qrows, ld, hn, scores.data() + b * bs, stride);
      }
      for (i64 h = 0; h < hn; ++h) {
        float* sc = scores.data() + h * stride;
        float mx = -std::numeric_limits<float>::infinity();
        for (i64 p = 0; p < ctx; ++p) {
          sc[p] *= softmax_scale_;
          mx = std::max(mx, sc[p]);
        }
        float sum = 0.0F;
        for (i64 p = 0; p < ctx; ++p) {
          sc[p] = std::exp(sc[p] - mx);
          sum += sc[p];
        }
        const float inv = 1.0F / sum;
        for (i64 p = 0; p < ctx; ++p) sc[p] *= inv;
        std::fill(sc + ctx, sc + stride, 0.0F);
      }
      float* ol = o_lat + (t * heads + h0) * ld;
      std::fill(ol, ol + hn * ld, 0.0F);
      for (i64 b = 0; b < nblocks; ++b) {
        const i64 rows = std::min(bs, ctx - b * bs);
        k_.matmulTransposed(block(b, rows), 0, rows, scores.data() + b * bs, stride, hn, ol, ld);
      }
    });
    runTasks(heads, n * heads * dv * r, [&](i64 hd) {
      k_.matmul(a.kv_b, hd * (dn + dv) + dn, (hd + 1) * (dn + dv), o_lat + hd * ld, heads * ld, n, o + hd * dv,
                heads * dv);
    });
  }

  // Prefill MLA: the context's latents are up-projected to per-head K/V (in chunks of context,
  // with an online softmax), then ordinary causal attention per head. Per head, the chunk's keys
  // (K_nope ‖ k_pe) and values are gathered into two row-major matrices, so that a block of 16
  // queries takes its scores and its output as two tiled matrix products (the kernels' matmul
  // and matmulTransposed) instead of one dot and one axpy per (query, key). Each query's result
  // depends only on its own scores and the context chunking (from position 0), not on which
  // queries share its block or forward.
  void prefillAttention(const AttentionWeights& a, i64 kv_layer, std::span<const SequenceChunk> batch,
                        const LatentCacheView& cache, const BatchPlan& plan, float* o, ForwardStats& stats) {
    constexpr i64 kCtxChunk = 512;
    constexpr i64 kQueryBlock = 16;
    const i64 heads = heads_;
    const i64 dn = cfg_.qk_nope_head_dim;
    const i64 dr = cfg_.qk_rope_head_dim;
    const i64 dv = cfg_.v_head_dim;
    const i64 qk = dn + dr;
    const i64 r = cfg_.kv_lora_rank;
    const i64 ld = r + dr;
    const i64 kvw = heads * (dn + dv);
    const float* q = ws_.q.data();
    float* run_max = grow(ws_.run_max, plan.tokens * heads);
    float* run_sum = grow(ws_.run_sum, plan.tokens * heads);
    for (std::size_t s = 0; s < batch.size(); ++s) {
      const SequenceChunk& seq = batch[s];
      const i64 t0 = plan.seq_begin[s];
      const i64 nq = plan.seq_begin[s + 1] - t0;
      const i64 ctx_total = seq.start_pos + nq;
      std::fill(run_max + t0 * heads, run_max + (t0 + nq) * heads, -std::numeric_limits<float>::infinity());
      std::fill(run_sum + t0 * heads, run_sum + (t0 + nq) * heads, 0.0F);
      std::fill(o + t0 * heads * dv, o + (t0 + nq) * heads * dv, 0.0F);
      for (i64 c0 = 0; c0 < ctx_total; c0 += kCtxChunk) {
        const i64 c1 = std::min(ctx_total, c0 + kCtxChunk);
        const i64 cn = c1 - c0;
        float* lat = grow(ws_.ctx_lat, cn * ld);
        for (i64 p = c0; p < c1; ++p) readLatent(cache, kv_layer, seq.block_table, p, lat + (p - c0) * ld);
        float* kvb = grow(ws_.kvb, cn * kvw);
        linear(a.kv_b, lat, ld, cn, kvb, kvw, stats);
        // Head hd's keys [cn, qk] at head_k + hd * cn * qk, its values [cn, dv] at head_v + hd * cn * dv.
        float* head_k = grow(ws_.head_k, heads * cn * qk);
        float* head_v = grow(ws_.head_v, heads * cn * dv);
        runTasks(heads, cn * heads * (qk + dv), [&](i64 hd) {
          for (i64 p = 0; p < cn; ++p) {
            const float* kv = kvb + p * kvw + hd * (dn + dv);
            float* k = head_k + (hd * cn + p) * qk;
            std::memcpy(k, kv, sz(dn) * sizeof(float));
            std::memcpy(k + dn, lat + p * ld + r, sz(dr) * sizeof(float));
            std::memcpy(head_v + (hd * cn + p) * dv, kv + dn, sz(dv) * sizeof(float));
          }
        });
        const i64 qblocks = (nq + kQueryBlock - 1) / kQueryBlock;
        runTasks(heads * qblocks, nq * cn * heads * (qk + dv), [&](i64 task) {
          const i64 hd = task % heads;
          const i64 i0 = (task / heads) * kQueryBlock;
          const i64 nb = std::min(nq, i0 + kQueryBlock) - i0;
          // Causal: query t sees positions < cache_pos[t] + 1, which grows with t in a chunk.
          const i64 rows = std::min(c1, plan.cache_pos[sz(t0 + i0 + nb - 1)] + 1) - c0;
          if (rows <= 0) return;
          thread_local std::vector<float> scores;
          if (scores.size() < sz(nb * rows)) scores.resize(sz(nb * rows));
          float* sc = scores.data();
          const WeightMatrix keys{DType::F32, rows, qk, head_k + hd * cn * qk};
          k_.matmul(keys, 0, rows, q + ((t0 + i0) * heads + hd) * qk, heads * qk, nb, sc, rows);
          for (i64 i = 0; i < nb; ++i) {
            const i64 t = t0 + i0 + i;
            const i64 m = std::min(c1, plan.cache_pos[sz(t)] + 1) - c0;  // this query's keys here
            float* row = sc + i * rows;
            if (m <= 0) {
              std::fill(row, row + rows, 0.0F);
              continue;
            }
            float mx = run_max[t * heads + hd];
            for (i64 p = 0; p < m; ++p) {
              row[p] *= softmax_scale_;
              mx = std::max(mx, row[p]);
            }
            float* ot = o + (t * heads + hd) * dv;
            const float old_max = run_max[t * heads + hd];
            float sum = run_sum[t * heads + hd];
            if (old_max != mx && sum > 0.0F) {
              const float f = std::exp(old_max - mx);
              sum *= f;
              for (i64 j = 0; j < dv; ++j) ot[j] *= f;
            }
            for (i64 p = 0; p < m; ++p) {
              row[p] = std::exp(row[p] - mx);
              sum += row[p];
            }
            std::fill(row + m, row + rows, 0.0F);
            run_max[t * heads + hd] = mx;
            run_sum[t * heads + hd] = sum;
          }
          const WeightMatrix values{DType::F32, rows, dv, head_v + hd * cn * dv};
          k_.matmulTransposed(values, 0, rows, sc, rows, nb, o + ((t0 + i0) * heads + hd) * dv, heads * dv);
        });
      }
      for (i64 t = t0; t < t0 + nq; ++t) {
        for (i64 hd = 0; hd < heads; ++hd) {
          const float inv = 1.0F / run_sum[t * heads + hd];
          float* ot = o + (t * heads + hd) * dv;
          for (i64 j = 0; j < dv; ++j) ot[j] *= inv;
        }
      }
    }
  }

  // Runs a list of SwiGLU MLPs: phase 1 gate/up + activation, phase 2 down, each as one
  // parallel region over (expert, row range) tasks so each expert's weights are read once.
  void runExperts(std::vector<ExpertWork>& work, ForwardStats& stats) {
    const i64 d = cfg_.hidden_size;
    const i64 target_tasks = static_cast<i64>(pool_.size()) * 4;
    i64 total_rows = 0;
    i64 total_work = 0;
    for (const ExpertWork& e : work) {
      total_rows += e.width;
      total_work += e.width * d * e.n;
      stats.weight_bytes += e.mlp->gate.bytes() + e.mlp->up.bytes() + e.mlp->down.bytes();
      stats.flops += static_cast<std::uint64_t>(6 * e.width * d * e.n);
    }
    const auto split = [&](i64 rows_of_expert, i64 total) {
      i64 chunk = std::max<i64>(4, (total + target_tasks - 1) / target_tasks);
      // Small problems: fewer, larger tasks (a region costs a few microseconds).
      if (total_work < (1 << 18)) chunk = std::max(chunk, rows_of_expert);
      return ((chunk + 3) / 4) * 4;
    };
    std::vector<RowTask> tasks;
    for (std::size_t e = 0; e < work.size(); ++e) {
      const i64 chunk = split(work[e].width, total_rows);
      for (i64 r0 = 0; r0 < work[e].width; r0 += chunk) {
        tasks.push_back({static_cast<i64>(e), r0, std::min(work[e].width, r0 + chunk)});
      }
    }
    runTasks(static_cast<i64>(tasks.size()), 2 * total_work, [&](i64 ti) {
      const RowTask& task = tasks[sz(ti)];
      ExpertWork& e = work[sz(task.expert)];
      thread_local std::vector<float> up;
      if (up.size() < sz(e.n * e.width)) up.resize(sz(e.n * e.width));
      k_.matmul(e.mlp->gate, task.row_begin, task.row_end, e.x, d, e.n, e.act + task.row_begin, e.width);
      k_.matmul(e.mlp->up, task.row_begin, task.row_end, e.x, d, e.n, up.data(), e.width);
      for (i64 t = 0; t < e.n; ++t) {
        float* g = e.act + t * e.width;
        const float* u = up.data() + t * e.width;
        for (i64 j = task.row_begin; j < task.row_end; ++j) g[j] = silu(g[j]) * u[j - task.row_begin];
      }
    });
    tasks.clear();
    for (std::size_t e = 0; e < work.size(); ++e) {
      const i64 chunk = split(d, d * static_cast<i64>(work.size()));
      for (i64 r0 = 0; r0 < d; r0 += chunk) tasks.push_back({static_cast<i64>(e), r0, std::min(d, r0 + chunk)});
    }
    runTasks(static_cast<i64>(tasks.size()), total_work, [&](i64 ti) {
      const RowTask& task = tasks[sz(ti)];
      const ExpertWork& e = work[sz(task.expert)];
      k_.matmul(e.mlp->down, task.row_begin, task.row_end, e.act, e.width, e.n, e.out + task.row_begin, d);
    });
  }

  float* dense(const MlpWeights& mlp, i64 n, ForwardStats& stats) {
    const i64 d = cfg_.hidden_size;
    const i64 width = mlp.gate.rows;
    std::vector<ExpertWork> work{
        {&mlp, width, ws_.xn.data(), n, grow(ws_.moe_act, n * width), grow(ws_.ffn_out, n * d)}};
    runExperts(work, stats);
    return ws_.ffn_out.data();
  }

  // Sigmoid routing with e_score_correction_bias (selection only), group-limited top-k, weights
  // renormalized over the chosen experts and scaled; experts run grouped; plus shared experts.
  float* moe(const LayerWeights& lw, i64 n, const ForwardOptions& options, ForwardStats& stats) {
    const i64 d = cfg_.hidden_size;
    const i64 n_exp = cfg_.n_routed_experts;
    const i64 top_k = cfg_.num_experts_per_tok;
    const i64 groups = cfg_.n_group;
    const float* xn = ws_.xn.data();
    float* logits = grow(ws_.router_logits, n * n_exp);
    linear(lw.router, xn, d, n, logits, n_exp, stats);

    std::vector<std::int32_t> chosen(sz(n * top_k));
    std::vector<float> weight(sz(n * top_k));
    RoutingScratch scratch;
    for (i64 t = 0; t < n; ++t) {
      routeToken(std::span<const float>(logits + t * n_exp, sz(n_exp)), lw.router_bias, groups, cfg_.topk_group, top_k,
                 cfg_.routed_scaling_factor, std::span<std::int32_t>(chosen).subspan(sz(t * top_k), sz(top_k)),
                 std::span<float>(weight).subspan(sz(t * top_k), sz(top_k)), scratch);
    }
    if (options.trace) {
      options.trace->topk_idx.insert(options.trace->topk_idx.end(), chosen.begin(), chosen.end());
      options.trace->topk_weight.insert(options.trace->topk_weight.end(), weight.begin(), weight.end());
    }

    // Group tokens by expert: expert e's rows are slots [slot_begin[e], slot_begin[e+1]).
    std::vector<i64> slot_begin(sz(n_exp + 1), 0);
    for (const std::int32_t e : chosen) ++slot_begin[sz(e) + 1];
    for (i64 e = 0; e < n_exp; ++e) slot_begin[sz(e + 1)] += slot_begin[sz(e)];
    std::vector<i64> slot_of(sz(n * top_k));  // (token, k) -> slot
    {
      std::vector<i64> fill(slot_begin.begin(), slot_begin.end() - 1);
      for (i64 i = 0; i < n * top_k; ++i) slot_of[sz(i)] = fill[sz(chosen[sz(i)])]++;
    }
    const i64 slots = n * top_k;
    const i64 width = lw.experts.empty() ? 0 : lw.experts[0].gate.rows;  // this rank's share under TP
    const i64 shared_width = lw.shared ? lw.shared->gate.rows : 0;
    float* gx = grow(ws_.moe_x, slots * d);
    for (i64 i = 0; i < slots; ++i) std::memcpy(gx + slot_of[sz(i)] * d, xn + (i / top_k) * d, sz(d) * sizeof(float));
    float* act = grow(ws_.moe_act, slots * width + n * shared_width);
    float* gout = grow(ws_.moe_out, (slots + n) * d);
    std::vector<ExpertWork> work;
    for (i64 e = 0; e < n_exp; ++e) {
      const i64 cnt = slot_begin[sz(e + 1)] - slot_begin[sz(e)];
      if (cnt == 0) continue;
      const i64 s0 = slot_begin[sz(e)];
      work.push_back({&lw.experts[sz(e)], width, gx + s0 * d, cnt, act + s0 * width, gout + s0 * d});
    }
    stats.experts_used += static_cast<i64>(work.size());
    if (lw.shared) work.push_back({&*lw.shared, shared_width, xn, n, act + slots * width, gout + slots * d});
    runExperts(work, stats);

    float* out = grow(ws_.ffn_out, n * d);
    std::vector<i64> ks(sz(top_k));
    for (i64 t = 0; t < n; ++t) {
      float* y = out + t * d;
      std::fill(y, y + d, 0.0F);
      // Experts in ascending id order, as the reference accumulates them.
      std::iota(ks.begin(), ks.end(), 0);
      std::sort(ks.begin(), ks.end(),
                [&](i64 x, i64 z) { return chosen[sz(t * top_k + x)] < chosen[sz(t * top_k + z)]; });
      for (const i64 k : ks) {
        k_.axpy(weight[sz(t * top_k + k)], gout + slot_of[sz(t * top_k + k)] * d, y, d);
      }
      if (lw.shared) {
        const float* z = gout + (slots + t) * d;
        for (i64 j = 0; j < d; ++j) y[j] += z[j];
      }
    }
    return out;
  }

  // Final norm, then the rows of logits and hidden states the options ask for.
  Status finish(const std::vector<float>& norm, const WeightMatrix& head, std::span<const SequenceChunk> batch,
                const BatchPlan& plan, const ForwardOptions& options, ForwardOutput& out,
                bool normalize_hidden = true) {
    const i64 d = cfg_.hidden_size;
    const auto rows_of = [&](OutputRows which) {
      std::vector<i64> rows;
      if (which == OutputRows::All) {
        rows.resize(sz(plan.tokens));
        std::iota(rows.begin(), rows.end(), 0);
      } else if (which == OutputRows::Last) {
        for (std::size_t s = 0; s < batch.size(); ++s) rows.push_back(plan.seq_begin[s + 1] - 1);
      }
      return rows;
    };
    const std::vector<i64> logit_rows = rows_of(options.logits);
    const std::vector<i64> hidden_rows = rows_of(options.hidden);
    const float* h = ws_.h.data();
    if (!hidden_rows.empty()) {
      out.hidden.resize(hidden_rows.size() * sz(d));
      for (std::size_t i = 0; i < hidden_rows.size(); ++i) {
        if (normalize_hidden) {
          rmsNorm(h + hidden_rows[i] * d, norm.data(), d, eps_, out.hidden.data() + i * sz(d));
        } else {
          std::memcpy(out.hidden.data() + i * sz(d), h + hidden_rows[i] * d, sz(d) * sizeof(float));
        }
      }
    }
    if (!logit_rows.empty()) {
      const auto m = static_cast<i64>(logit_rows.size());
      float* hn = grow(ws_.final_h, m * d);
      for (i64 i = 0; i < m; ++i) rmsNorm(h + logit_rows[sz(i)] * d, norm.data(), d, eps_, hn + i * d);
      out.logits.resize(sz(m * cfg_.vocab_size));
      if (!tp_) {
        linear(head, hn, d, m, out.logits.data(), cfg_.vocab_size, out.stats);
        return okStatus();
      }
      // Vocab-parallel head: each rank's slice (padded to the largest), gathered in rank order.
      const int ranks = tp_->size();
      const i64 pad = (cfg_.vocab_size + ranks - 1) / ranks;
      std::vector<float> mine(sz(m * pad), 0.0F);
      linear(head, hn, d, m, mine.data(), pad, out.stats);
      std::vector<float> all(sz(m * pad) * sz(ranks));
      PD_TRY(comm::allGatherFloats(*tp_, mine, all));
      for (int r = 0; r < ranks; ++r) {
        const ShardRange v = shardRange(cfg_.vocab_size, r, ranks);
        for (i64 i = 0; i < m; ++i) {
          std::memcpy(out.logits.data() + i * cfg_.vocab_size + v.begin, all.data() + (r * m + i) * pad,
                      sz(v.end - v.begin) * sizeof(float));
        }
      }
    }
    return okStatus();
  }

  std::unique_ptr<ModelWeights> weights_;
  const ModelConfig& cfg_;
  KernelTable k_;  // a copy: batch-invariant mode swaps its matmul
  bool batch_invariant_ = false;
  ThreadPool pool_;
  std::vector<float> inv_freq_;
  float softmax_scale_;
  float eps_;
  comm::Communicator* tp_;  // null without tensor parallelism (size 1); not owned
  i64 heads_;               // attention heads of this rank
  ShardRange vocab_;        // vocab rows of this rank's embedding / head shard
  Workspace ws_;
};

}  // namespace

Result<std::unique_ptr<Engine>> createCpuEngine(std::unique_ptr<ModelWeights> weights,
                                                const CpuEngineOptions& options) {
  const CpuIsa isa = options.isa.value_or(detectCpuIsa());
  if (!cpuSupports(isa)) {
    return makeError(ErrorCode::Unsupported, fmt::format("this CPU cannot run the {} kernels", cpuIsaName(isa)));
  }
  PD_ASSIGN_OR_RETURN(std::vector<float> inv_freq, ropeInvFreq(weights->config()));
  const TpShard want = options.tp ? TpShard{options.tp->rank(), options.tp->size()} : TpShard{};
  if (weights->shard().rank != want.rank || weights->shard().size != want.size) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("weights are shard {} of {}, the tensor-parallel group wants rank {} of {}",
                                 weights->shard().rank, weights->shard().size, want.rank, want.size));
  }
  auto engine = std::make_unique<CpuEngine>(std::move(weights), kernelTable(isa), options.threads, std::move(inv_freq),
                                            options.tp, options.batch_invariant);
  if (options.prefault_weights) engine->prefault();
  const EngineCapabilities caps = engine->capabilities();
  log::debug("engine", "cpu engine: {} threads, {} kernels, weights {}", caps.threads, caps.backend,
             dtypeName(caps.weight_dtype));
  return std::unique_ptr<Engine>(std::move(engine));
}

Result<std::unique_ptr<Engine>> createCpuEngine(const std::filesystem::path& model_dir,
                                                const CpuEngineOptions& options) {
  const TpShard shard = options.tp ? TpShard{options.tp->rank(), options.tp->size()} : TpShard{};
  PD_ASSIGN_OR_RETURN(std::unique_ptr<ModelWeights> weights, ModelWeights::load(model_dir, shard));
  return createCpuEngine(std::move(weights), options);
}

}  // namespace pd::model
