#include "pd/engine/generate.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <utility>
#include <vector>

#include "pd/engine/cache_residency.h"
#include "pd/engine/device_sampling.h"

namespace pd::model {

Result<GenerateResult> generate(Engine& engine, std::span<const std::int32_t> prompt, const GenerateOptions& o) {
  const ModelConfig& cfg = engine.config();
  const auto n_prompt = static_cast<std::int64_t>(prompt.size());
  if (n_prompt == 0) return makeError(ErrorCode::InvalidArgument, "generate: empty prompt");
  if (o.max_tokens < 1) return makeError(ErrorCode::InvalidArgument, "generate: max_tokens must be >= 1");
  if (o.mtp_drafts < 0 || o.block_size < 1 || o.prefill_chunk < 0) {
    return makeError(ErrorCode::InvalidArgument, "generate: mtp_drafts, block_size and prefill_chunk must be >= 0");
  }
  PD_TRY(validate(o.sampling));
  if (o.mtp_drafts > 0 && !engine.capabilities().mtp) {
    return makeError(ErrorCode::Unsupported, "generate: the checkpoint has no MTP layer to draft with");
  }
  const std::int64_t max_pos =
      cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : n_prompt + o.max_tokens + o.mtp_drafts + 1;
  if (n_prompt + o.max_tokens - 1 > max_pos) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("generate: prompt ({}) + max_tokens ({}) exceeds max_position_embeddings ({})",
                                 n_prompt, o.max_tokens, max_pos));
  }
  const std::int64_t capacity = n_prompt + o.max_tokens + o.mtp_drafts + 1;
  const std::int64_t blocks = (capacity + o.block_size - 1) / o.block_size;
  PD_ASSIGN_OR_RETURN(PagedLatentCache cache, PagedLatentCache::create(cfg, blocks, o.block_size, o.cache_dtype));
  std::vector<std::int32_t> table(static_cast<std::size_t>(blocks));
  std::iota(table.begin(), table.end(), 0);
  // Only the engine writes this cache, so its blocks keep their first epochs: an engine that keeps
  // a copy of the cache (the CUDA engine, CacheResidency) copies each position at most once.
  std::vector<std::uint64_t> epochs(static_cast<std::size_t>(blocks));
  for (auto& e : epochs) e = nextCacheEpoch();
  LatentCacheView view = cache.view();
  view.block_epochs = epochs;

  const bool mtp = o.mtp_drafts > 0;
  const std::int64_t d = cfg.hidden_size;
  Sampler sampler(o.sampling);
  std::vector<std::int32_t> seq(prompt.begin(), prompt.end());
  std::vector<float> hidden;  // main-model final hidden state of positions [0, seq.size() - 1)
  GenerateResult result;

  // Device sampling: the rows carry what the host Sampler keeps (its draw counter and the
  // counts of the tokens produced), so the engine's tokens are the Sampler's.
  SamplingEngine* const device =
      o.device_sampling && deviceSamplable(o.sampling) ? dynamic_cast<SamplingEngine*>(&engine) : nullptr;
  std::map<std::int32_t, std::int64_t> produced;
  std::uint64_t draws = 0;
  const bool stochastic = o.sampling.temperature > 0.0;
  // Requests for `n` rows where row j follows the tokens `ahead[0, j)` (MTP drafts it verifies).
  std::vector<std::vector<std::pair<std::int32_t, std::int64_t>>> row_counts;
  const auto row_samples = [&](std::size_t n, std::span<const std::int32_t> ahead) {
    std::vector<RowSample> rows(n);
    row_counts.assign(n, {});
    std::map<std::int32_t, std::int64_t> counts = produced;
    for (std::size_t j = 0; j < n; ++j) {
      if (j > 0) ++counts[ahead[j - 1]];
      row_counts[j].assign(counts.begin(), counts.end());
      rows[j].params = &o.sampling;
      rows[j].draw = stochastic ? draws + j : 0;
      rows[j].counts = row_counts[j];
    }
    return rows;
  };

  const auto emit_token = [&](SampledToken t) {
    if (device != nullptr) {
      ++produced[t.token];
      if (stochastic) ++draws;
    }
    seq.push_back(t.token);
    result.tokens.push_back(t.token);
    result.samples.push_back(std::move(t));
    const bool eos = o.stop_at_eos && result.tokens.back() == cfg.eos_token_id;
    return eos || static_cast<std::int64_t>(result.tokens.size()) >= o.max_tokens;
  };
  const auto emit = [&](std::span<const float> logits) { return emit_token(sampler.sample(logits)); };
  std::vector<SampledToken> sampled;  // the device's tokens of the last call, one per logits row
  // engine.forward, or the device's sampled forward when sampling there.
  const auto forward = [&](const SequenceChunk& sc, const ForwardOptions& fo,
                           std::span<const std::int32_t> ahead) -> Result<ForwardOutput> {
    if (device == nullptr || fo.logits == OutputRows::None) {
      return engine.forward(std::span<const SequenceChunk>(&sc, 1), view, fo);
    }
    const std::size_t n = fo.logits == OutputRows::All ? sc.tokens.size() : 1;
    const std::vector<RowSample> rows = row_samples(n, ahead);
    PD_ASSIGN_OR_RETURN(SampledForward r,
                        device->forwardSampled(std::span<const SequenceChunk>(&sc, 1), view, fo, rows));
    sampled = std::move(r.sampled);
    return std::move(r.output);
  };

  // Prefill.
  const std::int64_t chunk = o.prefill_chunk > 0 ? o.prefill_chunk : n_prompt;
  ForwardOutput out;
  for (std::int64_t c0 = 0; c0 < n_prompt; c0 += chunk) {
    const std::int64_t c1 = std::min(n_prompt, c0 + chunk);
    const SequenceChunk sc{std::span<const std::int32_t>(seq.data() + c0, static_cast<std::size_t>(c1 - c0)), c0,
                           table};
    ForwardOptions fo;
    fo.logits = c1 == n_prompt ? OutputRows::Last : OutputRows::None;
    fo.hidden = mtp ? OutputRows::All : OutputRows::None;
    PD_ASSIGN_OR_RETURN(out, forward(sc, fo, {}));
    hidden.insert(hidden.end(), out.hidden.begin(), out.hidden.end());
  }
  if (device != nullptr ? emit_token(sampled.at(0)) : emit(out.logits)) return result;

  std::int64_t mtp_done = 0;  // MTP positions computed from true (token, hidden) pairs
  std::vector<std::int32_t> drafts;
  for (;;) {
    const auto len = static_cast<std::int64_t>(seq.size());
    const std::int64_t start = len - 1;  // position of the last token, not yet fed
    const std::int64_t remaining = o.max_tokens - static_cast<std::int64_t>(result.tokens.size());
    const std::int64_t k = std::max<std::int64_t>(0, std::min({o.mtp_drafts, remaining - 1, max_pos - 1 - start}));
    drafts.clear();
    if (k > 0) {
      // MTP over the positions whose inputs are now known; its last row drafts seq[len].
      const SequenceChunk sc{
          std::span<const std::int32_t>(seq.data() + mtp_done + 1, static_cast<std::size_t>(start - mtp_done)),
          mtp_done, table,
          std::span<const float>(hidden.data() + mtp_done * d, static_cast<std::size_t>((start - mtp_done) * d))};
      ForwardOptions fo;
      fo.logits = OutputRows::Last;
      fo.hidden = OutputRows::Last;
      PD_ASSIGN_OR_RETURN(ForwardOutput m, engine.forwardMtp(std::span<const SequenceChunk>(&sc, 1), view, fo));
      mtp_done = start;
      drafts.push_back(argmax(m.logits));
      // Further drafts chain the MTP layer on its own output.
      for (std::int64_t j = 1; j < k; ++j) {
        const std::vector<float> prev = m.hidden;
        const SequenceChunk chained{std::span<const std::int32_t>(&drafts.back(), 1), start + j - 1, table, prev};
        PD_ASSIGN_OR_RETURN(m, engine.forwardMtp(std::span<const SequenceChunk>(&chained, 1), view, fo));
        drafts.push_back(argmax(m.logits));
      }
      result.drafts_proposed += static_cast<std::int64_t>(drafts.size());
    }
    std::vector<std::int32_t> feed{seq.back()};
    feed.insert(feed.end(), drafts.begin(), drafts.end());
    const SequenceChunk sc{feed, start, table};
    ForwardOptions fo;
    fo.attention = AttentionPath::Absorbed;
    fo.logits = OutputRows::All;
    fo.hidden = mtp ? OutputRows::All : OutputRows::None;
    PD_ASSIGN_OR_RETURN(out, forward(sc, fo, drafts));
    ++result.decode_steps;
    const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
    for (std::size_t j = 0; j < feed.size(); ++j) {
      if (mtp)
        hidden.insert(hidden.end(), out.hidden.begin() + static_cast<std::ptrdiff_t>(j * static_cast<std::size_t>(d)),
                      out.hidden.begin() + static_cast<std::ptrdiff_t>((j + 1) * static_cast<std::size_t>(d)));
      const bool done = device != nullptr ? emit_token(sampled.at(j))
                                          : emit(std::span<const float>(out.logits.data() + j * vocab, vocab));
      if (done) return result;
      if (j >= drafts.size() || seq.back() != drafts[j]) break;
      ++result.drafts_accepted;
    }
  }
}

}  // namespace pd::model
