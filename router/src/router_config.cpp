#include "pd/router/router_config.h"

namespace pd::router {

void registerOptions(config::OptionSet& set, RouterConfig& cfg) {
  set.add("host", &cfg.host, "address the OpenAI-compatible HTTP server binds")
      .add("port", &cfg.port, "HTTP port (0 = any free port, printed at startup)", 0, 65535)
      .add("io_threads", &cfg.io_threads, "io_context threads shared by the HTTP server and the calls to the workers",
           1, 256)
      .add("cpu_threads", &cfg.cpu_threads, "threads that parse, template and tokenize requests (off the io threads)",
           1, 256)
      .add("cpu_queue", &cfg.cpu_queue, "requests waiting for a CPU thread; more are refused with 503 and Retry-After",
           1, 1 << 20)
      .add("cpu_inline_bytes", &cfg.cpu_inline_bytes,
           "request bodies up to this size are prepared on the io thread (0: all go to the CPU threads)", 0, 1 << 20)
      .add("max_body_bytes", &cfg.max_body_bytes, "largest accepted request body; larger is 413", 1024, 1LL << 30)
      .add("max_queued_requests", &cfg.max_queued_requests, "requests waiting for a worker before 429", 1, 1 << 20)
      .add("request_timeout_ms", &cfg.request_timeout_ms, "end-to-end deadline of one request", 100, 86400000)
      .add("log_prompts", &cfg.log_prompts,
           "the per-request log line includes the prompt (chat messages, text or ids); off: never")
      .add("api_keys_file", &cfg.api_keys_file,
           "file of accepted Bearer keys, one per line, each optionally followed by max_concurrent=N "
           "tokens_per_minute=N (empty: no auth)")
      .add("served_model_name", &cfg.served_model_name, "model name reported by /v1/models and required in requests")
      .add("retry_after_s", &cfg.retry_after_s, "Retry-After seconds sent with 429 and 503 answers", 1, 3600)
      .add("drain_timeout_ms", &cfg.drain_timeout_ms, "on SIGTERM, how long in-flight requests may finish", 0, 86400000)
      .add("prefill_workers", &cfg.prefill_workers, "static prefill workers, host:port each")
      .add("decode_workers", &cfg.decode_workers, "static decode workers, host:port each")
      .add("prefill_service", &cfg.prefill_service, "DNS name:port whose every address is a prefill worker")
      .add("decode_service", &cfg.decode_service, "DNS name:port whose every address is a decode worker")
      .add("discovery_interval_ms", &cfg.discovery_interval_ms, "how often the service names are re-resolved", 100,
           3600000)
      .add("health_interval_ms", &cfg.health_interval_ms, "how often each worker's status is polled", 10, 600000)
      .add("health_timeout_ms", &cfg.health_timeout_ms, "deadline of one status poll", 10, 600000)
      .add("health_failures", &cfg.health_failures, "failed polls in a row that take a worker out of rotation", 1, 1000)
      .add("model_hash", &cfg.model_hash,
           "model_hash every worker must report (empty: the first one a ready worker reports)")
      .add("prefill_policy", &cfg.prefill_policy,
           "how a prefill worker is chosen (docs/routing.md); auto: cache_aware with more than one prefill worker, "
           "least_queued_tokens otherwise",
           {"auto", "cache_aware", "power_of_two", "least_queued_tokens", "round_robin"})
      .add("kv_events_interval_ms", &cfg.kv_events_interval_ms,
           "cache_aware: how often each prefill worker's KV events (blocks stored and evicted) are read", 1, 600000)
      .add("kv_index_max_blocks", &cfg.kv_index_max_blocks,
           "cache_aware: most prefix-cache blocks indexed per prefill worker (more: the worker is not indexed)", 1,
           1LL << 24)
      .add("cache_aware_balance_abs", &cfg.cache_aware_balance_abs,
           "cache_aware: load gap (requests) beyond which the least loaded worker is taken, with the ratio", 0, 1 << 20)
      .add("cache_aware_balance_rel", &cfg.cache_aware_balance_rel,
           "cache_aware: load ratio beyond which the least loaded worker is taken, with the gap", 1.0, 1e6)
      .add("decode_affinity_entries", &cfg.decode_affinity_entries,
           "conversations whose decode worker the router remembers (a later turn prefers it while it has room)", 1,
           1 << 24)
      .add("prefill_retries", &cfg.prefill_retries, "retries of a failed prefill on another prefill worker", 0, 16)
      .add("decode_retries", &cfg.decode_retries,
           "retries of a request on another decode worker while no token reached the client", 0, 16)
      .add("remote_prefill_min_tokens", &cfg.remote_prefill_min_tokens,
           "prompts shorter than this are prefilled by their decode worker itself, without a prefill worker or a "
           "KV transfer (0 = every prompt goes to a prefill worker)",
           0, 1 << 24)
      .add("max_resumes", &cfg.max_resumes,
           "resumes of a generation whose decode leg failed without a finish (worker lost or drained, stalled): "
           "re-prefilled with the tokens so far on a decode worker with room (preemptions are resumed until the "
           "deadline)",
           0, 16)
      .add("max_n", &cfg.max_n,
           "most choices (OpenAI n) one request may ask for; more is a 400 naming this cap (the choices share one "
           "prefill and the prompt's KV blocks)",
           1, 128)
      .add("decode_open_timeout_ms", &cfg.decode_open_timeout_ms, "deadline for a decode worker's KV descriptor", 10,
           600000)
      .add("kv_timeout_ms", &cfg.kv_timeout_ms, "how long a decode worker waits for the prefilled KV (all attempts)",
           10, 3600000)
      .add("prefill_timeout_ms", &cfg.prefill_timeout_ms, "deadline of one prefill attempt", 10, 3600000)
      .add("stream_stall_timeout_ms", &cfg.stream_stall_timeout_ms,
           "longest silence of a decode stream once its tokens flow", 10, 3600000)
      .add("abort_timeout_ms", &cfg.abort_timeout_ms, "deadline of the abort/cancel calls to workers", 10, 60000)
      .add("max_generations", &cfg.max_generations, "generations running at once; more are refused (503)", 1, 1 << 20)
      .add("pool_idle_ms", &cfg.pool_idle_ms,
           "a pooled connection to a worker idle this long is closed (keep it below the workers' idle timeout)", 1,
           3600000)
      .add("tool_parser", &cfg.tool_parser,
           "tool-call format read out of chat answers and enforced by tool_choice required / named (auto: from the "
           "chat template; none: tool calls stay in content)",
           {"auto", "deepseek_v3", "deepseek_v31", "none"})
      .add("reasoning_parser", &cfg.reasoning_parser,
           "split <think>...</think> into reasoning_content (auto: when the chat template uses <think>)",
           {"auto", "deepseek_r1", "none"});
}

std::string resolvePrefillPolicy(const RouterConfig& cfg) {
  if (cfg.prefill_policy != "auto") return cfg.prefill_policy;
  return cfg.prefill_workers.size() > 1 || !cfg.prefill_service.empty() ? "cache_aware" : "least_queued_tokens";
}

}  // namespace pd::router
