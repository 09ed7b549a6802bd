#pragma once
/// The P/D orchestrator: the CompletionBackend that serves a generation with one decode worker
/// and one prefill worker (DESIGN §3, docs/internal-api.md).
///
/// Per generation: pick D (the conversation's previous decode worker while it has room, else most
/// free KV blocks), open its decode stream (NDJSON) and read the KV descriptor; then pick P (by
/// router.prefill_policy, worker_policy.h) and submit the prefill with that
/// descriptor; relay D's tokens to the sink, detokenized incrementally and cut at stop strings
/// (the stream is then closed, which aborts it at D). The router always sends a seed (a random
/// one when the client gave none) and the same sampling to both legs.
///
/// Both legs are asynchronous state machines on the router's io threads (http::IoThreads, the
/// same threads as the HTTP server's when the ApiServer runs on ioThreads()): http::AsyncClient
/// calls to the workers from a per-worker pool of keep-alive connections (idle ones closed after
/// `pool_idle_age`), and one asio steady_timer per generation for the legs' deadlines. No thread
/// per request or per leg, and no watchdog thread.
///
/// Failures:
///   - a prefill attempt fails (Overloaded, PeerFailed, Timeout, Io, Corrupt, Cancelled by the
///     worker, Internal): retried on another P, up to `prefill_retries`, with the same descriptor
///     (DecodeOpen.prefill_attempts = retries + 1 so D keeps the blocks meanwhile); when no
///     attempt is left the request is aborted at D and fails with the prefill's error;
///   - D refuses (503 Overloaded, or any error other than a request that can never fit) or the
///     decode leg fails before a token reached the client: the whole request is retried on
///     another D, up to `decode_retries` (the retry's worker request id gets a "-retry<n>" suffix);
///   - the decode leg ends without a finish after a token reached the client, or D preempts the
///     request (its KV pool ran dry), dies, drains or stalls: the generation is **resumed**
///     (docs/kv-memory.md, "Resume"; src/generation_resume.h): the prompt plus the tokens relayed
///     so far are re-prefilled into a decode worker with room (preferably another), the worker
///     request id gets a "-resume<n>" suffix, and the client's stream goes on without a token
///     repeated or missing; after failures at most `max_resumes` times, then onError with the
///     leg's error (after preemptions until the deadline: they are flow control, not failures);
///   - every decode worker refuses as Overloaded (full, or draining) once `decode_retries` are
///     spent: the generation waits for room, retrying with a backoff (20 ms doubling to 500 ms)
///     until its deadline;
///   - any other decode leg failure after a token reached the client: onError.
/// Retries are counted on pdserve_router_retries_total{leg="prefill"|"decode"}, resumes on
/// pdserve_router_resumes_total{cause}, routing choices on
/// pdserve_router_routing_decisions_total{role,reason}.
///
/// Deadlines: the request's deadline caps every wait; D's descriptor must come within
/// `decode_open_timeout`, the first token within `kv_timeout` + `stream_stall_timeout`, and
/// later tokens at most `stream_stall_timeout` apart; one prefill attempt may take
/// `prefill_timeout`. A wait that runs out cancels the leg (Timeout).
///
/// abort() (the client went away, or the front end's deadline): both legs' connections are
/// cut at once, then POST /v1/internal/decode/abort and /v1/internal/prefill/cancel tell the
/// workers, and the sink gets onError(Cancelled).
///
/// Thread rules: thread-safe. start() never blocks; generations run as callbacks on the io
/// threads, and the sink is called from them (serially per generation). The registry, tokenizer
/// and metrics registry must outlive the backend, and a server sharing ioThreads() must be
/// stopped before it. The destructor (not on an io thread) aborts what still runs, waits for
/// every generation to end (their abort calls included) and stops io threads it started.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "pd/common/internal_auth.h"
#include "pd/common/io_threads.h"
#include "pd/common/metrics.h"
#include "pd/common/result.h"
#include "pd/router/completion_backend.h"
#include "pd/router/router_config.h"
#include "pd/router/worker_policy.h"
#include "pd/router/worker_registry.h"
#include "pd/tokenizer/tokenizer.h"
#include "pd/trace/tracer.h"

namespace pd::router {

struct PdBackendOptions {
  /// least_queued_tokens, round_robin, power_of_two or cache_aware (which needs the registry's
  /// prefixIndex(); worker_policy.h).
  std::string prefill_policy = "least_queued_tokens";
  CacheAwareOptions cache_aware;
  std::size_t decode_affinity_entries = 65536;  ///< conversations remembered for decode affinity
  std::int64_t prefill_retries = 1;
  std::int64_t decode_retries = 1;
  /// Resumes of a generation whose decode leg ended without a finish (generation_resume.h).
  std::int64_t max_resumes = 2;
  /// Prompts (of a leg: a resumed one counts its tokens so far) shorter than this are prefilled
  /// by the decode worker itself (DecodeOpen::local_prompt_token_ids); 0: never.
  std::int64_t remote_prefill_min_tokens = 0;
  std::chrono::milliseconds decode_open_timeout{10000};
  std::chrono::milliseconds kv_timeout{60000};  ///< DecodeOpen.kv_timeout_ms (every prefill attempt)
  std::chrono::milliseconds prefill_timeout{60000};
  std::chrono::milliseconds stream_stall_timeout{30000};
  std::chrono::milliseconds abort_timeout{2000};  ///< the abort/cancel calls
  std::int64_t max_generations = 4096;            ///< more at once: Overloaded
  int io_threads = 2;                             ///< threads of the backend's own io_context (unused with `io`)
  /// Run on these io threads (shared with the HTTP server) instead of starting its own.
  std::shared_ptr<http::IoThreads> io;
  /// A pooled keep-alive connection to a worker idle this long is closed (the workers close theirs
  /// after 60 s: a few seconds less keeps them from closing first).
  std::chrono::milliseconds pool_idle_age{55000};
  /// Signs every call to a worker (internal_auth.h); null: unsigned (an unauthenticated plane).
  std::shared_ptr<InternalAuth> auth;
  /// Records router.route and the legs' client spans under GenerationRequest::trace, whose
  /// traceparents the workers get (docs/observability.md); null: tracing off. Must outlive the backend.
  const trace::Tracer* tracer = nullptr;
};

[[nodiscard]] PdBackendOptions pdBackendOptionsFromConfig(const RouterConfig& config);

class PdBackend final : public CompletionBackend {
 public:
  /// InvalidArgument for an unknown policy name or out-of-range options.
  [[nodiscard]] static Result<std::unique_ptr<PdBackend>> create(PdBackendOptions options, WorkerRegistry& registry,
                                                                 const tokenizer::Tokenizer& tokenizer,
                                                                 metrics::Registry& metrics);
  PdBackend(const PdBackend&) = delete;
  PdBackend& operator=(const PdBackend&) = delete;
  PdBackend(PdBackend&&) = delete;
  PdBackend& operator=(PdBackend&&) = delete;
  ~PdBackend() override;

  /// Overloaded when no prefill or no decode worker is in rotation, max_generations run, or the
  /// backend is draining.
  [[nodiscard]] Result<std::unique_ptr<GenerationControl>> start(GenerationRequest request,
                                                                 std::shared_ptr<TokenSink> sink) override;
  /// n > 1: one prefill and one decode worker for every choice (the prompt's KV crosses once;
  /// choices 1..n-1 attach to choice 0's decode stream). A choice that cannot attach, and a
  /// resumed one, is served alone as n = 1 with its own seed.
  [[nodiscard]] Result<std::unique_ptr<GenerationControl>> startChoices(
      GenerationRequest request, std::vector<std::shared_ptr<TokenSink>> sinks) override;
  /// At least one prefill and one decode worker in rotation, and not draining.
  [[nodiscard]] bool ready() const override;
  /// Generations that have not ended yet (their calls to the workers, abort calls included).
  [[nodiscard]] std::int64_t running() const;
  /// The io threads the generations run on; the ApiServer serves HTTP on them too.
  [[nodiscard]] std::shared_ptr<http::IoThreads> ioThreads() const override;
  /// From now on ready() is false and start() refuses (Overloaded "draining"); running
  /// generations go on. Idempotent.
  void beginDrain();

  class Impl;

 private:
  explicit PdBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pd::router
