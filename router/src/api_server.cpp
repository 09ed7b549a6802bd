#include "pd/router/api_server.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <utility>

#include "chat_output.h"
#include "cpu_pool.h"
#include "deadline_scheduler.h"
#include "json_writer.h"
#include "openai_response.h"
#include "pd/common/crypto.h"
#include "pd/common/http_message.h"
#include "pd/common/io_threads.h"
#include "pd/common/log.h"
#include "pd/common/log_format.h"
#include "pd/common/probe_routes.h"
#include "pd/router/json_text.h"
#include "pd/router/key_limits.h"
#include "pd/router/openai_request.h"
#include "pd/router/status_page.h"

namespace pd::router {
namespace {

constexpr std::string_view kLog = "router";
constexpr std::string_view kJson = "application/json";
using Clock = std::chrono::steady_clock;

std::int64_t unixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double secondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

/// The router's metrics; references stay valid as long as the registry (which outlives us).
struct FrontEndMetrics {
  explicit FrontEndMetrics(metrics::Registry& r)
      : requests(r.counter("pdserve_router_requests_total",
                           "Requests answered, by endpoint and HTTP status (499: the client went away).",
                           {"endpoint", "status"})),
        ttft(r.histogram("pdserve_router_time_to_first_token_seconds",
                         "Time from receiving a generation request to its first token.", metrics::latencyBuckets())
                 .get()),
        tpot(r.histogram("pdserve_router_time_per_output_token_seconds",
                         "Mean time between output tokens after the first, per request.",
                         {0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0})
                 .get()),
        itl(r.histogram("pdserve_router_inter_token_latency_seconds",
                        "Time between successive output tokens as the client receives them (tokens that arrive "
                        "together share their gap).",
                        {0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5})
                .get()),
        e2e(r.histogram("pdserve_router_e2e_request_latency_seconds",
                        "Time from receiving a generation request to its last byte.", metrics::latencyBuckets())
                .get()),
        in_flight(r.gauge("pdserve_router_requests_in_flight", "Generation requests being served.").get()),
        waiting(r.gauge("pdserve_router_requests_waiting",
                        "Generation requests admitted and waiting for their first token (the queue).")
                    .get()),
        prompt_tokens(r.counter("pdserve_router_prompt_tokens_total", "Prompt tokens of admitted requests.").get()),
        generation_tokens(r.counter("pdserve_router_generation_tokens_total", "Tokens generated for clients.").get()),
        rate_limited(r.counter("pdserve_router_rate_limited_total",
                               "Requests refused with 429 by their API key's limits, by limit (concurrent or tokens).",
                               {"limit"})),
        cpu_queue(r.gauge("pdserve_router_cpu_queue_depth",
                          "Requests waiting for a CPU thread to parse, template and tokenize them.")
                      .get()),
        cpu_rejected(r.counter("pdserve_router_cpu_queue_rejected_total",
                               "Requests refused with 503 because the CPU queue was full.")
                         .get()) {
    // Retries happen in the backend, which increments these on the same registry.
    auto& retries = r.counter("pdserve_router_retries_total",
                              "Generation legs retried on another worker, by leg (prefill or decode).", {"leg"});
    retries.labels({"prefill"});
    retries.labels({"decode"});
  }

  metrics::Family<metrics::Counter>& requests;
  metrics::Histogram& ttft;
  metrics::Histogram& tpot;
  metrics::Histogram& itl;
  metrics::Histogram& e2e;
  metrics::Gauge& in_flight;
  metrics::Gauge& waiting;
  metrics::Counter& prompt_tokens;
  metrics::Counter& generation_tokens;
  metrics::Family<metrics::Counter>& rate_limited;
  metrics::Gauge& cpu_queue;
  metrics::Counter& cpu_rejected;
};

/// What every request of one server shares. Each request holds it (shared_ptr: a backend may
/// deliver a late event after the ApiServer is gone), so it owns only values and references to
/// things that outlive every generation.
struct FrontEnd {
  FrontEnd(const ApiServerOptions& o, CompletionBackend& b, const PromptRenderer& pr, metrics::Registry& r)
      : served_model_name(o.served_model_name),
        max_model_len(o.max_model_len),
        default_completion_max_tokens(o.default_completion_max_tokens),
        max_queued_requests(o.max_queued_requests),
        max_n(o.max_n),
        request_timeout(o.request_timeout),
        retry_after(o.retry_after),
        api_keys(o.api_keys),
        grammars(o.grammars),
        tool_parser(o.tool_parser),
        reasoning_parser(o.reasoning_parser),
        prompt_opens_think(o.prompt_opens_think),
        key_limiter(o.api_keys.limits()),
        backend(b),
        renderer(pr),
        tracer(o.tracer != nullptr ? *o.tracer : trace::Tracer::disabled()),
        log_prompts(o.log_prompts),
        registry(r),
        metrics(r),
        started_at(unixSeconds()) {}

  void countRequest(std::string_view endpoint, int status) {
    metrics.requests.labels({std::string(endpoint), std::to_string(status)}).inc();
  }
  http::Response errorResponse(const ApiError& e, std::string_view request_id) const {
    http::Response r = http::Response::withBody(e.status, std::string(kJson), errorJson(e));
    if (e.status == 429 || e.status == 503) r.headers.push_back({"Retry-After", std::to_string(retry_after.count())});
    if (e.status == 401) r.headers.push_back({"WWW-Authenticate", "Bearer"});
    if (!request_id.empty()) r.headers.push_back({"X-Request-Id", std::string(request_id)});
    return r;
  }

  const std::string served_model_name;
  const std::int64_t max_model_len;
  const std::int64_t default_completion_max_tokens;
  const std::int64_t max_queued_requests;
  const std::int64_t max_n;
  const std::chrono::milliseconds request_timeout;
  const std::chrono::seconds retry_after;
  const ApiKeySet api_keys;
  const std::shared_ptr<structured::GrammarCache> grammars;
  const std::optional<structured::ToolCallFormat> tool_parser;
  const bool reasoning_parser;
  const bool prompt_opens_think;
  KeyLimiter key_limiter;
  CompletionBackend& backend;
  const PromptRenderer& renderer;
  const trace::Tracer& tracer;
  const bool log_prompts;
  metrics::Registry& registry;
  FrontEndMetrics metrics;
  const std::int64_t started_at;
  std::atomic<std::int64_t> waiting{0};
  std::atomic<std::int64_t> in_flight{0};
  /// Weak: the ApiServer owns the scheduler; a late event after it is gone just skips the cancel.
  std::weak_ptr<DeadlineScheduler> deadlines;
};

ApiError serverError(int status, std::string code, std::string message) {
  return ApiError{status, "server_error", std::move(code), std::move(message)};
}

/// A backend error as the client sees it (the mapping documented in completion_backend.h).
ApiError fromBackendError(const Error& e) {
  switch (e.code) {
    case ErrorCode::InvalidArgument:
    case ErrorCode::ResourceExhausted:
    case ErrorCode::Unsupported:
      return invalidRequest(e.message);
    case ErrorCode::Overloaded:
      return serverError(503, "service_unavailable", "no worker can take the request now; retry later");
    case ErrorCode::PeerFailed:
    case ErrorCode::Corrupt:
    case ErrorCode::Io:
      return serverError(502, "upstream_error", "a worker failed while serving the request");
    case ErrorCode::Timeout:
      return serverError(504, "upstream_timeout", "a worker did not answer in time");
    case ErrorCode::Cancelled:
      return serverError(503, "cancelled", "the request was cancelled by the server");
    case ErrorCode::NotFound:
    case ErrorCode::Internal:
    case ErrorCode::Unauthenticated:  // the cluster secret is misconfigured: not the client's doing
      break;
  }
  return serverError(500, "internal_error", "internal error");
}

/// The front end's part of a request's log line: its phases before the backend, and the prompt
/// when `router.log_prompts` is on.
struct RequestLog {
  double validate_ms = 0;
  std::optional<double> template_ms;  ///< chat only
  double tokenize_ms = 0;
  std::optional<std::string> prompt;
};

double msBetween(trace::TimePoint a, trace::TimePoint b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

/// One generation request from admission to its last byte: the backend's TokenSink (of choice 0;
/// ChoiceSink forwards choice i's events with n > 1), and the target of the client-gone and
/// deadline callbacks. With n > 1 every choice has its own output state (parser, sanitizer, text);
/// the answer is complete when every choice finished, and any choice's error fails the request
/// (the other choices are aborted).
///
/// Thread rules: the backend calls each choice's sink methods serially, and the choices' sinks
/// concurrently; clientGone() and deadlinePassed() come from io threads, concurrently with them. `mu_` guards
/// everything; the backend's abort() and the scheduler's cancel() are called without it (either
/// may call back into this object).
class RequestState final : public TokenSink, public std::enable_shared_from_this<RequestState> {
 public:
  RequestState(std::shared_ptr<FrontEnd> fe, http::Exchange exchange, ResponseShape shape, bool stream,
               std::string endpoint, std::vector<TokenId> prompt_ids, Clock::time_point received,
               KeyLimiter::Lease lease, trace::Span span, RequestLog log,
               std::vector<std::unique_ptr<ChatOutputParser>> parsers)
      : fe_(std::move(fe)),
        exchange_(std::move(exchange)),
        shape_(std::move(shape)),
        stream_(stream),
        endpoint_(std::move(endpoint)),
        prompt_ids_(std::move(prompt_ids)),
        received_(received),
        lease_(std::move(lease)),
        span_(std::move(span)),
        log_(std::move(log)) {
    PD_CHECK(!parsers.empty());
    choices_.resize(parsers.size());
    for (std::size_t i = 0; i < parsers.size(); ++i) {
      choices_[i].shape = shape_;
      choices_[i].shape.index = static_cast<std::int64_t>(i);
      choices_[i].parser = std::move(parsers[i]);
    }
  }

  void onTokens(TokenDelta delta) override { choiceTokens(0, std::move(delta)); }
  void onFinish(FinishEvent finish) override { choiceFinish(0, finish); }
  void onError(Error error) override { choiceError(0, error); }
  void onReport(const GenerationReport& report) override {
    std::lock_guard lock(mu_);
    report_ = report;
  }

  /// Choice i's events (the backend's sink for choice i forwards here).
  void choiceTokens(std::size_t index, TokenDelta delta) {
    std::lock_guard lock(mu_);
    if (done_) return;
    Choice& c = choices_[index];
    const auto now = Clock::now();
    if (!first_token_at_) {
      first_token_at_ = now;
      stream_span_ = span_.child("router.stream");
      leaveQueue();
      fe_->metrics.ttft.observe(secondsBetween(received_, now));
    } else if (!delta.token_ids.empty()) {
      // Each token of this delta waited its share of the gap since the previous delivery.
      const double gap = secondsBetween(last_token_at_, now) / static_cast<double>(delta.token_ids.size());
      for (std::size_t i = 0; i < delta.token_ids.size(); ++i) fe_->metrics.itl.observe(gap);
    }
    last_token_at_ = now;
    completion_tokens_ += static_cast<std::int64_t>(delta.token_ids.size());
    std::string text = c.sanitizer.push(delta.text);
    if (c.parser) return parsedTokensLocked(c, text, delta);
    if (!stream_) {
      c.text += text;
      c.ids.insert(c.ids.end(), delta.token_ids.begin(), delta.token_ids.end());
      for (auto& lp : delta.logprobs) c.logprobs.push_back(std::move(lp));
      return;
    }
    beginStreamLocked();
    const bool has_payload =
        !text.empty() || (!delta.token_ids.empty() && (shape_.return_token_ids || shape_.logprobs));
    if (!has_payload) return;
    exchange_.write(deltaChunk(c.shape, text, delta.token_ids, delta.logprobs, c.cursor, promptIdsForChunk()));
  }

  /// Writes the request's log line: the client has its answer and the backend is done with it.
  ~RequestState() override {
    try {
      if (final_status_) logRequest(*final_status_);
    } catch (const std::exception& e) {
      log::error(kLog, "{}: the request's log line failed: {}", shape_.id, e.what());
    }
  }
  RequestState(const RequestState&) = delete;
  RequestState& operator=(const RequestState&) = delete;
  RequestState(RequestState&&) = delete;
  RequestState& operator=(RequestState&&) = delete;

  void choiceFinish(std::size_t i, const FinishEvent& finish) {
    const GenerationEnd& end = finish.end;
    std::optional<DeadlineScheduler::Id> cancel;
    {
      std::lock_guard lock(mu_);
      endChoiceLocked();
      if (done_) return;
      Choice& c = choices_[i];
      // The prompt's KV is prefilled once, with choice 0 (usage counts cached tokens once).
      if (i == 0) cached_tokens_ = end.cached_prompt_tokens;
      c.finish = end.reason;
      std::string tail = c.sanitizer.push(finish.text);
      tail += c.sanitizer.finish();
      if (c.parser) {
        parsedFinishLocked(c, tail, end.reason);
      } else if (stream_) {
        beginStreamLocked();
        if (!tail.empty()) exchange_.write(deltaChunk(c.shape, tail, {}, {}, c.cursor, promptIdsForChunk()));
        exchange_.write(finishChunk(c.shape, end.reason, promptIdsForChunk()));
      } else {
        c.text += tail;
      }
      if (++finished_ < choices_.size()) return;
      finish_reason_ = std::string(finishReasonName(*choices_[0].finish));
      settleLeaseLocked();  // before the answer: a client that saw it may send its next request at once
      // OpenAI's usage for n choices: the prompt once, the completion tokens of all choices.
      Usage usage{static_cast<std::int64_t>(prompt_ids_.size()), completion_tokens_, cached_tokens_};
      std::int64_t reasoning = 0;
      bool parses_reasoning = false;
      for (const Choice& each : choices_) {
        reasoning += each.reasoning_tokens;
        parses_reasoning = parses_reasoning || (each.parser && each.parser->parsesReasoning());
      }
      if (parses_reasoning) usage.reasoning_tokens = reasoning;
      // Booked before the answer is written: a client that has the answer sees it in /metrics.
      cancel = finishLocked(200);
      if (stream_) {
        beginStreamLocked();
        if (shape_.include_usage) exchange_.write(usageChunk(shape_, usage));
        exchange_.write(std::string(kSseDone));
        exchange_.end();
      } else {
        std::vector<ChoiceOutput> out;
        out.reserve(choices_.size());
        for (const Choice& each : choices_) {
          out.push_back(ChoiceOutput{each.text, &each.ids, &each.logprobs, *each.finish,
                                     each.parser ? &each.message_parts : nullptr});
        }
        http::Response r =
            http::Response::withBody(200, std::string(kJson), fullResponseChoices(shape_, out, usage, prompt_ids_));
        r.headers.push_back({"X-Request-Id", shape_.id});
        exchange_.respond(std::move(r));
      }
    }
    cancelDeadline(cancel);
  }

  /// Any choice's error fails the request; the other choices are aborted.
  void choiceError(std::size_t i, const Error& error) {
    std::optional<DeadlineScheduler::Id> cancel;
    {
      std::lock_guard lock(mu_);
      endChoiceLocked();
      if (done_) return;
      const ApiError api = fromBackendError(error);
      if (api.status >= 500) log::warn(kLog, "{}: generation of choice {} failed: {}", shape_.id, i, error.toString());
      backend_error_ = std::string(errorCodeName(error.code));
      cancel = failLocked(api);
    }
    cancelDeadline(cancel);
    abortBackend();  // the other choices (nothing when every choice has ended)
  }

  /// start() refused the request; the sink was never called.
  void startFailed(const Error& error) {
    std::optional<DeadlineScheduler::Id> cancel;
    {
      std::lock_guard lock(mu_);
      backend_ended_ = true;
      if (done_) return;
      const ApiError api = fromBackendError(error);
      if (api.status >= 500) log::warn(kLog, "{}: backend refused the request: {}", shape_.id, error.toString());
      backend_error_ = std::string(errorCodeName(error.code));
      cancel = failLocked(api);
    }
    cancelDeadline(cancel);
  }

  void setControl(std::unique_ptr<GenerationControl> control) {
    bool abort_now = false;
    {
      std::lock_guard lock(mu_);
      control_ = std::move(control);
      abort_now = done_ && !backend_ended_;
    }
    if (abort_now) control_->abort();
  }

  void setDeadline(DeadlineScheduler::Id id) {
    std::lock_guard lock(mu_);
    if (!done_) deadline_id_ = id;
  }

  /// The client disconnected: stop generating for it.
  void clientGone() {
    std::optional<DeadlineScheduler::Id> cancel;
    {
      std::lock_guard lock(mu_);
      if (done_) return;
      log::debug(kLog, "{}: client went away; aborting the generation", shape_.id);
      cancel = finishLocked(499);
    }
    cancelDeadline(cancel);
    abortBackend();
  }

  /// The request's deadline passed (its timer's callback: the deadline is no longer pending).
  void deadlinePassed() {
    {
      std::lock_guard lock(mu_);
      if (done_) return;
      deadline_id_.reset();
      log::warn(kLog, "{}: request deadline passed; aborting the generation", shape_.id);
      (void)failLocked(serverError(504, "timeout", "the request did not finish within the time limit"));
    }
    abortBackend();
  }

 private:
  void leaveQueue() { fe_->metrics.waiting.set(static_cast<double>(--fe_->waiting)); }

  /// One choice's output state (OpenAI `choices[i]`).
  struct Choice {
    ResponseShape shape;                       ///< the request's, with this choice's index
    std::unique_ptr<ChatOutputParser> parser;  ///< chat with tools or reasoning parsing; else null
    Utf8StreamSanitizer sanitizer;
    LogprobCursor cursor;
    std::string text;  ///< non-streaming: accumulated output
    std::vector<TokenId> ids;
    std::vector<LogprobEntry> logprobs;
    std::int64_t reasoning_tokens = 0;
    ChatMessageParts message_parts;  ///< non-streaming with a parser: reasoning and tool calls
    std::optional<FinishReason> finish;
  };

  /// A choice's terminal event came; the backend has ended once every choice's has.
  void endChoiceLocked() {
    if (++ended_ >= choices_.size()) backend_ended_ = true;
  }

  /// onTokens with a ChatOutputParser: content, reasoning and tool calls split out of the text.
  void parsedTokensLocked(Choice& c, const std::string& text, TokenDelta& delta) {
    const bool was_reasoning = c.parser->inReasoning();
    ChatOutputParser::Piece piece = c.parser->feed(text);
    // A stream event's tokens count as reasoning when the parser was inside the reasoning before
    // or after them, or they added to it: the tokens that open and close it count (exact when each
    // event carries one token, i.e. without MTP).
    if (was_reasoning || c.parser->inReasoning() || !piece.parts.reasoning.empty()) {
      c.reasoning_tokens += static_cast<std::int64_t>(delta.token_ids.size());
    }
    if (!stream_) {
      addPieceLocked(c, std::move(piece));
      c.ids.insert(c.ids.end(), delta.token_ids.begin(), delta.token_ids.end());
      for (auto& lp : delta.logprobs) c.logprobs.push_back(std::move(lp));
      return;
    }
    beginStreamLocked();
    const bool has_payload =
        !piece.empty() || (!delta.token_ids.empty() && (shape_.return_token_ids || shape_.logprobs));
    if (!has_payload) return;
    exchange_.write(chatPartsChunk(c.shape, piece.content, piece.parts, delta.token_ids, delta.logprobs, c.cursor));
  }

  static void addPieceLocked(Choice& c, ChatOutputParser::Piece piece) {
    c.text += piece.content;
    c.message_parts.reasoning += piece.parts.reasoning;
    for (auto& d : piece.parts.tool_calls) {
      if (d.index >= c.message_parts.tool_calls.size()) c.message_parts.tool_calls.resize(d.index + 1);
      structured::ToolCall& call = c.message_parts.tool_calls[d.index];
      if (!d.id.empty()) call.id = std::move(d.id);
      if (!d.name.empty()) call.name = std::move(d.name);
      call.arguments += d.arguments;
    }
  }

  /// A choice's finish with a ChatOutputParser: the parser's held-back text, then (streaming) the
  /// choice's finish chunk.
  void parsedFinishLocked(Choice& c, const std::string& tail, FinishReason reason) {
    ChatOutputParser::Piece piece = c.parser->feed(tail);
    ChatOutputParser::Piece last = c.parser->finish();
    piece.content += last.content;
    piece.parts.reasoning += last.parts.reasoning;
    for (auto& call : last.parts.tool_calls) piece.parts.tool_calls.push_back(std::move(call));
    const bool tool_calls = c.parser->sawToolCalls();
    if (stream_) {
      beginStreamLocked();
      if (!piece.empty()) exchange_.write(chatPartsChunk(c.shape, piece.content, piece.parts, {}, {}, c.cursor));
      exchange_.write(finishChunk(c.shape, reason, nullptr, tool_calls));
      return;
    }
    addPieceLocked(c, std::move(piece));
    c.message_parts.reasoning_parsed = c.parser->parsesReasoning();
  }

  void beginStreamLocked() {
    if (stream_started_) return;
    stream_started_ = true;
    exchange_.beginStream(200, {{"Content-Type", "text/event-stream; charset=utf-8"},
                                {"Cache-Control", "no-cache"},
                                {"X-Accel-Buffering", "no"},
                                {"X-Request-Id", shape_.id}});
    if (shape_.endpoint == Endpoint::ChatCompletions) {
      for (const Choice& c : choices_) exchange_.write(chatRoleChunk(c.shape, prompt_ids_));
      prompt_ids_sent_ = true;
    }
  }

  /// The prompt ids ride on the first completions chunk when the client asked for them.
  const std::vector<TokenId>* promptIdsForChunk() {
    if (prompt_ids_sent_ || !shape_.return_token_ids) return nullptr;
    prompt_ids_sent_ = true;
    return &prompt_ids_;
  }

  std::optional<DeadlineScheduler::Id> failLocked(const ApiError& api) {
    error_code_ = api.code;
    // Booked before the answer is written: a client that has the answer sees it in /metrics.
    const auto cancel = finishLocked(api.status);
    if (stream_started_) {
      // Headers are gone already: end the stream with an error event, as OpenAI does.
      exchange_.write(sseData(errorJson(api)));
      exchange_.write(std::string(kSseDone));
      exchange_.end();
    } else {
      exchange_.respond(fe_->errorResponse(api, shape_.id));
    }
    return cancel;
  }

  /// Books the outcome once; returns the deadline to cancel after unlocking.
  std::optional<DeadlineScheduler::Id> finishLocked(int status) {
    done_ = true;
    settleLeaseLocked();
    fe_->countRequest(endpoint_, status);
    if (!first_token_at_) leaveQueue();
    fe_->metrics.in_flight.set(static_cast<double>(--fe_->in_flight));
    fe_->metrics.generation_tokens.inc(static_cast<double>(completion_tokens_));
    if (status == 200) {
      const auto now = Clock::now();
      fe_->metrics.e2e.observe(secondsBetween(received_, now));
      if (first_token_at_ && completion_tokens_ > 1) {
        fe_->metrics.tpot.observe(secondsBetween(*first_token_at_, last_token_at_) /
                                  static_cast<double>(completion_tokens_ - 1));
      }
    }
    finished_at_ = Clock::now();
    final_status_ = status;
    endSpansLocked(status);
    auto id = deadline_id_;
    deadline_id_.reset();
    return id;
  }

  /// The request's one info line (docs/observability.md): ids, tokens, latencies, the phases,
  /// the workers and the outcome; the prompt only with router.log_prompts. Written once the
  /// backend let go of the request (its report is complete then), with the times of the answer.
  void logRequest(int status) {
    if (log::level() > log::Level::Info) return;
    const auto now = finished_at_;
    const auto ms = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    std::vector<log::Field> f;
    f.push_back({"id", shape_.id});
    f.push_back({"trace_id", span_.context().valid() ? span_.context().trace_id.hex() : std::string()});
    f.push_back({"model", fe_->served_model_name});
    f.push_back({"endpoint", endpoint_});
    f.push_back({"stream", stream_});
    f.push_back({"status", static_cast<std::int64_t>(status)});
    f.push_back({"outcome", std::string(status == 200 ? "ok" : status == 499 ? "client_gone" : "error")});
    if (!finish_reason_.empty()) f.push_back({"finish_reason", finish_reason_});
    if (!error_code_.empty()) f.push_back({"error_code", error_code_});
    if (!backend_error_.empty()) f.push_back({"backend_error", backend_error_});
    f.push_back({"prompt_tokens", static_cast<std::int64_t>(prompt_ids_.size())});
    f.push_back({"cached_tokens", cached_tokens_});
    f.push_back({"completion_tokens", completion_tokens_});
    f.push_back({"e2e_ms", ms(received_, now)});
    if (first_token_at_) f.push_back({"ttft_ms", ms(received_, *first_token_at_)});
    if (first_token_at_ && completion_tokens_ > 1) {
      f.push_back({"tpot_ms", ms(*first_token_at_, last_token_at_) / static_cast<double>(completion_tokens_ - 1)});
    }
    f.push_back({"validate_ms", log_.validate_ms});
    if (log_.template_ms) f.push_back({"template_ms", *log_.template_ms});
    f.push_back({"tokenize_ms", log_.tokenize_ms});
    const auto opt = [&f](const char* key, const std::optional<double>& v) {
      if (v) f.push_back({key, *v});
    };
    opt("route_ms", report_.route_ms);
    opt("decode_open_ms", report_.decode_open_ms);
    opt("prefill_ms", report_.prefill_ms);
    opt("prefill_queue_ms", report_.prefill_queue_ms);
    opt("prefill_compute_ms", report_.prefill_compute_ms);
    opt("prefill_transfer_ms", report_.prefill_transfer_ms);
    if (first_token_at_) f.push_back({"stream_ms", ms(*first_token_at_, now)});
    if (!report_.prefill_where.empty()) f.push_back({"prefill", report_.prefill_where});
    if (!report_.prefill_reason.empty()) f.push_back({"prefill_reason", report_.prefill_reason});
    if (!report_.prefill_worker.empty()) f.push_back({"prefill_worker", report_.prefill_worker});
    if (!report_.decode_worker.empty()) f.push_back({"decode_worker", report_.decode_worker});
    if (report_.prefill_attempts > 1) f.push_back({"prefill_attempts", report_.prefill_attempts});
    if (report_.decode_attempts > 1) f.push_back({"decode_attempts", report_.decode_attempts});
    if (log_.prompt) f.push_back({"prompt", *log_.prompt});
    log::write(log::Level::Info, kLog, "request", f);
  }

  /// Ends router.stream and router.request with the outcome.
  void endSpansLocked(int status) {
    stream_span_.end();
    span_.setAttribute("http.response.status_code", static_cast<std::int64_t>(status));
    span_.setAttribute("pd.completion_tokens", completion_tokens_);
    if (status >= 500) span_.setError(fmt::format("HTTP {}", status));
    span_.end();
  }

  /// Frees the key's concurrency slot and charges the tokens used (prompt + generated so far).
  void settleLeaseLocked() { lease_.finish(static_cast<std::int64_t>(prompt_ids_.size()) + completion_tokens_); }

  void cancelDeadline(std::optional<DeadlineScheduler::Id> id) {
    if (!id) return;
    if (auto scheduler = fe_->deadlines.lock()) scheduler->cancel(*id);
  }

  void abortBackend() {
    GenerationControl* control = nullptr;
    {
      std::lock_guard lock(mu_);
      if (backend_ended_) return;
      control = control_.get();  // stable once set; null until start() returned (setControl aborts then)
    }
    if (control != nullptr) control->abort();
  }

  const std::shared_ptr<FrontEnd> fe_;
  http::Exchange exchange_;
  const ResponseShape shape_;
  const bool stream_;
  const std::string endpoint_;
  const std::vector<TokenId> prompt_ids_;
  const Clock::time_point received_;

  std::mutex mu_;
  KeyLimiter::Lease lease_;  ///< the API key's slot and token reservation; settled when the client has its answer
  std::unique_ptr<GenerationControl> control_;
  std::optional<DeadlineScheduler::Id> deadline_id_;
  bool done_ = false;           ///< the client has its answer (or is gone); later events are dropped
  bool backend_ended_ = false;  ///< the backend delivered its terminal event
  bool stream_started_ = false;
  bool prompt_ids_sent_ = false;
  std::optional<Clock::time_point> first_token_at_;
  Clock::time_point last_token_at_;
  std::int64_t completion_tokens_ = 0;
  std::vector<Choice> choices_;      ///< OpenAI `n` of them; sized at construction
  std::size_t ended_ = 0;            ///< choices whose terminal event came
  std::size_t finished_ = 0;         ///< choices that finished (Stop or Length)
  std::optional<int> final_status_;  ///< the answer's status, once booked
  Clock::time_point finished_at_;    ///< when it was booked
  std::int64_t cached_tokens_ = 0;
  std::string finish_reason_;  ///< of a finished generation
  std::string error_code_;     ///< the client's error code (OpenAI's `code`) of a failed request
  std::string backend_error_;  ///< the backend's ErrorCode name of a failed generation
  GenerationReport report_;
  trace::Span span_;         ///< router.request: ends with the answer
  trace::Span stream_span_;  ///< router.stream: first token to the answer's end
  RequestLog log_;
};

/// Choice i's sink (n > 1): forwards its events to the request's state.
class ChoiceSink final : public TokenSink {
 public:
  ChoiceSink(std::shared_ptr<RequestState> state, std::size_t index) : state_(std::move(state)), index_(index) {}
  void onTokens(TokenDelta delta) override { state_->choiceTokens(index_, std::move(delta)); }
  void onFinish(FinishEvent finish) override { state_->choiceFinish(index_, finish); }
  void onError(Error error) override { state_->choiceError(index_, error); }
  void onReport(const GenerationReport& report) override {
    if (index_ == 0) state_->onReport(report);
  }

 private:
  const std::shared_ptr<RequestState> state_;
  const std::size_t index_;
};

std::string_view endpointLabel(Endpoint e) {
  return e == Endpoint::ChatCompletions ? "/v1/chat/completions" : "/v1/completions";
}

}  // namespace

class ApiServer::Impl {
 public:
  Impl(const ApiServerOptions& options, CompletionBackend& backend, const PromptRenderer& renderer,
       metrics::Registry& registry)
      : fe_(std::make_shared<FrontEnd>(options, backend, renderer, registry)) {}
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  Impl(Impl&&) = delete;
  Impl& operator=(Impl&&) = delete;
  ~Impl() {
    try {
      stop(std::chrono::milliseconds{0});
    } catch (const std::exception& e) {
      log::error(kLog, "stopping the API server failed: {}", e.what());
    }
  }

  Status startHttp(http::ServerOptions options, int cpu_threads, std::size_t cpu_queue, std::size_t cpu_inline_bytes) {
    if (cpu_threads < 1 || cpu_queue < 1) {
      return makeError(ErrorCode::InvalidArgument, "cpu_threads and cpu_queue must be at least 1");
    }
    cpu_ = std::make_unique<CpuPool>(cpu_threads, cpu_queue);
    cpu_inline_bytes_ = cpu_inline_bytes;
    // One io_context for the router: the backend's when it has one, else our own.
    if (!options.io) options.io = fe_->backend.ioThreads();
    if (!options.io) {
      PD_ASSIGN_OR_RETURN(own_io_, http::IoThreads::start(options.io_threads, std::string(kLog)));
      options.io = own_io_;
    }
    deadlines_ = std::make_shared<DeadlineScheduler>(options.io->executor());
    fe_->deadlines = deadlines_;
    metrics::Family<metrics::Counter>* requests = &fe_->metrics.requests;
    const auto retry_after = fe_->retry_after;
    // Errors the HTTP layer answers itself (malformed HTTP, unknown path, 413, ...) in OpenAI's shape.
    options.error_responder = [requests, retry_after](int status, std::string_view message) {
      requests->labels({"other", std::to_string(status)}).inc();
      ApiError e{status, status >= 500 ? "server_error" : "invalid_request_error", "", std::string(message)};
      if (status == 404) e.code = "not_found";
      if (status == 413) e.code = "request_too_large";
      http::Response r = http::Response::withBody(status, std::string(kJson), errorJson(e));
      if (status == 503) r.headers.push_back({"Retry-After", std::to_string(retry_after.count())});
      return r;
    };
    std::vector<http::Route> routes;
    routes.push_back({"POST", "/v1/chat/completions", [this](http::Request req, http::Exchange ex) {
                        handleCompletion(Endpoint::ChatCompletions, std::move(req), std::move(ex));
                      }});
    routes.push_back({"POST", "/v1/completions", [this](http::Request req, http::Exchange ex) {
                        handleCompletion(Endpoint::Completions, std::move(req), std::move(ex));
                      }});
    routes.push_back(
        {"GET", "/v1/models", [this](const http::Request& req, http::Exchange ex) { handleModels(req, ex); }});
    for (http::Route& r : statusPageRoutes()) routes.push_back(std::move(r));  // GET /, /status.js
    http::addProbeRoutes(routes, {.format = http::Probes::Format::Json,
                                  .not_ready = [this] { return fe_->backend.ready() ? "" : std::string("not ready"); },
                                  .metrics = [this] { return fe_->registry.render(); }});
    PD_ASSIGN_OR_RETURN(http_, http::Server::start(std::move(options), std::move(routes)));
    return okStatus();
  }

  std::uint16_t port() const { return http_->port(); }
  std::int64_t inFlight() const { return fe_->in_flight.load(); }

  void stop(std::chrono::milliseconds drain) {
    if (http_) http_->stop(drain);        // cuts remaining clients: their generations are aborted
    if (cpu_) cpu_->stop();               // no handler runs now: nothing is queued after this
    if (deadlines_) deadlines_->close();  // cancels the deadlines left; requests that still hold
    deadlines_.reset();                   // it touch no timer once the io threads are gone
    if (own_io_) own_io_->stop();
  }

 private:
  /// When a generation request arrived: for the metrics (steady) and for its spans (wall).
  struct Received {
    Clock::time_point steady;
    trace::TimePoint wall;
  };

  /// Who sent a request: the index of its API key (nullopt with authentication off).
  struct Caller {
    std::optional<std::size_t> key;
  };

  /// The caller, or nullopt after answering 401 when the request carries no accepted key.
  std::optional<Caller> authorize(const http::Request& req, http::Exchange& ex, std::string_view endpoint) {
    if (fe_->api_keys.empty()) return Caller{};
    const std::string_view auth = req.header("Authorization");
    if (!auth.empty()) {
      if (auto key = fe_->api_keys.findAuthorization(auth)) return Caller{key};
    }
    reject(
        ex, endpoint,
        ApiError{401, "invalid_request_error", "invalid_api_key",
                 auth.empty() ? "missing API key: send the header 'Authorization: Bearer <key>'" : "invalid API key"});
    return std::nullopt;
  }

  /// Answers 429 for a request its key's limits refused: OpenAI's rate-limit error ("requests" or
  /// "tokens", code rate_limit_exceeded) with a Retry-After of the seconds until the token window
  /// has room, the configured one for concurrency, and none when the request can never fit.
  void rejectLimited(http::Exchange& ex, std::string_view endpoint, const KeyLimiter::Admission& refused) {
    const bool concurrent = refused.refusal == KeyLimiter::Refusal::Concurrent;
    fe_->metrics.rate_limited.labels({concurrent ? "concurrent" : "tokens"}).inc();
    fe_->countRequest(endpoint, 429);
    http::Response r = fe_->errorResponse(
        ApiError{429, concurrent ? "requests" : "tokens", "rate_limit_exceeded", refused.message}, {});
    std::erase_if(r.headers, [](const http::Header& h) { return http::equalsIgnoreCase(h.name, "Retry-After"); });
    if (refused.refusal == KeyLimiter::Refusal::Tokens && refused.retry_after) {
      r.headers.push_back({"Retry-After", std::to_string(refused.retry_after->count())});
    } else if (concurrent) {
      r.headers.push_back({"Retry-After", std::to_string(fe_->retry_after.count())});
    }
    ex.respond(std::move(r));
  }

  void reject(http::Exchange& ex, std::string_view endpoint, const ApiError& e) {
    fe_->countRequest(endpoint, e.status);
    ex.respond(fe_->errorResponse(e, {}));
  }
  /// reject() of a request whose router.request span started; the span ends with the status.
  void reject(http::Exchange& ex, std::string_view endpoint, const ApiError& e, trace::Span& span) {
    span.setAttribute("http.response.status_code", static_cast<std::int64_t>(e.status));
    if (e.status >= 500) span.setError(e.code);
    span.end();
    reject(ex, endpoint, e);
  }

  void handleModels(const http::Request& req, http::Exchange& ex) {
    if (!authorize(req, ex, "/v1/models")) return;
    JsonWriter w;
    w.beginObject().key("object").string("list").key("data").beginArray().beginObject();
    w.key("id").string(fe_->served_model_name);
    w.key("object").string("model");
    w.key("created").number(fe_->started_at);
    w.key("owned_by").string("pdserve");
    w.key("max_model_len").number(fe_->max_model_len);
    // The token ids a prompt may hold, [0, vocab_size): what `pdserve bench serve` draws from.
    w.key("vocab_size").number(static_cast<std::int64_t>(fe_->renderer.vocabSize()));
    w.endObject().endArray().endObject();
    fe_->countRequest("/v1/models", 200);
    ex.respond(http::Response::withBody(200, std::string(kJson), w.take()));
  }

  /// The prompt as the request log shows it (router.log_prompts): chat messages as JSON, a completion's
  /// text, or its token ids.
  static std::string promptForLog(const CompletionParams& p) {
    if (p.endpoint == Endpoint::ChatCompletions) return p.conversation.messages_json;
    if (p.prompt_text) return *p.prompt_text;
    std::string ids;
    for (TokenId id : p.prompt_token_ids.value_or(std::vector<TokenId>{})) {
      if (!ids.empty()) ids += ',';
      ids += std::to_string(id);
    }
    return ids;
  }

  /// The prompt's token ids (and when a chat template was done; `parsed` otherwise), or the error to answer.
  Result<TimedPrompt> promptIds(const CompletionParams& p, trace::TimePoint parsed) {
    if (p.endpoint == Endpoint::ChatCompletions) return fe_->renderer.renderChatTimed(p.conversation);
    if (p.prompt_token_ids) return TimedPrompt{*p.prompt_token_ids, parsed};
    PD_ASSIGN_OR_RETURN(auto ids, fe_->renderer.tokenize(*p.prompt_text));
    return TimedPrompt{std::move(ids), parsed};
  }

  /// Checks a request's output constraint by compiling it (the workers compile the same text with
  /// the same options); sets its worker-API form. The error to answer, or nullopt.
  std::optional<ApiError> checkOutputControls(const CompletionParams& p, std::string& constraint, std::string& format) {
    if (!p.constraint.constrained()) return std::nullopt;
    const bool tool_calls = p.constraint.kind == structured::ResponseConstraint::Kind::ToolCalls;
    if (!fe_->grammars) {
      return invalidRequest(tool_calls ? "'tool_choice' required or a named function is not available on this server"
                                       : "'response_format' json_object / json_schema is not available on this server");
    }
    if (tool_calls && !fe_->tool_parser) {
      return invalidRequest(
          "'tool_choice' required or a named function needs a tool-call format (router.tool_parser is none)");
    }
    if (p.ignore_eos) return invalidRequest("'ignore_eos' cannot be combined with 'response_format' or 'tool_choice'");
    auto grammar = fe_->grammars->get(p.constraint);
    if (!grammar.ok()) {
      return invalidRequest(fmt::format("{}: {}", tool_calls ? "'tools'" : "'response_format.json_schema.schema'",
                                        grammar.error().message));
    }
    constraint = structured::encodeConstraint(p.constraint);
    format =
        std::string(structured::toolCallFormatName(fe_->tool_parser.value_or(structured::ToolCallFormat::DeepSeekV3)));
    return std::nullopt;
  }

  /// On an io thread: authorizes, then hands the request to the CPU pool (parsing, templating and
  /// tokenizing a large body must not hold an io thread); a full queue answers 503 + Retry-After.
  /// A body of at most cpu_inline_bytes is prepared right here: its work is linear in its size and
  /// takes microseconds, less than the two thread hand-offs the pool would add to its latency.
  void handleCompletion(Endpoint endpoint, http::Request req, http::Exchange ex) {
    const Received received{Clock::now(), trace::Clock::now()};
    const std::string_view label = endpointLabel(endpoint);
    const std::optional<Caller> caller = authorize(req, ex, label);
    if (!caller) return;
    if (req.body.size() <= cpu_inline_bytes_) return admitCompletion(endpoint, req, std::move(ex), received, *caller);
    const bool queued =
        cpu_->trySubmit([this, endpoint, req = std::move(req), ex, received, caller = *caller]() mutable {
          fe_->metrics.cpu_queue.set(static_cast<double>(cpu_->queued()));
          admitCompletion(endpoint, req, std::move(ex), received, caller);
        });
    if (!queued) {
      fe_->metrics.cpu_rejected.inc();
      return reject(
          ex, label,
          serverError(503, "service_unavailable", "the router is busy preparing other requests; retry later"));
    }
    fe_->metrics.cpu_queue.set(static_cast<double>(cpu_->queued()));
  }

  /// On a CPU thread (or an io thread for a small body): parses, renders and validates the request,
  /// then starts its generation. Its router.request span starts at `received`; the phases
  /// validate, template, tokenize and route follow one another without gaps (each starts where
  /// the previous ended), so with the backend's decode leg they tile the request.
  void admitCompletion(Endpoint endpoint, const http::Request& req, http::Exchange ex, Received received,
                       const Caller& caller) {
    const std::string_view label = endpointLabel(endpoint);
    if (ex.clientGone()) return fe_->countRequest(label, 499);  // hung up while queued: skip the work
    const trace::Tracer& tracer = fe_->tracer;
    trace::Span span = tracer.startFromHeader("router.request", req.header(trace::kTraceparentHeader),
                                              trace::SpanKind::Server, received.wall);
    span.setAttribute("http.route", std::string(label));

    auto parsed = parseCompletionRequest(endpoint, req.body);
    if (!parsed.ok()) return reject(ex, label, invalidRequest(parsed.error().message), span);
    CompletionParams p = std::move(parsed).value();
    if (p.n > fe_->max_n) {
      return reject(ex, label,
                    invalidRequest(fmt::format("'n' must be at most {} (router.max_n), not {}", fe_->max_n, p.n)),
                    span);
    }
    std::string g_constraint;
    std::string g_format;
    if (p.model != fe_->served_model_name) {
      return reject(ex, label,
                    ApiError{404, "invalid_request_error", "model_not_found",
                             "the requested model does not exist; GET /v1/models lists the served model", "model"},
                    span);
    }
    if (auto refused = checkOutputControls(p, g_constraint, g_format); refused) {
      return reject(ex, label, *refused, span);
    }
    const trace::TimePoint validated = trace::Clock::now();
    tracer.record(span.context(), "router.validate", received.wall, validated);

    auto prompt = promptIds(p, validated);
    if (!prompt.ok()) {
      if (prompt.error().code == ErrorCode::InvalidArgument) {
        return reject(ex, label, invalidRequest(prompt.error().message), span);
      }
      log::error(kLog, "rendering a prompt failed: {}", prompt.error().toString());
      return reject(ex, label, serverError(500, "internal_error", "the prompt could not be rendered"), span);
    }
    const trace::TimePoint templated = prompt->templated;
    if (endpoint == Endpoint::ChatCompletions) tracer.record(span.context(), "router.template", validated, templated);
    std::vector<TokenId> prompt_ids = std::move(prompt->ids);
    if (prompt_ids.empty()) return reject(ex, label, invalidRequest("the prompt is empty"), span);
    const std::size_t vocab = fe_->renderer.vocabSize();
    const auto outside = [vocab](TokenId id) { return id < 0 || static_cast<std::size_t>(id) >= vocab; };
    for (TokenId id : prompt_ids) {
      if (outside(id))
        return reject(ex, label, invalidRequest("'prompt' contains a token id outside the vocabulary"), span);
    }
    for (TokenId id : p.stop_token_ids) {
      if (outside(id))
        return reject(ex, label, invalidRequest("'stop_token_ids' contains an id outside the vocabulary"), span);
    }
    const auto prompt_len = static_cast<std::int64_t>(prompt_ids.size());
    const std::int64_t room = fe_->max_model_len - prompt_len;
    if (room < 1) {
      return reject(ex, label,
                    invalidRequest(fmt::format("the prompt has {} tokens, which leaves no room to generate within the "
                                               "model's context length of {} tokens",
                                               prompt_len, fe_->max_model_len),
                                   "context_length_exceeded"),
                    span);
    }
    std::int64_t max_tokens = 0;
    if (p.max_tokens) {
      if (*p.max_tokens > room) {
        return reject(ex, label,
                      invalidRequest(fmt::format("the prompt has {} tokens; with the requested max_tokens the request "
                                                 "exceeds the model's context length of {} tokens (at most {} more)",
                                                 prompt_len, fe_->max_model_len, room),
                                     "context_length_exceeded"),
                      span);
      }
      max_tokens = *p.max_tokens;
    } else {
      max_tokens = endpoint == Endpoint::Completions ? std::min(room, fe_->default_completion_max_tokens) : room;
    }

    const trace::TimePoint tokenized = trace::Clock::now();
    tracer.record(span.context(), "router.tokenize", templated, tokenized, {{"pd.prompt_tokens", prompt_len}});
    RequestLog request_log{msBetween(received.wall, validated), std::nullopt, msBetween(templated, tokenized),
                           std::nullopt};
    if (endpoint == Endpoint::ChatCompletions) request_log.template_ms = msBetween(validated, templated);
    if (fe_->log_prompts) request_log.prompt = promptForLog(p);

    if (!fe_->backend.ready()) {
      return reject(ex, label,
                    serverError(503, "service_unavailable", "no prefill and decode workers are ready; retry later"),
                    span);
    }
    KeyLimiter::Lease lease;
    if (caller.key) {
      KeyLimiter::Admission admission = fe_->key_limiter.admit(*caller.key, prompt_len + max_tokens);
      if (!admission.lease) {
        span.setAttribute("http.response.status_code", std::int64_t{429});
        span.end();
        return rejectLimited(ex, label, admission);
      }
      lease = std::move(*admission.lease);
    }
    if (fe_->waiting.fetch_add(1) >= fe_->max_queued_requests) {
      fe_->waiting.fetch_sub(1);
      lease.finish(0);  // refused before any work: nothing is charged
      return reject(
          ex, label,
          ApiError{429, "requests", "rate_limit_exceeded", "too many requests are waiting for a worker; retry later"},
          span);
    }
    fe_->metrics.waiting.set(static_cast<double>(fe_->waiting.load()));
    fe_->metrics.in_flight.set(static_cast<double>(++fe_->in_flight));
    fe_->metrics.prompt_tokens.inc(static_cast<double>(prompt_len));

    // 128 bits from the CSPRNG: an id names a request to the workers (abort), so it must not be guessable.
    const std::string id =
        fmt::format("{}-{}", endpoint == Endpoint::ChatCompletions ? "chatcmpl" : "cmpl", crypto::randomHex128());
    GenerationRequest g;
    g.request_id = id;
    g.prompt_token_ids = prompt_ids;
    g.max_tokens = max_tokens;
    g.sampling = p.sampling;
    g.seed = p.seed;
    g.logprobs = p.logprobs;
    g.stop = std::move(p.stop);
    g.stop_token_ids = std::move(p.stop_token_ids);
    g.ignore_eos = p.ignore_eos;
    g.skip_special_tokens = p.skip_special_tokens;
    g.include_stop_str_in_output = p.include_stop_str_in_output;
    g.deadline = received.steady + fe_->request_timeout;
    g.trace = span.context();
    g.handed_at = tokenized;
    span.setAttribute("pd.request_id", id);
    span.setAttribute("pd.prompt_tokens", prompt_len);
    // {:?} escapes: the client's strings cannot forge log lines.
    if (!p.user.empty()) log::info(kLog, "{}: user {:?}", id, p.user);
    if (!p.safety_identifier.empty()) log::info(kLog, "{}: safety_identifier {:?}", id, p.safety_identifier);
    g.constraint = std::move(g_constraint);
    g.tool_call_format = std::move(g_format);

    ResponseShape shape{endpoint,           id,        unixSeconds(), fe_->served_model_name, p.include_usage,
                        p.return_token_ids, p.logprobs};
    // Each choice parses its own output (tool calls, reasoning) with a parser of its own.
    std::vector<std::unique_ptr<ChatOutputParser>> parsers(static_cast<std::size_t>(p.n));
    const bool tools_parsed = p.parse_tool_calls && fe_->tool_parser.has_value();
    // A constrained answer is the value itself (JSON, or the tool-call section): no reasoning in it.
    const bool reasoning = fe_->reasoning_parser && !p.constraint.constrained();
    if (endpoint == Endpoint::ChatCompletions && (tools_parsed || reasoning)) {
      for (std::size_t i = 0; i < parsers.size(); ++i) {
        // Tool call ids stay unique across choices.
        const std::string prefix =
            "call_" + id.substr(id.find('-') + 1, 24) + (i > 0 ? fmt::format("c{}", i) : "") + "_";
        parsers[i] = std::make_unique<ChatOutputParser>(tools_parsed ? fe_->tool_parser : std::nullopt, reasoning,
                                                        fe_->prompt_opens_think, prefix);
      }
    }
    auto state = std::make_shared<RequestState>(fe_, ex, std::move(shape), p.stream, std::string(label),
                                                std::move(prompt_ids), received.steady, std::move(lease),
                                                std::move(span), std::move(request_log), std::move(parsers));
    const std::weak_ptr<RequestState> weak = state;
    ex.onClientGone([weak] {
      if (auto s = weak.lock()) s->clientGone();
    });
    if (auto scheduler = fe_->deadlines.lock()) {
      state->setDeadline(scheduler->schedule(g.deadline, [weak] {
        if (auto s = weak.lock()) s->deadlinePassed();
      }));
    }
    Result<std::unique_ptr<GenerationControl>> started = makeError(ErrorCode::Internal, "not started");
    if (p.n == 1) {
      started = fe_->backend.start(std::move(g), state);
    } else {
      std::vector<std::shared_ptr<TokenSink>> sinks;
      sinks.reserve(static_cast<std::size_t>(p.n));
      for (std::size_t i = 0; i < static_cast<std::size_t>(p.n); ++i) {
        sinks.push_back(std::make_shared<ChoiceSink>(state, i));
      }
      started = fe_->backend.startChoices(std::move(g), std::move(sinks));
    }
    if (!started.ok()) return state->startFailed(started.error());
    state->setControl(std::move(started).value());
  }

  std::shared_ptr<FrontEnd> fe_;
  std::shared_ptr<http::IoThreads> own_io_;       // when the backend has no io threads to share
  std::shared_ptr<DeadlineScheduler> deadlines_;  // shared only so requests can hold it weakly
  std::unique_ptr<CpuPool> cpu_;                  // before http_: handlers queue on it
  std::size_t cpu_inline_bytes_ = 0;              // set before http_ starts
  std::unique_ptr<http::Server> http_;
};

Result<ApiServerOptions> apiServerOptionsFromConfig(const RouterConfig& config, std::int64_t max_model_len) {
  ApiServerOptions o;
  o.http.host = config.host;
  o.http.port = static_cast<std::uint16_t>(config.port);
  o.http.io_threads = static_cast<int>(config.io_threads);
  o.cpu_threads = static_cast<int>(config.cpu_threads);
  o.cpu_queue = static_cast<std::size_t>(config.cpu_queue);
  o.cpu_inline_bytes = static_cast<std::size_t>(config.cpu_inline_bytes);
  o.http.max_body_bytes = static_cast<std::size_t>(config.max_body_bytes);
  o.served_model_name = config.served_model_name;
  o.max_model_len = max_model_len;
  o.max_queued_requests = config.max_queued_requests;
  o.max_n = config.max_n;
  o.request_timeout = std::chrono::milliseconds(config.request_timeout_ms);
  o.retry_after = std::chrono::seconds(config.retry_after_s);
  o.log_prompts = config.log_prompts;
  if (!config.api_keys_file.empty()) {
    PD_ASSIGN_OR_RETURN(o.api_keys, ApiKeySet::fromFile(config.api_keys_file));
  }
  return o;
}

Result<std::unique_ptr<ApiServer>> ApiServer::start(ApiServerOptions options, CompletionBackend& backend,
                                                    const PromptRenderer& renderer, metrics::Registry& registry) {
  if (options.max_model_len < 2) return makeError(ErrorCode::InvalidArgument, "max_model_len must be at least 2");
  const std::string host = options.http.host;
  auto impl = std::make_unique<Impl>(options, backend, renderer, registry);
  PD_TRY(impl->startHttp(std::move(options.http), options.cpu_threads, options.cpu_queue, options.cpu_inline_bytes));
  log::info(kLog, "OpenAI API for model '{}' on http://{}:{}", options.served_model_name, host, impl->port());
  return std::unique_ptr<ApiServer>(new ApiServer(std::move(impl)));
}

ApiServer::ApiServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ApiServer::~ApiServer() = default;
std::uint16_t ApiServer::port() const {
  return impl_->port();
}
std::int64_t ApiServer::inFlight() const {
  return impl_->inFlight();
}
void ApiServer::stop(std::chrono::milliseconds drain) {
  impl_->stop(drain);
}

}  // namespace pd::router
