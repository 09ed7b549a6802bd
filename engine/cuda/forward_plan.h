#pragma once
/// The host side of a CudaEngine call (cuda_engine.h): a batch of sequence chunks (prefill chunks,
/// decode steps, MTP verify: any number of new tokens per sequence) checked like the CPU engine
/// checks it, then cut into device steps of at most `max_step_rows` rows. Each new token is one
/// row that attends to the cache positions up to and including its own (exact causal attention:
/// a chunk of n tokens runs as n absorbed-attention rows), so a chunk may be split across steps:
/// a later step's rows find the earlier steps' latents in the device cache.
/// Also: the runs of contiguous cache slots that hold a range of a sequence's positions (what is
/// copied between the caller's host cache and the engine's device cache).
///
/// Host arithmetic only, in every build (CPU-only builds and their unit tests included).
/// Private to the CUDA backend (engine/cuda) and its tests.
/// Thread rules: free functions, thread-safe; a plan is a value that refers to the batch's spans.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "decode_step_plan.h"
#include "pd/common/result.h"
#include "pd/engine/engine.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/model_config.h"

namespace pd::gpu {

/// One device step of a forward call: rows [first_row, first_row + plan.tokens) of the call.
struct ForwardStep {
  DecodeStepPlan plan;
  std::int64_t first_row = 0;
  std::vector<std::int64_t> logit_rows;   ///< step-local rows whose logits the call returns, ascending
  std::vector<std::int64_t> hidden_rows;  ///< step-local rows whose hidden states the call returns
  /// Per sequence with rows in this step: (sequence, its first row in the step, row count,
  /// cache position of that first row), in batch order: what the latent sink is called with.
  struct SequenceSpan {
    std::size_t sequence = 0;
    std::int64_t first_row = 0;
    std::int64_t rows = 0;
    std::int64_t start_pos = 0;
  };
  std::vector<SequenceSpan> sequences;
};

struct ForwardPlan {
  std::int64_t rows = 0;  ///< new tokens of the whole batch
  std::vector<ForwardStep> steps;
  std::int64_t logit_rows = 0;   ///< rows of ForwardOutput::logits
  std::int64_t hidden_rows = 0;  ///< rows of ForwardOutput::hidden
};

/// Checks `batch` as the CPU engine does (InvalidArgument: empty batch or chunk, negative position,
/// token outside the vocabulary, block table too short or with an id outside [0, num_blocks),
/// RoPE position beyond max_position_embeddings, for MTP prev_hidden of the wrong size; the host
/// cache's dtype (F32 / BF16), latent_dim and its layer count for `kv_layer`) and cuts the rows in
/// batch order into steps of at most max_step_rows (1..kMaxDecodeBatch) rows. `logits` / `hidden`
/// say which rows' outputs the call returns (Last: each sequence's last token).
[[nodiscard]] Result<ForwardPlan> planForward(const ModelConfig& config, const model::LatentCacheView& cache,
                                              std::span<const model::SequenceChunk> batch, std::int64_t kv_layer,
                                              bool mtp, model::OutputRows logits, model::OutputRows hidden,
                                              std::int64_t max_step_rows = kMaxDecodeBatch);

/// Positions [begin, begin + count) of a sequence live in slots [slot, slot + count) of the cache
/// (slot = block id * block_size + offset).
struct CacheRun {
  std::int64_t position = 0;
  std::int64_t slot = 0;
  std::int64_t count = 0;
};

/// The runs of contiguous slots holding positions [begin, end) of a sequence with `block_table`
/// (blocks with consecutive ids merge into one run). The table must hold the positions (checked
/// by planForward first).
[[nodiscard]] std::vector<CacheRun> cacheRuns(std::span<const std::int32_t> block_table, std::int64_t block_size,
                                              std::int64_t begin, std::int64_t end);

}  // namespace pd::gpu
