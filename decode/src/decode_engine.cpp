#include "pd/decode/decode_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <numeric>
#include <unordered_set>
#include <utility>

#include "draft_verifier.h"
#include "pd/common/log.h"
#include "pd/engine/latent_cache.h"

namespace pd::decode {

namespace {

// A local prefill's layers, computed in a float32 scratch cache as a prefill worker computes them
// in its own, written into the request's pool blocks as its transfer would land them.
class PoolWriter final : public model::LatentKvSink {
 public:
  PoolWriter(KvPool& pool, std::span<const std::int32_t> blocks) : pool_(pool), blocks_(blocks) {}
  void onLayer(std::int64_t kv_layer, std::size_t /*sequence*/, std::int64_t start_pos,
               std::span<const float> latent) override {
    if (status_.ok()) status_ = pool_.writeLatents(kv_layer, blocks_, start_pos, latent);
  }
  /// The first failed write into a device pool, if any.
  [[nodiscard]] const Status& status() const { return status_; }

 private:
  KvPool& pool_;
  std::span<const std::int32_t> blocks_;
  Status status_ = okStatus();
};

}  // namespace

DecodeEngineOptions engineOptions(const DecodeConfig& config) {
  DecodeEngineOptions options;
  options.num_speculative_tokens = config.num_speculative_tokens;
  options.max_running_requests = config.max_running_requests;
  options.kv_headroom_blocks = config.kv_headroom_blocks;
  options.local_prefill_chunk_size = config.local_prefill_chunk_size;
  options.local_prefill_token_budget = config.local_prefill_token_budget;
  // With tensor parallelism every rank holds the KV: a choice's block copy would be needed on all.
  options.max_choices = config.tensor_parallel > 1 ? 1 : pd::kMaxChoices;
  // Prefix reuse needs nothing from the followers: every rank's pool holds the same KV at the
  // same block ids (the prefill worker writes every rank's target, and decode steps run on every
  // rank over the same block table; a TP worker refuses local prefills), and the leader's block
  // manager alone decides which blocks stay cached.
  options.prefix_cache_blocks = config.prefix_cache_blocks;
  options.overlap_steps = config.overlap_steps;
  return options;
}

struct DecodeEngine::Sequence {
  enum class State { WaitingKv, LocalPrefill, Ready, Running };

  Sequence(DecodeRequest r, bool spec, std::pair<std::int64_t, std::uint64_t> order)
      : req(std::move(r)),
        sampler(req.sampling, req.logprobs),
        speculate(spec),
        admitted(order),
        constraint(req.grammar ? std::make_unique<ConstraintState>(req.grammar) : nullptr) {
    sampler.resumeAfter(req.resumed_tokens);
    // A resumed generation's output so far is part of its prompt now: the grammar continues
    // after it. A token the grammar refuses leaves the state there; the first token's check
    // then ends the stream.
    if (constraint) {
      for (pd::TokenId t : req.resumed_tokens) {
        if (!constraint->accept(t).ok()) break;
      }
    }
  }

  [[nodiscard]] std::int64_t len() const { return req.prompt_tokens + static_cast<std::int64_t>(generated.size()); }

  DecodeRequest req;
  State state = State::WaitingKv;
  model::Sampler sampler;
  bool speculate;
  // (arrival, admission counter): the latest is preempted first (header comment, "Preemption").
  std::pair<std::int64_t, std::uint64_t> admitted;
  std::int64_t present_tokens = 0;              // leading prompt tokens shared from the prefix cache
  std::vector<std::int32_t> generated;          // tokens after the prompt; the last is not yet in the cache
  MtpState mtp;                                 // the MTP layer's catch-up state (speculating sequences)
  std::unique_ptr<ConstraintState> constraint;  // null: free text
  std::string kv_traceparent;                   // the record's trace context, until the first event
  // Choices attached while the KV is awaited, forked when it arrives (header comment, "Choices").
  struct AttachedChoice {
    std::int64_t choice = 0;
    std::uint64_t id = 0;
    TokenEventSink sink;
  };
  std::vector<AttachedChoice> attached;
};

DecodeEngine::DecodeEngine(model::Engine& engine, KvPool& pool, DecodeEngineOptions options,
                           std::unique_ptr<Drafter> drafter)
    : engine_(engine),
      pool_(pool),
      options_(options),
      blocks_(pool.numBlocks(), pool.blockSize(), std::min(options.kv_headroom_blocks, pool.numBlocks() - 1),
              std::max<std::int64_t>(options.prefix_cache_blocks, 0), options.model_hash),
      drafter_(drafter ? std::move(drafter) : std::make_unique<MtpDrafter>(engine, pool)),
      verifier_(std::make_unique<DraftVerifier>(engine, pool)) {
  PD_CHECK(pool.latentDim() == engine.config().latentDim());
  PD_CHECK(pool.numLayers() == engine.config().kvLayers());
  // This engine owns the pool's allocations, so it keeps the block epochs an engine's copy of
  // the cache relies on (LatentCacheView::block_epochs): a block changes owner only through
  // take() (touched there), KV lands only into such fresh blocks (touched again on arrival and
  // after a local prefill), and copyBlock touches its destination.
  pool_.enableEpochs();
  blocks_.setOnTake([this](std::int32_t b) { pool_.touch(b); });
  PD_CHECK(options_.num_speculative_tokens >= 0 && options_.max_running_requests >= 1 &&
           options_.kv_headroom_blocks >= 0 && options_.local_prefill_chunk_size >= 1 &&
           options_.local_prefill_token_budget >= 1 && options_.max_choices >= 1 && options_.prefix_cache_blocks >= 0);
  publishGauges();
}

// A step between prepareStep and completeStep (decode_engine.h, "Overlap").
struct DecodeEngine::PendingStep {
  Clock::time_point started;
  std::vector<Sequence*> batch;  // oldest admission first
  std::vector<std::int64_t> k;   // drafts per sequence
  // Block tables taken on the owning thread (the block manager is not touched by computeStep).
  std::vector<std::span<const std::int32_t>> tables;
  std::unordered_set<std::uint64_t> ids;  // the batch's requests
  std::vector<std::vector<std::int32_t>> drafts;
  Result<std::vector<Verified>> verified = makeError(ErrorCode::Internal, "the step has not run");
  std::vector<std::uint64_t> deferred_aborts;  // abort() of a batch request while the step ran
};

DecodeEngine::~DecodeEngine() {
  PD_CHECK(pending_ == nullptr);  // a running step completes first (DecodeLoop)
  // Requests still held end as aborted so that every sink hears the end of its stream.
  std::vector<std::uint64_t> ids;
  ids.reserve(requests_.size());
  for (const auto& [id, seq] : requests_) ids.push_back(id);
  for (const std::uint64_t id : ids) abort(id);
  // The pool outlives the engine but its accounting does not: quarantines end here, and their
  // expectations are cancelled (a worker deregisters the pool before freeing it).
  ids.clear();
  for (const auto& [id, q] : quarantine_) ids.push_back(id);
  for (const std::uint64_t id : ids) endQuarantine(id, true);
}

Result<std::vector<std::int32_t>> DecodeEngine::admit(DecodeRequest request) {
  const ModelConfig& cfg = engine_.config();
  if (!request.sink) return makeError(ErrorCode::InvalidArgument, fmt::format("request {}: no sink", request.id));
  if (request.prompt_tokens < 1 || request.max_tokens < 1) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("request {}: prompt_tokens ({}) and max_tokens ({}) must be >= 1", request.id,
                                 request.prompt_tokens, request.max_tokens));
  }
  PD_TRY(pd::validate(request.sampling));
  if (request.grammar && request.ignore_eos) {
    // After its stop token a grammar allows nothing: the sequence must end there.
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("request {}: ignore_eos cannot be combined with a constraint", request.id));
  }
  if (request.prefill_attempts < 1) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("request {}: prefill_attempts ({}) must be >= 1",
                                                             request.id, request.prefill_attempts));
  }
  if (cfg.max_position_embeddings > 0 && request.prompt_tokens + request.max_tokens - 1 > cfg.max_position_embeddings) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("request {}: prompt ({}) + max_tokens ({}) exceeds max_position_embeddings ({})",
                                 request.id, request.prompt_tokens, request.max_tokens, cfg.max_position_embeddings));
  }
  const bool speculate = options_.num_speculative_tokens > 0;
  if (speculate && !engine_.capabilities().mtp) {
    return makeError(ErrorCode::Unsupported, "speculative decoding needs a checkpoint with an MTP layer");
  }
  if (static_cast<std::int64_t>(request.resumed_tokens.size()) >= request.prompt_tokens) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("request {}: {} resumed tokens in a {}-token prompt", request.id,
                                 request.resumed_tokens.size(), request.prompt_tokens));
  }
  if (request.choices < 1 || request.choices > pd::kMaxChoices ||
      (request.choices > 1 && !request.resumed_tokens.empty())) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("request {}: choices {} must be in [1, {}] (1 when resumed)", request.id,
                                 request.choices, pd::kMaxChoices));
  }
  if (request.choices > options_.max_choices) {
    return makeError(ErrorCode::Unsupported, fmt::format("request {}: {} choices; this decode worker serves at most {} "
                                                         "(1 with tensor parallelism)",
                                                         request.id, request.choices, options_.max_choices));
  }
  if (requests_.contains(request.id)) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("request {} is already admitted", request.id));
  }
  const bool local = !request.local_prompt.empty();
  if (local) {
    if (static_cast<std::int64_t>(request.local_prompt.size()) != request.prompt_tokens) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("request {}: {} local prompt tokens for a {}-token prompt", request.id,
                                   request.local_prompt.size(), request.prompt_tokens));
    }
    for (const pd::TokenId t : request.local_prompt) {
      if (t < 0 || t >= cfg.vocab_size) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("request {}: prompt token {} is outside the vocabulary", request.id, t));
      }
    }
  }
  if (request.forced_first_token >= cfg.vocab_size || request.forced_first_token < -1 ||
      (request.forced_first_token >= 0 && !local)) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("request {}: bad forced_first_token {}", request.id, request.forced_first_token));
  }
  if (local && request.choices != 1) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("request {}: a local prefill is for one choice", request.id));
  }
  if (!request.prompt_token_ids.empty()) {
    if (local || static_cast<std::int64_t>(request.prompt_token_ids.size()) != request.prompt_tokens) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("request {}: {} prompt token ids for a {}-token prompt{}", request.id,
                                   request.prompt_token_ids.size(), request.prompt_tokens,
                                   local ? " prefilled here (local_prompt has them)" : ""));
    }
    for (const pd::TokenId t : request.prompt_token_ids) {
      if (t < 0 || t >= cfg.vocab_size) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("request {}: prompt token {} is outside the vocabulary", request.id, t));
      }
    }
  }
  // Decode-side prefix reuse: the longest cached run of the prompt's leading blocks, in whole
  // granules (the prefill workers' chunks: the KV a cold prefill computes), short of the last
  // token (the prefill worker writes at least the block holding it).
  std::vector<std::int32_t> shared;
  if (options_.prefix_cache_blocks > 0 && !request.prompt_token_ids.empty()) {
    const std::int64_t bs = pool_.blockSize();
    const std::int64_t granule = std::lcm(bs, options_.local_prefill_chunk_size) / bs;
    shared = blocks_.matchPrefix(request.prompt_token_ids, (request.prompt_tokens - 1) / bs);
    shared.resize(shared.size() / static_cast<std::size_t>(granule) * static_cast<std::size_t>(granule));
  }
  // One spare block per further choice: its copy of the last prompt block (KvBlockManager::fork).
  PD_TRY(blocks_.admit(request.id, request.prompt_tokens, request.choices - 1, shared));
  const std::int64_t present = static_cast<std::int64_t>(shared.size()) * pool_.blockSize();
  if (present > 0) {
    stats_.prefix_hit_tokens += present;
    if (options_.metrics != nullptr) options_.metrics->prefixHit(present);
    log::debug("decode", "request {}: {} of {} prompt tokens are in the prefix cache", request.id, present,
               request.prompt_tokens);
  }
  const std::uint64_t id = request.id;
  const std::span<const std::int32_t> table = blocks_.blockTable(id);
  std::vector<std::int32_t> ids(table.begin(), table.end());
  // A generation keeps its arrival across resumes (the router's); a fresh one arrives now.
  const std::int64_t arrival =
      request.arrival_us > 0
          ? request.arrival_us
          : std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
                .count();
  auto seq = std::make_unique<Sequence>(std::move(request), speculate, std::pair(arrival, ++admissions_));
  seq->present_tokens = present;
  if (local) {
    seq->state = Sequence::State::LocalPrefill;
    local_.push_back(id);
  }
  requests_.emplace(id, std::move(seq));
  publishGauges();
  return ids;
}

std::int64_t DecodeEngine::presentTokens(std::uint64_t request_id) const {
  const auto it = requests_.find(request_id);
  return it == requests_.end() ? 0 : it->second->present_tokens;
}

void DecodeEngine::cachePrompt(const Sequence& seq) {
  const std::vector<pd::TokenId>& tokens =
      seq.req.local_prompt.empty() ? seq.req.prompt_token_ids : seq.req.local_prompt;
  if (options_.prefix_cache_blocks == 0 || tokens.empty()) return;
  // Full blocks inside whole prefill chunks (computed as a cold prefill of a longer prompt computes
  // them) and before the block holding the last prompt token (whose MTP row pairs with a sampled
  // token, and which decode steps append to).
  const std::int64_t bs = pool_.blockSize();
  const std::int64_t n = seq.req.prompt_tokens;
  const std::int64_t chunked = n / options_.local_prefill_chunk_size * options_.local_prefill_chunk_size;
  const std::int64_t blocks = std::min((n - 1) / bs, chunked / bs);
  if (blocks <= 0) return;
  const std::int64_t added = blocks_.cachePrefix(seq.req.id, tokens, blocks);
  stats_.prefix_cached_blocks += added;
}

bool DecodeEngine::awaitingKv(std::uint64_t request_id) const {
  const auto it = requests_.find(request_id);
  return it != requests_.end() && it->second->state == Sequence::State::WaitingKv;
}

Status DecodeEngine::onKvReady(std::uint64_t request_id, Result<kvtransfer::CompletionRecord> record) {
  if (quarantine_.contains(request_id)) {
    // The transfer is over (completed, failed, or timed out at the sender's side): no byte of it
    // can land any more.
    endQuarantine(request_id, false);
    return okStatus();
  }
  const auto it = requests_.find(request_id);
  if (it == requests_.end() || it->second->state != Sequence::State::WaitingKv) {
    return makeError(ErrorCode::NotFound, fmt::format("request {} is not waiting for its KV", request_id));
  }
  Sequence& seq = *it->second;
  if (!record.ok()) {
    const bool timeout = record.error().code == ErrorCode::Timeout;
    finish(request_id, FinishReason::Error, std::move(record).error(),
           timeout ? RequestOutcome::Timeout : RequestOutcome::KvFailed);
    return okStatus();
  }
  kvtransfer::CompletionRecord rec = std::move(record).value();
  const ModelConfig& cfg = engine_.config();
  std::string problem;
  if (static_cast<std::int64_t>(rec.num_tokens) != seq.req.prompt_tokens) {
    problem = fmt::format("KV of {} tokens arrived for a {}-token prompt", rec.num_tokens, seq.req.prompt_tokens);
  } else if (rec.first_token < 0 || rec.first_token >= cfg.vocab_size) {
    problem = fmt::format("first token {} is outside the vocabulary", rec.first_token);
  } else if (seq.speculate && static_cast<std::int64_t>(rec.hidden_state.size()) != cfg.hidden_size) {
    problem = fmt::format("hidden state of {} values, expected {}", rec.hidden_state.size(), cfg.hidden_size);
  } else if (static_cast<std::int64_t>(rec.choice_tokens.size()) != seq.req.choices - 1) {
    problem = fmt::format("{} first tokens arrived for {} choices", rec.choice_tokens.size() + 1, seq.req.choices);
  } else if (std::any_of(rec.choice_tokens.begin(), rec.choice_tokens.end(),
                         [&](const pd::SampledToken& t) { return t.token < 0 || t.token >= cfg.vocab_size; })) {
    problem = "a choice's first token is outside the vocabulary";
  }
  if (!problem.empty()) {
    finish(request_id, FinishReason::Error,
           makeError(ErrorCode::Corrupt, fmt::format("request {}: {}", request_id, problem)), RequestOutcome::KvFailed);
    return okStatus();
  }
  forkChoices(seq, rec);
  startRunning(seq, std::move(rec));
  return okStatus();
}

Status DecodeEngine::attach(std::uint64_t parent_id, std::int64_t choice, std::uint64_t child_id, TokenEventSink sink) {
  if (!sink) return makeError(ErrorCode::InvalidArgument, fmt::format("choice {}: no sink", child_id));
  const auto it = requests_.find(parent_id);
  if (it == requests_.end() || it->second->state != Sequence::State::WaitingKv) {
    return makeError(ErrorCode::NotFound, fmt::format("request {} is not waiting for its KV", parent_id));
  }
  Sequence& parent = *it->second;
  if (choice < 1 || choice >= parent.req.choices) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("request {} has {} choices; choice {} cannot attach",
                                                             parent_id, parent.req.choices, choice));
  }
  const bool in_use =
      requests_.contains(child_id) || std::any_of(requests_.begin(), requests_.end(), [&](const auto& r) {
        return std::any_of(r.second->attached.begin(), r.second->attached.end(),
                           [&](const Sequence::AttachedChoice& a) { return a.id == child_id; });
      });
  if (in_use || std::any_of(parent.attached.begin(), parent.attached.end(),
                            [&](const Sequence::AttachedChoice& a) { return a.choice == choice; })) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("request {}: choice {} or id {} is already attached", parent_id, choice, child_id));
  }
  parent.attached.push_back(Sequence::AttachedChoice{choice, child_id, std::move(sink)});
  return okStatus();
}

void DecodeEngine::forkChoices(Sequence& parent, const kvtransfer::CompletionRecord& record) {
  std::vector<Sequence::AttachedChoice> attached = std::exchange(parent.attached, {});
  for (Sequence::AttachedChoice& a : attached) {
    Result<KvBlockManager::BlockCopy> copy = blocks_.fork(parent.req.id, a.id);
    PD_CHECK(copy.ok());  // a spare was admitted for every choice, and ids are checked at attach()
    pool_.copyBlock(copy->src, copy->dst);
    DecodeRequest r;
    r.id = a.id;
    r.prompt_tokens = parent.req.prompt_tokens;
    r.max_tokens = parent.req.max_tokens;
    r.sampling = parent.req.sampling;
    r.sampling.seed = pd::choiceSeed(parent.req.sampling.seed, a.choice);
    r.arrival_us = parent.admitted.first;
    r.stop_token_ids = parent.req.stop_token_ids;
    r.ignore_eos = parent.req.ignore_eos;
    r.logprobs = parent.req.logprobs;
    r.grammar = parent.req.grammar;
    r.sink = std::move(a.sink);
    auto child =
        std::make_unique<Sequence>(std::move(r), parent.speculate, std::pair(parent.admitted.first, ++admissions_));
    Sequence& seq = *child;
    requests_.emplace(a.id, std::move(child));
    const pd::SampledToken& first = record.choice_tokens[static_cast<std::size_t>(a.choice - 1)];
    kvtransfer::CompletionRecord own;
    own.num_tokens = record.num_tokens;
    own.first_token = first.token;
    own.hidden_state = record.hidden_state;
    if (seq.req.logprobs) {
      own.first_logprob = pd::TokenLogprob{first.token, first.logprob};
      own.top_logprobs = first.top;
    }
    startRunning(seq, std::move(own));  // may end it at once (max_tokens 1, a stop token)
  }
  // Choices that never attached leave their copies unused.
  blocks_.releaseSpares(parent.req.id);
  publishGauges();
}

void DecodeEngine::startRunning(Sequence& seq, kvtransfer::CompletionRecord record) {
  model::SampledToken first;
  first.token = record.first_token;
  if (record.first_logprob) first.logprob = record.first_logprob->logprob;
  first.top = record.top_logprobs;
  // Replay the prefill worker's draw: sampling a row where only the first token is possible
  // advances the RNG by the one draw the prefill side used (none when greedy) and counts the
  // token for penalties, so the rest of the stream is what single-process generation samples.
  std::vector<float> only(static_cast<std::size_t>(engine_.config().vocab_size), std::numeric_limits<float>::lowest());
  only[static_cast<std::size_t>(first.token)] = 0.0F;
  PD_CHECK(seq.sampler.sample(only).token == first.token);
  if (seq.constraint && !seq.constraint->accept(first.token).ok()) {
    finish(
        seq.req.id, FinishReason::Error,
        makeError(ErrorCode::Corrupt,
                  fmt::format("the prefill worker's first token {} is outside the request's constraint", first.token)),
        RequestOutcome::KvFailed);
    return;
  }
  // The prefill side wrote MTP positions [0, n - 1); position n - 1 pairs h[n - 1] with the first token.
  seq.mtp.done = seq.req.prompt_tokens - 1;
  seq.mtp.hidden = std::move(record.hidden_state);
  seq.kv_traceparent = std::move(record.traceparent);
  std::vector<model::SampledToken> tokens;
  tokens.push_back(std::move(first));
  seq.state = Sequence::State::Ready;
  const std::uint64_t id = seq.req.id;
  if (!emit(seq, std::move(tokens))) {
    ready_.push_back(id);
    publishGauges();
  }
}

void DecodeEngine::runLocalPrefills() {
  std::int64_t budget = options_.local_prefill_token_budget;
  while (!local_.empty() && budget > 0) {
    const std::uint64_t id = local_.front();
    local_.pop_front();
    Sequence& seq = *requests_.at(id);  // finish() takes ended requests out of local_
    budget -= seq.req.prompt_tokens;
    const auto started = Clock::now();
    Result<kvtransfer::CompletionRecord> record = localPrefill(seq);
    ++stats_.local_prefills;
    stats_.local_prefill_tokens += seq.req.prompt_tokens;
    if (options_.metrics != nullptr) {
      options_.metrics->localPrefilled(seq.req.prompt_tokens,
                                       std::chrono::duration<double>(Clock::now() - started).count());
    }
    if (!record.ok()) {
      const ErrorCode code = record.error().code == ErrorCode::PeerFailed || record.error().code == ErrorCode::Timeout
                                 ? record.error().code
                                 : ErrorCode::Internal;
      finish(id, FinishReason::Error,
             makeError(code, fmt::format("request {}: local prefill failed: {}", id, record.error().toString())),
             RequestOutcome::Error);
      continue;
    }
    startRunning(seq, std::move(record).value());
  }
}

Result<kvtransfer::CompletionRecord> DecodeEngine::localPrefill(Sequence& seq) {
  const ModelConfig& cfg = engine_.config();
  const std::span<const std::int32_t> tokens(seq.req.local_prompt);
  const std::span<const std::int32_t> table = blocks_.blockTable(seq.req.id);
  const auto n = static_cast<std::int64_t>(tokens.size());
  const bool mtp = seq.speculate && cfg.num_nextn_predict_layers > 0;
  std::vector<float> hidden;  // [n, hidden_size] when mtp, else the last row only
  std::vector<float> last_logits;
  // As a prefill worker computes it: in prefill-worker-sized chunks over a float32 cache of its
  // own (attention reads float32 latents), every layer also written into the pool, converted as a
  // transfer lands it. The same chunks give the same KV bit for bit. A batch-invariant engine
  // attends over latents rounded as the pool holds them, as its decode steps do (and as a prefill
  // worker with prefill.kv_dtype equal to the pool's does).
  const std::int64_t bs = pool_.blockSize();
  const DType scratch_dtype = engine_.capabilities().batch_invariant ? pool_.view().dtype : DType::F32;
  PD_ASSIGN_OR_RETURN(model::PagedLatentCache scratch,
                      model::PagedLatentCache::create(cfg, (n + bs - 1) / bs, bs, scratch_dtype));
  std::vector<std::int32_t> scratch_table(static_cast<std::size_t>((n + bs - 1) / bs));
  std::iota(scratch_table.begin(), scratch_table.end(), 0);
  PoolWriter writer(pool_, table);
  for (std::int64_t pos = 0; pos < n; pos += options_.local_prefill_chunk_size) {
    const std::int64_t take = std::min(options_.local_prefill_chunk_size, n - pos);
    const model::SequenceChunk chunk{tokens.subspan(static_cast<std::size_t>(pos), static_cast<std::size_t>(take)), pos,
                                     scratch_table};
    model::ForwardOptions fo;
    fo.logits = pos + take == n ? model::OutputRows::Last : model::OutputRows::None;
    fo.hidden = mtp ? model::OutputRows::All : (pos + take == n ? model::OutputRows::Last : model::OutputRows::None);
    fo.sink = &writer;
    PD_ASSIGN_OR_RETURN(model::ForwardOutput out, engine_.forward(std::span(&chunk, 1), scratch.view(), fo));
    PD_TRY(writer.status());
    hidden.insert(hidden.end(), out.hidden.begin(), out.hidden.end());
    if (pos + take == n) last_logits = std::move(out.logits);
  }
  // The first token as a prefill worker samples it: a fresh sampler of the request's params,
  // resumed after the tokens this generation already produced, under the constraint's mask.
  model::Sampler sampler(seq.req.sampling, seq.req.logprobs);
  sampler.resumeAfter(seq.req.resumed_tokens);
  std::span<const std::uint64_t> allowed;
  if (seq.constraint && seq.req.forced_first_token < 0) allowed = seq.constraint->mask();
  model::SampledToken first = sampler.sample(last_logits, allowed);
  if (seq.req.forced_first_token >= 0) first.token = seq.req.forced_first_token;
  const auto hidden_size = static_cast<std::size_t>(cfg.hidden_size);
  if (mtp) {
    // MTP row i pairs token i+1 with final hidden state i; the last row takes the first token.
    std::vector<std::int32_t> mtp_tokens(tokens.begin() + 1, tokens.end());
    mtp_tokens.push_back(first.token);
    model::SequenceChunk chunk{mtp_tokens, 0, scratch_table};
    chunk.prev_hidden = hidden;
    model::ForwardOptions fo;
    fo.logits = model::OutputRows::None;
    fo.hidden = model::OutputRows::None;
    fo.sink = &writer;
    PD_TRY(engine_.forwardMtp(std::span(&chunk, 1), scratch.view(), fo));
  }
  kvtransfer::CompletionRecord record;
  record.num_tokens = static_cast<std::uint32_t>(n);
  record.first_token = first.token;
  if (hidden.size() >= hidden_size) {
    record.hidden_state.assign(hidden.end() - static_cast<std::ptrdiff_t>(hidden_size), hidden.end());
  }
  if (seq.req.logprobs) {
    record.first_logprob = pd::TokenLogprob{first.token, first.logprob};
    record.top_logprobs = first.top;
  }
  return record;
}

bool DecodeEngine::emit(Sequence& seq, std::vector<model::SampledToken> tokens) {
  const std::int32_t eos = static_cast<std::int32_t>(engine_.config().eos_token_id);
  std::optional<FinishReason> reason;
  std::size_t kept = 0;
  for (const auto& t : tokens) {
    seq.generated.push_back(t.token);
    ++kept;
    // A constraint's stop token ends the output even if it is not the model's EOS (the verifier
    // emits nothing after it, so it is the step's last token).
    const bool grammar_done = seq.constraint && seq.constraint->terminated() && kept == tokens.size();
    const bool stop = (!seq.req.ignore_eos && t.token == eos) || grammar_done ||
                      std::find(seq.req.stop_token_ids.begin(), seq.req.stop_token_ids.end(), t.token) !=
                          seq.req.stop_token_ids.end();
    if (stop) {
      reason = FinishReason::Stop;
    } else if (static_cast<std::int64_t>(seq.generated.size()) >= seq.req.max_tokens) {
      reason = FinishReason::Length;
    }
    if (reason) break;
  }
  tokens.resize(kept);
  TokenEvent event;
  event.request_id = seq.req.id;
  event.tokens = std::move(tokens);
  event.prompt_tokens = seq.req.prompt_tokens;
  event.completion_tokens = static_cast<std::int64_t>(seq.generated.size());
  event.kv_traceparent = std::exchange(seq.kv_traceparent, {});
  if (!reason) {
    seq.req.sink(event);
    return false;
  }
  event.finish = reason;
  const std::uint64_t id = seq.req.id;
  TokenEventSink sink = std::exchange(seq.req.sink, nullptr);
  finish(id, *reason, std::nullopt,
         *reason == FinishReason::Stop
             ? RequestOutcome::Stop
             : RequestOutcome::Length);  // frees the blocks; the sink was moved out, so it is not called there
  sink(event);
  return true;
}

void DecodeEngine::finish(std::uint64_t request_id, FinishReason reason, std::optional<Error> error,
                          RequestOutcome outcome, bool preempted) {
  const auto it = requests_.find(request_id);
  PD_CHECK(it != requests_.end());
  std::unique_ptr<Sequence> seq = std::move(it->second);
  requests_.erase(it);
  std::erase(running_, request_id);
  std::erase(ready_, request_id);
  std::erase(local_, request_id);
  const bool awaited = seq->state == Sequence::State::WaitingKv;
  const auto held_blocks = preempted ? static_cast<std::int64_t>(blocks_.blockTable(request_id).size()) : 0;
  if (awaited && options_.quarantine_late_writes && reason == FinishReason::Aborted &&
      seq->req.kv_deadline > Clock::now()) {
    // rma: a prefill may be writing these blocks right now. Hold them until the transfer's
    // outcome arrives or its deadline passes (header comment, "Late writes").
    PD_CHECK(blocks_.quarantine(request_id) > 0);
    if (seq->req.end_kv_attempts) seq->req.end_kv_attempts();
    quarantine_.emplace(request_id, Quarantined{seq->req.kv_deadline, std::move(seq->req.stop_kv_wait)});
    ++stats_.quarantined;
  } else {
    // Stop the transport's expectation before the blocks can be handed to another request.
    if (awaited && seq->req.stop_kv_wait) seq->req.stop_kv_wait();
    // A prompt whose KV arrived (checked by onKvReady) or was computed here is complete.
    const bool kv_complete = seq->state == Sequence::State::Ready || seq->state == Sequence::State::Running;
    if (kv_complete && outcome != RequestOutcome::Error) cachePrompt(*seq);
    PD_CHECK(blocks_.release(request_id));
  }
  if (options_.metrics != nullptr) options_.metrics->requestEnded(outcome);
  publishGauges();  // before the sink: whoever sees the end of the stream sees the blocks free
  // Choices attached to a request that never got its KV end with it.
  for (Sequence::AttachedChoice& a : seq->attached) {
    if (options_.metrics != nullptr) options_.metrics->requestEnded(outcome);
    TokenEvent event;
    event.request_id = a.id;
    event.finish = reason;
    event.error = error;
    event.prompt_tokens = seq->req.prompt_tokens;
    event.preempted = preempted;
    a.sink(event);
  }
  if (!seq->req.sink) return;  // emit() delivers the final event itself
  TokenEvent event;
  event.request_id = request_id;
  event.finish = reason;
  event.error = std::move(error);
  event.prompt_tokens = seq->req.prompt_tokens;
  event.completion_tokens = static_cast<std::int64_t>(seq->generated.size());
  event.preempted = preempted;
  event.preempted_blocks = held_blocks;
  seq->req.sink(event);
}

std::uint64_t DecodeEngine::preemptLatest() {
  PD_CHECK(!requests_.empty());
  std::uint64_t id = 0;
  const Sequence* latest = nullptr;
  for (const auto& [rid, seq] : requests_) {
    if (latest == nullptr || seq->admitted > latest->admitted) {
      id = rid;
      latest = seq.get();
    }
  }
  const auto held = blocks_.blockTable(id).size();
  ++stats_.preemptions;
  if (options_.metrics != nullptr) options_.metrics->preempted();
  log::info("decode", "request {}: preempted ({} KV blocks, {} tokens generated): the pool ran dry", id, held,
            latest != nullptr ? latest->generated.size() : 0);
  finish(id, FinishReason::Aborted,
         makeError(ErrorCode::Overloaded, fmt::format("request {} preempted: the KV pool ran dry", id)),
         RequestOutcome::Preempted, /*preempted=*/true);
  return id;
}

bool DecodeEngine::growOrPreempt(Sequence& seq, std::int64_t tokens) {
  const std::uint64_t id = seq.req.id;
  for (;;) {
    if (blocks_.grow(id, tokens).ok()) return true;
    if (preemptLatest() == id) return false;  // `seq` is gone
  }
}

void DecodeEngine::endQuarantine(std::uint64_t request_id, bool cancel_wait) {
  const auto it = quarantine_.find(request_id);
  PD_CHECK(it != quarantine_.end());
  std::function<void()> stop = std::move(it->second.stop_kv_wait);
  quarantine_.erase(it);
  // Cancelling may answer the expectation at once (a Cancelled arrival for an id that is no
  // longer known here: ignored), so the entry is gone first.
  if (cancel_wait && stop) stop();
  PD_CHECK(blocks_.release(request_id));
  publishGauges();
}

void DecodeEngine::noteKvRetry(std::uint64_t request_id, const Error& failure) {
  const auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  ++stats_.prefill_retries;
  if (options_.metrics != nullptr) options_.metrics->prefillRetried();
  log::info("decode", "request {}: prefill attempt failed ({}); keeping its blocks for the next attempt", request_id,
            failure.toString());
}

bool DecodeEngine::abort(std::uint64_t request_id) {
  for (auto& [id, seq] : requests_) {
    auto& attached = seq->attached;
    const auto a = std::find_if(attached.begin(), attached.end(),
                                [&](const Sequence::AttachedChoice& c) { return c.id == request_id; });
    if (a == attached.end()) continue;
    // Not forked yet: it holds no block of its own (its spare goes back at the fork).
    TokenEventSink sink = std::move(a->sink);
    attached.erase(a);
    if (options_.metrics != nullptr) options_.metrics->requestEnded(RequestOutcome::Aborted);
    TokenEvent event;
    event.request_id = request_id;
    event.finish = FinishReason::Aborted;
    event.error = makeError(ErrorCode::Cancelled, fmt::format("request {} aborted", request_id));
    event.prompt_tokens = seq->req.prompt_tokens;
    sink(event);
    return true;
  }
  if (!requests_.contains(request_id)) return false;
  if (pending_ && pending_->ids.contains(request_id)) {
    // In the step that is running (computeStep): it ends when the step completes.
    pending_->deferred_aborts.push_back(request_id);
    return true;
  }
  finish(request_id, FinishReason::Aborted,
         makeError(ErrorCode::Cancelled, fmt::format("request {} aborted", request_id)), RequestOutcome::Aborted);
  return true;
}

void DecodeEngine::publishGauges() const {
  if (options_.metrics == nullptr) return;
  std::int64_t waiting = 0;
  std::int64_t waiting_tokens = 0;
  for (const auto& [id, seq] : requests_) {
    if (seq->state != Sequence::State::WaitingKv && seq->state != Sequence::State::LocalPrefill) continue;
    ++waiting;
    waiting_tokens += seq->req.prompt_tokens;
  }
  options_.metrics->setBlocks(blocks_.freeBlocks(), blocks_.availableBlocks(), blocks_.numBlocks(),
                              blocks_.quarantinedBlocks());
  options_.metrics->setPrefixCache(blocks_.cachedBlocks(), blocks_.prefixEvictions());
  options_.metrics->setSequences(waiting, waiting_tokens, static_cast<std::int64_t>(ready_.size()),
                                 static_cast<std::int64_t>(running_.size()));
}

std::optional<Clock::time_point> DecodeEngine::nextKvDeadline() const {
  std::optional<Clock::time_point> next;
  for (const auto& [id, seq] : requests_) {
    if (seq->state == Sequence::State::WaitingKv && (!next || seq->req.kv_deadline < *next))
      next = seq->req.kv_deadline;
  }
  for (const auto& [id, q] : quarantine_) {
    if (!next || q.until < *next) next = q.until;
  }
  return next;
}

void DecodeEngine::step(Clock::time_point now) {
  if (!prepareStep(now)) return;
  computeStep();
  completeStep();
}

bool DecodeEngine::prepareStep(Clock::time_point now) {
  PD_CHECK(!pending_);
  std::vector<std::uint64_t> expired;
  for (const auto& [id, seq] : requests_) {
    if (seq->state == Sequence::State::WaitingKv && seq->req.kv_deadline < now) expired.push_back(id);
  }
  for (const std::uint64_t id : expired) {
    finish(id, FinishReason::Error,
           makeError(ErrorCode::Timeout, fmt::format("request {}: its KV did not arrive before the deadline", id)),
           RequestOutcome::Timeout);
  }
  std::vector<std::uint64_t> released;
  for (const auto& [id, q] : quarantine_) {
    if (q.until <= now) released.push_back(id);
  }
  for (const std::uint64_t id : released) endQuarantine(id, true);
  runLocalPrefills();
  while (!ready_.empty() && static_cast<std::int64_t>(running_.size()) < options_.max_running_requests) {
    const std::uint64_t id = ready_.front();
    ready_.pop_front();
    requests_.at(id)->state = Sequence::State::Running;
    running_.push_back(id);
  }
  if (running_.empty()) return false;
  std::vector<Sequence*> all;
  all.reserve(running_.size());
  for (const std::uint64_t id : running_) all.push_back(requests_.at(id).get());
  auto step = std::make_unique<PendingStep>(planBatch(all));
  if (step->batch.empty()) {
    publishGauges();
    return false;
  }
  pending_ = std::move(step);
  return true;
}

DecodeEngine::PendingStep DecodeEngine::planBatch(std::span<Sequence* const> all) {
  PendingStep step;
  step.started = Clock::now();
  const ModelConfig& cfg = engine_.config();
  const std::int64_t max_pos = cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : INT64_MAX;

  // Drafts per sequence (clipped to the tokens the request may still produce and to the
  // context), then the blocks the step writes: oldest admission first, so that preemption (of the
  // latest) never takes a sequence already grown for this step. Drafts are dropped before anyone
  // is preempted for their blocks.
  std::vector<std::pair<std::pair<std::int64_t, std::uint64_t>, std::uint64_t>> order;  // (admission, id)
  order.reserve(all.size());
  for (Sequence* seq : all) order.emplace_back(seq->admitted, seq->req.id);
  std::sort(order.begin(), order.end());
  for (const auto& [admitted, id] : order) {
    const auto it = requests_.find(id);
    if (it == requests_.end()) continue;  // preempted for an older sequence's block
    Sequence* seq = it->second.get();
    const std::int64_t start = seq->len() - 1;
    const std::int64_t remaining = seq->req.max_tokens - static_cast<std::int64_t>(seq->generated.size());
    std::int64_t ki =
        seq->speculate
            ? std::max<std::int64_t>(0, std::min({options_.num_speculative_tokens, remaining - 1, max_pos - 1 - start}))
            : 0;
    if (ki > 0 && !blocks_.grow(id, start + 1 + ki).ok()) ki = 0;
    if (!growOrPreempt(*seq, start + 1 + ki)) continue;
    step.batch.push_back(seq);
    step.k.push_back(ki);
  }
  // The block tables now, on this thread: computeStep may run while admissions change the block
  // manager (a sequence's own table changes only here and when it ends, neither while it runs).
  for (Sequence* seq : step.batch) {
    step.tables.push_back(blocks_.blockTable(seq->req.id));
    step.ids.insert(seq->req.id);
  }
  return step;
}

void DecodeEngine::computeStep() {
  PD_CHECK(pending_ != nullptr);
  PendingStep& step = *pending_;
  const std::vector<Sequence*>& batch = step.batch;
  const std::vector<std::int64_t>& k = step.k;
  const std::size_t n = batch.size();

  // Draft: the drafter proposes k[i] tokens for every sequence that drafts this step.
  step.drafts.assign(n, {});
  std::vector<DraftSlot> draft_slots;
  std::vector<std::size_t> drafting;
  for (std::size_t i = 0; i < n; ++i) {
    if (k[i] == 0) continue;
    Sequence& s = *batch[i];
    draft_slots.push_back(DraftSlot{s.req.id, s.req.prompt_tokens, s.generated, k[i], step.tables[i], &s.mtp});
    drafting.push_back(i);
  }
  if (!draft_slots.empty()) {
    auto proposed = drafter_->draft(draft_slots);
    if (!proposed.ok()) {
      step.verified = std::move(proposed).error();
      return;
    }
    PD_CHECK(proposed->size() == drafting.size());
    for (std::size_t r = 0; r < drafting.size(); ++r) {
      PD_CHECK(static_cast<std::int64_t>((*proposed)[r].size()) == k[drafting[r]]);
      step.drafts[drafting[r]] = std::move((*proposed)[r]);
    }
  }

  // A draft the grammar refuses can never equal a sample drawn under its mask: verify only the
  // prefix it accepts.
  for (std::size_t i = 0; i < n; ++i) {
    if (batch[i]->constraint && !step.drafts[i].empty()) {
      step.drafts[i].resize(batch[i]->constraint->acceptablePrefix(step.drafts[i]));
    }
  }

  // Verify: one forward of the main model over (last token, drafts...) of every sequence.
  std::vector<VerifySlot> verify_slots;
  verify_slots.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    Sequence& s = *batch[i];
    verify_slots.push_back(VerifySlot{s.generated.back(), s.len() - 1, step.drafts[i], step.tables[i], &s.sampler,
                                      static_cast<std::size_t>(s.req.max_tokens) - s.generated.size(),
                                      s.speculate ? &s.mtp : nullptr, s.constraint.get()});
  }
  step.verified = verifier_->verify(verify_slots);
}

void DecodeEngine::completeStep() {
  PD_CHECK(pending_ != nullptr);
  const std::unique_ptr<PendingStep> owned = std::move(pending_);
  PendingStep& step = *owned;
  const std::vector<Sequence*>& batch = step.batch;
  const std::size_t n = batch.size();
  if (!step.verified.ok()) {
    // A tensor-parallel group's communication failure keeps its code (PeerFailed / Timeout: a
    // rank died or stalled); anything else is this worker's internal failure.
    const Error& e = step.verified.error();
    const ErrorCode code =
        e.code == ErrorCode::PeerFailed || e.code == ErrorCode::Timeout ? e.code : ErrorCode::Internal;
    for (Sequence* seq : batch) {
      finish(seq->req.id, FinishReason::Error, makeError(code, fmt::format("decode step failed: {}", e.toString())),
             RequestOutcome::Error);
    }
  } else {
    std::vector<Verified>& verified = *step.verified;
    ++stats_.steps;
    std::int64_t emitted_tokens = 0;
    std::int64_t proposed_tokens = 0;
    std::int64_t accepted_tokens = 0;
    for (std::size_t i = 0; i < n; ++i) {
      proposed_tokens += static_cast<std::int64_t>(step.drafts[i].size());
      accepted_tokens += verified[i].accepted;
      emitted_tokens += static_cast<std::int64_t>(verified[i].tokens.size());
    }
    for (Sequence* seq : batch) {
      if (seq->constraint) stats_.grammar_seconds += seq->constraint->takeSeconds();
    }
    stats_.sample_seconds += verifier_->takeSampleSeconds();
    stats_.engine_sampled_tokens += verifier_->takeEngineSampledTokens();
    stats_.drafts_proposed += proposed_tokens;
    stats_.drafts_accepted += accepted_tokens;
    stats_.tokens_generated += emitted_tokens;
    // Counted before any stream hears of this step, so its last event implies the step's metrics.
    if (options_.metrics != nullptr) {
      options_.metrics->stepDone(std::chrono::duration<double>(Clock::now() - step.started).count(), emitted_tokens,
                                 proposed_tokens, accepted_tokens);
    }
    for (std::size_t i = 0; i < n; ++i) {
      emit(*batch[i], std::move(verified[i].tokens));  // may end and destroy the sequence: not touched after
    }
  }
  // Aborts that arrived while the step ran, for sequences its tokens did not end.
  for (const std::uint64_t id : step.deferred_aborts) (void)abort(id);
  publishGauges();
}

}  // namespace pd::decode
