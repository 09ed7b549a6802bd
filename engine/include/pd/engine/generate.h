#pragma once
/// Single-process generation: prefill, then decode steps, optionally with MTP speculation
/// (the MTP layer drafts k tokens, one main-model step verifies them). This is the reference the
/// disaggregated system is tested against (`pdserve generate`).
///
/// Speculation never changes the output: each verified position is sampled from the main
/// model's logits with the request's sampler exactly as plain decoding would (one RNG draw per
/// emitted token), and a draft is accepted only if it equals that sample.
///
/// Thread rules: runs on the calling thread, which must own the engine for the duration.

#include <cstdint>
#include <span>
#include <vector>

#include "pd/common/dtype.h"
#include "pd/common/result.h"
#include "pd/engine/engine.h"
#include "pd/engine/sampling.h"

namespace pd::model {

struct GenerateOptions {
  std::int64_t max_tokens = 16;
  SamplingParams sampling;
  std::int64_t mtp_drafts = 0;   ///< tokens drafted per step by the MTP layer (0 = no speculation)
  bool stop_at_eos = true;       ///< stop after the config's eos_token_id
  std::int64_t block_size = 64;  ///< latent cache block size
  DType cache_dtype = DType::F32;
  std::int64_t prefill_chunk = 0;  ///< prefill in chunks of this many tokens (0 = one chunk)
  /// Sample on the engine where it computes the logits (a SamplingEngine, device_sampling.h: only
  /// the sampled ids and their logprobs cross to the host) when it is one and the sampling params
  /// allow it (deviceSamplable); the host Sampler otherwise. The tokens are the same either way.
  bool device_sampling = false;
};

struct GenerateResult {
  std::vector<std::int32_t> tokens;   ///< generated tokens (the prompt not included)
  std::vector<SampledToken> samples;  ///< per generated token: logprob and top logprobs
  std::int64_t decode_steps = 0;      ///< main-model decode calls
  std::int64_t drafts_proposed = 0;
  std::int64_t drafts_accepted = 0;
};

/// InvalidArgument for an empty prompt, bad sampling params, or a prompt + max_tokens beyond
/// max_position_embeddings; Unsupported for mtp_drafts > 0 on a checkpoint without MTP.
Result<GenerateResult> generate(Engine& engine, std::span<const std::int32_t> prompt, const GenerateOptions& options);

}  // namespace pd::model
