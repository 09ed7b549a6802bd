#pragma once
/// The draft half of speculative decoding: a Drafter proposes the next tokens of every
/// speculating sequence of a step; the DecodeEngine's draft verifier then runs them through the
/// main model in one forward and keeps the prefix that sampling confirms (decode_engine.h). The
/// drafter never changes the output, only how many tokens a step emits.
///
/// MtpDrafter, the model's own MTP layer, is the drafter a worker runs. `pdserve bench decode`
/// subclasses it to propose a known continuation with a chosen probability (choose()), so that
/// acceptance can be set while the MTP layer's cost is still paid.
///
/// Thread rules: engine thread only, like the DecodeEngine that calls it.

#include <cstdint>
#include <span>
#include <vector>

#include "pd/common/result.h"
#include "pd/decode/kv_pool.h"
#include "pd/engine/engine.h"

namespace pd::decode {

/// A sequence's MTP layer state. The MTP layer has cached positions [0, done); `hidden` holds the
/// main model's final hidden states of positions [done, len - 1), the inputs it still needs. The
/// draft verifier appends to `hidden`; MtpDrafter consumes it.
struct MtpState {
  std::int64_t done = 0;
  std::vector<float> hidden;
};

/// One sequence's share of a draft step.
struct DraftSlot {
  std::uint64_t request_id = 0;
  std::int64_t prompt_tokens = 0;
  /// Tokens after the prompt; the last one is not yet in the cache. Its index is the output
  /// index of the token just before the first draft (the first token, from prefill, is 0).
  std::span<const std::int32_t> generated;
  std::int64_t count = 0;  ///< drafts wanted (>= 1)
  /// Cache blocks covering every position the step writes (the drafts' included).
  std::span<const std::int32_t> block_table;
  MtpState* mtp = nullptr;  ///< never null
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  Drafter() = default;
  Drafter(const Drafter&) = delete;
  Drafter& operator=(const Drafter&) = delete;
  Drafter(Drafter&&) = delete;
  Drafter& operator=(Drafter&&) = delete;

  /// drafts[i] holds slots[i].count proposed tokens, each inside the vocabulary. An error fails
  /// the whole step (the engine ends the batch's requests with it).
  [[nodiscard]] virtual Result<std::vector<std::vector<std::int32_t>>> draft(std::span<const DraftSlot> slots) = 0;
};

/// Drafts with the checkpoint's MTP layer: it first catches up on the positions whose inputs are
/// now known (the slot's MtpState), its last row drafts the token after the last one, and further
/// drafts chain the layer on its own output and hidden state. Needs an engine with an MTP layer.
class MtpDrafter : public Drafter {
 public:
  /// `engine` and `pool` must outlive the drafter.
  MtpDrafter(model::Engine& engine, KvPool& pool) : engine_(engine), pool_(pool) {}

  [[nodiscard]] Result<std::vector<std::vector<std::int32_t>>> draft(std::span<const DraftSlot> slots) final;

 protected:
  /// The token to propose at output index `output_index` of `request_id` (the MTP layer's
  /// argmax is `mtp_draft`); the chain continues from the returned token. Must return a token
  /// inside the vocabulary (PD_CHECKed).
  [[nodiscard]] virtual std::int32_t choose(std::uint64_t /*request_id*/, std::int64_t /*output_index*/,
                                            std::int32_t mtp_draft) {
    return mtp_draft;
  }

 private:
  model::Engine& engine_;
  KvPool& pool_;
};

}  // namespace pd::decode
