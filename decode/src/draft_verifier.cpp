#include "draft_verifier.h"

#include <fmt/format.h>

#include <chrono>
#include <map>

#include "pd/common/check.h"

namespace pd::decode {

bool DraftVerifier::engineSamples(std::span<const VerifySlot> slots) const {
  if (sampling_engine_ == nullptr) return false;
  const auto words = static_cast<std::size_t>((engine_.config().vocab_size + 63) / 64);
  for (const VerifySlot& s : slots) {
    if (!model::deviceSamplable(s.sampler->params())) return false;
    if (s.constraint != nullptr && s.constraint->maskWords() != words) return false;  // masks the model's vocabulary
  }
  return true;
}

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
  const bool engine_samples = engineSamples(slots);
  model::ForwardOutput out;
  std::vector<model::SampledToken> sampled;  // engine_samples: one per row, in row order
  if (engine_samples) {
    // Row j of a slot is sampled as the slot's sampler would be after emitting drafts [0, j):
    // their counts added, one draw each when sampling is stochastic.
    std::size_t total_rows = 0;
    for (const auto& f : feeds) total_rows += f.size();
    std::vector<std::vector<std::pair<std::int32_t, std::int64_t>>> row_counts;
    row_counts.reserve(total_rows);  // the requests' spans point into these
    std::vector<model::RowSample> rows;
    rows.reserve(total_rows);
    // A constrained slot's rows go with the masks its grammar gives after the drafts before each.
    std::vector<std::vector<std::uint64_t>> masks(n);
    for (std::size_t i = 0; i < n; ++i) {
      const VerifySlot& s = slots[i];
      const pd::SamplingParams& params = s.sampler->params();
      const std::size_t words = s.constraint != nullptr ? s.constraint->maskWords() : 0;
      if (s.constraint != nullptr) masks[i] = s.constraint->rowMasks(s.drafts);
      const std::vector<std::pair<std::int32_t, std::int64_t>> base = s.sampler->counts();
      std::map<std::int32_t, std::int64_t> counts(base.begin(), base.end());
      for (std::size_t j = 0; j < feeds[i].size(); ++j) {
        if (j > 0) ++counts[s.drafts[j - 1]];
        row_counts.emplace_back(counts.begin(), counts.end());
        const std::uint64_t draw = params.temperature != 0.0 ? s.sampler->draws() + j : 0;
        const std::span<const std::uint64_t> allowed =
            s.constraint != nullptr ? std::span<const std::uint64_t>(masks[i]).subspan(j * words, words)
                                    : std::span<const std::uint64_t>{};
        rows.push_back(model::RowSample{&params, draw, row_counts.back(), allowed});
      }
    }
    PD_ASSIGN_OR_RETURN(model::SampledForward r, sampling_engine_->forwardSampled(chunks, pool_.view(), fo, rows));
    if (r.sampled.size() != total_rows) {
      return makeError(ErrorCode::Internal,
                       fmt::format("verify: the engine sampled {} of {} rows", r.sampled.size(), total_rows));
    }
    out = std::move(r.output);
    sampled = std::move(r.sampled);
  } else {
    PD_ASSIGN_OR_RETURN(out, engine_.forward(chunks, pool_.view(), fo));
  }

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
      if (engine_samples) {
        const model::SampledToken& t = sampled[row + j];
        s.sampler->resumeAfter(std::span<const std::int32_t>(&t.token, 1));  // its counts and its draw
        v.tokens.push_back(t);
        ++engine_sampled_tokens_;
        if (s.constraint != nullptr) {
          PD_CHECK(s.constraint->accept(t.token).ok());  // sampled under the row's mask
          if (s.constraint->terminated()) break;         // nothing may follow the stop token
        }
      } else if (s.constraint != nullptr) {
        const std::span<const float> logits(out.logits.data() + (row + j) * vocab, vocab);
        const std::span<const std::uint64_t> mask = s.constraint->mask();
        const auto t0 = std::chrono::steady_clock::now();
        v.tokens.push_back(s.sampler->sample(logits, mask));
        sample_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        PD_CHECK(s.constraint->accept(v.tokens.back().token).ok());  // sampled under the mask
        if (s.constraint->terminated()) break;                       // nothing may follow the stop token
      } else {
        const std::span<const float> logits(out.logits.data() + (row + j) * vocab, vocab);
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
