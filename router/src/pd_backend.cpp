#include "pd/router/pd_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <unordered_map>
#include <utility>

#include "generation_resume.h"
#include "pd/common/async_http_client.h"
#include "pd/common/choices.h"
#include "pd/common/http_client.h"
#include "pd/common/io_threads.h"
#include "pd/common/log.h"
#include "pd/common/worker_api.h"
#include "pd/router/worker_policy.h"
#include "token_relay.h"
#include "worker_client_pool.h"

namespace pd::router {
namespace {

constexpr std::string_view kLog = "router.pd";
// Longest prompt whose token ids go to a decode prefix cache: the decode worker caps an open's
// body at 1 MiB, and a token id takes up to 7 bytes of JSON.
constexpr std::int64_t kMaxDecodePrefixTokens = 100000;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

/// Rounded up, so that a wait given this budget ends at or after `deadline`, never before it.
milliseconds remainingUntil(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now());
  return std::max(left, milliseconds{1});
}

/// A signed POST of a JSON body (unsigned when `auth` is null).
http::ClientRequest postJson(const InternalAuth* auth, std::string_view target, std::string body) {
  http::ClientRequest r{"POST", std::string(target), {{"Content-Type", "application/json"}}, std::move(body)};
  signRequest(auth, r.method, r.target, r.body, r.headers);
  return r;
}

/// A response's error: the transport's, or the worker's error body for a non-200 status.
Error responseError(const Result<http::ClientResponse>& response) {
  if (!response.ok()) return response.error();
  return worker_api::parseErrorJson(response.value().status, response.value().body);
}

/// Failures another prefill worker may not repeat.
bool prefillRetryable(ErrorCode code) {
  switch (code) {
    case ErrorCode::Overloaded:
    case ErrorCode::PeerFailed:
    case ErrorCode::Timeout:
    case ErrorCode::Io:
    case ErrorCode::Corrupt:
    case ErrorCode::Cancelled:
    case ErrorCode::Internal:
      return true;
    default:
      return false;
  }
}

/// Failures of the decode leg (before any token) that another decode worker may not repeat:
/// everything but a request that can never be served.
bool decodeRetryable(ErrorCode code) {
  return code != ErrorCode::InvalidArgument && code != ErrorCode::ResourceExhausted && code != ErrorCode::Unsupported &&
         code != ErrorCode::NotFound;
}

/// A failure that says the worker itself is unreachable or stuck (health counts it).
bool workerUnreachable(ErrorCode code) {
  return code == ErrorCode::PeerFailed || code == ErrorCode::Timeout;
}

/// The public message of a worker's refusal that the client sees verbatim (a 400). A worker's own
/// text names internal details (transfer ids, pool sizes, addresses), so it only reaches the log.
std::string publicRefusal(ErrorCode code) {
  switch (code) {
    case ErrorCode::ResourceExhausted:
      return "the prompt needs more KV cache than a decode worker has; shorten the prompt";
    case ErrorCode::Unsupported:
      return "the request asks for something the workers do not support";
    default:
      return "a worker refused the request's parameters";
  }
}

/// Names the worker in an error's message, except for errors the client sees verbatim (400s),
/// which get a public message instead (publicRefusal).
Error fromWorker(Error error, std::string_view role, const WorkerAddress& worker) {
  log::debug(kLog, "{} worker {}: {}", role, worker.key(), error.toString());
  if (error.code == ErrorCode::InvalidArgument || error.code == ErrorCode::ResourceExhausted ||
      error.code == ErrorCode::Unsupported) {
    log::info(kLog, "{} worker {} refused a request: {}", role, worker.key(), error.toString());
    error.message = publicRefusal(error.code);
    return error;
  }
  error.message = fmt::format("{} worker {}: {}", role, worker.key(), error.message);
  return error;
}

double msBetween(trace::TimePoint a, trace::TimePoint b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

std::uint64_t randomSeed() {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard lock(mu);
  return rng();
}

}  // namespace

PdBackendOptions pdBackendOptionsFromConfig(const RouterConfig& config) {
  PdBackendOptions o;
  o.prefill_policy = resolvePrefillPolicy(config);
  o.cache_aware = {config.cache_aware_balance_abs, config.cache_aware_balance_rel};
  o.decode_affinity_entries = static_cast<std::size_t>(config.decode_affinity_entries);
  o.prefill_retries = config.prefill_retries;
  o.decode_retries = config.decode_retries;
  o.max_resumes = config.max_resumes;
  o.remote_prefill_min_tokens = config.remote_prefill_min_tokens;
  o.decode_open_timeout = milliseconds{config.decode_open_timeout_ms};
  o.kv_timeout = milliseconds{config.kv_timeout_ms};
  o.prefill_timeout = milliseconds{config.prefill_timeout_ms};
  o.stream_stall_timeout = milliseconds{config.stream_stall_timeout_ms};
  o.abort_timeout = milliseconds{config.abort_timeout_ms};
  o.max_generations = config.max_generations;
  o.io_threads = static_cast<int>(config.io_threads);
  o.pool_idle_age = milliseconds{config.pool_idle_ms};
  return o;
}

/// What every generation shares: options, the registry, policies, metrics, the io threads and
/// the pool of worker connections.
struct Shared {
  PdBackendOptions options;
  WorkerRegistry& registry;
  const tokenizer::Tokenizer& tokenizer;
  std::unique_ptr<WorkerPolicy> prefill_policy;
  std::unique_ptr<WorkerPolicy> decode_policy;
  metrics::Counter& prefill_retries;
  metrics::Counter& decode_retries;
  metrics::Family<metrics::Counter>& routing_decisions;
  ResumeMetrics resume_metrics;
  std::shared_ptr<http::IoThreads> io;
  bool owns_io = false;
  std::shared_ptr<WorkerClientPool> clients;
  /// pdserve_router_prefills_total{where, reason}: conditional disaggregation's decisions.
  metrics::Family<metrics::Counter>* prefills = nullptr;

  const trace::Tracer& tracer() const {
    return options.tracer != nullptr ? *options.tracer : trace::Tracer::disabled();
  }

  /// A worker of `role` by policy for `prompt`, preferring those not in `tried`; nullopt when none
  /// is ready.
  /// Whether `worker`'s last status says it keeps a decode prefix cache (it then gets the prompt's
  /// token ids in the open, docs/kv-memory.md "Prefix reuse on the decode side").
  // The last polled status of ready decode worker `worker`; nullopt when it is not in rotation.
  std::optional<worker_api::WorkerStatus> decodeStatus(const WorkerAddress& worker) const {
    for (const WorkerView& w : registry.ready(WorkerRole::Decode)) {
      if (w.address == worker) return w.status;
    }
    return std::nullopt;
  }

  // The longest prompt `worker` prefills itself (WorkerStatus::local_prefill_max_tokens); -1 when
  // it does not say.
  std::int64_t localPrefillLimit(const WorkerAddress& worker) const {
    const auto st = decodeStatus(worker);
    return st ? st->local_prefill_max_tokens : -1;
  }

  bool hasDecodePrefixCache(const WorkerAddress& worker) const {
    const auto st = decodeStatus(worker);
    return st && st->prefix_cache_capacity > 0;
  }

  std::optional<WorkerAddress> pick(WorkerRole role, const std::set<std::string>& tried,
                                    std::span<const TokenId> prompt) const {
    auto picked = pickWithWork(role, tried, prompt);
    if (!picked) return std::nullopt;
    return picked->first;
  }

  /// pick(), with the tokens the policy expects the worker to compute (the prompt's when it has no
  /// estimate): what the prefill leg counts as in flight there.
  std::optional<std::pair<WorkerAddress, std::int64_t>> pickWithWork(WorkerRole role,
                                                                     const std::set<std::string>& tried,
                                                                     std::span<const TokenId> prompt) const {
    auto all = registry.ready(role);
    if (all.empty()) return std::nullopt;
    std::vector<WorkerView> fresh;
    for (const auto& w : all) {
      if (tried.count(w.address.key()) == 0) fresh.push_back(w);
    }
    const auto& pool = fresh.empty() ? all : fresh;
    auto& policy = role == WorkerRole::Prefill ? *prefill_policy : *decode_policy;
    const RouteChoice choice = policy.choose(pool, RouteRequest{prompt});
    routing_decisions.labels({std::string(roleName(role)), std::string(choice.reason)}).inc();
    const auto work = choice.work_tokens >= 0 ? choice.work_tokens : static_cast<std::int64_t>(prompt.size());
    return std::make_pair(pool[choice.index].address, work);
  }

  std::unique_ptr<http::AsyncClient> acquire(const WorkerAddress& w) const { return clients->acquire(w.host, w.port); }
  void release(const WorkerAddress& w, std::unique_ptr<http::AsyncClient> client) const {
    clients->release(w.host, w.port, std::move(client));
  }

  /// Best-effort abort/cancel call to a worker (its answer only matters for the log); `then` runs
  /// once it answered or failed, on an io thread.
  void tellAbort(const WorkerAddress& worker, std::string_view path, const std::string& request_id,
                 std::function<void()> then) const {
    auto client = std::make_shared<http::AsyncClient>(io->executor(), worker.host, worker.port);
    // The callback holds the client until the exchange is over (then both go).
    client->send(postJson(options.auth.get(), path, worker_api::toJson(worker_api::AbortRequest{request_id})),
                 options.abort_timeout,
                 [client, path = std::string(path), key = worker.key(), request_id,
                  then = std::move(then)](Result<http::ClientResponse> r) mutable {
                   if (!r.ok() || r.value().status != 200) {
                     log::debug(kLog, "{}: {} at {} failed: {}", request_id, path, key,
                                r.ok() ? fmt::format("status {}", r.value().status) : r.error().toString());
                   }
                   client.reset();
                   if (then) then();
                 });
  }
};

class Generation;

/// The choices of one n > 1 request (docs/kv-memory.md, "Choices share the prompt"). Choice 0's
/// generation opens its decode stream with `choices` = n; once that stream's descriptor is in,
/// every other choice attaches to it on the same decode worker (its own stream, no prefill), and
/// choice 0's prefill — n first tokens, one prompt — goes out when every attach has answered
/// (attached, refused or failed: a choice whose attach fails is prefilled alone as n = 1).
/// Until then choice 0 opens its stream with `choices` = n on every attempt; the children have
/// not begun.
///
/// Thread rules: thread-safe (`mu`); `then` runs on the thread of the last answer, unlocked.
struct ChoiceGroup {
  explicit ChoiceGroup(std::int64_t n) : choices(n) {}
  const std::int64_t choices;  // n
  std::mutex mu;
  // Choices 1..n-1, in order, until they begin (then handed over: an attached choice holds the
  // group, so keeping them here would be a cycle).
  std::vector<std::shared_ptr<Generation>> children;  // guarded by mu
  bool started = false;                               // guarded by mu: the children have begun
  std::int64_t waiting = 0;                           // guarded by mu: attach answers still to come
  std::function<void()> then;                         // guarded by mu: choice 0's prefill

  bool isStarted() {
    std::lock_guard lock(mu);
    return started;
  }
  /// One child's attach answered (exactly once per child once started).
  void answered() {
    std::function<void()> run;
    {
      std::lock_guard lock(mu);
      if (--waiting == 0) run = std::move(then);
    }
    if (run) run();
  }
};

/// The generations alive (not destroyed yet: their last callback has not run). The backend's
/// destructor aborts them and waits for the set to empty.
struct LiveSet {
  std::mutex mu;
  std::condition_variable cv;
  std::unordered_map<const Generation*, std::weak_ptr<Generation>> live;  // guarded by mu
  bool stopping = false;                                                  // guarded by mu
};

/// One generation: a state machine driven by the callbacks of its clients and its timer, on the
/// backend's io threads. No thread of its own, and no callback ever blocks.
///
/// A decode attempt streams D's events (onDecodeLine, then onDecodeDone); its descriptor starts
/// the prefill leg, whose attempts (prefillAttempt, onPrefillDone) run beside it. The attempt
/// ends (endAttempt) once both legs are over, whichever ends last; a failed one is then retried
/// on another D or ends the generation.
///
/// Thread rules: callbacks arrive on any io thread; `mu_` guards the state marked so. The sink
/// and the relay are used without `mu_`, by one chain of callbacks at a time by construction:
/// D's line callbacks and its done callback (one client's strand, in order), then the single
/// caller of endAttempt(), then the next attempt. abort() comes from any thread. Clients are
/// owned here and reached by abort() only under `mu_` while stored, so a cancelled or refused leg
/// can never leave abort() a dangling client.
class Generation : public std::enable_shared_from_this<Generation> {
 public:
  Generation(const Shared& shared, LiveSet& live, GenerationRequest request, std::shared_ptr<TokenSink> sink,
             std::shared_ptr<ChoiceGroup> group = nullptr)
      : s_(shared),
        group_(std::move(group)),
        live_(live),
        req_(std::move(request)),
        sink_(std::move(sink)),
        relay_(shared.tokenizer, req_),
        resume_(shared.options.max_resumes, shared.resume_metrics),
        watch_(shared.io->executor()),
        backoff_(shared.io->executor()) {
    req_.sampling.seed = req_.seed ? static_cast<std::uint64_t>(*req_.seed) : randomSeed();
    if (!req_.logprobs) req_.sampling.top_logprobs = 0;
  }
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;
  Generation(Generation&&) = delete;
  Generation& operator=(Generation&&) = delete;
  ~Generation() {
    std::lock_guard lock(live_.mu);
    live_.live.erase(this);
    live_.cv.notify_all();
  }

  /// Choice `choice` (>= 1) of a ChoiceGroup: its first attempt attaches to the stream
  /// `parent_id` on `worker` (choice 0's) instead of opening one; `group` hears its answer. Call
  /// before begin().
  void attachTo(std::shared_ptr<ChoiceGroup> group, WorkerAddress worker, std::string parent_id, std::int64_t choice) {
    attach_ = AttachTarget{std::move(group), std::move(worker), std::move(parent_id), choice};
  }

  /// Starts the first decode attempt on an io thread.
  void begin() {
    boost::asio::post(s_.io->executor(), [self = shared_from_this()] { self->nextDecodeAttempt(); });
  }

  /// Cuts both legs now; the generation then tells the workers and ends with Cancelled.
  void abort() {
    std::lock_guard lock(mu_);
    if (aborted_) return;
    aborted_ = true;
    backoff_.cancel();  // a generation waiting for room goes on at once (and ends)
    if (a_) {
      if (a_->client) a_->client->cancel();
      if (a_->leg.client) a_->leg.client->cancel();
    }
  }

 private:
  enum class Outcome { Retry, Resume, Wait, Fail };

  /// Where an attached choice's first attempt attaches (attachTo()).
  struct AttachTarget {
    std::shared_ptr<ChoiceGroup> group;
    WorkerAddress worker;
    std::string parent_id;
    std::int64_t choice = 0;
  };

  /// The prefill leg of one decode attempt. Guarded by mu_.
  struct PrefillLeg {
    bool running = false;  // an attempt in flight, or an abort call before the next
    bool stop = false;     // ended by us (the decode leg is over, or the generation aborted)
    bool failed = false;   // ended on its own: every attempt failed
    Error error;           // when failed
    Error last;            // the latest attempt's failure
    // The latest attempt's prefill worker answered that the KV could not reach the decode worker
    // (PeerFailed or Timeout in its answer): the decode target is at fault, not the prefill.
    bool last_blames_decode = false;
    bool blames_decode = false;  // when failed: the leg failed for the decode target's sake
    std::int64_t attempts = 0;
    std::set<std::string> tried;
    worker_api::PrefillSubmit submit;
    std::optional<WorkerAddress> worker;        // of the attempt in flight
    std::unique_ptr<http::AsyncClient> client;  // of the attempt in flight
    trace::Span span;                           // router.prefill_leg of the attempt in flight
    trace::TimePoint submitted;                 // of the attempt in flight
    std::int64_t work_tokens = 0;               // of the attempt in flight: the policy's estimate
  };

  /// One decode attempt. Guarded by mu_ (the fields D's callbacks alone touch too, for clarity).
  struct Attempt {
    std::int64_t index = 0;
    std::string id;  // the worker request id
    WorkerAddress worker;
    bool attached = false;                      // an attached choice's attach (no prefill leg of its own)
    std::int64_t choices = 1;                   // opened for this many choices (a ChoiceGroup's choice 0)
    std::unique_ptr<http::AsyncClient> client;  // while D's stream is open
    bool got_descriptor = false;
    bool stop_hit = false;
    bool preempted = false;      // D's last event was Preempted (stream_error holds its message)
    bool local_prefill = false;  // D prefills the prompt itself (no prefill leg)
    // A resumed leg streams the last token the client has first (GenerationResume::skipFirst).
    std::optional<TokenId> skip_first;
    std::optional<worker_api::DecodeEvent> finish;
    std::optional<Error> stream_error;  // D's error event
    std::optional<Error> protocol_error;
    bool decode_done = false;
    bool succeeded = false;
    /// A finished decode stream whose prefill answer (with its cached_tokens) has not come yet:
    /// delivered when the prefill leg ends (endPrefill), so usage always has the prefix reuse.
    std::optional<FinishEvent> pending_finish;
    std::optional<Result<http::ClientResponse>> response;
    std::optional<std::string> timed_out;
    bool ended = false;
    PrefillLeg leg;
    trace::Span span;  // router.decode_leg: open sent -> D's stream over
    trace::TimePoint sent;
    trace::SpanContext parent;  // of this attempt's leg spans: the request's, or its router.resume
  };

  // ---- the decode leg ----

  void nextDecodeAttempt() {
    if (isAborted()) return fail();
    if (retries_ > s_.options.decode_retries) return fail();
    if (Clock::now() >= req_.deadline) {
      last_ = makeError(ErrorCode::Timeout, "the request's deadline passed");
      return fail();
    }
    const bool attach = attach_.has_value() && attempt_ == 0;
    auto d = attach ? std::optional<WorkerAddress>(attach_->worker)
                    : s_.pick(WorkerRole::Decode, tried_, req_.prompt_token_ids);
    if (!d) {
      if (attempt_ == 0) last_ = makeError(ErrorCode::Overloaded, "no decode worker is ready");
      return fail();
    }
    if (std::exchange(after_wait_, false)) {
      // waitForRoom's next try: neither a retry nor a resume
    } else if (std::exchange(after_attach_, false)) {
      log::info(kLog, "{}: serving the choice alone on decode worker {}: its attach failed: {}", req_.request_id,
                d->key(), last_.toString());
    } else if (resuming_) {
      log::info(kLog, "{}: resuming after {} token(s) on decode worker {} ({}): {}", req_.request_id,
                resume_.generated().size(), d->key(), resumeCauseName(*resuming_), last_.toString());
    } else if (attempt_ > 0) {
      s_.decode_retries.inc();
      log::info(kLog, "{}: retrying on decode worker {} after: {}", req_.request_id, d->key(), last_.toString());
    }
    if (!attach) tried_.insert(d->key());  // an attach did not choose its worker
    const std::string id = resume_.legId(req_.request_id, attempt_);
    if (unshared_) startChoicesAlone();  // once; nothing when they have begun
    const std::int64_t choices = group_ && !group_->isStarted() ? group_->choices : 1;
    worker_api::DecodeOpen open;
    open.request_id = id;
    open.arrival_us = arrival_us_;
    resume_.shapeOpen(req_, open);
    const std::int64_t prompt_tokens = open.prompt_tokens;
    // Conditional disaggregation: a short prompt is prefilled by the decode worker itself.
    const std::int64_t min_remote = s_.options.remote_prefill_min_tokens;
    // One choice's leg only: n > 1 shares one remote prefill among its choices (attach).
    const bool one_choice = choices == 1 && !attach;
    const bool short_prompt = min_remote > 0 && prompt_tokens < min_remote;
    // The worker's own limit: a tensor-parallel worker prefills nothing, others up to
    // decode.local_prefill_max_tokens; past it the prompt goes to a prefill worker.
    const std::int64_t limit = one_choice && short_prompt ? s_.localPrefillLimit(*d) : -1;
    const bool worker_refuses = limit >= 0 && prompt_tokens > limit;
    const bool local = one_choice && short_prompt && !worker_refuses;
    const char* reason = min_remote == 0 ? "disabled"
                         : !one_choice   ? "choices"
                         : !short_prompt ? "long_prompt"
                         : local         ? "short_prompt"
                                         : "worker_limit";
    if (local) {
      worker_api::PrefillSubmit shaped;  // the tokens and first token a prefill worker would get
      resume_.shapePrefill(req_, shaped);
      open.local_prompt_token_ids = std::move(shaped.token_ids);
      open.forced_first_token = shaped.forced_first_token;
    } else if (!attach && prompt_tokens <= kMaxDecodePrefixTokens && s_.hasDecodePrefixCache(*d)) {
      worker_api::PrefillSubmit shaped;  // the prompt the prefill worker gets: what the blocks hold
      resume_.shapePrefill(req_, shaped);
      open.prompt_token_ids = std::move(shaped.token_ids);
    }
    open.sampling = req_.sampling;
    open.logprobs = req_.logprobs;
    open.stop_token_ids = req_.stop_token_ids;
    open.ignore_eos = req_.ignore_eos;
    open.constraint = req_.constraint;
    open.tool_call_format = req_.tool_call_format;
    open.choices = choices;
    if (attach) {
      open.attach_to = attach_->parent_id;
      open.choice = attach_->choice;
    }
    open.kv_timeout_ms = std::min(s_.options.kv_timeout, remainingUntil(req_.deadline)).count();
    open.prefill_attempts = s_.options.prefill_retries + 1;
    const trace::TimePoint sent = trace::Clock::now();
    if (attempt_ == 0 && req_.handed_at != trace::TimePoint{}) {
      s_.tracer().record(req_.trace, "router.route", req_.handed_at, sent, {{"pd.decode_worker", d->key()}});
    }
    // After a resume the legs are children of its router.resume span (docs/observability.md).
    const trace::SpanContext leg_parent = resume_span_.context().valid() ? resume_span_.context() : req_.trace;
    trace::Span leg_span = s_.tracer().startSpan("router.decode_leg", leg_parent, trace::SpanKind::Client, sent);
    leg_span.setAttribute("pd.worker", d->key());
    leg_span.setAttribute("pd.attempt", attempt_);
    open.traceparent = leg_span.traceparent();

    auto client = s_.acquire(*d);
    std::unique_lock lock(mu_);
    if (aborted_) {
      lock.unlock();
      return fail();  // the client never went out: abort() never saw it
    }
    a_ = std::make_unique<Attempt>();
    a_->index = attempt_;
    a_->id = id;
    a_->worker = *d;
    a_->attached = attach;
    a_->choices = choices;
    a_->client = std::move(client);
    a_->span = std::move(leg_span);
    a_->sent = sent;
    a_->parent = leg_parent;
    report_.decode_worker = d->key();
    report_.decode_attempts = attempt_ + 1;
    if (attempt_ == 0 && req_.handed_at != trace::TimePoint{}) report_.route_ms = msBetween(req_.handed_at, sent);
    a_->skip_first = resume_.skipFirst();
    a_->local_prefill = local;
    report_.prefill_where = local ? "local" : "remote";
    report_.prefill_reason = reason;
    if (s_.prefills != nullptr) s_.prefills->labels({local ? "local" : "remote", reason}).inc();
    s_.registry.noteSent(WorkerRole::Decode, d->key(), prompt_tokens + open.max_tokens);
    armWatchLocked(s_.options.decode_open_timeout, fmt::format("decode worker {} sent no KV descriptor within {} ms",
                                                               d->key(), s_.options.decode_open_timeout.count()));
    a_->client->streamLines(
        postJson(s_.options.auth.get(), worker_api::kDecodeOpenPath, worker_api::toJson(open)),
        remainingUntil(req_.deadline),
        [self = shared_from_this()](std::string_view line) { return self->onDecodeLine(line); },
        [self = shared_from_this()](Result<http::ClientResponse> r) { self->onDecodeDone(std::move(r)); });
  }

  /// One line of D's stream (D's client strand). False stops reading (the stream is then cut).
  bool onDecodeLine(std::string_view line) {
    if (line.empty()) return true;
    auto parsed = worker_api::parseDecodeEvent(line);
    std::unique_lock lock(mu_);
    Attempt& a = *a_;
    if (!parsed.ok()) {
      a.protocol_error = makeError(ErrorCode::Corrupt, fmt::format("decode worker {} sent a malformed event: {}",
                                                                   a.worker.key(), parsed.error().message));
      return false;
    }
    auto& ev = parsed.value();
    if (a.finish || a.stream_error) return true;  // nothing may follow the last event
    if (ev.type == worker_api::DecodeEventType::Preempted) {
      a.preempted = true;
      a.stream_error = makeError(ErrorCode::Overloaded,
                                 fmt::format("decode worker {} preempted the request: {}", a.worker.key(), ev.message));
      return true;
    }
    if (ev.type == worker_api::DecodeEventType::Error) {
      a.stream_error = fromWorker(Error{ev.code, ev.message}, "decode", a.worker);
      return true;
    }
    if (!a.got_descriptor) {
      if (ev.type != worker_api::DecodeEventType::Descriptor) {
        a.protocol_error = makeError(ErrorCode::Corrupt,
                                     fmt::format("decode worker {} did not start with a descriptor", a.worker.key()));
        return false;
      }
      a.got_descriptor = true;
      report_.decode_open_ms = msBetween(a.sent, trace::Clock::now());
      if (a.local_prefill) {
        // The decode worker prefills the prompt itself: no prefill leg, no KV to wait for beyond
        // its own compute (the same deadline as a transfer's).
        armWatchLocked(s_.options.kv_timeout + s_.options.stream_stall_timeout,
                       fmt::format("no token from decode worker {} within {} ms of its local prefill's start",
                                   a.worker.key(), (s_.options.kv_timeout + s_.options.stream_stall_timeout).count()));
        return true;
      }
      armWatchLocked(s_.options.kv_timeout + s_.options.stream_stall_timeout,
                     fmt::format("no token from decode worker {} within {} ms of its descriptor", a.worker.key(),
                                 (s_.options.kv_timeout + s_.options.stream_stall_timeout).count()));
      if (a.attached) {
        // Choice 0's prefill brings this choice's KV and first token.
        lock.unlock();
        answerGroup();
        return true;
      }
      PrefillLeg& leg = a.leg;
      leg.running = true;
      leg.submit.request_id = a.id;
      resume_.shapePrefill(req_, leg.submit);
      leg.submit.sampling = req_.sampling;
      leg.submit.logprobs = req_.logprobs;
      leg.submit.constraint = req_.constraint;
      leg.submit.tool_call_format = req_.tool_call_format;
      leg.submit.kv_descriptor = std::move(ev.kv_descriptor);
      leg.submit.kv_descriptor_tag = std::move(ev.kv_descriptor_tag);
      leg.submit.choices = a.choices;
      const WorkerAddress worker = a.worker;
      const std::string id = a.id;
      const bool start_choices = a.choices > 1;
      lock.unlock();
      if (start_choices) {
        startChoices(worker, id);  // the prefill goes out once every choice has attached
      } else {
        prefillAttempt();
      }
      return true;
    }
    switch (ev.type) {
      case worker_api::DecodeEventType::Tokens: {
        armWatchLocked(s_.options.stream_stall_timeout,
                       fmt::format("decode worker {} went silent for {} ms", a.worker.key(),
                                   s_.options.stream_stall_timeout.count()));
        if (a.skip_first && !ev.token_ids.empty()) {
          if (ev.token_ids.front() != *a.skip_first) {
            a.protocol_error =
                makeError(ErrorCode::Corrupt, fmt::format("decode worker {} resumed with token {}, not {}",
                                                          a.worker.key(), ev.token_ids.front(), *a.skip_first));
            return false;
          }
          ev.token_ids.erase(ev.token_ids.begin());
          if (!ev.logprobs.empty()) ev.logprobs.erase(ev.logprobs.begin());
          a.skip_first.reset();
        }
        lock.unlock();
        auto step = relay_.push(ev.token_ids, ev.logprobs);
        if (step.delta) {
          resume_.noteRelayed(step.delta->token_ids);
          sink_->onTokens(std::move(*step.delta));
        }
        lock.lock();
        a.stop_hit = step.stop_matched;
        return !step.stop_matched;
      }
      case worker_api::DecodeEventType::Finish:
        a.finish = std::move(ev);
        return true;
      default:
        a.protocol_error =
            makeError(ErrorCode::Corrupt, fmt::format("decode worker {} sent a second descriptor", a.worker.key()));
        return false;
    }
  }

  /// D's stream ended (D's client strand): a normal end delivers the finish; anything else ends
  /// the prefill leg too, and the attempt is judged in endAttempt().
  void onDecodeDone(Result<http::ClientResponse> response) {
    answerGroup();  // an attach that ended without attaching has answered too
    std::unique_lock lock(mu_);
    Attempt& a = *a_;
    cancelWatchLocked();
    std::unique_ptr<http::AsyncClient> client = std::move(a.client);  // abort() cannot reach it from here on
    a.timed_out = std::exchange(timed_out_, std::nullopt);
    const bool success = a.stop_hit || (a.finish && response.ok() && !aborted_);
    if (!success)
      a.span.setError(response.ok() ? "the decode stream ended without a finish" : response.error().message);
    a.span.end();
    if (success) {
      // A finished, uncut stream leaves the connection reusable (a stop string cut it).
      if (!a.stop_hit && !a.timed_out && response.value().complete) s_.release(a.worker, std::move(client));
      const bool stop_hit = a.stop_hit;
      const auto reason = stop_hit ? FinishReason::Stop : a.finish->finish_reason;
      const std::int64_t cached = cached_tokens_;
      lock.unlock();
      FinishEvent end = TokenRelay::stopped();
      bool cut = stop_hit;
      if (!stop_hit) {
        auto tail = relay_.finish(reason);
        cut = tail.stop_matched;
        end = std::move(tail.event);
      }
      lock.lock();
      a.succeeded = true;
      a.decode_done = true;
      // A stop string closed the stream, which aborts the request at D; the explicit abort also
      // covers a worker that has not noticed yet. The prefill is over (its first token came).
      if (cut && a.leg.running) stopPrefillLocked();
      if (cut) s_.tellAbort(a.worker, worker_api::kDecodeAbortPath, a.id, [self = shared_from_this()] {});
      if (!cut && a.leg.running) {
        // P's answer (queue, compute, cached_tokens) is still on its way: the finish waits for it.
        a.pending_finish = std::move(end);
        lock.unlock();
        maybeEndAttempt();
        return;
      }
      end.end.cached_prompt_tokens = cut ? cached : cached_tokens_;
      lock.unlock();
      sink_->onFinish(std::move(end));
      maybeEndAttempt();
      return;
    }
    a.response = std::move(response);
    a.decode_done = true;
    if (a.leg.running && !a.leg.failed) stopPrefillLocked();
    lock.unlock();
    maybeEndAttempt();
  }

  /// Ends the attempt once both legs are over; runs its end exactly once.
  void maybeEndAttempt() {
    std::optional<GenerationReport> report;
    {
      std::lock_guard lock(mu_);
      if (!a_->decode_done || a_->leg.running || a_->ended) return;
      a_->ended = true;
      if (a_->succeeded) report = report_;
    }
    // The sink has its finish: the generation is over, and its report complete (both legs ended).
    if (report) return sink_->onReport(*report);
    endFailedAttempt();
  }

  /// A failed attempt: tell D (its blocks), then judge the failure.
  void endFailedAttempt() {
    bool tell = false;
    WorkerAddress d;
    std::string id;
    {
      std::lock_guard lock(mu_);
      const bool ended_by_worker = a_->stream_error.has_value() && a_->response->ok();
      tell = a_->got_descriptor && !ended_by_worker;
      d = a_->worker;
      id = a_->id;
    }
    if (tell) {
      s_.tellAbort(d, worker_api::kDecodeAbortPath, id, [self = shared_from_this()] { self->judgeFailedAttempt(); });
    } else {
      judgeFailedAttempt();
    }
  }

  void judgeFailedAttempt() {
    Outcome outcome = Outcome::Fail;
    bool attach_retry = false;
    {
      std::lock_guard lock(mu_);
      Attempt& a = *a_;
      Error error;
      LegEnd end;  // what the resume logic needs to know (generation_resume.h)
      bool judge_decode = true;
      if (aborted_) {
        error = makeError(ErrorCode::Cancelled, "the generation was aborted");
        judge_decode = false;
      } else if (a.leg.failed) {
        error = a.leg.error;
        // The KV could not reach this decode worker: another decode worker may take the attempt
        // (or the resume), as if its stream had been cut.
        end.kv_unreachable = a.leg.blames_decode;
        judge_decode = a.leg.blames_decode;
      } else {
        const auto& response = *a.response;
        end.preempted = a.preempted;
        end.stalled = a.timed_out.has_value() && Clock::now() < req_.deadline;
        end.transport_failed = !a.timed_out && !response.ok();
        if (response.ok() && response.value().status != 200) {
          end.refused = worker_api::parseErrorJson(response.value().status, response.value().body).code;
        }
        if (a.stream_error) end.error = a.stream_error->code;
        end.protocol_error = a.protocol_error.has_value();
        if (a.timed_out) {
          error = makeError(ErrorCode::Timeout, *a.timed_out);
        } else if (!response.ok()) {
          error = response.error();
          if (workerUnreachable(error.code) && !ownDeadline(error.code)) {
            s_.registry.reportFailure(WorkerRole::Decode, a.worker.key(), error.message);
          }
        } else if (response.value().status != 200) {
          error = fromWorker(worker_api::parseErrorJson(response.value().status, response.value().body), "decode",
                             a.worker);
        } else if (a.protocol_error) {
          error = *a.protocol_error;
        } else if (a.stream_error) {
          error = *a.stream_error;
        } else {
          error = makeError(ErrorCode::PeerFailed,
                            fmt::format("the stream of decode worker {} ended without a finish event", a.worker.key()));
        }
      }
      if (judge_decode) {
        const std::optional<ResumeCause> cause = classifyLegEnd(end);
        const bool in_time = Clock::now() < req_.deadline;
        // D refused the open because its pool is full now (or it drains): once the retries on
        // other workers are spent, wait for room instead of failing (docs/kv-memory.md).
        const bool full = end.refused == ErrorCode::Overloaded;
        const bool may_retry = !relay_.committed() && !a.preempted && !resuming_;
        if (end.refused == ErrorCode::Unsupported && a.choices > 1 && !relay_.committed() && in_time) {
          // The decode worker cannot share one prompt among choices (tensor parallelism refuses
          // `choices` > 1): choice 0 is served alone and so is every other choice, each as n = 1
          // with its own seed, which gives the same tokens. Not a retry.
          log::info(kLog, "{}: decode worker {} cannot share the prompt among {} choices ({}); serving each alone",
                    req_.request_id, a.worker.key(), a.choices, error.message);
          outcome = Outcome::Retry;
          attach_retry = true;
          unshared_ = true;
        } else if (a.attached && !relay_.committed() && in_time) {
          // The attach failed (choice 0's stream is gone, or it ended before its KV): this choice
          // is served alone, as n = 1 with its own seed, prefill included. Not a retry.
          outcome = Outcome::Retry;
          attach_retry = true;
        } else if (full && in_time) {
          outcome = may_retry && retries_ < s_.options.decode_retries ? Outcome::Retry : Outcome::Wait;
        } else if (may_retry) {
          if (in_time && decodeRetryable(error.code)) outcome = Outcome::Retry;
        } else if (cause && in_time && resume_.take(*cause)) {
          outcome = Outcome::Resume;
          resuming_ = cause;
          // Prefer another worker, but the one that failed may take it again when it is the only one.
          tried_ = {a.worker.key()};
        }
      }
      last_ = std::move(error);
    }
    if (outcome == Outcome::Fail) return fail();
    if (outcome == Outcome::Wait) return waitForRoom();
    if (outcome == Outcome::Retry && !attach_retry) ++retries_;
    after_attach_ = attach_retry;
    if (outcome == Outcome::Resume && static_cast<std::int64_t>(resume_.generated().size()) >= req_.max_tokens) {
      // Every token the request may have was relayed; only the finish event was lost.
      FinishEvent end = relay_.finish(FinishReason::Length).event;
      sink_->onFinish(std::move(end));
      return;
    }
    if (outcome == Outcome::Resume) startResumeSpan();
    ++attempt_;
    nextDecodeAttempt();
  }

  /// router.resume (driving chain): from the decision to resume to the next resume or the
  /// generation's end; the legs opened meanwhile are its children. Ends the previous one.
  void startResumeSpan() {
    resume_span_ = s_.tracer().startSpan("router.resume", req_.trace);
    resume_span_.setAttribute("pd.cause", std::string(resumeCauseName(*resuming_)));
    resume_span_.setAttribute("pd.attempt", resume_.resumes());
    resume_span_.setAttribute("pd.tokens_carried", static_cast<std::int64_t>(resume_.generated().size()));
  }

  /// Every decode worker tried refused for want of room: the next attempt (on whichever worker
  /// the policy picks then) after a backoff, 20 ms doubling up to 500 ms, within the deadline.
  void waitForRoom() {
    const milliseconds delay = std::min(milliseconds{20LL << std::min<std::int64_t>(waits_, 5)}, milliseconds{500});
    ++waits_;
    after_wait_ = true;
    if (waits_ == 1 || waits_ % 20 == 0) {
      log::debug(kLog, "{}: no decode worker has room ({}); waiting", req_.request_id, last_.toString());
    }
    std::lock_guard lock(mu_);
    if (aborted_) {
      boost::asio::post(s_.io->executor(), [self = shared_from_this()] { self->nextDecodeAttempt(); });
      return;
    }
    tried_.clear();
    backoff_.expires_at(std::min(Clock::now() + delay, req_.deadline));
    backoff_.async_wait([self = shared_from_this()](const boost::system::error_code&) { self->nextDecodeAttempt(); });
  }

  /// The terminal error (the last failure, or Cancelled after abort()).
  void fail() {
    answerGroup();
    abandonChoices();
    if (isAborted()) last_ = makeError(ErrorCode::Cancelled, "the generation was aborted");
    GenerationReport report;
    {
      std::lock_guard lock(mu_);
      report = report_;
    }
    sink_->onReport(report);
    sink_->onError(std::move(last_));
  }

  // ---- choices (ChoiceGroup) ----

  /// Choice 0's descriptor is in: every other choice attaches to stream `id` on `worker`; the
  /// prefill goes out once all have answered.
  void startChoices(const WorkerAddress& worker, const std::string& id) {
    std::vector<std::shared_ptr<Generation>> children;
    {
      std::lock_guard lock(group_->mu);
      group_->started = true;
      group_->waiting = static_cast<std::int64_t>(group_->children.size());
      group_->then = [self = shared_from_this()] { self->prefillAttempt(); };
      children = std::exchange(group_->children, {});
    }
    for (std::size_t i = 0; i < children.size(); ++i) {
      children[i]->attachTo(group_, worker, id, static_cast<std::int64_t>(i) + 1);
      children[i]->begin();
    }
  }

  /// Choice 0's decode worker refused to share its prompt: every other choice begins now, alone
  /// (no attach), as its own n = 1 generation with its own seed. Once; nothing if they began.
  void startChoicesAlone() {
    if (!group_) return;
    std::vector<std::shared_ptr<Generation>> children;
    {
      std::lock_guard lock(group_->mu);
      if (group_->started) return;
      group_->started = true;
      children = std::exchange(group_->children, {});
    }
    for (auto& child : children) child->begin();
  }

  /// An attached choice's attach has answered (once; later calls do nothing).
  void answerGroup() {
    if (!attach_ || answered_.exchange(true)) return;
    attach_->group->answered();
  }

  /// Choice 0 failed before its choices began: they end too (Cancelled), each through its sink.
  void abandonChoices() {
    if (!group_) return;
    std::vector<std::shared_ptr<Generation>> children;
    {
      std::lock_guard lock(group_->mu);
      if (group_->started) return;
      group_->started = true;
      children = std::exchange(group_->children, {});
    }
    for (auto& child : children) {
      child->abort();
      child->begin();  // ends at once: aborted
    }
  }

  // ---- the prefill leg ----

  /// The next prefill attempt, or the leg's end (stopped, failed, or out of attempts).
  void prefillAttempt() {
    std::unique_lock lock(mu_);
    PrefillLeg& leg = a_->leg;
    // No new attempt once D's stream is over (it finished: the prefill's work is done anyway).
    if (aborted_ || leg.stop || a_->decode_done) return endPrefill(lock);
    // A prefill that could not deliver the KV is retried on another prefill worker into the
    // same decode worker (the fault may be the first one's link); when all fail that way, the
    // decode worker counts as lost (judgeFailedAttempt).
    if (leg.attempts > 0 && (!prefillRetryable(leg.last.code) || Clock::now() >= req_.deadline)) {
      return prefillFailed(lock);
    }
    if (leg.attempts > s_.options.prefill_retries) return prefillFailed(lock);
    const auto picked = s_.pickWithWork(WorkerRole::Prefill, leg.tried, leg.submit.token_ids);
    const std::optional<WorkerAddress> p = picked ? std::optional(picked->first) : std::nullopt;
    if (!p) {
      if (leg.attempts == 0) leg.last = makeError(ErrorCode::Overloaded, "no prefill worker is ready");
      return prefillFailed(lock);
    }
    if (leg.attempts > 0) {
      s_.prefill_retries.inc();
      log::info(kLog, "{}: retrying the prefill on {} after: {}", leg.submit.request_id, p->key(), leg.last.toString());
    }
    ++leg.attempts;
    leg.tried.insert(p->key());
    const milliseconds budget = std::min(s_.options.prefill_timeout, remainingUntil(req_.deadline));
    leg.submit.timeout_ms = budget.count();
    leg.worker = *p;
    leg.client = s_.acquire(*p);
    s_.registry.noteSent(WorkerRole::Prefill, p->key(), static_cast<std::int64_t>(req_.prompt_token_ids.size()));
    leg.work_tokens = picked->second;
    s_.registry.noteInFlight(WorkerRole::Prefill, p->key(), 1, leg.work_tokens);
    leg.span = s_.tracer().startSpan("router.prefill_leg", a_->parent, trace::SpanKind::Client);
    leg.span.setAttribute("pd.worker", p->key());
    leg.span.setAttribute("pd.attempt", leg.attempts - 1);
    leg.submit.traceparent = leg.span.traceparent();
    leg.submitted = trace::Clock::now();
    report_.prefill_worker = p->key();
    ++report_.prefill_attempts;
    // The worker answers by its own deadline; the margin lets its answer arrive.
    leg.client->send(postJson(s_.options.auth.get(), worker_api::kPrefillPath, worker_api::toJson(leg.submit)),
                     budget + s_.options.abort_timeout, [self = shared_from_this()](Result<http::ClientResponse> r) {
                       self->onPrefillDone(std::move(r));
                     });
  }

  void onPrefillDone(Result<http::ClientResponse> response) {
    std::unique_lock lock(mu_);
    PrefillLeg& leg = a_->leg;
    std::unique_ptr<http::AsyncClient> client = std::move(leg.client);
    const WorkerAddress p = *leg.worker;
    const std::string id = leg.submit.request_id;
    s_.registry.noteInFlight(WorkerRole::Prefill, p.key(), -1, -leg.work_tokens);
    const bool stopped = leg.stop || aborted_;
    trace::Span span = std::move(leg.span);  // ends as this returns (with an error set on failure)
    if (!stopped && response.ok()) s_.release(p, std::move(client));
    if (stopped) {
      if (response.ok()) return endPrefill(lock);
      // Cut by us: closing the connection cancels at P; say it explicitly too.
      lock.unlock();
      s_.tellAbort(p, worker_api::kPrefillCancelPath, id, [self = shared_from_this()] {
        std::unique_lock relock(self->mu_);
        self->endPrefill(relock);
      });
      return;
    }
    bool cancel_at_p = false;
    if (response.ok() && response.value().status == 200) {
      auto outcome = worker_api::parsePrefillOutcome(response.value().body);
      if (outcome.ok()) {
        log::debug(kLog, "{}: prefilled on {}: queue {:.1f} ms, compute {:.1f} ms, transfer {:.1f} ms", id, p.key(),
                   outcome.value().queue_ms, outcome.value().compute_ms, outcome.value().transfer_ms);
        span.end();
        report_.prefill_ms = msBetween(leg.submitted, trace::Clock::now());
        report_.prefill_queue_ms = outcome.value().queue_ms;
        report_.prefill_compute_ms = outcome.value().compute_ms;
        report_.prefill_transfer_ms = outcome.value().transfer_ms;
        cached_tokens_ = outcome.value().cached_tokens;
        return endPrefill(lock);
      }
      leg.last = makeError(ErrorCode::Corrupt,
                           fmt::format("prefill worker {} answered malformed: {}", p.key(), outcome.error().message));
    } else {
      leg.last = fromWorker(responseError(response), "prefill", p);
      // The prefill worker itself answered: a PeerFailed or Timeout is its KV transfer's.
      leg.last_blames_decode = response.ok() && workerUnreachable(leg.last.code) && !ownDeadline(leg.last.code);
      if (!response.ok() && workerUnreachable(leg.last.code) && !ownDeadline(leg.last.code)) {
        s_.registry.reportFailure(WorkerRole::Prefill, p.key(), leg.last.message);
        cancel_at_p = true;
      }
    }
    span.setError(leg.last.message);
    span.end();
    lock.unlock();
    if (cancel_at_p) {
      s_.tellAbort(p, worker_api::kPrefillCancelPath, id, [self = shared_from_this()] { self->prefillAttempt(); });
    } else {
      prefillAttempt();
    }
  }

  /// Every attempt failed: the generation fails with the last error; D's stream is cut now (D
  /// would otherwise wait for attempts that will not come).
  void prefillFailed(std::unique_lock<std::mutex>& lock) {
    PrefillLeg& leg = a_->leg;
    if (!leg.stop) {
      log::warn(kLog, "{}: prefill failed: {}", leg.submit.request_id, leg.last.toString());
      leg.failed = true;
      leg.error = leg.last;
      leg.blames_decode = leg.last_blames_decode;
      if (a_->client) a_->client->cancel();
    }
    endPrefill(lock);
  }

  void endPrefill(std::unique_lock<std::mutex>& lock) {
    a_->leg.running = false;
    std::optional<FinishEvent> finish = std::exchange(a_->pending_finish, std::nullopt);
    if (finish) finish->end.cached_prompt_tokens = cached_tokens_;
    lock.unlock();
    if (finish) sink_->onFinish(std::move(*finish));
    maybeEndAttempt();
  }

  void stopPrefillLocked() {
    a_->leg.stop = true;
    if (a_->leg.client) a_->leg.client->cancel();
  }

  // ---- deadlines of the legs: one timer on the io_context, re-armed as the stream advances ----

  void armWatchLocked(milliseconds after, std::string reason) {
    watch_.expires_at(std::min(Clock::now() + after, req_.deadline));  // cancels the previous wait
    watch_reason_ = std::move(reason);
    const std::uint64_t armed = ++watch_armed_;
    watch_.async_wait([self = shared_from_this(), armed](const boost::system::error_code& ec) {
      if (ec) return;
      self->watchFired(armed);
    });
  }
  void cancelWatchLocked() {
    ++watch_armed_;
    watch_.cancel();
  }
  void watchFired(std::uint64_t armed) {
    std::lock_guard lock(mu_);
    if (armed != watch_armed_) return;  // re-armed or cancelled since
    timed_out_ = watch_reason_;
    if (a_ && a_->client) a_->client->cancel();
  }

  bool isAborted() {
    std::lock_guard lock(mu_);
    return aborted_;
  }
  /// A timeout at or past the request's own deadline (the client's request_timeout_ms): the
  /// request ran out of time, which says nothing about the worker's health.
  bool ownDeadline(ErrorCode code) const { return code == ErrorCode::Timeout && Clock::now() >= req_.deadline; }

  const Shared& s_;
  const std::shared_ptr<ChoiceGroup> group_;  // choice 0 of n > 1: the other choices
  std::optional<AttachTarget> attach_;        // choice i >= 1 of n > 1 (set before begin())
  std::atomic<bool> answered_{false};         // the attach has answered the group
  LiveSet& live_;
  GenerationRequest req_;
  std::shared_ptr<TokenSink> sink_;
  // The driving chain's own (see the thread rules).
  TokenRelay relay_;
  GenerationResume resume_;
  std::optional<ResumeCause> resuming_;  // set once the generation has been resumed (the latest cause)
  trace::Span resume_span_;              // router.resume of the latest resume (startResumeSpan)
  // When the generation arrived (µs since the epoch): every leg's DecodeOpen.arrival_us.
  const std::int64_t arrival_us_ =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  std::int64_t attempt_ = 0;
  std::int64_t retries_ = 0;   // decode retries used (before any token reached the client)
  std::int64_t waits_ = 0;     // waits for a decode worker with room (waitForRoom)
  bool after_wait_ = false;    // the next attempt follows a wait
  bool after_attach_ = false;  // the next attempt serves an attached choice alone (its attach failed)
  bool unshared_ = false;      // choice 0's decode worker refused to share the prompt: choices run alone
  std::set<std::string> tried_;
  Error last_ = makeError(ErrorCode::Overloaded, "no decode worker is ready");

  std::mutex mu_;
  bool aborted_ = false;                  // guarded by mu_
  std::unique_ptr<Attempt> a_;            // guarded by mu_: the current decode attempt
  boost::asio::steady_timer watch_;       // guarded by mu_
  boost::asio::steady_timer backoff_;     // guarded by mu_: waitForRoom's
  std::uint64_t watch_armed_ = 0;         // guarded by mu_
  std::string watch_reason_;              // guarded by mu_
  std::optional<std::string> timed_out_;  // guarded by mu_
  GenerationReport report_;               // guarded by mu_
  std::int64_t cached_tokens_ = 0;        // guarded by mu_: the last prefill answer's prefix-cache reuse
};

namespace {

class Control final : public GenerationControl {
 public:
  explicit Control(std::weak_ptr<Generation> g) { g_.push_back(std::move(g)); }
  explicit Control(std::vector<std::weak_ptr<Generation>> g) : g_(std::move(g)) {}
  void abort() override {
    for (auto& weak : g_) {
      if (auto g = weak.lock()) g->abort();
    }
  }

 private:
  std::vector<std::weak_ptr<Generation>> g_;
};

}  // namespace

class PdBackend::Impl {
 public:
  explicit Impl(Shared shared) : shared_(std::move(shared)) {}
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  Impl(Impl&&) = delete;
  Impl& operator=(Impl&&) = delete;

  // NOLINTNEXTLINE(bugprone-exception-escape): only allocation or mutex failures throw here; terminate is right then
  ~Impl() {
    std::vector<std::shared_ptr<Generation>> all;
    {
      std::lock_guard lock(live_.mu);
      live_.stopping = true;
      for (auto& [p, weak] : live_.live) {
        if (auto g = weak.lock()) all.push_back(std::move(g));
      }
    }
    for (auto& g : all) g->abort();
    all.clear();
    {
      // Every generation ends within its abort calls' deadline once aborted.
      std::unique_lock lock(live_.mu);
      live_.cv.wait(lock, [&] { return live_.live.empty(); });
    }
    shared_.clients->close();
    if (shared_.owns_io) shared_.io->stop();
  }

  Result<std::unique_ptr<GenerationControl>> start(GenerationRequest request, std::shared_ptr<TokenSink> sink) {
    if (draining_.load()) return makeError(ErrorCode::Overloaded, "the router is draining");
    if (!ready()) return makeError(ErrorCode::Overloaded, "no prefill and decode workers are ready");
    auto g = std::make_shared<Generation>(shared_, live_, std::move(request), std::move(sink));
    {
      std::lock_guard lock(live_.mu);
      if (live_.stopping) return makeError(ErrorCode::Overloaded, "the router is shutting down");
      // `g` is not in the set yet: its destructor must not count here.
      if (static_cast<std::int64_t>(live_.live.size()) >= shared_.options.max_generations) {
        return makeError(ErrorCode::Overloaded, "too many generations are running");
      }
      live_.live.emplace(g.get(), g);
    }
    g->begin();
    return std::unique_ptr<GenerationControl>(std::make_unique<Control>(g));
  }

  /// n > 1 (ChoiceGroup): one generation per choice, choice i seeded choiceSeed(seed, i); choice 0
  /// leads, the others begin when its descriptor is in.
  Result<std::unique_ptr<GenerationControl>> startChoices(GenerationRequest request,
                                                          std::vector<std::shared_ptr<TokenSink>> sinks) {
    if (sinks.size() == 1) return start(std::move(request), std::move(sinks.front()));
    if (sinks.empty() || static_cast<std::int64_t>(sinks.size()) > pd::kMaxChoices) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("{} choices", sinks.size()));
    }
    if (draining_.load()) return makeError(ErrorCode::Overloaded, "the router is draining");
    if (!ready()) return makeError(ErrorCode::Overloaded, "no prefill and decode workers are ready");
    const auto seed = static_cast<std::uint64_t>(request.seed.value_or(static_cast<std::int64_t>(randomSeed())));
    request.seed = static_cast<std::int64_t>(seed);
    auto group = std::make_shared<ChoiceGroup>(static_cast<std::int64_t>(sinks.size()));
    std::vector<std::shared_ptr<Generation>> all;
    for (std::size_t i = 1; i < sinks.size(); ++i) {
      GenerationRequest r = request;
      r.request_id = fmt::format("{}-c{}", request.request_id, i);
      r.seed = static_cast<std::int64_t>(pd::choiceSeed(seed, static_cast<std::int64_t>(i)));
      group->children.push_back(std::make_shared<Generation>(shared_, live_, std::move(r), std::move(sinks[i])));
    }
    auto lead = std::make_shared<Generation>(shared_, live_, std::move(request), std::move(sinks[0]), group);
    all.push_back(lead);
    all.insert(all.end(), group->children.begin(), group->children.end());
    {
      std::lock_guard lock(live_.mu);
      if (live_.stopping) return makeError(ErrorCode::Overloaded, "the router is shutting down");
      if (static_cast<std::int64_t>(live_.live.size() + all.size()) > shared_.options.max_generations) {
        return makeError(ErrorCode::Overloaded, "too many generations are running");
      }
      for (const auto& g : all) live_.live.emplace(g.get(), g);
    }
    lead->begin();
    std::vector<std::weak_ptr<Generation>> weak(all.begin(), all.end());
    return std::unique_ptr<GenerationControl>(std::make_unique<Control>(std::move(weak)));
  }

  void beginDrain() { draining_.store(true); }

  bool ready() const {
    return !draining_.load() && shared_.registry.hasReady(WorkerRole::Prefill) &&
           shared_.registry.hasReady(WorkerRole::Decode);
  }

  std::int64_t running() const {
    std::lock_guard lock(live_.mu);
    return static_cast<std::int64_t>(live_.live.size());
  }

  std::shared_ptr<http::IoThreads> ioThreads() const { return shared_.io; }

 private:
  Shared shared_;
  mutable LiveSet live_;
  std::atomic<bool> draining_{false};
};

PdBackend::PdBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PdBackend::~PdBackend() = default;

Result<std::unique_ptr<PdBackend>> PdBackend::create(PdBackendOptions options, WorkerRegistry& registry,
                                                     const tokenizer::Tokenizer& tokenizer,
                                                     metrics::Registry& metrics) {
  PD_ASSIGN_OR_RETURN(auto prefill_policy,
                      makePrefillPolicy(options.prefill_policy, registry.prefixIndex(), options.cache_aware));
  if (options.decode_affinity_entries == 0) {
    return makeError(ErrorCode::InvalidArgument, "decode_affinity_entries must be positive");
  }
  if (options.prefill_retries < 0 || options.decode_retries < 0 || options.max_resumes < 0 ||
      options.max_generations < 1) {
    return makeError(ErrorCode::InvalidArgument, "retries and max_resumes must be >= 0 and max_generations >= 1");
  }
  if (options.pool_idle_age <= milliseconds{0}) {
    return makeError(ErrorCode::InvalidArgument, "pool_idle_age must be positive");
  }
  std::shared_ptr<http::IoThreads> io = options.io;
  const bool owns_io = !io;
  if (owns_io) {
    PD_ASSIGN_OR_RETURN(io, http::IoThreads::start(options.io_threads, std::string(kLog)));
  }
  auto clients = WorkerClientPool::create(io->executor(), {.idle_age = options.pool_idle_age});
  auto& retries = metrics.counter("pdserve_router_retries_total",
                                  "Generation legs retried on another worker, by leg (prefill or decode).", {"leg"});
  auto& decisions =
      metrics.counter("pdserve_router_routing_decisions_total",
                      "Workers chosen, by role and the policy's reason (docs/routing.md).", {"role", "reason"});
  auto decode_policy = makeDecodeAffinityPolicy(options.decode_affinity_entries);
  Shared shared{std::move(options),
                registry,
                tokenizer,
                std::move(prefill_policy),
                std::move(decode_policy),
                retries.labels({"prefill"}),
                retries.labels({"decode"}),
                decisions,
                ResumeMetrics(metrics),
                std::move(io),
                owns_io,
                std::move(clients)};
  shared.prefills = &metrics.counter(
      "pdserve_router_prefills_total",
      "Prompts (of every leg) by where they were prefilled: remote (a prefill worker) or local (the decode "
      "worker itself, router.remote_prefill_min_tokens), and why (worker_limit: short, but longer than the decode "
      "worker prefills itself).",
      {"where", "reason"});
  return std::unique_ptr<PdBackend>(new PdBackend(std::make_unique<Impl>(std::move(shared))));
}

Result<std::unique_ptr<GenerationControl>> PdBackend::start(GenerationRequest request,
                                                            std::shared_ptr<TokenSink> sink) {
  return impl_->start(std::move(request), std::move(sink));
}
Result<std::unique_ptr<GenerationControl>> PdBackend::startChoices(GenerationRequest request,
                                                                   std::vector<std::shared_ptr<TokenSink>> sinks) {
  return impl_->startChoices(std::move(request), std::move(sinks));
}
bool PdBackend::ready() const {
  return impl_->ready();
}
std::int64_t PdBackend::running() const {
  return impl_->running();
}
void PdBackend::beginDrain() {
  impl_->beginDrain();
}
std::shared_ptr<http::IoThreads> PdBackend::ioThreads() const {
  return impl_->ioThreads();
}

}  // namespace pd::router
