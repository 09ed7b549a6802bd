#include "decode_step_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <unordered_set>

namespace pd::gpu {
namespace {

Error invalid(std::string message) {
  return makeError(ErrorCode::InvalidArgument, std::move(message));
}

}  // namespace

Status checkDecodeModel(const ModelConfig& c) {
  if (c.hidden_size <= 0 || c.vocab_size <= 0 || c.num_hidden_layers <= 0 || c.num_attention_heads <= 0) {
    return invalid("device decode: the model needs positive hidden_size, vocab_size, layers and heads");
  }
  if (c.kv_lora_rank <= 0 || c.qk_rope_head_dim <= 0 || c.qk_rope_head_dim % 2 != 0 || c.qk_nope_head_dim <= 0 ||
      c.v_head_dim <= 0) {
    return invalid(
        fmt::format("device decode: MLA dims kv_lora_rank {}, qk_rope_head_dim {} (even), qk_nope_head_dim "
                    "{}, v_head_dim {} must be positive",
                    c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim));
  }
  if (c.latentDim() > kMaxDecodeLatentDim) {
    return makeError(ErrorCode::Unsupported,
                     fmt::format("device decode: latent_dim {} exceeds the attention kernel's {}", c.latentDim(),
                                 kMaxDecodeLatentDim));
  }
  const bool any_moe = c.n_routed_experts > 0 && c.first_k_dense_replace < c.num_hidden_layers;
  if (any_moe) {
    if (c.num_experts_per_tok <= 0 || c.num_experts_per_tok > c.n_routed_experts || c.n_group <= 0 ||
        c.n_routed_experts % c.n_group != 0 || c.topk_group <= 0 || c.topk_group > c.n_group ||
        c.moe_intermediate_size <= 0) {
      return invalid(fmt::format("device decode: MoE shape experts {}, top_k {}, groups {}, topk_group {}, width {}",
                                 c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group,
                                 c.moe_intermediate_size));
    }
  }
  if (c.intermediate_size <= 0 && c.first_k_dense_replace > 0) {
    return invalid("device decode: dense layers need a positive intermediate_size");
  }
  return okStatus();
}

Result<DecodeStepPlan> planDecodeStep(const ModelConfig& config, const DecodeCacheShape& cache,
                                      std::span<const DecodeSequence> batch) {
  if (batch.empty() || static_cast<std::int64_t>(batch.size()) > kMaxDecodeBatch) {
    return invalid(fmt::format("device decode: {} sequences; a step takes 1..{}", batch.size(), kMaxDecodeBatch));
  }
  if (cache.num_blocks <= 0 || cache.block_size <= 0) {
    return invalid(
        fmt::format("device decode: cache of {} blocks of {} positions", cache.num_blocks, cache.block_size));
  }
  DecodeStepPlan plan;
  plan.tokens = static_cast<std::int64_t>(batch.size());
  std::unordered_set<std::int64_t> slots;
  for (std::size_t s = 0; s < batch.size(); ++s) {
    const DecodeSequence& q = batch[s];
    if (q.token < 0 || q.token >= config.vocab_size) {
      return invalid(
          fmt::format("device decode: sequence {}: token id {} outside [0, {})", s, q.token, config.vocab_size));
    }
    const std::int64_t rope_position = q.position + q.rope_offset;
    if (q.position < 0 || q.rope_offset < 0 ||
        (config.max_position_embeddings > 0 && rope_position >= config.max_position_embeddings)) {
      return invalid(fmt::format("device decode: sequence {}: position {} (RoPE offset {}) outside [0, {})", s,
                                 q.position, q.rope_offset, config.max_position_embeddings));
    }
    const std::int64_t ctx = q.position + 1;
    const std::int64_t needed = (ctx + cache.block_size - 1) / cache.block_size;
    if (static_cast<std::int64_t>(q.block_table.size()) < needed) {
      return invalid(fmt::format("device decode: sequence {}: {} blocks of {} positions cannot hold position {}", s,
                                 q.block_table.size(), cache.block_size, q.position));
    }
    plan.table_begin.push_back(static_cast<std::int64_t>(plan.block_tables.size()));
    for (std::int64_t b = 0; b < needed; ++b) {
      const std::int32_t id = q.block_table[static_cast<std::size_t>(b)];
      if (id < 0 || id >= cache.num_blocks) {
        return invalid(fmt::format("device decode: sequence {}: block id {} outside [0, {})", s, id, cache.num_blocks));
      }
      plan.block_tables.push_back(id);
    }
    const std::int64_t slot =
        static_cast<std::int64_t>(q.block_table[static_cast<std::size_t>(q.position / cache.block_size)]) *
            cache.block_size +
        q.position % cache.block_size;
    if (!slots.insert(slot).second) {
      return invalid(
          fmt::format("device decode: sequence {} writes cache slot {} (block {}, offset {}) that another "
                      "sequence of the step writes",
                      s, slot, slot / cache.block_size, slot % cache.block_size));
    }
    plan.token_ids.push_back(q.token);
    plan.positions.push_back(rope_position);
    plan.ctx_len.push_back(ctx);
    plan.write_slot.push_back(slot);
    plan.max_context = std::max(plan.max_context, ctx);
  }
  return plan;
}

Status checkCacheShape(const DecodeCacheShape& shape) {
  if (shape.num_blocks <= 0 || shape.block_size <= 0 || shape.num_blocks > (std::int64_t{1} << 31) / shape.block_size) {
    return invalid(
        fmt::format("device decode: cache of {} blocks of {} positions", shape.num_blocks, shape.block_size));
  }
  if (shape.dtype != DType::F32 && shape.dtype != DType::BF16 && shape.dtype != DType::F8E4M3) {
    return invalid(fmt::format("device decode: a {} cache (only F32, BF16 and F8_E4M3)", dtypeName(shape.dtype)));
  }
  return okStatus();
}

AttentionCost attentionCost(const ModelConfig& c, const DecodeStepPlan& plan) {
  const auto heads = static_cast<double>(c.num_attention_heads);
  const auto nope = static_cast<double>(c.qk_nope_head_dim);
  const auto rope = static_cast<double>(c.qk_rope_head_dim);
  const auto v = static_cast<double>(c.v_head_dim);
  const auto rank = static_cast<double>(c.kv_lora_rank);
  const double ld = rank + rope;
  AttentionCost cost;
  for (const std::int64_t ctx : plan.ctx_len) {
    const auto n = static_cast<double>(ctx);
    cost.absorbed += 2.0 * heads * (nope + v) * rank + 2.0 * n * heads * (ld + rank);
    cost.prefill += 2.0 * n * heads * (nope + rope + v);
  }
  for (const PrefillSegment& s : prefillSegments(plan)) {
    cost.prefill += 2.0 * static_cast<double>(s.context) * heads * (nope + v) * rank;
  }
  return cost;
}

bool preferPrefillAttention(const ModelConfig& config, const DecodeStepPlan& plan) {
  const AttentionCost cost = attentionCost(config, plan);
  return cost.prefill < cost.absorbed;
}

std::int64_t graphRowBucket(std::int64_t rows) {
  if (rows <= 1) return 1;
  if (rows <= 2) return 2;
  if (rows <= 4) return 4;
  return std::min<std::int64_t>((rows + 7) / 8 * 8, kMaxDecodeBatch);
}

std::int64_t paddingBlocks(std::int64_t block_size) {
  return (kMaxDecodeBatch - 1 + block_size - 1) / block_size;
}

DecodeStepPlan padDecodeStep(const DecodeStepPlan& plan, std::int64_t rows, const DecodeCacheShape& cache) {
  DecodeStepPlan out = plan;
  for (std::int64_t i = 0; plan.tokens + i < rows; ++i) {
    const std::int64_t block = cache.num_blocks + i / cache.block_size;
    out.token_ids.push_back(0);
    out.positions.push_back(0);
    out.ctx_len.push_back(1);
    out.table_begin.push_back(static_cast<std::int64_t>(out.block_tables.size()));
    out.block_tables.push_back(static_cast<std::int32_t>(block));
    // Context 1 reads position 0 through the table: the row's table is its block, and the row
    // writes the block's slot i % block_size; slot 0 of that block is where it reads. Every
    // padded row reads slot 0 of its block, written by the padded row with that offset 0 (or by
    // itself): what it reads is a padded latent, never a real one.
    out.write_slot.push_back(block * cache.block_size + i % cache.block_size);
  }
  out.tokens = std::max(rows, plan.tokens);
  out.max_context = std::max<std::int64_t>(out.max_context, 1);
  return out;
}

std::vector<PrefillSegment> prefillSegments(const DecodeStepPlan& plan) {
  std::vector<PrefillSegment> out;
  const auto table_end = [&](std::int64_t t) {
    return t + 1 < plan.tokens ? plan.table_begin[static_cast<std::size_t>(t + 1)]
                               : static_cast<std::int64_t>(plan.block_tables.size());
  };
  // Row u continues row u - 1's segment when u - 1's table is a prefix of u's and u's context is
  // not shorter: then every earlier row of the segment reads its positions through u's table too.
  const auto continues = [&](std::int64_t u) {
    const auto prev = static_cast<std::size_t>(u - 1);
    const auto cur = static_cast<std::size_t>(u);
    if (plan.ctx_len[cur] < plan.ctx_len[prev]) return false;
    const std::int64_t prev_len = table_end(u - 1) - plan.table_begin[prev];
    const std::int64_t cur_len = table_end(u) - plan.table_begin[cur];
    if (prev_len > cur_len) return false;
    const auto* a = plan.block_tables.data() + plan.table_begin[prev];
    const auto* b = plan.block_tables.data() + plan.table_begin[cur];
    return std::equal(a, a + prev_len, b);
  };
  for (std::int64_t t = 0; t < plan.tokens; ++t) {
    if (t == 0 || !continues(t)) out.push_back(PrefillSegment{t, t, 0, 0});
    PrefillSegment& seg = out.back();
    seg.row_end = t + 1;
    seg.table_begin = plan.table_begin[static_cast<std::size_t>(t)];
    seg.context = plan.ctx_len[static_cast<std::size_t>(t)];
  }
  return out;
}

BatchedGemm linearGemm(std::int64_t rows, std::int64_t cols, std::int64_t tokens, std::int64_t x_stride,
                       std::int64_t y_stride) {
  // W row-major [rows, cols] is W^T column-major with ld = cols; x is [cols, tokens] column-major.
  BatchedGemm g;
  g.trans_a = true;
  g.m = rows;
  g.n = tokens;
  g.k = cols;
  g.lda = cols;
  g.ldb = x_stride;
  g.ldc = y_stride;
  return g;
}

BatchedGemm absorbQueryGemm(const ModelConfig& c, std::int64_t tokens) {
  const std::int64_t r = c.kv_lora_rank;
  const std::int64_t dn = c.qk_nope_head_dim;
  const std::int64_t heads = c.num_attention_heads;
  // W_UK_h row-major [dn, r] is column-major [r, dn] with ld r; C_h column-major [r, tokens].
  BatchedGemm g;
  g.m = r;
  g.n = tokens;
  g.k = dn;
  g.lda = r;
  g.stride_a = (dn + c.v_head_dim) * r;
  g.ldb = heads * c.qkHeadDim();
  g.stride_b = c.qkHeadDim();
  g.ldc = heads * c.latentDim();
  g.stride_c = c.latentDim();
  g.batch = heads;
  return g;
}

BatchedGemm valueUpGemm(const ModelConfig& c, std::int64_t tokens) {
  const std::int64_t r = c.kv_lora_rank;
  const std::int64_t dn = c.qk_nope_head_dim;
  const std::int64_t dv = c.v_head_dim;
  const std::int64_t heads = c.num_attention_heads;
  // W_UV_h row-major [dv, r] is column-major [r, dv] with ld r, transposed; B_h is [r, tokens].
  BatchedGemm g;
  g.trans_a = true;
  g.m = dv;
  g.n = tokens;
  g.k = r;
  g.lda = r;
  g.a_offset = dn * r;
  g.stride_a = (dn + dv) * r;
  g.ldb = heads * c.latentDim();
  g.stride_b = c.latentDim();
  g.ldc = heads * dv;
  g.stride_c = dv;
  g.batch = heads;
  return g;
}

void referenceGemm(const BatchedGemm& g, const float* a, const float* b, float* c) {
  for (std::int64_t bt = 0; bt < g.batch; ++bt) {
    const float* ab = a + g.a_offset + bt * g.stride_a;
    const float* bb = b + bt * g.stride_b;
    float* cb = c + bt * g.stride_c;
    for (std::int64_t j = 0; j < g.n; ++j) {
      for (std::int64_t i = 0; i < g.m; ++i) {
        float sum = 0.0F;
        for (std::int64_t p = 0; p < g.k; ++p) {
          const float x = g.trans_a ? ab[p + i * g.lda] : ab[i + p * g.lda];
          const float y = g.trans_b ? bb[j + p * g.ldb] : bb[p + j * g.ldb];
          sum += x * y;
        }
        cb[i + j * g.ldc] = sum;
      }
    }
  }
}

std::int64_t graphAttentionContext(std::int64_t max_context, std::int64_t split_positions, std::int64_t limit) {
  if (max_context <= 0 || split_positions <= 0) return max_context;
  const std::int64_t splits = (max_context + split_positions - 1) / split_positions;
  std::int64_t bucket = 1;
  while (bucket < splits) bucket *= 2;
  const std::int64_t context = bucket * split_positions;
  return std::max(max_context, std::min(context, limit));
}

}  // namespace pd::gpu
