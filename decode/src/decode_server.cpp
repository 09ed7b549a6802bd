#include "pd/decode/decode_server.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "pd/common/crypto.h"
#include "pd/common/http_server.h"
#include "pd/common/log.h"
#include "pd/common/probe_routes.h"
#include "pd/decode/decode_loop.h"
#include "pd/decode/decode_metrics.h"
#include "pd/decode/kv_pool.h"
#include "pd/decode/tp_worker.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/kvtransfer/ucx_transport.h"
#include "pd/trace/tracer.h"

namespace pd::decode {
namespace {

constexpr std::string_view kJson = "application/json";
constexpr std::string_view kNdjson = "application/x-ndjson";

http::Response jsonResponse(int status, std::string body) {
  return http::Response::withBody(status, std::string(kJson), std::move(body));
}

http::Response errorResponse(const Error& error) {
  return jsonResponse(worker_api::httpStatusFor(error.code), worker_api::errorJson(error));
}

// Errors the HTTP server answers itself (404, 405, 413, ...) in the internal API's error shape.
http::Response serverError(int status, std::string_view message) {
  return jsonResponse(
      status, worker_api::errorJson(makeError(worker_api::errorCodeForHttpStatus(status), std::string(message))));
}

worker_api::DecodeEvent tokensEvent(const TokenEvent& e, bool logprobs) {
  worker_api::DecodeEvent ev;
  ev.type = worker_api::DecodeEventType::Tokens;
  for (const model::SampledToken& t : e.tokens) {
    ev.token_ids.push_back(t.token);
    if (logprobs) ev.logprobs.push_back(t);
  }
  return ev;
}

worker_api::DecodeEvent lastEvent(const TokenEvent& e) {
  worker_api::DecodeEvent ev;
  if (*e.finish == FinishReason::Stop || *e.finish == FinishReason::Length) {
    ev.type = worker_api::DecodeEventType::Finish;
    ev.finish_reason = *e.finish;
    ev.prompt_tokens = e.prompt_tokens;
    ev.completion_tokens = e.completion_tokens;
    return ev;
  }
  if (e.preempted) {
    ev.type = worker_api::DecodeEventType::Preempted;
    ev.message = e.error ? e.error->message : "preempted";
    ev.completion_tokens = e.completion_tokens;
    return ev;
  }
  ev.type = worker_api::DecodeEventType::Error;
  if (e.error) {
    ev.code = e.error->code;
    ev.message = e.error->message;
  } else {
    ev.code = *e.finish == FinishReason::Aborted ? ErrorCode::Cancelled : ErrorCode::Internal;
    ev.message = fmt::format("request ended: {}", finishReasonName(*e.finish));
  }
  return ev;
}

}  // namespace

// Everything the server holds; DecodeServer forwards to it.
class DecodeServer::Impl {
 public:
  Impl(std::unique_ptr<model::Engine> engine, DecodeServerOptions options);
  ~Impl();
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  Impl(Impl&&) = delete;
  Impl& operator=(Impl&&) = delete;

  [[nodiscard]] Status startParts();
  [[nodiscard]] std::uint16_t port() const;
  [[nodiscard]] std::string url() const;
  void beginDrain();
  [[nodiscard]] bool draining() const { return draining_.load(); }
  [[nodiscard]] std::size_t openStreams() const;
  bool waitIdle(std::chrono::milliseconds timeout) const;
  void stop(std::chrono::milliseconds drain);
  [[nodiscard]] worker_api::WorkerStatus status() const;
  [[nodiscard]] metrics::Registry& registry() { return registry_; }
  [[nodiscard]] kvtransfer::TransportStats transportStats() const;

 private:
  // One open decode stream: its reply channel and what its events need.
  struct Stream {
    std::string request_id;
    std::uint64_t local_id = 0;  // DecodeRequest::id; never on the wire
    http::Exchange exchange;
    bool logprobs = false;
    // Tracing: decode.request, and what its children need (written on the loop thread once the
    // open is handed to the loop).
    trace::Span span;
    std::int64_t prompt_tokens = 0;
    trace::TimePoint opened;
    trace::TimePoint admitted;
    trace::TimePoint first_event;   // the first token (the prefill worker's) arrived
    trace::TimePoint second_event;  // the first decode step's tokens
    std::int64_t token_events = 0;
    std::int64_t early_tokens = 0;  // tokens of the first two events
  };
  // The stream's spans at its last event `e` (loop thread).
  void recordSpans(Stream& stream, const TokenEvent& e);
  // decode.kv_record (loop thread): a child of the prefill worker's completion span named by the
  // record's `traceparent`, from `start` (its first token handed to the stream) to now, linked
  // to the stream's decode.request.
  void recordKvRecord(const Stream& stream, std::string_view traceparent, trace::TimePoint start);

  void handleOpen(const http::Request& request, http::Exchange exchange);
  // An attached choice's open (DecodeOpen::attach_to): a stream of its own over its parent's KV.
  void handleAttach(worker_api::DecodeOpen open, const std::shared_ptr<Stream>& stream);
  // The sink that writes `stream`'s token and last lines (loop thread).
  TokenEventSink streamSink(const std::shared_ptr<Stream>& stream);
  void handleAbort(const http::Request& request, http::Exchange exchange);
  // Answers `error` with its status and counts the refusal.
  void refuse(http::Exchange& exchange, const Error& error);
  // Called on the loop thread with the request's final event: forgets the stream.
  void streamEnded(const std::string& request_id);
  // Why /ready answers 503 now (draining, a broken TP group, a pool that cannot admit a minimal
  // request), or empty while the worker takes work. Thread-safe: reads atomics and gauges.
  [[nodiscard]] std::string notReadyReason() const;
  // The tensor-parallel group is broken (never for tensor_parallel 1).
  [[nodiscard]] bool tpBroken() const { return options_.tp_leader != nullptr && options_.tp_leader->broken(); }

  DecodeServerOptions options_;
  metrics::Registry registry_;  // first: everything below publishes into it
  DecodeMetrics metrics_;
  std::unique_ptr<trace::Tracer> tracer_;  // before everything that holds spans (the loop's sinks)
  std::unique_ptr<model::Engine> engine_;
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<kvtransfer::Transport> transport_;
  kvtransfer::RegionId region_ = 0;
  bool region_registered_ = false;
  kvtransfer::CompatInfo compat_;
  std::vector<kvtransfer::KvTarget> targets_;
  std::chrono::milliseconds receive_grace_{0};
  kvtransfer::KvTransferPath kv_path_ = kvtransfer::KvTransferPath::Direct;
  std::unique_ptr<DecodeLoop> loop_;  // after the transport and pool: destroyed before them

  mutable std::mutex mutex_;
  mutable std::condition_variable idle_;
  std::map<std::string, std::shared_ptr<Stream>> streams_;  // guarded by mutex_: by router id
  std::atomic<bool> draining_{false};
  // A dense handle for each request inside this process (the loop, the block manager, the TP
  // relay): never on the wire, so a counter. What crosses the network is the 128-bit random
  // transfer id that the transport's grant binds to it (docs/security.md, "Ids").
  std::uint64_t newLocalId() { return next_local_id_.fetch_add(1) + 1; }
  std::atomic<std::uint64_t> next_local_id_{0};
  bool stopped_ = false;  // controlling thread only

  std::unique_ptr<http::Server> http_;  // last: its handlers use everything above
};

DecodeServer::Impl::Impl(std::unique_ptr<model::Engine> engine, DecodeServerOptions options)
    : options_(std::move(options)), metrics_(registry_), engine_(std::move(engine)) {}

Result<std::unique_ptr<DecodeServer>> DecodeServer::start(std::unique_ptr<model::Engine> engine,
                                                          DecodeServerOptions options) {
  PD_CHECK(engine != nullptr);
  auto impl = std::make_unique<Impl>(std::move(engine), std::move(options));
  PD_TRY(impl->startParts());
  return std::unique_ptr<DecodeServer>(new DecodeServer(std::move(impl)));
}

Status DecodeServer::Impl::startParts() {
  PD_ASSIGN_OR_RETURN(tracer_, trace::Tracer::create(options_.trace, "pdserve-decode", &registry_));
  const DecodeConfig& cfg = options_.decode;
  model::TpLeaderEngine* const tp = options_.tp_leader;
  const std::int64_t group_size = tp != nullptr ? tp->comm().size() : 1;
  if (cfg.tensor_parallel != group_size) {
    return makeError(
        ErrorCode::InvalidArgument,
        fmt::format("decode.tensor_parallel {} but the engine runs on {} rank(s)", cfg.tensor_parallel, group_size));
  }
  if (cfg.num_speculative_tokens > 0 && !engine_->capabilities().mtp) {
    return makeError(ErrorCode::Unsupported,
                     fmt::format("decode.num_speculative_tokens {} needs a checkpoint with an MTP layer; set it to 0",
                                 cfg.num_speculative_tokens));
  }
  // The pool in the memory the engine reads best: the CUDA engine's GPU memory (the device KV pool:
  // KV lands there through the staging transport's device copier, no host copy) or host memory.
  // With decode tensor parallelism every rank's pool is its own engine's (TpLeaderEngine passes
  // the call to rank 0's shard; TpFollowerWorker::start for the others), and each rank's staging
  // transport grants staging blocks of its own (KvTarget::block_ids).
  PD_ASSIGN_OR_RETURN(std::unique_ptr<model::CacheMemory> memory,
                      engine_->allocateCache(poolBlocks(cfg), cfg.block_size, poolDtype(cfg)));
  PD_ASSIGN_OR_RETURN(KvPool pool, KvPool::create(std::move(memory)));
  pool_ = std::make_unique<KvPool>(std::move(pool));
  log::info("decode", "KV pool: {} blocks x {} tokens, {}, in {} memory ({})", pool_->numBlocks(), pool_->blockSize(),
            kvDTypeName(pool_->dtype()), pool_->onDevice() ? "GPU" : "host", pool_->location());
  compat_ = pool_->compat(options_.model_hash, static_cast<std::uint32_t>(group_size));

  kvtransfer::UcxTransportOptions tx = kvtransfer::ucxOptionsFromConfig(options_.kvtransfer, compat_);
  tx.metrics = &registry_;
  tx.name = "decode-kv";
  tx.auth = options_.auth;  // records must be signed with the cluster secret
  kvtransfer::inheritLoopbackHost(tx, options_.decode.host);
  const bool rma = kvtransfer::resolveKvDataPath(tx.data_path, tx.ucx_tls) == kvtransfer::KvDataPath::Rma;
  if (rma) receive_grace_ = std::chrono::milliseconds(options_.kvtransfer.receive_grace_ms);
  // A host pool: `auto` resolves to direct, `staging` stages anyway. A GPU pool: direct only where
  // UCX registers GPU memory, staging through pinned buffers and the CUDA copier otherwise.
  PD_ASSIGN_OR_RETURN(kvtransfer::KvTransport kv,
                      kvtransfer::createKvTransport(options_.kvtransfer, tx, kvtransfer::KvTransportUse::Receive,
                                                    pool_->onDevice(), pool_->view().device));
  transport_ = std::move(kv.transport);
  kv_path_ = kv.path;
  PD_ASSIGN_OR_RETURN(region_, transport_->registerRegion(pool_->memory()));
  region_registered_ = true;
  const kvtransfer::RegionLayout layout = pool_->regionLayout(region_);
  PD_ASSIGN_OR_RETURN(kvtransfer::KvTarget target,
                      transport_->exportTarget(0, std::span<const kvtransfer::RegionLayout>(&layout, 1)));
  if (tp != nullptr) {
    // Every rank's target, in rank order (the followers are in TpFollowerWorker::start).
    PD_ASSIGN_OR_RETURN(targets_, exchangeKvTargets(tp->comm(), std::move(target)));
  } else {
    targets_.push_back(std::move(target));
  }

  DecodeEngineOptions engine_options = engineOptions(cfg);
  engine_options.metrics = &metrics_;
  // am drops late bytes in the transport; the staging path writes the pool only before a record is
  // honoured (late bytes land in its own quarantined staging blocks).
  engine_options.quarantine_late_writes = rma && kv_path_ == kvtransfer::KvTransferPath::Direct;
  loop_ = std::make_unique<DecodeLoop>(*engine_, *pool_, engine_options, tp);

  http::ServerOptions http_options;
  http_options.host = cfg.host;
  http_options.port = static_cast<std::uint16_t>(cfg.port);
  http_options.io_threads = static_cast<int>(cfg.http_threads);
  http_options.max_body_bytes = 1 << 20;
  http_options.server_name = "pdserve-decode";
  http_options.error_responder = serverError;
  std::vector<http::Route> routes;
  http::Probes probes;
  probes.not_ready = [this] { return notReadyReason(); };
  probes.metrics = [this] { return registry_.render(); };
  probes.status = [this] { return worker_api::toJson(status()); };
  http::addProbeRoutes(routes, std::move(probes));
  routes.push_back({"POST", std::string(worker_api::kDecodeOpenPath),
                    [this](const http::Request& req, http::Exchange ex) { handleOpen(req, std::move(ex)); }});
  routes.push_back({"POST", std::string(worker_api::kDecodeAbortPath),
                    [this](const http::Request& req, http::Exchange ex) { handleAbort(req, std::move(ex)); }});
  if (!options_.auth) log::warn("decode", "no cluster secret: the internal API is unauthenticated (docs/security.md)");
  routes = requireInternalAuth(std::move(routes), options_.auth, &registry_);
  PD_ASSIGN_OR_RETURN(http_, http::Server::start(std::move(http_options), std::move(routes)));
  log::info("decode", "serving on {} ({} KV blocks of {} tokens, {}, MTP k={}, TP {}, transport {})", url(),
            poolBlocks(cfg), cfg.block_size, cfg.kv_dtype, cfg.num_speculative_tokens, group_size,
            transport_->capabilities().name);
  return okStatus();
}

DecodeServer::Impl::~Impl() {
  stop(std::chrono::milliseconds(0));
}

std::uint16_t DecodeServer::Impl::port() const {
  return http_ ? http_->port() : 0;
}

std::string DecodeServer::Impl::url() const {
  return fmt::format("http://{}:{}", options_.decode.host, port());
}

void DecodeServer::Impl::refuse(http::Exchange& exchange, const Error& error) {
  metrics_.refused(error.code);
  exchange.respond(errorResponse(error));
}

void DecodeServer::Impl::handleOpen(const http::Request& request, http::Exchange exchange) {
  if (draining_.load()) {
    refuse(exchange, makeError(ErrorCode::Overloaded, "the decode worker is draining"));
    return;
  }
  Result<worker_api::DecodeOpen> parsed = worker_api::parseDecodeOpen(request.body);
  if (!parsed.ok()) {
    refuse(exchange, parsed.error());
    return;
  }
  worker_api::DecodeOpen& open = *parsed;
  auto grammar = structured::requestGrammar(options_.grammars.get(), open.constraint, open.tool_call_format);
  if (!grammar.ok()) {
    refuse(exchange, grammar.error());
    return;
  }
  if (*grammar && open.ignore_eos) {
    refuse(exchange, makeError(ErrorCode::InvalidArgument, "ignore_eos cannot be combined with a constraint"));
    return;
  }
  auto stream = std::make_shared<Stream>(Stream{open.request_id, newLocalId(), exchange, open.logprobs});
  stream->opened = trace::Clock::now();
  stream->span = tracer_->startFromHeader("decode.request", open.traceparent, trace::SpanKind::Server, stream->opened);
  stream->prompt_tokens = open.prompt_tokens;
  {
    std::lock_guard lock(mutex_);
    if (streams_.contains(open.request_id)) {
      refuse(exchange,
             makeError(ErrorCode::InvalidArgument, fmt::format("request {} is already open here", open.request_id)));
      return;
    }
    streams_.emplace(open.request_id, stream);
  }
  if (!open.attach_to.empty()) return handleAttach(std::move(open), stream);

  const std::int64_t kv_timeout_ms = std::min(open.kv_timeout_ms, options_.decode.kv_wait_timeout_ms);
  DecodeRequest r;
  r.id = stream->local_id;
  r.prompt_tokens = open.prompt_tokens;
  r.max_tokens = open.max_tokens;
  r.sampling = open.sampling;
  r.stop_token_ids = std::move(open.stop_token_ids);
  r.resumed_tokens = std::move(open.resumed_token_ids);
  r.arrival_us = open.arrival_us;
  r.ignore_eos = open.ignore_eos;
  r.logprobs = open.logprobs;
  r.kv_deadline = Clock::now() + std::chrono::milliseconds(kv_timeout_ms) + receive_grace_;
  r.prefill_attempts = open.prefill_attempts;
  r.grammar = std::move(grammar).value();
  r.choices = open.choices;
  r.prompt_token_ids = std::move(open.prompt_token_ids);
  r.sink = streamSink(stream);

  DecodeLoop* loop = loop_.get();
  if (!open.local_prompt_token_ids.empty()) {
    // Conditional disaggregation: this worker prefills the prompt itself; no KV is awaited.
    if (options_.decode.tensor_parallel > 1) {
      // A local prefill runs over a scratch cache of the leader's alone, which the followers'
      // forwards cannot follow (it would break the group): a TP worker takes remote KV only.
      stream->span.end();
      refuse(exchange, makeError(ErrorCode::Unsupported,
                                 "a decode worker with decode.tensor_parallel > 1 does not prefill locally: keep "
                                 "router.remote_prefill_min_tokens at 0 for it"));
      streamEnded(open.request_id);
      return;
    }
    if (open.prompt_tokens > options_.decode.local_prefill_max_tokens) {
      stream->span.end();
      refuse(exchange,
             makeError(ErrorCode::InvalidArgument,
                       fmt::format("a local prefill of {} tokens exceeds decode.local_prefill_max_tokens ({})",
                                   open.prompt_tokens, options_.decode.local_prefill_max_tokens)));
      streamEnded(open.request_id);
      return;
    }
    r.local_prompt = std::move(open.local_prompt_token_ids);
    r.prompt_token_ids.clear();  // a local prompt brings its ids in local_prompt
    r.forced_first_token = open.forced_first_token;
    r.kv_deadline = Clock::time_point::max();
    loop_->openLocalAsync(std::move(r), [this, stream, loop](const Status& admitted) {
      stream->admitted = trace::Clock::now();
      if (!admitted.ok()) {
        stream->span.setError(admitted.error().toString());
        stream->span.end();
        refuse(stream->exchange, admitted.error());
        streamEnded(stream->request_id);
        return;
      }
      worker_api::DecodeEvent first;  // a descriptor event without a descriptor: nothing to transfer
      first.type = worker_api::DecodeEventType::Descriptor;
      stream->exchange.beginStream(200, {{"Content-Type", std::string(kNdjson)}, {"Cache-Control", "no-store"}});
      stream->exchange.write(worker_api::toJson(first) + "\n");
      const std::uint64_t id = stream->local_id;
      stream->exchange.onClientGone([loop, id] { loop->postAbort(id); });
    });
    return;
  }
  loop_->openStreamAsync(
      std::move(r), *transport_, compat_, targets_, static_cast<std::uint32_t>(kv_timeout_ms),
      [this, stream, loop](Result<kvtransfer::KvDescriptor> descriptor) {
        stream->admitted = trace::Clock::now();
        if (!descriptor.ok()) {
          stream->span.setError(descriptor.error().toString());
          stream->span.end();
          refuse(stream->exchange, descriptor.error());
          streamEnded(stream->request_id);
          return;
        }
        worker_api::DecodeEvent first;
        first.type = worker_api::DecodeEventType::Descriptor;
        const std::vector<std::uint8_t> bytes = kvtransfer::encode(*descriptor);
        first.kv_descriptor.assign(bytes.begin(), bytes.end());
        if (options_.auth) {
          first.kv_descriptor_tag = crypto::toHex(options_.auth->tag("descriptor", std::as_bytes(std::span(bytes))));
        }
        first.blocks = static_cast<std::int64_t>(descriptor->block_ids.size());
        stream->exchange.beginStream(200, {{"Content-Type", std::string(kNdjson)}, {"Cache-Control", "no-store"}});
        stream->exchange.write(worker_api::toJson(first) + "\n");
        // Set only now that the request is admitted; runs at once if the client is already gone.
        const std::uint64_t id = stream->local_id;
        stream->exchange.onClientGone([loop, id] { loop->postAbort(id); });
      });
}

void DecodeServer::Impl::handleAttach(worker_api::DecodeOpen open, const std::shared_ptr<Stream>& stream) {
  std::optional<std::uint64_t> parent;
  {
    std::lock_guard lock(mutex_);
    const auto it = streams_.find(open.attach_to);
    if (it != streams_.end()) parent = it->second->local_id;
  }
  if (!parent) {
    stream->span.end();
    refuse(stream->exchange, makeError(ErrorCode::NotFound, fmt::format("request {} to attach choice {} to is not "
                                                                        "open here",
                                                                        open.attach_to, open.choice)));
    streamEnded(stream->request_id);
    return;
  }
  DecodeLoop* loop = loop_.get();
  loop_->attachAsync(
      *parent, open.choice, stream->local_id, streamSink(stream), [this, stream, loop](const Status& attached) {
        stream->admitted = trace::Clock::now();
        if (!attached.ok()) {
          stream->span.setError(attached.error().toString());
          stream->span.end();
          refuse(stream->exchange, attached.error());
          streamEnded(stream->request_id);
          return;
        }
        // An empty descriptor: the parent's prefill brings this choice's KV and first token.
        worker_api::DecodeEvent first;
        first.type = worker_api::DecodeEventType::Descriptor;
        stream->exchange.beginStream(200, {{"Content-Type", std::string(kNdjson)}, {"Cache-Control", "no-store"}});
        stream->exchange.write(worker_api::toJson(first) + "\n");
        const std::uint64_t id = stream->local_id;
        stream->exchange.onClientGone([loop, id] { loop->postAbort(id); });
      });
}

TokenEventSink DecodeServer::Impl::streamSink(const std::shared_ptr<Stream>& stream) {
  // Runs on the loop thread; Exchange::write only queues, so it never blocks the loop.
  return [this, stream](const TokenEvent& e) {
    const trace::TimePoint event_at = e.kv_traceparent.empty() ? trace::TimePoint{} : trace::Clock::now();
    if (!e.tokens.empty()) stream->exchange.write(worker_api::toJson(tokensEvent(e, stream->logprobs)) + "\n");
    if (!e.kv_traceparent.empty()) recordKvRecord(*stream, e.kv_traceparent, event_at);
    if (stream->span.recording() && !e.tokens.empty()) {
      const trace::TimePoint now = trace::Clock::now();
      if (stream->token_events == 0) stream->first_event = now;
      if (stream->token_events == 1) stream->second_event = now;
      if (stream->token_events < 2) stream->early_tokens += static_cast<std::int64_t>(e.tokens.size());
      ++stream->token_events;
    }
    if (!e.finish) return;
    if (stream->span.recording()) recordSpans(*stream, e);
    stream->exchange.write(worker_api::toJson(lastEvent(e)) + "\n");
    stream->exchange.end();
    streamEnded(stream->request_id);
  };
}

void DecodeServer::Impl::recordSpans(Stream& stream, const TokenEvent& e) {
  const trace::TimePoint now = trace::Clock::now();
  const trace::SpanContext parent = stream.span.context();
  tracer_->record(parent, "decode.admission", stream.opened, stream.admitted);
  const trace::TimePoint kv_end = stream.token_events > 0 ? stream.first_event : now;
  tracer_->record(parent, "decode.kv_wait", stream.admitted, kv_end);
  if (stream.token_events > 1) {
    tracer_->record(parent, "decode.first_step", stream.first_event, stream.second_event);
  }
  if (stream.token_events > 2) {
    // Each later token event is one decode step (its tokens: the accepted MTP drafts plus one).
    const std::int64_t steps = stream.token_events - 2;
    const std::int64_t tokens = e.completion_tokens - stream.early_tokens;
    tracer_->record(parent, "decode.steps", stream.second_event, now,
                    {{"pd.steps", steps},
                     {"pd.tokens", tokens},
                     {"pd.tokens_per_step", static_cast<double>(tokens) / static_cast<double>(steps)}});
  }
  if (e.preempted) {
    // The pool ran dry and this request gave its blocks up; the router resumes it (its
    // router.resume span) with the tokens it has.
    tracer_->record(parent, "decode.preempted", now, now,
                    {{"pd.blocks_freed", e.preempted_blocks},
                     {"pd.completion_tokens", e.completion_tokens},
                     {"pd.reason", std::string("kv_pool_exhausted")}});
  }
  stream.span.setAttribute("pd.request_id", stream.request_id);
  stream.span.setAttribute("pd.prompt_tokens", stream.prompt_tokens);
  stream.span.setAttribute("pd.completion_tokens", e.completion_tokens);
  stream.span.setAttribute("pd.finish_reason", std::string(finishReasonName(*e.finish)));
  if (e.error) stream.span.setError(e.error->toString());
  stream.span.end(now);
}

void DecodeServer::Impl::recordKvRecord(const Stream& stream, std::string_view traceparent, trace::TimePoint start) {
  if (!tracer_->enabled()) return;
  // The record's context passed the wire decoder's exact check; parse it as any caller's.
  const std::optional<trace::SpanContext> completion = trace::parseTraceparent(traceparent);
  if (!completion) return;
  trace::Span span = tracer_->startSpan("decode.kv_record", completion, trace::SpanKind::Internal, start);
  span.setAttribute("pd.request_id", stream.request_id);
  span.addLink(stream.span.context());
  span.end();
}

void DecodeServer::Impl::handleAbort(const http::Request& request, http::Exchange exchange) {
  Result<worker_api::AbortRequest> parsed = worker_api::parseAbortRequest(request.body);
  if (!parsed.ok()) {
    exchange.respond(errorResponse(parsed.error()));
    return;
  }
  std::optional<std::uint64_t> id;
  {
    std::lock_guard lock(mutex_);
    const auto it = streams_.find(parsed->request_id);
    if (it != streams_.end()) id = it->second->local_id;
  }
  // The stream ends with a Cancelled error line; the blocks are free before it does.
  if (id) loop_->postAbort(*id);
  exchange.respond(jsonResponse(200, id ? R"({"found":true})" : R"({"found":false})"));
}

void DecodeServer::Impl::streamEnded(const std::string& request_id) {
  std::lock_guard lock(mutex_);
  streams_.erase(request_id);
  if (streams_.empty()) idle_.notify_all();
}

void DecodeServer::Impl::beginDrain() {
  if (!draining_.exchange(true)) log::info("decode", "draining: refusing new requests");
}

std::string DecodeServer::Impl::notReadyReason() const {
  if (draining_.load()) return "draining";
  if (tpBroken()) return "tensor-parallel group failed";
  // A minimal request (1 prompt token) needs 1 block of what admission may take: free blocks
  // minus the headroom (kv_block_manager.h).
  constexpr std::int64_t kMinimalRequestBlocks = 1;
  const DecodeMetrics::Snapshot m = metrics_.snapshot();
  if (m.available_blocks < kMinimalRequestBlocks) {
    return fmt::format("KV pool full: {} of {} blocks available, a minimal request needs {}", m.available_blocks,
                       m.total_blocks, kMinimalRequestBlocks);
  }
  return {};
}

std::size_t DecodeServer::Impl::openStreams() const {
  std::lock_guard lock(mutex_);
  return streams_.size();
}

bool DecodeServer::Impl::waitIdle(std::chrono::milliseconds timeout) const {
  std::unique_lock lock(mutex_);
  return idle_.wait_for(lock, timeout, [this] { return streams_.empty(); });
}

void DecodeServer::Impl::stop(std::chrono::milliseconds drain) {
  if (stopped_) return;
  stopped_ = true;
  beginDrain();
  if (loop_) {
    if (!waitIdle(drain)) {
      std::vector<std::uint64_t> ids;
      {
        std::lock_guard lock(mutex_);
        for (const auto& [name, s] : streams_) ids.push_back(s->local_id);
      }
      log::warn("decode", "drain time over: aborting {} open request(s)", ids.size());
      for (const std::uint64_t id : ids) loop_->postAbort(id);
      // Each abort ends its stream on the loop thread; give the error lines a moment to be queued.
      (void)waitIdle(std::chrono::milliseconds(5000));
    }
  }
  // Lets the last lines reach their clients; handlers stop here, so nothing opens afterwards.
  if (http_) http_->stop(std::chrono::milliseconds(1000));
  loop_.reset();  // ends anything still held (each sink hears it) and cancels its KV expectation
  if (region_registered_) {
    const Status s = transport_->deregisterRegion(region_);
    if (!s.ok()) log::warn("decode", "deregistering the KV pool: {}", s.error().toString());
    region_registered_ = false;
  }
  transport_.reset();
}

worker_api::WorkerStatus DecodeServer::Impl::status() const {
  const DecodeMetrics::Snapshot m = metrics_.snapshot();
  worker_api::WorkerStatus s;
  s.role = "decode";
  s.draining = draining_.load();
  s.ready = notReadyReason().empty();
  s.busy = !s.ready && !s.draining && !tpBroken();  // the only other reason: the pool is full
  s.model_hash = fmt::format("{:016x}", options_.model_hash);
  s.queued_requests = m.waiting_kv;
  s.queued_tokens = m.waiting_kv_tokens;
  s.running_requests = m.running + m.queued;
  s.free_blocks = m.free_blocks;
  s.quarantined_blocks = m.quarantined_blocks;
  s.total_blocks = m.total_blocks;
  s.block_size = options_.decode.block_size;
  s.drafts_proposed = m.drafts_proposed;
  s.drafts_accepted = m.drafts_accepted;
  // The CPU engine's pool, in host memory (a device pool sized by the GPU memory plan is not
  // built yet: docs/gpu.md).
  s.kv_pool_memory = pool_->location();
  s.kv_cache_dtype = options_.decode.kv_dtype;
  s.kv_pool_bytes = pool_ ? static_cast<std::int64_t>(pool_->memory().size()) : 0;
  s.kv_transfer_path = std::string(kvtransfer::kvTransferPathName(kv_path_));
  s.prefix_cache_blocks = m.prefix_cache_blocks;
  s.prefix_cache_capacity = loop_ != nullptr ? engineOptions(options_.decode).prefix_cache_blocks : 0;
  // A tensor-parallel worker prefills nothing itself (openStream refuses it): the router then
  // sends its short prompts to a prefill worker.
  s.local_prefill_max_tokens = options_.decode.tensor_parallel > 1 ? 0 : options_.decode.local_prefill_max_tokens;
  return s;
}

kvtransfer::TransportStats DecodeServer::Impl::transportStats() const {
  return transport_ ? transport_->stats() : kvtransfer::TransportStats{};
}

DecodeServer::DecodeServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DecodeServer::~DecodeServer() = default;

std::uint16_t DecodeServer::port() const {
  return impl_->port();
}
std::string DecodeServer::url() const {
  return impl_->url();
}
void DecodeServer::beginDrain() {
  impl_->beginDrain();
}
bool DecodeServer::draining() const {
  return impl_->draining();
}
std::size_t DecodeServer::openStreams() const {
  return impl_->openStreams();
}
bool DecodeServer::waitIdle(std::chrono::milliseconds timeout) const {
  return impl_->waitIdle(timeout);
}
void DecodeServer::stop(std::chrono::milliseconds drain) {
  impl_->stop(drain);
}
worker_api::WorkerStatus DecodeServer::status() const {
  return impl_->status();
}
metrics::Registry& DecodeServer::registry() {
  return impl_->registry();
}
kvtransfer::TransportStats DecodeServer::transportStats() const {
  return impl_->transportStats();
}

}  // namespace pd::decode
