#pragma once
/// The decode worker's scheduler and step loop body (DESIGN §3 steps 2 and 4).
///
/// A request's life here:
///  1. admit(): blocks for the prompt are allocated, provided the admission headroom stays free
///     (kv_block_manager.h); the answer is the block ids the prefill worker writes into. Later
///     blocks are taken one at a time as the request's tokens (and MTP drafts) are written.
///  2. Waiting for KV: onKvReady() delivers the completion record (first token + the prompt's
///     last hidden state, the MTP input) or the failure; a request still waiting at its
///     kv_deadline ends with Timeout at the next step().
///  3. Running: the first token is streamed at once; each step() then runs one batched decode
///     forward (absorbed MLA over the paged cache) for every running sequence, with k MTP draft
///     tokens per sequence verified in that same forward, samples each verified position with
///     the request's sampler exactly as plain decoding would (one draw per emitted token; a draft
///     is accepted only if it equals that sample, so speculation never changes the output), and
///     streams the new tokens. Drafts are the MTP layer's argmax (q one-hot), so accepting iff
///     the sample equals the draft accepts with probability p(draft) and emits exactly p — what
///     speculative sampling's min(1, p/q) test with a max(0, p − q) residual gives for that q.
///     The first token was sampled by the prefill worker with a sampler of the same params and
///     seed; this side replays that one draw, so a seeded request samples the same tokens as
///     single-process generation (model::generate).
///  4. It ends on max_tokens, EOS (unless ignore_eos), a stop token id, abort(), a KV failure
///     or deadline, preemption, or an engine error; the sink gets exactly one event with `finish`
///     set, and every block of the request is released (or quarantined) before that event is
///     delivered.
///
/// Preemption (docs/kv-memory.md): when a step cannot get the block a sequence needs next (it
/// first gives up that step's MTP drafts), the engine preempts the request admitted latest —
/// whatever its state, the sequence itself included — and tries again, until the block is there
/// or the sequence itself was the one preempted. "Latest" orders by DecodeRequest::arrival_us (a
/// resumed generation keeps its first arrival, so it is not the first victim again), then by
/// admission here. Sequences are grown oldest admission first, so
/// a victim is never one already grown for this step. A preempted request ends with finish
/// Aborted, `preempted` set and error Overloaded; its blocks are freed at once, except those of a
/// request still waiting for its KV on the rma data path, which are quarantined like an abort's
/// ("Late writes"). The router resumes it elsewhere or here (prompt + the tokens it produced).
///
/// Resume: a request whose `resumed_tokens` is not empty continues a generation that produced
/// those tokens elsewhere (they are the tail of its prompt); its sampler resumes after them
/// (model::Sampler::resumeAfter), so greedy and seeded sampling give the tokens the
/// uninterrupted generation would have given.
///
/// Late writes (docs/kv-transfer.md, "Data paths"): with the `am` data path the transport drops
/// bytes of a request it no longer expects, so an ended request's blocks are reused at once. With
/// `rma` a prefill worker puts straight into the pool, so a request aborted while its KV is still
/// awaited (abort(): router cancel, client gone, shutdown) may still be written into. With
/// DecodeEngineOptions::quarantine_late_writes (the worker sets it when its data path resolves to
/// rma) such a request's blocks are quarantined instead of freed (KvBlockManager::quarantine):
/// the stream ends at once, but the blocks return to the free list only when the transfer's
/// outcome arrives (onKvReady with the completion or failure record, or the transport's Timeout:
/// the sender has stopped writing) or at the request's kv_deadline (the transfer's deadline plus
/// kvtransfer.receive_grace_ms), whichever comes first. The transport's expectation stays armed
/// meanwhile (end_kv_attempts stops re-arming it for further prefill attempts); stop_kv_wait
/// cancels it when the deadline releases the blocks. Requests that end on their transfer's own
/// outcome (a failure record, a bad record, the deadline) have nothing in flight: freed at once.
/// Residual assumption: after an abort, no prefill attempt starts that began after the record
/// which ends the quarantine (the router does not retry a generation it has ended).
///
/// Choices (OpenAI `n`, docs/kv-memory.md "Choices share the prompt"): a request admitted with
/// `choices` = n > 1 holds its prompt's blocks plus n - 1 spare blocks. Before its KV arrives,
/// choices 1..n-1 attach() to it, each with an id and a sink of its own. When the record arrives
/// (it carries n first tokens, CompletionRecord::choice_tokens) every attached choice is forked
/// off the request: it shares the prompt's blocks by reference count, gets its own copy of the
/// last prompt block (the first block its decode steps and its MTP position n-1 write), samples
/// with pd::choiceSeed(seed, choice), and runs from then on as a request of its own (its own
/// growth, preemption, abort and end; a block is freed when its last holder lets go). Spares of
/// choices that never attached are freed at the fork. A request that ends while its KV is awaited
/// ends its attached choices with it (the same finish and error).
///
/// Prefix cache (docs/kv-memory.md, "Prefix reuse on the decode side"): with
/// DecodeEngineOptions::prefix_cache_blocks > 0, a request that brings its prompt's token ids
/// (DecodeRequest::prompt_token_ids) is admitted with the longest run of cached blocks holding its
/// leading full blocks, in whole granules and short of its last token, shared read-only with the
/// cache (KvBlockManager); presentTokens() says how many tokens they hold, and the descriptor tells
/// the prefill worker not to send them. When a request whose KV arrived (and was checked) ends in
/// any way but an engine error, its prompt's full blocks inside whole granules, short of the block
/// holding its last prompt token, are offered to the cache (also for local prompts). Only prompt
/// blocks are cached: blocks holding generated tokens were written by decode steps, whose KV
/// differs in the low bits from the prefill worker's. Blocks enter the cache before the request's
/// blocks are released, so its idle blocks are there for the next turn.
///
/// The MTP layer's latent KV (kv layer num_hidden_layers) for prompt positions [0, n-1) must be
/// written by the prefill side like any other layer. Position n-1 pairs the prompt's last hidden
/// state with the first token; this engine computes it from the record on the first draft step
/// (the prefill worker also writes it: same inputs, same values) and writes every later one.
///
/// Thread rules: engine thread only — one thread owns a DecodeEngine, the model engine and the
/// pool during every call. Network threads hand work over through a queue to that thread. Sinks
/// are called on that thread, must not block and must not call back into the DecodeEngine.

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "pd/common/choices.h"
#include "pd/common/result.h"
#include "pd/decode/decode_config.h"
#include "pd/decode/decode_metrics.h"
#include "pd/decode/drafter.h"
#include "pd/decode/kv_block_manager.h"
#include "pd/decode/kv_pool.h"
#include "pd/engine/engine.h"
#include "pd/engine/sampling.h"
#include "pd/kvtransfer/wire.h"
#include "pd/structured/grammar.h"

namespace pd::decode {

class DraftVerifier;

using Clock = std::chrono::steady_clock;

// FinishReason is the generation vocabulary's (generation.h): Stop (EOS or a stop token id),
// Length (max_tokens), Aborted (abort(): the client went away or the router cancelled), Error
// (KV failure, KV deadline, or an engine error; TokenEvent::error says which).
using pd::FinishReason;

/// What a request's sink receives: new tokens, and on the last event the finish.
struct TokenEvent {
  std::uint64_t request_id = 0;
  std::vector<model::SampledToken> tokens;  ///< tokens produced since the previous event
  std::optional<FinishReason> finish;       ///< set on the request's last event only
  std::optional<Error> error;               ///< with finish == Error (or Aborted: Cancelled)
  std::int64_t prompt_tokens = 0;           ///< usage
  std::int64_t completion_tokens = 0;       ///< usage: tokens streamed so far, these included
  /// On the last event: the request was preempted (finish Aborted, error Overloaded); the KV
  /// pool ran dry and this request gave its blocks up to be resumed.
  bool preempted = false;
  /// With `preempted`: the KV blocks the request held and gave up.
  std::int64_t preempted_blocks = 0;
  /// On the first event (the first token): the completion record's trace context
  /// (kvtransfer::CompletionRecord::traceparent), empty when it carried none.
  std::string kv_traceparent;
};

/// Called on the engine thread; must not block.
using TokenEventSink = std::function<void(const TokenEvent&)>;

struct DecodeRequest {
  std::uint64_t id = 0;
  std::int64_t prompt_tokens = 0;
  std::int64_t max_tokens = 16;  ///< the first token (from prefill) counts
  pd::SamplingParams sampling;
  /// A resumed generation: the tokens it produced before this leg, which are the last
  /// resumed_tokens.size() (< prompt_tokens) tokens of the prompt. The sampler resumes after
  /// them (penalties and RNG position). Empty for a fresh request.
  std::vector<pd::TokenId> resumed_tokens;
  /// When the generation arrived (µs since the Unix epoch, the router's clock): preemption takes
  /// the latest arrival first. 0: now (the admission).
  std::int64_t arrival_us = 0;
  std::vector<pd::TokenId> stop_token_ids;
  bool ignore_eos = false;
  bool logprobs = false;  ///< fill each token's logprob (and sampling.top_logprobs alternatives)
  Clock::time_point kv_deadline = Clock::time_point::max();
  /// Prefill attempts to wait for (>= 1): DecodeLoop::openStream absorbs attempts - 1 failure
  /// records, keeping the blocks, before a failure ends the request. Within kv_deadline.
  std::int64_t prefill_attempts = 1;
  TokenEventSink sink;
  /// The output constraint (docs/structured-outputs.md): every token after the first is sampled
  /// under the grammar's mask, MTP drafts are trimmed to what the grammar accepts, and a first
  /// token (sampled by prefill under the same grammar) the grammar refuses ends the request with
  /// Corrupt. Null: free text.
  std::shared_ptr<const structured::Grammar> grammar;
  /// Conditional disaggregation (docs/kv-memory.md, "Local prefill"): the prompt's token ids when
  /// this worker prefills the prompt itself instead of receiving its KV (prompt_tokens of them,
  /// each within the vocabulary). Empty: the KV comes from a prefill worker (onKvReady). A local
  /// request never waits for KV: step() runs its prompt through the model into its own blocks,
  /// samples the first token exactly as a prefill worker would (same sampler, seed, constraint
  /// and forced_first_token), runs the MTP layer over the prompt when speculating, and streams on.
  std::vector<pd::TokenId> local_prompt;
  /// A resumed local prefill's first token (the one the client already has); -1: sampled.
  pd::TokenId forced_first_token = -1;
  /// Called once on the engine thread when the request ends while its KV is still awaited
  /// (abort, deadline, a bad record, shutdown), before its blocks are freed: stops the transport's
  /// expectation so that late bytes are dropped instead of landing in reused blocks; with
  /// quarantine_late_writes, when the quarantine ends at the deadline instead. Optional.
  std::function<void()> stop_kv_wait;
  /// With quarantine_late_writes: called once on the engine thread when the request ends while
  /// its KV is awaited and its blocks are quarantined — the expectation stays armed (its outcome
  /// ends the quarantine) but must not be re-armed for further prefill attempts. Optional.
  std::function<void()> end_kv_attempts;
  /// Decode-side prefix reuse (header comment, "Prefix cache"): the prompt's token ids
  /// (prompt_tokens of them, each within the vocabulary) for a request whose KV comes from a
  /// prefill worker. With them the leading blocks the prefix cache holds are attached instead of
  /// written (presentTokens()), and the prompt's blocks enter the cache when the request ends.
  /// Empty: no reuse (a local request uses local_prompt).
  std::vector<pd::TokenId> prompt_token_ids;
  /// Choices sharing this prompt (header comment, "Choices"): 1..DecodeEngineOptions::max_choices;
  /// above 1, not for a resumed generation. This request is choice 0.
  std::int64_t choices = 1;
};

struct DecodeEngineOptions {
  std::int64_t num_speculative_tokens = 0;  ///< MTP drafts per step (0 = off)
  std::int64_t max_running_requests = 64;   ///< sequences in one step; the rest wait their turn
  /// Where to publish pool, sequence, request and step series (may be null); must outlive the
  /// engine.
  DecodeMetrics* metrics = nullptr;
  /// Hold the blocks of a request aborted while its KV is awaited until its transfer is over
  /// (header comment, "Late writes"). For the rma data path; off keeps the am behaviour.
  bool quarantine_late_writes = false;
  /// Blocks an admission must leave free (KvBlockManager's headroom; clamped below the pool's
  /// size). Last, so that positional initializers of the fields above keep working.
  std::int64_t kv_headroom_blocks = 0;
  /// Local prefills (DecodeRequest::local_prompt): prompt tokens one forward takes (a prefill
  /// worker's chunk_size: the same chunks give the same KV), and the prompt tokens one step()
  /// prefills before its decode batch runs (at least one prompt per step).
  std::int64_t local_prefill_chunk_size = 512;
  std::int64_t local_prefill_token_budget = 2048;
  /// Most choices one request may have (DecodeRequest::choices). 1 with tensor parallelism: the
  /// copy of a forked choice's last block is made in this rank's pool only.
  std::int64_t max_choices = pd::kMaxChoices;
  /// Decode-side prefix reuse (header comment, "Prefix cache"): most blocks the block manager's
  /// prefix cache keeps (0 = off), and the model hash its key chain starts from. Reuse comes in
  /// granules of lcm(block size, local_prefill_chunk_size) tokens (the prefill workers' chunks).
  std::int64_t prefix_cache_blocks = 0;
  std::uint64_t model_hash = 0;
  /// DecodeLoop: run computeStep on a thread of its own while the loop thread serves commands
  /// (prepareStep / computeStep / completeStep). Off: step() on the loop thread.
  bool overlap_steps = false;
};

/// The engine options a worker's typed config implies.
[[nodiscard]] DecodeEngineOptions engineOptions(const DecodeConfig& config);

/// Counters since construction (acceptance rate = drafts_accepted / drafts_proposed).
struct DecodeStats {
  std::int64_t steps = 0;
  std::int64_t tokens_generated = 0;  ///< by decode steps (first tokens from prefill excluded)
  std::int64_t drafts_proposed = 0;
  std::int64_t drafts_accepted = 0;
  std::int64_t prefill_retries = 0;  ///< prefill failures absorbed (noteKvRetry)
  std::int64_t quarantined = 0;      ///< requests whose blocks were quarantined (late-write guard)
  std::int64_t preemptions = 0;      ///< requests preempted because a step could not get a block
  std::int64_t local_prefills = 0;   ///< prompts prefilled here (DecodeRequest::local_prompt)
  std::int64_t local_prefill_tokens = 0;
  std::int64_t prefix_hit_tokens = 0;     ///< prompt tokens found in the prefix cache (not transferred)
  std::int64_t prefix_cached_blocks = 0;  ///< blocks offered to the prefix cache and taken
  /// Wall time in output constraints (masks, accepts, draft checks) during steps, all sequences.
  double grammar_seconds = 0.0;
  /// Wall time in the samplers during steps, all sequences (a constraint's mask applied included).
  double sample_seconds = 0.0;
  /// Tokens the engine sampled where it computed the logits (a SamplingEngine: the CUDA engine's
  /// device sampling), not the host samplers.
  std::int64_t engine_sampled_tokens = 0;
};

class DecodeEngine {
 public:
  /// `engine` and `pool` must outlive this object and fit each other (PD_CHECKed: same
  /// latent_dim and layer count). Unsupported (via admit) for speculation without an MTP layer.
  /// `drafter` proposes the drafts when num_speculative_tokens > 0; null: the model's own MTP
  /// layer (MtpDrafter). Only benchmarks and tests pass another.
  DecodeEngine(model::Engine& engine, KvPool& pool, DecodeEngineOptions options,
               std::unique_ptr<Drafter> drafter = nullptr);
  ~DecodeEngine();
  DecodeEngine(const DecodeEngine&) = delete;
  DecodeEngine& operator=(const DecodeEngine&) = delete;
  DecodeEngine(DecodeEngine&&) = delete;
  DecodeEngine& operator=(DecodeEngine&&) = delete;

  /// Admits a request and returns the block ids that will hold its prompt's KV.
  /// InvalidArgument (bad sizes, sampling params, duplicate id, no sink, beyond
  /// max_position_embeddings, resumed_tokens not shorter than the prompt), ResourceExhausted (the
  /// prompt alone is larger than the pool), Overloaded (not enough free blocks now),
  /// Unsupported (speculation configured on a checkpoint without MTP). Nothing is held on error.
  [[nodiscard]] Result<std::vector<std::int32_t>> admit(DecodeRequest request);
  /// Leading prompt tokens of an admitted request whose KV the prefix cache already holds (its
  /// first presentTokens() / block_size blocks are shared and must not be written); 0 for an
  /// unknown request or without reuse.
  [[nodiscard]] std::int64_t presentTokens(std::uint64_t request_id) const;

  /// The request's KV has arrived (the record) or will not (the error: the prefill failure, a
  /// transport Timeout, ...). On an error, or a record that does not match the request, the
  /// request ends with finish Error and its blocks are freed. For a request whose blocks are
  /// quarantined, any outcome frees them (ok). NotFound when no request with this id is waiting
  /// for KV (unknown, aborted and freed, or already running).
  [[nodiscard]] Status onKvReady(std::uint64_t request_id, Result<kvtransfer::CompletionRecord> record);

  /// True when request `request_id` is admitted and still waits for its KV (onKvReady would take
  /// its record).
  [[nodiscard]] bool awaitingKv(std::uint64_t request_id) const;

  /// Attaches choice `choice` (1..choices-1) of request `parent_id`, which must still wait for its
  /// KV, under the new id `child_id` with its own sink (header comment, "Choices"). NotFound when
  /// the parent is unknown or no longer waits; InvalidArgument for a choice out of range or
  /// already attached, an id in use, or no sink. The sink hears nothing before the fork.
  [[nodiscard]] Status attach(std::uint64_t parent_id, std::int64_t choice, std::uint64_t child_id,
                              TokenEventSink sink);

  /// A prefill attempt of a request waiting for KV failed and the transport has been re-armed
  /// for the next one (DecodeLoop::openStream): the request keeps its blocks. Counts it; nothing
  /// else changes. Unknown ids are ignored.
  void noteKvRetry(std::uint64_t request_id, const Error& failure);

  /// Ends a request in any state with finish Aborted and frees its blocks (an attached choice
  /// not yet forked is detached). False if unknown.
  bool abort(std::uint64_t request_id);

  /// Expires KV waits whose deadline is before `now`, frees quarantined blocks whose deadline
  /// is not after `now`, then runs one decode step over the
  /// running batch (nothing when it is empty). Errors are per request (they end those requests);
  /// the step itself does not fail. prepareStep, computeStep and completeStep in a row.
  void step(Clock::time_point now);

  /// step() in three parts, so that the owning thread can serve other calls while the model runs
  /// (DecodeLoop, docs/kv-memory.md "Overlapped steps"):
  ///  - prepareStep(now): everything before the model runs (deadlines, quarantines, local
  ///    prefills, the batch: its drafts' budget, its blocks, preemption). False when there is no
  ///    batch (then there is nothing to compute or complete).
  ///  - computeStep(): the batch's draft and verify forwards and sampling. It touches only the
  ///    batch's sequences, the drafter, the verifier, the model engine and the pool's memory, so
  ///    it may run on another thread; meanwhile the owning thread may call admit, onKvReady,
  ///    attach, noteKvRetry, abort and the read-only accessors, but not step, prepareStep or
  ///    completeStep. abort() of a request in the batch is deferred until completeStep.
  ///  - completeStep(): on the owning thread, after computeStep: counts the step, streams its
  ///    tokens (ending the requests they end; a failed step ends its whole batch), then applies
  ///    the deferred aborts.
  [[nodiscard]] bool prepareStep(Clock::time_point now);
  void computeStep();
  void completeStep();
  /// Whether a prepared step has not completed yet.
  [[nodiscard]] bool stepPending() const { return pending_ != nullptr; }

  /// The earliest kv_deadline of the requests still waiting for KV or quarantined (the loop
  /// sleeps until then).
  [[nodiscard]] std::optional<Clock::time_point> nextKvDeadline() const;
  /// True when a step() would do work (a sequence is running or ready to run).
  [[nodiscard]] bool hasWork() const { return !running_.empty() || !ready_.empty() || !local_.empty(); }
  [[nodiscard]] std::size_t numRequests() const { return requests_.size(); }
  [[nodiscard]] std::size_t numRunning() const { return running_.size(); }
  /// Ended requests whose blocks are still quarantined.
  [[nodiscard]] std::size_t numQuarantined() const { return quarantine_.size(); }
  [[nodiscard]] const KvBlockManager& blocks() const { return blocks_; }
  [[nodiscard]] const DecodeStats& stats() const { return stats_; }

 private:
  struct Sequence;
  struct Quarantined {
    Clock::time_point until;
    std::function<void()> stop_kv_wait;
  };

  void startRunning(Sequence& seq, kvtransfer::CompletionRecord record);
  // Prefills the queued local prompts (up to the step's token budget) and starts them running.
  void runLocalPrefills();
  // One local prompt: forward, first token, MTP; the record a prefill worker would have sent.
  Result<kvtransfer::CompletionRecord> localPrefill(Sequence& seq);
  // Forks every attached choice off `parent`, whose record just arrived, and starts them.
  void forkChoices(Sequence& parent, const kvtransfer::CompletionRecord& record);
  // Streams `tokens` and, if a stop condition holds, ends the request. True if it ended.
  bool emit(Sequence& seq, std::vector<model::SampledToken> tokens);
  void finish(std::uint64_t request_id, FinishReason reason, std::optional<Error> error, RequestOutcome outcome,
              bool preempted = false);
  // Ends the request admitted latest (header comment, "Preemption"); returns its id.
  std::uint64_t preemptLatest();
  // Grows `seq`'s blocks to cover `tokens` positions, preempting as needed. False when `seq`
  // itself was preempted (it is destroyed then).
  bool growOrPreempt(Sequence& seq, std::int64_t tokens);
  struct PendingStep;
  // The step's batch out of the running sequences: the drafts' budget and the blocks (oldest
  // admission first, preempting as needed).
  PendingStep planBatch(std::span<Sequence* const> all);
  // Pool and sequence gauges (options_.metrics).
  void publishGauges() const;
  // Offers a request's checked prompt blocks to the prefix cache (header comment, "Prefix cache").
  void cachePrompt(const Sequence& seq);
  // Frees a quarantined request's blocks; `cancel_wait` stops its transport expectation first.
  void endQuarantine(std::uint64_t request_id, bool cancel_wait);

  model::Engine& engine_;
  KvPool& pool_;
  DecodeEngineOptions options_;
  KvBlockManager blocks_;
  std::unique_ptr<Drafter> drafter_;
  std::unique_ptr<DraftVerifier> verifier_;
  std::unordered_map<std::uint64_t, std::unique_ptr<Sequence>> requests_;
  std::deque<std::uint64_t> local_;                            // local prompts to prefill (FIFO)
  std::deque<std::uint64_t> ready_;                            // KV arrived, waiting for a batch slot (FIFO)
  std::vector<std::uint64_t> running_;                         // in the batch, in join order
  std::unordered_map<std::uint64_t, Quarantined> quarantine_;  // ended, blocks held (late writes)
  std::uint64_t admissions_ = 0;                               // admission order of the sequences
  DecodeStats stats_;
  std::unique_ptr<PendingStep> pending_;  // between prepareStep and completeStep
};

}  // namespace pd::decode
