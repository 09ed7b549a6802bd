#pragma once
// A model::SamplingEngine over any engine that samples each logits row (under its allowed-token
// mask, if any) with a fresh host Sampler put where the request's would be (resumeAfter of the row's token counts; the
// draw counter is checked to be one per produced token when sampling is stochastic), so that the bookkeeping of a
// caller of forwardSampled (model::generate, the decode worker's verifier) is checked in every
// build against plain host sampling; tests/gpu runs the CUDA engine's DeviceSampler through the
// same callers. Like a device engine it returns no logits, only the tokens.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "pd/engine/device_sampling.h"
#include "pd/engine/engine.h"
#include "pd/engine/sampling.h"

namespace pd::test_support {

class HostRowSamplingEngine final : public model::Engine, public model::SamplingEngine {
 public:
  explicit HostRowSamplingEngine(std::unique_ptr<model::Engine> inner) : owned_(std::move(inner)), inner_(*owned_) {}
  explicit HostRowSamplingEngine(model::Engine& inner) : inner_(inner) {}
  [[nodiscard]] const pd::ModelConfig& config() const override { return inner_.config(); }
  [[nodiscard]] model::EngineCapabilities capabilities() const override { return inner_.capabilities(); }
  pd::Result<model::ForwardOutput> forward(std::span<const model::SequenceChunk> batch,
                                           const model::LatentCacheView& cache,
                                           const model::ForwardOptions& options) override {
    return inner_.forward(batch, cache, options);
  }
  pd::Result<model::ForwardOutput> forwardMtp(std::span<const model::SequenceChunk> batch,
                                              const model::LatentCacheView& cache,
                                              const model::ForwardOptions& options) override {
    return inner_.forwardMtp(batch, cache, options);
  }
  pd::Result<model::SampledForward> forwardSampled(std::span<const model::SequenceChunk> batch,
                                                   const model::LatentCacheView& cache,
                                                   const model::ForwardOptions& options,
                                                   std::span<const model::RowSample> rows) override {
    PD_ASSIGN_OR_RETURN(model::ForwardOutput out, inner_.forward(batch, cache, options));
    const auto vocab = static_cast<std::size_t>(config().vocab_size);
    EXPECT_EQ(out.logits.size(), rows.size() * vocab) << "one request per logits row";
    model::SampledForward r;
    for (std::size_t j = 0; j < rows.size() && (j + 1) * vocab <= out.logits.size(); ++j) {
      const model::RowSample& row = rows[j];
      std::vector<std::int32_t> produced;
      for (const auto& [token, count] : row.counts) {
        produced.insert(produced.end(), static_cast<std::size_t>(count), token);
      }
      // Every produced token consumed one draw when sampling is stochastic (none when greedy).
      const std::uint64_t want_draw = row.params->temperature > 0.0 ? produced.size() : 0;
      EXPECT_EQ(row.draw, want_draw) << "row " << j;
      model::Sampler sampler(*row.params);
      sampler.resumeAfter(produced);
      r.sampled.push_back(sampler.sample(std::span<const float>(out.logits.data() + j * vocab, vocab), row.allowed));
      if (!row.allowed.empty()) ++masked_rows;
      ++sampled_rows;
    }
    r.output = std::move(out);
    r.output.logits.clear();  // as a device engine: nothing but the tokens comes back
    return r;
  }
  int sampled_rows = 0;
  int masked_rows = 0;  ///< rows sampled under an allowed-token mask

 private:
  std::unique_ptr<model::Engine> owned_;
  model::Engine& inner_;
};

/// The sampling parameters a caller of forwardSampled is checked with: greedy, seeded top-k,
/// top-p with penalties, greedy with penalties (the counts matter, the draws do not), and
/// logit_bias with top logprobs.
inline std::vector<pd::SamplingParams> engineSamplingCases() {
  std::vector<pd::SamplingParams> cases(5);
  cases[1].temperature = 0.9;
  cases[1].top_k = 50;
  cases[1].seed = 11;
  cases[2].temperature = 0.7;
  cases[2].top_p = 0.9;
  cases[2].presence_penalty = 0.5;
  cases[2].frequency_penalty = 0.3;
  cases[2].seed = 3;
  cases[3].presence_penalty = 1.5;
  cases[4].temperature = 0.8;
  cases[4].seed = 5;
  cases[4].top_logprobs = 3;
  cases[4].logit_bias = {{5, 6.0F}, {77, -100.0F}};
  return cases;
}

}  // namespace pd::test_support
