#include "forward_plan.h"

#include <fmt/format.h>

#include <algorithm>

#include "pd/common/kv_format.h"

namespace pd::gpu {
namespace {

using i64 = std::int64_t;

Error invalid(std::string message) {
  return makeError(ErrorCode::InvalidArgument, std::move(message));
}

Status checkBatch(const ModelConfig& c, const model::LatentCacheView& cache,
                  std::span<const model::SequenceChunk> batch, i64 kv_layer, bool mtp) {
  if (batch.empty()) return invalid("empty batch");
  if (!isKvDType(cache.dtype)) {
    return invalid("latent cache dtype must be F32, BF16 or F8_E4M3");
  }
  if (cache.latent_dim != c.latentDim() || cache.block_size <= 0 || cache.num_blocks <= 0 ||
      static_cast<i64>(cache.layers.size()) <= kv_layer) {
    return invalid(fmt::format(
        "latent cache has latent_dim {}, {} blocks of {} and {} layers; the model needs latent_dim {} and layer {}",
        cache.latent_dim, cache.num_blocks, cache.block_size, cache.layers.size(), c.latentDim(), kv_layer));
  }
  for (std::size_t si = 0; si < batch.size(); ++si) {
    const model::SequenceChunk& s = batch[si];
    const auto n = static_cast<i64>(s.tokens.size());
    if (n == 0) return invalid(fmt::format("sequence {} has no new tokens", si));
    if (s.start_pos < 0 || s.rope_offset < 0) return invalid(fmt::format("sequence {}: negative position", si));
    for (const std::int32_t tok : s.tokens) {
      if (tok < 0 || tok >= c.vocab_size) {
        return invalid(fmt::format("sequence {}: token id {} outside [0, {})", si, tok, c.vocab_size));
      }
    }
    const i64 end = s.start_pos + n;
    if (static_cast<i64>(s.block_table.size()) * cache.block_size < end) {
      return invalid(fmt::format("sequence {}: {} blocks of {} tokens cannot hold {} positions", si,
                                 s.block_table.size(), cache.block_size, end));
    }
    for (i64 b = 0; b < (end + cache.block_size - 1) / cache.block_size; ++b) {
      const std::int32_t id = s.block_table[static_cast<std::size_t>(b)];
      if (id < 0 || id >= cache.num_blocks) {
        return invalid(fmt::format("sequence {}: block id {} outside [0, {})", si, id, cache.num_blocks));
      }
    }
    if (c.max_position_embeddings > 0 && end + s.rope_offset > c.max_position_embeddings) {
      return invalid(fmt::format("sequence {}: position {} beyond max_position_embeddings {}", si,
                                 end + s.rope_offset - 1, c.max_position_embeddings));
    }
    if (mtp && static_cast<i64>(s.prev_hidden.size()) != n * c.hidden_size) {
      return invalid(fmt::format("sequence {}: MTP needs {} x {} previous hidden values, got {}", si, n, c.hidden_size,
                                 s.prev_hidden.size()));
    }
  }
  return okStatus();
}

bool wanted(model::OutputRows rows, i64 index, i64 count) {
  return rows == model::OutputRows::All || (rows == model::OutputRows::Last && index == count - 1);
}

}  // namespace

Result<ForwardPlan> planForward(const ModelConfig& config, const model::LatentCacheView& cache,
                                std::span<const model::SequenceChunk> batch, i64 kv_layer, bool mtp,
                                model::OutputRows logits, model::OutputRows hidden, i64 max_step_rows) {
  if (max_step_rows <= 0 || max_step_rows > kMaxDecodeBatch) {
    return invalid(
        fmt::format("device forward: {} rows per step; the step takes 1..{}", max_step_rows, kMaxDecodeBatch));
  }
  PD_TRY(checkBatch(config, cache, batch, kv_layer, mtp));
  struct Row {
    std::size_t sequence;
    i64 index;
  };
  std::vector<Row> rows;
  for (std::size_t s = 0; s < batch.size(); ++s) {
    for (i64 i = 0; i < static_cast<i64>(batch[s].tokens.size()); ++i) rows.push_back({s, i});
  }
  ForwardPlan plan;
  plan.rows = static_cast<i64>(rows.size());
  const DecodeCacheShape shape{cache.num_blocks, cache.block_size};
  for (i64 first = 0; first < plan.rows; first += max_step_rows) {
    const i64 count = std::min(max_step_rows, plan.rows - first);
    ForwardStep step;
    step.first_row = first;
    std::vector<DecodeSequence> seqs;
    seqs.reserve(static_cast<std::size_t>(count));
    for (i64 r = 0; r < count; ++r) {
      const Row& row = rows[static_cast<std::size_t>(first + r)];
      const model::SequenceChunk& s = batch[row.sequence];
      const auto n = static_cast<i64>(s.tokens.size());
      seqs.push_back(
          {s.tokens[static_cast<std::size_t>(row.index)], s.start_pos + row.index, s.block_table, s.rope_offset});
      if (wanted(logits, row.index, n)) step.logit_rows.push_back(r);
      if (wanted(hidden, row.index, n)) step.hidden_rows.push_back(r);
      if (step.sequences.empty() || step.sequences.back().sequence != row.sequence) {
        step.sequences.push_back({row.sequence, r, 0, s.start_pos + row.index});
      }
      ++step.sequences.back().rows;
    }
    PD_ASSIGN_OR_RETURN(step.plan, planDecodeStep(config, shape, seqs));
    plan.logit_rows += static_cast<i64>(step.logit_rows.size());
    plan.hidden_rows += static_cast<i64>(step.hidden_rows.size());
    plan.steps.push_back(std::move(step));
  }
  return plan;
}

std::vector<CacheRun> cacheRuns(std::span<const std::int32_t> block_table, i64 block_size, i64 begin, i64 end) {
  std::vector<CacheRun> runs;
  for (i64 p = begin; p < end;) {
    const i64 offset = p % block_size;
    const i64 count = std::min(block_size - offset, end - p);
    const i64 slot = static_cast<i64>(block_table[static_cast<std::size_t>(p / block_size)]) * block_size + offset;
    if (!runs.empty() && runs.back().slot + runs.back().count == slot) {
      runs.back().count += count;
    } else {
      runs.push_back({p, slot, count});
    }
    p += count;
  }
  return runs;
}

}  // namespace pd::gpu
