#include "pd/decode/drafter.h"

#include <algorithm>

#include "pd/engine/sampling.h"

namespace pd::decode {

Result<std::vector<std::vector<std::int32_t>>> MtpDrafter::draft(std::span<const DraftSlot> slots) {
  const ModelConfig& cfg = engine_.config();
  const auto d = static_cast<std::size_t>(cfg.hidden_size);
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  const std::size_t n = slots.size();
  std::vector<std::vector<std::int32_t>> drafts(n);
  if (n == 0) return drafts;
  std::vector<std::vector<float>> mtp_hidden(n);
  const auto propose = [&](std::size_t i, std::int64_t j, std::int32_t mtp_draft) {
    const DraftSlot& s = slots[i];
    const std::int32_t token = choose(s.request_id, static_cast<std::int64_t>(s.generated.size()) + j, mtp_draft);
    PD_CHECK(token >= 0 && static_cast<std::size_t>(token) < vocab);
    drafts[i].push_back(token);
  };
  model::ForwardOptions fo;
  fo.logits = model::OutputRows::Last;
  fo.hidden = model::OutputRows::Last;

  // Catch up on positions [done, len - 1) and draft the token after the last one.
  std::vector<model::SequenceChunk> chunks;
  chunks.reserve(n);
  for (const DraftSlot& s : slots) {
    const auto len = s.prompt_tokens + static_cast<std::int64_t>(s.generated.size());
    const std::int64_t start = len - 1;
    const auto first = static_cast<std::size_t>(s.mtp->done + 1 - s.prompt_tokens);
    const auto count = static_cast<std::size_t>(start - s.mtp->done);
    PD_CHECK(s.count >= 1 && s.mtp->hidden.size() == count * d);
    chunks.push_back(
        model::SequenceChunk{s.generated.subspan(first, count), s.mtp->done, s.block_table, s.mtp->hidden});
  }
  PD_ASSIGN_OR_RETURN(model::ForwardOutput m, engine_.forwardMtp(chunks, pool_.view(), fo));
  for (std::size_t i = 0; i < n; ++i) {
    const DraftSlot& s = slots[i];
    propose(i, 0, model::argmax(std::span<const float>(m.logits.data() + i * vocab, vocab)));
    mtp_hidden[i].assign(m.hidden.begin() + static_cast<std::ptrdiff_t>(i * d),
                         m.hidden.begin() + static_cast<std::ptrdiff_t>((i + 1) * d));
    s.mtp->done = s.prompt_tokens + static_cast<std::int64_t>(s.generated.size()) - 1;
    s.mtp->hidden.clear();
  }

  // Further drafts: the layer on its own last draft and hidden state.
  std::int64_t k_max = 0;
  for (const DraftSlot& s : slots) k_max = std::max(k_max, s.count);
  std::vector<std::size_t> who;
  for (std::int64_t j = 1; j < k_max; ++j) {
    chunks.clear();
    who.clear();
    for (std::size_t i = 0; i < n; ++i) {
      const DraftSlot& s = slots[i];
      if (s.count <= j) continue;
      const std::int64_t last = s.prompt_tokens + static_cast<std::int64_t>(s.generated.size()) - 1;
      chunks.push_back(model::SequenceChunk{std::span<const std::int32_t>(&drafts[i].back(), 1), last + j - 1,
                                            s.block_table, mtp_hidden[i]});
      who.push_back(i);
    }
    PD_ASSIGN_OR_RETURN(model::ForwardOutput c, engine_.forwardMtp(chunks, pool_.view(), fo));
    for (std::size_t r = 0; r < who.size(); ++r) {
      const std::size_t i = who[r];
      propose(i, j, model::argmax(std::span<const float>(c.logits.data() + r * vocab, vocab)));
      mtp_hidden[i].assign(c.hidden.begin() + static_cast<std::ptrdiff_t>(r * d),
                           c.hidden.begin() + static_cast<std::ptrdiff_t>((r + 1) * d));
    }
  }
  return drafts;
}

}  // namespace pd::decode
