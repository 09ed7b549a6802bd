#pragma once
/// The seam between the OpenAI front end and whatever generates tokens. Today tests plug in a
/// scripted fake (tests/fakes/fake_completion_backend.h); the P/D orchestrator (worker registry,
/// decode stream + prefill submission, retries) will implement it next.
///
/// A generation: the front end validates and tokenizes a request, then calls start() with a
/// GenerationRequest and a TokenSink. The backend streams TokenDelta events to the sink and ends
/// with exactly one terminal event. The backend owns detokenization and stop handling (it has the
/// tokenizer and sees token boundaries): the text it emits already ends before a stop string.
///
/// Errors the backend reports map to HTTP statuses (docs/api.md):
///   InvalidArgument, ResourceExhausted, Unsupported -> 400 (the request can never be served)
///   Overloaded                                      -> 503 + Retry-After (no pool can take it now)
///   PeerFailed, Corrupt, Io                         -> 502 (a worker failed, after retries)
///   Timeout                                         -> 504 (a worker did not answer in time)
///   Cancelled                                       -> (the client is gone; nothing is sent)
///   anything else                                   -> 500
/// Before the first token these become the response status; after it, an error event ends the
/// stream. The front end's own queue limit answers 429 before start() is called.
///
/// Retries are the backend's business; it counts them on the shared metrics registry as
/// `pdserve_router_retries_total{leg="prefill"|"decode"}` (the front end registers that family).

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pd/common/generation.h"
#include "pd/common/result.h"
#include "pd/trace/trace_context.h"

namespace pd::http {
class IoThreads;
}  // namespace pd::http

namespace pd::router {

// The generation vocabulary (pd/common/generation.h): TokenId, SamplingParams, SampledToken,
// TokenLogprob, FinishReason, GenerationEnd. Names are used unqualified in pd::router.

/// The OpenAI API's sampling defaults (temperature 1), which differ from the model's (greedy).
[[nodiscard]] inline SamplingParams openAiSamplingDefaults() {
  SamplingParams p;
  p.temperature = 1.0;
  return p;
}

struct GenerationRequest {
  std::string request_id;  ///< unique per request ("chatcmpl-..." / "cmpl-..."); for logs and workers
  std::vector<TokenId> prompt_token_ids;
  std::int64_t max_tokens = 16;  ///< >= 1; prompt + max_tokens fits the model's context
  /// What both workers sample with. `sampling.seed` is ignored: `seed` below decides it.
  /// `sampling.top_logprobs`: alternatives per token when `logprobs` is on.
  SamplingParams sampling = openAiSamplingDefaults();
  std::optional<std::int64_t> seed;         ///< the client's seed; unset: the backend picks a random one
  bool logprobs = false;                    ///< report each token's logprob (and top_logprobs alternatives)
  std::vector<std::string> stop;            ///< stop strings; the returned text ends before the match
  std::vector<TokenId> stop_token_ids;      ///< extra end tokens (besides the model's EOS)
  bool ignore_eos = false;                  ///< keep going past EOS (benchmarks)
  bool skip_special_tokens = true;          ///< special tokens add no text (logprob entries keep theirs)
  bool include_stop_str_in_output = false;  ///< the text ends after the matched stop string, not before
  /// The output constraint both workers sample under (worker_api::DecodeOpen::constraint:
  /// pd::structured::encodeConstraint's text); empty: free text.
  std::string constraint;
  std::string tool_call_format;  ///< of a tool-call constraint ("deepseek_v3" / "deepseek_v31")
  /// The front end aborts the generation at this time; the backend should give up before it.
  std::chrono::steady_clock::time_point deadline;
  /// The front end's `router.request` span (docs/observability.md): the backend's spans are its
  /// children, and the workers' calls carry their traceparent. Invalid: nothing to continue.
  trace::SpanContext trace;
  /// When the front end handed the request to the backend (wall clock: where `router.route` starts).
  std::chrono::system_clock::time_point handed_at;
};

/// One generated token's logprob as the client sees it: the vocabulary's SampledToken plus the
/// text of the token and of each alternative (raw bytes; the front end sanitizes), which only the
/// backend's tokenizer knows.
struct LogprobEntry {
  SampledToken sampled;
  std::string text;                   ///< of sampled.token
  std::vector<std::string> top_text;  ///< of each sampled.top entry, in order
};

/// New tokens. `text` is what they add to the output (may be empty while a multi-byte character
/// or a possible stop-string prefix is held back). Several tokens may come at once (MTP).
struct TokenDelta {
  std::vector<TokenId> token_ids;
  std::string text;
  std::vector<LogprobEntry> logprobs;  ///< one per token id when logprobs were requested
};

/// The end of a generation as the sink sees it. `end.reason` is Stop or Length.
struct FinishEvent {
  GenerationEnd end;
  std::string text;  ///< any held-back text released at the end
};

/// What the backend learned about one generation, for the front end's per-request log line
/// (docs/observability.md). Times in milliseconds; a phase that did not happen stays nullopt.
struct GenerationReport {
  std::string decode_worker;   ///< host:port of the last decode attempt; empty when none was picked
  std::string prefill_worker;  ///< host:port of the last prefill attempt; empty when none was sent
  std::int64_t decode_attempts = 0;
  std::int64_t prefill_attempts = 0;
  /// Where the last attempt's prompt was prefilled: "remote" (a prefill worker) or "local" (the
  /// decode worker itself), and why ("short_prompt", "long_prompt", "disabled"); empty: nowhere.
  std::string prefill_where;
  std::string prefill_reason;
  std::optional<double> route_ms;          ///< handed over -> the first decode open sent
  std::optional<double> decode_open_ms;    ///< the last attempt's open sent -> its KV descriptor
  std::optional<double> prefill_ms;        ///< the answered prefill's submit -> answer
  std::optional<double> prefill_queue_ms;  ///< the prefill worker's own figures (PrefillOutcome)
  std::optional<double> prefill_compute_ms;
  std::optional<double> prefill_transfer_ms;
};

/// Receives one generation's events.
///
/// Thread rules: the backend calls a sink from any thread but serially (never two calls at once
/// for one generation); zero or more onTokens(), then exactly one onFinish() or onError(), then
/// nothing but at most one onReport(). Calls may come before start() returns. Implementations
/// must not block.
class TokenSink {
 public:
  TokenSink() = default;
  virtual ~TokenSink() = default;
  TokenSink(const TokenSink&) = delete;
  TokenSink& operator=(const TokenSink&) = delete;
  TokenSink(TokenSink&&) = delete;
  TokenSink& operator=(TokenSink&&) = delete;
  virtual void onTokens(TokenDelta delta) = 0;
  virtual void onFinish(FinishEvent finish) = 0;
  virtual void onError(Error error) = 0;
  /// The generation's report, at most once, when the backend is done with every leg: just before
  /// the terminal event, or after it (a prefill answer may come after the last token). Never
  /// concurrently with another call. Ignored by default.
  virtual void onReport(const GenerationReport& report) { (void)report; }
};

/// Control of one running generation.
/// Thread rules: abort() is thread-safe, idempotent and non-blocking; it may be called before
/// or after the terminal event. Destroying the control does not abort.
class GenerationControl {
 public:
  GenerationControl() = default;
  virtual ~GenerationControl() = default;
  GenerationControl(const GenerationControl&) = delete;
  GenerationControl& operator=(const GenerationControl&) = delete;
  GenerationControl(GenerationControl&&) = delete;
  GenerationControl& operator=(GenerationControl&&) = delete;
  /// Stops the generation and frees its resources on every worker; the sink then gets its
  /// terminal event (normally onError(Cancelled)) if it has not had it yet.
  virtual void abort() = 0;
};

/// Something that turns token ids into more token ids.
/// Thread rules: thread-safe; start() and ready() are called from the HTTP io threads or the
/// front end's CPU pool, and must not block. The backend outlives the front end and joins its threads before it is
/// destroyed.
class CompletionBackend {
 public:
  CompletionBackend() = default;
  virtual ~CompletionBackend() = default;
  CompletionBackend(const CompletionBackend&) = delete;
  CompletionBackend& operator=(const CompletionBackend&) = delete;
  CompletionBackend(CompletionBackend&&) = delete;
  CompletionBackend& operator=(CompletionBackend&&) = delete;

  /// Begins a generation. On success the sink gets its events as described above (the backend
  /// keeps `sink` alive until its terminal event). On error the sink is never called; the error
  /// maps to a status as in the file comment.
  [[nodiscard]] virtual Result<std::unique_ptr<GenerationControl>> start(GenerationRequest request,
                                                                         std::shared_ptr<TokenSink> sink) = 0;
  /// Begins a generation of sinks.size() choices (OpenAI `n`, 1..pd::kMaxChoices): choice i's
  /// events go to sinks[i], each with the TokenSink contract of its own, and choice i samples with
  /// seed pd::choiceSeed(seed, i) — `request.seed`, or one seed the backend picks for all — so
  /// choice 0 is the n = 1 answer. The control aborts every choice. On error no sink is called
  /// (the default's choices started before the failing one end with onError(Cancelled)). The
  /// default starts each choice as a generation of its own (start(), one prefill each); the P/D
  /// backend shares one prefill and the prompt's KV blocks (docs/kv-memory.md, "Choices").
  [[nodiscard]] virtual Result<std::unique_ptr<GenerationControl>> startChoices(
      GenerationRequest request, std::vector<std::shared_ptr<TokenSink>> sinks);
  /// True when a request could be served now (at least one ready prefill and decode worker);
  /// drives /ready. A request that arrives while false gets 503.
  [[nodiscard]] virtual bool ready() const = 0;
  /// The io threads the backend runs on, when it has any: the front end then serves HTTP on the
  /// same threads (one io_context for the router). Null (the default): the front end starts its
  /// own.
  [[nodiscard]] virtual std::shared_ptr<http::IoThreads> ioThreads() const { return nullptr; }
};

}  // namespace pd::router
