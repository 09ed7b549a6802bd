#include "draft_verifier.h"

#include <chrono>

#include "pd/common/check.h"

namespace pd::decode {

Result<std::vector<Verified>> DraftVerifier::verify(std::span<const VerifySlot> slots) {
  const ModelConfig& cfg = engine_.config();
  const auto d = static_cast<std::size_t>(cfg.hidden_size);
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  const std::size_t n = slots.size();
  std::vector<std::vector<std::int32_t>> feeds(n);
  std::vector<model::SequenceChunk> chunks;
  chunks.reserve(n);
  bool any_spec = false;
  for (std::size_t i = 0; i < n; ++i) {
    const VerifySlot& s = slots[i];
    feeds[i].push_back(s.last_token);
    feeds[i].insert(feeds[i].end(), s.drafts.begin(), s.drafts.end());
    chunks.push_back(model::SequenceChunk{feeds[i], s.position, s.block_table});
    any_spec = any_spec || s.mtp != nullptr;
  }
  model::ForwardOptions fo;
  fo.attention = model::AttentionPath::Absorbed;
  fo.logits = model::OutputRows::All;
  fo.hidden = any_spec ? model::OutputRows::All : model::OutputRows::None;
  PD_ASSIGN_OR_RETURN(model::ForwardOutput out, engine_.forward(chunks, pool_.view(), fo));

  std::vector<Verified> verified(n);
  std::size_t row = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const VerifySlot& s = slots[i];
    const std::size_t rows = feeds[i].size();
    Verified& v = verified[i];
    for (std::size_t j = 0; j < rows && v.tokens.size() < s.max_emit; ++j) {
      if (s.mtp != nullptr) {
        const auto* h = out.hidden.data() + (row + j) * d;
        s.mtp->hidden.insert(s.mtp->hidden.end(), h, h + d);
      }
      const std::span<const float> logits(out.logits.data() + (row + j) * vocab, vocab);
      if (s.constraint != nullptr) {
        const std::span<const std::uint64_t> mask = s.constraint->mask();
        const auto t0 = std::chrono::steady_clock::now();
        v.tokens.push_back(s.sampler->sample(logits, mask));
        sample_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        PD_CHECK(s.constraint->accept(v.tokens.back().token).ok());  // sampled under the mask
        if (s.constraint->terminated()) break;                       // nothing may follow the stop token
      } else {
        const auto t0 = std::chrono::steady_clock::now();
        v.tokens.push_back(s.sampler->sample(logits));
        sample_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      if (j >= s.drafts.size() || v.tokens.back().token != s.drafts[j]) break;
      ++v.accepted;
    }
    row += rows;
  }
  return verified;
}

}  // namespace pd::decode
