#pragma once
/// The prefill engine loop: a bounded queue of prefill requests and one thread that
/// owns the queue's consumer side, a local paged latent cache and the model engine. Each step
/// admits queued requests while the local cache has blocks for them, then runs one forward over
/// up to `token_budget` new tokens taken from several requests, each contributing at most
/// `chunk_size` tokens (long prompts take several steps; a chunk attends to its own tokens and
/// the earlier chunks' KV in the local cache). Every layer's latent KV goes to the request's
/// KvSink as the engine produces it. When a prompt's last chunk is done the engine samples the
/// first token (the request's SamplingParams and seed), runs the MTP layer over the prompt in
/// chunks on the main pass's grid (golden README §3.8: row i pairs token i+1 with final hidden
/// state i, every position, the last row taking the first sampled token) and puts its latent KV
/// as KV layer num_hidden_layers, then
/// calls KvSink::complete() with the first token, the last position's final hidden state and,
/// when asked, logprobs.
///
/// Prefix cache (prefix_cache_blocks > 0): when a prompt is done its full blocks stay in the
/// local cache under their token hash chain (prefix_cache.h). A later prompt that starts with
/// cached blocks, each followed by the token it was cached with, references them (shared by
/// every request using them, never evicted while referenced), puts their KV (every layer, MTP
/// included) to its sink at admission (the decode worker gets every block) and computes only the
/// rest, the MTP pass included. Admission evicts idle cached blocks, least recently used first,
/// when the free blocks do not suffice. No forward writes to a shared block.
///
/// Failures: a request past its deadline ends with Timeout and a cancel()led one with Cancelled;
/// both are checked before every step and before every layer's put (its sink gets no further
/// layers; the forward in progress still finishes, then the request is failed). A forward error
/// fails every request of that forward; a putLayer error fails its request. Each ends with
/// exactly one KvSink::fail() call, after which its local blocks are free again (a failed request's
/// blocks never enter the prefix cache).
///
/// Thread rules: submit(), cancel() and stats() are thread-safe. step() is the engine thread's
/// work; call it either from the thread start() launches or, with no thread started, from one
/// test thread. The Engine must not be used by anyone else while this object exists.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_set>
#include <vector>

#include "pd/common/result.h"
#include "pd/engine/engine.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/sampling.h"
#include "pd/prefill/kv_sink.h"
#include "pd/prefill/prefill_config.h"
#include "pd/prefill/prefix_cache.h"
#include "pd/structured/grammar.h"

namespace pd::prefill {

using Clock = std::chrono::steady_clock;

struct PrefillRequest {
  std::uint64_t id = 0;
  std::vector<std::int32_t> tokens;  ///< the prompt; at least one token
  pd::SamplingParams sampling;
  /// A resumed generation: its last resumed_tokens tokens were produced by it (fewer than
  /// tokens.size()); the sampler resumes after them (model::Sampler::resumeAfter).
  std::int64_t resumed_tokens = 0;
  /// A resumed generation's next token, already known: sent as the first token instead of the
  /// sampled one (within the vocabulary). -1: sample it.
  std::int32_t forced_first_token = -1;
  bool logprobs = false;  ///< fill first_logprob (and top_logprobs per sampling)
  /// Choices (OpenAI `n`, 1..pd::kMaxChoices): the record carries choices - 1 more first tokens
  /// (CompletionRecord::choice_tokens), each sampled from the same last-position logits with a
  /// sampler seeded pd::choiceSeed(sampling.seed, i). Not with a forced first token.
  std::int64_t choices = 1;
  /// The output constraint: the first token is sampled under the grammar's initial mask (its
  /// vocabulary must cover the model's, PD_CHECKed by the sampler). Null: free text.
  std::shared_ptr<const structured::Grammar> grammar;
  Clock::time_point deadline = Clock::time_point::max();
  std::unique_ptr<KvSink> sink;  ///< where the KV and the outcome go; required
};

struct PrefillEngineOptions {
  std::int64_t chunk_size = 512;           ///< most new tokens of one request per forward
  std::int64_t token_budget = 2048;        ///< most new tokens per forward, all requests together
  std::int64_t max_queued_requests = 256;  ///< submit() answers Overloaded beyond this
  std::int64_t cache_blocks = 64;          ///< local latent cache size, in blocks
  std::int64_t block_size = 64;            ///< tokens per local cache block
  DType cache_dtype = DType::F32;          ///< local cache element type: F32 or BF16
  /// Prefix cache (prefix_cache.h): most local blocks kept for reuse after their prompt is done;
  /// 0 turns it off. At most cache_blocks. A prompt reuses its cached prefix in whole granules of
  /// lcm(block_size, min(chunk_size, token_budget)) tokens, so that its remaining chunks start
  /// where a cold prefill's would: a request prefilled alone gets bit-equal KV, hidden state and
  /// first token with the cache on or off.
  std::int64_t prefix_cache_blocks = 0;
  std::uint64_t model_hash = 0;  ///< the root of the prefix cache's hash chain
  /// Where the prefix cache reports blocks stored and removed (kv_event_log.h); null: nowhere.
  /// Must outlive the engine.
  KvEventLog* kv_events = nullptr;
  /// The clock deadlines are checked against (a fake in tests).
  std::function<Clock::time_point()> now = [] { return Clock::now(); };
};

/// The engine options a validated PrefillConfig asks for (real clock).
[[nodiscard]] PrefillEngineOptions engineOptions(const PrefillConfig& config);

struct PrefillEngineStats {
  std::int64_t queued_requests = 0;
  std::int64_t queued_tokens = 0;
  std::int64_t running_requests = 0;
  std::int64_t completed = 0;
  std::int64_t failed = 0;
  std::int64_t free_blocks = 0;         ///< blocks admission can use: free plus idle prefix-cache blocks
  std::int64_t prompt_tokens = 0;       ///< prompt tokens run through the main model, all requests
  double compute_seconds = 0.0;         ///< wall time inside forward() and forwardMtp()
  std::int64_t prefix_hit_tokens = 0;   ///< prompt tokens whose KV came from the prefix cache
  std::int64_t prefix_miss_tokens = 0;  ///< prompt tokens computed (prefix cache on)
  std::int64_t prefix_cached_blocks = 0;
  std::int64_t prefix_evictions = 0;
};

class PrefillEngine {
 public:
  /// InvalidArgument for non-positive sizes; ResourceExhausted when the local cache cannot be
  /// allocated. `engine` must outlive the PrefillEngine.
  static Result<std::unique_ptr<PrefillEngine>> create(model::Engine& engine, PrefillEngineOptions options);
  /// Stops the thread (if started) and fails every request still held with Cancelled.
  ~PrefillEngine();
  PrefillEngine(const PrefillEngine&) = delete;
  PrefillEngine& operator=(const PrefillEngine&) = delete;
  PrefillEngine(PrefillEngine&&) = delete;
  PrefillEngine& operator=(PrefillEngine&&) = delete;

  /// Queues a request. InvalidArgument (empty prompt, token out of range, prompt beyond
  /// max_position_embeddings, bad sampling params, missing sink, duplicate id), ResourceExhausted
  /// (the prompt can never fit the local cache), Overloaded (queue full). On error the sink is
  /// dropped without being called. Thread-safe.
  [[nodiscard]] Status submit(PrefillRequest request);
  /// Asks to end request `id` with Cancelled before the next step. False when the engine holds no
  /// such request. Thread-safe.
  bool cancel(std::uint64_t id);
  /// Thread-safe snapshot.
  [[nodiscard]] PrefillEngineStats stats() const;
  /// Where the local latent cache lives: "host", or "cuda:N" (the CUDA engine's own memory).
  [[nodiscard]] std::string cacheLocation() const { return cache_->location(); }

  /// One step: expire deadlines, apply cancels, admit, one forward (and the MTP of prompts that
  /// finished). Returns false when there was nothing to do. Engine thread only.
  bool step();
  /// Launches the engine thread, which steps while there is work and sleeps otherwise. Call once.
  void start();
  /// Stops and joins the engine thread; requests stay held until destruction. Idempotent.
  void stop();

 private:
  struct Running;
  PrefillEngine(model::Engine& engine, PrefillEngineOptions options, std::unique_ptr<model::CacheMemory> cache);
  void failRunning(Running& r, const Error& reason);
  void finishPrompt(std::vector<Running*>& done);
  void release(Running& r, bool completed = false);
  // Ships the cached prefix's main-layer KV to r's sink (at admission). False when r failed.
  bool shipCachedPrefix(Running& r);
  void updateCacheStats();  // engine thread; takes mutex_
  // Why `r` must stop now (deadline passed, cancel asked), checked before each layer's put.
  [[nodiscard]] std::optional<Error> stopReason(const Running& r) const;
  void loop();

  model::Engine& engine_;
  const PrefillEngineOptions options_;
  std::unique_ptr<model::CacheMemory> cache_;  // the engine's memory (Engine::allocateCache): GPU memory on CUDA

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<PrefillRequest> queue_;            // guarded by mutex_
  std::unordered_set<std::uint64_t> held_ids_;  // guarded by mutex_: queued or running
  std::unordered_set<std::uint64_t> cancels_;   // guarded by mutex_
  PrefillEngineStats stats_;                    // guarded by mutex_
  bool stopping_ = false;                       // guarded by mutex_

  // Engine thread only.
  std::vector<std::unique_ptr<Running>> running_;
  std::vector<std::int32_t> free_blocks_;
  std::optional<PrefixCache> prefix_;  // engaged when prefix_cache_blocks > 0
  std::int64_t reuse_granule_ = 0;     // lcm(block_size, min(chunk_size, token_budget)), in tokens

  std::thread thread_;  // last: joined before the state above goes
};

}  // namespace pd::prefill
