#include "pd/router/pd_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "pd/common/http_client.h"
#include "pd/common/log.h"
#include "pd/common/worker_api.h"
#include "pd/router/worker_policy.h"
#include "token_relay.h"

namespace pd::router {
namespace {

constexpr std::string_view kLog = "router.pd";
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
      return "the prompt plus max_tokens needs more KV cache than a decode worker has; shorten the prompt or lower "
             "max_tokens";
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

std::uint64_t randomSeed() {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard lock(mu);
  return rng();
}

}  // namespace

PdBackendOptions pdBackendOptionsFromConfig(const RouterConfig& config) {
  PdBackendOptions o;
  o.prefill_policy = config.prefill_policy;
  o.prefill_retries = config.prefill_retries;
  o.decode_retries = config.decode_retries;
  o.decode_open_timeout = milliseconds{config.decode_open_timeout_ms};
  o.kv_timeout = milliseconds{config.kv_timeout_ms};
  o.prefill_timeout = milliseconds{config.prefill_timeout_ms};
  o.stream_stall_timeout = milliseconds{config.stream_stall_timeout_ms};
  o.abort_timeout = milliseconds{config.abort_timeout_ms};
  o.max_generations = config.max_generations;
  return o;
}

/// Idle keep-alive connections to workers, reused by later generations: a leg then costs no TCP
/// connect. A client goes back only after an exchange that ended normally and was never
/// cancelled; one idle for more than kMaxIdle is dropped (workers close idle connections after
/// their own idle timeout, 60 s by default; a reused connection the worker did close is retried
/// once on a fresh one by http::Client).
class ClientPool {
 public:
  std::unique_ptr<http::Client> acquire(const WorkerAddress& worker) {
    {
      std::lock_guard lock(mu_);
      auto it = idle_.find(worker.key());
      const auto now = Clock::now();
      while (it != idle_.end() && !it->second.empty()) {
        Entry e = std::move(it->second.back());
        it->second.pop_back();
        if (now - e.since < kMaxIdle) return std::move(e.client);
      }
    }
    return std::make_unique<http::Client>(worker.host, worker.port);
  }
  void release(const WorkerAddress& worker, std::unique_ptr<http::Client> client) {
    if (!client || client->cancelled()) return;
    std::lock_guard lock(mu_);
    auto& idle = idle_[worker.key()];
    if (idle.size() < kMaxIdlePerWorker) idle.push_back(Entry{std::move(client), Clock::now()});
  }

 private:
  static constexpr std::chrono::seconds kMaxIdle{5};
  static constexpr std::size_t kMaxIdlePerWorker = 256;
  struct Entry {
    std::unique_ptr<http::Client> client;
    Clock::time_point since;
  };
  std::mutex mu_;
  std::map<std::string, std::vector<Entry>> idle_;  // guarded by mu_: by worker key
};

/// What every generation shares: options, the registry, policies, metrics.
struct Shared {
  PdBackendOptions options;
  WorkerRegistry& registry;
  const tokenizer::Tokenizer& tokenizer;
  std::unique_ptr<WorkerPolicy> prefill_policy;
  std::unique_ptr<WorkerPolicy> decode_policy;
  metrics::Counter& prefill_retries;
  metrics::Counter& decode_retries;
  std::shared_ptr<ClientPool> clients = std::make_shared<ClientPool>();

  /// A worker of `role` by policy, preferring those not in `tried`; nullopt when none is ready.
  std::optional<WorkerAddress> pick(WorkerRole role, const std::set<std::string>& tried) const {
    auto all = registry.ready(role);
    if (all.empty()) return std::nullopt;
    std::vector<WorkerView> fresh;
    for (const auto& w : all) {
      if (tried.count(w.address.key()) == 0) fresh.push_back(w);
    }
    const auto& pool = fresh.empty() ? all : fresh;
    auto& policy = role == WorkerRole::Prefill ? *prefill_policy : *decode_policy;
    return pool[policy.choose(pool)].address;
  }

  /// Best-effort abort/cancel call to a worker (its answer only matters for the log).
  void tellAbort(const WorkerAddress& worker, std::string_view path, const std::string& request_id) const {
    http::Client client(worker.host, worker.port);
    auto r = client.send(postJson(options.auth.get(), path, worker_api::toJson(worker_api::AbortRequest{request_id})),
                         options.abort_timeout);
    if (!r.ok() || r.value().status != 200) {
      log::debug(kLog, "{}: {} at {} failed: {}", request_id, path, worker.key(),
                 r.ok() ? fmt::format("status {}", r.value().status) : r.error().toString());
    }
  }
};

/// One generation: the sink, both legs, and the state abort() and the watchdog touch.
///
/// Thread rules: run() and the prefill leg run on their own threads; abort() and watch() come
/// from any thread. `mu_` guards the fields marked so; the sink is called only from the run()
/// thread.
class Generation : public std::enable_shared_from_this<Generation> {
 public:
  Generation(const Shared& shared, GenerationRequest request, std::shared_ptr<TokenSink> sink)
      : s_(shared), req_(std::move(request)), sink_(std::move(sink)), relay_(shared.tokenizer, req_) {
    req_.sampling.seed = req_.seed ? static_cast<std::uint64_t>(*req_.seed) : randomSeed();
    if (!req_.logprobs) req_.sampling.top_logprobs = 0;
  }

  void startThread() {
    thread_ = std::thread([self = shared_from_this()] { self->run(); });
  }
  void join() {
    if (thread_.joinable()) thread_.join();
  }
  [[nodiscard]] bool finished() const { return finished_.load(); }

  /// Cuts both legs now; run() then tells the workers and ends with Cancelled.
  void abort() {
    std::lock_guard lock(mu_);
    if (aborted_) return;
    aborted_ = true;
    if (decode_client_ != nullptr) decode_client_->cancel();
    if (prefill_client_ != nullptr) prefill_client_->cancel();
  }

  /// Called by the watchdog: fires a leg's deadline that has passed.
  void watch(Clock::time_point now) {
    std::lock_guard lock(mu_);
    if (!watch_deadline_ || now < *watch_deadline_) return;
    watch_deadline_.reset();
    timed_out_ = watch_reason_;
    if (decode_client_ != nullptr) decode_client_->cancel();
  }

 private:
  enum class Outcome { Done, Retry, Fail };

  /// The prefill leg of one decode attempt.
  struct PrefillLeg {
    std::thread thread;
    bool stop = false;    // guarded by mu_
    bool failed = false;  // guarded by mu_
    Error error;          // guarded by mu_
  };

  void run() {
    Error last = makeError(ErrorCode::Overloaded, "no decode worker is ready");
    std::set<std::string> tried;
    bool done = false;
    for (std::int64_t attempt = 0; attempt <= s_.options.decode_retries && !done; ++attempt) {
      if (isAborted()) break;
      if (Clock::now() >= req_.deadline) {
        last = makeError(ErrorCode::Timeout, "the request's deadline passed");
        break;
      }
      auto d = s_.pick(WorkerRole::Decode, tried);
      if (!d) {
        if (attempt == 0) last = makeError(ErrorCode::Overloaded, "no decode worker is ready");
        break;
      }
      if (attempt > 0) {
        s_.decode_retries.inc();
        log::info(kLog, "{}: retrying on decode worker {} after: {}", req_.request_id, d->key(), last.toString());
      }
      tried.insert(d->key());
      Error error;
      const Outcome outcome = decodeAttempt(*d, attempt, error);
      if (outcome == Outcome::Done) {
        done = true;
      } else {
        last = std::move(error);
        if (outcome == Outcome::Fail) break;
      }
    }
    if (!done) {
      if (isAborted()) last = makeError(ErrorCode::Cancelled, "the generation was aborted");
      sink_->onError(std::move(last));
    }
    finished_.store(true);
  }

  Outcome decodeAttempt(const WorkerAddress& d, std::int64_t attempt, Error& error) {
    const std::string id = attempt == 0 ? req_.request_id : fmt::format("{}-retry{}", req_.request_id, attempt);
    const auto prompt_tokens = static_cast<std::int64_t>(req_.prompt_token_ids.size());
    worker_api::DecodeOpen open;
    open.request_id = id;
    open.prompt_tokens = prompt_tokens;
    open.max_tokens = req_.max_tokens;
    open.sampling = req_.sampling;
    open.logprobs = req_.logprobs;
    open.stop_token_ids = req_.stop_token_ids;
    open.ignore_eos = req_.ignore_eos;
    open.kv_timeout_ms = std::min(s_.options.kv_timeout, remainingUntil(req_.deadline)).count();
    open.prefill_attempts = s_.options.prefill_retries + 1;

    auto client_owner = s_.clients->acquire(d);
    http::Client& client = *client_owner;
    if (!setDecodeClient(&client)) {
      error = makeError(ErrorCode::Cancelled, "aborted");
      return Outcome::Fail;
    }
    s_.registry.noteSent(WorkerRole::Decode, d.key(), prompt_tokens + req_.max_tokens);
    setWatch(s_.options.decode_open_timeout, fmt::format("decode worker {} sent no KV descriptor within {} ms", d.key(),
                                                         s_.options.decode_open_timeout.count()));

    bool got_descriptor = false;
    bool stop_hit = false;
    std::optional<worker_api::DecodeEvent> finish;
    std::optional<Error> stream_error;  // D's error event
    std::optional<Error> protocol_error;
    PrefillLeg leg;
    const auto on_line = [&](std::string_view line) -> bool {
      if (line.empty()) return true;
      auto parsed = worker_api::parseDecodeEvent(line);
      if (!parsed.ok()) {
        protocol_error = makeError(ErrorCode::Corrupt, fmt::format("decode worker {} sent a malformed event: {}",
                                                                   d.key(), parsed.error().message));
        return false;
      }
      auto& ev = parsed.value();
      if (finish || stream_error) return true;  // nothing may follow the last event
      if (ev.type == worker_api::DecodeEventType::Error) {
        stream_error = fromWorker(Error{ev.code, ev.message}, "decode", d);
        return true;
      }
      if (!got_descriptor) {
        if (ev.type != worker_api::DecodeEventType::Descriptor) {
          protocol_error =
              makeError(ErrorCode::Corrupt, fmt::format("decode worker {} did not start with a descriptor", d.key()));
          return false;
        }
        got_descriptor = true;
        setWatch(s_.options.kv_timeout + s_.options.stream_stall_timeout,
                 fmt::format("no token from decode worker {} within {} ms of its descriptor", d.key(),
                             (s_.options.kv_timeout + s_.options.stream_stall_timeout).count()));
        leg.thread = std::thread([this, &leg, id, kv = std::move(ev.kv_descriptor),
                                  tag = std::move(ev.kv_descriptor_tag)] { runPrefill(leg, id, kv, tag); });
        return true;
      }
      switch (ev.type) {
        case worker_api::DecodeEventType::Tokens:
          setWatch(s_.options.stream_stall_timeout, fmt::format("decode worker {} went silent for {} ms", d.key(),
                                                                s_.options.stream_stall_timeout.count()));
          stop_hit = relayTokens(ev);
          return !stop_hit;
        case worker_api::DecodeEventType::Finish:
          finish = std::move(ev);
          return true;
        default:
          protocol_error =
              makeError(ErrorCode::Corrupt, fmt::format("decode worker {} sent a second descriptor", d.key()));
          return false;
      }
    };
    auto response =
        client.streamLines(postJson(s_.options.auth.get(), worker_api::kDecodeOpenPath, worker_api::toJson(open)),
                           remainingUntil(req_.deadline), on_line);
    clearWatch();
    setDecodeClient(nullptr);
    const std::optional<std::string> timed_out = takeTimeout();

    // The normal ends: the decode worker finished, or a stop string matched.
    if (stop_hit || (finish && response.ok() && !isAborted())) {
      // A finished, uncut stream leaves the connection reusable (a stop string cut it).
      if (!stop_hit && !timed_out && response.value().complete) s_.clients->release(d, std::move(client_owner));
      FinishEvent end = TokenRelay::stopped();
      if (!stop_hit) {
        auto tail = relay_.finish(finish->finish_reason);
        stop_hit = tail.stop_matched;
        end = std::move(tail.event);
      }
      sink_->onFinish(std::move(end));
      // A stop string closed the stream, which aborts the request at D; the explicit abort also
      // covers a worker that has not noticed yet. The prefill is over (its first token came).
      stopPrefill(leg, /*cancel=*/stop_hit, id);
      if (stop_hit) s_.tellAbort(d, worker_api::kDecodeAbortPath, id);
      return Outcome::Done;
    }

    // Everything else is a failure of this attempt. Make sure both legs are over first.
    const bool prefill_failed = stopPrefill(leg, /*cancel=*/true, id);
    const bool ended_by_worker = stream_error.has_value() && response.ok();
    if (got_descriptor && !ended_by_worker) s_.tellAbort(d, worker_api::kDecodeAbortPath, id);
    if (isAborted()) {
      error = makeError(ErrorCode::Cancelled, "the generation was aborted");
      return Outcome::Fail;
    }
    if (prefill_failed) {
      std::lock_guard lock(mu_);
      error = leg.error;
      return Outcome::Fail;
    }
    if (timed_out) {
      error = makeError(ErrorCode::Timeout, *timed_out);
    } else if (!response.ok()) {
      error = response.error();
      if (workerUnreachable(error.code) && !ownDeadline(error.code)) {
        s_.registry.reportFailure(WorkerRole::Decode, d.key(), error.message);
      }
    } else if (response.value().status != 200) {
      error = fromWorker(worker_api::parseErrorJson(response.value().status, response.value().body), "decode", d);
    } else if (protocol_error) {
      error = *protocol_error;
    } else if (stream_error) {
      error = *stream_error;
    } else {
      error = makeError(ErrorCode::PeerFailed,
                        fmt::format("the stream of decode worker {} ended without a finish event", d.key()));
    }
    if (relay_.committed()) return Outcome::Fail;
    if (Clock::now() >= req_.deadline) return Outcome::Fail;
    return decodeRetryable(error.code) ? Outcome::Retry : Outcome::Fail;
  }

  /// Hands a tokens event to the sink through the relay. True when a stop string matched (the
  /// generation ends here).
  bool relayTokens(const worker_api::DecodeEvent& ev) {
    auto step = relay_.push(ev.token_ids, ev.logprobs);
    if (step.delta) sink_->onTokens(std::move(*step.delta));
    return step.stop_matched;
  }

  /// The prefill leg: attempts on prefill workers until one succeeds, the attempts run out, or
  /// the leg is stopped. On failure it cuts the decode stream (run() then aborts it at D).
  void runPrefill(PrefillLeg& leg, const std::string& id, const std::string& kv_descriptor,
                  const std::string& kv_descriptor_tag) {
    worker_api::PrefillSubmit submit;
    submit.request_id = id;
    submit.token_ids = req_.prompt_token_ids;
    submit.sampling = req_.sampling;
    submit.logprobs = req_.logprobs;
    submit.kv_descriptor = kv_descriptor;
    submit.kv_descriptor_tag = kv_descriptor_tag;
    const auto prompt_tokens = static_cast<std::int64_t>(req_.prompt_token_ids.size());

    std::set<std::string> tried;
    Error last = makeError(ErrorCode::Overloaded, "no prefill worker is ready");
    for (std::int64_t attempt = 0; attempt <= s_.options.prefill_retries; ++attempt) {
      auto p = s_.pick(WorkerRole::Prefill, tried);
      if (!p) {
        if (attempt == 0) last = makeError(ErrorCode::Overloaded, "no prefill worker is ready");
        break;
      }
      if (attempt > 0) {
        s_.prefill_retries.inc();
        log::info(kLog, "{}: retrying the prefill on {} after: {}", id, p->key(), last.toString());
      }
      tried.insert(p->key());
      const milliseconds budget = std::min(s_.options.prefill_timeout, remainingUntil(req_.deadline));
      submit.timeout_ms = budget.count();
      auto client_owner = s_.clients->acquire(*p);
      http::Client& client = *client_owner;
      if (!setPrefillClient(leg, &client)) return;
      s_.registry.noteSent(WorkerRole::Prefill, p->key(), prompt_tokens);
      // The worker answers by its own deadline; the margin lets its answer arrive.
      auto response = client.send(postJson(s_.options.auth.get(), worker_api::kPrefillPath, worker_api::toJson(submit)),
                                  budget + s_.options.abort_timeout);
      const bool stopped = !setPrefillClient(leg, nullptr);
      if (!stopped && response.ok()) s_.clients->release(*p, std::move(client_owner));
      if (stopped) {
        // Cut by us: closing the connection cancels at P; say it explicitly too.
        if (!response.ok()) s_.tellAbort(*p, worker_api::kPrefillCancelPath, id);
        return;
      }
      if (response.ok() && response.value().status == 200) {
        auto outcome = worker_api::parsePrefillOutcome(response.value().body);
        if (outcome.ok()) {
          log::debug(kLog, "{}: prefilled on {}: queue {:.1f} ms, compute {:.1f} ms, transfer {:.1f} ms", id, p->key(),
                     outcome.value().queue_ms, outcome.value().compute_ms, outcome.value().transfer_ms);
          return;
        }
        last = makeError(ErrorCode::Corrupt,
                         fmt::format("prefill worker {} answered malformed: {}", p->key(), outcome.error().message));
      } else {
        last = fromWorker(responseError(response), "prefill", *p);
        if (!response.ok() && workerUnreachable(last.code) && !ownDeadline(last.code)) {
          s_.registry.reportFailure(WorkerRole::Prefill, p->key(), last.message);
          s_.tellAbort(*p, worker_api::kPrefillCancelPath, id);
        }
      }
      if (!prefillRetryable(last.code) || Clock::now() >= req_.deadline) break;
    }
    log::warn(kLog, "{}: prefill failed: {}", id, last.toString());
    {
      std::lock_guard lock(mu_);
      if (leg.stop) return;
      leg.failed = true;
      leg.error = std::move(last);
      // End the decode stream now: D would otherwise wait for attempts that will not come.
      if (decode_client_ != nullptr) decode_client_->cancel();
    }
  }

  /// Ends the prefill leg (cancelling it if asked) and joins it. True if it failed on its own.
  bool stopPrefill(PrefillLeg& leg, bool cancel, const std::string& /*id*/) {
    if (!leg.thread.joinable()) return false;
    if (cancel) {
      std::lock_guard lock(mu_);
      if (!leg.failed) {
        leg.stop = true;
        if (prefill_client_ != nullptr) prefill_client_->cancel();
      }
    }
    leg.thread.join();
    std::lock_guard lock(mu_);
    return leg.failed;
  }

  /// Registers the decode leg's client; false when the generation was aborted. A refused client
  /// is not stored: its owner is about to destroy it, and abort() must never reach it.
  bool setDecodeClient(http::Client* client) {
    std::lock_guard lock(mu_);
    const bool go = !aborted_;
    decode_client_ = go ? client : nullptr;
    return go;
  }

  /// Registers the prefill leg's client; false when the leg must stop (stopped or aborted), and
  /// then the client is not stored (as setDecodeClient).
  bool setPrefillClient(PrefillLeg& leg, http::Client* client) {
    std::lock_guard lock(mu_);
    const bool go = !aborted_ && !leg.stop;
    prefill_client_ = go ? client : nullptr;
    return go;
  }

  void setWatch(milliseconds after, std::string reason) {
    std::lock_guard lock(mu_);
    watch_deadline_ = std::min(Clock::now() + after, req_.deadline);
    watch_reason_ = std::move(reason);
  }
  void clearWatch() {
    std::lock_guard lock(mu_);
    watch_deadline_.reset();
  }
  std::optional<std::string> takeTimeout() {
    std::lock_guard lock(mu_);
    return std::exchange(timed_out_, std::nullopt);
  }
  bool isAborted() {
    std::lock_guard lock(mu_);
    return aborted_;
  }
  /// A timeout at or past the request's own deadline (the client's request_timeout_ms): the
  /// request ran out of time, which says nothing about the worker's health.
  bool ownDeadline(ErrorCode code) const { return code == ErrorCode::Timeout && Clock::now() >= req_.deadline; }

  const Shared& s_;
  GenerationRequest req_;
  std::shared_ptr<TokenSink> sink_;
  // The run() thread's own.
  TokenRelay relay_;
  std::thread thread_;
  std::atomic<bool> finished_{false};

  std::mutex mu_;
  bool aborted_ = false;                             // guarded by mu_
  http::Client* decode_client_ = nullptr;            // guarded by mu_
  http::Client* prefill_client_ = nullptr;           // guarded by mu_
  std::optional<Clock::time_point> watch_deadline_;  // guarded by mu_
  std::string watch_reason_;                         // guarded by mu_
  std::optional<std::string> timed_out_;             // guarded by mu_
};

namespace {

class Control final : public GenerationControl {
 public:
  explicit Control(std::weak_ptr<Generation> g) : g_(std::move(g)) {}
  void abort() override {
    if (auto g = g_.lock()) g->abort();
  }

 private:
  std::weak_ptr<Generation> g_;
};

}  // namespace

class PdBackend::Impl {
 public:
  explicit Impl(Shared shared) : shared_(std::move(shared)), watchdog_([this] { watchLoop(); }) {}
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  ~Impl() {
    std::list<std::shared_ptr<Generation>> all;
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      all = live_;
    }
    cv_.notify_all();
    watchdog_.join();
    for (auto& g : all) g->abort();
    for (auto& g : all) g->join();
  }

  Result<std::unique_ptr<GenerationControl>> start(GenerationRequest request, std::shared_ptr<TokenSink> sink) {
    if (draining_.load()) return makeError(ErrorCode::Overloaded, "the router is draining");
    if (!ready()) return makeError(ErrorCode::Overloaded, "no prefill and decode workers are ready");
    auto g = std::make_shared<Generation>(shared_, std::move(request), std::move(sink));
    {
      std::lock_guard lock(mu_);
      if (stopping_) return makeError(ErrorCode::Overloaded, "the router is shutting down");
      if (static_cast<std::int64_t>(live_.size()) >= shared_.options.max_generations) {
        return makeError(ErrorCode::Overloaded, "too many generations are running");
      }
      live_.push_back(g);
      g->startThread();
    }
    return std::unique_ptr<GenerationControl>(std::make_unique<Control>(g));
  }

  void beginDrain() { draining_.store(true); }

  bool ready() const {
    return !draining_.load() && shared_.registry.hasReady(WorkerRole::Prefill) &&
           shared_.registry.hasReady(WorkerRole::Decode);
  }

  std::int64_t running() const {
    std::lock_guard lock(mu_);
    std::int64_t n = 0;
    for (const auto& g : live_) n += g->finished() ? 0 : 1;
    return n;
  }

 private:
  /// Fires legs' deadlines and joins the threads of finished generations.
  void watchLoop() {
    std::unique_lock lock(mu_);
    while (!stopping_) {
      cv_.wait_for(lock, milliseconds{10});
      const auto now = Clock::now();
      std::vector<std::shared_ptr<Generation>> done;
      for (auto it = live_.begin(); it != live_.end();) {
        if ((*it)->finished()) {
          done.push_back(std::move(*it));
          it = live_.erase(it);
        } else {
          (*it)->watch(now);
          ++it;
        }
      }
      lock.unlock();
      for (auto& g : done) g->join();
      done.clear();
      lock.lock();
    }
  }

  Shared shared_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::list<std::shared_ptr<Generation>> live_;
  bool stopping_ = false;
  std::atomic<bool> draining_{false};
  std::thread watchdog_;
};

PdBackend::PdBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PdBackend::~PdBackend() = default;

Result<std::unique_ptr<PdBackend>> PdBackend::create(PdBackendOptions options, WorkerRegistry& registry,
                                                     const tokenizer::Tokenizer& tokenizer,
                                                     metrics::Registry& metrics) {
  PD_ASSIGN_OR_RETURN(auto prefill_policy, makePrefillPolicy(options.prefill_policy));
  if (options.prefill_retries < 0 || options.decode_retries < 0 || options.max_generations < 1) {
    return makeError(ErrorCode::InvalidArgument, "retries must be >= 0 and max_generations >= 1");
  }
  auto& retries = metrics.counter("pdserve_router_retries_total",
                                  "Generation legs retried on another worker, by leg (prefill or decode).", {"leg"});
  Shared shared{std::move(options),
                registry,
                tokenizer,
                std::move(prefill_policy),
                makeMostFreeBlocksPolicy(),
                retries.labels({"prefill"}),
                retries.labels({"decode"})};
  return std::unique_ptr<PdBackend>(new PdBackend(std::make_unique<Impl>(std::move(shared))));
}

Result<std::unique_ptr<GenerationControl>> PdBackend::start(GenerationRequest request,
                                                            std::shared_ptr<TokenSink> sink) {
  return impl_->start(std::move(request), std::move(sink));
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

}  // namespace pd::router
