#include "pd/prefill/prefill_server.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <utility>
#include <vector>

#include "pd/common/http_server.h"
#include "pd/common/log.h"
#include "pd/common/probe_routes.h"
#include "pd/common/worker_api.h"
#include "pd/engine/model_hash.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/kvtransfer/ucx_transport.h"
#include "pd/kvtransfer/wire.h"
#include "pd/prefill/kv_event_log.h"
#include "pd/prefill/prefill_engine.h"
#include "pd/prefill/transport_kv_sink.h"
#include "pd/trace/tracer.h"

namespace pd::prefill {
namespace {

namespace kvt = pd::kvtransfer;
constexpr std::string_view kJson = "application/json";
// Layers per prefill.layers span: enough detail to see a slow group, few spans per chunk.
constexpr std::uint32_t kTraceLayerGroup = 8;
// Forwards of one request that get prefill.layers spans: a very long prompt's trace stays small.
constexpr std::size_t kTraceLayerForwards = 16;

double msBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// One submission, from the request to its answer. Shared by the registry (cancel lookups), the
// transport's done callback and the submitting handler; the exchange's gone-callback holds it
// weakly. Its timeline is shared with the request's TransportKvSink.
struct Call {
  std::string router_id;
  std::uint64_t engine_id = 0;
  kvt::TransferId transfer_id;  // the descriptor's (128 random bits the decode worker's transport drew)
  kvt::Transport* transport = nullptr;
  http::Exchange exchange;
  std::int64_t prompt_tokens = 0;
  std::uint64_t kv_bytes = 0;
  Clock::time_point received;
  trace::Span span;  // prefill.request; ended when answered
  // prefill.completion's id, drawn at submission: the completion record carries its context.
  trace::SpanId completion_span_id;
  std::shared_ptr<TransferTimeline> timeline = std::make_shared<TransferTimeline>();

  std::mutex mutex;
  // The answer needs both the transfer's end and the submit's verdict (a refused submit drops the
  // sink, which ends the transfer, before its reason is known): whichever comes second answers.
  bool submitted = false;                  // guarded: the engine took (or refused) the request
  std::optional<Status> transfer_outcome;  // guarded: the transport's done callback came
  bool answered = false;                   // guarded

  explicit Call(http::Exchange ex) : exchange(std::move(ex)) {}
};

http::Response errorResponse(const Error& e) {
  return http::Response::withBody(worker_api::httpStatusFor(e.code), std::string(kJson), worker_api::errorJson(e));
}

std::string outcomeLabel(const std::optional<Error>& e) {
  return e ? std::string(errorCodeName(e->code)) : std::string("ok");
}

}  // namespace

class PrefillServer::Impl {
 public:
  Impl(std::unique_ptr<model::Engine> engine, PrefillServerOptions options)
      : options_(std::move(options)), model_(std::move(engine)) {
    registerMetrics();
    if (std::min(options_.prefill.prefix_cache_blocks, options_.prefill.cache_blocks) > 0) {
      kv_events_ = std::make_unique<KvEventLog>(instance_id_, options_.model_hash, options_.prefill.cache_block_size);
    }
  }

  Status start() {
    PD_ASSIGN_OR_RETURN(tracer_, trace::Tracer::create(options_.trace, "pdserve-prefill", &registry_));
    PD_ASSIGN_OR_RETURN(prefill_, PrefillEngine::create(*model_, engineOptionsWithHash()));
    cache_location_ = prefill_->cacheLocation();
    log::info("prefill", "local latent cache: {} blocks x {} tokens in {} memory", options_.prefill.cache_blocks,
              options_.prefill.cache_block_size, cache_location_);
    prefill_->start();
    http::ServerOptions so;
    so.host = options_.prefill.host;
    so.port = static_cast<std::uint16_t>(options_.prefill.port);
    so.io_threads = static_cast<int>(options_.prefill.io_threads);
    so.server_name = "pdserve-prefill";
    // The server's own errors (404, 413, malformed HTTP) in the contract's error body too.
    so.error_responder = [](int status, std::string_view message) {
      const Error error = makeError(worker_api::errorCodeForHttpStatus(status), std::string(message));
      return http::Response::withBody(status, std::string(kJson), worker_api::errorJson(error));
    };
    std::vector<http::Route> routes;
    routes.push_back({"POST", std::string(worker_api::kPrefillPath),
                      [this](const http::Request& r, http::Exchange ex) { onSubmit(r, std::move(ex)); }});
    routes.push_back({"POST", std::string(worker_api::kPrefillCancelPath),
                      [this](const http::Request& r, http::Exchange ex) { onCancel(r, ex); }});
    routes.push_back({"GET", std::string(worker_api::kKvEventsPath),
                      [this](const http::Request& r, http::Exchange ex) { onKvEvents(r, ex); }});
    http::Probes probes;
    probes.not_ready = [this] { return notReadyReason(); };
    probes.metrics = [this] {
      refreshGauges();
      return registry_.render();
    };
    probes.status = [this] { return worker_api::toJson(status()); };
    http::addProbeRoutes(routes, std::move(probes));
    if (!options_.auth)
      log::warn("prefill", "no cluster secret: the internal API is unauthenticated (docs/security.md)");
    routes = requireInternalAuth(std::move(routes), options_.auth, &registry_);
    PD_ASSIGN_OR_RETURN(http_, http::Server::start(std::move(so), std::move(routes)));
    log::info("prefill", "serving on {}:{} (model hash {}, chunk {}, token budget {}, local cache {}x{})",
              options_.prefill.host, http_->port(), modelHashHex(options_.model_hash), options_.prefill.chunk_size,
              options_.prefill.token_budget, options_.prefill.cache_blocks, options_.prefill.cache_block_size);
    return okStatus();
  }

  ~Impl() { stop(); }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  Impl(Impl&&) = delete;
  Impl& operator=(Impl&&) = delete;

  std::uint16_t port() const { return http_->port(); }
  std::string url() const { return fmt::format("http://{}:{}", options_.prefill.host, http_->port()); }

  void beginDrain() {
    if (!draining_.exchange(true)) log::info("prefill", "draining: new prefills are refused");
    m_.draining->set(1);
  }

  bool waitIdle(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return idle_.wait_for(lock, timeout, [&] { return calls_.empty() && answering_ == 0; });
  }

  void stop() {
    if (stopped_) return;
    stopped_ = true;
    beginDrain();
    std::vector<std::shared_ptr<Call>> left;
    {
      std::lock_guard lock(mutex_);
      for (auto& [id, call] : calls_) left.push_back(call);
    }
    if (!left.empty()) log::info("prefill", "aborting {} prefills still in flight", left.size());
    for (auto& call : left) cancelCall(call, "the prefill worker is shutting down");
    // Every transfer ends by its deadline at the latest; this bound only guards against a bug.
    if (!waitIdle(std::chrono::milliseconds(options_.prefill.request_timeout_ms) + std::chrono::seconds(5))) {
      log::error("prefill", "prefills still held at shutdown");
    }
    if (http_) http_->stop(std::chrono::milliseconds(1000));  // lets the last answers go out
    std::unique_ptr<PrefillEngine> prefill;
    {
      std::unique_lock lock(engine_guard_);
      prefill = std::move(prefill_);
    }
    prefill.reset();  // stops the engine thread; fails whatever it still holds (transfers ended)
    std::lock_guard lock(transports_mutex_);
    transports_.clear();
  }

  PrefillServerStats stats() const {
    PrefillServerStats s;
    {
      std::lock_guard lock(mutex_);
      s.submissions = static_cast<std::int64_t>(calls_.size());
    }
    {
      std::shared_lock lock(engine_guard_);
      if (prefill_) {
        const PrefillEngineStats e = prefill_->stats();
        s.queued_requests = e.queued_requests;
        s.queued_tokens = e.queued_tokens;
        s.running_requests = e.running_requests;  // still computing, possibly after its answer
      }
    }
    s.running_requests = std::max(s.running_requests, s.submissions - s.queued_requests);
    std::lock_guard lock(transports_mutex_);
    for (const auto& [compat, t] : transports_) {
      const kvt::TransportStats ts = t->stats();
      s.transfers_in_flight += ts.in_flight;
      s.registered_regions += ts.registered_regions;
    }
    s.kv_layouts = static_cast<std::int64_t>(transports_.size());
    return s;
  }

  metrics::Registry& registry() { return registry_; }

 private:
  struct Metrics {
    metrics::Gauge* queue_requests = nullptr;
    metrics::Gauge* queue_tokens = nullptr;
    metrics::Gauge* running = nullptr;
    metrics::Gauge* free_blocks = nullptr;
    metrics::Gauge* draining = nullptr;
    metrics::Gauge* tokens_per_second = nullptr;
    metrics::Counter* prompt_tokens = nullptr;
    metrics::Counter* forward_seconds = nullptr;
    metrics::Counter* kv_bytes = nullptr;
    metrics::Family<metrics::Counter>* requests = nullptr;
    metrics::Histogram* queue_s = nullptr;
    metrics::Histogram* compute_s = nullptr;
    metrics::Histogram* transfer_s = nullptr;
    metrics::Histogram* total_s = nullptr;
    metrics::Counter* prefix_hit_tokens = nullptr;
    metrics::Counter* prefix_miss_tokens = nullptr;
    metrics::Counter* prefix_evictions = nullptr;
    metrics::Gauge* prefix_cached_blocks = nullptr;
  };

  PrefillEngineOptions engineOptionsWithHash() const {
    PrefillEngineOptions o = engineOptions(options_.prefill);
    o.model_hash = options_.model_hash;  // the prefix cache's chain root: KV of one model only
    o.kv_events = kv_events_.get();
    return o;
  }

  void registerMetrics() {
    auto& r = registry_;
    m_.queue_requests = &r.gauge("pdserve_prefill_queue_requests", "Prefill requests waiting for the engine.").get();
    m_.queue_tokens = &r.gauge("pdserve_prefill_queue_tokens", "Prompt tokens of the queued requests.").get();
    m_.running =
        &r.gauge("pdserve_prefill_running_requests", "Prefill requests computing or finishing their KV transfer.")
             .get();
    m_.free_blocks = &r.gauge("pdserve_prefill_cache_free_blocks", "Free blocks of the local latent cache.").get();
    m_.draining = &r.gauge("pdserve_prefill_draining", "1 while the worker drains before exiting.").get();
    m_.tokens_per_second =
        &r.gauge("pdserve_prefill_tokens_per_second", "Prompt tokens per second of forward time, since start.").get();
    m_.prompt_tokens =
        &r.counter("pdserve_prefill_prompt_tokens_total", "Prompt tokens run through the main model.").get();
    m_.forward_seconds =
        &r.counter("pdserve_prefill_forward_seconds_total", "Wall time spent in forward passes (main and MTP).").get();
    m_.kv_bytes = &r.counter("pdserve_prefill_kv_bytes_total",
                             "Latent KV bytes delivered to decode workers (completed requests, per target).")
                       .get();
    m_.requests =
        &r.counter("pdserve_prefill_requests_total", "Prefill submissions answered, by outcome.", {"outcome"});
    const std::vector<double> b = metrics::latencyBuckets();
    m_.queue_s = &r.histogram("pdserve_prefill_queue_seconds", "TTFT component: submit to first forward.", b).get();
    m_.compute_s =
        &r.histogram("pdserve_prefill_compute_seconds", "TTFT component: first forward to last layer computed.", b)
             .get();
    m_.transfer_s = &r.histogram("pdserve_prefill_transfer_seconds",
                                 "TTFT component: last layer computed to completion record delivered.", b)
                         .get();
    m_.prefix_hit_tokens = &r.counter("pdserve_prefill_prefix_cache_hit_tokens_total",
                                      "Prompt tokens whose KV came from the prefix cache (not recomputed).")
                                .get();
    m_.prefix_miss_tokens =
        &r.counter("pdserve_prefill_prefix_cache_miss_tokens_total", "Prompt tokens computed with the prefix cache on.")
             .get();
    m_.prefix_evictions =
        &r.counter("pdserve_prefill_prefix_cache_evictions_total", "Prefix-cache blocks evicted (LRU).").get();
    m_.prefix_cached_blocks =
        &r.gauge("pdserve_prefill_prefix_cache_blocks", "Local cache blocks held by the prefix cache.").get();
    m_.total_s = &r.histogram("pdserve_prefill_request_seconds", "Submit to answer of successful prefills.", b).get();
  }

  // Adds to `counter` what the engine's `total` gained since `seen` (mirror_mutex_ held).
  static void mirror(metrics::Counter& counter, std::int64_t total, std::int64_t& seen) {
    if (total > seen) counter.inc(static_cast<double>(total - seen));
    seen = std::max(seen, total);
  }

  // Gauges and the counters mirrored from the engine's totals; refreshed when read.
  void refreshGauges() {
    const PrefillServerStats s = stats();
    m_.queue_requests->set(static_cast<double>(s.queued_requests));
    m_.queue_tokens->set(static_cast<double>(s.queued_tokens));
    m_.running->set(static_cast<double>(s.running_requests));
    std::shared_lock guard(engine_guard_);
    if (!prefill_) return;
    const PrefillEngineStats e = prefill_->stats();
    m_.free_blocks->set(static_cast<double>(e.free_blocks));
    std::lock_guard lock(mirror_mutex_);
    if (e.prompt_tokens > mirrored_tokens_)
      m_.prompt_tokens->inc(static_cast<double>(e.prompt_tokens - mirrored_tokens_));
    if (e.compute_seconds > mirrored_seconds_) m_.forward_seconds->inc(e.compute_seconds - mirrored_seconds_);
    mirrored_tokens_ = std::max(mirrored_tokens_, e.prompt_tokens);
    mirrored_seconds_ = std::max(mirrored_seconds_, e.compute_seconds);
    m_.prefix_cached_blocks->set(static_cast<double>(e.prefix_cached_blocks));
    mirror(*m_.prefix_hit_tokens, e.prefix_hit_tokens, mirrored_hits_);
    mirror(*m_.prefix_miss_tokens, e.prefix_miss_tokens, mirrored_misses_);
    mirror(*m_.prefix_evictions, e.prefix_evictions, mirrored_evictions_);
    if (e.compute_seconds > 0) m_.tokens_per_second->set(static_cast<double>(e.prompt_tokens) / e.compute_seconds);
  }

  [[nodiscard]] bool broken() const { return options_.broken && options_.broken(); }

  // Why /ready answers 503 now (draining, a broken TP group, a full queue: the next submit would
  // be refused Overloaded), or empty while the worker takes work. Thread-safe, never blocks long.
  std::string notReadyReason() const {
    if (draining_.load()) return "draining";
    if (broken()) return "tensor-parallel group broken";
    std::shared_lock guard(engine_guard_);
    if (!prefill_) return "stopped";
    const std::int64_t queued = prefill_->stats().queued_requests;
    if (queued >= options_.prefill.max_queued_requests) {
      return fmt::format("prefill queue full: {} of {} requests queued", queued, options_.prefill.max_queued_requests);
    }
    return {};
  }

  worker_api::WorkerStatus status() {
    refreshGauges();
    const PrefillServerStats s = stats();
    worker_api::WorkerStatus w;
    w.role = "prefill";
    w.draining = draining_.load();
    w.ready = notReadyReason().empty();
    w.busy = !w.ready && !w.draining && !broken();  // the only other reason: the queue is full
    w.model_hash = modelHashHex(options_.model_hash);
    w.queued_requests = s.queued_requests;
    w.queued_tokens = s.queued_tokens;
    w.running_requests = s.running_requests;
    w.free_blocks = static_cast<std::int64_t>(m_.free_blocks->value());
    w.total_blocks = options_.prefill.cache_blocks;
    w.block_size = options_.prefill.cache_block_size;
    w.kv_pool_memory = cache_location_;  // the local cache (and prefix cache): "host" or "cuda:N"
    const auto setting = kvt::parseKvTransferPath(options_.kvtransfer.path);
    if (setting.ok()) w.kv_transfer_path = kvt::kvTransferPathName(kvt::resolveKvTransferPath(*setting, false, false));
    return w;
  }

  void reject(http::Exchange& ex, const Error& e) {
    m_.requests->labels({outcomeLabel(e)}).inc();
    ex.respond(errorResponse(e));
  }

  // What must agree with the descriptor's layout: protocol, model, KV layers and latent width.
  // The rest (dtype, block size, TP) is the decode worker's choice.
  Status checkLayout(const kvt::CompatInfo& theirs) const {
    kvt::CompatInfo ours = theirs;
    ours.protocol_version = kvt::kProtocolVersion;
    ours.model_hash = options_.model_hash;
    ours.num_layers = static_cast<std::uint32_t>(model_->config().kvLayers());
    ours.kv_dim = static_cast<std::uint32_t>(model_->config().latentDim());
    return kvt::checkCompatible(ours, theirs);
  }

  Result<kvt::Transport*> transportFor(const kvt::CompatInfo& compat) {
    std::lock_guard lock(transports_mutex_);
    for (auto& [c, t] : transports_) {
      if (c == compat) return t.get();
    }
    if (transports_.size() >= kMaxKvLayouts) {
      return makeError(
          ErrorCode::Unsupported,
          fmt::format("this prefill worker already serves {} KV layouts (dtype, block size, TP)", kMaxKvLayouts));
    }
    kvt::UcxTransportOptions o = kvt::ucxOptionsFromConfig(options_.kvtransfer, compat);
    o.name = fmt::format("prefill-kv{}", transports_.size());
    kvt::inheritLoopbackHost(o, options_.prefill.host);
    o.metrics = &registry_;
    o.auth = options_.auth;  // signs every completion and failure record
    // The sources are host memory (the CPU engine's): `auto` resolves to direct.
    PD_ASSIGN_OR_RETURN(kvt::KvTransport kv, kvt::createKvTransport(options_.kvtransfer, o, kvt::KvTransportUse::Send,
                                                                    /*pool_in_device_memory=*/false));
    std::unique_ptr<kvt::Transport> t = std::move(kv.transport);
    log::info("prefill", "KV layout {}: {} blocks of {} tokens, {} layers, TP {}", transports_.size(),
              dtypeName(compat.kv_dtype), compat.block_size, compat.num_layers, compat.tp_size);
    transports_.emplace_back(compat, std::move(t));
    return transports_.back().second.get();
  }

  void onSubmit(const http::Request& request, http::Exchange ex) {
    const Clock::time_point received = Clock::now();
    if (draining_.load()) return reject(ex, makeError(ErrorCode::Overloaded, "prefill worker is draining"));
    Result<worker_api::PrefillSubmit> parsed = worker_api::parsePrefillSubmit(request.body);
    if (!parsed.ok()) return reject(ex, parsed.error());
    worker_api::PrefillSubmit& sub = *parsed;
    auto grammar = structured::requestGrammar(options_.grammars.get(), sub.constraint, sub.tool_call_format);
    if (!grammar.ok()) return reject(ex, grammar.error());
    const auto& raw = sub.kv_descriptor;
    // With a cluster secret, only a descriptor a decode worker of this cluster made reaches the
    // decoder and UCX (docs/security.md).
    if (options_.auth) {
      auto tag = crypto::fromHex(sub.kv_descriptor_tag);
      if (!tag.ok() ||
          !options_.auth->checkTag("descriptor", std::as_bytes(std::span(raw.data(), raw.size())), tag.value())) {
        return reject(ex, makeError(ErrorCode::Unauthenticated,
                                    "kv_descriptor is not signed by a decode worker of this cluster"));
      }
    }
    Result<kvt::KvDescriptor> desc =
        kvt::decodeKvDescriptor(std::span(reinterpret_cast<const std::uint8_t*>(raw.data()), raw.size()));
    if (!desc.ok()) {
      const ErrorCode code =
          desc.error().code == ErrorCode::Unsupported ? ErrorCode::Unsupported : ErrorCode::InvalidArgument;
      return reject(ex, makeError(code, "kv_descriptor: " + desc.error().message));
    }
    if (desc->num_tokens != sub.token_ids.size()) {
      return reject(
          ex, makeError(ErrorCode::InvalidArgument, fmt::format("kv_descriptor is for {} tokens, the prompt has {}",
                                                                desc->num_tokens, sub.token_ids.size())));
    }
    if (sub.timeout_ms <= 0) return reject(ex, makeError(ErrorCode::InvalidArgument, "timeout_ms must be positive"));
    if (Status s = checkLayout(desc->compat); !s.ok()) return reject(ex, s.error());
    Result<kvt::Transport*> transport = transportFor(desc->compat);
    if (!transport.ok()) return reject(ex, transport.error());

    auto call = std::make_shared<Call>(ex);
    call->router_id = sub.request_id;
    call->transfer_id = desc->transfer_id;
    call->transport = *transport;
    call->prompt_tokens = static_cast<std::int64_t>(sub.token_ids.size());
    call->kv_bytes =
        std::uint64_t{desc->num_tokens} * desc->compat.num_layers * desc->compat.tokenBytes() * desc->targets.size();
    call->received = received;
    // The span starts when the submission arrived, like its prefill.queue child.
    const trace::TimePoint wall_received =
        trace::Clock::now() - std::chrono::duration_cast<trace::Clock::duration>(Clock::now() - received);
    call->span = tracer_->startFromHeader("prefill.request", sub.traceparent, trace::SpanKind::Server, wall_received);
    call->timeline = std::make_shared<TransferTimeline>(call->span.recording());
    {
      std::lock_guard lock(mutex_);
      if (calls_.contains(sub.request_id)) {
        return reject(ex, makeError(ErrorCode::InvalidArgument,
                                    fmt::format("request {} is already held by this prefill worker", sub.request_id)));
      }
      call->engine_id = next_engine_id_++;
      // Transfer ids are 128 random bits: a second submit of a live one is a replayed descriptor.
      if (transfers_.contains({call->transport, call->transfer_id})) {
        return reject(ex, makeError(ErrorCode::InvalidArgument,
                                    fmt::format("transfer {} is already in flight here", call->transfer_id)));
      }
      calls_.emplace(sub.request_id, call);
      transfers_.emplace(call->transport, call->transfer_id);
    }
    const auto timeout = std::chrono::milliseconds(std::min(sub.timeout_ms, options_.prefill.request_timeout_ms));
    const Clock::time_point deadline = received + timeout;
    // The completion record names the prefill.completion span recorded at the answer, so the
    // decode worker's decode.kv_record is its child; with tracing off here, the caller's context
    // passes on unchanged (docs/observability.md, "Propagation").
    std::string record_traceparent = call->span.traceparent();
    if (call->span.recording()) {
      call->completion_span_id = trace::newSpanId();
      const trace::SpanContext& ctx = call->span.context();
      record_traceparent = trace::formatTraceparent({ctx.trace_id, call->completion_span_id, ctx.flags});
    }
    Result<std::unique_ptr<TransportKvSink>> sink = TransportKvSink::create(
        **transport, *desc, deadline,
        [this, call](const kvt::TransferId&, Status s) { onTransferDone(call, std::move(s)); }, call->timeline,
        std::move(record_traceparent));
    if (!sink.ok()) {
      {
        std::lock_guard lock(mutex_);
        calls_.erase(sub.request_id);
        transfers_.erase({call->transport, call->transfer_id});
      }
      idle_.notify_all();
      return reject(ex, sink.error());
    }
    PrefillRequest pr;
    pr.id = call->engine_id;
    pr.tokens = std::move(sub.token_ids);
    pr.sampling = sub.sampling;
    pr.resumed_tokens = sub.resumed_tokens;
    pr.forced_first_token = static_cast<std::int32_t>(sub.forced_first_token);
    pr.choices = sub.choices;
    pr.logprobs = sub.logprobs;
    pr.grammar = std::move(grammar).value();
    pr.deadline = deadline;
    pr.sink = std::move(sink).value();
    Status submitted = makeError(ErrorCode::Cancelled, "the prefill worker is shutting down");
    {
      std::shared_lock guard(engine_guard_);
      if (prefill_) submitted = prefill_->submit(std::move(pr));
    }
    // A refused request's dropped sink has ended its transfer (Cancelled); the answer carries
    // the refusal's reason, recorded before it can go out.
    if (!submitted.ok()) call->timeline->failed(submitted.error());
    std::optional<Status> transfer_outcome;
    {
      std::lock_guard lock(call->mutex);
      call->submitted = true;
      transfer_outcome = call->transfer_outcome;
    }
    if (transfer_outcome) answer(call, *transfer_outcome);
    if (submitted.ok()) {
      ex.onClientGone([this, weak = std::weak_ptr<Call>(call)] {
        if (auto c = weak.lock()) cancelCall(c, "the router closed the submission");
      });
    }
  }

  // GET kv_events?after=SEQ&instance=ID (kv_event_log.h). Without a prefix cache the worker holds
  // nothing: an empty snapshot, so a router's index for it stays empty.
  void onKvEvents(const http::Request& request, http::Exchange& ex) {
    std::uint64_t after = 0;
    std::string_view instance;
    std::string_view query = request.query;
    while (!query.empty()) {
      const std::string_view pair = query.substr(0, query.find('&'));
      query.remove_prefix(std::min(query.size(), pair.size() + 1));
      const auto eq = pair.find('=');
      const std::string_view name = pair.substr(0, eq);
      const std::string_view value = eq == std::string_view::npos ? std::string_view{} : pair.substr(eq + 1);
      if (name == "after") {
        const auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), after);
        if (ec != std::errc() || ptr != value.data() + value.size()) {
          return reject(ex, makeError(ErrorCode::InvalidArgument, "kv_events: after must be an unsigned integer"));
        }
      } else if (name == "instance") {
        if (value.size() > worker_api::kMaxIdBytes) {
          return reject(ex, makeError(ErrorCode::InvalidArgument, "kv_events: instance is too long"));
        }
        instance = value;
      }
    }
    worker_api::KvEvents events;
    if (kv_events_) {
      events = kv_events_->read(instance, after);
    } else {
      events.instance_id = instance_id_;
      events.model_hash = options_.model_hash;
      events.block_size = options_.prefill.cache_block_size;
      events.snapshot = true;
    }
    ex.respond(http::Response::withBody(200, std::string(kJson), worker_api::toJson(events)));
  }

  void onCancel(const http::Request& request, http::Exchange& ex) {
    Result<worker_api::AbortRequest> parsed = worker_api::parseAbortRequest(request.body);
    if (!parsed.ok()) return (void)ex.respond(errorResponse(parsed.error()));
    std::shared_ptr<Call> call;
    {
      std::lock_guard lock(mutex_);
      if (auto it = calls_.find(parsed->request_id); it != calls_.end()) call = it->second;
    }
    if (call) cancelCall(call, "cancelled by the router");
    ex.respond(http::Response::withBody(200, std::string(kJson), call ? R"({"found":true})" : R"({"found":false})"));
  }

  // Ends a call early: the engine stops it before its next layer (and fails its sink, which
  // aborts the transfer); a call past its compute has its transfer aborted directly.
  void cancelCall(const std::shared_ptr<Call>& call, const std::string& reason) {
    call->timeline->failed(makeError(ErrorCode::Cancelled, fmt::format("request {}: {}", call->router_id, reason)));
    {
      std::shared_lock guard(engine_guard_);
      if (prefill_ && prefill_->cancel(call->engine_id)) return;
    }
    {
      std::lock_guard lock(call->mutex);
      if (call->answered || !call->submitted) return;
    }
    Status s = call->transport->abort(call->transfer_id, ErrorCode::Cancelled, reason);
    if (!s.ok() && s.error().code != ErrorCode::NotFound) {
      log::warn("prefill", "request {}: abort failed: {}", call->router_id, s.error().toString());
    }
  }

  // The transport ended the call's transfer (progress thread): answer the router, or leave it
  // to the submitting handler when the engine's verdict is not in yet.
  void onTransferDone(const std::shared_ptr<Call>& call, Status status) {
    {
      std::lock_guard lock(call->mutex);
      if (!call->submitted) {
        call->transfer_outcome = std::move(status);
        return;
      }
    }
    answer(call, status);
  }

  // Answers the router once the transfer has ended with `status`, preferring the first recorded
  // reason of a failure (the engine's, a cancel's, a refused submit's) to the transport's.
  void answer(const std::shared_ptr<Call>& call, const Status& status) {
    const Clock::time_point now = Clock::now();
    std::optional<Error> failure;
    worker_api::PrefillOutcome outcome;
    {
      std::lock_guard lock(call->mutex);
      call->answered = true;
    }
    const TransferTimeline::Snapshot timeline = call->timeline->snapshot();
    if (!status.ok()) failure = timeline.failure ? *timeline.failure : status.error();
    outcome.first_token = timeline.first_token;
    outcome.prompt_tokens = call->prompt_tokens;
    outcome.cached_tokens = timeline.cached_tokens;
    const Clock::time_point admitted = timeline.admitted.value_or(now);
    const Clock::time_point computed = timeline.computed.value_or(now);
    outcome.queue_ms = msBetween(call->received, admitted);
    outcome.compute_ms = msBetween(admitted, computed);
    outcome.transfer_ms = msBetween(computed, now);
    if (failure) {
      // The engine may still hold it (the transport gave up first): stop its compute too.
      std::shared_lock guard(engine_guard_);
      if (prefill_) (void)prefill_->cancel(call->engine_id);
    }
    // Released before the answer goes out: the router may retry this request here at once. Still
    // counted (answering_) until answered, so a drain waits for the answer.
    {
      std::lock_guard lock(mutex_);
      if (auto it = calls_.find(call->router_id); it != calls_.end() && it->second == call) calls_.erase(it);
      transfers_.erase({call->transport, call->transfer_id});
      ++answering_;
    }
    m_.requests->labels({outcomeLabel(failure)}).inc();
    if (call->span.recording()) recordSpans(*call, timeline, now, failure);
    if (failure) {
      log::info("prefill", "request {} failed: {}", call->router_id, failure->toString());
      call->exchange.respond(errorResponse(*failure));
    } else {
      m_.queue_s->observe(outcome.queue_ms / 1000.0);
      m_.compute_s->observe(outcome.compute_ms / 1000.0);
      m_.transfer_s->observe(outcome.transfer_ms / 1000.0);
      m_.total_s->observe(msBetween(call->received, now) / 1000.0);
      m_.kv_bytes->inc(static_cast<double>(call->kv_bytes));
      call->exchange.respond(http::Response::withBody(200, std::string(kJson), worker_api::toJson(outcome)));
    }
    {
      std::lock_guard lock(mutex_);
      --answering_;
    }
    idle_.notify_all();
  }

  // The call's spans from its timeline (steady clock) placed on the wall clock at `now`.
  void recordSpans(Call& call, const TransferTimeline::Snapshot& t, Clock::time_point now,
                   const std::optional<Error>& failure) {
    const trace::TimePoint wall_now = trace::Clock::now();
    const auto wall = [&](Clock::time_point at) {
      return wall_now - std::chrono::duration_cast<trace::Clock::duration>(now - at);
    };
    const trace::SpanContext parent = call.span.context();
    const Clock::time_point admitted = t.admitted.value_or(now);
    tracer_->record(parent, "prefill.queue", wall(call.received), wall(admitted));
    if (t.admitted) {
      const Clock::time_point computed = t.computed.value_or(now);
      const trace::SpanContext compute =
          tracer_->record(parent, "prefill.compute", wall(admitted), wall(computed),
                          {{"pd.forwards", static_cast<std::int64_t>(t.forwards.size())}});
      for (std::size_t k = 0; k < t.forwards.size(); ++k) {
        const TransferTimeline::Forward& f = t.forwards[k];
        const trace::SpanContext fwd =
            tracer_->record(compute, f.mtp ? "prefill.mtp" : "prefill.chunk", wall(f.start), wall(f.end),
                            {{"pd.first_pos", f.first_pos}, {"pd.tokens", f.tokens}});
        if (k >= kTraceLayerForwards && !f.mtp) continue;
        // This forward's puts, by layer; each group spans from the previous group's last put.
        std::vector<const TransferTimeline::Put*> puts;
        for (const auto& p : t.puts) {
          if (p.first_pos == f.first_pos && p.posted >= f.start && p.posted <= f.end) puts.push_back(&p);
        }
        std::sort(puts.begin(), puts.end(), [](const auto* a, const auto* b) { return a->layer < b->layer; });
        Clock::time_point group_start = f.start;
        for (std::size_t i = 0; i < puts.size();) {
          std::size_t j = i;
          const std::uint32_t group = puts[i]->layer / kTraceLayerGroup;
          Clock::time_point last = puts[i]->posted;
          while (j < puts.size() && puts[j]->layer / kTraceLayerGroup == group)
            last = std::max(last, puts[j++]->posted);
          tracer_->record(fwd, "prefill.layers", wall(group_start), wall(last),
                          {{"pd.layer_first", static_cast<std::int64_t>(puts[i]->layer)},
                           {"pd.layer_last", static_cast<std::int64_t>(puts[j - 1]->layer)}});
          group_start = last;
          i = j;
        }
      }
      if (t.computed) {
        tracer_->record(parent, "prefill.completion", wall(computed), wall(now),
                        {{"pd.kv_bytes", static_cast<std::int64_t>(call.kv_bytes)}}, trace::SpanKind::Internal,
                        call.completion_span_id);
      }
    }
    call.span.setAttribute("pd.request_id", call.router_id);
    call.span.setAttribute("pd.prompt_tokens", call.prompt_tokens);
    call.span.setAttribute("pd.outcome", outcomeLabel(failure));
    if (failure) call.span.setError(failure->toString());
    call.span.end(wall_now);
  }

  const PrefillServerOptions options_;
  metrics::Registry registry_;  // first: transports publish to it until they go
  Metrics m_;
  std::unique_ptr<trace::Tracer> tracer_;  // after the registry it reports to; before every call
  std::unique_ptr<model::Engine> model_;
  // The prefix cache's events (null without one); before the engine that appends to it.
  const std::string instance_id_ = randomInstanceId();
  std::unique_ptr<KvEventLog> kv_events_;

  mutable std::mutex transports_mutex_;
  std::vector<std::pair<kvt::CompatInfo, std::unique_ptr<kvt::Transport>>> transports_;  // guarded

  mutable std::mutex mutex_;
  std::condition_variable idle_;
  int answering_ = 0;                                   // guarded by mutex_: released calls whose answer is being sent
  std::map<std::string, std::shared_ptr<Call>> calls_;  // guarded by mutex_: router id -> call
  std::set<std::pair<kvt::Transport*, kvt::TransferId>> transfers_;  // guarded by mutex_: in flight
  std::uint64_t next_engine_id_ = 1;                                 // guarded by mutex_

  std::mutex mirror_mutex_;
  std::int64_t mirrored_tokens_ = 0;     // guarded by mirror_mutex_
  double mirrored_seconds_ = 0.0;        // guarded by mirror_mutex_
  std::int64_t mirrored_hits_ = 0;       // guarded by mirror_mutex_
  std::int64_t mirrored_misses_ = 0;     // guarded by mirror_mutex_
  std::int64_t mirrored_evictions_ = 0;  // guarded by mirror_mutex_

  std::atomic<bool> draining_{false};
  bool stopped_ = false;  // control thread only

  // Callbacks reach the engine under a shared lock; stop() takes it away under the unique lock.
  mutable std::shared_mutex engine_guard_;
  std::unique_ptr<PrefillEngine> prefill_;
  std::string cache_location_ = "host";  // set by start(), before the server answers
  std::unique_ptr<http::Server> http_;
};

Result<std::unique_ptr<PrefillServer>> PrefillServer::start(std::unique_ptr<model::Engine> engine,
                                                            PrefillServerOptions options) {
  PD_CHECK(engine != nullptr);
  auto impl = std::make_unique<Impl>(std::move(engine), std::move(options));
  PD_TRY(impl->start());
  return std::unique_ptr<PrefillServer>(new PrefillServer(std::move(impl)));
}

PrefillServer::PrefillServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PrefillServer::~PrefillServer() = default;

std::uint16_t PrefillServer::port() const {
  return impl_->port();
}
std::string PrefillServer::url() const {
  return impl_->url();
}
void PrefillServer::beginDrain() {
  impl_->beginDrain();
}
bool PrefillServer::waitIdle(std::chrono::milliseconds timeout) {
  return impl_->waitIdle(timeout);
}
void PrefillServer::stop() {
  impl_->stop();
}
PrefillServerStats PrefillServer::stats() const {
  return impl_->stats();
}
metrics::Registry& PrefillServer::metrics() {
  return impl_->registry();
}

}  // namespace pd::prefill
