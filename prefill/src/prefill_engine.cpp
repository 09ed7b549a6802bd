#include "pd/prefill/prefill_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <optional>
#include <utility>

#include "pd/common/choices.h"
#include "pd/common/kv_format.h"

namespace pd::prefill {

struct PrefillEngine::Running {
  PrefillRequest request;
  std::vector<std::int32_t> blocks;
  std::int64_t next_pos = 0;       // prompt positions [0, next_pos) are in the local cache
  std::vector<float> hidden;       // [next_pos - cached_tokens, hidden_size] final hidden states (the MTP input)
  std::vector<float> last_logits;  // the last prompt position's logits
  std::int32_t first_token = -1;   // the first sampled token (choice 0), once the prompt is done
  std::optional<Error> error;      // first put error
  std::vector<std::uint64_t> cached_keys;  // prefix-cache entries it references: blocks[0, size)
  std::int64_t cached_tokens = 0;          // prompt positions whose KV came from the prefix cache
  bool finished = false;

  [[nodiscard]] std::int64_t size() const { return static_cast<std::int64_t>(request.tokens.size()); }
};

namespace {

// Routes each layer of a forward to the KvSink of the batch row's request. A row whose request
// errs, is cancelled or passes its deadline gets no further layers; the step then fails it.
class BatchSink final : public model::LatentKvSink {
 public:
  using StopFn = std::function<std::optional<Error>(std::size_t row)>;
  BatchSink(std::vector<KvSink*> sinks, std::vector<std::optional<Error>*> errors, StopFn stop)
      : sinks_(std::move(sinks)), errors_(std::move(errors)), stop_(std::move(stop)) {}

  void onLayer(std::int64_t kv_layer, std::size_t sequence, std::int64_t start_pos,
               std::span<const float> latent) override {
    std::optional<Error>& error = *errors_[sequence];
    if (error) return;
    error = stop_(sequence);
    if (error) return;
    Status s = sinks_[sequence]->putLayer(static_cast<std::uint32_t>(kv_layer), start_pos, latent);
    if (!s.ok()) error = std::move(s).error();
  }

 private:
  std::vector<KvSink*> sinks_;
  std::vector<std::optional<Error>*> errors_;
  StopFn stop_;
};

std::int64_t ceilDiv(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace

PrefillEngineOptions engineOptions(const PrefillConfig& config) {
  PrefillEngineOptions o;
  o.chunk_size = config.chunk_size;
  o.token_budget = config.token_budget;
  o.max_queued_requests = config.max_queued_requests;
  o.cache_blocks = config.cache_blocks;
  o.block_size = config.cache_block_size;
  o.cache_dtype = parseKvDType(config.kv_dtype).value_or(DType::F32);
  o.prefix_cache_blocks = std::min(config.prefix_cache_blocks, config.cache_blocks);
  return o;
}

Result<std::unique_ptr<PrefillEngine>> PrefillEngine::create(model::Engine& engine, PrefillEngineOptions options) {
  if (options.chunk_size <= 0 || options.token_budget <= 0 || options.max_queued_requests <= 0 ||
      options.cache_blocks <= 0 || options.block_size <= 0 || !options.now || options.prefix_cache_blocks < 0 ||
      options.prefix_cache_blocks > options.cache_blocks) {
    return makeError(ErrorCode::InvalidArgument,
                     "prefill engine: chunk_size, token_budget, max_queued_requests, cache_blocks and block_size "
                     "must be positive, prefix_cache_blocks within [0, cache_blocks] and a clock given");
  }
  // In the memory the engine reads best: GPU memory for the CUDA engine (the step's own cache, no
  // host mirror), host memory otherwise; a tensor-parallel leader passes the call to its own shard.
  PD_ASSIGN_OR_RETURN(std::unique_ptr<model::CacheMemory> cache,
                      engine.allocateCache(options.cache_blocks, options.block_size, options.cache_dtype));
  return std::unique_ptr<PrefillEngine>(new PrefillEngine(engine, std::move(options), std::move(cache)));
}

PrefillEngine::PrefillEngine(model::Engine& engine, PrefillEngineOptions options,
                             std::unique_ptr<model::CacheMemory> cache)
    : engine_(engine), options_(std::move(options)), cache_(std::move(cache)) {
  for (std::int64_t b = options_.cache_blocks - 1; b >= 0; --b) free_blocks_.push_back(static_cast<std::int32_t>(b));
  stats_.free_blocks = options_.cache_blocks;
  reuse_granule_ = std::lcm(options_.block_size, std::min(options_.chunk_size, options_.token_budget));
  if (options_.prefix_cache_blocks > 0)
    prefix_.emplace(options_.prefix_cache_blocks, options_.block_size, options_.model_hash, options_.kv_events);
}

PrefillEngine::~PrefillEngine() {
  stop();
  const Error cancelled = makeError(ErrorCode::Cancelled, "prefill engine shut down");
  for (auto& r : running_) failRunning(*r, cancelled);
  running_.clear();
  std::deque<PrefillRequest> queued;
  {
    std::lock_guard lock(mutex_);
    queued.swap(queue_);
    held_ids_.clear();
    stats_.queued_requests = 0;
    stats_.queued_tokens = 0;
  }
  for (PrefillRequest& q : queued) q.sink->fail(cancelled);
}

Status PrefillEngine::submit(PrefillRequest request) {
  const ModelConfig& cfg = engine_.config();
  const auto n = static_cast<std::int64_t>(request.tokens.size());
  if (request.sink == nullptr) return makeError(ErrorCode::InvalidArgument, "prefill request without a KV sink");
  if (n == 0) return makeError(ErrorCode::InvalidArgument, "prefill request with an empty prompt");
  if (cfg.max_position_embeddings > 0 && n > cfg.max_position_embeddings) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("prompt of {} tokens exceeds max_position_embeddings {}",
                                                             n, cfg.max_position_embeddings));
  }
  for (const std::int32_t t : request.tokens) {
    if (t < 0 || t >= cfg.vocab_size) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("token id {} outside the vocabulary", t));
    }
  }
  PD_TRY(pd::validate(request.sampling));
  if (request.forced_first_token >= cfg.vocab_size) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("forced first token {} outside the vocabulary", request.forced_first_token));
  }
  if (request.choices < 1 || request.choices > pd::kMaxChoices ||
      (request.choices > 1 && request.forced_first_token >= 0)) {
    return makeError(
        ErrorCode::InvalidArgument,
        fmt::format("choices {} must be in [1, {}] (1 with a forced first token)", request.choices, pd::kMaxChoices));
  }
  if (ceilDiv(n, options_.block_size) > options_.cache_blocks) {
    return makeError(ErrorCode::ResourceExhausted,
                     fmt::format("prompt of {} tokens exceeds the prefill cache ({} blocks of {})", n,
                                 options_.cache_blocks, options_.block_size));
  }
  {
    std::lock_guard lock(mutex_);
    if (static_cast<std::int64_t>(queue_.size()) >= options_.max_queued_requests) {
      return makeError(ErrorCode::Overloaded, fmt::format("prefill queue full ({} requests)", queue_.size()));
    }
    if (!held_ids_.insert(request.id).second) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("request {} is already in the prefill engine", request.id));
    }
    stats_.queued_requests += 1;
    stats_.queued_tokens += n;
    queue_.push_back(std::move(request));
  }
  wake_.notify_one();
  return okStatus();
}

bool PrefillEngine::cancel(std::uint64_t id) {
  {
    std::lock_guard lock(mutex_);
    if (!held_ids_.contains(id)) return false;
    cancels_.insert(id);
  }
  wake_.notify_one();
  return true;
}

PrefillEngineStats PrefillEngine::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void PrefillEngine::release(Running& r, bool completed) {
  const auto shared = static_cast<std::ptrdiff_t>(r.cached_keys.size());
  const std::span<const std::int32_t> own(r.blocks.begin() + shared, r.blocks.end());
  if (!prefix_) {
    free_blocks_.insert(free_blocks_.end(), own.begin(), own.end());
  } else {
    std::vector<std::int32_t> back(own.begin(), own.end());
    if (completed) {
      // Every layer of every prompt position is in the blocks, the MTP layer's last position
      // computed with the first sampled token: offer the full blocks with their next tokens.
      std::vector<std::int32_t> followed(r.request.tokens);
      followed.push_back(r.first_token);
      back = prefix_->insert(followed, shared, own);
    }
    prefix_->release(r.cached_keys);
    free_blocks_.insert(free_blocks_.end(), back.begin(), back.end());
  }
  r.blocks.clear();
  r.cached_keys.clear();
  r.finished = true;
  {
    std::lock_guard lock(mutex_);
    held_ids_.erase(r.request.id);
    cancels_.erase(r.request.id);  // a late cancel must not hit a later request with this id
    stats_.running_requests -= 1;
  }
  updateCacheStats();
}

void PrefillEngine::updateCacheStats() {
  const PrefixCacheStats c = prefix_ ? prefix_->stats() : PrefixCacheStats{};
  std::lock_guard lock(mutex_);
  stats_.free_blocks = static_cast<std::int64_t>(free_blocks_.size()) + c.idle_blocks;
  stats_.prefix_cached_blocks = c.cached_blocks;
  stats_.prefix_evictions = c.evictions;
}

bool PrefillEngine::shipCachedPrefix(Running& r) {
  if (r.cached_tokens == 0) return true;
  r.request.sink->prefixCached(r.cached_tokens);
  const std::int64_t dim = engine_.config().latentDim();
  std::vector<float> rows(static_cast<std::size_t>(r.cached_tokens * dim));
  // Main layers and the MTP layer alike: a cached block matched its next token, so its MTP
  // latents are this prompt's too (prefix_cache.h).
  const auto layers = static_cast<std::int64_t>(cache_->view().layers.size());
  for (std::int64_t layer = 0; layer < layers; ++layer) {
    // Through the cache's memory: a copy from the device for a GPU cache.
    if (Status s = cache_->readLatents(layer, r.blocks, r.cached_tokens, rows.data()); !s.ok()) {
      failRunning(r, s.error());
      return false;
    }
    if (Status s = r.request.sink->putLayer(static_cast<std::uint32_t>(layer), 0, rows); !s.ok()) {
      failRunning(r, s.error());
      return false;
    }
  }
  return true;
}

void PrefillEngine::failRunning(Running& r, const Error& reason) {
  if (r.finished) return;
  r.request.sink->fail(reason);
  release(r);
  std::lock_guard lock(mutex_);
  stats_.failed += 1;
}

std::optional<Error> PrefillEngine::stopReason(const Running& r) const {
  if (r.request.deadline <= options_.now()) {
    return makeError(ErrorCode::Timeout, fmt::format("request {} passed its deadline", r.request.id));
  }
  std::lock_guard lock(mutex_);
  if (cancels_.contains(r.request.id)) {
    return makeError(ErrorCode::Cancelled, fmt::format("request {} cancelled", r.request.id));
  }
  return std::nullopt;
}

bool PrefillEngine::step() {
  const Clock::time_point now = options_.now();
  std::vector<std::pair<PrefillRequest, Error>> dropped;  // queued requests that end before running
  std::unordered_set<std::uint64_t> cancels;
  {
    std::lock_guard lock(mutex_);
    cancels.swap(cancels_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      std::optional<Error> why;
      if (cancels.contains(it->id)) {
        why = makeError(ErrorCode::Cancelled, fmt::format("request {} cancelled", it->id));
      } else if (it->deadline <= now) {
        why = makeError(ErrorCode::Timeout, fmt::format("request {} passed its deadline while queued", it->id));
      }
      if (!why) {
        ++it;
        continue;
      }
      held_ids_.erase(it->id);
      stats_.queued_requests -= 1;
      stats_.queued_tokens -= static_cast<std::int64_t>(it->tokens.size());
      stats_.failed += 1;
      dropped.emplace_back(std::move(*it), std::move(*why));
      it = queue_.erase(it);
    }
  }
  bool worked = !dropped.empty();
  for (auto& [request, why] : dropped) request.sink->fail(why);

  for (auto& r : running_) {
    if (cancels.contains(r->request.id)) {
      worked = true;
      failRunning(*r, makeError(ErrorCode::Cancelled, fmt::format("request {} cancelled", r->request.id)));
    } else if (r->request.deadline <= now) {
      worked = true;
      failRunning(*r, makeError(ErrorCode::Timeout, fmt::format("request {} passed its deadline", r->request.id)));
    }
  }

  // Admit in arrival order while the local cache has room; a prompt that cannot fit waits.
  const std::size_t first_admitted = running_.size();
  {
    std::lock_guard lock(mutex_);
    while (!queue_.empty()) {
      const auto n = static_cast<std::int64_t>(queue_.front().tokens.size());
      // Cached full blocks of the prompt, short of its last token (whose logits we need), in whole
      // reuse granules: the suffix's chunks then start where a cold prefill's do, so the results
      // are bit-equal to it (the engine's GEMM and MoE paths depend on the rows of a chunk).
      std::vector<PrefixCache::Hit> hits;
      if (prefix_) {
        const std::int64_t per = reuse_granule_ / options_.block_size;
        hits = prefix_->acquire(queue_.front().tokens, (n - 1) / reuse_granule_ * per);
        const auto keep = static_cast<std::size_t>(static_cast<std::int64_t>(hits.size()) / per * per);
        std::vector<std::uint64_t> extra;
        for (std::size_t i = keep; i < hits.size(); ++i) extra.push_back(hits[i].entry);
        prefix_->release(extra);
        hits.resize(keep);
      }
      const std::int64_t need = ceilDiv(n, options_.block_size) - static_cast<std::int64_t>(hits.size());
      if (prefix_ && need > static_cast<std::int64_t>(free_blocks_.size())) {
        for (const std::int32_t b : prefix_->evict(need - static_cast<std::int64_t>(free_blocks_.size()))) {
          free_blocks_.push_back(b);
        }
      }
      if (need > static_cast<std::int64_t>(free_blocks_.size())) {
        std::vector<std::uint64_t> keys;
        keys.reserve(hits.size());
        for (const auto& h : hits) keys.push_back(h.entry);
        if (prefix_) prefix_->release(keys);
        break;
      }
      auto r = std::make_unique<Running>();
      r->request = std::move(queue_.front());
      queue_.pop_front();
      for (const auto& h : hits) {
        r->blocks.push_back(h.block);
        r->cached_keys.push_back(h.entry);
      }
      r->cached_tokens = static_cast<std::int64_t>(hits.size()) * options_.block_size;
      r->next_pos = r->cached_tokens;
      if (engine_.config().num_nextn_predict_layers == 0) r->hidden.clear();
      if (prefix_) {
        stats_.prefix_hit_tokens += r->cached_tokens;
        stats_.prefix_miss_tokens += n - r->cached_tokens;
      }
      for (std::int64_t i = 0; i < need; ++i) {
        r->blocks.push_back(free_blocks_.back());
        free_blocks_.pop_back();
      }
      stats_.queued_requests -= 1;
      stats_.queued_tokens -= r->size();
      stats_.running_requests += 1;
      running_.push_back(std::move(r));
    }
  }
  updateCacheStats();
  for (std::size_t i = first_admitted; i < running_.size(); ++i) {
    running_[i]->request.sink->admitted();
    if (shipCachedPrefix(*running_[i])) continue;
    worked = true;
  }

  // One forward over up to token_budget new tokens, at most chunk_size per request.
  std::vector<Running*> rows;
  std::vector<model::SequenceChunk> batch;
  std::vector<std::int64_t> takes;
  std::int64_t budget = options_.token_budget;
  bool ends_a_prompt = false;
  for (auto& r : running_) {
    if (r->finished || budget == 0) continue;
    const std::int64_t take = std::min({options_.chunk_size, r->size() - r->next_pos, budget});
    budget -= take;
    ends_a_prompt = ends_a_prompt || r->next_pos + take == r->size();
    rows.push_back(r.get());
    takes.push_back(take);
    batch.push_back(
        model::SequenceChunk{std::span<const std::int32_t>(r->request.tokens)
                                 .subspan(static_cast<std::size_t>(r->next_pos), static_cast<std::size_t>(take)),
                             r->next_pos, r->blocks});
  }
  if (!batch.empty()) {
    worked = true;
    std::vector<KvSink*> sinks;
    std::vector<std::optional<Error>*> errors;
    for (Running* r : rows) {
      sinks.push_back(r->request.sink.get());
      errors.push_back(&r->error);
    }
    BatchSink sink(std::move(sinks), std::move(errors), [&](std::size_t row) { return stopReason(*rows[row]); });
    model::ForwardOptions fo;
    // Logits only when a prompt ends here: the vocabulary projection is the costliest row.
    fo.logits = ends_a_prompt ? model::OutputRows::Last : model::OutputRows::None;
    fo.hidden = model::OutputRows::All;
    fo.sink = &sink;
    const auto t0 = Clock::now();
    Result<model::ForwardOutput> out = engine_.forward(batch, cache_->view(), fo);
    const auto t1 = Clock::now();
    for (std::size_t i = 0; i < rows.size(); ++i) {
      rows[i]->request.sink->forwardTimed(batch[i].start_pos, takes[i], false, t0, t1);
    }
    {
      std::lock_guard lock(mutex_);
      stats_.compute_seconds += std::chrono::duration<double>(t1 - t0).count();
      if (out.ok()) stats_.prompt_tokens += options_.token_budget - budget;
    }
    if (!out.ok()) {
      for (Running* r : rows) failRunning(*r, out.error());
    } else {
      const auto hidden_size = static_cast<std::size_t>(engine_.config().hidden_size);
      const auto vocab = static_cast<std::size_t>(engine_.config().vocab_size);
      std::size_t hidden_row = 0;
      std::vector<Running*> done;
      for (std::size_t i = 0; i < rows.size(); ++i) {
        Running& r = *rows[i];
        const auto take = static_cast<std::size_t>(takes[i]);
        r.hidden.insert(r.hidden.end(), out->hidden.begin() + static_cast<std::ptrdiff_t>(hidden_row * hidden_size),
                        out->hidden.begin() + static_cast<std::ptrdiff_t>((hidden_row + take) * hidden_size));
        hidden_row += take;
        r.next_pos += takes[i];
        if (r.error) {
          failRunning(r, *r.error);
        } else if (r.next_pos == r.size()) {
          r.last_logits.assign(out->logits.begin() + static_cast<std::ptrdiff_t>(i * vocab),
                               out->logits.begin() + static_cast<std::ptrdiff_t>((i + 1) * vocab));
          done.push_back(&r);
        }
      }
      if (!done.empty()) finishPrompt(done);
    }
  }
  std::erase_if(running_, [](const std::unique_ptr<Running>& r) { return r->finished; });
  return worked;
}

void PrefillEngine::finishPrompt(std::vector<Running*>& done) {
  const ModelConfig& cfg = engine_.config();
  std::vector<model::SampledToken> first;
  std::vector<std::vector<pd::SampledToken>> choice_first(done.size());  // choices 1..n-1
  for (std::size_t d = 0; d < done.size(); ++d) {
    Running* r = done[d];
    const auto resumed = static_cast<std::size_t>(
        std::clamp<std::int64_t>(r->request.resumed_tokens, 0, static_cast<std::int64_t>(r->request.tokens.size())));
    const auto resumed_ids = std::span(r->request.tokens).last(resumed);
    std::vector<structured::MaskWord> allowed;  // empty: free text
    if (r->request.grammar && r->request.forced_first_token < 0) {
      // The first token is sampled under the constraint like every later one (decode checks it);
      // a resumed generation's grammar continues after the output it already produced.
      allowed.resize(r->request.grammar->vocabulary().maskWords());
      structured::Matcher matcher(r->request.grammar);
      for (pd::TokenId t : resumed_ids) {
        if (!matcher.accept(t).ok()) break;
      }
      matcher.fillMask(allowed);
    }
    // Every choice draws from the same logits with its own stream: choice 0 with the request's
    // seed (the n = 1 answer), choice i with pd::choiceSeed(seed, i).
    for (std::int64_t c = 0; c < std::max<std::int64_t>(1, r->request.choices); ++c) {
      pd::SamplingParams params = r->request.sampling;
      params.seed = pd::choiceSeed(params.seed, c);
      model::Sampler sampler(params, r->request.logprobs);
      sampler.resumeAfter(resumed_ids);
      model::SampledToken t = sampler.sample(r->last_logits, allowed);
      if (c == 0) {
        first.push_back(std::move(t));
        if (r->request.forced_first_token >= 0) first.back().token = r->request.forced_first_token;
      } else {
        if (!r->request.logprobs) t = model::SampledToken{t.token, 0.0F, {}};
        choice_first[d].push_back(std::move(t));
      }
    }
  }
  // The MTP pass: row p pairs token p+1 (the first sampled token for the last row) with final
  // hidden state p, over the positions the main pass computed; a cached prefix's MTP latents
  // were cached with the same next tokens (prefix_cache.h). It runs in chunks on the main pass's
  // grid (multiples of min(chunk_size, token_budget) from position 0, the cached prefix a whole
  // number of them), so that a prompt's MTP layer is bit-equal with and without a cached prefix.
  // Every row it writes lies in the request's own blocks, never in a shared one.
  const std::int64_t step = std::min(options_.chunk_size, options_.token_budget);
  std::vector<std::vector<std::int32_t>> next_tokens(done.size());
  std::vector<std::int64_t> mtp_pos(done.size());
  for (std::size_t i = 0; i < done.size(); ++i) {
    Running& r = *done[i];
    r.first_token = first[i].token;
    next_tokens[i].assign(r.request.tokens.begin() + 1, r.request.tokens.end());
    next_tokens[i].push_back(first[i].token);
    mtp_pos[i] = r.cached_tokens;
  }
  const auto hidden_size = static_cast<std::size_t>(cfg.hidden_size);
  for (bool more = cfg.num_nextn_predict_layers > 0; more;) {
    more = false;
    std::vector<model::SequenceChunk> batch;
    std::vector<KvSink*> sinks;
    std::vector<std::optional<Error>*> errors;
    std::vector<Running*> rows;
    std::vector<std::int64_t> takes;
    for (std::size_t i = 0; i < done.size(); ++i) {
      Running& r = *done[i];
      if (r.finished || r.error || mtp_pos[i] == r.size()) continue;
      const std::int64_t from = mtp_pos[i];
      const std::int64_t take = std::min(step - from % step, r.size() - from);
      const auto offset = static_cast<std::size_t>(from - r.cached_tokens);
      model::SequenceChunk c{std::span<const std::int32_t>(next_tokens[i])
                                 .subspan(static_cast<std::size_t>(from), static_cast<std::size_t>(take)),
                             from, r.blocks};
      c.prev_hidden =
          std::span<const float>(r.hidden).subspan(offset * hidden_size, static_cast<std::size_t>(take) * hidden_size);
      batch.push_back(c);
      sinks.push_back(r.request.sink.get());
      errors.push_back(&r.error);
      rows.push_back(&r);
      takes.push_back(take);
      mtp_pos[i] = from + take;
      more = more || mtp_pos[i] < r.size();
    }
    if (batch.empty()) break;
    BatchSink sink(std::move(sinks), std::move(errors), [&](std::size_t row) { return stopReason(*rows[row]); });
    model::ForwardOptions fo;
    fo.logits = model::OutputRows::None;
    fo.hidden = model::OutputRows::None;
    fo.sink = &sink;
    const auto t0 = Clock::now();
    Result<model::ForwardOutput> out = engine_.forwardMtp(batch, cache_->view(), fo);
    const auto t1 = Clock::now();
    for (std::size_t k = 0; k < rows.size(); ++k) {
      rows[k]->request.sink->forwardTimed(batch[k].start_pos, takes[k], true, t0, t1);
    }
    {
      std::lock_guard lock(mutex_);
      stats_.compute_seconds += std::chrono::duration<double>(t1 - t0).count();
    }
    if (!out.ok()) {
      for (Running* r : rows) failRunning(*r, out.error());
    }
  }
  for (std::size_t i = 0; i < done.size(); ++i) {
    Running& r = *done[i];
    if (r.finished) continue;  // its MTP forward failed
    if (r.error) {
      failRunning(r, *r.error);
      continue;
    }
    kvtransfer::CompletionRecord record;
    record.num_tokens = static_cast<std::uint32_t>(r.size());
    record.first_token = first[i].token;
    record.hidden_state.assign(r.hidden.end() - static_cast<std::ptrdiff_t>(hidden_size), r.hidden.end());
    if (r.request.logprobs) {
      record.first_logprob = pd::TokenLogprob{first[i].token, first[i].logprob};
      record.top_logprobs = first[i].top;
    }
    record.choice_tokens = std::move(choice_first[i]);
    r.request.sink->complete(std::move(record));
    release(r, true);
    std::lock_guard lock(mutex_);
    stats_.completed += 1;
  }
}

void PrefillEngine::loop() {
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      // Wakes for work, and at least every few ms so that queued deadlines fire on time.
      wake_.wait_for(lock, std::chrono::milliseconds(5),
                     [&] { return stopping_ || !queue_.empty() || !cancels_.empty() || !running_.empty(); });
      if (stopping_) return;
    }
    (void)step();
  }
}

void PrefillEngine::start() {
  PD_CHECK_MSG(!thread_.joinable(), "PrefillEngine::start() called twice");
  thread_ = std::thread([this] { loop(); });
}

void PrefillEngine::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

}  // namespace pd::prefill
