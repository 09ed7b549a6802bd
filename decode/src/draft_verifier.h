#pragma once
// The verify half of speculative decoding (decode_engine.h, step 3): one forward of the main
// model over (last token, drafts...) of every sequence in the step, then each verified position
// is sampled with the request's own sampler exactly as plain decoding would; a draft is accepted
// only if it equals that sample, so speculation never changes the output.
//
// When the engine is also a model::SamplingEngine (the CUDA engine), the rows are sampled where
// the logits are (forwardSampled): each row gets its request's parameters, draw counter and token
// counts as its sampler would have them after the drafts before it, and, for a constrained
// sequence, the grammar's mask after those drafts (ConstraintState::rowMasks), so the tokens are
// the host sampler's, and only they cross to the host. The host samplers are then advanced by
// the tokens emitted (Sampler::resumeAfter) and the grammars accept them.
// Thread rules: engine thread only.

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "constraint_state.h"
#include "pd/common/result.h"
#include "pd/decode/drafter.h"
#include "pd/decode/kv_pool.h"
#include "pd/engine/device_sampling.h"
#include "pd/engine/engine.h"
#include "pd/engine/sampling.h"

namespace pd::decode {

/// One sequence's share of a verify forward.
struct VerifySlot {
  std::int32_t last_token = 0;  ///< the sequence's last token, not yet cached
  std::int64_t position = 0;    ///< its cache position
  std::span<const std::int32_t> drafts;
  std::span<const std::int32_t> block_table;
  model::Sampler* sampler = nullptr;  ///< never null
  std::size_t max_emit = 0;           ///< tokens the request may still emit (>= 1)
  /// A speculating sequence: the verified positions' hidden states are appended to its
  /// MtpState (the MTP layer's next inputs). Null when the sequence does not speculate.
  MtpState* mtp = nullptr;
  /// The sequence's output constraint: every position is sampled under its mask and the sample
  /// accepted into it. Null: free text.
  ConstraintState* constraint = nullptr;
};

struct Verified {
  std::vector<model::SampledToken> tokens;  ///< the samples emitted (accepted drafts, then one more)
  std::int64_t accepted = 0;                ///< drafts accepted
};

class DraftVerifier {
 public:
  /// `engine` and `pool` must outlive the verifier.
  DraftVerifier(model::Engine& engine, KvPool& pool)
      : engine_(engine), sampling_engine_(dynamic_cast<model::SamplingEngine*>(&engine)), pool_(pool) {}

  /// One result per slot, in order; the forward's error otherwise.
  [[nodiscard]] Result<std::vector<Verified>> verify(std::span<const VerifySlot> slots);

  /// Wall time in the samplers (masks applied included, the grammar's own work not) since the
  /// last call: DecodeStats::sample_seconds.
  [[nodiscard]] double takeSampleSeconds() { return std::exchange(sample_seconds_, 0.0); }
  /// Tokens sampled by the engine (forwardSampled) since the last call: DecodeStats.
  [[nodiscard]] std::int64_t takeEngineSampledTokens() { return std::exchange(engine_sampled_tokens_, 0); }

 private:
  /// Whether this step's rows can be sampled by the engine: it samples, and it takes every
  /// slot's parameters.
  [[nodiscard]] bool engineSamples(std::span<const VerifySlot> slots) const;

  model::Engine& engine_;
  model::SamplingEngine* sampling_engine_;  ///< the engine, when it samples; else null
  KvPool& pool_;
  double sample_seconds_ = 0.0;
  std::int64_t engine_sampled_tokens_ = 0;
};

}  // namespace pd::decode
