#pragma once
// One decoding sequence's output constraint (docs/structured-outputs.md): the grammar's Matcher
// and the mask buffer every sampling step of the sequence uses. The decode engine samples each
// verified position under mask(), accepts what it sampled, and trims MTP drafts to the prefix the
// grammar accepts before they are verified (a draft the grammar refuses could never equal a
// sample drawn under the mask).
// Thread rules: engine thread only (one per sequence).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "pd/common/result.h"
#include "pd/structured/grammar.h"

namespace pd::decode {

class ConstraintState {
 public:
  explicit ConstraintState(std::shared_ptr<const structured::Grammar> grammar);

  /// The tokens allowed next (a bitset over the model's vocabulary); valid until the next call.
  [[nodiscard]] std::span<const std::uint64_t> mask();
  /// Advances by one token; InvalidArgument (state unchanged) when the grammar refuses it.
  [[nodiscard]] Status accept(pd::TokenId token);
  /// How many leading `drafts` the grammar accepts in order; the state is unchanged after the
  /// call (the drafts are accepted, counted, then rolled back).
  [[nodiscard]] std::size_t acceptablePrefix(std::span<const std::int32_t> drafts);
  /// Words of a mask (the vocabulary's maskWords()).
  [[nodiscard]] std::size_t maskWords() const { return mask_.size(); }
  /// The masks a verify forward samples the rows of (last token, drafts...) with, concatenated:
  /// row j's is the mask after drafts [0, j) were accepted; a row past a draft the grammar
  /// refuses or past a stop token (never sampled: verification stops before it) repeats the last
  /// mask. The state is unchanged after the call.
  [[nodiscard]] std::vector<std::uint64_t> rowMasks(std::span<const std::int32_t> drafts);
  /// True once a stop token was accepted: the output is complete and nothing may follow.
  [[nodiscard]] bool terminated() const { return matcher_.isTerminated(); }
  /// Wall time spent in mask(), accept(), acceptablePrefix() and rowMasks() since the last call (the
  /// grammar's share of a decode step; DecodeStats::grammar_seconds).
  [[nodiscard]] double takeSeconds() { return std::exchange(seconds_, 0.0); }

 private:
  std::vector<structured::MaskWord> mask_;  // sized from the grammar before matcher_ takes it
  structured::Matcher matcher_;
  double seconds_ = 0.0;
};

}  // namespace pd::decode
