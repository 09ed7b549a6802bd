#pragma once
/// Sampling where the logits are computed: an Engine that also implements SamplingEngine (the
/// CUDA engine) samples its logits rows on the device, so that only the sampled ids and their
/// logprobs cross to the host, never the [rows, vocab] logits. The rules are model::Sampler's
/// (sampling.h) and so are the tokens: a row is keyed by the request's seed and its draw counter
/// (the non-greedy tokens sampled so far), and its penalties by the counts of the tokens the
/// request produced, so no sampler state lives on the device. logit_bias and top-n logprobs are
/// sampled there too (the top logprobs come back with the token).
///
/// An allowed-token mask (grammar-constrained decoding) goes with its row: the device sets every
/// token outside it to -inf after logit_bias, as the host Sampler's dense path does, which picks
/// the same token as its sparse path. deviceSamplable() says whether a request's parameters are
/// within what the device takes.
///
/// Thread rules: as model::Engine (one thread at a time).

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "pd/common/result.h"
#include "pd/engine/engine.h"
#include "pd/engine/sampling.h"

namespace pd::model {

/// One logits row's sampling request.
struct RowSample {
  const SamplingParams* params = nullptr;  ///< not owned; deviceSamplable(*params)
  std::uint64_t draw = 0;                  ///< the request's non-greedy tokens sampled before this row
  /// The tokens the request produced before this row, each with its count (distinct ids).
  std::span<const std::pair<std::int32_t, std::int64_t>> counts;
  /// Empty: every token. Otherwise a bitset over token ids as Sampler::sample's `allowed` (bit t
  /// of word t / 64), of ceil(vocab / 64) words, allowing at least one token below vocab.
  std::span<const std::uint64_t> allowed;
};

/// Most top logprobs the device reports per token (SamplingParams' own limit).
inline constexpr std::int64_t kMaxDeviceTopLogprobs = 20;

/// Whether the device samples `params` exactly as the host Sampler would: every validated
/// request (validate(SamplingParams)) is, this checks the two limits the device has.
[[nodiscard]] inline bool deviceSamplable(const SamplingParams& params) {
  return params.top_logprobs >= 0 && params.top_logprobs <= kMaxDeviceTopLogprobs &&
         params.logit_bias.size() <= kMaxLogitBias;
}

struct SampledForward {
  ForwardOutput output;               ///< logits empty; hidden as options.hidden says
  std::vector<SampledToken> sampled;  ///< one per logits row (token, its raw logprob, the top alternatives asked for)
};

class SamplingEngine {
 public:
  virtual ~SamplingEngine() = default;
  /// Engine::forward whose logits rows (options.logits) are sampled where they are computed:
  /// `rows` holds one request per logits row, in the order the logits would have come.
  /// InvalidArgument for a row count that differs or a request deviceSamplable() refuses.
  virtual Result<SampledForward> forwardSampled(std::span<const SequenceChunk> batch, const LatentCacheView& cache,
                                                const ForwardOptions& options, std::span<const RowSample> rows) = 0;
};

}  // namespace pd::model
