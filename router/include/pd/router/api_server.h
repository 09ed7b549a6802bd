#pragma once
/// The OpenAI-compatible HTTP front end (docs/api.md): POST /v1/chat/completions and
/// /v1/completions (streaming and not), GET /v1/models, the probes /health and /ready, and
/// /metrics. It validates and tokenizes requests (PromptRenderer), hands them to a
/// CompletionBackend, and turns the backend's token events into OpenAI responses or
/// server-sent events. A client that disconnects aborts its generation; every request has a
/// deadline; a bounded number of requests may wait for their first token (429 beyond it).
///
/// Errors: start() fails with Io / InvalidArgument when the HTTP server cannot bind.
///
/// Threads: HTTP is served on the backend's io threads (CompletionBackend::ioThreads(); the
/// router has one io_context for its server and its calls to the workers), or on io threads of
/// its own when the backend has none. Handlers only authorize and hand a generation request larger
/// than `cpu_inline_bytes` to a bounded CPU pool (`cpu_threads`), which parses the body, renders
/// the chat template, tokenizes, validates and starts the generation; a full pool queue
/// (`cpu_queue`) answers 503 with Retry-After. Small bodies are prepared on the io thread. Request deadlines are asio
/// timers on the io_context (DeadlineScheduler).
///
/// Thread rules: start() and stop() from one control thread (main), never an io thread. The
/// backend, the renderer and the registry must outlive the ApiServer and every generation it
/// started (the backend waits for its generations in its destructor, after the ApiServer is
/// stopped).

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "pd/common/http_server.h"
#include "pd/common/metrics.h"
#include "pd/common/result.h"
#include "pd/router/api_keys.h"
#include "pd/router/completion_backend.h"
#include "pd/router/prompt_renderer.h"
#include "pd/router/router_config.h"
#include "pd/structured/response_constraint.h"
#include "pd/tokenizer/tokenizer.h"
#include "pd/trace/tracer.h"

namespace pd::router {

struct ApiServerOptions {
  /// host, port, body limit, HTTP deadlines; io_threads only when neither `http.io` nor the
  /// backend gives io threads to share
  http::ServerOptions http;
  std::string served_model_name = "pdserve-default";
  std::int64_t max_model_len = 4096;  ///< the context: prompt + max_tokens must fit
  /// /v1/completions without max_tokens generates this many (OpenAI's legacy default);
  /// chat without it may use the rest of the context.
  std::int64_t default_completion_max_tokens = 16;
  /// Requests admitted but still waiting for their first token; more get 429.
  std::int64_t max_queued_requests = 256;
  /// Most choices (OpenAI `n`) one request may ask for; more is a 400 naming this cap.
  std::int64_t max_n = 16;
  std::chrono::milliseconds request_timeout{600000};
  std::chrono::seconds retry_after{1};  ///< the Retry-After of 429 and 503
  ApiKeySet api_keys;                   ///< empty: no authentication
  /// Threads that parse, template and tokenize requests, off the io threads.
  int cpu_threads = 2;
  /// Requests waiting for a CPU thread; more are refused with 503 + Retry-After.
  std::size_t cpu_queue = 1024;
  /// A body of at most this many bytes is prepared on its io thread (microseconds of work, less
  /// than the pool's two thread hand-offs); 0: every request goes through the pool.
  std::size_t cpu_inline_bytes = 4096;
  /// Records the router's spans (docs/observability.md); null: tracing off (a client's
  /// traceparent still reaches the workers). Must outlive the ApiServer and its generations.
  const trace::Tracer* tracer = nullptr;
  /// The per-request log line carries the prompt (chat messages as JSON, a completion's text or
  /// ids). Off by default: prompts are the users' data.
  bool log_prompts = false;
  /// Output constraints (docs/api.md, "Structured outputs"): each request's `response_format` /
  /// `tool_choice` constraint is compiled here first, so an unsupported schema feature is a 400
  /// naming it before any worker sees it. Null: such requests are refused with 400.
  std::shared_ptr<structured::GrammarCache> grammars;
  /// The tool-call format parsed out of chat answers (and that `tool_choice` required / named
  /// constrains to); nullopt: tool calls are not parsed and required / named are refused.
  std::optional<structured::ToolCallFormat> tool_parser;
  /// Split R1 reasoning (`<think>…</think>`) out of chat answers into reasoning_content.
  bool reasoning_parser = false;
  /// The chat template's generation prompt already opens `<think>` (R1).
  bool prompt_opens_think = false;
};

/// Sets the output options above from router.tool_parser / router.reasoning_parser ("auto" reads
/// the chat template) and builds the grammar cache over `tokenizer`'s vocabulary (masks sized for
/// `model_vocab_size`). InvalidArgument for an unknown option value; a vocabulary that cannot be
/// built is logged and leaves constraints off.
[[nodiscard]] Status configureOutput(ApiServerOptions& options, const RouterConfig& config,
                                     const tokenizer::Tokenizer& tokenizer, std::size_t model_vocab_size);

/// Options from the router's config section; reads the API key file if one is set.
/// `max_model_len` comes from the model's config.
[[nodiscard]] Result<ApiServerOptions> apiServerOptionsFromConfig(const RouterConfig& config,
                                                                  std::int64_t max_model_len);

class ApiServer {
 public:
  [[nodiscard]] static Result<std::unique_ptr<ApiServer>> start(ApiServerOptions options, CompletionBackend& backend,
                                                                const PromptRenderer& renderer,
                                                                metrics::Registry& registry);
  ApiServer(const ApiServer&) = delete;
  ApiServer& operator=(const ApiServer&) = delete;
  ApiServer(ApiServer&&) = delete;
  ApiServer& operator=(ApiServer&&) = delete;
  /// stop() with no drain time if not called yet.
  ~ApiServer();

  [[nodiscard]] std::uint16_t port() const;
  /// Requests being served right now (admitted and not yet answered in full).
  [[nodiscard]] std::int64_t inFlight() const;
  /// Stops accepting, lets in-flight requests finish for up to `drain`, then cuts the rest
  /// (aborting their generations). Idempotent.
  void stop(std::chrono::milliseconds drain = std::chrono::milliseconds{0});

  class Impl;

 private:
  explicit ApiServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pd::router
