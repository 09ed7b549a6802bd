#pragma once
/// The decode worker process's core (docs/internal-api.md): the model engine, the latent
/// KV pool registered with a UCX transport, the engine loop, and the internal HTTP API:
///
///   POST /v1/internal/decode        DecodeOpen -> 200 chunked NDJSON DecodeEvent lines
///                                   (descriptor, tokens..., finish | error), or an error status
///   POST /v1/internal/decode/abort  {"request_id"} -> {"found": bool}
///   GET  /health, /ready, /metrics, /v1/internal/status
///
/// Readiness: /ready answers 503 with the reason (and the status says ready false) while the
/// worker drains, once its tensor-parallel group is broken, and while its pool cannot admit a
/// minimal request (1 prompt token: one block available to admission, i.e. free minus the
/// admission headroom, decode.kv_headroom_blocks). It is 200 again as soon as a block is.
///
/// A stream's lifetime is its request's: a client that goes away aborts the request (its blocks
/// are freed), and the request's end ends the stream. The router's string id maps to a fresh
/// transfer id (the descriptor's request_id), never reused within the process.
///
/// Deadlines: a request waits for its KV min(kv_timeout_ms, decode.kv_wait_timeout_ms), plus
/// kvtransfer.receive_grace_ms when this worker's data path resolves to rma (docs/kv-transfer.md:
/// a late sender must have stopped writing before the blocks are reused; with am the transport
/// drops late bytes itself). The descriptor carries the un-graced budget as timeout_ms. On rma the
/// blocks of a request aborted while its KV is awaited are quarantined until that deadline or the
/// transfer's record (decode_engine.h, "Late writes"); /v1/internal/status reports them as
/// `quarantined_blocks`, not in `free_blocks`.
///
/// Thread rules: start(), stop() and the destructor from one controlling thread (not an HTTP io
/// thread, not the loop thread); the accessors are thread-safe. HTTP handlers never wait for the
/// engine loop: opens are answered from the loop thread when admission is decided.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "pd/common/internal_auth.h"
#include "pd/common/metrics.h"
#include "pd/common/result.h"
#include "pd/common/worker_api.h"
#include "pd/decode/decode_config.h"
#include "pd/engine/engine.h"
#include "pd/engine/tp_engine.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/kvtransfer/transport.h"
#include "pd/structured/worker_grammars.h"
#include "pd/trace/trace_config.h"

namespace pd::decode {

struct DecodeServerOptions {
  DecodeConfig decode;
  kvtransfer::KvTransferConfig kvtransfer;
  /// Identifies the checkpoint; prefill and decode of one deployment must agree (CompatInfo).
  std::uint64_t model_hash = 0;
  /// Tensor parallelism (docs/tensor-parallel.md): the engine passed to start(), seen as the
  /// group's leader, or null for tensor_parallel 1. When set, decode.tensor_parallel must equal
  /// its group size; start() exchanges KV targets with the followers (a collective: they must be
  /// in TpFollowerWorker::start), descriptors list every rank's target, every open relays its KV
  /// expectation to the followers, and /ready answers 503 once the group is broken.
  model::TpLeaderEngine* tp_leader = nullptr;
  /// The cluster secret's verifier (internal_auth.h): internal calls without a valid signature get
  /// 401, and each descriptor handed out carries a tag the prefill worker checks. Null: an
  /// unauthenticated plane (a warning is logged at start).
  std::shared_ptr<InternalAuth> auth;
  /// Tracing (docs/observability.md): each open is a decode.request span continuing the open's
  /// traceparent, with children decode.admission, decode.kv_wait, decode.first_step and
  /// decode.steps (the later steps together), recorded when the stream ends.
  trace::TraceConfig trace;
  /// Output constraints (worker_api::DecodeOpen::constraint) compile against this vocabulary.
  /// Null: an open that carries a constraint is refused with Unsupported.
  std::shared_ptr<const structured::WorkerGrammars> grammars;
};

class DecodeServer {
 public:
  /// Builds the pool for `engine`'s model, the UCX transport (pool registered, target exported),
  /// the loop and the HTTP server, which listens on decode.host:decode.port when this returns.
  /// Errors: InvalidArgument (tensor_parallel does not match options.tp_leader), Unsupported
  /// (speculation on a checkpoint without MTP), the KV target exchange's (PeerFailed, Timeout),
  /// ResourceExhausted (the pool does not fit in memory), the transport's and the server's.
  [[nodiscard]] static Result<std::unique_ptr<DecodeServer>> start(std::unique_ptr<model::Engine> engine,
                                                                   DecodeServerOptions options);
  /// stop(0) if stop() was not called.
  ~DecodeServer();
  DecodeServer(const DecodeServer&) = delete;
  DecodeServer& operator=(const DecodeServer&) = delete;
  DecodeServer(DecodeServer&&) = delete;
  DecodeServer& operator=(DecodeServer&&) = delete;

  [[nodiscard]] std::uint16_t port() const;
  /// "http://host:port".
  [[nodiscard]] std::string url() const;

  /// From now on /ready answers 503 and opens are refused with 503 Overloaded ("draining");
  /// streams already open go on. Idempotent.
  void beginDrain();
  [[nodiscard]] bool draining() const;
  /// Streams open now (admitted or being admitted, not yet ended).
  [[nodiscard]] std::size_t openStreams() const;
  /// Waits until no stream is open; false when `timeout` passed first.
  bool waitIdle(std::chrono::milliseconds timeout) const;
  /// Graceful stop: beginDrain(), lets open streams finish for up to `drain`, aborts the rest
  /// (each ends with an error line, its blocks freed, its KV expectation cancelled), then stops
  /// the HTTP server, the loop and the transport. Idempotent; blocks.
  void stop(std::chrono::milliseconds drain);

  /// What GET /v1/internal/status answers.
  [[nodiscard]] worker_api::WorkerStatus status() const;
  /// The registry /metrics renders (decode and transport series).
  [[nodiscard]] metrics::Registry& registry();
  /// The transport's counters (tests read pending receives from it).
  [[nodiscard]] kvtransfer::TransportStats transportStats() const;

 private:
  class Impl;
  explicit DecodeServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pd::decode
