#pragma once
/// The prefill worker process's serving core (docs/internal-api.md, prefill side): the
/// model engine, the PrefillEngine loop thread, the UCX transports its KV leaves through, and the
/// internal HTTP API:
///
///   POST /v1/internal/prefill         PrefillSubmit -> 200 PrefillOutcome, or an error body
///   POST /v1/internal/prefill/cancel  {"request_id"} -> {"found": bool}
///   GET  /health, /ready, /metrics, /v1/internal/status (WorkerStatus)
///
/// Traces (docs/observability.md): a submission is a `prefill.request` span continuing the
/// submit's traceparent, with children prefill.queue, prefill.compute (prefill.chunk /
/// prefill.mtp per forward, prefill.layers per layer group) and prefill.completion, recorded when
/// the submission is answered.
///
/// Readiness: /ready answers 503 with the reason (and the status says ready false) while the
/// worker drains, once its tensor-parallel group is broken, and while the engine's queue holds
/// prefill.max_queued_requests prompts (the next submission would be refused Overloaded).
///
/// A submission is answered only when its transfer has ended (the transport's done callback):
/// 200 once the completion record reached the decode worker, otherwise the first reason the
/// request failed (a refused submit, the engine's Timeout / Cancelled / compute error, the
/// transport's PeerFailed / Timeout). So when the router sees the answer, no put of that attempt
/// is in flight. Closing the submission's connection cancels it like the cancel endpoint.
///
/// Router ids (strings) map to fresh engine ids (uint64). KV layouts: the prefill side adapts to
/// whatever layout a decode worker's descriptor names (cache dtype, block size, tensor-parallel
/// ranks) and requires only what must agree — protocol version, model hash, KV layers and latent
/// width; one transport per distinct layout is created on first use (at most kMaxKvLayouts).
///
/// Thread rules: start() and the lifecycle calls (beginDrain, waitIdle, stop, destruction) from
/// one control thread that is none of the server's; handlers run on HTTP io threads, done
/// callbacks on transport progress threads; port(), url(), stats() and metrics() are thread-safe.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "pd/common/internal_auth.h"
#include "pd/common/metrics.h"
#include "pd/common/result.h"
#include "pd/engine/engine.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/prefill/prefill_config.h"
#include "pd/structured/worker_grammars.h"
#include "pd/trace/trace_config.h"

namespace pd::prefill {

/// Distinct decode KV layouts (dtype, block size, TP) one prefill worker serves at once.
inline constexpr std::size_t kMaxKvLayouts = 4;

struct PrefillServerOptions {
  PrefillConfig prefill;  ///< host, port, engine sizes, request_timeout_ms, io_threads
  kvtransfer::KvTransferConfig kvtransfer;
  std::uint64_t model_hash = 0;  ///< modelHash() of the checkpoint the engine runs
  /// Optional: true once the engine can no longer serve (a tensor-parallel group lost a rank):
  /// /ready answers 503 and the status says not ready. Called from io threads; must not block.
  std::function<bool()> broken;
  /// The cluster secret's verifier (internal_auth.h): internal calls without a valid signature get
  /// 401, and a KV descriptor must carry its decode worker's tag. Null: an unauthenticated plane
  /// (a warning is logged at start).
  std::shared_ptr<InternalAuth> auth;
  /// Tracing (docs/observability.md): each submission's spans continue its `traceparent`.
  trace::TraceConfig trace;
  /// Output constraints (worker_api::PrefillSubmit::constraint) compile against this vocabulary.
  /// Null: a submission that carries a constraint is refused with Unsupported.
  std::shared_ptr<const structured::WorkerGrammars> grammars;
};

/// What the server holds right now (tests and the status endpoint).
struct PrefillServerStats {
  std::int64_t submissions = 0;  ///< answered-or-not submissions held (queued, computing, transferring)
  std::int64_t queued_requests = 0;
  std::int64_t queued_tokens = 0;
  /// Computing or finishing the transfer: submissions held and not queued, or requests the engine
  /// still computes (one whose transfer failed stops at its next layer), whichever is more.
  std::int64_t running_requests = 0;
  std::int64_t transfers_in_flight = 0;  ///< over every transport
  std::int64_t registered_regions = 0;   ///< over every transport (staging buffers)
  std::int64_t kv_layouts = 0;           ///< transports created
};

class PrefillServer {
 public:
  /// Starts the engine thread and the HTTP server (listening when this returns). Errors:
  /// InvalidArgument (engine sizes), Io (cannot bind). `engine` is owned from here on.
  [[nodiscard]] static Result<std::unique_ptr<PrefillServer>> start(std::unique_ptr<model::Engine> engine,
                                                                    PrefillServerOptions options);
  /// stop() if it was not called.
  ~PrefillServer();
  PrefillServer(const PrefillServer&) = delete;
  PrefillServer& operator=(const PrefillServer&) = delete;
  PrefillServer(PrefillServer&&) = delete;
  PrefillServer& operator=(PrefillServer&&) = delete;

  [[nodiscard]] std::uint16_t port() const;
  /// "http://host:port" with the bound port.
  [[nodiscard]] std::string url() const;

  /// /ready answers 503 from now on and new submissions are refused with 503 Overloaded
  /// ("draining"); what is in flight continues. Idempotent.
  void beginDrain();
  /// Blocks until no submission is held or `timeout` passed; true when idle.
  bool waitIdle(std::chrono::milliseconds timeout);
  /// Cancels everything still held (failure records go to the decode workers, puts are aborted),
  /// waits for every transfer to end and its answer to go out, then stops the HTTP server, the
  /// engine thread and the transports. Idempotent.
  void stop();

  [[nodiscard]] PrefillServerStats stats() const;
  [[nodiscard]] metrics::Registry& metrics();

  class Impl;

 private:
  explicit PrefillServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pd::prefill
